/* dtype.c: storage data types, their names and sizes, and host-side
 * conversions between fp64, fp32, bf16 and fp16 (round to nearest even,
 * NaN preserved as a quiet NaN, overflow to Inf). */
#include <math.h>
#include <string.h>
#include <strings.h>

#include "mtrain/mtrain_error.h"

size_t mtrain_dtype_size(mtrain_dtype_t dtype) {
  switch (dtype) {
  case MTRAIN_F32:
    return 4;
  case MTRAIN_BF16:
  case MTRAIN_F16:
    return 2;
  case MTRAIN_F64:
    return 8;
  }
  return 0;
}

const char *mtrain_dtype_name(mtrain_dtype_t dtype) {
  switch (dtype) {
  case MTRAIN_F32:
    return "fp32";
  case MTRAIN_BF16:
    return "bf16";
  case MTRAIN_F16:
    return "fp16";
  case MTRAIN_F64:
    return "fp64";
  }
  return "unknown";
}

mtrain_status_t mtrain_dtype_parse(const char *name, mtrain_dtype_t *out) {
  MTRAIN_CHECK_NOT_NULL(name);
  MTRAIN_CHECK_NOT_NULL(out);
  static const struct {
    const char *name;
    mtrain_dtype_t dtype;
  } names[] = {{"fp32", MTRAIN_F32},  {"f32", MTRAIN_F32},       {"float32", MTRAIN_F32},
               {"bf16", MTRAIN_BF16}, {"bfloat16", MTRAIN_BF16}, {"fp16", MTRAIN_F16},
               {"f16", MTRAIN_F16},   {"float16", MTRAIN_F16},   {"half", MTRAIN_F16},
               {"fp64", MTRAIN_F64},  {"f64", MTRAIN_F64},       {"float64", MTRAIN_F64}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcasecmp(name, names[i].name) == 0) {
      *out = names[i].dtype;
      return MTRAIN_SUCCESS;
    }
  return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                      "unknown dtype '%s' (expected fp32, bf16, fp16 or fp64)", name);
}

static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

float mtrain_bf16_to_float(uint16_t x) { return bits_float((uint32_t)x << 16); }

uint16_t mtrain_float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float mtrain_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    float f = ldexpf((float)man, -24);
    return sign ? -f : f;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t mtrain_float_to_half(float x) {
  uint32_t u = float_bits(x);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow (incl. Inf) */
  if (a < 0x38800000u) {                                   /* subnormal or zero half */
    float f = bits_float(a);
    /* value / 2^-24, rounded to nearest even by the FPU */
    float scaled = f * 16777216.0f;
    uint32_t m = (uint32_t)nearbyintf(scaled);
    return (uint16_t)(sign | m);
  }
  uint32_t mant_round = a + 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | ((mant_round - 0x38000000u) >> 13));
}

/* Reads element i of a buffer of any dtype as double. */
static double load_as_double(const void *src, mtrain_dtype_t dtype, int64_t i) {
  switch (dtype) {
  case MTRAIN_F32:
    return ((const float *)src)[i];
  case MTRAIN_F64:
    return ((const double *)src)[i];
  case MTRAIN_BF16:
    return mtrain_bf16_to_float(((const uint16_t *)src)[i]);
  case MTRAIN_F16:
    return mtrain_half_to_float(((const uint16_t *)src)[i]);
  }
  return 0.0;
}

static void store_from_double(void *dst, mtrain_dtype_t dtype, int64_t i, double x) {
  switch (dtype) {
  case MTRAIN_F32:
    ((float *)dst)[i] = (float)x;
    break;
  case MTRAIN_F64:
    ((double *)dst)[i] = x;
    break;
  case MTRAIN_BF16: /* double -> float -> bf16 rounds twice only for values
                       exactly between; inputs here are fp32-representable */
    ((uint16_t *)dst)[i] = mtrain_float_to_bf16((float)x);
    break;
  case MTRAIN_F16:
    ((uint16_t *)dst)[i] = mtrain_float_to_half((float)x);
    break;
  }
}

mtrain_status_t mtrain_convert(const void *src, mtrain_dtype_t src_dtype, void *dst,
                               mtrain_dtype_t dst_dtype, int64_t count) {
  if (count < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "mtrain_convert: negative count %lld",
                        (long long)count);
  if (count == 0) return MTRAIN_SUCCESS;
  MTRAIN_CHECK_NOT_NULL(src);
  MTRAIN_CHECK_NOT_NULL(dst);
  if (mtrain_dtype_size(src_dtype) == 0 || mtrain_dtype_size(dst_dtype) == 0)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "mtrain_convert: unknown dtype %d -> %d",
                        (int)src_dtype, (int)dst_dtype);
  if (src_dtype == dst_dtype) {
    memcpy(dst, src, (size_t)count * mtrain_dtype_size(src_dtype));
    return MTRAIN_SUCCESS;
  }
  if (src_dtype == MTRAIN_F32 && dst_dtype == MTRAIN_BF16) {
    const float *s = src;
    uint16_t *d = dst;
    for (int64_t i = 0; i < count; i++) d[i] = mtrain_float_to_bf16(s[i]);
    return MTRAIN_SUCCESS;
  }
  if (src_dtype == MTRAIN_BF16 && dst_dtype == MTRAIN_F32) {
    const uint16_t *s = src;
    float *d = dst;
    for (int64_t i = 0; i < count; i++) d[i] = mtrain_bf16_to_float(s[i]);
    return MTRAIN_SUCCESS;
  }
  for (int64_t i = 0; i < count; i++)
    store_from_double(dst, dst_dtype, i, load_as_double(src, src_dtype, i));
  return MTRAIN_SUCCESS;
}
