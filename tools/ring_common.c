/* ring_common.c: the pieces of a W-rank run that mtrain-run's ring form and
 * mtrain-bench share (see ring_common.h): set-up of the communicators and
 * the context, the tools' timed collectives and the end of a failed job,
 * each rank's inputs in a layout, the distributed estimate and the timings
 * combined over the ranks. Reports and tables are the callers'. */
#include "ring_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_mpi.h"
#ifdef MTRAIN_HAVE_NCCL
#include "mtrain/mtrain_nccl.h"
#endif
#include "run_fault.h"
#include "tool_common.h"

/* ---- the tools' collectives ---------------------------------------------- */

/* A collective of the tool failed (message: the last error): the
 * communicator is unusable and a rank may be stalled, so the job ends. */
static void collective_failed(const ring_env_t *env, const char *what, mtrain_status_t st) {
  char message[1024];
  snprintf(message, sizeof message, "%s", mtrain_last_error());
  if (env->rank > 0) { /* let a lower rank that saw the same failure speak first */
    const int steps = env->rank < 8 ? env->rank : 8;
    const struct timespec wait = {steps / 2, (long)(steps % 2) * 500000000L};
    nanosleep(&wait, NULL);
  }
  fprintf(stderr, "%s: rank %d: %s: %s: %s; ending the job on every rank\n", env->prog, env->rank,
          what, mtrain_status_name(st), message);
  fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

void ring_allreduce(const ring_env_t *env, double *buf, int n, mtrain_reduce_op_t op,
                    const char *what) {
  const mtrain_status_t st = env->comm->ops->allreduce(env->comm->state, buf, n, MTRAIN_F64, op);
  if (st) collective_failed(env, what, st);
}

void ring_allgather(const ring_env_t *env, const void *send, void *recv, size_t bytes,
                    const char *what) {
  const mtrain_status_t st = env->comm->ops->allgather(env->comm->state, send, recv, bytes);
  if (st) collective_failed(env, what, st);
}

void ring_barrier(const ring_env_t *env, const char *what) {
  const mtrain_status_t st = env->comm->ops->barrier(env->comm->state);
  if (st) collective_failed(env, what, st);
}

/* One message of the gather, in pieces of at most 1 GiB (the mpi
 * communicator's messages are below 2 GiB). */
static mtrain_status_t transfer(const ring_env_t *env, void *buf, size_t bytes, int peer,
                                int send) {
  const mtrain_comm_ops_t *ops = env->comm->ops;
  const size_t piece = (size_t)1 << 30;
  for (size_t at = 0; at < bytes || (bytes == 0 && at == 0); at += piece) {
    const size_t n = bytes - at < piece ? bytes - at : piece;
    mtrain_comm_request_t *req = NULL;
    mtrain_status_t st =
        send ? ops->isend(env->comm->state, (char *)buf + at, n, peer, MTRAIN_TAG_USER, &req)
             : ops->irecv(env->comm->state, (char *)buf + at, n, peer, MTRAIN_TAG_USER, &req);
    if (!st) st = ops->wait(env->comm->state, req);
    if (st) return st;
    if (bytes == 0) break;
  }
  return MTRAIN_SUCCESS;
}

void ring_gather(const ring_env_t *env, const void *send, void *recv, size_t bytes,
                 const char *what) {
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (env->rank != 0) {
    st = transfer(env, (void *)send, bytes, 0, 1);
  } else {
    if (bytes) memcpy(recv, send, bytes);
    for (int r = 1; r < env->world && !st; r++)
      st = transfer(env, (char *)recv + (size_t)r * bytes, bytes, r, 0);
  }
  if (st) collective_failed(env, what, st);
}

int ring_agree(const ring_env_t *env, int rc, const char *what) {
  if (!env->comm) { /* no communicator: the others cannot be told */
    if (rc) MPI_Abort(MPI_COMM_WORLD, 1);
    return 0;
  }
  /* whether a rank failed, and the lowest that did (as world - rank) */
  double mine[2] = {rc ? 1.0 : 0.0, rc ? (double)(env->world - env->rank) : 0.0};
  ring_allreduce(env, mine, 2, MTRAIN_REDUCE_MAX, what);
  if (mine[0] == 0.0) return 0;
  if (env->rank == 0)
    fprintf(stderr, "%s: stopping every rank: rank %d failed while %s (its error above)\n",
            env->prog, env->world - (int)mine[1], what);
  return 1;
}

void ring_abort_if(const ring_env_t *env, int rc) {
  (void)env;
  if (!rc) return;
  fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

/* ---- set-up --------------------------------------------------------------- */

/* The hierarchical ring's ranks per node into env (0: the flat ring): the
 * option, or detected as the ranks that share memory with this one
 * (MPI_COMM_TYPE_SHARED). A hierarchy needs at least two nodes of the same
 * size, each a block of consecutive ranks: otherwise 1 with a message on
 * rank 0. Collective; every rank decides alike. */
static int hier_ranks_per_node(const char *prog, const run_options_t *o, int rank, int world,
                               ring_env_t *env) {
  /* (the timed collectives below need env->comm: created first) */
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
  /* MPI_Comm_split_type blocks and has no timed form: every rank first
   * meets the others in a timed barrier, so that the split starts only once
   * all are there */
  ring_barrier(env, "detecting the nodes (before MPI_Comm_split_type)");
  MPI_Comm shared;
  MPI_Group group, world_group;
  int first = rank, zero = 0;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shared);
  MPI_Comm_size(shared, &n);
  /* the node's first rank: rank 0 of `shared` (ordered by world rank), found
   * without communicating */
  MPI_Comm_group(shared, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Group_translate_ranks(group, 1, &zero, world_group, &first);
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  MPI_Comm_free(&shared);
  /* the largest and smallest node, and whether every node is the block of
   * ranks [k n, (k + 1) n) (max of its negation: the minimum) */
  double all[3] = {n, -n, -(double)(first % n == 0 && rank - first < n)};
  ring_allreduce(env, all, 3, MTRAIN_REDUCE_MAX, "detecting the nodes");
  all[2] = -all[2];
  const char *how = "detected with MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)";
  if (all[0] != -all[1] || all[2] == 0.0) {
    if (rank == 0)
      fprintf(stderr,
              "%s: --schedule hier without --ranks-per-node: the nodes %s hold %d to %d ranks%s; "
              "the hierarchical ring needs nodes of equal size, each a block of consecutive "
              "ranks (give --ranks-per-node n, or place the ranks by slot)\n",
              prog, how, (int)-all[1], (int)all[0],
              all[2] != 0.0 ? "" : ", not in consecutive blocks");
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
  env->prog = prog;
  env->rank = rank;
  env->world = world;
  env->device = strcmp(o->backend, "cuda") == 0;
  /* first the timed communicator: every later wait of the tool is bounded */
  if (tool_failed(prog, "MPI communicator",
                  mtrain_comm_create_mpi(MPI_COMM_WORLD, o->timeout, &env->comm))) {
    env->comm = NULL;
    return 1;
  }
  if (hier_ranks_per_node(prog, o, rank, world, env)) return 2;
  if (env->device) {
#ifdef MTRAIN_HAVE_NCCL
    /* one GPU per rank: the rank's index on its host picks the device */
    if (tool_failed(prog, "NCCL communicator",
                    mtrain_comm_create_nccl_mpi(MPI_COMM_WORLD, -1, o->timeout, &env->dev_comm)))
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
  run_fault_point(prog, "inputs", env->rank);
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
  eo.top_p_forced = o->top_p_forced;
  run_inputs_t *work = ring_inputs_work(env, in);
  ring_barrier(env, "before the estimate");
  const double t0 = tool_now();
  int rc = tool_failed(
      prog, "estimating the pattern",
      mtrain_pattern_estimate_ring(env->ctx, layout, &work->q, &work->k, budgets, &eo, pattern));
  *seconds = tool_now() - t0;
  free(budgets);
  return rc;
}

void ring_totals_compute(const ring_env_t *env, const mtrain_plan_t *plan, const run_result_t *r,
                         int forward_only, ring_totals_t *t) {
  const double pairs = (double)mtrain_plan_computed_pairs(plan);
  const mtrain_call_stats_t *fs = &r->fwd_stats, *bs = &r->bwd_stats;
  double all_sums[3] = {pairs, r->t_fwd, r->t_bwd};
  double all_max[5] = {pairs, r->t_fwd, r->t_bwd, fs->ring_seconds / fs->compute_seconds,
                       forward_only ? 0.0 : bs->ring_seconds / bs->compute_seconds};
  ring_allreduce(env, all_sums, 3, MTRAIN_REDUCE_SUM, "the report: summing the ranks' figures");
  ring_allreduce(env, all_max, 5, MTRAIN_REDUCE_MAX, "the report: the slowest rank's figures");
  t->pairs = all_sums[0];
  t->fwd_sum = all_sums[1];
  t->bwd_sum = all_sums[2];
  t->max_pairs = all_max[0];
  t->fwd = all_max[1];
  t->bwd = all_max[2];
  t->fwd_ratio = all_max[3];
  t->bwd_ratio = all_max[4];
}
