/* ring.h (private): the ring driver's interface to the attention entry
 * points: which step function to call with the chunk in hand, and (backward)
 * this rank's own dK/dV accumulators, into which the partials of its chunk
 * are added. */
#ifndef MTRAIN_CORE_RING_H
#define MTRAIN_CORE_RING_H

#include "mtrain/mtrain.h"

/** Computes ring step t with the chunk in hand (backend memory): k, v of
 *  the input dtype, dk, dv accumulators of the acc dtype (NULL forward). */
typedef mtrain_status_t (*mtrain_ring_step_fn)(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                               int32_t t, const void *k, const void *v, void *dk,
                                               void *dv, void *user);

typedef struct mtrain_ring_args {
  int backward;
  mtrain_dtype_t dtype;  /**< dtype of k and v */
  size_t chunk_elems;    /**< elements of one of k, v (local tokens x Hkv x d) */
  const void *k, *v;     /**< this rank's own chunk (backend memory) */
  void *dk_own, *dv_own; /**< backward: this rank's dK/dV accumulators (acc dtype) */
  mtrain_ring_step_fn step;
  void *user;
} mtrain_ring_args_t;

/** Runs every step of a plan, moving chunks through the context's
 *  communicator: the only step loop of the library. On one rank (a ring of
 *  one) the chunk in hand is the rank's own K/V and its gradients accumulate
 *  in place: nothing is copied or sent. Collective over the communicator. */
mtrain_status_t mtrain_ring_run(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                const mtrain_ring_args_t *args);

#endif /* MTRAIN_CORE_RING_H */
