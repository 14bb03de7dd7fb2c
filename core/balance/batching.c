/* batching.c: SparseBalance's coarse balance (docs/BALANCE.md,
 * "SparseBalance"): dealing the sequences of a global batch to ranks and
 * micro-batches. The solver is longest-processing-time first (Graham 1969:
 * makespan at most 4/3 - 1/(3R) times the optimum) followed by a local
 * search of moves and swaps off the busiest rank, each of which lowers both
 * ranks it touches below the busiest load (so the sum of squared loads falls
 * strictly and the search ends). Length-sorted batching, the third method, is
 * the baseline that groups similar lengths. Optionally the largest documents
 * are split over several ranks (a context-parallel ring each), placed first
 * as gangs on the ranks free first, the whole documents then dealt on top
 * (mtrain_balance_assign_split). Deterministic: ties go to the lower index. */
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

/* LPT of the items idx[0..m) (weights w) onto `bins` bins: bin_of[idx[j]].
 * The bins start at base[b] (NULL: 0). */
static void lpt(const double *w, const int32_t *idx, int32_t m, int32_t bins, keyed_t *order,
                double *load, int32_t *bin_of, const double *base) {
  for (int32_t j = 0; j < m; j++) {
    order[j].w = w[idx[j]];
    order[j].i = idx[j];
  }
  qsort(order, (size_t)m, sizeof *order, by_weight_desc);
  for (int32_t b = 0; b < bins; b++) load[b] = base ? base[b] : 0;
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
 * checks against that scan), through per-rank lists sorted by weight. A
 * rank's load is base[r] (NULL: 0; the split phase) plus its items. */
static mtrain_status_t improve(const double *w, int32_t n, int32_t R, int32_t *rank_of,
                               double *load, const double *base) {
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
    if (base) {
      load[top] += base[top];
      load[br] += base[br];
    }
  }
  free(sorted);
  free(scratch);
  lists_free(lists, R);
  return ok ? MTRAIN_SUCCESS
            : mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "balance assign: out of memory");
}

static mtrain_status_t check_assign(const double *weights, int32_t n, int32_t ranks,
                                    int32_t micro_batches, mtrain_batch_method_t method) {
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
  return MTRAIN_SUCCESS;
}

/* The solver on checked inputs, each rank starting at base[r] (NULL: 0;
 * not with MTRAIN_BATCH_SORTED). */
static mtrain_status_t assign_core(const double *weights, int32_t n, int32_t ranks,
                                   int32_t micro_batches, mtrain_batch_method_t method,
                                   const double *base, int32_t *rank_of, int32_t *micro_of) {
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
    lpt(weights, idx, n, ranks, order, load, rk, base);
    const mtrain_status_t st = improve(weights, n, ranks, rk, load, base);
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
    if (m) lpt(weights, idx, m, micro_batches, order, load, mb, NULL);
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

mtrain_status_t mtrain_balance_assign(const double *weights, int32_t n, int32_t ranks,
                                      int32_t micro_batches, mtrain_batch_method_t method,
                                      int32_t *rank_of, int32_t *micro_of) {
  MTRAIN_CHECK_NOT_NULL(weights);
  MTRAIN_CHECK_NOT_NULL(rank_of);
  MTRAIN_CHECK_NOT_NULL(micro_of);
  const mtrain_status_t st = check_assign(weights, n, ranks, micro_batches, method);
  if (st != MTRAIN_SUCCESS) return st;
  return assign_core(weights, n, ranks, micro_batches, method, NULL, rank_of, micro_of);
}

/* ---- splitting the largest documents over several ranks ------------------------------------ */

void mtrain_balance_split_free(mtrain_balance_split_t *r) {
  if (!r) return;
  free(r->rank_of);
  free(r->num_ranks);
  free(r->offset);
  free(r->group);
  free(r->micro_of);
  free(r->split_order);
  free(r->share);
  free(r->start);
  free(r->rank_load);
  free(r->rank_idle);
  memset(r, 0, sizeof *r);
}

static mtrain_status_t check_split(const double *w, const double *ring, const double *fixed,
                                   int32_t n, int32_t ranks, mtrain_batch_method_t method,
                                   const mtrain_balance_split_options_t *sp) {
  if (!sp) return MTRAIN_SUCCESS;
  if (!(sp->split_above >= 0) || sp->split_above > 1e300)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance split: split_above %g must be finite and >= 0 (0: no splitting)",
                        sp->split_above);
  if (!(sp->ring_overhead >= 1) || sp->ring_overhead > 1e300)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance split: ring_overhead %g must be finite and >= 1",
                        sp->ring_overhead);
  if (sp->max_ranks < 0 || sp->max_ranks > ranks)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance split: max_ranks %d must be in [0, ranks %d] (0: ranks)",
                        sp->max_ranks, ranks);
  if (sp->split_above > 0 && method == MTRAIN_BATCH_SORTED)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance split: splitting needs the cost (0) or tokens (1) method, not "
                        "sorted (2)");
  for (int32_t i = 0; i < n; i++) {
    const double r = ring ? ring[i] : 0, f = fixed ? fixed[i] : 0;
    if (!(r >= 0) || !(f >= 0) || r > 1e300 || f > 1e300)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance split: ring_part[%d] = %g and fixed_part[%d] = %g must be "
                          "finite and >= 0",
                          i, r, i, f);
    if (r + f > w[i] * (1 + 1e-9))
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance split: ring_part[%d] + fixed_part[%d] = %g exceeds weights[%d] "
                          "= %g",
                          i, i, r + f, i, w[i]);
  }
  return MTRAIN_SUCCESS;
}

/* The load of one rank of a document split over k ranks. */
static double split_share(const double *w, const double *ring, const double *fixed, double ovh,
                          int32_t i, int32_t k) {
  const double r = ring ? ring[i] : w[i], f = fixed ? fixed[i] : 0;
  if (k == 1) return w[i];
  return f + (w[i] - f + (ovh - 1) * r) / k;
}

mtrain_status_t mtrain_balance_assign_split(const double *weights, const double *ring_part,
                                            const double *fixed_part, int32_t n, int32_t ranks,
                                            int32_t micro_batches, mtrain_batch_method_t method,
                                            const mtrain_balance_split_options_t *split,
                                            mtrain_balance_split_t *out) {
  MTRAIN_CHECK_NOT_NULL(out);
  memset(out, 0, sizeof *out);
  MTRAIN_CHECK_NOT_NULL(weights);
  mtrain_status_t st = check_assign(weights, n, ranks, micro_batches, method);
  if (st == MTRAIN_SUCCESS)
    st = check_split(weights, ring_part, fixed_part, n, ranks, method, split);
  if (st != MTRAIN_SUCCESS) return st;
  const double ovh = split ? split->ring_overhead : 1.0;
  const int32_t kmax = split && split->max_ranks > 0 ? split->max_ranks : ranks;
  const int on = split && split->split_above > 0 && kmax >= 2;
  double total = 0;
  for (int32_t i = 0; i < n; i++) total += weights[i];
  const double T = on ? split->split_above * total / ranks : 0;
  int32_t *k = malloc((size_t)n * sizeof *k);
  keyed_t *order = malloc((size_t)n * sizeof *order);
  keyed_t *byready = malloc((size_t)ranks * sizeof *byready);
  double *ready = calloc((size_t)ranks, sizeof *ready), *idle = calloc((size_t)ranks, sizeof *idle);
  double *wc = malloc((size_t)n * sizeof *wc);
  int32_t *rkc = malloc((size_t)n * sizeof *rkc), *mbc = malloc((size_t)n * sizeof *mbc);
  int32_t *whole = malloc((size_t)n * sizeof *whole);
  MTRAIN_FAIL_IF(!k || !order || !byready || !ready || !idle || !wc || !rkc || !mbc || !whole,
                 MTRAIN_ERR_OUT_OF_MEMORY, "balance split: out of memory");
  /* 1. how many ranks each document spans */
  int32_t ns = 0;
  int64_t group_len = 0;
  for (int32_t i = 0; i < n; i++) {
    k[i] = 1;
    if (on && weights[i] > T) {
      k[i] = 2;
      while (k[i] < kmax && split_share(weights, ring_part, fixed_part, ovh, i, k[i]) > T) k[i]++;
      ns++;
    }
    group_len += k[i];
  }
  out->n = n;
  out->ranks = ranks;
  out->num_split = ns;
  out->rank_of = malloc((size_t)n * sizeof *out->rank_of);
  out->num_ranks = malloc((size_t)n * sizeof *out->num_ranks);
  out->offset = malloc((size_t)(n + 1) * sizeof *out->offset);
  out->group = malloc((size_t)group_len * sizeof *out->group);
  out->micro_of = malloc((size_t)n * sizeof *out->micro_of);
  out->split_order = malloc((size_t)(ns ? ns : 1) * sizeof *out->split_order);
  out->share = malloc((size_t)n * sizeof *out->share);
  out->start = malloc((size_t)n * sizeof *out->start);
  out->rank_load = malloc((size_t)ranks * sizeof *out->rank_load);
  out->rank_idle = malloc((size_t)ranks * sizeof *out->rank_idle);
  MTRAIN_FAIL_IF(!out->rank_of || !out->num_ranks || !out->offset || !out->group ||
                     !out->micro_of || !out->split_order || !out->share || !out->start ||
                     !out->rank_load || !out->rank_idle,
                 MTRAIN_ERR_OUT_OF_MEMORY, "balance split: out of memory");
  out->offset[0] = 0;
  for (int32_t i = 0; i < n; i++) {
    out->num_ranks[i] = k[i];
    out->offset[i + 1] = out->offset[i] + k[i];
    out->share[i] = split_share(weights, ring_part, fixed_part, ovh, i, k[i]);
    out->start[i] = -1;
  }
  /* 2. the split phase: largest first, each on the k ranks free first */
  int32_t m = 0;
  for (int32_t i = 0; i < n; i++)
    if (k[i] > 1) {
      order[m].w = weights[i];
      order[m].i = i;
      m++;
    }
  qsort(order, (size_t)m, sizeof *order, by_weight_desc);
  for (int32_t j = 0; j < m; j++) {
    const int32_t i = order[j].i;
    out->split_order[j] = i;
    for (int32_t r = 0; r < ranks; r++) {
      byready[r].w = ready[r];
      byready[r].i = r;
    }
    qsort(byready, (size_t)ranks, sizeof *byready, by_weight_asc);
    const double start = byready[k[i] - 1].w; /* the last of the k to be free */
    int32_t *g = out->group + out->offset[i];
    for (int32_t q = 0; q < k[i]; q++) {
      const int32_t r = byready[q].i;
      idle[r] += start - ready[r];
      ready[r] = start + out->share[i];
      g[q] = r;
    }
    qsort(g, (size_t)k[i], sizeof *g, by_index);
    out->rank_of[i] = g[0];
    out->micro_of[i] = -1;
    out->start[i] = start;
  }
  /* 3. the whole documents on top of the split phase */
  m = 0;
  for (int32_t i = 0; i < n; i++)
    if (k[i] == 1) {
      whole[m] = i;
      wc[m++] = weights[i];
    }
  if (m > 0)
    MTRAIN_TRY(assign_core(wc, m, ranks, micro_batches, method, ns ? ready : NULL, rkc, mbc));
  for (int32_t j = 0; j < m; j++) {
    const int32_t i = whole[j];
    out->rank_of[i] = rkc[j];
    out->group[out->offset[i]] = rkc[j];
    out->micro_of[i] = mbc[j];
  }
  for (int32_t r = 0; r < ranks; r++) {
    out->rank_load[r] = ready[r];
    out->rank_idle[r] = idle[r];
  }
  for (int32_t j = 0; j < m; j++) out->rank_load[rkc[j]] += wc[j];
cleanup:
  free(k);
  free(order);
  free(byready);
  free(ready);
  free(idle);
  free(wc);
  free(rkc);
  free(mbc);
  free(whole);
  if (st != MTRAIN_SUCCESS) mtrain_balance_split_free(out);
  return st;
}
