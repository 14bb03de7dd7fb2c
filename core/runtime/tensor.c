/* tensor.c: tensor descriptor helpers (construction, element counts). Shape
 * checks against a plan live in attention.c where the rules are known. */
#include <stdint.h>

#include "mtrain/mtrain_error.h"

mtrain_tensor_t mtrain_tensor_3d(void *data, mtrain_dtype_t dtype, int64_t tokens, int64_t heads,
                                 int64_t dim) {
  mtrain_tensor_t t = {data, dtype, 3, {tokens, heads, dim, 0}};
  return t;
}

mtrain_tensor_t mtrain_tensor_2d(void *data, mtrain_dtype_t dtype, int64_t tokens, int64_t heads) {
  mtrain_tensor_t t = {data, dtype, 2, {tokens, heads, 0, 0}};
  return t;
}

int64_t mtrain_tensor_numel(const mtrain_tensor_t *t) {
  if (!t || t->ndim < 0 || t->ndim > MTRAIN_MAX_DIMS) return 0;
  int64_t n = 1;
  for (int32_t i = 0; i < t->ndim; i++)
    if (t->shape[i] < 0) return 0;
  for (int32_t i = 0; i < t->ndim; i++) {
    if (t->shape[i] == 0) return 0;
    if (n > INT64_MAX / t->shape[i]) return -1; /* overflow: never a count to allocate */
    n *= t->shape[i];
  }
  return n;
}
