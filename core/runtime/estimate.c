/* estimate.c: the public entry points of the online vertical-slash
 * estimate (SPEC.md section 2): one sequence, a packed batch of sequences
 * on one rank, and one sequence laid out over the ranks of a ring. They
 * check their inputs and describe each sequence's last queries and keys;
 * the stages and the selection are estimate_core.c's. Single rank: the
 * chunk is the whole sequence; ring: each rank scores its own slots of the
 * layout after the last L queries are gathered. */
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/estimate_core.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"

static mtrain_status_t check_inputs(mtrain_context_t *ctx, const mtrain_tensor_t *q,
                                    const mtrain_tensor_t *k, const mtrain_head_budget_t *budgets,
                                    const mtrain_estimate_options_t *o) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(q);
  MTRAIN_CHECK_NOT_NULL(k);
  MTRAIN_CHECK_NOT_NULL(budgets);
  MTRAIN_CHECK_NOT_NULL(o);
  if (q->ndim != 3 || k->ndim != 3)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "estimate: q and k must be [tokens, heads, head_dim] (ndim %d and %d)",
                        q->ndim, k->ndim);
  if (q->shape[0] < 1 || k->shape[0] != q->shape[0])
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "estimate: q has %lld tokens, k has %lld",
                        (long long)q->shape[0], (long long)k->shape[0]);
  if (k->shape[2] != q->shape[2])
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "estimate: q has head_dim %lld, k has %lld",
                        (long long)q->shape[2], (long long)k->shape[2]);
  if (k->shape[1] < 1 || q->shape[1] % k->shape[1] != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                        "estimate: query heads %lld are not a multiple of kv heads %lld",
                        (long long)q->shape[1], (long long)k->shape[1]);
  if (k->dtype != q->dtype)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "estimate: q is %s but k is %s",
                        mtrain_dtype_name(q->dtype), mtrain_dtype_name(k->dtype));
  if (!q->data || !k->data)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "estimate: tensor '%s' has data == NULL",
                        q->data ? "k" : "q");
  if (o->last_q < 1 || o->num_sinks < 0 || o->window < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "estimate: options last_q %d (>= 1), num_sinks %d and window %d (>= 0)",
                        o->last_q, o->num_sinks, o->window);
  if (o->top_p_forced != 0 && o->top_p_forced != 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "estimate: options top_p_forced %d (0 or 1)",
                        o->top_p_forced);
  for (int64_t h = 0; h < q->shape[1]; h++) {
    mtrain_status_t st = mtrain_head_budget_validate(&budgets[h]);
    if (st) return mtrain_error_prefix(st, "estimate: budgets[%lld]", (long long)h);
  }
  if (!mtrain_be_has_pattern_scores(ctx))
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED, "estimate: backend '%s' has no pattern scores",
                        ctx->backend_name);
  return mtrain_be_supports(ctx, q->dtype, (int32_t)q->shape[2]);
}

/* The packed sequences [offsets[s], offsets[s+1]) of q and k (one rank),
 * estimated together. */
static mtrain_status_t estimate_packed(mtrain_context_t *ctx, const int64_t *offsets, int32_t count,
                                       const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                       const mtrain_head_budget_t *budgets,
                                       const mtrain_estimate_options_t *options,
                                       mtrain_pattern_t **out, estimate_device_plan_t *device) {
  const int32_t G = ctx->config.granularity;
  const int32_t Hq = (int32_t)q->shape[1], Hkv = (int32_t)k->shape[1], d = (int32_t)q->shape[2];
  int64_t max_nb = 0;
  for (int32_t s = 0; s < count; s++) {
    const int64_t nb = (offsets[s + 1] - offsets[s] + G - 1) / G;
    if (nb > max_nb) max_nb = nb;
  }
  int64_t *identity = malloc(sizeof(int64_t) * (size_t)max_nb);
  estimate_input_t *in = malloc(sizeof *in * (size_t)count);
  if (!identity || !in) {
    free(identity);
    free(in);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of memory (%d sequences)", count);
  }
  for (int64_t gb = 0; gb < max_nb; gb++) identity[gb] = gb;
  const size_t q_row = (size_t)Hq * d * mtrain_dtype_size(q->dtype);
  const size_t k_row = (size_t)Hkv * d * mtrain_dtype_size(k->dtype);
  for (int32_t s = 0; s < count; s++) {
    const int64_t N = offsets[s + 1] - offsets[s];
    const int32_t L = options->last_q < N ? options->last_q : (int32_t)N;
    in[s] =
        (estimate_input_t){.N = N,
                           .Hq = Hq,
                           .Hkv = Hkv,
                           .d = d,
                           .L = L,
                           .q_dtype = q->dtype,
                           .k_dtype = k->dtype,
                           .q_last = (const char *)q->data + (size_t)(offsets[s] + N - L) * q_row,
                           .k = (const char *)k->data + (size_t)offsets[s] * k_row,
                           .k_tokens = N,
                           .num_k_blocks = (int32_t)((N + G - 1) / G),
                           .k_block_global = identity};
  }
  mtrain_status_t st = mtrain_estimate_core(ctx, in, count, budgets, options, out, device);
  free(in);
  free(identity);
  return st;
}

static mtrain_status_t check_one_rank(mtrain_context_t *ctx, const char *alternative) {
  if (mtrain_context_world(ctx) == 1) return MTRAIN_SUCCESS;
  return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "estimate: world size %d: %s",
                      mtrain_context_world(ctx), alternative);
}

mtrain_status_t mtrain_pattern_estimate(mtrain_context_t *ctx, const mtrain_tensor_t *q,
                                        const mtrain_tensor_t *k,
                                        const mtrain_head_budget_t *budgets,
                                        const mtrain_estimate_options_t *options,
                                        mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  *out = NULL;
  mtrain_status_t st = check_inputs(ctx, q, k, budgets, options);
  if (!st)
    st = check_one_rank(ctx, "use mtrain_pattern_estimate_ring with the layout of the ranks' "
                             "tensors");
  if (st) return st;
  const int64_t offsets[2] = {0, q->shape[0]};
  return estimate_packed(ctx, offsets, 1, q, k, budgets, options, out, NULL);
}

mtrain_status_t mtrain_pattern_estimate_batch(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                              const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                              const mtrain_head_budget_t *budgets,
                                              const mtrain_estimate_options_t *options,
                                              mtrain_pattern_t **out) {
  return mtrain_estimate_batch_or_plan(ctx, seqs, q, k, budgets, options, out, NULL);
}

mtrain_status_t mtrain_estimate_batch_or_plan(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                              const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                              const mtrain_head_budget_t *budgets,
                                              const mtrain_estimate_options_t *options,
                                              mtrain_pattern_t **out,
                                              estimate_device_plan_t *device) {
  MTRAIN_CHECK_NOT_NULL(seqs);
  MTRAIN_CHECK_NOT_NULL(out);
  if (seqs->num_seqs < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "estimate batch: num_seqs must be >= 1, got %d", seqs->num_seqs);
  for (int32_t s = 0; s < seqs->num_seqs; s++) out[s] = NULL;
  if (!seqs->offsets)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "estimate batch: seqs->offsets is NULL");
  mtrain_status_t st = check_inputs(ctx, q, k, budgets, options);
  if (!st)
    st = check_one_rank(ctx, "estimate each sequence with mtrain_pattern_estimate_ring and its "
                             "layout");
  if (st) return st;
  if (seqs->offsets[0] != 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "estimate batch: seqs->offsets[0] is %lld, must be 0",
                        (long long)seqs->offsets[0]);
  for (int32_t s = 0; s < seqs->num_seqs; s++)
    if (seqs->offsets[s + 1] <= seqs->offsets[s])
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "estimate batch: sequence %d has length %lld (offsets must increase)", s,
                          (long long)(seqs->offsets[s + 1] - seqs->offsets[s]));
  if (seqs->offsets[seqs->num_seqs] != q->shape[0])
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "estimate batch: the %d sequences hold %lld tokens, q and k have %lld",
                        seqs->num_seqs, (long long)seqs->offsets[seqs->num_seqs],
                        (long long)q->shape[0]);
  return estimate_packed(ctx, seqs->offsets, seqs->num_seqs, q, k, budgets, options, out, device);
}

mtrain_status_t mtrain_pattern_estimate_ring(mtrain_context_t *ctx,
                                             const struct mtrain_layout *layout,
                                             const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                             const mtrain_head_budget_t *budgets,
                                             const mtrain_estimate_options_t *options,
                                             mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  MTRAIN_CHECK_NOT_NULL(layout);
  mtrain_status_t st = check_inputs(ctx, q, k, budgets, options);
  if (st) return st;
  const int32_t rank = mtrain_context_rank(ctx), world = mtrain_context_world(ctx);
  const int64_t N = mtrain_layout_seq_len(layout), T = mtrain_layout_local_tokens(layout, rank);
  if (mtrain_layout_world(layout) != world)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "estimate: the layout is for %d ranks, the communicator has %d",
                        mtrain_layout_world(layout), world);
  if (mtrain_layout_granularity(layout) != ctx->config.granularity)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "estimate: the layout's granularity %d is not the context's %d",
                        mtrain_layout_granularity(layout), ctx->config.granularity);
  if (q->shape[0] != T)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "estimate: rank %d holds %lld token slots of the layout, q has %lld", rank,
                        (long long)T, (long long)q->shape[0]);
  const int32_t Hq = (int32_t)q->shape[1], d = (int32_t)q->shape[2];
  const int32_t L = options->last_q < N ? options->last_q : (int32_t)N;
  const mtrain_dtype_t gdt = q->dtype == MTRAIN_F64 ? MTRAIN_F64 : MTRAIN_F32;
  const size_t row = (size_t)Hq * d, gsz = mtrain_dtype_size(gdt);
  /* gather the last L queries: each row has one owner, the others add zeros */
  void *host = calloc((size_t)L * row, gsz),
       *q_local_row = malloc(row * mtrain_dtype_size(q->dtype));
  void *q_last = NULL;
  if (!host || !q_local_row) {
    free(host);
    free(q_local_row);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of memory");
  }
  for (int32_t r = 0; r < L && st == MTRAIN_SUCCESS; r++) {
    int32_t owner = -1;
    int64_t local = -1;
    st = mtrain_layout_global_to_local(layout, N - L + r, &owner, &local);
    if (st || owner != rank) continue;
    st = mtrain_be_copy_to_host(
        ctx, q_local_row, (const char *)q->data + (size_t)local * row * mtrain_dtype_size(q->dtype),
        row * mtrain_dtype_size(q->dtype));
    if (!st)
      st = mtrain_convert(q_local_row, q->dtype, (char *)host + (size_t)r * row * gsz, gdt,
                          (int64_t)row);
  }
  if (!st) st = mtrain_cm_allreduce(ctx, host, (int64_t)((size_t)L * row), gdt, MTRAIN_REDUCE_SUM);
  if (!st) st = mtrain_be_alloc(ctx, (size_t)L * row * gsz, &q_last);
  if (!st) st = mtrain_be_copy_from_host(ctx, q_last, host, (size_t)L * row * gsz);
  if (!st) {
    const estimate_input_t in = {.N = N,
                                 .Hq = Hq,
                                 .Hkv = (int32_t)k->shape[1],
                                 .d = d,
                                 .L = L,
                                 .q_dtype = gdt,
                                 .k_dtype = k->dtype,
                                 .q_last = q_last,
                                 .k = k->data,
                                 .k_tokens = T,
                                 .num_k_blocks = mtrain_layout_rank_num_blocks(layout, rank),
                                 .k_block_global = mtrain_layout_rank_blocks(layout, rank)};
    st = mtrain_estimate_core(ctx, &in, 1, budgets, options, out, NULL);
  }
  mtrain_be_free(ctx, q_last);
  free(host);
  free(q_local_row);
  return st;
}
