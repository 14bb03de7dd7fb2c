/* attn_wgmma_fwd.cu: the forward step of variant 3 (Hopper tensor cores,
 * sm_90a): cuda_wgmma_supports and cuda_wgmma_fwd. Variant 2's forward
 * (attn_mma2_fwd.cu) with the matrix products on warpgroup MMA
 * (wgmma.mma_async, attn_wgmma_ptx.cuh) and warp-specialised loads:
 *  - one work item per (query head, query tile of BM = 64 * NWG rows): NWG
 *    consumer warpgroups of 4 warps, each owning 64 query rows (NWG = 2
 *    when G is a multiple of 128, else 1), and one producer warpgroup;
 *  - the producer walks the item's key tiles (runs, then bars 64 at a
 *    time) and copies each stage's K and V rows (one walk tile at d 128,
 *    two at d 64: 128 keys) with cp.async into one of four stages, in
 *    the 128-byte-swizzle panel layout that wgmma reads through
 *    descriptors; mbarriers hand stages over (full: copies landed and the
 *    tile's descriptor published; empty: every consumer done), so the two
 *    warpgroups run at their own pace, without CTA barriers;
 *  - Q stays in registers as A fragments (loaded once per item with
 *    ldmatrix); per stage S = Q K^T is 8 wgmma m64n64k16 (d 128) or 4
 *    m64n128k16 (d 64) reading K K-major, O += P V is 4 wgmma m64n{d}k16
 *    per 64 keys with P from registers and V read N-major; the consumer
 *    loop is software-pipelined, and at d 128 the two consumer warpgroups
 *    issue their products in turns (attn_wgmma_fwd_common.cuh, shared by
 *    the two kernels below);
 *  - the masks, the online softmax in the log2 domain, the skipped O
 *    rescale and the epilogue's merge into o_acc / lse_acc are variant 2's.
 * Two kernels, chosen per context (MTRAIN_CUDA_WGMMA_FWD_PERSISTENT):
 *  - wgmma_fwd_kernel: one CTA per item, heaviest items first;
 *  - wgmma_fwd_persistent_kernel: min(items, SMs x CTAs per SM) CTAs, CTA
 *    b takes items b, b + grid, b + 2 grid, ... (the same order); its
 *    producer runs ahead across items: it loads the next item's Q into the
 *    second of two query buffers and its first key tiles into the stage
 *    ring while the consumers finish the current item (CUDA_KERNELS.md,
 *    "The persistent forward").
 * The backward of variant 3 is attn_wgmma_bwd.cu. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "backends/cuda/attn_mma2.h"
#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/attn_wgmma.h"
#include "backends/cuda/attn_wgmma_fwd_common.cuh"
#include "backends/cuda/attn_wgmma_ptx.cuh"
#include "backends/cuda/cuda_internal.h"
#include "mtrain/mtrain_error.h"

namespace wg {

using mma::cp_async_commit;
using mma::cp_async_wait;
using mma2::contiguous_rows_n;
using mma2::load_rows_n;

/* One CTA per query item (the cuda_q_items grid). */
template <int D, typename T, int NWG>
__global__ void __launch_bounds__(128 * NWG + kProducers, 1)
    wgmma_fwd_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                     const T *__restrict__ v, float *__restrict__ o_acc,
                     float *__restrict__ lse_acc) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap(); /* wgmma exists on sm_90a only; the host side refuses other devices */
#else
  extern __shared__ __align__(1024) unsigned char smem[];
  using S = FwdShape<D, NWG>;
  constexpr int NC = S::NC, BM = S::BM, TBK = S::TBK, NST = S::kStages;
  constexpr int NKS = D / 16; /* k-slices of Q K^T */
  const int tid = threadIdx.x;

  mma2::QItem item; /* heaviest (last) query tiles first, the heads of one tile together */
  if (!mma2::q_item_begin<BM>(st, item)) return;
  const int h = item.h, qb = item.qb, qt = item.qt, rows_here = item.rows;
  const int64_t gq = item.gq;
  const uint32_t sraw = smem_u32(smem);
  const uint32_t s0 = (sraw + 1023u) & ~1023u;
  FwdCtl &ctl = *reinterpret_cast<FwdCtl *>(smem + (s0 - sraw) + S::kCtlOff);
  const uint32_t sKV = s0, sQ = s0 + S::kQOff;
  const uint32_t full0 = smem_u32(&ctl.full[0]), empty0 = smem_u32(&ctl.empty[0]);
  if (tid == 0) {
    for (int x = 0; x < NST; ++x) {
      mbar_init(full0 + 8 * x, S::NP);
      mbar_init(empty0 + 8 * x, NC);
    }
  }
  __syncthreads();

  const int hk = h / st.group;
  const int64_t kv_stride = (int64_t)st.Hkv * D;
  const T *kbase = k + (int64_t)hk * D, *vbase = v + (int64_t)hk * D;

  using R = FwdRegs<D, NWG, 1>;
  if (tid >= NC) {
    if constexpr (R::kMoveRegs) setmaxnreg_dec<R::kProducerRegs>();
    const int p = tid - NC; /* producer thread */
    /* ---- producer warpgroup: walks the key tiles (every thread alike), loads
     * tile n into stage n % NST once the consumers released it, publishes
     * tile n - 2 once its copies have landed (three tiles in flight) ---- */
    KeyWalk2 w;
    w.init(st, h, qb, gq, qt * BM, rows_here);
    /* tile x's descriptor into the control block, then this thread's
     * arrival on full (release: its copies, and thread 0's descriptor) */
    auto publish = [&](int x, const StageTiles &d) {
      if (p == 0) ctl.tile[x % NST] = d;
      mbar_arrive(full0 + 8 * (x % NST));
    };
    StageTiles prev2, prev1; /* stages n - 2 and n - 1, loaded, not yet published */
    prev2.h[0].kind = prev1.h[0].kind = 0;
    for (int n = 0;; ++n) {
      /* tile n - 2 first, before the wait for a free stage: it is published
       * as soon as it has landed, so the consumers, which look one tile ahead,
       * do not wait on the producer's wait for the stage of tile n */
      if (n >= 2) {
        cp_async_wait<1>();  /* tile n - 2 has landed (this thread's copies) */
        fence_proxy_async(); /* ... visible to wgmma's reads */
        publish(n - 2, prev2);
      }
      StageTiles t;
      const bool have = next_stage<D>(st, w, t);
      const int sn = n % NST;
      if (n >= NST)
        while (!mbar_try_wait(empty0 + 8 * sn, (uint32_t)((n / NST - 1) & 1))) {
        }
      if (have)
        producer_load_stage<D, T>(st, t, w, p, sKV + (uint32_t)(sn * 2 * TBK), kbase, vbase,
                                  kv_stride);
      cp_async_commit();
      if (!have) {
        cp_async_wait<0>();  /* every tile has landed (this thread's copies) */
        fence_proxy_async(); /* ... visible to wgmma's reads */
        if (n >= 1) publish(n - 1, prev1);
        StageTiles end;
        end.h[0].kind = end.h[1].kind = 0;
        publish(n, end);
        break;
      }
      prev2 = prev1;
      prev1 = t;
    }
    cp_async_wait<0>();
    return;
  }

  /* ---- consumer warpgroups: Q's A fragments (the consumers load the tile),
   * then the item's key tiles and epilogue ---- */
  if constexpr (R::kMoveRegs) setmaxnreg_inc<R::kConsumerRegs>();
  {
    const int64_t qrow0 = (int64_t)qb * st.G + (int64_t)qt * BM;
    int64_t rows[LoadShape<NC, BM>::kRows];
    contiguous_rows_n<NC, BM>(rows, qrow0, rows_here, tid);
    load_rows_n<D, NC, BM>(sQ, q + (int64_t)h * D, (int64_t)st.Hq * D, rows, tid);
    cp_async_commit();
  }
  cp_async_wait<0>();
  named_barrier(1, NC);
  uint32_t qf[NKS][4];
  load_q_fragments<D>(qf, sQ);
  if constexpr (R::kPingPong) fwd_pingpong_start();
  fwd_consume_item<D, T, NWG, false, R::kPipelined, R::kPingPong>(st, item, qf, ctl, sKV, full0,
                                                                  empty0, 0, o_acc, lse_acc);
  if constexpr (R::kPingPong) fwd_pingpong_end();
#endif
}

/* The persistent kernel's registers: compiled for one CTA per SM (two Q
 * buffers and four 32 KB stages leave no room for a second). */
template <int D, int NWG> using PersistRegs = FwdRegs<D, NWG, 1>;

/* CTAs that loop over the query items: CTA b takes one item of each wave of
 * gridDim.x consecutive items of the cuda_q_items order (heaviest first;
 * persistent_item), skipping padding-only tiles, and computes each as
 * wgmma_fwd_kernel does
 * (fwd_consume_item). The stage ring's slots run on across items: slot n of
 * the CTA's life sits in stage n % NST; an item takes one slot per key tile,
 * then one for its marker (kind 0: no copies, published at once; the
 * consumers release it like a tile). The producer walks the items: item j
 * (j: the CTA's item count) gets query buffer j % 2 once the consumers have
 * arrived on qempty[j % 2] for item j - 2; the producer writes the item's
 * index to qitem[j % 2], loads its Q with the copies of the item's first
 * tile and arrives on qfull[j % 2] when it publishes that tile (an item
 * without tiles: at once, no copies: its Q is never used). The consumers
 * wait on qfull[j % 2], read the index (-1: no more items, the producer's
 * last signal) and Q's fragments, arrive on qempty[j % 2], and compute the
 * item. Phases: full/empty by slot (n / NST), qfull/qempty by item (j / 2). */
template <int D, typename T, int NWG>
__global__ void __launch_bounds__(128 * NWG + kProducers, (PersistRegs<D, NWG>::kMinBlocks))
    wgmma_fwd_persistent_kernel(const cuda_step_t st, const T *__restrict__ q,
                                const T *__restrict__ k, const T *__restrict__ v,
                                float *__restrict__ o_acc, float *__restrict__ lse_acc) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap(); /* wgmma exists on sm_90a only; the host side refuses other devices */
#else
  extern __shared__ __align__(1024) unsigned char smem[];
  using S = FwdShape<D, NWG, 2>;
  constexpr int NC = S::NC, NP = S::NP, BM = S::BM, TBK = S::TBK, TBQ = S::TBQ;
  constexpr int NST = S::kStages;
  constexpr int NKS = D / 16; /* k-slices of Q K^T */
  const int tid = threadIdx.x;
  const unsigned items = (unsigned)st.num_q_blocks * (unsigned)(st.G / BM) * (unsigned)st.Hq;

  const uint32_t sraw = smem_u32(smem);
  const uint32_t s0 = (sraw + 1023u) & ~1023u;
  FwdCtl &ctl = *reinterpret_cast<FwdCtl *>(smem + (s0 - sraw) + S::kCtlOff);
  const uint32_t sKV = s0, sQ0 = s0 + S::kQOff;
  const uint32_t full0 = smem_u32(&ctl.full[0]), empty0 = smem_u32(&ctl.empty[0]);
  const uint32_t qfull0 = smem_u32(&ctl.qfull[0]), qempty0 = smem_u32(&ctl.qempty[0]);
  if (tid == 0) {
    for (int x = 0; x < NST; ++x) {
      mbar_init(full0 + 8 * x, NP);
      mbar_init(empty0 + 8 * x, NC);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(qfull0 + 8 * b, NP);
      mbar_init(qempty0 + 8 * b, NC);
    }
  }
  __syncthreads();

  if (tid >= NC) {
    if constexpr (PersistRegs<D, NWG>::kMoveRegs)
      setmaxnreg_dec<PersistRegs<D, NWG>::kProducerRegs>();
    const int p = tid - NC; /* producer thread */
    const int64_t kv_stride = (int64_t)st.Hkv * D;
    /* slot x's descriptor into the control block, then this thread's
     * arrival on full (release: its copies, and thread 0's descriptor) */
    auto publish = [&](int x, const StageTiles &d) {
      if (p == 0) ctl.tile[x % NST] = d;
      mbar_arrive(full0 + 8 * (x % NST));
    };
    /* slots n - 2 and n - 1: the tile loaded there, not yet published (kind
     * 0: nothing left to publish, a marker is published at once), and the
     * query buffer whose copies are in the slot's cp.async group (-1: none) */
    StageTiles prev2, prev1;
    prev2.h[0].kind = prev1.h[0].kind = 0;
    int qbuf2 = -1, qbuf1 = -1;
    /* slot x (its copies landed): the tile's descriptor, and Q's readiness */
    auto publish_landed = [&](int x, const StageTiles &d, int qbuf) {
      if (d.h[0].kind != 0) publish(x, d);
      if (qbuf >= 0) mbar_arrive(qfull0 + 8 * qbuf);
    };
    /* query buffer j % 2, once the consumers have read item j - 2's Q */
    auto claim_qbuf = [&](int j) {
      const int qbuf = j & 1;
      if (j >= 2)
        while (!mbar_try_wait(qempty0 + 8 * qbuf, (uint32_t)(((j >> 1) - 1) & 1))) {
        }
      return qbuf;
    };
    int n = 0; /* the next slot */
    int j = 0; /* the CTA's items so far */
    for (unsigned wave = 0; wave * gridDim.x < items; ++wave) {
      const unsigned it = persistent_item(wave, blockIdx.x, gridDim.x);
      mma2::QItem item;
      if (it >= items || !mma2::q_item_at<BM>(st, it, item)) continue;
      const int hk = item.h / st.group;
      const T *kbase = k + (int64_t)hk * D, *vbase = v + (int64_t)hk * D;
      KeyWalk2 w;
      w.init(st, item.h, item.qb, item.gq, item.qt * BM, item.rows);
      StageTiles t;
      bool have = next_stage<D>(st, w, t);
      const int qbuf = claim_qbuf(j);
      if (p == 0) ctl.qitem[qbuf] = (int)it;
      int qsig = -1; /* the buffer signalled with the item's first tile */
      if (have) {
        /* Q's copies: committed with the first tile's, below */
        const int64_t qrow0 = (int64_t)item.qb * st.G + (int64_t)item.qt * BM;
        int64_t rows[LoadShape<NP, BM>::kRows];
        contiguous_rows_n<NP, BM>(rows, qrow0, item.rows, p);
        load_rows_n<D, NP, BM>(sQ0 + (uint32_t)(qbuf * TBQ), q + (int64_t)item.h * D,
                               (int64_t)st.Hq * D, rows, p);
        qsig = qbuf;
      } else {
        mbar_arrive(qfull0 + 8 * qbuf); /* no tile reads this item's Q */
      }
      for (bool first = true;; first = false) {
        /* slot n - 2 first, before the wait for a free stage: it is published
         * as soon as it has landed, so the consumers, which look one tile
         * ahead, do not wait on the producer's wait for the stage of slot n */
        if (n >= 2) {
          cp_async_wait<1>();  /* slot n - 2 has landed (this thread's copies) */
          fence_proxy_async(); /* ... visible to wgmma's reads */
          publish_landed(n - 2, prev2, qbuf2);
        }
        if (!first) have = next_stage<D>(st, w, t);
        const int sn = n % NST;
        if (n >= NST)
          while (!mbar_try_wait(empty0 + 8 * sn, (uint32_t)((n / NST - 1) & 1))) {
          }
        if (have)
          producer_load_stage<D, T>(st, t, w, p, sKV + (uint32_t)(sn * 2 * TBK), kbase, vbase,
                                    kv_stride);
        cp_async_commit(); /* one group per slot (a marker's is empty) */
        prev2 = prev1;
        qbuf2 = qbuf1;
        if (have) {
          prev1 = t;
          qbuf1 = first ? qsig : -1;
        } else {
          StageTiles end;
          end.h[0].kind = end.h[1].kind = 0;
          publish(n, end); /* the item's marker: nothing to land */
          prev1 = end;
          qbuf1 = -1;
        }
        ++n;
        if (!have) break;
      }
      ++j;
    }
    cp_async_wait<0>();  /* every slot has landed (this thread's copies) */
    fence_proxy_async(); /* ... visible to wgmma's reads */
    publish_landed(n - 2, prev2, qbuf2);
    publish_landed(n - 1, prev1, qbuf1);
    /* the end of the CTA's items: item index -1 */
    const int qbuf = claim_qbuf(j);
    if (p == 0) ctl.qitem[qbuf] = -1;
    mbar_arrive(qfull0 + 8 * qbuf);
    return;
  }

  /* ---- consumer warpgroups: per item, Q's A fragments from its buffer, then
   * the item's key tiles and epilogue ---- */
  if constexpr (PersistRegs<D, NWG>::kMoveRegs)
    setmaxnreg_inc<PersistRegs<D, NWG>::kConsumerRegs>();
  if constexpr (PersistRegs<D, NWG>::kPingPong) fwd_pingpong_start();
  uint32_t qf[NKS][4];
  int n = 0; /* the item's first slot */
  int j = 0; /* the CTA's items so far */
  for (;; ++j) {
    const int qbuf = j & 1;
    while (!mbar_try_wait(qfull0 + 8 * qbuf, (uint32_t)((j >> 1) & 1))) {
    }
    const int it = ctl.qitem[qbuf]; /* the producer's item j, -1 past the last */
    if (it < 0) break;
    mma2::QItem item;
    mma2::q_item_at<BM>(st, (unsigned)it, item);
    load_q_fragments<D>(qf, sQ0 + (uint32_t)(qbuf * TBQ));
    mbar_arrive(qempty0 + 8 * qbuf); /* this thread's reads of the buffer are done */
    n = fwd_consume_item<D, T, NWG, true, PersistRegs<D, NWG>::kPipelined,
                         PersistRegs<D, NWG>::kPingPong>(st, item, qf, ctl, sKV, full0, empty0, n,
                                                         o_acc, lse_acc);
  }
  if constexpr (PersistRegs<D, NWG>::kPingPong) fwd_pingpong_end();
#endif
}

/* ---- host side ---- */

/* The forward kernel that a context runs when MTRAIN_CUDA_WGMMA_FWD_PERSISTENT
 * is unset or empty: 1 the persistent kernel (wgmma_fwd_persistent_kernel),
 * 0 one CTA per item (wgmma_fwd_kernel). */
constexpr int kFwdPersistentDefault = 1;

template <int D, typename T, int NWG>
static mtrain_status_t launch_fwd(cuda_state_t *s, const cuda_step_t *st,
                                  const mtrain_fwd_step_args_t *a) {
  using S = FwdShape<D, NWG>;
  static cuda_smem_attr_t attr;
  return mma2::launch_fwd_kernel(s, wgmma_fwd_kernel<D, T, NWG>, "variant 3", "wgmma_fwd_kernel",
                                 cuda_q_items(st, S::BM), S::NT, S::kSmem, &attr, st, a);
}

/* CTAs of `threads` threads and `smem` bytes of dynamic shared memory that
 * one SM of s->device holds together (cudaOccupancyMaxActiveBlocksPerMultiprocessor),
 * queried once per (kernel, device): cache[device], 0 until then. */
static mtrain_status_t ctas_per_sm(const cuda_state_t *s, const void *kernel, const char *name,
                                   int threads, int smem, int *cache, int *out) {
  int *c = s->device >= 0 && s->device < CUDA_MAX_DEVICES ? &cache[s->device] : NULL;
  int n = c ? __atomic_load_n(c, __ATOMIC_ACQUIRE) : 0;
  if (n <= 0) {
    mtrain_status_t rc = cuda_check(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, (size_t)smem), name);
    if (rc != MTRAIN_SUCCESS) return rc;
    if (n <= 0)
      return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                          "cuda variant 3 %s: no CTA of %d threads with %d bytes of shared "
                          "memory fits an SM of this device",
                          name, threads, smem);
    if (c) __atomic_store_n(c, n, __ATOMIC_RELEASE);
  }
  *out = n;
  return MTRAIN_SUCCESS;
}

/* The persistent kernel on min(items, SMs x CTAs per SM) CTAs (the SM count
 * read once when the context was created, cuda_state_t::num_sms). */
template <int D, typename T, int NWG>
static mtrain_status_t launch_fwd_persistent(cuda_state_t *s, const cuda_step_t *st,
                                             const mtrain_fwd_step_args_t *a) {
  using S = FwdShape<D, NWG, 2>;
  static cuda_smem_attr_t attr;
  static int per_sm[CUDA_MAX_DEVICES];
  const char *name = "wgmma_fwd_persistent_kernel";
  const auto kernel = wgmma_fwd_persistent_kernel<D, T, NWG>;
  const int64_t items = cuda_q_items(st, S::BM);
  if (items <= 0) return MTRAIN_SUCCESS;
  /* the checks of a grid of one CTA per item (the kernel's item indices are
   * 32-bit) and the kernel's shared-memory limit, before the occupancy query */
  mtrain_status_t rc = cuda_prepare_launch(s, (const void *)kernel, "variant 3", name, items, 1,
                                           (size_t)S::kSmem, &attr);
  if (rc != MTRAIN_SUCCESS) return rc;
  int ctas = 0;
  rc = ctas_per_sm(s, (const void *)kernel, name, S::NT, S::kSmem, per_sm, &ctas);
  if (rc != MTRAIN_SUCCESS) return rc;
  const int64_t slots = (int64_t)(s->num_sms > 0 ? s->num_sms : 1) * ctas;
  return mma2::launch_fwd_kernel(s, kernel, "variant 3", name, items < slots ? items : slots, S::NT,
                                 S::kSmem, &attr, st, a);
}

template <int D, typename T>
static mtrain_status_t fwd_g(cuda_state_t *s, const cuda_step_t *st,
                             const mtrain_fwd_step_args_t *a) {
  /* 128-row tiles need G % 128 == 0: a tile never spans two blocks */
  const bool wide = st->G % 128 == 0;
  if (s->wgmma_fwd_persistent)
    return wide ? launch_fwd_persistent<D, T, 2>(s, st, a)
                : launch_fwd_persistent<D, T, 1>(s, st, a);
  return wide ? launch_fwd<D, T, 2>(s, st, a) : launch_fwd<D, T, 1>(s, st, a);
}

} /* namespace wg */

extern "C" int cuda_wgmma_supports(const cuda_state_t *s, mtrain_dtype_t dtype, int32_t d,
                                   int32_t G, const char **why) {
  if (s->cc_major != 9 || s->cc_minor != 0) {
    if (why)
      *why = "variant 3 uses Hopper instructions (wgmma): it needs a compute capability 9.0 GPU";
    return 0;
  }
  /* the shapes of variant 2, whose dQ kernel the deterministic backward runs */
  return cuda_mma2_supports(dtype, d, G, why);
}

extern "C" mtrain_status_t cuda_wgmma_fwd(cuda_state_t *s, const cuda_step_t *st,
                                          const mtrain_fwd_step_args_t *a) {
  const bool bf16 = a->dtype == MTRAIN_BF16;
  if (st->d == 64)
    return bf16 ? wg::fwd_g<64, __nv_bfloat16>(s, st, a) : wg::fwd_g<64, __half>(s, st, a);
  return bf16 ? wg::fwd_g<128, __nv_bfloat16>(s, st, a) : wg::fwd_g<128, __half>(s, st, a);
}

extern "C" mtrain_status_t cuda_wgmma_fwd_persistent_from_env(int *on) {
  const char *e = getenv("MTRAIN_CUDA_WGMMA_FWD_PERSISTENT");
  *on = wg::kFwdPersistentDefault;
  if (!e || !*e) return MTRAIN_SUCCESS;
  if ((e[0] == '0' || e[0] == '1') && e[1] == '\0') {
    *on = e[0] - '0';
    return MTRAIN_SUCCESS;
  }
  return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                      "backend 'cuda': environment variable MTRAIN_CUDA_WGMMA_FWD_PERSISTENT='%s': "
                      "expected 1 (variant 3's persistent forward kernel, CTAs that loop over the "
                      "query items%s) or 0 (one CTA per query item%s)",
                      e, wg::kFwdPersistentDefault ? ", the default" : "",
                      wg::kFwdPersistentDefault ? "" : ", the default");
}
