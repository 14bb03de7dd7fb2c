/* block_entry.c: the entry points of block-sparse selection (SPEC.md
 * section 9): AdaSpa-style precise search from the forward's LSE,
 * XAttention-style antidiagonal scoring and MoBA-style mean-pooled gating.
 * The backend scores the (query block, key block) pairs of the query blocks
 * this rank owns (the block_scores slot, in its compact form: only these
 * rows are held), the head-adaptive budgets combine exact per-head gain
 * curves (an fp64 all-reduce of exact-sum words), each rank selects its own
 * rows, and the selected rows (per row: kept and total score, count, key
 * blocks) are all-gathered, so every rank assembles the same pattern, bitwise
 * the single-rank one. The keys: passed around the ring in chunks on a
 * backend that scores key chunks of the method (cpu and cpu-ref, host
 * memory; three passes for antidiag), else gathered on every rank (cuda,
 * MTRAIN_BLOCK_KEY_GATHER=1). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/block_rows.h"
#include "core/runtime/block_select.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/exact_sum.h"
#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"

static _Thread_local mtrain_block_times_t last_times;

mtrain_block_times_t mtrain_block_last_times(void) { return last_times; }

/* What the scores are computed from. */
typedef struct block_input {
  int64_t N;
  int32_t Hq, Hkv, d;
  mtrain_dtype_t q_dtype, k_dtype, lse_dtype;
  const void *q; /* backend memory [q_tokens, Hq, d] */
  int64_t q_tokens;
  const void *k;                 /* backend memory [N, Hkv, d] */
  const void *lse;               /* backend memory [q_tokens, Hq] or NULL */
  const mtrain_layout_t *layout; /* the ranks' query blocks; NULL: one rank owns them all */
  int key_ring; /* 1: k is this rank's own chunk [q_tokens, Hkv, d], passed around the ring */
} block_input_t;

/* Posts the sends (send != 0) or receives of `bytes` in pieces below 1 GiB
 * (communicators may refuse 2 GiB), appending their requests. */
static mtrain_status_t post_pieces(mtrain_context_t *ctx, void *buf, size_t bytes, int peer,
                                   int send, mtrain_comm_request_t **req, int *nreq) {
  const size_t piece = (size_t)1 << 30;
  for (size_t off = 0; off < bytes; off += piece) {
    const size_t n = bytes - off < piece ? bytes - off : piece;
    mtrain_status_t st =
        send ? mtrain_cm_isend(ctx, (char *)buf + off, n, peer, MTRAIN_TAG_BLOCK_KEYS, &req[*nreq])
             : mtrain_cm_irecv(ctx, (char *)buf + off, n, peer, MTRAIN_TAG_BLOCK_KEYS, &req[*nreq]);
    if (st) return st;
    (*nreq)++;
  }
  return MTRAIN_SUCCESS;
}

/* One ring pass over the key chunks: at step s this rank holds the keys of
 * rank (rank - s) mod W, scores its query blocks against that chunk's key
 * blocks while passing it on to rank + 1 and receiving the next from
 * rank - 1. Two chunk buffers (buf); no rank ever holds every key. */
static mtrain_status_t key_ring_pass(mtrain_context_t *ctx, const block_input_t *in,
                                     mtrain_block_scores_args_t a, void *buf[2], size_t row,
                                     int pieces) {
  const int32_t W = mtrain_context_world(ctx), rank = mtrain_context_rank(ctx);
  mtrain_comm_request_t **req = calloc((size_t)(2 * pieces), sizeof *req);
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (!req) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory");
  const void *hand = in->k;
  for (int32_t s = 0; s < W && !st; s++) {
    const int32_t src = (rank - s + W) % W, next = (rank - s - 1 + W) % W;
    int nreq = 0;
    if (s + 1 < W) {
      void *into = buf[(s + 1) % 2];
      st = post_pieces(ctx, into, (size_t)mtrain_layout_local_tokens(in->layout, next) * row,
                       (rank - 1 + W) % W, 0, req, &nreq);
      if (!st)
        st = post_pieces(ctx, (void *)hand,
                         (size_t)mtrain_layout_local_tokens(in->layout, src) * row, (rank + 1) % W,
                         1, req, &nreq);
    }
    if (!st) {
      a.k = hand;
      a.k_tokens = mtrain_layout_local_tokens(in->layout, src);
      a.num_k_blocks = mtrain_layout_rank_num_blocks(in->layout, src);
      a.k_block_global = mtrain_layout_rank_blocks(in->layout, src);
      st = mtrain_be_block_scores(ctx, &a);
    }
    for (int i = 0; i < nreq; i++) {
      const mtrain_status_t w = mtrain_cm_wait(ctx, req[i]);
      if (!st) st = w;
    }
    hand = buf[(s + 1) % 2];
  }
  free(req);
  return st;
}

/* The scores from the keys passed around the ring: one pass (precise,
 * meanpool), or three for the antidiagonal method (SPEC.md 9.6: the row
 * maxima, the exact normalisers, the scores), its strided rows' state held
 * between them (Hq x the local strided rows, in backend memory). */
static mtrain_status_t score_key_ring(mtrain_context_t *ctx, const block_input_t *in,
                                      mtrain_block_scores_args_t a) {
  const int32_t W = mtrain_context_world(ctx);
  const size_t row = (size_t)in->Hkv * (size_t)in->d * mtrain_dtype_size(in->k_dtype);
  int64_t most = 0;
  for (int32_t r = 0; r < W; r++)
    if (mtrain_layout_local_tokens(in->layout, r) > most)
      most = mtrain_layout_local_tokens(in->layout, r);
  const int pieces = (int)(((size_t)most * row) >> 30) + 2;
  void *buf[2] = {NULL, NULL};
  mtrain_antidiag_row_t *state = NULL;
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (W > 1) {
    st = mtrain_be_alloc(ctx, (size_t)most * row + 8, &buf[0]);
    if (!st) st = mtrain_be_alloc(ctx, (size_t)most * row + 8, &buf[1]);
  }
  if (!st && a.method == MTRAIN_BLOCK_ANTIDIAG) {
    const int64_t n = (int64_t)a.num_heads * a.num_q_blocks * (a.granularity / a.stride);
    st = mtrain_be_alloc(ctx, sizeof *state * (size_t)(n + 1), (void **)&state);
    for (int64_t i = 0; !st && i < n; i++) {
      state[i].max = -INFINITY;
      state[i].z[0] = state[i].z[1] = state[i].z[2] = state[i].nan = 0;
    }
    a.row_state = state;
    for (int32_t pass = 1; pass <= 3 && !st; pass++) {
      a.antidiag_pass = pass;
      st = key_ring_pass(ctx, in, a, buf, row, pieces);
    }
  } else if (!st) {
    st = key_ring_pass(ctx, in, a, buf, row, pieces);
  }
  mtrain_be_free(ctx, state);
  mtrain_be_free(ctx, buf[0]);
  mtrain_be_free(ctx, buf[1]);
  return st;
}

/* The owned rows' scores: [Hq * R] host, row_off[lb] of each local block
 * (R = the sum of the row lengths, gb + 1 or nb non-causally, over the local
 * blocks gb < nb). A backend in host
 * memory scores straight into *out, then *owner is that backend buffer (to
 * free with mtrain_be_free), else *owner is NULL and *out is malloc'd. */
static mtrain_status_t owned_scores(mtrain_context_t *ctx, const block_input_t *in,
                                    const mtrain_block_options_t *o, int32_t local,
                                    const int64_t *blocks, int64_t *row_off, int64_t *R,
                                    double **out, void **owner) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  const int32_t G = ctx->config.granularity;
  const int64_t nb = (in->N + G - 1) / G;
  int64_t *global = malloc(sizeof(int64_t) * (size_t)(local + 1));
  void *dev = NULL;
  double *host = NULL;
  MTRAIN_FAIL_IF(!global, MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory");
  *R = 0;
  for (int32_t lb = 0; lb < local; lb++) {
    global[lb] = mtrain_block_at(blocks, lb);
    row_off[lb] = *R;
    if (global[lb] < nb) *R += mtrain_block_row_len(global[lb], nb, o);
  }
  const size_t n = (size_t)in->Hq * (size_t)*R;
  const int on_host = mtrain_be_memory_space(ctx) == MTRAIN_MEMORY_HOST;
  if (!on_host) {
    host = malloc(sizeof(double) * (n + 1));
    MTRAIN_FAIL_IF(!host, MTRAIN_ERR_OUT_OF_MEMORY,
                   "block selection: out of host memory (%lld score rows, %d heads)", (long long)*R,
                   in->Hq);
  }
  MTRAIN_TRY(mtrain_be_alloc(ctx, (n + 1) * sizeof(double), &dev));
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, dev, (n + 1) * sizeof(double)));
  const mtrain_block_scores_args_t a = {.method = o->method,
                                        .seq_len = in->N,
                                        .granularity = G,
                                        .num_heads = in->Hq,
                                        .num_kv_heads = in->Hkv,
                                        .head_dim = in->d,
                                        .scale = ctx->config.softmax_scale > 0
                                                     ? ctx->config.softmax_scale
                                                     : 1.0 / sqrt((double)in->d),
                                        .stride = o->stride,
                                        .q_dtype = in->q_dtype,
                                        .q = in->q,
                                        .q_tokens = in->q_tokens,
                                        .num_q_blocks = local,
                                        .q_block_global = global,
                                        .k_dtype = in->k_dtype,
                                        .k = in->k,
                                        .lse_dtype = in->lse_dtype,
                                        .lse = in->lse,
                                        .scores = dev,
                                        .scores_row = row_off,
                                        .scores_head_stride = *R,
                                        .noncausal = o->noncausal ? 1 : 0};
  if (in->key_ring)
    MTRAIN_TRY(score_key_ring(ctx, in, a));
  else
    MTRAIN_TRY(mtrain_be_block_scores(ctx, &a));
  last_times.score_bytes = (int64_t)(n * sizeof(double));
  if (on_host) {
    *out = dev;
    *owner = dev;
    dev = NULL;
  } else {
    MTRAIN_TRY(mtrain_be_copy_to_host(ctx, host, dev, n * sizeof(double)));
    *out = host;
    *owner = NULL;
    host = NULL;
  }
cleanup:
  mtrain_be_free(ctx, dev);
  free(host);
  free(global);
  return st;
}

/* The budgets: top_k, -1 for top-p, or the head-adaptive ones from the
 * gain words of every rank's rows (an exact fp64 sum all-reduce). */
static mtrain_status_t budgets(mtrain_context_t *ctx, const double *scores, int64_t R,
                               const int64_t *row_off, const int64_t *row_qb, int64_t rows,
                               int32_t Hq, int64_t nb, const mtrain_block_options_t *o,
                               int32_t *budget) {
  for (int32_t h = 0; h < Hq; h++) budget[h] = o->kind == MTRAIN_BUDGET_TOP_K ? o->top_k : -1;
  if (o->kind != MTRAIN_BUDGET_TOP_K || !o->head_adaptive) return MTRAIN_SUCCESS;
  mtrain_status_t st = MTRAIN_SUCCESS;
  const int64_t cap = mtrain_block_gain_cap(nb, Hq, o);
  const int64_t count = (int64_t)Hq * (cap + 1) * MTRAIN_XSUM_WORDS;
  double *words = malloc(sizeof(double) * (size_t)count);
  MTRAIN_FAIL_IF(!words, MTRAIN_ERR_OUT_OF_MEMORY,
                 "block selection: out of host memory (gain curves of %d heads, %lld ranks)", Hq,
                 (long long)cap);
  MTRAIN_TRY(mtrain_block_gain_words(scores, R, row_off, row_qb, rows, nb, Hq, o, cap,
                                     mtrain_block_threads(ctx), words));
  MTRAIN_TRY(mtrain_cm_allreduce(ctx, words, count, MTRAIN_F64, MTRAIN_REDUCE_SUM));
  mtrain_block_budgets_from_words(words, Hq, nb, o, cap, budget);
cleanup:
  free(words);
  return st;
}

static void release_scores(mtrain_context_t *ctx, double **scores, void **owner) {
  if (*owner)
    mtrain_be_free(ctx, *owner);
  else
    free(*scores);
  *scores = NULL;
  *owner = NULL;
}

static mtrain_status_t block_core(mtrain_context_t *ctx, const block_input_t *in,
                                  const mtrain_block_options_t *o,
                                  const mtrain_block_report_t *report, mtrain_pattern_t **out) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  const int32_t G = ctx->config.granularity, rank = mtrain_context_rank(ctx),
                W = mtrain_context_world(ctx);
  const int64_t nb = (in->N + G - 1) / G;
  const int64_t *blocks;
  int32_t local;
  const int64_t n = mtrain_block_rank_rows(in->layout, nb, rank, &blocks, &local);
  int64_t *row_off = malloc(sizeof(int64_t) * (size_t)(local + 1));
  int64_t *off = malloc(sizeof(int64_t) * (size_t)(n + 1)),
          *qbs = malloc(sizeof(int64_t) * (size_t)(n + 1));
  int32_t *budget = malloc(sizeof(int32_t) * (size_t)in->Hq);
  double *scores = NULL;
  void *scores_owner = NULL; /* the backend buffer holding scores, if any */
  void *msg = NULL;
  char *all = NULL;
  int64_t R = 0;
  size_t bytes = 0;
  memset(&last_times, 0, sizeof last_times);
  const double t0 = mtrain_now();
  MTRAIN_FAIL_IF(!row_off || !off || !qbs || !budget, MTRAIN_ERR_OUT_OF_MEMORY,
                 "block selection: out of host memory");
  MTRAIN_TRY(owned_scores(ctx, in, o, local, blocks, row_off, &R, &scores, &scores_owner));
  /* the rows (< nb) of the local blocks, ascending */
  for (int32_t lb = 0, i = 0; lb < local; lb++)
    if (mtrain_block_at(blocks, lb) < nb)
      off[i] = row_off[lb], qbs[i++] = mtrain_block_at(blocks, lb);
  const double t1 = mtrain_now();
  last_times.scores = t1 - t0;
  MTRAIN_TRY(budgets(ctx, scores, R, off, qbs, n, in->Hq, nb, o, budget));
  MTRAIN_TRY(
      mtrain_block_select_rows(ctx, scores, R, off, qbs, n, nb, in->Hq, o, budget, &msg, &bytes));
  release_scores(ctx, &scores, &scores_owner);
  /* the compact gather: every rank's message, padded to the longest */
  size_t stride = 0;
  MTRAIN_TRY(mtrain_block_gather_rows(ctx, &msg, bytes, &all, &stride));
  last_times.gather_bytes = (int64_t)(stride * (size_t)W);
  MTRAIN_TRY(
      mtrain_block_assemble(ctx, in->layout, in->N, in->Hq, all, stride, budget, o, report, out));
  last_times.select = mtrain_now() - t1;
cleanup:
  free(row_off);
  free(off);
  free(qbs);
  free(budget);
  release_scores(ctx, &scores, &scores_owner);
  free(msg);
  free(all);
  return st;
}

/* ---- argument checks and the two entry points -------------------------------------------- */

static mtrain_status_t check_options(const mtrain_context_t *ctx, const mtrain_block_options_t *o) {
  if (o->method != MTRAIN_BLOCK_PRECISE && o->method != MTRAIN_BLOCK_ANTIDIAG &&
      o->method != MTRAIN_BLOCK_MEANPOOL)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "block selection: unknown method %d",
                        (int)o->method);
  if (o->kind == MTRAIN_BUDGET_TOP_K) {
    if (o->top_k < 0)
      return mtrain_error(MTRAIN_ERR_INVALID_BUDGET, "block selection: top_k %d (>= 0)", o->top_k);
  } else if (o->kind == MTRAIN_BUDGET_TOP_P) {
    if (!(o->top_p > 0.0 && o->top_p <= 1.0))
      return mtrain_error(MTRAIN_ERR_INVALID_BUDGET, "block selection: top_p %g (in (0, 1])",
                          o->top_p);
    if (o->method == MTRAIN_BLOCK_MEANPOOL)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "block selection: meanpool gating is top-k only (its scores are "
                          "logits, not masses)");
  } else {
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "block selection: unknown budget kind %d",
                        (int)o->kind);
  }
  if (o->head_adaptive && (o->kind != MTRAIN_BUDGET_TOP_K || o->method == MTRAIN_BLOCK_MEANPOOL))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block selection: head_adaptive needs top-k with precise or antidiag");
  if (o->sink_blocks < 0 || o->local_blocks < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block selection: sink_blocks %d and local_blocks %d (>= 0)",
                        o->sink_blocks, o->local_blocks);
  if (o->noncausal != 0 && o->noncausal != 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block selection: noncausal %d (0: causal, 1: every key block)",
                        o->noncausal);
  if (o->method == MTRAIN_BLOCK_ANTIDIAG &&
      (o->stride < 1 || ctx->config.granularity % o->stride != 0))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block selection: stride %d does not divide the granularity %d", o->stride,
                        ctx->config.granularity);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t check_inputs(mtrain_context_t *ctx, const mtrain_tensor_t *q,
                                    const mtrain_tensor_t *k, const mtrain_tensor_t *lse,
                                    const mtrain_block_options_t *o, int64_t N) {
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(q);
  MTRAIN_CHECK_NOT_NULL(k);
  MTRAIN_CHECK_NOT_NULL(o);
  mtrain_status_t st = check_options(ctx, o);
  if (st) return st;
  if (q->ndim != 3 || k->ndim != 3)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "block selection: q and k must be [tokens, heads, head_dim] (ndim %d "
                        "and %d)",
                        q->ndim, k->ndim);
  if (q->shape[0] < 1 || k->shape[0] != q->shape[0])
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH, "block selection: q has %lld tokens, k has %lld",
                        (long long)q->shape[0], (long long)k->shape[0]);
  if (k->shape[2] != q->shape[2] || q->shape[2] < 1)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "block selection: q has head_dim %lld, k has %lld", (long long)q->shape[2],
                        (long long)k->shape[2]);
  if (k->shape[1] < 1 || q->shape[1] % k->shape[1] != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                        "block selection: query heads %lld are not a multiple of kv heads %lld",
                        (long long)q->shape[1], (long long)k->shape[1]);
  if (k->dtype != q->dtype)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "block selection: q is %s but k is %s",
                        mtrain_dtype_name(q->dtype), mtrain_dtype_name(k->dtype));
  if (!q->data || !k->data)
    return mtrain_error(MTRAIN_ERR_NULL_POINTER, "block selection: tensor '%s' has data == NULL",
                        q->data ? "k" : "q");
  if (o->method == MTRAIN_BLOCK_PRECISE) {
    if (!lse || !lse->data)
      return mtrain_error(MTRAIN_ERR_NULL_POINTER,
                          "block selection: the precise method needs the forward's lse");
    if (lse->ndim != 2 || lse->shape[0] != q->shape[0] || lse->shape[1] != q->shape[1])
      return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                          "block selection: lse must be [%lld, %lld] (the rows of q)",
                          (long long)q->shape[0], (long long)q->shape[1]);
    if (lse->dtype != MTRAIN_F32 && lse->dtype != MTRAIN_F64)
      return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "block selection: lse is %s (fp32 or fp64)",
                          mtrain_dtype_name(lse->dtype));
  }
  const int64_t nb = (N + ctx->config.granularity - 1) / ctx->config.granularity;
  if (nb > MTRAIN_PATTERN_MAX_MASK_BLOCKS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block selection: %lld blocks, more than a block mask may have (%lld)",
                        (long long)nb, (long long)MTRAIN_PATTERN_MAX_MASK_BLOCKS);
  if (!mtrain_be_has_block_scores(ctx))
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "block selection: backend '%s' has no block scores (the optional "
                        "block_scores slot)",
                        ctx->backend_name);
  if (o->noncausal && !ctx->backend->block_scores_noncausal)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "block selection: backend '%s' scores causal blocks only (noncausal 1 "
                        "needs a backend with block_scores_noncausal: cpu, cpu-ref, cuda)",
                        ctx->backend_name);
  return mtrain_be_supports(ctx, q->dtype, (int32_t)q->shape[2]);
}

mtrain_status_t mtrain_pattern_select_blocks(mtrain_context_t *ctx, const mtrain_tensor_t *q,
                                             const mtrain_tensor_t *k, const mtrain_tensor_t *lse,
                                             const mtrain_block_options_t *options,
                                             const mtrain_block_report_t *report,
                                             mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  MTRAIN_CHECK_NOT_NULL(q);
  mtrain_status_t st = check_inputs(ctx, q, k, lse, options, q->shape[0]);
  if (st) return st;
  if (mtrain_context_world(ctx) != 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block selection: world size %d: use mtrain_pattern_select_blocks_ring "
                        "with the layout of the ranks' tensors",
                        mtrain_context_world(ctx));
  const int64_t N = q->shape[0];
  const int use_lse = options->method == MTRAIN_BLOCK_PRECISE;
  const block_input_t in = {.N = N,
                            .Hq = (int32_t)q->shape[1],
                            .Hkv = (int32_t)k->shape[1],
                            .d = (int32_t)q->shape[2],
                            .q_dtype = q->dtype,
                            .k_dtype = k->dtype,
                            .lse_dtype = use_lse ? lse->dtype : MTRAIN_F32,
                            .q = q->data,
                            .q_tokens = N,
                            .k = k->data,
                            .lse = use_lse ? lse->data : NULL,
                            .layout = NULL};
  return block_core(ctx, &in, options, report, out);
}

/* The ring pass over the key chunks where the backend scores key chunks of
 * the method (block_scores_key_chunks: cpu and cpu-ref, every method) in
 * host memory, unless MTRAIN_BLOCK_KEY_GATHER=1 asks for the gather of every
 * key (for comparisons; the same on every rank, as the backend and the
 * options are). */
static int key_ring_possible(const mtrain_context_t *ctx, const mtrain_block_options_t *o) {
  const char *env = getenv("MTRAIN_BLOCK_KEY_GATHER");
  if (env && strcmp(env, "1") == 0) return 0;
  const int need =
      o->method == MTRAIN_BLOCK_ANTIDIAG ? MTRAIN_BLOCK_CHUNKS_ANTIDIAG : MTRAIN_BLOCK_CHUNKS_SUMS;
  return (ctx->backend->block_scores_key_chunks & need) &&
         mtrain_be_memory_space(ctx) == MTRAIN_MEMORY_HOST &&
         mtrain_cm_memory_space(ctx) != MTRAIN_MEMORY_DEVICE;
}

mtrain_status_t
mtrain_pattern_select_blocks_ring(mtrain_context_t *ctx, const struct mtrain_layout *layout,
                                  const mtrain_tensor_t *q, const mtrain_tensor_t *k,
                                  const mtrain_tensor_t *lse, const mtrain_block_options_t *options,
                                  const mtrain_block_report_t *report, mtrain_pattern_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  MTRAIN_CHECK_NOT_NULL(layout);
  const int64_t N = mtrain_layout_seq_len(layout);
  mtrain_status_t st = check_inputs(ctx, q, k, lse, options, N);
  if (st) return st;
  const int32_t rank = mtrain_context_rank(ctx), world = mtrain_context_world(ctx);
  const int64_t T = mtrain_layout_local_tokens(layout, rank);
  if (mtrain_layout_world(layout) != world)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block selection: the layout is for %d ranks, the communicator has %d",
                        mtrain_layout_world(layout), world);
  if (mtrain_layout_granularity(layout) != ctx->config.granularity)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block selection: the layout's granularity %d is not the context's %d",
                        mtrain_layout_granularity(layout), ctx->config.granularity);
  if (q->shape[0] != T)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "block selection: rank %d holds %lld token slots of the layout, q has "
                        "%lld",
                        rank, (long long)T, (long long)q->shape[0]);
  const int32_t Hkv = (int32_t)k->shape[1], d = (int32_t)k->shape[2];
  const int use_lse = options->method == MTRAIN_BLOCK_PRECISE;
  if (key_ring_possible(ctx, options)) {
    const block_input_t in = {.N = N,
                              .Hq = (int32_t)q->shape[1],
                              .Hkv = Hkv,
                              .d = d,
                              .q_dtype = q->dtype,
                              .k_dtype = k->dtype,
                              .lse_dtype = use_lse ? lse->dtype : MTRAIN_F32,
                              .q = q->data,
                              .q_tokens = T,
                              .k = k->data,
                              .lse = use_lse ? lse->data : NULL,
                              .layout = layout,
                              .key_ring = 1};
    return block_core(ctx, &in, options, report, out);
  }
  /* gather every key: each global row has one owner, the others add zeros */
  const mtrain_dtype_t gdt = k->dtype == MTRAIN_F64 ? MTRAIN_F64 : MTRAIN_F32;
  const size_t row = (size_t)Hkv * d, esz = mtrain_dtype_size(k->dtype),
               gsz = mtrain_dtype_size(gdt);
  void *host = calloc((size_t)N * row, gsz), *local = malloc((size_t)T * row * esz);
  int64_t *index = malloc(sizeof(int64_t) * (size_t)T);
  void *k_all = NULL;
  MTRAIN_FAIL_IF(!host || !local || !index, MTRAIN_ERR_OUT_OF_MEMORY,
                 "block selection: out of host memory gathering %lld keys", (long long)N);
  MTRAIN_TRY(mtrain_layout_rank_token_index(layout, rank, index));
  MTRAIN_TRY(mtrain_be_copy_to_host(ctx, local, k->data, (size_t)T * row * esz));
  for (int64_t i = 0; i < T; i++)
    if (index[i] < N)
      MTRAIN_TRY(mtrain_convert((const char *)local + (size_t)i * row * esz, k->dtype,
                                (char *)host + (size_t)index[i] * row * gsz, gdt, (int64_t)row));
  MTRAIN_TRY(mtrain_cm_allreduce(ctx, host, (int64_t)((size_t)N * row), gdt, MTRAIN_REDUCE_SUM));
  MTRAIN_TRY(mtrain_be_alloc(ctx, (size_t)N * row * gsz, &k_all));
  MTRAIN_TRY(mtrain_be_copy_from_host(ctx, k_all, host, (size_t)N * row * gsz));
  free(host); /* the scoring needs only the backend's copy */
  host = NULL;
  free(local);
  local = NULL;
  {
    const block_input_t in = {.N = N,
                              .Hq = (int32_t)q->shape[1],
                              .Hkv = Hkv,
                              .d = d,
                              .q_dtype = q->dtype,
                              .k_dtype = gdt,
                              .lse_dtype = use_lse ? lse->dtype : MTRAIN_F32,
                              .q = q->data,
                              .q_tokens = T,
                              .k = k_all,
                              .lse = use_lse ? lse->data : NULL,
                              .layout = layout};
    st = block_core(ctx, &in, options, report, out);
  }
cleanup:
  mtrain_be_free(ctx, k_all);
  free(host);
  free(local);
  free(index);
  return st;
}
