/* plan.c: the plan (SPEC.md section 4): for every sequence, ring step and
 * head, which key blocks (as runs of local key blocks) and which bar columns
 * (as segments of the chunk's vertical list) each local query block computes.
 * Built from patterns and the blocks each rank holds; the layouts that decide
 * those blocks live elsewhere (single rank: the identity). */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/layout/schedule.h"
#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"

/* ---- a growable int32 array ------------------------------------------------ */

typedef struct ivec {
  int32_t *data;
  int64_t size, cap;
} ivec_t;

static int ivec_push(ivec_t *v, int32_t x) {
  if (v->size == v->cap) {
    int64_t cap = v->cap ? v->cap * 2 : 64;
    int32_t *d = realloc(v->data, (size_t)cap * sizeof *d);
    if (!d) return 0;
    v->data = d;
    v->cap = cap;
  }
  v->data[v->size++] = x;
  return 1;
}

/* First index in the increasing array a[0..n) with a[i] >= x. */
static int32_t lower_bound64(const int64_t *a, int32_t n, int64_t x) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo) / 2;
    if (a[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static int cmp_i64(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Appends local key-block run [lo, hi), merging with the previous run. */
static int push_run(ivec_t *runs, int64_t run_begin, int32_t lo, int32_t hi) {
  if (lo >= hi) return 1;
  if (runs->size > run_begin && runs->data[runs->size - 1] == lo) {
    runs->data[runs->size - 1] = hi;
    return 1;
  }
  return ivec_push(runs, lo) && ivec_push(runs, hi);
}

/* Valid rows of local block lb (padding and the partial tail excluded). */
static int64_t rows_of(const mtrain_rank_blocks_t *b, int32_t lb, int64_t seq_len, int32_t G) {
  return mtrain_block_rows(b->tokens, G, lb, b->global[lb], seq_len);
}

/* ---- what the step builder reads, built once ------------------------------- *
 * The builder's answers are those of the plain walk it replaces (kept as
 * tests/reference/plan_ref.c and tested bitwise against it): the same runs,
 * segments, bars and pair counts, found with tables instead of searches. */

/* One head of a pattern: its diagonal set as a bitmap and as maximal ranges
 * of consecutive diagonals (ascending). Block-mask heads have neither. */
typedef struct head_aux {
  uint8_t *has_diag; /* [num_blocks] */
  int32_t *range_lo, *range_hi;
  int32_t num_ranges;
} head_aux_t;

static void head_aux_free(head_aux_t *a) {
  free(a->has_diag);
  free(a->range_lo);
  free(a->range_hi);
  memset(a, 0, sizeof *a);
}

static int head_aux_build(const mtrain_pattern_t *pattern, int32_t head, head_aux_t *a) {
  const mtrain_pattern_head_t *h = &pattern->heads[head];
  memset(a, 0, sizeof *a);
  if (h->mask_off) return 1;
  a->has_diag = calloc((size_t)pattern->num_blocks + 1, 1);
  a->range_lo = malloc(sizeof(int32_t) * (size_t)(h->num_diagonals + 1));
  a->range_hi = malloc(sizeof(int32_t) * (size_t)(h->num_diagonals + 1));
  if (!a->has_diag || !a->range_lo || !a->range_hi) return 0;
  for (int32_t d = 0; d < h->num_diagonals; d++) {
    const int32_t t = h->diagonals[d];
    a->has_diag[t] = 1;
    if (a->num_ranges > 0 && a->range_hi[a->num_ranges - 1] == t - 1) {
      a->range_hi[a->num_ranges - 1] = t;
    } else {
      a->range_lo[a->num_ranges] = t;
      a->range_hi[a->num_ranges] = t;
      a->num_ranges++;
    }
  }
  return 1;
}

/* One chunk (the key side of a step): lower_bound of every global block
 * in its increasing block list, and the prefix sums of its blocks' rows. */
typedef struct chunk_aux {
  int32_t *lb;         /* [lb_size]: lb[x] = lower_bound(k->global, x) */
  int64_t lb_size;     /* entries x >= lb_size map to num_blocks */
  int64_t *row_prefix; /* [num_blocks + 1] */
} chunk_aux_t;

static void chunk_aux_free(chunk_aux_t *c) {
  free(c->lb);
  free(c->row_prefix);
  memset(c, 0, sizeof *c);
}

/* `max_global`: the largest global block any query or key of the plan has. */
static int chunk_aux_build(const mtrain_rank_blocks_t *k, int64_t max_global, int64_t seq_len,
                           int32_t G, chunk_aux_t *c) {
  memset(c, 0, sizeof *c);
  c->lb_size = max_global + 2;
  c->lb = malloc(sizeof(int32_t) * (size_t)c->lb_size);
  c->row_prefix = malloc(sizeof(int64_t) * (size_t)(k->num_blocks + 1));
  if (!c->lb || !c->row_prefix) return 0;
  int32_t i = 0;
  for (int64_t x = 0; x < c->lb_size; x++) {
    while (i < k->num_blocks && k->global[i] < x) i++;
    c->lb[x] = i;
  }
  c->row_prefix[0] = 0;
  for (int32_t b = 0; b < k->num_blocks; b++)
    c->row_prefix[b + 1] = c->row_prefix[b] + rows_of(k, b, seq_len, G);
  return 1;
}

static inline int32_t chunk_lower_bound(const chunk_aux_t *c, const mtrain_rank_blocks_t *k,
                                        int64_t x) {
  if (x <= 0) return 0;
  return x < c->lb_size ? c->lb[x] : k->num_blocks;
}

/* The largest global block of the blocks lists (0 when all are empty). */
static int64_t max_global_of(const mtrain_rank_blocks_t *a, const mtrain_rank_blocks_t *b) {
  int64_t m = 0;
  if (a->num_blocks > 0 && a->global[a->num_blocks - 1] > m) m = a->global[a->num_blocks - 1];
  if (b->num_blocks > 0 && b->global[b->num_blocks - 1] > m) m = b->global[b->num_blocks - 1];
  return m;
}

/* Key-block runs of query block gq for a vertical-slash head: the ranges of
 * consecutive diagonals from the largest (earliest key block) to the
 * smallest, the first clipped at gq, each mapped to a local range of the
 * chunk. */
static int runs_vertical_slash(const head_aux_t *a, int64_t gq, const mtrain_rank_blocks_t *k,
                               const chunk_aux_t *c, ivec_t *runs) {
  int64_t run_begin = runs->size;
  /* the last range starting at or before gq */
  int32_t lo = 0, hi = a->num_ranges;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo) / 2;
    if (a->range_lo[mid] <= gq)
      lo = mid + 1;
    else
      hi = mid;
  }
  for (int32_t r = lo - 1; r >= 0; r--) {
    const int64_t hi_t = a->range_hi[r] < gq ? a->range_hi[r] : gq, lo_t = a->range_lo[r];
    /* global key blocks [gq - hi_t, gq - lo_t] */
    if (!push_run(runs, run_begin, chunk_lower_bound(c, k, gq - hi_t),
                  chunk_lower_bound(c, k, gq - lo_t + 1)))
      return 0;
  }
  return 1;
}

static int runs_block_mask(const mtrain_pattern_head_t *h, int64_t gq,
                           const mtrain_rank_blocks_t *k, const chunk_aux_t *c, ivec_t *runs) {
  int64_t run_begin = runs->size;
  for (int64_t e = h->mask_off[gq]; e < h->mask_off[gq + 1]; e++) {
    int32_t lb = chunk_lower_bound(c, k, h->mask_idx[e]);
    if (lb < k->num_blocks && k->global[lb] == h->mask_idx[e])
      if (!push_run(runs, run_begin, lb, lb + 1)) return 0;
  }
  return 1;
}

/* The chunk's bars: verticals of the head that lie in the chunk, as local
 * positions, with the distinct global blocks they fall in (bar_block[] with
 * bar_start[] CSR offsets into bars) and, for every global block of the
 * sequence, its index among them (-1: no bar there). */
typedef struct chunk_bars {
  ivec_t bars;
  int64_t *block; /* distinct global blocks */
  int32_t *start; /* [num_blocks + 1] */
  int32_t num_blocks;
  int32_t *index_of; /* [pattern num_blocks] */
} chunk_bars_t;

static void chunk_bars_free(chunk_bars_t *cb) {
  free(cb->bars.data);
  free(cb->block);
  free(cb->start);
  free(cb->index_of);
}

/* Sizes the arrays for `nv` bars; `nb` global blocks of the sequence. */
static int chunk_bars_alloc(chunk_bars_t *cb, int32_t nv, int64_t nb) {
  memset(cb, 0, sizeof *cb);
  cb->block = malloc((size_t)(nv + 1) * sizeof *cb->block);
  cb->start = malloc((size_t)(nv + 1) * sizeof *cb->start);
  cb->index_of = malloc((size_t)(nb + 1) * sizeof *cb->index_of);
  cb->bars.cap = nv + 1;
  cb->bars.data = malloc((size_t)cb->bars.cap * sizeof *cb->bars.data);
  if (!cb->block || !cb->start || !cb->index_of || !cb->bars.data) return 0;
  for (int64_t b = 0; b <= nb; b++) cb->index_of[b] = -1;
  return 1;
}

/* Adds bar `value` in global block gb (blocks in increasing order). */
static void chunk_bars_add(chunk_bars_t *cb, int64_t gb, int32_t value) {
  if (cb->num_blocks == 0 || cb->block[cb->num_blocks - 1] != gb) {
    cb->block[cb->num_blocks] = gb;
    cb->start[cb->num_blocks] = (int32_t)cb->bars.size;
    cb->index_of[gb] = cb->num_blocks;
    cb->num_blocks++;
  }
  cb->bars.data[cb->bars.size++] = value; /* capacity: one per vertical */
}

static int chunk_bars_build(const mtrain_pattern_t *pattern, const mtrain_pattern_head_t *h,
                            const mtrain_rank_blocks_t *k, const chunk_aux_t *c, chunk_bars_t *cb) {
  const int32_t G = pattern->granularity;
  if (!chunk_bars_alloc(cb, h->num_verticals, pattern->num_blocks)) return 0;
  for (int32_t i = 0; i < h->num_verticals; i++) {
    int64_t gb = h->verticals[i] / G;
    int32_t lb = chunk_lower_bound(c, k, gb);
    if (lb >= k->num_blocks || k->global[lb] != gb) continue;
    chunk_bars_add(cb, gb, (int32_t)((int64_t)lb * G + h->verticals[i] % G));
  }
  cb->start[cb->num_blocks] = (int32_t)cb->bars.size;
  return 1;
}

static int push_seg(ivec_t *segs, int32_t b0, int32_t b1, int64_t *num_bars) {
  *num_bars += b1 - b0;
  return ivec_push(segs, b0) && ivec_push(segs, b1);
}

/* Segments of the chunk's bars that query block gq computes: bars in global
 * blocks strictly before gq whose block diagonal is not already listed, as
 * maximal ranges of bar blocks. The excluded bar blocks are found from
 * whichever is shorter: the bar blocks before gq (each looked up in the
 * diagonal bitmap) or the diagonals 1..gq (each looked up among the bar
 * blocks). */
static int segs_for_query(const mtrain_pattern_head_t *h, const head_aux_t *a,
                          const chunk_bars_t *cb, int64_t gq, ivec_t *segs, int64_t *num_bars) {
  int32_t nbb = lower_bound64(cb->block, cb->num_blocks, gq); /* bar blocks before gq */
  *num_bars = 0;
  if (nbb == 0) return 1;
  /* diagonals in [1, gq]: indices [1, nd) (diagonal 0 is first) */
  int32_t lo = 0, hi = h->num_diagonals;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo) / 2;
    if (h->diagonals[mid] <= gq)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int32_t nd = lo;
  int32_t begin = 0; /* first bar block of the open range */
  if (nd - 1 < nbb) {
    /* walk the diagonals from the largest (earliest bar block) down */
    for (int32_t d = nd - 1; d >= 1; d--) {
      const int32_t b = cb->index_of[gq - h->diagonals[d]];
      if (b < 0) continue;
      if (b > begin && !push_seg(segs, cb->start[begin], cb->start[b], num_bars)) return 0;
      begin = b + 1;
    }
  } else {
    for (int32_t b = 0; b < nbb; b++) {
      if (!a->has_diag[gq - cb->block[b]]) continue;
      if (b > begin && !push_seg(segs, cb->start[begin], cb->start[b], num_bars)) return 0;
      begin = b + 1;
    }
  }
  if (begin < nbb && !push_seg(segs, cb->start[begin], cb->start[nbb], num_bars)) return 0;
  return 1;
}

/* Pairs computed by query block qb (of r rows, global gq) against the local
 * key-block run [lo, hi): full blocks, except in a causal pattern the
 * diagonal block (global == gq), whose lower triangle counts. */
static int64_t run_pairs(const mtrain_rank_blocks_t *k, const chunk_aux_t *c, int64_t gq, int64_t r,
                         int32_t lo, int32_t hi, int64_t seq_len, int32_t G, int causal) {
  int64_t pairs = r * (c->row_prefix[hi] - c->row_prefix[lo]);
  if (!causal) return pairs;
  const int32_t kd = chunk_lower_bound(c, k, gq);
  if (kd >= lo && kd < hi && k->global[kd] == gq)
    pairs += r * (r + 1) / 2 - r * rows_of(k, kd, seq_len, G);
  return pairs;
}

/* Builds one (step, head) entry from the head's and the chunk's tables; 0
 * when out of memory (out is then freed). */
static int build_step_head_core(const mtrain_pattern_t *pattern, int32_t head, const head_aux_t *a,
                                const mtrain_rank_blocks_t *q, const mtrain_rank_blocks_t *k,
                                const chunk_aux_t *c, int with_bars,
                                mtrain_step_head_store_t *out) {
  const mtrain_pattern_head_t *h = &pattern->heads[head];
  const int32_t G = pattern->granularity;
  const int64_t N = pattern->seq_len;
  ivec_t runs = {0}, segs = {0};
  chunk_bars_t cb;
  memset(out, 0, sizeof *out);
  memset(&cb, 0, sizeof cb);
  out->run_off = malloc((size_t)(q->num_blocks + 1) * sizeof(int32_t));
  out->seg_off = malloc((size_t)(q->num_blocks + 1) * sizeof(int32_t));
  int ok = out->run_off && out->seg_off;
  if (ok && with_bars && !h->mask_off && h->num_verticals)
    ok = chunk_bars_build(pattern, h, k, c, &cb);
  for (int32_t qb = 0; ok && qb < q->num_blocks; qb++) {
    int64_t gq = q->global[qb];
    out->run_off[qb] = (int32_t)(runs.size / 2);
    out->seg_off[qb] = (int32_t)(segs.size / 2);
    if (gq * G >= N) continue; /* a padding block computes nothing */
    int64_t run_start = runs.size;
    ok =
        h->mask_off ? runs_block_mask(h, gq, k, c, &runs) : runs_vertical_slash(a, gq, k, c, &runs);
    const int64_t r = rows_of(q, qb, N, G);
    for (int64_t e = run_start; ok && e < runs.size; e += 2)
      out->pairs += run_pairs(k, c, gq, r, runs.data[e], runs.data[e + 1], N, G, pattern->causal);
    if (ok && cb.bars.size) {
      int64_t nbars = 0;
      ok = segs_for_query(h, a, &cb, gq, &segs, &nbars);
      out->pairs += nbars * r;
    }
  }
  if (!ok) {
    free(runs.data);
    free(segs.data);
    chunk_bars_free(&cb);
    mtrain_step_head_store_free(out);
    return 0;
  }
  out->run_off[q->num_blocks] = (int32_t)(runs.size / 2);
  out->seg_off[q->num_blocks] = (int32_t)(segs.size / 2);
  out->runs = runs.data;
  out->segs = segs.data;
  out->num_runs = (int32_t)(runs.size / 2);
  out->num_segs = (int32_t)(segs.size / 2);
  out->num_bars = (int32_t)cb.bars.size;
  if (cb.bars.size) { /* no bars in the chunk: no array, as the plain walk left it */
    out->bars = cb.bars.data;
    cb.bars.data = NULL;
  }
  chunk_bars_free(&cb);
  return 1;
}

static mtrain_status_t build_step_head(const mtrain_pattern_t *pattern, int32_t head,
                                       const mtrain_rank_blocks_t *q, const mtrain_rank_blocks_t *k,
                                       int with_bars, mtrain_step_head_store_t *out) {
  head_aux_t a;
  chunk_aux_t c;
  int ok = head_aux_build(pattern, head, &a) &&
           chunk_aux_build(k, max_global_of(q, k), pattern->seq_len, pattern->granularity, &c);
  ok = ok && build_step_head_core(pattern, head, &a, q, k, &c, with_bars, out);
  if (!ok) memset(out, 0, sizeof *out);
  head_aux_free(&a);
  chunk_aux_free(&c);
  return ok ? MTRAIN_SUCCESS
            : mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory building head %d", head);
}

mtrain_status_t mtrain_plan_build_step_head(const mtrain_pattern_t *pattern, int32_t head,
                                            const mtrain_rank_blocks_t *q,
                                            const mtrain_rank_blocks_t *k,
                                            mtrain_step_head_store_t *out) {
  return build_step_head(pattern, head, q, k, 1, out);
}

mtrain_status_t mtrain_plan_build_step_head_runs(const mtrain_pattern_t *pattern, int32_t head,
                                                 const mtrain_rank_blocks_t *q,
                                                 const mtrain_rank_blocks_t *k,
                                                 mtrain_step_head_store_t *out) {
  return build_step_head(pattern, head, q, k, 0, out);
}

/* Bars gathered, one head: all its bar segments on this rank (over the local
 * query blocks in order, as in the ring: `all`, qseg[qb] the first of qb's)
 * and their bar count, computed once for the head's shares of every step. */
typedef struct gathered_head {
  chunk_bars_t cb;
  ivec_t all;
  int32_t *qseg; /* [num_q_blocks + 1] */
  int64_t total;
} gathered_head_t;

static void gathered_head_free(gathered_head_t *g) {
  chunk_bars_free(&g->cb);
  free(g->all.data);
  free(g->qseg);
  memset(g, 0, sizeof *g);
}

static int gathered_head_build(const mtrain_pattern_t *pattern, int32_t head, const head_aux_t *a,
                               const mtrain_rank_blocks_t *q, const int64_t *positions,
                               int64_t count, gathered_head_t *g) {
  const mtrain_pattern_head_t *h = &pattern->heads[head];
  const int32_t G = pattern->granularity;
  const int64_t N = pattern->seq_len;
  memset(g, 0, sizeof *g);
  int ok = 1;
  /* the head's verticals as indices into the gathered positions */
  if (!h->mask_off && h->num_verticals) {
    ok = chunk_bars_alloc(&g->cb, h->num_verticals, pattern->num_blocks);
    int32_t idx = 0;
    for (int32_t i = 0; ok && i < h->num_verticals; i++) {
      /* verticals and positions increase: the index only moves forward */
      while (idx < count && positions[idx] < h->verticals[i]) idx++;
      chunk_bars_add(&g->cb, h->verticals[i] / G, idx);
    }
    if (ok) g->cb.start[g->cb.num_blocks] = (int32_t)g->cb.bars.size;
  }
  g->qseg = calloc((size_t)(q->num_blocks + 1), sizeof(int32_t));
  ok = ok && g->qseg;
  for (int32_t qb = 0; ok && qb < q->num_blocks; qb++) {
    g->qseg[qb] = (int32_t)(g->all.size / 2);
    const int64_t gq = q->global[qb];
    if (gq * G >= N || g->cb.bars.size == 0) continue;
    int64_t nbars = 0;
    ok = segs_for_query(h, a, &g->cb, gq, &g->all, &nbars);
    g->total += nbars;
  }
  if (g->qseg) g->qseg[q->num_blocks] = (int32_t)(g->all.size / 2);
  return ok;
}

/* Share `part` of `parts` of head h's gathered bar work on this rank: the
 * head's bar entries (concatenated over the local query blocks in order)
 * [floor(part*B/parts), floor((part+1)*B/parts)), as segments into the
 * gathered positions (docs/BALANCE.md, "Bars gathered"). 0 when out of
 * memory (out is then freed). */
static int build_gathered_share(const mtrain_pattern_t *pattern, const gathered_head_t *g,
                                const mtrain_rank_blocks_t *q, int32_t part, int32_t parts,
                                mtrain_step_head_store_t *out) {
  const int32_t G = pattern->granularity;
  const int64_t N = pattern->seq_len;
  ivec_t segs = {0};
  memset(out, 0, sizeof *out);
  out->run_off = calloc((size_t)(q->num_blocks + 1), sizeof(int32_t));
  out->seg_off = calloc((size_t)(q->num_blocks + 1), sizeof(int32_t));
  const int32_t nbars = (int32_t)g->cb.bars.size;
  out->bars = malloc(sizeof(int32_t) * (size_t)(nbars + 1));
  int ok = out->run_off && out->seg_off && out->bars;
  if (ok && nbars) memcpy(out->bars, g->cb.bars.data, sizeof(int32_t) * (size_t)nbars);
  out->num_bars = nbars;
  const int64_t lo = (int64_t)part * g->total / parts, hi = (int64_t)(part + 1) * g->total / parts;
  int64_t c = 0;
  for (int32_t qb = 0; ok && qb < q->num_blocks; qb++) {
    out->seg_off[qb] = (int32_t)(segs.size / 2);
    const int32_t nr = mtrain_block_rows(q->tokens, G, qb, q->global[qb], N);
    for (int32_t e = g->qseg[qb]; ok && e < g->qseg[qb + 1]; e++) {
      const int64_t b0 = g->all.data[2 * e], len = g->all.data[2 * e + 1] - b0;
      const int64_t from = lo > c ? lo - c : 0, to = hi - c < len ? hi - c : len;
      if (from < to) {
        ok = ivec_push(&segs, (int32_t)(b0 + from)) && ivec_push(&segs, (int32_t)(b0 + to));
        out->pairs += (to - from) * nr;
      }
      c += len;
    }
  }
  if (!ok) {
    free(segs.data);
    mtrain_step_head_store_free(out);
    return 0;
  }
  out->seg_off[q->num_blocks] = (int32_t)(segs.size / 2);
  out->segs = segs.data;
  out->num_segs = (int32_t)(segs.size / 2);
  if (nbars == 0) {
    free(out->bars);
    out->bars = NULL;
  }
  return 1;
}

void mtrain_step_head_store_free(mtrain_step_head_store_t *s) {
  if (!s) return;
  free(s->run_off);
  free(s->runs);
  free(s->seg_off);
  free(s->segs);
  free(s->bars);
  memset(s, 0, sizeof *s);
}

mtrain_step_head_t mtrain_step_head_view(const mtrain_step_head_store_t *s) {
  mtrain_step_head_t v = {s->run_off, s->runs,     s->seg_off,  s->segs,
                          s->bars,    s->num_runs, s->num_segs, s->num_bars};
  return v;
}

static size_t step_head_bytes(const mtrain_step_head_store_t *s, int32_t nqb) {
  return sizeof(int32_t) * ((size_t)2 * (nqb + 1) + 2 * (size_t)s->num_runs +
                            2 * (size_t)s->num_segs + (size_t)s->num_bars);
}

/* ---- the whole plan -------------------------------------------------------- */

static void step_free(mtrain_plan_step_t *step, int32_t num_heads) {
  if (step->heads)
    for (int32_t h = 0; h < num_heads; h++) mtrain_step_head_store_free(&step->heads[h]);
  free(step->heads);
  free(step->head_views);
}

static void plan_seq_free(mtrain_plan_seq_t *s, int32_t num_steps, int32_t num_heads) {
  for (int32_t t = 0; s->steps && t < num_steps; t++) step_free(&s->steps[t], num_heads);
  for (int32_t t = 0; s->bar_steps && t < num_steps; t++) step_free(&s->bar_steps[t], num_heads);
  free(s->steps);
  free(s->bar_steps);
  if (s->k_globals)
    for (int32_t t = 0; t < num_steps; t++) free(s->k_globals[t]);
  free(s->k_globals);
  free(s->q_global);
  mtrain_pattern_destroy(s->pattern);
}

static void gathered_free(mtrain_plan_gathered_t *g) {
  if (!g) return;
  free(g->pack_rows);
  free(g->unpack);
  free(g->owned_bars);
  free(g);
}

void mtrain_plan_destroy(mtrain_plan_t *plan) {
  if (!plan) return;
  mtrain_plan_device_free(plan->device);
  gathered_free(plan->gathered);
  if (plan->seqs)
    for (int32_t s = 0; s < plan->num_seqs; s++)
      plan_seq_free(&plan->seqs[s], plan->num_steps, plan->num_heads);
  free(plan->seqs);
  free(plan);
}

/* Allocates the head arrays of a step and fills its view. */
static mtrain_status_t step_init(mtrain_plan_t *plan, const mtrain_plan_seq_t *s,
                                 mtrain_plan_step_t *step, int32_t t, int32_t src, int64_t k_tokens,
                                 int32_t num_k_blocks, const int64_t *k_block_global) {
  step->src_rank = src;
  step->heads = calloc((size_t)plan->num_heads, sizeof *step->heads);
  step->head_views = calloc((size_t)plan->num_heads, sizeof *step->head_views);
  if (!step->heads || !step->head_views)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  mtrain_step_view_t v = {.step = t,
                          .src_rank = src,
                          .granularity = s->pattern->granularity,
                          .num_heads = plan->num_heads,
                          .seq_len = s->pattern->seq_len,
                          .q_tokens = s->q.tokens,
                          .k_tokens = k_tokens,
                          .num_q_blocks = s->q.num_blocks,
                          .num_k_blocks = num_k_blocks,
                          .q_block_global = s->q.global,
                          .k_block_global = k_block_global,
                          .heads = step->head_views,
                          .causal = s->pattern->causal};
  step->view = v;
  return MTRAIN_SUCCESS;
}

/* Records a built head of a step in the plan's totals. */
static void step_head_done(mtrain_plan_t *plan, const mtrain_plan_seq_t *s,
                           mtrain_plan_step_t *step, int32_t h) {
  step->head_views[h] = mtrain_step_head_view(&step->heads[h]);
  plan->computed_pairs += step->heads[h].pairs;
  plan->bytes += step_head_bytes(&step->heads[h], s->q.num_blocks);
}

/* Threads of the host-side plan work: the context's (OpenMP's default when
 * 0). Every (sequence, step, head) entry is built by one thread from
 * read-only inputs, and the totals are added afterwards in that order, so
 * the plan is the same for any thread count. */
static int plan_threads(const mtrain_context_t *ctx) {
  return ctx->config.num_threads > 0 ? ctx->config.num_threads : omp_get_max_threads();
}

/* The head tables of every sequence's pattern (aux[s][h]), all (sequence,
 * head) pairs in one parallel loop, so that a packed batch of many short
 * sequences pays for one OpenMP region, not one per sequence. aux[s] are
 * allocated here; 0 when out of memory (head_aux_free_all frees what
 * exists). */
static int head_aux_build_seqs(const mtrain_plan_t *plan, head_aux_t **aux, int threads) {
  const int32_t S = plan->num_seqs, H = plan->num_heads;
  for (int32_t s = 0; s < S; s++) {
    aux[s] = calloc((size_t)H, sizeof *aux[s]);
    if (!aux[s]) return 0;
  }
  const int64_t tasks = (int64_t)S * H;
  int ok = 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(& : ok)
  for (int64_t i = 0; i < tasks; i++) {
    const int32_t s = (int32_t)(i / H), h = (int32_t)(i % H);
    ok &= head_aux_build(plan->seqs[s].pattern, h, &aux[s][h]);
  }
  return ok;
}

static void head_aux_free_all(head_aux_t *aux, int32_t num_heads) {
  for (int32_t h = 0; aux && h < num_heads; h++) head_aux_free(&aux[h]);
  free(aux);
}

/* Builds every step of every sequence (step t's chunk and source already
 * set in seqs[s].steps[t]): the chunk tables in order, all (sequence, step,
 * head) entries in one parallel loop (one OpenMP region for a packed batch
 * of any size), then the views and the totals in order. */
static mtrain_status_t build_steps(mtrain_plan_t *plan, head_aux_t *const *aux, int threads) {
  const int32_t T = plan->num_steps, H = plan->num_heads;
  const int64_t chunks = (int64_t)plan->num_seqs * T, tasks = chunks * H;
  chunk_aux_t *caux = calloc((size_t)chunks, sizeof *caux);
  uint8_t *done = calloc((size_t)tasks, 1);
  mtrain_status_t st = MTRAIN_SUCCESS;
  int ok = caux && done;
  for (int64_t x = 0; ok && x < chunks; x++) {
    mtrain_plan_seq_t *s = &plan->seqs[x / T];
    const int32_t t = (int32_t)(x % T);
    mtrain_plan_step_t *step = &s->steps[t];
    st = step_init(plan, s, step, t, step->src_rank, step->k.tokens, step->k.num_blocks,
                   step->k.global);
    ok = st == MTRAIN_SUCCESS &&
         chunk_aux_build(&step->k, max_global_of(&s->q, &step->k), s->pattern->seq_len,
                         s->pattern->granularity, &caux[x]);
  }
  if (ok) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; i++) {
      const int64_t x = i / H;
      const int32_t h = (int32_t)(i % H);
      mtrain_plan_seq_t *s = &plan->seqs[x / T];
      mtrain_plan_step_t *step = &s->steps[x % T];
      done[i] = (uint8_t)build_step_head_core(s->pattern, h, &aux[x / T][h], &s->q, &step->k,
                                              &caux[x], s->bar_steps == NULL, &step->heads[h]);
    }
    for (int64_t i = 0; ok && i < tasks; i++) ok = done[i];
  }
  for (int64_t x = 0; ok && x < chunks; x++)
    for (int32_t h = 0; h < H; h++)
      step_head_done(plan, &plan->seqs[x / T], &plan->seqs[x / T].steps[x % T], h);
  for (int64_t x = 0; caux && x < chunks; x++) chunk_aux_free(&caux[x]);
  free(caux);
  free(done);
  if (st) return st;
  return ok ? MTRAIN_SUCCESS : mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
}

/* The sorted union of the verticals of all heads of a pattern (*out owned;
 * *count entries). */
static mtrain_status_t vertical_union(const mtrain_pattern_t *p, int64_t **out, int64_t *count) {
  int64_t total = 0;
  for (int32_t h = 0; h < p->num_heads; h++) total += p->heads[h].num_verticals;
  int64_t *pos = malloc(sizeof(int64_t) * (size_t)(total + 1));
  if (!pos) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  int64_t n = 0;
  for (int32_t h = 0; h < p->num_heads; h++)
    for (int32_t i = 0; i < p->heads[h].num_verticals; i++) pos[n++] = p->heads[h].verticals[i];
  qsort(pos, (size_t)n, sizeof *pos, cmp_i64);
  int64_t m = 0;
  for (int64_t i = 0; i < n; i++)
    if (m == 0 || pos[m - 1] != pos[i]) pos[m++] = pos[i];
  *out = pos;
  *count = m;
  return MTRAIN_SUCCESS;
}

/* Bars gathered, one sequence: its bar share of every ring step against the
 * gathered rows of its verticals `positions`. Each head's segments are found
 * once and cut into the steps' shares, in parallel. */
static mtrain_status_t build_bar_steps(mtrain_plan_t *plan, mtrain_plan_seq_t *ps,
                                       const head_aux_t *aux, const int64_t *positions,
                                       int64_t count, int threads) {
  const int32_t T = plan->num_steps, H = plan->num_heads;
  mtrain_status_t st = MTRAIN_SUCCESS;
  ps->bar_steps = calloc((size_t)T, sizeof *ps->bar_steps);
  gathered_head_t *g = calloc((size_t)H, sizeof *g);
  uint8_t *done = calloc((size_t)T * (size_t)H + (size_t)H, 1);
  int ok = ps->bar_steps && g && done;
  for (int32_t t = 0; ok && t < T; t++) {
    st = step_init(plan, ps, &ps->bar_steps[t], t, -1, count, 0, NULL);
    ok = st == MTRAIN_SUCCESS;
  }
  if (ok) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int32_t h = 0; h < H; h++)
      done[h] =
          (uint8_t)gathered_head_build(ps->pattern, h, &aux[h], &ps->q, positions, count, &g[h]);
    for (int32_t h = 0; ok && h < H; h++) ok = done[h];
  }
  if (ok) {
    const int64_t tasks = (int64_t)T * H;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; i++) {
      const int32_t t = (int32_t)(i / H), h = (int32_t)(i % H);
      done[H + i] = (uint8_t)build_gathered_share(ps->pattern, &g[h], &ps->q, t, T,
                                                  &ps->bar_steps[t].heads[h]);
    }
    for (int64_t i = 0; ok && i < tasks; i++) ok = done[H + i];
  }
  for (int32_t t = 0; ok && t < T; t++)
    for (int32_t h = 0; h < H; h++) step_head_done(plan, ps, &ps->bar_steps[t], h);
  for (int32_t h = 0; g && h < H; h++) gathered_head_free(&g[h]);
  free(g);
  free(done);
  if (st) return st;
  return ok ? MTRAIN_SUCCESS : mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
}

/* Bars gathered: for every sequence whose layout gathers its bars, the union
 * of its verticals and its bar steps; over all of them, where each gathered
 * row comes from (its owner's pack) and which rows this rank packs.
 * `slot_offset[r * num_seqs + s]` is the first local token slot of sequence
 * s on rank r. */
static mtrain_status_t build_gathered(mtrain_plan_t *plan, const mtrain_layout_t *const *layouts,
                                      const int64_t *slot_offset, head_aux_t *const *aux,
                                      int threads) {
  const int32_t W = plan->world, S = plan->num_seqs;
  mtrain_status_t st = MTRAIN_SUCCESS;
  mtrain_plan_gathered_t *g = calloc(1, sizeof *g);
  int64_t *owner_count = calloc((size_t)W, sizeof *owner_count);
  int64_t **positions = calloc((size_t)S, sizeof *positions);
  int32_t *bar_owner = NULL;
  int64_t *bar_row = NULL; /* the owner's local token slot of each gathered row */
  if (!g || !owner_count || !positions) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
    goto done;
  }
  plan->gathered = g;
  for (int32_t s = 0; st == MTRAIN_SUCCESS && s < S; s++) {
    mtrain_plan_seq_t *ps = &plan->seqs[s];
    if (mtrain_layout_bars_mode(layouts[s]) != MTRAIN_BARS_GATHERED) continue;
    st = vertical_union(ps->pattern, &positions[s], &ps->bar_count);
    ps->bar_base = g->count;
    g->count += ps->bar_count;
    if (st == MTRAIN_SUCCESS)
      st = build_bar_steps(plan, ps, aux[s], positions[s], ps->bar_count, threads);
  }
  if (st) goto done;
  bar_owner = malloc(sizeof(int32_t) * (size_t)(g->count + 1));
  bar_row = malloc(sizeof(int64_t) * (size_t)(g->count + 1));
  if (!bar_owner || !bar_row) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
    goto done;
  }
  for (int32_t s = 0; st == MTRAIN_SUCCESS && s < S; s++) {
    const mtrain_plan_seq_t *ps = &plan->seqs[s];
    for (int64_t i = 0; st == MTRAIN_SUCCESS && i < ps->bar_count; i++) {
      int32_t owner = -1;
      int64_t local = -1;
      st = mtrain_layout_global_to_local(layouts[s], positions[s][i], &owner, &local);
      bar_owner[ps->bar_base + i] = owner;
      bar_row[ps->bar_base + i] = slot_offset[(int64_t)owner * S + s] + local;
    }
  }
  if (st) goto done;
  for (int64_t i = 0; i < g->count; i++) owner_count[bar_owner[i]]++;
  for (int32_t r = 0; r < W; r++)
    if (owner_count[r] > g->max_owned) g->max_owned = owner_count[r];
  g->owned = owner_count[plan->rank];
  g->pack_rows = malloc(sizeof(int64_t) * (size_t)(g->max_owned + 1));
  g->unpack = malloc(sizeof(int64_t) * (size_t)(2 * g->count + 1));
  g->owned_bars = malloc(sizeof(int64_t) * (size_t)(2 * g->owned + 1));
  if (!g->pack_rows || !g->unpack || !g->owned_bars) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
    goto done;
  }
  /* the j-th row an owner packs is its j-th gathered row in gathered order */
  memset(owner_count, 0, sizeof(int64_t) * (size_t)W);
  for (int64_t i = 0; i < g->count; i++) {
    const int32_t r = bar_owner[i];
    const int64_t j = owner_count[r]++;
    g->unpack[i] = (int64_t)r * 2 * g->max_owned + j;
    g->unpack[g->count + i] = (int64_t)r * 2 * g->max_owned + g->max_owned + j;
    if (r == plan->rank) {
      g->pack_rows[j] = bar_row[i];
      g->owned_bars[j] = i;
      g->owned_bars[g->owned + j] = g->count + i;
    }
  }
  for (int64_t j = g->owned; j < g->max_owned; j++) g->pack_rows[j] = INT64_MAX; /* zero rows */
  plan->bytes += sizeof *g + sizeof(int64_t) * (size_t)(g->max_owned + 2 * g->count + 2 * g->owned);
done:
  for (int32_t s = 0; positions && s < S; s++) free(positions[s]);
  free(positions);
  free(owner_count);
  free(bar_owner);
  free(bar_row);
  return st;
}

/* Collective: every rank must plan the same problem. A rank that planned
 * another batch (or head count, or schedule) would send K/V chunks of
 * another size, and a message longer than the posted receive is not
 * reliably refused by the transport: Open MPI's single-copy path (CMA) was
 * seen writing past the receive buffer (AddressSanitizer, 2026-11-22). So
 * the plans are compared before any transfer, and all ranks fail, naming two
 * ranks and their values. */
static mtrain_status_t check_ring_plan_agrees(mtrain_context_t *ctx, const mtrain_plan_t *plan) {
  const int size = mtrain_context_world(ctx);
  if (size <= 1) return MTRAIN_SUCCESS;
  enum { K = 6 };
  uint64_t lengths = 1469598103934665603ull; /* FNV-1a over the sequence lengths */
  int64_t total = 0;
  for (int32_t s = 0; s < plan->num_seqs; s++) {
    const int64_t n = plan->seqs[s].pattern->seq_len;
    total += n;
    for (int b = 0; b < 8; b++)
      lengths = (lengths ^ (uint64_t)((n >> (8 * b)) & 0xff)) * 1099511628211ull;
  }
  const int64_t mine[K] = {plan->num_seqs,     total,
                           plan->num_heads,    plan->ranks_per_node,
                           plan->local_tokens, (int64_t)(lengths >> 1)};
  int64_t *all = calloc((size_t)size * K, sizeof *all);
  if (!all) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  mtrain_status_t st = mtrain_cm_allgather(ctx, mine, all, sizeof mine);
  for (int r = 1; st == MTRAIN_SUCCESS && r < size; r++)
    if (memcmp(all, all + K * r, sizeof mine) != 0) {
      const int64_t *a = all, *b = all + K * r;
      st = mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "plan: rank 0 plans the ring for %lld sequences of %lld tokens in all, "
                        "%lld heads, ranks per node %lld, %lld local slots%s; rank %d for %lld "
                        "sequences of %lld tokens, %lld heads, ranks per node %lld, %lld local "
                        "slots: every rank must plan the same problem (expected the same on "
                        "every rank)",
                        (long long)a[0], (long long)a[1], (long long)a[2], (long long)a[3],
                        (long long)a[4], a[5] != b[5] ? " (and other sequence lengths)" : "", r,
                        (long long)b[0], (long long)b[1], (long long)b[2], (long long)b[3],
                        (long long)b[4]);
    }
  free(all);
  return st;
}

static mtrain_status_t check_seqs(const mtrain_seqs_t *seqs,
                                  const mtrain_pattern_t *const *patterns, int32_t G) {
  int32_t n = seqs ? seqs->num_seqs : 1;
  if (n < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "plan: num_seqs must be >= 1, got %d", n);
  if (seqs && !seqs->offsets)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "plan: seqs->offsets is NULL");
  if (seqs && seqs->offsets[0] != 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "plan: seqs->offsets[0] is %lld, must be 0",
                        (long long)seqs->offsets[0]);
  for (int32_t s = 0; s < n; s++) {
    const mtrain_pattern_t *p = patterns[s];
    if (!p) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "plan: patterns[%d] is NULL", s);
    if (p->num_heads != patterns[0]->num_heads)
      return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                          "plan: patterns[%d] has %d heads, patterns[0] has %d", s, p->num_heads,
                          patterns[0]->num_heads);
    if (p->granularity != G)
      return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                          "plan: patterns[%d] has granularity %d, the context uses %d", s,
                          p->granularity, G);
    if (seqs) {
      int64_t len = seqs->offsets[s + 1] - seqs->offsets[s];
      if (len <= 0)
        return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                            "plan: sequence %d has length %lld (offsets must increase)", s,
                            (long long)len);
      if (len != p->seq_len)
        return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                            "plan: sequence %d has %lld tokens but patterns[%d] is for %lld", s,
                            (long long)len, s, (long long)p->seq_len);
    }
  }
  return MTRAIN_SUCCESS;
}

static mtrain_status_t check_layouts(const mtrain_context_t *ctx,
                                     const mtrain_layout_t *const *layouts,
                                     const mtrain_pattern_t *const *patterns, int32_t n,
                                     int32_t world) {
  for (int32_t s = 0; s < n; s++) {
    const mtrain_layout_t *l = layouts[s];
    if (!l) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "plan: layouts[%d] is NULL", s);
    if (mtrain_layout_world(l) != world)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "plan: layouts[%d] is for %d ranks, the communicator has %d", s,
                          mtrain_layout_world(l), world);
    if (mtrain_layout_seq_len(l) != patterns[s]->seq_len)
      return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                          "plan: layouts[%d] is for %lld tokens, patterns[%d] for %lld", s,
                          (long long)mtrain_layout_seq_len(l), s, (long long)patterns[s]->seq_len);
    if (mtrain_layout_granularity(l) != ctx->config.granularity)
      return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                          "plan: layouts[%d] has granularity %d, the context uses %d", s,
                          mtrain_layout_granularity(l), ctx->config.granularity);
  }
  return MTRAIN_SUCCESS;
}

/* The one plan builder: sequence s of the batch is dealt over the ranks by
 * layouts[s], or (layouts == NULL, one rank) held whole in token order with
 * no padding. Every plan is a ring: one step per rank (one step on one rank),
 * step t holding the chunk of the rank the schedule names. */
static mtrain_status_t build_plan(mtrain_context_t *ctx, int32_t num_seqs,
                                  const mtrain_pattern_t *const *patterns,
                                  const mtrain_layout_t *const *layouts, int32_t ranks_per_node,
                                  mtrain_plan_t **out) {
  const int32_t world = layouts ? mtrain_context_world(ctx) : 1;
  const int32_t rank = layouts ? mtrain_context_rank(ctx) : 0;
  mtrain_status_t st = MTRAIN_SUCCESS;
  mtrain_ring_geometry_t geo;
  int64_t *slot_offset = NULL; /* [rank * num_seqs + s] first local slot of s on rank */
  head_aux_t **aux = NULL;     /* [num_seqs][num_heads] */
  const int threads = plan_threads(ctx);
  mtrain_plan_t *plan = calloc(1, sizeof *plan);
  if (!plan) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  MTRAIN_TRY(mtrain_ring_geometry(world, ranks_per_node == world ? 0 : ranks_per_node, rank, &geo));
  plan->num_seqs = num_seqs;
  plan->num_steps = world;
  plan->num_heads = patterns[0]->num_heads;
  plan->granularity = ctx->config.granularity;
  plan->rank = rank;
  plan->world = world;
  plan->ranks_per_node = ranks_per_node == world ? 0 : ranks_per_node;
  plan->seqs = calloc((size_t)num_seqs, sizeof *plan->seqs);
  slot_offset = calloc((size_t)world * (size_t)num_seqs, sizeof *slot_offset);
  aux = calloc((size_t)num_seqs, sizeof *aux);
  MTRAIN_FAIL_IF(!plan->seqs || !slot_offset || !aux, MTRAIN_ERR_OUT_OF_MEMORY,
                 "plan: out of memory");
  for (int32_t r = 0; r < world; r++) {
    int64_t off = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
      slot_offset[(int64_t)r * num_seqs + s] = off;
      off += layouts ? mtrain_layout_local_tokens(layouts[s], r) : patterns[s]->seq_len;
    }
  }
  for (int32_t s = 0; s < num_seqs; s++) {
    mtrain_plan_seq_t *ps = &plan->seqs[s];
    MTRAIN_TRY(mtrain_pattern_clone(patterns[s], &ps->pattern));
    ps->local_offset = slot_offset[(int64_t)rank * num_seqs + s];
    const int32_t nb = layouts ? mtrain_layout_rank_num_blocks(layouts[s], rank)
                               : (int32_t)ps->pattern->num_blocks;
    ps->q.num_blocks = nb;
    ps->q.tokens = layouts ? mtrain_layout_local_tokens(layouts[s], rank) : ps->pattern->seq_len;
    ps->q_global = malloc(sizeof(int64_t) * (size_t)(nb + 1));
    ps->steps = calloc((size_t)world, sizeof *ps->steps);
    ps->k_globals = calloc((size_t)world, sizeof *ps->k_globals);
    MTRAIN_FAIL_IF(!ps->q_global || !ps->steps || !ps->k_globals, MTRAIN_ERR_OUT_OF_MEMORY,
                   "plan: out of memory");
    for (int32_t b = 0; b < nb; b++)
      ps->q_global[b] = layouts ? mtrain_layout_rank_blocks(layouts[s], rank)[b] : b;
    ps->q.global = ps->q_global; /* the plan must not depend on the layout's lifetime */
    plan->local_tokens += ps->q.tokens;
  }
  MTRAIN_FAIL_IF(!head_aux_build_seqs(plan, aux, threads), MTRAIN_ERR_OUT_OF_MEMORY,
                 "plan: out of memory");
  if (world > 1)
    for (int32_t s = 0; s < num_seqs; s++)
      if (mtrain_layout_bars_mode(layouts[s]) == MTRAIN_BARS_GATHERED) {
        MTRAIN_TRY(build_gathered(plan, layouts, slot_offset, aux, threads));
        break;
      }
  for (int32_t s = 0; s < num_seqs; s++) {
    mtrain_plan_seq_t *ps = &plan->seqs[s];
    for (int32_t t = 0; t < world; t++) {
      const int32_t src = mtrain_ring_geometry_source(&geo, t);
      mtrain_rank_blocks_t k = ps->q;
      if (layouts) {
        k.num_blocks = mtrain_layout_rank_num_blocks(layouts[s], src);
        k.tokens = mtrain_layout_local_tokens(layouts[s], src);
        ps->k_globals[t] = malloc(sizeof(int64_t) * (size_t)(k.num_blocks + 1));
        MTRAIN_FAIL_IF(!ps->k_globals[t], MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
        memcpy(ps->k_globals[t], mtrain_layout_rank_blocks(layouts[s], src),
               sizeof(int64_t) * (size_t)k.num_blocks);
        k.global = ps->k_globals[t];
      }
      ps->steps[t].chunk_offset = slot_offset[(int64_t)src * num_seqs + s];
      ps->steps[t].src_rank = src;
      ps->steps[t].k = k;
    }
  }
  MTRAIN_TRY(build_steps(plan, aux, threads));
  plan->bytes += sizeof *plan + (size_t)num_seqs * sizeof *plan->seqs;
  if (layouts) MTRAIN_TRY(check_ring_plan_agrees(ctx, plan));
  for (int32_t s = 0; s < num_seqs; s++) head_aux_free_all(aux[s], plan->num_heads);
  free(aux);
  free(slot_offset);
  *out = plan;
  return MTRAIN_SUCCESS;
cleanup:
  for (int32_t s = 0; aux && s < num_seqs; s++) head_aux_free_all(aux[s], plan->num_heads);
  free(aux);
  free(slot_offset);
  mtrain_plan_destroy(plan);
  return st;
}

mtrain_status_t mtrain_plan_create_ring(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                        const mtrain_layout_t *const *layouts,
                                        int32_t ranks_per_node,
                                        const mtrain_pattern_t *const *patterns,
                                        mtrain_plan_t **out) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(layouts);
  MTRAIN_CHECK_NOT_NULL(patterns);
  MTRAIN_CHECK_NOT_NULL(out);
  const int32_t world = mtrain_context_world(ctx), n = seqs ? seqs->num_seqs : 1;
  mtrain_status_t st = check_seqs(seqs, patterns, ctx->config.granularity);
  if (st == MTRAIN_SUCCESS) st = check_layouts(ctx, layouts, patterns, n, world);
  if (st == MTRAIN_SUCCESS &&
      (ranks_per_node < 0 || (ranks_per_node > 0 && world % ranks_per_node != 0)))
    st = mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                      "plan: ranks_per_node %d does not divide the world size %d", ranks_per_node,
                      world);
  if (st != MTRAIN_SUCCESS) return st;
  return build_plan(ctx, n, patterns, layouts, ranks_per_node, out);
}

mtrain_status_t mtrain_plan_create(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                   const mtrain_pattern_t *const *patterns, mtrain_plan_t **out) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(patterns);
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_status_t st = check_seqs(seqs, patterns, ctx->config.granularity);
  if (st != MTRAIN_SUCCESS) return st;
  int world = mtrain_context_world(ctx);
  if (world != 1)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "plan: world size %d: use mtrain_plan_create_ring with a layout per "
                        "sequence for several ranks",
                        world);
  return build_plan(ctx, seqs ? seqs->num_seqs : 1, patterns, NULL, 0, out);
}

int32_t mtrain_plan_num_seqs(const mtrain_plan_t *plan) { return plan ? plan->num_seqs : 0; }
int64_t mtrain_plan_seq_local_offset(const mtrain_plan_t *plan, int32_t seq) {
  return plan && seq >= 0 && seq < plan->num_seqs ? plan->seqs[seq].local_offset : -1;
}
int64_t mtrain_plan_local_tokens(const mtrain_plan_t *plan) {
  return plan ? plan->local_tokens : 0;
}
int32_t mtrain_plan_num_heads(const mtrain_plan_t *plan) { return plan ? plan->num_heads : 0; }
int32_t mtrain_plan_num_steps(const mtrain_plan_t *plan) { return plan ? plan->num_steps : 0; }
int32_t mtrain_plan_rank(const mtrain_plan_t *plan) { return plan ? plan->rank : 0; }
int32_t mtrain_plan_ranks_per_node(const mtrain_plan_t *plan) {
  return plan ? plan->ranks_per_node : 0;
}

size_t mtrain_plan_bytes(const mtrain_plan_t *plan) { return plan ? plan->bytes : 0; }
