/* plan.c: the plan (SPEC.md section 4): for every sequence, ring step and
 * head, which key blocks (as runs of local key blocks) and which bar columns
 * (as segments of the chunk's vertical list) each local query block computes.
 * Built from patterns and the blocks each rank holds; the layouts that decide
 * those blocks live elsewhere (single rank: the identity). */
#include <stdlib.h>
#include <string.h>

#include "core/layout/schedule.h"
#include "core/runtime/context_internal.h"
#include "mtrain/mtrain_error.h"
#include "core/runtime/pattern_internal.h"
#include "core/runtime/plan_internal.h"
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
    mtrain_step_head_store_free(out);
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
    mtrain_step_head_store_free(out);
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

static void plan_seq_free(mtrain_plan_seq_t *s, int32_t num_steps, int32_t num_heads) {
  if (s->steps)
    for (int32_t t = 0; t < num_steps; t++) {
      mtrain_plan_step_t *step = &s->steps[t];
      if (step->heads)
        for (int32_t h = 0; h < num_heads; h++) mtrain_step_head_store_free(&step->heads[h]);
      free(step->heads);
      free(step->head_views);
    }
  free(s->steps);
  if (s->k_globals)
    for (int32_t t = 0; t < num_steps; t++) free(s->k_globals[t]);
  free(s->k_globals);
  free(s->q_global);
  mtrain_pattern_destroy(s->pattern);
}

static void gathered_free(mtrain_plan_gathered_t *g, int32_t num_steps, int32_t num_heads) {
  if (!g) return;
  if (g->steps)
    for (int32_t t = 0; t < num_steps; t++) {
      if (g->steps[t].heads)
        for (int32_t h = 0; h < num_heads; h++) mtrain_step_head_store_free(&g->steps[t].heads[h]);
      free(g->steps[t].heads);
      free(g->steps[t].head_views);
    }
  free(g->steps);
  free(g->positions);
  free(g->local_row);
  free(g);
}

void mtrain_plan_destroy(mtrain_plan_t *plan) {
  if (!plan) return;
  gathered_free(plan->gathered, plan->num_steps, plan->num_heads);
  if (plan->seqs)
    for (int32_t s = 0; s < plan->num_seqs; s++)
      plan_seq_free(&plan->seqs[s], plan->num_steps, plan->num_heads);
  free(plan->seqs);
  free(plan);
}

/* Builds step `t` of a sequence: the chunk of rank src, all heads. */
static mtrain_status_t build_step(mtrain_plan_t *plan, mtrain_plan_seq_t *s, int32_t t, int32_t src,
                                  mtrain_rank_blocks_t k, int with_bars) {
  const mtrain_pattern_t *p = s->pattern;
  mtrain_plan_step_t *step = &s->steps[t];
  step->src_rank = src;
  step->k = k;
  step->heads = calloc((size_t)plan->num_heads, sizeof *step->heads);
  step->head_views = calloc((size_t)plan->num_heads, sizeof *step->head_views);
  if (!step->heads || !step->head_views)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  for (int32_t h = 0; h < plan->num_heads; h++) {
    mtrain_status_t st = build_step_head(p, h, &s->q, &step->k, with_bars, &step->heads[h]);
    if (st != MTRAIN_SUCCESS) return st;
    step->head_views[h] = mtrain_step_head_view(&step->heads[h]);
    plan->computed_pairs += step->heads[h].pairs;
    plan->bytes += step_head_bytes(&step->heads[h], s->q.num_blocks);
  }
  mtrain_step_view_t v = {.step = t,
                          .src_rank = src,
                          .granularity = p->granularity,
                          .num_heads = plan->num_heads,
                          .seq_len = p->seq_len,
                          .q_tokens = s->q.tokens,
                          .k_tokens = step->k.tokens,
                          .num_q_blocks = s->q.num_blocks,
                          .num_k_blocks = step->k.num_blocks,
                          .q_block_global = s->q.global,
                          .k_block_global = step->k.global,
                          .heads = step->head_views};
  step->view = v;
  return MTRAIN_SUCCESS;
}

/* Bars gathered: the union of the verticals, this rank's rows of it, and
 * the bar share of every ring step (runs empty, bars into the union). */
static mtrain_status_t build_gathered(mtrain_plan_t *plan, mtrain_plan_seq_t *ps,
                                      const struct mtrain_layout *layout) {
  const mtrain_pattern_t *p = ps->pattern;
  mtrain_plan_gathered_t *g = calloc(1, sizeof *g);
  if (!g) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  plan->gathered = g;
  int64_t total = 0;
  for (int32_t h = 0; h < p->num_heads; h++) total += p->heads[h].num_verticals;
  g->positions = malloc(sizeof(int64_t) * (size_t)(total + 1));
  g->local_row = malloc(sizeof(int64_t) * (size_t)(total + 1));
  g->steps = calloc((size_t)plan->num_steps, sizeof *g->steps);
  if (!g->positions || !g->local_row || !g->steps)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  /* union of sorted lists: merge by sorting the concatenation */
  int64_t n = 0;
  for (int32_t h = 0; h < p->num_heads; h++)
    for (int32_t i = 0; i < p->heads[h].num_verticals; i++)
      g->positions[n++] = p->heads[h].verticals[i];
  qsort(g->positions, (size_t)n, sizeof *g->positions, cmp_i64);
  int64_t m = 0;
  for (int64_t i = 0; i < n; i++)
    if (m == 0 || g->positions[m - 1] != g->positions[i]) g->positions[m++] = g->positions[i];
  g->count = m;
  for (int64_t i = 0; i < m; i++) {
    int32_t owner = -1;
    int64_t local = -1;
    mtrain_status_t st = mtrain_layout_global_to_local(layout, g->positions[i], &owner, &local);
    if (st) return st;
    g->local_row[i] = owner == plan->rank ? local : -1;
  }
  for (int32_t t = 0; t < plan->num_steps; t++) {
    mtrain_plan_step_t *step = &g->steps[t];
    step->src_rank = -1;
    step->heads = calloc((size_t)plan->num_heads, sizeof *step->heads);
    step->head_views = calloc((size_t)plan->num_heads, sizeof *step->head_views);
    if (!step->heads || !step->head_views)
      return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
    for (int32_t h = 0; h < plan->num_heads; h++) {
      mtrain_status_t st = build_gathered_share(p, h, &ps->q, g->positions, g->count, t,
                                                plan->num_steps, &step->heads[h]);
      if (st) return st;
      step->head_views[h] = mtrain_step_head_view(&step->heads[h]);
      plan->computed_pairs += step->heads[h].pairs;
      plan->bytes += step_head_bytes(&step->heads[h], ps->q.num_blocks);
    }
    mtrain_step_view_t v = {.step = t,
                            .src_rank = -1,
                            .granularity = p->granularity,
                            .num_heads = plan->num_heads,
                            .seq_len = p->seq_len,
                            .q_tokens = ps->q.tokens,
                            .k_tokens = g->count,
                            .num_q_blocks = ps->q.num_blocks,
                            .num_k_blocks = 0,
                            .q_block_global = ps->q.global,
                            .k_block_global = NULL,
                            .heads = step->head_views};
    step->view = v;
  }
  plan->bytes += sizeof(int64_t) * 2 * (size_t)m;
  return MTRAIN_SUCCESS;
}

/* Collective: every rank must plan the same problem. A rank that planned
 * another sequence length (or head count, or schedule) would send K/V
 * chunks of another size, and a message longer than the posted receive is
 * not reliably refused by the transport: Open MPI's single-copy path (CMA)
 * was seen writing past the receive buffer (AddressSanitizer, 2026-11-22).
 * So the plans are compared before any transfer, and all ranks fail,
 * naming two ranks and their values. */
static mtrain_status_t check_ring_plan_agrees(mtrain_context_t *ctx, int64_t seq_len, int32_t heads,
                                              int32_t ranks_per_node) {
  const int size = mtrain_comm_size(ctx->comm);
  if (size <= 1) return MTRAIN_SUCCESS;
  const int64_t mine[3] = {seq_len, heads, ranks_per_node};
  int64_t *all = calloc((size_t)size * 3, sizeof *all);
  if (!all) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  mtrain_status_t st = ctx->comm->ops->allgather(ctx->comm->state, mine, all, sizeof mine);
  for (int r = 1; st == MTRAIN_SUCCESS && r < size; r++)
    if (memcmp(all, all + 3 * r, sizeof mine) != 0)
      st =
          mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                       "plan: rank 0 plans the ring for %lld tokens, %lld heads, ranks per node "
                       "%lld; rank %d for %lld tokens, %lld heads, ranks per node %lld: every "
                       "rank must plan the same problem (expected the same on every rank)",
                       (long long)all[0], (long long)all[1], (long long)all[2], r,
                       (long long)all[3 * r], (long long)all[3 * r + 1], (long long)all[3 * r + 2]);
  free(all);
  return st;
}

mtrain_status_t mtrain_plan_create_ring(mtrain_context_t *ctx, const struct mtrain_layout *layout,
                                        int32_t ranks_per_node, const mtrain_pattern_t *pattern,
                                        mtrain_plan_t **out) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(layout);
  MTRAIN_CHECK_NOT_NULL(pattern);
  MTRAIN_CHECK_NOT_NULL(out);
  const int32_t world = mtrain_context_world(ctx), rank = mtrain_context_rank(ctx);
  if (mtrain_layout_world(layout) != world)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "plan: the layout is for %d ranks, the communicator has %d",
                        mtrain_layout_world(layout), world);
  if (mtrain_layout_seq_len(layout) != pattern->seq_len)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "plan: the layout is for %lld tokens, the pattern for %lld",
                        (long long)mtrain_layout_seq_len(layout), (long long)pattern->seq_len);
  if (mtrain_layout_granularity(layout) != ctx->config.granularity ||
      pattern->granularity != ctx->config.granularity)
    return mtrain_error(MTRAIN_ERR_INVALID_PATTERN,
                        "plan: granularity of the layout (%d) and the pattern (%d) must be the "
                        "context's (%d)",
                        mtrain_layout_granularity(layout), pattern->granularity,
                        ctx->config.granularity);
  if (ranks_per_node < 0 || (ranks_per_node > 0 && world % ranks_per_node != 0))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "plan: ranks_per_node %d does not divide the world size %d", ranks_per_node,
                        world);
  mtrain_status_t st =
      check_ring_plan_agrees(ctx, pattern->seq_len, pattern->num_heads, ranks_per_node);
  if (st != MTRAIN_SUCCESS) return st;
  mtrain_plan_t *plan = calloc(1, sizeof *plan);
  if (!plan) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  plan->num_seqs = 1;
  plan->num_steps = world;
  plan->num_heads = pattern->num_heads;
  plan->granularity = ctx->config.granularity;
  plan->rank = rank;
  plan->world = world;
  plan->ranks_per_node = ranks_per_node == world ? 0 : ranks_per_node;
  plan->seqs = calloc(1, sizeof *plan->seqs);
  MTRAIN_FAIL_IF(!plan->seqs, MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  mtrain_plan_seq_t *ps = &plan->seqs[0];
  MTRAIN_TRY(mtrain_pattern_clone(pattern, &ps->pattern));
  ps->q.num_blocks = mtrain_layout_rank_num_blocks(layout, rank);
  ps->q.global = mtrain_layout_rank_blocks(layout, rank);
  ps->q.tokens = mtrain_layout_local_tokens(layout, rank);
  ps->q_global = malloc(sizeof(int64_t) * (size_t)(ps->q.num_blocks + 1));
  ps->steps = calloc((size_t)world, sizeof *ps->steps);
  MTRAIN_FAIL_IF(!ps->q_global || !ps->steps, MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  memcpy(ps->q_global, ps->q.global, sizeof(int64_t) * (size_t)ps->q.num_blocks);
  ps->q.global = ps->q_global; /* the plan must not depend on the layout's lifetime */
  if (world > 1 && mtrain_layout_bars_mode(layout) == MTRAIN_BARS_GATHERED)
    MTRAIN_TRY(build_gathered(plan, ps, layout));
  ps->k_globals = calloc((size_t)world, sizeof *ps->k_globals);
  MTRAIN_FAIL_IF(!ps->k_globals, MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  for (int32_t t = 0; t < world; t++) {
    int32_t src = 0;
    MTRAIN_TRY(mtrain_ring_source(world, plan->ranks_per_node, rank, t, &src));
    mtrain_rank_blocks_t k = {mtrain_layout_rank_num_blocks(layout, src), NULL,
                              mtrain_layout_local_tokens(layout, src)};
    ps->k_globals[t] = malloc(sizeof(int64_t) * (size_t)(k.num_blocks + 1));
    MTRAIN_FAIL_IF(!ps->k_globals[t], MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
    memcpy(ps->k_globals[t], mtrain_layout_rank_blocks(layout, src),
           sizeof(int64_t) * (size_t)k.num_blocks);
    k.global = ps->k_globals[t];
    MTRAIN_TRY(build_step(plan, ps, t, src, k, plan->gathered == NULL));
  }
  plan->local_tokens = ps->q.tokens;
  plan->bytes += sizeof *plan + sizeof *plan->seqs;
  *out = plan;
  return MTRAIN_SUCCESS;
cleanup:
  mtrain_plan_destroy(plan);
  return st;
}

/* Builds one sequence of a single-rank plan (identity layout, one step). */
static mtrain_status_t build_single_rank_seq(mtrain_plan_t *plan, mtrain_plan_seq_t *s) {
  const mtrain_pattern_t *p = s->pattern;
  int32_t nb = (int32_t)p->num_blocks;
  s->q_global = malloc((size_t)nb * sizeof *s->q_global);
  s->steps = calloc(1, sizeof *s->steps);
  if (!s->q_global || !s->steps)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  for (int32_t b = 0; b < nb; b++) s->q_global[b] = b;
  s->q.num_blocks = nb;
  s->q.global = s->q_global;
  s->q.tokens = p->seq_len;
  return build_step(plan, s, 0, 0, s->q, 1);
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
                        "plan: world size %d: use mtrain_plan_create_ring with a layout for "
                        "several ranks",
                        world);
  mtrain_plan_t *plan = calloc(1, sizeof *plan);
  if (!plan) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  plan->num_seqs = seqs ? seqs->num_seqs : 1;
  plan->num_steps = 1;
  plan->world = 1;
  plan->num_heads = patterns[0]->num_heads;
  plan->granularity = ctx->config.granularity;
  plan->rank = 0;
  plan->seqs = calloc((size_t)plan->num_seqs, sizeof *plan->seqs);
  MTRAIN_FAIL_IF(!plan->seqs, MTRAIN_ERR_OUT_OF_MEMORY, "plan: out of memory");
  for (int32_t s = 0; s < plan->num_seqs; s++) {
    mtrain_plan_seq_t *ps = &plan->seqs[s];
    MTRAIN_TRY(mtrain_pattern_clone(patterns[s], &ps->pattern));
    ps->local_offset = plan->local_tokens;
    MTRAIN_TRY(build_single_rank_seq(plan, ps));
    plan->local_tokens += ps->q.tokens;
  }
  plan->bytes += sizeof *plan + (size_t)plan->num_seqs * sizeof *plan->seqs;
  *out = plan;
  return MTRAIN_SUCCESS;
cleanup:
  mtrain_plan_destroy(plan);
  return st;
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
int64_t mtrain_plan_computed_pairs(const mtrain_plan_t *plan) {
  return plan ? plan->computed_pairs : 0;
}
size_t mtrain_plan_bytes(const mtrain_plan_t *plan) { return plan ? plan->bytes : 0; }
