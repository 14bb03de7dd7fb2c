/* run_ring.c: mtrain-run on several ranks (under mpiexec): every rank
 * generates or reads the whole inputs, keeps its slots of the layout, builds
 * or estimates the pattern (the estimate runs distributed), runs the ring
 * forward and backward, optionally checks against the distributed fp64
 * reference and gathers the outputs to rank 0; rank 0 prints the per-rank
 * and total report (sparsity, time per phase, effective GFLOP/s,
 * imbalance). */
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
#include "mtrain/mtrain_mpi.h"
#ifdef MTRAIN_HAVE_NCCL
#include "mtrain/mtrain_nccl.h"
#endif
#include "run_common.h"
#include "tool_common.h"

static const char *prog = "mtrain-run";

/* The rank's slots of a whole [N, heads, dim] tensor (padding slots zero),
 * by the library's permutation. */
static int slice(mtrain_context_t *ctx, const mtrain_layout_t *layout, int rank,
                 const mtrain_tensor_t *full, mtrain_tensor_t *local) {
  const int64_t T = mtrain_layout_local_tokens(layout, rank);
  const size_t row = (size_t)(full->shape[1] * full->shape[2]) * mtrain_dtype_size(full->dtype);
  *local =
      mtrain_tensor_3d(malloc((size_t)T * row + 1), full->dtype, T, full->shape[1], full->shape[2]);
  if (!local->data) {
    fprintf(stderr, "%s: out of memory for %lld local tokens\n", prog, (long long)T);
    return 1;
  }
  return tool_failed(prog, "permuting the inputs",
                     mtrain_layout_permute(ctx, layout, rank, full, local));
}

static int slice_inputs(mtrain_context_t *ctx, const mtrain_layout_t *layout, int rank,
                        const run_inputs_t *in, run_inputs_t *local) {
  *local = *in;
  local->tokens = mtrain_layout_local_tokens(layout, rank);
  local->q.data = local->k.data = local->v.data = local->dout.data = NULL;
  return slice(ctx, layout, rank, &in->q, &local->q) ||
         slice(ctx, layout, rank, &in->k, &local->k) ||
         slice(ctx, layout, rank, &in->v, &local->v) ||
         slice(ctx, layout, rank, &in->dout, &local->dout);
}

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
  int rank, world, ranks_per_node;
  mtrain_comm_t *comm;     /* MPI: host contexts (slicing, the reference) */
  mtrain_comm_t *dev_comm; /* NCCL, for the "cuda" backend; else NULL */
  int device;              /* --backend cuda: device tensors */
  mtrain_layout_t *layout;
  int64_t T, *index;
  run_inputs_t full, local, dev_local;
  run_outputs_t out, dev_out;
  mtrain_pattern_t *pattern;
  mtrain_context_t *ctx, *host_ctx;
  mtrain_plan_t *plan;
  run_result_t r;
} ring_run_t;

static int make_context(ring_run_t *rr, const char *backend, mtrain_comm_t *comm,
                        mtrain_context_t **ctx) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = rr->o->granularity;
  cfg.num_threads = rr->o->threads;
  cfg.check_inputs = 1;
  return tool_failed(prog, "creating the context", mtrain_context_create(&cfg, comm, ctx));
}

static int make_pattern(ring_run_t *rr) {
  const run_options_t *o = rr->o;
  if (run_options_estimate(o)) {
    mtrain_head_budget_t *budgets = NULL;
    if (run_make_budgets(prog, o, rr->full.heads, &budgets)) return 1;
    mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
    eo.last_q = o->last_q;
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = tool_now();
    int rc = tool_failed(prog, "estimating the pattern",
                         mtrain_pattern_estimate_ring(rr->ctx, rr->layout,
                                                      rr->device ? &rr->dev_local.q : &rr->local.q,
                                                      rr->device ? &rr->dev_local.k : &rr->local.k,
                                                      budgets, &eo, &rr->pattern));
    rr->r.t_estimate = tool_now() - t0;
    free(budgets);
    return rc;
  }
  if (!o->pattern_path)
    return tool_failed(
        prog, "dense pattern",
        mtrain_pattern_create_dense(rr->full.tokens, rr->full.heads, o->granularity, &rr->pattern));
  if (tool_failed(prog, o->pattern_path, mtrain_pattern_read_json(o->pattern_path, &rr->pattern)))
    return 1;
  if (mtrain_pattern_seq_len(rr->pattern) != rr->full.tokens ||
      mtrain_pattern_num_heads(rr->pattern) != rr->full.heads ||
      mtrain_pattern_granularity(rr->pattern) != o->granularity) {
    fprintf(stderr,
            "%s: %s: the pattern (N=%lld, %d heads, G=%d) does not match the inputs "
            "(N=%lld, %d heads, G=%d)\n",
            prog, o->pattern_path, (long long)mtrain_pattern_seq_len(rr->pattern),
            mtrain_pattern_num_heads(rr->pattern), mtrain_pattern_granularity(rr->pattern),
            (long long)rr->full.tokens, rr->full.heads, o->granularity);
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
  int rc = make_context(rr, "cpu-ref", rr->comm, &ref);
  if (!rc)
    rc = tool_failed(
        prog, "reference plan",
        mtrain_plan_create_ring(ref, rr->layout, rr->ranks_per_node, rr->pattern, &plan));
  if (!rc) rc = run_inputs_widen(&rr->local, &in64);
  if (!rc) rc = run_outputs_alloc(&in64, MTRAIN_F64, &out64);
  run_options_t once = *rr->o;
  once.repeat = 1;
  run_result_t scratch = {0};
  if (!rc) rc = run_attention(ref, plan, &in64, &out64, &once, &scratch);
  if (!rc) {
    const mtrain_dtype_t dt = rr->local.q.dtype;
    const double rel = dt == MTRAIN_BF16 ? 4 * 0x1p-8 : dt == MTRAIN_F16 ? 4 * 0x1p-11 : 1e-4;
    const int n = rr->o->forward_only ? 2 : 5;
    double mine[10] = {0}, all[10];
    for (int t = 0; t < n; t++)
      compare_rows(run_outputs_get(&rr->out, t), run_outputs_get(&out64, t), rr->index,
                   rr->full.tokens, &mine[2 * t], &mine[2 * t + 1]);
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
  if (rr->rank == 0) mkdir(o->out_dir, 0755);
  int64_t *all_index = rr->rank == 0 ? malloc(sizeof(int64_t) * (size_t)(rr->T * rr->world)) : NULL;
  MPI_Gather(rr->index, (int)rr->T, MPI_INT64_T, all_index, (int)rr->T, MPI_INT64_T, 0,
             MPI_COMM_WORLD);
  for (int t = 0; t < (o->forward_only ? 2 : 5); t++) {
    const mtrain_tensor_t *loc = run_outputs_get(&rr->out, t);
    const size_t row = (size_t)(mtrain_tensor_numel(loc) / rr->T) * mtrain_dtype_size(loc->dtype);
    char *all = rr->rank == 0 ? malloc(row * (size_t)(rr->T * rr->world)) : NULL;
    MPI_Gather(loc->data, (int)(row * (size_t)rr->T), MPI_BYTE, all, (int)(row * (size_t)rr->T),
               MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rr->rank == 0 && !rc) {
      mtrain_tensor_t g = *loc;
      g.shape[0] = rr->full.tokens;
      g.data = malloc(row * (size_t)rr->full.tokens);
      for (int64_t i = 0; i < rr->T * rr->world; i++)
        if (all_index[i] < rr->full.tokens)
          memcpy((char *)g.data + (size_t)all_index[i] * row, all + (size_t)i * row, row);
      char path[4096];
      snprintf(path, sizeof path, "%s/%s.npy", o->out_dir, names[t]);
      rc = tool_failed(prog, path, run_write_f32(path, &g));
      free(g.data);
    }
    free(all);
  }
  if (rr->rank == 0 && !rc) {
    char path[4096];
    snprintf(path, sizeof path, "%s/pattern.json", o->out_dir);
    rc = tool_failed(prog, path, mtrain_pattern_write_json(path, rr->pattern));
  }
  free(all_index);
  return rc;
}

/* Per-rank figures gathered on rank 0, then the report. */
static void report(ring_run_t *rr) {
  const run_options_t *o = rr->o;
  double mine[4] = {(double)mtrain_plan_computed_pairs(rr->plan), rr->r.t_fwd, rr->r.t_bwd,
                    rr->r.t_estimate};
  double *all = rr->rank == 0 ? malloc(sizeof(double) * 4 * (size_t)rr->world) : NULL;
  MPI_Gather(mine, 4, MPI_DOUBLE, all, 4, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  /* communication hidden: ring time over the summed step compute, per rank */
  const mtrain_call_stats_t *fs = &rr->r.fwd_stats, *bs = &rr->r.bwd_stats;
  double ratios[4] = {fs->ring_seconds / fs->compute_seconds,
                      o->forward_only ? 0.0 : bs->ring_seconds / bs->compute_seconds,
                      fs->wait_seconds, o->forward_only ? 0.0 : bs->wait_seconds};
  double worst[4];
  MPI_Reduce(ratios, worst, 4, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  if (rr->rank != 0) return;
  const int d = rr->full.head_dim;
  double pairs = 0, max_pairs = 0, max_fwd = 0, max_bwd = 0, sum_fwd = 0, sum_bwd = 0;
  for (int r = 0; r < rr->world; r++) {
    pairs += all[4 * r];
    max_pairs = fmax(max_pairs, all[4 * r]);
    max_fwd = fmax(max_fwd, all[4 * r + 1]);
    max_bwd = fmax(max_bwd, all[4 * r + 2]);
    sum_fwd += all[4 * r + 1];
    sum_bwd += all[4 * r + 2];
  }
  const double dense = (double)rr->full.heads * (double)rr->full.tokens * (rr->full.tokens + 1) / 2;
  const double flops = 4.0 * d * pairs;
  const char *sched = rr->ranks_per_node ? "hierarchical" : "flat";
  if (o->json) {
    json_t *j = json_object(), *ranks = json_array();
    json_object_set_new(j, "backend", json_string(o->backend));
    json_object_set_new(j, "dtype", json_string(mtrain_dtype_name(rr->full.q.dtype)));
    json_object_set_new(j, "world", json_integer(rr->world));
    json_object_set_new(j, "layout", json_string(mtrain_layout_variant(rr->layout)));
    json_object_set_new(j, "schedule", json_string(sched));
    json_object_set_new(j, "ranks_per_node", json_integer(rr->ranks_per_node));
    json_object_set_new(j, "seq_len", json_integer(rr->full.tokens));
    json_object_set_new(j, "heads", json_integer(rr->full.heads));
    json_object_set_new(j, "kv_heads", json_integer(rr->full.kv_heads));
    json_object_set_new(j, "head_dim", json_integer(d));
    json_object_set_new(j, "pattern", json_string(run_pattern_source(o)));
    json_object_set_new(j, "sparsity", json_real(1.0 - pairs / dense));
    json_object_set_new(j, "estimate_seconds", json_real(rr->r.t_estimate));
    json_object_set_new(j, "forward_seconds", json_real(max_fwd));
    json_object_set_new(j, "forward_gflops", json_real(flops / max_fwd * 1e-9));
    json_object_set_new(j, "pair_imbalance", json_real(max_pairs / (pairs / rr->world)));
    json_object_set_new(j, "forward_ring_over_compute", json_real(worst[0]));
    if (!o->forward_only) json_object_set_new(j, "backward_ring_over_compute", json_real(worst[1]));
    json_object_set_new(j, "forward_time_imbalance", json_real(max_fwd / (sum_fwd / rr->world)));
    if (!o->forward_only) {
      json_object_set_new(j, "backward_seconds", json_real(max_bwd));
      json_object_set_new(j, "backward_gflops", json_real(2.5 * flops / max_bwd * 1e-9));
    }
    for (int r = 0; r < rr->world; r++) {
      json_t *e = json_object();
      json_object_set_new(e, "computed_pairs", json_integer((json_int_t)all[4 * r]));
      json_object_set_new(e, "forward_seconds", json_real(all[4 * r + 1]));
      json_object_set_new(e, "backward_seconds", json_real(all[4 * r + 2]));
      json_array_append_new(ranks, e);
    }
    json_object_set_new(j, "ranks", ranks);
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
    printf("mtrain-run: backend %s, dtype %s, %d ranks, layout %s, %s ring%s\n", o->backend,
           mtrain_dtype_name(rr->full.q.dtype), rr->world, mtrain_layout_variant(rr->layout), sched,
           rr->ranks_per_node ? "" : "");
    if (rr->ranks_per_node)
      printf("  topology   %d nodes x %d ranks\n", rr->world / rr->ranks_per_node,
             rr->ranks_per_node);
    printf("  shape      N=%lld Hq=%d Hkv=%d d=%d G=%d, %lld token slots per rank\n",
           (long long)rr->full.tokens, rr->full.heads, rr->full.kv_heads, d, o->granularity,
           (long long)rr->T);
    printf("  pattern    %s: sparsity %.2f%%\n", run_pattern_source(o),
           100.0 * (1 - pairs / dense));
    if (run_options_estimate(o))
      printf("  estimate   %.3f ms (distributed, last %d queries)\n", 1e3 * rr->r.t_estimate,
             o->last_q);
    printf("  %-6s %14s %12s %12s %12s\n", "rank", "pairs", "forward ms", "backward ms",
           "fwd GFLOP/s");
    for (int r = 0; r < rr->world; r++)
      printf("  %-6d %14.0f %12.3f %12.3f %12.2f\n", r, all[4 * r], 1e3 * all[4 * r + 1],
             1e3 * all[4 * r + 2], 4.0 * d * all[4 * r] / all[4 * r + 1] * 1e-9);
    printf("  total      forward %.3f ms, %.2f effective GFLOP/s", 1e3 * max_fwd,
           flops / max_fwd * 1e-9);
    if (!o->forward_only)
      printf("; backward %.3f ms, %.2f effective GFLOP/s", 1e3 * max_bwd,
             2.5 * flops / max_bwd * 1e-9);
    printf("\n  imbalance  pairs max/mean %.3f, forward time max/mean %.3f\n",
           max_pairs / (pairs / rr->world), max_fwd / (sum_fwd / rr->world));
    printf("  comm       ring time / summed step compute, worst rank: forward %.3f", worst[0]);
    if (!o->forward_only) printf(", backward %.3f", worst[1]);
    printf(" (1.000 = transfers fully hidden)\n");
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
}

/* Ranks per node: the option, or the ranks sharing memory with this one. */
static int ranks_per_node(const run_options_t *o, int world) {
  if (!o->hierarchical) return 0;
  int n = o->ranks_per_node;
  if (n == 0) {
    MPI_Comm shared;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &shared);
    MPI_Comm_size(shared, &n);
    MPI_Comm_free(&shared);
  }
  return n == world ? 0 : n;
}

int run_ring(const run_options_t *o, int rank, int world) {
  ring_run_t rr;
  memset(&rr, 0, sizeof rr);
  rr.r.cuda_variant = -1;
  rr.o = o;
  rr.rank = rank;
  rr.world = world;
  rr.ranks_per_node = ranks_per_node(o, world);
  int rc = 0;
  if (o->hierarchical && o->ranks_per_node && world % o->ranks_per_node != 0) {
    if (rank == 0)
      fprintf(stderr, "%s: --ranks-per-node %d does not divide the %d ranks\n", prog,
              o->ranks_per_node, world);
    rc = 1;
  }
  mtrain_layout_kind_t kind = MTRAIN_LAYOUT_STRIPED;
  if (!rc) rc = tool_failed(prog, "--layout", mtrain_layout_kind_parse(o->layout, &kind));
  if (!rc) rc = run_inputs_load_or_generate(o, &rr.full);
  if (!rc)
    rc = tool_failed(prog, "MPI communicator", mtrain_comm_create_mpi(MPI_COMM_WORLD, 0, &rr.comm));
  rr.device = strcmp(o->backend, "cuda") == 0;
  if (!rc && rr.device) {
#ifdef MTRAIN_HAVE_NCCL
    /* one GPU per rank: the rank's index on its host picks the device */
    rc = tool_failed(prog, "NCCL communicator",
                     mtrain_comm_create_nccl_mpi(MPI_COMM_WORLD, -1, 0, &rr.dev_comm));
#else
    if (rank == 0)
      fprintf(stderr, "%s: --backend cuda on several ranks needs a build with NCCL\n", prog);
    rc = 1;
#endif
  }
  if (!rc)
    rc = tool_failed(
        prog, "layout",
        mtrain_layout_create(kind, rr.full.tokens, o->granularity, world, NULL, &rr.layout));
  if (!rc) {
    rr.T = mtrain_layout_local_tokens(rr.layout, rank);
    rr.index = malloc(sizeof(int64_t) * (size_t)rr.T);
    rc = tool_failed(prog, "layout", mtrain_layout_rank_token_index(rr.layout, rank, rr.index));
  }
  if (!rc) rc = make_context(&rr, o->backend, rr.device ? rr.dev_comm : rr.comm, &rr.ctx);
  if (!rc && rr.device && o->cuda_variant != RUN_CUDA_VARIANT_UNSET)
    rc = tool_failed(prog, "--cuda-variant",
                     mtrain_cuda_set_variant(rr.ctx, (mtrain_cuda_variant_t)o->cuda_variant));
  /* the inputs are sliced on the host (a cpu context for the cuda backend) */
  if (!rc && rr.device) rc = make_context(&rr, "cpu", rr.comm, &rr.host_ctx);
  if (!rc)
    rc = slice_inputs(rr.device ? rr.host_ctx : rr.ctx, rr.layout, rank, &rr.full, &rr.local);
  if (!rc && rr.device) rc = run_inputs_to_device(&rr.local, &rr.dev_local);
  if (!rc) rc = make_pattern(&rr);
  if (!rc) {
    const double t0 = tool_now();
    rc = tool_failed(
        prog, "building the plan",
        mtrain_plan_create_ring(rr.ctx, rr.layout, rr.ranks_per_node, rr.pattern, &rr.plan));
    rr.r.t_plan = tool_now() - t0;
  }
  if (!rc) rc = run_outputs_alloc(&rr.local, rr.local.q.dtype, &rr.out);
  if (!rc && rr.device) rc = run_outputs_alloc_device(&rr.local, rr.local.q.dtype, &rr.dev_out);
  if (!rc) {
    MPI_Barrier(MPI_COMM_WORLD);
    rc = rr.device ? run_attention(rr.ctx, rr.plan, &rr.dev_local, &rr.dev_out, o, &rr.r)
                   : run_attention(rr.ctx, rr.plan, &rr.local, &rr.out, o, &rr.r);
  }
  if (!rc && rr.device) {
    rr.r.cuda_variant = mtrain_cuda_last_variant(rr.ctx);
    rc = run_outputs_download(&rr.dev_out, &rr.out, o->forward_only ? 2 : 5);
  }
  /* a rank that failed ends the job: the others may be waiting for it inside
   * a collective call, and a training job must not go on without it */
  if (rc) MPI_Abort(MPI_COMM_WORLD, 1);
  if (o->check) rc = check(&rr);
  if (rc) MPI_Abort(MPI_COMM_WORLD, 1);
  if (o->out_dir) rc = write_outputs(&rr);
  if (!rc) report(&rr);
  run_outputs_free_device(&rr.dev_out);
  run_inputs_free_device(&rr.dev_local);
  run_outputs_free(&rr.out);
  run_inputs_free(&rr.local);
  run_inputs_free(&rr.full);
  mtrain_plan_destroy(rr.plan);
  mtrain_context_destroy(rr.ctx);
  mtrain_context_destroy(rr.host_ctx);
  mtrain_pattern_destroy(rr.pattern);
  mtrain_layout_destroy(rr.layout);
  mtrain_comm_destroy(rr.dev_comm);
  mtrain_comm_destroy(rr.comm);
  free(rr.index);
  if (rc) return 1;
  return rr.r.checked && !rr.r.check_ok ? 3 : 0;
}
