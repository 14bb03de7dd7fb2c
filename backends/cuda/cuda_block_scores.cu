/* cuda_block_scores.cu: the block scores of SPEC.md section 9 on the GPU (the
 * block_scores slot): the argument checks and the launches of the kernels of
 * block_scores_kernels.cuh (fp64, in cpu-ref's order of additions), causal
 * or, with args.noncausal, the non-causal scores of section 9.7 (the row of
 * query block gb then holds nb entries: h * nb * nb + gb * nb without
 * scores_row). Precise and antidiag scores of bf16 or fp16 inputs go to the
 * tensor-core kernels (block_scores_mma.cu) where they take the shape;
 * MTRAIN_CUDA_BLOCK_SCORES=fp64 (read at every call) keeps them on the exact
 * fp64 kernels. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/block_scores_kernels.cuh"
#include "backends/cuda/block_scores_mma.h"
#include "mtrain/mtrain_error.h"

namespace {

using bsk::blk_params;
using bsk::kThreads;

/* Device scratch of one antidiagonal launch (strided logits of its CTAs). */
constexpr size_t kAntidiagScratch = (size_t)256 << 20;

bool storage_dtype(mtrain_dtype_t t) {
  return t == MTRAIN_F32 || t == MTRAIN_BF16 || t == MTRAIN_F16;
}

mtrain_status_t check_args(const mtrain_block_scores_args_t *a) {
  if (a->method != MTRAIN_BLOCK_PRECISE && a->method != MTRAIN_BLOCK_ANTIDIAG &&
      a->method != MTRAIN_BLOCK_MEANPOOL)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda block scores: unknown method %d",
                        (int)a->method);
  if (a->seq_len < 1 || a->granularity < 1 || a->num_heads < 1 || a->num_kv_heads < 1 ||
      a->head_dim < 1 || a->num_heads % a->num_kv_heads != 0 || a->num_q_blocks < 0 ||
      a->q_tokens < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda block scores: bad geometry (N %lld, G %d, heads %d/%d, head_dim "
                        "%d, %d query blocks, %lld query slots)",
                        (long long)a->seq_len, a->granularity, a->num_heads, a->num_kv_heads,
                        a->head_dim, a->num_q_blocks, (long long)a->q_tokens);
  if (a->method == MTRAIN_BLOCK_ANTIDIAG && (a->stride < 1 || a->granularity % a->stride != 0))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda block scores: stride %d does not divide the granularity %d",
                        a->stride, a->granularity);
  if (!storage_dtype(a->q_dtype) || !storage_dtype(a->k_dtype))
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                        "cuda block scores: q is %s and k is %s (fp32, bf16 or fp16)",
                        mtrain_dtype_name(a->q_dtype), mtrain_dtype_name(a->k_dtype));
  if (a->k_block_global)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda block scores: key chunks (k_block_global) are not supported: give "
                        "every key");
  if (!a->q || !a->k || !a->scores || (a->num_q_blocks > 0 && !a->q_block_global))
    return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                        "cuda block scores: q, k, scores and q_block_global must be set");
  if (a->method == MTRAIN_BLOCK_PRECISE) {
    if (!a->lse)
      return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                          "cuda block scores: the precise method needs lse");
    if (a->lse_dtype != MTRAIN_F32 && a->lse_dtype != MTRAIN_F64)
      return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                          "cuda block scores: lse is %s (fp32 or fp64)",
                          mtrain_dtype_name(a->lse_dtype));
  }
  return MTRAIN_SUCCESS;
}

/* MTRAIN_CUDA_BLOCK_SCORES: unset, empty or "mma" (the tensor-core kernels
 * where they take the call, the default) or "fp64" (the exact kernels). */
mtrain_status_t path_from_env(bool *fp64) {
  const char *e = getenv("MTRAIN_CUDA_BLOCK_SCORES");
  *fp64 = false;
  if (!e || !*e || strcmp(e, "mma") == 0) return MTRAIN_SUCCESS;
  if (strcmp(e, "fp64") == 0) {
    *fp64 = true;
    return MTRAIN_SUCCESS;
  }
  return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                      "backend 'cuda': environment variable MTRAIN_CUDA_BLOCK_SCORES='%s': "
                      "expected mma (the tensor-core block scores of bf16 and fp16 inputs, the "
                      "default) or fp64 (the exact fp64 kernels)",
                      e);
}

/* A local block and its global index, ordered longest row first. */
struct block_order_t {
  int64_t gb;
  int lb;
};
int longest_first(const void *x, const void *y) {
  const block_order_t *a = (const block_order_t *)x, *b = (const block_order_t *)y;
  if (a->gb != b->gb) return a->gb > b->gb ? -1 : 1;
  return a->lb < b->lb ? -1 : a->lb > b->lb;
}

/* Queues interleave_kernel into kp and points p->kp at it. */
mtrain_status_t interleave(cuda_state_t *s, blk_params *p, int P, int64_t cols, float *kp) {
  const int64_t total = (int64_t)p->Hkv * P * p->d * cols;
  int64_t grid = (total + 255) / 256;
  if (grid > 65536) grid = 65536;
  bsk::interleave_kernel<<<(unsigned)grid, 256, 0, (cudaStream_t)s->stream>>>(*p, P, cols, kp);
  p->kp = kp;
  return cuda_check_launch("interleave_kernel");
}

} // namespace

extern "C" mtrain_status_t cuda_block_scores(void *state, const mtrain_block_scores_args_t *a) {
  cuda_state_t *s = (cuda_state_t *)state;
  mtrain_status_t st = check_args(a);
  if (st) return st;
  bool fp64 = false;
  st = path_from_env(&fp64);
  if (st) return st;
  if (a->num_q_blocks == 0) return MTRAIN_SUCCESS;
  const int tc = fp64 ? 0 : cuda_block_scores_mma_supports(s, a);
  const bool mma = tc != 0, gated = tc == 2; /* gated: fp32 keys, the fp64 kernels behind */
  blk_params p = bsk::params_of(a);
  const bool nc = a->noncausal != 0;
  const int64_t items = (int64_t)p.Hq * p.num_q_blocks;
  cudaStream_t stream = (cudaStream_t)s->stream;
  void *dev = NULL;
  int slot = -1;
  /* the global blocks, the rows' offsets (the full square's or triangle's
   * without scores_row) and (tensor cores) the local blocks longest row first and
   * the gate word (0) */
  const int nq = p.num_q_blocks;
  const size_t words = (mma ? 3 : 2) * (size_t)nq + (mma ? 1 : 0);
  int64_t *blocks = (int64_t *)malloc(sizeof(int64_t) * words);
  if (!blocks) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda block scores: out of memory");
  for (int lb = 0; lb < nq; lb++) {
    blocks[lb] = a->q_block_global[lb];
    blocks[nq + lb] = bsk::row_offset(a, p.nb, lb);
  }
  if (mma) { /* by global block descending, then local block (the pairs in the third part) */
    int64_t *ord = blocks + 2 * nq;
    block_order_t *pairs = (block_order_t *)malloc(sizeof(block_order_t) * (size_t)nq);
    if (!pairs) {
      free(blocks);
      return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda block scores: out of memory");
    }
    for (int lb = 0; lb < nq; lb++) pairs[lb] = {blocks[lb], lb};
    qsort(pairs, (size_t)nq, sizeof *pairs, longest_first);
    for (int x = 0; x < nq; x++) ord[x] = pairs[x].lb;
    free(pairs);
    blocks[3 * nq] = 0;
  }
  st = cuda_upload_small(s, blocks, sizeof(int64_t) * words, &dev, &slot);
  free(blocks);
  if (st) return st;
  p.q_block_global = (const int64_t *)dev;
  p.row_off = p.q_block_global + p.num_q_blocks;
  char who[96];
  snprintf(who, sizeof who, "block scores (%s%s%s, granularity %d, head_dim %d)",
           mtrain_block_method_name(a->method), nc ? ", non-causal" : "",
           mma ? ", tensor cores" : "", p.G, p.d);
  if (mma) {
    unsigned *gate = (unsigned *)(p.q_block_global + 3 * nq);
    st = cuda_block_scores_mma(s, a, p.q_block_global, gate, who);
    p.gate = gate; /* the fp64 kernels below run where the gate is set */
  }
  if (st || (mma && !gated)) {
    /* scored (or failed) */
  } else if (a->method == MTRAIN_BLOCK_PRECISE) {
    const size_t smem = sizeof(double) * (size_t)p.d;
    void (*precise)(blk_params) = nc ? bsk::precise_kernel<true> : bsk::precise_kernel<false>;
    void *work = NULL;
    st = cuda_scratch(s, sizeof(float) * (size_t)((int64_t)p.Hkv * p.G * p.d * p.nb), &work);
    if (!st) st = interleave(s, &p, p.G, p.nb, (float *)work);
    if (!st)
      st = cuda_prepare_launch(s, (const void *)precise, who, "precise_kernel", items, 1, smem,
                               NULL);
    if (!st) {
      precise<<<(unsigned)items, kThreads, smem, stream>>>(p);
      st = cuda_check_launch("precise_kernel");
    }
  } else if (a->method == MTRAIN_BLOCK_MEANPOOL) {
    void *work = NULL;
    st = cuda_scratch(s, sizeof(double) * (size_t)(p.nb * p.Hkv * p.d), &work);
    if (!st)
      st = cuda_prepare_launch(s, (const void *)bsk::kbar_kernel, who, "kbar_kernel", p.nb * p.Hkv,
                               1, 0, NULL);
    const size_t smem = sizeof(double) * (size_t)p.d;
    void (*meanpool)(blk_params) = nc ? bsk::meanpool_kernel<true> : bsk::meanpool_kernel<false>;
    if (!st)
      st = cuda_prepare_launch(s, (const void *)meanpool, who, "meanpool_kernel", items, 1, smem,
                               NULL);
    if (!st) {
      p.work = (double *)work;
      bsk::kbar_kernel<<<(unsigned)(p.nb * p.Hkv), kThreads, 0, stream>>>(p);
      st = cuda_check_launch("kbar_kernel");
    }
    if (!st) {
      meanpool<<<(unsigned)items, kThreads, smem, stream>>>(p);
      st = cuda_check_launch("meanpool_kernel");
    }
  } else {
    /* the strided logits of each CTA live in device scratch: launches of at
     * most kAntidiagScratch bytes of it */
    const size_t per_item = sizeof(double) * (size_t)p.ncs;
    int64_t chunk = (int64_t)(kAntidiagScratch / per_item);
    if (chunk < 1) chunk = 1;
    if (chunk > items) chunk = items;
    void *work = NULL;
    const size_t smem = sizeof(double) * (size_t)p.S * (size_t)p.d;
    /* the interleaved keys, then the strided logits (256-byte aligned) */
    const size_t kp_bytes =
        (sizeof(float) * (size_t)((int64_t)p.Hkv * p.S * p.d * p.ncs) + 255) / 256 * 256;
    static cuda_smem_attr_t attr[2]; /* per kernel: causal, non-causal */
    void (*antidiag)(blk_params) = nc ? bsk::antidiag_kernel<true> : bsk::antidiag_kernel<false>;
    st = cuda_scratch(s, kp_bytes + per_item * (size_t)chunk, &work);
    if (!st) st = interleave(s, &p, p.S, p.ncs, (float *)work);
    if (!st)
      st = cuda_prepare_launch(s, (const void *)antidiag, who, "antidiag_kernel", chunk, 1, smem,
                               &attr[nc]);
    p.work = (double *)((char *)work + kp_bytes);
    for (int64_t i0 = 0; i0 < items && !st; i0 += chunk) {
      p.item0 = i0;
      const int64_t n = items - i0 < chunk ? items - i0 : chunk;
      antidiag<<<(unsigned)n, kThreads, smem, stream>>>(p);
      st = cuda_check_launch("antidiag_kernel");
    }
  }
  mtrain_status_t st2 = cuda_step_release(s, slot);
  return st ? st : st2;
}
