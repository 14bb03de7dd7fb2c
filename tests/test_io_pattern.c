/* test_io_pattern.c: the pattern JSON reader and writer (SPEC.md section 8):
 * round trips (vertical-slash and block-mask heads, large exact integers),
 * defaults (diagonal 0 added, verticals optional), a real budget file that
 * is not a pattern, and one test per class of malformed input, checking the
 * status and that the message names the origin, the place and the reason. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdint.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_io.h"

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

static void tmp_path(char *buf, size_t cap, const char *name) {
  snprintf(buf, cap, "%s/pattern_%s", MTRAIN_TEST_TMPDIR, name);
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
  assert_int_equal(fclose(f), 0);
}

/* Checks the status and that the message holds each NULL-terminated
 * fragment (the origin among them). */
static void expect_error(mtrain_status_t st, mtrain_status_t want, ...) {
  const char *msg = mtrain_last_error();
  if (st != want)
    fail_msg("status %s, expected %s (message: %s)", mtrain_status_name(st),
             mtrain_status_name(want), msg);
  va_list ap;
  va_start(ap, want);
  for (const char *frag = va_arg(ap, const char *); frag; frag = va_arg(ap, const char *))
    if (!strstr(msg, frag)) fail_msg("message '%s' lacks '%s'", msg, frag);
  va_end(ap);
}

/* Parses `text` (origin "bad.json") expecting `want` and the fragments; the
 * output must stay untouched. */
static void check_bad(const char *text, mtrain_status_t want, const char *frag1,
                      const char *frag2) {
  mtrain_pattern_t *sentinel = (mtrain_pattern_t *)&want, *p = sentinel;
  mtrain_status_t st = mtrain_pattern_parse_json(text, "bad.json", &p);
  expect_error(st, want, "bad.json", frag1, frag2, NULL);
  assert_ptr_equal(p, sentinel);
}

static void assert_heads_equal(const mtrain_pattern_t *a, const mtrain_pattern_t *b, int32_t h) {
  const mtrain_pattern_head_t *x = &a->heads[h], *y = &b->heads[h];
  assert_int_equal(mtrain_pattern_head_is_block_mask(a, h),
                   mtrain_pattern_head_is_block_mask(b, h));
  assert_int_equal(x->num_diagonals, y->num_diagonals);
  assert_int_equal(x->num_verticals, y->num_verticals);
  for (int32_t i = 0; i < x->num_diagonals; i++) assert_int_equal(x->diagonals[i], y->diagonals[i]);
  for (int32_t i = 0; i < x->num_verticals; i++) assert_int_equal(x->verticals[i], y->verticals[i]);
  if (!x->mask_off) return;
  for (int64_t qb = 0; qb <= a->num_blocks; qb++)
    assert_int_equal(x->mask_off[qb], y->mask_off[qb]);
  for (int64_t e = 0; e < x->mask_off[a->num_blocks]; e++)
    assert_int_equal(x->mask_idx[e], y->mask_idx[e]);
}

static void assert_patterns_equal(const mtrain_pattern_t *a, const mtrain_pattern_t *b) {
  assert_int_equal(mtrain_pattern_seq_len(a), mtrain_pattern_seq_len(b));
  assert_int_equal(mtrain_pattern_granularity(a), mtrain_pattern_granularity(b));
  assert_int_equal(mtrain_pattern_num_heads(a), mtrain_pattern_num_heads(b));
  for (int32_t h = 0; h < a->num_heads; h++) assert_heads_equal(a, b, h);
}

static mtrain_pattern_t *parse_ok(const char *text) {
  mtrain_pattern_t *p = NULL;
  mtrain_status_t st = mtrain_pattern_parse_json(text, "ok.json", &p);
  if (st != MTRAIN_SUCCESS) fail_msg("%s", mtrain_last_error());
  return p;
}

static void write_read(const mtrain_pattern_t *p, const char *name, mtrain_pattern_t **back,
                       char *text, size_t cap) {
  char path[512];
  tmp_path(path, sizeof path, name);
  assert_int_equal(mtrain_pattern_write_json(path, p), MTRAIN_SUCCESS);
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  size_t n = fread(text, 1, cap - 1, f);
  text[n] = '\0';
  fclose(f);
  mtrain_status_t st = mtrain_pattern_read_json(path, back);
  if (st != MTRAIN_SUCCESS) fail_msg("%s", mtrain_last_error());
}

/* ------------------------------------------------------------------------ */
/* Round trips and defaults                                                  */
/* ------------------------------------------------------------------------ */

static void test_roundtrip_mixed_heads(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL, *back = NULL;
  assert_int_equal(mtrain_pattern_create(1000, 4, 64, &p), MTRAIN_SUCCESS); /* 16 blocks */
  const int32_t d0[3] = {0, 1, 7};
  const int64_t v0[4] = {0, 1, 2, 900};
  assert_int_equal(mtrain_pattern_set_head(p, 0, d0, 3, v0, 4), MTRAIN_SUCCESS);
  uint8_t mask[16 * 16] = {0};
  mask[1 * 16 + 0] = mask[5 * 16 + 2] = mask[5 * 16 + 3] = mask[15 * 16 + 0] = 1;
  assert_int_equal(mtrain_pattern_set_block_mask(p, 2, mask), MTRAIN_SUCCESS);
  int32_t dense[16];
  for (int32_t t = 0; t < 16; t++) dense[t] = t;
  assert_int_equal(mtrain_pattern_set_head(p, 3, dense, 16, NULL, 0), MTRAIN_SUCCESS);

  char text[8192];
  write_read(p, "mixed.json", &back, text, sizeof text);
  assert_patterns_equal(p, back);
  assert_true(mtrain_pattern_head_is_block_mask(back, 2));
  assert_true(mtrain_pattern_allowed(back, 2, 5 * 64 + 3, 3 * 64 + 10));
  assert_false(mtrain_pattern_allowed(back, 2, 5 * 64 + 3, 4 * 64 + 10));
  int lines = 0;
  for (const char *c = text; *c; c++) lines += *c == '\n';
  assert_int_equal(lines, 4 + 2); /* one line per head */
  assert_non_null(strstr(text, "{\"diagonals\": [0, 1, 7], \"verticals\": [0, 1, 2, 900]}"));
  assert_non_null(strstr(text, "{\"block_mask\": [[0, 0], [1, 0], [1, 1], [2, 2]"));
  mtrain_pattern_destroy(p);
  mtrain_pattern_destroy(back);
}

/* Integers are written and read exactly, beyond 2^53 too. */
static void test_roundtrip_large_integers(void **state) {
  (void)state;
  const int64_t n = ((int64_t)1 << 60) + 5, g = (int64_t)1 << 30; /* 2^30 + 1 blocks */
  mtrain_pattern_t *p = NULL, *back = NULL;
  assert_int_equal(mtrain_pattern_create(n, 1, (int32_t)g, &p), MTRAIN_SUCCESS);
  const int32_t d[2] = {3, 1 << 30};
  const int64_t v[3] = {0, ((int64_t)1 << 53) + 1, n - 1};
  assert_int_equal(mtrain_pattern_set_head(p, 0, d, 2, v, 3), MTRAIN_SUCCESS);
  char text[1024];
  write_read(p, "large.json", &back, text, sizeof text);
  assert_patterns_equal(p, back);
  assert_non_null(strstr(text, "1152921504606846980")); /* 2^60 + 4 */
  assert_non_null(strstr(text, "9007199254740993"));    /* 2^53 + 1 */
  mtrain_pattern_destroy(p);
  mtrain_pattern_destroy(back);
}

static void test_diagonal_zero_added(void **state) {
  (void)state;
  mtrain_pattern_t *p =
      parse_ok("{\"granularity\": 4, \"seq_len\": 40, \"heads\": ["
               "{\"diagonals\": [1, 3], \"verticals\": [5]}, {\"verticals\": [2]},"
               " {}, {\"diagonals\": []}]}");
  const int32_t *d;
  const int64_t *v;
  int32_t nd, nv;
  assert_int_equal(mtrain_pattern_num_heads(p), 4);
  assert_int_equal(mtrain_pattern_get_head(p, 0, &d, &nd, &v, &nv), MTRAIN_SUCCESS);
  assert_int_equal(nd, 3);
  assert_true(d[0] == 0 && d[1] == 1 && d[2] == 3);
  assert_true(nv == 1 && v[0] == 5);
  for (int32_t h = 1; h < 4; h++) {
    assert_int_equal(mtrain_pattern_get_head(p, h, &d, &nd, &v, &nv), MTRAIN_SUCCESS);
    assert_true(nd == 1 && d[0] == 0);
    assert_int_equal(nv, h == 1 ? 1 : 0);
  }
  mtrain_pattern_destroy(p);
}

static void test_block_mask_head(void **state) {
  (void)state;
  mtrain_pattern_t *p = parse_ok("{\"granularity\": 2, \"seq_len\": 6, \"heads\": ["
                                 "{\"block_mask\": [[1, 0], [2, 1]]}, {\"block_mask\": []}]}");
  const mtrain_pattern_head_t *h = &p->heads[0];
  assert_true(mtrain_pattern_head_is_block_mask(p, 0));
  const int64_t off[4] = {0, 1, 3, 5};
  const int32_t idx[5] = {0, 0, 1, 1, 2}; /* diagonal blocks forced on */
  for (int i = 0; i < 4; i++) assert_int_equal(h->mask_off[i], off[i]);
  for (int i = 0; i < 5; i++) assert_int_equal(h->mask_idx[i], idx[i]);
  assert_int_equal(p->heads[1].mask_off[3], 3);
  assert_false(mtrain_pattern_allowed(p, 0, 5, 0));
  assert_true(mtrain_pattern_allowed(p, 0, 5, 2));
  mtrain_pattern_destroy(p);
}

/* A real budget file (a list of per-layer objects) is not a pattern. */
static void test_budget_file_rejected(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/Qwen2.5_3B_flex_0.90.json", MTRAIN_PATTERN_DATA_DIR);
  FILE *f = fopen(path, "rb");
  if (!f) {
    skip();
    return;
  }
  fclose(f);
  mtrain_pattern_t *p = NULL;
  expect_error(mtrain_pattern_read_json(path, &p), MTRAIN_ERR_FORMAT, "Qwen2.5_3B_flex_0.90.json",
               "top level", "expected an object, found an array", NULL);
  assert_null(p);
}

/* ------------------------------------------------------------------------ */
/* Malformed input                                                           */
/* ------------------------------------------------------------------------ */

#define HDR "{\"granularity\": 4, \"seq_len\": 40, \"heads\": "

static void test_syntax_error(void **state) {
  (void)state;
  check_bad("{\"granularity\": 4,\n \"seq_len\": }", MTRAIN_ERR_FORMAT, "syntax error", "line 2");
  check_bad("", MTRAIN_ERR_FORMAT, "syntax error", "line");
  check_bad(HDR "[{}]} trailing", MTRAIN_ERR_FORMAT, "syntax error", "column");
  check_bad(HDR "[{\"verticals\": [100000000000000000000000]}]}", MTRAIN_ERR_FORMAT, "syntax error",
            "too big");
}

static void test_duplicate_key(void **state) {
  (void)state;
  check_bad(HDR "[{\"verticals\": [1], \"verticals\": [2]}]}", MTRAIN_ERR_FORMAT, "duplicate",
            "line 1");
}

static void test_top_level_structure(void **state) {
  (void)state;
  check_bad("[1, 2]", MTRAIN_ERR_FORMAT, "top level", "expected an object, found an array");
  check_bad("{\"seq_len\": 40, \"heads\": [{}]}", MTRAIN_ERR_FORMAT, "missing key", "granularity");
  check_bad("{\"granularity\": 4, \"heads\": [{}]}", MTRAIN_ERR_FORMAT, "missing key", "seq_len");
  check_bad("{\"granularity\": 4, \"seq_len\": 40}", MTRAIN_ERR_FORMAT, "missing key", "heads");
  check_bad(HDR "[{}], \"head\": []}", MTRAIN_ERR_FORMAT, "unknown key 'head'", "top level");
}

static void test_top_level_types(void **state) {
  (void)state;
  check_bad("{\"granularity\": \"4\", \"seq_len\": 40, \"heads\": [{}]}", MTRAIN_ERR_FORMAT,
            "granularity: expected an integer", "a string");
  check_bad("{\"granularity\": 4, \"seq_len\": 40.5, \"heads\": [{}]}", MTRAIN_ERR_FORMAT,
            "seq_len: expected an integer", "non-integer number");
  check_bad(HDR "{}}", MTRAIN_ERR_FORMAT, "heads: expected an array", "an object");
}

static void test_top_level_ranges(void **state) {
  (void)state;
  check_bad("{\"granularity\": 0, \"seq_len\": 40, \"heads\": [{}]}", MTRAIN_ERR_INVALID_PATTERN,
            "granularity: 0 out of range", "[1, 2147483647]");
  check_bad("{\"granularity\": 2147483648, \"seq_len\": 40, \"heads\": [{}]}",
            MTRAIN_ERR_INVALID_PATTERN, "granularity: 2147483648 out of range", "[1,");
  check_bad("{\"granularity\": 4, \"seq_len\": -40, \"heads\": [{}]}", MTRAIN_ERR_INVALID_PATTERN,
            "seq_len: -40 out of range", "[1,");
  check_bad("{\"granularity\": 1, \"seq_len\": 4294967296, \"heads\": [{}]}",
            MTRAIN_ERR_INVALID_PATTERN, "bad.json", "2^31 blocks");
  /* found by the long fuzz run: 888888200 blocks of one token asked for 7 GB */
  check_bad("{\"granularity\": 1, \"seq_len\": 888888200, \"heads\": [{\"verticals\": [9]}, "
            "{\"block_mask\": [[0, 0], [3, 1]]}]}",
            MTRAIN_ERR_INVALID_PATTERN, "1 block-mask heads of 888888200 query blocks", "2^22");
}

static void test_empty_heads(void **state) {
  (void)state;
  check_bad(HDR "[]}", MTRAIN_ERR_FORMAT, "heads: empty array", "at least one head");
}

static void test_head_not_object(void **state) {
  (void)state;
  check_bad(HDR "[{}, [0, 1]]}", MTRAIN_ERR_FORMAT, "heads[1]: expected an object", "an array");
}

static void test_unknown_head_key(void **state) {
  (void)state;
  check_bad(HDR "[{}, {}, {\"diagonal\": [0, 1]}]}", MTRAIN_ERR_FORMAT, "heads[2]",
            "unknown key 'diagonal'");
  check_bad(HDR "[{\"verticals\": [1], \"Verticals\": [2]}]}", MTRAIN_ERR_FORMAT, "heads[0]",
            "unknown key 'Verticals'");
}

static void test_ill_typed_arrays(void **state) {
  (void)state;
  check_bad(HDR "[{\"diagonals\": 1}]}", MTRAIN_ERR_FORMAT, "heads[0].diagonals",
            "expected an array, found an integer");
  check_bad(HDR "[{\"verticals\": \"0, 1\"}]}", MTRAIN_ERR_FORMAT, "heads[0].verticals",
            "expected an array, found a string");
  check_bad(HDR "[{\"diagonals\": [0, 1.5]}]}", MTRAIN_ERR_FORMAT, "heads[0].diagonals[1]",
            "expected an integer, found a non-integer number");
  check_bad(HDR "[{}, {}, {}, {\"verticals\": [0, 1, 2, 3, 4, 5, 6, \"7\"]}]}", MTRAIN_ERR_FORMAT,
            "heads[3].verticals[7]", "expected an integer, found a string");
  check_bad(HDR "[{\"verticals\": [null]}]}", MTRAIN_ERR_FORMAT, "heads[0].verticals[0]", "null");
}

static void test_diagonal_beyond_int32(void **state) {
  (void)state;
  check_bad(HDR "[{\"diagonals\": [0, 4294967297]}]}", MTRAIN_ERR_INVALID_PATTERN,
            "heads[0].diagonals[1]", "does not fit in 32 bits");
  check_bad(HDR "[{\"diagonals\": [-2147483649]}]}", MTRAIN_ERR_INVALID_PATTERN,
            "heads[0].diagonals[0]", "does not fit in 32 bits");
}

static void test_values_out_of_range(void **state) {
  (void)state;
  check_bad(HDR "[{}, {\"diagonals\": [0, 10]}]}", MTRAIN_ERR_INVALID_PATTERN, "heads[1]",
            "out of range [0, 10)");
  check_bad(HDR "[{\"diagonals\": [-1, 0]}]}", MTRAIN_ERR_INVALID_PATTERN, "heads[0]",
            "out of range");
  check_bad(HDR "[{\"verticals\": [3, 40]}]}", MTRAIN_ERR_INVALID_PATTERN, "heads[0]",
            "out of range [0, 40)");
  check_bad(HDR "[{\"verticals\": [-1]}]}", MTRAIN_ERR_INVALID_PATTERN, "heads[0]", "out of range");
}

static void test_unsorted_and_duplicates(void **state) {
  (void)state;
  check_bad(HDR "[{\"diagonals\": [0, 3, 2]}]}", MTRAIN_ERR_INVALID_PATTERN, "heads[0]",
            "not strictly increasing at index 2");
  check_bad(HDR "[{}, {\"verticals\": [1, 5, 5]}]}", MTRAIN_ERR_INVALID_PATTERN, "heads[1]",
            "not strictly increasing at index 2");
  check_bad(HDR "[{\"diagonals\": [0, 0]}]}", MTRAIN_ERR_INVALID_PATTERN, "heads[0]",
            "not strictly increasing");
}

static void test_block_mask_errors(void **state) {
  (void)state;
  check_bad(HDR "[{\"block_mask\": [], \"diagonals\": [0]}]}", MTRAIN_ERR_FORMAT,
            "heads[0].block_mask", "cannot be combined");
  check_bad(HDR "[{\"block_mask\": {}}]}", MTRAIN_ERR_FORMAT, "heads[0].block_mask",
            "expected an array");
  check_bad(HDR "[{\"block_mask\": [[1, 0], [2]]}]}", MTRAIN_ERR_FORMAT, "heads[0].block_mask[1]",
            "array of 1 entries");
  check_bad(HDR "[{\"block_mask\": [3]}]}", MTRAIN_ERR_FORMAT, "heads[0].block_mask[0]",
            "pair, found an integer");
  check_bad(HDR "[{\"block_mask\": [[1, 0.5]]}]}", MTRAIN_ERR_FORMAT, "heads[0].block_mask[0]",
            "expected an integer");
  check_bad(HDR "[{\"block_mask\": [[1, 2]]}]}", MTRAIN_ERR_INVALID_PATTERN,
            "heads[0].block_mask[0]", "causal");
  check_bad(HDR "[{\"block_mask\": [[10, 0]]}]}", MTRAIN_ERR_INVALID_PATTERN,
            "heads[0].block_mask[0]", "query block 10 out of range [0, 10)");
  check_bad(HDR "[{\"block_mask\": [[2, 0], [1, 0]]}]}", MTRAIN_ERR_INVALID_PATTERN,
            "heads[0].block_mask[1]", "must be sorted");
  check_bad(HDR "[{\"block_mask\": [[2, 1], [2, 0]]}]}", MTRAIN_ERR_INVALID_PATTERN,
            "heads[0].block_mask[1]", "must be sorted");
  check_bad(HDR "[{\"block_mask\": [[2, 1], [2, 1]]}]}", MTRAIN_ERR_INVALID_PATTERN,
            "heads[0].block_mask[1]", "without duplicates");
  /* a non-causal file of too many blocks is refused before any allocation
   * (the fuzzer once found this asking for 9 GB) */
  check_bad("{\"granularity\": 1, \"seq_len\": 1153264722, \"causal\": false, \"heads\": "
            "[{\"block_mask\": []}]}",
            MTRAIN_ERR_INVALID_PATTERN, "1153264722 query blocks", "2^22");
  /* the limit is over all block-mask heads together (2^22 rows): 4 heads of
   * 2^21 blocks are refused before the pattern is made, 2 are read */
  check_bad("{\"granularity\": 8, \"seq_len\": 16777216, \"causal\": false, \"heads\": "
            "[{\"block_mask\": []}, {\"block_mask\": []}, {\"block_mask\": []}, "
            "{\"block_mask\": []}]}",
            MTRAIN_ERR_INVALID_PATTERN, "4 block-mask heads of 2097152 query blocks", "2^22");
  check_bad("{\"granularity\": 8, \"seq_len\": 16777216, \"heads\": [{}, "
            "{\"block_mask\": []}, {\"verticals\": [1]}, {\"block_mask\": []}, "
            "{\"block_mask\": []}]}",
            MTRAIN_ERR_INVALID_PATTERN, "3 block-mask heads", "heads");
  mtrain_pattern_t *two = NULL;
  assert_int_equal(mtrain_pattern_parse_json("{\"granularity\": 8, \"seq_len\": 16777216, "
                                             "\"causal\": false, \"heads\": [{\"block_mask\": "
                                             "[]}, {\"block_mask\": [[0, 5]]}]}",
                                             "ok.json", &two),
                   MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_num_heads(two), 2);
  mtrain_pattern_destroy(two);
  /* a non-causal file whose head is not a block mask fails before the
   * pattern of 2^22 rows is made */
  check_bad("{\"granularity\": 4, \"seq_len\": 16777216, \"causal\": false, \"heads\": "
            "[{\"block_mask\": []}, {\"blocksk\": []}]}",
            MTRAIN_ERR_INVALID_PATTERN, "heads[1]", "holds block-mask heads only");
  check_bad("{\"granularity\": 4, \"seq_len\": 64, \"causal\": false, \"heads\": [3]}",
            MTRAIN_ERR_FORMAT, "heads[0]", "expected an object");
}

static void test_file_errors(void **state) {
  (void)state;
  char path[512];
  mtrain_pattern_t *p = NULL;
  tmp_path(path, sizeof path, "missing.json");
  remove(path);
  expect_error(mtrain_pattern_read_json(path, &p), MTRAIN_ERR_IO, "pattern_missing.json",
               "cannot open", NULL);
  assert_null(p);
  tmp_path(path, sizeof path, "syntax.json");
  write_text(path, "{\"granularity\": 4,\n\n  \"seq_len\" 40}");
  expect_error(mtrain_pattern_read_json(path, &p), MTRAIN_ERR_FORMAT, "pattern_syntax.json",
               "line 3", NULL);
  tmp_path(path, sizeof path, "bad_value.json");
  write_text(path, HDR "[{\"verticals\": [7, 3]}]}");
  expect_error(mtrain_pattern_read_json(path, &p), MTRAIN_ERR_INVALID_PATTERN,
               "pattern_bad_value.json: heads[0]", "not strictly increasing", NULL);
  assert_null(p);
}

static void test_null_arguments(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_parse_json(NULL, "x", &p), MTRAIN_ERR_NULL_POINTER);
  assert_int_equal(mtrain_pattern_parse_json("{}", "x", NULL), MTRAIN_ERR_NULL_POINTER);
  assert_int_equal(mtrain_pattern_read_json(NULL, &p), MTRAIN_ERR_NULL_POINTER);
  assert_int_equal(mtrain_pattern_write_json("x.json", NULL), MTRAIN_ERR_NULL_POINTER);
  expect_error(mtrain_pattern_parse_json("{", NULL, &p), MTRAIN_ERR_FORMAT, "<string>", NULL);
}

static void test_write_errors(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create_dense(4096, 8, 4, &p), MTRAIN_SUCCESS);
  char path[512];
  snprintf(path, sizeof path, "%s/no_such_dir/p.json", MTRAIN_TEST_TMPDIR);
  expect_error(mtrain_pattern_write_json(path, p), MTRAIN_ERR_IO, "no_such_dir/p.json",
               "cannot open for writing", NULL);
  FILE *probe = fopen("/dev/full", "w");
  if (probe) {
    fclose(probe);
    expect_error(mtrain_pattern_write_json("/dev/full", p), MTRAIN_ERR_IO, "/dev/full",
                 "write failed", NULL);
  }
  mtrain_pattern_destroy(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_roundtrip_mixed_heads),
      cmocka_unit_test(test_roundtrip_large_integers),
      cmocka_unit_test(test_diagonal_zero_added),
      cmocka_unit_test(test_block_mask_head),
      cmocka_unit_test(test_budget_file_rejected),
      cmocka_unit_test(test_syntax_error),
      cmocka_unit_test(test_duplicate_key),
      cmocka_unit_test(test_top_level_structure),
      cmocka_unit_test(test_top_level_types),
      cmocka_unit_test(test_top_level_ranges),
      cmocka_unit_test(test_empty_heads),
      cmocka_unit_test(test_head_not_object),
      cmocka_unit_test(test_unknown_head_key),
      cmocka_unit_test(test_ill_typed_arrays),
      cmocka_unit_test(test_diagonal_beyond_int32),
      cmocka_unit_test(test_values_out_of_range),
      cmocka_unit_test(test_unsorted_and_duplicates),
      cmocka_unit_test(test_block_mask_errors),
      cmocka_unit_test(test_file_errors),
      cmocka_unit_test(test_null_arguments),
      cmocka_unit_test(test_write_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
