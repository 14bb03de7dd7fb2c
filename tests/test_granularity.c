/* test_granularity.c: every granularity the configuration accepts is
 * computed correctly by every CPU backend, and the first one outside the
 * accepted range is refused with MTRAIN_ERR_INVALID_CONFIG naming it.
 *
 * The accepted range is [1, 2^20] (config.c) on both CPU backends: the
 * "cpu" backend splits a query block into row chunks and the causal
 * diagonal block into column tiles of its score tile (256), so no block size
 * reaches past its buffers. The sweep takes the range's edges (1 and 2^20),
 * the score tile's edges (255, 256, 257), values between (2, 300, 512,
 * 1000), forward and backward, against the fp64 dense-masked reference
 * (mtrain_cpu.h) for dense, random sparse (diagonals and verticals) and
 * block-mask patterns: "cpu" within SPEC.md's fp32 bound 1e-4 * max|ref|,
 * "cpu-ref" within 1e-12 * max|ref| (as test_gradcheck). The pattern
 * scores of the online estimate (the backends' pattern_scores slot) of
 * "cpu" are compared with "cpu-ref"'s at the same granularities. Before the
 * fix, G = 257 gave wrong outputs (the diagonal tile of G columns in a
 * 256-column score buffer) and G = 300 corrupted the heap. Seeds are printed;
 * MTRAIN_TEST_SEED overrides them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_backend.h"
#include "mtrain/mtrain_cpu.h"
#include "test_support.h"

enum { HQ = 4, HKV = 2, D = 32 };

static const int32_t kGranularities[] = {1, 2, 255, 256, 257, 300, 512, 1000, 1 << 20};

/* Tokens of the sequence for a granularity: several blocks and a partial
 * last block where the block is small, one block of more rows than the
 * score tile where it is not. */
static int64_t tokens_for(int32_t G) { return G == 1 ? 150 : G <= 512 ? 3 * G + 37 : 600; }

typedef struct problem {
  int64_t N;
  double *q, *k, *v, *dout;       /* fp32-exact values, as doubles */
  float *qf, *kf, *vf, *doutf;    /* the same in fp32 */
  double *o, *lse, *dq, *dk, *dv; /* the dense reference */
} problem_t;

static void problem_init(problem_t *p, const mtrain_pattern_t *pattern, int64_t N, uint64_t seed) {
  memset(p, 0, sizeof *p);
  p->N = N;
  const int64_t nq = N * HQ * D, nk = N * HKV * D;
  p->q = malloc(sizeof(double) * (size_t)nq);
  p->k = malloc(sizeof(double) * (size_t)nk);
  p->v = malloc(sizeof(double) * (size_t)nk);
  p->dout = malloc(sizeof(double) * (size_t)nq);
  p->qf = malloc(sizeof(float) * (size_t)nq);
  p->kf = malloc(sizeof(float) * (size_t)nk);
  p->vf = malloc(sizeof(float) * (size_t)nk);
  p->doutf = malloc(sizeof(float) * (size_t)nq);
  p->o = malloc(sizeof(double) * (size_t)nq);
  p->lse = malloc(sizeof(double) * (size_t)(N * HQ));
  p->dq = malloc(sizeof(double) * (size_t)nq);
  p->dk = malloc(sizeof(double) * (size_t)nk);
  p->dv = malloc(sizeof(double) * (size_t)nk);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  ts_fill_normal(&rng, p->qf, MTRAIN_F32, nq, 1.0, p->q);
  ts_fill_normal(&rng, p->kf, MTRAIN_F32, nk, 1.0, p->k);
  ts_fill_normal(&rng, p->vf, MTRAIN_F32, nk, 1.0, p->v);
  ts_fill_normal(&rng, p->doutf, MTRAIN_F32, nq, 1.0, p->dout);
  assert_int_equal(
      mtrain_cpu_dense_reference_forward(pattern, HKV, D, 0.0, p->q, p->k, p->v, p->o, p->lse),
      MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cpu_dense_reference_backward(pattern, HKV, D, 0.0, p->q, p->k, p->v, p->o,
                                                       p->lse, p->dout, p->dq, p->dk, p->dv),
                   MTRAIN_SUCCESS);
}

static void problem_free(problem_t *p) {
  void *all[] = {p->q,     p->k, p->v,   p->dout, p->qf, p->kf, p->vf,
                 p->doutf, p->o, p->lse, p->dq,   p->dk, p->dv};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) free(all[i]);
}

/* max |got - want| / max |want| over count values (NaN: infinite). */
static double rel_err(const void *got, mtrain_dtype_t dtype, const double *want, int64_t count) {
  double *g = ts_to_double(got, dtype, count);
  const double err = ts_max_abs_diff(g, want, count), mag = ts_max_abs(want, count);
  free(g);
  return mag > 0 ? err / mag : err;
}

/* Runs forward and backward of `pattern` on `backend` (fp32 on "cpu", fp64
 * on "cpu-ref") and checks every output against the reference. */
static void run_case(const char *backend, const mtrain_pattern_t *pattern, const problem_t *p,
                     int32_t G, const char *kind, uint64_t seed) {
  const int is_ref = strcmp(backend, "cpu-ref") == 0;
  const mtrain_dtype_t dt = is_ref ? MTRAIN_F64 : MTRAIN_F32;
  const double tol = is_ref ? 1e-12 : 1e-4;
  const int64_t N = p->N, nq = N * HQ * D, nk = N * HKV * D;
  const size_t es = mtrain_dtype_size(dt);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  cfg.num_threads = 2;
  mtrain_context_t *ctx = NULL;
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &ctx);
  if (st) fail_msg("%s G=%d: context: %s", backend, G, mtrain_last_error());
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *pats[1] = {pattern};
  st = mtrain_plan_create(ctx, NULL, pats, &plan);
  if (st) fail_msg("%s G=%d: plan: %s", backend, G, mtrain_last_error());
  void *q = malloc(es * (size_t)nq), *k = malloc(es * (size_t)nk), *v = malloc(es * (size_t)nk);
  void *dout = malloc(es * (size_t)nq);
  mtrain_convert(p->qf, MTRAIN_F32, q, dt, nq);
  mtrain_convert(p->kf, MTRAIN_F32, k, dt, nk);
  mtrain_convert(p->vf, MTRAIN_F32, v, dt, nk);
  mtrain_convert(p->doutf, MTRAIN_F32, dout, dt, nq);
  /* outputs with guard bytes: a write past an end fails the case */
  ts_buf_t o = ts_buf_alloc(es * (size_t)nq), lse = ts_buf_alloc(es * (size_t)(N * HQ));
  ts_buf_t dq = ts_buf_alloc(es * (size_t)nq), dk = ts_buf_alloc(es * (size_t)nk),
           dv = ts_buf_alloc(es * (size_t)nk);
  mtrain_tensor_t tq = mtrain_tensor_3d(q, dt, N, HQ, D), tk = mtrain_tensor_3d(k, dt, N, HKV, D),
                  tv = mtrain_tensor_3d(v, dt, N, HKV, D),
                  tdo = mtrain_tensor_3d(dout, dt, N, HQ, D),
                  to = mtrain_tensor_3d(o.data, dt, N, HQ, D),
                  tl = mtrain_tensor_2d(lse.data, dt, N, HQ),
                  tdq = mtrain_tensor_3d(dq.data, dt, N, HQ, D),
                  tdk = mtrain_tensor_3d(dk.data, dt, N, HKV, D),
                  tdv = mtrain_tensor_3d(dv.data, dt, N, HKV, D);
  st = mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl);
  if (st) fail_msg("%s G=%d %s: forward: %s", backend, G, kind, mtrain_last_error());
  st = mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv);
  if (st) fail_msg("%s G=%d %s: backward: %s", backend, G, kind, mtrain_last_error());
  const ts_buf_t *bufs[5] = {&o, &lse, &dq, &dk, &dv};
  const char *names[5] = {"o", "lse", "dq", "dk", "dv"};
  const double *want[5] = {p->o, p->lse, p->dq, p->dk, p->dv};
  const int64_t counts[5] = {nq, N * HQ, nq, nk, nk};
  double worst = 0.0;
  for (int t = 0; t < 5; t++) {
    if (!ts_buf_guards_ok(bufs[t]))
      fail_msg("%s G=%d %s seed %llu: %s written past its ends", backend, G, kind,
               (unsigned long long)seed, names[t]);
    const double e = rel_err(bufs[t]->data, dt, want[t], counts[t]), bound = tol;
    if (!(e <= bound))
      fail_msg("%s G=%d N=%lld %s seed %llu: max|%s - reference| = %.3g * max|reference|, "
               "bound %.0e",
               backend, G, (long long)N, kind, (unsigned long long)seed, names[t], e, bound);
    if (e / bound > worst) worst = e / bound;
  }
  print_message("%-7s G=%-7d N=%-5lld %-13s seed %llu: ok (worst err/bound %.3f)\n", backend, G,
                (long long)N, kind, (unsigned long long)seed, worst);
  for (int t = 0; t < 5; t++) ts_buf_free((ts_buf_t *)bufs[t]);
  free(q), free(k), free(v), free(dout);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
}

static void test_accepted_granularities(void **state) {
  (void)state;
  const ts_pattern_kind_t kinds[] = {TS_PATTERN_DENSE, TS_PATTERN_RANDOM_SPARSE,
                                     TS_PATTERN_BLOCK_MASK};
  for (size_t gi = 0; gi < sizeof kGranularities / sizeof *kGranularities; gi++) {
    const int32_t G = kGranularities[gi];
    const int64_t N = tokens_for(G);
    for (size_t ki = 0; ki < sizeof kinds / sizeof *kinds; ki++) {
      const uint64_t seed = ts_seed(1000 + 10 * gi + ki);
      mtrain_pattern_t *pattern = ts_make_pattern(kinds[ki], N, HQ, G, seed);
      problem_t p;
      problem_init(&p, pattern, N, seed + 1);
      run_case("cpu", pattern, &p, G, ts_pattern_kind_name(kinds[ki]), seed);
      run_case("cpu-ref", pattern, &p, G, ts_pattern_kind_name(kinds[ki]), seed);
      problem_free(&p);
      mtrain_pattern_destroy(pattern);
    }
  }
}

/* The first granularity outside the accepted range, on each side, is
 * refused by context creation, naming the value and the bound. */
static void test_refused_granularities(void **state) {
  (void)state;
  const char *backends[] = {"cpu", "cpu-ref"};
  for (int b = 0; b < 2; b++) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.backend = backends[b];
    mtrain_context_t *ctx = NULL;
    cfg.granularity = (1 << 20) + 1;
    TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                     "granularity 1048577");
    assert_non_null(strstr(mtrain_last_error(), "2^20"));
    assert_null(ctx);
    cfg.granularity = 0;
    TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                     "granularity 0");
    cfg.granularity = 1 << 20;
    assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
    mtrain_context_destroy(ctx);
  }
}

/* The pattern scores (SPEC.md section 2) of "cpu" against "cpu-ref", every
 * stage, at granularities around and far above the score tile. */
static void test_pattern_scores(void **state) {
  (void)state;
  const int32_t grans[] = {64, 255, 256, 257, 300, 1000, 1 << 20};
  for (size_t gi = 0; gi < sizeof grans / sizeof *grans; gi++) {
    const int32_t G = grans[gi], L = 64;
    const int64_t N = G <= 300 ? 3 * G + 37 : 1500;
    const uint64_t seed = ts_seed(2000 + gi);
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    const int64_t nk = N * HKV * D, nql = (int64_t)L * HQ * D;
    float *k = malloc(sizeof(float) * (size_t)nk), *ql = malloc(sizeof(float) * (size_t)nql);
    ts_fill_normal(&rng, k, MTRAIN_F32, nk, 1.0, NULL);
    ts_fill_normal(&rng, ql, MTRAIN_F32, nql, 1.0, NULL);
    const int64_t nb = (N + G - 1) / G;
    int64_t *kbg = malloc(sizeof(int64_t) * (size_t)nb);
    for (int64_t b = 0; b < nb; b++) kbg[b] = b;
    const int32_t slots = mtrain_scores_slots(L, G);
    uint8_t probs[HQ] = {1, 0, 1, 0};
    double *out[2][5]; /* per backend: row_max, row_sums, row_norm, col, diag */
    const int64_t sizes[5] = {(int64_t)HQ * L, (int64_t)HQ * L * nb, (int64_t)HQ * L,
                              (int64_t)HQ * N, (int64_t)HQ * N * slots};
    const char *names[2] = {"cpu-ref", "cpu"};
    for (int b = 0; b < 2; b++) {
      mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
      cfg.backend = names[b];
      cfg.granularity = G;
      cfg.num_threads = 2;
      mtrain_context_t *ctx = NULL;
      assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
      const mtrain_backend_ops_t *ops = mtrain_backend_find(names[b]);
      assert_non_null(ops);
      void *bs = mtrain_context_backend_state(ctx, ops);
      assert_non_null(bs);
      for (int x = 0; x < 5; x++) out[b][x] = calloc((size_t)sizes[x], sizeof(double));
      for (int64_t i = 0; i < sizes[0]; i++) out[b][0][i] = -INFINITY;
      mtrain_scores_args_t a = {.stage = MTRAIN_SCORES_ROW_MAX,
                                .seq_len = N,
                                .last_q = L,
                                .granularity = G,
                                .num_heads = HQ,
                                .num_kv_heads = HKV,
                                .head_dim = D,
                                .scale = 1.0 / sqrt((double)D),
                                .dtype = MTRAIN_F32,
                                .q_dtype = MTRAIN_F32,
                                .q_last = ql,
                                .k = k,
                                .k_tokens = N,
                                .num_k_blocks = (int32_t)nb,
                                .k_block_global = kbg,
                                .probs = probs};
      a.row_out = out[b][0];
      assert_int_equal(ops->pattern_scores(bs, &a), MTRAIN_SUCCESS);
      a.stage = MTRAIN_SCORES_ROW_BLOCK_SUMS;
      a.row_max = out[b][0];
      a.row_out = out[b][1];
      assert_int_equal(ops->pattern_scores(bs, &a), MTRAIN_SUCCESS);
      for (int64_t r = 0; r < (int64_t)HQ * L; r++)
        for (int64_t j = 0; j < nb; j++) out[b][2][r] += out[b][1][r * nb + j];
      a.stage = MTRAIN_SCORES_SUMS;
      a.row_norm = out[b][2];
      a.row_out = NULL;
      a.col_out = out[b][3];
      a.diag_out = out[b][4];
      assert_int_equal(ops->pattern_scores(bs, &a), MTRAIN_SUCCESS);
      mtrain_context_destroy(ctx);
    }
    const char *what[5] = {"row max", "row block sums", "row norms", "column sums",
                           "diagonal sums"};
    for (int x = 0; x < 5; x++) {
      const double e = ts_max_abs_diff(out[1][x], out[0][x], sizes[x]);
      const double mag = ts_max_abs(out[0][x], sizes[x]);
      if (!(e <= 1e-4 * mag))
        fail_msg("pattern scores G=%d N=%lld seed %llu: %s differ by %.3g (max %.3g)", G,
                 (long long)N, (unsigned long long)seed, what[x], e, mag);
    }
    print_message("pattern scores G=%-7d N=%-5lld seed %llu: cpu = cpu-ref within 1e-4\n", G,
                  (long long)N, (unsigned long long)seed);
    for (int b = 0; b < 2; b++)
      for (int x = 0; x < 5; x++) free(out[b][x]);
    free(k), free(ql), free(kbg);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_refused_granularities),
      cmocka_unit_test(test_accepted_granularities),
      cmocka_unit_test(test_pattern_scores),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
