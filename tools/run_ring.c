/* run_ring.c: mtrain-run on several ranks (under mpiexec): every rank
 * generates its own slots of the layout directly (or reads the whole input
 * files and keeps its slots), builds or estimates the pattern (the estimate
 * runs distributed), runs the ring forward and backward, optionally checks
 * against the distributed fp64 reference and gathers the outputs to rank 0;
 * rank 0 prints the per-rank and total report (sparsity, time per phase,
 * effective GFLOP/s, imbalance). Set-up shared with mtrain-bench:
 * ring_common.c. */
#include "run_ring.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_io.h"
#include "mtrain/mtrain_layout.h"
#include "ring_common.h"
#include "run_common.h"
#include "tool_common.h"

static const char *prog = "mtrain-run";

static double load(const mtrain_tensor_t *t, int64_t i) {
  double x = 0.0;
  mtrain_convert((const char *)t->data + i * (int64_t)mtrain_dtype_size(t->dtype), t->dtype, &x,
                 MTRAIN_F64, 1);
  return x;
}

/* max |a - ref| and max |ref| over the rows that hold sequence tokens. */
static void compare_rows(const mtrain_tensor_t *a, const mtrain_tensor_t *ref, const int64_t *index,
                         int64_t N, double *err, double *ref_max) {
  const int64_t T = ref->shape[0], width = mtrain_tensor_numel(ref) / (T > 0 ? T : 1);
  for (int64_t i = 0; i < T; i++) {
    if (index[i] >= N) continue;
    for (int64_t x = 0; x < width; x++) {
      const double u = load(a, i * width + x), w = load(ref, i * width + x);
      const double d = fabs(u - w);
      if (!isfinite(u)) *err = INFINITY;
      if (d > *err) *err = d;
      if (fabs(w) > *ref_max) *ref_max = fabs(w);
    }
  }
}

typedef struct ring_run {
  const run_options_t *o;
  ring_env_t env;
  mtrain_layout_t *layout;
  ring_inputs_t in; /* this rank's inputs; in.N, in.T, in.index */
  run_outputs_t out, dev_out;
  mtrain_pattern_t *pattern;
  mtrain_plan_t *plan;
  run_result_t r;
  double t_inputs; /* making the inputs, slowest rank */
} ring_run_t;

static int make_pattern(ring_run_t *rr) {
  const run_options_t *o = rr->o;
  const int64_t N = rr->in.N;
  const int32_t heads = rr->in.host.heads;
  if (run_options_estimate(o))
    return ring_estimate(prog, &rr->env, o, rr->layout, &rr->in, &rr->pattern, &rr->r.t_estimate);
  if (!o->pattern_path)
    return tool_failed(prog, "dense pattern",
                       mtrain_pattern_create_dense(N, heads, o->granularity, &rr->pattern));
  if (tool_failed(prog, o->pattern_path, mtrain_pattern_read_json(o->pattern_path, &rr->pattern)))
    return 1;
  if (mtrain_pattern_seq_len(rr->pattern) != N || mtrain_pattern_num_heads(rr->pattern) != heads ||
      mtrain_pattern_granularity(rr->pattern) != o->granularity) {
    fprintf(stderr,
            "%s: %s: the pattern (N=%lld, %d heads, G=%d) does not match the inputs "
            "(N=%lld, %d heads, G=%d)\n",
            prog, o->pattern_path, (long long)mtrain_pattern_seq_len(rr->pattern),
            mtrain_pattern_num_heads(rr->pattern), mtrain_pattern_granularity(rr->pattern),
            (long long)N, heads, o->granularity);
    return 1;
  }
  return 0;
}

/* The distributed fp64 reference (cpu-ref over the same ring) and the
 * comparison of this rank's rows; errors combined over ranks. */
static int check(ring_run_t *rr) {
  const double t0 = tool_now();
  mtrain_context_t *ref = NULL;
  mtrain_plan_t *plan = NULL;
  run_inputs_t in64 = {0};
  run_outputs_t out64 = {0};
  int rc = run_make_context(prog, rr->o, "cpu-ref", rr->env.comm, &ref);
  if (!rc)
    rc =
        tool_failed(prog, "reference plan",
                    mtrain_plan_create_ring(ref, NULL, (const mtrain_layout_t *const[]){rr->layout},
                                            rr->env.ranks_per_node,
                                            (const mtrain_pattern_t *const[]){rr->pattern}, &plan));
  if (!rc) rc = run_inputs_widen(&rr->in.host, &in64);
  if (!rc) rc = run_outputs_alloc(&in64, MTRAIN_F64, &out64);
  run_options_t once = *rr->o;
  once.repeat = 1;
  run_result_t scratch = {0};
  if (!rc) rc = run_attention(prog, ref, plan, &in64, &out64, &once, &scratch);
  if (!rc) {
    const mtrain_dtype_t dt = rr->in.host.q.dtype;
    const double rel = tool_check_tolerance(dt); /* the tools' one bound (tool_common.h) */
    const int n = rr->o->forward_only ? 2 : 5;
    double mine[10] = {0}, all[10];
    for (int t = 0; t < n; t++)
      compare_rows(run_outputs_get(&rr->out, t), run_outputs_get(&out64, t), rr->in.index, rr->in.N,
                   &mine[2 * t], &mine[2 * t + 1]);
    MPI_Allreduce(mine, all, 10, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    rr->r.check_ok = 1;
    for (int t = 0; t < n; t++) {
      rr->r.err[t] = all[2 * t];
      rr->r.ref_max[t] = all[2 * t + 1];
      rr->r.bound[t] = rel * all[2 * t + 1];
      if (!(rr->r.err[t] <= rr->r.bound[t])) rr->r.check_ok = 0;
    }
    rr->r.checked = 1;
  }
  run_outputs_free(&out64);
  run_inputs_free(&in64);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ref);
  rr->r.t_check = tool_now() - t0;
  return rc;
}

/* Rank 0 gathers every rank's rows of each output and writes them in
 * global order, with the pattern. */
static int write_outputs(ring_run_t *rr) {
  static const char *const names[5] = {"o", "lse", "dq", "dk", "dv"};
  const run_options_t *o = rr->o;
  int rc = 0;
  if (rr->env.rank == 0) mkdir(o->out_dir, 0755);
  int64_t *all_index =
      rr->env.rank == 0 ? malloc(sizeof(int64_t) * (size_t)(rr->in.T * rr->env.world)) : NULL;
  MPI_Gather(rr->in.index, (int)rr->in.T, MPI_INT64_T, all_index, (int)rr->in.T, MPI_INT64_T, 0,
             MPI_COMM_WORLD);
  for (int t = 0; t < (o->forward_only ? 2 : 5); t++) {
    const mtrain_tensor_t *loc = run_outputs_get(&rr->out, t);
    const size_t row =
        (size_t)(mtrain_tensor_numel(loc) / rr->in.T) * mtrain_dtype_size(loc->dtype);
    char *all = rr->env.rank == 0 ? malloc(row * (size_t)(rr->in.T * rr->env.world)) : NULL;
    MPI_Gather(loc->data, (int)(row * (size_t)rr->in.T), MPI_BYTE, all,
               (int)(row * (size_t)rr->in.T), MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rr->env.rank == 0 && !rc) {
      mtrain_tensor_t g = *loc;
      g.shape[0] = rr->in.N;
      g.data = malloc(row * (size_t)rr->in.N);
      for (int64_t i = 0; i < rr->in.T * rr->env.world; i++)
        if (all_index[i] < rr->in.N)
          memcpy((char *)g.data + (size_t)all_index[i] * row, all + (size_t)i * row, row);
      char path[4096];
      snprintf(path, sizeof path, "%s/%s.npy", o->out_dir, names[t]);
      rc = tool_failed(prog, path, run_write_f32(path, &g));
      free(g.data);
    }
    free(all);
  }
  if (rr->env.rank == 0 && !rc) {
    char path[4096];
    snprintf(path, sizeof path, "%s/pattern.json", o->out_dir);
    rc = tool_failed(prog, path, mtrain_pattern_write_json(path, rr->pattern));
  }
  free(all_index);
  return rc;
}

/* Memory of every rank (docs/MEMORY.md): the peak backend bytes of the run's
 * context, their bound from the shapes (mtrain_memory_bound), the plan's
 * host bytes and the process peak RSS, gathered on rank 0 (`all`, 4 per
 * rank). Collective. 1 (message naming the rank) when this rank's peak
 * exceeds its bound or the figures cannot be had. */
static int memory_gather(ring_run_t *rr, double mine[4], double *all) {
  const run_options_t *o = rr->o;
  mtrain_memory_stats_t s = {0};
  mtrain_memory_bound_t b = {0};
  int rc = tool_failed(prog, "memory figures", mtrain_context_memory(rr->env.ctx, &s));
  if (!rc)
    rc = tool_failed(prog, "memory bound",
                     mtrain_memory_bound(rr->env.ctx, rr->plan, rr->in.host.kv_heads,
                                         rr->in.host.head_dim, rr->in.host.q.dtype,
                                         run_options_estimate(o) ? o->last_q : 0, &b));
  mine[0] = (double)s.backend_peak_bytes;
  mine[1] = (double)b.backend_bytes;
  mine[2] = (double)b.plan_bytes;
  mine[3] = (double)s.process_peak_rss_bytes;
  MPI_Gather(mine, 4, MPI_DOUBLE, all, 4, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (!rc && s.backend_peak_bytes > b.backend_bytes) {
    fprintf(stderr,
            "%s: rank %d: peak backend memory %zu bytes exceeds its bound %zu bytes "
            "(docs/MEMORY.md)\n",
            prog, rr->env.rank, s.backend_peak_bytes, b.backend_bytes);
    rc = 1;
  }
  return rc;
}

/* Per-rank figures gathered on rank 0, then the report. Returns 1 when a
 * rank's peak backend memory exceeds its bound (memory_gather). */
static int report(ring_run_t *rr) {
  const run_options_t *o = rr->o;
  double mem[4];
  double *mem_all = rr->env.rank == 0 ? malloc(sizeof(double) * 4 * (size_t)rr->env.world) : NULL;
  const int mem_rc = memory_gather(rr, mem, mem_all);
  double mem_max[4] = {0};
  int mem_within = 1; /* rank 0: every rank's peak within its bound */
  for (int r = 0; mem_all && r < rr->env.world; r++) {
    for (int x = 0; x < 4; x++) mem_max[x] = fmax(mem_max[x], mem_all[4 * r + x]);
    mem_within &= mem_all[4 * r] <= mem_all[4 * r + 1];
  }
  double mine[4] = {(double)mtrain_plan_computed_pairs(rr->plan), rr->r.t_fwd, rr->r.t_bwd,
                    rr->r.t_estimate};
  double *all = rr->env.rank == 0 ? malloc(sizeof(double) * 4 * (size_t)rr->env.world) : NULL;
  MPI_Gather(mine, 4, MPI_DOUBLE, all, 4, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  /* the totals; communication hidden: ring time over the summed step compute */
  ring_totals_t tot;
  ring_totals_compute(rr->plan, &rr->r, o->forward_only, &tot);
  if (rr->env.rank != 0) return mem_rc;
  const int d = rr->in.host.head_dim;
  const double pairs = tot.pairs, max_pairs = tot.max_pairs, max_fwd = tot.fwd, max_bwd = tot.bwd;
  const double sum_fwd = tot.fwd_sum, worst[2] = {tot.fwd_ratio, tot.bwd_ratio};
  const double dense = (double)rr->in.host.heads * (double)rr->in.N * (rr->in.N + 1) / 2;
  const double flops = 4.0 * d * pairs;
  const char *sched = rr->env.ranks_per_node ? "hierarchical" : "flat";
  if (o->json) {
    json_t *j = json_object(), *ranks = json_array();
    json_object_set_new(j, "backend", json_string(o->backend));
    json_object_set_new(j, "dtype", json_string(mtrain_dtype_name(rr->in.host.q.dtype)));
    json_object_set_new(j, "world", json_integer(rr->env.world));
    json_object_set_new(j, "layout", json_string(mtrain_layout_variant(rr->layout)));
    json_object_set_new(j, "schedule", json_string(sched));
    json_object_set_new(j, "ranks_per_node", json_integer(rr->env.ranks_per_node));
    if (rr->env.ranks_per_node)
      json_object_set_new(j, "ranks_per_node_source",
                          json_string(rr->env.ranks_per_node_detected ? "detected" : "option"));
    json_object_set_new(j, "seq_len", json_integer(rr->in.N));
    json_object_set_new(j, "heads", json_integer(rr->in.host.heads));
    json_object_set_new(j, "kv_heads", json_integer(rr->in.host.kv_heads));
    json_object_set_new(j, "head_dim", json_integer(d));
    json_object_set_new(j, "pattern", json_string(run_pattern_source(o)));
    json_object_set_new(j, "sparsity", json_real(1.0 - pairs / dense));
    json_object_set_new(j, "inputs_seconds", json_real(rr->t_inputs));
    json_object_set_new(j, "estimate_seconds", json_real(rr->r.t_estimate));
    json_object_set_new(j, "forward_seconds", json_real(max_fwd));
    json_object_set_new(j, "forward_gflops", json_real(flops / max_fwd * 1e-9));
    json_object_set_new(j, "pair_imbalance", json_real(max_pairs / (pairs / rr->env.world)));
    json_object_set_new(j, "forward_ring_over_compute", json_real(worst[0]));
    if (!o->forward_only) json_object_set_new(j, "backward_ring_over_compute", json_real(worst[1]));
    json_object_set_new(j, "forward_time_imbalance",
                        json_real(max_fwd / (sum_fwd / rr->env.world)));
    if (!o->forward_only) {
      json_object_set_new(j, "backward_seconds", json_real(max_bwd));
      json_object_set_new(j, "backward_gflops", json_real(2.5 * flops / max_bwd * 1e-9));
    }
    for (int r = 0; r < rr->env.world; r++) {
      json_t *e = json_object();
      json_object_set_new(e, "computed_pairs", json_integer((json_int_t)all[4 * r]));
      json_object_set_new(e, "forward_seconds", json_real(all[4 * r + 1]));
      json_object_set_new(e, "backward_seconds", json_real(all[4 * r + 2]));
      json_object_set_new(e, "backend_peak_bytes", json_integer((json_int_t)mem_all[4 * r]));
      json_object_set_new(e, "backend_bound_bytes", json_integer((json_int_t)mem_all[4 * r + 1]));
      json_object_set_new(e, "plan_bytes", json_integer((json_int_t)mem_all[4 * r + 2]));
      json_object_set_new(e, "process_peak_rss_bytes",
                          json_integer((json_int_t)mem_all[4 * r + 3]));
      json_array_append_new(ranks, e);
    }
    json_object_set_new(j, "ranks", ranks);
    json_t *m = json_object(); /* the largest over the ranks */
    json_object_set_new(m, "backend_peak_bytes", json_integer((json_int_t)mem_max[0]));
    json_object_set_new(m, "backend_bound_bytes", json_integer((json_int_t)mem_max[1]));
    json_object_set_new(m, "plan_bytes", json_integer((json_int_t)mem_max[2]));
    json_object_set_new(m, "process_peak_rss_bytes", json_integer((json_int_t)mem_max[3]));
    json_object_set_new(m, "within_bound", json_boolean(mem_within));
    json_object_set_new(j, "memory_max", m);
    if (rr->r.checked) {
      json_t *c = json_object();
      json_object_set_new(c, "passed", json_boolean(rr->r.check_ok));
      json_object_set_new(c, "seconds", json_real(rr->r.t_check));
      static const char *const names[5] = {"o", "lse", "dq", "dk", "dv"};
      for (int t = 0; t < (o->forward_only ? 2 : 5); t++) {
        json_t *e = json_object();
        json_object_set_new(e, "max_abs_error", json_real(rr->r.err[t]));
        json_object_set_new(e, "bound", json_real(rr->r.bound[t]));
        json_object_set_new(c, names[t], e);
      }
      json_object_set_new(j, "check", c);
    }
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    if (text) puts(text);
    free(text);
    json_decref(j);
  } else {
    printf("mtrain-run: backend %s, dtype %s, %d ranks, layout %s, %s ring\n", o->backend,
           mtrain_dtype_name(rr->in.host.q.dtype), rr->env.world, mtrain_layout_variant(rr->layout),
           sched);
    if (rr->env.ranks_per_node) printf("  topology   %s\n", ring_env_topology(&rr->env));
    printf("  shape      N=%lld Hq=%d Hkv=%d d=%d G=%d, %lld token slots per rank\n",
           (long long)rr->in.N, rr->in.host.heads, rr->in.host.kv_heads, d, o->granularity,
           (long long)rr->in.T);
    printf("  inputs     %s, %.3f s (slowest rank)\n",
           o->q_path ? "read, each rank's slots taken" : "generated, each rank its own slots",
           rr->t_inputs);
    printf("  pattern    %s: sparsity %.2f%%\n", run_pattern_source(o),
           100.0 * (1 - pairs / dense));
    if (run_options_estimate(o))
      printf("  estimate   %.3f ms (distributed, last %d queries)\n", 1e3 * rr->r.t_estimate,
             o->last_q);
    printf("  %-6s %14s %12s %12s %12s\n", "rank", "pairs", "forward ms", "backward ms",
           "fwd GFLOP/s");
    for (int r = 0; r < rr->env.world; r++)
      printf("  %-6d %14.0f %12.3f %12.3f %12.2f\n", r, all[4 * r], 1e3 * all[4 * r + 1],
             1e3 * all[4 * r + 2], 4.0 * d * all[4 * r] / all[4 * r + 1] * 1e-9);
    printf("  total      forward %.3f ms, %.2f effective GFLOP/s", 1e3 * max_fwd,
           flops / max_fwd * 1e-9);
    if (!o->forward_only)
      printf("; backward %.3f ms, %.2f effective GFLOP/s", 1e3 * max_bwd,
             2.5 * flops / max_bwd * 1e-9);
    printf("\n  imbalance  pairs max/mean %.3f, forward time max/mean %.3f\n",
           max_pairs / (pairs / rr->env.world), max_fwd / (sum_fwd / rr->env.world));
    printf("  comm       ring time / summed step compute, worst rank: forward %.3f", worst[0]);
    if (!o->forward_only) printf(", backward %.3f", worst[1]);
    printf(" (1.000 = transfers fully hidden)\n");
    printf("  memory     %-6s %16s %12s %10s %14s\n", "rank", "backend peak MiB", "bound MiB",
           "plan MiB", "peak RSS MiB");
    for (int r = 0; r <= rr->env.world; r++) { /* the ranks, then the largest of each */
      const double *x = r < rr->env.world ? &mem_all[4 * r] : mem_max;
      char name[16] = "max";
      if (r < rr->env.world) snprintf(name, sizeof name, "%d", r);
      printf("             %-6s %16.3f %12.3f %10.3f %14.1f%s\n", name, x[0] / 1048576,
             x[1] / 1048576, x[2] / 1048576, x[3] / 1048576,
             r == rr->env.world || x[0] <= x[1] ? "" : "  <-- over the bound");
    }
    if (rr->r.checked) {
      static const char *const names[5] = {"o", "lse", "dq", "dk", "dv"};
      printf("  check      against cpu-ref (fp64) on the same ring, %.3f s: %s\n", rr->r.t_check,
             rr->r.check_ok ? "PASS" : "FAIL");
      for (int t = 0; t < (o->forward_only ? 2 : 5); t++)
        printf("    %-4s max|err| %.3e  bound %.3e  (max|ref| %.3e)%s\n", names[t], rr->r.err[t],
               rr->r.bound[t], rr->r.ref_max[t],
               rr->r.err[t] <= rr->r.bound[t] ? "" : "  <-- FAIL");
    }
  }
  free(all);
  free(mem_all);
  return mem_rc;
}

int run_ring(const run_options_t *o, int rank, int world) {
  ring_run_t rr;
  memset(&rr, 0, sizeof rr);
  rr.r.cuda_variant = -1;
  rr.o = o;
  run_inputs_t full = {0}; /* only with input files: read whole, then permuted */
  mtrain_layout_kind_t kind = MTRAIN_LAYOUT_STRIPED;
  int rc = tool_failed(prog, "--layout", mtrain_layout_kind_parse(o->layout, &kind));
  if (!rc && o->q_path) rc = run_inputs_load_or_generate(o, &full);
  if (!rc) rc = ring_env_open(prog, o, rank, world, &rr.env);
  if (rc == 2) { /* the schedule options cannot form the ring: every rank alike */
    run_inputs_free(&full);
    ring_env_close(&rr.env);
    return 1;
  }
  const int64_t N = o->q_path ? full.tokens : o->seq_len;
  if (!rc)
    rc = tool_failed(prog, "layout",
                     mtrain_layout_create(kind, N, o->granularity, world, NULL, &rr.layout));
  if (!rc) rc = ring_inputs_make(prog, &rr.env, o, rr.layout, o->q_path ? &full : NULL, &rr.in);
  run_inputs_free(&full);
  if (!rc) MPI_Allreduce(&rr.in.seconds, &rr.t_inputs, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (!rc) rc = make_pattern(&rr);
  if (!rc) {
    const double t0 = tool_now();
    rc = tool_failed(
        prog, "building the plan",
        mtrain_plan_create_ring(rr.env.ctx, NULL, (const mtrain_layout_t *const[]){rr.layout},
                                rr.env.ranks_per_node,
                                (const mtrain_pattern_t *const[]){rr.pattern}, &rr.plan));
    rr.r.t_plan = tool_now() - t0;
  }
  run_inputs_t *work = ring_inputs_work(&rr.env, &rr.in);
  if (!rc) rc = run_outputs_alloc(&rr.in.host, rr.in.host.q.dtype, &rr.out);
  if (!rc && rr.env.device)
    rc = run_outputs_alloc_device(&rr.in.host, rr.in.host.q.dtype, &rr.dev_out);
  if (!rc) {
    MPI_Barrier(MPI_COMM_WORLD);
    rc = run_attention(prog, rr.env.ctx, rr.plan, work, rr.env.device ? &rr.dev_out : &rr.out, o,
                       &rr.r);
  }
  if (!rc && rr.env.device) {
    rr.r.cuda_variant = mtrain_cuda_last_variant(rr.env.ctx);
    rc = run_outputs_download(&rr.dev_out, &rr.out, o->forward_only ? 2 : 5);
  }
  /* a rank that failed ends the job: the others may be waiting for it inside
   * a collective call, and a training job must not go on without it */
  if (rc) MPI_Abort(MPI_COMM_WORLD, 1);
  if (o->check) rc = check(&rr);
  if (rc) MPI_Abort(MPI_COMM_WORLD, 1);
  if (o->out_dir) rc = write_outputs(&rr);
  if (!rc) rc = report(&rr);
  run_outputs_free_device(&rr.dev_out);
  run_outputs_free(&rr.out);
  ring_inputs_free(&rr.in);
  mtrain_plan_destroy(rr.plan);
  mtrain_pattern_destroy(rr.pattern);
  mtrain_layout_destroy(rr.layout);
  ring_env_close(&rr.env);
  if (rc) return 1;
  return rr.r.checked && !rr.r.check_ok ? 3 : 0;
}
