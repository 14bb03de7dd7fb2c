/* schedule.h (private): the ring schedule (SPEC.md section 5), defined once:
 * who holds whose K/V chunk at each step and who sends what to whom, for the
 * flat ring (one node of W ranks) and the hierarchical ring (n nodes of L
 * ranks). The ring driver (core/runtime/ring.c), the plan builder and the
 * cost model all read it from here. */
#ifndef MTRAIN_CORE_SCHEDULE_H
#define MTRAIN_CORE_SCHEDULE_H

#include "mtrain/mtrain_layout.h"

/** One rank's view of the ring: rank = node * L + local; step t = o * L + i
 *  (outer step o, inner step i). The flat ring is n = 1, L = W. */
typedef struct mtrain_ring_geometry {
  int32_t world, rank, L, n, node, local;
  int32_t inner_next, inner_prev; /**< neighbours in the node's inner ring */
  int32_t outer_next, outer_prev; /**< the same local rank of the next / previous node */
} mtrain_ring_geometry_t;

/** Validates ranks_per_node for world: 0, or a divisor of world. Returns the
 *  L the hierarchical ring uses (world when ranks_per_node is 0). */
mtrain_status_t mtrain_ring_check(int32_t world, int32_t ranks_per_node, int32_t *inner);

/** The geometry of `rank` (validated as mtrain_ring_source does). */
mtrain_status_t mtrain_ring_geometry(int32_t world, int32_t ranks_per_node, int32_t rank,
                                     mtrain_ring_geometry_t *out);

/** The rank whose chunk this rank holds at step t (0 <= t < world). */
int32_t mtrain_ring_geometry_source(const mtrain_ring_geometry_t *g, int32_t t);

/** Backward: the rank whose node partial of outer step o arrives at this
 *  rank (the chunk's owner): the node o ahead, local rank - 1, which holds
 *  this rank's chunk at the last inner step of outer step o. */
int32_t mtrain_ring_geometry_partial_from(const mtrain_ring_geometry_t *g, int32_t o);

#endif /* MTRAIN_CORE_SCHEDULE_H */
