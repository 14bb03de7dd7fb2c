/* tool_common.h: small helpers shared by the command-line tools: a
 * monotonic clock, reporting a failed mtrain call, medians, effective FLOP
 * counts. */
#ifndef MTRAIN_TOOL_COMMON_H
#define MTRAIN_TOOL_COMMON_H

#include <stdio.h>
#include <stdlib.h>
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

static inline int tool_cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/** Median of the n > 0 values of v (sorts v). */
static inline double tool_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, tool_cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/** Effective forward FLOPs of SPEC.md section 6: 4 * d per computed pair. */
static inline double tool_fwd_flops(long long pairs, int head_dim) {
  return 4.0 * (double)head_dim * (double)pairs;
}

#endif /* MTRAIN_TOOL_COMMON_H */
