/* ring_common.h: what mtrain-run's ring form (run_ring.c) and mtrain-bench
 * share on W ranks under mpiexec: the communicators and the context, the
 * tools' own collectives (timed by the communicator's timeout) and how a
 * failure ends the job, each rank's inputs in a layout (generated directly
 * in the rank's slots, or read and permuted), the distributed estimate, and
 * the timings combined over the ranks. In ring_common.c. */
#ifndef MTRAIN_RING_COMMON_H
#define MTRAIN_RING_COMMON_H

#include <mpi.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_layout.h"
#include "run_common.h"

/** One rank's ring: communicators and the context of --backend. */
typedef struct ring_env {
  const char *prog; /**< the tool, for messages */
  int rank, world;
  int device;                  /**< --backend cuda: device tensors, the NCCL communicator */
  int ranks_per_node;          /**< 0: flat ring */
  int ranks_per_node_detected; /**< 1: ranks_per_node detected (MPI_COMM_TYPE_SHARED), 0: the
                                    option */
  mtrain_comm_t *comm;         /**< MPI, for host contexts */
  mtrain_comm_t *dev_comm;     /**< NCCL with --backend cuda; else NULL */
  mtrain_context_t *ctx;       /**< the --backend context over the ring */
} ring_env_t;

/** Creates the communicators (MPI with --timeout, NCCL too with --backend
 *  cuda: one GPU per rank, picked by the rank's index on its host) and the
 *  context, with --cuda-variant applied. --schedule hier takes
 *  --ranks-per-node, or detects the nodes (the ranks that share memory); it
 *  needs at least two nodes of equal size in blocks of consecutive ranks.
 *  Collective over MPI_COMM_WORLD. Returns 0; 2 when the schedule options
 *  cannot form the ring (decided alike on every rank, message on rank 0);
 *  or 1 with a message starting with `prog`. Either way the env is to be
 *  closed; after 1, ring_agree tells the other ranks. */
int ring_env_open(const char *prog, const run_options_t *o, int rank, int world, ring_env_t *env);
/** "flat ring", or "2 nodes x 4 ranks (detected: ...)" / "(--ranks-per-node)"
 *  for reports (a static buffer). */
const char *ring_env_topology(const ring_env_t *env);
/** Destroys what ring_env_open made (also after a failed open). */
void ring_env_close(ring_env_t *env);
/** One rank's inputs in a layout. */
typedef struct ring_inputs {
  int64_t N;      /**< sequence length */
  int64_t T;      /**< this rank's token slots */
  int64_t *index; /**< [T] the global token of each slot (>= N: padding) */
  run_inputs_t host;
  run_inputs_t dev; /**< the device copy (--backend cuda), else empty */
  double seconds;   /**< generating (or reading and permuting) them */
} ring_inputs_t;

/** This rank's inputs of the layout: with `full` NULL generated directly in
 *  its slots (only its own tokens, run_inputs_generate_rows), else permuted
 *  from the whole tensors `full` (read from files); with --backend cuda also
 *  copied to the device. Returns 0 or 1 (message printed). Not collective. */
int ring_inputs_make(const char *prog, const ring_env_t *env, const run_options_t *o,
                     const mtrain_layout_t *layout, const run_inputs_t *full, ring_inputs_t *in);
/** The tensors the context computes on: the device copy with cuda. */
run_inputs_t *ring_inputs_work(const ring_env_t *env, ring_inputs_t *in);
void ring_inputs_free(ring_inputs_t *in);

/** The pattern estimated online, distributed, from the budgets the options
 *  ask for (run_make_budgets) and this rank's q and k; the time of the
 *  estimate (after a timed barrier) into *seconds. Collective. */
int ring_estimate(const char *prog, const ring_env_t *env, const run_options_t *o,
                  const mtrain_layout_t *layout, ring_inputs_t *in, mtrain_pattern_t **pattern,
                  double *seconds);

/* ---- the tools' own collectives, and failures ----------------------------
 * Every collective call of the tools goes through env->comm (the mpi
 * communicator), so that every wait is bounded by its timeout (--timeout,
 * else MTRAIN_COMM_TIMEOUT, else 300 s). A collective that fails (a rank died
 * or stopped answering: MTRAIN_ERR_TIMEOUT naming the operation; or an MPI
 * error) leaves the communicator unusable: the rank prints the error with
 * `what` (the phase) and ends the job with MPI_Abort, so that mpiexec ends
 * every rank, the stalled one included. Ranks above 0 first wait rank x 0.5 s
 * (at most 4 s), so that when several ranks time out in the same collective
 * the lowest one prints and its abort ends the others before they repeat
 * it. `what` names the phase in the message. */

/** In-place all-reduce (op MTRAIN_REDUCE_SUM or _MAX) of n doubles. */
void ring_allreduce(const ring_env_t *env, double *buf, int n, mtrain_reduce_op_t op,
                    const char *what);
/** `bytes` from every rank into recv (world x bytes, rank order). */
void ring_allgather(const ring_env_t *env, const void *send, void *recv, size_t bytes,
                    const char *what);
/** Rank 0 receives `bytes` from every rank into recv (world x bytes, rank
 *  order; recv is unused elsewhere); the others send theirs. */
void ring_gather(const ring_env_t *env, const void *send, void *recv, size_t bytes,
                 const char *what);
void ring_barrier(const ring_env_t *env, const char *what);
/** The check after a phase of local work (reading, writing, allocating):
 *  every rank gives its status rc (0: success; a failure has printed its
 *  reason). Returns 0 when every rank succeeded, else 1 on every rank, and
 *  rank 0 names the lowest rank that failed. The ranks then stop together
 *  (no MPI_Abort). With no communicator (it could not be created) a failure
 *  ends the job. */
int ring_agree(const ring_env_t *env, int rc, const char *what);
/** After a collective call of the library failed on this rank (its reason
 *  printed): the others may be waiting inside that call, so the job ends
 *  now (MPI_Abort). Nothing when rc is 0. */
void ring_abort_if(const ring_env_t *env, int rc);

/** The figures of a timed run combined over the ranks (every rank gets
 *  them). */
typedef struct ring_totals {
  double fwd, bwd;             /**< the slowest rank's median times */
  double fwd_sum, bwd_sum;     /**< summed over the ranks */
  double pairs, max_pairs;     /**< computed pairs: summed, and the largest rank's */
  double fwd_ratio, bwd_ratio; /**< ring time / summed step compute, worst rank */
} ring_totals_t;

/** Combines this rank's run (its plan and run_attention's result) with the
 *  others'. Collective (timed, as above). */
void ring_totals_compute(const ring_env_t *env, const mtrain_plan_t *plan, const run_result_t *r,
                         int forward_only, ring_totals_t *t);

#endif /* MTRAIN_RING_COMMON_H */
