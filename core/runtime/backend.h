/* backend.h (private): the core's only way to a context's backend and
 * communicator. One checked wrapper per slot of the tables of
 * mtrain_backend.h and mtrain_comm.h, taking the context; core code never
 * reads ctx->backend or ctx->comm->ops itself. The tables are checked once,
 * when the context is created (mtrain_backend_table_check,
 * mtrain_comm_table_check: api_version == MTRAIN_API_VERSION, every required
 * slot set), so the wrappers of required slots call straight through; an
 * absent optional slot gives MTRAIN_ERR_NOT_SUPPORTED naming the backend and
 * the slot, or the neutral behaviour documented with the wrapper. Every
 * wrapper returns the slot's status and leaves the slot's message.
 *
 * The wrappers, slot by slot (arguments: the context, then the slot's own
 * after its state; prototypes and details below):
 *   backend table          wrapper
 *   init, fini             mtrain_be_init(ctx), mtrain_be_fini(ctx)
 *   supports               mtrain_be_supports(ctx, dtype, head_dim)
 *   alloc, free            mtrain_be_alloc(ctx, bytes, &ptr), mtrain_be_free(ctx, ptr)
 *                          (these two also keep the context's memory accounting)
 *   memset_zero            mtrain_be_memset_zero(ctx, ptr, bytes)
 *   copy_to_host           mtrain_be_copy_to_host(ctx, host_dst, src, bytes)
 *   copy_from_host         mtrain_be_copy_from_host(ctx, dst, host_src, bytes)
 *   copy                   mtrain_be_copy(ctx, dst, src, bytes)
 *   add                    mtrain_be_add(ctx, dst, src, dtype, count)
 *   permute                mtrain_be_permute(ctx, dst, src, row_bytes, index, count,
 *                                            other_rows, scatter)
 *   convert                mtrain_be_convert(ctx, src, src_dtype, dst, dst_dtype, count)
 *   find_nonfinite         mtrain_be_find_nonfinite(ctx, ptr, dtype, count, &bad_index)
 *   attn_fwd_init          mtrain_be_attn_fwd_init(ctx, o_acc, lse_acc, rows, heads, d)
 *   attn_fwd_step          mtrain_be_attn_fwd_step(ctx, &args)
 *   attn_bwd_prepare       mtrain_be_attn_bwd_prepare(ctx, o, dout, dtype, delta_acc, rows,
 *                                                     heads, d)
 *   attn_bwd_step          mtrain_be_attn_bwd_step(ctx, &args)
 *   pattern_scores (opt.)  mtrain_be_pattern_scores(ctx, &args); mtrain_be_has_pattern_scores
 *   data_stream (opt.)     mtrain_be_data_stream(ctx): NULL when absent; mtrain_be_has_data_stream
 *   synchronize            mtrain_be_synchronize(ctx)
 *   timer_mark (opt.)      mtrain_be_timer_mark(ctx, index); mtrain_be_has_timer(ctx)
 *   timer_elapsed (opt.)   mtrain_be_timer_elapsed(ctx, from, to, &seconds)
 *   async (opt.)           mtrain_be_async(ctx)
 *   deferred_scan (opt.)   mtrain_be_deferred_scan(ctx, ptr, dtype, count, row0, width, hd, what)
 *   deferred_poll (opt.)   mtrain_be_deferred_poll(ctx, blocking)
 *   block_scores (opt.)    mtrain_be_block_scores(ctx, &args); mtrain_be_has_block_scores
 *   pattern_select (opt.)  mtrain_be_pattern_select(ctx, &args); mtrain_be_has_pattern_select
 *   pattern_scores_batch (opt.) mtrain_be_pattern_scores_batch(ctx, args, count): per
 *                          sequence through pattern_scores when absent
 *   pattern_select_batch (opt.) mtrain_be_pattern_select_batch(ctx, args, count): per
 *                          sequence through pattern_select when absent
 *   device_plan_* (opt.)   mtrain_be_device_plan_size / _build / _read / _release;
 *                          mtrain_be_has_device_plan
 *   fill_f64, row_sums_f64 (opt.) mtrain_be_fill_f64, mtrain_be_row_sums_f64;
 *                          mtrain_be_has_row_stats
 *   acc_dtype, memory_space  mtrain_be_acc_dtype(ctx), mtrain_be_memory_space(ctx)
 *   communicator table     wrapper
 *   isend, irecv           mtrain_cm_isend(ctx, buf, bytes, peer, tag, &req), mtrain_cm_irecv
 *   wait                   mtrain_cm_wait(ctx, req)
 *   allreduce              mtrain_cm_allreduce(ctx, buf, count, dtype, op)
 *   allgather              mtrain_cm_allgather(ctx, send, recv, bytes)
 *   allreduce_device (opt) mtrain_cm_allreduce_device(ctx, buf, count, dtype, op);
 *                          mtrain_cm_has_allreduce_device
 *   barrier                mtrain_cm_barrier(ctx)
 *   set_data_stream (opt.) mtrain_cm_set_data_stream(ctx, stream): a no-op when absent
 *   name, memory_space     mtrain_cm_name(ctx), mtrain_cm_memory_space(ctx)
 *   rank, size             mtrain_context_rank(ctx), mtrain_context_world(ctx) (mtrain.h)
 * (split, abort and destroy belong to the communicator's owner: mtrain_comm.h.)
 */
#ifndef MTRAIN_CORE_BACKEND_H
#define MTRAIN_CORE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_backend.h"
#include "mtrain/mtrain_comm.h"

/* ---- table checks (context creation) --------------------------------------- */

/** MTRAIN_SUCCESS when `ops` can serve a context: api_version equal to
 *  MTRAIN_API_VERSION, a name, a known acc_dtype (fp32 or fp64) and memory
 *  space (host or device), every required slot set, and the timer slots
 *  both or neither. Else MTRAIN_ERR_INVALID_CONFIG naming the table, the
 *  field and (for api_version) both versions. */
mtrain_status_t mtrain_backend_table_check(const mtrain_backend_ops_t *ops);
/** The same for a communicator table: api_version, a name, a known memory
 *  space, every slot but the optional set_data_stream. */
mtrain_status_t mtrain_comm_table_check(const mtrain_comm_ops_t *ops);

/* ---- backend ----------------------------------------------------------------- */

/** Creates the backend state from the context's configuration. */
mtrain_status_t mtrain_be_init(mtrain_context_t *ctx);
/** Frees the backend blocks still live (none, unless an allocation leaked)
 *  and the backend state; nothing when init has not succeeded. */
void mtrain_be_fini(mtrain_context_t *ctx);
/** MTRAIN_SUCCESS if q/k/v of `dtype` and this head_dim can be computed. */
mtrain_status_t mtrain_be_supports(mtrain_context_t *ctx, mtrain_dtype_t dtype, int32_t head_dim);

/** Allocates `bytes` of backend memory and counts them in the context's
 *  memory accounting (memory_stats.h; the requested size, a backend may
 *  round up). On failure nothing is allocated or counted. Every backend
 *  allocation of the core goes through it. */
mtrain_status_t mtrain_be_alloc(mtrain_context_t *ctx, size_t bytes, void **ptr);
/** Frees a block of mtrain_be_alloc and uncounts it. NULL is a no-op.
 *  Without a caller's allocator the block is kept for reuse (reuse_cache.h)
 *  within the context's reuse limit, the oldest kept blocks freed beyond it. */
void mtrain_be_free(mtrain_context_t *ctx, void *ptr);
/** Returns the oldest kept blocks to the backend until the kept bytes are
 *  within the context's reuse limit. */
void mtrain_be_trim_kept(mtrain_context_t *ctx);
/** Returns every kept block to the backend. */
void mtrain_be_release_kept(mtrain_context_t *ctx);
mtrain_status_t mtrain_be_memset_zero(mtrain_context_t *ctx, void *ptr, size_t bytes);
mtrain_status_t mtrain_be_copy_to_host(mtrain_context_t *ctx, void *host_dst, const void *src,
                                       size_t bytes);
mtrain_status_t mtrain_be_copy_from_host(mtrain_context_t *ctx, void *dst, const void *host_src,
                                         size_t bytes);
/** Copies within the backend's memory (regions do not overlap). */
mtrain_status_t mtrain_be_copy(mtrain_context_t *ctx, void *dst, const void *src, size_t bytes);
/** dst += src element-wise, `count` elements of `dtype` (fp32 or fp64). */
mtrain_status_t mtrain_be_add(mtrain_context_t *ctx, void *dst, const void *src,
                              mtrain_dtype_t dtype, int64_t count);
/** Row gather (scatter == 0) or scatter (1); see mtrain_backend_ops_t.permute. */
mtrain_status_t mtrain_be_permute(mtrain_context_t *ctx, void *dst, const void *src,
                                  size_t row_bytes, const int64_t *index, int64_t count,
                                  int64_t other_rows, int scatter);
/** Element-wise dtype conversion within the backend's memory. */
mtrain_status_t mtrain_be_convert(mtrain_context_t *ctx, const void *src, mtrain_dtype_t src_dtype,
                                  void *dst, mtrain_dtype_t dst_dtype, int64_t count);
/** *bad_index = index of the first NaN/Inf element, or -1. */
mtrain_status_t mtrain_be_find_nonfinite(mtrain_context_t *ctx, const void *ptr,
                                         mtrain_dtype_t dtype, int64_t count, int64_t *bad_index);

/** Sets o_acc to 0 and lse_acc to -inf for `rows` rows of Hq heads. */
mtrain_status_t mtrain_be_attn_fwd_init(mtrain_context_t *ctx, void *o_acc, void *lse_acc,
                                        int64_t rows, int32_t num_heads, int32_t head_dim);
/** One step's listed pairs, merged into o_acc/lse_acc. */
mtrain_status_t mtrain_be_attn_fwd_step(mtrain_context_t *ctx, const mtrain_fwd_step_args_t *args);
/** delta_acc[i,h] = sum_d dout[i,h,:] * o[i,h,:]. */
mtrain_status_t mtrain_be_attn_bwd_prepare(mtrain_context_t *ctx, const void *o, const void *dout,
                                           mtrain_dtype_t dtype, void *delta_acc, int64_t rows,
                                           int32_t num_heads, int32_t head_dim);
/** One step's contributions, accumulated into dq_acc, dk_acc, dv_acc. */
mtrain_status_t mtrain_be_attn_bwd_step(mtrain_context_t *ctx, const mtrain_bwd_step_args_t *args);

/** One stage of the pattern scores; MTRAIN_ERR_NOT_SUPPORTED naming the
 *  backend when it has none (optional slot). */
mtrain_status_t mtrain_be_pattern_scores(mtrain_context_t *ctx, const mtrain_scores_args_t *args);
/** 1 when the backend computes pattern scores. */
int mtrain_be_has_pattern_scores(const mtrain_context_t *ctx);

/** The block scores of SPEC.md section 9 for this rank's query blocks;
 *  MTRAIN_ERR_NOT_SUPPORTED naming the backend when it has none (optional
 *  slot). */
mtrain_status_t mtrain_be_block_scores(mtrain_context_t *ctx,
                                       const mtrain_block_scores_args_t *args);
/** 1 when the backend computes block scores. */
int mtrain_be_has_block_scores(const mtrain_context_t *ctx);

/** The vertical-slash selection on the backend; MTRAIN_ERR_NOT_SUPPORTED
 *  naming the backend when it has none, or naming the budget it cannot
 *  select (optional slot). */
mtrain_status_t mtrain_be_pattern_select(mtrain_context_t *ctx, const mtrain_select_args_t *args);
/** One scores stage of `count` sequences (the pattern_scores_batch slot,
 *  else pattern_scores for each in turn). */
mtrain_status_t mtrain_be_pattern_scores_batch(mtrain_context_t *ctx,
                                               const mtrain_scores_args_t *args, int32_t count);
/** The selection of `count` sequences (the pattern_select_batch slot, else
 *  pattern_select for each in turn: a MTRAIN_ERR_NOT_SUPPORTED then may come
 *  after earlier sequences were selected; the caller selects them all on
 *  the host). */
mtrain_status_t mtrain_be_pattern_select_batch(mtrain_context_t *ctx,
                                               const mtrain_select_args_t *args, int32_t count);
/** 1 when the backend selects vertical-slash patterns itself. */
int mtrain_be_has_pattern_select(const mtrain_context_t *ctx);

/** Plans built on the backend (the four device_plan slots; mtrain_backend.h
 *  says what each does). The wrappers report MTRAIN_ERR_NOT_SUPPORTED naming
 *  the backend when it has none; release is a no-op then. */
int mtrain_be_has_device_plan(const mtrain_context_t *ctx);
mtrain_status_t mtrain_be_device_plan_size(mtrain_context_t *ctx,
                                           const mtrain_device_plan_args_t *args, size_t *bytes);
mtrain_status_t mtrain_be_device_plan_build(mtrain_context_t *ctx,
                                            const mtrain_device_plan_args_t *args, void *memory,
                                            void **handle);
mtrain_status_t mtrain_be_device_plan_read(mtrain_context_t *ctx, void *handle,
                                           const mtrain_device_plan_args_t *args, int64_t *pairs);
void mtrain_be_device_plan_release(mtrain_context_t *ctx, void *handle);

/** The estimate's row statistics in backend memory (fill_f64, row_sums_f64;
 *  mtrain_backend.h): 1 when the backend has both slots. */
int mtrain_be_has_row_stats(const mtrain_context_t *ctx);
mtrain_status_t mtrain_be_fill_f64(mtrain_context_t *ctx, double *dst, double value, int64_t count);
mtrain_status_t mtrain_be_row_sums_f64(mtrain_context_t *ctx, const double *in, double *out,
                                       int64_t rows, int64_t cols);

/** 1 when the backend has a data stream (the optional data_stream slot). */
int mtrain_be_has_data_stream(const mtrain_context_t *ctx);
/** The stream the backend queues its work on, or NULL (no data_stream slot,
 *  or work done when each slot returns). */
void *mtrain_be_data_stream(mtrain_context_t *ctx);
/** Waits for all work queued by the backend. */
mtrain_status_t mtrain_be_synchronize(mtrain_context_t *ctx);

/** 1 when the backend's state is in stream-ordered mode (the optional
 *  async slot): single-rank calls return once queued and check their
 *  outputs with deferred scans; 0 without the slot. */
int mtrain_be_async(const mtrain_context_t *ctx);
/** Queues a deferred NaN/Inf scan (mtrain_backend_ops_t.deferred_scan);
 *  MTRAIN_ERR_NOT_SUPPORTED without the slot. */
mtrain_status_t mtrain_be_deferred_scan(mtrain_context_t *ctx, const void *ptr,
                                        mtrain_dtype_t dtype, int64_t count, int64_t row0,
                                        int64_t row_width, int64_t head_dim, const char *what);
/** Reports the first finding of the deferred scans (deferred_poll);
 *  MTRAIN_SUCCESS without the slot. */
mtrain_status_t mtrain_be_deferred_poll(mtrain_context_t *ctx, int blocking);

/** 1 when the backend times on the device (timer_mark and timer_elapsed);
 *  0: the host clock is exact. */
int mtrain_be_has_timer(const mtrain_context_t *ctx);
/** Records a device timestamp into slot `index` (0 <= index < 4096);
 *  MTRAIN_ERR_NOT_SUPPORTED naming the backend when it has no timer. */
mtrain_status_t mtrain_be_timer_mark(mtrain_context_t *ctx, int index);
/** Seconds between two recorded slots (waits for both); NOT_SUPPORTED as
 *  mtrain_be_timer_mark. */
mtrain_status_t mtrain_be_timer_elapsed(mtrain_context_t *ctx, int from, int to, double *seconds);

/** The dtype of the backend's accumulators (fp32, or fp64 for cpu-ref). */
mtrain_dtype_t mtrain_be_acc_dtype(const mtrain_context_t *ctx);
/** Where the backend keeps tensors (host or device memory). */
mtrain_memory_space_t mtrain_be_memory_space(const mtrain_context_t *ctx);

/* ---- communicator -------------------------------------------------------------- */

/** Non-blocking point-to-point; buffers stay valid until mtrain_cm_wait. */
mtrain_status_t mtrain_cm_isend(mtrain_context_t *ctx, const void *buf, size_t bytes, int peer,
                                int tag, mtrain_comm_request_t **req);
mtrain_status_t mtrain_cm_irecv(mtrain_context_t *ctx, void *buf, size_t bytes, int peer, int tag,
                                mtrain_comm_request_t **req);
/** Completes and frees a request (MTRAIN_ERR_TIMEOUT naming the peer). */
mtrain_status_t mtrain_cm_wait(mtrain_context_t *ctx, mtrain_comm_request_t *req);
/** In-place all-reduce of `count` fp32 or fp64 elements (host memory). */
mtrain_status_t mtrain_cm_allreduce(mtrain_context_t *ctx, void *buf, int64_t count,
                                    mtrain_dtype_t dtype, mtrain_reduce_op_t op);
/** Whether the communicator has the optional device all-reduce. */
int mtrain_cm_has_allreduce_device(const mtrain_context_t *ctx);
/** In-place all-reduce of `count` fp32 or fp64 elements in backend (device)
 *  memory, blocking (mtrain_comm_ops_t.allreduce_device); NOT_SUPPORTED
 *  for a communicator without the slot. */
mtrain_status_t mtrain_cm_allreduce_device(mtrain_context_t *ctx, void *buf, int64_t count,
                                           mtrain_dtype_t dtype, mtrain_reduce_op_t op);
/** Gathers `bytes` from every rank into recv (world * bytes, rank order). */
mtrain_status_t mtrain_cm_allgather(mtrain_context_t *ctx, const void *send, void *recv,
                                    size_t bytes);
mtrain_status_t mtrain_cm_barrier(mtrain_context_t *ctx);
/** Orders the communicator's transfers after `stream`; a no-op (success)
 *  for a communicator without the optional set_data_stream slot. */
mtrain_status_t mtrain_cm_set_data_stream(mtrain_context_t *ctx, void *stream);
/** The communicator's name ("self", "mpi", "nccl", ...). */
const char *mtrain_cm_name(const mtrain_context_t *ctx);
/** Where its point-to-point buffers must live (host, device or any). */
mtrain_memory_space_t mtrain_cm_memory_space(const mtrain_context_t *ctx);

#endif /* MTRAIN_CORE_BACKEND_H */
