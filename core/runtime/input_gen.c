/* input_gen.c: reproducible inputs (mtrain_inputs.h): structured q, k, v
 * with vertical-slash attention, seeded normal noise, and random patterns of
 * a given density. All randomness is counter-based (a splitmix64 hash of
 * seed, stream and element index), so the results are bitwise the same at
 * any thread count and in any storage dtype (values are made in fp64 and
 * rounded once by mtrain_convert). A token's values depend only on its
 * position, so mtrain_generate_structured_rows makes any subset of the
 * tokens (one rank's slots of a layout) in O(rows) work plus an O(N) pass
 * over one uniform per key for the outlier positions.
 *
 * The structured generator, per kv head hk (query head h reads hk = h / g):
 * the RoPE pairs (2m, 2m+1), frequency theta_m = base^(-2m/d), are split into
 * bands: "sharp" (theta_m >= 1/8: dephase within a few tokens), "window"
 * (theta_m in [1/W, 8/W), W a per-head width in [64, 512] tokens) and "low"
 * (the lowest max(1, d/64) pairs, nearly unrotated over the sequence when
 * theta_min * N << 1). Unit vectors u_s, u_w, u_l live in those bands (random
 * phase per pair). Before RoPE, an ordinary key is M * unit(u_w + u_s) + noise,
 * with M = mean_strength * sigma * sqrt(d) and noise N(0, sigma^2) per
 * element; an outlier key (the first num_sinks keys and num_outliers seeded
 * positions) is outlier_strength * |ordinary key| * u_l + noise; a query of
 * head h is gain_h * M * (w_h u_w + s_h u_s + f_h R(-P_h) u_s + rho_h u_l) +
 * noise with per-head weights. Then q_i and k_j are rotated by RoPE at their
 * positions, so the mean-mean logit depends only on i - j: a local window of
 * about W tokens (u_w), a sharp peak at distance 0 (u_s) and, for about half
 * of the query heads, a slash at distance P_h in [16, 512] (the query's sharp
 * component pre-rotated by -P_h); outlier keys meet every query's rho_h u_l
 * component: verticals. sigma^2 = 2 / sqrt(d) fixes the temperature: with
 * the default strengths the mean-mean logits are a few units. The low band
 * stays coherent only while theta_min * N is small (about N < base / 2);
 * longer sequences need a larger rope_base (long-context models use 1e6). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_inputs.h"

#define TWO_PI 6.283185307179586476925286766559
#define GOLDEN 0x9E3779B97F4A7C15ull

/* Random streams (one per use, so changing one use never shifts another). */
enum {
  STREAM_Q = 1,
  STREAM_K = 2,
  STREAM_V = 3,
  STREAM_KV_HEAD = 4,
  STREAM_Q_HEAD = 5,
  STREAM_OUTLIERS = 6,
  STREAM_NORMAL = 7,
  STREAM_RANDOM_LIKE = 8,
};

/* Parameters drawn per head: indices into the head's stream. */
enum { KV_WIDTH = 0, KV_PHASES = 16 };
enum { QH_GAIN = 0, QH_RHO, QH_WINDOW, QH_SHARP, QH_HAS_SLASH, QH_SLASH, QH_DISTANCE };

/* Temperature: sigma^2 = GEN_TEMPERATURE / sqrt(d). */
#define GEN_TEMPERATURE 2.0
#define GEN_SHARP_THETA 0.125
#define GEN_WINDOW_SPAN 8.0

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* The key of one random stream (seed, stream, sub-stream). */
static uint64_t stream_key(uint64_t seed, uint64_t stream, uint64_t sub) {
  return mix64(mix64(seed + GOLDEN) ^ mix64(stream * 0xD1B54A32D192ED03ull + sub * GOLDEN + 1));
}

/* Uniform in (0, 1) at counter idx of a stream. */
static double uniform_at(uint64_t key, uint64_t idx) {
  return ((double)(mix64(key + (idx + 1) * GOLDEN) >> 11) + 0.5) * 0x1.0p-53;
}

/* Standard normals at counters first .. first+count-1: Box-Muller on the
 * uniforms 2p and 2p+1 gives element 2p (cosine) and 2p+1 (sine). */
static void normals_at(uint64_t key, uint64_t first, int64_t count, double *out) {
  for (int64_t e = 0; e < count;) {
    const uint64_t idx = first + (uint64_t)e, p = idx >> 1;
    const double r = sqrt(-2.0 * log(uniform_at(key, 2 * p)));
    const double a = TWO_PI * uniform_at(key, 2 * p + 1);
    if (idx & 1) {
      out[e++] = r * sin(a);
    } else {
      out[e++] = r * cos(a);
      if (e < count) out[e++] = r * sin(a);
    }
  }
}

static double uniform_range(uint64_t key, uint64_t idx, double lo, double hi) {
  return lo + (hi - lo) * uniform_at(key, idx);
}

/* Marks `count` distinct positions of [lo, hi) in flags (selection sampling:
 * sorted, one uniform per position, O(hi - lo)). */
static void pick_positions(uint64_t key, int64_t lo, int64_t hi, int64_t count, uint8_t *flags) {
  int64_t need = count;
  for (int64_t j = lo; j < hi && need > 0; j++) {
    const int64_t left = hi - j;
    if ((double)left * uniform_at(key, (uint64_t)j) < (double)need) {
      flags[j] = 1;
      need--;
    }
  }
}

/* ---- argument checks ---- */

static mtrain_status_t check_tensor(const mtrain_tensor_t *t, const char *name, int32_t ndim,
                                    const char *fn) {
  if (!t) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: argument '%s' is NULL", fn, name);
  if (mtrain_dtype_size(t->dtype) == 0)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "%s: %s has an unknown dtype %d", fn, name,
                        (int)t->dtype);
  if (ndim > 0 && t->ndim != ndim)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "%s: %s must have %d dimensions, has %d", fn,
                        name, ndim, t->ndim);
  if (t->ndim < 1 || t->ndim > MTRAIN_MAX_DIMS)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "%s: %s has %d dimensions (1 to %d allowed)", fn,
                        name, t->ndim, MTRAIN_MAX_DIMS);
  for (int32_t i = 0; i < t->ndim; i++)
    if (t->shape[i] < (ndim > 0 ? 1 : 0))
      return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "%s: %s has extent %lld in dimension %d", fn,
                          name, (long long)t->shape[i], i);
  if (!t->data && mtrain_tensor_numel(t) > 0)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: %s->data is NULL", fn, name);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t check_structured(const char *fn, const mtrain_structured_options_t *o,
                                        const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                        const mtrain_tensor_t *v) {
  if (!o) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: argument 'options' is NULL", fn);
  mtrain_status_t st = check_tensor(q, "q", 3, fn);
  if (!st) st = check_tensor(k, "k", 3, fn);
  if (!st) st = check_tensor(v, "v", 3, fn);
  if (st) return st;
  if (k->shape[0] != q->shape[0] || v->shape[0] != q->shape[0])
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "%s: token counts differ: q has %lld, k %lld, v %lld", fn,
                        (long long)q->shape[0], (long long)k->shape[0], (long long)v->shape[0]);
  if (k->shape[2] != q->shape[2] || v->shape[2] != q->shape[2])
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "%s: head dimensions differ: q has %lld, k %lld, v %lld", fn,
                        (long long)q->shape[2], (long long)k->shape[2], (long long)v->shape[2]);
  if (v->shape[1] != k->shape[1])
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH, "%s: v has %lld heads, k has %lld", fn,
                        (long long)v->shape[1], (long long)k->shape[1]);
  if (q->shape[1] % k->shape[1] != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                        "%s: %lld query heads are not a multiple of %lld kv heads", fn,
                        (long long)q->shape[1], (long long)k->shape[1]);
  if (q->shape[1] > INT32_MAX || q->shape[2] > INT32_MAX)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "%s: q shape [%lld, %lld, %lld] too large", fn,
                        (long long)q->shape[0], (long long)q->shape[1], (long long)q->shape[2]);
  if (!(o->rope_base > 1.0) || !isfinite(o->rope_base))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: rope_base must be finite and > 1, got %g",
                        fn, o->rope_base);
  if (!(o->mean_strength >= 0.0) || !isfinite(o->mean_strength))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "%s: mean_strength must be finite and >= 0, got %g", fn, o->mean_strength);
  if (!(o->outlier_strength >= 0.0) || !isfinite(o->outlier_strength))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "%s: outlier_strength must be finite and >= 0, got %g", fn,
                        o->outlier_strength);
  if (o->num_sinks < 0 || o->num_outliers < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "%s: num_sinks (%d) and num_outliers (%d) must be >= 0", fn, o->num_sinks,
                        o->num_outliers);
  return MTRAIN_SUCCESS;
}

/* ---- the structured generator ---- */

typedef struct gen_shape {
  int64_t n;
  int32_t hq, hkv, d, pairs;
} gen_shape_t;

/* Writes the unit vector of a band (pairs with band[m] == which, phase per
 * pair) into u; all zero when the band is empty. */
static void band_vector(const gen_shape_t *s, const uint8_t *band, int which, const double *phase,
                        double *u) {
  memset(u, 0, sizeof(double) * (size_t)s->d);
  int32_t count = 0;
  for (int32_t m = 0; m < s->pairs; m++)
    if (band[m] == which) count++;
  if (!count) return;
  const double a = 1.0 / sqrt((double)count);
  for (int32_t m = 0; m < s->pairs; m++)
    if (band[m] == which) {
      u[2 * m] = a * cos(phase[m]);
      u[2 * m + 1] = a * sin(phase[m]);
    }
}

/* The RoPE rotation at position pos: pair m turns by pos * theta_m. */
static void rope_angles(const gen_shape_t *s, const double *theta, double pos, double *cs,
                        double *sn) {
  for (int32_t m = 0; m < s->pairs; m++) {
    cs[m] = cos(pos * theta[m]);
    sn[m] = sin(pos * theta[m]);
  }
}

/* Rotates the pairs (2m, 2m+1) of x; an odd last element stays as it is. */
static void rope_rotate(const gen_shape_t *s, const double *cs, const double *sn, double *x) {
  for (int32_t m = 0; m < s->pairs; m++) {
    const double x0 = x[2 * m], x1 = x[2 * m + 1];
    x[2 * m] = x0 * cs[m] - x1 * sn[m];
    x[2 * m + 1] = x0 * sn[m] + x1 * cs[m];
  }
}

/* Mean vectors: kmean/omean [hkv][d] (ordinary and outlier keys), qmean
 * [hq][d]; outlier flags [hkv][n]. */
static void make_means(const mtrain_structured_options_t *o, const gen_shape_t *s,
                       const double *theta, double sigma, double *kmean, double *omean,
                       double *qmean, uint8_t *outlier, uint8_t *band, double *phase, double *us,
                       double *uw, double *ul, double *tmp, double *cs, double *sn) {
  const int32_t d = s->d, group = s->hq / s->hkv, nlow = s->pairs / 32 > 1 ? s->pairs / 32 : 1;
  const double M = o->mean_strength * sigma * sqrt((double)d);
  const double key_norm = sigma * sqrt((double)d) * sqrt(o->mean_strength * o->mean_strength + 1);
  const int64_t sinks = o->num_sinks < s->n ? o->num_sinks : s->n;
  const int64_t room = s->n - sinks;
  const int64_t extra = o->num_outliers < room ? o->num_outliers : room;
  for (int32_t hk = 0; hk < s->hkv; hk++) {
    const uint64_t key = stream_key(o->seed, STREAM_KV_HEAD, (uint64_t)hk);
    const double width = exp(uniform_range(key, KV_WIDTH, log(64.0), log(512.0)));
    for (int32_t m = 0; m < s->pairs; m++) {
      phase[m] = TWO_PI * uniform_at(key, KV_PHASES + (uint64_t)m);
      if (m >= s->pairs - nlow)
        band[m] = 3; /* low */
      else if (theta[m] >= GEN_SHARP_THETA)
        band[m] = 1; /* sharp */
      else if (theta[m] >= 1.0 / width && theta[m] < GEN_WINDOW_SPAN / width)
        band[m] = 2; /* window */
      else
        band[m] = 0; /* noise only */
    }
    band_vector(s, band, 1, phase, us);
    band_vector(s, band, 2, phase, uw);
    band_vector(s, band, 3, phase, ul);
    double *km = kmean + (int64_t)hk * d, *om = omean + (int64_t)hk * d;
    double norm = 0.0;
    for (int32_t c = 0; c < d; c++) norm += (us[c] + uw[c]) * (us[c] + uw[c]);
    norm = norm > 0 ? M / sqrt(norm) : 0.0;
    for (int32_t c = 0; c < d; c++) {
      km[c] = norm * (us[c] + uw[c]);
      om[c] = o->outlier_strength * key_norm * ul[c];
    }
    uint8_t *flags = outlier + (int64_t)hk * s->n;
    memset(flags, 0, (size_t)s->n);
    memset(flags, 1, (size_t)sinks);
    pick_positions(stream_key(o->seed, STREAM_OUTLIERS, (uint64_t)hk), sinks, s->n, extra, flags);
    for (int32_t h = hk * group; h < (hk + 1) * group; h++) {
      const uint64_t qk = stream_key(o->seed, STREAM_Q_HEAD, (uint64_t)h);
      const double gain = uniform_range(qk, QH_GAIN, 0.75, 1.25) * M;
      const double rho = uniform_range(qk, QH_RHO, 0.09, 0.16);
      const double ww = uniform_range(qk, QH_WINDOW, 0.35, 0.65);
      const double ws = uniform_range(qk, QH_SHARP, 0.3, 0.5);
      const double wf =
          uniform_at(qk, QH_HAS_SLASH) < 0.5 ? uniform_range(qk, QH_SLASH, 0.3, 0.6) : 0.0;
      const double dist = exp(uniform_range(qk, QH_DISTANCE, log(16.0), log(512.0)));
      memcpy(tmp, us, sizeof(double) * (size_t)d);
      rope_angles(s, theta, -dist, cs, sn);
      rope_rotate(s, cs, sn, tmp); /* the slash: the sharp part looking back dist tokens */
      double *qm = qmean + (int64_t)h * d;
      for (int32_t c = 0; c < d; c++)
        qm[c] = gain * (ww * uw[c] + ws * us[c] + wf * tmp[c] + rho * ul[c]);
    }
  }
}

/* Per-thread scratch of the token loop. */
typedef struct gen_rows {
  double *q, *k, *v, *cs, *sn;
} gen_rows_t;

static void make_token(const mtrain_structured_options_t *o, const gen_shape_t *s,
                       const double *theta, double sigma, const double *kmean, const double *omean,
                       const double *qmean, const uint8_t *outlier, int64_t i, gen_rows_t *r) {
  const int32_t d = s->d;
  const uint64_t kq = stream_key(o->seed, STREAM_Q, 0), kk = stream_key(o->seed, STREAM_K, 0);
  const uint64_t kv = stream_key(o->seed, STREAM_V, 0);
  rope_angles(s, theta, (double)i, r->cs, r->sn);
  for (int32_t h = 0; h < s->hq; h++) {
    double *x = r->q + (int64_t)h * d;
    normals_at(kq, (uint64_t)((i * s->hq + h) * d), d, x);
    for (int32_t c = 0; c < d; c++) x[c] = qmean[(int64_t)h * d + c] + sigma * x[c];
    rope_rotate(s, r->cs, r->sn, x);
  }
  for (int32_t hk = 0; hk < s->hkv; hk++) {
    double *x = r->k + (int64_t)hk * d, *y = r->v + (int64_t)hk * d;
    const double *mean = (outlier[(int64_t)hk * s->n + i] ? omean : kmean) + (int64_t)hk * d;
    normals_at(kk, (uint64_t)((i * s->hkv + hk) * d), d, x);
    normals_at(kv, (uint64_t)((i * s->hkv + hk) * d), d, y);
    for (int32_t c = 0; c < d; c++) x[c] = mean[c] + sigma * x[c];
    rope_rotate(s, r->cs, r->sn, x);
  }
}

static void store_row(const double *row, mtrain_tensor_t *t, int64_t i, int64_t width) {
  const size_t es = mtrain_dtype_size(t->dtype);
  (void)mtrain_convert(row, MTRAIN_F64, (char *)t->data + (size_t)(i * width) * es, t->dtype,
                       width);
}

/* Writes a zero row (a layout padding slot). */
static void zero_row(mtrain_tensor_t *t, int64_t r, int64_t width) {
  const size_t es = mtrain_dtype_size(t->dtype);
  memset((char *)t->data + (size_t)(r * width) * es, 0, (size_t)width * es);
}

/* Checks the rows' token indices: none negative; with no index, the rows
 * must fit in the sequence. */
static mtrain_status_t check_rows(const char *fn, int64_t seq_len, const int64_t *index,
                                  int64_t rows) {
  if (seq_len < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: seq_len must be >= 1, got %lld", fn,
                        (long long)seq_len);
  if (!index && rows > seq_len)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "%s: %lld rows without an index exceed seq_len %lld", fn, (long long)rows,
                        (long long)seq_len);
  for (int64_t r = 0; index && r < rows; r++)
    if (index[r] < 0)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: index[%lld] = %lld is negative", fn,
                          (long long)r, (long long)index[r]);
  return MTRAIN_SUCCESS;
}

/* The generator behind both entry points: row r of q, k, v is token
 * index[r] (r when index is NULL) of a sequence of s.n tokens. */
static mtrain_status_t generate_rows(const mtrain_structured_options_t *options,
                                     const gen_shape_t *shape, const int64_t *index, int64_t rows,
                                     mtrain_tensor_t *q, mtrain_tensor_t *k, mtrain_tensor_t *v) {
  const gen_shape_t s = *shape;
  const int32_t d = s.d;
  const double sigma = sqrt(GEN_TEMPERATURE / sqrt((double)d));
  mtrain_status_t st = MTRAIN_SUCCESS;
  double *theta = malloc(sizeof(double) * (size_t)(s.pairs + 1));
  double *work = malloc(sizeof(double) * (size_t)d * (size_t)(2 * s.hkv + s.hq + 4) +
                        sizeof(double) * (size_t)(3 * s.pairs + 3));
  uint8_t *band = malloc((size_t)s.pairs + 1);
  uint8_t *outlier = malloc((size_t)(s.n * s.hkv));
  if (!theta || !work || !band || !outlier) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "mtrain_generate_structured: out of memory");
    goto cleanup;
  }
  for (int32_t m = 0; m < s.pairs; m++) theta[m] = pow(options->rope_base, -2.0 * m / d);
  double *kmean = work, *omean = kmean + (int64_t)s.hkv * d, *qmean = omean + (int64_t)s.hkv * d;
  double *us = qmean + (int64_t)s.hq * d, *uw = us + d, *ul = uw + d, *tmp = ul + d;
  double *phase = tmp + d, *cs = phase + s.pairs + 1, *sn = cs + s.pairs + 1;
  make_means(options, &s, theta, sigma, kmean, omean, qmean, outlier, band, phase, us, uw, ul, tmp,
             cs, sn);
  int failed = 0;
#pragma omp parallel
  {
    gen_rows_t r = {NULL, NULL, NULL, NULL, NULL};
    r.q = malloc(sizeof(double) * ((size_t)d * (size_t)(s.hq + 2 * s.hkv) + 2 * (size_t)s.pairs));
    if (!r.q) {
#pragma omp atomic write
      failed = 1;
    } else {
      r.k = r.q + (int64_t)s.hq * d;
      r.v = r.k + (int64_t)s.hkv * d;
      r.cs = r.v + (int64_t)s.hkv * d;
      r.sn = r.cs + s.pairs;
    }
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
      if (!r.q) continue;
      const int64_t i = index ? index[row] : row;
      if (i >= s.n) {
        zero_row(q, row, (int64_t)s.hq * d);
        zero_row(k, row, (int64_t)s.hkv * d);
        zero_row(v, row, (int64_t)s.hkv * d);
        continue;
      }
      make_token(options, &s, theta, sigma, kmean, omean, qmean, outlier, i, &r);
      store_row(r.q, q, row, (int64_t)s.hq * d);
      store_row(r.k, k, row, (int64_t)s.hkv * d);
      store_row(r.v, v, row, (int64_t)s.hkv * d);
    }
    free(r.q);
  }
  if (failed)
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "mtrain_generate_structured: out of memory");
cleanup:
  free(theta);
  free(work);
  free(band);
  free(outlier);
  return st;
}

mtrain_status_t mtrain_generate_structured(const mtrain_structured_options_t *options,
                                           mtrain_tensor_t *q, mtrain_tensor_t *k,
                                           mtrain_tensor_t *v) {
  mtrain_status_t st = check_structured("mtrain_generate_structured", options, q, k, v);
  if (st) return st;
  const gen_shape_t s = {q->shape[0], (int32_t)q->shape[1], (int32_t)k->shape[1],
                         (int32_t)q->shape[2], (int32_t)q->shape[2] / 2};
  return generate_rows(options, &s, NULL, s.n, q, k, v);
}

mtrain_status_t mtrain_generate_structured_rows(const mtrain_structured_options_t *options,
                                                int64_t seq_len, const int64_t *index,
                                                mtrain_tensor_t *q, mtrain_tensor_t *k,
                                                mtrain_tensor_t *v) {
  static const char fn[] = "mtrain_generate_structured_rows";
  mtrain_status_t st = check_structured(fn, options, q, k, v);
  if (!st) st = check_rows(fn, seq_len, index, q->shape[0]);
  if (st) return st;
  const gen_shape_t s = {seq_len, (int32_t)q->shape[1], (int32_t)k->shape[1], (int32_t)q->shape[2],
                         (int32_t)q->shape[2] / 2};
  return generate_rows(options, &s, index, q->shape[0], q, k, v);
}

/* ---- normal noise ---- */

#define NORMAL_CHUNK 1024

mtrain_status_t mtrain_generate_normal(uint64_t seed, double stddev, mtrain_tensor_t *t) {
  static const char fn[] = "mtrain_generate_normal";
  mtrain_status_t st = check_tensor(t, "t", 0, fn);
  if (st) return st;
  if (!(stddev >= 0.0) || !isfinite(stddev))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: stddev must be finite and >= 0, got %g",
                        fn, stddev);
  const int64_t count = mtrain_tensor_numel(t);
  const int64_t chunks = (count + NORMAL_CHUNK - 1) / NORMAL_CHUNK;
  const uint64_t key = stream_key(seed, STREAM_NORMAL, 0);
  const size_t es = mtrain_dtype_size(t->dtype);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; c++) {
    double buf[NORMAL_CHUNK];
    const int64_t first = c * NORMAL_CHUNK;
    const int64_t len = count - first < NORMAL_CHUNK ? count - first : NORMAL_CHUNK;
    normals_at(key, (uint64_t)first, len, buf);
    for (int64_t e = 0; e < len; e++) buf[e] *= stddev;
    (void)mtrain_convert(buf, MTRAIN_F64, (char *)t->data + (size_t)first * es, t->dtype, len);
  }
  return MTRAIN_SUCCESS;
}

/* ---- random patterns of a given density ---- */

/* gains[t], t = 1..nb-1: the pairs block diagonal t adds to a head whose
 * key block kb holds vcount[kb] verticals (its bars in those blocks are
 * replaced by the blocks). Diagonals cover disjoint blocks, so the pair
 * count of a head is its count without diagonals plus the gains of its
 * diagonals. For t >= 1 the key blocks are full; only the last query block
 * may be short. */
static void diagonal_gains(int64_t n, int64_t g, int64_t nb, const int64_t *vcount,
                           int64_t *gains) {
  const int64_t last_rows = n - (nb - 1) * g;
  int64_t prefix = 0; /* sum over kb < nb - t of (g - vcount[kb]), built from t = nb-1 down */
  for (int64_t t = nb - 1; t >= 1; t--) {
    prefix += g - vcount[nb - 1 - t];
    gains[t] = g * prefix - (g - last_rows) * (g - vcount[nb - 1 - t]);
  }
}

static int64_t abs_i64(int64_t x) { return x < 0 ? -x : x; }

/* Sorts diagonal indices by gain, then index (a bottom-up merge sort:
 * qsort's comparator could not see the gains without shared state). */
static void sort_by_gain(int32_t *idx, int64_t count, const int64_t *gains, int32_t *tmp) {
  for (int64_t width = 1; width < count; width *= 2) {
    for (int64_t lo = 0; lo < count; lo += 2 * width) {
      const int64_t mid = lo + width < count ? lo + width : count;
      const int64_t hi = lo + 2 * width < count ? lo + 2 * width : count;
      int64_t a = lo, b = mid, o = lo;
      while (a < mid || b < hi) {
        const int take_a =
            b >= hi || (a < mid && (gains[idx[a]] < gains[idx[b]] ||
                                    (gains[idx[a]] == gains[idx[b]] && idx[a] < idx[b])));
        tmp[o++] = take_a ? idx[a++] : idx[b++];
      }
    }
    memcpy(idx, tmp, sizeof *idx * (size_t)count);
  }
}

/* Scratch of random_like, sized for one head. */
typedef struct rl_scratch {
  uint8_t *flags;  /* [n]: picked verticals, then chosen diagonals */
  int64_t *verts;  /* [n] */
  int64_t *vcount; /* [nb] */
  int64_t *gains;  /* [nb] */
  int32_t *order;  /* [nb] */
  int32_t *sorted; /* [nb] */
  int32_t *tmp;    /* [nb] */
} rl_scratch_t;

/* The unchosen diagonal (in sorted order) whose gain is nearest to want;
 * 0 when every diagonal is chosen. */
static int32_t nearest_unchosen(const rl_scratch_t *w, int64_t count, int64_t want) {
  int64_t lo = 0, hi = count;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (w->gains[w->sorted[mid]] < want)
      lo = mid + 1;
    else
      hi = mid;
  }
  int32_t best = 0;
  for (int64_t e = lo; e < count; e++)
    if (!w->flags[w->sorted[e]]) {
      best = w->sorted[e];
      break;
    }
  for (int64_t e = lo - 1; e >= 0; e--)
    if (!w->flags[w->sorted[e]]) {
      if (!best || abs_i64(w->gains[w->sorted[e]] - want) <= abs_i64(w->gains[best] - want))
        best = w->sorted[e];
      break;
    }
  return best;
}

/* Head h of out: nv random verticals, then block diagonals in a random order
 * while they fit under target, then single additions, removals or swaps
 * while they bring the pair count closer to target. */
static mtrain_status_t random_head(mtrain_pattern_t *out, int32_t h, int64_t target, int32_t nv,
                                   uint64_t seed, rl_scratch_t *w) {
  const int64_t n = mtrain_pattern_seq_len(out), nb = mtrain_pattern_num_blocks(out);
  const int64_t g = mtrain_pattern_granularity(out), nd_max = nb - 1;
  const uint64_t key = stream_key(seed, STREAM_RANDOM_LIKE, (uint64_t)h);
  memset(w->flags, 0, (size_t)n);
  pick_positions(key, 0, n, nv, w->flags);
  memset(w->vcount, 0, sizeof(int64_t) * (size_t)nb);
  int32_t v = 0;
  for (int64_t j = 0; j < n; j++)
    if (w->flags[j]) {
      w->verts[v++] = j;
      w->vcount[j / g]++;
    }
  mtrain_status_t st = mtrain_pattern_set_head(out, h, NULL, 0, w->verts, v);
  if (st) return st;
  int64_t cur = mtrain_pattern_count_pairs(out, h);
  diagonal_gains(n, g, nb, w->vcount, w->gains);
  memset(w->flags, 0, (size_t)nb); /* now: diagonal t chosen */
  /* a random order of the diagonals 1..nb-1 (Fisher-Yates on its own stream) */
  const uint64_t okey = stream_key(seed, STREAM_RANDOM_LIKE, (uint64_t)h + 0x100000000ull);
  for (int64_t t = 1; t < nb; t++) w->order[t - 1] = w->sorted[t - 1] = (int32_t)t;
  for (int64_t e = nd_max - 1; e > 0; e--) {
    const int64_t r = (int64_t)(uniform_at(okey, (uint64_t)e) * (double)(e + 1));
    const int32_t x = w->order[e];
    w->order[e] = w->order[r];
    w->order[r] = x;
  }
  for (int64_t e = 0; e < nd_max; e++)
    if (cur + w->gains[w->order[e]] <= target) {
      cur += w->gains[w->order[e]];
      w->flags[w->order[e]] = 1;
    }
  /* local moves: c leaves (0: none), u enters (0: none) */
  sort_by_gain(w->sorted, nd_max, w->gains, w->tmp);
  for (int round = 0; round < 64; round++) {
    int32_t best_c = 0, best_u = 0;
    int64_t best = abs_i64(cur - target);
    for (int64_t t = 0; t < nb; t++) {
      if (t > 0 && !w->flags[t]) continue;
      const int64_t base = cur - (t > 0 ? w->gains[t] : 0);
      if (t > 0 && abs_i64(base - target) < best) {
        best = abs_i64(base - target);
        best_c = (int32_t)t;
        best_u = 0;
      }
      const int32_t u = nearest_unchosen(w, nd_max, target - base);
      if (u && abs_i64(base + w->gains[u] - target) < best) {
        best = abs_i64(base + w->gains[u] - target);
        best_c = (int32_t)t;
        best_u = u;
      }
    }
    if (!best_c && !best_u) break;
    if (best_c) {
      w->flags[best_c] = 0;
      cur -= w->gains[best_c];
    }
    if (best_u) {
      w->flags[best_u] = 1;
      cur += w->gains[best_u];
    }
  }
  int32_t nd = 0;
  for (int64_t t = 1; t < nb; t++)
    if (w->flags[t]) w->order[nd++] = (int32_t)t;
  st = mtrain_pattern_set_head(out, h, w->order, nd, w->verts, v);
  if (st) return st;
  if (mtrain_pattern_count_pairs(out, h) != cur)
    return mtrain_error(MTRAIN_ERR_INTERNAL,
                        "mtrain_pattern_random_like: head %d pair count %lld, expected %lld", h,
                        (long long)mtrain_pattern_count_pairs(out, h), (long long)cur);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_pattern_random_like(const mtrain_pattern_t *like, uint64_t seed,
                                           mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(like);
  MTRAIN_CHECK_NOT_NULL(out);
  const int64_t n = mtrain_pattern_seq_len(like), nb = mtrain_pattern_num_blocks(like);
  const int32_t heads = mtrain_pattern_num_heads(like);
  mtrain_pattern_t *p = NULL;
  rl_scratch_t w;
  w.flags = malloc((size_t)n);
  w.verts = malloc(sizeof(int64_t) * (size_t)n);
  w.vcount = malloc(sizeof(int64_t) * (size_t)nb);
  w.gains = malloc(sizeof(int64_t) * (size_t)nb);
  w.order = malloc(sizeof(int32_t) * (size_t)nb);
  w.sorted = malloc(sizeof(int32_t) * (size_t)nb);
  w.tmp = malloc(sizeof(int32_t) * (size_t)nb);
  mtrain_status_t st = MTRAIN_SUCCESS;
  MTRAIN_FAIL_IF(!w.flags || !w.verts || !w.vcount || !w.gains || !w.order || !w.sorted || !w.tmp,
                 MTRAIN_ERR_OUT_OF_MEMORY, "mtrain_pattern_random_like: out of memory");
  MTRAIN_TRY(mtrain_pattern_create(n, heads, mtrain_pattern_granularity(like), &p));
  for (int32_t h = 0; h < heads; h++) {
    int32_t nv = 0;
    MTRAIN_TRY(mtrain_pattern_get_head(like, h, NULL, NULL, NULL, &nv));
    MTRAIN_TRY(random_head(p, h, mtrain_pattern_count_pairs(like, h), nv, seed, &w));
  }
  *out = p;
  p = NULL;
cleanup:
  mtrain_pattern_destroy(p);
  free(w.flags);
  free(w.verts);
  free(w.vcount);
  free(w.gains);
  free(w.order);
  free(w.sorted);
  free(w.tmp);
  return st;
}
