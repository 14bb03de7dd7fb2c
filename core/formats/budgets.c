/* budgets.c: per-head sparse budgets in the MInference JSON format (SPEC.md
 * sections 2 and 8), read with jansson. The file is a list with one object per
 * layer, mapping the head index ("0".."H-1", each exactly once) to
 *   ["vertical_and_slash", v_size, s_size, score]                 (top-k)
 *   ["flex_vertical_and_slash", [p_v, cap_v], [p_s, cap_s], score] (top-p)
 * The score is informational: it must be a number and is not kept. Layers may
 * have different head counts. Messages name the origin, the place
 * ("layer 3, head \"7\"[1]") and the reason; shape and type errors are
 * MTRAIN_ERR_FORMAT, values out of range MTRAIN_ERR_INVALID_BUDGET.
 * mtrain_head_budget_validate() checks one budget's values. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/formats/file_io.h"
#include "core/formats/json_util.h"
#include "mtrain/mtrain_error.h"

/* Sizes and caps beyond this are rejected (no sequence is that long). */
#define BUDGET_SIZE_MAX ((int64_t)1 << 40)

#define KIND_TOP_K "vertical_and_slash"
#define KIND_TOP_P "flex_vertical_and_slash"

struct mtrain_budgets {
  int32_t num_layers;
  int32_t *num_heads;          /* per layer */
  int64_t *first;              /* per layer: index of its head 0 in `heads` */
  mtrain_head_budget_t *heads; /* all heads, layer by layer */
};

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

/* A double in the fewest digits that read back exactly (up to 17). */
static void format_double(double x, char *buf, size_t cap) {
  for (int prec = 6; prec <= 17; prec++) {
    snprintf(buf, cap, "%.*g", prec, x);
    if (isnan(x) || strtod(buf, NULL) == x) return;
  }
}

/* ------------------------------------------------------------------------ */
/* Reading                                                                   */
/* ------------------------------------------------------------------------ */

static int p_ok(double p) { return p > 0.0 && p <= 1.0; } /* false for NaN */

/* Where an error is: origin, layer (-1: top level), head key (NULL: the
 * layer itself). */
typedef struct json_ctx {
  const char *origin;
  int32_t layer;
  const char *head;
} json_ctx_t;

/* Error at a place: "<origin>: layer L, head \"k\"<sub>: reason", or
 * "<origin>: layer L: reason", or "<origin>: top level: reason". `sub` is an
 * element path such as "[1][0]" (may be ""). */
static mtrain_status_t fail_at(const json_ctx_t *c, mtrain_status_t st, const char *sub,
                               const char *fmt, ...) MTRAIN_PRINTF(4, 5);
static mtrain_status_t fail_at(const json_ctx_t *c, mtrain_status_t st, const char *sub,
                               const char *fmt, ...) {
  char reason[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(reason, sizeof reason, fmt, ap);
  va_end(ap);
  if (c->layer < 0) return mtrain_error(st, "%s: top level: %s", c->origin, reason);
  if (!c->head) return mtrain_error(st, "%s: layer %d: %s", c->origin, c->layer, reason);
  return mtrain_error(st, "%s: layer %d, head \"%s\"%s: %s", c->origin, c->layer, c->head, sub,
                      reason);
}

/* A size or cap: a JSON integer in [0, 2^40]. */
static mtrain_status_t get_size(const json_ctx_t *c, const json_t *v, const char *sub,
                                const char *what, int64_t *out) {
  if (!json_is_integer(v))
    return fail_at(c, MTRAIN_ERR_FORMAT, sub, "%s: expected a non-negative integer, found %s", what,
                   mtrain_json_type_name(v));
  json_int_t x = json_integer_value(v);
  if (x < 0)
    return fail_at(c, MTRAIN_ERR_INVALID_BUDGET, sub, "%s %lld is negative", what, (long long)x);
  if (x > BUDGET_SIZE_MAX)
    return fail_at(c, MTRAIN_ERR_INVALID_BUDGET, sub, "%s %lld is beyond 2^40 = %lld", what,
                   (long long)x, (long long)BUDGET_SIZE_MAX);
  *out = (int64_t)x;
  return MTRAIN_SUCCESS;
}

/* A top-p pair [p, cap] at entry element `idx` (1: verticals, 2: slashes). */
static mtrain_status_t get_top_p_pair(const json_ctx_t *c, const json_t *v, int idx,
                                      const char *p_name, const char *cap_name, double *p,
                                      int64_t *cap) {
  char sub[32], num[40];
  snprintf(sub, sizeof sub, "[%d]", idx);
  if (!json_is_array(v))
    return fail_at(c, MTRAIN_ERR_FORMAT, sub, "expected a [%s, %s] pair, found %s", p_name,
                   cap_name, mtrain_json_type_name(v));
  if (json_array_size(v) != 2)
    return fail_at(c, MTRAIN_ERR_FORMAT, sub,
                   "expected a [%s, %s] pair, found a list of %zu entries", p_name, cap_name,
                   json_array_size(v));
  const json_t *jp = json_array_get(v, 0);
  snprintf(sub, sizeof sub, "[%d][0]", idx);
  if (!json_is_number(jp))
    return fail_at(c, MTRAIN_ERR_FORMAT, sub, "%s: expected a number in (0, 1], found %s", p_name,
                   mtrain_json_type_name(jp));
  double x = json_number_value(jp);
  if (!p_ok(x)) {
    format_double(x, num, sizeof num);
    return fail_at(c, MTRAIN_ERR_INVALID_BUDGET, sub, "%s %s is not in (0, 1]", p_name, num);
  }
  snprintf(sub, sizeof sub, "[%d][1]", idx);
  mtrain_status_t st = get_size(c, json_array_get(v, 1), sub, cap_name, cap);
  if (st != MTRAIN_SUCCESS) return st;
  *p = x;
  return MTRAIN_SUCCESS;
}

/* One head's entry. Fields of the other kind are left zero. */
static mtrain_status_t parse_entry(const json_ctx_t *c, const json_t *e, mtrain_head_budget_t *b) {
  if (!json_is_array(e))
    return fail_at(c, MTRAIN_ERR_FORMAT, "",
                   "expected a list [kind, ..., score], found %s (kinds: '" KIND_TOP_K
                   "', '" KIND_TOP_P "')",
                   mtrain_json_type_name(e));
  if (json_array_size(e) != 4)
    return fail_at(c, MTRAIN_ERR_FORMAT, "",
                   "expected a list of 4 entries [kind, ..., score], found %zu entries",
                   json_array_size(e));
  const json_t *kind = json_array_get(e, 0);
  if (!json_is_string(kind))
    return fail_at(c, MTRAIN_ERR_FORMAT, "[0]",
                   "expected the kind string '" KIND_TOP_K "' or '" KIND_TOP_P "', found %s",
                   mtrain_json_type_name(kind));
  const json_t *score = json_array_get(e, 3);
  mtrain_head_budget_t r;
  memset(&r, 0, sizeof r);
  mtrain_status_t st;
  if (strcmp(json_string_value(kind), KIND_TOP_K) == 0) {
    r.kind = MTRAIN_BUDGET_TOP_K;
    st = get_size(c, json_array_get(e, 1), "[1]", "v_size", &r.v_size);
    if (st == MTRAIN_SUCCESS) st = get_size(c, json_array_get(e, 2), "[2]", "s_size", &r.s_size);
  } else if (strcmp(json_string_value(kind), KIND_TOP_P) == 0) {
    r.kind = MTRAIN_BUDGET_TOP_P;
    st = get_top_p_pair(c, json_array_get(e, 1), 1, "p_v", "cap_v", &r.p_v, &r.cap_v);
    if (st == MTRAIN_SUCCESS)
      st = get_top_p_pair(c, json_array_get(e, 2), 2, "p_s", "cap_s", &r.p_s, &r.cap_s);
  } else {
    return fail_at(c, MTRAIN_ERR_FORMAT, "[0]",
                   "unknown kind '%s' (known: '" KIND_TOP_K "', '" KIND_TOP_P "')",
                   json_string_value(kind));
  }
  if (st != MTRAIN_SUCCESS) return st;
  if (!json_is_number(score))
    return fail_at(c, MTRAIN_ERR_FORMAT, "[3]", "score: expected a number, found %s",
                   mtrain_json_type_name(score));
  *b = r;
  return MTRAIN_SUCCESS;
}

/* 1 when `key` is a decimal head index below `n` (n <= 2^31 - 1) without sign
 * or leading zeros. */
static int head_index(const char *key, size_t n) {
  size_t v = 0;
  if (key[0] == '\0' || (key[0] == '0' && key[1] != '\0')) return 0;
  for (const char *s = key; *s; s++) {
    if (*s < '0' || *s > '9') return 0;
    v = v * 10 + (size_t)(*s - '0'); /* v < n <= 2^31 before: no overflow */
    if (v >= n) return 0;
  }
  return 1;
}

/* Checks that the keys of layer `obj` (n >= 1 of them) are "0".."n-1", each
 * once (jansson already rejected duplicate keys). */
static mtrain_status_t check_head_keys(const json_ctx_t *c, const json_t *obj, size_t n) {
  const char *key;
  json_t *value;
  json_object_foreach((json_t *)obj, key, value) {
    (void)value;
    if (head_index(key, n)) continue;
    /* n distinct keys, one not in "0".."n-1": some index is missing. */
    char want[32];
    for (size_t i = 0; i < n; i++) {
      snprintf(want, sizeof want, "%zu", i);
      if (!json_object_get(obj, want))
        return fail_at(c, MTRAIN_ERR_FORMAT, "",
                       "key \"%s\" is not one of the head indices \"0\"..\"%zu\" (decimal, no "
                       "leading zeros, each exactly once in a layer of %zu heads): head \"%s\" "
                       "is missing",
                       key, n - 1, n, want);
    }
    return fail_at(c, MTRAIN_ERR_FORMAT, "",
                   "key \"%s\" is not one of the head indices \"0\"..\"%zu\"", key, n - 1);
  }
  return MTRAIN_SUCCESS;
}

/* One layer: heads go to b->heads from b->first[layer] on. */
static mtrain_status_t parse_layer(json_ctx_t *c, const json_t *obj, mtrain_budgets_t *b) {
  if (!json_is_object(obj))
    return fail_at(c, MTRAIN_ERR_FORMAT, "",
                   "expected an object mapping head indices to entries, found %s",
                   mtrain_json_type_name(obj));
  size_t n = json_object_size(obj);
  if (n == 0) return fail_at(c, MTRAIN_ERR_FORMAT, "", "empty object (a layer needs a head)");
  if (n > INT32_MAX) return fail_at(c, MTRAIN_ERR_FORMAT, "", "%zu heads, more than 2^31 - 1", n);
  mtrain_status_t st = check_head_keys(c, obj, n);
  if (st != MTRAIN_SUCCESS) return st;
  char key[32];
  mtrain_head_budget_t *out = b->heads + b->first[c->layer];
  for (size_t h = 0; h < n; h++) {
    snprintf(key, sizeof key, "%zu", h);
    c->head = key;
    const json_t *e = json_object_get(obj, key);
    if (!e) return fail_at(c, MTRAIN_ERR_FORMAT, "", "missing");
    st = parse_entry(c, e, &out[h]);
    if (st != MTRAIN_SUCCESS) return st;
  }
  c->head = NULL;
  b->num_heads[c->layer] = (int32_t)n;
  b->first[c->layer + 1] = b->first[c->layer] + (int64_t)n;
  return MTRAIN_SUCCESS;
}

/* Allocates the result for `nl` layers and at most `max_heads` heads. */
static mtrain_budgets_t *budgets_alloc(size_t nl, size_t max_heads) {
  mtrain_budgets_t *b = calloc(1, sizeof *b);
  if (!b) return NULL;
  b->num_heads = calloc(nl, sizeof *b->num_heads);
  b->first = calloc(nl + 1, sizeof *b->first);
  b->heads = calloc(max_heads ? max_heads : 1, sizeof *b->heads);
  if (!b->num_heads || !b->first || !b->heads) {
    mtrain_budgets_destroy(b);
    return NULL;
  }
  b->num_layers = (int32_t)nl;
  return b;
}

static mtrain_status_t parse_root(const json_t *root, const char *origin, mtrain_budgets_t **out) {
  json_ctx_t c = {origin, -1, NULL};
  if (!json_is_array(root))
    return fail_at(&c, MTRAIN_ERR_FORMAT, "", "expected a list with one object per layer, found %s",
                   mtrain_json_type_name(root));
  size_t nl = json_array_size(root);
  if (nl == 0)
    return fail_at(&c, MTRAIN_ERR_FORMAT, "", "empty list (a budget file needs a layer)");
  if (nl > INT32_MAX)
    return fail_at(&c, MTRAIN_ERR_FORMAT, "", "%zu layers, more than 2^31 - 1", nl);
  size_t max_heads = 0;
  for (size_t l = 0; l < nl; l++) {
    const json_t *layer = json_array_get(root, l);
    if (json_is_object(layer)) max_heads += json_object_size(layer);
  }
  mtrain_budgets_t *b = budgets_alloc(nl, max_heads);
  if (!b) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory", origin);
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (size_t l = 0; st == MTRAIN_SUCCESS && l < nl; l++) {
    c.layer = (int32_t)l;
    st = parse_layer(&c, json_array_get(root, l), b);
  }
  if (st != MTRAIN_SUCCESS) {
    mtrain_budgets_destroy(b);
    return st;
  }
  *out = b;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t syntax_error(const char *origin, const json_error_t *err) {
  return mtrain_error(MTRAIN_ERR_FORMAT, "%s: JSON syntax error at line %d, column %d: %s", origin,
                      err->line, err->column, err->text);
}

mtrain_status_t mtrain_budgets_parse(const char *text, const char *origin, mtrain_budgets_t **out) {
  MTRAIN_CHECK_NOT_NULL(text);
  MTRAIN_CHECK_NOT_NULL(out);
  if (!origin) origin = "<string>";
  json_error_t err;
  json_t *root = json_loads(text, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &err);
  if (!root) return syntax_error(origin, &err);
  mtrain_status_t st = parse_root(root, origin, out);
  json_decref(root);
  return st;
}

mtrain_status_t mtrain_budgets_read(const char *path, mtrain_budgets_t **out) {
  MTRAIN_CHECK_NOT_NULL(path);
  MTRAIN_CHECK_NOT_NULL(out);
  char *text = NULL;
  size_t len = 0;
  mtrain_status_t st = mtrain_read_file(path, &text, &len);
  if (st != MTRAIN_SUCCESS) return st;
  json_error_t err;
  json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &err);
  free(text);
  if (!root) return syntax_error(path, &err);
  st = parse_root(root, path, out);
  json_decref(root);
  return st;
}

/* ------------------------------------------------------------------------ */
/* Access                                                                    */
/* ------------------------------------------------------------------------ */

void mtrain_budgets_destroy(mtrain_budgets_t *budgets) {
  if (!budgets) return;
  free(budgets->num_heads);
  free(budgets->first);
  free(budgets->heads);
  free(budgets);
}

int32_t mtrain_budgets_num_layers(const mtrain_budgets_t *budgets) {
  return budgets ? budgets->num_layers : 0;
}

int32_t mtrain_budgets_num_heads(const mtrain_budgets_t *budgets, int32_t layer) {
  if (!budgets || layer < 0 || layer >= budgets->num_layers) return 0;
  return budgets->num_heads[layer];
}

mtrain_status_t mtrain_budgets_get(const mtrain_budgets_t *budgets, int32_t layer, int32_t head,
                                   mtrain_head_budget_t *out) {
  MTRAIN_CHECK_NOT_NULL(budgets);
  MTRAIN_CHECK_NOT_NULL(out);
  if (layer < 0 || layer >= budgets->num_layers)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "mtrain_budgets_get: layer %d out of range [0, %d) (the budgets have %d "
                        "layers)",
                        layer, budgets->num_layers, budgets->num_layers);
  int32_t nh = budgets->num_heads[layer];
  if (head < 0 || head >= nh)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "mtrain_budgets_get: head %d out of range [0, %d) (layer %d has %d heads)",
                        head, nh, layer, nh);
  *out = budgets->heads[budgets->first[layer] + head];
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_head_budget_validate(const mtrain_head_budget_t *budget) {
  MTRAIN_CHECK_NOT_NULL(budget);
  char num[40];
  switch (budget->kind) {
  case MTRAIN_BUDGET_TOP_K:
    if (budget->v_size < 0)
      return mtrain_error(MTRAIN_ERR_INVALID_BUDGET, "top-k budget: v_size %lld is negative",
                          (long long)budget->v_size);
    if (budget->s_size < 0)
      return mtrain_error(MTRAIN_ERR_INVALID_BUDGET, "top-k budget: s_size %lld is negative",
                          (long long)budget->s_size);
    return MTRAIN_SUCCESS;
  case MTRAIN_BUDGET_TOP_P:
    if (!p_ok(budget->p_v)) {
      format_double(budget->p_v, num, sizeof num);
      return mtrain_error(MTRAIN_ERR_INVALID_BUDGET, "top-p budget: p_v %s is not in (0, 1]", num);
    }
    if (!p_ok(budget->p_s)) {
      format_double(budget->p_s, num, sizeof num);
      return mtrain_error(MTRAIN_ERR_INVALID_BUDGET, "top-p budget: p_s %s is not in (0, 1]", num);
    }
    if (budget->cap_v < 0)
      return mtrain_error(MTRAIN_ERR_INVALID_BUDGET, "top-p budget: cap_v %lld is negative",
                          (long long)budget->cap_v);
    if (budget->cap_s < 0)
      return mtrain_error(MTRAIN_ERR_INVALID_BUDGET, "top-p budget: cap_s %lld is negative",
                          (long long)budget->cap_s);
    return MTRAIN_SUCCESS;
  }
  return mtrain_error(MTRAIN_ERR_INVALID_BUDGET,
                      "budget kind %d is neither MTRAIN_BUDGET_TOP_K (%d) nor MTRAIN_BUDGET_TOP_P "
                      "(%d)",
                      (int)budget->kind, (int)MTRAIN_BUDGET_TOP_K, (int)MTRAIN_BUDGET_TOP_P);
}
