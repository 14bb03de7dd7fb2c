/* cpu_block_common.h (private): the indexing shared by the block-score files
 * of the CPU backends (cpu_block_scores.c, cpu_block_antidiag.c): where a
 * (head, query block) row of scores lives, which key blocks a call holds and
 * where a global key sits in k (every key, or a chunk of key blocks). */
#ifndef MTRAIN_CPU_BLOCK_COMMON_H
#define MTRAIN_CPU_BLOCK_COMMON_H

#include <stdint.h>

#include "backends/cpu/cpu_backend.h"
#include "mtrain/mtrain_backend.h"

/** The first entry of row qb in a causal triangle. */
static inline int64_t cpu_tri_row(int64_t qb) { return qb * (qb + 1) / 2; }

/** The output row of (head h, local block lb, global block gb): the full
 *  triangle (or square, non-causally), or the compact rows of scores_row. */
static inline double *cpu_block_out_row(const mtrain_block_scores_args_t *a, int32_t h, int32_t lb,
                                        int64_t gb) {
  if (a->scores_row) return a->scores + (int64_t)h * a->scores_head_stride + a->scores_row[lb];
  const int64_t nb = (a->seq_len + a->granularity - 1) / a->granularity;
  if (a->noncausal) return a->scores + (int64_t)h * nb * nb + gb * nb;
  return a->scores + (int64_t)h * (nb * (nb + 1) / 2) + cpu_tri_row(gb);
}

/** Whether row gb has no entry for key block kb: padding (kb >= nb), or
 *  above the diagonal of a causal call. */
static inline int cpu_block_skip(const mtrain_block_scores_args_t *a, int64_t gb, int64_t kb,
                                 int64_t nb) {
  return kb >= nb || (!a->noncausal && kb > gb);
}

/** The key blocks of a call: every block (k holds all keys) or the chunk's. */
static inline int64_t cpu_call_blocks(const mtrain_block_scores_args_t *a) {
  return a->k_block_global ? a->num_k_blocks : (a->seq_len + a->granularity - 1) / a->granularity;
}

/** The global key block of call block x. */
static inline int64_t cpu_call_block(const mtrain_block_scores_args_t *a, int64_t x) {
  return a->k_block_global ? a->k_block_global[x] : x;
}

/** The slot in k of global key j, in call block x (global key block kb). */
static inline int64_t cpu_key_slot(const mtrain_block_scores_args_t *a, int64_t x, int64_t kb,
                                   int64_t j) {
  return a->k_block_global ? x * a->granularity + (j - kb * a->granularity) : j;
}

/** The antidiagonal scores of one (head, local block lb, global block gb)
 *  row in fp64 as SPEC.md 9.2 writes them (cpu-ref): every key at once
 *  (antidiag_pass 0) or one pass over a key chunk. 1 when out of memory. */
int mtrain_cpu_ref_antidiag_row(const mtrain_block_scores_args_t *a, int32_t h, int32_t lb,
                                int64_t gb, int32_t rows, double *out);

/** The antidiagonal scores of the cpu backend (fp32 logits, each a sum
 *  over k ascending, vectorised across key columns; fp64 softmax sums), from
 *  q and k already in fp32 (k: every key, or the chunk of k_block_global). */
mtrain_status_t mtrain_cpu_fast_antidiag_scores(cpu_state_t *s, const mtrain_block_scores_args_t *a,
                                                const float *q, const float *k);

#endif /* MTRAIN_CPU_BLOCK_COMMON_H */
