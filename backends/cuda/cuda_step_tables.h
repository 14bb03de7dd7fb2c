/* cuda_step_tables.h (private): the host half of a plan step's upload to the
 * "cuda" backend: the packing of a step view's per-head arrays and, for the
 * backward, the key-major (kv head, key block) lists and the bar tiles
 * (cuda_internal.h describes them) into one host buffer. Plain C without the
 * CUDA runtime: cuda_step.c packs into pinned staging and copies it to the
 * device; mtrain-bench-plan times the same code on any machine. */
#ifndef MTRAIN_CUDA_STEP_TABLES_H
#define MTRAIN_CUDA_STEP_TABLES_H

#include <stddef.h>
#include <stdint.h>

#include "mtrain/mtrain_backend.h"

/* Where the parts of a packed step lie: the buffer starts with the query and
 * key blocks' global indices (int64, num_q_blocks then num_k_blocks); the
 * int32 region follows; offsets are in int32 units from its start, and
 * SIZE_MAX marks a part the step does not have (the backward's lists in a
 * forward step). */
typedef struct cuda_step_tables {
  size_t bytes;     /* bytes of the whole packed buffer */
  size_t i32_base;  /* byte offset of the int32 region */
  size_t head_meta; /* [Hq * CUDA_HM_STRIDE] */
  size_t idx;       /* the per-head arrays */
  size_t kv_off;    /* [Hkv * num_k_blocks + 1] */
  size_t kv_ent;    /* [2 * kv entries] */
  size_t bt_tile;   /* [3 * bar tiles] */
  size_t bt_off;    /* [bar tiles + 1] */
  size_t bt_ent;    /* [3 * bar entries] */
  int32_t num_bar_tiles;
  int32_t total_bars; /* sum over heads of num_bars */
} cuda_step_tables_t;

/** Sizes the packed buffer of step view v with `hkv` kv heads, forward
 *  (backward == 0) or backward, into t->bytes (the other fields are set by
 *  cuda_step_tables_pack). MTRAIN_ERR_HEAD_MISMATCH when Hq % hkv != 0,
 *  MTRAIN_ERR_NOT_SUPPORTED beyond the 32-bit index range. */
mtrain_status_t cuda_step_tables_size(const mtrain_step_view_t *v, int32_t hkv, int backward,
                                      cuda_step_tables_t *t);

/** Packs v into `host` (at least t->bytes bytes, t from cuda_step_tables_size
 *  of the same arguments) and fills t's offsets. Thread-safe on distinct
 *  buffers. */
mtrain_status_t cuda_step_tables_pack(const mtrain_step_view_t *v, int32_t hkv, int backward,
                                      char *host, cuda_step_tables_t *t);

#endif /* MTRAIN_CUDA_STEP_TABLES_H */
