/* time_model.c: predicted ring time from the cost model (docs/BALANCE.md,
 * "time model"). Per layer and ring step, each rank computes its work at a
 * given FLOP rate while the next K/V chunk moves over an intra-node or an
 * inter-node link; a step ends when the slowest rank and the slowest link
 * are done. The flat ring sends every step over the link r -> r+1 (some of
 * which cross nodes); the hierarchical ring runs L inner steps over
 * intra-node links while one chunk crosses to the next node. In bars-gathered
 * mode an all-gather of the vertical K/V rows overlaps the listed-block
 * compute of step 0 and a reduce-scatter of their fp32 dK/dV ends the
 * backward. A model, not a measurement: it ignores kernel efficiency
 * differences between block and bar work, contention and NCCL's algorithms. */
#include <stdlib.h>
#include <string.h>

#include "core/balance/cost_internal.h"
#include "core/layout/layout_internal.h"
#include "core/runtime/pattern_internal.h"
#include "mtrain/mtrain_error.h"

typedef struct pass {
  double flop_per_pair; /* 4 d forward, 2.5 times that backward */
  double chunk_bytes;   /* what moves each step */
  int gather_at_start;  /* forward in gathered mode: step 0 waits for the gather */
} pass_t;

static double dmax(double a, double b) { return a > b ? a : b; }

/* Compute seconds of rank r at step t of one layer. */
static double compute_s(const mtrain_cost_t *c, mtrain_ring_kind_t ring, int32_t layer, int32_t r,
                        int32_t t, const pass_t *p, double flops, double t_gather) {
  mtrain_work_counts_t k;
  mtrain_cost_counts(c, ring, layer, r, t, &k);
  const double G = (double)c->granularity;
  const double blocks = ((double)k.full_blocks + 0.5 * (double)k.diag_blocks) * G * G;
  const double bars = (double)k.bars * G;
  const double tb = blocks * p->flop_per_pair / flops, tr = bars * p->flop_per_pair / flops;
  if (p->gather_at_start && t == 0) return dmax(tb, t_gather) + tr;
  return tb + tr;
}

static double flat_ring(const mtrain_cost_t *c, int32_t layer, const pass_t *p,
                        const mtrain_time_params_t *q, int32_t L, double t_gather) {
  const int32_t W = c->world;
  double total = 0.0;
  for (int32_t t = 0; t < W; t++) {
    double step = 0.0;
    for (int32_t r = 0; r < W; r++) {
      step = dmax(step, compute_s(c, MTRAIN_RING_FLAT, layer, r, t, p, q->flops, t_gather));
      if (t < W - 1) {
        const int intra = (r + 1) % W / L == r / L;
        step = dmax(step, q->latency + p->chunk_bytes / (intra ? q->bw_intra : q->bw_inter));
      }
    }
    total += step;
  }
  return total;
}

static double hier_ring(const mtrain_cost_t *c, int32_t layer, const pass_t *p,
                        const mtrain_time_params_t *q, int32_t L, double t_gather) {
  const int32_t W = c->world, n = W / L;
  double total = 0.0;
  for (int32_t o = 0; o < n; o++) {
    double inner = 0.0;
    for (int32_t i = 0; i < L; i++) {
      double step = 0.0;
      for (int32_t r = 0; r < W; r++)
        step = dmax(step, compute_s(c, MTRAIN_RING_HIERARCHICAL, layer, r, o * L + i, p, q->flops,
                                    t_gather));
      if (i < L - 1) step = dmax(step, q->latency + p->chunk_bytes / q->bw_intra);
      inner += step;
    }
    const double outer = o < n - 1 ? q->latency + p->chunk_bytes / q->bw_inter : 0.0;
    total += dmax(inner, outer);
  }
  return total;
}

static int cmp_i64(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* K/V rows a bars-gathered layer all-gathers: per kv head, the union of the
 * verticals of its query heads that some query block uses as a bar. */
static mtrain_status_t gathered_rows(const mtrain_pattern_t *p, int32_t kv_heads, int64_t *rows) {
  const int32_t g = p->num_heads / kv_heads;
  const int64_t nbr = p->num_blocks;
  *rows = 0;
  for (int32_t kv = 0; kv < kv_heads; kv++) {
    int64_t n = 0;
    for (int32_t h = kv * g; h < (kv + 1) * g; h++) n += p->heads[h].num_verticals;
    if (n == 0) continue;
    int64_t *all = malloc((size_t)n * sizeof *all);
    if (!all) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "time model: out of memory");
    int64_t m = 0;
    for (int32_t h = kv * g; h < (kv + 1) * g; h++)
      for (int32_t v = 0; v < p->heads[h].num_verticals; v++)
        if (p->heads[h].verticals[v] / p->granularity + 1 < nbr)
          all[m++] = p->heads[h].verticals[v];
    qsort(all, (size_t)m, sizeof *all, cmp_i64);
    for (int64_t i = 0; i < m; i++)
      if (i == 0 || all[i] != all[i - 1]) (*rows)++;
    free(all);
  }
  return MTRAIN_SUCCESS;
}

static mtrain_status_t check_params(const mtrain_time_params_t *q) {
  if (!(q->flops > 0) || !(q->bw_intra > 0) || !(q->bw_inter > 0) || !(q->latency >= 0))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "time model: flops %g, bw_intra %g and bw_inter %g must be > 0 and "
                        "latency %g >= 0",
                        q->flops, q->bw_intra, q->bw_inter, q->latency);
  if (q->head_dim < 1 || q->dtype_bytes < 1 || q->kv_heads < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "time model: head_dim %d and dtype_bytes %d must be >= 1, kv_heads %d >= 0",
                        q->head_dim, q->dtype_bytes, q->kv_heads);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_time_predict(const mtrain_cost_t *cost, const mtrain_layout_t *layout,
                                    const mtrain_pattern_t *const *patterns, int32_t num_patterns,
                                    const mtrain_time_params_t *params,
                                    mtrain_time_prediction_t out[2]) {
  MTRAIN_CHECK_NOT_NULL(cost);
  MTRAIN_CHECK_NOT_NULL(layout);
  MTRAIN_CHECK_NOT_NULL(patterns);
  MTRAIN_CHECK_NOT_NULL(params);
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_status_t st = check_params(params);
  if (st != MTRAIN_SUCCESS) return st;
  if (num_patterns != cost->num_layers || layout->world != cost->world ||
      layout->granularity != cost->granularity)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "time model: %d patterns, world %d, granularity %d do not match the cost "
                        "(%d layers, world %d, granularity %d)",
                        num_patterns, layout->world, layout->granularity, cost->num_layers,
                        cost->world, cost->granularity);
  const int32_t W = cost->world;
  const int32_t L = cost->ranks_per_node ? cost->ranks_per_node : W;
  const double d = params->head_dim;
  const double tokens = (double)layout->per_rank * layout->granularity;
  mtrain_time_prediction_t res[2];
  memset(res, 0, sizeof res);
  for (int32_t l = 0; l < num_patterns; l++) {
    const mtrain_pattern_t *p = patterns[l];
    if (!p) return mtrain_error(MTRAIN_ERR_NULL_POINTER, "time model: patterns[%d] is NULL", l);
    if (p->num_heads != cost->layer_first_head[l + 1] - cost->layer_first_head[l])
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "time model: patterns[%d] has %d heads, the cost's layer %d has %d", l,
                          p->num_heads, l,
                          cost->layer_first_head[l + 1] - cost->layer_first_head[l]);
    const int32_t kv = params->kv_heads ? params->kv_heads : p->num_heads;
    if (p->num_heads % kv != 0)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "time model: kv_heads %d does not divide the %d query heads of layer %d",
                          kv, p->num_heads, l);
    const double kv_row = (double)kv * d; /* elements of one token's K (or V) */
    const pass_t fwd = {4.0 * d, tokens * kv_row * 2 * params->dtype_bytes,
                        cost->mode == MTRAIN_BARS_GATHERED};
    const pass_t bwd = {10.0 * d, tokens * kv_row * (2.0 * params->dtype_bytes + 8.0), 0};
    const double dkdv = tokens * kv_row * 8.0;
    double t_gather = 0.0, t_rs = 0.0, bytes = 0.0;
    if (cost->mode == MTRAIN_BARS_GATHERED && W > 1) {
      int64_t rows = 0;
      st = gathered_rows(p, kv, &rows);
      if (st != MTRAIN_SUCCESS) return st;
      const double bw = W / L > 1 ? params->bw_inter : params->bw_intra;
      const double share = (double)(W - 1) / W;
      t_gather =
          (W - 1) * params->latency + (double)rows * d * 2 * params->dtype_bytes * share / bw;
      t_rs = (W - 1) * params->latency + (double)rows * d * 2 * 4.0 * share / bw;
      bytes = (double)rows * d * 2 * (params->dtype_bytes + 4.0);
    }
    double work = 0.0;
    for (int32_t r = 0; r < W; r++)
      for (int32_t t = 0; t < W; t++) work += mtrain_cost_work(cost, MTRAIN_RING_FLAT, l, r, t);
    /* final hop of the dK/dV accumulators back to their owners */
    const double back_flat =
        W > 1 ? params->latency + dkdv / (W / L > 1 ? params->bw_inter : params->bw_intra) : 0.0;
    const double back_hier = (L > 1 ? params->latency + dkdv / params->bw_intra : 0.0) +
                             (W / L > 1 ? params->latency + dkdv / params->bw_inter : 0.0);
    for (int ring = 0; ring < 2; ring++) {
      const int flat = ring == MTRAIN_RING_FLAT;
      res[ring].forward += flat ? flat_ring(cost, l, &fwd, params, L, t_gather)
                                : hier_ring(cost, l, &fwd, params, L, t_gather);
      res[ring].backward += (flat ? flat_ring(cost, l, &bwd, params, L, 0.0)
                                  : hier_ring(cost, l, &bwd, params, L, 0.0)) +
                            (flat ? back_flat : back_hier) + t_rs;
      res[ring].compute_ideal += work * 14.0 * d / params->flops / W;
      res[ring].gather += t_gather + t_rs;
      res[ring].gather_bytes += bytes;
    }
  }
  out[0] = res[0];
  out[1] = res[1];
  return MTRAIN_SUCCESS;
}
