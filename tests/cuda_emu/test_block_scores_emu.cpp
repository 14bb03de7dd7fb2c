// test_block_scores_emu.cpp: runs the CUDA block-score kernels of SPEC.md section 9
// (backends/cuda/block_scores_kernels.cuh: precise, antidiag, meanpool) on the CPU, in the
// emulator of cuda_emu.h, causal and non-causal (section 9.7), against the cpu-ref backend's
// block_scores slot, the entries a call does not own left at zero. Precise and meanpool: every
// entry bitwise equal (both add in fp64 in the same order without fused multiply-adds, and here
// both take exp() from the same libm). Antidiag: cpu-ref rounds each row's softmax normaliser
// once from an exact fixed-point sum (so that W ranks give bitwise one rank's scores), the
// kernels sum it in fp64 in column order; all its terms are positive, so the kernels' normaliser
// is within (n - 1) u of the exact one (n terms, u = 2^-53) and each score, a ratio to it
// rounded once on both sides, within (n + 2) u of cpu-ref's, with n <= ceil(N / S), the strided
// columns of the longest row. Random inputs per case: lengths mostly not multiples
// of the granularity, GQA, head dims 64 and 128, strides 1 .. 16, fp32, bf16 and fp16 inputs,
// the LSE (of causal or bidirectional attention, fp64 here) in fp32 or fp64, every eighth case
// with more key blocks (and strided columns) than a CTA has threads; every query block
// in the full triangle or square, or a packed subset of them (with a padding block) in the
// compact rows of scores_row. The launch parameters come from the same params_of and
// row_offset as cuda_block_scores.cu's launches.
// Usage: test_block_scores_emu [cases [seed]] (defaults 24 and 5); prints the seed and each case.
#include <math.h>

#include <functional>
#include <random>
#include <vector>

#include "cuda_emu.h"
#include "lse_reference.h"

// the fp64 intrinsics the kernels use (device-only in the CUDA headers): correctly rounded, no
// contraction (separate operations; x86-64 without -mfma has no fused multiply-add anyway)
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }

#include "backends/cuda/block_scores_kernels.cuh"

extern "C" {
#include "core/runtime/backend.h"
#include "mtrain/mtrain.h"
}

namespace emu {
void launch(int grid, int smem_bytes, std::function<void()> k, bool shuffle_blocks, int nt);
}

using std::vector;
static std::mt19937_64 R;
static int irand(int a, int b) { return a + (int)(R() % (uint64_t)(b - a + 1)); } // [a, b]

#define CHECK(x)                                                                                   \
  do {                                                                                             \
    const mtrain_status_t st_ = (x);                                                               \
    if (st_) {                                                                                     \
      fprintf(stderr, "%s: %s (%s)\n", #x, mtrain_status_name(st_), mtrain_last_error());          \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

// The kernels of one call in the emulator, launched as cuda_block_scores launches them.
static void emu_scores(const mtrain_block_scores_args_t *a) {
  bsk::blk_params p = bsk::params_of(a);
  const bool nc = a->noncausal != 0;
  vector<int64_t> blocks(2 * (size_t)p.num_q_blocks);
  for (int lb = 0; lb < p.num_q_blocks; lb++) {
    blocks[lb] = a->q_block_global[lb];
    blocks[p.num_q_blocks + lb] = bsk::row_offset(a, p.nb, lb);
  }
  p.q_block_global = blocks.data();
  p.row_off = blocks.data() + p.num_q_blocks;
  const int items = p.Hq * p.num_q_blocks;
  const int T = bsk::kThreads;
  vector<float> kp;
  vector<double> work;
  auto interleave = [&](int P, int64_t cols) {
    kp.assign((size_t)p.Hkv * P * p.d * cols, NAN);
    const int64_t total = (int64_t)kp.size();
    const int grid = (int)std::min<int64_t>((total + 255) / 256, 16);
    emu::launch(
        grid, 0, [&] { bsk::interleave_kernel(p, P, cols, kp.data()); }, true, 256);
    p.kp = kp.data();
  };
  const int smem_d = (int)sizeof(double) * p.d;
  if (a->method == MTRAIN_BLOCK_PRECISE) {
    interleave(p.G, p.nb);
    emu::launch(
        items, smem_d, [&] { nc ? bsk::precise_kernel<true>(p) : bsk::precise_kernel<false>(p); },
        true, T);
  } else if (a->method == MTRAIN_BLOCK_MEANPOOL) {
    work.assign((size_t)(p.nb * p.Hkv * p.d), NAN);
    p.work = work.data();
    emu::launch((int)(p.nb * p.Hkv), 0, [&] { bsk::kbar_kernel(p); }, true, T);
    emu::launch(
        items, smem_d, [&] { nc ? bsk::meanpool_kernel<true>(p) : bsk::meanpool_kernel<false>(p); },
        true, T);
  } else {
    interleave(p.S, p.ncs);
    work.assign((size_t)items * p.ncs, NAN);
    p.work = work.data();
    emu::launch(
        items, smem_d * p.S,
        [&] { nc ? bsk::antidiag_kernel<true>(p) : bsk::antidiag_kernel<false>(p); }, true, T);
  }
}

// The inputs of a case, held in their storage dtypes.
struct Case {
  int64_t N;
  int G, Hq, Hkv, d, S;
  mtrain_dtype_t dt, lse_dt;
  bool subset;
};

static const char *dname(mtrain_dtype_t t) { return mtrain_dtype_name(t); }

static int run_case(int index, uint64_t seed, mtrain_context_t *ref_ctx[3]) {
  R.seed(seed);
  Case c;
  const int Gs[] = {16, 32, 64};
  int gi = irand(0, 2);
  c.G = Gs[gi];
  c.N = irand(1, 5 * c.G);
  if (c.N % c.G == 0 && irand(0, 3) != 0) c.N += irand(1, c.G - 1); // mostly a partial block
  c.Hkv = irand(1, 2);
  c.Hq = c.Hkv * irand(1, 3);
  if (index % 8 == 7) { // more key blocks and strided columns than a CTA has threads
    c.G = Gs[gi = 0];
    c.N = irand(2049, 2200);
    c.Hkv = 1;
    c.Hq = irand(1, 2);
  }
  c.d = index % 2 ? 128 : 64;
  const int strides[] = {1, 2, 4, 8, 16};
  do c.S = strides[irand(0, 4)];
  while (c.S > c.G);
  const mtrain_dtype_t dts[] = {MTRAIN_F32, MTRAIN_BF16, MTRAIN_F16};
  c.dt = dts[irand(0, 2)];
  c.lse_dt = irand(0, 1) ? MTRAIN_F64 : MTRAIN_F32;
  c.subset = irand(0, 2) == 0;
  const int64_t N = c.N, nb = (N + c.G - 1) / c.G;
  const double scale = 1.0 / sqrt((double)c.d);
  // fp32 values, peaked a little (a shared direction), then the storage dtype and back
  std::normal_distribution<double> nd(0.0, 1.0);
  vector<float> q((size_t)(N * c.Hq * c.d)), k((size_t)(N * c.Hkv * c.d));
  for (float &x : q) x = (float)nd(R);
  for (float &x : k) x = (float)nd(R);
  for (int64_t j = 0; j < N; j += irand(3, 40))
    for (int hk = 0; hk < c.Hkv; hk++) k[(size_t)((j * c.Hkv + hk) * c.d)] += 3.0f;
  const size_t esz = mtrain_dtype_size(c.dt);
  vector<char> qs(esz * q.size()), ks(esz * k.size());
  CHECK(mtrain_convert(q.data(), MTRAIN_F32, qs.data(), c.dt, (int64_t)q.size()));
  CHECK(mtrain_convert(k.data(), MTRAIN_F32, ks.data(), c.dt, (int64_t)k.size()));
  CHECK(mtrain_convert(qs.data(), c.dt, q.data(), MTRAIN_F32, (int64_t)q.size()));
  CHECK(mtrain_convert(ks.data(), c.dt, k.data(), MTRAIN_F32, (int64_t)k.size()));
  // the query blocks of the call: all, or a packed subset (with a padding block id >= nb)
  vector<int64_t> ids;
  for (int64_t b = 0; b < nb; b++)
    if (!c.subset || irand(0, 1)) ids.push_back(b);
  if (c.subset) ids.push_back(nb + irand(0, 2));
  const int nloc = (int)ids.size();
  const int64_t slots = (int64_t)nloc * c.G;
  int bad = 0;
  for (int nc = 0; nc < 2; nc++) {
    // the LSE of causal or bidirectional attention (fp64), in the call's slots
    vector<double> lse64((size_t)(slots * c.Hq), 0.0);
    vector<char> qp(esz * (size_t)(slots * c.Hq * c.d), 0);
    for (int lb = 0; lb < nloc; lb++)
      for (int r = 0; r < c.G; r++) {
        const int64_t i = ids[lb] * c.G + r, s = (int64_t)lb * c.G + r;
        if (i >= N) continue;
        memcpy(qp.data() + esz * (size_t)(s * c.Hq * c.d),
               qs.data() + esz * (size_t)(i * c.Hq * c.d), esz * (size_t)(c.Hq * c.d));
        for (int h = 0; h < c.Hq; h++)
          lse64[(size_t)(s * c.Hq + h)] =
              lse_reference(q.data(), k.data(), N, c.Hq, c.Hkv, c.d, scale, i, h, nc);
      }
    vector<char> lse(mtrain_dtype_size(c.lse_dt) * lse64.size());
    CHECK(mtrain_convert(lse64.data(), MTRAIN_F64, lse.data(), c.lse_dt, (int64_t)lse64.size()));
    // the rows: the full triangle or square, or the compact rows of the subset
    vector<int64_t> row(nloc);
    int64_t R_ = 0;
    for (int lb = 0; lb < nloc; lb++) {
      row[lb] = R_;
      if (ids[lb] < nb) R_ += nc ? nb : ids[lb] + 1;
    }
    const int64_t per_head = c.subset ? R_ : nc ? nb * nb : nb * (nb + 1) / 2;
    for (int mi = 0; mi < 3 && !bad; mi++) {
      const mtrain_block_method_t m = (mtrain_block_method_t)mi;
      vector<double> want((size_t)(per_head * c.Hq), 0.0), got(want.size(), 0.0);
      mtrain_block_scores_args_t a = {};
      a.method = m;
      a.seq_len = N;
      a.granularity = c.G;
      a.num_heads = c.Hq;
      a.num_kv_heads = c.Hkv;
      a.head_dim = c.d;
      a.scale = scale;
      a.stride = c.S;
      a.q_dtype = c.dt;
      a.q = qp.data();
      a.q_tokens = slots;
      a.num_q_blocks = nloc;
      a.q_block_global = ids.data();
      a.k_dtype = c.dt;
      a.k = ks.data();
      a.lse_dtype = c.lse_dt;
      a.lse = m == MTRAIN_BLOCK_PRECISE ? lse.data() : NULL;
      a.scores_row = c.subset ? row.data() : NULL;
      a.scores_head_stride = c.subset ? R_ : 0;
      a.noncausal = nc;
      a.scores = want.data();
      CHECK(mtrain_be_block_scores(ref_ctx[gi], &a));
      a.scores = got.data();
      emu_scores(&a);
      // the bound of the header comment: 0 (bitwise) but for antidiag
      const double bound =
          m == MTRAIN_BLOCK_ANTIDIAG ? (double)((N + c.S - 1) / c.S + 2) * ldexp(1.0, -53) : 0.0;
      int64_t diff = 0, first = -1, nonzero = 0, inexact = 0;
      double worst = 0.0;
      for (size_t e = 0; e < want.size(); e++) {
        nonzero += want[e] != 0.0;
        if (memcmp(&want[e], &got[e], sizeof(double)) == 0) continue;
        const double r = fabs(got[e] - want[e]) / (fabs(want[e]) + 1e-300);
        if (!(r <= worst)) worst = r;
        if (bound > 0.0 && want[e] != 0.0 && r <= bound) {
          inexact++;
          continue;
        }
        if (first < 0) first = (int64_t)e;
        diff++;
      }
      printf("case %d seed %llu: N %lld G %d heads %d/%d d %d S %d %s lse %s %s %s %s: %zu "
             "entries (%lld nonzero), %lld differ, %lld within %.3g (max relative %.3g)\n",
             index, (unsigned long long)seed, (long long)N, c.G, c.Hq, c.Hkv, c.d, c.S, dname(c.dt),
             dname(c.lse_dt), c.subset ? "subset/compact" : "all blocks",
             nc ? "non-causal" : "causal", mtrain_block_method_name(m), want.size(),
             (long long)nonzero, (long long)diff, (long long)inexact, bound, worst);
      if (diff) {
        printf("  FAILED: first entry %lld: emulated cuda %.17g, cpu-ref %.17g (max relative "
               "error %.3g)\n",
               (long long)first, got[(size_t)first], want[(size_t)first], worst);
        bad = 1;
      }
    }
  }
  return bad;
}

int main(int argc, char **argv) {
  const int cases = argc > 1 ? atoi(argv[1]) : 24;
  const uint64_t seed = argc > 2 ? strtoull(argv[2], nullptr, 10) : 5;
  printf("test_block_scores_emu: %d cases, seed %llu\n", cases, (unsigned long long)seed);
  mtrain_context_t *ref[3];
  const int Gs[] = {16, 32, 64};
  for (int g = 0; g < 3; g++) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.backend = "cpu-ref";
    cfg.granularity = Gs[g];
    CHECK(mtrain_context_create(&cfg, NULL, &ref[g]));
  }
  int failed = 0;
  for (int i = 0; i < cases; i++) failed += run_case(i, seed * 1000003ULL + (uint64_t)i, ref);
  for (int g = 0; g < 3; g++) mtrain_context_destroy(ref[g]);
  printf("%s: %d of %d cases differ from cpu-ref\n", failed ? "FAILED" : "passed", failed, cases);
  return failed ? 1 : 0;
}
