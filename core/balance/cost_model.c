/* cost_model.c: the cost model and balance metrics of SPEC.md section 6,
 * counted directly from an owner map and the patterns, without building
 * plans. For every head, the number of listed key blocks (off and on the
 * block diagonal) and of bars each rank computes against each source rank's
 * chunk is counted; ring schedules then map sources to steps. Both bars
 * modes (in the ring, gathered up front) and both rings (flat,
 * hierarchical) come out of one pass. tests/test_cost_model.c checks the
 * counts against plans built by mtrain_plan_build_step_head.
 *
 * Counting, per head (nbr = blocks holding tokens, W ranks):
 *  - diagonal 0: each rank's own query blocks, at src == rank;
 *  - block diagonals grouped into maximal ranges [a, b] of consecutive
 *    values: a short range walks each diagonal (query gq, key gq - t), a
 *    range longer than W adds, per query block, per-owner prefix counts of
 *    the key blocks [gq - b, gq - a] (O(W) instead of O(b - a));
 *  - bars: per block vb holding c verticals, c for every query block after
 *    vb (per-rank prefix counts of query blocks), minus c for every query
 *    block vb + t with t a listed diagonal (the vertical is inside a listed
 *    block there), with the same short/long split.
 * Identical heads (same diagonals and verticals) are counted once. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/balance/cost_internal.h"
#include "core/layout/layout_internal.h"
#include "core/layout/schedule.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_error.h"

/* ---- per-owner prefix counts ------------------------------------------------------ */

typedef struct owner_tables {
  const int32_t *owner;
  int64_t nbr; /* blocks holding tokens; larger ids are padding */
  int32_t W;
  int32_t *pref; /* [(nbr + 1) * W]: pref[x * W + s] = #{k < x : owner[k] == s} */
} owner_tables_t;

static int owner_tables_init(owner_tables_t *t, const int32_t *owner, int64_t nbr, int32_t W) {
  t->owner = owner;
  t->nbr = nbr;
  t->W = W;
  t->pref = malloc((size_t)(nbr + 1) * (size_t)W * sizeof *t->pref);
  if (!t->pref) return 0;
  memset(t->pref, 0, (size_t)W * sizeof *t->pref);
  for (int64_t x = 0; x < nbr; x++) {
    memcpy(t->pref + (x + 1) * W, t->pref + x * W, (size_t)W * sizeof *t->pref);
    t->pref[(x + 1) * W + owner[x]]++;
  }
  return 1;
}

/* ---- one head ------------------------------------------------------------------------ */

/* Counts of one head: full[r * W + src], bars[r * W + src] (bars computed by
 * rank r against keys of src's chunk), diag[r]. */
typedef struct head_counts {
  int64_t *full, *bars, *diag;
  int64_t *ranges; /* scratch: diagonal ranges [a, b] pairs */
} head_counts_t;

static int head_counts_alloc(head_counts_t *c, int32_t W, int64_t nbr) {
  c->full = malloc((size_t)W * (size_t)W * sizeof *c->full);
  c->bars = malloc((size_t)W * (size_t)W * sizeof *c->bars);
  c->diag = malloc((size_t)W * sizeof *c->diag);
  c->ranges = malloc((size_t)(2 * nbr + 2) * sizeof *c->ranges);
  return c->full && c->bars && c->diag && c->ranges;
}

static void head_counts_free(head_counts_t *c) {
  free(c->full);
  free(c->bars);
  free(c->diag);
  free(c->ranges);
}

/* Maximal ranges of consecutive diagonals >= 1 that hold some query block
 * (clipped to nbr - 1); returns their number. */
static int64_t diagonal_ranges(const mtrain_pattern_head_t *h, int64_t nbr, int64_t *ranges) {
  int64_t n = 0;
  int32_t d = 0;
  while (d < h->num_diagonals && h->diagonals[d] < 1) d++;
  while (d < h->num_diagonals && h->diagonals[d] < nbr) {
    int64_t a = h->diagonals[d], b = a;
    while (d + 1 < h->num_diagonals && h->diagonals[d + 1] == b + 1) b = h->diagonals[++d];
    d++;
    if (b > nbr - 1) b = nbr - 1;
    ranges[2 * n] = a;
    ranges[2 * n + 1] = b;
    n++;
  }
  return n;
}

static void count_block_mask(const owner_tables_t *t, const mtrain_pattern_head_t *h,
                             head_counts_t *c) {
  const int32_t W = t->W;
  for (int64_t gq = 0; gq < t->nbr; gq++) {
    int64_t *row = c->full + (int64_t)t->owner[gq] * W;
    for (int64_t e = h->mask_off[gq]; e < h->mask_off[gq + 1]; e++)
      if (h->mask_idx[e] != gq) row[t->owner[h->mask_idx[e]]]++;
  }
}

/* The layout's diagonal table: for every block diagonal t >= 1 the
 * histogram of (owner of query block gq, owner of key block gq - t) over
 * gq in [t, nbr), stored sparsely. It depends on the layout only, and has
 * about W (striped) to 4W (zigzag) entries per diagonal for the layouts
 * here, so a head's diagonal t costs that many additions instead of nbr.
 * Built once per evaluation when it fits DIAG_TABLE_MAX entries. */
#define DIAG_TABLE_MAX ((int64_t)1 << 23)

typedef struct diag_table {
  int64_t *off; /* [nbr + 1]: entries of diagonal t at [off[t], off[t + 1]) */
  int32_t *idx; /* pair index owner(gq) * W + owner(gq - t) */
  int32_t *cnt;
} diag_table_t;

static void diag_table_free(diag_table_t *d) {
  free(d->off);
  free(d->idx);
  free(d->cnt);
  memset(d, 0, sizeof *d);
}

/* Returns 1 when built, 0 when it would exceed DIAG_TABLE_MAX entries or
 * memory ran out (the direct count is used then). */
static int diag_table_build(const owner_tables_t *t, diag_table_t *d) {
  const int32_t W = t->W;
  const int64_t nbr = t->nbr;
  int64_t cap = 4 * (int64_t)W * (nbr > 1 ? nbr : 1), n = 0;
  if (cap > DIAG_TABLE_MAX) cap = DIAG_TABLE_MAX;
  int32_t *dense = calloc((size_t)W * (size_t)W, sizeof *dense);
  int32_t *touched = malloc((size_t)W * (size_t)W * sizeof *touched);
  d->off = malloc((size_t)(nbr + 1) * sizeof *d->off);
  d->idx = malloc((size_t)cap * sizeof *d->idx);
  d->cnt = malloc((size_t)cap * sizeof *d->cnt);
  int ok = dense && touched && d->off && d->idx && d->cnt;
  if (ok) d->off[0] = d->off[1] = 0;
  for (int64_t k = 1; ok && k < nbr; k++) {
    int32_t nt = 0, prev = -1, run = 0;
    for (int64_t gq = k; gq <= nbr; gq++) {
      const int32_t idx = gq < nbr ? t->owner[gq] * W + t->owner[gq - k] : -1;
      if (idx == prev) {
        run++;
        continue;
      }
      if (prev >= 0) {
        if (dense[prev] == 0) touched[nt++] = prev;
        dense[prev] += run;
      }
      prev = idx;
      run = 1;
    }
    if (n + nt > cap) {
      int64_t grown = cap * 2 > n + nt ? cap * 2 : n + nt;
      if (grown > DIAG_TABLE_MAX) {
        ok = 0;
        break;
      }
      int32_t *i2 = realloc(d->idx, (size_t)grown * sizeof *i2);
      if (i2) d->idx = i2;
      int32_t *c2 = realloc(d->cnt, (size_t)grown * sizeof *c2);
      if (c2) d->cnt = c2;
      if (!i2 || !c2) {
        ok = 0;
        break;
      }
      cap = grown;
    }
    for (int32_t e = 0; e < nt; e++) {
      d->idx[n] = touched[e];
      d->cnt[n++] = dense[touched[e]];
      dense[touched[e]] = 0;
    }
    d->off[k + 1] = n;
  }
  free(dense);
  free(touched);
  if (!ok) diag_table_free(d);
  return ok;
}

static void count_diagonals(const owner_tables_t *t, const diag_table_t *table,
                            const int64_t *ranges, int64_t nr, head_counts_t *c) {
  const int32_t W = t->W;
  const int32_t *owner = t->owner;
  for (int64_t k = 0; k < nr; k++) {
    const int64_t a = ranges[2 * k], b = ranges[2 * k + 1];
    const int64_t long_cost = (t->nbr - a) * W;
    if (table->off && table->off[b + 1] - table->off[a] <= long_cost) {
      for (int64_t e = table->off[a]; e < table->off[b + 1]; e++)
        c->full[table->idx[e]] += table->cnt[e];
    } else if (!table->off && b - a + 1 <= W) {
      /* runs of equal (owner, owner) pairs are added at once: layouts with
       * long runs (contiguous, zigzag) would otherwise chain increments of
       * one counter */
      for (int64_t d = a; d <= b; d++) {
        const int32_t *oq = owner + d;
        const int64_t n = t->nbr - d;
        int64_t prev = -1, run = 0;
        for (int64_t i = 0; i < n; i++) {
          const int64_t idx = (int64_t)oq[i] * W + owner[i];
          if (idx == prev) {
            run++;
          } else {
            if (prev >= 0) c->full[prev] += run;
            prev = idx;
            run = 1;
          }
        }
        if (prev >= 0) c->full[prev] += run;
      }
    } else {
      for (int64_t gq = a; gq < t->nbr; gq++) {
        const int64_t lo = gq - b > 0 ? gq - b : 0, hi = gq - a + 1;
        const int32_t *p1 = t->pref + hi * W, *p0 = t->pref + lo * W;
        int64_t *row = c->full + (int64_t)owner[gq] * W;
        for (int32_t s = 0; s < W; s++) row[s] += p1[s] - p0[s];
      }
    }
  }
}

static void count_bars(const owner_tables_t *t, const mtrain_pattern_head_t *h,
                       const int64_t *ranges, int64_t nr, int32_t G, head_counts_t *c) {
  const int32_t W = t->W;
  const int32_t *owner = t->owner;
  const int32_t *last = t->pref + t->nbr * W;
  for (int32_t i = 0; i < h->num_verticals;) {
    const int64_t vb = h->verticals[i] / G;
    int64_t cnt = 0;
    while (i < h->num_verticals && h->verticals[i] / G == vb) i++, cnt++;
    if (vb + 1 >= t->nbr) break; /* no query block after it */
    const int32_t src = owner[vb];
    const int32_t *after = t->pref + (vb + 1) * W;
    for (int32_t r = 0; r < W; r++) c->bars[(int64_t)r * W + src] += cnt * (last[r] - after[r]);
    for (int64_t k = 0; k < nr; k++) {
      const int64_t q0 = vb + ranges[2 * k];
      if (q0 >= t->nbr) break;
      const int64_t q1 = vb + ranges[2 * k + 1] < t->nbr ? vb + ranges[2 * k + 1] : t->nbr - 1;
      if (q1 - q0 + 1 <= W) {
        for (int64_t gq = q0; gq <= q1; gq++) c->bars[(int64_t)owner[gq] * W + src] -= cnt;
      } else {
        const int32_t *p1 = t->pref + (q1 + 1) * W, *p0 = t->pref + q0 * W;
        for (int32_t r = 0; r < W; r++) c->bars[(int64_t)r * W + src] -= cnt * (p1[r] - p0[r]);
      }
    }
  }
}

static void count_head(const owner_tables_t *t, const diag_table_t *table,
                       const mtrain_pattern_head_t *h, int32_t G, head_counts_t *c) {
  const int32_t W = t->W;
  memset(c->full, 0, (size_t)W * (size_t)W * sizeof *c->full);
  memset(c->bars, 0, (size_t)W * (size_t)W * sizeof *c->bars);
  for (int32_t r = 0; r < W; r++) c->diag[r] = t->pref[t->nbr * W + r];
  if (h->mask_off) {
    count_block_mask(t, h, c);
    return;
  }
  const int64_t nr = diagonal_ranges(h, t->nbr, c->ranges);
  count_diagonals(t, table, c->ranges, nr, c);
  if (h->num_verticals) count_bars(t, h, c->ranges, nr, G, c);
}

/* Bars of share `step` when B bars are split evenly over W steps. */
static int64_t bar_share(int64_t B, int32_t step, int32_t W) {
  return (B * (step + 1)) / W - (B * step) / W;
}

/* ---- grouping identical heads -------------------------------------------------------- */

typedef struct head_ref {
  uint64_t hash;
  int32_t index; /* global head index */
  int32_t layer, head;
} head_ref_t;

static uint64_t mix(uint64_t h, uint64_t x) {
  h ^= x + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0xBF58476D1CE4E5B9ull;
}

static uint64_t head_hash(const mtrain_pattern_head_t *h, int32_t index) {
  if (h->mask_off) return mix(0xB10C, (uint64_t)index); /* block masks are never merged */
  uint64_t x = mix((uint64_t)h->num_diagonals, (uint64_t)h->num_verticals);
  for (int32_t d = 0; d < h->num_diagonals; d++) x = mix(x, (uint64_t)h->diagonals[d]);
  for (int32_t v = 0; v < h->num_verticals; v++) x = mix(x, (uint64_t)h->verticals[v]);
  return x;
}

static int same_head(const mtrain_pattern_head_t *a, const mtrain_pattern_head_t *b) {
  if (a->mask_off || b->mask_off) return a == b;
  return a->num_diagonals == b->num_diagonals && a->num_verticals == b->num_verticals &&
         !memcmp(a->diagonals, b->diagonals, (size_t)a->num_diagonals * sizeof *a->diagonals) &&
         (a->num_verticals == 0 ||
          !memcmp(a->verticals, b->verticals, (size_t)a->num_verticals * sizeof *a->verticals));
}

static int cmp_ref(const void *x, const void *y) {
  const head_ref_t *a = x, *b = y;
  if (a->hash != b->hash) return a->hash < b->hash ? -1 : 1;
  return (a->index > b->index) - (a->index < b->index);
}

/* ---- evaluation ------------------------------------------------------------------------ */

void mtrain_cost_destroy(mtrain_cost_t *c) {
  if (!c) return;
  free(c->layer_first_head);
  for (int r = 0; r < 2; r++) free(c->step_src[r]);
  free(c->full);
  free(c->diag);
  free(c->bars_ring);
  free(c->bars_gathered);
  for (int m = 0; m < 2; m++)
    for (int r = 0; r < 2; r++) {
      free(c->head_sync[m][r]);
      free(c->layer_sync[m][r]);
    }
  free(c->head_imbalance);
  free(c);
}

static double work_of(int64_t full, int64_t diag, int64_t bars, int32_t G) {
  const double g = (double)G;
  return (double)full * g * g + (double)diag * g * g * 0.5 + (double)bars * g;
}

double mtrain_work_of(const mtrain_work_counts_t *c, int32_t granularity) {
  return c ? work_of(c->full_blocks, c->diag_blocks, c->bars, granularity) : 0.0;
}

/* Counts of (rank, step) from (rank, src) matrices; `bars_gathered` may be
 * NULL with mode IN_RING. B[r] is used for GATHERED when gathered is NULL
 * (one head: the even split of its per-rank bar total). */
static void step_counts(const mtrain_cost_t *c, int mode, int ring, const int64_t *full,
                        const int64_t *diag, const int64_t *bars_ring, const int64_t *bars_gathered,
                        const int64_t *B, int32_t r, int32_t t, mtrain_work_counts_t *out) {
  const int32_t W = c->world;
  const int32_t src = c->step_src[ring][r * W + t];
  out->full_blocks = full[r * W + src];
  out->diag_blocks = src == r ? diag[r] : 0;
  if (mode == MTRAIN_BARS_IN_RING)
    out->bars = bars_ring[r * W + src];
  else
    out->bars = bars_gathered ? bars_gathered[r * W + t] : bar_share(B[r], t, W);
}

/* Sum over steps of the max over ranks, and the total, of one (mode, ring). */
static void step_max(const mtrain_cost_t *c, int mode, int ring, const int64_t *full,
                     const int64_t *diag, const int64_t *bars_ring, const int64_t *bars_gathered,
                     const int64_t *B, double *max_sum, double *total) {
  const int32_t W = c->world;
  *max_sum = 0.0;
  *total = 0.0;
  for (int32_t t = 0; t < W; t++) {
    double mx = 0.0;
    for (int32_t r = 0; r < W; r++) {
      mtrain_work_counts_t k;
      step_counts(c, mode, ring, full, diag, bars_ring, bars_gathered, B, r, t, &k);
      const double w = mtrain_work_of(&k, c->granularity);
      if (w > mx) mx = w;
      *total += w;
    }
    *max_sum += mx;
  }
}

/* Adds one head's counts to its layer and records its per-head figures. */
static void add_head(mtrain_cost_t *c, const head_counts_t *hc, int64_t *B, int32_t layer,
                     int32_t index) {
  const int32_t W = c->world;
  for (int32_t r = 0; r < W; r++) {
    B[r] = 0;
    for (int32_t s = 0; s < W; s++) B[r] += hc->bars[r * W + s];
  }
  for (int m = 0; m < 2; m++)
    for (int ring = 0; ring < 2; ring++) {
      double mx, total;
      step_max(c, m, ring, hc->full, hc->diag, hc->bars, NULL, B, &mx, &total);
      c->head_sync[m][ring][index] = total > 0 ? mx / (total / W) : 1.0;
    }
  double total = 0.0, top = 0.0;
  for (int32_t r = 0; r < W; r++) {
    double tr = 0.0;
    for (int32_t s = 0; s < W; s++)
      tr += work_of(hc->full[r * W + s], s == r ? hc->diag[r] : 0, hc->bars[r * W + s],
                    c->granularity);
    total += tr;
    if (tr > top) top = tr;
  }
  c->head_imbalance[index] = total > 0 ? top / (total / W) : 1.0;
  const int64_t off2 = (int64_t)layer * W * W;
  /* unnamed: a named critical section makes GCC emit a global lock symbol
   * (.gomp_critical_user_NAME) that libmtrain.so would export */
#pragma omp critical
  {
    for (int32_t i = 0; i < W * W; i++) {
      c->full[off2 + i] += hc->full[i];
      c->bars_ring[off2 + i] += hc->bars[i];
    }
    for (int32_t r = 0; r < W; r++) {
      c->diag[(int64_t)layer * W + r] += hc->diag[r];
      for (int32_t t = 0; t < W; t++) c->bars_gathered[off2 + r * W + t] += bar_share(B[r], t, W);
    }
  }
}

/* Whole-model and per-layer figures from the per-layer counts. */
static void finish_metrics(mtrain_cost_t *c) {
  const int32_t W = c->world;
  double *rank_total = calloc((size_t)W, sizeof *rank_total);
  double total = 0.0;
  for (int32_t l = 0; l < c->num_layers; l++) {
    const int64_t off2 = (int64_t)l * W * W;
    for (int32_t r = 0; r < W; r++)
      for (int32_t s = 0; s < W; s++) {
        const double w = work_of(c->full[off2 + r * W + s], s == r ? c->diag[l * W + r] : 0,
                                 c->bars_ring[off2 + r * W + s], c->granularity);
        if (rank_total) rank_total[r] += w;
        total += w;
      }
  }
  double top = 0.0;
  for (int32_t r = 0; rank_total && r < W; r++)
    if (rank_total[r] > top) top = rank_total[r];
  free(rank_total);
  for (int m = 0; m < 2; m++)
    for (int ring = 0; ring < 2; ring++) {
      mtrain_cost_metrics_t *x = &c->metrics[m][ring];
      memset(x, 0, sizeof *x);
      x->total_work = total;
      x->max_rank_work = top;
      x->worker_imbalance = total > 0 ? top / (total / W) : 1.0;
      for (int32_t l = 0; l < c->num_layers; l++) {
        const int64_t off2 = (int64_t)l * W * W;
        double mx, lt;
        step_max(c, m, ring, c->full + off2, c->diag + (int64_t)l * W, c->bars_ring + off2,
                 c->bars_gathered + off2, NULL, &mx, &lt);
        c->layer_sync[m][ring][l] = lt > 0 ? mx / (lt / W) : 1.0;
        x->step_max_sum += mx;
      }
      x->ring_sync_slowdown = total > 0 ? x->step_max_sum / (total / W) : 1.0;
      x->worst_head = 0;
      x->worst_head_slowdown = 0.0;
      for (int32_t h = 0; h < c->num_heads; h++)
        if (c->head_sync[m][ring][h] > x->worst_head_slowdown) {
          x->worst_head_slowdown = c->head_sync[m][ring][h];
          x->worst_head = h;
        }
    }
}

static mtrain_status_t cost_alloc(mtrain_cost_t *c, const mtrain_pattern_t *const *patterns) {
  const int32_t W = c->world;
  const size_t w2 = (size_t)W * (size_t)W, nl = (size_t)c->num_layers;
  c->layer_first_head = malloc((nl + 1) * sizeof *c->layer_first_head);
  if (!c->layer_first_head) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cost: out of memory");
  c->layer_first_head[0] = 0;
  for (size_t l = 0; l < nl; l++) {
    if ((int64_t)c->layer_first_head[l] + patterns[l]->num_heads > INT32_MAX)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cost: more than 2^31 - 1 heads in all");
    c->layer_first_head[l + 1] = c->layer_first_head[l] + patterns[l]->num_heads;
  }
  c->num_heads = c->layer_first_head[nl];
  const size_t nh = (size_t)c->num_heads;
  int ok = 1;
  for (int r = 0; r < 2; r++) ok &= (c->step_src[r] = malloc(w2 * sizeof(int32_t))) != NULL;
  ok &= (c->full = calloc(nl * w2, sizeof *c->full)) != NULL;
  ok &= (c->bars_ring = calloc(nl * w2, sizeof *c->bars_ring)) != NULL;
  ok &= (c->bars_gathered = calloc(nl * w2, sizeof *c->bars_gathered)) != NULL;
  ok &= (c->diag = calloc(nl * (size_t)W, sizeof *c->diag)) != NULL;
  ok &= (c->head_imbalance = calloc(nh, sizeof(double))) != NULL;
  for (int m = 0; m < 2; m++)
    for (int r = 0; r < 2; r++) {
      ok &= (c->head_sync[m][r] = calloc(nh, sizeof(double))) != NULL;
      ok &= (c->layer_sync[m][r] = calloc(nl, sizeof(double))) != NULL;
    }
  if (!ok)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cost: out of memory for %d layers, %d ranks",
                        c->num_layers, W);
  for (int32_t r = 0; r < W; r++)
    for (int32_t t = 0; t < W; t++) {
      mtrain_ring_source(W, 0, r, t, &c->step_src[MTRAIN_RING_FLAT][r * W + t]);
      mtrain_ring_source(W, c->ranks_per_node, r, t,
                         &c->step_src[MTRAIN_RING_HIERARCHICAL][r * W + t]);
    }
  return MTRAIN_SUCCESS;
}

/* Distinct heads (representatives) and, per representative, its members. */
typedef struct head_groups {
  head_ref_t *refs; /* all heads, sorted by hash then index */
  int32_t *rep_of;  /* [num_heads] position in refs of each ref's representative */
  int32_t *reps;    /* positions in refs of representatives */
  int32_t num_reps;
} head_groups_t;

static const mtrain_pattern_head_t *ref_head(const mtrain_pattern_t *const *patterns,
                                             const head_ref_t *r) {
  return &patterns[r->layer]->heads[r->head];
}

static int group_heads(const mtrain_pattern_t *const *patterns, int32_t num_layers,
                       int32_t num_heads, head_groups_t *g) {
  g->refs = malloc((size_t)num_heads * sizeof *g->refs);
  g->rep_of = malloc((size_t)num_heads * sizeof *g->rep_of);
  g->reps = malloc((size_t)num_heads * sizeof *g->reps);
  g->num_reps = 0;
  if (!g->refs || !g->rep_of || !g->reps) return 0;
  int32_t n = 0;
  for (int32_t l = 0; l < num_layers; l++)
    for (int32_t h = 0; h < patterns[l]->num_heads; h++, n++) {
      g->refs[n].index = n;
      g->refs[n].layer = l;
      g->refs[n].head = h;
      g->refs[n].hash = head_hash(&patterns[l]->heads[h], n);
    }
  qsort(g->refs, (size_t)num_heads, sizeof *g->refs, cmp_ref);
  for (int32_t i = 0; i < num_heads;) {
    int32_t j = i;
    while (j < num_heads && g->refs[j].hash == g->refs[i].hash) j++;
    const int32_t first_rep = g->num_reps;
    for (int32_t k = i; k < j; k++) {
      int32_t found = -1;
      for (int32_t q = first_rep; q < g->num_reps && found < 0; q++)
        if (same_head(ref_head(patterns, &g->refs[g->reps[q]]), ref_head(patterns, &g->refs[k])))
          found = g->reps[q];
      if (found < 0) {
        found = k;
        g->reps[g->num_reps++] = k;
      }
      g->rep_of[k] = found;
    }
    i = j;
  }
  return 1;
}

static void head_groups_free(head_groups_t *g) {
  free(g->refs);
  free(g->rep_of);
  free(g->reps);
}

static mtrain_status_t check_patterns(const mtrain_pattern_t *const *patterns, int32_t num_patterns,
                                      int64_t seq_len, int32_t G) {
  if (!patterns) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "cost: patterns is NULL");
  if (num_patterns < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cost: num_patterns %d must be >= 1",
                        num_patterns);
  for (int32_t i = 0; i < num_patterns; i++) {
    if (!patterns[i]) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "cost: patterns[%d] is NULL", i);
    if (patterns[i]->seq_len != seq_len || patterns[i]->granularity != G)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "cost: patterns[%d] has seq_len %lld and granularity %d, the layout "
                          "%lld and %d",
                          i, (long long)patterns[i]->seq_len, patterns[i]->granularity,
                          (long long)seq_len, G);
  }
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cost_evaluate_owner(const int32_t *owner, int64_t num_blocks,
                                           int64_t seq_len, int32_t granularity, int32_t world,
                                           int32_t ranks_per_node, mtrain_bars_mode_t mode,
                                           const mtrain_pattern_t *const *patterns,
                                           int32_t num_patterns, int flags, mtrain_cost_t **out) {
  int32_t L = 0;
  mtrain_status_t st = mtrain_ring_check(world, ranks_per_node, &L);
  if (st != MTRAIN_SUCCESS) return mtrain_error_prefix(st, "cost");
  st = check_patterns(patterns, num_patterns, seq_len, granularity);
  if (st != MTRAIN_SUCCESS) return st;
  mtrain_cost_t *c = calloc(1, sizeof *c);
  if (!c) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cost: out of memory");
  c->world = world;
  c->granularity = granularity;
  c->ranks_per_node = ranks_per_node;
  c->num_layers = num_patterns;
  c->mode = mode;
  owner_tables_t tables = {0};
  diag_table_t table = {0};
  head_groups_t groups = {0};
  st = cost_alloc(c, patterns);
  if (st != MTRAIN_SUCCESS) goto done;
  const int64_t nbr = (seq_len + granularity - 1) / granularity;
  if (nbr > num_blocks) {
    st = mtrain_error(MTRAIN_ERR_INTERNAL, "cost: %lld sequence blocks, only %lld laid out",
                      (long long)nbr, (long long)num_blocks);
    goto done;
  }
  if (!owner_tables_init(&tables, owner, nbr, world) ||
      !group_heads(patterns, num_patterns, c->num_heads, &groups)) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cost: out of memory for %lld blocks, %d ranks",
                      (long long)nbr, world);
    goto done;
  }
  if (!(flags & MTRAIN_COST_DIRECT)) diag_table_build(&tables, &table);
  int failed = 0;
#pragma omp parallel
  {
    head_counts_t hc = {0};
    int64_t *B = malloc((size_t)world * sizeof *B);
    const int ok = head_counts_alloc(&hc, world, nbr) && B;
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int32_t k = 0; k < groups.num_reps; k++) {
      if (!ok) continue;
      const head_ref_t *rep = &groups.refs[groups.reps[k]];
      count_head(&tables, &table, ref_head(patterns, rep), granularity, &hc);
      /* members: every ref whose representative is this one (same hash run) */
      for (int32_t i = groups.reps[k]; i < c->num_heads && groups.refs[i].hash == rep->hash; i++)
        if (groups.rep_of[i] == groups.reps[k])
          add_head(c, &hc, B, groups.refs[i].layer, groups.refs[i].index);
    }
    head_counts_free(&hc);
    free(B);
  }
  if (failed) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cost: out of memory for per-thread counts");
    goto done;
  }
  finish_metrics(c);
done:
  free(tables.pref);
  diag_table_free(&table);
  head_groups_free(&groups);
  if (st != MTRAIN_SUCCESS) {
    mtrain_cost_destroy(c);
    return st;
  }
  *out = c;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cost_evaluate(const mtrain_layout_t *layout,
                                     const mtrain_pattern_t *const *patterns, int32_t num_patterns,
                                     const mtrain_cost_options_t *options, mtrain_cost_t **out) {
  MTRAIN_CHECK_NOT_NULL(layout);
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_cost_options_t o = MTRAIN_COST_OPTIONS_INIT;
  if (options) o = *options;
  if (o.bars_mode != -1 && o.bars_mode != MTRAIN_BARS_IN_RING &&
      o.bars_mode != MTRAIN_BARS_GATHERED)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cost: bars_mode %d is not -1 (the layout's), 0 (in_ring) or 1 (gathered)",
                        o.bars_mode);
  const mtrain_bars_mode_t mode =
      o.bars_mode == -1 ? layout->bars_mode : (mtrain_bars_mode_t)o.bars_mode;
  return mtrain_cost_evaluate_owner(layout->owner, layout->num_blocks, layout->seq_len,
                                    layout->granularity, layout->world, o.ranks_per_node, mode,
                                    patterns, num_patterns, 0, out);
}

/* ---- accessors ---------------------------------------------------------------------- */

int32_t mtrain_cost_world(const mtrain_cost_t *c) { return c ? c->world : 0; }
int32_t mtrain_cost_ranks_per_node(const mtrain_cost_t *c) { return c ? c->ranks_per_node : 0; }
int32_t mtrain_cost_num_layers(const mtrain_cost_t *c) { return c ? c->num_layers : 0; }
int32_t mtrain_cost_num_heads(const mtrain_cost_t *c) { return c ? c->num_heads : 0; }
mtrain_bars_mode_t mtrain_cost_bars_mode(const mtrain_cost_t *c) {
  return c ? c->mode : MTRAIN_BARS_IN_RING;
}

static int ring_ok(mtrain_ring_kind_t ring) {
  return ring == MTRAIN_RING_FLAT || ring == MTRAIN_RING_HIERARCHICAL;
}

mtrain_status_t mtrain_cost_metrics(const mtrain_cost_t *c, mtrain_ring_kind_t ring,
                                    mtrain_cost_metrics_t *out) {
  MTRAIN_CHECK_NOT_NULL(c);
  MTRAIN_CHECK_NOT_NULL(out);
  if (!ring_ok(ring))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cost: ring kind %d is not flat (0) or "
                        "hierarchical (1)",
                        (int)ring);
  *out = c->metrics[c->mode][ring];
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_cost_counts(const mtrain_cost_t *c, mtrain_ring_kind_t ring, int32_t layer,
                                   int32_t rank, int32_t step, mtrain_work_counts_t *out) {
  MTRAIN_CHECK_NOT_NULL(c);
  MTRAIN_CHECK_NOT_NULL(out);
  if (!ring_ok(ring))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cost: ring kind %d is not flat (0) or hierarchical (1)", (int)ring);
  if (layer < -1 || layer >= c->num_layers)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cost: layer %d out of range [-1, %d)", layer,
                        c->num_layers);
  const int32_t W = c->world;
  if (rank < 0 || rank >= W || step < 0 || step >= W)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cost: rank %d or step %d out of range [0, %d)", rank, step, W);
  mtrain_work_counts_t sum = {0, 0, 0};
  const int32_t l0 = layer < 0 ? 0 : layer, l1 = layer < 0 ? c->num_layers : layer + 1;
  for (int32_t l = l0; l < l1; l++) {
    const int64_t off2 = (int64_t)l * W * W;
    mtrain_work_counts_t k;
    step_counts(c, c->mode, ring, c->full + off2, c->diag + (int64_t)l * W, c->bars_ring + off2,
                c->bars_gathered + off2, NULL, rank, step, &k);
    sum.full_blocks += k.full_blocks;
    sum.diag_blocks += k.diag_blocks;
    sum.bars += k.bars;
  }
  *out = sum;
  return MTRAIN_SUCCESS;
}

double mtrain_cost_work(const mtrain_cost_t *c, mtrain_ring_kind_t ring, int32_t layer,
                        int32_t rank, int32_t step) {
  if (!c || !ring_ok(ring) || layer < -1 || layer >= c->num_layers || rank < 0 ||
      rank >= c->world || step < 0 || step >= c->world)
    return 0.0;
  mtrain_work_counts_t k;
  mtrain_cost_counts(c, ring, layer, rank, step, &k);
  return mtrain_work_of(&k, c->granularity);
}

double mtrain_cost_head_ring_sync(const mtrain_cost_t *c, mtrain_ring_kind_t ring, int32_t head) {
  if (!c || !ring_ok(ring) || head < 0 || head >= c->num_heads) return 0.0;
  return c->head_sync[c->mode][ring][head];
}

double mtrain_cost_head_worker_imbalance(const mtrain_cost_t *c, int32_t head) {
  if (!c || head < 0 || head >= c->num_heads) return 0.0;
  return c->head_imbalance[head];
}

double mtrain_cost_layer_ring_sync(const mtrain_cost_t *c, mtrain_ring_kind_t ring, int32_t layer) {
  if (!c || !ring_ok(ring) || layer < 0 || layer >= c->num_layers) return 0.0;
  return c->layer_sync[c->mode][ring][layer];
}
