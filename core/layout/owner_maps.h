/* owner_maps.h (private): the owner maps a layout deals its blocks by, shared
 * by the layout module (contiguous, zigzag, striped) and the balanced
 * layout's search (its candidates), so that neither depends on the other. */
#ifndef MTRAIN_CORE_OWNER_MAPS_H
#define MTRAIN_CORE_OWNER_MAPS_H

#include <stdint.h>

/* Owner maps. Groups are W consecutive blocks; each map gives every rank
 * exactly one block of each group (zigzag and contiguous: of the whole). */
typedef enum mtrain_owner_map {
  MTRAIN_MAP_CONTIGUOUS,
  MTRAIN_MAP_ZIGZAG,
  MTRAIN_MAP_STRIPED,  /* b mod W */
  MTRAIN_MAP_SNAKE,    /* boustrophedon: odd groups dealt in reverse */
  MTRAIN_MAP_ROTATED,  /* group g dealt from rank g mod W on */
  MTRAIN_MAP_GRID_ROT, /* position (node k, local q) of group g to node (k + g / L) mod n, local
                   (q + g) mod L: every rank visits every position of a group once in W
                   groups, so each diagonal falls on the same mix of hierarchical steps
                   on every rank */
} mtrain_owner_map_t;

/** Fills owner[0..nbp) with `map` for W ranks (L ranks per node for the
 *  grid-rotated map). nbp is a multiple of the map's unit. */
void mtrain_owner_map_fill(mtrain_owner_map_t map, int64_t nbp, int32_t W, int32_t L,
                           int32_t *owner);
/** The map's name ("striped", "snake", ...). */
const char *mtrain_owner_map_name(mtrain_owner_map_t map);

#endif /* MTRAIN_CORE_OWNER_MAPS_H */
