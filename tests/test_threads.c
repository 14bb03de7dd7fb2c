/* test_threads.c: the context accepts only thread counts OpenMP can run.
 * config.num_threads (and MTRAIN_NUM_THREADS, and OpenMP's own default when
 * num_threads is 0) must not exceed min(omp_get_thread_limit(),
 * 4 x omp_get_num_procs()); a larger one fails context creation with
 * MTRAIN_ERR_INVALID_CONFIG naming the value and the bound, the bound
 * itself is accepted and computes. Before the fix, num_threads 65536 was
 * accepted and the first parallel region crashed inside libgomp (32768:
 * libgomp ended the process).
 *
 * Run by ctest three times: plainly; with MTRAIN_NUM_THREADS=65536 (the
 * environment is read once per process: argument "env"); with
 * OMP_NUM_THREADS=65536 and num_threads 0 (argument "omp-default"). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "test_support.h"

static int g_mode; /* 0 plain, 1 env, 2 omp-default */

static int32_t bound(void) {
  const int limit = omp_get_thread_limit(), cap = 4 * omp_get_num_procs();
  return limit < cap ? limit : cap;
}

/* A small forward on a context of `threads` threads. */
static mtrain_status_t run_forward(int32_t threads) {
  enum { N = 300, HQ = 2, HKV = 1, D = 16 };
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = 32;
  cfg.num_threads = threads;
  mtrain_context_t *ctx = NULL;
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &ctx);
  if (st) return st;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create_dense(N, HQ, 32, &p), MTRAIN_SUCCESS);
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *pats[1] = {p};
  assert_int_equal(mtrain_plan_create(ctx, NULL, pats, &plan), MTRAIN_SUCCESS);
  static float q[N * HQ * D], k[N * HKV * D], o[N * HQ * D], lse[N * HQ];
  ts_rng_t rng;
  ts_rng_seed(&rng, 7);
  ts_fill_normal(&rng, q, MTRAIN_F32, N * HQ * D, 1.0, NULL);
  ts_fill_normal(&rng, k, MTRAIN_F32, N * HKV * D, 1.0, NULL);
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, N, HQ);
  st = mtrain_attention_forward(ctx, plan, &tq, &tk, &tk, &to, &tl);
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(p);
  mtrain_context_destroy(ctx);
  return st;
}

static void test_thread_bound(void **state) {
  (void)state;
  const int32_t b = bound();
  char value[32], limit[32];
  print_message("bound: %d threads (thread limit %d, %d processors)\n", b, omp_get_thread_limit(),
                omp_get_num_procs());
  if (g_mode == 1) { /* MTRAIN_NUM_THREADS=65536 overrides every config */
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    mtrain_context_t *ctx = NULL;
    snprintf(limit, sizeof limit, "%d", b);
    TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                     "MTRAIN_NUM_THREADS='65536'");
    assert_non_null(strstr(mtrain_last_error(), limit));
    assert_null(ctx);
    return;
  }
  if (g_mode == 2) { /* OMP_NUM_THREADS=65536: OpenMP's default is refused */
    snprintf(limit, sizeof limit, "%d", b);
    TS_ASSERT_STATUS(run_forward(0), MTRAIN_ERR_INVALID_CONFIG, "OMP_NUM_THREADS");
    assert_non_null(strstr(mtrain_last_error(), limit));
    assert_non_null(strstr(mtrain_last_error(), "65536"));
    /* an explicit count within the bound still runs */
    assert_int_equal(run_forward(b), MTRAIN_SUCCESS);
    return;
  }
  const int32_t refused[] = {b + 1, 32768, 65536, INT32_MAX};
  for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
    snprintf(value, sizeof value, "num_threads %d", refused[i]);
    snprintf(limit, sizeof limit, "%d", b);
    TS_ASSERT_STATUS(run_forward(refused[i]), MTRAIN_ERR_INVALID_CONFIG, value);
    if (!strstr(mtrain_last_error(), limit))
      fail_msg("the message '%s' does not name the bound %d", mtrain_last_error(), b);
  }
  TS_ASSERT_STATUS(run_forward(-1), MTRAIN_ERR_INVALID_CONFIG, "num_threads -1");
  assert_int_equal(run_forward(b), MTRAIN_SUCCESS);
  assert_int_equal(run_forward(1), MTRAIN_SUCCESS);
  assert_int_equal(run_forward(0), MTRAIN_SUCCESS);
}

int main(int argc, char **argv) {
  g_mode = argc > 1 && !strcmp(argv[1], "env")           ? 1
           : argc > 1 && !strcmp(argv[1], "omp-default") ? 2
                                                         : 0;
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_thread_bound)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
