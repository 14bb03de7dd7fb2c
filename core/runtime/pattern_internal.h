/* pattern_internal.h (private): the layout of a pattern, shared by the
 * pattern, plan and I/O modules. */
#ifndef MTRAIN_CORE_PATTERN_INTERNAL_H
#define MTRAIN_CORE_PATTERN_INTERNAL_H

#include "mtrain/mtrain.h"

/** One query head. Vertical-slash form: diagonals (sorted, unique, 0 first)
 *  and verticals (sorted, unique). Block-mask form (mask_off != NULL): for
 *  query block qb the key blocks mask_idx[mask_off[qb] .. mask_off[qb+1]),
 *  increasing, each <= qb (any block of a non-causal pattern), qb itself
 *  always present; diagonals and verticals are then empty. */
typedef struct mtrain_pattern_head {
  int32_t *diagonals;
  int32_t num_diagonals;
  int64_t *verticals;
  int32_t num_verticals;
  int64_t *mask_off; /* [nb + 1] or NULL */
  int32_t *mask_idx;
} mtrain_pattern_head_t;

struct mtrain_pattern {
  int64_t seq_len;
  int32_t num_heads;
  int32_t granularity;
  int64_t num_blocks;
  int causal; /* 1: key j <= query i (SPEC.md section 1); 0: block masks over all keys */
  mtrain_pattern_head_t *heads;
};

/** Sets head h to block-mask form from CSR (copied); validates. */
mtrain_status_t mtrain_pattern_set_block_csr(mtrain_pattern_t *pattern, int32_t head,
                                             const int64_t *mask_off, const int32_t *mask_idx);

/** 1 if block diagonal t is in head's diagonal set (binary search). */
int mtrain_pattern_head_has_diagonal(const mtrain_pattern_head_t *head, int64_t t);

#endif /* MTRAIN_CORE_PATTERN_INTERNAL_H */
