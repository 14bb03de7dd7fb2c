/* schedule.c: the ring schedule (SPEC.md section 5), the one definition the
 * ring driver, the plan builder and the cost model share: the geometry of a
 * rank in the flat or hierarchical ring and the source of the chunk it holds
 * at each step. */
#include "core/layout/schedule.h"
#include "mtrain/mtrain_error.h"

const char *mtrain_ring_kind_name(mtrain_ring_kind_t kind) {
  switch (kind) {
  case MTRAIN_RING_FLAT:
    return "flat";
  case MTRAIN_RING_HIERARCHICAL:
    return "hierarchical";
  }
  return "unknown";
}

mtrain_status_t mtrain_ring_check(int32_t world, int32_t ranks_per_node, int32_t *inner) {
  if (world < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "ring: world size %d must be >= 1", world);
  if (ranks_per_node < 0 || ranks_per_node > world ||
      (ranks_per_node > 0 && world % ranks_per_node != 0))
    return mtrain_error(
        MTRAIN_ERR_INVALID_ARGUMENT,
        "ring: ranks_per_node %d must be 0 (flat) or a divisor of the world size %d",
        ranks_per_node, world);
  *inner = ranks_per_node == 0 ? world : ranks_per_node;
  return MTRAIN_SUCCESS;
}

static int32_t mod_i32(int64_t a, int32_t m) { return (int32_t)(((a % m) + m) % m); }

mtrain_status_t mtrain_ring_geometry(int32_t world, int32_t ranks_per_node, int32_t rank,
                                     mtrain_ring_geometry_t *out) {
  MTRAIN_CHECK_NOT_NULL(out);
  int32_t L = 0;
  mtrain_status_t st = mtrain_ring_check(world, ranks_per_node, &L);
  if (st != MTRAIN_SUCCESS) return st;
  if (rank < 0 || rank >= world)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "ring: rank %d out of range [0, %d)", rank,
                        world);
  mtrain_ring_geometry_t g;
  g.world = world;
  g.rank = rank;
  g.L = L;
  g.n = world / L;
  g.node = rank / L;
  g.local = rank % L;
  g.inner_next = g.node * L + mod_i32(g.local + 1, L);
  g.inner_prev = g.node * L + mod_i32(g.local - 1, L);
  g.outer_next = mod_i32(g.node + 1, g.n) * L + g.local;
  g.outer_prev = mod_i32(g.node - 1, g.n) * L + g.local;
  *out = g;
  return MTRAIN_SUCCESS;
}

int32_t mtrain_ring_geometry_source(const mtrain_ring_geometry_t *g, int32_t t) {
  const int32_t o = t / g->L, i = t % g->L;
  return mod_i32(g->node - o, g->n) * g->L + mod_i32(g->local - i, g->L);
}

int32_t mtrain_ring_geometry_partial_from(const mtrain_ring_geometry_t *g, int32_t o) {
  return mod_i32(g->node + o, g->n) * g->L + mod_i32(g->local - 1, g->L);
}

static mtrain_status_t ring_args(int32_t world, int32_t ranks_per_node, int32_t rank, int32_t x,
                                 const char *what, int32_t *inner) {
  mtrain_status_t st = mtrain_ring_check(world, ranks_per_node, inner);
  if (st != MTRAIN_SUCCESS) return st;
  if (rank < 0 || rank >= world)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "ring: rank %d out of range [0, %d)", rank,
                        world);
  if (x < 0 || x >= world)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "ring: %s %d out of range [0, %d)", what, x,
                        world);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_ring_source(int32_t world, int32_t ranks_per_node, int32_t rank,
                                   int32_t step, int32_t *src) {
  MTRAIN_CHECK_NOT_NULL(src);
  int32_t L = 0;
  mtrain_status_t st = ring_args(world, ranks_per_node, rank, step, "step", &L);
  if (st != MTRAIN_SUCCESS) return st;
  mtrain_ring_geometry_t g;
  if ((st = mtrain_ring_geometry(world, ranks_per_node, rank, &g)) != MTRAIN_SUCCESS) return st;
  *src = mtrain_ring_geometry_source(&g, step);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_ring_step_of(int32_t world, int32_t ranks_per_node, int32_t rank,
                                    int32_t src, int32_t *step) {
  MTRAIN_CHECK_NOT_NULL(step);
  int32_t L = 0;
  mtrain_status_t st = ring_args(world, ranks_per_node, rank, src, "source rank", &L);
  if (st != MTRAIN_SUCCESS) return st;
  const int32_t n = world / L;
  const int32_t o = mod_i32(rank / L - src / L, n), i = mod_i32(rank % L - src % L, L);
  *step = o * L + i;
  return MTRAIN_SUCCESS;
}
