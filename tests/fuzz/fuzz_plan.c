/* fuzz_plan.c: libFuzzer target: a small random pattern (a causal
 * vertical-slash head, or a non-causal block mask) and block layout from the
 * bytes; the step builder's plan over all ranks and steps must compute every
 * allowed pair exactly once. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint8_t take(const uint8_t **d, size_t *n) {
  if (*n == 0) return 0;
  (*n)--;
  return *(*d)++;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const int32_t G = 1 + take(&data, &size) % 8, W = 1 + take(&data, &size) % 5;
  const int64_t N = 1 + (take(&data, &size) | (take(&data, &size) << 8)) % 200;
  const int64_t nb = (N + G - 1) / G, nbp = (nb + W - 1) / W * W;
  const int causal = !(take(&data, &size) & 1);
  mtrain_pattern_t *p = NULL;
  int32_t *d = malloc(sizeof(int32_t) * (size_t)nb);
  int64_t *v = malloc(sizeof(int64_t) * (size_t)N);
  if (causal) {
    if (mtrain_pattern_create(N, 1, G, &p) != MTRAIN_SUCCESS) abort();
    int32_t nd = 0, nv = 0;
    for (int64_t t = 0; t < nb; t++)
      if (take(&data, &size) & 1) d[nd++] = (int32_t)t;
    for (int64_t j = 0; j < N; j++)
      if ((take(&data, &size) & 7) == 0) v[nv++] = j;
    if (mtrain_pattern_set_head(p, 0, d, nd, v, nv) != MTRAIN_SUCCESS) abort();
  } else {
    if (mtrain_pattern_create_noncausal(N, 1, G, &p) != MTRAIN_SUCCESS) abort();
    uint8_t *mask = malloc((size_t)(nb * nb));
    for (int64_t x = 0; x < nb * nb; x++) mask[x] = take(&data, &size) & 1;
    if (mtrain_pattern_set_block_mask(p, 0, mask) != MTRAIN_SUCCESS) abort();
    free(mask);
  }
  /* blocks dealt by the bytes: block b to rank byte % W, each rank's list increasing */
  int64_t **glob = calloc((size_t)W, sizeof *glob);
  mtrain_rank_blocks_t *rb = calloc((size_t)W, sizeof *rb);
  int32_t *count = calloc((size_t)W, sizeof *count);
  for (int32_t r = 0; r < W; r++) glob[r] = malloc(sizeof(int64_t) * (size_t)nbp);
  for (int64_t b = 0; b < nbp; b++) {
    const int32_t r = take(&data, &size) % W;
    glob[r][count[r]++] = b;
  }
  int64_t max_blocks = 0;
  for (int32_t r = 0; r < W; r++) max_blocks = count[r] > max_blocks ? count[r] : max_blocks;
  for (int32_t r = 0; r < W; r++) {
    rb[r].num_blocks = count[r];
    rb[r].global = glob[r];
    rb[r].tokens = (int64_t)count[r] * G;
  }
  uint8_t *seen = calloc((size_t)(N * N), 1);
  for (int32_t r = 0; r < W; r++)
    for (int32_t s = 0; s < W; s++) {
      mtrain_step_head_store_t st;
      if (mtrain_plan_build_step_head(p, 0, &rb[r], &rb[s], &st) != MTRAIN_SUCCESS) abort();
      for (int32_t qb = 0; qb < rb[r].num_blocks; qb++) {
        const int64_t gq = rb[r].global[qb];
        const int32_t nr = mtrain_block_rows(rb[r].tokens, G, qb, gq, N);
        for (int32_t row = 0; row < nr; row++) {
          const int64_t i = gq * G + row;
          for (int32_t e = st.run_off[qb]; e < st.run_off[qb + 1]; e++)
            for (int32_t kb = st.runs[2 * e]; kb < st.runs[2 * e + 1]; kb++) {
              const int64_t gk = rb[s].global[kb];
              const int32_t nc = mtrain_block_rows(rb[s].tokens, G, kb, gk, N);
              for (int32_t c = 0; c < nc && !(causal && gk == gq && gk * G + c > i); c++)
                if (++seen[i * N + gk * G + c] > 1) abort();
            }
          for (int32_t sg = st.seg_off[qb]; sg < st.seg_off[qb + 1]; sg++)
            for (int32_t b = st.segs[2 * sg]; b < st.segs[2 * sg + 1]; b++) {
              const int64_t j = rb[s].global[st.bars[b] / G] * G + st.bars[b] % G;
              if (++seen[i * N + j] > 1) abort();
            }
        }
      }
      mtrain_step_head_store_free(&st);
    }
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < N; j++)
      if (seen[i * N + j] != mtrain_pattern_allowed(p, 0, i, j)) abort();
  (void)max_blocks;
  free(seen);
  for (int32_t r = 0; r < W; r++) free(glob[r]);
  free(glob), free(rb), free(count), free(d), free(v);
  mtrain_pattern_destroy(p);
  return 0;
}
