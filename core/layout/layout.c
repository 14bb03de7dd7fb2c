/* layout.c: layouts (SPEC.md section 3). A layout is an owner map over the
 * padded G-blocks of a sequence; from it come each rank's increasing block
 * list and the token index mappings the permutation needs. The owner maps
 * are dealt here; the balanced layout's choice among them is made by the
 * cost model (core/balance/balanced_layout.c); the ring schedules are in
 * schedule.c; moving tensor data is left to the backends' permute
 * operation. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/balance/balanced_layout.h"
#include "core/layout/layout_internal.h"
#include "core/layout/owner_maps.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_error.h"

/* ---- names ------------------------------------------------------------------ */

static const char *const kind_names[] = {"contiguous", "zigzag", "striped", "balanced"};

const char *mtrain_layout_kind_name(mtrain_layout_kind_t kind) {
  if ((int)kind < 0 || (int)kind > (int)MTRAIN_LAYOUT_BALANCED) return "unknown";
  return kind_names[kind];
}

mtrain_status_t mtrain_layout_kind_parse(const char *name, mtrain_layout_kind_t *out) {
  MTRAIN_CHECK_NOT_NULL(name);
  MTRAIN_CHECK_NOT_NULL(out);
  for (int k = 0; k <= (int)MTRAIN_LAYOUT_BALANCED; k++)
    if (strcmp(name, kind_names[k]) == 0) {
      *out = (mtrain_layout_kind_t)k;
      return MTRAIN_SUCCESS;
    }
  return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                      "layout '%s' is not one of contiguous, zigzag, striped, balanced", name);
}

const char *mtrain_bars_mode_name(mtrain_bars_mode_t mode) {
  switch (mode) {
  case MTRAIN_BARS_IN_RING:
    return "in_ring";
  case MTRAIN_BARS_GATHERED:
    return "gathered";
  }
  return "unknown";
}

/* ---- building layouts ---------------------------------------------------------- */

void mtrain_layout_destroy(mtrain_layout_t *layout) {
  if (!layout) return;
  free(layout->owner);
  free(layout->local);
  free(layout->blocks);
  free(layout);
}

mtrain_status_t mtrain_layout_from_owner(mtrain_layout_kind_t kind, const char *variant,
                                         mtrain_bars_mode_t bars_mode, int64_t seq_len,
                                         int32_t granularity, int32_t world, int64_t num_blocks,
                                         const int32_t *owner, mtrain_layout_t **out) {
  if (num_blocks % world != 0)
    return mtrain_error(MTRAIN_ERR_INTERNAL, "layout: %lld blocks do not divide over %d ranks",
                        (long long)num_blocks, world);
  mtrain_layout_t *l = calloc(1, sizeof *l);
  if (!l) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "layout: out of memory");
  l->kind = kind;
  l->bars_mode = bars_mode;
  snprintf(l->variant, sizeof l->variant, "%s", variant);
  l->seq_len = seq_len;
  l->granularity = granularity;
  l->world = world;
  l->num_blocks = num_blocks;
  l->num_seq_blocks = (seq_len + granularity - 1) / granularity;
  l->per_rank = (int32_t)(num_blocks / world);
  l->owner = malloc((size_t)num_blocks * sizeof *l->owner);
  l->local = malloc((size_t)num_blocks * sizeof *l->local);
  l->blocks = malloc((size_t)num_blocks * sizeof *l->blocks);
  int32_t *fill = calloc((size_t)world, sizeof *fill);
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (!l->owner || !l->local || !l->blocks || !fill) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "layout: out of memory for %lld blocks",
                      (long long)num_blocks);
    goto done;
  }
  for (int64_t b = 0; b < num_blocks; b++) {
    const int32_t r = owner[b];
    if (r < 0 || r >= world || fill[r] >= l->per_rank) {
      st = mtrain_error(MTRAIN_ERR_INTERNAL,
                        "layout: owner map gives block %lld to rank %d (world %d, %d blocks each)",
                        (long long)b, r, world, l->per_rank);
      goto done;
    }
    l->owner[b] = r;
    l->local[b] = fill[r];
    l->blocks[(int64_t)r * l->per_rank + fill[r]] = b;
    fill[r]++;
  }
done:
  free(fill);
  if (st != MTRAIN_SUCCESS) {
    mtrain_layout_destroy(l);
    return st;
  }
  *out = l;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_layout_create(mtrain_layout_kind_t kind, int64_t seq_len,
                                     int32_t granularity, int32_t world,
                                     const mtrain_balance_options_t *balance,
                                     mtrain_layout_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  if ((int)kind < 0 || (int)kind > (int)MTRAIN_LAYOUT_BALANCED)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "layout: kind %d is not one of contiguous (0), zigzag (1), striped (2), "
                        "balanced (3)",
                        (int)kind);
  if (seq_len < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "layout: seq_len %lld must be >= 1",
                        (long long)seq_len);
  if (granularity < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "layout: granularity %d must be >= 1",
                        granularity);
  if (world < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "layout: world size %d must be >= 1", world);
  const int64_t unit_blocks = (kind == MTRAIN_LAYOUT_ZIGZAG ? 2 : 1) * (int64_t)world;
  const int64_t nb = (seq_len + granularity - 1) / granularity;
  const int64_t nbp = (nb + unit_blocks - 1) / unit_blocks * unit_blocks;
  if (nbp > INT32_MAX)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "layout: seq_len %lld at granularity %d over %d ranks needs %lld padded "
                        "blocks, more than 2^31 - 1",
                        (long long)seq_len, granularity, world, (long long)nbp);
  int32_t *owner = malloc((size_t)nbp * sizeof *owner);
  if (!owner) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "layout: out of memory");
  mtrain_owner_map_t map = MTRAIN_MAP_STRIPED;
  mtrain_bars_mode_t mode = MTRAIN_BARS_IN_RING;
  mtrain_status_t st = MTRAIN_SUCCESS;
  char variant[32];
  switch (kind) {
  case MTRAIN_LAYOUT_CONTIGUOUS:
    map = MTRAIN_MAP_CONTIGUOUS;
    break;
  case MTRAIN_LAYOUT_ZIGZAG:
    map = MTRAIN_MAP_ZIGZAG;
    break;
  case MTRAIN_LAYOUT_STRIPED:
    break;
  case MTRAIN_LAYOUT_BALANCED:
    mode = MTRAIN_BARS_GATHERED; /* the default design, without a workload */
    if (balance) st = mtrain_balanced_layout_check(balance, seq_len, granularity);
    if (st == MTRAIN_SUCCESS && balance && balance->num_patterns > 0)
      st = mtrain_balanced_layout_choose(balance, seq_len, granularity, world, nbp, owner, &map,
                                         &mode);
    break;
  }
  if (st == MTRAIN_SUCCESS) {
    int32_t L = world;
    if (balance && kind == MTRAIN_LAYOUT_BALANCED && balance->ranks_per_node > 0)
      L = balance->ranks_per_node;
    mtrain_owner_map_fill(map, nbp, world, L, owner);
    if (kind == MTRAIN_LAYOUT_BALANCED)
      snprintf(variant, sizeof variant, "%s%s", mtrain_owner_map_name(map),
               mode == MTRAIN_BARS_GATHERED ? "+gathered" : "");
    else
      snprintf(variant, sizeof variant, "%s", mtrain_owner_map_name(map));
    st =
        mtrain_layout_from_owner(kind, variant, mode, seq_len, granularity, world, nbp, owner, out);
  }
  free(owner);
  return st;
}

/* ---- accessors ------------------------------------------------------------------ */

mtrain_layout_kind_t mtrain_layout_kind(const mtrain_layout_t *l) {
  return l ? l->kind : MTRAIN_LAYOUT_CONTIGUOUS;
}
const char *mtrain_layout_variant(const mtrain_layout_t *l) { return l ? l->variant : ""; }
mtrain_bars_mode_t mtrain_layout_bars_mode(const mtrain_layout_t *l) {
  return l ? l->bars_mode : MTRAIN_BARS_IN_RING;
}
int64_t mtrain_layout_seq_len(const mtrain_layout_t *l) { return l ? l->seq_len : 0; }
int32_t mtrain_layout_granularity(const mtrain_layout_t *l) { return l ? l->granularity : 0; }
int32_t mtrain_layout_world(const mtrain_layout_t *l) { return l ? l->world : 0; }
int64_t mtrain_layout_padded_len(const mtrain_layout_t *l) {
  return l ? l->num_blocks * l->granularity : 0;
}
int64_t mtrain_layout_num_blocks(const mtrain_layout_t *l) { return l ? l->num_blocks : 0; }
int64_t mtrain_layout_num_seq_blocks(const mtrain_layout_t *l) { return l ? l->num_seq_blocks : 0; }
int32_t mtrain_layout_rank_num_blocks(const mtrain_layout_t *l, int32_t rank) {
  return l && rank >= 0 && rank < l->world ? l->per_rank : 0;
}
int64_t mtrain_layout_local_tokens(const mtrain_layout_t *l, int32_t rank) {
  return (int64_t)mtrain_layout_rank_num_blocks(l, rank) * (l ? l->granularity : 0);
}
const int64_t *mtrain_layout_rank_blocks(const mtrain_layout_t *l, int32_t rank) {
  if (!l || rank < 0 || rank >= l->world) return NULL;
  return l->blocks + (int64_t)rank * l->per_rank;
}

mtrain_rank_blocks_t mtrain_layout_rank_view(const mtrain_layout_t *l, int32_t rank) {
  mtrain_rank_blocks_t v = {l->per_rank, mtrain_layout_rank_blocks(l, rank),
                            (int64_t)l->per_rank * l->granularity};
  return v;
}

mtrain_status_t mtrain_layout_block_owner(const mtrain_layout_t *l, int64_t block, int32_t *rank,
                                          int32_t *local_block) {
  MTRAIN_CHECK_NOT_NULL(l);
  MTRAIN_CHECK_NOT_NULL(rank);
  MTRAIN_CHECK_NOT_NULL(local_block);
  if (block < 0 || block >= l->num_blocks)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "layout: block %lld out of range [0, %lld) (padded block count)",
                        (long long)block, (long long)l->num_blocks);
  *rank = l->owner[block];
  *local_block = l->local[block];
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_layout_global_to_local(const mtrain_layout_t *l, int64_t token,
                                              int32_t *rank, int64_t *local) {
  MTRAIN_CHECK_NOT_NULL(l);
  MTRAIN_CHECK_NOT_NULL(rank);
  MTRAIN_CHECK_NOT_NULL(local);
  const int64_t padded = l->num_blocks * l->granularity;
  if (token < 0 || token >= padded)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "layout: token %lld out of range [0, %lld) (padded length)",
                        (long long)token, (long long)padded);
  const int64_t b = token / l->granularity;
  *rank = l->owner[b];
  *local = (int64_t)l->local[b] * l->granularity + token % l->granularity;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_layout_local_to_global(const mtrain_layout_t *l, int32_t rank, int64_t local,
                                              int64_t *token) {
  MTRAIN_CHECK_NOT_NULL(l);
  MTRAIN_CHECK_NOT_NULL(token);
  if (rank < 0 || rank >= l->world)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "layout: rank %d out of range [0, %d)", rank,
                        l->world);
  const int64_t n = (int64_t)l->per_rank * l->granularity;
  if (local < 0 || local >= n)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "layout: local token %lld out of range [0, %lld) on rank %d",
                        (long long)local, (long long)n, rank);
  const int64_t b = l->blocks[(int64_t)rank * l->per_rank + local / l->granularity];
  *token = b * l->granularity + local % l->granularity;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_layout_rank_token_index(const mtrain_layout_t *l, int32_t rank,
                                               int64_t *global) {
  MTRAIN_CHECK_NOT_NULL(l);
  MTRAIN_CHECK_NOT_NULL(global);
  if (rank < 0 || rank >= l->world)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "layout: rank %d out of range [0, %d)", rank,
                        l->world);
  const int64_t *blocks = l->blocks + (int64_t)rank * l->per_rank;
  const int32_t G = l->granularity;
  for (int32_t lb = 0; lb < l->per_rank; lb++)
    for (int32_t c = 0; c < G; c++) global[(int64_t)lb * G + c] = blocks[lb] * G + c;
  return MTRAIN_SUCCESS;
}
