/* block_select.h (private): the selection half of block-sparse selection
 * (SPEC.md section 9): from the lower-triangular block scores of one head
 * to its block mask, and the head-adaptive budgets. Pure host logic, shared
 * by every backend and exposed here for the white-box tests. */
#ifndef MTRAIN_CORE_BLOCK_SELECT_H
#define MTRAIN_CORE_BLOCK_SELECT_H

#include "mtrain/mtrain.h"

/** Entries of one head's lower triangle of nb query blocks. */
static inline int64_t mtrain_block_tri(int64_t nb) { return nb * (nb + 1) / 2; }

/** What one head's selection found. */
typedef struct mtrain_block_head_result {
  double kept;    /**< sum over query blocks (ascending) of the kept score of each */
  double total;   /**< sum over query blocks (ascending) of each block row's total */
  int64_t blocks; /**< selected pairs, forced included */
} mtrain_block_head_result_t;

/** Selects one head (SPEC.md section 9.4) from its scores `w` (nb query
 *  blocks, lower triangle) with the budget top_k (top-k) or the options'
 *  top_p. Writes the CSR of the mask: mask_off [nb + 1], mask_idx (capacity
 *  nb (nb + 1) / 2) key blocks ascending per query block. `scratch_idx`
 *  holds nb int64, `scratch_keep` nb bytes. Thread-safe (no shared state). */
void mtrain_block_select_head(const double *w, int64_t nb, const mtrain_block_options_t *o,
                              int32_t top_k, int64_t *mask_off, int32_t *mask_idx,
                              int64_t *scratch_idx, uint8_t *scratch_keep,
                              mtrain_block_head_result_t *result);

/** The head-adaptive top-k budgets of SPEC.md section 9.5: distributes
 *  Hq * o->top_k units over the heads greedily by marginal recall; writes
 *  top_k[Hq]. `scores` holds the Hq triangles. Uses up to `threads` OpenMP
 *  threads; the result does not depend on them. Returns MTRAIN_SUCCESS or
 *  MTRAIN_ERR_OUT_OF_MEMORY. */
mtrain_status_t mtrain_block_adaptive_budgets(const double *scores, int32_t Hq, int64_t nb,
                                              const mtrain_block_options_t *o, int threads,
                                              int32_t *top_k);

/** Wall-clock seconds of the two halves of the calling thread's last block
 *  selection: `scores` (gather, backend scores, combination) and `select`
 *  (budgets and masks). For the measurements of docs/PATTERNS.md. */
typedef struct mtrain_block_times {
  double scores, select;
} mtrain_block_times_t;
mtrain_block_times_t mtrain_block_last_times(void);

#endif /* MTRAIN_CORE_BLOCK_SELECT_H */
