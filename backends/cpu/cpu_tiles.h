/* cpu_tiles.h (private): enumerates the column tiles one (head, query block)
 * computes in a plan step, for the fast CPU path: runs of key blocks become
 * contiguous tiles of at most `tile_cols` local key columns (the causal
 * diagonal block in tiles of its own, masked, also of at most `tile_cols`
 * columns whatever the granularity), bar segments become tiles of the head's
 * gathered bar rows. */
#ifndef MTRAIN_CPU_TILES_H
#define MTRAIN_CPU_TILES_H

#include "mtrain/mtrain_backend.h"

typedef struct cpu_tile {
  int64_t first;    /* first local key column (runs) or first bar index (bars) */
  int32_t count;    /* columns in the tile */
  int32_t causal;   /* 1: in the diagonal block: mask column c where diag_col + c > row r */
  int32_t is_bar;   /* 1: columns are bars[first .. first+count) */
  int32_t diag_col; /* causal tiles: the tile's first column within the diagonal block */
} cpu_tile_t;

typedef void (*cpu_tile_fn)(void *ctx, const cpu_tile_t *tile);

/** Calls fn for every tile of (head h, local query block qb), runs first in
 *  increasing key order, then bar segments. No tile has more than tile_cols
 *  columns. */
void mtrain_cpu_for_each_tile(const mtrain_step_view_t *view, int32_t h, int32_t qb,
                              int32_t tile_cols, cpu_tile_fn fn, void *ctx);

#endif /* MTRAIN_CPU_TILES_H */
