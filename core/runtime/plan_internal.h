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
  mtrain_rank_blocks_t k;
  mtrain_step_head_store_t *heads; /* [num_heads] */
  mtrain_step_head_t *head_views;  /* [num_heads] */
  mtrain_step_view_t view;
} mtrain_plan_step_t;

typedef struct mtrain_plan_seq {
  mtrain_pattern_t *pattern; /* owned copy */
  int64_t local_offset;      /* first local token of this sequence */
  mtrain_rank_blocks_t q;
  int64_t *q_global;         /* owned storage of q.global */
  mtrain_plan_step_t *steps; /* [num_steps] */
  int64_t **k_globals;       /* ring plans: owned block ids of each step's chunk */
} mtrain_plan_seq_t;

/** Bars gathered (docs/BALANCE.md): the union of the verticals of all heads,
 *  whose K/V rows every rank receives before the ring, and for every ring
 *  step the share of this rank's bar work computed against them. */
typedef struct mtrain_plan_gathered {
  int64_t *positions; /* [count] sorted global key positions */
  int64_t *local_row; /* [count] this rank's local row of each, or -1 */
  int64_t count;
  mtrain_plan_step_t *steps; /* [num_steps]: runs empty, bars index `positions` */
} mtrain_plan_gathered_t;

struct mtrain_plan {
  int32_t num_seqs, num_steps, num_heads, granularity, rank;
  int32_t world, ranks_per_node;    /* ring: world size and ranks per node (0: flat) */
  mtrain_plan_gathered_t *gathered; /* NULL: bars computed in the ring steps */
  int64_t local_tokens;
  int64_t computed_pairs;
  size_t bytes;
  mtrain_plan_seq_t *seqs;
};

#endif /* MTRAIN_CORE_PLAN_INTERNAL_H */
