/* block_scores_mma.cuh (private): the tensor-core kernels of the block scores
 * of SPEC.md 9.1 (precise) and 9.2 (antidiagonal), causal and, with NC, the
 * non-causal 9.7, for bf16 and fp16 q and k (block_scores_mma.cu holds their
 * launches; block_scores_kernels.cuh the exact fp64 kernels). Logits by
 * mma.sync m16n8k16 (products exact, fp32 accumulation), exp by ex2.approx
 * in fp32, fp32 partial sums per thread and key tile, then fixed-order sums
 * into fp64. Not cpu-ref's bits: within the tolerance derived in
 * tests/cuda_emu/test_block_scores_mma_emu.cpp (per entry, relative to the
 * entry itself). Shapes: head_dim 64 or 128, G 64 or 128 (the antidiag
 * kernel is written for G a multiple of 64 up to 256 with G/S dividing 64 or
 * a multiple of 64, but only G 64 and 128 are tested and launched).
 *
 * Determinism: one CTA per (head, local query block); every value it writes
 * is formed from that block's rows and the keys, with additions in an order
 * fixed by (N, G, S, gb) alone (warp butterflies: a + b == b + a, so every
 * lane holds the same bits; smem sums by one thread in a fixed order; no
 * atomics), so a subset of the query blocks (a rank's) gives bitwise the
 * rows of the whole run. blockIdx only picks the (head, block): the local
 * blocks are visited longest row first (order[], host-sorted), the heads of
 * one block together.
 *
 * Precise: Q of the block resident in shared memory, key tiles of 64 keys
 * (a key block is G/64 tiles) through two cp.async stages; warp w owns the
 * 16-row MMA tiles w, w + 4 (G 128). p = ex2(s log2e * dot - lse log2e)
 * (one FFMA), masked (key >= N, causal key > query, padding rows); each
 * thread's fp32 sum over its 32 or 64 scores of a tile, a warp butterfly,
 * and thread 0 adds the warp sums of the key block in (tile, warp) order in
 * fp64 onto the entry.
 *
 * Antidiag: X(a, c) = (s / S) sum_t q_{aS+t} . k_{cS+S-1-t} as a GEMM with
 * the strided columns c as MMA rows (A: a tile of 64 keys cS+S-1-t for one
 * t, warp w its 16) and the block's strided rows as MMA columns (B: rows
 * aS+t of the resident Q), inner dimension S*d walked t-major; the strided
 * rows in groups of 64 (8 MMA column tiles). The causal diagonal column c = a
 * (where terms with key > query drop) is computed apart in fp64 from global
 * memory and replaces the GEMM's value. Pass 1: the exact maximum m_a of
 * the fp32 X over the defined columns. Pass 2 (the same X bits again):
 * e = ex2((X - m_a) log2e), summed per key block (G/S strided columns):
 * a butterfly over min(G/S, 8) lanes, then the 8-column units in order in
 * fp32, added in fp64 into E(a, kb) (device scratch, per CTA). Then Z_a =
 * sum_kb E(a, kb) and w(qb, kb) = sum_a E(a, kb) / Z_a in fp64, ascending.
 * So Z_a is not the exact fixed-point sum of 9.2 (tolerance). */
#ifndef MTRAIN_CUDA_BLOCK_SCORES_MMA_CUH
#define MTRAIN_CUDA_BLOCK_SCORES_MMA_CUH

#include "backends/cuda/attn_mma_common.cuh"
#include "backends/cuda/block_scores_kernels.cuh"

#ifdef MTRAIN_CUDA_EMU
#define BSM_SMEM unsigned char *smem = emu::smem_base()
#else
#define BSM_SMEM extern __shared__ __align__(128) unsigned char smem[]
#endif

namespace bsm {
namespace {

constexpr int kNT = 128; /* 4 warps */
constexpr int kKT = 64;  /* keys (precise) or strided columns (antidiag) per tile */

struct mparams {
  bsk::blk_params p;    /* geometry, inputs, outputs (device q_block_global, row_off) */
  const int64_t *order; /* device [num_q_blocks]: the local blocks, longest row first */
  double *E;            /* antidiag: per CTA [R][nb] doubles */
  const unsigned *gate; /* device word or NULL: when it is not 0 every CTA exits (fp32 keys
                           that the q dtype does not hold exactly: the fp64 kernels score) */
};

/* Shared-memory bytes of a launch. */
inline size_t precise_smem(int G, int D) {
  return (size_t)G * D * 2 + (size_t)2 * kKT * D * 2 + sizeof(float) * 2 * 2 * 4;
}
inline size_t antidiag_smem(int G, int D) {
  return (size_t)G * D * 2 + (size_t)2 * kKT * D * 2 +
         sizeof(float) * (64 * 64 + 4 * 64 + 64 + 64) + sizeof(double) * (size_t)G;
}

/* The (head, local block) of this CTA (heads of one block together, the
 * blocks in order[]); false for padding blocks and blocks without rows. */
__device__ __forceinline__ bool item_of(const mparams &mp, int *h, int *lb, int64_t *gb,
                                        int *rows) {
  const bsk::blk_params &p = mp.p;
  if (mp.gate && *mp.gate != 0) return false;
  const int64_t item = p.item0 + blockIdx.x;
  *h = (int)(item % p.Hq);
  *lb = (int)mp.order[item / p.Hq];
  *gb = p.q_block_global[*lb];
  if (*gb >= p.nb) return false;
  *rows = block_rows_dev(p.q_tokens, p.G, *lb, *gb, p.N);
  return *rows > 0;
}

/* The keys narrowed from fp32 to the q dtype T (the cuda backend's gathered
 * keys of several ranks are fp32 copies of bf16 or fp16 keys): *inexact
 * becomes nonzero when some key is not a value of T (or NaN). */
template <typename T>
__global__ void __launch_bounds__(256)
    narrow_keys_kernel(const float *k32, T *k, int64_t n, unsigned *inexact) {
  unsigned bad = 0;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
       e += (int64_t)gridDim.x * blockDim.x) {
    const float x = k32[e];
    const T y = from_float<T>(x);
    k[e] = y;
    bad |= ld(&y, 0) != x;
  }
  if (bad) atomicOr(inexact, 1u);
}

/* cp.async of `nrows` rows of D 16-bit elements into a swizzled tile at
 * sbase: row r from src(r) (NULL: zero-filled; `any` is a mapped address). */
template <int D, typename T, typename F>
__device__ __forceinline__ void load_tile(uint32_t sbase, int nrows, const T *any, F src) {
  constexpr int CH = D / 8;
  for (int e = threadIdx.x; e < nrows * CH; e += kNT) {
    const int r = e / CH, ch = e % CH;
    const T *g = src(r);
    const int pch = (ch & ~7) | ((ch ^ r) & 7);
    mma::cp_async16(sbase + mma::toff<D>(r, pch), g ? g + ch * 8 : any, g != nullptr);
  }
}

/* 9.1 on tensor cores (MT = G / 64 MMA row tiles per warp). */
template <int D, typename T, int MT, bool NC>
__global__ void __launch_bounds__(kNT) precise_mma_kernel(mparams mp) {
  BSM_SMEM;
  const bsk::blk_params &p = mp.p;
  constexpr int G = 64 * MT, NKS = D / 16, TB = kKT * D * 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  int h, lb, rows;
  int64_t gb;
  if (!item_of(mp, &h, &lb, &gb, &rows)) return;
  const int hk = h / (p.Hq / p.Hkv);
  const T *q = (const T *)p.q, *k = (const T *)p.k;
  const uint32_t sQ = mma::smem_u32(smem), sK = sQ + (uint32_t)(G * D * 2);
  float *part = (float *)(smem + G * D * 2 + 2 * TB); /* [kb parity][MT tiles][4 warps] */
  double *out = p.scores + (int64_t)h * p.head_stride + p.row_off[lb];
  const int64_t kend = NC ? p.nb : gb + 1, ntiles = kend * MT;
  const mma::Frag<D> fr(lane);

  const int64_t N = p.N;
  const int Hkv = p.Hkv;
  auto ksrc = [=](int64_t it) {
    const int64_t j0 = it * kKT; /* tile it = (kb, sub) starts at key kb G + sub 64 */
    return [=](int r) -> const T * {
      const int64_t j = j0 + r;
      return j < N ? k + (j * Hkv + hk) * D : nullptr;
    };
  };
  load_tile<D, T>(sQ, G, q, [&](int r) -> const T * {
    return r < rows ? q + (((int64_t)lb * G + r) * p.Hq + h) * D : nullptr;
  });
  load_tile<D, T>(sK, kKT, k, ksrc(0));
  mma::cp_async_commit();

  /* the rows of this thread: 16 (w + 4i) + g + 8hh; lse in log2 units */
  float lse2[MT][2];
  bool rok[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * (warp + 4 * i) + g + 8 * hh;
      rok[i][hh] = r < rows;
      lse2[i][hh] = rok[i][hh]
                        ? (float)(bsk::ld_d(p.lse, p.lse_dtype, ((int64_t)lb * G + r) * p.Hq + h) *
                                  1.4426950408889634)
                        : 0.f;
    }
  const float sl2 = (float)(p.scale * 1.4426950408889634);

  for (int64_t it = 0; it < ntiles; ++it) {
    mma::cp_async_wait<0>();
    __syncthreads();
    if (tid == 0 && it > 0 && it % MT == 0) { /* key block it / MT - 1 is complete */
      const int64_t kb = it / MT - 1;
      const float *pp = part + (kb & 1) * MT * 4;
      double acc = out[kb];
      for (int x = 0; x < MT * 4; ++x) acc += (double)pp[x];
      out[kb] = acc;
    }
    if (it + 1 < ntiles) {
      load_tile<D, T>(sK + (uint32_t)(((it + 1) & 1) * TB), kKT, k, ksrc(it + 1));
      mma::cp_async_commit();
    }
    const uint32_t sk = sK + (uint32_t)((it & 1) * TB);
    float s[MT][8][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int n = 0; n < 8; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < NKS; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
        mma::ldsm_x4(sQ + fr.A(16 * (warp + 4 * i), 2 * kk), a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0, b1, b2, b3;
        mma::ldsm_x4(sk + fr.B(np * 16, 2 * kk), b0, b1, b2, b3);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma::mma16816<T>(s[i][2 * np], a[i], b0, b1);
          mma::mma16816<T>(s[i][2 * np + 1], a[i], b2, b3);
        }
      }
    }
    const int64_t j0 = it * kKT, i0 = gb * G;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int64_t qi = i0 + 16 * (warp + 4 * i) + g + 8 * hh;
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t j = j0 + 8 * n + 2 * t4 + e;
            const bool ok = rok[i][hh] && j < p.N && (NC || j <= qi);
            const float x = mma::fast_exp2(fmaf(s[i][n][2 * hh + e], sl2, -lse2[i][hh]));
            sum += ok ? x : 0.f;
          }
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) part[((it / MT) & 1) * MT * 4 + (it % MT) * 4 + warp] = sum;
  }
  __syncthreads();
  if (tid == 0) {
    const int64_t kb = kend - 1;
    const float *pp = part + (kb & 1) * MT * 4;
    double acc = out[kb];
    for (int x = 0; x < MT * 4; ++x) acc += (double)pp[x];
    out[kb] = acc;
  }
}

/* 9.2 on tensor cores (see the file comment). */
template <int D, typename T, bool NC>
__global__ void __launch_bounds__(kNT) antidiag_mma_kernel(mparams mp) {
  BSM_SMEM;
  const bsk::blk_params &p = mp.p;
  constexpr int NKS = D / 16, TB = kKT * D * 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  int h, lb, rows;
  int64_t gb;
  if (!item_of(mp, &h, &lb, &gb, &rows)) return;
  const int G = p.G, S = p.S, R = G / S; /* strided rows of the block = columns of a key block */
  const int hk = h / (p.Hq / p.Hkv);
  const T *q = (const T *)p.q, *k = (const T *)p.k;
  const uint32_t sQ = mma::smem_u32(smem), sK = sQ + (uint32_t)(G * D * 2);
  float *us = (float *)(smem + G * D * 2 + 2 * TB); /* [64 rows][64 units] */
  float *mxw = us + 64 * 64;                        /* [4 warps][64 rows] */
  float *mrow = mxw + 4 * 64;                       /* [64]: m_a of the group's rows */
  float *diag = mrow + 64;                          /* [64]: causal X(a, a) (-inf: undefined) */
  double *zrow = (double *)(diag + 64);             /* [R]: Z_a (0: row without columns) */
  double *out = p.scores + (int64_t)h * p.head_stride + p.row_off[lb];
  double *E = mp.E + (int64_t)blockIdx.x * R * p.nb;
  const int64_t kend = NC ? p.nb : gb + 1, a_blk = gb * R;
  const int rreal = (rows + S - 1) / S; /* strided rows with a real query */
  const float sS = (float)(p.scale / S);
  const int U = R < 8 ? R : 8; /* columns per unit sum */
  const mma::Frag<D> fr(lane);

  load_tile<D, T>(sQ, G, q, [&](int r) -> const T * {
    return r < rows ? q + (((int64_t)lb * G + r) * p.Hq + h) * D : nullptr;
  });
  mma::cp_async_commit();

  for (int r0 = 0; r0 < rreal; r0 += 64) { /* a group of up to 64 strided rows */
    const int nr = rreal - r0 < 64 ? rreal - r0 : 64, ntl = (nr + 7) / 8;
    /* the strided columns this group sees: 0 .. ncol - 1 */
    const int64_t ncol = NC ? p.ncs : a_blk + r0 + nr;
    const int64_t nct = (ncol + kKT - 1) / kKT, nit = nct * S;
    __syncthreads(); /* the previous group's smem readers are done */
    if (!NC)
      for (int x = tid; x < nr; x += kNT) { /* the causal diagonal, terms t >= S / 2, in fp64 */
        const int64_t a = a_blk + r0 + x;
        double dot = 0.0;
        int terms = 0;
        for (int t = S / 2; t < S && (r0 + x) * S + t < rows; ++t, ++terms) {
          const int64_t j = a * S + S - 1 - t;
          const int64_t qs = (((int64_t)lb * G + (int64_t)(r0 + x) * S + t) * p.Hq + h) * D;
          for (int y = 0; y < D; ++y)
            dot +=
                bsk::ld_d(q, p.q_dtype, qs + y) * bsk::ld_d(k, p.k_dtype, (j * p.Hkv + hk) * D + y);
        }
        diag[x] = terms ? (float)(p.scale / S * dot) : -INFINITY;
      }
    /* X of the thread's elements for the tile just computed: column
     * c = c0 + 16 warp + g + 8 (e >> 1), group row x = 8 j + 2 t4 + (e & 1) */
    auto xval = [&](float acc, int64_t c, int x) -> float {
      const int64_t a = a_blk + r0 + x;
      if (x >= nr || c >= ncol) return -INFINITY;
      if (NC) {
        if (c == p.ncs - 1) { /* the edge column: a term with a real key and query? */
          const int64_t lo = c * S + S - p.N, hi = p.N - a * S;
          if ((lo > 0 ? lo : 0) >= (hi < S ? hi : S)) return -INFINITY;
        }
        return acc * sS;
      }
      if (c > a) return -INFINITY;
      return c == a ? diag[x] : acc * sS;
    };
    for (int pass = 0; pass < 2; ++pass) {
      float mx[8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j) mx[j][0] = mx[j][1] = -INFINITY;
      const int64_t N = p.N;
      const int Hkv = p.Hkv;
      auto ksrc = [=](int64_t it) {
        const int64_t c0 = it / S * kKT, t = it % S;
        return [=](int r) -> const T * {
          const int64_t c = c0 + r, j = c * S + S - 1 - t;
          return c < ncol && j < N ? k + (j * Hkv + hk) * D : nullptr;
        };
      };
      load_tile<D, T>(sK, kKT, k, ksrc(0));
      mma::cp_async_commit();
      float acc[8][4];
      for (int64_t it = 0; it < nit; ++it) {
        const int t = (int)(it % S);
        const int64_t c0 = it / S * kKT;
        mma::cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < nit) {
          load_tile<D, T>(sK + (uint32_t)(((it + 1) & 1) * TB), kKT, k, ksrc(it + 1));
          mma::cp_async_commit();
        }
        if (t == 0) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        }
        const uint32_t sk = sK + (uint32_t)((it & 1) * TB);
#pragma unroll
        for (int q2 = 0; q2 < NKS / 2; ++q2) { /* k-slices 2 q2 and 2 q2 + 1 */
          uint32_t a0[4], a1[4];
          mma::ldsm_x4(sk + fr.A(16 * warp, 4 * q2), a0[0], a0[1], a0[2], a0[3]);
          mma::ldsm_x4(sk + fr.A(16 * warp, 4 * q2 + 2), a1[0], a1[1], a1[2], a1[3]);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (j >= ntl) break;
            int x = 8 * j + (lane & 7);
            if (x >= nr) x = 0; /* a row past the group: any row (its result is dropped) */
            const int rr = (r0 + x) * S + t, ch = 4 * q2 + (lane >> 3);
            uint32_t b0, b1, b2, b3;
            mma::ldsm_x4(sQ + mma::toff<D>(rr, (ch & ~7) | ((ch ^ rr) & 7)), b0, b1, b2, b3);
            mma::mma16816<T>(acc[j], a0, b0, b1);
            mma::mma16816<T>(acc[j], a1, b2, b3);
          }
        }
        if (t != S - 1) continue;
        /* the tile's X are complete */
        if (pass == 0) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float x =
                  xval(acc[j][e], c0 + 16 * warp + g + 8 * (e >> 1), 8 * j + 2 * t4 + (e & 1));
              mx[j][e & 1] = fmaxf(mx[j][e & 1], x);
            }
          continue;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int x = 8 * j + 2 * t4 + (e & 1), cl = 16 * warp + g + 8 * (e >> 1);
            const float xv = xval(acc[j][e], c0 + cl, x);
            float v =
                xv == -INFINITY ? 0.f : mma::fast_exp2((xv - mrow[x < 64 ? x : 0]) * mma::kLog2e);
            for (int o = 4; o < 4 * U; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (g % U == 0 && x < nr) us[x * 64 + cl / U] = v;
          }
        __syncthreads();
        /* per (row, key block of the tile): its units in order, then into E */
        const int per = R < kKT ? R : kKT, nseg = kKT / per, upseg = per / U;
        for (int e = tid; e < nr * nseg; e += kNT) {
          const int x = e / nseg, sg = e % nseg;
          const int64_t cf = c0 + (int64_t)sg * per;
          if (cf >= ncol || mrow[x] == -INFINITY) continue;
          float sum = 0.f;
          for (int u = 0; u < upseg; ++u) sum += us[x * 64 + sg * upseg + u];
          double *ep = E + (int64_t)(r0 + x) * p.nb + cf / R;
          *ep = (cf % R == 0 ? 0.0 : *ep) + (double)sum;
        }
      }
      if (pass == 0) { /* the group's row maxima: lanes of one t4, then the warps */
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float m = mx[j][e];
            for (int o = 4; o < 32; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            if (g == 0) mxw[warp * 64 + 8 * j + 2 * t4 + e] = m;
          }
        __syncthreads();
        for (int x = tid; x < 64; x += kNT) {
          float m = mxw[x];
          for (int w = 1; w < 4; ++w) m = fmaxf(m, mxw[w * 64 + x]);
          mrow[x] = x < nr ? m : -INFINITY;
        }
      }
      mma::cp_async_wait<0>();
      __syncthreads();
    }
    /* Z_a of the group's rows, key blocks ascending */
    for (int x = tid; x < nr; x += kNT) {
      double z = 0.0;
      if (mrow[x] != -INFINITY)
        for (int64_t kb = 0; kb < kend; ++kb) z += E[(int64_t)(r0 + x) * p.nb + kb];
      zrow[r0 + x] = z;
    }
  }
  __syncthreads();
  /* w(qb, kb) = sum over strided rows ascending of E(a, kb) / Z_a */
  for (int64_t kb = tid; kb < kend; kb += kNT) {
    double w = 0.0;
    for (int x = 0; x < rreal; ++x)
      if (zrow[x] > 0.0) w += E[(int64_t)x * p.nb + kb] / zrow[x];
    out[kb] += w;
  }
}

} // namespace
} // namespace bsm

#endif
