/* dense_reference.c: fp64 dense-masked attention from the pattern predicate
 * (mtrain_cpu.h). Every (i, j) with j <= i (every j of a non-causal pattern)
 * is tested with
 * mtrain_pattern_allowed; nothing of the plan or the backends is used, so it
 * is an independent oracle for both. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_cpu.h"
#include "mtrain/mtrain_error.h"

static double dot(const double *a, const double *b, int32_t d) {
  double s = 0.0;
  for (int32_t c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

static mtrain_status_t check_args(const mtrain_pattern_t *p, int32_t hkv, int32_t d) {
  MTRAIN_CHECK_NOT_NULL(p);
  int32_t hq = mtrain_pattern_num_heads(p);
  if (hkv < 1 || hq % hkv != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                        "dense reference: %d query heads are not a multiple of %d kv heads", hq,
                        hkv);
  if (d < 1)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_HEAD_DIM, "dense reference: head_dim %d", d);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_dense_reference_forward(const mtrain_pattern_t *p, int32_t hkv,
                                                   int32_t d, double scale, const double *q,
                                                   const double *k, const double *v, double *o,
                                                   double *lse) {
  mtrain_status_t st = check_args(p, hkv, d);
  if (st) return st;
  MTRAIN_CHECK_NOT_NULL(q);
  MTRAIN_CHECK_NOT_NULL(k);
  MTRAIN_CHECK_NOT_NULL(v);
  MTRAIN_CHECK_NOT_NULL(o);
  MTRAIN_CHECK_NOT_NULL(lse);
  const int64_t N = mtrain_pattern_seq_len(p);
  const int32_t hq = mtrain_pattern_num_heads(p), group = hq / hkv;
  if (scale <= 0) scale = 1.0 / sqrt((double)d);
  double *s = malloc(sizeof(double) * (size_t)N * hq);
  if (!s) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "dense reference: out of memory");
#pragma omp parallel for schedule(dynamic, 1)
  for (int32_t h = 0; h < hq; h++) {
    double *row = s + (int64_t)h * N;
    const int32_t hk = h / group;
    for (int64_t i = 0; i < N; i++) {
      const double *qi = q + (i * hq + h) * d;
      const int64_t j_end = mtrain_pattern_is_causal(p) ? i + 1 : N;
      double m = -INFINITY;
      for (int64_t j = 0; j < j_end; j++) {
        row[j] = mtrain_pattern_allowed(p, h, i, j) ? scale * dot(qi, k + (j * hkv + hk) * d, d)
                                                    : -INFINITY;
        if (row[j] > m) m = row[j];
      }
      double sum = 0.0;
      for (int64_t j = 0; j < j_end; j++) sum += exp(row[j] - m);
      const double l = m + log(sum);
      double *oi = o + (i * hq + h) * d;
      memset(oi, 0, sizeof(double) * (size_t)d);
      for (int64_t j = 0; j < j_end; j++) {
        const double pij = exp(row[j] - l);
        if (pij == 0.0) continue;
        const double *vj = v + (j * hkv + hk) * d;
        for (int32_t c = 0; c < d; c++) oi[c] += pij * vj[c];
      }
      lse[i * hq + h] = l;
    }
  }
  free(s);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_dense_reference_backward(const mtrain_pattern_t *p, int32_t hkv,
                                                    int32_t d, double scale, const double *q,
                                                    const double *k, const double *v,
                                                    const double *o, const double *lse,
                                                    const double *dout, double *dq, double *dk,
                                                    double *dv) {
  mtrain_status_t st = check_args(p, hkv, d);
  if (st) return st;
  MTRAIN_CHECK_NOT_NULL(q);
  MTRAIN_CHECK_NOT_NULL(k);
  MTRAIN_CHECK_NOT_NULL(v);
  MTRAIN_CHECK_NOT_NULL(o);
  MTRAIN_CHECK_NOT_NULL(lse);
  MTRAIN_CHECK_NOT_NULL(dout);
  MTRAIN_CHECK_NOT_NULL(dq);
  MTRAIN_CHECK_NOT_NULL(dk);
  MTRAIN_CHECK_NOT_NULL(dv);
  const int64_t N = mtrain_pattern_seq_len(p);
  const int32_t hq = mtrain_pattern_num_heads(p), group = hq / hkv;
  if (scale <= 0) scale = 1.0 / sqrt((double)d);
  memset(dq, 0, sizeof(double) * (size_t)(N * hq * d));
  memset(dk, 0, sizeof(double) * (size_t)(N * hkv * d));
  memset(dv, 0, sizeof(double) * (size_t)(N * hkv * d));
  /* one kv head per iteration: its dk/dv and its group's dq are private */
#pragma omp parallel for schedule(dynamic, 1)
  for (int32_t hk = 0; hk < hkv; hk++)
    for (int32_t h = hk * group; h < (hk + 1) * group; h++)
      for (int64_t i = 0; i < N; i++) {
        const double *qi = q + (i * hq + h) * d, *doi = dout + (i * hq + h) * d;
        const double delta = dot(doi, o + (i * hq + h) * d, d), l = lse[i * hq + h];
        double *dqi = dq + (i * hq + h) * d;
        const int64_t j_end = mtrain_pattern_is_causal(p) ? i + 1 : N;
        for (int64_t j = 0; j < j_end; j++) {
          if (!mtrain_pattern_allowed(p, h, i, j)) continue;
          const double *kj = k + (j * hkv + hk) * d, *vj = v + (j * hkv + hk) * d;
          const double pij = exp(scale * dot(qi, kj, d) - l);
          const double ds = pij * (dot(doi, vj, d) - delta);
          double *dkj = dk + (j * hkv + hk) * d, *dvj = dv + (j * hkv + hk) * d;
          for (int32_t c = 0; c < d; c++) {
            dqi[c] += scale * ds * kj[c];
            dkj[c] += scale * ds * qi[c];
            dvj[c] += pij * doi[c];
          }
        }
      }
  return MTRAIN_SUCCESS;
}
