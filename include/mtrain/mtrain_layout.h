/* mtrain_layout.h: layouts (SPEC.md section 3), ring schedules (section 5),
 * the cost model and balance metrics (section 6), a time model of the ring,
 * and the position model that turns per-head budgets into patterns without
 * tensors. docs/BALANCE.md explains the designs and shows measured figures.
 *
 * A layout deals the G-blocks of a sequence, padded at its end, to W ranks:
 * each rank holds a list of global block ids in increasing order. Kinds:
 *   contiguous  rank r holds blocks [r*B/W, (r+1)*B/W)            unit G*W
 *   zigzag      2W equal chunks, rank r holds chunks r, 2W-1-r    unit 2*G*W
 *   striped     block b on rank b mod W                          unit G*W
 *   balanced    chosen by the cost model from a workload among     unit G*W
 *               striped-like maps, with the bars in the ring or
 *               gathered up front (mtrain_layout_bars_mode)
 * where B is the padded block count and "unit" the granule the sequence is
 * padded to (padded length = seq_len rounded up to a multiple of the unit).
 * Padding blocks (global block >= ceil(seq_len / G)) never compute.
 *
 * Conventions as in mtrain.h: status returns, outputs last and written only
 * on success, destroy(NULL) is a no-op, nothing prints. Layouts and cost
 * results are immutable after creation and may be read by several threads at
 * once; creating them is thread-safe (no shared state).
 */
#ifndef MTRAIN_LAYOUT_H
#define MTRAIN_LAYOUT_H

#include "mtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Ring schedules (SPEC.md section 5)                                        */
/* ------------------------------------------------------------------------ */

/** Which ring a figure refers to. */
typedef enum mtrain_ring_kind {
  MTRAIN_RING_FLAT = 0,         /**< one ring over all W ranks */
  MTRAIN_RING_HIERARCHICAL = 1, /**< inner ring inside a node, outer ring across nodes */
} mtrain_ring_kind_t;

/** "flat" or "hierarchical"; "unknown" otherwise. */
const char *mtrain_ring_kind_name(mtrain_ring_kind_t kind);

/** The rank whose K/V chunk `rank` holds at ring step `step` (0..world-1).
 *  ranks_per_node == 0 (or == world, or == 1) is the flat ring: source
 *  (rank - step) mod world. Otherwise the hierarchical ring with
 *  L = ranks_per_node (a divisor of world), n = world / L nodes,
 *  rank = node * L + local and step = o * L + i (outer step o, inner step i):
 *  source ((node - o) mod n) * L + ((local - i) mod L). */
mtrain_status_t mtrain_ring_source(int32_t world, int32_t ranks_per_node, int32_t rank,
                                   int32_t step, int32_t *src);
/** The inverse: the step at which `rank` holds the chunk of `src`. */
mtrain_status_t mtrain_ring_step_of(int32_t world, int32_t ranks_per_node, int32_t rank,
                                    int32_t src, int32_t *step);

/* ------------------------------------------------------------------------ */
/* Layouts (SPEC.md section 3)                                               */
/* ------------------------------------------------------------------------ */

typedef enum mtrain_layout_kind {
  MTRAIN_LAYOUT_CONTIGUOUS = 0,
  MTRAIN_LAYOUT_ZIGZAG = 1,
  MTRAIN_LAYOUT_STRIPED = 2,
  MTRAIN_LAYOUT_BALANCED = 3,
} mtrain_layout_kind_t;

/** "contiguous", "zigzag", "striped", "balanced"; "unknown" otherwise. */
const char *mtrain_layout_kind_name(mtrain_layout_kind_t kind);
/** Parses the names above; MTRAIN_ERR_INVALID_ARGUMENT naming `name` else. */
mtrain_status_t mtrain_layout_kind_parse(const char *name, mtrain_layout_kind_t *out);

/** Where the bar (vertical) work of a query block is computed.
 *  IN_RING (SPEC.md section 4): a bar is computed at the ring step in which
 *  the chunk holding its key passes. GATHERED: before ring step 0 every rank
 *  receives copies of the K/V rows of all verticals (an all-gather); the bar
 *  work of a query block is then done by its own rank against those copies,
 *  spread evenly over the W steps (docs/BALANCE.md, "bars gathered"), and
 *  the ring steps compute only listed key blocks. Both compute the same
 *  (query, key) pairs exactly once. */
typedef enum mtrain_bars_mode {
  MTRAIN_BARS_IN_RING = 0,
  MTRAIN_BARS_GATHERED = 1,
} mtrain_bars_mode_t;

/** "in_ring" or "gathered"; "unknown" otherwise. */
const char *mtrain_bars_mode_name(mtrain_bars_mode_t mode);

/** A layout: for each rank its global G-blocks in increasing order. Opaque,
 *  immutable, safe to read from several threads. */
typedef struct mtrain_layout mtrain_layout_t;

/** What the balanced layout is chosen from (ignored by the other kinds).
 *  `patterns` is a representative workload, one pattern per attention call
 *  (one per layer): all with the layout's seq_len and granularity; they are
 *  only read during mtrain_layout_create. With no patterns the balanced
 *  layout is the default design (striped blocks, bars gathered) without a
 *  search. `ranks_per_node` picks the schedule the choice optimises
 *  (0 or world: the flat ring; a proper divisor of world: hierarchical).
 *  Initialise with MTRAIN_BALANCE_OPTIONS_INIT. */
typedef struct mtrain_balance_options {
  const mtrain_pattern_t *const *patterns;
  int32_t num_patterns;
  int32_t ranks_per_node;
} mtrain_balance_options_t;

#define MTRAIN_BALANCE_OPTIONS_INIT                                                                \
  { NULL, 0, 0 }

/** Creates a layout of `seq_len` tokens in blocks of `granularity` tokens
 *  over `world` ranks (seq_len >= 1, granularity >= 1, world >= 1). The
 *  sequence is padded at its end to a multiple of the kind's unit (see the
 *  top of this file); every rank gets the same number of blocks. `balance`
 *  is read only for MTRAIN_LAYOUT_BALANCED and may be NULL. The caller
 *  destroys the result. */
mtrain_status_t mtrain_layout_create(mtrain_layout_kind_t kind, int64_t seq_len,
                                     int32_t granularity, int32_t world,
                                     const mtrain_balance_options_t *balance,
                                     mtrain_layout_t **out);
void mtrain_layout_destroy(mtrain_layout_t *layout);

mtrain_layout_kind_t mtrain_layout_kind(const mtrain_layout_t *layout);
/** The design a layout uses: its kind's name, or for balanced the candidate
 *  the cost model chose ("striped+gathered", "snake+gathered", ...). */
const char *mtrain_layout_variant(const mtrain_layout_t *layout);
/** Where the attention driver must compute bars for this layout
 *  (MTRAIN_BARS_IN_RING for contiguous, zigzag and striped). */
mtrain_bars_mode_t mtrain_layout_bars_mode(const mtrain_layout_t *layout);
int64_t mtrain_layout_seq_len(const mtrain_layout_t *layout);
int32_t mtrain_layout_granularity(const mtrain_layout_t *layout);
int32_t mtrain_layout_world(const mtrain_layout_t *layout);
/** Padded length: the number of token slots over all ranks (>= seq_len). */
int64_t mtrain_layout_padded_len(const mtrain_layout_t *layout);
/** Blocks over all ranks, padding included (padded_len / G). */
int64_t mtrain_layout_num_blocks(const mtrain_layout_t *layout);
/** Blocks holding tokens of the sequence, ceil(seq_len / G); blocks with a
 *  global id at or beyond this are padding. */
int64_t mtrain_layout_num_seq_blocks(const mtrain_layout_t *layout);
/** Blocks of one rank (0 for a rank out of range). */
int32_t mtrain_layout_rank_num_blocks(const mtrain_layout_t *layout, int32_t rank);
/** Token slots of one rank, rank_num_blocks * G (padding included): the
 *  first dimension of that rank's permuted tensors. */
int64_t mtrain_layout_local_tokens(const mtrain_layout_t *layout, int32_t rank);
/** Borrowed, strictly increasing global block ids of a rank's local blocks
 *  (local block lb is global block blocks[lb]); NULL for a rank out of
 *  range. Valid until the layout is destroyed. */
const int64_t *mtrain_layout_rank_blocks(const mtrain_layout_t *layout, int32_t rank);
/** Owner rank and local block index of a global block (padding included). */
mtrain_status_t mtrain_layout_block_owner(const mtrain_layout_t *layout, int64_t block,
                                          int32_t *rank, int32_t *local_block);
/** Where global token position `token` (0 <= token < padded_len; positions
 *  >= seq_len are padding slots) lives: rank and local token position. */
mtrain_status_t mtrain_layout_global_to_local(const mtrain_layout_t *layout, int64_t token,
                                              int32_t *rank, int64_t *local);
/** The inverse: the global position of local token `local` of `rank`
 *  (a result >= seq_len is a padding slot). */
mtrain_status_t mtrain_layout_local_to_global(const mtrain_layout_t *layout, int32_t rank,
                                              int64_t local, int64_t *token);
/** The gather index of a rank, for the permutation: writes
 *  mtrain_layout_local_tokens(layout, rank) global positions into `global`
 *  (local token i of the rank is global token global[i]; values >= seq_len
 *  are padding slots, to be zero-filled and never read back). */
mtrain_status_t mtrain_layout_rank_token_index(const mtrain_layout_t *layout, int32_t rank,
                                               int64_t *global);

/** The permutation (SPEC.md section 3) as a backend operation on the
 *  context's backend memory: gathers `rank`'s token slots of a whole-sequence
 *  tensor `full` [seq_len, ...] into `local` [local tokens, ...] (padding
 *  slots zero). Any dtype; both tensors of one dtype and the same trailing
 *  shape. Local (not collective). */
mtrain_status_t mtrain_layout_permute(mtrain_context_t *ctx, const mtrain_layout_t *layout,
                                      int32_t rank, const mtrain_tensor_t *full,
                                      mtrain_tensor_t *local);
/** The inverse: writes `rank`'s local rows back to their global positions of
 *  `full`; padding slots are dropped; rows of other ranks are left alone. */
mtrain_status_t mtrain_layout_unpermute(mtrain_context_t *ctx, const mtrain_layout_t *layout,
                                        int32_t rank, const mtrain_tensor_t *local,
                                        mtrain_tensor_t *full);

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
mtrain_status_t mtrain_pattern_from_budgets(const mtrain_budgets_t *budgets, int32_t layer,
                                            int64_t seq_len, int32_t granularity,
                                            const mtrain_position_model_t *model,
                                            mtrain_pattern_t **out);
/** The verticals and slashes the position model gives one budget (for
 *  layer/head seeding), after scaling and clamping: *v and *s. */
mtrain_status_t mtrain_position_model_counts(const mtrain_head_budget_t *budget, int64_t seq_len,
                                             int32_t granularity,
                                             const mtrain_position_model_t *model, int64_t *v,
                                             int64_t *s);

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
double mtrain_work_of(const mtrain_work_counts_t *counts, int32_t granularity);

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
mtrain_status_t mtrain_cost_evaluate(const mtrain_layout_t *layout,
                                     const mtrain_pattern_t *const *patterns, int32_t num_patterns,
                                     const mtrain_cost_options_t *options, mtrain_cost_t **out);
void mtrain_cost_destroy(mtrain_cost_t *cost);

int32_t mtrain_cost_world(const mtrain_cost_t *cost);
int32_t mtrain_cost_ranks_per_node(const mtrain_cost_t *cost);
int32_t mtrain_cost_num_layers(const mtrain_cost_t *cost);
/** Heads over all layers; head index = heads of earlier layers + head. */
int32_t mtrain_cost_num_heads(const mtrain_cost_t *cost);
mtrain_bars_mode_t mtrain_cost_bars_mode(const mtrain_cost_t *cost);
/** Whole-model figures of a ring schedule. */
mtrain_status_t mtrain_cost_metrics(const mtrain_cost_t *cost, mtrain_ring_kind_t ring,
                                    mtrain_cost_metrics_t *out);
/** Counts of (rank, step) summed over heads of one layer, or over all
 *  layers when layer == -1. */
mtrain_status_t mtrain_cost_counts(const mtrain_cost_t *cost, mtrain_ring_kind_t ring,
                                   int32_t layer, int32_t rank, int32_t step,
                                   mtrain_work_counts_t *out);
/** Work of (rank, step) of one layer, or of the whole model (layer == -1);
 *  0 for arguments out of range. */
double mtrain_cost_work(const mtrain_cost_t *cost, mtrain_ring_kind_t ring, int32_t layer,
                        int32_t rank, int32_t step);
/** Ring-sync slowdown of one head (0 for an index out of range). */
double mtrain_cost_head_ring_sync(const mtrain_cost_t *cost, mtrain_ring_kind_t ring, int32_t head);
/** Worker imbalance (max/mean of total work over ranks) of one head. */
double mtrain_cost_head_worker_imbalance(const mtrain_cost_t *cost, int32_t head);
/** Ring-sync slowdown of one layer. */
double mtrain_cost_layer_ring_sync(const mtrain_cost_t *cost, mtrain_ring_kind_t ring,
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
mtrain_status_t mtrain_time_predict(const mtrain_cost_t *cost, const mtrain_layout_t *layout,
                                    const mtrain_pattern_t *const *patterns, int32_t num_patterns,
                                    const mtrain_time_params_t *params,
                                    mtrain_time_prediction_t out[2]);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_LAYOUT_H */
