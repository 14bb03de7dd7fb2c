/* test_plan.c: property tests of the plan (SPEC.md section 4): over all ranks
 * and ring steps, the union of listed key blocks and bars is exactly the
 * allowed set of the pattern and no (query, key) pair is computed twice;
 * padding never takes part; the pair count the plan reports is exact. Run on
 * the single-rank plans of the public API and on the step builder with the
 * contiguous, zigzag and striped block assignments for W in {1,2,3,4,7,8}. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain_layout.h"
#include "test_support.h"

/* Adds every pair one (step, head) entry computes to count[i * N + j]. */
static int64_t mark_pairs(const mtrain_step_head_store_t *s, const mtrain_rank_blocks_t *q,
                          const mtrain_rank_blocks_t *k, int32_t G, int64_t N, uint8_t *count) {
  int64_t pairs = 0;
  for (int32_t qb = 0; qb < q->num_blocks; qb++) {
    const int64_t gq = q->global[qb];
    const int32_t nr = mtrain_block_rows(q->tokens, G, qb, gq, N);
    for (int32_t r = 0; r < nr; r++) {
      const int64_t i = gq * G + r;
      for (int32_t e = s->run_off[qb]; e < s->run_off[qb + 1]; e++)
        for (int32_t kb = s->runs[2 * e]; kb < s->runs[2 * e + 1]; kb++) {
          const int64_t gk = k->global[kb];
          const int32_t nc = mtrain_block_rows(k->tokens, G, kb, gk, N);
          for (int32_t c = 0; c < nc; c++) {
            const int64_t j = gk * G + c;
            if (gk == gq && j > i) break;
            count[i * N + j]++;
            pairs++;
          }
        }
      for (int32_t sg = s->seg_off[qb]; sg < s->seg_off[qb + 1]; sg++)
        for (int32_t b = s->segs[2 * sg]; b < s->segs[2 * sg + 1]; b++) {
          const int32_t col = s->bars[b];
          const int64_t j = k->global[col / G] * G + col % G;
          count[i * N + j]++;
          pairs++;
        }
    }
  }
  return pairs;
}

/* Every allowed pair counted once, nothing else counted. */
static void check_counts(const mtrain_pattern_t *p, int32_t h, const uint8_t *count,
                         const char *what) {
  const int64_t N = mtrain_pattern_seq_len(p);
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < N; j++) {
      const int want = mtrain_pattern_allowed(p, h, i, j);
      if (count[i * N + j] != want)
        fail_msg("%s: head %d pair (%lld, %lld) computed %d times, allowed = %d", what, h,
                 (long long)i, (long long)j, count[i * N + j], want);
    }
}

static void test_single_rank_plan_exact(void **state) {
  (void)state;
  const int64_t lengths[] = {1, 7, 64, 65, 300, 517};
  const int32_t grans[] = {1, 16, 64};
  const ts_pattern_kind_t kinds[] = {TS_PATTERN_DENSE, TS_PATTERN_DIAGONAL_ONLY,
                                     TS_PATTERN_RANDOM_SPARSE, TS_PATTERN_BLOCK_MASK,
                                     TS_PATTERN_BUDGETS};
  uint64_t seed = ts_seed(1234);
  for (size_t li = 0; li < sizeof lengths / sizeof *lengths; li++)
    for (size_t gi = 0; gi < 3; gi++)
      for (size_t ki = 0; ki < 5; ki++) {
        const int64_t N = lengths[li];
        const int32_t G = grans[gi];
        if (G == 1 && N > 300) continue; /* keeps the block-mask case small */
        mtrain_pattern_t *p = ts_make_pattern(kinds[ki], N, 3, G, seed + li * 100 + gi * 10 + ki);
        mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
        cfg.granularity = G;
        mtrain_context_t *ctx = NULL;
        assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
        mtrain_plan_t *plan = NULL;
        const mtrain_pattern_t *pats[1] = {p};
        assert_int_equal(mtrain_plan_create(ctx, NULL, pats, &plan), MTRAIN_SUCCESS);
        assert_int_equal(mtrain_plan_local_tokens(plan), N);
        assert_int_equal(mtrain_plan_num_steps(plan), 1);
        uint8_t *count = calloc((size_t)(N * N), 1);
        int64_t expected_pairs = 0, marked = 0;
        const mtrain_plan_seq_t *ps = &plan->seqs[0];
        for (int32_t h = 0; h < 3; h++) {
          memset(count, 0, (size_t)(N * N));
          marked += mark_pairs(&ps->steps[0].heads[h], &ps->q, &ps->steps[0].k, G, N, count);
          char what[128];
          snprintf(what, sizeof what, "N=%lld G=%d %s seed=%llu", (long long)N, G,
                   ts_pattern_kind_name(kinds[ki]), (unsigned long long)seed);
          check_counts(p, h, count, what);
          expected_pairs += mtrain_pattern_count_pairs(p, h);
        }
        assert_int_equal(marked, expected_pairs);
        assert_int_equal(mtrain_plan_computed_pairs(plan), expected_pairs);
        assert_true(mtrain_plan_bytes(plan) > 0);
        free(count);
        mtrain_plan_destroy(plan);
        mtrain_context_destroy(ctx);
        mtrain_pattern_destroy(p);
      }
}

typedef enum { LAYOUT_CONTIGUOUS, LAYOUT_ZIGZAG, LAYOUT_STRIPED } test_layout_t;

/* Global blocks of rank r (increasing) for a padded block count nbp. */
static int32_t layout_blocks(test_layout_t layout, int32_t W, int32_t r, int64_t nbp,
                             int64_t *out) {
  int32_t n = 0;
  if (layout == LAYOUT_CONTIGUOUS) {
    for (int64_t b = r * nbp / W; b < (r + 1) * nbp / W; b++) out[n++] = b;
  } else if (layout == LAYOUT_ZIGZAG) {
    const int64_t c = nbp / (2 * W);
    for (int64_t b = r * c; b < (r + 1) * c; b++) out[n++] = b;
    for (int64_t b = (2 * W - 1 - r) * c; b < (2 * W - r) * c; b++) out[n++] = b;
  } else {
    for (int64_t b = r; b < nbp; b += W) out[n++] = b;
  }
  return n;
}

static void test_multi_rank_builder_exact(void **state) {
  (void)state;
  const int32_t worlds[] = {1, 2, 3, 4, 7, 8};
  const test_layout_t layouts[] = {LAYOUT_CONTIGUOUS, LAYOUT_ZIGZAG, LAYOUT_STRIPED};
  const ts_pattern_kind_t kinds[] = {TS_PATTERN_DENSE, TS_PATTERN_RANDOM_SPARSE,
                                     TS_PATTERN_BLOCK_MASK, TS_PATTERN_BUDGETS};
  const int32_t G = 8;
  uint64_t seed = ts_seed(777);
  for (size_t wi = 0; wi < 6; wi++)
    for (size_t li = 0; li < 3; li++)
      for (size_t ki = 0; ki < 4; ki++) {
        const int32_t W = worlds[wi];
        const int64_t N = 203 + 17 * (int64_t)wi; /* never a multiple of G * W */
        const int64_t unit = (layouts[li] == LAYOUT_ZIGZAG ? 2 : 1) * (int64_t)W * G;
        const int64_t nbp = (N + unit - 1) / unit * unit / G; /* padded block count */
        mtrain_pattern_t *p = ts_make_pattern(kinds[ki], N, 2, G, seed + wi * 31 + li * 7 + ki);
        int64_t **glob = calloc((size_t)W, sizeof *glob);
        mtrain_rank_blocks_t *rb = calloc((size_t)W, sizeof *rb);
        for (int32_t r = 0; r < W; r++) {
          glob[r] = malloc(sizeof(int64_t) * (size_t)nbp);
          rb[r].num_blocks = layout_blocks(layouts[li], W, r, nbp, glob[r]);
          rb[r].global = glob[r];
          rb[r].tokens = (int64_t)rb[r].num_blocks * G;
        }
        uint8_t *count = calloc((size_t)(N * N), 1);
        for (int32_t h = 0; h < 2; h++) {
          memset(count, 0, (size_t)(N * N));
          int64_t marked = 0, reported = 0;
          for (int32_t r = 0; r < W; r++)
            for (int32_t t = 0; t < W; t++) {
              const int32_t src = ((r - t) % W + W) % W;
              mtrain_step_head_store_t s;
              assert_int_equal(mtrain_plan_build_step_head(p, h, &rb[r], &rb[src], &s),
                               MTRAIN_SUCCESS);
              marked += mark_pairs(&s, &rb[r], &rb[src], G, N, count);
              reported += s.pairs;
              mtrain_step_head_store_free(&s);
            }
          char what[160];
          snprintf(what, sizeof what, "W=%d layout=%d %s N=%lld seed=%llu", W, (int)layouts[li],
                   ts_pattern_kind_name(kinds[ki]), (long long)N, (unsigned long long)seed);
          check_counts(p, h, count, what);
          assert_int_equal(marked, mtrain_pattern_count_pairs(p, h));
          assert_int_equal(reported, marked);
        }
        free(count);
        for (int32_t r = 0; r < W; r++) free(glob[r]);
        free(glob);
        free(rb);
        mtrain_pattern_destroy(p);
      }
}

static void test_plan_packed_sequences(void **state) {
  (void)state;
  const int64_t offsets[] = {0, 100, 101, 333};
  mtrain_pattern_t *p[3];
  for (int s = 0; s < 3; s++)
    p[s] = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, offsets[s + 1] - offsets[s], 2, 32, 5 + s);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = 32;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  mtrain_seqs_t seqs = {3, offsets};
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *pats[3] = {p[0], p[1], p[2]};
  assert_int_equal(mtrain_plan_create(ctx, &seqs, pats, &plan), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_plan_local_tokens(plan), 333);
  int64_t want = 0;
  for (int s = 0; s < 3; s++)
    for (int h = 0; h < 2; h++) want += mtrain_pattern_count_pairs(p[s], h);
  assert_int_equal(mtrain_plan_computed_pairs(plan), want);
  assert_int_equal(plan->seqs[2].local_offset, 101);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  for (int s = 0; s < 3; s++) mtrain_pattern_destroy(p[s]);
}

/* Ring plans through the public layouts and schedules: for every layout
 * kind, W in {1, 2, 3, 4, 7, 8, 32} and the flat and (where W allows)
 * hierarchical rings, the steps of every rank visit every chunk once and the
 * union of all ranks' steps computes every allowed pair exactly once. */
static void test_ring_plans_every_layout_and_schedule(void **state) {
  (void)state;
  const int32_t worlds[] = {1, 2, 3, 4, 7, 8, 32};
  const mtrain_layout_kind_t kinds[] = {MTRAIN_LAYOUT_CONTIGUOUS, MTRAIN_LAYOUT_ZIGZAG,
                                        MTRAIN_LAYOUT_STRIPED, MTRAIN_LAYOUT_BALANCED};
  const int32_t G = 4;
  uint64_t seed = ts_seed(4242);
  for (size_t wi = 0; wi < sizeof worlds / sizeof *worlds; wi++)
    for (size_t ki = 0; ki < 4; ki++)
      for (int hier = 0; hier < 2; hier++) {
        const int32_t W = worlds[wi];
        const int32_t rpn = hier ? (W % 2 == 0 && W > 2 ? 2 : 0) : 0;
        if (hier && rpn == 0) continue;
        const int64_t N = 301 + W;
        mtrain_pattern_t *p = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, N, 2, G, seed + wi + ki);
        mtrain_layout_t *layout = NULL;
        assert_int_equal(mtrain_layout_create(kinds[ki], N, G, W, NULL, &layout), MTRAIN_SUCCESS);
        uint8_t *count = calloc((size_t)(N * N), 1);
        for (int32_t h = 0; h < 2; h++) {
          memset(count, 0, (size_t)(N * N));
          int64_t marked = 0;
          for (int32_t r = 0; r < W; r++) {
            mtrain_rank_blocks_t q = {mtrain_layout_rank_num_blocks(layout, r),
                                      mtrain_layout_rank_blocks(layout, r),
                                      mtrain_layout_local_tokens(layout, r)};
            uint8_t *seen = calloc((size_t)W, 1);
            for (int32_t t = 0; t < W; t++) {
              int32_t src = -1;
              assert_int_equal(mtrain_ring_source(W, rpn, r, t, &src), MTRAIN_SUCCESS);
              assert_true(src >= 0 && src < W && !seen[src]); /* every chunk exactly once */
              seen[src] = 1;
              mtrain_rank_blocks_t k = {mtrain_layout_rank_num_blocks(layout, src),
                                        mtrain_layout_rank_blocks(layout, src),
                                        mtrain_layout_local_tokens(layout, src)};
              mtrain_step_head_store_t s;
              assert_int_equal(mtrain_plan_build_step_head(p, h, &q, &k, &s), MTRAIN_SUCCESS);
              marked += mark_pairs(&s, &q, &k, G, N, count);
              mtrain_step_head_store_free(&s);
            }
            free(seen);
          }
          char what[160];
          snprintf(what, sizeof what, "W=%d %s %s N=%lld seed=%llu", W,
                   mtrain_layout_kind_name(kinds[ki]), rpn ? "hierarchical" : "flat", (long long)N,
                   (unsigned long long)seed);
          check_counts(p, h, count, what);
          assert_int_equal(marked, mtrain_pattern_count_pairs(p, h));
        }
        free(count);
        mtrain_layout_destroy(layout);
        mtrain_pattern_destroy(p);
      }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_single_rank_plan_exact),
      cmocka_unit_test(test_multi_rank_builder_exact),
      cmocka_unit_test(test_plan_packed_sequences),
      cmocka_unit_test(test_ring_plans_every_layout_and_schedule),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
