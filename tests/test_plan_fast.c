/* test_plan_fast.c: the host speed-ups of issue 20 change nothing: the
 * plan builder, the step builder, the selection and the estimate of the
 * library give bitwise the same plans (every array, count, pair total and
 * byte count of every step, head and rank) and patterns as the code they
 * replaced, kept as tests/reference/ (commit 906fdc4). Random patterns and
 * inputs (seeds printed; MTRAIN_TEST_SEED overrides), GQA, lengths not
 * divisible by the block size, W = 1, 2, 3, 5 with every layout kind, 1 and
 * 3 threads, and every layer of the real budget files. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
#include "core/runtime/select.h"
#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_layout.h"
#include "reference/reference.h"
#include "test_support.h"

/* ---- bitwise comparison of plans ------------------------------------------- */

static char where[1024]; /* what is being compared, for the failure message */

#define SAME(a, b, what)                                                                           \
  do {                                                                                             \
    if ((int64_t)(a) != (int64_t)(b))                                                              \
      fail_msg("%s: %s differs: %lld (fast) vs %lld (reference)", where, what, (long long)(a),     \
               (long long)(b));                                                                    \
  } while (0)

static void same_array(const void *a, const void *b, size_t bytes, const char *what) {
  if (bytes == 0) return;
  if (!a || !b) fail_msg("%s: %s: NULL array of %zu bytes", where, what, bytes);
  if (memcmp(a, b, bytes) != 0) fail_msg("%s: %s differs", where, what);
}

static void same_store(const mtrain_step_head_store_t *a, const mtrain_step_head_store_t *b,
                       int32_t nqb) {
  SAME(a->num_runs, b->num_runs, "num_runs");
  SAME(a->num_segs, b->num_segs, "num_segs");
  SAME(a->num_bars, b->num_bars, "num_bars");
  SAME(a->pairs, b->pairs, "pairs");
  same_array(a->run_off, b->run_off, sizeof(int32_t) * (size_t)(nqb + 1), "run_off");
  same_array(a->seg_off, b->seg_off, sizeof(int32_t) * (size_t)(nqb + 1), "seg_off");
  same_array(a->runs, b->runs, sizeof(int32_t) * 2 * (size_t)a->num_runs, "runs");
  same_array(a->segs, b->segs, sizeof(int32_t) * 2 * (size_t)a->num_segs, "segs");
  same_array(a->bars, b->bars, sizeof(int32_t) * (size_t)a->num_bars, "bars");
}

static void same_view(const mtrain_step_view_t *a, const mtrain_step_view_t *b) {
  SAME(a->step, b->step, "view.step");
  SAME(a->src_rank, b->src_rank, "view.src_rank");
  SAME(a->granularity, b->granularity, "view.granularity");
  SAME(a->num_heads, b->num_heads, "view.num_heads");
  SAME(a->seq_len, b->seq_len, "view.seq_len");
  SAME(a->q_tokens, b->q_tokens, "view.q_tokens");
  SAME(a->k_tokens, b->k_tokens, "view.k_tokens");
  SAME(a->num_q_blocks, b->num_q_blocks, "view.num_q_blocks");
  SAME(a->num_k_blocks, b->num_k_blocks, "view.num_k_blocks");
  same_array(a->q_block_global, b->q_block_global, sizeof(int64_t) * (size_t)a->num_q_blocks,
             "view.q_block_global");
  same_array(a->k_block_global, b->k_block_global, sizeof(int64_t) * (size_t)a->num_k_blocks,
             "view.k_block_global");
  for (int32_t h = 0; h < a->num_heads; h++) {
    const mtrain_step_head_t *x = &a->heads[h], *y = &b->heads[h];
    SAME(x->num_runs, y->num_runs, "view head num_runs");
    SAME(x->num_segs, y->num_segs, "view head num_segs");
    SAME(x->num_bars, y->num_bars, "view head num_bars");
  }
}

static void same_step(const mtrain_plan_step_t *a, const mtrain_plan_step_t *b, int32_t H,
                      int32_t nqb, const char *kind, int32_t t) {
  const size_t n = strlen(where);
  SAME(a->src_rank, b->src_rank, "src_rank");
  SAME(a->chunk_offset, b->chunk_offset, "chunk_offset");
  same_view(&a->view, &b->view);
  for (int32_t h = 0; h < H; h++) {
    snprintf(where + n, sizeof where - n, ", %s %d head %d", kind, t, h);
    same_store(&a->heads[h], &b->heads[h], nqb);
  }
  where[n] = 0;
}

static void same_plan(const mtrain_plan_t *a, const mtrain_plan_t *b) {
  SAME(a->num_seqs, b->num_seqs, "num_seqs");
  SAME(a->num_steps, b->num_steps, "num_steps");
  SAME(a->num_heads, b->num_heads, "num_heads");
  SAME(a->granularity, b->granularity, "granularity");
  SAME(a->rank, b->rank, "rank");
  SAME(a->world, b->world, "world");
  SAME(a->ranks_per_node, b->ranks_per_node, "ranks_per_node");
  SAME(a->local_tokens, b->local_tokens, "local_tokens");
  SAME(a->computed_pairs, b->computed_pairs, "computed_pairs");
  SAME(a->bytes, b->bytes, "bytes");
  SAME(a->gathered != NULL, b->gathered != NULL, "gathered");
  if (a->gathered) {
    const mtrain_plan_gathered_t *x = a->gathered, *y = b->gathered;
    SAME(x->count, y->count, "gathered count");
    SAME(x->owned, y->owned, "gathered owned");
    SAME(x->max_owned, y->max_owned, "gathered max_owned");
    same_array(x->pack_rows, y->pack_rows, sizeof(int64_t) * (size_t)x->max_owned, "pack_rows");
    same_array(x->unpack, y->unpack, sizeof(int64_t) * 2 * (size_t)x->count, "unpack");
    same_array(x->owned_bars, y->owned_bars, sizeof(int64_t) * 2 * (size_t)x->owned, "owned_bars");
  }
  for (int32_t s = 0; s < a->num_seqs; s++) {
    const mtrain_plan_seq_t *x = &a->seqs[s], *y = &b->seqs[s];
    SAME(x->local_offset, y->local_offset, "local_offset");
    SAME(x->q.num_blocks, y->q.num_blocks, "q.num_blocks");
    SAME(x->q.tokens, y->q.tokens, "q.tokens");
    same_array(x->q.global, y->q.global, sizeof(int64_t) * (size_t)x->q.num_blocks, "q.global");
    SAME(x->bar_base, y->bar_base, "bar_base");
    SAME(x->bar_count, y->bar_count, "bar_count");
    SAME(x->bar_steps != NULL, y->bar_steps != NULL, "bar steps");
    for (int32_t t = 0; t < a->num_steps; t++) {
      same_step(&x->steps[t], &y->steps[t], a->num_heads, x->q.num_blocks, "step", t);
      if (x->bar_steps)
        same_step(&x->bar_steps[t], &y->bar_steps[t], a->num_heads, x->q.num_blocks, "bar step", t);
    }
  }
}

/* Builds the plan of rank r of W (layout kind, ranks per node) for the n
 * sequences ps (a packed batch when n > 1; n == 1 passes no mtrain_seqs_t)
 * with the library and the reference and compares them; W == 1 with kind < 0:
 * the single-rank mtrain_plan_create. */
static void compare_batch_rank(const mtrain_pattern_t *const *ps, int32_t n, int32_t W, int32_t r,
                               int kind, int32_t rpn, int threads, const char *what) {
  const int32_t G = mtrain_pattern_granularity(ps[0]);
  int64_t offsets[9] = {0};
  assert_true(n >= 1 && n <= 8);
  for (int32_t s = 0; s < n; s++) offsets[s + 1] = offsets[s] + mtrain_pattern_seq_len(ps[s]);
  const mtrain_seqs_t batch = {n, offsets};
  const mtrain_seqs_t *seqs = n > 1 ? &batch : NULL;
  mtrain_comm_t *comm = NULL;
  assert_int_equal(mtrain_comm_create_planning(r, W, &comm), MTRAIN_SUCCESS);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  cfg.num_threads = threads;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, W > 1 ? comm : NULL, &ctx), MTRAIN_SUCCESS);
  mtrain_layout_t *layouts[8] = {NULL};
  mtrain_plan_t *fast = NULL, *ref = NULL;
  mtrain_status_t sf, sr;
  if (kind < 0) {
    sf = mtrain_plan_create(ctx, seqs, ps, &fast);
    sr = ref_plan_create(ctx, seqs, ps, &ref);
  } else {
    for (int32_t s = 0; s < n; s++)
      assert_int_equal(mtrain_layout_create((mtrain_layout_kind_t)kind,
                                            mtrain_pattern_seq_len(ps[s]), G, W, NULL, &layouts[s]),
                       MTRAIN_SUCCESS);
    const mtrain_layout_t *const *ls = (const mtrain_layout_t *const *)layouts;
    sf = mtrain_plan_create_ring(ctx, seqs, ls, rpn, ps, &fast);
    sr = ref_plan_create_ring(ctx, seqs, ls, rpn, ps, &ref);
  }
  snprintf(where, sizeof where,
           "%.300s: %d sequence(s), N %lld (first) G %d W %d rank %d layout %s rpn %d threads %d",
           what, n, (long long)offsets[1], G, W, r,
           kind < 0 ? "single" : mtrain_layout_kind_name(kind), rpn, threads);
  SAME(sf, sr, "status");
  if (sf == MTRAIN_SUCCESS) same_plan(fast, ref);
  mtrain_plan_destroy(fast);
  ref_plan_destroy(ref);
  for (int32_t s = 0; s < n; s++) mtrain_layout_destroy(layouts[s]);
  mtrain_context_destroy(ctx);
  mtrain_comm_destroy(comm);
}

/* One sequence's plan (compare_batch_rank with n = 1). */
static void compare_plan_rank(const mtrain_pattern_t *p, int32_t W, int32_t r, int kind,
                              int32_t rpn, int threads, const char *what) {
  compare_batch_rank((const mtrain_pattern_t *const[]){p}, 1, W, r, kind, rpn, threads, what);
}

/* Every rank of W = 1, 2, 3, 5 over every layout kind (flat; hierarchical
 * with one rank per node too), threads alternating 1 and 3. */
static void compare_all_plans(const mtrain_pattern_t *p, const char *what, int ranks_all) {
  static const int32_t worlds[] = {1, 2, 3, 5};
  int threads = 1;
  compare_plan_rank(p, 1, 0, -1, 0, 3, what);
  for (size_t wi = 0; wi < sizeof worlds / sizeof *worlds; wi++) {
    const int32_t W = worlds[wi];
    for (int kind = 0; kind <= MTRAIN_LAYOUT_BALANCED; kind++)
      for (int32_t rpn = 0; rpn <= (W > 1 ? 1 : 0); rpn++)
        for (int32_t r = 0; r < W; r++) {
          if (!ranks_all && r != 0 && r != W - 1) continue;
          compare_plan_rank(p, W, r, kind, rpn, threads, what);
          threads = 4 - threads;
        }
  }
}

/* ---- random patterns ------------------------------------------------------- */

static double pick(ts_rng_t *rng, const double *v, int n) { return v[ts_rng_below(rng, n)]; }

/* Heads of every kind: no verticals or many, few diagonals or nearly all,
 * runs of consecutive diagonals, and generic block masks. */
static mtrain_pattern_t *random_pattern(ts_rng_t *rng, int64_t N, int32_t H, int32_t G) {
  static const double pd[] = {0.0, 0.02, 0.2, 0.7, 1.0}, pv[] = {0.0, 0.002, 0.03, 0.3};
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(N, H, G, &p), MTRAIN_SUCCESS);
  const int64_t nb = mtrain_pattern_num_blocks(p);
  int32_t *diags = malloc(sizeof(int32_t) * (size_t)(nb + 1));
  int64_t *verts = malloc(sizeof(int64_t) * (size_t)(N + 1));
  uint8_t *mask = nb <= 200 ? malloc((size_t)(nb * nb)) : NULL;
  for (int32_t h = 0; h < H; h++) {
    if (mask && ts_rng_below(rng, 6) == 0) {
      const double q = ts_rng_uniform(rng);
      for (int64_t i = 0; i < nb; i++)
        for (int64_t j = 0; j < nb; j++) mask[i * nb + j] = j <= i && ts_rng_uniform(rng) < q;
      assert_int_equal(mtrain_pattern_set_block_mask(p, h, mask), MTRAIN_SUCCESS);
      continue;
    }
    const double d = pick(rng, pd, 5), v = pick(rng, pv, 4);
    const int clustered = ts_rng_below(rng, 2) == 0;
    int32_t nd = 0;
    for (int64_t t = 0; t < nb; t++) {
      int take = ts_rng_uniform(rng) < d;
      if (clustered && nd > 0 && diags[nd - 1] == t - 1 && ts_rng_uniform(rng) < 0.8) take = 1;
      if (take) diags[nd++] = (int32_t)t;
    }
    int32_t nv = 0;
    for (int64_t j = 0; j < N; j++)
      if (ts_rng_uniform(rng) < v || (v > 0 && j < 4)) verts[nv++] = j;
    assert_int_equal(mtrain_pattern_set_head(p, h, diags, nd, verts, nv), MTRAIN_SUCCESS);
  }
  free(diags);
  free(verts);
  free(mask);
  return p;
}

/* MTRAIN_TEST_QUICK=1 (emulated and sanitizer runs): a third of the cases,
 * every sixth layer of the budget files, one long pattern per file. */
static int quick(void) {
  const char *e = getenv("MTRAIN_TEST_QUICK");
  return e && strcmp(e, "1") == 0;
}

static void test_random_plans(void **state) {
  (void)state;
  static const int64_t lengths[] = {1, 37, 200, 1000, 1024, 3001};
  static const int32_t grans[] = {1, 7, 16, 64, 128};
  for (int c = 0; c < (quick() ? 8 : 24); c++) {
    const uint64_t seed = ts_seed(0x9e3779b9u + (uint64_t)c);
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    const int64_t N = lengths[ts_rng_below(&rng, 6)];
    int32_t G = grans[ts_rng_below(&rng, 5)];
    if (G == 1 && N > 200) G = 16; /* kept quick */
    const int32_t H = 1 + (int32_t)ts_rng_below(&rng, 4);
    mtrain_pattern_t *p = random_pattern(&rng, N, H, G);
    char what[96];
    snprintf(what, sizeof what, "random plan seed %llu", (unsigned long long)seed);
    printf("%s: N %lld G %d heads %d\n", what, (long long)N, G, H);
    compare_all_plans(p, what, 1);
    mtrain_pattern_destroy(p);
  }
}

/* Packed batches (several sequences in one plan, built in one parallel loop
 * over all sequences, steps and heads): the library's plan of rank r against
 * the reference's, single-rank and on rings of every layout kind. */
static void test_packed_plans(void **state) {
  (void)state;
  for (int c = 0; c < (quick() ? 3 : 8); c++) {
    const uint64_t seed = ts_seed(0xBA7C0000u + (uint64_t)c);
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    const int32_t G = (int32_t)(8 << ts_rng_below(&rng, 4)), H = 1 + (int32_t)ts_rng_below(&rng, 4);
    const int32_t n = 2 + (int32_t)ts_rng_below(&rng, 7);
    mtrain_pattern_t *ps[8];
    for (int32_t s = 0; s < n; s++)
      ps[s] = random_pattern(&rng, 1 + ts_rng_below(&rng, 20 * G), H, G);
    char what[96];
    snprintf(what, sizeof what, "packed plan seed %llu", (unsigned long long)seed);
    printf("%s: %d sequences G %d heads %d\n", what, n, G, H);
    const mtrain_pattern_t *const *cps = (const mtrain_pattern_t *const *)ps;
    compare_batch_rank(cps, n, 1, 0, -1, 0, 1 + c % 3, what);
    static const int32_t worlds[] = {2, 3};
    for (int wi = 0; wi < 2; wi++)
      for (int kind = 0; kind <= MTRAIN_LAYOUT_BALANCED; kind++)
        for (int32_t r = 0; r < worlds[wi]; r++)
          compare_batch_rank(cps, n, worlds[wi], r, kind, 0, 1 + (r + kind) % 3, what);
    for (int32_t s = 0; s < n; s++) mtrain_pattern_destroy(ps[s]);
  }
}

/* The step builder alone, on arbitrary increasing block subsets (padding
 * blocks included) for q and k, with and without bars. */
static void test_step_head_builder(void **state) {
  (void)state;
  for (int c = 0; c < 60; c++) {
    const uint64_t seed = ts_seed(0x5eed0000u + (uint64_t)c);
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    const int32_t G = 1 + (int32_t)ts_rng_below(&rng, 40);
    const int64_t N = 1 + ts_rng_below(&rng, 60 * G);
    mtrain_pattern_t *p = random_pattern(&rng, N, 2, G);
    const int64_t nb = mtrain_pattern_num_blocks(p), padded = nb + ts_rng_below(&rng, 4);
    int64_t *qg = malloc(sizeof(int64_t) * (size_t)padded),
            *kg = malloc(sizeof(int64_t) * (size_t)padded);
    mtrain_rank_blocks_t q = {0, qg, 0}, k = {0, kg, 0};
    for (int64_t b = 0; b < padded; b++) {
      if (ts_rng_below(&rng, 3)) qg[q.num_blocks++] = b;
      if (ts_rng_below(&rng, 3)) kg[k.num_blocks++] = b;
    }
    q.tokens = (int64_t)q.num_blocks * G;
    k.tokens = (int64_t)k.num_blocks * G;
    for (int32_t h = 0; h < 2; h++)
      for (int bars = 0; bars < 2; bars++) {
        mtrain_step_head_store_t a, b;
        snprintf(where, sizeof where, "step builder seed %llu N %lld G %d head %d bars %d",
                 (unsigned long long)seed, (long long)N, G, h, bars);
        assert_int_equal(bars ? mtrain_plan_build_step_head(p, h, &q, &k, &a)
                              : mtrain_plan_build_step_head_runs(p, h, &q, &k, &a),
                         MTRAIN_SUCCESS);
        assert_int_equal(bars ? ref_plan_build_step_head(p, h, &q, &k, &b)
                              : ref_plan_build_step_head_runs(p, h, &q, &k, &b),
                         MTRAIN_SUCCESS);
        same_store(&a, &b, q.num_blocks);
        mtrain_step_head_store_free(&a);
        ref_step_head_store_free(&b);
      }
    free(qg);
    free(kg);
    mtrain_pattern_destroy(p);
  }
}

/* ---- selection ------------------------------------------------------------- */

static void test_selection(void **state) {
  (void)state;
  static const double specials[] = {0.0, -0.0, 1.0, 0.5, INFINITY, -INFINITY, NAN, 1e-300};
  for (int c = 0; c < 400; c++) {
    const uint64_t seed = ts_seed(0xabcd0000u + (uint64_t)c);
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    const int64_t n = ts_rng_below(&rng, c < 300 ? 300 : 20000);
    double *sc = malloc(sizeof(double) * (size_t)(n + 1));
    uint8_t *forced = calloc((size_t)n + 1, 1);
    int64_t *o1 = malloc(sizeof(int64_t) * (size_t)(n + 1)),
            *o2 = malloc(sizeof(int64_t) * (size_t)(n + 1)),
            *r1 = malloc(sizeof(int64_t) * (size_t)(n + 1)),
            *r2 = malloc(sizeof(int64_t) * (size_t)(n + 1));
    const int mode = (int)ts_rng_below(&rng, 4); /* 0 distinct, 1 few values, 2 specials, 3 probs */
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) {
      sc[i] = mode == 0   ? ts_rng_uniform(&rng)
              : mode == 1 ? (double)ts_rng_below(&rng, 5)
              : mode == 2 ? specials[ts_rng_below(&rng, 8)]
                          : ts_rng_uniform(&rng) * ts_rng_uniform(&rng);
      total += mode == 3 ? sc[i] : 0.0;
      forced[i] = ts_rng_below(&rng, 20) == 0;
    }
    for (int64_t i = 0; mode == 3 && i < n; i++) sc[i] /= total;
    const int64_t k = ts_rng_below(&rng, n + 3) - 1;
    const uint8_t *f = ts_rng_below(&rng, 2) ? forced : NULL;
    snprintf(where, sizeof where, "selection seed %llu n %lld k %lld mode %d",
             (unsigned long long)seed, (long long)n, (long long)k, mode);
    const int64_t a = mtrain_select_top_k(sc, f, n, k, o1, r1);
    const int64_t b = ref_select_top_k(sc, f, n, k, o2, r2);
    SAME(a, b, "top-k count");
    same_array(r1, r2, sizeof(int64_t) * (size_t)a, "top-k indices");
    const double pp = ts_rng_uniform(&rng);
    const int64_t cap = ts_rng_below(&rng, n + 3) - 1;
    const int64_t x = mtrain_select_top_p(sc, NULL, n, pp, cap, o1, r1);
    const int64_t y = ref_select_top_p(sc, n, pp, cap, o2, r2);
    SAME(x, y, "top-p count");
    same_array(r1, r2, sizeof(int64_t) * (size_t)x, "top-p indices");
    free(sc);
    free(forced);
    free(o1);
    free(o2);
    free(r1);
    free(r2);
  }
}

/* ---- the estimate ---------------------------------------------------------- */

/* Estimates with the library (threads 1 and 3) and the reference, compares
 * the patterns; returns the library's (the caller destroys it). */
static mtrain_pattern_t *compare_estimate(const char *backend, int32_t G, const mtrain_tensor_t *q,
                                          const mtrain_tensor_t *k, const mtrain_head_budget_t *b,
                                          const mtrain_estimate_options_t *eo) {
  mtrain_pattern_t *ref = NULL, *fast = NULL;
  const int32_t H = (int32_t)q->shape[1];
  for (int threads = 1; threads <= 3; threads += 2) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.backend = backend;
    cfg.granularity = G;
    cfg.num_threads = threads;
    mtrain_context_t *ctx = NULL;
    assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
    if (!ref) assert_int_equal(ref_pattern_estimate(ctx, q, k, b, eo, &ref), MTRAIN_SUCCESS);
    mtrain_pattern_destroy(fast);
    fast = NULL;
    assert_int_equal(mtrain_pattern_estimate(ctx, q, k, b, eo, &fast), MTRAIN_SUCCESS);
    mtrain_context_destroy(ctx);
    int32_t head = -1;
    if (!ts_patterns_equal(fast, ref, H, &head))
      fail_msg("%s: estimated patterns differ at head %d (threads %d)", where, head, threads);
  }
  mtrain_pattern_destroy(ref);
  return fast;
}

static void test_random_estimates(void **state) {
  (void)state;
  static const int64_t lengths[] = {1, 50, 333, 1000, 3001};
  static const int32_t grans[] = {16, 64, 128};
  static const int32_t hq[] = {4, 8, 6, 2}, hkv[] = {2, 2, 3, 2};
  for (int c = 0; c < (quick() ? 6 : 16); c++) {
    const uint64_t seed = ts_seed(0xe5700000u + (uint64_t)c);
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    const int64_t N = lengths[ts_rng_below(&rng, 5)];
    const int32_t G = grans[ts_rng_below(&rng, 3)], hi = (int32_t)ts_rng_below(&rng, 4);
    const int32_t Hq = hq[hi], Hkv = hkv[hi], d = ts_rng_below(&rng, 2) ? 32 : 64;
    const mtrain_dtype_t dt = ts_rng_below(&rng, 2) ? MTRAIN_F32 : MTRAIN_BF16;
    const char *backend = ts_rng_below(&rng, 3) ? "cpu" : "cpu-ref";
    const size_t es = mtrain_dtype_size(dt);
    mtrain_tensor_t q = mtrain_tensor_3d(malloc((size_t)N * Hq * d * es), dt, N, Hq, d);
    mtrain_tensor_t k = mtrain_tensor_3d(malloc((size_t)N * Hkv * d * es), dt, N, Hkv, d);
    mtrain_tensor_t v = mtrain_tensor_3d(malloc((size_t)N * Hkv * d * es), dt, N, Hkv, d);
    if (ts_rng_below(&rng, 2)) {
      mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
      so.seed = seed;
      assert_int_equal(mtrain_generate_structured(&so, &q, &k, &v), MTRAIN_SUCCESS);
    } else {
      assert_int_equal(mtrain_generate_normal(seed, 1.0, &q), MTRAIN_SUCCESS);
      assert_int_equal(mtrain_generate_normal(seed + 1, 1.0, &k), MTRAIN_SUCCESS);
    }
    mtrain_head_budget_t *b = calloc((size_t)Hq, sizeof *b);
    for (int32_t h = 0; h < Hq; h++) {
      if (ts_rng_below(&rng, 2)) {
        b[h].kind = MTRAIN_BUDGET_TOP_K;
        b[h].v_size = ts_rng_below(&rng, N + 20);
        b[h].s_size = ts_rng_below(&rng, N + 20);
      } else {
        b[h].kind = MTRAIN_BUDGET_TOP_P;
        b[h].p_v = 0.05 + 0.95 * ts_rng_uniform(&rng);
        b[h].p_s = 0.05 + 0.95 * ts_rng_uniform(&rng);
        b[h].cap_v = ts_rng_below(&rng, N + 20);
        b[h].cap_s = ts_rng_below(&rng, N + 20);
      }
    }
    mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
    eo.last_q = 1 + (int32_t)ts_rng_below(&rng, 130);
    eo.num_sinks = (int32_t)ts_rng_below(&rng, 40);
    eo.window = (int32_t)ts_rng_below(&rng, 150);
    snprintf(where, sizeof where,
             "estimate seed %llu %s N %lld G %d heads %d/%d d %d %s last_q %d sinks %d window %d",
             (unsigned long long)seed, backend, (long long)N, G, Hq, Hkv, d, mtrain_dtype_name(dt),
             eo.last_q, eo.num_sinks, eo.window);
    printf("%s\n", where);
    char what[300];
    snprintf(what, sizeof what, "%.290s", where);
    mtrain_pattern_t *p = compare_estimate(backend, G, &q, &k, b, &eo);
    if (c % 4 == 0) compare_all_plans(p, what, 0);
    mtrain_pattern_destroy(p);
    free(b);
    free(q.data);
    free(k.data);
    free(v.data);
  }
}

/* Every layer of every real budget file: the estimate on structured inputs
 * (kv heads an eighth of the query heads, as Qwen2.5-3B and Llama-3.1-8B),
 * and the plans of its pattern. */
static void test_real_budgets(void **state) {
  (void)state;
  static const char *files[] = {"Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json",
                                "Qwen2.5_3B_flex_0.90.json", "Qwen2.5_3B_flex_0.95.json",
                                "Llama_3.1_8B_Instruct_128k_kv_out_v32_fit_o_best_pattern.json"};
  const int64_t N = 4099;
  const int32_t G = 64, d = 32;
  for (size_t f = 0; f < sizeof files / sizeof *files; f++) {
    mtrain_budgets_t *file = NULL;
    assert_int_equal(mtrain_budgets_read(ts_data_path(files[f]), &file), MTRAIN_SUCCESS);
    const int32_t Hq = mtrain_budgets_num_heads(file, 0), Hkv = Hq / 8;
    mtrain_tensor_t q =
        mtrain_tensor_3d(malloc(sizeof(float) * (size_t)N * Hq * d), MTRAIN_F32, N, Hq, d);
    mtrain_tensor_t k =
        mtrain_tensor_3d(malloc(sizeof(float) * (size_t)N * Hkv * d), MTRAIN_F32, N, Hkv, d);
    mtrain_tensor_t v =
        mtrain_tensor_3d(malloc(sizeof(float) * (size_t)N * Hkv * d), MTRAIN_F32, N, Hkv, d);
    mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
    assert_int_equal(mtrain_generate_structured(&so, &q, &k, &v), MTRAIN_SUCCESS);
    mtrain_head_budget_t *b = calloc((size_t)Hq, sizeof *b);
    for (int32_t l = 0; l < mtrain_budgets_num_layers(file); l += quick() ? 6 : 1) {
      for (int32_t h = 0; h < Hq; h++)
        assert_int_equal(mtrain_budgets_get(file, l, h, &b[h]), MTRAIN_SUCCESS);
      mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
      snprintf(where, sizeof where, "%s layer %d: estimate N %lld G %d", files[f], l, (long long)N,
               G);
      mtrain_pattern_t *p = compare_estimate("cpu", G, &q, &k, b, &eo);
      char what[160];
      snprintf(what, sizeof what, "%s layer %d", files[f], l);
      if (l % 6 == 0)
        compare_all_plans(p, what, 0);
      else
        compare_plan_rank(p, 1, 0, -1, 0, 2, what);
      mtrain_pattern_destroy(p);
    }
    free(b);
    free(q.data);
    free(k.data);
    free(v.data);
    mtrain_budgets_destroy(file);
  }
}

/* Long sequences: the budget patterns of the test support at 32768 tokens
 * (256 blocks), single rank and rank 0 and the last of 3 and 5. */
static void test_long_budget_plans(void **state) {
  (void)state;
  static const char *files[] = {"Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json",
                                "Llama_3.1_8B_Instruct_128k_kv_out_v32_fit_o_best_pattern.json"};
  for (size_t f = 0; f < 2; f++)
    for (int32_t l = 0; l < (quick() ? 1 : 32); l += 15) {
      mtrain_pattern_t *p =
          ts_pattern_from_budgets(ts_data_path(files[f]), l, 32768 + 77, 8, 128, 131072, 7 + l);
      assert_non_null(p);
      char what[160];
      snprintf(what, sizeof what, "%s layer %d (support pattern)", files[f], l);
      compare_plan_rank(p, 1, 0, -1, 0, 2, what);
      for (int32_t W = 3; W <= 5; W += 2)
        for (int32_t r = 0; r < W; r += W - 1) {
          compare_plan_rank(p, W, r, MTRAIN_LAYOUT_STRIPED, 0, 2, what);
          compare_plan_rank(p, W, r, MTRAIN_LAYOUT_BALANCED, 0, 1, what);
        }
      mtrain_pattern_destroy(p);
    }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_selection),         cmocka_unit_test(test_step_head_builder),
      cmocka_unit_test(test_random_plans),      cmocka_unit_test(test_packed_plans),
      cmocka_unit_test(test_random_estimates),  cmocka_unit_test(test_real_budgets),
      cmocka_unit_test(test_long_budget_plans),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
