/* attention.c: the attention entry points. Validates tensors against the plan
 * and the backend, allocates the accumulators in the backend's memory, walks
 * the plan's sequences and ring steps calling the backend's step operations,
 * and casts the accumulators to the output dtypes. Single-rank plans walk
 * their sequences here; ring plans go through the ring driver (ring.c). No
 * kernel math here. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/context_internal.h"
#include "mtrain/mtrain_error.h"
#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
#include "core/runtime/ring.h"

/* Checks that t is [rows, heads, dim] (or [rows, heads] when dim < 0). */
static mtrain_status_t check_shape(const char *name, const mtrain_tensor_t *t, int64_t rows,
                                   int64_t heads, int64_t dim) {
  if (!t) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "tensor '%s' is NULL", name);
  int32_t ndim = dim < 0 ? 2 : 3;
  if (t->ndim != ndim)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "tensor '%s' has %d dimensions, expected %d",
                        name, t->ndim, ndim);
  const int64_t want[3] = {rows, heads, dim};
  static const char *const what[3] = {"tokens", "heads", "head_dim"};
  for (int32_t i = 0; i < ndim; i++)
    if (t->shape[i] != want[i])
      return mtrain_error(i == 1 ? MTRAIN_ERR_HEAD_MISMATCH : MTRAIN_ERR_SHAPE_MISMATCH,
                          "tensor '%s' has %s = %lld (shape[%d]), expected %lld", name, what[i],
                          (long long)t->shape[i], i, (long long)want[i]);
  if (!t->data && rows > 0)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "tensor '%s' has data == NULL", name);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t check_dtype(const char *name, const mtrain_tensor_t *t,
                                   mtrain_dtype_t want) {
  if (t->dtype != want)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "tensor '%s' has dtype %s, expected %s", name,
                        mtrain_dtype_name(t->dtype), mtrain_dtype_name(want));
  return MTRAIN_SUCCESS;
}

static mtrain_status_t check_lse_dtype(const mtrain_tensor_t *lse) {
  if (lse->dtype != MTRAIN_F32 && lse->dtype != MTRAIN_F64)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                        "tensor 'lse' has dtype %s, expected fp32 "
                        "(or fp64)",
                        mtrain_dtype_name(lse->dtype));
  return MTRAIN_SUCCESS;
}

/* The dimensions every attention call agrees on, taken from q and k. */
typedef struct attn_dims {
  int64_t tokens;
  int32_t hq, hkv, d;
  mtrain_dtype_t dtype;
  double scale;
} attn_dims_t;

static mtrain_status_t check_common(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                    const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                    const mtrain_tensor_t *v, attn_dims_t *dims) {
  if (!ctx) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "argument 'ctx' is NULL");
  if (!plan) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "argument 'plan' is NULL");
  if (!q) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "tensor 'q' is NULL");
  if (!k) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "tensor 'k' is NULL");
  if (!v) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "tensor 'v' is NULL");
  if (plan->granularity != ctx->config.granularity)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "plan granularity %d differs from the context's %d", plan->granularity,
                        ctx->config.granularity);
  if (q->ndim != 3)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "tensor 'q' has %d dimensions, expected 3 "
                        "[tokens, heads, head_dim]",
                        q->ndim);
  if (k->ndim != 3)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "tensor 'k' has %d dimensions, expected 3 "
                        "[tokens, kv_heads, head_dim]",
                        k->ndim);
  mtrain_status_t st;
  if ((st = check_shape("q", q, plan->local_tokens, plan->num_heads, q->shape[2]))) return st;
  int64_t hkv = k->shape[1], d = q->shape[2];
  if (hkv < 1 || hkv > plan->num_heads || plan->num_heads % hkv != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                        "query heads %d are not a multiple of kv heads %lld (tensor 'k' "
                        "shape[1])",
                        plan->num_heads, (long long)hkv);
  if (d < 1 || d > 1024)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_HEAD_DIM,
                        "head_dim %lld (tensor 'q' shape[2]) "
                        "is not in [1, 1024]",
                        (long long)d);
  if ((st = check_shape("k", k, plan->local_tokens, hkv, d))) return st;
  if ((st = check_shape("v", v, plan->local_tokens, hkv, d))) return st;
  if ((st = check_dtype("k", k, q->dtype))) return st;
  if ((st = check_dtype("v", v, q->dtype))) return st;
  if (mtrain_dtype_size(q->dtype) == 0)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "tensor 'q' has unknown dtype %d",
                        (int)q->dtype);
  if ((st = ctx->backend->supports(ctx->backend_state, q->dtype, (int32_t)d))) return st;
  dims->tokens = plan->local_tokens;
  dims->hq = plan->num_heads;
  dims->hkv = (int32_t)hkv;
  dims->d = (int32_t)d;
  dims->dtype = q->dtype;
  dims->scale = ctx->config.softmax_scale > 0 ? ctx->config.softmax_scale : 1.0 / sqrt((double)d);
  return MTRAIN_SUCCESS;
}

/* NaN/Inf scan of the rows [row0, row0 + rows) of a token-major tensor. */
static mtrain_status_t scan_rows(mtrain_context_t *ctx, const char *name, const mtrain_tensor_t *t,
                                 int64_t row0, int64_t rows) {
  const int64_t width = mtrain_tensor_numel(t) / (t->shape[0] > 0 ? t->shape[0] : 1);
  const size_t esz = mtrain_dtype_size(t->dtype);
  int64_t bad = -1;
  mtrain_status_t st = ctx->backend->find_nonfinite(
      ctx->backend_state, (const char *)t->data + (size_t)(row0 * width) * esz, t->dtype,
      rows * width, &bad);
  if (st) return st;
  if (bad >= 0) {
    bad += row0 * width;
    const int64_t row = bad / width, head = (bad % width) / (t->ndim == 3 ? t->shape[2] : 1);
    return mtrain_error(MTRAIN_ERR_NONFINITE,
                        "tensor '%s' holds NaN or Inf at element %lld (token %lld, head %lld)",
                        name, (long long)bad, (long long)row, (long long)head);
  }
  return MTRAIN_SUCCESS;
}

/* NaN/Inf scan of the rows that hold sequence tokens (padding slots of a
 * ring plan are skipped: their LSE is -inf by definition, no key). */
static mtrain_status_t check_finite(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                    const char *name, const mtrain_tensor_t *t) {
  const int32_t G = plan->granularity;
  int64_t begin = 0, end = 0; /* the current run of token rows, merged across blocks */
  for (int32_t s = 0; s < plan->num_seqs; s++) {
    const mtrain_plan_seq_t *ps = &plan->seqs[s];
    for (int32_t lb = 0; lb < ps->q.num_blocks; lb++) {
      const int32_t rows =
          mtrain_block_rows(ps->q.tokens, G, lb, ps->q.global[lb], ps->pattern->seq_len);
      const int64_t first = ps->local_offset + (int64_t)lb * G;
      if (rows == 0) continue;
      if (first != end && end > begin) {
        mtrain_status_t st = scan_rows(ctx, name, t, begin, end - begin);
        if (st) return st;
        begin = first;
      } else if (end == begin) {
        begin = first;
      }
      end = first + rows;
    }
  }
  return end > begin ? scan_rows(ctx, name, t, begin, end - begin) : MTRAIN_SUCCESS;
}

/* Backend memory, counted per context (memory_stats.c). */
static mtrain_status_t backend_alloc(mtrain_context_t *ctx, size_t bytes, void **ptr) {
  return mtrain_backend_alloc(ctx, bytes ? bytes : 1, ptr);
}

static void backend_free(mtrain_context_t *ctx, void *ptr) { mtrain_backend_free(ctx, ptr); }

/* Pointer to token `row` of a [tokens, heads, dim] buffer. */
static const void *row_ptr(const void *base, int64_t row, int64_t heads, int64_t dim, size_t elem) {
  return (const char *)base + (size_t)(row * heads * dim) * elem;
}

/* What the ring's step callbacks need besides the chunk in hand. */
typedef struct ring_call {
  const attn_dims_t *dm;
  const void *q, *dout;
  void *o_acc, *lse_acc;             /* forward */
  const void *lse_acc_c, *delta_acc; /* backward */
  void *dq_acc, *dk_own, *dv_own;    /* backward */
  const void *kbar, *vbar;           /* bars gathered: the vertical K/V rows */
  void *dkbar, *dvbar;               /* bars gathered, backward: their dK/dV */
} ring_call_t;

/* Bars gathered: every rank receives the K and V rows of the union of the
 * verticals (each row has one owner; the others add zeros, so the sum is
 * exact), widened to fp64 for the all-reduce and narrowed back. */
static mtrain_status_t gather_bars(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                   const attn_dims_t *dm, const mtrain_tensor_t *k,
                                   const mtrain_tensor_t *v, void **kbar, void **vbar) {
  const mtrain_plan_gathered_t *g = plan->gathered;
  const mtrain_backend_ops_t *be = ctx->backend;
  const int64_t row = (int64_t)dm->hkv * dm->d, n = g->count * row;
  const size_t esz = mtrain_dtype_size(dm->dtype);
  mtrain_status_t st = MTRAIN_SUCCESS;
  double *host = calloc((size_t)(2 * n + 1), sizeof(double));
  void *raw = malloc((size_t)(row > 0 ? row : 1) * esz + (size_t)(2 * n + 1) * esz);
  if (!host || !raw) st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "bars gathered: out of memory");
  for (int64_t i = 0; !st && i < g->count; i++) {
    if (g->local_row[i] < 0) continue;
    const mtrain_tensor_t *src[2] = {k, v};
    for (int x = 0; !st && x < 2; x++) {
      st = be->copy_to_host(ctx->backend_state, raw,
                            (const char *)src[x]->data + (size_t)(g->local_row[i] * row) * esz,
                            (size_t)row * esz);
      if (!st) st = mtrain_convert(raw, dm->dtype, host + x * n + i * row, MTRAIN_F64, row);
    }
  }
  if (!st)
    st = ctx->comm->ops->allreduce(ctx->comm->state, host, 2 * n, MTRAIN_F64, MTRAIN_REDUCE_SUM);
  if (!st) st = mtrain_convert(host, MTRAIN_F64, raw, dm->dtype, 2 * n);
  if (!st) st = mtrain_backend_alloc(ctx, (size_t)(n > 0 ? n : 1) * esz, kbar);
  if (!st) st = mtrain_backend_alloc(ctx, (size_t)(n > 0 ? n : 1) * esz, vbar);
  if (!st) st = be->copy_from_host(ctx->backend_state, *kbar, raw, (size_t)n * esz);
  if (!st)
    st = be->copy_from_host(ctx->backend_state, *vbar, (const char *)raw + (size_t)n * esz,
                            (size_t)n * esz);
  free(host);
  free(raw);
  return st;
}

/* Bars gathered, backward: the dK/dV of the vertical rows summed over the
 * ranks, each owner adding its rows to its own accumulators. */
static mtrain_status_t scatter_bar_grads(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                         const attn_dims_t *dm, void *dkbar, void *dvbar,
                                         void *dk_acc, void *dv_acc) {
  const mtrain_plan_gathered_t *g = plan->gathered;
  const mtrain_backend_ops_t *be = ctx->backend;
  const int64_t row = (int64_t)dm->hkv * dm->d, n = g->count * row;
  const size_t acc = mtrain_dtype_size(be->acc_dtype);
  void *host = malloc((size_t)(2 * n + 1) * acc);
  if (!host) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "bars gathered: out of memory");
  mtrain_status_t st = be->copy_to_host(ctx->backend_state, host, dkbar, (size_t)n * acc);
  if (!st)
    st = be->copy_to_host(ctx->backend_state, (char *)host + (size_t)n * acc, dvbar,
                          (size_t)n * acc);
  if (!st)
    st = ctx->comm->ops->allreduce(ctx->comm->state, host, 2 * n, be->acc_dtype, MTRAIN_REDUCE_SUM);
  if (!st) st = be->copy_from_host(ctx->backend_state, dkbar, host, (size_t)n * acc);
  if (!st)
    st = be->copy_from_host(ctx->backend_state, dvbar, (const char *)host + (size_t)n * acc,
                            (size_t)n * acc);
  for (int64_t i = 0; !st && i < g->count; i++) {
    if (g->local_row[i] < 0) continue;
    const size_t to = (size_t)(g->local_row[i] * row) * acc, from = (size_t)(i * row) * acc;
    st = be->add(ctx->backend_state, (char *)dk_acc + to, (const char *)dkbar + from, be->acc_dtype,
                 row);
    if (!st)
      st = be->add(ctx->backend_state, (char *)dv_acc + to, (const char *)dvbar + from,
                   be->acc_dtype, row);
  }
  free(host);
  return st;
}

static mtrain_status_t ring_fwd_step(mtrain_context_t *ctx, const mtrain_plan_t *plan, int32_t t,
                                     const void *k, const void *v, void *dk, void *dv, void *user) {
  (void)dk;
  (void)dv;
  const ring_call_t *rc = user;
  mtrain_fwd_step_args_t a = {.view = &plan->seqs[0].steps[t].view,
                              .num_kv_heads = rc->dm->hkv,
                              .head_dim = rc->dm->d,
                              .scale = rc->dm->scale,
                              .dtype = rc->dm->dtype,
                              .q = rc->q,
                              .k = k,
                              .v = v,
                              .o_acc = rc->o_acc,
                              .lse_acc = rc->lse_acc};
  mtrain_status_t st = ctx->backend->attn_fwd_step(ctx->backend_state, &a);
  if (st || !plan->gathered) return st;
  a.view = &plan->gathered->steps[t].view; /* this step's share of the gathered bars */
  a.k = rc->kbar;
  a.v = rc->vbar;
  return ctx->backend->attn_fwd_step(ctx->backend_state, &a);
}

static mtrain_status_t ring_bwd_step(mtrain_context_t *ctx, const mtrain_plan_t *plan, int32_t t,
                                     const void *k, const void *v, void *dk, void *dv, void *user) {
  const ring_call_t *rc = user;
  mtrain_bwd_step_args_t a = {.view = &plan->seqs[0].steps[t].view,
                              .num_kv_heads = rc->dm->hkv,
                              .head_dim = rc->dm->d,
                              .scale = rc->dm->scale,
                              .dtype = rc->dm->dtype,
                              .q = rc->q,
                              .k = k,
                              .v = v,
                              .dout = rc->dout,
                              .lse_acc = rc->lse_acc_c,
                              .delta_acc = rc->delta_acc,
                              .dq_acc = rc->dq_acc,
                              .dk_acc = dk,
                              .dv_acc = dv};
  mtrain_status_t st = ctx->backend->attn_bwd_step(ctx->backend_state, &a);
  if (st || !plan->gathered) return st;
  a.view = &plan->gathered->steps[t].view;
  a.k = rc->kbar;
  a.v = rc->vbar;
  a.dk_acc = rc->dkbar;
  a.dv_acc = rc->dvbar;
  return ctx->backend->attn_bwd_step(ctx->backend_state, &a);
}

static mtrain_status_t ring_add_partial(mtrain_context_t *ctx, const void *dk, const void *dv,
                                        void *user) {
  const ring_call_t *rc = user;
  const int64_t n = rc->dm->tokens * rc->dm->hkv * rc->dm->d;
  const mtrain_backend_ops_t *be = ctx->backend;
  mtrain_status_t st = be->add(ctx->backend_state, rc->dk_own, dk, be->acc_dtype, n);
  return st ? st : be->add(ctx->backend_state, rc->dv_own, dv, be->acc_dtype, n);
}

mtrain_status_t mtrain_attention_forward(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                         const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                         const mtrain_tensor_t *v, mtrain_tensor_t *o,
                                         mtrain_tensor_t *lse) {
  attn_dims_t dm = {0};
  mtrain_status_t st = check_common(ctx, plan, q, k, v, &dm);
  if (st) return st;
  if ((st = check_shape("o", o, dm.tokens, dm.hq, dm.d))) return st;
  if ((st = check_dtype("o", o, dm.dtype))) return st;
  if ((st = check_shape("lse", lse, dm.tokens, dm.hq, -1))) return st;
  if ((st = check_lse_dtype(lse))) return st;
  if (ctx->config.check_inputs) {
    if ((st = check_finite(ctx, plan, "q", q))) return st;
    if ((st = check_finite(ctx, plan, "k", k))) return st;
    if ((st = check_finite(ctx, plan, "v", v))) return st;
  }
  const double call_start = mtrain_now();
  memset(&ctx->last_stats, 0, sizeof ctx->last_stats);
  const mtrain_backend_ops_t *be = ctx->backend;
  const size_t acc = mtrain_dtype_size(be->acc_dtype), esz = mtrain_dtype_size(dm.dtype);
  void *o_acc = NULL, *lse_acc = NULL, *kbar = NULL, *vbar = NULL;
  MTRAIN_TRY(backend_alloc(ctx, (size_t)(dm.tokens * dm.hq * dm.d) * acc, &o_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)(dm.tokens * dm.hq) * acc, &lse_acc));
  MTRAIN_TRY(be->attn_fwd_init(ctx->backend_state, o_acc, lse_acc, dm.tokens, dm.hq, dm.d));
  if (plan->world > 1) {
    ring_call_t rc = {.dm = &dm, .q = q->data, .o_acc = o_acc, .lse_acc = lse_acc};
    if (plan->gathered) MTRAIN_TRY(gather_bars(ctx, plan, &dm, k, v, &kbar, &vbar));
    rc.kbar = kbar;
    rc.vbar = vbar;
    mtrain_ring_args_t ra = {.backward = 0,
                             .dtype = dm.dtype,
                             .chunk_elems = (size_t)(dm.tokens * dm.hkv * dm.d),
                             .k = k->data,
                             .v = v->data,
                             .step = ring_fwd_step,
                             .user = &rc};
    MTRAIN_TRY(mtrain_ring_run(ctx, plan, &ra));
  }
  for (int32_t s = 0; plan->world == 1 && s < plan->num_seqs; s++) {
    const mtrain_plan_seq_t *ps = &plan->seqs[s];
    int64_t off = ps->local_offset;
    for (int32_t t = 0; t < plan->num_steps; t++) {
      mtrain_fwd_step_args_t a = {.view = &ps->steps[t].view,
                                  .num_kv_heads = dm.hkv,
                                  .head_dim = dm.d,
                                  .scale = dm.scale,
                                  .dtype = dm.dtype,
                                  .q = row_ptr(q->data, off, dm.hq, dm.d, esz),
                                  .k = row_ptr(k->data, off, dm.hkv, dm.d, esz),
                                  .v = row_ptr(v->data, off, dm.hkv, dm.d, esz),
                                  .o_acc = (void *)row_ptr(o_acc, off, dm.hq, dm.d, acc),
                                  .lse_acc = (void *)row_ptr(lse_acc, off, dm.hq, 1, acc)};
      const double t0 = mtrain_now();
      MTRAIN_TRY(be->attn_fwd_step(ctx->backend_state, &a));
      ctx->last_stats.compute_seconds += mtrain_now() - t0;
      ctx->last_stats.ring_seconds += mtrain_now() - t0;
      ctx->last_stats.steps++;
    }
  }
  MTRAIN_TRY(be->convert(ctx->backend_state, o_acc, be->acc_dtype, o->data, o->dtype,
                         dm.tokens * dm.hq * dm.d));
  MTRAIN_TRY(be->convert(ctx->backend_state, lse_acc, be->acc_dtype, lse->data, lse->dtype,
                         dm.tokens * dm.hq));
  MTRAIN_TRY(be->synchronize(ctx->backend_state));
  ctx->last_stats.seconds = mtrain_now() - call_start;
cleanup:
  backend_free(ctx, kbar);
  backend_free(ctx, vbar);
  backend_free(ctx, o_acc);
  backend_free(ctx, lse_acc);
  return st;
}

mtrain_status_t mtrain_attention_backward(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                          const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                          const mtrain_tensor_t *v, const mtrain_tensor_t *o,
                                          const mtrain_tensor_t *lse, const mtrain_tensor_t *dout,
                                          mtrain_tensor_t *dq, mtrain_tensor_t *dk,
                                          mtrain_tensor_t *dv) {
  attn_dims_t dm = {0};
  mtrain_status_t st = check_common(ctx, plan, q, k, v, &dm);
  if (st) return st;
  if ((st = check_shape("o", o, dm.tokens, dm.hq, dm.d))) return st;
  if ((st = check_dtype("o", o, dm.dtype))) return st;
  if ((st = check_shape("lse", lse, dm.tokens, dm.hq, -1))) return st;
  if ((st = check_lse_dtype(lse))) return st;
  if ((st = check_shape("dout", dout, dm.tokens, dm.hq, dm.d))) return st;
  if ((st = check_dtype("dout", dout, dm.dtype))) return st;
  if ((st = check_shape("dq", dq, dm.tokens, dm.hq, dm.d))) return st;
  if ((st = check_dtype("dq", dq, dm.dtype))) return st;
  if ((st = check_shape("dk", dk, dm.tokens, dm.hkv, dm.d))) return st;
  if ((st = check_dtype("dk", dk, dm.dtype))) return st;
  if ((st = check_shape("dv", dv, dm.tokens, dm.hkv, dm.d))) return st;
  if ((st = check_dtype("dv", dv, dm.dtype))) return st;
  if (ctx->config.check_inputs) {
    if ((st = check_finite(ctx, plan, "q", q))) return st;
    if ((st = check_finite(ctx, plan, "k", k))) return st;
    if ((st = check_finite(ctx, plan, "v", v))) return st;
    if ((st = check_finite(ctx, plan, "o", o))) return st;
    if ((st = check_finite(ctx, plan, "lse", lse))) return st;
    if ((st = check_finite(ctx, plan, "dout", dout))) return st;
  }
  const mtrain_backend_ops_t *be = ctx->backend;
  void *bs = ctx->backend_state;
  const size_t acc = mtrain_dtype_size(be->acc_dtype), esz = mtrain_dtype_size(dm.dtype);
  const int64_t nq = dm.tokens * dm.hq * dm.d, nk = dm.tokens * dm.hkv * dm.d;
  const double call_start = mtrain_now();
  memset(&ctx->last_stats, 0, sizeof ctx->last_stats);
  void *lse_acc = NULL, *delta_acc = NULL, *dq_acc = NULL, *dk_acc = NULL, *dv_acc = NULL;
  void *kbar = NULL, *vbar = NULL, *dkbar = NULL, *dvbar = NULL;
  MTRAIN_TRY(backend_alloc(ctx, (size_t)(dm.tokens * dm.hq) * acc, &lse_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)(dm.tokens * dm.hq) * acc, &delta_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)nq * acc, &dq_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)nk * acc, &dk_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)nk * acc, &dv_acc));
  MTRAIN_TRY(be->convert(bs, lse->data, lse->dtype, lse_acc, be->acc_dtype, dm.tokens * dm.hq));
  MTRAIN_TRY(be->memset_zero(bs, dq_acc, (size_t)nq * acc));
  MTRAIN_TRY(be->memset_zero(bs, dk_acc, (size_t)nk * acc));
  MTRAIN_TRY(be->memset_zero(bs, dv_acc, (size_t)nk * acc));
  MTRAIN_TRY(
      be->attn_bwd_prepare(bs, o->data, dout->data, dm.dtype, delta_acc, dm.tokens, dm.hq, dm.d));
  if (plan->world > 1) {
    ring_call_t rc = {.dm = &dm,
                      .q = q->data,
                      .dout = dout->data,
                      .lse_acc_c = lse_acc,
                      .delta_acc = delta_acc,
                      .dq_acc = dq_acc,
                      .dk_own = dk_acc,
                      .dv_own = dv_acc};
    if (plan->gathered) {
      const size_t nbar = (size_t)(plan->gathered->count * dm.hkv * dm.d) * acc;
      MTRAIN_TRY(gather_bars(ctx, plan, &dm, k, v, &kbar, &vbar));
      MTRAIN_TRY(backend_alloc(ctx, nbar, &dkbar));
      MTRAIN_TRY(backend_alloc(ctx, nbar, &dvbar));
      MTRAIN_TRY(be->memset_zero(bs, dkbar, nbar));
      MTRAIN_TRY(be->memset_zero(bs, dvbar, nbar));
      rc.kbar = kbar;
      rc.vbar = vbar;
      rc.dkbar = dkbar;
      rc.dvbar = dvbar;
    }
    mtrain_ring_args_t ra = {.backward = 1,
                             .dtype = dm.dtype,
                             .chunk_elems = (size_t)nk,
                             .k = k->data,
                             .v = v->data,
                             .step = ring_bwd_step,
                             .add_partial = ring_add_partial,
                             .user = &rc};
    MTRAIN_TRY(mtrain_ring_run(ctx, plan, &ra));
    if (plan->gathered) MTRAIN_TRY(scatter_bar_grads(ctx, plan, &dm, dkbar, dvbar, dk_acc, dv_acc));
  }
  for (int32_t s = 0; plan->world == 1 && s < plan->num_seqs; s++) {
    const mtrain_plan_seq_t *ps = &plan->seqs[s];
    int64_t off = ps->local_offset;
    for (int32_t t = 0; t < plan->num_steps; t++) {
      mtrain_bwd_step_args_t a = {.view = &ps->steps[t].view,
                                  .num_kv_heads = dm.hkv,
                                  .head_dim = dm.d,
                                  .scale = dm.scale,
                                  .dtype = dm.dtype,
                                  .q = row_ptr(q->data, off, dm.hq, dm.d, esz),
                                  .k = row_ptr(k->data, off, dm.hkv, dm.d, esz),
                                  .v = row_ptr(v->data, off, dm.hkv, dm.d, esz),
                                  .dout = row_ptr(dout->data, off, dm.hq, dm.d, esz),
                                  .lse_acc = row_ptr(lse_acc, off, dm.hq, 1, acc),
                                  .delta_acc = row_ptr(delta_acc, off, dm.hq, 1, acc),
                                  .dq_acc = (void *)row_ptr(dq_acc, off, dm.hq, dm.d, acc),
                                  .dk_acc = (void *)row_ptr(dk_acc, off, dm.hkv, dm.d, acc),
                                  .dv_acc = (void *)row_ptr(dv_acc, off, dm.hkv, dm.d, acc)};
      const double t0 = mtrain_now();
      MTRAIN_TRY(be->attn_bwd_step(bs, &a));
      ctx->last_stats.compute_seconds += mtrain_now() - t0;
      ctx->last_stats.ring_seconds += mtrain_now() - t0;
      ctx->last_stats.steps++;
    }
  }
  MTRAIN_TRY(be->convert(bs, dq_acc, be->acc_dtype, dq->data, dq->dtype, nq));
  MTRAIN_TRY(be->convert(bs, dk_acc, be->acc_dtype, dk->data, dk->dtype, nk));
  MTRAIN_TRY(be->convert(bs, dv_acc, be->acc_dtype, dv->data, dv->dtype, nk));
  MTRAIN_TRY(be->synchronize(bs));
  ctx->last_stats.seconds = mtrain_now() - call_start;
cleanup:
  backend_free(ctx, kbar);
  backend_free(ctx, vbar);
  backend_free(ctx, dkbar);
  backend_free(ctx, dvbar);
  backend_free(ctx, lse_acc);
  backend_free(ctx, delta_acc);
  backend_free(ctx, dq_acc);
  backend_free(ctx, dk_acc);
  backend_free(ctx, dv_acc);
  return st;
}
