// test_cuda_emu.cpp: runs the CUDA kernels of variants 2 and 3 on the CPU (the emulator of
// cuda_emu.h, sources cut by cut_ptx.py) against the fp64 cpu-ref oracle of libmtrain, on random
// attention steps (single-rank and ring-like, bars anywhere, padded tokens, GQA, d 64 and 128,
// bf16 and fp16; causal, and non-causal with key blocks on both sides of the diagonal and no
// mask but the sequence end): every forward tiling of variant 2 and variant 3's forward (its
// one-item kernel and its persistent kernel, on a grid of a few emulated SMs so that every CTA
// loops over items, compared bit for bit; configurations 29-30: items of 0, 1 and few tiles),
// variant 2's deterministic and fused backward, and variant 3's with each of its two kernels
// (kv0: wgmma_bwd_kernel, kv3: the warp-specialised wgmma_bwd_ws_kernel). Every key-major
// backward runs as the dispatcher runs it: the long-item split's schedule kernel, the kernel over
// the work list's parts, the reduce of the split items' parts (configurations 22-28: a sink
// column, so that items split, or bar items split with C 1 (28); the deterministic backward
// twice, compared bit for bit).
// Usage: test_cuda_emu [config|-1 [seed [fwd kind [bwd]]]]; without arguments the
// configurations of kQuick with seed 7. bwd: one backward of the list `all` in run() (4, 5:
// variant 3's first kernel, deterministic and fused; 6, 7: its warp-specialised kernel); a fwd
// kind that no forward has (e.g. 9) runs variant 3's forward only (with a bwd that no backward
// has, e.g. `9 99`, variant 3's forward alone).
#include "backends/cuda/attn_mma2_bwd.cu"
#include "backends/cuda/attn_mma2_fwd.cu"
#include "backends/cuda/attn_wgmma_bwd.cu"
#include "backends/cuda/attn_wgmma_fwd.cu"
#include "cuda_emu.h"
#include <functional>
#include <random>
#include <string>
#include <vector>

extern "C" {
mtrain_status_t mtrain_cpu_ref_fwd_step(void *state, const mtrain_fwd_step_args_t *args);
mtrain_status_t mtrain_cpu_ref_bwd_step(void *state, const mtrain_bwd_step_args_t *args);
}
struct cpu_state_like {
  int num_threads, deterministic, saved_blas_threads;
};
namespace emu {
void launch(int grid, int smem_bytes, std::function<void()> k, bool shuffle_blocks, int nt);
void red_region(float *p, size_t n);
void register_buffer(const void *p, size_t n);
void clear_buffers();
void set_launch_regs(int n);
extern long g_switches;
} // namespace emu

using std::vector;
static int only_kind = -1, only_bwd = -1;
static std::mt19937_64 R(1);
static double urand() { return std::uniform_real_distribution<double>(0, 1)(R); }
static int irand(int a, int b) { return a + (int)(R() % (uint64_t)(b - a + 1)); } // [a, b]
static double nrand() { return std::normal_distribution<double>(0, 1)(R); }

static int brows(int64_t tokens, int G, int lb, int64_t gb, int64_t N) {
  int64_t a = tokens - (int64_t)lb * G, b = N - gb * G, n = a < b ? a : b;
  if (n > G) n = G;
  return n < 0 ? 0 : (int)n;
}

struct Cfg {
  const char *name;
  int G, D;
  bool bf16;
  int Hq, Hkv;
  int64_t N;
  int mode;         // 0: single rank (q = k = all blocks), 1: ring-like random subsets
  double density;   // prob. of a non-diagonal key block
  int nbars;        // bars per head (max)
  int data;         // 0 random, 1 counting (q = 0, lse = 0 in bwd)
  int random_tiles; // bar tiles of random sizes <= 64
  double qscale;
  int noncausal; // 1: a non-causal step (key blocks above the diagonal too, no causal mask)
  // the long-item split of the key-major backward (kv_split_schedule_kernel): sink 1: the
  // step's first key block (a "sink" column) in every query block's runs, 2: vertical-slash
  // (the sink column, the diagonal block and the one before it, nothing else); cmin: the
  // split's C_MIN (0: CUDA_KV_SPLIT_MIN); sms: the SM count the schedule assumes (0: 132)
  int sink = 0, cmin = 0, sms = 0;
  // the SM count of variant 3's persistent forward (0: kFwdSms): its grid is min(items, SMs x
  // CTAs per SM), small so that every CTA loops over several items
  int fwd_sms = 0;
};

// The emulated SM count of the persistent forward's grid (Cfg::fwd_sms), and whether it runs:
// MTRAIN_CUDA_WGMMA_FWD_PERSISTENT unset, empty or 1: variant 3's forward runs with both kernels
// (wgmma_fwd_kernel, one CTA per item, and wgmma_fwd_persistent_kernel), their outputs compared
// bit for bit; 0: the one-item kernel alone.
static const int kFwdSms = 3;
static int fwd_persistent = 1;

template <typename T> static uint16_t to16(float f);
template <> uint16_t to16<__nv_bfloat16>(float f) {
  __nv_bfloat16 h = __float2bfloat16_rn(f);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}
template <> uint16_t to16<__half>(float f) {
  __half h = __float2half_rn(f);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}

struct Err {
  double max_abs = 0, ref_max = 0;
  int64_t worst = -1;
};
static Err compare(const float *x, const double *y, int64_t n) {
  Err e;
  int64_t first_nan = -1; // a NaN error sticks (a NaN max_abs would let the next element reset it)
  for (int64_t i = 0; i < n; ++i) {
    if (std::isinf(y[i]) && x[i] == y[i]) continue;
    double d = std::fabs((double)x[i] - y[i]);
    if (std::isnan(d)) {
      if (first_nan < 0) first_nan = i;
    } else if (!(d <= e.max_abs)) {
      e.max_abs = d;
      e.worst = i;
    }
    if (std::isfinite(y[i])) e.ref_max = std::max(e.ref_max, std::fabs(y[i]));
  }
  if (first_nan >= 0) {
    e.max_abs = NAN;
    e.worst = first_nan;
  }
  return e;
}

// The persistent forward's items (query tiles of BM rows, cuda_q_items order) by their key
// tiles (the walk that the kernel's producer runs), and what CTA 0 of a grid of `grid` takes.
template <int BM> static void print_fwd_items(const cuda_step_t &st, int grid) {
  const int items = (int)cuda_q_items(&st, BM);
  int hist[4] = {0, 0, 0, 0}, pad = 0; // 0, 1, 2-3, 4+ tiles; padding-only tiles
  std::string cta0;
  for (int it = 0; it < items; ++it) {
    mma2::QItem item;
    if (!mma2::q_item_at<BM>(st, (unsigned)it, item)) {
      ++pad;
      continue;
    }
    mma2::KeyWalk2 w;
    w.init(st, item.h, item.qb, item.gq, item.qt * BM, item.rows);
    mma2::KTile2 t;
    int n = 0;
    while (w.next(st, t)) ++n;
    ++hist[n == 0 ? 0 : n == 1 ? 1 : n < 4 ? 2 : 3];
    if (wg::persistent_item((unsigned)(it / grid), 0, (unsigned)grid) == (unsigned)it &&
        cta0.size() < 60)
      cta0 += " " + std::to_string(n);
  }
  printf("    persistent BM %d: %d CTAs over %d items (key tiles 0: %d, 1: %d, 2-3: %d, 4+: %d; "
         "padding %d); CTA 0's items' tiles:%s\n",
         BM, grid, items, hist[0], hist[1], hist[2], hist[3], pad, cta0.c_str());
}

template <int D, typename T> static bool run(const Cfg &c, uint64_t seed) {
  R.seed(seed);
  const int G = c.G, Hq = c.Hq, Hkv = c.Hkv, group = Hq / Hkv;
  const int64_t N = c.N;
  const int nb = (int)((N + G - 1) / G);
  // local blocks
  vector<int64_t> qg, kg;
  if (c.mode == 0) {
    for (int i = 0; i < nb; ++i) {
      qg.push_back(i);
      kg.push_back(i);
    }
  } else {
    for (int i = 0; i < nb; ++i) {
      if (urand() < 0.6) qg.push_back(i);
      if (urand() < 0.6) kg.push_back(i);
    }
    if (qg.empty()) qg.push_back(nb - 1);
    if (kg.empty()) kg.push_back(0);
    if (urand() < 0.5) std::shuffle(kg.begin(), kg.end(), R);
  }
  const int nqb = (int)qg.size(), nkb = (int)kg.size();
  auto tokens_of = [&](const vector<int64_t> &gl) -> int64_t {
    int64_t t = (int64_t)(gl.size() - 1) * G;
    int last = (int)std::min<int64_t>(G, N - gl.back() * G);
    if (c.mode == 0) return t + last;                   // exact: N
    return t + (urand() < 0.5 ? last : irand(last, G)); // exact or padded
  };
  const int64_t qT = tokens_of(qg), kT = tokens_of(kg);
  // per head plan
  struct HeadPlan {
    vector<int32_t> run_off, runs, seg_off, segs, bars;
  };
  vector<HeadPlan> hp(Hq);
  vector<int64_t> valid_keys;
  for (int kb = 0; kb < nkb; ++kb)
    for (int cc = 0; cc < brows(kT, G, kb, kg[kb], N); ++cc)
      valid_keys.push_back((int64_t)kb * G + cc);
  // the sink: the first key block of the step (the lowest global index among those with rows)
  int64_t sink_g = -1;
  for (int kb = 0; kb < nkb; ++kb)
    if (brows(kT, G, kb, kg[kb], N) > 0 && (sink_g < 0 || kg[kb] < sink_g)) sink_g = kg[kb];
  for (int h = 0; h < Hq; ++h) {
    HeadPlan &p = hp[h];
    // bars
    int nbh = std::min<int>(irand(0, c.nbars), (int)valid_keys.size());
    if (h == 0 && c.nbars > 0) nbh = std::min<int>(c.nbars, (int)valid_keys.size());
    vector<int64_t> pool = valid_keys;
    std::shuffle(pool.begin(), pool.end(), R);
    pool.resize(nbh);
    std::sort(pool.begin(), pool.end());
    for (auto x : pool) p.bars.push_back((int32_t)x);
    p.run_off.push_back(0);
    p.seg_off.push_back(0);
    for (int qb = 0; qb < nqb; ++qb) {
      vector<int> chosen;
      for (int kb = 0; kb < nkb; ++kb) {
        if ((!c.noncausal && kg[kb] > qg[qb]) || brows(kT, G, kb, kg[kb], N) == 0) continue;
        double pr = kg[kb] == qg[qb] ? 0.85 : c.density;
        if (c.sink && kg[kb] == sink_g)
          pr = 1.0; // the sink column
        else if (c.sink == 2)
          pr = kg[kb] == qg[qb] || kg[kb] + 1 == qg[qb] ? 1.0 : 0.0; // the slash
        if (urand() < pr) chosen.push_back(kb);
      }
      // runs: consecutive local blocks, randomly split; order ascending or (rarely) reversed runs
      vector<std::pair<int, int>> rs;
      for (size_t i = 0; i < chosen.size(); ++i) {
        if (!rs.empty() && rs.back().second == chosen[i] && urand() < 0.7)
          rs.back().second++;
        else
          rs.push_back({chosen[i], chosen[i] + 1});
      }
      if (urand() < 0.2) std::reverse(rs.begin(), rs.end());
      for (auto &r : rs) {
        p.runs.push_back(r.first);
        p.runs.push_back(r.second);
      }
      p.run_off.push_back((int32_t)(p.runs.size() / 2));
      // segments over the bar indices
      int b = 0;
      while (b < nbh) {
        int len = irand(0, std::min(nbh - b, urand() < 0.5 ? 5 : 90));
        if (urand() < 0.6) {
          p.segs.push_back(b);
          p.segs.push_back(b + len);
        }
        b += len + irand(0, 30);
      }
      p.seg_off.push_back((int32_t)(p.segs.size() / 2));
    }
  }
  // oracle view
  vector<mtrain_step_head_t> heads(Hq);
  for (int h = 0; h < Hq; ++h) {
    heads[h].run_off = hp[h].run_off.data();
    heads[h].runs = hp[h].runs.data();
    heads[h].seg_off = hp[h].seg_off.data();
    heads[h].segs = hp[h].segs.data();
    heads[h].bars = hp[h].bars.data();
    heads[h].num_runs = (int32_t)hp[h].runs.size() / 2;
    heads[h].num_segs = (int32_t)hp[h].segs.size() / 2;
    heads[h].num_bars = (int32_t)hp[h].bars.size();
  }
  mtrain_step_view_t view = {};
  view.granularity = G;
  view.num_heads = Hq;
  view.seq_len = N;
  view.q_tokens = qT;
  view.k_tokens = kT;
  view.num_q_blocks = nqb;
  view.num_k_blocks = nkb;
  view.q_block_global = qg.data();
  view.k_block_global = kg.data();
  view.heads = heads.data();
  view.causal = c.noncausal ? 0 : 1;
  // device step
  vector<int32_t> meta(Hq * CUDA_HM_STRIDE, 0), idx;
  idx.reserve(1);
  int total_bars = 0;
  for (int h = 0; h < Hq; ++h) {
    int32_t *m = &meta[h * CUDA_HM_STRIDE];
    auto put = [&](const vector<int32_t> &a) {
      int32_t off = (int32_t)idx.size();
      idx.insert(idx.end(), a.begin(), a.end());
      return off;
    };
    m[CUDA_HM_RUN_OFF] = put(hp[h].run_off);
    m[CUDA_HM_RUNS] = put(hp[h].runs);
    m[CUDA_HM_SEG_OFF] = put(hp[h].seg_off);
    m[CUDA_HM_SEGS] = put(hp[h].segs);
    m[CUDA_HM_BARS] = put(hp[h].bars);
    m[CUDA_HM_NUM_BARS] = (int32_t)hp[h].bars.size();
    m[CUDA_HM_BAR_BASE] = total_bars;
    total_bars += (int)hp[h].bars.size();
  }
  vector<int32_t> kv_off, kv_ent;
  kv_ent.reserve(1);
  for (int hk = 0; hk < Hkv; ++hk)
    for (int kb = 0; kb < nkb; ++kb) {
      kv_off.push_back((int32_t)kv_ent.size() / 2);
      for (int h = hk * group; h < (hk + 1) * group; ++h)
        for (int qb = 0; qb < nqb; ++qb) {
          bool in = false;
          for (int e = hp[h].run_off[qb]; e < hp[h].run_off[qb + 1]; ++e)
            if (kb >= hp[h].runs[2 * e] && kb < hp[h].runs[2 * e + 1]) in = true;
          if (in) {
            kv_ent.push_back(h);
            kv_ent.push_back(qb);
          }
        }
    }
  kv_off.push_back((int32_t)kv_ent.size() / 2);
  vector<int32_t> bt_tile, bt_off, bt_ent;
  bt_tile.reserve(1);
  bt_ent.reserve(1);
  for (int h = 0; h < Hq; ++h) {
    int nbh = (int)hp[h].bars.size();
    for (int b0 = 0; b0 < nbh;) {
      int b1 = std::min(nbh, b0 + (c.random_tiles ? irand(1, 64) : 64));
      bt_tile.push_back(h);
      bt_tile.push_back(b0);
      bt_tile.push_back(b1);
      bt_off.push_back((int32_t)bt_ent.size() / 3);
      for (int qb = 0; qb < nqb; ++qb)
        for (int s = hp[h].seg_off[qb]; s < hp[h].seg_off[qb + 1]; ++s) {
          int lo = hp[h].segs[2 * s], hi = hp[h].segs[2 * s + 1];
          if (std::max(lo, b0) < std::min(hi, b1)) {
            bt_ent.push_back(qb);
            bt_ent.push_back(lo);
            bt_ent.push_back(hi);
          }
        }
      b0 = b1;
    }
  }
  const int num_bar_tiles = (int)bt_tile.size() / 3;
  bt_off.push_back((int32_t)bt_ent.size() / 3);
  {
    int empty_bt = 0, empty_kv = 0, no_key_items = 0, multi_seg_tiles = 0, total_keys = 0;
    for (int t = 0; t < num_bar_tiles; ++t) {
      empty_bt += bt_off[t] == bt_off[t + 1];
      multi_seg_tiles += bt_off[t + 1] - bt_off[t] > 1;
    }
    for (size_t x = 0; x + 1 < kv_off.size(); ++x) empty_kv += kv_off[x] == kv_off[x + 1];
    for (int h = 0; h < Hq; ++h)
      for (int qb = 0; qb < nqb; ++qb) {
        int nk = 0;
        for (int e = hp[h].run_off[qb]; e < hp[h].run_off[qb + 1]; ++e)
          nk += hp[h].runs[2 * e + 1] - hp[h].runs[2 * e];
        for (int sg = hp[h].seg_off[qb]; sg < hp[h].seg_off[qb + 1]; ++sg)
          nk += hp[h].segs[2 * sg + 1] - hp[h].segs[2 * sg];
        no_key_items += nk == 0;
        total_keys += nk;
      }
    printf("    q_tokens %lld k_tokens %lld nqb %d nkb %d | bar tiles %d (empty %d, >1 entry %d) | "
           "kv items empty %d/%zu | (h,qb) without keys %d\n",
           (long long)qT, (long long)kT, nqb, nkb, num_bar_tiles, empty_bt, multi_seg_tiles,
           empty_kv, kv_off.size() - 1, no_key_items);
  }
  cuda_step_t st = {};
  st.G = G;
  st.Hq = Hq;
  st.Hkv = Hkv;
  st.group = group;
  st.d = D;
  st.num_q_blocks = nqb;
  st.num_k_blocks = nkb;
  st.causal = view.causal;
  st.seq_len = N;
  st.q_tokens = qT;
  st.k_tokens = kT;
  st.scale = (float)(1.0 / std::sqrt((double)D));
  st.q_block_global = qg.data();
  st.k_block_global = kg.data();
  st.head_meta = meta.data();
  st.idx = idx.data();
  st.kv_off = kv_off.data();
  st.kv_ent = kv_ent.data();
  st.bt_tile = bt_tile.data();
  st.bt_off = bt_off.data();
  st.bt_ent = bt_ent.data();
  st.num_bar_tiles = num_bar_tiles;
  st.total_bars = total_bars;
  const double scale = st.scale;

  // data (exact sizes, so ASan / the cp.async check see any overrun)
  const int64_t nq = qT * Hq * D, nk = kT * Hkv * D;
  vector<uint16_t> q(nq), k(nk), v(nk), dout(nq);
  for (auto &x : q) x = to16<T>(c.data == 1 ? 0.f : (float)(nrand() * c.qscale));
  for (auto &x : k) x = to16<T>((float)nrand());
  for (auto &x : v) x = to16<T>((float)nrand());
  for (auto &x : dout) x = to16<T>((float)nrand());
  emu::clear_buffers();
  emu::register_buffer(q.data(), nq * 2);
  emu::register_buffer(k.data(), nk * 2);
  emu::register_buffer(v.data(), nk * 2);
  emu::register_buffer(dout.data(), nq * 2);
  cpu_state_like cs = {2, 1, 0};
  bool ok = true;
  auto report = [&](const char *what, const Err &e, double tol) {
    double rel = e.max_abs / std::max(1e-30, e.ref_max);
    bool good = rel <= tol;
    printf("    %-20s max|err| %.3e  max|ref| %.3e  rel %.2e %s\n", what, e.max_abs, e.ref_max, rel,
           good ? "" : "  <<<<< FAIL");
    if (!good) ok = false;
  };
  const bool cnt = c.data == 1;
  const double tol = cnt ? 2e-5 : (std::is_same<T, __nv_bfloat16>::value ? 2e-2 : 3e-3);

  /* the oracle's forward arguments for this step, accumulating into o_acc / lse_acc */
  auto fwd_args = [&](double *o_acc, double *lse_acc) {
    mtrain_fwd_step_args_t a = {};
    a.view = &view;
    a.num_kv_heads = Hkv;
    a.head_dim = D;
    a.scale = scale;
    a.dtype = std::is_same<T, __nv_bfloat16>::value ? MTRAIN_BF16 : MTRAIN_F16;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.o_acc = o_acc;
    a.lse_acc = lse_acc;
    return a;
  };

  // ---------------- forward ----------------
  {
    const int64_t no = qT * Hq * D, nl = qT * Hq;
    vector<float> o(no), lse(nl);
    for (int64_t r = 0; r < nl; ++r) {
      bool fresh = cnt || urand() < 0.5;
      lse[r] = fresh ? -INFINITY : (float)(nrand() * 2 + 3);
      for (int d = 0; d < D; ++d) o[r * D + d] = fresh ? 0.f : (float)nrand();
    }
    vector<double> o64(o.begin(), o.end()), lse64(lse.begin(), lse.end());
    mtrain_fwd_step_args_t a = fwd_args(o64.data(), lse64.data());
    if (mtrain_cpu_ref_fwd_step(&cs, &a) != MTRAIN_SUCCESS) {
      printf("oracle failed\n");
      return false;
    }
    const T *qp = (const T *)q.data(), *kp = (const T *)k.data(), *vp = (const T *)v.data();
    for (int kind = 0; kind < 3; ++kind) {
      if (kind != mma2::kFwd4x16 && G % 128 != 0) continue;
      if (only_kind >= 0 && kind != only_kind) continue;
      vector<float> o2 = o, l2 = lse;
      float *op = o2.data(), *lp = l2.data();
      int items = 0, smem = 0, nt = 0;
      std::function<void()> fn;
#define FWD_KIND(KIND)                                                                             \
  if (kind == KIND) {                                                                              \
    using K = mma2::FwdKind<D, KIND>;                                                              \
    using S = mma2::FwdShape<D, K::NW, K::WM, K::QREG>;                                            \
    items = (int)cuda_q_items(&st, S::BM);                                                         \
    smem = S::kSmem;                                                                               \
    nt = S::NT;                                                                                    \
    fn = [&]() {                                                                                   \
      mma2::mma2_fwd_kernel<D, T, K::NW, K::WM, K::QREG, K::MINB>(st, qp, kp, vp, op, lp);         \
    };                                                                                             \
  }
      FWD_KIND(mma2::kFwd4x32)
      FWD_KIND(mma2::kFwd8x16) FWD_KIND(mma2::kFwd4x16) emu::launch(items, smem, fn, true, nt);
      char nm[32];
      snprintf(nm, sizeof nm, "O k%d", kind);
      report(nm, compare(o2.data(), o64.data(), no), tol);
      snprintf(nm, sizeof nm, "LSE k%d", kind);
      report(nm, compare(l2.data(), lse64.data(), nl), cnt ? 1e-5 : 1e-4);
    }
    for (int nwg = 1; nwg <= 2; ++nwg) { /* variant 3: 1 or 2 consumer warpgroups */
      if (nwg == 2 && G % 128 != 0) continue;
      vector<float> o1, l1; // the one-item kernel's output
      for (int persistent = 0; persistent <= fwd_persistent; ++persistent) {
        vector<float> o2 = o, l2 = lse;
        float *op = o2.data(), *lp = l2.data();
        int items = 0, grid = 0, smem = 0, nt = 0, regs = 0;
        std::function<void()> fn;
        const int sms = c.fwd_sms > 0 ? c.fwd_sms : kFwdSms;
#define V3_FWD(NWG)                                                                                \
  if (nwg == NWG && !persistent) {                                                                 \
    using S = wg::FwdShape<D, NWG>;                                                                \
    items = grid = (int)cuda_q_items(&st, S::BM);                                                  \
    smem = S::kSmem;                                                                               \
    nt = S::NT;                                                                                    \
    using R1 = wg::FwdRegs<D, NWG, 1>;                                                             \
    regs = R1::kMoveRegs ? R1::kLaunchRegs : 0;                                                    \
    fn = [&]() { wg::wgmma_fwd_kernel<D, T, NWG>(st, qp, kp, vp, op, lp); };                       \
  } else if (nwg == NWG) {                                                                         \
    using S = wg::FwdShape<D, NWG, 2>;                                                             \
    using PR = wg::PersistRegs<D, NWG>;                                                            \
    items = (int)cuda_q_items(&st, S::BM);                                                         \
    grid = std::min(items, sms * PR::kMinBlocks);                                                  \
    smem = S::kSmem;                                                                               \
    nt = S::NT;                                                                                    \
    regs = PR::kMoveRegs ? PR::kLaunchRegs : 0;                                                    \
    fn = [&]() { wg::wgmma_fwd_persistent_kernel<D, T, NWG>(st, qp, kp, vp, op, lp); };            \
    print_fwd_items<S::BM>(st, grid);                                                              \
  }
        V3_FWD(1)
        V3_FWD(2)
#undef V3_FWD
        emu::set_launch_regs(regs);
        emu::launch(grid, smem, fn, true, nt);
        emu::set_launch_regs(0);
        const char *kn = persistent ? "pers" : "";
        char nm[32];
        snprintf(nm, sizeof nm, "O v3 wg%d%s", nwg, kn);
        report(nm, compare(o2.data(), o64.data(), no), tol);
        snprintf(nm, sizeof nm, "LSE v3 wg%d%s", nwg, kn);
        report(nm, compare(l2.data(), lse64.data(), nl), cnt ? 1e-5 : 1e-4);
        if (!persistent) {
          o1 = o2;
          l1 = l2;
          continue;
        }
        const bool same =
            memcmp(o1.data(), o2.data(), no * 4) == 0 && memcmp(l1.data(), l2.data(), nl * 4) == 0;
        printf("    v3 wg%d persistent (%d CTAs, %d items) vs one CTA per item: %s\n", nwg, grid,
               items, same ? "bitwise equal" : "DIFFER  <<<<< FAIL");
        if (!same) ok = false;
      }
    }
  }
  // ---------------- backward ----------------
  {
    const int64_t nl = qT * Hq;
    // final LSE: the step's own (fresh forward), rows without keys 0; counting data: 0
    vector<double> o64(qT * Hq * D, 0.0), l64(nl, -INFINITY);
    mtrain_fwd_step_args_t a = fwd_args(o64.data(), l64.data());
    mtrain_cpu_ref_fwd_step(&cs, &a);
    vector<float> lse(nl), delta(nl);
    for (int64_t r = 0; r < nl; ++r) {
      lse[r] = cnt ? 0.f : (std::isfinite(l64[r]) ? (float)l64[r] : 0.f);
      delta[r] = cnt ? 0.f : (float)(nrand() * 0.5);
    }
    vector<double> lse_d(lse.begin(), lse.end()), delta_d(delta.begin(), delta.end());
    emu::register_buffer(lse.data(), nl * 4);
    emu::register_buffer(delta.data(), nl * 4);
    vector<float> dq(nq), dk(nk), dv(nk);
    for (auto &x : dq) x = (float)nrand();
    for (auto &x : dk) x = (float)nrand();
    for (auto &x : dv) x = (float)nrand();
    vector<double> dq64(dq.begin(), dq.end()), dk64(dk.begin(), dk.end()),
        dv64(dv.begin(), dv.end());
    mtrain_bwd_step_args_t b = {};
    b.view = &view;
    b.num_kv_heads = Hkv;
    b.head_dim = D;
    b.scale = scale;
    b.dtype = a.dtype;
    b.q = q.data();
    b.k = k.data();
    b.v = v.data();
    b.dout = dout.data();
    b.lse_acc = lse_d.data();
    b.delta_acc = delta_d.data();
    b.dq_acc = dq64.data();
    b.dk_acc = dk64.data();
    b.dv_acc = dv64.data();
    if (mtrain_cpu_ref_bwd_step(&cs, &b) != MTRAIN_SUCCESS) {
      printf("oracle bwd failed\n");
      return false;
    }
    const T *qp = (const T *)q.data(), *kp = (const T *)k.data(), *vp = (const T *)v.data(),
            *dp = (const T *)dout.data();
    const float *lp = lse.data(), *dlp = delta.data();
    // variants: (fused, kv_nw, dq_nw)
    // kv_nw 0: variant 3's first wgmma kernel (wgmma_bwd_kernel, MTRAIN_CUDA_WGMMA_BWD=1), 3:
    // its warp-specialised kernel (wgmma_bwd_ws_kernel, the default); two consumer warpgroups
    // when G % 128 == 0, else one
    struct BV {
      int fused, kv_nw, dq_nw;
    };
    vector<BV> bvs;
    const int wide = G % 128 == 0 ? 8 : 4;
    const BV all[8] = {{0, 4, 4},    {0, 8, 8}, {1, 4, 0},    {1, 8, 0},
                       {0, 0, wide}, {1, 0, 0}, {0, 3, wide}, {1, 3, 0}};
    for (int x = 0; x < 8; ++x) {
      if (all[x].kv_nw == 8 && G % 128 != 0) continue;
      if (only_bwd >= 0 && x != only_bwd) continue;
      bvs.push_back(all[x]);
    }
    // the long-item split as the dispatcher runs it (launch_kv_kernel): the schedule kernel's
    // work list for BN-key items, the kernel over the parts (sk), the reduce of the split parts
    const int sms = c.sms > 0 ? c.sms : 132, cmin = c.cmin > 0 ? c.cmin : CUDA_KV_SPLIT_MIN;
    cuda_step_t sk = st;
    vector<int32_t> work;
    vector<float> dk_part, dv_part;
    int split_total = 0;     // split items over the backward kernels run
    int bar_split_total = 0; // of them bar items
    // a bar tile that is the second of a 128-key pair (walked with the first; no part)
    auto pair_at = [&](int BN, int t) {
      if (BN != 128 || t < 0 || t + 1 >= num_bar_tiles) return false;
      const int32_t *x = &bt_tile[3 * (size_t)t];
      return x[1] % 128 == 0 && x[2] - x[1] == 64 && x[3] == x[0] && x[4] == x[2];
    };
    auto split_prep = [&](int BN, bool verbose) -> int {
      sk = st;
      const int runs = nkb * (G / BN) * Hkv, items = num_bar_tiles + runs;
      if (items <= 0) return (int)cuda_kv_items(&st, BN);
      const int max_parts = items + 2 * sms + 1, max_slots = std::min(4 * sms, max_parts);
      work.assign(CUDA_KV_WORK_HEADER + 4 * (size_t)max_parts, -7);
      dk_part.assign((size_t)max_slots * BN * D, NAN); // NaN: a slot never written shows
      dv_part.assign((size_t)max_slots * BN * D, NAN);
      emu::launch(
          1, 3 * mma2::kSplitThreads * 4,
          [&]() { mma2::kv_split_schedule_kernel(st, BN, cmin, sms, work.data()); }, false,
          mma2::kSplitThreads);
      sk.kv_work = work.data();
      sk.kv_dk_part = dk_part.data();
      sk.kv_dv_part = dv_part.data();
      // the list: every item in order (bar tiles, the second of a pair left out, then the run
      // items), its parts covering its entries in order, at most C entries a part when split,
      // slots 0, 1, ... along the list; C from the total work W
      const int P = work[0], S = work[1], C = work[2];
      const int64_t W = (int64_t)(G / BN) * (kv_off[Hkv * nkb] - kv_off[0]) +
                        (num_bar_tiles ? bt_off[num_bar_tiles] - bt_off[0] : 0);
      const int64_t c_want = std::max<int64_t>(cmin, (W + 2 * sms - 1) / (2 * sms));
      bool good = P <= max_parts && S <= max_slots && C == c_want;
      int p = 0, slot = 0, nsplit = 0, bar_split = 0;
      for (int u = 0; u < items && good; ++u) {
        int e, e_end;
        if (u < num_bar_tiles) {
          if (pair_at(BN, u - 1)) continue;
          e = bt_off[u];
          e_end = bt_off[pair_at(BN, u) ? u + 2 : u + 1];
        } else {
          const int r = u - num_bar_tiles;
          const int ktg = r / Hkv, hk = r % Hkv, kb = ktg / (G / BN), x = hk * nkb + kb;
          e = kv_off[x];
          e_end = kv_off[x + 1];
        }
        const bool split = e_end - e > C;
        nsplit += split;
        bar_split += split && u < num_bar_tiles;
        do {
          const int32_t *w = &work[CUDA_KV_WORK_HEADER + 4 * (size_t)p];
          good = good && p < P && w[0] == u && w[1] == e && w[2] > e - (e == e_end) &&
                 w[2] <= e_end && (!split || w[2] - w[1] <= C) && w[3] == (split ? slot++ : -1);
          e = w[2];
          ++p;
        } while (good && e < e_end);
      }
      good = good && p == P && slot == S && nsplit == work[3];
      if (!good) {
        printf("    work list (BN %d) wrong: parts %d slots %d C %d\n", BN, P, S, C);
        ok = false;
      }
      split_total += work[3];
      bar_split_total += bar_split;
      if (verbose)
        printf("    split BN %d: C %d, %d bar + %d run items -> %d parts, %d items split (%d bar; "
               "%d slots)\n",
               BN, C, num_bar_tiles, runs, P, work[3], bar_split, S);
      return max_parts;
    };
    auto split_done = [&](int BN, float *dkp, float *dvp, float *dkbp, float *dvbp) {
      if (!sk.kv_work) return;
      const int max_parts = num_bar_tiles + nkb * (G / BN) * Hkv + 2 * sms + 1;
      emu::launch(
          max_parts, 0, [&]() { mma2::kv_split_reduce_kernel(sk, BN, dkp, dvp, dkbp, dvbp); }, true,
          mma2::kSplitThreads);
    };
    for (const BV &bv : bvs) {
      // deterministic: with a sink column, the whole backward twice (the emulator runs the CTAs
      // in another random order each time), compared bit for bit
      const int reps = c.sink && !bv.fused ? 2 : 1;
      vector<float> bits_dq, bits_dk, bits_dv;
      for (int rep = 0; rep < reps; ++rep) {
        vector<float> dq2 = dq, dk2 = dk, dv2 = dv;
        float *dqp = dq2.data(), *dkp = dk2.data(), *dvp = dv2.data();
        vector<float> dkb((size_t)total_bars * D, NAN), dvb((size_t)total_bars * D, NAN);
        dkb.reserve(1);
        dvb.reserve(1);
        float *dkbp = dkb.data(), *dvbp = dvb.data();
        emu::red_region(dqp, dq2.size());
        if (!bv.fused) {
          if (bv.dq_nw == 8) {
            using S = mma2::DqShape<D, 8>;
            emu::launch(
                (int)cuda_q_items(&st, S::BM), S::kSmem,
                [&]() { mma2::mma2_bwd_dq_kernel<D, T, 8>(st, qp, kp, vp, dp, lp, dlp, dqp); },
                true, S::NT);
          } else {
            using S = mma2::DqShape<D, 4>;
            emu::launch(
                (int)cuda_q_items(&st, S::BM), S::kSmem,
                [&]() { mma2::mma2_bwd_dq_kernel<D, T, 4>(st, qp, kp, vp, dp, lp, dlp, dqp); },
                true, S::NT);
          }
        }
#define KV_LAUNCH(NW, FU)                                                                          \
  {                                                                                                \
    using S = mma2::KvShape<D, NW>;                                                                \
    emu::launch(                                                                                   \
        split_prep(S::BN, rep == 0), S::kSmem,                                                     \
        [&]() {                                                                                    \
          mma2::mma2_bwd_kv_kernel<D, T, NW, FU>(sk, qp, kp, vp, dp, lp, dlp, dqp, dkp, dvp, dkbp, \
                                                 dvbp);                                            \
        },                                                                                         \
        true, S::NT);                                                                              \
    split_done(S::BN, dkp, dvp, dkbp, dvbp);                                                       \
  }
#define WG_LAUNCH(NWG, FU)                                                                         \
  {                                                                                                \
    using S = wg::BwdShape<D, NWG>;                                                                \
    emu::launch(                                                                                   \
        split_prep(S::BN, rep == 0), S::kSmem,                                                     \
        [&]() {                                                                                    \
          wg::wgmma_bwd_kernel<D, T, NWG, FU>(sk, qp, kp, vp, dp, lp, dlp, dqp, dkp, dvp, dkbp,    \
                                              dvbp);                                               \
        },                                                                                         \
        true, S::NC);                                                                              \
    split_done(S::BN, dkp, dvp, dkbp, dvbp);                                                       \
  }
#define WS_LAUNCH(NWG, FU)                                                                         \
  {                                                                                                \
    using S = wg::WsShape<D, NWG>;                                                                 \
    const int grid = split_prep(S::BN, rep == 0);                                                  \
    emu::set_launch_regs(S::kMoveRegs ? S::kLaunchRegs : 0);                                       \
    emu::launch(                                                                                   \
        grid, S::kSmem,                                                                            \
        [&]() {                                                                                    \
          wg::wgmma_bwd_ws_kernel<D, T, NWG, FU>(sk, qp, kp, vp, dp, lp, dlp, dqp, dkp, dvp, dkbp, \
                                                 dvbp);                                            \
        },                                                                                         \
        true, S::NT);                                                                              \
    emu::set_launch_regs(0);                                                                       \
    split_done(S::BN, dkp, dvp, dkbp, dvbp);                                                       \
  }
        if (bv.kv_nw == 3) {
          if (G % 128 == 0) {
            if (bv.fused) WS_LAUNCH(2, true) else WS_LAUNCH(2, false)
          } else {
            if (bv.fused) WS_LAUNCH(1, true) else WS_LAUNCH(1, false)
          }
        } else if (bv.kv_nw == 0) {
          if (G % 128 == 0) {
            if (bv.fused) WG_LAUNCH(2, true) else WG_LAUNCH(2, false)
          } else {
            if (bv.fused) WG_LAUNCH(1, true) else WG_LAUNCH(1, false)
          }
        } else if (bv.kv_nw == 8) {
          if (bv.fused) KV_LAUNCH(8, true) else KV_LAUNCH(8, false)
        } else {
          if (bv.fused) KV_LAUNCH(4, true) else KV_LAUNCH(4, false)
        }
        // host version of cuda_bars_reduce
        bool bar_ok = true;
        for (int h = 0; h < Hq && bar_ok; ++h) {
          const int hk = h / group, base = meta[h * CUDA_HM_STRIDE + CUDA_HM_BAR_BASE];
          for (size_t bi = 0; bi < hp[h].bars.size(); ++bi) {
            const int64_t j = hp[h].bars[bi];
            for (int d = 0; d < D; ++d) {
              float xk = dkb[(base + bi) * D + d], xv = dvb[(base + bi) * D + d];
              if (std::isnan(xk) || std::isnan(xv)) {
                printf("    bar scratch row %d of head %d not written\n", (int)bi, h);
                ok = false;
                bar_ok = false;
                break;
              }
              dk2[(j * Hkv + hk) * D + d] += xk;
              dv2[(j * Hkv + hk) * D + d] += xv;
            }
            if (!bar_ok) break;
          }
        }
        if (rep == 1) {
          const bool same = memcmp(bits_dq.data(), dq2.data(), nq * 4) == 0 &&
                            memcmp(bits_dk.data(), dk2.data(), nk * 4) == 0 &&
                            memcmp(bits_dv.data(), dv2.data(), nk * 4) == 0;
          printf("    det kv%d twice: %s\n", bv.kv_nw,
                 same ? "bitwise equal" : "DIFFER  <<<<< FAIL");
          if (!same) ok = false;
          continue;
        }
        bits_dq = dq2;
        bits_dk = dk2;
        bits_dv = dv2;
        char nm[48];
        snprintf(nm, sizeof nm, "dQ %s kv%d dq%d", bv.fused ? "fused" : "det", bv.kv_nw,
                 bv.fused ? 0 : bv.dq_nw);
        report(nm, compare(dq2.data(), dq64.data(), nq), cnt ? 3e-3 : tol);
        snprintf(nm, sizeof nm, "dK %s kv%d", bv.fused ? "fused" : "det", bv.kv_nw);
        report(nm, compare(dk2.data(), dk64.data(), nk), cnt ? 3e-3 : tol);
        snprintf(nm, sizeof nm, "dV %s kv%d", bv.fused ? "fused" : "det", bv.kv_nw);
        report(nm, compare(dv2.data(), dv64.data(), nk), tol);
      }
    }
    printf("    split items over the backward kernels: %d (bar items %d)\n", split_total,
           bar_split_total);
  }
  return ok;
}

int main(int argc, char **argv) {
  vector<Cfg> cfgs = {
      // name, G, D, bf16, Hq, Hkv, N, mode, density, nbars, data, random_tiles, qscale, noncausal
      {"single G64 d64 bf16 4:2", 64, 64, true, 4, 2, 300, 0, 0.5, 100, 0, 0, 1.0, 0},
      {"single G128 d128 fp16 4:4", 128, 128, false, 4, 4, 333, 0, 0.6, 150, 0, 1, 1.0, 0},
      {"ring G64 d128 bf16 8:1", 64, 128, true, 8, 1, 450, 1, 0.5, 80, 0, 1, 2.0, 0},
      {"ring G128 d64 fp16 16:2", 128, 64, false, 16, 2, 700, 1, 0.4, 200, 0, 0, 1.0, 0},
      {"single G256 d64 fp16 2:1", 256, 64, false, 2, 1, 600, 0, 0.7, 130, 0, 1, 1.0, 0},
      {"count G64 d64 bf16 4:2", 64, 64, true, 4, 2, 290, 1, 0.6, 150, 1, 1, 0.0, 0},
      {"count G128 d128 fp16 4:1", 128, 128, false, 4, 1, 400, 1, 0.6, 150, 1, 1, 0.0, 0},
      {"N=1 G64 d64 bf16", 64, 64, true, 2, 1, 1, 0, 0.5, 1, 0, 0, 1.0, 0},
      {"N=1 G128 d128 fp16 count", 128, 128, false, 2, 2, 1, 0, 0.5, 1, 1, 0, 0.0, 0},
      {"single G192 d128 bf16 4:2", 192, 128, true, 4, 2, 500, 0, 0.5, 70, 0, 1, 1.0, 0},
      {"count G256 d64 bf16 8:1", 256, 64, true, 8, 1, 777, 1, 0.5, 250, 1, 1, 0.0, 0},
      // variant 2: 64-bar tiles (pairs of bar tiles with 128-key items), dense, larger steps
      {"pairs G128 d128 bf16 8:2 ring", 128, 128, true, 8, 2, 900, 1, 0.3, 330, 0, 0, 1.0, 0},
      {"pairs G256 d128 fp16 4:1", 256, 128, false, 4, 1, 1000, 0, 0.4, 260, 0, 0, 1.0, 0},
      {"dense G128 d128 bf16 2:1", 128, 128, true, 2, 1, 700, 0, 1.0, 0, 0, 0, 1.0, 0},
      {"pairs count G128 d64 fp16 4:2", 128, 64, false, 4, 2, 650, 1, 0.5, 300, 1, 0, 0.0, 0},
      {"dense G256 d64 bf16 4:4 ring", 256, 64, true, 4, 4, 1100, 1, 1.0, 70, 0, 0, 3.0, 0},
      // non-causal steps (mtrain_pattern_create_noncausal's plans): key blocks above the
      // diagonal, the diagonal block unmasked, keys past N masked; N not a multiple of G; the
      // plans of such patterns hold no bars, the last two add some all the same (never masked)
      {"nc single G64 d64 bf16 4:2", 64, 64, true, 4, 2, 300, 0, 0.5, 0, 0, 0, 1.0, 1},
      {"nc ring G128 d128 fp16 8:2", 128, 128, false, 8, 2, 450, 1, 0.5, 0, 0, 0, 1.0, 1},
      {"nc count G64 d128 bf16 4:1 ring", 64, 128, true, 4, 1, 333, 1, 0.6, 0, 1, 0, 0.0, 1},
      {"nc count G128 d64 fp16 8:2", 128, 64, false, 8, 2, 500, 0, 0.5, 0, 1, 0, 0.0, 1},
      {"nc dense G128 d128 bf16 2:1", 128, 128, true, 2, 1, 300, 0, 1.0, 0, 0, 0, 3.0, 1},
      {"nc G256 d64 fp16 4:4 ring bars", 256, 64, false, 4, 4, 900, 1, 0.5, 120, 0, 1, 1.0, 1},
      // the long-item split (sink, cmin, sms last): a sink column in every query block, so that
      // its items are long; N not a multiple of G; deterministic runs twice, bit for bit
      {"sink G64 d64 bf16 4:2 C2", 64, 64, true, 4, 2, 700, 0, 0.3, 0, 0, 0, 1.0, 0, 1, 2, 0},
      {"sink G128 d128 fp16 8:2 ring bars", 128, 128, false, 8, 2, 900, 1, 0.2, 40, 0, 0, 1.0, 0, 1,
       0, 0},
      {"vslash G128 d64 bf16 16:2 8 SMs", 128, 64, true, 16, 2, 1000, 0, 0, 0, 0, 0, 1.0, 0, 2, 3,
       8},
      {"nc sink G64 d128 bf16 4:1 C1", 64, 128, true, 4, 1, 333, 0, 0.3, 0, 0, 0, 1.0, 1, 1, 1, 0},
      {"sink count G128 d64 fp16 4:2 ring", 128, 64, false, 4, 2, 800, 1, 0.3, 60, 1, 1, 0.0, 0, 1,
       2, 0},
      {"sink G64 d128 bf16 4:2 unsplit", 64, 128, true, 4, 2, 500, 0, 0.3, 0, 0, 0, 1.0, 0, 1,
       1000000, 0},
      // bar items split too (C 1): 64-key bar tiles walked in parts, each part's rows summed
      // into the bar scratch rows by the reduce kernel
      {"bars split G64 d64 bf16 4:2 C1", 64, 64, true, 4, 2, 700, 0, 0.2, 120, 0, 1, 1.0, 0, 1, 1,
       0},
      // short items for the persistent forward (fwd_sms last): sparse ring-like steps, so that
      // many query tiles have no key tile or one (a bar tile, a short last block), and each CTA
      // of the small grid loops over items of 0, 1 and more tiles
      {"short G64 d64 fp16 8:2 ring 2 SMs", 64, 64, false, 8, 2, 900, 1, 0.05, 40, 0, 1, 1.0, 0, 0,
       0, 0, 2},
      {"short G128 d128 bf16 4:1 ring 3 SMs", 128, 128, true, 4, 1, 1100, 1, 0.1, 30, 0, 1, 1.0, 0,
       0, 0, 0, 3},
  };
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (const char *e = getenv("MTRAIN_CUDA_WGMMA_FWD_PERSISTENT")) {
    if (*e && strcmp(e, "0") != 0 && strcmp(e, "1") != 0) {
      fprintf(stderr, "MTRAIN_CUDA_WGMMA_FWD_PERSISTENT='%s': expected 0 or 1\n", e);
      return 2;
    }
    fwd_persistent = strcmp(e, "0") != 0;
  }
  printf("variant 3's forward: %s\n",
         fwd_persistent ? "one CTA per item and persistent, compared bit for bit"
                        : "one CTA per item (MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=0)");
  /* the default run (about 220 s on one core): single-rank and ring-like steps, G 64 and 128
   * (128-row tiles, two consumer warpgroups), d 64 and 128, bf16 and fp16, bars in 64-bar
   * pairs and tiles of random size, counting data, N = 1; non-causal steps (16: single-rank,
   * G 64, d 64; 18: ring-like, counting data, d 128); the long-item split with a sink column
   * (22: C 2, G 64, d 64; 25: non-causal, C 1, d 128; 26: ring-like, counting data, G 128);
   * bar items split (28: C 1, G 64, 64-key bar tiles; 14 and 26 split 128-key bar pairs) */
  static const int kQuick[] = {0, 2, 5, 6, 7, 8, 14, 16, 18, 22, 25, 26, 28};
  int only = argc > 1 ? atoi(argv[1]) : -2;
  uint64_t seed = argc > 2 ? strtoull(argv[2], 0, 10) : 7;
  if (argc > 3) only_kind = atoi(argv[3]);
  if (argc > 4) only_bwd = atoi(argv[4]);
  bool all = true;
  for (size_t i = 0; i < cfgs.size(); ++i) {
    if (only >= 0 && (int)i != only) continue;
    if (only == -2 && std::find(std::begin(kQuick), std::end(kQuick), (int)i) == std::end(kQuick))
      continue;
    const Cfg &c = cfgs[i];
    printf("[%zu] %s (seed %llu)\n", i, c.name, (unsigned long long)seed);
    bool ok;
    if (c.D == 64)
      ok = c.bf16 ? run<64, __nv_bfloat16>(c, seed) : run<64, __half>(c, seed);
    else
      ok = c.bf16 ? run<128, __nv_bfloat16>(c, seed) : run<128, __half>(c, seed);
    all = all && ok;
    fflush(stdout);
  }
  printf(all ? "ALL OK\n" : "SOME FAILED\n");
  return all ? 0 : 1;
}
