/* test_cuda_select.c: the vertical-slash selection on the GPU (the "cuda"
 * backend's pattern_select slot) against the host selection of the same
 * scores: on one cuda context, mtrain_pattern_estimate selects on the device
 * and, with MTRAIN_HOST_SELECT=1, on the host; the two patterns must be
 * bitwise equal. Random and structured inputs (printed seeds), GQA, head dims
 * 64 and 128, lengths that are not multiples of the granularity, bf16, fp16
 * and fp32, random top-k budgets (some beyond the candidates), the real
 * budget files (Qwen2.5-3B static and top-p, Llama-3.1-8B static), and
 * top-p caps beyond the device's 8192-rank sort (up to the whole sequence of
 * 32K tokens: the walk goes through chunks of 8192 ranks). Which path ran is checked through the
 * estimate's timings (the device path copies no scores). Packed batches
 * (mtrain_pattern_estimate_batch): each document's pattern equals its own estimate and the host
 * selection, timed against one call per document. Top-p with the sinks and the window forced
 * (top_p_forced = 1): random and structured inputs, the real top-p budget files, sinks beyond the
 * candidates, a window beyond N, caps below the forced prefixes, a packed batch. Last: both paths
 * timed at 131072 tokens. Skipped (exit 77) without a CUDA device. */
#define _POSIX_C_SOURCE 200809L /* setenv, clock_gettime */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "core/runtime/select.h"
#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

static int have_gpu;

#define CHECK_OK(expr)                                                                             \
  do {                                                                                             \
    const mtrain_status_t st_ = (expr);                                                            \
    if (st_) fail_msg("%s: %s (%s)", #expr, mtrain_status_name(st_), mtrain_last_error());         \
  } while (0)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One estimate problem: q, k on the device and its budgets. */
typedef struct problem {
  int64_t n;
  int32_t hq, hkv, d, g;
  mtrain_dtype_t dtype;
  void *q, *k;
  mtrain_head_budget_t *budgets;
  mtrain_estimate_options_t opt; /* MTRAIN_ESTIMATE_INIT unless a test sets it */
} problem_t;

static void *to_device(const void *host, size_t bytes) {
  void *d = NULL;
  CHECK_OK(mtrain_cuda_malloc(bytes, &d));
  CHECK_OK(mtrain_cuda_memcpy_to_device(d, host, bytes));
  return d;
}

/* Inputs: structured (RoPE'd, vertical-slash structure) or normal noise. */
static void problem_init(problem_t *p, int64_t n, int32_t hq, int32_t hkv, int32_t d, int32_t g,
                         mtrain_dtype_t dtype, int structured, uint64_t seed) {
  memset(p, 0, sizeof *p);
  p->n = n, p->hq = hq, p->hkv = hkv, p->d = d, p->g = g, p->dtype = dtype;
  p->opt = (mtrain_estimate_options_t)MTRAIN_ESTIMATE_INIT;
  const size_t es = mtrain_dtype_size(dtype);
  const size_t bq = (size_t)n * hq * d * es, bk = (size_t)n * hkv * d * es;
  void *q = malloc(bq), *k = malloc(bk), *v = malloc(bk);
  assert_true(q && k && v);
  mtrain_tensor_t tq = mtrain_tensor_3d(q, dtype, n, hq, d);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, dtype, n, hkv, d);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, dtype, n, hkv, d);
  if (structured) {
    mtrain_structured_options_t o = MTRAIN_STRUCTURED_INIT;
    o.seed = seed;
    CHECK_OK(mtrain_generate_structured(&o, &tq, &tk, &tv));
  } else {
    CHECK_OK(mtrain_generate_normal(seed, 1.0, &tq));
    CHECK_OK(mtrain_generate_normal(seed + 1, 1.0, &tk));
  }
  p->q = to_device(q, bq);
  p->k = to_device(k, bk);
  free(q), free(k), free(v);
  p->budgets = calloc((size_t)hq, sizeof *p->budgets);
  assert_non_null(p->budgets);
}

static void problem_free(problem_t *p) {
  mtrain_cuda_free(p->q);
  mtrain_cuda_free(p->k);
  free(p->budgets);
}

static void budgets_from_file(problem_t *p, const char *file, int32_t layer) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", MTRAIN_PATTERN_DATA_DIR, file);
  mtrain_budgets_t *b = NULL;
  CHECK_OK(mtrain_budgets_read(path, &b));
  assert_int_equal(mtrain_budgets_num_heads(b, layer), p->hq);
  for (int32_t h = 0; h < p->hq; h++) CHECK_OK(mtrain_budgets_get(b, layer, h, &p->budgets[h]));
  mtrain_budgets_destroy(b);
}

static mtrain_context_t *cuda_context(int32_t g) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = g;
  mtrain_context_t *ctx = NULL;
  CHECK_OK(mtrain_context_create(&cfg, NULL, &ctx));
  return ctx;
}

/* One estimate on ctx; host_select picks the path; *copies gets the time the
 * estimate spent copying scores to the host (0 on the device path). */
static mtrain_pattern_t *estimate(mtrain_context_t *ctx, const problem_t *p, int host_select,
                                  double *seconds, double *copies) {
  if (host_select)
    setenv("MTRAIN_HOST_SELECT", "1", 1);
  else
    unsetenv("MTRAIN_HOST_SELECT");
  const mtrain_tensor_t tq = mtrain_tensor_3d(p->q, p->dtype, p->n, p->hq, p->d);
  const mtrain_tensor_t tk = mtrain_tensor_3d(p->k, p->dtype, p->n, p->hkv, p->d);
  mtrain_pattern_t *pat = NULL;
  const double t0 = now();
  CHECK_OK(mtrain_pattern_estimate(ctx, &tq, &tk, p->budgets, &p->opt, &pat));
  if (seconds) *seconds = now() - t0;
  if (copies) *copies = mtrain_estimate_last_times().copies;
  unsetenv("MTRAIN_HOST_SELECT");
  return pat;
}

/* Device and host selections of p: equal; `device_expected` says whether the
 * backend should have selected (0: it declines these budgets). */
static void check_equal(const char *name, const problem_t *p, int device_expected) {
  mtrain_context_t *ctx = cuda_context(p->g);
  double t_dev, t_host, c_dev, c_host;
  mtrain_pattern_t *dev = estimate(ctx, p, 0, &t_dev, &c_dev);
  mtrain_pattern_t *host = estimate(ctx, p, 1, &t_host, &c_host);
  int32_t head = -1;
  const int equal = ts_patterns_equal(dev, host, p->hq, &head);
  print_message("%-44s N %6lld %2d:%d d %3d G %3d %s: %s (device path %s; %.1f ms vs host %.1f "
                "ms)\n",
                name, (long long)p->n, p->hq, p->hkv, p->d, p->g, mtrain_dtype_name(p->dtype),
                equal ? "equal" : "DIFFERENT", c_dev == 0.0 ? "taken" : "not taken", 1e3 * t_dev,
                1e3 * t_host);
  if (!equal) fail_msg("%s: the device and host patterns differ at head %d", name, head);
  assert_true(c_host > 0.0); /* the host path copied the scores */
  if (device_expected)
    assert_true(c_dev == 0.0);
  else
    assert_true(c_dev > 0.0);
  mtrain_pattern_destroy(dev);
  mtrain_pattern_destroy(host);
  mtrain_context_destroy(ctx);
}

static void require_gpu(void) {
  if (have_gpu) return;
  print_message("SKIPPED: no CUDA device is visible\n");
  skip();
}

static void test_random_top_k(void **state) {
  (void)state;
  require_gpu();
  const uint64_t seed = 20261125;
  print_message("seed %llu\n", (unsigned long long)seed);
  srand((unsigned)seed);
  problem_t p;
  problem_init(&p, 3001, 8, 2, 64, 64, MTRAIN_BF16, 0, seed);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = MTRAIN_BUDGET_TOP_K;
    p.budgets[h].v_size = h == 0 ? 5000 : h == 1 ? 0 : 1 + rand() % 1500;
    p.budgets[h].s_size = h == 2 ? 4000 : 1 + rand() % 1500;
  }
  check_equal("random top-k (some beyond the candidates)", &p, 1);
  problem_free(&p);
  problem_init(&p, 5000, 4, 4, 128, 128, MTRAIN_F32, 0, seed + 7);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = h % 2 ? MTRAIN_BUDGET_TOP_P : MTRAIN_BUDGET_TOP_K;
    p.budgets[h].v_size = 1 + rand() % 500, p.budgets[h].s_size = 1 + rand() % 500;
    p.budgets[h].p_v = 0.5 + 0.1 * h, p.budgets[h].p_s = 0.9, p.budgets[h].cap_v = 1000 * (h + 1);
    p.budgets[h].cap_s = 3000;
  }
  check_equal("mixed top-k / top-p, fp32, MHA", &p, 1);
  problem_free(&p);
}

static void test_real_budgets(void **state) {
  (void)state;
  require_gpu();
  const struct {
    const char *file;
    int32_t layer, hq, hkv, d;
    int64_t n;
    mtrain_dtype_t dtype;
  } cases[] = {
      {"Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json", 3, 16, 2, 128, 20001, MTRAIN_BF16},
      {"Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json", 31, 16, 2, 64, 9000, MTRAIN_F16},
      {"Qwen2.5_3B_flex_0.90.json", 15, 16, 2, 128, 32768, MTRAIN_BF16},
      {"Qwen2.5_3B_flex_0.95.json", 0, 16, 2, 128, 12345, MTRAIN_F32},
      {"Llama_3.1_8B_Instruct_128k_kv_out_v32_fit_o_best_pattern.json", 0, 32, 8, 128, 8191,
       MTRAIN_BF16},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    problem_t p;
    const uint64_t seed = 1000 + i;
    print_message("seed %llu\n", (unsigned long long)seed);
    problem_init(&p, cases[i].n, cases[i].hq, cases[i].hkv, cases[i].d, 128, cases[i].dtype, 1,
                 seed);
    budgets_from_file(&p, cases[i].file, cases[i].layer);
    char name[160];
    snprintf(name, sizeof name, "%.28s layer %d", cases[i].file, cases[i].layer);
    check_equal(name, &p, 1);
    problem_free(&p);
  }
}

/* Top-p caps beyond the device's sort of 8192 ranks: the walk goes through
 * chunks of 8192 (still on the device, bitwise the host's): one head's cap of
 * 12000, then every cap the whole sequence of 32768 tokens (p 0.95 and 1.0:
 * walks through every chunk), with and without top_p_forced. */
static void test_cap_beyond_device_sort(void **state) {
  (void)state;
  require_gpu();
  problem_t p;
  problem_init(&p, 20000, 4, 2, 128, 128, MTRAIN_BF16, 1, 77);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = MTRAIN_BUDGET_TOP_P;
    p.budgets[h].p_v = p.budgets[h].p_s = 0.95;
    p.budgets[h].cap_v = 2000, p.budgets[h].cap_s = h == 3 ? 12000 : 2000;
  }
  check_equal("top-p cap 12000 (chunks of 8192)", &p, 1);
  problem_free(&p);
  problem_init(&p, 32768, 8, 2, 64, 128, MTRAIN_BF16, 1, 78);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = MTRAIN_BUDGET_TOP_P;
    p.budgets[h].p_v = h % 4 == 0 ? 1.0 : 0.95;
    p.budgets[h].p_s = h % 4 == 1 ? 1.0 : 0.9;
    p.budgets[h].cap_v = p.budgets[h].cap_s = 32768;
  }
  check_equal("top-p caps 32768 at 32K", &p, 1);
  p.opt.top_p_forced = 1;
  check_equal("top-p caps 32768 at 32K, top_p_forced", &p, 1);
  problem_free(&p);
}

/* A packed batch (mtrain_pattern_estimate_batch): every document's pattern
 * from the batch's one call equals the estimate of that document alone on
 * the device and the batch's host selection, bitwise, also with a top-p cap
 * beyond the device's 8192-rank sort (walked in chunks). Then the
 * batch's time against one estimate per document. */
static mtrain_pattern_t **estimate_packed(mtrain_context_t *ctx, const problem_t *p,
                                          const int64_t *offsets, int32_t count, int host_select,
                                          double *seconds, double *copies) {
  if (host_select)
    setenv("MTRAIN_HOST_SELECT", "1", 1);
  else
    unsetenv("MTRAIN_HOST_SELECT");
  const mtrain_tensor_t tq = mtrain_tensor_3d(p->q, p->dtype, p->n, p->hq, p->d);
  const mtrain_tensor_t tk = mtrain_tensor_3d(p->k, p->dtype, p->n, p->hkv, p->d);
  const mtrain_seqs_t seqs = {count, offsets};
  mtrain_pattern_t **out = calloc((size_t)count, sizeof *out);
  assert_non_null(out);
  const double t0 = now();
  CHECK_OK(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, p->budgets, &p->opt, out));
  if (seconds) *seconds = now() - t0;
  if (copies) *copies = mtrain_estimate_last_times().copies;
  unsetenv("MTRAIN_HOST_SELECT");
  return out;
}

/* One document of p alone: a problem that views rows [a, b) of p's tensors. */
static problem_t document(const problem_t *p, int64_t a, int64_t b) {
  problem_t d = *p;
  const size_t es = mtrain_dtype_size(p->dtype);
  d.n = b - a;
  d.q = (char *)p->q + (size_t)a * p->hq * p->d * es;
  d.k = (char *)p->k + (size_t)a * p->hkv * p->d * es;
  return d;
}

static void check_packed(const char *name, const problem_t *p, const int64_t *offsets,
                         int32_t count, int device_expected) {
  mtrain_context_t *ctx = cuda_context(p->g);
  double t_batch, c_batch, c_host;
  mtrain_pattern_t **dev = estimate_packed(ctx, p, offsets, count, 0, &t_batch, &c_batch);
  mtrain_pattern_t **host = estimate_packed(ctx, p, offsets, count, 1, NULL, &c_host);
  double t_each = 0.0;
  for (int32_t s = 0; s < count; s++) {
    const problem_t d = document(p, offsets[s], offsets[s + 1]);
    double t;
    mtrain_pattern_t *alone = estimate(ctx, &d, 0, &t, NULL);
    t_each += t;
    int32_t head = -1;
    if (!ts_patterns_equal(dev[s], alone, p->hq, &head))
      fail_msg("%s: document %d (%lld tokens): the batch's pattern differs from the document's "
               "own estimate at head %d",
               name, s, (long long)d.n, head);
    if (!ts_patterns_equal(dev[s], host[s], p->hq, &head))
      fail_msg("%s: document %d: the batch's device and host selections differ at head %d", name, s,
               head);
    mtrain_pattern_destroy(alone);
    mtrain_pattern_destroy(dev[s]);
    mtrain_pattern_destroy(host[s]);
  }
  print_message("%-40s %2d documents, %6lld tokens: equal (device path %s); batch %.1f ms, one "
                "call per document %.1f ms\n",
                name, count, (long long)p->n, c_batch == 0.0 ? "taken" : "not taken", 1e3 * t_batch,
                1e3 * t_each);
  assert_true(c_host > 0.0);
  if (device_expected)
    assert_true(c_batch == 0.0);
  else
    assert_true(c_batch > 0.0);
  free(dev);
  free(host);
  mtrain_context_destroy(ctx);
}

static void test_packed_batch(void **state) {
  (void)state;
  require_gpu();
  const int64_t lens[] = {1, 100, 128, 129, 4000, 16384, 777, 2, 9001};
  enum { COUNT = sizeof lens / sizeof lens[0] };
  int64_t offsets[COUNT + 1] = {0};
  for (int s = 0; s < COUNT; s++) offsets[s + 1] = offsets[s] + lens[s];
  const uint64_t seed = 4242;
  print_message("seed %llu\n", (unsigned long long)seed);
  problem_t p;
  problem_init(&p, offsets[COUNT], 16, 2, 128, 128, MTRAIN_BF16, 1, seed);
  budgets_from_file(&p, "Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json", 3);
  check_packed("packed, Qwen2.5-3B static layer 3", &p, offsets, COUNT, 1);
  budgets_from_file(&p, "Qwen2.5_3B_flex_0.90.json", 15);
  check_packed("packed, Qwen2.5-3B top-p 0.90 layer 15", &p, offsets, COUNT, 1);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = MTRAIN_BUDGET_TOP_P;
    p.budgets[h].p_v = p.budgets[h].p_s = 0.95;
    p.budgets[h].cap_v = 2000, p.budgets[h].cap_s = h == 5 ? 12000 : 2000;
  }
  check_packed("packed, top-p cap 12000 (chunks of 8192)", &p, offsets, COUNT, 1);
  problem_free(&p);
  /* many short documents, the training program's shapes (8:2 heads, d 64) */
  enum { MANY = 64 };
  int64_t many[MANY + 1] = {0};
  for (int s = 0; s < MANY; s++) many[s + 1] = many[s] + 512 + 37 * (s % 29);
  problem_init(&p, many[MANY], 8, 2, 64, 128, MTRAIN_BF16, 1, seed + 1);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = MTRAIN_BUDGET_TOP_K;
    p.budgets[h].v_size = 64 + 16 * h, p.budgets[h].s_size = 256;
  }
  check_packed("64 short documents, top-k", &p, many, MANY, 1);
  problem_free(&p);
}

/* The device's scores against the host's: top-k budgets rank the raw
 * logits, which the cuda scores compute in fp64 in the spec's order (no
 * fused multiply-add), so a packed batch's patterns on the device equal
 * cpu-ref's on the same values (bf16 inputs widened to fp32 exactly). */
static void test_scores_against_cpu_ref(void **state) {
  (void)state;
  require_gpu();
  const int64_t lens[] = {700, 1, 4096, 129, 2500};
  enum { COUNT = sizeof lens / sizeof lens[0] };
  int64_t offsets[COUNT + 1] = {0};
  for (int s = 0; s < COUNT; s++) offsets[s + 1] = offsets[s] + lens[s];
  const uint64_t seed = 777;
  print_message("seed %llu\n", (unsigned long long)seed);
  problem_t p;
  problem_init(&p, offsets[COUNT], 8, 2, 64, 64, MTRAIN_BF16, 1, seed);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = MTRAIN_BUDGET_TOP_K;
    p.budgets[h].v_size = 20 + 40 * h, p.budgets[h].s_size = 60 + 25 * h;
  }
  mtrain_context_t *dev_ctx = cuda_context(p.g);
  mtrain_pattern_t **dev = estimate_packed(dev_ctx, &p, offsets, COUNT, 0, NULL, NULL);
  /* the same values on the host, fp32 */
  const size_t nq = (size_t)p.n * p.hq * p.d, nk = (size_t)p.n * p.hkv * p.d;
  uint16_t *qb = malloc(2 * nq), *kb = malloc(2 * nk);
  float *qf = malloc(4 * nq), *kf = malloc(4 * nk);
  assert_true(qb && kb && qf && kf);
  CHECK_OK(mtrain_cuda_memcpy_to_host(qb, p.q, 2 * nq));
  CHECK_OK(mtrain_cuda_memcpy_to_host(kb, p.k, 2 * nk));
  CHECK_OK(mtrain_convert(qb, MTRAIN_BF16, qf, MTRAIN_F32, (int64_t)nq));
  CHECK_OK(mtrain_convert(kb, MTRAIN_BF16, kf, MTRAIN_F32, (int64_t)nk));
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cpu-ref";
  cfg.granularity = p.g;
  mtrain_context_t *host_ctx = NULL;
  CHECK_OK(mtrain_context_create(&cfg, NULL, &host_ctx));
  const mtrain_tensor_t tq = mtrain_tensor_3d(qf, MTRAIN_F32, p.n, p.hq, p.d);
  const mtrain_tensor_t tk = mtrain_tensor_3d(kf, MTRAIN_F32, p.n, p.hkv, p.d);
  const mtrain_estimate_options_t opt = MTRAIN_ESTIMATE_INIT;
  const mtrain_seqs_t seqs = {COUNT, offsets};
  mtrain_pattern_t *host[COUNT] = {0};
  CHECK_OK(mtrain_pattern_estimate_batch(host_ctx, &seqs, &tq, &tk, p.budgets, &opt, host));
  for (int s = 0; s < COUNT; s++) {
    int32_t head = -1;
    if (!ts_patterns_equal(dev[s], host[s], p.hq, &head))
      fail_msg("document %d (%lld tokens): the cuda estimate differs from cpu-ref's at head %d", s,
               (long long)lens[s], head);
    mtrain_pattern_destroy(dev[s]);
    mtrain_pattern_destroy(host[s]);
  }
  print_message("packed top-k estimate, %d documents, %lld tokens: cuda equals cpu-ref\n", COUNT,
                (long long)p.n);
  free(dev);
  free(qb), free(kb), free(qf), free(kf);
  mtrain_context_destroy(host_ctx);
  mtrain_context_destroy(dev_ctx);
  problem_free(&p);
}

/* Top-p with the sinks and the window forced (top_p_forced = 1): the device
 * selection equals the host's bitwise, and the top-p heads keep the forced
 * sinks (checked on the device's pattern). */
static void check_forced(const char *name, problem_t *p) {
  p->opt.top_p_forced = 1;
  check_equal(name, p, 1);
  mtrain_context_t *ctx = cuda_context(p->g);
  mtrain_pattern_t *pat = estimate(ctx, p, 0, NULL, NULL);
  const int64_t nv_cand = ((p->n - 1) / p->g) * p->g;
  for (int32_t h = 0; h < p->hq; h++) {
    const mtrain_head_budget_t *b = &p->budgets[h];
    if (b->kind != MTRAIN_BUDGET_TOP_P) continue;
    int64_t sinks = p->opt.num_sinks < nv_cand ? p->opt.num_sinks : nv_cand;
    sinks = sinks < b->cap_v ? sinks : b->cap_v;
    const int32_t *d;
    const int64_t *v;
    int32_t nd, nv;
    CHECK_OK(mtrain_pattern_get_head(pat, h, &d, &nd, &v, &nv));
    for (int64_t j = 0; j < sinks; j++)
      if (j >= nv || v[j] != j)
        fail_msg("%s: head %d: forced sink %lld is not a vertical", name, h, (long long)j);
  }
  mtrain_pattern_destroy(pat);
  mtrain_context_destroy(ctx);
  p->opt.top_p_forced = 0;
}

static void test_top_p_forced(void **state) {
  (void)state;
  require_gpu();
  const uint64_t seed = 20261129;
  print_message("seed %llu\n", (unsigned long long)seed);
  srand((unsigned)seed);
  problem_t p;
  /* random inputs, mixed heads, GQA, N not a multiple of G */
  problem_init(&p, 5001, 8, 2, 64, 64, MTRAIN_BF16, 0, seed);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = h % 4 == 3 ? MTRAIN_BUDGET_TOP_K : MTRAIN_BUDGET_TOP_P;
    p.budgets[h].v_size = 1 + rand() % 500, p.budgets[h].s_size = 1 + rand() % 500;
    p.budgets[h].p_v = 0.3 + 0.1 * h, p.budgets[h].p_s = 0.2 + 0.1 * h;
    p.budgets[h].cap_v = h == 0 ? 10 : 100 * h, p.budgets[h].cap_s = h == 1 ? 50 : 300 * h;
  }
  check_forced("top_p_forced, random, mixed (caps below the window)", &p);
  /* sinks beyond the candidates, a window beyond N */
  p.opt.num_sinks = 6000;
  p.opt.window = 6000;
  check_forced("top_p_forced, sinks and window beyond N", &p);
  problem_free(&p);
  /* structured inputs, the real top-p budgets */
  const char *files[2] = {"Qwen2.5_3B_flex_0.90.json", "Qwen2.5_3B_flex_0.95.json"};
  for (int f = 0; f < 2; f++) {
    problem_init(&p, 16384 + 77 * f, 16, 2, 128, 128, MTRAIN_BF16, 1, seed + 1 + (uint64_t)f);
    budgets_from_file(&p, files[f], 15);
    char name[96];
    snprintf(name, sizeof name, "top_p_forced, %s layer 15", files[f]);
    check_forced(name, &p);
    problem_free(&p);
  }
  /* the forced mass alone reaches p: small p, a long window */
  problem_init(&p, 3000, 4, 1, 64, 128, MTRAIN_F32, 1, seed + 5);
  for (int32_t h = 0; h < p.hq; h++) {
    p.budgets[h].kind = MTRAIN_BUDGET_TOP_P;
    p.budgets[h].p_v = p.budgets[h].p_s = 0.05;
    p.budgets[h].cap_v = p.budgets[h].cap_s = 3000;
  }
  p.opt.num_sinks = 500;
  p.opt.window = 2000;
  check_forced("top_p_forced, the forced mass alone above p", &p);
  problem_free(&p);
  /* a packed batch: each document as alone, device equal to host */
  const int64_t lens[] = {1, 100, 129, 4000, 777, 9001};
  enum { COUNT = sizeof lens / sizeof lens[0] };
  int64_t offsets[COUNT + 1] = {0};
  for (int s = 0; s < COUNT; s++) offsets[s + 1] = offsets[s] + lens[s];
  problem_init(&p, offsets[COUNT], 16, 2, 128, 128, MTRAIN_BF16, 1, seed + 6);
  budgets_from_file(&p, "Qwen2.5_3B_flex_0.90.json", 3);
  p.opt.top_p_forced = 1;
  check_packed("packed, top_p_forced, Qwen2.5-3B top-p 0.90", &p, offsets, COUNT, 1);
  problem_free(&p);
}

static void test_time_at_128k(void **state) {
  (void)state;
  require_gpu();
  const char *files[] = {"Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json",
                         "Qwen2.5_3B_flex_0.90.json"};
  for (int f = 0; f < 2; f++) {
    problem_t p;
    problem_init(&p, 131072, 16, 2, 128, 128, MTRAIN_BF16, 1, 5);
    budgets_from_file(&p, files[f], 15);
    mtrain_context_t *ctx = cuda_context(128);
    double best[2] = {1e9, 1e9};
    for (int r = 0; r < 4; r++)
      for (int host = 0; host < 2; host++) {
        double t;
        mtrain_pattern_t *pat = estimate(ctx, &p, host, &t, NULL);
        const mtrain_estimate_times_t lt = mtrain_estimate_last_times();
        if (r > 0 && t < best[host]) best[host] = t;
        if (r == 3)
          print_message("  %s select: estimate %.1f ms (stages %.1f, copies %.1f, select %.1f)\n",
                        host ? "host" : "device", 1e3 * t, 1e3 * lt.stages, 1e3 * lt.copies,
                        1e3 * lt.select);
        mtrain_pattern_destroy(pat);
      }
    print_message("%s layer 15, N 131072: estimate best of 3 warm: device select %.1f ms, host "
                  "select %.1f ms\n",
                  files[f], 1e3 * best[0], 1e3 * best[1]);
    mtrain_context_destroy(ctx);
    problem_free(&p);
  }
}

int main(void) {
  have_gpu = mtrain_cuda_device_count() > 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_top_k),           cmocka_unit_test(test_real_budgets),
      cmocka_unit_test(test_cap_beyond_device_sort), cmocka_unit_test(test_packed_batch),
      cmocka_unit_test(test_scores_against_cpu_ref), cmocka_unit_test(test_top_p_forced),
      cmocka_unit_test(test_time_at_128k),
  };
  const int failed = cmocka_run_group_tests(tests, NULL, NULL);
  if (failed) return 1;
  return have_gpu ? 0 : 77;
}
