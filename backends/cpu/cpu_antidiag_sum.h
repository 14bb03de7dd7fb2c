/* cpu_antidiag_sum.h (private): the row state of the antidiagonal scores
 * (SPEC.md 9.2 and 9.6): the row maximum, and the normaliser Z = the sum of
 * exp(X - max) over the row's defined columns as an exact fixed-point sum.
 * Every term lies in [0, 1] (X <= max) and is cut to a multiple of 2^-128
 * (an error below 2^-128 a term, against Z >= 1); the cut terms add as
 * integers, exactly and so in any order: the normaliser has the same bits
 * whichever key chunks, in whichever order, brought the columns. */
#ifndef MTRAIN_CPU_ANTIDIAG_SUM_H
#define MTRAIN_CPU_ANTIDIAG_SUM_H

#include <math.h>
#include <stdint.h>

#include "mtrain/mtrain_backend.h"

/** An empty state: no column seen. */
static inline void cpu_adrow_init(mtrain_antidiag_row_t *r) {
  r->max = -INFINITY;
  r->z[0] = r->z[1] = r->z[2] = 0;
  r->nan = 0;
}

/** Folds a column's X into the maximum (NaN never becomes the maximum). */
static inline void cpu_adrow_max(mtrain_antidiag_row_t *r, double x) {
  if (x > r->max) r->max = x;
}

/** Adds a term e = exp(X - max), in [0, 1] or NaN, to the normaliser. */
static inline void cpu_adrow_add(mtrain_antidiag_row_t *r, double e) {
  if (e != e) {
    r->nan = 1;
    return;
  }
  const double two64 = 18446744073709551616.0;
  const uint64_t w2 = e >= 1.0 ? 1u : 0u;    /* e <= 1: the integer part */
  const double f = (e - (double)w2) * two64; /* exact, below 2^64 */
  const double f1 = floor(f);                /* bits 2^-1 .. 2^-64 */
  const uint64_t w1 = (uint64_t)f1, w0 = (uint64_t)floor((f - f1) * two64); /* .. 2^-128 */
  const uint64_t s0 = r->z[0] + w0, c0 = s0 < w0;
  const uint64_t s1a = r->z[1] + w1, c1a = s1a < w1;
  const uint64_t s1 = s1a + c0, c1 = c1a + (s1 < c0);
  r->z[0] = s0;
  r->z[1] = s1;
  r->z[2] += w2 + c1;
}

/** The normaliser as a double: a fixed function of the exact sum (within
 *  about one unit in the last place for Z >= 1); NaN after a NaN term. */
static inline double cpu_adrow_z(const mtrain_antidiag_row_t *r) {
  if (r->nan) return NAN;
  const double two_m64 = 5.421010862427522170037264e-20; /* 2^-64 */
  return (double)r->z[2] + ((double)r->z[1] + (double)r->z[0] * two_m64) * two_m64;
}

#endif /* MTRAIN_CPU_ANTIDIAG_SUM_H */
