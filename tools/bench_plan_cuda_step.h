/* bench_plan_cuda_step.h: a replica of the host work of the cuda backend's
 * step upload (backends/cuda/cuda_step.c, cuda_step_upload, as of commit
 * 906fdc4) for mtrain-bench-plan: the same packing of a step view's per-head
 * arrays and, for the backward, the same key-major (kv head, key block)
 * lists and bar tiles, into host memory, with the CUDA runtime calls (pinned
 * staging, events, the copy to the device) left out. It times on any machine
 * what the host pays per step before the kernels start. */
#ifndef MTRAIN_BENCH_PLAN_CUDA_STEP_H
#define MTRAIN_BENCH_PLAN_CUDA_STEP_H

#include <stddef.h>

#include "mtrain/mtrain_backend.h"

/** Reusable staging memory (grown on demand, freed by bench_cuda_step_free). */
typedef struct bench_cuda_staging {
  char *host;
  size_t cap;
} bench_cuda_staging_t;

/** Packs one step view as cuda_step_upload does before a forward
 *  (backward == 0) or a backward step, for `hkv` kv heads. *bytes_out: the
 *  metadata bytes that would be copied to the device. */
mtrain_status_t bench_cuda_step_host(bench_cuda_staging_t *s, const mtrain_step_view_t *v,
                                     int32_t hkv, int backward, size_t *bytes_out);
void bench_cuda_step_free(bench_cuda_staging_t *s);

#endif /* MTRAIN_BENCH_PLAN_CUDA_STEP_H */
