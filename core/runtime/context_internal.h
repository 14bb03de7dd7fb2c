/* context_internal.h (private): the context, shared by the modules that
 * dispatch to its backend and communicator. */
#ifndef MTRAIN_CORE_CONTEXT_INTERNAL_H
#define MTRAIN_CORE_CONTEXT_INTERNAL_H

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_backend.h"
#include "mtrain/mtrain_comm.h"

#include "core/runtime/memory_stats.h"
#include "core/runtime/reuse_cache.h"

struct mtrain_context {
  mtrain_config_t config; /* effective config; config.backend points at backend_name */
  char backend_name[64];
  const mtrain_backend_ops_t *backend;
  void *backend_state;
  mtrain_comm_t *comm;            /* borrowed, or own_comm */
  mtrain_comm_t *own_comm;        /* the self communicator when the caller gave none */
  mtrain_call_stats_t last_stats; /* timing of the last attention call */
  mtrain_memory_tracker_t memory; /* backend bytes allocated through it (memory_stats.c) */
  mtrain_allocator_t allocator;   /* the caller's allocator; alloc NULL: the backend's own */
  mtrain_reuse_cache_t kept;      /* freed backend blocks kept for reuse (reuse_cache.h) */
  size_t reuse_limit;             /* most bytes kept, or MTRAIN_REUSE_LIMIT_PEAK */
  int64_t reused_blocks;          /* allocations served from kept blocks */
  /* host memory the estimate reuses from call to call for the scores it
   * brings back (estimate.c): grow-only, freed with the context, so that a
   * call at a length seen before touches no fresh pages */
  void *estimate_host;
  size_t estimate_host_bytes;
};

/** Applies MTRAIN_* environment overrides to a config (the environment is
 *  read once per process). Fails naming the variable on a malformed value. */
mtrain_status_t mtrain_config_apply_env(mtrain_config_t *config);
/** The reuse limit of new contexts: MTRAIN_REUSE_LIMIT (bytes, or "peak")
 *  from the environment, else MTRAIN_REUSE_LIMIT_PEAK. Fails naming the
 *  variable on a malformed value. */
mtrain_status_t mtrain_env_reuse_limit(size_t *out);
/** Seconds on a monotonic clock. */
double mtrain_now(void);

/** Validates a config (api_version, granularity, threads). */
mtrain_status_t mtrain_config_validate(const mtrain_config_t *config);

#endif /* MTRAIN_CORE_CONTEXT_INTERNAL_H */
