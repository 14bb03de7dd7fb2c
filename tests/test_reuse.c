/* test_reuse.c: block reuse (mtrain_context_set_reuse_limit, reuse_cache.h).
 * On cpu and cpu-ref, an estimate, a forward and a backward repeated on one
 * context reuse the blocks the earlier calls gave back, which still hold
 * those calls' data, and give results bitwise equal to a context that keeps
 * nothing, at the same length and at a length whose blocks fit the kept ones
 * with less than an eighth to spare; the memory accounting is unchanged; the
 * kept bytes respect the limit (the context's highest live bytes by default, a
 * byte count, 0); release and a caller's allocator free them. Run again with
 * MTRAIN_REUSE_LIMIT set in the environment (--env-zero, --env-bad). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

enum { N = 700, N_SHORT = 650, HQ = 4, HKV = 2, D = 32, G = 64 };

typedef struct outputs {
  float o[N * HQ * D], lse[N * HQ], dq[N * HQ * D], dk[N * HKV * D], dv[N * HKV * D];
} outputs_t;

static float q_[N * HQ * D], k_[N * HKV * D], v_[N * HKV * D], do_[N * HQ * D];

static void *plain_alloc(size_t bytes, void *user) {
  (void)user;
  return malloc(bytes ? bytes : 1);
}

static void plain_free(void *ptr, size_t bytes, void *user) {
  (void)bytes;
  (void)user;
  free(ptr);
}

static mtrain_context_t *new_context(const char *backend, size_t limit) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  cfg.num_threads = 2;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_context_set_reuse_limit(ctx, limit), MTRAIN_SUCCESS);
  return ctx;
}

/* The estimate on the first n tokens, its plan, a forward and a backward. */
static void step(mtrain_context_t *ctx, int64_t n, outputs_t *out) {
  memset(out, 0, sizeof *out);
  mtrain_tensor_t q = mtrain_tensor_3d(q_, MTRAIN_F32, n, HQ, D);
  mtrain_tensor_t k = mtrain_tensor_3d(k_, MTRAIN_F32, n, HKV, D);
  mtrain_tensor_t v = mtrain_tensor_3d(v_, MTRAIN_F32, n, HKV, D);
  mtrain_tensor_t dout = mtrain_tensor_3d(do_, MTRAIN_F32, n, HQ, D);
  mtrain_tensor_t o = mtrain_tensor_3d(out->o, MTRAIN_F32, n, HQ, D);
  mtrain_tensor_t l = mtrain_tensor_2d(out->lse, MTRAIN_F32, n, HQ);
  mtrain_tensor_t dq = mtrain_tensor_3d(out->dq, MTRAIN_F32, n, HQ, D);
  mtrain_tensor_t dk = mtrain_tensor_3d(out->dk, MTRAIN_F32, n, HKV, D);
  mtrain_tensor_t dv = mtrain_tensor_3d(out->dv, MTRAIN_F32, n, HKV, D);
  mtrain_head_budget_t budgets[HQ];
  for (int h = 0; h < HQ; h++) {
    memset(&budgets[h], 0, sizeof budgets[h]);
    budgets[h].kind = MTRAIN_BUDGET_TOP_K;
    budgets[h].v_size = 40 + 10 * h;
    budgets[h].s_size = 60;
  }
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = 64;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_estimate(ctx, &q, &k, budgets, &eo, &p), MTRAIN_SUCCESS);
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_plan_t *plan = NULL;
  assert_int_equal(mtrain_plan_create(ctx, NULL, pats, &plan), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_attention_forward(ctx, plan, &q, &k, &v, &o, &l), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_attention_backward(ctx, plan, &q, &k, &v, &o, &l, &dout, &dq, &dk, &dv),
                   MTRAIN_SUCCESS);
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(p);
}

static void inputs(uint64_t seed) {
  mtrain_tensor_t tq = mtrain_tensor_3d(q_, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tk = mtrain_tensor_3d(k_, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tv = mtrain_tensor_3d(v_, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tdo = mtrain_tensor_3d(do_, MTRAIN_F32, N, HQ, D);
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = seed;
  assert_int_equal(mtrain_generate_structured(&so, &tq, &tk, &tv), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_generate_normal(seed + 1, 1.0, &tdo), MTRAIN_SUCCESS);
}

static void kept(const mtrain_context_t *ctx, size_t *bytes, int64_t *reused) {
  assert_int_equal(mtrain_context_kept(ctx, bytes, reused), MTRAIN_SUCCESS);
}

static void test_reuse_same_results(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(91);
  inputs(seed);
  const char *backends[2] = {"cpu", "cpu-ref"};
  outputs_t *ref = malloc(sizeof *ref), *got = malloc(sizeof *got);
  for (int b = 0; b < 2; b++) {
    const int64_t lengths[3] = {N, N, N_SHORT};
    mtrain_context_t *fresh = new_context(backends[b], 0);
    mtrain_context_t *ctx = new_context(backends[b], MTRAIN_REUSE_LIMIT_PEAK);
    size_t first_peak = 0;
    int64_t reused_before = 0;
    for (int r = 0; r < 3; r++) {
      step(fresh, lengths[r], ref);
      step(ctx, lengths[r], got);
      if (memcmp(ref, got, sizeof *ref) != 0)
        fail_msg("%s, seed %llu, call %d (N %lld): results with reused blocks differ from a "
                 "context that keeps none",
                 backends[b], (unsigned long long)seed, r, (long long)lengths[r]);
      mtrain_memory_stats_t ms, mf;
      assert_int_equal(mtrain_context_memory(ctx, &ms), MTRAIN_SUCCESS);
      assert_int_equal(mtrain_context_memory(fresh, &mf), MTRAIN_SUCCESS);
      /* the accounting counts requested bytes, reused or not */
      assert_int_equal(ms.backend_current_bytes, 0);
      assert_int_equal(ms.backend_peak_bytes, mf.backend_peak_bytes);
      assert_int_equal(ms.backend_allocations, mf.backend_allocations);
      if (r == 0) first_peak = ms.backend_peak_bytes;
      size_t kb;
      int64_t reused;
      kept(ctx, &kb, &reused);
      if (kb == 0 || kb > first_peak)
        fail_msg("%s: %zu bytes kept after call %d, the highest live bytes %zu", backends[b], kb, r,
                 first_peak);
      /* blocks given back earlier in the same step may serve it already;
       * a repeated step reuses more */
      if (r > 0 && reused <= reused_before)
        fail_msg("%s: %lld blocks reused after call %d, %lld before it", backends[b],
                 (long long)reused, r, (long long)reused_before);
      reused_before = reused;
      size_t fb;
      int64_t freused;
      kept(fresh, &fb, &freused);
      assert_int_equal(fb, 0);
      assert_int_equal(freused, 0);
    }
    int64_t reused;
    kept(ctx, NULL, &reused);
    mtrain_memory_stats_t ms;
    assert_int_equal(mtrain_context_memory(ctx, &ms), MTRAIN_SUCCESS);
    printf("%s: %lld of %lld allocations served by kept blocks over 3 steps\n", backends[b],
           (long long)reused, (long long)ms.backend_allocations);
    mtrain_context_destroy(fresh);
    mtrain_context_destroy(ctx);
  }
  free(ref);
  free(got);
}

static void test_reuse_limits(void **state) {
  (void)state;
  inputs(ts_seed(92));
  outputs_t *out = malloc(sizeof *out);
  mtrain_context_t *ctx = new_context("cpu", MTRAIN_REUSE_LIMIT_PEAK);
  step(ctx, N, out);
  size_t kb, limited;
  int64_t reused;
  kept(ctx, &kb, &reused);
  assert_true(kb > 0);
  /* a byte limit below what is kept frees the oldest blocks at once */
  const size_t limit = kb / 2;
  assert_int_equal(mtrain_context_set_reuse_limit(ctx, limit), MTRAIN_SUCCESS);
  kept(ctx, &limited, NULL);
  if (limited > limit) fail_msg("%zu bytes kept under a limit of %zu", limited, limit);
  step(ctx, N, out);
  kept(ctx, &limited, NULL);
  if (limited > limit) fail_msg("%zu bytes kept under a limit of %zu after a call", limited, limit);
  /* release frees everything; the next call still works and keeps again */
  assert_int_equal(mtrain_context_release_kept(ctx), MTRAIN_SUCCESS);
  kept(ctx, &kb, NULL);
  assert_int_equal(kb, 0);
  /* 0 turns reuse off: nothing kept, nothing reused */
  assert_int_equal(mtrain_context_set_reuse_limit(ctx, 0), MTRAIN_SUCCESS);
  kept(ctx, NULL, &reused);
  step(ctx, N, out);
  int64_t after;
  kept(ctx, &kb, &after);
  assert_int_equal(kb, 0);
  assert_int_equal(after, reused);
  /* a caller's allocator: the kept blocks are freed and nothing is kept */
  assert_int_equal(mtrain_context_set_reuse_limit(ctx, MTRAIN_REUSE_LIMIT_PEAK), MTRAIN_SUCCESS);
  step(ctx, N, out);
  kept(ctx, &kb, NULL);
  assert_true(kb > 0);
  const mtrain_allocator_t a = {plain_alloc, plain_free, NULL};
  assert_int_equal(mtrain_context_set_allocator(ctx, &a), MTRAIN_SUCCESS);
  kept(ctx, &kb, NULL);
  assert_int_equal(kb, 0);
  step(ctx, N, out);
  kept(ctx, &kb, NULL);
  assert_int_equal(kb, 0);
  TS_ASSERT_STATUS(mtrain_context_set_reuse_limit(NULL, 0), MTRAIN_ERR_NULL_POINTER, "ctx");
  TS_ASSERT_STATUS(mtrain_context_release_kept(NULL), MTRAIN_ERR_NULL_POINTER, "ctx");
  TS_ASSERT_STATUS(mtrain_context_kept(NULL, NULL, NULL), MTRAIN_ERR_NULL_POINTER, "ctx");
  mtrain_context_destroy(ctx);
  free(out);
}

/* MTRAIN_REUSE_LIMIT=0 in the environment: new contexts keep nothing. */
static void test_reuse_env_zero(void **state) {
  (void)state;
  inputs(ts_seed(93));
  outputs_t *out = malloc(sizeof *out);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  step(ctx, N, out);
  step(ctx, N, out);
  size_t kb;
  int64_t reused;
  kept(ctx, &kb, &reused);
  assert_int_equal(kb, 0);
  assert_int_equal(reused, 0);
  mtrain_context_destroy(ctx);
  free(out);
}

/* A malformed MTRAIN_REUSE_LIMIT fails context creation, naming it. */
static void test_reuse_env_bad(void **state) {
  (void)state;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  mtrain_context_t *ctx = NULL;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "MTRAIN_REUSE_LIMIT");
  assert_null(ctx);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--env-zero") == 0) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_reuse_env_zero)};
    return cmocka_run_group_tests(tests, NULL, NULL);
  }
  if (argc > 1 && strcmp(argv[1], "--env-bad") == 0) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_reuse_env_bad)};
    return cmocka_run_group_tests(tests, NULL, NULL);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reuse_same_results),
      cmocka_unit_test(test_reuse_limits),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
