/* reuse_cache.h (private): the blocks a context's calls gave back, kept for
 * the next call. mtrain_be_free puts a block here instead of returning it to
 * the backend, and mtrain_be_alloc takes a kept block of the same size (up to
 * an eighth larger) before asking the backend: a training loop that repeats
 * its shapes then touches no fresh pages on the CPU backends (a fresh 64 MiB
 * accumulator cost 11-13% of a cpu forward in page faults) and calls no
 * cudaMalloc/cudaFree, which waits for the device, on "cuda". The blocks are
 * the backend's (never the caller's allocator's: with one set, nothing is
 * kept). Like the context, used by one thread at a time: no locking. */
#ifndef MTRAIN_CORE_REUSE_CACHE_H
#define MTRAIN_CORE_REUSE_CACHE_H

#include <stddef.h>

/** One kept block and the bytes it was first requested with. */
typedef struct mtrain_kept_block {
  void *ptr;
  size_t bytes;
} mtrain_kept_block_t;

/** The kept blocks of one context, oldest first. */
typedef struct mtrain_reuse_cache {
  mtrain_kept_block_t *blocks; /* [count], capacity cap */
  size_t count, cap;
  size_t bytes; /* sum of the kept blocks' bytes */
} mtrain_reuse_cache_t;

/** Takes the kept block that fits `bytes` best (its size in [bytes, bytes +
 *  bytes / 8]); NULL when none does. *block_bytes gets the block's size. */
void *mtrain_reuse_take(mtrain_reuse_cache_t *c, size_t bytes, size_t *block_bytes);
/** Keeps a block; 0 on success, 1 when the cache's own list cannot grow (the
 *  caller then frees the block itself). */
int mtrain_reuse_put(mtrain_reuse_cache_t *c, void *ptr, size_t bytes);
/** Removes and returns the oldest kept block (NULL when empty). */
void *mtrain_reuse_pop_oldest(mtrain_reuse_cache_t *c, size_t *block_bytes);
/** Frees the list itself; the blocks must be taken out first. */
void mtrain_reuse_clear(mtrain_reuse_cache_t *c);

#endif /* MTRAIN_CORE_REUSE_CACHE_H */
