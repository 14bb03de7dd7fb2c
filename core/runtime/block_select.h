/* block_select.h (private): the selection half of block-sparse selection
 * (SPEC.md section 9): from the block scores of query block rows to their
 * selected key blocks, and the head-adaptive budgets. Pure host logic
 * (block_select.c), shared by every backend and exposed here for the
 * white-box tests; the entry points that score are in block_entry.c, the
 * per-rank selection, its gather and the assembly in block_rows.c. */
#ifndef MTRAIN_CORE_BLOCK_SELECT_H
#define MTRAIN_CORE_BLOCK_SELECT_H

#include "mtrain/mtrain.h"

/** Entries of one head's lower triangle of nb query blocks. */
static inline int64_t mtrain_block_tri(int64_t nb) { return nb * (nb + 1) / 2; }

/** The key blocks scored in row qb: 0 .. qb (causal), or all nb
 *  (o->noncausal, SPEC.md section 9.7). */
static inline int64_t mtrain_block_row_len(int64_t qb, int64_t nb,
                                           const mtrain_block_options_t *o) {
  return o->noncausal ? nb : qb + 1;
}

/** The offset of row qb in one head's full scores: the lower triangle, or
 *  nb x nb (non-causal). */
static inline int64_t mtrain_block_row_at(int64_t qb, int64_t nb, const mtrain_block_options_t *o) {
  return o->noncausal ? qb * nb : mtrain_block_tri(qb);
}

/** Entries of one head's full scores (mtrain_block_row_at). */
static inline int64_t mtrain_block_head_entries(int64_t nb, const mtrain_block_options_t *o) {
  return o->noncausal ? nb * nb : mtrain_block_tri(nb);
}

/** What one head's selection found. */
typedef struct mtrain_block_head_result {
  double kept;    /**< sum over query blocks (ascending) of the kept score of each */
  double total;   /**< sum over query blocks (ascending) of each block row's total */
  int64_t blocks; /**< selected pairs, forced included */
} mtrain_block_head_result_t;

/** Selects one query block row qb (SPEC.md sections 9.4 and 9.7) from its
 *  scores row[0 .. len) (len = mtrain_block_row_len) with the budget top_k
 *  (top-k) or the options' top_p. Writes the selected key blocks ascending to
 *  idx (capacity len) and returns their count; *kept and *total get the
 *  row's kept score and its total (key blocks ascending). `scratch_idx`
 *  holds len int64, `scratch_keep` len bytes. Thread-safe; depends on this
 *  row alone. */
int64_t mtrain_block_select_row(const double *row, int64_t qb, int64_t len,
                                const mtrain_block_options_t *o, int32_t top_k, int32_t *idx,
                                int64_t *scratch_idx, uint8_t *scratch_keep, double *kept,
                                double *total);

/** Selects one head from its scores `w` (nb query blocks, the lower
 *  triangle, or nb x nb with o->noncausal: mtrain_block_row_at):
 *  mtrain_block_select_row for each row. Writes the CSR of the mask:
 *  mask_off [nb + 1], mask_idx (capacity mtrain_block_head_entries) key
 *  blocks ascending per query block. `scratch_idx` holds nb int64,
 *  `scratch_keep` nb bytes. Thread-safe (no shared state). */
void mtrain_block_select_head(const double *w, int64_t nb, const mtrain_block_options_t *o,
                              int32_t top_k, int64_t *mask_off, int32_t *mask_idx,
                              int64_t *scratch_idx, uint8_t *scratch_keep,
                              mtrain_block_head_result_t *result);

/** The candidates (key blocks not forced in) of query block row qb of
 *  `len` key blocks (mtrain_block_row_len). O(1). */
int64_t mtrain_block_candidates(int64_t qb, int64_t len, const mtrain_block_options_t *o);

/** The most candidates of any row of nb query blocks. */
int64_t mtrain_block_most_candidates(int64_t nb, const mtrain_block_options_t *o);

/** The length of the head-adaptive gain curves: min(Hq top_k, the most
 *  candidates of a row), the ranks a greedy budget can reach. */
int64_t mtrain_block_gain_cap(int64_t nb, int32_t Hq, const mtrain_block_options_t *o);

/** The head-adaptive gain curves of SPEC.md section 9.5 over the rows a
 *  rank holds, as exact sums (exact_sum.h): words [Hq][cap + 1]
 *  [MTRAIN_XSUM_WORDS], entry 0 the head's total (the sum of its rows'
 *  totals), entry 1 + u the sum over rows of the row's (u+1)-th ranked
 *  candidate. Row r of head h is scores[h * head_stride + row_off[r]], its
 *  query block row_qb[r] (of nb). The words of several ranks combine by an fp64 sum
 *  all-reduce, exactly. Uses up to `threads` OpenMP threads; the result does
 *  not depend on them. MTRAIN_SUCCESS or MTRAIN_ERR_OUT_OF_MEMORY. */
mtrain_status_t mtrain_block_gain_words(const double *scores, int64_t head_stride,
                                        const int64_t *row_off, const int64_t *row_qb, int64_t rows,
                                        int64_t nb, int32_t Hq, const mtrain_block_options_t *o,
                                        int64_t cap, int threads, double *words);

/** The greedy of SPEC.md section 9.5 from the (summed) gain words: each of
 *  the Hq * o->top_k units to the head whose next block adds the most
 *  recall; writes top_k[Hq]. */
void mtrain_block_budgets_from_words(const double *words, int32_t Hq, int64_t nb,
                                     const mtrain_block_options_t *o, int64_t cap, int32_t *top_k);

/** The head-adaptive top-k budgets of one rank holding every row: the gain
 *  words of the Hq triangles in `scores`, then the greedy. Returns
 *  MTRAIN_SUCCESS or MTRAIN_ERR_OUT_OF_MEMORY. */
mtrain_status_t mtrain_block_adaptive_budgets(const double *scores, int32_t Hq, int64_t nb,
                                              const mtrain_block_options_t *o, int threads,
                                              int32_t *top_k);

/** The calling thread's last block selection: wall-clock seconds of its two
 *  halves, `scores` (gather, backend scores) and `select` (budgets, masks,
 *  the gather of the selected rows), and the bytes this rank held for
 *  scores (its own query block rows, fp64, host) and received in the
 *  compact gather of the selection. For the measurements of docs/PATTERNS.md
 *  and the tests. */
typedef struct mtrain_block_times {
  double scores, select;
  int64_t score_bytes, gather_bytes;
} mtrain_block_times_t;
mtrain_block_times_t mtrain_block_last_times(void);

#endif /* MTRAIN_CORE_BLOCK_SELECT_H */
