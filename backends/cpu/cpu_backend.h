/* cpu_backend.h (private): the two CPU backends' tables and the pieces they
 * share: state, memory and conversion operations, element loads. */
#ifndef MTRAIN_CPU_BACKEND_H
#define MTRAIN_CPU_BACKEND_H

#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_backend.h"

extern const mtrain_backend_ops_t mtrain_cpu_ref_backend; /* "cpu-ref": fp64 oracle */
extern const mtrain_backend_ops_t mtrain_cpu_backend;     /* "cpu": OpenMP + OpenBLAS */

typedef struct cpu_state {
  int num_threads;        /* OpenMP threads for this backend's parallel regions */
  int deterministic;      /* 1: fixed work assignment, bitwise repeatable results */
  int saved_blas_threads; /* OpenBLAS thread count to restore at fini */
} cpu_state_t;

/* Shared operations (cpu_common.c). */
mtrain_status_t mtrain_cpu_init(const mtrain_config_t *config, void **state);
void mtrain_cpu_fini(void *state);
mtrain_status_t mtrain_cpu_alloc(void *state, size_t bytes, void **ptr);
void mtrain_cpu_free(void *state, void *ptr);
mtrain_status_t mtrain_cpu_memset_zero(void *state, void *ptr, size_t bytes);
mtrain_status_t mtrain_cpu_copy(void *state, void *dst, const void *src, size_t bytes);
mtrain_status_t mtrain_cpu_copy_from(void *state, void *dst, const void *src, size_t bytes);
mtrain_status_t mtrain_cpu_add(void *state, void *dst, const void *src, mtrain_dtype_t dtype,
                               int64_t count);
mtrain_status_t mtrain_cpu_permute(void *state, void *dst, const void *src, size_t row_bytes,
                                   const int64_t *index, int64_t count, int64_t other_rows,
                                   int scatter);
mtrain_status_t mtrain_cpu_convert(void *state, const void *src, mtrain_dtype_t src_dtype,
                                   void *dst, mtrain_dtype_t dst_dtype, int64_t count);
mtrain_status_t mtrain_cpu_find_nonfinite(void *state, const void *ptr, mtrain_dtype_t dtype,
                                          int64_t count, int64_t *bad_index);
mtrain_status_t mtrain_cpu_synchronize(void *state);

/* Reference-path operations (cpu_ref.c), accumulators fp64. */
mtrain_status_t mtrain_cpu_ref_fwd_init(void *state, void *o_acc, void *lse_acc, int64_t rows,
                                        int32_t num_heads, int32_t head_dim);
mtrain_status_t mtrain_cpu_ref_fwd_step(void *state, const mtrain_fwd_step_args_t *args);
mtrain_status_t mtrain_cpu_ref_bwd_prepare(void *state, const void *o, const void *dout,
                                           mtrain_dtype_t dtype, void *delta_acc, int64_t rows,
                                           int32_t num_heads, int32_t head_dim);
mtrain_status_t mtrain_cpu_ref_bwd_step(void *state, const mtrain_bwd_step_args_t *args);

/* Fast-path operations (cpu_fast_fwd.c, cpu_fast_bwd.c), accumulators fp32. */
mtrain_status_t mtrain_cpu_fast_fwd_init(void *state, void *o_acc, void *lse_acc, int64_t rows,
                                         int32_t num_heads, int32_t head_dim);
mtrain_status_t mtrain_cpu_fast_fwd_step(void *state, const mtrain_fwd_step_args_t *args);
mtrain_status_t mtrain_cpu_fast_bwd_prepare(void *state, const void *o, const void *dout,
                                            mtrain_dtype_t dtype, void *delta_acc, int64_t rows,
                                            int32_t num_heads, int32_t head_dim);
mtrain_status_t mtrain_cpu_fast_bwd_step(void *state, const mtrain_bwd_step_args_t *args);

/* Pattern scores (cpu_scores.c). */
mtrain_status_t mtrain_cpu_ref_pattern_scores(void *state, const mtrain_scores_args_t *args);
mtrain_status_t mtrain_cpu_fast_pattern_scores(void *state, const mtrain_scores_args_t *args);

/* Block scores of SPEC.md section 9 (cpu_block_scores.c). */
mtrain_status_t mtrain_cpu_ref_block_scores(void *state, const mtrain_block_scores_args_t *args);
mtrain_status_t mtrain_cpu_fast_block_scores(void *state, const mtrain_block_scores_args_t *args);

/** Element i of a buffer of `dtype`, widened to double. */
static inline double mtrain_cpu_load(const void *p, mtrain_dtype_t dtype, int64_t i) {
  switch (dtype) {
  case MTRAIN_F32:
    return ((const float *)p)[i];
  case MTRAIN_F64:
    return ((const double *)p)[i];
  case MTRAIN_BF16: {
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  case MTRAIN_F16:
    return mtrain_half_to_float(((const uint16_t *)p)[i]);
  }
  return 0.0;
}

#endif /* MTRAIN_CPU_BACKEND_H */
