/* test_allocator.c: the caller's allocator (mtrain_context_set_allocator).
 * Every block the library takes during an estimate, a forward and a
 * backward comes from the caller's functions and goes back to them with
 * its size, the results are bitwise those of the backend's own allocator,
 * an allocator that has no memory fails the call with OUT_OF_MEMORY naming
 * it, and a half-given allocator or a change while blocks are live is
 * refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

enum { N = 700, HQ = 4, HKV = 2, D = 32, G = 64 };

typedef struct counting {
  size_t allocs, frees, live_bytes, peak_bytes;
  int fail; /* 1: return NULL */
} counting_t;

static void *count_alloc(size_t bytes, void *user) {
  counting_t *c = user;
  if (c->fail) return NULL;
  c->allocs++;
  c->live_bytes += bytes;
  if (c->live_bytes > c->peak_bytes) c->peak_bytes = c->live_bytes;
  return malloc(bytes ? bytes : 1);
}

static void count_free(void *ptr, size_t bytes, void *user) {
  counting_t *c = user;
  c->frees++;
  c->live_bytes -= bytes;
  free(ptr);
}

typedef struct outputs {
  float o[N * HQ * D], lse[N * HQ], dq[N * HQ * D], dk[N * HKV * D], dv[N * HKV * D];
} outputs_t;

static float q_[N * HQ * D], k_[N * HKV * D], v_[N * HKV * D], do_[N * HQ * D];

/* Forward and backward of one sparse pattern on the fixed inputs. */
static mtrain_status_t run(mtrain_context_t *ctx, const mtrain_plan_t *plan, outputs_t *out) {
  mtrain_tensor_t q = mtrain_tensor_3d(q_, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t k = mtrain_tensor_3d(k_, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t v = mtrain_tensor_3d(v_, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t dout = mtrain_tensor_3d(do_, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t o = mtrain_tensor_3d(out->o, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t l = mtrain_tensor_2d(out->lse, MTRAIN_F32, N, HQ);
  mtrain_tensor_t dq = mtrain_tensor_3d(out->dq, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t dk = mtrain_tensor_3d(out->dk, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t dv = mtrain_tensor_3d(out->dv, MTRAIN_F32, N, HKV, D);
  mtrain_status_t st = mtrain_attention_forward(ctx, plan, &q, &k, &v, &o, &l);
  if (st == MTRAIN_SUCCESS)
    st = mtrain_attention_backward(ctx, plan, &q, &k, &v, &o, &l, &dout, &dq, &dk, &dv);
  return st;
}

static void test_allocator_takes_every_block(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(90);
  mtrain_tensor_t tq = mtrain_tensor_3d(q_, MTRAIN_F32, N, HQ, D);
  mtrain_tensor_t tk = mtrain_tensor_3d(k_, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tv = mtrain_tensor_3d(v_, MTRAIN_F32, N, HKV, D);
  mtrain_tensor_t tdo = mtrain_tensor_3d(do_, MTRAIN_F32, N, HQ, D);
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = seed;
  assert_int_equal(mtrain_generate_structured(&so, &tq, &tk, &tv), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_generate_normal(seed + 1, 1.0, &tdo), MTRAIN_SUCCESS);
  const char *backends[2] = {"cpu", "cpu-ref"};
  for (int b = 0; b < 2; b++) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.backend = backends[b];
    cfg.granularity = G;
    cfg.num_threads = 2;
    mtrain_context_t *ctx = NULL;
    assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
    /* the estimate takes its score buffers from the allocator too */
    counting_t c = {0};
    const mtrain_allocator_t a = {count_alloc, count_free, &c};
    assert_int_equal(mtrain_context_set_allocator(ctx, &a), MTRAIN_SUCCESS);
    mtrain_head_budget_t budgets[HQ];
    for (int h = 0; h < HQ; h++) {
      memset(&budgets[h], 0, sizeof budgets[h]);
      budgets[h].kind = MTRAIN_BUDGET_TOP_K;
      budgets[h].v_size = 40 + 10 * h;
      budgets[h].s_size = 60;
    }
    mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
    eo.last_q = 64;
    mtrain_pattern_t *p = NULL;
    assert_int_equal(mtrain_pattern_estimate(ctx, &tq, &tk, budgets, &eo, &p), MTRAIN_SUCCESS);
    const size_t estimate_allocs = c.allocs;
    if (estimate_allocs == 0 || c.live_bytes != 0 || c.frees != c.allocs)
      fail_msg("%s, seed %llu: the estimate took %zu blocks from the allocator, %zu returned, "
               "%zu bytes live",
               backends[b], (unsigned long long)seed, c.allocs, c.frees, c.live_bytes);
    const mtrain_pattern_t *pats[1] = {p};
    mtrain_plan_t *plan = NULL;
    assert_int_equal(mtrain_plan_create(ctx, NULL, pats, &plan), MTRAIN_SUCCESS);
    outputs_t *with = calloc(1, sizeof *with), *without = calloc(1, sizeof *without);
    assert_int_equal(run(ctx, plan, with), MTRAIN_SUCCESS);
    mtrain_memory_stats_t ms;
    assert_int_equal(mtrain_context_memory(ctx, &ms), MTRAIN_SUCCESS);
    if (c.allocs == estimate_allocs || c.frees != c.allocs || c.live_bytes != 0 ||
        c.peak_bytes != ms.backend_peak_bytes)
      fail_msg("%s, seed %llu: %zu blocks taken, %zu returned, %zu bytes live, the allocator's "
               "peak %zu bytes against the context's %zu",
               backends[b], (unsigned long long)seed, c.allocs, c.frees, c.live_bytes, c.peak_bytes,
               (size_t)ms.backend_peak_bytes);
    /* the backend's own allocator again: the same results, bit for bit */
    assert_int_equal(mtrain_context_set_allocator(ctx, NULL), MTRAIN_SUCCESS);
    const size_t before = c.allocs;
    assert_int_equal(run(ctx, plan, without), MTRAIN_SUCCESS);
    assert_int_equal(c.allocs, before);
    if (memcmp(with, without, sizeof *with) != 0)
      fail_msg("%s, seed %llu: results differ with the caller's allocator", backends[b],
               (unsigned long long)seed);
    /* an allocator without memory fails the call, naming it */
    c.fail = 1;
    assert_int_equal(mtrain_context_set_allocator(ctx, &a), MTRAIN_SUCCESS);
    TS_ASSERT_STATUS(run(ctx, plan, with), MTRAIN_ERR_OUT_OF_MEMORY, "caller's allocator");
    free(with);
    free(without);
    mtrain_plan_destroy(plan);
    mtrain_pattern_destroy(p);
    mtrain_context_destroy(ctx);
  }
}

static void test_allocator_bad_input(void **state) {
  (void)state;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  counting_t c = {0};
  const mtrain_allocator_t half = {count_alloc, NULL, &c};
  TS_ASSERT_STATUS(mtrain_context_set_allocator(ctx, &half), MTRAIN_ERR_NULL_POINTER,
                   "allocator->free is NULL");
  TS_ASSERT_STATUS(mtrain_context_set_allocator(NULL, NULL), MTRAIN_ERR_NULL_POINTER, "ctx");
  mtrain_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_allocator_takes_every_block),
      cmocka_unit_test(test_allocator_bad_input),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
