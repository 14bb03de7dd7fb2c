/* test_support.h: helpers shared by the tests: a seeded random generator,
 * buffers with guard bytes, error measures, random and real-budget patterns,
 * and a message-checking assertion. Not part of the library. */
#ifndef MTRAIN_TEST_SUPPORT_H
#define MTRAIN_TEST_SUPPORT_H

#include <stddef.h>
#include <stdint.h>

#include "mtrain/mtrain.h"

/* ---- random numbers (splitmix64; reproducible from a seed) ---- */
typedef struct ts_rng {
  uint64_t state;
} ts_rng_t;

void ts_rng_seed(ts_rng_t *rng, uint64_t seed);
uint64_t ts_rng_u64(ts_rng_t *rng);
/** Uniform in [0, 1). */
double ts_rng_uniform(ts_rng_t *rng);
/** Standard normal. */
double ts_rng_normal(ts_rng_t *rng);
/** Uniform integer in [0, n). */
int64_t ts_rng_below(ts_rng_t *rng, int64_t n);

/* ---- buffers with guard bytes ---- */
#define TS_GUARD_BYTES 64
#define TS_GUARD_VALUE 0xA5

/** A malloc'ed buffer of `bytes` with TS_GUARD_BYTES guard bytes before and
 *  after, set to TS_GUARD_VALUE. */
typedef struct ts_buf {
  unsigned char *base;
  void *data;
  size_t bytes;
} ts_buf_t;

ts_buf_t ts_buf_alloc(size_t bytes);
void ts_buf_free(ts_buf_t *b);
/** 1 when both guards are intact. */
int ts_buf_guards_ok(const ts_buf_t *b);

/** Fills `count` elements of `dtype` with normal values * scale (rounded to
 *  the dtype) and also writes the exact stored values as doubles into
 *  `as_double` when not NULL. */
void ts_fill_normal(ts_rng_t *rng, void *data, mtrain_dtype_t dtype, int64_t count, double scale,
                    double *as_double);
/** Widens any dtype buffer to a new malloc'ed double array. */
double *ts_to_double(const void *data, mtrain_dtype_t dtype, int64_t count);

/** max |a - b| over count doubles; NaN anywhere gives +inf. */
double ts_max_abs_diff(const double *a, const double *b, int64_t count);
/** max |a| over count doubles. */
double ts_max_abs(const double *a, int64_t count);
/** 1 if any element is NaN or Inf. */
int ts_has_nonfinite(const double *a, int64_t count);

/* ---- patterns ---- */
typedef enum ts_pattern_kind {
  TS_PATTERN_DENSE,
  TS_PATTERN_DIAGONAL_ONLY,
  TS_PATTERN_RANDOM_SPARSE, /* random diagonals and verticals */
  TS_PATTERN_BLOCK_MASK,    /* random generic block mask */
  TS_PATTERN_BUDGETS,       /* from a real budget file (see ts_pattern_from_budgets) */
  TS_PATTERN_NONCAUSAL,     /* random non-causal block mask (mtrain_pattern_create_noncausal):
                               blocks on both sides of the diagonal */
  TS_PATTERN_SINK_MASK,     /* random block mask with key block 0 (a "sink") in every row */
} ts_pattern_kind_t;

const char *ts_pattern_kind_name(ts_pattern_kind_t kind);

/** A random pattern of the given kind (TS_PATTERN_BUDGETS uses the Qwen2.5-3B
 *  static budgets, layer picked by the seed). Aborts the test on failure. */
mtrain_pattern_t *ts_make_pattern(ts_pattern_kind_t kind, int64_t seq_len, int32_t num_heads,
                                  int32_t granularity, uint64_t seed);

/** A vertical-slash pattern from a MInference budget file (static top-k
 *  entries): for each head, v_size verticals and s_size token slashes,
 *  scaled by seq_len / budget_context and clamped to what fits, placed by a
 *  simple position model (30 sinks and the first 100 token diagonals first,
 *  the rest at seeded random positions), token diagonals converted to block
 *  diagonals as SPEC.md section 2 says. Heads beyond the file's are taken
 *  modulo its head count. Returns NULL (and prints why) on failure. */
mtrain_pattern_t *ts_pattern_from_budgets(const char *path, int32_t layer, int64_t seq_len,
                                          int32_t num_heads, int32_t granularity,
                                          int64_t budget_context, uint64_t seed);

/** Path of a file in the budget-data folder (static buffer). */
const char *ts_data_path(const char *file);

/* ---- the distributed ring tests (test_mpi_ring, test_nccl_ring, test_nccl_fault) ----
 * They start a ts_rng_t at the bare seed (ts_rng_t r = {seed}), not through
 * ts_rng_seed, and draw from it in a fixed order on every rank. */

/** x[i] = uniform in [-1, 1) for n values from rng; with bf16_exact the
 *  values are rounded to bf16 (still stored as fp32), so that a bf16 copy
 *  holds them exactly. */
void ts_ring_fill(float *x, int64_t n, ts_rng_t *rng, int bf16_exact);

/** The ring tests' patterns of N tokens, `heads` heads, block size G:
 *  kind 0 dense causal; 1 random sparse (each block diagonal with
 *  probability 0.3, each key a vertical with probability 0.05); 2 the main
 *  block diagonal only (most query blocks see no key in most ring steps);
 *  3 budget-like (block diagonals 0 and 1, the first 8 keys and 2% of the
 *  others as verticals); 4 mixed: even heads block masks (the diagonal block,
 *  the first key block and each other causal block with probability 0.3, as
 *  the block selections give), odd heads random sparse as kind 1; 5
 *  non-causal (mtrain_pattern_create_noncausal): every head a block mask of
 *  the diagonal, the first block and each block w.p. 0.3, above the diagonal
 *  too. Seeded (the same on every rank). NULL on failure. */
mtrain_pattern_t *ts_ring_pattern(int kind, int64_t N, int32_t heads, int32_t G, uint64_t seed);

/** Copies global row index[i] (of `width` floats) into local row i for the
 *  T slots of a rank; slots with index[i] >= N (padding) are left as they
 *  are. */
void ts_ring_gather(float *local, const float *global, const int64_t *index, int64_t T, int64_t N,
                    int64_t width);

/** Raises *err to max |local[i] - global[index[i]]| and *ref to max
 *  |global[index[i]]| over the slots that hold tokens (rows of `width`
 *  floats; padding skipped); NaN makes *err infinite. */
void ts_ring_compare(const float *local, const float *global, const int64_t *index, int64_t T,
                     int64_t N, int64_t width, double *err, double *ref);

/** The per-head budgets of the distributed-estimate cases (4 heads: top-k
 *  and top-p, small and large). */
void ts_ring_estimate_budgets(mtrain_head_budget_t budgets[4]);

/** 1 when a and b have the same block diagonals and verticals in every one
 *  of their first `heads` heads; else 0 and the first head that differs in
 *  *head. */
int ts_patterns_equal(const mtrain_pattern_t *a, const mtrain_pattern_t *b, int32_t heads,
                      int32_t *head);

/* ---- running the tools ---- */

/** Runs a shell command, returns its exit status (-1 when it did not exit)
 *  and its standard output in *out (malloc'ed, NUL-terminated; join stderr
 *  with 2>&1 in the command to get both). */
int ts_run_capture(const char *command, char **out);

/* ---- assertions ---- */
/** Fails the cmocka test unless `st` == `want` and the last error message
 *  contains `needle` (when not NULL); prints both on failure. */
#define TS_ASSERT_STATUS(st, want, needle)                                                         \
  ts_assert_status((st), (want), (needle), __FILE__, __LINE__)
void ts_assert_status(mtrain_status_t st, mtrain_status_t want, const char *needle,
                      const char *file, int line);

/** Seed for a test case, from MTRAIN_TEST_SEED or the given default. */
uint64_t ts_seed(uint64_t default_seed);

#endif /* MTRAIN_TEST_SUPPORT_H */
