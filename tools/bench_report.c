/* bench_report.c: mtrain-bench's table and JSON (see bench_report.h): per
 * row the sparse and the dense ring's forward+backward time, tokens/s of
 * each, the speed-up and the ring time over the summed step compute. */
#include "bench_report.h"

#include <jansson.h>
#include <stdio.h>

static double total(const bench_run_t *r) { return r->fwd + r->bwd; }

void bench_print_table(const bench_info_t *info, const bench_row_t *rows, int count) {
  printf("mtrain-bench: backend %s, dtype %s, %d ranks, %d:%d heads, d %d, G %d, %s inputs\n",
         info->backend, info->dtype, info->world, info->heads, info->kv_heads, info->head_dim,
         info->granularity, info->input);
  printf("  sparse: %s layout, %s ring, pattern %s\n", info->sparse_layout, info->schedule,
         info->pattern_source);
  if (info->ranks_per_node) printf("  topology: %s\n", info->topology);
  printf("  dense: zigzag layout, %s ring; forward+backward, median of %d after %d warm-up, "
         "slowest rank\n",
         info->schedule, info->repeat, info->warmup);
  printf("%9s %5s %8s %10s %10s %12s %12s %8s %13s %13s\n", "tokens", "layer", "sparsity",
         "sparse_s", "dense_s", "sparse_tok/s", "dense_tok/s", "speedup", "sparse_ring",
         "dense_ring");
  for (int i = 0; i < count; i++) {
    const bench_row_t *r = &rows[i];
    char layer[16], dense_s[16], dense_tps[16], speedup[16], sparse_ring[32], dense_ring[32];
    snprintf(layer, sizeof layer, "-");
    if (r->layer >= 0) snprintf(layer, sizeof layer, "%d", r->layer);
    snprintf(dense_s, sizeof dense_s, "-");
    snprintf(dense_tps, sizeof dense_tps, "-");
    snprintf(speedup, sizeof speedup, "-");
    snprintf(dense_ring, sizeof dense_ring, "-");
    if (r->has_dense) {
      snprintf(dense_s, sizeof dense_s, "%.4f", total(&r->dense));
      snprintf(dense_tps, sizeof dense_tps, "%.0f", (double)r->tokens / total(&r->dense));
      snprintf(speedup, sizeof speedup, "%.2f", total(&r->dense) / total(&r->sparse));
      snprintf(dense_ring, sizeof dense_ring, "%.3f/%.3f", r->dense.fwd_ratio, r->dense.bwd_ratio);
    }
    snprintf(sparse_ring, sizeof sparse_ring, "%.3f/%.3f", r->sparse.fwd_ratio,
             r->sparse.bwd_ratio);
    printf("%9lld %5s %8.4f %10.4f %10s %12.0f %12s %8s %13s %13s\n", (long long)r->tokens, layer,
           r->sparsity, total(&r->sparse), dense_s, (double)r->tokens / total(&r->sparse),
           dense_tps, speedup, sparse_ring, dense_ring);
  }
  printf("(s: forward+backward seconds; ring: ring time / summed step compute, forward/backward, "
         "1.000 = transfers hidden)\n");
}

static json_t *run_json(const bench_run_t *r, int64_t tokens) {
  json_t *j = json_object();
  json_object_set_new(j, "forward_seconds", json_real(r->fwd));
  json_object_set_new(j, "backward_seconds", json_real(r->bwd));
  json_object_set_new(j, "seconds", json_real(total(r)));
  json_object_set_new(j, "tokens_per_second", json_real((double)tokens / total(r)));
  json_object_set_new(j, "forward_ring_over_compute", json_real(r->fwd_ratio));
  json_object_set_new(j, "backward_ring_over_compute", json_real(r->bwd_ratio));
  return j;
}

int bench_write_json(const char *path, const bench_info_t *info, const bench_row_t *rows,
                     int count) {
  json_t *j = json_object(), *arr = json_array();
  json_object_set_new(j, "tool", json_string("mtrain-bench"));
  json_object_set_new(j, "backend", json_string(info->backend));
  if (info->cuda_variant >= 0)
    json_object_set_new(j, "cuda_variant", json_integer(info->cuda_variant));
  json_object_set_new(j, "dtype", json_string(info->dtype));
  json_object_set_new(j, "world", json_integer(info->world));
  json_object_set_new(j, "heads", json_integer(info->heads));
  json_object_set_new(j, "kv_heads", json_integer(info->kv_heads));
  json_object_set_new(j, "head_dim", json_integer(info->head_dim));
  json_object_set_new(j, "granularity", json_integer(info->granularity));
  json_object_set_new(j, "input", json_string(info->input));
  json_object_set_new(j, "sparse_layout", json_string(info->sparse_layout));
  json_object_set_new(j, "dense_layout", json_string("zigzag"));
  json_object_set_new(j, "schedule", json_string(info->schedule));
  json_object_set_new(j, "ranks_per_node", json_integer(info->ranks_per_node));
  if (info->ranks_per_node)
    json_object_set_new(j, "ranks_per_node_source",
                        json_string(info->ranks_per_node_detected ? "detected" : "option"));
  json_object_set_new(j, "pattern", json_string(info->pattern_source));
  json_object_set_new(j, "warmup", json_integer(info->warmup));
  json_object_set_new(j, "repeat", json_integer(info->repeat));
  for (int i = 0; i < count; i++) {
    const bench_row_t *r = &rows[i];
    json_t *e = json_object();
    json_object_set_new(e, "tokens", json_integer(r->tokens));
    json_object_set_new(e, "layer", r->layer >= 0 ? json_integer(r->layer) : json_null());
    json_object_set_new(e, "sparsity", json_real(r->sparsity));
    json_object_set_new(e, "inputs_seconds", json_real(r->inputs_seconds));
    json_object_set_new(e, "estimate_seconds", json_real(r->estimate_seconds));
    json_object_set_new(e, "sparse", run_json(&r->sparse, r->tokens));
    json_object_set_new(e, "dense", r->has_dense ? run_json(&r->dense, r->tokens) : json_null());
    json_object_set_new(
        e, "speedup", r->has_dense ? json_real(total(&r->dense) / total(&r->sparse)) : json_null());
    json_array_append_new(arr, e);
  }
  json_object_set_new(j, "rows", arr);
  const int rc = json_dump_file(j, path, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
  json_decref(j);
  if (rc) fprintf(stderr, "mtrain-bench: cannot write --json '%s'\n", path);
  return rc ? 1 : 0;
}
