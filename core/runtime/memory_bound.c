/* memory_bound.c: the backend memory the estimation, the forward and the
 * backward of one plan allocate at their peak, computed from the shapes the
 * way attention.c, ring.c and estimate.c allocate (docs/MEMORY.md derives
 * each term). Each term is exact for the requested sizes (the estimation's
 * counts the ring form's gathered queries, which the single-rank form does
 * not allocate): a change to those allocations must change this file and
 * docs/MEMORY.md with it (tests/test_memory.c checks that the measured
 * peaks equal the terms). */
#include <stdint.h>

#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain_error.h"

/* Bytes of an allocation that attention.c rounds up from 0 to 1. */
static size_t at_least_1(size_t bytes) { return bytes ? bytes : 1; }

/* The gathered last-L queries of the ring form of the estimate. */
static size_t q_last_bytes(int64_t N, int32_t Hq, int32_t d, int32_t last_q, mtrain_dtype_t dtype) {
  const int32_t L = last_q < N ? last_q : (int32_t)N;
  return (size_t)Hq * (size_t)L * (size_t)d * (dtype == MTRAIN_F64 ? 8 : 4);
}

/* estimate_core.c: the scores' backend buffers of one sequence of N tokens
 * with top-p heads (the normalisers' row sums and the row statistics, then
 * col and diag; top-k alone allocates only col and diag) plus the gathered
 * last-L queries of the ring form (q_last). */
static size_t estimate_bytes(int64_t N, int32_t Hq, int32_t d, int32_t G, int32_t last_q,
                             mtrain_dtype_t dtype) {
  const int32_t L = last_q < N ? last_q : (int32_t)N;
  const size_t slots = (size_t)mtrain_scores_slots(L, G), nb = (size_t)((N + G - 1) / G);
  const size_t hl = (size_t)Hq * (size_t)L, n_row_sums = hl * nb;
  const size_t n_row = n_row_sums + 2 * hl;
  const size_t n_col = (size_t)Hq * (size_t)N, n_diag = n_col * slots;
  return sizeof(double) * (n_row + n_col + n_diag) + q_last_bytes(N, Hq, d, last_q, dtype);
}

mtrain_status_t mtrain_memory_bound(const mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                    int32_t kv_heads, int32_t head_dim, mtrain_dtype_t dtype,
                                    int32_t last_q, mtrain_memory_bound_t *out) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(plan);
  MTRAIN_CHECK_NOT_NULL(out);
  const size_t e = mtrain_dtype_size(dtype), a = mtrain_dtype_size(mtrain_be_acc_dtype(ctx));
  if (e == 0) return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "memory bound: unknown dtype");
  if (kv_heads < 1 || plan->num_heads % kv_heads != 0 || head_dim < 1 || last_q < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "memory bound: kv_heads %d (must divide the plan's %d heads), head_dim %d "
                        "(>= 1), last_q %d (>= 0)",
                        kv_heads, plan->num_heads, head_dim, last_q);
  const size_t T = (size_t)plan->local_tokens, Hq = (size_t)plan->num_heads;
  const size_t Hkv = (size_t)kv_heads, d = (size_t)head_dim;
  const size_t q_acc = T * Hq * d * a, row_acc = T * Hq * a;   /* [T, Hq, d] and [T, Hq] */
  const size_t kv = T * Hkv * d * e, kv_acc = T * Hkv * d * a; /* one of K, V; dK, dV */
  mtrain_memory_bound_t b = {0};
  /* attention.c: forward o_acc, lse_acc; backward lse_acc, delta_acc, dq_acc, dk_acc, dv_acc */
  b.forward_bytes = at_least_1(q_acc) + at_least_1(row_acc);
  b.backward_bytes = 2 * at_least_1(row_acc) + at_least_1(q_acc) + 2 * at_least_1(kv_acc);
  if (plan->world > 1) {
    /* ring.c: the chunk buffers [K | V] (+ [dK | dV] backward) the schedule uses (A; B with
     * several nodes; C, D with an inner ring of 2 or 3+ ranks); backward also the inner
     * partial and, per node, a partial in and out. The ring of one allocates nothing. */
    const size_t L = plan->ranks_per_node > 0 ? (size_t)plan->ranks_per_node : (size_t)plan->world;
    const size_t nodes = (size_t)plan->world / L;
    const size_t chunks = 1 + (nodes > 1) + (L > 1) + (L > 2);
    size_t ring_fwd = chunks * (2 * kv);
    size_t ring_bwd = chunks * (2 * kv + 2 * kv_acc) + 2 * kv_acc + nodes * 2 * (2 * kv_acc);
    if (plan->gathered) {
      /* attention.c, bars gathered: gather_bars holds its pack, the all-gathered packs and
       * the gathered [K | V] rows at once, then keeps the rows; backward adds their
       * [dK | dV] (acc dtype) through the ring, and scatter_bar_grads the owned rows' sums
       * and the owner's own rows (acc dtype) */
      const mtrain_plan_gathered_t *g = plan->gathered;
      const size_t row_e = Hkv * d * e, row_a = Hkv * d * a;
      const size_t pack = at_least_1(2 * (size_t)g->max_owned * row_e);
      const size_t all = at_least_1(2 * (size_t)g->max_owned * row_e * (size_t)plan->world);
      const size_t rows = at_least_1(2 * (size_t)g->count * row_e);
      const size_t drows = at_least_1(2 * (size_t)g->count * row_a);
      const size_t owned = g->owned > 0 ? 3 * (size_t)g->owned * row_a : 0;
      const size_t gather = pack + all + rows;
      ring_fwd = gather > rows + ring_fwd ? gather : rows + ring_fwd;
      const size_t after = drows + (ring_bwd > owned ? ring_bwd : owned);
      ring_bwd = gather > rows + after ? gather : rows + after;
    }
    b.forward_bytes += ring_fwd;
    b.backward_bytes += ring_bwd;
  }
  if (last_q > 0) {
    /* W > 1: one mtrain_pattern_estimate_ring per sequence, the longest's buffers. One rank:
     * mtrain_pattern_estimate_batch holds every sequence's buffers at once; their sum, with
     * the longest sequence's q_last term kept so that one sequence's bound is as on a ring
     * (the single-rank estimate allocates no q_last: the caller subtracts it, mtrain.h). */
    int64_t N = 0;
    size_t sum = 0, longest = 0;
    for (int32_t s = 0; s < plan->num_seqs; s++) {
      const int64_t n = plan->seqs[s].pattern->seq_len;
      const size_t one =
          estimate_bytes(n, plan->num_heads, head_dim, plan->granularity, last_q, dtype);
      sum += one - q_last_bytes(n, plan->num_heads, head_dim, last_q, dtype);
      if (n > N) N = n, longest = one;
    }
    b.estimate_bytes =
        plan->world > 1 ? longest : sum + q_last_bytes(N, plan->num_heads, head_dim, last_q, dtype);
  }
  if (plan->device) {
    /* plan_estimated.c: the device plan's memory is taken during the estimate
     * (after its score buffers) and held until the plan is destroyed */
    b.device_plan_bytes = plan->device->bytes;
    if (last_q > 0) b.estimate_bytes += b.device_plan_bytes;
    b.forward_bytes += b.device_plan_bytes;
    b.backward_bytes += b.device_plan_bytes;
  }
  b.backend_bytes = b.forward_bytes > b.backward_bytes ? b.forward_bytes : b.backward_bytes;
  if (b.estimate_bytes > b.backend_bytes) b.backend_bytes = b.estimate_bytes;
  b.plan_bytes = plan->bytes - b.device_plan_bytes;
  *out = b;
  return MTRAIN_SUCCESS;
}
