/* plan_kernels.cuh (private): the kernels that build the step tables of a
 * single-rank plan on the device (cuda_plan_build.h), entry for entry those
 * of the host plan builder (core/runtime/plan.c) packed by
 * cuda_step_tables_pack, for a whole batch of sequences in five launches:
 *
 *  1. aux_kernel, one CTA per (sequence, head): cuts the head's counts to the
 *     capacities and its lists to their valid prefix, and builds plan.c's
 *     tables of the head: the diagonal bitmap and the ranges of consecutive
 *     diagonals, the bars (the verticals, as int32), the distinct blocks that
 *     hold bars with the index of their first bar, and index_of (block ->
 *     its index among them, -1 where none);
 *  2. count_kernel, one thread per (sequence, head, query block): its runs,
 *     segments and pairs; one per (sequence, kv head, key block): its entries
 *     of the key-major lists; each bar tile's entry count (atomics on
 *     integers: the same sum in any order);
 *  3. scan_kernel, one CTA per (sequence, head): the run and segment offsets
 *     (in-place prefix sums), the head's pairs and head_meta; one CTA per
 *     sequence: the heads' bar and tile bases, kv_off, the bar tiles and
 *     their entry offsets, the padding tiles;
 *  4. fill_kernel, one thread per (sequence, head, query block): its runs and
 *     segments; one warp per (sequence, kv head, key block): its (h, qb)
 *     entries, h ascending then qb ascending (qb = kb + d for the head's
 *     diagonals d ascending: no atomics, a fixed order);
 *  5. tile_kernel, one CTA per (sequence, bar tile slot): the (qb, s0, s1)
 *     entries of the query blocks whose segments meet the tile, in qb order
 *     (a block prefix sum over the query blocks).
 *
 * Every region is sized from the capacities (seq_layout derives the bounds),
 * so the grids are known on the host; seq_layout, batch_layout and
 * batch_prepare (host) are the one description of where everything lies,
 * used by the launcher (cuda_plan_build.cu) and by the emulator test, and
 * run_stages is the one sequence of launches for both.
 *
 * Written in the subset of CUDA that the CPU emulator of tests/cuda_emu runs
 * (block barriers, shared memory, atomicAdd / atomicOr on unsigned):
 * MTRAIN_CUDA_EMU selects the emulator's shared memory, so CI checks these
 * kernels against the host plan without a GPU. Internal linkage (the inner
 * unnamed namespace), so that the emulator's CPU build links next to the
 * library's host stubs. */
#ifndef MTRAIN_CUDA_PLAN_KERNELS_CUH
#define MTRAIN_CUDA_PLAN_KERNELS_CUH

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backends/cuda/block_scan.cuh"
#include "backends/cuda/cuda_plan_build.h"

#ifdef MTRAIN_CUDA_EMU
#define PLAN_SMEM(name) unsigned char *name = emu::smem_base()
#else
#define PLAN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace plan {
namespace {

constexpr int kThreads = 256;        /* threads of every CTA */
constexpr int kPer = 8;              /* consecutive elements per thread in a block prefix sum */
constexpr int kTile = CUDA_BAR_TILE; /* bars per bar tile */
constexpr int64_t kMaxGrid = 8192;   /* CTAs of a grid-stride launch */
constexpr size_t kSmem = kThreads * sizeof(long long); /* the block scans' buffer */

__host__ __device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- where everything lies (host) ------------------------------------------ */

/* One sequence's part of `dev`: capacities, the int32 region of its tables
 * (offsets in int32 units from its start, as cuda_step_tables_t), then the
 * builder's scratch (byte offsets from the sequence's base). */
struct SeqLayout {
  int64_t N, nb;
  int64_t Cv, Cd;     /* verticals, diagonals a head may keep: min(cap, N) and min(cap, nb) */
  int64_t Bcap, Tcap; /* distinct bar blocks, bar tiles of a head */
  int64_t cap_runs, cap_segs, cap_bent; /* runs, segments, bar entries of a head */
  int64_t cap_kv, tiles;                /* kv entries, bar tiles of the sequence */
  /* a head's arrays, from idx + h * hstride: run_off at 0, then runs, seg_off, segs, bars */
  int64_t hstride, o_runs, o_seg_off, o_segs, o_bars;
  int64_t head_meta, idx, kv_off, kv_ent, bt_tile, bt_off, bt_ent, n_i32;
  size_t g64, i32; /* the identity block list (int64 [nb]), the int32 region */
  size_t aux, has_diag, range_lo, range_hi, bblock, bstart, index_of, tile_cnt, pairs_q;
  size_t bytes;
};

inline size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* sum_{i=0}^{n-1} floor((a i + b) / m) for n, m >= 1 and a, b >= 0 (the
 * Euclid-like reduction: whole parts of a / m and b / m are taken out, then
 * the sum is counted again with the roles of the axes swapped). No overflow
 * while a n + b and n^2 a / m stay below 2^62. */
inline int64_t floor_sum(int64_t n, int64_t m, int64_t a, int64_t b) {
  int64_t sum = 0;
  for (;;) {
    if (a >= m) {
      sum += (n - 1) * n / 2 * (a / m);
      a %= m;
    }
    if (b >= m) {
      sum += n * (b / m);
      b %= m;
    }
    const int64_t y = a * n + b;
    if (y < m) return sum;
    n = y / m;
    b = y % m;
    const int64_t t = m;
    m = a;
    a = t;
  }
}

/* Lays out one sequence of N tokens, granularity G, Hq query and Hkv kv
 * heads whose heads keep at most cap_v verticals and cap_d block diagonals
 * (arguments checked by the caller: N >= 1, G >= 1, Hq, Hkv >= 1, cap_v >=
 * 0, cap_d >= 1). 0: done; 1: beyond the 32-bit indices of the tables (or N
 * beyond the int32 bar positions).
 *
 * The bounds (nb blocks; Cv = min(cap_v, N), Cd = min(cap_d, nb); a head
 * keeps nv <= Cv verticals and nd <= Cd diagonals, 0 among them; every
 * bound is reached by some pattern, or nearly, as noted):
 *  - runs of query block q: one per maximal range of consecutive diagonals
 *    whose first diagonal is <= q (two ranges never give adjacent key
 *    blocks: a gap of at least one diagonal lies between them, so push_run
 *    never merges). The r-th range (from 0) starts at >= 2r, so at most
 *    floor(q/2) + 1 of them start <= q, and at most Cd ranges exist:
 *    runs(q) <= min(Cd, floor(q/2) + 1); summed over q in closed form
 *    (diagonals 0, 2, 4, ... reach it);
 *  - segments of q: maximal ranges of the nbb bar blocks before q with the
 *    excluded ones (block diagonal q - b a diagonal >= 1) between them: k
 *    segments need k - 1 excluded blocks between them, so k <= (nd - 1) + 1
 *    <= Cd, and 2k - 1 <= nbb, where nbb <= min(q, Cv) (distinct blocks
 *    below q, each holding a vertical): segs(q) <= min(Cd, ceil(min(q,
 *    Cv) / 2)), summed in closed form; 0 without verticals;
 *  - bars: nv <= Cv; bar tiles: ceil(nv / 64) <= Tcap = ceil(Cv / 64);
 *  - bar entries of q: each segment gives one entry per tile it meets, i.e.
 *    1 + the tile boundaries (multiples of 64) strictly inside it; the
 *    segments are disjoint and lie in the first m <= min(Cv, q G) bars
 *    (those in blocks before q), which hold ceil(m / 64) - 1 boundaries:
 *    entries(q) <= segs(q) + ceil(min(Cv, q G) / 64) - 1 for q >= 1 (the
 *    sum over q uses floor_sum);
 *  - kv entries of a head: the (qb, kb) with qb - kb a diagonal d, nb - d of
 *    them for each d, at most sum_{d < Cd} (nb - d) (diagonals 0..Cd-1 reach
 *    it); Hq heads. */
inline int seq_layout(int64_t N, int32_t G, int32_t Hq, int32_t Hkv, int32_t cap_v, int32_t cap_d,
                      SeqLayout *L) {
  memset(L, 0, sizeof *L);
  if (N > INT32_MAX) return 1;
  const int64_t nb = (N + G - 1) / G;
  const int64_t Cv = lmin(cap_v, N), Cd = lmin(cap_d, nb);
  L->N = N;
  L->nb = nb;
  L->Cv = Cv;
  L->Cd = Cd;
  L->Bcap = lmin(Cv, nb);
  L->Tcap = (Cv + kTile - 1) / kTile;
  /* runs: sum_{q < K} (floor(q/2) + 1) + (nb - K) Cd, K = min(nb, 2 Cd) */
  int64_t K = lmin(nb, 2 * Cd);
  L->cap_runs = (K / 2) * ((K - 1) / 2) + K + (nb - K) * Cd;
  /* segments: sum_q min(M, ceil(q/2)), M = min(Cd, ceil(Cv/2)); ceil(q/2) <= M for q <= 2M */
  const int64_t M = lmin(Cd, (Cv + 1) / 2);
  K = lmin(nb, 2 * M + 1);
  L->cap_segs = Cv > 0 ? (K / 2) * ((K + 1) / 2) + (nb - K) * M : 0;
  /* bar entries: segments + sum_{q=1}^{nb-1} (ceil(min(Cv, q G) / 64) - 1) */
  if (Cv > 0) {
    const int64_t Q = lmin(nb - 1, (Cv - 1) / G); /* q in [1, Q]: q G < Cv */
    const int64_t below = Q > 0 ? floor_sum(Q, kTile, G, G + kTile - 1) : 0;
    L->cap_bent = L->cap_segs + below + (nb - 1 - Q) * L->Tcap - (nb - 1);
  }
  const int64_t kv_head = Cd * nb - Cd * (Cd - 1) / 2;
  if (L->cap_runs > INT32_MAX || L->cap_segs > INT32_MAX || kv_head > INT32_MAX ||
      L->cap_bent > INT32_MAX)
    return 1;
  L->hstride = 2 * (nb + 1) + 2 * L->cap_runs + 2 * L->cap_segs + Cv;
  if (L->hstride > INT32_MAX) return 1;
  L->o_runs = nb + 1;
  L->o_seg_off = L->o_runs + 2 * L->cap_runs;
  L->o_segs = L->o_seg_off + nb + 1;
  L->o_bars = L->o_segs + 2 * L->cap_segs;
  L->cap_kv = Hq * kv_head;
  L->tiles = Hq * L->Tcap;
  L->head_meta = 0;
  L->idx = (int64_t)Hq * CUDA_HM_STRIDE;
  L->kv_off = L->idx + Hq * L->hstride;
  L->kv_ent = L->kv_off + (int64_t)Hkv * nb + 1;
  L->bt_tile = L->kv_ent + 2 * L->cap_kv;
  L->bt_off = L->bt_tile + 3 * L->tiles;
  L->bt_ent = L->bt_off + L->tiles + 1;
  L->n_i32 = L->bt_ent + 3 * Hq * L->cap_bent;
  if (L->n_i32 > INT32_MAX) return 1;
  L->cap_bent *= Hq; /* from here on: the sequence's */
  size_t off = 0;
  const size_t H = (size_t)Hq;
  L->g64 = off;
  off += align256((size_t)nb * sizeof(int64_t));
  L->i32 = off;
  off += align256((size_t)L->n_i32 * sizeof(int32_t));
  L->aux = off;
  off += align256(H * 32); /* HeadAux */
  L->has_diag = off;
  off += align256(H * (size_t)nb);
  L->range_lo = off;
  off += align256(H * (size_t)Cd * sizeof(int32_t));
  L->range_hi = off;
  off += align256(H * (size_t)Cd * sizeof(int32_t));
  L->bblock = off;
  off += align256(H * (size_t)L->Bcap * sizeof(int32_t));
  L->bstart = off;
  off += align256(H * (size_t)(L->Bcap + 1) * sizeof(int32_t));
  L->index_of = off;
  off += align256(H * (size_t)nb * sizeof(int32_t));
  L->tile_cnt = off;
  off += align256(H * (size_t)L->Tcap * sizeof(unsigned));
  L->pairs_q = off;
  off += align256(H * (size_t)nb * sizeof(int64_t));
  L->bytes = off;
  return 0;
}

/* `dev`: the error word at CUDA_PLAN_ERR_OFFSET, the pairs (int64 [count *
 * Hq]) at kPairsOffset, then the sequences at base[s] (256-byte aligned). */
constexpr size_t kPairsOffset = 256;

/* Lays out the batch (geometry checked by the caller): L[s] and base[s] for
 * every sequence, *bytes in all. 0: done; 1: sequence *bad is beyond the
 * 32-bit indices. */
inline int batch_layout(const cuda_plan_geom_t *g, SeqLayout *L, size_t *base, size_t *bytes,
                        int32_t *bad) {
  size_t off = kPairsOffset + align256((size_t)g->count * (size_t)g->num_heads * sizeof(int64_t));
  for (int32_t s = 0; s < g->count; s++) {
    const cuda_plan_seq_t *q = &g->seqs[s];
    if (seq_layout(q->seq_len, g->granularity, g->num_heads, g->num_kv_heads, q->cap_verticals,
                   q->cap_diagonals, &L[s])) {
      *bad = s;
      return 1;
    }
    base[s] = off;
    off += L[s].bytes;
  }
  *bytes = off;
  return 0;
}

/* ---- what the kernels read ------------------------------------------------- */

/* A head's summary (aux_kernel; bases: scan_kernel). */
struct HeadAux {
  int32_t nv, nd;    /* the verticals and diagonals used (cut as cuda_plan_build.h says) */
  int32_t nranges;   /* maximal ranges of consecutive diagonals */
  int32_t nblocks;   /* distinct blocks holding bars */
  int32_t bar_base;  /* bars of the heads before it */
  int32_t tile_base; /* bar tiles of the heads before it */
  uint32_t err;      /* CUDA_PLAN_ERR_* found in its pattern */
  int32_t pad;
};
static_assert(sizeof(HeadAux) == 32, "seq_layout sizes HeadAux as 32 bytes");

/* One sequence, device pointers (batch_prepare). */
struct Seq {
  int64_t N, nb, Cv, Cd, Bcap, Tcap, cap_v, cap_d;
  int64_t cap_runs, cap_segs, cap_bent, cap_kv, tiles;
  int64_t hstride, o_runs, o_seg_off, o_segs, o_bars;
  int32_t G, Hq, Hkv, group;
  const int32_t *counts; /* the pattern (cuda_plan_seq_t) */
  const int64_t *verticals;
  const int32_t *diagonals;
  int64_t *g64; /* the tables */
  int32_t *head_meta, *idx, *kv_off, *kv_ent, *bt_tile, *bt_off, *bt_ent;
  int64_t *pairs;               /* [Hq] */
  HeadAux *aux;                 /* the scratch, per head: */
  uint8_t *has_diag;            /* [nb] */
  int32_t *range_lo, *range_hi; /* [Cd] */
  int32_t *bblock, *bstart;     /* [Bcap], [Bcap + 1] */
  int32_t *index_of;            /* [nb] */
  unsigned *tile_cnt;           /* [Tcap] */
  int64_t *pairs_q;             /* [nb] */
};

/* The batch: every kernel's one argument. first_*[s]: the items of the
 * sequences before s (count + 1 entries); the totals are the last ones. */
struct Batch {
  const Seq *seqs;
  const int64_t *first_heads; /* Hq per sequence */
  const int64_t *first_q;     /* Hq * nb */
  const int64_t *first_kv;    /* Hkv * nb */
  const int64_t *first_tiles; /* Hq * Tcap */
  int64_t heads, q_items, kv_items, tiles;
  int32_t count;
  uint32_t *err;
};

/* The uploaded table: Seq [count], then the four prefix arrays. */
struct TableLayout {
  size_t seqs, first_heads, first_q, first_kv, first_tiles, bytes;
};

inline TableLayout table_layout(int32_t count) {
  TableLayout t;
  const size_t pre = align256((size_t)(count + 1) * sizeof(int64_t));
  t.seqs = 0;
  t.first_heads = align256((size_t)count * sizeof(Seq));
  t.first_q = t.first_heads + pre;
  t.first_kv = t.first_q + pre;
  t.first_tiles = t.first_kv + pre;
  t.bytes = t.first_tiles + pre;
  return t;
}

/* Host: writes the table of the batch into table_host (table_layout bytes),
 * whose copy the kernels read at table_dev; fills *b (pointers into
 * table_dev and dev), steps[s] and *pairs_dev (pointers into dev). L and
 * base from batch_layout. */
inline void batch_prepare(const cuda_plan_geom_t *g, const SeqLayout *L, const size_t *base,
                          char *dev, char *table_host, char *table_dev, Batch *b,
                          cuda_step_t *steps, int64_t **pairs_dev) {
  const TableLayout T = table_layout(g->count);
  Seq *seqs = (Seq *)(table_host + T.seqs);
  int64_t *fh = (int64_t *)(table_host + T.first_heads), *fq = (int64_t *)(table_host + T.first_q);
  int64_t *fk = (int64_t *)(table_host + T.first_kv), *ft = (int64_t *)(table_host + T.first_tiles);
  const int32_t Hq = g->num_heads, Hkv = g->num_kv_heads, G = g->granularity;
  int64_t *pairs = (int64_t *)(dev + kPairsOffset);
  fh[0] = fq[0] = fk[0] = ft[0] = 0;
  for (int32_t s = 0; s < g->count; s++) {
    const SeqLayout &l = L[s];
    const cuda_plan_seq_t &in = g->seqs[s];
    char *sb = dev + base[s];
    int32_t *i32 = (int32_t *)(sb + l.i32);
    Seq &p = seqs[s];
    memset(&p, 0, sizeof p);
    p.N = l.N;
    p.nb = l.nb;
    p.Cv = l.Cv;
    p.Cd = l.Cd;
    p.Bcap = l.Bcap;
    p.Tcap = l.Tcap;
    p.cap_v = in.cap_verticals;
    p.cap_d = in.cap_diagonals;
    p.cap_runs = l.cap_runs;
    p.cap_segs = l.cap_segs;
    p.cap_bent = l.cap_bent;
    p.cap_kv = l.cap_kv;
    p.tiles = l.tiles;
    p.hstride = l.hstride;
    p.o_runs = l.o_runs;
    p.o_seg_off = l.o_seg_off;
    p.o_segs = l.o_segs;
    p.o_bars = l.o_bars;
    p.G = G;
    p.Hq = Hq;
    p.Hkv = Hkv;
    p.group = Hq / Hkv;
    p.counts = in.counts;
    p.verticals = in.verticals;
    p.diagonals = in.diagonals;
    p.g64 = (int64_t *)(sb + l.g64);
    p.head_meta = i32 + l.head_meta;
    p.idx = i32 + l.idx;
    p.kv_off = i32 + l.kv_off;
    p.kv_ent = i32 + l.kv_ent;
    p.bt_tile = i32 + l.bt_tile;
    p.bt_off = i32 + l.bt_off;
    p.bt_ent = i32 + l.bt_ent;
    p.pairs = pairs + (int64_t)s * Hq;
    p.aux = (HeadAux *)(sb + l.aux);
    p.has_diag = (uint8_t *)(sb + l.has_diag);
    p.range_lo = (int32_t *)(sb + l.range_lo);
    p.range_hi = (int32_t *)(sb + l.range_hi);
    p.bblock = (int32_t *)(sb + l.bblock);
    p.bstart = (int32_t *)(sb + l.bstart);
    p.index_of = (int32_t *)(sb + l.index_of);
    p.tile_cnt = (unsigned *)(sb + l.tile_cnt);
    p.pairs_q = (int64_t *)(sb + l.pairs_q);
    fh[s + 1] = fh[s] + Hq;
    fq[s + 1] = fq[s] + Hq * l.nb;
    fk[s + 1] = fk[s] + Hkv * l.nb;
    ft[s + 1] = ft[s] + l.tiles;
    cuda_step_t &st = steps[s];
    memset(&st, 0, sizeof st);
    st.G = G;
    st.Hq = Hq;
    st.Hkv = Hkv;
    st.group = Hq / Hkv;
    st.num_q_blocks = st.num_k_blocks = (int32_t)l.nb;
    st.causal = 1;
    st.seq_len = st.q_tokens = st.k_tokens = l.N;
    st.q_block_global = st.k_block_global = p.g64;
    st.head_meta = p.head_meta;
    st.idx = p.idx;
    st.kv_off = p.kv_off;
    st.kv_ent = p.kv_ent;
    st.bt_tile = p.bt_tile;
    st.bt_off = p.bt_off;
    st.bt_ent = p.bt_ent;
    st.num_bar_tiles = (int32_t)l.tiles;
    st.total_bars = (int32_t)(Hq * l.Cv);
    st.max_runs_per_item = 0;
  }
  const int32_t n = g->count;
  b->seqs = (const Seq *)(table_dev + T.seqs);
  b->first_heads = (const int64_t *)(table_dev + T.first_heads);
  b->first_q = (const int64_t *)(table_dev + T.first_q);
  b->first_kv = (const int64_t *)(table_dev + T.first_kv);
  b->first_tiles = (const int64_t *)(table_dev + T.first_tiles);
  b->heads = fh[n];
  b->q_items = fq[n];
  b->kv_items = fk[n];
  b->tiles = ft[n];
  b->count = n;
  b->err = (uint32_t *)(dev + CUDA_PLAN_ERR_OFFSET);
  *pairs_dev = pairs;
}

/* ---- device helpers ---------------------------------------------------------- */

/* The sequence of a batch that holds item x: first[s] <= x < first[s + 1]
 * (sequences without items skipped: the last s with first[s] <= x). */
__device__ __forceinline__ int32_t batch_find(const int64_t *first, int32_t count, int64_t x) {
  int32_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (first[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/* Entries of the increasing a[0..n) that are <= x (upper bound). */
__device__ __forceinline__ int32_t count_le(const int32_t *a, int32_t n, int64_t x) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (a[mid] <= x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Entries of the increasing a[0..n) that are < x (lower bound). */
__device__ __forceinline__ int32_t count_lt(const int32_t *a, int32_t n, int64_t x) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (a[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The sum (min: the minimum) of one value per thread, for every thread. */
__device__ __forceinline__ long long block_reduce(long long v, long long *buf, bool min_op) {
  const int t = (int)threadIdx.x;
  buf[t] = v;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (t < w) buf[t] = min_op ? lmin(buf[t], buf[t + w]) : buf[t] + buf[t + w];
    __syncthreads();
  }
  const long long r = buf[0];
  __syncthreads();
  return r;
}

/* The prefix sums of value(i) over i in [0, n), by the CTA: emit(i, ex, v)
 * with v = value(i) and ex = the sum of the values before i. Each thread
 * owns kPer consecutive elements of a chunk of kThreads * kPer; value(i) is
 * called once, before the chunk's barriers, emit after them, by the same
 * thread (so emit may overwrite what value read). Returns the total. Every
 * thread must call it. */
template <class Value, class Emit>
__device__ __forceinline__ long long block_prefix(int64_t n, long long *buf, Value &&value,
                                                  Emit &&emit) {
  const int t = (int)threadIdx.x;
  long long carry = 0;
  for (int64_t lo = 0; lo < n; lo += (int64_t)kThreads * kPer) {
    const int64_t i0 = lo + (int64_t)t * kPer;
    long long v[kPer], sum = 0;
#pragma unroll
    for (int e = 0; e < kPer; e++) {
      v[e] = i0 + e < n ? (long long)value(i0 + e) : 0;
      sum += v[e];
    }
    long long total;
    long long ex = carry + bscan::block_scan<kThreads>(sum, buf, &total);
#pragma unroll
    for (int e = 0; e < kPer; e++) {
      if (i0 + e >= n) break;
      emit(i0 + e, ex, v[e]);
      ex += v[e];
    }
    carry += total;
  }
  return carry;
}

/* Turns the counts a[1..n] into offsets a[0..n] (a[0] = 0) in place;
 * returns the total. */
__device__ __forceinline__ long long scan_counts(int32_t *a, int64_t n, long long *buf) {
  const long long total = block_prefix(
      n, buf, [&](int64_t i) { return (long long)a[1 + i]; },
      [&](int64_t i, long long ex, long long v) { a[1 + i] = (int32_t)(ex + v); });
  if (threadIdx.x == 0) a[0] = 0;
  return total;
}

/* A head's tables (the pattern's, the scratch's and its own arrays). */
struct HeadView {
  HeadAux a;
  const int32_t *D, *rlo, *rhi, *bbk, *bst, *iof;
  const uint8_t *hd;
  int32_t *run_off, *runs, *seg_off, *segs, *bars;
  unsigned *tc;
};

__device__ __forceinline__ HeadView head_view(const Seq &P, int64_t h) {
  HeadView v;
  v.a = P.aux[h];
  v.D = P.diagonals + h * (P.nb + 1);
  v.rlo = P.range_lo + h * P.Cd;
  v.rhi = P.range_hi + h * P.Cd;
  v.bbk = P.bblock + h * P.Bcap;
  v.bst = P.bstart + h * (P.Bcap + 1);
  v.iof = P.index_of + h * P.nb;
  v.hd = P.has_diag + h * P.nb;
  int32_t *base = P.idx + h * P.hstride;
  v.run_off = base;
  v.runs = base + P.o_runs;
  v.seg_off = base + P.o_seg_off;
  v.segs = base + P.o_segs;
  v.bars = base + P.o_bars;
  v.tc = P.tile_cnt + h * P.Tcap;
  return v;
}

/* The runs of query block qb, from the earliest key block (plan.c's
 * runs_vertical_slash on one rank): emit(lo, hi) for key blocks [lo, hi). */
template <class F>
__device__ __forceinline__ void walk_runs(const HeadView &v, int32_t qb, F &&emit) {
  for (int32_t r = count_le(v.rlo, v.a.nranges, qb) - 1; r >= 0; r--) {
    const int32_t hi = v.rhi[r] < qb ? v.rhi[r] : qb;
    emit(qb - hi, qb - v.rlo[r] + 1);
  }
}

/* The segments of query block qb (plan.c's segs_for_query, the same choice
 * of walk): emit(s0, s1) for bar indices [s0, s1), ascending. */
template <class F>
__device__ __forceinline__ void walk_segs(const HeadView &v, int32_t qb, F &&emit) {
  const int32_t nbb = count_lt(v.bbk, v.a.nblocks, qb); /* bar blocks before qb */
  if (nbb == 0) return;
  const int32_t nd = count_le(v.D, v.a.nd, qb); /* diagonals 0..qb */
  int32_t begin = 0;
  if (nd - 1 < nbb) {
    for (int32_t d = nd - 1; d >= 1; d--) {
      const int32_t b = v.iof[qb - v.D[d]];
      if (b < 0) continue;
      if (b > begin) emit(v.bst[begin], v.bst[b]);
      begin = b + 1;
    }
  } else {
    for (int32_t b = 0; b < nbb; b++) {
      if (!v.hd[qb - v.bbk[b]]) continue;
      if (b > begin) emit(v.bst[begin], v.bst[b]);
      begin = b + 1;
    }
  }
  if (begin < nbb) emit(v.bst[begin], v.bst[nbb]);
}

/* ---- the kernels --------------------------------------------------------------- */

/* Stage 1: one CTA per (sequence, head). */
__global__ void __launch_bounds__(kThreads) aux_kernel(Batch b) {
  PLAN_SMEM(smem);
  long long *buf = (long long *)smem;
  const int t = (int)threadIdx.x;
  if (blockIdx.x == 0 && t == 0) *b.err = 0; /* set again from scan_kernel on */
  const int32_t s = batch_find(b.first_heads, b.count, (int64_t)blockIdx.x);
  const Seq &P = b.seqs[s];
  const int64_t h = (int64_t)blockIdx.x - b.first_heads[s], nb = P.nb, G = P.G;
  const int64_t *V = P.verticals + h * P.N;
  const int32_t *D = P.diagonals + h * (nb + 1);
  /* the counts, cut to the capacities, then to the valid prefixes */
  uint32_t err = 0;
  int64_t nv = P.counts[2 * h], nd = P.counts[2 * h + 1];
  if (nv < 0 || nv > P.cap_v) err |= CUDA_PLAN_ERR_CAPACITY;
  if (nd < 0 || nd > P.cap_d) err |= CUDA_PLAN_ERR_CAPACITY;
  if (nv > P.Cv && nv <= P.cap_v) err |= CUDA_PLAN_ERR_PATTERN; /* more than N */
  if (nd > P.Cd && nd <= P.cap_d) err |= CUDA_PLAN_ERR_PATTERN; /* more than nb */
  nv = lmax(0, lmin(nv, P.Cv));
  nd = lmax(0, lmin(nd, P.Cd));
  long long bad_v = nv, bad_d = nd;
  for (int64_t i = t; i < nv; i += kThreads) {
    const int64_t x = V[i];
    if (x < 0 || x >= P.N || (i > 0 && x <= V[i - 1])) {
      bad_v = i;
      break;
    }
  }
  for (int64_t i = t; i < nd; i += kThreads) {
    const int32_t x = D[i];
    if (x >= nb || (i == 0 ? x != 0 : x <= D[i - 1])) {
      bad_d = i;
      break;
    }
  }
  bad_v = block_reduce(bad_v, buf, true);
  bad_d = block_reduce(bad_d, buf, true);
  if (bad_v < nv || bad_d < nd) err |= CUDA_PLAN_ERR_PATTERN;
  nv = bad_v;
  nd = bad_d;
  uint8_t *hd = P.has_diag + h * nb;
  int32_t *iof = P.index_of + h * nb;
  for (int64_t i = t; i < nb; i += kThreads) {
    hd[i] = 0;
    iof[i] = -1;
  }
  unsigned *tc = P.tile_cnt + h * P.Tcap;
  for (int64_t i = t; i < P.Tcap; i += kThreads) tc[i] = 0;
  __syncthreads();
  /* the diagonal bitmap and the maximal ranges of consecutive diagonals */
  int32_t *rlo = P.range_lo + h * P.Cd, *rhi = P.range_hi + h * P.Cd;
  const long long nranges = block_prefix(
      nd, buf, [&](int64_t i) { return i == 0 || D[i - 1] != D[i] - 1 ? 1 : 0; },
      [&](int64_t i, long long ex, long long f) {
        const int32_t x = D[i];
        hd[x] = 1;
        if (f) rlo[ex] = x;
        if (i == nd - 1 || D[i + 1] != x + 1) rhi[ex + f - 1] = x;
      });
  /* the bars, and the distinct blocks that hold them */
  int32_t *bars = P.idx + h * P.hstride + P.o_bars;
  int32_t *bbk = P.bblock + h * P.Bcap, *bst = P.bstart + h * (P.Bcap + 1);
  const long long nblocks = block_prefix(
      nv, buf, [&](int64_t i) { return i == 0 || V[i - 1] / G != V[i] / G ? 1 : 0; },
      [&](int64_t i, long long ex, long long f) {
        const int64_t x = V[i];
        bars[i] = (int32_t)x;
        if (!f) return;
        bbk[ex] = (int32_t)(x / G);
        bst[ex] = (int32_t)i;
        iof[x / G] = (int32_t)ex;
      });
  if (t == 0) {
    bst[nblocks] = (int32_t)nv;
    HeadAux a;
    a.nv = (int32_t)nv;
    a.nd = (int32_t)nd;
    a.nranges = (int32_t)nranges;
    a.nblocks = (int32_t)nblocks;
    a.bar_base = a.tile_base = 0;
    a.err = err;
    a.pad = 0;
    P.aux[h] = a;
  }
}

/* Stage 2, one query block: its run and segment counts (into run_off[qb +
 * 1], seg_off[qb + 1]), its pairs (plan.c's run_pairs and bars: the causal
 * diagonal block counts its lower triangle), and its bar entries per tile. */
__device__ __forceinline__ void count_query(const Seq &P, int64_t h, int32_t qb) {
  const HeadView v = head_view(P, h);
  const int64_t G = P.G, N = P.N, r = lmin(G, N - qb * G);
  int32_t nr = 0, ns = 0;
  int64_t keys = 0, nbars = 0;
  bool diag = false;
  walk_runs(v, qb, [&](int32_t lo, int32_t hi) {
    nr++;
    keys += lmin(hi * G, N) - lmin(lo * G, N);
    diag |= lo <= qb && qb < hi;
  });
  walk_segs(v, qb, [&](int32_t s0, int32_t s1) {
    ns++;
    nbars += s1 - s0;
    for (int32_t k = s0 / kTile; k <= (s1 - 1) / kTile; k++) atomicAdd(v.tc + k, 1u);
  });
  v.run_off[qb + 1] = nr;
  v.seg_off[qb + 1] = ns;
  P.pairs_q[h * P.nb + qb] = r * keys + (diag ? r * (r + 1) / 2 - r * r : 0) + nbars * r;
}

/* Stage 2, one (kv head, key block): its entry count (into kv_off[x + 1]):
 * for each head of the group, the diagonals d with kb + d < nb. */
__device__ __forceinline__ void count_keys(const Seq &P, int64_t hk, int64_t kb) {
  int64_t c = 0;
  for (int64_t h = hk * P.group; h < (hk + 1) * P.group; h++)
    c += count_le(P.diagonals + h * (P.nb + 1), P.aux[h].nd, P.nb - 1 - kb);
  P.kv_off[hk * P.nb + kb + 1] = (int32_t)c;
  if (hk == 0) P.g64[kb] = kb;
}

/* Stage 2: grid-stride over the query items, then the key items. */
__global__ void __launch_bounds__(kThreads) count_kernel(Batch b) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t x0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t x = x0; x < b.q_items; x += stride) {
    const int32_t s = batch_find(b.first_q, b.count, x);
    const Seq &P = b.seqs[s];
    const int64_t local = x - b.first_q[s];
    count_query(P, local / P.nb, (int32_t)(local % P.nb));
  }
  for (int64_t x = x0; x < b.kv_items; x += stride) {
    const int32_t s = batch_find(b.first_kv, b.count, x);
    const Seq &P = b.seqs[s];
    const int64_t local = x - b.first_kv[s];
    count_keys(P, local / P.nb, local % P.nb);
  }
}

/* Stage 3: CTAs [0, heads) one per (sequence, head), then one per sequence. */
__global__ void __launch_bounds__(kThreads) scan_kernel(Batch b) {
  PLAN_SMEM(smem);
  long long *buf = (long long *)smem;
  const int t = (int)threadIdx.x;
  if ((int64_t)blockIdx.x < b.heads) {
    const int32_t s = batch_find(b.first_heads, b.count, (int64_t)blockIdx.x);
    const Seq &P = b.seqs[s];
    const int64_t h = (int64_t)blockIdx.x - b.first_heads[s];
    const HeadView v = head_view(P, h);
    const long long runs = scan_counts(v.run_off, P.nb, buf);
    const long long segs = scan_counts(v.seg_off, P.nb, buf);
    long long pairs = 0;
    for (int64_t i = t; i < P.nb; i += kThreads) pairs += P.pairs_q[h * P.nb + i];
    pairs = block_reduce(pairs, buf, false);
    if (t == 0) {
      uint32_t e = v.a.err;
      if (runs > P.cap_runs || segs > P.cap_segs) e |= CUDA_PLAN_ERR_INTERNAL;
      if (e) atomicOr(b.err, e);
      P.pairs[h] = pairs;
      int32_t *m = P.head_meta + h * CUDA_HM_STRIDE;
      const int64_t base = h * P.hstride;
      m[CUDA_HM_RUN_OFF] = (int32_t)base;
      m[CUDA_HM_RUNS] = (int32_t)(base + P.o_runs);
      m[CUDA_HM_SEG_OFF] = (int32_t)(base + P.o_seg_off);
      m[CUDA_HM_SEGS] = (int32_t)(base + P.o_segs);
      m[CUDA_HM_BARS] = (int32_t)(base + P.o_bars);
      m[CUDA_HM_NUM_BARS] = v.a.nv;
      m[7] = 0; /* (CUDA_HM_BAR_BASE: the sequence's CTA) */
    }
    return;
  }
  const int32_t s = (int32_t)((int64_t)blockIdx.x - b.heads);
  const Seq &P = b.seqs[s];
  /* the heads' bar bases (head_meta) and tile bases (for tile_kernel) */
  block_prefix(
      P.Hq, buf, [&](int64_t h) { return (long long)P.aux[h].nv; },
      [&](int64_t h, long long ex, long long) {
        P.aux[h].bar_base = (int32_t)ex;
        P.head_meta[h * CUDA_HM_STRIDE + CUDA_HM_BAR_BASE] = (int32_t)ex;
      });
  const long long real = block_prefix(
      P.Hq, buf, [&](int64_t h) { return (long long)(P.aux[h].nv + kTile - 1) / kTile; },
      [&](int64_t h, long long ex, long long) { P.aux[h].tile_base = (int32_t)ex; });
  __syncthreads(); /* the tile bases, read by other threads below */
  const long long kv = scan_counts(P.kv_off, (int64_t)P.Hkv * P.nb, buf);
  /* the real tiles in head order (slot h * Tcap + j is real iff 64 j < nv) */
  const long long ent = block_prefix(
      P.tiles, buf,
      [&](int64_t i) {
        const int64_t h = i / P.Tcap, j = i % P.Tcap;
        return j * kTile < P.aux[h].nv ? (long long)P.tile_cnt[i] : 0;
      },
      [&](int64_t i, long long ex, long long) {
        const int64_t h = i / P.Tcap, j = i % P.Tcap;
        const HeadAux a = P.aux[h];
        if (j * kTile >= a.nv) return;
        const int64_t pos = a.tile_base + j;
        P.bt_tile[3 * pos] = (int32_t)h;
        P.bt_tile[3 * pos + 1] = (int32_t)(j * kTile);
        P.bt_tile[3 * pos + 2] = (int32_t)lmin(j * kTile + kTile, a.nv);
        P.bt_off[pos] = (int32_t)ex;
      });
  /* the padding tiles: head 0, bars [0, 0), no entries */
  for (int64_t p = real + t; p <= P.tiles; p += kThreads) {
    if (p < P.tiles) P.bt_tile[3 * p] = P.bt_tile[3 * p + 1] = P.bt_tile[3 * p + 2] = 0;
    P.bt_off[p] = (int32_t)ent;
  }
  if (t == 0 && (kv > P.cap_kv || ent > P.cap_bent)) atomicOr(b.err, CUDA_PLAN_ERR_INTERNAL);
}

/* Stage 4, one query block: its runs and segments at its offsets. */
__device__ __forceinline__ void fill_query(const Seq &P, int64_t h, int32_t qb) {
  const HeadView v = head_view(P, h);
  int64_t p = v.run_off[qb], end = lmin(v.run_off[qb + 1], P.cap_runs);
  walk_runs(v, qb, [&](int32_t lo, int32_t hi) {
    if (p >= 0 && p < end) {
      v.runs[2 * p] = lo;
      v.runs[2 * p + 1] = hi;
    }
    p++;
  });
  p = v.seg_off[qb];
  end = lmin(v.seg_off[qb + 1], P.cap_segs);
  walk_segs(v, qb, [&](int32_t s0, int32_t s1) {
    if (p >= 0 && p < end) {
      v.segs[2 * p] = s0;
      v.segs[2 * p + 1] = s1;
    }
    p++;
  });
}

/* Stage 4, one (kv head, key block) by one warp: the entries (h, kb + d) of
 * the heads h of the group in order, each over its diagonals d ascending. */
__device__ __forceinline__ void fill_keys(const Seq &P, int64_t hk, int64_t kb, int lane) {
  const int64_t x = hk * P.nb + kb;
  int64_t p = P.kv_off[x];
  const int64_t end = lmin(P.kv_off[x + 1], P.cap_kv);
  for (int64_t h = hk * P.group; h < (hk + 1) * P.group; h++) {
    const int32_t *D = P.diagonals + h * (P.nb + 1);
    const int32_t c = count_le(D, P.aux[h].nd, P.nb - 1 - kb);
    for (int32_t j = lane; j < c; j += 32)
      if (p + j >= 0 && p + j < end) {
        P.kv_ent[2 * (p + j)] = (int32_t)h;
        P.kv_ent[2 * (p + j) + 1] = (int32_t)(kb + D[j]);
      }
    p += c;
  }
}

/* Stage 4: grid-stride over the query items (threads), then the key items
 * (warps). */
__global__ void __launch_bounds__(kThreads) fill_kernel(Batch b) {
  const int64_t threads = (int64_t)gridDim.x * blockDim.x;
  const int64_t x0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (int64_t x = x0; x < b.q_items; x += threads) {
    const int32_t s = batch_find(b.first_q, b.count, x);
    const Seq &P = b.seqs[s];
    const int64_t local = x - b.first_q[s];
    fill_query(P, local / P.nb, (int32_t)(local % P.nb));
  }
  for (int64_t w = x0 / 32; w < b.kv_items; w += threads / 32) {
    const int32_t s = batch_find(b.first_kv, b.count, w);
    const Seq &P = b.seqs[s];
    const int64_t local = w - b.first_kv[s];
    fill_keys(P, local / P.nb, local % P.nb, (int)(threadIdx.x % 32));
  }
}

/* The segments of query block qb that meet bars [b0, b1): [*first, *first +
 * return value) among the head's segments (ascending and disjoint: those
 * ending after b0 and starting before b1 are consecutive). */
__device__ __forceinline__ int32_t segs_meeting(const HeadView &v, int32_t qb, int64_t b0,
                                                int64_t b1, int32_t *first) {
  int32_t lo = v.seg_off[qb], hi = v.seg_off[qb + 1];
  while (lo < hi) { /* the first segment ending after b0 */
    const int32_t mid = lo + (hi - lo) / 2;
    if (v.segs[2 * mid + 1] <= b0)
      lo = mid + 1;
    else
      hi = mid;
  }
  *first = lo;
  hi = v.seg_off[qb + 1];
  int32_t e = lo;
  while (e < hi) { /* the first segment starting at or after b1 */
    const int32_t mid = e + (hi - e) / 2;
    if (v.segs[2 * mid] < b1)
      e = mid + 1;
    else
      hi = mid;
  }
  return e - lo;
}

/* Stage 5: one CTA per (sequence, tile slot h * Tcap + j); padding slots
 * (64 j >= nv) have nothing to do. The query blocks before the block of the
 * tile's first bar have no bar of it before them, so no entry. */
__global__ void __launch_bounds__(kThreads) tile_kernel(Batch b) {
  PLAN_SMEM(smem);
  long long *buf = (long long *)smem;
  const int32_t s = batch_find(b.first_tiles, b.count, (int64_t)blockIdx.x);
  const Seq &P = b.seqs[s];
  const int64_t local = (int64_t)blockIdx.x - b.first_tiles[s];
  const int64_t h = local / P.Tcap, j = local % P.Tcap;
  const HeadView v = head_view(P, h);
  const int64_t b0 = j * kTile;
  if (b0 >= v.a.nv) return;
  const int64_t b1 = lmin(b0 + kTile, v.a.nv), pos = v.a.tile_base + j;
  const int64_t out = P.bt_off[pos], end = lmin(P.bt_off[pos + 1], P.cap_bent);
  const int32_t q0 = (int32_t)(v.bars[b0] / P.G + 1);
  const long long total = block_prefix(
      P.nb - q0, buf,
      [&](int64_t i) {
        int32_t f;
        return (long long)segs_meeting(v, (int32_t)(q0 + i), b0, b1, &f);
      },
      [&](int64_t i, long long ex, long long c) {
        if (!c) return;
        const int32_t qb = (int32_t)(q0 + i);
        int32_t f;
        segs_meeting(v, qb, b0, b1, &f);
        for (int32_t k = 0; k < c; k++) {
          const int64_t p = out + ex + k;
          if (p < 0 || p >= end) break;
          P.bt_ent[3 * p] = qb;
          P.bt_ent[3 * p + 1] = v.segs[2 * (f + k)];
          P.bt_ent[3 * p + 2] = v.segs[2 * (f + k) + 1];
        }
      });
  if (threadIdx.x == 0 && out + total != P.bt_off[pos + 1]) atomicOr(b.err, CUDA_PLAN_ERR_INTERNAL);
}

/* CTAs of a grid-stride launch over n items of one thread each, at most
 * max_grid. */
inline int64_t grid_for(int64_t n, int64_t max_grid) {
  return lmax(1, lmin((n + kThreads - 1) / kThreads, max_grid));
}

using Kernel = void (*)(Batch);

/* The launches of the build, in order: launch(kernel, name, grid, smem)
 * queues `kernel` on grid CTAs of kThreads threads with `smem` bytes of
 * dynamic shared memory (grid >= 1) and returns nonzero to stop. The
 * grid-stride launches use at most max_grid CTAs (the test makes them loop). */
template <class Launch>
auto run_stages(const Batch &b, Launch &&launch, int64_t max_grid = kMaxGrid)
    -> decltype(launch(aux_kernel, "", 1, 0)) {
  const int64_t count_grid = grid_for(lmax(b.q_items, b.kv_items), max_grid);
  const int64_t fill_grid = grid_for(lmax(b.q_items, 32 * b.kv_items), max_grid);
  auto st = launch(aux_kernel, "plan aux_kernel", b.heads, kSmem);
  if (!st) st = launch(count_kernel, "plan count_kernel", count_grid, 0);
  if (!st) st = launch(scan_kernel, "plan scan_kernel", b.heads + b.count, kSmem);
  if (!st) st = launch(fill_kernel, "plan fill_kernel", fill_grid, 0);
  if (!st && b.tiles > 0) st = launch(tile_kernel, "plan tile_kernel", b.tiles, kSmem);
  return st;
}

} /* namespace */
} /* namespace plan */

#endif /* MTRAIN_CUDA_PLAN_KERNELS_CUH */
