/* test_pattern.c: patterns (SPEC.md section 1): creation, validation of
 * diagonals, verticals and block masks with their messages, diagonal 0
 * forced, the allowed predicate against its definition, exact pair counts
 * against brute force, and cloning. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "core/runtime/pattern_internal.h"
#include "test_support.h"

static void test_create_rejects_bad_sizes(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL;
  TS_ASSERT_STATUS(mtrain_pattern_create(0, 4, 128, &p), MTRAIN_ERR_INVALID_ARGUMENT, "seq_len");
  TS_ASSERT_STATUS(mtrain_pattern_create(100, 0, 128, &p), MTRAIN_ERR_INVALID_ARGUMENT,
                   "num_heads");
  TS_ASSERT_STATUS(mtrain_pattern_create(100, 4, 0, &p), MTRAIN_ERR_INVALID_ARGUMENT,
                   "granularity");
  TS_ASSERT_STATUS(mtrain_pattern_create(100, 4, 16, NULL), MTRAIN_ERR_NULL_POINTER, "out");
  assert_null(p);
  mtrain_pattern_destroy(NULL); /* no-op */
}

static void test_set_head_validation(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(1000, 2, 100, &p), MTRAIN_SUCCESS); /* 10 blocks */
  const int32_t unsorted[] = {0, 3, 2};
  const int32_t dup[] = {0, 2, 2};
  const int32_t too_far[] = {0, 10};
  const int32_t neg[] = {-1, 0};
  const int64_t vbad[] = {5, 1000};
  const int64_t vunsorted[] = {9, 3};
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 0, unsorted, 3, NULL, 0), MTRAIN_ERR_INVALID_PATTERN,
                   "not strictly increasing");
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 0, dup, 3, NULL, 0), MTRAIN_ERR_INVALID_PATTERN,
                   "index 2");
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 0, too_far, 2, NULL, 0), MTRAIN_ERR_INVALID_PATTERN,
                   "out of range");
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 0, neg, 2, NULL, 0), MTRAIN_ERR_INVALID_PATTERN,
                   "diagonal[0] = -1");
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 1, NULL, 0, vbad, 2), MTRAIN_ERR_INVALID_PATTERN,
                   "vertical[1] = 1000");
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 1, NULL, 0, vunsorted, 2), MTRAIN_ERR_INVALID_PATTERN,
                   "head 1");
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 2, NULL, 0, NULL, 0), MTRAIN_ERR_INVALID_ARGUMENT,
                   "head 2 out of range");
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 0, NULL, 3, NULL, 0), MTRAIN_ERR_NULL_POINTER,
                   "diagonals");
  /* diagonal 0 is added when absent */
  const int32_t d[] = {2, 5};
  const int64_t v[] = {1, 350};
  assert_int_equal(mtrain_pattern_set_head(p, 0, d, 2, v, 2), MTRAIN_SUCCESS);
  const int32_t *dd;
  const int64_t *vv;
  int32_t nd, nv;
  assert_int_equal(mtrain_pattern_get_head(p, 0, &dd, &nd, &vv, &nv), MTRAIN_SUCCESS);
  assert_int_equal(nd, 3);
  assert_int_equal(dd[0], 0);
  assert_int_equal(dd[2], 5);
  assert_int_equal(nv, 2);
  mtrain_pattern_destroy(p);
}

static void test_block_mask_validation(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(40, 1, 10, &p), MTRAIN_SUCCESS); /* 4 blocks */
  uint8_t mask[16] = {0};
  mask[0 * 4 + 1] = 1; /* above the diagonal */
  TS_ASSERT_STATUS(mtrain_pattern_set_block_mask(p, 0, mask), MTRAIN_ERR_INVALID_PATTERN,
                   "above the causal diagonal");
  memset(mask, 0, sizeof mask);
  mask[3 * 4 + 1] = 1;
  assert_int_equal(mtrain_pattern_set_block_mask(p, 0, mask), MTRAIN_SUCCESS);
  assert_true(mtrain_pattern_head_is_block_mask(p, 0));
  /* (3,1) listed, diagonal blocks forced, (3,0) not listed */
  assert_true(mtrain_pattern_allowed(p, 0, 35, 15));
  assert_true(mtrain_pattern_allowed(p, 0, 5, 3));
  assert_false(mtrain_pattern_allowed(p, 0, 35, 5));
  assert_false(mtrain_pattern_allowed(p, 0, 5, 6)); /* causal */
  mtrain_pattern_destroy(p);
  /* a block mask of more than 2^24 query blocks is refused before its
   * arrays are read (they would take memory in proportion to the blocks) */
  assert_int_equal(mtrain_pattern_create(MTRAIN_PATTERN_MAX_MASK_BLOCKS + 1, 1, 1, &p),
                   MTRAIN_SUCCESS);
  const int64_t off[1] = {0};
  const int32_t idx[1] = {0};
  TS_ASSERT_STATUS(mtrain_pattern_set_block_csr(p, 0, off, idx), MTRAIN_ERR_INVALID_PATTERN,
                   "more than the 2^24 supported");
  TS_ASSERT_STATUS(mtrain_pattern_set_block_mask(p, 0, mask), MTRAIN_ERR_INVALID_PATTERN,
                   "16777217 query blocks");
  assert_false(mtrain_pattern_head_is_block_mask(p, 0));
  mtrain_pattern_destroy(p);
}

/* The definition of SPEC.md section 1, written out independently. */
static int allowed_by_definition(const int32_t *d, int32_t nd, const int64_t *v, int32_t nv,
                                 int32_t G, int64_t i, int64_t j) {
  if (j > i) return 0;
  for (int32_t a = 0; a < nd; a++)
    if (i / G - j / G == d[a]) return 1;
  if (j / G < i / G)
    for (int32_t b = 0; b < nv; b++)
      if (v[b] == j) return 1;
  return 0;
}

static void test_allowed_and_counts(void **state) {
  (void)state;
  uint64_t seed = ts_seed(42);
  const int64_t lengths[] = {1, 9, 64, 100, 257};
  const int32_t grans[] = {1, 8, 32};
  for (int li = 0; li < 5; li++)
    for (int gi = 0; gi < 3; gi++) {
      const int64_t N = lengths[li];
      const int32_t G = grans[gi];
      mtrain_pattern_t *p = ts_make_pattern(TS_PATTERN_RANDOM_SPARSE, N, 2, G, seed + li + gi);
      for (int32_t h = 0; h < 2; h++) {
        const int32_t *d;
        const int64_t *v;
        int32_t nd, nv;
        assert_int_equal(mtrain_pattern_get_head(p, h, &d, &nd, &v, &nv), MTRAIN_SUCCESS);
        int64_t count = 0;
        for (int64_t i = 0; i < N; i++)
          for (int64_t j = 0; j < N; j++) {
            int want = allowed_by_definition(d, nd, v, nv, G, i, j);
            if (mtrain_pattern_allowed(p, h, i, j) != want)
              fail_msg("N=%lld G=%d head %d (%lld,%lld) seed %llu", (long long)N, G, h,
                       (long long)i, (long long)j, (unsigned long long)seed);
            count += want;
          }
        assert_int_equal(mtrain_pattern_count_pairs(p, h), count);
      }
      mtrain_pattern_t *c = NULL;
      assert_int_equal(mtrain_pattern_clone(p, &c), MTRAIN_SUCCESS);
      for (int32_t h = 0; h < 2; h++)
        assert_int_equal(mtrain_pattern_count_pairs(c, h), mtrain_pattern_count_pairs(p, h));
      mtrain_pattern_destroy(c);
      mtrain_pattern_destroy(p);
    }
}

static void test_dense_counts(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create_dense(1000, 2, 128, &p), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_num_blocks(p), 8);
  assert_int_equal(mtrain_pattern_count_pairs(p, 1), 1000 * 1001 / 2);
  mtrain_pattern_destroy(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_create_rejects_bad_sizes),
      cmocka_unit_test(test_set_head_validation),
      cmocka_unit_test(test_block_mask_validation),
      cmocka_unit_test(test_allowed_and_counts),
      cmocka_unit_test(test_dense_counts),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
