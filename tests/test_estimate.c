/* test_estimate.c: online pattern estimation (SPEC.md section 2). The
 * selection rules (ties, forced sinks and window, clamping, the top-p rule
 * with and without forced candidates, token to block diagonals) on hand-made
 * scores; the estimate of "cpu-ref" against an independent brute-force
 * implementation of the section written here (bitwise equal sets); "cpu"
 * against it with the allowed near-tie differences; both budget modes and
 * mixed heads, GQA, lengths that are not multiples of G, L > G; top-p with
 * the sinks and the window forced (top_p_forced = 1) on random and
 * structured inputs: sinks beyond the candidates, a window beyond N, caps
 * below the forced prefixes, forced mass alone above p; bad inputs. Seeds
 * are printed (MTRAIN_TEST_SEED overrides them). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/select.h"
#include "mtrain/mtrain_cpu.h"
#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

/* ---- selection rules ---------------------------------------------------- */

static void test_top_k_ties_and_forced(void **state) {
  (void)state;
  const double s[6] = {1.0, 3.0, 3.0, 2.0, NAN, 3.0};
  int64_t order[6], out[6];
  int64_t n = mtrain_select_top_k(s, NULL, 6, 2, order, out);
  assert_int_equal(n, 2);
  assert_int_equal(out[0], 1); /* three tie at 3.0: the two lowest indices */
  assert_int_equal(out[1], 2);
  const uint8_t forced[6] = {1, 0, 0, 0, 0, 0};
  n = mtrain_select_top_k(s, forced, 6, 2, order, out);
  assert_int_equal(n, 2);
  assert_int_equal(out[0], 0);
  assert_int_equal(out[1], 1);
  n = mtrain_select_top_k(s, NULL, 6, 100, order, out); /* clamped */
  assert_int_equal(n, 6);
  n = mtrain_select_top_k(s, NULL, 5, 5, order, out); /* NaN ranks last but is kept if asked */
  assert_int_equal(n, 5);
  assert_int_equal(mtrain_select_top_k(s, NULL, 6, 0, order, out), 0);
}

static void test_top_p_rule(void **state) {
  (void)state;
  /* exact binary fractions: sorted 0.5, 0.25, 0.125, 0.0625, 0.03125 with
   * prefix sums 0.5, 0.75, 0.875, 0.9375, 0.96875 */
  const double s[5] = {0.0625, 0.5, 0.125, 0.25, 0.03125};
  int64_t order[5], out[5];
  assert_int_equal(mtrain_select_top_p(s, NULL, 5, 0.9, 10, order, out), 3); /* 0.875 < 0.9 */
  assert_int_equal(out[0], 1);
  assert_int_equal(out[1], 2);
  assert_int_equal(out[2], 3);
  assert_int_equal(mtrain_select_top_p(s, NULL, 5, 0.875, 10, order, out), 2); /* not < 0.875 */
  assert_int_equal(mtrain_select_top_p(s, NULL, 5, 1.0, 10, order, out), 5);
  assert_int_equal(mtrain_select_top_p(s, NULL, 5, 0.9, 1, order, out), 1);  /* cap */
  assert_int_equal(mtrain_select_top_p(s, NULL, 5, 0.5, 10, order, out), 0); /* top alone >= p */
}

/* Top-p with forced candidates (top_p_forced): they rank first, lowest
 * index first, and are kept whatever the sum, which they join; the cap
 * counts them first. */
static void test_top_p_forced_rule(void **state) {
  (void)state;
  /* forced 0 and 4 (0.0625 + 0.03125 = 0.09375), then 0.5, 0.25, 0.125 */
  const double s[5] = {0.0625, 0.5, 0.125, 0.25, 0.03125};
  const uint8_t forced[5] = {1, 0, 0, 0, 1};
  int64_t order[5], out[5];
  /* 0.59375 and 0.84375 < 0.9; 0.96875 is not */
  assert_int_equal(mtrain_select_top_p(s, forced, 5, 0.9, 10, order, out), 4);
  assert_int_equal(out[0], 0);
  assert_int_equal(out[1], 1);
  assert_int_equal(out[2], 3);
  assert_int_equal(out[3], 4);
  /* the forced mass alone reaches p: only the forced candidates */
  assert_int_equal(mtrain_select_top_p(s, forced, 5, 0.05, 10, order, out), 2);
  assert_int_equal(out[0], 0);
  assert_int_equal(out[1], 4);
  /* a cap below the forced count keeps the lowest forced indices */
  assert_int_equal(mtrain_select_top_p(s, forced, 5, 0.9, 1, order, out), 1);
  assert_int_equal(out[0], 0);
  /* a cap of 3: both forced, then the best other */
  assert_int_equal(mtrain_select_top_p(s, forced, 5, 1.0, 3, order, out), 3);
  assert_int_equal(out[0], 0);
  assert_int_equal(out[1], 1);
  assert_int_equal(out[2], 4);
  /* a NaN forced score is kept and poisons the sum: nothing else */
  const double t[4] = {NAN, 0.5, 0.25, 0.125};
  const uint8_t f1[4] = {1, 0, 0, 0};
  assert_int_equal(mtrain_select_top_p(t, f1, 4, 1.0, 10, order, out), 1);
  assert_int_equal(out[0], 0);
  /* no forced candidate marked: the plain rule (0.5 then 0.75 < 0.8; 0.875 is not) */
  const uint8_t none[4] = {0, 0, 0, 0};
  assert_int_equal(mtrain_select_top_p(t + 1, none, 3, 0.8, 10, order, out), 2);
}

static void test_token_to_block_diagonals(void **state) {
  (void)state;
  int32_t out[32];
  /* G = 128: t = 0 -> 0; 5 -> 0,1; 128 -> 1; 300 -> 2,3; 1000 -> 7 and 8 (8 dropped: nb = 8) */
  const int64_t tokens[] = {0, 5, 128, 300, 1000};
  const int32_t n = mtrain_token_to_block_diagonals(tokens, 5, 128, 8, out);
  const int32_t want[] = {0, 1, 2, 3, 7};
  assert_int_equal(n, 5);
  for (int i = 0; i < 5; i++) assert_int_equal(out[i], want[i]);
  assert_int_equal(mtrain_token_to_block_diagonals(tokens, 0, 128, 8, out), 1); /* only 0 */
}

/* ---- brute force of SPEC.md section 2 ----------------------------------- */

/* The column and slash scores of head h, straight from the definitions. */
static void brute_scores(const double *q, const double *k, int64_t N, int32_t Hq, int32_t Hkv,
                         int32_t d, int32_t L, int32_t G, int32_t h, int probs, double *vs,
                         double *ss) {
  const double scale = 1.0 / sqrt((double)d);
  const int32_t hk = h / (Hq / Hkv), slots = (L + G - 1) / G + 1;
  double *A = malloc(sizeof(double) * (size_t)(L * N));
  for (int32_t r = 0; r < L; r++) {
    const int64_t qpos = N - L + r;
    double mx = -INFINITY;
    for (int64_t j = 0; j <= qpos; j++) {
      double dot = 0.0;
      for (int32_t x = 0; x < d; x++) dot += q[(qpos * Hq + h) * d + x] * k[(j * Hkv + hk) * d + x];
      A[r * N + j] = scale * dot;
      if (A[r * N + j] > mx) mx = A[r * N + j];
    }
    if (!probs) continue;
    double norm = 0.0; /* per key block in key order, blocks in order */
    for (int64_t b = 0; b * G <= qpos; b++) {
      double part = 0.0;
      for (int64_t j = b * G; j < (b + 1) * G && j <= qpos; j++) part += exp(A[r * N + j] - mx);
      norm += part;
    }
    for (int64_t j = 0; j <= qpos; j++) A[r * N + j] = exp(A[r * N + j] - mx) / norm / L;
  }
  for (int64_t j = 0; j < N; j++) {
    vs[j] = 0.0;
    for (int32_t r = 0; r < L; r++)
      if (j <= N - L + r) vs[j] += A[r * N + j];
  }
  for (int64_t t = 0; t < N; t++) {
    double *part = calloc((size_t)slots, sizeof(double));
    const int64_t b0 = (N - L - t > 0 ? N - L - t : 0) / G;
    for (int32_t r = 0; r < L; r++) {
      const int64_t j = N - L + r - t;
      if (j >= 0) part[j / G - b0] += A[r * N + j];
    }
    ss[t] = 0.0;
    for (int32_t s = 0; s < slots; s++) ss[t] += part[s];
    free(part);
  }
  free(A);
}

/* Naive selection, independent of select.c: repeatedly the highest score
 * among those not yet taken (forced first, ties to the lower index, NaN
 * lowest); returns the taken indices in the order taken. */
static int64_t naive_rank(const double *sc, const uint8_t *forced, int64_t n, int64_t count,
                          int64_t *taken) {
  uint8_t *used = calloc((size_t)n + 1, 1);
  int64_t m = 0;
  for (; m < count && m < n; m++) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++) {
      if (used[i]) continue;
      if (best < 0) {
        best = i;
        continue;
      }
      const double x = forced && forced[i] ? INFINITY : (isnan(sc[i]) ? -INFINITY : sc[i]);
      const double y = forced && forced[best] ? INFINITY : (isnan(sc[best]) ? -INFINITY : sc[best]);
      if (x > y) best = i;
    }
    used[best] = 1;
    taken[m] = best;
  }
  free(used);
  return m;
}

static int cmp_i64(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static int64_t naive_top_k(const double *sc, const uint8_t *forced, int64_t n, int64_t k,
                           int64_t *out) {
  const int64_t m = naive_rank(sc, forced, n, k, out);
  qsort(out, (size_t)m, sizeof *out, cmp_i64);
  return m;
}

/* Top-p: walk down the naive ranking (forced first); a forced candidate is
 * kept and its score added whatever the sum, another while the sum with it
 * stays below p; at most cap in all. */
static int64_t naive_top_p(const double *sc, const uint8_t *forced, int64_t n, double p,
                           int64_t cap, int64_t *out) {
  const int64_t m = naive_rank(sc, forced, n, n, out);
  double sum = 0.0;
  int64_t count = 0;
  while (count < m && count < cap) {
    const int64_t j = out[count];
    if (!(forced && forced[j]) && !(sum + sc[j] < p)) break;
    sum += sc[j];
    count++;
  }
  qsort(out, (size_t)count, sizeof *out, cmp_i64);
  return count;
}

/* The expected head from the scores: indices picked by the spec's rules
 * (the sinks and the window forced in top-k mode, and in top-p mode with
 * o->top_p_forced). */
static void brute_select(const mtrain_head_budget_t *b, const mtrain_estimate_options_t *o,
                         const double *vs, const double *ss, int64_t N, int32_t G, int64_t *verts,
                         int64_t *nv, int64_t *slashes, int64_t *ns) {
  const int64_t nv_cand = ((N - 1) / G) * G;
  const int top_k = b->kind == MTRAIN_BUDGET_TOP_K, force = top_k || o->top_p_forced;
  uint8_t *fv = calloc((size_t)N, 1), *fs = calloc((size_t)N, 1);
  for (int64_t j = 0; force && j < o->num_sinks && j < nv_cand; j++) fv[j] = 1;
  for (int64_t t = 0; force && t < o->window && t < N; t++) fs[t] = 1;
  if (top_k) {
    *nv = naive_top_k(vs, fv, nv_cand, b->v_size, verts);
    *ns = naive_top_k(ss, fs, N, b->s_size, slashes);
  } else {
    *nv = naive_top_p(vs, force ? fv : NULL, nv_cand, b->p_v, b->cap_v, verts);
    *ns = naive_top_p(ss, force ? fs : NULL, N, b->p_s, b->cap_s, slashes);
  }
  free(fv);
  free(fs);
}

/* The selection (quickselect + sort of the best) against the naive one, on
 * scores with many ties, forced candidates and NaN. */
static void test_selection_matches_naive(void **state) {
  (void)state;
  ts_rng_t rng;
  ts_rng_seed(&rng, ts_seed(77));
  for (int it = 0; it < 300; it++) {
    const int64_t n = 1 + ts_rng_below(&rng, 300);
    double *sc = malloc(sizeof(double) * (size_t)n);
    uint8_t *forced = calloc((size_t)n, 1);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)n), *a = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *b = malloc(sizeof(int64_t) * (size_t)n);
    const int levels = 1 + (int)ts_rng_below(&rng, 6);
    for (int64_t i = 0; i < n; i++) {
      sc[i] = (double)ts_rng_below(&rng, levels) / levels;
      if (ts_rng_below(&rng, 50) == 0) sc[i] = NAN;
      forced[i] = ts_rng_below(&rng, 20) == 0;
    }
    const int64_t k = ts_rng_below(&rng, n + 5);
    const int64_t na = mtrain_select_top_k(sc, forced, n, k, order, a);
    const int64_t nb = naive_top_k(sc, forced, n, k, b);
    if (na != nb || memcmp(a, b, sizeof(int64_t) * (size_t)na) != 0)
      fail_msg("top-k differs from the naive selection: n=%lld k=%lld iteration %d", (long long)n,
               (long long)k, it);
    for (int64_t i = 0; i < n; i++)
      if (isnan(sc[i])) sc[i] = 0.0; /* top-p scores are probabilities */
    const double p = ts_rng_uniform(&rng) * 1.5;
    const int64_t cap = ts_rng_below(&rng, n + 3);
    const int64_t pa = mtrain_select_top_p(sc, NULL, n, p, cap, order, a);
    const int64_t pb = naive_top_p(sc, NULL, n, p, cap, b);
    if (pa != pb || memcmp(a, b, sizeof(int64_t) * (size_t)pa) != 0)
      fail_msg("top-p differs from the naive selection: n=%lld p=%g cap=%lld iteration %d",
               (long long)n, p, (long long)cap, it);
    /* forced candidates: a prefix (as the estimate forces them; its length
     * from the iteration, so the draws above stay those of before) or the
     * scattered ones of the top-k check */
    const int64_t prefix = ((int64_t)it * 7) % (n + 3);
    for (int64_t i = 0; it % 2 == 0 && i < n; i++) forced[i] = i < prefix;
    const int64_t fa = mtrain_select_top_p(sc, forced, n, p, cap, order, a);
    const int64_t fb = naive_top_p(sc, forced, n, p, cap, b);
    if (fa != fb || memcmp(a, b, sizeof(int64_t) * (size_t)fa) != 0)
      fail_msg("forced top-p differs from the naive selection: n=%lld p=%g cap=%lld %s "
               "iteration %d",
               (long long)n, p, (long long)cap, it % 2 == 0 ? "prefix" : "scattered", it);
    free(sc), free(forced), free(order), free(a), free(b);
  }
}

typedef struct est_case {
  int64_t N;
  int32_t Hq, Hkv, d, G, L;
  int mixed; /* 1: even heads top-k, odd heads top-p; else all top-k or (2) all top-p */
  uint64_t seed;
} est_case_t;

static mtrain_head_budget_t budget_for(const est_case_t *c, int32_t h) {
  mtrain_head_budget_t b = {0};
  const int top_p = c->mixed == 2 || (c->mixed == 1 && (h % 2));
  if (top_p) {
    b.kind = MTRAIN_BUDGET_TOP_P;
    b.p_v = 0.5 + 0.1 * (h % 4);
    b.p_s = 0.9;
    b.cap_v = 40;
    b.cap_s = 4096;
  } else {
    b.kind = MTRAIN_BUDGET_TOP_K;
    b.v_size = 35 + 7 * h;
    b.s_size = 110 + 13 * h;
  }
  return b;
}

/* Runs the estimate on backend `name` with dtype fp64 (cpu-ref) or fp32,
 * with the options `o` (last_q set to the case's L). */
static mtrain_pattern_t *estimate_on(const char *name, const est_case_t *c, const double *q,
                                     const double *k, const mtrain_head_budget_t *budgets,
                                     const mtrain_estimate_options_t *o) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = name;
  cfg.granularity = c->G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  const int is_ref = strcmp(name, "cpu-ref") == 0;
  const mtrain_dtype_t dt = is_ref ? MTRAIN_F64 : MTRAIN_F32;
  const int64_t nq = c->N * c->Hq * c->d, nk = c->N * c->Hkv * c->d;
  void *qb = malloc(mtrain_dtype_size(dt) * (size_t)nq),
       *kb = malloc(mtrain_dtype_size(dt) * (size_t)nk);
  mtrain_convert(q, MTRAIN_F64, qb, dt, nq);
  mtrain_convert(k, MTRAIN_F64, kb, dt, nk);
  mtrain_tensor_t tq = mtrain_tensor_3d(qb, dt, c->N, c->Hq, c->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(kb, dt, c->N, c->Hkv, c->d);
  mtrain_estimate_options_t opt = *o;
  opt.last_q = c->L;
  mtrain_pattern_t *p = NULL;
  mtrain_status_t st = mtrain_pattern_estimate(ctx, &tq, &tk, budgets, &opt, &p);
  if (st != MTRAIN_SUCCESS) fail_msg("estimate on %s: %s", name, mtrain_last_error());
  free(qb);
  free(kb);
  mtrain_context_destroy(ctx);
  return p;
}

static int64_t count_outside(const int64_t *a, int64_t na, const int64_t *b, int64_t nb,
                             int64_t *diff) {
  int64_t n = 0;
  for (int64_t i = 0; i < na; i++) {
    int found = 0;
    for (int64_t j = 0; j < nb && !found; j++) found = a[i] == b[j];
    if (!found) diff[n++] = a[i];
  }
  return n;
}

/* Every index in which got and want differ scores within 1e-5 relative of
 * the selection threshold (the lowest kept score of want). */
static void expect_near_ties(const char *what, const est_case_t *c, int32_t h, const double *score,
                             const int64_t *want, int64_t nw, const int64_t *got, int64_t ng,
                             int64_t num_forced) {
  double threshold = INFINITY; /* forced candidates (sinks) do not set it */
  for (int64_t i = 0; i < nw; i++)
    if (want[i] >= num_forced && score[want[i]] < threshold) threshold = score[want[i]];
  int64_t *diff = malloc(sizeof(int64_t) * (size_t)(nw + ng + 1));
  int64_t nd = count_outside(want, nw, got, ng, diff);
  nd += count_outside(got, ng, want, nw, diff + nd);
  for (int64_t i = 0; i < nd; i++) {
    const double sc = score[diff[i]];
    if (isinf(threshold) || fabs(sc - threshold) > 1e-5 * fabs(threshold) + 1e-12)
      fail_msg("%s: N=%lld G=%d L=%d seed=%llu head %d: index %lld (score %.17g) differs, "
               "threshold %.17g",
               what, (long long)c->N, c->G, c->L, (unsigned long long)c->seed, h,
               (long long)diff[i], sc, threshold);
  }
  free(diff);
}

/* With top_p_forced, the forced part of a top-p head's pattern: the first
 * min(num_sinks, candidates, cap_v) keys are verticals, and the block
 * diagonals of token diagonals 0 .. min(window, N, cap_s) - 1 are in; with
 * `only`, nothing else is (the forced mass alone reached p). */
static void expect_forced(const est_case_t *c, const mtrain_estimate_options_t *o,
                          const mtrain_head_budget_t *b, int32_t h, const mtrain_pattern_t *p,
                          int only) {
  const int64_t nv_cand = ((c->N - 1) / c->G) * c->G, nb = (c->N + c->G - 1) / c->G;
  int64_t fv = o->num_sinks < nv_cand ? o->num_sinks : nv_cand;
  int64_t fs = o->window < c->N ? o->window : c->N;
  fv = fv < b->cap_v ? fv : b->cap_v;
  fs = fs < b->cap_s ? fs : b->cap_s;
  const int32_t *d;
  const int64_t *v;
  int32_t nd, nv;
  assert_int_equal(mtrain_pattern_get_head(p, h, &d, &nd, &v, &nv), MTRAIN_SUCCESS);
  uint8_t *want = calloc((size_t)nb, 1), *have = calloc((size_t)nb, 1);
  want[0] = 1;
  for (int64_t t = 0; t < fs; t++) {
    want[t / c->G] = 1;
    if (t % c->G && t / c->G + 1 < nb) want[t / c->G + 1] = 1;
  }
  for (int32_t i = 0; i < nd; i++) have[d[i]] = 1;
  for (int64_t j = 0; j < fv; j++)
    if (j >= nv || v[j] != j)
      fail_msg("seed %llu head %d: sink key %lld is not a vertical (top_p_forced)",
               (unsigned long long)c->seed, h, (long long)j);
  for (int64_t a = 0; a < nb; a++)
    if (want[a] && !have[a])
      fail_msg("seed %llu head %d: block diagonal %lld of the forced window (%lld tokens) "
               "missing (top_p_forced)",
               (unsigned long long)c->seed, h, (long long)a, (long long)fs);
  if (only) {
    int32_t nwant = 0;
    for (int64_t a = 0; a < nb; a++) nwant += want[a];
    if (nv != fv || nd != nwant)
      fail_msg("seed %llu head %d: %d verticals and %d block diagonals, the forced ones alone "
               "are %lld and %d (their mass reaches p)",
               (unsigned long long)c->seed, h, nv, nd, (long long)fv, nwant);
  }
  free(want);
  free(have);
}

/* One case: q and k (N(0, 1.5) or structured), the estimate of cpu-ref
 * against the brute force bitwise, cpu's within near-ties; `tp` (may be
 * NULL) replaces the top-p heads' budget; with o->top_p_forced the forced
 * part of every top-p head is checked (`only`: and nothing else kept). */
static void brute_force_case(const est_case_t *c, const mtrain_estimate_options_t *o,
                             const mtrain_head_budget_t *tp, int structured, int only) {
  const uint64_t seed = ts_seed(c->seed);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  const int64_t nq = c->N * c->Hq * c->d, nk = c->N * c->Hkv * c->d;
  double *q = malloc(sizeof(double) * (size_t)nq), *k = malloc(sizeof(double) * (size_t)nk);
  if (structured) {
    double *v = malloc(sizeof(double) * (size_t)nk);
    mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F64, c->N, c->Hq, c->d);
    mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F64, c->N, c->Hkv, c->d);
    mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F64, c->N, c->Hkv, c->d);
    mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
    so.seed = seed;
    assert_int_equal(mtrain_generate_structured(&so, &tq, &tk, &tv), MTRAIN_SUCCESS);
    free(v);
  } else {
    ts_fill_normal(&rng, q, MTRAIN_F64, nq, 1.5, NULL);
    ts_fill_normal(&rng, k, MTRAIN_F64, nk, 1.5, NULL);
  }
  /* fp32-representable values so the fp32 run sees the same inputs */
  for (int64_t i = 0; i < nq; i++) q[i] = (float)q[i];
  for (int64_t i = 0; i < nk; i++) k[i] = (float)k[i];
  mtrain_head_budget_t *budgets = malloc(sizeof *budgets * (size_t)c->Hq);
  for (int32_t h = 0; h < c->Hq; h++) {
    budgets[h] = budget_for(c, h);
    if (tp && budgets[h].kind == MTRAIN_BUDGET_TOP_P) budgets[h] = *tp;
  }
  mtrain_pattern_t *ref = estimate_on("cpu-ref", c, q, k, budgets, o);
  mtrain_pattern_t *fast = estimate_on("cpu", c, q, k, budgets, o);
  const int32_t L = c->L < c->N ? c->L : (int32_t)c->N;
  const int64_t nb = (c->N + c->G - 1) / c->G, nv_cand = ((c->N - 1) / c->G) * c->G;
  double *vs = malloc(sizeof(double) * (size_t)c->N), *ss = malloc(sizeof(double) * (size_t)c->N);
  int64_t *verts = malloc(sizeof(int64_t) * (size_t)c->N),
          *sl = malloc(sizeof(int64_t) * (size_t)c->N);
  int32_t *blocks = malloc(sizeof(int32_t) * (size_t)(2 * c->N + 1));
  for (int32_t h = 0; h < c->Hq; h++) {
    const int top_p = budgets[h].kind == MTRAIN_BUDGET_TOP_P;
    brute_scores(q, k, c->N, c->Hq, c->Hkv, c->d, L, c->G, h, top_p, vs, ss);
    int64_t nv, ns;
    brute_select(&budgets[h], o, vs, ss, c->N, c->G, verts, &nv, sl, &ns);
    const int32_t nd = mtrain_token_to_block_diagonals(sl, ns, c->G, nb, blocks);
    const int32_t *rd, *fd;
    const int64_t *rv, *fv;
    int32_t rnd, rnv, fnd, fnv;
    assert_int_equal(mtrain_pattern_get_head(ref, h, &rd, &rnd, &rv, &rnv), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_pattern_get_head(fast, h, &fd, &fnd, &fv, &fnv), MTRAIN_SUCCESS);
    /* cpu-ref: bitwise the brute force's sets */
    if (rnv != nv || (nv > 0 && memcmp(rv, verts, sizeof(int64_t) * (size_t)nv) != 0) ||
        rnd != nd || memcmp(rd, blocks, sizeof(int32_t) * (size_t)nd) != 0)
      fail_msg("cpu-ref differs from the brute force: N=%lld seed %llu head %d top_p_forced %d "
               "(verticals %d vs %lld, diagonals %d vs %d)",
               (long long)c->N, (unsigned long long)seed, h, o->top_p_forced, rnv, (long long)nv,
               rnd, nd);
    /* cpu: the same verticals up to near-ties */
    int64_t *fv64 = malloc(sizeof(int64_t) * (size_t)(fnv + 1));
    if (fnv > 0) memcpy(fv64, fv, sizeof(int64_t) * (size_t)fnv);
    const int64_t sinks = o->num_sinks < nv_cand ? o->num_sinks : nv_cand;
    expect_near_ties("cpu verticals", c, h, vs, verts, nv, fv64, fnv,
                     !top_p || o->top_p_forced ? sinks : 0);
    free(fv64);
    if (top_p && o->top_p_forced) {
      expect_forced(c, o, &budgets[h], h, ref, only);
      expect_forced(c, o, &budgets[h], h, fast, only);
    }
  }
  print_message("estimate: N=%lld G=%d L=%d heads %d:%d mode %d sinks %d window %d top_p_forced "
                "%d%s seed %llu: ok\n",
                (long long)c->N, c->G, L, c->Hq, c->Hkv, c->mixed, o->num_sinks, o->window,
                o->top_p_forced, structured ? " structured" : "", (unsigned long long)seed);
  free(vs), free(ss), free(verts), free(sl), free(blocks);
  mtrain_pattern_destroy(ref);
  mtrain_pattern_destroy(fast);
  free(budgets), free(q), free(k);
}

static void test_estimate_against_brute_force(void **state) {
  (void)state;
  const est_case_t cases[] = {
      {700, 4, 2, 32, 128, 64, 0, 1}, {515, 4, 1, 16, 64, 64, 2, 2},
      {300, 2, 2, 64, 32, 40, 1, 3},  {1000, 4, 2, 32, 128, 200, 1, 4},
      {129, 2, 1, 16, 128, 64, 0, 5}, {64, 2, 2, 16, 128, 64, 2, 6},
  };
  const mtrain_estimate_options_t o = MTRAIN_ESTIMATE_INIT;
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
    brute_force_case(&cases[ci], &o, NULL, 0, 0);
}

/* top_p_forced = 1: top-p heads keep the sinks and the window, then add by
 * mass; against the brute force of the rule. */
static void test_estimate_top_p_forced(void **state) {
  (void)state;
  const struct {
    est_case_t c;
    int32_t sinks, window;
    mtrain_head_budget_t tp; /* kind 0 (top-k): budget_for's top-p budgets */
    int structured, only;
  } cases[] = {
      /* GQA, N not a multiple of G, the default sinks and window */
      {{700, 4, 2, 32, 128, 64, 2, 21}, 30, 100, {0}, 0, 0},
      /* mixed heads; sinks beyond the candidates (512), a window beyond N: every
       * candidate forced, the vertical cap (40) below the forced prefix */
      {{515, 4, 1, 16, 64, 64, 1, 22}, 600, 700, {0}, 0, 0},
      /* small prefixes, L > G */
      {{300, 2, 2, 64, 32, 40, 2, 23}, 5, 3, {0}, 0, 0},
      /* caps below both forced prefixes: the lowest forced indices */
      {{260, 2, 2, 16, 16, 32, 2, 25},
       30,
       100,
       {MTRAIN_BUDGET_TOP_P, 0, 0, 0.9, 0.9, 10, 20},
       0,
       0},
      /* the forced mass alone reaches p: only the forced candidates */
      {{400, 2, 1, 16, 32, 64, 2, 24},
       300,
       350,
       {MTRAIN_BUDGET_TOP_P, 0, 0, 0.3, 0.3, 1000, 1000},
       0,
       1},
      /* structured inputs (RoPE'd, vertical-slash structure), mixed heads, GQA */
      {{1100, 4, 2, 64, 64, 64, 1, 26}, 30, 100, {0}, 1, 0},
      {{2048, 4, 2, 64, 128, 64, 2, 27},
       30,
       100,
       {MTRAIN_BUDGET_TOP_P, 0, 0, 0.5, 0.3, 64, 32},
       1,
       0},
  };
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    mtrain_estimate_options_t o = MTRAIN_ESTIMATE_INIT;
    o.num_sinks = cases[ci].sinks;
    o.window = cases[ci].window;
    o.top_p_forced = 1;
    const mtrain_head_budget_t *tp =
        cases[ci].tp.kind == MTRAIN_BUDGET_TOP_P ? &cases[ci].tp : NULL;
    brute_force_case(&cases[ci].c, &o, tp, cases[ci].structured, cases[ci].only);
    /* the same inputs without forcing: the brute force of the plain rule */
    o.top_p_forced = 0;
    brute_force_case(&cases[ci].c, &o, tp, cases[ci].structured, 0);
  }
}

static void test_estimate_bad_inputs(void **state) {
  (void)state;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = 16;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  float q[64 * 4 * 8] = {0}, k[64 * 2 * 8] = {0};
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, 64, 4, 8);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, 64, 2, 8);
  mtrain_head_budget_t b[4] = {{MTRAIN_BUDGET_TOP_K, 4, 4, 0, 0, 0, 0}};
  for (int h = 1; h < 4; h++) b[h] = b[0];
  mtrain_estimate_options_t opt = MTRAIN_ESTIMATE_INIT;
  mtrain_pattern_t *p = NULL;
  b[2].v_size = -1;
  TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p), MTRAIN_ERR_INVALID_BUDGET,
                   "budgets[2]");
  b[2] = b[0];
  b[1].kind = MTRAIN_BUDGET_TOP_P;
  b[1].p_v = 1.5;
  b[1].p_s = 0.5;
  TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p), MTRAIN_ERR_INVALID_BUDGET,
                   "(0, 1]");
  b[1] = b[0];
  tk.shape[1] = 3;
  TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p), MTRAIN_ERR_HEAD_MISMATCH,
                   "not a multiple");
  tk.shape[1] = 2;
  tk.shape[0] = 63;
  TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p), MTRAIN_ERR_SHAPE_MISMATCH,
                   "k has 63");
  tk.shape[0] = 64;
  opt.last_q = 0;
  TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p), MTRAIN_ERR_INVALID_ARGUMENT,
                   "last_q 0");
  opt.last_q = 64;
  /* top_p_forced is 0 or 1, refused by every entry point naming it */
  const int32_t bad_forced[2] = {2, -1};
  const int64_t offsets[3] = {0, 20, 64};
  const mtrain_seqs_t seqs = {2, offsets};
  mtrain_pattern_t *two[2] = {NULL, NULL};
  mtrain_plan_t *plan = NULL;
  for (int i = 0; i < 2; i++) {
    char want[64];
    snprintf(want, sizeof want, "top_p_forced %d", bad_forced[i]);
    opt.top_p_forced = bad_forced[i];
    TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p),
                     MTRAIN_ERR_INVALID_ARGUMENT, want);
    TS_ASSERT_STATUS(mtrain_pattern_estimate_batch(ctx, &seqs, &tq, &tk, b, &opt, two),
                     MTRAIN_ERR_INVALID_ARGUMENT, want);
    TS_ASSERT_STATUS(mtrain_plan_create_estimated(ctx, &seqs, &tq, &tk, b, &opt, &plan),
                     MTRAIN_ERR_INVALID_ARGUMENT, want);
    assert_null(p);
    assert_null(two[0]);
    assert_null(plan);
  }
  opt.top_p_forced = 1;
  assert_int_equal(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p), MTRAIN_SUCCESS);
  mtrain_pattern_destroy(p);
  p = NULL;
  opt.top_p_forced = 0;
  tk.dtype = MTRAIN_BF16;
  TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p),
                   MTRAIN_ERR_UNSUPPORTED_DTYPE, "k is bf16");
  tk.dtype = MTRAIN_F32;
  TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, NULL, &opt, &p), MTRAIN_ERR_NULL_POINTER,
                   "budgets");
  assert_null(p);
  assert_int_equal(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &p), MTRAIN_SUCCESS);
  mtrain_pattern_destroy(p);
  mtrain_context_destroy(ctx);
}

/* Pattern quality on structured inputs: the estimated pattern keeps far
 * more of the dense attention mass than a random pattern of the same
 * density (SPEC.md section 2; figures in docs/PATTERNS.md). */
static void test_estimated_recall_beats_random(void **state) {
  (void)state;
  const int64_t N = 2048;
  const int32_t Hq = 4, Hkv = 2, d = 64, G = 64;
  const int64_t nq = N * Hq * d, nk = N * Hkv * d;
  double *q = malloc(sizeof(double) * (size_t)nq), *k = malloc(sizeof(double) * (size_t)nk);
  double *v = malloc(sizeof(double) * (size_t)nk);
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F64, N, Hq, d);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F64, N, Hkv, d);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F64, N, Hkv, d);
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = ts_seed(2024);
  assert_int_equal(mtrain_generate_structured(&so, &tq, &tk, &tv), MTRAIN_SUCCESS);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cpu-ref";
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  const mtrain_head_budget_t modes[2] = {{MTRAIN_BUDGET_TOP_K, 64, 128, 0, 0, 0, 0},
                                         {MTRAIN_BUDGET_TOP_P, 0, 0, 0.5, 0.3, 64, 32}};
  for (int m = 0; m < 2; m++) {
    mtrain_head_budget_t b[4] = {modes[m], modes[m], modes[m], modes[m]};
    mtrain_estimate_options_t opt = MTRAIN_ESTIMATE_INIT;
    mtrain_pattern_t *est = NULL, *rnd = NULL;
    assert_int_equal(mtrain_pattern_estimate(ctx, &tq, &tk, b, &opt, &est), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_pattern_random_like(est, so.seed + 1, &rnd), MTRAIN_SUCCESS);
    double r_est = 0, r_rnd = 0;
    int64_t pairs = 0;
    for (int32_t h = 0; h < Hq; h++) pairs += mtrain_pattern_count_pairs(est, h);
    assert_int_equal(mtrain_cpu_pattern_recall(est, Hkv, d, 0, q, k, NULL, &r_est), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_cpu_pattern_recall(rnd, Hkv, d, 0, q, k, NULL, &r_rnd), MTRAIN_SUCCESS);
    const double density = (double)pairs / ((double)Hq * N * (N + 1) / 2);
    print_message("recall (%s, N=%lld, G=%d, seed %llu): estimated %.3f, random of the same "
                  "density %.3f, density %.3f\n",
                  m ? "top-p 0.5/0.3, caps 64/32" : "top-k 64/128", (long long)N, G,
                  (unsigned long long)so.seed, r_est, r_rnd, density);
    /* the estimate misses at most half the mass the random pattern misses */
    if (!(1.0 - r_est <= 0.5 * (1.0 - r_rnd) && r_est >= r_rnd + 0.1))
      fail_msg("estimated pattern recall %.3f is not far above random %.3f (seed %llu)", r_est,
               r_rnd, (unsigned long long)so.seed);
    mtrain_pattern_destroy(est);
    mtrain_pattern_destroy(rnd);
  }
  mtrain_context_destroy(ctx);
  free(q), free(k), free(v);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_top_k_ties_and_forced),
      cmocka_unit_test(test_top_p_rule),
      cmocka_unit_test(test_top_p_forced_rule),
      cmocka_unit_test(test_token_to_block_diagonals),
      cmocka_unit_test(test_selection_matches_naive),
      cmocka_unit_test(test_estimate_against_brute_force),
      cmocka_unit_test(test_estimate_top_p_forced),
      cmocka_unit_test(test_estimate_bad_inputs),
      cmocka_unit_test(test_estimated_recall_beats_random),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
