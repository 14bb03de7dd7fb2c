/* test_cuda_block_scores.c: the "cuda" backend's block scores (SPEC.md
 * section 9, the block_scores slot) against the cpu-ref backend.
 *  (a) scores of every method (precise from a dense forward's LSE, strided
 *      antidiagonal, mean-pooled), GQA 8:2, d 64 and 128, N 1000 (G 64) and
 *      3001 (G 128), fp32, bf16 and fp16 inputs, LSE fp32 and fp64: the
 *      masses (precise, antidiag) agree per entry within 1e-12 relative,
 *      the logits (meanpool) within 1e-12 of the largest |logit|. Both
 *      backends add in the same order in fp64 without fused multiply-adds;
 *      only the last bits of exp() differ, and the antidiagonal normaliser
 *      (cpu-ref's exact fixed-point sum, cuda's fp64 sum in column order:
 *      within n eps relative, n the strided columns of the row);
 *  (b) the distributed contract: scoring only the odd query blocks (their
 *      slots packed, as a rank holds them) writes bitwise the rows of the
 *      whole run and leaves every other row at zero, and in the compact form
 *      (scores_row: only those rows held) writes the same bits;
 *  (c) patterns selected end to end on a cuda context (device tensors;
 *      top-p and top-k, all three methods) equal the host selection of the
 *      cuda scores exactly, and the selection of the cpu-ref scores except in
 *      query blocks where the cpu-ref selection has a near tie (a decision
 *      within 1e-9 of the row's scale; counted and printed, none expected);
 *  (d) bad arguments of the slot are refused naming the problem;
 *  (e) the non-causal scores (SPEC.md section 9.7, args.noncausal: rows of
 *      nb entries over every key, precise from the LSE of a bidirectional
 *      dense forward) of cases 0 and 3: (a), (b) and (c) as above, the
 *      selection with options.noncausal (forced blocks on both sides).
 * (a)-(e) run the exact fp64 kernels (MTRAIN_CUDA_BLOCK_SCORES=fp64, set here).
 *  (f) the default path: the tensor-core kernels (block_scores_mma.cuh) for
 *      the bf16 and fp16 cases, precise and antidiag, causal and non-causal:
 *      each entry within the tolerance derived in
 *      tests/cuda_emu/test_block_scores_mma_emu.cpp (relative to the entry:
 *      rel from the case's largest s sum_x |q_x k_x| and |lse|), some entry
 *      not bitwise the fp64 path's (the tensor cores did score it), (b)'s
 *      subset and compact rows bitwise, and (c)'s selection with a near tie
 *      meaning a decision within 2 rel of the row's scale; fp32 keys (as the
 *      distributed selection gathers them): exact copies of the keys score
 *      bitwise as the keys, keys the dtype does not hold as the fp64 path;
 *  (g) MTRAIN_CUDA_BLOCK_SCORES with an unknown value is refused.
 * MTRAIN_TEST_QUICK=1 runs the N 1000 cases only (the sanitizer runs).
 * Skipped (exit 77) without a CUDA device. Seeds are printed;
 * MTRAIN_TEST_SEED overrides them. */
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

#include "core/runtime/backend.h"
#include "core/runtime/block_select.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "test_support.h"

static int have_gpu;

static void require_gpu(void) {
  if (have_gpu) return;
  print_message("SKIPPED: no CUDA device is visible\n");
  skip();
}

/* MTRAIN_TEST_QUICK=1 (the sanitizer runs): the N 1000 cases only. */
static void require_full(int64_t N) {
  const char *e = getenv("MTRAIN_TEST_QUICK");
  if (N <= 1000 || !e || strcmp(e, "1") != 0) return;
  print_message("SKIPPED: MTRAIN_TEST_QUICK=1 runs the N 1000 cases only\n");
  skip();
}

#define CHECK_OK(x)                                                                                \
  do {                                                                                             \
    const mtrain_status_t st_ = (x);                                                               \
    if (st_) fail_msg("%s: %s (%s)", #x, mtrain_status_name(st_), mtrain_last_error());            \
  } while (0)

static mtrain_context_t *make_ctx(const char *backend, int32_t G) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  CHECK_OK(mtrain_context_create(&cfg, NULL, &ctx));
  return ctx;
}

static void *dev_copy(const void *host, size_t bytes) {
  void *d = NULL;
  CHECK_OK(mtrain_cuda_malloc(bytes, &d));
  CHECK_OK(mtrain_cuda_memcpy_to_device(d, host, bytes));
  /* the backend's stream does not wait for the default stream */
  CHECK_OK(mtrain_cuda_device_synchronize());
  return d;
}

/* ---- one case: inputs on the host and on the device -------------------------------------- */

typedef struct gcase {
  int64_t N;
  int32_t G, Hq, Hkv, d, S;
  mtrain_dtype_t dtype;
  int lse64;
} gcase_t;

static const gcase_t cases[] = {
    {1000, 64, 8, 2, 64, 8, MTRAIN_F32, 0},    /* N % G = 40 */
    {1000, 64, 8, 2, 64, 8, MTRAIN_BF16, 1},   /* lse fp64 */
    {3001, 128, 8, 2, 128, 8, MTRAIN_BF16, 0}, /* N % G = 57 */
    {3001, 128, 8, 2, 128, 16, MTRAIN_F16, 1}, /* stride 16, lse fp64 */
};
#define NCASES (sizeof cases / sizeof cases[0])

typedef struct problem {
  gcase_t c;
  uint64_t seed;
  int nc;          /* non-causal (SPEC.md 9.7): rows of nb entries, the LSE bidirectional */
  int64_t nb, tri; /* tri: entries per head (the triangle, or nb * nb non-causally) */
  size_t esz;
  void *q, *k, *lse;          /* host: q, k in c.dtype, lse fp32 or fp64 */
  void *dq, *dk, *dlse, *dsc; /* device; dsc: Hq * tri doubles */
} problem_t;

static void problem_make(problem_t *p, const gcase_t *c, uint64_t seed, int nc) {
  memset(p, 0, sizeof *p);
  p->c = *c;
  p->seed = seed;
  p->nc = nc;
  const int64_t N = c->N, nq = N * c->Hq * c->d, nk = N * c->Hkv * c->d;
  p->nb = (N + c->G - 1) / c->G;
  p->tri = nc ? p->nb * p->nb : mtrain_block_tri(p->nb);
  p->esz = mtrain_dtype_size(c->dtype);
  float *q = malloc(sizeof(float) * (size_t)nq), *k = malloc(sizeof(float) * (size_t)nk);
  float *v = malloc(sizeof(float) * (size_t)nk), *o = malloc(sizeof(float) * (size_t)nq);
  float *lse = malloc(sizeof(float) * (size_t)(N * c->Hq));
  p->q = malloc(p->esz * (size_t)nq);
  p->k = malloc(p->esz * (size_t)nk);
  assert_true(q && k && v && o && lse && p->q && p->k);
  /* structured inputs (peaked attention) and noise of the seed's own */
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = seed;
  so.rope_base = 4.0 * (double)N;
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, c->Hq, c->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, c->Hkv, c->d);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F32, N, c->Hkv, c->d);
  CHECK_OK(mtrain_generate_structured(&so, &tq, &tk, &tv));
  ts_rng_t rng;
  ts_rng_seed(&rng, seed ^ 0x5eed);
  for (int64_t i = 0; i < nq; i++) q[i] += (float)(0.3 * ts_rng_normal(&rng));
  /* the storage dtype, and back: both backends see the same values */
  CHECK_OK(mtrain_convert(q, MTRAIN_F32, p->q, c->dtype, nq));
  CHECK_OK(mtrain_convert(k, MTRAIN_F32, p->k, c->dtype, nk));
  CHECK_OK(mtrain_convert(p->q, c->dtype, q, MTRAIN_F32, nq));
  CHECK_OK(mtrain_convert(p->k, c->dtype, k, MTRAIN_F32, nk));
  /* the LSE of a dense forward (cpu backend; bidirectional when non-causal) */
  mtrain_context_t *ctx = make_ctx("cpu", c->G);
  mtrain_pattern_t *dense = NULL;
  CHECK_OK(nc ? mtrain_pattern_create_noncausal(N, c->Hq, c->G, &dense)
              : mtrain_pattern_create_dense(N, c->Hq, c->G, &dense));
  const mtrain_pattern_t *ps[] = {dense};
  mtrain_plan_t *plan = NULL;
  CHECK_OK(mtrain_plan_create(ctx, NULL, ps, &plan));
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F32, N, c->Hq, c->d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, N, c->Hq);
  CHECK_OK(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl));
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(dense);
  mtrain_context_destroy(ctx);
  const size_t lsz = c->lse64 ? sizeof(double) : sizeof(float);
  p->lse = malloc(lsz * (size_t)(N * c->Hq));
  assert_non_null(p->lse);
  CHECK_OK(mtrain_convert(lse, MTRAIN_F32, p->lse, c->lse64 ? MTRAIN_F64 : MTRAIN_F32, N * c->Hq));
  p->dq = dev_copy(p->q, p->esz * (size_t)nq);
  p->dk = dev_copy(p->k, p->esz * (size_t)nk);
  p->dlse = dev_copy(p->lse, lsz * (size_t)(N * c->Hq));
  CHECK_OK(mtrain_cuda_malloc(sizeof(double) * (size_t)(p->tri * c->Hq), &p->dsc));
  free(q), free(k), free(v), free(o), free(lse);
}

static void problem_free(problem_t *p) {
  free(p->q), free(p->k), free(p->lse);
  mtrain_cuda_free(p->dq), mtrain_cuda_free(p->dk), mtrain_cuda_free(p->dlse);
  mtrain_cuda_free(p->dsc);
}

static mtrain_block_scores_args_t args_of(const problem_t *p, mtrain_block_method_t m,
                                          const int64_t *ids, int device) {
  const gcase_t *c = &p->c;
  const mtrain_block_scores_args_t a = {
      .method = m,
      .seq_len = c->N,
      .granularity = c->G,
      .num_heads = c->Hq,
      .num_kv_heads = c->Hkv,
      .head_dim = c->d,
      .scale = 1.0 / sqrt((double)c->d),
      .stride = c->S,
      .q_dtype = c->dtype,
      .q = device ? p->dq : p->q,
      .q_tokens = c->N,
      .num_q_blocks = (int32_t)p->nb,
      .q_block_global = ids,
      .k_dtype = c->dtype,
      .k = device ? p->dk : p->k,
      .lse_dtype = c->lse64 ? MTRAIN_F64 : MTRAIN_F32,
      .lse = m == MTRAIN_BLOCK_PRECISE ? (device ? p->dlse : p->lse) : NULL,
      .scores = NULL,
      .noncausal = p->nc};
  return a;
}

static int64_t *identity(int64_t nb) {
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)nb);
  assert_non_null(ids);
  for (int64_t b = 0; b < nb; b++) ids[b] = b;
  return ids;
}

/* Where row qb of a head starts in the full scores, and its entries. */
static int64_t row_at(const problem_t *p, int64_t qb) {
  return p->nc ? qb * p->nb : mtrain_block_tri(qb);
}
static int64_t row_len(const problem_t *p, int64_t qb) { return p->nc ? p->nb : qb + 1; }

/* The scores of one method on cpu-ref (host) and cuda (downloaded). */
static void both_scores(const problem_t *p, mtrain_context_t *ref, mtrain_context_t *gpu,
                        mtrain_block_method_t m, double *want, double *got) {
  const size_t bytes = sizeof(double) * (size_t)(p->tri * p->c.Hq);
  int64_t *ids = identity(p->nb);
  mtrain_block_scores_args_t a = args_of(p, m, ids, 0);
  memset(want, 0, bytes);
  a.scores = want;
  CHECK_OK(mtrain_be_block_scores(ref, &a));
  a = args_of(p, m, ids, 1);
  CHECK_OK(mtrain_be_memset_zero(gpu, p->dsc, bytes));
  a.scores = p->dsc;
  CHECK_OK(mtrain_be_block_scores(gpu, &a));
  CHECK_OK(mtrain_be_copy_to_host(gpu, got, p->dsc, bytes));
  free(ids);
}

/* ---- (a) and (b): scores ------------------------------------------------------------------ */

static const mtrain_block_method_t methods[] = {MTRAIN_BLOCK_PRECISE, MTRAIN_BLOCK_ANTIDIAG,
                                                MTRAIN_BLOCK_MEANPOOL};

static void compare_scores(const problem_t *p, mtrain_block_method_t m, const double *want,
                           const double *got) {
  const int64_t n = p->tri * p->c.Hq;
  const double M = ts_max_abs(want, n);
  double worst = 0.0;
  int64_t at = -1;
  for (int64_t e = 0; e < n; e++) {
    /* masses: relative per entry (a floor for subnormal terms); logits: of the largest */
    const double scale = m == MTRAIN_BLOCK_MEANPOOL ? M : fabs(want[e]) + 1e-290;
    const double r = fabs(got[e] - want[e]) / scale;
    if (!(r <= worst)) worst = r, at = e;
  }
  print_message("scores%s seed %llu N %lld G %d heads %d/%d d %d %s lse %s %s: max %s err %.3g "
                "(bound 1e-12, max |score| %.3g)\n",
                p->nc ? " (non-causal)" : "", (unsigned long long)p->seed, (long long)p->c.N,
                p->c.G, p->c.Hq, p->c.Hkv, p->c.d, mtrain_dtype_name(p->c.dtype),
                p->c.lse64 ? "fp64" : "fp32", mtrain_block_method_name(m),
                m == MTRAIN_BLOCK_MEANPOOL ? "scaled" : "relative", worst, M);
  if (!(worst <= 1e-12))
    fail_msg("cuda %s%s scores, seed %llu N %lld: entry %lld is %.17g, cpu-ref %.17g (error %.3g "
             "> 1e-12)",
             mtrain_block_method_name(m), p->nc ? " non-causal" : "", (unsigned long long)p->seed,
             (long long)p->c.N, (long long)at, got[at], want[at], worst);
}

/* (b): only the odd query blocks, packed as a rank holds them. */
static void check_subset(const problem_t *p, mtrain_context_t *gpu, mtrain_block_method_t m,
                         const double *full) {
  const gcase_t *c = &p->c;
  const int64_t nloc = p->nb / 2, slots = nloc * c->G;
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)nloc);
  const size_t qrow = p->esz * (size_t)(c->Hq * c->d);
  const size_t lsz = c->lse64 ? sizeof(double) : sizeof(float), lrow = lsz * (size_t)c->Hq;
  char *q = calloc((size_t)slots, qrow), *lse = calloc((size_t)slots, lrow);
  assert_true(ids && q && lse);
  for (int64_t lb = 0; lb < nloc; lb++) {
    ids[lb] = 2 * lb + 1;
    for (int64_t r = 0; r < c->G && ids[lb] * c->G + r < c->N; r++) {
      const int64_t i = ids[lb] * c->G + r, s = lb * c->G + r;
      memcpy(q + (size_t)s * qrow, (const char *)p->q + (size_t)i * qrow, qrow);
      memcpy(lse + (size_t)s * lrow, (const char *)p->lse + (size_t)i * lrow, lrow);
    }
  }
  void *dq = dev_copy(q, (size_t)slots * qrow), *dl = dev_copy(lse, (size_t)slots * lrow);
  mtrain_block_scores_args_t a = args_of(p, m, ids, 1);
  a.q = dq;
  a.q_tokens = slots;
  a.num_q_blocks = (int32_t)nloc;
  a.lse = m == MTRAIN_BLOCK_PRECISE ? dl : NULL;
  const int64_t n = p->tri * c->Hq;
  double *got = malloc(sizeof(double) * (size_t)n);
  assert_non_null(got);
  CHECK_OK(mtrain_be_memset_zero(gpu, p->dsc, sizeof(double) * (size_t)n));
  a.scores = p->dsc;
  CHECK_OK(mtrain_be_block_scores(gpu, &a));
  CHECK_OK(mtrain_be_copy_to_host(gpu, got, p->dsc, sizeof(double) * (size_t)n));
  int64_t owned = 0;
  for (int32_t h = 0; h < c->Hq; h++)
    for (int64_t qb = 0; qb < p->nb; qb++)
      for (int64_t kb = 0; kb < row_len(p, qb); kb++) {
        const int64_t e = h * p->tri + row_at(p, qb) + kb;
        const int odd = qb % 2 == 1 && qb / 2 < nloc;
        const double want = odd ? full[e] : 0.0;
        owned += odd;
        if (memcmp(&got[e], &want, sizeof want) != 0)
          fail_msg("cuda %s scores of the odd query blocks only: head %d (%lld, %lld) is %.17g, "
                   "want %.17g (%s)",
                   mtrain_block_method_name(m), h, (long long)qb, (long long)kb, got[e], want,
                   odd ? "the whole run's bits" : "untouched");
      }
  print_message("subset %s%s N %lld: %lld owned entries bitwise the whole run's, the rest zero\n",
                mtrain_block_method_name(m), p->nc ? " (non-causal)" : "", (long long)c->N,
                (long long)owned);
  /* the compact form (scores_row): only the odd rows held, the same bits */
  int64_t *row = malloc(sizeof(int64_t) * (size_t)(nloc + 1)), R = 0;
  assert_non_null(row);
  for (int64_t lb = 0; lb < nloc; lb++) row[lb] = R, R += row_len(p, ids[lb]);
  a.scores_row = row;
  a.scores_head_stride = R;
  CHECK_OK(mtrain_be_memset_zero(gpu, p->dsc, sizeof(double) * (size_t)(R * c->Hq)));
  CHECK_OK(mtrain_be_block_scores(gpu, &a));
  CHECK_OK(mtrain_be_copy_to_host(gpu, got, p->dsc, sizeof(double) * (size_t)(R * c->Hq)));
  for (int32_t h = 0; h < c->Hq; h++)
    for (int64_t lb = 0; lb < nloc; lb++)
      if (memcmp(got + h * R + row[lb], full + h * p->tri + row_at(p, ids[lb]),
                 sizeof(double) * (size_t)row_len(p, ids[lb])))
        fail_msg("cuda %s scores, compact rows: head %d query block %lld differs from the whole "
                 "run's row",
                 mtrain_block_method_name(m), h, (long long)ids[lb]);
  print_message("subset %s%s N %lld: the compact rows (%lld of %lld entries) bitwise the same\n",
                mtrain_block_method_name(m), p->nc ? " (non-causal)" : "", (long long)c->N,
                (long long)(R * c->Hq), (long long)n);
  free(row);
  mtrain_cuda_free(dq), mtrain_cuda_free(dl);
  free(ids), free(q), free(lse), free(got);
}

/* ---- (c): selection ------------------------------------------------------------------------- */

typedef struct sel {
  mtrain_block_method_t method;
  mtrain_budget_kind_t kind;
  int32_t top_k;
  double top_p;
} sel_t;

static const sel_t sels[] = {
    {MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_P, 0, 0.9},
    {MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_K, 4, 0},
    {MTRAIN_BLOCK_ANTIDIAG, MTRAIN_BUDGET_TOP_P, 0, 0.9},
    {MTRAIN_BLOCK_ANTIDIAG, MTRAIN_BUDGET_TOP_K, 4, 0},
    {MTRAIN_BLOCK_MEANPOOL, MTRAIN_BUDGET_TOP_K, 4, 0},
};
#define NSELS (sizeof sels / sizeof sels[0])

/* Descending, NaN last, then ascending key block (SPEC.md 9.4). */
static const double *cmp_row;
static int by_rank(const void *pa, const void *pb) {
  const int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
  const double x = isnan(cmp_row[a]) ? -INFINITY : cmp_row[a];
  const double y = isnan(cmp_row[b]) ? -INFINITY : cmp_row[b];
  if (x != y) return x > y ? -1 : 1;
  return (a > b) - (a < b);
}

/* The smallest margin of the decisions of row qb's selection (its len
 * entries), relative to the row's scale: a difference of the scores below it
 * may change the set. Forced: SPEC.md 9.4 and 9.7 (|kb - qb| < local
 * non-causally; a causal row has no kb > qb). */
static double row_margin(const double *row, int64_t qb, int64_t len,
                         const mtrain_block_options_t *o) {
  int64_t *idx = malloc(sizeof(int64_t) * (size_t)len), n = 0;
  double total = 0.0, kept = 0.0, scale = 0.0;
  for (int64_t kb = 0; kb < len; kb++) {
    const int forced =
        kb == qb || kb < o->sink_blocks || (kb > qb - o->local_blocks && kb < qb + o->local_blocks);
    total += row[kb];
    scale = fmax(scale, fabs(row[kb]));
    if (forced)
      kept += row[kb];
    else
      idx[n++] = kb;
  }
  cmp_row = row;
  qsort(idx, (size_t)n, sizeof *idx, by_rank);
  double margin = INFINITY;
  int64_t take = 0;
  if (o->kind == MTRAIN_BUDGET_TOP_K) {
    take = o->top_k < n ? o->top_k : n;
  } else {
    scale = fabs(total);
    const double target = o->top_p * total;
    while (take < n && kept < target) {
      margin = fmin(margin, target - kept);
      kept += row[idx[take++]];
    }
    if (take < n) margin = fmin(margin, kept - target);
  }
  if (take > 0 && take < n) margin = fmin(margin, row[idx[take - 1]] - row[idx[take]]);
  free(idx);
  return scale > 0.0 ? margin / scale : margin;
}

/* The host selection of `scores` (mtrain_block_select_head), head by head. */
typedef struct csr {
  int64_t *off;
  int32_t *idx;
} csr_t;

static csr_t *host_select(const double *scores, int64_t nb, int32_t Hq,
                          const mtrain_block_options_t *o, double *recall) {
  csr_t *r = calloc((size_t)Hq, sizeof *r);
  int64_t *order = malloc(sizeof(int64_t) * (size_t)nb);
  uint8_t *keep = malloc((size_t)nb);
  assert_true(r && order && keep);
  for (int32_t h = 0; h < Hq; h++) {
    r[h].off = malloc(sizeof(int64_t) * (size_t)(nb + 1));
    r[h].idx = malloc(sizeof(int32_t) * (size_t)mtrain_block_head_entries(nb, o));
    mtrain_block_head_result_t res;
    mtrain_block_select_head(scores + h * mtrain_block_head_entries(nb, o), nb, o, o->top_k,
                             r[h].off, r[h].idx, order, keep, &res);
    recall[h] = res.kept / res.total;
  }
  free(order), free(keep);
  return r;
}

static void csr_free(csr_t *r, int32_t Hq) {
  for (int32_t h = 0; h < Hq; h++) free(r[h].off), free(r[h].idx);
  free(r);
}

static int row_equal(const mtrain_pattern_head_t *ph, const csr_t *c, int64_t qb) {
  const int64_t n = ph->mask_off[qb + 1] - ph->mask_off[qb];
  if (n != c->off[qb + 1] - c->off[qb]) return 0;
  return memcmp(ph->mask_idx + ph->mask_off[qb], c->idx + c->off[qb], sizeof(int32_t) * n) == 0;
}

/* tie: the largest decision margin (relative to the row's scale) at which
 * the cuda selection may differ from cpu-ref's; rtol: the recall's tolerance
 * in a head without such rows. */
static void check_selection(const problem_t *p, mtrain_context_t *gpu, const sel_t *s,
                            const double *ref_scores, const double *gpu_scores, double tie,
                            double rtol) {
  const gcase_t *c = &p->c;
  mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
  o.method = s->method;
  o.kind = s->kind;
  o.top_k = s->top_k;
  o.top_p = s->kind == MTRAIN_BUDGET_TOP_P ? s->top_p : 0.9;
  o.stride = c->S;
  o.noncausal = p->nc;
  mtrain_tensor_t tq = mtrain_tensor_3d(p->dq, c->dtype, c->N, c->Hq, c->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(p->dk, c->dtype, c->N, c->Hkv, c->d);
  mtrain_tensor_t tl = mtrain_tensor_2d(p->dlse, c->lse64 ? MTRAIN_F64 : MTRAIN_F32, c->N, c->Hq);
  double *recall = malloc(sizeof(double) * (size_t)c->Hq);
  double *rec_gpu = malloc(sizeof(double) * (size_t)c->Hq);
  double *rec_ref = malloc(sizeof(double) * (size_t)c->Hq);
  mtrain_block_report_t rep = {recall, NULL, NULL};
  mtrain_pattern_t *pat = NULL;
  CHECK_OK(mtrain_pattern_select_blocks(gpu, &tq, &tk, &tl, &o, &rep, &pat));
  csr_t *from_gpu = host_select(gpu_scores, p->nb, c->Hq, &o, rec_gpu);
  csr_t *from_ref = host_select(ref_scores, p->nb, c->Hq, &o, rec_ref);
  int64_t ties = 0, rows = 0;
  for (int32_t h = 0; h < c->Hq; h++) {
    const int64_t ties0 = ties;
    const mtrain_pattern_head_t *ph = &pat->heads[h];
    assert_true(mtrain_pattern_head_is_block_mask(pat, h));
    for (int64_t qb = 0; qb < p->nb; qb++) {
      if (!row_equal(ph, &from_gpu[h], qb))
        fail_msg("%s: head %d query block %lld: the cuda context's pattern is not the host "
                 "selection of the cuda scores",
                 mtrain_block_method_name(s->method), h, (long long)qb);
      rows++;
      if (row_equal(ph, &from_ref[h], qb)) continue;
      const double margin =
          row_margin(ref_scores + h * p->tri + row_at(p, qb), qb, row_len(p, qb), &o);
      if (!(margin <= tie))
        fail_msg("%s %s: head %d query block %lld selects other key blocks on cuda than on "
                 "cpu-ref, and the cpu-ref decision margin is %.3g (no near tie)",
                 mtrain_block_method_name(s->method),
                 s->kind == MTRAIN_BUDGET_TOP_K ? "top-k" : "top-p", h, (long long)qb, margin);
      ties++;
    }
    if (s->method != MTRAIN_BLOCK_MEANPOOL) {
      assert_true(recall[h] == rec_gpu[h]);
      if (ties == ties0 && !(fabs(recall[h] - rec_ref[h]) <= rtol))
        fail_msg("%s: head %d recall %.17g on cuda, %.17g from the cpu-ref scores",
                 mtrain_block_method_name(s->method), h, recall[h], rec_ref[h]);
    }
  }
  print_message("select%s seed %llu N %lld %s %s: %lld query-block rows equal to cpu-ref's, %lld "
                "differ at near ties\n",
                p->nc ? " (non-causal)" : "", (unsigned long long)p->seed, (long long)c->N,
                mtrain_block_method_name(s->method),
                s->kind == MTRAIN_BUDGET_TOP_K ? "top-k 4" : "top-p 0.9", (long long)(rows - ties),
                (long long)ties);
  mtrain_pattern_destroy(pat);
  csr_free(from_gpu, c->Hq), csr_free(from_ref, c->Hq);
  free(recall), free(rec_gpu), free(rec_ref);
}

/* ---- the cases --------------------------------------------------------------------------------
 */

static void run_case(size_t ci, int nc) {
  require_gpu();
  require_full(cases[ci].N);
  setenv("MTRAIN_CUDA_BLOCK_SCORES", "fp64", 1);
  problem_t p;
  problem_make(&p, &cases[ci], ts_seed((nc ? 3150 : 3100) + ci), nc);
  mtrain_context_t *ref = make_ctx("cpu-ref", p.c.G), *gpu = make_ctx("cuda", p.c.G);
  const int64_t n = p.tri * p.c.Hq;
  double *want[3], *got[3];
  for (int mi = 0; mi < 3; mi++) {
    want[mi] = malloc(sizeof(double) * (size_t)n);
    got[mi] = malloc(sizeof(double) * (size_t)n);
    assert_true(want[mi] && got[mi]);
    both_scores(&p, ref, gpu, methods[mi], want[mi], got[mi]);
    compare_scores(&p, methods[mi], want[mi], got[mi]);
    if (ci == 0 || ci == 3) check_subset(&p, gpu, methods[mi], got[mi]);
  }
  for (size_t si = 0; si < NSELS; si++) {
    const int mi = (int)sels[si].method;
    check_selection(&p, gpu, &sels[si], want[mi], got[mi], 1e-9, 1e-9);
  }
  for (int mi = 0; mi < 3; mi++) free(want[mi]), free(got[mi]);
  mtrain_context_destroy(ref);
  mtrain_context_destroy(gpu);
  problem_free(&p);
  unsetenv("MTRAIN_CUDA_BLOCK_SCORES");
}

/* ---- (f): the tensor-core path ---------------------------------------------------------------
 */

/* M, the largest s sum_x |q_x k_x| over the pairs the scores see, and L, the
 * largest |lse|: the inputs of the tensor-core path's tolerance. */
static void mma_bounds(const problem_t *p, double *M_, double *L_) {
  const gcase_t *c = &p->c;
  const int64_t N = c->N, nq = N * c->Hq * c->d, nk = N * c->Hkv * c->d;
  float *q = malloc(sizeof(float) * (size_t)nq), *k = malloc(sizeof(float) * (size_t)nk);
  double *lse = malloc(sizeof(double) * (size_t)(N * c->Hq));
  assert_true(q && k && lse);
  CHECK_OK(mtrain_convert(p->q, c->dtype, q, MTRAIN_F32, nq));
  CHECK_OK(mtrain_convert(p->k, c->dtype, k, MTRAIN_F32, nk));
  CHECK_OK(mtrain_convert(p->lse, c->lse64 ? MTRAIN_F64 : MTRAIN_F32, lse, MTRAIN_F64, N * c->Hq));
  const double s = 1.0 / sqrt((double)c->d);
  double M = 0.0, L = 0.0;
  for (int64_t e = 0; e < N * c->Hq; e++) L = fmax(L, fabs(lse[e]));
  for (int32_t h = 0; h < c->Hq; h++) {
    const int32_t hk = h / (c->Hq / c->Hkv);
    for (int64_t i = 0; i < N; i++) {
      const float *qi = q + (i * c->Hq + h) * c->d;
      for (int64_t j = 0; j < (p->nc ? N : i + 1); j++) {
        const float *kj = k + (j * c->Hkv + hk) * c->d;
        double sa = 0.0;
        for (int32_t x = 0; x < c->d; x++) sa += fabs((double)qi[x] * kj[x]);
        M = fmax(M, s * sa);
      }
    }
  }
  *M_ = M, *L_ = L;
  free(q), free(k), free(lse);
}

/* The tolerance of the tensor-core scores per entry, |got - want| <= rel
 * want + abs: the derivation of test_block_scores_mma_emu.cpp. */
static void mma_tolerance(const problem_t *p, mtrain_block_method_t m, double M, double L,
                          double *rel, double *abs_) {
  const gcase_t *c = &p->c;
  const int64_t N = c->N;
  const double u24 = ldexp(1.0, -24), u22 = ldexp(1.0, -22), u21 = ldexp(1.0, -21),
               u53 = ldexp(1.0, -53);
  if (m == MTRAIN_BLOCK_PRECISE) {
    const double et = 1.01 * (c->d / 16.0 * u21 * M + (2 * M + 2 * L) * u24 + u22);
    *rel = et + (32.0 * (c->G / 64) + 5) * u24 + 1e-11;
  } else {
    const double ex = 1.01 * (c->S * c->d / 16.0 * u21 * M + 8 * M * u24 + u22);
    *rel = 2 * (ex + 11 * u24) + (double)(p->nb + c->G / c->S + (N + c->S - 1) / c->S + 4) * u53;
  }
  *abs_ = (double)c->G * c->G * ldexp(1.0, -124);
}

/* The cuda scores of method m with the keys given in fp32 (device k32). */
static void scores_k32(const problem_t *p, mtrain_context_t *gpu, mtrain_block_method_t m,
                       const void *k32, double *out) {
  const size_t bytes = sizeof(double) * (size_t)(p->tri * p->c.Hq);
  int64_t *ids = identity(p->nb);
  mtrain_block_scores_args_t a = args_of(p, m, ids, 1);
  a.k = k32;
  a.k_dtype = MTRAIN_F32;
  CHECK_OK(mtrain_be_memset_zero(gpu, p->dsc, bytes));
  a.scores = p->dsc;
  CHECK_OK(mtrain_be_block_scores(gpu, &a));
  CHECK_OK(mtrain_be_copy_to_host(gpu, out, p->dsc, bytes));
  free(ids);
}

/* fp32 keys (as the distributed selection gathers them): exact copies of the
 * bf16 or fp16 keys score bitwise as those keys (tensor cores); with one key
 * element that the dtype does not hold, bitwise as the fp64 kernels. */
static void check_fp32_keys(const problem_t *p, mtrain_context_t *gpu, mtrain_block_method_t m,
                            const double *got) {
  const int64_t nk = p->c.N * p->c.Hkv * p->c.d, n = p->tri * p->c.Hq;
  float *k = malloc(sizeof(float) * (size_t)nk);
  double *a = malloc(sizeof(double) * (size_t)n), *b = malloc(sizeof(double) * (size_t)n);
  assert_true(k && a && b);
  CHECK_OK(mtrain_convert(p->k, p->c.dtype, k, MTRAIN_F32, nk));
  void *dk = dev_copy(k, sizeof(float) * (size_t)nk);
  scores_k32(p, gpu, m, dk, a);
  if (memcmp(a, got, sizeof(double) * (size_t)n))
    fail_msg("%s: fp32 copies of the keys do not score bitwise as the keys",
             mtrain_block_method_name(m));
  k[nk / 2] = nextafterf(k[nk / 2], INFINITY); /* not a bf16 or fp16 value */
  mtrain_cuda_free(dk);
  dk = dev_copy(k, sizeof(float) * (size_t)nk);
  scores_k32(p, gpu, m, dk, a);
  setenv("MTRAIN_CUDA_BLOCK_SCORES", "fp64", 1);
  scores_k32(p, gpu, m, dk, b);
  unsetenv("MTRAIN_CUDA_BLOCK_SCORES");
  if (memcmp(a, b, sizeof(double) * (size_t)n))
    fail_msg("%s: fp32 keys beyond the q dtype are not scored by the fp64 kernels",
             mtrain_block_method_name(m));
  print_message("fp32 keys %s%s: exact copies bitwise the keys' scores, an inexact key bitwise "
                "the fp64 kernels'\n",
                mtrain_block_method_name(m), p->nc ? " (non-causal)" : "");
  mtrain_cuda_free(dk);
  free(k), free(a), free(b);
}

static void run_case_mma(size_t ci, int nc) {
  require_gpu();
  require_full(cases[ci].N);
  unsetenv("MTRAIN_CUDA_BLOCK_SCORES");
  problem_t p;
  problem_make(&p, &cases[ci], ts_seed((nc ? 3250 : 3200) + ci), nc);
  mtrain_context_t *ref = make_ctx("cpu-ref", p.c.G), *gpu = make_ctx("cuda", p.c.G);
  const int64_t n = p.tri * p.c.Hq;
  double *want[2], *got[2], rel[2];
  double *exact = malloc(sizeof(double) * (size_t)n), M, L;
  assert_non_null(exact);
  mma_bounds(&p, &M, &L);
  for (int mi = 0; mi < 2; mi++) {
    const mtrain_block_method_t m = methods[mi];
    want[mi] = malloc(sizeof(double) * (size_t)n);
    got[mi] = malloc(sizeof(double) * (size_t)n);
    assert_true(want[mi] && got[mi]);
    both_scores(&p, ref, gpu, m, want[mi], got[mi]);
    double abs_;
    mma_tolerance(&p, m, M, L, &rel[mi], &abs_);
    double worst = 0.0;
    int64_t at = -1;
    for (int64_t e = 0; e < n; e++) {
      const double r = fabs(got[mi][e] - want[mi][e]) / (rel[mi] * fabs(want[mi][e]) + abs_);
      if (!(r <= worst)) worst = r, at = e;
    }
    print_message("tensor-core scores%s seed %llu N %lld G %d heads %d/%d d %d S %d %s lse %s %s: "
                  "rel tol %.3g, largest error / tolerance %.3g\n",
                  p.nc ? " (non-causal)" : "", (unsigned long long)p.seed, (long long)p.c.N, p.c.G,
                  p.c.Hq, p.c.Hkv, p.c.d, p.c.S, mtrain_dtype_name(p.c.dtype),
                  p.c.lse64 ? "fp64" : "fp32", mtrain_block_method_name(m), rel[mi], worst);
    if (!(worst <= 1.0))
      fail_msg("tensor-core %s%s scores, seed %llu: entry %lld is %.17g, cpu-ref %.17g (error "
               "%.3g of the tolerance)",
               mtrain_block_method_name(m), p.nc ? " non-causal" : "", (unsigned long long)p.seed,
               (long long)at, got[mi][at], want[mi][at], worst);
    /* the default did take the tensor cores: not the fp64 kernels' bits everywhere */
    setenv("MTRAIN_CUDA_BLOCK_SCORES", "fp64", 1);
    both_scores(&p, ref, gpu, m, want[mi], exact);
    unsetenv("MTRAIN_CUDA_BLOCK_SCORES");
    assert_true(memcmp(exact, got[mi], sizeof(double) * (size_t)n) != 0);
    check_subset(&p, gpu, m, got[mi]);
    check_fp32_keys(&p, gpu, m, got[mi]);
  }
  for (size_t si = 0; si < NSELS; si++) {
    const int mi = (int)sels[si].method;
    if (mi < 2) check_selection(&p, gpu, &sels[si], want[mi], got[mi], 2 * rel[mi], 4 * rel[mi]);
  }
  for (int mi = 0; mi < 2; mi++) free(want[mi]), free(got[mi]);
  free(exact);
  mtrain_context_destroy(ref);
  mtrain_context_destroy(gpu);
  problem_free(&p);
}

static void test_mma_case1(void **state) { (void)state, run_case_mma(1, 0); }
static void test_mma_case2(void **state) { (void)state, run_case_mma(2, 0); }
static void test_mma_case3(void **state) { (void)state, run_case_mma(3, 0); }
static void test_mma_noncausal_case1(void **state) { (void)state, run_case_mma(1, 1); }
static void test_mma_noncausal_case3(void **state) { (void)state, run_case_mma(3, 1); }

static void test_case0(void **state) { (void)state, run_case(0, 0); }
static void test_case1(void **state) { (void)state, run_case(1, 0); }
static void test_case2(void **state) { (void)state, run_case(2, 0); }
static void test_case3(void **state) { (void)state, run_case(3, 0); }
/* (e): non-causal, d 64 (N % G = 40, fp32) and d 128 (N % G = 57, fp16, stride 16, lse fp64) */
static void test_noncausal_case0(void **state) { (void)state, run_case(0, 1); }
static void test_noncausal_case3(void **state) { (void)state, run_case(3, 1); }

/* ---- (d): refusals ----------------------------------------------------------------------------
 */

static void test_refusals(void **state) {
  (void)state;
  require_gpu();
  problem_t p;
  const gcase_t small = {200, 64, 4, 2, 64, 8, MTRAIN_F32, 0};
  problem_make(&p, &small, ts_seed(3199), 0);
  mtrain_context_t *gpu = make_ctx("cuda", p.c.G);
  int64_t *ids = identity(p.nb);
  mtrain_block_scores_args_t a = args_of(&p, MTRAIN_BLOCK_ANTIDIAG, ids, 1);
  a.scores = p.dsc;
  a.stride = 7;
  TS_ASSERT_STATUS(mtrain_be_block_scores(gpu, &a), MTRAIN_ERR_INVALID_ARGUMENT,
                   "stride 7 does not divide the granularity 64");
  a = args_of(&p, MTRAIN_BLOCK_PRECISE, ids, 1);
  a.scores = p.dsc;
  a.lse = NULL;
  TS_ASSERT_STATUS(mtrain_be_block_scores(gpu, &a), MTRAIN_ERR_NULL_POINTER, "needs lse");
  a = args_of(&p, MTRAIN_BLOCK_MEANPOOL, ids, 1);
  a.scores = p.dsc;
  a.q_dtype = MTRAIN_F64;
  TS_ASSERT_STATUS(mtrain_be_block_scores(gpu, &a), MTRAIN_ERR_UNSUPPORTED_DTYPE, "q is fp64");
  a = args_of(&p, MTRAIN_BLOCK_MEANPOOL, ids, 1);
  a.scores = p.dsc;
  a.num_kv_heads = 3;
  TS_ASSERT_STATUS(mtrain_be_block_scores(gpu, &a), MTRAIN_ERR_INVALID_ARGUMENT, "heads 4/3");
  a = args_of(&p, MTRAIN_BLOCK_PRECISE, ids, 1);
  a.scores = p.dsc;
  a.method = (mtrain_block_method_t)9;
  TS_ASSERT_STATUS(mtrain_be_block_scores(gpu, &a), MTRAIN_ERR_INVALID_ARGUMENT,
                   "unknown method 9");
  /* (g) */
  a = args_of(&p, MTRAIN_BLOCK_PRECISE, ids, 1);
  a.scores = p.dsc;
  setenv("MTRAIN_CUDA_BLOCK_SCORES", "fast", 1);
  TS_ASSERT_STATUS(mtrain_be_block_scores(gpu, &a), MTRAIN_ERR_INVALID_CONFIG,
                   "MTRAIN_CUDA_BLOCK_SCORES='fast'");
  unsetenv("MTRAIN_CUDA_BLOCK_SCORES");
  free(ids);
  mtrain_context_destroy(gpu);
  problem_free(&p);
}

int main(void) {
  have_gpu = mtrain_cuda_device_count() > 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_case0),
      cmocka_unit_test(test_case1),
      cmocka_unit_test(test_case2),
      cmocka_unit_test(test_case3),
      cmocka_unit_test(test_noncausal_case0),
      cmocka_unit_test(test_noncausal_case3),
      cmocka_unit_test(test_mma_case1),
      cmocka_unit_test(test_mma_case2),
      cmocka_unit_test(test_mma_case3),
      cmocka_unit_test(test_mma_noncausal_case1),
      cmocka_unit_test(test_mma_noncausal_case3),
      cmocka_unit_test(test_refusals),
  };
  const int failed = cmocka_run_group_tests(tests, NULL, NULL);
  if (failed) return 1;
  return have_gpu ? 0 : 77;
}
