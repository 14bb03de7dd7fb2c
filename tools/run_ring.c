/* run_ring.c: mtrain-run on several ranks (under mpiexec): every rank
 * generates its own slots of the layout directly (or reads the whole input
 * files and keeps its slots), builds or estimates the pattern (the estimate
 * runs distributed), runs the ring forward and backward, optionally checks
 * against the distributed fp64 reference and gathers the outputs to rank 0;
 * rank 0 prints the per-rank and total report (sparsity, time per phase,
 * effective GFLOP/s, imbalance). Set-up shared with mtrain-bench:
 * ring_common.c. Every collective of the tool is timed (ring_common.h); a
 * phase of local work ends in ring_agree, so that a failure on one rank
 * stops every rank, and a failed collective call of the library ends the
 * job (ring_abort_if). */
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
#include "run_fault.h"
#include "run_files.h"
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
    if (rr->env.rank == 0) /* alike on every rank */
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
 * comparison of this rank's rows; errors, the inputs' norms and the bounds
 * combined over ranks. */
static int check(ring_run_t *rr) {
  const double t0 = tool_now();
  mtrain_context_t *ref = NULL;
  mtrain_plan_t *plan = NULL;
  run_inputs_t in64 = {0};
  run_outputs_t out64 = {0};
  /* the reference's context and plan, and its run, are collective */
  int rc = run_make_context(prog, rr->o, "cpu-ref", rr->env.comm, &ref);
  if (!rc)
    rc =
        tool_failed(prog, "reference plan",
                    mtrain_plan_create_ring(ref, NULL, (const mtrain_layout_t *const[]){rr->layout},
                                            rr->env.ranks_per_node,
                                            (const mtrain_pattern_t *const[]){rr->pattern}, &plan));
  ring_abort_if(&rr->env, rc);
  rc = run_inputs_widen(&rr->in.host, &in64);
  if (!rc) rc = run_outputs_alloc(&in64, MTRAIN_F64, &out64);
  if (!ring_agree(&rr->env, rc, "preparing the reference")) {
    run_options_t once = *rr->o;
    once.repeat = 1;
    run_result_t scratch = {0};
    ring_abort_if(&rr->env, run_attention(prog, ref, plan, &in64, &out64, &once, &scratch));
    const int n = rr->o->forward_only ? 2 : 5;
    /* per output: max|err| and max|ref| over this rank's rows, then the
     * floor's scales (run_inputs_norms) */
    double all[16] = {0};
    for (int t = 0; t < n; t++)
      compare_rows(run_outputs_get(&rr->out, t), run_outputs_get(&out64, t), rr->in.index, rr->in.N,
                   &all[2 * t], &all[2 * t + 1]);
    run_inputs_norms(&rr->in.host, &all[10]);
    ring_allreduce(&rr->env, all, 16, MTRAIN_REDUCE_MAX, "the check: combining the errors");
    for (int t = 0; t < n; t++) {
      rr->r.err[t] = all[2 * t];
      rr->r.ref_max[t] = all[2 * t + 1];
    }
    run_check_bounds(rr->env.ctx, rr->in.host.q.dtype, rr->in.host.head_dim, &all[10], n, &rr->r);
  } else {
    rc = 1;
  }
  run_outputs_free(&out64);
  run_inputs_free(&in64);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ref);
  rr->r.t_check = tool_now() - t0;
  return rc;
}

/* Rank 0 gathers every rank's rows of each output and writes them in
 * global order, with the pattern, all or nothing (run_files.h). Every rank
 * goes through every gather, also after a failed write on rank 0 (which
 * then only receives). Returns this rank's status (rank 0: 1 when a write
 * failed, message printed); ring_agree follows. */
static int write_outputs(ring_run_t *rr) {
  const run_options_t *o = rr->o;
  const char *names[RUN_FILES_MAX];
  run_files_names(o->forward_only, names);
  const int root = rr->env.rank == 0;
  const int64_t slots = rr->in.T * rr->env.world;
  run_files_t files;
  run_files_begin(&files, prog, o->out_dir);
  int64_t *all_index = root ? malloc(sizeof(int64_t) * (size_t)(slots + 1)) : NULL;
  if (root && !all_index) fprintf(stderr, "%s: out of memory gathering the outputs\n", prog);
  /* (rank 0 cannot receive without memory, and the others wait for it) */
  ring_abort_if(&rr->env, root && !all_index);
  ring_gather(&rr->env, rr->in.index, all_index, sizeof(int64_t) * (size_t)rr->in.T,
              "writing the outputs: gathering the layout's token index");
  int rc = 0;
  for (int t = 0; t < (o->forward_only ? 2 : 5); t++) {
    const mtrain_tensor_t *loc = run_outputs_get(&rr->out, t);
    const size_t row =
        (size_t)(mtrain_tensor_numel(loc) / rr->in.T) * mtrain_dtype_size(loc->dtype);
    char *all = root ? malloc(row * (size_t)(slots + 1)) : NULL;
    if (root && !all) fprintf(stderr, "%s: out of memory gathering %s\n", prog, names[t]);
    ring_abort_if(&rr->env, root && !all);
    char what[96];
    snprintf(what, sizeof what, "writing the outputs: gathering %s", names[t]);
    ring_gather(&rr->env, loc->data, all, row * (size_t)rr->in.T, what);
    if (root && !rc) {
      mtrain_tensor_t g = *loc;
      g.shape[0] = rr->in.N;
      g.data = malloc(row * (size_t)rr->in.N + 1);
      if (!g.data) {
        fprintf(stderr, "%s: out of memory writing %s\n", prog, names[t]);
        rc = 1;
      }
      for (int64_t i = 0; !rc && i < slots; i++)
        if (all_index[i] < rr->in.N)
          memcpy((char *)g.data + (size_t)all_index[i] * row, all + (size_t)i * row, row);
      if (!rc) rc = run_files_write_tensor(&files, names[t], &g);
      free(g.data);
    }
    free(all);
  }
  if (root && !rc) rc = run_files_write_pattern(&files, "pattern.json", rr->pattern);
  if (root && !rc) rc = run_files_commit(&files);
  if (root && rc) run_files_discard(&files);
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
  ring_gather(&rr->env, mine, all, 4 * sizeof(double), "the report: gathering the memory figures");
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
  run_fault_point(prog, "report", rr->env.rank);
  const char *backend = mtrain_context_backend_name(rr->env.ctx);
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
  ring_gather(&rr->env, mine, all, 4 * sizeof(double), "the report: gathering the per-rank times");
  /* the totals; communication hidden: ring time over the summed step compute */
  ring_totals_t tot;
  ring_totals_compute(&rr->env, rr->plan, &rr->r, o->forward_only, &tot);
  if (rr->env.rank != 0) return mem_rc;
  const int d = rr->in.host.head_dim;
  const double pairs = tot.pairs, max_pairs = tot.max_pairs, max_fwd = tot.fwd, max_bwd = tot.bwd;
  const double sum_fwd = tot.fwd_sum, worst[2] = {tot.fwd_ratio, tot.bwd_ratio};
  const double dense = (double)rr->in.host.heads * (double)rr->in.N * (rr->in.N + 1) / 2;
  const double flops = 4.0 * d * pairs;
  const char *sched = rr->env.ranks_per_node ? "hierarchical" : "flat";
  if (o->json) {
    json_t *j = json_object(), *ranks = json_array();
    json_object_set_new(j, "backend", json_string(backend));
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
        json_object_set_new(e, "max_abs_reference", json_real(rr->r.ref_max[t]));
        json_object_set_new(e, "floor", json_real(rr->r.floor[t]));
        json_object_set_new(c, names[t], e);
      }
      json_object_set_new(j, "check", c);
    }
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    if (text) puts(text);
    free(text);
    json_decref(j);
  } else {
    printf("mtrain-run: backend %s, dtype %s, %d ranks, layout %s, %s ring\n", backend,
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
      for (int t = 0; t < (o->forward_only ? 2 : 5); t++) run_check_print(names[t], &rr->r, t);
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
  /* decided alike on every rank: rank 0 says it */
  const mtrain_status_t layout_st = mtrain_layout_kind_parse(o->layout, &kind);
  if (layout_st) {
    if (rank == 0) tool_failed(prog, "--layout", layout_st);
    return 1;
  }
  int rc = ring_env_open(prog, o, rank, world, &rr.env);
  if (rc == 2 || ring_agree(&rr.env, rc, "creating the communicators and the context")) {
    ring_env_close(&rr.env);
    return 1;
  }
  /* --out before the work: a directory that cannot be written stops the run now */
  const char *names[RUN_FILES_MAX];
  const int n_names = run_files_names(o->forward_only, names);
  rc = o->out_dir && rank == 0 ? run_files_prepare(prog, o->out_dir, names, n_names) : 0;
  if (ring_agree(&rr.env, rc, "preparing the --out directory")) {
    rc = 1;
    goto done;
  }
  if (o->q_path) rc = run_inputs_load_or_generate(o, &full);
  const int64_t N = o->q_path ? full.tokens : o->seq_len;
  if (!rc)
    rc = tool_failed(prog, "layout",
                     mtrain_layout_create(kind, N, o->granularity, world, NULL, &rr.layout));
  if (!rc) rc = ring_inputs_make(prog, &rr.env, o, rr.layout, o->q_path ? &full : NULL, &rr.in);
  run_inputs_free(&full);
  if (ring_agree(&rr.env, rc, "making the inputs")) {
    rc = 1;
    goto done;
  }
  rr.t_inputs = rr.in.seconds;
  ring_allreduce(&rr.env, &rr.t_inputs, 1, MTRAIN_REDUCE_MAX,
                 "the inputs: the slowest rank's time");
  if (run_options_estimate(o)) {
    ring_abort_if(&rr.env, make_pattern(&rr)); /* the estimate is collective */
  } else if (ring_agree(&rr.env, make_pattern(&rr), "reading or making the pattern")) {
    rc = 1;
    goto done;
  }
  const double t0 = tool_now();
  ring_abort_if(&rr.env,
                tool_failed(prog, "building the plan",
                            mtrain_plan_create_ring(
                                rr.env.ctx, NULL, (const mtrain_layout_t *const[]){rr.layout},
                                rr.env.ranks_per_node,
                                (const mtrain_pattern_t *const[]){rr.pattern}, &rr.plan)));
  rr.r.t_plan = tool_now() - t0;
  run_inputs_t *work = ring_inputs_work(&rr.env, &rr.in);
  rc = run_outputs_alloc(&rr.in.host, rr.in.host.q.dtype, &rr.out);
  if (!rc && rr.env.device)
    rc = run_outputs_alloc_device(&rr.in.host, rr.in.host.q.dtype, &rr.dev_out);
  if (ring_agree(&rr.env, rc, "allocating the outputs")) {
    rc = 1;
    goto done;
  }
  ring_barrier(&rr.env, "before the timed run");
  /* a rank that failed inside the ring ends the job: the others may be
   * waiting for it inside a collective call, and a training job must not go
   * on without it */
  ring_abort_if(&rr.env, run_attention(prog, rr.env.ctx, rr.plan, work,
                                       rr.env.device ? &rr.dev_out : &rr.out, o, &rr.r));
  if (rr.env.device) {
    rr.r.cuda_variant = mtrain_cuda_last_variant(rr.env.ctx);
    rc = run_outputs_download(&rr.dev_out, &rr.out, o->forward_only ? 2 : 5);
    if (ring_agree(&rr.env, rc, "copying the outputs from the device")) {
      rc = 1;
      goto done;
    }
  }
  if (rank == 0) run_perturb_outputs(&rr.out, o->forward_only ? 2 : 5);
  if (o->check && check(&rr)) {
    rc = 1;
    goto done;
  }
  if (o->out_dir && ring_agree(&rr.env, write_outputs(&rr), "writing the outputs")) {
    rc = 1;
    goto done;
  }
  rc = report(&rr);
done:
  run_inputs_free(&full);
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
