/* example.c: the README's API example as a program. Sparse attention
 * forward and backward on random inputs with a small vertical-slash pattern,
 * on the "cpu" backend; prints the first output value and exits 0 on
 * success. Built against an installed mtrain by the install test. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <mtrain/mtrain.h>

#define CHECK(call)                                                                                \
  do {                                                                                             \
    mtrain_status_t st_ = (call);                                                                  \
    if (st_ != MTRAIN_SUCCESS) {                                                                   \
      fprintf(stderr, "%s failed: %s: %s\n", #call, mtrain_status_name(st_), mtrain_last_error()); \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

int main(void) {
  enum { N = 1000, HQ = 4, HKV = 2, D = 64 };
  float *q = malloc(sizeof(float) * N * HQ * D), *o = malloc(sizeof(float) * N * HQ * D);
  float *k = malloc(sizeof(float) * N * HKV * D), *v = malloc(sizeof(float) * N * HKV * D);
  float *lse = malloc(sizeof(float) * N * HQ), *dout = malloc(sizeof(float) * N * HQ * D);
  float *dq = malloc(sizeof(float) * N * HQ * D), *dk = malloc(sizeof(float) * N * HKV * D);
  float *dv = malloc(sizeof(float) * N * HKV * D);
  for (int i = 0; i < N * HQ * D; i++) q[i] = dout[i] = sinf(0.1f * (float)i);
  for (int i = 0; i < N * HKV * D; i++) k[i] = v[i] = cosf(0.07f * (float)i);

  /* 1. a context on the CPU backend */
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT; /* backend "cpu", G = 128 */
  mtrain_context_t *ctx = NULL;
  CHECK(mtrain_context_create(&cfg, NULL, &ctx));

  /* 2. a pattern: per head, block diagonals 0, 1, 4 and verticals 0..3 */
  mtrain_pattern_t *pattern = NULL;
  CHECK(mtrain_pattern_create(N, HQ, cfg.granularity, &pattern));
  const int32_t diagonals[] = {0, 1, 4};
  const int64_t verticals[] = {0, 1, 2, 3};
  for (int h = 0; h < HQ; h++)
    CHECK(mtrain_pattern_set_head(pattern, h, diagonals, 3, verticals, 4));

  /* 3. the plan, then forward and backward */
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *patterns[1] = {pattern};
  CHECK(mtrain_plan_create(ctx, NULL, patterns, &plan));
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, N, HQ);
  mtrain_tensor_t tdo = mtrain_tensor_3d(dout, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tdq = mtrain_tensor_3d(dq, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tdk = mtrain_tensor_3d(dk, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tdv = mtrain_tensor_3d(dv, MTRAIN_F32, N, HKV, D);
  CHECK(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl));
  CHECK(mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv));
  printf("o[0] = %g, lse[0] = %g, computed pairs = %lld\n", o[0], lse[0],
         (long long)mtrain_plan_computed_pairs(plan));

  const int ok = isfinite(o[0]) && isfinite(dq[0]);

  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(pattern);
  mtrain_context_destroy(ctx);
  free(q), free(k), free(v), free(o), free(lse), free(dout), free(dq), free(dk), free(dv);
  return ok ? 0 : 1;
}
