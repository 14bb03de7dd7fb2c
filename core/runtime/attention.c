/* attention.c: the attention entry points. Validates tensors against the plan
 * and the backend, allocates the accumulators in the backend's memory, hands
 * the steps to the ring driver (ring.c, the only step loop: one rank is the
 * ring of one), computes each step's sequences through the backend's step
 * operations, moves the gathered bars, and casts the accumulators to the
 * output dtypes. No kernel math here. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
#include "core/runtime/ring.h"
#include "mtrain/mtrain_error.h"

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
  if (plan->device && plan->device->ctx != ctx)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "plan was built on the device of another context "
                        "(mtrain_plan_create_estimated): run it on the context that built it");
  if (plan->granularity != ctx->config.granularity)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "plan granularity %d differs from the context's %d", plan->granularity,
                        ctx->config.granularity);
  for (int32_t s = 0; !ctx->backend->noncausal && s < plan->num_seqs; s++)
    if (!mtrain_pattern_is_causal(plan->seqs[s].pattern))
      return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                          "backend '%s' computes causal attention only, and sequence %d of the "
                          "plan has a non-causal pattern (mtrain_pattern_create_noncausal); run "
                          "it on the cpu or cpu-ref backend",
                          ctx->backend_name, s);
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
  if ((st = mtrain_be_supports(ctx, q->dtype, (int32_t)d))) return st;
  dims->tokens = plan->local_tokens;
  dims->hq = plan->num_heads;
  dims->hkv = (int32_t)hkv;
  dims->d = (int32_t)d;
  dims->dtype = q->dtype;
  dims->scale = ctx->config.softmax_scale > 0 ? ctx->config.softmax_scale : 1.0 / sqrt((double)d);
  return MTRAIN_SUCCESS;
}

/* NaN/Inf scan of the rows [row0, row0 + rows) of a token-major tensor.
 * With `deferred` (a stream-ordered call's output check: the message of a
 * finding) the scan is queued and its finding reported later
 * (mtrain_be_deferred_poll); otherwise it runs now. */
static mtrain_status_t scan_rows(mtrain_context_t *ctx, const char *name, const mtrain_tensor_t *t,
                                 int64_t row0, int64_t rows, const char *deferred) {
  const int64_t width = mtrain_tensor_numel(t) / (t->shape[0] > 0 ? t->shape[0] : 1);
  const int64_t head_dim = t->ndim == 3 ? t->shape[2] : 1;
  const size_t esz = mtrain_dtype_size(t->dtype);
  const void *first = (const char *)t->data + (size_t)(row0 * width) * esz;
  if (deferred)
    return mtrain_be_deferred_scan(ctx, first, t->dtype, rows * width, row0, width, head_dim,
                                   deferred);
  int64_t bad = -1;
  mtrain_status_t st = mtrain_be_find_nonfinite(ctx, first, t->dtype, rows * width, &bad);
  if (st) return st;
  if (bad >= 0) {
    bad += row0 * width;
    const int64_t row = bad / width, head = (bad % width) / head_dim;
    return mtrain_error(MTRAIN_ERR_NONFINITE,
                        "tensor '%s' holds NaN or Inf at element %lld (token %lld, head %lld)",
                        name, (long long)bad, (long long)row, (long long)head);
  }
  return MTRAIN_SUCCESS;
}

/* NaN/Inf scan of the rows that hold sequence tokens (padding slots of a
 * ring plan are skipped: their LSE is -inf by definition, no key). */
static mtrain_status_t check_finite(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                    const char *name, const mtrain_tensor_t *t,
                                    const char *deferred) {
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
        mtrain_status_t st = scan_rows(ctx, name, t, begin, end - begin, deferred);
        if (st) return st;
        begin = first;
      } else if (end == begin) {
        begin = first;
      }
      end = first + rows;
    }
  }
  return end > begin ? scan_rows(ctx, name, t, begin, end - begin, deferred) : MTRAIN_SUCCESS;
}

/* The outputs' NaN/Inf scan: every query row of a pattern sees at least its
 * own key (diagonal 0 is always in), so finite inputs give a finite LSE
 * unless a score q.k * scale overflowed the accumulator; the forward scans
 * the LSE ([T, Hq], cheap) and reports such a result instead of returning
 * it (o is then finite too: a convex combination of finite V rows). In the
 * backward, fp16 storage (largest value 65504) turns finite accumulated
 * gradients into Inf, so fp16 gradients are scanned; bf16 and fp32 share the
 * fp32 accumulators' range and are not (they overflow only where the fp32
 * sums do, with inputs near 1e19). Padding slots are skipped. A
 * stream-ordered call (`deferred`) queues the scan; its finding, with the
 * same message, comes from mtrain_context_check_deferred or a later call. */
static mtrain_status_t check_output(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                    const char *call, const char *name, const mtrain_tensor_t *t,
                                    int deferred) {
  const char *cause =
      strcmp(call, "forward") == 0
          ? "the scores q.k * scale overflowed the accumulator (inputs too large; scale q or k "
            "down)"
          : "the gradients overflowed the fp16 range (inputs too large for fp16 storage)";
  if (deferred) {
    char what[512];
    snprintf(what, sizeof what,
             "%s: output '%s' is not finite: %s (with check_inputs off, NaN or Inf inputs also "
             "give this): tensor '%s' holds NaN or Inf",
             call, name, cause, name);
    return check_finite(ctx, plan, name, t, what);
  }
  mtrain_status_t st = check_finite(ctx, plan, name, t, NULL);
  if (st != MTRAIN_ERR_NONFINITE) return st;
  return mtrain_error_prefix(
      st,
      "%s: output '%s' is not finite: %s (with check_inputs off, NaN or Inf inputs also give "
      "this)",
      call, name, cause);
}

/* Backend memory, counted per context (memory_stats.c). */
static mtrain_status_t backend_alloc(mtrain_context_t *ctx, size_t bytes, void **ptr) {
  return mtrain_be_alloc(ctx, bytes ? bytes : 1, ptr);
}

static void backend_free(mtrain_context_t *ctx, void *ptr) { mtrain_be_free(ctx, ptr); }

/* Pointer to token `row` of a [tokens, width] buffer of `elem`-byte elements. */
static void *row_at(const void *base, int64_t row, int64_t width, size_t elem) {
  return (char *)base + (size_t)(row * width) * elem;
}

/* What the ring's step callbacks need besides the chunk in hand. */
typedef struct ring_call {
  const attn_dims_t *dm;
  const void *q, *dout;
  void *o_acc, *lse_acc;             /* forward */
  const void *lse_acc_c, *delta_acc; /* backward */
  void *dq_acc;                      /* backward */
  const void *kbar, *vbar;           /* bars gathered: the vertical K/V rows */
  void *dkbar, *dvbar;               /* bars gathered, backward: their dK/dV */
} ring_call_t;

/* Bars gathered (plan_internal.h): every rank packs the K/V rows of the
 * verticals it owns, the packs are all-gathered and unpacked into
 * [K rows | V rows] of the gathered verticals. Backend permutes and one
 * host all-gather: only rows move, so the copies are bitwise the owners'. */
static mtrain_status_t gather_bars(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                   const attn_dims_t *dm, const mtrain_tensor_t *k,
                                   const mtrain_tensor_t *v, void **kvbar) {
  const mtrain_plan_gathered_t *g = plan->gathered;
  const size_t row = (size_t)dm->hkv * (size_t)dm->d * mtrain_dtype_size(dm->dtype);
  const size_t pack = 2 * (size_t)g->max_owned * row, world = (size_t)plan->world;
  void *send = NULL, *all = NULL, *host = malloc(pack * (world + 1) + 1);
  mtrain_status_t st = MTRAIN_SUCCESS;
  MTRAIN_FAIL_IF(!host, MTRAIN_ERR_OUT_OF_MEMORY, "bars gathered: out of host memory");
  MTRAIN_TRY(backend_alloc(ctx, pack, &send));
  MTRAIN_TRY(mtrain_be_permute(ctx, send, k->data, row, g->pack_rows, g->max_owned, dm->tokens, 0));
  MTRAIN_TRY(mtrain_be_permute(ctx, (char *)send + pack / 2, v->data, row, g->pack_rows,
                               g->max_owned, dm->tokens, 0));
  MTRAIN_TRY(mtrain_be_copy_to_host(ctx, host, send, pack));
  MTRAIN_TRY(mtrain_cm_allgather(ctx, host, (char *)host + pack, pack));
  MTRAIN_TRY(backend_alloc(ctx, pack * world, &all));
  MTRAIN_TRY(mtrain_be_copy_from_host(ctx, all, (char *)host + pack, pack * world));
  MTRAIN_TRY(backend_alloc(ctx, 2 * (size_t)g->count * row, kvbar));
  MTRAIN_TRY(mtrain_be_permute(ctx, *kvbar, all, row, g->unpack, 2 * g->count,
                               2 * g->max_owned * plan->world, 0));
cleanup:
  backend_free(ctx, send);
  backend_free(ctx, all);
  free(host);
  return st;
}

/* Bars gathered, backward: the dK/dV of the gathered rows summed over the
 * ranks (in the acc dtype), and each owner adds its rows to its own
 * accumulators: gather, add, scatter back. */
static mtrain_status_t scatter_bar_grads(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                         const attn_dims_t *dm, void *dbar, void *dk_acc,
                                         void *dv_acc) {
  const mtrain_plan_gathered_t *g = plan->gathered;
  const int64_t width = (int64_t)dm->hkv * dm->d;
  const size_t row = (size_t)width * mtrain_dtype_size(mtrain_be_acc_dtype(ctx));
  const size_t bytes = 2 * (size_t)g->count * row, mine = (size_t)g->owned * row;
  void *host = malloc(bytes + 1), *theirs = NULL, *own = NULL;
  mtrain_status_t st = MTRAIN_SUCCESS;
  MTRAIN_FAIL_IF(!host, MTRAIN_ERR_OUT_OF_MEMORY, "bars gathered: out of host memory");
  MTRAIN_TRY(mtrain_be_copy_to_host(ctx, host, dbar, bytes));
  MTRAIN_TRY(mtrain_cm_allreduce(ctx, host, 2 * g->count * width, mtrain_be_acc_dtype(ctx),
                                 MTRAIN_REDUCE_SUM));
  MTRAIN_TRY(mtrain_be_copy_from_host(ctx, dbar, host, bytes));
  if (g->owned > 0) {
    MTRAIN_TRY(backend_alloc(ctx, 2 * mine, &theirs));
    MTRAIN_TRY(backend_alloc(ctx, mine, &own));
    MTRAIN_TRY(
        mtrain_be_permute(ctx, theirs, dbar, row, g->owned_bars, 2 * g->owned, 2 * g->count, 0));
    void *const acc[2] = {dk_acc, dv_acc};
    for (int x = 0; x < 2; x++) {
      MTRAIN_TRY(mtrain_be_permute(ctx, own, acc[x], row, g->pack_rows, g->owned, dm->tokens, 0));
      MTRAIN_TRY(mtrain_be_add(ctx, own, (char *)theirs + (size_t)x * mine,
                               mtrain_be_acc_dtype(ctx), g->owned * width));
      MTRAIN_TRY(mtrain_be_permute(ctx, acc[x], own, row, g->pack_rows, g->owned, dm->tokens, 1));
    }
  }
cleanup:
  backend_free(ctx, theirs);
  backend_free(ctx, own);
  free(host);
  return st;
}

/* One ring step: every sequence of the batch against its part of the chunk
 * in hand (and, bars gathered, its share of the gathered bars). */
static mtrain_status_t step_fwd(mtrain_context_t *ctx, const mtrain_plan_t *plan, int32_t t,
                                const void *k, const void *v, void *dk, void *dv, void *user) {
  (void)dk;
  (void)dv;
  const ring_call_t *rc = user;
  const attn_dims_t *dm = rc->dm;
  const size_t esz = mtrain_dtype_size(dm->dtype),
               acc = mtrain_dtype_size(mtrain_be_acc_dtype(ctx));
  const int64_t qw = (int64_t)dm->hq * dm->d, kw = (int64_t)dm->hkv * dm->d;
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (int32_t s = 0; st == MTRAIN_SUCCESS && s < plan->num_seqs; s++) {
    const mtrain_plan_seq_t *ps = &plan->seqs[s];
    const int64_t off = ps->local_offset, koff = ps->steps[t].chunk_offset;
    mtrain_fwd_step_args_t a = {.view = &ps->steps[t].view,
                                .num_kv_heads = dm->hkv,
                                .head_dim = dm->d,
                                .scale = dm->scale,
                                .dtype = dm->dtype,
                                .q = row_at(rc->q, off, qw, esz),
                                .k = row_at(k, koff, kw, esz),
                                .v = row_at(v, koff, kw, esz),
                                .o_acc = row_at(rc->o_acc, off, qw, acc),
                                .lse_acc = row_at(rc->lse_acc, off, dm->hq, acc)};
    st = mtrain_be_attn_fwd_step(ctx, &a);
    if (st || !ps->bar_steps) continue;
    a.view = &ps->bar_steps[t].view; /* this step's share of the gathered bars */
    a.k = row_at(rc->kbar, ps->bar_base, kw, esz);
    a.v = row_at(rc->vbar, ps->bar_base, kw, esz);
    st = mtrain_be_attn_fwd_step(ctx, &a);
  }
  return st;
}

static mtrain_status_t step_bwd(mtrain_context_t *ctx, const mtrain_plan_t *plan, int32_t t,
                                const void *k, const void *v, void *dk, void *dv, void *user) {
  const ring_call_t *rc = user;
  const attn_dims_t *dm = rc->dm;
  const size_t esz = mtrain_dtype_size(dm->dtype),
               acc = mtrain_dtype_size(mtrain_be_acc_dtype(ctx));
  const int64_t qw = (int64_t)dm->hq * dm->d, kw = (int64_t)dm->hkv * dm->d;
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (int32_t s = 0; st == MTRAIN_SUCCESS && s < plan->num_seqs; s++) {
    const mtrain_plan_seq_t *ps = &plan->seqs[s];
    const int64_t off = ps->local_offset, koff = ps->steps[t].chunk_offset;
    mtrain_bwd_step_args_t a = {.view = &ps->steps[t].view,
                                .num_kv_heads = dm->hkv,
                                .head_dim = dm->d,
                                .scale = dm->scale,
                                .dtype = dm->dtype,
                                .q = row_at(rc->q, off, qw, esz),
                                .k = row_at(k, koff, kw, esz),
                                .v = row_at(v, koff, kw, esz),
                                .dout = row_at(rc->dout, off, qw, esz),
                                .lse_acc = row_at(rc->lse_acc_c, off, dm->hq, acc),
                                .delta_acc = row_at(rc->delta_acc, off, dm->hq, acc),
                                .dq_acc = row_at(rc->dq_acc, off, qw, acc),
                                .dk_acc = row_at(dk, koff, kw, acc),
                                .dv_acc = row_at(dv, koff, kw, acc)};
    st = mtrain_be_attn_bwd_step(ctx, &a);
    if (st || !ps->bar_steps) continue;
    a.view = &ps->bar_steps[t].view;
    a.k = row_at(rc->kbar, ps->bar_base, kw, esz);
    a.v = row_at(rc->vbar, ps->bar_base, kw, esz);
    a.dk_acc = row_at(rc->dkbar, ps->bar_base, kw, acc);
    a.dv_acc = row_at(rc->dvbar, ps->bar_base, kw, acc);
    st = mtrain_be_attn_bwd_step(ctx, &a);
  }
  return st;
}

/* The forward over the ring into the backend's accumulators: o_acc and
 * lse_acc are initialised here; bars gathered are moved first. */
static mtrain_status_t forward_ring(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                    const attn_dims_t *dm, const mtrain_tensor_t *q,
                                    const mtrain_tensor_t *k, const mtrain_tensor_t *v, void *o_acc,
                                    void *lse_acc) {
  const size_t esz = mtrain_dtype_size(dm->dtype);
  void *kvbar = NULL;
  mtrain_status_t st = MTRAIN_SUCCESS;
  MTRAIN_TRY(mtrain_be_attn_fwd_init(ctx, o_acc, lse_acc, dm->tokens, dm->hq, dm->d));
  ring_call_t rc = {.dm = dm, .q = q->data, .o_acc = o_acc, .lse_acc = lse_acc};
  if (plan->gathered) {
    MTRAIN_TRY(gather_bars(ctx, plan, dm, k, v, &kvbar));
    rc.kbar = kvbar;
    rc.vbar = (const char *)kvbar + (size_t)(plan->gathered->count * dm->hkv * dm->d) * esz;
  }
  mtrain_ring_args_t ra = {.backward = 0,
                           .dtype = dm->dtype,
                           .chunk_elems = (size_t)(dm->tokens * dm->hkv * dm->d),
                           .k = k->data,
                           .v = v->data,
                           .step = step_fwd,
                           .user = &rc};
  MTRAIN_TRY(mtrain_ring_run(ctx, plan, &ra));
cleanup:
  backend_free(ctx, kvbar);
  return st;
}

/* The backward's LSE in the accumulator dtype. A backend whose accumulator
 * is wider than the LSE it is given (the fp64 oracle given an fp32 LSE)
 * recomputes it with a forward pass instead of widening it: probabilities
 * exp(s - LSE) taken from a rounded LSE are off by a factor exp(ulp(LSE)),
 * which for large scores (|LSE| ~ 5e8 in fp32: ulp 32) is no probability
 * at all. The recomputation's memory is the forward's, below the
 * backward's own peak (docs/MEMORY.md). */
static mtrain_status_t backward_lse(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                    const attn_dims_t *dm, const mtrain_tensor_t *q,
                                    const mtrain_tensor_t *k, const mtrain_tensor_t *v,
                                    const mtrain_tensor_t *lse, void *lse_acc) {
  if (mtrain_dtype_size(mtrain_be_acc_dtype(ctx)) <= mtrain_dtype_size(lse->dtype))
    return mtrain_be_convert(ctx, lse->data, lse->dtype, lse_acc, mtrain_be_acc_dtype(ctx),
                             dm->tokens * dm->hq);
  void *o_tmp = NULL;
  mtrain_status_t st = MTRAIN_SUCCESS;
  MTRAIN_TRY(backend_alloc(
      ctx, (size_t)(dm->tokens * dm->hq * dm->d) * mtrain_dtype_size(mtrain_be_acc_dtype(ctx)),
      &o_tmp));
  MTRAIN_TRY(forward_ring(ctx, plan, dm, q, k, v, o_tmp, lse_acc));
cleanup:
  backend_free(ctx, o_tmp);
  return st;
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
  /* stream-ordered mode (single rank): the call returns once queued; the
   * completed findings of earlier calls' deferred scans are reported first */
  const int async = plan->world == 1 && mtrain_be_async(ctx);
  if ((st = mtrain_be_deferred_poll(ctx, 0))) return st;
  if (ctx->config.check_inputs) {
    if ((st = check_finite(ctx, plan, "q", q, NULL))) return st;
    if ((st = check_finite(ctx, plan, "k", k, NULL))) return st;
    if ((st = check_finite(ctx, plan, "v", v, NULL))) return st;
  }
  const double call_start = mtrain_now();
  memset(&ctx->last_stats, 0, sizeof ctx->last_stats);
  const size_t acc = mtrain_dtype_size(mtrain_be_acc_dtype(ctx));
  void *o_acc = NULL, *lse_acc = NULL;
  MTRAIN_TRY(backend_alloc(ctx, (size_t)(dm.tokens * dm.hq * dm.d) * acc, &o_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)(dm.tokens * dm.hq) * acc, &lse_acc));
  MTRAIN_TRY(forward_ring(ctx, plan, &dm, q, k, v, o_acc, lse_acc));
  MTRAIN_TRY(mtrain_be_convert(ctx, o_acc, mtrain_be_acc_dtype(ctx), o->data, o->dtype,
                               dm.tokens * dm.hq * dm.d));
  MTRAIN_TRY(mtrain_be_convert(ctx, lse_acc, mtrain_be_acc_dtype(ctx), lse->data, lse->dtype,
                               dm.tokens * dm.hq));
  if (!async) MTRAIN_TRY(mtrain_be_synchronize(ctx));
  MTRAIN_TRY(check_output(ctx, plan, "forward", "lse", lse, async));
  ctx->last_stats.seconds = mtrain_now() - call_start;
cleanup:
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
  const int async = plan->world == 1 && mtrain_be_async(ctx); /* as in the forward */
  if ((st = mtrain_be_deferred_poll(ctx, 0))) return st;
  if (ctx->config.check_inputs) {
    if ((st = check_finite(ctx, plan, "q", q, NULL))) return st;
    if ((st = check_finite(ctx, plan, "k", k, NULL))) return st;
    if ((st = check_finite(ctx, plan, "v", v, NULL))) return st;
    if ((st = check_finite(ctx, plan, "o", o, NULL))) return st;
    if ((st = check_finite(ctx, plan, "lse", lse, NULL))) return st;
    if ((st = check_finite(ctx, plan, "dout", dout, NULL))) return st;
  }
  const size_t acc = mtrain_dtype_size(mtrain_be_acc_dtype(ctx)), esz = mtrain_dtype_size(dm.dtype);
  const int64_t nq = dm.tokens * dm.hq * dm.d, nk = dm.tokens * dm.hkv * dm.d;
  const double call_start = mtrain_now();
  memset(&ctx->last_stats, 0, sizeof ctx->last_stats);
  void *lse_acc = NULL, *delta_acc = NULL, *dq_acc = NULL, *dk_acc = NULL, *dv_acc = NULL;
  void *kvbar = NULL, *dbar = NULL;
  MTRAIN_TRY(backend_alloc(ctx, (size_t)(dm.tokens * dm.hq) * acc, &lse_acc));
  MTRAIN_TRY(backward_lse(ctx, plan, &dm, q, k, v, lse, lse_acc));
  memset(&ctx->last_stats, 0, sizeof ctx->last_stats); /* a recomputation's steps are not counted */
  MTRAIN_TRY(backend_alloc(ctx, (size_t)(dm.tokens * dm.hq) * acc, &delta_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)nq * acc, &dq_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)nk * acc, &dk_acc));
  MTRAIN_TRY(backend_alloc(ctx, (size_t)nk * acc, &dv_acc));
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, dq_acc, (size_t)nq * acc));
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, dk_acc, (size_t)nk * acc));
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, dv_acc, (size_t)nk * acc));
  MTRAIN_TRY(mtrain_be_attn_bwd_prepare(ctx, o->data, dout->data, dm.dtype, delta_acc, dm.tokens,
                                        dm.hq, dm.d));
  ring_call_t rc = {.dm = &dm,
                    .q = q->data,
                    .dout = dout->data,
                    .lse_acc_c = lse_acc,
                    .delta_acc = delta_acc,
                    .dq_acc = dq_acc};
  if (plan->gathered) {
    const int64_t nbar = plan->gathered->count * dm.hkv * dm.d;
    const size_t dbar_bytes = 2 * (size_t)nbar * acc;
    MTRAIN_TRY(gather_bars(ctx, plan, &dm, k, v, &kvbar));
    MTRAIN_TRY(backend_alloc(ctx, dbar_bytes, &dbar));
    MTRAIN_TRY(mtrain_be_memset_zero(ctx, dbar, dbar_bytes));
    rc.kbar = kvbar;
    rc.vbar = (const char *)kvbar + (size_t)nbar * esz;
    rc.dkbar = dbar;
    rc.dvbar = (char *)dbar + (size_t)nbar * acc;
  }
  mtrain_ring_args_t ra = {.backward = 1,
                           .dtype = dm.dtype,
                           .chunk_elems = (size_t)nk,
                           .k = k->data,
                           .v = v->data,
                           .dk_own = dk_acc,
                           .dv_own = dv_acc,
                           .step = step_bwd,
                           .user = &rc};
  MTRAIN_TRY(mtrain_ring_run(ctx, plan, &ra));
  if (plan->gathered) MTRAIN_TRY(scatter_bar_grads(ctx, plan, &dm, dbar, dk_acc, dv_acc));
  MTRAIN_TRY(mtrain_be_convert(ctx, dq_acc, mtrain_be_acc_dtype(ctx), dq->data, dq->dtype, nq));
  MTRAIN_TRY(mtrain_be_convert(ctx, dk_acc, mtrain_be_acc_dtype(ctx), dk->data, dk->dtype, nk));
  MTRAIN_TRY(mtrain_be_convert(ctx, dv_acc, mtrain_be_acc_dtype(ctx), dv->data, dv->dtype, nk));
  if (!async) MTRAIN_TRY(mtrain_be_synchronize(ctx));
  if (dm.dtype == MTRAIN_F16) {
    MTRAIN_TRY(check_output(ctx, plan, "backward", "dq", dq, async));
    MTRAIN_TRY(check_output(ctx, plan, "backward", "dk", dk, async));
    MTRAIN_TRY(check_output(ctx, plan, "backward", "dv", dv, async));
  }
  ctx->last_stats.seconds = mtrain_now() - call_start;
cleanup:
  backend_free(ctx, kvbar);
  backend_free(ctx, dbar);
  backend_free(ctx, lse_acc);
  backend_free(ctx, delta_acc);
  backend_free(ctx, dq_acc);
  backend_free(ctx, dk_acc);
  backend_free(ctx, dv_acc);
  return st;
}
