/* reference.h: the reference copies of the plan builder, the selection and
 * the estimate as of commit 906fdc4 (plan_ref.c, select_ref.c,
 * estimate_ref.c), against which the optimised code of the library is
 * tested bitwise. Same contracts as the library functions of the same names
 * without the ref_ prefix. */
#ifndef MTRAIN_TESTS_REFERENCE_H
#define MTRAIN_TESTS_REFERENCE_H

#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain.h"

struct mtrain_layout;

/** mtrain_plan_create and mtrain_plan_create_ring as of 906fdc4. */
mtrain_status_t ref_plan_create(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                const mtrain_pattern_t *const *patterns, mtrain_plan_t **out);
mtrain_status_t ref_plan_create_ring(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                     const struct mtrain_layout *const *layouts,
                                     int32_t ranks_per_node,
                                     const mtrain_pattern_t *const *patterns, mtrain_plan_t **out);
/** Frees a plan made by ref_plan_create or ref_plan_create_ring. */
void ref_plan_destroy(mtrain_plan_t *plan);
/** The step builder (plan_internal.h) as of 906fdc4. */
mtrain_status_t ref_plan_build_step_head(const mtrain_pattern_t *pattern, int32_t head,
                                         const mtrain_rank_blocks_t *q,
                                         const mtrain_rank_blocks_t *k,
                                         mtrain_step_head_store_t *out);
mtrain_status_t ref_plan_build_step_head_runs(const mtrain_pattern_t *pattern, int32_t head,
                                              const mtrain_rank_blocks_t *q,
                                              const mtrain_rank_blocks_t *k,
                                              mtrain_step_head_store_t *out);
void ref_step_head_store_free(mtrain_step_head_store_t *s);
mtrain_step_head_t ref_step_head_view(const mtrain_step_head_store_t *s);

/** The selection (select.h) as of 906fdc4. */
int64_t ref_select_top_k(const double *scores, const uint8_t *forced, int64_t n, int64_t k,
                         int64_t *order, int64_t *out);
int64_t ref_select_top_p(const double *scores, int64_t n, double p, int64_t cap, int64_t *order,
                         int64_t *out);
int32_t ref_token_to_block_diagonals(const int64_t *tokens, int64_t n, int32_t granularity,
                                     int64_t num_blocks, int32_t *out);

/** mtrain_pattern_estimate and mtrain_pattern_estimate_ring as of 906fdc4. */
mtrain_status_t ref_pattern_estimate(mtrain_context_t *ctx, const mtrain_tensor_t *q,
                                     const mtrain_tensor_t *k, const mtrain_head_budget_t *budgets,
                                     const mtrain_estimate_options_t *options,
                                     mtrain_pattern_t **out);
mtrain_status_t ref_pattern_estimate_ring(mtrain_context_t *ctx, const struct mtrain_layout *layout,
                                          const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                          const mtrain_head_budget_t *budgets,
                                          const mtrain_estimate_options_t *options,
                                          mtrain_pattern_t **out);

#endif /* MTRAIN_TESTS_REFERENCE_H */
