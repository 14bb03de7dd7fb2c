/* bench_plan_cuda_step.c: the replica of cuda_step_upload's host work
 * (bench_plan_cuda_step.h). The loops are those of backends/cuda/cuda_step.c
 * at commit 906fdc4; only the staging ring and the CUDA calls are gone. */
#include <stdlib.h>
#include <string.h>

#include "bench_plan_cuda_step.h"
#include "mtrain/mtrain_error.h"

enum { BAR_TILE = 64, HM_STRIDE = 8 }; /* CUDA_BAR_TILE, CUDA_HM_STRIDE */

typedef struct step_sizes {
  size_t heads_i32, kv_entries, bar_tiles, bar_entries;
} step_sizes_t;

static void count_sizes(const mtrain_step_view_t *v, int backward, step_sizes_t *z) {
  memset(z, 0, sizeof *z);
  const int32_t nqb = v->num_q_blocks;
  z->heads_i32 = (size_t)v->num_heads * HM_STRIDE;
  for (int32_t h = 0; h < v->num_heads; h++) {
    const mtrain_step_head_t *hd = &v->heads[h];
    z->heads_i32 += 2 * (size_t)(nqb + 1) + 2 * (size_t)hd->num_runs + 2 * (size_t)hd->num_segs +
                    (size_t)hd->num_bars;
    if (!backward) continue;
    for (int32_t e = 0; e < hd->num_runs; e++)
      z->kv_entries += (size_t)(hd->runs[2 * e + 1] - hd->runs[2 * e]);
    z->bar_tiles += (size_t)((hd->num_bars + BAR_TILE - 1) / BAR_TILE);
    for (int32_t sg = 0; sg < hd->num_segs; sg++) {
      const int32_t s0 = hd->segs[2 * sg], s1 = hd->segs[2 * sg + 1];
      if (s1 > s0) z->bar_entries += (size_t)((s1 - 1) / BAR_TILE - s0 / BAR_TILE + 1);
    }
  }
}

static int32_t *put(int32_t *dst, const int32_t *src, size_t n) {
  if (n) memcpy(dst, src, n * sizeof *src);
  return dst + n;
}

void bench_cuda_step_free(bench_cuda_staging_t *s) {
  free(s->host);
  s->host = NULL;
  s->cap = 0;
}

mtrain_status_t bench_cuda_step_host(bench_cuda_staging_t *s, const mtrain_step_view_t *v,
                                     int32_t hkv, int backward, size_t *bytes_out) {
  const int32_t Hq = v->num_heads, nqb = v->num_q_blocks, nkb = v->num_k_blocks;
  if (hkv < 1 || Hq % hkv != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH, "cuda step replica: %d query heads, %d kv heads",
                        Hq, hkv);
  step_sizes_t z;
  count_sizes(v, backward, &z);
  const size_t n_kvoff = backward ? (size_t)hkv * nkb + 1 : 0;
  const size_t n_i32 = z.heads_i32 + n_kvoff + 2 * z.kv_entries + 3 * z.bar_tiles +
                       (backward ? z.bar_tiles + 1 : 0) + 3 * z.bar_entries;
  const size_t bytes = sizeof(int64_t) * (size_t)(nqb + nkb) + sizeof(int32_t) * n_i32 + 16;
  if (bytes > s->cap) {
    free(s->host);
    s->cap = bytes < 65536 ? 65536 : bytes + bytes / 2;
    s->host = malloc(s->cap);
    if (!s->host) {
      s->cap = 0;
      return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda step replica: out of memory");
    }
  }
  char *host = s->host;
  int64_t *g64 = (int64_t *)host;
  memcpy(g64, v->q_block_global, sizeof(int64_t) * (size_t)nqb);
  memcpy(g64 + nqb, v->k_block_global, sizeof(int64_t) * (size_t)nkb);
  int32_t *base = (int32_t *)(g64 + nqb + nkb);
  int32_t *meta = base, *w = base + (size_t)Hq * HM_STRIDE;
  int32_t bar_base = 0;
  for (int32_t h = 0; h < Hq; h++) {
    const mtrain_step_head_t *hd = &v->heads[h];
    int32_t *m = meta + (size_t)h * HM_STRIDE;
    m[0] = (int32_t)(w - base - (ptrdiff_t)Hq * HM_STRIDE);
    w = put(w, hd->run_off, (size_t)nqb + 1);
    m[1] = (int32_t)(w - base - (ptrdiff_t)Hq * HM_STRIDE);
    w = put(w, hd->runs, 2 * (size_t)hd->num_runs);
    m[2] = (int32_t)(w - base - (ptrdiff_t)Hq * HM_STRIDE);
    w = put(w, hd->seg_off, (size_t)nqb + 1);
    m[3] = (int32_t)(w - base - (ptrdiff_t)Hq * HM_STRIDE);
    w = put(w, hd->segs, 2 * (size_t)hd->num_segs);
    m[4] = (int32_t)(w - base - (ptrdiff_t)Hq * HM_STRIDE);
    w = put(w, hd->bars, (size_t)hd->num_bars);
    m[5] = hd->num_bars;
    m[6] = bar_base;
    m[7] = 0;
    bar_base += hd->num_bars;
  }
  if (backward) {
    const int32_t group = Hq / hkv;
    int32_t *kv_off = w;
    w += n_kvoff;
    int32_t *kv_ent = w;
    w += 2 * z.kv_entries;
    memset(kv_off, 0, n_kvoff * sizeof(int32_t));
    for (int32_t h = 0; h < Hq; h++) {
      const mtrain_step_head_t *hd = &v->heads[h];
      for (int32_t e = 0; e < hd->num_runs; e++)
        for (int32_t kb = hd->runs[2 * e]; kb < hd->runs[2 * e + 1]; kb++)
          kv_off[(size_t)(h / group) * nkb + kb + 1]++;
    }
    for (size_t x = 1; x < n_kvoff; x++) kv_off[x] += kv_off[x - 1];
    int32_t *fill = malloc(sizeof(int32_t) * (n_kvoff ? n_kvoff : 1));
    if (!fill) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda step replica: out of memory");
    memcpy(fill, kv_off, sizeof(int32_t) * n_kvoff);
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
    int32_t *bt_tile = w;
    w += 3 * z.bar_tiles;
    int32_t *bt_off = w;
    w += z.bar_tiles + 1;
    int32_t *bt_ent = w;
    w += 3 * z.bar_entries;
    int32_t ne = 0, num_tiles = 0;
    bt_off[0] = 0;
    for (int32_t h = 0; h < Hq; h++) {
      const mtrain_step_head_t *hd = &v->heads[h];
      for (int32_t b0 = 0; b0 < hd->num_bars; b0 += BAR_TILE) {
        const int32_t b1 = b0 + BAR_TILE < hd->num_bars ? b0 + BAR_TILE : hd->num_bars;
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
      return mtrain_error(MTRAIN_ERR_INTERNAL, "cuda step replica: bar tile count mismatch");
  }
  *bytes_out = (size_t)((char *)w - host);
  return MTRAIN_SUCCESS;
}
