/* test_memory.c: the memory accounting and its bound (docs/MEMORY.md).
 * Runs the main job's sequence (estimate, plan, forward, backward) for
 * several lengths, head configurations, dtypes and both CPU backends, and
 * checks that the backend peak of each phase equals its term of
 * mtrain_memory_bound (the formula describes the code exactly; the
 * single-rank estimate allocates the gathered last-L queries less), that the
 * peak over the sequence stays within the bound, and that every byte comes
 * back (current 0) once the calls return. Built twice:
 *  - test_memory (one process): world size 1; the bound's O(N/W) scaling for
 *    W = 2..8 (plans of other ranks built through the planning communicator,
 *    mtrain_comm_create_planning); and a leak loop: the whole
 *    sequence, context creation to destruction, 20 times, with current
 *    backend bytes 0 after each iteration and the process's resident set
 *    growing less than 1 MiB after the first two (not asserted under a
 *    sanitizer, whose quarantine and shadow memory grow on their own;
 *    LeakSanitizer checks the loop there instead).
 *  - test_memory_mpi (MTRAIN_TEST_MEMORY_MPI, under mpiexec -n 3): the ring,
 *    flat and hierarchical (3 nodes of 1 rank), striped and bars gathered,
 *    and the peak's growth with N at W = 3 (linear in N / W). Every rank
 *    checks its own figures; the verdicts are combined before asserting, so
 *    that no rank is left waiting in a collective. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_layout.h"
#include "test_support.h"
#ifdef MTRAIN_TEST_MEMORY_MPI
#include <mpi.h>

#include "mtrain/mtrain_mpi.h"
#endif

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif
#ifndef UNDER_SANITIZER
#define UNDER_SANITIZER 0
#endif

enum { LAST_Q = 64 };

typedef struct mem_case {
  const char *backend;
  mtrain_dtype_t dtype;
  int64_t N;
  int32_t hq, hkv, d, G;
  mtrain_layout_kind_t layout; /* ring only */
  int32_t ranks_per_node;      /* ring only; 0: flat */
} mem_case_t;

/* What one run of the sequence measured, and its bound. */
typedef struct mem_result {
  size_t est_peak, fwd_peak, bwd_peak, peak, current_after;
  int64_t live_after;
  mtrain_memory_bound_t bound;
  int64_t T;
  int world;
} mem_result_t;

/* The tensors of one rank: q, k, v, dout in; o, lse, dq, dk, dv out. */
typedef struct tensors {
  mtrain_tensor_t q, k, v, dout, o, lse, dq, dk, dv;
} tensors_t;

static mtrain_tensor_t alloc3(mtrain_dtype_t dt, int64_t n, int32_t h, int32_t d) {
  return mtrain_tensor_3d(calloc((size_t)(n * h * d) + 1, mtrain_dtype_size(dt)), dt, n, h, d);
}

static void tensors_alloc(tensors_t *t, const mem_case_t *c, int64_t n) {
  t->q = alloc3(c->dtype, n, c->hq, c->d);
  t->k = alloc3(c->dtype, n, c->hkv, c->d);
  t->v = alloc3(c->dtype, n, c->hkv, c->d);
  t->dout = alloc3(c->dtype, n, c->hq, c->d);
  t->o = alloc3(c->dtype, n, c->hq, c->d);
  const mtrain_dtype_t ldt = c->dtype == MTRAIN_F64 ? MTRAIN_F64 : MTRAIN_F32;
  t->lse = mtrain_tensor_2d(calloc((size_t)(n * c->hq) + 1, mtrain_dtype_size(ldt)), ldt, n, c->hq);
  t->dq = alloc3(c->dtype, n, c->hq, c->d);
  t->dk = alloc3(c->dtype, n, c->hkv, c->d);
  t->dv = alloc3(c->dtype, n, c->hkv, c->d);
}

static void tensors_free(tensors_t *t) {
  mtrain_tensor_t *all[9] = {&t->q, &t->k, &t->v, &t->dout, &t->o, &t->lse, &t->dq, &t->dk, &t->dv};
  for (int i = 0; i < 9; i++) free(all[i]->data);
}

/* Structured q, k, v and normal dout of the whole sequence (the same on
 * every rank: seeded). */
static void generate(tensors_t *t, uint64_t seed) {
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = seed;
  assert_int_equal(mtrain_generate_structured(&so, &t->q, &t->k, &t->v), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_generate_normal(seed + 1, 1.0, &t->dout), MTRAIN_SUCCESS);
}

/* The backend peak since the last reset, then a new peak begins. */
static size_t take_peak(mtrain_context_t *ctx) {
  mtrain_memory_stats_t s;
  assert_int_equal(mtrain_context_memory(ctx, &s), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_context_reset_peak_memory(ctx), MTRAIN_SUCCESS);
  return s.backend_peak_bytes;
}

/* The main job's sequence on the context's communicator (NULL: one rank):
 * estimate (top-k budgets and one top-p head, whose row statistics make the
 * estimate's largest memory), plan, forward, backward; the phases' peaks. */
static void run_sequence(const mem_case_t *c, mtrain_comm_t *comm, uint64_t seed, mem_result_t *r) {
  memset(r, 0, sizeof *r);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = c->backend;
  cfg.granularity = c->G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, comm, &ctx), MTRAIN_SUCCESS);
  r->world = mtrain_context_world(ctx);
  const int rank = mtrain_context_rank(ctx);
  tensors_t full, loc;
  tensors_alloc(&full, c, c->N);
  generate(&full, seed);
  mtrain_layout_t *layout = NULL;
  if (r->world > 1) {
    assert_int_equal(mtrain_layout_create(c->layout, c->N, c->G, r->world, NULL, &layout),
                     MTRAIN_SUCCESS);
    r->T = mtrain_layout_local_tokens(layout, rank);
    tensors_alloc(&loc, c, r->T);
    const mtrain_tensor_t *src[4] = {&full.q, &full.k, &full.v, &full.dout};
    mtrain_tensor_t *dst[4] = {&loc.q, &loc.k, &loc.v, &loc.dout};
    for (int i = 0; i < 4; i++)
      assert_int_equal(mtrain_layout_permute(ctx, layout, rank, src[i], dst[i]), MTRAIN_SUCCESS);
  } else {
    r->T = c->N;
  }
  tensors_t *t = r->world > 1 ? &loc : &full;
  mtrain_head_budget_t *budgets = calloc((size_t)c->hq, sizeof *budgets);
  for (int32_t h = 0; h < c->hq; h++) {
    budgets[h].kind = MTRAIN_BUDGET_TOP_K;
    budgets[h].v_size = 32 + 8 * h;
    budgets[h].s_size = 200;
  }
  budgets[0].kind = MTRAIN_BUDGET_TOP_P;
  budgets[0].p_v = budgets[0].p_s = 0.9;
  budgets[0].cap_v = budgets[0].cap_s = 300;
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = LAST_Q;
  mtrain_pattern_t *pattern = NULL;
  const mtrain_status_t est =
      r->world > 1 ? mtrain_pattern_estimate_ring(ctx, layout, &t->q, &t->k, budgets, &eo, &pattern)
                   : mtrain_pattern_estimate(ctx, &t->q, &t->k, budgets, &eo, &pattern);
  if (est) fail_msg("estimate: %s", mtrain_last_error());
  r->est_peak = take_peak(ctx);
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *pats[1] = {pattern};
  const mtrain_status_t pst =
      r->world > 1 ? mtrain_plan_create_ring(ctx, NULL, (const mtrain_layout_t *const[]){layout},
                                             c->ranks_per_node,
                                             (const mtrain_pattern_t *const[]){pattern}, &plan)
                   : mtrain_plan_create(ctx, NULL, pats, &plan);
  if (pst) fail_msg("plan: %s", mtrain_last_error());
  assert_int_equal(mtrain_memory_bound(ctx, plan, c->hkv, c->d, c->dtype, LAST_Q, &r->bound),
                   MTRAIN_SUCCESS);
  assert_int_equal(take_peak(ctx), 0); /* the plan is host memory */
  if (mtrain_attention_forward(ctx, plan, &t->q, &t->k, &t->v, &t->o, &t->lse))
    fail_msg("forward: %s", mtrain_last_error());
  r->fwd_peak = take_peak(ctx);
  if (mtrain_attention_backward(ctx, plan, &t->q, &t->k, &t->v, &t->o, &t->lse, &t->dout, &t->dq,
                                &t->dk, &t->dv))
    fail_msg("backward: %s", mtrain_last_error());
  r->bwd_peak = take_peak(ctx);
  r->peak = r->est_peak > r->fwd_peak ? r->est_peak : r->fwd_peak;
  if (r->bwd_peak > r->peak) r->peak = r->bwd_peak;
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(pattern);
  mtrain_memory_stats_t s;
  assert_int_equal(mtrain_context_memory(ctx, &s), MTRAIN_SUCCESS);
  r->current_after = s.backend_current_bytes;
  r->live_after = s.backend_live_blocks;
  free(budgets);
  if (r->world > 1) tensors_free(&loc);
  tensors_free(&full);
  mtrain_layout_destroy(layout);
  mtrain_context_destroy(ctx);
}

/* The gathered last-L queries the ring estimate allocates and the
 * single-rank one does not. */
static size_t q_last_bytes(const mem_case_t *c) {
  const int64_t L = c->N < LAST_Q ? c->N : LAST_Q;
  return (size_t)(L * c->hq * c->d) * (c->dtype == MTRAIN_F64 ? 8 : 4);
}

/* 1 when the measured peaks are the bound's terms; prints the figures
 * otherwise (and always when verbose). */
static int check_result(const mem_case_t *c, const mem_result_t *r, int rank, int verbose) {
  const mtrain_memory_bound_t *b = &r->bound;
  const size_t est_want = b->estimate_bytes - (r->world > 1 ? 0 : q_last_bytes(c));
  const int ok = r->est_peak == est_want && r->fwd_peak == b->forward_bytes &&
                 r->bwd_peak == b->backward_bytes && r->peak <= b->backend_bytes &&
                 r->current_after == 0 && r->live_after == 0;
  if (!ok || verbose)
    print_message("%s rank %d/%d %s %s N=%lld T=%lld Hq=%d Hkv=%d d=%d G=%d layout %s rpn %d: "
                  "peaks estimate %zu (bound %zu), forward %zu (%zu), backward %zu (%zu); "
                  "peak %zu <= %zu; plan %zu host bytes; after: %zu bytes in %lld blocks\n",
                  ok ? "ok" : "FAIL", rank, r->world, c->backend, mtrain_dtype_name(c->dtype),
                  (long long)c->N, (long long)r->T, c->hq, c->hkv, c->d, c->G,
                  mtrain_layout_kind_name(c->layout), c->ranks_per_node, r->est_peak, est_want,
                  r->fwd_peak, b->forward_bytes, r->bwd_peak, b->backward_bytes, r->peak,
                  b->backend_bytes, b->plan_bytes, r->current_after, (long long)r->live_after);
  return ok;
}

#ifndef MTRAIN_TEST_MEMORY_MPI

/* ---- one process ---------------------------------------------------------- */

static void test_peaks_single_rank(void **state) {
  (void)state;
  static const mem_case_t cases[] = {
      {"cpu", MTRAIN_F32, 512, 4, 4, 64, 64, MTRAIN_LAYOUT_STRIPED, 0},
      {"cpu", MTRAIN_F32, 1000, 8, 2, 64, 64, MTRAIN_LAYOUT_STRIPED, 0},
      {"cpu", MTRAIN_BF16, 1536, 4, 1, 128, 128, MTRAIN_LAYOUT_STRIPED, 0},
      {"cpu", MTRAIN_F16, 777, 6, 3, 32, 32, MTRAIN_LAYOUT_STRIPED, 0},
      {"cpu-ref", MTRAIN_F32, 384, 4, 2, 64, 64, MTRAIN_LAYOUT_STRIPED, 0},
      {"cpu-ref", MTRAIN_F64, 300, 2, 1, 32, 32, MTRAIN_LAYOUT_STRIPED, 0},
  };
  int ok = 1;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    mem_result_t r;
    run_sequence(&cases[i], NULL, ts_seed(11 + i), &r);
    ok &= check_result(&cases[i], &r, 0, 1);
  }
  assert_true(ok);
}

/* The bound of rank 0 of W ranks (W = 1: the single-rank plan). */
static mtrain_memory_bound_t bound_of(const mtrain_pattern_t *p, int32_t W, int32_t rpn,
                                      mtrain_layout_kind_t kind, int32_t hkv, int32_t d) {
  const int64_t N = mtrain_pattern_seq_len(p);
  const int32_t G = mtrain_pattern_granularity(p);
  mtrain_comm_t *comm = NULL; /* rank 0 of W in this process */
  assert_int_equal(mtrain_comm_create_planning(0, W, &comm), MTRAIN_SUCCESS);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, W > 1 ? comm : NULL, &ctx), MTRAIN_SUCCESS);
  mtrain_plan_t *plan = NULL;
  mtrain_layout_t *layout = NULL;
  if (W > 1) {
    assert_int_equal(mtrain_layout_create(kind, N, G, W, NULL, &layout), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_plan_create_ring(ctx, NULL, (const mtrain_layout_t *const[]){layout},
                                             rpn, (const mtrain_pattern_t *const[]){p}, &plan),
                     MTRAIN_SUCCESS);
  } else {
    const mtrain_pattern_t *pats[1] = {p};
    assert_int_equal(mtrain_plan_create(ctx, NULL, pats, &plan), MTRAIN_SUCCESS);
  }
  mtrain_memory_bound_t b;
  assert_int_equal(mtrain_memory_bound(ctx, plan, hkv, d, MTRAIN_F32, LAST_Q, &b), MTRAIN_SUCCESS);
  mtrain_plan_destroy(plan);
  mtrain_layout_destroy(layout);
  mtrain_context_destroy(ctx);
  mtrain_comm_destroy(comm);
  return b;
}

/* The attention terms of the bound fall as 1/W on the flat ring (N
 * divisible by G * W: no padding), the estimation's term does not depend on
 * W, and the ring's constant over the single-rank path is the documented
 * one. Qwen2.5-3B's heads (16 query, 2 kv, d = 128) at N = 32768. */
/* A packed batch estimated in one call (mtrain_pattern_estimate_batch) holds
 * every sequence's score buffers at once: its peak is the bound's estimate
 * term for the batch's plan, less the longest sequence's q_last (one rank). */
static void test_packed_estimate_peak(void **state) {
  (void)state;
  const int64_t offsets[4] = {0, 300, 817, 946}; /* 300, 517 and 129 tokens */
  const mem_case_t c = {"cpu", MTRAIN_F32, offsets[3], 4, 2, 32, 32, MTRAIN_LAYOUT_STRIPED, 0};
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = c.backend;
  cfg.granularity = c.G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  tensors_t t;
  tensors_alloc(&t, &c, c.N);
  generate(&t, 5);
  mtrain_head_budget_t budgets[4];
  for (int32_t h = 0; h < 4; h++)
    budgets[h] = (mtrain_head_budget_t){MTRAIN_BUDGET_TOP_K, 20 + 8 * h, 60, 0, 0, 0, 0};
  budgets[0] = (mtrain_head_budget_t){MTRAIN_BUDGET_TOP_P, 0, 0, 0.9, 0.9, 300, 300};
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = LAST_Q;
  const mtrain_seqs_t seqs = {3, offsets};
  mtrain_pattern_t *pats[3] = {NULL, NULL, NULL};
  take_peak(ctx);
  if (mtrain_pattern_estimate_batch(ctx, &seqs, &t.q, &t.k, budgets, &eo, pats))
    fail_msg("estimate: %s", mtrain_last_error());
  const size_t peak = take_peak(ctx);
  mtrain_plan_t *plan = NULL;
  assert_int_equal(mtrain_plan_create(ctx, &seqs, (const mtrain_pattern_t *const *)pats, &plan),
                   MTRAIN_SUCCESS);
  mtrain_memory_bound_t b;
  assert_int_equal(mtrain_memory_bound(ctx, plan, c.hkv, c.d, c.dtype, LAST_Q, &b), MTRAIN_SUCCESS);
  const mem_case_t longest = {"cpu", MTRAIN_F32, 517, 4, 2, 32, 32, MTRAIN_LAYOUT_STRIPED, 0};
  print_message("packed batch of 300, 517 and 129 tokens: estimate peak %zu, bound %zu (less the "
                "longest sequence's q_last %zu)\n",
                peak, b.estimate_bytes, q_last_bytes(&longest));
  assert_int_equal(peak, b.estimate_bytes - q_last_bytes(&longest));
  mtrain_plan_destroy(plan);
  for (int s = 0; s < 3; s++) mtrain_pattern_destroy(pats[s]);
  tensors_free(&t);
  mtrain_context_destroy(ctx);
}

static void test_bound_scales(void **state) {
  (void)state;
  enum { BN = 32768, BHQ = 16, BHKV = 2, BD = 128, BG = 128 };
  mtrain_pattern_t *p = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, BN, BHQ, BG, ts_seed(3));
  const mtrain_memory_bound_t b1 = bound_of(p, 1, 0, MTRAIN_LAYOUT_STRIPED, BHKV, BD);
  const mtrain_memory_bound_t b2 = bound_of(p, 2, 0, MTRAIN_LAYOUT_STRIPED, BHKV, BD);
  const int32_t worlds[] = {4, 8, 16};
  for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
    const int32_t W = worlds[i];
    const mtrain_memory_bound_t b = bound_of(p, W, 0, MTRAIN_LAYOUT_STRIPED, BHKV, BD);
    /* the flat ring keeps 3 chunk buffers from W = 3 on, 2 at W = 2 */
    const double per_token_w = (double)b.backward_bytes * W / BN;
    print_message("W=%d: forward %zu, backward %zu (x W / N = %.1f B/token), estimate %zu, "
                  "plan %zu\n",
                  W, b.forward_bytes, b.backward_bytes, per_token_w, b.estimate_bytes,
                  b.plan_bytes);
    assert_true(b.estimate_bytes == b2.estimate_bytes);
    if (W > 4) { /* same schedule shape as W = 4: exactly 1/W */
      const mtrain_memory_bound_t b4 = bound_of(p, 4, 0, MTRAIN_LAYOUT_STRIPED, BHKV, BD);
      assert_true(b.forward_bytes * (size_t)W == b4.forward_bytes * 4);
      assert_true(b.backward_bytes * (size_t)W == b4.backward_bytes * 4);
    }
  }
  /* per token of the rank: Hq (d + 2) a + 2 Hkv d a (W = 1, backward); the
   * flat ring from W = 3 adds 3 (2e + 2a) Hkv d + 2a Hkv d + 4a Hkv d */
  const double single = (double)BHQ * (BD + 2) * 4 + 2.0 * BHKV * BD * 4;
  const double ring = single + (3 * 16.0 + 8 + 16) * BHKV * BD;
  const mtrain_memory_bound_t b4 = bound_of(p, 4, 0, MTRAIN_LAYOUT_STRIPED, BHKV, BD);
  print_message("W=1: backward %zu = %.1f B/token (formula %.1f); W=4: %.1f B/token (formula "
                "%.1f); W=2: backward %zu\n",
                b1.backward_bytes, (double)b1.backward_bytes / BN, single,
                (double)b4.backward_bytes * 4 / BN, ring, b2.backward_bytes);
  assert_true(b1.backward_bytes == (size_t)(single * BN));
  assert_true(b4.backward_bytes * 4 == (size_t)(ring * BN));
  /* hierarchical, 4 nodes of 2: chunk buffers A, B (outer) and C (an inner ring of 2),
   * and a partial in and out per node */
  const mtrain_memory_bound_t h = bound_of(p, 8, 2, MTRAIN_LAYOUT_STRIPED, BHKV, BD);
  const double hier = single + (3 * 16.0 + 8 + 4 * 16) * BHKV * BD;
  print_message("W=8 hierarchical 4x2: backward %zu = %.1f B/token x W (formula %.1f)\n",
                h.backward_bytes, (double)h.backward_bytes * 8 / BN, hier);
  assert_true(h.backward_bytes * 8 == (size_t)(hier * BN));
  mtrain_pattern_destroy(p);
}

/* Resident set now, from /proc/self/statm (0 where unavailable). */
static size_t rss_now(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long long size = 0, res = 0;
  const int n = f ? fscanf(f, "%llu %llu", &size, &res) : 0;
  if (f) fclose(f);
  const long page = sysconf(_SC_PAGESIZE);
  return n == 2 && page > 0 ? (size_t)res * (size_t)page : 0;
}

/* Heap bytes in use now (glibc mallinfo2: every arena, mmapped chunks included;
 * 0 where unavailable). */
static size_t heap_in_use(void) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
#else
  return 0;
#endif
}

/* The whole main-job sequence, context to context, K times in one process
 * (K = 100, 20 under a sanitizer, or MTRAIN_TEST_LEAK_ITERATIONS). Backend bytes
 * must be back to 0 after every iteration (check_result), and over the second
 * half of the loop:
 *  - the heap bytes in use (malloc's own count, all arenas) must not grow by
 *    64 KiB or more: a leak of L bytes per iteration grows them by L * K / 2,
 *    so at K = 100 every leak of 1.3 KiB or more per iteration fails;
 *  - the resident set must not grow by 4 MiB or more (memory outside malloc,
 *    such as a runtime's mappings). The resident set alone is too noisy for a
 *    finer bound: malloc grows and trims its heaps in steps of about 1 MiB,
 *    and with no leak (the in-use count flat) it was seen (2-core VM,
 *    2026-11-22) at +1.0 MiB from iteration 50 to 100, +1.5 MiB from 100 to
 *    200, and flat from 150 to 300 in another run of the same binary. */
static void test_leak_loop(void **state) {
  (void)state;
  const char *env = getenv("MTRAIN_TEST_LEAK_ITERATIONS");
  const int K = env && atoi(env) >= 4 ? atoi(env) : UNDER_SANITIZER ? 20 : 100;
  const mem_case_t c = {"cpu", MTRAIN_F32, 1024, 4, 2, 64, 64, MTRAIN_LAYOUT_STRIPED, 0};
  size_t rss_1 = 0, rss_half = 0, rss_k = 0, heap_half = 0, heap_k = 0;
  for (int it = 0; it < K; it++) {
    mem_result_t r;
    run_sequence(&c, NULL, 7, &r);
    if (!check_result(&c, &r, 0, 0)) fail_msg("iteration %d", it);
    const size_t rss = rss_now(), heap = heap_in_use();
    if (it == 0) rss_1 = rss;
    if (it == K / 2 - 1) {
      rss_half = rss;
      heap_half = heap;
    }
    rss_k = rss;
    heap_k = heap;
  }
  const long long growth = (long long)rss_k - (long long)rss_half;
  const long long heap_growth = (long long)heap_k - (long long)heap_half;
  print_message("resident set: after iteration 1 %zu KiB, %d %zu KiB, %d %zu KiB: growth %lld "
                "KiB over the second half; heap in use %zu -> %zu bytes (%+lld)%s\n",
                rss_1 / 1024, K / 2, rss_half / 1024, K, rss_k / 1024, growth / 1024, heap_half,
                heap_k, heap_growth, UNDER_SANITIZER ? " (not asserted under a sanitizer)" : "");
  if (UNDER_SANITIZER) return;
  if (heap_growth >= 64 * 1024)
    fail_msg("the heap in use grew by %lld bytes over iterations %d to %d", heap_growth, K / 2, K);
  if (growth >= 4 * 1024 * 1024)
    fail_msg("the resident set grew by %lld KiB over iterations %d to %d", growth / 1024, K / 2, K);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_peaks_single_rank),
      cmocka_unit_test(test_packed_estimate_peak),
      cmocka_unit_test(test_bound_scales),
      cmocka_unit_test(test_leak_loop),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

#else /* MTRAIN_TEST_MEMORY_MPI */

/* ---- under mpiexec -------------------------------------------------------- */

static mtrain_comm_t *comm_;
static int rank_;

/* 1 on every rank when `ok` holds on every rank. */
static int all_ok(int ok) {
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
  return all;
}

static void test_peaks_ring(void **state) {
  (void)state;
  static const mem_case_t cases[] = {
      {"cpu", MTRAIN_F32, 1536, 4, 2, 64, 64, MTRAIN_LAYOUT_STRIPED, 0},
      {"cpu", MTRAIN_F32, 1000, 8, 8, 32, 32, MTRAIN_LAYOUT_ZIGZAG, 0},
      {"cpu", MTRAIN_BF16, 2048, 4, 1, 128, 128, MTRAIN_LAYOUT_BALANCED, 0},
      {"cpu", MTRAIN_F32, 1536, 4, 2, 64, 64, MTRAIN_LAYOUT_STRIPED, 1},
      {"cpu-ref", MTRAIN_F32, 768, 4, 2, 64, 64, MTRAIN_LAYOUT_STRIPED, 0},
      {"cpu-ref", MTRAIN_F64, 600, 2, 1, 32, 32, MTRAIN_LAYOUT_BALANCED, 1},
  };
  int ok = 1;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    mem_result_t r;
    run_sequence(&cases[i], comm_, ts_seed(21 + i), &r);
    ok &= check_result(&cases[i], &r, rank_, rank_ == 0);
  }
  assert_true(all_ok(ok));
}

/* At W = 3 the peak grows linearly with N / W: doubling N doubles the
 * forward and backward peaks up to the bars and the all-ones allocations. */
static void test_peak_linear_in_n(void **state) {
  (void)state;
  mem_case_t c = {"cpu", MTRAIN_F32, 0, 8, 2, 64, 64, MTRAIN_LAYOUT_STRIPED, 0};
  const int64_t lengths[] = {1536, 3072, 6144};
  mem_result_t r[3];
  int ok = 1;
  for (int i = 0; i < 3; i++) {
    c.N = lengths[i];
    run_sequence(&c, comm_, ts_seed(31), &r[i]);
    ok &= check_result(&c, &r[i], rank_, rank_ == 0);
  }
  for (int i = 1; i < 3; i++) {
    const double f = (double)r[i].fwd_peak / (double)r[i - 1].fwd_peak;
    const double b = (double)r[i].bwd_peak / (double)r[i - 1].bwd_peak;
    if (rank_ == 0)
      print_message("N %lld -> %lld: forward x %.4f, backward x %.4f\n", (long long)lengths[i - 1],
                    (long long)lengths[i], f, b);
    ok &= f > 1.99 && f < 2.01 && b > 1.99 && b < 2.01;
  }
  assert_true(all_ok(ok));
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  int rc = 1;
  if (mtrain_comm_create_mpi(MPI_COMM_WORLD, 0, &comm_) == MTRAIN_SUCCESS) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peaks_ring),
        cmocka_unit_test(test_peak_linear_in_n),
    };
    rc = cmocka_run_group_tests(tests, NULL, NULL);
    mtrain_comm_destroy(comm_);
  }
  MPI_Finalize();
  return rc;
}

#endif /* MTRAIN_TEST_MEMORY_MPI */
