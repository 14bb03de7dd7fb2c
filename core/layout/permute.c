/* permute.c: the layout permutation of token-major tensors and its inverse
 * (SPEC.md section 3), through the backend's permute operation with the
 * layout's gather index. */
#include <stdlib.h>

#include "core/runtime/backend.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"

/* Checks shapes; returns the bytes of one token row. */
static mtrain_status_t check(mtrain_context_t *ctx, const mtrain_layout_t *layout, int32_t rank,
                             const mtrain_tensor_t *full, const mtrain_tensor_t *local,
                             size_t *row_bytes) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(layout);
  MTRAIN_CHECK_NOT_NULL(full);
  MTRAIN_CHECK_NOT_NULL(local);
  if (rank < 0 || rank >= mtrain_layout_world(layout))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "permute: rank %d out of range [0, %d)", rank,
                        mtrain_layout_world(layout));
  if (full->dtype != local->dtype || mtrain_dtype_size(full->dtype) == 0)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "permute: dtypes %s and %s",
                        mtrain_dtype_name(full->dtype), mtrain_dtype_name(local->dtype));
  if (full->ndim != local->ndim || full->ndim < 1 || full->ndim > MTRAIN_MAX_DIMS)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "permute: %d and %d dimensions", full->ndim,
                        local->ndim);
  if (full->shape[0] != mtrain_layout_seq_len(layout))
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "permute: the whole tensor has %lld tokens, the layout %lld",
                        (long long)full->shape[0], (long long)mtrain_layout_seq_len(layout));
  if (local->shape[0] != mtrain_layout_local_tokens(layout, rank))
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "permute: the local tensor has %lld tokens, rank %d holds %lld slots",
                        (long long)local->shape[0], rank,
                        (long long)mtrain_layout_local_tokens(layout, rank));
  size_t row = mtrain_dtype_size(full->dtype);
  for (int32_t i = 1; i < full->ndim; i++) {
    if (full->shape[i] != local->shape[i])
      return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "permute: shape[%d] is %lld and %lld", i,
                          (long long)full->shape[i], (long long)local->shape[i]);
    row *= (size_t)full->shape[i];
  }
  if ((!full->data && full->shape[0] > 0) || (!local->data && local->shape[0] > 0))
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "permute: a tensor has data == NULL");
  *row_bytes = row;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t run(mtrain_context_t *ctx, const mtrain_layout_t *layout, int32_t rank,
                           const mtrain_tensor_t *full, const mtrain_tensor_t *local, int scatter) {
  size_t row = 0;
  mtrain_status_t st = check(ctx, layout, rank, full, local, &row);
  if (st) return st;
  const int64_t T = mtrain_layout_local_tokens(layout, rank);
  int64_t *index = malloc(sizeof(int64_t) * (size_t)(T + 1));
  if (!index) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "permute: out of memory");
  st = mtrain_layout_rank_token_index(layout, rank, index);
  if (!st)
    st = scatter
             ? mtrain_be_permute(ctx, full->data, local->data, row, index, T, full->shape[0], 1)
             : mtrain_be_permute(ctx, local->data, full->data, row, index, T, full->shape[0], 0);
  free(index);
  return st;
}

mtrain_status_t mtrain_layout_permute(mtrain_context_t *ctx, const mtrain_layout_t *layout,
                                      int32_t rank, const mtrain_tensor_t *full,
                                      mtrain_tensor_t *local) {
  return run(ctx, layout, rank, full, local, 0);
}

mtrain_status_t mtrain_layout_unpermute(mtrain_context_t *ctx, const mtrain_layout_t *layout,
                                        int32_t rank, const mtrain_tensor_t *local,
                                        mtrain_tensor_t *full) {
  return run(ctx, layout, rank, full, local, 1);
}
