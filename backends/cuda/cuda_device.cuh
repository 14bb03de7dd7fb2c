/* cuda_device.cuh (private): device-side helpers shared by the CUDA kernels:
 * element loads and stores of the storage dtypes, the step accessors
 * (runs, segments, bars of a head), the valid-rows rule for padding, and the
 * LSE merge of a step's partial result into the running O/LSE. */
#ifndef MTRAIN_CUDA_DEVICE_CUH
#define MTRAIN_CUDA_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "backends/cuda/cuda_internal.h"

/* Storage element <-> float. */
__device__ __forceinline__ float ld(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16 *p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ float ld(const __half *p, int64_t i) { return __half2float(p[i]); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

/* Valid rows of local block lb (global gb) of a side with `tokens` tokens. */
__device__ __forceinline__ int block_rows_dev(int64_t tokens, int32_t G, int32_t lb, int64_t gb,
                                              int64_t seq_len) {
  int64_t local_left = tokens - (int64_t)lb * G;
  int64_t global_left = seq_len - gb * G;
  int64_t n = local_left < global_left ? local_left : global_left;
  if (n > G) n = G;
  return n < 0 ? 0 : (int)n;
}

/* Accessors of head h's step arrays. */
struct head_view {
  const int32_t *run_off, *runs, *seg_off, *segs, *bars;
  int32_t num_bars, bar_base;
};

__device__ __forceinline__ head_view head_of(const cuda_step_t &s, int h) {
  const int32_t *m = s.head_meta + (int64_t)h * CUDA_HM_STRIDE;
  head_view v;
  v.run_off = s.idx + m[CUDA_HM_RUN_OFF];
  v.runs = s.idx + m[CUDA_HM_RUNS];
  v.seg_off = s.idx + m[CUDA_HM_SEG_OFF];
  v.segs = s.idx + m[CUDA_HM_SEGS];
  v.bars = s.idx + m[CUDA_HM_BARS];
  v.num_bars = m[CUDA_HM_NUM_BARS];
  v.bar_base = m[CUDA_HM_BAR_BASE];
  return v;
}

/* Merge of a step's partial (natural-log LSE lse_s, normalised output o_s)
 * into the running (lse, o): weights of old and new. Returns the new LSE. */
__device__ __forceinline__ float merge_weights(float lse_old, float lse_s, float *w_old,
                                               float *w_new) {
  if (lse_old == -INFINITY) {
    *w_old = 0.f;
    *w_new = 1.f;
    return lse_s;
  }
  const float mx = fmaxf(lse_old, lse_s);
  const float lnew = mx + logf(expf(lse_old - mx) + expf(lse_s - mx));
  *w_old = expf(lse_old - lnew);
  *w_new = expf(lse_s - lnew);
  return lnew;
}

#endif /* MTRAIN_CUDA_DEVICE_CUH */
