/* cuda_plan_build.h (private): the step tables of a single-rank plan built on
 * the device, from vertical-slash patterns that never left it (the device
 * selection's output), so that an estimated plan needs no host round trip.
 * The tables are those cuda_step_tables_pack makes on the host from the plan
 * builder's step view (cuda_internal.h describes them), entry for entry; the
 * regions are sized from capacities the host knows (the selection's bounds),
 * so the kernels' grids are fixed without reading counts back: the bar tiles
 * are padded at the end with empty tiles (h 0, bars [0, 0), no entries),
 * which every kernel skips, and total_bars is the capacity (the scratch rows
 * past a head's bars are never read). Single rank only: the query and key
 * blocks of a sequence are all its blocks, in order. */
#ifndef MTRAIN_CUDA_PLAN_BUILD_H
#define MTRAIN_CUDA_PLAN_BUILD_H

#include <stddef.h>
#include <stdint.h>

#include "backends/cuda/cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/** One sequence of the batch: its pattern in device memory, as the
 *  selection kernels leave it (select_kernels.cuh, sel::Params). */
typedef struct cuda_plan_seq {
  int64_t seq_len;          /* N (host) */
  const int32_t *counts;    /* device [2 * Hq]: head h keeps counts[2h] verticals and
                               counts[2h + 1] block diagonals */
  const int64_t *verticals; /* device: head h's verticals at verticals + h * N, strictly
                               increasing, in [0, N) */
  const int32_t *diagonals; /* device: head h's block diagonals at diagonals + h * (nb + 1),
                               nb = ceil(N / G), strictly increasing, diagonals[0] == 0 */
  int32_t cap_verticals;    /* host: no head of this sequence keeps more verticals */
  int32_t cap_diagonals;    /* host: nor more block diagonals (>= 1) */
} cuda_plan_seq_t;

/** The batch: `count` sequences of Hq query and Hkv kv heads, granularity G. */
typedef struct cuda_plan_geom {
  int32_t num_heads, num_kv_heads, granularity, count;
  const cuda_plan_seq_t *seqs; /* host [count] */
} cuda_plan_geom_t;

/* The builder's error word: a uint32 at byte CUDA_PLAN_ERR_OFFSET of `dev`.
 * The first kernel zeroes it; later ones set bits in it when a pattern breaks
 * the contract above, and then build the tables of the pattern cut to what
 * the contract allows (never writing outside `dev`'s regions): the first
 * min(count, capacity) entries of a head, then their longest prefix that is
 * strictly increasing and in range (diagonals also starting at 0). 0 after
 * the kernels: the tables are those of the pattern as given. The caller may
 * copy it back whenever convenient (the kernels never read it back). */
#define CUDA_PLAN_ERR_OFFSET 0
#define CUDA_PLAN_ERR_CAPACITY 1u /* a count above its capacity (or negative) */
#define CUDA_PLAN_ERR_PATTERN 2u  /* entries unsorted, out of range, or diagonals[0] != 0 */
#define CUDA_PLAN_ERR_INTERNAL 4u /* a table outgrew its bound: a builder bug (entries dropped) */

/** Bytes of device memory cuda_plan_build needs for the whole batch (tables
 *  and the builder's scratch). MTRAIN_ERR_INVALID_ARGUMENT for a bad
 *  geometry (named), MTRAIN_ERR_NOT_SUPPORTED beyond the 32-bit indices of
 *  the tables. Host only; no device work. */
mtrain_status_t cuda_plan_build_bytes(const cuda_plan_geom_t *g, size_t *bytes);

/** Queues on s->stream the kernels that build every sequence's step tables
 *  into `dev` (device memory of cuda_plan_build_bytes bytes, 256-byte
 *  aligned, owned by the caller, who keeps it until the kernels that read the
 *  tables are done) and fills steps[s] (host structs of device pointers into
 *  `dev`, the backward's lists included; `d` and `scale` are left 0 for the
 *  caller). *pairs_dev gets a device int64 [count * Hq] array inside `dev`:
 *  the (query, key) pairs each head of each sequence computes (the plan
 *  builder's mtrain_step_head_store_t.pairs). Never waits for the device. */
mtrain_status_t cuda_plan_build(cuda_state_t *s, const cuda_plan_geom_t *g, void *dev,
                                cuda_step_t *steps, int64_t **pairs_dev);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_CUDA_PLAN_BUILD_H */
