/* cuda_select.h (private): the parts of the device vertical-slash selection
 * (cuda_select.cu) that the pattern_select slots and the device plan
 * (cuda_device_plan.c) share: the host checks and sizes of a batch, the
 * queued kernels with the kept sets written where the caller says, and the
 * read back of those sets into the host outputs of mtrain_select_args_t. */
#ifndef MTRAIN_CUDA_SELECT_H
#define MTRAIN_CUDA_SELECT_H

#include <stddef.h>
#include <stdint.h>

#include "backends/cuda/cuda_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The checks and sizes of the selection of a batch (cuda_select_plan). */
typedef struct cuda_select_plan {
  void *heads;  /* host [entries]: the heads' device budgets (sel::Head) */
  size_t *base; /* host [count]: each sequence's scratch offset */
  int64_t entries, total_v, total_d, sort_pow2;
  size_t bytes; /* device scratch of the sequences' selections */
} cuda_select_plan_t;

/** Checks `count` sequences' selection arguments and sizes their scratch:
 *  MTRAIN_ERR_NOT_SUPPORTED for lengths the device cannot select (N >= 2^31;
 *  top-p caps of any size are selected, in chunks of 8192 ranks),
 *  MTRAIN_ERR_INVALID_ARGUMENT for bad geometry. Host only. */
mtrain_status_t cuda_select_plan(const mtrain_select_args_t *args, int32_t count,
                                 cuda_select_plan_t *p);
void cuda_select_plan_free(cuda_select_plan_t *p);

/** Queues the selection kernels of the batch (one launch each) on
 *  s->stream with their scratch at `scratch` (p->bytes of device memory).
 *  counts: device [2 * entries] (verticals, block diagonals per (sequence,
 *  head), sequences in order). verticals[q] / diags[q]: where sequence q's
 *  kept sets go (device; head h at h * N and h * (nb + 1)); NULL: in the
 *  scratch. Never waits for the device. */
mtrain_status_t cuda_select_queue(cuda_state_t *s, const mtrain_select_args_t *args, int32_t count,
                                  const cuda_select_plan_t *p, void *scratch, int32_t *counts,
                                  int64_t *const *verticals, int32_t *const *diags);

/** Device bytes cuda_select_read packs into. */
size_t cuda_select_read_bytes(const cuda_select_plan_t *p);

/** Packs the kept sets (where cuda_select_queue left them) into
 *  `pack_scratch` (cuda_select_read_bytes), copies the counts and the packed
 *  sets to the host (two waits) and writes every head's share into args[q]'s
 *  host outputs (verticals, num_verticals, diagonals, num_diagonals). */
mtrain_status_t cuda_select_read(cuda_state_t *s, const mtrain_select_args_t *args, int32_t count,
                                 const cuda_select_plan_t *p, int64_t *const *verticals,
                                 int32_t *const *diags, const int32_t *counts, void *pack_scratch);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_CUDA_SELECT_H */
