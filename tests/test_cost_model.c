/* test_cost_model.c: the cost model (SPEC.md section 6) and the time model.
 * The fast counter's per-(rank, step) block and bar counts equal those of
 * plans built with mtrain_plan_build_step_head, for every layout, flat and
 * hierarchical rings, both bars modes, with and without the diagonal table;
 * the metrics on hand-computed examples; the balanced layout is never worse
 * than striped; the time model in its compute- and transfer-bound limits;
 * the position model's counts and positions. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/balance/cost_internal.h"
#include "core/layout/layout_internal.h"
#include "core/layout/schedule.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_layout.h"
#include "test_support.h"

#define NEAR(a, b) (fabs((a) - (b)) <= 1e-12 * (fabs(a) + fabs(b) + 1.0))

/* ---- plan-derived counts ------------------------------------------------------ */

typedef struct plan_counts {
  int64_t full, diag, bars, pairs;
} plan_counts_t;

/* Counts of one (rank, src) for one head from a plan step entry. */
static plan_counts_t plan_step_counts(const mtrain_pattern_t *p, int32_t h,
                                      const mtrain_rank_blocks_t *q,
                                      const mtrain_rank_blocks_t *k) {
  mtrain_step_head_store_t s;
  assert_int_equal(mtrain_plan_build_step_head(p, h, q, k, &s), MTRAIN_SUCCESS);
  plan_counts_t c = {0, 0, 0, s.pairs};
  for (int32_t qb = 0; qb < q->num_blocks; qb++) {
    for (int32_t e = s.run_off[qb]; e < s.run_off[qb + 1]; e++)
      for (int32_t kb = s.runs[2 * e]; kb < s.runs[2 * e + 1]; kb++) {
        if (k->global[kb] == q->global[qb])
          c.diag++;
        else
          c.full++;
      }
    for (int32_t g = s.seg_off[qb]; g < s.seg_off[qb + 1]; g++)
      c.bars += s.segs[2 * g + 1] - s.segs[2 * g];
  }
  mtrain_step_head_store_free(&s);
  return c;
}

/* The even split of B bars over W steps, as docs/BALANCE.md defines it. */
static int64_t share(int64_t B, int32_t t, int32_t W) { return B * (t + 1) / W - B * t / W; }

/* Checks the cost's counts of every layer, rank and step against plans. */
static void check_against_plans(const mtrain_layout_t *layout, const mtrain_pattern_t **pats,
                                int32_t np, int32_t rpn, const char *what) {
  const int32_t W = mtrain_layout_world(layout);
  const int32_t G = mtrain_layout_granularity(layout);
  const int64_t N = mtrain_layout_seq_len(layout);
  mtrain_cost_t *cost[2][2]; /* [direct][mode] */
  for (int direct = 0; direct < 2; direct++)
    for (int m = 0; m < 2; m++)
      assert_int_equal(mtrain_cost_evaluate_owner(
                           layout->owner, layout->num_blocks, N, G, W, rpn, (mtrain_bars_mode_t)m,
                           pats, np, direct ? MTRAIN_COST_DIRECT : 0, &cost[direct][m]),
                       MTRAIN_SUCCESS);
  plan_counts_t *rs = calloc((size_t)W * W, sizeof *rs);       /* [rank][src] of one layer */
  int64_t *gathered = calloc((size_t)W * W, sizeof *gathered); /* [rank][step] */
  for (int32_t l = 0; l < np; l++) {
    memset(rs, 0, sizeof *rs * (size_t)W * W);
    memset(gathered, 0, sizeof *gathered * (size_t)W * W);
    for (int32_t h = 0; h < mtrain_pattern_num_heads(pats[l]); h++)
      for (int32_t r = 0; r < W; r++) {
        const mtrain_rank_blocks_t q = mtrain_layout_rank_view(layout, r);
        int64_t B = 0;
        for (int32_t s = 0; s < W; s++) {
          const mtrain_rank_blocks_t k = mtrain_layout_rank_view(layout, s);
          const plan_counts_t c = plan_step_counts(pats[l], h, &q, &k);
          rs[r * W + s].full += c.full;
          rs[r * W + s].diag += c.diag;
          rs[r * W + s].bars += c.bars;
          rs[r * W + s].pairs += c.pairs;
          B += c.bars;
        }
        for (int32_t t = 0; t < W; t++) gathered[r * W + t] += share(B, t, W);
      }
    for (int ring = 0; ring < 2; ring++)
      for (int32_t r = 0; r < W; r++)
        for (int32_t t = 0; t < W; t++) {
          int32_t src = -1;
          assert_int_equal(mtrain_ring_source(W, ring ? rpn : 0, r, t, &src), MTRAIN_SUCCESS);
          const plan_counts_t want = rs[r * W + src];
          for (int direct = 0; direct < 2; direct++)
            for (int m = 0; m < 2; m++) {
              mtrain_work_counts_t got;
              assert_int_equal(
                  mtrain_cost_counts(cost[direct][m], (mtrain_ring_kind_t)ring, l, r, t, &got),
                  MTRAIN_SUCCESS);
              const int64_t want_bars = m ? gathered[r * W + t] : want.bars;
              if (got.full_blocks != want.full || got.diag_blocks != want.diag ||
                  got.bars != want_bars)
                fail_msg("%s: layer %d ring %d rank %d step %d (src %d) direct %d mode %d: cost "
                         "(%lld, %lld, %lld), plans (%lld, %lld, %lld)",
                         what, l, ring, r, t, src, direct, m, (long long)got.full_blocks,
                         (long long)got.diag_blocks, (long long)got.bars, (long long)want.full,
                         (long long)want.diag, (long long)want_bars);
              /* token-level pairs from block counts when blocks are whole */
              if (N % G == 0 && m == 0)
                assert_int_equal(got.full_blocks * G * G + got.diag_blocks * G * (G + 1) / 2 +
                                     got.bars * G,
                                 want.pairs);
            }
        }
  }
  for (int direct = 0; direct < 2; direct++)
    for (int m = 0; m < 2; m++) mtrain_cost_destroy(cost[direct][m]);
  free(rs);
  free(gathered);
}

/* A head dominated by the local window and sinks: block diagonals 0 and 1,
 * verticals at the first `sinks` keys and `spread` more spread evenly. */
static void set_window_sinks_head(mtrain_pattern_t *p, int32_t h, int32_t sinks, int32_t spread) {
  const int64_t N = mtrain_pattern_seq_len(p);
  const int32_t G = mtrain_pattern_granularity(p);
  const int64_t limit = (mtrain_pattern_num_blocks(p) - 1) * G;
  int64_t *v = malloc(sizeof(int64_t) * (size_t)(sinks + spread + 1));
  int32_t nv = 0;
  for (int32_t i = 0; i < sinks && i < limit; i++) v[nv++] = i;
  for (int32_t i = 0; i < spread; i++) {
    const int64_t x = sinks + (2 * (int64_t)i + 1) * (limit - sinks) / (2 * spread);
    if (x < limit && x > v[nv - 1]) v[nv++] = x;
  }
  const int32_t d[2] = {0, 1};
  assert_int_equal(mtrain_pattern_set_head(p, h, d, N > G ? 2 : 1, v, nv), MTRAIN_SUCCESS);
  free(v);
}

static mtrain_pattern_t *window_sinks_pattern(int64_t N, int32_t G, int32_t heads) {
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(N, heads, G, &p), MTRAIN_SUCCESS);
  for (int32_t h = 0; h < heads; h++) set_window_sinks_head(p, h, 30, 20 + 40 * h);
  return p;
}

static void test_counts_match_plans(void **state) {
  (void)state;
  /* (world, ranks per node): flat-only worlds and the 2x2, 3x2, 4x2 clusters */
  const int32_t shapes[][2] = {{1, 0}, {2, 0}, {3, 0}, {4, 2}, {6, 2}, {8, 2}, {7, 0}};
  const ts_pattern_kind_t kinds[] = {TS_PATTERN_DENSE, TS_PATTERN_RANDOM_SPARSE,
                                     TS_PATTERN_BLOCK_MASK, TS_PATTERN_BUDGETS};
  const int32_t G = 8;
  const uint64_t seed = ts_seed(4242);
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
    const int32_t W = shapes[si][0], rpn = shapes[si][1];
    for (int whole = 0; whole < 2; whole++) {
      const int64_t N = whole ? (int64_t)G * 4 * W * 2 : 211 + 13 * (int64_t)si;
      const mtrain_pattern_t *pats[5];
      mtrain_pattern_t *owned[5];
      for (int k = 0; k < 4; k++)
        owned[k] = ts_make_pattern(kinds[k], N, 2, G, seed + si * 17 + (uint64_t)k);
      owned[4] = window_sinks_pattern(N, G, 2);
      for (int k = 0; k < 5; k++) pats[k] = owned[k];
      for (int kind = 0; kind <= MTRAIN_LAYOUT_BALANCED; kind++) {
        mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
        bo.patterns = pats;
        bo.num_patterns = 5;
        bo.ranks_per_node = rpn;
        mtrain_layout_t *layout = NULL;
        assert_int_equal(mtrain_layout_create((mtrain_layout_kind_t)kind, N, G, W, &bo, &layout),
                         MTRAIN_SUCCESS);
        char what[160];
        snprintf(what, sizeof what, "W=%d rpn=%d N=%lld layout=%s (%s) seed=%llu", W, rpn,
                 (long long)N, mtrain_layout_kind_name((mtrain_layout_kind_t)kind),
                 mtrain_layout_variant(layout), (unsigned long long)seed);
        check_against_plans(layout, pats, 5, rpn, what);
        mtrain_layout_destroy(layout);
      }
      for (int k = 0; k < 5; k++) mtrain_pattern_destroy(owned[k]);
    }
  }
}

/* Every candidate owner map the balanced search may pick, counted through
 * the table and directly, also agrees with plans (maps built by hand). */
static void test_counts_match_plans_candidate_maps(void **state) {
  (void)state;
  const int32_t W = 4, G = 4, L = 2;
  const int64_t N = 397, nbp = 100; /* 100 blocks: 25 groups of 4 */
  mtrain_pattern_t *p = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, N, 3, G, ts_seed(99));
  const mtrain_pattern_t *pats[1] = {p};
  int32_t owner[100];
  for (int map = 0; map < 3; map++) {
    for (int64_t b = 0; b < nbp; b++) {
      const int64_t g = b / W;
      const int32_t pos = (int32_t)(b % W);
      owner[b] = map == 0   ? (g % 2 ? W - 1 - pos : pos) /* snake */
                 : map == 1 ? (int32_t)((pos + g) % W)    /* rotated */
                            : (int32_t)((pos / L + g / L) % (W / L)) * L +
                                  (int32_t)((pos % L + g) % L); /* grid-rotated */
    }
    mtrain_layout_t *layout = NULL;
    assert_int_equal(mtrain_layout_from_owner(MTRAIN_LAYOUT_BALANCED, "test", MTRAIN_BARS_IN_RING,
                                              N, G, W, nbp, owner, &layout),
                     MTRAIN_SUCCESS);
    check_against_plans(layout, pats, 1, L, "candidate map");
    mtrain_layout_destroy(layout);
  }
  mtrain_pattern_destroy(p);
}

/* ---- metrics on hand-computed examples ---------------------------------------------- */

static mtrain_cost_t *tiny_cost(mtrain_layout_kind_t kind, const mtrain_pattern_t *p, int mode) {
  mtrain_layout_t *layout = NULL;
  assert_int_equal(mtrain_layout_create(kind, 8, 2, 2, NULL, &layout), MTRAIN_SUCCESS);
  mtrain_cost_options_t o = MTRAIN_COST_OPTIONS_INIT;
  o.bars_mode = mode;
  mtrain_cost_t *c = NULL;
  const mtrain_pattern_t *pats[1] = {p};
  assert_int_equal(mtrain_cost_evaluate(layout, pats, 1, &o, &c), MTRAIN_SUCCESS);
  mtrain_layout_destroy(layout);
  return c;
}

static void test_metrics_hand_computed(void **state) {
  (void)state;
  /* N = 8, G = 2: 4 blocks; striped over 2 ranks: rank 0 {0, 2}, rank 1 {1, 3}. */
  mtrain_pattern_t *dense = NULL, *bar = NULL;
  assert_int_equal(mtrain_pattern_create_dense(8, 1, 2, &dense), MTRAIN_SUCCESS);
  /* Dense: step 0: rank 0 has (2,2),(0,0) diagonal and (2,0) full: 1*4 + 2*2 = 8; rank 1
   * likewise 8. Step 1: rank 0 holds {1,3}: (2,1): 4; rank 1 holds {0,2}: (1,0),(3,0),(3,2):
   * 12. Totals 12 and 20 (mean 16); step maxima 8 + 12 = 20, step means 8 + 8 = 16. */
  mtrain_cost_t *c = tiny_cost(MTRAIN_LAYOUT_STRIPED, dense, -1);
  mtrain_cost_metrics_t m;
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &m), MTRAIN_SUCCESS);
  assert_true(NEAR(m.total_work, 32.0));
  assert_true(NEAR(m.max_rank_work, 20.0));
  assert_true(NEAR(m.worker_imbalance, 1.25));
  assert_true(NEAR(m.ring_sync_slowdown, 1.25));
  assert_true(NEAR(m.step_max_sum, 20.0));
  assert_true(NEAR(mtrain_cost_work(c, MTRAIN_RING_FLAT, -1, 1, 1), 12.0));
  assert_true(NEAR(mtrain_cost_head_ring_sync(c, MTRAIN_RING_FLAT, 0), 1.25));
  assert_true(NEAR(mtrain_cost_head_worker_imbalance(c, 0), 1.25));
  mtrain_cost_destroy(c);
  /* Contiguous: rank 0 {0,1}, rank 1 {2,3}. Step 0: rank 0: (0,0),(1,1) diag, (1,0): 8;
   * rank 1: (2,2),(3,3),(3,2): 8. Step 1: rank 0 holds {2,3}: nothing; rank 1 holds {0,1}:
   * (2,0),(2,1),(3,0),(3,1): 16. Totals 8, 24: imbalance 1.5; maxima 8 + 16 = 24: 1.5. */
  c = tiny_cost(MTRAIN_LAYOUT_CONTIGUOUS, dense, -1);
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &m), MTRAIN_SUCCESS);
  assert_true(NEAR(m.worker_imbalance, 1.5));
  assert_true(NEAR(m.ring_sync_slowdown, 1.5));
  mtrain_cost_destroy(c);

  /* Diagonal 0 and one vertical at key 0 (block 0, rank 0): bars for query blocks 1, 2, 3
   * (G = 2 each). In the ring: rank 0 step 0: 2 diag (4) + 1 bar (2) = 6; rank 1 step 0:
   * 2 diag = 4; rank 0 step 1: 0; rank 1 step 1 (chunk of rank 0): 2 bars = 4. Total 14,
   * maxima 6 + 4 = 10: slowdown 10 / 7; ranks 6 and 8: imbalance 8 / 7. Gathered: rank 0
   * has 1 bar, split 0 + 1; rank 1 has 2, split 1 + 1: rank 0 steps 4, 2; rank 1 steps 6,
   * 2: maxima 6 + 2 = 8: slowdown 8 / 7. */
  assert_int_equal(mtrain_pattern_create(8, 1, 2, &bar), MTRAIN_SUCCESS);
  const int32_t d0[1] = {0};
  const int64_t v0[1] = {0};
  assert_int_equal(mtrain_pattern_set_head(bar, 0, d0, 1, v0, 1), MTRAIN_SUCCESS);
  c = tiny_cost(MTRAIN_LAYOUT_STRIPED, bar, MTRAIN_BARS_IN_RING);
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &m), MTRAIN_SUCCESS);
  assert_true(NEAR(m.total_work, 14.0));
  assert_true(NEAR(m.ring_sync_slowdown, 10.0 / 7.0));
  assert_true(NEAR(m.worker_imbalance, 8.0 / 7.0));
  mtrain_work_counts_t k;
  assert_int_equal(mtrain_cost_counts(c, MTRAIN_RING_FLAT, 0, 1, 1, &k), MTRAIN_SUCCESS);
  assert_int_equal(k.bars, 2);
  assert_int_equal(k.full_blocks + k.diag_blocks, 0);
  mtrain_cost_destroy(c);
  c = tiny_cost(MTRAIN_LAYOUT_STRIPED, bar, MTRAIN_BARS_GATHERED);
  assert_int_equal(mtrain_cost_bars_mode(c), MTRAIN_BARS_GATHERED);
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &m), MTRAIN_SUCCESS);
  assert_true(NEAR(m.ring_sync_slowdown, 8.0 / 7.0));
  assert_true(NEAR(m.worker_imbalance, 8.0 / 7.0));
  assert_true(NEAR(mtrain_cost_work(c, MTRAIN_RING_FLAT, 0, 0, 1), 2.0));
  mtrain_cost_destroy(c);

  /* Two layers: the whole-model slowdown sums per-layer step maxima. Layer A
   * (dense) 20 / 16, layer B (bar, in ring) 10 / 7: (20 + 10) / (16 + 7). */
  mtrain_layout_t *layout = NULL;
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, 8, 2, 2, NULL, &layout),
                   MTRAIN_SUCCESS);
  const mtrain_pattern_t *two[2] = {dense, bar};
  assert_int_equal(mtrain_cost_evaluate(layout, two, 2, NULL, &c), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cost_num_layers(c), 2);
  assert_int_equal(mtrain_cost_num_heads(c), 2);
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &m), MTRAIN_SUCCESS);
  assert_true(NEAR(m.ring_sync_slowdown, 30.0 / 23.0));
  assert_true(NEAR(m.worst_head_slowdown, 10.0 / 7.0));
  assert_int_equal(m.worst_head, 1);
  assert_true(NEAR(mtrain_cost_layer_ring_sync(c, MTRAIN_RING_FLAT, 0), 1.25));
  mtrain_cost_destroy(c);
  mtrain_layout_destroy(layout);
  mtrain_pattern_destroy(dense);
  mtrain_pattern_destroy(bar);
}

/* Hierarchical ring, 2 nodes x 2: with a dense pattern over 16 blocks the
 * per-rank totals equal the flat ring's (a schedule only reorders steps). */
static void test_hierarchical_reorders_only(void **state) {
  (void)state;
  mtrain_pattern_t *p = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, 128, 4, 8, ts_seed(5));
  mtrain_layout_t *layout = NULL;
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, 128, 8, 4, NULL, &layout),
                   MTRAIN_SUCCESS);
  mtrain_cost_options_t o = MTRAIN_COST_OPTIONS_INIT;
  o.ranks_per_node = 2;
  mtrain_cost_t *c = NULL;
  const mtrain_pattern_t *pats[1] = {p};
  assert_int_equal(mtrain_cost_evaluate(layout, pats, 1, &o, &c), MTRAIN_SUCCESS);
  for (int32_t r = 0; r < 4; r++) {
    double flat = 0, hier = 0;
    for (int32_t t = 0; t < 4; t++) {
      flat += mtrain_cost_work(c, MTRAIN_RING_FLAT, -1, r, t);
      hier += mtrain_cost_work(c, MTRAIN_RING_HIERARCHICAL, -1, r, t);
    }
    assert_true(NEAR(flat, hier));
  }
  mtrain_cost_metrics_t a, b;
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &a), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_HIERARCHICAL, &b), MTRAIN_SUCCESS);
  assert_true(NEAR(a.worker_imbalance, b.worker_imbalance));
  assert_true(NEAR(a.total_work, b.total_work));
  assert_int_equal(mtrain_cost_ranks_per_node(c), 2);
  mtrain_cost_destroy(c);
  mtrain_layout_destroy(layout);
  mtrain_pattern_destroy(p);
}

/* ---- balanced never worse than striped ------------------------------------------------ */

static void test_balanced_never_worse(void **state) {
  (void)state;
  const int32_t G = 16;
  const int32_t shapes[][2] = {{2, 0}, {3, 0}, {4, 0}, {8, 0}, {4, 2}, {8, 4}, {6, 3}};
  const uint64_t seed = ts_seed(31337);
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
    const int32_t W = shapes[si][0], rpn = shapes[si][1];
    const int64_t N = 4093 + 64 * (int64_t)si;
    mtrain_pattern_t *owned[4];
    owned[0] = window_sinks_pattern(N, G, 3);
    owned[1] = ts_make_pattern(TS_PATTERN_DENSE, N, 1, G, seed);
    owned[2] = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, N, 2, G, seed + si);
    owned[3] = ts_make_pattern(TS_PATTERN_BUDGETS, N, 4, G, seed + 7 * si);
    const mtrain_pattern_t *pats[4] = {owned[0], owned[1], owned[2], owned[3]};
    /* the workload alone, each pattern alone and the window-and-sinks one */
    for (int set = 0; set < 5; set++) {
      const mtrain_pattern_t *const *ps = set == 4 ? pats : pats + set;
      const int32_t np = set == 4 ? 4 : 1;
      mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
      bo.patterns = ps;
      bo.num_patterns = np;
      bo.ranks_per_node = rpn;
      mtrain_layout_t *striped = NULL, *balanced = NULL;
      assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, N, G, W, NULL, &striped),
                       MTRAIN_SUCCESS);
      assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_BALANCED, N, G, W, &bo, &balanced),
                       MTRAIN_SUCCESS);
      mtrain_cost_options_t o = MTRAIN_COST_OPTIONS_INIT;
      o.ranks_per_node = rpn;
      mtrain_cost_t *cs = NULL, *cb = NULL;
      assert_int_equal(mtrain_cost_evaluate(striped, ps, np, &o, &cs), MTRAIN_SUCCESS);
      assert_int_equal(mtrain_cost_evaluate(balanced, ps, np, &o, &cb), MTRAIN_SUCCESS);
      const mtrain_ring_kind_t ring = rpn ? MTRAIN_RING_HIERARCHICAL : MTRAIN_RING_FLAT;
      mtrain_cost_metrics_t ms, mb;
      assert_int_equal(mtrain_cost_metrics(cs, ring, &ms), MTRAIN_SUCCESS);
      assert_int_equal(mtrain_cost_metrics(cb, ring, &mb), MTRAIN_SUCCESS);
      if (!(mb.ring_sync_slowdown <= ms.ring_sync_slowdown) ||
          !(mb.worker_imbalance <= ms.worker_imbalance))
        fail_msg("W=%d rpn=%d set %d: balanced (%s) ring-sync %.6f imbalance %.6f, striped "
                 "%.6f %.6f (seed %llu)",
                 W, rpn, set, mtrain_layout_variant(balanced), mb.ring_sync_slowdown,
                 mb.worker_imbalance, ms.ring_sync_slowdown, ms.worker_imbalance,
                 (unsigned long long)seed);
      /* window-and-sinks heads: striped leaves the sinks on one rank per step (the
       * hierarchical case at a size of whole rotation cycles is tested below) */
      if (set == 0 && W >= 4 && rpn == 0) {
        assert_true(mb.ring_sync_slowdown < ms.ring_sync_slowdown);
        if (!(mb.worst_head_slowdown <= 1.10))
          fail_msg("W=%d rpn=%d: balanced (%s) worst head %.4f (striped %.4f)", W, rpn,
                   mtrain_layout_variant(balanced), mb.worst_head_slowdown, ms.worst_head_slowdown);
      }
      mtrain_cost_destroy(cs);
      mtrain_cost_destroy(cb);
      mtrain_layout_destroy(striped);
      mtrain_layout_destroy(balanced);
    }
    for (int k = 0; k < 4; k++) mtrain_pattern_destroy(owned[k]);
  }
}

/* Hierarchical rings: with whole rotation cycles (a multiple of W groups of
 * W blocks) the balanced layout keeps every head of a window-and-sinks
 * workload within 1.10, where striped leaves the sinks and diagonal 1 on
 * different steps for different ranks. */
static void test_balanced_hierarchical(void **state) {
  (void)state;
  const int32_t shapes[][2] = {{4, 2}, {6, 2}, {8, 4}, {8, 2}};
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
    const int32_t W = shapes[si][0], rpn = shapes[si][1], G = 16;
    const int64_t N = (int64_t)G * W * W * 4;
    mtrain_pattern_t *p = window_sinks_pattern(N, G, 3);
    const mtrain_pattern_t *pats[1] = {p};
    mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
    bo.patterns = pats;
    bo.num_patterns = 1;
    bo.ranks_per_node = rpn;
    mtrain_layout_t *striped = NULL, *balanced = NULL;
    assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, N, G, W, NULL, &striped),
                     MTRAIN_SUCCESS);
    assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_BALANCED, N, G, W, &bo, &balanced),
                     MTRAIN_SUCCESS);
    mtrain_cost_options_t o = MTRAIN_COST_OPTIONS_INIT;
    o.ranks_per_node = rpn;
    mtrain_cost_t *cs = NULL, *cb = NULL;
    assert_int_equal(mtrain_cost_evaluate(striped, pats, 1, &o, &cs), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_cost_evaluate(balanced, pats, 1, &o, &cb), MTRAIN_SUCCESS);
    mtrain_cost_metrics_t ms, mb;
    assert_int_equal(mtrain_cost_metrics(cs, MTRAIN_RING_HIERARCHICAL, &ms), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_cost_metrics(cb, MTRAIN_RING_HIERARCHICAL, &mb), MTRAIN_SUCCESS);
    if (!(mb.worst_head_slowdown <= 1.10) || !(mb.ring_sync_slowdown < ms.ring_sync_slowdown))
      fail_msg("W=%d rpn=%d: balanced (%s) ring-sync %.4f worst head %.4f, striped %.4f %.4f", W,
               rpn, mtrain_layout_variant(balanced), mb.ring_sync_slowdown, mb.worst_head_slowdown,
               ms.ring_sync_slowdown, ms.worst_head_slowdown);
    mtrain_cost_destroy(cs);
    mtrain_cost_destroy(cb);
    mtrain_layout_destroy(striped);
    mtrain_layout_destroy(balanced);
    mtrain_pattern_destroy(p);
  }
}

/* ---- time model -------------------------------------------------------------------- */

static void test_time_model_limits(void **state) {
  (void)state;
  const int32_t W = 8, G = 16;
  const int64_t N = 8192;
  mtrain_pattern_t *p = window_sinks_pattern(N, G, 2);
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_layout_t *layout = NULL;
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, N, G, W, NULL, &layout),
                   MTRAIN_SUCCESS);
  mtrain_cost_options_t o = MTRAIN_COST_OPTIONS_INIT;
  o.ranks_per_node = 4;
  mtrain_cost_t *c = NULL;
  assert_int_equal(mtrain_cost_evaluate(layout, pats, 1, &o, &c), MTRAIN_SUCCESS);
  mtrain_cost_metrics_t m;
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &m), MTRAIN_SUCCESS);
  mtrain_time_params_t q = MTRAIN_TIME_PARAMS_INIT;
  q.head_dim = 64;
  q.kv_heads = 1;
  q.latency = 0;
  mtrain_time_prediction_t t[2];
  /* compute-bound: infinite links; forward = sum of step maxima * 4d / rate */
  q.bw_intra = q.bw_inter = 1e30;
  assert_int_equal(mtrain_time_predict(c, layout, pats, 1, &q, t), MTRAIN_SUCCESS);
  assert_true(NEAR(t[0].forward, m.step_max_sum * 4 * 64 / q.flops));
  assert_true(NEAR(t[0].backward, 2.5 * t[0].forward));
  assert_true(NEAR(t[0].compute_ideal, m.total_work * 14 * 64 / q.flops / W));
  assert_true(t[0].forward >= m.total_work * 4 * 64 / q.flops / W);
  assert_true(NEAR(t[0].gather, 0.0));
  assert_true(t[0].gather_bytes == 0.0);
  /* transfer-bound: free compute; flat = (W - 1) inter-node hops, hierarchical = one outer
   * hop hidden behind nothing plus the inner hops of each node */
  q.flops = 1e30;
  q.bw_intra = 1e9;
  q.bw_inter = 1e8;
  assert_int_equal(mtrain_time_predict(c, layout, pats, 1, &q, t), MTRAIN_SUCCESS);
  const double chunk = (double)mtrain_layout_local_tokens(layout, 0) * 1 * 64 * 2 * 2;
  assert_true(NEAR(t[0].forward, (W - 1) * chunk / q.bw_inter));
  /* 2 nodes of 4: outer step 0 = max(3 inner hops, 1 outer hop), outer step 1 = 3 inner */
  const double inner = chunk / q.bw_intra, outer = chunk / q.bw_inter;
  assert_true(NEAR(t[1].forward, (3 * inner > outer ? 3 * inner : outer) + 3 * inner));
  assert_true(t[1].forward < t[0].forward);
  /* bad parameters are named */
  q.kv_heads = 3;
  TS_ASSERT_STATUS(mtrain_time_predict(c, layout, pats, 1, &q, t), MTRAIN_ERR_INVALID_ARGUMENT,
                   "kv_heads 3");
  q.kv_heads = 1;
  q.flops = 0;
  TS_ASSERT_STATUS(mtrain_time_predict(c, layout, pats, 1, &q, t), MTRAIN_ERR_INVALID_ARGUMENT,
                   "flops");
  mtrain_cost_destroy(c);
  /* gathered bars: the gather is accounted */
  o.bars_mode = MTRAIN_BARS_GATHERED;
  assert_int_equal(mtrain_cost_evaluate(layout, pats, 1, &o, &c), MTRAIN_SUCCESS);
  q = (mtrain_time_params_t)MTRAIN_TIME_PARAMS_INIT;
  q.kv_heads = 1;
  assert_int_equal(mtrain_time_predict(c, layout, pats, 1, &q, t), MTRAIN_SUCCESS);
  assert_true(t[0].gather > 0.0);
  /* rows: the union over the 2 heads of one kv group of their usable verticals */
  int64_t rows = 0;
  {
    const int32_t *dd;
    const int64_t *v0, *v1;
    int32_t ndd, n0, n1;
    assert_int_equal(mtrain_pattern_get_head(p, 0, &dd, &ndd, &v0, &n0), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_pattern_get_head(p, 1, &dd, &ndd, &v1, &n1), MTRAIN_SUCCESS);
    int32_t i = 0, j = 0;
    while (i < n0 || j < n1) {
      const int64_t x = j >= n1 || (i < n0 && v0[i] < v1[j]) ? v0[i] : v1[j];
      while (i < n0 && v0[i] == x) i++;
      while (j < n1 && v1[j] == x) j++;
      if (x / G + 1 < N / G) rows++;
    }
  }
  assert_true(NEAR(t[0].gather_bytes, (double)rows * 128 * 2 * (2 + 4)));
  assert_true(t[0].forward > 0.0 && t[1].forward > 0.0);
  mtrain_cost_destroy(c);
  mtrain_layout_destroy(layout);
  mtrain_pattern_destroy(p);
}

/* ---- position model ------------------------------------------------------------------ */

static void test_position_model(void **state) {
  (void)state;
  const char *text = "[{\"0\": [\"vertical_and_slash\", 3500, 100, 0.9],"
                     "  \"1\": [\"vertical_and_slash\", 10, 300, 0.9],"
                     "  \"2\": [\"flex_vertical_and_slash\", [0.9, 64], [0.95, 500], 0.0]}]";
  mtrain_budgets_t *b = NULL;
  assert_int_equal(mtrain_budgets_parse(text, "inline", &b), MTRAIN_SUCCESS);
  const int64_t N = 16384;
  const int32_t G = 128;
  mtrain_position_model_t m = MTRAIN_POSITION_MODEL_INIT;
  mtrain_pattern_t *p = NULL, *q = NULL;
  assert_int_equal(mtrain_pattern_from_budgets(b, 0, N, G, &m, &p), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_num_heads(p), 3);
  const int32_t *d;
  const int64_t *v;
  int32_t nd, nv;
  /* head 0: 30 sinks + 3470 spread before the last block; window 100 -> diagonals 0, 1 */
  assert_int_equal(mtrain_pattern_get_head(p, 0, &d, &nd, &v, &nv), MTRAIN_SUCCESS);
  assert_int_equal(nv, 3500);
  for (int i = 0; i < 30; i++) assert_int_equal(v[i], i);
  assert_true(v[nv - 1] < N - G);
  assert_int_equal(nd, 2);
  assert_int_equal(d[0], 0);
  assert_int_equal(d[1], 1);
  /* head 1: 10 sinks only; 100 window diagonals + 200 spread ones */
  assert_int_equal(mtrain_pattern_get_head(p, 1, &d, &nd, &v, &nv), MTRAIN_SUCCESS);
  assert_int_equal(nv, 10);
  assert_int_equal(v[9], 9);
  assert_true(nd > 2 && nd <= 128);
  /* head 2, top-p: the caps are the counts */
  assert_int_equal(mtrain_pattern_get_head(p, 2, &d, &nd, &v, &nv), MTRAIN_SUCCESS);
  assert_int_equal(nv, 64);
  int64_t cv = 0, cs = 0;
  mtrain_head_budget_t hb;
  assert_int_equal(mtrain_budgets_get(b, 0, 2, &hb), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_position_model_counts(&hb, N, G, &m, &cv, &cs), MTRAIN_SUCCESS);
  assert_int_equal(cv, 64);
  assert_int_equal(cs, 500);
  /* scaling: budgets for 4096 tokens at 16384 are 4x; clamped to the candidates */
  m.budget_context = 4096;
  assert_int_equal(mtrain_budgets_get(b, 0, 0, &hb), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_position_model_counts(&hb, N, G, &m, &cv, &cs), MTRAIN_SUCCESS);
  assert_int_equal(cv, 14000); /* below the 16256 keys before the last block */
  assert_int_equal(cs, 400);
  m.budget_context = 1024; /* 16x: 56000 verticals clamp to 16256, 1600 slashes stay */
  assert_int_equal(mtrain_position_model_counts(&hb, N, G, &m, &cv, &cs), MTRAIN_SUCCESS);
  assert_int_equal(cv, N - G);
  assert_int_equal(cs, 1600);
  m.budget_context = 0;
  /* random spread: reproducible from the seed, different for another */
  m.spread = MTRAIN_SPREAD_RANDOM;
  m.seed = 7;
  mtrain_pattern_destroy(p);
  assert_int_equal(mtrain_pattern_from_budgets(b, 0, N, G, &m, &p), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_from_budgets(b, 0, N, G, &m, &q), MTRAIN_SUCCESS);
  const int64_t *v2;
  const int32_t *d2;
  int32_t nd2, nv2;
  assert_int_equal(mtrain_pattern_get_head(p, 0, &d, &nd, &v, &nv), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_get_head(q, 0, &d2, &nd2, &v2, &nv2), MTRAIN_SUCCESS);
  assert_int_equal(nv, 3500);
  assert_memory_equal(v, v2, sizeof *v * (size_t)nv);
  mtrain_pattern_destroy(q);
  m.seed = 8;
  assert_int_equal(mtrain_pattern_from_budgets(b, 0, N, G, &m, &q), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_get_head(q, 0, &d2, &nd2, &v2, &nv2), MTRAIN_SUCCESS);
  assert_int_equal(nv2, 3500);
  assert_true(memcmp(v, v2, sizeof *v * (size_t)nv) != 0);
  for (int i = 0; i < 30; i++) assert_int_equal(v2[i], i); /* sinks do not move */
  /* local spread: verticals 0..v-1, token diagonals 0..s-1 (300 of head 1: blocks 0..3) */
  mtrain_pattern_destroy(q);
  m.spread = MTRAIN_SPREAD_LOCAL;
  assert_int_equal(mtrain_pattern_from_budgets(b, 0, N, G, &m, &q), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_get_head(q, 0, &d2, &nd2, &v2, &nv2), MTRAIN_SUCCESS);
  for (int i = 0; i < nv2; i++) assert_int_equal(v2[i], i);
  assert_int_equal(mtrain_pattern_get_head(q, 1, &d2, &nd2, &v2, &nv2), MTRAIN_SUCCESS);
  assert_int_equal(nd2, 4); /* token diagonals 0..299 cross block diagonals 0, 1, 2, 3 */
  assert_int_equal(d2[3], 3);
  /* token diagonal 99 at G = 128 crosses block diagonals 0 and 1; a window of 128 does not */
  mtrain_pattern_destroy(q);
  m.spread = MTRAIN_SPREAD_EVEN;
  m.window = 128;
  const char *one = "[{\"0\": [\"vertical_and_slash\", 0, 128, 0.9]}]";
  mtrain_budgets_t *b1 = NULL;
  assert_int_equal(mtrain_budgets_parse(one, "one", &b1), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_from_budgets(b1, 0, N, G, &m, &q), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_get_head(q, 0, &d2, &nd2, &v2, &nv2), MTRAIN_SUCCESS);
  assert_int_equal(nd2, 2); /* token diagonals 1..127 cross into block diagonal 1 */
  assert_int_equal(nv2, 0);
  mtrain_pattern_destroy(q);
  /* errors name the bad value */
  TS_ASSERT_STATUS(mtrain_pattern_from_budgets(b, 5, N, G, &m, &q), MTRAIN_ERR_INVALID_ARGUMENT,
                   "layer 5");
  m.num_sinks = -1;
  TS_ASSERT_STATUS(mtrain_pattern_from_budgets(b, 0, N, G, &m, &q), MTRAIN_ERR_INVALID_ARGUMENT,
                   "num_sinks -1");
  mtrain_pattern_destroy(p);
  mtrain_budgets_destroy(b);
  mtrain_budgets_destroy(b1);
}

/* ---- argument checking ------------------------------------------------------------------ */

static void test_cost_bad_input(void **state) {
  (void)state;
  mtrain_layout_t *layout = NULL;
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, 1000, 10, 4, NULL, &layout),
                   MTRAIN_SUCCESS);
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(999, 1, 10, &p), MTRAIN_SUCCESS);
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_cost_t *c = NULL;
  TS_ASSERT_STATUS(mtrain_cost_evaluate(layout, pats, 1, NULL, &c), MTRAIN_ERR_INVALID_ARGUMENT,
                   "seq_len 999");
  TS_ASSERT_STATUS(mtrain_cost_evaluate(layout, pats, 0, NULL, &c), MTRAIN_ERR_INVALID_ARGUMENT,
                   "num_patterns 0");
  mtrain_pattern_destroy(p);
  assert_int_equal(mtrain_pattern_create(1000, 1, 10, &p), MTRAIN_SUCCESS);
  pats[0] = p;
  mtrain_cost_options_t o = MTRAIN_COST_OPTIONS_INIT;
  o.ranks_per_node = 3;
  TS_ASSERT_STATUS(mtrain_cost_evaluate(layout, pats, 1, &o, &c), MTRAIN_ERR_INVALID_ARGUMENT,
                   "ranks_per_node 3");
  o.ranks_per_node = 0;
  o.bars_mode = 5;
  TS_ASSERT_STATUS(mtrain_cost_evaluate(layout, pats, 1, &o, &c), MTRAIN_ERR_INVALID_ARGUMENT,
                   "bars_mode 5");
  o.bars_mode = -1;
  assert_int_equal(mtrain_cost_evaluate(layout, pats, 1, &o, &c), MTRAIN_SUCCESS);
  mtrain_work_counts_t k;
  TS_ASSERT_STATUS(mtrain_cost_counts(c, MTRAIN_RING_FLAT, 1, 0, 0, &k),
                   MTRAIN_ERR_INVALID_ARGUMENT, "layer 1");
  TS_ASSERT_STATUS(mtrain_cost_counts(c, MTRAIN_RING_FLAT, 0, 4, 0, &k),
                   MTRAIN_ERR_INVALID_ARGUMENT, "rank 4");
  assert_true(mtrain_cost_work(c, MTRAIN_RING_FLAT, 0, 0, 9) == 0.0);
  assert_true(mtrain_cost_head_ring_sync(c, MTRAIN_RING_FLAT, 1) == 0.0);
  mtrain_cost_destroy(c);
  mtrain_cost_destroy(NULL);
  mtrain_pattern_destroy(p);
  mtrain_layout_destroy(layout);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_counts_match_plans),
      cmocka_unit_test(test_counts_match_plans_candidate_maps),
      cmocka_unit_test(test_metrics_hand_computed),
      cmocka_unit_test(test_hierarchical_reorders_only),
      cmocka_unit_test(test_balanced_never_worse),
      cmocka_unit_test(test_balanced_hierarchical),
      cmocka_unit_test(test_time_model_limits),
      cmocka_unit_test(test_position_model),
      cmocka_unit_test(test_cost_bad_input),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
