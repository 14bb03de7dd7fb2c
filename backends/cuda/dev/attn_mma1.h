/* attn_mma1.h (private, development build only): entry points of variant 1
 * of the CUDA attention kernels (dev/attn_mma_fwd.cu, dev/attn_mma_bwd.cu;
 * built with -DMTRAIN_CUDA_DEV_VARIANTS=ON, see dev/README.md). Same
 * contract as every variant (cuda_internal.h); the dispatcher calls them
 * only when variant 1 is forced, for calls that cuda_mma2_supports accepts
 * (the same shapes), with q, k, v and dout 16-byte aligned. */
#ifndef MTRAIN_ATTN_MMA1_H
#define MTRAIN_ATTN_MMA1_H

#include "backends/cuda/cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

mtrain_status_t cuda_mma_fwd(cuda_state_t *s, const cuda_step_t *st,
                             const mtrain_fwd_step_args_t *a);
mtrain_status_t cuda_mma_bwd(cuda_state_t *s, const cuda_step_t *st,
                             const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_ATTN_MMA1_H */
