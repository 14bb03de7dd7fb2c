/* cuda_backend.c: the "cuda" backend table: state (device, stream, staging
 * slots, scratch; the device properties and the tile configuration read
 * once at init), memory operations on caller-owned device memory, the
 * variant dispatch of the attention steps (which checks once what a variant
 * can compute), the launch checks of every kernel (cuda_prepare_launch), and
 * the public mtrain_cuda_* functions. Kernels live in the .cu files; the
 * step metadata upload in cuda_step.c. Every CUDA error is mapped to a
 * status here (cuda_check). */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/attn_mma2.h"
#include "backends/cuda/attn_wgmma.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_device_plan.h"
#include "backends/cuda/cuda_internal.h"
#ifdef MTRAIN_HAVE_CUDA_DEV_VARIANTS
#include "backends/cuda/dev/attn_mma1.h"
#endif
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_error.h"
#ifdef MTRAIN_HAVE_NCCL
#include "mtrain/mtrain_nccl.h"
#endif

#define CUDA_MAX_HEAD_DIM 256

mtrain_status_t cuda_check(int err, const char *what) {
  if (err == cudaSuccess) return MTRAIN_SUCCESS;
  cudaGetLastError(); /* clear a non-sticky error so the context stays usable */
  const cudaError_t e = (cudaError_t)err;
  if (e == cudaErrorMemoryAllocation)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda: %s: out of memory on the device (%s)",
                        what, cudaGetErrorString(e));
  return mtrain_error(MTRAIN_ERR_BACKEND, "cuda: %s failed: %s (%s)", what, cudaGetErrorName(e),
                      cudaGetErrorString(e));
}

mtrain_status_t cuda_prepare_launch(const cuda_state_t *s, const void *kernel, const char *who,
                                    const char *name, int64_t grid_x, int64_t grid_y, size_t smem,
                                    cuda_smem_attr_t *attr) {
  if (grid_x > 0x7fffffff || grid_y > 0xffff)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda %s %s: a grid of %lld x %lld thread blocks, more than a grid holds",
                        who, name, (long long)grid_x, (long long)grid_y);
  if (s->max_smem_optin > 0 && smem > s->max_smem_optin)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda %s %s: needs %zu bytes of shared memory per block, the device "
                        "allows %zu",
                        who, name, smem, s->max_smem_optin);
  if (!attr || smem == 0) return MTRAIN_SUCCESS;
  /* the kernel's limit on this device, raised at its first launch that
   * needs more (a device past CUDA_MAX_DEVICES: at every launch) */
  int *set = s->device >= 0 && s->device < CUDA_MAX_DEVICES ? &attr->bytes[s->device] : NULL;
  if (set && (size_t)__atomic_load_n(set, __ATOMIC_ACQUIRE) >= smem) return MTRAIN_SUCCESS;
  mtrain_status_t st = cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), name);
  if (!st && set) __atomic_store_n(set, (int)smem, __ATOMIC_RELEASE);
  return st;
}

static mtrain_status_t check_device_ptr(const void *p, const char *name);

static cudaStream_t stream_of(const cuda_state_t *s) { return (cudaStream_t)s->stream; }

void *mtrain_cuda_state_stream(void *state) { return ((cuda_state_t *)state)->stream; }

/* ---- state ---------------------------------------------------------------- */

static mtrain_status_t parse_variant_env(int *variant) {
  const char *e = getenv("MTRAIN_CUDA_VARIANT");
  *variant = MTRAIN_CUDA_VARIANT_AUTO;
  if (!e || !*e || strcmp(e, "auto") == 0) return MTRAIN_SUCCESS;
  if (strcmp(e, "0") == 0)
    *variant = MTRAIN_CUDA_VARIANT_SIMT;
  else if (strcmp(e, "1") == 0)
    *variant = MTRAIN_CUDA_VARIANT_MMA;
  else if (strcmp(e, "2") == 0)
    *variant = MTRAIN_CUDA_VARIANT_MMA2;
  else if (strcmp(e, "3") == 0)
    *variant = MTRAIN_CUDA_VARIANT_WGMMA;
  else
    return mtrain_error(
        MTRAIN_ERR_INVALID_CONFIG,
        "environment variable MTRAIN_CUDA_VARIANT='%s': expected auto, 0, 1, 2 or 3", e);
  return MTRAIN_SUCCESS;
}

static void cuda_fini(void *state) {
  cuda_state_t *s = state;
  if (!s) return;
  cudaSetDevice(s->device);
  if (s->stream) cudaStreamSynchronize(stream_of(s));
  for (int i = 0; i < CUDA_STAGE_SLOTS_MAX; i++) {
    if (s->slots[i].event) cudaEventDestroy((cudaEvent_t)s->slots[i].event);
    if (s->slots[i].host) cudaFreeHost(s->slots[i].host);
    if (s->slots[i].dev) cudaFree(s->slots[i].dev);
  }
  cuda_deferred_free(s);
  if (s->switch_event) cudaEventDestroy((cudaEvent_t)s->switch_event);
  if (s->scratch) cudaFree(s->scratch);
  if (s->kv_split) cudaFree(s->kv_split);
  for (int i = 0; i < s->num_timers; i++)
    if (s->timers[i]) cudaEventDestroy((cudaEvent_t)s->timers[i]);
  free(s->timers);
  if (s->own_stream) cudaStreamDestroy((cudaStream_t)s->own_stream);
  free(s);
}

/* The largest granularity this device's kernels take: the pattern-scores
 * kernel (cuda_scores.cu) keeps at least one row of G fp64 logits and one
 * query row of up to CUDA_MAX_HEAD_DIM floats in a block's shared memory;
 * the attention kernels take any granularity (variant 0; the others fall
 * back or refuse by shape). A larger one is refused when the context is
 * created, not at the first estimate. */
static mtrain_status_t check_granularity(const cuda_state_t *s, int32_t granularity) {
  const int64_t limit = ((int64_t)s->max_smem_optin - 4 * CUDA_MAX_HEAD_DIM) / 8;
  if (granularity > limit)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "backend 'cuda': config.granularity %d exceeds this device's limit %lld "
                        "(the pattern-scores kernel holds a block's logits in %zu bytes of shared "
                        "memory)",
                        granularity, (long long)limit, s->max_smem_optin);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t cuda_init(const mtrain_config_t *config, void **state) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return mtrain_error(MTRAIN_ERR_BACKEND, "backend 'cuda': no CUDA device is usable here (%s)",
                        e != cudaSuccess ? cudaGetErrorString(e) : "no device found");
  }
  mtrain_status_t st = MTRAIN_SUCCESS;
  cuda_state_t *s = calloc(1, sizeof *s);
  if (!s) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "backend 'cuda': out of host memory");
  MTRAIN_TRY(parse_variant_env(&s->variant));
  MTRAIN_TRY(cuda_mma2_config_from_env(&s->mma2_config));
  MTRAIN_TRY(cuda_wgmma_bwd_kernel_from_env(&s->wgmma_bwd));
  MTRAIN_TRY(cuda_wgmma_fwd_persistent_from_env(&s->wgmma_fwd_persistent));
  MTRAIN_TRY(cuda_kv_split_min_from_env(&s->kv_split_min));
  s->last_variant = -1;
  s->deterministic = config->deterministic;
  MTRAIN_TRY(cuda_check(cudaGetDevice(&s->device), "cudaGetDevice"));
  struct cudaDeviceProp prop;
  MTRAIN_TRY(cuda_check(cudaGetDeviceProperties(&prop, s->device), "cudaGetDeviceProperties"));
  s->num_sms = prop.multiProcessorCount;
  s->cc_major = prop.major;
  s->cc_minor = prop.minor;
  s->max_smem_optin = prop.sharedMemPerBlockOptin;
  MTRAIN_TRY(check_granularity(s, config->granularity));
  cudaStream_t own = NULL;
  MTRAIN_TRY(cuda_check(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking),
                        "cudaStreamCreateWithFlags"));
  s->own_stream = own;
  s->stream = own;
  for (int i = 0; i < CUDA_STAGE_SLOTS; i++) {
    cudaEvent_t ev = NULL;
    MTRAIN_TRY(cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                          "cudaEventCreateWithFlags"));
    s->slots[i].event = ev;
    s->num_slots = i + 1;
  }
  {
    cudaEvent_t ev = NULL;
    MTRAIN_TRY(cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                          "cudaEventCreateWithFlags"));
    s->switch_event = ev;
  }
  *state = s;
  return MTRAIN_SUCCESS;
cleanup:
  cuda_fini(s);
  return st;
}

static mtrain_status_t cuda_supports(void *state, mtrain_dtype_t dtype, int32_t head_dim) {
  (void)state;
  if (dtype != MTRAIN_F32 && dtype != MTRAIN_BF16 && dtype != MTRAIN_F16)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                        "backend 'cuda' computes fp32, bf16 and fp16 inputs, not %s",
                        mtrain_dtype_name(dtype));
  if (head_dim < 32 || head_dim > CUDA_MAX_HEAD_DIM || head_dim % 32 != 0)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_HEAD_DIM,
                        "backend 'cuda' supports head_dim 32, 64, ..., %d (a multiple of 32), "
                        "got %d",
                        CUDA_MAX_HEAD_DIM, head_dim);
  return MTRAIN_SUCCESS;
}

/* ---- memory ---------------------------------------------------------------- */

static mtrain_status_t cuda_alloc(void *state, size_t bytes, void **ptr) {
  (void)state;
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (e == cudaErrorMemoryAllocation)
      return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY,
                          "cuda: out of memory on the device allocating %zu bytes", bytes);
    return cuda_check((int)e, "cudaMalloc");
  }
  *ptr = p;
  return MTRAIN_SUCCESS;
}

static void cuda_free(void *state, void *ptr) {
  cuda_state_t *s = state;
  if (!ptr) return;
  /* the memory may still be read by queued work */
  cudaStreamSynchronize(stream_of(s));
  cudaFree(ptr);
}

static mtrain_status_t cuda_memset_zero(void *state, void *ptr, size_t bytes) {
  return cuda_check(cudaMemsetAsync(ptr, 0, bytes, stream_of(state)), "cudaMemsetAsync");
}

static mtrain_status_t cuda_copy_to_host(void *state, void *host_dst, const void *src,
                                         size_t bytes) {
  cuda_state_t *s = state;
  mtrain_status_t st = cuda_check(
      cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(s)), "copy to host");
  return st ? st : cuda_check(cudaStreamSynchronize(stream_of(s)), "copy to host (sync)");
}

static mtrain_status_t cuda_copy_from_host(void *state, void *dst, const void *host_src,
                                           size_t bytes) {
  cuda_state_t *s = state;
  mtrain_status_t st =
      cuda_check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_of(s)),
                 "copy from host");
  /* the host buffer may be reused by the caller as soon as we return */
  return st ? st : cuda_check(cudaStreamSynchronize(stream_of(s)), "copy from host (sync)");
}

static mtrain_status_t cuda_copy(void *state, void *dst, const void *src, size_t bytes) {
  mtrain_status_t st = check_device_ptr(src, "a tensor");
  if (!st) st = check_device_ptr(dst, "an output tensor");
  if (st) return st;
  return cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(state)),
                    "device copy");
}

static mtrain_status_t cuda_synchronize(void *state) {
  return cuda_check(cudaStreamSynchronize(stream_of(state)), "cudaStreamSynchronize");
}

/* Grows the scratch buffer *buf (capacity *cap) to at least `bytes`: the old
 * one is freed once the queued work that may read it is done. */
static mtrain_status_t scratch_grow(cuda_state_t *s, void **buf, size_t *cap, size_t bytes) {
  if (bytes > *cap) {
    if (*buf) {
      cudaStreamSynchronize(stream_of(s));
      cudaFree(*buf);
      *buf = NULL;
      *cap = 0;
    }
    mtrain_status_t st = cuda_alloc(s, bytes, buf);
    if (st) return st;
    *cap = bytes;
  }
  return MTRAIN_SUCCESS;
}

mtrain_status_t cuda_scratch(cuda_state_t *s, size_t bytes, void **out) {
  mtrain_status_t st = scratch_grow(s, &s->scratch, &s->scratch_cap, bytes);
  if (st) return st;
  *out = s->scratch;
  return MTRAIN_SUCCESS;
}

mtrain_status_t cuda_kv_split_scratch(cuda_state_t *s, size_t bytes, void **out) {
  mtrain_status_t st = scratch_grow(s, &s->kv_split, &s->kv_split_cap, bytes);
  if (st) return st;
  *out = s->kv_split;
  return MTRAIN_SUCCESS;
}

mtrain_status_t cuda_kv_split_min_from_env(int *out) {
  const char *e = getenv("MTRAIN_CUDA_KV_SPLIT_CHUNK");
  *out = CUDA_KV_SPLIT_MIN;
  if (!e || !*e) return MTRAIN_SUCCESS;
  char *end = NULL;
  errno = 0;
  const long v = strtol(e, &end, 10);
  if (errno == 0 && end && *end == '\0' && v > 0 && v <= INT32_MAX) {
    *out = (int)v;
    return MTRAIN_SUCCESS;
  }
  return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                      "backend 'cuda': environment variable MTRAIN_CUDA_KV_SPLIT_CHUNK='%s': "
                      "expected a positive integer (the least entries of a part of a split "
                      "key-major backward item; default %d)",
                      e, CUDA_KV_SPLIT_MIN);
}

/* Device memory check of a caller pointer (host memory would crash a kernel). */
static mtrain_status_t check_device_ptr(const void *p, const char *name) {
  if (!p) return MTRAIN_SUCCESS;
  struct cudaPointerAttributes attr;
  cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "backend 'cuda': %s is not a CUDA pointer (%s); the cuda backend takes "
                        "device memory",
                        name, cudaGetErrorString(e));
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "backend 'cuda': %s is host memory; the cuda backend takes device memory "
                        "(cudaMalloc or mtrain_cuda_malloc)",
                        name);
  return MTRAIN_SUCCESS;
}

/* ---- attention dispatch -------------------------------------------------------- */

/* The tensor-core variants load rows with 16-byte copies. */
static int aligned16(const void *a, const void *b, const void *c, const void *e) {
  return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)e) & 15u) == 0;
}

/* The one check of what variant v can compute (the variants' entry points
 * rely on it): 1, or 0 and *why. */
static int variant_can(const cuda_state_t *s, int v, mtrain_dtype_t dtype, int32_t d, int32_t G,
                       int aligned, const char **why) {
  switch (v) {
  case MTRAIN_CUDA_VARIANT_SIMT:
    return 1; /* every call that cuda_supports accepts */
  case MTRAIN_CUDA_VARIANT_MMA:
#ifndef MTRAIN_HAVE_CUDA_DEV_VARIANTS
    *why = "this build leaves it out (a development variant: configure with "
           "-DMTRAIN_CUDA_DEV_VARIANTS=ON, see backends/cuda/dev/README.md)";
    return 0;
#endif
  case MTRAIN_CUDA_VARIANT_MMA2: /* variant 1 takes the same shapes */
    if (!cuda_mma2_supports(dtype, d, G, why)) return 0;
    break;
  case MTRAIN_CUDA_VARIANT_WGMMA:
    if (!cuda_wgmma_supports(s, dtype, d, G, why)) return 0;
    break;
  default:
    *why = "unknown variant";
    return 0;
  }
  if (!aligned) {
    *why = "q, k, v (and dout) must be 16-byte aligned";
    return 0;
  }
  return 1;
}

static const char *const variant_names[] = {"simt", "mma", "mma2", "wgmma"};

/* The variant forced on the context, or for AUTO the fastest that can
 * compute the call (measured: docs/PERFORMANCE.md): 3 (compute capability
 * 9.0), else 2, else 0. AUTO never picks the development variant 1. */
static mtrain_status_t pick_variant(cuda_state_t *s, mtrain_dtype_t dtype, int32_t d, int32_t G,
                                    int aligned, int *variant) {
  const char *why = NULL;
  if (s->variant != MTRAIN_CUDA_VARIANT_AUTO) {
    if (!variant_can(s, s->variant, dtype, d, G, aligned, &why))
      return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED, "cuda variant %d (%s) cannot compute this: %s",
                          s->variant, variant_names[s->variant], why);
    *variant = s->variant;
  } else {
    static const int auto_order[] = {MTRAIN_CUDA_VARIANT_WGMMA, MTRAIN_CUDA_VARIANT_MMA2};
    *variant = MTRAIN_CUDA_VARIANT_SIMT;
    for (size_t i = 0; i < sizeof auto_order / sizeof auto_order[0]; i++)
      if (variant_can(s, auto_order[i], dtype, d, G, aligned, &why)) {
        *variant = auto_order[i];
        break;
      }
  }
  s->last_variant = *variant;
  return MTRAIN_SUCCESS;
}

/* What the forward and backward steps do first: the inputs' memory, the
 * variant, the step metadata (released by the caller through *slot). */
static mtrain_status_t step_begin(cuda_state_t *s, const mtrain_step_view_t *view,
                                  mtrain_dtype_t dtype, int32_t head_dim, int32_t num_kv_heads,
                                  double scale, const void *q, const void *k, const void *v,
                                  const void *dout, int backward, int *variant, cuda_step_t *step,
                                  int *slot) {
  mtrain_status_t st = check_device_ptr(q, "q");
  if (!st) st = check_device_ptr(k, "k");
  if (!st) st = check_device_ptr(v, "v");
  if (!st && backward) st = check_device_ptr(dout, "dout");
  if (!st)
    st = pick_variant(s, dtype, head_dim, view->granularity,
                      aligned16(q, k, v, backward ? dout : q), variant);
  if (st) return st;
  if (view->device_tables) {
    /* a plan built on the device: its tables are there already */
    st = cuda_device_plan_step(view->device_tables, view->device_seq, step);
    if (st) return st;
    if (step->Hkv != num_kv_heads)
      return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                          "cuda: the device plan was built for %d kv heads, the call has %d",
                          step->Hkv, num_kv_heads);
    step->d = head_dim;
    step->scale = (float)scale;
    return MTRAIN_SUCCESS;
  }
  return cuda_step_upload(s, view, num_kv_heads, head_dim, scale, backward, step, slot);
}

static mtrain_status_t cuda_fwd_init_op(void *state, void *o_acc, void *lse_acc, int64_t rows,
                                        int32_t num_heads, int32_t head_dim) {
  return cuda_fwd_init(state, o_acc, lse_acc, rows, num_heads, head_dim);
}

static mtrain_status_t cuda_fwd_step(void *state, const mtrain_fwd_step_args_t *a) {
  cuda_state_t *s = state;
  mtrain_status_t st = MTRAIN_SUCCESS;
  int variant = 0, slot = -1;
  cuda_step_t step;
  MTRAIN_TRY(step_begin(s, a->view, a->dtype, a->head_dim, a->num_kv_heads, a->scale, a->q, a->k,
                        a->v, NULL, 0, &variant, &step, &slot));
  switch (variant) {
  case MTRAIN_CUDA_VARIANT_WGMMA:
    st = cuda_wgmma_fwd(s, &step, a);
    break;
  case MTRAIN_CUDA_VARIANT_MMA2:
    st = cuda_mma2_fwd(s, &step, a);
    break;
#ifdef MTRAIN_HAVE_CUDA_DEV_VARIANTS
  case MTRAIN_CUDA_VARIANT_MMA:
    st = cuda_mma_fwd(s, &step, a);
    break;
#endif
  default:
    st = cuda_simt_fwd(s, &step, a);
    break;
  }
cleanup:
  if (slot >= 0) {
    mtrain_status_t st2 = cuda_step_release(s, slot);
    if (!st) st = st2;
  }
  return st;
}

static mtrain_status_t cuda_bwd_prepare(void *state, const void *o, const void *dout,
                                        mtrain_dtype_t dtype, void *delta_acc, int64_t rows,
                                        int32_t num_heads, int32_t head_dim) {
  mtrain_status_t st = check_device_ptr(o, "o");
  if (!st) st = check_device_ptr(dout, "dout");
  if (st) return st;
  return cuda_bwd_delta(state, o, dout, dtype, delta_acc, rows, num_heads, head_dim);
}

static mtrain_status_t cuda_bwd_step(void *state, const mtrain_bwd_step_args_t *a) {
  cuda_state_t *s = state;
  mtrain_status_t st = MTRAIN_SUCCESS;
  int variant = 0, slot = -1;
  cuda_step_t step;
  MTRAIN_TRY(step_begin(s, a->view, a->dtype, a->head_dim, a->num_kv_heads, a->scale, a->q, a->k,
                        a->v, a->dout, 1, &variant, &step, &slot));
  float *dk_bar = NULL, *dv_bar = NULL;
  if (step.total_bars > 0) {
    void *scr = NULL;
    const size_t n = (size_t)step.total_bars * (size_t)a->head_dim;
    MTRAIN_TRY(cuda_scratch(s, 2 * n * sizeof(float), &scr));
    dk_bar = scr;
    dv_bar = dk_bar + n;
  }
  switch (variant) {
  case MTRAIN_CUDA_VARIANT_WGMMA:
    st = cuda_wgmma_bwd(s, &step, a, dk_bar, dv_bar);
    break;
  case MTRAIN_CUDA_VARIANT_MMA2:
    st = cuda_mma2_bwd(s, &step, a, dk_bar, dv_bar);
    break;
#ifdef MTRAIN_HAVE_CUDA_DEV_VARIANTS
  case MTRAIN_CUDA_VARIANT_MMA:
    st = cuda_mma_bwd(s, &step, a, dk_bar, dv_bar);
    break;
#endif
  default:
    st = cuda_simt_bwd(s, &step, a, dk_bar, dv_bar);
    break;
  }
  if (!st && step.total_bars > 0)
    st = cuda_bars_reduce(s, &step, dk_bar, dv_bar, a->dk_acc, a->dv_acc);
cleanup:
  if (slot >= 0) {
    mtrain_status_t st2 = cuda_step_release(s, slot);
    if (!st) st = st2;
  }
  return st;
}

static mtrain_status_t cuda_convert_op(void *state, const void *src, mtrain_dtype_t src_dtype,
                                       void *dst, mtrain_dtype_t dst_dtype, int64_t count) {
  mtrain_status_t st = check_device_ptr(src, "a tensor");
  if (!st) st = check_device_ptr(dst, "an output tensor");
  return st ? st : cuda_convert(state, src, src_dtype, dst, dst_dtype, count);
}

static mtrain_status_t cuda_find_nonfinite_op(void *state, const void *ptr, mtrain_dtype_t dtype,
                                              int64_t count, int64_t *bad_index) {
  mtrain_status_t st = check_device_ptr(ptr, "input tensor");
  return st ? st : cuda_find_nonfinite(state, ptr, dtype, count, bad_index);
}

static mtrain_status_t cuda_fill_f64_op(void *state, double *dst, double value, int64_t count) {
  return cuda_fill_f64(state, dst, value, count);
}

static mtrain_status_t cuda_row_sums_f64_op(void *state, const double *in, double *out,
                                            int64_t rows, int64_t cols) {
  return cuda_row_sums_f64(state, in, out, rows, cols);
}

static mtrain_status_t cuda_add_op(void *state, void *dst, const void *src, mtrain_dtype_t dtype,
                                   int64_t count) {
  return cuda_add(state, dst, src, dtype, count);
}

static mtrain_status_t cuda_permute_op(void *state, void *dst, const void *src, size_t row_bytes,
                                       const int64_t *index, int64_t count, int64_t other_rows,
                                       int scatter) {
  mtrain_status_t st = check_device_ptr(src, "a tensor");
  if (!st) st = check_device_ptr(dst, "an output tensor");
  return st ? st : cuda_permute(state, dst, src, row_bytes, index, count, other_rows, scatter);
}

static mtrain_status_t cuda_scores_op(void *state, const mtrain_scores_args_t *a) {
  return cuda_pattern_scores(state, a);
}

static mtrain_status_t cuda_scores_batch_op(void *state, const mtrain_scores_args_t *args,
                                            int32_t count) {
  return cuda_pattern_scores_batch(state, args, count);
}

static mtrain_status_t cuda_select_op(void *state, const mtrain_select_args_t *a) {
  return cuda_pattern_select(state, a);
}

static mtrain_status_t cuda_select_batch_op(void *state, const mtrain_select_args_t *args,
                                            int32_t count) {
  return cuda_pattern_select_batch(state, args, count);
}

#define CUDA_MAX_TIMERS 4096

static mtrain_status_t cuda_timer_mark(void *state, int index) {
  cuda_state_t *s = state;
  if (index < 0 || index >= CUDA_MAX_TIMERS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda timer slot %d out of range", index);
  if (index >= s->num_timers) {
    int n = s->num_timers ? s->num_timers : 64;
    while (n <= index) n *= 2;
    void **t = realloc(s->timers, sizeof(void *) * (size_t)n);
    if (!t) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda timers: out of host memory");
    for (int i = s->num_timers; i < n; i++) t[i] = NULL;
    s->timers = t;
    s->num_timers = n;
  }
  if (!s->timers[index]) {
    cudaEvent_t ev;
    mtrain_status_t st = cuda_check(cudaEventCreate(&ev), "cudaEventCreate (timer)");
    if (st) return st;
    s->timers[index] = ev;
  }
  return cuda_check(cudaEventRecord((cudaEvent_t)s->timers[index], stream_of(s)),
                    "cudaEventRecord (timer)");
}

static mtrain_status_t cuda_timer_elapsed(void *state, int from, int to, double *seconds) {
  cuda_state_t *s = state;
  if (from < 0 || to < 0 || from >= s->num_timers || to >= s->num_timers || !s->timers[from] ||
      !s->timers[to])
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda timer slots %d, %d were not marked",
                        from, to);
  mtrain_status_t st =
      cuda_check(cudaEventSynchronize((cudaEvent_t)s->timers[to]), "cudaEventSynchronize");
  float ms = 0.f;
  if (!st)
    st = cuda_check(
        cudaEventElapsedTime(&ms, (cudaEvent_t)s->timers[from], (cudaEvent_t)s->timers[to]),
        "cudaEventElapsedTime");
  if (!st) *seconds = 1e-3 * (double)ms;
  return st;
}

const mtrain_backend_ops_t mtrain_cuda_backend = {
    .api_version = MTRAIN_API_VERSION,
    .name = "cuda",
    .acc_dtype = MTRAIN_F32,
    .memory_space = MTRAIN_MEMORY_DEVICE,
    .data_stream = mtrain_cuda_state_stream,
    .init = cuda_init,
    .fini = cuda_fini,
    .supports = cuda_supports,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .memset_zero = cuda_memset_zero,
    .copy_to_host = cuda_copy_to_host,
    .copy_from_host = cuda_copy_from_host,
    .copy = cuda_copy,
    .add = cuda_add_op,
    .permute = cuda_permute_op,
    .convert = cuda_convert_op,
    .find_nonfinite = cuda_find_nonfinite_op,
    .attn_fwd_init = cuda_fwd_init_op,
    .attn_fwd_step = cuda_fwd_step,
    .attn_bwd_prepare = cuda_bwd_prepare,
    .attn_bwd_step = cuda_bwd_step,
    .pattern_scores = cuda_scores_op,
    .block_scores = cuda_block_scores,
    .block_scores_noncausal = 1,
    .synchronize = cuda_synchronize,
    .timer_mark = cuda_timer_mark,
    .timer_elapsed = cuda_timer_elapsed,
    .async = cuda_async_op,
    .deferred_scan = cuda_deferred_scan_op,
    .deferred_poll = cuda_deferred_poll_op,
    .pattern_select = cuda_select_op,
    .pattern_select_batch = cuda_select_batch_op,
    .pattern_scores_batch = cuda_scores_batch_op,
    .noncausal = 1,
    .device_plan_size = cuda_device_plan_size,
    .device_plan_build = cuda_device_plan_build,
    .device_plan_read = cuda_device_plan_read,
    .device_plan_release = cuda_device_plan_release,
    .fill_f64 = cuda_fill_f64_op,
    .row_sums_f64 = cuda_row_sums_f64_op,
};

/* ---- public functions (mtrain_cuda.h) ---------------------------------------- */

static mtrain_status_t cuda_state_of(const mtrain_context_t *ctx, cuda_state_t **out) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  cuda_state_t *s = mtrain_context_backend_state(ctx, &mtrain_cuda_backend);
  if (!s)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "the context uses backend '%s', not 'cuda'",
                        mtrain_context_backend_name(ctx));
  *out = s;
  return MTRAIN_SUCCESS;
}

int mtrain_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

mtrain_status_t mtrain_cuda_set_stream(mtrain_context_t *ctx, void *stream) {
  cuda_state_t *s = NULL;
  mtrain_status_t st = cuda_state_of(ctx, &s);
  if (st) return st;
  void *next = stream ? stream : s->own_stream;
  if (next == s->stream) return MTRAIN_SUCCESS; /* the same stream: nothing to order */
  /* work queued on the old stream completes before the new one's work runs
   * (an event: the host does not wait) */
  st = cuda_check(cudaEventRecord((cudaEvent_t)s->switch_event, stream_of(s)),
                  "cudaEventRecord (stream switch)");
  if (!st)
    st = cuda_check(cudaStreamWaitEvent((cudaStream_t)next, (cudaEvent_t)s->switch_event, 0),
                    "cudaStreamWaitEvent (stream switch)");
  if (st) return st;
  s->stream = next;
  /* the ring's transfers follow the compute of the new stream */
  return mtrain_context_bind_stream(ctx);
}

mtrain_status_t mtrain_cuda_set_async(mtrain_context_t *ctx, int enabled) {
  cuda_state_t *s = NULL;
  mtrain_status_t st = cuda_state_of(ctx, &s);
  if (st) return st;
  if (!enabled && s->async) {
    /* back to synchronous calls: the findings of the async ones first */
    s->async = 0;
    return cuda_deferred_poll_op(s, 1);
  }
  s->async = enabled != 0;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cuda_set_variant(mtrain_context_t *ctx, mtrain_cuda_variant_t variant) {
  cuda_state_t *s = NULL;
  mtrain_status_t st = cuda_state_of(ctx, &s);
  if (st) return st;
  if (variant != MTRAIN_CUDA_VARIANT_AUTO && variant != MTRAIN_CUDA_VARIANT_SIMT &&
      variant != MTRAIN_CUDA_VARIANT_MMA && variant != MTRAIN_CUDA_VARIANT_MMA2 &&
      variant != MTRAIN_CUDA_VARIANT_WGMMA)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda variant %d: expected -1 (auto), 0, 1, 2 or 3", (int)variant);
  s->variant = variant;
  return MTRAIN_SUCCESS;
}

int mtrain_cuda_last_variant(const mtrain_context_t *ctx) {
  cuda_state_t *s = NULL;
  if (cuda_state_of(ctx, &s)) return -1;
  return s->last_variant;
}

mtrain_status_t mtrain_cuda_malloc(size_t bytes, void **ptr) {
  MTRAIN_CHECK_NOT_NULL(ptr);
  return cuda_alloc(NULL, bytes, ptr);
}

void mtrain_cuda_free(void *ptr) {
  if (ptr) cudaFree(ptr);
}

mtrain_status_t mtrain_cuda_memcpy_to_device(void *dst, const void *host_src, size_t bytes) {
  return cuda_check(cudaMemcpy(dst, host_src, bytes, cudaMemcpyHostToDevice), "copy to device");
}

mtrain_status_t mtrain_cuda_memcpy_to_host(void *host_dst, const void *src, size_t bytes) {
  return cuda_check(cudaMemcpy(host_dst, src, bytes, cudaMemcpyDeviceToHost), "copy to host");
}

mtrain_status_t mtrain_cuda_memset(void *ptr, int value, size_t bytes) {
  return cuda_check(cudaMemset(ptr, value, bytes), "cudaMemset");
}

mtrain_status_t mtrain_cuda_set_device(int device) {
  return cuda_check(cudaSetDevice(device), "cudaSetDevice");
}

mtrain_status_t mtrain_cuda_device_synchronize(void) {
  return cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}
