/* mtrain_cpu.h: the CPU oracle available to users and tests: fp64
 * dense-masked attention straight from the pattern's allowed(h, i, j)
 * predicate (SPEC.md sections 1 and 7), sharing no code with the plan or the
 * backends. O(N^2 * Hq * d): meant for small N (checks, tests). Single
 * sequence, single rank, host memory, caller-owned fp64 buffers; thread-safe
 * (no shared state); parallel with OpenMP over query heads. */
#ifndef MTRAIN_CPU_H
#define MTRAIN_CPU_H

#include "mtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

/** o [N, Hq, d] and lse [N, Hq] from q [N, Hq, d], k and v [N, Hkv, d], where
 *  N and Hq come from the pattern. scale <= 0 means 1/sqrt(d). */
MTRAIN_API mtrain_status_t mtrain_cpu_dense_reference_forward(
    const mtrain_pattern_t *pattern, int32_t num_kv_heads, int32_t head_dim, double scale,
    const double *q, const double *k, const double *v, double *o, double *lse);

/** dq, dk, dv (overwritten) from the forward's inputs and outputs and dout. */
MTRAIN_API mtrain_status_t mtrain_cpu_dense_reference_backward(
    const mtrain_pattern_t *pattern, int32_t num_kv_heads, int32_t head_dim, double scale,
    const double *q, const double *k, const double *v, const double *o, const double *lse,
    const double *dout, double *dq, double *dk, double *dv);

/** Pattern quality: the share of the dense causal attention mass the pattern
 *  keeps. For each head and row i, the dense softmax over keys j <= i (every
 *  key, for a non-causal pattern) is summed over the allowed keys; the result is averaged over rows
 *  (per_head[h], when not NULL) and over heads (*mean). fp64,
 *  O(N^2 * Hq * d): for small N. q [N, Hq, d], k [N, Hkv, d] in fp64. */
MTRAIN_API mtrain_status_t mtrain_cpu_pattern_recall(const mtrain_pattern_t *pattern,
                                                     int32_t num_kv_heads, int32_t head_dim,
                                                     double scale, const double *q, const double *k,
                                                     double *per_head, double *mean);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_CPU_H */
