/* cpu_block_scores.c: the block scores of SPEC.md section 9 (the optional
 * block_scores slot) for both CPU backends: precise block masses from the
 * forward's LSE (AdaSpa-style) and mean-pooled gating (MoBA-style) here; the
 * strided antidiagonal estimates (XAttention-style) in cpu_block_antidiag.c.
 *
 * The reference computes every logit as an fp64 dot product and adds in the
 * order the spec gives. The fast path computes the logits of a query block
 * with sgemm in fp32, one key block per call, and adds in fp64. Every method
 * also takes the keys as chunks of key blocks (k_block_global: the ring pass
 * of the distributed selection; the antidiagonal method in three passes),
 * each entry with the same bits as from all keys. With args.noncausal every
 * key block of a row is scored over all its keys (SPEC.md section 9.7). Each
 * (head, query block) row of the output is one task (OpenMP, dynamic
 * schedule) that reads only its own query block and the keys, so a row's
 * bits depend on neither the thread count nor which rank computes it.
 * Mean-pooled gating is cheap (O(nb^2 d) per head) and shares the
 * reference's fp64 code in both backends. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_block_common.h"
#include "backends/cpu/cpu_fast_common.h"
#include "mtrain/mtrain_error.h"

/* Query rows per sgemm of the precise fast path. */
#define BLK_ROWS 256
/* The end of the keys of block kb (from j0) that query i sees. */
static inline int64_t key_end(const mtrain_block_scores_args_t *a, int64_t j0, int64_t i) {
  const int64_t last = a->noncausal ? a->seq_len : i + 1;
  return j0 + a->granularity < last ? j0 + a->granularity : last;
}

static mtrain_status_t check_args(const mtrain_block_scores_args_t *a) {
  if (a->method == MTRAIN_BLOCK_ANTIDIAG &&
      (a->k_block_global ? a->antidiag_pass < 1 || a->antidiag_pass > 3 || !a->row_state
                         : a->antidiag_pass != 0))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block scores: the antidiagonal method takes a key chunk in pass 1, 2 "
                        "or 3 with row_state, all keys in pass 0 (antidiag_pass %d, %s)",
                        (int)a->antidiag_pass, a->k_block_global ? "a key chunk" : "all keys");
  if (a->method != MTRAIN_BLOCK_PRECISE && a->method != MTRAIN_BLOCK_ANTIDIAG &&
      a->method != MTRAIN_BLOCK_MEANPOOL)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "block scores: unknown method %d",
                        (int)a->method);
  if (a->method == MTRAIN_BLOCK_ANTIDIAG && (a->stride < 1 || a->granularity % a->stride != 0))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block scores: stride %d does not divide the granularity %d", a->stride,
                        a->granularity);
  if (a->method == MTRAIN_BLOCK_PRECISE && !a->lse)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "block scores: the precise method needs lse");
  return MTRAIN_SUCCESS;
}

/* ---- mean-pooled gating (both backends) --------------------------------------- */

static mtrain_status_t meanpool_scores(cpu_state_t *s, const mtrain_block_scores_args_t *a) {
  const int32_t G = a->granularity, Hq = a->num_heads, Hkv = a->num_kv_heads, d = a->head_dim;
  const int32_t group = Hq / Hkv;
  const int64_t N = a->seq_len, nb = (N + G - 1) / G, nx = cpu_call_blocks(a);
  double *kbar = malloc(sizeof(double) * (size_t)(nx * Hkv * d + 1));
  if (!kbar) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block scores: out of memory");
    /* kbar[kx][hk][x] = mean over the keys of call block kx, keys ascending */
#pragma omp parallel for num_threads(s->num_threads) schedule(static)
  for (int64_t kx = 0; kx < nx; kx++) {
    const int64_t kb = cpu_call_block(a, kx);
    if (kb >= nb) continue;
    const int64_t j0 = kb * G, j1 = j0 + G < N ? j0 + G : N;
    for (int32_t hk = 0; hk < Hkv; hk++)
      for (int32_t x = 0; x < d; x++) {
        double sum = 0.0;
        for (int64_t j = j0; j < j1; j++)
          sum += mtrain_cpu_load(a->k, a->k_dtype, (cpu_key_slot(a, kx, kb, j) * Hkv + hk) * d + x);
        kbar[(kx * Hkv + hk) * d + x] = sum / (double)(j1 - j0);
      }
  }
  int failed = 0;
  const int64_t tasks = (int64_t)Hq * a->num_q_blocks;
#pragma omp parallel for num_threads(s->num_threads) schedule(dynamic, 1) reduction(| : failed)
  for (int64_t t = 0; t < tasks; t++) {
    const int32_t h = (int32_t)(t / a->num_q_blocks), lb = (int32_t)(t % a->num_q_blocks);
    const int64_t gb = a->q_block_global[lb];
    if (gb >= nb) continue; /* a padding block */
    const int32_t rows = mtrain_block_rows(a->q_tokens, G, lb, gb, N);
    if (rows <= 0) continue;
    double *qbar = malloc(sizeof(double) * (size_t)d);
    if (!qbar) {
      failed = 1;
      continue;
    }
    for (int32_t x = 0; x < d; x++) {
      double sum = 0.0;
      for (int32_t r = 0; r < rows; r++)
        sum += mtrain_cpu_load(a->q, a->q_dtype, (((int64_t)lb * G + r) * Hq + h) * d + x);
      qbar[x] = sum / (double)rows;
    }
    double *out = cpu_block_out_row(a, h, lb, gb);
    for (int64_t kx = 0; kx < nx; kx++) {
      const int64_t kb = cpu_call_block(a, kx);
      if (cpu_block_skip(a, gb, kb, nb)) continue;
      const double *kv = kbar + (kx * Hkv + h / group) * d;
      double dot = 0.0;
      for (int32_t x = 0; x < d; x++) dot += qbar[x] * kv[x];
      out[kb] = a->scale * dot;
    }
    free(qbar);
  }
  free(kbar);
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block scores: out of memory")
                : MTRAIN_SUCCESS;
}

/* ---- the reference ------------------------------------------------------------- */

/* Row r of local query block lb, head h, into q (fp64). */
static void load_q(const mtrain_block_scores_args_t *a, int32_t lb, int32_t r, int32_t h,
                   double *q) {
  const int64_t base = (((int64_t)lb * a->granularity + r) * a->num_heads + h) * a->head_dim;
  for (int32_t x = 0; x < a->head_dim; x++) q[x] = mtrain_cpu_load(a->q, a->q_dtype, base + x);
}

/* q . the key in slot j of k. */
static double dot_k(const mtrain_block_scores_args_t *a, const double *q, int64_t j, int32_t hk) {
  const int64_t base = (j * a->num_kv_heads + hk) * a->head_dim;
  double dot = 0.0;
  for (int32_t x = 0; x < a->head_dim; x++)
    dot += q[x] * mtrain_cpu_load(a->k, a->k_dtype, base + x);
  return dot;
}

/* Precise: out[kb] += exp(s q_i.k_j - lse_i), i ascending, then j ascending,
 * for each key block kb of the call (kb <= gb, or every kb non-causally). */
static void ref_precise_row(const mtrain_block_scores_args_t *a, int32_t h, int32_t lb, int64_t gb,
                            int32_t rows, double *q, double *out) {
  const int32_t G = a->granularity, hk = h / (a->num_heads / a->num_kv_heads);
  const int64_t nx = cpu_call_blocks(a), nb = (a->seq_len + G - 1) / G;
  for (int64_t kx = 0; kx < nx; kx++) {
    const int64_t kb = cpu_call_block(a, kx);
    if (cpu_block_skip(a, gb, kb, nb)) continue;
    for (int32_t r = 0; r < rows; r++) {
      const int64_t i = gb * G + r, j0 = kb * G, j1 = key_end(a, j0, i);
      if (j1 <= j0) continue;
      load_q(a, lb, r, h, q);
      const double lse =
          mtrain_cpu_load(a->lse, a->lse_dtype, ((int64_t)lb * G + r) * a->num_heads + h);
      for (int64_t j = j0; j < j1; j++)
        out[kb] += exp(a->scale * dot_k(a, q, cpu_key_slot(a, kx, kb, j), hk) - lse);
    }
  }
}

mtrain_status_t mtrain_cpu_ref_block_scores(void *state, const mtrain_block_scores_args_t *a) {
  cpu_state_t *s = state;
  mtrain_status_t st = check_args(a);
  if (st) return st;
  if (a->method == MTRAIN_BLOCK_MEANPOOL) return meanpool_scores(s, a);
  const int32_t G = a->granularity, Hq = a->num_heads;
  const int64_t N = a->seq_len, nb = (N + G - 1) / G;
  const int64_t tasks = (int64_t)Hq * a->num_q_blocks;
  int failed = 0;
#pragma omp parallel for num_threads(s->num_threads) schedule(dynamic, 1) reduction(| : failed)
  for (int64_t t = 0; t < tasks; t++) {
    const int32_t h = (int32_t)(t / a->num_q_blocks), lb = (int32_t)(t % a->num_q_blocks);
    const int64_t gb = a->q_block_global[lb];
    if (gb >= nb) continue;
    const int32_t rows = mtrain_block_rows(a->q_tokens, G, lb, gb, N);
    if (rows <= 0) continue;
    double *out = cpu_block_out_row(a, h, lb, gb);
    if (a->method == MTRAIN_BLOCK_PRECISE) {
      double *q = malloc(sizeof(double) * (size_t)a->head_dim);
      if (!q) {
        failed = 1;
        continue;
      }
      ref_precise_row(a, h, lb, gb, rows, q, out);
      free(q);
    } else {
      failed |= mtrain_cpu_ref_antidiag_row(a, h, lb, gb, rows, out);
    }
  }
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu-ref block scores: out of memory")
                : MTRAIN_SUCCESS;
}

/* ---- the fast path --------------------------------------------------------------- */

/* fp32 views of the inputs: borrowed when already fp32, else widened. */
typedef struct fast_inputs {
  const float *q, *k;
  float *own_q, *own_k;
} fast_inputs_t;

static mtrain_status_t fast_inputs(cpu_state_t *s, const mtrain_block_scores_args_t *a,
                                   fast_inputs_t *f) {
  const int64_t nq = a->q_tokens * a->num_heads * a->head_dim;
  const int64_t nk = (a->k_block_global ? a->k_tokens : a->seq_len) * a->num_kv_heads * a->head_dim;
  f->own_q = f->own_k = NULL;
  if (a->q_dtype != MTRAIN_F32) f->own_q = malloc(sizeof(float) * (size_t)(nq + 1));
  if (a->k_dtype != MTRAIN_F32) f->own_k = malloc(sizeof(float) * (size_t)(nk + 1));
  if ((a->q_dtype != MTRAIN_F32 && !f->own_q) || (a->k_dtype != MTRAIN_F32 && !f->own_k)) {
    free(f->own_q);
    free(f->own_k);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu block scores: out of memory");
  }
  if (f->own_q) mtrain_cpu_convert(s, a->q, a->q_dtype, f->own_q, MTRAIN_F32, nq);
  if (f->own_k) mtrain_cpu_convert(s, a->k, a->k_dtype, f->own_k, MTRAIN_F32, nk);
  f->q = f->own_q ? f->own_q : a->q;
  f->k = f->own_k ? f->own_k : a->k;
  return MTRAIN_SUCCESS;
}

/* Precise, one (head, query block): row chunks of BLK_ROWS at fixed offsets
 * in the block; per chunk and key block of the call one sgemm over the key
 * block's causal columns (A [nr x G]); per (row, key block) an fp32 partial
 * of expf(A - lse), added into the fp64 entry in row order. The calls depend
 * on (gb, kb, rows) alone, so a key block gives the same bits whether k holds
 * every key or a chunk. */
static int fast_precise_row(const mtrain_block_scores_args_t *a, const fast_inputs_t *f, int32_t h,
                            int32_t lb, int64_t gb, int32_t rows, float *A, double *out) {
  const int32_t G = a->granularity, Hq = a->num_heads, Hkv = a->num_kv_heads, d = a->head_dim;
  const int32_t hk = h / (Hq / Hkv);
  const int64_t nx = cpu_call_blocks(a), nb = (a->seq_len + G - 1) / G;
  for (int32_t r0 = 0; r0 < rows; r0 += BLK_ROWS) {
    const int32_t nr = rows - r0 < BLK_ROWS ? rows - r0 : BLK_ROWS;
    const int64_t i_last = gb * G + r0 + nr - 1;
    const float *qp = f->q + (((int64_t)lb * G + r0) * Hq + h) * d;
    for (int64_t kx = 0; kx < nx; kx++) {
      const int64_t kb = cpu_call_block(a, kx), c0 = kb * G;
      if (cpu_block_skip(a, gb, kb, nb) || (!a->noncausal && c0 > i_last)) continue;
      const int64_t c1 = key_end(a, c0, i_last);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, (int)(c1 - c0), d, (float)a->scale,
                  qp, (int64_t)Hq * d, f->k + (cpu_key_slot(a, kx, kb, c0) * Hkv + hk) * d,
                  (int64_t)Hkv * d, 0.0f, A, G);
      for (int32_t r = 0; r < nr; r++) {
        const int64_t i = gb * G + r0 + r;
        const int64_t jend = !a->noncausal && i + 1 < c1 ? i + 1 : c1;
        if (jend <= c0) continue;
        const float lse =
            (float)mtrain_cpu_load(a->lse, a->lse_dtype, ((int64_t)lb * G + r0 + r) * Hq + h);
        const float *row = A + (int64_t)r * G;
        float part = 0.0f;
        for (int64_t j = c0; j < jend; j++) part += expf(row[j - c0] - lse);
        out[kb] += (double)part;
      }
    }
  }
  return 0;
}

mtrain_status_t mtrain_cpu_fast_block_scores(void *state, const mtrain_block_scores_args_t *a) {
  cpu_state_t *s = state;
  mtrain_status_t st = check_args(a);
  if (st) return st;
  if (a->method == MTRAIN_BLOCK_MEANPOOL) return meanpool_scores(s, a);
  const int32_t G = a->granularity, Hq = a->num_heads;
  const int64_t N = a->seq_len, nb = (N + G - 1) / G;
  fast_inputs_t f;
  st = fast_inputs(s, a, &f);
  if (st) return st;
  if (a->method == MTRAIN_BLOCK_ANTIDIAG) {
    st = mtrain_cpu_fast_antidiag_scores(s, a, f.q, f.k);
    free(f.own_q);
    free(f.own_k);
    return st;
  }
  const int blas_threads = cpu_blas_single_begin();
  const int64_t tasks = (int64_t)Hq * a->num_q_blocks;
  int failed = 0;
#pragma omp parallel num_threads(s->num_threads) reduction(| : failed)
  {
    float *A = malloc(sizeof(float) * (size_t)BLK_ROWS * (size_t)G);
    failed |= !A;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
      if (!A) continue;
      const int32_t h = (int32_t)(t / a->num_q_blocks), lb = (int32_t)(t % a->num_q_blocks);
      const int64_t gb = a->q_block_global[lb];
      if (gb >= nb) continue;
      const int32_t rows = mtrain_block_rows(a->q_tokens, G, lb, gb, N);
      if (rows <= 0) continue;
      fast_precise_row(a, &f, h, lb, gb, rows, A, cpu_block_out_row(a, h, lb, gb));
    }
    free(A);
  }
  cpu_blas_single_end(blas_threads);
  free(f.own_q);
  free(f.own_k);
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu block scores: out of memory")
                : MTRAIN_SUCCESS;
}
