/* cpu_fwd_avx512.c: the "cpu" backend's forward work item (one head, one
 * chunk of at most MTRAIN_CPU_ROWS query rows) with AVX-512 kernels of its
 * own instead of OpenBLAS, chosen at run time where the processor has
 * AVX-512F (cpu_fast_fwd.c keeps the OpenBLAS path for the others).
 *
 * Why (perf, 2026-11-25, vertical-slash forward of mtrain-bench-cpu): with
 * OpenBLAS, 17% of the time went to its operand packing (the query chunk
 * repacked for every 128- or 256-column tile, the probabilities and V for
 * every output GEMM) and 17% to the row softmax between the two GEMMs; the
 * GEMM kernel itself was 45%.
 *
 * Layout: everything is kept with the query rows along the vector lanes.
 * The chunk's queries are transposed once per item into QT [d][RP] (scale
 * folded in; RP = rows rounded up to 32, the padding rows zero), a score
 * slab of 32 rows is ST [columns][32], the unnormalised output OT [d][RP].
 * Then the score kernel reads K rows in place (one broadcast per element,
 * no packing), the softmax's max and sum per row are plain lane-wise vector
 * operations over the columns, and the output kernel reads V rows in place
 * (and applies the online softmax's rescaling of the output as it loads
 * it). Causal tiles skip the 32-row groups' column ranges that lie wholly
 * above the diagonal. Results differ from the OpenBLAS path's in rounding only;
 * they do not depend on the thread count. */
#include "backends/cpu/cpu_fast_common.h"

#if MTRAIN_CPU_HAVE_AVX512

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define AVX512 __attribute__((target("avx512f")))
#define INLINE static inline __attribute__((always_inline))
#define SLAB 32 /* query rows per kernel call: two vectors */
#define NC 12   /* key columns (scores) or output columns (P V) per kernel call */

int cpu_fwd_avx512_available(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

/* exp(x) for x <= 0 (or -inf: 0), as mtrain_fast_exp (cpu_math.h) with FMAs. */
AVX512 INLINE __m512 exp16(__m512 x) {
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  t = _mm512_max_ps(t, _mm512_set1_ps(-127.0f));
  t = _mm512_min_ps(t, _mm512_set1_ps(127.0f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381610e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* ST[j][0..32) = sum_c QT[c][0..32) * K[j][c] for the nc <= NC columns j. */
AVX512 INLINE void score_kernel(const float *qt, int64_t ldqt, const float *k, int64_t ldk,
                                int32_t d, float *st, int nc) {
  __m512 a0[NC], a1[NC];
  for (int j = 0; j < nc; j++) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int32_t c = 0; c < d; c++) {
    const __m512 q0 = _mm512_load_ps(qt + c * ldqt), q1 = _mm512_load_ps(qt + c * ldqt + 16);
    for (int j = 0; j < nc; j++) {
      const __m512 b = _mm512_set1_ps(k[j * ldk + c]);
      a0[j] = _mm512_fmadd_ps(q0, b, a0[j]);
      a1[j] = _mm512_fmadd_ps(q1, b, a1[j]);
    }
  }
  for (int j = 0; j < nc; j++) {
    _mm512_store_ps(st + j * SLAB, a0[j]);
    _mm512_store_ps(st + j * SLAB + 16, a1[j]);
  }
}

/* OT[c][0..32) = alpha * OT[c][0..32) + sum_j ST[j][0..32) * V[j][c] for the
 * nc <= NC columns c (the online softmax's rescaling done on the load: as a
 * pass of its own over OT it was a fifth of the softmax's time). */
AVX512 INLINE void pv_kernel(const float *st, int32_t n, const float *v, int64_t ldv, float *ot,
                             int64_t ldot, __m512 al0, __m512 al1, int nc) {
  __m512 a0[NC], a1[NC];
  for (int c = 0; c < nc; c++) {
    a0[c] = _mm512_mul_ps(_mm512_load_ps(ot + c * ldot), al0);
    a1[c] = _mm512_mul_ps(_mm512_load_ps(ot + c * ldot + 16), al1);
  }
  for (int32_t j = 0; j < n; j++) {
    const __m512 p0 = _mm512_load_ps(st + j * SLAB), p1 = _mm512_load_ps(st + j * SLAB + 16);
    for (int c = 0; c < nc; c++) {
      const __m512 b = _mm512_set1_ps(v[j * ldv + c]);
      a0[c] = _mm512_fmadd_ps(p0, b, a0[c]);
      a1[c] = _mm512_fmadd_ps(p1, b, a1[c]);
    }
  }
  for (int c = 0; c < nc; c++) {
    _mm512_store_ps(ot + c * ldot, a0[c]);
    _mm512_store_ps(ot + c * ldot + 16, a1[c]);
  }
}

/* One instance per column count, so that the accumulators stay in registers. */
#define CASES(F, ...)                                                                              \
  switch (nc) {                                                                                    \
  case 1:                                                                                          \
    F(__VA_ARGS__, 1);                                                                             \
    break;                                                                                         \
  case 2:                                                                                          \
    F(__VA_ARGS__, 2);                                                                             \
    break;                                                                                         \
  case 3:                                                                                          \
    F(__VA_ARGS__, 3);                                                                             \
    break;                                                                                         \
  case 4:                                                                                          \
    F(__VA_ARGS__, 4);                                                                             \
    break;                                                                                         \
  case 5:                                                                                          \
    F(__VA_ARGS__, 5);                                                                             \
    break;                                                                                         \
  case 6:                                                                                          \
    F(__VA_ARGS__, 6);                                                                             \
    break;                                                                                         \
  case 7:                                                                                          \
    F(__VA_ARGS__, 7);                                                                             \
    break;                                                                                         \
  case 8:                                                                                          \
    F(__VA_ARGS__, 8);                                                                             \
    break;                                                                                         \
  case 9:                                                                                          \
    F(__VA_ARGS__, 9);                                                                             \
    break;                                                                                         \
  case 10:                                                                                         \
    F(__VA_ARGS__, 10);                                                                            \
    break;                                                                                         \
  case 11:                                                                                         \
    F(__VA_ARGS__, 11);                                                                            \
    break;                                                                                         \
  default:                                                                                         \
    F(__VA_ARGS__, NC);                                                                            \
    break;                                                                                         \
  }

AVX512 static void scores(const float *qt, int64_t ldqt, const float *k, int64_t ldk, int32_t d,
                          int32_t n, float *st) {
  for (int32_t j = 0; j < n; j += NC) {
    const int nc = n - j < NC ? n - j : NC;
    CASES(score_kernel, qt, ldqt, k + j * ldk, ldk, d, st + (int64_t)j * SLAB)
  }
}

AVX512 static void pv(const float *st, int32_t n, const float *v, int64_t ldv, int32_t d, float *ot,
                      int64_t ldot, __m512 al0, __m512 al1) {
  for (int32_t c = 0; c < d; c += NC) {
    const int nc = d - c < NC ? d - c : NC;
    CASES(pv_kernel, st, n, v + c, ldv, ot + c * ldot, ldot, al0, al1)
  }
}

typedef struct item {
  const cpu_step_inputs_t *in;
  int32_t h, hk, row0, rp;
  cpu_fwd_avx512_ws_t *ws;
} item_t;

/* Masks the slab's columns above the diagonal: row i (of the slab starting
 * at block row `first`) keeps column j when diag_col + j <= first + i. */
AVX512 static void mask_causal(float *st, int32_t n, int32_t diag_col, int32_t first) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int32_t j = 0; j < n; j++) {
    const int32_t keep_from = diag_col + j - first; /* rows below it are masked */
    if (keep_from <= 0) continue;
    for (int half = 0; half < 2; half++) {
      const __mmask16 m = _mm512_cmplt_epi32_mask(
          _mm512_add_epi32(lane, _mm512_set1_epi32(16 * half)), _mm512_set1_epi32(keep_from));
      float *p = st + (int64_t)j * SLAB + 16 * half;
      _mm512_store_ps(p, _mm512_mask_mov_ps(_mm512_load_ps(p), m, ninf));
    }
  }
}

AVX512 static void tile(void *ctx, const cpu_tile_t *t) {
  item_t *it = ctx;
  cpu_fwd_avx512_ws_t *ws = it->ws;
  const float *k, *v;
  int64_t ldk;
  cpu_tile_operands(it->in, it->h, it->hk, t, &k, &v, &ldk);
  const int32_t d = it->in->d, rp = it->rp;
  for (int32_t g = 0; g < rp; g += SLAB) {
    int32_t n = t->count;
    if (t->causal) { /* columns above the slab's last row: none computed */
      const int64_t allowed = (int64_t)it->row0 + g + SLAB - t->diag_col;
      if (allowed <= 0) continue;
      if (allowed < n) n = (int32_t)allowed;
    }
    float *st = ws->st;
    scores(ws->qt + g, rp, k, ldk, d, n, st);
    if (t->causal) mask_causal(st, n, t->diag_col, it->row0 + g);
    __m512 alpha[2];
    for (int half = 0; half < 2; half++) {
      const int32_t o = g + 16 * half;
      const float *col = st + 16 * half;
      /* four running maxima: one was a serial chain of vmaxps latencies */
      __m512 mx4[4];
      for (int x = 0; x < 4; x++) mx4[x] = _mm512_set1_ps(-INFINITY);
      int32_t j = 0;
      for (; j + 4 <= n; j += 4)
        for (int x = 0; x < 4; x++)
          mx4[x] = _mm512_max_ps(mx4[x], _mm512_load_ps(col + (j + x) * SLAB));
      for (; j < n; j++) mx4[0] = _mm512_max_ps(mx4[0], _mm512_load_ps(col + j * SLAB));
      const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx4[0], mx4[1]), _mm512_max_ps(mx4[2], mx4[3]));
      const __m512 mold = _mm512_load_ps(ws->m + o);
      const __m512 mnew = _mm512_max_ps(mold, mx);
      /* rows with nothing allowed yet: shift 0, so that exp gives 0, not NaN */
      const __m512 shift =
          _mm512_mask_mov_ps(mnew, _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                             _mm512_setzero_ps());
      __m512 sum = _mm512_setzero_ps();
      for (j = 0; j < n; j++) {
        float *p = st + j * SLAB + 16 * half;
        const __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(p), shift));
        _mm512_store_ps(p, e);
        sum = _mm512_add_ps(sum, e);
      }
      alpha[half] = exp16(_mm512_sub_ps(mold, shift));
      _mm512_store_ps(ws->l + o, _mm512_fmadd_ps(_mm512_load_ps(ws->l + o), alpha[half], sum));
      _mm512_store_ps(ws->m + o, mnew);
    }
    pv(st, n, v, ldk, d, ws->ot + g, rp, alpha[0], alpha[1]);
  }
}

/* Transposes the 16 x 16 block r[row][column] in registers: r[c] becomes
 * column c. Three stages: 32-bit and 64-bit interleaves within 128-bit lanes,
 * then two shuffles of whole lanes. */
AVX512 INLINE void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++)
    for (int x = 0; x < 2; x++) {
      const __m512d a = _mm512_castps_pd(t[4 * i + x]), b = _mm512_castps_pd(t[4 * i + 2 + x]);
      u[4 * i + 2 * x] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[4 * i + 2 * x + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  /* u[4 i + m], 128-bit lane k: column 4 k + m of rows 4 i .. 4 i + 3 */
  for (int m = 0; m < 4; m++) {
    t[m] = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88);
    t[4 + m] = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xdd);
    t[8 + m] = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
    t[12 + m] = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xdd);
  }
  for (int m = 0; m < 4; m++) {
    r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
    r[4 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xdd);
  }
}

AVX512 void cpu_fwd_avx512_item(const cpu_step_inputs_t *in, int32_t h, int32_t hk, int32_t qb,
                                int32_t row0, int32_t nr, float scale, cpu_fwd_avx512_ws_t *ws) {
  const mtrain_step_view_t *v = in->view;
  const int32_t d = in->d, rp = (nr + SLAB - 1) / SLAB * SLAB;
  const float *q = in->q + ((int64_t)qb * v->granularity + row0) * in->ldq + (int64_t)h * d;
  /* the transposition in 16 x 16 blocks in registers (element by element,
   * column by column over all rows, it was 7% of the forward: perf,
   * 2026-11-25) */
  const __m512 sc = _mm512_set1_ps(scale);
  for (int32_t r0 = 0; r0 < rp; r0 += 16)
    for (int32_t c0 = 0; c0 < d; c0 += 16) {
      const int32_t mc = d - c0 < 16 ? d - c0 : 16;
      const __mmask16 cols = (__mmask16)((1u << mc) - 1u);
      __m512 b[16];
      for (int32_t r = 0; r < 16; r++)
        b[r] = r0 + r < nr
                   ? _mm512_mul_ps(
                         _mm512_maskz_loadu_ps(cols, q + (int64_t)(r0 + r) * in->ldq + c0), sc)
                   : _mm512_setzero_ps();
      transpose16(b);
      for (int32_t c = 0; c < mc; c++) _mm512_store_ps(ws->qt + (int64_t)(c0 + c) * rp + r0, b[c]);
    }
  memset(ws->ot, 0, sizeof(float) * (size_t)d * rp);
  for (int32_t r = 0; r < rp; r++) {
    ws->m[r] = -INFINITY;
    ws->l[r] = 0.0f;
  }
  item_t it = {in, h, hk, row0, rp, ws};
  mtrain_cpu_for_each_tile(v, h, qb, MTRAIN_CPU_TILE, tile, &it);
  /* back to rows for the merge, through 16 x 16 blocks (the merge reading OT
   * with a stride was 8% of the forward: perf, 2026-11-25) */
  for (int32_t r0 = 0; r0 < rp; r0 += 16)
    for (int32_t c0 = 0; c0 < d; c0 += 16) {
      const int32_t mc = d - c0 < 16 ? d - c0 : 16;
      const __mmask16 cols = (__mmask16)((1u << mc) - 1u);
      __m512 b[16];
      for (int32_t c = 0; c < 16; c++)
        b[c] = c < mc ? _mm512_load_ps(ws->ot + (int64_t)(c0 + c) * rp + r0) : _mm512_setzero_ps();
      transpose16(b);
      for (int32_t r = 0; r < 16; r++)
        _mm512_mask_storeu_ps(ws->orow + (int64_t)(r0 + r) * d + c0, cols, b[r]);
    }
}

#else /* no AVX-512 kernels in this build */

int cpu_fwd_avx512_available(void) { return 0; }

void cpu_fwd_avx512_item(const cpu_step_inputs_t *in, int32_t h, int32_t hk, int32_t qb,
                         int32_t row0, int32_t nr, float scale, cpu_fwd_avx512_ws_t *ws) {
  (void)in, (void)h, (void)hk, (void)qb, (void)row0, (void)nr, (void)scale, (void)ws;
}

#endif
