/* test_status.c: status codes and messages, the thread-local last error,
 * dtype names and the fp16/bf16 conversions (known values, round to nearest
 * even, NaN/Inf, exhaustive round trips). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <string.h>

#include "test_support.h"

static void test_status_strings_distinct(void **state) {
  (void)state;
  static const mtrain_status_t all[] = {
#define X_(name, value, text) name,
      MTRAIN_STATUS_TABLE(X_)
#undef X_
  };
  const size_t n = sizeof all / sizeof all[0];
  for (size_t i = 0; i < n; i++) {
    assert_string_not_equal(mtrain_status_string(all[i]), "unknown status");
    assert_true(strncmp(mtrain_status_name(all[i]), "MTRAIN_", 7) == 0);
    for (size_t j = i + 1; j < n; j++) {
      assert_int_not_equal(all[i], all[j]);
      assert_string_not_equal(mtrain_status_string(all[i]), mtrain_status_string(all[j]));
    }
  }
  assert_int_equal(MTRAIN_SUCCESS, 0);
  assert_string_equal(mtrain_status_string((mtrain_status_t)12345), "unknown status");
}

static void *other_thread(void *arg) {
  (void)arg;
  mtrain_dtype_t dt;
  (void)mtrain_dtype_parse("nonsense-in-thread", &dt);
  return NULL;
}

static void test_last_error_is_thread_local(void **state) {
  (void)state;
  mtrain_dtype_t dt;
  TS_ASSERT_STATUS(mtrain_dtype_parse("int8", &dt), MTRAIN_ERR_UNSUPPORTED_DTYPE, "int8");
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, other_thread, NULL), 0);
  pthread_join(t, NULL);
  assert_non_null(strstr(mtrain_last_error(), "int8"));
  assert_null(strstr(mtrain_last_error(), "nonsense-in-thread"));
  mtrain_clear_error();
  assert_string_equal(mtrain_last_error(), "");
}

static void test_dtype_names(void **state) {
  (void)state;
  const mtrain_dtype_t all[] = {MTRAIN_F32, MTRAIN_BF16, MTRAIN_F16, MTRAIN_F64};
  for (int i = 0; i < 4; i++) {
    mtrain_dtype_t back;
    assert_int_equal(mtrain_dtype_parse(mtrain_dtype_name(all[i]), &back), MTRAIN_SUCCESS);
    assert_int_equal(back, all[i]);
  }
  assert_int_equal(mtrain_dtype_size(MTRAIN_BF16), 2);
  assert_int_equal(mtrain_dtype_size(MTRAIN_F64), 8);
  assert_int_equal(mtrain_dtype_size((mtrain_dtype_t)99), 0);
}

static void test_bf16_known_values(void **state) {
  (void)state;
  assert_int_equal(mtrain_float_to_bf16(1.0f), 0x3f80);
  assert_int_equal(mtrain_float_to_bf16(-2.0f), 0xc000);
  /* 1 + 2^-8 lies exactly between 1 and 1 + 2^-7: ties to even (1.0) */
  assert_int_equal(mtrain_float_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  /* 1 + 3*2^-8 lies between 1+2^-7 (odd) and 1+2^-6 (even): rounds up */
  assert_int_equal(mtrain_float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  assert_int_equal(mtrain_float_to_bf16(INFINITY), 0x7f80);
  assert_true(isnan(mtrain_bf16_to_float(mtrain_float_to_bf16(NAN))));
  for (uint32_t u = 0; u < 0x10000; u++) {
    float f = mtrain_bf16_to_float((uint16_t)u);
    if (isnan(f)) continue;
    assert_int_equal(mtrain_float_to_bf16(f), u);
  }
}

static void test_half_known_values(void **state) {
  (void)state;
  assert_int_equal(mtrain_float_to_half(1.0f), 0x3c00);
  assert_int_equal(mtrain_float_to_half(65504.0f), 0x7bff);
  assert_int_equal(mtrain_float_to_half(65520.0f), 0x7c00);        /* rounds to Inf */
  assert_int_equal(mtrain_float_to_half(0x1p-24f), 0x0001);        /* smallest subnormal */
  assert_int_equal(mtrain_float_to_half(0x1p-25f), 0x0000);        /* tie to even: 0 */
  assert_int_equal(mtrain_float_to_half(1.0f + 0x1p-11f), 0x3c00); /* tie to even */
  assert_int_equal(mtrain_float_to_half(1.0f + 3 * 0x1p-11f), 0x3c02);
  assert_int_equal(mtrain_float_to_half(-0.0f), 0x8000);
  assert_true(isnan(mtrain_half_to_float(mtrain_float_to_half(NAN))));
  for (uint32_t u = 0; u < 0x10000; u++) {
    float f = mtrain_half_to_float((uint16_t)u);
    if (isnan(f)) continue;
    assert_int_equal(mtrain_float_to_half(f), u);
  }
}

static void test_convert_rejects_bad_arguments(void **state) {
  (void)state;
  float x = 1.0f;
  double y;
  TS_ASSERT_STATUS(mtrain_convert(&x, MTRAIN_F32, &y, MTRAIN_F64, -1), MTRAIN_ERR_INVALID_ARGUMENT,
                   "negative");
  TS_ASSERT_STATUS(mtrain_convert(NULL, MTRAIN_F32, &y, MTRAIN_F64, 1), MTRAIN_ERR_NULL_POINTER,
                   "src");
  TS_ASSERT_STATUS(mtrain_convert(&x, (mtrain_dtype_t)42, &y, MTRAIN_F64, 1),
                   MTRAIN_ERR_UNSUPPORTED_DTYPE, "dtype");
  assert_int_equal(mtrain_convert(&x, MTRAIN_F32, &y, MTRAIN_F64, 1), MTRAIN_SUCCESS);
  assert_true(y == 1.0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_strings_distinct),
      cmocka_unit_test(test_last_error_is_thread_local),
      cmocka_unit_test(test_dtype_names),
      cmocka_unit_test(test_bf16_known_values),
      cmocka_unit_test(test_half_known_values),
      cmocka_unit_test(test_convert_rejects_bad_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
