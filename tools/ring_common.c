/* ring_common.c: the pieces of a W-rank run that mtrain-run's ring form and
 * mtrain-bench share (see ring_common.h): set-up of the communicators and
 * the context, each rank's inputs in a layout, the distributed estimate and
 * the timings combined over the ranks. Reports and tables are the callers'. */
#include "ring_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_mpi.h"
#ifdef MTRAIN_HAVE_NCCL
#include "mtrain/mtrain_nccl.h"
#endif
#include "tool_common.h"

/* The hierarchical ring's ranks per node into env (0: the flat ring): the
 * option, or detected as the ranks that share memory with this one
 * (MPI_COMM_TYPE_SHARED). A hierarchy needs at least two nodes of the same
 * size, each a block of consecutive ranks: otherwise 1 with a message on
 * rank 0. Collective; every rank decides alike. */
static int hier_ranks_per_node(const char *prog, const run_options_t *o, int rank, int world,
                               ring_env_t *env) {
  env->ranks_per_node = 0;
  env->ranks_per_node_detected = 0;
  if (!o->hierarchical) return 0;
  int n = o->ranks_per_node;
  if (n) {
    const char *problem = world % n != 0 ? "does not divide" : n == world ? "equals" : NULL;
    if (problem && rank == 0)
      fprintf(stderr,
              "%s: --schedule hier: --ranks-per-node %d %s the %d ranks: a hierarchical ring "
              "needs at least 2 nodes of equal size (give a divisor of %d below %d, or use "
              "--schedule flat)\n",
              prog, n, problem, world, world, world);
    if (problem) return 1;
    env->ranks_per_node = n;
    return 0;
  }
  MPI_Comm shared;
  int first = rank;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shared);
  MPI_Comm_size(shared, &n);
  MPI_Allreduce(&rank, &first, 1, MPI_INT, MPI_MIN, shared);
  MPI_Comm_free(&shared);
  /* the largest and smallest node, and whether every node is the block of
   * ranks [k n, (k + 1) n) */
  int mine[3] = {n, -n, first % n == 0 && rank - first < n}, all[3];
  MPI_Allreduce(mine, all, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(&mine[2], &all[2], 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  const char *how = "detected with MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)";
  if (all[0] != -all[1] || !all[2]) {
    if (rank == 0)
      fprintf(stderr,
              "%s: --schedule hier without --ranks-per-node: the nodes %s hold %d to %d ranks%s; "
              "the hierarchical ring needs nodes of equal size, each a block of consecutive "
              "ranks (give --ranks-per-node n, or place the ranks by slot)\n",
              prog, how, -all[1], all[0], all[2] ? "" : ", not in consecutive blocks");
    return 1;
  }
  if (n == world) {
    if (rank == 0)
      fprintf(stderr,
              "%s: --schedule hier without --ranks-per-node: all %d ranks share one node (%s); "
              "a hierarchical ring needs at least 2 nodes: give --ranks-per-node n (a divisor of "
              "%d below %d) to treat groups of n ranks as nodes, or use --schedule flat\n",
              prog, world, how, world, world);
    return 1;
  }
  env->ranks_per_node = n;
  env->ranks_per_node_detected = 1;
  return 0;
}

int ring_env_open(const char *prog, const run_options_t *o, int rank, int world, ring_env_t *env) {
  memset(env, 0, sizeof *env);
  env->rank = rank;
  env->world = world;
  env->device = strcmp(o->backend, "cuda") == 0;
  if (hier_ranks_per_node(prog, o, rank, world, env)) return 2;
  if (tool_failed(prog, "MPI communicator", mtrain_comm_create_mpi(MPI_COMM_WORLD, 0, &env->comm)))
    return 1;
  if (env->device) {
#ifdef MTRAIN_HAVE_NCCL
    /* one GPU per rank: the rank's index on its host picks the device */
    if (tool_failed(prog, "NCCL communicator",
                    mtrain_comm_create_nccl_mpi(MPI_COMM_WORLD, -1, 0, &env->dev_comm)))
      return 1;
#else
    if (rank == 0)
      fprintf(stderr, "%s: --backend cuda on several ranks needs a build with NCCL\n", prog);
    return 1;
#endif
  }
  if (run_make_context(prog, o, o->backend, env->device ? env->dev_comm : env->comm, &env->ctx))
    return 1;
  if (env->device && o->cuda_variant != RUN_CUDA_VARIANT_UNSET)
    return tool_failed(prog, "--cuda-variant",
                       mtrain_cuda_set_variant(env->ctx, (mtrain_cuda_variant_t)o->cuda_variant));
  return 0;
}

const char *ring_env_topology(const ring_env_t *env) {
  static char text[160];
  if (!env->ranks_per_node) return "flat ring";
  snprintf(text, sizeof text, "%d nodes x %d ranks (%s)", env->world / env->ranks_per_node,
           env->ranks_per_node,
           env->ranks_per_node_detected ? "detected: the ranks that share memory"
                                        : "--ranks-per-node");
  return text;
}

void ring_env_close(ring_env_t *env) {
  mtrain_context_destroy(env->ctx);
  mtrain_comm_destroy(env->dev_comm);
  mtrain_comm_destroy(env->comm);
  memset(env, 0, sizeof *env);
}

/* The rank's slots of a whole [N, heads, dim] tensor (padding slots zero),
 * by the library's permutation on a single-rank host context. */
static int slice(const char *prog, mtrain_context_t *ctx, const mtrain_layout_t *layout, int rank,
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

static int slice_inputs(const char *prog, const run_options_t *o, const mtrain_layout_t *layout,
                        int rank, const run_inputs_t *full, run_inputs_t *local) {
  mtrain_context_t *host = NULL;
  *local = *full;
  local->tokens = mtrain_layout_local_tokens(layout, rank);
  local->q.data = local->k.data = local->v.data = local->dout.data = NULL;
  int rc = run_make_context(prog, o, "cpu", NULL, &host) ||
           slice(prog, host, layout, rank, &full->q, &local->q) ||
           slice(prog, host, layout, rank, &full->k, &local->k) ||
           slice(prog, host, layout, rank, &full->v, &local->v) ||
           slice(prog, host, layout, rank, &full->dout, &local->dout);
  mtrain_context_destroy(host);
  return rc;
}

int ring_inputs_make(const char *prog, const ring_env_t *env, const run_options_t *o,
                     const mtrain_layout_t *layout, const run_inputs_t *full, ring_inputs_t *in) {
  memset(in, 0, sizeof *in);
  const double t0 = tool_now();
  in->N = mtrain_layout_seq_len(layout);
  in->T = mtrain_layout_local_tokens(layout, env->rank);
  in->index = malloc(sizeof(int64_t) * (size_t)(in->T + 1));
  if (!in->index) {
    fprintf(stderr, "%s: out of memory for the layout index\n", prog);
    return 1;
  }
  int rc =
      tool_failed(prog, "layout", mtrain_layout_rank_token_index(layout, env->rank, in->index));
  if (!rc)
    rc = full ? slice_inputs(prog, o, layout, env->rank, full, &in->host)
              : run_inputs_generate_rows(o, in->index, in->T, &in->host);
  in->seconds = tool_now() - t0;
  if (!rc && env->device) rc = run_inputs_to_device(&in->host, &in->dev);
  return rc;
}

run_inputs_t *ring_inputs_work(const ring_env_t *env, ring_inputs_t *in) {
  return env->device ? &in->dev : &in->host;
}

void ring_inputs_free(ring_inputs_t *in) {
  run_inputs_free_device(&in->dev);
  run_inputs_free(&in->host);
  free(in->index);
  memset(in, 0, sizeof *in);
}

int ring_estimate(const char *prog, const ring_env_t *env, const run_options_t *o,
                  const mtrain_layout_t *layout, ring_inputs_t *in, mtrain_pattern_t **pattern,
                  double *seconds) {
  mtrain_head_budget_t *budgets = NULL;
  if (run_make_budgets(prog, o, in->host.heads, &budgets)) return 1;
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = o->last_q;
  run_inputs_t *work = ring_inputs_work(env, in);
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = tool_now();
  int rc = tool_failed(
      prog, "estimating the pattern",
      mtrain_pattern_estimate_ring(env->ctx, layout, &work->q, &work->k, budgets, &eo, pattern));
  *seconds = tool_now() - t0;
  free(budgets);
  return rc;
}

void ring_totals_compute(const mtrain_plan_t *plan, const run_result_t *r, int forward_only,
                         ring_totals_t *t) {
  const double pairs = (double)mtrain_plan_computed_pairs(plan);
  const mtrain_call_stats_t *fs = &r->fwd_stats, *bs = &r->bwd_stats;
  double sums[3] = {pairs, r->t_fwd, r->t_bwd}, all_sums[3];
  double maxes[5] = {pairs, r->t_fwd, r->t_bwd, fs->ring_seconds / fs->compute_seconds,
                     forward_only ? 0.0 : bs->ring_seconds / bs->compute_seconds};
  double all_max[5];
  MPI_Allreduce(sums, all_sums, 3, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(maxes, all_max, 5, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  t->pairs = all_sums[0];
  t->fwd_sum = all_sums[1];
  t->bwd_sum = all_sums[2];
  t->max_pairs = all_max[0];
  t->fwd = all_max[1];
  t->bwd = all_max[2];
  t->fwd_ratio = all_max[3];
  t->bwd_ratio = all_max[4];
}
