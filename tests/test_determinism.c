/* test_determinism.c: the deterministic mode (the default): two runs of the
 * "cpu" backend on the same inputs and thread count give bitwise identical
 * outputs and gradients, for a dense and a sparse pattern, GQA, 2 threads
 * (the backward's per-thread partial sums are where it could differ). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

enum { N = 1500, HQ = 8, HKV = 2, D = 32, G = 32 };

static void run_twice(ts_pattern_kind_t kind) {
  const size_t nq = (size_t)N * HQ * D, nk = (size_t)N * HKV * D;
  float *q = malloc(4 * nq), *k = malloc(4 * nk), *v = malloc(4 * nk), *dout = malloc(4 * nq);
  float *o[2], *lse[2], *dq[2], *dk[2], *dv[2];
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tdo = mtrain_tensor_3d(dout, MTRAIN_F32, N, HQ, D);
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = ts_seed(5);
  assert_int_equal(mtrain_generate_structured(&so, &tq, &tk, &tv), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_generate_normal(so.seed + 1, 1.0, &tdo), MTRAIN_SUCCESS);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT; /* deterministic by default */
  cfg.granularity = G;
  cfg.num_threads = 2;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  mtrain_pattern_t *p = ts_make_pattern(kind, N, HQ, G, so.seed);
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_plan_t *plan = NULL;
  assert_int_equal(mtrain_plan_create(ctx, NULL, pats, &plan), MTRAIN_SUCCESS);
  for (int r = 0; r < 2; r++) {
    o[r] = malloc(4 * nq), lse[r] = malloc(4 * (size_t)N * HQ), dq[r] = malloc(4 * nq);
    dk[r] = malloc(4 * nk), dv[r] = malloc(4 * nk);
    mtrain_tensor_t to = mtrain_tensor_3d(o[r], MTRAIN_F32, N, HQ, D);
    mtrain_tensor_t tl = mtrain_tensor_2d(lse[r], MTRAIN_F32, N, HQ);
    mtrain_tensor_t tdq = mtrain_tensor_3d(dq[r], MTRAIN_F32, N, HQ, D);
    mtrain_tensor_t tdk = mtrain_tensor_3d(dk[r], MTRAIN_F32, N, HKV, D);
    mtrain_tensor_t tdv = mtrain_tensor_3d(dv[r], MTRAIN_F32, N, HKV, D);
    assert_int_equal(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl), MTRAIN_SUCCESS);
    assert_int_equal(
        mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv),
        MTRAIN_SUCCESS);
  }
  if (memcmp(o[0], o[1], 4 * nq) || memcmp(lse[0], lse[1], 4 * (size_t)N * HQ) ||
      memcmp(dq[0], dq[1], 4 * nq) || memcmp(dk[0], dk[1], 4 * nk) || memcmp(dv[0], dv[1], 4 * nk))
    fail_msg("two runs differ (pattern %s, seed %llu)", ts_pattern_kind_name(kind),
             (unsigned long long)so.seed);
  for (int r = 0; r < 2; r++) free(o[r]), free(lse[r]), free(dq[r]), free(dk[r]), free(dv[r]);
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(p);
  mtrain_context_destroy(ctx);
  free(q), free(k), free(v), free(dout);
}

static void test_dense_twice(void **state) {
  (void)state;
  run_twice(TS_PATTERN_DENSE);
}

static void test_sparse_twice(void **state) {
  (void)state;
  run_twice(TS_PATTERN_RANDOM_SPARSE);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dense_twice),
      cmocka_unit_test(test_sparse_twice),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
