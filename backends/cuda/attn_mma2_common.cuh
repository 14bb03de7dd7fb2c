/* attn_mma2_common.cuh (private): device code shared by the forward and
 * backward kernels of variant 2 (attn_mma2_fwd.cu, attn_mma2_bwd.cu) and of
 * variant 3 (attn_wgmma_*.cu). It uses the mma.sync PTX wrappers, fragment
 * layouts and swizzled 64-column chunk addressing of attn_mma_common.cuh
 * (namespace mma) and adds:
 *  - two PTX wrappers: stmatrix.x4 (C fragments -> shared memory, the exact
 *    inverse of ldmatrix.x4) and the sm_90 vector reduction
 *    red.global.add.v2.f32 (the atomic dQ of the fused backward);
 *  - the run-time configurations (MTRAIN_CUDA_MMA2_CONFIG);
 *  - row loaders for CTAs of NT threads and tiles of any multiple of 64 rows;
 *  - FragC, fragment addressing for warp tiles whose columns start at a
 *    warp-dependent chunk (mma::Frag needs compile-time chunks);
 *  - the decode of a CTA's work item, written once for every tensor-core
 *    kernel: q_item_begin (query-major: forward, dQ) and kv_item_begin
 *    (key-major: dK/dV, fused backward), the grids that cuda_q_items and
 *    cuda_kv_items (cuda_internal.h) count;
 *  - the query-major key walk generalised to query tiles of BM = 64 or 128
 *    rows (KeyWalk2), advanced by one thread in shared memory (TileRing) so
 *    that no walk state occupies registers during the MMAs;
 *  - the key-major query walk generalised to key items of BN = 64 or 128
 *    keys (QWalk2), where a 128-key bar item is a pair of consecutive 64-bar
 *    tiles of one head.
 *
 * Masks use one rule everywhere: a tile pair on the causal diagonal block
 * carries off = (first key position of the key tile in the block) - (first
 * query position of the query tile in the block); tile-local key column c
 * is masked for tile-local query row r iff c + off > r. A non-causal step
 * (cuda_step_t.causal 0) has no diagonal block: the walks below never find
 * one (KeyWalk2::init and kv_item_begin replace the block index they compare
 * with by -1, which no block has), so every tile is unmasked but for the
 * keys past seq_len (nvalid) and past the item's key range (jlo, jhi). The
 * causal path pays nothing for it: one select per item, none per tile. */
#ifndef MTRAIN_ATTN_MMA2_COMMON_CUH
#define MTRAIN_ATTN_MMA2_COMMON_CUH

#include <stdint.h>

#include "backends/cuda/attn_mma2.h"
#include "backends/cuda/attn_mma_common.cuh"
#include "backends/cuda/cuda_device.cuh"

namespace mma2 {

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

constexpr int kKT = 64; /* rows of a streamed key tile (forward, dQ) and of a
                           streamed query tile (dK/dV); one bar tile */

/* True when `blocks` CTAs of `smem` dynamic bytes fit one SM of sm_90 (228
 * KB, of which each CTA reserves 1 KB): the occupancy that a kernel's
 * __launch_bounds__ asks for is checked at compile time against this. */
constexpr bool fits_sm90(int smem, int blocks) { return blocks * (smem + 1024) <= 228 * 1024; }

/* ---- PTX wrappers of variant 2 ---- */

/* Stores four 8x8 16-bit matrices: lanes 8i..8i+7 give the row addresses of
 * matrix i, register i of lane l holds {M_i[l/4][2(l%4)], M_i[l/4][2(l%4)+1]}.
 * With the A-fragment addressing Frag::A(m0, c2) and the registers of pack_a
 * it stores a 16x16 block of C fragments (rows m0.., columns 8*c2..). */
__device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                        uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

/* p[0] += a, p[1] += b in global memory, one relaxed gpu-scope reduction
 * (p 8-byte aligned). */
__device__ __forceinline__ void red_add_v2(float *p, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}

/* ---- end of PTX wrappers of variant 2 ---- */

/* ---- run-time configurations ---- */

/* Forward kernels: NW warps of WM query rows each (query tile BM = NW * WM
 * rows), 64-key tiles, two cp.async stages of (K, V).
 *  kind 0: 4 warps x 32 rows (BM 128): every K/V fragment read from shared
 *          memory feeds two 16-row MMA tiles; Q fragments re-read from
 *          shared memory per key tile at d = 128 (kept in registers at d = 64);
 *  kind 1: 8 warps x 16 rows (BM 128), Q in registers;
 *  kind 2: 4 warps x 16 rows (BM 64), Q in registers (variant 1's tiling).
 * Kinds 0 and 1 need G % 128 == 0. */
enum { kFwd4x32 = 0, kFwd8x16 = 1, kFwd4x16 = 2 };

struct Config {
  int fwd;   /* forward kind (above) for G a multiple of 128 */
  int kv_nw; /* warps of the key-major dK/dV (fused or not) kernel: 8 (128-key
                tiles) or 4 (64-key tiles), for G a multiple of 128 */
  int dq_nw; /* warps of the deterministic dQ kernel (16 query rows each) */
};

/* MTRAIN_CUDA_MMA2_CONFIG, read once when a context is created
 * (cuda_mma2_config_from_env, kept in cuda_state_t::mma2_config): index
 * into this table. Chosen so that one run
 * of the three separates the effects: 0 vs 1 compares the forward kinds and
 * (deterministic backward) the dQ kernel's 128- and 64-row tiles; 1 vs 2
 * compares the dK/dV (fused or not) kernel's 128- and 64-key items (and
 * the 64-row forward). */
constexpr int kNumConfigs = CUDA_MMA2_NUM_CONFIGS;
static const Config kConfigs[kNumConfigs] = {
    {kFwd4x32, 8, 8}, /* "0" (default) */
    {kFwd8x16, 8, 4}, /* "1" */
    {kFwd4x16, 4, 4}, /* "2": 64-row / 64-key tiles everywhere */
};

/* The configuration actually run for granularity G: 128-row and 128-key
 * tiles need G % 128 == 0 (a tile never spans two blocks, whose key lists
 * and causal diagonals differ); otherwise configuration 2's 64-row tiles. */
inline Config effective_config(int index, int G) {
  Config c = kConfigs[index];
  if (G % 128 != 0) c = kConfigs[2];
  return c;
}

/* ---- fragment addressing with a run-time column base ---- */

/* mma::Frag needs compile-time chunk indices (it selects one of four
 * per-lane offsets by c2 % 8). A warp tile whose columns start at a
 * warp-dependent chunk cb (even) uses FragC instead: entry j is the lane's
 * byte offset of logical chunk cb + 2j (row 0), for the A addressing
 * (kA = true: ldmatrix rows m0 + (lane & 15), chunk + (lane >> 4)) or the B
 * addressing (kA = false: rows m0 + (lane & 7) + 8 (lane >> 4), chunk +
 * ((lane >> 3) & 1)) of mma::Frag; at(m0, j) adds the row offset. N
 * entries cost N registers. */
template <int COLS, int N, bool kA> struct FragC {
  static constexpr int RB = COLS * 2; /* bytes per tile row */
  uint32_t e[N];
  __device__ __forceinline__ FragC(int lane, int cb) {
    const int x = kA ? ((lane >> 4) ^ (lane & 7)) : (((lane >> 3) & 1) ^ (lane & 7));
    const int r = kA ? (lane & 15) : ((lane & 7) | ((lane >> 4) << 3));
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int c = cb + 2 * j;
      e[j] = (uint32_t)(r * RB + ((((c & 7) ^ x)) << 4) + ((c >> 3) << 7));
    }
  }
  __device__ __forceinline__ uint32_t at(int m0, int j) const { return e[j] + (uint32_t)(m0 * RB); }
};

/* ---- loaders ---- */

/* Rows per thread of an R-row tile loaded by NT threads (8 threads a row). */
template <int NT, int R> struct LoadShape {
  static_assert(NT % 64 == 0 && R % (NT / 8) == 0, "tile rows must be a multiple of NT / 8");
  static constexpr int kStep = NT / 8;    /* rows between a thread's rows */
  static constexpr int kRows = R / kStep; /* rows per thread */
};

/* Loads R rows into a swizzled tile at sdst: tile row i = tid/8 + step*r
 * comes from g + rows[r] * stride (elements), zero-filled where rows[r] < 0.
 * Thread tid copies chunks tid%8 + 8j of its rows (8 threads read one row's
 * 128 contiguous bytes per instruction); row & 7 == (tid / 8) & 7 because
 * step is a multiple of 8. */
template <int D, int NT, int R, typename T>
__device__ __forceinline__ void load_rows_n(uint32_t sdst, const T *g, int64_t stride,
                                            const int64_t (&rows)[LoadShape<NT, R>::kRows],
                                            int tid) {
  using LS = LoadShape<NT, R>;
  const int i0 = tid >> 3, c0 = tid & 7, cx = c0 ^ (i0 & 7);
#pragma unroll
  for (int r = 0; r < LS::kRows; ++r) {
    const int i = i0 + LS::kStep * r;
    const bool ok = rows[r] >= 0;
    const T *src = ok ? g + rows[r] * stride + c0 * 8 : g;
#pragma unroll
    for (int j = 0; j < D / 64; ++j)
      cp_async16(sdst + toff<D>(i, 8 * j + cx), ok ? src + 64 * j : g, ok);
  }
}

/* The same rows into the panel layout that wgmma reads (variant 3,
 * attn_wgmma_ptx.cuh): D / 64 panels of R rows x 128 bytes, chunk c of row i
 * at chunk c ^ (i & 7) of the row (the 128-byte swizzle). */
template <int D, int NT, int R, typename T>
__device__ __forceinline__ void load_rows_panel(uint32_t sdst, const T *g, int64_t stride,
                                                const int64_t (&rows)[LoadShape<NT, R>::kRows],
                                                int tid) {
  using LS = LoadShape<NT, R>;
  const int i0 = tid >> 3, c0 = tid & 7;
#pragma unroll
  for (int r = 0; r < LS::kRows; ++r) {
    const int i = i0 + LS::kStep * r;
    const int cx = c0 ^ (i & 7);
    const bool ok = rows[r] >= 0;
    const T *src = ok ? g + rows[r] * stride + c0 * 8 : g;
#pragma unroll
    for (int p = 0; p < D / 64; ++p)
      cp_async16(sdst + (uint32_t)(p * R * 128 + i * 128 + cx * 16), ok ? src + 64 * p : g, ok);
  }
}

/* Rows of a tile whose valid rows are row0 + i for i < nvalid. */
template <int NT, int R>
__device__ __forceinline__ void contiguous_rows_n(int64_t (&rows)[LoadShape<NT, R>::kRows],
                                                  int64_t row0, int nvalid, int tid) {
  using LS = LoadShape<NT, R>;
#pragma unroll
  for (int r = 0; r < LS::kRows; ++r) {
    const int i = (tid >> 3) + LS::kStep * r;
    rows[r] = i < nvalid ? row0 + i : -1;
  }
}

/* ---- query-major items and walk (forward, dQ) ---- */

/* A query-major work item: query tile qt (BM rows) of local query block qb
 * (global block gq) for query head h, with `rows` valid rows. */
struct QItem {
  int h, qb, qt, rows;
  int64_t gq;
};

/* Query-major item `index` for query tiles of BM rows (index < cuda_q_items):
 * the heaviest (last) query tiles first, the heads of one tile adjacent (a
 * GQA group shares K/V in L2). False when the tile holds no valid row
 * (padding only). */
template <int BM>
__device__ __forceinline__ bool q_item_at(const cuda_step_t &st, unsigned index, QItem &it) {
  const int tpb = st.G / BM;
  const int nqt = st.num_q_blocks * tpb;
  const int qtile = nqt - 1 - (int)(index / (unsigned)st.Hq);
  const int h = (int)(index % (unsigned)st.Hq);
  const int qb = qtile / tpb, qt = qtile - qb * tpb;
  const int64_t gq = st.q_block_global[qb];
  const int nr = block_rows_dev(st.q_tokens, st.G, qb, gq, st.seq_len);
  const int rows = min(BM, nr - qt * BM);
  it.h = h;
  it.qb = qb;
  it.qt = qt;
  it.rows = rows;
  it.gq = gq;
  return rows > 0;
}

/* The query-major item of CTA blockIdx.x (the cuda_q_items grid, one CTA
 * per item). Uniform over the CTA. */
template <int BM> __device__ __forceinline__ bool q_item_begin(const cuda_step_t &st, QItem &it) {
  return q_item_at<BM>(st, blockIdx.x, it);
}

/* One 64-key tile of a query item: kind 1 = consecutive key rows of a run
 * block from row a, kind 2 = bars from the cursor (segment a, bar index b).
 * Valid key columns [0, nvalid); causal: on the diagonal block, mask
 * c + off > r. */
struct KTile2 {
  int kind, nvalid, causal, off, a, b;
};

/* The key tiles of (head h, local query block qb, query rows [q0, q0 +
 * nq) of the block), in the plan's order: every run block's 64-key tiles
 * that hold valid keys (on the diagonal block of a causal step only those
 * starting at or before the last valid query row), then qb's bars 64 at a
 * time. Every thread of the CTA walks it identically. The per-head arrays are kept as
 * 32-bit offsets into st.idx (kernel parameter space), and the global query
 * block as 32 bits (block indices are far below 2^31), which keeps the walk
 * near variant 1's register count. */
struct KeyWalk2 {
  int runs, segs, bars; /* offsets of the head's arrays in st.idx */
  int e, e_end, kb, kb_end, kt;
  int s, s_end, b, bars_left;
  int q0, qlast, gq; /* gq: the global query block, -1 in a non-causal step */

  __device__ __forceinline__ void init(const cuda_step_t &st, int h, int qb, int64_t gq_, int q0_,
                                       int nq) {
    const int32_t *m = st.head_meta + (int64_t)h * CUDA_HM_STRIDE;
    const int32_t *run_off = st.idx + m[CUDA_HM_RUN_OFF];
    const int32_t *seg_off = st.idx + m[CUDA_HM_SEG_OFF];
    runs = m[CUDA_HM_RUNS];
    segs = m[CUDA_HM_SEGS];
    bars = m[CUDA_HM_BARS];
    gq = st.causal ? (int)gq_ : -1; /* non-causal: no key block is the diagonal */
    q0 = q0_;
    qlast = q0_ + nq - 1;
    e = run_off[qb];
    e_end = run_off[qb + 1];
    kb = kb_end = 0;
    if (e < e_end) {
      kb = st.idx[runs + 2 * e];
      kb_end = st.idx[runs + 2 * e + 1];
    }
    kt = 0;
    s = seg_off[qb];
    s_end = seg_off[qb + 1];
    const int32_t *sg = st.idx + segs;
    bars_left = 0;
    for (int x = s; x < s_end; ++x) bars_left += sg[2 * x + 1] - sg[2 * x];
    b = s < s_end ? sg[2 * s] : 0;
    seg_walk(sg, s_end, s, b, 0);
  }

  __device__ __forceinline__ bool next(const cuda_step_t &st, KTile2 &t) {
    while (e < e_end) {
      if (kb < kb_end) {
        const int64_t gk = st.k_block_global[kb];
        const int nc = block_rows_dev(st.k_tokens, st.G, kb, gk, st.seq_len);
        const bool diag = (int)gk == gq;
        int lim = (nc + kKT - 1) / kKT;
        if (diag && lim > qlast / kKT + 1) lim = qlast / kKT + 1;
        if (kt < lim) {
          t.kind = 1;
          t.a = kb * st.G + kt * kKT;
          t.b = 0;
          t.nvalid = min(kKT, nc - kt * kKT);
          t.off = kt * kKT - q0;
          t.causal = diag && t.off + kKT - 1 > 0;
          ++kt;
          return true;
        }
        ++kb;
        kt = 0;
        continue;
      }
      if (++e < e_end) {
        kb = st.idx[runs + 2 * e];
        kb_end = st.idx[runs + 2 * e + 1];
        kt = 0;
      }
    }
    if (bars_left > 0) {
      t.kind = 2;
      t.nvalid = min(kKT, bars_left);
      t.causal = 0;
      t.off = 0;
      t.a = s;
      t.b = b;
      seg_walk(st.idx + segs, s_end, s, b, kKT);
      bars_left -= kKT;
      return true;
    }
    return false;
  }
};

/* The walk of a query item shared by the CTA: thread 0 alone advances it
 * (state in shared memory) and publishes each tile in a ring of 3 slots,
 * two tiles ahead of the one being computed; every thread reads the slots.
 * Tile n sits in d[n % 3]; thread 0 writes tile n + 2 during iteration n,
 * into the slot of tile n - 1, which every thread finished reading before
 * the barrier that opens iteration n. No walk state stays in registers
 * across the MMAs. kind == 0 marks the end of the walk. */
struct TileRing {
  KeyWalk2 w; /* thread 0 only */
  /* d[] and the constants each start a 16-byte granule: the compiler may
   * read segs, bars and s_end with one 16-byte load, which must not cover
   * the end of d[2] (written by thread 0 while the others read these; a
   * read-write race that compute-sanitizer's racecheck reported, harmless
   * in value but a race all the same) */
  alignas(16) KTile2 d[3];
  alignas(16) int segs;        /* copies of w's constants for every thread's bar loads */
  int bars, s_end, unused_pad; /* (segs, bars, s_end, unused_pad): one 16-byte granule */
  /* the item's first query row, valid rows and head, for the epilogue: read
   * back from shared memory, they hold no register across the MMAs */
  int64_t row0;
  int rows, h;

  /* thread 0: the walk of query item it (q_item_begin, tiles of BM rows),
   * its first two tiles, and the item's rows for the epilogue */
  __device__ __forceinline__ void start(const cuda_step_t &st, const QItem &it, int BM) {
    w.init(st, it.h, it.qb, it.gq, it.qt * BM, it.rows);
    segs = w.segs;
    bars = w.bars;
    s_end = w.s_end;
    produce(st, 0);
    produce(st, 1);
    row0 = (int64_t)it.qb * st.G + (int64_t)it.qt * BM;
    rows = it.rows;
    h = it.h;
  }

  /* thread 0: the next tile of the walk into d[slot] */
  __device__ __forceinline__ void produce(const cuda_step_t &st, int slot) {
    KeyWalk2 x = w;
    KTile2 t;
    if (!x.next(st, t)) t.kind = 0;
    d[slot] = t;
    w = x;
  }

  /* Issues the cp.async loads of tile t into the K and V tiles at sK, sV
   * (NT threads; kv head base pointers kbase, vbase). */
  template <int D, int NT, typename T>
  __device__ __forceinline__ void load(const cuda_step_t &st, uint32_t sK, uint32_t sV,
                                       const T *kbase, const T *vbase, int64_t stride,
                                       const KTile2 &t, int tid) const {
    int64_t rows[LoadShape<NT, kKT>::kRows];
    tile_rows<NT>(st, t, tid, rows);
    load_rows_n<D, NT, kKT>(sK, kbase, stride, rows, tid);
    load_rows_n<D, NT, kKT>(sV, vbase, stride, rows, tid);
  }

  /* The key rows of tile t that thread tid loads (tile rows tid/8 + NT/8 *
   * r), -1 past the tile's valid keys: consecutive rows of a run block, or
   * the bars gathered through the cursor (segment t.a, bar index t.b). */
  template <int NT>
  __device__ __forceinline__ void tile_rows(const cuda_step_t &st, const KTile2 &t, int tid,
                                            int64_t (&rows)[LoadShape<NT, kKT>::kRows]) const {
    using LS = LoadShape<NT, kKT>;
    if (t.kind == 1) {
      contiguous_rows_n<NT, kKT>(rows, t.a, t.nvalid, tid);
    } else {
      const int i0 = tid >> 3;
      const int32_t *sg = st.idx + segs, *bl = st.idx + bars;
      int cs = t.a, cb = t.b;
      seg_walk(sg, s_end, cs, cb, i0);
#pragma unroll
      for (int r = 0; r < LS::kRows; ++r) {
        rows[r] = i0 + LS::kStep * r < t.nvalid ? (int64_t)bl[cb] : -1;
        if (r + 1 < LS::kRows) seg_walk(sg, s_end, cs, cb, LS::kStep);
      }
    }
  }
};

/* Bytes reserved for a TileRing at the end of a kernel's dynamic shared
 * memory (a multiple of 128). */
constexpr int kRingBytes = (int)((sizeof(TileRing) + 127) / 128 * 128);

/* ---- key-major walk (dK/dV, fused backward) ---- */

/* One streamed 64-row query tile of a key-major item: rows row0 + i (i <
 * nvalid) of head h; key slots outside [jlo, jhi) take no part; causal: on
 * the diagonal block, mask c + off > r. */
struct QTile2 {
  int h, nvalid, causal, off, jlo, jhi;
  int64_t row0;
};

/* Bar tiles t and t + 1 form one 128-key item when t holds bars [b0, b0 +
 * 64) with b0 % 128 == 0 and t + 1 is the next 64 bars of the same head
 * (always so for cuda_step.c's tiles but the last odd one of a head). */
__device__ __forceinline__ bool bar_tiles_pair(const cuda_step_t &st, int t) {
  if (t < 0 || t + 1 >= st.num_bar_tiles) return false;
  const int32_t *a = st.bt_tile + 3 * t;
  return a[1] % 128 == 0 && a[2] - a[1] == 64 && a[3] == a[0] && a[4] == a[2];
}

/* The query tiles of a key-major item of BN keys.
 * Runs (key tile kt of local block kb, BN keys from kt * BN): the entries
 * (h, qb) of kv_ent, every 64-row tile of qb's valid rows; on the diagonal
 * block of a causal step from the first tile that holds a query at or after
 * the key tile's first key. Bars (one bar tile [b0, b1), or a pair [b0,
 * b2)): the entries (qb, lo, hi) of the first tile, then those of the
 * second tile whose segment starts at or after b1 (the others met the first
 * tile and were walked with it); key slots [max(lo, b0), min(hi, b_end)) -
 * b0. */
struct QWalk2 {
  int bars;
  int e, e_end, e_mid, qt, qt_end, h, nr, jlo, jhi, diag;
  int64_t rbase;
  int kpos, nk; /* runs: first key position in the block, valid keys */
  int64_t gk;   /* runs: the key block's global index; -1 in a non-causal step */
  int h_bar, b0, b1, b_end;

  __device__ __forceinline__ bool next(const cuda_step_t &st, QTile2 &t) {
    while (qt >= qt_end) {
      if (++e >= e_end) return false;
      int qb;
      if (bars) {
        qb = st.bt_ent[3 * e];
        const int lo = st.bt_ent[3 * e + 1], hi = st.bt_ent[3 * e + 2];
        if (e >= e_mid && lo < b1) continue; /* walked with the first tile */
        h = h_bar;
        jlo = max(lo, b0) - b0;
        jhi = min(hi, b_end) - b0;
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
      qt = diag ? kpos / kKT : 0;
      qt_end = jlo < jhi ? (nr + kKT - 1) / kKT : 0;
    }
    t.h = h;
    t.row0 = rbase + (int64_t)qt * kKT;
    t.nvalid = min(kKT, nr - qt * kKT);
    t.off = kpos - qt * kKT;
    t.causal = diag && t.off + (jhi - 1) > 0;
    t.jlo = jlo;
    t.jhi = jhi;
    ++qt;
    return true;
  }
};

/* Run item u of a key-major launch of BN-key items (u in [0, number of run
 * items), in the grid's order: key tile ktg = u / Hkv of the step, the kv
 * heads of one key tile together): kv head hk, local key block kb,
 * key tile kt of the block, and x, the item's (hk, kb) index into kv_off. */
__device__ __forceinline__ void kv_run_item(const cuda_step_t &st, int BN, unsigned u, int &hk,
                                            int &kb, int &kt, int &x) {
  const int tpb = st.G / BN;
  const int ktg = (int)(u / (unsigned)st.Hkv);
  hk = (int)(u % (unsigned)st.Hkv);
  kb = ktg / tpb;
  kt = ktg - kb * tpb;
  x = hk * st.num_k_blocks + kb;
}

/* The key-major item of CTA blockIdx.x with BN keys (64 or 128; the
 * cuda_kv_items grid): bar items first (block indices [0, num_bar_tiles):
 * one bar tile, or with BN = 128 a pair of them), then the run key tiles
 * (kv head, key tile of BN keys): one CTA per item over its whole entry
 * range. With a work list (st.kv_work, the long-item split) one CTA per
 * part instead: part w = blockIdx.x walks the entries [e0, e1) of its item,
 * a bar item (item < num_bar_tiles: the bar tile, or the first of a pair)
 * or a run item (item - num_bar_tiles); the grid is a bound, CTAs past the
 * parts exit.
 * Sets the query walk qw (qw.bars: a bar item, its keys gathered through the
 * bar list), the kv head hk, the item's keys nk and row0 (runs: first local
 * key row; bars: first bar scratch row), and slot: the part's scratch slot
 * when its item is split (its rows are WRITTEN to st.kv_dk_part /
 * kv_dv_part rows slot * BN.., and kv_split_reduce_kernel adds them, or for
 * a bar item writes their sum to its bar scratch rows), else -1. False: the
 * CTA has nothing to do (the second tile of a bar pair, a key tile past the
 * block's rows, or no part). Uniform over the CTA. */
__device__ __forceinline__ bool kv_item_begin(const cuda_step_t &st, int BN, QWalk2 &qw, int &hk,
                                              int &nk, int64_t &row0, int &slot) {
  slot = -1;
  unsigned item = blockIdx.x;
  int e0 = 0, e1 = 0;
  if (st.kv_work) {
    if (item >= (unsigned)st.kv_work[0]) return false; /* past the parts */
    const int32_t *w = st.kv_work + CUDA_KV_WORK_HEADER + 4 * (size_t)item;
    item = (unsigned)w[0];
    e0 = w[1];
    e1 = w[2];
    slot = w[3];
  }
  const bool bars = (int)item < st.num_bar_tiles;
  qw.bars = bars;
  qw.qt = qw.qt_end = 0;
  qw.kpos = 0;
  qw.nk = 0;
  qw.gk = -1;
  qw.h_bar = qw.b0 = qw.b1 = qw.b_end = 0;
  qw.h = qw.nr = qw.jlo = qw.jhi = qw.diag = 0;
  qw.rbase = 0;
  if (bars) {
    const int t = (int)item;
    if (BN == 128 && bar_tiles_pair(st, t - 1)) return false; /* walked with tile t - 1 */
    const bool pair = BN == 128 && bar_tiles_pair(st, t);
    qw.h_bar = st.bt_tile[3 * t];
    qw.b0 = st.bt_tile[3 * t + 1];
    qw.b1 = st.bt_tile[3 * t + 2];
    qw.b_end = pair ? st.bt_tile[3 * t + 5] : qw.b1;
    nk = min(BN, qw.b_end - qw.b0);
    if (nk <= 0) return false;
    hk = qw.h_bar / st.group;
    row0 = st.head_meta[(int64_t)qw.h_bar * CUDA_HM_STRIDE + CUDA_HM_BAR_BASE] + qw.b0;
    if (!st.kv_work) {
      e0 = st.bt_off[t];
      e1 = st.bt_off[pair ? t + 2 : t + 1];
    }
    qw.e = e0 - 1;
    qw.e_end = e1;
    qw.e_mid = st.bt_off[t + 1]; /* a pair's second tile from here (a single tile ends here) */
  } else {
    item -= (unsigned)st.num_bar_tiles;
    int kb, kt, x;
    kv_run_item(st, BN, item, hk, kb, kt, x);
    if (!st.kv_work) {
      e0 = st.kv_off[x];
      e1 = st.kv_off[x + 1];
    }
    const int64_t gk = st.k_block_global[kb];
    /* non-causal: -1, no query block's index, so no diagonal (QWalk2::next) */
    qw.gk = st.causal ? gk : -1;
    const int nc = block_rows_dev(st.k_tokens, st.G, kb, gk, st.seq_len);
    nk = min(BN, nc - kt * BN);
    if (nk <= 0) return false;
    qw.nk = nk;
    qw.kpos = kt * BN;
    row0 = (int64_t)kb * st.G + (int64_t)kt * BN;
    qw.e = e0 - 1;
    qw.e_end = e1;
    qw.e_mid = qw.e_end;
  }
  return true;
}

/* The query walk of a key-major item shared by the CTA, as TileRing for the
 * query-major kernels: thread 0 advances it in shared memory and publishes
 * query tile n in d[n % 3] two tiles ahead (h < 0: end of the walk), and
 * the item's output rows, read back by the epilogue. */
struct QRing {
  QWalk2 w;
  /* 16-byte granules of their own, as in TileRing: a widened load of one
   * group never covers bytes that thread 0 writes meanwhile */
  alignas(16) QTile2 d[3];
  /* runs: first local key row; bars: first scratch row; parts of a split
   * item: first part scratch row (slot * BN) */
  alignas(16) int64_t krow0;
  int hk, nk, bars, part;

  /* thread 0: the walk of an item (kv_item_begin), its first two query
   * tiles, and the item's output rows */
  __device__ __forceinline__ void start(const cuda_step_t &st, const QWalk2 &qw, int64_t row0,
                                        int hk_, int nk_, bool bars_, bool part_) {
    w = qw;
    produce(st, 0);
    produce(st, 1);
    krow0 = row0;
    hk = hk_;
    nk = nk_;
    bars = bars_;
    part = part_;
  }

  /* thread 0: the next query tile into d[slot] */
  __device__ __forceinline__ void produce(const cuda_step_t &st, int slot) {
    QWalk2 x = w;
    QTile2 t;
    if (!x.next(st, t)) t.h = -1;
    d[slot] = t;
    w = x;
  }
};

constexpr int kRingBytesQ = (int)((sizeof(QRing) + 127) / 128 * 128);

/* The source rows of a key-major item's K and V tile of BN rows, as loaded
 * by NT threads (LoadShape): the bars bar_list[b0 + i] of a bar item, the
 * run rows row0 + i of a run item; -1 past the nk keys. */
template <int NT, int BN>
__device__ __forceinline__ void kv_item_rows(int64_t (&rows)[LoadShape<NT, BN>::kRows],
                                             const cuda_step_t &st, const QWalk2 &qw, int64_t row0,
                                             int nk, int tid) {
  if (qw.bars) {
    const int32_t *bar_list =
        st.idx + st.head_meta[(int64_t)qw.h_bar * CUDA_HM_STRIDE + CUDA_HM_BARS];
#pragma unroll
    for (int r = 0; r < LoadShape<NT, BN>::kRows; ++r) {
      const int i = (tid >> 3) + LoadShape<NT, BN>::kStep * r;
      rows[r] = i < nk ? (int64_t)bar_list[qw.b0 + i] : -1;
    }
  } else {
    contiguous_rows_n<NT, BN>(rows, row0, nk, tid);
  }
}

/* The dK and dV output rows of key kr of a key-major item (bars: a bar
 * item; part: a part of a split item, bar or run; krow0: the first scratch
 * row of either, or a run item's first local key row; hk: the kv head): a
 * part's slot rows (written; a part of a split bar item too), an unsplit bar
 * item's bar scratch rows (written), a run item's dk_acc / dv_acc rows
 * (added). */
__device__ __forceinline__ void kv_out_rows(const cuda_step_t &st, bool bars, bool part,
                                            int64_t krow0, int hk, int kr, int D, float *dk_acc,
                                            float *dv_acc, float *dk_bar, float *dv_bar,
                                            float *&dkr, float *&dvr) {
  if (part) {
    dkr = st.kv_dk_part + (krow0 + kr) * D;
    dvr = st.kv_dv_part + (krow0 + kr) * D;
  } else if (bars) {
    dkr = dk_bar + (krow0 + kr) * D;
    dvr = dv_bar + (krow0 + kr) * D;
  } else {
    dkr = dk_acc + ((krow0 + kr) * st.Hkv + hk) * D;
    dvr = dv_acc + ((krow0 + kr) * st.Hkv + hk) * D;
  }
}

/* The same for the item whose ring is r. */
__device__ __forceinline__ void kv_out_rows(const cuda_step_t &st, const QRing &r, int kr, int D,
                                            float *dk_acc, float *dv_acc, float *dk_bar,
                                            float *dv_bar, float *&dkr, float *&dvr) {
  kv_out_rows(st, r.bars != 0, r.part != 0, r.krow0, r.hk, kr, D, dk_acc, dv_acc, dk_bar, dv_bar,
              dkr, dvr);
}

/* Writes (bar scratch) or adds (owned accumulator rows) two floats. */
__device__ __forceinline__ void store_pair(float *p, float a, float b, bool add) {
  float2 *q = reinterpret_cast<float2 *>(p);
  if (add) {
    const float2 o = *q;
    a += o.x;
    b += o.y;
  }
  *q = make_float2(a, b);
}

/* Issues the loads of query tile t's LSE[64] and delta[64] into the buffer
 * at sl (zeros past nvalid), by threads 0..127. */
__device__ __forceinline__ void load_ld(uint32_t sl, const cuda_step_t &st, const float *lse_acc,
                                        const float *delta_acc, const QTile2 &t, int tid) {
  if (tid < 2 * kKT) {
    const int i = tid & (kKT - 1);
    const bool ok = i < t.nvalid;
    const float *src = tid < kKT ? lse_acc : delta_acc;
    cp_async4(sl + (uint32_t)(tid * 4), ok ? src + (t.row0 + i) * st.Hq + t.h : src, ok);
  }
}

/* ---- host side ---- */

/* The launches of the tensor-core kernels, one per kernel signature: the
 * checks of cuda_prepare_launch, then `blocks` CTAs (cuda_q_items or
 * cuda_kv_items; none: nothing to do) of `threads` threads with `smem`
 * bytes of dynamic shared memory on s->stream, then cuda_check_launch.
 * *attr is the kernel's record of its shared-memory attribute. */

/* Forward kernels: (step, q, k, v, o_acc, lse_acc). */
template <typename T>
inline mtrain_status_t
launch_fwd_kernel(cuda_state_t *s,
                  void (*kern)(cuda_step_t, const T *, const T *, const T *, float *, float *),
                  const char *who, const char *name, int64_t blocks, int threads, int smem,
                  cuda_smem_attr_t *attr, const cuda_step_t *st, const mtrain_fwd_step_args_t *a) {
  if (blocks <= 0) return MTRAIN_SUCCESS;
  mtrain_status_t rc =
      cuda_prepare_launch(s, (const void *)kern, who, name, blocks, 1, (size_t)smem, attr);
  if (rc != MTRAIN_SUCCESS) return rc;
  kern<<<(unsigned)blocks, threads, smem, (cudaStream_t)s->stream>>>(
      *st, (const T *)a->q, (const T *)a->k, (const T *)a->v, (float *)a->o_acc,
      (float *)a->lse_acc);
  return cuda_check_launch(name);
}

/* Query-major dQ kernels: (step, q, k, v, dout, lse, delta, dq_acc). */
template <typename T>
inline mtrain_status_t
launch_dq_kernel(cuda_state_t *s,
                 void (*kern)(cuda_step_t, const T *, const T *, const T *, const T *,
                              const float *, const float *, float *),
                 const char *who, const char *name, int64_t blocks, int threads, int smem,
                 cuda_smem_attr_t *attr, const cuda_step_t *st, const mtrain_bwd_step_args_t *a) {
  if (blocks <= 0) return MTRAIN_SUCCESS;
  mtrain_status_t rc =
      cuda_prepare_launch(s, (const void *)kern, who, name, blocks, 1, (size_t)smem, attr);
  if (rc != MTRAIN_SUCCESS) return rc;
  kern<<<(unsigned)blocks, threads, smem, (cudaStream_t)s->stream>>>(
      *st, (const T *)a->q, (const T *)a->k, (const T *)a->v, (const T *)a->dout,
      (const float *)a->lse_acc, (const float *)a->delta_acc, (float *)a->dq_acc);
  return cuda_check_launch(name);
}

/* Key-major backward kernels: (step, q, k, v, dout, lse, delta, dq_acc,
 * dk_acc, dv_acc, dk_bar, dv_bar), of bn-key items: the long-item split's
 * schedule kernel first (cuda_kv_split_begin: the grid becomes a bound of
 * the parts), the kernel, then the reduce of the split items' parts
 * (cuda_kv_split_end). */
template <typename T>
inline mtrain_status_t launch_kv_kernel(cuda_state_t *s,
                                        void (*kern)(cuda_step_t, const T *, const T *, const T *,
                                                     const T *, const float *, const float *,
                                                     float *, float *, float *, float *, float *),
                                        const char *who, const char *name, int bn, int threads,
                                        int smem, cuda_smem_attr_t *attr, const cuda_step_t *st,
                                        const mtrain_bwd_step_args_t *a, float *dk_bar,
                                        float *dv_bar) {
  int64_t blocks = cuda_kv_items(st, bn);
  if (blocks <= 0) return MTRAIN_SUCCESS;
  cuda_step_t sk = *st;
  mtrain_status_t rc = cuda_kv_split_begin(s, &sk, bn, &blocks);
  if (rc != MTRAIN_SUCCESS) return rc;
  rc = cuda_prepare_launch(s, (const void *)kern, who, name, blocks, 1, (size_t)smem, attr);
  if (rc != MTRAIN_SUCCESS) return rc;
  kern<<<(unsigned)blocks, threads, smem, (cudaStream_t)s->stream>>>(
      sk, (const T *)a->q, (const T *)a->k, (const T *)a->v, (const T *)a->dout,
      (const float *)a->lse_acc, (const float *)a->delta_acc, (float *)a->dq_acc,
      (float *)a->dk_acc, (float *)a->dv_acc, dk_bar, dv_bar);
  rc = cuda_check_launch(name);
  if (rc != MTRAIN_SUCCESS) return rc;
  return cuda_kv_split_end(s, &sk, bn, (float *)a->dk_acc, (float *)a->dv_acc, dk_bar, dv_bar);
}

} /* namespace mma2 */

#endif /* MTRAIN_ATTN_MMA2_COMMON_CUH */
