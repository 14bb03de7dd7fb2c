/* predict.c: SparseBalance's cost predictor (docs/BALANCE.md,
 * "SparseBalance"): the seconds of one training step's work on a sequence,
 * from the pairs of its predicted pattern at its length (the position model
 * of the budgets, exact counts), a per-device calibration (seconds per pair,
 * per query row, per call; FLOP/s and a per-sequence cost of the linear
 * layers) and the model's
 * linear-layer FLOPs per token. Also the calibration file reader. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/balance/balance_internal.h"
#include "mtrain/mtrain_error.h"

/* ---- calibration file ---------------------------------------------------------------- */

mtrain_status_t mtrain_balance_calibration_read(const char *path,
                                                mtrain_balance_calibration_t *out) {
  MTRAIN_CHECK_NOT_NULL(path);
  MTRAIN_CHECK_NOT_NULL(out);
  json_error_t jerr;
  json_t *root = json_load_file(path, 0, &jerr);
  if (!root)
    return mtrain_error(MTRAIN_ERR_FORMAT, "calibration %s: line %d: %s", path, jerr.line,
                        jerr.text);
  mtrain_status_t st = MTRAIN_SUCCESS;
  /* the four required numbers, then the optional linear_seq_s (0 when absent) */
  static const char *const numbers[] = {"pair_s", "row_s", "seq_s", "linear_flops", "linear_seq_s"};
  static const char *const notes[] = {"device",  "backend", "status",       "derivation",
                                      "anchors", "fit",     "measurements", "model"};
  double v[5] = {0, 0, 0, 0, 0};
  if (!json_is_object(root)) {
    st = mtrain_error(MTRAIN_ERR_FORMAT, "calibration %s: expected a JSON object", path);
    goto cleanup;
  }
  const char *key;
  json_t *val;
  json_object_foreach(root, key, val) {
    int known = 0;
    for (int i = 0; i < 5; i++) known |= strcmp(key, numbers[i]) == 0;
    for (int i = 0; i < 8; i++) known |= strcmp(key, notes[i]) == 0;
    MTRAIN_FAIL_IF(!known, MTRAIN_ERR_FORMAT, "calibration %s: unknown key \"%s\"", path, key);
  }
  for (int i = 0; i < 5; i++) {
    json_t *x = json_object_get(root, numbers[i]);
    if (!x && i == 4) continue; /* linear_seq_s is optional */
    MTRAIN_FAIL_IF(!x || !json_is_number(x), MTRAIN_ERR_FORMAT,
                   "calibration %s: \"%s\" must be a number", path, numbers[i]);
    v[i] = json_number_value(x);
    MTRAIN_FAIL_IF(!(v[i] >= 0) || !isfinite(v[i]), MTRAIN_ERR_FORMAT,
                   "calibration %s: \"%s\" is %g, must be finite and >= 0", path, numbers[i], v[i]);
  }
  out->pair_s = v[0];
  out->row_s = v[1];
  out->seq_s = v[2];
  out->linear_flops = v[3];
  out->linear_seq_s = v[4];
cleanup:
  json_decref(root);
  return st;
}

/* ---- the predictor -------------------------------------------------------------------- */

static int64_t head_count(const mtrain_head_budget_t *b, int which) {
  if (b->kind == MTRAIN_BUDGET_TOP_K) return which ? b->s_size : b->v_size;
  return which ? b->cap_s : b->cap_v;
}

mtrain_status_t mtrain_balance_predictor_create(
    const mtrain_budgets_t *budgets, const double *scales, int32_t num_levels, int32_t base_level,
    const mtrain_position_model_t *position_model, int32_t granularity,
    const mtrain_balance_calibration_t *calibration, const mtrain_balance_model_t *model,
    mtrain_balance_predictor_t **out) {
  MTRAIN_CHECK_NOT_NULL(budgets);
  MTRAIN_CHECK_NOT_NULL(scales);
  MTRAIN_CHECK_NOT_NULL(position_model);
  MTRAIN_CHECK_NOT_NULL(calibration);
  MTRAIN_CHECK_NOT_NULL(model);
  MTRAIN_CHECK_NOT_NULL(out);
  if (num_levels < 1 || num_levels > 64)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance predictor: num_levels %d must be in [1, 64]", num_levels);
  if (base_level < 0 || base_level >= num_levels)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance predictor: base_level %d out of range [0, %d)", base_level,
                        num_levels);
  for (int32_t k = 0; k < num_levels; k++)
    if (!(scales[k] > 0) || !isfinite(scales[k]) || (k > 0 && !(scales[k] > scales[k - 1])))
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance predictor: scales[%d] = %g: scales must be finite, > 0 and "
                          "strictly increasing",
                          k, scales[k]);
  if (granularity < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance predictor: granularity %d must be >= 1", granularity);
  const mtrain_balance_calibration_t *c = calibration;
  if (!(c->pair_s >= 0) || !(c->row_s >= 0) || !(c->seq_s >= 0) || !(c->linear_flops >= 0) ||
      !(c->linear_seq_s >= 0) ||
      !isfinite(c->pair_s + c->row_s + c->seq_s + c->linear_flops + c->linear_seq_s))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance predictor: calibration values must be finite and >= 0");
  if (model->hidden < 0 || model->intermediate < 0 || model->vocab < 0 || model->kv_heads < 0 ||
      model->head_dim < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance predictor: model dimensions must be >= 0");
  if (model->hidden > 0 && !(c->linear_flops > 0))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance predictor: the model has linear layers (hidden %lld) but the "
                        "calibration's linear_flops is 0",
                        (long long)model->hidden);
  const int32_t nl = mtrain_budgets_num_layers(budgets);
  int32_t nh = 0;
  for (int32_t l = 0; l < nl; l++) nh += mtrain_budgets_num_heads(budgets, l);
  if (nl < 1 || nh < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "balance predictor: the budgets are empty");
  mtrain_status_t st = MTRAIN_SUCCESS;
  mtrain_balance_predictor_t *p = calloc(1, sizeof *p);
  if (!p) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "balance predictor: out of memory");
  p->num_layers = nl;
  p->num_heads = nh;
  p->num_levels = num_levels;
  p->base_level = base_level;
  p->granularity = granularity;
  p->model = *position_model;
  if (p->model.spread == MTRAIN_SPREAD_RANDOM) p->model.spread = MTRAIN_SPREAD_EVEN; /* no seeds */
  p->cal = *c;
  p->combo = malloc((size_t)nh * sizeof *p->combo);
  p->combo_counts = malloc((size_t)nh * 2 * sizeof *p->combo_counts);
  p->scales = malloc((size_t)num_levels * sizeof *p->scales);
  MTRAIN_FAIL_IF(!p->combo || !p->combo_counts || !p->scales, MTRAIN_ERR_OUT_OF_MEMORY,
                 "balance predictor: out of memory");
  memcpy(p->scales, scales, (size_t)num_levels * sizeof *scales);
  for (int32_t l = 0, g = 0; l < nl; l++) {
    for (int32_t h = 0; h < mtrain_budgets_num_heads(budgets, l); h++, g++) {
      mtrain_head_budget_t b;
      MTRAIN_TRY(mtrain_budgets_get(budgets, l, h, &b));
      const int64_t v = head_count(&b, 0), s = head_count(&b, 1);
      int32_t found = -1;
      for (int32_t k = 0; k < p->num_combos && found < 0; k++)
        if (p->combo_counts[2 * k] == v && p->combo_counts[2 * k + 1] == s) found = k;
      if (found < 0) {
        found = p->num_combos++;
        p->combo_counts[2 * found] = v;
        p->combo_counts[2 * found + 1] = s;
      }
      p->combo[g] = found;
    }
  }
  if (model->hidden > 0) {
    const double H = (double)model->hidden, d = (double)model->head_dim;
    const double hq = (double)mtrain_budgets_num_heads(budgets, 0), hkv = (double)model->kv_heads;
    const double per_layer = 2 * H * hq * d + 2 * H * hkv * d + 3 * H * (double)model->intermediate;
    p->linear_flop_per_token = 6.0 * ((double)nl * per_layer + H * (double)model->vocab);
  }
  *out = p;
  return MTRAIN_SUCCESS;
cleanup:
  mtrain_balance_predictor_destroy(p);
  return st;
}

mtrain_status_t mtrain_balance_predictor_set_row_pairs_grid(mtrain_balance_predictor_t *p,
                                                            int32_t num_lengths,
                                                            const int64_t *lengths,
                                                            const double *row_pairs) {
  MTRAIN_CHECK_NOT_NULL(p);
  MTRAIN_CHECK_NOT_NULL(row_pairs);
  if (num_lengths < 1 || num_lengths > 64)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance predictor: %d row-pair lengths; must be in [1, 64]", num_lengths);
  if (num_lengths > 1 && !lengths)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                        "balance predictor: row-pair lengths is NULL with %d lengths", num_lengths);
  for (int32_t i = 0; lengths && i < num_lengths; i++)
    if (lengths[i] < 1 || (i > 0 && lengths[i] <= lengths[i - 1]))
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance predictor: row-pair lengths[%d] = %lld: lengths must be >= 1 "
                          "and strictly increasing",
                          i, (long long)lengths[i]);
  const int32_t H = p->num_heads, K = p->num_levels;
  const size_t n = (size_t)num_lengths * (size_t)H * (size_t)K;
  for (size_t i = 0; i < n; i++)
    if (!(row_pairs[i] > 0) || !isfinite(row_pairs[i])) {
      const size_t at = i % ((size_t)H * (size_t)K);
      if (num_lengths == 1)
        return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                            "balance predictor: row_pairs[head %d, level %d] = %g: pairs per "
                            "query row must be finite and > 0",
                            (int)(at / (size_t)K), (int)(at % (size_t)K), row_pairs[i]);
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance predictor: row_pairs[length %d, head %d, level %d] = %g: pairs "
                          "per query row must be finite and > 0",
                          (int)(i / ((size_t)H * (size_t)K)), (int)(at / (size_t)K),
                          (int)(at % (size_t)K), row_pairs[i]);
    }
  double *copy = malloc(n * sizeof *copy);
  int64_t *lcopy = lengths ? malloc((size_t)num_lengths * sizeof *lcopy) : NULL;
  if (!copy || (lengths && !lcopy)) {
    free(copy);
    free(lcopy);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "balance predictor: out of memory");
  }
  memcpy(copy, row_pairs, n * sizeof *copy);
  if (lcopy) memcpy(lcopy, lengths, (size_t)num_lengths * sizeof *lcopy);
  free(p->row_pairs);
  free(p->row_lengths);
  p->row_pairs = copy;
  p->row_lengths = lcopy;
  p->num_row_lengths = num_lengths;
  p->num_combos = H; /* measured heads differ: each its own combo */
  for (int32_t h = 0; h < H; h++) p->combo[h] = h;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_balance_predictor_set_row_pairs(mtrain_balance_predictor_t *p,
                                                       const double *row_pairs) {
  return mtrain_balance_predictor_set_row_pairs_grid(p, 1, NULL, row_pairs);
}

/* Pairs per query row of entry i (head * num_levels + level) at length N:
 * the measured value, or between two measured lengths linear in log N, the
 * nearest end's value outside them. */
static double row_pairs_at(const mtrain_balance_predictor_t *p, int32_t i, int64_t N) {
  const size_t stride = (size_t)p->num_heads * (size_t)p->num_levels;
  const int32_t L = p->num_row_lengths;
  const int64_t *len = p->row_lengths;
  if (L == 1 || N <= len[0]) return p->row_pairs[i];
  if (N >= len[L - 1]) return p->row_pairs[(size_t)(L - 1) * stride + (size_t)i];
  int32_t j = 0;
  while (len[j + 1] < N) j++;
  const double a = p->row_pairs[(size_t)j * stride + (size_t)i];
  const double b = p->row_pairs[(size_t)(j + 1) * stride + (size_t)i];
  const double t = log((double)N / (double)len[j]) / log((double)len[j + 1] / (double)len[j]);
  return a + (b - a) * t;
}

/* A measured head's pairs at length N: its pairs per query row times N, at
 * most the causal pairs, at least 1. */
static int64_t measured_pairs(double row_pairs, int64_t N) {
  const double causal = (double)N * (double)(N + 1) / 2.0;
  const double x = floor(row_pairs * (double)N + 0.5);
  return x >= causal ? (int64_t)causal : x < 1 ? 1 : (int64_t)x;
}

void mtrain_balance_predictor_destroy(mtrain_balance_predictor_t *p) {
  if (!p) return;
  free(p->row_pairs);
  free(p->row_lengths);
  free(p->combo);
  free(p->combo_counts);
  free(p->scales);
  free(p);
}

int32_t mtrain_balance_predictor_num_heads(const mtrain_balance_predictor_t *p) {
  return p ? p->num_heads : 0;
}

int32_t mtrain_balance_predictor_num_levels(const mtrain_balance_predictor_t *p) {
  return p ? p->num_levels : 0;
}

/* Counts times a level's scale, rounded, at least 1 (0 stays 0). */
static int64_t scaled(int64_t x, double scale) {
  if (x <= 0) return 0;
  const double y = floor((double)x * scale + 0.5);
  return y < 1 ? 1 : (int64_t)y;
}

mtrain_status_t mtrain_predictor_pair_table(const mtrain_balance_predictor_t *p, int64_t N,
                                            mtrain_pm_scratch_t *scratch, int64_t *out) {
  if (p->row_pairs) {
    for (int32_t i = 0; i < p->num_combos * p->num_levels; i++)
      out[i] = measured_pairs(row_pairs_at(p, i, N), N);
    return MTRAIN_SUCCESS;
  }
  for (int32_t c = 0; c < p->num_combos; c++) {
    for (int32_t k = 0; k < p->num_levels; k++) {
      mtrain_head_budget_t b;
      memset(&b, 0, sizeof b);
      b.kind = MTRAIN_BUDGET_TOP_K;
      b.v_size = scaled(p->combo_counts[2 * c], p->scales[k]);
      b.s_size = scaled(p->combo_counts[2 * c + 1], p->scales[k]);
      mtrain_status_t st = mtrain_position_model_head_pairs(&b, N, p->granularity, &p->model, 0, 0,
                                                            scratch, &out[c * p->num_levels + k]);
      if (st != MTRAIN_SUCCESS) return st;
    }
  }
  return MTRAIN_SUCCESS;
}

double mtrain_predictor_fixed_seconds(const mtrain_balance_predictor_t *p, int64_t N) {
  double s = p->cal.row_s * (double)N * (double)p->num_heads + p->cal.seq_s * (double)p->num_layers;
  if (p->linear_flop_per_token > 0)
    s += p->linear_flop_per_token * (double)N / p->cal.linear_flops + p->cal.linear_seq_s;
  return s;
}

mtrain_status_t mtrain_balance_head_pairs(const mtrain_balance_predictor_t *p, int64_t seq_len,
                                          int32_t head, int32_t level, int64_t *out) {
  MTRAIN_CHECK_NOT_NULL(p);
  MTRAIN_CHECK_NOT_NULL(out);
  if (head < 0 || head >= p->num_heads || level < 0 || level >= p->num_levels || seq_len < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance head pairs: head %d (of %d), level %d (of %d), seq_len %lld", head,
                        p->num_heads, level, p->num_levels, (long long)seq_len);
  if (p->row_pairs) {
    *out = measured_pairs(row_pairs_at(p, head * p->num_levels + level, seq_len), seq_len);
    return MTRAIN_SUCCESS;
  }
  mtrain_pm_scratch_t sc;
  memset(&sc, 0, sizeof sc);
  mtrain_head_budget_t b;
  memset(&b, 0, sizeof b);
  const int32_t c = p->combo[head];
  b.kind = MTRAIN_BUDGET_TOP_K;
  b.v_size = scaled(p->combo_counts[2 * c], p->scales[level]);
  b.s_size = scaled(p->combo_counts[2 * c + 1], p->scales[level]);
  mtrain_status_t st =
      mtrain_position_model_head_pairs(&b, seq_len, p->granularity, &p->model, 0, 0, &sc, out);
  mtrain_pm_scratch_free(&sc);
  return st;
}

mtrain_status_t mtrain_balance_predict(const mtrain_balance_predictor_t *p, int64_t seq_len,
                                       const int32_t *levels, double *seconds) {
  MTRAIN_CHECK_NOT_NULL(p);
  MTRAIN_CHECK_NOT_NULL(seconds);
  if (seq_len < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "balance predict: seq_len %lld must be >= 1",
                        (long long)seq_len);
  for (int32_t h = 0; levels && h < p->num_heads; h++)
    if (levels[h] < 0 || levels[h] >= p->num_levels)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance predict: levels[%d] = %d out of range [0, %d)", h, levels[h],
                          p->num_levels);
  int64_t *table = malloc((size_t)p->num_combos * (size_t)p->num_levels * sizeof *table);
  if (!table) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "balance predict: out of memory");
  mtrain_pm_scratch_t sc;
  memset(&sc, 0, sizeof sc);
  mtrain_status_t st = mtrain_predictor_pair_table(p, seq_len, &sc, table);
  if (st == MTRAIN_SUCCESS) {
    double pairs = 0;
    for (int32_t h = 0; h < p->num_heads; h++)
      pairs += (double)table[p->combo[h] * p->num_levels + (levels ? levels[h] : p->base_level)];
    *seconds = p->cal.pair_s * pairs + mtrain_predictor_fixed_seconds(p, seq_len);
  }
  mtrain_pm_scratch_free(&sc);
  free(table);
  return st;
}
