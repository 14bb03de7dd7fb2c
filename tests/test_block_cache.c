/* test_block_cache.c: the cache of block selections (mtrain_block_cache.h).
 * Inputs change at every step (structured q/k with a step's own noise), so
 * that a fresh selection differs from the cached one and a cache that
 * re-selected too often, or too rarely, is seen:
 *  - the refresh schedule (ages 0, 1, .., refresh - 1, 0, ..), due before
 *    each call, the counts; a selection step's pattern is the direct
 *    selection of that step's inputs, a cached step's is the earlier one
 *    (the same object), and differs from that step's own selection;
 *  - layers keep separate schedules; refresh 1 selects every step;
 *  - other options (non-causal too) or another sequence length re-select and
 *    restart the schedule; invalidate (one layer, every layer);
 *  - the precise method reads no lse on cached steps; a failed selection
 *    leaves the layer as it was;
 *  - the ring form on one rank equals the single-rank form;
 *  - bad arguments are refused naming the problem.
 * Seeds are printed; MTRAIN_TEST_SEED overrides them. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_block_cache.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_layout.h"
#include "test_support.h"

#define HQ 4
#define HKV 2
#define D 32
#define G 32

#define CHECK_OK(x)                                                                                \
  do {                                                                                             \
    const mtrain_status_t st_ = (x);                                                               \
    if (st_) fail_msg("%s: %s (%s)", #x, mtrain_status_name(st_), mtrain_last_error());            \
  } while (0)

/* The inputs of one step: structured q/k (seed) plus the step's noise. */
typedef struct step_in {
  int64_t N;
  float *q, *k, *lse;
  mtrain_tensor_t tq, tk, tl;
} step_in_t;

static void step_make(step_in_t *s, int64_t N, uint64_t seed, int step) {
  s->N = N;
  s->q = malloc(sizeof(float) * (size_t)(N * HQ * D));
  s->k = malloc(sizeof(float) * (size_t)(N * HKV * D));
  s->lse = malloc(sizeof(float) * (size_t)(N * HQ));
  float *v = malloc(sizeof(float) * (size_t)(N * HKV * D));
  assert_true(s->q && s->k && s->lse && v);
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = seed;
  so.rope_base = 4.0 * (double)N;
  s->tq = mtrain_tensor_3d(s->q, MTRAIN_F32, N, HQ, D);
  s->tk = mtrain_tensor_3d(s->k, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F32, N, HKV, D);
  CHECK_OK(mtrain_generate_structured(&so, &s->tq, &s->tk, &tv));
  ts_rng_t rng;
  ts_rng_seed(&rng, seed * 1000003u + (uint64_t)step);
  for (int64_t i = 0; i < N * HQ * D; i++) s->q[i] += (float)(0.8 * ts_rng_normal(&rng));
  for (int64_t i = 0; i < N * HKV * D; i++) s->k[i] += (float)(0.8 * ts_rng_normal(&rng));
  /* a constant LSE: the precise scores are then masses up to a factor per
   * row, enough for the cache (the selection itself is tested elsewhere) */
  for (int64_t i = 0; i < N * HQ; i++) s->lse[i] = 8.0f;
  s->tl = mtrain_tensor_2d(s->lse, MTRAIN_F32, N, HQ);
  free(v);
}

static void step_free(step_in_t *s) { free(s->q), free(s->k), free(s->lse); }

static mtrain_context_t *make_ctx(void) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cpu-ref";
  cfg.granularity = G;
  cfg.num_threads = 2;
  mtrain_context_t *ctx = NULL;
  CHECK_OK(mtrain_context_create(&cfg, NULL, &ctx));
  return ctx;
}

static mtrain_block_options_t topk_options(mtrain_block_method_t m, int32_t k) {
  mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
  o.method = m;
  o.kind = MTRAIN_BUDGET_TOP_K;
  o.top_k = k;
  return o;
}

/* 1 when both patterns have the same block masks in every head. */
static int same_masks(const mtrain_pattern_t *a, const mtrain_pattern_t *b) {
  if (a->num_heads != b->num_heads || a->num_blocks != b->num_blocks) return 0;
  for (int32_t h = 0; h < a->num_heads; h++) {
    const mtrain_pattern_head_t *x = &a->heads[h], *y = &b->heads[h];
    if (!x->mask_off || !y->mask_off) return 0;
    if (memcmp(x->mask_off, y->mask_off, sizeof(int64_t) * (size_t)(a->num_blocks + 1))) return 0;
    if (memcmp(x->mask_idx, y->mask_idx, sizeof(int32_t) * (size_t)x->mask_off[a->num_blocks]))
      return 0;
  }
  return 1;
}

static mtrain_pattern_t *direct(mtrain_context_t *ctx, const step_in_t *s,
                                const mtrain_block_options_t *o) {
  mtrain_pattern_t *p = NULL;
  CHECK_OK(mtrain_pattern_select_blocks(ctx, &s->tq, &s->tk, &s->tl, o, NULL, &p));
  return p;
}

/* ---- the schedule --------------------------------------------------------------------------- */

static void test_schedule(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(11);
  print_message("schedule seed %llu\n", (unsigned long long)seed);
  mtrain_context_t *ctx = make_ctx();
  mtrain_block_cache_t *cache = NULL;
  CHECK_OK(mtrain_block_cache_create(2, 3, &cache));
  const mtrain_block_options_t o = topk_options(MTRAIN_BLOCK_ANTIDIAG, 2);
  mtrain_pattern_t *last = NULL;
  const mtrain_pattern_t *cached = NULL;
  int differs = 0;
  for (int step = 0; step < 8; step++) {
    step_in_t s;
    step_make(&s, 320, seed, step);
    int due = -1;
    CHECK_OK(mtrain_block_cache_due(cache, 0, &due));
    const mtrain_pattern_t *p = NULL;
    int32_t age = -1;
    CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, NULL, &o, NULL, &p, &age));
    assert_int_equal(age, step % 3);
    assert_int_equal(due, step % 3 == 0);
    mtrain_pattern_t *fresh = direct(ctx, &s, &o);
    if (age == 0) {
      assert_true(same_masks(p, fresh));
      mtrain_pattern_destroy(last);
      last = fresh;
      cached = p;
    } else {
      assert_ptr_equal(p, cached);
      assert_true(same_masks(p, last));
      differs += !same_masks(p, fresh);
      mtrain_pattern_destroy(fresh);
    }
    step_free(&s);
  }
  /* the inputs drift: a cache that re-selected would be seen */
  print_message("cached steps whose own selection differs: %d of 5\n", differs);
  assert_true(differs >= 1);
  int64_t steps = 0, selections = 0;
  CHECK_OK(mtrain_block_cache_counts(cache, 0, &steps, &selections));
  assert_int_equal(steps, 8);
  assert_int_equal(selections, 3);
  CHECK_OK(mtrain_block_cache_counts(cache, 1, &steps, &selections));
  assert_int_equal(steps, 0);
  assert_int_equal(selections, 0);
  mtrain_pattern_destroy(last);
  mtrain_block_cache_destroy(cache);
  mtrain_context_destroy(ctx);
}

static void test_layers_and_refresh_one(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(12);
  mtrain_context_t *ctx = make_ctx();
  mtrain_block_cache_t *two = NULL, *one = NULL;
  CHECK_OK(mtrain_block_cache_create(3, 2, &two));
  CHECK_OK(mtrain_block_cache_create(1, 1, &one));
  const mtrain_block_options_t o = topk_options(MTRAIN_BLOCK_MEANPOOL, 2);
  /* layer 0 on every step, layer 2 on every other step: separate schedules */
  int32_t want0[] = {0, 1, 0, 1, 0, 1}, want2[] = {0, -1, 1, -1, 0, -1};
  for (int step = 0; step < 6; step++) {
    step_in_t s;
    step_make(&s, 200, seed, step);
    const mtrain_pattern_t *p = NULL;
    int32_t age = -1;
    CHECK_OK(mtrain_block_cache_select(two, 0, ctx, &s.tq, &s.tk, NULL, &o, NULL, &p, &age));
    assert_int_equal(age, want0[step]);
    if (want2[step] >= 0) {
      CHECK_OK(mtrain_block_cache_select(two, 2, ctx, &s.tq, &s.tk, NULL, &o, NULL, &p, &age));
      assert_int_equal(age, want2[step]);
    }
    CHECK_OK(mtrain_block_cache_select(one, 0, ctx, &s.tq, &s.tk, NULL, &o, NULL, &p, &age));
    assert_int_equal(age, 0);
    mtrain_pattern_t *fresh = direct(ctx, &s, &o);
    assert_true(same_masks(p, fresh));
    mtrain_pattern_destroy(fresh);
    step_free(&s);
  }
  int64_t steps = 0, selections = 0;
  CHECK_OK(mtrain_block_cache_counts(two, 2, &steps, &selections));
  assert_int_equal(steps, 3);
  assert_int_equal(selections, 2);
  CHECK_OK(mtrain_block_cache_counts(one, 0, &steps, &selections));
  assert_int_equal(selections, 6);
  mtrain_block_cache_destroy(two);
  mtrain_block_cache_destroy(one);
  mtrain_context_destroy(ctx);
}

/* ---- what re-selects
 * ------------------------------------------------------------------------------ */

static void test_changes_and_invalidate(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(13);
  mtrain_context_t *ctx = make_ctx();
  mtrain_block_cache_t *cache = NULL;
  CHECK_OK(mtrain_block_cache_create(2, 10, &cache));
  mtrain_block_options_t o = topk_options(MTRAIN_BLOCK_ANTIDIAG, 2);
  step_in_t a, b;
  step_make(&a, 256, seed, 0);
  step_make(&b, 300, seed, 1);
  const mtrain_pattern_t *p = NULL;
  int32_t age = -1;
  int due = -1;
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &a.tq, &a.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 0);
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &a.tq, &a.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 1);
  /* other options: a new selection, the schedule restarts */
  o.top_k = 3;
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &a.tq, &a.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 0);
  mtrain_pattern_t *fresh = direct(ctx, &a, &o);
  assert_true(same_masks(p, fresh));
  mtrain_pattern_destroy(fresh);
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &a.tq, &a.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 1);
  /* non-causal: a new selection, a non-causal pattern; back to causal: another */
  o.noncausal = 1;
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &a.tq, &a.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 0);
  assert_int_equal(mtrain_pattern_is_causal(p), 0);
  fresh = direct(ctx, &a, &o);
  assert_true(same_masks(p, fresh));
  mtrain_pattern_destroy(fresh);
  o.noncausal = 0;
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &a.tq, &a.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 0);
  assert_int_equal(mtrain_pattern_is_causal(p), 1);
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &a.tq, &a.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 1);
  /* another sequence length */
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &b.tq, &b.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 0);
  assert_int_equal(mtrain_pattern_seq_len(p), 300);
  /* invalidate one layer, then every layer */
  CHECK_OK(mtrain_block_cache_select(cache, 1, ctx, &b.tq, &b.tk, NULL, &o, NULL, &p, &age));
  CHECK_OK(mtrain_block_cache_due(cache, 0, &due));
  assert_int_equal(due, 0);
  CHECK_OK(mtrain_block_cache_invalidate(cache, 0));
  CHECK_OK(mtrain_block_cache_due(cache, 0, &due));
  assert_int_equal(due, 1);
  CHECK_OK(mtrain_block_cache_due(cache, 1, &due));
  assert_int_equal(due, 0);
  CHECK_OK(mtrain_block_cache_invalidate(cache, -1));
  CHECK_OK(mtrain_block_cache_due(cache, 1, &due));
  assert_int_equal(due, 1);
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &b.tq, &b.tk, NULL, &o, NULL, &p, &age));
  assert_int_equal(age, 0);
  int64_t steps = 0, selections = 0;
  CHECK_OK(mtrain_block_cache_counts(cache, 0, &steps, &selections));
  assert_int_equal(steps, 9);
  assert_int_equal(selections, 6);
  step_free(&a), step_free(&b);
  mtrain_block_cache_destroy(cache);
  mtrain_context_destroy(ctx);
}

static void test_precise_lse_and_failure(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(14);
  mtrain_context_t *ctx = make_ctx();
  mtrain_block_cache_t *cache = NULL;
  CHECK_OK(mtrain_block_cache_create(1, 2, &cache));
  mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT; /* precise, top-p 0.9 */
  step_in_t s;
  step_make(&s, 256, seed, 0);
  const mtrain_pattern_t *p = NULL, *first = NULL;
  int32_t age = -1;
  /* a due step without lse fails and counts nothing */
  TS_ASSERT_STATUS(mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, NULL, &o, NULL, &p, &age),
                   MTRAIN_ERR_NULL_POINTER, "needs the forward's lse");
  int64_t steps = -1, selections = -1;
  CHECK_OK(mtrain_block_cache_counts(cache, 0, &steps, &selections));
  assert_int_equal(steps, 0);
  assert_int_equal(selections, 0);
  double recall[HQ] = {0};
  mtrain_block_report_t rep = {recall, NULL, NULL};
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, &s.tl, &o, &rep, &first, &age));
  assert_int_equal(age, 0);
  assert_true(recall[0] > 0.0);
  /* a cached step reads no lse */
  recall[0] = -1.0;
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, NULL, &o, &rep, &p, &age));
  assert_int_equal(age, 1);
  assert_ptr_equal(p, first);
  assert_true(recall[0] == -1.0); /* the report is written only when selecting */
  /* a failed re-selection keeps the pattern */
  TS_ASSERT_STATUS(mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, NULL, &o, NULL, &p, &age),
                   MTRAIN_ERR_NULL_POINTER, "needs the forward's lse");
  CHECK_OK(mtrain_block_cache_counts(cache, 0, &steps, &selections));
  assert_int_equal(steps, 2);
  assert_int_equal(selections, 1);
  int due = 0;
  CHECK_OK(mtrain_block_cache_due(cache, 0, &due));
  assert_int_equal(due, 1);
  step_free(&s);
  mtrain_block_cache_destroy(cache);
  mtrain_context_destroy(ctx);
}

static void test_ring_one_rank(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(15);
  mtrain_context_t *ctx = make_ctx();
  step_in_t s;
  step_make(&s, 256, seed, 0);
  mtrain_layout_t *layout = NULL;
  CHECK_OK(mtrain_layout_create(MTRAIN_LAYOUT_CONTIGUOUS, s.N, G, 1, NULL, &layout));
  assert_int_equal(mtrain_layout_local_tokens(layout, 0), s.N);
  mtrain_block_cache_t *cache = NULL;
  CHECK_OK(mtrain_block_cache_create(1, 4, &cache));
  const mtrain_block_options_t o = topk_options(MTRAIN_BLOCK_PRECISE, 2);
  const mtrain_pattern_t *p = NULL;
  int32_t age = -1;
  CHECK_OK(mtrain_block_cache_select_ring(cache, 0, ctx, layout, &s.tq, &s.tk, &s.tl, &o, NULL, &p,
                                          &age));
  assert_int_equal(age, 0);
  mtrain_pattern_t *fresh = direct(ctx, &s, &o);
  assert_true(same_masks(p, fresh));
  /* ring and single-rank selections are kept apart: switching re-selects */
  CHECK_OK(mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, &s.tl, &o, NULL, &p, &age));
  assert_int_equal(age, 0);
  mtrain_pattern_destroy(fresh);
  mtrain_layout_destroy(layout);
  step_free(&s);
  mtrain_block_cache_destroy(cache);
  mtrain_context_destroy(ctx);
}

/* ---- refusals
 * ------------------------------------------------------------------------------------- */

static void test_bad_inputs(void **state) {
  (void)state;
  mtrain_block_cache_t *cache = NULL;
  TS_ASSERT_STATUS(mtrain_block_cache_create(0, 4, &cache), MTRAIN_ERR_INVALID_ARGUMENT,
                   "num_layers 0");
  assert_null(cache);
  TS_ASSERT_STATUS(mtrain_block_cache_create(2, 0, &cache), MTRAIN_ERR_INVALID_ARGUMENT,
                   "refresh 0");
  TS_ASSERT_STATUS(mtrain_block_cache_create(2, 4, NULL), MTRAIN_ERR_NULL_POINTER, "out");
  CHECK_OK(mtrain_block_cache_create(2, 4, &cache));
  mtrain_context_t *ctx = make_ctx();
  step_in_t s;
  step_make(&s, 100, 1, 0);
  const mtrain_block_options_t o = topk_options(MTRAIN_BLOCK_MEANPOOL, 1);
  const mtrain_pattern_t *p = NULL;
  TS_ASSERT_STATUS(mtrain_block_cache_select(cache, 2, ctx, &s.tq, &s.tk, NULL, &o, NULL, &p, NULL),
                   MTRAIN_ERR_INVALID_ARGUMENT, "layer 2 out of range (the cache has 2 layers)");
  TS_ASSERT_STATUS(
      mtrain_block_cache_select(cache, -1, ctx, &s.tq, &s.tk, NULL, &o, NULL, &p, NULL),
      MTRAIN_ERR_INVALID_ARGUMENT, "layer -1 out of range");
  TS_ASSERT_STATUS(
      mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, NULL, &o, NULL, NULL, NULL),
      MTRAIN_ERR_NULL_POINTER, "pattern");
  TS_ASSERT_STATUS(
      mtrain_block_cache_select(cache, 0, NULL, &s.tq, &s.tk, NULL, &o, NULL, &p, NULL),
      MTRAIN_ERR_NULL_POINTER, "ctx");
  TS_ASSERT_STATUS(
      mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, NULL, NULL, NULL, &p, NULL),
      MTRAIN_ERR_NULL_POINTER, "options");
  TS_ASSERT_STATUS(
      mtrain_block_cache_select_ring(cache, 0, ctx, NULL, &s.tq, &s.tk, NULL, &o, NULL, &p, NULL),
      MTRAIN_ERR_NULL_POINTER, "layout");
  mtrain_tensor_t flat = mtrain_tensor_2d(s.q, MTRAIN_F32, s.N, HQ * D);
  TS_ASSERT_STATUS(mtrain_block_cache_select(cache, 0, ctx, &flat, &s.tk, NULL, &o, NULL, &p, NULL),
                   MTRAIN_ERR_SHAPE_MISMATCH, "q must be [tokens, heads, head_dim] (ndim 2)");
  /* a bad budget is the selection's refusal, passed on */
  mtrain_block_options_t bad = o;
  bad.top_k = -1;
  TS_ASSERT_STATUS(
      mtrain_block_cache_select(cache, 0, ctx, &s.tq, &s.tk, NULL, &bad, NULL, &p, NULL),
      MTRAIN_ERR_INVALID_BUDGET, "top_k -1");
  int due = 0;
  TS_ASSERT_STATUS(mtrain_block_cache_due(cache, 5, &due), MTRAIN_ERR_INVALID_ARGUMENT,
                   "layer 5 out of range");
  TS_ASSERT_STATUS(mtrain_block_cache_due(cache, 0, NULL), MTRAIN_ERR_NULL_POINTER, "due");
  TS_ASSERT_STATUS(mtrain_block_cache_invalidate(cache, -2), MTRAIN_ERR_INVALID_ARGUMENT,
                   "layer -2 out of range");
  TS_ASSERT_STATUS(mtrain_block_cache_counts(cache, 9, NULL, NULL), MTRAIN_ERR_INVALID_ARGUMENT,
                   "layer 9 out of range");
  TS_ASSERT_STATUS(mtrain_block_cache_counts(NULL, 0, NULL, NULL), MTRAIN_ERR_NULL_POINTER,
                   "cache");
  int64_t steps = -1;
  CHECK_OK(mtrain_block_cache_counts(cache, 0, &steps, NULL));
  assert_int_equal(steps, 0); /* no refused call counted */
  mtrain_block_cache_destroy(NULL);
  step_free(&s);
  mtrain_block_cache_destroy(cache);
  mtrain_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_schedule),
      cmocka_unit_test(test_layers_and_refresh_one),
      cmocka_unit_test(test_changes_and_invalidate),
      cmocka_unit_test(test_precise_lse_and_failure),
      cmocka_unit_test(test_ring_one_rank),
      cmocka_unit_test(test_bad_inputs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
