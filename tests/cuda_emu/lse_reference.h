// lse_reference.h: the fp64 log-sum-exp of one query row of dense attention
// (causal: keys 0..i; non-causal: every key), the LSE the block-score
// emulator tests give the precise search so that its masses are exact shares.
#ifndef MTRAIN_TESTS_CUDA_EMU_LSE_REFERENCE_H
#define MTRAIN_TESTS_CUDA_EMU_LSE_REFERENCE_H

#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

// q [N, Hq, d] and k [N, Hkv, d] as doubles (or floats); row i of query head h
// (GQA: kv head h / (Hq / Hkv)), logits scale * q . k.
template <typename TQ, typename TK>
static double lse_reference(const TQ *q, const TK *k, int64_t N, int Hq, int Hkv, int d,
                            double scale, int64_t i, int h, bool noncausal) {
  const int hk = h / (Hq / Hkv);
  const int64_t jend = noncausal ? N : i + 1;
  std::vector<double> lg((size_t)jend);
  double m = -INFINITY, z = 0.0;
  for (int64_t j = 0; j < jend; j++) {
    double dot = 0.0;
    for (int x = 0; x < d; x++)
      dot += (double)q[(size_t)((i * Hq + h) * d + x)] * k[(size_t)((j * Hkv + hk) * d + x)];
    lg[(size_t)j] = scale * dot;
    m = std::max(m, lg[(size_t)j]);
  }
  for (int64_t j = 0; j < jend; j++) z += exp(lg[(size_t)j] - m);
  return m + log(z);
}

#endif // MTRAIN_TESTS_CUDA_EMU_LSE_REFERENCE_H
