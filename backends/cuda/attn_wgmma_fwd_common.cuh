/* attn_wgmma_fwd_common.cuh (private): the device code that variant 3's two
 * forward kernels share (attn_wgmma_fwd.cu: wgmma_fwd_kernel, one CTA per
 * item, and wgmma_fwd_persistent_kernel, CTAs that loop over items): the CTA
 * shape and shared-memory layout, the control block of the stage ring, the
 * producer's rows of a key tile, and the consumer warpgroups' whole work on
 * one item (key tiles, online softmax, epilogue), written once so that the
 * two kernels compute every item with the same operations in the same order
 * (bitwise equal outputs). */
#ifndef MTRAIN_ATTN_WGMMA_FWD_COMMON_CUH
#define MTRAIN_ATTN_WGMMA_FWD_COMMON_CUH

#include <stdint.h>

#include "backends/cuda/attn_mma2.h"
#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/attn_wgmma_ptx.cuh"
#include "backends/cuda/cuda_internal.h"

namespace wg {

using mma::fast_exp2;
using mma::kLn2;
using mma::kLog2e;
using mma::ldsm_x4;
using mma::pack2;
using mma::smem_u32;
using mma2::KeyWalk2;
using mma2::kKT;
using mma2::KTile2;
using mma2::LoadShape;

/* Producer threads: one warpgroup, so that 4 warps keep the copies of
 * up to two tiles in flight (a single warp could not feed the consumers). */
constexpr int kProducers = 128;

/* Stages of (K, V) tiles: the producer keeps three tiles in flight while
 * the consumers read a fourth. */
constexpr int kFwdStages = 4;

/* Walk tiles (64 keys each, KeyWalk2) per stage: two at d 64, so that a
 * stage holds 128 keys and S = Q K^T is one m64n128k16 product per k-slice
 * (a stage of the same 32 KB as d 128's 64-key one); one at d 128. */
template <int D> constexpr int kStageHalves = D == 64 ? 2 : 1;
template <int D> constexpr int kStageKeys = D == 64 ? 2 * kKT : kKT; /* kStageHalves x kKT */

/* The walk tiles of one stage: h[0], then h[1] at d 64 (kind 0: the walk
 * ended after h[0]; its rows are loaded as zeros and masked). A stage
 * whose h[0] has kind 0 is an item's marker. */
struct StageTiles {
  KTile2 h[2];
};

/* The forward CTA: NWG consumer warpgroups (64 query rows each) and one
 * producer warpgroup. Shared memory: kStages stages of (K, V) panel tiles
 * (stage x: K at 2 * TBK * x, V at + TBK); NQ query tiles (the layout of
 * attn_mma_common.cuh, read with ldmatrix; NQ = 2 in the persistent
 * kernel, whose producer loads the next item's Q while the consumers work
 * on the current one); the control block (FwdCtl). 1024 bytes of slack
 * align the base to the 128-byte swizzle's 1024-byte period. */
constexpr int kFwdCtlBytes = 512; /* the control block's room (FwdCtl) */

template <int D, int NWG, int NQ = 1> struct FwdShape {
  static constexpr int NC = 128 * NWG;  /* consumer threads */
  static constexpr int NP = kProducers; /* producer threads */
  static constexpr int NT = NC + NP;
  static constexpr int BM = 64 * NWG;
  static constexpr int TBK = kStageKeys<D> * D * 2; /* K (or V) bytes of a stage */
  static constexpr int TBQ = BM * D * 2;
  static constexpr int kStages = kFwdStages;
  static constexpr int kQOff = kStages * 2 * TBK;
  static constexpr int kCtlOff = kQOff + NQ * TBQ;
  static constexpr int kSmem = kCtlOff + kFwdCtlBytes + 1024;
  static_assert(TBK % 1024 == 0, "panel tiles keep the 1024-byte alignment");
  static_assert(TBQ % 16 == 0, "query tiles keep the 16-byte alignment of ldmatrix");
  static_assert(mma2::fits_sm90(kSmem, 1), "shared memory per SM");
};

/* The registers of a forward kernel compiled for kMinBlocks CTAs per SM of
 * FwdShape<D, NWG>'s threads, and the consumer loop they allow:
 *  - one consumer warpgroup at two CTAs per SM (no kernel since the
 *    128-key stages at d 64; the persistent kernel at d 64 was compiled so
 *    before): 128 registers a thread at launch, of which the producer
 *    warpgroup gives 32 to the consumers (at 128 each, ptxas spilled 8
 *    bytes);
 *  - two consumer warpgroups: 168 at launch (384 threads), the producer
 *    keeps kProducerRegs and the consumers get the rest, so that their
 *    software-pipelined loop (two S fragments beside O and Q; at d 64 a
 *    128-key S) fits without spills; at 168 each d 128's does not (ptxas
 *    serializes the wgmma, C7512);
 *  - else every thread keeps its launch count (one warpgroup at one CTA
 *    per SM: 255).
 * kPipelined: the consumers run the software-pipelined loop of
 * fwd_consume_item (every case but d 128 with two warpgroups and no
 * registers moved, which no kernel compiles). */
template <int D, int NWG, int MIN_BLOCKS> struct FwdRegs {
  static constexpr int kMinBlocks = MIN_BLOCKS;
  static constexpr int NT = 128 * NWG + kProducers;
  static constexpr bool kMoveRegs = kMinBlocks == 2 || NWG == 2;
  static constexpr int kLaunchRegs = (65536 / (NT * kMinBlocks)) & ~7;
  static constexpr int kProducerRegs = kMinBlocks == 2 ? 96 : 64;
  static constexpr int kConsumerRegs =
      kMoveRegs ? ((NT * kLaunchRegs - kProducers * kProducerRegs) / (128 * NWG)) & ~7
                : kLaunchRegs;
  static constexpr bool kPipelined = D == 64 || NWG == 1 || kMoveRegs;
  /* the two consumer warpgroups take turns at issuing their products
   * (fwd_pingpong_start, fwd_consume_item, fwd_pingpong_end): at d 128;
   * at d 64 it measured 1.0-1.3% slower on an H200 (CUDA_KERNELS.md) */
  static constexpr bool kPingPong = kPipelined && NWG == 2 && D == 128;
  static_assert(!kMoveRegs ||
                    (kConsumerRegs > kLaunchRegs && kConsumerRegs <= 256 &&
                     NT * kLaunchRegs >= kProducers * kProducerRegs + 128 * NWG * kConsumerRegs),
                "setmaxnreg counts");
};

/* Ping-pong of two consumer warpgroups (FA3's recipe): in every iteration of
 * the pipelined loop a warpgroup waits for its turn (named barrier
 * kBarTurn0 + its index), issues its two products, and hands the turn to
 * the other (bar.arrive on the other's barrier), so that one warpgroup's
 * softmax runs while the other's products hold the tensor cores, instead
 * of both issuing at once and both waiting on their exponentials. Every
 * iteration is one turn of each warpgroup: both run the same tiles (every
 * item's tiles, masked where their rows do not reach them). Warpgroup 0
 * goes first: warpgroup 1 arrives once on warpgroup 0's barrier before its
 * first item (fwd_pingpong_start), and warpgroup 0 takes that last turn
 * after its last item (fwd_pingpong_end), so that no arrival is left
 * pending when the CTA ends. Each barrier then holds at most one pending
 * arrival: the other warpgroup's next arrival on it follows this
 * warpgroup's wait. */
constexpr int kBarTurn0 = 2; /* 2 and 3 (0: __syncthreads, 1: the consumers' Q) */
__device__ __forceinline__ void fwd_pingpong_start() {
  if ((threadIdx.x >> 7) == 1) named_barrier_arrive(kBarTurn0, 256);
}
__device__ __forceinline__ void fwd_pingpong_end() {
  if ((threadIdx.x >> 7) == 0) named_barrier(kBarTurn0, 256);
}

/* The control block: slot n of the stage ring (a key tile, or the marker
 * that ends an item's walk: kind == 0) sits in stage n % kFwdStages; the
 * producer publishes its descriptor in tile[] and completes full[] (one
 * arrival per producer thread, after its copies have landed); the
 * consumers complete empty[] (NC arrivals) once their products have read
 * the stage. The persistent kernel adds, per query buffer b, qfull[b] (the
 * producer's arrivals once an item's Q copies landed) and qempty[b] (the
 * consumers' arrivals once they read Q into registers), and qitem[b], the
 * index of the item whose Q the buffer holds (written by the producer
 * before its qfull arrival; -1: the CTA has no more items). */
struct FwdCtl {
  StageTiles tile[kFwdStages];
  uint64_t full[kFwdStages], empty[kFwdStages];
  uint64_t qfull[2], qempty[2];
  int qitem[2]; /* the item whose Q is in buffer b (-1: no more items) */
};
static_assert(sizeof(FwdCtl) <= kFwdCtlBytes, "control block");

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

/* The next stage of the walk: h[0] and, at d 64, h[1] (kind 0 when the
 * walk ends after h[0]). False at the walk's end (h[0].kind = 0: the
 * item's marker). */
template <int D>
__device__ __forceinline__ bool next_stage(const cuda_step_t &st, KeyWalk2 &w, StageTiles &t) {
  t.h[1] = KTile2{}; /* kind 0, and no field left undefined when the stage is copied */
  if (!w.next(st, t.h[0])) {
    t.h[0].kind = 0;
    return false;
  }
  if constexpr (kStageHalves<D> == 2)
    if (!w.next(st, t.h[1])) t.h[1].kind = 0;
  return true;
}

/* Issues the producer thread's copies of stage t's K and V rows into the
 * stage at sk (K at sk, V at sk + TBK), in the panel layout: half h's 64
 * rows at rows 64 h of the stage's panels (d 64: one panel of 128 rows),
 * an absent half (kind 0) as zeros. */
template <int D, typename T>
__device__ __forceinline__ void
producer_load_stage(const cuda_step_t &st, const StageTiles &t, const KeyWalk2 &w, int p,
                    uint32_t sk, const T *kbase, const T *vbase, int64_t kv_stride) {
  constexpr int TBK = kStageKeys<D> * D * 2;
  static_assert(kStageHalves<D> == 1 || D == 64, "two halves in one panel: d 64");
#pragma unroll
  for (int h = 0; h < kStageHalves<D>; ++h) {
    int64_t rows[kPRows];
    if (t.h[h].kind != 0) {
      producer_rows(st, t.h[h], w, p, rows);
    } else {
#pragma unroll
      for (int r = 0; r < kPRows; ++r) rows[r] = -1;
    }
    const uint32_t off = (uint32_t)(h * kKT * 128);
    mma2::load_rows_panel<D, kProducers, kKT>(sk + off, kbase, kv_stride, rows, p);
    mma2::load_rows_panel<D, kProducers, kKT>(sk + TBK + off, vbase, kv_stride, rows, p);
  }
}

/* The item that CTA b of a persistent grid of `grid` CTAs takes from wave w
 * (items w grid .. w grid + grid - 1 of the cuda_q_items order): b in even
 * waves, grid - 1 - b in odd ones, so that over two waves every CTA gets
 * about the same work when the items' lengths fall along the order (a
 * causal step's query tiles), where the plain stride b, b + grid, ... would
 * give CTA 0 the longest item of every wave. */
__device__ __forceinline__ unsigned persistent_item(unsigned w, unsigned b, unsigned grid) {
  return w * grid + ((w & 1u) ? grid - 1u - b : b);
}

/* Issues S += Q K^T for a stage (64 keys at d 128, 128 at d 64): NKS
 * wgmma k-slices, Q's A fragments from registers, K read K-major from the
 * panel tile at sK. At d 64 S is m64n128k16 and O = P V m64n64k16, never
 * products of the same shape: with both m64n64k16 (64-key stages), the
 * H200 computed the second and later key tiles wrong (deterministically;
 * one tile was right), which a one-tile test with the same instructions
 * does not show; the cause was not found (64-key stages at d 64 computed S
 * as two m64n32k16 per k-slice). */
template <int D, typename T>
__device__ __forceinline__ void qk_product(float (&s)[32 * kStageHalves<D>],
                                           const uint32_t (&qf)[D / 16][4], uint32_t sK) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t kaddr = sK + (uint32_t)((kk >> 2) * kKT * 128 + (kk & 3) * 32);
    if constexpr (D == 128)
      wgmma_m64n64k16<T, 0>(s, qf[kk], sw128_desc(kaddr, 16, 1024));
    else /* the stage's 128 keys: one panel of 128 rows */
      wgmma_m64n128k16<T, 0>(s, qf[kk], sw128_desc(kaddr, 16, 1024));
  }
}

/* The Q tile's A fragments of the calling consumer warp's 16 rows, from the
 * query tile at sQ (ldmatrix). */
template <int D>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qf)[D / 16][4], uint32_t sQ) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const mma::Frag<D> fr(lane);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldsm_x4(sQ + fr.A(warp * 16, 2 * kk), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
}

/* The consumer warpgroups' work on one query item (consumer threads only,
 * Q's A fragments in qf): the key tiles of stage-ring slots n0, n0 + 1, ...
 * up to the item's marker (kind 0), then the merge of the item's (lse, O)
 * into o_acc / lse_acc. Returns the slot after the marker. RELEASE_MARKER:
 * the consumers also release the marker's slot (arrive on its empty
 * barrier, after any product that read its stage has completed), which the
 * persistent kernel's producer waits for before it reuses the stage; the
 * one-item kernel never reuses it.
 *  - PIPELINED (FwdRegs::kPipelined): the loop is software-pipelined inside
 *    the warpgroup: S of tile n + 1 is issued before P V of tile n, and its
 *    softmax runs while P V is on the tensor cores (the producer publishes
 *    each tile as soon as it has landed, so that looking one tile ahead does
 *    not wait);
 *  - else (d 128 with two consumer warpgroups at 168 registers a thread:
 *    the second S fragment does not fit) one tile at a time;
 *  - PINGPONG (FwdRegs::kPingPong): the pipelined loop's products issued in
 *    turns of the two warpgroups (fwd_pingpong_start above). */
template <int D, typename T, int NWG, bool RELEASE_MARKER, bool PIPELINED, bool PINGPONG>
__device__ __forceinline__ int
fwd_consume_item(const cuda_step_t &st, const mma2::QItem &item, const uint32_t (&qf)[D / 16][4],
                 const FwdCtl &ctl, uint32_t sKV, uint32_t full0, uint32_t empty0, int n0,
                 float *__restrict__ o_acc, float *__restrict__ lse_acc) {
  using S = FwdShape<D, NWG>;
  constexpr int TBK = S::TBK, NST = S::kStages, BM = S::BM;
  constexpr int NO = D / 2;          /* O accumulators per thread (64 rows x D per warpgroup) */
  constexpr int H = kStageHalves<D>; /* walk tiles per stage */
  constexpr int NS = 32 * H;         /* S accumulators per thread (64 rows x the stage's keys) */
  /* the software pipeline of the consumer loop (below), where the
   * consumers' registers allow it (FwdRegs::kPipelined) */
  constexpr bool kPipelined = PIPELINED;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = item.h, qb = item.qb, qt = item.qt, rows_here = item.rows;
  const int g = lane >> 2, t4 = lane & 3;
  const int wgr0 = (warp >> 2) * 64; /* the warpgroup's first tile row */
  const int wr0 = warp * 16;         /* the warp's first tile row */
  const int64_t qrow0 = (int64_t)qb * st.G + (int64_t)qt * BM;
  (void)wgr0;

  /* o[4n + e]: C fragment of the warp's rows (e < 2: row g, else g + 8),
   * output columns 8n + 2 t4 + (e & 1). m[hh], l[hh]: running max (log2
   * domain, scale folded in) and the thread's partial sum of row
   * wr0 + 8 hh + g. */
  float o[NO];
#pragma unroll
  for (int x = 0; x < NO; ++x) o[x] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = st.scale * kLog2e;

  /* The stage's masked scores to probabilities in place (log2 domain,
   * scale folded in); the running max and sums move on, alpha[hh] is the
   * factor that O's row hh still needs. Returns whether a max of the warp
   * changed. Half hf of the stage (scores s[32 hf ..], keys 64 hf ..) is
   * masked by its walk tile t.h[hf] (kind 0: every key). */
  auto softmax = [&](float(&s)[NS], const StageTiles &st2, float(&alpha)[2]) -> bool {
  /* masked scores -inf (raw scores; the scale is applied below) */
#pragma unroll
    for (int hf = 0; hf < H; ++hf) {
      const KTile2 &t = st2.h[hf];
      const int nvalid = t.kind != 0 ? t.nvalid : 0;
      if (nvalid < kKT || (t.causal && t.off + kKT - 1 > wr0)) {
#pragma unroll
        for (int x = 0; x < 32; ++x) {
          const int col = (x >> 2) * 8 + 2 * t4 + (x & 1);
          const int row = wr0 + g + (((x >> 1) & 1) << 3);
          if (col >= nvalid || (t.causal && col + t.off > row)) s[32 * hf + x] = -INFINITY;
        }
      }
    }
    /* online softmax, row hh: s[4n + 2hh], s[4n + 2hh + 1] */
    bool changed = false;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < 8 * H; ++c)
        mx = fmaxf(mx, fmaxf(s[4 * c + 2 * hh], s[4 * c + 2 * hh + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mnew = fmaxf(m[hh], mx * sl2);
      changed |= mnew != m[hh];
      const float mu = mnew == -INFINITY ? 0.f : mnew; /* no key yet: exp2(-inf) = 0 */
      alpha[hh] = fast_exp2(m[hh] - mu);
      m[hh] = mnew;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < 8 * H; ++c) {
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
  uint32_t pa[4 * H][4];
  auto pack_p = [&](const float(&s)[NS]) {
#pragma unroll
    for (int j = 0; j < 4 * H; ++j) {
      pa[j][0] = pack2<T>(s[8 * j], s[8 * j + 1]);
      pa[j][1] = pack2<T>(s[8 * j + 2], s[8 * j + 3]);
      pa[j][2] = pack2<T>(s[8 * j + 4], s[8 * j + 5]);
      pa[j][3] = pack2<T>(s[8 * j + 6], s[8 * j + 7]);
    }
  };
  /* waits for the item's stage n (slot n0 + n); false at the item's marker */
  auto next_tile = [&](int n, StageTiles &t) -> bool {
    const int sn = (n0 + n) % NST;
    while (!mbar_try_wait(full0 + 8 * sn, (uint32_t)(((n0 + n) / NST) & 1))) {
    }
    t = ctl.tile[sn];
    return t.h[0].kind != 0;
  };
  /* O += P V over the stage at sk: each half's 64 keys (rows 64 h of V) */
  auto pv_product = [&](uint32_t sk) {
#pragma unroll
    for (int hf = 0; hf < H; ++hf)
      wgmma_regs_by_rows64<D, T>(o, *reinterpret_cast<const uint32_t(*)[4][4]>(&pa[4 * hf]),
                                 sk + TBK + (uint32_t)(hf * kKT * 128));
  };
  auto stage_k = [&](int n) { return sKV + (uint32_t)(((n0 + n) % NST) * 2 * TBK); };
  auto release = [&](int n) { mbar_arrive(empty0 + 8 * ((n0 + n) % NST)); };
  auto zero_s = [&](float(&s)[NS]) {
#pragma unroll
    for (int x = 0; x < NS; ++x) {
      s[x] = 0.f;
      reg_fence(s[x]); /* zeroed before the fence: zeroing sunk past it makes
                          ptxas serialize every wgmma of the kernel */
    }
  };

  float s[NS];
  float alpha[2];
  int marker; /* the item's marker: its tile index */
  if constexpr (kPipelined) {
    /* Software pipeline inside the warpgroup: while P_n V_n runs on the tensor
     * cores, the softmax of tile n + 1 (whose S was issued just before it)
     * runs on the other pipes. Per iteration: issue S_{n+1} = Q K_{n+1}^T,
     * issue O += P_n V_n, wait for S_{n+1}, softmax, wait for P_n V_n,
     * release stage n, rescale O, pack P_{n+1}. Every product is issued
     * unconditionally (a wgmma under a branch makes ptxas serialize all of
     * them, C7520): tiles that none of the warpgroup's rows reach are masked
     * to P = 0, and at the walk's marker S reads a stale stage and is
     * dropped. */
    StageTiles t;
    bool have = next_tile(0, t);
    zero_s(s);
    wgmma_fence();
    qk_product<D, T>(s, qf, stage_k(0));
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int x = 0; x < NS; ++x) reg_fence(s[x]);
    if (have) {
      softmax(s, t, alpha); /* O is zero: nothing to rescale */
      pack_p(s);
    }
    marker = 0;
    for (int n = 0; have; ++n) {
      StageTiles t1;
      const bool have1 = next_tile(n + 1, t1);
      zero_s(s);
      if constexpr (PINGPONG) named_barrier(kBarTurn0 + (warp >> 2), 256); /* our turn */
      wgmma_fence();
      qk_product<D, T>(s, qf, stage_k(n + 1)); /* S_{n+1} */
      wgmma_commit();
      pv_product(stage_k(n)); /* O += P_n V_n */
      wgmma_commit();
      if constexpr (PINGPONG) named_barrier_arrive(kBarTurn0 + 1 - (warp >> 2), 256); /* theirs */
      wgmma_wait<1>(); /* S_{n+1} done */
#pragma unroll
      for (int x = 0; x < NS; ++x) reg_fence(s[x]);
      bool changed = false;
      if (have1) changed = softmax(s, t1, alpha);
      wgmma_wait<0>(); /* P_n V_n done */
#pragma unroll
      for (int x = 0; x < NO; ++x) reg_fence(o[x]);
#pragma unroll
      for (int j = 0; j < 4 * H; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) reg_fence_u(pa[j][r]);
      release(n); /* this thread's reads of stage n are done */
      if (have1) {
        if (changed) rescale(alpha);
        pack_p(s);
      }
      have = have1;
      marker = n + 1;
    }
  } else {
    /* one tile at a time: S, softmax, P V, each product waited for (64-key
     * stages only) */
    static_assert(H == 1, "the one-tile loop takes 64-key stages");
    for (int n = 0;; ++n) {
      StageTiles t;
      if (!next_tile(n, t)) {
        marker = n;
        break;
      }
      /* the warpgroup's 64 rows all padding, or all before the tile's keys
       * (uniform over the warpgroup, as wgmma requires) */
      const bool skip = wgr0 >= rows_here || (t.h[0].causal && t.h[0].off > wgr0 + 63);
      if (!skip) {
        zero_s(s);
        wgmma_fence();
        qk_product<D, T>(s, qf, stage_k(n));
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int x = 0; x < NS; ++x) reg_fence(s[x]);
        if (softmax(s, t, alpha)) rescale(alpha);
        pack_p(s);
        wgmma_fence();
        pv_product(stage_k(n)); /* O += P V */
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int x = 0; x < NO; ++x) reg_fence(o[x]);
      }
      release(n); /* this thread's reads of the stage are done */
    }
  }
  /* the marker's stage (read by the dropped S at d 64, whose product has
   * completed at the last wait) */
  if constexpr (RELEASE_MARKER) release(marker);

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
  return n0 + marker + 1;
}

} /* namespace wg */

#endif /* MTRAIN_ATTN_WGMMA_FWD_COMMON_CUH */
