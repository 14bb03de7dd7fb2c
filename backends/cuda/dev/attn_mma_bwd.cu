/* attn_mma_bwd.cu (development build only, see README.md): the backward
 * step of variant 1, the first tensor-core variant: cuda_mma_bwd, two deterministic kernels (no
 * floating-point atomics):
 *  - mma_bwd_dq_kernel, query-major: one CTA per (query head, 64-row query
 *    tile) keeps Q, dO in shared memory and its dQ accumulator in registers
 *    while it streams the item's key tiles (the forward's walk) through
 *    double-buffered K/V tiles; adds scale * dQ into dq_acc (rows it owns);
 *  - mma_bwd_dkdv_kernel, key-major, one launch for two kinds of CTA, each
 *    keeping a 64-key tile of K, V in shared memory and its dK, dV in
 *    registers while it streams 64-row Q/dO tiles (with their LSE and
 *    delta): first one CTA per bar tile (h, b0, b1) over its (qb, lo, hi)
 *    entries, which WRITES the tile's rows of the dK/dV bar scratch (zeros
 *    where nothing contributes); then one CTA per (kv head, 64-key tile of a
 *    local key block) over the (h, qb) entries that list the block, which
 *    adds into the dk_acc/dv_acc rows it owns. Bar tiles usually see most
 *    query blocks, so they get the lowest block indices (start first) and
 *    the run tiles fill the machine around them.
 * Per (query i, key j): p = exp(scale q_i.k_j - lse_i), dp = dout_i.v_j,
 * ds = p (dp - delta_i); dq_i += scale ds k_j, dk_j += scale ds q_i,
 * dv_j += p dout_i. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/dev/attn_mma1.cuh"
#include "backends/cuda/dev/attn_mma1.h"

namespace mma1 {

static_assert(CUDA_BAR_TILE == kTile, "a bar tile is one 64-row key tile");

/* dQ kernel: Q tile, dO tile, then two stages of (K tile, V tile). */
template <int D> __host__ __device__ constexpr int dq_smem_bytes() { return 6 * kTile * D * 2; }
/* dK/dV kernels: K tile, V tile, then two stages of (Q tile, dO tile,
 * LSE[64], delta[64]). */
template <int D> __host__ __device__ constexpr int dkdv_stage_bytes() {
  return 2 * kTile * D * 2 + 2 * kTile * 4;
}
template <int D> __host__ __device__ constexpr int dkdv_smem_bytes() {
  return 2 * kTile * D * 2 + 2 * dkdv_stage_bytes<D>();
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, kBwdMinBlocks)
    mma_bwd_dq_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                      const T *__restrict__ v, const T *__restrict__ dout,
                      const float *__restrict__ lse_acc, const float *__restrict__ delta_acc,
                      float *__restrict__ dq_acc) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int TB = kTile * D * 2;
  constexpr int NKS = D / 16, NDT = D / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  mma2::QItem item; /* heaviest (last) query tiles first, the heads of one tile together */
  if (!mma2::q_item_begin<kTile>(st, item)) return;
  const int h = item.h, qb = item.qb, qt = item.qt, rows_here = item.rows;
  const int64_t gq = item.gq;
  const head_view hv = head_of(st, h);
  KeyWalk walk;
  walk.init(hv, qb, st.causal ? gq : -1, qt); /* non-causal: no diagonal block */
  KTile cur;
  if (!walk.next(st, cur)) return;

  const int hk = h / st.group;
  const int64_t q_stride = (int64_t)st.Hq * D, kv_stride = (int64_t)st.Hkv * D;
  const T *kbase = k + (int64_t)hk * D, *vbase = v + (int64_t)hk * D;
  const int64_t qrow0 = (int64_t)qb * st.G + (int64_t)qt * kTile;
  const uint32_t s0 = smem_u32(smem);
  const uint32_t sQ = s0, sO = s0 + TB, sKV = s0 + 2 * TB; /* stage x at sKV + 2*TB*x */
  const Frag<D> fr(lane);

  {
    int64_t rows[4];
    contiguous_rows(rows, qrow0, rows_here, tid);
    load_rows<D>(sQ, q + (int64_t)h * D, q_stride, rows, tid);
    load_rows<D>(sO, dout + (int64_t)h * D, q_stride, rows, tid);
  }
  load_kv_tile<D>(sKV, sKV + TB, kbase, vbase, kv_stride, walk, cur, tid);
  cp_async_commit();

  /* the thread's two rows (row_a, row_a + 8): LSE in the log2 domain
   * (+inf on padding rows so that their P is 0) and delta */
  const int row_a = warp * 16 + g;
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

  int stage = 0;
  for (;;) {
    KTile nxt;
    const bool more = walk.next(st, nxt);
    if (more) {
      const uint32_t sn = sKV + (uint32_t)((stage ^ 1) * 2 * TB);
      load_kv_tile<D>(sn, sn + TB, kbase, vbase, kv_stride, walk, nxt, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint32_t sK = sKV + (uint32_t)(stage * 2 * TB), sV = sK + TB;

    /* S = Q K^T, then P (in place) */
    float p[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) p[n][0] = p[n][1] = p[n][2] = p[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < NKS; ++kk) {
      uint32_t a[4];
      ldsm_x4(sQ + fr.A(warp * 16, 2 * kk), a[0], a[1], a[2], a[3]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(sK + fr.B(np * 16, 2 * kk), b0, b1, b2, b3);
        mma16816<T>(p[2 * np], a, b0, b1);
        mma16816<T>(p[2 * np + 1], a, b2, b3);
      }
    }
    const bool need_mask = cur.nvalid < kTile || cur.causal;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float x = fast_exp2(p[n][j] * sl2 - lse2[j >> 1]);
        if (need_mask) {
          const int col = n * 8 + 2 * t4 + (j & 1), row = row_a + ((j >> 1) << 3);
          if (col >= cur.nvalid || (cur.causal && col > row)) x = 0.f;
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
      ldsm_x4(sO + fr.A(warp * 16, 2 * kk), a[0], a[1], a[2], a[3]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(sV + fr.B(np * 16, 2 * kk), b0, b1, b2, b3);
        mma16816<T>(ds[2 * np], a, b0, b1);
        mma16816<T>(ds[2 * np + 1], a, b2, b3);
      }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int j = 0; j < 4; ++j) ds[n][j] = p[n][j] * (ds[n][j] - dl[j >> 1]);
    }

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
    __syncthreads();
    if (!more) break;
    cur = nxt;
    stage ^= 1;
  }

  const float sc = st.scale;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_a + 8 * i;
    if (row < rows_here) {
      float *dqr = dq_acc + ((qrow0 + row) * st.Hq + h) * D;
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

/* One streamed query tile of a dK/dV item: rows row0 + i (i < nvalid) of
 * head h; key slots (tile-local rows of K) outside [jlo, jhi) take no part;
 * causal: the diagonal tile pair, key slot c > query row r masked. */
struct QTile {
  int h, nvalid, causal, jlo, jhi;
  int64_t row0;
};

/* The query tiles of a dK/dV item (a bar tile when `bars`, else a run key
 * tile). Runs: entries (h, qb) of kv_ent, every
 * 64-row tile of qb's valid rows, from the key tile's own index kt on when
 * qb is the causal diagonal block (earlier tiles see none of its keys).
 * Bars: entries (qb, lo, hi) of bt_ent with head h_bar; key slots of the
 * tile [max(lo, b0), min(hi, b1)) - b0. */
struct QWalk {
  int bars; /* 1: a bar tile's walk */
  int e, e_end, qt, qt_end, h, nr, jlo, jhi, diag;
  int64_t rbase;
  /* runs */
  int kt, nk;
  int64_t gk;
  /* bars */
  int h_bar, b0, b1;

  __device__ __forceinline__ bool next(const cuda_step_t &st, QTile &t) {
    while (qt >= qt_end) {
      if (++e >= e_end) return false;
      int qb;
      if (bars) {
        qb = st.bt_ent[3 * e];
        const int lo = st.bt_ent[3 * e + 1], hi = st.bt_ent[3 * e + 2];
        h = h_bar;
        jlo = max(lo, b0) - b0;
        jhi = min(hi, b1) - b0;
        diag = 0;
      } else {
        h = st.kv_ent[2 * e];
        qb = st.kv_ent[2 * e + 1];
        jlo = 0;
        jhi = nk;
      }
      const int64_t gq = st.q_block_global[qb];
      nr = block_rows_dev(st.q_tokens, st.G, qb, gq, st.seq_len);
      rbase = (int64_t)qb * st.G;
      if (!bars) diag = gq == gk;
      qt = diag ? kt : 0;
      qt_end = jlo < jhi ? (nr + kTile - 1) / kTile : 0;
    }
    t.h = h;
    t.row0 = rbase + (int64_t)qt * kTile;
    t.nvalid = min(kTile, nr - qt * kTile);
    t.causal = diag && qt == kt;
    t.jlo = jlo;
    t.jhi = jhi;
    ++qt;
    return true;
  }
};

/* Issues the loads of query tile t (Q, dO, LSE, delta) into stage `ss`. */
template <int D, typename T>
__device__ __forceinline__ void load_q_tile(uint32_t ss, const cuda_step_t &st, const T *q,
                                            const T *dout, const float *lse_acc,
                                            const float *delta_acc, const QTile &t, int tid) {
  constexpr int TB = kTile * D * 2;
  const int64_t stride = (int64_t)st.Hq * D;
  int64_t rows[4];
  contiguous_rows(rows, t.row0, t.nvalid, tid);
  load_rows<D>(ss, q + (int64_t)t.h * D, stride, rows, tid);
  load_rows<D>(ss + TB, dout + (int64_t)t.h * D, stride, rows, tid);
  const int i = tid & (kTile - 1);
  const bool ok = i < t.nvalid;
  const float *src = tid < kTile ? lse_acc : delta_acc;
  cp_async4(ss + 2 * TB + (uint32_t)(tid * 4), ok ? src + (t.row0 + i) * st.Hq + t.h : src, ok);
}

/* Block x < num_bar_tiles: bar tile x (writes dk_bar/dv_bar rows); else run
 * key tile x - num_bar_tiles = (key tile index ktg, kv head hk), ktg =
 * kb * G/64 + kt (adds into dk_acc/dv_acc). QS: query columns per inner
 * step (64 or 32; 32 halves the S/dP registers next to the 2 x D/8 x 4
 * dK/dV accumulators). */
template <int D, typename T>
__global__ void __launch_bounds__(kThreads, kBwdMinBlocks)
    mma_bwd_dkdv_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                        const T *__restrict__ v, const T *__restrict__ dout,
                        const float *__restrict__ lse_acc, const float *__restrict__ delta_acc,
                        float *__restrict__ dk_acc, float *__restrict__ dv_acc,
                        float *__restrict__ dk_bar, float *__restrict__ dv_bar) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int TB = kTile * D * 2, SB = dkdv_stage_bytes<D>();
  constexpr int NKS = D / 16, NDT = D / 8;
  constexpr int QS = D == 128 ? 32 : 64, NQ = QS / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  const bool bars = (int)blockIdx.x < st.num_bar_tiles; /* uniform over the CTA */
  QWalk qw;
  qw.bars = bars;
  qw.qt = qw.qt_end = 0;
  qw.kt = 0;
  qw.nk = 0;
  qw.gk = -1;
  qw.h_bar = qw.b0 = qw.b1 = 0;
  int hk, nk;
  int64_t krow0 = 0;           /* runs: first local key row of the tile */
  const int32_t *bar_list = 0; /* bars: head h_bar's bar list */
  int bar_base = 0;
  if (bars) {
    const int t = blockIdx.x;
    qw.h_bar = st.bt_tile[3 * t];
    qw.b0 = st.bt_tile[3 * t + 1];
    qw.b1 = st.bt_tile[3 * t + 2];
    nk = min(kTile, qw.b1 - qw.b0);
    if (nk <= 0) return;
    hk = qw.h_bar / st.group;
    const head_view hv = head_of(st, qw.h_bar);
    bar_list = hv.bars;
    bar_base = hv.bar_base;
    qw.e = st.bt_off[t] - 1;
    qw.e_end = st.bt_off[t + 1];
  } else {
    const int tpb = st.G / kTile;
    const unsigned item = blockIdx.x - (unsigned)st.num_bar_tiles;
    const int ktg = (int)(item / (unsigned)st.Hkv);
    hk = (int)(item % (unsigned)st.Hkv);
    const int kb = ktg / tpb;
    qw.kt = ktg - kb * tpb;
    const int64_t gk = st.k_block_global[kb];
    qw.gk = st.causal ? gk : -1; /* non-causal: no query block is the diagonal */
    const int nc = block_rows_dev(st.k_tokens, st.G, kb, gk, st.seq_len);
    nk = min(kTile, nc - qw.kt * kTile);
    if (nk <= 0) return;
    qw.nk = nk;
    krow0 = (int64_t)kb * st.G + (int64_t)qw.kt * kTile;
    const int x = hk * st.num_k_blocks + kb;
    qw.e = st.kv_off[x] - 1;
    qw.e_end = st.kv_off[x + 1];
  }

  float dk[NDT][4], dv[NDT][4];
#pragma unroll
  for (int n = 0; n < NDT; ++n) {
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.f;
    dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.f;
  }
  const int row_a = warp * 16 + g; /* the thread's key slots row_a, row_a + 8 */

  QTile cur;
  if (qw.next(st, cur)) {
    const int64_t kv_stride = (int64_t)st.Hkv * D;
    const uint32_t s0 = smem_u32(smem);
    const uint32_t sK = s0, sV = s0 + TB, sS = s0 + 2 * TB; /* stage x at sS + SB*x */
    const Frag<D> fr(lane);
    {
      int64_t rows[4];
      if (bars) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = (tid >> 3) + 16 * r;
          rows[r] = i < nk ? (int64_t)bar_list[qw.b0 + i] : -1;
        }
      } else {
        contiguous_rows(rows, krow0, nk, tid);
      }
      load_rows<D>(sK, k + (int64_t)hk * D, kv_stride, rows, tid);
      load_rows<D>(sV, v + (int64_t)hk * D, kv_stride, rows, tid);
    }
    load_q_tile<D>(sS, st, q, dout, lse_acc, delta_acc, cur, tid);
    cp_async_commit();
    const float sl2 = st.scale * kLog2e;

    int stage = 0;
    for (;;) {
      QTile nxt;
      const bool more = qw.next(st, nxt);
      if (more)
        load_q_tile<D>(sS + (uint32_t)((stage ^ 1) * SB), st, q, dout, lse_acc, delta_acc, nxt,
                       tid);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      const uint32_t sQ = sS + (uint32_t)(stage * SB), sO = sQ + TB;
      /* the stage's LSE[64] and delta[64] follow its Q and dO tiles */
      const float *lse_t = reinterpret_cast<const float *>(smem + 2 * TB + stage * SB + 2 * TB);
      const float *del_t = lse_t + kTile;
      const bool kok0 = row_a >= cur.jlo && row_a < cur.jhi;
      const bool kok1 = row_a + 8 >= cur.jlo && row_a + 8 < cur.jhi;
      const bool need_mask = cur.nvalid < kTile || cur.causal || cur.jlo > 0 || cur.jhi < kTile;

#pragma unroll 1
      for (int c0 = 0; c0 < kTile; c0 += QS) {
        /* S^T = K Q^T over query columns c0..c0+QS-1, then P^T (in place) */
        float p[NQ][4];
#pragma unroll
        for (int n = 0; n < NQ; ++n) p[n][0] = p[n][1] = p[n][2] = p[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < NKS; ++kk) {
          uint32_t a[4];
          ldsm_x4(sK + fr.A(warp * 16, 2 * kk), a[0], a[1], a[2], a[3]);
#pragma unroll
          for (int np = 0; np < NQ / 2; ++np) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(sQ + fr.B(c0 + np * 16, 2 * kk), b0, b1, b2, b3);
            mma16816<T>(p[2 * np], a, b0, b1);
            mma16816<T>(p[2 * np + 1], a, b2, b3);
          }
        }
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
          const int col = c0 + n * 8 + 2 * t4;
          const float2 L = *reinterpret_cast<const float2 *>(lse_t + col);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float x = fast_exp2(p[n][j] * sl2 - ((j & 1) ? L.y : L.x) * kLog2e);
            if (need_mask) {
              const int cc = col + (j & 1), kr = row_a + ((j >> 1) << 3);
              const bool kok = (j >> 1) ? kok1 : kok0;
              if (cc >= cur.nvalid || !kok || (cur.causal && kr > cc)) x = 0.f;
            }
            p[n][j] = x;
          }
        }

        /* dV += P^T dO: k-slice jj = query columns c0+16jj.., dO by .trans */
#pragma unroll
        for (int jj = 0; jj < NQ / 2; ++jj) {
          uint32_t a[4];
          pack_a<T>(a, p[2 * jj], p[2 * jj + 1]);
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(sO + fr.A(c0 + 16 * jj, 2 * dp), b0, b1, b2, b3);
            mma16816<T>(dv[2 * dp], a, b0, b1);
            mma16816<T>(dv[2 * dp + 1], a, b2, b3);
          }
        }

        /* dP^T = V dO^T, then dS^T = P^T (dP^T - delta) (in place) */
        float ds[NQ][4];
#pragma unroll
        for (int n = 0; n < NQ; ++n) ds[n][0] = ds[n][1] = ds[n][2] = ds[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < NKS; ++kk) {
          uint32_t a[4];
          ldsm_x4(sV + fr.A(warp * 16, 2 * kk), a[0], a[1], a[2], a[3]);
#pragma unroll
          for (int np = 0; np < NQ / 2; ++np) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(sO + fr.B(c0 + np * 16, 2 * kk), b0, b1, b2, b3);
            mma16816<T>(ds[2 * np], a, b0, b1);
            mma16816<T>(ds[2 * np + 1], a, b2, b3);
          }
        }
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
          const int col = c0 + n * 8 + 2 * t4;
          const float2 Dl = *reinterpret_cast<const float2 *>(del_t + col);
          ds[n][0] = p[n][0] * (ds[n][0] - Dl.x);
          ds[n][1] = p[n][1] * (ds[n][1] - Dl.y);
          ds[n][2] = p[n][2] * (ds[n][2] - Dl.x);
          ds[n][3] = p[n][3] * (ds[n][3] - Dl.y);
        }

        /* dK += dS^T Q: Q by .trans */
#pragma unroll
        for (int jj = 0; jj < NQ / 2; ++jj) {
          uint32_t a[4];
          pack_a<T>(a, ds[2 * jj], ds[2 * jj + 1]);
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(sQ + fr.A(c0 + 16 * jj, 2 * dp), b0, b1, b2, b3);
            mma16816<T>(dk[2 * dp], a, b0, b1);
            mma16816<T>(dk[2 * dp + 1], a, b2, b3);
          }
        }
      }
      __syncthreads();
      if (!more) break;
      cur = nxt;
      stage ^= 1;
    }
  } else if (!bars) {
    return; /* no query tile sees this key tile: nothing to add */
  }

  const float sc = st.scale;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int kr = row_a + 8 * i;
    if (kr < nk) {
      float *dkr, *dvr;
      if (bars) {
        dkr = dk_bar + (int64_t)(bar_base + qw.b0 + kr) * D;
        dvr = dv_bar + (int64_t)(bar_base + qw.b0 + kr) * D;
      } else {
        dkr = dk_acc + ((krow0 + kr) * st.Hkv + hk) * D;
        dvr = dv_acc + ((krow0 + kr) * st.Hkv + hk) * D;
      }
#pragma unroll
      for (int n = 0; n < NDT; ++n) {
        float2 *pk = reinterpret_cast<float2 *>(dkr + n * 8 + 2 * t4);
        float2 *pv = reinterpret_cast<float2 *>(dvr + n * 8 + 2 * t4);
        float2 xk = make_float2(sc * dk[n][2 * i], sc * dk[n][2 * i + 1]);
        float2 xv = make_float2(dv[n][2 * i], dv[n][2 * i + 1]);
        if (!bars) {
          const float2 ok = *pk, ov = *pv;
          xk.x += ok.x;
          xk.y += ok.y;
          xv.x += ov.x;
          xv.y += ov.y;
        }
        *pk = xk;
        *pv = xv;
      }
    }
  }
}

/* ---- host side ---- */

template <int D, typename T>
static mtrain_status_t launch_bwd(cuda_state_t *s, const cuda_step_t *st,
                                  const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar) {
  static cuda_smem_attr_t attr_dq, attr_kv;
  const cudaStream_t stream = (cudaStream_t)s->stream;
  const T *q = (const T *)a->q, *k = (const T *)a->k, *v = (const T *)a->v;
  const T *dout = (const T *)a->dout;
  const float *lse = (const float *)a->lse_acc, *delta = (const float *)a->delta_acc;
  mtrain_status_t rc;

  rc = mma2::launch_dq_kernel(s, mma_bwd_dq_kernel<D, T>, "variant 1", "mma_bwd_dq_kernel",
                              cuda_q_items(st, kTile), kThreads, dq_smem_bytes<D>(), &attr_dq, st,
                              a);
  if (rc != MTRAIN_SUCCESS) return rc;
  /* one launch: the bar tiles, then the run key tiles */
  const int64_t kv_grid = cuda_kv_items(st, kTile);
  if (kv_grid > 0) {
    constexpr int smem = dkdv_smem_bytes<D>();
    rc = cuda_prepare_launch(s, (const void *)mma_bwd_dkdv_kernel<D, T>, "variant 1",
                             "mma_bwd_dkdv_kernel", kv_grid, 1, smem, &attr_kv);
    if (rc != MTRAIN_SUCCESS) return rc;
    mma_bwd_dkdv_kernel<D, T><<<(unsigned)kv_grid, kThreads, smem, stream>>>(
        *st, q, k, v, dout, lse, delta, (float *)a->dk_acc, (float *)a->dv_acc, dk_bar, dv_bar);
    rc = cuda_check_launch("mma_bwd_dkdv_kernel");
    if (rc != MTRAIN_SUCCESS) return rc;
  }
  return MTRAIN_SUCCESS;
}

} /* namespace mma1 */

extern "C" mtrain_status_t cuda_mma_bwd(cuda_state_t *s, const cuda_step_t *st,
                                        const mtrain_bwd_step_args_t *a, float *dk_bar,
                                        float *dv_bar) {
  const bool bf16 = a->dtype == MTRAIN_BF16;
  if (st->d == 64)
    return bf16 ? mma1::launch_bwd<64, __nv_bfloat16>(s, st, a, dk_bar, dv_bar)
                : mma1::launch_bwd<64, __half>(s, st, a, dk_bar, dv_bar);
  return bf16 ? mma1::launch_bwd<128, __nv_bfloat16>(s, st, a, dk_bar, dv_bar)
              : mma1::launch_bwd<128, __half>(s, st, a, dk_bar, dv_bar);
}
