/* cuda_step.c: uploads the device copy of one plan step (cuda_step_t): packed
 * on the host by cuda_step_tables.c into pinned staging, then copied to the
 * device on the context's stream. The metadata goes through a ring of pinned staging
 * slots, each reused only after the event recorded behind its kernels; the
 * ring grows (to CUDA_STAGE_SLOTS_MAX) rather than make the host wait. */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/cuda_step_tables.h"
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

mtrain_status_t cuda_upload_reserve(cuda_state_t *s, size_t bytes, void **dev, int *slot) {
  int i = 0;
  mtrain_status_t st = slot_acquire(s, bytes, &i);
  if (st) return st;
  *dev = s->slots[i].dev;
  *slot = i;
  return MTRAIN_SUCCESS;
}

mtrain_status_t cuda_upload_commit(cuda_state_t *s, int slot, const void *host, size_t bytes) {
  memcpy(s->slots[slot].host, host, bytes);
  return cuda_check(cudaMemcpyAsync(s->slots[slot].dev, s->slots[slot].host, bytes,
                                    cudaMemcpyHostToDevice, (cudaStream_t)s->stream),
                    "metadata upload");
}

mtrain_status_t cuda_upload_small(cuda_state_t *s, const void *host, size_t bytes, void **dev,
                                  int *slot) {
  int i = 0;
  void *d = NULL;
  mtrain_status_t st = cuda_upload_reserve(s, bytes, &d, &i);
  if (st) return st;
  st = cuda_upload_commit(s, i, host, bytes);
  if (st) {
    cuda_step_release(s, i);
    return st;
  }
  *dev = d;
  *slot = i;
  return MTRAIN_SUCCESS;
}

mtrain_status_t cuda_step_upload(cuda_state_t *s, const mtrain_step_view_t *v, int32_t hkv,
                                 int32_t d, double scale, int backward, cuda_step_t *out,
                                 int *slot) {
  cuda_step_tables_t t;
  mtrain_status_t st = cuda_step_tables_size(v, hkv, backward, &t);
  if (st) return st;
  int i = 0;
  if ((st = slot_acquire(s, t.bytes, &i))) return st;
  char *host = s->slots[i].host, *dev = s->slots[i].dev;
  if ((st = cuda_step_tables_pack(v, hkv, backward, host, &t))) return st;
  st = cuda_check(
      cudaMemcpyAsync(dev, host, t.bytes, cudaMemcpyHostToDevice, (cudaStream_t)s->stream),
      "step metadata upload");
  if (st) return st;
  const int32_t *base = (const int32_t *)(dev + t.i32_base);
#define DEV(off) ((off) == SIZE_MAX ? NULL : base + (off))
  memset(out, 0, sizeof *out);
  out->G = v->granularity;
  out->Hq = v->num_heads;
  out->Hkv = hkv;
  out->group = v->num_heads / hkv;
  out->d = d;
  out->num_q_blocks = v->num_q_blocks;
  out->num_k_blocks = v->num_k_blocks;
  out->causal = v->causal ? 1 : 0;
  out->seq_len = v->seq_len;
  out->q_tokens = v->q_tokens;
  out->k_tokens = v->k_tokens;
  out->scale = (float)scale;
  out->q_block_global = (const int64_t *)dev;
  out->k_block_global = (const int64_t *)dev + v->num_q_blocks;
  out->head_meta = DEV(t.head_meta);
  out->idx = DEV(t.idx);
  out->kv_off = DEV(t.kv_off);
  out->kv_ent = DEV(t.kv_ent);
  out->bt_tile = DEV(t.bt_tile);
  out->bt_off = DEV(t.bt_off);
  out->bt_ent = DEV(t.bt_ent);
#undef DEV
  out->num_bar_tiles = t.num_bar_tiles;
  out->total_bars = t.total_bars;
  *slot = i;
  return MTRAIN_SUCCESS;
}
