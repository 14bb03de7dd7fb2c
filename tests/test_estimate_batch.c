/* test_estimate_batch.c: mtrain_pattern_estimate_batch, the estimate of a
 * packed batch of sequences in one call. Every sequence's pattern must be
 * bitwise the one mtrain_pattern_estimate gives for its rows alone: on
 * "cpu-ref" (fp64) and "cpu" (fp32), random batches (seeds printed) with
 * lengths that are not multiples of G, sequences shorter than G and than L,
 * GQA, several head dims, top-k, top-p and mixed budgets, top-p with and
 * without the sinks and the window forced (top_p_forced). The selection on a
 * backend (the path the cuda backend takes) is checked with a table that
 * selects on the host through the pattern_select slot, with and without the
 * pattern_select_batch and pattern_scores_batch slots (one call per stage
 * for the whole batch). Bad inputs give clear errors and no pattern. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/select.h"
#include "host_select.h"
#include "test_support.h"

typedef struct batch_case {
  int32_t count, Hq, Hkv, d, G, L;
  int64_t offsets[9];
  int budget_style;     /* 0 top-k, 1 top-p, 2 mixed */
  int32_t top_p_forced; /* the estimate's option (random_case leaves it 0) */
} batch_case_t;

static mtrain_head_budget_t budget_of(int style, int32_t h) {
  mtrain_head_budget_t b = {0};
  if (style == 1 || (style == 2 && h % 2)) {
    b.kind = MTRAIN_BUDGET_TOP_P;
    b.p_v = 0.4 + 0.15 * (h % 3);
    b.p_s = 0.85;
    b.cap_v = 24 + 5 * h;
    b.cap_s = 300;
  } else {
    b.kind = MTRAIN_BUDGET_TOP_K;
    b.v_size = 5 + 3 * h;
    b.s_size = 20 + 9 * h;
  }
  return b;
}

static batch_case_t random_case(ts_rng_t *rng) {
  batch_case_t c;
  memset(&c, 0, sizeof c);
  const int32_t G_choices[] = {16, 32}, d_choices[] = {8, 16, 32};
  c.G = G_choices[ts_rng_below(rng, 2)];
  c.d = d_choices[ts_rng_below(rng, 3)];
  c.Hkv = 1 + (int32_t)ts_rng_below(rng, 2);
  c.Hq = c.Hkv * (1 + (int32_t)ts_rng_below(rng, 3));
  c.L = 1 + (int32_t)ts_rng_below(rng, 80);
  c.count = 1 + (int32_t)ts_rng_below(rng, 8);
  c.budget_style = (int)ts_rng_below(rng, 3);
  for (int32_t s = 0; s < c.count; s++) {
    const int pick = (int)ts_rng_below(rng, 4);
    const int64_t len = pick == 0   ? 1 + ts_rng_below(rng, c.G)       /* shorter than a block */
                        : pick == 1 ? c.G * (1 + ts_rng_below(rng, 6)) /* whole blocks */
                                    : 1 + ts_rng_below(rng, 400);
    c.offsets[s + 1] = c.offsets[s] + len;
  }
  return c;
}

static mtrain_context_t *make_context(const char *backend, int32_t G) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  return ctx;
}

/* Estimates the batch with one call and each sequence alone; fails unless
 * every pattern is the same. The batch's patterns are kept in keep[] (when
 * not NULL; the caller destroys them). */
static void check_batch(mtrain_context_t *ctx, const batch_case_t *c, const char *what,
                        uint64_t seed, mtrain_pattern_t **keep) {
  const mtrain_dtype_t dt = strcmp(ctx->backend_name, "cpu-ref") == 0 ? MTRAIN_F64 : MTRAIN_F32;
  const int64_t T = c->offsets[c->count];
  const size_t es = mtrain_dtype_size(dt);
  const size_t q_row = (size_t)c->Hq * (size_t)c->d, k_row = (size_t)c->Hkv * (size_t)c->d;
  char *q = malloc(es * q_row * (size_t)T), *k = malloc(es * k_row * (size_t)T);
  assert_non_null(q);
  assert_non_null(k);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed ^ 0x5eed);
  ts_fill_normal(&rng, q, dt, (int64_t)q_row * T, 1.0, NULL);
  ts_fill_normal(&rng, k, dt, (int64_t)k_row * T, 1.0, NULL);
  mtrain_head_budget_t budgets[8];
  for (int32_t h = 0; h < c->Hq; h++) budgets[h] = budget_of(c->budget_style, h);
  mtrain_estimate_options_t opt = MTRAIN_ESTIMATE_INIT;
  opt.last_q = c->L;
  opt.num_sinks = 3;
  opt.window = 7;
  opt.top_p_forced = c->top_p_forced;
  const mtrain_seqs_t seqs = {c->count, c->offsets};
  const mtrain_tensor_t tq = mtrain_tensor_3d(q, dt, T, c->Hq, c->d);
  const mtrain_tensor_t tk = mtrain_tensor_3d(k, dt, T, c->Hkv, c->d);
  mtrain_pattern_t *batch[8] = {0};
  if (mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, budgets, &opt, batch) != MTRAIN_SUCCESS)
    fail_msg("%s seed %llu: batch estimate: %s", what, (unsigned long long)seed,
             mtrain_last_error());
  for (int32_t s = 0; s < c->count; s++) {
    const int64_t n = c->offsets[s + 1] - c->offsets[s];
    const mtrain_tensor_t sq =
        mtrain_tensor_3d(q + es * q_row * (size_t)c->offsets[s], dt, n, c->Hq, c->d);
    const mtrain_tensor_t sk =
        mtrain_tensor_3d(k + es * k_row * (size_t)c->offsets[s], dt, n, c->Hkv, c->d);
    mtrain_pattern_t *alone = NULL;
    if (mtrain_pattern_estimate(ctx, &sq, &sk, budgets, &opt, &alone) != MTRAIN_SUCCESS)
      fail_msg("%s seed %llu: estimate of sequence %d: %s", what, (unsigned long long)seed, s,
               mtrain_last_error());
    int32_t head = -1;
    assert_int_equal(mtrain_pattern_seq_len(batch[s]), n);
    if (!ts_patterns_equal(batch[s], alone, c->Hq, &head))
      fail_msg("%s seed %llu: sequence %d of %d (%lld tokens, G %d, L %d, %d:%d heads, d %d, "
               "budgets %d, top_p_forced %d): head %d differs from the estimate of the sequence "
               "alone",
               what, (unsigned long long)seed, s, c->count, (long long)n, c->G, c->L, c->Hq, c->Hkv,
               c->d, c->budget_style, c->top_p_forced, head);
    mtrain_pattern_destroy(alone);
    if (keep)
      keep[s] = batch[s];
    else
      mtrain_pattern_destroy(batch[s]);
  }
  free(q);
  free(k);
}

static void test_batch_equals_each_sequence(void **state) {
  (void)state;
  const uint64_t seed0 = ts_seed(20261127);
  const char *backends[] = {"cpu-ref", "cpu"};
  for (int i = 0; i < 24; i++) {
    const uint64_t seed = seed0 + (uint64_t)i;
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    batch_case_t c = random_case(&rng);
    const char *backend = backends[i % 2];
    printf("batch case %d seed %llu: %s, %d sequences (%lld tokens), G %d, L %d, %d:%d heads, "
           "d %d, budgets %d\n",
           i, (unsigned long long)seed, backend, c.count, (long long)c.offsets[c.count], c.G, c.L,
           c.Hq, c.Hkv, c.d, c.budget_style);
    mtrain_context_t *ctx = make_context(backend, c.G);
    check_batch(ctx, &c, backend, seed, NULL);
    if (c.budget_style != 0) { /* top-p heads: again with the sinks and the window forced */
      c.top_p_forced = 1;
      check_batch(ctx, &c, backend, seed, NULL);
    }
    mtrain_context_destroy(ctx);
  }
}

/* ---- a backend that selects through the pattern_select slot (on the host,
 * as the cuda backend does on its device) ---- */

static int select_calls, select_batch_calls;

static mtrain_status_t host_pattern_select(void *state, const mtrain_select_args_t *a) {
  select_calls++;
  return ts_host_pattern_select(state, a);
}

static int scores_batch_calls;
static mtrain_status_t (*real_scores)(void *state, const mtrain_scores_args_t *args);

/* A pattern_scores_batch slot over the backend's own pattern_scores. */
static mtrain_status_t counting_scores_batch(void *state, const mtrain_scores_args_t *args,
                                             int32_t count) {
  scores_batch_calls++;
  for (int32_t s = 0; s < count; s++) {
    mtrain_status_t st = real_scores(state, &args[s]);
    if (st) return st;
  }
  return MTRAIN_SUCCESS;
}

static mtrain_status_t host_pattern_select_batch(void *state, const mtrain_select_args_t *args,
                                                 int32_t count) {
  select_batch_calls++;
  for (int32_t s = 0; s < count; s++) {
    mtrain_status_t st = host_pattern_select(state, &args[s]);
    if (st) return st;
  }
  return MTRAIN_SUCCESS;
}

static void test_batch_through_backend_selection(void **state) {
  (void)state;
  const uint64_t seed0 = ts_seed(9127);
  for (int with_batch_slot = 0; with_batch_slot <= 1; with_batch_slot++)
    for (int i = 0; i < 6; i++) {
      const uint64_t seed = seed0 + (uint64_t)i;
      ts_rng_t rng;
      ts_rng_seed(&rng, seed);
      batch_case_t c = random_case(&rng);
      printf("backend selection (%s), case %d seed %llu: %d sequences, G %d, L %d\n",
             with_batch_slot ? "batch slot" : "per sequence", i, (unsigned long long)seed, c.count,
             c.G, c.L);
      /* top-p heads: also with the sinks and the window forced (top_p_forced reaches
       * the backend's selection arguments) */
      for (int32_t forced = 0; forced <= (c.budget_style != 0); forced++) {
        c.top_p_forced = forced;
        mtrain_context_t *ctx = make_context("cpu-ref", c.G);
        mtrain_backend_ops_t ops = *ctx->backend;
        ops.pattern_select = host_pattern_select;
        ops.pattern_select_batch = with_batch_slot ? host_pattern_select_batch : NULL;
        real_scores = ops.pattern_scores;
        ops.pattern_scores_batch = with_batch_slot ? counting_scores_batch : NULL;
        assert_int_equal(mtrain_backend_table_check(&ops), MTRAIN_SUCCESS);
        /* the reference: the core's own host selection */
        mtrain_pattern_t *host[8] = {0}, *backend[8] = {0};
        check_batch(ctx, &c, "host selection", seed, host);
        const mtrain_backend_ops_t *real = ctx->backend;
        ctx->backend = &ops;
        select_calls = select_batch_calls = scores_batch_calls = 0;
        check_batch(ctx, &c, "backend selection", seed, backend);
        for (int32_t s = 0; s < c.count; s++) {
          int32_t head = -1;
          if (!ts_patterns_equal(host[s], backend[s], c.Hq, &head))
            fail_msg("seed %llu: sequence %d head %d: the backend's selection differs from the "
                     "host's (top_p_forced %d)",
                     (unsigned long long)seed, s, head, forced);
          mtrain_pattern_destroy(host[s]);
          mtrain_pattern_destroy(backend[s]);
        }
        /* one batch call for the batch, then one per sequence alone */
        assert_int_equal(select_batch_calls, with_batch_slot ? 1 + c.count : 0);
        assert_int_equal(select_calls, 2 * c.count);
        /* one scores call per stage for the batch (three stages with top-p heads) */
        const int stages = c.budget_style == 0 ? 1 : 3;
        assert_int_equal(scores_batch_calls, with_batch_slot ? stages * (1 + c.count) : 0);
        ctx->backend = real;
        mtrain_context_destroy(ctx);
      }
    }
}

static void test_batch_bad_inputs(void **state) {
  (void)state;
  mtrain_context_t *ctx = make_context("cpu", 16);
  enum { T = 40, H = 2, D = 8 };
  static float q[T * H * D], k[T * H * D];
  const mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, T, H, D);
  const mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, T, H, D);
  mtrain_head_budget_t b[H] = {budget_of(0, 0), budget_of(0, 1)};
  const mtrain_estimate_options_t opt = MTRAIN_ESTIMATE_INIT;
  int64_t offsets[3] = {0, 10, T};
  mtrain_seqs_t seqs = {2, offsets};
  mtrain_pattern_t *out[2] = {(mtrain_pattern_t *)&seqs, (mtrain_pattern_t *)&seqs};
  TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, NULL, &tq, &tk, b, &opt, out),
                   MTRAIN_ERR_NULL_POINTER, "seqs");
  TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, NULL),
                   MTRAIN_ERR_NULL_POINTER, "out");
  seqs.num_seqs = 0;
  TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, out),
                   MTRAIN_ERR_INVALID_ARGUMENT, "num_seqs must be >= 1, got 0");
  seqs.num_seqs = 2;
  seqs.offsets = NULL;
  TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, out),
                   MTRAIN_ERR_NULL_POINTER, "seqs->offsets is NULL");
  assert_null(out[0]);
  assert_null(out[1]);
  seqs.offsets = offsets;
  offsets[0] = 2;
  TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, out),
                   MTRAIN_ERR_INVALID_ARGUMENT, "offsets[0] is 2, must be 0");
  offsets[0] = 0;
  offsets[1] = 0;
  TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, out),
                   MTRAIN_ERR_INVALID_ARGUMENT, "sequence 0 has length 0");
  offsets[1] = 10;
  offsets[2] = T - 1;
  TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, out),
                   MTRAIN_ERR_SHAPE_MISMATCH, "the 2 sequences hold 39 tokens, q and k have 40");
  offsets[2] = T;
  b[1].v_size = -3;
  TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, out),
                   MTRAIN_ERR_INVALID_BUDGET, "budgets[1]");
  assert_null(out[0]);
  assert_null(out[1]);
  b[1] = budget_of(0, 1);
  assert_int_equal(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, out),
                   MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_seq_len(out[0]), 10);
  assert_int_equal(mtrain_pattern_seq_len(out[1]), T - 10);
  mtrain_pattern_destroy(out[0]);
  mtrain_pattern_destroy(out[1]);
  /* a batch slot without the single one is refused */
  mtrain_backend_ops_t ops = *ctx->backend;
  ops.pattern_select = NULL;
  ops.pattern_select_batch = host_pattern_select_batch;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "'pattern_select_batch' is set but 'pattern_select' is NULL");
  ops = *ctx->backend;
  ops.pattern_scores = NULL;
  ops.pattern_scores_batch = counting_scores_batch;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "'pattern_scores_batch' is set but 'pattern_scores' is NULL");
  mtrain_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_batch_equals_each_sequence),
      cmocka_unit_test(test_batch_through_backend_selection),
      cmocka_unit_test(test_batch_bad_inputs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
