/* memory_stats.h (private): accounting of the memory a context takes from
 * its backend. Every backend allocation of core/ goes through mtrain_be_alloc
 * / mtrain_be_free (backend.h), which record the live blocks with their sizes
 * here and so keep the current and peak bytes of the context
 * (docs/MEMORY.md). The public query is mtrain_context_memory (mtrain.h);
 * the bound the peak is checked against is in memory_bound.c. */
#ifndef MTRAIN_CORE_MEMORY_STATS_H
#define MTRAIN_CORE_MEMORY_STATS_H

#include <stddef.h>
#include <stdint.h>

#include "mtrain/mtrain.h"

/** One live backend block, the bytes it was requested with and the bytes it
 *  holds (more when a kept block a little larger was reused: reuse_cache.h). */
typedef struct mtrain_memory_block {
  void *ptr;
  size_t bytes;
  size_t held;
} mtrain_memory_block_t;

/** The accounting of one context (a member of struct mtrain_context). Like
 *  the context, used by one thread at a time: no locking. */
typedef struct mtrain_memory_tracker {
  mtrain_memory_block_t *live; /* [num_live], capacity cap */
  size_t num_live, cap;
  size_t current, peak; /* requested bytes of the live blocks; the most since the last reset */
  size_t highest;       /* the most requested bytes live at once since creation (never reset) */
  int64_t allocations;  /* successful allocations since the context was created */
} mtrain_memory_tracker_t;

/** Makes room to record one more block; 0 on success, 1 when out of host
 *  memory (nothing changed). */
int mtrain_memory_tracker_reserve(mtrain_memory_tracker_t *t);
/** Records a new live block of `bytes` requested, `held` >= bytes held
 *  (after a successful reserve). */
void mtrain_memory_tracker_add(mtrain_memory_tracker_t *t, void *ptr, size_t bytes, size_t held);
/** Forgets a live block and returns its requested bytes, its held bytes in
 *  *held (0 for both, a no-op, for a pointer it does not hold). */
size_t mtrain_memory_tracker_remove(mtrain_memory_tracker_t *t, void *ptr, size_t *held);
/** Frees the accounting itself; the blocks must be freed already. */
void mtrain_memory_tracker_clear(mtrain_memory_tracker_t *t);

#endif /* MTRAIN_CORE_MEMORY_STATS_H */
