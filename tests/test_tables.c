/* test_tables.c: the backend and communicator tables are the only way from
 * the core to a backend (core/runtime/backend.c): a table of another API
 * version, or without a required slot, is refused with
 * MTRAIN_ERR_INVALID_CONFIG naming the table, the field and the versions;
 * an absent optional slot gives MTRAIN_ERR_NOT_SUPPORTED naming the backend
 * and the slot, or its documented neutral behaviour; allocations through
 * the wrappers are counted. White-box: fake tables are altered copies of the
 * built-in ones, put into a context by hand. The planning communicator
 * (mtrain_comm_create_planning) answers, refuses and plans as documented. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "mtrain/mtrain_backend.h"
#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_layout.h"
#include "test_support.h"

/* Asserts the last error contains `needle`. */
static void assert_message(const char *needle) {
  if (!strstr(mtrain_last_error(), needle))
    fail_msg("message \"%s\" lacks \"%s\"", mtrain_last_error(), needle);
}

/* A timer_mark slot for a table without timer_elapsed. */
static mtrain_status_t fake_timer_mark(void *state, int index) {
  (void)state, (void)index;
  return MTRAIN_SUCCESS;
}

/* A stream-ordered async slot for a table without the deferred scans. */
static int fake_async(void *state) {
  (void)state;
  return 1;
}

/* Every built-in backend table passes the check. */
static void test_builtin_tables_pass(void **state) {
  (void)state;
  const char *names[16];
  const int n = mtrain_backend_list(names, 16);
  assert_true(n >= 2);
  for (int i = 0; i < n && i < 16; i++)
    assert_int_equal(mtrain_backend_table_check(mtrain_backend_find(names[i])), MTRAIN_SUCCESS);
  mtrain_comm_t *self = NULL;
  assert_int_equal(mtrain_comm_create_self(&self), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_comm_table_check(self->ops), MTRAIN_SUCCESS);
  mtrain_comm_destroy(self);
}

/* A fake backend table of another api_version, or with a required slot
 * NULL, is refused naming the table, the field and both versions. */
static void test_bad_backend_tables(void **state) {
  (void)state;
  const mtrain_backend_ops_t *cpu = mtrain_backend_find("cpu");
  assert_non_null(cpu);
  mtrain_backend_ops_t ops = *cpu;
  ops.api_version = MTRAIN_API_VERSION + 1;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "backend table 'cpu': api_version is");
  char want[64];
  snprintf(want, sizeof want, "api_version is %d but this mtrain is %d", MTRAIN_API_VERSION + 1,
           MTRAIN_API_VERSION);
  assert_message(want);

  ops = *cpu;
  ops.attn_fwd_step = NULL;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "required slot 'attn_fwd_step' is NULL");
  assert_message("backend table 'cpu'");
  ops = *cpu;
  ops.permute = NULL;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "required slot 'permute' is NULL");
  ops = *cpu;
  ops.name = NULL;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "backend table '(unnamed)' (api_version");
  ops = *cpu;
  ops.acc_dtype = MTRAIN_BF16;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "acc_dtype is bf16");
  ops = *cpu;
  ops.memory_space = MTRAIN_MEMORY_ANY;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "memory_space is 2");
  /* the timer slots come as a pair */
  ops = *cpu;
  ops.timer_mark = fake_timer_mark;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "'timer_mark' is set but 'timer_elapsed' is NULL");
  /* the stream-ordered slots come as a triple */
  ops = *cpu;
  ops.async = fake_async;
  TS_ASSERT_STATUS(mtrain_backend_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "of the stream-ordered slots async, deferred_scan and deferred_poll only 1 is "
                   "set");
  /* optional slots may be NULL */
  ops = *cpu;
  ops.pattern_scores = NULL;
  ops.data_stream = NULL;
  ops.timer_mark = NULL;
  ops.timer_elapsed = NULL;
  assert_int_equal(mtrain_backend_table_check(&ops), MTRAIN_SUCCESS);
  TS_ASSERT_STATUS(mtrain_backend_table_check(NULL), MTRAIN_ERR_NULL_POINTER, "ops");
}

/* The same for communicator tables (mtrain_context_create applies it to the
 * caller's communicator: test_bad_input.c). */
static void test_bad_comm_tables(void **state) {
  (void)state;
  mtrain_comm_t *self = NULL;
  assert_int_equal(mtrain_comm_create_self(&self), MTRAIN_SUCCESS);
  mtrain_comm_ops_t ops = *self->ops;
  ops.api_version = 1;
  TS_ASSERT_STATUS(mtrain_comm_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "communicator table 'self': api_version is 1 but this mtrain is");
  ops = *self->ops;
  ops.allgather = NULL;
  TS_ASSERT_STATUS(mtrain_comm_table_check(&ops), MTRAIN_ERR_INVALID_CONFIG,
                   "required slot 'allgather' is NULL");
  ops = *self->ops;
  ops.set_data_stream = NULL; /* optional */
  assert_int_equal(mtrain_comm_table_check(&ops), MTRAIN_SUCCESS);
  mtrain_comm_destroy(self);
}

/* A communicator whose point-to-point memory is not the backend's is refused
 * at context creation, naming both (the tables say where memory lives; no
 * name is compared). */
static void test_memory_space_mismatch(void **state) {
  (void)state;
  mtrain_comm_t *self = NULL;
  assert_int_equal(mtrain_comm_create_self(&self), MTRAIN_SUCCESS);
  mtrain_comm_ops_t ops = *self->ops;
  ops.memory_space = MTRAIN_MEMORY_DEVICE;
  mtrain_comm_t device_comm = {&ops, self->state};
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT; /* the cpu backend: host memory */
  mtrain_context_t *ctx = NULL;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, &device_comm, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "moves device memory and cannot serve backend 'cpu'");
  assert_null(ctx);
  ops.memory_space = MTRAIN_MEMORY_HOST;
  assert_int_equal(mtrain_context_create(&cfg, &device_comm, &ctx), MTRAIN_SUCCESS);
  mtrain_context_destroy(ctx);
  mtrain_comm_destroy(self);
}

/* A context whose backend lacks every optional slot: the wrappers say
 * NOT_SUPPORTED naming the backend and the slot, or behave neutrally. */
static void test_absent_optional_slots(void **state) {
  (void)state;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = 16;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  const mtrain_backend_ops_t *real = ctx->backend;
  mtrain_backend_ops_t bare = *real;
  bare.pattern_scores = NULL;
  bare.data_stream = NULL;
  bare.timer_mark = NULL;
  bare.timer_elapsed = NULL;
  ctx->backend = &bare;
  static float q_unused[1];

  mtrain_scores_args_t args;
  memset(&args, 0, sizeof args);
  assert_int_equal(mtrain_be_has_pattern_scores(ctx), 0);
  TS_ASSERT_STATUS(mtrain_be_pattern_scores(ctx, &args), MTRAIN_ERR_NOT_SUPPORTED,
                   "backend 'cpu' has no pattern_scores");
  assert_int_equal(mtrain_be_has_timer(ctx), 0);
  TS_ASSERT_STATUS(mtrain_be_timer_mark(ctx, 0), MTRAIN_ERR_NOT_SUPPORTED,
                   "backend 'cpu' has no timer_mark");
  double seconds = -1.0;
  TS_ASSERT_STATUS(mtrain_be_timer_elapsed(ctx, 0, 1, &seconds), MTRAIN_ERR_NOT_SUPPORTED,
                   "backend 'cpu' has no timer_elapsed");
  assert_true(seconds == -1.0);
  assert_int_equal(mtrain_be_has_data_stream(ctx), 0);
  assert_null(mtrain_be_data_stream(ctx));
  assert_int_equal(mtrain_context_bind_stream(ctx), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_cm_set_data_stream(ctx, NULL), MTRAIN_SUCCESS); /* "self" has none */
  /* without the stream-ordered slots: synchronous, nothing deferred */
  assert_int_equal(mtrain_be_async(ctx), 0);
  assert_int_equal(mtrain_be_deferred_poll(ctx, 1), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_context_check_deferred(ctx), MTRAIN_SUCCESS);
  TS_ASSERT_STATUS(mtrain_be_deferred_scan(ctx, q_unused, MTRAIN_F32, 1, 0, 1, 1, "x"),
                   MTRAIN_ERR_NOT_SUPPORTED, "backend 'cpu' has no deferred scans");

  /* the public estimate reports the missing slot before touching anything */
  enum { N = 64, H = 2, D = 16 };
  static float q[N * H * D], k[N * H * D];
  const mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, H, D);
  const mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, H, D);
  mtrain_head_budget_t budgets[H];
  memset(budgets, 0, sizeof budgets);
  for (int h = 0; h < H; h++) budgets[h].v_size = budgets[h].s_size = 4;
  const mtrain_estimate_options_t opt = MTRAIN_ESTIMATE_INIT;
  mtrain_pattern_t *p = NULL;
  TS_ASSERT_STATUS(mtrain_pattern_estimate(ctx, &tq, &tk, budgets, &opt, &p),
                   MTRAIN_ERR_NOT_SUPPORTED, "backend 'cpu' has no pattern scores");
  assert_null(p);

  ctx->backend = real;
  mtrain_context_destroy(ctx);
}

/* Allocations through the wrappers are counted; blocks left live are freed
 * when the context is destroyed. */
static void test_alloc_is_counted(void **state) {
  (void)state;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  void *a = NULL, *b = NULL;
  assert_int_equal(mtrain_be_alloc(ctx, 100, &a), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_be_alloc(ctx, 28, &b), MTRAIN_SUCCESS);
  mtrain_memory_stats_t m;
  assert_int_equal(mtrain_context_memory(ctx, &m), MTRAIN_SUCCESS);
  assert_int_equal(m.backend_current_bytes, 128);
  assert_int_equal(m.backend_live_blocks, 2);
  assert_int_equal(mtrain_be_memset_zero(ctx, a, 100), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_be_copy(ctx, b, a, 28), MTRAIN_SUCCESS);
  mtrain_be_free(ctx, a);
  mtrain_be_free(ctx, NULL);
  assert_int_equal(mtrain_context_memory(ctx, &m), MTRAIN_SUCCESS);
  assert_int_equal(m.backend_current_bytes, 28);
  assert_int_equal(m.backend_peak_bytes, 128);
  assert_int_equal(m.backend_allocations, 2);
  assert_int_equal(mtrain_be_acc_dtype(ctx), MTRAIN_F32);
  assert_int_equal(mtrain_be_memory_space(ctx), MTRAIN_MEMORY_HOST);
  assert_string_equal(mtrain_cm_name(ctx), "self");
  mtrain_context_destroy(ctx); /* frees b (under ASan: no leak) */
}

/* The planning communicator: its table passes, it answers the rank and size
 * it was made for, all-gathers copies, refuses the rest naming the
 * operation, and a context over it plans rank 2 of 3 but cannot run the
 * ring. */
static void test_planning_comm(void **state) {
  (void)state;
  mtrain_comm_t *pc = NULL;
  TS_ASSERT_STATUS(mtrain_comm_create_planning(3, 3, &pc), MTRAIN_ERR_INVALID_ARGUMENT,
                   "rank 3 of size 3");
  TS_ASSERT_STATUS(mtrain_comm_create_planning(0, 0, &pc), MTRAIN_ERR_INVALID_ARGUMENT,
                   "rank 0 of size 0");
  TS_ASSERT_STATUS(mtrain_comm_create_planning(0, 1, NULL), MTRAIN_ERR_NULL_POINTER, "out");
  assert_int_equal(mtrain_comm_create_planning(2, 3, &pc), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_comm_table_check(pc->ops), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_comm_rank(pc), 2);
  assert_int_equal(mtrain_comm_size(pc), 3);
  const int32_t mine = 7;
  int32_t all[3] = {0, 0, 0};
  assert_int_equal(pc->ops->allgather(pc->state, &mine, all, sizeof mine), MTRAIN_SUCCESS);
  assert_true(all[0] == 7 && all[1] == 7 && all[2] == 7);
  float x = 1.0f;
  TS_ASSERT_STATUS(pc->ops->allreduce(pc->state, &x, 1, MTRAIN_F32, MTRAIN_REDUCE_SUM),
                   MTRAIN_ERR_NOT_SUPPORTED, "allreduce");
  mtrain_comm_t *sub = NULL;
  TS_ASSERT_STATUS(mtrain_comm_split(pc, 0, 0, &sub), MTRAIN_ERR_NOT_SUPPORTED, "split");
  enum { N = 256, G = 64, D = 16 };
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, pc, &ctx), MTRAIN_SUCCESS);
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create_dense(N, 1, G, &p), MTRAIN_SUCCESS);
  mtrain_layout_t *layout = NULL;
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_ZIGZAG, N, G, 3, NULL, &layout),
                   MTRAIN_SUCCESS);
  mtrain_plan_t *plan = NULL;
  assert_int_equal(mtrain_plan_create_ring(ctx, NULL, (const mtrain_layout_t *const[]){layout}, 0,
                                           (const mtrain_pattern_t *const[]){p}, &plan),
                   MTRAIN_SUCCESS);
  assert_int_equal(mtrain_plan_rank(plan), 2);
  assert_int_equal(mtrain_plan_num_steps(plan), 3);
  const int64_t T = mtrain_plan_local_tokens(plan);
  float *buf = calloc((size_t)(5 * T * D), sizeof *buf);
  assert_non_null(buf);
  mtrain_tensor_t q = mtrain_tensor_3d(buf, MTRAIN_F32, T, 1, D);
  mtrain_tensor_t k = mtrain_tensor_3d(buf + T * D, MTRAIN_F32, T, 1, D);
  mtrain_tensor_t v = mtrain_tensor_3d(buf + 2 * T * D, MTRAIN_F32, T, 1, D);
  mtrain_tensor_t o = mtrain_tensor_3d(buf + 3 * T * D, MTRAIN_F32, T, 1, D);
  mtrain_tensor_t lse = mtrain_tensor_2d(buf + 4 * T * D, MTRAIN_F32, T, 1);
  TS_ASSERT_STATUS(mtrain_attention_forward(ctx, plan, &q, &k, &v, &o, &lse),
                   MTRAIN_ERR_NOT_SUPPORTED, "planning communicator");
  free(buf);
  mtrain_plan_destroy(plan);
  mtrain_layout_destroy(layout);
  mtrain_pattern_destroy(p);
  mtrain_context_destroy(ctx);
  mtrain_comm_destroy(pc);
}

/* A backend whose table lacks `noncausal` (a table of the caller's; every
 * backend of the library sets it): a plan with a
 * non-causal pattern is refused before any work, naming the backend and the
 * sequence; the same backend runs causal plans. */
static void test_noncausal_refused(void **state) {
  (void)state;
  enum { N = 96, G = 32, D = 16 };
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  assert_int_equal(ctx->backend->noncausal, 1);
  const mtrain_backend_ops_t *real = ctx->backend;
  mtrain_backend_ops_t causal_only = *real;
  causal_only.noncausal = 0;
  ctx->backend = &causal_only;
  static float q[N * D], k[N * D], v[N * D], o[N * D], lse[N], dq[N * D], dk[N * D], dv[N * D];
  const mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, 1, D);
  const mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, 1, D);
  const mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F32, N, 1, D);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F32, N, 1, D);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, N, 1);
  mtrain_tensor_t tdq = mtrain_tensor_3d(dq, MTRAIN_F32, N, 1, D);
  mtrain_tensor_t tdk = mtrain_tensor_3d(dk, MTRAIN_F32, N, 1, D);
  mtrain_tensor_t tdv = mtrain_tensor_3d(dv, MTRAIN_F32, N, 1, D);
  mtrain_pattern_t *nc = NULL, *causal = NULL;
  assert_int_equal(mtrain_pattern_create_noncausal(N, 1, G, &nc), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_create_dense(N, 1, G, &causal), MTRAIN_SUCCESS);
  mtrain_plan_t *plan = NULL;
  assert_int_equal(mtrain_plan_create(ctx, NULL, (const mtrain_pattern_t *const[]){nc}, &plan),
                   MTRAIN_SUCCESS);
  TS_ASSERT_STATUS(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl),
                   MTRAIN_ERR_NOT_SUPPORTED,
                   "backend 'cpu' computes causal attention only, and sequence 0");
  TS_ASSERT_STATUS(
      mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &to, &tdq, &tdk, &tdv),
      MTRAIN_ERR_NOT_SUPPORTED, "computes causal attention only");
  mtrain_plan_destroy(plan);
  assert_int_equal(mtrain_plan_create(ctx, NULL, (const mtrain_pattern_t *const[]){causal}, &plan),
                   MTRAIN_SUCCESS);
  assert_int_equal(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl), MTRAIN_SUCCESS);
  mtrain_plan_destroy(plan);
  ctx->backend = real;
  mtrain_pattern_destroy(nc);
  mtrain_pattern_destroy(causal);
  mtrain_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_noncausal_refused),   cmocka_unit_test(test_planning_comm),
      cmocka_unit_test(test_builtin_tables_pass), cmocka_unit_test(test_bad_backend_tables),
      cmocka_unit_test(test_bad_comm_tables),     cmocka_unit_test(test_absent_optional_slots),
      cmocka_unit_test(test_alloc_is_counted),    cmocka_unit_test(test_memory_space_mismatch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
