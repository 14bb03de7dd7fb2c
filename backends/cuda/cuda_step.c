/* cuda_step.c: builds the device copy of one plan step (cuda_step_t) on the
 * host and uploads it: the step view's per-head CSR arrays as they are, and
 * for the backward the two key-major lists of cuda_internal.h (entries of
 * each (kv head, key block), and bar tiles with the query blocks whose
 * segments meet them). The metadata goes through a ring of pinned staging
 * slots, each reused only after the event recorded behind its kernels; the
 * ring grows (to CUDA_STAGE_SLOTS_MAX) rather than make the host wait. */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_internal.h"
#include "mtrain/mtrain_error.h"

/* Makes slot i hold at least `bytes` (host pinned + device); waits for its
 * previous users first. */
static mtrain_status_t slot_reserve(cuda_state_t *s, int i, size_t bytes) {
  cuda_stage_slot_t *sl = &s->slots[i];
  mtrain_status_t st =
      cuda_check(cudaEventSynchronize((cudaEvent_t)sl->event), "waiting for a staging slot");
  if (st) return st;
  if (bytes <= sl->cap) return MTRAIN_SUCCESS;
  if (sl->host) cudaFreeHost(sl->host);
  if (sl->dev) cudaFree(sl->dev);
  sl->host = sl->dev = NULL;
  sl->cap = 0;
  size_t cap = bytes < 65536 ? 65536 : bytes + bytes / 2;
  if ((st = cuda_check(cudaMallocHost(&sl->host, cap), "cudaMallocHost (step staging)"))) return st;
  if ((st = cuda_check(cudaMalloc(&sl->dev, cap), "cudaMalloc (step metadata)"))) return st;
  sl->cap = cap;
  return MTRAIN_SUCCESS;
}

/* Picks the slot for the next upload: the next one in turn when the work
 * that read it is done; while it is still in use and fewer than
 * CUDA_STAGE_SLOTS_MAX exist, a new slot, so that the host does not wait for
 * the device (stream-ordered calls); with all slots made, the next one in
 * turn, waiting for it in slot_reserve. */
static mtrain_status_t slot_acquire(cuda_state_t *s, size_t bytes, int *out) {
  int i = s->next_slot;
  const cudaError_t q = cudaEventQuery((cudaEvent_t)s->slots[i].event);
  if (q != cudaSuccess && q != cudaErrorNotReady) return cuda_check(q, "staging slot query");
  if (q == cudaErrorNotReady) {
    cudaGetLastError(); /* not an error: the slot is busy */
    if (s->num_slots < CUDA_STAGE_SLOTS_MAX) {
      cudaEvent_t ev = NULL;
      mtrain_status_t st = cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                                      "cudaEventCreateWithFlags (staging slot)");
      if (st) return st;
      i = s->num_slots++;
      s->slots[i].event = ev;
    }
  }
  s->next_slot = (i + 1) % s->num_slots;
  *out = i;
  return slot_reserve(s, i, bytes);
}

mtrain_status_t cuda_step_release(cuda_state_t *s, int slot) {
  return cuda_check(cudaEventRecord((cudaEvent_t)s->slots[slot].event, (cudaStream_t)s->stream),
                    "cudaEventRecord");
}

mtrain_status_t cuda_upload_small(cuda_state_t *s, const void *host, size_t bytes, void **dev,
                                  int *slot) {
  int i = 0;
  mtrain_status_t st = slot_acquire(s, bytes, &i);
  if (st) return st;
  memcpy(s->slots[i].host, host, bytes);
  st = cuda_check(cudaMemcpyAsync(s->slots[i].dev, s->slots[i].host, bytes, cudaMemcpyHostToDevice,
                                  (cudaStream_t)s->stream),
                  "metadata upload");
  if (st) return st;
  *dev = s->slots[i].dev;
  *slot = i;
  return MTRAIN_SUCCESS;
}

/* Sizes of the int32 region. */
typedef struct step_sizes {
  size_t heads_i32; /* head_meta + per-head arrays */
  size_t kv_entries, bar_tiles, bar_entries;
} step_sizes_t;

static void count_sizes(const mtrain_step_view_t *v, int32_t hkv, int backward, step_sizes_t *z) {
  memset(z, 0, sizeof *z);
  const int32_t nqb = v->num_q_blocks;
  z->heads_i32 = (size_t)v->num_heads * CUDA_HM_STRIDE;
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
  (void)hkv;
}

static int32_t *put(int32_t *dst, const int32_t *src, size_t n) {
  if (n) memcpy(dst, src, n * sizeof *src);
  return dst + n;
}

mtrain_status_t cuda_step_upload(cuda_state_t *s, const mtrain_step_view_t *v, int32_t hkv,
                                 int32_t d, double scale, int backward, cuda_step_t *out,
                                 int *slot) {
  const int32_t Hq = v->num_heads, nqb = v->num_q_blocks, nkb = v->num_k_blocks;
  if (hkv < 1 || Hq % hkv != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH, "cuda step: %d query heads, %d kv heads", Hq,
                        hkv);
  step_sizes_t z;
  count_sizes(v, hkv, backward, &z);
  const size_t n_kvoff = backward ? (size_t)hkv * nkb + 1 : 0;
  const size_t n_i32 = z.heads_i32 + n_kvoff + 2 * z.kv_entries + 3 * z.bar_tiles +
                       (backward ? z.bar_tiles + 1 : 0) + 3 * z.bar_entries;
  if (n_i32 > (size_t)INT32_MAX)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda step: metadata of %zu entries exceeds the 32-bit index range", n_i32);
  const size_t bytes = sizeof(int64_t) * (size_t)(nqb + nkb) + sizeof(int32_t) * n_i32 + 16;
  int i = 0;
  mtrain_status_t st = slot_acquire(s, bytes, &i);
  if (st) return st;
  char *host = s->slots[i].host, *dev = s->slots[i].dev;
  int64_t *g64 = (int64_t *)host;
  memcpy(g64, v->q_block_global, sizeof(int64_t) * (size_t)nqb);
  memcpy(g64 + nqb, v->k_block_global, sizeof(int64_t) * (size_t)nkb);
  int32_t *base = (int32_t *)(g64 + nqb + nkb);
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
  int32_t *kv_off = NULL, *kv_ent = NULL, *bt_tile = NULL, *bt_off = NULL, *bt_ent = NULL;
  int32_t num_tiles = 0;
  if (backward) {
    const int32_t group = Hq / hkv;
    kv_off = w;
    w += n_kvoff;
    kv_ent = w;
    w += 2 * z.kv_entries;
    /* counts per (hk, kb), then prefix sums, then fill in (h, qb) order */
    memset(kv_off, 0, n_kvoff * sizeof(int32_t));
    for (int32_t h = 0; h < Hq; h++) {
      const mtrain_step_head_t *hd = &v->heads[h];
      for (int32_t e = 0; e < hd->num_runs; e++)
        for (int32_t kb = hd->runs[2 * e]; kb < hd->runs[2 * e + 1]; kb++)
          kv_off[(size_t)(h / group) * nkb + kb + 1]++;
    }
    for (size_t x = 1; x < n_kvoff; x++) kv_off[x] += kv_off[x - 1];
    int32_t *fill = malloc(sizeof(int32_t) * (n_kvoff ? n_kvoff : 1));
    if (!fill) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda step: out of host memory");
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
    /* bar tiles */
    bt_tile = w;
    w += 3 * z.bar_tiles;
    bt_off = w;
    w += z.bar_tiles + 1;
    bt_ent = w;
    w += 3 * z.bar_entries;
    int32_t ne = 0;
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
  }
  const size_t used = (size_t)((char *)w - host);
  st = cuda_check(cudaMemcpyAsync(dev, host, used, cudaMemcpyHostToDevice, (cudaStream_t)s->stream),
                  "step metadata upload");
  if (st) return st;
#define DEV(p) ((p) ? (const int32_t *)(dev + ((const char *)(p)-host)) : NULL)
  memset(out, 0, sizeof *out);
  out->G = v->granularity;
  out->Hq = Hq;
  out->Hkv = hkv;
  out->group = Hq / hkv;
  out->d = d;
  out->num_q_blocks = nqb;
  out->num_k_blocks = nkb;
  out->seq_len = v->seq_len;
  out->q_tokens = v->q_tokens;
  out->k_tokens = v->k_tokens;
  out->scale = (float)scale;
  out->q_block_global = (const int64_t *)dev;
  out->k_block_global = (const int64_t *)dev + nqb;
  out->head_meta = DEV(meta);
  out->idx = DEV(base + (size_t)Hq * CUDA_HM_STRIDE);
  out->kv_off = DEV(kv_off);
  out->kv_ent = DEV(kv_ent);
  out->bt_tile = DEV(bt_tile);
  out->bt_off = DEV(bt_off);
  out->bt_ent = DEV(bt_ent);
#undef DEV
  out->num_bar_tiles = num_tiles;
  out->total_bars = bar_base;
  *slot = i;
  return MTRAIN_SUCCESS;
}
