/* balanced_layout.c: the balanced layout's search (docs/BALANCE.md): every
 * candidate owner map in both bars modes is evaluated under the cost model
 * on the caller's workload and the best is kept. The maps themselves are
 * dealt by core/layout. */
#include "core/balance/balanced_layout.h"
#include "core/balance/cost_internal.h"
#include "core/layout/schedule.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_error.h"

/* The balanced layout's candidates, in order of preference on ties. */
static const mtrain_owner_map_t balanced_candidates[] = {MTRAIN_MAP_STRIPED, MTRAIN_MAP_SNAKE,
                                                         MTRAIN_MAP_ROTATED, MTRAIN_MAP_GRID_ROT};

mtrain_status_t mtrain_balanced_layout_check(const mtrain_balance_options_t *b, int64_t seq_len,
                                             int32_t granularity) {
  if (b->num_patterns < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "balanced layout: num_patterns %d is negative",
                        b->num_patterns);
  if (b->num_patterns > 0 && !b->patterns)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                        "balanced layout: patterns is NULL with num_patterns %d", b->num_patterns);
  for (int32_t i = 0; i < b->num_patterns; i++) {
    const mtrain_pattern_t *p = b->patterns[i];
    if (!p)
      return mtrain_error(MTRAIN_ERR_NULL_POINTER, "balanced layout: patterns[%d] is NULL", i);
    if (p->seq_len != seq_len || p->granularity != granularity)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balanced layout: patterns[%d] has seq_len %lld and granularity %d, the "
                          "layout %lld and %d",
                          i, (long long)p->seq_len, p->granularity, (long long)seq_len,
                          granularity);
  }
  return MTRAIN_SUCCESS;
}

/* Picks the balanced layout's owner map and bars mode: every candidate map
 * in both bars modes is evaluated on the workload; among those whose worker
 * imbalance is no worse than striped's, the one with the smallest sum of
 * per-step maxima on the target ring wins (ties: earlier in the list, in-ring
 * before gathered). Striped with bars in the ring is always admissible, so
 * the result is never worse than striped on either figure. */
mtrain_status_t mtrain_balanced_layout_choose(const mtrain_balance_options_t *b, int64_t seq_len,
                                              int32_t G, int32_t W, int64_t nbp, int32_t *owner,
                                              mtrain_owner_map_t *best_map,
                                              mtrain_bars_mode_t *best_mode) {
  int32_t L = 0;
  mtrain_status_t st = mtrain_ring_check(W, b->ranks_per_node, &L);
  if (st != MTRAIN_SUCCESS) return mtrain_error_prefix(st, "balanced layout");
  const mtrain_ring_kind_t ring = L < W && L > 1 ? MTRAIN_RING_HIERARCHICAL : MTRAIN_RING_FLAT;
  double limit = 0.0, best = 0.0;
  int have = 0;
  const int nc = (int)(sizeof balanced_candidates / sizeof *balanced_candidates);
  for (int c = 0; c < nc; c++) {
    if (balanced_candidates[c] == MTRAIN_MAP_GRID_ROT && ring != MTRAIN_RING_HIERARCHICAL) continue;
    mtrain_owner_map_fill(balanced_candidates[c], nbp, W, L, owner);
    mtrain_cost_t *cost = NULL;
    st = mtrain_cost_evaluate_owner(owner, nbp, seq_len, G, W, b->ranks_per_node,
                                    MTRAIN_BARS_IN_RING, b->patterns, b->num_patterns, 0, &cost);
    if (st != MTRAIN_SUCCESS) return st;
    if (c == 0) limit = cost->metrics[MTRAIN_BARS_IN_RING][ring].worker_imbalance;
    for (int m = 0; m < 2; m++) {
      const mtrain_cost_metrics_t *x = &cost->metrics[m][ring];
      if (x->worker_imbalance > limit) continue;
      if (!have || x->step_max_sum < best) {
        have = 1;
        best = x->step_max_sum;
        *best_map = balanced_candidates[c];
        *best_mode = (mtrain_bars_mode_t)m;
      }
    }
    mtrain_cost_destroy(cost);
  }
  mtrain_owner_map_fill(*best_map, nbp, W, L, owner);
  return MTRAIN_SUCCESS;
}
