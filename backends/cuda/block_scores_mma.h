/* block_scores_mma.h (private): the tensor-core path of the cuda block
 * scores (block_scores_mma.cu), which cuda_block_scores.cu chooses. */
#ifndef MTRAIN_CUDA_BLOCK_SCORES_MMA_H
#define MTRAIN_CUDA_BLOCK_SCORES_MMA_H

#include "backends/cuda/cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when the tensor-core kernels score this call (precise or antidiag, q
 * bf16 or fp16 and k of the same dtype, head_dim 64 or 128, G 64 or 128,
 * q and k 16-byte aligned, a device of compute capability 8 or more); 2 when so but for fp32 keys:
 * the kernels then score it if every key is a value of the q dtype, the fp64 kernels otherwise
 * (gate); 0: the fp64 kernels score it. */
int cuda_block_scores_mma_supports(const cuda_state_t *s, const mtrain_block_scores_args_t *a);

/* Queues the tensor-core kernels of a checked call with num_q_blocks > 0.
 * dev_blocks: device [3][num_q_blocks] int64: the global blocks, the rows'
 * offsets within a head, the local blocks longest row first. gate: a device
 * word holding 0 (fp32 keys only): set to nonzero when a key is not a value
 * of the q dtype, and then the tensor-core kernels leave the scores alone. */
mtrain_status_t cuda_block_scores_mma(cuda_state_t *s, const mtrain_block_scores_args_t *a,
                                      const int64_t *dev_blocks, unsigned *gate, const char *who);

#ifdef __cplusplus
}
#endif

#endif
