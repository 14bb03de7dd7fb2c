/* plan_internal.h (private): the plan's layout and the step builder, shared
 * by the plan module, the attention driver and the property tests. */
#ifndef MTRAIN_CORE_PLAN_INTERNAL_H
#define MTRAIN_CORE_PLAN_INTERNAL_H

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_backend.h"

/** The blocks one rank holds of one sequence: global block ids, strictly
 *  increasing (a layout keeps each rank's blocks in global order), and the
 *  number of local tokens (num_blocks * G for padded layouts; seq_len for the
 *  single-rank identity layout, whose last block may be partial). */
typedef struct mtrain_rank_blocks {
  int32_t num_blocks;
  const int64_t *global; /* [num_blocks] */
  int64_t tokens;
} mtrain_rank_blocks_t;

/** The arrays behind one mtrain_step_head_t (owned). */
typedef struct mtrain_step_head_store {
  int32_t *run_off, *runs, *seg_off, *segs, *bars;
  int32_t num_runs, num_segs, num_bars;
  int64_t pairs; /* (i, j) pairs this step computes for this head */
} mtrain_step_head_store_t;

/** Builds one (step, head) entry: which key blocks and bars of the chunk
 *  `k` the local query blocks `q` compute under head h of the pattern. */
mtrain_status_t mtrain_plan_build_step_head(const mtrain_pattern_t *pattern, int32_t head,
                                            const mtrain_rank_blocks_t *q,
                                            const mtrain_rank_blocks_t *k,
                                            mtrain_step_head_store_t *out);
/** The same with the bars left out (bars gathered: the ring steps compute
 *  only listed blocks). */
mtrain_status_t mtrain_plan_build_step_head_runs(const mtrain_pattern_t *pattern, int32_t head,
                                                 const mtrain_rank_blocks_t *q,
                                                 const mtrain_rank_blocks_t *k,
                                                 mtrain_step_head_store_t *out);
void mtrain_step_head_store_free(mtrain_step_head_store_t *s);
/** The public view of a stored entry. */
mtrain_step_head_t mtrain_step_head_view(const mtrain_step_head_store_t *s);

typedef struct mtrain_plan_step {
  int32_t src_rank;
  int64_t chunk_offset; /* first token slot of this sequence in src_rank's chunk */
  mtrain_rank_blocks_t k;
  mtrain_step_head_store_t *heads; /* [num_heads] */
  mtrain_step_head_t *head_views;  /* [num_heads] */
  mtrain_step_view_t view;
} mtrain_plan_step_t;

typedef struct mtrain_plan_seq {
  mtrain_pattern_t *pattern; /* owned copy */
  int64_t local_offset;      /* first local token slot of this sequence */
  mtrain_rank_blocks_t q;
  int64_t *q_global;         /* owned storage of q.global */
  mtrain_plan_step_t *steps; /* [num_steps] */
  int64_t **k_globals;       /* ring plans: owned block ids of each step's chunk */
  /* bars gathered (docs/BALANCE.md): this sequence's verticals are rows
   * [bar_base, bar_base + bar_count) of the gathered K/V buffer and
   * bar_steps[t] is the share of its bar work done at step t against them
   * (runs empty, bars index the sequence's rows); NULL: bars in the ring */
  mtrain_plan_step_t *bar_steps;
  int64_t bar_base, bar_count;
} mtrain_plan_seq_t;

/** Bars gathered, over all sequences of the plan: before the ring every rank
 *  packs the K/V rows of the verticals it owns (pack_rows, padded with zero
 *  rows to max_owned), the packs are all-gathered ([world][K pack | V pack]
 *  of max_owned rows each) and unpacked into the gathered buffer
 *  [K rows | V rows] of `count` rows each (unpack: 2 * count indices into the
 *  all-gathered rows). Backward, the gathered dK/dV are summed over the ranks
 *  and each owner adds the rows owned_bars (2 * owned indices into
 *  [dK rows | dV rows]) to its rows pack_rows. Only rows move; no arithmetic
 *  touches the K/V values, so the gathered rows are bitwise the owners'. */
typedef struct mtrain_plan_gathered {
  int64_t count;       /* gathered rows over all sequences */
  int64_t owned;       /* rows this rank owns */
  int64_t max_owned;   /* the largest `owned` over the ranks */
  int64_t *pack_rows;  /* [max_owned] local token rows; padding entries INT64_MAX */
  int64_t *unpack;     /* [2 * count] */
  int64_t *owned_bars; /* [2 * owned] */
} mtrain_plan_gathered_t;

/* A plan built on the backend (mtrain_plan_create_estimated, one rank): the
 * backend's handle of the batch's device tables and the backend memory that
 * holds them and the patterns, both of `ctx`'s backend. Until `read` the
 * sequences' patterns are shells (their geometry, no head sets) and the
 * plan's computed_pairs is -1; plan_estimated.c reads them on demand. */
typedef struct mtrain_plan_device {
  mtrain_context_t *ctx;
  void *handle;
  void *memory;
  size_t bytes;
  int32_t num_kv_heads;
  int read; /* the patterns and pairs have been read back */
} mtrain_plan_device_t;

struct mtrain_plan {
  int32_t num_seqs, num_steps, num_heads, granularity, rank;
  int32_t world, ranks_per_node;    /* ring: world size and ranks per node (0: flat) */
  mtrain_plan_gathered_t *gathered; /* NULL: every sequence computes its bars in the ring */
  int64_t local_tokens;
  int64_t computed_pairs;
  size_t bytes;
  mtrain_plan_seq_t *seqs;
  mtrain_plan_device_t *device; /* NULL: the plan was built on the host */
};

/* Frees a plan's device part (plan_estimated.c): releases the backend's
 * handle and gives its memory back. */
void mtrain_plan_device_free(mtrain_plan_device_t *d);

#endif /* MTRAIN_CORE_PLAN_INTERNAL_H */
