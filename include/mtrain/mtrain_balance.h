/* mtrain_balance.h: the balance models, which need no tensors: the position
 * model that turns per-head budgets into patterns, the cost model and its
 * balance metrics (SPEC.md section 6) and the time model of the ring. The
 * balanced layout (mtrain_layout.h) is chosen with the cost model.
 * docs/BALANCE.md explains the designs and shows measured figures.
 *
 * Conventions as in mtrain.h: status returns, outputs last and written only
 * on success, destroy(NULL) is a no-op, nothing prints. Cost results are
 * immutable after creation and may be read by several threads at once.
 */
#ifndef MTRAIN_BALANCE_H
#define MTRAIN_BALANCE_H

#include "mtrain_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Position model: patterns from budgets, no tensors needed                  */
/* ------------------------------------------------------------------------ */

typedef enum mtrain_spread {
  MTRAIN_SPREAD_EVEN = 0,   /**< evenly spaced over the free range */
  MTRAIN_SPREAD_RANDOM = 1, /**< uniform without replacement, seeded */
  MTRAIN_SPREAD_LOCAL = 2,  /**< packed at the start of the free range (right after the
                                 sinks, right after the window) */
} mtrain_spread_t;

/** Where a head's v verticals and s slashes fall (docs/BALANCE.md):
 *  - v and s are the budget's v_size and s_size (top-p entries: cap_v and
 *    cap_s, the most the selection may keep), multiplied by
 *    seq_len / budget_context and rounded when budget_context > 0;
 *  - verticals: the first min(v, num_sinks) keys (sinks), the rest spread
 *    over the keys after them that are not in the last G-block (SPEC.md
 *    section 2 never selects those); v is clamped to the candidates;
 *  - slashes: token diagonals 0..min(s, window)-1 (local window), the rest
 *    spread over the token diagonals window..seq_len-1; a token diagonal
 *    t = a*G + b becomes block diagonals a and, when b > 0, a + 1; those
 *    beyond the last block are dropped; diagonal 0 is always present.
 *  RANDOM draws each head's positions from a generator seeded with (seed,
 *  layer, head), so results are reproducible. Initialise with
 *  MTRAIN_POSITION_MODEL_INIT (30 sinks, window 100, even, no scaling). */
typedef struct mtrain_position_model {
  int32_t num_sinks;
  int32_t window;
  mtrain_spread_t spread;
  uint64_t seed;
  int64_t budget_context; /**< 0: budgets used as given */
} mtrain_position_model_t;

#define MTRAIN_POSITION_MODEL_INIT                                                                 \
  { 30, 100, MTRAIN_SPREAD_EVEN, 0, 0 }

/** The vertical-slash pattern of one layer of a budget file under the
 *  position model: one head per budget of the layer. The caller destroys
 *  the result. */
MTRAIN_API mtrain_status_t mtrain_pattern_from_budgets(const mtrain_budgets_t *budgets,
                                                       int32_t layer, int64_t seq_len,
                                                       int32_t granularity,
                                                       const mtrain_position_model_t *model,
                                                       mtrain_pattern_t **out);
/** The verticals and slashes the position model gives one budget (for
 *  layer/head seeding), after scaling and clamping: *v and *s. */
MTRAIN_API mtrain_status_t mtrain_position_model_counts(const mtrain_head_budget_t *budget,
                                                        int64_t seq_len, int32_t granularity,
                                                        const mtrain_position_model_t *model,
                                                        int64_t *v, int64_t *s);

/* ------------------------------------------------------------------------ */
/* Cost model and balance metrics (SPEC.md section 6)                        */
/* ------------------------------------------------------------------------ */

/** Block-level counts of one (rank, step), summed over heads. Work =
 *  full_blocks * G^2 + diag_blocks * G^2 / 2 + bars * G. */
typedef struct mtrain_work_counts {
  int64_t full_blocks; /**< listed key blocks off the block diagonal */
  int64_t diag_blocks; /**< listed key blocks on the block diagonal */
  int64_t bars;        /**< bar columns, each against one query block */
} mtrain_work_counts_t;

/** The work of counts at granularity G (a double; exact below 2^53). */
MTRAIN_API double mtrain_work_of(const mtrain_work_counts_t *counts, int32_t granularity);

/** Balance figures of one ring schedule. A "layer" is one pattern of the
 *  workload (one ring pass); the whole-model ring-sync slowdown sums the
 *  per-layer step maxima: sum over layers and steps of max over ranks,
 *  divided by sum over layers and steps of mean over ranks. */
typedef struct mtrain_cost_metrics {
  double total_work;          /**< over ranks, steps, layers and heads */
  double max_rank_work;       /**< largest total work of one rank */
  double worker_imbalance;    /**< max over ranks / mean over ranks of total work */
  double ring_sync_slowdown;  /**< see above; 1.0 is perfect */
  double step_max_sum;        /**< sum over layers and steps of max over ranks */
  double worst_head_slowdown; /**< largest ring-sync slowdown of one head */
  int32_t worst_head;         /**< its index (layer-major over the patterns' heads) */
} mtrain_cost_metrics_t;

/** Options of a cost evaluation. Initialise with MTRAIN_COST_OPTIONS_INIT. */
typedef struct mtrain_cost_options {
  int32_t ranks_per_node; /**< hierarchical figures with this L (0: same as flat) */
  int32_t bars_mode;      /**< an mtrain_bars_mode_t, or -1: the layout's */
} mtrain_cost_options_t;

#define MTRAIN_COST_OPTIONS_INIT                                                                   \
  { 0, -1 }

/** The cost of a workload under a layout, for the flat ring and (with
 *  ranks_per_node) the hierarchical ring. Opaque, immutable. */
typedef struct mtrain_cost mtrain_cost_t;

/** Evaluates the cost model: for every pattern (layer), head, rank and
 *  ring step, the listed blocks and bars of SPEC.md section 4, counted
 *  directly (no plans are built; equal to the plan's counts, tested).
 *  Patterns must have the layout's seq_len and granularity. Uses OpenMP
 *  threads; deterministic. The caller destroys the result. */
MTRAIN_API mtrain_status_t mtrain_cost_evaluate(const mtrain_layout_t *layout,
                                                const mtrain_pattern_t *const *patterns,
                                                int32_t num_patterns,
                                                const mtrain_cost_options_t *options,
                                                mtrain_cost_t **out);
MTRAIN_API void mtrain_cost_destroy(mtrain_cost_t *cost);

MTRAIN_API int32_t mtrain_cost_world(const mtrain_cost_t *cost);
MTRAIN_API int32_t mtrain_cost_ranks_per_node(const mtrain_cost_t *cost);
MTRAIN_API int32_t mtrain_cost_num_layers(const mtrain_cost_t *cost);
/** Heads over all layers; head index = heads of earlier layers + head. */
MTRAIN_API int32_t mtrain_cost_num_heads(const mtrain_cost_t *cost);
MTRAIN_API mtrain_bars_mode_t mtrain_cost_bars_mode(const mtrain_cost_t *cost);
/** Whole-model figures of a ring schedule. */
MTRAIN_API mtrain_status_t mtrain_cost_metrics(const mtrain_cost_t *cost, mtrain_ring_kind_t ring,
                                               mtrain_cost_metrics_t *out);
/** Counts of (rank, step) summed over heads of one layer, or over all
 *  layers when layer == -1. */
MTRAIN_API mtrain_status_t mtrain_cost_counts(const mtrain_cost_t *cost, mtrain_ring_kind_t ring,
                                              int32_t layer, int32_t rank, int32_t step,
                                              mtrain_work_counts_t *out);
/** Work of (rank, step) of one layer, or of the whole model (layer == -1);
 *  0 for arguments out of range. */
MTRAIN_API double mtrain_cost_work(const mtrain_cost_t *cost, mtrain_ring_kind_t ring,
                                   int32_t layer, int32_t rank, int32_t step);
/** Ring-sync slowdown of one head (0 for an index out of range). */
MTRAIN_API double mtrain_cost_head_ring_sync(const mtrain_cost_t *cost, mtrain_ring_kind_t ring,
                                             int32_t head);
/** Worker imbalance (max/mean of total work over ranks) of one head. */
MTRAIN_API double mtrain_cost_head_worker_imbalance(const mtrain_cost_t *cost, int32_t head);
/** Ring-sync slowdown of one layer. */
MTRAIN_API double mtrain_cost_layer_ring_sync(const mtrain_cost_t *cost, mtrain_ring_kind_t ring,
                                              int32_t layer);

/* ------------------------------------------------------------------------ */
/* Time model                                                                */
/* ------------------------------------------------------------------------ */

/** Machine and model shape for the time model. Initialise with
 *  MTRAIN_TIME_PARAMS_INIT (values describe an A100 cluster of 8-GPU nodes:
 *  assumptions, not measurements; set your own). */
typedef struct mtrain_time_params {
  double flops;     /**< effective attention FLOP/s of one GPU */
  double bw_intra;  /**< bytes/s one GPU sends to a GPU of its node */
  double bw_inter;  /**< bytes/s one GPU sends to a GPU of another node */
  double latency;   /**< seconds per message */
  int32_t head_dim; /**< d */
  int32_t kv_heads; /**< K/V heads per layer, dividing its query heads; 0: as many as query heads */
  int32_t dtype_bytes; /**< bytes of one stored K/V element (2 for bf16) */
} mtrain_time_params_t;

#define MTRAIN_TIME_PARAMS_INIT                                                                    \
  { 150e12, 150e9, 25e9, 10e-6, 128, 0, 2 }

/** Predicted seconds of one schedule over all layers, and their parts. */
typedef struct mtrain_time_prediction {
  double forward;       /**< forward pass over all layers */
  double backward;      /**< backward pass over all layers */
  double compute_ideal; /**< forward + backward compute with perfect balance, no communication */
  double gather;        /**< bars gathered: all-gather + reduce-scatter seconds (exposed or not) */
  double gather_bytes;  /**< bars gathered: bytes of the gathered K/V rows (forward) plus
                             their fp32 dK/dV (backward), all layers (0 in the ring) */
} mtrain_time_prediction_t;

/** Predicts the forward and backward time of the workload's cost on a
 *  cluster of nodes of mtrain_cost_ranks_per_node(cost) GPUs (0: one node
 *  holds all W), for the flat ring and the
 *  hierarchical ring (docs/BALANCE.md, "time model"): per step the compute
 *  of each rank from its work (4 * d FLOPs per (query, key) pair forward,
 *  2.5 times that backward) overlapped with the transfer of the next chunk;
 *  a step ends when the slowest rank and the slowest link are done. The
 *  patterns must be those the cost was evaluated on (their verticals size
 *  the gather of bars-gathered mode). `out` receives [flat, hierarchical]. */
MTRAIN_API mtrain_status_t mtrain_time_predict(const mtrain_cost_t *cost,
                                               const mtrain_layout_t *layout,
                                               const mtrain_pattern_t *const *patterns,
                                               int32_t num_patterns,
                                               const mtrain_time_params_t *params,
                                               mtrain_time_prediction_t out[2]);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_BALANCE_H */
