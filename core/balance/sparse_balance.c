/* sparse_balance.c: SparseBalance's batch call (docs/BALANCE.md,
 * "SparseBalance"): predicts every sequence's seconds, deals the sequences
 * to ranks and micro-batches (batching.c), then tunes each rank's per-head
 * budget levels in both directions: stragglers give up the recall that is
 * cheapest per second saved until they meet the step target, ranks with
 * idle time buy the recall that is cheapest per second added without passing
 * the step time. One level per (rank, head) applies to all of the rank's
 * sequences in the step. With splitting (mtrain_balance_batch_split) the
 * largest documents are split over several ranks (batching.c): they run at
 * the base level on every rank of their ring, in a split phase before the
 * rank's whole documents, and the tuner changes only the whole documents'
 * levels. Deterministic: ties go to the lower head index. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/balance/balance_internal.h"
#include "mtrain/mtrain_error.h"

static int cmp_i64(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static int32_t find_len(const int64_t *u, int32_t nu, int64_t x) {
  int32_t lo = 0, hi = nu - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (u[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static mtrain_status_t check_inputs(const mtrain_balance_predictor_t *p, const int64_t *lengths,
                                    int32_t n, const double *mass,
                                    const mtrain_balance_batch_options_t *o) {
  if (n < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance batch: %d sequences: the batch must hold at least one", n);
  for (int32_t i = 0; i < n; i++)
    if (lengths[i] < 1)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "balance batch: lengths[%d] = %lld must be >= 1", i,
                          (long long)lengths[i]);
  if (o->ranks < 1 || o->micro_batches < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance batch: ranks %d and micro_batches %d must be >= 1", o->ranks,
                        o->micro_batches);
  const int32_t K = p->num_levels;
  const int32_t lo = o->min_level < 0 ? 0 : o->min_level;
  const int32_t hi = o->max_level < 0 ? K - 1 : o->max_level;
  if (lo >= K || hi >= K || lo > hi)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "balance batch: level bounds [%d, %d] are not inside [0, %d]", lo, hi,
                        K - 1);
  if (!(o->target_s <= 1e300) || isnan(o->target_s))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "balance batch: target_s must be finite");
  if (o->tune && !mass)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                        "balance batch: tuning needs the heads' mass curves (mass is NULL)");
  for (int32_t h = 0; mass && h < p->num_heads; h++)
    for (int32_t k = 0; k < K; k++) {
      const double m = mass[h * K + k];
      if (!(m >= 0 && m <= 1))
        return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                            "balance batch: mass of head %d at level %d is %g, not in [0, 1]", h, k,
                            m);
      if (k > 0 && m < mass[h * K + k - 1] - 1e-12)
        return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                            "balance batch: mass of head %d falls from %g at level %d to %g at "
                            "level %d (must not decrease with the budget)",
                            h, mass[h * K + k - 1], k - 1, m, k);
    }
  return MTRAIN_SUCCESS;
}

/* Per-rank tuning state. */
typedef struct rank_state {
  const mtrain_balance_predictor_t *p;
  const double *P; /* [combos * K]: pairs summed over the rank's sequences */
  const double *mass;
  int32_t *lv; /* [heads] */
  double cost;
} rank_state_t;

static double step_seconds(const rank_state_t *s, int32_t h, int32_t from, int32_t to) {
  const int32_t K = s->p->num_levels, c = s->p->combo[h];
  return s->p->cal.pair_s * (s->P[c * K + to] - s->P[c * K + from]);
}

/* Lowers levels until cost <= target (or nothing is left to lower). */
static int64_t tune_down(rank_state_t *s, double target, int32_t lo) {
  const int32_t K = s->p->num_levels;
  int64_t moves = 0;
  while (s->cost > target) {
    int32_t best = -1;
    double bl = 0, bs = 0; /* the best loss and saving: least bl / bs */
    for (int32_t h = 0; h < s->p->num_heads; h++) {
      const int32_t k = s->lv[h];
      if (k <= lo) continue;
      const double save = -step_seconds(s, h, k, k - 1);
      if (!(save > 0)) continue;
      const double loss = s->mass[h * K + k] - s->mass[h * K + k - 1];
      if (best < 0 || loss * bs < bl * save) {
        best = h;
        bl = loss;
        bs = save;
      }
    }
    if (best < 0) break;
    s->lv[best]--;
    s->cost -= bs;
    moves++;
  }
  return moves;
}

/* Raises levels while the cost stays <= limit, most recall per second first. */
static int64_t tune_up(rank_state_t *s, double limit, int32_t hi) {
  const int32_t K = s->p->num_levels;
  int64_t moves = 0;
  for (;;) {
    int32_t best = -1;
    double bg = 0, be = 0; /* the best gain and extra: largest bg / be */
    for (int32_t h = 0; h < s->p->num_heads; h++) {
      const int32_t k = s->lv[h];
      if (k >= hi) continue;
      const double extra = step_seconds(s, h, k, k + 1);
      const double gain = s->mass[h * K + k + 1] - s->mass[h * K + k];
      if (!(gain > 0) || extra < 0 || s->cost + extra > limit) continue;
      if (best < 0 || gain * be > bg * extra) {
        best = h;
        bg = gain;
        be = extra;
      }
    }
    if (best < 0) break;
    s->lv[best]++;
    s->cost += be;
    moves++;
  }
  return moves;
}

/* Both batch calls: without `out` (mtrain_balance_batch) the assignment is
 * mtrain_balance_assign's into rank_of/micro_of; with it, that of
 * mtrain_balance_assign_split under `sp`, returned in *out in seconds. */
static mtrain_status_t batch_impl(const mtrain_balance_predictor_t *p, const int64_t *lengths,
                                  int32_t n, const double *mass,
                                  const mtrain_balance_batch_options_t *o,
                                  const mtrain_balance_split_options_t *sp,
                                  mtrain_balance_split_t *out, int32_t *rank_of, int32_t *micro_of,
                                  int32_t *levels, double *rank_before, double *rank_after,
                                  mtrain_balance_report_t *report) {
  mtrain_status_t st = check_inputs(p, lengths, n, mass, o);
  if (st != MTRAIN_SUCCESS) return st;
  const int32_t R = o->ranks, K = p->num_levels, H = p->num_heads, C = p->num_combos;
  const int32_t lo = o->min_level < 0 ? 0 : o->min_level;
  const int32_t hi = o->max_level < 0 ? K - 1 : o->max_level;
  int32_t base = p->base_level < lo ? lo : p->base_level > hi ? hi : p->base_level;
  int64_t *uniq = malloc((size_t)n * sizeof *uniq);
  int64_t *table = NULL;
  double *cost = malloc((size_t)n * sizeof *cost), *weight = malloc((size_t)n * sizeof *weight);
  double *P = calloc((size_t)R * C * K, sizeof *P), *before = calloc((size_t)R, sizeof *before);
  double *fixed = calloc((size_t)R, sizeof *fixed), *tokens = calloc((size_t)R, sizeof *tokens);
  int32_t *rk = malloc((size_t)n * sizeof *rk), *mb = malloc((size_t)n * sizeof *mb);
  int32_t *lv = malloc((size_t)R * H * sizeof *lv);
  int32_t *combo_heads = calloc((size_t)C, sizeof *combo_heads);
  double *ring = NULL, *once = NULL, *ready = NULL, *idle = NULL, *stokens = NULL;
  rank_state_t *rs = NULL;
  mtrain_pm_scratch_t sc;
  memset(&sc, 0, sizeof sc);
  mtrain_balance_report_t rep;
  memset(&rep, 0, sizeof rep);
  MTRAIN_FAIL_IF(!uniq || !cost || !weight || !P || !before || !fixed || !tokens || !rk || !mb ||
                     !lv || !combo_heads,
                 MTRAIN_ERR_OUT_OF_MEMORY, "balance batch: out of memory");
  if (out) {
    ring = malloc((size_t)n * sizeof *ring);
    once = malloc((size_t)n * sizeof *once);
    ready = calloc((size_t)R, sizeof *ready);
    idle = calloc((size_t)R, sizeof *idle);
    stokens = calloc((size_t)R, sizeof *stokens);
    MTRAIN_FAIL_IF(!ring || !once || !ready || !idle || !stokens, MTRAIN_ERR_OUT_OF_MEMORY,
                   "balance batch: out of memory");
  }
  /* 1. pair tables of the distinct lengths, each sequence's base cost */
  memcpy(uniq, lengths, (size_t)n * sizeof *uniq);
  qsort(uniq, (size_t)n, sizeof *uniq, cmp_i64);
  int32_t nu = 0;
  for (int32_t i = 0; i < n; i++)
    if (nu == 0 || uniq[i] != uniq[nu - 1]) uniq[nu++] = uniq[i];
  table = malloc((size_t)nu * C * K * sizeof *table);
  MTRAIN_FAIL_IF(!table, MTRAIN_ERR_OUT_OF_MEMORY, "balance batch: out of memory");
  for (int32_t u = 0; u < nu; u++)
    MTRAIN_TRY(mtrain_predictor_pair_table(p, uniq[u], &sc, table + (size_t)u * C * K));
  for (int32_t h = 0; h < H; h++) combo_heads[p->combo[h]]++;
  for (int32_t i = 0; i < n; i++) {
    const int64_t *t = table + (size_t)find_len(uniq, nu, lengths[i]) * C * K;
    double pairs = 0;
    for (int32_t c = 0; c < C; c++) pairs += (double)combo_heads[c] * (double)t[c * K + base];
    cost[i] = p->cal.pair_s * pairs + mtrain_predictor_fixed_seconds(p, lengths[i]);
    weight[i] = o->method == MTRAIN_BATCH_COST ? cost[i] : (double)lengths[i];
    if (out) { /* the parts of a split document's share: ring-carried, paid by every rank */
      ring[i] = p->cal.pair_s * pairs + p->cal.row_s * (double)lengths[i] * H;
      once[i] =
          p->cal.seq_s * p->num_layers + (p->linear_flop_per_token > 0 ? p->cal.linear_seq_s : 0.0);
    }
  }
  /* 2. batching; a split document's seconds on each of its ranks, and the
   * split phase in seconds (its groups, in its order) */
  if (out) {
    const int by_cost = o->method == MTRAIN_BATCH_COST;
    MTRAIN_TRY(mtrain_balance_assign_split(weight, by_cost ? ring : NULL, by_cost ? once : NULL, n,
                                           R, o->micro_batches, o->method, sp, out));
    const double ovh = sp ? sp->ring_overhead : 1.0;
    for (int32_t i = 0; i < n; i++) {
      const int32_t k = out->num_ranks[i];
      out->share[i] = k == 1 ? cost[i] : once[i] + (cost[i] - once[i] + (ovh - 1) * ring[i]) / k;
      rk[i] = out->rank_of[i];
      mb[i] = out->micro_of[i];
    }
    for (int32_t j = 0; j < out->num_split; j++) {
      const int32_t i = out->split_order[j];
      const int32_t *g = out->group + out->offset[i];
      double start = 0;
      for (int32_t q = 0; q < out->num_ranks[i]; q++)
        start = ready[g[q]] > start ? ready[g[q]] : start;
      for (int32_t q = 0; q < out->num_ranks[i]; q++) {
        idle[g[q]] += start - ready[g[q]];
        ready[g[q]] = start + out->share[i];
        stokens[g[q]] += (double)lengths[i] / out->num_ranks[i];
      }
      out->start[i] = start;
    }
    for (int32_t r = 0; r < R; r++) before[r] = fixed[r] = ready[r];
  } else {
    MTRAIN_TRY(mtrain_balance_assign(weight, n, R, o->micro_batches, o->method, rk, mb));
  }
  for (int32_t i = 0; i < n; i++) {
    if (mb[i] < 0) continue; /* split: in the split phase */
    const int32_t r = rk[i];
    const int64_t *t = table + (size_t)find_len(uniq, nu, lengths[i]) * C * K;
    before[r] += cost[i];
    fixed[r] += mtrain_predictor_fixed_seconds(p, lengths[i]);
    tokens[r] += (double)lengths[i];
    for (int32_t j = 0; j < C * K; j++) P[(size_t)r * C * K + j] += (double)t[j];
  }
  for (int32_t r = 0; r < R; r++) {
    rep.max_before = before[r] > rep.max_before ? before[r] : rep.max_before;
    rep.mean_before += before[r] / R;
    rep.empty_ranks += tokens[r] == 0 && (!stokens || stokens[r] == 0);
  }
  /* 3. tuning */
  for (int32_t j = 0; j < R * H; j++) lv[j] = base;
  rs = calloc((size_t)R, sizeof *rs);
  MTRAIN_FAIL_IF(!rs, MTRAIN_ERR_OUT_OF_MEMORY, "balance batch: out of memory");
  for (int32_t r = 0; r < R; r++) {
    rs[r].p = p;
    rs[r].P = P + (size_t)r * C * K;
    rs[r].mass = mass;
    rs[r].lv = lv + (size_t)r * H;
    double pairs = 0;
    for (int32_t h = 0; h < H; h++) pairs += rs[r].P[p->combo[h] * K + base];
    rs[r].cost = fixed[r] + p->cal.pair_s * pairs;
  }
  rep.target_s = o->target_s > 0 ? o->target_s : rep.mean_before;
  if (o->tune) {
    double step = rep.target_s;
    for (int32_t r = 0; r < R; r++) {
      if (tokens[r] == 0 && (!stokens || stokens[r] == 0)) continue;
      rep.moves_down += tune_down(&rs[r], rep.target_s, lo);
      if (rs[r].cost > rep.target_s * (1 + 1e-12)) rep.ranks_over_target++;
      if (rs[r].cost > step) step = rs[r].cost;
    }
    for (int32_t r = 0; r < R; r++)
      if (tokens[r] > 0) rep.moves_up += tune_up(&rs[r], step, hi);
  }
  /* 4. report: exact recomputation of the tuned costs, recall */
  double total_tokens = 0;
  rep.worst_recall_before = rep.worst_recall_after = mass ? 1.0 : 0.0;
  for (int32_t r = 0; r < R; r++) {
    double pairs = 0;
    for (int32_t h = 0; h < H; h++) pairs += rs[r].P[p->combo[h] * K + rs[r].lv[h]];
    const double after = fixed[r] + p->cal.pair_s * pairs;
    if (rank_after) rank_after[r] = after;
    rep.max_after = after > rep.max_after ? after : rep.max_after;
    rep.mean_after += after / R;
    const double st_r = stokens ? stokens[r] : 0; /* split shares' tokens, at the base level */
    total_tokens += tokens[r];
    if (st_r > 0) total_tokens += st_r;
    if (!mass || (tokens[r] == 0 && st_r == 0)) continue;
    double mb0 = 0, mb1 = 0, mbs = 0;
    for (int32_t h = 0; h < H; h++) {
      const double m0 = mass[h * K + p->base_level], m1 = mass[h * K + rs[r].lv[h]],
                   ms = mass[h * K + base];
      mb0 += m0 / H;
      mb1 += m1 / H;
      mbs += ms / H;
      if (m0 < rep.worst_recall_before) rep.worst_recall_before = m0;
      if (tokens[r] > 0 && m1 < rep.worst_recall_after) rep.worst_recall_after = m1;
      if (st_r > 0 && ms < rep.worst_recall_after) rep.worst_recall_after = ms;
    }
    rep.recall_before += tokens[r] * mb0;
    rep.recall_after += tokens[r] * mb1;
    if (st_r > 0) {
      rep.recall_before += st_r * mb0;
      rep.recall_after += st_r * mbs;
    }
  }
  rep.recall_before /= total_tokens;
  rep.recall_after /= total_tokens;
  if (out) {
    for (int32_t r = 0; r < R; r++) {
      out->rank_load[r] = before[r];
      out->rank_idle[r] = idle[r];
    }
  } else {
    memcpy(rank_of, rk, (size_t)n * sizeof *rk);
    memcpy(micro_of, mb, (size_t)n * sizeof *mb);
  }
  if (levels) memcpy(levels, lv, (size_t)R * H * sizeof *lv);
  if (rank_before) memcpy(rank_before, before, (size_t)R * sizeof *before);
  if (report) *report = rep;
cleanup:
  mtrain_pm_scratch_free(&sc);
  free(uniq);
  free(table);
  free(cost);
  free(weight);
  free(P);
  free(before);
  free(fixed);
  free(tokens);
  free(rk);
  free(mb);
  free(lv);
  free(combo_heads);
  free(ring);
  free(once);
  free(ready);
  free(idle);
  free(stokens);
  free(rs);
  if (st != MTRAIN_SUCCESS && out) mtrain_balance_split_free(out);
  return st;
}

mtrain_status_t mtrain_balance_batch(const mtrain_balance_predictor_t *p, const int64_t *lengths,
                                     int32_t n, const double *mass,
                                     const mtrain_balance_batch_options_t *o, int32_t *rank_of,
                                     int32_t *micro_of, int32_t *levels, double *rank_before,
                                     double *rank_after, mtrain_balance_report_t *report) {
  MTRAIN_CHECK_NOT_NULL(p);
  MTRAIN_CHECK_NOT_NULL(lengths);
  MTRAIN_CHECK_NOT_NULL(o);
  MTRAIN_CHECK_NOT_NULL(rank_of);
  MTRAIN_CHECK_NOT_NULL(micro_of);
  return batch_impl(p, lengths, n, mass, o, NULL, NULL, rank_of, micro_of, levels, rank_before,
                    rank_after, report);
}

mtrain_status_t mtrain_balance_batch_split(const mtrain_balance_predictor_t *p,
                                           const int64_t *lengths, int32_t n, const double *mass,
                                           const mtrain_balance_batch_options_t *o,
                                           const mtrain_balance_split_options_t *sp,
                                           mtrain_balance_split_t *out, int32_t *levels,
                                           double *rank_before, double *rank_after,
                                           mtrain_balance_report_t *report) {
  MTRAIN_CHECK_NOT_NULL(out);
  memset(out, 0, sizeof *out);
  MTRAIN_CHECK_NOT_NULL(p);
  MTRAIN_CHECK_NOT_NULL(lengths);
  MTRAIN_CHECK_NOT_NULL(o);
  return batch_impl(p, lengths, n, mass, o, sp, out, NULL, NULL, levels, rank_before, rank_after,
                    report);
}
