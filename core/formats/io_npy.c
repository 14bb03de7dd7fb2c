/* io_npy.c: NumPy .npy tensors (SPEC.md section 8). Reads format versions
 * 1.0, 2.0 and 3.0 holding little-endian float16/float32/float64 arrays in C
 * order with 1 to MTRAIN_MAX_DIMS dimensions (scalars, shape (), are
 * rejected); writes format 1.0 exactly as numpy.save does. The header, a
 * Python dict literal, is read by a small strict parser. Every malformed file
 * is rejected with a message naming the file, the place and the reason. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "core/formats/file_io.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_io.h"

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
#define NPY_ALIGN 64         /* numpy pads the preamble + header to this */
#define NPY_MAX_STRING 64    /* longest string value accepted in a header */
#define NPY_STAGE_ELEMS 8192 /* elements per staged write (conversion, swap) */

/* What the header says. */
typedef struct npy_header {
  mtrain_dtype_t dtype;
  int32_t ndim;
  int64_t shape[MTRAIN_MAX_DIMS];
  int64_t shape_offset; /* file offset of the shape value, for messages */
} npy_header_t;

/* Cursor over the header text (not NUL-terminated). */
typedef struct hdr_parser {
  const char *path;
  const char *text;
  size_t len;
  size_t pos;
  int64_t base; /* file offset of text[0] */
} hdr_parser_t;

/* ------------------------------------------------------------------------ */
/* Small helpers                                                             */
/* ------------------------------------------------------------------------ */

static int host_is_big_endian(void) {
  const uint16_t one = 1;
  unsigned char first;
  memcpy(&first, &one, 1);
  return first == 0;
}

/* Reverses the bytes of each of `count` elements of `width` bytes. */
static void swap_bytes(void *data, int64_t count, size_t width) {
  unsigned char *p = data;
  for (int64_t e = 0; e < count; e++, p += width)
    for (size_t a = 0, b = width - 1; a < b; a++, b--) {
      unsigned char tmp = p[a];
      p[a] = p[b];
      p[b] = tmp;
    }
}

/* "(2, 3)", "(5,)" or "()": the Python repr of a shape tuple. */
static void shape_text(const int64_t *shape, int32_t ndim, char *buf, size_t cap) {
  size_t n = (size_t)snprintf(buf, cap, "(");
  for (int32_t d = 0; d < ndim && n < cap; d++)
    n += (size_t)snprintf(buf + n, cap - n, d ? ", %lld" : "%lld", (long long)shape[d]);
  if (n < cap) snprintf(buf + n, cap - n, ndim == 1 ? ",)" : ")");
}

static const char *npy_descr(mtrain_dtype_t dtype) {
  switch (dtype) {
  case MTRAIN_F16:
    return "<f2";
  case MTRAIN_F32:
  case MTRAIN_BF16: /* widened on write */
    return "<f4";
  case MTRAIN_F64:
    return "<f8";
  }
  return NULL;
}

/* Element count of a shape; -1 when it overflows int64. The product of the
 * non-zero extents must fit even when one extent is 0 (the array is empty):
 * a shape such as (2^62, 0, 2^10) is refused, not read as 0 elements. */
static int64_t shape_numel(const int64_t *shape, int32_t ndim) {
  int64_t numel = 1;
  int empty = 0;
  for (int32_t d = 0; d < ndim; d++) {
    if (shape[d] == 0) {
      empty = 1;
      continue;
    }
    if (numel > INT64_MAX / shape[d]) return -1;
    numel *= shape[d];
  }
  return empty ? 0 : numel;
}

/* Bytes of numel elements of `width` bytes; -1 when it overflows int64 or
 * size_t. */
static int64_t data_bytes(int64_t numel, size_t width) {
  if (numel < 0 || numel > INT64_MAX / (int64_t)width) return -1;
  int64_t bytes = numel * (int64_t)width;
  if ((uint64_t)bytes > (uint64_t)SIZE_MAX) return -1;
  return bytes;
}

/* ------------------------------------------------------------------------ */
/* Header parser                                                             */
/* ------------------------------------------------------------------------ */

/* FORMAT error at the cursor: "<path>: header key 'k' (byte offset N): why". */
static mtrain_status_t hdr_fail(const hdr_parser_t *p, const char *key, const char *fmt, ...)
    MTRAIN_PRINTF(3, 4);
static mtrain_status_t hdr_fail(const hdr_parser_t *p, const char *key, const char *fmt, ...) {
  char reason[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(reason, sizeof reason, fmt, ap);
  va_end(ap);
  long long offset = (long long)(p->base + (int64_t)p->pos);
  if (key)
    return mtrain_error(MTRAIN_ERR_FORMAT, "%s: header key '%s' (byte offset %lld): %s", p->path,
                        key, offset, reason);
  return mtrain_error(MTRAIN_ERR_FORMAT, "%s: header (byte offset %lld): %s", p->path, offset,
                      reason);
}

static int is_space(int c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f'; }
static int is_digit(int c) { return c >= '0' && c <= '9'; }

/* Next non-blank character (not consumed); -1 at the end of the header. */
static int peek(hdr_parser_t *p) {
  while (p->pos < p->len && is_space((unsigned char)p->text[p->pos])) p->pos++;
  return p->pos < p->len ? (unsigned char)p->text[p->pos] : -1;
}

/* Consumes `c` when it is the next non-blank character. */
static int accept(hdr_parser_t *p, char c) {
  if (peek(p) != (unsigned char)c) return 0;
  p->pos++;
  return 1;
}

/* Describes the next character for messages: "'x'", "byte 0x93", "the end". */
static const char *found(hdr_parser_t *p, char *buf, size_t cap) {
  int c = peek(p);
  if (c < 0)
    snprintf(buf, cap, "the end of the header");
  else if (c >= 0x20 && c < 0x7f)
    snprintf(buf, cap, "'%c'", c);
  else
    snprintf(buf, cap, "byte 0x%02x", (unsigned)c);
  return buf;
}

static mtrain_status_t expect_char(hdr_parser_t *p, const char *key, char c) {
  char what[32];
  if (accept(p, c)) return MTRAIN_SUCCESS;
  return hdr_fail(p, key, "expected '%c', found %s", c, found(p, what, sizeof what));
}

/* A quoted Python string ('...' or "...") without escapes. */
static mtrain_status_t parse_string(hdr_parser_t *p, const char *key, char *out, size_t cap) {
  char what[32];
  int quote = peek(p);
  if (quote != '\'' && quote != '"')
    return hdr_fail(p, key, "expected a quoted string, found %s", found(p, what, sizeof what));
  size_t start = ++p->pos, n = 0;
  for (; p->pos < p->len && p->text[p->pos] != quote && p->text[p->pos] != '\n'; p->pos++, n++) {
    unsigned char c = (unsigned char)p->text[p->pos];
    if (c == '\\' || c < 0x20 || c >= 0x7f)
      return hdr_fail(p, key, "unsupported character (byte 0x%02x) in a string", (unsigned)c);
    if (n + 1 >= cap) return hdr_fail(p, key, "string longer than %zu characters", cap - 1);
  }
  if (p->pos >= p->len || p->text[p->pos] != quote) {
    p->pos = start - 1;
    return hdr_fail(p, key, "unterminated string");
  }
  memcpy(out, p->text + start, n);
  out[n] = '\0';
  p->pos++;
  return MTRAIN_SUCCESS;
}

/* Whether the header continues with the word `w` (not followed by an
 * identifier character); consumes it when so. */
static int accept_word(hdr_parser_t *p, const char *w) {
  size_t n = strlen(w);
  if (peek(p) < 0 || p->len - p->pos < n || memcmp(p->text + p->pos, w, n) != 0) return 0;
  if (p->pos + n < p->len) {
    unsigned char c = (unsigned char)p->text[p->pos + n];
    if (c == '_' || is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 0;
  }
  p->pos += n;
  return 1;
}

static mtrain_status_t parse_descr(hdr_parser_t *p, npy_header_t *h) {
  char s[NPY_MAX_STRING];
  if (peek(p) == '[') return hdr_fail(p, "descr", "structured (record) dtypes are not supported");
  size_t at = p->pos;
  mtrain_status_t st = parse_string(p, "descr", s, sizeof s);
  if (st != MTRAIN_SUCCESS) return st;
  if (strcmp(s, "<f2") == 0) {
    h->dtype = MTRAIN_F16;
  } else if (strcmp(s, "<f4") == 0) {
    h->dtype = MTRAIN_F32;
  } else if (strcmp(s, "<f8") == 0) {
    h->dtype = MTRAIN_F64;
  } else {
    p->pos = at;
    if (s[0] == '>' && (!strcmp(s + 1, "f2") || !strcmp(s + 1, "f4") || !strcmp(s + 1, "f8")))
      return hdr_fail(p, "descr",
                      "big-endian data ('%s') is not supported; save it little-endian "
                      "(for example a.astype('<%s'))",
                      s, s + 1);
    return hdr_fail(p, "descr", "unsupported dtype '%s' (mtrain reads '<f2', '<f4' and '<f8')", s);
  }
  return MTRAIN_SUCCESS;
}

static mtrain_status_t parse_fortran_order(hdr_parser_t *p) {
  char what[32];
  if (accept_word(p, "False")) return MTRAIN_SUCCESS;
  if (accept_word(p, "True")) {
    p->pos -= 4;
    return hdr_fail(p, "fortran_order",
                    "Fortran-order arrays are not supported (save a C-contiguous array, for "
                    "example numpy.ascontiguousarray(a))");
  }
  return hdr_fail(p, "fortran_order", "expected True or False, found %s",
                  found(p, what, sizeof what));
}

/* One shape extent: a non-negative decimal integer, optionally with the
 * Python 2 'L' suffix. */
static mtrain_status_t parse_extent(hdr_parser_t *p, int64_t *out) {
  char what[32];
  int c = peek(p);
  if (c == '-') return hdr_fail(p, "shape", "negative extent");
  if (c < 0 || !is_digit(c))
    return hdr_fail(p, "shape", "expected an integer extent, found %s",
                    found(p, what, sizeof what));
  size_t start = p->pos;
  int64_t v = 0;
  for (; p->pos < p->len && is_digit((unsigned char)p->text[p->pos]); p->pos++) {
    int digit = p->text[p->pos] - '0';
    if (v > (INT64_MAX - digit) / 10) {
      p->pos = start;
      return hdr_fail(p, "shape", "extent overflows a 64-bit integer");
    }
    v = v * 10 + digit;
  }
  if (p->pos < p->len && (p->text[p->pos] == 'L' || p->text[p->pos] == 'l')) p->pos++;
  *out = v;
  return MTRAIN_SUCCESS;
}

/* A tuple of extents: "()", "(3,)", "(2, 3)", "(2, 3,)". "(3)" is read as a
 * one-dimensional shape too. */
static mtrain_status_t parse_shape(hdr_parser_t *p, npy_header_t *h) {
  char what[32];
  peek(p);
  h->shape_offset = p->base + (int64_t)p->pos;
  mtrain_status_t st = expect_char(p, "shape", '(');
  if (st != MTRAIN_SUCCESS) return st;
  h->ndim = 0;
  while (!accept(p, ')')) {
    if (h->ndim == MTRAIN_MAX_DIMS)
      return hdr_fail(p, "shape", "more than %d dimensions (mtrain supports at most %d)",
                      MTRAIN_MAX_DIMS, MTRAIN_MAX_DIMS);
    st = parse_extent(p, &h->shape[h->ndim]);
    if (st != MTRAIN_SUCCESS) return st;
    h->ndim++;
    if (accept(p, ',')) continue;
    if (peek(p) != ')')
      return hdr_fail(p, "shape", "expected ',' or ')', found %s", found(p, what, sizeof what));
  }
  return MTRAIN_SUCCESS;
}

enum { KEY_DESCR = 1, KEY_FORTRAN = 2, KEY_SHAPE = 4 };

/* Parses the value of one key; `seen` collects the keys met so far. */
static mtrain_status_t parse_entry(hdr_parser_t *p, npy_header_t *h, unsigned *seen) {
  char key[NPY_MAX_STRING];
  size_t at = p->pos;
  mtrain_status_t st = parse_string(p, NULL, key, sizeof key);
  if (st != MTRAIN_SUCCESS) return st;
  unsigned bit = !strcmp(key, "descr")           ? KEY_DESCR
                 : !strcmp(key, "fortran_order") ? KEY_FORTRAN
                 : !strcmp(key, "shape")         ? KEY_SHAPE
                                                 : 0;
  if (bit == 0) {
    p->pos = at;
    return hdr_fail(p, key, "unknown key (a .npy header has 'descr', 'fortran_order', 'shape')");
  }
  if (*seen & bit) {
    p->pos = at;
    return hdr_fail(p, key, "duplicate key");
  }
  *seen |= bit;
  st = expect_char(p, key, ':');
  if (st != MTRAIN_SUCCESS) return st;
  if (bit == KEY_DESCR) return parse_descr(p, h);
  if (bit == KEY_FORTRAN) return parse_fortran_order(p);
  return parse_shape(p, h);
}

/* The whole header: one dict, then only blanks. */
static mtrain_status_t parse_header(hdr_parser_t *p, npy_header_t *h) {
  char what[32];
  unsigned seen = 0;
  if (!accept(p, '{'))
    return hdr_fail(p, NULL, "expected a dict starting with '{', found %s",
                    found(p, what, sizeof what));
  while (!accept(p, '}')) {
    mtrain_status_t st = parse_entry(p, h, &seen);
    if (st != MTRAIN_SUCCESS) return st;
    if (accept(p, ',')) continue;
    if (peek(p) != '}')
      return hdr_fail(p, NULL, "expected ',' or '}', found %s", found(p, what, sizeof what));
  }
  if (peek(p) >= 0) return hdr_fail(p, NULL, "unexpected text after the closing '}'");
  const char *missing = !(seen & KEY_DESCR)     ? "descr"
                        : !(seen & KEY_FORTRAN) ? "fortran_order"
                        : !(seen & KEY_SHAPE)   ? "shape"
                                                : NULL;
  if (missing) return hdr_fail(p, missing, "missing from the header");
  if (h->ndim == 0) {
    p->pos = (size_t)(h->shape_offset - p->base);
    return hdr_fail(p, "shape",
                    "shape () (a scalar) is not supported; mtrain reads 1 to %d dimensions",
                    MTRAIN_MAX_DIMS);
  }
  return MTRAIN_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Reading                                                                   */
/* ------------------------------------------------------------------------ */

static mtrain_status_t file_size(FILE *f, const char *path, int64_t *size) {
  off_t end;
  if (fseeko(f, 0, SEEK_END) != 0 || (end = ftello(f)) < 0 || fseeko(f, 0, SEEK_SET) != 0)
    return mtrain_io_error(path, "cannot determine the file size", errno);
  *size = (int64_t)end;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t read_at(FILE *f, const char *path, void *buf, size_t n, int64_t offset) {
  if (n == 0 || fread(buf, 1, n, f) == n) return MTRAIN_SUCCESS;
  if (ferror(f)) {
    char what[96];
    snprintf(what, sizeof what, "read error at byte offset %lld", (long long)offset);
    return mtrain_io_error(path, what, errno);
  }
  return mtrain_error(MTRAIN_ERR_IO,
                      "%s: file ended early while reading %zu bytes at byte offset %lld "
                      "(was it changed while being read?)",
                      path, n, (long long)offset);
}

/* Magic, version and header length; returns the header's offset and length. */
static mtrain_status_t read_preamble(FILE *f, const char *path, int64_t size, int64_t *hdr_off,
                                     uint32_t *hdr_len) {
  unsigned char pre[12];
  size_t got = size < NPY_MAGIC_LEN + 2 ? (size_t)size : NPY_MAGIC_LEN + 2;
  mtrain_status_t st = read_at(f, path, pre, got, 0);
  if (st != MTRAIN_SUCCESS) return st;
  if (got < NPY_MAGIC_LEN || memcmp(pre, NPY_MAGIC, NPY_MAGIC_LEN) != 0)
    return mtrain_error(MTRAIN_ERR_FORMAT,
                        "%s: bad magic at byte offset 0: not a .npy file (it must start with "
                        "\\x93NUMPY; file size %lld)",
                        path, (long long)size);
  if (got < NPY_MAGIC_LEN + 2)
    return mtrain_error(MTRAIN_ERR_FORMAT,
                        "%s: byte offset 6: file ends before the format version (file size %lld)",
                        path, (long long)size);
  unsigned major = pre[6], minor = pre[7];
  if (major < 1 || major > 3 || minor != 0)
    return mtrain_error(MTRAIN_ERR_FORMAT,
                        "%s: byte offset 6: unknown .npy format version %u.%u (mtrain reads 1.0, "
                        "2.0 and 3.0)",
                        path, major, minor);
  size_t field = major == 1 ? 2 : 4;
  if (size < (int64_t)(8 + field))
    return mtrain_error(MTRAIN_ERR_FORMAT,
                        "%s: byte offset 8: file ends inside the header length field (file size "
                        "%lld)",
                        path, (long long)size);
  st = read_at(f, path, pre + 8, field, 8);
  if (st != MTRAIN_SUCCESS) return st;
  uint32_t len = (uint32_t)pre[8] | (uint32_t)pre[9] << 8;
  if (field == 4) len |= (uint32_t)pre[10] << 16 | (uint32_t)pre[11] << 24;
  *hdr_off = (int64_t)(8 + field);
  if ((int64_t)len > size - *hdr_off)
    return mtrain_error(MTRAIN_ERR_FORMAT,
                        "%s: byte offset 8: header length %u runs past the end of the file "
                        "(header starts at byte offset %lld, file size %lld)",
                        path, len, (long long)*hdr_off, (long long)size);
  *hdr_len = len;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t read_header(FILE *f, const char *path, int64_t size, npy_header_t *h,
                                   int64_t *data_off) {
  int64_t hdr_off = 0;
  uint32_t hdr_len = 0;
  mtrain_status_t st = read_preamble(f, path, size, &hdr_off, &hdr_len);
  if (st != MTRAIN_SUCCESS) return st;
  char *text = malloc(hdr_len ? hdr_len : 1);
  if (!text)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory for the header", path);
  st = read_at(f, path, text, hdr_len, hdr_off);
  if (st == MTRAIN_SUCCESS) {
    hdr_parser_t p = {path, text, hdr_len, 0, hdr_off};
    st = parse_header(&p, h);
  }
  free(text);
  *data_off = hdr_off + (int64_t)hdr_len;
  return st;
}

/* Checks that the file holds exactly the data the header describes. */
static mtrain_status_t check_data_size(const char *path, const npy_header_t *h, int64_t size,
                                       int64_t data_off, int64_t *bytes) {
  char shape[128];
  shape_text(h->shape, h->ndim, shape, sizeof shape);
  size_t width = mtrain_dtype_size(h->dtype);
  /* the extents of a non-empty array are bounded by the data they need,
   * which the file must hold; those of an empty array (an extent 0) by the
   * same rule on its non-zero extents, so that they stay addressable too */
  const int64_t numel = shape_numel(h->shape, h->ndim);
  int64_t nonzero = 1;
  for (int32_t d = 0; numel >= 0 && d < h->ndim; d++)
    if (h->shape[d] > 0) nonzero *= h->shape[d]; /* fits: shape_numel checked it */
  *bytes = data_bytes(numel, width);
  if (*bytes < 0 || data_bytes(nonzero, width) < 0)
    return mtrain_error(MTRAIN_ERR_FORMAT,
                        "%s: header key 'shape' (byte offset %lld): shape %s of %zu-byte elements "
                        "overflows the addressable size",
                        path, (long long)h->shape_offset, shape, width);
  int64_t avail = size - data_off;
  if (avail < *bytes)
    return mtrain_error(MTRAIN_ERR_FORMAT,
                        "%s: data truncated: shape %s of %zu-byte elements needs %lld bytes from "
                        "byte offset %lld, but the file ends after %lld (file size %lld)",
                        path, shape, width, (long long)*bytes, (long long)data_off,
                        (long long)avail, (long long)size);
  if (avail > *bytes)
    return mtrain_error(MTRAIN_ERR_FORMAT,
                        "%s: %lld trailing bytes after the data at byte offset %lld (shape %s "
                        "needs %lld bytes, file size %lld)",
                        path, (long long)(avail - *bytes), (long long)(data_off + *bytes), shape,
                        (long long)*bytes, (long long)size);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t read_file(FILE *f, const char *path, mtrain_npy_t *out) {
  int64_t size = 0, data_off = 0, bytes = 0;
  npy_header_t h;
  memset(&h, 0, sizeof h);
  mtrain_status_t st = file_size(f, path, &size);
  if (st == MTRAIN_SUCCESS) st = read_header(f, path, size, &h, &data_off);
  if (st == MTRAIN_SUCCESS) st = check_data_size(path, &h, size, data_off, &bytes);
  if (st != MTRAIN_SUCCESS) return st;
  void *data = malloc(bytes ? (size_t)bytes : 1);
  if (!data)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory for %lld bytes of data", path,
                        (long long)bytes);
  st = read_at(f, path, data, (size_t)bytes, data_off);
  if (st != MTRAIN_SUCCESS) {
    free(data);
    return st;
  }
  size_t width = mtrain_dtype_size(h.dtype);
  if (host_is_big_endian()) swap_bytes(data, bytes / (int64_t)width, width);
  memset(out, 0, sizeof *out);
  out->tensor.data = data;
  out->tensor.dtype = h.dtype;
  out->tensor.ndim = h.ndim;
  memcpy(out->tensor.shape, h.shape, sizeof h.shape);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_npy_read(const char *path, mtrain_npy_t *out) {
  MTRAIN_CHECK_NOT_NULL(path);
  MTRAIN_CHECK_NOT_NULL(out);
  FILE *f = fopen(path, "rb");
  if (!f) return mtrain_io_error(path, "cannot open for reading", errno);
  mtrain_npy_t result;
  mtrain_status_t st = read_file(f, path, &result);
  fclose(f); /* read-only stream: nothing to lose */
  if (st == MTRAIN_SUCCESS) *out = result;
  return st;
}

static mtrain_status_t check_expected_shape(const char *path, const mtrain_tensor_t *t,
                                            int32_t ndim, const int64_t *expect_shape) {
  char shape[128];
  shape_text(t->shape, t->ndim, shape, sizeof shape);
  if (t->ndim != ndim)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "%s: has %d dimensions (shape %s), expected %d",
                        path, t->ndim, shape, ndim);
  /* a tensor for the API has no empty dimension: refused here, before any
   * caller loops over the extents of an array that holds nothing */
  for (int32_t d = 0; d < ndim; d++)
    if (t->shape[d] < 1)
      return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                          "%s: dimension %d is %lld (shape %s, no data): every dimension of a "
                          "tensor must be at least 1",
                          path, d, (long long)t->shape[d], shape);
  for (int32_t d = 0; expect_shape && d < ndim; d++)
    if (expect_shape[d] >= 0 && t->shape[d] != expect_shape[d])
      return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "%s: dimension %d is %lld, expected %lld",
                          path, d, (long long)t->shape[d], (long long)expect_shape[d]);
  return MTRAIN_SUCCESS;
}

/* Replaces npy's data by its conversion to `dtype`. */
static mtrain_status_t convert_in_place(const char *path, mtrain_npy_t *npy, mtrain_dtype_t dtype) {
  mtrain_tensor_t *t = &npy->tensor;
  if (t->dtype == dtype) return MTRAIN_SUCCESS;
  int64_t numel = shape_numel(t->shape, t->ndim);
  int64_t bytes = data_bytes(numel, mtrain_dtype_size(dtype));
  if (bytes < 0)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "%s: %lld elements as %s overflow memory", path,
                        (long long)numel, mtrain_dtype_name(dtype));
  void *data = malloc(bytes ? (size_t)bytes : 1);
  if (!data)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory converting to %s", path,
                        mtrain_dtype_name(dtype));
  mtrain_status_t st =
      numel ? mtrain_convert(t->data, t->dtype, data, dtype, numel) : MTRAIN_SUCCESS;
  if (st != MTRAIN_SUCCESS) {
    free(data);
    return mtrain_error_prefix(st, "%s: converting %s to %s", path, mtrain_dtype_name(t->dtype),
                               mtrain_dtype_name(dtype));
  }
  free(t->data);
  t->data = data;
  t->dtype = dtype;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_npy_read_as(const char *path, mtrain_dtype_t dtype, int32_t ndim,
                                   const int64_t *expect_shape, mtrain_npy_t *out) {
  MTRAIN_CHECK_NOT_NULL(path);
  MTRAIN_CHECK_NOT_NULL(out);
  if (mtrain_dtype_size(dtype) == 0)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "%s: unknown target dtype %d", path,
                        (int)dtype);
  if (ndim < 1 || ndim > MTRAIN_MAX_DIMS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: expected ndim %d out of range [1, %d]",
                        path, ndim, MTRAIN_MAX_DIMS);
  mtrain_npy_t npy;
  mtrain_status_t st = mtrain_npy_read(path, &npy);
  if (st != MTRAIN_SUCCESS) return st;
  st = check_expected_shape(path, &npy.tensor, ndim, expect_shape);
  if (st == MTRAIN_SUCCESS) st = convert_in_place(path, &npy, dtype);
  if (st != MTRAIN_SUCCESS) {
    mtrain_npy_free(&npy);
    return st;
  }
  *out = npy;
  return MTRAIN_SUCCESS;
}

void mtrain_npy_free(mtrain_npy_t *npy) {
  if (!npy) return;
  free(npy->tensor.data);
  memset(npy, 0, sizeof *npy);
}

/* ------------------------------------------------------------------------ */
/* Writing                                                                   */
/* ------------------------------------------------------------------------ */

static mtrain_status_t check_tensor(const char *path, const mtrain_tensor_t *t, int64_t *numel) {
  if (!npy_descr(t->dtype) || mtrain_dtype_size(t->dtype) == 0)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "%s: cannot write dtype %d", path,
                        (int)t->dtype);
  if (t->ndim < 1 || t->ndim > MTRAIN_MAX_DIMS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: tensor ndim %d out of range [1, %d]",
                        path, t->ndim, MTRAIN_MAX_DIMS);
  for (int32_t d = 0; d < t->ndim; d++)
    if (t->shape[d] < 0)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: tensor dimension %d is negative (%lld)",
                          path, d, (long long)t->shape[d]);
  *numel = shape_numel(t->shape, t->ndim);
  if (data_bytes(*numel, 8) < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "%s: tensor size overflows", path);
  if (*numel > 0 && !t->data)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: tensor data is NULL", path);
  return MTRAIN_SUCCESS;
}

/* Preamble + header of format 1.0, padded with spaces and ended by '\n' to a
 * multiple of NPY_ALIGN bytes; returns its length. */
static size_t format_header(const mtrain_tensor_t *t, char *buf, size_t cap) {
  char shape[128];
  shape_text(t->shape, t->ndim, shape, sizeof shape);
  size_t n =
      (size_t)snprintf(buf + 10, cap - 10, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                       npy_descr(t->dtype), shape);
  size_t total = (10 + n + 1 + NPY_ALIGN - 1) / NPY_ALIGN * NPY_ALIGN;
  memset(buf + 10 + n, ' ', total - 10 - n - 1);
  buf[total - 1] = '\n';
  size_t hlen = total - 10;
  memcpy(buf, NPY_MAGIC, NPY_MAGIC_LEN);
  buf[6] = 1;
  buf[7] = 0;
  buf[8] = (char)(hlen & 0xff);
  buf[9] = (char)(hlen >> 8);
  return total;
}

/* Writes the elements through a staging buffer (BF16 widening, byte swap on
 * big-endian hosts). */
static mtrain_status_t write_staged(FILE *f, const char *path, const mtrain_tensor_t *t,
                                    int64_t numel) {
  mtrain_dtype_t out_dtype = t->dtype == MTRAIN_BF16 ? MTRAIN_F32 : t->dtype;
  size_t in_w = mtrain_dtype_size(t->dtype), out_w = mtrain_dtype_size(out_dtype);
  unsigned char *stage = malloc(NPY_STAGE_ELEMS * out_w);
  if (!stage) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (int64_t e = 0; e < numel && st == MTRAIN_SUCCESS; e += NPY_STAGE_ELEMS) {
    int64_t n = numel - e < NPY_STAGE_ELEMS ? numel - e : NPY_STAGE_ELEMS;
    const unsigned char *src = (const unsigned char *)t->data + (size_t)e * in_w;
    if (out_dtype != t->dtype)
      st = mtrain_convert(src, t->dtype, stage, out_dtype, n);
    else
      memcpy(stage, src, (size_t)n * in_w);
    if (st != MTRAIN_SUCCESS) {
      st = mtrain_error_prefix(st, "%s: widening bf16 to float32", path);
      break;
    }
    if (host_is_big_endian()) swap_bytes(stage, n, out_w);
    if (fwrite(stage, out_w, (size_t)n, f) != (size_t)n)
      st = mtrain_io_error(path, "write failed", errno);
  }
  free(stage);
  return st;
}

static mtrain_status_t write_file(FILE *f, const char *path, const mtrain_tensor_t *t,
                                  int64_t numel) {
  char header[256];
  size_t len = format_header(t, header, sizeof header);
  if (fwrite(header, 1, len, f) != len) return mtrain_io_error(path, "write failed", errno);
  if (t->dtype == MTRAIN_BF16 || host_is_big_endian()) return write_staged(f, path, t, numel);
  size_t bytes = (size_t)numel * mtrain_dtype_size(t->dtype);
  if (bytes && fwrite(t->data, 1, bytes, f) != bytes)
    return mtrain_io_error(path, "write failed", errno);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_npy_write(const char *path, const mtrain_tensor_t *tensor) {
  MTRAIN_CHECK_NOT_NULL(path);
  MTRAIN_CHECK_NOT_NULL(tensor);
  int64_t numel = 0;
  mtrain_status_t st = check_tensor(path, tensor, &numel);
  if (st != MTRAIN_SUCCESS) return st;
  FILE *f = fopen(path, "wb");
  if (!f) return mtrain_io_error(path, "cannot open for writing", errno);
  st = write_file(f, path, tensor, numel);
  if (fclose(f) != 0 && st == MTRAIN_SUCCESS) st = mtrain_io_error(path, "closing failed", errno);
  return st;
}
