/* test_cuda_device_plan.c: plans built on the GPU (mtrain_plan_create_estimated
 * on the "cuda" backend: the selection and the step tables stay on the device)
 * against the host plan of the same estimate (MTRAIN_PLAN_ON_HOST=1, the
 * plan builder of core/runtime/plan.c, the reference):
 *  (a) random packed batches (seeds printed): lengths that are not multiples
 *      of G and shorter than G, 1 to 6 sequences, GQA 8:2, 4:1 and 2:2, d 64
 *      and 128, G 64 and 128, top-k, top-p and mixed budgets: the same
 *      patterns (read back), the same pairs, and bitwise the same forward
 *      (o, lse) and deterministic backward (dq, dk, dv), for kernel
 *      variants 3 (Hopper), 2 and 0 (whose bar kernels see the padded tiles);
 *      every case with top-p heads again with top_p_forced = 1;
 *  (b) the real Qwen2.5-3B budgets of layers 3, 15 and 31 on structured
 *      inputs of 16384 tokens, one sequence and a packed batch; top-p 0.95
 *      with caps of the whole sequence (20011 and 3001 + 9000 tokens: walks
 *      through several of the device selection's 8192-rank chunks), with and
 *      without top_p_forced;
 *  (c) the host does not wait: behind a dense forward queued first, the
 *      estimated plan of a top-k batch returns in under a quarter of that
 *      forward's synchronous time (a stream-ordered allocator on the
 *      context's stream);
 *  (d) a plan used with other kv heads than it was built for is refused.
 * MTRAIN_TEST_QUICK=1 (under compute-sanitizer): three random cases only.
 * Skipped (exit 77) without a CUDA device. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

#define CHECK_OK(call)                                                                             \
  do {                                                                                             \
    const mtrain_status_t st_ = (call);                                                            \
    if (st_) fail_msg("%s: %s (%s)", #call, mtrain_status_name(st_), mtrain_last_error());         \
  } while (0)

static int have_gpu, quick;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A stream-ordered allocator on one stream (the user pointer). */
static void *alloc_on_stream(size_t bytes, void *user) {
  void *p = NULL;
  return cudaMallocAsync(&p, bytes, *(cudaStream_t *)user) == cudaSuccess ? p : NULL;
}
static void free_on_stream(void *p, size_t bytes, void *user) {
  (void)bytes;
  cudaFreeAsync(p, *(cudaStream_t *)user);
}

static cudaStream_t stream;

static mtrain_context_t *make_context(int32_t G, int variant) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = G;
  cfg.deterministic = 1;
  mtrain_context_t *ctx = NULL;
  CHECK_OK(mtrain_context_create(&cfg, NULL, &ctx));
  CHECK_OK(mtrain_cuda_set_stream(ctx, stream));
  CHECK_OK(mtrain_cuda_set_async(ctx, 1));
  CHECK_OK(mtrain_cuda_set_variant(ctx, (mtrain_cuda_variant_t)variant));
  mtrain_allocator_t a = {alloc_on_stream, free_on_stream, &stream};
  CHECK_OK(mtrain_context_set_allocator(ctx, &a));
  return ctx;
}

/* One batch on the device (bf16 q, k, v, dout; outputs). */
typedef struct batch {
  int32_t count, hq, hkv, d;
  int64_t offsets[8], T;
  int32_t top_p_forced; /* the estimate's option (0 unless a test sets it) */
  void *q, *k, *v, *dout, *o, *lse, *dq, *dk, *dv;
  size_t bq, bk, bl;
} batch_t;

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  CHECK_OK(mtrain_cuda_malloc(bytes, &p));
  return p;
}

static void *to_device(const void *h, size_t bytes) {
  void *d = dev_alloc(bytes);
  CHECK_OK(mtrain_cuda_memcpy_to_device(d, h, bytes));
  return d;
}

/* structured: q/k with vertical-slash structure per sequence (mtrain_inputs.h);
 * else N(0, 1) */
static void batch_init(batch_t *b, int32_t hq, int32_t hkv, int32_t d, uint64_t seed,
                       int structured) {
  b->hq = hq, b->hkv = hkv, b->d = d, b->T = b->offsets[b->count];
  const int64_t T = b->T;
  b->bq = 2 * (size_t)(T * hq * d), b->bk = 2 * (size_t)(T * hkv * d);
  b->bl = sizeof(float) * (size_t)(T * hq);
  uint16_t *hq_ = malloc(b->bq), *hk_ = malloc(b->bk), *hv_ = malloc(b->bk), *ho = malloc(b->bq);
  for (int32_t s = 0; s < b->count; s++) {
    const int64_t n = b->offsets[s + 1] - b->offsets[s], o = b->offsets[s];
    mtrain_tensor_t q = mtrain_tensor_3d(hq_ + o * hq * d, MTRAIN_BF16, n, hq, d);
    mtrain_tensor_t k = mtrain_tensor_3d(hk_ + o * hkv * d, MTRAIN_BF16, n, hkv, d);
    mtrain_tensor_t v = mtrain_tensor_3d(hv_ + o * hkv * d, MTRAIN_BF16, n, hkv, d);
    if (structured) {
      mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
      so.seed = seed + (uint64_t)s;
      CHECK_OK(mtrain_generate_structured(&so, &q, &k, &v));
    } else {
      CHECK_OK(mtrain_generate_normal(seed + 3 * (uint64_t)s, 1.0, &q));
      CHECK_OK(mtrain_generate_normal(seed + 3 * (uint64_t)s + 1, 1.0, &k));
      CHECK_OK(mtrain_generate_normal(seed + 3 * (uint64_t)s + 2, 1.0, &v));
    }
  }
  mtrain_tensor_t dout = mtrain_tensor_3d(ho, MTRAIN_BF16, T, hq, d);
  CHECK_OK(mtrain_generate_normal(seed ^ 0xd07u, 1.0, &dout));
  b->q = to_device(hq_, b->bq), b->k = to_device(hk_, b->bk), b->v = to_device(hv_, b->bk);
  b->dout = to_device(ho, b->bq);
  free(hq_), free(hk_), free(hv_), free(ho);
  b->o = dev_alloc(b->bq), b->lse = dev_alloc(b->bl);
  b->dq = dev_alloc(b->bq), b->dk = dev_alloc(b->bk), b->dv = dev_alloc(b->bk);
}

static void batch_free(batch_t *b) {
  void *all[9] = {b->q, b->k, b->v, b->dout, b->o, b->lse, b->dq, b->dk, b->dv};
  for (int i = 0; i < 9; i++) mtrain_cuda_free(all[i]);
}

static mtrain_plan_t *estimated(mtrain_context_t *ctx, const batch_t *b,
                                const mtrain_head_budget_t *budgets, int on_host) {
  if (on_host)
    setenv("MTRAIN_PLAN_ON_HOST", "1", 1);
  else
    unsetenv("MTRAIN_PLAN_ON_HOST");
  const mtrain_seqs_t seqs = {b->count, (int64_t *)b->offsets};
  mtrain_tensor_t q = mtrain_tensor_3d(b->q, MTRAIN_BF16, b->T, b->hq, b->d);
  mtrain_tensor_t k = mtrain_tensor_3d(b->k, MTRAIN_BF16, b->T, b->hkv, b->d);
  mtrain_estimate_options_t opt = MTRAIN_ESTIMATE_INIT;
  opt.top_p_forced = b->top_p_forced;
  mtrain_plan_t *plan = NULL;
  CHECK_OK(mtrain_plan_create_estimated(ctx, &seqs, &q, &k, budgets, &opt, &plan));
  unsetenv("MTRAIN_PLAN_ON_HOST");
  assert_int_equal(mtrain_plan_on_device(plan), !on_host);
  return plan;
}

/* Forward and deterministic backward; returns [o | lse | dq | dk | dv] on the host. */
static unsigned char *run(mtrain_context_t *ctx, const mtrain_plan_t *plan, const batch_t *b) {
  mtrain_tensor_t q = mtrain_tensor_3d(b->q, MTRAIN_BF16, b->T, b->hq, b->d);
  mtrain_tensor_t k = mtrain_tensor_3d(b->k, MTRAIN_BF16, b->T, b->hkv, b->d);
  mtrain_tensor_t v = mtrain_tensor_3d(b->v, MTRAIN_BF16, b->T, b->hkv, b->d);
  mtrain_tensor_t o = mtrain_tensor_3d(b->o, MTRAIN_BF16, b->T, b->hq, b->d);
  mtrain_tensor_t lse = mtrain_tensor_2d(b->lse, MTRAIN_F32, b->T, b->hq);
  mtrain_tensor_t dout = mtrain_tensor_3d(b->dout, MTRAIN_BF16, b->T, b->hq, b->d);
  mtrain_tensor_t dq = mtrain_tensor_3d(b->dq, MTRAIN_BF16, b->T, b->hq, b->d);
  mtrain_tensor_t dk = mtrain_tensor_3d(b->dk, MTRAIN_BF16, b->T, b->hkv, b->d);
  mtrain_tensor_t dv = mtrain_tensor_3d(b->dv, MTRAIN_BF16, b->T, b->hkv, b->d);
  CHECK_OK(mtrain_attention_forward(ctx, plan, &q, &k, &v, &o, &lse));
  CHECK_OK(mtrain_attention_backward(ctx, plan, &q, &k, &v, &o, &lse, &dout, &dq, &dk, &dv));
  CHECK_OK(mtrain_context_check_deferred(ctx));
  const size_t n = 2 * b->bq + b->bl + 2 * b->bk;
  unsigned char *h = malloc(n), *w = h;
  const void *src[5] = {b->o, b->lse, b->dq, b->dk, b->dv};
  const size_t bytes[5] = {b->bq, b->bl, b->bq, b->bk, b->bk};
  for (int i = 0; i < 5; i++) {
    CHECK_OK(mtrain_cuda_memcpy_to_host(w, src[i], bytes[i]));
    w += bytes[i];
  }
  return h;
}

/* The device plan against the host plan of the same batch and budgets. */
static void compare(const char *what, uint64_t seed, mtrain_context_t *ctx, const batch_t *b,
                    const mtrain_head_budget_t *budgets) {
  mtrain_plan_t *dev = estimated(ctx, b, budgets, 0);
  mtrain_plan_t *host = estimated(ctx, b, budgets, 1);
  unsigned char *got = run(ctx, dev, b), *want = run(ctx, host, b);
  const size_t n = 2 * b->bq + b->bl + 2 * b->bk;
  for (size_t i = 0; i < n; i++)
    if (got[i] != want[i])
      fail_msg("%s seed %llu: byte %zu of %zu of [o | lse | dq | dk | dv] differs between the "
               "device plan and the host plan",
               what, (unsigned long long)seed, i, n);
  free(got);
  free(want);
  assert_int_equal(mtrain_plan_computed_pairs(dev), mtrain_plan_computed_pairs(host));
  for (int32_t s = 0; s < b->count; s++) {
    const mtrain_pattern_t *pd = NULL, *ph = NULL;
    CHECK_OK(mtrain_plan_pattern(dev, s, &pd));
    CHECK_OK(mtrain_plan_pattern(host, s, &ph));
    int32_t head = -1;
    if (!ts_patterns_equal(pd, ph, b->hq, &head))
      fail_msg("%s seed %llu: sequence %d head %d: the device plan's pattern differs", what,
               (unsigned long long)seed, s, head);
  }
  mtrain_plan_destroy(dev);
  mtrain_plan_destroy(host);
}

static mtrain_head_budget_t budget_of(int style, int32_t h, int64_t N) {
  mtrain_head_budget_t x = {0};
  if (style == 1 || (style == 2 && h % 2)) {
    x.kind = MTRAIN_BUDGET_TOP_P;
    x.p_v = 0.6 + 0.1 * (h % 3);
    x.p_s = 0.9;
    x.cap_v = 64 + 37 * h;
    x.cap_s = N < 4000 ? N : 4000;
  } else {
    x.kind = MTRAIN_BUDGET_TOP_K;
    x.v_size = 40 + 29 * h;
    x.s_size = 60 + 41 * h;
  }
  return x;
}

static void test_random_batches(void **state) {
  (void)state;
  if (!have_gpu) skip();
  const uint64_t seed0 = ts_seed(5151);
  const int variants[3] = {3, 2, 0};
  const int cases = quick ? 3 : 12;
  for (int i = 0; i < cases; i++) {
    const uint64_t seed = seed0 + (uint64_t)i;
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    const int32_t G = ts_rng_below(&rng, 2) ? 128 : 64, d = ts_rng_below(&rng, 2) ? 128 : 64;
    const int32_t heads[3][2] = {{8, 2}, {4, 1}, {2, 2}};
    const int hs = (int)ts_rng_below(&rng, 3);
    const int style = (int)ts_rng_below(&rng, 3), variant = variants[i % 3];
    batch_t b;
    memset(&b, 0, sizeof b);
    b.count = 1 + (int32_t)ts_rng_below(&rng, 6);
    for (int32_t s = 0; s < b.count; s++) {
      const int pick = (int)ts_rng_below(&rng, 3);
      const int64_t len = pick == 0   ? 1 + ts_rng_below(&rng, G)
                          : pick == 1 ? G * (1 + ts_rng_below(&rng, 12))
                                      : 1 + ts_rng_below(&rng, 3000);
      b.offsets[s + 1] = b.offsets[s] + len;
    }
    printf("case %d seed %llu: variant %d, %d sequences (%lld tokens), G %d, %d:%d heads, d %d, "
           "budgets %d\n",
           i, (unsigned long long)seed, variant, b.count, (long long)b.offsets[b.count], G,
           heads[hs][0], heads[hs][1], d, style);
    batch_init(&b, heads[hs][0], heads[hs][1], d, seed, 0);
    mtrain_head_budget_t budgets[8];
    for (int32_t h = 0; h < b.hq; h++) budgets[h] = budget_of(style, h, b.T);
    mtrain_context_t *ctx = make_context(G, variant);
    compare("random", seed, ctx, &b, budgets);
    if (style != 0) { /* top-p heads: again with the sinks and the window forced */
      b.top_p_forced = 1;
      compare("random, top_p_forced", seed, ctx, &b, budgets);
      b.top_p_forced = 0;
    }
    mtrain_context_destroy(ctx);
    batch_free(&b);
  }
}

static void test_real_budgets(void **state) {
  (void)state;
  if (!have_gpu || quick) skip();
  mtrain_budgets_t *file = NULL;
  CHECK_OK(
      mtrain_budgets_read(ts_data_path("Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"), &file));
  const int32_t layers[3] = {3, 15, 31};
  for (int li = 0; li < 3; li++)
    for (int packed = 0; packed <= 1; packed++) {
      batch_t b;
      memset(&b, 0, sizeof b);
      b.count = packed ? 3 : 1;
      const int64_t lens[3] = {16384, 9000, 4321};
      for (int32_t s = 0; s < b.count; s++) b.offsets[s + 1] = b.offsets[s] + lens[s];
      const uint64_t seed = 900 + (uint64_t)(10 * li + packed);
      printf("Qwen2.5-3B layer %d, %d sequence(s), seed %llu\n", layers[li], b.count,
             (unsigned long long)seed);
      batch_init(&b, 16, 2, 128, seed, 1);
      mtrain_head_budget_t budgets[16];
      for (int32_t h = 0; h < 16; h++)
        CHECK_OK(mtrain_budgets_get(file, layers[li], h, &budgets[h]));
      mtrain_context_t *ctx = make_context(128, 3);
      compare("Qwen2.5-3B", seed, ctx, &b, budgets);
      mtrain_context_destroy(ctx);
      batch_free(&b);
    }
  mtrain_budgets_destroy(file);
}

/* Top-p heads whose caps are the whole sequence: the device selection walks
 * their ranking through several chunks of 8192 ranks (a plan on the device,
 * equal to the host plan), with and without the forced sinks and window. */
static void test_wide_top_p(void **state) {
  (void)state;
  if (!have_gpu || quick) skip();
  for (int packed = 0; packed <= 1; packed++) {
    batch_t b;
    memset(&b, 0, sizeof b);
    b.count = packed ? 2 : 1;
    const int64_t lens[2] = {packed ? 3001 : 20011, 9000};
    for (int32_t s = 0; s < b.count; s++) b.offsets[s + 1] = b.offsets[s] + lens[s];
    const uint64_t seed = 7300 + (uint64_t)packed;
    printf("top-p 0.95, caps of the whole sequence, %d sequence(s) (%lld tokens), seed %llu\n",
           b.count, (long long)b.offsets[b.count], (unsigned long long)seed);
    batch_init(&b, 8, 2, 64, seed, 1);
    mtrain_head_budget_t budgets[8];
    for (int32_t h = 0; h < 8; h++) {
      memset(&budgets[h], 0, sizeof budgets[h]);
      budgets[h].kind = MTRAIN_BUDGET_TOP_P;
      budgets[h].p_v = h == 0 ? 1.0 : 0.95;
      budgets[h].p_s = 0.95;
      budgets[h].cap_v = budgets[h].cap_s = b.T;
    }
    mtrain_context_t *ctx = make_context(128, 3);
    compare("top-p, whole-sequence caps", seed, ctx, &b, budgets);
    b.top_p_forced = 1;
    compare("top-p, whole-sequence caps, top_p_forced", seed, ctx, &b, budgets);
    mtrain_context_destroy(ctx);
    batch_free(&b);
  }
}

static void test_host_does_not_wait(void **state) {
  (void)state;
  if (!have_gpu || quick) skip();
  batch_t big, small;
  memset(&big, 0, sizeof big);
  memset(&small, 0, sizeof small);
  big.count = 1, big.offsets[1] = 32768;
  small.count = 4;
  for (int32_t s = 0; s < 4; s++) small.offsets[s + 1] = small.offsets[s] + 4096 + 77 * s;
  batch_init(&big, 16, 2, 128, 31, 0);
  batch_init(&small, 16, 2, 128, 32, 0);
  mtrain_context_t *ctx = make_context(128, 3);
  mtrain_pattern_t *dense = NULL;
  CHECK_OK(mtrain_pattern_create_dense(big.T, 16, 128, &dense));
  const mtrain_pattern_t *pats[1] = {dense};
  mtrain_plan_t *dplan = NULL;
  CHECK_OK(mtrain_plan_create(ctx, NULL, pats, &dplan));
  mtrain_tensor_t q = mtrain_tensor_3d(big.q, MTRAIN_BF16, big.T, 16, 128);
  mtrain_tensor_t k = mtrain_tensor_3d(big.k, MTRAIN_BF16, big.T, 2, 128);
  mtrain_tensor_t v = mtrain_tensor_3d(big.v, MTRAIN_BF16, big.T, 2, 128);
  mtrain_tensor_t o = mtrain_tensor_3d(big.o, MTRAIN_BF16, big.T, 16, 128);
  mtrain_tensor_t lse = mtrain_tensor_2d(big.lse, MTRAIN_F32, big.T, 16);
  mtrain_head_budget_t budgets[16];
  for (int32_t h = 0; h < 16; h++) budgets[h] = budget_of(0, h, small.T);
  /* warm: the kernels loaded, the allocator's pool grown */
  for (int w = 0; w < 2; w++) {
    CHECK_OK(mtrain_attention_forward(ctx, dplan, &q, &k, &v, &o, &lse));
    mtrain_plan_destroy(estimated(ctx, &small, budgets, 0));
  }
  CHECK_OK(mtrain_cuda_device_synchronize());
  double t0 = now();
  CHECK_OK(mtrain_attention_forward(ctx, dplan, &q, &k, &v, &o, &lse));
  CHECK_OK(mtrain_cuda_device_synchronize());
  const double sync_fwd = now() - t0;
  CHECK_OK(mtrain_attention_forward(ctx, dplan, &q, &k, &v, &o, &lse));
  t0 = now();
  mtrain_plan_t *plan = estimated(ctx, &small, budgets, 0);
  const double queued = now() - t0;
  CHECK_OK(mtrain_cuda_device_synchronize());
  printf("dense forward of 32768 tokens: %.3f ms synchronous; the estimated plan of a top-k batch "
         "queued behind it: %.3f ms\n",
         1e3 * sync_fwd, 1e3 * queued);
  assert_true(queued < 0.25 * sync_fwd);
  /* (d) other kv heads than the plan's */
  mtrain_tensor_t sq = mtrain_tensor_3d(small.q, MTRAIN_BF16, small.T, 16, 128);
  mtrain_tensor_t so = mtrain_tensor_3d(small.o, MTRAIN_BF16, small.T, 16, 128);
  mtrain_tensor_t sl = mtrain_tensor_2d(small.lse, MTRAIN_F32, small.T, 16);
  mtrain_tensor_t k1 = mtrain_tensor_3d(small.k, MTRAIN_BF16, small.T, 1, 128);
  mtrain_tensor_t v1 = mtrain_tensor_3d(small.v, MTRAIN_BF16, small.T, 1, 128);
  TS_ASSERT_STATUS(mtrain_attention_forward(ctx, plan, &sq, &k1, &v1, &so, &sl),
                   MTRAIN_ERR_HEAD_MISMATCH, "built for 2 kv heads");
  mtrain_plan_destroy(plan);
  mtrain_plan_destroy(dplan);
  mtrain_pattern_destroy(dense);
  mtrain_context_destroy(ctx);
  batch_free(&big);
  batch_free(&small);
}

int main(void) {
  have_gpu = mtrain_cuda_device_count() > 0;
  const char *q = getenv("MTRAIN_TEST_QUICK");
  quick = q && q[0] == '1';
  if (!have_gpu) {
    printf("SKIPPED: no CUDA device is visible\n");
    return 77;
  }
  if (cudaStreamCreate(&stream) != cudaSuccess) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_batches),
      cmocka_unit_test(test_real_budgets),
      cmocka_unit_test(test_wide_top_p),
      cmocka_unit_test(test_host_does_not_wait),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
