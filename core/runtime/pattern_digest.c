/* pattern_digest.c: mtrain_pattern_digest, a 128-bit digest of the content of
 * a list of patterns (shape, causality, every head's sets or block mask), so
 * that callers (the Python package's plan cache) find a live plan for the
 * same patterns without reading them back head by head. Not cryptographic:
 * two lanes of multiply-xorshift absorption, each finished by splitmix64. */
#include <stdint.h>
#include <string.h>

#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain.h"
#include "mtrain/mtrain_error.h"

typedef struct digest {
  uint64_t a, b;
} digest_t;

static uint64_t finish64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Absorbs one 64-bit word into both lanes (different constants and
 * rotations, so that the lanes fail independently). */
static void absorb(digest_t *d, uint64_t w) {
  d->a = (d->a ^ w) * 0x9E3779B97F4A7C15ull;
  d->a ^= d->a >> 29;
  d->b = (d->b + w) * 0xC2B2AE3D27D4EB4Full;
  d->b = (d->b << 31) | (d->b >> 33);
}

static void absorb_i32(digest_t *d, const int32_t *x, int64_t n) {
  int64_t i = 0;
  for (; i + 1 < n; i += 2)
    absorb(d, (uint64_t)(uint32_t)x[i] | ((uint64_t)(uint32_t)x[i + 1] << 32));
  if (i < n) absorb(d, (uint64_t)(uint32_t)x[i] | (0xFFFFFFFFull << 32));
}

static void absorb_i64(digest_t *d, const int64_t *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) absorb(d, (uint64_t)x[i]);
}

mtrain_status_t mtrain_pattern_digest(const mtrain_pattern_t *const *patterns, int32_t count,
                                      uint64_t digest[2]) {
  if (!digest)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: argument 'digest' is NULL", __func__);
  if (count < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: count %d is negative", __func__, count);
  if (count > 0 && !patterns)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: argument 'patterns' is NULL", __func__);
  for (int32_t i = 0; i < count; i++)
    if (!patterns[i])
      return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: patterns[%d] is NULL", __func__, i);
  digest_t d = {0x6D747261696E2D64ull /* "mtrain-d" */, (uint64_t)count};
  absorb(&d, (uint64_t)count);
  for (int32_t i = 0; i < count; i++) {
    const mtrain_pattern_t *p = patterns[i];
    absorb(&d, (uint64_t)p->seq_len);
    absorb(&d, (uint64_t)(uint32_t)p->num_heads | ((uint64_t)(uint32_t)p->granularity << 32));
    absorb(&d, (uint64_t)p->causal);
    for (int32_t h = 0; h < p->num_heads; h++) {
      const mtrain_pattern_head_t *hd = &p->heads[h];
      if (hd->mask_off) {
        /* block-mask form: the CSR rows (nb + 1 offsets) and their indices */
        absorb(&d, 0xB10C0000ull | 1u);
        absorb_i64(&d, hd->mask_off, p->num_blocks + 1);
        absorb_i32(&d, hd->mask_idx, hd->mask_off[p->num_blocks]);
      } else {
        absorb(&d, (uint64_t)(uint32_t)hd->num_diagonals |
                       ((uint64_t)(uint32_t)hd->num_verticals << 32));
        absorb_i32(&d, hd->diagonals, hd->num_diagonals);
        absorb_i64(&d, hd->verticals, hd->num_verticals);
      }
    }
  }
  digest[0] = finish64(d.a ^ finish64(d.b));
  digest[1] = finish64(d.b + 0x632BE59BD9B4E019ull);
  return MTRAIN_SUCCESS;
}
