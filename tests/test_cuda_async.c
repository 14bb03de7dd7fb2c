/* test_cuda_async.c: stream-ordered calls of the "cuda" backend
 * (mtrain_cuda_set_async, mtrain_context_check_deferred):
 *  (a) the API on a CPU context: set_async is refused naming the backend,
 *      check_deferred is a success;
 *  (b) async forward and backward give bitwise the outputs of synchronous
 *      calls (random sparse pattern, GQA 8:2, d 128 and 64, bf16, a length
 *      that is not a multiple of the block size, the caller's stream);
 *  (c) NaN in q with check_inputs off: the async forward succeeds, the
 *      deferred check then reports MTRAIN_ERR_NONFINITE naming the call, the
 *      LSE, the token and the head, once;
 *  (d) the first later call reports a completed finding itself;
 *  (e) the host does not wait: with a stream-ordered allocator
 *      (cudaMallocAsync on the context's stream), queueing a dense forward
 *      of 16K tokens takes under a quarter of its synchronous time;
 *  (f) the same with the backend's own allocator: the context's kept blocks
 *      (mtrain_context_set_reuse_limit) serve the calls after the first, so
 *      no cudaFree waits for the device, and the outputs are bitwise those of
 *      a context that keeps nothing (where every free waits: timed, printed).
 * Skipped (exit 77) without a CUDA device. Seeds are printed. */
#define _POSIX_C_SOURCE 200809L
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
#include <time.h>

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

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

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

static mtrain_plan_t *make_plan(mtrain_context_t *ctx, const mtrain_pattern_t *p) {
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_plan_t *plan = NULL;
  const mtrain_status_t st = mtrain_plan_create(ctx, NULL, pats, &plan);
  if (st) fail_msg("mtrain_plan_create: %s (%s)", mtrain_status_name(st), mtrain_last_error());
  return plan;
}

/* One problem on the device: inputs N(0, 1) from a seed, outputs. */
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

/* Device tensor of `count` bf16 N(0, 1) values from `seed`. */
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

static mtrain_status_t forward(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                               const problem_t *p) {
  mtrain_tensor_t q = mtrain_tensor_3d(p->q, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t k = mtrain_tensor_3d(p->k, MTRAIN_BF16, p->n, p->hkv, p->d);
  mtrain_tensor_t v = mtrain_tensor_3d(p->v, MTRAIN_BF16, p->n, p->hkv, p->d);
  mtrain_tensor_t o = mtrain_tensor_3d(p->o, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t lse = mtrain_tensor_2d(p->lse, MTRAIN_F32, p->n, p->hq);
  return mtrain_attention_forward(ctx, plan, &q, &k, &v, &o, &lse);
}

static mtrain_status_t backward(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                const problem_t *p) {
  mtrain_tensor_t q = mtrain_tensor_3d(p->q, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t k = mtrain_tensor_3d(p->k, MTRAIN_BF16, p->n, p->hkv, p->d);
  mtrain_tensor_t v = mtrain_tensor_3d(p->v, MTRAIN_BF16, p->n, p->hkv, p->d);
  mtrain_tensor_t o = mtrain_tensor_3d(p->o, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t lse = mtrain_tensor_2d(p->lse, MTRAIN_F32, p->n, p->hq);
  mtrain_tensor_t dout = mtrain_tensor_3d(p->dout, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t dq = mtrain_tensor_3d(p->dq, MTRAIN_BF16, p->n, p->hq, p->d);
  mtrain_tensor_t dk = mtrain_tensor_3d(p->dk, MTRAIN_BF16, p->n, p->hkv, p->d);
  mtrain_tensor_t dv = mtrain_tensor_3d(p->dv, MTRAIN_BF16, p->n, p->hkv, p->d);
  return mtrain_attention_backward(ctx, plan, &q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv);
}

/* Host copy of a device buffer (caller frees). */
static void *host_copy(const void *dev, size_t bytes) {
  void *h = malloc(bytes);
  assert_non_null(h);
  assert_int_equal(mtrain_cuda_memcpy_to_host(h, dev, bytes), MTRAIN_SUCCESS);
  return h;
}

#define CHECK_OK(call)                                                                             \
  do {                                                                                             \
    const mtrain_status_t st_ = (call);                                                            \
    if (st_) fail_msg("%s: %s (%s)", #call, mtrain_status_name(st_), mtrain_last_error());         \
  } while (0)

/* (a) */
static void test_api_on_cpu(void **state) {
  (void)state;
  mtrain_context_t *cpu = make_context("cpu", 128);
  assert_int_equal(mtrain_cuda_set_async(cpu, 1), MTRAIN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(mtrain_last_error(), "uses backend 'cpu', not 'cuda'"));
  assert_int_equal(mtrain_context_check_deferred(cpu), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cuda_set_async(NULL, 1), MTRAIN_ERR_NULL_POINTER);
  assert_int_equal(mtrain_context_check_deferred(NULL), MTRAIN_ERR_NULL_POINTER);
  mtrain_context_destroy(cpu);
}

/* (b) for one head_dim */
static void async_equals_sync(int32_t d, uint64_t seed) {
  const int64_t n = 3000; /* not a multiple of the block size 128 */
  print_message("async == sync: n %lld, 8:2 heads, d %d, bf16, seed %llu\n", (long long)n, d,
                (unsigned long long)seed);
  problem_t p;
  problem_init(&p, n, 8, 2, d, seed);
  mtrain_pattern_t *pat = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, n, 8, 128, seed);
  mtrain_context_t *ctx = make_context("cuda", 128);
  cudaStream_t stream = NULL;
  assert_int_equal(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  CHECK_OK(mtrain_cuda_set_stream(ctx, stream));
  mtrain_plan_t *plan = make_plan(ctx, pat);
  CHECK_OK(forward(ctx, plan, &p));
  CHECK_OK(backward(ctx, plan, &p));
  void *want[5] = {host_copy(p.o, p.bq), host_copy(p.lse, p.bl), host_copy(p.dq, p.bq),
                   host_copy(p.dk, p.bk), host_copy(p.dv, p.bk)};
  const size_t bytes[5] = {p.bq, p.bl, p.bq, p.bk, p.bk};
  void *dev[5] = {p.o, p.lse, p.dq, p.dk, p.dv};
  for (int i = 0; i < 5; i++) assert_int_equal(mtrain_cuda_memset(dev[i], 0xFF, bytes[i]), 0);
  CHECK_OK(mtrain_cuda_set_async(ctx, 1));
  CHECK_OK(forward(ctx, plan, &p));
  CHECK_OK(backward(ctx, plan, &p));
  CHECK_OK(mtrain_context_check_deferred(ctx));
  for (int i = 0; i < 5; i++) {
    void *got = host_copy(dev[i], bytes[i]);
    if (memcmp(got, want[i], bytes[i]) != 0) fail_msg("output %d differs from the sync call's", i);
    free(got);
    free(want[i]);
  }
  CHECK_OK(mtrain_cuda_set_async(ctx, 0));
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  cudaStreamDestroy(stream);
  mtrain_pattern_destroy(pat);
  problem_free(&p);
}

static void test_async_equals_sync(void **state) {
  (void)state;
  require_gpu();
  async_equals_sync(128, 0xa51c01);
  async_equals_sync(64, 0xa51c02);
}

/* Writes a NaN into q[token, head, 0] (bf16 0x7fc0). */
static void poison_q(const problem_t *p, int64_t token, int32_t head) {
  const uint16_t nan_bf16 = 0x7fc0;
  char *at = (char *)p->q + 2 * (size_t)((token * p->hq + head) * p->d);
  assert_int_equal(mtrain_cuda_memcpy_to_device(at, &nan_bf16, 2), MTRAIN_SUCCESS);
}

/* (c) */
static void test_deferred_finding(void **state) {
  (void)state;
  require_gpu();
  const uint64_t seed = 0xa51c03;
  print_message("deferred finding: seed %llu\n", (unsigned long long)seed);
  problem_t p;
  problem_init(&p, 1000, 4, 2, 64, seed);
  poison_q(&p, 777, 3);
  mtrain_pattern_t *pat = ts_make_pattern(TS_PATTERN_DENSE, 1000, 4, 128, seed);
  mtrain_context_t *ctx = make_context("cuda", 128);
  mtrain_plan_t *plan = make_plan(ctx, pat);
  CHECK_OK(mtrain_cuda_set_async(ctx, 1));
  assert_int_equal(forward(ctx, plan, &p), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_context_check_deferred(ctx), MTRAIN_ERR_NONFINITE);
  const char *msg = mtrain_last_error();
  print_message("reported: %s\n", msg);
  assert_non_null(strstr(msg, "forward: output 'lse' is not finite"));
  assert_non_null(strstr(msg, "(token 777, head 3)"));
  assert_non_null(strstr(msg, "mtrain_cuda_set_async"));
  assert_int_equal(mtrain_context_check_deferred(ctx), MTRAIN_SUCCESS); /* once */
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  mtrain_pattern_destroy(pat);
  problem_free(&p);
}

/* (d) */
static void test_later_call_reports(void **state) {
  (void)state;
  require_gpu();
  const uint64_t seed = 0xa51c04;
  print_message("later call reports: seed %llu\n", (unsigned long long)seed);
  problem_t bad, good;
  problem_init(&bad, 700, 4, 2, 64, seed);
  problem_init(&good, 700, 4, 2, 64, seed + 10);
  poison_q(&bad, 5, 1);
  mtrain_pattern_t *pat = ts_make_pattern(TS_PATTERN_DENSE, 700, 4, 128, seed);
  mtrain_context_t *ctx = make_context("cuda", 128);
  mtrain_plan_t *plan = make_plan(ctx, pat);
  CHECK_OK(mtrain_cuda_set_async(ctx, 1));
  assert_int_equal(forward(ctx, plan, &bad), MTRAIN_SUCCESS);
  CHECK_OK(mtrain_cuda_device_synchronize()); /* the scan is complete */
  assert_int_equal(forward(ctx, plan, &good), MTRAIN_ERR_NONFINITE);
  assert_non_null(strstr(mtrain_last_error(), "(token 5, head 1)"));
  assert_int_equal(forward(ctx, plan, &good), MTRAIN_SUCCESS);
  CHECK_OK(mtrain_context_check_deferred(ctx));
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  mtrain_pattern_destroy(pat);
  problem_free(&bad);
  problem_free(&good);
}

/* A stream-ordered allocator on one stream (the user pointer). */
static void *alloc_on_stream(size_t bytes, void *user) {
  void *p = NULL;
  return cudaMallocAsync(&p, bytes, *(cudaStream_t *)user) == cudaSuccess ? p : NULL;
}
static void free_on_stream(void *ptr, size_t bytes, void *user) {
  (void)bytes;
  cudaFreeAsync(ptr, *(cudaStream_t *)user);
}

/* (e) */
static void test_host_does_not_wait(void **state) {
  (void)state;
  require_gpu();
  const uint64_t seed = 0xa51c05;
  const int64_t n = 16384;
  print_message("host does not wait: dense %lld tokens, 16:2 heads, d 128, seed %llu\n",
                (long long)n, (unsigned long long)seed);
  problem_t p;
  problem_init(&p, n, 16, 2, 128, seed);
  mtrain_pattern_t *pat = ts_make_pattern(TS_PATTERN_DENSE, n, 16, 128, seed);
  mtrain_context_t *ctx = make_context("cuda", 128);
  cudaStream_t stream = NULL;
  assert_int_equal(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  CHECK_OK(mtrain_cuda_set_stream(ctx, stream));
  mtrain_allocator_t a = {alloc_on_stream, free_on_stream, &stream};
  CHECK_OK(mtrain_context_set_allocator(ctx, &a));
  mtrain_plan_t *plan = make_plan(ctx, pat);
  CHECK_OK(forward(ctx, plan, &p)); /* warm-up: staging slots, kernels loaded */
  double sync_best = 1e30;
  for (int r = 0; r < 3; r++) {
    const double t0 = now();
    CHECK_OK(forward(ctx, plan, &p));
    const double t = now() - t0;
    sync_best = t < sync_best ? t : sync_best;
  }
  CHECK_OK(mtrain_cuda_set_async(ctx, 1));
  CHECK_OK(forward(ctx, plan, &p));
  CHECK_OK(mtrain_context_check_deferred(ctx));
  const int calls = 4;
  const double t0 = now();
  for (int r = 0; r < calls; r++) CHECK_OK(forward(ctx, plan, &p));
  const double queued = (now() - t0) / calls;
  CHECK_OK(mtrain_context_check_deferred(ctx));
  const double total = (now() - t0) / calls;
  print_message("synchronous call %.3f ms; async: queued in %.3f ms per call, done after %.3f ms "
                "per call\n",
                1e3 * sync_best, 1e3 * queued, 1e3 * total);
  assert_true(queued < 0.25 * sync_best);
  mtrain_plan_destroy(plan);
  CHECK_OK(mtrain_cuda_set_async(ctx, 0));
  mtrain_context_destroy(ctx);
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  mtrain_pattern_destroy(pat);
  problem_free(&p);
}

/* One context of (f): the warm-up call, then the best synchronous call, then
 * the async calls' queueing time per call; the outputs copied to the host. */
static void time_own_allocator(const problem_t *p, const mtrain_pattern_t *pat, size_t limit,
                               double *sync_best, double *queued, int64_t *reused, void **o_host) {
  mtrain_context_t *ctx = make_context("cuda", 128);
  CHECK_OK(mtrain_context_set_reuse_limit(ctx, limit));
  mtrain_plan_t *plan = make_plan(ctx, pat);
  CHECK_OK(forward(ctx, plan, p));
  *sync_best = 1e30;
  for (int r = 0; r < 3; r++) {
    const double t0 = now();
    CHECK_OK(forward(ctx, plan, p));
    const double t = now() - t0;
    *sync_best = t < *sync_best ? t : *sync_best;
  }
  CHECK_OK(mtrain_cuda_set_async(ctx, 1));
  CHECK_OK(forward(ctx, plan, p));
  CHECK_OK(mtrain_context_check_deferred(ctx));
  const int calls = 4;
  const double t0 = now();
  for (int r = 0; r < calls; r++) CHECK_OK(forward(ctx, plan, p));
  *queued = (now() - t0) / calls;
  CHECK_OK(mtrain_context_check_deferred(ctx));
  CHECK_OK(mtrain_context_kept(ctx, NULL, reused));
  *o_host = host_copy(p->o, p->bq);
  mtrain_plan_destroy(plan);
  CHECK_OK(mtrain_cuda_set_async(ctx, 0));
  mtrain_context_destroy(ctx);
}

/* (f) */
static void test_kept_blocks_do_not_wait(void **state) {
  (void)state;
  require_gpu();
  const uint64_t seed = 0xa51c06;
  const int64_t n = 16384;
  print_message("kept blocks: dense %lld tokens, 16:2 heads, d 128, seed %llu\n", (long long)n,
                (unsigned long long)seed);
  problem_t p;
  problem_init(&p, n, 16, 2, 128, seed);
  mtrain_pattern_t *pat = ts_make_pattern(TS_PATTERN_DENSE, n, 16, 128, seed);
  double sync_kept, queued_kept, sync_none, queued_none;
  int64_t reused_kept, reused_none;
  void *o_kept = NULL, *o_none = NULL;
  time_own_allocator(&p, pat, MTRAIN_REUSE_LIMIT_PEAK, &sync_kept, &queued_kept, &reused_kept,
                     &o_kept);
  time_own_allocator(&p, pat, 0, &sync_none, &queued_none, &reused_none, &o_none);
  print_message("blocks kept: synchronous call %.3f ms, async queued in %.3f ms per call, %lld "
                "allocations served by kept blocks; none kept: %.3f ms, %.3f ms, %lld\n",
                1e3 * sync_kept, 1e3 * queued_kept, (long long)reused_kept, 1e3 * sync_none,
                1e3 * queued_none, (long long)reused_none);
  assert_true(reused_kept > 0);
  assert_int_equal(reused_none, 0);
  assert_true(queued_kept < 0.25 * sync_kept);
  if (memcmp(o_kept, o_none, p.bq) != 0) fail_msg("outputs differ with and without kept blocks");
  free(o_kept);
  free(o_none);
  mtrain_pattern_destroy(pat);
  problem_free(&p);
}

int main(void) {
  have_gpu = mtrain_cuda_device_count() > 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_api_on_cpu),         cmocka_unit_test(test_async_equals_sync),
      cmocka_unit_test(test_deferred_finding),   cmocka_unit_test(test_later_call_reports),
      cmocka_unit_test(test_host_does_not_wait), cmocka_unit_test(test_kept_blocks_do_not_wait),
  };
  const int failed = cmocka_run_group_tests(tests, NULL, NULL);
  if (failed) return 1;
  return have_gpu ? 0 : 77;
}
