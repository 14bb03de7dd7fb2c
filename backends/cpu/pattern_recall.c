/* pattern_recall.c: pattern quality (mtrain_cpu.h): the share of the dense
 * causal softmax mass that the keys allowed by the pattern hold, per head and
 * on average. fp64, straight from the mtrain_pattern_allowed predicate like
 * the dense reference; OpenMP over query heads. */
#include <math.h>
#include <stdlib.h>

#include "mtrain/mtrain_cpu.h"
#include "mtrain/mtrain_error.h"

static double dot(const double *a, const double *b, int32_t d) {
  double s = 0.0;
  for (int32_t c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

/* Mean over rows of head h of the allowed share of row i's dense softmax;
 * row is N doubles of scratch. */
static double head_recall(const mtrain_pattern_t *p, int32_t h, int32_t hkv, int32_t d,
                          double scale, const double *q, const double *k, double *row) {
  const int64_t n = mtrain_pattern_seq_len(p);
  const int32_t hq = mtrain_pattern_num_heads(p), hk = h / (hq / hkv);
  double total = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double *qi = q + (i * hq + h) * d;
    const int64_t j_end = mtrain_pattern_is_causal(p) ? i + 1 : n;
    double m = -INFINITY;
    for (int64_t j = 0; j < j_end; j++) {
      row[j] = scale * dot(qi, k + (j * hkv + hk) * d, d);
      if (row[j] > m) m = row[j];
    }
    double all = 0.0, kept = 0.0;
    for (int64_t j = 0; j < j_end; j++) {
      const double e = exp(row[j] - m);
      all += e;
      if (mtrain_pattern_allowed(p, h, i, j)) kept += e;
    }
    total += kept / all;
  }
  return total / (double)n;
}

mtrain_status_t mtrain_cpu_pattern_recall(const mtrain_pattern_t *pattern, int32_t hkv, int32_t d,
                                          double scale, const double *q, const double *k,
                                          double *per_head, double *mean) {
  MTRAIN_CHECK_NOT_NULL(pattern);
  const mtrain_pattern_t *p = pattern;
  MTRAIN_CHECK_NOT_NULL(q);
  MTRAIN_CHECK_NOT_NULL(k);
  MTRAIN_CHECK_NOT_NULL(mean);
  const int32_t hq = mtrain_pattern_num_heads(p);
  if (hkv < 1 || hq % hkv != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                        "pattern recall: %d query heads are not a multiple of %d kv heads", hq,
                        hkv);
  if (d < 1) return mtrain_error(MTRAIN_ERR_UNSUPPORTED_HEAD_DIM, "pattern recall: head_dim %d", d);
  if (!isfinite(scale))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "pattern recall: scale %g is not finite",
                        scale);
  if (scale <= 0) scale = 1.0 / sqrt((double)d);
  const int64_t n = mtrain_pattern_seq_len(p);
  double *rows = malloc(sizeof(double) * (size_t)n * (size_t)hq);
  double *recall = malloc(sizeof(double) * (size_t)hq);
  if (!rows || !recall) {
    free(rows);
    free(recall);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "pattern recall: out of memory");
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int32_t h = 0; h < hq; h++)
    recall[h] = head_recall(p, h, hkv, d, scale, q, k, rows + (int64_t)h * n);
  double sum = 0.0;
  for (int32_t h = 0; h < hq; h++) {
    sum += recall[h];
    if (per_head) per_head[h] = recall[h];
  }
  *mean = sum / (double)hq;
  free(rows);
  free(recall);
  return MTRAIN_SUCCESS;
}
