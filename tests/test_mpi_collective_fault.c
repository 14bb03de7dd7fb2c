/* test_mpi_collective_fault.c: a rank that stops answering at a collective
 * must end that collective with MTRAIN_ERR_TIMEOUT on every rank that waits,
 * naming the operation, and leave the process able to report it (no abort
 * from inside MPI); the communicator is then broken, and its next call fails
 * at once with MTRAIN_ERR_COMM naming the first error. Run under mpiexec (3
 * ranks) by test_mpi_collective_fault.sh with one mode, the entry point at
 * which rank 1 stalls (sleeps past the others' timeout, never calls it):
 *   create     mtrain_comm_create_mpi (the duplication of the communicator)
 *   context    mtrain_context_create (the configuration check, an all-gather)
 *   plan       mtrain_plan_create_ring (the plans' agreement, an all-gather)
 *   estimate   mtrain_pattern_estimate_ring (its all-reduces)
 *   allreduce, allgather, barrier, split: the communicator's own operations
 * Before the fix, every mode but create and split ended the job inside
 * MPI_Cancel ("MPI_ERR_REQUEST"), and create and split hung until the peer
 * came. Each waiting rank prints one line per call, which the script reads:
 *   rank R: ENTRY failed after S s: STATUS: MESSAGE
 *   rank R: next call failed after S s: STATUS: MESSAGE
 * and, at the end, "rank R: done". */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_layout.h"
#include "mtrain/mtrain_mpi.h"

enum { N = 512, HQ = 4, HKV = 2, D = 16, G = 32 };
static const double kTimeout = 3.0; /* seconds, the communicator's */
static const int kStall = 6;        /* seconds rank 1 sleeps instead of calling */

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* This rank's plan of the ring (one sequence, the flat ring). */
static mtrain_status_t plan_ring(mtrain_context_t *ctx, const mtrain_layout_t *layout,
                                 const mtrain_pattern_t *pattern, mtrain_plan_t **plan) {
  return mtrain_plan_create_ring(ctx, NULL, (const mtrain_layout_t *const[]){layout}, 0,
                                 (const mtrain_pattern_t *const[]){pattern}, plan);
}

/* Prints the outcome of the stalled call; then, when the communicator
 * exists, the outcome of the next call on it. Returns 1 when both failed as
 * they must. */
static int report(int rank, const char *entry, mtrain_status_t st, double t0, mtrain_comm_t *comm) {
  if (st == MTRAIN_SUCCESS) {
    printf("rank %d: %s returned success although rank 1 never called it\n", rank, entry);
    return 0;
  }
  printf("rank %d: %s failed after %.1f s: %s: %s\n", rank, entry, now() - t0,
         mtrain_status_name(st), mtrain_last_error());
  if (!comm) return st == MTRAIN_ERR_TIMEOUT;
  const double t1 = now();
  mtrain_status_t next = comm->ops->barrier(comm->state);
  printf("rank %d: next call failed after %.3f s: %s: %s\n", rank, now() - t1,
         mtrain_status_name(next), next ? mtrain_last_error() : "(none)");
  return st == MTRAIN_ERR_TIMEOUT && next == MTRAIN_ERR_COMM;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const char *mode = argc > 1 ? argv[1] : "barrier";
  const int stalls = rank == 1;
  int ok = 1;
  mtrain_comm_t *comm = NULL;
  mtrain_context_t *ctx = NULL;
  mtrain_layout_t *layout = NULL;
  mtrain_pattern_t *pattern = NULL, *estimated = NULL;
  mtrain_plan_t *plan = NULL;
  float *q = NULL, *k = NULL;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  cfg.num_threads = 1;
  MPI_Barrier(MPI_COMM_WORLD);
  /* rank 1 stalls at the entry point of the mode: it sleeps, then skips the
   * call and everything after it, up to the final barrier */
  const char *stall_at = mode;
  mtrain_status_t st = MTRAIN_SUCCESS;
  double t0 = now();
  if (stalls && !strcmp(stall_at, "create")) goto stall;
  st = mtrain_comm_create_mpi(MPI_COMM_WORLD, kTimeout, &comm);
  if (!strcmp(mode, "create")) {
    ok = report(rank, "mtrain_comm_create_mpi", st, t0, NULL);
    goto done;
  }
  if (st) {
    printf("rank %d: setup failed: %s\n", rank, mtrain_last_error());
    ok = 0;
    goto done;
  }
  if (stalls && !strcmp(stall_at, "context")) goto stall;
  t0 = now();
  st = mtrain_context_create(&cfg, comm, &ctx);
  if (!strcmp(mode, "context")) {
    ok = report(rank, "mtrain_context_create", st, t0, comm);
    goto done;
  }
  if (!st) st = mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, N, G, world, NULL, &layout);
  if (!st) st = mtrain_pattern_create_dense(N, HQ, G, &pattern);
  if (st) {
    printf("rank %d: setup failed: %s\n", rank, mtrain_last_error());
    ok = 0;
    goto done;
  }
  if (stalls && !strcmp(stall_at, "plan")) goto stall;
  if (!strcmp(mode, "plan")) {
    t0 = now();
    st = plan_ring(ctx, layout, pattern, &plan);
    ok = report(rank, "mtrain_plan_create_ring", st, t0, comm);
    goto done;
  }
  if (!strcmp(mode, "estimate")) {
    const int64_t T = mtrain_layout_local_tokens(layout, rank);
    q = calloc((size_t)(T * HQ * D) + 1, sizeof(float));
    k = calloc((size_t)(T * HKV * D) + 1, sizeof(float));
    for (int64_t i = 0; i < T * HQ * D; i++) q[i] = (float)((i * 7919) % 13) / 13.0f;
    for (int64_t i = 0; i < T * HKV * D; i++) k[i] = (float)((i * 104729) % 11) / 11.0f;
    mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, T, HQ, D);
    mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, T, HKV, D);
    mtrain_head_budget_t budgets[HQ];
    for (int h = 0; h < HQ; h++)
      budgets[h] = (mtrain_head_budget_t){MTRAIN_BUDGET_TOP_K, 16, 16, 0, 0, 0, 0};
    mtrain_estimate_options_t opt = MTRAIN_ESTIMATE_INIT;
    opt.last_q = 64;
    if (stalls) goto stall;
    t0 = now();
    st = mtrain_pattern_estimate_ring(ctx, layout, &tq, &tk, budgets, &opt, &estimated);
    ok = report(rank, "mtrain_pattern_estimate_ring", st, t0, comm);
    goto done;
  }
  /* the communicator's own collectives */
  if (stalls) goto stall;
  t0 = now();
  if (!strcmp(mode, "allreduce")) {
    double x[3] = {1.0, 2.0, 3.0};
    st = comm->ops->allreduce(comm->state, x, 3, MTRAIN_F64, MTRAIN_REDUCE_SUM);
  } else if (!strcmp(mode, "allgather")) {
    int32_t mine = rank, all[16];
    st = comm->ops->allgather(comm->state, &mine, all, sizeof mine);
  } else if (!strcmp(mode, "barrier")) {
    st = comm->ops->barrier(comm->state);
  } else if (!strcmp(mode, "split")) {
    mtrain_comm_t *sub = NULL;
    st = mtrain_comm_split(comm, 0, rank, &sub);
    mtrain_comm_destroy(sub);
  } else {
    printf("rank %d: unknown mode %s\n", rank, mode);
    ok = 0;
    goto done;
  }
  ok = report(rank, mode, st, t0, comm);
  goto done;
stall : {
  struct timespec nap = {kStall, 0};
  nanosleep(&nap, NULL);
}
done:
  /* the process lives on: it releases what it made and meets the others */
  mtrain_pattern_destroy(estimated);
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(pattern);
  mtrain_layout_destroy(layout);
  mtrain_context_destroy(ctx);
  mtrain_comm_destroy(comm);
  free(q);
  free(k);
  fflush(stdout);
  MPI_Barrier(MPI_COMM_WORLD);
  printf("rank %d: done%s\n", rank, ok ? "" : " (FAILED)");
  fflush(stdout);
  MPI_Finalize();
  return ok ? 0 : 1;
}
