/* mtrain_layout.h: layouts and the permutation (SPEC.md section 3) and the
 * ring schedules (section 5). The models that judge layouts (cost, time and
 * position models) are in mtrain_balance.h. docs/BALANCE.md explains the
 * designs and shows measured figures.
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
MTRAIN_API const char *mtrain_ring_kind_name(mtrain_ring_kind_t kind);

/** The rank whose K/V chunk `rank` holds at ring step `step` (0..world-1).
 *  ranks_per_node == 0 (or == world, or == 1) is the flat ring: source
 *  (rank - step) mod world. Otherwise the hierarchical ring with
 *  L = ranks_per_node (a divisor of world), n = world / L nodes,
 *  rank = node * L + local and step = o * L + i (outer step o, inner step i):
 *  source ((node - o) mod n) * L + ((local - i) mod L). */
MTRAIN_API mtrain_status_t mtrain_ring_source(int32_t world, int32_t ranks_per_node, int32_t rank,
                                              int32_t step, int32_t *src);
/** The inverse: the step at which `rank` holds the chunk of `src`. */
MTRAIN_API mtrain_status_t mtrain_ring_step_of(int32_t world, int32_t ranks_per_node, int32_t rank,
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
MTRAIN_API const char *mtrain_layout_kind_name(mtrain_layout_kind_t kind);
/** Parses the names above; MTRAIN_ERR_INVALID_ARGUMENT naming `name` else. */
MTRAIN_API mtrain_status_t mtrain_layout_kind_parse(const char *name, mtrain_layout_kind_t *out);

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
MTRAIN_API const char *mtrain_bars_mode_name(mtrain_bars_mode_t mode);

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
MTRAIN_API mtrain_status_t mtrain_layout_create(mtrain_layout_kind_t kind, int64_t seq_len,
                                                int32_t granularity, int32_t world,
                                                const mtrain_balance_options_t *balance,
                                                mtrain_layout_t **out);
MTRAIN_API void mtrain_layout_destroy(mtrain_layout_t *layout);

MTRAIN_API mtrain_layout_kind_t mtrain_layout_kind(const mtrain_layout_t *layout);
/** The design a layout uses: its kind's name, or for balanced the candidate
 *  the cost model chose ("striped+gathered", "snake+gathered", ...). */
MTRAIN_API const char *mtrain_layout_variant(const mtrain_layout_t *layout);
/** Where the attention driver must compute bars for this layout
 *  (MTRAIN_BARS_IN_RING for contiguous, zigzag and striped). */
MTRAIN_API mtrain_bars_mode_t mtrain_layout_bars_mode(const mtrain_layout_t *layout);
MTRAIN_API int64_t mtrain_layout_seq_len(const mtrain_layout_t *layout);
MTRAIN_API int32_t mtrain_layout_granularity(const mtrain_layout_t *layout);
MTRAIN_API int32_t mtrain_layout_world(const mtrain_layout_t *layout);
/** Padded length: the number of token slots over all ranks (>= seq_len). */
MTRAIN_API int64_t mtrain_layout_padded_len(const mtrain_layout_t *layout);
/** Blocks over all ranks, padding included (padded_len / G). */
MTRAIN_API int64_t mtrain_layout_num_blocks(const mtrain_layout_t *layout);
/** Blocks holding tokens of the sequence, ceil(seq_len / G); blocks with a
 *  global id at or beyond this are padding. */
MTRAIN_API int64_t mtrain_layout_num_seq_blocks(const mtrain_layout_t *layout);
/** Blocks of one rank (0 for a rank out of range). */
MTRAIN_API int32_t mtrain_layout_rank_num_blocks(const mtrain_layout_t *layout, int32_t rank);
/** Token slots of one rank, rank_num_blocks * G (padding included): the
 *  first dimension of that rank's permuted tensors. */
MTRAIN_API int64_t mtrain_layout_local_tokens(const mtrain_layout_t *layout, int32_t rank);
/** Borrowed, strictly increasing global block ids of a rank's local blocks
 *  (local block lb is global block blocks[lb]); NULL for a rank out of
 *  range. Valid until the layout is destroyed. */
MTRAIN_API const int64_t *mtrain_layout_rank_blocks(const mtrain_layout_t *layout, int32_t rank);
/** Owner rank and local block index of a global block (padding included). */
MTRAIN_API mtrain_status_t mtrain_layout_block_owner(const mtrain_layout_t *layout, int64_t block,
                                                     int32_t *rank, int32_t *local_block);
/** Where global token position `token` (0 <= token < padded_len; positions
 *  >= seq_len are padding slots) lives: rank and local token position. */
MTRAIN_API mtrain_status_t mtrain_layout_global_to_local(const mtrain_layout_t *layout,
                                                         int64_t token, int32_t *rank,
                                                         int64_t *local);
/** The inverse: the global position of local token `local` of `rank`
 *  (a result >= seq_len is a padding slot). */
MTRAIN_API mtrain_status_t mtrain_layout_local_to_global(const mtrain_layout_t *layout,
                                                         int32_t rank, int64_t local,
                                                         int64_t *token);
/** The gather index of a rank, for the permutation: writes
 *  mtrain_layout_local_tokens(layout, rank) global positions into `global`
 *  (local token i of the rank is global token global[i]; values >= seq_len
 *  are padding slots, to be zero-filled and never read back). */
MTRAIN_API mtrain_status_t mtrain_layout_rank_token_index(const mtrain_layout_t *layout,
                                                          int32_t rank, int64_t *global);

/** The permutation (SPEC.md section 3) as a backend operation on the
 *  context's backend memory: gathers `rank`'s token slots of a whole-sequence
 *  tensor `full` [seq_len, ...] into `local` [local tokens, ...] (padding
 *  slots zero). Any dtype; both tensors of one dtype and the same trailing
 *  shape. Local (not collective). */
MTRAIN_API mtrain_status_t mtrain_layout_permute(mtrain_context_t *ctx,
                                                 const mtrain_layout_t *layout, int32_t rank,
                                                 const mtrain_tensor_t *full,
                                                 mtrain_tensor_t *local);
/** The inverse: writes `rank`'s local rows back to their global positions of
 *  `full`; padding slots are dropped; rows of other ranks are left alone. */
MTRAIN_API mtrain_status_t mtrain_layout_unpermute(mtrain_context_t *ctx,
                                                   const mtrain_layout_t *layout, int32_t rank,
                                                   const mtrain_tensor_t *local,
                                                   mtrain_tensor_t *full);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_LAYOUT_H */
