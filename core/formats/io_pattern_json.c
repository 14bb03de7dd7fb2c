/* io_pattern_json.c: the pattern JSON of SPEC.md section 8, read with jansson
 * and written by hand (one head per line, integers exact):
 *   {"granularity": G, "seq_len": N, "heads": [
 *     {"diagonals": [0, 1, 7], "verticals": [0, 1, 2, 4100]},
 *     {"block_mask": [[0, 0], [1, 0], [1, 1]]}]}
 * "diagonals" may be absent (only diagonal 0), "verticals" may be absent
 * (none). An optional top-level "causal": false makes a non-causal pattern
 * (block-mask heads only, pairs above the diagonal allowed). Unknown keys, at the top level and in
 * heads, are rejected so that typos are not silently ignored. Messages name the origin, the place
 * ("heads[3].verticals[7]") and the reason. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/file_io.h"
#include "core/formats/json_util.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_io.h"

/* ------------------------------------------------------------------------ */
/* Reading                                                                   */
/* ------------------------------------------------------------------------ */

/* Where an error is: origin and head (-1 for the top level). */
typedef struct json_ctx {
  const char *origin;
  int32_t head;
} json_ctx_t;

/* Error at a place: "<origin>: heads[h].<place>: reason" (or "<origin>:
 * <place>: reason" at the top level). */
static mtrain_status_t fail_at(const json_ctx_t *c, mtrain_status_t st, const char *place,
                               const char *fmt, ...) MTRAIN_PRINTF(4, 5);
static mtrain_status_t fail_at(const json_ctx_t *c, mtrain_status_t st, const char *place,
                               const char *fmt, ...) {
  char reason[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(reason, sizeof reason, fmt, ap);
  va_end(ap);
  if (c->head < 0) return mtrain_error(st, "%s: %s: %s", c->origin, place, reason);
  return mtrain_error(st, "%s: heads[%d]%s%s: %s", c->origin, c->head, place[0] ? "." : "", place,
                      reason);
}

/* Rejects keys of `obj` not in the NULL-terminated list `allowed`. */
static mtrain_status_t check_keys(const json_ctx_t *c, const json_t *obj, const char *place,
                                  const char *const *allowed, const char *allowed_text) {
  const char *key;
  json_t *value;
  json_object_foreach((json_t *)obj, key, value) {
    (void)value;
    int ok = 0;
    for (const char *const *a = allowed; *a && !ok; a++) ok = strcmp(key, *a) == 0;
    if (!ok)
      return fail_at(c, MTRAIN_ERR_FORMAT, place, "unknown key '%s' (allowed: %s)", key,
                     allowed_text);
  }
  return MTRAIN_SUCCESS;
}

/* A required integer member of the top-level object, in [lo, hi]. */
static mtrain_status_t get_top_int(const json_ctx_t *c, const json_t *root, const char *key,
                                   json_int_t lo, json_int_t hi, json_int_t *out) {
  const json_t *v = json_object_get(root, key);
  if (!v) return mtrain_error(MTRAIN_ERR_FORMAT, "%s: missing key '%s'", c->origin, key);
  if (!json_is_integer(v))
    return fail_at(c, MTRAIN_ERR_FORMAT, key, "expected an integer, found %s",
                   mtrain_json_type_name(v));
  json_int_t x = json_integer_value(v);
  if (x < lo || x > hi)
    return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, key, "%lld out of range [%lld, %lld]",
                   (long long)x, (long long)lo, (long long)hi);
  *out = x;
  return MTRAIN_SUCCESS;
}

/* An array of integers (copied to a malloc'ed int64 array, at least one
 * element allocated). */
static mtrain_status_t get_int_array(const json_ctx_t *c, const json_t *arr, const char *key,
                                     int64_t **vals, int32_t *count) {
  char place[96];
  if (!json_is_array(arr))
    return fail_at(c, MTRAIN_ERR_FORMAT, key, "expected an array, found %s",
                   mtrain_json_type_name(arr));
  size_t n = json_array_size(arr);
  if (n > INT32_MAX)
    return fail_at(c, MTRAIN_ERR_FORMAT, key, "%zu entries, more than 2^31 - 1", n);
  int64_t *v = malloc((n ? n : 1) * sizeof *v);
  if (!v) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory", c->origin);
  for (size_t i = 0; i < n; i++) {
    const json_t *e = json_array_get(arr, i);
    if (!json_is_integer(e)) {
      free(v);
      snprintf(place, sizeof place, "%s[%zu]", key, i);
      return fail_at(c, MTRAIN_ERR_FORMAT, place, "expected an integer, found %s",
                     mtrain_json_type_name(e));
    }
    v[i] = (int64_t)json_integer_value(e);
  }
  *vals = v;
  *count = (int32_t)n;
  return MTRAIN_SUCCESS;
}

/* Narrows diagonals to int32; values beyond int32 are out of range [0, nb). */
static mtrain_status_t narrow_diagonals(const json_ctx_t *c, const int64_t *wide, int32_t n,
                                        int64_t nb, int32_t *out) {
  char place[64];
  for (int32_t i = 0; i < n; i++) {
    if (wide[i] < INT32_MIN || wide[i] > INT32_MAX) {
      snprintf(place, sizeof place, "diagonals[%d]", i);
      return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, place,
                     "%lld does not fit in 32 bits (block diagonals lie in [0, %lld))",
                     (long long)wide[i], (long long)nb);
    }
    out[i] = (int32_t)wide[i];
  }
  return MTRAIN_SUCCESS;
}

/* A vertical-slash head: optional "diagonals" and "verticals". */
static mtrain_status_t parse_vs_head(const json_ctx_t *c, const json_t *obj, mtrain_pattern_t *p) {
  const json_t *jd = json_object_get(obj, "diagonals");
  const json_t *jv = json_object_get(obj, "verticals");
  int64_t *wide = NULL, *verts = NULL;
  int32_t *diags = NULL;
  int32_t nd = 0, nv = 0;
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (jd) MTRAIN_TRY(get_int_array(c, jd, "diagonals", &wide, &nd));
  if (jv) MTRAIN_TRY(get_int_array(c, jv, "verticals", &verts, &nv));
  diags = malloc((nd ? (size_t)nd : 1) * sizeof *diags);
  MTRAIN_FAIL_IF(!diags, MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory", c->origin);
  MTRAIN_TRY(narrow_diagonals(c, wide, nd, p->num_blocks, diags));
  st = mtrain_pattern_set_head(p, c->head, diags, nd, verts, nv);
  if (st != MTRAIN_SUCCESS) st = mtrain_error_prefix(st, "%s: heads[%d]", c->origin, c->head);
cleanup:
  free(wide);
  free(verts);
  free(diags);
  return st;
}

/* Entry i of a block mask: a [qb, kb] pair with 0 <= kb <= qb < nb (kb < nb
 * when not causal), after the previous pair (prev[0], prev[1]) in (qb, kb)
 * order. */
static mtrain_status_t get_block_pair(const json_ctx_t *c, const json_t *arr, size_t i, int64_t nb,
                                      int causal, const int64_t *prev, int64_t *pair) {
  char place[64];
  snprintf(place, sizeof place, "block_mask[%zu]", i);
  const json_t *e = json_array_get(arr, i);
  if (!json_is_array(e))
    return fail_at(c, MTRAIN_ERR_FORMAT, place,
                   "expected a [query_block, key_block] pair, found %s", mtrain_json_type_name(e));
  if (json_array_size(e) != 2)
    return fail_at(c, MTRAIN_ERR_FORMAT, place,
                   "expected a [query_block, key_block] pair, found an array of %zu entries",
                   json_array_size(e));
  for (size_t k = 0; k < 2; k++)
    if (!json_is_integer(json_array_get(e, k)))
      return fail_at(c, MTRAIN_ERR_FORMAT, place, "entry %zu: expected an integer, found %s", k,
                     mtrain_json_type_name(json_array_get(e, k)));
  pair[0] = (int64_t)json_integer_value(json_array_get(e, 0));
  pair[1] = (int64_t)json_integer_value(json_array_get(e, 1));
  if (pair[0] < 0 || pair[0] >= nb)
    return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, place, "query block %lld out of range [0, %lld)",
                   (long long)pair[0], (long long)nb);
  if (causal && (pair[1] < 0 || pair[1] > pair[0]))
    return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, place,
                   "key block %lld out of range [0, %lld] (causal: key block <= query block)",
                   (long long)pair[1], (long long)pair[0]);
  if (!causal && (pair[1] < 0 || pair[1] >= nb))
    return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, place, "key block %lld out of range [0, %lld)",
                   (long long)pair[1], (long long)nb);
  if (prev && (pair[0] < prev[0] || (pair[0] == prev[0] && pair[1] <= prev[1])))
    return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, place,
                   "[%lld, %lld] after [%lld, %lld]: pairs must be sorted by query block then "
                   "key block, without duplicates",
                   (long long)pair[0], (long long)pair[1], (long long)prev[0], (long long)prev[1]);
  return MTRAIN_SUCCESS;
}

/* A block-mask head: "block_mask" as sorted pairs, turned into CSR. */
static mtrain_status_t parse_mask_head(const json_ctx_t *c, const json_t *arr,
                                       mtrain_pattern_t *p) {
  if (!json_is_array(arr))
    return fail_at(c, MTRAIN_ERR_FORMAT, "block_mask", "expected an array, found %s",
                   mtrain_json_type_name(arr));
  int64_t nb = p->num_blocks;
  if (nb > MTRAIN_PATTERN_MAX_MASK_BLOCKS)
    return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, "block_mask",
                   "a block mask takes memory in proportion to its %lld query blocks (seq_len / "
                   "granularity), more than the 2^24 supported; use a larger granularity or "
                   "vertical-slash heads",
                   (long long)nb);
  size_t n = json_array_size(arr);
  int64_t *off = calloc((size_t)nb + 1, sizeof *off);
  int32_t *idx = malloc((n ? n : 1) * sizeof *idx);
  int64_t pair[2] = {0, 0}, prev[2] = {0, 0};
  mtrain_status_t st = MTRAIN_SUCCESS;
  MTRAIN_FAIL_IF(!off || !idx, MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory", c->origin);
  for (size_t i = 0; i < n; i++) {
    MTRAIN_TRY(get_block_pair(c, arr, i, nb, p->causal, i ? prev : NULL, pair));
    off[pair[0] + 1]++;
    idx[i] = (int32_t)pair[1];
    prev[0] = pair[0];
    prev[1] = pair[1];
  }
  for (int64_t qb = 0; qb < nb; qb++) off[qb + 1] += off[qb];
  st = mtrain_pattern_set_block_csr(p, c->head, off, idx);
  if (st != MTRAIN_SUCCESS) st = mtrain_error_prefix(st, "%s: heads[%d]", c->origin, c->head);
cleanup:
  free(off);
  free(idx);
  return st;
}

static mtrain_status_t parse_head(const json_ctx_t *c, const json_t *obj, mtrain_pattern_t *p) {
  static const char *const allowed[] = {"diagonals", "verticals", "block_mask", NULL};
  if (!json_is_object(obj))
    return fail_at(c, MTRAIN_ERR_FORMAT, "", "expected an object, found %s",
                   mtrain_json_type_name(obj));
  mtrain_status_t st = check_keys(c, obj, "", allowed, "'diagonals', 'verticals', 'block_mask'");
  if (st != MTRAIN_SUCCESS) return st;
  const json_t *mask = json_object_get(obj, "block_mask");
  if (!mask && !p->causal)
    return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, "",
                   "a non-causal pattern (\"causal\": false) holds block-mask heads only; "
                   "this head has no 'block_mask'");
  if (!mask) return parse_vs_head(c, obj, p);
  if (json_object_get(obj, "diagonals") || json_object_get(obj, "verticals"))
    return fail_at(c, MTRAIN_ERR_FORMAT, "block_mask",
                   "cannot be combined with 'diagonals' or 'verticals'");
  return parse_mask_head(c, mask, p);
}

/* Most query-block rows that the block-mask heads of one pattern file may hold
 * together (every head of a non-causal file): 2^22, e.g. 32 heads of 131072
 * blocks (8M tokens at G = 64). A block mask takes memory and time in
 * proportion to its query blocks, so a file of a few bytes must not ask for
 * gigabytes or minutes. */
#define PATTERN_FILE_MAX_MASK_ROWS ((int64_t)1 << 22)

/* Checked before the pattern is made: the block-mask heads' rows against the
 * limit above, and in a non-causal file that every head is a block mask (the
 * error parse_head would give, without allocating the pattern first). */
static mtrain_status_t check_mask_budget(const json_ctx_t *c, const json_t *heads, int noncausal,
                                         int64_t seq_len, int64_t granularity) {
  int64_t nb = (seq_len + granularity - 1) / granularity;
  int64_t mask_heads = 0;
  for (size_t h = 0; h < json_array_size(heads); h++) {
    const json_t *head = json_array_get(heads, h);
    const int is_mask = json_is_object(head) && json_object_get(head, "block_mask");
    if (noncausal && !is_mask) {
      json_ctx_t at = {c->origin, (int32_t)h};
      if (!json_is_object(head))
        return fail_at(&at, MTRAIN_ERR_FORMAT, "", "expected an object, found %s",
                       mtrain_json_type_name(head));
      return fail_at(&at, MTRAIN_ERR_INVALID_PATTERN, "",
                     "a non-causal pattern (\"causal\": false) holds block-mask heads only; "
                     "this head has no 'block_mask'");
    }
    mask_heads += noncausal || is_mask;
  }
  if (mask_heads == 0 || nb <= PATTERN_FILE_MAX_MASK_ROWS / mask_heads) return MTRAIN_SUCCESS;
  return fail_at(c, MTRAIN_ERR_INVALID_PATTERN, "heads",
                 "%lld block-mask heads of %lld query blocks each (seq_len / granularity): a "
                 "block mask takes memory and time in proportion to its query blocks, and a "
                 "pattern file may hold 2^22 of them over all heads; use a larger granularity "
                 "or vertical-slash heads",
                 (long long)mask_heads, (long long)nb);
}

/* Checks the top level and creates the pattern (heads still empty). */
static mtrain_status_t parse_top(const json_ctx_t *c, const json_t *root, const json_t **heads,
                                 mtrain_pattern_t **out) {
  static const char *const allowed[] = {"granularity", "seq_len", "heads", "causal", NULL};
  if (!json_is_object(root))
    return mtrain_error(MTRAIN_ERR_FORMAT, "%s: top level: expected an object, found %s", c->origin,
                        mtrain_json_type_name(root));
  mtrain_status_t st =
      check_keys(c, root, "top level", allowed, "'granularity', 'seq_len', 'heads', 'causal'");
  json_int_t g = 0, n = 0;
  if (st == MTRAIN_SUCCESS) st = get_top_int(c, root, "granularity", 1, INT32_MAX, &g);
  if (st == MTRAIN_SUCCESS) st = get_top_int(c, root, "seq_len", 1, INT64_MAX, &n);
  if (st != MTRAIN_SUCCESS) return st;
  *heads = json_object_get(root, "heads");
  if (!*heads) return mtrain_error(MTRAIN_ERR_FORMAT, "%s: missing key 'heads'", c->origin);
  if (!json_is_array(*heads))
    return fail_at(c, MTRAIN_ERR_FORMAT, "heads", "expected an array, found %s",
                   mtrain_json_type_name(*heads));
  size_t nh = json_array_size(*heads);
  if (nh == 0)
    return fail_at(c, MTRAIN_ERR_FORMAT, "heads",
                   "empty array (a pattern needs at least one head)");
  if (nh > INT32_MAX)
    return fail_at(c, MTRAIN_ERR_FORMAT, "heads", "%zu heads, more than 2^31 - 1", nh);
  const json_t *causal = json_object_get(root, "causal");
  if (causal && !json_is_boolean(causal))
    return fail_at(c, MTRAIN_ERR_FORMAT, "causal", "expected true or false, found %s",
                   mtrain_json_type_name(causal));
  st = check_mask_budget(c, *heads, causal && json_is_false(causal), (int64_t)n, (int64_t)g);
  if (st != MTRAIN_SUCCESS) return st;
  st = causal && json_is_false(causal)
           ? mtrain_pattern_create_noncausal((int64_t)n, (int32_t)nh, (int32_t)g, out)
           : mtrain_pattern_create((int64_t)n, (int32_t)nh, (int32_t)g, out);
  if (st == MTRAIN_ERR_INVALID_ARGUMENT)
    return mtrain_error_prefix(MTRAIN_ERR_INVALID_PATTERN, "%s", c->origin);
  return st;
}

static mtrain_status_t parse_root(const json_t *root, const char *origin, mtrain_pattern_t **out) {
  json_ctx_t c = {origin, -1};
  const json_t *heads = NULL;
  mtrain_pattern_t *p = NULL;
  mtrain_status_t st = parse_top(&c, root, &heads, &p);
  for (size_t h = 0; st == MTRAIN_SUCCESS && h < json_array_size(heads); h++) {
    c.head = (int32_t)h;
    st = parse_head(&c, json_array_get(heads, h), p);
  }
  if (st != MTRAIN_SUCCESS) {
    mtrain_pattern_destroy(p);
    return st;
  }
  *out = p;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t syntax_error(const char *origin, const json_error_t *err) {
  return mtrain_error(MTRAIN_ERR_FORMAT, "%s: JSON syntax error at line %d, column %d: %s", origin,
                      err->line, err->column, err->text);
}

mtrain_status_t mtrain_pattern_parse_json(const char *text, const char *origin,
                                          mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(text);
  MTRAIN_CHECK_NOT_NULL(out);
  if (!origin) origin = "<string>";
  json_error_t err;
  json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &err);
  if (!root) return syntax_error(origin, &err);
  mtrain_status_t st = parse_root(root, origin, out);
  json_decref(root);
  return st;
}

mtrain_status_t mtrain_pattern_read_json(const char *path, mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(path);
  MTRAIN_CHECK_NOT_NULL(out);
  char *text = NULL;
  size_t len = 0;
  mtrain_status_t st = mtrain_read_file(path, &text, &len);
  if (st != MTRAIN_SUCCESS) return st;
  json_error_t err;
  json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &err);
  free(text);
  if (!root) return syntax_error(path, &err);
  st = parse_root(root, path, out);
  json_decref(root);
  return st;
}

/* ------------------------------------------------------------------------ */
/* Writing                                                                   */
/* ------------------------------------------------------------------------ */

/* A FILE with a sticky error: after the first failure nothing more is written
 * and `err` keeps its errno. */
typedef struct writer {
  FILE *f;
  int failed;
  int err;
} writer_t;

static void put(writer_t *w, const char *fmt, ...) MTRAIN_PRINTF(2, 3);
static void put(writer_t *w, const char *fmt, ...) {
  if (w->failed) return;
  va_list ap;
  va_start(ap, fmt);
  int r = vfprintf(w->f, fmt, ap);
  va_end(ap);
  if (r < 0) {
    w->failed = 1;
    w->err = errno;
  }
}

static void put_vs_head(writer_t *w, const mtrain_pattern_head_t *h) {
  put(w, "{\"diagonals\": [");
  for (int32_t i = 0; i < h->num_diagonals; i++) put(w, i ? ", %d" : "%d", h->diagonals[i]);
  put(w, "], \"verticals\": [");
  for (int32_t i = 0; i < h->num_verticals; i++)
    put(w, i ? ", %lld" : "%lld", (long long)h->verticals[i]);
  put(w, "]}");
}

static void put_mask_head(writer_t *w, const mtrain_pattern_head_t *h, int64_t nb) {
  put(w, "{\"block_mask\": [");
  int first = 1;
  for (int64_t qb = 0; qb < nb; qb++)
    for (int64_t e = h->mask_off[qb]; e < h->mask_off[qb + 1]; e++, first = 0)
      put(w, first ? "[%lld, %d]" : ", [%lld, %d]", (long long)qb, h->mask_idx[e]);
  put(w, "]}");
}

static void put_pattern(writer_t *w, const mtrain_pattern_t *p) {
  put(w, "{\"granularity\": %d, \"seq_len\": %lld, %s\"heads\": [\n", p->granularity,
      (long long)p->seq_len, p->causal ? "" : "\"causal\": false, ");
  for (int32_t h = 0; h < p->num_heads; h++) {
    put(w, "  ");
    if (p->heads[h].mask_off)
      put_mask_head(w, &p->heads[h], p->num_blocks);
    else
      put_vs_head(w, &p->heads[h]);
    put(w, h + 1 < p->num_heads ? ",\n" : "\n");
  }
  put(w, "]}\n");
}

mtrain_status_t mtrain_pattern_write_json(const char *path, const mtrain_pattern_t *pattern) {
  MTRAIN_CHECK_NOT_NULL(path);
  MTRAIN_CHECK_NOT_NULL(pattern);
  writer_t w = {fopen(path, "w"), 0, 0};
  if (!w.f) return mtrain_io_error(path, "cannot open for writing", errno);
  put_pattern(&w, pattern);
  if (!w.failed && ferror(w.f)) {
    w.failed = 1;
    w.err = errno;
  }
  if (fclose(w.f) != 0 && !w.failed) {
    w.failed = 1;
    w.err = errno;
  }
  if (!w.failed) return MTRAIN_SUCCESS;
  return mtrain_io_error(path, "write failed", w.err);
}
