/* attn_wgmma_bwd.cu: the backward step of variant 3 (Hopper tensor cores,
 * sm_90a): cuda_wgmma_bwd. Variant 2's key-major dK/dV kernel
 * (attn_mma2_bwd.cu: the same items, query walk, masks and outputs) with
 * every matrix product on warpgroup MMA (wgmma.mma_async):
 *  - one CTA per key item of BN = 64 NWG keys (NWG = 2 consumer warpgroups
 *    when G is a multiple of 128, else 1), warpgroup w owning keys 64 w ..
 *    64 w + 63; K and V of the item stay in shared memory (panel layout of
 *    attn_wgmma_ptx.cuh), dK and dV in registers (wgmma accumulators);
 *  - 64-row (Q, dO, LSE, delta) query tiles stream through cp.async
 *    stages;
 *  - per query tile and warpgroup, transposed so that the keys are the M
 *    dimension: S^T = K Q^T and dP^T = V dO^T (A and B from shared memory),
 *    P^T = exp(scale S^T - LSE) and dS^T = P^T (dP^T - delta) in registers,
 *    dV += P^T dO and dK += dS^T Q (A from registers, dO and Q read
 *    N-major);
 *  - fused (non-deterministic contexts): dS^T is stored to shared memory
 *    (stmatrix) and dQ = dS K is one more wgmma (dS read M-major, K read
 *    N-major), added into dq_acc with red.global.add.v2.f32; at d = 128
 *    with two warpgroups each takes 64 of dQ's columns over all 128 keys,
 *    at d = 64 each computes its own keys' part of all columns, and the
 *    two parts are summed through shared memory before the atomics
 *    (dq_pair_exchange);
 *  - deterministic contexts run variant 2's query-major dQ kernel
 *    (cuda_mma2_bwd_dq) and this kernel without its dQ product.
 * Two kernels compute this, chosen per context (MTRAIN_CUDA_WGMMA_BWD,
 * cuda_wgmma_bwd_kernel_from_env): wgmma_bwd_kernel (1: consumer
 * warpgroups only, every thread loading the next query tile, a CTA barrier
 * per tile) and wgmma_bwd_ws_kernel (2, the default: a producer warpgroup
 * walks and loads the query tiles into mbarrier-guarded stages, setmaxnreg
 * moves its registers to the consumers, which never meet at a CTA barrier;
 * at d 64 the consumer loop is software-pipelined).
 * Per (query i, key j): p = exp(scale q_i.k_j - lse_i), dp = dout_i.v_j,
 * ds = p (dp - delta_i); dq_i += scale ds k_j, dk_j += scale ds q_i,
 * dv_j += p dout_i. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "backends/cuda/attn_mma2.h"
#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/attn_wgmma.h"
#include "backends/cuda/attn_wgmma_ptx.cuh"
#include "backends/cuda/cuda_internal.h"
#include "mtrain/mtrain_error.h"

namespace wg {

using mma::cp_async16;
using mma::cp_async_commit;
using mma::cp_async_wait;
using mma::fast_exp2;
using mma::kLog2e;
using mma::pack2;
using mma::smem_u32;
using mma2::contiguous_rows_n;
using mma2::kKT;
using mma2::kRingBytesQ;
using mma2::kv_item_begin;
using mma2::kv_item_rows;
using mma2::kv_out_rows;
using mma2::load_ld;
using mma2::load_rows_panel;
using mma2::LoadShape;
using mma2::QRing;
using mma2::QTile2;
using mma2::QWalk2;
using mma2::red_add_v2;
using mma2::store_pair;
using mma2::stsm_x4;

/* Shared memory of the backward CTA: K and V of the item (BN-row panel
 * tiles), two stages of (Q, dO) 64-row panel tiles, the dS^T tile [key]
 * [query] (one panel of BN rows), two (LSE[64], delta[64]) buffers, the
 * query walk; 1024 bytes of slack align the base to the swizzle period. */
template <int D, int NWG> struct BwdShape {
  static constexpr int NC = 128 * NWG; /* threads */
  static constexpr int BN = 64 * NWG;  /* keys of an item */
  static constexpr int TBK = BN * D * 2;
  static constexpr int TBQ = kKT * D * 2;
  static constexpr int SB = 2 * TBQ;
  static constexpr int TBS = BN * kKT * 2;
  static constexpr int kStageOff = 2 * TBK;
  static constexpr int kDsOff = kStageOff + 2 * SB;
  static constexpr int kLdOff = kDsOff + TBS;
  static constexpr int kRingOff = kLdOff + 2 * 2 * kKT * 4;
  /* dQ columns of a warpgroup; at d = 64 with two warpgroups each takes
   * all 64 columns over its own 64 keys (a 32-column N-major operand would
   * start inside a swizzle row) */
  static constexpr int DQN = D / NWG >= 64 ? D / NWG : D;
  static constexpr bool kDqOwnKeys = NWG > 1 && DQN == D;
  /* kDqOwnKeys: the two warpgroups' parts of one dQ tile meet here before
   * the atomics (per warpgroup, warp and k-slice, one float4 per lane) */
  static constexpr int kXOff = kRingOff + kRingBytesQ;
  static constexpr int kXBytes = kDqOwnKeys ? NWG * 4 * 4 * 32 * 16 : 0;
  static constexpr int kSmem = kXOff + kXBytes + 1024;
  static_assert(TBK % 1024 == 0 && TBQ % 1024 == 0 && TBS % 1024 == 0, "1024-byte alignment");
  static_assert(mma2::fits_sm90(kSmem, 1), "shared memory per SM");
};

/* Issues the loads of query tile t: Q and dO into the stage at ss, LSE and
 * delta into the buffer at sl. */
template <int D, int NT, typename T>
__device__ __forceinline__ void load_q_stage(uint32_t ss, uint32_t sl, const cuda_step_t &st,
                                             const T *q, const T *dout, const float *lse_acc,
                                             const float *delta_acc, const QTile2 &t, int tid) {
  constexpr int TBQ = kKT * D * 2;
  const int64_t stride = (int64_t)st.Hq * D;
  int64_t rows[LoadShape<NT, kKT>::kRows];
  contiguous_rows_n<NT, kKT>(rows, t.row0, t.nvalid, tid);
  load_rows_panel<D, NT, kKT>(ss, q + (int64_t)t.h * D, stride, rows, tid);
  load_rows_panel<D, NT, kKT>(ss + TBQ, dout + (int64_t)t.h * D, stride, rows, tid);
  load_ld(sl, st, lse_acc, delta_acc, t, tid);
}

/* Issues X^T += A_w B^T for the warpgroup's 64 keys and the 64 queries of a
 * tile: A = K or V rows of the warpgroup (K-major, BN-row panel tile at sA
 * + 64 w rows), B = Q or dO (K-major, 64-row panel tile at sB), D / 16
 * k-slices of m64n64k16, both from shared memory. */
template <int D, int BN, typename T>
__device__ __forceinline__ void keys_by_queries(float (&x)[32], uint32_t sA, uint32_t sB) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t ka = (uint32_t)((kk >> 2) * BN * 128 + (kk & 3) * 32);
    const uint32_t kb = (uint32_t)((kk >> 2) * kKT * 128 + (kk & 3) * 32);
    wgmma_ss_m64n64k16<T, 0, 0>(x, sw128_desc(sA + ka, 16, 1024), sw128_desc(sB + kb, 16, 1024));
  }
}

/* kDqOwnKeys (d 64, two warpgroups): each warpgroup holds its 64 keys'
 * part of the same 64 x 64 dQ tile, warp j of both the same 16 rows.
 * Instead of two atomics per element, warpgroup w keeps the columns 32 w ..
 * 32 w + 31 (C fragment column groups KEEP .. KEEP + 3) and hands the other
 * 32 (SEND ..) to warp j of the other warpgroup through shared memory
 * (xs: [warpgroup][warp][group][lane] float4), then adds what it received
 * and issues the atomics of its own 32 columns: half of the red.global
 * traffic, split evenly over the 8 warps. The barrier (id BAR0 + j, the
 * two warps j) orders the writes before the reads; the caller orders the
 * next write to the same xs after both warps have read (wgmma_bwd_kernel:
 * the next iteration's CTA barrier). */
template <int SEND, int KEEP, int BAR0 = 2>
__device__ __forceinline__ void dq_pair_exchange(float (&acc)[32], float4 *xs, int wgi, int wj,
                                                 int lane) {
  float4 *mine = xs + (wgi * 4 + wj) * 4 * 32 + lane;
  const float4 *theirs = xs + ((wgi ^ 1) * 4 + wj) * 4 * 32 + lane;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = SEND + j;
    mine[32 * j] = make_float4(acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3]);
  }
  named_barrier(BAR0 + wj, 64);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = KEEP + j;
    const float4 x = theirs[32 * j];
    acc[4 * n] += x.x;
    acc[4 * n + 1] += x.y;
    acc[4 * n + 2] += x.z;
    acc[4 * n + 3] += x.w;
  }
}

/* P^T in place: sT[4n + e] holds S^T of key kr0 + 8 (e >> 1) of the item
 * (kr0 = kw0 + wr + g: the thread's first key row; kw0: the warpgroup's
 * first key) and query 8n + 2 t4 + (e & 1) of tile t, and becomes
 * exp2(S^T scale log2e - LSE log2e), 0 where masked (past the tile's valid
 * queries, outside the tile's key slots [jlo, jhi), causal); ld: the tile's
 * LSE[64] (then delta[64]) in shared memory. */
__device__ __forceinline__ void probs_t(float (&sT)[32], const float *ld, const QTile2 &t,
                                        float sl2, int kw0, int kr0, int t4) {
  const bool need_mask =
      t.nvalid < kKT || kw0 < t.jlo || kw0 + 64 > t.jhi || (t.causal && kw0 + 63 + t.off > 0);
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float2 L = *reinterpret_cast<const float2 *>(ld + 8 * n + 2 * t4);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = fast_exp2(fmaf(sT[4 * n + e], sl2, -((e & 1) ? L.y : L.x) * kLog2e));
      if (need_mask) {
        const int c = 8 * n + 2 * t4 + (e & 1), kr = kr0 + 8 * (e >> 1);
        if (c >= t.nvalid || kr < t.jlo || kr >= t.jhi || (t.causal && kr + t.off > c)) x = 0.f;
      }
      sT[4 * n + e] = x;
    }
  }
}

/* dS^T = P^T (dP^T - delta) in place of dP^T (delta per query column, at ld
 * + 64). */
__device__ __forceinline__ void dsoft_t(float (&dpT)[32], const float (&pT)[32], const float *ld,
                                        int t4) {
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float2 Dl = *reinterpret_cast<const float2 *>(ld + kKT + 8 * n + 2 * t4);
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dpT[4 * n + e] = pT[4 * n + e] * (dpT[4 * n + e] - ((e & 1) ? Dl.y : Dl.x));
  }
}

/* The A fragments of a 64 x 64 accumulator tile x (keys x queries) for
 * products over the queries: k-slice j = queries 16 j .. 16 j + 15. */
template <typename T>
__device__ __forceinline__ void pack_a_frags(uint32_t (&a)[4][4], const float (&x)[32]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[j][r] = pack2<T>(x[8 * j + 2 * r], x[8 * j + 2 * r + 1]);
}

/* scale * acc into dq_acc with red.global.add.v2.f32: the warp's rows wr +
 * g, wr + g + 8 of query tile (row0, h, nvalid), C fragment column groups
 * N0 .. N0 + NRED - 1 of the tile's columns from c0. */
template <int D, int N0, int NRED, int NACC>
__device__ __forceinline__ void dq_red(const float (&acc)[NACC], float *dq_acc,
                                       const cuda_step_t &st, int64_t row0, int h, int nvalid,
                                       int c0, int wr, int g, int t4) {
  const float sc = st.scale;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = wr + g + 8 * hh;
    if (row < nvalid) {
      float *dqr = dq_acc + ((row0 + row) * st.Hq + h) * D + c0 + 2 * t4;
#pragma unroll
      for (int n = N0; n < N0 + NRED; ++n)
        red_add_v2(dqr + 8 * n, sc * acc[4 * n + 2 * hh], sc * acc[4 * n + 2 * hh + 1]);
    }
  }
}

/* The epilogue: scale * dK and dV of the thread's keys kr0, kr0 + 8 of the
 * item (bars, part, krow0, hk: kv_out_rows; nk valid keys): bar items and
 * parts of split items WRITE their scratch rows (zeros where nothing
 * contributed), run items add into the dk_acc / dv_acc rows they own. */
template <int D>
__device__ __forceinline__ void
store_dkdv(const float (&dk)[D / 2], const float (&dv)[D / 2], const cuda_step_t &st, bool bars,
           bool part, int64_t krow0, int hk, int nk, int kr0, int t4, float *dk_acc, float *dv_acc,
           float *dk_bar, float *dv_bar) {
  const float sc = st.scale;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int kr = kr0 + 8 * hh;
    if (kr < nk) {
      float *dkr, *dvr;
      kv_out_rows(st, bars, part, krow0, hk, kr, D, dk_acc, dv_acc, dk_bar, dv_bar, dkr, dvr);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int c = n * 8 + 2 * t4;
        store_pair(dkr + c, sc * dk[4 * n + 2 * hh], sc * dk[4 * n + 2 * hh + 1], !bars && !part);
        store_pair(dvr + c, dv[4 * n + 2 * hh], dv[4 * n + 2 * hh + 1], !bars && !part);
      }
    }
  }
}

/* The stmatrix address of lane for k-slice j (query chunks 2j, 2j + 1) of
 * the 16 key rows from r0 of the dS^T tile at sDS ([key][query], one panel
 * of 128-byte rows, 128-byte swizzle): lanes 8m .. 8m + 7 address the rows
 * of 8 x 8 matrix m = (rows + 8 (m & 1), chunk 2j + (m >> 1)). */
__device__ __forceinline__ uint32_t ds_addr(uint32_t sDS, int r0, int j, int lane) {
  const int row = r0 + (lane & 7) + 8 * ((lane >> 3) & 1), chunk = 2 * j + (lane >> 4);
  return sDS + (uint32_t)(row * 128 + ((chunk ^ (row & 7)) << 4));
}

template <int D, typename T, int NWG, bool FUSED>
__global__ void __launch_bounds__(128 * NWG, 1)
    wgmma_bwd_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                     const T *__restrict__ v, const T *__restrict__ dout,
                     const float *__restrict__ lse_acc, const float *__restrict__ delta_acc,
                     float *__restrict__ dq_acc, float *__restrict__ dk_acc,
                     float *__restrict__ dv_acc, float *__restrict__ dk_bar,
                     float *__restrict__ dv_bar) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap(); /* wgmma exists on sm_90a only; the host side refuses other devices */
#else
  extern __shared__ __align__(1024) unsigned char smem[];
  using S = BwdShape<D, NWG>;
  constexpr int NC = S::NC, BN = S::BN, TBK = S::TBK, TBQ = S::TBQ, SB = S::SB;
  constexpr int DQN = S::DQN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int wgi = warp >> 2;      /* the warpgroup */
  const int kw0 = 64 * wgi;       /* its first key of the item */
  const int wr = 16 * (warp & 3); /* the warp's first row of the warpgroup's 64 */
  const uint32_t sraw = smem_u32(smem);
  const uint32_t s0 = (sraw + 1023u) & ~1023u;
  unsigned char *sbase = smem + (s0 - sraw);
  QRing &ring = *reinterpret_cast<QRing *>(sbase + S::kRingOff);
  const uint32_t sK = s0, sV = s0 + TBK, sS = s0 + S::kStageOff, sDS = s0 + S::kDsOff;
  const uint32_t sL = s0 + S::kLdOff;

  /* the item (uniform over the CTA), K and V of its keys */
  bool bars; /* a bar item (its keys gathered through the bar list) */
  {
    QWalk2 qw;
    int hk, nk, slot;
    int64_t row0;
    if (!kv_item_begin(st, BN, qw, hk, nk, row0, slot)) return;
    bars = qw.bars != 0;
    /* a part of a split item writes the scratch rows of its slot */
    if (tid == 0)
      ring.start(st, qw, slot >= 0 ? (int64_t)slot * BN : row0, hk, nk, bars, slot >= 0);
    __syncthreads();
    if (ring.d[0].h >= 0) {
      const int64_t kv_stride = (int64_t)st.Hkv * D;
      int64_t rows[LoadShape<NC, BN>::kRows];
      kv_item_rows<NC, BN>(rows, st, qw, row0, nk, tid);
      load_rows_panel<D, NC, BN>(sK, k + (int64_t)hk * D, kv_stride, rows, tid);
      load_rows_panel<D, NC, BN>(sV, v + (int64_t)hk * D, kv_stride, rows, tid);
    }
  }
  /* no query tile sees these keys (bar items and parts write zeros) */
  if (ring.d[0].h < 0 && !bars && !ring.part) return;

  /* dk[4n + e], dv[4n + e]: key kw0 + wr + g + 8 (e >> 1), d column 8n +
   * 2 t4 + (e & 1) */
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int x = 0; x < D / 2; ++x) dk[x] = dv[x] = 0.f;

  if (ring.d[0].h >= 0) {
    load_q_stage<D, NC>(sS, sL, st, q, dout, lse_acc, delta_acc, ring.d[0], tid);
    cp_async_commit();
    const float sl2 = st.scale * kLog2e;

    for (int it = 0;; ++it) {
      cp_async_wait<0>();  /* tile it (and K, V) landed: this thread's copies */
      fence_proxy_async(); /* ... visible to wgmma */
      __syncthreads();     /* ... every thread's; the other stage and dS^T are free */
      const int slot = it % 3, slot1 = slot == 2 ? 0 : slot + 1;
      const int stage = it & 1;
      const QTile2 t = ring.d[slot];
      const bool more = ring.d[slot1].h >= 0;
      if (more) {
        load_q_stage<D, NC>(sS + (uint32_t)((stage ^ 1) * SB), sL + (uint32_t)((stage ^ 1) * 512),
                            st, q, dout, lse_acc, delta_acc, ring.d[slot1], tid);
        cp_async_commit();
      }
      /* thread 0 advances the walk (tile it + 3) while the warpgroup waits
       * for its last products: its dependent global reads would otherwise
       * hold back the warpgroup's next wgmma */
      auto advance_walk = [&]() {
        if (more && tid == 0) ring.produce(st, slot1 == 2 ? 0 : slot1 + 1);
      };
      const uint32_t sQ = sS + (uint32_t)(stage * SB), sO = sQ + TBQ;
      const float *ld = reinterpret_cast<const float *>(sbase + S::kLdOff + stage * 512);

      /* Every product is issued whether or not the warpgroup's keys reach
       * the tile (masked entries are zeros; tiles that no key of a
       * warpgroup reaches are rare): the iteration's products are one
       * branch-free sequence, and dQ queues behind dK and dV without a
       * wait. */
      float sT[32], dpT[32];
#pragma unroll
      for (int x = 0; x < 32; ++x) {
        sT[x] = dpT[x] = 0.f;
        reg_fence(sT[x]);  /* zeroed before the fence (not sunk past it: */
        reg_fence(dpT[x]); /* ptxas would then serialize every wgmma) */
      }
      wgmma_fence();
      keys_by_queries<D, BN, T>(sT, sK + (uint32_t)(kw0 * 128), sQ);
      wgmma_commit();
      keys_by_queries<D, BN, T>(dpT, sV + (uint32_t)(kw0 * 128), sO);
      wgmma_commit();
      wgmma_wait<1>();
#pragma unroll
      for (int x = 0; x < 32; ++x) reg_fence(sT[x]);

      /* P^T: sT[4n + e] = key kr, query c */
      const bool need_mask =
          t.nvalid < kKT || kw0 < t.jlo || kw0 + 64 > t.jhi || (t.causal && kw0 + 63 + t.off > 0);
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float2 L = *reinterpret_cast<const float2 *>(ld + 8 * n + 2 * t4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = fast_exp2(fmaf(sT[4 * n + e], sl2, -((e & 1) ? L.y : L.x) * kLog2e));
          if (need_mask) {
            const int c = 8 * n + 2 * t4 + (e & 1), kr = kw0 + wr + g + 8 * (e >> 1);
            if (c >= t.nvalid || kr < t.jlo || kr >= t.jhi || (t.causal && kr + t.off > c)) x = 0.f;
          }
          sT[4 * n + e] = x;
        }
      }
      wgmma_wait<0>();
#pragma unroll
      for (int x = 0; x < 32; ++x) reg_fence(dpT[x]);
        /* dS^T = P^T (dP^T - delta) */
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float2 Dl = *reinterpret_cast<const float2 *>(ld + kKT + 8 * n + 2 * t4);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dpT[4 * n + e] = sT[4 * n + e] * (dpT[4 * n + e] - ((e & 1) ? Dl.y : Dl.x));
      }
      /* A fragments of P^T and dS^T, k-slice j = queries 16 j .. 16 j + 15 */
      uint32_t pa[4][4], dsa[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          pa[j][r] = pack2<T>(sT[8 * j + 2 * r], sT[8 * j + 2 * r + 1]);
          dsa[j][r] = pack2<T>(dpT[8 * j + 2 * r], dpT[8 * j + 2 * r + 1]);
        }
      wgmma_fence();
      /* every query k-slice is issued (masked queries hold zeros), so the
       * sequence from fence to wait has no branch */
      wgmma_regs_by_rows64<D, T>(dv, pa, sO);
      wgmma_regs_by_rows64<D, T>(dk, dsa, sQ);
      wgmma_commit();
      if constexpr (FUSED) {
        /* dS^T into the [key][query] tile while dK, dV run: stmatrix
         * k-slice j = query chunks 2j, 2j + 1 of the warp's 16 key rows */
#pragma unroll
        for (int j = 0; j < 4; ++j)
          stsm_x4(ds_addr(sDS, kw0 + wr, j, lane), dsa[j][0], dsa[j][1], dsa[j][2], dsa[j][3]);
        fence_proxy_async(); /* the stmatrix writes, visible to wgmma */
        named_barrier(1, NC);
        /* dQ = dS K, columns c0 .. c0 + DQN - 1 over the key k-slices [k0,
         * k0 + NKQ): all BN keys, or the warpgroup's own 64 (d = 64, two
         * warpgroups); queued behind dK, dV */
        constexpr int NKQ = S::kDqOwnKeys ? 4 : BN / 16;
        const int k0 = S::kDqOwnKeys ? 4 * wgi : 0, c0 = S::kDqOwnKeys ? 0 : DQN * wgi;
        float acc[DQN / 2];
#pragma unroll
        for (int x = 0; x < DQN / 2; ++x) {
          acc[x] = 0.f;
          reg_fence(acc[x]);
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < NKQ; ++kk) {
          const uint32_t krow = (uint32_t)((k0 + kk) * 16 * 128);
          const uint64_t ad = sw128_desc(sDS + krow, BN * 128, 1024);
          const uint64_t bd =
              sw128_desc(sK + (uint32_t)((c0 / 64) * BN * 128) + krow, BN * 128, 1024);
          if constexpr (DQN == 128)
            wgmma_ss_m64n128k16<T, 1, 1>(acc, ad, bd);
          else
            wgmma_ss_m64n64k16<T, 1, 1>(acc, ad, bd);
        }
        wgmma_commit();
        /* with 64 dQ accumulators (d 128, one warpgroup) the walk goes after
         * the wait: before it, ptxas spills */
        if constexpr (DQN < 128) advance_walk();
        wgmma_wait<0>();
        if constexpr (DQN == 128) advance_walk();
#pragma unroll
        for (int x = 0; x < DQN / 2; ++x) reg_fence(acc[x]);
        const float sc = st.scale;
        if constexpr (S::kDqOwnKeys) {
          static_assert(DQN == 64, "the exchange splits 64 columns");
          float4 *xs = reinterpret_cast<float4 *>(sbase + S::kXOff);
          if (wgi == 0)
            dq_pair_exchange<4, 0>(acc, xs, wgi, warp & 3, lane);
          else
            dq_pair_exchange<0, 4>(acc, xs, wgi, warp & 3, lane);
        }
        /* the column groups this warpgroup adds into dq_acc */
        constexpr int NRED = S::kDqOwnKeys ? 4 : DQN / 8;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = wr + g + 8 * hh;
          if (row < t.nvalid) {
            float *dqr = dq_acc + ((t.row0 + row) * st.Hq + t.h) * D + c0 + 2 * t4;
            if (S::kDqOwnKeys && wgi == 1) {
#pragma unroll
              for (int n = 4; n < 8; ++n)
                red_add_v2(dqr + 8 * n, sc * acc[4 * n + 2 * hh], sc * acc[4 * n + 2 * hh + 1]);
            } else {
#pragma unroll
              for (int n = 0; n < NRED; ++n)
                red_add_v2(dqr + 8 * n, sc * acc[4 * n + 2 * hh], sc * acc[4 * n + 2 * hh + 1]);
            }
          }
        }
      } else {
        advance_walk();
        wgmma_wait<0>(); /* dK, dV products done */
      }
      /* the stage, pa and dsa are free once the products have read them */
#pragma unroll
      for (int x = 0; x < D / 2; ++x) {
        reg_fence(dk[x]);
        reg_fence(dv[x]);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          reg_fence_u(pa[j][r]);
          reg_fence_u(dsa[j][r]);
        }
      if (!more) break;
    }
  }

  /* epilogue: scale * dK and dV of the warpgroup's keys; bar items and
   * parts of split items WRITE their scratch rows (zeros where nothing
   * contributed), run items add into the dk_acc/dv_acc rows they own */
  const float sc = st.scale;
  const bool add = !bars && !ring.part;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int kr = kw0 + wr + g + 8 * hh;
    if (kr < ring.nk) {
      float *dkr, *dvr;
      kv_out_rows(st, ring, kr, D, dk_acc, dv_acc, dk_bar, dv_bar, dkr, dvr);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int c = n * 8 + 2 * t4;
        store_pair(dkr + c, sc * dk[4 * n + 2 * hh], sc * dk[4 * n + 2 * hh + 1], add);
        store_pair(dvr + c, dv[4 * n + 2 * hh], dv[4 * n + 2 * hh + 1], add);
      }
    }
  }
#endif
}

/* ---- the warp-specialised backward (wgmma_bwd_ws_kernel, the default) ----
 *
 * The same items, walk, products, masks and outputs as wgmma_bwd_kernel,
 * with the loads taken off the consumers: one producer warpgroup advances
 * the query walk and copies each query tile (Q, dO, LSE, delta) into a ring
 * of stages guarded by mbarriers (full: the copies landed and the tile's
 * descriptor is published; empty: every consumer thread is done with the
 * stage); the consumer warpgroups never meet at a CTA barrier in the loop.
 * With two consumer warpgroups the CTA has 384 threads (168 registers each
 * at launch), so setmaxnreg moves registers from the producer (40) to the
 * consumers (232); with one at d 64, two CTAs of 256 threads share an SM
 * (128 registers each at launch; producer 32, consumers 224). */

/* Named barriers of wgmma_bwd_ws_kernel (0 is __syncthreads): the producer
 * warpgroup's (thread 0's tile descriptor, read by every producer thread),
 * the consumers' (K and V landed; the dS^T tile of both warpgroups at d 128
 * with two), one per consumer warpgroup (its own dS^T tile), and the pairs
 * of warps j of the d 64 dQ exchange (kBarPair0 + j). */
constexpr int kBarProducer = 1, kBarConsumers = 2, kBarWg0 = 3, kBarPair0 = 5;

/* The control block of wgmma_bwd_ws_kernel: the query walk (advanced by
 * producer thread 0 alone, in shared memory: no walk state in registers);
 * query tile n's descriptor in tile[n % NST] (h < 0: the end of the walk),
 * published with full[n % NST] (NP arrivals, each after the thread's copies
 * landed), the stage released with empty[n % NST] (NC arrivals); the item's
 * output rows for the epilogue. */
template <int NST> struct WsCtl {
  QWalk2 w;
  alignas(16) QTile2 tile[NST];
  uint64_t full[NST], empty[NST];
  int64_t krow0; /* runs: first local key row; bars, parts: first scratch row */
  int hk, nk, bars, part;
};

/* The CTA of wgmma_bwd_ws_kernel<D, ., NWG, .>: NWG consumer warpgroups
 * (warpgroup w owns keys 64 w .. 64 w + 63 of the item) and one producer
 * warpgroup (the last); shapes, stages, registers and shared memory. */
template <int D, int NWG> struct WsShape {
  static constexpr int NC = 128 * NWG; /* consumer threads */
  static constexpr int NP = 128;       /* producer threads (one warpgroup) */
  static constexpr int NT = NC + NP;
  static constexpr int BN = 64 * NWG; /* keys of an item */
  static constexpr int TBK = BN * D * 2;
  static constexpr int TBQ = kKT * D * 2;
  static constexpr int SB = 2 * TBQ; /* a stage: Q, then dO */
  static constexpr int TBS = BN * kKT * 2;
  /* dQ columns of a warpgroup, as in BwdShape */
  static constexpr int DQN = D / NWG >= 64 ? D / NWG : D;
  static constexpr bool kDqOwnKeys = NWG > 1 && DQN == D;
  /* the dQ product reads the dS^T rows of both warpgroups (d 128, two) */
  static constexpr bool kDsShared = NWG > 1 && !kDqOwnKeys;
  /* d 64: the consumer loop is software-pipelined (tile n's dK, dV and dQ
   * products run while the warpgroup moves on to tile n + 1; tile n's dQ
   * atomics run while tile n + 1's S^T and dP^T are on the tensor cores), so
   * a consumer warpgroup holds two stages; at d 128 the registers do not
   * allow it (dK, dV: 128 accumulators) */
  static constexpr bool kPipelined = D == 64;
  /* CTAs per SM: two at NWG 1 d 64 (256 threads of 128 registers), else one */
  static constexpr int kMinBlocks = NWG == 1 && D == 64 ? 2 : 1;
  /* the producer keeps kInFlight tiles loading: at the top of iteration n
   * it publishes tile n - kInFlight, once landed; then it waits for the
   * stage of tile n. Deadlock-free when kStages >= kInFlight + held - 1
   * (held: stages a consumer holds at once), without a wait for the
   * producer at kStages >= kInFlight + held */
  static constexpr int kInFlight = 2;
  static constexpr int kStages = kPipelined ? 4 : 3;
  /* setmaxnreg: registers per thread at launch (__launch_bounds__), then
   * the producer's and the consumers'; one CTA of 256 threads per SM has
   * 255 each and moves none */
  static constexpr bool kMoveRegs = NT * kMinBlocks > 256;
  static constexpr int kLaunchRegs = kMoveRegs ? (65536 / (NT * kMinBlocks)) & ~7 : 255;
  /* 40 with two consumer warpgroups (the consumers get 232: 24 would give
   * them 240 but spill the producer's walk); 32 with one (the consumers get
   * 224, of which the pipelined d 64 loop needs more than 216: ptxas
   * serializes the wgmma, C7512, at 40) */
  static constexpr int kProducerRegs = NWG == 1 ? 32 : 40;
  static constexpr int kConsumerRegs =
      kMoveRegs ? ((NT * kLaunchRegs - NP * kProducerRegs) / NC) & ~7 : kLaunchRegs;
  /* shared memory: K, V of the item; kStages stages; two dS^T tiles
   * (fused; tile n in n % 2, so that a warp writes tile n only after every
   * warp's dQ product of tile n - 2, not n - 1, has completed); LSE and
   * delta per stage; the dQ exchange (d 64, two warpgroups; two buffers);
   * the control block (WsCtl) */
  static constexpr int kStageOff = 2 * TBK;
  static constexpr int kDsOff = kStageOff + kStages * SB;
  static constexpr int kLdOff = kDsOff + 2 * TBS;
  static constexpr int kXOff = kLdOff + kStages * 2 * kKT * 4;
  static constexpr int kXBytes = kDqOwnKeys ? 2 * NWG * 4 * 4 * 32 * 16 : 0;
  static constexpr int kCtlOff = kXOff + kXBytes;
  /* 1024 bytes of slack align the base to the swizzle period */
  static constexpr int kSmem = kCtlOff + (int)sizeof(WsCtl<kStages>) + 1024;
  static_assert(mma2::fits_sm90(kSmem, kMinBlocks), "shared memory per SM");
  static_assert(kStages >= kInFlight + (kPipelined ? 2 : 1), "a stage ring without waits");
  static_assert(TBK % 1024 == 0 && TBQ % 1024 == 0 && TBS % 1024 == 0, "1024-byte alignment");
  static_assert(!kMoveRegs || (kConsumerRegs >= kLaunchRegs && kConsumerRegs <= 256),
                "setmaxnreg counts");
};

/* dQ of query tile (row0, h, nvalid) from a warpgroup's accumulators acc
 * (rows of the warp wr.., columns c0.. of the tile: DQN of them, or at d
 * 64 with two warpgroups all 64 over the warpgroup's own keys, summed with
 * the other warpgroup's through xs first) into dq_acc. */
template <int D, int NWG>
__device__ __forceinline__ void ws_dq_out(float (&acc)[WsShape<D, NWG>::DQN / 2], float4 *xs,
                                          float *dq_acc, const cuda_step_t &st, int64_t row0, int h,
                                          int nvalid, int wgi, int warp, int lane) {
  using S = WsShape<D, NWG>;
  const int g = lane >> 2, t4 = lane & 3, wr = 16 * (warp & 3);
  if constexpr (S::kDqOwnKeys) {
    static_assert(S::DQN == 64, "the exchange splits 64 columns");
    if (wgi == 0) {
      dq_pair_exchange<4, 0, kBarPair0>(acc, xs, wgi, warp & 3, lane);
      dq_red<D, 0, 4>(acc, dq_acc, st, row0, h, nvalid, 0, wr, g, t4);
    } else {
      dq_pair_exchange<0, 4, kBarPair0>(acc, xs, wgi, warp & 3, lane);
      dq_red<D, 4, 4>(acc, dq_acc, st, row0, h, nvalid, 0, wr, g, t4);
    }
  } else {
    dq_red<D, 0, S::DQN / 8>(acc, dq_acc, st, row0, h, nvalid, S::DQN * wgi, wr, g, t4);
  }
}

template <int D, typename T, int NWG, bool FUSED>
__global__ void __launch_bounds__(WsShape<D, NWG>::NT, WsShape<D, NWG>::kMinBlocks)
    wgmma_bwd_ws_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                        const T *__restrict__ v, const T *__restrict__ dout,
                        const float *__restrict__ lse_acc, const float *__restrict__ delta_acc,
                        float *__restrict__ dq_acc, float *__restrict__ dk_acc,
                        float *__restrict__ dv_acc, float *__restrict__ dk_bar,
                        float *__restrict__ dv_bar) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap(); /* wgmma exists on sm_90a only; the host side refuses other devices */
#else
  extern __shared__ __align__(1024) unsigned char smem[];
  using S = WsShape<D, NWG>;
  constexpr int NC = S::NC, NP = S::NP, BN = S::BN, TBK = S::TBK, TBQ = S::TBQ, SB = S::SB;
  constexpr int NST = S::kStages, DQN = S::DQN;
  constexpr uint32_t kLdBytes = 2 * kKT * 4;
  using Ctl = WsCtl<NST>;
  const int tid = threadIdx.x;
  const uint32_t sraw = smem_u32(smem);
  const uint32_t s0 = (sraw + 1023u) & ~1023u;
  unsigned char *sbase = smem + (s0 - sraw);
  Ctl &ctl = *reinterpret_cast<Ctl *>(sbase + S::kCtlOff);
  const uint32_t full0 = smem_u32(&ctl.full[0]), empty0 = smem_u32(&ctl.empty[0]);
  const uint32_t sS = s0 + S::kStageOff, sL = s0 + S::kLdOff;

  /* the item (uniform over the CTA); thread 0 sets up the control block and
   * finds the walk's first tile */
  QWalk2 qw;
  int hk, nk, slot;
  int64_t row0;
  if (!kv_item_begin(st, BN, qw, hk, nk, row0, slot)) return;
  const bool bars = qw.bars != 0; /* a bar item (its keys gathered through the bar list) */
  const bool part = slot >= 0;    /* a part of a split item: writes its slot's rows */
  const int64_t orow0 = part ? (int64_t)slot * BN : row0;
  if (tid == 0) {
    for (int x = 0; x < NST; ++x) {
      mbar_init(full0 + 8 * x, NP);
      mbar_init(empty0 + 8 * x, NC);
    }
    ctl.krow0 = orow0;
    ctl.hk = hk;
    ctl.nk = nk;
    ctl.bars = bars;
    ctl.part = part;
    QWalk2 w = qw;
    QTile2 t0{};
    if (!w.next(st, t0)) t0.h = -1;
    ctl.w = w;
    ctl.tile[0] = t0;
  }
  __syncthreads();
  if (ctl.tile[0].h < 0) {
    /* no query tile sees these keys: a bar item or a part writes zero
     * scratch rows */
    if ((bars || part) && tid < NC) {
      const int lane = tid & 31, warp = tid >> 5;
      float z[D / 2];
#pragma unroll
      for (int x = 0; x < D / 2; ++x) z[x] = 0.f;
      store_dkdv<D>(z, z, st, bars, part, orow0, hk, nk,
                    64 * (warp >> 2) + 16 * (warp & 3) + (lane >> 2), lane & 3, dk_acc, dv_acc,
                    dk_bar, dv_bar);
    }
    return;
  }

  if (tid >= NC) {
    /* ---- producer warpgroup: tile n of the walk into stage n % NST once the
     * consumers released it; tile n - kInFlight published once landed ---- */
    if constexpr (S::kMoveRegs) setmaxnreg_dec<S::kProducerRegs>();
    constexpr int F = S::kInFlight;
    const int p = tid - NC;
    for (int n = 0;; ++n) {
      if (n >= F) {
        cp_async_wait<F - 1>(); /* tile n - F has landed (this thread's copies) */
        fence_proxy_async();    /* ... visible to wgmma's reads */
        mbar_arrive(full0 + 8 * ((n - F) % NST));
      }
      const int sn = n % NST;
      if (n >= NST)
        while (!mbar_try_wait(empty0 + 8 * sn, (uint32_t)((n / NST - 1) & 1))) {
        }
      if (n > 0) {
        /* thread 0: tile n's descriptor into the free slot */
        if (p == 0) {
          QTile2 t{};
          if (!ctl.w.next(st, t)) t.h = -1;
          ctl.tile[sn] = t;
        }
        named_barrier(kBarProducer, NP);
      }
      const QTile2 t = ctl.tile[sn];
      if (t.h >= 0)
        load_q_stage<D, NP>(sS + (uint32_t)(sn * SB), sL + (uint32_t)sn * kLdBytes, st, q, dout,
                            lse_acc, delta_acc, t, p);
      cp_async_commit();
      if (t.h < 0) {
        /* the end: publish the tiles still loading and the end marker */
        cp_async_wait<0>();
        fence_proxy_async();
        for (int x = n - F + 1; x <= n; ++x)
          if (x >= 0) mbar_arrive(full0 + 8 * (x % NST));
        break;
      }
    }
    return;
  }

  /* ---- consumer warpgroups ---- */
  if constexpr (S::kMoveRegs) setmaxnreg_inc<S::kConsumerRegs>();
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int wgi = warp >> 2;      /* the warpgroup */
  const int kw0 = 64 * wgi;       /* its first key of the item */
  const int wr = 16 * (warp & 3); /* the warp's first row of the warpgroup's 64 */
  const uint32_t sK = s0, sV = s0 + TBK, sDS = s0 + S::kDsOff;
  {
    /* K and V of the item, loaded by the consumers while the producer loads
     * the first query tiles */
    const int64_t kv_stride = (int64_t)st.Hkv * D;
    int64_t rows[LoadShape<NC, BN>::kRows];
    kv_item_rows<NC, BN>(rows, st, qw, row0, nk, tid);
    load_rows_panel<D, NC, BN>(sK, k + (int64_t)hk * D, kv_stride, rows, tid);
    load_rows_panel<D, NC, BN>(sV, v + (int64_t)hk * D, kv_stride, rows, tid);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_barrier(kBarConsumers, NC);
  }

  /* dk[4n + e], dv[4n + e]: key kw0 + wr + g + 8 (e >> 1), d column 8n +
   * 2 t4 + (e & 1) */
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int x = 0; x < D / 2; ++x) dk[x] = dv[x] = 0.f;
  const float sl2 = st.scale * kLog2e;
  float4 *xs = reinterpret_cast<float4 *>(sbase + S::kXOff);
  constexpr int kXHalf = NWG * 4 * 4 * 32; /* float4s of one exchange buffer */

  /* waits for tile n's stage; its descriptor */
  auto acquire = [&](int n) -> QTile2 {
    const int sn = n % NST;
    while (!mbar_try_wait(full0 + 8 * sn, (uint32_t)((n / NST) & 1))) {
    }
    return ctl.tile[sn];
  };
  auto zero32 = [](float(&x)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      x[i] = 0.f;
      reg_fence(x[i]); /* zeroed before the fence (not sunk past it: ptxas
                          would then serialize every wgmma) */
    }
  };
  /* S^T and dP^T of the stage at sQ (Q, then dO), committed as two groups */
  auto issue_s_dp = [&](float(&sT)[32], float(&dpT)[32], uint32_t sQ) {
    zero32(sT);
    zero32(dpT);
    wgmma_fence();
    keys_by_queries<D, BN, T>(sT, sK + (uint32_t)(kw0 * 128), sQ);
    wgmma_commit();
    keys_by_queries<D, BN, T>(dpT, sV + (uint32_t)(kw0 * 128), sQ + TBQ);
    wgmma_commit();
  };
  /* dS^T of tile n into its buffer (stmatrix k-slice j = query chunks 2j,
   * 2j + 1 of the warp's 16 key rows), visible to wgmma, then the barrier
   * of the warpgroups whose dQ products read it; returns the buffer */
  auto store_ds = [&](const uint32_t(&dsa)[4][4], int n) -> uint32_t {
    const uint32_t buf = sDS + (uint32_t)((n & 1) * S::TBS);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      stsm_x4(ds_addr(buf, kw0 + wr, j, lane), dsa[j][0], dsa[j][1], dsa[j][2], dsa[j][3]);
    fence_proxy_async(); /* the stmatrix writes, visible to wgmma */
    if constexpr (S::kDsShared)
      named_barrier(kBarConsumers, NC);
    else
      named_barrier(kBarWg0 + wgi, 128);
    return buf;
  };
  /* dQ = dS K of the dS^T tile at buf (columns c0 .. c0 + DQN - 1 over the
   * key k-slices [k0, k0 + NKQ): all BN keys, or the warpgroup's own 64 at
   * d 64 with two warpgroups), into acc (zeroed here), one group */
  auto issue_dq = [&](float(&acc)[DQN / 2], uint32_t buf) {
    constexpr int NKQ = S::kDqOwnKeys ? 4 : BN / 16;
    const int k0 = S::kDqOwnKeys ? 4 * wgi : 0, c0 = S::kDqOwnKeys ? 0 : DQN * wgi;
#pragma unroll
    for (int x = 0; x < DQN / 2; ++x) {
      acc[x] = 0.f;
      reg_fence(acc[x]);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < NKQ; ++kk) {
      const uint32_t krow = (uint32_t)((k0 + kk) * 16 * 128);
      const uint64_t ad = sw128_desc(buf + krow, BN * 128, 1024);
      const uint64_t bd = sw128_desc(sK + (uint32_t)((c0 / 64) * BN * 128) + krow, BN * 128, 1024);
      if constexpr (DQN == 128)
        wgmma_ss_m64n128k16<T, 1, 1>(acc, ad, bd);
      else
        wgmma_ss_m64n64k16<T, 1, 1>(acc, ad, bd);
    }
    wgmma_commit();
  };
  auto fence_kv = [&]() {
#pragma unroll
    for (int x = 0; x < D / 2; ++x) {
      reg_fence(dk[x]);
      reg_fence(dv[x]);
    }
  };

  float sT[32], dpT[32];
  uint32_t pa[4][4], dsa[4][4];
  float acc[DQN / 2];
  /* P^T and dS^T of tile t from the S^T, dP^T products in flight (the two
   * most recent groups), packed into the A fragments pa, dsa */
  auto softmax_grad = [&](const QTile2 &t, const float *ld) {
    wgmma_wait<1>(); /* S^T */
#pragma unroll
    for (int x = 0; x < 32; ++x) reg_fence(sT[x]);
    probs_t(sT, ld, t, sl2, kw0, kw0 + wr + g, t4);
    wgmma_wait<0>(); /* dP^T */
#pragma unroll
    for (int x = 0; x < 32; ++x) reg_fence(dpT[x]);
    dsoft_t(dpT, sT, ld, t4);
    pack_a_frags<T>(pa, sT);
    pack_a_frags<T>(dsa, dpT);
  };
  auto stage_ld = [&](int n) {
    return reinterpret_cast<const float *>(sbase + S::kLdOff + (n % NST) * kLdBytes);
  };
  if constexpr (S::kPipelined) {
    /* Iteration n starts with P^T, dS^T of tile n packed: issue dV, dK; dS^T
     * into shared memory; issue dQ; wait for tile n + 1's stage and issue
     * its S^T, dP^T (queued behind tile n's products); wait for tile n's
     * products, release its stage and add its dQ (exchange, atomics) while
     * tile n + 1's run; P^T, dS^T of tile n + 1. Every product is issued
     * unconditionally (branch-free within the warpgroup): past the walk's
     * end S^T and dP^T read a stale stage (not written any more) and are
     * dropped. Each product is waited for in the iteration that issued it:
     * ptxas serializes every wgmma (C7514) when an accumulator is read
     * after a wait that retires a product of the previous iteration. */
    QTile2 t = acquire(0);
    issue_s_dp(sT, dpT, sS);
    softmax_grad(t, stage_ld(0));
    for (int n = 0;; ++n) {
      const uint32_t sQ = sS + (uint32_t)((n % NST) * SB);
      wgmma_fence();
      wgmma_regs_by_rows64<D, T>(dv, pa, sQ + TBQ);
      wgmma_regs_by_rows64<D, T>(dk, dsa, sQ);
      wgmma_commit();
      if constexpr (FUSED) issue_dq(acc, store_ds(dsa, n));
      const QTile2 t1 = acquire(n + 1);
      issue_s_dp(sT, dpT, sS + (uint32_t)(((n + 1) % NST) * SB));
      wgmma_wait<2>(); /* tile n's dV, dK (and dQ) */
      fence_kv();
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          reg_fence_u(pa[j][r]);
          reg_fence_u(dsa[j][r]);
        }
      mbar_arrive(empty0 + 8 * (n % NST)); /* this thread is done with tile n's stage */
      if constexpr (FUSED) {
#pragma unroll
        for (int x = 0; x < DQN / 2; ++x) reg_fence(acc[x]);
        ws_dq_out<D, NWG>(acc, xs + (n & 1) * kXHalf, dq_acc, st, t.row0, t.h, t.nvalid, wgi, warp,
                          lane);
      }
      softmax_grad(t1, stage_ld(n + 1));
      if (t1.h < 0) break;
      t = t1;
    }
  } else {
    /* one tile at a time: S^T, dP^T; P^T, dS^T; dV, dK (and dQ) */
    for (int n = 0;; ++n) {
      const QTile2 t = acquire(n);
      if (t.h < 0) break;
      const int sn = n % NST;
      const uint32_t sQ = sS + (uint32_t)(sn * SB);
      issue_s_dp(sT, dpT, sQ);
      softmax_grad(t, stage_ld(n));
      wgmma_fence();
      wgmma_regs_by_rows64<D, T>(dv, pa, sQ + TBQ);
      wgmma_regs_by_rows64<D, T>(dk, dsa, sQ);
      wgmma_commit();
      if constexpr (FUSED) {
        issue_dq(acc, store_ds(dsa, n));
        wgmma_wait<1>(); /* dV, dK done: the stage is free */
      } else {
        wgmma_wait<0>();
      }
      fence_kv();
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          reg_fence_u(pa[j][r]);
          reg_fence_u(dsa[j][r]);
        }
      mbar_arrive(empty0 + 8 * sn); /* this thread is done with the stage */
      if constexpr (FUSED) {
        wgmma_wait<0>(); /* dQ */
#pragma unroll
        for (int x = 0; x < DQN / 2; ++x) reg_fence(acc[x]);
        ws_dq_out<D, NWG>(acc, xs + (n & 1) * kXHalf, dq_acc, st, t.row0, t.h, t.nvalid, wgi, warp,
                          lane);
      }
    }
  }

  store_dkdv<D>(dk, dv, st, ctl.bars != 0, ctl.part != 0, ctl.krow0, ctl.hk, ctl.nk, kw0 + wr + g,
                t4, dk_acc, dv_acc, dk_bar, dv_bar);
#endif
}

/* ---- host side ---- */

template <int D, typename T, int NWG, bool FUSED>
static mtrain_status_t launch_bwd(cuda_state_t *s, const cuda_step_t *st,
                                  const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar) {
  using S = BwdShape<D, NWG>;
  static cuda_smem_attr_t attr;
  /* one launch: the bar items, then the run key tiles */
  return mma2::launch_kv_kernel(s, wgmma_bwd_kernel<D, T, NWG, FUSED>, "variant 3",
                                FUSED ? "wgmma_bwd_kernel (fused dQ)" : "wgmma_bwd_kernel", S::BN,
                                S::NC, S::kSmem, &attr, st, a, dk_bar, dv_bar);
}

template <int D, typename T, int NWG, bool FUSED>
static mtrain_status_t launch_bwd_ws(cuda_state_t *s, const cuda_step_t *st,
                                     const mtrain_bwd_step_args_t *a, float *dk_bar,
                                     float *dv_bar) {
  using S = WsShape<D, NWG>;
  static cuda_smem_attr_t attr;
  return mma2::launch_kv_kernel(s, wgmma_bwd_ws_kernel<D, T, NWG, FUSED>, "variant 3",
                                FUSED ? "wgmma_bwd_ws_kernel (fused dQ)" : "wgmma_bwd_ws_kernel",
                                S::BN, S::NT, S::kSmem, &attr, st, a, dk_bar, dv_bar);
}

/* The dK/dV (and fused dQ) kernel of the context's choice
 * (cuda_state_t::wgmma_bwd): 1 wgmma_bwd_kernel, 2 wgmma_bwd_ws_kernel. */
template <int D, typename T, bool FUSED>
static mtrain_status_t launch_kv(cuda_state_t *s, const cuda_step_t *st,
                                 const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar) {
  /* 128-key items need G % 128 == 0: an item never spans two blocks */
  const bool wide = st->G % 128 == 0;
  if (s->wgmma_bwd == 1)
    return wide ? launch_bwd<D, T, 2, FUSED>(s, st, a, dk_bar, dv_bar)
                : launch_bwd<D, T, 1, FUSED>(s, st, a, dk_bar, dv_bar);
  return wide ? launch_bwd_ws<D, T, 2, FUSED>(s, st, a, dk_bar, dv_bar)
              : launch_bwd_ws<D, T, 1, FUSED>(s, st, a, dk_bar, dv_bar);
}

template <int D, typename T>
static mtrain_status_t bwd_g(cuda_state_t *s, const cuda_step_t *st,
                             const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar) {
  if (!s->deterministic) return launch_kv<D, T, true>(s, st, a, dk_bar, dv_bar);
  mtrain_status_t rc = cuda_mma2_bwd_dq(s, st, a);
  if (rc != MTRAIN_SUCCESS) return rc;
  return launch_kv<D, T, false>(s, st, a, dk_bar, dv_bar);
}

} /* namespace wg */

extern "C" mtrain_status_t cuda_wgmma_bwd_kernel_from_env(int *which) {
  const char *e = getenv("MTRAIN_CUDA_WGMMA_BWD");
  *which = 2;
  if (!e || !*e) return MTRAIN_SUCCESS;
  if ((e[0] == '1' || e[0] == '2') && e[1] == '\0') {
    *which = e[0] - '0';
    return MTRAIN_SUCCESS;
  }
  return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                      "backend 'cuda': environment variable MTRAIN_CUDA_WGMMA_BWD='%s': expected 1 "
                      "(variant 3's first backward kernel, all threads loading) or 2 (the "
                      "warp-specialised kernel with a producer warpgroup, the default)",
                      e);
}

extern "C" mtrain_status_t cuda_wgmma_bwd(cuda_state_t *s, const cuda_step_t *st,
                                          const mtrain_bwd_step_args_t *a, float *dk_bar,
                                          float *dv_bar) {
  const bool bf16 = a->dtype == MTRAIN_BF16;
  if (st->d == 64)
    return bf16 ? wg::bwd_g<64, __nv_bfloat16>(s, st, a, dk_bar, dv_bar)
                : wg::bwd_g<64, __half>(s, st, a, dk_bar, dv_bar);
  return bf16 ? wg::bwd_g<128, __nv_bfloat16>(s, st, a, dk_bar, dv_bar)
              : wg::bwd_g<128, __half>(s, st, a, dk_bar, dv_bar);
}
