/* cpu_fast_bwd.c: the "cpu" backend's backward step. For each kv head, the
 * query blocks of its group's heads run in parallel (OpenMP); each work item
 * recomputes its probability tiles from the final LSE and accumulates
 *   dQ += s dS K (straight into dq_acc: the rows belong to the item),
 *   dK += s dS^T Q and dV += P^T dO (into per-thread buffers),
 * with dS = P * (dO V^T - Delta). The per-thread buffers are summed into
 * dk_acc/dv_acc after the kv head, bar rows scattered back to their key
 * positions. All GEMMs are OpenBLAS sgemm in fp32. A query block of more
 * than MTRAIN_CPU_ROWS rows runs in chunks of rows. Extra memory: per thread,
 * two [k_tokens x d] and two [bars x d] fp32 buffers. */
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

/* One thread's scratch and gradient buffers. */
typedef struct bwd_thread {
  float *s, *dp;    /* [ROWS x TILE] */
  float *dk, *dv;   /* [k_tokens x d] for the current kv head */
  float *dkb, *dvb; /* [max bars x d] for the current head */
} bwd_thread_t;

typedef struct bwd_item {
  const cpu_step_inputs_t *in;
  bwd_thread_t *th;
  int32_t h, hk, nr, d;
  float scale;
  const float *q, *dout;    /* first row of the chunk, ld in->ldq */
  float *dq;                /* dq_acc rows of the chunk, ld in->ldq */
  const float *lse, *delta; /* acc rows of the chunk, ld Hq */
  int32_t row0;             /* the chunk's first row within the query block */
} bwd_item_t;

MTRAIN_CPU_DISPATCH static void bwd_tile(void *ctx, const cpu_tile_t *t) {
  bwd_item_t *it = ctx;
  const cpu_step_inputs_t *in = it->in;
  const int32_t Hq = in->view->num_heads, n = t->count, nr = it->nr, d = it->d;
  /* a diagonal tile whose every column lies above the chunk's rows */
  if (t->causal && t->diag_col > it->row0 + nr - 1) return;
  const float *k, *v;
  int64_t ldk;
  cpu_tile_operands(in, it->h, it->hk, t, &k, &v, &ldk);
  float *dk = t->is_bar ? it->th->dkb + t->first * d : it->th->dk + t->first * d;
  float *dv = t->is_bar ? it->th->dvb + t->first * d : it->th->dv + t->first * d;
  float *P = it->th->s, *dP = it->th->dp;
  const int ld = MTRAIN_CPU_TILE;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, n, d, it->scale, it->q, (int)in->ldq, k,
              (int)ldk, 0.0f, P, ld);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, n, d, 1.0f, it->dout, (int)in->ldq, v,
              (int)ldk, 0.0f, dP, ld);
  for (int32_t r = 0; r < nr; r++) {
    float *prow = P + (int64_t)r * ld, *dprow = dP + (int64_t)r * ld;
    const float lse = it->lse[(int64_t)r * Hq], delta = it->delta[(int64_t)r * Hq];
    for (int32_t c = 0; c < n; c++) {
      /* P <= 1 by definition: where the forward's LSE rounds below a score
       * recomputed here, exp must not overflow (cpu_fast_fwd.c keeps the two
       * consistent where the scores are large) */
      const float p = mtrain_fast_exp(fminf(prow[c] - lse, 0.0f));
      prow[c] = p;
      dprow[c] = p * (dprow[c] - delta); /* dS */
    }
    if (t->causal)
      for (int32_t c = cpu_causal_first_masked(t, it->row0, r, n); c < n; c++)
        prow[c] = dprow[c] = 0.0f;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, d, n, it->scale, dP, ld, k, (int)ldk,
              1.0f, it->dq, (int)in->ldq);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, d, nr, it->scale, dP, ld, it->q,
              (int)in->ldq, 1.0f, dk, d);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, d, nr, 1.0f, P, ld, it->dout,
              (int)in->ldq, 1.0f, dv, d);
}

static void threads_free(bwd_thread_t *th, int n) {
  if (!th) return;
  for (int t = 0; t < n; t++) {
    free(th[t].s);
    free(th[t].dp);
    free(th[t].dk);
    free(th[t].dv);
    free(th[t].dkb);
    free(th[t].dvb);
  }
  free(th);
}

static bwd_thread_t *threads_alloc(int n, int32_t rows, int64_t k_tokens, int32_t d,
                                   int32_t max_bars) {
  bwd_thread_t *th = calloc((size_t)n, sizeof *th);
  if (!th) return NULL;
  for (int t = 0; t < n; t++) {
    th[t].s = malloc(sizeof(float) * (size_t)rows * MTRAIN_CPU_TILE);
    th[t].dp = malloc(sizeof(float) * (size_t)rows * MTRAIN_CPU_TILE);
    th[t].dk = malloc(sizeof(float) * (size_t)(k_tokens * d + 1));
    th[t].dv = malloc(sizeof(float) * (size_t)(k_tokens * d + 1));
    th[t].dkb = malloc(sizeof(float) * ((size_t)max_bars * d + 1));
    th[t].dvb = malloc(sizeof(float) * ((size_t)max_bars * d + 1));
    if (!th[t].s || !th[t].dp || !th[t].dk || !th[t].dv || !th[t].dkb || !th[t].dvb) {
      threads_free(th, n);
      return NULL;
    }
  }
  return th;
}

/* One query block of head h against the chunk, in chunks of at most
 * MTRAIN_CPU_ROWS rows (in order: the sums stay deterministic). */
static void bwd_block(const mtrain_bwd_step_args_t *a, const cpu_step_inputs_t *in,
                      bwd_thread_t *mine, int32_t h, int32_t hk, int32_t qb) {
  const mtrain_step_view_t *v = a->view;
  const int32_t G = v->granularity, d = a->head_dim, Hq = v->num_heads;
  const int32_t rows = G < MTRAIN_CPU_ROWS ? G : MTRAIN_CPU_ROWS;
  const int64_t gq = v->q_block_global[qb];
  const int32_t nr = mtrain_block_rows(v->q_tokens, G, qb, gq, v->seq_len);
  for (int32_t r0 = 0; r0 < nr; r0 += rows) {
    const int64_t row0 = (int64_t)qb * G + r0;
    bwd_item_t it = {in,
                     mine,
                     h,
                     hk,
                     nr - r0 < rows ? nr - r0 : rows,
                     d,
                     (float)a->scale,
                     in->q + row0 * in->ldq + (int64_t)h * d,
                     in->dout + row0 * in->ldq + (int64_t)h * d,
                     (float *)a->dq_acc + row0 * in->ldq + (int64_t)h * d,
                     (const float *)a->lse_acc + row0 * Hq + h,
                     (const float *)a->delta_acc + row0 * Hq + h,
                     r0};
    mtrain_cpu_for_each_tile(v, h, qb, MTRAIN_CPU_TILE, bwd_tile, &it);
  }
}

/* Runs the query blocks of head h against the chunk, accumulating into the
 * threads' buffers and dq_acc, then scatters the head's bar gradients. */
static void bwd_head(const mtrain_bwd_step_args_t *a, const cpu_step_inputs_t *in, bwd_thread_t *th,
                     int nthreads, int deterministic, int32_t h, int32_t hk) {
  const mtrain_step_view_t *v = a->view;
  const int32_t d = a->head_dim;
  const int32_t nbars = v->heads[h].num_bars;
  for (int t = 0; t < nthreads; t++) { /* also those OpenMP may not start */
    memset(th[t].dkb, 0, sizeof(float) * (size_t)nbars * d);
    memset(th[t].dvb, 0, sizeof(float) * (size_t)nbars * d);
  }
#pragma omp parallel num_threads(nthreads)
  {
    bwd_thread_t *mine = &th[omp_get_thread_num()];
    if (deterministic) { /* a fixed assignment: the per-thread sums repeat bitwise */
#pragma omp for schedule(static, 1)
      for (int32_t qb = 0; qb < v->num_q_blocks; qb++) bwd_block(a, in, mine, h, hk, qb);
    } else { /* load-balanced, the sums' split over threads varies */
#pragma omp for schedule(dynamic, 1)
      for (int32_t qb = 0; qb < v->num_q_blocks; qb++) bwd_block(a, in, mine, h, hk, qb);
    }
    /* bar gradients: sum over threads, scatter to the bars' key rows */
#pragma omp for schedule(static)
    for (int32_t b = 0; b < nbars; b++) {
      float *dk = (float *)a->dk_acc + ((int64_t)v->heads[h].bars[b] * a->num_kv_heads + hk) * d;
      float *dv = (float *)a->dv_acc + ((int64_t)v->heads[h].bars[b] * a->num_kv_heads + hk) * d;
      for (int t = 0; t < nthreads; t++)
        for (int32_t c = 0; c < d; c++) {
          dk[c] += th[t].dkb[(int64_t)b * d + c];
          dv[c] += th[t].dvb[(int64_t)b * d + c];
        }
    }
  }
}

mtrain_status_t mtrain_cpu_fast_bwd_step(void *state, const mtrain_bwd_step_args_t *a) {
  cpu_state_t *s = state;
  const mtrain_step_view_t *v = a->view;
  const int32_t G = v->granularity, d = a->head_dim, Hkv = a->num_kv_heads;
  const int32_t group = v->num_heads / Hkv;
  const int nthreads = s->num_threads;
  int32_t max_bars = 0;
  for (int32_t h = 0; h < v->num_heads; h++)
    if (v->heads[h].num_bars > max_bars) max_bars = v->heads[h].num_bars;
  cpu_step_inputs_t in;
  mtrain_status_t st =
      cpu_step_inputs_prepare(s, v, Hkv, d, a->dtype, a->q, a->k, a->v, a->dout, &in);
  if (st) return st;
  bwd_thread_t *th =
      threads_alloc(nthreads, G < MTRAIN_CPU_ROWS ? G : MTRAIN_CPU_ROWS, v->k_tokens, d, max_bars);
  if (!th) {
    cpu_step_inputs_release(&in);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY,
                        "cpu backward: out of memory for %d per-thread [%lld x %d] gradient "
                        "buffers",
                        nthreads, (long long)v->k_tokens, d);
  }
  int blas_threads = cpu_blas_single_begin();
  const int64_t kd = v->k_tokens * d;
  for (int32_t hk = 0; hk < Hkv; hk++) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
      memset(th[t].dk, 0, sizeof(float) * (size_t)kd);
      memset(th[t].dv, 0, sizeof(float) * (size_t)kd);
    }
    for (int32_t h = hk * group; h < (hk + 1) * group; h++)
      bwd_head(a, &in, th, nthreads, s->deterministic, h, hk);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < v->k_tokens; j++) {
      float *dk = (float *)a->dk_acc + (j * Hkv + hk) * d;
      float *dv = (float *)a->dv_acc + (j * Hkv + hk) * d;
      for (int t = 0; t < nthreads; t++)
        for (int32_t c = 0; c < d; c++) {
          dk[c] += th[t].dk[j * d + c];
          dv[c] += th[t].dv[j * d + c];
        }
    }
  }
  cpu_blas_single_end(blas_threads);
  threads_free(th, nthreads);
  cpu_step_inputs_release(&in);
  return MTRAIN_SUCCESS;
}
