/* mtrain_block_cache.h: a cache of block selections across steps
 * (docs/PATTERNS.md "Pattern cache"). AdaSpa-style training reuses one block
 * search for several steps: the cache keeps the selected pattern of every
 * layer and selects anew every `refresh` steps of that layer.
 *
 * Steps. Each call of mtrain_block_cache_select (or _select_ring) for a
 * layer is one step of that layer. The call selects (SPEC.md section 9, with
 * the caller's q, k, lse and options) when the layer has no pattern yet,
 * when `refresh` steps have passed since its last selection (steps 0,
 * refresh, 2 refresh, ... of an undisturbed schedule), after
 * mtrain_block_cache_invalidate, or when the call's sequence length, head
 * count, granularity or options differ from those of the cached selection
 * (the schedule then restarts from this call). Otherwise it returns the
 * cached pattern without reading q, k or lse. mtrain_block_cache_due says
 * beforehand whether the schedule makes the next call select, so that the
 * caller computes the LSE the precise method needs only on those steps.
 *
 * Ownership. The cache owns the patterns: the pointer returned is valid until
 * the next select call for the same layer, mtrain_block_cache_invalidate of
 * that layer, or mtrain_block_cache_destroy; the caller does not destroy it
 * and does not keep it longer. The cache holds no context and no
 * tensor: each call uses the context it is given.
 *
 * Threading. A cache is not thread-safe: one thread at a time per cache
 * (different caches are independent). The distributed form is collective,
 * like mtrain_pattern_select_blocks_ring: every rank keeps its own cache
 * with the same layers and refresh and makes the same calls, so the ranks
 * select on the same steps and hold bitwise the same patterns.
 *
 * A failed call leaves the layer as it was (its pattern and its step count). */
#ifndef MTRAIN_BLOCK_CACHE_H
#define MTRAIN_BLOCK_CACHE_H

#include "mtrain/mtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

struct mtrain_layout;
typedef struct mtrain_block_cache mtrain_block_cache_t;

/** Creates a cache of `num_layers` layers (1 .. 2^20), each re-selected
 *  every `refresh` steps (1 .. 2^30; 1: every step selects). */
MTRAIN_API mtrain_status_t mtrain_block_cache_create(int32_t num_layers, int32_t refresh,
                                                     mtrain_block_cache_t **out);
/** Frees the cache and every pattern it holds. NULL is a no-op. */
MTRAIN_API void mtrain_block_cache_destroy(mtrain_block_cache_t *cache);

/** One step of `layer` on one rank (world 1): the cached pattern, or a new
 *  selection by mtrain_pattern_select_blocks(ctx, q, k, lse, options,
 *  report) when one is due (see above). *pattern: owned by the cache.
 *  *age (may be NULL): 0 when this call selected, else the steps since the
 *  selection. `report` is written only when this call selects. */
MTRAIN_API mtrain_status_t mtrain_block_cache_select(
    mtrain_block_cache_t *cache, int32_t layer, mtrain_context_t *ctx, const mtrain_tensor_t *q,
    const mtrain_tensor_t *k, const mtrain_tensor_t *lse, const mtrain_block_options_t *options,
    const mtrain_block_report_t *report, const mtrain_pattern_t **pattern, int32_t *age);

/** The same with mtrain_pattern_select_blocks_ring (W ranks, collective:
 *  every rank calls it for the same layer on the same step). */
MTRAIN_API mtrain_status_t mtrain_block_cache_select_ring(
    mtrain_block_cache_t *cache, int32_t layer, mtrain_context_t *ctx,
    const struct mtrain_layout *layout, const mtrain_tensor_t *q, const mtrain_tensor_t *k,
    const mtrain_tensor_t *lse, const mtrain_block_options_t *options,
    const mtrain_block_report_t *report, const mtrain_pattern_t **pattern, int32_t *age);

/** *due = 1 when the schedule makes the next call for `layer` select (no
 *  pattern yet, `refresh` steps passed, or invalidated), else 0. A call
 *  whose shape or options differ from the cached selection's selects too. */
MTRAIN_API mtrain_status_t mtrain_block_cache_due(const mtrain_block_cache_t *cache, int32_t layer,
                                                  int *due);

/** Drops the pattern of `layer` (-1: of every layer): the next call selects. */
MTRAIN_API mtrain_status_t mtrain_block_cache_invalidate(mtrain_block_cache_t *cache,
                                                         int32_t layer);

/** Counts of `layer`: steps (successful select calls) and selections. */
MTRAIN_API mtrain_status_t mtrain_block_cache_counts(const mtrain_block_cache_t *cache,
                                                     int32_t layer, int64_t *steps,
                                                     int64_t *selections);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_BLOCK_CACHE_H */
