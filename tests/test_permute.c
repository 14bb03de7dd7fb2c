/* test_permute.c: the layout permutation as a backend operation (SPEC.md
 * section 3): for every layout kind and W in {1, 2, 3, 4, 7, 8, 32},
 * gathering every rank's slots and scattering them back is the identity,
 * padding slots are zero and never reach the whole tensor, every token lands
 * on the slot the layout's index names; bad shapes are rejected. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_layout.h"
#include "test_support.h"

static void test_round_trip_every_layout(void **state) {
  (void)state;
  const int32_t worlds[] = {1, 2, 3, 4, 7, 8, 32};
  const mtrain_layout_kind_t kinds[] = {MTRAIN_LAYOUT_CONTIGUOUS, MTRAIN_LAYOUT_ZIGZAG,
                                        MTRAIN_LAYOUT_STRIPED, MTRAIN_LAYOUT_BALANCED};
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = 8;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  const int64_t N = 1001, H = 3, D = 5;
  float *full = malloc(sizeof(float) * (size_t)(N * H * D));
  float *back = malloc(sizeof(float) * (size_t)(N * H * D));
  for (int64_t i = 0; i < N * H * D; i++) full[i] = (float)(i + 1);
  for (size_t w = 0; w < sizeof worlds / sizeof *worlds; w++)
    for (size_t k = 0; k < 4; k++) {
      mtrain_layout_t *layout = NULL;
      assert_int_equal(mtrain_layout_create(kinds[k], N, 8, worlds[w], NULL, &layout),
                       MTRAIN_SUCCESS);
      memset(back, 0, sizeof(float) * (size_t)(N * H * D));
      mtrain_tensor_t tf = {full, MTRAIN_F32, 3, {N, H, D, 0}};
      mtrain_tensor_t tb = {back, MTRAIN_F32, 3, {N, H, D, 0}};
      for (int32_t r = 0; r < worlds[w]; r++) {
        const int64_t T = mtrain_layout_local_tokens(layout, r);
        float *loc = malloc(sizeof(float) * (size_t)(T * H * D + 1));
        int64_t *index = malloc(sizeof(int64_t) * (size_t)(T + 1));
        memset(loc, 0xff, sizeof(float) * (size_t)(T * H * D)); /* NaN: must be overwritten */
        mtrain_tensor_t tl = {loc, MTRAIN_F32, 3, {T, H, D, 0}};
        assert_int_equal(mtrain_layout_permute(ctx, layout, r, &tf, &tl), MTRAIN_SUCCESS);
        assert_int_equal(mtrain_layout_rank_token_index(layout, r, index), MTRAIN_SUCCESS);
        for (int64_t i = 0; i < T; i++)
          for (int64_t x = 0; x < H * D; x++) {
            const float want = index[i] < N ? full[index[i] * H * D + x] : 0.0f;
            if (loc[i * H * D + x] != want)
              fail_msg("W=%d %s rank %d slot %lld: %g, expected %g", worlds[w],
                       mtrain_layout_kind_name(kinds[k]), r, (long long)i,
                       (double)loc[i * H * D + x], (double)want);
          }
        assert_int_equal(mtrain_layout_unpermute(ctx, layout, r, &tl, &tb), MTRAIN_SUCCESS);
        free(loc);
        free(index);
      }
      if (memcmp(full, back, sizeof(float) * (size_t)(N * H * D)) != 0)
        fail_msg("W=%d %s: permute then unpermute is not the identity", worlds[w],
                 mtrain_layout_kind_name(kinds[k]));
      mtrain_layout_destroy(layout);
    }
  free(full);
  free(back);
  mtrain_context_destroy(ctx);
}

static void test_permute_bad_shapes(void **state) {
  (void)state;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = 8;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  mtrain_layout_t *layout = NULL;
  assert_int_equal(mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, 100, 8, 3, NULL, &layout),
                   MTRAIN_SUCCESS);
  float full[100 * 2], loc[200 * 2];
  mtrain_tensor_t tf = {full, MTRAIN_F32, 2, {100, 2, 0, 0}};
  mtrain_tensor_t tl = {loc, MTRAIN_F32, 2, {mtrain_layout_local_tokens(layout, 0) + 1, 2, 0, 0}};
  TS_ASSERT_STATUS(mtrain_layout_permute(ctx, layout, 0, &tf, &tl), MTRAIN_ERR_SHAPE_MISMATCH,
                   "rank 0 holds");
  tl.shape[0] -= 1;
  tl.shape[1] = 3;
  TS_ASSERT_STATUS(mtrain_layout_permute(ctx, layout, 0, &tf, &tl), MTRAIN_ERR_SHAPE_MISMATCH,
                   "shape[1]");
  tl.shape[1] = 2;
  TS_ASSERT_STATUS(mtrain_layout_permute(ctx, layout, 3, &tf, &tl), MTRAIN_ERR_INVALID_ARGUMENT,
                   "rank 3 out of range");
  tl.dtype = MTRAIN_BF16;
  TS_ASSERT_STATUS(mtrain_layout_permute(ctx, layout, 0, &tf, &tl), MTRAIN_ERR_UNSUPPORTED_DTYPE,
                   "permute");
  tl.dtype = MTRAIN_F32;
  tf.shape[0] = 99;
  TS_ASSERT_STATUS(mtrain_layout_unpermute(ctx, layout, 0, &tl, &tf), MTRAIN_ERR_SHAPE_MISMATCH,
                   "99 tokens");
  mtrain_layout_destroy(layout);
  mtrain_context_destroy(ctx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_round_trip_every_layout),
      cmocka_unit_test(test_permute_bad_shapes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
