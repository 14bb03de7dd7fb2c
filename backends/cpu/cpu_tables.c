/* cpu_tables.c: the two CPU backend tables, "cpu-ref" (the fp64 oracle) and
 * "cpu" (fast fp32 path), and their capability checks. */
#include "backends/cpu/cpu_backend.h"
#include "mtrain/mtrain_error.h"

#define MTRAIN_CPU_MAX_HEAD_DIM 512

static mtrain_status_t check_head_dim(const char *name, int32_t head_dim) {
  if (head_dim < 1 || head_dim > MTRAIN_CPU_MAX_HEAD_DIM)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_HEAD_DIM,
                        "backend '%s' supports head_dim 1..%d, got %d", name,
                        MTRAIN_CPU_MAX_HEAD_DIM, head_dim);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t ref_supports(void *state, mtrain_dtype_t dtype, int32_t head_dim) {
  (void)state;
  if (mtrain_dtype_size(dtype) == 0)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "backend 'cpu-ref': unknown dtype %d",
                        (int)dtype);
  return check_head_dim("cpu-ref", head_dim);
}

static mtrain_status_t fast_supports(void *state, mtrain_dtype_t dtype, int32_t head_dim) {
  (void)state;
  if (dtype != MTRAIN_F32 && dtype != MTRAIN_BF16 && dtype != MTRAIN_F16)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                        "backend 'cpu' computes fp32, bf16 and fp16 inputs, not %s (fp64 is for "
                        "the 'cpu-ref' backend)",
                        mtrain_dtype_name(dtype));
  return check_head_dim("cpu", head_dim);
}

const mtrain_backend_ops_t mtrain_cpu_ref_backend = {
    .api_version = MTRAIN_API_VERSION,
    .name = "cpu-ref",
    .acc_dtype = MTRAIN_F64,
    .memory_space = MTRAIN_MEMORY_HOST,
    .init = mtrain_cpu_init,
    .fini = mtrain_cpu_fini,
    .supports = ref_supports,
    .alloc = mtrain_cpu_alloc,
    .free = mtrain_cpu_free,
    .memset_zero = mtrain_cpu_memset_zero,
    .copy_to_host = mtrain_cpu_copy,
    .copy_from_host = mtrain_cpu_copy_from,
    .copy = mtrain_cpu_copy,
    .add = mtrain_cpu_add,
    .permute = mtrain_cpu_permute,
    .convert = mtrain_cpu_convert,
    .find_nonfinite = mtrain_cpu_find_nonfinite,
    .attn_fwd_init = mtrain_cpu_ref_fwd_init,
    .attn_fwd_step = mtrain_cpu_ref_fwd_step,
    .attn_bwd_prepare = mtrain_cpu_ref_bwd_prepare,
    .attn_bwd_step = mtrain_cpu_ref_bwd_step,
    .pattern_scores = mtrain_cpu_ref_pattern_scores,
    .block_scores = mtrain_cpu_ref_block_scores,
    .block_scores_key_chunks = MTRAIN_BLOCK_CHUNKS_SUMS | MTRAIN_BLOCK_CHUNKS_ANTIDIAG,
    .block_scores_noncausal = 1,
    .noncausal = 1,
    .synchronize = mtrain_cpu_synchronize,
};

const mtrain_backend_ops_t mtrain_cpu_backend = {
    .api_version = MTRAIN_API_VERSION,
    .name = "cpu",
    .acc_dtype = MTRAIN_F32,
    .memory_space = MTRAIN_MEMORY_HOST,
    .init = mtrain_cpu_init,
    .fini = mtrain_cpu_fini,
    .supports = fast_supports,
    .alloc = mtrain_cpu_alloc,
    .free = mtrain_cpu_free,
    .memset_zero = mtrain_cpu_memset_zero,
    .copy_to_host = mtrain_cpu_copy,
    .copy_from_host = mtrain_cpu_copy_from,
    .copy = mtrain_cpu_copy,
    .add = mtrain_cpu_add,
    .permute = mtrain_cpu_permute,
    .convert = mtrain_cpu_convert,
    .find_nonfinite = mtrain_cpu_find_nonfinite,
    .attn_fwd_init = mtrain_cpu_fast_fwd_init,
    .attn_fwd_step = mtrain_cpu_fast_fwd_step,
    .attn_bwd_prepare = mtrain_cpu_fast_bwd_prepare,
    .attn_bwd_step = mtrain_cpu_fast_bwd_step,
    .pattern_scores = mtrain_cpu_fast_pattern_scores,
    .block_scores = mtrain_cpu_fast_block_scores,
    .block_scores_key_chunks = MTRAIN_BLOCK_CHUNKS_SUMS | MTRAIN_BLOCK_CHUNKS_ANTIDIAG,
    .block_scores_noncausal = 1,
    .noncausal = 1,
    .synchronize = mtrain_cpu_synchronize,
};
