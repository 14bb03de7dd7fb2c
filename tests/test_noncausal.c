/* test_noncausal.c: non-causal patterns (mtrain_pattern_create_noncausal,
 * SPEC.md section 1, "Non-causal patterns"), the bidirectional block-sparse attention of encoders
 * and video DiTs:
 *  - the pattern: block masks above the diagonal accepted (refused in a
 *    causal pattern), the diagonal forced, vertical-slash heads refused,
 *    allowed() over every key, exact pair counts, clone, JSON round trip
 *    ("causal": false) and its errors;
 *  - attention: random non-causal block masks (the diagonal, the first block
 *    and 30% of all blocks, a dense head among them) through the plan,
 *    forward and backward, on cpu (fp32) and cpu-ref (fp64), against the fp64
 *    dense reference masked by the same pattern, which knows nothing of the
 *    plan; GQA, d 32 and 64, N not a multiple of G; the fully non-causal
 *    pattern equals dense bidirectional attention computed here directly.
 *    Bound max |got - ref| <= tol * max |ref| per output, tol 1e-4 (cpu),
 *    1e-10 (cpu-ref). Seeds printed (MTRAIN_TEST_SEED overrides);
 *  - "cuda", where compiled and a device is visible (skipped otherwise): the
 *    same cases in fp32 with the tensors in device memory (outputs poisoned
 *    with NaN first), the automatic variant choice (variant 0: the one that
 *    computes fp32), the same bound 1e-4. The tensor-core variants 2 and 3
 *    (bf16, fp16) run the non-causal rows of test_cross_backend.
 * `test_noncausal cuda` runs the "cuda" test alone and exits 77 (ctest's
 * SKIP_RETURN_CODE) without a backend or device: the ctest test
 * test_noncausal_cuda. The ring form runs in test_mpi_ring (pattern kind 5). */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cpu.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_io.h"
#include "test_support.h"

/* A random non-causal block mask per head: head 0 dense (every block), the
 * others the diagonal, the first key block and each block w.p. 0.3. */
static mtrain_pattern_t *random_noncausal(int64_t N, int32_t H, int32_t G, uint64_t seed) {
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create_noncausal(N, H, G, &p), MTRAIN_SUCCESS);
  const int64_t nb = (N + G - 1) / G;
  uint8_t *mask = malloc((size_t)(nb * nb));
  assert_non_null(mask);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  for (int32_t h = 0; h < H; h++) {
    for (int64_t i = 0; i < nb; i++)
      for (int64_t j = 0; j < nb; j++)
        mask[i * nb + j] = (uint8_t)(h == 0 || j == 0 || ts_rng_uniform(&rng) < 0.3);
    assert_int_equal(mtrain_pattern_set_block_mask(p, h, mask), MTRAIN_SUCCESS);
  }
  free(mask);
  return p;
}

static void test_pattern(void **state) {
  (void)state;
  enum { N = 200, G = 64, NB = 4 };
  uint8_t mask[NB * NB] = {0};
  mask[0 * NB + 3] = 1; /* above the diagonal */
  mask[2 * NB + 1] = 1;
  mtrain_pattern_t *causal = NULL, *p = NULL, *c = NULL, *r = NULL;
  assert_int_equal(mtrain_pattern_create(N, 2, G, &causal), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_is_causal(causal), 1);
  TS_ASSERT_STATUS(mtrain_pattern_set_block_mask(causal, 0, mask), MTRAIN_ERR_INVALID_PATTERN,
                   "above the causal diagonal");
  /* block masks are O(blocks): more than 2^24 blocks is refused up front */
  TS_ASSERT_STATUS(mtrain_pattern_create_noncausal(MTRAIN_PATTERN_MAX_MASK_BLOCKS + 1, 2, 1, &p),
                   MTRAIN_ERR_INVALID_ARGUMENT, "2^24");
  assert_null(p);
  assert_int_equal(mtrain_pattern_create_noncausal(N, 2, G, &p), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_is_causal(p), 0);
  /* a fresh head: the diagonal blocks, every pair of them */
  assert_true(mtrain_pattern_head_is_block_mask(p, 1));
  assert_true(mtrain_pattern_allowed(p, 1, 10, 63));
  assert_false(mtrain_pattern_allowed(p, 1, 10, 64));
  assert_int_equal(mtrain_pattern_count_pairs(p, 1), 3 * 64 * 64 + 8 * 8);
  assert_int_equal(mtrain_pattern_set_block_mask(p, 0, mask), MTRAIN_SUCCESS);
  /* (0, 3): query 5 sees key 199; the diagonal is forced: (1, 1) */
  assert_true(mtrain_pattern_allowed(p, 0, 5, 199));
  assert_true(mtrain_pattern_allowed(p, 0, 70, 127));
  assert_true(mtrain_pattern_allowed(p, 0, 130, 64));
  assert_false(mtrain_pattern_allowed(p, 0, 130, 0));
  assert_false(mtrain_pattern_allowed(p, 0, 5, 200));
  /* blocks: (0,0) (0,3) (1,1) (2,1) (2,2) (3,3): 64*64 + 64*8 + 64*64 + 64*64 + 64*64 + 8*8 */
  assert_int_equal(mtrain_pattern_count_pairs(p, 0), 4 * 64 * 64 + 64 * 8 + 8 * 8);
  TS_ASSERT_STATUS(mtrain_pattern_set_head(p, 1, NULL, 0, NULL, 0), MTRAIN_ERR_INVALID_PATTERN,
                   "block-mask heads only");
  assert_int_equal(mtrain_pattern_clone(p, &c), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_is_causal(c), 0);
  assert_int_equal(mtrain_pattern_count_pairs(c, 0), mtrain_pattern_count_pairs(p, 0));
  /* JSON round trip */
  char path[] = "/tmp/mtrain_noncausal_XXXXXX";
  const int fd = mkstemp(path);
  assert_true(fd >= 0);
  assert_int_equal(mtrain_pattern_write_json(path, p), MTRAIN_SUCCESS);
  assert_int_equal(mtrain_pattern_read_json(path, &r), MTRAIN_SUCCESS);
  remove(path);
  assert_int_equal(mtrain_pattern_is_causal(r), 0);
  for (int32_t h = 0; h < 2; h++) {
    assert_int_equal(mtrain_pattern_count_pairs(r, h), mtrain_pattern_count_pairs(p, h));
    for (int64_t i = 0; i < N; i += 7)
      for (int64_t j = 0; j < N; j += 5)
        assert_int_equal(mtrain_pattern_allowed(p, h, i, j), mtrain_pattern_allowed(r, h, i, j));
  }
  mtrain_pattern_t *bad = NULL;
  TS_ASSERT_STATUS(mtrain_pattern_parse_json("{\"granularity\": 64, \"seq_len\": 200, \"causal\": "
                                             "false, \"heads\": [{\"diagonals\": [0]}]}",
                                             "t", &bad),
                   MTRAIN_ERR_INVALID_PATTERN, "block-mask heads only");
  TS_ASSERT_STATUS(mtrain_pattern_parse_json("{\"granularity\": 64, \"seq_len\": 200, \"causal\": "
                                             "0, \"heads\": [{\"block_mask\": [[0, 0]]}]}",
                                             "t", &bad),
                   MTRAIN_ERR_FORMAT, "expected true or false");
  TS_ASSERT_STATUS(mtrain_pattern_parse_json("{\"granularity\": 64, \"seq_len\": 200, "
                                             "\"heads\": [{\"block_mask\": [[0, 2]]}]}",
                                             "t", &bad),
                   MTRAIN_ERR_INVALID_PATTERN, "causal: key block <= query block");
  TS_ASSERT_STATUS(mtrain_pattern_parse_json("{\"granularity\": 64, \"seq_len\": 200, \"causal\": "
                                             "false, \"heads\": [{\"block_mask\": [[0, 4]]}]}",
                                             "t", &bad),
                   MTRAIN_ERR_INVALID_PATTERN, "key block 4 out of range [0, 4)");
  assert_int_equal(mtrain_pattern_parse_json("{\"granularity\": 64, \"seq_len\": 200, \"causal\": "
                                             "false, \"heads\": [{\"block_mask\": [[0, 3]]}]}",
                                             "t", &bad),
                   MTRAIN_SUCCESS);
  assert_true(mtrain_pattern_allowed(bad, 0, 0, 199));
  mtrain_pattern_destroy(bad);
  mtrain_pattern_destroy(r);
  mtrain_pattern_destroy(c);
  mtrain_pattern_destroy(p);
  mtrain_pattern_destroy(causal);
}

typedef struct shape {
  int64_t N;
  int32_t G, Hq, Hkv, d;
} shape_t;

static void check(const char *what, const double *got, const double *want, int64_t n, double tol) {
  const double e = ts_max_abs_diff(got, want, n), M = ts_max_abs(want, n);
  if (ts_has_nonfinite(got, n) || !(e <= tol * M))
    fail_msg("%s: max error %.3g > %.3g (max |ref| %.3g)", what, e, tol * M, M);
}

/* Forward and backward of `p` on `backend`, outputs widened to fp64. For
 * "cuda" the tensors live in device memory: the inputs copied there, the
 * outputs filled with 0xFF bytes (NaN) first, so that an element the
 * kernels leave unwritten fails the check. */
static void run(const char *backend, const mtrain_pattern_t *p, const shape_t *s, const double *q,
                const double *k, const double *v, const double *dout, double *out[5]) {
  const int fp64 = strcmp(backend, "cpu-ref") == 0, cuda = strcmp(backend, "cuda") == 0;
  const mtrain_dtype_t dt = fp64 ? MTRAIN_F64 : MTRAIN_F32;
  const int64_t nq = s->N * s->Hq * s->d, nk = s->N * s->Hkv * s->d, nl = s->N * s->Hq;
  const int64_t counts[9] = {nq, nk, nk, nq, nq, nl, nq, nk, nk};
  const double *src[4] = {q, k, v, dout};
  void *buf[9];
  for (int i = 0; i < 9; i++) {
    buf[i] = calloc((size_t)counts[i], fp64 ? sizeof(double) : sizeof(float));
    assert_non_null(buf[i]);
    for (int64_t x = 0; i < 4 && x < counts[i]; x++)
      if (fp64)
        ((double *)buf[i])[x] = src[i][x];
      else
        ((float *)buf[i])[x] = (float)src[i][x];
  }
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = s->G;
  mtrain_context_t *ctx = NULL;
  assert_int_equal(mtrain_context_create(&cfg, NULL, &ctx), MTRAIN_SUCCESS);
  mtrain_plan_t *plan = NULL;
  assert_int_equal(mtrain_plan_create(ctx, NULL, (const mtrain_pattern_t *const[]){p}, &plan),
                   MTRAIN_SUCCESS);
  const size_t esize = fp64 ? sizeof(double) : sizeof(float);
  void *dev[9] = {NULL};
  for (int i = 0; cuda && i < 9; i++) {
    const size_t bytes = (size_t)counts[i] * esize;
    assert_int_equal(mtrain_cuda_malloc(bytes, &dev[i]), MTRAIN_SUCCESS);
    if (i < 4)
      assert_int_equal(mtrain_cuda_memcpy_to_device(dev[i], buf[i], bytes), MTRAIN_SUCCESS);
    else
      assert_int_equal(mtrain_cuda_memset(dev[i], 0xFF, bytes), MTRAIN_SUCCESS);
  }
  mtrain_tensor_t t[9];
  for (int i = 0; i < 9; i++) {
    const int32_t heads = (i == 1 || i == 2 || i == 7 || i == 8) ? s->Hkv : s->Hq;
    void *data = cuda ? dev[i] : buf[i];
    t[i] = i == 5 ? mtrain_tensor_2d(data, dt, s->N, s->Hq)
                  : mtrain_tensor_3d(data, dt, s->N, heads, s->d);
  }
  assert_int_equal(mtrain_attention_forward(ctx, plan, &t[0], &t[1], &t[2], &t[4], &t[5]),
                   MTRAIN_SUCCESS);
  if (cuda) assert_int_equal(mtrain_cuda_last_variant(ctx), MTRAIN_CUDA_VARIANT_SIMT);
  assert_int_equal(mtrain_attention_backward(ctx, plan, &t[0], &t[1], &t[2], &t[4], &t[5], &t[3],
                                             &t[6], &t[7], &t[8]),
                   MTRAIN_SUCCESS);
  for (int i = 0; cuda && i < 9; i++) {
    if (i >= 4)
      assert_int_equal(mtrain_cuda_memcpy_to_host(buf[i], dev[i], (size_t)counts[i] * esize),
                       MTRAIN_SUCCESS);
    mtrain_cuda_free(dev[i]);
  }
  for (int i = 4; i < 9; i++) {
    double *x = ts_to_double(buf[i], dt, counts[i]);
    memcpy(out[i - 4], x, sizeof(double) * (size_t)counts[i]);
    free(x);
  }
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  for (int i = 0; i < 9; i++) free(buf[i]);
}

/* Bidirectional dense attention, computed here directly: o and lse. */
static void plain_bidirectional(const shape_t *s, const double *q, const double *k, const double *v,
                                double *o, double *lse) {
  const double scale = 1.0 / sqrt((double)s->d);
  double *row = malloc(sizeof(double) * (size_t)s->N);
  for (int64_t i = 0; i < s->N; i++)
    for (int32_t h = 0; h < s->Hq; h++) {
      const int32_t hk = h / (s->Hq / s->Hkv);
      double m = -INFINITY, z = 0.0;
      for (int64_t j = 0; j < s->N; j++) {
        double dot = 0.0;
        for (int32_t c = 0; c < s->d; c++)
          dot += q[(i * s->Hq + h) * s->d + c] * k[(j * s->Hkv + hk) * s->d + c];
        row[j] = scale * dot;
        m = row[j] > m ? row[j] : m;
      }
      for (int64_t j = 0; j < s->N; j++) z += exp(row[j] - m);
      lse[i * s->Hq + h] = m + log(z);
      for (int32_t c = 0; c < s->d; c++) {
        double acc = 0.0;
        for (int64_t j = 0; j < s->N; j++)
          acc += exp(row[j] - m) / z * v[(j * s->Hkv + hk) * s->d + c];
        o[(i * s->Hq + h) * s->d + c] = acc;
      }
    }
  free(row);
}

/* The cases on each of `backends`: random non-causal masks, forward and
 * backward against the fp64 dense reference. */
static void agree(const char *const *backends, int num_backends) {
  static const shape_t shapes[] = {{300, 32, 4, 2, 32}, {421, 64, 4, 1, 64}, {97, 32, 2, 2, 32}};
  for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
    const shape_t *s = &shapes[c];
    const uint64_t seed = ts_seed(4100 + c);
    const int64_t nq = s->N * s->Hq * s->d, nk = s->N * s->Hkv * s->d, nl = s->N * s->Hq;
    double *q = malloc(sizeof(double) * (size_t)nq), *k = malloc(sizeof(double) * (size_t)nk);
    double *v = malloc(sizeof(double) * (size_t)nk), *dout = malloc(sizeof(double) * (size_t)nq);
    ts_rng_t rng;
    ts_rng_seed(&rng, seed);
    ts_fill_normal(&rng, q, MTRAIN_F64, nq, 1.0, 0);
    ts_fill_normal(&rng, k, MTRAIN_F64, nk, 1.0, 0);
    ts_fill_normal(&rng, v, MTRAIN_F64, nk, 1.0, 0);
    ts_fill_normal(&rng, dout, MTRAIN_F64, nq, 1.0, 0);
    mtrain_pattern_t *p = random_noncausal(s->N, s->Hq, s->G, seed);
    const int64_t counts[5] = {nq, nl, nq, nk, nk};
    static const char *const names[5] = {"o", "lse", "dq", "dk", "dv"};
    double *want[5], *got[5];
    for (int i = 0; i < 5; i++) {
      want[i] = malloc(sizeof(double) * (size_t)counts[i]);
      got[i] = malloc(sizeof(double) * (size_t)counts[i]);
    }
    assert_int_equal(
        mtrain_cpu_dense_reference_forward(p, s->Hkv, s->d, 0.0, q, k, v, want[0], want[1]),
        MTRAIN_SUCCESS);
    assert_int_equal(mtrain_cpu_dense_reference_backward(p, s->Hkv, s->d, 0.0, q, k, v, want[0],
                                                         want[1], dout, want[2], want[3], want[4]),
                     MTRAIN_SUCCESS);
    /* head 0 is dense: the reference there is plain bidirectional attention */
    double *po = malloc(sizeof(double) * (size_t)nq), *pl = malloc(sizeof(double) * (size_t)nl);
    plain_bidirectional(s, q, k, v, po, pl);
    for (int64_t i = 0; i < s->N; i++) {
      assert_true(fabs(pl[i * s->Hq] - want[1][i * s->Hq]) < 1e-9);
      for (int32_t x = 0; x < s->d; x++)
        assert_true(fabs(po[i * s->Hq * s->d + x] - want[0][i * s->Hq * s->d + x]) < 1e-9);
    }
    free(po);
    free(pl);
    int64_t pairs = 0;
    for (int32_t h = 0; h < s->Hq; h++) pairs += mtrain_pattern_count_pairs(p, h);
    for (int b = 0; b < num_backends; b++) {
      const char *backend = backends[b];
      const int exact = strcmp(backend, "cpu-ref") == 0;
      run(backend, p, s, q, k, v, dout, got);
      for (int i = 0; i < 5; i++) {
        char what[160];
        snprintf(what, sizeof what, "seed %llu N %lld G %d %d:%d d %d %s: %s",
                 (unsigned long long)seed, (long long)s->N, s->G, s->Hq, s->Hkv, s->d, backend,
                 names[i]);
        check(what, got[i], want[i], counts[i], exact ? 1e-10 : 1e-4);
      }
      print_message("seed %llu N %lld G %d %d:%d d %d %s: density %.3f of all N^2 pairs, forward "
                    "and backward match the dense reference\n",
                    (unsigned long long)seed, (long long)s->N, s->G, s->Hq, s->Hkv, s->d, backend,
                    (double)pairs / ((double)s->Hq * (double)s->N * (double)s->N));
    }
    for (int i = 0; i < 5; i++) free(want[i]), free(got[i]);
    mtrain_pattern_destroy(p);
    free(q), free(k), free(v), free(dout);
  }
}

static void test_attention(void **state) {
  (void)state;
  static const char *const backends[] = {"cpu-ref", "cpu"};
  agree(backends, 2);
}

/* 1 when a "cuda" context can be made here (the backend compiled in and a
 * device visible). */
static int cuda_usable(void) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  mtrain_context_t *ctx = NULL;
  if (mtrain_context_create(&cfg, NULL, &ctx) != MTRAIN_SUCCESS) {
    print_message("SKIPPED: no cuda backend or device (%s)\n", mtrain_last_error());
    return 0;
  }
  mtrain_context_destroy(ctx);
  return 1;
}

/* "cuda" computes the non-causal plans as the CPU backends do (skipped
 * without the backend or a device). */
static void test_cuda(void **state) {
  (void)state;
  if (!cuda_usable()) skip();
  static const char *const backends[] = {"cuda"};
  agree(backends, 1);
}

int main(int argc, char **argv) {
  if (argc > 1) {
    if (argc > 2 || strcmp(argv[1], "cuda") != 0) {
      fprintf(stderr, "usage: %s [cuda]\n", argv[0]);
      return 2;
    }
    if (!cuda_usable()) return 77;
    const struct CMUnitTest cuda_tests[] = {cmocka_unit_test(test_cuda)};
    return cmocka_run_group_tests(cuda_tests, NULL, NULL);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pattern),
      cmocka_unit_test(test_attention),
      cmocka_unit_test(test_cuda),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
