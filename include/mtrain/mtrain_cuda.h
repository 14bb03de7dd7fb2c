/* mtrain_cuda.h: the CUDA backend's public extras: the caller's stream, the
 * kernel variant, and small device-memory helpers for C programs (tests,
 * tools) that do not include the CUDA runtime themselves.
 *
 * With the "cuda" backend every tensor passed to mtrain (q, k, v, o, lse,
 * dout, dq, dk, dv) is device memory of the current CUDA device, owned by
 * the caller. All work of a call is queued on the context's stream (the
 * caller's, set with mtrain_cuda_set_stream, or the backend's own). By
 * default a call returns once its outputs are complete on that stream (it
 * synchronises the stream before returning: the ring driver reads host-side
 * results, and the outputs' NaN/Inf check reads its result on the host). In
 * stream-ordered mode (mtrain_cuda_set_async) a single-rank attention call
 * returns as soon as its work is queued, as cuDNN's and FlashAttention's
 * calls do. The estimate (mtrain_pattern_estimate*) and calls on several
 * ranks always synchronise: their selection and their ring run on the host.
 *
 * Every function here exists in every build: without CUDA they report
 * MTRAIN_ERR_NOT_SUPPORTED (mtrain_cuda_device_count returns 0). */
#ifndef MTRAIN_CUDA_H
#define MTRAIN_CUDA_H

#include <stddef.h>

#include "mtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Kernel variants (numbered, each validated against cpu-ref before timing).
 *  AUTO picks the fastest variant that supports the call's dtype, head_dim
 *  and granularity: 3 (compute capability 9.0), else 2, else 0 (measured:
 *  docs/PERFORMANCE.md). Variant 1 is a development variant that AUTO never
 *  picks, built only with the CMake option MTRAIN_CUDA_DEV_VARIANTS=ON
 *  (backends/cuda/dev/README.md). */
typedef enum mtrain_cuda_variant {
  MTRAIN_CUDA_VARIANT_AUTO = -1,
  MTRAIN_CUDA_VARIANT_SIMT = 0,  /**< one warp per row, any d % 32 == 0 up to 256, fp32/bf16/fp16 */
  MTRAIN_CUDA_VARIANT_MMA = 1,   /**< tensor cores (mma.sync m16n8k16): bf16/fp16, d 64 or 128,
                                      granularity a multiple of 64; only in builds with
                                      MTRAIN_CUDA_DEV_VARIANTS=ON (otherwise every call forced
                                      to it fails with MTRAIN_ERR_NOT_SUPPORTED) */
  MTRAIN_CUDA_VARIANT_MMA2 = 2,  /**< tensor cores, tuned: 128-row query tiles, and with
                                      config.deterministic = 0 a fused backward with atomic dQ;
                                      bf16/fp16, d 64 or 128, granularity a multiple of 64
                                      (128-row tiles where it is a multiple of 128) */
  MTRAIN_CUDA_VARIANT_WGMMA = 3, /**< Hopper: the forward and backward on warpgroup MMA
                                      (wgmma, compute capability 9.0 only; the deterministic
                                      backward takes its dQ from variant 2's kernel); same
                                      dtypes, head_dims and granularities as variant 2 */
} mtrain_cuda_variant_t;

/** Number of CUDA devices visible (0 without CUDA, a driver or a GPU). */
MTRAIN_API int mtrain_cuda_device_count(void);

/** Queues the context's work on `stream` (a cudaStream_t; NULL returns to
 *  the backend's own non-blocking stream, which is not ordered with the
 *  legacy default stream: pass cudaStreamLegacy, or cudaStreamPerThread, for
 *  the default stream). Work queued on the previous
 *  stream runs before later work on the new one (an event; the host does not
 *  wait); the same stream again is a no-op. The stream must outlive its use
 *  by the context. Fails with MTRAIN_ERR_INVALID_ARGUMENT when the context
 *  does not use the "cuda" backend. Not thread-safe with respect to ctx. */
MTRAIN_API mtrain_status_t mtrain_cuda_set_stream(mtrain_context_t *ctx, void *stream);

/** Stream-ordered calls on ctx (enabled != 0; default off). A single-rank
 *  mtrain_attention_forward / _backward then queues its work on the
 *  context's stream and returns without waiting for the device: its outputs
 *  are ready for work queued after it on that stream, not for the host, and
 *  mtrain_last_stats gives host times. The outputs' NaN/Inf checks (the
 *  forward's LSE, fp16 gradients) run as deferred scans: a finding is
 *  reported as MTRAIN_ERR_NONFINITE, naming the call, tensor, token and head,
 *  by mtrain_context_check_deferred (which waits) or by the first later
 *  attention call on ctx that finds the scan complete (without waiting).
 *  Memory the call frees goes back in stream order: to a stream-ordered
 *  allocator of the caller's (mtrain_context_set_allocator, as torch's
 *  caching allocator), or, with the backend's own, into the context's kept
 *  blocks (mtrain_context_set_reuse_limit), which later calls on the stream
 *  reuse; only a block the context does not keep (reuse limit 0, or beyond
 *  it) is freed with cudaFree after waiting for the stream. Staging buffers for the
 *  plan's step tables grow (up to 16 in flight) instead of waiting. Turning
 *  it off reports the pending findings (waits for them). Fails with
 *  MTRAIN_ERR_INVALID_ARGUMENT when ctx does not use "cuda". Not thread-safe
 *  with respect to ctx. */
MTRAIN_API mtrain_status_t mtrain_cuda_set_async(mtrain_context_t *ctx, int enabled);

/** Selects the kernel variant for later calls on ctx (default AUTO, or the
 *  environment variable MTRAIN_CUDA_VARIANT = auto|0|1|2|3 read at context
 *  creation). A forced variant that cannot compute a call makes that call
 *  fail with MTRAIN_ERR_NOT_SUPPORTED naming the reason; so does a variant
 *  that this build leaves out (variant 1 without MTRAIN_CUDA_DEV_VARIANTS:
 *  the message names the option). Fails with MTRAIN_ERR_INVALID_ARGUMENT for
 *  a value that is no variant. */
MTRAIN_API mtrain_status_t mtrain_cuda_set_variant(mtrain_context_t *ctx,
                                                   mtrain_cuda_variant_t variant);

/** The variant the last attention call on ctx ran (-1 before any). */
MTRAIN_API int mtrain_cuda_last_variant(const mtrain_context_t *ctx);

/** Device-memory helpers (current device, synchronous). Errors, including
 *  out-of-memory, are returned as statuses with the CUDA message. */
MTRAIN_API mtrain_status_t mtrain_cuda_malloc(size_t bytes, void **ptr);
/** Frees memory from mtrain_cuda_malloc; NULL is a no-op. */
MTRAIN_API void mtrain_cuda_free(void *ptr);
MTRAIN_API mtrain_status_t mtrain_cuda_memcpy_to_device(void *dst, const void *host_src,
                                                        size_t bytes);
MTRAIN_API mtrain_status_t mtrain_cuda_memcpy_to_host(void *host_dst, const void *src,
                                                      size_t bytes);
MTRAIN_API mtrain_status_t mtrain_cuda_memset(void *ptr, int value, size_t bytes);
/** Selects the current device of the calling thread. */
MTRAIN_API mtrain_status_t mtrain_cuda_set_device(int device);
/** Waits for all work on the current device. */
MTRAIN_API mtrain_status_t mtrain_cuda_device_synchronize(void);

/** Kinds of injected fault (mtrain_cuda_inject_fault). */
typedef enum mtrain_cuda_fault {
  MTRAIN_CUDA_FAULT_NONE = 0,   /**< disarm */
  MTRAIN_CUDA_FAULT_LAUNCH = 1, /**< a launch that fails at once (too large a block): the
                                     call fails with MTRAIN_ERR_BACKEND naming the kernel; the
                                     error is not sticky and the context stays usable */
  MTRAIN_CUDA_FAULT_TRAP = 2,   /**< a kernel that traps on the device: the call (or the next
                                     one that synchronizes) fails with MTRAIN_ERR_BACKEND; the
                                     error is sticky: every later CUDA call of the process fails,
                                     and contexts can only be destroyed */
} mtrain_cuda_fault_t;

/** Fault injection, for tests of the error paths: after the next
 *  `nth_launch` - 1 kernel launches of the backend (any context, any thread
 *  of the process), the nth is followed by a launch that really fails in the
 *  way `kind` says, and the call that made it returns the error. NONE (any
 *  nth_launch) disarms. Process-wide; thread-safe. Fails with
 *  MTRAIN_ERR_INVALID_ARGUMENT for an unknown kind or nth_launch < 1. */
MTRAIN_API mtrain_status_t mtrain_cuda_inject_fault(mtrain_cuda_fault_t kind, int64_t nth_launch);

/** Launches left before an armed fault fires (0: none armed, or fired). */
MTRAIN_API int64_t mtrain_cuda_fault_pending(void);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_CUDA_H */
