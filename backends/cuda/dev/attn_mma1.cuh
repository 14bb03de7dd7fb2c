/* attn_mma1.cuh (private, development build only): the device code that
 * only variant 1 (dev/attn_mma_fwd.cu, dev/attn_mma_bwd.cu) uses, on top of
 * the mma.sync building blocks that it shares with variants 2 and 3
 * (attn_mma_common.cuh): its CTA shape (4 warps, 64-row tiles), the row
 * loaders of a 64-row tile by 128 threads, and the walk over the key tiles
 * of a (head, query tile) item that its forward and dQ kernels share. */
#ifndef MTRAIN_ATTN_MMA1_CUH
#define MTRAIN_ATTN_MMA1_CUH

#include <stdint.h>

#include "backends/cuda/attn_mma_common.cuh"
#include "backends/cuda/cuda_device.cuh"

namespace mma1 {

using mma::cp_async16;
using mma::cp_async4;
using mma::cp_async_commit;
using mma::cp_async_wait;
using mma::fast_exp2;
using mma::Frag;
using mma::kLn2;
using mma::kLog2e;
using mma::ldsm_x4;
using mma::ldsm_x4_t;
using mma::mma16816;
using mma::pack2;
using mma::pack_a;
using mma::seg_walk;
using mma::smem_u32;
using mma::toff;

constexpr int kThreads = 128; /* 4 warps per CTA */
constexpr int kTile = 64;     /* rows of a query tile and of a key tile */
/* Minimum resident CTAs per SM asked of ptxas (__launch_bounds__): 3 caps
 * the forward at 168 registers (no spills; 3 x 64 KB shared memory at
 * d = 128); the backward kernels spill below 2. */
constexpr int kFwdMinBlocks = 3;
constexpr int kBwdMinBlocks = 2;

/* Loads 64 rows into a swizzled tile at shared address sdst: tile row i
 * comes from g + rows[.] * stride (elements), zero-filled where the row is
 * -1. Thread tid handles rows i = tid/8 + 16r (r < 4), chunks tid%8 + 8j:
 * 8 threads read one row's 128 contiguous bytes per instruction. */
template <int D, typename T>
__device__ __forceinline__ void load_rows(uint32_t sdst, const T *g, int64_t stride,
                                          const int64_t (&rows)[4], int tid) {
  const int i0 = tid >> 3, c0 = tid & 7, cx = c0 ^ (i0 & 7);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = i0 + 16 * r;
    const bool ok = rows[r] >= 0;
    const T *src = ok ? g + rows[r] * stride + c0 * 8 : g;
#pragma unroll
    for (int j = 0; j < D / 64; ++j)
      cp_async16(sdst + toff<D>(i, 8 * j + cx), ok ? src + 64 * j : g, ok);
  }
}

/* Rows of a tile whose valid rows are row0 + i for i < nvalid. */
__device__ __forceinline__ void contiguous_rows(int64_t (&rows)[4], int64_t row0, int nvalid,
                                                int tid) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = (tid >> 3) + 16 * r;
    rows[r] = i < nvalid ? row0 + i : -1;
  }
}

/* One key tile of a query item: kind 1 = 64 consecutive key rows of a run
 * block (first row a), kind 2 = up to 64 bars from the cursor (segment a,
 * bar index b). Valid key columns are [0, nvalid); causal marks the tile
 * on the causal diagonal (same tile index in the block as the query tile):
 * there column c > row r is masked (both tile-local). */
struct KTile {
  int kind, nvalid, causal, a, b;
};

/* The key tiles of (head h, local query block qb, query tile qt of the
 * block), in the plan's order: each run block's 64-row tiles that hold valid
 * keys (on the diagonal block only tiles kt <= qt), then the bars of qb's
 * segments 64 at a time. Every thread of the CTA walks it identically. */
struct KeyWalk {
  const int32_t *runs, *segs, *bars;
  int e, e_end, kb, kb_end, kt;
  int s, s_end, b, bars_left;
  int qt;
  int64_t gq;

  __device__ __forceinline__ void init(const head_view &hv, int qb, int64_t gq_, int qt_) {
    runs = hv.runs;
    segs = hv.segs;
    bars = hv.bars;
    gq = gq_;
    qt = qt_;
    e = hv.run_off[qb];
    e_end = hv.run_off[qb + 1];
    kb = kb_end = 0;
    if (e < e_end) {
      kb = runs[2 * e];
      kb_end = runs[2 * e + 1];
    }
    kt = 0;
    s = hv.seg_off[qb];
    s_end = hv.seg_off[qb + 1];
    bars_left = 0;
    for (int x = s; x < s_end; ++x) bars_left += segs[2 * x + 1] - segs[2 * x];
    b = s < s_end ? segs[2 * s] : 0;
    seg_walk(segs, s_end, s, b, 0);
  }

  __device__ __forceinline__ bool next(const cuda_step_t &st, KTile &t) {
    while (e < e_end) {
      if (kb < kb_end) {
        const int64_t gk = st.k_block_global[kb];
        const int nc = block_rows_dev(st.k_tokens, st.G, kb, gk, st.seq_len);
        const bool diag = gk == gq;
        int lim = (nc + kTile - 1) / kTile;
        if (diag && lim > qt + 1) lim = qt + 1;
        if (kt < lim) {
          t.kind = 1;
          t.a = kb * st.G + kt * kTile;
          t.nvalid = min(kTile, nc - kt * kTile);
          t.causal = diag && kt == qt;
          t.b = 0;
          ++kt;
          return true;
        }
        ++kb;
        kt = 0;
        continue;
      }
      if (++e < e_end) {
        kb = runs[2 * e];
        kb_end = runs[2 * e + 1];
        kt = 0;
      }
    }
    if (bars_left > 0) {
      t.kind = 2;
      t.nvalid = min(kTile, bars_left);
      t.causal = 0;
      t.a = s;
      t.b = b;
      seg_walk(segs, s_end, s, b, kTile);
      bars_left -= kTile;
      return true;
    }
    return false;
  }
};

/* Issues the cp.async loads of key tile t of walk w into the K and V tiles at
 * sK and sV (kv head base pointers kbase, vbase; row stride in elements). */
template <int D, typename T>
__device__ __forceinline__ void load_kv_tile(uint32_t sK, uint32_t sV, const T *kbase,
                                             const T *vbase, int64_t stride, const KeyWalk &w,
                                             const KTile &t, int tid) {
  int64_t rows[4];
  if (t.kind == 1) {
    contiguous_rows(rows, t.a, t.nvalid, tid);
  } else {
    const int i0 = tid >> 3;
    int s = t.a, b = t.b;
    seg_walk(w.segs, w.s_end, s, b, i0);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      rows[r] = i0 + 16 * r < t.nvalid ? (int64_t)w.bars[b] : -1;
      if (r < 3) seg_walk(w.segs, w.s_end, s, b, 16);
    }
  }
  load_rows<D>(sK, kbase, stride, rows, tid);
  load_rows<D>(sV, vbase, stride, rows, tid);
}

} /* namespace mma1 */

#endif /* MTRAIN_ATTN_MMA1_CUH */
