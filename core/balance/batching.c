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

/* A candidate of the local search: the larger of the two new loads (m) and
 * its place in the search order of the first solver (item i ascending; for
 * each i its moves, by rank, before its swaps, by partner j), so that equal
 * loads resolve exactly as that scan did. kind 0: move i to rank x; kind 1:
 * swap i with item x. */
typedef struct candidate {
  double m;
  int32_t i, kind, x, r;
} candidate_t;

static int better(const candidate_t *c, const candidate_t *best) {
  if (c->m != best->m) return c->m < best->m;
  if (c->i != best->i) return c->i < best->i;
  if (c->kind != best->kind) return c->kind < best->kind;
  return c->x < best->x;
}

/* The items of one rank sorted by (weight, index), kept up to date as items
 * move, so that a round costs what the busiest rank's items and the ranks
 * cost, not a pass over every item. */
typedef struct rank_list {
  int32_t *item;
  int32_t len, cap;
} rank_list_t;

static int before(const double *w, int32_t a, int32_t b) {
  return w[a] < w[b] || (w[a] == w[b] && a < b);
}

/* The position of the first item of l not before x. */
static int32_t list_find(const double *w, const rank_list_t *l, int32_t x) {
  int32_t a = 0, b = l->len;
  while (a < b) {
    const int32_t mid = a + (b - a) / 2;
    if (before(w, l->item[mid], x))
      a = mid + 1;
    else
      b = mid;
  }
  return a;
}

static int list_insert(const double *w, rank_list_t *l, int32_t x) {
  if (l->len == l->cap) {
    const int32_t cap = l->cap ? 2 * l->cap : 16;
    int32_t *grown = realloc(l->item, (size_t)cap * sizeof *grown);
    if (!grown) return 0;
    l->item = grown;
    l->cap = cap;
  }
  const int32_t p = list_find(w, l, x);
  memmove(l->item + p + 1, l->item + p, (size_t)(l->len - p) * sizeof *l->item);
  l->item[p] = x;
  l->len++;
  return 1;
}

static void list_remove(const double *w, rank_list_t *l, int32_t x) {
  const int32_t p = list_find(w, l, x);
  memmove(l->item + p, l->item + p + 1, (size_t)(l->len - p - 1) * sizeof *l->item);
  l->len--;
}

static int by_index(const void *a, const void *b) {
  const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* A rank's load summed in item order, as a pass over all items sums it (the
 * same floating-point result). */
static double list_load(const double *w, const rank_list_t *l, int32_t *scratch) {
  memcpy(scratch, l->item, (size_t)l->len * sizeof *scratch);
  qsort(scratch, (size_t)l->len, sizeof *scratch, by_index);
  double sum = 0;
  for (int32_t p = 0; p < l->len; p++) sum += w[scratch[p]];
  return sum;
}

/* The swaps of item i (on the busiest rank, load L) with the strictly
 * lighter items of rank r: m(j) = max((L - w_i) + w_j, (load_r + w_i) - w_j)
 * falls and then rises with w_j (a non-decreasing and a non-increasing term,
 * also in floating point), so the scan starts where the two terms cross and
 * walks outwards while a term alone stays within the best m so far. */
static void swaps_on_rank(const double *w, int32_t i, int32_t r, double L, const double *load,
                          const rank_list_t *l, candidate_t *best) {
  const int32_t *it = l->item;
  const double A = L - w[i], B = load[r] + w[i];
  int32_t a = 0, hi = l->len;
  while (a < hi) { /* the items lighter than w_i: [0, hi) */
    const int32_t mid = a + (hi - a) / 2;
    if (w[it[mid]] < w[i])
      a = mid + 1;
    else
      hi = mid;
  }
  int32_t b = hi;
  a = 0;
  while (a < b) { /* the first with A + w_j >= B - w_j */
    const int32_t mid = a + (b - a) / 2;
    if (A + w[it[mid]] < B - w[it[mid]])
      a = mid + 1;
    else
      b = mid;
  }
  for (int32_t p = a; p < hi; p++) { /* rising side: A + w_j dominates */
    const int32_t j = it[p];
    const double x = A + w[j], y = B - w[j];
    if (x > best->m) break;
    const candidate_t c = {x > y ? x : y, i, 1, j, r};
    if (better(&c, best)) *best = c;
  }
  for (int32_t p = a - 1; p >= 0; p--) { /* falling side: B - w_j dominates */
    const int32_t j = it[p];
    const double x = A + w[j], y = B - w[j];
    if (y > best->m) break;
    const candidate_t c = {x > y ? x : y, i, 1, j, r};
    if (better(&c, best)) *best = c;
  }
}

static void lists_free(rank_list_t *lists, int32_t R) {
  for (int32_t r = 0; lists && r < R; r++) free(lists[r].item);
  free(lists);
}

/* Moves and swaps off the busiest rank while one lowers both ranks below it:
 * each round takes the best candidate (the smallest larger load; ties as the
 * first solver's scan of every pair took them, which test_sparse_balance
 * checks against that scan), through per-rank lists sorted by weight. */
static mtrain_status_t improve(const double *w, int32_t n, int32_t R, int32_t *rank_of,
                               double *load) {
  keyed_t *sorted = malloc((size_t)n * sizeof *sorted);
  int32_t *scratch = malloc((size_t)n * sizeof *scratch);
  rank_list_t *lists = calloc((size_t)R, sizeof *lists);
  int ok = sorted && scratch && lists;
  if (ok) {
    for (int32_t i = 0; i < n; i++) {
      sorted[i].w = w[i];
      sorted[i].i = i;
    }
    qsort(sorted, (size_t)n, sizeof *sorted, by_weight_asc);
    for (int32_t j = 0; j < n && ok; j++)
      ok = list_insert(w, &lists[rank_of[sorted[j].i]], sorted[j].i);
  }
  const int64_t max_rounds = 64 * (int64_t)n;
  for (int64_t round = 0; ok && round < max_rounds; round++) {
    int32_t top = 0;
    for (int32_t r = 1; r < R; r++)
      if (load[r] > load[top]) top = r;
    const double L = load[top];
    candidate_t best = {L, -1, 0, -1, -1}; /* must fall below L */
    for (int32_t p = 0; p < lists[top].len; p++) {
      const int32_t i = lists[top].item[p];
      if (!(w[i] > 0)) continue;
      for (int32_t r = 0; r < R; r++) { /* move i to r */
        if (r == top) continue;
        const double a = L - w[i], b = load[r] + w[i];
        const candidate_t c = {a > b ? a : b, i, 0, r, r};
        if (better(&c, &best)) best = c;
      }
      for (int32_t r = 0; r < R; r++) /* swap i with a lighter j elsewhere */
        if (r != top) swaps_on_rank(w, i, r, L, load, &lists[r], &best);
    }
    if (best.i < 0) break;
    const int32_t br = best.r;
    list_remove(w, &lists[top], best.i);
    ok = list_insert(w, &lists[br], best.i);
    rank_of[best.i] = br;
    if (best.kind == 1 && ok) {
      list_remove(w, &lists[br], best.x);
      ok = list_insert(w, &lists[top], best.x);
      rank_of[best.x] = top;
    }
    /* the two loads again from their items (no drift from repeated +/-) */
    load[top] = list_load(w, &lists[top], scratch);
    load[br] = list_load(w, &lists[br], scratch);
  }
  free(sorted);
  free(scratch);
  lists_free(lists, R);
  return ok ? MTRAIN_SUCCESS
            : mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "balance assign: out of memory");
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
    const mtrain_status_t st = improve(weights, n, ranks, rk, load);
    if (st) {
      free(order);
      free(load);
      free(idx);
      free(rk);
      free(mb);
      return st;
    }
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
