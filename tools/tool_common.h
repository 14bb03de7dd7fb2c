/* tool_common.h: small helpers shared by the command-line tools: a
 * monotonic clock, reporting a failed mtrain call, medians, effective FLOP
 * counts, and the correctness tolerance of the tools' checks and its floor
 * (defined here once). */
#ifndef MTRAIN_TOOL_COMMON_H
#define MTRAIN_TOOL_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/** The relative bound of every tool's correctness check (docs/USAGE.md,
 *  "The correctness bound"): an output computed with storage type `dtype`
 *  passes when max|out - ref| <= tool_check_tolerance(dtype) * max|ref|,
 *  ref being the fp64 reference (cpu-ref) on the same rounded inputs.
 *  fp32 (and fp64): SPEC.md's 1e-4; bf16 and fp16: 4 unit roundoffs of the
 *  storage type, u = 2^-8 (bf16, 8 significand bits) and u = 2^-11 (fp16,
 *  11 significand bits). */
static inline double tool_check_tolerance(mtrain_dtype_t dtype) {
  switch (dtype) {
  case MTRAIN_BF16:
    return 4 * 0x1p-8;
  case MTRAIN_F16:
    return 4 * 0x1p-11;
  default:
    return 1e-4;
  }
}

/** The unit roundoff of the accumulator of backend `name`: 2^-53 for
 *  cpu-ref (fp64 throughout), 2^-24 for cpu and cuda (fp32 accumulation). */
static inline double tool_accumulator_unit_roundoff(const char *name) {
  return name && strcmp(name, "cpu-ref") == 0 ? 0x1p-53 : 0x1p-24;
}

/** The absolute floor of the check's bound for dQ (kq_max = max |k|) and dK
 *  (kq_max = max |q|) (docs/SPEC.md section 7, docs/USAGE.md): 8 * u_acc * S
 *  with S = scale * max ||dout|| * max ||v|| * kq_max, the norms L2 over
 *  head_dim, maxima over rows and heads, kq_max the largest |element|. By
 *  Cauchy-Schwarz |dP| and |delta| are at most max ||dout|| * max ||v||;
 *  dS = P (dP - delta) cancels when the softmax saturates, leaving the
 *  rounding of dP - delta, a few u_acc of that size, which dQ = scale dS K
 *  (dK = scale dS^T Q) carries, element by element, times k's (q's)
 *  elements, with the weights of P. The bound is max(tol(dtype) * max|ref|,
 *  floor): unchanged wherever the floor is below the relative term. */
static inline double tool_check_floor(double u_acc, double scale, double dout_norm, double v_norm,
                                      double kq_max) {
  return 8.0 * u_acc * scale * dout_norm * v_norm * kq_max;
}

/** The same bound between two computations that each satisfy
 *  tool_check_tolerance against the exact result (for example the cuda
 *  backend against the cpu backend, neither of them the fp64 reference):
 *  twice it, by the triangle inequality. */
static inline double tool_check_tolerance_between(mtrain_dtype_t dtype) {
  return 2 * tool_check_tolerance(dtype);
}

#endif /* MTRAIN_TOOL_COMMON_H */
