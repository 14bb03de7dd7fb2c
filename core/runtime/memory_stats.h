/* memory_stats.h (private): accounting of the memory a context takes from
 * its backend. Every backend allocation of core/ goes through
 * mtrain_backend_alloc / mtrain_backend_free, which keep the live blocks
 * with their sizes and the current and peak bytes of the context
 * (docs/MEMORY.md). The public query is mtrain_context_memory (mtrain.h);
 * the bound the peak is checked against is in memory_bound.c. */
#ifndef MTRAIN_CORE_MEMORY_STATS_H
#define MTRAIN_CORE_MEMORY_STATS_H

#include <stddef.h>
#include <stdint.h>

#include "mtrain/mtrain.h"

/** One live backend block and the bytes it was requested with. */
typedef struct mtrain_memory_block {
  void *ptr;
  size_t bytes;
} mtrain_memory_block_t;

/** The accounting of one context (a member of struct mtrain_context). Like
 *  the context, used by one thread at a time: no locking. */
typedef struct mtrain_memory_tracker {
  mtrain_memory_block_t *live; /* [num_live], capacity cap */
  size_t num_live, cap;
  size_t current, peak; /* requested bytes of the live blocks; the most since the last reset */
  int64_t allocations;  /* successful allocations since the context was created */
} mtrain_memory_tracker_t;

/** Allocates `bytes` of backend memory through ctx's backend table and
 *  counts them (the requested size: a backend may round up). On failure
 *  nothing is allocated or counted and the backend's status is returned. */
mtrain_status_t mtrain_backend_alloc(mtrain_context_t *ctx, size_t bytes, void **ptr);
/** Frees a block from mtrain_backend_alloc and uncounts it. NULL is a no-op. */
void mtrain_backend_free(mtrain_context_t *ctx, void *ptr);
/** Frees the blocks still live (none, unless an allocation leaked) and the
 *  accounting itself; called by mtrain_context_destroy before the backend's
 *  fini. */
void mtrain_memory_tracker_release(mtrain_context_t *ctx);

#endif /* MTRAIN_CORE_MEMORY_STATS_H */
