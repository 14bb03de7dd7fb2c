/* test_bad_input.c: every class of bad input to the context, plan and
 * attention entry points returns its own status with a message naming the
 * problem, and leaves the outputs untouched. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_comm.h"
#include "test_support.h"

enum { N = 100, HQ = 4, HKV = 2, D = 16, G = 32 };

typedef struct fixture {
  mtrain_context_t *ctx;
  mtrain_pattern_t *pattern;
  mtrain_plan_t *plan;
  float q[N * HQ * D], k[N * HKV * D], v[N * HKV * D], o[N * HQ * D], lse[N * HQ];
  float dout[N * HQ * D], dq[N * HQ * D], dk[N * HKV * D], dv[N * HKV * D];
  mtrain_tensor_t tq, tk, tv, to, tlse, tdo, tdq, tdk, tdv;
} fixture_t;

static int setup(void **state) {
  fixture_t *f = calloc(1, sizeof *f);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  cfg.check_inputs = 1;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &f->ctx), MTRAIN_SUCCESS);
  f->pattern = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, N, HQ, G, 3);
  const mtrain_pattern_t *pats[1] = {f->pattern};
  assert_int_equal(mtrain_plan_create(f->ctx, NULL, pats, &f->plan), MTRAIN_SUCCESS);
  ts_rng_t rng;
  ts_rng_seed(&rng, 11);
  ts_fill_normal(&rng, f->q, MTRAIN_F32, N * HQ * D, 1.0, NULL);
  ts_fill_normal(&rng, f->k, MTRAIN_F32, N * HKV * D, 1.0, NULL);
  ts_fill_normal(&rng, f->v, MTRAIN_F32, N * HKV * D, 1.0, NULL);
  ts_fill_normal(&rng, f->dout, MTRAIN_F32, N * HQ * D, 1.0, NULL);
  f->tq = mtrain_tensor_3d(f->q, MTRAIN_F32, N, HQ, D);
  f->tk = mtrain_tensor_3d(f->k, MTRAIN_F32, N, HKV, D);
  f->tv = mtrain_tensor_3d(f->v, MTRAIN_F32, N, HKV, D);
  f->to = mtrain_tensor_3d(f->o, MTRAIN_F32, N, HQ, D);
  f->tlse = mtrain_tensor_2d(f->lse, MTRAIN_F32, N, HQ);
  f->tdo = mtrain_tensor_3d(f->dout, MTRAIN_F32, N, HQ, D);
  f->tdq = mtrain_tensor_3d(f->dq, MTRAIN_F32, N, HQ, D);
  f->tdk = mtrain_tensor_3d(f->dk, MTRAIN_F32, N, HKV, D);
  f->tdv = mtrain_tensor_3d(f->dv, MTRAIN_F32, N, HKV, D);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture_t *f = *state;
  mtrain_plan_destroy(f->plan);
  mtrain_pattern_destroy(f->pattern);
  mtrain_context_destroy(f->ctx);
  free(f);
  return 0;
}

static mtrain_status_t fwd(fixture_t *f) {
  return mtrain_attention_forward(f->ctx, f->plan, &f->tq, &f->tk, &f->tv, &f->to, &f->tlse);
}

static mtrain_status_t bwd(fixture_t *f) {
  return mtrain_attention_backward(f->ctx, f->plan, &f->tq, &f->tk, &f->tv, &f->to, &f->tlse,
                                   &f->tdo, &f->tdq, &f->tdk, &f->tdv);
}

/* Sets o to a marker, runs a failing forward, checks o was not touched. */
static void expect_fwd_fails(fixture_t *f, mtrain_status_t want, const char *needle) {
  for (int i = 0; i < N * HQ * D; i++) f->o[i] = 7.0f;
  TS_ASSERT_STATUS(fwd(f), want, needle);
  for (int i = 0; i < N * HQ * D; i++) assert_true(f->o[i] == 7.0f);
}

static void test_forward_succeeds_on_good_input(void **state) {
  fixture_t *f = *state;
  assert_int_equal(fwd(f), MTRAIN_SUCCESS);
  assert_int_equal(bwd(f), MTRAIN_SUCCESS);
}

static void test_null_arguments(void **state) {
  fixture_t *f = *state;
  TS_ASSERT_STATUS(
      mtrain_attention_forward(NULL, f->plan, &f->tq, &f->tk, &f->tv, &f->to, &f->tlse),
      MTRAIN_ERR_NULL_POINTER, "ctx");
  TS_ASSERT_STATUS(mtrain_attention_forward(f->ctx, NULL, &f->tq, &f->tk, &f->tv, &f->to, &f->tlse),
                   MTRAIN_ERR_NULL_POINTER, "plan");
  TS_ASSERT_STATUS(
      mtrain_attention_forward(f->ctx, f->plan, &f->tq, NULL, &f->tv, &f->to, &f->tlse),
      MTRAIN_ERR_NULL_POINTER, "'k'");
  TS_ASSERT_STATUS(mtrain_attention_forward(f->ctx, f->plan, &f->tq, &f->tk, &f->tv, &f->to, NULL),
                   MTRAIN_ERR_NULL_POINTER, "'lse'");
  f->tv.data = NULL;
  expect_fwd_fails(f, MTRAIN_ERR_NULL_POINTER, "'v' has data == NULL");
  f->tv.data = f->v;
  TS_ASSERT_STATUS(mtrain_attention_backward(f->ctx, f->plan, &f->tq, &f->tk, &f->tv, &f->to,
                                             &f->tlse, NULL, &f->tdq, &f->tdk, &f->tdv),
                   MTRAIN_ERR_NULL_POINTER, "'dout'");
  TS_ASSERT_STATUS(mtrain_context_create(NULL, NULL, NULL), MTRAIN_ERR_NULL_POINTER, "config");
}

static void test_shape_mismatches(void **state) {
  fixture_t *f = *state;
  f->tq.shape[0] = N - 1;
  expect_fwd_fails(f, MTRAIN_ERR_SHAPE_MISMATCH, "'q' has tokens = 99");
  f->tq.shape[0] = N;
  f->tk.shape[2] = D / 2;
  expect_fwd_fails(f, MTRAIN_ERR_SHAPE_MISMATCH, "'k' has head_dim = 8");
  f->tk.shape[2] = D;
  f->tv.ndim = 2;
  expect_fwd_fails(f, MTRAIN_ERR_SHAPE_MISMATCH, "'v' has 2 dimensions");
  f->tv.ndim = 3;
  f->tlse.shape[1] = HQ + 1;
  expect_fwd_fails(f, MTRAIN_ERR_HEAD_MISMATCH, "'lse' has heads = 5");
  f->tlse.shape[1] = HQ;
  f->tdk.shape[0] = 5;
  TS_ASSERT_STATUS(bwd(f), MTRAIN_ERR_SHAPE_MISMATCH, "'dk' has tokens = 5");
  f->tdk.shape[0] = N;
}

static void test_head_count_mismatches(void **state) {
  fixture_t *f = *state;
  f->tq.shape[1] = HQ * 2; /* q heads differ from the plan's */
  expect_fwd_fails(f, MTRAIN_ERR_HEAD_MISMATCH, "'q' has heads = 8");
  f->tq.shape[1] = HQ;
  f->tk.shape[1] = 3; /* 4 % 3 != 0 */
  f->tv.shape[1] = 3;
  expect_fwd_fails(f, MTRAIN_ERR_HEAD_MISMATCH, "not a multiple of kv heads 3");
  f->tk.shape[1] = HKV;
  f->tv.shape[1] = 1; /* v differs from k */
  expect_fwd_fails(f, MTRAIN_ERR_HEAD_MISMATCH, "'v' has heads = 1");
  f->tv.shape[1] = HKV;
}

static void test_dtype_problems(void **state) {
  fixture_t *f = *state;
  f->tk.dtype = MTRAIN_BF16;
  expect_fwd_fails(f, MTRAIN_ERR_UNSUPPORTED_DTYPE, "'k' has dtype bf16, expected fp32");
  f->tk.dtype = MTRAIN_F32;
  f->tlse.dtype = MTRAIN_F16;
  expect_fwd_fails(f, MTRAIN_ERR_UNSUPPORTED_DTYPE, "'lse' has dtype fp16");
  f->tlse.dtype = MTRAIN_F32;
  /* fp64 is the oracle's: the fast backend refuses it */
  static double q64[N * HQ * D], k64[N * HKV * D], v64[N * HKV * D], o64[N * HQ * D];
  mtrain_tensor_t q = mtrain_tensor_3d(q64, MTRAIN_F64, N, HQ, D);
  mtrain_tensor_t k = mtrain_tensor_3d(k64, MTRAIN_F64, N, HKV, D);
  mtrain_tensor_t v = mtrain_tensor_3d(v64, MTRAIN_F64, N, HKV, D);
  mtrain_tensor_t o = mtrain_tensor_3d(o64, MTRAIN_F64, N, HQ, D);
  TS_ASSERT_STATUS(mtrain_attention_forward(f->ctx, f->plan, &q, &k, &v, &o, &f->tlse),
                   MTRAIN_ERR_UNSUPPORTED_DTYPE, "cpu-ref");
}

static void test_unsupported_head_dim(void **state) {
  fixture_t *f = *state;
  static float big[N * HQ * 2048];
  mtrain_tensor_t q = mtrain_tensor_3d(big, MTRAIN_F32, N, HQ, 2048);
  TS_ASSERT_STATUS(mtrain_attention_forward(f->ctx, f->plan, &q, &f->tk, &f->tv, &f->to, &f->tlse),
                   MTRAIN_ERR_UNSUPPORTED_HEAD_DIM, "head_dim 2048");
  q = mtrain_tensor_3d(big, MTRAIN_F32, N, HQ, 600);
  mtrain_tensor_t k = mtrain_tensor_3d(big, MTRAIN_F32, N, HKV, 600);
  mtrain_tensor_t o = mtrain_tensor_3d(big, MTRAIN_F32, N, HQ, 600);
  TS_ASSERT_STATUS(mtrain_attention_forward(f->ctx, f->plan, &q, &k, &k, &o, &f->tlse),
                   MTRAIN_ERR_UNSUPPORTED_HEAD_DIM, "supports head_dim 1..512");
}

static void test_nonfinite_inputs(void **state) {
  fixture_t *f = *state;
  const float saved = f->k[5 * HKV * D + 1 * D + 3];
  f->k[5 * HKV * D + 1 * D + 3] = NAN;
  expect_fwd_fails(f, MTRAIN_ERR_NONFINITE,
                   "'k' holds NaN or Inf at element 179 (token 5, head 1)");
  f->k[5 * HKV * D + 1 * D + 3] = saved;
  assert_int_equal(fwd(f), MTRAIN_SUCCESS);
  f->dout[7] = INFINITY;
  TS_ASSERT_STATUS(bwd(f), MTRAIN_ERR_NONFINITE, "'dout'");
  f->dout[7] = 0.0f;
}

static void test_bad_config(void **state) {
  (void)state;
  mtrain_context_t *ctx = NULL;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "tpu";
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_BACKEND_NOT_FOUND,
                   "'tpu' is not compiled into this build (available: cpu-ref, cpu");
  cfg = (mtrain_config_t)MTRAIN_CONFIG_INIT;
  cfg.api_version = 99;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "api_version is 99");
  cfg = (mtrain_config_t)MTRAIN_CONFIG_INIT;
  cfg.granularity = 0;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "granularity 0");
  cfg = (mtrain_config_t)MTRAIN_CONFIG_INIT;
  cfg.softmax_scale = NAN;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "softmax_scale");
  cfg = (mtrain_config_t)MTRAIN_CONFIG_INIT;
  cfg.check_inputs = 2;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "check_inputs 2");
  cfg = (mtrain_config_t)MTRAIN_CONFIG_INIT;
  cfg.deterministic = 5;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "deterministic 5");
  assert_null(ctx);
}

/* A communicator table of another API version, or without a required slot,
 * is refused at context creation, naming the table, the field and the
 * versions (the tables are checked once there, core/runtime/backend.c). The
 * fake tables are copies of the "self" communicator's, altered. */
static void test_bad_comm_table(void **state) {
  (void)state;
  mtrain_comm_t *self = NULL;
  assert_int_equal(mtrain_comm_create_self(&self), MTRAIN_SUCCESS);
  mtrain_comm_ops_t ops = *self->ops;
  mtrain_comm_t fake = {&ops, self->state};
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  mtrain_context_t *ctx = NULL;
  /* the unaltered copy is accepted */
  assert_int_equal(mtrain_context_create(&cfg, &fake, &ctx), MTRAIN_SUCCESS);
  mtrain_context_destroy(ctx);
  ctx = NULL;

  ops.api_version = MTRAIN_API_VERSION - 1;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, &fake, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "communicator table 'self': api_version is");
  char want[64];
  snprintf(want, sizeof want, "api_version is %d but this mtrain is %d", MTRAIN_API_VERSION - 1,
           MTRAIN_API_VERSION);
  assert_non_null(strstr(mtrain_last_error(), want));

  ops = *self->ops;
  ops.wait = NULL;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, &fake, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "required slot 'wait' is NULL");
  assert_non_null(strstr(mtrain_last_error(), "communicator table 'self'"));
  ops = *self->ops;
  ops.name = NULL;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, &fake, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "required slot 'name' is NULL");
  ops = *self->ops;
  ops.memory_space = (mtrain_memory_space_t)7;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, &fake, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "memory_space is 7");
  /* set_data_stream is optional: absent in "self" already */
  assert_null(self->ops->set_data_stream);
  assert_null(ctx);
  mtrain_comm_destroy(self);
}

static void test_bad_plans(void **state) {
  fixture_t *f = *state;
  mtrain_plan_t *plan = NULL;
  mtrain_pattern_t *other = ts_make_pattern(TS_PATTERN_DENSE, 50, HQ, 16, 1);
  const mtrain_pattern_t *pats[2] = {f->pattern, other};
  TS_ASSERT_STATUS(mtrain_plan_create(f->ctx, NULL, pats + 1, &plan), MTRAIN_ERR_INVALID_PATTERN,
                   "granularity 16, the context uses 32");
  mtrain_pattern_destroy(other);
  other = ts_make_pattern(TS_PATTERN_DENSE, 50, HQ + 1, G, 1);
  pats[1] = other;
  const int64_t offsets[] = {0, N, N + 50};
  mtrain_seqs_t seqs = {2, offsets};
  TS_ASSERT_STATUS(mtrain_plan_create(f->ctx, &seqs, pats, &plan), MTRAIN_ERR_HEAD_MISMATCH,
                   "patterns[1] has 5 heads");
  mtrain_pattern_destroy(other);
  other = ts_make_pattern(TS_PATTERN_DENSE, 49, HQ, G, 1);
  pats[1] = other;
  TS_ASSERT_STATUS(mtrain_plan_create(f->ctx, &seqs, pats, &plan), MTRAIN_ERR_SHAPE_MISMATCH,
                   "sequence 1 has 50 tokens but patterns[1] is for 49");
  const int64_t bad_offsets[] = {0, N, N};
  seqs.offsets = bad_offsets;
  TS_ASSERT_STATUS(mtrain_plan_create(f->ctx, &seqs, pats, &plan), MTRAIN_ERR_INVALID_ARGUMENT,
                   "sequence 1 has length 0");
  pats[1] = NULL;
  seqs.offsets = offsets;
  TS_ASSERT_STATUS(mtrain_plan_create(f->ctx, &seqs, pats, &plan), MTRAIN_ERR_NULL_POINTER,
                   "patterns[1]");
  assert_null(plan);
  mtrain_pattern_destroy(other);
}

/* Element counts of tensor descriptors: an empty or negative extent counts
 * 0 elements, a product past int64 -1 (it wrapped to 0 before: (2^40, 2^40,
 * 1) counted 0 elements), never a count to allocate. */
static void test_tensor_numel(void **state) {
  (void)state;
  const mtrain_tensor_t ok = mtrain_tensor_3d(NULL, MTRAIN_F32, 2, 3, 4);
  assert_int_equal(mtrain_tensor_numel(&ok), 24);
  const mtrain_tensor_t empty = mtrain_tensor_3d(NULL, MTRAIN_F32, (int64_t)1 << 40, 0, 64);
  assert_int_equal(mtrain_tensor_numel(&empty), 0);
  const mtrain_tensor_t negative = mtrain_tensor_3d(NULL, MTRAIN_F32, 5, -1, 64);
  assert_int_equal(mtrain_tensor_numel(&negative), 0);
  const mtrain_tensor_t wraps =
      mtrain_tensor_3d(NULL, MTRAIN_F32, (int64_t)1 << 40, (int64_t)1 << 40, 1);
  assert_int_equal(mtrain_tensor_numel(&wraps), -1);
  const mtrain_tensor_t big = mtrain_tensor_3d(NULL, MTRAIN_F32, INT64_MAX, 2, 1);
  assert_int_equal(mtrain_tensor_numel(&big), -1);
  const mtrain_tensor_t edge = mtrain_tensor_2d(NULL, MTRAIN_F32, INT64_MAX, 1);
  assert_int_equal(mtrain_tensor_numel(&edge), INT64_MAX);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tensor_numel),
      cmocka_unit_test_setup_teardown(test_forward_succeeds_on_good_input, setup, teardown),
      cmocka_unit_test_setup_teardown(test_null_arguments, setup, teardown),
      cmocka_unit_test_setup_teardown(test_shape_mismatches, setup, teardown),
      cmocka_unit_test_setup_teardown(test_head_count_mismatches, setup, teardown),
      cmocka_unit_test_setup_teardown(test_dtype_problems, setup, teardown),
      cmocka_unit_test_setup_teardown(test_unsupported_head_dim, setup, teardown),
      cmocka_unit_test_setup_teardown(test_nonfinite_inputs, setup, teardown),
      cmocka_unit_test(test_bad_config),
      cmocka_unit_test(test_bad_comm_table),
      cmocka_unit_test_setup_teardown(test_bad_plans, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
