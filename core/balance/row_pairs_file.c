/* row_pairs_file.c: reads a measured-pricing table on a length grid (the
 * "mtrain-row-pairs-1" JSON that tools/balance_row_pairs.py writes: every
 * head's pairs per query row of its estimated pattern at every budget level
 * and length) into a cost predictor (docs/BALANCE.md, "Pricing on a length
 * grid"). Every mismatch with the predictor (levels, granularity, layers,
 * heads) and every missing or bad value is refused naming it. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/balance/balance_internal.h"
#include "mtrain/mtrain.h"
#include "mtrain/mtrain_error.h"

#define TABLE_FORMAT "mtrain-row-pairs-1"

static int64_t int_of(json_t *root, const char *key) {
  json_t *x = json_object_get(root, key);
  return json_is_integer(x) ? (int64_t)json_integer_value(x) : -1;
}

mtrain_status_t mtrain_balance_predictor_read_row_pairs(mtrain_balance_predictor_t *p,
                                                        const char *path) {
  MTRAIN_CHECK_NOT_NULL(p);
  MTRAIN_CHECK_NOT_NULL(path);
  json_error_t jerr;
  json_t *root = json_load_file(path, 0, &jerr);
  if (!root)
    return mtrain_error(MTRAIN_ERR_FORMAT, "row pairs %s: line %d: %s", path, jerr.line, jerr.text);
  mtrain_status_t st = MTRAIN_SUCCESS;
  int64_t *lengths = NULL;
  double *values = NULL;
  const json_t *fmt = json_object_get(root, "format");
  MTRAIN_FAIL_IF(!json_is_string(fmt) || strcmp(json_string_value(fmt), TABLE_FORMAT) != 0,
                 MTRAIN_ERR_FORMAT, "row pairs %s: \"format\" must be \"%s\"", path, TABLE_FORMAT);
  const int32_t K = p->num_levels, NL = p->num_layers;
  json_t *levels = json_object_get(root, "levels");
  MTRAIN_FAIL_IF(!json_is_array(levels) || (int32_t)json_array_size(levels) != K,
                 MTRAIN_ERR_INVALID_ARGUMENT,
                 "row pairs %s: \"levels\" must list the predictor's %d levels", path, K);
  for (int32_t k = 0; k < K; k++) {
    const double x = json_number_value(json_array_get(levels, (size_t)k));
    MTRAIN_FAIL_IF(fabs(x - p->scales[k]) > 1e-12 * p->scales[k], MTRAIN_ERR_INVALID_ARGUMENT,
                   "row pairs %s: level %d is %g, the predictor's is %g", path, k, x, p->scales[k]);
  }
  const int64_t G = int_of(root, "granularity"), heads = int_of(root, "heads");
  const int64_t layers = int_of(root, "num_layers");
  MTRAIN_FAIL_IF(G != p->granularity, MTRAIN_ERR_INVALID_ARGUMENT,
                 "row pairs %s: granularity %lld, the predictor's is %d", path, (long long)G,
                 p->granularity);
  MTRAIN_FAIL_IF(layers != NL || heads < 1 || heads * layers != p->num_heads,
                 MTRAIN_ERR_INVALID_ARGUMENT,
                 "row pairs %s: %lld layers of %lld heads, the predictor's budgets have %d layers "
                 "and %d heads in all",
                 path, (long long)layers, (long long)heads, NL, p->num_heads);
  json_t *lens = json_object_get(root, "lengths");
  const size_t L = json_is_array(lens) ? json_array_size(lens) : 0;
  MTRAIN_FAIL_IF(L < 1 || L > 64, MTRAIN_ERR_FORMAT,
                 "row pairs %s: \"lengths\" must be an array of 1 to 64 token counts", path);
  lengths = malloc(L * sizeof *lengths);
  values = malloc(L * (size_t)p->num_heads * (size_t)K * sizeof *values);
  MTRAIN_FAIL_IF(!lengths || !values, MTRAIN_ERR_OUT_OF_MEMORY, "row pairs: out of memory");
  for (size_t i = 0; i < L; i++) {
    json_t *x = json_array_get(lens, i);
    MTRAIN_FAIL_IF(!json_is_integer(x), MTRAIN_ERR_FORMAT,
                   "row pairs %s: lengths[%zu] is not an integer", path, i);
    lengths[i] = (int64_t)json_integer_value(x);
  }
  json_t *done = json_object_get(root, "layers_done");
  MTRAIN_FAIL_IF(!json_is_object(done), MTRAIN_ERR_FORMAT,
                 "row pairs %s: \"layers_done\" must be an object", path);
  for (int32_t l = 0; l < NL; l++) {
    char key[16];
    snprintf(key, sizeof key, "%d", l);
    json_t *layer = json_object_get(done, key);
    MTRAIN_FAIL_IF(!layer, MTRAIN_ERR_INVALID_ARGUMENT,
                   "row pairs %s: layer %d was not measured (resume the measurement)", path, l);
    MTRAIN_FAIL_IF(!json_is_array(layer) || json_array_size(layer) != L, MTRAIN_ERR_FORMAT,
                   "row pairs %s: layer %d must hold %zu lengths", path, l, L);
    for (size_t i = 0; i < L; i++) {
      json_t *per_len = json_array_get(layer, i);
      MTRAIN_FAIL_IF(!json_is_array(per_len) || json_array_size(per_len) != (size_t)heads,
                     MTRAIN_ERR_FORMAT, "row pairs %s: layer %d, length %zu must hold %lld heads",
                     path, l, i, (long long)heads);
      for (int64_t h = 0; h < heads; h++) {
        json_t *per_head = json_array_get(per_len, (size_t)h);
        MTRAIN_FAIL_IF(!json_is_array(per_head) || json_array_size(per_head) != (size_t)K,
                       MTRAIN_ERR_FORMAT,
                       "row pairs %s: layer %d, length %zu, head %lld must hold %d levels", path, l,
                       i, (long long)h, K);
        for (int32_t k = 0; k < K; k++) {
          json_t *v = json_array_get(per_head, (size_t)k);
          MTRAIN_FAIL_IF(!json_is_number(v), MTRAIN_ERR_FORMAT,
                         "row pairs %s: layer %d, length %zu, head %lld, level %d is not a number",
                         path, l, i, (long long)h, k);
          const size_t g = (size_t)l * (size_t)heads + (size_t)h;
          values[(i * (size_t)p->num_heads + g) * (size_t)K + (size_t)k] = json_number_value(v);
        }
      }
    }
  }
  st = mtrain_balance_predictor_set_row_pairs_grid(p, (int32_t)L, lengths, values);
  if (st) {
    char why[512];
    snprintf(why, sizeof why, "%s", mtrain_last_error()); /* the buffer is rewritten below */
    st = mtrain_error(st, "row pairs %s: %s", path, why);
  }
cleanup:
  free(lengths);
  free(values);
  json_decref(root);
  return st;
}
