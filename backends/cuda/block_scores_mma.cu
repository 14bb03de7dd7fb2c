/* block_scores_mma.cu: the launches of the tensor-core block-score kernels
 * (block_scores_mma.cuh: precise and antidiag, bf16 and fp16, causal and
 * non-causal) and the shapes they take; cuda_block_scores.cu chooses them
 * over the fp64 kernels (MTRAIN_CUDA_BLOCK_SCORES). The antidiag kernel
 * keeps its per-(strided row, key block) sums in device scratch: launches
 * of at most kScratch bytes of it, the blocks longest row first. fp32 keys
 * with bf16 or fp16 queries (the keys that the backend's distributed
 * selection gathers from every rank, fp32 copies of the ranks' keys) are
 * narrowed to the query dtype first; where one is not held exactly the gate
 * word turns the tensor-core kernels off and the fp64 kernels on (launched
 * after them by cuda_block_scores), so the scores of one call never mix the
 * two, and a selection is the same bits at every world size. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "backends/cuda/block_scores_mma.cuh"
#include "backends/cuda/block_scores_mma.h"
#include "mtrain/mtrain_error.h"

namespace {

constexpr size_t kScratch = (size_t)256 << 20;

template <typename K>
mtrain_status_t launch(cuda_state_t *s, K kernel, const char *who, const char *name,
                       bsm::mparams mp, int64_t items, int64_t chunk, size_t smem,
                       cuda_smem_attr_t *attr) {
  mtrain_status_t st = cuda_prepare_launch(s, (const void *)kernel, who, name,
                                           chunk < items ? chunk : items, 1, smem, attr);
  for (int64_t i0 = 0; i0 < items && !st; i0 += chunk) {
    mp.p.item0 = i0;
    const int64_t n = items - i0 < chunk ? items - i0 : chunk;
    kernel<<<(unsigned)n, bsm::kNT, smem, (cudaStream_t)s->stream>>>(mp);
    st = cuda_check_launch(name);
  }
  return st;
}

template <int D, typename T>
mtrain_status_t run(cuda_state_t *s, const mtrain_block_scores_args_t *a, bsm::mparams mp,
                    int64_t chunk, const char *who) {
  const bsk::blk_params &p = mp.p;
  const bool nc = a->noncausal != 0;
  const int64_t items = (int64_t)p.Hq * p.num_q_blocks;
  static cuda_smem_attr_t attr[2][2][2]; /* [method][MT - 1 or 0][non-causal] */
  if (a->method == MTRAIN_BLOCK_PRECISE) {
    const size_t smem = bsm::precise_smem(p.G, D);
    if (p.G == 64)
      return launch(
          s, nc ? bsm::precise_mma_kernel<D, T, 1, true> : bsm::precise_mma_kernel<D, T, 1, false>,
          who, "precise_mma_kernel", mp, items, items, smem, &attr[0][0][nc]);
    return launch(
        s, nc ? bsm::precise_mma_kernel<D, T, 2, true> : bsm::precise_mma_kernel<D, T, 2, false>,
        who, "precise_mma_kernel", mp, items, items, smem, &attr[0][1][nc]);
  }
  return launch(
      s, nc ? bsm::antidiag_mma_kernel<D, T, true> : bsm::antidiag_mma_kernel<D, T, false>, who,
      "antidiag_mma_kernel", mp, items, chunk, bsm::antidiag_smem(p.G, D), &attr[1][0][nc]);
}

/* Queues narrow_keys_kernel: k32 into k as T, *flag set when inexact. */
template <typename T>
mtrain_status_t narrow(cuda_state_t *s, const float *k32, void *k, int64_t n, unsigned *flag) {
  int64_t grid = (n + 255) / 256;
  if (grid > 65536) grid = 65536;
  bsm::narrow_keys_kernel<T>
      <<<(unsigned)grid, 256, 0, (cudaStream_t)s->stream>>>(k32, (T *)k, n, flag);
  return cuda_check_launch("narrow_keys_kernel");
}

} // namespace

extern "C" int cuda_block_scores_mma_supports(const cuda_state_t *s,
                                              const mtrain_block_scores_args_t *a) {
  if (s->cc_major < 8) return 0;
  if (a->method != MTRAIN_BLOCK_PRECISE && a->method != MTRAIN_BLOCK_ANTIDIAG) return 0;
  if (a->q_dtype != MTRAIN_BF16 && a->q_dtype != MTRAIN_F16) return 0;
  if (a->k_dtype != a->q_dtype && a->k_dtype != MTRAIN_F32) return 0;
  if (a->head_dim != 64 && a->head_dim != 128) return 0;
  if ((uintptr_t)a->q % 16 || (uintptr_t)a->k % 16) return 0;
  /* G 64 or 128 (the emulator test's shapes): S divides G, so G/S, the
   * strided columns of a key block, divides 64 or is 128 */
  const int ok = a->granularity == 64 || a->granularity == 128;
  return ok ? (a->k_dtype == MTRAIN_F32 ? 2 : 1) : 0;
}

extern "C" mtrain_status_t cuda_block_scores_mma(cuda_state_t *s,
                                                 const mtrain_block_scores_args_t *a,
                                                 const int64_t *dev_blocks, unsigned *gate,
                                                 const char *who) {
  bsm::mparams mp;
  mp.p = bsk::params_of(a);
  mp.p.q_block_global = dev_blocks;
  mp.p.row_off = dev_blocks + a->num_q_blocks;
  mp.order = dev_blocks + 2 * (int64_t)a->num_q_blocks;
  mp.E = NULL;
  mp.gate = NULL;
  const bool bf16 = a->q_dtype == MTRAIN_BF16, narrowed = a->k_dtype == MTRAIN_F32;
  const bsk::blk_params &p = mp.p;
  /* scratch: the narrowed keys (fp32 keys), then the antidiag sums of each CTA */
  const int64_t items = (int64_t)p.Hq * p.num_q_blocks, nk = p.N * p.Hkv * p.d;
  const size_t pre = narrowed ? ((size_t)nk * 2 + 255) / 256 * 256 : 0;
  const size_t per_item =
      a->method == MTRAIN_BLOCK_ANTIDIAG ? sizeof(double) * (size_t)(p.G / p.S) * (size_t)p.nb : 0;
  int64_t chunk = per_item ? (int64_t)(kScratch / per_item) : items;
  if (chunk < 1) chunk = 1;
  if (chunk > items) chunk = items;
  if (pre + per_item * (size_t)chunk > 0) {
    void *work = NULL;
    mtrain_status_t st = cuda_scratch(s, pre + per_item * (size_t)chunk, &work);
    if (st) return st;
    if (narrowed) {
      st = bf16 ? narrow<__nv_bfloat16>(s, (const float *)a->k, work, nk, gate)
                : narrow<__half>(s, (const float *)a->k, work, nk, gate);
      if (st) return st;
      mp.p.k = work;
      mp.p.k_dtype = a->q_dtype;
      mp.gate = gate;
    }
    mp.E = (double *)((char *)work + pre);
  }
  if (a->head_dim == 64)
    return bf16 ? run<64, __nv_bfloat16>(s, a, mp, chunk, who)
                : run<64, __half>(s, a, mp, chunk, who);
  return bf16 ? run<128, __nv_bfloat16>(s, a, mp, chunk, who)
              : run<128, __half>(s, a, mp, chunk, who);
}
