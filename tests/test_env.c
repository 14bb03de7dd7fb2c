/* test_env.c: a malformed MTRAIN_* environment variable fails context
 * creation with MTRAIN_ERR_INVALID_CONFIG naming the variable and its value.
 * ctest runs it with MTRAIN_GRANULARITY=12x (the environment is read once
 * per process, so each case needs its own process). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "test_support.h"

static void test_malformed_granularity(void **state) {
  (void)state;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  mtrain_context_t *ctx = NULL;
  TS_ASSERT_STATUS(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_ERR_INVALID_CONFIG,
                   "MTRAIN_GRANULARITY='12x'");
  assert_null(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_malformed_granularity)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
