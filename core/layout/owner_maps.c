/* owner_maps.c: the owner maps (which rank holds each padded G-block) that
 * layouts are dealt by: contiguous, zigzag, striped, and the balanced
 * layout's candidates snake, rotated and grid-rotated. */
#include "core/layout/owner_maps.h"

void mtrain_owner_map_fill(mtrain_owner_map_t map, int64_t nbp, int32_t W, int32_t L,
                           int32_t *owner) {
  for (int64_t b = 0; b < nbp; b++) {
    const int64_t g = b / W;
    const int32_t p = (int32_t)(b % W);
    switch (map) {
    case MTRAIN_MAP_CONTIGUOUS:
      owner[b] = (int32_t)(b / (nbp / W));
      break;
    case MTRAIN_MAP_ZIGZAG: {
      const int32_t chunk = (int32_t)(b / (nbp / (2 * W)));
      owner[b] = chunk < W ? chunk : 2 * W - 1 - chunk;
      break;
    }
    case MTRAIN_MAP_STRIPED:
      owner[b] = p;
      break;
    case MTRAIN_MAP_SNAKE:
      owner[b] = g % 2 == 0 ? p : W - 1 - p;
      break;
    case MTRAIN_MAP_ROTATED:
      owner[b] = (int32_t)((p + g) % W);
      break;
    case MTRAIN_MAP_GRID_ROT: {
      const int32_t n = W / L;
      owner[b] = (int32_t)((p / L + g / L) % n) * L + (int32_t)((p % L + g) % L);
      break;
    }
    }
  }
}

static const char *const map_names[] = {"contiguous", "zigzag",  "striped",
                                        "snake",      "rotated", "grid-rotated"};

const char *mtrain_owner_map_name(mtrain_owner_map_t map) {
  return (int)map >= 0 && (int)map <= (int)MTRAIN_MAP_GRID_ROT ? map_names[map] : "unknown";
}
