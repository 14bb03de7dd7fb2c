/* estimate_core.c: the stages of the vertical-slash estimate (SPEC.md
 * section 2) for a batch of sequences. The backend computes the last-L
 * query scores in stages (row maxima and normalisers for top-p heads, then
 * column and diagonal sums); each stage is one call for every sequence of
 * the batch (pattern_scores_batch, or pattern_scores per sequence) before
 * its results are combined, so a packed batch waits for the backend once
 * per stage instead of once per sequence. Partial results are
 * indexed globally and combined with the communicator's all-reduce (each
 * entry has one contributor, so the sums are exact and do not depend on the
 * world size), on the devices where the communicator has a device
 * all-reduce. The selection is the backend's (pattern_select_batch, or
 * pattern_select per sequence) where it has one, else host code shared by
 * all backends (select.c). Each sequence's pattern is bitwise what the
 * estimate of that sequence alone gives. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/estimate_core.h"
#include "core/runtime/select.h"
#include "mtrain/mtrain_error.h"

/* The calling thread's last estimation times (mtrain_estimate_last_times). */
static _Thread_local mtrain_estimate_times_t last_times;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

mtrain_estimate_times_t mtrain_estimate_last_times(void) { return last_times; }

/* One sequence's share of the batch's buffers: sizes and offsets in
 * elements (doubles), the selection's in bytes. */
typedef struct seq_part {
  int64_t N, nb;
  int32_t L, slots;
  size_t n_row;  /* Hq * L * nb: the normalisers' per-(row, key block) sums */
  size_t n_stat; /* Hq * L: row maxima (and normalisers) */
  size_t n_col, n_diag;
  size_t row_off, stat_off, col_off, diag_off;
  size_t select_off; /* into the host region after the row sums */
} seq_part_t;

/* Everything one estimation call allocates, freed in one place. */
typedef struct estimate_buffers {
  void *row, *stat, *col, *diag;           /* backend memory, every sequence's part */
  double *row_host, *col_host, *diag_host; /* the context's reused host region */
  double *stat_host;                       /* [2 * n_stat]: row maxima, then normalisers */
  uint8_t *probs;
  seq_part_t *parts;
  mtrain_scores_args_t *stage;
  size_t n_row, n_stat, n_col, n_diag, select_bytes; /* totals */
} estimate_buffers_t;

static void buffers_free(mtrain_context_t *ctx, estimate_buffers_t *b) {
  void *backend[] = {b->row, b->stat, b->col, b->diag};
  for (int i = 0; i < 4; i++) mtrain_be_free(ctx, backend[i]);
  free(b->stat_host);
  free(b->probs);
  free(b->parts);
  free(b->stage);
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

/* Bytes of one sequence's selection in host memory (a multiple of 8):
 * verticals [Hq * N] int64, diagonals [Hq * (nb + 1)], then the counts
 * of diagonals and of verticals [Hq] each, int32. */
static size_t select_part_bytes(int32_t Hq, int64_t N, int64_t nb) {
  const size_t bytes = sizeof(int64_t) * (size_t)Hq * (size_t)N +
                       sizeof(int32_t) * ((size_t)Hq * (size_t)(nb + 1) + 2 * (size_t)Hq);
  return (bytes + 7) & ~(size_t)7;
}

static void plan_parts(const estimate_input_t *in, int32_t count, int32_t G,
                       estimate_buffers_t *b) {
  const size_t Hq = (size_t)in[0].Hq;
  for (int32_t s = 0; s < count; s++) {
    seq_part_t *p = &b->parts[s];
    p->N = in[s].N;
    p->nb = (p->N + G - 1) / G;
    p->L = in[s].L;
    p->slots = mtrain_scores_slots(p->L, G);
    p->n_stat = Hq * (size_t)p->L;
    p->n_row = p->n_stat * (size_t)p->nb;
    p->n_col = Hq * (size_t)p->N;
    p->n_diag = p->n_col * (size_t)p->slots;
    p->row_off = b->n_row;
    p->stat_off = b->n_stat;
    p->col_off = b->n_col;
    p->diag_off = b->n_diag;
    p->select_off = b->select_bytes;
    b->n_row += p->n_row;
    b->n_stat += p->n_stat;
    b->n_col += p->n_col;
    b->n_diag += p->n_diag;
    b->select_bytes += select_part_bytes(in[s].Hq, p->N, p->nb);
  }
}

static mtrain_status_t to_host(mtrain_context_t *ctx, double *dst, const void *src, size_t count) {
  return mtrain_be_copy_to_host(ctx, dst, src, count * sizeof(double));
}

static mtrain_status_t from_host(mtrain_context_t *ctx, void *dst, const double *src,
                                 size_t count) {
  return mtrain_be_copy_from_host(ctx, dst, src, count * sizeof(double));
}

static mtrain_status_t allreduce(mtrain_context_t *ctx, double *buf, size_t n,
                                 mtrain_reduce_op_t op) {
  return mtrain_cm_allreduce(ctx, buf, (int64_t)n, MTRAIN_F64, op);
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
    return allreduce(ctx, host, n, op);
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

/* Selects head h's verticals and diagonals from the sequence's column scores
 * `col` [Hq * N] and slash partial sums `diag` [Hq * N * slots] and stores
 * them in the pattern (only head h of it is touched). */
static mtrain_status_t select_head(const mtrain_head_budget_t *bud,
                                   const mtrain_estimate_options_t *o, int32_t h,
                                   const seq_part_t *sp, int32_t G, const double *col_all,
                                   const double *diag_all, select_scratch_t *x,
                                   mtrain_pattern_t *p) {
  const int64_t N = sp->N, nb = sp->nb;
  const int32_t slots = sp->slots;
  /* vertical candidates: keys before the last block */
  const int64_t nv_cand = ((N - 1) / G) * G;
  const double *col = col_all + (int64_t)h * N;
  /* slash scores: per-block partial sums added in block order */
  const double *diag = diag_all + (int64_t)h * N * slots;
  for (int64_t t = 0; t < N; t++) {
    double sum = 0.0;
    for (int32_t s = 0; s < slots; s++) sum += diag[t * slots + s];
    x->sscore[t] = sum;
  }
  int64_t nv, ns;
  const int top_k = bud->kind == MTRAIN_BUDGET_TOP_K;
  /* forced candidates are a prefix (top-k always, top-p with top_p_forced;
   * else none): only that prefix is marked and cleared */
  const int force = top_k || o->top_p_forced;
  const uint8_t *forced = force ? x->forced : NULL;
  const int64_t nf_v = !force ? 0 : o->num_sinks < nv_cand ? o->num_sinks : nv_cand;
  const int64_t nf_s = !force ? 0 : o->window < N ? o->window : N;
  memset(x->forced, 1, (size_t)nf_v);
  memset(x->forced + nf_v, 0, (size_t)(N - nf_v));
  nv = top_k ? mtrain_select_top_k(col, x->forced, nv_cand, bud->v_size, x->order, x->picked)
             : mtrain_select_top_p(col, forced, nv_cand, bud->p_v, bud->cap_v, x->order, x->picked);
  memset(x->forced, 0, (size_t)N);
  memset(x->forced, 1, (size_t)nf_s);
  ns = top_k ? mtrain_select_top_k(x->sscore, x->forced, N, bud->s_size, x->order, x->tokens)
             : mtrain_select_top_p(x->sscore, forced, N, bud->p_s, bud->cap_s, x->order, x->tokens);
  const int32_t nd = mtrain_token_to_block_diagonals(x->tokens, ns, G, nb, x->blocks);
  return mtrain_pattern_set_head(p, h, x->blocks, nd, x->picked, (int32_t)nv);
}

/* Every head's selection of one sequence, heads in parallel on the
 * context's threads (each head's result depends on its own scores only:
 * the same pattern for any thread count). */
static mtrain_status_t select_all(mtrain_context_t *ctx, const mtrain_head_budget_t *budgets,
                                  const mtrain_estimate_options_t *o, int32_t Hq,
                                  const seq_part_t *sp, int32_t G, const double *col,
                                  const double *diag, mtrain_pattern_t *p) {
  int threads = ctx->config.num_threads > 0 ? ctx->config.num_threads : omp_get_max_threads();
  if (threads > Hq) threads = Hq;
  mtrain_status_t *status = malloc(sizeof(mtrain_status_t) * (size_t)Hq);
  if (!status) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of host memory");
  for (int32_t h = 0; h < Hq; h++) status[h] = MTRAIN_ERR_OUT_OF_MEMORY;
#pragma omp parallel num_threads(threads)
  {
    select_scratch_t x;
    memset(&x, 0, sizeof x);
    const int ok = scratch_alloc(&x, sp->N);
#pragma omp for schedule(dynamic, 1)
    for (int32_t h = 0; h < Hq; h++)
      if (ok) status[h] = select_head(&budgets[h], o, h, sp, G, col, diag, &x, p);
    scratch_free(&x);
  }
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (int32_t h = 0; h < Hq && st == MTRAIN_SUCCESS; h++)
    if (status[h] != MTRAIN_SUCCESS)
      st = mtrain_error(status[h], "estimate: selecting head %d failed (%s, N = %lld)", h,
                        mtrain_status_name(status[h]), (long long)sp->N);
  free(status);
  return st;
}

/* Every sequence's selection arguments, `args` [count], without their host
 * outputs (a plan built on the backend leaves them unused). */
static void select_args_of(const estimate_buffers_t *b, const mtrain_head_budget_t *budgets,
                           const mtrain_estimate_options_t *o, int32_t Hq, int32_t G, int32_t count,
                           mtrain_select_args_t *args) {
  for (int32_t s = 0; s < count; s++) {
    const seq_part_t *sp = &b->parts[s];
    args[s] = (mtrain_select_args_t){.seq_len = sp->N,
                                     .granularity = G,
                                     .num_heads = Hq,
                                     .slots = sp->slots,
                                     .num_sinks = o->num_sinks,
                                     .window = o->window,
                                     .budgets = budgets,
                                     .col = (const double *)b->col + sp->col_off,
                                     .diag = (const double *)b->diag + sp->diag_off,
                                     .top_p_forced = o->top_p_forced};
  }
}

/* The selection on the backend (one rank, or scores already combined on
 * the devices): every sequence's verticals and block diagonals come back
 * into `region` (the context's host region) and make out[s].
 * MTRAIN_ERR_NOT_SUPPORTED (no pattern made) for budgets the backend
 * cannot select. */
static mtrain_status_t select_on_backend(mtrain_context_t *ctx, const mtrain_head_budget_t *budgets,
                                         const mtrain_estimate_options_t *o, int32_t Hq, int32_t G,
                                         int32_t count, const estimate_buffers_t *b, char *region,
                                         mtrain_pattern_t **out) {
  mtrain_select_args_t *args = calloc((size_t)count, sizeof *args);
  if (!args) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of host memory");
  select_args_of(b, budgets, o, Hq, G, count, args);
  for (int32_t s = 0; s < count; s++) {
    const seq_part_t *sp = &b->parts[s];
    int64_t *verticals = (int64_t *)(region + sp->select_off);
    int32_t *diagonals = (int32_t *)(verticals + (size_t)Hq * (size_t)sp->N);
    int32_t *num_diagonals = diagonals + (size_t)Hq * (size_t)(sp->nb + 1);
    args[s].verticals = verticals;
    args[s].num_verticals = num_diagonals + Hq;
    args[s].diagonals = diagonals;
    args[s].num_diagonals = num_diagonals;
  }
  mtrain_status_t st = mtrain_be_pattern_select_batch(ctx, args, count);
  for (int32_t s = 0; s < count && !st; s++) {
    const mtrain_select_args_t *a = &args[s];
    const int64_t nb = b->parts[s].nb;
    st = mtrain_pattern_create(a->seq_len, Hq, G, &out[s]);
    for (int32_t h = 0; h < Hq && !st; h++) {
      st = mtrain_pattern_set_head(
          out[s], h, a->diagonals + (size_t)h * (size_t)(nb + 1), a->num_diagonals[h],
          a->verticals + (size_t)h * (size_t)a->seq_len, a->num_verticals[h]);
      if (st)
        st = mtrain_error(st,
                          "estimate: the backend's selection of head %d of sequence %d is not a "
                          "pattern (%s)",
                          h, s, mtrain_status_name(st));
    }
  }
  free(args);
  return st;
}

/* The common fields of the scores' arguments, and one sequence's. */
static void scores_seq(mtrain_scores_args_t *a, const estimate_input_t *in) {
  a->seq_len = in->N;
  a->last_q = in->L;
  a->q_last = in->q_last;
  a->k = in->k;
  a->k_tokens = in->k_tokens;
  a->num_k_blocks = in->num_k_blocks;
  a->k_block_global = in->k_block_global;
}

/* Whether the batch's plan is built on the backend: one rank, a `device`
 * request, the backend's device_plan slots, MTRAIN_PLAN_ON_HOST unset and
 * budgets the backend takes (its device_plan_size answers; NOT_SUPPORTED:
 * no). Sets *bytes. */
static mtrain_status_t wants_device_plan(mtrain_context_t *ctx, const estimate_device_plan_t *dev,
                                         int device_select, const mtrain_device_plan_args_t *pa,
                                         int *yes, size_t *bytes) {
  *yes = 0;
  const char *env = getenv("MTRAIN_PLAN_ON_HOST");
  if (!dev || !device_select || mtrain_context_world(ctx) != 1 || !mtrain_be_has_device_plan(ctx) ||
      (env && env[0] == '1'))
    return MTRAIN_SUCCESS;
  mtrain_status_t st = mtrain_be_device_plan_size(ctx, pa, bytes);
  if (st == MTRAIN_ERR_NOT_SUPPORTED) return MTRAIN_SUCCESS; /* the host plan, as before */
  if (st) return st;
  *yes = 1;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_estimate_core(mtrain_context_t *ctx, const estimate_input_t *in,
                                     int32_t count, const mtrain_head_budget_t *budgets,
                                     const mtrain_estimate_options_t *options,
                                     mtrain_pattern_t **out, estimate_device_plan_t *device) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  mtrain_select_args_t *plan_select = NULL; /* a plan built on the backend: its selections */
  const int32_t Hq = in[0].Hq;
  const int32_t G = ctx->config.granularity;
  for (int32_t s = 0; s < count; s++) out[s] = NULL;
  estimate_buffers_t b;
  memset(&b, 0, sizeof b);
  b.probs = calloc((size_t)Hq, 1);
  b.parts = calloc((size_t)count, sizeof *b.parts);
  b.stage = calloc((size_t)count, sizeof *b.stage);
  mtrain_scores_args_t *stage = b.stage; /* one stage's arguments, per sequence */
  MTRAIN_FAIL_IF(!b.probs || !b.parts || !b.stage, MTRAIN_ERR_OUT_OF_MEMORY,
                 "estimate: out of host memory (%d sequences, %d heads)", count, Hq);
  plan_parts(in, count, G, &b);
  int any_probs = 0;
  for (int32_t h = 0; h < Hq; h++) any_probs |= b.probs[h] = budgets[h].kind == MTRAIN_BUDGET_TOP_P;
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
  const int device_select =
      (world == 1 || reduce_on_device) && !host_only && mtrain_be_has_pattern_select(ctx);
  const size_t n_row = any_probs ? b.n_row : 0;
  const size_t host_bytes = sizeof(double) * (n_row + b.n_col + b.n_diag);
  double *region =
      host_region(ctx, device_select ? sizeof(double) * n_row + b.select_bytes : host_bytes);
  MTRAIN_FAIL_IF(!region, MTRAIN_ERR_OUT_OF_MEMORY,
                 "estimate: out of host memory (%d sequences, %d heads)", count, Hq);
  b.row_host = region;
  b.col_host = region + n_row;
  b.diag_host = region + n_row + b.n_col;
  if (any_probs) {
    b.stat_host = malloc(sizeof(double) * 2 * b.n_stat);
    MTRAIN_FAIL_IF(!b.stat_host, MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of host memory");
    MTRAIN_TRY(mtrain_be_alloc(ctx, b.n_row * sizeof(double), &b.row));
    MTRAIN_TRY(mtrain_be_alloc(ctx, 2 * b.n_stat * sizeof(double), &b.stat));
  }
  MTRAIN_TRY(mtrain_be_alloc(ctx, b.n_col * sizeof(double), &b.col));
  MTRAIN_TRY(mtrain_be_alloc(ctx, b.n_diag * sizeof(double), &b.diag));
  /* a plan built on the backend? decided before any work (host arithmetic) */
  int on_device = 0;
  size_t plan_bytes = 0;
  mtrain_device_plan_args_t plan_args = {.count = count,
                                         .num_kv_heads = device ? device->num_kv_heads : 0};
  if (device) {
    plan_select = calloc((size_t)count, sizeof *plan_select);
    MTRAIN_FAIL_IF(!plan_select, MTRAIN_ERR_OUT_OF_MEMORY, "estimate: out of host memory");
    select_args_of(&b, budgets, options, Hq, G, count, plan_select);
    plan_args.select = plan_select;
    MTRAIN_TRY(wants_device_plan(ctx, device, device_select, &plan_args, &on_device, &plan_bytes));
  }
  memset(&last_times, 0, sizeof last_times);
  const double t_scores = now_s();
  mtrain_scores_args_t a = {.granularity = G,
                            .num_heads = Hq,
                            .num_kv_heads = in[0].Hkv,
                            .head_dim = in[0].d,
                            .scale = ctx->config.softmax_scale > 0 ? ctx->config.softmax_scale
                                                                   : 1.0 / sqrt((double)in[0].d),
                            .dtype = in[0].k_dtype,
                            .q_dtype = in[0].q_dtype,
                            .probs = b.probs};
  double *stat_dev = b.stat;
  /* a plan built on the device with top-p heads: the row statistics stay in
   * backend memory too (one rank: every entry has one contributor, the maxima
   * need no combining, and the normalisers are summed there in the host's
   * order), so the estimate makes no host round trip */
  const int stats_on_device = on_device && mtrain_be_has_row_stats(ctx);
  if (any_probs) {
    /* row maxima, combined with MAX */
    if (stats_on_device) {
      MTRAIN_TRY(mtrain_be_fill_f64(ctx, b.stat, -INFINITY, (int64_t)b.n_stat));
    } else {
      for (size_t i = 0; i < b.n_stat; i++) b.stat_host[i] = -INFINITY;
      MTRAIN_TRY(from_host(ctx, b.stat, b.stat_host, b.n_stat));
    }
    a.stage = MTRAIN_SCORES_ROW_MAX;
    for (int32_t s = 0; s < count; s++) {
      stage[s] = a;
      scores_seq(&stage[s], &in[s]);
      stage[s].row_out = stat_dev + b.parts[s].stat_off;
    }
    MTRAIN_TRY(mtrain_be_pattern_scores_batch(ctx, stage, count));
    if (!stats_on_device)
      MTRAIN_TRY(combine(ctx, b.stat, b.stat_host, b.n_stat, MTRAIN_REDUCE_MAX, reduce_on_device));
    /* normalisers: per (row, key block) partial sums, added in block order */
    MTRAIN_TRY(mtrain_be_memset_zero(ctx, b.row, b.n_row * sizeof(double)));
    if (!stats_on_device) MTRAIN_TRY(from_host(ctx, b.stat, b.stat_host, b.n_stat));
    a.stage = MTRAIN_SCORES_ROW_BLOCK_SUMS;
    for (int32_t s = 0; s < count; s++) {
      stage[s] = a;
      scores_seq(&stage[s], &in[s]);
      stage[s].row_max = stat_dev + b.parts[s].stat_off;
      stage[s].row_out = (double *)b.row + b.parts[s].row_off;
    }
    MTRAIN_TRY(mtrain_be_pattern_scores_batch(ctx, stage, count));
    for (int32_t s = 0; stats_on_device && s < count; s++) {
      const seq_part_t *sp = &b.parts[s];
      MTRAIN_TRY(mtrain_be_row_sums_f64(ctx, (const double *)b.row + sp->row_off,
                                        stat_dev + b.n_stat + sp->stat_off, (int64_t)sp->n_stat,
                                        sp->nb));
    }
  }
  if (any_probs && !stats_on_device) {
    MTRAIN_TRY(combine(ctx, b.row, b.row_host, b.n_row, MTRAIN_REDUCE_SUM, reduce_on_device));
    for (int32_t s = 0; s < count; s++) {
      const seq_part_t *sp = &b.parts[s];
      const double *sums = b.row_host + sp->row_off;
      double *norm = b.stat_host + b.n_stat + sp->stat_off;
      for (size_t r = 0; r < sp->n_stat; r++) {
        double sum = 0.0;
        for (int64_t gb = 0; gb < sp->nb; gb++) sum += sums[r * (size_t)sp->nb + (size_t)gb];
        norm[r] = sum;
      }
    }
    /* the maxima and the normalisers travel to the backend together */
    MTRAIN_TRY(from_host(ctx, b.stat, b.stat_host, 2 * b.n_stat));
  }
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, b.col, b.n_col * sizeof(double)));
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, b.diag, b.n_diag * sizeof(double)));
  a.stage = MTRAIN_SCORES_SUMS;
  a.row_out = NULL;
  for (int32_t s = 0; s < count; s++) {
    const seq_part_t *sp = &b.parts[s];
    stage[s] = a;
    scores_seq(&stage[s], &in[s]);
    if (any_probs) {
      stage[s].row_max = stat_dev + sp->stat_off;
      stage[s].row_norm = stat_dev + b.n_stat + sp->stat_off;
    }
    stage[s].col_out = (double *)b.col + sp->col_off;
    stage[s].diag_out = (double *)b.diag + sp->diag_off;
  }
  MTRAIN_TRY(mtrain_be_pattern_scores_batch(ctx, stage, count));
  if (on_device) {
    /* the selection and the plan's tables queued behind the stages: no wait */
    MTRAIN_TRY(mtrain_be_alloc(ctx, plan_bytes, &device->memory));
    device->bytes = plan_bytes;
    const double t_queued = now_s();
    st = mtrain_be_device_plan_build(ctx, &plan_args, device->memory, &device->handle);
    if (st) {
      mtrain_be_free(ctx, device->memory);
      device->memory = NULL;
      device->bytes = 0;
      device->handle = NULL;
      goto cleanup;
    }
    last_times.stages = t_queued - t_scores;
    last_times.scores = t_queued - t_scores;
    last_times.select = now_s() - t_queued;
    goto cleanup;
  }
  /* the copies below wait for the stages anyway: the wait is only timed apart */
  MTRAIN_TRY(mtrain_be_synchronize(ctx));
  const double t_stages = now_s();
  last_times.stages = t_stages - t_scores;
  double t_reduced = t_stages;
  int col_diag_reduced = 0;
  if (device_select && reduce_on_device) {
    MTRAIN_TRY(
        mtrain_cm_allreduce_device(ctx, b.col, (int64_t)b.n_col, MTRAIN_F64, MTRAIN_REDUCE_SUM));
    MTRAIN_TRY(
        mtrain_cm_allreduce_device(ctx, b.diag, (int64_t)b.n_diag, MTRAIN_F64, MTRAIN_REDUCE_SUM));
    col_diag_reduced = 1;
    t_reduced = now_s();
    last_times.reduce = t_reduced - t_stages;
  }
  if (device_select) {
    st = select_on_backend(ctx, budgets, options, Hq, G, count, &b, (char *)(region + n_row), out);
    if (st != MTRAIN_ERR_NOT_SUPPORTED) {
      last_times.scores = t_reduced - t_scores;
      last_times.select = now_s() - t_reduced;
      goto cleanup;
    }
    /* budgets the backend cannot select: the host path below */
    st = MTRAIN_SUCCESS;
    for (int32_t s = 0; s < count; s++) {
      mtrain_pattern_destroy(out[s]);
      out[s] = NULL;
    }
    region = host_region(ctx, host_bytes);
    MTRAIN_FAIL_IF(!region, MTRAIN_ERR_OUT_OF_MEMORY,
                   "estimate: out of host memory (%d sequences, %d heads)", count, Hq);
    b.col_host = region + n_row;
    b.diag_host = region + n_row + b.n_col;
  }
  MTRAIN_TRY(to_host(ctx, b.col_host, b.col, b.n_col));
  MTRAIN_TRY(to_host(ctx, b.diag_host, b.diag, b.n_diag));
  const double t_copies = now_s();
  if (!col_diag_reduced) { /* else combined on the devices already */
    MTRAIN_TRY(allreduce(ctx, b.col_host, b.n_col, MTRAIN_REDUCE_SUM));
    MTRAIN_TRY(allreduce(ctx, b.diag_host, b.n_diag, MTRAIN_REDUCE_SUM));
  }
  const double t_select = now_s();
  last_times.scores = t_select - t_scores;
  last_times.copies = t_copies - t_reduced;
  last_times.reduce += t_select - t_copies;
  for (int32_t s = 0; s < count; s++) {
    const seq_part_t *sp = &b.parts[s];
    MTRAIN_TRY(mtrain_pattern_create(sp->N, Hq, G, &out[s]));
    MTRAIN_TRY(select_all(ctx, budgets, options, Hq, sp, G, b.col_host + sp->col_off,
                          b.diag_host + sp->diag_off, out[s]));
  }
  last_times.select = now_s() - t_select;
cleanup:
  if (st)
    for (int32_t s = 0; s < count; s++) {
      mtrain_pattern_destroy(out[s]);
      out[s] = NULL;
    }
  free(plan_select);
  buffers_free(ctx, &b);
  return st;
}
