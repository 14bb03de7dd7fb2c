/* cpu_fast_fwd.c: the "cpu" backend's forward step: OpenMP over (head, query
 * block), a block of more than MTRAIN_CPU_ROWS rows in chunks of rows,
 * OpenBLAS sgemm on [rows x tile] score tiles and [rows x d] output tiles,
 * flash-style online softmax in fp32, and the merge of the step's partial
 * (O, LSE) into the running fp32 accumulators. Inputs of bf16/fp16 are
 * widened to fp32 once per step; bar rows are gathered per head so that
 * every bar segment is one contiguous GEMM operand. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_fast_common.h"
#include "backends/cpu/cpu_math.h"
#include "backends/cpu/cpu_tiles.h"
#include "mtrain/mtrain_error.h"

mtrain_status_t mtrain_cpu_fast_fwd_init(void *state, void *o_acc, void *lse_acc, int64_t rows,
                                         int32_t num_heads, int32_t head_dim) {
  cpu_state_t *s = state;
  float *o = o_acc, *lse = lse_acc;
  const int64_t no = rows * num_heads * head_dim, nl = rows * num_heads;
#pragma omp parallel num_threads(s->num_threads)
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < no; i++) o[i] = 0.0f;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nl; i++) lse[i] = -INFINITY;
  }
  return MTRAIN_SUCCESS;
}

/* Per-thread state of one (head, query block, chunk of rows) work item. */
typedef struct fwd_item {
  const cpu_step_inputs_t *in;
  int32_t h, hk, nr, d;
  float scale;
  const float *q; /* first row of the chunk, ld in->ldq */
  float *s;       /* [ROWS x TILE] scores / probabilities */
  float *o;       /* [ROWS x d] unnormalised output */
  float *m, *l;   /* [ROWS] running max and sum */
  int32_t row0;   /* the chunk's first row within the query block */
} fwd_item_t;

MTRAIN_CPU_DISPATCH static void fwd_tile(void *ctx, const cpu_tile_t *t) {
  fwd_item_t *it = ctx;
  const cpu_step_inputs_t *in = it->in;
  const float *k, *v;
  int64_t ldk;
  cpu_tile_operands(in, it->h, it->hk, t, &k, &v, &ldk);
  const int32_t n = t->count, nr = it->nr, d = it->d;
  /* a diagonal tile whose every column lies above the chunk's rows */
  if (t->causal && t->diag_col > it->row0 + nr - 1) return;
  float *S = it->s;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, n, d, it->scale, it->q, (int)in->ldq, k,
              (int)ldk, 0.0f, S, MTRAIN_CPU_TILE);
  for (int32_t r = 0; r < nr; r++) {
    float *row = S + (int64_t)r * MTRAIN_CPU_TILE;
    if (t->causal)
      for (int32_t c = cpu_causal_first_masked(t, it->row0, r, n); c < n; c++) row[c] = -INFINITY;
    /* the max and the sum in lanes: as serial chains they took half of this
     * function's time (scalar vmaxss / vaddss, perf annotate, 2026-11-25) */
    const float mx = mtrain_row_max(row, n);
    const float mnew = mx > it->m[r] ? mx : it->m[r];
    if (mnew == -INFINITY) continue; /* nothing allowed yet in this row */
    const float sum = mtrain_row_exp_sum(row, n, mnew);
    const float alpha = mtrain_fast_exp(it->m[r] - mnew);
    it->l[r] = it->l[r] * alpha + sum;
    it->m[r] = mnew;
    if (alpha != 1.0f) {
      float *orow = it->o + (int64_t)r * d;
      for (int32_t c = 0; c < d; c++) orow[c] *= alpha;
    }
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, d, n, 1.0f, S, MTRAIN_CPU_TILE, v,
              (int)ldk, 1.0f, it->o, d);
}

/* Merges a partial result (rows [0, nr) of head h: running max m, sum l,
 * unnormalised output row r, column c at o[r * rs + c * cs]) into the
 * running accumulators at row row0. A row with nothing accumulated yet
 * (lse -inf, output 0) is written without reading the old output. */
static void fwd_merge(const cpu_step_inputs_t *in, int32_t h, int32_t nr, const float *m,
                      const float *l, const float *o, int64_t rs, int64_t cs, int64_t row0,
                      float *o_acc, float *lse_acc) {
  const int32_t Hq = in->view->num_heads, d = in->d;
  for (int32_t r = 0; r < nr; r++) {
    if (!(l[r] > 0.0f)) continue; /* no key in this step: contributes nothing */
    const float lse_s = m[r] + logf(l[r]);
    float *li = lse_acc + (row0 + r) * Hq + h;
    float *oi = o_acc + ((row0 + r) * Hq + h) * d;
    const float *os = o + r * rs;
    const float lo = *li;
    if (lo == -INFINITY) {
      const float w = 1.0f / l[r];
      for (int32_t c = 0; c < d; c++) oi[c] = w * os[c * cs];
      *li = lse_s;
      continue;
    }
    const float mx = lo > lse_s ? lo : lse_s;
    const float lnew = mx + logf(expf(lo - mx) + expf(lse_s - mx));
    const float w_old = expf(lo - lnew), w_new = expf(lse_s - lnew) / l[r];
    for (int32_t c = 0; c < d; c++) oi[c] = w_old * oi[c] + w_new * os[c * cs];
    *li = lnew;
  }
}

/* Per-thread buffers of the AVX-512 items (NULL members when out of memory). */
static void ws_alloc(cpu_fwd_avx512_ws_t *ws, int32_t rows, int32_t d) {
  const size_t rp = (size_t)(rows + 31) / 32 * 32, pad = 16;
  ws->qt = aligned_alloc(64, sizeof(float) * (rp * (size_t)d + pad));
  ws->ot = aligned_alloc(64, sizeof(float) * (rp * (size_t)d + pad));
  ws->orow = aligned_alloc(64, sizeof(float) * (rp * (size_t)d + pad));
  ws->st = aligned_alloc(64, sizeof(float) * (size_t)MTRAIN_CPU_TILE * 32);
  ws->m = aligned_alloc(64, sizeof(float) * rp);
  ws->l = aligned_alloc(64, sizeof(float) * rp);
}

static void ws_free(cpu_fwd_avx512_ws_t *ws) {
  free(ws->qt);
  free(ws->ot);
  free(ws->orow);
  free(ws->st);
  free(ws->m);
  free(ws->l);
}

/* Largest squared row norm of `rows` rows of d floats, `ld` apart (each row
 * `heads` vectors of d). */
static double max_norm2(const float *x, int64_t rows, int32_t heads, int32_t d, int64_t ld) {
  double most = 0.0;
  for (int64_t r = 0; r < rows; r++)
    for (int32_t h = 0; h < heads; h++) {
      const float *v = x + r * ld + (int64_t)h * d;
      double s = 0.0;
      for (int32_t c = 0; c < d; c++) s += (double)v[c] * v[c];
      most = s > most ? s : most;
    }
  return most;
}

/* The AVX-512 kernels sum each score's products in another order than the
 * backward's sgemm, so the forward's LSE and the scores the backward
 * recomputes differ by a few fp32 ulps of the scores; exp(S - LSE) turns that
 * into a relative error of a few ulp(|S|) of P, harmless while |S| is small
 * and fatal when it is not (|S| ~ 5e8: P of 0 or inf, test_run_check_bound).
 * They run only where scale * max|q_i| * max|k_j| (Cauchy-Schwarz: a bound on
 * every |S|) is at most 1024 (ulp 1.2e-4); above it the OpenBLAS path, whose
 * scores are the backward's bit for bit, runs. */
#define AVX512_SCORE_LIMIT 1024.0

static int scores_small(const cpu_step_inputs_t *in, double scale) {
  const mtrain_step_view_t *v = in->view;
  const double q2 = max_norm2(in->q, v->q_tokens, v->num_heads, in->d, in->ldq);
  double k2 = max_norm2(in->k, v->k_tokens, in->hkv, in->d, in->ldk);
  for (int32_t h = 0; in->kbar && h < v->num_heads; h++)
    if (v->heads[h].num_bars > 0) {
      const double b2 = max_norm2(in->kbar[h], v->heads[h].num_bars, 1, in->d, in->d);
      k2 = b2 > k2 ? b2 : k2;
    }
  return scale * sqrt(q2) * sqrt(k2) <= AVX512_SCORE_LIMIT;
}

mtrain_status_t mtrain_cpu_fast_fwd_step(void *state, const mtrain_fwd_step_args_t *a) {
  cpu_state_t *s = state;
  const mtrain_step_view_t *v = a->view;
  const int32_t G = v->granularity, d = a->head_dim;
  cpu_step_inputs_t in;
  mtrain_status_t st =
      cpu_step_inputs_prepare(s, v, a->num_kv_heads, d, a->dtype, a->q, a->k, a->v, NULL, &in);
  if (st) return st;
  int blas_threads = cpu_blas_single_begin();
  const int32_t group = v->num_heads / a->num_kv_heads;
  const int64_t items = (int64_t)v->num_heads * v->num_q_blocks;
  int failed = 0;
  const int32_t rows = G < MTRAIN_CPU_ROWS ? G : MTRAIN_CPU_ROWS;
  const int avx512 = cpu_fwd_avx512_available() && scores_small(&in, a->scale);
#pragma omp parallel num_threads(s->num_threads) reduction(| : failed)
  {
    float *S = NULL, *O = NULL, *M = NULL;
    cpu_fwd_avx512_ws_t ws = {0};
    if (avx512) {
      ws_alloc(&ws, rows, d);
      if (!ws.qt || !ws.ot || !ws.orow || !ws.st || !ws.m || !ws.l) failed = 1;
    } else {
      S = malloc(sizeof(float) * (size_t)rows * MTRAIN_CPU_TILE);
      O = malloc(sizeof(float) * (size_t)rows * d);
      M = malloc(sizeof(float) * (size_t)rows * 2);
      if (!S || !O || !M) failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; i++) {
      if (failed) continue;
      /* the last query blocks first: under causality they have the most
       * keys, and the small items of the first blocks then even out the
       * threads' ends (the largest items last kept one thread waiting) */
      const int32_t qb = v->num_q_blocks - 1 - (int32_t)(i / v->num_heads),
                    h = (int32_t)(i % v->num_heads);
      const int64_t gq = v->q_block_global[qb];
      const int32_t nr = mtrain_block_rows(v->q_tokens, G, qb, gq, v->seq_len);
      /* the block's rows in chunks: rows are independent in the forward */
      for (int32_t r0 = 0; r0 < nr; r0 += rows) {
        const int32_t n = nr - r0 < rows ? nr - r0 : rows;
        if (avx512) {
          cpu_fwd_avx512_item(&in, h, h / group, qb, r0, n, (float)a->scale, &ws);
          fwd_merge(&in, h, n, ws.m, ws.l, ws.orow, d, 1, (int64_t)qb * G + r0, a->o_acc,
                    a->lse_acc);
          continue;
        }
        fwd_item_t it = {&in,
                         h,
                         h / group,
                         n,
                         d,
                         (float)a->scale,
                         in.q + ((int64_t)qb * G + r0) * in.ldq + (int64_t)h * d,
                         S,
                         O,
                         M,
                         M + rows,
                         r0};
        for (int32_t r = 0; r < it.nr; r++) {
          it.m[r] = -INFINITY;
          it.l[r] = 0.0f;
        }
        memset(O, 0, sizeof(float) * (size_t)it.nr * d);
        mtrain_cpu_for_each_tile(v, h, qb, MTRAIN_CPU_TILE, fwd_tile, &it);
        fwd_merge(&in, h, n, it.m, it.l, O, d, 1, (int64_t)qb * G + r0, a->o_acc, a->lse_acc);
      }
    }
    free(S);
    free(O);
    free(M);
    ws_free(&ws);
  }
  cpu_blas_single_end(blas_threads);
  cpu_step_inputs_release(&in);
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu forward: out of memory")
                : MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_fast_bwd_prepare(void *state, const void *o, const void *dout,
                                            mtrain_dtype_t dtype, void *delta_acc, int64_t rows,
                                            int32_t num_heads, int32_t head_dim) {
  cpu_state_t *s = state;
  float *delta = delta_acc;
  const int64_t n = rows * num_heads;
#pragma omp parallel for num_threads(s->num_threads) schedule(static)
  for (int64_t r = 0; r < n; r++) {
    float sum = 0.0f;
    for (int32_t c = 0; c < head_dim; c++)
      sum += (float)mtrain_cpu_load(o, dtype, r * head_dim + c) *
             (float)mtrain_cpu_load(dout, dtype, r * head_dim + c);
    delta[r] = sum;
  }
  return MTRAIN_SUCCESS;
}
