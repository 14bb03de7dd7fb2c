/* test_support.c: shared test helpers (see test_support.h). */
#define _POSIX_C_SOURCE 200809L /* popen */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "test_support.h"

void ts_rng_seed(ts_rng_t *rng, uint64_t seed) { rng->state = seed ^ 0x9E3779B97F4A7C15ull; }

uint64_t ts_rng_u64(ts_rng_t *rng) {
  uint64_t z = (rng->state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double ts_rng_uniform(ts_rng_t *rng) { return (double)(ts_rng_u64(rng) >> 11) * 0x1.0p-53; }

double ts_rng_normal(ts_rng_t *rng) {
  double u1 = ts_rng_uniform(rng), u2 = ts_rng_uniform(rng);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

int64_t ts_rng_below(ts_rng_t *rng, int64_t n) { return (int64_t)(ts_rng_u64(rng) % (uint64_t)n); }

ts_buf_t ts_buf_alloc(size_t bytes) {
  ts_buf_t b = {0};
  b.base = malloc(bytes + 2 * TS_GUARD_BYTES);
  assert_non_null(b.base);
  memset(b.base, TS_GUARD_VALUE, bytes + 2 * TS_GUARD_BYTES);
  b.data = b.base + TS_GUARD_BYTES;
  b.bytes = bytes;
  return b;
}

void ts_buf_free(ts_buf_t *b) {
  free(b->base);
  memset(b, 0, sizeof *b);
}

int ts_buf_guards_ok(const ts_buf_t *b) {
  for (size_t i = 0; i < TS_GUARD_BYTES; i++)
    if (b->base[i] != TS_GUARD_VALUE || b->base[TS_GUARD_BYTES + b->bytes + i] != TS_GUARD_VALUE)
      return 0;
  return 1;
}

void ts_fill_normal(ts_rng_t *rng, void *data, mtrain_dtype_t dtype, int64_t count, double scale,
                    double *as_double) {
  for (int64_t i = 0; i < count; i++) {
    double x = ts_rng_normal(rng) * scale;
    assert_int_equal(
        mtrain_convert(&x, MTRAIN_F64, (char *)data + i * mtrain_dtype_size(dtype), dtype, 1),
        MTRAIN_SUCCESS);
  }
  if (as_double)
    assert_int_equal(mtrain_convert(data, dtype, as_double, MTRAIN_F64, count), MTRAIN_SUCCESS);
}

double *ts_to_double(const void *data, mtrain_dtype_t dtype, int64_t count) {
  double *out = malloc(sizeof(double) * (size_t)(count > 0 ? count : 1));
  assert_non_null(out);
  assert_int_equal(mtrain_convert(data, dtype, out, MTRAIN_F64, count), MTRAIN_SUCCESS);
  return out;
}

double ts_max_abs_diff(const double *a, const double *b, int64_t count) {
  double m = 0.0;
  for (int64_t i = 0; i < count; i++) {
    double d = fabs(a[i] - b[i]);
    if (isnan(d)) return INFINITY;
    if (d > m) m = d;
  }
  return m;
}

double ts_max_abs(const double *a, int64_t count) {
  double m = 0.0;
  for (int64_t i = 0; i < count; i++)
    if (fabs(a[i]) > m) m = fabs(a[i]);
  return m;
}

int ts_has_nonfinite(const double *a, int64_t count) {
  for (int64_t i = 0; i < count; i++)
    if (!isfinite(a[i])) return 1;
  return 0;
}

const char *ts_pattern_kind_name(ts_pattern_kind_t kind) {
  switch (kind) {
  case TS_PATTERN_DENSE:
    return "dense";
  case TS_PATTERN_DIAGONAL_ONLY:
    return "diagonal-only";
  case TS_PATTERN_RANDOM_SPARSE:
    return "random-sparse";
  case TS_PATTERN_BLOCK_MASK:
    return "block-mask";
  case TS_PATTERN_BUDGETS:
    return "qwen-budgets";
  case TS_PATTERN_NONCAUSAL:
    return "non-causal";
  case TS_PATTERN_SINK_MASK:
    return "sink-mask";
  }
  return "?";
}

const char *ts_data_path(const char *file) {
  static char path[1024];
  snprintf(path, sizeof path, "%s/%s", MTRAIN_PATTERN_DATA_DIR, file);
  return path;
}

/* Sorted unique int64 values: in-place sort + dedupe, returns new count. */
static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static int32_t sort_unique_i64(int64_t *v, int32_t n) {
  qsort(v, (size_t)n, sizeof *v, cmp_i64);
  int32_t m = 0;
  for (int32_t i = 0; i < n; i++)
    if (m == 0 || v[m - 1] != v[i]) v[m++] = v[i];
  return m;
}

/* Sets head h from token verticals and token slashes (SPEC.md section 2's
 * token-diagonal to block-diagonal conversion). */
static void set_head_from_tokens(mtrain_pattern_t *p, int32_t h, int64_t *verts, int32_t nv,
                                 const int64_t *slashes, int32_t ns) {
  const int32_t G = mtrain_pattern_granularity(p);
  const int64_t nb = mtrain_pattern_num_blocks(p);
  int64_t *blk = malloc(sizeof(int64_t) * (size_t)(2 * ns + 1));
  int32_t nd = 0;
  blk[nd++] = 0;
  for (int32_t i = 0; i < ns; i++) {
    int64_t a = slashes[i] / G, b = slashes[i] % G;
    if (a < nb) blk[nd++] = a;
    if (b > 0 && a + 1 < nb) blk[nd++] = a + 1;
  }
  nd = sort_unique_i64(blk, nd);
  int32_t *d32 = malloc(sizeof(int32_t) * (size_t)nd);
  for (int32_t i = 0; i < nd; i++) d32[i] = (int32_t)blk[i];
  nv = sort_unique_i64(verts, nv);
  assert_int_equal(mtrain_pattern_set_head(p, h, d32, nd, verts, nv), MTRAIN_SUCCESS);
  free(blk);
  free(d32);
}

/* v_size verticals and s_size slashes for one head, by the position model. */
static void head_from_budget(mtrain_pattern_t *p, int32_t h, int64_t v_size, int64_t s_size,
                             ts_rng_t *rng) {
  const int64_t N = mtrain_pattern_seq_len(p);
  if (v_size > N) v_size = N;
  if (s_size > N) s_size = N;
  if (v_size < 1) v_size = 1;
  if (s_size < 1) s_size = 1;
  int64_t *verts = malloc(sizeof(int64_t) * (size_t)v_size);
  int64_t *slashes = malloc(sizeof(int64_t) * (size_t)s_size);
  for (int64_t i = 0; i < v_size; i++) verts[i] = i < 30 ? i : ts_rng_below(rng, N);
  for (int64_t i = 0; i < s_size; i++) slashes[i] = i < 100 ? i : ts_rng_below(rng, N);
  set_head_from_tokens(p, h, verts, (int32_t)v_size, slashes, (int32_t)s_size);
  free(verts);
  free(slashes);
}

mtrain_pattern_t *ts_pattern_from_budgets(const char *path, int32_t layer, int64_t seq_len,
                                          int32_t num_heads, int32_t granularity,
                                          int64_t budget_context, uint64_t seed) {
  json_error_t jerr;
  json_t *root = json_load_file(path, 0, &jerr);
  if (!root) {
    fprintf(stderr, "cannot read budgets %s: %s (line %d)\n", path, jerr.text, jerr.line);
    return NULL;
  }
  json_t *entry_layer = json_array_get(root, (size_t)layer);
  if (!entry_layer || !json_is_object(entry_layer) || json_object_size(entry_layer) == 0) {
    fprintf(stderr, "budgets %s: no layer %d\n", path, layer);
    json_decref(root);
    return NULL;
  }
  int32_t file_heads = (int32_t)json_object_size(entry_layer);
  mtrain_pattern_t *p = NULL;
  assert_int_equal(mtrain_pattern_create(seq_len, num_heads, granularity, &p), MTRAIN_SUCCESS);
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  for (int32_t h = 0; h < num_heads; h++) {
    char key[16];
    snprintf(key, sizeof key, "%d", h % file_heads);
    json_t *e = json_object_get(entry_layer, key);
    if (!e || !json_is_array(e) || !json_is_integer(json_array_get(e, 1)) ||
        !json_is_integer(json_array_get(e, 2))) {
      fprintf(stderr, "budgets %s: layer %d head %s is not a static top-k entry\n", path, layer,
              key);
      mtrain_pattern_destroy(p);
      json_decref(root);
      return NULL;
    }
    double f = (double)seq_len / (double)budget_context;
    int64_t v = (int64_t)llround((double)json_integer_value(json_array_get(e, 1)) * f);
    int64_t s = (int64_t)llround((double)json_integer_value(json_array_get(e, 2)) * f);
    head_from_budget(p, h, v, s, &rng);
  }
  json_decref(root);
  return p;
}

mtrain_pattern_t *ts_make_pattern(ts_pattern_kind_t kind, int64_t seq_len, int32_t num_heads,
                                  int32_t granularity, uint64_t seed) {
  mtrain_pattern_t *p = NULL;
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  const int64_t nb = (seq_len + granularity - 1) / granularity;
  switch (kind) {
  case TS_PATTERN_DENSE:
    assert_int_equal(mtrain_pattern_create_dense(seq_len, num_heads, granularity, &p),
                     MTRAIN_SUCCESS);
    return p;
  case TS_PATTERN_DIAGONAL_ONLY:
    assert_int_equal(mtrain_pattern_create(seq_len, num_heads, granularity, &p), MTRAIN_SUCCESS);
    return p;
  case TS_PATTERN_RANDOM_SPARSE: {
    assert_int_equal(mtrain_pattern_create(seq_len, num_heads, granularity, &p), MTRAIN_SUCCESS);
    for (int32_t h = 0; h < num_heads; h++) {
      int32_t nd = 0, nv = 0;
      int32_t *d = malloc(sizeof(int32_t) * (size_t)(nb + 1));
      int64_t *v = malloc(sizeof(int64_t) * (size_t)(seq_len + 1));
      double pd = ts_rng_uniform(&rng) * 0.5, pv = ts_rng_uniform(&rng) * 0.1;
      for (int64_t t = 0; t < nb; t++)
        if (t == 0 || ts_rng_uniform(&rng) < pd) d[nd++] = (int32_t)t;
      for (int64_t j = 0; j < seq_len; j++)
        if (ts_rng_uniform(&rng) < pv) v[nv++] = j;
      assert_int_equal(mtrain_pattern_set_head(p, h, d, nd, v, nv), MTRAIN_SUCCESS);
      free(d);
      free(v);
    }
    return p;
  }
  case TS_PATTERN_BLOCK_MASK: {
    assert_int_equal(mtrain_pattern_create(seq_len, num_heads, granularity, &p), MTRAIN_SUCCESS);
    uint8_t *mask = calloc((size_t)(nb * nb), 1);
    for (int32_t h = 0; h < num_heads; h++) {
      double density = ts_rng_uniform(&rng);
      for (int64_t qb = 0; qb < nb; qb++)
        for (int64_t kb = 0; kb < nb; kb++)
          mask[qb * nb + kb] = kb <= qb && ts_rng_uniform(&rng) < density;
      assert_int_equal(mtrain_pattern_set_block_mask(p, h, mask), MTRAIN_SUCCESS);
    }
    free(mask);
    return p;
  }
  case TS_PATTERN_SINK_MASK: {
    /* per head a density in [0, 0.3), key block 0 in every query block: the
     * long key-major items that the CUDA backward splits */
    assert_int_equal(mtrain_pattern_create(seq_len, num_heads, granularity, &p), MTRAIN_SUCCESS);
    uint8_t *mask = calloc((size_t)(nb * nb), 1);
    assert_non_null(mask);
    for (int32_t h = 0; h < num_heads; h++) {
      double density = 0.3 * ts_rng_uniform(&rng);
      for (int64_t qb = 0; qb < nb; qb++)
        for (int64_t kb = 0; kb < nb; kb++)
          mask[qb * nb + kb] = kb <= qb && (kb == 0 || ts_rng_uniform(&rng) < density);
      assert_int_equal(mtrain_pattern_set_block_mask(p, h, mask), MTRAIN_SUCCESS);
    }
    free(mask);
    return p;
  }
  case TS_PATTERN_NONCAUSAL: {
    /* per head a density in [0, 1), each (query block, key block) pair w.p.
     * that density, above the diagonal too; the diagonal block is added by
     * the pattern */
    assert_int_equal(mtrain_pattern_create_noncausal(seq_len, num_heads, granularity, &p),
                     MTRAIN_SUCCESS);
    uint8_t *mask = calloc((size_t)(nb * nb), 1);
    assert_non_null(mask);
    for (int32_t h = 0; h < num_heads; h++) {
      double density = ts_rng_uniform(&rng);
      for (int64_t x = 0; x < nb * nb; x++) mask[x] = ts_rng_uniform(&rng) < density;
      assert_int_equal(mtrain_pattern_set_block_mask(p, h, mask), MTRAIN_SUCCESS);
    }
    free(mask);
    return p;
  }
  case TS_PATTERN_BUDGETS:
    p = ts_pattern_from_budgets(ts_data_path("Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"),
                                (int32_t)(seed % 36), seq_len, num_heads, granularity, 131072 / 8,
                                seed);
    assert_non_null(p);
    return p;
  }
  fail_msg("unknown pattern kind %d", (int)kind);
  return NULL;
}

void ts_ring_fill(float *x, int64_t n, ts_rng_t *rng, int bf16_exact) {
  for (int64_t i = 0; i < n; i++) {
    const float u = (float)(2.0 * ts_rng_uniform(rng) - 1.0);
    x[i] = bf16_exact ? mtrain_bf16_to_float(mtrain_float_to_bf16(u)) : u;
  }
}

mtrain_pattern_t *ts_ring_pattern(int kind, int64_t N, int32_t heads, int32_t G, uint64_t seed) {
  mtrain_pattern_t *p = NULL;
  const int64_t nb = (N + G - 1) / G;
  if (kind == 0) return mtrain_pattern_create_dense(N, heads, G, &p) ? NULL : p;
  if (kind == 5) { /* non-causal block masks over every key block */
    if (mtrain_pattern_create_noncausal(N, heads, G, &p)) return NULL;
    ts_rng_t nrng = {seed * 11 + 3};
    uint8_t *mask = calloc((size_t)(nb * nb), 1);
    int ok = mask != NULL;
    for (int32_t h = 0; ok && h < heads; h++) {
      for (int64_t i = 0; i < nb; i++)
        for (int64_t j = 0; j < nb; j++)
          mask[i * nb + j] = (uint8_t)(j == 0 || ts_rng_uniform(&nrng) < 0.3);
      ok = mtrain_pattern_set_block_mask(p, h, mask) == MTRAIN_SUCCESS;
    }
    free(mask);
    if (ok) return p;
    mtrain_pattern_destroy(p);
    return NULL;
  }
  if (mtrain_pattern_create(N, heads, G, &p)) return NULL;
  if (kind == 2) return p;
  ts_rng_t rng = {seed * 7 + 1};
  int32_t *d = malloc(sizeof(int32_t) * (size_t)(nb + 1));
  int64_t *v = malloc(sizeof(int64_t) * (size_t)(N + 1));
  int ok = d && v;
  for (int32_t h = 0; ok && h < heads; h++) {
    if (kind == 4 && h % 2 == 0) {
      uint8_t *mask = calloc((size_t)(nb * nb), 1);
      ok = mask != NULL;
      for (int64_t i = 0; ok && i < nb; i++)
        for (int64_t j = 0; j <= i; j++)
          mask[i * nb + j] = (uint8_t)(j == i || j == 0 || ts_rng_uniform(&rng) < 0.3);
      ok = ok && mtrain_pattern_set_block_mask(p, h, mask) == MTRAIN_SUCCESS;
      free(mask);
      continue;
    }
    int32_t nd = 0, nv = 0;
    for (int64_t t = 0; t < nb; t++)
      if (t == 0 || (kind == 3 ? t < 2 : ts_rng_uniform(&rng) < 0.3)) d[nd++] = (int32_t)t;
    for (int64_t j = 0; j < N; j++)
      if (kind == 3 ? (j < 8 || ts_rng_uniform(&rng) < 0.02) : ts_rng_uniform(&rng) < 0.05)
        v[nv++] = j;
    ok = mtrain_pattern_set_head(p, h, d, nd, v, nv) == MTRAIN_SUCCESS;
  }
  free(d);
  free(v);
  if (ok) return p;
  mtrain_pattern_destroy(p);
  return NULL;
}

void ts_ring_gather(float *local, const float *global, const int64_t *index, int64_t T, int64_t N,
                    int64_t width) {
  for (int64_t i = 0; i < T; i++)
    if (index[i] < N)
      memcpy(local + i * width, global + index[i] * width, sizeof(float) * (size_t)width);
}

void ts_ring_compare(const float *local, const float *global, const int64_t *index, int64_t T,
                     int64_t N, int64_t width, double *err, double *ref) {
  for (int64_t i = 0; i < T; i++) {
    if (index[i] >= N) continue;
    for (int64_t x = 0; x < width; x++) {
      const double g = global[index[i] * width + x], l = local[i * width + x];
      const double e = fabs(l - g);
      if (!(e <= *err)) *err = isnan(e) ? INFINITY : e;
      if (fabs(g) > *ref) *ref = fabs(g);
    }
  }
}

void ts_ring_estimate_budgets(mtrain_head_budget_t budgets[4]) {
  const mtrain_head_budget_t b[4] = {{MTRAIN_BUDGET_TOP_K, 12, 40, 0, 0, 0, 0},
                                     {MTRAIN_BUDGET_TOP_P, 0, 0, 0.5, 0.4, 30, 60},
                                     {MTRAIN_BUDGET_TOP_K, 40, 8, 0, 0, 0, 0},
                                     {MTRAIN_BUDGET_TOP_P, 0, 0, 0.9, 0.9, 100, 200}};
  memcpy(budgets, b, sizeof b);
}

int ts_patterns_equal(const mtrain_pattern_t *a, const mtrain_pattern_t *b, int32_t heads,
                      int32_t *head) {
  for (int32_t h = 0; h < heads; h++) {
    const int32_t *d1 = NULL, *d2 = NULL;
    const int64_t *v1 = NULL, *v2 = NULL;
    int32_t nd1 = -1, nd2 = -2, nv1 = -1, nv2 = -2;
    mtrain_pattern_get_head(a, h, &d1, &nd1, &v1, &nv1);
    mtrain_pattern_get_head(b, h, &d2, &nd2, &v2, &nv2);
    if (nd1 != nd2 || nv1 != nv2 || (nd1 > 0 && memcmp(d1, d2, sizeof(int32_t) * (size_t)nd1)) ||
        (nv1 > 0 && memcmp(v1, v2, sizeof(int64_t) * (size_t)nv1))) {
      *head = h;
      return 0;
    }
  }
  return 1;
}

int ts_run_capture(const char *command, char **out) {
  FILE *p = popen(command, "r");
  assert_non_null(p);
  size_t n = 0, cap = 1 << 16;
  char *buf = malloc(cap);
  assert_non_null(buf);
  size_t got;
  while ((got = fread(buf + n, 1, cap - n - 1, p)) > 0) {
    n += got;
    if (cap - n < 1024) {
      buf = realloc(buf, cap *= 2);
      assert_non_null(buf);
    }
  }
  buf[n] = '\0';
  const int status = pclose(p);
  *out = buf;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void ts_assert_status(mtrain_status_t st, mtrain_status_t want, const char *needle,
                      const char *file, int line) {
  const char *msg = mtrain_last_error();
  if (st != want) {
    fail_msg("%s:%d: status %s (%d), expected %s (%d); message: %s", file, line,
             mtrain_status_name(st), (int)st, mtrain_status_name(want), (int)want, msg);
  }
  if (needle && !strstr(msg, needle))
    fail_msg("%s:%d: message \"%s\" does not mention \"%s\"", file, line, msg, needle);
}

uint64_t ts_seed(uint64_t default_seed) {
  const char *s = getenv("MTRAIN_TEST_SEED");
  return s ? strtoull(s, NULL, 0) : default_seed;
}
