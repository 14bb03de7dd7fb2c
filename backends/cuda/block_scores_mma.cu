/* block_scores_mma.cu: the launches of the tensor-core block-score kernels
 * (block_scores_mma.cuh: precise and antidiag, bf16 and fp16, causal and
 * non-causal) and the shapes they take; cuda_block_scores.cu chooses them
 * over the fp64 kernels (MTRAIN_CUDA_BLOCK_SCORES). The antidiag kernel
 * keeps its per-(strided row, key block) sums in device scratch: launches
 * of at most kScratch bytes of it, the blocks longest row first. */
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
                    const char *who) {
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
  const size_t per_item = sizeof(double) * (size_t)(p.G / p.S) * (size_t)p.nb;
  int64_t chunk = (int64_t)(kScratch / per_item);
  if (chunk < 1) chunk = 1;
  if (chunk > items) chunk = items;
  void *work = NULL;
  mtrain_status_t st = cuda_scratch(s, per_item * (size_t)chunk, &work);
  if (st) return st;
  mp.E = (double *)work;
  return launch(
      s, nc ? bsm::antidiag_mma_kernel<D, T, true> : bsm::antidiag_mma_kernel<D, T, false>, who,
      "antidiag_mma_kernel", mp, items, chunk, bsm::antidiag_smem(p.G, D), &attr[1][0][nc]);
}

} // namespace

extern "C" int cuda_block_scores_mma_supports(const cuda_state_t *s,
                                              const mtrain_block_scores_args_t *a) {
  if (s->cc_major < 8) return 0;
  if (a->method != MTRAIN_BLOCK_PRECISE && a->method != MTRAIN_BLOCK_ANTIDIAG) return 0;
  if (a->q_dtype != a->k_dtype || (a->q_dtype != MTRAIN_BF16 && a->q_dtype != MTRAIN_F16)) return 0;
  if (a->head_dim != 64 && a->head_dim != 128) return 0;
  if ((uintptr_t)a->q % 16 || (uintptr_t)a->k % 16) return 0;
  const int G = a->granularity;
  if (a->method == MTRAIN_BLOCK_PRECISE) return G == 64 || G == 128;
  if (G % 64 || G > 256) return 0;
  const int R = G / a->stride; /* strided columns per key block */
  return R % 64 == 0 || 64 % R == 0;
}

extern "C" mtrain_status_t cuda_block_scores_mma(cuda_state_t *s,
                                                 const mtrain_block_scores_args_t *a,
                                                 const int64_t *dev_blocks, const char *who) {
  bsm::mparams mp;
  mp.p = bsk::params_of(a);
  mp.p.q_block_global = dev_blocks;
  mp.p.row_off = dev_blocks + a->num_q_blocks;
  mp.order = dev_blocks + 2 * (int64_t)a->num_q_blocks;
  mp.E = NULL;
  const bool bf16 = a->q_dtype == MTRAIN_BF16;
  if (a->head_dim == 64)
    return bf16 ? run<64, __nv_bfloat16>(s, a, mp, who) : run<64, __half>(s, a, mp, who);
  return bf16 ? run<128, __nv_bfloat16>(s, a, mp, who) : run<128, __half>(s, a, mp, who);
}
