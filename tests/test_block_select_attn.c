/* test_block_select_attn.c: selected block patterns (SPEC.md section 9) run
 * through the existing plan and sparse attention, forward and backward, on
 * cpu (fp32) and cpu-ref (fp64), against the dense fp64 reference masked by
 * the same pattern (mtrain_cpu.h, no code shared with the plan). The precise
 * search reuses the LSE of a dense forward of the same backend, as a
 * training step would. Structured inputs, GQA, d 64 and 128, N not a
 * multiple of G; seeds printed (MTRAIN_TEST_SEED overrides). Bound:
 * max |got - ref| <= tol * max |ref| per output, tol 1e-4 for cpu and 1e-10
 * for cpu-ref. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cpu.h"
#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

typedef struct attn_case {
  int64_t N;
  int32_t G, Hq, Hkv, d, S;
} attn_case_t;

static const attn_case_t cases[] = {
    {421, 32, 4, 2, 64, 8},
    {300, 32, 4, 1, 128, 16},
};

/* Runs forward (and backward) of `pattern` on ctx; outputs in fp64. */
static void run_attention(mtrain_context_t *ctx, const mtrain_pattern_t *pattern, mtrain_dtype_t dt,
                          const void *q, const void *k, const void *v, const void *dout, int64_t N,
                          int32_t Hq, int32_t Hkv, int32_t d, double *o, double *lse, double *dq,
                          double *dk, double *dv) {
  const size_t es = mtrain_dtype_size(dt);
  void *ob = malloc(es * (size_t)(N * Hq * d)), *lb = malloc(es * (size_t)(N * Hq));
  void *dqb = malloc(es * (size_t)(N * Hq * d)), *dkb = malloc(es * (size_t)(N * Hkv * d)),
       *dvb = malloc(es * (size_t)(N * Hkv * d));
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *pats[] = {pattern};
  assert_int_equal(mtrain_plan_create(ctx, NULL, pats, &plan), MTRAIN_SUCCESS);
  mtrain_tensor_t tq = mtrain_tensor_3d((void *)q, dt, N, Hq, d);
  mtrain_tensor_t tk = mtrain_tensor_3d((void *)k, dt, N, Hkv, d);
  mtrain_tensor_t tv = mtrain_tensor_3d((void *)v, dt, N, Hkv, d);
  mtrain_tensor_t to = mtrain_tensor_3d(ob, dt, N, Hq, d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lb, dt, N, Hq);
  assert_int_equal(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl), MTRAIN_SUCCESS);
  if (dout) {
    mtrain_tensor_t tdo = mtrain_tensor_3d((void *)dout, dt, N, Hq, d);
    mtrain_tensor_t tdq = mtrain_tensor_3d(dqb, dt, N, Hq, d);
    mtrain_tensor_t tdk = mtrain_tensor_3d(dkb, dt, N, Hkv, d);
    mtrain_tensor_t tdv = mtrain_tensor_3d(dvb, dt, N, Hkv, d);
    assert_int_equal(
        mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv),
        MTRAIN_SUCCESS);
    double *x;
    x = ts_to_double(dqb, dt, N * Hq * d), memcpy(dq, x, sizeof(double) * (size_t)(N * Hq * d)),
    free(x);
    x = ts_to_double(dkb, dt, N * Hkv * d), memcpy(dk, x, sizeof(double) * (size_t)(N * Hkv * d)),
    free(x);
    x = ts_to_double(dvb, dt, N * Hkv * d), memcpy(dv, x, sizeof(double) * (size_t)(N * Hkv * d)),
    free(x);
  }
  double *x = ts_to_double(ob, dt, N * Hq * d);
  memcpy(o, x, sizeof(double) * (size_t)(N * Hq * d));
  free(x);
  x = ts_to_double(lb, dt, N * Hq);
  memcpy(lse, x, sizeof(double) * (size_t)(N * Hq));
  free(x);
  mtrain_plan_destroy(plan);
  free(ob), free(lb), free(dqb), free(dkb), free(dvb);
}

static void check(const char *what, const double *got, const double *want, int64_t n, double tol) {
  const double e = ts_max_abs_diff(got, want, n), M = ts_max_abs(want, n);
  if (ts_has_nonfinite(got, n) || !(e <= tol * M))
    fail_msg("%s: max error %.3g > %.3g (max |ref| %.3g)", what, e, tol * M, M);
}

static void test_selected_patterns_attention(void **state) {
  (void)state;
  static const mtrain_block_method_t methods[] = {MTRAIN_BLOCK_PRECISE, MTRAIN_BLOCK_ANTIDIAG,
                                                  MTRAIN_BLOCK_MEANPOOL};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const attn_case_t *ac = &cases[c];
    const int64_t N = ac->N, nq = N * ac->Hq * ac->d, nk = N * ac->Hkv * ac->d;
    const uint64_t seed = ts_seed(500 + c);
    float *q = malloc(sizeof(float) * (size_t)nq), *k = malloc(sizeof(float) * (size_t)nk);
    float *v = malloc(sizeof(float) * (size_t)nk), *dout = malloc(sizeof(float) * (size_t)nq);
    mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
    so.seed = seed;
    so.rope_base = 4.0 * (double)N;
    mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, ac->Hq, ac->d);
    mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, ac->Hkv, ac->d);
    mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F32, N, ac->Hkv, ac->d);
    mtrain_tensor_t tdo = mtrain_tensor_3d(dout, MTRAIN_F32, N, ac->Hq, ac->d);
    assert_int_equal(mtrain_generate_structured(&so, &tq, &tk, &tv), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_generate_normal(seed + 1, 1.0, &tdo), MTRAIN_SUCCESS);
    double *qd = ts_to_double(q, MTRAIN_F32, nq), *kd = ts_to_double(k, MTRAIN_F32, nk);
    double *vd = ts_to_double(v, MTRAIN_F32, nk), *dod = ts_to_double(dout, MTRAIN_F32, nq);
    double *o = malloc(sizeof(double) * (size_t)nq),
           *lse = malloc(sizeof(double) * (size_t)(N * ac->Hq));
    double *dq = malloc(sizeof(double) * (size_t)nq), *dk = malloc(sizeof(double) * (size_t)nk);
    double *dv = malloc(sizeof(double) * (size_t)nk);
    double *ro = malloc(sizeof(double) * (size_t)nq),
           *rlse = malloc(sizeof(double) * (size_t)(N * ac->Hq));
    double *rdq = malloc(sizeof(double) * (size_t)nq), *rdk = malloc(sizeof(double) * (size_t)nk);
    double *rdv = malloc(sizeof(double) * (size_t)nk);
    for (int b = 0; b < 2; b++) {
      const char *backend = b ? "cpu" : "cpu-ref";
      const mtrain_dtype_t dt = b ? MTRAIN_F32 : MTRAIN_F64;
      const double tol = b ? 1e-4 : 1e-10;
      const void *qx = b ? (const void *)q : qd, *kx = b ? (const void *)k : kd;
      const void *vx = b ? (const void *)v : vd, *dox = b ? (const void *)dout : dod;
      mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
      cfg.backend = backend;
      cfg.granularity = ac->G;
      mtrain_context_t *ctx = NULL;
      assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
      /* the dense forward whose LSE the precise search reuses */
      mtrain_pattern_t *dense = NULL;
      assert_int_equal(mtrain_pattern_create_dense(N, ac->Hq, ac->G, &dense), MTRAIN_SUCCESS);
      run_attention(ctx, dense, dt, qx, kx, vx, NULL, N, ac->Hq, ac->Hkv, ac->d, o, lse, NULL, NULL,
                    NULL);
      mtrain_pattern_destroy(dense);
      /* kept apart: the sparse runs below overwrite `lse` */
      void *lse_x = malloc((b ? sizeof(float) : sizeof(double)) * (size_t)(N * ac->Hq));
      for (int64_t i = 0; i < N * ac->Hq; i++)
        if (b)
          ((float *)lse_x)[i] = (float)lse[i];
        else
          ((double *)lse_x)[i] = lse[i];
      for (int mi = 0; mi < 3; mi++) {
        mtrain_block_options_t opt = MTRAIN_BLOCK_OPTIONS_INIT;
        opt.method = methods[mi];
        opt.stride = ac->S;
        opt.top_p = 0.8;
        if (methods[mi] == MTRAIN_BLOCK_MEANPOOL) opt.kind = MTRAIN_BUDGET_TOP_K, opt.top_k = 2;
        mtrain_tensor_t xq = mtrain_tensor_3d((void *)qx, dt, N, ac->Hq, ac->d);
        mtrain_tensor_t xk = mtrain_tensor_3d((void *)kx, dt, N, ac->Hkv, ac->d);
        mtrain_tensor_t xl = mtrain_tensor_2d(lse_x, dt, N, ac->Hq);
        mtrain_pattern_t *pat = NULL;
        assert_int_equal(mtrain_pattern_select_blocks(ctx, &xq, &xk, &xl, &opt, NULL, &pat),
                         MTRAIN_SUCCESS);
        int64_t pairs = 0;
        for (int32_t h = 0; h < ac->Hq; h++) pairs += mtrain_pattern_count_pairs(pat, h);
        const double density = (double)pairs / ((double)ac->Hq * (double)N * (double)(N + 1) / 2);
        assert_true(density < 1.0); /* a sparse pattern, not the dense one */
        run_attention(ctx, pat, dt, qx, kx, vx, dox, N, ac->Hq, ac->Hkv, ac->d, o, lse, dq, dk, dv);
        assert_int_equal(
            mtrain_cpu_dense_reference_forward(pat, ac->Hkv, ac->d, 0.0, qd, kd, vd, ro, rlse),
            MTRAIN_SUCCESS);
        assert_int_equal(mtrain_cpu_dense_reference_backward(pat, ac->Hkv, ac->d, 0.0, qd, kd, vd,
                                                             ro, rlse, dod, rdq, rdk, rdv),
                         MTRAIN_SUCCESS);
        char what[160];
#define CHECK(name, got, want, n)                                                                  \
  snprintf(what, sizeof what, "seed %llu N %lld d %d %s %s: %s", (unsigned long long)seed,         \
           (long long)N, ac->d, backend, mtrain_block_method_name(methods[mi]), name);             \
  check(what, got, want, n, tol)
        CHECK("o", o, ro, nq);
        CHECK("lse", lse, rlse, N * ac->Hq);
        CHECK("dq", dq, rdq, nq);
        CHECK("dk", dk, rdk, nk);
        CHECK("dv", dv, rdv, nk);
#undef CHECK
        print_message("seed %llu N %lld G %d d %d %s %s: density %.3f, forward and backward "
                      "match the dense reference\n",
                      (unsigned long long)seed, (long long)N, ac->G, ac->d, backend,
                      mtrain_block_method_name(methods[mi]), density);
        mtrain_pattern_destroy(pat);
      }
      free(lse_x);
      mtrain_context_destroy(ctx);
    }
    free(q), free(k), free(v), free(dout), free(qd), free(kd), free(vd), free(dod);
    free(o), free(lse), free(dq), free(dk), free(dv), free(ro), free(rlse), free(rdq), free(rdk),
        free(rdv);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_selected_patterns_attention)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
