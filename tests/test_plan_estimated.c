/* test_plan_estimated.c: mtrain_plan_create_estimated, the estimate and the
 * plan of a packed batch in one call, and plans built on the backend (the
 * device_plan slots that the cuda backend fills). Without a GPU the backend
 * side is a stand-in: a table over "cpu-ref" whose device_plan slots select
 * on the host (host_select.h) and build a host plan of their own, and whose
 * attention slots run the views of that plan when a step view carries the
 * stand-in's handle. So this checks the core's part: that the plan built on
 * the backend gives the same patterns (read back on demand), the same pairs
 * and bitwise the same forward and backward as estimate + plan_create, on
 * random batches (seeds printed) with GQA, lengths that are not multiples of
 * G, top-k, top-p and mixed budgets; that the call neither waits for the
 * backend nor copies to the host with top-k budgets; the fallbacks (no
 * slots, a refusal, MTRAIN_PLAN_ON_HOST=1); the memory accounting and bound;
 * and bad inputs. The cuda slots themselves are tested on GPUs
 * (test_cuda_device_plan) and their table builder in the emulator
 * (test_plan_build_emu). */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
#include "host_select.h"
#include "mtrain/mtrain_error.h"
#include "test_support.h"

/* ---- the stand-in backend ---- */

static const mtrain_backend_ops_t *real; /* cpu-ref's table */
static mtrain_context_t *side;           /* builds the stand-in's host plans */
static int syncs, to_host, builds, reads, releases, refuse_size;
static const size_t stand_bytes = 4096; /* what the stand-in asks the core for */

/* The stand-in's handle: the batch's patterns and their host plan. */
typedef struct stand_plan {
  int32_t count, num_heads;
  mtrain_pattern_t **patterns;
  mtrain_plan_t *plan;
  unsigned char *memory; /* the core's backend memory, marked */
} stand_plan_t;

static mtrain_status_t stand_size(void *state, const mtrain_device_plan_args_t *a, size_t *bytes) {
  (void)state;
  if (refuse_size) return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED, "stand-in: refused");
  assert_true(a->count >= 1);
  *bytes = stand_bytes;
  return MTRAIN_SUCCESS;
}

static void stand_release(void *state, void *handle) {
  (void)state;
  stand_plan_t *p = handle;
  releases++;
  mtrain_plan_destroy(p->plan);
  for (int32_t s = 0; s < p->count; s++) mtrain_pattern_destroy(p->patterns[s]);
  free(p->patterns);
  free(p);
}

static mtrain_status_t stand_build(void *state, const mtrain_device_plan_args_t *a, void *memory,
                                   void **handle) {
  builds++;
  stand_plan_t *p = calloc(1, sizeof *p);
  assert_non_null(p);
  p->count = a->count;
  p->num_heads = a->select[0].num_heads;
  p->patterns = calloc((size_t)a->count, sizeof *p->patterns);
  p->memory = memory;
  memset(memory, 0xA5, stand_bytes); /* the core's memory is really this big */
  int64_t *offsets = calloc((size_t)a->count + 1, sizeof *offsets);
  for (int32_t s = 0; s < a->count; s++) {
    mtrain_select_args_t x = a->select[s];
    const int64_t N = x.seq_len, nb = (N + x.granularity - 1) / x.granularity;
    int64_t *v = malloc(sizeof(int64_t) * (size_t)(x.num_heads * N));
    int32_t *d = malloc(sizeof(int32_t) * (size_t)(x.num_heads * (nb + 1) + 2 * x.num_heads));
    x.verticals = v;
    x.diagonals = d;
    x.num_diagonals = d + x.num_heads * (nb + 1);
    x.num_verticals = x.num_diagonals + x.num_heads;
    assert_int_equal(ts_host_pattern_select(state, &x), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_pattern_create(N, x.num_heads, x.granularity, &p->patterns[s]),
                     MTRAIN_SUCCESS);
    for (int32_t h = 0; h < x.num_heads; h++)
      assert_int_equal(mtrain_pattern_set_head(p->patterns[s], h, d + h * (nb + 1),
                                               x.num_diagonals[h], v + h * N, x.num_verticals[h]),
                       MTRAIN_SUCCESS);
    offsets[s + 1] = offsets[s] + N;
    free(v);
    free(d);
  }
  const mtrain_seqs_t seqs = {a->count, offsets};
  mtrain_status_t st =
      mtrain_plan_create(side, &seqs, (const mtrain_pattern_t *const *)p->patterns, &p->plan);
  free(offsets);
  if (st) {
    stand_release(state, p);
    return st;
  }
  *handle = p;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t stand_read(void *state, void *handle, const mtrain_device_plan_args_t *a,
                                  int64_t *pairs) {
  (void)state;
  reads++;
  const stand_plan_t *p = handle;
  assert_int_equal(a->count, p->count);
  for (int32_t s = 0; s < p->count; s++) {
    const mtrain_select_args_t *x = &a->select[s];
    const int64_t N = x->seq_len, nb = (N + x->granularity - 1) / x->granularity;
    for (int32_t h = 0; h < p->num_heads; h++) {
      const mtrain_pattern_head_t *ph = &p->patterns[s]->heads[h];
      x->num_diagonals[h] = ph->num_diagonals;
      x->num_verticals[h] = ph->num_verticals;
      memcpy(x->diagonals + h * (nb + 1), ph->diagonals, sizeof(int32_t) * ph->num_diagonals);
      if (ph->num_verticals) /* (no array without verticals) */
        memcpy(x->verticals + h * N, ph->verticals, sizeof(int64_t) * ph->num_verticals);
      if (pairs) pairs[s * p->num_heads + h] = p->plan->seqs[s].steps[0].heads[h].pairs;
    }
  }
  return MTRAIN_SUCCESS;
}

/* The attention slots: a view carrying the stand-in's handle runs the view
 * of the stand-in's host plan (the same pairs); others run as they are. */
static const mtrain_step_view_t *stand_view(const mtrain_step_view_t *v) {
  if (!v->device_tables) return v;
  const stand_plan_t *p = v->device_tables;
  assert_null(v->heads);
  assert_true(v->device_seq >= 0 && v->device_seq < p->count);
  const mtrain_step_view_t *w = &p->plan->seqs[v->device_seq].steps[0].view;
  assert_int_equal(w->seq_len, v->seq_len);
  assert_int_equal(w->num_q_blocks, v->num_q_blocks);
  return w;
}

static mtrain_status_t stand_fwd(void *state, const mtrain_fwd_step_args_t *a) {
  mtrain_fwd_step_args_t b = *a;
  b.view = stand_view(a->view);
  return real->attn_fwd_step(state, &b);
}

static mtrain_status_t stand_bwd(void *state, const mtrain_bwd_step_args_t *a) {
  mtrain_bwd_step_args_t b = *a;
  b.view = stand_view(a->view);
  return real->attn_bwd_step(state, &b);
}

static mtrain_status_t stand_sync(void *state) {
  syncs++;
  return real->synchronize(state);
}

static mtrain_status_t stand_to_host(void *state, void *dst, const void *src, size_t bytes) {
  to_host++;
  return real->copy_to_host(state, dst, src, bytes);
}

/* The row statistics on the "backend" (host memory: cpu-ref's), as the
 * cuda backend keeps them on its device. */
static mtrain_status_t stand_fill(void *state, double *dst, double value, int64_t count) {
  (void)state;
  for (int64_t i = 0; i < count; i++) dst[i] = value;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t stand_row_sums(void *state, const double *in, double *out, int64_t rows,
                                      int64_t cols) {
  (void)state;
  for (int64_t r = 0; r < rows; r++) {
    double sum = 0.0;
    for (int64_t c = 0; c < cols; c++) sum += in[r * cols + c];
    out[r] = sum;
  }
  return MTRAIN_SUCCESS;
}

static mtrain_backend_ops_t stand_table(void) {
  real = mtrain_backend_find("cpu-ref");
  assert_non_null(real);
  mtrain_backend_ops_t ops = *real;
  ops.name = "stand-in";
  ops.pattern_select = ts_host_pattern_select;
  ops.device_plan_size = stand_size;
  ops.device_plan_build = stand_build;
  ops.device_plan_read = stand_read;
  ops.device_plan_release = stand_release;
  ops.attn_fwd_step = stand_fwd;
  ops.attn_bwd_step = stand_bwd;
  ops.synchronize = stand_sync;
  ops.copy_to_host = stand_to_host;
  ops.fill_f64 = stand_fill;
  ops.row_sums_f64 = stand_row_sums;
  return ops;
}

static mtrain_context_t *make_context(int32_t G) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cpu-ref";
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  return ctx;
}

/* ---- one batch ---- */

typedef struct batch {
  int32_t count, Hq, Hkv, d, G;
  int64_t offsets[8];
  int style; /* 0 top-k, 1 top-p, 2 mixed */
  double *q, *k, *v, *dout;
  mtrain_head_budget_t budgets[8];
  mtrain_estimate_options_t opt;
} batch_t;

static batch_t random_batch(uint64_t seed) {
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  batch_t b;
  memset(&b, 0, sizeof b);
  const int32_t Gs[] = {16, 32}, ds[] = {8, 16};
  b.G = Gs[ts_rng_below(&rng, 2)];
  b.d = ds[ts_rng_below(&rng, 2)];
  b.Hkv = 1 + (int32_t)ts_rng_below(&rng, 2);
  b.Hq = b.Hkv * (1 + (int32_t)ts_rng_below(&rng, 3));
  b.count = 1 + (int32_t)ts_rng_below(&rng, 5);
  b.style = (int)ts_rng_below(&rng, 3);
  for (int32_t s = 0; s < b.count; s++) {
    const int pick = (int)ts_rng_below(&rng, 3);
    const int64_t len = pick == 0   ? 1 + ts_rng_below(&rng, b.G)
                        : pick == 1 ? b.G * (1 + ts_rng_below(&rng, 5))
                                    : 1 + ts_rng_below(&rng, 300);
    b.offsets[s + 1] = b.offsets[s] + len;
  }
  for (int32_t h = 0; h < b.Hq; h++) {
    mtrain_head_budget_t *x = &b.budgets[h];
    if (b.style == 1 || (b.style == 2 && h % 2)) {
      x->kind = MTRAIN_BUDGET_TOP_P;
      x->p_v = 0.5;
      x->p_s = 0.8;
      x->cap_v = 20 + 3 * h;
      x->cap_s = 200;
    } else {
      x->kind = MTRAIN_BUDGET_TOP_K;
      x->v_size = 4 + 3 * h;
      x->s_size = 10 + 7 * h;
    }
  }
  b.opt = (mtrain_estimate_options_t)MTRAIN_ESTIMATE_INIT;
  b.opt.last_q = 1 + (int32_t)ts_rng_below(&rng, 40);
  b.opt.num_sinks = 3;
  b.opt.window = 7;
  const int64_t T = b.offsets[b.count];
  b.q = malloc(sizeof(double) * (size_t)(T * b.Hq * b.d));
  b.k = malloc(sizeof(double) * (size_t)(T * b.Hkv * b.d));
  b.v = malloc(sizeof(double) * (size_t)(T * b.Hkv * b.d));
  b.dout = malloc(sizeof(double) * (size_t)(T * b.Hq * b.d));
  ts_fill_normal(&rng, b.q, MTRAIN_F64, T * b.Hq * b.d, 1.0, NULL);
  ts_fill_normal(&rng, b.k, MTRAIN_F64, T * b.Hkv * b.d, 1.0, NULL);
  ts_fill_normal(&rng, b.v, MTRAIN_F64, T * b.Hkv * b.d, 1.0, NULL);
  ts_fill_normal(&rng, b.dout, MTRAIN_F64, T * b.Hq * b.d, 1.0, NULL);
  return b;
}

static void batch_free(batch_t *b) {
  free(b->q);
  free(b->k);
  free(b->v);
  free(b->dout);
}

/* Forward and backward of plan on ctx: o, lse, dq, dk, dv (malloc'ed, in
 * that order in one buffer, returned). */
static double *run_attention(mtrain_context_t *ctx, mtrain_plan_t *plan, const batch_t *b) {
  const int64_t T = b->offsets[b->count];
  const size_t nq = (size_t)(T * b->Hq * b->d), nk = (size_t)(T * b->Hkv * b->d);
  double *out = calloc(2 * nq + (size_t)(T * b->Hq) + 2 * nk, sizeof(double));
  double *o = out, *lse = o + nq, *dq = lse + T * b->Hq, *dk = dq + nq, *dv = dk + nk;
  const mtrain_tensor_t tq = mtrain_tensor_3d(b->q, MTRAIN_F64, T, b->Hq, b->d);
  const mtrain_tensor_t tk = mtrain_tensor_3d(b->k, MTRAIN_F64, T, b->Hkv, b->d);
  const mtrain_tensor_t tv = mtrain_tensor_3d(b->v, MTRAIN_F64, T, b->Hkv, b->d);
  const mtrain_tensor_t tdo = mtrain_tensor_3d(b->dout, MTRAIN_F64, T, b->Hq, b->d);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F64, T, b->Hq, b->d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F64, T, b->Hq);
  mtrain_tensor_t tdq = mtrain_tensor_3d(dq, MTRAIN_F64, T, b->Hq, b->d);
  mtrain_tensor_t tdk = mtrain_tensor_3d(dk, MTRAIN_F64, T, b->Hkv, b->d);
  mtrain_tensor_t tdv = mtrain_tensor_3d(dv, MTRAIN_F64, T, b->Hkv, b->d);
  if (mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl) != MTRAIN_SUCCESS)
    fail_msg("forward: %s", mtrain_last_error());
  if (mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv) !=
      MTRAIN_SUCCESS)
    fail_msg("backward: %s", mtrain_last_error());
  return out;
}

static size_t attention_doubles(const batch_t *b) {
  const int64_t T = b->offsets[b->count];
  return (size_t)(2 * T * b->Hq * b->d + T * b->Hq + 2 * T * b->Hkv * b->d);
}

/* The reference: estimate_batch then plan_create on the plain cpu-ref. */
static mtrain_plan_t *reference_plan(mtrain_context_t *ctx, const batch_t *b,
                                     mtrain_pattern_t **patterns) {
  const int64_t T = b->offsets[b->count];
  const mtrain_seqs_t seqs = {b->count, (int64_t *)b->offsets};
  const mtrain_tensor_t tq = mtrain_tensor_3d(b->q, MTRAIN_F64, T, b->Hq, b->d);
  const mtrain_tensor_t tk = mtrain_tensor_3d(b->k, MTRAIN_F64, T, b->Hkv, b->d);
  assert_int_equal(
      mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b->budgets, &b->opt, patterns),
      MTRAIN_SUCCESS);
  mtrain_plan_t *plan = NULL;
  assert_int_equal(mtrain_plan_create(ctx, &seqs, (const mtrain_pattern_t *const *)patterns, &plan),
                   MTRAIN_SUCCESS);
  return plan;
}

static mtrain_plan_t *estimated_plan(mtrain_context_t *ctx, const batch_t *b) {
  const int64_t T = b->offsets[b->count];
  const mtrain_seqs_t seqs = {b->count, (int64_t *)b->offsets};
  const mtrain_tensor_t tq = mtrain_tensor_3d(b->q, MTRAIN_F64, T, b->Hq, b->d);
  const mtrain_tensor_t tk = mtrain_tensor_3d(b->k, MTRAIN_F64, T, b->Hkv, b->d);
  mtrain_plan_t *plan = NULL;
  if (mtrain_plan_create_estimated(ctx, &seqs, &tq, &tk, b->budgets, &b->opt, &plan) !=
      MTRAIN_SUCCESS)
    fail_msg("estimated plan: %s", mtrain_last_error());
  return plan;
}

/* The plan's patterns, pairs and attention against the reference's. */
static void compare_plans(uint64_t seed, const batch_t *b, mtrain_context_t *ctx,
                          mtrain_plan_t *plan, mtrain_context_t *ref_ctx, mtrain_plan_t *ref,
                          mtrain_pattern_t **ref_patterns) {
  double *got = run_attention(ctx, plan, b);
  double *want = run_attention(ref_ctx, ref, b);
  const size_t n = attention_doubles(b);
  for (size_t i = 0; i < n; i++)
    if (memcmp(&got[i], &want[i], sizeof(double)) != 0)
      fail_msg("seed %llu: attention output %zu of %zu differs (%.17g, reference %.17g)",
               (unsigned long long)seed, i, n, got[i], want[i]);
  free(got);
  free(want);
  assert_int_equal(mtrain_plan_computed_pairs(plan), mtrain_plan_computed_pairs(ref));
  for (int32_t s = 0; s < b->count; s++) {
    const mtrain_pattern_t *p = NULL;
    assert_int_equal(mtrain_plan_pattern(plan, s, &p), MTRAIN_SUCCESS);
    int32_t head = -1;
    if (!ts_patterns_equal(p, ref_patterns[s], b->Hq, &head))
      fail_msg("seed %llu: sequence %d head %d: the plan's pattern differs from the estimate's",
               (unsigned long long)seed, s, head);
  }
  assert_int_equal(mtrain_plan_local_tokens(plan), mtrain_plan_local_tokens(ref));
  assert_int_equal(mtrain_plan_num_seqs(plan), b->count);
  for (int32_t s = 0; s < b->count; s++)
    assert_int_equal(mtrain_plan_seq_local_offset(plan, s), b->offsets[s]);
}

static void test_backend_plan_equals_host_plan(void **state) {
  (void)state;
  const uint64_t seed0 = ts_seed(20261128);
  mtrain_backend_ops_t ops = stand_table();
  assert_int_equal(mtrain_backend_table_check(&ops), MTRAIN_SUCCESS);
  mtrain_backend_ops_t no_stats = ops; /* without the row-statistics slots */
  no_stats.fill_f64 = NULL;
  no_stats.row_sums_f64 = NULL;
  for (int i = 0; i < 18; i++) {
    const uint64_t seed = seed0 + (uint64_t)i;
    batch_t b = random_batch(seed);
    const int with_stats = i % 3 != 2;
    printf("case %d seed %llu: %d sequences (%lld tokens), G %d, %d:%d heads, d %d, budgets %d, "
           "row statistics %s\n",
           i, (unsigned long long)seed, b.count, (long long)b.offsets[b.count], b.G, b.Hq, b.Hkv,
           b.d, b.style, with_stats ? "on the backend" : "on the host");
    mtrain_context_t *ref_ctx = make_context(b.G), *ctx = make_context(b.G);
    side = make_context(b.G);
    ctx->backend = with_stats ? &ops : &no_stats;
    mtrain_pattern_t *ref_patterns[8] = {0};
    mtrain_plan_t *ref = reference_plan(ref_ctx, &b, ref_patterns);
    syncs = to_host = builds = reads = releases = 0;
    mtrain_plan_t *plan = estimated_plan(ctx, &b);
    assert_int_equal(mtrain_plan_on_device(plan), 1);
    assert_int_equal(builds, 1);
    assert_int_equal(reads, 0); /* nothing read back until asked for */
    if (b.style == 0 || with_stats) {
      /* top-k, or top-p heads with the row statistics on the backend: the call
       * neither waits for the backend nor copies to the host */
      assert_int_equal(syncs, 0);
      assert_int_equal(to_host, 0);
    } else {
      /* top-p heads without them: the statistics come to the host */
      assert_true(to_host > 0);
    }
    /* the plan holds the backend memory it asked for, counted by the context */
    mtrain_memory_stats_t m;
    assert_int_equal(mtrain_context_memory(ctx, &m), MTRAIN_SUCCESS);
    assert_true(m.backend_current_bytes >= stand_bytes);
    mtrain_memory_bound_t bound;
    assert_int_equal(mtrain_memory_bound(ctx, plan, b.Hkv, b.d, MTRAIN_F64, b.opt.last_q, &bound),
                     MTRAIN_SUCCESS);
    assert_int_equal(bound.device_plan_bytes, stand_bytes);
    assert_true(mtrain_plan_bytes(plan) >= stand_bytes);
    compare_plans(seed, &b, ctx, plan, ref_ctx, ref, ref_patterns);
    assert_int_equal(reads, 1); /* read once, on the first question */
    assert_int_equal(mtrain_context_reset_peak_memory(ctx), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_context_memory(ctx, &m), MTRAIN_SUCCESS);
    assert_true(m.backend_peak_bytes <= bound.backend_bytes);
    mtrain_plan_destroy(plan);
    assert_int_equal(releases, 1);
    assert_int_equal(mtrain_context_memory(ctx, &m), MTRAIN_SUCCESS);
    assert_int_equal(m.backend_current_bytes, 0);
    mtrain_plan_destroy(ref);
    for (int32_t s = 0; s < b.count; s++) mtrain_pattern_destroy(ref_patterns[s]);
    mtrain_context_destroy(side);
    ctx->backend = real;
    mtrain_context_destroy(ctx);
    mtrain_context_destroy(ref_ctx);
    batch_free(&b);
  }
}

/* Without the slots, with a refusal and with MTRAIN_PLAN_ON_HOST=1 the plan
 * is built on the host, and is the reference's. */
static void test_host_plan_fallbacks(void **state) {
  (void)state;
  const uint64_t seed0 = ts_seed(77);
  mtrain_backend_ops_t ops = stand_table();
  for (int mode = 0; mode < 3; mode++) {
    const uint64_t seed = seed0 + (uint64_t)mode;
    batch_t b = random_batch(seed);
    printf("fallback %d seed %llu\n", mode, (unsigned long long)seed);
    mtrain_context_t *ref_ctx = make_context(b.G), *ctx = make_context(b.G);
    side = make_context(b.G);
    if (mode > 0) ctx->backend = &ops;
    refuse_size = mode == 1;
    if (mode == 2) setenv("MTRAIN_PLAN_ON_HOST", "1", 1);
    builds = 0;
    mtrain_pattern_t *ref_patterns[8] = {0};
    mtrain_plan_t *ref = reference_plan(ref_ctx, &b, ref_patterns);
    mtrain_plan_t *plan = estimated_plan(ctx, &b);
    assert_int_equal(mtrain_plan_on_device(plan), 0);
    assert_int_equal(builds, 0);
    compare_plans(seed, &b, ctx, plan, ref_ctx, ref, ref_patterns);
    unsetenv("MTRAIN_PLAN_ON_HOST");
    refuse_size = 0;
    mtrain_plan_destroy(plan);
    mtrain_plan_destroy(ref);
    for (int32_t s = 0; s < b.count; s++) mtrain_pattern_destroy(ref_patterns[s]);
    mtrain_context_destroy(side);
    ctx->backend = real;
    mtrain_context_destroy(ctx);
    mtrain_context_destroy(ref_ctx);
    batch_free(&b);
  }
}

static void test_bad_inputs(void **state) {
  (void)state;
  mtrain_backend_ops_t ops = stand_table();
  batch_t b = random_batch(5);
  const int64_t T = b.offsets[b.count];
  mtrain_context_t *ctx = make_context(b.G), *other = make_context(b.G);
  side = make_context(b.G);
  ctx->backend = &ops;
  const mtrain_seqs_t seqs = {b.count, b.offsets};
  const mtrain_tensor_t tq = mtrain_tensor_3d(b.q, MTRAIN_F64, T, b.Hq, b.d);
  const mtrain_tensor_t tk = mtrain_tensor_3d(b.k, MTRAIN_F64, T, b.Hkv, b.d);
  mtrain_plan_t *plan = (mtrain_plan_t *)&b; /* must be overwritten with NULL */
  TS_ASSERT_STATUS(mtrain_plan_create_estimated(ctx, &seqs, &tq, &tk, b.budgets, &b.opt, NULL),
                   MTRAIN_ERR_NULL_POINTER, "out");
  TS_ASSERT_STATUS(mtrain_plan_create_estimated(NULL, &seqs, &tq, &tk, b.budgets, &b.opt, &plan),
                   MTRAIN_ERR_NULL_POINTER, "ctx");
  assert_null(plan);
  TS_ASSERT_STATUS(mtrain_plan_create_estimated(ctx, NULL, &tq, &tk, b.budgets, &b.opt, &plan),
                   MTRAIN_ERR_NULL_POINTER, "seqs");
  TS_ASSERT_STATUS(mtrain_plan_create_estimated(ctx, &seqs, &tq, NULL, b.budgets, &b.opt, &plan),
                   MTRAIN_ERR_NULL_POINTER, "k");
  TS_ASSERT_STATUS(mtrain_plan_create_estimated(ctx, &seqs, NULL, &tk, b.budgets, &b.opt, &plan),
                   MTRAIN_ERR_NULL_POINTER, "q");
  const mtrain_seqs_t none = {0, b.offsets};
  TS_ASSERT_STATUS(mtrain_plan_create_estimated(ctx, &none, &tq, &tk, b.budgets, &b.opt, &plan),
                   MTRAIN_ERR_INVALID_ARGUMENT, "num_seqs must be >= 1");
  const mtrain_seqs_t short_seqs = {1, b.offsets};
  if (b.count > 1)
    TS_ASSERT_STATUS(
        mtrain_plan_create_estimated(ctx, &short_seqs, &tq, &tk, b.budgets, &b.opt, &plan),
        MTRAIN_ERR_SHAPE_MISMATCH, "tokens");
  mtrain_head_budget_t bad[8];
  memcpy(bad, b.budgets, sizeof bad);
  bad[0].kind = MTRAIN_BUDGET_TOP_P;
  bad[0].p_v = 2.0;
  TS_ASSERT_STATUS(mtrain_plan_create_estimated(ctx, &seqs, &tq, &tk, bad, &b.opt, &plan),
                   MTRAIN_ERR_INVALID_BUDGET, "budgets[0]");
  assert_null(plan);
  plan = estimated_plan(ctx, &b);
  const mtrain_pattern_t *p = NULL;
  TS_ASSERT_STATUS(mtrain_plan_pattern(plan, b.count, &p), MTRAIN_ERR_INVALID_ARGUMENT,
                   "out of range");
  TS_ASSERT_STATUS(mtrain_plan_pattern(plan, -1, &p), MTRAIN_ERR_INVALID_ARGUMENT, "out of range");
  TS_ASSERT_STATUS(mtrain_plan_pattern(NULL, 0, &p), MTRAIN_ERR_NULL_POINTER, "plan");
  TS_ASSERT_STATUS(mtrain_plan_pattern(plan, 0, NULL), MTRAIN_ERR_NULL_POINTER, "out");
  /* a plan built on one context's backend runs on that context only */
  const size_t nq = (size_t)(T * b.Hq * b.d);
  double *o = calloc(nq + (size_t)(T * b.Hq), sizeof(double));
  const mtrain_tensor_t tv = mtrain_tensor_3d(b.v, MTRAIN_F64, T, b.Hkv, b.d);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F64, T, b.Hq, b.d);
  mtrain_tensor_t tl = mtrain_tensor_2d(o + nq, MTRAIN_F64, T, b.Hq);
  TS_ASSERT_STATUS(mtrain_attention_forward(other, plan, &tq, &tk, &tv, &to, &tl),
                   MTRAIN_ERR_INVALID_ARGUMENT, "another context");
  free(o);
  mtrain_plan_destroy(plan);
  mtrain_plan_destroy(NULL);
  assert_int_equal(mtrain_plan_on_device(NULL), 0);
  /* a table with some of the four slots is refused */
  mtrain_backend_ops_t partial = ops;
  partial.device_plan_read = NULL;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&partial), MTRAIN_ERR_INVALID_CONFIG,
                   "only 3 are set");
  partial = ops;
  partial.pattern_select = NULL;
  partial.pattern_select_batch = NULL;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&partial), MTRAIN_ERR_INVALID_CONFIG,
                   "'pattern_select' is NULL");
  partial = ops;
  partial.row_sums_f64 = NULL;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&partial), MTRAIN_ERR_INVALID_CONFIG,
                   "'fill_f64' is set but 'row_sums_f64' is NULL");
  mtrain_context_destroy(side);
  ctx->backend = real;
  mtrain_context_destroy(ctx);
  mtrain_context_destroy(other);
  batch_free(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_backend_plan_equals_host_plan),
      cmocka_unit_test(test_host_plan_fallbacks),
      cmocka_unit_test(test_bad_inputs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
