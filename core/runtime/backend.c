/* backend.c: the checked wrappers around the backend and communicator
 * tables (backend.h): the only file of core/ that calls a table's slots.
 * The tables are checked once, at context creation; the wrappers of
 * optional slots answer for an absent slot. */
#include "core/runtime/backend.h"

#include "core/runtime/context_internal.h"
#include "mtrain/mtrain_error.h"

/* ---- table checks ------------------------------------------------------------ */

static const char *table_name(const char *name) { return name ? name : "(unnamed)"; }

static mtrain_status_t check_version(const char *kind, const char *name, int32_t version) {
  if (version == MTRAIN_API_VERSION) return MTRAIN_SUCCESS;
  return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                      "%s table '%s': api_version is %d but this mtrain is %d "
                      "(MTRAIN_API_VERSION); rebuild it against this mtrain's headers",
                      kind, table_name(name), (int)version, MTRAIN_API_VERSION);
}

static mtrain_status_t missing(const char *kind, const char *name, const char *slot) {
  return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                      "%s table '%s' (api_version %d): required slot '%s' is NULL", kind,
                      table_name(name), MTRAIN_API_VERSION, slot);
}

/* Fails naming the first NULL slot of the list. */
#define REQUIRE_SLOT(kind, ops, slot)                                                              \
  do {                                                                                             \
    if (!(ops)->slot) return missing(kind, (ops)->name, #slot);                                    \
  } while (0)

mtrain_status_t mtrain_backend_table_check(const mtrain_backend_ops_t *ops) {
  MTRAIN_CHECK_NOT_NULL(ops);
  const char *kind = "backend";
  mtrain_status_t st = check_version(kind, ops->name, ops->api_version);
  if (st) return st;
  REQUIRE_SLOT(kind, ops, name);
  if (ops->acc_dtype != MTRAIN_F32 && ops->acc_dtype != MTRAIN_F64)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "backend table '%s': acc_dtype is %s (%d), not fp32 or fp64", ops->name,
                        mtrain_dtype_name(ops->acc_dtype), (int)ops->acc_dtype);
  if (ops->memory_space != MTRAIN_MEMORY_HOST && ops->memory_space != MTRAIN_MEMORY_DEVICE)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "backend table '%s': memory_space is %d, not MTRAIN_MEMORY_HOST or "
                        "MTRAIN_MEMORY_DEVICE",
                        ops->name, (int)ops->memory_space);
  REQUIRE_SLOT(kind, ops, init);
  REQUIRE_SLOT(kind, ops, fini);
  REQUIRE_SLOT(kind, ops, supports);
  REQUIRE_SLOT(kind, ops, alloc);
  REQUIRE_SLOT(kind, ops, free);
  REQUIRE_SLOT(kind, ops, memset_zero);
  REQUIRE_SLOT(kind, ops, copy_to_host);
  REQUIRE_SLOT(kind, ops, copy_from_host);
  REQUIRE_SLOT(kind, ops, copy);
  REQUIRE_SLOT(kind, ops, add);
  REQUIRE_SLOT(kind, ops, permute);
  REQUIRE_SLOT(kind, ops, convert);
  REQUIRE_SLOT(kind, ops, find_nonfinite);
  REQUIRE_SLOT(kind, ops, attn_fwd_init);
  REQUIRE_SLOT(kind, ops, attn_fwd_step);
  REQUIRE_SLOT(kind, ops, attn_bwd_prepare);
  REQUIRE_SLOT(kind, ops, attn_bwd_step);
  REQUIRE_SLOT(kind, ops, synchronize);
  /* optional: pattern_scores, block_scores, pattern_select (and its batch form), data_stream; the
   * timer slots come as a pair, the stream-ordered slots as a triple */
  {
    const int n = !!ops->async + !!ops->deferred_scan + !!ops->deferred_poll;
    if (n != 0 && n != 3)
      return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                          "backend table '%s': of the stream-ordered slots async, deferred_scan "
                          "and deferred_poll only %d %s set (all three or none)",
                          ops->name, n, n == 1 ? "is" : "are");
  }
  if (ops->pattern_scores_batch && !ops->pattern_scores)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "backend table '%s': 'pattern_scores_batch' is set but 'pattern_scores' "
                        "is NULL (the batch slot needs the single one)",
                        ops->name);
  if (ops->pattern_select_batch && !ops->pattern_select)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "backend table '%s': 'pattern_select_batch' is set but 'pattern_select' "
                        "is NULL (the batch slot needs the single one)",
                        ops->name);
  {
    const int n = !!ops->device_plan_size + !!ops->device_plan_build + !!ops->device_plan_read +
                  !!ops->device_plan_release;
    if (n != 0 && n != 4)
      return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                          "backend table '%s': of the device-plan slots device_plan_size, "
                          "device_plan_build, device_plan_read and device_plan_release only %d "
                          "%s set (all four or none)",
                          ops->name, n, n == 1 ? "is" : "are");
    if (n == 4 && !ops->pattern_select)
      return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                          "backend table '%s': the device-plan slots are set but "
                          "'pattern_select' is NULL (a device plan selects on the backend)",
                          ops->name);
  }
  if (!ops->fill_f64 != !ops->row_sums_f64)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "backend table '%s': '%s' is set but '%s' is NULL (the row statistics "
                        "need both or neither)",
                        ops->name, ops->fill_f64 ? "fill_f64" : "row_sums_f64",
                        ops->fill_f64 ? "row_sums_f64" : "fill_f64");
  if (!ops->timer_mark != !ops->timer_elapsed)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "backend table '%s': '%s' is set but '%s' is NULL (the device timer "
                        "needs both or neither)",
                        ops->name, ops->timer_mark ? "timer_mark" : "timer_elapsed",
                        ops->timer_mark ? "timer_elapsed" : "timer_mark");
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_comm_table_check(const mtrain_comm_ops_t *ops) {
  MTRAIN_CHECK_NOT_NULL(ops);
  const char *kind = "communicator";
  mtrain_status_t st = check_version(kind, ops->name, ops->api_version);
  if (st) return st;
  REQUIRE_SLOT(kind, ops, name);
  if (ops->memory_space != MTRAIN_MEMORY_HOST && ops->memory_space != MTRAIN_MEMORY_DEVICE &&
      ops->memory_space != MTRAIN_MEMORY_ANY)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "communicator table '%s': memory_space is %d, not MTRAIN_MEMORY_HOST, "
                        "MTRAIN_MEMORY_DEVICE or MTRAIN_MEMORY_ANY",
                        ops->name, (int)ops->memory_space);
  REQUIRE_SLOT(kind, ops, rank);
  REQUIRE_SLOT(kind, ops, size);
  REQUIRE_SLOT(kind, ops, isend);
  REQUIRE_SLOT(kind, ops, irecv);
  REQUIRE_SLOT(kind, ops, wait);
  REQUIRE_SLOT(kind, ops, allreduce);
  REQUIRE_SLOT(kind, ops, allgather);
  REQUIRE_SLOT(kind, ops, barrier);
  REQUIRE_SLOT(kind, ops, split);
  REQUIRE_SLOT(kind, ops, abort);
  REQUIRE_SLOT(kind, ops, destroy);
  /* optional: set_data_stream, allreduce_device */
  return MTRAIN_SUCCESS;
}

/* ---- backend ------------------------------------------------------------------- */

/* An optional slot the backend lacks. */
static mtrain_status_t not_supported(const mtrain_context_t *ctx, const char *slot) {
  return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED, "backend '%s' has no %s (an optional slot)",
                      ctx->backend_name, slot);
}

mtrain_status_t mtrain_be_init(mtrain_context_t *ctx) {
  return ctx->backend->init(&ctx->config, &ctx->backend_state);
}

void mtrain_be_fini(mtrain_context_t *ctx) {
  mtrain_memory_tracker_t *t = &ctx->memory;
  if (ctx->backend && ctx->backend_state) {
    mtrain_be_release_kept(ctx);
    for (size_t i = 0; i < t->num_live; i++) {
      if (ctx->allocator.alloc)
        ctx->allocator.free(t->live[i].ptr, t->live[i].bytes, ctx->allocator.user);
      else
        ctx->backend->free(ctx->backend_state, t->live[i].ptr);
    }
    ctx->backend->fini(ctx->backend_state);
  }
  ctx->backend_state = NULL;
  mtrain_memory_tracker_clear(t);
  mtrain_reuse_clear(&ctx->kept);
}

mtrain_status_t mtrain_be_supports(mtrain_context_t *ctx, mtrain_dtype_t dtype, int32_t head_dim) {
  return ctx->backend->supports(ctx->backend_state, dtype, head_dim);
}

/* The most the context keeps between calls (reuse_cache.h). */
static size_t kept_limit(const mtrain_context_t *ctx) {
  return ctx->reuse_limit == MTRAIN_REUSE_LIMIT_PEAK ? ctx->memory.highest : ctx->reuse_limit;
}

void mtrain_be_trim_kept(mtrain_context_t *ctx) {
  const size_t limit = kept_limit(ctx);
  size_t bytes;
  while (ctx->kept.bytes > limit)
    ctx->backend->free(ctx->backend_state, mtrain_reuse_pop_oldest(&ctx->kept, &bytes));
}

void mtrain_be_release_kept(mtrain_context_t *ctx) {
  size_t bytes;
  void *p;
  while ((p = mtrain_reuse_pop_oldest(&ctx->kept, &bytes)))
    ctx->backend->free(ctx->backend_state, p);
}

mtrain_status_t mtrain_be_alloc(mtrain_context_t *ctx, size_t bytes, void **ptr) {
  mtrain_memory_tracker_t *t = &ctx->memory;
  if (mtrain_memory_tracker_reserve(t))
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "memory accounting: out of host memory");
  void *p = NULL;
  size_t held = bytes;
  if (ctx->allocator.alloc) {
    p = ctx->allocator.alloc(bytes, ctx->allocator.user);
    if (!p)
      return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY,
                          "the caller's allocator (mtrain_context_set_allocator) returned NULL for "
                          "%zu bytes",
                          bytes);
  } else if ((p = mtrain_reuse_take(&ctx->kept, bytes, &held))) {
    ctx->reused_blocks++;
  } else {
    mtrain_status_t st = ctx->backend->alloc(ctx->backend_state, bytes, &p);
    if (st == MTRAIN_ERR_OUT_OF_MEMORY && ctx->kept.count > 0) {
      /* the kept blocks of other sizes may be what is missing */
      mtrain_clear_error();
      mtrain_be_release_kept(ctx);
      st = ctx->backend->alloc(ctx->backend_state, bytes, &p);
    }
    if (st) return st;
  }
  mtrain_memory_tracker_add(t, p, bytes, held);
  *ptr = p;
  return MTRAIN_SUCCESS;
}

void mtrain_be_free(mtrain_context_t *ctx, void *ptr) {
  if (!ptr) return;
  size_t held;
  const size_t bytes = mtrain_memory_tracker_remove(&ctx->memory, ptr, &held);
  if (ctx->allocator.alloc) {
    ctx->allocator.free(ptr, bytes, ctx->allocator.user);
    return;
  }
  if (bytes == 0 || held > kept_limit(ctx) || mtrain_reuse_put(&ctx->kept, ptr, held)) {
    ctx->backend->free(ctx->backend_state, ptr);
    return;
  }
  mtrain_be_trim_kept(ctx);
}

mtrain_status_t mtrain_be_memset_zero(mtrain_context_t *ctx, void *ptr, size_t bytes) {
  return ctx->backend->memset_zero(ctx->backend_state, ptr, bytes);
}

mtrain_status_t mtrain_be_copy_to_host(mtrain_context_t *ctx, void *host_dst, const void *src,
                                       size_t bytes) {
  return ctx->backend->copy_to_host(ctx->backend_state, host_dst, src, bytes);
}

mtrain_status_t mtrain_be_copy_from_host(mtrain_context_t *ctx, void *dst, const void *host_src,
                                         size_t bytes) {
  return ctx->backend->copy_from_host(ctx->backend_state, dst, host_src, bytes);
}

mtrain_status_t mtrain_be_copy(mtrain_context_t *ctx, void *dst, const void *src, size_t bytes) {
  return ctx->backend->copy(ctx->backend_state, dst, src, bytes);
}

mtrain_status_t mtrain_be_add(mtrain_context_t *ctx, void *dst, const void *src,
                              mtrain_dtype_t dtype, int64_t count) {
  return ctx->backend->add(ctx->backend_state, dst, src, dtype, count);
}

mtrain_status_t mtrain_be_permute(mtrain_context_t *ctx, void *dst, const void *src,
                                  size_t row_bytes, const int64_t *index, int64_t count,
                                  int64_t other_rows, int scatter) {
  return ctx->backend->permute(ctx->backend_state, dst, src, row_bytes, index, count, other_rows,
                               scatter);
}

mtrain_status_t mtrain_be_convert(mtrain_context_t *ctx, const void *src, mtrain_dtype_t src_dtype,
                                  void *dst, mtrain_dtype_t dst_dtype, int64_t count) {
  return ctx->backend->convert(ctx->backend_state, src, src_dtype, dst, dst_dtype, count);
}

mtrain_status_t mtrain_be_find_nonfinite(mtrain_context_t *ctx, const void *ptr,
                                         mtrain_dtype_t dtype, int64_t count, int64_t *bad_index) {
  return ctx->backend->find_nonfinite(ctx->backend_state, ptr, dtype, count, bad_index);
}

mtrain_status_t mtrain_be_attn_fwd_init(mtrain_context_t *ctx, void *o_acc, void *lse_acc,
                                        int64_t rows, int32_t num_heads, int32_t head_dim) {
  return ctx->backend->attn_fwd_init(ctx->backend_state, o_acc, lse_acc, rows, num_heads, head_dim);
}

mtrain_status_t mtrain_be_attn_fwd_step(mtrain_context_t *ctx, const mtrain_fwd_step_args_t *args) {
  return ctx->backend->attn_fwd_step(ctx->backend_state, args);
}

mtrain_status_t mtrain_be_attn_bwd_prepare(mtrain_context_t *ctx, const void *o, const void *dout,
                                           mtrain_dtype_t dtype, void *delta_acc, int64_t rows,
                                           int32_t num_heads, int32_t head_dim) {
  return ctx->backend->attn_bwd_prepare(ctx->backend_state, o, dout, dtype, delta_acc, rows,
                                        num_heads, head_dim);
}

mtrain_status_t mtrain_be_attn_bwd_step(mtrain_context_t *ctx, const mtrain_bwd_step_args_t *args) {
  return ctx->backend->attn_bwd_step(ctx->backend_state, args);
}

mtrain_status_t mtrain_be_pattern_scores(mtrain_context_t *ctx, const mtrain_scores_args_t *args) {
  if (!ctx->backend->pattern_scores) return not_supported(ctx, "pattern_scores");
  return ctx->backend->pattern_scores(ctx->backend_state, args);
}

mtrain_status_t mtrain_be_pattern_scores_batch(mtrain_context_t *ctx,
                                               const mtrain_scores_args_t *args, int32_t count) {
  if (ctx->backend->pattern_scores_batch)
    return ctx->backend->pattern_scores_batch(ctx->backend_state, args, count);
  if (!ctx->backend->pattern_scores) return not_supported(ctx, "pattern_scores");
  for (int32_t s = 0; s < count; s++) {
    mtrain_status_t st = ctx->backend->pattern_scores(ctx->backend_state, &args[s]);
    if (st) return st;
  }
  return MTRAIN_SUCCESS;
}

int mtrain_be_has_pattern_scores(const mtrain_context_t *ctx) {
  return ctx->backend->pattern_scores != NULL;
}

mtrain_status_t mtrain_be_block_scores(mtrain_context_t *ctx,
                                       const mtrain_block_scores_args_t *args) {
  if (!ctx->backend->block_scores) return not_supported(ctx, "block_scores");
  return ctx->backend->block_scores(ctx->backend_state, args);
}

int mtrain_be_has_block_scores(const mtrain_context_t *ctx) {
  return ctx->backend->block_scores != NULL;
}

mtrain_status_t mtrain_be_pattern_select(mtrain_context_t *ctx, const mtrain_select_args_t *args) {
  if (!ctx->backend->pattern_select) return not_supported(ctx, "pattern_select");
  return ctx->backend->pattern_select(ctx->backend_state, args);
}

mtrain_status_t mtrain_be_pattern_select_batch(mtrain_context_t *ctx,
                                               const mtrain_select_args_t *args, int32_t count) {
  if (ctx->backend->pattern_select_batch)
    return ctx->backend->pattern_select_batch(ctx->backend_state, args, count);
  if (!ctx->backend->pattern_select) return not_supported(ctx, "pattern_select");
  for (int32_t s = 0; s < count; s++) {
    mtrain_status_t st = ctx->backend->pattern_select(ctx->backend_state, &args[s]);
    if (st) return st;
  }
  return MTRAIN_SUCCESS;
}

int mtrain_be_has_pattern_select(const mtrain_context_t *ctx) {
  return ctx->backend->pattern_select != NULL;
}

int mtrain_be_has_device_plan(const mtrain_context_t *ctx) {
  return ctx->backend->device_plan_build != NULL;
}

mtrain_status_t mtrain_be_device_plan_size(mtrain_context_t *ctx,
                                           const mtrain_device_plan_args_t *args, size_t *bytes) {
  if (!ctx->backend->device_plan_size) return not_supported(ctx, "device_plan_size");
  return ctx->backend->device_plan_size(ctx->backend_state, args, bytes);
}

mtrain_status_t mtrain_be_device_plan_build(mtrain_context_t *ctx,
                                            const mtrain_device_plan_args_t *args, void *memory,
                                            void **handle) {
  if (!ctx->backend->device_plan_build) return not_supported(ctx, "device_plan_build");
  return ctx->backend->device_plan_build(ctx->backend_state, args, memory, handle);
}

mtrain_status_t mtrain_be_device_plan_read(mtrain_context_t *ctx, void *handle,
                                           const mtrain_device_plan_args_t *args, int64_t *pairs) {
  if (!ctx->backend->device_plan_read) return not_supported(ctx, "device_plan_read");
  return ctx->backend->device_plan_read(ctx->backend_state, handle, args, pairs);
}

int mtrain_be_has_row_stats(const mtrain_context_t *ctx) {
  return ctx->backend->fill_f64 && ctx->backend->row_sums_f64;
}

mtrain_status_t mtrain_be_fill_f64(mtrain_context_t *ctx, double *dst, double value,
                                   int64_t count) {
  if (!ctx->backend->fill_f64) return not_supported(ctx, "fill_f64");
  return ctx->backend->fill_f64(ctx->backend_state, dst, value, count);
}

mtrain_status_t mtrain_be_row_sums_f64(mtrain_context_t *ctx, const double *in, double *out,
                                       int64_t rows, int64_t cols) {
  if (!ctx->backend->row_sums_f64) return not_supported(ctx, "row_sums_f64");
  return ctx->backend->row_sums_f64(ctx->backend_state, in, out, rows, cols);
}

void mtrain_be_device_plan_release(mtrain_context_t *ctx, void *handle) {
  if (ctx->backend->device_plan_release && handle)
    ctx->backend->device_plan_release(ctx->backend_state, handle);
}

int mtrain_be_has_data_stream(const mtrain_context_t *ctx) {
  return ctx->backend->data_stream != NULL;
}

void *mtrain_be_data_stream(mtrain_context_t *ctx) {
  return ctx->backend->data_stream ? ctx->backend->data_stream(ctx->backend_state) : NULL;
}

mtrain_status_t mtrain_be_synchronize(mtrain_context_t *ctx) {
  return ctx->backend->synchronize(ctx->backend_state);
}

int mtrain_be_async(const mtrain_context_t *ctx) {
  return ctx->backend->async ? ctx->backend->async(ctx->backend_state) != 0 : 0;
}

mtrain_status_t mtrain_be_deferred_scan(mtrain_context_t *ctx, const void *ptr,
                                        mtrain_dtype_t dtype, int64_t count, int64_t row0,
                                        int64_t row_width, int64_t head_dim, const char *what) {
  if (!ctx->backend->deferred_scan)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED, "backend '%s' has no deferred scans",
                        ctx->backend_name);
  return ctx->backend->deferred_scan(ctx->backend_state, ptr, dtype, count, row0, row_width,
                                     head_dim, what);
}

mtrain_status_t mtrain_be_deferred_poll(mtrain_context_t *ctx, int blocking) {
  return ctx->backend->deferred_poll ? ctx->backend->deferred_poll(ctx->backend_state, blocking)
                                     : MTRAIN_SUCCESS;
}

int mtrain_be_has_timer(const mtrain_context_t *ctx) {
  return ctx->backend->timer_mark && ctx->backend->timer_elapsed;
}

mtrain_status_t mtrain_be_timer_mark(mtrain_context_t *ctx, int index) {
  if (!ctx->backend->timer_mark) return not_supported(ctx, "timer_mark");
  return ctx->backend->timer_mark(ctx->backend_state, index);
}

mtrain_status_t mtrain_be_timer_elapsed(mtrain_context_t *ctx, int from, int to, double *seconds) {
  if (!ctx->backend->timer_elapsed) return not_supported(ctx, "timer_elapsed");
  return ctx->backend->timer_elapsed(ctx->backend_state, from, to, seconds);
}

mtrain_dtype_t mtrain_be_acc_dtype(const mtrain_context_t *ctx) { return ctx->backend->acc_dtype; }

mtrain_memory_space_t mtrain_be_memory_space(const mtrain_context_t *ctx) {
  return ctx->backend->memory_space;
}

/* ---- communicator ---------------------------------------------------------------- */

mtrain_status_t mtrain_cm_isend(mtrain_context_t *ctx, const void *buf, size_t bytes, int peer,
                                int tag, mtrain_comm_request_t **req) {
  return ctx->comm->ops->isend(ctx->comm->state, buf, bytes, peer, tag, req);
}

mtrain_status_t mtrain_cm_irecv(mtrain_context_t *ctx, void *buf, size_t bytes, int peer, int tag,
                                mtrain_comm_request_t **req) {
  return ctx->comm->ops->irecv(ctx->comm->state, buf, bytes, peer, tag, req);
}

mtrain_status_t mtrain_cm_wait(mtrain_context_t *ctx, mtrain_comm_request_t *req) {
  return ctx->comm->ops->wait(ctx->comm->state, req);
}

mtrain_status_t mtrain_cm_allreduce(mtrain_context_t *ctx, void *buf, int64_t count,
                                    mtrain_dtype_t dtype, mtrain_reduce_op_t op) {
  return ctx->comm->ops->allreduce(ctx->comm->state, buf, count, dtype, op);
}

int mtrain_cm_has_allreduce_device(const mtrain_context_t *ctx) {
  return ctx->comm->ops->allreduce_device != NULL;
}

mtrain_status_t mtrain_cm_allreduce_device(mtrain_context_t *ctx, void *buf, int64_t count,
                                           mtrain_dtype_t dtype, mtrain_reduce_op_t op) {
  if (!ctx->comm->ops->allreduce_device)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "communicator '%s' has no device all-reduce (allreduce_device)",
                        mtrain_cm_name(ctx));
  return ctx->comm->ops->allreduce_device(ctx->comm->state, buf, count, dtype, op);
}

mtrain_status_t mtrain_cm_allgather(mtrain_context_t *ctx, const void *send, void *recv,
                                    size_t bytes) {
  return ctx->comm->ops->allgather(ctx->comm->state, send, recv, bytes);
}

mtrain_status_t mtrain_cm_barrier(mtrain_context_t *ctx) {
  return ctx->comm->ops->barrier(ctx->comm->state);
}

mtrain_status_t mtrain_cm_set_data_stream(mtrain_context_t *ctx, void *stream) {
  if (!ctx->comm->ops->set_data_stream) return MTRAIN_SUCCESS;
  return ctx->comm->ops->set_data_stream(ctx->comm->state, stream);
}

const char *mtrain_cm_name(const mtrain_context_t *ctx) { return ctx->comm->ops->name; }

mtrain_memory_space_t mtrain_cm_memory_space(const mtrain_context_t *ctx) {
  return ctx->comm->ops->memory_space;
}
