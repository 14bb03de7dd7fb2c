/* position_model.c: the position model that turns per-head budgets into
 * vertical-slash patterns without tensors (for the cost model and the
 * balance analyser): sinks and the local window first, as SPEC.md section 2
 * forces them, the rest of each budget spread evenly or at seeded random
 * positions. Token diagonals become block diagonals as section 2 says. The
 * real positions come from the online estimation (estimate.c); this is a
 * stand-in with the right counts and the structure that matters for
 * balance. */
#include <stdlib.h>
#include <string.h>

#include "core/balance/balance_internal.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_balance.h"
#include "mtrain/mtrain_error.h"

/* ---- a seeded generator (splitmix64) ------------------------------------------ */

static uint64_t splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Uniform in [0, n), n >= 1, without modulo bias. */
static int64_t below(uint64_t *state, int64_t n) {
  const uint64_t un = (uint64_t)n, limit = UINT64_MAX - UINT64_MAX % un;
  uint64_t x;
  do x = splitmix64(state);
  while (x >= limit);
  return (int64_t)(x % un);
}

/* `count` positions in [lo, hi), increasing, written to out (count <= hi - lo).
 * Even: the midpoints of count equal parts. Local: lo, lo + 1, ... Random:
 * Floyd's sampling without replacement, marked in a bitmap (scratch of
 * (hi - lo + 63) / 64 words). */
static void spread(int64_t lo, int64_t hi, int64_t count, mtrain_spread_t how, uint64_t *state,
                   uint64_t *bitmap, int64_t *out) {
  const int64_t n = hi - lo;
  if (count <= 0) return;
  if (how == MTRAIN_SPREAD_EVEN) {
    for (int64_t i = 0; i < count; i++) out[i] = lo + (2 * i + 1) * n / (2 * count);
    return;
  }
  if (how == MTRAIN_SPREAD_LOCAL) {
    for (int64_t i = 0; i < count; i++) out[i] = lo + i;
    return;
  }
  const int64_t words = (n + 63) / 64;
  memset(bitmap, 0, (size_t)words * sizeof *bitmap);
  for (int64_t j = n - count; j < n; j++) {
    int64_t x = below(state, j + 1);
    if (bitmap[x / 64] >> (x % 64) & 1) x = j;
    bitmap[x / 64] |= (uint64_t)1 << (x % 64);
  }
  int64_t k = 0;
  for (int64_t w = 0; w < words; w++)
    for (uint64_t bits = bitmap[w]; bits; bits &= bits - 1)
      out[k++] = lo + w * 64 + __builtin_ctzll(bits);
}

static mtrain_status_t check_model(const mtrain_position_model_t *m) {
  if (m->num_sinks < 0 || m->window < 0 || m->budget_context < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "position model: num_sinks %d, window %d and budget_context %lld must be "
                        ">= 0",
                        m->num_sinks, m->window, (long long)m->budget_context);
  if (m->spread != MTRAIN_SPREAD_EVEN && m->spread != MTRAIN_SPREAD_RANDOM &&
      m->spread != MTRAIN_SPREAD_LOCAL)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "position model: spread %d is not even (0), random (1) or local (2)",
                        (int)m->spread);
  return MTRAIN_SUCCESS;
}

/* x * num / den rounded to nearest (num, den > 0; no overflow for the sizes
 * budgets and sequences have: both below 2^40, done in long double). */
static int64_t scale(int64_t x, int64_t num, int64_t den) {
  const long double v = (long double)x * (long double)num / (long double)den;
  return (int64_t)(v + 0.5L);
}

mtrain_status_t mtrain_position_model_counts(const mtrain_head_budget_t *budget, int64_t seq_len,
                                             int32_t granularity,
                                             const mtrain_position_model_t *model, int64_t *v,
                                             int64_t *s) {
  MTRAIN_CHECK_NOT_NULL(budget);
  MTRAIN_CHECK_NOT_NULL(model);
  MTRAIN_CHECK_NOT_NULL(v);
  MTRAIN_CHECK_NOT_NULL(s);
  mtrain_status_t st = mtrain_head_budget_validate(budget);
  if (st == MTRAIN_SUCCESS) st = check_model(model);
  if (st != MTRAIN_SUCCESS) return st;
  if (seq_len < 1 || granularity < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "position model: seq_len %lld and granularity %d must be >= 1",
                        (long long)seq_len, granularity);
  int64_t nv = budget->kind == MTRAIN_BUDGET_TOP_K ? budget->v_size : budget->cap_v;
  int64_t ns = budget->kind == MTRAIN_BUDGET_TOP_K ? budget->s_size : budget->cap_s;
  if (model->budget_context > 0) {
    nv = scale(nv, seq_len, model->budget_context);
    ns = scale(ns, seq_len, model->budget_context);
  }
  const int64_t nb = (seq_len + granularity - 1) / granularity;
  const int64_t v_candidates = (nb - 1) * granularity; /* keys before the last block */
  *v = nv < v_candidates ? nv : v_candidates;
  *s = ns < seq_len ? ns : seq_len;
  return MTRAIN_SUCCESS;
}

/* One head: verticals and block diagonals into caller buffers. */
static void head_positions(int64_t N, int32_t G, int64_t v, int64_t s,
                           const mtrain_position_model_t *m, uint64_t seed, uint64_t *bitmap,
                           int64_t *tok, uint8_t *mark, int64_t *verticals, int32_t *diagonals,
                           int32_t *num_diagonals) {
  const int64_t nb = (N + G - 1) / G;
  uint64_t state = seed;
  /* verticals */
  const int64_t sinks = v < m->num_sinks ? v : m->num_sinks;
  for (int64_t i = 0; i < sinks; i++) verticals[i] = i;
  spread(sinks, (nb - 1) * G, v - sinks, m->spread, &state, bitmap, verticals + sinks);
  /* slashes: token diagonals, then block diagonals */
  const int64_t window = s < m->window ? s : m->window;
  for (int64_t i = 0; i < window; i++) tok[i] = i;
  spread(window, N, s - window, m->spread, &state, bitmap, tok + window);
  memset(mark, 0, (size_t)nb);
  mark[0] = 1;
  for (int64_t i = 0; i < s; i++) {
    const int64_t a = tok[i] / G;
    mark[a] = 1;
    if (tok[i] % G && a + 1 < nb) mark[a + 1] = 1;
  }
  int32_t nd = 0;
  for (int64_t a = 0; a < nb; a++)
    if (mark[a]) diagonals[nd++] = (int32_t)a;
  *num_diagonals = nd;
}

mtrain_status_t mtrain_pattern_from_budgets(const mtrain_budgets_t *budgets, int32_t layer,
                                            int64_t seq_len, int32_t granularity,
                                            const mtrain_position_model_t *model,
                                            mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(budgets);
  MTRAIN_CHECK_NOT_NULL(model);
  MTRAIN_CHECK_NOT_NULL(out);
  const int32_t heads = mtrain_budgets_num_heads(budgets, layer);
  if (heads < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "position model: layer %d out of range [0, %d) of the budgets", layer,
                        mtrain_budgets_num_layers(budgets));
  mtrain_status_t st = check_model(model);
  if (st != MTRAIN_SUCCESS) return st;
  mtrain_pattern_t *p = NULL;
  st = mtrain_pattern_create(seq_len, heads, granularity, &p);
  if (st != MTRAIN_SUCCESS) return st;
  const int64_t nb = p->num_blocks;
  uint64_t *bitmap = malloc((size_t)((seq_len + 63) / 64) * sizeof *bitmap);
  int64_t *tok = malloc((size_t)seq_len * sizeof *tok);
  int64_t *verticals = malloc((size_t)seq_len * sizeof *verticals);
  int32_t *diagonals = malloc((size_t)nb * sizeof *diagonals);
  uint8_t *mark = malloc((size_t)nb);
  if (!bitmap || !tok || !verticals || !diagonals || !mark) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "position model: out of memory for %lld tokens",
                      (long long)seq_len);
    goto cleanup;
  }
  for (int32_t h = 0; h < heads; h++) {
    mtrain_head_budget_t b;
    int64_t v = 0, s = 0;
    int32_t nd = 0;
    MTRAIN_TRY(mtrain_budgets_get(budgets, layer, h, &b));
    st = mtrain_position_model_counts(&b, seq_len, granularity, model, &v, &s);
    if (st != MTRAIN_SUCCESS) {
      st = mtrain_error_prefix(st, "layer %d, head %d", layer, h);
      goto cleanup;
    }
    if (v > INT32_MAX) {
      st = mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "position model: layer %d, head %d: %lld verticals, more than 2^31 - 1",
                        layer, h, (long long)v);
      goto cleanup;
    }
    uint64_t seed_state = model->seed ^ ((uint64_t)(uint32_t)layer << 32 | (uint32_t)h);
    const uint64_t seed = splitmix64(&seed_state);
    head_positions(seq_len, granularity, v, s, model, seed, bitmap, tok, mark, verticals, diagonals,
                   &nd);
    MTRAIN_TRY(mtrain_pattern_set_head(p, h, diagonals, nd, verticals, (int32_t)v));
  }
cleanup:
  free(bitmap);
  free(tok);
  free(verticals);
  free(diagonals);
  free(mark);
  if (st != MTRAIN_SUCCESS) {
    mtrain_pattern_destroy(p);
    return st;
  }
  *out = p;
  return MTRAIN_SUCCESS;
}

/* ---- pair counts without a pattern (SparseBalance's predictor) ---------------------- */

int64_t mtrain_vs_pairs(const int32_t *diagonals, int32_t nd, const int64_t *verticals, int64_t nv,
                        int64_t N, int32_t G) {
  const int64_t nb = (N + G - 1) / G, rl = N - (nb - 1) * G; /* rows of the last block */
  int64_t total = 0;
  for (int32_t i = 0; i < nd; i++) {
    const int64_t t = diagonals[i];
    if (t >= nb) break;
    if (t == 0)
      total += (nb - 1) * ((int64_t)G * (G + 1) / 2) + rl * (rl + 1) / 2;
    else
      total += (int64_t)G * (N - t * G); /* query rows of blocks t..nb-1, G keys each */
  }
  /* a vertical in key block kb: every query row of blocks kb+1..nb-1, less
   * the blocks kb+t on a listed diagonal t >= 1 (the key is inside them) */
  int64_t hi = 0; /* diagonals[0..hi) <= nb-1-kb, found by bisection per block */
  int64_t prev_kb = -1, listed = 0;
  for (int64_t i = 0; i < nv; i++) {
    const int64_t kb = verticals[i] / G;
    if (kb >= nb - 1) break;
    if (kb != prev_kb) {
      const int64_t lim = nb - 1 - kb;
      int64_t lo = 0, up = nd;
      while (lo < up) {
        const int64_t mid = (lo + up) / 2;
        if (diagonals[mid] <= lim)
          lo = mid + 1;
        else
          up = mid;
      }
      hi = lo;
      int64_t c = hi - (nd > 0 && diagonals[0] == 0); /* listed t in [1, lim] */
      listed = (int64_t)G * c;
      if (hi > 0 && diagonals[hi - 1] == lim && lim >= 1) listed -= G - rl; /* last block */
      prev_kb = kb;
    }
    total += (N - (kb + 1) * G) - listed;
  }
  return total;
}

void mtrain_pm_scratch_free(mtrain_pm_scratch_t *s) {
  if (!s) return;
  free(s->bitmap);
  free(s->tok);
  free(s->verticals);
  free(s->diagonals);
  free(s->mark);
  memset(s, 0, sizeof *s);
}

static int scratch_reserve(mtrain_pm_scratch_t *s, int64_t N) {
  if (N <= s->cap) return 1;
  mtrain_pm_scratch_free(s);
  const int64_t nb = N + 1; /* blocks of any granularity */
  s->bitmap = malloc((size_t)((N + 63) / 64) * sizeof *s->bitmap);
  s->tok = malloc((size_t)N * sizeof *s->tok);
  s->verticals = malloc((size_t)N * sizeof *s->verticals);
  s->diagonals = malloc((size_t)nb * sizeof *s->diagonals);
  s->mark = malloc((size_t)nb);
  if (!s->bitmap || !s->tok || !s->verticals || !s->diagonals || !s->mark) {
    mtrain_pm_scratch_free(s);
    return 0;
  }
  s->cap = N;
  return 1;
}

mtrain_status_t mtrain_position_model_head_pairs(const mtrain_head_budget_t *budget, int64_t N,
                                                 int32_t G, const mtrain_position_model_t *model,
                                                 int32_t layer, int32_t head,
                                                 mtrain_pm_scratch_t *scratch, int64_t *pairs) {
  int64_t v = 0, s = 0;
  mtrain_status_t st = mtrain_position_model_counts(budget, N, G, model, &v, &s);
  if (st != MTRAIN_SUCCESS) return st;
  if (!scratch_reserve(scratch, N))
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "position model: out of memory for %lld tokens",
                        (long long)N);
  uint64_t seed_state = model->seed ^ ((uint64_t)(uint32_t)layer << 32 | (uint32_t)head);
  const uint64_t seed = splitmix64(&seed_state);
  int32_t nd = 0;
  head_positions(N, G, v, s, model, seed, scratch->bitmap, scratch->tok, scratch->mark,
                 scratch->verticals, scratch->diagonals, &nd);
  *pairs = mtrain_vs_pairs(scratch->diagonals, nd, scratch->verticals, v, N, G);
  return MTRAIN_SUCCESS;
}
