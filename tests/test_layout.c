/* test_layout.c: layouts (SPEC.md section 3) and ring schedules (section 5):
 * every global block owned by exactly one rank, per-rank block lists
 * increasing and equal in length, padding to the kind's unit, the exact
 * contiguous/zigzag/striped maps of the SPEC, token index round trips, the
 * flat and hierarchical ring sources, the balanced layout's defaults and
 * argument errors; and that plans over the balanced layout compute every
 * allowed pair exactly once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/layout/layout_internal.h"
#include "core/layout/schedule.h"
#include "mtrain/mtrain_layout.h"
#include "test_support.h"

static const int32_t worlds[] = {1, 2, 3, 4, 7, 8, 32};
#define NUM_WORLDS ((int)(sizeof worlds / sizeof *worlds))

/* A balanced layout from a small workload (window and sinks plus budgets). */
static mtrain_layout_t *make_layout(mtrain_layout_kind_t kind, int64_t N, int32_t G, int32_t W) {
  mtrain_layout_t *l = NULL;
  if (kind != MTRAIN_LAYOUT_BALANCED) {
    assert_int_equal(mtrain_layout_create(kind, N, G, W, NULL, &l), MTRAIN_SUCCESS);
    return l;
  }
  mtrain_pattern_t *p = ts_make_pattern(TS_PATTERN_BUDGETS, N, 2, G, 11);
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
  bo.patterns = pats;
  bo.num_patterns = 1;
  assert_int_equal(mtrain_layout_create(kind, N, G, W, &bo, &l), MTRAIN_SUCCESS);
  mtrain_pattern_destroy(p);
  return l;
}

static void test_blocks_owned_once(void **state) {
  (void)state;
  const int64_t lengths[] = {1, 5, 64, 1000, 4097};
  const int32_t grans[] = {1, 4, 16};
  for (int kind = 0; kind <= MTRAIN_LAYOUT_BALANCED; kind++)
    for (int wi = 0; wi < NUM_WORLDS; wi++)
      for (size_t li = 0; li < sizeof lengths / sizeof *lengths; li++)
        for (size_t gi = 0; gi < sizeof grans / sizeof *grans; gi++) {
          const int32_t W = worlds[wi], G = grans[gi];
          const int64_t N = lengths[li];
          if (kind == MTRAIN_LAYOUT_BALANCED && (G == 1 || N > 1000)) continue; /* kept quick */
          mtrain_layout_t *l = make_layout((mtrain_layout_kind_t)kind, N, G, W);
          const int64_t unit = (kind == MTRAIN_LAYOUT_ZIGZAG ? 2 : 1) * (int64_t)W * G;
          const int64_t padded = mtrain_layout_padded_len(l);
          assert_true(padded >= N && padded % unit == 0 && padded - N < unit);
          assert_int_equal(mtrain_layout_num_blocks(l), padded / G);
          assert_int_equal(mtrain_layout_num_seq_blocks(l), (N + G - 1) / G);
          const int64_t nbp = mtrain_layout_num_blocks(l);
          int32_t *seen = calloc((size_t)nbp, sizeof *seen);
          for (int32_t r = 0; r < W; r++) {
            const int32_t n = mtrain_layout_rank_num_blocks(l, r);
            const int64_t *b = mtrain_layout_rank_blocks(l, r);
            assert_int_equal(n, nbp / W);
            assert_int_equal(mtrain_layout_local_tokens(l, r), (int64_t)n * G);
            for (int32_t i = 0; i < n; i++) {
              assert_true(b[i] >= 0 && b[i] < nbp);
              if (i > 0 && !(b[i] > b[i - 1]))
                fail_msg("%s W=%d N=%lld G=%d rank %d: blocks not increasing at %d",
                         mtrain_layout_kind_name((mtrain_layout_kind_t)kind), W, (long long)N, G, r,
                         i);
              seen[b[i]]++;
              int32_t owner = -1, local = -1;
              assert_int_equal(mtrain_layout_block_owner(l, b[i], &owner, &local), MTRAIN_SUCCESS);
              assert_int_equal(owner, r);
              assert_int_equal(local, i);
            }
          }
          for (int64_t b = 0; b < nbp; b++)
            if (seen[b] != 1)
              fail_msg("%s W=%d N=%lld G=%d: block %lld owned %d times",
                       mtrain_layout_kind_name((mtrain_layout_kind_t)kind), W, (long long)N, G,
                       (long long)b, seen[b]);
          free(seen);
          mtrain_layout_destroy(l);
        }
}

/* The SPEC's maps, block by block. */
static void test_spec_maps(void **state) {
  (void)state;
  for (int wi = 0; wi < NUM_WORLDS; wi++) {
    const int32_t W = worlds[wi], G = 8;
    const int64_t N = 1234;
    for (int kind = 0; kind < MTRAIN_LAYOUT_BALANCED; kind++) {
      mtrain_layout_t *l = make_layout((mtrain_layout_kind_t)kind, N, G, W);
      const int64_t nbp = mtrain_layout_num_blocks(l);
      for (int64_t b = 0; b < nbp; b++) {
        int32_t want = -1;
        if (kind == MTRAIN_LAYOUT_CONTIGUOUS) want = (int32_t)(b / (nbp / W));
        if (kind == MTRAIN_LAYOUT_STRIPED) want = (int32_t)(b % W);
        if (kind == MTRAIN_LAYOUT_ZIGZAG) {
          const int32_t chunk = (int32_t)(b / (nbp / (2 * W)));
          want = chunk < W ? chunk : 2 * W - 1 - chunk;
        }
        int32_t owner, local;
        assert_int_equal(mtrain_layout_block_owner(l, b, &owner, &local), MTRAIN_SUCCESS);
        if (owner != want)
          fail_msg("%s W=%d: block %lld on rank %d, SPEC says %d",
                   mtrain_layout_kind_name((mtrain_layout_kind_t)kind), W, (long long)b, owner,
                   want);
      }
      assert_string_equal(mtrain_layout_variant(l),
                          mtrain_layout_kind_name((mtrain_layout_kind_t)kind));
      assert_int_equal(mtrain_layout_bars_mode(l), MTRAIN_BARS_IN_RING);
      mtrain_layout_destroy(l);
    }
  }
}

static void test_token_round_trips(void **state) {
  (void)state;
  for (int kind = 0; kind <= MTRAIN_LAYOUT_BALANCED; kind++)
    for (int wi = 0; wi < NUM_WORLDS; wi++) {
      const int32_t W = worlds[wi], G = 4;
      const int64_t N = 517;
      mtrain_layout_t *l = make_layout((mtrain_layout_kind_t)kind, N, G, W);
      const int64_t padded = mtrain_layout_padded_len(l);
      int64_t *hits = calloc((size_t)padded, sizeof *hits);
      for (int64_t i = 0; i < padded; i++) {
        int32_t r = -1;
        int64_t loc = -1, back = -1;
        assert_int_equal(mtrain_layout_global_to_local(l, i, &r, &loc), MTRAIN_SUCCESS);
        assert_true(r >= 0 && r < W && loc >= 0 && loc < mtrain_layout_local_tokens(l, r));
        assert_int_equal(mtrain_layout_local_to_global(l, r, loc, &back), MTRAIN_SUCCESS);
        if (back != i)
          fail_msg("%s W=%d: token %lld -> (%d, %lld) -> %lld",
                   mtrain_layout_kind_name((mtrain_layout_kind_t)kind), W, (long long)i, r,
                   (long long)loc, (long long)back);
      }
      /* local -> global -> local, and the gather index covers each slot once */
      for (int32_t r = 0; r < W; r++) {
        const int64_t n = mtrain_layout_local_tokens(l, r);
        int64_t *idx = malloc(sizeof(int64_t) * (size_t)n);
        assert_int_equal(mtrain_layout_rank_token_index(l, r, idx), MTRAIN_SUCCESS);
        for (int64_t j = 0; j < n; j++) {
          int64_t g = -1, loc = -1;
          int32_t rr = -1;
          assert_int_equal(mtrain_layout_local_to_global(l, r, j, &g), MTRAIN_SUCCESS);
          assert_int_equal(g, idx[j]);
          assert_int_equal(mtrain_layout_global_to_local(l, g, &rr, &loc), MTRAIN_SUCCESS);
          assert_int_equal(rr, r);
          assert_int_equal(loc, j);
          hits[g]++;
          /* tokens keep their order inside a rank */
          if (j > 0) assert_true(idx[j] > idx[j - 1]);
        }
        free(idx);
      }
      for (int64_t i = 0; i < padded; i++) assert_int_equal(hits[i], 1);
      free(hits);
      mtrain_layout_destroy(l);
    }
}

static void test_ring_schedules(void **state) {
  (void)state;
  const int32_t shapes[][2] = {{1, 0}, {2, 0}, {3, 0}, {7, 0},  {4, 2}, {6, 2},
                               {6, 3}, {8, 2}, {8, 4}, {32, 8}, {8, 1}, {8, 8}};
  for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
    const int32_t W = shapes[si][0], rpn = shapes[si][1];
    const int32_t L = rpn ? rpn : W, n = W / L;
    for (int32_t r = 0; r < W; r++) {
      int32_t *visits = calloc((size_t)W, sizeof *visits);
      for (int32_t t = 0; t < W; t++) {
        int32_t src = -1, back = -1, flat = -1;
        assert_int_equal(mtrain_ring_source(W, rpn, r, t, &src), MTRAIN_SUCCESS);
        const int32_t node = r / L, local = r % L, o = t / L, i = t % L;
        const int32_t want = ((node - o) % n + n) % n * L + ((local - i) % L + L) % L;
        assert_int_equal(src, want);
        assert_int_equal(mtrain_ring_step_of(W, rpn, r, src, &back), MTRAIN_SUCCESS);
        assert_int_equal(back, t);
        assert_int_equal(mtrain_ring_source(W, 0, r, t, &flat), MTRAIN_SUCCESS);
        assert_int_equal(flat, ((r - t) % W + W) % W);
        visits[src]++;
      }
      for (int32_t s = 0; s < W; s++) assert_int_equal(visits[s], 1); /* each chunk once */
      free(visits);
    }
  }
  int32_t x;
  TS_ASSERT_STATUS(mtrain_ring_source(8, 3, 0, 0, &x), MTRAIN_ERR_INVALID_ARGUMENT,
                   "ranks_per_node 3");
  TS_ASSERT_STATUS(mtrain_ring_source(8, 2, 8, 0, &x), MTRAIN_ERR_INVALID_ARGUMENT, "rank 8");
  TS_ASSERT_STATUS(mtrain_ring_source(8, 2, 0, -1, &x), MTRAIN_ERR_INVALID_ARGUMENT, "step -1");
  TS_ASSERT_STATUS(mtrain_ring_step_of(0, 0, 0, 0, &x), MTRAIN_ERR_INVALID_ARGUMENT,
                   "world size 0");
  assert_string_equal(mtrain_ring_kind_name(MTRAIN_RING_HIERARCHICAL), "hierarchical");
}

static void test_balanced_defaults_and_choice(void **state) {
  (void)state;
  mtrain_layout_t *l = NULL;
  /* no workload: striped blocks with the bars gathered */
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_BALANCED, 1000, 16, 4, NULL, &l),
                   MTRAIN_SUCCESS);
  assert_int_equal(mtrain_layout_kind(l), MTRAIN_LAYOUT_BALANCED);
  assert_string_equal(mtrain_layout_variant(l), "striped+gathered");
  assert_int_equal(mtrain_layout_bars_mode(l), MTRAIN_BARS_GATHERED);
  assert_int_equal(mtrain_layout_padded_len(l), 1024);
  for (int64_t b = 0; b < 64; b++) {
    int32_t r, lb;
    assert_int_equal(mtrain_layout_block_owner(l, b, &r, &lb), MTRAIN_SUCCESS);
    assert_int_equal(r, b % 4);
  }
  mtrain_layout_destroy(l);
  /* a pure diagonal-0 workload: nothing to gain, striped in the ring is kept */
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(4096, 2, 16, &p), MTRAIN_SUCCESS);
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
  bo.patterns = pats;
  bo.num_patterns = 1;
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_BALANCED, 4096, 16, 4, &bo, &l),
                   MTRAIN_SUCCESS);
  assert_string_equal(mtrain_layout_variant(l), "striped");
  assert_int_equal(mtrain_layout_bars_mode(l), MTRAIN_BARS_IN_RING);
  mtrain_layout_destroy(l);
  mtrain_pattern_destroy(p);
}

/* Plans over balanced layouts compute every allowed pair exactly once
 * (the plan builder takes any increasing block assignment). */
static void test_balanced_plans_exact(void **state) {
  (void)state;
  const int32_t G = 8;
  const int64_t N = 301;
  for (int wi = 1; wi < 6; wi++) {
    const int32_t W = worlds[wi];
    mtrain_pattern_t *p = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, N, 2, G, ts_seed(3) + wi);
    const mtrain_pattern_t *pats[1] = {p};
    mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
    bo.patterns = pats;
    bo.num_patterns = 1;
    mtrain_layout_t *l = NULL;
    assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_BALANCED, N, G, W, &bo, &l),
                     MTRAIN_SUCCESS);
    uint8_t *count = calloc((size_t)(N * N), 1);
    for (int32_t h = 0; h < 2; h++) {
      memset(count, 0, (size_t)(N * N));
      int64_t pairs = 0;
      for (int32_t r = 0; r < W; r++)
        for (int32_t s = 0; s < W; s++) {
          const mtrain_rank_blocks_t q = mtrain_layout_rank_view(l, r);
          const mtrain_rank_blocks_t k = mtrain_layout_rank_view(l, s);
          mtrain_step_head_store_t st;
          assert_int_equal(mtrain_plan_build_step_head(p, h, &q, &k, &st), MTRAIN_SUCCESS);
          pairs += st.pairs;
          for (int32_t qb = 0; qb < q.num_blocks; qb++) {
            const int64_t gq = q.global[qb];
            for (int64_t i = gq * G; i < (gq + 1) * G && i < N; i++) {
              for (int32_t e = st.run_off[qb]; e < st.run_off[qb + 1]; e++)
                for (int32_t kb = st.runs[2 * e]; kb < st.runs[2 * e + 1]; kb++)
                  for (int64_t j = k.global[kb] * G; j < (k.global[kb] + 1) * G && j <= i; j++)
                    count[i * N + j]++;
              for (int32_t sg = st.seg_off[qb]; sg < st.seg_off[qb + 1]; sg++)
                for (int32_t b = st.segs[2 * sg]; b < st.segs[2 * sg + 1]; b++)
                  count[i * N + k.global[st.bars[b] / G] * G + st.bars[b] % G]++;
            }
          }
          mtrain_step_head_store_free(&st);
        }
      for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < N; j++)
          if (count[i * N + j] != mtrain_pattern_allowed(p, h, i, j))
            fail_msg("W=%d %s head %d: pair (%lld, %lld) computed %d times", W,
                     mtrain_layout_variant(l), h, (long long)i, (long long)j, count[i * N + j]);
      assert_int_equal(pairs, mtrain_pattern_count_pairs(p, h));
    }
    free(count);
    mtrain_layout_destroy(l);
    mtrain_pattern_destroy(p);
  }
}

static void test_layout_bad_input(void **state) {
  (void)state;
  mtrain_layout_t *l = NULL;
  mtrain_layout_kind_t k;
  TS_ASSERT_STATUS(mtrain_layout_kind_parse("diagonal", &k), MTRAIN_ERR_INVALID_ARGUMENT,
                   "'diagonal'");
  assert_int_equal(mtrain_layout_kind_parse("zigzag", &k), MTRAIN_SUCCESS);
  assert_int_equal(k, MTRAIN_LAYOUT_ZIGZAG);
  TS_ASSERT_STATUS(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, 0, 8, 2, NULL, &l),
                   MTRAIN_ERR_INVALID_ARGUMENT, "seq_len 0");
  TS_ASSERT_STATUS(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, 10, 0, 2, NULL, &l),
                   MTRAIN_ERR_INVALID_ARGUMENT, "granularity 0");
  TS_ASSERT_STATUS(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, 10, 8, 0, NULL, &l),
                   MTRAIN_ERR_INVALID_ARGUMENT, "world size 0");
  TS_ASSERT_STATUS(mtrain_layout_create((mtrain_layout_kind_t)9, 10, 8, 2, NULL, &l),
                   MTRAIN_ERR_INVALID_ARGUMENT, "kind 9");
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(100, 1, 8, &p), MTRAIN_SUCCESS);
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
  bo.patterns = pats;
  bo.num_patterns = 1;
  TS_ASSERT_STATUS(mtrain_layout_create(MTRAIN_LAYOUT_BALANCED, 200, 8, 2, &bo, &l),
                   MTRAIN_ERR_INVALID_ARGUMENT, "seq_len 100");
  bo.ranks_per_node = 3;
  TS_ASSERT_STATUS(mtrain_layout_create(MTRAIN_LAYOUT_BALANCED, 100, 8, 4, &bo, &l),
                   MTRAIN_ERR_INVALID_ARGUMENT, "ranks_per_node 3");
  mtrain_pattern_destroy(p);
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_ZIGZAG, 100, 8, 2, NULL, &l), MTRAIN_SUCCESS);
  int32_t r, lb;
  int64_t x;
  TS_ASSERT_STATUS(mtrain_layout_block_owner(l, 16, &r, &lb), MTRAIN_ERR_INVALID_ARGUMENT,
                   "block 16");
  TS_ASSERT_STATUS(mtrain_layout_global_to_local(l, 128, &r, &x), MTRAIN_ERR_INVALID_ARGUMENT,
                   "token 128");
  TS_ASSERT_STATUS(mtrain_layout_local_to_global(l, 2, 0, &x), MTRAIN_ERR_INVALID_ARGUMENT,
                   "rank 2");
  TS_ASSERT_STATUS(mtrain_layout_local_to_global(l, 0, 64, &x), MTRAIN_ERR_INVALID_ARGUMENT,
                   "local token 64");
  assert_null(mtrain_layout_rank_blocks(l, 2));
  assert_int_equal(mtrain_layout_rank_num_blocks(l, -1), 0);
  mtrain_layout_destroy(l);
  mtrain_layout_destroy(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_blocks_owned_once),
      cmocka_unit_test(test_spec_maps),
      cmocka_unit_test(test_token_round_trips),
      cmocka_unit_test(test_ring_schedules),
      cmocka_unit_test(test_balanced_defaults_and_choice),
      cmocka_unit_test(test_balanced_plans_exact),
      cmocka_unit_test(test_layout_bad_input),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
