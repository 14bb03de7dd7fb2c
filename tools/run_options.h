/* run_options.h: the command line of mtrain-run. */
#ifndef MTRAIN_RUN_OPTIONS_H
#define MTRAIN_RUN_OPTIONS_H

#include <stdint.h>

#include "mtrain/mtrain.h"

typedef struct run_options {
  const char *q_path, *k_path, *v_path, *do_path; /* inputs from .npy, or all NULL */
  int64_t seq_len;
  int32_t heads, kv_heads, head_dim, granularity, threads;
  int granularity_given; /* --granularity was on the command line */
  uint64_t seed;
  double input_scale; /* generated q, k and v are multiplied by it (default 1) */
  double timeout;     /* seconds of the communicators' waits (0: MTRAIN_COMM_TIMEOUT or 300) */
  const char *pattern_path; /* a fixed pattern file */
  /* online estimation (SPEC.md section 2): any of these selects it */
  int64_t v_size, s_size;   /* static top-k for every head (-1: not given) */
  double top_p;             /* top-p threshold for every head (0: not given) */
  int64_t top_p_cap;        /* its cap (default 4096) */
  const char *budgets_path; /* per-head budgets of --layer from a budget file */
  int32_t layer, last_q;
  int top_p_forced;  /* --top-p-forced: the sinks and the window forced into top-p budgets too */
  const char *input; /* generated inputs: "structured" or "normal" */
  /* several ranks (under mpiexec) */
  const char *layout;     /* contiguous|zigzag|striped|balanced (default striped) */
  int hierarchical;       /* --schedule hier */
  int32_t ranks_per_node; /* 0: not given (detected: the ranks that share memory) */
  const char *backend;    /* MTRAIN_BACKEND when set, else --backend */
  /* the --backend value (or default) that MTRAIN_BACKEND replaced; NULL when
   * it did not */
  const char *backend_overridden;
  int cuda_variant; /* --cuda-variant: -1 auto, 0, 1; RUN_CUDA_VARIANT_UNSET when not given */
  mtrain_dtype_t dtype;
  const char *out_dir;
  int check, json, forward_only, repeat;
  unsigned char given[128]; /* given[c]: the option of getopt value c was on the command line */
} run_options_t;

/** run_options_t.cuda_variant when --cuda-variant was not given (the
 *  backend's default: MTRAIN_CUDA_VARIANT or auto). */
#define RUN_CUDA_VARIANT_UNSET (-2)

/** 1 when the options ask for online estimation. */
static inline int run_options_estimate(const run_options_t *o) {
  return o->v_size >= 0 || o->s_size >= 0 || o->top_p > 0 || o->budgets_path != NULL;
}

/** Parses argv. Returns 0 on success, 1 on a bad command line (message
 *  printed), 2 when --help was asked (usage printed). MTRAIN_BACKEND, when
 *  set, replaces --backend here, and is then removed from the environment:
 *  it picks the backend under test, and must not reach the contexts the
 *  tools create for themselves (the cpu-ref reference of --check). */
int run_options_parse(int argc, char **argv, run_options_t *opt);

/** Warnings on stderr (when `verbose`: rank 0 of a ring prints for all) for
 *  options that have no effect: generator options with input files, --seed
 *  with --do, --do with --forward-only, --last-q without an estimate,
 *  --top-p-cap without --top-p and, when `single_rank` (no ring), --layout,
 *  --schedule and --timeout; and a note when MTRAIN_BACKEND replaced
 *  --backend. */
void run_options_warn(const char *prog, const run_options_t *opt, int single_rank, int verbose);

/** With --pattern: reads the pattern file's granularity. Without
 *  --granularity the run takes it (opt->granularity); with --granularity
 *  the two must agree. Returns 0, or 1 with a message starting with `prog`
 *  (printed only when `verbose`: rank 0 of a ring prints for all). */
int run_options_resolve_pattern(const char *prog, run_options_t *opt, int verbose);

#endif /* MTRAIN_RUN_OPTIONS_H */
