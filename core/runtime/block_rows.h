/* block_rows.h (private): the selected rows of the distributed block
 * selection (SPEC.md section 9.6): each rank selects the query block rows it
 * owns into a compact message, the messages are all-gathered, and every rank
 * assembles the same pattern from them (block_rows.c). */
#ifndef MTRAIN_CORE_BLOCK_ROWS_H
#define MTRAIN_CORE_BLOCK_ROWS_H

#include "core/runtime/context_internal.h"
#include "mtrain/mtrain.h"

struct mtrain_layout;

/** The OpenMP threads of the context. */
int mtrain_block_threads(const mtrain_context_t *ctx);

/** The query blocks of rank r: *blocks the layout's global ids of its local
 *  blocks (NULL without a layout: one rank owning blocks 0 .. nb-1), *local
 *  their count; returns how many are below nb (its rows). */
int64_t mtrain_block_rank_rows(const struct mtrain_layout *layout, int64_t nb, int32_t r,
                               const int64_t **blocks, int32_t *local);

/** The global block of local block lb (blocks as above). */
static inline int64_t mtrain_block_at(const int64_t *blocks, int64_t lb) {
  return blocks ? blocks[lb] : lb;
}

/** Selects this rank's n rows (row r of head h at scores[h * R +
 *  row_off[r]], query block row_qb[r] of nb, mtrain_block_row_len entries)
 *  with the heads' budgets into one
 *  message (*msg, malloc'd, *bytes long, a multiple of 8): per (head, row)
 *  the kept and the total score (fp64) and the count (int32), then the key
 *  blocks of every (head, row) in that order (int32). */
mtrain_status_t mtrain_block_select_rows(mtrain_context_t *ctx, const double *scores, int64_t R,
                                         const int64_t *row_off, const int64_t *row_qb, int64_t n,
                                         int64_t nb, int32_t Hq, const mtrain_block_options_t *o,
                                         const int32_t *budget, void **msg, size_t *bytes);

/** All-gathers every rank's message, padded to the longest (*stride bytes),
 *  into *all [W][*stride] (malloc'd); *msg may be reallocated. */
mtrain_status_t mtrain_block_gather_rows(mtrain_context_t *ctx, void **msg, size_t bytes,
                                         char **all, size_t *stride);

/** Assembles the pattern of N tokens (non-causal with o->noncausal) from
 *  the gathered messages (the rows of each rank as `layout` gives them, or
 *  one rank's without it) and fills
 *  `report` (may be NULL): the recalls are 9.4's sums over the query blocks
 *  ascending of the gathered per-row values. */
mtrain_status_t mtrain_block_assemble(mtrain_context_t *ctx, const struct mtrain_layout *layout,
                                      int64_t N, int32_t Hq, const char *all, size_t stride,
                                      const int32_t *budget, const mtrain_block_options_t *o,
                                      const mtrain_block_report_t *report, mtrain_pattern_t **out);

/** The largest all-gather of the distributed selection, in bytes per rank
 *  (256 MiB; longer messages go in pieces). Settable for the tests. */
extern size_t mtrain_block_gather_piece;

#endif /* MTRAIN_CORE_BLOCK_ROWS_H */
