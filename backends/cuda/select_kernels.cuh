/* select_kernels.cuh (private): the vertical-slash selection of SPEC.md
 * section 2 as CUDA kernels, bitwise the host's (core/runtime/select.c and
 * estimate.c's select_head): the same candidates, the same order (score
 * descending with forced candidates +inf, NaN lowest and -0 as +0, ties to
 * the lower index), the same top-p sum in rank order (with top_p_forced the
 * forced candidates kept whatever the sum). One CTA per (head,
 * side): side 0 selects the head's verticals among the column scores, side 1
 * its token diagonals among the slash scores (the per-slot sums added in
 * slot order, as the host does) and turns them into block diagonals.
 *
 * The best m candidates are found without sorting: a radix select (eight
 * passes over 8-bit digits of the ranking keys, a shared histogram each)
 * gives the m-th largest key T and how many of the keys equal to T are kept;
 * one ordered pass writes the kept indices in increasing order. Top-p walks
 * the ranking in chunks of at most sort_chunk ranks (kSortMax on the GPU):
 * the radix select bounds chunk c (ranks [c * chunk, (c + 1) * chunk) of the
 * cap's m), one ordered pass writes its candidates, a bitonic sort in shared
 * memory puts them in rank order, and one thread goes on adding their scores
 * in rank order until the mass reaches p. A walk that ends in its first
 * chunk keeps the flagged part of it; a longer one selects its kept count
 * K's best again (index order), so any cap up to N is selected.
 *
 * Written in the subset of CUDA that the CPU emulator of tests/cuda_emu runs
 * (block barriers, shared memory, shared-memory atomics): MTRAIN_CUDA_EMU
 * selects the emulator's shared memory, so CI checks these kernels against
 * the host selection without a GPU. */
#ifndef MTRAIN_CUDA_SELECT_KERNELS_CUH
#define MTRAIN_CUDA_SELECT_KERNELS_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "backends/cuda/block_scan.cuh"

#ifdef MTRAIN_CUDA_EMU
#define SEL_SMEM(name) unsigned char *name = emu::smem_base()
#else
#define SEL_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace sel {

constexpr int kThreads = 256;
constexpr int kPerThread = 8; /* consecutive candidates per thread in a tile */
constexpr int64_t kTile = (int64_t)kThreads * kPerThread;
constexpr int kSortMax = 8192; /* top-p: ranks sorted at a time in shared memory */
/* A key above every ranking key (key_of is at most +inf's 0xfff0...): with 0
 * ties it bounds the empty best set. */
constexpr unsigned long long kNoKey = ~0ULL;

/* One head's budget (mtrain_head_budget_t, device copy). */
struct Head {
  int32_t top_p;
  int32_t pad;
  int64_t k_v, k_s;     /* top-k sizes */
  int64_t cap_v, cap_s; /* top-p caps */
  double p_v, p_s;      /* top-p masses */
};

struct Params {
  int64_t N, nb, nv_cand; /* tokens, blocks, vertical candidates */
  int32_t G, slots, Hq;
  int32_t top_p_forced; /* 1: top-p heads force the prefixes nf_v, nf_s too */
  int64_t sort_chunk;   /* top-p ranks sorted at a time (>= 1; kSortMax) */
  int64_t nf_v, nf_s;   /* forced prefixes (sinks, window): top-k, top-p with top_p_forced */
  const double *col;    /* [Hq * N] */
  const double *diag;   /* [Hq * N * slots] */
  double *sscore;       /* [Hq * N] slash scores (slash_sums_kernel) */
  const Head *heads;    /* [Hq] */
  int64_t *verticals;   /* [Hq * N] head h's kept verticals at h * N */
  int64_t *tokens;      /* [Hq * N] head h's kept token diagonals at h * N */
  uint8_t *bitmap;      /* [Hq * nb] */
  int32_t *diags;       /* [Hq * (nb + 1)] head h's block diagonals */
  int32_t *counts;      /* [Hq * 2]: verticals, block diagonals */
};

/* Shared memory of select_kernel: histogram, scan buffer, broadcast words,
 * then (top-p) the sort keys and positions. */
constexpr size_t kSmemHist = 256 * sizeof(unsigned);
constexpr size_t kSmemScan = kThreads * sizeof(long long);
constexpr size_t kSmemBcast = 4 * sizeof(unsigned long long);
constexpr size_t kSmemFixed = kSmemHist + kSmemScan + kSmemBcast;

static inline size_t smem_bytes(int64_t sort_n) {
  return kSmemFixed + (size_t)sort_n * (sizeof(unsigned long long) + sizeof(int32_t));
}

/* The ranking key of candidate i as an unsigned integer whose order is the
 * host's (select.c's key_of, shifted to unsigned): forced +inf, NaN -inf,
 * -0 as +0, then the IEEE bits made monotone. Never 0 (the sort's padding). */
__device__ __forceinline__ unsigned long long key_of(const double *s, int64_t i, int64_t nf) {
  double x = i < nf ? INFINITY : s[i];
  if (x != x) x = -INFINITY;
  if (x == 0.0) x = 0.0;
  long long b;
  memcpy(&b, &x, sizeof b);
  if (b < 0) b ^= 0x7fffffffffffffffLL;
  return (unsigned long long)b ^ 0x8000000000000000ULL;
}

/* The m-th largest key (1 <= m <= n) among s[0..n) with the forced prefix nf,
 * and in *ties how many of the keys equal to it rank among the m best (the
 * lowest indices of them win). */
__device__ unsigned long long radix_select(const double *s, int64_t n, int64_t nf, int64_t m,
                                           unsigned *hist, unsigned long long *bcast,
                                           int64_t *ties) {
  const int t = threadIdx.x;
  unsigned long long prefix = 0, mask = 0;
  int64_t r = m; /* rank wanted among the keys that match prefix, from the top */
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = t; i < 256; i += kThreads) hist[i] = 0;
    __syncthreads();
    for (int64_t i = t; i < n; i += kThreads) {
      const unsigned long long k = key_of(s, i, nf);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255], 1u);
    }
    __syncthreads();
    if (t == 0) {
      int64_t above = 0;
      int d = 255;
      for (; d > 0; d--) {
        if (above + (int64_t)hist[d] >= r) break;
        above += hist[d];
      }
      bcast[0] = prefix | ((unsigned long long)d << shift);
      bcast[1] = (unsigned long long)(r - above);
    }
    __syncthreads();
    prefix = bcast[0];
    r = (int64_t)bcast[1];
    mask |= 255ULL << shift;
    __syncthreads();
  }
  *ties = r;
  return prefix;
}

/* out[0..m) = the m best candidates in increasing index order: keys above T
 * and the first `ties` keys equal to T. One pass of tiles; each thread owns
 * kPerThread consecutive candidates of a tile. */
__device__ void write_best(const double *s, int64_t n, int64_t nf, unsigned long long T,
                           int64_t ties, int64_t *out, long long *scan) {
  const int t = threadIdx.x;
  int64_t base_out = 0, ties_left = ties;
  for (int64_t lo = 0; lo < n; lo += kTile) {
    const int64_t i0 = lo + (int64_t)t * kPerThread;
    int gt = 0, eq = 0;
    for (int e = 0; e < kPerThread; e++) {
      const int64_t i = i0 + e;
      if (i >= n) break;
      const unsigned long long k = key_of(s, i, nf);
      gt += k > T;
      eq += k == T;
    }
    /* the two 32-bit counts packed in one value: they add independently
     * while each stays below 2^32 */
    long long total;
    const long long ex =
        bscan::block_scan<kThreads>((long long)gt | ((long long)eq << 32), scan, &total);
    const int64_t gt_before = ex & 0xffffffffLL, eq_before = ex >> 32;
    int64_t pos = base_out + gt_before + (eq_before < ties_left ? eq_before : ties_left);
    int64_t tie_rank = eq_before;
    for (int e = 0; e < kPerThread; e++) {
      const int64_t i = i0 + e;
      if (i >= n) break;
      const unsigned long long k = key_of(s, i, nf);
      if (k > T) {
        out[pos++] = i;
      } else if (k == T) {
        if (tie_rank < ties_left) out[pos++] = i;
        tie_rank++;
      }
    }
    const int64_t gt_tot = total & 0xffffffffLL, eq_tot = total >> 32;
    base_out += gt_tot + (eq_tot < ties_left ? eq_tot : ties_left);
    ties_left = eq_tot < ties_left ? ties_left - eq_tot : 0;
  }
  __syncthreads();
}

/* Keeps the entries a[i] of a[0..n) with flag[i] != 0, in order, at the front
 * of a (in place); returns the count. */
template <typename T, typename F>
__device__ int64_t compact_flagged(T *a, const F *flag, int64_t n, long long *scan) {
  const int t = threadIdx.x;
  int64_t base = 0;
  for (int64_t lo = 0; lo < n; lo += kTile) {
    const int64_t i0 = lo + (int64_t)t * kPerThread;
    T v[kPerThread];
    int keep = 0;
    for (int e = 0; e < kPerThread; e++) {
      const int64_t i = i0 + e;
      if (i < n && flag[i]) v[keep++] = a[i];
    }
    long long total;
    /* (its barriers order the reads and writes) */
    const long long ex = bscan::block_scan<kThreads>(keep, scan, &total);
    for (int e = 0; e < keep; e++) a[base + ex + e] = v[e];
    base += total;
    __syncthreads();
  }
  return base;
}

/* The candidates of ranks [lo, hi) of the ranking, best(hi) minus best(lo),
 * in increasing index order to out[0..hi - lo): best(m) is the keys above T
 * and the first `ties` keys equal to T (T_lo = kNoKey with ties_lo = 0: the
 * empty best(0)); best(lo) lies within best(hi). One pass of tiles as
 * write_best, four counts per thread scanned at once in 16-bit fields (each
 * at most kTile = 2048 a tile, so no field carries into the next). */
__device__ void write_rank_range(const double *s, int64_t n, int64_t nf, unsigned long long T_lo,
                                 int64_t ties_lo, unsigned long long T_hi, int64_t ties_hi,
                                 int64_t *out, long long *scan) {
  const int t = threadIdx.x;
  int64_t gt_hi_seen = 0, eq_hi_seen = 0, gt_lo_seen = 0, eq_lo_seen = 0;
  for (int64_t lo = 0; lo < n; lo += kTile) {
    const int64_t i0 = lo + (int64_t)t * kPerThread;
    long long gt_hi = 0, eq_hi = 0, gt_lo = 0, eq_lo = 0;
    for (int e = 0; e < kPerThread; e++) {
      const int64_t i = i0 + e;
      if (i >= n) break;
      const unsigned long long k = key_of(s, i, nf);
      gt_hi += k > T_hi;
      eq_hi += k == T_hi;
      gt_lo += k > T_lo;
      eq_lo += k == T_lo;
    }
    long long total;
    const long long ex = bscan::block_scan<kThreads>(
        gt_hi | (eq_hi << 16) | (gt_lo << 32) | (eq_lo << 48), scan, &total);
    int64_t rank_hi = eq_hi_seen + ((ex >> 16) & 0xffff);
    int64_t rank_lo = eq_lo_seen + ((ex >> 48) & 0xffff);
    const int64_t in_hi = gt_hi_seen + (ex & 0xffff) + (rank_hi < ties_hi ? rank_hi : ties_hi);
    const int64_t in_lo =
        gt_lo_seen + ((ex >> 32) & 0xffff) + (rank_lo < ties_lo ? rank_lo : ties_lo);
    int64_t pos = in_hi - in_lo;
    for (int e = 0; e < kPerThread; e++) {
      const int64_t i = i0 + e;
      if (i >= n) break;
      const unsigned long long k = key_of(s, i, nf);
      const bool hi_has = k > T_hi || (k == T_hi && rank_hi < ties_hi);
      const bool lo_has = k > T_lo || (k == T_lo && rank_lo < ties_lo);
      rank_hi += k == T_hi;
      rank_lo += k == T_lo;
      if (hi_has && !lo_has) out[pos++] = i;
    }
    gt_hi_seen += total & 0xffff;
    eq_hi_seen += (total >> 16) & 0xffff;
    gt_lo_seen += (total >> 32) & 0xffff;
    eq_lo_seen += (total >> 48) & 0xffff;
  }
  __syncthreads();
}

/* Ascending position in [0, count) of a sorted top-p pass: the host's
 * by_score_desc order on (key, position in the index-ordered chunk). */
__device__ __forceinline__ bool before(unsigned long long ka, int32_t pa, unsigned long long kb,
                                       int32_t pb) {
  return ka > kb || (ka == kb && pa < pb);
}

/* Sorts the candidates idx[0..cnt) (index order) by rank, in shared memory:
 * pos[r] = the position in idx of rank r (key[] its keys, then padding).
 * pos starts at key + P, P the power of two >= cnt. Bitonic. */
__device__ void sort_by_rank(const double *s, const int64_t *idx, int64_t cnt, int64_t nf,
                             unsigned char *sort_mem) {
  const int t = threadIdx.x;
  int64_t P = 1;
  while (P < cnt) P <<= 1;
  unsigned long long *key = (unsigned long long *)sort_mem;
  int32_t *pos = (int32_t *)(key + P);
  for (int64_t i = t; i < P; i += kThreads) {
    key[i] = i < cnt ? key_of(s, idx[i], nf) : 0ULL; /* padding sorts last */
    pos[i] = (int32_t)i;
  }
  __syncthreads();
  for (int64_t k = 2; k <= P; k <<= 1) {
    for (int64_t j = k >> 1; j > 0; j >>= 1) {
      for (int64_t i = t; i < P; i += kThreads) {
        const int64_t x = i ^ j;
        if (x <= i) continue;
        const bool first = before(key[i], pos[i], key[x], pos[x]);
        if (((i & k) == 0) != first) {
          const unsigned long long tk = key[i];
          key[i] = key[x];
          key[x] = tk;
          const int32_t tp = pos[i];
          pos[i] = pos[x];
          pos[x] = tp;
        }
      }
      __syncthreads();
    }
  }
}

/* Top-p among the m best (the cap) of s[0..n) with the forced prefix nf:
 * walking down the ranking, a candidate of the forced prefix is kept and its
 * score added whatever the sum; another is kept while the sum with it stays
 * below p (the walk stops at the first that does not). The walk goes through
 * chunks of `chunk` ranks (see the top of the file). The kept ones go in
 * index order to out[0..count); out[0..m) is scratch on the way. */
__device__ int64_t top_p_select(const double *s, int64_t n, int64_t nf, int64_t m, double p,
                                int64_t chunk, int64_t *out, unsigned char *sort_mem,
                                unsigned *hist, unsigned long long *bcast, long long *scan) {
  const int t = threadIdx.x;
  unsigned long long T_lo = kNoKey;
  int64_t ties_lo = 0, lo = 0, kept = 0;
  double sum = 0.0; /* thread 0's running mass, across chunks */
  for (;;) {
    const int64_t hi = m - lo > chunk ? lo + chunk : m, cnt = hi - lo;
    int64_t ties_hi;
    const unsigned long long T_hi = radix_select(s, n, nf, hi, hist, bcast, &ties_hi);
    write_rank_range(s, n, nf, T_lo, ties_lo, T_hi, ties_hi, out + lo, scan);
    sort_by_rank(s, out + lo, cnt, nf, sort_mem);
    int64_t P = 1;
    while (P < cnt) P <<= 1;
    const int32_t *pos = (const int32_t *)((unsigned long long *)sort_mem + P);
    /* the chunk's scores in rank order, gathered by every thread into the
     * sort keys' room (the keys are no longer needed), so that thread 0's
     * walk below reads shared memory only: its adds must stay one after
     * another (the host's sum order), and with two dependent global loads
     * per rank it took 6.95 ms a layer's launch at 32K tokens and density
     * 0.75 on an H200 (docs/PERFORMANCE.md) */
    double *val = (double *)sort_mem;
    for (int64_t i = t; i < cnt; i += kThreads) val[i] = s[out[lo + pos[i]]];
    __syncthreads();
    if (t == 0) {
      /* rank lo + i is a forced candidate (index < nf) exactly when
       * lo + i < nf: forced keys are +inf, above every other key but a
       * score of +inf, whose index (>= nf) ranks it after them */
      int64_t count = 0, stopped = 0;
      for (int64_t i = 0; i < cnt; i++) {
        const double next = sum + val[i];
        if (!(next < p) && lo + i >= nf) {
          stopped = 1;
          break;
        }
        sum = next;
        count++;
      }
      bcast[2] = (unsigned long long)count;
      bcast[3] = (unsigned long long)stopped;
    }
    __syncthreads();
    const int64_t count = (int64_t)bcast[2];
    const bool stopped = bcast[3] != 0;
    kept = lo + count;
    if (!stopped && hi < m) {
      lo = hi;
      T_lo = T_hi;
      ties_lo = ties_hi;
      __syncthreads(); /* bcast[2..3] read by every thread before they change */
      continue;
    }
    if (lo > 0) break;
    /* the walk ended in its first chunk: out[0..cnt) is best(cnt) in index
     * order; keep the flagged positions of the first `count` ranks (flags
     * over the sorted keys' space: the keys are no longer needed) */
    unsigned char *flag = sort_mem;
    for (int64_t i = t; i < cnt; i += kThreads) flag[i] = 0;
    __syncthreads();
    for (int64_t i = t; i < count; i += kThreads) flag[pos[i]] = 1;
    __syncthreads();
    return compact_flagged(out, flag, cnt, scan);
  }
  /* several chunks: ranks [0, kept) are the best `kept`, in index order */
  int64_t ties;
  const unsigned long long T = radix_select(s, n, nf, kept, hist, bcast, &ties);
  write_best(s, n, nf, T, ties, out, scan);
  return kept;
}

/* sscore[h * N + t] = the slash score of token diagonal t of head h: its
 * per-slot partial sums added in slot order from 0.0 (the host's loop). */
__device__ __forceinline__ void slash_sum_at(const Params &p, int64_t i) {
  const double *d = p.diag + i * p.slots;
  double sum = 0.0;
  for (int s = 0; s < p.slots; s++) sum += d[s];
  p.sscore[i] = sum;
}

__global__ void slash_sums_kernel(Params p) {
  const int64_t total = (int64_t)p.Hq * p.N;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x)
    slash_sum_at(p, i);
}

/* The sequence of a batch that holds item x: first[s] <= x < first[s + 1]
 * (first[0] = 0, count + 1 entries, increasing). */
__device__ __forceinline__ int batch_find(const int64_t *first, int count, int64_t x) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/* The slash sums of a batch of sequences (params[s] each) in one launch:
 * item x of first[count] = sum of Hq * N is entry x - first[s] of sequence s. */
__global__ void slash_sums_batch_kernel(const Params *params, const int64_t *first, int count) {
  const int64_t total = first[count];
  for (int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; x < total;
       x += (int64_t)gridDim.x * blockDim.x) {
    const int s = batch_find(first, count, x);
    slash_sum_at(params[s], x - first[s]);
  }
}

/* The selection of head h, side 0 (verticals) or 1 (token diagonals, then
 * block diagonals), by one CTA. */
__device__ void select_head_side(const Params &p, int h, int side) {
  SEL_SMEM(smem);
  unsigned *hist = (unsigned *)smem;
  long long *scan = (long long *)(smem + kSmemHist);
  unsigned long long *bcast = (unsigned long long *)(smem + kSmemHist + kSmemScan);
  unsigned char *sort_mem = smem + kSmemFixed;
  const Head hb = p.heads[h];
  const double *s = side == 0 ? p.col + (int64_t)h * p.N : p.sscore + (int64_t)h * p.N;
  const int64_t n = side == 0 ? p.nv_cand : p.N;
  int64_t *out = (side == 0 ? p.verticals : p.tokens) + (int64_t)h * p.N;
  int64_t kept = 0;
  if (!hb.top_p) {
    int64_t k = side == 0 ? hb.k_v : hb.k_s;
    if (k > n) k = n;
    const int64_t nf = side == 0 ? p.nf_v : p.nf_s;
    if (k > 0 && n > 0) {
      int64_t ties;
      const unsigned long long T = radix_select(s, n, nf, k, hist, bcast, &ties);
      write_best(s, n, nf, T, ties, out, scan);
      kept = k;
    }
  } else {
    const int64_t cap = side == 0 ? hb.cap_v : hb.cap_s;
    const int64_t nf = !p.top_p_forced ? 0 : side == 0 ? p.nf_v : p.nf_s;
    if (n > 0 && cap > 0) {
      const int64_t m = cap < n ? cap : n;
      kept = top_p_select(s, n, nf, m, side == 0 ? hb.p_v : hb.p_s, p.sort_chunk, out, sort_mem,
                          hist, bcast, scan);
    }
  }
  if (side == 0) {
    if (threadIdx.x == 0) p.counts[2 * h] = (int32_t)kept;
    return;
  }
  /* token diagonals to block diagonals: mark then collect (diagonal 0 always) */
  uint8_t *bits = p.bitmap + (int64_t)h * p.nb;
  for (int64_t i = threadIdx.x; i < p.nb; i += kThreads) bits[i] = i == 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < kept; i += kThreads) {
    const int64_t a = out[i] / p.G, b = out[i] % p.G;
    if (a < p.nb) bits[a] = 1;
    if (b > 0 && a + 1 < p.nb) bits[a + 1] = 1;
  }
  __syncthreads();
  int32_t *diags = p.diags + (int64_t)h * (p.nb + 1);
  for (int64_t i = threadIdx.x; i < p.nb; i += kThreads) diags[i] = (int32_t)i;
  __syncthreads();
  const int64_t nd = compact_flagged(diags, bits, p.nb, scan);
  if (threadIdx.x == 0) p.counts[2 * h + 1] = (int32_t)nd;
}

/* One CTA per (head h, side): blockIdx.x = 2 * h + side. */
__global__ void __launch_bounds__(kThreads) select_kernel(Params p) {
  select_head_side(p, (int)(blockIdx.x / 2), (int)(blockIdx.x % 2));
}

/* A batch of sequences in one launch: CTA x of first[count] = sum of 2 * Hq
 * is CTA x - first[s] of sequence s's select_kernel. Shared memory: the
 * largest of the sequences'. */
__global__ void __launch_bounds__(kThreads)
    select_batch_kernel(const Params *params, const int64_t *first, int count) {
  const int s = batch_find(first, count, (int64_t)blockIdx.x);
  const Params p = params[s];
  const int64_t local = (int64_t)blockIdx.x - first[s];
  select_head_side(p, (int)(local / 2), (int)(local % 2));
}

/* One (sequence, head) entry of a batched selection, as pack_kernel reads
 * it: where select_kernel left that head's kept verticals and block
 * diagonals (Params.verticals + h * N, Params.diags + h * (nb + 1)). */
struct PackEntry {
  const int64_t *verticals;
  const int32_t *diags;
};

/* Shared memory of pack_kernel: two partial sums per thread. */
constexpr size_t kSmemPack = 2 * kThreads * sizeof(long long);

/* Packs the kept verticals and block diagonals of `entries` one after
 * another, entry e after entries 0..e-1, into packed_v and packed_d, so a
 * batch comes to the host in two copies. counts[2 * e] and [2 * e + 1] are
 * entry e's counts (select_kernel's). One CTA per entry: it adds the counts
 * before it (a block reduction) and copies its own. */
__global__ void __launch_bounds__(kThreads)
    pack_kernel(const PackEntry *entries, const int32_t *counts, int64_t *packed_v,
                int32_t *packed_d) {
  SEL_SMEM(smem);
  long long *part = (long long *)smem;
  const int64_t e = blockIdx.x;
  const int t = (int)threadIdx.x;
  long long sv = 0, sd = 0;
  for (int64_t i = t; i < e; i += kThreads) {
    sv += counts[2 * i];
    sd += counts[2 * i + 1];
  }
  part[t] = sv;
  part[kThreads + t] = sd;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (t < w) {
      part[t] += part[t + w];
      part[kThreads + t] += part[kThreads + t + w];
    }
    __syncthreads();
  }
  const int64_t off_v = part[0], off_d = part[kThreads];
  const int32_t nv = counts[2 * e], nd = counts[2 * e + 1];
  const PackEntry en = entries[e];
  for (int64_t i = t; i < nv; i += kThreads) packed_v[off_v + i] = en.verticals[i];
  for (int64_t i = t; i < nd; i += kThreads) packed_d[off_d + i] = en.diags[i];
}

} /* namespace sel */

#endif /* MTRAIN_CUDA_SELECT_KERNELS_CUH */
