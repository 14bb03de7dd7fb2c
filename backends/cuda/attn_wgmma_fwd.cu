/* attn_wgmma_fwd.cu: the forward step of variant 3 (Hopper tensor cores,
 * sm_90a): cuda_wgmma_supports and cuda_wgmma_fwd. Variant 2's forward
 * (attn_mma2_fwd.cu) with the matrix products on warpgroup MMA
 * (wgmma.mma_async, attn_wgmma_ptx.cuh) and warp-specialised loads:
 *  - one CTA per (query head, query tile of BM = 64 * NWG rows): NWG
 *    consumer warpgroups of 4 warps, each owning 64 query rows (NWG = 2
 *    when G is a multiple of 128, else 1), and one producer warpgroup;
 *  - the producer walks the item's key tiles (runs, then bars 64 at a
 *    time) and copies each tile's K and V rows with cp.async into one of
 *    four stages, in the 128-byte-swizzle panel layout that wgmma reads
 *    through descriptors; mbarriers hand stages over (full: copies landed
 *    and the tile's descriptor published; empty: every consumer done), so
 *    the two warpgroups run at their own pace, without CTA barriers;
 *  - Q stays in registers as A fragments (loaded once with ldmatrix); per
 *    key tile S = Q K^T is 8 (d 128) or 8 half-width (d 64) wgmma reading
 *    K K-major, O += P V is 4 wgmma m64n{d}k16 with P from registers and V
 *    read N-major;
 *  - at d 64 the consumer loop is software-pipelined inside the warpgroup:
 *    S of tile n + 1 is issued before P V of tile n, and its softmax runs
 *    while P V is on the tensor cores (the producer publishes each tile as
 *    soon as it has landed, so that looking one tile ahead does not wait);
 *    at d 128 with two consumer warpgroups the second S fragment does not
 *    fit the registers, and the loop takes one tile at a time;
 *  - the masks, the online softmax in the log2 domain, the skipped O
 *    rescale and the epilogue's merge into o_acc / lse_acc are variant 2's.
 * The backward of variant 3 is attn_wgmma_bwd.cu. */
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
using mma::kLn2;
using mma::kLog2e;
using mma::ldsm_x4;
using mma::pack2;
using mma::smem_u32;
using mma2::contiguous_rows_n;
using mma2::KeyWalk2;
using mma2::kKT;
using mma2::KTile2;
using mma2::load_rows_n;
using mma2::load_rows_panel;
using mma2::LoadShape;

/* The forward kernel's CTA: NWG consumer warpgroups (64 query rows each)
 * and one producer warpgroup. Shared memory: kStages stages of (K, V) panel
 * tiles (stage x: K at 2 * TBK * x, V at + TBK); the Q tile (the layout
 * of attn_mma_common.cuh, read once with ldmatrix); the control block (per stage: the tile's
 * descriptor and the full / empty mbarriers). 1024 bytes of slack align
 * the base to the 128-byte swizzle's 1024-byte period. */
/* Producer threads: one warpgroup, so that 4 warps keep the copies of
 * up to two tiles in flight (a single warp could not feed the consumers). */
constexpr int kProducers = 128;

/* Stages of (K, V) tiles: the producer keeps three tiles in flight while
 * the consumers read a fourth. */
constexpr int kFwdStages = 4;

template <int D, int NWG> struct FwdShape {
  static constexpr int NC = 128 * NWG;  /* consumer threads */
  static constexpr int NP = kProducers; /* producer threads */
  static constexpr int NT = NC + NP;
  static constexpr int BM = 64 * NWG;
  static constexpr int TBK = kKT * D * 2;
  static constexpr int TBQ = BM * D * 2;
  static constexpr int kStages = kFwdStages;
  static constexpr int kQOff = kStages * 2 * TBK;
  static constexpr int kCtlOff = kQOff + TBQ;
  static constexpr int kSmem = kCtlOff + 256 + 1024;
  static_assert(TBK % 1024 == 0, "panel tiles keep the 1024-byte alignment");
  static_assert(mma2::fits_sm90(kSmem, 1), "shared memory per SM");
};

/* The control block: tile n of the walk sits in stage n % kStages; the
 * producer publishes its descriptor in tile[] and completes full[] (one
 * arrival per producer thread, after its copies have landed); the
 * consumers complete empty[] (NC arrivals) once their products have read
 * the stage. kind == 0 in a published descriptor ends the walk. */
struct FwdCtl {
  KTile2 tile[kFwdStages];
  uint64_t full[kFwdStages], empty[kFwdStages];
};
static_assert(sizeof(FwdCtl) <= 256, "control block");

/* Rows per producer thread of a 64-key tile: producer thread p handles
 * chunk p % 8 of tile rows p / 8 + (NP / 8) r (r < kPRows). */
constexpr int kPStep = LoadShape<kProducers, kKT>::kStep,
              kPRows = LoadShape<kProducers, kKT>::kRows;

/* The producer thread's rows of tile t; -1 past the valid keys. */
__device__ __forceinline__ void producer_rows(const cuda_step_t &st, const KTile2 &t,
                                              const KeyWalk2 &w, int p, int64_t (&rows)[kPRows]) {
  const int i0 = p >> 3;
  if (t.kind == 1) {
#pragma unroll
    for (int r = 0; r < kPRows; ++r) {
      const int i = i0 + kPStep * r;
      rows[r] = i < t.nvalid ? (int64_t)t.a + i : -1;
    }
  } else {
    const int32_t *sg = st.idx + w.segs, *bl = st.idx + w.bars;
    int cs = t.a, cb = t.b;
    mma::seg_walk(sg, w.s_end, cs, cb, i0);
#pragma unroll
    for (int r = 0; r < kPRows; ++r) {
      rows[r] = i0 + kPStep * r < t.nvalid ? (int64_t)bl[cb] : -1;
      if (r + 1 < kPRows) mma::seg_walk(sg, w.s_end, cs, cb, kPStep);
    }
  }
}

/* Issues S += Q K^T for a 64-key tile: NKS wgmma k-slices, Q's A
 * fragments from registers, K read K-major from the panel tile at sK. At
 * d = 64 each k-slice is two m64n32k16 (keys 0-31, 32-63), so that S and
 * O = P V (m64n64k16 there) are never products of the same shape: with
 * both m64n64k16, the H200 computed the second and later key tiles wrong
 * (deterministically; one tile was right), which a one-tile test with the
 * same instructions does not show; the cause was not found. */
template <int D, typename T>
__device__ __forceinline__ void qk_product(float (&s)[32], const uint32_t (&qf)[D / 16][4],
                                           uint32_t sK) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t kaddr = sK + (uint32_t)((kk >> 2) * kKT * 128 + (kk & 3) * 32);
    if constexpr (D == 128) {
      wgmma_m64n64k16<T, 0>(s, qf[kk], sw128_desc(kaddr, 16, 1024));
    } else {
      float(&lo)[16] = *reinterpret_cast<float(*)[16]>(&s[0]);
      float(&hi)[16] = *reinterpret_cast<float(*)[16]>(&s[16]);
      wgmma_m64n32k16<T, 0>(lo, qf[kk], sw128_desc(kaddr, 16, 1024));
      wgmma_m64n32k16<T, 0>(hi, qf[kk], sw128_desc(kaddr + 32 * 128, 16, 1024));
    }
  }
}

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
  constexpr int NO = D / 2;   /* O accumulators per thread (64 rows x D per warpgroup) */
  /* the software pipeline of the consumer loop (below) at d 64; at d 128
   * with two consumer warpgroups its second S fragment does not fit the 168
   * registers a thread has (ptxas serializes the wgmma, C7512) */
  constexpr bool kPipelined = D == 64;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

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

  if (tid >= NC) {
    const int p = tid - NC; /* producer thread */
    /* ---- producer warpgroup: walks the key tiles (every thread alike), loads
     * tile n into stage n % NST once the consumers released it, publishes
     * tile n - 2 once its copies have landed (three tiles in flight) ---- */
    KeyWalk2 w;
    w.init(st, h, qb, gq, qt * BM, rows_here);
    /* tile x's descriptor into the control block, then this thread's
     * arrival on full (release: its copies, and thread 0's descriptor) */
    auto publish = [&](int x, const KTile2 &d) {
      if (p == 0) ctl.tile[x % NST] = d;
      mbar_arrive(full0 + 8 * (x % NST));
    };
    KTile2 prev2, prev1; /* tiles n - 2 and n - 1, loaded, not yet published */
    prev2.kind = prev1.kind = 0;
    for (int n = 0;; ++n) {
      /* tile n - 2 first, before the wait for a free stage: it is published
       * as soon as it has landed, so the consumers, which look one tile ahead,
       * do not wait on the producer's wait for the stage of tile n */
      if (n >= 2) {
        cp_async_wait<1>();  /* tile n - 2 has landed (this thread's copies) */
        fence_proxy_async(); /* ... visible to wgmma's reads */
        publish(n - 2, prev2);
      }
      KTile2 t;
      const bool have = w.next(st, t);
      const int sn = n % NST;
      if (n >= NST)
        while (!mbar_try_wait(empty0 + 8 * sn, (uint32_t)((n / NST - 1) & 1))) {
        }
      if (have) {
        int64_t rows[kPRows];
        producer_rows(st, t, w, p, rows);
        const uint32_t sk = sKV + (uint32_t)(sn * 2 * TBK);
        load_rows_panel<D, kProducers, kKT>(sk, kbase, kv_stride, rows, p);
        load_rows_panel<D, kProducers, kKT>(sk + TBK, vbase, kv_stride, rows, p);
      }
      cp_async_commit();
      if (!have) {
        cp_async_wait<0>();  /* every tile has landed (this thread's copies) */
        fence_proxy_async(); /* ... visible to wgmma's reads */
        if (n >= 1) publish(n - 1, prev1);
        KTile2 end;
        end.kind = 0;
        publish(n, end);
        break;
      }
      prev2 = prev1;
      prev1 = t;
    }
    cp_async_wait<0>();
    return;
  }

  /* ---- consumer warpgroups ---- */
  const int g = lane >> 2, t4 = lane & 3;
  const int wgr0 = (warp >> 2) * 64; /* the warpgroup's first tile row */
  const int wr0 = warp * 16;         /* the warp's first tile row */
  const int64_t qrow0 = (int64_t)qb * st.G + (int64_t)qt * BM;
  {
    int64_t rows[LoadShape<NC, BM>::kRows];
    contiguous_rows_n<NC, BM>(rows, qrow0, rows_here, tid);
    load_rows_n<D, NC, BM>(sQ, q + (int64_t)h * D, (int64_t)st.Hq * D, rows, tid);
    cp_async_commit();
  }
  cp_async_wait<0>();
  named_barrier(1, NC);
  const mma::Frag<D> fr(lane);
  uint32_t qf[NKS][4];
#pragma unroll
  for (int kk = 0; kk < NKS; ++kk)
    ldsm_x4(sQ + fr.A(wr0, 2 * kk), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);

  /* o[4n + e]: C fragment of the warp's rows (e < 2: row g, else g + 8),
   * output columns 8n + 2 t4 + (e & 1). m[hh], l[hh]: running max (log2
   * domain, scale folded in) and the thread's partial sum of row
   * wr0 + 8 hh + g. */
  float o[NO];
#pragma unroll
  for (int x = 0; x < NO; ++x) o[x] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = st.scale * kLog2e;

  /* The tile's masked scores to probabilities in place (log2 domain, scale
   * folded in); the running max and sums move on, alpha[hh] is the factor
   * that O's row hh still needs. Returns whether a max of the warp changed. */
  auto softmax = [&](float(&s)[32], const KTile2 &t, float(&alpha)[2]) -> bool {
    /* masked scores -inf (raw scores; the scale is applied below) */
    if (t.nvalid < kKT || (t.causal && t.off + kKT - 1 > wr0)) {
#pragma unroll
      for (int x = 0; x < 32; ++x) {
        const int col = (x >> 2) * 8 + 2 * t4 + (x & 1);
        const int row = wr0 + g + (((x >> 1) & 1) << 3);
        if (col >= t.nvalid || (t.causal && col + t.off > row)) s[x] = -INFINITY;
      }
    }
    /* online softmax, row hh: s[4n + 2hh], s[4n + 2hh + 1] */
    bool changed = false;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < 8; ++c) mx = fmaxf(mx, fmaxf(s[4 * c + 2 * hh], s[4 * c + 2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mnew = fmaxf(m[hh], mx * sl2);
      changed |= mnew != m[hh];
      const float mu = mnew == -INFINITY ? 0.f : mnew; /* no key yet: exp2(-inf) = 0 */
      alpha[hh] = fast_exp2(m[hh] - mu);
      m[hh] = mnew;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        s[4 * c + 2 * hh] = fast_exp2(fmaf(s[4 * c + 2 * hh], sl2, -mu));
        s[4 * c + 2 * hh + 1] = fast_exp2(fmaf(s[4 * c + 2 * hh + 1], sl2, -mu));
        sum += s[4 * c + 2 * hh] + s[4 * c + 2 * hh + 1];
      }
      l[hh] = l[hh] * alpha[hh] + sum;
    }
    return __any_sync(0xffffffffu, changed);
  };
  /* O *= alpha (row-wise) */
  auto rescale = [&](const float(&alpha)[2]) {
#pragma unroll
    for (int c = 0; c < NO / 4; ++c) {
      o[4 * c] *= alpha[0];
      o[4 * c + 1] *= alpha[0];
      o[4 * c + 2] *= alpha[1];
      o[4 * c + 3] *= alpha[1];
    }
  };
  /* P's A fragment of k-slice j (keys 16j .. 16j + 15) packed from the C
   * fragments of key columns 16j.. and 16j + 8.. */
  uint32_t pa[4][4];
  auto pack_p = [&](const float(&s)[32]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      pa[j][0] = pack2<T>(s[8 * j], s[8 * j + 1]);
      pa[j][1] = pack2<T>(s[8 * j + 2], s[8 * j + 3]);
      pa[j][2] = pack2<T>(s[8 * j + 4], s[8 * j + 5]);
      pa[j][3] = pack2<T>(s[8 * j + 6], s[8 * j + 7]);
    }
  };
  /* waits for tile n's stage; false at the end of the walk */
  auto next_tile = [&](int n, KTile2 &t) -> bool {
    const int sn = n % NST;
    while (!mbar_try_wait(full0 + 8 * sn, (uint32_t)((n / NST) & 1))) {
    }
    t = ctl.tile[sn];
    return t.kind != 0;
  };
  auto stage_k = [&](int n) { return sKV + (uint32_t)((n % NST) * 2 * TBK); };
  auto zero_s = [&](float(&s)[32]) {
#pragma unroll
    for (int x = 0; x < 32; ++x) {
      s[x] = 0.f;
      reg_fence(s[x]); /* zeroed before the fence: zeroing sunk past it makes
                          ptxas serialize every wgmma of the kernel */
    }
  };

  float s[32];
  float alpha[2];
  if constexpr (kPipelined) {
    /* Software pipeline inside the warpgroup: while P_n V_n runs on the tensor
     * cores, the softmax of tile n + 1 (whose S was issued just before it)
     * runs on the other pipes. Per iteration: issue S_{n+1} = Q K_{n+1}^T,
     * issue O += P_n V_n, wait for S_{n+1}, softmax, wait for P_n V_n,
     * release stage n, rescale O, pack P_{n+1}. Every product is issued
     * unconditionally (a wgmma under a branch makes ptxas serialize all of
     * them, C7520): tiles that none of the warpgroup's rows reach are masked
     * to P = 0, and past the walk's end S reads a stale stage and is
     * dropped. */
    KTile2 t;
    bool have = next_tile(0, t);
    zero_s(s);
    wgmma_fence();
    qk_product<D, T>(s, qf, stage_k(0));
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int x = 0; x < 32; ++x) reg_fence(s[x]);
    if (have) {
      softmax(s, t, alpha); /* O is zero: nothing to rescale */
      pack_p(s);
    }
    for (int n = 0; have; ++n) {
      KTile2 t1;
      const bool have1 = next_tile(n + 1, t1);
      zero_s(s);
      wgmma_fence();
      qk_product<D, T>(s, qf, stage_k(n + 1)); /* S_{n+1} */
      wgmma_commit();
      wgmma_regs_by_rows64<D, T>(o, pa, stage_k(n) + TBK); /* O += P_n V_n */
      wgmma_commit();
      wgmma_wait<1>(); /* S_{n+1} done */
#pragma unroll
      for (int x = 0; x < 32; ++x) reg_fence(s[x]);
      bool changed = false;
      if (have1) changed = softmax(s, t1, alpha);
      wgmma_wait<0>(); /* P_n V_n done */
#pragma unroll
      for (int x = 0; x < NO; ++x) reg_fence(o[x]);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) reg_fence_u(pa[j][r]);
      mbar_arrive(empty0 + 8 * (n % NST)); /* this thread's reads of stage n are done */
      if (have1) {
        if (changed) rescale(alpha);
        pack_p(s);
      }
      have = have1;
    }
  } else {
    /* one tile at a time: S, softmax, P V, each product waited for */
    for (int n = 0;; ++n) {
      KTile2 t;
      if (!next_tile(n, t)) break;
      /* the warpgroup's 64 rows all padding, or all before the tile's keys
       * (uniform over the warpgroup, as wgmma requires) */
      const bool skip = wgr0 >= rows_here || (t.causal && t.off > wgr0 + 63);
      if (!skip) {
        zero_s(s);
        wgmma_fence();
        qk_product<D, T>(s, qf, stage_k(n));
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int x = 0; x < 32; ++x) reg_fence(s[x]);
        if (softmax(s, t, alpha)) rescale(alpha);
        pack_p(s);
        wgmma_fence();
        wgmma_regs_by_rows64<D, T>(o, pa, stage_k(n) + TBK); /* O += P V */
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int x = 0; x < NO; ++x) reg_fence(o[x]);
      }
      mbar_arrive(empty0 + 8 * (n % NST)); /* this thread's reads of the stage are done */
    }
  }

  /* merge the step's (lse_s, O / l) into the running values, row by row */
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float li = l[hh];
    li += __shfl_xor_sync(0xffffffffu, li, 1);
    li += __shfl_xor_sync(0xffffffffu, li, 2);
    const int row = wr0 + 8 * hh + g;
    const bool valid = row < rows_here;
    const int64_t gi = (qrow0 + row) * st.Hq + h;
    /* one read of the old LSE per row, broadcast over the row's 4 lanes,
     * so that lane t4 == 0's store below cannot race with a read */
    float lse_old = (valid && t4 == 0) ? lse_acc[gi] : 0.f;
    lse_old = __shfl_sync(0xffffffffu, lse_old, lane & ~3);
    if (valid && li > 0.f) {
      const float lse_s = (m[hh] + log2f(li)) * kLn2;
      const float inv = 1.f / li;
      float w_old, w_new;
      const float lse_new = merge_weights(lse_old, lse_s, &w_old, &w_new);
      const float a_new = w_new * inv;
      float *orow = o_acc + gi * D;
#pragma unroll
      for (int c = 0; c < NO / 4; ++c) {
        float2 *p = reinterpret_cast<float2 *>(orow + c * 8 + 2 * t4);
        float2 x = *p;
        x.x = w_old * x.x + a_new * o[4 * c + 2 * hh];
        x.y = w_old * x.y + a_new * o[4 * c + 2 * hh + 1];
        *p = x;
      }
      if (t4 == 0) lse_acc[gi] = lse_new;
    }
  }
#endif
}

/* ---- host side ---- */

template <int D, typename T, int NWG>
static mtrain_status_t launch_fwd(cuda_state_t *s, const cuda_step_t *st,
                                  const mtrain_fwd_step_args_t *a) {
  using S = FwdShape<D, NWG>;
  static cuda_smem_attr_t attr;
  return mma2::launch_fwd_kernel(s, wgmma_fwd_kernel<D, T, NWG>, "variant 3", "wgmma_fwd_kernel",
                                 cuda_q_items(st, S::BM), S::NT, S::kSmem, &attr, st, a);
}

template <int D, typename T>
static mtrain_status_t fwd_g(cuda_state_t *s, const cuda_step_t *st,
                             const mtrain_fwd_step_args_t *a) {
  /* 128-row tiles need G % 128 == 0: a tile never spans two blocks */
  return st->G % 128 == 0 ? launch_fwd<D, T, 2>(s, st, a) : launch_fwd<D, T, 1>(s, st, a);
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
