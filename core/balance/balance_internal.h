/* balance_internal.h (private): what SparseBalance's files share: the exact
 * pair count of a vertical-slash head from its sets (no pattern object), the
 * position model's placement of one head into reusable scratch, and the
 * predictor's structure (read by the batching and tuning code and the
 * tests). docs/BALANCE.md, "SparseBalance". */
#ifndef MTRAIN_CORE_BALANCE_INTERNAL_H
#define MTRAIN_CORE_BALANCE_INTERNAL_H

#include "mtrain/mtrain_balance.h"

/** Exact allowed-pair count (SPEC.md section 1) of a vertical-slash head of
 *  N tokens at granularity G: `diagonals` sorted, unique, containing 0, all
 *  < ceil(N/G); `verticals` sorted, unique, each in a block before the last.
 *  Equal to mtrain_pattern_count_pairs of the same head (tested), in
 *  O(nd + nv log nd) instead of O(blocks * (nd + nv)). */
int64_t mtrain_vs_pairs(const int32_t *diagonals, int32_t nd, const int64_t *verticals, int64_t nv,
                        int64_t N, int32_t G);

/** Reusable buffers of the position model for sequences up to `cap` tokens. */
typedef struct mtrain_pm_scratch {
  int64_t cap;
  uint64_t *bitmap;
  int64_t *tok, *verticals;
  int32_t *diagonals;
  uint8_t *mark;
} mtrain_pm_scratch_t;

void mtrain_pm_scratch_free(mtrain_pm_scratch_t *s);

/** The pair count of one budget's head at length N under the position
 *  model (seeded as layer/head do in mtrain_pattern_from_budgets when the
 *  spread is random). Grows the scratch as needed. */
mtrain_status_t mtrain_position_model_head_pairs(const mtrain_head_budget_t *budget, int64_t N,
                                                 int32_t G, const mtrain_position_model_t *model,
                                                 int32_t layer, int32_t head,
                                                 mtrain_pm_scratch_t *scratch, int64_t *pairs);

/** The predictor. Heads with the same counts share a "combo": their pairs
 *  at a length and level are equal, so they are counted once. */
struct mtrain_balance_predictor {
  int32_t num_layers, num_heads, num_levels, base_level, granularity, num_combos;
  int32_t *combo;                /* [num_heads]: the head's combo */
  int64_t *combo_counts;         /* [num_combos * 2]: (v, s) counts at scale 1 */
  double *scales;                /* [num_levels] */
  mtrain_position_model_t model; /* spread forced to even */
  mtrain_balance_calibration_t cal;
  double linear_flop_per_token;
  /* [num_row_lengths * num_heads * num_levels] measured pairs per query row
   * (set_row_pairs, set_row_pairs_grid) at the lengths row_lengths
   * (increasing; NULL with one length: the same at every N), or NULL: the
   * position model counts. When set, every head is its own combo. */
  double *row_pairs;
  int64_t *row_lengths;
  int32_t num_row_lengths;
};

/** Pairs of every (combo, level) at length N: out[combo * num_levels + level]. */
mtrain_status_t mtrain_predictor_pair_table(const mtrain_balance_predictor_t *p, int64_t N,
                                            mtrain_pm_scratch_t *scratch, int64_t *out);

/** Seconds of a sequence of N tokens apart from the pairs: rows, calls and
 *  linear layers. */
double mtrain_predictor_fixed_seconds(const mtrain_balance_predictor_t *p, int64_t N);

#endif /* MTRAIN_CORE_BALANCE_INTERNAL_H */
