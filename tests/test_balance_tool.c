/* test_balance_tool.c: mtrain-balance end to end on tiny workloads: its JSON
 * (the whole-model ring_sync_slowdown and worker_imbalance, the per-head
 * list over all layers and heads) equals what the library computes for the
 * same budgets and position model; a pattern file as input; the PNG; usage
 * errors named with a non-zero exit. The tool's path comes from CMake. */
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
#include <sys/wait.h>

#include "mtrain/mtrain_balance.h"
#include "mtrain/mtrain_io.h"
#include "test_support.h"

#ifndef MTRAIN_BALANCE_TOOL
#error "MTRAIN_BALANCE_TOOL (the path of mtrain-balance) must be defined"
#endif

static const char budgets_text[] =
    "[{\"0\": [\"vertical_and_slash\", 100, 50, 0.9], \"1\": [\"vertical_and_slash\", 10, 500, "
    "0.9]},\n {\"0\": [\"vertical_and_slash\", 3500, 100, 0.9], \"1\": [\"vertical_and_slash\", "
    "40, 2000, 0.9]}]\n";

static const char *tmp_path(const char *name) {
  static char buf[4][512];
  static int next = 0;
  char *p = buf[next++ % 4];
  snprintf(p, 512, "%s/%s", MTRAIN_TEST_TMPDIR, name);
  return p;
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

/* Runs the tool with `args` (stderr joined to stdout when `join`); returns
 * the exit status and the output (malloc'ed). */
static int run_tool(const char *args, int join, char **out) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=2 '%s' %s%s", MTRAIN_BALANCE_TOOL, args,
           join ? " 2>&1" : " 2>/dev/null");
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = 0, cap = 1 << 16;
  char *buf = malloc(cap);
  size_t got;
  while ((got = fread(buf + n, 1, cap - n - 1, p)) > 0) {
    n += got;
    if (cap - n < 1024) buf = realloc(buf, cap *= 2);
  }
  buf[n] = '\0';
  const int status = pclose(p);
  *out = buf;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static json_t *run_json(const char *args) {
  char *out = NULL;
  const int rc = run_tool(args, 0, &out);
  if (rc != 0) fail_msg("mtrain-balance %s: exit %d, output:\n%s", args, rc, out);
  json_error_t err;
  json_t *j = json_loads(out, 0, &err);
  if (!j) fail_msg("mtrain-balance %s: not JSON (%s):\n%s", args, err.text, out);
  free(out);
  return j;
}

static double num(const json_t *obj, const char *key) {
  const json_t *v = json_object_get(obj, key);
  if (!v || !json_is_number(v)) fail_msg("JSON key '%s' missing or not a number", key);
  return json_number_value(v);
}

#define CLOSE(a, b) (fabs((a) - (b)) <= 1e-8 * fabs(b))

/* The library's cost of the same workload and layout. */
static mtrain_cost_t *library_cost(mtrain_layout_kind_t kind, int64_t N, int32_t G, int32_t W,
                                   int32_t rpn, mtrain_pattern_t **pats, int32_t np) {
  mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
  bo.patterns = (const mtrain_pattern_t *const *)pats;
  bo.num_patterns = np;
  mtrain_layout_t *l = NULL;
  assert_int_equal(mtrain_layout_create(kind, N, G, W, &bo, &l), MTRAIN_SUCCESS);
  mtrain_cost_options_t o = MTRAIN_COST_OPTIONS_INIT;
  o.ranks_per_node = rpn;
  mtrain_cost_t *c = NULL;
  assert_int_equal(mtrain_cost_evaluate(l, (const mtrain_pattern_t *const *)pats, np, &o, &c),
                   MTRAIN_SUCCESS);
  mtrain_layout_destroy(l);
  return c;
}

static void test_json_matches_library(void **state) {
  (void)state;
  const char *bpath = tmp_path("balance_budgets.json");
  write_text(bpath, budgets_text);
  char args[1024];
  snprintf(args, sizeof args,
           "--budgets '%s' --seq-len 8192 --granularity 64 --world 4 --ranks-per-node 2 --json",
           bpath);
  json_t *all = run_json(args);
  const json_t *layouts = json_object_get(all, "layouts");
  assert_int_equal(json_array_size(layouts), 4);
  assert_null(json_object_get(all, "ring_sync_slowdown")); /* several layouts: in the list */
  /* the same workload through the library */
  mtrain_budgets_t *b = NULL;
  assert_int_equal(mtrain_budgets_parse(budgets_text, "inline", &b), MTRAIN_SUCCESS);
  mtrain_position_model_t m = MTRAIN_POSITION_MODEL_INIT;
  mtrain_pattern_t *pats[2];
  for (int l = 0; l < 2; l++)
    assert_int_equal(mtrain_pattern_from_budgets(b, l, 8192, 64, &m, &pats[l]), MTRAIN_SUCCESS);
  double sync[4] = {0};
  for (int k = 0; k < 4; k++) {
    const json_t *e = json_array_get(layouts, (size_t)k);
    assert_string_equal(json_string_value(json_object_get(e, "layout")),
                        mtrain_layout_kind_name((mtrain_layout_kind_t)k));
    mtrain_cost_t *c = library_cost((mtrain_layout_kind_t)k, 8192, 64, 4, 2, pats, 2);
    mtrain_cost_metrics_t want;
    assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &want), MTRAIN_SUCCESS);
    sync[k] = num(e, "ring_sync_slowdown");
    assert_true(CLOSE(sync[k], want.ring_sync_slowdown));
    assert_true(CLOSE(num(e, "worker_imbalance"), want.worker_imbalance));
    const json_t *heads = json_object_get(e, "head_ring_sync_slowdown");
    assert_int_equal(json_array_size(heads), 4); /* 2 layers x 2 heads */
    for (int32_t h = 0; h < 4; h++) {
      const double v = json_number_value(json_array_get(heads, (size_t)h));
      assert_true(v >= 1.0);
      assert_true(CLOSE(v, mtrain_cost_head_ring_sync(c, MTRAIN_RING_FLAT, h)));
    }
    mtrain_cost_metrics_t hier;
    assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_HIERARCHICAL, &hier), MTRAIN_SUCCESS);
    assert_true(CLOSE(num(json_object_get(e, "hierarchical"), "ring_sync_slowdown"),
                      hier.ring_sync_slowdown));
    const json_t *t = json_object_get(json_object_get(e, "time"), "flat");
    assert_true(num(t, "forward_s") > 0 && num(t, "backward_s") > num(t, "forward_s"));
    mtrain_cost_destroy(c);
  }
  assert_true(sync[MTRAIN_LAYOUT_BALANCED] <= sync[MTRAIN_LAYOUT_STRIPED]);
  json_decref(all);

  /* one layout: its figures at the top level too */
  snprintf(args, sizeof args,
           "--budgets '%s' --seq-len 8192 --granularity 64 --world 4 --layout striped --json",
           bpath);
  json_t *one = run_json(args);
  assert_string_equal(json_string_value(json_object_get(one, "layout")), "striped");
  assert_true(num(one, "ring_sync_slowdown") >= 1.0);
  assert_true(num(one, "worker_imbalance") >= 1.0);
  assert_int_equal(json_array_size(json_object_get(one, "head_ring_sync_slowdown")), 4);
  assert_int_equal(num(json_object_get(one, "cluster"), "ranks_per_node"), 4); /* 4 % 8 != 0 */
  json_decref(one);
  for (int l = 0; l < 2; l++) mtrain_pattern_destroy(pats[l]);
  mtrain_budgets_destroy(b);
}

static void test_pattern_input_and_png(void **state) {
  (void)state;
  mtrain_pattern_t *p = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, 1000, 3, 16, ts_seed(8));
  const char *ppath = tmp_path("balance_pattern.json");
  const char *png = tmp_path("balance.png");
  assert_int_equal(mtrain_pattern_write_json(ppath, p), MTRAIN_SUCCESS);
  remove(png);
  char args[1024];
  snprintf(args, sizeof args, "--pattern '%s' --world 3 --layout zigzag --json --png '%s'", ppath,
           png);
  json_t *j = run_json(args);
  assert_int_equal(num(json_object_get(j, "input"), "heads"), 3);
  assert_int_equal(num(j, "padded_len"), 1056); /* 1000 up to a multiple of 2 * 16 * 3 */
  mtrain_cost_t *c = library_cost(MTRAIN_LAYOUT_ZIGZAG, 1000, 16, 3, 0, &p, 1);
  mtrain_cost_metrics_t want;
  assert_int_equal(mtrain_cost_metrics(c, MTRAIN_RING_FLAT, &want), MTRAIN_SUCCESS);
  assert_true(CLOSE(num(j, "ring_sync_slowdown"), want.ring_sync_slowdown));
  mtrain_cost_destroy(c);
  json_decref(j);
  FILE *f = fopen(png, "rb");
  assert_non_null(f);
  unsigned char sig[8] = {0};
  assert_int_equal(fread(sig, 1, 8, f), 8);
  fclose(f);
  const unsigned char want_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  assert_memory_equal(sig, want_sig, 8);
  /* the table form and one head's picture */
  char *out = NULL;
  snprintf(args, sizeof args, "--pattern '%s' --world 3 --head 0,2 --steps --png '%s'", ppath, png);
  assert_int_equal(run_tool(args, 1, &out), 0);
  assert_non_null(strstr(out, "ring-sync"));
  assert_non_null(strstr(out, "layer 0 head 2 work"));
  free(out);
  mtrain_pattern_destroy(p);
}

static void test_usage_errors(void **state) {
  (void)state;
  char *out = NULL;
  assert_int_equal(run_tool("--help", 1, &out), 0);
  assert_non_null(strstr(out, "position model"));
  free(out);
  assert_int_equal(run_tool("--world 4", 1, &out), 2);
  assert_non_null(strstr(out, "--budgets FILE or --pattern FILE"));
  free(out);
  const char *bpath = tmp_path("balance_budgets.json");
  write_text(bpath, budgets_text);
  char args[1024];
  snprintf(args, sizeof args, "--budgets '%s' --seq-len 4096 --layout diagonal", bpath);
  assert_int_equal(run_tool(args, 1, &out), 2);
  assert_non_null(strstr(out, "'diagonal'"));
  free(out);
  snprintf(args, sizeof args, "--budgets '%s' --seq-len 4096 --world 4 --ranks-per-node 3", bpath);
  assert_int_equal(run_tool(args, 1, &out), 2);
  assert_non_null(strstr(out, "--ranks-per-node 3"));
  free(out);
  assert_int_equal(run_tool("--budgets /nonexistent/b.json --seq-len 4096", 1, &out), 1);
  assert_non_null(strstr(out, "/nonexistent/b.json"));
  free(out);
  snprintf(args, sizeof args, "--budgets '%s' --seq-len 4096 --head 5,0", bpath);
  assert_int_equal(run_tool(args, 1, &out), 1);
  assert_non_null(strstr(out, "--head 5,0"));
  free(out);
}

/* mtrain-balance batch --row-pairs: every head priced by the measured table, interpolated in
 * log N (2000 tokens lie halfway from 1000 to 4000: 4.5 pairs per row at the base level; 3000
 * at log 3 / log 4), summed by the tool as the library does; a table that does not fit the
 * budgets and a table with --spread are refused. */
static void test_batch_row_pairs(void **state) {
  (void)state;
  const char *b = tmp_path("rp_budgets.json"), *t = tmp_path("rp_table.json");
  const char *l = tmp_path("rp_lengths.txt"), *c = tmp_path("rp_cal.json");
  write_text(b, budgets_text);
  write_text(t, "{\"format\": \"mtrain-row-pairs-1\", \"levels\": [0.25, 0.5, 0.75, 1, 1.5, "
                "2], \"granularity\": 128, \"heads\": 2, \"num_layers\": 2, \"lengths\": "
                "[1000, 4000], \"layers_done\": {\"0\": [[[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, "
                "6]], [[2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7]]], \"1\": [[[1, 2, 3, 4, 5, 6], [1, "
                "2, 3, 4, 5, 6]], [[2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7]]]}}");
  write_text(l, "2000\n3000\n");
  write_text(c, "{\"pair_s\": 1e-9, \"row_s\": 0, \"seq_s\": 0, \"linear_flops\": 1e12}");
  char args[2048];
  snprintf(args, sizeof args,
           "batch --budgets '%s' --calibration '%s' --lengths '%s' --world 1 --hidden 0 "
           "--row-pairs '%s' --json",
           b, c, l, t);
  json_t *root = run_json(args);
  const double got = json_number_value(json_array_get(
      json_object_get(json_object_get(json_object_get(root, "methods"), "tokens"), "rank_seconds"),
      0));
  const double t2000 = log(2.0) / log(4.0), t3000 = log(3.0) / log(4.0);
  const double pairs = 4 * (floor((4 + t2000) * 2000 + 0.5) + floor((4 + t3000) * 3000 + 0.5));
  assert_true(fabs(got - 1e-9 * pairs) <= 1e-12 * got);
  json_decref(root);
  char *out = NULL;
  snprintf(args, sizeof args,
           "batch --budgets '%s' --calibration '%s' --lengths '%s' --world 1 --row-pairs '%s' "
           "--levels 0.5,1,2",
           b, c, l, t);
  assert_int_equal(run_tool(args, 1, &out), 1);
  assert_non_null(strstr(out, "\"levels\" must list the predictor's 3 levels"));
  free(out);
  snprintf(args, sizeof args,
           "batch --budgets '%s' --calibration '%s' --lengths '%s' --world 1 --row-pairs '%s' "
           "--spread local",
           b, c, l, t);
  assert_int_equal(run_tool(args, 1, &out), 2);
  assert_non_null(strstr(out, "--spread do not apply"));
  free(out);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_json_matches_library),
      cmocka_unit_test(test_pattern_input_and_png),
      cmocka_unit_test(test_usage_errors),
      cmocka_unit_test(test_batch_row_pairs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
