/* test_pattern_digest.c: mtrain_pattern_digest. Equal content gives equal
 * digests (clones, patterns rebuilt from the same sets); every single change
 * of content (a diagonal, a vertical, a block of a mask, seq_len, granularity,
 * heads, causality, order and count of the list) changes it; random distinct
 * patterns never collide; bad arguments are refused with a message. Random
 * cases print their seed (MTRAIN_TEST_SEED reproduces them). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_support.h"

/* A random vertical-slash pattern of N tokens, H heads, granularity G. */
static mtrain_pattern_t *random_pattern(ts_rng_t *r, int64_t n, int32_t heads, int32_t g) {
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(n, heads, g, &p), MTRAIN_SUCCESS);
  const int64_t nb = mtrain_pattern_num_blocks(p);
  int32_t *dg = malloc((size_t)nb * sizeof *dg);
  int64_t *vt = malloc((size_t)n * sizeof *vt);
  for (int32_t h = 0; h < heads; h++) {
    int32_t nd = 0, nv = 0;
    for (int64_t t = 0; t < nb; t++)
      if (t == 0 || ts_rng_below(r, 3) == 0) dg[nd++] = (int32_t)t;
    for (int64_t j = 0; j < n; j++)
      if (ts_rng_below(r, 9) == 0) vt[nv++] = j;
    assert_int_equal(mtrain_pattern_set_head(p, h, dg, nd, vt, nv), MTRAIN_SUCCESS);
  }
  free(dg);
  free(vt);
  return p;
}

static void digest_of(mtrain_pattern_t *const *ps, int32_t count, uint64_t out[2]) {
  assert_int_equal(mtrain_pattern_digest((const mtrain_pattern_t *const *)ps, count, out),
                   MTRAIN_SUCCESS);
}

static int same(const uint64_t a[2], const uint64_t b[2]) { return a[0] == b[0] && a[1] == b[1]; }

/* The digest of one pattern. */
static void digest1(mtrain_pattern_t *p, uint64_t out[2]) { digest_of(&p, 1, out); }

/* Rebuilds p's head h with the given sets and returns the digest. */
static void set_and_digest(mtrain_pattern_t *p, int32_t h, const int32_t *d, int32_t nd,
                           const int64_t *v, int32_t nv, uint64_t out[2]) {
  assert_int_equal(mtrain_pattern_set_head(p, h, d, nd, v, nv), MTRAIN_SUCCESS);
  digest1(p, out);
}

static void test_equal_content_equal_digest(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(0xD16E57);
  printf("test_equal_content_equal_digest: seed %llu\n", (unsigned long long)seed);
  for (int c = 0; c < 20; c++) {
    ts_rng_t r1, r2;
    ts_rng_seed(&r1, seed + (uint64_t)c);
    ts_rng_seed(&r2, seed + (uint64_t)c);
    const int64_t n = 1 + ts_rng_below(&r1, 3000);
    const int32_t g = 16 << ts_rng_below(&r1, 4), heads = 1 + (int32_t)ts_rng_below(&r1, 4);
    (void)ts_rng_below(&r2, 3000);
    (void)ts_rng_below(&r2, 4);
    (void)ts_rng_below(&r2, 4);
    mtrain_pattern_t *a = random_pattern(&r1, n, heads, g), *b = random_pattern(&r2, n, heads, g);
    mtrain_pattern_t *cl = NULL;
    assert_int_equal(mtrain_pattern_clone(a, &cl), MTRAIN_SUCCESS);
    uint64_t da[2], db[2], dc[2];
    digest1(a, da);
    digest1(b, db);
    digest1(cl, dc);
    assert_true(same(da, db));
    assert_true(same(da, dc));
    mtrain_pattern_destroy(a);
    mtrain_pattern_destroy(b);
    mtrain_pattern_destroy(cl);
  }
}

static void test_every_change_changes_it(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(1000, 2, 100, &p), MTRAIN_SUCCESS); /* 10 blocks */
  const int32_t d[] = {0, 2, 5};
  const int64_t v[] = {3, 40, 999};
  uint64_t base[2], x[2];
  set_and_digest(p, 1, d, 3, v, 3, base);
  /* one diagonal more, one less, moved */
  const int32_t d_more[] = {0, 2, 5, 9}, d_moved[] = {0, 2, 6};
  set_and_digest(p, 1, d_more, 4, v, 3, x);
  assert_false(same(base, x));
  set_and_digest(p, 1, d, 2, v, 3, x);
  assert_false(same(base, x));
  set_and_digest(p, 1, d_moved, 3, v, 3, x);
  assert_false(same(base, x));
  /* a vertical moved, dropped; the same sets on the other head */
  const int64_t v_moved[] = {3, 41, 999};
  set_and_digest(p, 1, d, 3, v_moved, 3, x);
  assert_false(same(base, x));
  set_and_digest(p, 1, d, 3, v, 2, x);
  assert_false(same(base, x));
  set_and_digest(p, 1, d, 3, v, 3, x);
  assert_true(same(base, x)); /* back to the same content */
  assert_int_equal(mtrain_pattern_set_head(p, 1, NULL, 0, NULL, 0), MTRAIN_SUCCESS);
  set_and_digest(p, 0, d, 3, v, 3, x);
  assert_false(same(base, x));

  /* shape: seq_len, granularity, heads (same sets) */
  mtrain_pattern_t *q[3] = {NULL, NULL, NULL};
  assert_int_equal(mtrain_pattern_create(1001, 2, 100, &q[0]), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_create(1000, 2, 125, &q[1]), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_create(1000, 3, 100, &q[2]), MTRAIN_SUCCESS);
  mtrain_pattern_t *ref = NULL;
  assert_int_equal(mtrain_pattern_create(1000, 2, 100, &ref), MTRAIN_SUCCESS);
  uint64_t dref[2];
  digest1(ref, dref);
  for (int i = 0; i < 3; i++) {
    digest1(q[i], x);
    assert_false(same(dref, x));
  }

  /* causality: a non-causal pattern of the same shape; one block of its mask */
  mtrain_pattern_t *nc = NULL;
  assert_int_equal(mtrain_pattern_create_noncausal(1000, 2, 100, &nc), MTRAIN_SUCCESS);
  uint64_t dnc[2];
  digest1(nc, dnc);
  assert_false(same(dref, dnc));
  uint8_t mask[100];
  memset(mask, 0, sizeof mask);
  for (int i = 0; i < 10; i++) mask[i * 10 + i] = 1;
  mask[3 * 10 + 7] = 1; /* a block above the diagonal */
  assert_int_equal(mtrain_pattern_set_block_mask(nc, 0, mask), MTRAIN_SUCCESS);
  uint64_t dm1[2], dm2[2];
  digest1(nc, dm1);
  assert_false(same(dnc, dm1));
  mask[3 * 10 + 7] = 0;
  mask[3 * 10 + 8] = 1;
  assert_int_equal(mtrain_pattern_set_block_mask(nc, 0, mask), MTRAIN_SUCCESS);
  digest1(nc, dm2);
  assert_false(same(dm1, dm2));

  /* lists: order and count */
  mtrain_pattern_t *ab[2] = {p, ref}, *ba[2] = {ref, p};
  uint64_t dab[2], dba[2], d1[2], d0[2], d0b[2];
  digest_of(ab, 2, dab);
  digest_of(ba, 2, dba);
  digest_of(ab, 1, d1);
  digest_of(NULL, 0, d0);
  digest_of(ab, 0, d0b);
  assert_false(same(dab, dba));
  assert_false(same(dab, d1));
  assert_false(same(d1, d0));
  assert_true(same(d0, d0b));

  for (int i = 0; i < 3; i++) mtrain_pattern_destroy(q[i]);
  mtrain_pattern_destroy(ref);
  mtrain_pattern_destroy(nc);
  mtrain_pattern_destroy(p);
}

static int cmp_u64(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Distinct patterns that differ in one word (the first vertical i, a random
 * second one) never share a digest, nor either half of one. */
static void test_no_collisions(void **state) {
  (void)state;
  const uint64_t seed = ts_seed(0xC011);
  printf("test_no_collisions: seed %llu\n", (unsigned long long)seed);
  ts_rng_t r;
  ts_rng_seed(&r, seed);
  enum { kCount = 4000 };
  uint64_t *half[2] = {malloc(sizeof(uint64_t) * kCount), malloc(sizeof(uint64_t) * kCount)};
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(8192, 1, 64, &p), MTRAIN_SUCCESS);
  const int32_t d[] = {0, 1};
  for (int i = 0; i < kCount; i++) {
    const int64_t v[] = {(int64_t)i, 4096 + ts_rng_below(&r, 4096)};
    uint64_t x[2];
    set_and_digest(p, 0, d, 2, v, 2, x);
    half[0][i] = x[0];
    half[1][i] = x[1];
  }
  for (int k = 0; k < 2; k++) {
    qsort(half[k], kCount, sizeof(uint64_t), cmp_u64);
    for (int i = 1; i < kCount; i++) assert_true(half[k][i - 1] != half[k][i]);
    free(half[k]);
  }
  mtrain_pattern_destroy(p);
}

static void test_bad_arguments(void **state) {
  (void)state;
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(100, 1, 16, &p), MTRAIN_SUCCESS);
  const mtrain_pattern_t *ps[2] = {p, NULL};
  uint64_t out[2];
  TS_ASSERT_STATUS(mtrain_pattern_digest(ps, 1, NULL), MTRAIN_ERR_NULL_POINTER, "'digest'");
  TS_ASSERT_STATUS(mtrain_pattern_digest(ps, -1, out), MTRAIN_ERR_INVALID_ARGUMENT,
                   "count -1 is negative");
  TS_ASSERT_STATUS(mtrain_pattern_digest(NULL, 2, out), MTRAIN_ERR_NULL_POINTER, "'patterns'");
  TS_ASSERT_STATUS(mtrain_pattern_digest(ps, 2, out), MTRAIN_ERR_NULL_POINTER,
                   "patterns[1] is NULL");
  mtrain_pattern_destroy(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_equal_content_equal_digest),
      cmocka_unit_test(test_every_change_changes_it),
      cmocka_unit_test(test_no_collisions),
      cmocka_unit_test(test_bad_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
