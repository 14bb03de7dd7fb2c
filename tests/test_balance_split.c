/* test_balance_split.c: splitting the largest documents over several ranks
 * (docs/BALANCE.md, "Splitting the longest documents over a ring"):
 * mtrain_balance_assign_split with splitting off equals mtrain_balance_assign
 * bitwise; a document larger than the mean load is split and the makespan
 * falls below what any whole-document assignment can reach; on random
 * batches every split document spans k distinct ranks (the smallest k that
 * brings its share under the threshold), the loads add up to the total with
 * the ring overhead, the split phase's starts and waits are those of its
 * gang schedule, and results are deterministic; mtrain_balance_batch_split
 * equals mtrain_balance_batch with splitting off and charges a split
 * document its documented seconds with it on; bad inputs are rejected with
 * messages naming the problem. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_balance.h"
#include "test_support.h"

static const char budgets_text[] =
    "[{\"0\": [\"vertical_and_slash\", 100, 50, 0.9], \"1\": [\"vertical_and_slash\", 10, 500, "
    "0.9]},\n {\"0\": [\"vertical_and_slash\", 3500, 100, 0.9], \"1\": "
    "[\"flex_vertical_and_slash\", [0.9, 40], [0.9, 2000], 0.0]}]\n";

static const double scales[] = {0.25, 0.5, 1.0, 2.0};
enum { K = 4, BASE = 2 };

/* linear_seq_s: the calibration's per-sequence cost of the linear layers */
static mtrain_balance_predictor_t *make_predictor_lin(int64_t context, double linear_seq_s) {
  mtrain_budgets_t *b = NULL;
  assert_int_equal(mtrain_budgets_parse(budgets_text, "inline", &b), MTRAIN_SUCCESS);
  mtrain_position_model_t pm = MTRAIN_POSITION_MODEL_INIT;
  pm.budget_context = context;
  mtrain_balance_calibration_t cal = {1e-9, 1e-7, 1e-4, 1e12, linear_seq_s};
  mtrain_balance_model_t model = MTRAIN_BALANCE_MODEL_INIT;
  mtrain_balance_predictor_t *p = NULL;
  assert_int_equal(mtrain_balance_predictor_create(b, scales, K, BASE, &pm, 128, &cal, &model, &p),
                   MTRAIN_SUCCESS);
  mtrain_budgets_destroy(b);
  return p;
}

static mtrain_balance_predictor_t *make_predictor(int64_t context) {
  return make_predictor_lin(context, 0.0);
}

static void random_weights(ts_rng_t *rng, double *w, int32_t n, int kind) {
  for (int32_t i = 0; i < n; i++) {
    if (kind == 0)
      w[i] = ts_rng_uniform(rng) * 1e3;
    else if (kind == 1) /* few distinct values: ties everywhere */
      w[i] = 128.0 * (double)(1 + ts_rng_below(rng, 4));
    else if (kind == 2) /* long tail with zeros */
      w[i] = ts_rng_below(rng, 10) == 0   ? 0.0
             : ts_rng_below(rng, 20) == 0 ? 1e4 * (1 + ts_rng_uniform(rng))
                                          : 1 + ts_rng_uniform(rng) * 16;
    else
      w[i] = (double)(1 + ts_rng_below(rng, 50));
  }
}

/* ---- splitting off: the solver of mtrain_balance_assign, bitwise ----------------------- */

static void test_off_equals_assign(void **state) {
  (void)state;
  ts_rng_t rng;
  const uint64_t seed = ts_seed(23);
  ts_rng_seed(&rng, seed);
  enum { NMAX = 300 };
  double w[NMAX];
  int32_t want_r[NMAX], want_m[NMAX];
  for (int trial = 0; trial < 200; trial++) {
    const int32_t n = 1 + (int32_t)ts_rng_below(&rng, NMAX);
    const int32_t R = 1 + (int32_t)ts_rng_below(&rng, trial % 5 == 0 ? 80 : 17);
    const int32_t M = 1 + (int32_t)ts_rng_below(&rng, 3);
    const mtrain_batch_method_t method = (mtrain_batch_method_t)(trial % 3);
    random_weights(&rng, w, n, trial % 4);
    assert_int_equal(mtrain_balance_assign(w, n, R, M, method, want_r, want_m), MTRAIN_SUCCESS);
    mtrain_balance_split_options_t off = MTRAIN_BALANCE_SPLIT_INIT, never = off;
    never.split_above = 1e6; /* nothing is that large: splitting on, nothing split */
    const mtrain_balance_split_options_t *opts[3] = {NULL, &off, &never};
    for (int v = 0; v < (method == MTRAIN_BATCH_SORTED ? 2 : 3); v++) {
      mtrain_balance_split_t s;
      assert_int_equal(mtrain_balance_assign_split(w, NULL, NULL, n, R, M, method, opts[v], &s),
                       MTRAIN_SUCCESS);
      if (memcmp(s.rank_of, want_r, (size_t)n * sizeof *want_r) ||
          memcmp(s.micro_of, want_m, (size_t)n * sizeof *want_m))
        fail_msg("seed %llu, trial %d (n %d, R %d, M %d, method %d), options %d: not the "
                 "assignment of mtrain_balance_assign",
                 (unsigned long long)seed, trial, n, R, M, (int)method, v);
      assert_int_equal(s.num_split, 0);
      double load[80] = {0};
      for (int32_t i = 0; i < n; i++) {
        assert_int_equal(s.num_ranks[i], 1);
        assert_int_equal(s.offset[i], i);
        assert_int_equal(s.group[i], want_r[i]);
        assert_true(s.share[i] == w[i] && s.start[i] == -1);
        load[want_r[i]] += w[i];
      }
      for (int32_t r = 0; r < R; r++) assert_true(s.rank_load[r] == load[r] && s.rank_idle[r] == 0);
      mtrain_balance_split_free(&s);
      assert_null(s.rank_of); /* zeroed: freeing again is a no-op */
      mtrain_balance_split_free(&s);
    }
  }
  mtrain_balance_split_free(NULL);
}

/* ---- a document larger than the mean rank load -------------------------------------------- */

static void test_split_large_document(void **state) {
  (void)state;
  /* 10 and forty 0.5s on 4 ranks: the mean is 7.5, so no whole assignment does better
   * than 10; split over 2 ranks (5 each) the optimum 7.5 is reachable */
  enum { NW = 41 };
  double w[NW] = {10};
  for (int i = 1; i < NW; i++) w[i] = 0.5;
  int32_t r0[NW], m0[NW];
  assert_int_equal(mtrain_balance_assign(w, NW, 4, 1, MTRAIN_BATCH_COST, r0, m0), MTRAIN_SUCCESS);
  double whole_max = 0, load[4] = {0};
  for (int i = 0; i < NW; i++) load[r0[i]] += w[i];
  for (int r = 0; r < 4; r++) whole_max = load[r] > whole_max ? load[r] : whole_max;
  assert_true(whole_max >= 10);
  mtrain_balance_split_options_t o = MTRAIN_BALANCE_SPLIT_INIT;
  o.split_above = 1.0;
  o.ring_overhead = 1.0;
  mtrain_balance_split_t s;
  assert_int_equal(mtrain_balance_assign_split(w, NULL, NULL, NW, 4, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_SUCCESS);
  assert_int_equal(s.num_split, 1);
  assert_int_equal(s.num_ranks[0], 2);
  assert_int_equal(s.split_order[0], 0);
  assert_true(s.group[s.offset[0]] != s.group[s.offset[0] + 1]);
  assert_int_equal(s.micro_of[0], -1);
  assert_true(s.share[0] == 5.0 && s.start[0] == 0.0);
  double mx = 0;
  for (int r = 0; r < 4; r++) mx = s.rank_load[r] > mx ? s.rank_load[r] : mx;
  assert_true(mx == 7.5); /* the lower bound total / R: optimal */
  mtrain_balance_split_free(&s);
  /* with the ring's overhead each rank carries 5 * 1.01, and the loads sum to 30 + 0.1 */
  o.ring_overhead = 1.01;
  assert_int_equal(mtrain_balance_assign_split(w, NULL, NULL, NW, 4, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_SUCCESS);
  assert_true(fabs(s.share[0] - 5.05) < 1e-12);
  double sum = 0;
  mx = 0;
  for (int r = 0; r < 4; r++) {
    sum += s.rank_load[r] - s.rank_idle[r];
    mx = s.rank_load[r] > mx ? s.rank_load[r] : mx;
  }
  assert_true(fabs(sum - 30.1) < 1e-9);
  assert_true(mx < whole_max);
  print_message("split: 10 + 40 x 0.5 on 4 ranks: whole documents %.2f, split (overhead 1.01) "
                "%.2f\n",
                whole_max, mx);
  mtrain_balance_split_free(&s);
  /* a lower threshold splits further: 10 over 4 ranks (2.5 each <= 0.4 * 7.5 = 3) */
  o.split_above = 0.4;
  o.ring_overhead = 1.0;
  assert_int_equal(mtrain_balance_assign_split(w, NULL, NULL, NW, 4, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_SUCCESS);
  assert_int_equal(s.num_ranks[0], 4);
  for (int q = 0; q < 4; q++) assert_int_equal(s.group[s.offset[0] + q], q);
  mtrain_balance_split_free(&s);
  /* max_ranks caps k: the share stays above the threshold */
  o.max_ranks = 3;
  assert_int_equal(mtrain_balance_assign_split(w, NULL, NULL, NW, 4, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_SUCCESS);
  assert_int_equal(s.num_ranks[0], 3);
  assert_true(s.share[0] > 3.0);
  mtrain_balance_split_free(&s);
  /* one rank: nothing can be split */
  o.max_ranks = 0;
  assert_int_equal(mtrain_balance_assign_split(w, NULL, NULL, NW, 1, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_SUCCESS);
  assert_int_equal(s.num_split, 0);
  mtrain_balance_split_free(&s);
}

/* ---- random batches: the documented properties ---------------------------------------------- */

static void test_split_properties(void **state) {
  (void)state;
  ts_rng_t rng;
  const uint64_t seed = ts_seed(29);
  ts_rng_seed(&rng, seed);
  enum { NMAX = 200, RMAX = 40 };
  double w[NMAX], ring[NMAX], fixed[NMAX];
  int split_docs = 0;
  for (int trial = 0; trial < 300; trial++) {
    const int32_t n = 1 + (int32_t)ts_rng_below(&rng, NMAX);
    const int32_t R = 1 + (int32_t)ts_rng_below(&rng, RMAX);
    const int32_t M = 1 + (int32_t)ts_rng_below(&rng, 3);
    random_weights(&rng, w, n, trial % 4);
    const int parts = trial % 3; /* 0: NULL parts; 1: ring only; 2: ring and fixed */
    for (int32_t i = 0; i < n; i++) {
      ring[i] = w[i] * ts_rng_uniform(&rng);
      fixed[i] = (w[i] - ring[i]) * 0.1 * ts_rng_uniform(&rng);
    }
    mtrain_balance_split_options_t o = MTRAIN_BALANCE_SPLIT_INIT;
    o.split_above = 0.1 + 1.5 * ts_rng_uniform(&rng);
    o.ring_overhead = 1 + 0.2 * ts_rng_uniform(&rng);
    o.max_ranks = trial % 4 == 0 ? (int32_t)ts_rng_below(&rng, (uint64_t)R + 1) : 0;
    const double *rp = parts ? ring : NULL, *fp = parts == 2 ? fixed : NULL;
    const mtrain_batch_method_t method = trial % 2 ? MTRAIN_BATCH_COST : MTRAIN_BATCH_TOKENS;
    mtrain_balance_split_t s, again;
    assert_int_equal(mtrain_balance_assign_split(w, rp, fp, n, R, M, method, &o, &s),
                     MTRAIN_SUCCESS);
    const int32_t kmax = o.max_ranks ? o.max_ranks : R;
    double total = 0;
    for (int32_t i = 0; i < n; i++) total += w[i];
    const double T = o.split_above * total / R;
    double busy = 0, ready[RMAX] = {0}, idle[RMAX] = {0}, load[RMAX];
    int32_t nsplit = 0;
    for (int32_t i = 0; i < n; i++) {
      const int32_t k = s.num_ranks[i];
      assert_int_equal(s.offset[i + 1] - s.offset[i], k);
      const double r = rp ? rp[i] : w[i], f = fp ? fp[i] : 0;
      if (k == 1) {
        assert_false(w[i] > T && kmax >= 2);
        assert_true(s.share[i] == w[i] && s.micro_of[i] >= 0 && s.micro_of[i] < M);
        assert_int_equal(s.group[s.offset[i]], s.rank_of[i]);
        busy += w[i];
        continue;
      }
      nsplit++;
      assert_true(w[i] > T && k >= 2 && k <= kmax && s.micro_of[i] == -1);
      const double share = f + (w[i] - f + (o.ring_overhead - 1) * r) / k;
      assert_true(s.share[i] == share);
      /* the smallest k bringing the share under T (or the cap) */
      if (k < kmax) assert_true(share <= T);
      if (k > 2) assert_true(f + (w[i] - f + (o.ring_overhead - 1) * r) / (k - 1) > T);
      const int32_t *g = s.group + s.offset[i];
      assert_int_equal(g[0], s.rank_of[i]);
      for (int32_t q = 0; q < k; q++) {
        assert_true(g[q] >= 0 && g[q] < R);
        if (q) assert_true(g[q] > g[q - 1]); /* ascending, so distinct */
      }
      busy += k * share;
    }
    assert_int_equal(nsplit, s.num_split);
    split_docs += nsplit;
    /* the split phase replayed: each group starts when its last rank is free */
    for (int32_t j = 0; j < s.num_split; j++) {
      const int32_t i = s.split_order[j];
      if (j) assert_true(w[i] <= w[s.split_order[j - 1]]);
      const int32_t *g = s.group + s.offset[i];
      double start = 0;
      for (int32_t q = 0; q < s.num_ranks[i]; q++)
        start = ready[g[q]] > start ? ready[g[q]] : start;
      assert_true(s.start[i] == start);
      for (int32_t q = 0; q < s.num_ranks[i]; q++) {
        idle[g[q]] += start - ready[g[q]];
        ready[g[q]] = start + s.share[i];
      }
    }
    double sum = 0;
    for (int32_t r = 0; r < R; r++) load[r] = ready[r];
    for (int32_t i = 0; i < n; i++)
      if (s.num_ranks[i] == 1) load[s.rank_of[i]] += w[i];
    for (int32_t r = 0; r < R; r++) {
      assert_true(s.rank_idle[r] == idle[r]);
      assert_true(fabs(s.rank_load[r] - load[r]) <= 1e-9 * (1 + load[r]));
      sum += s.rank_load[r] - s.rank_idle[r];
    }
    /* loads add up to the total, with the ring's overhead and the fixed parts per rank */
    assert_true(fabs(sum - busy) <= 1e-9 * (1 + busy));
    /* deterministic */
    assert_int_equal(mtrain_balance_assign_split(w, rp, fp, n, R, M, method, &o, &again),
                     MTRAIN_SUCCESS);
    assert_int_equal(again.num_split, s.num_split);
    assert_memory_equal(s.rank_of, again.rank_of, (size_t)n * sizeof *s.rank_of);
    assert_memory_equal(s.micro_of, again.micro_of, (size_t)n * sizeof *s.micro_of);
    assert_memory_equal(s.group, again.group, (size_t)s.offset[n] * sizeof *s.group);
    assert_memory_equal(s.rank_load, again.rank_load, (size_t)R * sizeof *s.rank_load);
    mtrain_balance_split_free(&s);
    mtrain_balance_split_free(&again);
  }
  print_message("split: 300 random batches, %d split documents (seed %llu)\n", split_docs,
                (unsigned long long)seed);
}

/* ---- through the predictor ------------------------------------------------------------------ */

static void fake_mass(double *mass, int32_t heads) {
  for (int32_t h = 0; h < heads; h++)
    for (int32_t k = 0; k < K; k++) mass[h * K + k] = 1 - (0.3 + 0.1 * h) / (1 << k);
}

static void test_batch_split(void **state) {
  (void)state;
  mtrain_balance_predictor_t *p = make_predictor(16384);
  double mass[4 * K];
  fake_mass(mass, 4);
  /* one long document and many short ones: the long one is most of the work */
  enum { N = 25, R = 4 };
  int64_t len[N] = {400000};
  for (int i = 1; i < N; i++) len[i] = 8000 + 1000 * i;
  int32_t rank_of[N], micro[N], lv[R * 4], lv2[R * 4];
  double before[R], after[R], before2[R], after2[R];
  mtrain_balance_report_t rep, rep2;
  /* splitting off: mtrain_balance_batch's outputs, bitwise */
  for (int v = 0; v < 6; v++) {
    mtrain_balance_batch_options_t o = MTRAIN_BALANCE_BATCH_INIT;
    o.ranks = R;
    o.micro_batches = 2;
    o.method = (mtrain_batch_method_t)(v % 3);
    o.tune = v >= 3;
    assert_int_equal(
        mtrain_balance_batch(p, len, N, mass, &o, rank_of, micro, lv, before, after, &rep),
        MTRAIN_SUCCESS);
    mtrain_balance_split_options_t off = MTRAIN_BALANCE_SPLIT_INIT;
    mtrain_balance_split_t s;
    assert_int_equal(
        mtrain_balance_batch_split(p, len, N, mass, &o, &off, &s, lv2, before2, after2, &rep2),
        MTRAIN_SUCCESS);
    assert_memory_equal(rank_of, s.rank_of, sizeof rank_of);
    assert_memory_equal(micro, s.micro_of, sizeof micro);
    assert_memory_equal(lv, lv2, sizeof lv);
    assert_memory_equal(before, before2, sizeof before);
    assert_memory_equal(after, after2, sizeof after);
    assert_memory_equal(before, s.rank_load, sizeof before);
    assert_memory_equal(&rep, &rep2, sizeof rep);
    mtrain_balance_split_free(&s);
  }
  /* splitting on: the long document spans several ranks and the step falls */
  mtrain_balance_batch_options_t o = MTRAIN_BALANCE_BATCH_INIT;
  o.ranks = R;
  o.tune = 0;
  assert_int_equal(
      mtrain_balance_batch(p, len, N, NULL, &o, rank_of, micro, NULL, before, NULL, &rep),
      MTRAIN_SUCCESS);
  mtrain_balance_split_options_t so = MTRAIN_BALANCE_SPLIT_INIT;
  so.split_above = 1.0;
  mtrain_balance_split_t s;
  assert_int_equal(
      mtrain_balance_batch_split(p, len, N, NULL, &o, &so, &s, NULL, before2, after2, &rep2),
      MTRAIN_SUCCESS);
  double cost0 = 0;
  assert_int_equal(mtrain_balance_predict(p, len[0], NULL, &cost0), MTRAIN_SUCCESS);
  assert_true(cost0 > rep.mean_before); /* larger than the mean rank time */
  assert_true(rep.max_before >= cost0);
  const int32_t k = s.num_ranks[0];
  assert_true(s.num_split >= 1 && k >= 2);
  for (int32_t q = 1; q < k; q++)
    assert_true(s.group[s.offset[0] + q] > s.group[s.offset[0] + q - 1]);
  /* its seconds on each rank: seq_s * layers + (1.01 * attention + linear) / k */
  const mtrain_balance_model_t m = MTRAIN_BALANCE_MODEL_INIT;
  const double per_layer = 2.0 * m.hidden * 2 * m.head_dim +
                           2.0 * m.hidden * m.kv_heads * m.head_dim +
                           3.0 * m.hidden * m.intermediate;
  const double lin = 6.0 * (2 * per_layer + (double)m.hidden * m.vocab) * (double)len[0] / 1e12;
  const double once = 1e-4 * 2, attn = cost0 - lin - once;
  const double want = once + (1.01 * attn + lin) / k;
  assert_true(fabs(s.share[0] - want) <= 1e-9 * want);
  assert_true(rep2.max_before < rep.max_before);
  assert_true(rep2.max_before < cost0); /* below any whole-document assignment */
  double busy = 0, sum = 0;
  for (int32_t i = 0; i < N; i++) busy += s.num_ranks[i] * s.share[i];
  for (int32_t r = 0; r < R; r++) {
    assert_true(before2[r] == s.rank_load[r]);
    sum += s.rank_load[r] - s.rank_idle[r];
  }
  assert_true(fabs(sum - busy) <= 1e-9 * busy);
  /* with the linear layers' per-sequence constant, every rank of the group pays it whole */
  {
    mtrain_balance_predictor_t *pl = make_predictor_lin(16384, 0.5);
    mtrain_balance_split_t sl;
    assert_int_equal(
        mtrain_balance_batch_split(pl, len, N, NULL, &o, &so, &sl, NULL, NULL, NULL, NULL),
        MTRAIN_SUCCESS);
    double c0 = 0;
    assert_int_equal(mtrain_balance_predict(pl, len[0], NULL, &c0), MTRAIN_SUCCESS);
    assert_true(fabs(c0 - (cost0 + 0.5)) <= 1e-12 * c0);
    const int32_t kl = sl.num_ranks[0];
    assert_true(kl >= 2);
    const double wl = once + 0.5 + (1.01 * attn + lin) / kl;
    assert_true(fabs(sl.share[0] - wl) <= 1e-9 * wl);
    mtrain_balance_split_free(&sl);
    mtrain_balance_predictor_destroy(pl);
  }
  print_message("batch split: max/mean %.4f -> %.4f, document 0 over %d ranks (%.3f s each of "
                "%.3f s)\n",
                rep.max_before / rep.mean_before, rep2.max_before / rep2.mean_before, k, s.share[0],
                cost0);
  mtrain_balance_split_free(&s);
  /* with tuning: levels within bounds, the step never lengthened, deterministic */
  o.tune = 1;
  o.min_level = 1;
  for (int t = 0; t < 2; t++) {
    assert_int_equal(mtrain_balance_batch_split(p, len, N, mass, &o, &so, &s, t ? lv2 : lv, NULL,
                                                t ? after2 : after, t ? &rep2 : &rep),
                     MTRAIN_SUCCESS);
    mtrain_balance_split_free(&s);
  }
  assert_memory_equal(lv, lv2, sizeof lv);
  assert_memory_equal(after, after2, sizeof after);
  assert_memory_equal(&rep, &rep2, sizeof rep);
  for (int j = 0; j < R * 4; j++) assert_true(lv[j] >= 1 && lv[j] <= 3);
  assert_true(rep.max_after <= rep.max_before * (1 + 1e-12));
  assert_true(rep.recall_after > 0 && rep.recall_after <= 1);
  /* token-count batching with splitting splits by tokens */
  o.tune = 0;
  o.method = MTRAIN_BATCH_TOKENS;
  assert_int_equal(
      mtrain_balance_batch_split(p, len, N, NULL, &o, &so, &s, NULL, NULL, NULL, &rep2),
      MTRAIN_SUCCESS);
  assert_true(s.num_ranks[0] >= 2);
  mtrain_balance_split_free(&s);
  mtrain_balance_predictor_destroy(p);
}

/* ---- bad inputs ------------------------------------------------------------------------------ */

static void test_bad_inputs(void **state) {
  (void)state;
  const double w[3] = {5, 1, 1};
  mtrain_balance_split_t s;
  mtrain_balance_split_options_t o = MTRAIN_BALANCE_SPLIT_INIT;
  o.split_above = -1;
  TS_ASSERT_STATUS(mtrain_balance_assign_split(w, NULL, NULL, 3, 2, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_ERR_INVALID_ARGUMENT, "split_above -1");
  assert_null(s.rank_of);
  o.split_above = NAN;
  TS_ASSERT_STATUS(mtrain_balance_assign_split(w, NULL, NULL, 3, 2, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_ERR_INVALID_ARGUMENT, "split_above");
  o.split_above = 1;
  o.ring_overhead = 0.9;
  TS_ASSERT_STATUS(mtrain_balance_assign_split(w, NULL, NULL, 3, 2, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_ERR_INVALID_ARGUMENT, "ring_overhead 0.9 must be finite and >= 1");
  o.ring_overhead = 1.01;
  o.max_ranks = 3;
  TS_ASSERT_STATUS(mtrain_balance_assign_split(w, NULL, NULL, 3, 2, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_ERR_INVALID_ARGUMENT, "max_ranks 3 must be in [0, ranks 2]");
  o.max_ranks = 0;
  TS_ASSERT_STATUS(mtrain_balance_assign_split(w, NULL, NULL, 3, 2, 1, MTRAIN_BATCH_SORTED, &o, &s),
                   MTRAIN_ERR_INVALID_ARGUMENT, "not sorted");
  const double bad_ring[3] = {1, -1, 0}, big_ring[3] = {4, 1, 1}, fixed[3] = {2, 0, 0};
  TS_ASSERT_STATUS(
      mtrain_balance_assign_split(w, bad_ring, NULL, 3, 2, 1, MTRAIN_BATCH_COST, &o, &s),
      MTRAIN_ERR_INVALID_ARGUMENT, "ring_part[1] = -1");
  TS_ASSERT_STATUS(
      mtrain_balance_assign_split(w, big_ring, fixed, 3, 2, 1, MTRAIN_BATCH_COST, &o, &s),
      MTRAIN_ERR_INVALID_ARGUMENT, "ring_part[0] + fixed_part[0] = 6 exceeds weights[0] = 5");
  const double nan_w[3] = {5, NAN, 1};
  TS_ASSERT_STATUS(
      mtrain_balance_assign_split(nan_w, NULL, NULL, 3, 2, 1, MTRAIN_BATCH_COST, &o, &s),
      MTRAIN_ERR_INVALID_ARGUMENT, "weights[1]");
  TS_ASSERT_STATUS(mtrain_balance_assign_split(w, NULL, NULL, 0, 2, 1, MTRAIN_BATCH_COST, &o, &s),
                   MTRAIN_ERR_INVALID_ARGUMENT, "at least one");
  TS_ASSERT_STATUS(mtrain_balance_assign_split(w, NULL, NULL, 3, 2, 1, MTRAIN_BATCH_COST, &o, NULL),
                   MTRAIN_ERR_NULL_POINTER, "out");
  /* through the batch call */
  mtrain_balance_predictor_t *p = make_predictor(0);
  const int64_t len[3] = {1000, 2000, 3000};
  mtrain_balance_batch_options_t bo = MTRAIN_BALANCE_BATCH_INIT;
  bo.ranks = 2;
  bo.tune = 0;
  o.ring_overhead = 0.5;
  TS_ASSERT_STATUS(mtrain_balance_batch_split(p, len, 3, NULL, &bo, &o, &s, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT, "ring_overhead 0.5");
  assert_null(s.rank_of);
  o.ring_overhead = 1.01;
  bo.method = MTRAIN_BATCH_SORTED;
  TS_ASSERT_STATUS(mtrain_balance_batch_split(p, len, 3, NULL, &bo, &o, &s, NULL, NULL, NULL, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT,
                   "splitting needs the cost (0) or tokens (1) method");
  bo.method = MTRAIN_BATCH_COST;
  const int64_t zero[2] = {5, 0};
  TS_ASSERT_STATUS(
      mtrain_balance_batch_split(p, zero, 2, NULL, &bo, &o, &s, NULL, NULL, NULL, NULL),
      MTRAIN_ERR_INVALID_ARGUMENT, "lengths[1] = 0");
  TS_ASSERT_STATUS(
      mtrain_balance_batch_split(p, len, 3, NULL, &bo, &o, NULL, NULL, NULL, NULL, NULL),
      MTRAIN_ERR_NULL_POINTER, "out");
  mtrain_balance_predictor_destroy(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_off_equals_assign), cmocka_unit_test(test_split_large_document),
      cmocka_unit_test(test_split_properties),  cmocka_unit_test(test_batch_split),
      cmocka_unit_test(test_bad_inputs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
