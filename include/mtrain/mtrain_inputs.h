/* mtrain_inputs.h: reproducible structured inputs for tests, benchmarks and
 * the tools. Random normal q and k give flat attention and flat patterns;
 * these inputs give the vertical-slash structure of real models: q and k are
 * rotated by RoPE over their positions around a shared mean component (which
 * makes attention depend on the distance i - j: slashes), and a few outlier
 * keys with large norms aligned with the mean query (which attract every
 * query: verticals), including the first keys (attention sinks). Host
 * memory; thread-safe; the same options give the same tensors bitwise. */
#ifndef MTRAIN_INPUTS_H
#define MTRAIN_INPUTS_H

#include "mtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mtrain_structured_options {
  uint64_t seed;
  double rope_base;        /**< RoPE frequency base (default 10000) */
  double mean_strength;    /**< norm of the shared mean component relative to the noise (slashes) */
  int32_t num_sinks;       /**< first keys made outliers (default 4) */
  int32_t num_outliers;    /**< further outlier keys at seeded random positions (default 16) */
  double outlier_strength; /**< outlier key norm relative to an ordinary key */
} mtrain_structured_options_t;

#define MTRAIN_STRUCTURED_INIT                                                                     \
  { 1, 10000.0, 2.0, 4, 16, 4.0 }

/** Fills q [N, Hq, d], k and v [N, Hkv, d] (any storage dtype, host memory,
 *  shapes taken from the tensors, which must agree) with structured inputs.
 *  v is plain normal noise. */
MTRAIN_API mtrain_status_t mtrain_generate_structured(const mtrain_structured_options_t *options,
                                                      mtrain_tensor_t *q, mtrain_tensor_t *k,
                                                      mtrain_tensor_t *v);

/** The same inputs for some of the tokens of a sequence of `seq_len` tokens:
 *  row r of q [R, Hq, d], k and v [R, Hkv, d] is token index[r] of the
 *  sequence, bitwise equal to that token's row of mtrain_generate_structured
 *  on [seq_len, ...] tensors with the same options; an index >= seq_len gives
 *  a zero row (a layout's padding slot, see mtrain_layout_rank_token_index).
 *  index NULL: rows 0 .. R-1 (R <= seq_len). Work O(R) (OpenMP over the
 *  rows) plus O(seq_len) for the outlier positions: each rank of a ring makes
 *  only its own slots. Negative indices: MTRAIN_ERR_INVALID_ARGUMENT. */
MTRAIN_API mtrain_status_t mtrain_generate_structured_rows(
    const mtrain_structured_options_t *options, int64_t seq_len, const int64_t *index,
    mtrain_tensor_t *q, mtrain_tensor_t *k, mtrain_tensor_t *v);

/** Fills a tensor with normal noise of standard deviation `stddev` (seeded). */
MTRAIN_API mtrain_status_t mtrain_generate_normal(uint64_t seed, double stddev, mtrain_tensor_t *t);

/** A random pattern like `like`: for every head the same number of verticals
 *  (at random key positions) and random block diagonals (0 always) added in
 *  random order until its allowed-pair count is as close as it gets to that
 *  of `like`'s head: a pattern of the same density but no knowledge of the
 *  attention. Seeded; the caller destroys the result. */
MTRAIN_API mtrain_status_t mtrain_pattern_random_like(const mtrain_pattern_t *like, uint64_t seed,
                                                      mtrain_pattern_t **out);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_INPUTS_H */
