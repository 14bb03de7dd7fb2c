/* block_select.c: the selection rules of block-sparse selection (SPEC.md
 * section 9): top-k or top-p per query block row with forced sink and local
 * blocks (each row on its own, its candidates ranked only as far as the
 * budget reaches: a quickselect, then a sort of that prefix), and the
 * head-adaptive top-k budgets, whose gain curves are exact sums
 * (exact_sum.h) so that they come out the same whichever rank holds which
 * rows. The method names. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/block_select.h"
#include "core/runtime/exact_sum.h"
#include "mtrain/mtrain_error.h"

const char *mtrain_block_method_name(mtrain_block_method_t method) {
  switch (method) {
  case MTRAIN_BLOCK_PRECISE:
    return "precise";
  case MTRAIN_BLOCK_ANTIDIAG:
    return "antidiag";
  case MTRAIN_BLOCK_MEANPOOL:
    return "meanpool";
  }
  return "unknown";
}

mtrain_status_t mtrain_block_method_parse(const char *name, mtrain_block_method_t *out) {
  MTRAIN_CHECK_NOT_NULL(name);
  MTRAIN_CHECK_NOT_NULL(out);
  for (int m = MTRAIN_BLOCK_PRECISE; m <= MTRAIN_BLOCK_MEANPOOL; m++)
    if (strcmp(name, mtrain_block_method_name((mtrain_block_method_t)m)) == 0) {
      *out = (mtrain_block_method_t)m;
      return MTRAIN_SUCCESS;
    }
  return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                      "block method '%s' is not one of precise, antidiag, meanpool", name);
}

/* ---- the selection of one row ------------------------------------------------------ */

/* qsort has no context argument: the comparison reads this row (thread-local). */
static _Thread_local const double *rank_row;

/* Descending score, NaN last, then ascending key block. */
static int by_rank(const void *pa, const void *pb) {
  const int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
  double x = rank_row[a], y = rank_row[b];
  if (isnan(x)) x = -INFINITY;
  if (isnan(y)) y = -INFINITY;
  if (x != y) return x > y ? -1 : 1;
  return (a > b) - (a < b);
}

/* F(qb) of SPEC.md 9.4 and 9.7: the diagonal block, the sink blocks and the
 * local ones, (qb - local, qb] causally and |kb - qb| < local non-causally
 * (the same test, since a causal row has no kb > qb). */
static inline int is_forced(const mtrain_block_options_t *o, int64_t qb, int64_t kb) {
  return kb == qb || kb < o->sink_blocks ||
         (kb > qb - o->local_blocks && kb < qb + o->local_blocks);
}

/* Orders idx[0 .. n) so that its first m entries are the m best by rank
 * (rank_row set), sorted, and every later entry ranks below them: a
 * quickselect (the rank order is total: no two entries are equal), then a
 * sort of the first m. */
static void rank_top(int64_t *idx, int64_t n, int64_t m) {
  if (m <= 0) return;
  if (m < n) {
    int64_t lo = 0, hi = n - 1;
    const int64_t k = m - 1;
    while (lo < hi) {
      const int64_t pivot = idx[lo + (hi - lo) / 2];
      int64_t i = lo, j = hi;
      while (i <= j) {
        while (by_rank(&idx[i], &pivot) < 0) i++;
        while (by_rank(&idx[j], &pivot) > 0) j--;
        if (i <= j) {
          const int64_t t = idx[i];
          idx[i++] = idx[j];
          idx[j--] = t;
        }
      }
      if (k <= j)
        hi = j;
      else if (k >= i)
        lo = i;
      else
        break;
    }
  }
  qsort(idx, (size_t)(m < n ? m : n), sizeof *idx, by_rank);
}

/* The candidates of row qb (not forced), the first min(m, count) of them in
 * rank order and the rest ranking below; returns their count. */
static int64_t rank_candidates(const double *w, int64_t qb, int64_t len,
                               const mtrain_block_options_t *o, int64_t *idx, int64_t m) {
  int64_t n = 0;
  for (int64_t kb = 0; kb < len; kb++)
    if (!is_forced(o, qb, kb)) idx[n++] = kb;
  rank_row = w;
  rank_top(idx, n, m);
  rank_row = NULL;
  return n;
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

int64_t mtrain_block_candidates(int64_t qb, int64_t len, const mtrain_block_options_t *o) {
  /* forced: the sinks [0, s1) and the local run [l0, l1) around qb (which holds qb) */
  const int64_t lw = max64(o->local_blocks, 1);
  const int64_t s1 = min64(o->sink_blocks, len);
  const int64_t l0 = max64(qb - lw + 1, 0), l1 = min64(qb + lw, len);
  const int64_t both = max64(0, min64(s1, l1) - l0);
  return len - (s1 + (l1 - l0) - both);
}

int64_t mtrain_block_most_candidates(int64_t nb, const mtrain_block_options_t *o) {
  if (nb <= 0) return 0;
  if (!o->noncausal) return mtrain_block_candidates(nb - 1, nb, o); /* grows with qb */
  int64_t most = 0;
  for (int64_t qb = 0; qb < nb; qb++) most = max64(most, mtrain_block_candidates(qb, nb, o));
  return most;
}

int64_t mtrain_block_select_row(const double *row, int64_t qb, int64_t len,
                                const mtrain_block_options_t *o, int32_t top_k, int32_t *idx,
                                int64_t *scratch_idx, uint8_t *scratch_keep, double *kept_out,
                                double *total_out) {
  double total = 0.0, kept = 0.0;
  for (int64_t kb = 0; kb < len; kb++) total += row[kb];
  for (int64_t kb = 0; kb < len; kb++) {
    scratch_keep[kb] = (uint8_t)is_forced(o, qb, kb);
    if (scratch_keep[kb]) kept += row[kb];
  }
  if (o->kind == MTRAIN_BUDGET_TOP_K) {
    const int64_t n = rank_candidates(row, qb, len, o, scratch_idx, top_k);
    const int64_t take = top_k < n ? top_k : n;
    for (int64_t u = 0; u < take; u++) {
      scratch_keep[scratch_idx[u]] = 1;
      kept += row[scratch_idx[u]];
    }
  } else {
    /* the ranking is built as far as the walk goes: 16 first, 4 times more each time */
    int64_t ranked = 16;
    const int64_t n = rank_candidates(row, qb, len, o, scratch_idx, ranked);
    const double target = o->top_p * total;
    for (int64_t u = 0; u < n && kept < target; u++) {
      if (u == ranked) {
        rank_row = row;
        rank_top(scratch_idx + ranked, n - ranked, 3 * ranked);
        rank_row = NULL;
        ranked *= 4;
      }
      scratch_keep[scratch_idx[u]] = 1;
      kept += row[scratch_idx[u]];
    }
  }
  int64_t count = 0;
  for (int64_t kb = 0; kb < len; kb++)
    if (scratch_keep[kb]) idx[count++] = (int32_t)kb;
  *kept_out = kept;
  *total_out = total;
  return count;
}

void mtrain_block_select_head(const double *w, int64_t nb, const mtrain_block_options_t *o,
                              int32_t top_k, int64_t *mask_off, int32_t *mask_idx,
                              int64_t *scratch_idx, uint8_t *scratch_keep,
                              mtrain_block_head_result_t *result) {
  double kept_all = 0.0, total_all = 0.0;
  int64_t count = 0;
  mask_off[0] = 0;
  for (int64_t qb = 0; qb < nb; qb++) {
    double kept = 0.0, total = 0.0;
    count += mtrain_block_select_row(w + mtrain_block_row_at(qb, nb, o), qb,
                                     mtrain_block_row_len(qb, nb, o), o, top_k, mask_idx + count,
                                     scratch_idx, scratch_keep, &kept, &total);
    mask_off[qb + 1] = count;
    kept_all += kept;
    total_all += total;
  }
  result->kept = kept_all;
  result->total = total_all;
  result->blocks = count;
}

/* ---- head-adaptive budgets ------------------------------------------------------------ */

int64_t mtrain_block_gain_cap(int64_t nb, int32_t Hq, const mtrain_block_options_t *o) {
  const int64_t most = mtrain_block_most_candidates(nb, o);
  const int64_t units = (int64_t)Hq * o->top_k;
  return units < most ? units : most;
}

mtrain_status_t mtrain_block_gain_words(const double *scores, int64_t head_stride,
                                        const int64_t *row_off, const int64_t *row_qb, int64_t rows,
                                        int64_t nb, int32_t Hq, const mtrain_block_options_t *o,
                                        int64_t cap, int threads, double *words) {
  const int64_t per_head = (cap + 1) * MTRAIN_XSUM_WORDS;
  int64_t most = 0;
  for (int64_t r = 0; r < rows; r++) most = max64(most, mtrain_block_row_len(row_qb[r], nb, o));
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(most + 1));
    mtrain_xsum_t *acc = malloc(sizeof(mtrain_xsum_t) * (size_t)(cap + 1));
    failed |= !idx || !acc;
#pragma omp for schedule(dynamic, 1)
    for (int32_t h = 0; h < Hq; h++) {
      if (!idx || !acc) continue;
      memset(acc, 0, sizeof(mtrain_xsum_t) * (size_t)(cap + 1));
      for (int64_t r = 0; r < rows; r++) {
        const double *row = scores + (int64_t)h * head_stride + row_off[r];
        const int64_t qb = row_qb[r], len = mtrain_block_row_len(qb, nb, o);
        double total = 0.0;
        for (int64_t kb = 0; kb < len; kb++) total += row[kb];
        mtrain_xsum_add(&acc[0], total);
        const int64_t n = rank_candidates(row, qb, len, o, idx, cap);
        for (int64_t u = 0; u < n && u < cap; u++) mtrain_xsum_add(&acc[1 + u], row[idx[u]]);
      }
      for (int64_t u = 0; u <= cap; u++)
        mtrain_xsum_export(&acc[u], words + h * per_head + u * MTRAIN_XSUM_WORDS);
    }
    free(idx);
    free(acc);
  }
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory")
                : MTRAIN_SUCCESS;
}

void mtrain_block_budgets_from_words(const double *words, int32_t Hq, int64_t nb,
                                     const mtrain_block_options_t *o, int64_t cap, int32_t *top_k) {
  const int64_t per_head = (cap + 1) * MTRAIN_XSUM_WORDS;
  const int64_t most = mtrain_block_most_candidates(nb, o);
  for (int32_t h = 0; h < Hq; h++) top_k[h] = 0;
  /* greedy: each unit to the head whose next block adds the most recall */
  const int64_t units = (int64_t)Hq * o->top_k;
  for (int64_t u = 0; u < units; u++) {
    int32_t best = -1;
    double best_gain = 0.0;
    for (int32_t h = 0; h < Hq; h++) {
      if (top_k[h] >= most || top_k[h] >= cap) continue;
      const double *w = words + h * per_head;
      const double total = mtrain_xsum_value(w);
      double v = mtrain_xsum_value(w + (1 + (int64_t)top_k[h]) * MTRAIN_XSUM_WORDS);
      v = total > 0.0 ? v / total : 0.0;
      if (isnan(v)) v = -INFINITY;
      if (best < 0 || v > best_gain) {
        best = h;
        best_gain = v;
      }
    }
    if (best < 0) break; /* every head keeps every candidate */
    top_k[best]++;
  }
}

mtrain_status_t mtrain_block_adaptive_budgets(const double *scores, int32_t Hq, int64_t nb,
                                              const mtrain_block_options_t *o, int threads,
                                              int32_t *top_k) {
  const int64_t cap = mtrain_block_gain_cap(nb, Hq, o);
  int64_t *row_off = malloc(sizeof(int64_t) * (size_t)(nb + 1));
  int64_t *row_qb = malloc(sizeof(int64_t) * (size_t)(nb + 1));
  double *words = malloc(sizeof(double) * (size_t)Hq * (size_t)(cap + 1) * MTRAIN_XSUM_WORDS);
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (!row_off || !row_qb || !words) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory");
  } else {
    for (int64_t qb = 0; qb < nb; qb++)
      row_off[qb] = mtrain_block_row_at(qb, nb, o), row_qb[qb] = qb;
    st = mtrain_block_gain_words(scores, mtrain_block_head_entries(nb, o), row_off, row_qb, nb, nb,
                                 Hq, o, cap, threads, words);
    if (!st) mtrain_block_budgets_from_words(words, Hq, nb, o, cap, top_k);
  }
  free(row_off);
  free(row_qb);
  free(words);
  return st;
}
