/* estimate.c: online estimation of the vertical-slash pattern (SPEC.md
 * section 2). The backend computes the last-L query scores in stages (row
 * maxima and normalisers for top-p heads, then column and diagonal sums);
 * partial results are indexed globally and combined with the communicator's
 * all-reduce (each entry has one contributor, so the sums are exact and do
 * not depend on the world size), on the devices where the communicator has
 * a device all-reduce. The selection is the backend's (pattern_select) where
 * it has one, else host code shared by all backends (select.c). Single rank:
 * the chunk is the whole sequence; ring: each rank scores its own slots of
 * the layout after the last L queries are gathered. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/select.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"

/* The calling thread's last estimation times (mtrain_estimate_last_times). */
static _Thread_local mtrain_estimate_times_t last_times;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

mtrain_estimate_times_t mtrain_estimate_last_times(void) { return last_times; }

/* Everything one estimation call allocates, freed in one place. */
typedef struct estimate_buffers {
  void *row, *col, *diag; /* backend memory */
  double *row_host, *row_max, *row_norm, *col_host, *diag_host;
  uint8_t *probs;
} estimate_buffers_t;

/* row_host, col_host and diag_host live in the context's reused host
 * region (context_internal.h); the rest is the call's own. */
static void buffers_free(mtrain_context_t *ctx, estimate_buffers_t *b) {
  void *backend[] = {b->row, b->col, b->diag};
  for (int i = 0; i < 3; i++) mtrain_be_free(ctx, backend[i]);
  free(b->row_max);
  free(b->row_norm);
  free(b->probs);
}

/* The context's reused host region of at least `bytes` (NULL when out of
 * memory; the region is then left as it was). */
static void *host_region(mtrain_context_t *ctx, size_t bytes) {
  if (bytes <= ctx->estimate_host_bytes) return ctx->estimate_host;
  void *p = malloc(bytes);
  if (!p) return NULL;
  free(ctx->estimate_host);
  ctx->estimate_host = p;
  ctx->estimate_host_bytes = bytes;
  return p;
}

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
  for (int64_t h = 0; h < q->shape[1]; h++) {
    mtrain_status_t st = mtrain_head_budget_validate(&budgets[h]);
    if (st) return mtrain_error_prefix(st, "estimate: budgets[%lld]", (long long)h);
  }
  if (!mtrain_be_has_pattern_scores(ctx))
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED, "estimate: backend '%s' has no pattern scores",
                        ctx->backend_name);
  return mtrain_be_supports(ctx, q->dtype, (int32_t)q->shape[2]);
}

static mtrain_status_t to_host(mtrain_context_t *ctx, double *dst, const void *src, size_t count) {
  return mtrain_be_copy_to_host(ctx, dst, src, count * sizeof(double));
}

static mtrain_status_t from_host(mtrain_context_t *ctx, void *dst, const double *src,
                                 size_t count) {
  return mtrain_be_copy_from_host(ctx, dst, src, count * sizeof(double));
}

static mtrain_status_t allreduce(mtrain_context_t *ctx, double *buf, int64_t n,
                                 mtrain_reduce_op_t op) {
  return mtrain_cm_allreduce(ctx, buf, n, MTRAIN_F64, op);
}

/* Combines `n` partial results in backend memory `dev` over the ranks into
 * `host`: on the device when `on_device` (the communicator's device
 * all-reduce, after the backend's work is done; `dev` then holds the result
 * too), else copied to the host first and reduced there. */
static mtrain_status_t combine(mtrain_context_t *ctx, void *dev, double *host, size_t n,
                               mtrain_reduce_op_t op, int on_device) {
  mtrain_status_t st;
  if (!on_device) {
    if ((st = to_host(ctx, host, dev, n))) return st;
    return allreduce(ctx, host, (int64_t)n, op);
  }
  if ((st = mtrain_be_synchronize(ctx))) return st;
  if ((st = mtrain_cm_allreduce_device(ctx, dev, (int64_t)n, MTRAIN_F64, op))) return st;
  return to_host(ctx, host, dev, n);
}

/* One thread's scratch of the selection (N entries each). */
typedef struct select_scratch {
  double *sscore;
  int64_t *order, *picked, *tokens;
  int32_t *blocks;
  uint8_t *forced;
} select_scratch_t;

static void scratch_free(select_scratch_t *x) {
  free(x->sscore);
  free(x->order);
  free(x->picked);
  free(x->tokens);
  free(x->blocks);
  free(x->forced);
}

static int scratch_alloc(select_scratch_t *x, int64_t N) {
  x->sscore = malloc(sizeof(double) * (size_t)N);
  x->order = malloc(sizeof(int64_t) * (size_t)N);
  x->picked = malloc(sizeof(int64_t) * (size_t)N);
  x->tokens = malloc(sizeof(int64_t) * (size_t)N);
  x->blocks = malloc(sizeof(int32_t) * (size_t)(2 * N + 1));
  x->forced = malloc((size_t)N);
  return x->sscore && x->order && x->picked && x->tokens && x->blocks && x->forced;
}

/* Selects head h's verticals and diagonals from its column and diagonal
 * scores and stores them in the pattern (only head h of it is touched). */
static mtrain_status_t select_head(const mtrain_head_budget_t *bud,
                                   const mtrain_estimate_options_t *o, int32_t h, int64_t N,
                                   int32_t L, int32_t G, const estimate_buffers_t *b,
                                   select_scratch_t *x, mtrain_pattern_t *p) {
  const int32_t slots = mtrain_scores_slots(L, G);
  const int64_t nb = (N + G - 1) / G;
  /* vertical candidates: keys before the last block */
  const int64_t nv_cand = ((N - 1) / G) * G;
  const double *col = b->col_host + (int64_t)h * N;
  /* slash scores: per-block partial sums added in block order */
  const double *diag = b->diag_host + (int64_t)h * N * slots;
  for (int64_t t = 0; t < N; t++) {
    double sum = 0.0;
    for (int32_t s = 0; s < slots; s++) sum += diag[t * slots + s];
    x->sscore[t] = sum;
  }
  int64_t nv, ns;
  if (bud->kind == MTRAIN_BUDGET_TOP_K) {
    /* forced candidates are a prefix: only that prefix is marked and cleared */
    const int64_t nf_v = o->num_sinks < nv_cand ? o->num_sinks : nv_cand;
    const int64_t nf_s = o->window < N ? o->window : N;
    memset(x->forced, 1, (size_t)nf_v);
    memset(x->forced + nf_v, 0, (size_t)(N - nf_v));
    nv = mtrain_select_top_k(col, x->forced, nv_cand, bud->v_size, x->order, x->picked);
    memset(x->forced, 0, (size_t)N);
    memset(x->forced, 1, (size_t)nf_s);
    ns = mtrain_select_top_k(x->sscore, x->forced, N, bud->s_size, x->order, x->tokens);
  } else {
    nv = mtrain_select_top_p(col, nv_cand, bud->p_v, bud->cap_v, x->order, x->picked);
    ns = mtrain_select_top_p(x->sscore, N, bud->p_s, bud->cap_s, x->order, x->tokens);
  }
  const int32_t nd = mtrain_token_to_block_diagonals(x->tokens, ns, G, nb, x->blocks);
  return mtrain_pattern_set_head(p, h, x->blocks, nd, x->picked, (int32_t)nv);
}

/* Every head's selection, heads in parallel on the context's threads (each
 * head's result depends on its own scores only: the same pattern for any
 * thread count). */
static mtrain_status_t select_all(mtrain_context_t *ctx, const mtrain_head_budget_t *budgets,
                                  const mtrain_estimate_options_t *o, int32_t Hq, int64_t N,
                                  int32_t L, int32_t G, const estimate_buffers_t *b,
                                  mtrain_pattern_t *p) {
  int threads = ctx->config.num_threads > 0 ? ctx->config.num_threads : omp_get_max_threads();
  if (threads > Hq) threads = Hq;
  mtrain_status_t *status = malloc(sizeof(mtrain_status_t) * (size_t)Hq);
  if (!status) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of host memory");
  for (int32_t h = 0; h < Hq; h++) status[h] = MTRAIN_ERR_OUT_OF_MEMORY;
#pragma omp parallel num_threads(threads)
  {
    select_scratch_t x;
    memset(&x, 0, sizeof x);
    const int ok = scratch_alloc(&x, N);
#pragma omp for schedule(dynamic, 1)
    for (int32_t h = 0; h < Hq; h++)
      if (ok) status[h] = select_head(&budgets[h], o, h, N, L, G, b, &x, p);
    scratch_free(&x);
  }
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (int32_t h = 0; h < Hq && st == MTRAIN_SUCCESS; h++)
    if (status[h] != MTRAIN_SUCCESS)
      st = mtrain_error(status[h], "estimate: selecting head %d failed (%s, N = %lld)", h,
                        mtrain_status_name(status[h]), (long long)N);
  free(status);
  return st;
}

/* The selection on the backend (one rank): every head's verticals and block
 * diagonals come back into `out_host` (the context's host region) and make
 * the pattern. MTRAIN_ERR_NOT_SUPPORTED (nothing done) for budgets the
 * backend cannot select. */
static mtrain_status_t select_on_backend(mtrain_context_t *ctx, const mtrain_head_budget_t *budgets,
                                         const mtrain_estimate_options_t *o, int32_t Hq, int64_t N,
                                         int32_t L, int32_t G, const estimate_buffers_t *b,
                                         void *out_host, mtrain_pattern_t **out) {
  const int64_t nb = (N + G - 1) / G;
  int64_t *verticals = out_host;
  int32_t *diagonals = (int32_t *)(verticals + (size_t)Hq * (size_t)N);
  int32_t *num_diagonals = diagonals + (size_t)Hq * (size_t)(nb + 1);
  int32_t *num_verticals = num_diagonals + Hq;
  const mtrain_select_args_t a = {.seq_len = N,
                                  .granularity = G,
                                  .num_heads = Hq,
                                  .slots = mtrain_scores_slots(L, G),
                                  .num_sinks = o->num_sinks,
                                  .window = o->window,
                                  .budgets = budgets,
                                  .col = b->col,
                                  .diag = b->diag,
                                  .verticals = verticals,
                                  .num_verticals = num_verticals,
                                  .diagonals = diagonals,
                                  .num_diagonals = num_diagonals};
  mtrain_status_t st = mtrain_be_pattern_select(ctx, &a);
  if (st) return st;
  mtrain_pattern_t *p = NULL;
  st = mtrain_pattern_create(N, Hq, G, &p);
  for (int32_t h = 0; h < Hq && !st; h++) {
    st = mtrain_pattern_set_head(p, h, diagonals + (size_t)h * (size_t)(nb + 1), num_diagonals[h],
                                 verticals + (size_t)h * (size_t)N, num_verticals[h]);
    if (st)
      st = mtrain_error(st, "estimate: the backend's selection of head %d is not a pattern (%s)", h,
                        mtrain_status_name(st));
  }
  if (st) {
    mtrain_pattern_destroy(p);
    return st;
  }
  *out = p;
  return MTRAIN_SUCCESS;
}

/* What the scores are computed from: the last L queries (gathered) and the
 * keys this rank holds, with their global blocks. */
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

/* Scores (stages on the backend, exact combination through the
 * communicator) and the selection: the pattern every rank gets. */
static mtrain_status_t estimate_core(mtrain_context_t *ctx, const estimate_input_t *in,
                                     const mtrain_head_budget_t *budgets,
                                     const mtrain_estimate_options_t *options,
                                     mtrain_pattern_t **out) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  const int64_t N = in->N;
  const int32_t Hq = in->Hq, L = in->L;
  const int32_t G = ctx->config.granularity;
  const int32_t slots = mtrain_scores_slots(L, G);
  const int64_t nb = (N + G - 1) / G;
  estimate_buffers_t b;
  memset(&b, 0, sizeof b);
  mtrain_pattern_t *p = NULL;
  const size_t n_row_sums = (size_t)Hq * L * (size_t)nb;
  const size_t n_row = n_row_sums > 2 * (size_t)Hq * L ? n_row_sums : 2 * (size_t)Hq * L;
  const size_t n_col = (size_t)Hq * N, n_diag = (size_t)Hq * N * slots;
  /* one rank: the backend may select on the device (only the pattern comes
   * back); else, and for budgets it cannot select, the scores come to the
   * host. MTRAIN_HOST_SELECT=1 selects on the host always (comparisons). */
  const char *host_env = getenv("MTRAIN_HOST_SELECT");
  const int host_only = host_env && host_env[0] == '1';
  /* several ranks: with a device all-reduce (nccl) the scores are combined
   * on the devices and every rank selects on its own device from the same
   * sums (each entry has one contributor: bitwise the one-rank scores) */
  const int world = mtrain_context_world(ctx);
  const int reduce_on_device = world > 1 && !host_only && mtrain_cm_has_allreduce_device(ctx) &&
                               mtrain_be_memory_space(ctx) == MTRAIN_MEMORY_DEVICE;
  int device_select =
      (world == 1 || reduce_on_device) && !host_only && mtrain_be_has_pattern_select(ctx);
  const size_t select_bytes = sizeof(int64_t) * (size_t)Hq * (size_t)N +
                              sizeof(int32_t) * ((size_t)Hq * (size_t)(nb + 1) + 2 * (size_t)Hq);
  const size_t host_bytes = sizeof(double) * (n_row + n_col + n_diag);
  b.probs = calloc((size_t)Hq, 1);
  double *region =
      host_region(ctx, device_select ? sizeof(double) * n_row + select_bytes : host_bytes);
  b.row_host = region;
  b.col_host = region && !device_select ? region + n_row : NULL;
  b.diag_host = region && !device_select ? region + n_row + n_col : NULL;
  b.row_max = malloc(sizeof(double) * (size_t)Hq * L);
  b.row_norm = malloc(sizeof(double) * (size_t)Hq * L);
  MTRAIN_FAIL_IF(!b.probs || !b.row_host || !b.row_max || !b.row_norm ||
                     (!device_select && (!b.col_host || !b.diag_host)),
                 MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of host memory (N = %lld, %d heads)",
                 (long long)N, Hq);
  MTRAIN_TRY(mtrain_be_alloc(ctx, n_row * sizeof(double), &b.row));
  MTRAIN_TRY(mtrain_be_alloc(ctx, n_col * sizeof(double), &b.col));
  MTRAIN_TRY(mtrain_be_alloc(ctx, n_diag * sizeof(double), &b.diag));
  memset(&last_times, 0, sizeof last_times);
  const double t_scores = now_s();
  int any_probs = 0;
  for (int32_t h = 0; h < Hq; h++) any_probs |= b.probs[h] = budgets[h].kind == MTRAIN_BUDGET_TOP_P;
  mtrain_scores_args_t a = {.seq_len = N,
                            .last_q = L,
                            .granularity = G,
                            .num_heads = Hq,
                            .num_kv_heads = in->Hkv,
                            .head_dim = in->d,
                            .scale = ctx->config.softmax_scale > 0 ? ctx->config.softmax_scale
                                                                   : 1.0 / sqrt((double)in->d),
                            .dtype = in->k_dtype,
                            .q_dtype = in->q_dtype,
                            .q_last = in->q_last,
                            .k = in->k,
                            .k_tokens = in->k_tokens,
                            .num_k_blocks = in->num_k_blocks,
                            .k_block_global = in->k_block_global,
                            .probs = b.probs};
  if (any_probs) {
    /* row maxima, combined with MAX */
    for (size_t i = 0; i < (size_t)Hq * L; i++) b.row_max[i] = -INFINITY;
    MTRAIN_TRY(from_host(ctx, b.row, b.row_max, (size_t)Hq * L));
    a.stage = MTRAIN_SCORES_ROW_MAX;
    a.row_out = b.row;
    MTRAIN_TRY(mtrain_be_pattern_scores(ctx, &a));
    MTRAIN_TRY(combine(ctx, b.row, b.row_max, (size_t)Hq * L, MTRAIN_REDUCE_MAX, reduce_on_device));
    /* normalisers: per (row, key block) partial sums, added in block order */
    MTRAIN_TRY(mtrain_be_memset_zero(ctx, b.row, n_row * sizeof(double)));
    void *row_max_dev = b.col; /* col is free until stage 2: borrow it for row_max */
    MTRAIN_TRY(from_host(ctx, row_max_dev, b.row_max, (size_t)Hq * L));
    a.stage = MTRAIN_SCORES_ROW_BLOCK_SUMS;
    a.row_max = row_max_dev;
    MTRAIN_TRY(mtrain_be_pattern_scores(ctx, &a));
    MTRAIN_TRY(combine(ctx, b.row, b.row_host, n_row_sums, MTRAIN_REDUCE_SUM, reduce_on_device));
    for (size_t r = 0; r < (size_t)Hq * L; r++) {
      double sum = 0.0;
      for (int64_t gb = 0; gb < nb; gb++) sum += b.row_host[r * (size_t)nb + (size_t)gb];
      b.row_norm[r] = sum;
    }
    /* row_max and row_norm travel to the backend in `row` (n_row >= 2 * Hq * L) */
    MTRAIN_TRY(from_host(ctx, b.row, b.row_max, (size_t)Hq * L));
    MTRAIN_TRY(from_host(ctx, (double *)b.row + (size_t)Hq * L, b.row_norm, (size_t)Hq * L));
    a.row_max = b.row;
    a.row_norm = (const double *)b.row + (size_t)Hq * L;
  }
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, b.col, n_col * sizeof(double)));
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, b.diag, n_diag * sizeof(double)));
  a.stage = MTRAIN_SCORES_SUMS;
  a.row_out = NULL;
  a.col_out = b.col;
  a.diag_out = b.diag;
  MTRAIN_TRY(mtrain_be_pattern_scores(ctx, &a));
  /* the copies below wait for the stages anyway: the wait is only timed apart */
  MTRAIN_TRY(mtrain_be_synchronize(ctx));
  const double t_stages = now_s();
  last_times.stages = t_stages - t_scores;
  double t_reduced = t_stages;
  int col_diag_reduced = 0;
  if (device_select && reduce_on_device) {
    MTRAIN_TRY(
        mtrain_cm_allreduce_device(ctx, b.col, (int64_t)n_col, MTRAIN_F64, MTRAIN_REDUCE_SUM));
    MTRAIN_TRY(
        mtrain_cm_allreduce_device(ctx, b.diag, (int64_t)n_diag, MTRAIN_F64, MTRAIN_REDUCE_SUM));
    col_diag_reduced = 1;
    t_reduced = now_s();
    last_times.reduce = t_reduced - t_stages;
  }
  if (device_select) {
    st = select_on_backend(ctx, budgets, options, Hq, N, L, G, &b, region + n_row, &p);
    if (st != MTRAIN_ERR_NOT_SUPPORTED) {
      last_times.scores = t_reduced - t_scores;
      last_times.select = now_s() - t_reduced;
      if (st) goto cleanup;
      *out = p;
      p = NULL;
      goto cleanup;
    }
    /* budgets the backend cannot select: the host path below */
    st = MTRAIN_SUCCESS;
    region = host_region(ctx, host_bytes);
    MTRAIN_FAIL_IF(!region, MTRAIN_ERR_OUT_OF_MEMORY,
                   "estimate: out of host memory (N = %lld, %d heads)", (long long)N, Hq);
    b.col_host = region + n_row;
    b.diag_host = region + n_row + n_col;
  }
  MTRAIN_TRY(to_host(ctx, b.col_host, b.col, n_col));
  MTRAIN_TRY(to_host(ctx, b.diag_host, b.diag, n_diag));
  const double t_copies = now_s();
  if (!col_diag_reduced) { /* else combined on the devices already */
    MTRAIN_TRY(allreduce(ctx, b.col_host, (int64_t)n_col, MTRAIN_REDUCE_SUM));
    MTRAIN_TRY(allreduce(ctx, b.diag_host, (int64_t)n_diag, MTRAIN_REDUCE_SUM));
  }
  const double t_select = now_s();
  last_times.scores = t_select - t_scores;
  last_times.copies = t_copies - t_reduced;
  last_times.reduce += t_select - t_copies;
  MTRAIN_TRY(mtrain_pattern_create(N, Hq, G, &p));
  MTRAIN_TRY(select_all(ctx, budgets, options, Hq, N, L, G, &b, p));
  last_times.select = now_s() - t_select;
  *out = p;
  p = NULL;
cleanup:
  mtrain_pattern_destroy(p);
  buffers_free(ctx, &b);
  return st;
}

mtrain_status_t mtrain_pattern_estimate(mtrain_context_t *ctx, const mtrain_tensor_t *q,
                                        const mtrain_tensor_t *k,
                                        const mtrain_head_budget_t *budgets,
                                        const mtrain_estimate_options_t *options,
                                        mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_status_t st = check_inputs(ctx, q, k, budgets, options);
  if (st) return st;
  if (mtrain_context_world(ctx) != 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "estimate: world size %d: use mtrain_pattern_estimate_ring with the "
                        "layout of the ranks' tensors",
                        mtrain_context_world(ctx));
  const int64_t N = q->shape[0];
  const int32_t G = ctx->config.granularity;
  const int64_t nb = (N + G - 1) / G;
  int64_t *identity = malloc(sizeof(int64_t) * (size_t)nb);
  if (!identity) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of memory");
  for (int64_t gb = 0; gb < nb; gb++) identity[gb] = gb;
  const int32_t Hq = (int32_t)q->shape[1], d = (int32_t)q->shape[2];
  const int32_t L = options->last_q < N ? options->last_q : (int32_t)N;
  const estimate_input_t in = {.N = N,
                               .Hq = Hq,
                               .Hkv = (int32_t)k->shape[1],
                               .d = d,
                               .L = L,
                               .q_dtype = q->dtype,
                               .k_dtype = k->dtype,
                               .q_last = (const char *)q->data +
                                         (size_t)(N - L) * Hq * d * mtrain_dtype_size(q->dtype),
                               .k = k->data,
                               .k_tokens = N,
                               .num_k_blocks = (int32_t)nb,
                               .k_block_global = identity};
  st = estimate_core(ctx, &in, budgets, options, out);
  free(identity);
  return st;
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
    st = estimate_core(ctx, &in, budgets, options, out);
  }
  mtrain_be_free(ctx, q_last);
  free(host);
  free(q_local_row);
  return st;
}
