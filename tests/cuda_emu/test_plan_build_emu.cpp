// test_plan_build_emu.cpp: runs the device build of a single-rank plan's step tables
// (backends/cuda/plan_kernels.cuh, the stages that cuda_plan_build.cu launches) on the CPU, in the
// emulator of cuda_emu.h, against the host: the plan of mtrain_plan_create (cpu-ref context, one
// rank) packed by cuda_step_tables_pack. Every region must be equal entry for entry (head_meta
// through the arrays it points at), the bar tiles past the real ones must be empty padding, the
// pairs must be the plan's, and nothing may be written past the used part of any region (canary
// bytes) or past the buffer. Random packed batches of 1 to 6 sequences: GQA (group 1, 2, 4, 8),
// G in {16, 32, 64, 128}, lengths not multiples of G and below G, heads with no verticals, with
// only diagonal 0, all diagonals, every other diagonal, verticals in block 0, in the last partial
// block, in diagonal blocks, capacities equal to the true maxima or larger, grid-stride launches
// capped at a few CTAs (so that they loop), sequences of more than 2048 blocks (prefix sums over
// several chunks); patterns that break the contract (counts over the capacities, unsorted or
// out-of-range entries): the tables of the cut pattern and the error bits; a case where the runs,
// segments and kv bounds are reached exactly.
// Usage: test_plan_build_emu [cases [seed]] (defaults 150 and 7); prints the seed and each case.
#include "backends/cuda/plan_kernels.cuh"
#include "cuda_emu.h"
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

extern "C" {
#include "backends/cuda/cuda_step_tables.h"
#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain.h"
}

namespace emu {
void launch(int grid, int smem_bytes, std::function<void()> k, bool shuffle_blocks, int nt);
}

using std::vector;
static std::mt19937_64 R;
static int64_t irand(int64_t a, int64_t b) { return a + (int64_t)(R() % (uint64_t)(b - a + 1)); }
static double urand() { return std::uniform_real_distribution<double>(0, 1)(R); }

static const uint32_t kCanary = 0xA5A5A5A5u;

// One head: the lists the device reads (after `count` entries: garbage) and the pattern the host
// plans (the device's lists cut as cuda_plan_build.h says).
struct Head {
  vector<int64_t> v; // device verticals
  vector<int32_t> d; // device diagonals
  int32_t nv = 0, nd = 0;
  vector<int64_t> host_v;
  vector<int32_t> host_d;
};

struct Seq {
  int64_t N = 0;
  int32_t cap_v = 0, cap_d = 1;
  vector<Head> heads;
  vector<int32_t> counts, diags;
  vector<int64_t> verts;
};

struct Case {
  int32_t Hq = 1, Hkv = 1, G = 16;
  vector<Seq> seqs;
  uint32_t want_err = 0;
  bool host_ok = true;     // the host plan is comparable (false: a head without diagonal 0)
  int64_t max_grid = 8192; // CTAs of the grid-stride launches (small: they loop)
  std::string what;
};

// ---- random patterns ---------------------------------------------------------------------------

static vector<int32_t> random_diagonals(int64_t nb) {
  vector<int32_t> d{0};
  const int style = (int)irand(0, 5);
  if (style == 0) return d; // diagonal 0 only
  if (style == 1) {         // all
    for (int32_t x = 1; x < nb; x++) d.push_back(x);
    return d;
  }
  if (style == 2) { // every other one (the most runs)
    const int64_t n = irand(1, nb);
    for (int32_t x = 2; x < nb && (int64_t)d.size() < n; x += 2) d.push_back(x);
    return d;
  }
  if (style == 3) { // a window of consecutive ones and a few far ones
    const int64_t w = irand(0, std::min<int64_t>(nb - 1, 12));
    for (int32_t x = 1; x <= w; x++) d.push_back(x);
    for (int k = 0; k < 3; k++) {
      const int32_t x = (int32_t)irand(0, nb - 1);
      if (x > d.back()) d.push_back(x);
    }
    return d;
  }
  // random density
  const double p = style == 4 ? urand() * 0.2 : urand();
  for (int32_t x = 1; x < nb; x++)
    if (urand() < p) d.push_back(x);
  return d;
}

static vector<int64_t> random_verticals(int64_t N, int32_t G, const vector<int32_t> &d) {
  vector<int64_t> v;
  const int64_t nb = (N + G - 1) / G;
  const int style = (int)irand(0, 6);
  vector<uint8_t> on(N, 0);
  if (style == 0) return v; // none
  if (style == 1) {         // all
    for (int64_t i = 0; i < N; i++) v.push_back(i);
    return v;
  }
  if (style == 2) { // block 0, the last (partial) block and blocks on diagonals of some blocks
    for (int k = 0; k < 3; k++) on[irand(0, std::min<int64_t>(G, N) - 1)] = 1;
    for (int k = 0; k < 3; k++) on[irand((nb - 1) * G, N - 1)] = 1;
    for (int k = 0; k < 6; k++) {
      const int64_t qb = irand(0, nb - 1), t = d[irand(0, (int64_t)d.size() - 1)];
      if (qb - t >= 0) on[(qb - t) * G + irand(0, std::min<int64_t>(G, N - (qb - t) * G) - 1)] = 1;
    }
  } else if (style == 3) { // clusters of consecutive positions (segments across tiles)
    const int64_t c = irand(1, 6);
    for (int64_t k = 0; k < c; k++) {
      const int64_t at = irand(0, N - 1), len = irand(1, 150);
      for (int64_t i = at; i < std::min(N, at + len); i++) on[i] = 1;
    }
  } else { // random density
    const double p = style == 4 ? urand() * 0.02 : style == 5 ? urand() * 0.3 : urand();
    for (int64_t i = 0; i < N; i++)
      if (urand() < p) on[i] = 1;
  }
  for (int64_t i = 0; i < N; i++)
    if (on[i]) v.push_back(i);
  return v;
}

// The longest prefix of a[0..n) that is strictly increasing in [0, limit) (and starts at 0 when
// `zero`), n first cut to [0, cap].
template <class T>
static int32_t valid_prefix(const vector<T> &a, int64_t n, int64_t cap, int64_t limit, bool zero) {
  n = std::max<int64_t>(0, std::min(n, cap));
  for (int64_t i = 0; i < n; i++)
    if (a[i] < 0 || a[i] >= limit || (i == 0 && zero && a[i] != 0) || (i > 0 && a[i] <= a[i - 1]))
      return (int32_t)i;
  return (int32_t)n;
}

// The device inputs of s (garbage after each head's count) and the host's cut patterns.
static void finish_seq(Seq &s, int32_t G) {
  const int64_t N = s.N, nb = (N + G - 1) / G, H = (int64_t)s.heads.size();
  s.counts.assign(2 * H, 0);
  s.verts.assign(H * N, -7);
  s.diags.assign(H * (nb + 1), -7);
  for (int64_t h = 0; h < H; h++) {
    Head &hd = s.heads[h];
    s.counts[2 * h] = hd.nv;
    s.counts[2 * h + 1] = hd.nd;
    for (size_t i = 0; i < hd.v.size() && (int64_t)i < N; i++) s.verts[h * N + i] = hd.v[i];
    for (size_t i = 0; i < hd.d.size() && (int64_t)i <= nb; i++)
      s.diags[h * (nb + 1) + i] = hd.d[i];
    const int32_t kv = valid_prefix(hd.v, std::min<int64_t>(hd.nv, N), s.cap_v, N, false);
    const int32_t kd = valid_prefix(hd.d, std::min<int64_t>(hd.nd, nb), s.cap_d, nb, true);
    hd.host_v.assign(hd.v.begin(), hd.v.begin() + kv);
    hd.host_d.assign(hd.d.begin(), hd.d.begin() + kd);
  }
}

// A random case; `breakage` >= 0 breaks the contract in one of several ways; `long_seqs`: one or
// two sequences of more than 2048 blocks (prefix sums over several chunks), G 16, 1 to 4 heads.
// A third of the cases cap the grid-stride launches at 1 to 3 CTAs (so that they loop).
static Case random_case(uint64_t seed, int breakage, bool long_seqs = false) {
  R.seed(seed);
  Case c;
  const int32_t Gs[] = {16, 32, 64, 128}, groups[] = {1, 2, 4, 8};
  c.G = long_seqs ? 16 : Gs[irand(0, 3)];
  const int32_t group = long_seqs ? (int32_t)irand(1, 2) : groups[irand(0, 3)];
  c.Hkv = group == 8 ? 1 : (int32_t)irand(1, 2);
  c.Hq = c.Hkv * group;
  c.max_grid = irand(0, 2) == 0 ? irand(1, 3) : 8192;
  const int count = long_seqs ? (int)irand(1, 2) : irand(0, 2) == 0 ? 1 : (int)irand(1, 6);
  for (int q = 0; q < count; q++) {
    Seq s;
    const int pick = long_seqs ? -1 : (int)irand(0, 9);
    s.N = pick == -1  ? irand(2100 * c.G, 2600 * c.G) | 1 // over 2048 blocks
          : pick == 0 ? irand(1, c.G - 1)                 // below G
          : pick == 1 ? c.G * irand(1, 20)                // a multiple of G
          : pick == 2 ? irand(1500, 4000)                 // longer
                      : irand(c.G, 1200) | 1;             // not a multiple of G
    const int64_t nb = (s.N + c.G - 1) / c.G;
    int32_t max_v = 0, max_d = 1;
    for (int32_t h = 0; h < c.Hq; h++) {
      Head hd;
      hd.d = random_diagonals(nb);
      hd.v = random_verticals(s.N, c.G, hd.d);
      hd.nv = (int32_t)hd.v.size();
      hd.nd = (int32_t)hd.d.size();
      max_v = std::max(max_v, hd.nv);
      max_d = std::max(max_d, hd.nd);
      s.heads.push_back(hd);
    }
    s.cap_v = max_v + (irand(0, 1) ? 0 : (int32_t)irand(1, 200));
    s.cap_d = max_d + (irand(0, 1) ? 0 : (int32_t)irand(1, 50));
    c.seqs.push_back(s);
  }
  if (breakage >= 0) {
    Seq &s = c.seqs[irand(0, count - 1)];
    Head &hd = s.heads[irand(0, c.Hq - 1)];
    const int64_t nb = (s.N + c.G - 1) / c.G;
    switch (breakage % 7) {
    case 0: // counts over the verticals' capacity
      if (s.cap_v > 0) s.cap_v = (int32_t)irand(0, s.cap_v - 1);
      for (Head &x : s.heads)
        if (x.nv > s.cap_v) c.want_err |= CUDA_PLAN_ERR_CAPACITY;
      c.what = "verticals over capacity";
      break;
    case 1: // ... and the diagonals'
      s.cap_d = (int32_t)irand(1, s.cap_d);
      for (Head &x : s.heads)
        if (x.nd > s.cap_d) c.want_err |= CUDA_PLAN_ERR_CAPACITY;
      c.what = "diagonals over capacity";
      break;
    case 2: // a negative count
      hd.nv = -(int32_t)irand(1, 5);
      c.want_err |= CUDA_PLAN_ERR_CAPACITY;
      c.what = "negative count";
      break;
    case 3: // two verticals swapped
      if (hd.v.size() >= 2) {
        const size_t k = (size_t)irand(0, (int64_t)hd.v.size() - 2);
        std::swap(hd.v[k], hd.v[k + 1]);
        c.want_err |= CUDA_PLAN_ERR_PATTERN;
      }
      c.what = "unsorted verticals";
      break;
    case 4: // a vertical at N, a diagonal at nb
      if (!hd.v.empty()) {
        hd.v.back() = s.N;
        c.want_err |= CUDA_PLAN_ERR_PATTERN;
      }
      if (hd.d.size() >= 2) {
        hd.d.back() = (int32_t)nb;
        c.want_err |= CUDA_PLAN_ERR_PATTERN;
      }
      c.what = "entries out of range";
      break;
    case 5: // more verticals than N within the capacity: a repeated last one
      hd.v.push_back(hd.v.empty() ? 0 : hd.v.back());
      hd.nv = (int32_t)hd.v.size();
      s.cap_v = std::max(s.cap_v, hd.nv + 3);
      if (hd.nv > 1) c.want_err |= CUDA_PLAN_ERR_PATTERN;
      c.what = "repeated vertical";
      break;
    default: // no diagonal 0: the head keeps nothing (the host would add diagonal 0)
      hd.d[0] = 1;
      c.want_err |= CUDA_PLAN_ERR_PATTERN;
      c.host_ok = false;
      c.what = "no diagonal 0";
      break;
    }
  }
  for (Seq &s : c.seqs) finish_seq(s, c.G);
  return c;
}

// ---- the device build in the emulator -----------------------------------------------------------

struct Built {
  vector<unsigned char> mem; // the device memory (dev at a 256-byte boundary inside) and a guard
  unsigned char *dev = nullptr;
  size_t bytes = 0, guard = 4096;
  vector<plan::SeqLayout> L;
  vector<size_t> base;
  vector<cuda_step_t> steps;
  int64_t *pairs = nullptr;
  vector<unsigned char> table;
};

static int build_on_device(const Case &c, vector<cuda_plan_seq_t> &in, Built &B) {
  const int32_t n = (int32_t)c.seqs.size();
  in.clear();
  for (const Seq &s : c.seqs)
    in.push_back(
        cuda_plan_seq_t{s.N, s.counts.data(), s.verts.data(), s.diags.data(), s.cap_v, s.cap_d});
  const cuda_plan_geom_t g = {c.Hq, c.Hkv, c.G, n, in.data()};
  size_t bytes = 0;
  if (cuda_plan_build_bytes(&g, &bytes) != MTRAIN_SUCCESS) {
    printf("  cuda_plan_build_bytes failed: %s\n", mtrain_last_error());
    return 1;
  }
  B.L.resize(n);
  B.base.resize(n);
  int32_t bad = 0;
  if (plan::batch_layout(&g, B.L.data(), B.base.data(), &B.bytes, &bad) || B.bytes != bytes) {
    printf("  batch_layout: %zu bytes, cuda_plan_build_bytes %zu\n", B.bytes, bytes);
    return 1;
  }
  B.mem.assign(B.bytes + 256 + B.guard, 0xA5);
  B.dev = B.mem.data() + (256 - (uintptr_t)B.mem.data() % 256) % 256;
  const plan::TableLayout T = plan::table_layout(n);
  B.table.assign(T.bytes, 0);
  B.steps.assign(n, cuda_step_t{});
  plan::Batch b;
  plan::batch_prepare(&g, B.L.data(), B.base.data(), (char *)B.dev, (char *)B.table.data(),
                      (char *)B.table.data(), &b, B.steps.data(), &B.pairs);
  return plan::run_stages(
      b,
      [&](plan::Kernel k, const char *, int64_t grid, size_t smem) {
        emu::launch((int)grid, (int)smem, [&] { k(b); }, true, plan::kThreads);
        return 0;
      },
      c.max_grid);
}

// ---- the comparison ----------------------------------------------------------------------------

static char where[256];

static int differ(const char *what, int64_t at, int64_t dev, int64_t host) {
  printf("  %s: %s differs at %lld: device %lld, host %lld\n", where, what, (long long)at,
         (long long)dev, (long long)host);
  return 1;
}

template <class A, class B>
static int same(const char *what, const A *dev, const B *host, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if ((int64_t)dev[i] != (int64_t)host[i]) return differ(what, i, dev[i], host[i]);
  return 0;
}

// The words [from, to) of a region are untouched.
static int untouched(const char *what, const int32_t *p, int64_t from, int64_t to) {
  for (int64_t i = from; i < to; i++)
    if ((uint32_t)p[i] != kCanary) {
      printf("  %s: %s written past its used part (at %lld of capacity %lld)\n", where, what,
             (long long)i, (long long)to);
      return 1;
    }
  return 0;
}

static std::map<int32_t, mtrain_context_t *> contexts; // cpu-ref, one rank, by granularity

static mtrain_context_t *context(int32_t G) {
  if (!contexts.count(G)) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.backend = "cpu-ref";
    cfg.granularity = G;
    cfg.num_threads = 1;
    mtrain_context_t *ctx = nullptr;
    if (mtrain_context_create(&cfg, NULL, &ctx) != MTRAIN_SUCCESS) {
      printf("context: %s\n", mtrain_last_error());
      exit(1);
    }
    contexts[G] = ctx;
  }
  return contexts[G];
}

// One sequence's tables against the host plan's (packed).
static int compare_seq(const Case &c, const Built &B, int32_t s, const mtrain_plan_t *hp) {
  const Seq &q = c.seqs[s];
  const plan::SeqLayout &L = B.L[s];
  const cuda_step_t &st = B.steps[s];
  const int32_t Hq = c.Hq, Hkv = c.Hkv;
  const int64_t nb = L.nb;
  const mtrain_plan_seq_t *ps = &hp->seqs[s];
  const mtrain_step_view_t *view = &ps->steps[0].view;
  cuda_step_tables_t t;
  if (cuda_step_tables_size(view, Hkv, 1, &t) != MTRAIN_SUCCESS) return 1;
  vector<char> hb(t.bytes);
  if (cuda_step_tables_pack(view, Hkv, 1, hb.data(), &t) != MTRAIN_SUCCESS) return 1;
  const int64_t *hg = (const int64_t *)hb.data();
  const int32_t *hi = (const int32_t *)(hb.data() + t.i32_base);
  snprintf(where, sizeof where, "sequence %d (N %lld)", s, (long long)q.N);
  // the step's fields
  const int64_t fields[][2] = {{st.G, c.G},
                               {st.Hq, Hq},
                               {st.Hkv, Hkv},
                               {st.group, Hq / Hkv},
                               {st.d, 0},
                               {st.num_q_blocks, view->num_q_blocks},
                               {st.num_k_blocks, view->num_k_blocks},
                               {st.causal, 1},
                               {st.seq_len, q.N},
                               {st.q_tokens, view->q_tokens},
                               {st.k_tokens, view->k_tokens},
                               {st.num_bar_tiles, L.tiles},
                               {st.total_bars, Hq * L.Cv},
                               {st.max_runs_per_item, 0}};
  for (size_t f = 0; f < sizeof fields / sizeof *fields; f++)
    if (fields[f][0] != fields[f][1])
      return differ("step field", (int64_t)f, fields[f][0], fields[f][1]);
  if (same("q_block_global", st.q_block_global, hg, nb) ||
      same("k_block_global", st.k_block_global, hg + nb, nb))
    return 1;
  // the heads
  const int32_t *hm = hi + t.head_meta, *hidx = hi + t.idx;
  int64_t bars_total = 0;
  for (int32_t h = 0; h < Hq; h++) {
    snprintf(where, sizeof where, "sequence %d (N %lld) head %d", s, (long long)q.N, h);
    const int32_t *dm = st.head_meta + (int64_t)h * CUDA_HM_STRIDE,
                  *m = hm + (int64_t)h * CUDA_HM_STRIDE;
    const mtrain_step_head_t &vh = view->heads[h];
    if (dm[CUDA_HM_NUM_BARS] != m[CUDA_HM_NUM_BARS])
      return differ("NUM_BARS", h, dm[CUDA_HM_NUM_BARS], m[CUDA_HM_NUM_BARS]);
    if (dm[CUDA_HM_BAR_BASE] != m[CUDA_HM_BAR_BASE])
      return differ("BAR_BASE", h, dm[CUDA_HM_BAR_BASE], m[CUDA_HM_BAR_BASE]);
    const int32_t *d_run_off = st.idx + dm[CUDA_HM_RUN_OFF],
                  *d_seg_off = st.idx + dm[CUDA_HM_SEG_OFF];
    if (same("run_off", d_run_off, hidx + m[CUDA_HM_RUN_OFF], nb + 1) ||
        same("runs", st.idx + dm[CUDA_HM_RUNS], hidx + m[CUDA_HM_RUNS], 2 * (int64_t)vh.num_runs) ||
        same("seg_off", d_seg_off, hidx + m[CUDA_HM_SEG_OFF], nb + 1) ||
        same("segs", st.idx + dm[CUDA_HM_SEGS], hidx + m[CUDA_HM_SEGS], 2 * (int64_t)vh.num_segs) ||
        same("bars", st.idx + dm[CUDA_HM_BARS], hidx + m[CUDA_HM_BARS], vh.num_bars))
      return 1;
    if (untouched("runs", st.idx + dm[CUDA_HM_RUNS], 2 * (int64_t)vh.num_runs, 2 * L.cap_runs) ||
        untouched("segs", st.idx + dm[CUDA_HM_SEGS], 2 * (int64_t)vh.num_segs, 2 * L.cap_segs) ||
        untouched("bars", st.idx + dm[CUDA_HM_BARS], vh.num_bars, L.Cv))
      return 1;
    if (B.pairs[(int64_t)s * Hq + h] != ps->steps[0].heads[h].pairs)
      return differ("pairs", h, B.pairs[(int64_t)s * Hq + h], ps->steps[0].heads[h].pairs);
    bars_total += vh.num_bars;
  }
  snprintf(where, sizeof where, "sequence %d (N %lld)", s, (long long)q.N);
  if (bars_total > st.total_bars) return differ("total_bars", 0, st.total_bars, bars_total);
  // the key-major lists
  const int64_t nkv = (int64_t)Hkv * nb;
  const int64_t kv_n = hi[t.kv_off + nkv];
  if (same("kv_off", st.kv_off, hi + t.kv_off, nkv + 1) ||
      same("kv_ent", st.kv_ent, hi + t.kv_ent, 2 * kv_n) ||
      untouched("kv_ent", st.kv_ent, 2 * kv_n, 2 * L.cap_kv))
    return 1;
  // the bar tiles: the real ones, then padding
  const int64_t T = t.num_bar_tiles, E = hi[t.bt_off + T];
  if (T > st.num_bar_tiles) return differ("bar tiles", 0, st.num_bar_tiles, T);
  if (same("bt_tile", st.bt_tile, hi + t.bt_tile, 3 * T) ||
      same("bt_off", st.bt_off, hi + t.bt_off, T + 1) ||
      same("bt_ent", st.bt_ent, hi + t.bt_ent, 3 * E) ||
      untouched("bt_ent", st.bt_ent, 3 * E, 3 * L.cap_bent))
    return 1;
  for (int64_t j = T; j < st.num_bar_tiles; j++) {
    const int32_t *p = st.bt_tile + 3 * j;
    if (p[0] != 0 || p[1] != 0 || p[2] != 0)
      return differ("padding tile", j, p[0] | p[1] | p[2], 0);
    if (st.bt_off[j + 1] != E) return differ("padding bt_off", j + 1, st.bt_off[j + 1], E);
  }
  return 0;
}

// Runs case c: the device build, the guard, the error word, then (when the host can plan the cut
// pattern) every sequence against the host plan. *fill: the largest share of each capacity used.
static int run(const Case &c, double fill[5]) {
  vector<cuda_plan_seq_t> in;
  Built B;
  if (build_on_device(c, in, B)) return 1;
  for (size_t i = 0; i < B.guard; i++)
    if (B.dev[B.bytes + i] != 0xA5) {
      printf("  written past the buffer (byte %zu after its end)\n", i);
      return 1;
    }
  const uint32_t err = *(const uint32_t *)(B.dev + CUDA_PLAN_ERR_OFFSET);
  if (err != c.want_err) {
    printf("  error word %u, expected %u\n", err, c.want_err);
    return 1;
  }
  if (!c.host_ok) {
    // the heads without diagonal 0 keep nothing: no run, no key entry
    for (size_t s = 0; s < c.seqs.size(); s++)
      for (int32_t h = 0; h < c.Hq; h++) {
        const int32_t *m = B.steps[s].head_meta + (int64_t)h * CUDA_HM_STRIDE;
        if (c.seqs[s].heads[h].host_d.empty() &&
            B.steps[s].idx[m[CUDA_HM_RUN_OFF] + B.L[s].nb] != 0) {
          printf("  sequence %zu head %d: runs without diagonal 0\n", s, h);
          return 1;
        }
      }
    return 0;
  }
  vector<mtrain_pattern_t *> pats;
  vector<int64_t> offsets{0};
  for (const Seq &s : c.seqs) {
    mtrain_pattern_t *p = nullptr;
    if (mtrain_pattern_create(s.N, c.Hq, c.G, &p) != MTRAIN_SUCCESS) return 1;
    for (int32_t h = 0; h < c.Hq; h++) {
      const Head &hd = s.heads[h];
      if (mtrain_pattern_set_head(p, h, hd.host_d.data(), (int32_t)hd.host_d.size(),
                                  hd.host_v.data(), (int32_t)hd.host_v.size()) != MTRAIN_SUCCESS) {
        printf("  set_head: %s\n", mtrain_last_error());
        return 1;
      }
    }
    pats.push_back(p);
    offsets.push_back(offsets.back() + s.N);
  }
  const mtrain_seqs_t seqs = {(int32_t)c.seqs.size(), offsets.data()};
  mtrain_plan_t *hp = nullptr;
  int bad = 0;
  if (mtrain_plan_create(context(c.G), &seqs, (const mtrain_pattern_t *const *)pats.data(), &hp) !=
      MTRAIN_SUCCESS) {
    printf("  plan: %s\n", mtrain_last_error());
    bad = 1;
  }
  for (int32_t s = 0; !bad && s < (int32_t)c.seqs.size(); s++) {
    bad = compare_seq(c, B, s, hp);
    const plan::SeqLayout &L = B.L[s];
    const mtrain_step_view_t *v = &hp->seqs[s].steps[0].view;
    cuda_step_tables_t t;
    vector<char> hb;
    for (int32_t h = 0; h < c.Hq; h++) {
      const mtrain_step_head_t &vh = v->heads[h];
      fill[0] = std::max(fill[0], L.cap_runs ? (double)vh.num_runs / L.cap_runs : 0.0);
      fill[1] = std::max(fill[1], L.cap_segs ? (double)vh.num_segs / L.cap_segs : 0.0);
    }
    if (cuda_step_tables_size(v, c.Hkv, 1, &t) == MTRAIN_SUCCESS) {
      hb.resize(t.bytes);
      cuda_step_tables_pack(v, c.Hkv, 1, hb.data(), &t);
      const int32_t *hi = (const int32_t *)(hb.data() + t.i32_base);
      fill[2] = std::max(fill[2], L.cap_kv ? (double)hi[t.kv_off + c.Hkv * L.nb] / L.cap_kv : 0.0);
      fill[3] = std::max(fill[3], L.tiles ? (double)t.num_bar_tiles / L.tiles : 0.0);
      fill[4] =
          std::max(fill[4], L.cap_bent ? (double)hi[t.bt_off + t.num_bar_tiles] / L.cap_bent : 0.0);
    }
  }
  mtrain_plan_destroy(hp);
  for (mtrain_pattern_t *p : pats) mtrain_pattern_destroy(p);
  return bad;
}

static void describe(const char *kind, int index, uint64_t seed, const Case &c) {
  printf("%s %d seed %llu: G %d, %d/%d heads, %zu sequences (N", kind, index,
         (unsigned long long)seed, c.G, c.Hq, c.Hkv, c.seqs.size());
  for (const Seq &s : c.seqs) printf(" %lld", (long long)s.N);
  printf("), caps");
  for (const Seq &s : c.seqs) printf(" %d/%d", s.cap_v, s.cap_d);
  if (c.max_grid < 8192) printf(", grids of at most %lld CTAs", (long long)c.max_grid);
  if (!c.what.empty()) printf(", %s (error %u)", c.what.c_str(), c.want_err);
  printf("\n");
}

// The bounds reached: every head of one sequence with every other diagonal (the most runs), of
// another with the first Cd diagonals (the most kv entries), of a third with every other diagonal
// and one vertical per block (every other bar block excluded: the most segments).
static int tight_case(double fill[5]) {
  Case c;
  c.G = 16;
  c.Hq = 4;
  c.Hkv = 2;
  c.what = "bounds reached";
  const int64_t N = 1000, nb = (N + c.G - 1) / c.G;
  const int32_t Cd = 9;
  for (int k = 0; k < 3; k++) {
    Seq s;
    s.N = N;
    s.cap_d = Cd;
    for (int32_t h = 0; h < c.Hq; h++) {
      Head hd;
      for (int32_t x = 0; (int32_t)hd.d.size() < Cd; x++) {
        const bool on = k == 1 || x % 2 == 0;
        if (on) hd.d.push_back(x);
      }
      if (k == 2)
        for (int64_t b = 0; b < nb; b++)
          hd.v.push_back(b * c.G + b % std::min<int64_t>(c.G, N - b * c.G));
      hd.nv = (int32_t)hd.v.size();
      hd.nd = (int32_t)hd.d.size();
      s.cap_v = std::max(s.cap_v, hd.nv);
      s.heads.push_back(hd);
    }
    c.seqs.push_back(s);
  }
  for (Seq &s : c.seqs) finish_seq(s, c.G);
  describe("bounds case", 0, 0, c);
  double f[5] = {0, 0, 0, 0, 0};
  if (run(c, f)) return 1;
  printf("  runs, segments and kv entries filled to %.3f, %.3f, %.3f of their bounds\n", f[0], f[1],
         f[2]);
  for (int i = 0; i < 5; i++) fill[i] = std::max(fill[i], f[i]);
  if (f[0] != 1.0 || f[1] != 1.0 || f[2] != 1.0) {
    printf("  a bound is not reached (runs, segments and kv entries should be)\n");
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  const int cases = argc > 1 ? atoi(argv[1]) : 150;
  const uint64_t seed = argc > 2 ? strtoull(argv[2], nullptr, 10) : 7;
  printf("test_plan_build_emu: %d cases, seed %llu\n", cases, (unsigned long long)seed);
  int failed = 0, total = 0;
  double fill[5] = {0, 0, 0, 0, 0};
  failed += tight_case(fill);
  total++;
  for (int i = 0; i < cases; i++) {
    const uint64_t cs = seed * 1000003ULL + (uint64_t)i;
    const Case c = random_case(cs, -1);
    describe("case", i, cs, c);
    failed += run(c, fill);
    total++;
  }
  const int longer = cases / 30 > 2 ? cases / 30 : 2;
  for (int i = 0; i < longer; i++) {
    const uint64_t cs = seed * 104729ULL + (uint64_t)i;
    const Case c = random_case(cs, -1, true);
    describe("long case", i, cs, c);
    failed += run(c, fill);
    total++;
  }
  const int broken = cases / 5 > 14 ? cases / 5 : 14;
  for (int i = 0; i < broken; i++) {
    const uint64_t cs = seed * 7919ULL + (uint64_t)i;
    const Case c = random_case(cs, i);
    describe("broken case", i, cs, c);
    failed += run(c, fill);
    total++;
  }
  printf("largest use of the bounds: runs %.3f, segments %.3f, kv entries %.3f, bar tiles %.3f, "
         "bar entries %.3f\n",
         fill[0], fill[1], fill[2], fill[3], fill[4]);
  for (auto &kv : contexts) mtrain_context_destroy(kv.second);
  printf("%s: %d of %d cases differ from the host plan\n", failed ? "FAILED" : "passed", failed,
         total);
  return failed ? 1 : 0;
}
