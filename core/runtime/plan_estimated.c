/* plan_estimated.c: the plan of an online-estimated batch in one call
 * (mtrain_plan_create_estimated). Where the backend builds plans itself (the
 * device_plan slots: "cuda"), the selection and the plan's step tables stay
 * in backend memory and the call returns once they are queued; the plan then
 * holds shells of its patterns (their geometry) and reads the real ones back
 * only when they are asked for (mtrain_plan_pattern, computed pairs).
 * Elsewhere it is mtrain_pattern_estimate_batch then mtrain_plan_create. The
 * plan's step views carry the backend's handle (mtrain_step_view_t
 * .device_tables), so attention.c and ring.c run it as any one-rank plan. */
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/estimate_core.h"
#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain_error.h"

void mtrain_plan_device_free(mtrain_plan_device_t *d) {
  if (!d) return;
  mtrain_be_device_plan_release(d->ctx, d->handle);
  mtrain_be_free(d->ctx, d->memory);
  free(d);
}

/* The plan around a backend-built batch: one step per sequence whose view
 * carries the handle; shells for the patterns. Takes dev (freed with the
 * plan, or here on error). */
static mtrain_status_t device_plan_shell(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                         int32_t num_heads, mtrain_plan_device_t *dev,
                                         mtrain_plan_t **out) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  const int32_t count = seqs->num_seqs, G = ctx->config.granularity;
  mtrain_plan_t *plan = calloc(1, sizeof *plan);
  if (!plan) {
    mtrain_plan_device_free(dev);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  }
  plan->device = dev;
  plan->num_seqs = count;
  plan->num_steps = 1;
  plan->num_heads = num_heads;
  plan->granularity = G;
  plan->world = 1;
  plan->computed_pairs = -1; /* read on demand */
  plan->seqs = calloc((size_t)count, sizeof *plan->seqs);
  MTRAIN_FAIL_IF(!plan->seqs, MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  for (int32_t s = 0; s < count; s++) {
    mtrain_plan_seq_t *ps = &plan->seqs[s];
    const int64_t N = seqs->offsets[s + 1] - seqs->offsets[s];
    MTRAIN_TRY(mtrain_pattern_create(N, num_heads, G, &ps->pattern));
    const int32_t nb = (int32_t)ps->pattern->num_blocks;
    ps->local_offset = seqs->offsets[s];
    ps->q_global = malloc(sizeof(int64_t) * (size_t)(nb + 1));
    ps->steps = calloc(1, sizeof *ps->steps);
    MTRAIN_FAIL_IF(!ps->q_global || !ps->steps, MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
    for (int32_t b = 0; b < nb; b++) ps->q_global[b] = b;
    ps->q = (mtrain_rank_blocks_t){.num_blocks = nb, .global = ps->q_global, .tokens = N};
    mtrain_plan_step_t *step = &ps->steps[0];
    step->src_rank = 0;
    step->chunk_offset = ps->local_offset;
    step->k = ps->q;
    step->view = (mtrain_step_view_t){.step = 0,
                                      .src_rank = 0,
                                      .granularity = G,
                                      .num_heads = num_heads,
                                      .seq_len = N,
                                      .q_tokens = N,
                                      .k_tokens = N,
                                      .num_q_blocks = nb,
                                      .num_k_blocks = nb,
                                      .q_block_global = ps->q_global,
                                      .k_block_global = ps->q_global,
                                      .heads = NULL,
                                      .causal = 1,
                                      .device_tables = dev->handle,
                                      .device_seq = s};
    plan->local_tokens += N;
    plan->bytes += sizeof(int64_t) * (size_t)(nb + 1) + sizeof *ps->steps;
  }
  plan->bytes += sizeof *plan + (size_t)count * sizeof *plan->seqs + dev->bytes;
  *out = plan;
  return MTRAIN_SUCCESS;
cleanup:
  mtrain_plan_destroy(plan);
  return st;
}

mtrain_status_t mtrain_plan_create_estimated(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                             const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                             const mtrain_head_budget_t *budgets,
                                             const mtrain_estimate_options_t *options,
                                             mtrain_plan_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  *out = NULL;
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(seqs);
  MTRAIN_CHECK_NOT_NULL(k);
  if (seqs->num_seqs < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "estimated plan: num_seqs must be >= 1, got %d", seqs->num_seqs);
  mtrain_pattern_t **patterns = calloc((size_t)seqs->num_seqs, sizeof *patterns);
  if (!patterns) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "estimated plan: out of memory");
  estimate_device_plan_t dev = {.num_kv_heads = k->ndim == 3 ? (int32_t)k->shape[1] : 0};
  mtrain_status_t st =
      mtrain_estimate_batch_or_plan(ctx, seqs, q, k, budgets, options, patterns, &dev);
  if (!st && dev.handle) {
    mtrain_plan_device_t *d = calloc(1, sizeof *d);
    if (!d) {
      mtrain_be_device_plan_release(ctx, dev.handle);
      mtrain_be_free(ctx, dev.memory);
      st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "estimated plan: out of memory");
    } else {
      *d = (mtrain_plan_device_t){.ctx = ctx,
                                  .handle = dev.handle,
                                  .memory = dev.memory,
                                  .bytes = dev.bytes,
                                  .num_kv_heads = dev.num_kv_heads};
      st = device_plan_shell(ctx, seqs, (int32_t)q->shape[1], d, out);
    }
  } else if (!st) {
    st = mtrain_plan_create(ctx, seqs, (const mtrain_pattern_t *const *)patterns, out);
  }
  for (int32_t s = 0; s < seqs->num_seqs; s++) mtrain_pattern_destroy(patterns[s]);
  free(patterns);
  return st;
}

int mtrain_plan_on_device(const mtrain_plan_t *plan) { return plan && plan->device ? 1 : 0; }

/* Reads a backend-built plan's patterns (into its shells) and pairs back:
 * waits for the backend. Once; later calls return at once. */
static mtrain_status_t device_read(mtrain_plan_t *plan) {
  mtrain_plan_device_t *d = plan->device;
  if (!d || d->read) return MTRAIN_SUCCESS;
  mtrain_status_t st = MTRAIN_SUCCESS;
  const int32_t count = plan->num_seqs, Hq = plan->num_heads, G = plan->granularity;
  mtrain_select_args_t *args = calloc((size_t)count, sizeof *args);
  int64_t *pairs = malloc(sizeof(int64_t) * (size_t)count * (size_t)Hq);
  void **host = calloc((size_t)count, sizeof *host);
  MTRAIN_FAIL_IF(!args || !pairs || !host, MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  for (int32_t s = 0; s < count; s++) {
    const int64_t N = plan->seqs[s].pattern->seq_len, nb = plan->seqs[s].pattern->num_blocks;
    const size_t bytes = sizeof(int64_t) * (size_t)Hq * (size_t)N +
                         sizeof(int32_t) * ((size_t)Hq * (size_t)(nb + 1) + 2 * (size_t)Hq);
    host[s] = malloc(bytes);
    MTRAIN_FAIL_IF(!host[s], MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
    int64_t *verticals = host[s];
    int32_t *diagonals = (int32_t *)(verticals + (size_t)Hq * (size_t)N);
    int32_t *num_diagonals = diagonals + (size_t)Hq * (size_t)(nb + 1);
    args[s] = (mtrain_select_args_t){.seq_len = N,
                                     .granularity = G,
                                     .num_heads = Hq,
                                     .verticals = verticals,
                                     .num_verticals = num_diagonals + Hq,
                                     .diagonals = diagonals,
                                     .num_diagonals = num_diagonals};
  }
  const mtrain_device_plan_args_t pa = {
      .count = count, .num_kv_heads = d->num_kv_heads, .select = args};
  MTRAIN_TRY(mtrain_be_device_plan_read(d->ctx, d->handle, &pa, pairs));
  int64_t total = 0;
  for (int32_t s = 0; s < count; s++) {
    const mtrain_select_args_t *a = &args[s];
    const int64_t nb = plan->seqs[s].pattern->num_blocks;
    for (int32_t h = 0; h < Hq; h++) {
      st = mtrain_pattern_set_head(
          plan->seqs[s].pattern, h, a->diagonals + (size_t)h * (size_t)(nb + 1),
          a->num_diagonals[h], a->verticals + (size_t)h * (size_t)a->seq_len, a->num_verticals[h]);
      if (st) {
        st = mtrain_error(st,
                          "plan: the backend's selection of head %d of sequence %d is not a "
                          "pattern (%s)",
                          h, s, mtrain_status_name(st));
        goto cleanup;
      }
      total += pairs[(size_t)s * (size_t)Hq + (size_t)h];
    }
  }
  plan->computed_pairs = total;
  d->read = 1;
cleanup:
  for (int32_t s = 0; host && s < count; s++) free(host[s]);
  free(host);
  free(args);
  free(pairs);
  return st;
}

mtrain_status_t mtrain_plan_pattern(mtrain_plan_t *plan, int32_t seq,
                                    const mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(plan);
  MTRAIN_CHECK_NOT_NULL(out);
  *out = NULL;
  if (seq < 0 || seq >= plan->num_seqs)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "plan: sequence %d out of range [0, %d)", seq,
                        plan->num_seqs);
  mtrain_status_t st = device_read(plan);
  if (st) return st;
  *out = plan->seqs[seq].pattern;
  return MTRAIN_SUCCESS;
}

int64_t mtrain_plan_computed_pairs(const mtrain_plan_t *plan) {
  if (!plan) return 0;
  /* reading a backend-built plan's pairs fills in what the plan defers: the
   * plan is logically unchanged */
  if (plan->device && device_read((mtrain_plan_t *)plan)) return -1;
  return plan->computed_pairs;
}
