/* run_common.h: what the single-rank and the ring forms of mtrain-run
 * share: the timing record, budgets from the options, the timed attention
 * run and the description of the pattern source. */
#ifndef MTRAIN_RUN_COMMON_H
#define MTRAIN_RUN_COMMON_H

#include "mtrain/mtrain.h"
#include "run_inputs.h"
#include "run_options.h"

typedef struct run_result {
  double t_estimate, t_plan, t_fwd, t_bwd, t_check;
  long long pairs, dense_pairs;
  size_t plan_bytes;
  int checked, check_ok;
  double err[5], ref_max[5], bound[5];      /* O, LSE, dQ, dK, dV */
  mtrain_call_stats_t fwd_stats, bwd_stats; /* of the last timed run */
  int cuda_variant;                         /* the CUDA kernel variant that ran (-1: not cuda) */
} run_result_t;

/** The per-head budgets the options ask for (malloc'ed, heads entries);
 *  0 on success, 1 on failure (message printed, starting with `prog`).
 *  In run_budgets.c. */
int run_make_budgets(const char *prog, const run_options_t *o, int32_t heads,
                     mtrain_head_budget_t **out);
/** Forward (and backward) --repeat times, medians into r->t_fwd, r->t_bwd. */
int run_attention(mtrain_context_t *ctx, const mtrain_plan_t *plan, run_inputs_t *in,
                  run_outputs_t *out, const run_options_t *o, run_result_t *r);
/** What the pattern came from, for reports (static buffer). */
const char *run_pattern_source(const run_options_t *o);

#endif /* MTRAIN_RUN_COMMON_H */
