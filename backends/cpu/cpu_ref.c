/* cpu_ref.c: the "cpu-ref" backend's attention: plain loops over exactly the
 * pairs a plan step lists, everything in fp64 (inputs widened, fp64 running
 * O/LSE and gradient accumulators). This is the oracle the fast paths are
 * checked against; it is written for clarity, not speed (OpenMP over query
 * blocks in the forward, over kv heads in the backward, so no two threads
 * ever write the same accumulator). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "backends/cpu/cpu_backend.h"
#include "mtrain/mtrain_error.h"

/* Widens a [rows, heads, d] buffer to fp64; returns the input itself when it
 * already is fp64 (then *owned stays NULL). */
static const double *widen(const void *p, mtrain_dtype_t dtype, int64_t count, double **owned) {
  *owned = NULL;
  if (dtype == MTRAIN_F64) return p;
  double *w = malloc((size_t)(count > 0 ? count : 1) * sizeof *w);
  if (!w) return NULL;
  for (int64_t i = 0; i < count; i++) w[i] = mtrain_cpu_load(p, dtype, i);
  *owned = w;
  return w;
}

/* A (head, query block) of a step: collect_keys writes the local key
 * columns query row r of the block computes, in plan order. */
typedef struct row_keys {
  const mtrain_step_view_t *v;
  const mtrain_step_head_t *h;
  int32_t qb;
  int64_t gq;
} row_keys_t;

static int64_t collect_keys(const row_keys_t *rk, int32_t r, int64_t *cols) {
  const mtrain_step_view_t *v = rk->v;
  const int32_t G = v->granularity;
  int64_t n = 0;
  for (int32_t e = rk->h->run_off[rk->qb]; e < rk->h->run_off[rk->qb + 1]; e++)
    for (int32_t kb = rk->h->runs[2 * e]; kb < rk->h->runs[2 * e + 1]; kb++) {
      int64_t gk = v->k_block_global[kb];
      int32_t nc = mtrain_block_rows(v->k_tokens, G, kb, gk, v->seq_len);
      for (int32_t c = 0; c < nc; c++) {
        if (v->causal && gk == rk->gq && c > r) break; /* causal within the diagonal block */
        cols[n++] = (int64_t)kb * G + c;
      }
    }
  for (int32_t s = rk->h->seg_off[rk->qb]; s < rk->h->seg_off[rk->qb + 1]; s++)
    for (int32_t b = rk->h->segs[2 * s]; b < rk->h->segs[2 * s + 1]; b++)
      cols[n++] = rk->h->bars[b];
  return n;
}

static int64_t max_keys_per_row(const mtrain_step_view_t *v) {
  int64_t most = 0;
  for (int32_t h = 0; h < v->num_heads; h++)
    if (v->heads[h].num_bars > most) most = v->heads[h].num_bars;
  return v->k_tokens + most + 1;
}

/* fp64 dot product in a fixed order: four interleaved partial sums (so the
 * compiler can use vector registers without reassociating), added pairwise. */
static double dot(const double *restrict a, const double *restrict b, int32_t d) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int32_t i = 0;
  for (; i + 4 <= d; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < d; i++) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

/* y += a * x (no aliasing between y and x). */
static void axpy(double *restrict y, double a, const double *restrict x, int32_t d) {
  for (int32_t c = 0; c < d; c++) y[c] += a * x[c];
}

mtrain_status_t mtrain_cpu_ref_fwd_init(void *state, void *o_acc, void *lse_acc, int64_t rows,
                                        int32_t num_heads, int32_t head_dim) {
  (void)state;
  double *o = o_acc, *lse = lse_acc;
  for (int64_t i = 0; i < rows * num_heads * head_dim; i++) o[i] = 0.0;
  for (int64_t i = 0; i < rows * num_heads; i++) lse[i] = -INFINITY;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_ref_fwd_step(void *state, const mtrain_fwd_step_args_t *a) {
  cpu_state_t *s = state;
  const mtrain_step_view_t *v = a->view;
  const int32_t Hq = v->num_heads, Hkv = a->num_kv_heads, d = a->head_dim, G = v->granularity;
  const int32_t group = Hq / Hkv;
  double *qo = NULL, *ko = NULL, *vo = NULL;
  const double *Q = widen(a->q, a->dtype, v->q_tokens * Hq * d, &qo);
  const double *K = widen(a->k, a->dtype, v->k_tokens * Hkv * d, &ko);
  const double *V = widen(a->v, a->dtype, v->k_tokens * Hkv * d, &vo);
  const int64_t cap = max_keys_per_row(v);
  int failed = !Q || !K || !V;
  double *O = a->o_acc, *L = a->lse_acc;
  const int64_t items = (int64_t)Hq * v->num_q_blocks;
#pragma omp parallel num_threads(s->num_threads) if (!failed) reduction(| : failed)
  {
    int64_t *cols = malloc((size_t)cap * sizeof *cols);
    double *sc = malloc((size_t)cap * sizeof *sc);
    double *acc = malloc((size_t)d * sizeof *acc);
    if (!cols || !sc || !acc) failed = 1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
      if (failed) continue;
      const int32_t h = (int32_t)(it / v->num_q_blocks), qb = (int32_t)(it % v->num_q_blocks);
      const int32_t hk = h / group;
      row_keys_t rk = {v, &v->heads[h], qb, v->q_block_global[qb]};
      int32_t nr = mtrain_block_rows(v->q_tokens, G, qb, rk.gq, v->seq_len);
      for (int32_t r = 0; r < nr; r++) {
        int64_t i = (int64_t)qb * G + r;
        int64_t n = collect_keys(&rk, r, cols);
        if (n == 0) continue;
        const double *qi = Q + (i * Hq + h) * d;
        double m = -INFINITY;
        for (int64_t e = 0; e < n; e++) {
          sc[e] = a->scale * dot(qi, K + (cols[e] * Hkv + hk) * d, d);
          if (sc[e] > m) m = sc[e];
        }
        double sum = 0.0;
        for (int64_t e = 0; e < n; e++) sum += exp(sc[e] - m);
        const double lse_s = m + log(sum);
        for (int32_t c = 0; c < d; c++) acc[c] = 0.0;
        for (int64_t e = 0; e < n; e++) {
          const double p = exp(sc[e] - lse_s);
          axpy(acc, p, V + (cols[e] * Hkv + hk) * d, d);
        }
        /* merge: LSE = logaddexp(LSE, lse_s), O = w_old O + w_new O_s */
        double *li = L + i * Hq + h, *oi = O + (i * Hq + h) * d;
        const double lo = *li, mx = lo > lse_s ? lo : lse_s;
        const double lnew = mx + log(exp(lo - mx) + exp(lse_s - mx));
        const double w_old = exp(lo - lnew), w_new = exp(lse_s - lnew);
        for (int32_t c = 0; c < d; c++) oi[c] = w_old * oi[c] + w_new * acc[c];
        *li = lnew;
      }
    }
    free(cols);
    free(sc);
    free(acc);
  }
  free(qo);
  free(ko);
  free(vo);
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu-ref forward: out of memory")
                : MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_ref_bwd_prepare(void *state, const void *o, const void *dout,
                                           mtrain_dtype_t dtype, void *delta_acc, int64_t rows,
                                           int32_t num_heads, int32_t head_dim) {
  (void)state;
  double *delta = delta_acc, *oo = NULL, *doo = NULL;
  const double *O = widen(o, dtype, rows * num_heads * head_dim, &oo);
  const double *dO = widen(dout, dtype, rows * num_heads * head_dim, &doo);
  if (!O || !dO) {
    free(oo);
    free(doo);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu-ref backward: out of memory");
  }
  /* the same dot as dP = dout . v, so that a row with one key gets dS = 0 exactly */
  for (int64_t r = 0; r < rows * num_heads; r++)
    delta[r] = dot(dO + r * head_dim, O + r * head_dim, head_dim);
  free(oo);
  free(doo);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_ref_bwd_step(void *state, const mtrain_bwd_step_args_t *a) {
  cpu_state_t *s = state;
  const mtrain_step_view_t *v = a->view;
  const int32_t Hq = v->num_heads, Hkv = a->num_kv_heads, d = a->head_dim, G = v->granularity;
  const int32_t group = Hq / Hkv;
  double *qo = NULL, *ko = NULL, *vo = NULL, *doo = NULL;
  const double *Q = widen(a->q, a->dtype, v->q_tokens * Hq * d, &qo);
  const double *K = widen(a->k, a->dtype, v->k_tokens * Hkv * d, &ko);
  const double *V = widen(a->v, a->dtype, v->k_tokens * Hkv * d, &vo);
  const double *dO = widen(a->dout, a->dtype, v->q_tokens * Hq * d, &doo);
  const double *L = a->lse_acc, *Dl = a->delta_acc;
  double *dQ = a->dq_acc, *dK = a->dk_acc, *dV = a->dv_acc;
  const int64_t cap = max_keys_per_row(v);
  int failed = !Q || !K || !V || !dO;
  /* one kv head per iteration: its dK/dV rows and its group's dQ are private */
#pragma omp parallel for num_threads(s->num_threads) schedule(dynamic, 1) if (!failed)             \
    reduction(|                                                                                    \
              : failed)
  for (int32_t hk = 0; hk < Hkv; hk++) {
    int64_t *cols = malloc((size_t)cap * sizeof *cols);
    if (!cols || failed) {
      failed = 1;
      free(cols);
      continue;
    }
    for (int32_t h = hk * group; h < (hk + 1) * group; h++)
      for (int32_t qb = 0; qb < v->num_q_blocks; qb++) {
        row_keys_t rk = {v, &v->heads[h], qb, v->q_block_global[qb]};
        int32_t nr = mtrain_block_rows(v->q_tokens, G, qb, rk.gq, v->seq_len);
        for (int32_t r = 0; r < nr; r++) {
          const int64_t i = (int64_t)qb * G + r;
          const int64_t n = collect_keys(&rk, r, cols);
          const double *qi = Q + (i * Hq + h) * d, *doi = dO + (i * Hq + h) * d;
          double *dqi = dQ + (i * Hq + h) * d;
          const double lse = L[i * Hq + h], delta = Dl[i * Hq + h];
          for (int64_t e = 0; e < n; e++) {
            const int64_t j = cols[e];
            const double *kj = K + (j * Hkv + hk) * d, *vj = V + (j * Hkv + hk) * d;
            const double p = exp(a->scale * dot(qi, kj, d) - lse);
            const double ds = p * (dot(doi, vj, d) - delta);
            double *dkj = dK + (j * Hkv + hk) * d, *dvj = dV + (j * Hkv + hk) * d;
            axpy(dqi, a->scale * ds, kj, d);
            axpy(dkj, a->scale * ds, qi, d);
            axpy(dvj, p, doi, d);
          }
        }
      }
    free(cols);
  }
  free(qo);
  free(ko);
  free(vo);
  free(doo);
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu-ref backward: out of memory")
                : MTRAIN_SUCCESS;
}
