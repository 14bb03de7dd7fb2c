/* cuda_misc.cu: the CUDA backend's element-wise and bookkeeping kernels:
 * running O/LSE initialisation, accumulator addition, dtype conversion, the
 * NaN/Inf scan, the layout row permutation, the backward's delta =
 * rowsum(dout * o), the deterministic addition of the bars' dK/dV
 * scratch into the chunk's accumulators, and the estimate's row statistics
 * (a fill and ordered row sums in fp64). */
#include <cuda_runtime.h>
#include <math.h>

#include "backends/cuda/cuda_device.cuh"
#include "mtrain/mtrain_error.h"

namespace {

constexpr int kThreads = 256;

int grid_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  if (b > 65535 * 8) b = 65535 * 8;
  return (int)(b > 0 ? b : 1);
}

__global__ void fill_f64_kernel(double *dst, double value, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = value;
}

/* One thread per row: the row's entries added in order from 0.0, as the
 * host's loop does (bitwise the same sum). */
__global__ void row_sums_f64_kernel(const double *in, double *out, int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows;
       r += (int64_t)gridDim.x * blockDim.x) {
    const double *x = in + r * cols;
    double sum = 0.0;
    for (int64_t c = 0; c < cols; c++) sum += x[c];
    out[r] = sum;
  }
}

__global__ void fwd_init_kernel(float *o, int64_t no, float *lse, int64_t nl) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < no;
       i += (int64_t)gridDim.x * blockDim.x)
    o[i] = 0.f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nl;
       i += (int64_t)gridDim.x * blockDim.x)
    lse[i] = -INFINITY;
}

template <typename T> __global__ void add_kernel(T *dst, const T *src, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    dst[i] += src[i];
}

__device__ __forceinline__ double load_any(const void *p, mtrain_dtype_t t, int64_t i) {
  switch (t) {
  case MTRAIN_F32:
    return ((const float *)p)[i];
  case MTRAIN_F64:
    return ((const double *)p)[i];
  case MTRAIN_BF16:
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
  default:
    return __half2float(((const __half *)p)[i]);
  }
}

__device__ __forceinline__ void store_any(void *p, mtrain_dtype_t t, int64_t i, double x) {
  switch (t) {
  case MTRAIN_F32:
    ((float *)p)[i] = (float)x;
    break;
  case MTRAIN_F64:
    ((double *)p)[i] = x;
    break;
  /* round once from the source value (fp32 sources are exact in double) */
  case MTRAIN_BF16:
    ((__nv_bfloat16 *)p)[i] = __double2bfloat16(x);
    break;
  default:
    ((__half *)p)[i] = __double2half(x);
    break;
  }
}

__global__ void convert_kernel(const void *src, mtrain_dtype_t st, void *dst, mtrain_dtype_t dt,
                               int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    store_any(dst, dt, i, load_any(src, st, i));
}

__global__ void nonfinite_kernel(const void *p, mtrain_dtype_t t, int64_t n,
                                 unsigned long long *first) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    if (!isfinite(load_any(p, t, i))) atomicMin(first, (unsigned long long)i);
}

/* gather: dst row i = src row index[i] (zero row when index[i] >= other_rows);
 * scatter: dst row index[i] = src row i where index[i] < other_rows. Rows are
 * moved in 4-byte words when row_bytes allows, else bytes. */
template <typename W>
__global__ void permute_kernel(W *dst, const W *src, int64_t row_words, const int64_t *index,
                               int64_t count, int64_t other_rows, int scatter) {
  const int64_t total = count * row_words;
  for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < total;
       x += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = x / row_words, c = x % row_words, j = index[i];
    if (!scatter)
      dst[x] = j < other_rows ? src[j * row_words + c] : W(0);
    else if (j < other_rows)
      dst[j * row_words + c] = src[x];
  }
}

/* One warp per (row, head): delta = sum_c dout * o in fp32. */
template <typename T>
__global__ void delta_kernel(const T *o, const T *dout, float *delta, int64_t rows_heads, int d) {
  const int64_t w = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows_heads) return;
  float acc = 0.f;
  for (int c = lane; c < d; c += 32) acc += ld(dout, w * d + c) * ld(o, w * d + c);
  for (int off = 16; off; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) delta[w] = acc;
}

/* Adds the bar scratch of the heads at group position g (one per kv head, so
 * no two threads of a launch write one element). */
__global__ void bars_reduce_kernel(cuda_step_t st, int g, const float *dk_bar, const float *dv_bar,
                                   float *dk, float *dv) {
  const int hk = blockIdx.y, h = hk * st.group + g, d = st.d;
  const head_view hv = head_of(st, h);
  const int64_t total = (int64_t)hv.num_bars * d;
  for (int64_t x = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; x < total;
       x += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = x / d, c = x % d, j = hv.bars[b];
    const int64_t to = (j * st.Hkv + hk) * d + c, from = (hv.bar_base + b) * d + c;
    dk[to] += dk_bar[from];
    dv[to] += dv_bar[from];
  }
}

} // namespace

extern "C" mtrain_status_t cuda_fwd_init(cuda_state_t *s, float *o_acc, float *lse_acc,
                                         int64_t rows, int32_t heads, int32_t d) {
  const int64_t no = rows * heads * d, nl = rows * heads;
  fwd_init_kernel<<<grid_for(no), kThreads, 0, (cudaStream_t)s->stream>>>(o_acc, no, lse_acc, nl);
  return cuda_check_launch("fwd_init_kernel");
}

extern "C" mtrain_status_t cuda_fill_f64(cuda_state_t *s, double *dst, double value,
                                         int64_t count) {
  if (count <= 0) return MTRAIN_SUCCESS;
  fill_f64_kernel<<<grid_for(count), kThreads, 0, (cudaStream_t)s->stream>>>(dst, value, count);
  return cuda_check_launch("fill_f64_kernel");
}

extern "C" mtrain_status_t cuda_row_sums_f64(cuda_state_t *s, const double *in, double *out,
                                             int64_t rows, int64_t cols) {
  if (rows <= 0) return MTRAIN_SUCCESS;
  row_sums_f64_kernel<<<grid_for(rows), kThreads, 0, (cudaStream_t)s->stream>>>(in, out, rows,
                                                                                cols);
  return cuda_check_launch("row_sums_f64_kernel");
}

extern "C" mtrain_status_t cuda_add(cuda_state_t *s, void *dst, const void *src,
                                    mtrain_dtype_t dtype, int64_t count) {
  cudaStream_t str = (cudaStream_t)s->stream;
  if (dtype == MTRAIN_F32)
    add_kernel<<<grid_for(count), kThreads, 0, str>>>((float *)dst, (const float *)src, count);
  else if (dtype == MTRAIN_F64)
    add_kernel<<<grid_for(count), kThreads, 0, str>>>((double *)dst, (const double *)src, count);
  else
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "cuda add: accumulators are fp32 or fp64");
  return cuda_check_launch("add_kernel");
}

extern "C" mtrain_status_t cuda_convert(cuda_state_t *s, const void *src, mtrain_dtype_t src_dtype,
                                        void *dst, mtrain_dtype_t dst_dtype, int64_t count) {
  if (count <= 0) return MTRAIN_SUCCESS;
  convert_kernel<<<grid_for(count), kThreads, 0, (cudaStream_t)s->stream>>>(src, src_dtype, dst,
                                                                            dst_dtype, count);
  return cuda_check_launch("convert_kernel");
}

extern "C" mtrain_status_t cuda_queue_nonfinite(cuda_state_t *s, const void *ptr,
                                                mtrain_dtype_t dtype, int64_t count,
                                                unsigned long long *first_dev) {
  cudaStream_t str = (cudaStream_t)s->stream;
  mtrain_status_t st =
      cuda_check(cudaMemsetAsync(first_dev, 0xff, sizeof *first_dev, str), "nonfinite scan init");
  if (st || count <= 0) return st;
  nonfinite_kernel<<<grid_for(count), kThreads, 0, str>>>(ptr, dtype, count, first_dev);
  return cuda_check_launch("nonfinite_kernel");
}

extern "C" mtrain_status_t cuda_find_nonfinite(cuda_state_t *s, const void *ptr,
                                               mtrain_dtype_t dtype, int64_t count,
                                               int64_t *bad_index) {
  void *scr = NULL;
  mtrain_status_t st = cuda_scratch(s, sizeof(unsigned long long), &scr);
  if (st) return st;
  cudaStream_t str = (cudaStream_t)s->stream;
  unsigned long long first = ~0ull;
  if ((st = cuda_queue_nonfinite(s, ptr, dtype, count, (unsigned long long *)scr))) return st;
  if ((st = cuda_check(cudaMemcpyAsync(&first, scr, sizeof first, cudaMemcpyDeviceToHost, str),
                       "nonfinite scan result")))
    return st;
  if ((st = cuda_check(cudaStreamSynchronize(str), "nonfinite scan (sync)"))) return st;
  *bad_index = first == ~0ull ? -1 : (int64_t)first;
  return MTRAIN_SUCCESS;
}

extern "C" mtrain_status_t cuda_permute(cuda_state_t *s, void *dst, const void *src,
                                        size_t row_bytes, const int64_t *index, int64_t count,
                                        int64_t other_rows, int scatter) {
  if (count <= 0) return MTRAIN_SUCCESS;
  void *dev_index = NULL;
  int slot = -1;
  mtrain_status_t st =
      cuda_upload_small(s, index, sizeof(int64_t) * (size_t)count, &dev_index, &slot);
  if (st) return st;
  cudaStream_t str = (cudaStream_t)s->stream;
  if (row_bytes % 4 == 0) {
    const int64_t words = (int64_t)(row_bytes / 4);
    permute_kernel<<<grid_for(count * words), kThreads, 0, str>>>(
        (uint32_t *)dst, (const uint32_t *)src, words, (const int64_t *)dev_index, count,
        other_rows, scatter);
  } else {
    permute_kernel<<<grid_for(count * (int64_t)row_bytes), kThreads, 0, str>>>(
        (uint8_t *)dst, (const uint8_t *)src, (int64_t)row_bytes, (const int64_t *)dev_index, count,
        other_rows, scatter);
  }
  st = cuda_check_launch("permute_kernel");
  mtrain_status_t st2 = cuda_step_release(s, slot);
  return st ? st : st2;
}

extern "C" mtrain_status_t cuda_bwd_delta(cuda_state_t *s, const void *o, const void *dout,
                                          mtrain_dtype_t dtype, float *delta, int64_t rows,
                                          int32_t heads, int32_t d) {
  const int64_t n = rows * heads;
  if (n <= 0) return MTRAIN_SUCCESS;
  const int64_t threads = n * 32;
  const int grid = (int)((threads + kThreads - 1) / kThreads);
  cudaStream_t str = (cudaStream_t)s->stream;
  switch (dtype) {
  case MTRAIN_F32:
    delta_kernel<<<grid, kThreads, 0, str>>>((const float *)o, (const float *)dout, delta, n, d);
    break;
  case MTRAIN_BF16:
    delta_kernel<<<grid, kThreads, 0, str>>>((const __nv_bfloat16 *)o, (const __nv_bfloat16 *)dout,
                                             delta, n, d);
    break;
  case MTRAIN_F16:
    delta_kernel<<<grid, kThreads, 0, str>>>((const __half *)o, (const __half *)dout, delta, n, d);
    break;
  default:
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "cuda delta: dtype %s",
                        mtrain_dtype_name(dtype));
  }
  return cuda_check_launch("delta_kernel");
}

extern "C" mtrain_status_t cuda_bars_reduce(cuda_state_t *s, const cuda_step_t *st,
                                            const float *dk_bar, const float *dv_bar, float *dk_acc,
                                            float *dv_acc) {
  for (int g = 0; g < st->group; g++) {
    dim3 grid(64, st->Hkv);
    bars_reduce_kernel<<<grid, kThreads, 0, (cudaStream_t)s->stream>>>(*st, g, dk_bar, dv_bar,
                                                                       dk_acc, dv_acc);
    mtrain_status_t e = cuda_check_launch("bars_reduce_kernel");
    if (e) return e;
  }
  return MTRAIN_SUCCESS;
}
