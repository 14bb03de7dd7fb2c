/* host_select.h: a stand-in for a backend's pattern_select slot for the
 * white-box tests (they link mtrain_internal): the vertical-slash selection
 * of SPEC.md section 2 written with the core's own host selection
 * (core/runtime/select.h), so that a test table that "selects on the
 * backend" gives exactly the host's patterns. Header-only (static inline):
 * black-box tests, which link only the public libmtrain, never include it. */
#ifndef MTRAIN_TEST_HOST_SELECT_H
#define MTRAIN_TEST_HOST_SELECT_H

#include <stdlib.h>
#include <string.h>

#include "core/runtime/select.h"
#include "mtrain/mtrain_backend.h"

/** Fills a's host outputs (verticals, num_verticals, diagonals,
 *  num_diagonals) from its scores (host memory: the cpu backends'), as the
 *  cuda backend's pattern_select does on the device. */
static inline mtrain_status_t ts_host_pattern_select(void *state, const mtrain_select_args_t *a) {
  (void)state;
  const int64_t N = a->seq_len, G = a->granularity, nb = (N + G - 1) / G;
  const int64_t nv_cand = ((N - 1) / G) * G;
  double *ss = malloc(sizeof(double) * (size_t)N);
  int64_t *order = malloc(sizeof(int64_t) * (size_t)N), *tokens = malloc(sizeof(int64_t) * N);
  int32_t *blocks = malloc(sizeof(int32_t) * (size_t)(2 * N + 1));
  uint8_t *forced = malloc((size_t)N);
  for (int32_t h = 0; h < a->num_heads; h++) {
    const mtrain_head_budget_t *b = &a->budgets[h];
    const double *col = a->col + h * N, *diag = a->diag + h * N * a->slots;
    for (int64_t t = 0; t < N; t++) {
      double sum = 0.0;
      for (int32_t s = 0; s < a->slots; s++) sum += diag[t * a->slots + s];
      ss[t] = sum;
    }
    int64_t *verticals = a->verticals + h * N, nv, ns;
    if (b->kind == MTRAIN_BUDGET_TOP_K) {
      for (int64_t i = 0; i < N; i++) forced[i] = i < a->num_sinks;
      nv = mtrain_select_top_k(col, forced, nv_cand, b->v_size, order, verticals);
      for (int64_t i = 0; i < N; i++) forced[i] = i < a->window;
      ns = mtrain_select_top_k(ss, forced, N, b->s_size, order, tokens);
    } else {
      const int f = a->top_p_forced;
      for (int64_t i = 0; i < N; i++) forced[i] = f && i < a->num_sinks;
      nv = mtrain_select_top_p(col, forced, nv_cand, b->p_v, b->cap_v, order, verticals);
      for (int64_t i = 0; i < N; i++) forced[i] = f && i < a->window;
      ns = mtrain_select_top_p(ss, forced, N, b->p_s, b->cap_s, order, tokens);
    }
    const int32_t nd = mtrain_token_to_block_diagonals(tokens, ns, (int32_t)G, nb, blocks);
    memcpy(a->diagonals + h * (nb + 1), blocks, sizeof(int32_t) * (size_t)nd);
    a->num_verticals[h] = (int32_t)nv;
    a->num_diagonals[h] = nd;
  }
  free(ss), free(order), free(tokens), free(blocks), free(forced);
  return MTRAIN_SUCCESS;
}

#endif /* MTRAIN_TEST_HOST_SELECT_H */
