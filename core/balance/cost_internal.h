/* cost_internal.h (private): the cost model's internal evaluation, which
 * the balanced layout's search reads for both bars modes, and the tests. */
#ifndef MTRAIN_CORE_COST_INTERNAL_H
#define MTRAIN_CORE_COST_INTERNAL_H

#include "mtrain/mtrain_balance.h"

/** Everything one evaluation computes, for both bars modes and both rings.
 *  Index conventions: [mode][ring], mode = mtrain_bars_mode_t, ring =
 *  mtrain_ring_kind_t; per layer l: full and bars_ring are (rank, src)
 *  matrices, bars_gathered a (rank, step) matrix, diag per rank (its block
 *  diagonal, held at src == rank). */
struct mtrain_cost {
  int32_t world, granularity, ranks_per_node, num_layers, num_heads;
  mtrain_bars_mode_t mode;   /* the mode the public accessors report */
  int32_t *layer_first_head; /* [num_layers + 1] */
  int32_t *step_src[2];      /* [ring][rank * W + step] */
  int64_t *full;             /* [layer][rank * W + src] */
  int64_t *diag;             /* [layer][rank] */
  int64_t *bars_ring;        /* [layer][rank * W + src] */
  int64_t *bars_gathered;    /* [layer][rank * W + step] */
  double *head_sync[2][2];   /* [mode][ring][head] */
  double *head_imbalance;    /* [head] */
  double *layer_sync[2][2];  /* [mode][ring][layer] */
  mtrain_cost_metrics_t metrics[2][2];
};

/** Flag of mtrain_cost_evaluate_owner: count every diagonal directly instead
 *  of through the layout's diagonal table (the tests compare both). */
#define MTRAIN_COST_DIRECT 1

/** Evaluates a workload under an owner map (the layout's, or a candidate's
 *  during the balanced search). `ranks_per_node` as in the public options;
 *  `mode` is only recorded for the accessors; `flags` 0 or MTRAIN_COST_DIRECT. */
mtrain_status_t mtrain_cost_evaluate_owner(const int32_t *owner, int64_t num_blocks,
                                           int64_t seq_len, int32_t granularity, int32_t world,
                                           int32_t ranks_per_node, mtrain_bars_mode_t mode,
                                           const mtrain_pattern_t *const *patterns,
                                           int32_t num_patterns, int flags, mtrain_cost_t **out);

#endif /* MTRAIN_CORE_COST_INTERNAL_H */
