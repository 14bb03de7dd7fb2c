/* run_options.h: the command line of mtrain-run. */
#ifndef MTRAIN_RUN_OPTIONS_H
#define MTRAIN_RUN_OPTIONS_H

#include <stdint.h>

#include "mtrain/mtrain.h"

typedef struct run_options {
  const char *q_path, *k_path, *v_path, *do_path; /* inputs from .npy, or all NULL */
  int64_t seq_len;
  int32_t heads, kv_heads, head_dim, granularity, threads;
  uint64_t seed;
  const char *pattern_path; /* NULL: dense causal */
  const char *backend;
  mtrain_dtype_t dtype;
  const char *out_dir;
  int check, json, forward_only, repeat;
} run_options_t;

/** Parses argv. Returns 0 on success, 1 on a bad command line (message
 *  printed), 2 when --help was asked (usage printed). */
int run_options_parse(int argc, char **argv, run_options_t *opt);

#endif /* MTRAIN_RUN_OPTIONS_H */
