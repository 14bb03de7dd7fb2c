/* cpu_scores.c: the pattern scores of SPEC.md section 2 (the
 * pattern_scores slot) for both CPU backends. The reference computes each
 * logit as an fp64 dot product; the fast path computes the L x tile logits of
 * a head with one sgemm in fp32. Both then accumulate in fp64 in the fixed
 * order the spec prescribes (rows ascending for every column and every
 * (diagonal, key block) slot, keys ascending within a block), so a result
 * never depends on threads. OpenMP over heads: each head owns its outputs. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_fast_common.h"
#include "mtrain/mtrain_error.h"

/* Accumulates one logit a = A[r, j] (key j in global block gb) of head h
 * into the stage's outputs. */
static inline void accumulate(const mtrain_scores_args_t *a, int32_t h, int32_t r, int64_t j,
                              int64_t gb, double logit, int32_t slots, int64_t nb) {
  const int32_t L = a->last_q;
  const int64_t N = a->seq_len, row = (int64_t)h * L + r;
  switch (a->stage) {
  case MTRAIN_SCORES_ROW_MAX:
    if (logit > a->row_out[row]) a->row_out[row] = logit;
    break;
  case MTRAIN_SCORES_ROW_BLOCK_SUMS:
    a->row_out[row * nb + gb] += exp(logit - a->row_max[row]);
    break;
  case MTRAIN_SCORES_SUMS: {
    const double s =
        a->probs[h] ? exp(logit - a->row_max[row]) / a->row_norm[row] / (double)L : logit;
    const int64_t t = N - L + r - j, lo = N - L - t > 0 ? N - L - t : 0;
    a->col_out[(int64_t)h * N + j] += s;
    a->diag_out[((int64_t)h * N + t) * slots + (gb - lo / a->granularity)] += s;
    break;
  }
  }
}

static mtrain_status_t check_stage(const mtrain_scores_args_t *a) {
  if (a->stage != MTRAIN_SCORES_ROW_MAX && a->stage != MTRAIN_SCORES_ROW_BLOCK_SUMS &&
      a->stage != MTRAIN_SCORES_SUMS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "pattern scores: unknown stage %d",
                        (int)a->stage);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cpu_ref_pattern_scores(void *state, const mtrain_scores_args_t *a) {
  cpu_state_t *s = state;
  mtrain_status_t st = check_stage(a);
  if (st) return st;
  const int32_t L = a->last_q, Hq = a->num_heads, Hkv = a->num_kv_heads, d = a->head_dim;
  const int32_t G = a->granularity, group = Hq / Hkv, slots = mtrain_scores_slots(L, G);
  const int64_t N = a->seq_len, nb = (N + G - 1) / G;
  int failed = 0;
#pragma omp parallel for num_threads(s->num_threads) schedule(dynamic, 1) reduction(| : failed)
  for (int32_t h = 0; h < Hq; h++) {
    double *q = malloc(sizeof(double) * (size_t)d), *k = malloc(sizeof(double) * (size_t)d);
    if (!q || !k) {
      failed = 1;
      free(q);
      free(k);
      continue;
    }
    for (int32_t r = 0; r < L; r++) {
      const int64_t qpos = N - L + r;
      for (int32_t c = 0; c < d; c++)
        q[c] = mtrain_cpu_load(a->q_last, a->q_dtype, ((int64_t)r * Hq + h) * d + c);
      for (int32_t lb = 0; lb < a->num_k_blocks; lb++) {
        const int64_t gb = a->k_block_global[lb];
        const int32_t cols = mtrain_block_rows(a->k_tokens, G, lb, gb, N);
        for (int32_t c = 0; c < cols && gb * G + c <= qpos; c++) {
          const int64_t jl = (int64_t)lb * G + c;
          double dot = 0.0;
          for (int32_t x = 0; x < d; x++) {
            k[x] = mtrain_cpu_load(a->k, a->dtype, (jl * Hkv + h / group) * d + x);
            dot += q[x] * k[x];
          }
          accumulate(a, h, r, gb * G + c, gb, a->scale * dot, slots, nb);
        }
      }
    }
    free(q);
    free(k);
  }
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu-ref pattern scores: out of memory")
                : MTRAIN_SUCCESS;
}

/* Local key blocks per sgemm tile, and the tile's columns at most where a
 * block is wider than SCORE_TILE_COLS / SCORE_TILE_BLOCKS: tiles then split
 * blocks, so the [L x tile] buffer does not grow with the granularity. */
#define SCORE_TILE_BLOCKS 4
#define SCORE_TILE_COLS 1024

mtrain_status_t mtrain_cpu_fast_pattern_scores(void *state, const mtrain_scores_args_t *a) {
  cpu_state_t *s = state;
  mtrain_status_t st = check_stage(a);
  if (st) return st;
  const int32_t L = a->last_q, Hq = a->num_heads, Hkv = a->num_kv_heads, d = a->head_dim;
  const int32_t G = a->granularity, group = Hq / Hkv, slots = mtrain_scores_slots(L, G);
  const int64_t N = a->seq_len, nb = (N + G - 1) / G;
  /* fp32 views of q_last and k */
  float *qf = malloc(sizeof(float) * (size_t)L * Hq * d);
  float *kf =
      a->dtype == MTRAIN_F32 ? NULL : malloc(sizeof(float) * (size_t)(a->k_tokens * Hkv * d + 1));
  if (!qf || (a->dtype != MTRAIN_F32 && !kf)) {
    free(qf);
    free(kf);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu pattern scores: out of memory");
  }
  mtrain_cpu_convert(s, a->q_last, a->q_dtype, qf, MTRAIN_F32, (int64_t)L * Hq * d);
  if (kf) mtrain_cpu_convert(s, a->k, a->dtype, kf, MTRAIN_F32, a->k_tokens * Hkv * d);
  const float *K = kf ? kf : a->k;
  /* local block lb holds local columns [lb G, lb G + its rows) */
  const int64_t k_cols =
      (int64_t)a->num_k_blocks * G < a->k_tokens ? (int64_t)a->num_k_blocks * G : a->k_tokens;
  const int tile =
      G <= SCORE_TILE_COLS / SCORE_TILE_BLOCKS ? SCORE_TILE_BLOCKS * G : SCORE_TILE_COLS;
  const int blas_threads = cpu_blas_single_begin();
  int failed = 0;
#pragma omp parallel for num_threads(s->num_threads) schedule(dynamic, 1) reduction(| : failed)
  for (int32_t h = 0; h < Hq; h++) {
    float *A = malloc(sizeof(float) * (size_t)L * tile);
    if (!A) {
      failed = 1;
      continue;
    }
    for (int64_t c0 = 0; c0 < k_cols; c0 += tile) {
      const int64_t c1 = c0 + tile < k_cols ? c0 + tile : k_cols;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, L, (int)(c1 - c0), d, (float)a->scale,
                  qf + (int64_t)h * d, Hq * d, K + c0 * Hkv * d + (int64_t)(h / group) * d, Hkv * d,
                  0.0f, A, tile);
      const int32_t lb0 = (int32_t)(c0 / G), lb1 = (int32_t)((c1 - 1) / G) + 1;
      for (int32_t r = 0; r < L; r++) {
        const int64_t qpos = N - L + r;
        for (int32_t lb = lb0; lb < lb1; lb++) {
          const int64_t gb = a->k_block_global[lb], first = (int64_t)lb * G;
          const int32_t cols = mtrain_block_rows(a->k_tokens, G, lb, gb, N);
          /* the block's columns in this tile: [cb, ce) within the block */
          const int32_t cb = (int32_t)(c0 > first ? c0 - first : 0);
          const int32_t ce = (int32_t)(c1 - first < cols ? c1 - first : cols);
          const float *row = A + (int64_t)r * tile;
          for (int32_t c = cb; c < ce && gb * G + c <= qpos; c++)
            accumulate(a, h, r, gb * G + c, gb, (double)row[first + c - c0], slots, nb);
        }
      }
    }
    free(A);
  }
  cpu_blas_single_end(blas_threads);
  free(qf);
  free(kf);
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu pattern scores: out of memory")
                : MTRAIN_SUCCESS;
}
