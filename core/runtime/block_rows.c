/* block_rows.c: the selected rows of the distributed block selection
 * (SPEC.md section 9.6, block_rows.h): each rank selects its own query block
 * rows into one compact message (per head and row: kept and total score,
 * count, key blocks), the messages are all-gathered (in pieces of at most
 * mtrain_block_gather_piece bytes per rank), and every rank assembles the
 * whole pattern and the per-head report, summing over the query blocks in
 * ascending order as one rank does. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/backend.h"
#include "core/runtime/block_rows.h"
#include "core/runtime/block_select.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"

size_t mtrain_block_gather_piece = (size_t)256 << 20;

int mtrain_block_threads(const mtrain_context_t *ctx) {
  return ctx->config.num_threads > 0 ? ctx->config.num_threads : omp_get_max_threads();
}

int64_t mtrain_block_rank_rows(const struct mtrain_layout *layout, int64_t nb, int32_t r,
                               const int64_t **blocks, int32_t *local) {
  if (!layout) {
    *blocks = NULL;
    *local = (int32_t)nb;
    return nb;
  }
  *blocks = mtrain_layout_rank_blocks(layout, r);
  *local = mtrain_layout_rank_num_blocks(layout, r);
  int64_t n = 0;
  for (int32_t lb = 0; lb < *local; lb++) n += (*blocks)[lb] < nb;
  return n;
}

/* One rank's selected rows as sent: kept [Hq][n], total [Hq][n] (fp64),
 * count [Hq][n] (int32), then the key blocks of each (head, row) in that
 * order (int32); n the rank's rows. */
typedef struct rows_msg {
  const double *kept, *total;
  const int32_t *count, *idx;
} rows_msg_t;

static rows_msg_t rows_msg_at(const void *base, int32_t Hq, int64_t n) {
  rows_msg_t m;
  m.kept = base;
  m.total = m.kept + (size_t)Hq * (size_t)n;
  m.count = (const int32_t *)(m.total + (size_t)Hq * (size_t)n);
  m.idx = m.count + (size_t)Hq * (size_t)n;
  return m;
}

static size_t rows_msg_bytes(int32_t Hq, int64_t n, int64_t selected) {
  const size_t b = (size_t)Hq * (size_t)n * (2 * sizeof(double) + sizeof(int32_t)) +
                   sizeof(int32_t) * (size_t)selected;
  return (b + 7) / 8 * 8;
}

mtrain_status_t mtrain_block_select_rows(mtrain_context_t *ctx, const double *scores, int64_t R,
                                         const int64_t *row_off, const int64_t *row_qb, int64_t n,
                                         int64_t nb, int32_t Hq, const mtrain_block_options_t *o,
                                         const int32_t *budget, void **msg, size_t *bytes) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  int32_t *sel = malloc(sizeof(int32_t) * ((size_t)Hq * (size_t)R + 1));
  double *kept = malloc(sizeof(double) * ((size_t)Hq * (size_t)n + 1));
  double *total = malloc(sizeof(double) * ((size_t)Hq * (size_t)n + 1));
  int32_t *count = malloc(sizeof(int32_t) * ((size_t)Hq * (size_t)n + 1));
  void *buf = NULL;
  int64_t most = 0;
  for (int64_t r = 0; r < n; r++) {
    const int64_t len = mtrain_block_row_len(row_qb[r], nb, o);
    most = len > most ? len : most;
  }
  int failed = !sel || !kept || !total || !count;
  if (!failed) {
    const int64_t tasks = (int64_t)Hq * n;
#pragma omp parallel num_threads(mtrain_block_threads(ctx)) reduction(| : failed)
    {
      int64_t *order = malloc(sizeof(int64_t) * (size_t)(most + 1));
      uint8_t *keep = malloc((size_t)(most + 1));
      const int ok = order && keep;
      failed |= !ok;
#pragma omp for schedule(dynamic, 16)
      for (int64_t t = 0; t < tasks; t++) {
        if (!ok) continue;
        const int32_t h = (int32_t)(t / n);
        const int64_t r = t % n, at = (int64_t)h * R + row_off[r];
        count[t] = (int32_t)mtrain_block_select_row(
            scores + at, row_qb[r], mtrain_block_row_len(row_qb[r], nb, o), o, budget[h], sel + at,
            order, keep, &kept[t], &total[t]);
      }
      free(order);
      free(keep);
    }
  }
  MTRAIN_FAIL_IF(failed, MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory");
  int64_t selected = 0;
  for (int64_t t = 0; t < (int64_t)Hq * n; t++) selected += count[t];
  *bytes = rows_msg_bytes(Hq, n, selected);
  buf = calloc(1, *bytes + 8);
  MTRAIN_FAIL_IF(!buf, MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory");
  {
    rows_msg_t m = rows_msg_at(buf, Hq, n);
    memcpy((double *)m.kept, kept, sizeof(double) * (size_t)Hq * (size_t)n);
    memcpy((double *)m.total, total, sizeof(double) * (size_t)Hq * (size_t)n);
    memcpy((int32_t *)m.count, count, sizeof(int32_t) * (size_t)Hq * (size_t)n);
    int32_t *dst = (int32_t *)m.idx;
    for (int64_t t = 0; t < (int64_t)Hq * n; t++) {
      const int32_t h = (int32_t)(t / n);
      memcpy(dst, sel + (int64_t)h * R + row_off[t % n], sizeof(int32_t) * (size_t)count[t]);
      dst += count[t];
    }
  }
  *msg = buf;
  buf = NULL;
cleanup:
  free(buf);
  free(sel);
  free(kept);
  free(total);
  free(count);
  return st;
}

mtrain_status_t mtrain_block_assemble(mtrain_context_t *ctx, const struct mtrain_layout *layout,
                                      int64_t N, int32_t Hq, const char *all, size_t stride,
                                      const int32_t *budget, const mtrain_block_options_t *o,
                                      const mtrain_block_report_t *report, mtrain_pattern_t **out) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  const int32_t W = mtrain_context_world(ctx), G = ctx->config.granularity;
  const int64_t nb = (N + G - 1) / G;
  int32_t *owner = malloc(sizeof(int32_t) * (size_t)(nb + 1));
  int64_t *pos = malloc(sizeof(int64_t) * (size_t)(nb + 1));
  int64_t *nrows = calloc((size_t)W, sizeof(int64_t));
  int64_t **from = calloc((size_t)W, sizeof(int64_t *));
  mtrain_block_head_result_t *res = calloc((size_t)Hq, sizeof *res);
  mtrain_status_t *status = malloc(sizeof(mtrain_status_t) * (size_t)Hq);
  mtrain_pattern_t *p = NULL;
  MTRAIN_FAIL_IF(!owner || !pos || !nrows || !from || !res || !status, MTRAIN_ERR_OUT_OF_MEMORY,
                 "block selection: out of host memory");
  for (int64_t qb = 0; qb < nb; qb++) owner[qb] = -1;
  int64_t most = 0; /* the most key blocks of one head */
  for (int32_t r = 0; r < W; r++) {
    const int64_t *blocks;
    int32_t local;
    const int64_t n = nrows[r] = mtrain_block_rank_rows(layout, nb, r, &blocks, &local);
    int64_t i = 0;
    for (int32_t lb = 0; lb < local; lb++) {
      const int64_t gb = mtrain_block_at(blocks, lb);
      if (gb >= nb) continue;
      MTRAIN_FAIL_IF(owner[gb] >= 0, MTRAIN_ERR_INVALID_ARGUMENT,
                     "block selection: query block %lld is on ranks %d and %d", (long long)gb,
                     owner[gb], r);
      owner[gb] = r;
      pos[gb] = i++;
    }
    const rows_msg_t m = rows_msg_at(all + (size_t)r * stride, Hq, n);
    from[r] = malloc(sizeof(int64_t) * ((size_t)Hq * (size_t)n + 1));
    MTRAIN_FAIL_IF(!from[r], MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory");
    int64_t at = 0;
    for (int32_t h = 0; h < Hq; h++) {
      for (int64_t t = 0; t < n; t++) {
        from[r][(int64_t)h * n + t] = at;
        at += m.count[(int64_t)h * n + t];
        res[h].blocks += m.count[(int64_t)h * n + t];
      }
    }
  }
  for (int64_t qb = 0; qb < nb; qb++)
    MTRAIN_FAIL_IF(owner[qb] < 0, MTRAIN_ERR_INVALID_ARGUMENT,
                   "block selection: query block %lld is on no rank", (long long)qb);
  for (int32_t h = 0; h < Hq; h++) {
    most = res[h].blocks > most ? res[h].blocks : most;
    status[h] = MTRAIN_ERR_OUT_OF_MEMORY;
  }
  MTRAIN_TRY(o->noncausal ? mtrain_pattern_create_noncausal(N, Hq, G, &p)
                          : mtrain_pattern_create(N, Hq, G, &p));
  int threads = mtrain_block_threads(ctx);
  if (threads > Hq) threads = Hq;
#pragma omp parallel num_threads(threads)
  {
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(nb + 1));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(most + 1));
    const int ok = off && idx;
#pragma omp for schedule(dynamic, 1)
    for (int32_t h = 0; h < Hq; h++) {
      if (!ok) continue;
      double kept = 0.0, total = 0.0;
      off[0] = 0;
      for (int64_t qb = 0; qb < nb; qb++) {
        const int32_t r = owner[qb];
        const int64_t t = (int64_t)h * nrows[r] + pos[qb];
        const rows_msg_t m = rows_msg_at(all + (size_t)r * stride, Hq, nrows[r]);
        memcpy(idx + off[qb], m.idx + from[r][t], sizeof(int32_t) * (size_t)m.count[t]);
        off[qb + 1] = off[qb] + m.count[t];
        kept += m.kept[t];
        total += m.total[t];
      }
      res[h].kept = kept;
      res[h].total = total;
      status[h] = mtrain_pattern_set_block_csr(p, h, off, idx);
    }
    free(off);
    free(idx);
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
  if (from)
    for (int32_t r = 0; r < W; r++) free(from[r]);
  free(from);
  free(owner);
  free(pos);
  free(nrows);
  free(res);
  free(status);
  return st;
}

/* The all-gather of `stride` bytes per rank in pieces of at most
 * mtrain_block_gather_piece bytes (communicators may refuse 2 GiB per rank),
 * into all [W][stride]. */
static mtrain_status_t gather_pieces(mtrain_context_t *ctx, const char *msg, char *all,
                                     size_t stride) {
  const size_t piece = mtrain_block_gather_piece;
  const int32_t W = mtrain_context_world(ctx);
  if (stride <= piece) return mtrain_cm_allgather(ctx, msg, all, stride);
  char *tmp = malloc(piece * (size_t)W);
  if (!tmp)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY,
                        "block selection: out of host memory gathering the selection");
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (size_t off = 0; off < stride && !st; off += piece) {
    const size_t n = stride - off < piece ? stride - off : piece;
    st = mtrain_cm_allgather(ctx, msg + off, tmp, n);
    for (int32_t r = 0; r < W && !st; r++)
      memcpy(all + (size_t)r * stride + off, tmp + (size_t)r * n, n);
  }
  free(tmp);
  return st;
}

mtrain_status_t mtrain_block_gather_rows(mtrain_context_t *ctx, void **msg, size_t bytes,
                                         char **all, size_t *stride) {
  const int32_t W = mtrain_context_world(ctx);
  double longest = (double)bytes;
  mtrain_status_t st = mtrain_cm_allreduce(ctx, &longest, 1, MTRAIN_F64, MTRAIN_REDUCE_MAX);
  if (st) return st;
  *stride = (size_t)longest;
  void *send = realloc(*msg, *stride + 8);
  if (!send) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block selection: out of host memory");
  *msg = send;
  memset((char *)send + bytes, 0, *stride - bytes);
  *all = malloc(*stride * (size_t)W + 8);
  if (!*all)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY,
                        "block selection: out of host memory gathering the selection (%zu bytes)",
                        *stride * (size_t)W);
  return gather_pieces(ctx, send, *all, *stride);
}
