/* attn_mma2.h (private): entry points of variant 2 of the CUDA attention
 * kernels (tensor cores, mma.sync, tuned: 128-row query tiles, a fused
 * key-major backward with atomic dQ when the context is not deterministic).
 * Same inputs, outputs and accumulator contract as every variant
 * (cuda_internal.h): fwd merges the step into o_acc/lse_acc; bwd adds dQ
 * into dq_acc, the runs' dK/dV into dk_acc/dv_acc, and WRITES every bar's
 * dK/dV to dk_bar/dv_bar [total_bars, d] fp32 (zero rows where a bar has no
 * entries). The dispatcher (cuda_backend.c) calls them only for calls that
 * cuda_mma2_supports accepts, with q, k, v and dout 16-byte aligned.
 *
 * The tile configuration is the context's cuda_state_t::mma2_config, read
 * once from the environment variable MTRAIN_CUDA_MMA2_CONFIG when the
 * context is created (cuda_mma2_config_from_env: "0" when unset or empty;
 * "0", "1" or "2", see docs/CUDA_KERNELS.md, section "Variant 2"; any other
 * value makes the context creation fail with MTRAIN_ERR_INVALID_CONFIG). */
#ifndef MTRAIN_ATTN_MMA2_H
#define MTRAIN_ATTN_MMA2_H

#include <stdint.h>

#include "backends/cuda/cuda_internal.h"

/* Tile configurations of variant 2 (MTRAIN_CUDA_MMA2_CONFIG 0 .. 2). */
#define CUDA_MMA2_NUM_CONFIGS 3

#ifdef __cplusplus
extern "C" {
#endif

/* Reads MTRAIN_CUDA_MMA2_CONFIG into *index (0 when unset or empty). */
mtrain_status_t cuda_mma2_config_from_env(int *index);
/* 1 when variant 2 can compute (dtype, d, G): bf16 or fp16, head_dim 64 or
 * 128, G a multiple of 64 (the shapes of every tensor-core variant); else 0
 * and *why (static). */
int cuda_mma2_supports(mtrain_dtype_t dtype, int32_t d, int32_t G, const char **why);
mtrain_status_t cuda_mma2_fwd(cuda_state_t *s, const cuda_step_t *st,
                              const mtrain_fwd_step_args_t *a);
/* Non-deterministic contexts (s->deterministic == 0) run the fused kernel
 * (dQ by fp32 atomics, order-dependent in the last bits); deterministic
 * ones run a query-major dQ kernel and a key-major dK/dV kernel. */
mtrain_status_t cuda_mma2_bwd(cuda_state_t *s, const cuda_step_t *st,
                              const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar);
/* The query-major dQ kernel of the deterministic path alone (added into
 * dq_acc, no atomics): variant 3's deterministic backward pairs it with its
 * own dK/dV kernel. Same preconditions as cuda_mma2_bwd. */
mtrain_status_t cuda_mma2_bwd_dq(cuda_state_t *s, const cuda_step_t *st,
                                 const mtrain_bwd_step_args_t *a);

/* The long-item split of a key-major launch of bn-key items (attn_mma2_bwd.cu):
 * begin makes the work list on the device (kv_split_schedule_kernel, queued
 * on s->stream; no host read-back) over the bar items and the run items,
 * points st's kv_work and part rows at it and sets *blocks to the launch's
 * bound (bar tiles + run items + 2 SMs + 1); nothing when the step has no
 * items. end queues the reduce of the split items' parts: added into
 * dk_acc/dv_acc for run items, written to the bar scratch rows dk_bar/dv_bar
 * for bar items (nothing without a work list). */
mtrain_status_t cuda_kv_split_begin(cuda_state_t *s, cuda_step_t *st, int bn, int64_t *blocks);
mtrain_status_t cuda_kv_split_end(cuda_state_t *s, const cuda_step_t *st, int bn, float *dk_acc,
                                  float *dv_acc, float *dk_bar, float *dv_bar);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_ATTN_MMA2_H */
