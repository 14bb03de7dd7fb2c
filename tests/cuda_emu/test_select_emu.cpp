// test_select_emu.cpp: runs the CUDA vertical-slash selection (backends/cuda/select_kernels.cuh)
// on the CPU, in the emulator of cuda_emu.h, against the host selection of libmtrain
// (core/runtime/select.c, wrapped as estimate.c's select_head wraps it): every head's verticals
// and block diagonals must be equal, on random scores with ties, NaN, infinities and -0, forced
// prefixes, top-k budgets of 0, in range and beyond the candidates, top-p budgets with caps below
// and above the candidates and above the GPU's sort of 8192 ranks, walked in one or many chunks
// (the GPU's chunk, or 1 rank up to N: walks that end in the first chunk, in a later one, or
// run through every chunk), with and without the forced prefixes (top_p_forced: sinks and windows
// beyond the candidates, caps below the prefix, forced mass alone above p), lengths that are not
// multiples of the granularity; and the batched selection (one launch of each kernel for 1 to 6
// such sequences, then the packing kernel).
// Usage: test_select_emu [cases [seed]] (defaults 200 and 11; each case runs without and with
// top_p_forced); prints the seed and each case.
#include "backends/cuda/select_kernels.cuh"
#include "cuda_emu.h"
#include <functional>
#include <random>
#include <vector>

extern "C" {
#include "core/runtime/select.h"
}

namespace emu {
void launch(int grid, int smem_bytes, std::function<void()> k, bool shuffle_blocks, int nt);
}

using std::vector;
static std::mt19937_64 R;
static int irand(int a, int b) { return a + (int)(R() % (uint64_t)(b - a + 1)); } // [a, b]
static double urand() { return std::uniform_real_distribution<double>(0, 1)(R); }

// A score drawn so that ties are common and (with `specials`) every special value appears.
static double score(int style, bool specials) {
  const int r = specials ? irand(0, 99) : 99;
  if (r < 2) return NAN;
  if (r < 4) return r == 2 ? INFINITY : -INFINITY;
  if (r < 7) return r % 2 ? -0.0 : 0.0;
  if (style == 0) return (double)irand(0, 6) * 0.125;   // few values: many ties
  if (style == 1) return urand() * 1e-3;                // small masses (top-p sums)
  if (style == 3) return (double)irand(1, 4) * 0x1p-10; // tied masses, exact sums
  if (style == 4) return irand(0, 2) == 0 ? 1.0 : irand(0, 1) ? -0.0 : 0.0; // signed zeros tie
  return std::normal_distribution<double>(0, 1)(R);
}

struct Case {
  int64_t N;
  int G, slots, Hq, sinks, window;
  int top_p_forced;   // 1: top-p heads force the sinks and the window too
  int64_t sort_chunk; // top-p ranks sorted at a time (the GPU's sel::kSortMax, or fewer)
  vector<mtrain_head_budget_t> budgets;
};

static mtrain_head_budget_t random_budget(int64_t N) {
  mtrain_head_budget_t b = {};
  if (irand(0, 1)) {
    b.kind = MTRAIN_BUDGET_TOP_K;
    const int pick = irand(0, 3);
    b.v_size = pick == 0 ? 0 : pick == 1 ? N + irand(0, 5) : irand(1, (int)N);
    b.s_size = irand(0, 3) == 0 ? N + 3 : irand(1, (int)N);
  } else {
    b.kind = MTRAIN_BUDGET_TOP_P;
    // exact multiples of the tied masses of styles 0 and 3 too: sums that hit p exactly
    const int pick = irand(0, 5);
    b.p_v = pick == 0   ? 1.0
            : pick == 1 ? irand(1, 64) * 0x1p-10
            : pick == 2 ? irand(1, 8) * 0.125
                        : urand();
    b.p_s = pick == 0   ? 1e-6
            : pick == 1 ? irand(1, 64) * 0x1p-10
            : pick == 2 ? irand(1, 8) * 0.125
                        : urand();
    b.cap_v = irand(0, 3) == 0 ? N + 7 : irand(1, (int)N);
    b.cap_s = irand(1, (int)N);
  }
  return b;
}

// The host's selection of head h (estimate.c's select_head on select.c's functions).
static void host_select(const Case &c, const double *col, const double *diag, int h,
                        vector<int64_t> &vert, vector<int32_t> &diags) {
  const int64_t N = c.N, G = c.G, nb = (N + G - 1) / G, nv_cand = ((N - 1) / G) * G;
  vector<double> ss(N);
  for (int64_t t = 0; t < N; t++) {
    double sum = 0.0;
    for (int s = 0; s < c.slots; s++) sum += diag[((int64_t)h * N + t) * c.slots + s];
    ss[t] = sum;
  }
  vector<int64_t> order(N + 1), picked(N + 1), tokens(N + 1);
  vector<uint8_t> forced(N + 1, 0);
  const mtrain_head_budget_t &b = c.budgets[h];
  int64_t nv, ns;
  const double *cs = col + (int64_t)h * N;
  if (b.kind == MTRAIN_BUDGET_TOP_K) {
    const int64_t nf_v = c.sinks < nv_cand ? c.sinks : nv_cand, nf_s = c.window < N ? c.window : N;
    for (int64_t i = 0; i < N; i++) forced[i] = i < nf_v;
    nv = mtrain_select_top_k(cs, forced.data(), nv_cand, b.v_size, order.data(), picked.data());
    for (int64_t i = 0; i < N; i++) forced[i] = i < nf_s;
    ns = mtrain_select_top_k(ss.data(), forced.data(), N, b.s_size, order.data(), tokens.data());
  } else {
    const int64_t nf_v = !c.top_p_forced ? 0 : std::min<int64_t>(c.sinks, nv_cand);
    const int64_t nf_s = !c.top_p_forced ? 0 : std::min<int64_t>(c.window, N);
    for (int64_t i = 0; i < N; i++) forced[i] = i < nf_v;
    nv = mtrain_select_top_p(cs, forced.data(), nv_cand, b.p_v, b.cap_v, order.data(),
                             picked.data());
    for (int64_t i = 0; i < N; i++) forced[i] = i < nf_s;
    ns = mtrain_select_top_p(ss.data(), forced.data(), N, b.p_s, b.cap_s, order.data(),
                             tokens.data());
  }
  vert.assign(picked.begin(), picked.begin() + nv);
  diags.assign(2 * ns + 1, 0);
  const int32_t nd = mtrain_token_to_block_diagonals(tokens.data(), ns, c.G, nb, diags.data());
  diags.resize(nd);
}

// One random case and the device selection's buffers (host memory in the emulator).
struct Selected {
  Case c;
  int style = 0;
  bool specials = false;
  int64_t sort_pow2 = 1;
  vector<double> col, diag, sscore;
  vector<int64_t> verts, toks;
  vector<uint8_t> bits;
  vector<int32_t> diags, counts;
  vector<sel::Head> heads;
};

// The kernels' parameters over r's buffers.
static sel::Params params_of(Selected &r) {
  const Case &c = r.c;
  sel::Params p;
  p.N = c.N;
  p.nb = (c.N + c.G - 1) / c.G;
  p.nv_cand = ((c.N - 1) / c.G) * c.G;
  p.G = c.G;
  p.slots = c.slots;
  p.Hq = c.Hq;
  p.top_p_forced = c.top_p_forced;
  p.sort_chunk = c.sort_chunk;
  p.nf_v = std::min<int64_t>(c.sinks, p.nv_cand);
  p.nf_s = std::min<int64_t>(c.window, c.N);
  p.col = r.col.data();
  p.diag = r.diag.data();
  p.sscore = r.sscore.data();
  p.heads = r.heads.data();
  p.verticals = r.verts.data();
  p.tokens = r.toks.data();
  p.bitmap = r.bits.data();
  p.diags = r.diags.data();
  p.counts = r.counts.data();
  return p;
}

static int smem_of(const Selected &r) {
  bool any_top_p = false;
  for (const mtrain_head_budget_t &b : r.c.budgets) any_top_p |= b.kind == MTRAIN_BUDGET_TOP_P;
  return (int)(any_top_p ? sel::smem_bytes(r.sort_pow2) : sel::kSmemFixed);
}

// A random case; with `launch`, selected by slash_sums_kernel and select_kernel. `forced`: the
// case's top-p heads force the sinks and the window (top_p_forced); drawn after everything else,
// so that a seed gives the same scores and budgets either way, with (one time in three) sinks
// and windows up to the whole sequence (prefixes beyond the candidates and the caps).
static Selected select_case(uint64_t seed, bool allow_big, bool launch = true,
                            bool forced = false) {
  R.seed(seed);
  Selected r;
  Case &c = r.c;
  const int big = irand(0, 4) == 0 && allow_big;
  c.N = big ? irand(4000, 12000) : irand(1, 700);
  const int Gs[] = {16, 64, 128};
  c.G = Gs[irand(0, 2)];
  c.slots = irand(1, 3);
  c.Hq = irand(1, 3);
  c.sinks = irand(0, 40);
  c.window = irand(0, 120);

  for (int h = 0; h < c.Hq; h++) c.budgets.push_back(random_budget(c.N));
  r.style = irand(0, 4);
  r.specials = irand(0, 2) == 0;
  const int64_t N = c.N, nb = (N + c.G - 1) / c.G;
  r.col.resize((size_t)c.Hq * N);
  r.diag.resize((size_t)c.Hq * N * c.slots);
  for (double &x : r.col) x = score(r.style, r.specials);
  for (double &x : r.diag) x = score(r.style, r.specials);
  c.top_p_forced = forced ? 1 : 0;
  if (forced && irand(0, 2) == 0) {
    c.sinks = irand(0, (int)N + 5);
    c.window = irand(0, (int)N + 5);
  }
  // the top-p walk's chunk: the GPU's, or smaller so that walks cross chunks (1 to 8 ranks on
  // short sequences, up to 12 chunks on longer ones)
  const int pick = irand(0, 2);
  c.sort_chunk = pick == 0 ? sel::kSortMax
                 : N <= 64 ? irand(1, 8)
                           : irand((int)(N / 12) + 1, (int)N);
  // with small chunks, half the time masses that walks reach late: through several chunks, ties
  // at their boundaries (styles 0, 3 and 4), or to the cap
  if (pick != 0 && irand(0, 1))
    for (mtrain_head_budget_t &b : c.budgets)
      if (b.kind == MTRAIN_BUDGET_TOP_P) b.p_v = b.p_s = irand(0, 1) ? 1.0 : 0.99;
  r.sscore.assign((size_t)c.Hq * N, 0.0);
  r.toks.assign((size_t)c.Hq * N, -1);
  r.bits.assign((size_t)c.Hq * nb, 7);
  r.verts.assign((size_t)c.Hq * N, -1);
  r.diags.assign((size_t)c.Hq * (nb + 1), -1);
  r.counts.assign(2 * c.Hq, -1);
  r.heads.resize(c.Hq);
  int64_t sort_n = 0;
  for (int h = 0; h < c.Hq; h++) {
    const mtrain_head_budget_t &b = c.budgets[h];
    r.heads[h] = sel::Head{
        b.kind == MTRAIN_BUDGET_TOP_P, 0, b.v_size, b.s_size, b.cap_v, b.cap_s, b.p_v, b.p_s};
    if (b.kind == MTRAIN_BUDGET_TOP_P) {
      const int64_t nv_cand = ((N - 1) / c.G) * c.G;
      sort_n = std::max(sort_n, std::max(std::min(b.cap_v, nv_cand), std::min(b.cap_s, N)));
    }
  }
  sort_n = std::min(sort_n, c.sort_chunk);
  while (r.sort_pow2 < sort_n) r.sort_pow2 <<= 1;
  if (!launch) return r;
  const sel::Params p = params_of(r);
  const int sum_blocks = (int)std::min<int64_t>(((int64_t)c.Hq * N + 255) / 256, 64);
  emu::launch(
      sum_blocks, 0, [&] { sel::slash_sums_kernel(p); }, true, sel::kThreads);
  emu::launch(
      2 * c.Hq, smem_of(r), [&] { sel::select_kernel(p); }, true, sel::kThreads);
  return r;
}

// The host's selection of every head of r against r's device outputs; prints the first
// difference and returns 1 when there is one.
static int compare_with_host(const Selected &r) {
  const Case &c = r.c;
  const int64_t N = c.N, nb = (N + c.G - 1) / c.G;
  for (int h = 0; h < c.Hq; h++) {
    vector<int64_t> hv;
    vector<int32_t> hd;
    host_select(c, r.col.data(), r.diag.data(), h, hv, hd);
    const mtrain_head_budget_t &b = c.budgets[h];
    const int nv = r.counts[2 * h], nd = r.counts[2 * h + 1];
    const bool same_v =
        nv == (int)hv.size() && std::equal(hv.begin(), hv.end(), r.verts.begin() + (int64_t)h * N);
    const bool same_d = nd == (int)hd.size() &&
                        std::equal(hd.begin(), hd.end(), r.diags.begin() + (int64_t)h * (nb + 1));
    if (!same_v || !same_d) {
      printf("  head %d (%s v %lld s %lld p_v %.17g p_s %.17g cap_v %lld cap_s %lld): "
             "verticals %d vs host %zu%s, diagonals %d vs host %zu%s\n",
             h, b.kind == MTRAIN_BUDGET_TOP_P ? "top-p" : "top-k", (long long)b.v_size,
             (long long)b.s_size, b.p_v, b.p_s, (long long)b.cap_v, (long long)b.cap_s, nv,
             hv.size(), same_v ? "" : " DIFFER", nd, hd.size(), same_d ? "" : " DIFFER");
      return 1;
    }
  }
  return 0;
}

static int run_case(int index, uint64_t seed, bool forced) {
  const Selected r = select_case(seed, true, true, forced);
  const Case &c = r.c;
  printf("case %d seed %llu%s: N %lld G %d slots %d heads %d sinks %d window %d style %d%s, "
         "top-p chunk %lld\n",
         index, (unsigned long long)seed, forced ? " top_p_forced" : "", (long long)c.N, c.G,
         c.slots, c.Hq, c.sinks, c.window, r.style, r.specials ? " specials" : "",
         (long long)c.sort_chunk);
  return compare_with_host(r);
}

// A batch of 1 to 6 sequences selected as the batched selection does it: one launch of
// slash_sums_batch_kernel and one of select_batch_kernel for all of them (parameter and prefix
// tables), every head against the host's selection, then pack_kernel: every (sequence, head)
// entry's kept verticals and block diagonals one after another, in entry order. `forced`: every
// sequence's top-p heads force the sinks and the window.
static int run_batch_case(int index, uint64_t seed, bool forced) {
  R.seed(seed);
  const int count = irand(1, 6);
  vector<Selected> seqs;
  for (int q = 0; q < count; q++)
    seqs.push_back(select_case(seed * 31 + (uint64_t)q, irand(0, 9) == 0, false, forced));
  vector<sel::Params> params;
  vector<int64_t> first_sums{0}, first_ctas{0};
  int smem = (int)sel::kSmemFixed;
  for (Selected &r : seqs) {
    params.push_back(params_of(r));
    first_sums.push_back(first_sums.back() + (int64_t)r.c.Hq * r.c.N);
    first_ctas.push_back(first_ctas.back() + 2 * (int64_t)r.c.Hq);
    smem = std::max(smem, smem_of(r));
  }
  const int sum_blocks = (int)std::min<int64_t>((first_sums.back() + 255) / 256, 64);
  emu::launch(
      sum_blocks, 0, [&] { sel::slash_sums_batch_kernel(params.data(), first_sums.data(), count); },
      true, sel::kThreads);
  emu::launch((int)first_ctas.back(), smem,
              [&] { sel::select_batch_kernel(params.data(), first_ctas.data(), count); }, true,
              sel::kThreads);
  int bad = 0;
  for (const Selected &r : seqs) bad |= compare_with_host(r);
  vector<sel::PackEntry> entries;
  vector<int32_t> counts;
  vector<int64_t> want_v;
  vector<int32_t> want_d;
  for (const Selected &r : seqs) {
    const int64_t N = r.c.N, nb = (N + r.c.G - 1) / r.c.G;
    for (int h = 0; h < r.c.Hq; h++) {
      const int64_t *v = r.verts.data() + (int64_t)h * N;
      const int32_t *d = r.diags.data() + (int64_t)h * (nb + 1);
      entries.push_back(sel::PackEntry{v, d});
      counts.push_back(r.counts[2 * h]);
      counts.push_back(r.counts[2 * h + 1]);
      want_v.insert(want_v.end(), v, v + r.counts[2 * h]);
      want_d.insert(want_d.end(), d, d + r.counts[2 * h + 1]);
    }
  }
  vector<int64_t> packed_v(want_v.size() + 8, -7);
  vector<int32_t> packed_d(want_d.size() + 8, -7);
  emu::launch(
      (int)entries.size(), (int)sel::kSmemPack,
      [&] { sel::pack_kernel(entries.data(), counts.data(), packed_v.data(), packed_d.data()); },
      true, sel::kThreads);
  const bool same = std::equal(want_v.begin(), want_v.end(), packed_v.begin()) &&
                    std::equal(want_d.begin(), want_d.end(), packed_d.begin()) &&
                    packed_v[want_v.size()] == -7 && packed_d[want_d.size()] == -7;
  printf("batch case %d seed %llu%s: %d sequences (N", index, (unsigned long long)seed,
         forced ? " top_p_forced" : "", count);
  for (const Selected &r : seqs) printf(" %lld", (long long)r.c.N);
  printf("), %zu entries, %zu verticals, %zu diagonals%s%s\n", entries.size(), want_v.size(),
         want_d.size(), bad ? " SELECTION DIFFERS" : "", same ? "" : " PACKING DIFFERS");
  return bad || !same ? 1 : 0;
}

int main(int argc, char **argv) {
  const int cases = argc > 1 ? atoi(argv[1]) : 200;
  const uint64_t seed = argc > 2 ? strtoull(argv[2], nullptr, 10) : 11;
  printf("test_select_emu: %d cases, seed %llu\n", cases, (unsigned long long)seed);
  int failed = 0;
  const int batch_cases = cases / 4 > 4 ? cases / 4 : 4;
  // every case without, then with the forced prefixes of top-p heads (top_p_forced)
  for (int forced = 0; forced <= 1; forced++) {
    for (int i = 0; i < cases; i++) failed += run_case(i, seed * 1000003ULL + (uint64_t)i, forced);
    for (int i = 0; i < batch_cases; i++)
      failed += run_batch_case(i, seed * 7919ULL + (uint64_t)i, forced);
  }
  printf("%s: %d of %d cases differ from the host selection or its packing\n",
         failed ? "FAILED" : "passed", failed, 2 * (cases + batch_cases));
  return failed ? 1 : 0;
}
