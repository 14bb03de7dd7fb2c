/* test_overflow.c: results that overflow are reported, never returned
 * silently. Finite q and k so large that q.k * scale overflows the
 * accumulator (fp32 and bf16 storage, scaled by 1e30) make the forward fail
 * with MTRAIN_ERR_NONFINITE naming the output and the cause, on every CPU
 * backend whose accumulator overflows, on one rank (the ring of one); fp16
 * gradients beyond the fp16 range make the backward fail the same way;
 * inputs of an ordinary scale pass the same checks (the scan does not
 * reject good results); and the fp64 oracle given an fp32 LSE of large
 * inputs (1e4 x N(0, 1): |LSE| ~ 1e8, ulp 8) recomputes its LSE in fp64
 * instead of widening it, so its gradients match the all-fp64 run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

enum { N = 300, HQ = 4, HKV = 2, D = 32, G = 32 };

typedef struct run {
  mtrain_context_t *ctx;
  mtrain_plan_t *plan;
  mtrain_pattern_t *pattern;
  mtrain_dtype_t dtype;
  void *q, *k, *v, *dout, *o, *dq, *dk, *dv;
  float *lse;
} run_t;

/* Normal inputs in fp32, times `scale` for q and k (`dscale` for dout),
 * stored in `dtype`. */
static void setup(run_t *r, const char *backend, mtrain_dtype_t dtype, double scale, double dscale,
                  uint64_t seed) {
  memset(r, 0, sizeof *r);
  r->dtype = dtype;
  const size_t nq = (size_t)N * HQ * D, nk = (size_t)N * HKV * D, e = mtrain_dtype_size(dtype);
  float *f[4] = {malloc(4 * nq), malloc(4 * nk), malloc(4 * nk), malloc(4 * nq)};
  const int64_t shape_h[4] = {HQ, HKV, HKV, HQ};
  const double scales[4] = {scale, scale, 1.0, dscale};
  void **dst[4] = {&r->q, &r->k, &r->v, &r->dout};
  for (int x = 0; x < 4; x++) {
    mtrain_tensor_t t = mtrain_tensor_3d(f[x], MTRAIN_F32, N, shape_h[x], D);
    assert_int_equal(mtrain_generate_normal(seed + (uint64_t)x, scales[x], &t), MTRAIN_SUCCESS);
    const size_t n = (size_t)N * (size_t)shape_h[x] * D;
    *dst[x] = malloc(e * n);
    assert_int_equal(mtrain_convert(f[x], MTRAIN_F32, *dst[x], dtype, (int64_t)n), MTRAIN_SUCCESS);
    free(f[x]);
  }
  r->o = calloc(nq, e), r->dq = calloc(nq, e), r->dk = calloc(nk, e), r->dv = calloc(nk, e);
  r->lse = calloc((size_t)N * HQ, sizeof(float));
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  cfg.num_threads = 1;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &r->ctx), MTRAIN_SUCCESS);
  r->pattern = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, N, HQ, G, seed);
  const mtrain_pattern_t *pats[1] = {r->pattern};
  assert_int_equal(mtrain_plan_create(r->ctx, NULL, pats, &r->plan), MTRAIN_SUCCESS);
}

static void teardown_run(run_t *r) {
  free(r->q), free(r->k), free(r->v), free(r->dout), free(r->o), free(r->dq), free(r->dk);
  free(r->dv), free(r->lse);
  mtrain_plan_destroy(r->plan);
  mtrain_pattern_destroy(r->pattern);
  mtrain_context_destroy(r->ctx);
}

static mtrain_status_t forward(run_t *r) {
  mtrain_tensor_t q = mtrain_tensor_3d(r->q, r->dtype, N, HQ, D);
  mtrain_tensor_t k = mtrain_tensor_3d(r->k, r->dtype, N, HKV, D);
  mtrain_tensor_t v = mtrain_tensor_3d(r->v, r->dtype, N, HKV, D);
  mtrain_tensor_t o = mtrain_tensor_3d(r->o, r->dtype, N, HQ, D);
  mtrain_tensor_t l = mtrain_tensor_2d(r->lse, MTRAIN_F32, N, HQ);
  return mtrain_attention_forward(r->ctx, r->plan, &q, &k, &v, &o, &l);
}

static mtrain_status_t backward(run_t *r) {
  mtrain_tensor_t q = mtrain_tensor_3d(r->q, r->dtype, N, HQ, D);
  mtrain_tensor_t k = mtrain_tensor_3d(r->k, r->dtype, N, HKV, D);
  mtrain_tensor_t v = mtrain_tensor_3d(r->v, r->dtype, N, HKV, D);
  mtrain_tensor_t o = mtrain_tensor_3d(r->o, r->dtype, N, HQ, D);
  mtrain_tensor_t l = mtrain_tensor_2d(r->lse, MTRAIN_F32, N, HQ);
  mtrain_tensor_t dout = mtrain_tensor_3d(r->dout, r->dtype, N, HQ, D);
  mtrain_tensor_t dq = mtrain_tensor_3d(r->dq, r->dtype, N, HQ, D);
  mtrain_tensor_t dk = mtrain_tensor_3d(r->dk, r->dtype, N, HKV, D);
  mtrain_tensor_t dv = mtrain_tensor_3d(r->dv, r->dtype, N, HKV, D);
  return mtrain_attention_backward(r->ctx, r->plan, &q, &k, &v, &o, &l, &dout, &dq, &dk, &dv);
}

/* q, k of 1e30 x N(0, 1): q.k is about 1e60, beyond fp32: the forward of a
 * backend with an fp32 accumulator reports the overflow (before: o = 0 and
 * lse = -inf for every row, status success). */
static void test_forward_overflow_reported(void **state) {
  (void)state;
  const mtrain_dtype_t dtypes[2] = {MTRAIN_F32, MTRAIN_BF16};
  for (int x = 0; x < 2; x++) {
    run_t r;
    const uint64_t seed = ts_seed(40 + (uint64_t)x);
    setup(&r, "cpu", dtypes[x], 1e30, 1.0, seed);
    const mtrain_status_t st = forward(&r);
    if (st != MTRAIN_ERR_NONFINITE || !strstr(mtrain_last_error(), "output 'lse'") ||
        !strstr(mtrain_last_error(), "overflowed"))
      fail_msg("%s, seed %llu: forward gave %s (%s), expected NONFINITE naming 'lse' and the "
               "overflow",
               mtrain_dtype_name(dtypes[x]), (unsigned long long)seed, mtrain_status_name(st),
               mtrain_last_error());
    teardown_run(&r);
  }
}

/* fp16 storage: dout of 3e4 x N(0, 1) gives dV rows summed over many
 * queries beyond fp16's 65504: the backward reports it. */
static void test_backward_overflow_reported(void **state) {
  (void)state;
  run_t r;
  const uint64_t seed = ts_seed(50);
  setup(&r, "cpu", MTRAIN_F16, 1.0, 3e4, seed);
  assert_int_equal(forward(&r), MTRAIN_SUCCESS);
  const mtrain_status_t st = backward(&r);
  if (st != MTRAIN_ERR_NONFINITE || !strstr(mtrain_last_error(), "backward: output 'd"))
    fail_msg("seed %llu: backward gave %s (%s), expected NONFINITE naming a gradient",
             (unsigned long long)seed, mtrain_status_name(st), mtrain_last_error());
  teardown_run(&r);
}

/* The same calls on inputs of an ordinary scale pass every output check,
 * on both CPU backends and all storage dtypes. */
static void test_ordinary_inputs_pass(void **state) {
  (void)state;
  const char *backends[2] = {"cpu", "cpu-ref"};
  const mtrain_dtype_t dtypes[3] = {MTRAIN_F32, MTRAIN_BF16, MTRAIN_F16};
  for (int b = 0; b < 2; b++)
    for (int x = 0; x < 3; x++) {
      run_t r;
      const uint64_t seed = ts_seed(60 + (uint64_t)(3 * b + x));
      setup(&r, backends[b], dtypes[x], 1.0, 1.0, seed);
      mtrain_status_t st = forward(&r);
      if (st == MTRAIN_SUCCESS) st = backward(&r);
      if (st != MTRAIN_SUCCESS)
        fail_msg("%s %s, seed %llu: %s (%s)", backends[b], mtrain_dtype_name(dtypes[x]),
                 (unsigned long long)seed, mtrain_status_name(st), mtrain_last_error());
      teardown_run(&r);
    }
}

/* 1e4 x N(0, 1) q, k, v (dout N(0, 1)): the oracle with fp32 storage (and
 * so an fp32 LSE) against the oracle on the same values in fp64 storage:
 * every output within SPEC.md's fp32 rule, 1e-4 of the largest reference
 * value (before: dv off by ~1e7 against a largest value of ~16). */
static void test_oracle_large_inputs_backward(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(70);
  run_t a, b;
  setup(&a, "cpu-ref", MTRAIN_F32, 1e4, 1.0, seed);
  setup(&b, "cpu-ref", MTRAIN_F64, 1e4, 1.0, seed);
  /* v too: scaled like q and k */
  const size_t nk = (size_t)N * HKV * D;
  for (size_t i = 0; i < nk; i++) ((float *)a.v)[i] *= 1e4f;
  for (size_t i = 0; i < nk; i++) ((double *)b.v)[i] = (double)((float *)a.v)[i];
  assert_int_equal(forward(&a), MTRAIN_SUCCESS);
  assert_int_equal(backward(&a), MTRAIN_SUCCESS);
  /* the fp64 run's LSE tensor is fp64: the oracle keeps full precision */
  mtrain_tensor_t q = mtrain_tensor_3d(b.q, MTRAIN_F64, N, HQ, D);
  mtrain_tensor_t k = mtrain_tensor_3d(b.k, MTRAIN_F64, N, HKV, D);
  mtrain_tensor_t v = mtrain_tensor_3d(b.v, MTRAIN_F64, N, HKV, D);
  mtrain_tensor_t o = mtrain_tensor_3d(b.o, MTRAIN_F64, N, HQ, D);
  double *lse64 = calloc((size_t)N * HQ, sizeof(double));
  mtrain_tensor_t l = mtrain_tensor_2d(lse64, MTRAIN_F64, N, HQ);
  mtrain_tensor_t dout = mtrain_tensor_3d(b.dout, MTRAIN_F64, N, HQ, D);
  mtrain_tensor_t dq = mtrain_tensor_3d(b.dq, MTRAIN_F64, N, HQ, D);
  mtrain_tensor_t dk = mtrain_tensor_3d(b.dk, MTRAIN_F64, N, HKV, D);
  mtrain_tensor_t dv = mtrain_tensor_3d(b.dv, MTRAIN_F64, N, HKV, D);
  assert_int_equal(mtrain_attention_forward(b.ctx, b.plan, &q, &k, &v, &o, &l), MTRAIN_SUCCESS);
  assert_int_equal(
      mtrain_attention_backward(b.ctx, b.plan, &q, &k, &v, &o, &l, &dout, &dq, &dk, &dv),
      MTRAIN_SUCCESS);
  const struct {
    const char *name;
    const float *got;
    const double *want;
    size_t n;
  } out[4] = {{"o", a.o, b.o, (size_t)N * HQ * D},
              {"dq", a.dq, b.dq, (size_t)N * HQ * D},
              {"dk", a.dk, b.dk, nk},
              {"dv", a.dv, b.dv, nk}};
  for (int x = 0; x < 4; x++) {
    double err = 0, ref = 0;
    for (size_t i = 0; i < out[x].n; i++) {
      const double e = fabs((double)out[x].got[i] - out[x].want[i]);
      if (!(e <= err)) err = e;
      if (fabs(out[x].want[i]) > ref) ref = fabs(out[x].want[i]);
    }
    if (!(err <= 1e-4 * ref))
      fail_msg("seed %llu: %s of the fp32-storage oracle off by %.3g (largest value %.3g, bound "
               "%.3g)",
               (unsigned long long)seed, out[x].name, err, ref, 1e-4 * ref);
  }
  free(lse64);
  teardown_run(&a);
  teardown_run(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_forward_overflow_reported),
      cmocka_unit_test(test_backward_overflow_reported),
      cmocka_unit_test(test_ordinary_inputs_pass),
      cmocka_unit_test(test_oracle_large_inputs_backward),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
