/* batching.c: SparseBalance's coarse balance (docs/BALANCE.md,
 * "SparseBalance"): dealing the sequences of a global batch to ranks and
 * micro-batches. The solver is longest-processing-time first (Graham 1969:
 * makespan at most 4/3 - 1/(3R) times the optimum) followed by a local
 * search of moves and swaps off the busiest rank, each of which lowers both
 * ranks it touches below the busiest load (so the sum of squared loads falls
 * strictly and the search ends). Length-sorted batching, the third method, is
 * the baseline that groups similar lengths. Deterministic: ties go to the
 * lower index. */
#include <stdlib.h>
#include <string.h>

#include "core/balance/balance_internal.h"
#include "mtrain/mtrain_error.h"

typedef struct keyed {
  double w;
  int32_t i;
} keyed_t;

static int by_weight_desc(const void *a, const void *b) {
  const keyed_t *x = a, *y = b;
  if (x->w != y->w) return x->w < y->w ? 1 : -1;
  return (x->i > y->i) - (x->i < y->i);
}

static int by_weight_asc(const void *a, const void *b) {
  const keyed_t *x = a, *y = b;
  if (x->w != y->w) return x->w > y->w ? 1 : -1;
  return (x->i > y->i) - (x->i < y->i);
}

/* LPT of the items idx[0..m) (weights w) onto `bins` bins: bin_of[idx[j]]. */
static void lpt(const double *w, const int32_t *idx, int32_t m, int32_t bins, keyed_t *order,
                double *load, int32_t *bin_of) {
  for (int32_t j = 0; j < m; j++) {
    order[j].w = w[idx[j]];
    order[j].i = idx[j];
  }
  qsort(order, (size_t)m, sizeof *order, by_weight_desc);
  for (int32_t b = 0; b < bins; b++) load[b] = 0;
  for (int32_t j = 0; j < m; j++) {
    int32_t best = 0;
    for (int32_t b = 1; b < bins; b++)
      if (load[b] < load[best]) best = b;
    bin_of[order[j].i] = best;
    load[best] += order[j].w;
  }
}

/* Moves and swaps off the busiest rank while one lowers both ranks below it. */
static void improve(const double *w, int32_t n, int32_t R, int32_t *rank_of, double *load) {
  const int64_t max_rounds = 64 * (int64_t)n;
  for (int64_t round = 0; round < max_rounds; round++) {
    int32_t top = 0;
    for (int32_t r = 1; r < R; r++)
      if (load[r] > load[top]) top = r;
    const double L = load[top];
    double best = L; /* the larger of the two new loads; must fall below L */
    int32_t bi = -1, bj = -1, br = -1;
    for (int32_t i = 0; i < n; i++) {
      if (rank_of[i] != top || !(w[i] > 0)) continue;
      for (int32_t r = 0; r < R; r++) { /* move i to r */
        if (r == top) continue;
        const double a = L - w[i], b = load[r] + w[i], m = a > b ? a : b;
        if (m < best) {
          best = m;
          bi = i;
          bj = -1;
          br = r;
        }
      }
      for (int32_t j = 0; j < n; j++) { /* swap i with a lighter j elsewhere */
        const int32_t r = rank_of[j];
        if (r == top || !(w[j] < w[i])) continue;
        const double a = L - w[i] + w[j], b = load[r] + w[i] - w[j], m = a > b ? a : b;
        if (m < best) {
          best = m;
          bi = i;
          bj = j;
          br = r;
        }
      }
    }
    if (bi < 0) return;
    /* recompute the two loads from the items (no drift from repeated +/-) */
    rank_of[bi] = br;
    if (bj >= 0) rank_of[bj] = top;
    load[top] = load[br] = 0;
    for (int32_t i = 0; i < n; i++)
      if (rank_of[i] == top || rank_of[i] == br) load[rank_of[i]] += w[i];
  }
}

mtrain_status_t mtrain_balance_assign(const double *weights, int32_t n, int32_t ranks,
                                      int32_t micro_batches, mtrain_batch_method_t method,
                                      int32_t *rank_of, int32_t *micro_of) {
  MTRAIN_CHECK_NOT_NULL(weights);
  MTRAIN_CHECK_NOT_NULL(rank_of);
  MTRAIN_CHECK_NOT_NULL(micro_of);
  if (n < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance assign: %d sequences: the batch must hold at least one", n);
  if (ranks < 1 || micro_batches < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance assign: ranks %d and micro_batches %d must be >= 1", ranks,
                        micro_batches);
  if (method != MTRAIN_BATCH_COST && method != MTRAIN_BATCH_TOKENS && method != MTRAIN_BATCH_SORTED)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance assign: method %d is not cost (0), tokens (1) or sorted (2)",
                        (int)method);
  for (int32_t i = 0; i < n; i++)
    if (!(weights[i] >= 0) || weights[i] > 1e300)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance assign: weights[%d] = %g must be finite and >= 0", i,
                          weights[i]);
  const int32_t bins = ranks > micro_batches ? ranks : micro_batches;
  keyed_t *order = malloc((size_t)n * sizeof *order);
  double *load = malloc((size_t)bins * sizeof *load);
  int32_t *idx = malloc((size_t)n * sizeof *idx);
  int32_t *rk = malloc((size_t)n * sizeof *rk), *mb = malloc((size_t)n * sizeof *mb);
  if (!order || !load || !idx || !rk || !mb) {
    free(order);
    free(load);
    free(idx);
    free(rk);
    free(mb);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "balance assign: out of memory");
  }
  for (int32_t i = 0; i < n; i++) idx[i] = i;
  if (method == MTRAIN_BATCH_SORTED) {
    /* ascending length, cut where the running total passes r/R of the tokens */
    for (int32_t i = 0; i < n; i++) {
      order[i].w = weights[i];
      order[i].i = i;
    }
    qsort(order, (size_t)n, sizeof *order, by_weight_asc);
    double total = 0, run = 0;
    for (int32_t i = 0; i < n; i++) total += weights[i];
    for (int32_t j = 0; j < n; j++) {
      int32_t r = total > 0 ? (int32_t)((run + 0.5 * order[j].w) * ranks / total) : j % ranks;
      if (r >= ranks) r = ranks - 1;
      rk[order[j].i] = r;
      run += order[j].w;
    }
  } else {
    lpt(weights, idx, n, ranks, order, load, rk);
    improve(weights, n, ranks, rk, load);
  }
  /* micro-batches: LPT within each rank */
  for (int32_t r = 0; r < ranks; r++) {
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++)
      if (rk[i] == r) idx[m++] = i;
    if (m) lpt(weights, idx, m, micro_batches, order, load, mb);
  }
  memcpy(rank_of, rk, (size_t)n * sizeof *rk);
  memcpy(micro_of, mb, (size_t)n * sizeof *mb);
  free(order);
  free(load);
  free(idx);
  free(rk);
  free(mb);
  return MTRAIN_SUCCESS;
}
