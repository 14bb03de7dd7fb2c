/* block_cache.c: the cache of block selections across steps
 * (mtrain_block_cache.h): per layer, the selected pattern, what it was
 * selected for (sequence length, heads, granularity, options, single or
 * ring) and the steps since; a call selects when the schedule or a change
 * of what it is asked for says so, else hands back the cached pattern. */
#include <stdlib.h>

#include "core/runtime/context_internal.h"
#include "mtrain/mtrain_block_cache.h"
#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_layout.h"

#define CACHE_MAX_LAYERS ((int32_t)1 << 20)
#define CACHE_MAX_REFRESH ((int32_t)1 << 30)

typedef struct cache_layer {
  mtrain_pattern_t *pattern; /* NULL: none (never selected, or invalidated) */
  int64_t N;                 /* what the pattern was selected for */
  int32_t Hq, G, ring;
  mtrain_block_options_t options;
  int32_t age; /* steps since the selection (0 right after it) */
  int64_t steps, selections;
} cache_layer_t;

struct mtrain_block_cache {
  int32_t num_layers, refresh;
  cache_layer_t *layers;
};

mtrain_status_t mtrain_block_cache_create(int32_t num_layers, int32_t refresh,
                                          mtrain_block_cache_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  *out = NULL;
  if (num_layers < 1 || num_layers > CACHE_MAX_LAYERS)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "block cache: num_layers %d (1 to %d)",
                        num_layers, CACHE_MAX_LAYERS);
  if (refresh < 1 || refresh > CACHE_MAX_REFRESH)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block cache: refresh %d (1 to %d steps; 1 selects every step)", refresh,
                        CACHE_MAX_REFRESH);
  mtrain_block_cache_t *c = calloc(1, sizeof *c);
  cache_layer_t *layers = calloc((size_t)num_layers, sizeof *layers);
  if (!c || !layers) {
    free(c);
    free(layers);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "block cache: out of host memory (%d layers)",
                        num_layers);
  }
  c->num_layers = num_layers;
  c->refresh = refresh;
  c->layers = layers;
  *out = c;
  return MTRAIN_SUCCESS;
}

void mtrain_block_cache_destroy(mtrain_block_cache_t *cache) {
  if (!cache) return;
  for (int32_t l = 0; l < cache->num_layers; l++) mtrain_pattern_destroy(cache->layers[l].pattern);
  free(cache->layers);
  free(cache);
}

static mtrain_status_t check_layer(const mtrain_block_cache_t *cache, int32_t layer) {
  if (layer < 0 || layer >= cache->num_layers)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "block cache: layer %d out of range (the cache has %d layers)", layer,
                        cache->num_layers);
  return MTRAIN_SUCCESS;
}

static int due_by_schedule(const mtrain_block_cache_t *cache, const cache_layer_t *l) {
  return l->pattern == NULL || l->age + 1 >= cache->refresh;
}

mtrain_status_t mtrain_block_cache_due(const mtrain_block_cache_t *cache, int32_t layer, int *due) {
  MTRAIN_CHECK_NOT_NULL(cache);
  MTRAIN_CHECK_NOT_NULL(due);
  mtrain_status_t st = check_layer(cache, layer);
  if (st) return st;
  *due = due_by_schedule(cache, &cache->layers[layer]);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_block_cache_invalidate(mtrain_block_cache_t *cache, int32_t layer) {
  MTRAIN_CHECK_NOT_NULL(cache);
  if (layer != -1) {
    mtrain_status_t st = check_layer(cache, layer);
    if (st) return st;
  }
  for (int32_t l = 0; l < cache->num_layers; l++)
    if (layer == -1 || l == layer) {
      mtrain_pattern_destroy(cache->layers[l].pattern);
      cache->layers[l].pattern = NULL;
      cache->layers[l].age = 0;
    }
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_block_cache_counts(const mtrain_block_cache_t *cache, int32_t layer,
                                          int64_t *steps, int64_t *selections) {
  MTRAIN_CHECK_NOT_NULL(cache);
  mtrain_status_t st = check_layer(cache, layer);
  if (st) return st;
  if (steps) *steps = cache->layers[layer].steps;
  if (selections) *selections = cache->layers[layer].selections;
  return MTRAIN_SUCCESS;
}

static int same_options(const mtrain_block_options_t *a, const mtrain_block_options_t *b) {
  return a->method == b->method && a->kind == b->kind && a->top_k == b->top_k &&
         a->top_p == b->top_p && a->sink_blocks == b->sink_blocks &&
         a->local_blocks == b->local_blocks && a->stride == b->stride &&
         a->head_adaptive == b->head_adaptive && a->noncausal == b->noncausal;
}

static mtrain_status_t cache_step(mtrain_block_cache_t *cache, int32_t layer, mtrain_context_t *ctx,
                                  const struct mtrain_layout *layout, const mtrain_tensor_t *q,
                                  const mtrain_tensor_t *k, const mtrain_tensor_t *lse,
                                  const mtrain_block_options_t *options,
                                  const mtrain_block_report_t *report,
                                  const mtrain_pattern_t **pattern, int32_t *age) {
  MTRAIN_CHECK_NOT_NULL(cache);
  MTRAIN_CHECK_NOT_NULL(ctx);
  MTRAIN_CHECK_NOT_NULL(q);
  MTRAIN_CHECK_NOT_NULL(k);
  MTRAIN_CHECK_NOT_NULL(options);
  MTRAIN_CHECK_NOT_NULL(pattern);
  mtrain_status_t st = check_layer(cache, layer);
  if (st) return st;
  if (q->ndim != 3)
    return mtrain_error(MTRAIN_ERR_SHAPE_MISMATCH,
                        "block cache: q must be [tokens, heads, head_dim] (ndim %d)", q->ndim);
  cache_layer_t *l = &cache->layers[layer];
  const int ring = layout != NULL;
  const int64_t N = ring ? mtrain_layout_seq_len(layout) : q->shape[0];
  const int32_t Hq = (int32_t)q->shape[1], G = ctx->config.granularity;
  const int same = l->pattern && l->N == N && l->Hq == Hq && l->G == G && l->ring == ring &&
                   same_options(&l->options, options);
  if (same && !due_by_schedule(cache, l)) {
    l->age++;
    l->steps++;
    *pattern = l->pattern;
    if (age) *age = l->age;
    return MTRAIN_SUCCESS;
  }
  mtrain_pattern_t *p = NULL;
  st = ring ? mtrain_pattern_select_blocks_ring(ctx, layout, q, k, lse, options, report, &p)
            : mtrain_pattern_select_blocks(ctx, q, k, lse, options, report, &p);
  if (st) return st; /* the layer stays as it was */
  mtrain_pattern_destroy(l->pattern);
  l->pattern = p;
  l->N = N;
  l->Hq = Hq;
  l->G = G;
  l->ring = ring;
  l->options = *options;
  l->age = 0;
  l->steps++;
  l->selections++;
  *pattern = p;
  if (age) *age = 0;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_block_cache_select(mtrain_block_cache_t *cache, int32_t layer,
                                          mtrain_context_t *ctx, const mtrain_tensor_t *q,
                                          const mtrain_tensor_t *k, const mtrain_tensor_t *lse,
                                          const mtrain_block_options_t *options,
                                          const mtrain_block_report_t *report,
                                          const mtrain_pattern_t **pattern, int32_t *age) {
  return cache_step(cache, layer, ctx, NULL, q, k, lse, options, report, pattern, age);
}

mtrain_status_t mtrain_block_cache_select_ring(
    mtrain_block_cache_t *cache, int32_t layer, mtrain_context_t *ctx,
    const struct mtrain_layout *layout, const mtrain_tensor_t *q, const mtrain_tensor_t *k,
    const mtrain_tensor_t *lse, const mtrain_block_options_t *options,
    const mtrain_block_report_t *report, const mtrain_pattern_t **pattern, int32_t *age) {
  MTRAIN_CHECK_NOT_NULL(layout);
  return cache_step(cache, layer, ctx, layout, q, k, lse, options, report, pattern, age);
}
