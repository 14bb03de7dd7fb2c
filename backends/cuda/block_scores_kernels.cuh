/* block_scores_kernels.cuh (private): the kernels of the block scores of
 * SPEC.md section 9 (cuda_block_scores.cu holds their launches). Every output
 * entry is owned by one thread and built with the additions of the cpu-ref
 * backend in its order, in fp64 without fused multiply-adds, so the two
 * differ only by the last bits of exp(). The keys are first copied (exactly,
 * as fp32) into a layout interleaved by key block (precise) or by stride
 * (antidiag), so that the threads of a warp, each at its own key block or
 * strided column, read consecutive words.
 *
 * The template argument NC selects the non-causal scores of SPEC.md section
 * 9.7 (args.noncausal): every key block of every query block, over all its
 * real keys (padding keys beyond N never count). NC = false is the causal
 * code as it was; the choice is made once per launch, not per element.
 *
 * Written in the subset of CUDA that the CPU emulator of tests/cuda_emu runs
 * (block barriers, shared memory): MTRAIN_CUDA_EMU selects the emulator's
 * shared memory (dynamic: its buffer; static: function statics, as the
 * emulator runs one CTA at a time), so test_block_scores_emu checks these
 * kernels against the cpu-ref backend without a GPU. */
#ifndef MTRAIN_CUDA_BLOCK_SCORES_KERNELS_CUH
#define MTRAIN_CUDA_BLOCK_SCORES_KERNELS_CUH

#include <math.h>
#include <stdint.h>

#include "backends/cuda/cuda_device.cuh"

#ifdef MTRAIN_CUDA_EMU
#define BS_DYN_SMEM(type, name) type *name = (type *)emu::smem_base()
#define BS_SHARED static
#else
#define BS_DYN_SMEM(type, name) extern __shared__ type name[]
#define BS_SHARED __shared__
#endif

/* bsk: internal linkage (the inner unnamed namespace), so that the emulator's
 * CPU build of these kernels links next to the library's host stubs. */
namespace bsk {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ double ld_d(const void *p, mtrain_dtype_t t, int64_t i) {
  switch (t) {
  case MTRAIN_F32:
    return (double)((const float *)p)[i];
  case MTRAIN_BF16:
    return (double)__bfloat162float(((const __nv_bfloat16 *)p)[i]);
  case MTRAIN_F16:
    return (double)__half2float(((const __half *)p)[i]);
  default:
    return ((const double *)p)[i];
  }
}

struct blk_params {
  int64_t N, nb, head_stride, q_tokens, ncs, item0;
  int G, Hq, Hkv, d, S, num_q_blocks;
  double scale;
  mtrain_dtype_t q_dtype, k_dtype, lse_dtype;
  const void *q, *k, *lse;
  const int64_t *q_block_global; /* device [num_q_blocks], then row_off */
  const int64_t *row_off;        /* device [num_q_blocks]: each local block's row in a head */
  double *scores, *work;         /* work: kbar (meanpool) or strided logits (antidiag) */
  const float *kp;               /* interleaved keys: [Hkv][P][d][ceil(N/P)], P = G or S */
  const unsigned *gate;          /* device word or NULL: when it reads 0 every CTA exits (the
                                    tensor-core kernels scored the call, block_scores_mma.cu) */
};

/* The parameters of a call (host side), all but the device arrays
 * (q_block_global, row_off, work, kp): a head's doubles are the compact
 * rows' stride, nb * nb (non-causal) or the triangle. */
inline blk_params params_of(const mtrain_block_scores_args_t *a) {
  blk_params p;
  p.N = a->seq_len;
  p.G = a->granularity;
  p.nb = (p.N + p.G - 1) / p.G;
  p.head_stride = a->scores_row  ? a->scores_head_stride
                  : a->noncausal ? p.nb * p.nb
                                 : p.nb * (p.nb + 1) / 2;
  p.q_tokens = a->q_tokens;
  p.Hq = a->num_heads;
  p.Hkv = a->num_kv_heads;
  p.d = a->head_dim;
  p.S = a->method == MTRAIN_BLOCK_ANTIDIAG ? a->stride : 1;
  p.ncs = (p.N + p.S - 1) / p.S;
  p.num_q_blocks = a->num_q_blocks;
  p.item0 = 0;
  p.scale = a->scale;
  p.q_dtype = a->q_dtype;
  p.k_dtype = a->k_dtype;
  p.lse_dtype = a->lse_dtype;
  p.q = a->q;
  p.k = a->k;
  p.lse = a->lse;
  p.scores = a->scores;
  p.q_block_global = p.row_off = NULL;
  p.work = NULL;
  p.kp = NULL;
  p.gate = NULL;
  return p;
}

/* The offset of local block lb's row within a head: scores_row's, else the
 * full square's (non-causal) or triangle's. */
inline int64_t row_offset(const mtrain_block_scores_args_t *a, int64_t nb, int lb) {
  const int64_t gb = a->q_block_global[lb];
  return a->scores_row ? a->scores_row[lb] : a->noncausal ? gb * nb : gb * (gb + 1) / 2;
}

/* q . k in fp64, x ascending, no fused multiply-add (cpu-ref's dot); the key
 * element x at kr[x * stride] (the interleaved layout). */
__device__ __forceinline__ double dot_kp(const double *q, const float *kr, int64_t stride, int d) {
  double acc = 0.0;
  for (int x = 0; x < d; x++)
    acc = __dadd_rn(acc, __dmul_rn(q[x], (double)kr[(int64_t)x * stride]));
  return acc;
}

/* kp[hk][s][x][c] = k[c P + s][hk][x] (0 beyond N): key j = c P + s of
 * column c; fp32 holds every storage dtype's value exactly. */
__global__ void __launch_bounds__(256)
    interleave_kernel(blk_params p, int P, int64_t cols, float *kp) {
  const int64_t total = (int64_t)p.Hkv * P * p.d * cols;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % cols, r = e / cols;
    const int x = (int)(r % p.d), sp = (int)(r / p.d % P), hk = (int)(r / p.d / P);
    const int64_t j = c * P + sp;
    kp[e] = j < p.N ? (float)ld_d(p.k, p.k_dtype, (j * p.Hkv + hk) * p.d + x) : 0.0f;
  }
}

/* The (head, local query block) of CTA blockIdx.x; false for padding. */
__device__ __forceinline__ bool item_of(const blk_params &p, int *h, int *lb, int64_t *gb,
                                        int *rows) {
  if (p.gate && *p.gate == 0) return false;
  const int64_t item = p.item0 + blockIdx.x;
  *h = (int)(item / p.num_q_blocks);
  *lb = (int)(item % p.num_q_blocks);
  *gb = p.q_block_global[*lb];
  if (*gb >= p.nb) return false;
  *rows = block_rows_dev(p.q_tokens, p.G, *lb, *gb, p.N);
  return *rows > 0;
}

/* 9.1: thread t owns key blocks t, t + kThreads, ... (kb <= gb; NC: every kb
 * < nb); for each it adds exp(s q_i.k_j - lse_i) over rows i ascending, then
 * keys j ascending (j <= i; NC: j < N). */
template <bool NC> __global__ void __launch_bounds__(kThreads) precise_kernel(blk_params p) {
  BS_DYN_SMEM(double, qrow); /* [d] */
  int h, lb, rows;
  int64_t gb;
  if (!item_of(p, &h, &lb, &gb, &rows)) return;
  const int hk = h / (p.Hq / p.Hkv), tid = threadIdx.x;
  double *out = p.scores + (int64_t)h * p.head_stride + p.row_off[lb];
  const float *kp = p.kp + (int64_t)hk * p.G * p.d * p.nb; /* [G][d][nb] */
  const int64_t kend = NC ? p.nb : gb + 1;                 /* the row's key blocks */
  for (int64_t kb0 = 0; kb0 < kend; kb0 += kThreads) {
    const int64_t kb = kb0 + tid;
    const bool active = kb < kend;
    double acc = active ? out[kb] : 0.0;
    for (int r = 0; r < rows; r++) {
      const int64_t slot = (int64_t)lb * p.G + r;
      __syncthreads();
      for (int x = tid; x < p.d; x += kThreads)
        qrow[x] = ld_d(p.q, p.q_dtype, (slot * p.Hq + h) * p.d + x);
      __syncthreads();
      if (!active) continue;
      const int64_t i = gb * p.G + r;
      const double lse = ld_d(p.lse, p.lse_dtype, slot * p.Hq + h);
      const int64_t jend = NC ? p.N : i + 1; /* the keys query i sees end here */
      const int64_t j0 = kb * p.G, j1 = j0 + p.G < jend ? j0 + p.G : jend;
      for (int64_t j = j0; j < j1; j++) {
        const double dot = dot_kp(qrow, kp + (j - j0) * p.d * p.nb + kb, p.nb, p.d);
        acc = __dadd_rn(acc, exp(__dsub_rn(__dmul_rn(p.scale, dot), lse)));
      }
    }
    if (active) out[kb] = acc;
  }
}

/* 9.2: per strided row a of the block: the logits X(a, c) (threads over c,
 * terms ascending), their maximum, exp(X - m) in place, Z by one thread (c
 * ascending), and P added into the key blocks (thread t owns key blocks t,
 * t + kThreads, ...; rows ascending, then c ascending). Causal: columns 0 ..
 * a, terms with key <= query; NC: every column 0 .. ceil(N/S) - 1, terms
 * with a real key. In both only the last column (the edge) can lack a term:
 * an earlier column's term t = 0 has the real query a S and (causal) the key
 * c S + S - 1 < a S, (NC) a key below (ceil(N/S) - 1) S < N. */
template <bool NC> __global__ void __launch_bounds__(kThreads) antidiag_kernel(blk_params p) {
  BS_DYN_SMEM(double, qbuf); /* [S][d]: the queries of the strided row */
  BS_SHARED double red[kThreads];
  BS_SHARED double z_sh;
  BS_SHARED int edge_ok;
  int h, lb, rows;
  int64_t gb;
  if (!item_of(p, &h, &lb, &gb, &rows)) return;
  const int hk = h / (p.Hq / p.Hkv), tid = threadIdx.x, S = p.S, d = p.d;
  double *X = p.work + (int64_t)blockIdx.x * p.ncs;
  const float *kp = p.kp + (int64_t)hk * S * d * p.ncs; /* [S][d][ncs] */
  double *out = p.scores + (int64_t)h * p.head_stride + p.row_off[lb];
  const double sS = __ddiv_rn(p.scale, (double)S);
  const int64_t a_first = gb * p.G / S, a_end = (gb * p.G + rows + S - 1) / S;
  for (int64_t ar = a_first; ar < a_end; ar++) {
    __syncthreads();
    for (int x = tid; x < S * d; x += kThreads) {
      const int sp = x / d;
      const int64_t rl = ar * S + sp - gb * p.G;
      qbuf[x] =
          rl < rows ? ld_d(p.q, p.q_dtype, (((int64_t)lb * p.G + rl) * p.Hq + h) * d + x % d) : 0.0;
    }
    if (tid == 0) edge_ok = 0;
    __syncthreads();
    const int64_t edge = NC ? p.ncs - 1 : ar; /* the last column */
    double m = -INFINITY;
    for (int64_t c = tid; c <= edge; c += kThreads) {
      double sum = 0.0;
      int terms = 0;
      for (int sp = 0; sp < S; sp++) {
        const int64_t i = ar * S + sp, j = c * S + S - 1 - sp;
        if (i >= p.N || i - gb * p.G >= rows || (NC ? j >= p.N : j > i)) continue;
        sum = __dadd_rn(sum, dot_kp(qbuf + sp * d, kp + (S - 1 - sp) * d * p.ncs + c, p.ncs, d));
        terms++;
      }
      const double x = __dmul_rn(sS, sum);
      X[c] = x;
      if (c == edge) edge_ok = terms > 0;
      if (terms > 0 && x > m) m = x;
    }
    red[tid] = m;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (tid < w && red[tid + w] > red[tid]) red[tid] = red[tid + w];
      __syncthreads();
    }
    m = red[0];
    if (m == -INFINITY) continue;                   /* no defined column (uniform across the CTA) */
    const int64_t last = edge_ok ? edge : edge - 1; /* the defined columns are 0 .. last */
    for (int64_t c = tid; c <= last; c += kThreads) X[c] = exp(__dsub_rn(X[c], m));
    __syncthreads();
    if (tid == 0) {
      double Z = 0.0;
      for (int64_t c = 0; c <= last; c++) Z = __dadd_rn(Z, X[c]);
      z_sh = Z;
    }
    __syncthreads();
    const double Z = z_sh;
    const int64_t per = p.G / S; /* strided columns per key block */
    for (int64_t kb = tid; kb * per <= last; kb += kThreads) {
      const int64_t c1 = (kb + 1) * per - 1 < last ? (kb + 1) * per - 1 : last;
      double acc = out[kb];
      for (int64_t c = kb * per; c <= c1; c++) acc = __dadd_rn(acc, __ddiv_rn(X[c], Z));
      out[kb] = acc;
    }
  }
}

/* 9.3, first half: kbar[kb][hk][x], keys ascending, then divided by the count. */
__global__ void __launch_bounds__(kThreads) kbar_kernel(blk_params p) {
  const int64_t kb = blockIdx.x / p.Hkv;
  const int hk = (int)(blockIdx.x % p.Hkv);
  const int64_t j0 = kb * p.G, j1 = j0 + p.G < p.N ? j0 + p.G : p.N;
  for (int x = threadIdx.x; x < p.d; x += kThreads) {
    double sum = 0.0;
    for (int64_t j = j0; j < j1; j++)
      sum = __dadd_rn(sum, ld_d(p.k, p.k_dtype, (j * p.Hkv + hk) * p.d + x));
    p.work[(kb * p.Hkv + hk) * p.d + x] = __ddiv_rn(sum, (double)(j1 - j0));
  }
}

/* 9.3, second half: the block's mean query, then s * (qbar . kbar) per key
 * block (kb <= gb; NC: every kb < nb). */
template <bool NC> __global__ void __launch_bounds__(kThreads) meanpool_kernel(blk_params p) {
  BS_DYN_SMEM(double, qbar); /* [d] */
  int h, lb, rows;
  int64_t gb;
  if (!item_of(p, &h, &lb, &gb, &rows)) return;
  const int hk = h / (p.Hq / p.Hkv);
  for (int x = threadIdx.x; x < p.d; x += kThreads) {
    double sum = 0.0;
    for (int r = 0; r < rows; r++)
      sum = __dadd_rn(sum, ld_d(p.q, p.q_dtype, (((int64_t)lb * p.G + r) * p.Hq + h) * p.d + x));
    qbar[x] = __ddiv_rn(sum, (double)rows);
  }
  __syncthreads();
  double *out = p.scores + (int64_t)h * p.head_stride + p.row_off[lb];
  const int64_t kend = NC ? p.nb : gb + 1;
  for (int64_t kb = threadIdx.x; kb < kend; kb += kThreads) {
    const double *kv = p.work + (kb * p.Hkv + hk) * p.d;
    double dot = 0.0;
    for (int x = 0; x < p.d; x++) dot = __dadd_rn(dot, __dmul_rn(qbar[x], kv[x]));
    out[kb] = __dmul_rn(p.scale, dot);
  }
}

} // namespace
} // namespace bsk

#endif
