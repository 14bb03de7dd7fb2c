/* cpu_common.c: what the two CPU backends share: state, host memory,
 * element-wise conversion and the NaN/Inf scan. Host memory is 64-byte
 * aligned. Parallel with OpenMP over large element counts. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_backend.h"
#include "mtrain/mtrain_error.h"

mtrain_status_t mtrain_cpu_init(const mtrain_config_t *config, void **state) {
  cpu_state_t *s = calloc(1, sizeof *s);
  if (!s) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu backend: out of memory");
  s->num_threads = config->num_threads > 0 ? config->num_threads : omp_get_max_threads();
  s->deterministic = config->deterministic;
  *state = s;
  return MTRAIN_SUCCESS;
}

void mtrain_cpu_fini(void *state) { free(state); }

mtrain_status_t mtrain_cpu_alloc(void *state, size_t bytes, void **ptr) {
  (void)state;
  size_t rounded = (bytes + 63) / 64 * 64;
  void *p = aligned_alloc(64, rounded ? rounded : 64);
  if (!p)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu backend: cannot allocate %zu bytes", bytes);
  *ptr = p;
  return MTRAIN_SUCCESS;
}

void mtrain_cpu_free(void *state, void *ptr) {
  (void)state;
  free(ptr);
}

mtrain_status_t mtrain_cpu_memset_zero(void *state, void *ptr, size_t bytes) {
  (void)state;
  memset(ptr, 0, bytes);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_copy(void *state, void *dst, const void *src, size_t bytes) {
  (void)state;
  memmove(dst, src, bytes);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_copy_from(void *state, void *dst, const void *src, size_t bytes) {
  return mtrain_cpu_copy(state, dst, src, bytes);
}

mtrain_status_t mtrain_cpu_add(void *state, void *dst, const void *src, mtrain_dtype_t dtype,
                               int64_t count) {
  cpu_state_t *s = state;
  if (dtype == MTRAIN_F32) {
    float *d = dst;
    const float *x = src;
#pragma omp parallel for num_threads(s->num_threads) schedule(static)
    for (int64_t i = 0; i < count; i++) d[i] += x[i];
  } else if (dtype == MTRAIN_F64) {
    double *d = dst;
    const double *x = src;
#pragma omp parallel for num_threads(s->num_threads) schedule(static)
    for (int64_t i = 0; i < count; i++) d[i] += x[i];
  } else {
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "cpu backend: add of %s",
                        mtrain_dtype_name(dtype));
  }
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_permute(void *state, void *dst, const void *src, size_t row_bytes,
                                   const int64_t *index, int64_t count, int64_t other_rows,
                                   int scatter) {
  cpu_state_t *s = state;
#pragma omp parallel for num_threads(s->num_threads) schedule(static)
  for (int64_t i = 0; i < count; i++) {
    const int64_t j = index[i];
    if (scatter) {
      if (j >= 0 && j < other_rows)
        memcpy((char *)dst + (size_t)j * row_bytes, (const char *)src + (size_t)i * row_bytes,
               row_bytes);
    } else if (j >= 0 && j < other_rows) {
      memcpy((char *)dst + (size_t)i * row_bytes, (const char *)src + (size_t)j * row_bytes,
             row_bytes);
    } else {
      memset((char *)dst + (size_t)i * row_bytes, 0, row_bytes);
    }
  }
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_convert(void *state, const void *src, mtrain_dtype_t src_dtype,
                                   void *dst, mtrain_dtype_t dst_dtype, int64_t count) {
  cpu_state_t *s = state;
  const int64_t chunk = 1 << 16;
  const int64_t nchunks = (count + chunk - 1) / chunk;
  const size_t ss = mtrain_dtype_size(src_dtype), ds = mtrain_dtype_size(dst_dtype);
  if (!ss || !ds)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "cpu backend: convert %d -> %d",
                        (int)src_dtype, (int)dst_dtype);
  int failed = 0;
#pragma omp parallel for num_threads(s->num_threads) schedule(static) reduction(| : failed)
  for (int64_t c = 0; c < nchunks; c++) {
    int64_t begin = c * chunk, n = count - begin < chunk ? count - begin : chunk;
    failed |= mtrain_convert((const char *)src + begin * ss, src_dtype, (char *)dst + begin * ds,
                             dst_dtype, n) != MTRAIN_SUCCESS;
  }
  return failed ? mtrain_error(MTRAIN_ERR_INTERNAL, "cpu backend: conversion failed")
                : MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_find_nonfinite(void *state, const void *ptr, mtrain_dtype_t dtype,
                                          int64_t count, int64_t *bad_index) {
  cpu_state_t *s = state;
  int64_t first = INT64_MAX;
#pragma omp parallel for num_threads(s->num_threads) schedule(static) reduction(min : first)
  for (int64_t i = 0; i < count; i++)
    if (!isfinite(mtrain_cpu_load(ptr, dtype, i)) && i < first) first = i;
  *bad_index = first == INT64_MAX ? -1 : first;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_synchronize(void *state) {
  (void)state;
  return MTRAIN_SUCCESS;
}
