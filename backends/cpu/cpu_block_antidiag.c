/* cpu_block_antidiag.c: the antidiagonal (XAttention-style) block scores of
 * SPEC.md 9.2 for both CPU backends, from every key at once or, for the
 * distributed selection, from key chunks in three ring passes (SPEC.md 9.6:
 * the row maxima, then the exact normalisers, then the scores), so that no
 * rank holds every key.
 *
 * Both forms make the same arithmetic per entry: X(a, c) from its query rows
 * and its key block alone (cpu-ref: fp64 dot products; cpu: fp32 dot
 * products summed over k ascending, vectorised across key columns), the maximum (exact in
 * any order), the normaliser as an exact fixed-point sum (cpu_antidiag_sum.h: any order), and each
 * key block's entry summed over strided rows ascending, then its columns ascending. The scores of a
 * row are therefore the same bits whichever rank holds which keys and in which order they arrive.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_antidiag_sum.h"
#include "backends/cpu/cpu_block_common.h"
#include "mtrain/mtrain_error.h"

/* Strided rows per chunk of the fast path. */
#define BLK_AROWS 32

/* The state of strided row ar (of global block gb) in args.row_state. */
static mtrain_antidiag_row_t *row_state(const mtrain_block_scores_args_t *a, int32_t h, int32_t lb,
                                        int64_t gb, int64_t ar) {
  const int64_t gs = a->granularity / a->stride;
  return a->row_state + ((int64_t)h * a->num_q_blocks + lb) * gs + (ar - gb * gs);
}

/* The columns of key block kb: c0 .. c0 + *cn - 1 (the last block may have
 * fewer than G / S). */
static int64_t block_cols(const mtrain_block_scores_args_t *a, int64_t kb, int64_t *cn) {
  const int64_t gs = a->granularity / a->stride, ncs = (a->seq_len + a->stride - 1) / a->stride;
  const int64_t c0 = kb * gs;
  *cn = ncs - c0 < gs ? ncs - c0 : gs;
  return c0;
}

/* ---- the reference (fp64) ----------------------------------------------------------- */

/* X(ar, c) of head h with c in call block x (key block kb), fp64; *valid
 * when a term exists. */
static double ref_x(const mtrain_block_scores_args_t *a, int32_t h, int32_t lb, int64_t gb,
                    int64_t ar, int64_t x, int64_t kb, int64_t c, double *q, int *valid) {
  const int32_t S = a->stride, d = a->head_dim, G = a->granularity;
  const int32_t hk = h / (a->num_heads / a->num_kv_heads);
  const int64_t N = a->seq_len;
  double sum = 0.0;
  int terms = 0;
  for (int32_t sp = 0; sp < S; sp++) {
    const int64_t i = ar * S + sp, j = c * S + S - 1 - sp;
    if (i >= N || j >= N || (!a->noncausal && j > i)) continue;
    const int64_t qbase = (((int64_t)lb * G + (i - gb * G)) * a->num_heads + h) * d;
    const int64_t kbase = (cpu_key_slot(a, x, kb, j) * a->num_kv_heads + hk) * d;
    double dot = 0.0;
    for (int32_t e = 0; e < d; e++) {
      q[e] = mtrain_cpu_load(a->q, a->q_dtype, qbase + e);
      dot += q[e] * mtrain_cpu_load(a->k, a->k_dtype, kbase + e);
    }
    sum += dot;
    terms++;
  }
  *valid = terms > 0;
  return a->scale / S * sum;
}

/* One pass over a value X of a defined column of key block kb. */
static void ref_apply(int pass, mtrain_antidiag_row_t *st, double X, int64_t kb, double *out) {
  if (pass == 1) {
    cpu_adrow_max(st, X);
  } else if (pass == 2) {
    cpu_adrow_add(st, exp(X - st->max));
  } else {
    out[kb] += exp(X - st->max) / cpu_adrow_z(st);
  }
}

/* Pass `pass` of strided row ar over the columns of the call's key blocks. */
static void ref_row_pass(const mtrain_block_scores_args_t *a, int pass, int32_t h, int32_t lb,
                         int64_t gb, int64_t ar, mtrain_antidiag_row_t *st, double *q,
                         double *out) {
  const int64_t nb = (a->seq_len + a->granularity - 1) / a->granularity, nx = cpu_call_blocks(a);
  if (pass > 1 && st->max == -INFINITY) return; /* no defined column */
  for (int64_t x = 0; x < nx; x++) {
    const int64_t kb = cpu_call_block(a, x);
    if (cpu_block_skip(a, gb, kb, nb)) continue;
    int64_t cn;
    const int64_t c0 = block_cols(a, kb, &cn);
    for (int64_t c = c0; c < c0 + cn && (a->noncausal || c <= ar); c++) {
      int valid;
      const double X = ref_x(a, h, lb, gb, ar, x, kb, c, q, &valid);
      if (valid) ref_apply(pass, st, X, kb, out);
    }
  }
}

int mtrain_cpu_ref_antidiag_row(const mtrain_block_scores_args_t *a, int32_t h, int32_t lb,
                                int64_t gb, int32_t rows, double *out) {
  const int32_t G = a->granularity, S = a->stride;
  const int64_t a_first = gb * G / S, a_end = (gb * G + rows + S - 1) / S;
  const int64_t ncs = (a->seq_len + S - 1) / S, width = a->noncausal ? ncs : a_end;
  double *q = malloc(sizeof(double) * (size_t)a->head_dim);
  double *X = a->antidiag_pass ? NULL : malloc(sizeof(double) * (size_t)(width + 1));
  uint8_t *valid = a->antidiag_pass ? NULL : malloc((size_t)(width + 1));
  if (!q || (!a->antidiag_pass && (!X || !valid))) {
    free(q), free(X), free(valid);
    return 1;
  }
  for (int64_t ar = a_first; ar < a_end; ar++) {
    if (a->antidiag_pass) {
      ref_row_pass(a, a->antidiag_pass, h, lb, gb, ar, row_state(a, h, lb, gb, ar), q, out);
      continue;
    }
    /* every key at hand: each X once, then the three passes over the row */
    const int64_t ncol = a->noncausal ? ncs : ar + 1;
    for (int64_t c = 0; c < ncol; c++) {
      int v;
      X[c] = ref_x(a, h, lb, gb, ar, c * S / G, c * S / G, c, q, &v);
      valid[c] = (uint8_t)v;
    }
    mtrain_antidiag_row_t st;
    cpu_adrow_init(&st);
    for (int pass = 1; pass <= 3; pass++) {
      if (pass > 1 && st.max == -INFINITY) break; /* no defined column */
      for (int64_t c = 0; c < ncol; c++)
        if (valid[c]) ref_apply(pass, &st, X[c], c * S / G, out);
    }
  }
  free(q), free(X), free(valid);
  return 0;
}

/* ---- the fast path (fp32 logits) ------------------------------------------------------ */

/* Columns per tile of the logit kernel; a key block's G / S strided columns
 * are padded with zero columns to a multiple of it. */
#define XW 8

static int32_t padded_cols(const mtrain_block_scores_args_t *a) {
  return (a->granularity / a->stride + XW - 1) / XW * XW;
}

/* The strided keys of the call, k-major: for kv head hk and call block x a
 * tile [S d][gsp] (gsp = padded_cols), whose column cc holds k_{cS+S-1},
 * ..., k_{cS} (c = kb G / S + cc; zero beyond N, beyond G / S and in padding
 * blocks), at ks + (hk * nx + x) * S d * gsp. */
static void build_kstrided(const mtrain_block_scores_args_t *a, const float *K, int32_t hk,
                           float *ks) {
  const int32_t S = a->stride, d = a->head_dim, Hkv = a->num_kv_heads, G = a->granularity;
  const int32_t gsp = padded_cols(a);
  const int64_t N = a->seq_len, nb = (N + G - 1) / G, nx = cpu_call_blocks(a), gs = G / S;
  const int64_t sd = (int64_t)S * d;
  for (int64_t x = 0; x < nx; x++) {
    const int64_t kb = cpu_call_block(a, x);
    float *tile = ks + ((int64_t)hk * nx + x) * sd * gsp;
    for (int64_t cc = 0; cc < gsp; cc++)
      for (int32_t sp = 0; sp < S; sp++) {
        const int64_t j = (kb * gs + cc) * S + S - 1 - sp;
        float *dst = tile + (int64_t)sp * d * gsp + cc;
        if (cc < gs && kb < nb && j < N) {
          const float *src = K + (cpu_key_slot(a, x, kb, j) * Hkv + hk) * d;
          for (int32_t e = 0; e < d; e++) dst[(int64_t)e * gsp] = src[e];
        } else {
          for (int32_t e = 0; e < d; e++) dst[(int64_t)e * gsp] = 0.0f;
        }
      }
  }
}

/* XW fp32 lanes (GCC and Clang vector extension): one tile row of columns. */
typedef float vxf __attribute__((vector_size(XW * sizeof(float))));

/* Wider vector units where the processor has them (x86-64, GCC): the same
 * lane arithmetic, a multiply then an add per lane (the file is compiled
 * with -ffp-contract=off), so every clone gives the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define XW_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define XW_CLONES
#endif

/* The dot products of four query rows q[0..3] (sd floats each) with the XW
 * columns of kt (k-major, row stride gsp): each a plain fp32 sum over k
 * ascending (lanes are columns, so the order is the same for every tile and
 * call), times alpha into o[r][0 .. XW). */
XW_CLONES static void x_quad(const float *const q[4], const float *kt, int64_t sd, int32_t gsp,
                             float alpha, float o[4][XW]) {
  vxf acc[4];
  memset(acc, 0, sizeof acc);
  for (int64_t k = 0; k < sd; k++) {
    vxf kv;
    memcpy(&kv, kt + k * gsp, sizeof kv);
    for (int r = 0; r < 4; r++) acc[r] += q[r][k] * kv;
  }
  for (int r = 0; r < 4; r++) {
    const vxf res = alpha * acc[r];
    memcpy(o[r], &res, sizeof res);
  }
}

/* The strided queries of rows a0 .. a0 + na - 1 of the query heads of kv
 * head hk (the GQA group): row g na + r = q_{(a0+r)S}, ..., q_{(a0+r)S+S-1}
 * of head hk group + g, zero beyond the block's rows. */
static void build_qstrided(const mtrain_block_scores_args_t *a, const float *Q, int32_t hk,
                           int32_t lb, int64_t gb, int32_t rows, int64_t a0, int32_t na,
                           float *qs) {
  const int32_t S = a->stride, d = a->head_dim, Hq = a->num_heads, G = a->granularity;
  const int32_t group = Hq / a->num_kv_heads;
  for (int32_t g = 0; g < group; g++)
    for (int32_t r = 0; r < na; r++)
      for (int32_t sp = 0; sp < S; sp++) {
        const int64_t rl = (a0 + r) * S + sp - gb * G, h = (int64_t)hk * group + g;
        float *dst = qs + (((int64_t)g * na + r) * S + sp) * d;
        if (rl < rows)
          for (int32_t e = 0; e < d; e++) dst[e] = Q[(((int64_t)lb * G + rl) * Hq + h) * d + e];
        else
          for (int32_t e = 0; e < d; e++) dst[e] = 0.0f;
      }
}

/* X of strided rows a0 .. a0 + na - 1 (query block gb) of the heads of kv
 * head hk against the columns of call block x (key block kb), into xb
 * [group na x G / S], each entry by x_quad (zero query rows beyond the block
 * and zero keys beyond N add nothing); undefined entries -infinity: causally the
 * columns beyond each row's diagonal, the diagonal column recomputed over
 * its terms with key <= query and query < N; non-causally the last column
 * where no term has a real query and a real key. The call depends on (hk,
 * gb, a0, kb) alone (each entry a sum of its own row and column), so its bits are the
 * same from a chunk or from all keys. */
static void block_x(const mtrain_block_scores_args_t *a, const float *K, const float *ks,
                    int32_t hk, int64_t gb, int64_t a0, int32_t na, int64_t x, int64_t kb,
                    const float *qs, float *xb) {
  const int32_t S = a->stride, d = a->head_dim, gs = a->granularity / a->stride;
  const int32_t group = a->num_heads / a->num_kv_heads;
  const int64_t N = a->seq_len, ncs = (N + S - 1) / S, nx = cpu_call_blocks(a), sd = (int64_t)S * d;
  const int32_t gsp = padded_cols(a), rows = group * na;
  const float alpha = (float)(a->scale / S);
  const float *kt = ks + ((int64_t)hk * nx + x) * sd * gsp;
  int64_t cn;
  const int64_t c0 = block_cols(a, kb, &cn);
  for (int32_t gr = 0; gr < rows; gr += 4) {
    const float *q[4]; /* past the last row: the last row again (its results dropped) */
    for (int r = 0; r < 4; r++) q[r] = qs + (int64_t)(gr + r < rows ? gr + r : rows - 1) * sd;
    for (int32_t ct = 0; ct < cn; ct += XW) {
      float o[4][XW];
      x_quad(q, kt + ct, sd, gsp, alpha, o);
      for (int r = 0; r < 4 && gr + r < rows; r++)
        for (int32_t c = 0; c < XW && ct + c < cn; c++)
          xb[(int64_t)(gr + r) * gs + ct + c] = o[r][c];
    }
  }
  for (int32_t gr = 0; gr < group * na; gr++) {
    const int64_t ar = a0 + gr % na;
    float *row = xb + (int64_t)gr * gs;
    if (a->noncausal) {
      /* the last column has a term when some t >= cS + S - N has ar S + t < N */
      const int64_t c = ncs - 1;
      if (c >= c0 && c < c0 + cn && c * S + S - N > N - 1 - ar * S) row[c - c0] = -INFINITY;
      continue;
    }
    if (kb != gb) continue; /* causal, kb < gb: every column defined */
    for (int64_t c = ar + 1; c < c0 + cn; c++) row[c - c0] = -INFINITY;
    double dsum = 0.0;
    int terms = 0;
    for (int32_t sp = 0; sp < S; sp++) {
      const int64_t i = ar * S + sp, j = ar * S + S - 1 - sp;
      if (i >= N || j > i) continue;
      const float *qi = qs + ((int64_t)gr * S + sp) * d;
      const float *kj = K + (cpu_key_slot(a, x, kb, j) * a->num_kv_heads + hk) * d;
      float dot = 0.0f;
      for (int32_t e = 0; e < d; e++) dot += qi[e] * kj[e];
      dsum += dot;
      terms++;
    }
    row[ar - c0] = terms > 0 ? (float)(a->scale / S * dsum) : -INFINITY;
  }
}

/* One pass over the cn columns xr of key block kb of a strided row
 * (-infinity: undefined, skipped). */
static void fast_apply(int pass, mtrain_antidiag_row_t *st, const float *xr, int64_t cn, int64_t kb,
                       double *out) {
  if (pass == 1) {
    for (int64_t c = 0; c < cn; c++)
      if (xr[c] != -INFINITY) cpu_adrow_max(st, (double)xr[c]);
    return;
  }
  if (st->max == -INFINITY) return; /* no defined column */
  const float m = (float)st->max;
  if (pass == 2) {
    for (int64_t c = 0; c < cn; c++)
      if (xr[c] != -INFINITY) cpu_adrow_add(st, (double)expf(xr[c] - m));
    return;
  }
  const double Z = cpu_adrow_z(st);
  for (int64_t c = 0; c < cn; c++)
    if (xr[c] != -INFINITY) out[kb] += (double)expf(xr[c] - m) / Z;
}

/* The rows of one (kv head hk, query block): chunks of BLK_AROWS strided
 * rows of every head of the group; every key at once (xw holds the chunk's
 * X of every key block, [nb][group BLK_AROWS][G/S]) or one pass over the
 * call's key chunk (xw: one key block). */
static void fast_rows(const mtrain_block_scores_args_t *a, const float *Q, const float *K,
                      const float *ks, int32_t hk, int32_t lb, int64_t gb, int32_t rows, float *qs,
                      float *xw) {
  const int32_t G = a->granularity, S = a->stride, gs = G / S;
  const int32_t group = a->num_heads / a->num_kv_heads;
  const int64_t a_first = gb * G / S, a_end = (gb * G + rows + S - 1) / S;
  const int64_t nb = (a->seq_len + G - 1) / G, nx = cpu_call_blocks(a);
  const int64_t slab = (int64_t)group * BLK_AROWS * gs;
  for (int64_t a0 = a_first; a0 < a_end; a0 += BLK_AROWS) {
    const int32_t na = a_end - a0 < BLK_AROWS ? (int32_t)(a_end - a0) : BLK_AROWS;
    build_qstrided(a, Q, hk, lb, gb, rows, a0, na, qs);
    if (a->antidiag_pass) {
      for (int64_t x = 0; x < nx; x++) {
        const int64_t kb = cpu_call_block(a, x);
        if (cpu_block_skip(a, gb, kb, nb)) continue;
        int64_t cn;
        block_cols(a, kb, &cn);
        block_x(a, K, ks, hk, gb, a0, na, x, kb, qs, xw);
        for (int32_t gr = 0; gr < group * na; gr++) {
          const int32_t h = hk * group + gr / na;
          fast_apply(a->antidiag_pass, row_state(a, h, lb, gb, a0 + gr % na), xw + (int64_t)gr * gs,
                     cn, kb, cpu_block_out_row(a, h, lb, gb));
        }
      }
      continue;
    }
    const int64_t kend = a->noncausal ? nb : gb + 1;
    for (int64_t kb = 0; kb < kend; kb++)
      block_x(a, K, ks, hk, gb, a0, na, kb, kb, qs, xw + kb * slab);
    for (int32_t gr = 0; gr < group * na; gr++) {
      const int32_t h = hk * group + gr / na;
      double *out = cpu_block_out_row(a, h, lb, gb);
      mtrain_antidiag_row_t st;
      cpu_adrow_init(&st);
      for (int pass = 1; pass <= 3; pass++)
        for (int64_t kb = 0; kb < kend; kb++) {
          int64_t cn;
          block_cols(a, kb, &cn);
          fast_apply(pass, &st, xw + kb * slab + (int64_t)gr * gs, cn, kb, out);
        }
    }
  }
}

mtrain_status_t mtrain_cpu_fast_antidiag_scores(cpu_state_t *s, const mtrain_block_scores_args_t *a,
                                                const float *q, const float *k) {
  const int32_t G = a->granularity, Hq = a->num_heads, Hkv = a->num_kv_heads, d = a->head_dim;
  const int32_t S = a->stride, gs = G / S, group = Hq / Hkv;
  const int64_t N = a->seq_len, nb = (N + G - 1) / G, nx = cpu_call_blocks(a);
  float *ks = malloc(sizeof(float) * (size_t)(Hkv * nx * S * d * padded_cols(a) + 1));
  if (!ks) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu block scores: out of memory");
#pragma omp parallel for num_threads(s->num_threads) schedule(static)
  for (int32_t hk = 0; hk < Hkv; hk++) build_kstrided(a, k, hk, ks);
  const int64_t tasks = (int64_t)Hkv * a->num_q_blocks;
  const int64_t xw_len = (a->antidiag_pass ? 1 : nb) * (int64_t)group * BLK_AROWS * gs;
  int failed = 0;
#pragma omp parallel num_threads(s->num_threads) reduction(| : failed)
  {
    float *xw = malloc(sizeof(float) * (size_t)xw_len);
    float *qs = malloc(sizeof(float) * (size_t)group * BLK_AROWS * S * d);
    const int ok = xw && qs;
    failed |= !ok;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
      if (!ok) continue;
      const int32_t hk = (int32_t)(t / a->num_q_blocks), lb = (int32_t)(t % a->num_q_blocks);
      const int64_t gb = a->q_block_global[lb];
      if (gb >= nb) continue;
      const int32_t rows = mtrain_block_rows(a->q_tokens, G, lb, gb, N);
      if (rows <= 0) continue;
      fast_rows(a, q, k, ks, hk, lb, gb, rows, qs, xw);
    }
    free(xw);
    free(qs);
  }
  free(ks);
  return failed ? mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu block scores: out of memory")
                : MTRAIN_SUCCESS;
}
