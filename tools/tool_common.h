/* tool_common.h: small helpers shared by the command-line tools: a
 * monotonic clock, reporting a failed mtrain call, effective FLOP counts. */
#ifndef MTRAIN_TOOL_COMMON_H
#define MTRAIN_TOOL_COMMON_H

#include <stdio.h>
#include <time.h>

#include "mtrain/mtrain.h"

/** Seconds on a monotonic clock. */
static inline double tool_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/** Prints "prog: what: STATUS_NAME: message" to stderr and returns 1 when st
 *  is an error; returns 0 otherwise. */
static inline int tool_failed(const char *prog, const char *what, mtrain_status_t st) {
  if (st == MTRAIN_SUCCESS) return 0;
  fprintf(stderr, "%s: %s: %s: %s\n", prog, what, mtrain_status_name(st), mtrain_last_error());
  return 1;
}

/** Effective forward FLOPs of SPEC.md section 6: 4 * d per computed pair. */
static inline double tool_fwd_flops(long long pairs, int head_dim) {
  return 4.0 * (double)head_dim * (double)pairs;
}

#endif /* MTRAIN_TOOL_COMMON_H */
