/* exact_sum.h (private): exact, order-independent sums of doubles. A sum is
 * kept as integer limbs over the whole double range (and counts of NaN and
 * infinities), so adding the same values in any order, on any number of
 * ranks, gives the same state; the ranks' states combine by an fp64 sum
 * all-reduce of their exported words (integer values below 2^53, exact in
 * any order for fewer than 2^21 ranks). The head-adaptive budgets of block
 * selection (SPEC.md section 9.5) use it so that their gain curves do not
 * depend on which rank holds which query block. */
#ifndef MTRAIN_CORE_EXACT_SUM_H
#define MTRAIN_CORE_EXACT_SUM_H

#include <stdint.h>

/** 32-bit limbs: bit i of the integer weighs 2^(i - 1126), which covers the
 *  least subnormal (2^-1074 = 2^52 units) to beyond DBL_MAX with headroom. */
#define MTRAIN_XSUM_LIMBS 70
/** Words of an exported sum: positive limbs, negative limbs, NaN, +inf, -inf. */
#define MTRAIN_XSUM_WORDS (2 * MTRAIN_XSUM_LIMBS + 3)

/** A local accumulator; zero-initialise it (memset or {0}). */
typedef struct mtrain_xsum {
  uint64_t pos[MTRAIN_XSUM_LIMBS], neg[MTRAIN_XSUM_LIMBS];
  uint64_t nan, pinf, ninf, adds;
} mtrain_xsum_t;

/** Adds v exactly. */
void mtrain_xsum_add(mtrain_xsum_t *s, double v);

/** Writes the state as MTRAIN_XSUM_WORDS doubles (integers below 2^32),
 *  ready for an fp64 sum all-reduce with other ranks' words. */
void mtrain_xsum_export(mtrain_xsum_t *s, double *words);

/** The double of the summed words of one or more ranks: a deterministic
 *  function of the exact sum (the positive and the negative terms' sums,
 *  each from its top three 32-bit limbs added top down, within one unit in
 *  the last place; then their difference); NaN if a NaN or both infinities
 *  were added, else +-inf if an infinity was added. */
double mtrain_xsum_value(const double *words);

#endif /* MTRAIN_CORE_EXACT_SUM_H */
