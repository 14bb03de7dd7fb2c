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

/* ------------------------------------------------------------------------ */
/* SparseBalance: cost predictor, sparsity-aware batching, bidirectional     */
/* sparsity tuning (docs/BALANCE.md, "SparseBalance")                        */
/* ------------------------------------------------------------------------ */
/* Threading: every function below may be called from several threads at
 * once; a predictor is immutable after creation and may be shared. All
 * results are deterministic: the same inputs give bitwise the same outputs
 * (no threads, no randomness, ties broken by the lower index). */

/** Per-device calibration of the cost predictor (seconds are forward +
 *  backward of one training step). Read from data/calibration/<device>.json
 *  with mtrain_balance_calibration_read; docs/BALANCE.md says how each table
 *  was derived. */
typedef struct mtrain_balance_calibration {
  double pair_s;       /**< seconds per computed (query, key) pair of one head */
  double row_s;        /**< seconds per (query row, head): per-row attention overhead */
  double seq_s;        /**< seconds per sequence and layer (per attention call) */
  double linear_flops; /**< FLOP/s of the linear layers; 0: their cost is left out */
  /** Seconds per sequence of the linear layers, beside their FLOPs at
   *  linear_flops: the fixed cost of their matrix products (short sequences
   *  run below the rate of long ones). Charged once per sequence when the
   *  linear layers are charged (model hidden > 0), and by every rank of a
   *  split sequence (each runs them on its share). Optional in files: 0. */
  double linear_seq_s;
} mtrain_balance_calibration_t;

/** Reads a calibration JSON: an object with the numbers "pair_s", "row_s",
 *  "seq_s" (>= 0) and "linear_flops" (>= 0), the optional number
 *  "linear_seq_s" (>= 0; 0 when absent), plus the documentation keys
 *  "device", "backend", "status", "derivation", "anchors", "fit",
 *  "measurements" and "model" (not interpreted). Any other key, a missing
 *  number or a negative one is MTRAIN_ERR_FORMAT naming the file and key. */
MTRAIN_API mtrain_status_t mtrain_balance_calibration_read(const char *path,
                                                           mtrain_balance_calibration_t *out);

/** The model's linear layers, charged per token: forward + backward FLOPs =
 *  6 * (layers * (2 * hidden * q_heads * head_dim + 2 * hidden * kv_heads *
 *  head_dim + 3 * hidden * intermediate) + hidden * vocab), with layers and
 *  q_heads those of the budgets (the first layer's heads). All >= 0; hidden
 *  0 leaves the linear cost out. Initialise with MTRAIN_BALANCE_MODEL_INIT
 *  (Qwen2.5-3B). */
typedef struct mtrain_balance_model {
  int64_t hidden, intermediate, vocab;
  int32_t kv_heads, head_dim;
} mtrain_balance_model_t;

#define MTRAIN_BALANCE_MODEL_INIT                                                                  \
  { 2048, 11008, 151936, 2, 128 }

/** The cost predictor: budgets (every layer and head), budget levels, the
 *  position model and a calibration. Opaque; immutable once made and, where
 *  used, given its measured pairs (mtrain_balance_predictor_set_row_pairs). */
typedef struct mtrain_balance_predictor mtrain_balance_predictor_t;

/** Creates a predictor. A head's budget at level k is its budget with the
 *  counts (v_size and s_size; top-p entries: cap_v and cap_s) multiplied by
 *  scales[k] and rounded (at least 1); scales must be > 0 and strictly
 *  increasing, and scales[base_level] is the untuned budget (normally 1.0).
 *  The pairs of a head at length N are the exact pair count (SPEC.md section
 *  1) of the pattern the position model gives that budget at N (spread even
 *  or local; random is replaced by even: the predictor does not depend on
 *  seeds). The
 *  inputs are copied. The caller destroys the result. */
MTRAIN_API mtrain_status_t mtrain_balance_predictor_create(
    const mtrain_budgets_t *budgets, const double *scales, int32_t num_levels, int32_t base_level,
    const mtrain_position_model_t *position_model, int32_t granularity,
    const mtrain_balance_calibration_t *calibration, const mtrain_balance_model_t *model,
    mtrain_balance_predictor_t **out);
MTRAIN_API void mtrain_balance_predictor_destroy(mtrain_balance_predictor_t *predictor);
/** Prices the heads by measured patterns instead of the position model:
 *  row_pairs[head * num_levels + level] (heads over all layers, as
 *  mtrain_balance_predictor_num_heads counts them) is the pairs per query row
 *  that the head's estimated pattern computed at that level on a measured
 *  sequence (pairs / its length); a sequence of N tokens is then charged
 *  min(N (N + 1) / 2, round(row_pairs * N)) pairs, at least 1 (a budget of
 *  fixed counts computes about the same pairs per row at every length). Every
 *  value finite and > 0 (else MTRAIN_ERR_INVALID_ARGUMENT naming it). The
 *  array is copied. Call before the predictor is shared: not thread-safe
 *  against its concurrent use. */
MTRAIN_API mtrain_status_t mtrain_balance_predictor_set_row_pairs(
    mtrain_balance_predictor_t *predictor, const double *row_pairs);
/** Measured pricing on a length grid: row_pairs[(i * heads + head) *
 *  num_levels + level] is the pairs per query row of the head's estimated
 *  pattern at that level on a measured sequence of lengths[i] tokens
 *  (num_lengths in [1, 64], lengths >= 1 and strictly increasing; lengths may
 *  be NULL when num_lengths is 1, which is mtrain_balance_predictor_set_row_pairs).
 *  At length N the pairs per row are interpolated linearly in log N between
 *  the two measured lengths around N, and taken from the nearest end outside
 *  them; a sequence is then charged min(N (N + 1) / 2, round(pairs per row *
 *  N)) pairs, at least 1. Why a grid: a budget of fixed counts computes more
 *  pairs per row at longer lengths (its slashes spread over more block
 *  diagonals), measured on an H200 (docs/BALANCE.md, "Pricing on a length
 *  grid"). Every value finite and > 0 (else MTRAIN_ERR_INVALID_ARGUMENT naming
 *  it). The arrays are copied; the same threading rule as set_row_pairs. */
MTRAIN_API mtrain_status_t mtrain_balance_predictor_set_row_pairs_grid(
    mtrain_balance_predictor_t *predictor, int32_t num_lengths, const int64_t *lengths,
    const double *row_pairs);
/** Reads a measured-pricing table (format "mtrain-row-pairs-1", written by
 *  tools/balance_row_pairs.py: "levels", "granularity", "heads" per layer,
 *  "num_layers", "lengths" and "layers_done" {"layer": [length][head][level]})
 *  and applies it with mtrain_balance_predictor_set_row_pairs_grid. Refuses
 *  (MTRAIN_ERR_INVALID_ARGUMENT or MTRAIN_ERR_FORMAT, naming the file and the
 *  entry) a table whose levels, granularity, layers or heads differ from the
 *  predictor's, a layer not measured, and any bad value. Same threading rule
 *  as set_row_pairs. */
MTRAIN_API mtrain_status_t
mtrain_balance_predictor_read_row_pairs(mtrain_balance_predictor_t *predictor, const char *path);
/** Heads over all layers of the budgets (index = heads of earlier layers + head). */
MTRAIN_API int32_t mtrain_balance_predictor_num_heads(const mtrain_balance_predictor_t *predictor);
MTRAIN_API int32_t mtrain_balance_predictor_num_levels(const mtrain_balance_predictor_t *predictor);
/** Exact pair count of head `head` (global index) at level `level` and length N. */
MTRAIN_API mtrain_status_t mtrain_balance_head_pairs(const mtrain_balance_predictor_t *predictor,
                                                     int64_t seq_len, int32_t head, int32_t level,
                                                     int64_t *out);
/** Predicted seconds (forward + backward) of one sequence of seq_len
 *  tokens: sum over heads of pair_s * pairs + row_s * N * heads + seq_s *
 *  layers + linear FLOPs * N / linear_flops + linear_seq_s (the last two
 *  when the model has linear layers). `levels` holds one level per
 *  head, or NULL for the base level everywhere. */
MTRAIN_API mtrain_status_t mtrain_balance_predict(const mtrain_balance_predictor_t *predictor,
                                                  int64_t seq_len, const int32_t *levels,
                                                  double *seconds);

/** How sequences are dealt to ranks. */
typedef enum mtrain_batch_method {
  MTRAIN_BATCH_COST = 0,   /**< by predicted cost: LPT, then moves and swaps off the busiest rank */
  MTRAIN_BATCH_TOKENS = 1, /**< token-count balancing: LPT on token counts (the usual practice) */
  MTRAIN_BATCH_SORTED = 2, /**< length-sorted: ascending lengths cut into R consecutive groups
                                of about equal tokens */
} mtrain_batch_method_t;

/** Deals n items with weights w[i] >= 0 to `ranks` ranks, and each rank's
 *  items to `micro_batches` micro-batches (LPT on the same weights within the
 *  rank). MTRAIN_BATCH_COST and MTRAIN_BATCH_TOKENS run the same solver
 *  (their callers pass costs or token counts): longest-processing-time first
 *  (weights descending, ties by index, each to the least-loaded rank, ties to
 *  the lower rank), then local improvement: a move or a swap of items between
 *  the busiest rank and another is taken when it lowers both ranks' loads
 *  below the busiest one's, best first, until none does (at most 64 * n
 *  rounds). The largest rank load is then at most (4/3 - 1/(3 ranks)) times
 *  the optimum (Graham's LPT bound; the improvement only lowers it).
 *  MTRAIN_BATCH_SORTED uses the weights as lengths. rank_of[n] and
 *  micro_of[n] receive the result. */
MTRAIN_API mtrain_status_t mtrain_balance_assign(const double *weights, int32_t n, int32_t ranks,
                                                 int32_t micro_batches,
                                                 mtrain_batch_method_t method, int32_t *rank_of,
                                                 int32_t *micro_of);

/** Splitting the longest documents over several ranks as a context-parallel
 *  group (the ring), docs/BALANCE.md "Splitting the longest documents over a
 *  ring". Initialise with MTRAIN_BALANCE_SPLIT_INIT (splitting off). */
typedef struct mtrain_balance_split_options {
  double split_above;   /**< a document whose weight exceeds split_above * (total weight /
                             ranks), the ideal mean rank load, is split; 0: never (off) */
  double ring_overhead; /**< >= 1: factor on the ring-carried part of each rank's share of a
                             split document (default 1.01: ring/compute 1.003 times the
                             layouts' per-rank imbalance 1.005, measured on 4 GPUs) */
  int32_t max_ranks;    /**< most ranks one document may span, in [0, ranks]; 0: ranks */
} mtrain_balance_split_options_t;

#define MTRAIN_BALANCE_SPLIT_INIT                                                                  \
  { 0.0, 1.01, 0 }

/** The result of mtrain_balance_assign_split / mtrain_balance_batch_split.
 *  Every array is allocated by the library and owned by the struct; release
 *  them with mtrain_balance_split_free. A whole (unsplit) document has one
 *  rank; a split document has k >= 2 distinct ranks, listed ascending: its
 *  position in that list is the rank's index in the document's ring. */
typedef struct mtrain_balance_split {
  int32_t n;            /**< documents */
  int32_t ranks;        /**< ranks */
  int32_t num_split;    /**< documents spanning more than one rank */
  int32_t *rank_of;     /**< [n] the document's first (lowest) rank; a whole one's only rank */
  int32_t *num_ranks;   /**< [n] k: the ranks it spans (1: whole) */
  int32_t *offset;      /**< [n + 1] the document's ranks are group[offset[i] .. offset[i + 1]) */
  int32_t *group;       /**< [offset[n]] the ranks of every document, ascending within one */
  int32_t *micro_of;    /**< [n] a whole document's micro-batch; -1 for a split one, which runs
                             in the split phase before the rank's micro-batches */
  int32_t *split_order; /**< [num_split] the split documents in the order every rank of their
                             groups runs them (the order they were placed: largest first) */
  double *share;        /**< [n] the load each of the document's ranks carries (a whole
                             document: its weight) */
  double *start;        /**< [n] a split document's predicted start in the split phase (its
                             group starts when its last rank is free); -1 for a whole one */
  double *rank_load;    /**< [ranks] predicted finish of each rank: the end of its split
                             phase (waits included) plus its whole documents */
  double *rank_idle;    /**< [ranks] the rank's waits in the split phase */
} mtrain_balance_split_t;

/** Frees the arrays of a result and zeroes it. NULL, or a zeroed struct, is
 *  a no-op. Not thread-safe on the same struct. */
MTRAIN_API void mtrain_balance_split_free(mtrain_balance_split_t *result);

/** mtrain_balance_assign with the largest documents split over several
 *  ranks (docs/BALANCE.md, "Splitting the longest documents over a ring"):
 *  1. T = split->split_above * (sum of weights) / ranks. A document with
 *     weight > T is split over k ranks, k the smallest in [2, max_ranks]
 *     with share(k) <= T (max_ranks when none is), where share(k) =
 *     fixed_part[i] + (weights[i] - fixed_part[i] + (ring_overhead - 1) *
 *     ring_part[i]) / k: the part every rank of the group pays in full (per
 *     call constants), the rest divided by k, the ring-carried part times
 *     the overhead. ring_part NULL: all of the weight is ring-carried;
 *     fixed_part NULL: none is fixed. Need 0 <= ring_part[i], fixed_part[i]
 *     and their sum <= weights[i] (to rounding).
 *  2. Split phase: the split documents, weights descending (ties: lower
 *     index), each on the k ranks free first (ties: lower rank); it starts
 *     when the last of them is free (the ring runs the group in lockstep),
 *     the others wait (rank_idle). Every rank runs its split documents in
 *     this order (split_order), before its whole documents.
 *  3. The whole documents: the solver of mtrain_balance_assign (LPT, moves
 *     and swaps off the busiest rank) on top of each rank's split-phase end,
 *     and each rank's whole documents in `micro_batches` micro-batches (LPT).
 *  With split NULL, split_above 0, or no document above T, the ranks and
 *  micro-batches equal mtrain_balance_assign's bitwise (every num_ranks 1).
 *  method: MTRAIN_BATCH_COST or MTRAIN_BATCH_TOKENS (MTRAIN_BATCH_SORTED
 *  only without splitting). On success *out holds a new result (free it with
 *  mtrain_balance_split_free); on failure *out is zeroed. Thread-safe. */
MTRAIN_API mtrain_status_t mtrain_balance_assign_split(
    const double *weights, const double *ring_part, const double *fixed_part, int32_t n,
    int32_t ranks, int32_t micro_batches, mtrain_batch_method_t method,
    const mtrain_balance_split_options_t *split, mtrain_balance_split_t *out);

/** Options of mtrain_balance_batch. Initialise with MTRAIN_BALANCE_BATCH_INIT. */
typedef struct mtrain_balance_batch_options {
  int32_t ranks, micro_batches;
  mtrain_batch_method_t method;
  int32_t tune;      /**< 1: bidirectional sparsity tuning after batching; 0: none */
  int32_t min_level; /**< lowest level the tuner may choose (bound); -1: 0 */
  int32_t max_level; /**< highest level the tuner may choose (bound); -1: the last */
  double target_s;   /**< step target in seconds; <= 0: the mean of the ranks' predicted
                          seconds at the base level (perfect balance) */
} mtrain_balance_batch_options_t;

#define MTRAIN_BALANCE_BATCH_INIT                                                                  \
  { 1, 1, MTRAIN_BATCH_COST, 1, -1, -1, 0.0 }

/** What mtrain_balance_batch did. Recall figures are the mass curves'
 *  values (attention mass kept), token-weighted over the ranks' sequences
 *  (mean) or the smallest of any (rank, head) holding tokens (worst). */
typedef struct mtrain_balance_report {
  double max_before, mean_before;                 /**< rank seconds after batching, base levels */
  double max_after, mean_after;                   /**< after tuning (= before without tuning) */
  double target_s;                                /**< the target the tuner aimed at */
  double recall_before, recall_after;             /**< token-weighted mean recall */
  double worst_recall_before, worst_recall_after; /**< smallest per-head recall */
  int32_t ranks_over_target;    /**< ranks still above the target after tuning (fallback) */
  int32_t empty_ranks;          /**< ranks given no sequence */
  int64_t moves_down, moves_up; /**< level changes made by the tuner */
} mtrain_balance_report_t;

/** Batches one global batch and tunes its sparsity (docs/BALANCE.md):
 *  1. predicts each sequence's seconds at the base level and deals the
 *     sequences with options->method (MTRAIN_BATCH_TOKENS weighs by tokens,
 *     MTRAIN_BATCH_SORTED cuts by length; both are then predicted alike);
 *  2. with options->tune, per rank (one level per head for all of a rank's
 *     sequences): a rank above the target lowers levels, one head one level
 *     at a time, choosing the step with the least recall lost per second
 *     saved, until it meets the target; if it cannot, it keeps the lowest
 *     allowed levels (fallback) and the step becomes its time. Then every
 *     rank below the step time raises levels, choosing the most recall gained
 *     per second added among steps that keep it at or below the step time.
 *     Levels stay within [min_level, max_level] (and the base level, when
 *     outside, is first clamped into it).
 *  mass[head * num_levels + level] (required with tune) is the recall curve
 *  of each head, nondecreasing in the level, in [0, 1]
 *  (mtrain_balance_mass_curve). lengths[n] >= 1. Outputs: rank_of[n],
 *  micro_of[n]; levels[ranks * heads] (may be NULL); rank_before[ranks] and
 *  rank_after[ranks] predicted seconds (may be NULL); report (may be NULL). */
MTRAIN_API mtrain_status_t
mtrain_balance_batch(const mtrain_balance_predictor_t *predictor, const int64_t *lengths, int32_t n,
                     const double *mass, const mtrain_balance_batch_options_t *options,
                     int32_t *rank_of, int32_t *micro_of, int32_t *levels, double *rank_before,
                     double *rank_after, mtrain_balance_report_t *report);

/** mtrain_balance_batch with the largest documents split over several ranks
 *  (mtrain_balance_assign_split; docs/BALANCE.md, "Splitting the longest
 *  documents over a ring"). A split document of N tokens costs each of its k
 *  ranks seq_s * layers + linear_seq_s + (ring_overhead * (pair_s * pairs +
 *  row_s * N * heads) + linear FLOPs * N / linear_flops) / k at the base
 *  level: the attention, carried by the ring, divided by k and times the
 *  overhead, the linear layers' FLOPs divided by k, the per-call and the
 *  linear layers' per-sequence constants paid by every rank.
 *  MTRAIN_BATCH_COST splits by these seconds, MTRAIN_BATCH_TOKENS by token
 *  counts (N * ring_overhead / k), both with the same threshold fraction.
 *  Split documents run at the base level (clamped into the bounds) on all
 *  their ranks (the ranks of one ring must agree on its pattern); the tuner
 *  changes only the levels of each rank's whole documents, and levels[r *
 *  heads + h] applies to those. Recall figures count a split document's
 *  N / k tokens on each of its ranks at the base level. *out receives the
 *  assignment with share, start, rank_load and rank_idle in predicted
 *  seconds at the base level (rank_load = rank_before); free it with
 *  mtrain_balance_split_free. With split NULL or split_above 0 every output
 *  equals mtrain_balance_batch's bitwise. Other arguments as there. */
MTRAIN_API mtrain_status_t mtrain_balance_batch_split(
    const mtrain_balance_predictor_t *predictor, const int64_t *lengths, int32_t n,
    const double *mass, const mtrain_balance_batch_options_t *options,
    const mtrain_balance_split_options_t *split, mtrain_balance_split_t *out, int32_t *levels,
    double *rank_before, double *rank_after, mtrain_balance_report_t *report);

/** Per-head sensitivity from the estimation's own scores: for one layer's
 *  post-RoPE q [seq_len, q_heads, head_dim] and k [seq_len, kv_heads,
 *  head_dim] (fp32, host), the top-p score matrix of SPEC.md section 2 (the
 *  last L = options->last_q queries, each row's causal softmax divided by L,
 *  summing to 1) is formed, and for every head and level the budget
 *  budgets[h] at that level (counts times scales[k], scaled by seq_len /
 *  budget_context when budget_context > 0, clamped as the position model
 *  clamps them) selects as the static top-k selection does (sinks and
 *  window first, then the best scores; verticals only before the last
 *  G-block); mass[h * num_levels + k] receives the
 *  share of the score matrix the selected verticals and slashes cover
 *  (their union, each entry once). This is the attention mass kept by the
 *  budget on the rows the estimate sees. O(L * N * d * heads). The options'
 *  top_p_forced is checked (0 or 1) and changes nothing here: every level
 *  forces the sinks and the window as top-k does. */
MTRAIN_API mtrain_status_t mtrain_balance_mass_curve(
    const float *q, const float *k, int64_t seq_len, int32_t q_heads, int32_t kv_heads,
    int32_t head_dim, int32_t granularity, const mtrain_head_budget_t *budgets,
    const double *scales, int32_t num_levels, int64_t budget_context,
    const mtrain_estimate_options_t *options, double *mass);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_BALANCE_H */
