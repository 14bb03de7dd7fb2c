/* test_sparse_balance.c: SparseBalance (docs/BALANCE.md, "SparseBalance"):
 * the pattern-free pair count equals mtrain_pattern_count_pairs (random
 * heads, real budgets under the position model); the predictor equals its
 * definition; the batching solver against a brute-force optimum on small
 * cases (never below it, never above Graham's LPT bound, the local search
 * fixing LPT's textbook miss), micro-batches and the length-sorted baseline;
 * the tuner keeps every level within its bounds, meets a feasible target,
 * falls back and reports an infeasible one, never lengthens the step, is
 * deterministic; the mass curve is a nondecreasing share in [0, 1]; the
 * calibration reader; bad inputs rejected with messages naming the
 * problem. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/balance/balance_internal.h"
#include "mtrain/mtrain_balance.h"
#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

static const char budgets_text[] =
    "[{\"0\": [\"vertical_and_slash\", 100, 50, 0.9], \"1\": [\"vertical_and_slash\", 10, 500, "
    "0.9]},\n {\"0\": [\"vertical_and_slash\", 3500, 100, 0.9], \"1\": "
    "[\"flex_vertical_and_slash\", [0.9, 40], [0.9, 2000], 0.0]}]\n";

static const double scales[] = {0.25, 0.5, 1.0, 2.0};
enum { K = 4, BASE = 2 };

static mtrain_balance_predictor_t *make_predictor(const char *text, int64_t context) {
  mtrain_budgets_t *b = NULL;
  assert_int_equal(mtrain_budgets_parse(text, "inline", &b), MTRAIN_SUCCESS);
  mtrain_position_model_t pm = MTRAIN_POSITION_MODEL_INIT;
  pm.budget_context = context;
  mtrain_balance_calibration_t cal = {1e-9, 1e-7, 1e-4, 1e12, 0};
  mtrain_balance_model_t model = MTRAIN_BALANCE_MODEL_INIT;
  mtrain_balance_predictor_t *p = NULL;
  assert_int_equal(mtrain_balance_predictor_create(b, scales, K, BASE, &pm, 128, &cal, &model, &p),
                   MTRAIN_SUCCESS);
  mtrain_budgets_destroy(b);
  return p;
}

/* ---- pair counts ------------------------------------------------------------------- */

static void test_pairs_random_heads(void **state) {
  (void)state;
  ts_rng_t rng;
  ts_rng_seed(&rng, ts_seed(11));
  for (int trial = 0; trial < 300; trial++) {
    const int32_t G = 1 + (int32_t)ts_rng_below(&rng, 16);
    const int64_t N = 1 + ts_rng_below(&rng, 40 * G);
    const int64_t nb = (N + G - 1) / G;
    int32_t diag[64];
    int64_t vert[256];
    int32_t nd = 0, nv = 0;
    for (int64_t t = 0; t < nb && nd < 64; t++)
      if (t == 0 || ts_rng_below(&rng, 4) == 0) diag[nd++] = (int32_t)t;
    for (int64_t j = 0; j < (nb - 1) * G && nv < 256; j++)
      if (ts_rng_below(&rng, 6) == 0) vert[nv++] = j;
    mtrain_pattern_t *p = NULL;
    assert_int_equal(mtrain_pattern_create(N, 1, G, &p), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_pattern_set_head(p, 0, diag, nd, vert, nv), MTRAIN_SUCCESS);
    const int64_t want = mtrain_pattern_count_pairs(p, 0);
    const int64_t got = mtrain_vs_pairs(diag, nd, vert, nv, N, G);
    if (got != want)
      fail_msg("trial %d: N=%lld G=%d: %lld pairs, count_pairs says %lld", trial, (long long)N, G,
               (long long)got, (long long)want);
    mtrain_pattern_destroy(p);
  }
}

/* The predictor's pairs are those of the position model's pattern (even spread). */
static void test_pairs_real_budgets(void **state) {
  (void)state;
  const char *path = ts_data_path("Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json");
  mtrain_budgets_t *b = NULL;
  assert_int_equal(mtrain_budgets_read(path, &b), MTRAIN_SUCCESS);
  mtrain_position_model_t pm = MTRAIN_POSITION_MODEL_INIT;
  mtrain_balance_calibration_t cal = {2e-9, 0, 0, 0, 0};
  mtrain_balance_model_t model = {0, 0, 0, 0, 0};
  mtrain_balance_predictor_t *pred = NULL;
  const double one[] = {1.0};
  assert_int_equal(mtrain_balance_predictor_create(b, one, 1, 0, &pm, 128, &cal, &model, &pred),
                   MTRAIN_SUCCESS);
  assert_int_equal(mtrain_balance_predictor_num_heads(pred), 36 * 16);
  const int64_t lengths[] = {1000, 4096, 20000};
  for (int a = 0; a < 3; a++) {
    double sum = 0;
    for (int32_t layer = 0; layer < 36; layer += 7) {
      mtrain_pattern_t *pat = NULL;
      assert_int_equal(mtrain_pattern_from_budgets(b, layer, lengths[a], 128, &pm, &pat),
                       MTRAIN_SUCCESS);
      for (int32_t h = 0; h < 16; h++) {
        int64_t got = -1;
        assert_int_equal(mtrain_balance_head_pairs(pred, lengths[a], layer * 16 + h, 0, &got),
                         MTRAIN_SUCCESS);
        assert_int_equal(got, mtrain_pattern_count_pairs(pat, h));
      }
      mtrain_pattern_destroy(pat);
    }
    /* predict = pair_s * sum of every head's pairs */
    for (int32_t layer = 0; layer < 36; layer++) {
      mtrain_pattern_t *pat = NULL;
      assert_int_equal(mtrain_pattern_from_budgets(b, layer, lengths[a], 128, &pm, &pat),
                       MTRAIN_SUCCESS);
      for (int32_t h = 0; h < 16; h++) sum += (double)mtrain_pattern_count_pairs(pat, h);
      mtrain_pattern_destroy(pat);
    }
    double s = 0;
    assert_int_equal(mtrain_balance_predict(pred, lengths[a], NULL, &s), MTRAIN_SUCCESS);
    assert_true(fabs(s - 2e-9 * sum) <= 1e-12 * s);
  }
  mtrain_balance_predictor_destroy(pred);
  mtrain_budgets_destroy(b);
}

static void test_predict_definition(void **state) {
  (void)state;
  mtrain_balance_predictor_t *p = make_predictor(budgets_text, 0);
  const int64_t N = 5000;
  int32_t lv[4] = {0, 3, 1, 2};
  double pairs = 0;
  for (int32_t h = 0; h < 4; h++) {
    int64_t x;
    assert_int_equal(mtrain_balance_head_pairs(p, N, h, lv[h], &x), MTRAIN_SUCCESS);
    pairs += (double)x;
  }
  const mtrain_balance_model_t m = MTRAIN_BALANCE_MODEL_INIT;
  const double per_layer = 2.0 * m.hidden * 2 * m.head_dim +
                           2.0 * m.hidden * m.kv_heads * m.head_dim +
                           3.0 * m.hidden * m.intermediate;
  const double lin = 6.0 * (2 * per_layer + (double)m.hidden * m.vocab) * N / 1e12;
  const double want = 1e-9 * pairs + 1e-7 * N * 4 + 1e-4 * 2 + lin;
  double got = 0;
  assert_int_equal(mtrain_balance_predict(p, N, lv, &got), MTRAIN_SUCCESS);
  assert_true(fabs(got - want) <= 1e-12 * want);
  /* the linear layers' per-sequence constant: once per sequence, only with linear layers */
  {
    mtrain_budgets_t *b = NULL;
    assert_int_equal(mtrain_budgets_parse(budgets_text, "inline", &b), MTRAIN_SUCCESS);
    mtrain_position_model_t pm = MTRAIN_POSITION_MODEL_INIT;
    mtrain_balance_calibration_t cal = {1e-9, 1e-7, 1e-4, 1e12, 0.25};
    mtrain_balance_model_t model = MTRAIN_BALANCE_MODEL_INIT;
    mtrain_balance_predictor_t *q = NULL;
    assert_int_equal(
        mtrain_balance_predictor_create(b, scales, K, BASE, &pm, 128, &cal, &model, &q),
        MTRAIN_SUCCESS);
    double g2 = 0;
    assert_int_equal(mtrain_balance_predict(q, N, lv, &g2), MTRAIN_SUCCESS);
    assert_true(fabs(g2 - (want + 0.25)) <= 1e-12 * want);
    mtrain_balance_predictor_destroy(q);
    model.hidden = 0; /* no linear layers: neither their FLOPs nor their constant */
    assert_int_equal(
        mtrain_balance_predictor_create(b, scales, K, BASE, &pm, 128, &cal, &model, &q),
        MTRAIN_SUCCESS);
    assert_int_equal(mtrain_balance_predict(q, N, lv, &g2), MTRAIN_SUCCESS);
    assert_true(fabs(g2 - (want - lin)) <= 1e-12 * want);
    mtrain_balance_predictor_destroy(q);
    cal.linear_seq_s = -1;
    TS_ASSERT_STATUS(
        mtrain_balance_predictor_create(b, scales, K, BASE, &pm, 128, &cal, &model, &q),
        MTRAIN_ERR_INVALID_ARGUMENT, "calibration values must be finite and >= 0");
    mtrain_budgets_destroy(b);
  }
  /* more budget, more pairs, up to dense (500 token slashes spread evenly over 782
   * blocks mark every block diagonal: head 1 is dense from level 2 on) */
  int64_t prev = -1;
  for (int32_t k = 0; k < K; k++) {
    int64_t x;
    assert_int_equal(mtrain_balance_head_pairs(p, 100000, 1, k, &x), MTRAIN_SUCCESS);
    assert_true(x > prev || x == 100000LL * 100001 / 2);
    prev = x;
  }
  assert_int_equal(prev, 100000LL * 100001 / 2);
  mtrain_balance_predictor_destroy(p);
}

/* Measured pricing: after set_row_pairs every head is charged min(causal, round(row_pairs *
 * N)) pairs at every level, predict and the tuner follow it, and bad values are refused. */
static void fake_mass(double *mass, int32_t heads);

static void test_measured_row_pairs(void **state) {
  (void)state;
  mtrain_balance_predictor_t *p = make_predictor(budgets_text, 0);
  double rp[4 * K];
  for (int h = 0; h < 4; h++)
    for (int k = 0; k < K; k++) rp[h * K + k] = 10.0 * (h + 1) * (k + 1) + 0.25;
  rp[3 * K + 3] = 1e9; /* beyond dense at any length: capped */
  double bad[4 * K];
  memcpy(bad, rp, sizeof bad);
  bad[5] = 0;
  TS_ASSERT_STATUS(mtrain_balance_predictor_set_row_pairs(p, bad), MTRAIN_ERR_INVALID_ARGUMENT,
                   "row_pairs[head 1, level 1] = 0");
  bad[5] = NAN;
  TS_ASSERT_STATUS(mtrain_balance_predictor_set_row_pairs(p, bad), MTRAIN_ERR_INVALID_ARGUMENT,
                   "finite");
  TS_ASSERT_STATUS(mtrain_balance_predictor_set_row_pairs(p, NULL), MTRAIN_ERR_NULL_POINTER,
                   "row_pairs");
  assert_int_equal(mtrain_balance_predictor_set_row_pairs(p, rp), MTRAIN_SUCCESS);
  const int64_t N = 4000;
  int32_t lv[4] = {0, 3, 1, 2};
  double pairs = 0;
  for (int32_t h = 0; h < 4; h++) {
    int64_t x;
    assert_int_equal(mtrain_balance_head_pairs(p, N, h, lv[h], &x), MTRAIN_SUCCESS);
    const double want = floor(rp[h * K + lv[h]] * N + 0.5);
    assert_true((double)x == want);
    pairs += (double)x;
  }
  int64_t capped;
  assert_int_equal(mtrain_balance_head_pairs(p, N, 3, 3, &capped), MTRAIN_SUCCESS);
  assert_true(capped == N * (N + 1) / 2);
  double got = 0, base = 0;
  assert_int_equal(mtrain_balance_predict(p, N, lv, &got), MTRAIN_SUCCESS);
  const int32_t none[4] = {0, 0, 0, 0};
  assert_int_equal(mtrain_balance_predict(p, N, none, &base), MTRAIN_SUCCESS);
  double p0 = 0;
  for (int32_t h = 0; h < 4; h++) p0 += floor(rp[h * K] * N + 0.5);
  assert_true(fabs((got - base) - 1e-9 * (pairs - p0)) <= 1e-12 * got);
  /* the tuner prices by the measured pairs: a level that costs more is seen to */
  double mass[4 * K];
  fake_mass(mass, 4);
  int64_t len[6] = {40000, 3000, 3000, 3000, 3000, 3000};
  int32_t rank_of[6], micro[6], lvs[2 * 4];
  double before[2], after[2];
  mtrain_balance_report_t rep;
  mtrain_balance_batch_options_t o = MTRAIN_BALANCE_BATCH_INIT;
  o.ranks = 2;
  assert_int_equal(
      mtrain_balance_batch(p, len, 6, mass, &o, rank_of, micro, lvs, before, after, &rep),
      MTRAIN_SUCCESS);
  assert_true(rep.max_after <= rep.max_before * (1 + 1e-12));
  for (int r = 0; r < 2; r++) {
    double x = 0;
    for (int i = 0; i < 6; i++) {
      if (rank_of[i] != r) continue;
      double s = 0;
      assert_int_equal(mtrain_balance_predict(p, len[i], &lvs[r * 4], &s), MTRAIN_SUCCESS);
      x += s;
    }
    assert_true(fabs(x - after[r]) <= 1e-9 * x);
  }
  mtrain_balance_predictor_destroy(p);
}

/* Measured pricing on a length grid: at a measured length a head is charged exactly its
 * value there, between two lengths the value linear in log N, outside the nearest end's;
 * one length is set_row_pairs; bad grids are refused naming the problem. */
static void test_measured_row_pairs_grid(void **state) {
  (void)state;
  mtrain_balance_predictor_t *p = make_predictor(budgets_text, 0);
  enum { L = 3, H = 4 };
  const int64_t lengths[L] = {1000, 4000, 16000};
  double rp[L * H * K];
  for (int i = 0; i < L; i++)
    for (int h = 0; h < H; h++)
      for (int k = 0; k < K; k++) rp[(i * H + h) * K + k] = 7.0 * (i + 1) * (h + 1) + k + 0.5;
  const int64_t bad_len[L] = {1000, 1000, 16000};
  TS_ASSERT_STATUS(mtrain_balance_predictor_set_row_pairs_grid(p, L, bad_len, rp),
                   MTRAIN_ERR_INVALID_ARGUMENT, "lengths[1] = 1000");
  const int64_t zero_len[L] = {0, 4000, 16000};
  TS_ASSERT_STATUS(mtrain_balance_predictor_set_row_pairs_grid(p, L, zero_len, rp),
                   MTRAIN_ERR_INVALID_ARGUMENT, "lengths[0] = 0");
  TS_ASSERT_STATUS(mtrain_balance_predictor_set_row_pairs_grid(p, L, NULL, rp),
                   MTRAIN_ERR_NULL_POINTER, "lengths is NULL");
  TS_ASSERT_STATUS(mtrain_balance_predictor_set_row_pairs_grid(p, 0, lengths, rp),
                   MTRAIN_ERR_INVALID_ARGUMENT, "0 row-pair lengths");
  double bad[L * H * K];
  memcpy(bad, rp, sizeof bad);
  bad[(2 * H + 1) * K + 2] = -3;
  TS_ASSERT_STATUS(mtrain_balance_predictor_set_row_pairs_grid(p, L, lengths, bad),
                   MTRAIN_ERR_INVALID_ARGUMENT, "row_pairs[length 2, head 1, level 2] = -3");
  assert_int_equal(mtrain_balance_predictor_set_row_pairs_grid(p, L, lengths, rp), MTRAIN_SUCCESS);
  for (int h = 0; h < H; h++)
    for (int k = 0; k < K; k++) {
      const double *at = &rp[h * K + k];
      const size_t stride = (size_t)H * K;
      int64_t x;
      /* on the grid, below it and above it */
      for (int i = 0; i < L; i++) {
        assert_int_equal(mtrain_balance_head_pairs(p, lengths[i], h, k, &x), MTRAIN_SUCCESS);
        assert_true((double)x == floor(at[i * stride] * (double)lengths[i] + 0.5));
      }
      assert_int_equal(mtrain_balance_head_pairs(p, 600, h, k, &x), MTRAIN_SUCCESS);
      assert_true((double)x == floor(at[0] * 600.0 + 0.5));
      assert_int_equal(mtrain_balance_head_pairs(p, 50000, h, k, &x), MTRAIN_SUCCESS);
      assert_true((double)x == floor(at[2 * stride] * 50000.0 + 0.5));
      /* 2000 lies halfway from 1000 to 4000 in log N (log 2 / log 4), 8000 from 4000 to 16000 */
      assert_int_equal(mtrain_balance_head_pairs(p, 2000, h, k, &x), MTRAIN_SUCCESS);
      const double mid = at[0] + 0.5 * (at[stride] - at[0]);
      assert_true((double)x == floor(mid * 2000.0 + 0.5));
      assert_int_equal(mtrain_balance_head_pairs(p, 8000, h, k, &x), MTRAIN_SUCCESS);
      const double mid2 = at[stride] + 0.5 * (at[2 * stride] - at[stride]);
      assert_true((double)x == floor(mid2 * 8000.0 + 0.5));
    }
  /* capped at dense: 10 tokens have 55 causal pairs, far below 7.5 pairs per row x 10 = 75 */
  int64_t small;
  assert_int_equal(mtrain_balance_head_pairs(p, 10, 0, 0, &small), MTRAIN_SUCCESS);
  assert_int_equal(small, 55);
  /* predict sums the same counts */
  double got = 0, zero = 0;
  assert_int_equal(mtrain_balance_predict(p, 2000, NULL, &got), MTRAIN_SUCCESS);
  mtrain_balance_predictor_t *q = make_predictor(budgets_text, 0);
  double one[H * K];
  for (int i = 0; i < H * K; i++) one[i] = 1e-300; /* pairs ~ 0 -> 1 each: the fixed part */
  assert_int_equal(mtrain_balance_predictor_set_row_pairs(q, one), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_balance_predict(q, 2000, NULL, &zero), MTRAIN_SUCCESS);
  double pairs = 0;
  for (int h = 0; h < H; h++) {
    int64_t x;
    assert_int_equal(mtrain_balance_head_pairs(p, 2000, h, BASE, &x), MTRAIN_SUCCESS);
    pairs += (double)x - 1.0;
  }
  assert_true(fabs((got - zero) - 1e-9 * pairs) <= 1e-12 * got);
  /* one length without lengths equals set_row_pairs */
  assert_int_equal(mtrain_balance_predictor_set_row_pairs_grid(q, 1, NULL, rp), MTRAIN_SUCCESS);
  int64_t a, b;
  assert_int_equal(mtrain_balance_head_pairs(q, 123456, 2, 1, &a), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_balance_head_pairs(p, 600, 2, 1, &b), MTRAIN_SUCCESS);
  assert_true((double)a == floor(rp[2 * K + 1] * 123456.0 + 0.5));
  mtrain_balance_predictor_destroy(q);
  mtrain_balance_predictor_destroy(p);
}

/* ---- batching ---------------------------------------------------------------------- */

static double max_load(const double *w, const int32_t *rank_of, int n, int R) {
  double load[8] = {0}, m = 0;
  for (int i = 0; i < n; i++) load[rank_of[i]] += w[i];
  for (int r = 0; r < R; r++) m = load[r] > m ? load[r] : m;
  return m;
}

static double brute_optimum(const double *w, int n, int R) {
  int32_t a[12] = {0};
  double best = INFINITY;
  for (;;) {
    const double m = max_load(w, a, n, R);
    if (m < best) best = m;
    int i = 0;
    while (i < n && ++a[i] == R) a[i++] = 0;
    if (i == n) break;
  }
  return best;
}

static void test_assign_against_optimum(void **state) {
  (void)state;
  ts_rng_t rng;
  ts_rng_seed(&rng, ts_seed(5));
  int32_t rank_of[12], micro[12], lpt_only_worse = 0;
  for (int trial = 0; trial < 400; trial++) {
    const int R = 2 + (int)ts_rng_below(&rng, 2), n = 3 + (int)ts_rng_below(&rng, 7);
    double w[12];
    for (int i = 0; i < n; i++)
      w[i] = trial % 3 ? 1 + ts_rng_below(&rng, 20) : ts_rng_uniform(&rng) * 100;
    assert_int_equal(mtrain_balance_assign(w, n, R, 1, MTRAIN_BATCH_COST, rank_of, micro),
                     MTRAIN_SUCCESS);
    for (int i = 0; i < n; i++) assert_true(rank_of[i] >= 0 && rank_of[i] < R && micro[i] == 0);
    const double opt = brute_optimum(w, n, R), got = max_load(w, rank_of, n, R);
    assert_true(got >= opt * (1 - 1e-12));
    if (got > (4.0 / 3.0 - 1.0 / (3.0 * R)) * opt * (1 + 1e-12))
      fail_msg("trial %d: n=%d R=%d: makespan %g above the LPT bound of the optimum %g", trial, n,
               R, got, opt);
    lpt_only_worse += got > opt * (1 + 1e-12);
  }
  /* LPT's classic miss: {3,3,2,2,2} on 2 ranks is 7 by LPT, 6 at best; the swap finds 6 */
  const double w[] = {3, 3, 2, 2, 2};
  assert_int_equal(mtrain_balance_assign(w, 5, 2, 1, MTRAIN_BATCH_COST, rank_of, micro),
                   MTRAIN_SUCCESS);
  assert_true(max_load(w, rank_of, 5, 2) == 6.0);
  print_message("assign: %d of 400 random cases above the optimum (all within the bound)\n",
                lpt_only_worse);
}

/* The first solver, kept here as the reference of the faster one: LPT, then
 * the local search scanning every (item on the busiest rank, rank) move and
 * every (item, lighter item elsewhere) swap per round, the first smallest
 * larger load winning. */
static void reference_assign(const double *w, int32_t n, int32_t R, int32_t *rank_of) {
  int32_t *order = malloc((size_t)n * sizeof *order);
  double *load = calloc((size_t)R, sizeof *load);
  assert_non_null(order);
  assert_non_null(load);
  for (int32_t i = 0; i < n; i++) order[i] = i;
  for (int32_t a = 1; a < n; a++) /* insertion sort: weight descending, index ascending */
    for (int32_t b = a; b > 0; b--) {
      const int32_t x = order[b - 1], y = order[b];
      if (w[x] > w[y] || (w[x] == w[y] && x < y)) break;
      order[b - 1] = y;
      order[b] = x;
    }
  for (int32_t j = 0; j < n; j++) {
    int32_t best = 0;
    for (int32_t b = 1; b < R; b++)
      if (load[b] < load[best]) best = b;
    rank_of[order[j]] = best;
    load[best] += w[order[j]];
  }
  for (int64_t round = 0; round < 64 * (int64_t)n; round++) {
    int32_t top = 0;
    for (int32_t r = 1; r < R; r++)
      if (load[r] > load[top]) top = r;
    const double L = load[top];
    double best = L;
    int32_t bi = -1, bj = -1, br = -1;
    for (int32_t i = 0; i < n; i++) {
      if (rank_of[i] != top || !(w[i] > 0)) continue;
      for (int32_t r = 0; r < R; r++) {
        if (r == top) continue;
        const double a = L - w[i], b = load[r] + w[i], m = a > b ? a : b;
        if (m < best) {
          best = m;
          bi = i;
          bj = -1;
          br = r;
        }
      }
      for (int32_t j = 0; j < n; j++) {
        const int32_t r = rank_of[j];
        if (r == top || !(w[j] < w[i])) continue;
        const double a = L - w[i] + w[j], b = load[r] + w[i] - w[j], m = a > b ? a : b;
        if (m < best) {
          best = m;
          bi = i;
          bj = j;
          br = r;
        }
      }
    }
    if (bi < 0) break;
    rank_of[bi] = br;
    if (bj >= 0) rank_of[bj] = top;
    load[top] = load[br] = 0;
    for (int32_t i = 0; i < n; i++)
      if (rank_of[i] == top || rank_of[i] == br) load[rank_of[i]] += w[i];
  }
  free(order);
  free(load);
}

/* The solver's local search (per-rank lists sorted by weight) chooses what
 * the full scan chose, move for move: equal assignments on random batches,
 * many of them full of equal weights (ties), zeros, one rank, more ranks than
 * items. */
static void test_assign_equals_full_scan(void **state) {
  (void)state;
  ts_rng_t rng;
  const uint64_t seed = ts_seed(17);
  ts_rng_seed(&rng, seed);
  enum { NMAX = 400 };
  double w[NMAX];
  int32_t got[NMAX], want[NMAX], micro[NMAX];
  int moved = 0;
  for (int trial = 0; trial < 300; trial++) {
    const int32_t n = 1 + (int32_t)ts_rng_below(&rng, trial < 200 ? 60 : NMAX);
    const int32_t R = 1 + (int32_t)ts_rng_below(&rng, trial % 5 == 0 ? 80 : 17);
    const int kind = trial % 4;
    for (int32_t i = 0; i < n; i++) {
      if (kind == 0)
        w[i] = ts_rng_uniform(&rng) * 1e3;
      else if (kind == 1) /* few distinct values: ties everywhere */
        w[i] = 128.0 * (double)(1 + ts_rng_below(&rng, 4));
      else if (kind == 2) /* long tail with zeros */
        w[i] = ts_rng_below(&rng, 10) == 0   ? 0.0
               : ts_rng_below(&rng, 20) == 0 ? 1e4 * (1 + ts_rng_uniform(&rng))
                                             : 1 + ts_rng_uniform(&rng) * 16;
      else
        w[i] = (double)(1 + ts_rng_below(&rng, 50));
    }
    assert_int_equal(mtrain_balance_assign(w, n, R, 1, MTRAIN_BATCH_COST, got, micro),
                     MTRAIN_SUCCESS);
    reference_assign(w, n, R, want);
    for (int32_t i = 0; i < n; i++)
      if (got[i] != want[i])
        fail_msg("seed %llu, trial %d (n %d, R %d, kind %d): item %d on rank %d, the full scan "
                 "put it on %d",
                 (unsigned long long)seed, trial, n, R, kind, i, got[i], want[i]);
    moved += n > 1 && R > 1;
  }
  print_message("assign: 300 random batches (%d with something to balance) equal to the full "
                "scan (seed %llu)\n",
                moved, (unsigned long long)seed);
}

static void test_assign_micro_and_sorted(void **state) {
  (void)state;
  double w[40];
  for (int i = 0; i < 40; i++) w[i] = (double)((i * 37) % 41 + 1);
  int32_t rank_of[40], micro[40], again_r[40], again_m[40];
  assert_int_equal(mtrain_balance_assign(w, 40, 4, 3, MTRAIN_BATCH_TOKENS, rank_of, micro),
                   MTRAIN_SUCCESS);
  for (int i = 0; i < 40; i++) assert_true(micro[i] >= 0 && micro[i] < 3);
  /* deterministic */
  assert_int_equal(mtrain_balance_assign(w, 40, 4, 3, MTRAIN_BATCH_TOKENS, again_r, again_m),
                   MTRAIN_SUCCESS);
  assert_memory_equal(rank_of, again_r, sizeof rank_of);
  assert_memory_equal(micro, again_m, sizeof micro);
  /* length-sorted: each rank a contiguous range of lengths, ranks in order */
  assert_int_equal(mtrain_balance_assign(w, 40, 4, 1, MTRAIN_BATCH_SORTED, rank_of, micro),
                   MTRAIN_SUCCESS);
  for (int i = 0; i < 40; i++)
    for (int j = 0; j < 40; j++)
      if (w[i] < w[j]) assert_true(rank_of[i] <= rank_of[j]);
}

/* ---- tuning -------------------------------------------------------------------------- */

static void fake_mass(double *mass, int32_t heads) {
  for (int32_t h = 0; h < heads; h++)
    for (int32_t k = 0; k < K; k++) mass[h * K + k] = 1 - (0.3 + 0.1 * h) / (1 << k);
}

static void test_tune_bounds_and_target(void **state) {
  (void)state;
  mtrain_balance_predictor_t *p = make_predictor(budgets_text, 16384);
  double mass[4 * K];
  fake_mass(mass, 4);
  /* one long sequence and many short ones: the long one's rank straggles */
  int64_t len[13] = {200000};
  for (int i = 1; i < 13; i++) len[i] = 16000 + 1000 * i;
  int32_t rank_of[13], micro[13], lv[4 * 4], lv2[4 * 4];
  double before[4], after[4];
  mtrain_balance_report_t rep, rep2;
  for (int lo = 0; lo <= BASE; lo++) {
    mtrain_balance_batch_options_t o = MTRAIN_BALANCE_BATCH_INIT;
    o.ranks = 4;
    o.min_level = lo;
    o.max_level = 3;
    assert_int_equal(
        mtrain_balance_batch(p, len, 13, mass, &o, rank_of, micro, lv, before, after, &rep),
        MTRAIN_SUCCESS);
    for (int j = 0; j < 16; j++) assert_true(lv[j] >= lo && lv[j] <= 3);
    assert_true(rep.max_after <= rep.max_before * (1 + 1e-12));
    double mx = 0;
    for (int r = 0; r < 4; r++) mx = after[r] > mx ? after[r] : mx;
    assert_true(mx == rep.max_after);
    if (rep.ranks_over_target == 0) {
      assert_true(rep.max_after <= rep.target_s * (1 + 1e-9));
    } else {
      /* the fallback: an over-target rank costs what it costs at the lowest allowed
       * levels (a head whose lowering saves nothing is left where it is) */
      double low[4] = {0};
      const int32_t lows[4] = {lo, lo, lo, lo};
      for (int i = 0; i < 13; i++) {
        double x = 0;
        assert_int_equal(mtrain_balance_predict(p, len[i], lows, &x), MTRAIN_SUCCESS);
        low[rank_of[i]] += x;
      }
      for (int r = 0; r < 4; r++)
        if (after[r] > rep.target_s * (1 + 1e-9))
          assert_true(fabs(after[r] - low[r]) <= 1e-9 * low[r]);
    }
    print_message("tune min_level %d: max/mean %.4f -> %.4f, over target %d, recall %.4f -> "
                  "%.4f\n",
                  lo, rep.max_before / rep.mean_before, rep.max_after / rep.mean_after,
                  rep.ranks_over_target, rep.recall_before, rep.recall_after);
    /* deterministic */
    int32_t r2[13], m2[13];
    assert_int_equal(mtrain_balance_batch(p, len, 13, mass, &o, r2, m2, lv2, NULL, NULL, &rep2),
                     MTRAIN_SUCCESS);
    assert_memory_equal(lv, lv2, sizeof lv);
    assert_memory_equal(rank_of, r2, sizeof r2);
    assert_memory_equal(&rep, &rep2, sizeof rep);
  }
  /* min_level = max_level = base: nothing moves */
  mtrain_balance_batch_options_t o = MTRAIN_BALANCE_BATCH_INIT;
  o.ranks = 4;
  o.min_level = o.max_level = BASE;
  assert_int_equal(
      mtrain_balance_batch(p, len, 13, mass, &o, rank_of, micro, lv, before, after, &rep),
      MTRAIN_SUCCESS);
  assert_true(rep.moves_down == 0 && rep.moves_up == 0);
  for (int r = 0; r < 4; r++) assert_true(fabs(before[r] - after[r]) <= 1e-12 * before[r]);
  /* the lowest level everywhere is feasible for a generous target: it is met */
  o.min_level = 0;
  o.max_level = 3;
  o.target_s = rep.max_before * 0.9;
  assert_int_equal(
      mtrain_balance_batch(p, len, 13, mass, &o, rank_of, micro, lv, before, after, &rep),
      MTRAIN_SUCCESS);
  assert_true(rep.max_after <= rep.max_before * 0.9 * (1 + 1e-9) || rep.ranks_over_target > 0);
  /* cost batching beats token batching on the straggler mix (predicted) */
  mtrain_balance_report_t tok;
  o = (mtrain_balance_batch_options_t)MTRAIN_BALANCE_BATCH_INIT;
  o.ranks = 4;
  o.tune = 0;
  o.method = MTRAIN_BATCH_TOKENS;
  assert_int_equal(
      mtrain_balance_batch(p, len, 13, NULL, &o, rank_of, micro, NULL, NULL, NULL, &tok),
      MTRAIN_SUCCESS);
  o.method = MTRAIN_BATCH_COST;
  assert_int_equal(
      mtrain_balance_batch(p, len, 13, NULL, &o, rank_of, micro, NULL, NULL, NULL, &rep),
      MTRAIN_SUCCESS);
  assert_true(rep.max_before <= tok.max_before);
  mtrain_balance_predictor_destroy(p);
}

/* ---- mass curve -------------------------------------------------------------------------- */

static void test_mass_curve(void **state) {
  (void)state;
  const int64_t N = 1024;
  const int32_t hq = 4, hkv = 2, d = 32;
  float *q = malloc(sizeof(float) * N * hq * d), *k = malloc(sizeof(float) * N * hkv * d),
        *v = malloc(sizeof(float) * N * hkv * d);
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, hq, d),
                  tk = mtrain_tensor_3d(k, MTRAIN_F32, N, hkv, d),
                  tv = mtrain_tensor_3d(v, MTRAIN_F32, N, hkv, d);
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  assert_int_equal(mtrain_generate_structured(&so, &tq, &tk, &tv), MTRAIN_SUCCESS);
  mtrain_head_budget_t b[4];
  memset(b, 0, sizeof b);
  for (int h = 0; h < 4; h++) {
    b[h].kind = MTRAIN_BUDGET_TOP_K;
    b[h].v_size = 20 + 30 * h;
    b[h].s_size = 100 + 40 * h;
  }
  b[3].v_size = 5000; /* everything: the whole mass */
  b[3].s_size = 5000;
  const double sc[] = {0.1, 0.5, 1.0, 4.0};
  double mass[16];
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  assert_int_equal(mtrain_balance_mass_curve(q, k, N, hq, hkv, d, 64, b, sc, 4, 0, &eo, mass),
                   MTRAIN_SUCCESS);
  for (int h = 0; h < 4; h++)
    for (int l = 0; l < 4; l++) {
      assert_true(mass[h * 4 + l] >= 0 && mass[h * 4 + l] <= 1);
      if (l) assert_true(mass[h * 4 + l] >= mass[h * 4 + l - 1]);
    }
  assert_true(fabs(mass[3 * 4 + 3] - 1.0) < 1e-9);
  assert_true(mass[0] < mass[3]);
  TS_ASSERT_STATUS(mtrain_balance_mass_curve(q, k, N, 3, hkv, d, 64, b, sc, 4, 0, &eo, mass),
                   MTRAIN_ERR_INVALID_ARGUMENT, "heads 3:2");
  eo.top_p_forced = 2; /* checked as the estimate checks it */
  TS_ASSERT_STATUS(mtrain_balance_mass_curve(q, k, N, hq, hkv, d, 64, b, sc, 4, 0, &eo, mass),
                   MTRAIN_ERR_INVALID_ARGUMENT, "top_p_forced 2");
  free(q);
  free(k);
  free(v);
}

/* ---- calibration file and bad inputs ---------------------------------------------------- */

static const char *write_tmp(const char *name, const char *text) {
  static char path[512];
  snprintf(path, sizeof path, "%s/%s", MTRAIN_TEST_TMPDIR, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  return path;
}

/* The measured-pricing table file: read into the predictor (the counts follow its values),
 * and every mismatch or gap refused naming it. */
static void table_text(char *out, size_t size, const char *format, const char *levels,
                       const char *layer1) {
  snprintf(out, size,
           "{\"format\": \"%s\", \"levels\": %s, \"granularity\": 128, \"heads\": 2, "
           "\"num_layers\": 2, \"lengths\": [1000, 4000], \"layers_done\": {\"0\": "
           "[[[1, 2, 3, 4], [5, 6, 7, 8]], [[11, 12, 13, 14], [15, 16, 17, 18]]]%s}}",
           format, levels, layer1);
}

static void test_row_pairs_file(void **state) {
  (void)state;
  mtrain_balance_predictor_t *p = make_predictor(budgets_text, 0);
  const char *good_levels = "[0.25, 0.5, 1.0, 2.0]";
  const char *layer1 =
      ", \"1\": [[[21, 22, 23, 24], [25, 26, 27, 28]], [[31, 32, 33, 34], [35, 36, 37, 38]]]";
  char text[1024];
  table_text(text, sizeof text, "mtrain-row-pairs-1", good_levels, layer1);
  assert_int_equal(mtrain_balance_predictor_read_row_pairs(p, write_tmp("rp_ok.json", text)),
                   MTRAIN_SUCCESS);
  int64_t x;
  assert_int_equal(mtrain_balance_head_pairs(p, 1000, 3, 1, &x), MTRAIN_SUCCESS);
  assert_int_equal(x, 26 * 1000); /* layer 1, head 1, level 1 at the first length */
  assert_int_equal(mtrain_balance_head_pairs(p, 4000, 1, 3, &x), MTRAIN_SUCCESS);
  assert_int_equal(x, 18 * 4000); /* layer 0, head 1, level 3 at the second */
  table_text(text, sizeof text, "other", good_levels, layer1);
  TS_ASSERT_STATUS(mtrain_balance_predictor_read_row_pairs(p, write_tmp("rp_f.json", text)),
                   MTRAIN_ERR_FORMAT, "\"format\" must be");
  table_text(text, sizeof text, "mtrain-row-pairs-1", "[0.25, 0.5, 1.0, 3.0]", layer1);
  TS_ASSERT_STATUS(mtrain_balance_predictor_read_row_pairs(p, write_tmp("rp_l.json", text)),
                   MTRAIN_ERR_INVALID_ARGUMENT, "level 3 is 3");
  table_text(text, sizeof text, "mtrain-row-pairs-1", good_levels, "");
  TS_ASSERT_STATUS(mtrain_balance_predictor_read_row_pairs(p, write_tmp("rp_m.json", text)),
                   MTRAIN_ERR_INVALID_ARGUMENT, "layer 1 was not measured");
  table_text(text, sizeof text, "mtrain-row-pairs-1", good_levels,
             ", \"1\": [[[21, 22, 23, 24], [25, 26, 27, 28]], [[31, 32, 33, 34], [35, 36, "
             "\"x\", 38]]]");
  TS_ASSERT_STATUS(mtrain_balance_predictor_read_row_pairs(p, write_tmp("rp_v.json", text)),
                   MTRAIN_ERR_FORMAT, "layer 1, length 1, head 1, level 2 is not a number");
  table_text(text, sizeof text, "mtrain-row-pairs-1", good_levels,
             ", \"1\": [[[21, 22, 23, 24], [25, 26, 27, 28]], [[31, 32, 33, 34], [35, 36, "
             "0, 38]]]");
  TS_ASSERT_STATUS(mtrain_balance_predictor_read_row_pairs(p, write_tmp("rp_z.json", text)),
                   MTRAIN_ERR_INVALID_ARGUMENT, "row_pairs[length 1, head 3, level 2] = 0");
  TS_ASSERT_STATUS(mtrain_balance_predictor_read_row_pairs(p, write_tmp("rp_j.json", "{")),
                   MTRAIN_ERR_FORMAT, "line");
  /* after the refusals the first table still prices */
  assert_int_equal(mtrain_balance_head_pairs(p, 1000, 3, 1, &x), MTRAIN_SUCCESS);
  assert_int_equal(x, 26 * 1000);
  mtrain_balance_predictor_destroy(p);
}

static void test_calibration_file(void **state) {
  (void)state;
  mtrain_balance_calibration_t c;
  assert_int_equal(mtrain_balance_calibration_read(
                       write_tmp("cal_ok.json", "{\"device\": \"x\", \"pair_s\": 1e-12, \"row_s\": "
                                                "0, \"seq_s\": 2e-5, \"linear_flops\": 5e14}"),
                       &c),
                   MTRAIN_SUCCESS);
  assert_true(c.pair_s == 1e-12 && c.seq_s == 2e-5 && c.linear_flops == 5e14);
  assert_true(c.linear_seq_s == 0); /* optional: 0 when absent */
  assert_int_equal(mtrain_balance_calibration_read(
                       write_tmp("cal_lin.json", "{\"pair_s\": 1e-12, \"row_s\": 0, \"seq_s\": "
                                                 "0, \"linear_flops\": 5e14, \"linear_seq_s\": "
                                                 "0.03}"),
                       &c),
                   MTRAIN_SUCCESS);
  assert_true(c.linear_seq_s == 0.03 && c.linear_flops == 5e14);
  TS_ASSERT_STATUS(mtrain_balance_calibration_read(
                       write_tmp("cal_bad4.json", "{\"pair_s\": 1, \"row_s\": 0, \"seq_s\": 0, "
                                                  "\"linear_flops\": 0, \"linear_seq_s\": -2}"),
                       &c),
                   MTRAIN_ERR_FORMAT, "\"linear_seq_s\" is -2");
  TS_ASSERT_STATUS(mtrain_balance_calibration_read(
                       write_tmp("cal_bad1.json", "{\"pair_s\": 1, \"row_s\": 0, \"seq_s\": 0, "
                                                  "\"linear_flops\": 0, \"pairs_s\": 3}"),
                       &c),
                   MTRAIN_ERR_FORMAT, "unknown key \"pairs_s\"");
  TS_ASSERT_STATUS(mtrain_balance_calibration_read(
                       write_tmp("cal_bad2.json", "{\"pair_s\": -1, \"row_s\": 0, \"seq_s\": 0, "
                                                  "\"linear_flops\": 0}"),
                       &c),
                   MTRAIN_ERR_FORMAT, "\"pair_s\" is -1");
  TS_ASSERT_STATUS(
      mtrain_balance_calibration_read(
          write_tmp("cal_bad3.json", "{\"pair_s\": 1, \"row_s\": 0, \"seq_s\": 0}"), &c),
      MTRAIN_ERR_FORMAT, "\"linear_flops\" must be a number");
}

static void test_bad_inputs(void **state) {
  (void)state;
  mtrain_budgets_t *b = NULL;
  assert_int_equal(mtrain_budgets_parse(budgets_text, "inline", &b), MTRAIN_SUCCESS);
  mtrain_position_model_t pm = MTRAIN_POSITION_MODEL_INIT;
  mtrain_balance_calibration_t cal = {1e-9, 0, 0, 1e12, 0};
  mtrain_balance_model_t model = MTRAIN_BALANCE_MODEL_INIT;
  mtrain_balance_predictor_t *p = NULL;
  const double down[] = {1.0, 0.5};
  TS_ASSERT_STATUS(mtrain_balance_predictor_create(b, down, 2, 0, &pm, 128, &cal, &model, &p),
                   MTRAIN_ERR_INVALID_ARGUMENT, "strictly increasing");
  TS_ASSERT_STATUS(mtrain_balance_predictor_create(b, scales, K, K, &pm, 128, &cal, &model, &p),
                   MTRAIN_ERR_INVALID_ARGUMENT, "base_level 4");
  cal.linear_flops = 0;
  TS_ASSERT_STATUS(mtrain_balance_predictor_create(b, scales, K, BASE, &pm, 128, &cal, &model, &p),
                   MTRAIN_ERR_INVALID_ARGUMENT, "linear_flops is 0");
  mtrain_budgets_destroy(b);
  p = make_predictor(budgets_text, 0);
  int64_t len[3] = {1000, 0, 5};
  int32_t r[3], m[3];
  double mass[16];
  fake_mass(mass, 4);
  mtrain_balance_batch_options_t o = MTRAIN_BALANCE_BATCH_INIT;
  o.ranks = 2;
  TS_ASSERT_STATUS(mtrain_balance_batch(p, len, 3, mass, &o, r, m, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT, "lengths[1] = 0");
  len[1] = 10;
  TS_ASSERT_STATUS(mtrain_balance_batch(p, len, 0, mass, &o, r, m, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT, "at least one");
  TS_ASSERT_STATUS(mtrain_balance_batch(p, len, 3, NULL, &o, r, m, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_NULL_POINTER, "mass curves");
  o.ranks = 0;
  TS_ASSERT_STATUS(mtrain_balance_batch(p, len, 3, mass, &o, r, m, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT, "ranks 0");
  o.ranks = 2;
  o.min_level = 3;
  o.max_level = 1;
  TS_ASSERT_STATUS(mtrain_balance_batch(p, len, 3, mass, &o, r, m, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT, "level bounds [3, 1]");
  o.min_level = o.max_level = -1;
  mass[1 * K + 2] = 0.0; /* head 1 falls at level 2 */
  TS_ASSERT_STATUS(mtrain_balance_batch(p, len, 3, mass, &o, r, m, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT, "mass of head 1 falls");
  mass[1 * K + 2] = 1.5;
  TS_ASSERT_STATUS(mtrain_balance_batch(p, len, 3, mass, &o, r, m, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT, "not in [0, 1]");
  const double w[2] = {1, NAN};
  TS_ASSERT_STATUS(mtrain_balance_assign(w, 2, 2, 1, MTRAIN_BATCH_COST, r, m),
                   MTRAIN_ERR_INVALID_ARGUMENT, "weights[1]");
  TS_ASSERT_STATUS(mtrain_balance_assign(w, 1, 2, 1, (mtrain_batch_method_t)7, r, m),
                   MTRAIN_ERR_INVALID_ARGUMENT, "method 7");
  int32_t lv[4] = {0, 0, 9, 0};
  double s;
  TS_ASSERT_STATUS(mtrain_balance_predict(p, 100, lv, &s), MTRAIN_ERR_INVALID_ARGUMENT,
                   "levels[2] = 9");
  mtrain_balance_predictor_destroy(p);
  mtrain_balance_predictor_destroy(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pairs_random_heads),
      cmocka_unit_test(test_pairs_real_budgets),
      cmocka_unit_test(test_predict_definition),
      cmocka_unit_test(test_measured_row_pairs),
      cmocka_unit_test(test_measured_row_pairs_grid),
      cmocka_unit_test(test_row_pairs_file),
      cmocka_unit_test(test_assign_against_optimum),
      cmocka_unit_test(test_assign_equals_full_scan),
      cmocka_unit_test(test_assign_micro_and_sorted),
      cmocka_unit_test(test_tune_bounds_and_target),
      cmocka_unit_test(test_mass_curve),
      cmocka_unit_test(test_calibration_file),
      cmocka_unit_test(test_bad_inputs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
