/* mass_curve.c: SparseBalance's per-head sensitivity (docs/BALANCE.md,
 * "SparseBalance"): how much of the estimation's own score mass a head keeps
 * at each budget level. The public estimate returns only the selected
 * pattern, so the scores are formed here again by SPEC.md section 2's
 * definition (top-p mode: the last L queries' causal softmax rows divided by
 * L, summing to 1), in fp64 on the host, and each level's static top-k
 * selection (sinks and window forced, then the best vertical and slash
 * scores, ties to the lower index) is scored by the exact mass of the union
 * of its verticals and slashes over those rows. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/balance/balance_internal.h"
#include "mtrain/mtrain_error.h"

typedef struct scored {
  double s;
  int64_t i;
} scored_t;

static int by_score(const void *a, const void *b) {
  const scored_t *x = a, *y = b;
  if (x->s != y->s) return x->s < y->s ? 1 : -1;
  return (x->i > y->i) - (x->i < y->i);
}

static int64_t scaled_count(int64_t x, double scale) {
  if (x <= 0) return 0;
  const double y = floor((double)x * scale + 0.5);
  return y < 1 ? 1 : (int64_t)y;
}

/* One head's curve into out[0..K): the score matrix of SPEC.md section 2
 * (top-p mode) over the last L rows, the rankings, and per level the mass of
 * the selected union. Buffers: A [L * N], the others [N]. */
static void mass_head(const float *q, const float *k, int64_t N, int32_t Hq, int32_t Hkv, int32_t d,
                      int32_t G, int32_t h, int64_t L, const mtrain_head_budget_t *b,
                      const double *scales, int32_t K, const mtrain_position_model_t *pm, double *A,
                      double *vs, double *ss, scored_t *vo, scored_t *so, uint8_t *inv,
                      double *out) {
  const int32_t kv = h / (Hq / Hkv);
  const int64_t nb = (N + G - 1) / G, ncand = (nb - 1) * G; /* vertical candidates */
  const double scale = 1.0 / sqrt((double)d);
  memset(vs, 0, (size_t)N * sizeof *vs);
  memset(ss, 0, (size_t)N * sizeof *ss);
  for (int64_t r = 0; r < L; r++) {
    const int64_t i = N - L + r;
    const float *qi = q + ((size_t)i * Hq + h) * d;
    double *row = A + r * N, m = -INFINITY, z = 0;
    for (int64_t j = 0; j <= i; j++) {
      const float *kj = k + ((size_t)j * Hkv + kv) * d;
      double dot = 0;
      for (int32_t c = 0; c < d; c++) dot += (double)qi[c] * (double)kj[c];
      row[j] = scale * dot;
      if (row[j] > m) m = row[j];
    }
    for (int64_t j = 0; j <= i; j++) z += exp(row[j] - m);
    for (int64_t j = 0; j <= i; j++) {
      row[j] = exp(row[j] - m) / (z * (double)L);
      vs[j] += row[j];
      ss[i - j] += row[j];
    }
    for (int64_t j = i + 1; j < N; j++) row[j] = 0;
  }
  /* rankings: forced candidates first (+infinity), then scores descending */
  for (int64_t j = 0; j < ncand; j++) {
    vo[j].i = j;
    vo[j].s = j < pm->num_sinks ? INFINITY : vs[j];
  }
  for (int64_t t = 0; t < N; t++) {
    so[t].i = t;
    so[t].s = t < pm->window ? INFINITY : ss[t];
  }
  qsort(vo, (size_t)ncand, sizeof *vo, by_score);
  qsort(so, (size_t)N, sizeof *so, by_score);
  for (int32_t lvl = 0; lvl < K; lvl++) {
    mtrain_head_budget_t sb;
    memset(&sb, 0, sizeof sb);
    sb.kind = MTRAIN_BUDGET_TOP_K;
    sb.v_size = scaled_count(b->kind == MTRAIN_BUDGET_TOP_K ? b->v_size : b->cap_v, scales[lvl]);
    sb.s_size = scaled_count(b->kind == MTRAIN_BUDGET_TOP_K ? b->s_size : b->cap_s, scales[lvl]);
    int64_t nv = 0, ns = 0;
    mtrain_position_model_counts(&sb, N, G, pm, &nv, &ns); /* inputs checked by the caller */
    memset(inv, 0, (size_t)N);
    for (int64_t x = 0; x < nv; x++) inv[vo[x].i] = 1;
    double kept = 0;
    for (int64_t r = 0; r < L; r++) {
      const int64_t i = N - L + r;
      const double *row = A + r * N;
      for (int64_t x = 0; x < nv; x++)
        if (vo[x].i <= i) kept += row[vo[x].i];
      for (int64_t x = 0; x < ns; x++) {
        const int64_t j = i - so[x].i;
        if (j >= 0 && !inv[j]) kept += row[j];
      }
    }
    kept = kept > 1 ? 1 : kept;
    /* the selections are nested, so the mass cannot fall; rounding of the
     * different sums could make it by an ulp */
    out[lvl] = lvl > 0 && kept < out[lvl - 1] ? out[lvl - 1] : kept;
  }
}

mtrain_status_t mtrain_balance_mass_curve(const float *q, const float *k, int64_t N, int32_t Hq,
                                          int32_t Hkv, int32_t d, int32_t G,
                                          const mtrain_head_budget_t *budgets, const double *scales,
                                          int32_t K, int64_t budget_context,
                                          const mtrain_estimate_options_t *opt, double *mass) {
  MTRAIN_CHECK_NOT_NULL(q);
  MTRAIN_CHECK_NOT_NULL(k);
  MTRAIN_CHECK_NOT_NULL(budgets);
  MTRAIN_CHECK_NOT_NULL(scales);
  MTRAIN_CHECK_NOT_NULL(opt);
  MTRAIN_CHECK_NOT_NULL(mass);
  if (N < 2 || Hq < 1 || Hkv < 1 || Hq % Hkv || d < 1 || G < 1 || K < 1 || budget_context < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance mass curve: seq_len %lld (>= 2), heads %d:%d (kv dividing q), "
                        "head_dim %d, granularity %d, levels %d (>= 1), budget_context %lld "
                        "(>= 0)",
                        (long long)N, Hq, Hkv, d, G, K, (long long)budget_context);
  if (opt->last_q < 1 || opt->num_sinks < 0 || opt->window < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance mass curve: last_q %d must be >= 1, sinks %d and window %d >= 0",
                        opt->last_q, opt->num_sinks, opt->window);
  if (opt->top_p_forced != 0 && opt->top_p_forced != 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance mass curve: top_p_forced %d must be 0 or 1", opt->top_p_forced);
  for (int32_t i = 0; i < K; i++)
    if (!(scales[i] > 0) || !isfinite(scales[i]))
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance mass curve: scales[%d] = %g must be finite and > 0", i,
                          scales[i]);
  for (int32_t h = 0; h < Hq; h++) {
    mtrain_status_t st = mtrain_head_budget_validate(&budgets[h]);
    if (st != MTRAIN_SUCCESS) return mtrain_error_prefix(st, "balance mass curve: head %d", h);
  }
  const int64_t L = opt->last_q < N ? opt->last_q : N;
  mtrain_position_model_t pm = MTRAIN_POSITION_MODEL_INIT;
  pm.num_sinks = opt->num_sinks;
  pm.window = opt->window;
  pm.budget_context = budget_context;
  int oom = 0;
  /* heads in parallel (OpenMP), each thread with its own buffers; a head's
   * curve depends on that head only, so any thread count gives the same */
#pragma omp parallel
  {
    double *A = malloc((size_t)(L * N) * sizeof *A);
    double *vs = malloc((size_t)N * sizeof *vs), *ss = malloc((size_t)N * sizeof *ss);
    scored_t *vo = malloc((size_t)N * sizeof *vo), *so = malloc((size_t)N * sizeof *so);
    uint8_t *inv = malloc((size_t)N);
    const int ok = A && vs && ss && vo && so && inv;
    if (!ok) {
#pragma omp atomic write
      oom = 1;
    }
#pragma omp for schedule(dynamic)
    for (int32_t h = 0; h < Hq; h++)
      if (ok)
        mass_head(q, k, N, Hq, Hkv, d, G, h, L, &budgets[h], scales, K, &pm, A, vs, ss, vo, so, inv,
                  mass + (size_t)h * K);
    free(A);
    free(vs);
    free(ss);
    free(vo);
    free(so);
    free(inv);
  }
  if (oom) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "balance mass curve: out of memory");
  return MTRAIN_SUCCESS;
}
