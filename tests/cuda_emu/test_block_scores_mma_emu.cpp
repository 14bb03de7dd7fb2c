// test_block_scores_mma_emu.cpp: runs the tensor-core block-score kernels
// (backends/cuda/block_scores_mma.cuh: precise and antidiag, SPEC.md 9.1, 9.2, 9.7) on the CPU,
// in the emulator of cuda_emu.h (mma.sync, ldmatrix and cp.async emulated), against the cpu-ref
// backend's block_scores slot (the fp64 oracle), launched as block_scores_mma.cu launches them.
//
// Random cases (seeds printed): N mostly not a multiple of G, G 64 and 128 (the shapes the backend
// launches them for), GQA, head dims 64 and 128, strides 1 .. 16, bf16
// and fp16 inputs, the LSE (of causal or bidirectional dense attention) in fp32 or fp64, causal
// and non-causal, the query slots past N filled with NaN (never read). Per (case, causality,
// method) three launches:
//  (1) every query block, the full triangle or square: each entry within the tolerance below
//      of cpu-ref's;
//  (2) a packed subset of the query blocks (local order shuffled, with a padding block) in the
//      compact rows of scores_row: bitwise the rows of (1);
//  (3) the same subset in the full triangle or square, the other rows holding a sentinel: the
//      subset's rows bitwise those of (1), every other entry still the sentinel.
// The launches of (1) may come in two chunks (item0), the CTAs in random order.
//
// Tolerance, per entry, relative to the entry w itself (all terms are positive, so relative
// errors of the terms bound the error of their sum):  |got - want| <= rel * want + abs.
// Assumptions: products of bf16 (or fp16) values are exact in fp32; one m16n8k16 step adds its
// 16 products and the accumulator (17 addends) with an error below 2^-21 (|acc| + sum
// |products|): the tensor cores (A100 and later) align the addends to the largest exponent,
// keeping 3 extra bits, truncate, and truncate the sum to fp32 (Fasi et al., "Numerical behavior
// of NVIDIA tensor cores", 2021): 17 2^-26 + 2^-23 < 2^-21 of the largest addend; so a dot of K
// terms by K/16 steps is within (K/16) 2^-21 sum |q_x k_x| (the emulator rounds each step once,
// exactly). ex2.approx.ftz.f32 is within 2^-22 relative (2 ulp); fp32 roundings 2^-24. M = the
// case's largest s sum_x |q_x k_x| over its (query, key) pairs (so |logit| <= M, and for antidiag
// |X| <= M), L = the largest |lse|.
//  - precise: the exponent x = fma(dot, s log2e, -lse log2e) (log2 units) is off by at most
//    log2e [(d/16) 2^-21 M (1 + 2^-24) + (2M + 2L) 2^-24] (the dot, the rounded s log2e, the
//    rounded lse log2e, the FMA), so each term exp(t) by
//      e_t = 1.01 [(d/16) 2^-21 M + (2M + 2L) 2^-24 + 2^-22]
//    relative; the sums: each thread's fp32 sum of its <= 32 MT scores of a tile, a 5-level warp
//    butterfly, then fp64: rel = e_t + (32 MT + 5) 2^-24 + 1e-11 (fp64 and cpu-ref's own sums).
//  - antidiag: X by one GEMM of inner dimension S d, scaled by the rounded s/S: |dX| <=
//    (S d / 16) 2^-21 M + 2 M 2^-24 (the diagonal, fp64 then rounded: M 2^-24); the exponent
//    (X - m) log2e: subtraction and product roundings, 4 M 2^-24 log2e more; so each
//    e = exp(X - m) within e_x = 1.01 [(S d / 16) 2^-21 M + 8 M 2^-24 + 2^-22] (m itself is
//    the same for every column of the row: it cancels in e / Z); E(a, kb) = the sums of e over a
//    key block's columns: a butterfly of <= 3 levels and <= 8 unit sums in fp32 (11 2^-24), then
//    fp64; Z and w = sum E / Z in fp64. rel = 2 (e_x + 11 2^-24) + (nb + G/S + ceil(N/S) + 4)
//    2^-53 (cpu-ref's own P within (n + 2) u).
//  - abs = G^2 2^-124: terms below 2^-126 that ex2.approx.ftz flushes (at most G^2 per entry).
// The test prints, per launch, the largest |got - want| / (rel want + abs) (1 would fail).
// Mutations tried, each failing the default run (16 cases, seed 7) in the cases noted: the causal
// mask dropped on the diagonal block (precise; 16), the LSE of the neighbouring row (16), the last
// key dropped (16), the antidiagonal's causal diagonal left to the GEMM (11), the non-causal edge
// column always defined (5), the second tile of a 128-column key block overwriting the first (2),
// the terms t walked in reverse on the query side (11).
// Usage: test_block_scores_mma_emu [cases [seed]] (defaults 16 and 7).
#include <math.h>

#include <algorithm>
#include <functional>
#include <random>
#include <vector>

#include "cuda_emu.h"
#include "lse_reference.h"

// the fp64 intrinsics of block_scores_kernels.cuh (device-only in the CUDA headers), whose
// parameters and helpers the tensor-core kernels share; its fp64 kernels are not used here
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
#pragma GCC diagnostic ignored "-Wunused-function"

#include "backends/cuda/block_scores_mma.cuh"

extern "C" {
#include "core/runtime/backend.h"
#include "mtrain/mtrain.h"
}

namespace emu {
void launch(int grid, int smem_bytes, std::function<void()> k, bool shuffle_blocks, int nt);
void register_buffer(const void *p, size_t n);
void clear_buffers();
} // namespace emu

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

// One call of the tensor-core kernels in the emulator, as cuda_block_scores and
// block_scores_mma.cu launch it (the blocks longest row first; antidiag scratch per CTA).
static void emu_scores(const mtrain_block_scores_args_t *a, bool two_chunks) {
  bsm::mparams mp;
  mp.p = bsk::params_of(a);
  mp.gate = nullptr;
  const int nq = mp.p.num_q_blocks;
  vector<int64_t> blocks(3 * (size_t)nq);
  vector<std::pair<int64_t, int>> ord;
  for (int lb = 0; lb < nq; lb++) {
    blocks[lb] = a->q_block_global[lb];
    blocks[nq + lb] = bsk::row_offset(a, mp.p.nb, lb);
    ord.push_back({-blocks[lb], lb});
  }
  std::sort(ord.begin(), ord.end());
  for (int x = 0; x < nq; x++) blocks[2 * nq + x] = ord[x].second;
  mp.p.q_block_global = blocks.data();
  mp.p.row_off = blocks.data() + nq;
  mp.order = blocks.data() + 2 * nq;
  const int items = mp.p.Hq * nq;
  const bool nc = a->noncausal != 0, bf16 = a->q_dtype == MTRAIN_BF16;
  const int D = mp.p.d, G = mp.p.G;
  vector<double> E;
  std::function<void()> k;
  int smem;
  if (a->method == MTRAIN_BLOCK_PRECISE) {
    smem = (int)bsm::precise_smem(G, D);
#define PK(D_, T_, MT_)                                                                            \
  k = [&] {                                                                                        \
    nc ? bsm::precise_mma_kernel<D_, T_, MT_, true>(mp)                                            \
       : bsm::precise_mma_kernel<D_, T_, MT_, false>(mp);                                          \
  }
    if (D == 64 && bf16) {
      if (G == 64)
        PK(64, __nv_bfloat16, 1);
      else
        PK(64, __nv_bfloat16, 2);
    } else if (D == 64) {
      if (G == 64)
        PK(64, __half, 1);
      else
        PK(64, __half, 2);
    } else if (bf16) {
      if (G == 64)
        PK(128, __nv_bfloat16, 1);
      else
        PK(128, __nv_bfloat16, 2);
    } else {
      if (G == 64)
        PK(128, __half, 1);
      else
        PK(128, __half, 2);
    }
#undef PK
  } else {
    smem = (int)bsm::antidiag_smem(G, D);
    E.assign((size_t)items * (G / mp.p.S) * mp.p.nb, NAN);
#define AK(D_, T_)                                                                                 \
  k = [&] {                                                                                        \
    nc ? bsm::antidiag_mma_kernel<D_, T_, true>(mp) : bsm::antidiag_mma_kernel<D_, T_, false>(mp); \
  }
    if (D == 64 && bf16)
      AK(64, __nv_bfloat16);
    else if (D == 64)
      AK(64, __half);
    else if (bf16)
      AK(128, __nv_bfloat16);
    else
      AK(128, __half);
#undef AK
  }
  const int chunk = two_chunks && items > 1 ? (items + 1) / 2 : items;
  for (int i0 = 0; i0 < items; i0 += chunk) {
    mp.p.item0 = i0;
    mp.E = E.empty() ? nullptr : E.data();
    emu::launch(std::min(chunk, items - i0), smem, k, true, bsm::kNT);
  }
}

struct Case {
  int64_t N;
  int G, Hq, Hkv, d, S;
  mtrain_dtype_t dt, lse_dt;
};

static const char *dname(mtrain_dtype_t t) { return mtrain_dtype_name(t); }

// The rows of a call: the full triangle or square (compact false) or the compact rows.
static vector<int64_t> rows_of(const vector<int64_t> &ids, int64_t nb, bool nc, bool compact,
                               int64_t *per_head) {
  vector<int64_t> row(ids.size());
  int64_t R_ = 0;
  for (size_t lb = 0; lb < ids.size(); lb++) {
    if (compact) {
      row[lb] = R_;
      if (ids[lb] < nb) R_ += nc ? nb : ids[lb] + 1;
    } else {
      row[lb] = ids[lb] >= nb ? -1 : nc ? ids[lb] * nb : ids[lb] * (ids[lb] + 1) / 2;
    }
  }
  *per_head = compact ? R_ : nc ? nb * nb : nb * (nb + 1) / 2;
  return row;
}

static int run_case(int index, uint64_t seed, mtrain_context_t *ref_ctx[2]) {
  R.seed(seed);
  Case c;
  const int gi = irand(0, 1);
  c.G = gi ? 128 : 64;
  c.N = irand(1, 5 * c.G);
  if (c.N % c.G == 0 && irand(0, 3) != 0) c.N += irand(1, c.G - 1); // mostly a partial block
  c.Hkv = irand(1, 2);
  c.Hq = c.Hkv * irand(1, 3);
  c.d = index % 2 ? 128 : 64;
  const int strides[] = {1, 2, 4, 8, 16};
  c.S = strides[irand(0, 4)];
  c.dt = irand(0, 1) ? MTRAIN_BF16 : MTRAIN_F16;
  c.lse_dt = irand(0, 1) ? MTRAIN_F64 : MTRAIN_F32;
  const int64_t N = c.N, nb = (N + c.G - 1) / c.G;
  const double scale = 1.0 / sqrt((double)c.d);
  std::normal_distribution<double> nd(0.0, 1.0);
  vector<float> q((size_t)(N * c.Hq * c.d)), k((size_t)(N * c.Hkv * c.d));
  for (float &x : q) x = (float)nd(R);
  for (float &x : k) x = (float)nd(R);
  for (int64_t j = 0; j < N; j += irand(3, 40)) // peaked a little: a shared direction
    for (int hk = 0; hk < c.Hkv; hk++) k[(size_t)((j * c.Hkv + hk) * c.d)] += 3.0f;
  const size_t esz = 2;
  vector<char> qs(esz * q.size()), ks(esz * k.size());
  CHECK(mtrain_convert(q.data(), MTRAIN_F32, qs.data(), c.dt, (int64_t)q.size()));
  CHECK(mtrain_convert(k.data(), MTRAIN_F32, ks.data(), c.dt, (int64_t)k.size()));
  CHECK(mtrain_convert(qs.data(), c.dt, q.data(), MTRAIN_F32, (int64_t)q.size()));
  CHECK(mtrain_convert(ks.data(), c.dt, k.data(), MTRAIN_F32, (int64_t)k.size()));
  // M: the largest s sum_x |q_x k_x| over (query, key) pairs of a head
  double M = 0.0;
  for (int h = 0; h < c.Hq; h++) {
    const int hk = h / (c.Hq / c.Hkv);
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < N; j++) {
        double sa = 0.0;
        for (int x = 0; x < c.d; x++)
          sa += fabs((double)q[(size_t)((i * c.Hq + h) * c.d + x)] *
                     k[(size_t)((j * c.Hkv + hk) * c.d + x)]);
        M = std::max(M, scale * sa);
      }
  }
  // the subset: a packed random subset in shuffled order, with a padding block
  vector<int64_t> all, sub;
  for (int64_t b = 0; b < nb; b++) {
    all.push_back(b);
    if (irand(0, 1)) sub.push_back(b);
  }
  std::shuffle(sub.begin(), sub.end(), R);
  sub.insert(sub.begin() + irand(0, (int)sub.size()), nb + irand(0, 2));
  int bad = 0;
  for (int nc = 0; nc < 2 && !bad; nc++) {
    // the call's q slots and LSE for a list of blocks (slots past N: NaN, never read)
    double L = 0.0;
    auto slots_of = [&](const vector<int64_t> &ids, vector<char> &qp, vector<char> &lse) {
      const int64_t slots = (int64_t)ids.size() * c.G;
      vector<double> lse64((size_t)(slots * c.Hq), NAN);
      qp.assign(esz * (size_t)(slots * c.Hq * c.d), (char)0xFF);
      for (size_t lb = 0; lb < ids.size(); lb++)
        for (int r = 0; r < c.G; r++) {
          const int64_t i = ids[lb] * c.G + r, s = (int64_t)lb * c.G + r;
          if (i >= N) continue;
          memcpy(qp.data() + esz * (size_t)(s * c.Hq * c.d),
                 qs.data() + esz * (size_t)(i * c.Hq * c.d), esz * (size_t)(c.Hq * c.d));
          for (int h = 0; h < c.Hq; h++)
            lse64[(size_t)(s * c.Hq + h)] =
                lse_reference(q.data(), k.data(), N, c.Hq, c.Hkv, c.d, scale, i, h, nc);
        }
      lse.assign(mtrain_dtype_size(c.lse_dt) * lse64.size(), 0);
      CHECK(mtrain_convert(lse64.data(), MTRAIN_F64, lse.data(), c.lse_dt, (int64_t)lse64.size()));
      vector<double> back(lse64.size());
      CHECK(mtrain_convert(lse.data(), c.lse_dt, back.data(), MTRAIN_F64, (int64_t)back.size()));
      for (double v : back)
        if (v == v) L = std::max(L, fabs(v));
    };
    vector<char> qa, la, qsub, lsub;
    slots_of(all, qa, la);
    slots_of(sub, qsub, lsub);
    for (int mi = 0; mi < 2 && !bad; mi++) {
      const mtrain_block_method_t m = mi ? MTRAIN_BLOCK_ANTIDIAG : MTRAIN_BLOCK_PRECISE;
      auto args = [&](const vector<int64_t> &ids, const vector<char> &qp, const vector<char> &lse,
                      const vector<int64_t> *row, int64_t per_head, double *out) {
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
        a.q_tokens = (int64_t)ids.size() * c.G;
        a.num_q_blocks = (int)ids.size();
        a.q_block_global = ids.data();
        a.k_dtype = c.dt;
        a.k = ks.data();
        a.lse_dtype = c.lse_dt;
        a.lse = m == MTRAIN_BLOCK_PRECISE ? lse.data() : NULL;
        a.scores_row = row ? row->data() : NULL;
        a.scores_head_stride = row ? per_head : 0;
        a.noncausal = nc;
        a.scores = out;
        return a;
      };
      auto emu_run = [&](const mtrain_block_scores_args_t &a, const vector<char> &qp, bool two) {
        emu::clear_buffers();
        emu::register_buffer(qp.data(), qp.size());
        emu::register_buffer(ks.data(), ks.size());
        emu_scores(&a, two);
        emu::clear_buffers();
      };
      // (1) every block, against cpu-ref
      int64_t tri;
      vector<int64_t> rfull = rows_of(all, nb, nc, false, &tri);
      vector<double> want((size_t)(tri * c.Hq), 0.0), got(want.size(), 0.0);
      mtrain_block_scores_args_t a = args(all, qa, la, NULL, 0, want.data());
      CHECK(mtrain_be_block_scores(ref_ctx[gi], &a));
      a.scores = got.data();
      emu_run(a, qa, irand(0, 1) != 0);
      const double u24 = ldexp(1.0, -24), u22 = ldexp(1.0, -22), u21 = ldexp(1.0, -21),
                   u53 = ldexp(1.0, -53);
      double rel;
      if (m == MTRAIN_BLOCK_PRECISE) {
        const double et = 1.01 * (c.d / 16.0 * u21 * M + (2 * M + 2 * L) * u24 + u22);
        rel = et + (32.0 * (c.G / 64) + 5) * u24 + 1e-11;
      } else {
        const double ex = 1.01 * (c.S * c.d / 16.0 * u21 * M + 8 * M * u24 + u22);
        rel = 2 * (ex + 11 * u24) + (double)(nb + c.G / c.S + (N + c.S - 1) / c.S + 4) * u53;
      }
      const double abs_ = (double)c.G * c.G * ldexp(1.0, -124);
      double worst = 0.0, wantsum = 0.0;
      int64_t first = -1, nerr = 0;
      for (size_t e = 0; e < want.size(); e++) {
        wantsum += want[e];
        const double r = fabs(got[e] - want[e]) / (rel * fabs(want[e]) + abs_);
        if (!(r <= worst)) worst = r;
        if (!(r <= 1.0)) {
          nerr++;
          if (first < 0) first = (int64_t)e;
        }
      }
      printf("case %d seed %llu: N %lld G %d heads %d/%d d %d S %d %s lse %s %s %s: %zu entries "
             "(sum %.6g), M %.3g L %.3g, rel tol %.3g: largest error / tolerance %.3g\n",
             index, (unsigned long long)seed, (long long)N, c.G, c.Hq, c.Hkv, c.d, c.S, dname(c.dt),
             dname(c.lse_dt), nc ? "non-causal" : "causal", mtrain_block_method_name(m),
             want.size(), wantsum, M, L, rel, worst);
      if (nerr) {
        printf("  FAILED: %lld entries beyond the tolerance, first %lld: emulated %.17g, cpu-ref "
               "%.17g\n",
               (long long)nerr, (long long)first, got[(size_t)first], want[(size_t)first]);
        bad = 1;
        break;
      }
      // (2) the subset in compact rows, (3) in the full form with a sentinel elsewhere
      int64_t ph;
      vector<int64_t> rc = rows_of(sub, nb, nc, true, &ph);
      vector<double> gc((size_t)(ph * c.Hq), 0.0);
      a = args(sub, qsub, lsub, &rc, ph, gc.data());
      emu_run(a, qsub, false);
      const double sentinel = -1234.5;
      vector<double> gt(want.size(), sentinel);
      vector<char> owned(want.size(), 0);
      for (int h = 0; h < c.Hq; h++)
        for (int64_t b : sub)
          if (b < nb)
            for (int64_t x = 0; x < (nc ? nb : b + 1); x++) {
              const size_t e = (size_t)(h * tri + rfull[b] + x);
              gt[e] = 0.0;
              owned[e] = 1;
            }
      a = args(sub, qsub, lsub, NULL, 0, gt.data());
      emu_run(a, qsub, false);
      int64_t ndiff = 0;
      for (int h = 0; h < c.Hq; h++)
        for (size_t lb = 0; lb < sub.size(); lb++) {
          const int64_t b = sub[lb];
          if (b >= nb) continue;
          for (int64_t x = 0; x < (nc ? nb : b + 1); x++) {
            const double ref = got[(size_t)(h * tri + rfull[b] + x)];
            ndiff += memcmp(&ref, &gc[(size_t)(h * ph + rc[lb] + x)], 8) != 0;
            ndiff += memcmp(&ref, &gt[(size_t)(h * tri + rfull[b] + x)], 8) != 0;
          }
        }
      for (size_t e = 0; e < gt.size(); e++)
        if (!owned[e]) ndiff += gt[e] != sentinel;
      if (ndiff) {
        printf("  FAILED: the subset's rows differ from the full run's, or an entry of another "
               "row changed (%lld)\n",
               (long long)ndiff);
        bad = 1;
      }
    }
  }
  return bad;
}

int main(int argc, char **argv) {
  const int cases = argc > 1 ? atoi(argv[1]) : 16;
  const uint64_t seed = argc > 2 ? strtoull(argv[2], nullptr, 10) : 7;
  printf("test_block_scores_mma_emu: %d cases, seed %llu\n", cases, (unsigned long long)seed);
  mtrain_context_t *ref[2];
  for (int g = 0; g < 2; g++) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.backend = "cpu-ref";
    cfg.granularity = g ? 128 : 64;
    CHECK(mtrain_context_create(&cfg, NULL, &ref[g]));
  }
  int failed = 0;
  for (int i = 0; i < cases; i++) failed += run_case(i, seed * 1000003ULL + (uint64_t)i, ref);
  for (int g = 0; g < 2; g++) mtrain_context_destroy(ref[g]);
  printf("%s: %d of %d cases outside the tolerance or not bitwise\n", failed ? "FAILED" : "passed",
         failed, cases);
  return failed ? 1 : 0;
}
