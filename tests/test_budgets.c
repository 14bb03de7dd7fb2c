/* test_budgets.c: the MInference budget files (SPEC.md sections 2 and 8):
 * the four real files of the data folder (layer and head counts, values
 * spot-checked against the files, checksums), layers of different sizes,
 * one test per class of malformed input (status, and a message naming the
 * origin, the place and the reason), a missing file, get() out of range and
 * mtrain_head_budget_validate(). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "test_support.h"

#define QWEN_STATIC "Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"
#define QWEN_FLEX_90 "Qwen2.5_3B_flex_0.90.json"
#define QWEN_FLEX_95 "Qwen2.5_3B_flex_0.95.json"
#define LLAMA_STATIC "Llama_3.1_8B_Instruct_128k_kv_out_v32_fit_o_best_pattern.json"

/* Valid entries to build documents from. */
#define K "[\"vertical_and_slash\", 10, 20, 0.5]"
#define P "[\"flex_vertical_and_slash\", [0.9, 4096], [0.95, 100], 0.0]"

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

/* One layer with head "0" holding `entry`. */
static const char *one_entry(const char *entry) {
  static char buf[1024];
  snprintf(buf, sizeof buf, "[{\"0\": %s}]", entry);
  return buf;
}

/* Parses `text` as "bad.json" expecting `want` and a message naming the
 * origin, `place` and `reason`; the output must stay untouched. */
#define CHECK_BAD(text, want, place, reason) check_bad((text), (want), (place), (reason), __LINE__)
static void check_bad(const char *text, mtrain_status_t want, const char *place, const char *reason,
                      int line) {
  mtrain_budgets_t *sentinel = (mtrain_budgets_t *)&want, *b = sentinel;
  mtrain_status_t st = mtrain_budgets_parse(text, "bad.json", &b);
  ts_assert_status(st, want, "bad.json: ", __FILE__, line);
  if (place) ts_assert_status(st, want, place, __FILE__, line);
  if (reason) ts_assert_status(st, want, reason, __FILE__, line);
  if (b != sentinel) fail_msg("%s:%d: output changed on failure", __FILE__, line);
}

static mtrain_budgets_t *parse_ok(const char *text) {
  mtrain_budgets_t *b = NULL;
  TS_ASSERT_STATUS(mtrain_budgets_parse(text, "good.json", &b), MTRAIN_SUCCESS, NULL);
  assert_non_null(b);
  return b;
}

static mtrain_budgets_t *read_real(const char *file) {
  mtrain_budgets_t *b = NULL;
  TS_ASSERT_STATUS(mtrain_budgets_read(ts_data_path(file), &b), MTRAIN_SUCCESS, NULL);
  assert_non_null(b);
  return b;
}

static mtrain_head_budget_t get_ok(const mtrain_budgets_t *b, int32_t layer, int32_t head) {
  mtrain_head_budget_t hb;
  memset(&hb, 0xAB, sizeof hb);
  TS_ASSERT_STATUS(mtrain_budgets_get(b, layer, head, &hb), MTRAIN_SUCCESS, NULL);
  return hb;
}

static void assert_top_k(const mtrain_budgets_t *b, int32_t layer, int32_t head, int64_t v,
                         int64_t s) {
  mtrain_head_budget_t hb = get_ok(b, layer, head);
  assert_int_equal(hb.kind, MTRAIN_BUDGET_TOP_K);
  assert_int_equal(hb.v_size, v);
  assert_int_equal(hb.s_size, s);
}

static void assert_top_p(const mtrain_budgets_t *b, int32_t layer, int32_t head, double p_v,
                         int64_t cap_v, double p_s, int64_t cap_s) {
  mtrain_head_budget_t hb = get_ok(b, layer, head);
  assert_int_equal(hb.kind, MTRAIN_BUDGET_TOP_P);
  assert_true(hb.p_v == p_v);
  assert_int_equal(hb.cap_v, cap_v);
  assert_true(hb.p_s == p_s);
  assert_int_equal(hb.cap_s, cap_s);
}

/* Every layer has `heads` heads of `kind`, each valid. */
static void assert_shape(const mtrain_budgets_t *b, int32_t layers, int32_t heads,
                         mtrain_budget_kind_t kind) {
  assert_int_equal(mtrain_budgets_num_layers(b), layers);
  for (int32_t l = 0; l < layers; l++) {
    assert_int_equal(mtrain_budgets_num_heads(b, l), heads);
    for (int32_t h = 0; h < heads; h++) {
      mtrain_head_budget_t hb = get_ok(b, l, h);
      assert_int_equal(hb.kind, kind);
      TS_ASSERT_STATUS(mtrain_head_budget_validate(&hb), MTRAIN_SUCCESS, NULL);
    }
  }
}

/* Sums of v_size and s_size over all heads (top-k files). */
static void assert_sums(const mtrain_budgets_t *b, int64_t sum_v, int64_t sum_s) {
  int64_t v = 0, s = 0;
  for (int32_t l = 0; l < mtrain_budgets_num_layers(b); l++)
    for (int32_t h = 0; h < mtrain_budgets_num_heads(b, l); h++) {
      mtrain_head_budget_t hb = get_ok(b, l, h);
      v += hb.v_size;
      s += hb.s_size;
    }
  assert_int_equal(v, sum_v);
  assert_int_equal(s, sum_s);
}

/* ------------------------------------------------------------------------ */
/* The real files (values read with python3's json module)                   */
/* ------------------------------------------------------------------------ */

static void test_real_qwen_static(void **state) {
  (void)state;
  mtrain_budgets_t *b = read_real(QWEN_STATIC);
  assert_shape(b, 36, 16, MTRAIN_BUDGET_TOP_K);
  assert_top_k(b, 0, 0, 1000, 6096);
  assert_top_k(b, 0, 12, 30, 800);
  assert_top_k(b, 3, 10, 3500, 100);
  assert_top_k(b, 5, 13, 100, 800);
  assert_top_k(b, 9, 6, 500, 700);
  assert_top_k(b, 31, 11, 100, 750);
  assert_top_k(b, 35, 9, 500, 700);
  assert_top_k(b, 35, 15, 100, 750);
  assert_sums(b, 700480, 2025860);
  mtrain_budgets_destroy(b);
}

static void test_real_llama_static(void **state) {
  (void)state;
  mtrain_budgets_t *b = read_real(LLAMA_STATIC);
  assert_shape(b, 32, 32, MTRAIN_BUDGET_TOP_K);
  assert_top_k(b, 0, 0, 1000, 6096);
  assert_top_k(b, 0, 16, 30, 800);
  assert_top_k(b, 0, 29, 3500, 100);
  assert_top_k(b, 2, 6, 100, 800);
  assert_top_k(b, 3, 14, 500, 700);
  assert_top_k(b, 17, 5, 500, 700);
  assert_top_k(b, 29, 24, 100, 750);
  assert_top_k(b, 31, 31, 100, 800);
  assert_sums(b, 895850, 2180284);
  mtrain_budgets_destroy(b);
}

static void test_real_qwen_flex(void **state) {
  (void)state;
  static const struct {
    const char *file;
    double p;
  } cases[] = {{QWEN_FLEX_90, 0.9}, {QWEN_FLEX_95, 0.95}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    mtrain_budgets_t *b = read_real(cases[i].file);
    assert_shape(b, 36, 16, MTRAIN_BUDGET_TOP_P);
    for (int32_t l = 0; l < 36; l++)
      for (int32_t h = 0; h < 16; h++) assert_top_p(b, l, h, cases[i].p, 4096, cases[i].p, 4096);
    mtrain_budgets_destroy(b);
  }
}

/* ------------------------------------------------------------------------ */
/* Valid documents                                                           */
/* ------------------------------------------------------------------------ */

/* Layers of different head counts, both kinds, keys in any order, p = 1 as
 * an integer, integer scores, zero sizes and 2^40 accepted. */
static void test_layers_of_different_sizes(void **state) {
  (void)state;
  mtrain_budgets_t *b = parse_ok("[{\"0\": " K "},\n"
                                 " {\"2\": " P ", \"0\": [\"vertical_and_slash\", 0, 0, 1],\n"
                                 "  \"1\": [\"flex_vertical_and_slash\", [1, 0], [1e-3, 7], 2]},\n"
                                 " {\"1\": [\"vertical_and_slash\", 1099511627776, 5, -3.5],\n"
                                 "  \"0\": [\"vertical_and_slash\", 3, 1099511627776, 0]}]");
  assert_int_equal(mtrain_budgets_num_layers(b), 3);
  assert_int_equal(mtrain_budgets_num_heads(b, 0), 1);
  assert_int_equal(mtrain_budgets_num_heads(b, 1), 3);
  assert_int_equal(mtrain_budgets_num_heads(b, 2), 2);
  assert_top_k(b, 0, 0, 10, 20);
  assert_top_k(b, 1, 0, 0, 0);
  assert_top_p(b, 1, 1, 1.0, 0, 1e-3, 7);
  assert_top_p(b, 1, 2, 0.9, 4096, 0.95, 100);
  assert_top_k(b, 2, 0, 3, INT64_C(1099511627776));
  assert_top_k(b, 2, 1, INT64_C(1099511627776), 5);
  mtrain_budgets_destroy(b);
  /* 10 heads: "10" is not a prefix trap for "1". */
  char text[2048];
  int n = snprintf(text, sizeof text, "[{");
  for (int h = 10; h >= 0; h--)
    n +=
        snprintf(text + n, sizeof text - (size_t)n, "%s\"%d\": [\"vertical_and_slash\", %d, %d, 0]",
                 h == 10 ? "" : ", ", h, h, 100 + h);
  snprintf(text + n, sizeof text - (size_t)n, "}]");
  b = parse_ok(text);
  assert_int_equal(mtrain_budgets_num_heads(b, 0), 11);
  for (int32_t h = 0; h <= 10; h++) assert_top_k(b, 0, h, h, 100 + h);
  mtrain_budgets_destroy(b);
}

/* ------------------------------------------------------------------------ */
/* Malformed documents, one class per test                                   */
/* ------------------------------------------------------------------------ */

static void test_syntax_error(void **state) {
  (void)state;
  CHECK_BAD("[{\"0\": [\"vertical_and_slash\", 1, 2, 0.5]", MTRAIN_ERR_FORMAT, "line 1",
            "syntax error");
  CHECK_BAD("[{\"0\": " K "}]\n]", MTRAIN_ERR_FORMAT, "line 2", "syntax error");
  CHECK_BAD("", MTRAIN_ERR_FORMAT, NULL, "syntax error");
  /* NaN is not JSON, so p = NaN can only reach validate(). */
  CHECK_BAD(one_entry("[\"flex_vertical_and_slash\", [NaN, 1], [0.5, 1], 0]"), MTRAIN_ERR_FORMAT,
            NULL, "syntax error");
  /* A NULL origin is named "<string>". */
  mtrain_budgets_t *b = NULL;
  TS_ASSERT_STATUS(mtrain_budgets_parse("[", NULL, &b), MTRAIN_ERR_FORMAT, "<string>: ");
  assert_null(b);
}

static void test_not_a_list(void **state) {
  (void)state;
  CHECK_BAD("{\"0\": " K "}", MTRAIN_ERR_FORMAT, "top level", "expected a list");
  CHECK_BAD("{\"0\": " K "}", MTRAIN_ERR_FORMAT, NULL, "found an object");
  CHECK_BAD("\"layers\"", MTRAIN_ERR_FORMAT, "top level", "found a string");
  CHECK_BAD("36", MTRAIN_ERR_FORMAT, "top level", "found an integer");
}

static void test_empty_list(void **state) {
  (void)state;
  CHECK_BAD("[]", MTRAIN_ERR_FORMAT, "top level", "empty list");
  CHECK_BAD(" [ ] ", MTRAIN_ERR_FORMAT, "top level", "empty list");
}

static void test_layer_not_an_object(void **state) {
  (void)state;
  CHECK_BAD("[{\"0\": " K "}, [" K "]]", MTRAIN_ERR_FORMAT, "layer 1: ", "expected an object");
  CHECK_BAD("[{\"0\": " K "}, {\"0\": " K "}, null]", MTRAIN_ERR_FORMAT, "layer 2: ", "found null");
  CHECK_BAD("[" K "]", MTRAIN_ERR_FORMAT, "layer 0: ", "found an array");
}

static void test_empty_layer(void **state) {
  (void)state;
  CHECK_BAD("[{}]", MTRAIN_ERR_FORMAT, "layer 0: ", "empty");
  CHECK_BAD("[{\"0\": " K "}, {}]", MTRAIN_ERR_FORMAT, "layer 1: ", "empty");
}

static void test_missing_head_key(void **state) {
  (void)state;
  const char *text =
      "[{\"0\": " K ", \"1\": " K ", \"2\": " K ", \"3\": " K ", \"4\": " K ", \"6\": " K "}]";
  CHECK_BAD(text, MTRAIN_ERR_FORMAT, "layer 0: ", "head \"5\" is missing");
  CHECK_BAD(text, MTRAIN_ERR_FORMAT, NULL, "key \"6\"");
  CHECK_BAD("[{\"0\": " K "}, {\"1\": " K "}]", MTRAIN_ERR_FORMAT,
            "layer 1: ", "head \"0\" is missing");
}

static void test_extra_head_key(void **state) {
  (void)state;
  CHECK_BAD("[{\"0\": " K ", \"1\": " K ", \"x\": " K "}]", MTRAIN_ERR_FORMAT,
            "layer 0: ", "key \"x\" is not one of the head indices \"0\"..\"2\"");
  CHECK_BAD("[{\"0\": " K ", \"1\": " K ", \"x\": " K "}]", MTRAIN_ERR_FORMAT, NULL,
            "head \"2\" is missing");
  CHECK_BAD("[{\"0\": " K ", \"head\": " K "}]", MTRAIN_ERR_FORMAT, "layer 0: ", "key \"head\"");
}

/* Keys that denote a head index but are not its plain decimal spelling. */
static void test_noncanonical_head_key(void **state) {
  (void)state;
  static const char *const keys[] = {"07", "+7", "-7", " 7", "7 ", "7.0", "0x7", "", "00"};
  char text[1024], want[32];
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    int n = snprintf(text, sizeof text, "[{");
    for (int h = 0; h < 7; h++)
      n += snprintf(text + n, sizeof text - (size_t)n, "\"%d\": " K ", ", h);
    snprintf(text + n, sizeof text - (size_t)n, "\"%s\": " K "}]", keys[i]);
    snprintf(want, sizeof want, "key \"%s\"", keys[i]);
    CHECK_BAD(text, MTRAIN_ERR_FORMAT, "layer 0: ", want);
    CHECK_BAD(text, MTRAIN_ERR_FORMAT, NULL, "head \"7\" is missing");
  }
}

static void test_duplicate_head_key(void **state) {
  (void)state;
  CHECK_BAD("[{\"0\": " K ", \"0\": " K "}]", MTRAIN_ERR_FORMAT, "line 1", "duplicate");
  CHECK_BAD("[{\"0\": " K "}, {\"0\": " K ", \"1\": " K ", \"1\": " P "}]", MTRAIN_ERR_FORMAT,
            "bad.json: ", "duplicate");
}

static void test_entry_not_a_list(void **state) {
  (void)state;
  CHECK_BAD("[{\"0\": " K ", \"1\": " K ", \"2\": {\"kind\": \"vertical_and_slash\"}}]",
            MTRAIN_ERR_FORMAT, "layer 0, head \"2\": ", "found an object");
  CHECK_BAD(one_entry("1000"), MTRAIN_ERR_FORMAT, "layer 0, head \"0\": ", "expected a list");
  CHECK_BAD(one_entry("\"vertical_and_slash\""), MTRAIN_ERR_FORMAT,
            "layer 0, head \"0\": ", "found a string");
}

static void test_entry_wrong_length(void **state) {
  (void)state;
  CHECK_BAD(one_entry("[\"vertical_and_slash\", 10, 20]"), MTRAIN_ERR_FORMAT,
            "layer 0, head \"0\": ", "found 3 entries");
  CHECK_BAD(one_entry("[\"vertical_and_slash\", 10, 20, 0.5, 1]"), MTRAIN_ERR_FORMAT,
            "layer 0, head \"0\": ", "found 5 entries");
  CHECK_BAD(one_entry("[]"), MTRAIN_ERR_FORMAT, "layer 0, head \"0\": ", "found 0 entries");
  CHECK_BAD(one_entry("[\"flex_vertical_and_slash\", [0.9, 4096], [0.9, 4096]]"), MTRAIN_ERR_FORMAT,
            "layer 0, head \"0\": ", "expected a list of 4 entries");
}

static void test_unknown_kind(void **state) {
  (void)state;
  CHECK_BAD("[{\"0\": " K "}, {\"0\": [\"vertical_slash\", 10, 20, 0.5]}]", MTRAIN_ERR_FORMAT,
            "layer 1, head \"0\"[0]: ", "unknown kind 'vertical_slash'");
  CHECK_BAD(one_entry("[\"\", 10, 20, 0.5]"), MTRAIN_ERR_FORMAT,
            "layer 0, head \"0\"[0]: ", "unknown kind ''");
  CHECK_BAD(one_entry("[\"Vertical_And_Slash\", 10, 20, 0.5]"), MTRAIN_ERR_FORMAT,
            "layer 0, head \"0\"[0]: ", "unknown kind");
}

static void test_wrong_element_types(void **state) {
  (void)state;
  static const struct {
    const char *entry, *place, *reason;
  } cases[] = {
      {"[1, 10, 20, 0.5]", "head \"0\"[0]: ", "kind string"},
      {"[null, 10, 20, 0.5]", "head \"0\"[0]: ", "found null"},
      {"[\"vertical_and_slash\", \"10\", 20, 0.5]", "head \"0\"[1]: ", "v_size"},
      {"[\"vertical_and_slash\", 10.5, 20, 0.5]", "head \"0\"[1]: ", "non-integer number"},
      {"[\"vertical_and_slash\", 10, 20.0, 0.5]", "head \"0\"[2]: ", "s_size"},
      {"[\"vertical_and_slash\", 10, true, 0.5]", "head \"0\"[2]: ", "found a boolean"},
      {"[\"vertical_and_slash\", [0.9, 10], 20, 0.5]", "head \"0\"[1]: ", "found an array"},
      {"[\"vertical_and_slash\", 10, 20, \"0.5\"]", "head \"0\"[3]: ", "score"},
      {"[\"vertical_and_slash\", 10, 20, null]", "head \"0\"[3]: ", "score"},
      {"[\"flex_vertical_and_slash\", 0.9, [0.9, 4096], 0.0]", "head \"0\"[1]: ", "pair"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096], [0.9], 0.0]",
       "head \"0\"[2]: ", "found a list of 1 entries"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096, 1], [0.9, 4096], 0.0]",
       "head \"0\"[1]: ", "pair"},
      {"[\"flex_vertical_and_slash\", [\"0.9\", 4096], [0.9, 4096], 0.0]",
       "head \"0\"[1][0]: ", "p_v"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096], [null, 4096], 0.0]",
       "head \"0\"[2][0]: ", "p_s"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096.0], [0.9, 4096], 0.0]",
       "head \"0\"[1][1]: ", "cap_v"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096], [0.9, \"all\"], 0.0]",
       "head \"0\"[2][1]: ", "cap_s"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096], [0.9, 4096], {}]", "head \"0\"[3]: ", "score"},
      {"[\"flex_vertical_and_slash\", 10, 20, 0.0]", "head \"0\"[1]: ", "found an integer"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    CHECK_BAD(one_entry(cases[i].entry), MTRAIN_ERR_FORMAT, cases[i].place, cases[i].reason);
}

static void test_negative_sizes(void **state) {
  (void)state;
  CHECK_BAD("[{\"0\": " K ", \"1\": [\"vertical_and_slash\", -1, 20, 0.5]}]",
            MTRAIN_ERR_INVALID_BUDGET, "layer 0, head \"1\"[1]: ", "v_size -1 is negative");
  CHECK_BAD("[{\"0\": " K "}, {\"0\": " K "}, {\"0\": " K ", \"1\": " K
            ", \"2\": [\"vertical_and_slash\", 10, -5, 0.5]}]",
            MTRAIN_ERR_INVALID_BUDGET, "layer 2, head \"2\"[2]: ", "s_size -5 is negative");
}

static void test_p_out_of_range(void **state) {
  (void)state;
  static const struct {
    const char *entry, *place, *reason;
  } cases[] = {
      {"[\"flex_vertical_and_slash\", [0, 4096], [0.9, 4096], 0.0]",
       "[1][0]: ", "p_v 0 is not in (0, 1]"},
      {"[\"flex_vertical_and_slash\", [0.0, 4096], [0.9, 4096], 0.0]", "[1][0]: ", "p_v 0"},
      {"[\"flex_vertical_and_slash\", [-0.1, 4096], [0.9, 4096], 0.0]",
       "[1][0]: ", "p_v -0.1 is not in (0, 1]"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096], [1.5, 4096], 0.0]",
       "[2][0]: ", "p_s 1.5 is not in (0, 1]"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096], [1.0000001, 4096], 0.0]",
       "[2][0]: ", "p_s 1.0000001 is not"},
      {"[\"flex_vertical_and_slash\", [0.9, 4096], [2, 4096], 0.0]", "[2][0]: ", "p_s 2 is not"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    CHECK_BAD(one_entry(cases[i].entry), MTRAIN_ERR_INVALID_BUDGET, cases[i].place,
              cases[i].reason);
  CHECK_BAD(one_entry("[\"flex_vertical_and_slash\", [0, 4096], [0.9, 4096], 0.0]"),
            MTRAIN_ERR_INVALID_BUDGET, "layer 0, head \"0\"[1][0]: ", NULL);
}

static void test_negative_caps(void **state) {
  (void)state;
  CHECK_BAD(one_entry("[\"flex_vertical_and_slash\", [0.9, -1], [0.9, 4096], 0.0]"),
            MTRAIN_ERR_INVALID_BUDGET, "layer 0, head \"0\"[1][1]: ", "cap_v -1 is negative");
  CHECK_BAD("[{\"0\": " P "}, {\"0\": " P ", \"1\": "
            "[\"flex_vertical_and_slash\", [0.9, 4096], [0.9, -4096], 0.0]}]",
            MTRAIN_ERR_INVALID_BUDGET, "layer 1, head \"1\"[2][1]: ", "cap_s -4096 is negative");
}

static void test_sizes_beyond_2_40(void **state) {
  (void)state;
  CHECK_BAD(one_entry("[\"vertical_and_slash\", 1099511627777, 20, 0.5]"),
            MTRAIN_ERR_INVALID_BUDGET, "layer 0, head \"0\"[1]: ", "v_size 1099511627777");
  CHECK_BAD(one_entry("[\"vertical_and_slash\", 10, 9223372036854775807, 0.5]"),
            MTRAIN_ERR_INVALID_BUDGET, "layer 0, head \"0\"[2]: ", "beyond 2^40");
  CHECK_BAD(one_entry("[\"flex_vertical_and_slash\", [0.9, 1099511627777], [0.9, 1], 0.0]"),
            MTRAIN_ERR_INVALID_BUDGET, "layer 0, head \"0\"[1][1]: ", "cap_v 1099511627777");
  CHECK_BAD(one_entry("[\"flex_vertical_and_slash\", [0.9, 1], [0.9, 4611686018427387904], 0]"),
            MTRAIN_ERR_INVALID_BUDGET, "layer 0, head \"0\"[2][1]: ", "beyond 2^40");
  /* Beyond 64 bits jansson itself refuses the number. */
  CHECK_BAD(one_entry("[\"vertical_and_slash\", 99999999999999999999, 20, 0.5]"), MTRAIN_ERR_FORMAT,
            "line 1", NULL);
}

/* ------------------------------------------------------------------------ */
/* Files                                                                     */
/* ------------------------------------------------------------------------ */

static void test_missing_file(void **state) {
  (void)state;
  const char *path = MTRAIN_TEST_TMPDIR "/no_such_dir/no_such_budgets.json";
  mtrain_budgets_t *sentinel = (mtrain_budgets_t *)&path, *b = sentinel;
  TS_ASSERT_STATUS(mtrain_budgets_read(path, &b), MTRAIN_ERR_IO, path);
  TS_ASSERT_STATUS(mtrain_budgets_read(path, &b), MTRAIN_ERR_IO, "cannot open");
  assert_ptr_equal(b, sentinel);
  /* A folder opens but cannot be read. */
  TS_ASSERT_STATUS(mtrain_budgets_read(MTRAIN_PATTERN_DATA_DIR, &b), MTRAIN_ERR_IO,
                   MTRAIN_PATTERN_DATA_DIR);
  assert_ptr_equal(b, sentinel);
}

/* Errors in a file name the file. */
static void test_bad_file_names_path(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/budgets_bad.json", MTRAIN_TEST_TMPDIR);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fputs("[{\"0\": " K "},\n {\"0\": [\"vertical_and_slash\", -3, 20, 0.5]}]\n", f);
  assert_int_equal(fclose(f), 0);
  mtrain_budgets_t *sentinel = (mtrain_budgets_t *)&f, *b = sentinel;
  mtrain_status_t st = mtrain_budgets_read(path, &b);
  remove(path);
  TS_ASSERT_STATUS(st, MTRAIN_ERR_INVALID_BUDGET, path);
  TS_ASSERT_STATUS(st, MTRAIN_ERR_INVALID_BUDGET, "layer 1, head \"0\"[1]: v_size -3");
  assert_ptr_equal(b, sentinel);
}

/* ------------------------------------------------------------------------ */
/* Access                                                                    */
/* ------------------------------------------------------------------------ */

static void test_get_out_of_range(void **state) {
  (void)state;
  mtrain_budgets_t *b = read_real(QWEN_STATIC);
  mtrain_head_budget_t hb, before;
  memset(&hb, 0x5C, sizeof hb);
  before = hb;
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 36, 0, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "layer 36");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 36, 0, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "[0, 36)");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, -1, 0, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "layer -1");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, INT32_MAX, 0, &hb), MTRAIN_ERR_INVALID_ARGUMENT,
                   "[0, 36)");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 3, 16, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "head 16");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 3, 16, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "[0, 16)");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 3, -1, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "head -1");
  assert_memory_equal(&hb, &before, sizeof hb);
  TS_ASSERT_STATUS(mtrain_budgets_get(NULL, 0, 0, &hb), MTRAIN_ERR_NULL_POINTER, "budgets");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 0, 0, NULL), MTRAIN_ERR_NULL_POINTER, "out");
  assert_int_equal(mtrain_budgets_num_heads(b, 36), 0);
  assert_int_equal(mtrain_budgets_num_heads(b, -1), 0);
  assert_int_equal(mtrain_budgets_num_heads(NULL, 0), 0);
  assert_int_equal(mtrain_budgets_num_layers(NULL), 0);
  mtrain_budgets_destroy(b);

  /* The head range is the layer's own. */
  b = parse_ok("[{\"0\": " K "}, {\"0\": " K ", \"1\": " K ", \"2\": " P "}]");
  assert_top_p(b, 1, 2, 0.9, 4096, 0.95, 100);
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 0, 1, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "[0, 1)");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 1, 3, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "[0, 3)");
  TS_ASSERT_STATUS(mtrain_budgets_get(b, 2, 0, &hb), MTRAIN_ERR_INVALID_ARGUMENT, "[0, 2)");
  mtrain_budgets_destroy(b);
}

static void test_validate(void **state) {
  (void)state;
  const mtrain_head_budget_t k = {.kind = MTRAIN_BUDGET_TOP_K, .v_size = 1000, .s_size = 6096};
  const mtrain_head_budget_t p = {
      .kind = MTRAIN_BUDGET_TOP_P, .p_v = 0.9, .p_s = 1.0, .cap_v = 4096, .cap_s = 0};
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&k), MTRAIN_SUCCESS, NULL);
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&p), MTRAIN_SUCCESS, NULL);
  mtrain_head_budget_t b;

  b = k;
  b.v_size = -1;
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_ERR_INVALID_BUDGET, "v_size -1");
  b = k;
  b.s_size = INT64_MIN;
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_ERR_INVALID_BUDGET, "s_size");
  b = k;
  b.v_size = 0;
  b.s_size = 0;
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_SUCCESS, NULL);

  static const struct {
    double p_v, p_s;
    const char *needle;
  } bad_p[] = {
      {0.0, 0.9, "p_v 0"},          {-0.5, 0.9, "p_v -0.5"}, {1.0000001, 0.9, "p_v 1"},
      {NAN, 0.9, "p_v nan"},        {0.9, NAN, "p_s nan"},   {0.9, INFINITY, "p_s inf"},
      {0.9, -INFINITY, "p_s -inf"}, {0.9, 0.0, "p_s 0"},
  };
  for (size_t i = 0; i < sizeof bad_p / sizeof bad_p[0]; i++) {
    b = p;
    b.p_v = bad_p[i].p_v;
    b.p_s = bad_p[i].p_s;
    TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_ERR_INVALID_BUDGET, bad_p[i].needle);
    TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_ERR_INVALID_BUDGET, "(0, 1]");
  }
  b = p;
  b.p_v = 1e-300;
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_SUCCESS, NULL);
  b = p;
  b.cap_v = -1;
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_ERR_INVALID_BUDGET, "cap_v -1");
  b = p;
  b.cap_s = -4096;
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_ERR_INVALID_BUDGET, "cap_s -4096");

  b = k;
  b.kind = (mtrain_budget_kind_t)7;
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_ERR_INVALID_BUDGET, "kind 7");
  b.kind = (mtrain_budget_kind_t)-1;
  TS_ASSERT_STATUS(mtrain_head_budget_validate(&b), MTRAIN_ERR_INVALID_BUDGET, "kind -1");
  TS_ASSERT_STATUS(mtrain_head_budget_validate(NULL), MTRAIN_ERR_NULL_POINTER, "budget");
}

static void test_null_arguments(void **state) {
  (void)state;
  mtrain_budgets_destroy(NULL);
  mtrain_budgets_t *b = NULL;
  TS_ASSERT_STATUS(mtrain_budgets_parse(NULL, "x", &b), MTRAIN_ERR_NULL_POINTER, "text");
  TS_ASSERT_STATUS(mtrain_budgets_parse(one_entry(K), "x", NULL), MTRAIN_ERR_NULL_POINTER, "out");
  TS_ASSERT_STATUS(mtrain_budgets_read(NULL, &b), MTRAIN_ERR_NULL_POINTER, "path");
  TS_ASSERT_STATUS(mtrain_budgets_read(ts_data_path(QWEN_STATIC), NULL), MTRAIN_ERR_NULL_POINTER,
                   "out");
  assert_null(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_real_qwen_static),
      cmocka_unit_test(test_real_llama_static),
      cmocka_unit_test(test_real_qwen_flex),
      cmocka_unit_test(test_layers_of_different_sizes),
      cmocka_unit_test(test_syntax_error),
      cmocka_unit_test(test_not_a_list),
      cmocka_unit_test(test_empty_list),
      cmocka_unit_test(test_layer_not_an_object),
      cmocka_unit_test(test_empty_layer),
      cmocka_unit_test(test_missing_head_key),
      cmocka_unit_test(test_extra_head_key),
      cmocka_unit_test(test_noncanonical_head_key),
      cmocka_unit_test(test_duplicate_head_key),
      cmocka_unit_test(test_entry_not_a_list),
      cmocka_unit_test(test_entry_wrong_length),
      cmocka_unit_test(test_unknown_kind),
      cmocka_unit_test(test_wrong_element_types),
      cmocka_unit_test(test_negative_sizes),
      cmocka_unit_test(test_p_out_of_range),
      cmocka_unit_test(test_negative_caps),
      cmocka_unit_test(test_sizes_beyond_2_40),
      cmocka_unit_test(test_missing_file),
      cmocka_unit_test(test_bad_file_names_path),
      cmocka_unit_test(test_get_out_of_range),
      cmocka_unit_test(test_validate),
      cmocka_unit_test(test_null_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
