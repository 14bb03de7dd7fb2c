/* exact_sum.c: exact, order-independent sums of doubles (exact_sum.h). A
 * finite value m 2^(e-53) (m a 53-bit integer) is added as the integer
 * m 2^(e + 1073) into 32-bit limbs held in uint64 words, normalised (carries
 * propagated) every 2^30 additions and before export, so no word overflows. */
#include <math.h>
#include <string.h>

#include "core/runtime/exact_sum.h"

#define M32 0xffffffffull
#define BIAS 1126 /* bit i weighs 2^(i - BIAS) */

static void normalize(uint64_t *limb) {
  uint64_t carry = 0;
  for (int i = 0; i < MTRAIN_XSUM_LIMBS; i++) {
    const uint64_t t = limb[i] + carry;
    limb[i] = t & M32;
    carry = t >> 32;
  }
}

void mtrain_xsum_add(mtrain_xsum_t *s, double v) {
  if (isnan(v)) {
    s->nan++;
    return;
  }
  if (isinf(v)) {
    if (v > 0)
      s->pinf++;
    else
      s->ninf++;
    return;
  }
  if (v == 0.0) return;
  int e = 0;
  const double f = frexp(fabs(v), &e); /* |v| = f 2^e, f in [0.5, 1) */
  const uint64_t m = (uint64_t)ldexp(f, 53);
  const int p = e - 53 + BIAS; /* >= 0: e >= -1073 */
  const int q = p / 32, sh = p % 32;
  uint64_t *limb = v > 0 ? s->pos : s->neg;
  const uint64_t x = (m & M32) << sh, y = (m >> 32) << sh;
  limb[q] += x & M32;
  limb[q + 1] += (x >> 32) + (y & M32);
  limb[q + 2] += y >> 32;
  if (++s->adds >= (1ull << 30)) {
    normalize(s->pos);
    normalize(s->neg);
    s->adds = 0;
  }
}

void mtrain_xsum_export(mtrain_xsum_t *s, double *words) {
  normalize(s->pos);
  normalize(s->neg);
  s->adds = 0;
  for (int i = 0; i < MTRAIN_XSUM_LIMBS; i++) {
    words[i] = (double)s->pos[i];
    words[MTRAIN_XSUM_LIMBS + i] = (double)s->neg[i];
  }
  words[2 * MTRAIN_XSUM_LIMBS] = (double)s->nan;
  words[2 * MTRAIN_XSUM_LIMBS + 1] = (double)s->pinf;
  words[2 * MTRAIN_XSUM_LIMBS + 2] = (double)s->ninf;
}

/* The normalised limbs' value: the top three nonzero-led limbs, top down. */
static double limbs_value(const double *words) {
  uint64_t limb[MTRAIN_XSUM_LIMBS];
  for (int i = 0; i < MTRAIN_XSUM_LIMBS; i++) limb[i] = (uint64_t)words[i];
  normalize(limb);
  int top = MTRAIN_XSUM_LIMBS - 1;
  while (top >= 0 && limb[top] == 0) top--;
  double v = 0.0;
  for (int i = top; i >= 0 && i > top - 3; i--) v += ldexp((double)limb[i], 32 * i - BIAS);
  return v;
}

double mtrain_xsum_value(const double *words) {
  const double nan_n = words[2 * MTRAIN_XSUM_LIMBS], pinf = words[2 * MTRAIN_XSUM_LIMBS + 1],
               ninf = words[2 * MTRAIN_XSUM_LIMBS + 2];
  if (nan_n > 0 || (pinf > 0 && ninf > 0)) return NAN;
  if (pinf > 0) return INFINITY;
  if (ninf > 0) return -INFINITY;
  return limbs_value(words) - limbs_value(words + MTRAIN_XSUM_LIMBS);
}
