/* context.c: creation and destruction of a context: effective configuration,
 * backend lookup, the check of the backend and communicator tables (their
 * api_version and required slots, backend.c), backend initialisation, the
 * communicator binding, and (on several ranks) the collective check that
 * every rank uses the same configuration. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "mtrain/mtrain_error.h"

/* The configuration fields every rank must agree on, in a fixed layout. */
typedef struct config_digest {
  int64_t api_version, granularity, deterministic, check_inputs;
  double softmax_scale;
  char backend[64];
} config_digest_t;

/* Collective: compares this rank's configuration with every other rank's
 * and fails on all ranks, naming the field and two ranks, if any differs. */
static mtrain_status_t check_config_agrees(mtrain_context_t *ctx) {
  const int size = mtrain_comm_size(ctx->comm);
  if (size <= 1) return MTRAIN_SUCCESS;
  config_digest_t mine;
  memset(&mine, 0, sizeof mine);
  mine.api_version = ctx->config.api_version;
  mine.granularity = ctx->config.granularity;
  mine.deterministic = ctx->config.deterministic;
  mine.check_inputs = ctx->config.check_inputs;
  mine.softmax_scale = ctx->config.softmax_scale;
  snprintf(mine.backend, sizeof mine.backend, "%s", ctx->backend_name);
  config_digest_t *all = calloc((size_t)size, sizeof *all);
  if (!all) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "context: out of memory");
  mtrain_status_t st = mtrain_cm_allgather(ctx, &mine, all, sizeof mine);
  for (int r = 1; st == MTRAIN_SUCCESS && r < size; r++) {
    const config_digest_t *a = &all[0], *b = &all[r];
    const char *field = a->api_version != b->api_version       ? "api_version"
                        : a->granularity != b->granularity     ? "granularity"
                        : a->deterministic != b->deterministic ? "deterministic"
                        : a->check_inputs != b->check_inputs   ? "check_inputs"
                        : a->softmax_scale != b->softmax_scale ? "softmax_scale"
                        : strcmp(a->backend, b->backend)       ? "backend"
                                                               : NULL;
    if (field)
      st = mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "context: config.%s differs between rank 0 and rank %d (granularity %lld "
                        "vs %lld, backend '%s' vs '%s'); every rank must use the same "
                        "configuration",
                        field, r, (long long)a->granularity, (long long)b->granularity, a->backend,
                        b->backend);
  }
  free(all);
  return st;
}

static const char *space_name(mtrain_memory_space_t space) {
  return space == MTRAIN_MEMORY_HOST ? "host" : space == MTRAIN_MEMORY_DEVICE ? "device" : "any";
}

/* The ring moves backend memory through the communicator: its point-to-point
 * buffers must live where the backend keeps tensors (the tables say where),
 * and its transfers are ordered after the backend's stream when it has one.
 * One rank moves nothing, so any communicator serves it. */
static mtrain_status_t bind_comm_to_backend(mtrain_context_t *ctx) {
  const mtrain_memory_space_t be = mtrain_be_memory_space(ctx), cm = mtrain_cm_memory_space(ctx);
  if (cm != MTRAIN_MEMORY_ANY && cm != be && mtrain_comm_size(ctx->comm) > 1)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "context: backend '%s' keeps tensors in %s memory but the '%s' "
                        "communicator moves %s memory; pair it with a communicator for %s "
                        "memory (the cuda backend with nccl, the cpu backends with mpi)",
                        ctx->backend_name, space_name(be), mtrain_cm_name(ctx), space_name(cm),
                        space_name(be));
  if (cm != MTRAIN_MEMORY_ANY && cm != be)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "context: the '%s' communicator moves %s memory and cannot serve backend "
                        "'%s', which keeps tensors in %s memory",
                        mtrain_cm_name(ctx), space_name(cm), ctx->backend_name, space_name(be));
  return mtrain_context_bind_stream(ctx);
}

mtrain_status_t mtrain_context_bind_stream(mtrain_context_t *ctx) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  if (!ctx->comm || !ctx->backend || !mtrain_be_has_data_stream(ctx)) return MTRAIN_SUCCESS;
  return mtrain_cm_set_data_stream(ctx, mtrain_be_data_stream(ctx));
}

void *mtrain_context_backend_state(const mtrain_context_t *ctx, const mtrain_backend_ops_t *ops) {
  return ctx && ops && ctx->backend == ops ? ctx->backend_state : NULL;
}

mtrain_status_t mtrain_context_create(const mtrain_config_t *config, mtrain_comm_t *comm,
                                      mtrain_context_t **out) {
  MTRAIN_CHECK_NOT_NULL(config);
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_status_t st = MTRAIN_SUCCESS;
  mtrain_context_t *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "context: out of memory");
  ctx->config = *config;
  MTRAIN_TRY(mtrain_config_validate(&ctx->config));
  MTRAIN_TRY(mtrain_config_apply_env(&ctx->config));
  MTRAIN_TRY(mtrain_config_validate(&ctx->config));
  MTRAIN_TRY(mtrain_env_reuse_limit(&ctx->reuse_limit));
  MTRAIN_FAIL_IF(strlen(ctx->config.backend) >= sizeof ctx->backend_name, MTRAIN_ERR_INVALID_CONFIG,
                 "config.backend name too long");
  strcpy(ctx->backend_name, ctx->config.backend);
  ctx->config.backend = ctx->backend_name;
  ctx->backend = mtrain_backend_find(ctx->backend_name);
  if (!ctx->backend) {
    const char *names[16];
    int n = mtrain_backend_list(names, 16);
    char list[256] = "";
    for (int i = 0; i < n && i < 16; i++) {
      strncat(list, i ? ", " : "", sizeof list - strlen(list) - 1);
      strncat(list, names[i], sizeof list - strlen(list) - 1);
    }
    st = mtrain_error(MTRAIN_ERR_BACKEND_NOT_FOUND,
                      "backend '%s' is not compiled into this build (available: %s)",
                      ctx->backend_name, list);
    goto cleanup;
  }
  /* the tables are checked here once, so that the wrappers of backend.c can
   * call every required slot without a check */
  MTRAIN_TRY(mtrain_backend_table_check(ctx->backend));
  if (comm) {
    MTRAIN_FAIL_IF(!comm->ops, MTRAIN_ERR_INVALID_ARGUMENT, "context: communicator has no table");
    MTRAIN_TRY(mtrain_comm_table_check(comm->ops));
  }
  MTRAIN_TRY(mtrain_be_init(ctx));
  if (comm) {
    ctx->comm = comm;
    MTRAIN_TRY(check_config_agrees(ctx));
    MTRAIN_TRY(bind_comm_to_backend(ctx));
  } else {
    MTRAIN_TRY(mtrain_comm_create_self(&ctx->own_comm));
    ctx->comm = ctx->own_comm;
  }
  *out = ctx;
  return MTRAIN_SUCCESS;
cleanup:
  mtrain_context_destroy(ctx);
  return st;
}

void mtrain_context_destroy(mtrain_context_t *ctx) {
  if (!ctx) return;
  mtrain_be_fini(ctx); /* frees leaked backend blocks, then the backend state */
  mtrain_comm_destroy(ctx->own_comm);
  free(ctx->estimate_host);
  free(ctx);
}

mtrain_status_t mtrain_context_set_allocator(mtrain_context_t *ctx,
                                             const mtrain_allocator_t *allocator) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  if (ctx->memory.num_live > 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "mtrain_context_set_allocator: %zu blocks of the context are live (an "
                        "attention or estimation call is running on it, or one failed without "
                        "cleaning up); set the allocator between calls",
                        ctx->memory.num_live);
  if (allocator && (!allocator->alloc || !allocator->free))
    return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                        "mtrain_context_set_allocator: allocator->%s is NULL (give both "
                        "functions, or a NULL allocator for the backend's own)",
                        !allocator->alloc ? "alloc" : "free");
  mtrain_be_release_kept(ctx); /* the kept blocks are the backend's */
  if (allocator)
    ctx->allocator = *allocator;
  else
    memset(&ctx->allocator, 0, sizeof ctx->allocator);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_context_set_reuse_limit(mtrain_context_t *ctx, size_t max_bytes) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  ctx->reuse_limit = max_bytes;
  mtrain_be_trim_kept(ctx);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_context_release_kept(mtrain_context_t *ctx) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  mtrain_be_release_kept(ctx);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_context_kept(const mtrain_context_t *ctx, size_t *kept_bytes,
                                    int64_t *reused_blocks) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  if (kept_bytes) *kept_bytes = ctx->kept.bytes;
  if (reused_blocks) *reused_blocks = ctx->reused_blocks;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_context_check_deferred(mtrain_context_t *ctx) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  return mtrain_be_deferred_poll(ctx, 1);
}

const mtrain_config_t *mtrain_context_config(const mtrain_context_t *ctx) {
  return ctx ? &ctx->config : NULL;
}

const char *mtrain_context_backend_name(const mtrain_context_t *ctx) {
  return ctx ? ctx->backend_name : "";
}

int mtrain_context_rank(const mtrain_context_t *ctx) {
  return ctx && ctx->comm ? mtrain_comm_rank(ctx->comm) : 0;
}

int mtrain_context_world(const mtrain_context_t *ctx) {
  return ctx && ctx->comm ? mtrain_comm_size(ctx->comm) : 1;
}

mtrain_status_t mtrain_context_last_stats(const mtrain_context_t *ctx, mtrain_call_stats_t *out) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(out);
  *out = ctx->last_stats;
  return MTRAIN_SUCCESS;
}

double mtrain_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
