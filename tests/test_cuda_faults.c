/* test_cuda_faults.c: the failure paths of the "cuda" backend on a GPU:
 *  (a) a forward whose accumulators cannot be allocated (almost all free
 *      device memory grabbed first with mtrain_cuda_malloc) fails with
 *      MTRAIN_ERR_OUT_OF_MEMORY and a message saying "out of memory", leaves
 *      its outputs untouched, and once the memory is freed the same context
 *      computes the same call, equal to the "cpu" backend on the host;
 *  (b) mtrain_cuda_malloc of an absurd size fails with
 *      MTRAIN_ERR_OUT_OF_MEMORY and leaves its output pointer alone;
 *  (c) host (malloc'd) pointers passed as tensors to a "cuda" context fail
 *      with MTRAIN_ERR_INVALID_ARGUMENT or MTRAIN_ERR_BACKEND, not a crash,
 *      without writing the host buffers, and the context works after;
 *  (d) contexts destroyed after failed calls release their device memory
 *      (free device memory measured before and after repeated cycles) and
 *      leave no CUDA error behind;
 *  (e) a kernel launch that fails (mtrain_cuda_inject_fault LAUNCH, at every
 *      launch of a forward+backward in turn, each kernel variant built): the
 *      call fails with MTRAIN_ERR_BACKEND naming the kernel and the CUDA
 *      error (an H200 with CUDA 13 reports cudaErrorInvalidValue), and the
 *      context then computes the call bitwise equal to a run that had no
 *      fault; a build without the development variants
 *      (MTRAIN_CUDA_DEV_VARIANTS=OFF) answers a call forced to variant 1
 *      with MTRAIN_ERR_NOT_SUPPORTED naming the option that builds it;
 *  (f) with the argument "trap" (a separate process, since the error is
 *      sticky): a kernel that traps on the device makes the forward fail with
 *      MTRAIN_ERR_BACKEND, later calls fail too (no crash, no hang), and the
 *      context and plan are destroyed.
 * Every test is skipped without a CUDA device (the program then exits 77,
 * ctest's SKIP_RETURN_CODE). Uses the CUDA runtime only to read the free
 * device memory (cudaMemGetInfo) and to check the device after the
 * clean-ups. Not to be run in parallel with other GPU programs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

#define MIB ((size_t)1 << 20)

static int have_gpu;
static int skipped_tests;

/* Skips the calling test when no CUDA device is visible. */
static void require_gpu(void) {
  if (have_gpu) return;
  print_message("SKIPPED: no CUDA device is visible\n");
  skipped_tests++;
  skip();
}

/* Free device memory of the current device, in bytes. */
static size_t free_device_memory(void) {
  size_t free_b = 0, total_b = 0;
  const cudaError_t err = cudaMemGetInfo(&free_b, &total_b);
  if (err != cudaSuccess) fail_msg("cudaMemGetInfo: %s", cudaGetErrorString(err));
  return free_b;
}

/* A "cuda" (or other) context with granularity g; fails the test on error. */
static mtrain_context_t *make_context(const char *backend, int32_t g) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = g;
  mtrain_context_t *ctx = NULL;
  const mtrain_status_t st = mtrain_context_create(&cfg, NULL, &ctx);
  if (st)
    fail_msg("mtrain_context_create(%s): %s (%s)", backend, mtrain_status_name(st),
             mtrain_last_error());
  return ctx;
}

/* The plan of one sequence with pattern p on ctx; fails the test on error. */
static mtrain_plan_t *make_plan(mtrain_context_t *ctx, const mtrain_pattern_t *p) {
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_plan_t *plan = NULL;
  const mtrain_status_t st = mtrain_plan_create(ctx, NULL, pats, &plan);
  if (st) fail_msg("mtrain_plan_create: %s (%s)", mtrain_status_name(st), mtrain_last_error());
  return plan;
}

/* Device memory of `bytes`; fails the test on error. */
static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  const mtrain_status_t st = mtrain_cuda_malloc(bytes, &p);
  if (st)
    fail_msg("mtrain_cuda_malloc(%zu): %s (%s)", bytes, mtrain_status_name(st),
             mtrain_last_error());
  return p;
}

/* A device copy of a host buffer; fails the test on error. */
static void *dev_copy(const void *host, size_t bytes) {
  void *p = dev_alloc(bytes);
  assert_int_equal(mtrain_cuda_memcpy_to_device(p, host, bytes), MTRAIN_SUCCESS);
  return p;
}

/* One attention problem: host inputs (normal noise), device copies, device
 * outputs, a diagonal-only pattern (cheap to compute, while the
 * accumulators are as large as for any pattern). */
typedef struct problem {
  int64_t n;
  int32_t hq, hkv, d, g;
  mtrain_dtype_t dtype;
  size_t bq, bk, bl;      /* bytes of q (and o, dout, dq), k (and v, dk, dv), lse */
  void *q, *k, *v, *dout; /* host */
  void *dq_, *dk_, *dv_, *ddout, *do_, *dlse; /* device: q, k, v, dout, o, lse */
  void *ddq, *ddk, *ddv;                      /* device gradients */
  mtrain_pattern_t *pattern;
} problem_t;

/* Host inputs N(0, 1) from `seed` and the diagonal-only pattern of a
 * problem of the given shape (no device memory yet). */
static void problem_init(problem_t *p, int64_t n, int32_t hq, int32_t hkv, int32_t d, int32_t g,
                         mtrain_dtype_t dtype, uint64_t seed) {
  memset(p, 0, sizeof *p);
  p->n = n, p->hq = hq, p->hkv = hkv, p->d = d, p->g = g, p->dtype = dtype;
  const size_t es = mtrain_dtype_size(dtype);
  p->bq = es * (size_t)(n * hq * d);
  p->bk = es * (size_t)(n * hkv * d);
  p->bl = sizeof(float) * (size_t)(n * hq);
  p->q = malloc(p->bq), p->dout = malloc(p->bq), p->k = malloc(p->bk), p->v = malloc(p->bk);
  assert_true(p->q && p->dout && p->k && p->v);
  mtrain_tensor_t t = mtrain_tensor_3d(p->q, dtype, n, hq, d);
  assert_int_equal(mtrain_generate_normal(seed, 1.0, &t), MTRAIN_SUCCESS);
  t = mtrain_tensor_3d(p->dout, dtype, n, hq, d);
  assert_int_equal(mtrain_generate_normal(seed + 1, 1.0, &t), MTRAIN_SUCCESS);
  t = mtrain_tensor_3d(p->k, dtype, n, hkv, d);
  assert_int_equal(mtrain_generate_normal(seed + 2, 1.0, &t), MTRAIN_SUCCESS);
  t = mtrain_tensor_3d(p->v, dtype, n, hkv, d);
  assert_int_equal(mtrain_generate_normal(seed + 3, 1.0, &t), MTRAIN_SUCCESS);
  p->pattern = ts_make_pattern(TS_PATTERN_DIAGONAL_ONLY, n, hq, g, seed);
}

/* Device copies of the inputs and device outputs poisoned with 0xFF. */
static void problem_to_device(problem_t *p) {
  p->dq_ = dev_copy(p->q, p->bq), p->dk_ = dev_copy(p->k, p->bk);
  p->dv_ = dev_copy(p->v, p->bk), p->ddout = dev_copy(p->dout, p->bq);
  p->do_ = dev_alloc(p->bq), p->dlse = dev_alloc(p->bl);
  p->ddq = dev_alloc(p->bq), p->ddk = dev_alloc(p->bk), p->ddv = dev_alloc(p->bk);
  assert_int_equal(mtrain_cuda_memset(p->do_, 0xFF, p->bq), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_memset(p->dlse, 0xFF, p->bl), MTRAIN_SUCCESS);
}

/* Frees the problem's host and device memory and its pattern. */
static void problem_free(problem_t *p) {
  void *dev[9] = {p->dq_, p->dk_, p->dv_, p->ddout, p->do_, p->dlse, p->ddq, p->ddk, p->ddv};
  for (int i = 0; i < 9; i++) mtrain_cuda_free(dev[i]);
  free(p->q), free(p->k), free(p->v), free(p->dout);
  mtrain_pattern_destroy(p->pattern);
  memset(p, 0, sizeof *p);
}

/* The forward on the problem's device tensors. */
static mtrain_status_t device_forward(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                      const problem_t *p) {
  mtrain_tensor_t q = mtrain_tensor_3d(p->dq_, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t k = mtrain_tensor_3d(p->dk_, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t v = mtrain_tensor_3d(p->dv_, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t o = mtrain_tensor_3d(p->do_, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t lse = mtrain_tensor_2d(p->dlse, MTRAIN_F32, p->n, p->hq);
  return mtrain_attention_forward(ctx, plan, &q, &k, &v, &o, &lse);
}

/* The backward on the problem's device tensors (after device_forward). */
static mtrain_status_t device_backward(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                       const problem_t *p) {
  mtrain_tensor_t q = mtrain_tensor_3d(p->dq_, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t k = mtrain_tensor_3d(p->dk_, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t v = mtrain_tensor_3d(p->dv_, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t o = mtrain_tensor_3d(p->do_, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t lse = mtrain_tensor_2d(p->dlse, MTRAIN_F32, p->n, p->hq);
  mtrain_tensor_t dout = mtrain_tensor_3d(p->ddout, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t dq = mtrain_tensor_3d(p->ddq, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t dk = mtrain_tensor_3d(p->ddk, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t dv = mtrain_tensor_3d(p->ddv, p->dtype, p->n, p->hkv, p->d);
  return mtrain_attention_backward(ctx, plan, &q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv);
}

/* 1 when every byte of the device buffer is `value`. */
static int device_bytes_all(const void *dev, size_t bytes, unsigned char value) {
  unsigned char *h = malloc(bytes);
  assert_non_null(h);
  assert_int_equal(mtrain_cuda_memcpy_to_host(h, dev, bytes), MTRAIN_SUCCESS);
  size_t i = 0;
  while (i < bytes && h[i] == value) i++;
  free(h);
  return i == bytes;
}

/* The problem's forward on the "cpu" backend on the host, compared with the
 * device outputs: O within two units of the storage type's rounding of
 * max|O| (both backends accumulate in fp32 and round once), LSE within
 * 1e-4 of max|LSE|, nothing non-finite. */
static void compare_with_cpu(const problem_t *p) {
  mtrain_context_t *cpu = make_context("cpu", p->g);
  mtrain_plan_t *plan = make_plan(cpu, p->pattern);
  void *o = malloc(p->bq), *lse = malloc(p->bl), *go = malloc(p->bq), *glse = malloc(p->bl);
  assert_true(o && lse && go && glse);
  mtrain_tensor_t tq = mtrain_tensor_3d(p->q, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(p->k, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t tv = mtrain_tensor_3d(p->v, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t to = mtrain_tensor_3d(o, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, p->n, p->hq);
  assert_int_equal(mtrain_attention_forward(cpu, plan, &tq, &tk, &tv, &to, &tl), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_memcpy_to_host(go, p->do_, p->bq), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_memcpy_to_host(glse, p->dlse, p->bl), MTRAIN_SUCCESS);
  const int64_t nq = p->n * p->hq * p->d, nl = p->n * p->hq;
  double *w_o = ts_to_double(o, p->dtype, nq), *g_o = ts_to_double(go, p->dtype, nq);
  double *w_l = ts_to_double(lse, MTRAIN_F32, nl), *g_l = ts_to_double(glse, MTRAIN_F32, nl);
  const double unit = p->dtype == MTRAIN_BF16 ? 0x1p-8 : p->dtype == MTRAIN_F16 ? 0x1p-11 : 1e-4;
  const double eo = ts_max_abs_diff(g_o, w_o, nq), bo = 2 * 2 * unit * ts_max_abs(w_o, nq);
  const double el = ts_max_abs_diff(g_l, w_l, nl), bl = 1e-4 * fmax(1.0, ts_max_abs(w_l, nl));
  print_message("after the recovery: max|O cuda - O cpu| = %.3g (bound %.3g), max|LSE cuda - "
                "LSE cpu| = %.3g (bound %.3g)\n",
                eo, bo, el, bl);
  const int bad =
      ts_has_nonfinite(g_o, nq) || ts_has_nonfinite(g_l, nl) || !(eo <= bo) || !(el <= bl);
  free(w_o), free(g_o), free(w_l), free(g_l);
  free(o), free(lse), free(go), free(glse);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(cpu);
  if (bad) fail_msg("the forward after the out-of-memory failure differs from the cpu backend");
}

/* (a) */
static void test_forward_out_of_memory(void **state) {
  (void)state;
  require_gpu();
  problem_t p;
  /* the forward's fp32 O accumulator alone is 256 MiB */
  problem_init(&p, 32768, 16, 2, 128, 128, MTRAIN_BF16, ts_seed(0x4001));
  const size_t acc_bytes = sizeof(float) * (size_t)(p.n * p.hq * p.d);
  mtrain_context_t *ctx = make_context("cuda", p.g);
  mtrain_plan_t *plan = make_plan(ctx, p.pattern);
  problem_to_device(&p);

  /* grab the free memory in chunks, largest first, until less than a
   * quarter of the accumulator is left */
  const size_t leave = acc_bytes / 4;
  const size_t chunks[] = {4096 * MIB, 1024 * MIB, 256 * MIB, 64 * MIB, 16 * MIB};
  size_t cap = 1024, num = 0, held = 0;
  void **hog = malloc(sizeof(void *) * cap);
  assert_non_null(hog);
  for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
    while (free_device_memory() > leave + chunks[c]) {
      void *ptr = NULL;
      if (mtrain_cuda_malloc(chunks[c], &ptr) != MTRAIN_SUCCESS) break; /* fragmentation */
      if (num == cap) {
        cap *= 2;
        hog = realloc(hog, sizeof(void *) * cap);
        assert_non_null(hog);
      }
      hog[num++] = ptr;
      held += chunks[c];
    }
  }
  mtrain_clear_error();
  const size_t left = free_device_memory();
  print_message("holding %.1f GiB in %zu chunks, %.1f MiB of device memory left; the forward "
                "needs %.0f MiB for its O accumulator\n",
                (double)held / (1024.0 * MIB), num, (double)left / MIB, (double)acc_bytes / MIB);
  if (left >= acc_bytes) fail_msg("could not take the device memory below the accumulator size");

  mtrain_status_t st = device_forward(ctx, plan, &p);
  TS_ASSERT_STATUS(st, MTRAIN_ERR_OUT_OF_MEMORY, "out of memory");
  print_message("forward without memory: %s: %s\n", mtrain_status_name(st), mtrain_last_error());
  if (!device_bytes_all(p.do_, p.bq, 0xFF) || !device_bytes_all(p.dlse, p.bl, 0xFF))
    fail_msg("the failed forward wrote its outputs");

  for (size_t i = 0; i < num; i++) mtrain_cuda_free(hog[i]);
  free(hog);
  st = device_forward(ctx, plan, &p);
  if (st)
    fail_msg("the same forward after freeing the memory: %s (%s)", mtrain_status_name(st),
             mtrain_last_error());
  compare_with_cpu(&p);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  problem_free(&p);
  assert_int_equal(mtrain_cuda_device_synchronize(), MTRAIN_SUCCESS);
}

/* (b) */
static void test_malloc_absurd_size(void **state) {
  (void)state;
  require_gpu();
  static int marker;
  void *ptr = &marker;
  const mtrain_status_t st = mtrain_cuda_malloc((size_t)1 << 50, &ptr); /* 1 PiB */
  TS_ASSERT_STATUS(st, MTRAIN_ERR_OUT_OF_MEMORY, "out of memory");
  assert_ptr_equal(ptr, &marker); /* outputs are written only on success */
  /* the device is still usable */
  void *small = dev_alloc(4096);
  assert_int_equal(mtrain_cuda_memset(small, 0, 4096), MTRAIN_SUCCESS);
  mtrain_cuda_free(small);
  assert_int_equal(mtrain_cuda_device_synchronize(), MTRAIN_SUCCESS);
}

/* Fails unless st is one of the statuses a host pointer may give. */
static void expect_host_pointer_error(mtrain_status_t st, const char *what) {
  if (st != MTRAIN_ERR_INVALID_ARGUMENT && st != MTRAIN_ERR_BACKEND)
    fail_msg("%s with host pointers returned %s (%s), expected MTRAIN_ERR_INVALID_ARGUMENT or "
             "MTRAIN_ERR_BACKEND",
             what, mtrain_status_name(st), mtrain_last_error());
  print_message("%s with host pointers: %s: %s\n", what, mtrain_status_name(st),
                mtrain_last_error());
}

/* 1 when every byte of the host buffer is `value`. */
static int host_bytes_all(const void *h, size_t bytes, unsigned char value) {
  const unsigned char *b = h;
  for (size_t i = 0; i < bytes; i++)
    if (b[i] != value) return 0;
  return 1;
}

/* (c) */
static void test_host_pointers(void **state) {
  (void)state;
  require_gpu();
  problem_t p;
  problem_init(&p, 1000, 8, 2, 64, 128, MTRAIN_BF16, ts_seed(0x4002));
  mtrain_context_t *ctx = make_context("cuda", p.g);
  mtrain_plan_t *plan = make_plan(ctx, p.pattern);
  void *o = malloc(p.bq), *lse = malloc(p.bl), *dq = malloc(p.bq), *dk = malloc(p.bk),
       *dv = malloc(p.bk);
  assert_true(o && lse && dq && dk && dv);
  memset(o, 0x5A, p.bq), memset(lse, 0x5A, p.bl), memset(dq, 0x5A, p.bq);
  memset(dk, 0x5A, p.bk), memset(dv, 0x5A, p.bk);
  mtrain_tensor_t tq = mtrain_tensor_3d(p.q, p.dtype, p.n, p.hq, p.d);
  mtrain_tensor_t tk = mtrain_tensor_3d(p.k, p.dtype, p.n, p.hkv, p.d);
  mtrain_tensor_t tv = mtrain_tensor_3d(p.v, p.dtype, p.n, p.hkv, p.d);
  mtrain_tensor_t tdo = mtrain_tensor_3d(p.dout, p.dtype, p.n, p.hq, p.d);
  mtrain_tensor_t to = mtrain_tensor_3d(o, p.dtype, p.n, p.hq, p.d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, p.n, p.hq);
  mtrain_tensor_t tdq = mtrain_tensor_3d(dq, p.dtype, p.n, p.hq, p.d);
  mtrain_tensor_t tdk = mtrain_tensor_3d(dk, p.dtype, p.n, p.hkv, p.d);
  mtrain_tensor_t tdv = mtrain_tensor_3d(dv, p.dtype, p.n, p.hkv, p.d);
  /* every tensor on the host */
  expect_host_pointer_error(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl),
                            "forward (all tensors)");
  expect_host_pointer_error(
      mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv),
      "backward (all tensors)");
  /* device inputs, one host output */
  problem_to_device(&p);
  mtrain_tensor_t dq_in = mtrain_tensor_3d(p.dq_, p.dtype, p.n, p.hq, p.d);
  mtrain_tensor_t dk_in = mtrain_tensor_3d(p.dk_, p.dtype, p.n, p.hkv, p.d);
  mtrain_tensor_t dv_in = mtrain_tensor_3d(p.dv_, p.dtype, p.n, p.hkv, p.d);
  mtrain_tensor_t dl_out = mtrain_tensor_2d(p.dlse, MTRAIN_F32, p.n, p.hq);
  expect_host_pointer_error(
      mtrain_attention_forward(ctx, plan, &dq_in, &dk_in, &dv_in, &to, &dl_out),
      "forward (o only)");
  /* one host input */
  mtrain_tensor_t do_out = mtrain_tensor_3d(p.do_, p.dtype, p.n, p.hq, p.d);
  expect_host_pointer_error(
      mtrain_attention_forward(ctx, plan, &dq_in, &tk, &dv_in, &do_out, &dl_out),
      "forward (k only)");
  if (!host_bytes_all(o, p.bq, 0x5A) || !host_bytes_all(lse, p.bl, 0x5A) ||
      !host_bytes_all(dq, p.bq, 0x5A) || !host_bytes_all(dk, p.bk, 0x5A) ||
      !host_bytes_all(dv, p.bk, 0x5A))
    fail_msg("a failed call wrote a host output buffer");
  /* the context still works */
  mtrain_status_t st = device_forward(ctx, plan, &p);
  if (!st) st = device_backward(ctx, plan, &p);
  if (st)
    fail_msg("a correct call after the host-pointer errors: %s (%s)", mtrain_status_name(st),
             mtrain_last_error());
  compare_with_cpu(&p);
  free(o), free(lse), free(dq), free(dk), free(dv);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  problem_free(&p);
  assert_int_equal(mtrain_cuda_device_synchronize(), MTRAIN_SUCCESS);
}

/* One context's life: a failed call of each kind, then (when `then_ok`) a
 * correct forward and backward, then destroy. */
static void error_cycle(problem_t *p, problem_t *p32, int then_ok) {
  mtrain_context_t *ctx = make_context("cuda", p->g);
  mtrain_plan_t *plan = make_plan(ctx, p->pattern);
  /* host pointers */
  mtrain_tensor_t hq = mtrain_tensor_3d(p->q, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t hk = mtrain_tensor_3d(p->k, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t hv = mtrain_tensor_3d(p->v, p->dtype, p->n, p->hkv, p->d);
  mtrain_tensor_t o = mtrain_tensor_3d(p->do_, p->dtype, p->n, p->hq, p->d);
  mtrain_tensor_t lse = mtrain_tensor_2d(p->dlse, MTRAIN_F32, p->n, p->hq);
  mtrain_status_t st = mtrain_attention_forward(ctx, plan, &hq, &hk, &hv, &o, &lse);
  if (st == MTRAIN_SUCCESS) fail_msg("a forward with host inputs succeeded");
  /* a forced variant that cannot compute the call: variant 2 and fp32 */
  assert_int_equal(mtrain_cuda_set_variant(ctx, MTRAIN_CUDA_VARIANT_MMA2), MTRAIN_SUCCESS);
  st = device_forward(ctx, plan, p32);
  TS_ASSERT_STATUS(st, MTRAIN_ERR_NOT_SUPPORTED, NULL);
  st = device_backward(ctx, plan, p32);
  TS_ASSERT_STATUS(st, MTRAIN_ERR_NOT_SUPPORTED, NULL);
  assert_int_equal(mtrain_cuda_set_variant(ctx, MTRAIN_CUDA_VARIANT_AUTO), MTRAIN_SUCCESS);
  if (then_ok) {
    st = device_forward(ctx, plan, p);
    if (!st) st = device_backward(ctx, plan, p);
    if (st)
      fail_msg("a correct call after errors: %s (%s)", mtrain_status_name(st), mtrain_last_error());
  }
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
}

/* (d) */
static void test_destroy_after_errors(void **state) {
  (void)state;
  require_gpu();
  problem_t p, p32;
  /* 32 MiB of fp32 O accumulator per forward: a leak would show */
  problem_init(&p, 4096, 16, 2, 128, 128, MTRAIN_BF16, ts_seed(0x4003));
  problem_init(&p32, 4096, 16, 2, 128, 128, MTRAIN_F32, ts_seed(0x4004));
  problem_to_device(&p);
  problem_to_device(&p32);
  /* warm-up: kernels of variant 0 and of the one AUTO picks loaded,
   * allocator state settled */
  const mtrain_cuda_variant_t warm[2] = {MTRAIN_CUDA_VARIANT_SIMT, MTRAIN_CUDA_VARIANT_AUTO};
  for (int i = 0; i < 2; i++) {
    const int variant = (int)warm[i];
    mtrain_context_t *ctx = make_context("cuda", p.g);
    mtrain_plan_t *plan = make_plan(ctx, p.pattern);
    assert_int_equal(mtrain_cuda_set_variant(ctx, warm[i]), MTRAIN_SUCCESS);
    mtrain_status_t st = device_forward(ctx, plan, &p);
    if (!st) st = device_backward(ctx, plan, &p);
    if (st)
      fail_msg("warm-up with variant %d: %s (%s)", variant, mtrain_status_name(st),
               mtrain_last_error());
    mtrain_plan_destroy(plan);
    mtrain_context_destroy(ctx);
  }
  error_cycle(&p, &p32, 1);
  assert_int_equal(mtrain_cuda_device_synchronize(), MTRAIN_SUCCESS);
  const size_t before = free_device_memory();
  const int cycles = 10;
  for (int i = 0; i < cycles; i++) error_cycle(&p, &p32, i % 2);
  assert_int_equal(mtrain_cuda_device_synchronize(), MTRAIN_SUCCESS);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) fail_msg("CUDA error left behind: %s", cudaGetErrorString(err));
  const size_t after = free_device_memory();
  const double lost = ((double)before - (double)after) / (double)MIB;
  print_message("free device memory before %zu MiB, after %d error cycles %zu MiB (%.1f MiB "
                "less)\n",
                before / MIB, cycles, after / MIB, lost);
  if (lost > 16.0)
    fail_msg("%d contexts destroyed after errors lost %.1f MiB of device memory", cycles, lost);
  /* and a fresh context computes correctly */
  mtrain_context_t *ctx = make_context("cuda", p.g);
  mtrain_plan_t *plan = make_plan(ctx, p.pattern);
  assert_int_equal(device_forward(ctx, plan, &p), MTRAIN_SUCCESS);
  compare_with_cpu(&p);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  problem_free(&p);
  problem_free(&p32);
}

/* Device outputs of a forward+backward, copied to the host. */
typedef struct outputs {
  unsigned char *o, *lse, *dq, *dk, *dv;
} outputs_t;

static void outputs_take(outputs_t *r, const problem_t *p) {
  r->o = malloc(p->bq), r->lse = malloc(p->bl), r->dq = malloc(p->bq);
  r->dk = malloc(p->bk), r->dv = malloc(p->bk);
  assert_true(r->o && r->lse && r->dq && r->dk && r->dv);
  assert_int_equal(mtrain_cuda_memcpy_to_host(r->o, p->do_, p->bq), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_memcpy_to_host(r->lse, p->dlse, p->bl), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_memcpy_to_host(r->dq, p->ddq, p->bq), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_memcpy_to_host(r->dk, p->ddk, p->bk), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_memcpy_to_host(r->dv, p->ddv, p->bk), MTRAIN_SUCCESS);
}

static void outputs_free(outputs_t *r) {
  free(r->o), free(r->lse), free(r->dq), free(r->dk), free(r->dv);
}

/* 1 when the two runs' outputs are bitwise equal. */
static int outputs_equal(const outputs_t *a, const outputs_t *b, const problem_t *p) {
  return !memcmp(a->o, b->o, p->bq) && !memcmp(a->lse, b->lse, p->bl) &&
         !memcmp(a->dq, b->dq, p->bq) && !memcmp(a->dk, b->dk, p->bk) &&
         !memcmp(a->dv, b->dv, p->bk);
}

static mtrain_status_t forward_backward(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                        const problem_t *p) {
  mtrain_status_t st = device_forward(ctx, plan, p);
  return st ? st : device_backward(ctx, plan, p);
}

/* (e) */
static void test_failing_launch(void **state) {
  (void)state;
  require_gpu();
  problem_t p;
  /* a pattern with verticals, so the bar kernels run too */
  problem_init(&p, 1000, 4, 2, 128, 128, MTRAIN_BF16, ts_seed(0x4005));
  mtrain_pattern_destroy(p.pattern);
  p.pattern = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, p.n, p.hq, p.g, ts_seed(0x4006));
  problem_to_device(&p);
  mtrain_context_t *ctx = make_context("cuda", p.g);
  mtrain_plan_t *plan = make_plan(ctx, p.pattern);
  for (int variant = 0; variant <= 3; variant++) {
    assert_int_equal(mtrain_cuda_set_variant(ctx, (mtrain_cuda_variant_t)variant), MTRAIN_SUCCESS);
    mtrain_status_t st = forward_backward(ctx, plan, &p);
#ifndef MTRAIN_HAVE_CUDA_DEV_VARIANTS
    if (variant == MTRAIN_CUDA_VARIANT_MMA) { /* not built: refused, naming the option */
      TS_ASSERT_STATUS(st, MTRAIN_ERR_NOT_SUPPORTED, "MTRAIN_CUDA_DEV_VARIANTS");
      print_message("variant %d is not built: %s\n", variant, mtrain_last_error());
      continue;
    }
#endif
    if (st)
      fail_msg("variant %d without a fault: %s (%s)", variant, mtrain_status_name(st),
               mtrain_last_error());
    outputs_t want;
    outputs_take(&want, &p);
    int failed_launches = 0;
    for (int64_t nth = 1;; nth++) {
      assert_int_equal(mtrain_cuda_inject_fault(MTRAIN_CUDA_FAULT_LAUNCH, nth), MTRAIN_SUCCESS);
      st = forward_backward(ctx, plan, &p);
      const int64_t pending = mtrain_cuda_fault_pending();
      assert_int_equal(mtrain_cuda_inject_fault(MTRAIN_CUDA_FAULT_NONE, 0), MTRAIN_SUCCESS);
      if (pending > 0) { /* past the last launch: the call must have succeeded */
        if (st)
          fail_msg("variant %d: a call without a fault failed: %s", variant, mtrain_last_error());
        break;
      }
      if (st != MTRAIN_ERR_BACKEND || !strstr(mtrain_last_error(), "failed: cudaError"))
        fail_msg("variant %d, failed launch %lld: status %s (%s), expected MTRAIN_ERR_BACKEND "
                 "with the CUDA error",
                 variant, (long long)nth, mtrain_status_name(st), mtrain_last_error());
      if (nth <= 2 || nth % 16 == 0)
        print_message("variant %d, launch %lld fails: %s\n", variant, (long long)nth,
                      mtrain_last_error());
      failed_launches++;
      /* the context is still usable and computes the same as before */
      st = forward_backward(ctx, plan, &p);
      if (st)
        fail_msg("variant %d: the call after failed launch %lld: %s (%s)", variant, (long long)nth,
                 mtrain_status_name(st), mtrain_last_error());
      outputs_t got;
      outputs_take(&got, &p);
      const int same = outputs_equal(&got, &want, &p);
      outputs_free(&got);
      if (!same)
        fail_msg("variant %d: after failed launch %lld the outputs differ from the run without "
                 "a fault",
                 variant, (long long)nth);
    }
    print_message("variant %d: each of the %d launches of a forward+backward failed in turn; "
                  "each time the call failed and the context then recomputed the same bits\n",
                  variant, failed_launches);
    assert_true(failed_launches >= 4);
    outputs_free(&want);
  }
  assert_int_equal(mtrain_cuda_inject_fault((mtrain_cuda_fault_t)7, 1),
                   MTRAIN_ERR_INVALID_ARGUMENT);
  assert_int_equal(mtrain_cuda_inject_fault(MTRAIN_CUDA_FAULT_LAUNCH, 0),
                   MTRAIN_ERR_INVALID_ARGUMENT);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  problem_free(&p);
}

/* (f) a kernel that traps on the device: a sticky error. Run in its own
 * process (argument "trap"): the process's CUDA context is lost. */
static void test_trapping_kernel(void **state) {
  (void)state;
  require_gpu();
  problem_t p;
  problem_init(&p, 1000, 4, 2, 64, 128, MTRAIN_BF16, ts_seed(0x4007));
  problem_to_device(&p);
  mtrain_context_t *ctx = make_context("cuda", p.g);
  mtrain_plan_t *plan = make_plan(ctx, p.pattern);
  assert_int_equal(device_forward(ctx, plan, &p), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_inject_fault(MTRAIN_CUDA_FAULT_TRAP, 2), MTRAIN_SUCCESS);
  mtrain_status_t st = device_forward(ctx, plan, &p);
  print_message("the forward with a trapping kernel: %s (%s)\n", mtrain_status_name(st),
                mtrain_last_error());
  TS_ASSERT_STATUS(st, MTRAIN_ERR_BACKEND, "cuda");
  st = device_backward(ctx, plan, &p);
  print_message("the backward after it: %s (%s)\n", mtrain_status_name(st), mtrain_last_error());
  if (st == MTRAIN_SUCCESS) fail_msg("a backward after a sticky device error succeeded");
  st = device_forward(ctx, plan, &p);
  if (st == MTRAIN_SUCCESS) fail_msg("a forward after a sticky device error succeeded");
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  st = mtrain_cuda_device_synchronize();
  print_message("the device after destroy: %s (%s)\n", mtrain_status_name(st),
                st ? mtrain_last_error() : "");
  if (st == MTRAIN_SUCCESS) fail_msg("the sticky error vanished");
  /* the host memory only: device frees would fail on a lost context */
  free(p.q), free(p.k), free(p.v), free(p.dout);
  mtrain_pattern_destroy(p.pattern);
}

int main(int argc, char **argv) {
  have_gpu = mtrain_cuda_device_count() > 0;
  if (!have_gpu)
    print_message("no CUDA device is visible (or the build has no CUDA backend): every test is "
                  "SKIPPED\n");
  if (argc > 1 && strcmp(argv[1], "trap") == 0) {
    const struct CMUnitTest trap[] = {cmocka_unit_test(test_trapping_kernel)};
    const int rc = cmocka_run_group_tests(trap, NULL, NULL);
    return rc == 0 && skipped_tests == 1 ? 77 : rc;
  }
  if (argc > 1) {
    fprintf(stderr, "usage: %s [trap]\n", argv[0]);
    return 2;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_malloc_absurd_size),    cmocka_unit_test(test_host_pointers),
      cmocka_unit_test(test_destroy_after_errors),  cmocka_unit_test(test_failing_launch),
      cmocka_unit_test(test_forward_out_of_memory),
  };
  const int rc = cmocka_run_group_tests(tests, NULL, NULL);
  if (rc == 0 && skipped_tests == (int)(sizeof tests / sizeof tests[0])) return 77;
  return rc;
}
