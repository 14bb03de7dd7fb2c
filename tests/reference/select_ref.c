/* select_ref.c: the reference copy of core/runtime/select.c as of commit 906fdc4 (before
 * the host speed-ups of issue 20), its external names prefixed ref_: the
 * optimised builders are tested against it bitwise (test_plan_fast.c). Not
 * part of the library; do not change it except to follow an API rename. */
#include <math.h>
#include <stdlib.h>

#include "reference.h"

/* qsort has no context argument: the comparison reads these (thread-local,
 * so selections on several threads do not interfere). Only the best k (top-k)
 * or cap (top-p) candidates are sorted, after a quickselect. */
static _Thread_local const double *sort_scores;
static _Thread_local const uint8_t *sort_forced;

/* Descending score (+inf for forced, NaN lowest), then ascending index. */
static int by_score_desc(const void *pa, const void *pb) {
  const int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
  double x = sort_forced && sort_forced[a] ? INFINITY : sort_scores[a];
  double y = sort_forced && sort_forced[b] ? INFINITY : sort_scores[b];
  if (isnan(x)) x = -INFINITY;
  if (isnan(y)) y = -INFINITY;
  if (x != y) return x > y ? -1 : 1;
  return (a > b) - (a < b);
}

static int by_index(const void *pa, const void *pb) {
  const int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
  return (a > b) - (a < b);
}

static void swap(int64_t *a, int64_t *b) {
  const int64_t t = *a;
  *a = *b;
  *b = t;
}

/* Moves the k best candidates (in the order of by_score_desc, a strict total
 * order, so the set is unique) to order[0..k), in no particular order:
 * quickselect with a median-of-three pivot. */
static void select_best(int64_t *order, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi && k > lo && k <= hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (by_score_desc(&order[mid], &order[lo]) < 0) swap(&order[mid], &order[lo]);
    if (by_score_desc(&order[hi], &order[lo]) < 0) swap(&order[hi], &order[lo]);
    if (by_score_desc(&order[hi], &order[mid]) < 0) swap(&order[hi], &order[mid]);
    const int64_t pivot = order[mid];
    int64_t i = lo, j = hi;
    while (i <= j) {
      while (by_score_desc(&order[i], &pivot) < 0) i++;
      while (by_score_desc(&pivot, &order[j]) < 0) j--;
      if (i <= j) swap(&order[i++], &order[j--]);
    }
    if (k <= j) /* the boundary lies in the left part */
      hi = j;
    else if (k >= i)
      lo = i;
    else
      break; /* order[j+1 .. i-1] equal the pivot: the boundary is settled */
  }
}

/* order[0..m) = the m best candidates, best first (m = min(m, n)). */
static void rank(const double *scores, const uint8_t *forced, int64_t n, int64_t m,
                 int64_t *order) {
  for (int64_t i = 0; i < n; i++) order[i] = i;
  sort_scores = scores;
  sort_forced = forced;
  if (m < n) select_best(order, n, m);
  qsort(order, (size_t)(m < n ? m : n), sizeof *order, by_score_desc);
  sort_scores = NULL;
  sort_forced = NULL;
}

static int64_t keep_first(const int64_t *order, int64_t count, int64_t *out) {
  for (int64_t i = 0; i < count; i++) out[i] = order[i];
  qsort(out, (size_t)count, sizeof *out, by_index);
  return count;
}

int64_t ref_select_top_k(const double *scores, const uint8_t *forced, int64_t n, int64_t k,
                         int64_t *order, int64_t *out) {
  if (k > n) k = n; /* budgets larger than the candidates are clamped */
  if (k <= 0 || n <= 0) return 0;
  rank(scores, forced, n, k, order);
  return keep_first(order, k, out);
}

int64_t ref_select_top_p(const double *scores, int64_t n, double p, int64_t cap, int64_t *order,
                         int64_t *out) {
  if (n <= 0 || cap <= 0) return 0;
  rank(scores, NULL, n, cap < n ? cap : n, order);
  double sum = 0.0;
  int64_t count = 0;
  while (count < n && count < cap) {
    const double next = sum + scores[order[count]];
    if (!(next < p)) break;
    sum = next;
    count++;
  }
  return keep_first(order, count, out);
}

int32_t ref_token_to_block_diagonals(const int64_t *tokens, int64_t n, int32_t granularity,
                                     int64_t num_blocks, int32_t *out) {
  /* mark then collect: block diagonals are < num_blocks */
  int32_t count = 0;
  out[count++] = 0;
  int64_t last = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t a = tokens[i] / granularity, b = tokens[i] % granularity;
    const int64_t cand[2] = {a, b > 0 ? a + 1 : -1};
    for (int c = 0; c < 2; c++) {
      if (cand[c] <= last || cand[c] >= num_blocks) continue; /* tokens are increasing */
      out[count++] = (int32_t)cand[c];
      last = cand[c];
    }
  }
  return count;
}
