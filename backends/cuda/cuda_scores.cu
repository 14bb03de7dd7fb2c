/* cuda_scores.cu: the pattern scores of SPEC.md section 2 on the GPU (the
 * pattern_scores slot, and pattern_scores_batch: the sequences of a batch in
 * one launch). One CTA per (query head, local key block): it
 * computes the logits of the last L queries against the block's keys in
 * fp64 (no fused multiply-add, the reference's dot-product order), a chunk
 * of rows at a time, and applies the stage. Every output entry of a stage
 * is owned by one CTA and accumulated in the order the spec fixes (rows
 * ascending; keys ascending within a block), so the result is deterministic
 * and matches the CPU backends up to the last bits of exp(). */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_device.cuh"
#include "mtrain/mtrain_error.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxRows = 32; /* rows of a chunk (register array bound) */

__device__ __forceinline__ float ld_any(const void *p, mtrain_dtype_t t, int64_t i) {
  switch (t) {
  case MTRAIN_F32:
    return ((const float *)p)[i];
  case MTRAIN_BF16:
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
  case MTRAIN_F16:
    return __half2float(((const __half *)p)[i]);
  default:
    return (float)((const double *)p)[i]; /* not reached: fp64 is refused */
  }
}

__device__ __forceinline__ void atomic_max_double(double *a, double v) {
  unsigned long long *p = (unsigned long long *)a, old = *p, assumed;
  while (__longlong_as_double((long long)old) < v) {
    assumed = old;
    old = atomicCAS(p, assumed, (unsigned long long)__double_as_longlong(v));
    if (old == assumed) break;
  }
}

struct scores_params {
  mtrain_scores_stage_t stage;
  int64_t N, k_tokens;
  int L, G, Hq, Hkv, d, rows_per_chunk, slots;
  double scale;
  mtrain_dtype_t dtype, q_dtype;
  const void *q_last, *k;
  const int64_t *k_block_global; /* device */
  const uint8_t *probs;          /* device */
  const double *row_max, *row_norm;
  double *row_out, *col_out, *diag_out;
};

/* The stage for query head h and local key block lb, by one CTA. */
__device__ void scores_block(const scores_params &p, int lb, int h) {
  extern __shared__ double smem[];
  const int hk = h / (p.Hq / p.Hkv), tid = threadIdx.x;
  const int R = p.rows_per_chunk, G = p.G, d = p.d, L = p.L;
  double *logit = smem;                        /* [R][G] */
  float *qs = (float *)(smem + (size_t)R * G); /* [R][d] */
  const int64_t gb = p.k_block_global[lb], N = p.N;
  const int cols = block_rows_dev(p.k_tokens, G, lb, gb, N);
  if (cols == 0) return;
  const int64_t j0 = gb * G; /* global position of column 0 */
  const int64_t nb = (N + G - 1) / G;
  for (int r0 = 0; r0 < L; r0 += R) {
    const int rows = L - r0 < R ? L - r0 : R;
    /* rows whose query position precedes the block see none of it */
    if (N - L + r0 + rows - 1 < j0) continue;
    __syncthreads();
    for (int x = tid; x < rows * d; x += kThreads) {
      const int rr = x / d, c = x % d;
      qs[x] = ld_any(p.q_last, p.q_dtype, ((int64_t)(r0 + rr) * p.Hq + h) * d + c);
    }
    __syncthreads();
    for (int c = tid; c < cols; c += kThreads) {
      const int64_t jl = (int64_t)lb * G + c;
      double acc[kMaxRows];
#pragma unroll
      for (int rr = 0; rr < kMaxRows; rr++) acc[rr] = 0.0;
      for (int x = 0; x < d; x++) {
        const double kx = (double)ld_any(p.k, p.dtype, (jl * p.Hkv + hk) * d + x);
#pragma unroll
        for (int rr = 0; rr < kMaxRows; rr++)
          if (rr < rows) acc[rr] = __dadd_rn(acc[rr], __dmul_rn((double)qs[rr * d + x], kx));
      }
#pragma unroll
      for (int rr = 0; rr < kMaxRows; rr++)
        if (rr < rows) logit[rr * G + c] = __dmul_rn(p.scale, acc[rr]);
    }
    __syncthreads();
    if (p.stage == MTRAIN_SCORES_ROW_MAX || p.stage == MTRAIN_SCORES_ROW_BLOCK_SUMS) {
      for (int rr = tid; rr < rows; rr += kThreads) {
        const int r = r0 + rr;
        const int64_t qpos = N - L + r, row = (int64_t)h * L + r;
        int n = (int)(qpos - j0 + 1);
        if (n > cols) n = cols;
        if (n <= 0) continue;
        if (p.stage == MTRAIN_SCORES_ROW_MAX) {
          double m = -INFINITY;
          for (int c = 0; c < n; c++) m = fmax(m, logit[rr * G + c]);
          atomic_max_double(&p.row_out[row], m);
        } else {
          double sum = p.row_out[row * nb + gb];
          for (int c = 0; c < n; c++) sum += exp(logit[rr * G + c] - p.row_max[row]);
          p.row_out[row * nb + gb] = sum;
        }
      }
      continue;
    }
    /* SUMS: scores in place, then columns, then diagonals */
    const bool probs = p.probs[h] != 0;
    for (int x = tid; x < rows * cols; x += kThreads) {
      const int rr = x / cols, c = x % cols;
      const int64_t row = (int64_t)h * L + r0 + rr;
      double *s = &logit[rr * G + c];
      if (probs) *s = exp(*s - p.row_max[row]) / p.row_norm[row] / (double)L;
    }
    __syncthreads();
    for (int c = tid; c < cols; c += kThreads) {
      const int64_t j = j0 + c;
      double acc = p.col_out[(int64_t)h * N + j];
      bool any = false;
      for (int rr = 0; rr < rows; rr++)
        if (j <= N - L + r0 + rr) {
          acc += logit[rr * G + c];
          any = true;
        }
      if (any) p.col_out[(int64_t)h * N + j] = acc;
    }
    /* t = N - L + r - j over this chunk's rows and the block's columns */
    const int64_t t_lo = N - L + r0 - (j0 + cols - 1), t_hi = N - L + r0 + rows - 1 - j0;
    for (int64_t t = t_lo + tid; t <= t_hi; t += kThreads) {
      if (t < 0) continue;
      const int64_t lo = N - L - t > 0 ? N - L - t : 0;
      double *slot = &p.diag_out[((int64_t)h * N + t) * p.slots + (gb - lo / G)];
      double acc = *slot;
      bool any = false;
      for (int rr = 0; rr < rows; rr++) {
        const int64_t c = N - L + r0 + rr - t - j0;
        if (c < 0 || c >= cols) continue;
        acc += logit[rr * G + c];
        any = true;
      }
      if (any) *slot = acc;
    }
  }
}

/* The sequences of a batch in one launch (the same stage, heads, head_dim
 * and granularity; one sequence is a batch of one): x-block x of first[count] = the sequences' key
 * blocks in turn is local key block x - first[s] of sequence s (params[s]). */
__global__ void __launch_bounds__(kThreads)
    scores_batch_kernel(const scores_params *params, const int64_t *first, int count) {
  const int64_t x = blockIdx.x;
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  const scores_params p = params[lo];
  scores_block(p, (int)(x - first[lo]), (int)blockIdx.y);
}

} // namespace

/* The kernel's parameters of one sequence's stage (k_block_global and
 * probs are set by the caller to device copies). */
static scores_params params_of(const mtrain_scores_args_t *a) {
  scores_params p;
  memset(&p, 0, sizeof p);
  p.stage = a->stage;
  p.N = a->seq_len;
  p.k_tokens = a->k_tokens;
  p.L = a->last_q;
  p.G = a->granularity;
  p.Hq = a->num_heads;
  p.Hkv = a->num_kv_heads;
  p.d = a->head_dim;
  int R = 4096 / p.G;
  if (R > kMaxRows) R = kMaxRows;
  if (R < 1) R = 1;
  p.rows_per_chunk = R;
  p.slots = mtrain_scores_slots(a->last_q, a->granularity);
  p.scale = a->scale;
  p.dtype = a->dtype;
  p.q_dtype = a->q_dtype;
  p.q_last = a->q_last;
  p.k = a->k;
  p.row_max = a->row_max;
  p.row_norm = a->row_norm;
  p.row_out = a->row_out;
  p.col_out = a->col_out;
  p.diag_out = a->diag_out;
  return p;
}

extern "C" mtrain_status_t
cuda_pattern_scores_batch(cuda_state_t *s, const mtrain_scores_args_t *args, int32_t count) {
  if (count < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "pattern scores: %d sequences (>= 1)", count);
  const mtrain_scores_args_t *a0 = &args[0];
  if (a0->stage != MTRAIN_SCORES_ROW_MAX && a0->stage != MTRAIN_SCORES_ROW_BLOCK_SUMS &&
      a0->stage != MTRAIN_SCORES_SUMS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "pattern scores: unknown stage %d",
                        (int)a0->stage);
  if (a0->num_heads == 0) return MTRAIN_SUCCESS;
  for (int32_t q = 1; q < count; q++)
    if (args[q].stage != a0->stage || args[q].num_heads != a0->num_heads ||
        args[q].num_kv_heads != a0->num_kv_heads || args[q].head_dim != a0->head_dim ||
        args[q].granularity != a0->granularity || args[q].dtype != a0->dtype ||
        args[q].q_dtype != a0->q_dtype || args[q].probs != a0->probs)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "pattern scores: sequence %d of a batch differs from sequence 0 in its "
                          "stage, heads, head_dim, granularity, dtypes or top-p flags",
                          q);
  /* one upload: the parameters, the prefix of key blocks, every sequence's
   * block globals, the per-head probs flags */
  const size_t nh = (size_t)a0->num_heads;
  size_t blocks = 0;
  for (int32_t q = 0; q < count; q++) blocks += (size_t)args[q].num_k_blocks;
  if (blocks == 0) return MTRAIN_SUCCESS;
  const size_t o_first = (size_t)count * sizeof(scores_params),
               o_globals = o_first + (size_t)(count + 1) * sizeof(int64_t),
               o_probs = o_globals + blocks * sizeof(int64_t), bytes = o_probs + nh;
  unsigned char *host = (unsigned char *)malloc(bytes);
  if (!host) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda scores: out of host memory");
  int64_t *first = (int64_t *)(host + o_first), *globals = (int64_t *)(host + o_globals);
  for (size_t h = 0; h < nh; h++) host[o_probs + h] = a0->probs ? a0->probs[h] : 0;
  first[0] = 0;
  for (int32_t q = 0; q < count; q++) {
    const size_t nkb = (size_t)args[q].num_k_blocks;
    memcpy(globals + first[q], args[q].k_block_global, nkb * sizeof(int64_t));
    first[q + 1] = first[q] + (int64_t)nkb;
  }
  /* the parameters point into the upload: its device address comes first */
  void *dev = NULL;
  int slot = -1;
  mtrain_status_t st = cuda_upload_reserve(s, bytes, &dev, &slot);
  if (!st) {
    for (int32_t q = 0; q < count; q++) {
      scores_params p = params_of(&args[q]);
      p.k_block_global = (const int64_t *)((unsigned char *)dev + o_globals) + first[q];
      p.probs = (const uint8_t *)dev + o_probs;
      memcpy(host + (size_t)q * sizeof(scores_params), &p, sizeof p);
    }
    st = cuda_upload_commit(s, slot, host, bytes);
  }
  free(host);
  if (st) {
    if (slot >= 0) cuda_step_release(s, slot);
    return st;
  }
  const int R = params_of(a0).rows_per_chunk, G = a0->granularity, d = a0->head_dim;
  const size_t smem = (size_t)R * G * sizeof(double) + (size_t)R * d * sizeof(float);
  static cuda_smem_attr_t attr;
  char who[64];
  snprintf(who, sizeof who, "scores (granularity %d, head_dim %d)", G, d);
  st = cuda_prepare_launch(s, (const void *)scores_batch_kernel, who, "scores_batch_kernel",
                           (int64_t)blocks, a0->num_heads, smem, &attr);
  if (!st) {
    dim3 grid((unsigned)blocks, (unsigned)a0->num_heads);
    scores_batch_kernel<<<grid, kThreads, smem, (cudaStream_t)s->stream>>>(
        (const scores_params *)dev, (const int64_t *)((unsigned char *)dev + o_first), count);
    st = cuda_check_launch("scores_batch_kernel");
  }
  mtrain_status_t st2 = cuda_step_release(s, slot);
  return st ? st : st2;
}

extern "C" mtrain_status_t cuda_pattern_scores(cuda_state_t *s, const mtrain_scores_args_t *a) {
  if (a->stage != MTRAIN_SCORES_ROW_MAX && a->stage != MTRAIN_SCORES_ROW_BLOCK_SUMS &&
      a->stage != MTRAIN_SCORES_SUMS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "pattern scores: unknown stage %d",
                        (int)a->stage);
  if (a->num_k_blocks == 0 || a->num_heads == 0 || a->last_q == 0) return MTRAIN_SUCCESS;
  return cuda_pattern_scores_batch(s, a, 1);
}
