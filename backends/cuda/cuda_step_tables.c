/* cuda_step_tables.c: the host packing of one plan step for the "cuda"
 * backend (cuda_step_tables.h): the step view's per-head CSR arrays as they
 * are, and for the backward the key-major lists of cuda_internal.h (entries
 * of each (kv head, key block), and bar tiles with the query blocks whose
 * segments meet them). Plain C: no CUDA runtime. */
#include "backends/cuda/cuda_step_tables.h"

#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_internal.h"
#include "mtrain/mtrain_error.h"

/* Sizes of the int32 region. */
typedef struct step_sizes {
  size_t heads_i32; /* head_meta + per-head arrays */
  size_t kv_off, kv_entries, bar_tiles, bar_entries;
} step_sizes_t;

static void count_sizes(const mtrain_step_view_t *v, int32_t hkv, int backward, step_sizes_t *z) {
  memset(z, 0, sizeof *z);
  const int32_t nqb = v->num_q_blocks;
  z->heads_i32 = (size_t)v->num_heads * CUDA_HM_STRIDE;
  z->kv_off = backward ? (size_t)hkv * v->num_k_blocks + 1 : 0;
  for (int32_t h = 0; h < v->num_heads; h++) {
    const mtrain_step_head_t *hd = &v->heads[h];
    z->heads_i32 += 2 * (size_t)(nqb + 1) + 2 * (size_t)hd->num_runs + 2 * (size_t)hd->num_segs +
                    (size_t)hd->num_bars;
    if (!backward) continue;
    for (int32_t e = 0; e < hd->num_runs; e++)
      z->kv_entries += (size_t)(hd->runs[2 * e + 1] - hd->runs[2 * e]);
    z->bar_tiles += (size_t)((hd->num_bars + CUDA_BAR_TILE - 1) / CUDA_BAR_TILE);
    for (int32_t sg = 0; sg < hd->num_segs; sg++) {
      const int32_t s0 = hd->segs[2 * sg], s1 = hd->segs[2 * sg + 1];
      if (s1 > s0) z->bar_entries += (size_t)((s1 - 1) / CUDA_BAR_TILE - s0 / CUDA_BAR_TILE + 1);
    }
  }
}

static size_t i32_count(const step_sizes_t *z, int backward) {
  return z->heads_i32 + z->kv_off + 2 * z->kv_entries + 3 * z->bar_tiles +
         (backward ? z->bar_tiles + 1 : 0) + 3 * z->bar_entries;
}

mtrain_status_t cuda_step_tables_size(const mtrain_step_view_t *v, int32_t hkv, int backward,
                                      cuda_step_tables_t *t) {
  const int32_t Hq = v->num_heads;
  if (hkv < 1 || Hq % hkv != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH, "cuda step: %d query heads, %d kv heads", Hq,
                        hkv);
  step_sizes_t z;
  count_sizes(v, hkv, backward, &z);
  const size_t n_i32 = i32_count(&z, backward);
  if (n_i32 > (size_t)INT32_MAX)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda step: metadata of %zu entries exceeds the 32-bit index range", n_i32);
  memset(t, 0, sizeof *t);
  t->i32_base = sizeof(int64_t) * (size_t)(v->num_q_blocks + v->num_k_blocks);
  t->bytes = t->i32_base + sizeof(int32_t) * n_i32 + 16;
  return MTRAIN_SUCCESS;
}

static int32_t *put(int32_t *dst, const int32_t *src, size_t n) {
  if (n) memcpy(dst, src, n * sizeof *src);
  return dst + n;
}

mtrain_status_t cuda_step_tables_pack(const mtrain_step_view_t *v, int32_t hkv, int backward,
                                      char *host, cuda_step_tables_t *t) {
  const int32_t Hq = v->num_heads, nqb = v->num_q_blocks, nkb = v->num_k_blocks;
  mtrain_status_t st = cuda_step_tables_size(v, hkv, backward, t);
  if (st) return st;
  step_sizes_t z;
  count_sizes(v, hkv, backward, &z);
  int64_t *g64 = (int64_t *)host;
  memcpy(g64, v->q_block_global, sizeof(int64_t) * (size_t)nqb);
  memcpy(g64 + nqb, v->k_block_global, sizeof(int64_t) * (size_t)nkb);
  int32_t *base = (int32_t *)(host + t->i32_base);
  int32_t *meta = base, *w = base + (size_t)Hq * CUDA_HM_STRIDE;
  int32_t bar_base = 0;
  for (int32_t h = 0; h < Hq; h++) {
    const mtrain_step_head_t *hd = &v->heads[h];
    int32_t *m = meta + (size_t)h * CUDA_HM_STRIDE;
    m[CUDA_HM_RUN_OFF] = (int32_t)(w - base - (ptrdiff_t)Hq * CUDA_HM_STRIDE);
    w = put(w, hd->run_off, (size_t)nqb + 1);
    m[CUDA_HM_RUNS] = (int32_t)(w - base - (ptrdiff_t)Hq * CUDA_HM_STRIDE);
    w = put(w, hd->runs, 2 * (size_t)hd->num_runs);
    m[CUDA_HM_SEG_OFF] = (int32_t)(w - base - (ptrdiff_t)Hq * CUDA_HM_STRIDE);
    w = put(w, hd->seg_off, (size_t)nqb + 1);
    m[CUDA_HM_SEGS] = (int32_t)(w - base - (ptrdiff_t)Hq * CUDA_HM_STRIDE);
    w = put(w, hd->segs, 2 * (size_t)hd->num_segs);
    m[CUDA_HM_BARS] = (int32_t)(w - base - (ptrdiff_t)Hq * CUDA_HM_STRIDE);
    w = put(w, hd->bars, (size_t)hd->num_bars);
    m[CUDA_HM_NUM_BARS] = hd->num_bars;
    m[CUDA_HM_BAR_BASE] = bar_base;
    m[7] = 0;
    bar_base += hd->num_bars;
  }
  t->head_meta = 0;
  t->idx = (size_t)Hq * CUDA_HM_STRIDE;
  t->kv_off = t->kv_ent = t->bt_tile = t->bt_off = t->bt_ent = SIZE_MAX;
  t->total_bars = bar_base;
  t->num_bar_tiles = 0;
  if (!backward) return MTRAIN_SUCCESS;
  const int32_t group = Hq / hkv;
  int32_t *kv_off = w;
  t->kv_off = (size_t)(w - base);
  w += z.kv_off;
  int32_t *kv_ent = w;
  t->kv_ent = (size_t)(w - base);
  w += 2 * z.kv_entries;
  /* counts per (hk, kb), then prefix sums, then fill in (h, qb) order */
  memset(kv_off, 0, z.kv_off * sizeof(int32_t));
  for (int32_t h = 0; h < Hq; h++) {
    const mtrain_step_head_t *hd = &v->heads[h];
    for (int32_t e = 0; e < hd->num_runs; e++)
      for (int32_t kb = hd->runs[2 * e]; kb < hd->runs[2 * e + 1]; kb++)
        kv_off[(size_t)(h / group) * nkb + kb + 1]++;
  }
  for (size_t x = 1; x < z.kv_off; x++) kv_off[x] += kv_off[x - 1];
  int32_t *fill = malloc(sizeof(int32_t) * (z.kv_off ? z.kv_off : 1));
  if (!fill) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda step: out of host memory");
  memcpy(fill, kv_off, sizeof(int32_t) * z.kv_off);
  for (int32_t h = 0; h < Hq; h++) {
    const mtrain_step_head_t *hd = &v->heads[h];
    for (int32_t qb = 0; qb < nqb; qb++)
      for (int32_t e = hd->run_off[qb]; e < hd->run_off[qb + 1]; e++)
        for (int32_t kb = hd->runs[2 * e]; kb < hd->runs[2 * e + 1]; kb++) {
          int32_t at = fill[(size_t)(h / group) * nkb + kb]++;
          kv_ent[2 * (size_t)at] = h;
          kv_ent[2 * (size_t)at + 1] = qb;
        }
  }
  free(fill);
  /* bar tiles */
  int32_t *bt_tile = w;
  t->bt_tile = (size_t)(w - base);
  w += 3 * z.bar_tiles;
  int32_t *bt_off = w;
  t->bt_off = (size_t)(w - base);
  w += z.bar_tiles + 1;
  int32_t *bt_ent = w;
  t->bt_ent = (size_t)(w - base);
  int32_t ne = 0, num_tiles = 0;
  bt_off[0] = 0;
  for (int32_t h = 0; h < Hq; h++) {
    const mtrain_step_head_t *hd = &v->heads[h];
    for (int32_t b0 = 0; b0 < hd->num_bars; b0 += CUDA_BAR_TILE) {
      const int32_t b1 = b0 + CUDA_BAR_TILE < hd->num_bars ? b0 + CUDA_BAR_TILE : hd->num_bars;
      bt_tile[3 * num_tiles] = h;
      bt_tile[3 * num_tiles + 1] = b0;
      bt_tile[3 * num_tiles + 2] = b1;
      for (int32_t qb = 0; qb < nqb; qb++)
        for (int32_t sg = hd->seg_off[qb]; sg < hd->seg_off[qb + 1]; sg++) {
          const int32_t s0 = hd->segs[2 * sg], s1 = hd->segs[2 * sg + 1];
          if (s1 <= b0 || s0 >= b1 || s1 <= s0) continue;
          bt_ent[3 * ne] = qb;
          bt_ent[3 * ne + 1] = s0;
          bt_ent[3 * ne + 2] = s1;
          ne++;
        }
      num_tiles++;
      bt_off[num_tiles] = ne;
    }
  }
  if ((size_t)ne != z.bar_entries || (size_t)num_tiles != z.bar_tiles)
    return mtrain_error(MTRAIN_ERR_INTERNAL, "cuda step: bar tile count mismatch");
  t->num_bar_tiles = num_tiles;
  return MTRAIN_SUCCESS;
}
