/* run_common.h: what the single-rank and the ring forms of mtrain-run
 * share: the timing record, budgets from the options, the context and the
 * timed attention run, the description of the pattern source, and the
 * bounds of --check. */
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
  double floor[5];                          /* the bound's absolute floor (dQ, dK; else 0) */
  mtrain_call_stats_t fwd_stats, bwd_stats; /* of the last timed run */
  int cuda_variant;                         /* the CUDA kernel variant that ran (-1: not cuda) */
  const char *backend;                      /* the backend the context uses (its name) */
} run_result_t;

/** The per-head budgets the options ask for (malloc'ed, heads entries);
 *  0 on success, 1 on failure (message printed, starting with `prog`).
 *  In run_budgets.c. */
int run_make_budgets(const char *prog, const run_options_t *o, int32_t heads,
                     mtrain_head_budget_t **out);
/** A context of `backend` with the options' granularity and threads, input
 *  checks on, over `comm` (NULL: one rank; else collective). Returns 0 or 1
 *  (message printed, starting with `prog`). In run_attention.c. */
int run_make_context(const char *prog, const run_options_t *o, const char *backend,
                     mtrain_comm_t *comm, mtrain_context_t **ctx);
/** Forward (and backward) --repeat times, medians into r->t_fwd, r->t_bwd,
 *  ring statistics of the last run into r->fwd_stats, r->bwd_stats; messages
 *  start with `prog`. In run_attention.c. */
int run_attention(const char *prog, mtrain_context_t *ctx, const mtrain_plan_t *plan,
                  run_inputs_t *in, run_outputs_t *out, const run_options_t *o, run_result_t *r);
/** What the pattern came from, for reports (static buffer). In run_budgets.c. */
const char *run_pattern_source(const run_options_t *o);

/** The bounds of --check (docs/USAGE.md, "The correctness bound"), from
 *  r->err and r->ref_max of the first n outputs: bound = max(tol(dtype) *
 *  max|ref|, floor), the floor (tool_check_floor) for dQ and dK from the
 *  inputs' scales (norms[0..5], run_inputs_norms), the softmax scale of
 *  `ctx` and the unit roundoff of its backend's accumulator; sets r->bound,
 *  r->floor, r->check_ok and r->checked. In run_check.c. */
void run_check_bounds(const mtrain_context_t *ctx, mtrain_dtype_t dtype, int32_t head_dim,
                      const double norms[6], int n, run_result_t *r);
/** The report line of output t (named `name`) of the check. In run_check.c. */
void run_check_print(const char *name, const run_result_t *r, int t);
/** The test hook MTRAIN_RUN_FAULT=add-NAME:X (run_fault.h): adds X to the
 *  first element of that output among the first n. In run_check.c. */
void run_perturb_outputs(run_outputs_t *out, int n);

#endif /* MTRAIN_RUN_COMMON_H */
