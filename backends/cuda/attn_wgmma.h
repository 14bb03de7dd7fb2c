/* attn_wgmma.h (private): entry points of variant 3 of the CUDA attention
 * kernels: the forward and backward steps on Hopper's warpgroup MMA (wgmma,
 * sm_90a; attn_wgmma_fwd.cu, attn_wgmma_bwd.cu). Same inputs, outputs and
 * accumulator contract as variants 1 and 2 (cuda_internal.h): the forward
 * step is merged into o_acc and lse_acc, the backward adds into dq_acc,
 * dk_acc, dv_acc and writes the bar scratch. q, k and v (and dout) must be
 * 16-byte aligned. */
#ifndef MTRAIN_ATTN_WGMMA_H
#define MTRAIN_ATTN_WGMMA_H

#include <stdint.h>

#include "backends/cuda/cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when variant 3's forward can compute (dtype, d, G) on the context's
 * device (compute capability 9.0); else 0 and *why (static). */
int cuda_wgmma_supports(const cuda_state_t *s, mtrain_dtype_t dtype, int32_t d, int32_t G,
                        const char **why);
/* The forward step on wgmma (attn_wgmma_fwd.cu), with the kernel of the
 * context's choice (cuda_state_t::wgmma_fwd_persistent). */
mtrain_status_t cuda_wgmma_fwd(cuda_state_t *s, const cuda_step_t *st,
                               const mtrain_fwd_step_args_t *a);
/* The forward kernel of variant 3 that a context runs, read once when the
 * context is created (kept in cuda_state_t::wgmma_fwd_persistent): the
 * environment variable MTRAIN_CUDA_WGMMA_FWD_PERSISTENT, "1" for the
 * persistent kernel (wgmma_fwd_persistent_kernel: min(items, SMs x CTAs per
 * SM) CTAs that loop over the query items), "0" for one CTA per item
 * (wgmma_fwd_kernel); unset or empty: wg::kFwdPersistentDefault
 * (attn_wgmma_fwd.cu). Any other value: MTRAIN_ERR_INVALID_CONFIG. */
mtrain_status_t cuda_wgmma_fwd_persistent_from_env(int *on);
/* The backward step on wgmma (attn_wgmma_bwd.cu): non-deterministic contexts
 * run one fused kernel (dQ by fp32 reductions, order-dependent in the last
 * bits); deterministic ones run variant 2's dQ kernel and the dK/dV kernel
 * of variant 3 without its dQ product. q, k, v and dout must be 16-byte
 * aligned; the bar scratch rows are written as by cuda_mma2_bwd. */
mtrain_status_t cuda_wgmma_bwd(cuda_state_t *s, const cuda_step_t *st,
                               const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar);
/* The backward kernel of variant 3 that a context runs, read once when the
 * context is created (kept in cuda_state_t::wgmma_bwd): the environment
 * variable MTRAIN_CUDA_WGMMA_BWD, "1" for the first kernel (wgmma_bwd_kernel:
 * consumer warpgroups only, which load the query tiles themselves), "2" or
 * unset for the warp-specialised one (wgmma_bwd_ws_kernel: a producer
 * warpgroup, mbarrier stages). Any other value: MTRAIN_ERR_INVALID_CONFIG. */
mtrain_status_t cuda_wgmma_bwd_kernel_from_env(int *which);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_ATTN_WGMMA_H */
