/* block_select.c: block-sparse pattern selection (SPEC.md section 9):
 * AdaSpa-style precise search from the forward's LSE, XAttention-style
 * antidiagonal scoring and MoBA-style mean-pooled gating. The backend
 * scores the (query block, key block) pairs of the query blocks a rank owns
 * (the block_scores slot), the lower-triangular score matrices are combined
 * with the communicator's all-reduce (each entry has one contributor, so the
 * sum is exact and independent of the world size), and every rank runs the
 * same host selection: top-k or top-p per query block with forced sink and
 * local blocks, optionally with head-adaptive top-k budgets. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/block_select.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"

static _Thread_local mtrain_block_times_t last_times;

mtrain_block_times_t mtrain_block_last_times(void) { return last_times; }

const char *mtrain_block_method_name(mtrain_block_method_t method) {
  switch (method) {
  case MTRAIN_BLOCK_PRECISE:
    return "precise";
  case MTRAIN_BLOCK_ANTIDIAG:
    return "antidiag";
  case MTRAIN_BLOCK_MEANPOOL:
    return "meanpool";
  }
  return "unknown";
}

mtrain_status_t mtrain_block_method_parse(const char *name, mtrain_block_method_t *out) {
  MTRAIN_CHECK_NOT_NULL(name);
  MTRAIN_CHECK_NOT_NULL(out);
  for (int m = MTRAIN_BLOCK_PRECISE; m <= MTRAIN_BLOCK_MEANPOOL; m++)
    if (strcmp(name, mtrain_block_method_name((mtrain_block_method_t)m)) == 0) {
      *out = (mtrain_block_method_t)m;
      return MTRAIN_SUCCESS;
    }
  return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                      "block method '%s' is not one of precise, antidiag, meanpool", name);
}

/* ---- the selection of one head ---------------------------------------------------- */

/* qsort has no context argument: the comparison reads this row (thread-local). */
static _Thread_local const double *rank_row;

/* Descending score, NaN last, then ascending key block. */
static int by_rank(const void *pa, const void *pb) {
  const int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
  double x = rank_row[a], y = rank_row[b];
  if (isnan(x)) x = -INFINITY;
  if (isnan(y)) y = -INFINITY;
  if (x != y) return x > y ? -1 : 1;
  return (a > b) - (a < b);
}

static inline int is_forced(const mtrain_block_options_t *o, int64_t qb, int64_t kb) {
  return kb == qb || kb < o->sink_blocks || kb > qb - o->local_blocks;
}

/* The candidates of row qb (not forced) in rank order; returns their count. */
static int64_t rank_candidates(const double *w, int64_t qb, const mtrain_block_options_t *o,
                               int64_t *idx) {
  int64_t n = 0;
  for (int64_t kb = 0; kb <= qb; kb++)
    if (!is_forced(o, qb, kb)) idx[n++] = kb;
  rank_row = w;
  qsort(idx, (size_t)n, sizeof *idx, by_rank);
  rank_row = NULL;
  return n;
}

void mtrain_block_select_head(const double *w, int64_t nb, const mtrain_block_options_t *o,
                              int32_t top_k, int64_t *mask_off, int32_t *mask_idx,
                              int64_t *scratch_idx, uint8_t *scratch_keep,
                              mtrain_block_head_result_t *result) {
  double kept_all = 0.0, total_all = 0.0;
  int64_t count = 0;
  mask_off[0] = 0;
  for (int64_t qb = 0; qb < nb; qb++) {
    const double *row = w + mtrain_block_tri(qb);
    double total = 0.0, kept = 0.0;
    for (int64_t kb = 0; kb <= qb; kb++) total += row[kb];
    for (int64_t kb = 0; kb <= qb; kb++) {
      scratch_keep[kb] = (uint8_t)is_forced(o, qb, kb);
      if (scratch_keep[kb]) kept += row[kb];
    }
    const int64_t n = rank_candidates(row, qb, o, scratch_idx);
    if (o->kind == MTRAIN_BUDGET_TOP_K) {
      const int64_t take = top_k < n ? top_k : n;
      for (int64_t u = 0; u < take; u++) {
        scratch_keep[scratch_idx[u]] = 1;
        kept += row[scratch_idx[u]];
      }
    } else {
      const double target = o->top_p * total;
      for (int64_t u = 0; u < n && kept < target; u++) {
        scratch_keep[scratch_idx[u]] = 1;
        kept += row[scratch_idx[u]];
      }
    }
    for (int64_t kb = 0; kb <= qb; kb++)
      if (scratch_keep[kb]) mask_idx[count++] = (int32_t)kb;
    mask_off[qb + 1] = count;
    kept_all += kept;
    total_all += total;
  }
  result->kept = kept_all;
  result->total = total_all;
  result->blocks = count;
}

/* ---- head-adaptive budgets ------------------------------------------------------------ */

mtrain_status_t mtrain_block_adaptive_budgets(const double *scores, int32_t Hq, int64_t nb,
                                              const mtrain_block_options_t *o, int threads,
                                              int32_t *top_k) {
  const int64_t tri = mtrain_block_tri(nb);
  double *gain = calloc((size_t)Hq * (size_t)nb, sizeof(double));
  int64_t *most = calloc((size_t)Hq, sizeof(int64_t));
  int failed = !gain || !most;
  if (!failed) {
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
      int64_t *idx = malloc(sizeof(int64_t) * (size_t)nb);
      failed |= !idx;
#pragma omp for schedule(dynamic, 1)
      for (int32_t h = 0; h < Hq; h++) {
        if (!idx) continue;
        const double *w = scores + (int64_t)h * tri;
        double *g = gain + (int64_t)h * nb, total = 0.0;
        for (int64_t qb = 0; qb < nb; qb++) {
          const double *row = w + mtrain_block_tri(qb);
          for (int64_t kb = 0; kb <= qb; kb++) total += row[kb];
          const int64_t n = rank_candidates(row, qb, o, idx);
          for (int64_t u = 0; u < n; u++) g[u] += row[idx[u]];
          if (n > most[h]) most[h] = n;
        }
        for (int64_t u = 0; u < nb; u++) g[u] = total > 0.0 ? g[u] / total : 0.0;
      }
      free(idx);
    }
  }
  if (failed) {
    free(gain);
    free(most);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory");
  }
  /* greedy: each unit to the head whose next block adds the most recall */
  for (int32_t h = 0; h < Hq; h++) top_k[h] = 0;
  const int64_t units = (int64_t)Hq * o->top_k;
  for (int64_t u = 0; u < units; u++) {
    int32_t best = -1;
    double best_gain = 0.0;
    for (int32_t h = 0; h < Hq; h++) {
      if (top_k[h] >= most[h]) continue;
      double v = gain[(int64_t)h * nb + top_k[h]];
      if (isnan(v)) v = -INFINITY;
      if (best < 0 || v > best_gain) {
        best = h;
        best_gain = v;
      }
    }
    if (best < 0) break; /* every head keeps every candidate */
    top_k[best]++;
  }
  free(gain);
  free(most);
  return MTRAIN_SUCCESS;
}

/* ---- the whole selection --------------------------------------------------------------- */

static int ctx_threads(const mtrain_context_t *ctx) {
  return ctx->config.num_threads > 0 ? ctx->config.num_threads : omp_get_max_threads();
}

static mtrain_status_t select_pattern(mtrain_context_t *ctx, const double *scores, int64_t N,
                                      int32_t Hq, int32_t G, const mtrain_block_options_t *o,
                                      const mtrain_block_report_t *report, mtrain_pattern_t **out) {
  const int64_t nb = (N + G - 1) / G, tri = mtrain_block_tri(nb);
  int threads = ctx_threads(ctx);
  mtrain_status_t st = MTRAIN_SUCCESS;
  mtrain_pattern_t *p = NULL;
  int32_t *budget = malloc(sizeof(int32_t) * (size_t)Hq);
  mtrain_status_t *status = malloc(sizeof(mtrain_status_t) * (size_t)Hq);
  mtrain_block_head_result_t *res = calloc((size_t)Hq, sizeof *res);
  MTRAIN_FAIL_IF(!budget || !status || !res, MTRAIN_ERR_OUT_OF_MEMORY,
                 "block selection: out of host memory");
  for (int32_t h = 0; h < Hq; h++) {
    budget[h] = o->kind == MTRAIN_BUDGET_TOP_K ? o->top_k : -1;
    status[h] = MTRAIN_ERR_OUT_OF_MEMORY;
  }
  if (o->kind == MTRAIN_BUDGET_TOP_K && o->head_adaptive)
    MTRAIN_TRY(mtrain_block_adaptive_budgets(scores, Hq, nb, o, threads, budget));
  MTRAIN_TRY(mtrain_pattern_create(N, Hq, G, &p));
  if (threads > Hq) threads = Hq;
#pragma omp parallel num_threads(threads)
  {
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(nb + 1));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)tri);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)nb);
    uint8_t *keep = malloc((size_t)nb);
    const int ok = off && idx && order && keep;
#pragma omp for schedule(dynamic, 1)
    for (int32_t h = 0; h < Hq; h++) {
      if (!ok) continue;
      mtrain_block_select_head(scores + (int64_t)h * tri, nb, o, budget[h], off, idx, order, keep,
                               &res[h]);
      status[h] = mtrain_pattern_set_block_csr(p, h, off, idx);
    }
    free(off);
    free(idx);
    free(order);
    free(keep);
  }
  for (int32_t h = 0; h < Hq && st == MTRAIN_SUCCESS; h++)
    if (status[h] != MTRAIN_SUCCESS)
      st = mtrain_error(status[h], "block selection: head %d failed (%s)", h,
                        mtrain_status_name(status[h]));
  if (st) goto cleanup;
  if (report) {
    for (int32_t h = 0; h < Hq; h++) {
      if (report->head_recall)
        report->head_recall[h] =
            o->method == MTRAIN_BLOCK_MEANPOOL ? NAN : res[h].kept / res[h].total;
      if (report->head_top_k) report->head_top_k[h] = budget[h];
      if (report->head_blocks) report->head_blocks[h] = res[h].blocks;
    }
  }
  *out = p;
  p = NULL;
cleanup:
  mtrain_pattern_destroy(p);
  free(budget);
  free(status);
  free(res);
  return st;
}

/* What the scores are computed from. */
typedef struct block_input {
  int64_t N;
  int32_t Hq, Hkv, d;
  mtrain_dtype_t q_dtype, k_dtype, lse_dtype;
  const void *q; /* backend memory [q_tokens, Hq, d] */
  int64_t q_tokens;
  int32_t num_q_blocks;
  const int64_t *q_block_global;
  const void *k;   /* backend memory [N, Hkv, d] */
  const void *lse; /* backend memory [q_tokens, Hq] or NULL */
} block_input_t;

static mtrain_status_t block_core(mtrain_context_t *ctx, const block_input_t *in,
                                  const mtrain_block_options_t *o,
                                  const mtrain_block_report_t *report, mtrain_pattern_t **out) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  const int32_t G = ctx->config.granularity;
  const int64_t nb = (in->N + G - 1) / G, tri = mtrain_block_tri(nb);
  const size_t n = (size_t)in->Hq * (size_t)tri;
  void *dev = NULL;
  double *host = malloc(sizeof(double) * n);
  last_times.scores = last_times.select = 0.0;
  const double t0 = mtrain_now();
  MTRAIN_FAIL_IF(!host, MTRAIN_ERR_OUT_OF_MEMORY,
                 "block selection: out of host memory (%lld blocks, %d heads)", (long long)nb,
                 in->Hq);
  MTRAIN_TRY(mtrain_be_alloc(ctx, n * sizeof(double), &dev));
  MTRAIN_TRY(mtrain_be_memset_zero(ctx, dev, n * sizeof(double)));
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
                                        .num_q_blocks = in->num_q_blocks,
                                        .q_block_global = in->q_block_global,
                                        .k_dtype = in->k_dtype,
                                        .k = in->k,
                                        .lse_dtype = in->lse_dtype,
                                        .lse = in->lse,
                                        .scores = dev};
  MTRAIN_TRY(mtrain_be_block_scores(ctx, &a));
  MTRAIN_TRY(mtrain_be_copy_to_host(ctx, host, dev, n * sizeof(double)));
  MTRAIN_TRY(mtrain_cm_allreduce(ctx, host, (int64_t)n, MTRAIN_F64, MTRAIN_REDUCE_SUM));
  const double t1 = mtrain_now();
  last_times.scores = t1 - t0;
  MTRAIN_TRY(select_pattern(ctx, host, in->N, in->Hq, G, o, report, out));
  last_times.select = mtrain_now() - t1;
cleanup:
  mtrain_be_free(ctx, dev);
  free(host);
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
  const int32_t G = ctx->config.granularity;
  const int64_t nb = (N + G - 1) / G;
  int64_t *identity = malloc(sizeof(int64_t) * (size_t)nb);
  if (!identity) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of memory");
  for (int64_t b = 0; b < nb; b++) identity[b] = b;
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
                            .num_q_blocks = (int32_t)nb,
                            .q_block_global = identity,
                            .k = k->data,
                            .lse = use_lse ? lse->data : NULL};
  st = block_core(ctx, &in, options, report, out);
  free(identity);
  return st;
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
  {
    const int use_lse = options->method == MTRAIN_BLOCK_PRECISE;
    const block_input_t in = {.N = N,
                              .Hq = (int32_t)q->shape[1],
                              .Hkv = Hkv,
                              .d = d,
                              .q_dtype = q->dtype,
                              .k_dtype = gdt,
                              .lse_dtype = use_lse ? lse->dtype : MTRAIN_F32,
                              .q = q->data,
                              .q_tokens = T,
                              .num_q_blocks = mtrain_layout_rank_num_blocks(layout, rank),
                              .q_block_global = mtrain_layout_rank_blocks(layout, rank),
                              .k = k_all,
                              .lse = use_lse ? lse->data : NULL};
    st = block_core(ctx, &in, options, report, out);
  }
cleanup:
  mtrain_be_free(ctx, k_all);
  free(host);
  free(local);
  free(index);
  return st;
}
