/* layout_internal.h (private): the layout's representation and its owner
 * maps, shared by the layout module, the cost model (which counts work from
 * the owner map), the balanced layout's search and the tests. */
#ifndef MTRAIN_CORE_LAYOUT_INTERNAL_H
#define MTRAIN_CORE_LAYOUT_INTERNAL_H

#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain_layout.h"

struct mtrain_layout {
  mtrain_layout_kind_t kind;
  mtrain_bars_mode_t bars_mode;
  char variant[32];
  int64_t seq_len;
  int32_t granularity;
  int32_t world;
  int64_t num_blocks;     /* padded block count */
  int64_t num_seq_blocks; /* ceil(seq_len / G) */
  int32_t per_rank;       /* blocks per rank (all ranks hold the same number) */
  int32_t *owner;         /* [num_blocks] rank of each global block */
  int32_t *local;         /* [num_blocks] local block index on its rank */
  int64_t *blocks;        /* [num_blocks] rank r's blocks at blocks + r * per_rank */
};

/** The blocks of one rank as the plan builder takes them (tokens = blocks * G). */
mtrain_rank_blocks_t mtrain_layout_rank_view(const mtrain_layout_t *layout, int32_t rank);

/** Builds a layout from an owner map of num_blocks blocks (each rank must own
 *  num_blocks / world of them). The owner array is copied. */
mtrain_status_t mtrain_layout_from_owner(mtrain_layout_kind_t kind, const char *variant,
                                         mtrain_bars_mode_t bars_mode, int64_t seq_len,
                                         int32_t granularity, int32_t world, int64_t num_blocks,
                                         const int32_t *owner, mtrain_layout_t **out);

#endif /* MTRAIN_CORE_LAYOUT_INTERNAL_H */
