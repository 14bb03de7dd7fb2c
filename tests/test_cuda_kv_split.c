/* test_cuda_kv_split.c: the long-item split of the "cuda" backward
 * (variants 2 and 3; docs/CUDA_KERNELS.md, "Long key-major items split"):
 *  (a) MTRAIN_CUDA_KV_SPLIT_CHUNK: a context is refused (MTRAIN_ERR_INVALID_CONFIG
 *      naming the variable) unless it is a positive integer;
 *  (b) deterministic contexts, a block mask with a sink column (key block 0
 *      in every query block), bf16, GQA 8:2, d 64 and 128, N not a multiple
 *      of G: with C_MIN 1 (every item of more than one entry split, as far as
 *      the 2-SM bound lets) the backward gives the same bits twice, and
 *      dQ, dK, dV within bf16 rounding of a context that never splits
 *      (C_MIN 10^9); each variant in turn.
 * Skipped (exit 77) without a CUDA device. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

static int have_gpu;

static void require_gpu(void) {
  if (have_gpu) return;
  print_message("SKIPPED: no CUDA device is visible\n");
  skip();
}

#define CHECK_OK(call)                                                                             \
  do {                                                                                             \
    const mtrain_status_t st_ = (call);                                                            \
    if (st_) fail_msg("%s: %s (%s)", #call, mtrain_status_name(st_), mtrain_last_error());         \
  } while (0)

/* A deterministic "cuda" context of block size g made with
 * MTRAIN_CUDA_KV_SPLIT_CHUNK=chunk (NULL: unset); the status of the
 * creation, the context in *out. */
static mtrain_status_t context_with_chunk(const char *chunk, int32_t g, mtrain_context_t **out) {
  if (chunk)
    setenv("MTRAIN_CUDA_KV_SPLIT_CHUNK", chunk, 1);
  else
    unsetenv("MTRAIN_CUDA_KV_SPLIT_CHUNK");
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = g;
  cfg.deterministic = 1;
  *out = NULL;
  const mtrain_status_t st = mtrain_context_create(&cfg, NULL, out);
  unsetenv("MTRAIN_CUDA_KV_SPLIT_CHUNK");
  return st;
}

/* (a) */
static void test_chunk_env(void **state) {
  (void)state;
  require_gpu();
  static const char *bad[] = {"0", "-3", "abc", "8x", "99999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    mtrain_context_t *ctx = NULL;
    const mtrain_status_t st = context_with_chunk(bad[i], 128, &ctx);
    TS_ASSERT_STATUS(st, MTRAIN_ERR_INVALID_CONFIG, "MTRAIN_CUDA_KV_SPLIT_CHUNK");
    assert_null(ctx);
  }
  mtrain_context_t *ctx = NULL;
  CHECK_OK(context_with_chunk("1", 128, &ctx));
  mtrain_context_destroy(ctx);
}

/* One problem on the device: bf16 inputs N(0, 1) from a seed, outputs. */
typedef struct problem {
  int64_t n;
  int32_t hq, hkv, d;
  size_t bq, bk, bl;
  void *q, *k, *v, *dout, *o, *lse, *dq, *dk, *dv; /* device */
} problem_t;

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  assert_int_equal(mtrain_cuda_malloc(bytes, &p), MTRAIN_SUCCESS);
  return p;
}

static void *dev_normal(int64_t count, uint64_t seed) {
  const size_t bytes = 2 * (size_t)count;
  void *h = malloc(bytes);
  assert_non_null(h);
  mtrain_tensor_t t = mtrain_tensor_2d(h, MTRAIN_BF16, count, 1);
  assert_int_equal(mtrain_generate_normal(seed, 1.0, &t), MTRAIN_SUCCESS);
  void *d = dev_alloc(bytes);
  assert_int_equal(mtrain_cuda_memcpy_to_device(d, h, bytes), MTRAIN_SUCCESS);
  free(h);
  return d;
}

static void problem_init(problem_t *p, int64_t n, int32_t hq, int32_t hkv, int32_t d,
                         uint64_t seed) {
  memset(p, 0, sizeof *p);
  p->n = n, p->hq = hq, p->hkv = hkv, p->d = d;
  p->bq = 2 * (size_t)(n * hq * d), p->bk = 2 * (size_t)(n * hkv * d);
  p->bl = sizeof(float) * (size_t)(n * hq);
  p->q = dev_normal(n * hq * d, seed), p->k = dev_normal(n * hkv * d, seed + 1);
  p->v = dev_normal(n * hkv * d, seed + 2), p->dout = dev_normal(n * hq * d, seed + 3);
  p->o = dev_alloc(p->bq), p->lse = dev_alloc(p->bl);
  p->dq = dev_alloc(p->bq), p->dk = dev_alloc(p->bk), p->dv = dev_alloc(p->bk);
}

static void problem_free(problem_t *p) {
  void *all[9] = {p->q, p->k, p->v, p->dout, p->o, p->lse, p->dq, p->dk, p->dv};
  for (int i = 0; i < 9; i++) mtrain_cuda_free(all[i]);
}

/* The forward, then the backward; dq, dk, dv copied to the host (bf16,
 * caller frees). */
static void forward_backward(mtrain_context_t *ctx, const mtrain_plan_t *plan, const problem_t *p,
                             void *out[3]) {
  mtrain_tensor_t q = mtrain_tensor_3d(p->q, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t k = mtrain_tensor_3d(p->k, MTRAIN_BF16, p->n, p->hkv, p->d);
  mtrain_tensor_t v = mtrain_tensor_3d(p->v, MTRAIN_BF16, p->n, p->hkv, p->d);
  mtrain_tensor_t o = mtrain_tensor_3d(p->o, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t lse = mtrain_tensor_2d(p->lse, MTRAIN_F32, p->n, p->hq);
  mtrain_tensor_t dout = mtrain_tensor_3d(p->dout, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t dq = mtrain_tensor_3d(p->dq, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t dk = mtrain_tensor_3d(p->dk, MTRAIN_BF16, p->n, p->hkv, p->d);
  mtrain_tensor_t dv = mtrain_tensor_3d(p->dv, MTRAIN_BF16, p->n, p->hkv, p->d);
  CHECK_OK(mtrain_attention_forward(ctx, plan, &q, &k, &v, &o, &lse));
  CHECK_OK(mtrain_attention_backward(ctx, plan, &q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv));
  const void *dev[3] = {p->dq, p->dk, p->dv};
  const size_t bytes[3] = {p->bq, p->bk, p->bk};
  for (int i = 0; i < 3; i++) {
    out[i] = malloc(bytes[i]);
    assert_non_null(out[i]);
    assert_int_equal(mtrain_cuda_memcpy_to_host(out[i], dev[i], bytes[i]), MTRAIN_SUCCESS);
  }
}

/* (b) for one head_dim and variant */
static void split_case(int32_t d, mtrain_cuda_variant_t variant, uint64_t seed) {
  const int64_t n = 2500; /* 20 blocks of 128, the last partial */
  const int32_t g = 128, hq = 8, hkv = 2;
  print_message("split: n %lld, G %d, %d:%d heads, d %d, variant %d, seed %llu\n", (long long)n, g,
                hq, hkv, d, (int)variant, (unsigned long long)seed);
  problem_t p;
  problem_init(&p, n, hq, hkv, d, seed);
  mtrain_pattern_t *pat = ts_make_pattern(TS_PATTERN_SINK_MASK, n, hq, g, seed);
  mtrain_context_t *split = NULL, *whole = NULL;
  CHECK_OK(context_with_chunk("1", g, &split));
  CHECK_OK(context_with_chunk("1000000000", g, &whole));
  const mtrain_status_t sv = mtrain_cuda_set_variant(split, variant);
  if (sv == MTRAIN_ERR_NOT_SUPPORTED) { /* e.g. variant 3 off sm_90 */
    print_message("  variant %d not supported here: %s\n", (int)variant, mtrain_last_error());
    mtrain_context_destroy(split);
    mtrain_context_destroy(whole);
    mtrain_pattern_destroy(pat);
    problem_free(&p);
    return;
  }
  CHECK_OK(sv);
  CHECK_OK(mtrain_cuda_set_variant(whole, variant));
  const mtrain_pattern_t *pats[1] = {pat};
  mtrain_plan_t *plan_s = NULL, *plan_w = NULL;
  CHECK_OK(mtrain_plan_create(split, NULL, pats, &plan_s));
  CHECK_OK(mtrain_plan_create(whole, NULL, pats, &plan_w));
  void *a[3], *b[3], *c[3];
  forward_backward(split, plan_s, &p, a);
  forward_backward(split, plan_s, &p, b);
  forward_backward(whole, plan_w, &p, c);
  const int64_t count[3] = {n * hq * d, n * hkv * d, n * hkv * d};
  static const char *name[3] = {"dQ", "dK", "dV"};
  for (int i = 0; i < 3; i++) {
    if (memcmp(a[i], b[i], 2 * (size_t)count[i]) != 0)
      fail_msg("%s: two runs of a deterministic context differ", name[i]);
    double *x = ts_to_double(a[i], MTRAIN_BF16, count[i]);
    double *y = ts_to_double(c[i], MTRAIN_BF16, count[i]);
    const double diff = ts_max_abs_diff(x, y, count[i]), ref = ts_max_abs(y, count[i]);
    print_message("  %s split vs unsplit: max |diff| %.3g, max |unsplit| %.3g\n", name[i], diff,
                  ref);
    /* the parts are summed in another order than one item's registers: a
     * few bf16 roundings apart */
    if (!(diff <= 2e-2 * ref)) fail_msg("%s: split and unsplit differ by %g", name[i], diff);
    free(x);
    free(y);
    free(a[i]);
    free(b[i]);
    free(c[i]);
  }
  mtrain_plan_destroy(plan_s);
  mtrain_plan_destroy(plan_w);
  mtrain_context_destroy(split);
  mtrain_context_destroy(whole);
  mtrain_pattern_destroy(pat);
  problem_free(&p);
}

static void test_split_deterministic(void **state) {
  (void)state;
  require_gpu();
  const uint64_t seed = ts_seed(0x5101);
  split_case(64, MTRAIN_CUDA_VARIANT_MMA2, seed);
  split_case(128, MTRAIN_CUDA_VARIANT_MMA2, seed + 1);
  split_case(64, MTRAIN_CUDA_VARIANT_WGMMA, seed + 2);
  split_case(128, MTRAIN_CUDA_VARIANT_WGMMA, seed + 3);
}

int main(void) {
  have_gpu = mtrain_cuda_device_count() > 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_chunk_env),
      cmocka_unit_test(test_split_deterministic),
  };
  const int failed = cmocka_run_group_tests(tests, NULL, NULL);
  if (failed) return 1;
  return have_gpu ? 0 : 77;
}
