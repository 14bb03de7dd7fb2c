/* cpu_math.h (private): small vectorisable math for the fast CPU path: an
 * exp(x) for x <= 0 accurate to about 2e-7 relative (range reduction to
 * [-0.5, 0.5] and a degree-7 Taylor polynomial of 2^f), returning exactly 0
 * for -inf and for x below about -87.3, written so that gcc vectorises loops
 * calling it. */
#ifndef MTRAIN_CPU_MATH_H
#define MTRAIN_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float mtrain_fast_exp(float x) {
  float t = x * 1.44269504088896341f;
  t = t < -127.0f ? -127.0f : t;
  t = t > 127.0f ? 127.0f : t;
  const float k = rintf(t);
  const float f = t - k; /* [-0.5, 0.5] */
  float p = 1.5252733804059841e-05f;
  p = p * f + 1.5403530393381610e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  const int32_t e = (int32_t)k + 127; /* 0 when k = -127: the result is 0 */
  const uint32_t bits = (uint32_t)e << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return scale * p;
}

#endif /* MTRAIN_CPU_MATH_H */
