/* cuda_plan_build.cu: the host side of the device-built step tables of a
 * single-rank plan (cuda_plan_build.h): the geometry checks, the size of the
 * device memory, and the launches of plan_kernels.cuh on the state's stream
 * (the sequences' parameters in one uploaded table, five launches for the
 * whole batch, no host wait). */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_plan_build.h"
#include "backends/cuda/plan_kernels.cuh"
#include "mtrain/mtrain_error.h"

/* The checks of the geometry (and with `pointers`, of the patterns'
 * pointers), each failure named. */
static mtrain_status_t check_geom(const cuda_plan_geom_t *g, int pointers) {
  if (!g) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "cuda plan build: geometry is NULL");
  if (g->count < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda plan build: %d sequences (>= 1)",
                        g->count);
  if (!g->seqs) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "cuda plan build: seqs is NULL");
  if (g->num_heads < 1 || g->num_kv_heads < 1 || g->num_heads % g->num_kv_heads != 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda plan build: %d query heads, %d kv heads (each >= 1, the kv heads "
                        "dividing the query heads)",
                        g->num_heads, g->num_kv_heads);
  if (g->granularity < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda plan build: granularity %d (>= 1)",
                        g->granularity);
  for (int32_t s = 0; s < g->count; s++) {
    const cuda_plan_seq_t *q = &g->seqs[s];
    if (q->seq_len < 1 || q->cap_verticals < 0 || q->cap_diagonals < 1)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "cuda plan build: sequence %d: seq_len %lld (>= 1), cap_verticals %d "
                          "(>= 0), cap_diagonals %d (>= 1)",
                          s, (long long)q->seq_len, q->cap_verticals, q->cap_diagonals);
    if (pointers && (!q->counts || !q->diagonals || (!q->verticals && q->cap_verticals > 0)))
      return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                          "cuda plan build: sequence %d: counts, verticals or diagonals is NULL",
                          s);
  }
  return MTRAIN_SUCCESS;
}

/* The layout of the batch into L and base (count entries each, allocated
 * here; freed by the caller, also on failure). */
static mtrain_status_t layout(const cuda_plan_geom_t *g, plan::SeqLayout **L, size_t **base,
                              size_t *bytes) {
  *L = (plan::SeqLayout *)calloc((size_t)g->count, sizeof **L);
  *base = (size_t *)calloc((size_t)g->count, sizeof **base);
  if (!*L || !*base)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda plan build: out of host memory");
  int32_t bad = 0;
  if (plan::batch_layout(g, *L, *base, bytes, &bad)) {
    const cuda_plan_seq_t *q = &g->seqs[bad];
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda plan build: sequence %d (%lld tokens, %d heads, granularity %d, "
                        "capacities %d verticals and %d diagonals) needs tables beyond the 32-bit "
                        "indices",
                        bad, (long long)q->seq_len, g->num_heads, g->granularity, q->cap_verticals,
                        q->cap_diagonals);
  }
  return MTRAIN_SUCCESS;
}

extern "C" mtrain_status_t cuda_plan_build_bytes(const cuda_plan_geom_t *g, size_t *bytes) {
  mtrain_status_t st = check_geom(g, 0);
  if (st) return st;
  if (!bytes) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "cuda plan build: bytes is NULL");
  plan::SeqLayout *L = NULL;
  size_t *base = NULL;
  st = layout(g, &L, &base, bytes);
  free(L);
  free(base);
  return st;
}

extern "C" mtrain_status_t cuda_plan_build(cuda_state_t *s, const cuda_plan_geom_t *g, void *dev,
                                           cuda_step_t *steps, int64_t **pairs_dev) {
  mtrain_status_t st = check_geom(g, 1);
  if (st) return st;
  if (!s || !dev || !steps || !pairs_dev)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                        "cuda plan build: state, dev, steps or pairs_dev is NULL");
  if ((uintptr_t)dev % 256 != 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda plan build: dev is not 256-byte aligned");
  plan::SeqLayout *L = NULL;
  size_t *base = NULL, bytes = 0;
  st = layout(g, &L, &base, &bytes);
  const plan::TableLayout T = plan::table_layout(g->count);
  char *host = NULL;
  void *table = NULL;
  int slot = -1;
  if (!st) {
    host = (char *)malloc(T.bytes);
    if (!host) st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda plan build: out of host memory");
  }
  if (!st) st = cuda_upload_reserve(s, T.bytes, &table, &slot);
  plan::Batch b;
  memset(&b, 0, sizeof b);
  if (!st) {
    plan::batch_prepare(g, L, base, (char *)dev, host, (char *)table, &b, steps, pairs_dev);
    st = cuda_upload_commit(s, slot, host, T.bytes);
  }
  free(host);
  free(L);
  free(base);
  cudaStream_t str = (cudaStream_t)s->stream;
  if (!st)
    st = plan::run_stages(
        b, [&](plan::Kernel k, const char *name, int64_t grid, size_t smem) -> mtrain_status_t {
          mtrain_status_t e =
              cuda_prepare_launch(s, (const void *)k, "plan build", name, grid, 1, smem, NULL);
          if (e) return e;
          k<<<(unsigned)grid, plan::kThreads, smem, str>>>(b);
          return cuda_check_launch(name);
        });
  const mtrain_status_t st2 = slot >= 0 ? cuda_step_release(s, slot) : MTRAIN_SUCCESS;
  return st ? st : st2;
}
