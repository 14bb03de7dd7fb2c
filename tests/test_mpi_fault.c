/* test_mpi_fault.c: a rank that dies or stops answering in the middle of a
 * ring must not hang the others. Run under mpiexec by test_mpi_fault.sh:
 *   kill        rank 1 is killed (SIGKILL) just before the forward;
 *   stall       rank 1 sleeps instead of joining the forward; the others
 *               must end with MTRAIN_ERR_TIMEOUT naming a peer within the
 *               timeout;
 *   kill-bwd    every rank completes the forward, then rank 1 is killed
 *               just before the backward;
 *   stall-bwd   the same, rank 1 sleeps instead of joining the backward;
 *   wrong-size  rank 1 plans a problem of another length (its chunks would
 *               be of another size): every rank fails at the collective
 *               check of mtrain_plan_create_ring, naming rank 1, before any
 *               transfer;
 *   kill-mid-fwd  rank 1 is killed inside the forward, when it posts its
 *               second K/V send (after the first ring step's exchange);
 *   kill-mid-bwd  every rank completes the forward; rank 1 is killed inside
 *               the backward, at its second send there.
 * The mid-ring kills wrap rank 1's MPI communicator in a communicator table
 * of this file that counts the sends (mtrain_comm.h: the table is public for
 * communicators brought by the caller).
 * A rank whose call fails prints the error and aborts the job, as a training
 * job would. */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_layout.h"
#include "mtrain/mtrain_mpi.h"

/* ---- a communicator that delegates to another and kills the process at
 * its kill_at-th send ---- */
static mtrain_comm_t *g_inner;
static long g_sends, g_kill_at = -1;

static int k_rank(void *s) { return (void)s, g_inner->ops->rank(g_inner->state); }
static int k_size(void *s) { return (void)s, g_inner->ops->size(g_inner->state); }
static mtrain_status_t k_isend(void *s, const void *buf, size_t bytes, int peer, int tag,
                               mtrain_comm_request_t **req) {
  (void)s;
  if (++g_sends == g_kill_at) {
    fprintf(stderr, "rank %d: killed at its send %ld (to rank %d)\n", k_rank(NULL), g_sends, peer);
    fflush(stderr);
    raise(SIGKILL);
  }
  return g_inner->ops->isend(g_inner->state, buf, bytes, peer, tag, req);
}
static mtrain_status_t k_irecv(void *s, void *buf, size_t bytes, int peer, int tag,
                               mtrain_comm_request_t **req) {
  return (void)s, g_inner->ops->irecv(g_inner->state, buf, bytes, peer, tag, req);
}
static mtrain_status_t k_wait(void *s, mtrain_comm_request_t *req) {
  return (void)s, g_inner->ops->wait(g_inner->state, req);
}
static mtrain_status_t k_allreduce(void *s, void *buf, int64_t count, mtrain_dtype_t dtype,
                                   mtrain_reduce_op_t op) {
  return (void)s, g_inner->ops->allreduce(g_inner->state, buf, count, dtype, op);
}
static mtrain_status_t k_allgather(void *s, const void *send, void *recv, size_t bytes) {
  return (void)s, g_inner->ops->allgather(g_inner->state, send, recv, bytes);
}
static mtrain_status_t k_barrier(void *s) { return (void)s, g_inner->ops->barrier(g_inner->state); }
static mtrain_status_t k_split(void *s, int color, int key, mtrain_comm_t **out) {
  return (void)s, g_inner->ops->split(g_inner->state, color, key, out);
}
static void k_abort(void *s, int code) { (void)s, g_inner->ops->abort(g_inner->state, code); }
static void k_destroy(void *s) { (void)s; }

/* A rank whose call failed ends the job, as a training job would
 * (MPI_Abort); in the mid-ring modes it only ends itself, so that the other
 * survivor lives to report its own error (mpiexec --enable-recovery). */
static void end_failed(int alone) {
  fflush(stdout);
  fflush(stderr);
  if (alone) _exit(3);
  MPI_Abort(MPI_COMM_WORLD, 3);
}

static const mtrain_comm_ops_t killer_ops = {.api_version = MTRAIN_API_VERSION,
                                             .name = "mpi",
                                             .memory_space = MTRAIN_MEMORY_HOST,
                                             .rank = k_rank,
                                             .size = k_size,
                                             .isend = k_isend,
                                             .irecv = k_irecv,
                                             .wait = k_wait,
                                             .allreduce = k_allreduce,
                                             .allgather = k_allgather,
                                             .barrier = k_barrier,
                                             .split = k_split,
                                             .abort = k_abort,
                                             .destroy = k_destroy};
static mtrain_comm_t killer_comm = {&killer_ops, NULL};

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const char *mode = argc > 1 ? argv[1] : "kill";
  enum { N = 2000, HQ = 4, HKV = 2, D = 32, G = 32 };
  mtrain_comm_t *comm = NULL;
  mtrain_context_t *ctx = NULL;
  mtrain_layout_t *layout = NULL;
  mtrain_pattern_t *pattern = NULL;
  mtrain_plan_t *plan = NULL;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  cfg.num_threads = 1;
  const int mid_fwd = strcmp(mode, "kill-mid-fwd") == 0,
            mid_bwd = strcmp(mode, "kill-mid-bwd") == 0;
  const int backward_fault =
      strcmp(mode, "kill-bwd") == 0 || strcmp(mode, "stall-bwd") == 0 || mid_bwd;
  /* wrong-size: rank 1's sequence is one ring's worth of blocks shorter */
  const int64_t n = strcmp(mode, "wrong-size") == 0 && rank == 1 ? N - G * world : N;
  mtrain_status_t st = mtrain_comm_create_mpi(MPI_COMM_WORLD, 3.0, &comm);
  g_inner = comm;
  if (rank == 1 && mid_fwd) g_kill_at = 2;
  /* rank 1 talks through the counting communicator in the mid-ring modes */
  if (!st)
    st = mtrain_context_create(&cfg, rank == 1 && (mid_fwd || mid_bwd) ? &killer_comm : comm, &ctx);
  if (!st) st = mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, n, G, world, NULL, &layout);
  if (!st) st = mtrain_pattern_create_dense(n, HQ, G, &pattern);
  if (!st)
    st = mtrain_plan_create_ring(ctx, NULL, (const mtrain_layout_t *const[]){layout}, 0,
                                 (const mtrain_pattern_t *const[]){pattern}, &plan);
  const int64_t T = st ? 0 : mtrain_layout_local_tokens(layout, rank);
  float *q = calloc((size_t)(T * HQ * D) + 1, sizeof(float));
  float *k = calloc((size_t)(T * HKV * D) + 1, sizeof(float));
  float *o = calloc((size_t)(T * HQ * D) + 1, sizeof(float));
  float *lse = calloc((size_t)(T * HQ) + 1, sizeof(float));
  float *dq = calloc((size_t)(T * HQ * D) + 1, sizeof(float));
  float *dk = calloc((size_t)(T * HKV * D) + 1, sizeof(float));
  float *dv = calloc((size_t)(T * HKV * D) + 1, sizeof(float));
  for (int64_t i = 0; i < T * HQ * D; i++) q[i] = (float)((i * 7919) % 13) / 13.0f;
  for (int64_t i = 0; i < T * HKV * D; i++) k[i] = (float)((i * 104729) % 11) / 11.0f;
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 1 && !backward_fault && !mid_fwd && strcmp(mode, "wrong-size") != 0) {
    if (strcmp(mode, "kill") == 0) raise(SIGKILL);
    struct timespec nap = {30, 0}; /* stall: never join the ring */
    nanosleep(&nap, NULL);
  }
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, T, HQ, D);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, T, HKV, D);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F32, T, HQ, D);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, T, HQ);
  if (!st) st = mtrain_attention_forward(ctx, plan, &tq, &tk, &tk, &to, &tl);
  if (st) {
    fprintf(stderr, "rank %d: forward failed: %s: %s\n", rank, mtrain_status_name(st),
            mtrain_last_error());
    end_failed(mid_fwd || mid_bwd);
  }
  if (backward_fault) {
    printf("rank %d: forward completed\n", rank);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 1 && mid_bwd) {
      g_kill_at = g_sends + 2;
    } else if (rank == 1) {
      if (strcmp(mode, "kill-bwd") == 0) raise(SIGKILL);
      struct timespec nap = {30, 0}; /* stall: never join the backward */
      nanosleep(&nap, NULL);
    }
    mtrain_tensor_t tdq = mtrain_tensor_3d(dq, MTRAIN_F32, T, HQ, D);
    mtrain_tensor_t tdk = mtrain_tensor_3d(dk, MTRAIN_F32, T, HKV, D);
    mtrain_tensor_t tdv = mtrain_tensor_3d(dv, MTRAIN_F32, T, HKV, D);
    st = mtrain_attention_backward(ctx, plan, &tq, &tk, &tk, &to, &tl, &to, &tdq, &tdk, &tdv);
    if (st) {
      fprintf(stderr, "rank %d: backward failed: %s: %s\n", rank, mtrain_status_name(st),
              mtrain_last_error());
      end_failed(mid_fwd || mid_bwd);
    }
  }
  if (mid_fwd || mid_bwd) {
    /* a survivor whose call had every transfer it needed (its sends to the
     * dead rank were buffered by MPI) succeeds, truthfully; the next
     * training step needs rank 1 and must fail */
    printf("rank %d: its %s completed (every transfer it needed arrived); next step\n", rank,
           mid_bwd ? "backward" : "forward");
    st = mtrain_attention_forward(ctx, plan, &tq, &tk, &tk, &to, &tl);
    if (st) {
      fprintf(stderr, "rank %d: forward failed: %s: %s (the next step)\n", rank,
              mtrain_status_name(st), mtrain_last_error());
      end_failed(mid_fwd || mid_bwd);
    }
  }
  printf("rank %d: %s returned success although rank 1 %s\n", rank,
         backward_fault ? "backward" : "forward",
         strcmp(mode, "wrong-size") == 0 ? "ran another length"
         : strncmp(mode, "kill", 4) == 0 ? "was killed"
                                         : "never joined");
  MPI_Finalize();
  return 0;
}
