/* cuda_block_scores.cu: the block scores of SPEC.md section 9 on the GPU (the
 * block_scores slot). Every output entry is owned by one thread and built
 * with the additions of the cpu-ref backend in its order, in fp64 without
 * fused multiply-adds, so the two differ only by the last bits of exp(). The
 * keys are first copied (exactly, as fp32) into a layout interleaved by key
 * block (precise) or by stride (antidiag), so that the threads of a warp,
 * each at its own key block or strided column, read consecutive words. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "backends/cuda/cuda_device.cuh"
#include "mtrain/mtrain_error.h"

namespace {

constexpr int kThreads = 128;
/* Device scratch of one antidiagonal launch (strided logits of its CTAs). */
constexpr size_t kAntidiagScratch = (size_t)256 << 20;

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
};

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
  const int64_t item = p.item0 + blockIdx.x;
  *h = (int)(item / p.num_q_blocks);
  *lb = (int)(item % p.num_q_blocks);
  *gb = p.q_block_global[*lb];
  if (*gb >= p.nb) return false;
  *rows = block_rows_dev(p.q_tokens, p.G, *lb, *gb, p.N);
  return *rows > 0;
}

/* 9.1: thread t owns key blocks t, t + kThreads, ...; for each it adds
 * exp(s q_i.k_j - lse_i) over rows i ascending, then keys j ascending. */
__global__ void __launch_bounds__(kThreads) precise_kernel(blk_params p) {
  extern __shared__ double qrow[]; /* [d] */
  int h, lb, rows;
  int64_t gb;
  if (!item_of(p, &h, &lb, &gb, &rows)) return;
  const int hk = h / (p.Hq / p.Hkv), tid = threadIdx.x;
  double *out = p.scores + (int64_t)h * p.head_stride + p.row_off[lb];
  const float *kp = p.kp + (int64_t)hk * p.G * p.d * p.nb; /* [G][d][nb] */
  for (int64_t kb0 = 0; kb0 <= gb; kb0 += kThreads) {
    const int64_t kb = kb0 + tid;
    const bool active = kb <= gb;
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
      const int64_t j0 = kb * p.G, j1 = j0 + p.G < i + 1 ? j0 + p.G : i + 1;
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
 * t + kThreads, ...; rows ascending, then c ascending). */
__global__ void __launch_bounds__(kThreads) antidiag_kernel(blk_params p) {
  extern __shared__ double qbuf[]; /* [S][d]: the queries of the strided row */
  __shared__ double red[kThreads];
  __shared__ double z_sh;
  __shared__ int diag_ok;
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
    if (tid == 0) diag_ok = 0;
    __syncthreads();
    double m = -INFINITY;
    for (int64_t c = tid; c <= ar; c += kThreads) {
      double sum = 0.0;
      int terms = 0;
      for (int sp = 0; sp < S; sp++) {
        const int64_t i = ar * S + sp, j = c * S + S - 1 - sp;
        if (i >= p.N || i - gb * p.G >= rows || j > i) continue;
        sum = __dadd_rn(sum, dot_kp(qbuf + sp * d, kp + (S - 1 - sp) * d * p.ncs + c, p.ncs, d));
        terms++;
      }
      const double x = __dmul_rn(sS, sum);
      X[c] = x;
      if (c == ar) diag_ok = terms > 0;
      if (terms > 0 && x > m) m = x;
    }
    red[tid] = m;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (tid < w && red[tid + w] > red[tid]) red[tid] = red[tid + w];
      __syncthreads();
    }
    m = red[0];
    if (m == -INFINITY) continue;               /* no defined column (uniform across the CTA) */
    const int64_t last = diag_ok ? ar : ar - 1; /* the defined columns are 0 .. last */
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

/* 9.3, second half: the block's mean query, then s * (qbar . kbar) per key block. */
__global__ void __launch_bounds__(kThreads) meanpool_kernel(blk_params p) {
  extern __shared__ double qbar[]; /* [d] */
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
  for (int64_t kb = threadIdx.x; kb <= gb; kb += kThreads) {
    const double *kv = p.work + (kb * p.Hkv + hk) * p.d;
    double dot = 0.0;
    for (int x = 0; x < p.d; x++) dot = __dadd_rn(dot, __dmul_rn(qbar[x], kv[x]));
    out[kb] = __dmul_rn(p.scale, dot);
  }
}

bool storage_dtype(mtrain_dtype_t t) {
  return t == MTRAIN_F32 || t == MTRAIN_BF16 || t == MTRAIN_F16;
}

mtrain_status_t check_args(const mtrain_block_scores_args_t *a) {
  if (a->method != MTRAIN_BLOCK_PRECISE && a->method != MTRAIN_BLOCK_ANTIDIAG &&
      a->method != MTRAIN_BLOCK_MEANPOOL)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda block scores: unknown method %d",
                        (int)a->method);
  if (a->seq_len < 1 || a->granularity < 1 || a->num_heads < 1 || a->num_kv_heads < 1 ||
      a->head_dim < 1 || a->num_heads % a->num_kv_heads != 0 || a->num_q_blocks < 0 ||
      a->q_tokens < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda block scores: bad geometry (N %lld, G %d, heads %d/%d, head_dim "
                        "%d, %d query blocks, %lld query slots)",
                        (long long)a->seq_len, a->granularity, a->num_heads, a->num_kv_heads,
                        a->head_dim, a->num_q_blocks, (long long)a->q_tokens);
  if (a->method == MTRAIN_BLOCK_ANTIDIAG && (a->stride < 1 || a->granularity % a->stride != 0))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda block scores: stride %d does not divide the granularity %d",
                        a->stride, a->granularity);
  if (!storage_dtype(a->q_dtype) || !storage_dtype(a->k_dtype))
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                        "cuda block scores: q is %s and k is %s (fp32, bf16 or fp16)",
                        mtrain_dtype_name(a->q_dtype), mtrain_dtype_name(a->k_dtype));
  if (a->k_block_global)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda block scores: key chunks (k_block_global) are not supported: give "
                        "every key");
  if (!a->q || !a->k || !a->scores || (a->num_q_blocks > 0 && !a->q_block_global))
    return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                        "cuda block scores: q, k, scores and q_block_global must be set");
  if (a->method == MTRAIN_BLOCK_PRECISE) {
    if (!a->lse)
      return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                          "cuda block scores: the precise method needs lse");
    if (a->lse_dtype != MTRAIN_F32 && a->lse_dtype != MTRAIN_F64)
      return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                          "cuda block scores: lse is %s (fp32 or fp64)",
                          mtrain_dtype_name(a->lse_dtype));
  }
  return MTRAIN_SUCCESS;
}

/* Queues interleave_kernel into kp and points p->kp at it. */
mtrain_status_t interleave(cuda_state_t *s, blk_params *p, int P, int64_t cols, float *kp) {
  const int64_t total = (int64_t)p->Hkv * P * p->d * cols;
  int64_t grid = (total + 255) / 256;
  if (grid > 65536) grid = 65536;
  interleave_kernel<<<(unsigned)grid, 256, 0, (cudaStream_t)s->stream>>>(*p, P, cols, kp);
  p->kp = kp;
  return cuda_check_launch("interleave_kernel");
}

} // namespace

extern "C" mtrain_status_t cuda_block_scores(void *state, const mtrain_block_scores_args_t *a) {
  cuda_state_t *s = (cuda_state_t *)state;
  mtrain_status_t st = check_args(a);
  if (st) return st;
  if (a->num_q_blocks == 0) return MTRAIN_SUCCESS;
  blk_params p;
  p.N = a->seq_len;
  p.G = a->granularity;
  p.nb = (p.N + p.G - 1) / p.G;
  p.head_stride = a->scores_row ? a->scores_head_stride : p.nb * (p.nb + 1) / 2;
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
  p.work = NULL;
  p.kp = NULL;
  const int64_t items = (int64_t)p.Hq * p.num_q_blocks;
  cudaStream_t stream = (cudaStream_t)s->stream;
  void *dev = NULL;
  int slot = -1;
  /* the global blocks and the rows' offsets (the full triangle's without scores_row) */
  int64_t *blocks = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)p.num_q_blocks);
  if (!blocks) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda block scores: out of memory");
  for (int lb = 0; lb < p.num_q_blocks; lb++) {
    const int64_t gb = a->q_block_global[lb];
    blocks[lb] = gb;
    blocks[p.num_q_blocks + lb] = a->scores_row ? a->scores_row[lb] : gb * (gb + 1) / 2;
  }
  st = cuda_upload_small(s, blocks, sizeof(int64_t) * 2 * (size_t)p.num_q_blocks, &dev, &slot);
  free(blocks);
  if (st) return st;
  p.q_block_global = (const int64_t *)dev;
  p.row_off = p.q_block_global + p.num_q_blocks;
  char who[96];
  snprintf(who, sizeof who, "block scores (%s, granularity %d, head_dim %d)",
           mtrain_block_method_name(a->method), p.G, p.d);
  if (a->method == MTRAIN_BLOCK_PRECISE) {
    const size_t smem = sizeof(double) * (size_t)p.d;
    void *work = NULL;
    st = cuda_scratch(s, sizeof(float) * (size_t)((int64_t)p.Hkv * p.G * p.d * p.nb), &work);
    if (!st) st = interleave(s, &p, p.G, p.nb, (float *)work);
    if (!st)
      st = cuda_prepare_launch(s, (const void *)precise_kernel, who, "precise_kernel", items, 1,
                               smem, NULL);
    if (!st) {
      precise_kernel<<<(unsigned)items, kThreads, smem, stream>>>(p);
      st = cuda_check_launch("precise_kernel");
    }
  } else if (a->method == MTRAIN_BLOCK_MEANPOOL) {
    void *work = NULL;
    st = cuda_scratch(s, sizeof(double) * (size_t)(p.nb * p.Hkv * p.d), &work);
    if (!st)
      st = cuda_prepare_launch(s, (const void *)kbar_kernel, who, "kbar_kernel", p.nb * p.Hkv, 1, 0,
                               NULL);
    const size_t smem = sizeof(double) * (size_t)p.d;
    if (!st)
      st = cuda_prepare_launch(s, (const void *)meanpool_kernel, who, "meanpool_kernel", items, 1,
                               smem, NULL);
    if (!st) {
      p.work = (double *)work;
      kbar_kernel<<<(unsigned)(p.nb * p.Hkv), kThreads, 0, stream>>>(p);
      st = cuda_check_launch("kbar_kernel");
    }
    if (!st) {
      meanpool_kernel<<<(unsigned)items, kThreads, smem, stream>>>(p);
      st = cuda_check_launch("meanpool_kernel");
    }
  } else {
    /* the strided logits of each CTA live in device scratch: launches of at
     * most kAntidiagScratch bytes of it */
    const size_t per_item = sizeof(double) * (size_t)p.ncs;
    int64_t chunk = (int64_t)(kAntidiagScratch / per_item);
    if (chunk < 1) chunk = 1;
    if (chunk > items) chunk = items;
    void *work = NULL;
    const size_t smem = sizeof(double) * (size_t)p.S * (size_t)p.d;
    /* the interleaved keys, then the strided logits (256-byte aligned) */
    const size_t kp_bytes =
        (sizeof(float) * (size_t)((int64_t)p.Hkv * p.S * p.d * p.ncs) + 255) / 256 * 256;
    static cuda_smem_attr_t attr;
    st = cuda_scratch(s, kp_bytes + per_item * (size_t)chunk, &work);
    if (!st) st = interleave(s, &p, p.S, p.ncs, (float *)work);
    if (!st)
      st = cuda_prepare_launch(s, (const void *)antidiag_kernel, who, "antidiag_kernel", chunk, 1,
                               smem, &attr);
    p.work = (double *)((char *)work + kp_bytes);
    for (int64_t i0 = 0; i0 < items && !st; i0 += chunk) {
      p.item0 = i0;
      const int64_t n = items - i0 < chunk ? items - i0 : chunk;
      antidiag_kernel<<<(unsigned)n, kThreads, smem, stream>>>(p);
      st = cuda_check_launch("antidiag_kernel");
    }
  }
  mtrain_status_t st2 = cuda_step_release(s, slot);
  return st ? st : st2;
}
