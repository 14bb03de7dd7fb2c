/* test_cuda_fwd_persistent.c: variant 3's two forward kernels on the device
 * (docs/CUDA_KERNELS.md, "The persistent forward"):
 *  (a) MTRAIN_CUDA_WGMMA_FWD_PERSISTENT: a context is refused
 *      (MTRAIN_ERR_INVALID_CONFIG naming the variable) unless it is 0, 1 or
 *      empty;
 *  (b) the persistent kernel (1) and the one-CTA-per-item kernel (0) give the
 *      same bits of O and LSE on the same inputs: bf16 and fp16, d 64 and
 *      128, G 64 (one consumer warpgroup) and 128 (two), causal block masks
 *      (random, with a sink column, the diagonal alone: items of one or two
 *      key tiles), diagonals and verticals (bars), and a non-causal block
 *      mask; N not a multiple of G.
 * Skipped (exit 77) without a CUDA device; the cases that variant 3 cannot
 * run here (a device other than compute capability 9.0) are skipped. */
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

#define ENV "MTRAIN_CUDA_WGMMA_FWD_PERSISTENT"

/* A "cuda" context of block size g made with MTRAIN_CUDA_WGMMA_FWD_PERSISTENT=value
 * (NULL: unset); the status of the creation, the context in *out. */
static mtrain_status_t context_with(const char *value, int32_t g, mtrain_context_t **out) {
  if (value)
    setenv(ENV, value, 1);
  else
    unsetenv(ENV);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = g;
  *out = NULL;
  const mtrain_status_t st = mtrain_context_create(&cfg, NULL, out);
  unsetenv(ENV);
  return st;
}

/* (a) */
static void test_env(void **state) {
  (void)state;
  require_gpu();
  static const char *bad[] = {"2", "-1", "yes", "01", "1 "};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    mtrain_context_t *ctx = NULL;
    const mtrain_status_t st = context_with(bad[i], 128, &ctx);
    TS_ASSERT_STATUS(st, MTRAIN_ERR_INVALID_CONFIG, ENV);
    assert_null(ctx);
  }
  static const char *good[] = {"0", "1", "", NULL};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    mtrain_context_t *ctx = NULL;
    CHECK_OK(context_with(good[i], 128, &ctx));
    mtrain_context_destroy(ctx);
  }
}

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  assert_int_equal(mtrain_cuda_malloc(bytes, &p), MTRAIN_SUCCESS);
  return p;
}

static void *dev_normal(int64_t count, mtrain_dtype_t dtype, uint64_t seed) {
  const size_t bytes = 2 * (size_t)count;
  void *h = malloc(bytes);
  assert_non_null(h);
  mtrain_tensor_t t = mtrain_tensor_2d(h, dtype, count, 1);
  assert_int_equal(mtrain_generate_normal(seed, 1.0, &t), MTRAIN_SUCCESS);
  void *d = dev_alloc(bytes);
  assert_int_equal(mtrain_cuda_memcpy_to_device(d, h, bytes), MTRAIN_SUCCESS);
  free(h);
  return d;
}

/* The forward of ctx on (q, k, v); O and LSE copied to the host (caller frees). */
static void forward(mtrain_context_t *ctx, const mtrain_pattern_t *pat, mtrain_dtype_t dtype,
                    int64_t n, int32_t hq, int32_t hkv, int32_t d, void *q, void *k, void *v,
                    void **o_host, void **lse_host) {
  const mtrain_pattern_t *pats[1] = {pat};
  mtrain_plan_t *plan = NULL;
  CHECK_OK(mtrain_plan_create(ctx, NULL, pats, &plan));
  const size_t bo = 2 * (size_t)(n * hq * d), bl = sizeof(float) * (size_t)(n * hq);
  void *o = dev_alloc(bo), *lse = dev_alloc(bl);
  mtrain_tensor_t tq = mtrain_tensor_3d(q, dtype, n, hq, d);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, dtype, n, hkv, d);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, dtype, n, hkv, d);
  mtrain_tensor_t to = mtrain_tensor_3d(o, dtype, n, hq, d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, n, hq);
  CHECK_OK(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl));
  *o_host = malloc(bo);
  *lse_host = malloc(bl);
  assert_non_null(*o_host);
  assert_non_null(*lse_host);
  assert_int_equal(mtrain_cuda_memcpy_to_host(*o_host, o, bo), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_memcpy_to_host(*lse_host, lse, bl), MTRAIN_SUCCESS);
  mtrain_cuda_free(o);
  mtrain_cuda_free(lse);
  mtrain_plan_destroy(plan);
}

/* (b) for one shape, dtype and pattern kind */
static void same_bits_case(int32_t g, int32_t d, mtrain_dtype_t dtype, ts_pattern_kind_t kind,
                           uint64_t seed) {
  const int64_t n = 20 * (int64_t)g - 37; /* the last block partial */
  const int32_t hq = 8, hkv = 2;
  print_message("same bits: n %lld, G %d, d %d, %s, %s, seed %llu\n", (long long)n, g, d,
                mtrain_dtype_name(dtype), ts_pattern_kind_name(kind), (unsigned long long)seed);
  mtrain_context_t *pers = NULL, *item = NULL;
  CHECK_OK(context_with("1", g, &pers));
  CHECK_OK(context_with("0", g, &item));
  const mtrain_status_t sv = mtrain_cuda_set_variant(pers, MTRAIN_CUDA_VARIANT_WGMMA);
  if (sv == MTRAIN_ERR_NOT_SUPPORTED) { /* variant 3 off sm_90 */
    print_message("  variant 3 not supported here: %s\n", mtrain_last_error());
    mtrain_context_destroy(pers);
    mtrain_context_destroy(item);
    return;
  }
  CHECK_OK(sv);
  CHECK_OK(mtrain_cuda_set_variant(item, MTRAIN_CUDA_VARIANT_WGMMA));
  void *q = dev_normal(n * hq * d, dtype, seed), *k = dev_normal(n * hkv * d, dtype, seed + 1);
  void *v = dev_normal(n * hkv * d, dtype, seed + 2);
  mtrain_pattern_t *pat = ts_make_pattern(kind, n, hq, g, seed);
  void *o1, *l1, *o2, *l2;
  forward(pers, pat, dtype, n, hq, hkv, d, q, k, v, &o1, &l1);
  forward(item, pat, dtype, n, hq, hkv, d, q, k, v, &o2, &l2);
  if (memcmp(l1, l2, sizeof(float) * (size_t)(n * hq)) != 0)
    fail_msg("LSE: the persistent and the one-item forward differ");
  if (memcmp(o1, o2, 2 * (size_t)(n * hq * d)) != 0)
    fail_msg("O: the persistent and the one-item forward differ");
  free(o1);
  free(l1);
  free(o2);
  free(l2);
  mtrain_pattern_destroy(pat);
  mtrain_cuda_free(q);
  mtrain_cuda_free(k);
  mtrain_cuda_free(v);
  mtrain_context_destroy(pers);
  mtrain_context_destroy(item);
}

static void test_same_bits(void **state) {
  (void)state;
  require_gpu();
  const uint64_t seed = ts_seed(0xF0F5);
  static const ts_pattern_kind_t kinds[] = {TS_PATTERN_BLOCK_MASK, TS_PATTERN_SINK_MASK,
                                            TS_PATTERN_DIAGONAL_ONLY, TS_PATTERN_RANDOM_SPARSE,
                                            TS_PATTERN_NONCAUSAL};
  uint64_t s = seed;
  for (int gi = 0; gi < 2; gi++)
    for (int di = 0; di < 2; di++)
      for (int ti = 0; ti < 2; ti++)
        for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++)
          same_bits_case(gi ? 128 : 64, di ? 128 : 64, ti ? MTRAIN_F16 : MTRAIN_BF16, kinds[ki],
                         s++);
}

int main(void) {
  have_gpu = mtrain_cuda_device_count() > 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_env),
      cmocka_unit_test(test_same_bits),
  };
  const int failed = cmocka_run_group_tests(tests, NULL, NULL);
  if (failed) return 1;
  return have_gpu ? 0 : 77;
}
