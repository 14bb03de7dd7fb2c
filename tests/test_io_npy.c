/* test_io_npy.c: the .npy reader and writer (SPEC.md section 8): round trips
 * for every dtype and 1 to 4 dimensions, files written by numpy itself
 * (format 1.0, 2.0 and 3.0, embedded byte for byte), the header parser's
 * tolerance, read_as (shape checks and conversion) and one test per class of
 * malformed input, checking the status and that the message names the file
 * and the reason; empty arrays (an extent 0) are read by mtrain_npy_read and
 * refused at once by mtrain_npy_read_as. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdint.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtrain/mtrain_io.h"

/* Exact bytes of .npy files written by numpy 2.4.6 (generated, do not edit). */
/* numpy.save of (np.arange(6, dtype='<f4') / 4).reshape(2, 3), format 1.0 */
static const unsigned char npy_v1_f4_2x3[152] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20,
    0x33, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x3e, 0x00, 0x00, 0x00, 0x3f, 0x00, 0x00, 0x40, 0x3f,
    0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0xa0, 0x3f,
};
/* numpy.save of np.array([[1, 0.5], [-3, 65504]], dtype='<f2'), format 1.0 */
static const unsigned char npy_v1_f2_2x2[136] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x32, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20,
    0x32, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x3c, 0x00, 0x38, 0x00, 0xc2, 0xff, 0x7b,
};
/* numpy.save of np.array([1.5, -2.25, 1e300]), format 1.0 */
static const unsigned char npy_v1_f8_3[152] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x38, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x33, 0x2c, 0x29,
    0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x3f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0xc0,
    0x9c, 0x75, 0x00, 0x88, 0x3c, 0xe4, 0x37, 0x7e,
};
/* np.lib.format.write_array(f, np.array([1.5, -2.25, 1e300]), version=(2, 0)) */
static const unsigned char npy_v2_f8_3[152] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x02, 0x00, 0x74, 0x00, 0x00, 0x00, 0x7b, 0x27, 0x64, 0x65,
    0x73, 0x63, 0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x38, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f,
    0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61,
    0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x33,
    0x2c, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0x3f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0xc0,
    0x9c, 0x75, 0x00, 0x88, 0x3c, 0xe4, 0x37, 0x7e,
};
/* np.lib.format.write_array(f, np.arange(24, dtype='<f4').reshape(1, 2, 3, 4) - 12,
 * version=(3, 0)) */
static const unsigned char npy_v3_f4_1x2x3x4[224] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x03, 0x00, 0x74, 0x00, 0x00, 0x00, 0x7b, 0x27, 0x64, 0x65,
    0x73, 0x63, 0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f,
    0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61,
    0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x31,
    0x2c, 0x20, 0x32, 0x2c, 0x20, 0x33, 0x2c, 0x20, 0x34, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x40, 0xc1, 0x00, 0x00, 0x30, 0xc1, 0x00, 0x00, 0x20, 0xc1, 0x00, 0x00, 0x10, 0xc1,
    0x00, 0x00, 0x00, 0xc1, 0x00, 0x00, 0xe0, 0xc0, 0x00, 0x00, 0xc0, 0xc0, 0x00, 0x00, 0xa0, 0xc0,
    0x00, 0x00, 0x80, 0xc0, 0x00, 0x00, 0x40, 0xc0, 0x00, 0x00, 0x00, 0xc0, 0x00, 0x00, 0x80, 0xbf,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x40, 0x40,
    0x00, 0x00, 0x80, 0x40, 0x00, 0x00, 0xa0, 0x40, 0x00, 0x00, 0xc0, 0x40, 0x00, 0x00, 0xe0, 0x40,
    0x00, 0x00, 0x00, 0x41, 0x00, 0x00, 0x10, 0x41, 0x00, 0x00, 0x20, 0x41, 0x00, 0x00, 0x30, 0x41,
};

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

static void tmp_path(char *buf, size_t cap, const char *name) {
  snprintf(buf, cap, "%s/npy_%s", MTRAIN_TEST_TMPDIR, name);
}

static void write_bytes(const char *path, const void *data, size_t len) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, len, f), len);
  assert_int_equal(fclose(f), 0);
}

/* Reads a whole file; returns its length. */
static size_t read_bytes(const char *path, unsigned char *buf, size_t cap) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  size_t n = fread(buf, 1, cap, f);
  assert_int_equal(fgetc(f), EOF);
  fclose(f);
  return n;
}

/* Writes a .npy file of format `major`.0 with the given header dict text
 * (padded like numpy to a multiple of `align` bytes, ended by '\n') and
 * `data_len` bytes of data (from `data`, or zeros when NULL). */
static void write_npy_raw(const char *path, int major, const char *dict, size_t align,
                          const void *data, size_t data_len) {
  size_t pre = major == 1 ? 10 : 12, dlen = strlen(dict);
  size_t total = (pre + dlen + 1 + align - 1) / align * align;
  size_t hlen = total - pre;
  unsigned char *buf = calloc(total + data_len + 1, 1);
  assert_non_null(buf);
  memcpy(buf, "\x93NUMPY", 6);
  buf[6] = (unsigned char)major;
  buf[7] = 0;
  for (size_t b = 0; b < pre - 8; b++) buf[8 + b] = (unsigned char)(hlen >> (8 * b));
  memcpy(buf + pre, dict, dlen);
  memset(buf + pre + dlen, ' ', hlen - dlen - 1);
  buf[total - 1] = '\n';
  if (data) memcpy(buf + total, data, data_len);
  write_bytes(path, buf, total + data_len);
  free(buf);
}

static const char *base_name(const char *path) {
  const char *s = strrchr(path, '/');
  return s ? s + 1 : path;
}

/* Checks the status and that the message names the file and each of the
 * given fragments (NULL-terminated). */
static void expect_error(mtrain_status_t st, mtrain_status_t want, const char *path, ...) {
  const char *msg = mtrain_last_error();
  if (st != want)
    fail_msg("status %s, expected %s (message: %s)", mtrain_status_name(st),
             mtrain_status_name(want), msg);
  if (!strstr(msg, base_name(path))) fail_msg("message '%s' does not name '%s'", msg, path);
  va_list ap;
  va_start(ap, path);
  for (const char *frag = va_arg(ap, const char *); frag; frag = va_arg(ap, const char *))
    if (!strstr(msg, frag)) fail_msg("message '%s' lacks '%s'", msg, frag);
  va_end(ap);
}

/* Reads `path` expecting failure; also checks the output was not written. */
static mtrain_status_t read_expect_fail(const char *path) {
  mtrain_npy_t npy;
  int sentinel = 0;
  npy.tensor.data = &sentinel;
  npy.tensor.ndim = -7;
  mtrain_status_t st = mtrain_npy_read(path, &npy);
  assert_int_not_equal(st, MTRAIN_SUCCESS);
  assert_ptr_equal(npy.tensor.data, &sentinel);
  assert_int_equal(npy.tensor.ndim, -7);
  return st;
}

/* Reads a malformed f4 header (format 1.0, zero data of data_len bytes). */
static void check_bad_header(const char *name, const char *dict, size_t data_len, const char *frag1,
                             const char *frag2) {
  char path[512];
  tmp_path(path, sizeof path, name);
  write_npy_raw(path, 1, dict, 64, NULL, data_len);
  mtrain_status_t st = read_expect_fail(path);
  expect_error(st, MTRAIN_ERR_FORMAT, path, frag1, frag2, "byte offset", NULL);
}

/* Fills `count` elements of `dtype` with distinct values (raw bit patterns
 * for the 16-bit types, including Inf, NaN and subnormals). */
static void fill(void *data, mtrain_dtype_t dtype, int64_t count) {
  for (int64_t i = 0; i < count; i++) {
    if (dtype == MTRAIN_F32)
      ((float *)data)[i] = (float)i * 0.375f - 3.0f;
    else if (dtype == MTRAIN_F64)
      ((double *)data)[i] = (double)i * 1e-3 - 0.1;
    else
      ((uint16_t *)data)[i] = (uint16_t)(i * 2654435761u >> 7);
  }
}

/* ------------------------------------------------------------------------ */
/* Round trips                                                               */
/* ------------------------------------------------------------------------ */

static const int64_t test_shape[MTRAIN_MAX_DIMS] = {5, 3, 2, 4};

static void roundtrip(mtrain_dtype_t dtype) {
  for (int32_t ndim = 1; ndim <= MTRAIN_MAX_DIMS; ndim++) {
    char path[512], name[64];
    snprintf(name, sizeof name, "rt_%s_%d.npy", mtrain_dtype_name(dtype), ndim);
    tmp_path(path, sizeof path, name);
    mtrain_tensor_t t = {NULL, dtype, ndim, {0, 0, 0, 0}};
    memcpy(t.shape, test_shape, sizeof t.shape);
    int64_t numel = 1;
    for (int32_t d = 0; d < ndim; d++) numel *= t.shape[d];
    size_t bytes = (size_t)numel * mtrain_dtype_size(dtype);
    t.data = malloc(bytes);
    assert_non_null(t.data);
    fill(t.data, dtype, numel);
    assert_int_equal(mtrain_npy_write(path, &t), MTRAIN_SUCCESS);

    /* numpy's layout: header padded to 64 bytes, then exactly the data */
    unsigned char head[16];
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fread(head, 1, 10, f), 10);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long size = ftell(f);
    fclose(f);
    size_t hlen = (size_t)head[8] | (size_t)head[9] << 8;
    assert_int_equal((10 + hlen) % 64, 0);
    assert_int_equal((size_t)size, 10 + hlen + bytes);

    mtrain_npy_t npy;
    assert_int_equal(mtrain_npy_read(path, &npy), MTRAIN_SUCCESS);
    assert_int_equal(npy.tensor.dtype, dtype);
    assert_int_equal(npy.tensor.ndim, ndim);
    for (int32_t d = 0; d < ndim; d++) assert_int_equal(npy.tensor.shape[d], t.shape[d]);
    assert_memory_equal(npy.tensor.data, t.data, bytes);
    mtrain_npy_free(&npy);
    assert_null(npy.tensor.data);
    free(t.data);
  }
}

static void test_roundtrip_f32(void **state) {
  (void)state;
  roundtrip(MTRAIN_F32);
}

static void test_roundtrip_f64(void **state) {
  (void)state;
  roundtrip(MTRAIN_F64);
}

static void test_roundtrip_f16(void **state) {
  (void)state;
  roundtrip(MTRAIN_F16);
}

/* BF16 is widened to float32 exactly. */
static void test_roundtrip_bf16_widened(void **state) {
  (void)state;
  for (int32_t ndim = 1; ndim <= MTRAIN_MAX_DIMS; ndim++) {
    char path[512];
    tmp_path(path, sizeof path, "rt_bf16.npy");
    mtrain_tensor_t t = {NULL, MTRAIN_BF16, ndim, {0, 0, 0, 0}};
    memcpy(t.shape, test_shape, sizeof t.shape);
    int64_t numel = 1;
    for (int32_t d = 0; d < ndim; d++) numel *= t.shape[d];
    uint16_t *src = malloc((size_t)numel * sizeof *src);
    assert_non_null(src);
    for (int64_t i = 0; i < numel; i++) src[i] = mtrain_float_to_bf16((float)i * 0.5f - 7.25f);
    t.data = src;
    assert_int_equal(mtrain_npy_write(path, &t), MTRAIN_SUCCESS);
    mtrain_npy_t npy;
    assert_int_equal(mtrain_npy_read(path, &npy), MTRAIN_SUCCESS);
    assert_int_equal(npy.tensor.dtype, MTRAIN_F32);
    assert_int_equal(npy.tensor.ndim, ndim);
    const float *got = npy.tensor.data;
    for (int64_t i = 0; i < numel; i++) {
      float want = mtrain_bf16_to_float(src[i]);
      assert_memory_equal(&got[i], &want, sizeof want);
    }
    mtrain_npy_free(&npy);
    free(src);
  }
}

/* An array with a zero extent has no data bytes. */
static void test_roundtrip_empty(void **state) {
  (void)state;
  char path[512];
  tmp_path(path, sizeof path, "empty.npy");
  float dummy = 0.0f;
  mtrain_tensor_t t = {&dummy, MTRAIN_F32, 2, {0, 3, 0, 0}};
  assert_int_equal(mtrain_npy_write(path, &t), MTRAIN_SUCCESS);
  mtrain_npy_t npy;
  assert_int_equal(mtrain_npy_read(path, &npy), MTRAIN_SUCCESS);
  assert_int_equal(npy.tensor.ndim, 2);
  assert_int_equal(npy.tensor.shape[0], 0);
  assert_int_equal(npy.tensor.shape[1], 3);
  mtrain_npy_free(&npy);
}

/* The writer's bytes equal numpy.save's, header included. */
static void check_written_equals(const char *name, mtrain_tensor_t t, const unsigned char *want,
                                 size_t want_len) {
  char path[512];
  unsigned char got[512];
  tmp_path(path, sizeof path, name);
  assert_int_equal(mtrain_npy_write(path, &t), MTRAIN_SUCCESS);
  size_t n = read_bytes(path, got, sizeof got);
  assert_int_equal(n, want_len);
  assert_memory_equal(got, want, want_len);
}

static void test_write_matches_numpy(void **state) {
  (void)state;
  float f4[6] = {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f};
  check_written_equals("same_f4.npy", (mtrain_tensor_t){f4, MTRAIN_F32, 2, {2, 3, 0, 0}},
                       npy_v1_f4_2x3, sizeof npy_v1_f4_2x3);
  uint16_t f2[4] = {0x3c00, 0x3800, 0xc200, 0x7bff}; /* 1, 0.5, -3, 65504 */
  check_written_equals("same_f2.npy", (mtrain_tensor_t){f2, MTRAIN_F16, 2, {2, 2, 0, 0}},
                       npy_v1_f2_2x2, sizeof npy_v1_f2_2x2);
  double f8[3] = {1.5, -2.25, 1e300};
  check_written_equals("same_f8.npy", (mtrain_tensor_t){f8, MTRAIN_F64, 1, {3, 0, 0, 0}},
                       npy_v1_f8_3, sizeof npy_v1_f8_3);
}

/* ------------------------------------------------------------------------ */
/* Files written by numpy                                                    */
/* ------------------------------------------------------------------------ */

static void read_embedded(const char *name, const unsigned char *bytes, size_t len,
                          mtrain_npy_t *npy) {
  char path[512];
  tmp_path(path, sizeof path, name);
  write_bytes(path, bytes, len);
  assert_int_equal(mtrain_npy_read(path, npy), MTRAIN_SUCCESS);
}

static void test_read_numpy_v1(void **state) {
  (void)state;
  mtrain_npy_t npy;
  read_embedded("np_v1_f4.npy", npy_v1_f4_2x3, sizeof npy_v1_f4_2x3, &npy);
  assert_int_equal(npy.tensor.dtype, MTRAIN_F32);
  assert_int_equal(npy.tensor.ndim, 2);
  assert_int_equal(npy.tensor.shape[0], 2);
  assert_int_equal(npy.tensor.shape[1], 3);
  for (int i = 0; i < 6; i++) assert_true(((float *)npy.tensor.data)[i] == (float)i / 4.0f);
  mtrain_npy_free(&npy);

  read_embedded("np_v1_f2.npy", npy_v1_f2_2x2, sizeof npy_v1_f2_2x2, &npy);
  assert_int_equal(npy.tensor.dtype, MTRAIN_F16);
  assert_int_equal(npy.tensor.ndim, 2);
  const uint16_t want[4] = {0x3c00, 0x3800, 0xc200, 0x7bff};
  assert_memory_equal(npy.tensor.data, want, sizeof want);
  mtrain_npy_free(&npy);
}

static void test_read_numpy_v2(void **state) {
  (void)state;
  mtrain_npy_t npy;
  read_embedded("np_v2_f8.npy", npy_v2_f8_3, sizeof npy_v2_f8_3, &npy);
  assert_int_equal(npy.tensor.dtype, MTRAIN_F64);
  assert_int_equal(npy.tensor.ndim, 1);
  assert_int_equal(npy.tensor.shape[0], 3);
  const double *d = npy.tensor.data;
  assert_true(d[0] == 1.5 && d[1] == -2.25 && d[2] == 1e300);
  mtrain_npy_free(&npy);
}

static void test_read_numpy_v3(void **state) {
  (void)state;
  mtrain_npy_t npy;
  read_embedded("np_v3_f4.npy", npy_v3_f4_1x2x3x4, sizeof npy_v3_f4_1x2x3x4, &npy);
  assert_int_equal(npy.tensor.dtype, MTRAIN_F32);
  assert_int_equal(npy.tensor.ndim, 4);
  const int64_t shape[4] = {1, 2, 3, 4};
  assert_memory_equal(npy.tensor.shape, shape, sizeof shape);
  for (int i = 0; i < 24; i++) assert_true(((float *)npy.tensor.data)[i] == (float)(i - 12));
  mtrain_npy_free(&npy);
}

/* Whitespace, key order, quotes, trailing commas, 16-byte alignment (old
 * numpy) and the Python 2 'L' suffix are all accepted. */
static void test_header_variants(void **state) {
  (void)state;
  static const struct {
    const char *dict;
    size_t align;
    int major;
  } cases[] = {
      {"{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}", 64, 1},
      {"{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2, 3)}", 64, 1},
      {"{ 'descr' :'<f4' ,\t'fortran_order':False,'shape':( 2 ,3 , ) , }", 16, 1},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }", 16, 2},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char path[512];
    tmp_path(path, sizeof path, "variant.npy");
    float data[6] = {1, 2, 3, 4, 5, 6};
    write_npy_raw(path, cases[c].major, cases[c].dict, cases[c].align, data, sizeof data);
    mtrain_npy_t npy;
    mtrain_status_t st = mtrain_npy_read(path, &npy);
    if (st != MTRAIN_SUCCESS) fail_msg("case %zu: %s", c, mtrain_last_error());
    assert_int_equal(npy.tensor.ndim, 2);
    assert_int_equal(npy.tensor.shape[0], 2);
    assert_int_equal(npy.tensor.shape[1], 3);
    assert_memory_equal(npy.tensor.data, data, sizeof data);
    mtrain_npy_free(&npy);
  }
}

/* ------------------------------------------------------------------------ */
/* read_as                                                                   */
/* ------------------------------------------------------------------------ */

static void test_read_as_converts(void **state) {
  (void)state;
  char path[512];
  tmp_path(path, sizeof path, "as_f8.npy");
  write_bytes(path, npy_v2_f8_3, sizeof npy_v2_f8_3);
  mtrain_npy_t npy;
  const int64_t want3[1] = {3};
  assert_int_equal(mtrain_npy_read_as(path, MTRAIN_F32, 1, want3, &npy), MTRAIN_SUCCESS);
  assert_int_equal(npy.tensor.dtype, MTRAIN_F32);
  const float *f = npy.tensor.data;
  assert_true(f[0] == 1.5f && f[1] == -2.25f && isinf(f[2]) && f[2] > 0);
  mtrain_npy_free(&npy);

  tmp_path(path, sizeof path, "as_f4.npy");
  write_bytes(path, npy_v1_f4_2x3, sizeof npy_v1_f4_2x3);
  assert_int_equal(mtrain_npy_read_as(path, MTRAIN_BF16, 2, NULL, &npy), MTRAIN_SUCCESS);
  assert_int_equal(npy.tensor.dtype, MTRAIN_BF16);
  for (int i = 0; i < 6; i++)
    assert_int_equal(((uint16_t *)npy.tensor.data)[i], mtrain_float_to_bf16((float)i / 4.0f));
  mtrain_npy_free(&npy);

  tmp_path(path, sizeof path, "as_f2.npy");
  write_bytes(path, npy_v1_f2_2x2, sizeof npy_v1_f2_2x2);
  const int64_t any_by_2[2] = {-1, 2};
  assert_int_equal(mtrain_npy_read_as(path, MTRAIN_F64, 2, any_by_2, &npy), MTRAIN_SUCCESS);
  assert_int_equal(npy.tensor.dtype, MTRAIN_F64);
  const double *d = npy.tensor.data;
  assert_true(d[0] == 1.0 && d[1] == 0.5 && d[2] == -3.0 && d[3] == 65504.0);
  mtrain_npy_free(&npy);
}

static void test_read_as_shape_mismatch(void **state) {
  (void)state;
  char path[512];
  tmp_path(path, sizeof path, "q.npy");
  write_bytes(path, npy_v1_f4_2x3, sizeof npy_v1_f4_2x3);
  mtrain_npy_t npy = {{NULL, MTRAIN_F32, 0, {0, 0, 0, 0}}};
  const int64_t want[2] = {2, 4};
  mtrain_status_t st = mtrain_npy_read_as(path, MTRAIN_F32, 2, want, &npy);
  expect_error(st, MTRAIN_ERR_SHAPE_MISMATCH, path, "dimension 1 is 3, expected 4", NULL);
  assert_null(npy.tensor.data);
  st = mtrain_npy_read_as(path, MTRAIN_F32, 3, NULL, &npy);
  expect_error(st, MTRAIN_ERR_SHAPE_MISMATCH, path, "has 2 dimensions", "expected 3", NULL);
  const int64_t first[2] = {5, -1};
  st = mtrain_npy_read_as(path, MTRAIN_F32, 2, first, &npy);
  expect_error(st, MTRAIN_ERR_SHAPE_MISMATCH, path, "dimension 0 is 2, expected 5", NULL);
  assert_null(npy.tensor.data);
}

static void test_read_as_bad_arguments(void **state) {
  (void)state;
  char path[512];
  tmp_path(path, sizeof path, "args.npy");
  write_bytes(path, npy_v1_f4_2x3, sizeof npy_v1_f4_2x3);
  mtrain_npy_t npy;
  assert_int_equal(mtrain_npy_read_as(path, (mtrain_dtype_t)99, 2, NULL, &npy),
                   MTRAIN_ERR_UNSUPPORTED_DTYPE);
  assert_int_equal(mtrain_npy_read_as(path, MTRAIN_F32, 0, NULL, &npy),
                   MTRAIN_ERR_INVALID_ARGUMENT);
  assert_int_equal(mtrain_npy_read_as(path, MTRAIN_F32, 5, NULL, &npy),
                   MTRAIN_ERR_INVALID_ARGUMENT);
  assert_int_equal(mtrain_npy_read_as(NULL, MTRAIN_F32, 2, NULL, &npy), MTRAIN_ERR_NULL_POINTER);
  assert_int_equal(mtrain_npy_read(path, NULL), MTRAIN_ERR_NULL_POINTER);
  mtrain_npy_free(NULL);
}

/* ------------------------------------------------------------------------ */
/* Malformed files                                                           */
/* ------------------------------------------------------------------------ */

static void test_missing_file(void **state) {
  (void)state;
  char path[512];
  tmp_path(path, sizeof path, "does_not_exist.npy");
  remove(path);
  mtrain_status_t st = read_expect_fail(path);
  expect_error(st, MTRAIN_ERR_IO, path, "cannot open", NULL);
}

static void test_bad_magic(void **state) {
  (void)state;
  char path[512];
  unsigned char buf[sizeof npy_v1_f4_2x3];
  memcpy(buf, npy_v1_f4_2x3, sizeof buf);
  buf[1] = 'n';
  tmp_path(path, sizeof path, "magic.npy");
  write_bytes(path, buf, sizeof buf);
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "bad magic", "byte offset 0", NULL);
  write_bytes(path, "", 0); /* empty file */
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "bad magic", NULL);
  write_bytes(path, "\x93NUMPY", 6); /* magic only */
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "format version", NULL);
}

static void test_unknown_version(void **state) {
  (void)state;
  char path[512];
  unsigned char buf[sizeof npy_v1_f4_2x3];
  memcpy(buf, npy_v1_f4_2x3, sizeof buf);
  buf[6] = 4;
  tmp_path(path, sizeof path, "version.npy");
  write_bytes(path, buf, sizeof buf);
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "version 4.0", "byte offset 6",
               NULL);
  buf[6] = 1;
  buf[7] = 1;
  write_bytes(path, buf, sizeof buf);
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "version 1.1", NULL);
  buf[6] = 0;
  buf[7] = 0;
  write_bytes(path, buf, sizeof buf);
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "version 0.0", NULL);
}

static void test_header_length_beyond_file(void **state) {
  (void)state;
  char path[512];
  unsigned char buf[sizeof npy_v1_f4_2x3];
  memcpy(buf, npy_v1_f4_2x3, sizeof buf);
  buf[8] = 0xff;
  buf[9] = 0x7f;
  tmp_path(path, sizeof path, "hlen.npy");
  write_bytes(path, buf, sizeof buf);
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "header length 32767",
               "past the end", "byte offset 8", NULL);
  write_bytes(path, buf, 9); /* ends inside the length field */
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "header length field", NULL);
}

static void test_truncated_data(void **state) {
  (void)state;
  char path[512];
  tmp_path(path, sizeof path, "truncated.npy");
  write_bytes(path, npy_v1_f4_2x3, sizeof npy_v1_f4_2x3 - 1);
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "truncated", "24 bytes",
               "byte offset 128", NULL);
  write_bytes(path, npy_v2_f8_3, 128); /* header only */
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "truncated", NULL);
}

static void test_trailing_garbage(void **state) {
  (void)state;
  char path[512];
  unsigned char buf[sizeof npy_v1_f4_2x3 + 3];
  memcpy(buf, npy_v1_f4_2x3, sizeof npy_v1_f4_2x3);
  memcpy(buf + sizeof npy_v1_f4_2x3, "xyz", 3);
  tmp_path(path, sizeof path, "trailing.npy");
  write_bytes(path, buf, sizeof buf);
  expect_error(read_expect_fail(path), MTRAIN_ERR_FORMAT, path, "3 trailing bytes",
               "byte offset 152", NULL);
}

static void test_big_endian(void **state) {
  (void)state;
  check_bad_header("big.npy", "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", 24,
                   "big-endian", "header key 'descr'");
  check_bad_header("big8.npy", "{'descr': '>f8', 'fortran_order': False, 'shape': (3,), }", 24,
                   "big-endian", "'>f8'");
}

static void test_unsupported_dtype(void **state) {
  (void)state;
  check_bad_header("i4.npy", "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }", 24,
                   "unsupported dtype '<i4'", "header key 'descr'");
  check_bad_header("pipe.npy", "{'descr': '|f4', 'fortran_order': False, 'shape': (2, 3), }", 24,
                   "unsupported dtype '|f4'", "header key 'descr'");
  check_bad_header("u1.npy", "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3), }", 6,
                   "unsupported dtype '|u1'", "header key 'descr'");
  check_bad_header("rec.npy",
                   "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2, 3), }", 24,
                   "structured", "header key 'descr'");
}

static void test_fortran_order(void **state) {
  (void)state;
  check_bad_header("fortran.npy", "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 24,
                   "Fortran", "header key 'fortran_order'");
  check_bad_header("fortran2.npy", "{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", 24,
                   "expected True or False", "header key 'fortran_order'");
}

static void test_too_many_dims(void **state) {
  (void)state;
  check_bad_header("dims5.npy",
                   "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 2), }", 8,
                   "more than 4 dimensions", "header key 'shape'");
}

static void test_scalar_shape(void **state) {
  (void)state;
  check_bad_header("scalar.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", 4,
                   "scalar", "header key 'shape'");
}

static void test_negative_shape(void **state) {
  (void)state;
  check_bad_header("negative.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }",
                   24, "negative extent", "header key 'shape'");
}

static void test_overflowing_shape(void **state) {
  (void)state;
  check_bad_header("ovf1.npy",
                   "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
                   4, "overflows a 64-bit", "header key 'shape'");
  check_bad_header("ovf2.npy",
                   "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), "
                   "}",
                   4, "overflows", "header key 'shape'");
  check_bad_header("ovf3.npy",
                   "{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,), }", 4,
                   "overflows", "header key 'shape'");
}

/* Empty arrays (an extent 0, no data bytes): mtrain_npy_read reads them,
 * but the product of their other extents must stay addressable; the tensor
 * reader mtrain_npy_read_as refuses every one of them at once, naming the
 * file and the dimension, before any caller loops over the extents (a
 * (2^40, 0, 64) file made mtrain-run loop over 2^40 empty rows; a
 * (10^7, 4, 0) one took 74 s before head_dim 0 was refused). */
static double seconds_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void test_empty_dimensions(void **state) {
  (void)state;
  const struct {
    const char *name, *shape;
    int dim;
    const char *value;
  } cases[] = {
      {"empty_rows.npy", "(1099511627776, 0, 64)", 1, "dimension 1 is 0"},
      {"empty_dim.npy", "(10000000, 4, 0)", 2, "dimension 2 is 0"},
      {"empty_tokens.npy", "(0, 4, 64)", 0, "dimension 0 is 0"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    char path[512], dict[160];
    tmp_path(path, sizeof path, cases[c].name);
    snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }",
             cases[c].shape);
    write_npy_raw(path, 1, dict, 64, NULL, 0);
    /* the plain reader: a valid empty array */
    mtrain_npy_t npy;
    assert_int_equal(mtrain_npy_read(path, &npy), MTRAIN_SUCCESS);
    assert_int_equal(npy.tensor.shape[cases[c].dim], 0);
    mtrain_npy_free(&npy);
    /* the tensor reader: refused, at once, whatever the other extents */
    const int64_t any[3] = {-1, -1, -1};
    const mtrain_dtype_t as[2] = {MTRAIN_F32, MTRAIN_F64};
    for (int a = 0; a < 2; a++) {
      int sentinel = 0;
      npy.tensor.data = &sentinel;
      const double t0 = seconds_now();
      mtrain_status_t st = mtrain_npy_read_as(path, as[a], 3, a ? any : NULL, &npy);
      const double took = seconds_now() - t0;
      expect_error(st, MTRAIN_ERR_SHAPE_MISMATCH, path, cases[c].value, cases[c].shape,
                   "at least 1", NULL);
      assert_ptr_equal(npy.tensor.data, &sentinel);
      if (took > 0.5) fail_msg("%s: refused after %.2f s, not at once", cases[c].name, took);
    }
  }
  /* an empty array whose other extents overflow: refused by both readers */
  check_bad_header("empty_ovf.npy",
                   "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 0, "
                   "1024), }",
                   0, "overflows", "header key 'shape'");
  check_bad_header("empty_ovf2.npy",
                   "{'descr': '<f8', 'fortran_order': False, 'shape': (0, 2305843009213693952), }",
                   0, "overflows", "header key 'shape'");
}

static void test_bad_header_syntax(void **state) {
  (void)state;
  check_bad_header("nodict.npy", "['descr', '<f4']", 0, "expected a dict", "header");
  check_bad_header("missing.npy", "{'descr': '<f4', 'fortran_order': False}", 0,
                   "header key 'shape'", "missing");
  check_bad_header("unknown.npy",
                   "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1}", 24,
                   "header key 'extra'", "unknown key");
  check_bad_header("dup.npy",
                   "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}", 24,
                   "header key 'descr'", "duplicate");
  check_bad_header("after.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)} x", 24,
                   "after the closing '}'", "header");
  check_bad_header("unterminated.npy", "{'descr': '<f4", 24, "header key 'descr'",
                   "unterminated string");
  check_bad_header("unquoted.npy", "{'descr': f4, 'fortran_order': False, 'shape': (2, 3)}", 24,
                   "header key 'descr'", "expected a quoted string");
  check_bad_header("badshape.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3]}", 24,
                   "header key 'shape'", "expected '('");
  check_bad_header("nocomma.npy", "{'descr': '<f4' 'fortran_order': False, 'shape': (2, 3)}", 24,
                   "expected ',' or '}'", "header");
}

/* ------------------------------------------------------------------------ */
/* Write errors                                                              */
/* ------------------------------------------------------------------------ */

static void test_write_errors(void **state) {
  (void)state;
  float data[6] = {0};
  mtrain_tensor_t t = {data, MTRAIN_F32, 2, {2, 3, 0, 0}};
  char path[512];
  snprintf(path, sizeof path, "%s/no_such_dir/out.npy", MTRAIN_TEST_TMPDIR);
  expect_error(mtrain_npy_write(path, &t), MTRAIN_ERR_IO, path, "cannot open for writing", NULL);
  tmp_path(path, sizeof path, "w.npy");
  mtrain_tensor_t bad = t;
  bad.ndim = 0;
  expect_error(mtrain_npy_write(path, &bad), MTRAIN_ERR_INVALID_ARGUMENT, path, "ndim", NULL);
  bad = t;
  bad.ndim = 5;
  assert_int_equal(mtrain_npy_write(path, &bad), MTRAIN_ERR_INVALID_ARGUMENT);
  bad = t;
  bad.shape[1] = -1;
  expect_error(mtrain_npy_write(path, &bad), MTRAIN_ERR_INVALID_ARGUMENT, path, "negative", NULL);
  bad = t;
  bad.dtype = (mtrain_dtype_t)42;
  assert_int_equal(mtrain_npy_write(path, &bad), MTRAIN_ERR_UNSUPPORTED_DTYPE);
  bad = t;
  bad.data = NULL;
  assert_int_equal(mtrain_npy_write(path, &bad), MTRAIN_ERR_NULL_POINTER);
  assert_int_equal(mtrain_npy_write(NULL, &t), MTRAIN_ERR_NULL_POINTER);
  assert_int_equal(mtrain_npy_write(path, NULL), MTRAIN_ERR_NULL_POINTER);
}

/* A full device: the failure surfaces (at fwrite or fclose) as an I/O error. */
static void test_write_to_full_device(void **state) {
  (void)state;
  FILE *probe = fopen("/dev/full", "wb");
  if (!probe) {
    skip();
    return;
  }
  fclose(probe);
  static float data[1 << 16];
  mtrain_tensor_t t = {data, MTRAIN_F32, 1, {1 << 16, 0, 0, 0}};
  expect_error(mtrain_npy_write("/dev/full", &t), MTRAIN_ERR_IO, "/dev/full", "failed", NULL);
  mtrain_tensor_t small = {data, MTRAIN_BF16, 1, {3, 0, 0, 0}}; /* fails only at fclose */
  expect_error(mtrain_npy_write("/dev/full", &small), MTRAIN_ERR_IO, "/dev/full", "failed", NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_roundtrip_f32),
      cmocka_unit_test(test_roundtrip_f64),
      cmocka_unit_test(test_roundtrip_f16),
      cmocka_unit_test(test_roundtrip_bf16_widened),
      cmocka_unit_test(test_roundtrip_empty),
      cmocka_unit_test(test_write_matches_numpy),
      cmocka_unit_test(test_read_numpy_v1),
      cmocka_unit_test(test_read_numpy_v2),
      cmocka_unit_test(test_read_numpy_v3),
      cmocka_unit_test(test_header_variants),
      cmocka_unit_test(test_read_as_converts),
      cmocka_unit_test(test_read_as_shape_mismatch),
      cmocka_unit_test(test_read_as_bad_arguments),
      cmocka_unit_test(test_missing_file),
      cmocka_unit_test(test_bad_magic),
      cmocka_unit_test(test_unknown_version),
      cmocka_unit_test(test_header_length_beyond_file),
      cmocka_unit_test(test_truncated_data),
      cmocka_unit_test(test_trailing_garbage),
      cmocka_unit_test(test_big_endian),
      cmocka_unit_test(test_unsupported_dtype),
      cmocka_unit_test(test_fortran_order),
      cmocka_unit_test(test_too_many_dims),
      cmocka_unit_test(test_scalar_shape),
      cmocka_unit_test(test_negative_shape),
      cmocka_unit_test(test_overflowing_shape),
      cmocka_unit_test(test_empty_dimensions),
      cmocka_unit_test(test_bad_header_syntax),
      cmocka_unit_test(test_write_errors),
      cmocka_unit_test(test_write_to_full_device),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
