/* test_bench_tool.c: mtrain-bench end to end under mpiexec on the cpu
 * backend at small sizes: the JSON holds every field of every row (sparse
 * and dense times, tokens/s, speed-up, ring over compute, sparsity), its
 * figures agree with each other, the dense ring is measured once per length
 * and skipped above --skip-dense-above, the table is printed;
 * budgets from the command line give one row per length; bad command lines
 * fail with a message. The tool's and mpiexec's paths come from CMake. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_support.h"

#if !defined(MTRAIN_BENCH_TOOL) || !defined(MTRAIN_MPIEXEC)
#error "MTRAIN_BENCH_TOOL and MTRAIN_MPIEXEC (paths of mtrain-bench and mpiexec) must be defined"
#endif

/* Runs mtrain-bench on `ranks` ranks with `args` (stderr joined to stdout);
 * returns the exit status and the output (malloc'ed). */
static int run_bench(int ranks, const char *args, char **out) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
           "'%s' -n %d --oversubscribe --bind-to none '%s' %s 2>&1",
           MTRAIN_MPIEXEC, ranks, MTRAIN_BENCH_TOOL, args);
  return ts_run_capture(cmd, out);
}

static json_t *bench_json(const char *args, const char *path, int rows) {
  char *out = NULL;
  remove(path);
  const int rc = run_bench(2, args, &out);
  if (rc != 0) fail_msg("mtrain-bench %s: exit %d, output:\n%s", args, rc, out);
  /* the table: its header and a line per row (rows start with the tokens) */
  assert_non_null(strstr(out, "sparse_tok/s"));
  int lines = 0;
  for (const char *l = out; *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : l + strlen(l)) {
    long long tokens = 0;
    char layer[16];
    double sparsity = 0;
    if (sscanf(l, " %lld %15s %lf", &tokens, layer, &sparsity) == 3 && tokens > 0) lines++;
  }
  if (lines != rows) fail_msg("%d table rows, expected %d; output:\n%s", lines, rows, out);
  free(out);
  json_error_t err;
  json_t *j = json_load_file(path, 0, &err);
  if (!j) fail_msg("%s: not JSON: %s", path, err.text);
  return j;
}

static json_t *field(const json_t *obj, const char *key) {
  json_t *v = json_object_get(obj, key);
  if (!v) fail_msg("JSON field '%s' missing", key);
  return v;
}

static double num(const json_t *obj, const char *key) {
  json_t *v = field(obj, key);
  if (!json_is_number(v)) fail_msg("JSON field '%s' is not a number", key);
  return json_number_value(v);
}

static int near(double a, double b) { return fabs(a - b) <= 1e-5 * fabs(b) + 1e-9; }

/* A timed ring's object: positive times, their sum, tokens/s, ratios. */
static void check_run(const json_t *run, int64_t tokens) {
  assert_true(json_is_object(run));
  const double f = num(run, "forward_seconds"), b = num(run, "backward_seconds");
  const double s = num(run, "seconds");
  assert_true(f > 0 && b > 0);
  assert_true(near(s, f + b));
  assert_true(near(num(run, "tokens_per_second"), (double)tokens / s));
  const double rf = num(run, "forward_ring_over_compute");
  const double rb = num(run, "backward_ring_over_compute");
  assert_true(isfinite(rf) && rf > 0.5);
  assert_true(isfinite(rb) && rb > 0.5);
}

static void test_budgets_sweep(void **state) {
  (void)state;
  char json_path[512], args[2048];
  snprintf(json_path, sizeof json_path, "%s/bench.json", MTRAIN_TEST_TMPDIR);
  snprintf(args, sizeof args,
           "--tokens-list 1024,2048 --budgets '%s' --layers 3,31 --head-dim 32 --warmup 1 "
           "--repeat 1 --skip-dense-above 1024 --json '%s'",
           ts_data_path("Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"), json_path);
  json_t *j = bench_json(args, json_path, 4);
  assert_string_equal(json_string_value(field(j, "tool")), "mtrain-bench");
  assert_string_equal(json_string_value(field(j, "backend")), "cpu");
  assert_string_equal(json_string_value(field(j, "sparse_layout")), "striped");
  assert_string_equal(json_string_value(field(j, "dense_layout")), "zigzag");
  assert_int_equal((int)num(j, "world"), 2);
  assert_int_equal((int)num(j, "heads"), 16);
  assert_int_equal((int)num(j, "kv_heads"), 2);
  assert_int_equal((int)num(j, "head_dim"), 32);
  assert_int_equal((int)num(j, "warmup"), 1);
  assert_int_equal((int)num(j, "repeat"), 1);
  assert_true(json_is_string(field(j, "dtype")) && json_is_string(field(j, "pattern")));
  const json_t *rows = field(j, "rows");
  assert_int_equal(json_array_size(rows), 4);
  const int64_t tokens[4] = {1024, 1024, 2048, 2048};
  const int layers[4] = {3, 31, 3, 31};
  for (size_t i = 0; i < 4; i++) {
    const json_t *r = json_array_get(rows, i);
    assert_int_equal((int64_t)num(r, "tokens"), tokens[i]);
    assert_int_equal((int)num(r, "layer"), layers[i]);
    const double sp = num(r, "sparsity");
    assert_true(sp >= 0.0 && sp < 1.0);
    assert_true(num(r, "inputs_seconds") > 0 && num(r, "estimate_seconds") > 0);
    check_run(field(r, "sparse"), tokens[i]);
    if (tokens[i] > 1024) { /* skipped: dense and speed-up are null */
      assert_true(json_is_null(field(r, "dense")));
      assert_true(json_is_null(field(r, "speedup")));
      continue;
    }
    check_run(field(r, "dense"), tokens[i]);
    assert_true(near(num(r, "speedup"),
                     num(field(r, "dense"), "seconds") / num(field(r, "sparse"), "seconds")));
  }
  /* the dense ring is measured once per length */
  const json_t *d0 = field(json_array_get(rows, 0), "dense"),
               *d1 = field(json_array_get(rows, 1), "dense");
  assert_true(num(d0, "seconds") == num(d1, "seconds"));
  json_decref(j);
}

/* Budgets from the command line: one row per length, layer null. */
static void test_command_line_budgets(void **state) {
  (void)state;
  char json_path[512], args[1024];
  snprintf(json_path, sizeof json_path, "%s/bench_vs.json", MTRAIN_TEST_TMPDIR);
  snprintf(args, sizeof args,
           "--tokens-list 1000 --v-size 64 --s-size 128 --heads 4 --kv-heads 1 --head-dim 32 "
           "--granularity 64 --warmup 0 --json '%s'",
           json_path);
  json_t *j = bench_json(args, json_path, 1);
  const json_t *rows = field(j, "rows");
  assert_int_equal(json_array_size(rows), 1);
  const json_t *r = json_array_get(rows, 0);
  assert_true(json_is_null(field(r, "layer")));
  assert_true(num(r, "sparsity") > 0.0);
  check_run(field(r, "sparse"), 1000);
  check_run(field(r, "dense"), 1000);
  assert_true(num(r, "speedup") > 0);
  json_decref(j);
}

static void test_usage_errors(void **state) {
  (void)state;
  const struct {
    const char *args, *needle;
  } cases[] = {
      {"--tokens-list 1024 --layers 3", "needs --budgets"},
      {"--tokens-list 1024", "needs --budgets FILE"},
      {"--tokens-list 1024,x --v-size 1 --s-size 1", "--tokens-list '1024,x'"},
      {"--tokens-list 1024 --v-size 1 --s-size 1 --check", "--check is not an option"},
      {"--tokens-list 1024 --v-size 1 --s-size 1 --json", "--json needs a value"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char *out = NULL;
    const int rc = run_bench(1, cases[c].args, &out);
    if (rc == 0 || !strstr(out, cases[c].needle))
      fail_msg("mtrain-bench %s: exit %d, expected an error naming \"%s\"; output:\n%s",
               cases[c].args, rc, cases[c].needle, out);
    free(out);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_budgets_sweep),
      cmocka_unit_test(test_command_line_budgets),
      cmocka_unit_test(test_usage_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
