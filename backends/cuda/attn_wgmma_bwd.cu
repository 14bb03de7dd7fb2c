/* attn_wgmma_bwd.cu: the backward step of variant 3 (Hopper tensor cores,
 * sm_90a): cuda_wgmma_bwd. Variant 2's key-major dK/dV kernel
 * (attn_mma2_bwd.cu: the same items, query walk, masks and outputs) with
 * every matrix product on warpgroup MMA (wgmma.mma_async):
 *  - one CTA per key item of BN = 64 NWG keys (NWG = 2 consumer warpgroups
 *    when G is a multiple of 128, else 1), warpgroup w owning keys 64 w ..
 *    64 w + 63; K and V of the item stay in shared memory (panel layout of
 *    attn_wgmma_ptx.cuh), dK and dV in registers (wgmma accumulators);
 *  - 64-row (Q, dO, LSE, delta) query tiles stream through two cp.async
 *    stages, loaded one tile ahead by every thread;
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
 * Per (query i, key j): p = exp(scale q_i.k_j - lse_i), dp = dout_i.v_j,
 * ds = p (dp - delta_i); dq_i += scale ds k_j, dk_j += scale ds q_i,
 * dv_j += p dout_i. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "backends/cuda/attn_mma2.h"
#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/attn_wgmma.h"
#include "backends/cuda/attn_wgmma_ptx.cuh"
#include "backends/cuda/cuda_internal.h"

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
 * traffic, split evenly over the 8 warps. The barrier (id 2 + j, the two
 * warps j) orders the writes before the reads; the next write to xs comes
 * after the next iteration's CTA barrier, when both have read. */
template <int SEND, int KEEP>
__device__ __forceinline__ void dq_pair_exchange(float (&acc)[32], float4 *xs, int wgi, int wj,
                                                 int lane) {
  float4 *mine = xs + (wgi * 4 + wj) * 4 * 32 + lane;
  const float4 *theirs = xs + ((wgi ^ 1) * 4 + wj) * 4 * 32 + lane;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = SEND + j;
    mine[32 * j] = make_float4(acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3]);
  }
  named_barrier(2 + wj, 64);
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
  const bool bars = (int)blockIdx.x < st.num_bar_tiles;
  {
    QWalk2 qw;
    int hk, nk;
    int64_t row0;
    if (!kv_item_begin(st, BN, qw, hk, nk, row0)) return;
    if (tid == 0) ring.start(st, qw, row0, hk, nk, bars);
    __syncthreads();
    if (ring.d[0].h >= 0) {
      const int64_t kv_stride = (int64_t)st.Hkv * D;
      int64_t rows[LoadShape<NC, BN>::kRows];
      kv_item_rows<NC, BN>(rows, st, qw, row0, nk, tid);
      load_rows_panel<D, NC, BN>(sK, k + (int64_t)hk * D, kv_stride, rows, tid);
      load_rows_panel<D, NC, BN>(sV, v + (int64_t)hk * D, kv_stride, rows, tid);
    }
  }
  if (ring.d[0].h < 0 && !bars) return; /* no query tile sees these keys */

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

  /* epilogue: scale * dK and dV of the warpgroup's keys; bar items WRITE
   * their scratch rows (zeros where nothing contributed), run items add
   * into the dk_acc/dv_acc rows they own */
  const float sc = st.scale;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int kr = kw0 + wr + g + 8 * hh;
    if (kr < ring.nk) {
      float *dkr, *dvr;
      kv_out_rows(st, ring, kr, D, dk_acc, dv_acc, dk_bar, dv_bar, dkr, dvr);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int c = n * 8 + 2 * t4;
        store_pair(dkr + c, sc * dk[4 * n + 2 * hh], sc * dk[4 * n + 2 * hh + 1], !bars);
        store_pair(dvr + c, dv[4 * n + 2 * hh], dv[4 * n + 2 * hh + 1], !bars);
      }
    }
  }
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
                                FUSED ? "wgmma_bwd_kernel (fused dQ)" : "wgmma_bwd_kernel",
                                cuda_kv_items(st, S::BN), S::NC, S::kSmem, &attr, st, a, dk_bar,
                                dv_bar);
}

template <int D, typename T>
static mtrain_status_t bwd_g(cuda_state_t *s, const cuda_step_t *st,
                             const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar) {
  /* 128-key items need G % 128 == 0: an item never spans two blocks */
  const bool wide = st->G % 128 == 0;
  if (!s->deterministic)
    return wide ? launch_bwd<D, T, 2, true>(s, st, a, dk_bar, dv_bar)
                : launch_bwd<D, T, 1, true>(s, st, a, dk_bar, dv_bar);
  mtrain_status_t rc = cuda_mma2_bwd_dq(s, st, a);
  if (rc != MTRAIN_SUCCESS) return rc;
  return wide ? launch_bwd<D, T, 2, false>(s, st, a, dk_bar, dv_bar)
              : launch_bwd<D, T, 1, false>(s, st, a, dk_bar, dv_bar);
}

} /* namespace wg */

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
