/* cpu_tiles.c: the column tiles of a (head, query block) in a plan step (see
 * cpu_tiles.h). */
#include "backends/cpu/cpu_tiles.h"

/* Emits tiles covering local key columns [c0, c1); causal: [c0, c1) is the
 * diagonal block (or its first columns), each tile knowing its offset in it. */
static void emit_range(int64_t c0, int64_t c1, int32_t tile_cols, int32_t causal, cpu_tile_fn fn,
                       void *ctx) {
  for (int64_t c = c0; c < c1; c += tile_cols) {
    cpu_tile_t t = {c, (int32_t)(c1 - c < tile_cols ? c1 - c : tile_cols), causal, 0,
                    causal ? (int32_t)(c - c0) : 0};
    fn(ctx, &t);
  }
}

void mtrain_cpu_for_each_tile(const mtrain_step_view_t *v, int32_t h, int32_t qb, int32_t tile_cols,
                              cpu_tile_fn fn, void *ctx) {
  const mtrain_step_head_t *hd = &v->heads[h];
  const int32_t G = v->granularity;
  const int64_t gq = v->q_block_global[qb];
  for (int32_t e = hd->run_off[qb]; e < hd->run_off[qb + 1]; e++) {
    const int32_t lo = hd->runs[2 * e], hi = hd->runs[2 * e + 1];
    /* under causality the diagonal block, when present, ends its run */
    const int diag = v->causal && v->k_block_global[hi - 1] == gq;
    const int32_t body_end = diag ? hi - 1 : hi;
    int64_t c1 = (int64_t)body_end * G;
    if (c1 > v->k_tokens) c1 = v->k_tokens;
    if (!v->causal && body_end > lo) {
      /* no causal mask hides the padding slots of a partial last block */
      const int32_t last = body_end - 1;
      const int64_t valid =
          (int64_t)last * G +
          mtrain_block_rows(v->k_tokens, G, last, v->k_block_global[last], v->seq_len);
      if (c1 > valid) c1 = valid;
    }
    emit_range((int64_t)lo * G, c1, tile_cols, 0, fn, ctx);
    if (diag) {
      int64_t d0 = (int64_t)(hi - 1) * G, d1 = d0 + G;
      if (d1 > v->k_tokens) d1 = v->k_tokens;
      emit_range(d0, d1, tile_cols, 1, fn, ctx);
    }
  }
  for (int32_t s = hd->seg_off[qb]; s < hd->seg_off[qb + 1]; s++) {
    const int32_t b0 = hd->segs[2 * s], b1 = hd->segs[2 * s + 1];
    for (int32_t b = b0; b < b1; b += tile_cols) {
      cpu_tile_t t = {b, b1 - b < tile_cols ? b1 - b : tile_cols, 0, 1, 0};
      fn(ctx, &t);
    }
  }
}
