/* test_cross_backend.c: a backend under test against the oracle "cpu-ref"
 * (SPEC.md section 7), forward and backward, as one table-driven test (one
 * cmocka test per row of the case table, so that an unsupported case counts
 * as skipped). The backend under test is argv[1]: "cpu" (the default) or
 * "cuda", with argv[2] the CUDA kernel variant "0", "1", "2", "3" or "auto"
 * (default); variant 1 is built only with MTRAIN_CUDA_DEV_VARIANTS=ON, and
 * without it every case is refused (NOT_SUPPORTED): all skipped, exit 77.
 * Each case draws q, k, v, dout in the case dtype, runs the backend under
 * test through the public API in that dtype (outputs in guard-byte buffers,
 * fp32 lse), and runs "cpu-ref" through the API on the same dtype-rounded
 * values widened to fp64 (fp64 lse; its backward uses its own O and LSE).
 * For "cuda" every tensor is staged in device memory: the inputs are copied
 * there, each output is a device buffer with guard bytes on both sides,
 * its data poisoned with 0xFF bytes (NaN in fp32, bf16 and fp16) so that an
 * element the backend does not write fails, and the whole buffer, guards
 * included, is copied back to the host for the checks. Errors are measured
 * in fp64:
 *  - fp32: max|got - oracle| <= 1e-4 * max|oracle| for O, LSE, dQ, dK, dV;
 *  - bf16/fp16 (the FlashAttention rule): error <= max(2 x the error of the
 *    same attention computed naively in that precision (naive_attention
 *    below), 1e-4 * max|oracle|);
 *  - a dQ or dK that is exactly zero by cancellation (N = 1: one key per
 *    row, dS = P (dP - Delta) = 0) takes its 1e-4 floor relative to the
 *    largest cancelling term rather than to max|oracle| = 0;
 *  - always: MTRAIN_SUCCESS, no NaN/Inf in any output, guard bytes intact;
 *    for "cuda" with a forced variant, the call ran that variant.
 * The table covers fp32/bf16/fp16, d 32/64/128, Hq:Hkv 16:2, 4:4, 8:1, N not
 * a multiple of G (and N = 1), G 32/64/128/256, every ts_pattern kind (the
 * non-causal block masks too, at the end of the table), packed
 * batches of 2 sequences, an explicit softmax_scale, and fp64 (which "cpu"
 * does not compute: skipped); the rows after the first 24 are the shapes the
 * CUDA variants need (d 64 and 128 in bf16 and fp16 at G 64, 128 and 256).
 * A case the backend reports unsupported (MTRAIN_ERR_UNSUPPORTED_DTYPE,
 * _HEAD_DIM, MTRAIN_ERR_NOT_SUPPORTED) is skipped; for "cuda" every case is
 * skipped when the backend is not compiled in or no device is visible, and
 * the program then exits with 77 (ctest's SKIP_RETURN_CODE), never passing.
 * Seeds come from MTRAIN_TEST_SEED when set; MTRAIN_TEST_QUICK=1 keeps only
 * a few small cases (for compute-sanitizer runs). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdint.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "test_support.h"

#define FP32_REL_TOL 1e-4

typedef struct xb_case {
  mtrain_dtype_t dtype;
  int32_t d, hq, hkv;
  int64_t n;  /* tokens of the (first) sequence */
  int64_t n2; /* > 0: a packed batch whose second sequence has n2 tokens */
  int32_t g;
  ts_pattern_kind_t kind;
  double in_scale;      /* q and k are N(0, 1) * in_scale (3.0 sharpens the softmax) */
  double softmax_scale; /* config.softmax_scale; 0 = 1/sqrt(d) */
  uint64_t seed;
} xb_case_t;

/* Hq = 16 with d = 128 only at small N: the oracle and the naive
 * computation are O(N^2 Hq d). */
static const xb_case_t cases[] = {
    /* fp32 */
    {MTRAIN_F32, 64, 4, 4, 300, 0, 128, TS_PATTERN_DENSE, 1.0, 0.0, 0x3001},
    {MTRAIN_F32, 128, 16, 2, 300, 0, 128, TS_PATTERN_RANDOM_SPARSE, 1.0, 0.0, 0x3002},
    {MTRAIN_F32, 64, 8, 1, 1000, 0, 128, TS_PATTERN_BUDGETS, 1.0, 0.0, 0x3003},
    {MTRAIN_F32, 32, 4, 4, 1, 0, 128, TS_PATTERN_DENSE, 1.0, 0.0, 0x3004},
    {MTRAIN_F32, 64, 8, 1, 515, 0, 64, TS_PATTERN_BLOCK_MASK, 3.0, 0.0, 0x3005},
    {MTRAIN_F32, 128, 4, 4, 515, 0, 32, TS_PATTERN_DIAGONAL_ONLY, 1.0, 0.0, 0x3006},
    {MTRAIN_F32, 64, 16, 2, 515, 0, 64, TS_PATTERN_DENSE, 1.0, 0.05, 0x3007},
    {MTRAIN_F32, 64, 4, 4, 300, 515, 128, TS_PATTERN_RANDOM_SPARSE, 1.0, 0.0, 0x3008},
    /* bf16 */
    {MTRAIN_BF16, 64, 4, 4, 300, 0, 128, TS_PATTERN_DENSE, 1.0, 0.0, 0x3101},
    {MTRAIN_BF16, 128, 16, 2, 300, 0, 128, TS_PATTERN_RANDOM_SPARSE, 3.0, 0.0, 0x3102},
    {MTRAIN_BF16, 64, 8, 1, 1000, 0, 128, TS_PATTERN_BUDGETS, 1.0, 0.0, 0x3103},
    {MTRAIN_BF16, 32, 4, 4, 515, 0, 64, TS_PATTERN_BLOCK_MASK, 1.0, 0.0, 0x3104},
    {MTRAIN_BF16, 64, 4, 4, 1, 0, 128, TS_PATTERN_DENSE, 1.0, 0.0, 0x3105},
    {MTRAIN_BF16, 128, 8, 1, 515, 0, 32, TS_PATTERN_DIAGONAL_ONLY, 3.0, 0.0, 0x3106},
    {MTRAIN_BF16, 64, 8, 1, 300, 515, 128, TS_PATTERN_RANDOM_SPARSE, 1.0, 0.0, 0x3107},
    {MTRAIN_BF16, 64, 16, 2, 300, 0, 64, TS_PATTERN_BLOCK_MASK, 1.0, 0.2, 0x3108},
    /* fp16 */
    {MTRAIN_F16, 64, 16, 2, 300, 0, 64, TS_PATTERN_DENSE, 3.0, 0.0, 0x3201},
    {MTRAIN_F16, 128, 4, 4, 515, 0, 128, TS_PATTERN_RANDOM_SPARSE, 1.0, 0.0, 0x3202},
    {MTRAIN_F16, 64, 8, 1, 1000, 0, 32, TS_PATTERN_BLOCK_MASK, 1.0, 0.0, 0x3203},
    {MTRAIN_F16, 32, 16, 2, 1000, 0, 128, TS_PATTERN_BUDGETS, 1.0, 0.0, 0x3204},
    {MTRAIN_F16, 64, 4, 4, 1, 0, 32, TS_PATTERN_DIAGONAL_ONLY, 1.0, 0.0, 0x3205},
    {MTRAIN_F16, 128, 16, 2, 200, 0, 128, TS_PATTERN_DENSE, 1.0, 0.0, 0x3206},
    {MTRAIN_F16, 64, 8, 1, 1000, 300, 64, TS_PATTERN_BUDGETS, 3.0, 0.1, 0x3207},
    /* fp64 is the oracle's dtype only: "cpu" must refuse it (skipped) */
    {MTRAIN_F64, 64, 4, 4, 300, 0, 128, TS_PATTERN_DENSE, 1.0, 0.0, 0x3301},
    /* the shapes of the CUDA tensor-core variants (bf16/fp16, d 64/128, G
     * a multiple of 64): d 64 and 128 in bf16 and fp16 at G 64, 128 and 256,
     * N not a multiple of G, GQA 16:2 and 8:1, real budgets at N ~ 2000,
     * block masks, packed batches, N = 1 */
    {MTRAIN_BF16, 128, 16, 2, 777, 0, 64, TS_PATTERN_RANDOM_SPARSE, 1.0, 0.0, 0x3401},
    {MTRAIN_BF16, 64, 8, 1, 700, 0, 64, TS_PATTERN_DENSE, 3.0, 0.0, 0x3402},
    {MTRAIN_BF16, 128, 8, 1, 1000, 0, 256, TS_PATTERN_BLOCK_MASK, 1.0, 0.0, 0x3403},
    {MTRAIN_BF16, 64, 16, 2, 600, 0, 256, TS_PATTERN_RANDOM_SPARSE, 3.0, 0.0, 0x3404},
    {MTRAIN_BF16, 64, 16, 2, 2000, 0, 128, TS_PATTERN_BUDGETS, 1.0, 0.0, 0x3405},
    {MTRAIN_BF16, 128, 16, 2, 300, 450, 128, TS_PATTERN_BLOCK_MASK, 1.0, 0.0, 0x3406},
    {MTRAIN_BF16, 128, 16, 2, 1, 0, 64, TS_PATTERN_DENSE, 1.0, 0.0, 0x3407},
    {MTRAIN_F16, 128, 16, 2, 700, 0, 64, TS_PATTERN_BLOCK_MASK, 1.0, 0.0, 0x3501},
    {MTRAIN_F16, 64, 8, 1, 900, 0, 128, TS_PATTERN_RANDOM_SPARSE, 1.0, 0.0, 0x3502},
    {MTRAIN_F16, 128, 8, 1, 800, 0, 256, TS_PATTERN_DENSE, 1.0, 0.0, 0x3503},
    {MTRAIN_F16, 64, 4, 4, 1900, 0, 256, TS_PATTERN_BUDGETS, 1.0, 0.0, 0x3504},
    {MTRAIN_F16, 128, 16, 2, 400, 333, 256, TS_PATTERN_RANDOM_SPARSE, 1.0, 0.0, 0x3505},
    {MTRAIN_F16, 64, 16, 2, 1, 0, 256, TS_PATTERN_DENSE, 1.0, 0.0, 0x3506},
    {MTRAIN_F16, 128, 16, 2, 250, 0, 128, TS_PATTERN_BLOCK_MASK, 3.0, 0.0, 0x3507},
    {MTRAIN_F32, 128, 16, 2, 700, 0, 256, TS_PATTERN_RANDOM_SPARSE, 1.0, 0.0, 0x3601},
    /* block masks with a sink column (key block 0 in every query block): the
     * CUDA backward of variants 2 and 3 splits the sink's key-major items
     * (at least C = 8 entries a part; the sink's items here hold 144 and 120) */
    {MTRAIN_BF16, 128, 16, 2, 1100, 0, 64, TS_PATTERN_SINK_MASK, 1.0, 0.0, 0x3801},
    {MTRAIN_F16, 64, 8, 1, 1900, 0, 128, TS_PATTERN_SINK_MASK, 1.0, 0.0, 0x3802},
    /* non-causal block masks (blocks above the diagonal, no causal mask):
     * fp32 (variant 0), bf16 and fp16 at d 64 and 128, G 64, 128 and 256, N
     * not a multiple of G, GQA, a packed batch, N = 1 */
    {MTRAIN_F32, 64, 8, 2, 515, 0, 64, TS_PATTERN_NONCAUSAL, 1.0, 0.0, 0x3701},
    {MTRAIN_BF16, 128, 16, 2, 777, 0, 64, TS_PATTERN_NONCAUSAL, 1.0, 0.0, 0x3702},
    {MTRAIN_BF16, 64, 8, 1, 700, 0, 128, TS_PATTERN_NONCAUSAL, 3.0, 0.0, 0x3703},
    {MTRAIN_F16, 128, 8, 2, 600, 0, 128, TS_PATTERN_NONCAUSAL, 1.0, 0.0, 0x3704},
    {MTRAIN_F16, 64, 16, 2, 900, 0, 256, TS_PATTERN_NONCAUSAL, 1.0, 0.0, 0x3705},
    {MTRAIN_BF16, 128, 4, 4, 300, 450, 128, TS_PATTERN_NONCAUSAL, 1.0, 0.0, 0x3706},
    {MTRAIN_F16, 64, 4, 1, 1, 0, 64, TS_PATTERN_NONCAUSAL, 1.0, 0.0, 0x3707},
};
#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))

/* The cases MTRAIN_TEST_QUICK=1 keeps (by table seed): small, and together
 * fp32, bf16 and fp16, G 64 and 128, d 64 and 128, GQA, a block mask, a
 * packed batch and N = 1. */
static const uint64_t quick_seeds[] = {0x3001, 0x3105, 0x3107, 0x3108,
                                       0x3402, 0x3407, 0x3507, 0x3703};

/* The backend under test (from the command line) and whether it can run. */
typedef struct xb_target {
  const char *backend; /* "cpu" or "cuda" */
  int variant;         /* cuda: mtrain_cuda_variant_t (-1 = auto) */
  char label[32];      /* "cpu", "cuda_v1", ... (test names and messages) */
  int available;       /* 0: every case is skipped, for the reason in `why` */
  char why[160];
} xb_target_t;

static xb_target_t target = {"cpu", MTRAIN_CUDA_VARIANT_AUTO, "cpu", 1, ""};

enum { T_O, T_LSE, T_DQ, T_DK, T_DV, NUM_T };
static const char *const tensor_names[NUM_T] = {"O", "LSE", "dQ", "dK", "dV"};

/* Largest error / bound seen per dtype (index = mtrain_dtype_t) and tensor. */
static double worst_ratio[4][NUM_T];
static int ran_cases[4], skipped_cases[4];

static const char *case_desc(int idx, const xb_case_t *c, uint64_t seed) {
  static char buf[320];
  char lens[64];
  if (c->n2 > 0)
    snprintf(lens, sizeof lens, "N=%lld+%lld (packed batch)", (long long)c->n, (long long)c->n2);
  else
    snprintf(lens, sizeof lens, "N=%lld", (long long)c->n);
  snprintf(buf, sizeof buf,
           "case %d (%s): dtype=%s d=%d Hq:Hkv=%d:%d %s G=%d pattern=%s input_scale=%g "
           "softmax_scale=%g seed=0x%llx",
           idx, target.label, mtrain_dtype_name(c->dtype), c->d, c->hq, c->hkv, lens, c->g,
           ts_pattern_kind_name(c->kind), c->in_scale, c->softmax_scale, (unsigned long long)seed);
  return buf;
}

static double now_s(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the naive low-precision attention ------------------------------------- */

/* x rounded to `dtype` and back, as a framework storing it in dtype would
 * (the scalar conversions mtrain_convert uses: round to nearest even). */
static float rnd(float x, mtrain_dtype_t dtype) {
  if (dtype == MTRAIN_BF16) return mtrain_bf16_to_float(mtrain_float_to_bf16(x));
  if (dtype == MTRAIN_F16) return mtrain_half_to_float(mtrain_float_to_half(x));
  return x;
}

static float dot_f32(const float *a, const float *b, int32_t d) {
  float s = 0.0f;
  for (int32_t c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

/* Dense-masked attention of one sequence (over mtrain_pattern_allowed) done
 * naively in `dtype`: every intermediate a framework would materialise is
 * rounded to the dtype; dot products and sums accumulate in fp32.
 *   S = rnd(q.k * scale), LSE = fp32 logsumexp of S, P = rnd(fp32 softmax(S)),
 *   O = rnd(sum P v); Delta = rnd(dout . O), dP = rnd(dout . v),
 *   dS = rnd(P (dP - Delta)), dQ = rnd(scale sum dS k),
 *   dK = rnd(scale sum dS q), dV = rnd(sum P dout) (dK, dV summed over the
 *   GQA group in fp32 before the rounding).
 * Inputs are the dtype values as fp32 [n, heads, d]; outputs fp64. */
static void naive_attention(const mtrain_pattern_t *p, mtrain_dtype_t dtype, int32_t hkv, int32_t d,
                            float scale, const float *q, const float *k, const float *v,
                            const float *dout, double *o, double *lse, double *dq, double *dk,
                            double *dv) {
  const int64_t n = mtrain_pattern_seq_len(p);
  const int32_t hq = mtrain_pattern_num_heads(p), group = hq / hkv;
  const int causal = mtrain_pattern_is_causal(p);
  int64_t *cols = malloc(sizeof(int64_t) * (size_t)n);
  float *s = malloc(sizeof(float) * (size_t)n), *pr = malloc(sizeof(float) * (size_t)n);
  float *orow = malloc(sizeof(float) * (size_t)d), *dqrow = malloc(sizeof(float) * (size_t)d);
  float *dk_acc = calloc((size_t)(n * hkv * d), sizeof(float));
  float *dv_acc = calloc((size_t)(n * hkv * d), sizeof(float));
  assert_true(cols && s && pr && orow && dqrow && dk_acc && dv_acc);
  for (int32_t h = 0; h < hq; h++) {
    const int32_t hk = h / group;
    for (int64_t i = 0; i < n; i++) {
      const float *qi = q + (i * hq + h) * d, *doi = dout + (i * hq + h) * d;
      int64_t m = 0;
      for (int64_t j = 0; j < (causal ? i + 1 : n); j++)
        if (mtrain_pattern_allowed(p, h, i, j)) cols[m++] = j;
      float mx = -INFINITY;
      for (int64_t e = 0; e < m; e++) {
        s[e] = rnd(dot_f32(qi, k + (cols[e] * hkv + hk) * d, d) * scale, dtype);
        if (s[e] > mx) mx = s[e];
      }
      float sum = 0.0f;
      for (int64_t e = 0; e < m; e++) sum += expf(s[e] - mx);
      lse[i * hq + h] = mx + logf(sum);
      for (int64_t e = 0; e < m; e++) pr[e] = rnd(expf(s[e] - mx) / sum, dtype);
      for (int32_t c = 0; c < d; c++) orow[c] = 0.0f;
      for (int64_t e = 0; e < m; e++) {
        const float *vj = v + (cols[e] * hkv + hk) * d;
        for (int32_t c = 0; c < d; c++) orow[c] += pr[e] * vj[c];
      }
      for (int32_t c = 0; c < d; c++) {
        orow[c] = rnd(orow[c], dtype);
        o[(i * hq + h) * d + c] = orow[c];
      }
      /* backward of this row */
      const float delta = rnd(dot_f32(doi, orow, d), dtype);
      for (int32_t c = 0; c < d; c++) dqrow[c] = 0.0f;
      for (int64_t e = 0; e < m; e++) {
        const int64_t kv = (cols[e] * hkv + hk) * d;
        const float dp = rnd(dot_f32(doi, v + kv, d), dtype);
        const float ds = rnd(pr[e] * (dp - delta), dtype);
        for (int32_t c = 0; c < d; c++) {
          dqrow[c] += ds * k[kv + c];
          dk_acc[kv + c] += ds * qi[c];
          dv_acc[kv + c] += pr[e] * doi[c];
        }
      }
      for (int32_t c = 0; c < d; c++) dq[(i * hq + h) * d + c] = rnd(scale * dqrow[c], dtype);
    }
  }
  for (int64_t x = 0; x < n * hkv * d; x++) {
    dk[x] = rnd(scale * dk_acc[x], dtype);
    dv[x] = rnd(dv_acc[x], dtype);
  }
  free(cols);
  free(s);
  free(pr);
  free(orow);
  free(dqrow);
  free(dk_acc);
  free(dv_acc);
}

/* ---- running one backend through the API ----------------------------------- */

typedef struct run_bufs {
  ts_buf_t o, lse, dq, dk, dv;
} run_bufs_t;

static int is_unsupported(mtrain_status_t st) {
  return st == MTRAIN_ERR_UNSUPPORTED_DTYPE || st == MTRAIN_ERR_UNSUPPORTED_HEAD_DIM ||
         st == MTRAIN_ERR_NOT_SUPPORTED;
}

/* The message of the failed attention call of the last run_backend (kept
 * before the clean-up calls that follow it). */
static char call_error[512];

/* ---- device staging (backend "cuda") ----------------------------------------- */

/* Fails the test with the status and message of a failed device helper. */
static void dev_check(mtrain_status_t st, const char *what, const char *desc) {
  if (st)
    fail_msg("%s failed: %s (%s) in %s", what, mtrain_status_name(st), mtrain_last_error(), desc);
}

/* A device copy of `bytes` of host memory (the test fails when it cannot be
 * made). */
static void *dev_upload(const void *host, size_t bytes, const char *desc) {
  void *dev = NULL;
  dev_check(mtrain_cuda_malloc(bytes, &dev), "mtrain_cuda_malloc of an input", desc);
  dev_check(mtrain_cuda_memcpy_to_device(dev, host, bytes), "mtrain_cuda_memcpy_to_device", desc);
  return dev;
}

/* A device output buffer laid out like ts_buf_t: TS_GUARD_BYTES of
 * TS_GUARD_VALUE on both sides of `bytes` of data poisoned with 0xFF bytes
 * (a NaN in fp32, bf16 and fp16, so that an element the backend does not
 * write fails the NaN check). Returns the base; the data starts
 * TS_GUARD_BYTES in. */
static unsigned char *dev_output(size_t bytes, const char *desc) {
  void *dev = NULL;
  dev_check(mtrain_cuda_malloc(bytes + 2 * TS_GUARD_BYTES, &dev), "mtrain_cuda_malloc of an output",
            desc);
  dev_check(mtrain_cuda_memset(dev, TS_GUARD_VALUE, bytes + 2 * TS_GUARD_BYTES),
            "mtrain_cuda_memset (guards)", desc);
  dev_check(mtrain_cuda_memset((unsigned char *)dev + TS_GUARD_BYTES, 0xFF, bytes),
            "mtrain_cuda_memset (poison)", desc);
  return dev;
}

/* Copies a device output buffer from dev_output, guards included, over the
 * host buffer b (from ts_buf_alloc of the same data size). */
static void dev_download(ts_buf_t *b, const unsigned char *dev, const char *desc) {
  dev_check(mtrain_cuda_memcpy_to_host(b->base, dev, b->bytes + 2 * TS_GUARD_BYTES),
            "mtrain_cuda_memcpy_to_host of an output", desc);
}

/* Forward then backward (with the forward's own O and LSE) of `backend` in
 * `dtype` on the given host inputs, outputs in fresh host guard-byte
 * buffers (lse in lse_dtype). For "cuda" the inputs are staged on the
 * device, the outputs computed into poisoned device buffers with guards and
 * copied back (guards included) when both calls succeed, and the target's
 * variant is forced. Returns the first non-success status (0 when both
 * ran). */
static mtrain_status_t run_backend(const char *backend, const xb_case_t *c,
                                   const mtrain_seqs_t *seqs,
                                   const mtrain_pattern_t *const *patterns, mtrain_dtype_t dtype,
                                   mtrain_dtype_t lse_dtype, int64_t tokens, void *q, void *k,
                                   void *v, void *dout, run_bufs_t *out, const char **where,
                                   const char *desc) {
  const int device = strcmp(backend, "cuda") == 0;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = c->g;
  cfg.softmax_scale = c->softmax_scale;
  mtrain_context_t *ctx = NULL;
  mtrain_plan_t *plan = NULL;
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &ctx);
  if (st)
    fail_msg("mtrain_context_create(%s) failed: %s (%s) in %s", backend, mtrain_status_name(st),
             mtrain_last_error(), desc);
  if (strcmp(mtrain_context_backend_name(ctx), backend) != 0)
    fail_msg("context runs backend '%s', not '%s' (MTRAIN_BACKEND set?) in %s",
             mtrain_context_backend_name(ctx), backend, desc);
  if (device && target.variant != MTRAIN_CUDA_VARIANT_AUTO)
    dev_check(mtrain_cuda_set_variant(ctx, (mtrain_cuda_variant_t)target.variant),
              "mtrain_cuda_set_variant", desc);
  st = mtrain_plan_create(ctx, seqs, patterns, &plan);
  if (st)
    fail_msg("mtrain_plan_create(%s) failed: %s (%s) in %s", backend, mtrain_status_name(st),
             mtrain_last_error(), desc);
  if (mtrain_plan_local_tokens(plan) != tokens)
    fail_msg("plan holds %lld tokens, expected %lld in %s",
             (long long)mtrain_plan_local_tokens(plan), (long long)tokens, desc);
  const size_t es = mtrain_dtype_size(dtype);
  const int64_t nq = tokens * c->hq * c->d, nk = tokens * c->hkv * c->d;
  const size_t bq = es * (size_t)nq, bk = es * (size_t)nk;
  out->o = ts_buf_alloc(bq);
  out->lse = ts_buf_alloc(mtrain_dtype_size(lse_dtype) * (size_t)(tokens * c->hq));
  out->dq = ts_buf_alloc(bq);
  out->dk = ts_buf_alloc(bk);
  out->dv = ts_buf_alloc(bk);
  ts_buf_t *outs[5] = {&out->o, &out->lse, &out->dq, &out->dk, &out->dv};
  void *in_ptr[4] = {q, k, v, dout}, *out_ptr[5];
  void *dev_in[4] = {NULL, NULL, NULL, NULL};
  unsigned char *dev_out[5] = {NULL, NULL, NULL, NULL, NULL};
  if (device) {
    const size_t in_bytes[4] = {bq, bk, bk, bq};
    for (int i = 0; i < 4; i++) in_ptr[i] = dev_in[i] = dev_upload(in_ptr[i], in_bytes[i], desc);
    for (int i = 0; i < 5; i++) {
      dev_out[i] = dev_output(outs[i]->bytes, desc);
      out_ptr[i] = dev_out[i] + TS_GUARD_BYTES;
    }
  } else {
    for (int i = 0; i < 5; i++) out_ptr[i] = outs[i]->data;
  }
  mtrain_tensor_t tq = mtrain_tensor_3d(in_ptr[0], dtype, tokens, c->hq, c->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(in_ptr[1], dtype, tokens, c->hkv, c->d);
  mtrain_tensor_t tv = mtrain_tensor_3d(in_ptr[2], dtype, tokens, c->hkv, c->d);
  mtrain_tensor_t tdo = mtrain_tensor_3d(in_ptr[3], dtype, tokens, c->hq, c->d);
  mtrain_tensor_t to = mtrain_tensor_3d(out_ptr[0], dtype, tokens, c->hq, c->d);
  mtrain_tensor_t tl = mtrain_tensor_2d(out_ptr[1], lse_dtype, tokens, c->hq);
  mtrain_tensor_t tdq = mtrain_tensor_3d(out_ptr[2], dtype, tokens, c->hq, c->d);
  mtrain_tensor_t tdk = mtrain_tensor_3d(out_ptr[3], dtype, tokens, c->hkv, c->d);
  mtrain_tensor_t tdv = mtrain_tensor_3d(out_ptr[4], dtype, tokens, c->hkv, c->d);
  call_error[0] = '\0';
  int ran[2] = {-1, -1}; /* the CUDA variant of the forward and of the backward */
  *where = "forward";
  st = mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl);
  if (st == MTRAIN_SUCCESS) {
    if (device) ran[0] = mtrain_cuda_last_variant(ctx);
    *where = "backward";
    st = mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv);
    if (device) ran[1] = mtrain_cuda_last_variant(ctx);
  }
  if (st) snprintf(call_error, sizeof call_error, "%s", mtrain_last_error());
  if (device) {
    if (st == MTRAIN_SUCCESS) {
      for (int i = 0; i < 5; i++) dev_download(outs[i], dev_out[i], desc);
      if (target.variant != MTRAIN_CUDA_VARIANT_AUTO &&
          (ran[0] != target.variant || ran[1] != target.variant))
        fail_msg("variant %d was forced, but the forward ran variant %d and the backward %d in %s",
                 target.variant, ran[0], ran[1], desc);
    }
    for (int i = 0; i < 4; i++) mtrain_cuda_free(dev_in[i]);
    for (int i = 0; i < 5; i++) mtrain_cuda_free(dev_out[i]);
  }
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  return st;
}

/* Frees the output buffers of run_backend. */
static void free_bufs(run_bufs_t *b) {
  ts_buf_free(&b->o);
  ts_buf_free(&b->lse);
  ts_buf_free(&b->dq);
  ts_buf_free(&b->dk);
  ts_buf_free(&b->dv);
}

/* ---- the test ---------------------------------------------------------------- */

/* One case of the table (state): the backend under test against the oracle,
 * skipped when the target cannot run or reports the case unsupported. */
static void test_vs_cpu_ref(void **state) {
  const xb_case_t *c = *state;
  const int idx = (int)(c - cases);
  const uint64_t seed = ts_seed(c->seed);
  char desc[320];
  snprintf(desc, sizeof desc, "%s", case_desc(idx, c, seed));
  if (!target.available) {
    print_message("%s: skipped, %s\n", desc, target.why);
    skipped_cases[c->dtype]++;
    skip();
  }
  const double t0 = now_s();

  /* sequences and patterns */
  const int32_t num_seqs = c->n2 > 0 ? 2 : 1;
  const int64_t lens[2] = {c->n, c->n2};
  int64_t offsets[3] = {0, c->n, c->n + c->n2};
  mtrain_pattern_t *pats[2] = {NULL, NULL};
  for (int32_t s = 0; s < num_seqs; s++)
    pats[s] = ts_make_pattern(c->kind, lens[s], c->hq, c->g, seed + (uint64_t)s);
  const mtrain_seqs_t seqs = {num_seqs, offsets};
  const mtrain_seqs_t *seqs_arg = num_seqs > 1 ? &seqs : NULL;
  const mtrain_pattern_t *const *pats_arg = (const mtrain_pattern_t *const *)pats;
  const int64_t T = offsets[num_seqs], hq = c->hq, hkv = c->hkv, d = c->d;
  const int64_t nq = T * hq * d, nk = T * hkv * d, nl = T * hq;
  const int64_t counts[NUM_T] = {nq, nl, nq, nk, nk};

  /* inputs in the case dtype, and their exact values in fp64 */
  const size_t es = mtrain_dtype_size(c->dtype);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  void *q = malloc(es * (size_t)nq), *k = malloc(es * (size_t)nk), *v = malloc(es * (size_t)nk);
  void *dout = malloc(es * (size_t)nq);
  double *q64 = malloc(sizeof(double) * (size_t)nq), *k64 = malloc(sizeof(double) * (size_t)nk);
  double *v64 = malloc(sizeof(double) * (size_t)nk), *do64 = malloc(sizeof(double) * (size_t)nq);
  assert_true(q && k && v && dout && q64 && k64 && v64 && do64);
  ts_fill_normal(&rng, q, c->dtype, nq, c->in_scale, q64);
  ts_fill_normal(&rng, k, c->dtype, nk, c->in_scale, k64);
  ts_fill_normal(&rng, v, c->dtype, nk, 1.0, v64);
  ts_fill_normal(&rng, dout, c->dtype, nq, 1.0, do64);

  /* the backend under test */
  run_bufs_t cpu;
  const char *where = "";
  mtrain_status_t st = run_backend(target.backend, c, seqs_arg, pats_arg, c->dtype, MTRAIN_F32, T,
                                   q, k, v, dout, &cpu, &where, desc);
  if (is_unsupported(st)) {
    print_message("%s: skipped, '%s' %s reports %s: %s\n", desc, target.label, where,
                  mtrain_status_name(st), call_error);
    skipped_cases[c->dtype]++;
    free_bufs(&cpu);
    for (int32_t s = 0; s < num_seqs; s++) mtrain_pattern_destroy(pats[s]);
    free(q), free(k), free(v), free(dout), free(q64), free(k64), free(v64), free(do64);
    skip();
  }
  if (st)
    fail_msg("'%s' %s returned %s (%s) in %s", target.label, where, mtrain_status_name(st),
             call_error, desc);

  /* the oracle, on the same values widened to fp64 */
  run_bufs_t ref;
  st = run_backend("cpu-ref", c, seqs_arg, pats_arg, MTRAIN_F64, MTRAIN_F64, T, q64, k64, v64, do64,
                   &ref, &where, desc);
  if (st)
    fail_msg("'cpu-ref' %s returned %s (%s) in %s", where, mtrain_status_name(st), call_error,
             desc);

  const ts_buf_t *cpu_bufs[NUM_T] = {&cpu.o, &cpu.lse, &cpu.dq, &cpu.dk, &cpu.dv};
  const ts_buf_t *ref_bufs[NUM_T] = {&ref.o, &ref.lse, &ref.dq, &ref.dk, &ref.dv};
  const mtrain_dtype_t cpu_dt[NUM_T] = {c->dtype, MTRAIN_F32, c->dtype, c->dtype, c->dtype};
  for (int t = 0; t < NUM_T; t++) {
    if (!ts_buf_guards_ok(cpu_bufs[t]))
      fail_msg("'%s' output %s: guard bytes overwritten in %s", target.label, tensor_names[t],
               desc);
    if (!ts_buf_guards_ok(ref_bufs[t]))
      fail_msg("'cpu-ref' output %s: guard bytes overwritten in %s", tensor_names[t], desc);
  }
  double *got[NUM_T], *want[NUM_T];
  for (int t = 0; t < NUM_T; t++) {
    got[t] = ts_to_double(cpu_bufs[t]->data, cpu_dt[t], counts[t]);
    want[t] = ts_to_double(ref_bufs[t]->data, MTRAIN_F64, counts[t]);
    if (ts_has_nonfinite(got[t], counts[t]))
      fail_msg("'%s' output %s holds NaN/Inf (or an element left unwritten) in %s", target.label,
               tensor_names[t], desc);
    if (ts_has_nonfinite(want[t], counts[t]))
      fail_msg("'cpu-ref' output %s holds NaN/Inf in %s", tensor_names[t], desc);
  }

  /* the naive low-precision computation, one sequence at a time */
  double naive_err[NUM_T] = {0};
  if (c->dtype != MTRAIN_F32) {
    double *nv[NUM_T];
    for (int t = 0; t < NUM_T; t++) {
      nv[t] = malloc(sizeof(double) * (size_t)counts[t]);
      assert_non_null(nv[t]);
    }
    float *qf = malloc(sizeof(float) * (size_t)nq), *kf = malloc(sizeof(float) * (size_t)nk);
    float *vf = malloc(sizeof(float) * (size_t)nk), *dof = malloc(sizeof(float) * (size_t)nq);
    assert_true(qf && kf && vf && dof);
    assert_int_equal(mtrain_convert(q, c->dtype, qf, MTRAIN_F32, nq), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_convert(k, c->dtype, kf, MTRAIN_F32, nk), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_convert(v, c->dtype, vf, MTRAIN_F32, nk), MTRAIN_SUCCESS);
    assert_int_equal(mtrain_convert(dout, c->dtype, dof, MTRAIN_F32, nq), MTRAIN_SUCCESS);
    const float scale = (float)(c->softmax_scale > 0 ? c->softmax_scale : 1.0 / sqrt((double)c->d));
    for (int32_t s = 0; s < num_seqs; s++) {
      const int64_t off = offsets[s];
      naive_attention(pats[s], c->dtype, c->hkv, c->d, scale, qf + off * hq * d, kf + off * hkv * d,
                      vf + off * hkv * d, dof + off * hq * d, nv[T_O] + off * hq * d,
                      nv[T_LSE] + off * hq, nv[T_DQ] + off * hq * d, nv[T_DK] + off * hkv * d,
                      nv[T_DV] + off * hkv * d);
    }
    for (int t = 0; t < NUM_T; t++) {
      naive_err[t] = ts_max_abs_diff(nv[t], want[t], counts[t]);
      free(nv[t]);
    }
    free(qf);
    free(kf);
    free(vf);
    free(dof);
  }

  /* errors and bounds. The fp32 floor is relative to max|oracle|; when a
   * gradient is exactly zero because dS = P (dP - Delta) cancels (every row
   * attends to one key, as with N = 1), max|oracle| is 0 and the floor is
   * taken relative to the largest cancelling term instead: scale *
   * max|Delta| * max|k| for dQ and scale * max|Delta| * max|q| for dK, with
   * Delta_i = dout_i . O_i from the oracle. */
  double cancel_mag[NUM_T] = {0};
  {
    const double sc = c->softmax_scale > 0 ? c->softmax_scale : 1.0 / sqrt((double)c->d);
    double max_delta = 0.0;
    for (int64_t r = 0; r < nl; r++) {
      double dl = 0.0;
      for (int64_t x = 0; x < d; x++) dl += do64[r * d + x] * want[T_O][r * d + x];
      if (fabs(dl) > max_delta) max_delta = fabs(dl);
    }
    cancel_mag[T_DQ] = sc * max_delta * ts_max_abs(k64, nk);
    cancel_mag[T_DK] = sc * max_delta * ts_max_abs(q64, nq);
  }
  char report[1024];
  int len = 0, failed = 0;
  char summary[512];
  int slen = 0;
  for (int t = 0; t < NUM_T; t++) {
    const double err = ts_max_abs_diff(got[t], want[t], counts[t]);
    double ref_mag = ts_max_abs(want[t], counts[t]);
    if (ref_mag == 0.0 && (t == T_DQ || t == T_DK))
      ref_mag = cancel_mag[t]; /* exactly zero by cancellation (single-key rows, N = 1) */
    const double floor_bound = FP32_REL_TOL * ref_mag;
    const double bound = fmax(2.0 * naive_err[t], floor_bound);
    const double ratio = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0.0);
    if (ratio > worst_ratio[c->dtype][t]) worst_ratio[c->dtype][t] = ratio;
    slen += snprintf(summary + slen, sizeof summary - (size_t)slen, " %s %.2g/%.2g",
                     tensor_names[t], err, bound);
    if (!(err <= bound)) {
      failed = 1;
      if (len < (int)sizeof report)
        len += snprintf(report + len, sizeof report - (size_t)len,
                        "\n  %s: max|%s - oracle| = %.4g > bound %.4g (naive %s error %.4g, "
                        "fp32 floor 1e-4*max|oracle| = %.4g)",
                        tensor_names[t], target.label, err, bound, mtrain_dtype_name(c->dtype),
                        naive_err[t], floor_bound);
    }
  }
  ran_cases[c->dtype]++;
  print_message("%s: err/bound%s (%.2f s)\n", desc, summary, now_s() - t0);

  for (int t = 0; t < NUM_T; t++) {
    free(got[t]);
    free(want[t]);
  }
  free_bufs(&cpu);
  free_bufs(&ref);
  for (int32_t s = 0; s < num_seqs; s++) mtrain_pattern_destroy(pats[s]);
  free(q), free(k), free(v), free(dout), free(q64), free(k64), free(v64), free(do64);
  if (failed)
    fail_msg("'%s' differs from the oracle 'cpu-ref' in %s:%s", target.label, desc, report);
}

/* 1 when `name` is a compiled-in backend. */
static int backend_compiled(const char *name) {
  const char *names[16];
  const int n = mtrain_backend_list(names, 16);
  for (int i = 0; i < n && i < 16; i++)
    if (strcmp(names[i], name) == 0) return 1;
  return 0;
}

/* 1 when case c is one of the MTRAIN_TEST_QUICK cases. */
static int is_quick(const xb_case_t *c) {
  for (size_t i = 0; i < sizeof quick_seeds / sizeof quick_seeds[0]; i++)
    if (quick_seeds[i] == c->seed) return 1;
  return 0;
}

/* Reads the backend under test from the command line and decides whether
 * it can run here. Returns 0, or 1 on a bad command line (usage printed). */
static int parse_target(int argc, char **argv) {
  if (argc > 3 || (argc > 1 && strcmp(argv[1], "cpu") != 0 && strcmp(argv[1], "cuda") != 0) ||
      (argc > 2 && strcmp(argv[1], "cuda") != 0) ||
      (argc > 2 && strcmp(argv[2], "0") != 0 && strcmp(argv[2], "1") != 0 &&
       strcmp(argv[2], "2") != 0 && strcmp(argv[2], "3") != 0 && strcmp(argv[2], "auto") != 0)) {
    fprintf(stderr, "usage: %s [cpu | cuda [0|1|2|3|auto]]\n", argv[0]);
    return 1;
  }
  if (argc < 2 || strcmp(argv[1], "cpu") == 0) return 0;
  target.backend = "cuda";
  target.variant = argc < 3 || strcmp(argv[2], "auto") == 0 ? MTRAIN_CUDA_VARIANT_AUTO
                                                            : (int)strtol(argv[2], NULL, 10);
  if (target.variant == MTRAIN_CUDA_VARIANT_AUTO)
    snprintf(target.label, sizeof target.label, "cuda");
  else
    snprintf(target.label, sizeof target.label, "cuda_v%d", target.variant);
  if (!backend_compiled("cuda")) {
    target.available = 0;
    snprintf(target.why, sizeof target.why,
             "backend 'cuda' is not compiled into this build (MTRAIN_WITH_CUDA=OFF)");
  } else if (mtrain_cuda_device_count() == 0) {
    target.available = 0;
    snprintf(target.why, sizeof target.why, "no CUDA device is visible");
  }
  return 0;
}

int main(int argc, char **argv) {
  if (parse_target(argc, argv)) return 2;
  const char *quick_env = getenv("MTRAIN_TEST_QUICK");
  const int quick = quick_env && strcmp(quick_env, "0") != 0 && quick_env[0] != '\0';
  static struct CMUnitTest tests[NUM_CASES];
  static char names[NUM_CASES][128];
  int num_tests = 0;
  for (int i = 0; i < NUM_CASES; i++) {
    const xb_case_t *c = &cases[i];
    if (quick && !is_quick(c)) continue;
    snprintf(names[i], sizeof names[i], "%s_vs_cpu_ref[%d] %s d%d %d:%d N%lld%s%s G%d %s",
             target.label, i, mtrain_dtype_name(c->dtype), c->d, c->hq, c->hkv, (long long)c->n,
             c->n2 > 0 ? "+" : "", c->n2 > 0 ? "packed" : "", c->g, ts_pattern_kind_name(c->kind));
    tests[num_tests++] = (struct CMUnitTest){names[i], test_vs_cpu_ref, NULL, NULL, (void *)c};
  }
  if (quick) print_message("MTRAIN_TEST_QUICK: %d of the %d cases\n", num_tests, NUM_CASES);
  if (!target.available)
    print_message("backend under test '%s': every case is SKIPPED: %s\n", target.label, target.why);
  const int rc = _cmocka_run_group_tests("cross_backend", tests, (size_t)num_tests, NULL, NULL);
  int ran_any = 0;
  for (int dt = 0; dt < 4; dt++) {
    ran_any |= ran_cases[dt] > 0;
    if (!ran_cases[dt] && !skipped_cases[dt]) continue;
    if (!ran_cases[dt]) {
      print_message("%s: %d case(s) skipped\n", mtrain_dtype_name((mtrain_dtype_t)dt),
                    skipped_cases[dt]);
      continue;
    }
    print_message("%s: %d case(s) compared, %d skipped; worst err/bound: O %.3g, LSE %.3g, "
                  "dQ %.3g, dK %.3g, dV %.3g\n",
                  mtrain_dtype_name((mtrain_dtype_t)dt), ran_cases[dt], skipped_cases[dt],
                  worst_ratio[dt][T_O], worst_ratio[dt][T_LSE], worst_ratio[dt][T_DQ],
                  worst_ratio[dt][T_DK], worst_ratio[dt][T_DV]);
  }
  /* nothing compared and nothing failed: the whole run was skipped (ctest
   * reports 77 as "Skipped", never as passed) */
  if (rc == 0 && !ran_any) {
    print_message("'%s': all cases SKIPPED, none compared\n", target.label);
    return 77;
  }
  return rc;
}
