/* select.h (private): the selection half of pattern estimation (SPEC.md
 * section 2): from column and diagonal scores of one head to its verticals
 * and block diagonals. Pure host logic, shared by every backend. */
#ifndef MTRAIN_CORE_SELECT_H
#define MTRAIN_CORE_SELECT_H

#include "mtrain/mtrain.h"

/** Indices of the kept candidates among scores[0..n): top-k keeps the `k`
 *  highest; top-p walks down the ranking and keeps a candidate while the
 *  running sum of the kept scores, itself included, stays below p, at most
 *  `cap`. Ties break towards the lower index; NaN ranks lowest. `forced`
 *  (may be NULL) marks candidates that rank as if scored +infinity; top-p
 *  keeps every forced candidate it reaches within `cap` (its score added to
 *  the running sum) whatever the sum. Writes the kept indices in increasing
 *  order into out (capacity n) and returns their count. `order` is scratch
 *  of n int64. */
int64_t mtrain_select_top_k(const double *scores, const uint8_t *forced, int64_t n, int64_t k,
                            int64_t *order, int64_t *out);
int64_t mtrain_select_top_p(const double *scores, const uint8_t *forced, int64_t n, double p,
                            int64_t cap, int64_t *order, int64_t *out);

/** Converts sorted token diagonals to sorted unique block diagonals: t =
 *  a*G + b gives a, and a+1 when b > 0; those >= num_blocks are dropped;
 *  diagonal 0 is added. out needs capacity 2*n + 1; returns the count. */
int32_t mtrain_token_to_block_diagonals(const int64_t *tokens, int64_t n, int32_t granularity,
                                        int64_t num_blocks, int32_t *out);

/* mtrain_estimate_last_times and its struct are public (mtrain.h). */

#endif /* MTRAIN_CORE_SELECT_H */
