/* cpu_math.h (private): small vectorisable math for the fast CPU path: an
 * exp(x) for x <= 0 accurate to about 2e-7 relative (range reduction to
 * [-0.5, 0.5] and a degree-7 Taylor polynomial of 2^f), returning exactly 0
 * for -inf and for x below about -87.3, written so that gcc vectorises loops
 * calling it; and the row reductions of the online softmax (max, and exp
 * with its sum) in MTRAIN_CPU_LANES independent lanes, so that they
 * vectorise too (a single running max or sum is a serial chain that gcc
 * keeps scalar in ISO C: it may not reorder a float sum). */
#ifndef MTRAIN_CPU_MATH_H
#define MTRAIN_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Runtime dispatch of the fast path's hot loops (the score tiles' softmax
 * and gradient loops). A portable build (MTRAIN_NATIVE OFF: the x86-64
 * baseline, SSE2, where rintf and so mtrain_fast_exp cannot vectorise) makes
 * one clone of each such function per x86-64 level, and the loader picks the
 * best the processor has (an ifunc). Not where the baseline already has AVX2
 * (-march=native builds), not under sanitizers (their runtimes and ifunc
 * resolvers do not mix), not on other architectures. MTRAIN_NO_CLONES turns
 * it off. The clones give the same bits: ISO C mode (-std=c11) contracts no
 * a * b + c into an FMA, and no loop reassociates a sum. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MTRAIN_CPU_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) ||                         \
    __has_feature(memory_sanitizer)
#define MTRAIN_CPU_SANITIZED 1
#endif
#endif
#if defined(__x86_64__) && defined(__linux__) && !defined(__AVX2__) &&                             \
    !defined(MTRAIN_CPU_SANITIZED) && !defined(MTRAIN_NO_CLONES)
#define MTRAIN_CPU_DISPATCH                                                                        \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "arch=x86-64-v2", "default")))
#else
#define MTRAIN_CPU_DISPATCH
#endif

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

/** Lanes of the row reductions: a fixed number, so that the order of the
 *  additions (and so the bits) does not depend on the vector width of the
 *  clone that runs them. */
#define MTRAIN_CPU_LANES 16

/** max of x[0 .. n), -INFINITY when n == 0 (no NaN expected). */
static inline float mtrain_row_max(const float *x, int32_t n) {
  float m[MTRAIN_CPU_LANES];
  for (int l = 0; l < MTRAIN_CPU_LANES; l++) m[l] = -INFINITY;
  int32_t c = 0;
  for (; c + MTRAIN_CPU_LANES <= n; c += MTRAIN_CPU_LANES)
    for (int l = 0; l < MTRAIN_CPU_LANES; l++) m[l] = x[c + l] > m[l] ? x[c + l] : m[l];
  for (int l = 0; c + l < n; l++) m[l] = x[c + l] > m[l] ? x[c + l] : m[l];
  for (int w = MTRAIN_CPU_LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) m[l] = m[l + w] > m[l] ? m[l + w] : m[l];
  return m[0];
}

/** x[c] = exp(x[c] - shift) for c in [0, n); returns the sum of the new
 *  values, added in lanes (column c into lane c % LANES) and the lanes then
 *  summed pairwise: a fixed order. */
static inline float mtrain_row_exp_sum(float *x, int32_t n, float shift) {
  float s[MTRAIN_CPU_LANES];
  for (int l = 0; l < MTRAIN_CPU_LANES; l++) s[l] = 0.0f;
  int32_t c = 0;
  for (; c + MTRAIN_CPU_LANES <= n; c += MTRAIN_CPU_LANES)
    for (int l = 0; l < MTRAIN_CPU_LANES; l++) {
      const float p = mtrain_fast_exp(x[c + l] - shift);
      x[c + l] = p;
      s[l] += p;
    }
  for (int l = 0; c + l < n; l++) {
    const float p = mtrain_fast_exp(x[c + l] - shift);
    x[c + l] = p;
    s[l] += p;
  }
  for (int w = MTRAIN_CPU_LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) s[l] += s[l + w];
  return s[0];
}

#endif /* MTRAIN_CPU_MATH_H */
