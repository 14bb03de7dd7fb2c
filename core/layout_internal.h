/* layout_internal.h (private): the layout's representation, shared by the
 * layout module, the cost model (which counts work from the owner map), the
 * balanced layout's search and the tests; and the cost model's internal
 * evaluation, which the balanced search reads for both bars modes. */
#ifndef MTRAIN_CORE_LAYOUT_INTERNAL_H
#define MTRAIN_CORE_LAYOUT_INTERNAL_H

#include "mtrain/mtrain_layout.h"
#include "plan_internal.h"

struct mtrain_layout {
  mtrain_layout_kind_t kind;
  mtrain_bars_mode_t bars_mode;
  char variant[32];
  int64_t seq_len;
  int32_t granularity;
  int32_t world;
  int64_t num_blocks;     /* padded block count */
  int64_t num_seq_blocks; /* ceil(seq_len / G) */
  int32_t per_rank;       /* blocks per rank (all ranks hold the same number) */
  int32_t *owner;         /* [num_blocks] rank of each global block */
  int32_t *local;         /* [num_blocks] local block index on its rank */
  int64_t *blocks;        /* [num_blocks] rank r's blocks at blocks + r * per_rank */
};

/** The blocks of one rank as the plan builder takes them (tokens = blocks * G). */
mtrain_rank_blocks_t mtrain_layout_rank_view(const mtrain_layout_t *layout, int32_t rank);

/** Builds a layout from an owner map of num_blocks blocks (each rank must own
 *  num_blocks / world of them). The owner array is copied. */
mtrain_status_t mtrain_layout_from_owner(mtrain_layout_kind_t kind, const char *variant,
                                         mtrain_bars_mode_t bars_mode, int64_t seq_len,
                                         int32_t granularity, int32_t world, int64_t num_blocks,
                                         const int32_t *owner, mtrain_layout_t **out);

/* ---- the cost model's internal evaluation --------------------------------- */

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

/** Validates ranks_per_node for world: 0, or a divisor of world. Returns the
 *  L the hierarchical ring uses (world when ranks_per_node is 0). */
mtrain_status_t mtrain_ring_check(int32_t world, int32_t ranks_per_node, int32_t *inner);

#endif /* MTRAIN_CORE_LAYOUT_INTERNAL_H */
