/* bench_report.h: mtrain-bench's results and their two forms, the table on
 * stdout and the JSON file (bench_report.c). */
#ifndef MTRAIN_BENCH_REPORT_H
#define MTRAIN_BENCH_REPORT_H

#include <stdint.h>

/** One timed ring (forward and backward): the slowest rank's medians. */
typedef struct bench_run {
  double fwd, bwd;             /**< seconds */
  double fwd_ratio, bwd_ratio; /**< ring time / summed step compute, worst rank */
} bench_run_t;

/** One row: a length and a layer; the dense ring of that length (measured
 *  once per length) repeated on each of its rows. */
typedef struct bench_row {
  int64_t tokens;
  int32_t layer; /**< the budget file's layer; -1: budgets from the command line */
  double sparsity, estimate_seconds;
  double inputs_seconds; /**< making the sparse ring's inputs, slowest rank */
  bench_run_t sparse;
  int has_dense; /**< 0: dense skipped at this length (--skip-dense-above) */
  bench_run_t dense;
} bench_row_t;

/** What every row shares. */
typedef struct bench_info {
  const char *backend, *dtype, *input, *sparse_layout, *schedule, *pattern_source;
  const char *topology;        /**< ring_env_topology: nodes x ranks and where from */
  int ranks_per_node;          /**< 0: flat ring */
  int ranks_per_node_detected; /**< 1: detected (ranks sharing memory), 0: --ranks-per-node */
  int world, cuda_variant;     /**< cuda_variant -1: not cuda */
  int32_t heads, kv_heads, head_dim, granularity, warmup, repeat;
} bench_info_t;

/** Prints the table (one line per row) on stdout. */
void bench_print_table(const bench_info_t *info, const bench_row_t *rows, int count);
/** Writes the results as one JSON object to `path`. Returns 0, or 1 with a
 *  message on stderr. */
int bench_write_json(const char *path, const bench_info_t *info, const bench_row_t *rows,
                     int count);

#endif /* MTRAIN_BENCH_REPORT_H */
