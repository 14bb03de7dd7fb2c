/* estimate_core.h (private): the scoring and selection of the vertical-slash
 * estimate (SPEC.md section 2) for one or several sequences at once. The
 * public entry points (estimate.c) check their inputs and describe each
 * sequence as an estimate_input_t; the core runs every stage for all the
 * sequences before the next stage, so a packed batch waits for the backend
 * once per stage, not once per sequence. */
#ifndef MTRAIN_CORE_ESTIMATE_CORE_H
#define MTRAIN_CORE_ESTIMATE_CORE_H

#include "mtrain/mtrain.h"

/* What one sequence's scores are computed from: the last L queries
 * (gathered) and the keys this rank holds, with their global blocks. */
typedef struct estimate_input {
  int64_t N;
  int32_t Hq, Hkv, d, L;
  mtrain_dtype_t q_dtype, k_dtype;
  const void *q_last; /* backend memory [L, Hq, d] */
  const void *k;      /* backend memory [k_tokens, Hkv, d] */
  int64_t k_tokens;
  int32_t num_k_blocks;
  const int64_t *k_block_global;
} estimate_input_t;

/* A plan built on the backend instead of patterns (mtrain_plan_create_estimated):
 * the caller sets num_kv_heads; when the backend takes the batch (one rank,
 * the device_plan slots, budgets its selection takes, MTRAIN_PLAN_ON_HOST
 * unset) the core sets handle (the backend's) and memory/bytes (backend
 * memory from mtrain_be_alloc, the caller's to free after releasing the
 * handle) and returns no pattern; else handle stays NULL and out[] holds the
 * patterns as without it. */
typedef struct estimate_device_plan {
  int32_t num_kv_heads;
  void *handle;
  void *memory;
  size_t bytes;
} estimate_device_plan_t;

/* Estimates the patterns of `count` sequences (in[s] each; the same heads,
 * head_dim and dtypes) with the same budgets: out[s] gets sequence s's
 * pattern, bitwise what a call for that sequence alone gives, or, with
 * `device` (NULL: patterns always), the backend's device plan of them. On
 * error no pattern or plan is returned (out[] is left NULL). Collective over
 * the context's communicator when its world is above 1 (every rank passes
 * the same count and lengths). Records mtrain_estimate_last_times for the
 * whole call. */
mtrain_status_t mtrain_estimate_core(mtrain_context_t *ctx, const estimate_input_t *in,
                                     int32_t count, const mtrain_head_budget_t *budgets,
                                     const mtrain_estimate_options_t *options,
                                     mtrain_pattern_t **out, estimate_device_plan_t *device);

/* mtrain_pattern_estimate_batch's checks and estimate, with `device` as
 * mtrain_estimate_core takes it (NULL: the public call). */
mtrain_status_t mtrain_estimate_batch_or_plan(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                              const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                              const mtrain_head_budget_t *budgets,
                                              const mtrain_estimate_options_t *options,
                                              mtrain_pattern_t **out,
                                              estimate_device_plan_t *device);

#endif /* MTRAIN_CORE_ESTIMATE_CORE_H */
