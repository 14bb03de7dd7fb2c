/* select.c: top-k and top-p selection with the tie-breaking of SPEC.md
 * section 2, and the token-diagonal to block-diagonal conversion. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/select.h"

/* qsort has no context argument: the comparison reads these (thread-local,
 * so selections on several threads do not interfere). Top-k sorts nothing
 * but its result by index: the k best are found by a selection on integer
 * keys (best_set). Top-p ranks only as far as its mass reaches, a chunk at a
 * time. */
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

/* The ranking key of candidate i as an int64 whose order is the order of
 * by_score_desc's scores: forced +inf, NaN -inf, -0 as +0 (equal scores tie
 * and break by index, as there), then the IEEE bits made monotone. */
static inline int64_t key_of(const double *scores, const uint8_t *forced, int64_t i) {
  double x = forced && forced[i] ? INFINITY : scores[i];
  if (isnan(x)) x = -INFINITY;
  if (x == 0.0) x = 0.0;
  int64_t b;
  memcpy(&b, &x, sizeof b);
  return b < 0 ? b ^ INT64_MAX : b;
}

/* The value of rank k (0-based, ascending) of a[0..n): quickselect with a
 * median-of-three pivot (a is reordered). */
static int64_t kth_smallest(int64_t *a, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] < a[lo]) swap(&a[mid], &a[lo]);
    if (a[hi] < a[lo]) swap(&a[hi], &a[lo]);
    if (a[hi] < a[mid]) swap(&a[hi], &a[mid]);
    const int64_t pivot = a[mid];
    int64_t i = lo, j = hi;
    while (i <= j) {
      while (a[i] < pivot) i++;
      while (pivot < a[j]) j--;
      if (i <= j) swap(&a[i++], &a[j--]);
    }
    if (k <= j)
      hi = j;
    else if (k >= i)
      lo = i;
    else
      return a[k]; /* a[j+1 .. i-1] equal the pivot */
  }
  return a[k];
}

/* order[0..m) = the m best candidates (0 < m <= n) in increasing index
 * order: those whose key exceeds the m-th largest key T, and of those equal
 * to T the lowest indices (the ties of by_score_desc). No comparison sort:
 * one selection on the keys and two scans. */
static void best_set(const double *scores, const uint8_t *forced, int64_t n, int64_t m,
                     int64_t *order) {
  for (int64_t i = 0; i < n; i++) order[i] = key_of(scores, forced, i);
  const int64_t T = kth_smallest(order, n, n - m);
  int64_t above = 0;
  for (int64_t i = 0; i < n; i++) above += key_of(scores, forced, i) > T;
  int64_t ties = m - above, c = 0;
  for (int64_t i = 0; i < n && c < m; i++) {
    const int64_t key = key_of(scores, forced, i);
    if (key > T || (key == T && ties-- > 0)) order[c++] = i;
  }
}

static int64_t keep_first(const int64_t *order, int64_t count, int64_t *out) {
  for (int64_t i = 0; i < count; i++) out[i] = order[i];
  qsort(out, (size_t)count, sizeof *out, by_index);
  return count;
}

int64_t mtrain_select_top_k(const double *scores, const uint8_t *forced, int64_t n, int64_t k,
                            int64_t *order, int64_t *out) {
  if (k > n) k = n; /* budgets larger than the candidates are clamped */
  if (k <= 0 || n <= 0) return 0;
  best_set(scores, forced, n, k, order); /* already in index order */
  for (int64_t i = 0; i < k; i++) out[i] = order[i];
  return k;
}

int64_t mtrain_select_top_p(const double *scores, const uint8_t *forced, int64_t n, double p,
                            int64_t cap, int64_t *order, int64_t *out) {
  if (n <= 0 || cap <= 0) return 0;
  const int64_t m = cap < n ? cap : n;
  best_set(scores, forced, n, m, order);
  /* rank order is needed only as far as the mass goes: sort the best chunk
   * of what is left, add it up, and go on with a twice larger chunk. Forced
   * candidates rank first: they are kept whatever the sum, which they join */
  sort_scores = scores;
  sort_forced = forced;
  double sum = 0.0;
  int64_t count = 0, chunk = 256;
  int stop = 0;
  for (int64_t lo = 0; lo < m && !stop; lo += chunk, chunk *= 2) {
    const int64_t c = chunk < m - lo ? chunk : m - lo;
    if (c < m - lo) select_best(order + lo, m - lo, c);
    qsort(order + lo, (size_t)c, sizeof *order, by_score_desc);
    for (int64_t i = lo; i < lo + c; i++) {
      const double next = sum + scores[order[i]];
      if (!(next < p) && !(forced && forced[order[i]])) {
        stop = 1;
        break;
      }
      sum = next;
      count++;
    }
  }
  sort_scores = NULL;
  sort_forced = NULL;
  return keep_first(order, count, out);
}

int32_t mtrain_token_to_block_diagonals(const int64_t *tokens, int64_t n, int32_t granularity,
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
