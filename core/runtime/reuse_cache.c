/* reuse_cache.c: the list of blocks a context keeps between calls
 * (reuse_cache.h); the policy (when to keep, how much) is backend.c's. */
#include "core/runtime/reuse_cache.h"

#include <stdlib.h>
#include <string.h>

void *mtrain_reuse_take(mtrain_reuse_cache_t *c, size_t bytes, size_t *block_bytes) {
  size_t best = c->count;
  for (size_t i = 0; i < c->count; i++) {
    const size_t b = c->blocks[i].bytes;
    if (b < bytes || b - bytes > bytes / 8) continue;
    if (best == c->count || b < c->blocks[best].bytes) best = i;
  }
  if (best == c->count) return NULL;
  void *p = c->blocks[best].ptr;
  *block_bytes = c->blocks[best].bytes;
  c->bytes -= c->blocks[best].bytes;
  memmove(&c->blocks[best], &c->blocks[best + 1], (c->count - best - 1) * sizeof *c->blocks);
  c->count--;
  return p;
}

int mtrain_reuse_put(mtrain_reuse_cache_t *c, void *ptr, size_t bytes) {
  if (c->count == c->cap) {
    const size_t cap = c->cap ? 2 * c->cap : 16;
    mtrain_kept_block_t *b = realloc(c->blocks, cap * sizeof *b);
    if (!b) return 1;
    c->blocks = b;
    c->cap = cap;
  }
  c->blocks[c->count].ptr = ptr;
  c->blocks[c->count].bytes = bytes;
  c->count++;
  c->bytes += bytes;
  return 0;
}

void *mtrain_reuse_pop_oldest(mtrain_reuse_cache_t *c, size_t *block_bytes) {
  if (c->count == 0) return NULL;
  void *p = c->blocks[0].ptr;
  *block_bytes = c->blocks[0].bytes;
  c->bytes -= c->blocks[0].bytes;
  memmove(&c->blocks[0], &c->blocks[1], (c->count - 1) * sizeof *c->blocks);
  c->count--;
  return p;
}

void mtrain_reuse_clear(mtrain_reuse_cache_t *c) {
  free(c->blocks);
  memset(c, 0, sizeof *c);
}
