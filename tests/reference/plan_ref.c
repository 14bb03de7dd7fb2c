/* plan_ref.c: the reference copy of core/runtime/plan.c as of commit 906fdc4 (before
 * the host speed-ups of issue 20), its external names prefixed ref_: the
 * optimised builders are tested against it bitwise (test_plan_fast.c). Not
 * part of the library; do not change it except to follow an API rename. */
#include <stdlib.h>
#include <string.h>

#include "core/layout/schedule.h"
#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"
#include "reference.h"

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

/* Pairs computed by query block qb against local key block kb. */
static int64_t block_pair_count(const mtrain_rank_blocks_t *q, int32_t qb,
                                const mtrain_rank_blocks_t *k, int32_t kb, int64_t seq_len,
                                int32_t G) {
  int64_t r = rows_of(q, qb, seq_len, G);
  if (q->global[qb] == k->global[kb]) return r * (r + 1) / 2;
  return r * rows_of(k, kb, seq_len, G);
}

/* Key-block runs of query block qb for a vertical-slash head: the diagonals
 * are walked from the largest (earliest key block) to the smallest, grouped
 * into maximal ranges of consecutive diagonals, each mapped to a local range
 * by binary search over the chunk's increasing global block ids. */
static int runs_vertical_slash(const mtrain_pattern_head_t *h, int64_t gq,
                               const mtrain_rank_blocks_t *k, ivec_t *runs) {
  int64_t run_begin = runs->size;
  int32_t d = h->num_diagonals - 1;
  while (d >= 0 && h->diagonals[d] > gq) d--;
  while (d >= 0) {
    int32_t hi_t = h->diagonals[d], lo_t = hi_t;
    while (d > 0 && h->diagonals[d - 1] == lo_t - 1) lo_t = h->diagonals[--d];
    d--;
    /* global key blocks [gq - hi_t, gq - lo_t] */
    int32_t lo = lower_bound64(k->global, k->num_blocks, gq - hi_t);
    int32_t hi = lower_bound64(k->global, k->num_blocks, gq - lo_t + 1);
    if (!push_run(runs, run_begin, lo, hi)) return 0;
  }
  return 1;
}

static int runs_block_mask(const mtrain_pattern_head_t *h, int64_t gq,
                           const mtrain_rank_blocks_t *k, ivec_t *runs) {
  int64_t run_begin = runs->size;
  for (int64_t e = h->mask_off[gq]; e < h->mask_off[gq + 1]; e++) {
    int32_t lb = lower_bound64(k->global, k->num_blocks, h->mask_idx[e]);
    if (lb < k->num_blocks && k->global[lb] == h->mask_idx[e])
      if (!push_run(runs, run_begin, lb, lb + 1)) return 0;
  }
  return 1;
}

/* The chunk's bars: verticals of the head that lie in the chunk, as local
 * positions, with the distinct global blocks they fall in (bar_block[] with
 * bar_start[] CSR offsets into bars). */
typedef struct chunk_bars {
  ivec_t bars;
  int64_t *block; /* distinct global blocks */
  int32_t *start; /* [num_blocks + 1] */
  int32_t num_blocks;
} chunk_bars_t;

static int chunk_bars_build(const mtrain_pattern_head_t *h, const mtrain_rank_blocks_t *k,
                            int32_t G, chunk_bars_t *cb) {
  memset(cb, 0, sizeof *cb);
  cb->block = malloc((size_t)(h->num_verticals + 1) * sizeof *cb->block);
  cb->start = malloc((size_t)(h->num_verticals + 1) * sizeof *cb->start);
  if (!cb->block || !cb->start) return 0;
  for (int32_t i = 0; i < h->num_verticals; i++) {
    int64_t gb = h->verticals[i] / G;
    int32_t lb = lower_bound64(k->global, k->num_blocks, gb);
    if (lb >= k->num_blocks || k->global[lb] != gb) continue;
    int64_t local = (int64_t)lb * G + h->verticals[i] % G;
    if (cb->num_blocks == 0 || cb->block[cb->num_blocks - 1] != gb) {
      cb->block[cb->num_blocks] = gb;
      cb->start[cb->num_blocks] = (int32_t)cb->bars.size;
      cb->num_blocks++;
    }
    if (!ivec_push(&cb->bars, (int32_t)local)) return 0;
  }
  cb->start[cb->num_blocks] = (int32_t)cb->bars.size;
  return 1;
}

static void chunk_bars_free(chunk_bars_t *cb) {
  free(cb->bars.data);
  free(cb->block);
  free(cb->start);
}

/* Segments of the chunk's bars that query block gq computes: bars in global
 * blocks strictly before gq whose block diagonal is not already listed. */
static int segs_for_query(const mtrain_pattern_head_t *h, const chunk_bars_t *cb, int64_t gq,
                          ivec_t *segs, int64_t *num_bars) {
  int32_t nbb = lower_bound64(cb->block, cb->num_blocks, gq); /* bar blocks before gq */
  int32_t begin = -1;
  *num_bars = 0;
  for (int32_t b = 0; b < nbb; b++) {
    int excluded = mtrain_pattern_head_has_diagonal(h, gq - cb->block[b]);
    if (!excluded && begin < 0) begin = cb->start[b];
    if (excluded && begin >= 0) {
      if (!ivec_push(segs, begin) || !ivec_push(segs, cb->start[b])) return 0;
      *num_bars += cb->start[b] - begin;
      begin = -1;
    }
  }
  if (begin >= 0) {
    if (!ivec_push(segs, begin) || !ivec_push(segs, cb->start[nbb])) return 0;
    *num_bars += cb->start[nbb] - begin;
  }
  return 1;
}

static mtrain_status_t build_step_head(const mtrain_pattern_t *pattern, int32_t head,
                                       const mtrain_rank_blocks_t *q, const mtrain_rank_blocks_t *k,
                                       int with_bars, mtrain_step_head_store_t *out) {
  const mtrain_pattern_head_t *h = &pattern->heads[head];
  const int32_t G = pattern->granularity;
  const int64_t N = pattern->seq_len;
  mtrain_status_t st = MTRAIN_SUCCESS;
  ivec_t runs = {0}, segs = {0};
  chunk_bars_t cb;
  memset(out, 0, sizeof *out);
  memset(&cb, 0, sizeof cb);
  out->run_off = malloc((size_t)(q->num_blocks + 1) * sizeof(int32_t));
  out->seg_off = malloc((size_t)(q->num_blocks + 1) * sizeof(int32_t));
  int ok = out->run_off && out->seg_off;
  if (ok && with_bars && !h->mask_off && h->num_verticals) ok = chunk_bars_build(h, k, G, &cb);
  for (int32_t qb = 0; ok && qb < q->num_blocks; qb++) {
    int64_t gq = q->global[qb];
    out->run_off[qb] = (int32_t)(runs.size / 2);
    out->seg_off[qb] = (int32_t)(segs.size / 2);
    if (gq * G >= N) continue; /* a padding block computes nothing */
    int64_t run_start = runs.size;
    ok = h->mask_off ? runs_block_mask(h, gq, k, &runs) : runs_vertical_slash(h, gq, k, &runs);
    for (int64_t r = run_start; ok && r < runs.size; r += 2)
      for (int32_t kb = runs.data[r]; kb < runs.data[r + 1]; kb++)
        out->pairs += block_pair_count(q, qb, k, kb, N, G);
    if (ok && cb.bars.size) {
      int64_t nbars = 0;
      ok = segs_for_query(h, &cb, gq, &segs, &nbars);
      out->pairs += nbars * rows_of(q, qb, N, G);
    }
  }
  if (!ok) {
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory building head %d", head);
    free(runs.data);
    free(segs.data);
    chunk_bars_free(&cb);
    ref_step_head_store_free(out);
    return st;
  }
  out->run_off[q->num_blocks] = (int32_t)(runs.size / 2);
  out->seg_off[q->num_blocks] = (int32_t)(segs.size / 2);
  out->runs = runs.data;
  out->segs = segs.data;
  out->num_runs = (int32_t)(runs.size / 2);
  out->num_segs = (int32_t)(segs.size / 2);
  out->bars = cb.bars.data;
  out->num_bars = (int32_t)cb.bars.size;
  cb.bars.data = NULL;
  chunk_bars_free(&cb);
  return MTRAIN_SUCCESS;
}

mtrain_status_t ref_plan_build_step_head(const mtrain_pattern_t *pattern, int32_t head,
                                         const mtrain_rank_blocks_t *q,
                                         const mtrain_rank_blocks_t *k,
                                         mtrain_step_head_store_t *out) {
  return build_step_head(pattern, head, q, k, 1, out);
}

mtrain_status_t ref_plan_build_step_head_runs(const mtrain_pattern_t *pattern, int32_t head,
                                              const mtrain_rank_blocks_t *q,
                                              const mtrain_rank_blocks_t *k,
                                              mtrain_step_head_store_t *out) {
  return build_step_head(pattern, head, q, k, 0, out);
}

/* Share `part` of `parts` of head h's gathered bar work on this rank: the
 * head's bar entries (concatenated over the local query blocks in order)
 * [floor(part*B/parts), floor((part+1)*B/parts)), as segments into the
 * gathered positions (docs/BALANCE.md, "Bars gathered"). */
static mtrain_status_t build_gathered_share(const mtrain_pattern_t *pattern, int32_t head,
                                            const mtrain_rank_blocks_t *q, const int64_t *positions,
                                            int64_t count, int32_t part, int32_t parts,
                                            mtrain_step_head_store_t *out) {
  const mtrain_pattern_head_t *h = &pattern->heads[head];
  const int32_t G = pattern->granularity;
  const int64_t N = pattern->seq_len;
  chunk_bars_t cb;
  ivec_t segs = {0}, all = {0};
  memset(&cb, 0, sizeof cb);
  memset(out, 0, sizeof *out);
  out->run_off = calloc((size_t)(q->num_blocks + 1), sizeof(int32_t));
  out->seg_off = calloc((size_t)(q->num_blocks + 1), sizeof(int32_t));
  int ok = out->run_off && out->seg_off;
  /* the head's verticals as indices into the gathered positions */
  if (ok && !h->mask_off && h->num_verticals) {
    cb.block = malloc((size_t)(h->num_verticals + 1) * sizeof *cb.block);
    cb.start = malloc((size_t)(h->num_verticals + 1) * sizeof *cb.start);
    ok = cb.block && cb.start;
    for (int32_t i = 0; ok && i < h->num_verticals; i++) {
      const int64_t gb = h->verticals[i] / G;
      const int32_t idx = lower_bound64(positions, (int32_t)count, h->verticals[i]);
      if (cb.num_blocks == 0 || cb.block[cb.num_blocks - 1] != gb) {
        cb.block[cb.num_blocks] = gb;
        cb.start[cb.num_blocks] = (int32_t)cb.bars.size;
        cb.num_blocks++;
      }
      ok = ivec_push(&cb.bars, idx);
    }
    if (ok) cb.start[cb.num_blocks] = (int32_t)cb.bars.size;
  }
  /* all segments of every query block, then the share's cut of them */
  int32_t *qseg = calloc((size_t)(q->num_blocks + 1), sizeof(int32_t));
  ok = ok && qseg;
  int64_t total = 0;
  for (int32_t qb = 0; ok && qb < q->num_blocks; qb++) {
    qseg[qb] = (int32_t)(all.size / 2);
    const int64_t gq = q->global[qb];
    if (gq * G >= N || cb.bars.size == 0) continue;
    int64_t nbars = 0;
    ok = segs_for_query(h, &cb, gq, &all, &nbars);
    total += nbars;
  }
  if (qseg) qseg[q->num_blocks] = (int32_t)(all.size / 2);
  const int64_t lo = (int64_t)part * total / parts, hi = (int64_t)(part + 1) * total / parts;
  int64_t c = 0;
  for (int32_t qb = 0; ok && qb < q->num_blocks; qb++) {
    out->seg_off[qb] = (int32_t)(segs.size / 2);
    const int32_t nr = mtrain_block_rows(q->tokens, G, qb, q->global[qb], N);
    for (int32_t e = qseg[qb]; ok && e < qseg[qb + 1]; e++) {
      const int64_t b0 = all.data[2 * e], len = all.data[2 * e + 1] - b0;
      const int64_t from = lo > c ? lo - c : 0, to = hi - c < len ? hi - c : len;
      if (from < to) {
        ok = ivec_push(&segs, (int32_t)(b0 + from)) && ivec_push(&segs, (int32_t)(b0 + to));
        out->pairs += (to - from) * nr;
      }
      c += len;
    }
  }
  if (out->seg_off) out->seg_off[q->num_blocks] = (int32_t)(segs.size / 2);
  free(qseg);
  free(all.data);
  if (!ok) {
    free(segs.data);
    chunk_bars_free(&cb);
    ref_step_head_store_free(out);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory (gathered bars)");
  }
  out->segs = segs.data;
  out->num_segs = (int32_t)(segs.size / 2);
  out->bars = cb.bars.data;
  out->num_bars = (int32_t)cb.bars.size;
  cb.bars.data = NULL;
  chunk_bars_free(&cb);
  return MTRAIN_SUCCESS;
}

void ref_step_head_store_free(mtrain_step_head_store_t *s) {
  if (!s) return;
  free(s->run_off);
  free(s->runs);
  free(s->seg_off);
  free(s->segs);
  free(s->bars);
  memset(s, 0, sizeof *s);
}

mtrain_step_head_t ref_step_head_view(const mtrain_step_head_store_t *s) {
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
    for (int32_t h = 0; h < num_heads; h++) ref_step_head_store_free(&step->heads[h]);
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

void ref_plan_destroy(mtrain_plan_t *plan) {
  if (!plan) return;
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
  step->head_views[h] = ref_step_head_view(&step->heads[h]);
  plan->computed_pairs += step->heads[h].pairs;
  plan->bytes += step_head_bytes(&step->heads[h], s->q.num_blocks);
}

/* Builds step `t` of a sequence: the chunk of rank src, all heads. */
static mtrain_status_t build_step(mtrain_plan_t *plan, mtrain_plan_seq_t *s, int32_t t, int32_t src,
                                  mtrain_rank_blocks_t k, int with_bars) {
  mtrain_plan_step_t *step = &s->steps[t];
  step->k = k;
  mtrain_status_t st = step_init(plan, s, step, t, src, k.tokens, k.num_blocks, step->k.global);
  for (int32_t h = 0; st == MTRAIN_SUCCESS && h < plan->num_heads; h++) {
    st = build_step_head(s->pattern, h, &s->q, &step->k, with_bars, &step->heads[h]);
    if (st == MTRAIN_SUCCESS) step_head_done(plan, s, step, h);
  }
  return st;
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
 * gathered rows of its verticals `positions`. */
static mtrain_status_t build_bar_steps(mtrain_plan_t *plan, mtrain_plan_seq_t *ps,
                                       const int64_t *positions, int64_t count) {
  ps->bar_steps = calloc((size_t)plan->num_steps, sizeof *ps->bar_steps);
  if (!ps->bar_steps) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  for (int32_t t = 0; t < plan->num_steps; t++) {
    mtrain_plan_step_t *step = &ps->bar_steps[t];
    mtrain_status_t st = step_init(plan, ps, step, t, -1, count, 0, NULL);
    for (int32_t h = 0; st == MTRAIN_SUCCESS && h < plan->num_heads; h++) {
      st = build_gathered_share(ps->pattern, h, &ps->q, positions, count, t, plan->num_steps,
                                &step->heads[h]);
      if (st == MTRAIN_SUCCESS) step_head_done(plan, ps, step, h);
    }
    if (st) return st;
  }
  return MTRAIN_SUCCESS;
}

/* Bars gathered: for every sequence whose layout gathers its bars, the union
 * of its verticals and its bar steps; over all of them, where each gathered
 * row comes from (its owner's pack) and which rows this rank packs.
 * `slot_offset[r * num_seqs + s]` is the first local token slot of sequence
 * s on rank r. */
static mtrain_status_t build_gathered(mtrain_plan_t *plan, const mtrain_layout_t *const *layouts,
                                      const int64_t *slot_offset) {
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
    if (st == MTRAIN_SUCCESS) st = build_bar_steps(plan, ps, positions[s], ps->bar_count);
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
  MTRAIN_FAIL_IF(!plan->seqs || !slot_offset, MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
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
  if (world > 1)
    for (int32_t s = 0; s < num_seqs; s++)
      if (mtrain_layout_bars_mode(layouts[s]) == MTRAIN_BARS_GATHERED) {
        MTRAIN_TRY(build_gathered(plan, layouts, slot_offset));
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
      MTRAIN_TRY(build_step(plan, ps, t, src, k, ps->bar_steps == NULL));
    }
  }
  plan->bytes += sizeof *plan + (size_t)num_seqs * sizeof *plan->seqs;
  if (layouts) MTRAIN_TRY(check_ring_plan_agrees(ctx, plan));
  free(slot_offset);
  *out = plan;
  return MTRAIN_SUCCESS;
cleanup:
  free(slot_offset);
  ref_plan_destroy(plan);
  return st;
}

mtrain_status_t ref_plan_create_ring(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                     const mtrain_layout_t *const *layouts, int32_t ranks_per_node,
                                     const mtrain_pattern_t *const *patterns, mtrain_plan_t **out) {
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

mtrain_status_t ref_plan_create(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
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
