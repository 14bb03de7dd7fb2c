/* attn_mma2_bwd.cu: the backward step of variant 2: cuda_mma2_bwd.
 *
 * Two paths (the contract of cuda_internal.h for dq_acc, dk_acc, dv_acc
 * and the bar scratch either way):
 *  - non-deterministic contexts (s->deterministic == 0): ONE fused key-major
 *    kernel, mma2_bwd_kv_kernel<FUSED = true>, which also produces dQ and
 *    adds it into dq_acc with fp32 vector reductions (red.global.add.v2.f32):
 *    5 matrix products per (query, key) tile pair instead of 7, at the
 *    price of an order-dependent dQ (last bits);
 *  - deterministic contexts: mma2_bwd_dq_kernel (query-major, dQ in
 *    registers, added into rows it owns) and mma2_bwd_kv_kernel<FUSED =
 *    false> (dK/dV only); no floating-point atomics.
 *
 * mma2_bwd_kv_kernel: one CTA of NW warps per key item of BN = 16 NW keys
 * (one launch: bar items first, then run items) keeps K, V of its keys in
 * shared memory and dK, dV in registers while it streams 64-row (Q, dO)
 * tiles through two cp.async stages (their LSE and delta through one
 * buffer, refilled once phase 1 has read it). Per query tile, in three
 * phases separated by barriers:
 *  1. S = Q K^T and dP = dO V^T on a 2 x (NW/2) grid of 32x32 warp tiles;
 *     P = exp2(S scale log2e - LSE log2e) and dS = P (dP - delta), masked,
 *     stored to shared memory as 16-bit [query][key] tiles (stmatrix);
 *  2. dV += P^T dO and dK += dS^T Q on an (NW/2) x 2 grid of (32 keys x d/2)
 *     warp tiles, P^T and dS^T read back with ldmatrix.trans (the warp's
 *     accumulators: 2 x 32 x d/2 floats, d floats a thread);
 *  3. (fused) dQ = dS K on a 2 x (NW/2) grid of (32 queries x 2d/NW) warp
 *     tiles, added into dq_acc with red.global.add.v2.f32.
 * With 32x32 warp tiles every fragment read from shared memory feeds two
 * MMA tiles (variant 1's 16-row warp tiles feed one): phases 1 and 2 read
 * 56 KB of shared memory per warp and 64x128 tile pair (d = 128, NW = 8)
 * where variant 1's dK/dV kernel reads 80 KB.
 * Items: a run item is (kv head hk, key tile kt of BN keys of local block
 * kb) over the (h, qb) entries that list kb; a bar item is one bar tile
 * (BN = 64) or two consecutive 64-bar tiles of one head (BN = 128,
 * bar_tiles_pair; the second tile's CTA exits at once). Bar items WRITE
 * their rows of dk_bar/dv_bar (zeros where nothing contributes); run items
 * add into the dk_acc/dv_acc rows they own.
 *
 * mma2_bwd_dq_kernel: variant 1's dQ kernel (dev/attn_mma_bwd.cu) with NW warps of 16 query rows
 * (128-row query tiles with NW = 8, each K/V tile serving twice the rows)
 * and the shared-memory walk of the forward (TileRing).
 *
 * Per (query i, key j): p = exp(scale q_i.k_j - lse_i), dp = dout_i.v_j,
 * ds = p (dp - delta_i); dq_i += scale ds k_j, dk_j += scale ds q_i,
 * dv_j += p dout_i. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "backends/cuda/attn_mma2.h"
#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/cuda_internal.h"

namespace mma2 {

static_assert(CUDA_BAR_TILE == kKT, "a bar tile is one 64-row key tile");

/* ---- deterministic dQ kernel (query-major) ---- */

template <int D, int NW> struct DqShape {
  static constexpr int NT = 32 * NW, BM = 16 * NW;
  static constexpr int TBK = kKT * D * 2, TBQ = BM * D * 2;
  /* Q tile, dO tile, two stages of (K, V), the walk */
  static constexpr int kRingOff = 2 * TBQ + 4 * TBK;
  static constexpr int kSmem = kRingOff + kRingBytes;
  static constexpr int kMinBlocks = NW == 8 ? 1 : 2;
  static_assert(fits_sm90(kSmem, kMinBlocks), "shared memory per SM");
};

template <int D, typename T, int NW>
__global__ void __launch_bounds__(32 * NW, DqShape<D, NW>::kMinBlocks)
    mma2_bwd_dq_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                       const T *__restrict__ v, const T *__restrict__ dout,
                       const float *__restrict__ lse_acc, const float *__restrict__ delta_acc,
                       float *__restrict__ dq_acc) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = DqShape<D, NW>;
  constexpr int NT = S::NT, BM = S::BM, TBK = S::TBK, TBQ = S::TBQ;
  constexpr int NKS = D / 16, NDT = D / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  QItem item; /* heaviest (last) query tiles first, the heads of one tile together */
  if (!q_item_begin<BM>(st, item)) return;
  const int h = item.h, qb = item.qb, qt = item.qt, rows_here = item.rows;
  TileRing &ring = *reinterpret_cast<TileRing *>(smem + S::kRingOff);
  if (tid == 0) ring.start(st, item, BM);
  __syncthreads();
  if (ring.d[0].kind == 0) return;

  const int hk = h / st.group;
  const int64_t q_stride = (int64_t)st.Hq * D, kv_stride = (int64_t)st.Hkv * D;
  const T *kbase = k + (int64_t)hk * D, *vbase = v + (int64_t)hk * D;
  const int64_t qrow0 = (int64_t)qb * st.G + (int64_t)qt * BM;
  const uint32_t s0 = smem_u32(smem);
  const uint32_t sQ = s0, sO = s0 + TBQ, sKV = s0 + 2 * TBQ; /* stage x at sKV + 2*TBK*x */
  const Frag<D> fr(lane);

  {
    int64_t rows[LoadShape<NT, BM>::kRows];
    contiguous_rows_n<NT, BM>(rows, qrow0, rows_here, tid);
    load_rows_n<D, NT, BM>(sQ, q + (int64_t)h * D, q_stride, rows, tid);
    load_rows_n<D, NT, BM>(sO, dout + (int64_t)h * D, q_stride, rows, tid);
  }
  ring.load<D, NT>(st, sKV, sKV + TBK, kbase, vbase, kv_stride, ring.d[0], tid);
  cp_async_commit();

  /* the thread's two rows (row_a, row_a + 8): LSE in the log2 domain (+inf
   * on padding rows so that their P is 0) and delta */
  const int wr0 = warp * 16, row_a = wr0 + g;
  float lse2[2], dl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_a + 8 * i;
    const int64_t gi = (qrow0 + row) * st.Hq + h;
    lse2[i] = row < rows_here ? lse_acc[gi] * kLog2e : INFINITY;
    dl[i] = row < rows_here ? delta_acc[gi] : 0.f;
  }
  float dq[NDT][4];
#pragma unroll
  for (int n = 0; n < NDT; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
  const float sl2 = st.scale * kLog2e;

  int it = 0;
  for (;;) {
    cp_async_wait<0>();
    __syncthreads();
    const int slot = it % 3, slot1 = slot == 2 ? 0 : slot + 1;
    const KTile2 nxt = ring.d[slot1];
    const bool more = nxt.kind != 0;
    const int stage = it & 1;
    if (more) {
      const uint32_t sn = sKV + (uint32_t)((stage ^ 1) * 2 * TBK);
      ring.load<D, NT>(st, sn, sn + TBK, kbase, vbase, kv_stride, nxt, tid);
      cp_async_commit();
      if (tid == 0) ring.produce(st, slot1 == 2 ? 0 : slot1 + 1);
    }
    const int c_nvalid = ring.d[slot].nvalid, c_causal = ring.d[slot].causal;
    const int c_off = ring.d[slot].off;
    const uint32_t sK = sKV + (uint32_t)(stage * 2 * TBK), sV = sK + TBK;
    const bool skip = BM > kKT && (wr0 >= rows_here || (c_causal && c_off > wr0 + 15));
    if (!skip) {
      /* S = Q K^T, then P (in place) */
      float p[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n) p[n][0] = p[n][1] = p[n][2] = p[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < NKS; ++kk) {
        uint32_t a[4];
        ldsm_x4(sQ + fr.A(wr0, 2 * kk), a[0], a[1], a[2], a[3]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sK + fr.B(np * 16, 2 * kk), b0, b1, b2, b3);
          mma16816<T>(p[2 * np], a, b0, b1);
          mma16816<T>(p[2 * np + 1], a, b2, b3);
        }
      }
      const bool need_mask = c_nvalid < kKT || (c_causal && c_off + kKT - 1 > wr0);
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float x = fast_exp2(fmaf(p[n][j], sl2, -lse2[j >> 1]));
          if (need_mask) {
            const int col = n * 8 + 2 * t4 + (j & 1), row = row_a + ((j >> 1) << 3);
            if (col >= c_nvalid || (c_causal && col + c_off > row)) x = 0.f;
          }
          p[n][j] = x;
        }

      /* dP = dO V^T, then dS = P (dP - delta) (in place) */
      float ds[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n) ds[n][0] = ds[n][1] = ds[n][2] = ds[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < NKS; ++kk) {
        uint32_t a[4];
        ldsm_x4(sO + fr.A(wr0, 2 * kk), a[0], a[1], a[2], a[3]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sV + fr.B(np * 16, 2 * kk), b0, b1, b2, b3);
          mma16816<T>(ds[2 * np], a, b0, b1);
          mma16816<T>(ds[2 * np + 1], a, b2, b3);
        }
      }
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) ds[n][j] = p[n][j] * (ds[n][j] - dl[j >> 1]);

          /* dQ += dS K: k-slice j = keys 16j..16j+15, K B fragments by .trans */
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a[4];
        pack_a<T>(a, ds[2 * j], ds[2 * j + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(sK + fr.A(16 * j, 2 * dp), b0, b1, b2, b3);
          mma16816<T>(dq[2 * dp], a, b0, b1);
          mma16816<T>(dq[2 * dp + 1], a, b2, b3);
        }
      }
    }
    if (!more) break;
    ++it;
  }

  const float sc = st.scale;
  const int64_t e_row0 = ring.row0;
  const int e_rows = ring.rows, e_h = ring.h;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_a + 8 * i;
    if (row < e_rows) {
      float *dqr = dq_acc + ((e_row0 + row) * st.Hq + e_h) * D;
#pragma unroll
      for (int n = 0; n < NDT; ++n) {
        float2 *ptr = reinterpret_cast<float2 *>(dqr + n * 8 + 2 * t4);
        float2 x = *ptr;
        x.x += sc * dq[n][2 * i];
        x.y += sc * dq[n][2 * i + 1];
        *ptr = x;
      }
    }
  }
}

/* ---- key-major dK/dV kernel (fused dQ optional) ---- */

template <int D, int NW> struct KvShape {
  static_assert(NW == 4 || NW == 8, "4 or 8 warps");
  static constexpr int NT = 32 * NW, BN = 16 * NW;
  static constexpr int TBK = BN * D * 2;   /* the K (or V) tile */
  static constexpr int TBQ = kKT * D * 2;  /* a streamed Q (or dO) tile */
  static constexpr int SB = 2 * TBQ;       /* stage: Q, dO */
  static constexpr int TBP = kKT * BN * 2; /* the P (or dS) tile */
  /* K, V, two stages of (Q, dO), one LSE[64] + delta[64] buffer (read by
   * phase 1 only, refilled after the mid-iteration barrier), P, dS, the
   * walk: 115456 bytes at d = 128 with 4 warps, so that two CTAs fit an
   * SM's 228 KB with their 1 KB reserve each */
  static constexpr int kStageOff = 2 * TBK;
  static constexpr int kLdOff = kStageOff + 2 * SB;
  static constexpr int kPOff = kLdOff + 2 * kKT * 4;
  static constexpr int kRingOff = kPOff + 2 * TBP;
  static constexpr int kSmem = kRingOff + kRingBytesQ;
  static constexpr int DQW = 2 * D / NW; /* dQ columns of a warp (phase 3) */
  /* a thread holds d dK/dV floats and 64 S/dP floats: 8 warps, one CTA */
  static constexpr int kMinBlocks = NW == 8 ? 1 : 2;
  static_assert(fits_sm90(kSmem, kMinBlocks), "shared memory per SM");
};

/* Issues the loads of query tile t: Q and dO into the stage at ss. */
template <int D, int NT, typename T>
__device__ __forceinline__ void load_q_tile(uint32_t ss, const cuda_step_t &st, const T *q,
                                            const T *dout, const QTile2 &t, int tid) {
  constexpr int TBQ = kKT * D * 2;
  const int64_t stride = (int64_t)st.Hq * D;
  int64_t rows[LoadShape<NT, kKT>::kRows];
  contiguous_rows_n<NT, kKT>(rows, t.row0, t.nvalid, tid);
  load_rows_n<D, NT, kKT>(ss, q + (int64_t)t.h * D, stride, rows, tid);
  load_rows_n<D, NT, kKT>(ss + TBQ, dout + (int64_t)t.h * D, stride, rows, tid);
}

template <int D, typename T, int NW, bool FUSED>
__global__ void __launch_bounds__(32 * NW, KvShape<D, NW>::kMinBlocks)
    mma2_bwd_kv_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                       const T *__restrict__ v, const T *__restrict__ dout,
                       const float *__restrict__ lse_acc, const float *__restrict__ delta_acc,
                       float *__restrict__ dq_acc, float *__restrict__ dk_acc,
                       float *__restrict__ dv_acc, float *__restrict__ dk_bar,
                       float *__restrict__ dv_bar) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = KvShape<D, NW>;
  constexpr int NT = S::NT, BN = S::BN, TBK = S::TBK, TBQ = S::TBQ, SB = S::SB;
  constexpr int NKS = D / 16;
  constexpr int DH = D / 2;   /* phase 2: d columns of a warp */
  constexpr int DQW = S::DQW; /* phase 3: d columns of a warp */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  QRing &ring = *reinterpret_cast<QRing *>(smem + S::kRingOff);

  /* the item (uniform over the CTA) */
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
    /* K and V rows of the item: the bars (bar_list[b0 + i]) or a run tile */
    if (ring.d[0].h >= 0) {
      const int64_t kv_stride = (int64_t)st.Hkv * D;
      int64_t rows[LoadShape<NT, BN>::kRows];
      kv_item_rows<NT, BN>(rows, st, qw, row0, nk, tid);
      const uint32_t s0 = smem_u32(smem);
      load_rows_n<D, NT, BN>(s0, k + (int64_t)hk * D, kv_stride, rows, tid);
      load_rows_n<D, NT, BN>(s0 + TBK, v + (int64_t)hk * D, kv_stride, rows, tid);
    }
  }
  /* no query tile sees this key tile (bar items and parts write zeros) */
  if (ring.d[0].h < 0 && !bars && !ring.part) return;

  /* warp tiles: phase 1 (S, dP) rows qw0 + 16i, keys cw0 + 8n; phase 2 (dK,
   * dV) keys kw0 + 16i, d columns dw0 + 8n; phase 3 (dQ) rows qw0 + 16i, d
   * columns qdw0 + 8n */
  const int qw0 = 32 * (warp & 1), cw0 = 32 * (warp >> 1), qdw0 = DQW * (warp >> 1);
  const int kw0 = 32 * (warp >> 1), dw0 = DH * (warp & 1);
  float dk[2][DH / 8][4], dv[2][DH / 8][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int n = 0; n < DH / 8; ++n) {
      dk[i][n][0] = dk[i][n][1] = dk[i][n][2] = dk[i][n][3] = 0.f;
      dv[i][n][0] = dv[i][n][1] = dv[i][n][2] = dv[i][n][3] = 0.f;
    }

  if (ring.d[0].h >= 0) {
    const uint32_t s0 = smem_u32(smem);
    const uint32_t sK = s0, sV = s0 + TBK, sS = s0 + S::kStageOff; /* stage x at sS + SB*x */
    const uint32_t sP = s0 + S::kPOff, sdS = sP + S::TBP;
    /* fragment addressing: tiles of d columns (K, V, Q, dO), tiles of BN
     * columns (P, dS), and the warp-dependent column bases (FragC) */
    const Frag<D> fd(lane);
    const Frag<BN> fp(lane);
    const FragC<BN, 2, true> f_pst(lane, cw0 / 8);                      /* P, dS stores */
    const FragC<BN, 2, false> f_pt(lane, kw0 / 8);                      /* P^T, dS^T */
    const FragC<D, DH / 16 < 4 ? DH / 16 : 4, true> f_o(lane, dw0 / 8); /* dO, Q (.trans) */
    const FragC<D, DQW / 16, true> f_k(lane, qdw0 / 8);                 /* K (.trans) */
    const uint32_t sL = s0 + S::kLdOff;
    {
      const QTile2 t0 = ring.d[0];
      load_q_tile<D, NT>(sS, st, q, dout, t0, tid);
      load_ld(sL, st, lse_acc, delta_acc, t0, tid);
    }
    cp_async_commit();
    const float sl2 = st.scale * kLog2e;

    int it = 0; /* query tile index: ring slot it % 3, stage it % 2 */
    for (;;) {
      cp_async_wait<0>(); /* tile it has landed (this thread's part) */
      __syncthreads();    /* ... every thread's; the other stage, P and dS are free */
      const int slot = it % 3, slot1 = slot == 2 ? 0 : slot + 1;
      const int stage = it & 1;
      const bool more = ring.d[slot1].h >= 0;
      if (more) {
        const QTile2 nx = ring.d[slot1];
        load_q_tile<D, NT>(sS + (uint32_t)((stage ^ 1) * SB), st, q, dout, nx, tid);
        cp_async_commit();
        if (tid == 0) ring.produce(st, slot1 == 2 ? 0 : slot1 + 1);
      }
      const uint32_t sQ = sS + (uint32_t)(stage * SB), sO = sQ + TBQ;
      const float *lse_t = reinterpret_cast<const float *>(smem + S::kLdOff);
      const float *del_t = lse_t + kKT;

      /* ---- phase 1: P and dS of rows qw0.., keys cw0.. ---- */
      {
        const int c_nvalid = ring.d[slot].nvalid, c_causal = ring.d[slot].causal;
        const int c_off = ring.d[slot].off, c_jlo = ring.d[slot].jlo, c_jhi = ring.d[slot].jhi;
        float sp[2][4][4], dp[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) sp[i][n][j] = dp[i][n][j] = 0.f;
        const bool skip = cw0 >= c_jhi || cw0 + 32 <= c_jlo || qw0 >= c_nvalid ||
                          (c_causal && cw0 + c_off > qw0 + 31);
        if (!skip) {
#pragma unroll
          for (int kk = 0; kk < NKS; ++kk) {
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
              ldsm_x4(sQ + fd.A(qw0 + 16 * i, 2 * kk), a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
              uint32_t b0, b1, b2, b3;
              ldsm_x4(sK + fd.B(cw0 + 16 * np, 2 * kk), b0, b1, b2, b3);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                mma16816<T>(sp[i][2 * np], a[i], b0, b1);
                mma16816<T>(sp[i][2 * np + 1], a[i], b2, b3);
              }
            }
          }
          const bool need_mask = qw0 + 32 > c_nvalid || cw0 < c_jlo || cw0 + 32 > c_jhi ||
                                 (c_causal && cw0 + 31 + c_off > qw0);
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int row = qw0 + 16 * i + 8 * hh + g;
              const float L = lse_t[row] * kLog2e;
#pragma unroll
              for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                  float x = fast_exp2(fmaf(sp[i][n][2 * hh + jj], sl2, -L));
                  if (need_mask) {
                    const int col = cw0 + 8 * n + 2 * t4 + jj;
                    if (row >= c_nvalid || col < c_jlo || col >= c_jhi ||
                        (c_causal && col + c_off > row))
                      x = 0.f;
                  }
                  sp[i][n][2 * hh + jj] = x;
                }
            }
#pragma unroll
          for (int kk = 0; kk < NKS; ++kk) {
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
              ldsm_x4(sO + fd.A(qw0 + 16 * i, 2 * kk), a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
              uint32_t b0, b1, b2, b3;
              ldsm_x4(sV + fd.B(cw0 + 16 * np, 2 * kk), b0, b1, b2, b3);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                mma16816<T>(dp[i][2 * np], a[i], b0, b1);
                mma16816<T>(dp[i][2 * np + 1], a[i], b2, b3);
              }
            }
          }
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const float Dl = del_t[qw0 + 16 * i + 8 * hh + g];
#pragma unroll
              for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int jj = 0; jj < 2; ++jj)
                  dp[i][n][2 * hh + jj] = sp[i][n][2 * hh + jj] * (dp[i][n][2 * hh + jj] - Dl);
            }
        }
        /* P and dS as 16-bit [query][key] tiles (zeros where skipped) */
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            uint32_t r[4];
            pack_a<T>(r, sp[i][2 * np], sp[i][2 * np + 1]);
            stsm_x4(sP + f_pst.at(qw0 + 16 * i, np), r[0], r[1], r[2], r[3]);
            pack_a<T>(r, dp[i][2 * np], dp[i][2 * np + 1]);
            stsm_x4(sdS + f_pst.at(qw0 + 16 * i, np), r[0], r[1], r[2], r[3]);
          }
      }
      __syncthreads(); /* P and dS complete; LSE and delta read */
      if (more) {
        const QTile2 nx = ring.d[slot1];
        load_ld(sL, st, lse_acc, delta_acc, nx, tid);
        cp_async_commit();
      }

      /* ---- phase 2: dV += P^T dO, dK += dS^T Q (keys kw0.., d dw0..) ---- */
      {
        const int c_nvalid = ring.d[slot].nvalid, c_jlo = ring.d[slot].jlo;
        const int c_jhi = ring.d[slot].jhi;
        /* query rows that can reach the warp's keys: [rlo, nvalid) */
        const int rlo = ring.d[slot].causal ? max(0, kw0 + ring.d[slot].off) : 0;
        const bool skip = kw0 >= c_jhi || kw0 + 32 <= c_jlo || rlo >= c_nvalid;
        if (!skip) {
#pragma unroll
          for (int jq = 0; jq < kKT / 16; ++jq) {
            if (16 * jq + 15 < rlo || 16 * jq >= c_nvalid) continue;
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
              ldsm_x4_t(sP + f_pt.at(16 * jq, i), a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
            for (int dq2 = 0; dq2 < DH / 16; ++dq2) {
              uint32_t b0, b1, b2, b3;
              ldsm_x4_t(sO + f_o.at(16 * jq, dq2 % 4) + (dq2 / 4) * 128, b0, b1, b2, b3);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                mma16816<T>(dv[i][2 * dq2], a[i], b0, b1);
                mma16816<T>(dv[i][2 * dq2 + 1], a[i], b2, b3);
              }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
              ldsm_x4_t(sdS + f_pt.at(16 * jq, i), a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
            for (int dq2 = 0; dq2 < DH / 16; ++dq2) {
              uint32_t b0, b1, b2, b3;
              ldsm_x4_t(sQ + f_o.at(16 * jq, dq2 % 4) + (dq2 / 4) * 128, b0, b1, b2, b3);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                mma16816<T>(dk[i][2 * dq2], a[i], b0, b1);
                mma16816<T>(dk[i][2 * dq2 + 1], a[i], b2, b3);
              }
            }
          }
        }
      }

      /* ---- phase 3 (fused): dQ = dS K for rows qw0.., d columns qdw0.. ---- */
      if constexpr (FUSED) {
        const int c_nvalid = ring.d[slot].nvalid, c_jlo = ring.d[slot].jlo;
        /* keys that can reach the warp's rows: [jlo, khi) */
        const int khi = ring.d[slot].causal ? min(ring.d[slot].jhi, qw0 + 32 - ring.d[slot].off)
                                            : ring.d[slot].jhi;
        const bool skip = qw0 >= c_nvalid || c_jlo >= khi;
        if (!skip) {
          float acc[2][DQW / 8][4];
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int n = 0; n < DQW / 8; ++n)
              acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.f;
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) {
            if (16 * kk >= khi || 16 * kk + 16 <= c_jlo) continue;
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i)
              ldsm_x4(sdS + fp.A(qw0 + 16 * i, 2 * kk), a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
            for (int dq2 = 0; dq2 < DQW / 16; ++dq2) {
              uint32_t b0, b1, b2, b3;
              ldsm_x4_t(sK + f_k.at(16 * kk, dq2), b0, b1, b2, b3);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                mma16816<T>(acc[i][2 * dq2], a[i], b0, b1);
                mma16816<T>(acc[i][2 * dq2 + 1], a[i], b2, b3);
              }
            }
          }
          const float sc = st.scale;
          const int64_t row0 = ring.d[slot].row0;
          const int hq = ring.d[slot].h;
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int row = qw0 + 16 * i + 8 * hh + g;
              if (row < c_nvalid) {
                float *dqr = dq_acc + ((row0 + row) * st.Hq + hq) * D + qdw0 + 2 * t4;
#pragma unroll
                for (int n = 0; n < DQW / 8; ++n)
                  red_add_v2(dqr + 8 * n, sc * acc[i][n][2 * hh], sc * acc[i][n][2 * hh + 1]);
              }
            }
        }
      }
      if (!more) break;
      ++it;
    }
  }

  /* epilogue: scale * dK and dV of the warp's keys; bar items and parts of
   * split items WRITE their scratch rows (zeros where nothing contributed),
   * run items add into the dk_acc/dv_acc rows they own */
  const float sc = st.scale;
  const bool add = !bars && !ring.part;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int kr = kw0 + 16 * i + 8 * hh + g;
      if (kr < ring.nk) {
        float *dkr, *dvr;
        kv_out_rows(st, ring, kr, D, dk_acc, dv_acc, dk_bar, dv_bar, dkr, dvr);
#pragma unroll
        for (int n = 0; n < DH / 8; ++n) {
          const int c = dw0 + n * 8 + 2 * t4;
          store_pair(dkr + c, sc * dk[i][n][2 * hh], sc * dk[i][n][2 * hh + 1], add);
          store_pair(dvr + c, dv[i][n][2 * hh], dv[i][n][2 * hh + 1], add);
        }
      }
    }
}

/* ---- the long-item split of the key-major backward ----
 *
 * Two kinds of key-major item walk far more entries than the others, and
 * the whole launch waits on them: a bar item (a tile of vertical keys) walks
 * every query block after its first bar, up to all of them, and a
 * block-sparse pattern's "sink" key block walks group x (query blocks)
 * entries where the others walk a handful. kv_split_schedule_kernel (one
 * CTA, queued before the key-major launch; it reads bt_off and kv_off on the
 * device, so that a plan built on the device needs no read-back) cuts every
 * item, bar or run, of more than C entries into ceil(len / C) parts of
 * consecutive entries, C = max(C_MIN, ceil(W / (2 SMs))), W = the items'
 * total work in entries (tiles per block x the run entries, plus the bar
 * items' entries: an entry is one query block either way). Why C is bounded
 * below by W / (2 SMs): a split item has len > C, so its extra parts number
 * ceil(len / C) - 1 < len / C, and over all items fewer than W / C <= 2 SMs;
 * the host sizes the grid without reading anything back (bar tiles + run
 * items + 2 SMs + 1, CTAs past the parts exit at once), and the parts of
 * split items, at most ceil(len / C) <= 2 len / C each, need at most 2 W / C
 * <= 4 SMs scratch slots of BN rows (the scratch bound). C_MIN keeps a part
 * long enough to pay for its K/V loads and its scratch rows.
 * The work list keeps the grid's item order, bar items first (parts of one
 * item next to each other, entry ranges ascending); an unsplit item keeps
 * slot -1 and writes its bar scratch rows or adds into dk_acc/dv_acc as
 * before; a part WRITES its rows to its slot (slots ascending along the
 * list), and kv_split_reduce_kernel takes, per split item, the sum of its
 * parts in part order and adds it into the run item's rows or writes it to
 * the bar item's scratch rows: the same bits every run whichever CTA
 * finishes first (deterministic mode). */
constexpr int kSplitThreads = 512; /* the emulator runs at most 512 */

/* Item u of the work list's order (bar tiles [0, num_bar_tiles), then the
 * run items): its entry range [e0, e0 + len); len 0 for the second tile of
 * a bar pair (walked with the first) and for nothing to walk. */
__device__ __forceinline__ int kv_item_len(const cuda_step_t &st, int BN, unsigned u, int &e0) {
  if ((int)u < st.num_bar_tiles) {
    const int t = (int)u;
    e0 = st.bt_off[t];
    if (BN == 128 && bar_tiles_pair(st, t - 1)) return 0;
    return st.bt_off[BN == 128 && bar_tiles_pair(st, t) ? t + 2 : t + 1] - e0;
  }
  int hk, kb, kt, x;
  kv_run_item(st, BN, u - (unsigned)st.num_bar_tiles, hk, kb, kt, x);
  e0 = st.kv_off[x];
  return st.kv_off[x + 1] - e0;
}

/* One CTA of kSplitThreads threads, 3 kSplitThreads int32 of dynamic shared
 * memory: the work list of a launch of BN-key items into `work` (header
 * CUDA_KV_WORK_HEADER int32: parts, slots, C, split items; then per part
 * (item, e0, e1, slot), item < num_bar_tiles a bar tile, else
 * num_bar_tiles + the run item). Thread t takes a contiguous range of
 * items; one exclusive scan of the threads' part and slot counts orders the
 * list. The second tile of a bar pair gets no part. */
__global__ void __launch_bounds__(kSplitThreads)
    kv_split_schedule_kernel(const cuda_step_t st, int BN, int cmin, int num_sms,
                             int32_t *__restrict__ work) {
  extern __shared__ __align__(128) unsigned char smem[];
  int *s_parts = reinterpret_cast<int *>(smem), *s_slots = s_parts + kSplitThreads;
  int *s_split = s_slots + kSplitThreads;
  const int tid = threadIdx.x;
  const int tpb = st.G / BN;
  const int nbt = st.num_bar_tiles;
  const int n = nbt + st.num_k_blocks * tpb * st.Hkv;
  const int nx = st.Hkv * st.num_k_blocks;
  const int64_t W = (int64_t)tpb * (st.kv_off[nx] - st.kv_off[0]) +
                    (nbt > 0 ? (int64_t)(st.bt_off[nbt] - st.bt_off[0]) : 0);
  const int64_t c2 = (W + 2 * (int64_t)num_sms - 1) / (2 * (int64_t)num_sms);
  const int C = (int)(c2 > cmin ? c2 : (int64_t)cmin);
  const int per = (n + kSplitThreads - 1) / kSplitThreads;
  const int a = min(n, tid * per), b = min(n, a + per);
  int np = 0, ns = 0, nsplit = 0;
  for (int u = a; u < b; ++u) {
    int e0;
    const int len = kv_item_len(st, BN, (unsigned)u, e0);
    if (u < nbt && BN == 128 && bar_tiles_pair(st, u - 1)) continue; /* no part */
    if (len > C) {
      const int k = (len + C - 1) / C;
      np += k;
      ns += k;
      ++nsplit;
    } else {
      ++np;
    }
  }
  s_parts[tid] = np;
  s_slots[tid] = ns;
  s_split[tid] = nsplit;
  __syncthreads();
  if (tid == 0) {
    int p = 0, q = 0, r = 0;
    for (int t = 0; t < kSplitThreads; ++t) {
      const int x = s_parts[t], y = s_slots[t];
      s_parts[t] = p;
      s_slots[t] = q;
      p += x;
      q += y;
      r += s_split[t];
    }
    work[0] = p;
    work[1] = q;
    work[2] = C;
    work[3] = r;
  }
  __syncthreads();
  int p = s_parts[tid], sl = s_slots[tid];
  for (int u = a; u < b; ++u) {
    int e0;
    const int len = kv_item_len(st, BN, (unsigned)u, e0);
    if (u < nbt && BN == 128 && bar_tiles_pair(st, u - 1)) continue;
    const int k = len > C ? (len + C - 1) / C : 1;
    for (int j = 0; j < k; ++j, ++p) {
      int32_t *w = work + CUDA_KV_WORK_HEADER + 4 * (size_t)p;
      w[0] = u;
      w[1] = e0 + j * C;
      w[2] = k > 1 ? min(e0 + (j + 1) * C, e0 + len) : e0 + len;
      w[3] = k > 1 ? sl++ : -1;
    }
  }
}

/* One CTA per work-list entry (the launch's bound; CTAs past the parts
 * exit): the CTA of a split item's first part takes, element by element, the
 * sum of its parts' rows in part order (p0 + p1 + ...: a fixed order, so the
 * same bits every run) and adds it into a run item's dk_acc / dv_acc rows,
 * or writes it to a bar item's scratch rows dk_bar / dv_bar. */
__global__ void __launch_bounds__(kSplitThreads)
    kv_split_reduce_kernel(const cuda_step_t st, int BN, float *__restrict__ dk_acc,
                           float *__restrict__ dv_acc, float *__restrict__ dk_bar,
                           float *__restrict__ dv_bar) {
  const int32_t *wl = st.kv_work;
  const int P = wl[0], w = blockIdx.x;
  if (w >= P) return;
  const int32_t *e = wl + CUDA_KV_WORK_HEADER + 4 * (size_t)w;
  if (e[3] < 0) return;               /* not split */
  if (w > 0 && e[-4] == e[0]) return; /* not the item's first part */
  const bool bars = e[0] < st.num_bar_tiles;
  int64_t row0;
  int hk = 0, nk;
  if (bars) {
    const int t = e[0];
    const int32_t *bt = st.bt_tile + 3 * t;
    const int b_end = BN == 128 && bar_tiles_pair(st, t) ? bt[5] : bt[2];
    nk = min(BN, b_end - bt[1]);
    row0 = st.head_meta[(int64_t)bt[0] * CUDA_HM_STRIDE + CUDA_HM_BAR_BASE] + bt[1];
  } else {
    int kb, kt, x;
    kv_run_item(st, BN, (unsigned)(e[0] - st.num_bar_tiles), hk, kb, kt, x);
    const int nc = block_rows_dev(st.k_tokens, st.G, kb, st.k_block_global[kb], st.seq_len);
    nk = min(BN, nc - kt * BN);
    row0 = (int64_t)kb * st.G + (int64_t)kt * BN;
  }
  if (nk <= 0) return; /* the kernel wrote nothing either */
  int m = 1;
  while (w + m < P && e[4 * m] == e[0]) ++m;
  const int D = st.d;
  for (int i = threadIdx.x; i < nk * D; i += kSplitThreads) {
    const int r = i / D, c = i - r * D;
    float sk = 0.f, sv = 0.f;
    for (int j = 0; j < m; ++j) {
      const int64_t src = ((int64_t)e[4 * j + 3] * BN + r) * D + c;
      sk += st.kv_dk_part[src];
      sv += st.kv_dv_part[src];
    }
    if (bars) {
      const int64_t dst = (row0 + r) * D + c;
      dk_bar[dst] = sk;
      dv_bar[dst] = sv;
    } else {
      const int64_t dst = ((row0 + r) * st.Hkv + hk) * D + c;
      dk_acc[dst] += sk;
      dv_acc[dst] += sv;
    }
  }
}

/* ---- host side ---- */

template <int D, typename T, int NW>
static mtrain_status_t launch_dq(cuda_state_t *s, const cuda_step_t *st,
                                 const mtrain_bwd_step_args_t *a) {
  using S = DqShape<D, NW>;
  static cuda_smem_attr_t attr;
  return launch_dq_kernel(s, mma2_bwd_dq_kernel<D, T, NW>, "variant 2", "mma2_bwd_dq_kernel",
                          cuda_q_items(st, S::BM), S::NT, S::kSmem, &attr, st, a);
}

template <int D, typename T, int NW, bool FUSED>
static mtrain_status_t launch_kv(cuda_state_t *s, const cuda_step_t *st,
                                 const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar) {
  using S = KvShape<D, NW>;
  static cuda_smem_attr_t attr;
  /* one launch: the bar items, then the run key tiles */
  return launch_kv_kernel(s, mma2_bwd_kv_kernel<D, T, NW, FUSED>, "variant 2",
                          FUSED ? "mma2_bwd_kv_kernel (fused dQ)" : "mma2_bwd_kv_kernel", S::BN,
                          S::NT, S::kSmem, &attr, st, a, dk_bar, dv_bar);
}

template <int D, typename T>
static mtrain_status_t launch_dq_nw(cuda_state_t *s, const cuda_step_t *st,
                                    const mtrain_bwd_step_args_t *a, const Config &c) {
  return c.dq_nw == 8 ? launch_dq<D, T, 8>(s, st, a) : launch_dq<D, T, 4>(s, st, a);
}

template <int D, typename T>
static mtrain_status_t launch_bwd(cuda_state_t *s, const cuda_step_t *st,
                                  const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar,
                                  const Config &c) {
  if (!s->deterministic)
    return c.kv_nw == 8 ? launch_kv<D, T, 8, true>(s, st, a, dk_bar, dv_bar)
                        : launch_kv<D, T, 4, true>(s, st, a, dk_bar, dv_bar);
  mtrain_status_t rc = launch_dq_nw<D, T>(s, st, a, c);
  if (rc != MTRAIN_SUCCESS) return rc;
  return c.kv_nw == 8 ? launch_kv<D, T, 8, false>(s, st, a, dk_bar, dv_bar)
                      : launch_kv<D, T, 4, false>(s, st, a, dk_bar, dv_bar);
}

} /* namespace mma2 */

extern "C" mtrain_status_t cuda_mma2_bwd(cuda_state_t *s, const cuda_step_t *st,
                                         const mtrain_bwd_step_args_t *a, float *dk_bar,
                                         float *dv_bar) {
  const mma2::Config c = mma2::effective_config(s->mma2_config, st->G);
  const bool bf16 = a->dtype == MTRAIN_BF16;
  if (st->d == 64)
    return bf16 ? mma2::launch_bwd<64, __nv_bfloat16>(s, st, a, dk_bar, dv_bar, c)
                : mma2::launch_bwd<64, __half>(s, st, a, dk_bar, dv_bar, c);
  return bf16 ? mma2::launch_bwd<128, __nv_bfloat16>(s, st, a, dk_bar, dv_bar, c)
              : mma2::launch_bwd<128, __half>(s, st, a, dk_bar, dv_bar, c);
}

extern "C" mtrain_status_t cuda_mma2_bwd_dq(cuda_state_t *s, const cuda_step_t *st,
                                            const mtrain_bwd_step_args_t *a) {
  const mma2::Config c = mma2::effective_config(s->mma2_config, st->G);
  const bool bf16 = a->dtype == MTRAIN_BF16;
  if (st->d == 64)
    return bf16 ? mma2::launch_dq_nw<64, __nv_bfloat16>(s, st, a, c)
                : mma2::launch_dq_nw<64, __half>(s, st, a, c);
  return bf16 ? mma2::launch_dq_nw<128, __nv_bfloat16>(s, st, a, c)
              : mma2::launch_dq_nw<128, __half>(s, st, a, c);
}

/* The long-item split (see kv_split_schedule_kernel). Scratch (one buffer,
 * cuda_kv_split_scratch): the work list (header + 4 int32 per part, parts
 * <= bar tiles + run items + 2 SMs + 1), then the parts' dK and dV rows,
 * 4 SMs slots of bn rows each (at most 2 W / C <= 4 SMs slots; never more
 * than the parts). */
static int64_t kv_split_max_parts(const cuda_state_t *s, const cuda_step_t *st, int bn) {
  return cuda_kv_items(st, bn) + 2 * (int64_t)s->num_sms + 1;
}

extern "C" mtrain_status_t cuda_kv_split_begin(cuda_state_t *s, cuda_step_t *st, int bn,
                                               int64_t *blocks) {
  if (cuda_kv_items(st, bn) <= 0 || !st->kv_off || s->num_sms <= 0) return MTRAIN_SUCCESS;
  const int64_t max_parts = kv_split_max_parts(s, st, bn);
  int64_t max_slots = 4 * (int64_t)s->num_sms;
  if (max_slots > max_parts) max_slots = max_parts;
  const size_t work_bytes =
      ((size_t)(CUDA_KV_WORK_HEADER + 4 * max_parts) * sizeof(int32_t) + 255) / 256 * 256;
  const size_t part_floats = (size_t)max_slots * (size_t)bn * (size_t)st->d;
  void *buf = NULL;
  mtrain_status_t rc = cuda_kv_split_scratch(s, work_bytes + 2 * part_floats * sizeof(float), &buf);
  if (rc != MTRAIN_SUCCESS) return rc;
  int32_t *work = (int32_t *)buf;
  st->kv_work = work;
  st->kv_dk_part = (float *)((char *)buf + work_bytes);
  st->kv_dv_part = st->kv_dk_part + part_floats;
  const int smem = 3 * mma2::kSplitThreads * (int)sizeof(int);
  rc = cuda_prepare_launch(s, (const void *)mma2::kv_split_schedule_kernel, "backward",
                           "kv_split_schedule_kernel", 1, 1, (size_t)smem, NULL);
  if (rc != MTRAIN_SUCCESS) return rc;
  mma2::kv_split_schedule_kernel<<<1, mma2::kSplitThreads, smem, (cudaStream_t)s->stream>>>(
      *st, bn, s->kv_split_min, s->num_sms, work);
  rc = cuda_check_launch("kv_split_schedule_kernel");
  if (rc != MTRAIN_SUCCESS) return rc;
  *blocks = max_parts;
  return MTRAIN_SUCCESS;
}

extern "C" mtrain_status_t cuda_kv_split_end(cuda_state_t *s, const cuda_step_t *st, int bn,
                                             float *dk_acc, float *dv_acc, float *dk_bar,
                                             float *dv_bar) {
  if (!st->kv_work) return MTRAIN_SUCCESS;
  const int64_t max_parts = kv_split_max_parts(s, st, bn);
  mtrain_status_t rc =
      cuda_prepare_launch(s, (const void *)mma2::kv_split_reduce_kernel, "backward",
                          "kv_split_reduce_kernel", max_parts, 1, 0, NULL);
  if (rc != MTRAIN_SUCCESS) return rc;
  mma2::kv_split_reduce_kernel<<<(unsigned)max_parts, mma2::kSplitThreads, 0,
                                 (cudaStream_t)s->stream>>>(*st, bn, dk_acc, dv_acc, dk_bar,
                                                            dv_bar);
  return cuda_check_launch("kv_split_reduce_kernel");
}
