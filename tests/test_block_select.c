/* test_block_select.c: block-sparse selection (SPEC.md section 9).
 * - the block scores of both CPU backends against a brute force of the
 *   spec's formulas written here (precise masses from the dense fp64 LSE,
 *   strided antidiagonal estimates, mean-pooled gating), GQA, d 64 and 128,
 *   N not a multiple of G;
 * - the selection (forced sink and local blocks, top-k, top-p, ties towards
 *   the lower key block, NaN last) against a brute force here;
 * - cpu-ref end to end equals the brute-force selection of the brute-force
 *   scores; the precise method's per-head recall equals the pattern's
 *   recall (mtrain_cpu_pattern_recall) with the dense LSE; cpu is close;
 * - the head-adaptive budgets preserve the total and are optimal (every
 *   split of the budget tried on a small case);
 * - the distributed form on W = 1, 2, 3, 4, 5 ranks (threads in one process
 *   sharing a communicator, with point-to-point mailboxes) and every layout
 *   kind but balanced, with the keys passed around the ring (every method;
 *   antidiag in three passes) and with every key gathered
 *   (MTRAIN_BLOCK_KEY_GATHER=1), gives
 *   bitwise the single-rank pattern and report, each rank holding the
 *   scores of its own query block rows only (the ranks' score bytes add up
 *   to the single-rank triangles);
 * - the exact sums of the head-adaptive gain curves: any order and any split
 *   into ranks give the same bits, within an ulp of a long double sum;
 *   NaN and infinities; the gather of the selection in small pieces;
 * - non-causal selection (SPEC.md 9.7): cpu scores against cpu-ref, the
 *   precise rows with the bidirectional LSE adding up to their row counts,
 *   the reported recall equal to the pattern's recall over every key, the
 *   O(1) candidate count against the definition, and the distributed form
 *   on W = 1, 2, 3, 4 bitwise the single-rank one (the Python tests check
 *   cpu-ref against an fp64 reference of the spec);
 * - the antidiagonal ring form holds no rank's every key: each rank's
 *   backend peak (mtrain_context_memory) is its two key chunks, its strided
 *   rows' state and its score rows, halving from W = 4 to 8, against the
 *   N x Hkv x d keys of the gather; its fixed-point normaliser gives the
 *   same state in any order and split, within 2 ulp of a long double sum;
 * - a backend without the block_scores slot (or without non-causal scores),
 *   and bad options, are refused.
 * Seeds are printed; MTRAIN_TEST_SEED overrides them. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_antidiag_sum.h"
#include "core/runtime/backend.h"
#include "core/runtime/block_rows.h"
#include "core/runtime/block_select.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/exact_sum.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_cpu.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_layout.h"
#include "test_support.h"

/* ---- the problem of one case --------------------------------------------------------- */

typedef struct problem {
  int64_t N;
  int32_t G, Hq, Hkv, d;
  uint64_t seed;
  float *q, *k, *v;     /* fp32 inputs */
  double *qd, *kd, *vd; /* the same values in fp64 */
  double *lse;          /* dense causal LSE, fp64 [N, Hq] */
  float *lsef;          /* the same in fp32 */
} problem_t;

static void problem_make(problem_t *p, int64_t N, int32_t G, int32_t Hq, int32_t Hkv, int32_t d,
                         uint64_t seed) {
  memset(p, 0, sizeof *p);
  p->N = N, p->G = G, p->Hq = Hq, p->Hkv = Hkv, p->d = d, p->seed = seed;
  const int64_t nq = N * Hq * d, nk = N * Hkv * d;
  p->q = malloc(sizeof(float) * (size_t)nq);
  p->k = malloc(sizeof(float) * (size_t)nk);
  p->v = malloc(sizeof(float) * (size_t)nk);
  assert_true(p->q && p->k && p->v);
  /* structured inputs give peaked attention (random normal would be flat) */
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = seed;
  so.rope_base = 4.0 * (double)N;
  mtrain_tensor_t tq = mtrain_tensor_3d(p->q, MTRAIN_F32, N, Hq, d);
  mtrain_tensor_t tk = mtrain_tensor_3d(p->k, MTRAIN_F32, N, Hkv, d);
  mtrain_tensor_t tv = mtrain_tensor_3d(p->v, MTRAIN_F32, N, Hkv, d);
  assert_int_equal(mtrain_generate_structured(&so, &tq, &tk, &tv), MTRAIN_SUCCESS);
  /* and some noise of its own, so that two seeds differ everywhere */
  ts_rng_t rng;
  ts_rng_seed(&rng, seed ^ 0x5eed);
  for (int64_t i = 0; i < nq; i++) p->q[i] += (float)(0.3 * ts_rng_normal(&rng));
  p->qd = ts_to_double(p->q, MTRAIN_F32, nq);
  p->kd = ts_to_double(p->k, MTRAIN_F32, nk);
  p->vd = ts_to_double(p->v, MTRAIN_F32, nk);
  p->lse = malloc(sizeof(double) * (size_t)(N * Hq));
  p->lsef = malloc(sizeof(float) * (size_t)(N * Hq));
  double *o = malloc(sizeof(double) * (size_t)nq);
  assert_true(p->lse && p->lsef && o);
  mtrain_pattern_t *dense = NULL;
  assert_int_equal(mtrain_pattern_create_dense(N, Hq, G, &dense), MTRAIN_SUCCESS);
  assert_int_equal(
      mtrain_cpu_dense_reference_forward(dense, Hkv, d, 0.0, p->qd, p->kd, p->vd, o, p->lse),
      MTRAIN_SUCCESS);
  for (int64_t i = 0; i < N * Hq; i++) p->lsef[i] = (float)p->lse[i];
  mtrain_pattern_destroy(dense);
  free(o);
}

static void problem_free(problem_t *p) {
  free(p->q), free(p->k), free(p->v), free(p->qd), free(p->kd), free(p->vd), free(p->lse),
      free(p->lsef);
}

static int64_t nblocks(const problem_t *p) { return (p->N + p->G - 1) / p->G; }

/* ---- brute force of SPEC.md section 9 ------------------------------------------------ */

static double qk(const problem_t *p, int32_t h, int64_t i, int64_t j) {
  const int32_t hk = h / (p->Hq / p->Hkv);
  double s = 0.0;
  for (int32_t x = 0; x < p->d; x++)
    s += p->qd[(i * p->Hq + h) * p->d + x] * p->kd[(j * p->Hkv + hk) * p->d + x];
  return s;
}

/* out [Hq * tri], every entry of every head. */
static void bf_scores(const problem_t *p, mtrain_block_method_t method, int32_t S, double *out) {
  const int64_t N = p->N, nb = nblocks(p), tri = mtrain_block_tri(nb);
  const int32_t G = p->G, d = p->d;
  const double scale = 1.0 / sqrt((double)d);
  memset(out, 0, sizeof(double) * (size_t)(tri * p->Hq));
  for (int32_t h = 0; h < p->Hq; h++) {
    double *w = out + h * tri;
#define W(qb, kb) w[(qb) * ((qb) + 1) / 2 + (kb)]
    if (method == MTRAIN_BLOCK_PRECISE) {
      for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j <= i; j++)
          W(i / G, j / G) += exp(scale * qk(p, h, i, j) - p->lse[i * p->Hq + h]);
    } else if (method == MTRAIN_BLOCK_ANTIDIAG) {
      const int64_t na = (N + S - 1) / S;
      double *X = malloc(sizeof(double) * (size_t)na);
      int *def = malloc(sizeof(int) * (size_t)na);
      for (int64_t a = 0; a < na; a++) {
        double m = -INFINITY;
        for (int64_t c = 0; c <= a; c++) {
          double sum = 0.0;
          def[c] = 0;
          for (int32_t s = 0; s < S; s++) {
            const int64_t i = a * S + s, j = c * S + S - 1 - s;
            if (i < N && j <= i) sum += qk(p, h, i, j), def[c] = 1;
          }
          X[c] = scale / S * sum;
          if (def[c]) m = fmax(m, X[c]);
        }
        if (!(m > -INFINITY)) continue;
        double Z = 0.0;
        for (int64_t c = 0; c <= a; c++) Z += def[c] ? exp(X[c] - m) : 0.0;
        for (int64_t c = 0; c <= a; c++)
          if (def[c]) W(a * S / G, c * S / G) += exp(X[c] - m) / Z;
      }
      free(X);
      free(def);
    } else {
      const int32_t hk = h / (p->Hq / p->Hkv);
      for (int64_t qb = 0; qb < nb; qb++)
        for (int64_t kb = 0; kb <= qb; kb++) {
          double dot = 0.0;
          for (int32_t x = 0; x < d; x++) {
            double qm = 0.0, km = 0.0;
            int64_t nq = 0, nk = 0;
            for (int64_t i = qb * G; i < N && i < (qb + 1) * G; i++, nq++)
              qm += p->qd[(i * p->Hq + h) * d + x];
            for (int64_t j = kb * G; j < N && j < (kb + 1) * G; j++, nk++)
              km += p->kd[(j * p->Hkv + hk) * d + x];
            dot += qm / (double)nq * (km / (double)nk);
          }
          W(qb, kb) = scale * dot;
        }
    }
#undef W
  }
}

/* The selection of one head as a dense nb x nb mask, by repeated maximum
 * (no sort): forced blocks, then candidates best first. */
static void bf_select(const double *w, int64_t nb, const mtrain_block_options_t *o, int32_t top_k,
                      uint8_t *mask, double *kept_out, double *total_out) {
  memset(mask, 0, (size_t)(nb * nb));
  double kept_all = 0.0, total_all = 0.0;
  for (int64_t qb = 0; qb < nb; qb++) {
    const double *row = w + qb * (qb + 1) / 2;
    uint8_t *m = mask + qb * nb;
    double total = 0.0, kept = 0.0;
    for (int64_t kb = 0; kb <= qb; kb++) total += row[kb];
    for (int64_t kb = 0; kb <= qb; kb++)
      if (kb == qb || kb < o->sink_blocks || kb + o->local_blocks > qb) m[kb] = 1, kept += row[kb];
    for (int64_t taken = 0;; taken++) {
      if (o->kind == MTRAIN_BUDGET_TOP_K && taken >= top_k) break;
      if (o->kind == MTRAIN_BUDGET_TOP_P && !(kept < o->top_p * total)) break;
      int64_t best = -1;
      for (int64_t kb = 0; kb <= qb; kb++) {
        if (m[kb]) continue;
        const double x = isnan(row[kb]) ? -INFINITY : row[kb];
        const double y = best < 0 ? 0 : isnan(row[best]) ? -INFINITY : row[best];
        if (best < 0 || x > y) best = kb;
      }
      if (best < 0) break;
      m[best] = 1;
      kept += row[best];
    }
    kept_all += kept;
    total_all += total;
  }
  if (kept_out) *kept_out = kept_all;
  if (total_out) *total_out = total_all;
}

/* Head h of a block-mask pattern as a dense mask. */
static void pattern_mask(const mtrain_pattern_t *p, int32_t h, uint8_t *mask) {
  const int64_t nb = p->num_blocks;
  assert_true(mtrain_pattern_head_is_block_mask(p, h));
  memset(mask, 0, (size_t)(nb * nb));
  const mtrain_pattern_head_t *hd = &p->heads[h];
  for (int64_t qb = 0; qb < nb; qb++)
    for (int64_t e = hd->mask_off[qb]; e < hd->mask_off[qb + 1]; e++)
      mask[qb * nb + hd->mask_idx[e]] = 1;
}

/* ---- contexts --------------------------------------------------------------------------- */

static mtrain_context_t *make_ctx(const char *backend, int32_t G, int threads) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  cfg.num_threads = threads;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  return ctx;
}

/* The backend's scores of the whole sequence (slot called directly). */
static void backend_scores(mtrain_context_t *ctx, const problem_t *p, mtrain_block_method_t method,
                           int32_t S, int lse64, double *out) {
  const int64_t nb = nblocks(p);
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)nb);
  for (int64_t b = 0; b < nb; b++) ids[b] = b;
  memset(out, 0, sizeof(double) * (size_t)(mtrain_block_tri(nb) * p->Hq));
  const mtrain_block_scores_args_t a = {.method = method,
                                        .seq_len = p->N,
                                        .granularity = p->G,
                                        .num_heads = p->Hq,
                                        .num_kv_heads = p->Hkv,
                                        .head_dim = p->d,
                                        .scale = 1.0 / sqrt((double)p->d),
                                        .stride = S,
                                        .q_dtype = MTRAIN_F32,
                                        .q = p->q,
                                        .q_tokens = p->N,
                                        .num_q_blocks = (int32_t)nb,
                                        .q_block_global = ids,
                                        .k_dtype = MTRAIN_F32,
                                        .k = p->k,
                                        .lse_dtype = lse64 ? MTRAIN_F64 : MTRAIN_F32,
                                        .lse = lse64 ? (const void *)p->lse : p->lsef,
                                        .scores = out};
  assert_int_equal(mtrain_be_block_scores(ctx, &a), MTRAIN_SUCCESS);
  free(ids);
}

typedef struct shape {
  int64_t N;
  int32_t G, Hq, Hkv, d, S;
} shape_t;

static const shape_t shapes[] = {
    {300, 32, 4, 2, 64, 8},   /* GQA 2, N % G = 12 */
    {200, 64, 4, 1, 128, 16}, /* GQA 4, d 128, N % G = 8 */
    {161, 16, 2, 2, 64, 4},   /* no GQA, N % G = 1 (a one-token block) */
};
#define NSHAPES (sizeof shapes / sizeof shapes[0])

static const mtrain_block_method_t methods[] = {MTRAIN_BLOCK_PRECISE, MTRAIN_BLOCK_ANTIDIAG,
                                                MTRAIN_BLOCK_MEANPOOL};

/* ---- 1. scores ---------------------------------------------------------------------------- */

static void test_scores(void **state) {
  (void)state;
  for (size_t c = 0; c < NSHAPES; c++) {
    const shape_t *s = &shapes[c];
    const uint64_t seed = ts_seed(100 + c);
    problem_t p;
    problem_make(&p, s->N, s->G, s->Hq, s->Hkv, s->d, seed);
    const int64_t n = mtrain_block_tri(nblocks(&p)) * p.Hq;
    double *want = malloc(sizeof(double) * (size_t)n), *got = malloc(sizeof(double) * (size_t)n);
    for (int mi = 0; mi < 3; mi++) {
      bf_scores(&p, methods[mi], s->S, want);
      const double M = ts_max_abs(want, n);
      for (int b = 0; b < 2; b++) {
        mtrain_context_t *ctx = make_ctx(b ? "cpu" : "cpu-ref", s->G, 2);
        backend_scores(ctx, &p, methods[mi], s->S, !b, got);
        const double err = ts_max_abs_diff(got, want, n);
        /* cpu: fp32 logits; meanpool is fp64 on both */
        const double tol = (b && methods[mi] != MTRAIN_BLOCK_MEANPOOL ? 2e-5 : 1e-12) * M;
        print_message("scores seed %llu N %lld G %d heads %d/%d d %d %s %s: max err %.3g "
                      "(max %.3g, bound %.3g)\n",
                      (unsigned long long)seed, (long long)s->N, s->G, s->Hq, s->Hkv, s->d,
                      mtrain_block_method_name(methods[mi]), b ? "cpu" : "cpu-ref", err, M, tol);
        if (!(err <= tol))
          fail_msg("block scores of %s, %s, seed %llu, shape %zu: error %.3g > %.3g",
                   b ? "cpu" : "cpu-ref", mtrain_block_method_name(methods[mi]),
                   (unsigned long long)seed, c, err, tol);
        mtrain_context_destroy(ctx);
      }
      if (methods[mi] == MTRAIN_BLOCK_PRECISE) /* with the dense LSE each row adds up to 1 */
        for (int32_t h = 0; h < p.Hq; h++) {
          double total = 0.0;
          for (int64_t e = 0; e < mtrain_block_tri(nblocks(&p)); e++)
            total += want[h * mtrain_block_tri(nblocks(&p)) + e];
          assert_true(fabs(total - (double)p.N) < 1e-9 * (double)p.N);
        }
    }
    free(want);
    free(got);
    problem_free(&p);
  }
}

/* ---- 2. the selection rule ------------------------------------------------------------------ */

static void check_select(const double *w, int64_t nb, const mtrain_block_options_t *o, int32_t k,
                         const char *what) {
  int64_t *off = malloc(sizeof(int64_t) * (size_t)(nb + 1));
  int32_t *idx = malloc(sizeof(int32_t) * (size_t)mtrain_block_tri(nb));
  int64_t *order = malloc(sizeof(int64_t) * (size_t)nb);
  uint8_t *keep = malloc((size_t)nb), *want = malloc((size_t)(nb * nb));
  mtrain_block_head_result_t r;
  mtrain_block_select_head(w, nb, o, k, off, idx, order, keep, &r);
  double kept = 0.0, total = 0.0;
  bf_select(w, nb, o, k, want, &kept, &total);
  int64_t blocks = 0;
  for (int64_t qb = 0; qb < nb; qb++) {
    for (int64_t kb = 0; kb < nb; kb++) blocks += want[qb * nb + kb];
    uint8_t *got = calloc((size_t)nb, 1);
    for (int64_t e = off[qb]; e < off[qb + 1]; e++) got[idx[e]] = 1;
    if (memcmp(got, want + qb * nb, (size_t)nb) != 0)
      fail_msg("%s: query block %lld selects other key blocks than the brute force", what,
               (long long)qb);
    free(got);
  }
  assert_int_equal(r.blocks, blocks);
  /* the same additions in the same order: the same bits */
  if (!(isnan(kept) && isnan(r.kept))) assert_true(r.kept == kept);
  free(off), free(idx), free(order), free(keep), free(want);
}

static void test_selection_rule(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(7);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  print_message("selection rule seed %llu\n", (unsigned long long)seed);
  /* 150 blocks: top-p walks past the first 16 and 64 ranked candidates (the ranking is
   * built as far as the walk goes) */
  double *w = malloc(sizeof(double) * (size_t)mtrain_block_tri(150));
  for (int trial = 0; trial < 40; trial++) {
    const int64_t nb = trial % 4 < 2 ? 23 : 150;
    /* integer scores in 0..4: many ties; sometimes a NaN */
    for (int64_t e = 0; e < mtrain_block_tri(nb); e++)
      w[e] = trial % 2 ? (double)ts_rng_below(&rng, 5) : ts_rng_uniform(&rng);
    if (trial % 5 == 4) w[ts_rng_below(&rng, mtrain_block_tri(nb))] = NAN;
    mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
    o.sink_blocks = (int32_t)ts_rng_below(&rng, 3);
    o.local_blocks = (int32_t)ts_rng_below(&rng, 4);
    char what[128];
    o.kind = MTRAIN_BUDGET_TOP_K;
    const int32_t k = (int32_t)ts_rng_below(&rng, 8);
    snprintf(what, sizeof what, "trial %d top-k %d sinks %d local %d", trial, k, o.sink_blocks,
             o.local_blocks);
    check_select(w, nb, &o, k, what);
    if (trial % 5 == 4) continue; /* top-p with a NaN total keeps the forced blocks only */
    o.kind = MTRAIN_BUDGET_TOP_P;
    o.top_p = trial % 3 ? 0.2 + 0.8 * ts_rng_uniform(&rng) : 0.999;
    snprintf(what, sizeof what, "trial %d top-p %.3f sinks %d local %d", trial, o.top_p,
             o.sink_blocks, o.local_blocks);
    check_select(w, nb, &o, 0, what);
  }
  free(w);
}

/* ---- 3. end to end on cpu-ref and cpu ----------------------------------------------------- */

typedef struct sel_case {
  mtrain_block_method_t method;
  mtrain_budget_kind_t kind;
  int32_t top_k;
  double top_p;
  int32_t sinks, local, adaptive;
} sel_case_t;

static const sel_case_t sel_cases[] = {
    {MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_P, 0, 0.9, 1, 1, 0},
    {MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_K, 2, 0, 1, 2, 0},
    {MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_K, 2, 0, 0, 1, 1},
    {MTRAIN_BLOCK_ANTIDIAG, MTRAIN_BUDGET_TOP_P, 0, 0.8, 1, 1, 0},
    {MTRAIN_BLOCK_ANTIDIAG, MTRAIN_BUDGET_TOP_K, 3, 0, 1, 1, 1},
    {MTRAIN_BLOCK_MEANPOOL, MTRAIN_BUDGET_TOP_K, 2, 0, 0, 1, 0},
};
#define NSEL (sizeof sel_cases / sizeof sel_cases[0])

static mtrain_block_options_t options_of(const sel_case_t *c, int32_t S) {
  mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
  o.method = c->method;
  o.kind = c->kind;
  o.top_k = c->top_k;
  o.top_p = c->top_p;
  o.sink_blocks = c->sinks;
  o.local_blocks = c->local;
  o.stride = S;
  o.head_adaptive = c->adaptive;
  return o;
}

static void test_end_to_end(void **state) {
  (void)state;
  for (size_t c = 0; c < NSHAPES; c++) {
    const shape_t *s = &shapes[c];
    const uint64_t seed = ts_seed(200 + c);
    problem_t p;
    problem_make(&p, s->N, s->G, s->Hq, s->Hkv, s->d, seed);
    const int64_t nb = nblocks(&p), tri = mtrain_block_tri(nb);
    double *w = malloc(sizeof(double) * (size_t)(tri * p.Hq));
    uint8_t *want = malloc((size_t)(nb * nb)), *got = malloc((size_t)(nb * nb));
    mtrain_tensor_t tq = mtrain_tensor_3d(p.q, MTRAIN_F32, p.N, p.Hq, p.d);
    mtrain_tensor_t tk = mtrain_tensor_3d(p.k, MTRAIN_F32, p.N, p.Hkv, p.d);
    mtrain_tensor_t tl64 = mtrain_tensor_2d(p.lse, MTRAIN_F64, p.N, p.Hq);
    mtrain_tensor_t tl32 = mtrain_tensor_2d(p.lsef, MTRAIN_F32, p.N, p.Hq);
    for (size_t ci = 0; ci < NSEL; ci++) {
      const sel_case_t *sc = &sel_cases[ci];
      const mtrain_block_options_t o = options_of(sc, s->S);
      bf_scores(&p, sc->method, s->S, w);
      int32_t *budget = malloc(sizeof(int32_t) * (size_t)p.Hq);
      for (int32_t h = 0; h < p.Hq; h++) budget[h] = sc->top_k;
      if (sc->adaptive)
        assert_int_equal(mtrain_block_adaptive_budgets(w, p.Hq, nb, &o, 1, budget), MTRAIN_SUCCESS);
      double recall_ref[16], recall[16], true_recall[16], mean_ref = 0.0, mean_cpu = 0.0;
      int32_t got_k[16];
      int64_t got_blocks[16];
      for (int b = 0; b < 2; b++) {
        mtrain_context_t *ctx = make_ctx(b ? "cpu" : "cpu-ref", s->G, 2);
        mtrain_block_report_t rep = {b ? recall : recall_ref, got_k, got_blocks};
        mtrain_pattern_t *pat = NULL;
        assert_int_equal(
            mtrain_pattern_select_blocks(ctx, &tq, &tk, b ? &tl32 : &tl64, &o, &rep, &pat),
            MTRAIN_SUCCESS);
        double mean = 0.0;
        assert_int_equal(
            mtrain_cpu_pattern_recall(pat, p.Hkv, p.d, 0.0, p.qd, p.kd, true_recall, &mean),
            MTRAIN_SUCCESS);
        int64_t rows_differ = 0;
        for (int32_t h = 0; h < p.Hq; h++) {
          /* cpu's adaptive budgets come from its own scores: select with those */
          const int32_t kh = sc->kind == MTRAIN_BUDGET_TOP_K && b ? got_k[h] : budget[h];
          bf_select(w + h * tri, nb, &o, kh, want, NULL, NULL);
          pattern_mask(pat, h, got);
          for (int64_t qb = 0; qb < nb; qb++)
            rows_differ += memcmp(want + qb * nb, got + qb * nb, (size_t)nb) != 0;
          if (sc->kind == MTRAIN_BUDGET_TOP_K && !b) assert_int_equal(got_k[h], budget[h]);
          if (sc->kind == MTRAIN_BUDGET_TOP_P) assert_int_equal(got_k[h], -1);
          if (sc->method == MTRAIN_BLOCK_PRECISE && !b &&
              fabs(recall_ref[h] - true_recall[h]) > 1e-9)
            fail_msg("seed %llu case %zu head %d: reported recall %.12f, the pattern's %.12f",
                     (unsigned long long)seed, ci, h, recall_ref[h], true_recall[h]);
        }
        print_message("select seed %llu shape %zu case %zu (%s %s) %s: recall %.4f, rows "
                      "differing from the brute force %lld of %lld\n",
                      (unsigned long long)seed, c, ci, mtrain_block_method_name(sc->method),
                      sc->kind == MTRAIN_BUDGET_TOP_K ? "top-k" : "top-p", b ? "cpu" : "cpu-ref",
                      mean, (long long)rows_differ, (long long)(nb * p.Hq));
        if (!b && rows_differ != 0)
          fail_msg("cpu-ref: %lld rows differ from the brute-force selection (seed %llu, shape "
                   "%zu, case %zu)",
                   (long long)rows_differ, (unsigned long long)seed, c, ci);
        /* cpu: fp32 scores may reorder near-equal blocks: a few rows, the same recall */
        if (b) {
          mean_cpu = mean;
          if (rows_differ * 10 > nb * p.Hq || fabs(mean_cpu - mean_ref) > 0.01)
            fail_msg("cpu: %lld rows differ, recall %.4f vs cpu-ref %.4f (seed %llu, shape %zu, "
                     "case %zu)",
                     (long long)rows_differ, mean_cpu, mean_ref, (unsigned long long)seed, c, ci);
        } else {
          mean_ref = mean;
        }
        mtrain_pattern_destroy(pat);
        mtrain_context_destroy(ctx);
      }
      free(budget);
    }
    free(w), free(want), free(got);
    problem_free(&p);
  }
}

/* ---- 4. head-adaptive budgets -----------------------------------------------------------------
 */

static double head_recall_at(const double *w, int64_t nb, const mtrain_block_options_t *o,
                             int32_t k) {
  uint8_t *mask = malloc((size_t)(nb * nb));
  double kept = 0.0, total = 0.0;
  bf_select(w, nb, o, k, mask, &kept, &total);
  free(mask);
  return kept / total;
}

static void test_adaptive(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(300);
  problem_t p;
  problem_make(&p, 256, 16, 3, 1, 64, seed);
  const int64_t nb = nblocks(&p), tri = mtrain_block_tri(nb);
  double *w = malloc(sizeof(double) * (size_t)(tri * p.Hq));
  bf_scores(&p, MTRAIN_BLOCK_PRECISE, 8, w);
  /* make the heads different: head 1 keeps nearly all its mass on the forced
   * diagonal block (high recall at any budget), head 2 sharper (masses
   * squared and renormalised per row) */
  for (int64_t qb = 0; qb < nb; qb++) {
    double *r1 = w + tri + qb * (qb + 1) / 2, *r2 = w + 2 * tri + qb * (qb + 1) / 2;
    double t1 = 0.0, t2 = 0.0, t2sq = 0.0;
    for (int64_t kb = 0; kb <= qb; kb++) t1 += r1[kb], t2 += r2[kb], t2sq += r2[kb] * r2[kb];
    for (int64_t kb = 0; kb <= qb; kb++) {
      r1[kb] = 0.01 * r1[kb] + (kb == qb ? 0.99 * t1 : 0.0);
      r2[kb] = r2[kb] * r2[kb] / t2sq * t2;
    }
  }
  for (int32_t base = 1; base <= 3; base++) {
    mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
    o.kind = MTRAIN_BUDGET_TOP_K;
    o.top_k = base;
    o.sink_blocks = 0;
    int32_t k[3];
    assert_int_equal(mtrain_block_adaptive_budgets(w, 3, nb, &o, 2, k), MTRAIN_SUCCESS);
    assert_int_equal(k[0] + k[1] + k[2], 3 * base);
    double best = -1.0, got = 0.0, at_base = 0.0;
    for (int32_t h = 0; h < 3; h++) {
      got += head_recall_at(w + h * tri, nb, &o, k[h]);
      at_base += head_recall_at(w + h * tri, nb, &o, base);
    }
    for (int32_t a = 0; a <= 3 * base; a++)
      for (int32_t b = 0; a + b <= 3 * base; b++) {
        const int32_t c = 3 * base - a - b;
        const double r = head_recall_at(w, nb, &o, a) + head_recall_at(w + tri, nb, &o, b) +
                         head_recall_at(w + 2 * tri, nb, &o, c);
        if (r > best) best = r;
      }
    print_message("adaptive seed %llu base %d: budgets %d %d %d, mean recall %.4f (base %.4f, "
                  "best split %.4f)\n",
                  (unsigned long long)seed, base, k[0], k[1], k[2], got / 3, at_base / 3, best / 3);
    assert_true(got >= at_base - 1e-12);
    /* head 1, whose recall is high at any budget, gives budget away */
    assert_true(k[1] < base);
    assert_true(fabs(got - best) <= 1e-9);
  }
  free(w);
  problem_free(&p);
}

/* ---- 5. W ranks in one process ------------------------------------------------------------------
 */

/* A message in flight between two threads. */
typedef struct tc_msg {
  struct tc_msg *next;
  int src, tag;
  size_t bytes;
  void *data;
} tc_msg_t;

typedef struct shared_comm {
  int size;
  pthread_barrier_t barrier;
  void *bufs[8];
  pthread_mutex_t mu; /* guards box */
  pthread_cond_t cv;
  tc_msg_t *box[8]; /* per destination: messages in order of sending */
} shared_comm_t;

/* A request: sends complete at once (copied), receives in tc_wait. */
struct mtrain_comm_request {
  int recv, peer, tag;
  void *buf;
  size_t bytes;
};

typedef struct thread_comm {
  shared_comm_t *sh;
  int rank;
} thread_comm_t;

static int tc_rank(void *s) { return ((thread_comm_t *)s)->rank; }
static int tc_size(void *s) { return ((thread_comm_t *)s)->sh->size; }
/* Point-to-point through per-destination mailboxes (the ring pass over the keys). */
static mtrain_status_t tc_isend(void *s, const void *b, size_t n, int p, int t,
                                mtrain_comm_request_t **r) {
  thread_comm_t *c = s;
  tc_msg_t *m = malloc(sizeof *m);
  *r = calloc(1, sizeof **r);
  if (!m || !*r) return MTRAIN_ERR_OUT_OF_MEMORY;
  m->next = NULL, m->src = c->rank, m->tag = t, m->bytes = n, m->data = malloc(n + 1);
  if (!m->data) return MTRAIN_ERR_OUT_OF_MEMORY;
  memcpy(m->data, b, n);
  pthread_mutex_lock(&c->sh->mu);
  tc_msg_t **at = &c->sh->box[p];
  while (*at) at = &(*at)->next;
  *at = m;
  pthread_cond_broadcast(&c->sh->cv);
  pthread_mutex_unlock(&c->sh->mu);
  return MTRAIN_SUCCESS;
}
static mtrain_status_t tc_irecv(void *s, void *b, size_t n, int p, int t,
                                mtrain_comm_request_t **r) {
  (void)s;
  *r = malloc(sizeof **r);
  if (!*r) return MTRAIN_ERR_OUT_OF_MEMORY;
  (*r)->recv = 1, (*r)->peer = p, (*r)->tag = t, (*r)->buf = b, (*r)->bytes = n;
  return MTRAIN_SUCCESS;
}
static mtrain_status_t tc_wait(void *s, mtrain_comm_request_t *r) {
  thread_comm_t *c = s;
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (r->recv) {
    tc_msg_t *m = NULL;
    pthread_mutex_lock(&c->sh->mu);
    for (;;) {
      tc_msg_t **at = &c->sh->box[c->rank];
      while (*at && ((*at)->src != r->peer || (*at)->tag != r->tag)) at = &(*at)->next;
      if (*at) {
        m = *at;
        *at = m->next;
        break;
      }
      pthread_cond_wait(&c->sh->cv, &c->sh->mu);
    }
    pthread_mutex_unlock(&c->sh->mu);
    if (m->bytes != r->bytes)
      st = MTRAIN_ERR_INVALID_ARGUMENT;
    else
      memcpy(r->buf, m->data, m->bytes);
    free(m->data);
    free(m);
  }
  free(r);
  return st;
}
static mtrain_status_t tc_barrier(void *s) {
  pthread_barrier_wait(&((thread_comm_t *)s)->sh->barrier);
  return MTRAIN_SUCCESS;
}
/* Every rank reduces all ranks' buffers in rank order into its own copy. */
static mtrain_status_t tc_allreduce(void *s, void *b, int64_t n, mtrain_dtype_t dt,
                                    mtrain_reduce_op_t op) {
  thread_comm_t *c = s;
  const size_t es = dt == MTRAIN_F64 ? 8 : 4;
  void *tmp = malloc(es * (size_t)(n + 1));
  if (!tmp) return MTRAIN_ERR_OUT_OF_MEMORY;
  c->sh->bufs[c->rank] = b;
  tc_barrier(s);
  for (int64_t i = 0; i < n; i++) {
    double acc = 0.0;
    for (int r = 0; r < c->sh->size; r++) {
      const double x =
          dt == MTRAIN_F64 ? ((double *)c->sh->bufs[r])[i] : (double)((float *)c->sh->bufs[r])[i];
      acc = r == 0 ? x : op == MTRAIN_REDUCE_MAX ? fmax(acc, x) : acc + x;
    }
    if (dt == MTRAIN_F64)
      ((double *)tmp)[i] = acc;
    else
      ((float *)tmp)[i] = (float)acc; /* sums of one value and zeros: exact */
  }
  tc_barrier(s);
  memcpy(b, tmp, es * (size_t)n);
  free(tmp);
  tc_barrier(s);
  return MTRAIN_SUCCESS;
}
static mtrain_status_t tc_allgather(void *s, const void *send, void *recv, size_t bytes) {
  thread_comm_t *c = s;
  c->sh->bufs[c->rank] = (void *)send;
  tc_barrier(s);
  for (int r = 0; r < c->sh->size; r++) memcpy((char *)recv + r * bytes, c->sh->bufs[r], bytes);
  tc_barrier(s);
  return MTRAIN_SUCCESS;
}
static mtrain_status_t tc_split(void *s, int color, int key, mtrain_comm_t **out) {
  (void)s, (void)color, (void)key, (void)out;
  return MTRAIN_ERR_NOT_SUPPORTED;
}
static void tc_abort(void *s, int code) { (void)s, (void)code; }
static void tc_destroy(void *s) { (void)s; }

static const mtrain_comm_ops_t tc_ops = {.api_version = MTRAIN_API_VERSION,
                                         .name = "threads",
                                         .memory_space = MTRAIN_MEMORY_HOST,
                                         .rank = tc_rank,
                                         .size = tc_size,
                                         .isend = tc_isend,
                                         .irecv = tc_irecv,
                                         .wait = tc_wait,
                                         .allreduce = tc_allreduce,
                                         .allgather = tc_allgather,
                                         .barrier = tc_barrier,
                                         .split = tc_split,
                                         .abort = tc_abort,
                                         .destroy = tc_destroy};

typedef struct rank_job {
  thread_comm_t tc;
  const problem_t *p;
  const mtrain_layout_t *layout;
  const char *backend;
  mtrain_block_options_t o;
  mtrain_pattern_t *pattern;
  double recall[16];
  int32_t top_k[16];
  int64_t blocks[16];
  mtrain_block_times_t times; /* the score and gather bytes of this rank */
  size_t peak;                /* the context's backend_peak_bytes after the selection */
  mtrain_status_t st;
} rank_job_t;

static void gather_rows(const void *global, void *local, const int64_t *index, int64_t T, int64_t N,
                        size_t row_bytes) {
  for (int64_t i = 0; i < T; i++)
    if (index[i] < N)
      memcpy((char *)local + i * row_bytes, (const char *)global + index[i] * row_bytes, row_bytes);
    else
      memset((char *)local + i * row_bytes, 0, row_bytes);
}

static void *rank_main(void *arg) {
  rank_job_t *j = arg;
  const problem_t *p = j->p;
  const int r = j->tc.rank;
  const int64_t T = mtrain_layout_local_tokens(j->layout, r);
  int64_t *index = malloc(sizeof(int64_t) * (size_t)T);
  float *q = malloc(sizeof(float) * (size_t)(T * p->Hq * p->d));
  float *k = malloc(sizeof(float) * (size_t)(T * p->Hkv * p->d));
  float *lse = malloc(sizeof(float) * (size_t)(T * p->Hq));
  mtrain_layout_rank_token_index(j->layout, r, index);
  gather_rows(p->q, q, index, T, p->N, sizeof(float) * (size_t)(p->Hq * p->d));
  gather_rows(p->k, k, index, T, p->N, sizeof(float) * (size_t)(p->Hkv * p->d));
  gather_rows(p->lsef, lse, index, T, p->N, sizeof(float) * (size_t)p->Hq);
  mtrain_comm_t comm = {&tc_ops, &j->tc};
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = j->backend;
  cfg.granularity = p->G;
  cfg.num_threads = 1;
  mtrain_context_t *ctx = NULL;
  j->st = mtrain_context_create(&cfg, &comm, &ctx);
  if (!j->st) {
    mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, T, p->Hq, p->d);
    mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, T, p->Hkv, p->d);
    mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, T, p->Hq);
    mtrain_block_report_t rep = {j->recall, j->top_k, j->blocks};
    j->st =
        mtrain_pattern_select_blocks_ring(ctx, j->layout, &tq, &tk, &tl, &j->o, &rep, &j->pattern);
    j->times = mtrain_block_last_times();
    mtrain_memory_stats_t ms;
    if (!j->st && mtrain_context_memory(ctx, &ms) == MTRAIN_SUCCESS)
      j->peak = ms.backend_peak_bytes;
  }
  mtrain_context_destroy(ctx);
  free(index), free(q), free(k), free(lse);
  return NULL;
}

static int same_masks(const mtrain_pattern_t *a, const mtrain_pattern_t *b) {
  for (int32_t h = 0; h < a->num_heads; h++) {
    const mtrain_pattern_head_t *x = &a->heads[h], *y = &b->heads[h];
    const int64_t nb = a->num_blocks;
    if (memcmp(x->mask_off, y->mask_off, sizeof(int64_t) * (size_t)(nb + 1)) ||
        memcmp(x->mask_idx, y->mask_idx, sizeof(int32_t) * (size_t)x->mask_off[nb]))
      return 0;
  }
  return 1;
}

static void test_ring_bitwise(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(400);
  problem_t p;
  problem_make(&p, 333, 16, 4, 2, 64, seed);
  static const int worlds[] = {1, 2, 3, 4, 5};
  static const mtrain_layout_kind_t kinds[] = {MTRAIN_LAYOUT_CONTIGUOUS, MTRAIN_LAYOUT_ZIGZAG,
                                               MTRAIN_LAYOUT_STRIPED};
  mtrain_tensor_t tq = mtrain_tensor_3d(p.q, MTRAIN_F32, p.N, p.Hq, p.d);
  mtrain_tensor_t tk = mtrain_tensor_3d(p.k, MTRAIN_F32, p.N, p.Hkv, p.d);
  mtrain_tensor_t tl = mtrain_tensor_2d(p.lsef, MTRAIN_F32, p.N, p.Hq);
  for (int b = 0; b < 2; b++) {
    const char *backend = b ? "cpu" : "cpu-ref";
    for (size_t ci = 0; ci < NSEL; ci++) {
      const mtrain_block_options_t o = options_of(&sel_cases[ci], 4);
      /* the single-rank selection, 2 threads */
      mtrain_context_t *ctx = make_ctx(backend, p.G, 2);
      mtrain_pattern_t *one = NULL;
      double recall[16];
      int32_t top_k[16];
      int64_t blocks[16];
      mtrain_block_report_t rep = {recall, top_k, blocks};
      assert_int_equal(mtrain_pattern_select_blocks(ctx, &tq, &tk, &tl, &o, &rep, &one),
                       MTRAIN_SUCCESS);
      mtrain_context_destroy(ctx);
      /* the ring pass over the keys (antidiag: three passes), then the gather of every key */
      for (int gather = 0; gather < 2; gather++)
        for (size_t wi = 0; wi < sizeof worlds / sizeof worlds[0]; wi++)
          for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
            const int W = worlds[wi];
            if (gather)
              setenv("MTRAIN_BLOCK_KEY_GATHER", "1", 1);
            else
              unsetenv("MTRAIN_BLOCK_KEY_GATHER");
            mtrain_layout_t *layout = NULL;
            assert_int_equal(mtrain_layout_create(kinds[ki], p.N, p.G, W, NULL, &layout),
                             MTRAIN_SUCCESS);
            /* case 1 gathers the selection in pieces of 100 bytes */
            mtrain_block_gather_piece = ci == 1 ? 100 : (size_t)256 << 20;
            shared_comm_t sh = {.size = W};
            pthread_barrier_init(&sh.barrier, NULL, (unsigned)W);
            pthread_mutex_init(&sh.mu, NULL);
            pthread_cond_init(&sh.cv, NULL);
            rank_job_t jobs[5];
            pthread_t th[5];
            int64_t score_sum = 0;
            for (int r = 0; r < W; r++) {
              memset(&jobs[r], 0, sizeof jobs[r]);
              jobs[r].tc.sh = &sh;
              jobs[r].tc.rank = r;
              jobs[r].p = &p;
              jobs[r].layout = layout;
              jobs[r].backend = backend;
              jobs[r].o = o;
              pthread_create(&th[r], NULL, rank_main, &jobs[r]);
            }
            for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
            for (int r = 0; r < W; r++) {
              if (jobs[r].st != MTRAIN_SUCCESS)
                fail_msg("%s W %d %s rank %d: %s (%s)", backend, W,
                         mtrain_layout_kind_name(kinds[ki]), r, mtrain_status_name(jobs[r].st),
                         mtrain_last_error());
              if (!same_masks(one, jobs[r].pattern) ||
                  memcmp(recall, jobs[r].recall, sizeof(double) * (size_t)p.Hq) ||
                  memcmp(top_k, jobs[r].top_k, sizeof(int32_t) * (size_t)p.Hq) ||
                  memcmp(blocks, jobs[r].blocks, sizeof(int64_t) * (size_t)p.Hq))
                fail_msg("%s seed %llu case %zu W %d %s rank %d: not bitwise the single-rank "
                         "selection (masks %s, recall %s, top_k %s, blocks %s)",
                         backend, (unsigned long long)seed, ci, W,
                         mtrain_layout_kind_name(kinds[ki]), r,
                         same_masks(one, jobs[r].pattern) ? "equal" : "differ",
                         memcmp(recall, jobs[r].recall, sizeof(double) * (size_t)p.Hq) ? "differs"
                                                                                       : "equal",
                         memcmp(top_k, jobs[r].top_k, sizeof(int32_t) * (size_t)p.Hq) ? "differs"
                                                                                      : "equal",
                         memcmp(blocks, jobs[r].blocks, sizeof(int64_t) * (size_t)p.Hq) ? "differ"
                                                                                        : "equal");
              mtrain_pattern_destroy(jobs[r].pattern);
              /* the rank held the scores of its own query block rows only */
              const int64_t *own = mtrain_layout_rank_blocks(layout, r);
              int64_t rows = 0;
              for (int32_t lb = 0; lb < mtrain_layout_rank_num_blocks(layout, r); lb++)
                if (own[lb] < nblocks(&p)) rows += own[lb] + 1;
              const int64_t want = (int64_t)sizeof(double) * p.Hq * rows;
              if (jobs[r].times.score_bytes != want)
                fail_msg("%s W %d %s rank %d: %lld score bytes, its rows have %lld", backend, W,
                         mtrain_layout_kind_name(kinds[ki]), r,
                         (long long)jobs[r].times.score_bytes, (long long)want);
              score_sum += jobs[r].times.score_bytes;
              if (ci == 0 && b == 0 && !gather)
                print_message("  W %d %s rank %d: score bytes %lld (one rank: %lld), gathered "
                              "selection %lld bytes\n",
                              W, mtrain_layout_kind_name(kinds[ki]), r,
                              (long long)jobs[r].times.score_bytes,
                              (long long)(sizeof(double) * (size_t)p.Hq *
                                          (size_t)mtrain_block_tri(nblocks(&p))),
                              (long long)jobs[r].times.gather_bytes);
            }
            /* every row held once: the ranks' bytes add up to the single-rank triangles */
            assert_int_equal(score_sum,
                             (int64_t)sizeof(double) * p.Hq * mtrain_block_tri(nblocks(&p)));
            pthread_barrier_destroy(&sh.barrier);
            pthread_mutex_destroy(&sh.mu);
            pthread_cond_destroy(&sh.cv);
            for (int r = 0; r < W; r++) assert_null(sh.box[r]); /* every message received */
            mtrain_layout_destroy(layout);
          }
      unsetenv("MTRAIN_BLOCK_KEY_GATHER");
      print_message("ring %s seed %llu case %zu (%s): W 1, 2, 3, 4, 5 x 3 layouts bitwise equal, "
                    "with the keys passed around the ring and with the keys gathered\n",
                    backend, (unsigned long long)seed, ci,
                    mtrain_block_method_name(sel_cases[ci].method));
      mtrain_pattern_destroy(one);
    }
  }
  problem_free(&p);
}

/* ---- 5b. exact sums ------------------------------------------------------------------------ */

/* The words of values[0 .. n) split at `cut` into two "ranks", summed. */
static double xsum_split(const double *values, int64_t n, int64_t cut) {
  double a[MTRAIN_XSUM_WORDS], b[MTRAIN_XSUM_WORDS];
  mtrain_xsum_t x = {0}, y = {0};
  for (int64_t i = 0; i < n; i++) mtrain_xsum_add(i < cut ? &x : &y, values[i]);
  mtrain_xsum_export(&x, a);
  mtrain_xsum_export(&y, b);
  for (int w = 0; w < MTRAIN_XSUM_WORDS; w++) a[w] += b[w];
  return mtrain_xsum_value(a);
}

static void test_exact_sum(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(500);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  enum { n = 2000 };
  double *v = malloc(sizeof(double) * n);
  assert_non_null(v);
  /* masses over many binades, some subnormal, a few negative */
  for (int i = 0; i < n; i++) {
    const double e = ts_rng_normal(&rng) * 40.0;
    v[i] = exp(e) * (1.0 + ts_rng_normal(&rng) * 0.1);
    if (i % 97 == 0) v[i] = -v[i];
    if (i % 501 == 0) v[i] = 4.9e-324 * (double)(i + 1);
  }
  long double ref = 0.0L;
  for (int i = 0; i < n; i++) ref += (long double)v[i];
  const double whole = xsum_split(v, n, n);
  for (int t = 0; t < 20; t++) {
    /* shuffle, and cut anywhere: the same bits */
    for (int i = n - 1; i > 0; i--) {
      const int j = (int)(ts_rng_uniform(&rng) * (i + 1));
      const double x = v[i];
      v[i] = v[j], v[j] = x;
    }
    const double got = xsum_split(v, n, (int64_t)(ts_rng_uniform(&rng) * n));
    if (memcmp(&got, &whole, sizeof got))
      fail_msg("exact sum seed %llu: %.17g after a shuffle, %.17g before", (unsigned long long)seed,
               got, whole);
  }
  const double err = fabs((double)(ref - (long double)whole)) / fabs(whole);
  print_message("exact sum seed %llu: %d values, %.17g, relative difference to long double %.3g\n",
                (unsigned long long)seed, n, whole, err);
  assert_true(err <= 4e-16);
  /* special values */
  const double small[3] = {1.0, 0.0, -0.0};
  assert_true(xsum_split(small, 3, 1) == 1.0);
  const double with_inf[3] = {1.0, INFINITY, 2.0};
  assert_true(xsum_split(with_inf, 3, 2) == INFINITY);
  const double both_inf[2] = {INFINITY, -INFINITY};
  assert_true(isnan(xsum_split(both_inf, 2, 1)));
  const double with_nan[2] = {NAN, 1.0};
  assert_true(isnan(xsum_split(with_nan, 2, 0)));
  free(v);
}

/* ---- 5c. non-causal selection (SPEC.md section 9.7) -------------------------------------------
 */

/* The backend's non-causal scores of the whole sequence, [Hq * nb * nb]. */
static void backend_scores_nc(mtrain_context_t *ctx, const problem_t *p,
                              mtrain_block_method_t method, int32_t S, const double *lse,
                              double *out) {
  const int64_t nb = nblocks(p);
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)nb);
  for (int64_t b = 0; b < nb; b++) ids[b] = b;
  memset(out, 0, sizeof(double) * (size_t)(nb * nb * p->Hq));
  const mtrain_block_scores_args_t a = {.method = method,
                                        .seq_len = p->N,
                                        .granularity = p->G,
                                        .num_heads = p->Hq,
                                        .num_kv_heads = p->Hkv,
                                        .head_dim = p->d,
                                        .scale = 1.0 / sqrt((double)p->d),
                                        .stride = S,
                                        .q_dtype = MTRAIN_F32,
                                        .q = p->q,
                                        .q_tokens = p->N,
                                        .num_q_blocks = (int32_t)nb,
                                        .q_block_global = ids,
                                        .k_dtype = MTRAIN_F32,
                                        .k = p->k,
                                        .lse_dtype = MTRAIN_F64,
                                        .lse = lse,
                                        .scores = out,
                                        .noncausal = 1};
  assert_int_equal(mtrain_be_block_scores(ctx, &a), MTRAIN_SUCCESS);
  free(ids);
}

/* The LSE of dense bidirectional attention, fp64 [N, Hq] (the fp64 reference
 * of an all-ones non-causal block mask). */
static double *noncausal_lse(const problem_t *p) {
  const int64_t nb = nblocks(p);
  mtrain_pattern_t *all = NULL;
  assert_int_equal(mtrain_pattern_create_noncausal(p->N, p->Hq, p->G, &all), MTRAIN_SUCCESS);
  uint8_t *ones = malloc((size_t)(nb * nb));
  memset(ones, 1, (size_t)(nb * nb));
  for (int32_t h = 0; h < p->Hq; h++)
    assert_int_equal(mtrain_pattern_set_block_mask(all, h, ones), MTRAIN_SUCCESS);
  double *o = malloc(sizeof(double) * (size_t)(p->N * p->Hq * p->d));
  double *lse = malloc(sizeof(double) * (size_t)(p->N * p->Hq));
  assert_int_equal(
      mtrain_cpu_dense_reference_forward(all, p->Hkv, p->d, 0.0, p->qd, p->kd, p->vd, o, lse),
      MTRAIN_SUCCESS);
  mtrain_pattern_destroy(all);
  free(ones);
  free(o);
  return lse;
}

/* Non-causal scores: cpu against cpu-ref (fp32 logits, 2e-5 of the largest),
 * the precise rows of cpu-ref with the bidirectional LSE adding up to their
 * row counts (the softmax over all keys), entries above the diagonal present;
 * cpu-ref end to end: a non-causal pattern whose precise per-head recall is
 * the pattern's recall over every key (mtrain_cpu_pattern_recall) to 1e-9. */
static void test_noncausal_scores(void **state) {
  (void)state;
  for (size_t c = 0; c < NSHAPES; c++) {
    const shape_t *s = &shapes[c];
    const uint64_t seed = ts_seed(700 + c);
    problem_t p;
    problem_make(&p, s->N, s->G, s->Hq, s->Hkv, s->d, seed);
    double *lse = noncausal_lse(&p);
    const int64_t nb = nblocks(&p), n = nb * nb * p.Hq;
    double *ref = malloc(sizeof(double) * (size_t)n), *got = malloc(sizeof(double) * (size_t)n);
    mtrain_context_t *cref = make_ctx("cpu-ref", s->G, 2), *cfast = make_ctx("cpu", s->G, 2);
    for (int mi = 0; mi < 3; mi++) {
      backend_scores_nc(cref, &p, methods[mi], s->S, lse, ref);
      backend_scores_nc(cfast, &p, methods[mi], s->S, lse, got);
      const double M = ts_max_abs(ref, n), err = ts_max_abs_diff(got, ref, n);
      const double tol = (methods[mi] != MTRAIN_BLOCK_MEANPOOL ? 2e-5 : 1e-12) * M;
      print_message("non-causal scores seed %llu N %lld G %d heads %d/%d d %d %s: cpu vs "
                    "cpu-ref max err %.3g (bound %.3g)\n",
                    (unsigned long long)seed, (long long)s->N, s->G, s->Hq, s->Hkv, s->d,
                    mtrain_block_method_name(methods[mi]), err, tol);
      if (!(err <= tol))
        fail_msg("non-causal %s scores, seed %llu, shape %zu: cpu differs by %.3g > %.3g",
                 mtrain_block_method_name(methods[mi]), (unsigned long long)seed, c, err, tol);
      double upper = 0.0; /* the mass above the diagonal */
      for (int32_t h = 0; h < p.Hq; h++)
        for (int64_t qb = 0; qb < nb; qb++) {
          double row = 0.0;
          for (int64_t kb = 0; kb < nb; kb++) {
            row += ref[(h * nb + qb) * nb + kb];
            if (kb > qb) upper += fabs(ref[(h * nb + qb) * nb + kb]);
          }
          const double rows = (double)((qb + 1) * p.G < p.N ? p.G : p.N - qb * p.G);
          if (methods[mi] == MTRAIN_BLOCK_PRECISE && !(fabs(row - rows) <= 1e-9 * rows))
            fail_msg("precise non-causal row %lld of head %d adds up to %.17g, not %g",
                     (long long)qb, h, row, rows);
        }
      assert_true(upper > 0.0);
    }
    /* end to end on cpu-ref: recall over every key */
    mtrain_tensor_t tq = mtrain_tensor_3d(p.q, MTRAIN_F32, p.N, p.Hq, p.d);
    mtrain_tensor_t tk = mtrain_tensor_3d(p.k, MTRAIN_F32, p.N, p.Hkv, p.d);
    mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F64, p.N, p.Hq);
    mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
    o.top_p = 0.8;
    o.noncausal = 1;
    double recall[16], want[16], mean = 0.0;
    mtrain_block_report_t rep = {recall, NULL, NULL};
    mtrain_pattern_t *pat = NULL;
    assert_int_equal(mtrain_pattern_select_blocks(cref, &tq, &tk, &tl, &o, &rep, &pat),
                     MTRAIN_SUCCESS);
    assert_int_equal(mtrain_pattern_is_causal(pat), 0);
    assert_int_equal(mtrain_cpu_pattern_recall(pat, p.Hkv, p.d, 0.0, p.qd, p.kd, want, &mean),
                     MTRAIN_SUCCESS);
    for (int32_t h = 0; h < p.Hq; h++) {
      if (!(fabs(recall[h] - want[h]) <= 1e-9))
        fail_msg("non-causal recall of head %d: reported %.17g, pattern %.17g", h, recall[h],
                 want[h]);
      assert_true(want[h] >= 0.8 - 1e-9);
    }
    mtrain_pattern_destroy(pat);
    mtrain_context_destroy(cref);
    mtrain_context_destroy(cfast);
    free(ref), free(got), free(lse);
    problem_free(&p);
  }
}

/* The selection rule's non-causal candidates and forced blocks: the O(1)
 * candidate count against a count by the definition, every (qb, len) of
 * small cases. */
static void test_noncausal_candidates(void **state) {
  (void)state;
  for (int nc = 0; nc < 2; nc++)
    for (int32_t sink = 0; sink < 4; sink++)
      for (int32_t local = 0; local < 5; local++)
        for (int64_t nb = 1; nb < 9; nb++) {
          mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
          o.sink_blocks = sink, o.local_blocks = local, o.noncausal = nc;
          int64_t most = 0;
          for (int64_t qb = 0; qb < nb; qb++) {
            const int64_t len = mtrain_block_row_len(qb, nb, &o);
            int64_t want = 0;
            for (int64_t kb = 0; kb < len; kb++) {
              const int64_t dist = kb > qb ? kb - qb : qb - kb;
              want += !(kb == qb || kb < sink || (dist < local && (nc || kb <= qb)));
            }
            most = want > most ? want : most;
            if (mtrain_block_candidates(qb, len, &o) != want)
              fail_msg("candidates of qb %lld (nb %lld, sink %d, local %d, noncausal %d): %lld, "
                       "not %lld",
                       (long long)qb, (long long)nb, sink, local, nc,
                       (long long)mtrain_block_candidates(qb, len, &o), (long long)want);
          }
          assert_int_equal(mtrain_block_most_candidates(nb, &o), most);
        }
}

/* The distributed non-causal selection: W = 1, 2, 3 ranks, three layouts,
 * keys on the ring and gathered, bitwise the single-rank pattern and report;
 * each rank holds nb entries per own query block row. */
static void test_noncausal_ring(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(800);
  problem_t p;
  problem_make(&p, 333, 16, 4, 2, 64, seed);
  const int64_t nb = nblocks(&p);
  static const int worlds[] = {1, 2, 3, 4};
  static const mtrain_layout_kind_t kinds[] = {MTRAIN_LAYOUT_CONTIGUOUS, MTRAIN_LAYOUT_ZIGZAG,
                                               MTRAIN_LAYOUT_STRIPED};
  static const size_t cases[] = {0, 2, 3, 4, 5}; /* sel_cases: every method, adaptive */
  mtrain_tensor_t tq = mtrain_tensor_3d(p.q, MTRAIN_F32, p.N, p.Hq, p.d);
  mtrain_tensor_t tk = mtrain_tensor_3d(p.k, MTRAIN_F32, p.N, p.Hkv, p.d);
  mtrain_tensor_t tl = mtrain_tensor_2d(p.lsef, MTRAIN_F32, p.N, p.Hq);
  for (int b = 0; b < 2; b++) {
    const char *backend = b ? "cpu" : "cpu-ref";
    for (size_t cj = 0; cj < sizeof cases / sizeof cases[0]; cj++) {
      mtrain_block_options_t o = options_of(&sel_cases[cases[cj]], 4);
      o.noncausal = 1;
      mtrain_context_t *ctx = make_ctx(backend, p.G, 2);
      mtrain_pattern_t *one = NULL;
      double recall[16];
      int32_t top_k[16];
      int64_t blocks[16];
      mtrain_block_report_t rep = {recall, top_k, blocks};
      assert_int_equal(mtrain_pattern_select_blocks(ctx, &tq, &tk, &tl, &o, &rep, &one),
                       MTRAIN_SUCCESS);
      mtrain_context_destroy(ctx);
      assert_int_equal(mtrain_pattern_is_causal(one), 0);
      for (int gather = 0; gather < 2; gather++)
        for (size_t wi = 0; wi < sizeof worlds / sizeof worlds[0]; wi++)
          for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
            const int W = worlds[wi];
            if (gather)
              setenv("MTRAIN_BLOCK_KEY_GATHER", "1", 1);
            else
              unsetenv("MTRAIN_BLOCK_KEY_GATHER");
            mtrain_layout_t *layout = NULL;
            assert_int_equal(mtrain_layout_create(kinds[ki], p.N, p.G, W, NULL, &layout),
                             MTRAIN_SUCCESS);
            shared_comm_t sh = {.size = W};
            pthread_barrier_init(&sh.barrier, NULL, (unsigned)W);
            pthread_mutex_init(&sh.mu, NULL);
            pthread_cond_init(&sh.cv, NULL);
            rank_job_t jobs[4];
            pthread_t th[4];
            int64_t score_sum = 0;
            for (int r = 0; r < W; r++) {
              memset(&jobs[r], 0, sizeof jobs[r]);
              jobs[r].tc.sh = &sh;
              jobs[r].tc.rank = r;
              jobs[r].p = &p;
              jobs[r].layout = layout;
              jobs[r].backend = backend;
              jobs[r].o = o;
              pthread_create(&th[r], NULL, rank_main, &jobs[r]);
            }
            for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
            for (int r = 0; r < W; r++) {
              if (jobs[r].st != MTRAIN_SUCCESS)
                fail_msg("non-causal %s W %d %s rank %d: %s (%s)", backend, W,
                         mtrain_layout_kind_name(kinds[ki]), r, mtrain_status_name(jobs[r].st),
                         mtrain_last_error());
              if (!same_masks(one, jobs[r].pattern) || mtrain_pattern_is_causal(jobs[r].pattern) ||
                  memcmp(recall, jobs[r].recall, sizeof(double) * (size_t)p.Hq) ||
                  memcmp(top_k, jobs[r].top_k, sizeof(int32_t) * (size_t)p.Hq) ||
                  memcmp(blocks, jobs[r].blocks, sizeof(int64_t) * (size_t)p.Hq))
                fail_msg("non-causal %s seed %llu case %zu W %d %s rank %d: not bitwise the "
                         "single-rank selection",
                         backend, (unsigned long long)seed, cases[cj], W,
                         mtrain_layout_kind_name(kinds[ki]), r);
              mtrain_pattern_destroy(jobs[r].pattern);
              const int64_t *own = mtrain_layout_rank_blocks(layout, r);
              int64_t rows = 0;
              for (int32_t lb = 0; lb < mtrain_layout_rank_num_blocks(layout, r); lb++)
                rows += own[lb] < nb;
              assert_int_equal(jobs[r].times.score_bytes,
                               (int64_t)sizeof(double) * p.Hq * rows * nb);
              score_sum += jobs[r].times.score_bytes;
            }
            assert_int_equal(score_sum, (int64_t)sizeof(double) * p.Hq * nb * nb);
            pthread_barrier_destroy(&sh.barrier);
            pthread_mutex_destroy(&sh.mu);
            pthread_cond_destroy(&sh.cv);
            for (int r = 0; r < W; r++) assert_null(sh.box[r]);
            mtrain_layout_destroy(layout);
          }
      unsetenv("MTRAIN_BLOCK_KEY_GATHER");
      print_message("non-causal ring %s seed %llu case %zu (%s): W 1, 2, 3, 4 x 3 layouts "
                    "bitwise equal\n",
                    backend, (unsigned long long)seed, cases[cj],
                    mtrain_block_method_name(o.method));
      mtrain_pattern_destroy(one);
    }
  }
  problem_free(&p);
}

/* ---- 5d. the antidiagonal ring form: no key gather ------------------------------------------ */

/* Runs the selection of `o` on W threads sharing a communicator; the jobs'
 * patterns are left for the caller. */
static void run_ranks(const problem_t *p, const mtrain_layout_t *layout, const char *backend,
                      const mtrain_block_options_t *o, int W, rank_job_t *jobs) {
  shared_comm_t sh = {.size = W};
  pthread_t th[8];
  pthread_barrier_init(&sh.barrier, NULL, (unsigned)W);
  pthread_mutex_init(&sh.mu, NULL);
  pthread_cond_init(&sh.cv, NULL);
  for (int r = 0; r < W; r++) {
    memset(&jobs[r], 0, sizeof jobs[r]);
    jobs[r].tc.sh = &sh;
    jobs[r].tc.rank = r;
    jobs[r].p = p;
    jobs[r].layout = layout;
    jobs[r].backend = backend;
    jobs[r].o = *o;
    pthread_create(&th[r], NULL, rank_main, &jobs[r]);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < W; r++)
    if (jobs[r].st != MTRAIN_SUCCESS)
      fail_msg("%s W %d rank %d: %s (%s)", backend, W, r, mtrain_status_name(jobs[r].st),
               mtrain_last_error());
  pthread_barrier_destroy(&sh.barrier);
  pthread_mutex_destroy(&sh.mu);
  pthread_cond_destroy(&sh.cv);
}

/* The backend memory of the antidiagonal selection on W = 4 and 8 ranks
 * (zigzag): with the keys on the ring each rank's peak is exactly its two
 * key chunk buffers, its strided rows' state and its score rows, below the
 * N x Hkv x d fp32 keys that the gather (MTRAIN_BLOCK_KEY_GATHER=1) holds on
 * every rank, and it falls with W (N / W); the pattern is bitwise W = 1's. */
static void test_antidiag_ring_memory(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(900);
  problem_t p;
  problem_make(&p, 2001, 32, 4, 2, 64, seed);
  const int64_t nb = nblocks(&p), all_keys = (int64_t)sizeof(float) * p.N * p.Hkv * p.d;
  sel_case_t c = {MTRAIN_BLOCK_ANTIDIAG, MTRAIN_BUDGET_TOP_P, 0, 0.85, 1, 1, 0};
  const mtrain_block_options_t o = options_of(&c, 8);
  mtrain_tensor_t tq = mtrain_tensor_3d(p.q, MTRAIN_F32, p.N, p.Hq, p.d);
  mtrain_tensor_t tk = mtrain_tensor_3d(p.k, MTRAIN_F32, p.N, p.Hkv, p.d);
  for (int b = 0; b < 2; b++) {
    const char *backend = b ? "cpu" : "cpu-ref";
    mtrain_context_t *ctx = make_ctx(backend, p.G, 2);
    mtrain_pattern_t *one = NULL;
    assert_int_equal(mtrain_pattern_select_blocks(ctx, &tq, &tk, NULL, &o, NULL, &one),
                     MTRAIN_SUCCESS);
    mtrain_context_destroy(ctx);
    int64_t ring_peak[2] = {0, 0};
    for (int wi = 0; wi < 2; wi++) {
      const int W = wi ? 8 : 4;
      mtrain_layout_t *layout = NULL;
      assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_ZIGZAG, p.N, p.G, W, NULL, &layout),
                       MTRAIN_SUCCESS);
      int64_t most = 0;
      for (int r = 0; r < W; r++)
        if (mtrain_layout_local_tokens(layout, r) > most)
          most = mtrain_layout_local_tokens(layout, r);
      rank_job_t jobs[8];
      for (int gather = 0; gather < 2; gather++) {
        if (gather)
          setenv("MTRAIN_BLOCK_KEY_GATHER", "1", 1);
        else
          unsetenv("MTRAIN_BLOCK_KEY_GATHER");
        run_ranks(&p, layout, backend, &o, W, jobs);
        for (int r = 0; r < W; r++) {
          if (!same_masks(one, jobs[r].pattern))
            fail_msg("%s seed %llu W %d rank %d %s: not the single-rank pattern", backend,
                     (unsigned long long)seed, W, r, gather ? "gathered" : "ring");
          mtrain_pattern_destroy(jobs[r].pattern);
          const int32_t local = mtrain_layout_rank_num_blocks(layout, r);
          const int64_t *own = mtrain_layout_rank_blocks(layout, r);
          int64_t rows = 0;
          for (int32_t lb = 0; lb < local; lb++)
            if (own[lb] < nb) rows += own[lb] + 1;
          const int64_t chunks = 2 * (most * p.Hkv * p.d * (int64_t)sizeof(float) + 8);
          const int64_t states =
              ((int64_t)p.Hq * local * (p.G / 8) + 1) * (int64_t)sizeof(mtrain_antidiag_row_t);
          const int64_t scores = ((int64_t)p.Hq * rows + 1) * (int64_t)sizeof(double);
          if (r == 0)
            print_message("antidiag %s seed %llu W %d rank %d, keys %s: backend peak %zu bytes "
                          "(all keys %lld; chunks %lld + row state %lld + scores %lld)\n",
                          backend, (unsigned long long)seed, W, r,
                          gather ? "gathered" : "on the ring", jobs[r].peak, (long long)all_keys,
                          (long long)chunks, (long long)states, (long long)scores);
          if (gather) {
            assert_true((int64_t)jobs[r].peak >= all_keys);
          } else {
            assert_int_equal((int64_t)jobs[r].peak, chunks + states + scores);
            assert_true((int64_t)jobs[r].peak < all_keys);
            if ((int64_t)jobs[r].peak > ring_peak[wi]) ring_peak[wi] = (int64_t)jobs[r].peak;
          }
        }
      }
      unsetenv("MTRAIN_BLOCK_KEY_GATHER");
      mtrain_layout_destroy(layout);
    }
    /* N / W: the largest rank's peak at W = 8 is about half of W = 4's */
    assert_true(ring_peak[1] < 0.6 * (double)ring_peak[0]);
    mtrain_pattern_destroy(one);
  }
  problem_free(&p);
}

/* The fixed-point normaliser of the antidiagonal rows: the same state for
 * any order and split of its terms, within two units in the last place of
 * a long double sum; a NaN term makes it NaN. */
static void test_antidiag_normaliser(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(901);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  enum { n = 3000 };
  double *t = malloc(sizeof(double) * n);
  long double exact = 0.0L;
  for (int i = 0; i < n; i++) {
    const double u = ts_rng_uniform(&rng);
    t[i] = i % 7 == 0 ? 1.0 : i % 5 == 0 ? ldexp(u, -60) : exp(-40.0 * u);
    exact += (long double)t[i];
  }
  mtrain_antidiag_row_t fwd, bwd, split[2];
  cpu_adrow_init(&fwd), cpu_adrow_init(&bwd), cpu_adrow_init(&split[0]), cpu_adrow_init(&split[1]);
  for (int i = 0; i < n; i++) {
    cpu_adrow_add(&fwd, t[i]);
    cpu_adrow_add(&bwd, t[n - 1 - i]);
    cpu_adrow_add(&split[ts_rng_below(&rng, 2)], t[i]);
  }
  /* a split's parts continued on the other part's terms: any order of arrival */
  mtrain_antidiag_row_t joined = split[0];
  for (int i = n - 1; i >= 0; i--) cpu_adrow_add(&joined, 0.0);
  assert_memory_equal(fwd.z, bwd.z, sizeof fwd.z);
  const double z = cpu_adrow_z(&fwd);
  print_message("antidiag normaliser seed %llu: %d terms, %.17g, relative difference to long "
                "double %.3g\n",
                (unsigned long long)seed, n, z, (double)fabsl(((long double)z - exact) / exact));
  assert_true(fabsl((long double)z - exact) <= 2.0L * 2.220446049250313e-16L * exact);
  /* the two parts' integer states add to the whole (carries included) */
  unsigned __int128 lo = (unsigned __int128)split[0].z[0] + split[1].z[0];
  unsigned __int128 mid = (unsigned __int128)split[0].z[1] + split[1].z[1] + (uint64_t)(lo >> 64);
  assert_true((uint64_t)lo == fwd.z[0] && (uint64_t)mid == fwd.z[1]);
  assert_true(split[0].z[2] + split[1].z[2] + (uint64_t)(mid >> 64) == fwd.z[2]);
  assert_memory_equal(joined.z, split[0].z, sizeof joined.z); /* zeros add nothing */
  cpu_adrow_add(&fwd, NAN);
  assert_true(isnan(cpu_adrow_z(&fwd)));
  free(t);
}

/* ---- 6. refusals ---------------------------------------------------------------------------- */

static void test_refusals(void **state) {
  (void)state;
  problem_t p;
  problem_make(&p, 100, 16, 2, 1, 64, 1);
  mtrain_tensor_t tq = mtrain_tensor_3d(p.q, MTRAIN_F32, p.N, p.Hq, p.d);
  mtrain_tensor_t tk = mtrain_tensor_3d(p.k, MTRAIN_F32, p.N, p.Hkv, p.d);
  mtrain_tensor_t tl = mtrain_tensor_2d(p.lsef, MTRAIN_F32, p.N, p.Hq);
  mtrain_context_t *ctx = make_ctx("cpu", p.G, 1);
  mtrain_pattern_t *out = NULL;
  mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, NULL, &o, NULL, &out),
                   MTRAIN_ERR_NULL_POINTER, "needs the forward's lse");
  o.method = MTRAIN_BLOCK_ANTIDIAG;
  o.stride = 5;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, NULL, &o, NULL, &out),
                   MTRAIN_ERR_INVALID_ARGUMENT, "stride 5 does not divide the granularity 16");
  o = (mtrain_block_options_t)MTRAIN_BLOCK_OPTIONS_INIT;
  o.method = MTRAIN_BLOCK_MEANPOOL;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, NULL, &o, NULL, &out),
                   MTRAIN_ERR_INVALID_ARGUMENT, "meanpool gating is top-k only");
  o.kind = MTRAIN_BUDGET_TOP_K;
  o.top_k = -1;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, NULL, &o, NULL, &out),
                   MTRAIN_ERR_INVALID_BUDGET, "top_k -1");
  o.top_k = 2;
  o.head_adaptive = 1;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, NULL, &o, NULL, &out),
                   MTRAIN_ERR_INVALID_ARGUMENT, "head_adaptive needs top-k with precise");
  o = (mtrain_block_options_t)MTRAIN_BLOCK_OPTIONS_INIT;
  o.top_p = 1.5;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, &tl, &o, NULL, &out),
                   MTRAIN_ERR_INVALID_BUDGET, "top_p 1.5");
  /* a backend without the optional slot: NOT_SUPPORTED naming it */
  mtrain_backend_ops_t ops = *ctx->backend;
  ops.block_scores = NULL;
  const mtrain_backend_ops_t *saved = ctx->backend;
  ctx->backend = &ops;
  o = (mtrain_block_options_t)MTRAIN_BLOCK_OPTIONS_INIT;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, &tl, &o, NULL, &out),
                   MTRAIN_ERR_NOT_SUPPORTED, "backend 'cpu' has no block scores");
  /* non-causal: refused by a backend without block_scores_noncausal, naming it */
  ops = *saved;
  ops.block_scores_noncausal = 0;
  o.noncausal = 1;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, &tl, &o, NULL, &out),
                   MTRAIN_ERR_NOT_SUPPORTED, "backend 'cpu' scores causal blocks only");
  o.noncausal = 2;
  TS_ASSERT_STATUS(mtrain_pattern_select_blocks(ctx, &tq, &tk, &tl, &o, NULL, &out),
                   MTRAIN_ERR_INVALID_ARGUMENT, "noncausal 2");
  mtrain_block_scores_args_t a = {.method = MTRAIN_BLOCK_MEANPOOL};
  ops.block_scores = NULL;
  TS_ASSERT_STATUS(mtrain_be_block_scores(ctx, &a), MTRAIN_ERR_NOT_SUPPORTED,
                   "backend 'cpu' has no block_scores");
  ctx->backend = saved;
  /* antidiagonal key chunks: only in pass 1, 2 or 3 with the row state; all keys in pass 0 */
  const int64_t chunk[1] = {0};
  a = (mtrain_block_scores_args_t){.method = MTRAIN_BLOCK_ANTIDIAG,
                                   .granularity = 16,
                                   .stride = 4,
                                   .k_block_global = chunk,
                                   .num_k_blocks = 1};
  TS_ASSERT_STATUS(mtrain_be_block_scores(ctx, &a), MTRAIN_ERR_INVALID_ARGUMENT,
                   "antidiag_pass 0, a key chunk");
  a.antidiag_pass = 2;
  TS_ASSERT_STATUS(mtrain_be_block_scores(ctx, &a), MTRAIN_ERR_INVALID_ARGUMENT,
                   "antidiag_pass 2, a key chunk");
  a.k_block_global = NULL;
  TS_ASSERT_STATUS(mtrain_be_block_scores(ctx, &a), MTRAIN_ERR_INVALID_ARGUMENT,
                   "antidiag_pass 2, all keys");
  assert_null(out);
  /* names */
  mtrain_block_method_t m;
  assert_int_equal(mtrain_block_method_parse("antidiag", &m), MTRAIN_SUCCESS);
  assert_int_equal(m, MTRAIN_BLOCK_ANTIDIAG);
  TS_ASSERT_STATUS(mtrain_block_method_parse("moba", &m), MTRAIN_ERR_INVALID_ARGUMENT, "'moba'");
  mtrain_context_destroy(ctx);
  problem_free(&p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_scores),
      cmocka_unit_test(test_selection_rule),
      cmocka_unit_test(test_end_to_end),
      cmocka_unit_test(test_adaptive),
      cmocka_unit_test(test_ring_bitwise),
      cmocka_unit_test(test_exact_sum),
      cmocka_unit_test(test_noncausal_scores),
      cmocka_unit_test(test_noncausal_candidates),
      cmocka_unit_test(test_noncausal_ring),
      cmocka_unit_test(test_antidiag_ring_memory),
      cmocka_unit_test(test_antidiag_normaliser),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
