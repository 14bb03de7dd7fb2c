/* memory_stats.c: the per-context accounting of backend memory (the live
 * blocks that mtrain_be_alloc and mtrain_be_free record, backend.c) and the
 * public queries: current and peak backend bytes, the peak reset, and the
 * process figures (peak RSS from getrusage, current RSS from
 * /proc/self/statm). What is and is not counted: docs/MEMORY.md. */
#include "core/runtime/memory_stats.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/runtime/context_internal.h"
#include "mtrain/mtrain_error.h"

int mtrain_memory_tracker_reserve(mtrain_memory_tracker_t *t) {
  if (t->num_live < t->cap) return 0;
  const size_t cap = t->cap ? 2 * t->cap : 16;
  mtrain_memory_block_t *grown = realloc(t->live, cap * sizeof *grown);
  if (!grown) return 1;
  t->live = grown;
  t->cap = cap;
  return 0;
}

void mtrain_memory_tracker_add(mtrain_memory_tracker_t *t, void *ptr, size_t bytes, size_t held) {
  t->live[t->num_live].ptr = ptr;
  t->live[t->num_live].bytes = bytes;
  t->live[t->num_live].held = held;
  t->num_live++;
  t->current += bytes;
  if (t->current > t->peak) t->peak = t->current;
  if (t->current > t->highest) t->highest = t->current;
  t->allocations++;
}

size_t mtrain_memory_tracker_remove(mtrain_memory_tracker_t *t, void *ptr, size_t *held) {
  /* blocks are mostly freed in reverse order of allocation: search from the end */
  *held = 0;
  for (size_t i = t->num_live; i-- > 0;) {
    if (t->live[i].ptr != ptr) continue;
    const size_t bytes = t->live[i].bytes;
    *held = t->live[i].held;
    t->current -= bytes;
    t->live[i] = t->live[--t->num_live];
    return bytes;
  }
  return 0;
}

void mtrain_memory_tracker_clear(mtrain_memory_tracker_t *t) {
  free(t->live);
  t->live = NULL;
  t->num_live = t->cap = t->current = 0;
}

/* Resident set of the process now, from /proc/self/statm (0 elsewhere). */
static size_t current_rss(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return 0;
  unsigned long long size = 0, resident = 0;
  const int n = fscanf(f, "%llu %llu", &size, &resident);
  fclose(f);
  const long page = sysconf(_SC_PAGESIZE);
  return n == 2 && page > 0 ? (size_t)resident * (size_t)page : 0;
}

mtrain_status_t mtrain_context_memory(const mtrain_context_t *ctx, mtrain_memory_stats_t *out) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_memory_stats_t s = {0};
  s.backend_current_bytes = ctx->memory.current;
  s.backend_peak_bytes = ctx->memory.peak;
  s.backend_live_blocks = (int64_t)ctx->memory.num_live;
  s.backend_allocations = ctx->memory.allocations;
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) == 0 && ru.ru_maxrss > 0)
    s.process_peak_rss_bytes = (size_t)ru.ru_maxrss * 1024; /* Linux: kilobytes */
  s.process_rss_bytes = current_rss();
  *out = s;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_context_reset_peak_memory(mtrain_context_t *ctx) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  ctx->memory.peak = ctx->memory.current;
  return MTRAIN_SUCCESS;
}
