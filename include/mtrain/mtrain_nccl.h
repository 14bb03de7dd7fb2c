/* mtrain_nccl.h: the NCCL communicator (built when MTRAIN_WITH_NCCL is on),
 * for the ring on GPUs. Point-to-point buffers are device memory of the
 * communicator's device; the small collectives (all-reduce, all-gather,
 * barrier) take host buffers like every communicator and stage them through
 * the device.
 *
 * Traffic classes run on separate NCCL communicators, each with its own
 * stream, so K/V transfers of the inner ring, of the outer ring, the dK/dV
 * partials and the collectives never queue behind one another: tags 11
 * (inner K/V), 12 (outer K/V), 13 (inner dK/dV partial), >= 100 (partials to
 * their owner), anything else on the first class. A receive is launched
 * together with the next send of the same tag (one NCCL group, so a ring
 * exchange cannot deadlock) or, if the caller waits for it first, alone.
 * Transfers are ordered after the work queued so far on the data stream
 * (mtrain_comm_nccl_set_data_stream; the context does it for the "cuda"
 * backend), so a buffer is sent only once computed and overwritten only once
 * read. Waits block the host until the transfer is complete.
 *
 * Communicators run in NCCL's non-blocking mode: every wait and every
 * collective gives up after the timeout with MTRAIN_ERR_TIMEOUT naming the
 * peer or the operation, aborting the NCCL communicators (ncclCommAbort), so
 * a dead or stalled peer never hangs the others. After such an error the
 * communicator can only be destroyed. Not thread-safe: one thread drives one
 * communicator (the thread-per-GPU mode uses one communicator per thread). */
#ifndef MTRAIN_NCCL_H
#define MTRAIN_NCCL_H

#include <stddef.h>

#include "mtrain_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Default timeout of waits, seconds (MTRAIN_COMM_TIMEOUT overrides it when
 *  the caller passes 0). */
#define MTRAIN_NCCL_DEFAULT_TIMEOUT 300.0
/** Bytes of an NCCL unique id (ncclUniqueId). */
#define MTRAIN_NCCL_ID_BYTES 128

/** Writes a new NCCL unique id (MTRAIN_NCCL_ID_BYTES bytes) to `id`: rank 0
 *  calls it and hands the bytes to the other ranks (threads of one process,
 *  or any out-of-band channel). */
MTRAIN_API mtrain_status_t mtrain_nccl_unique_id(void *id);

/** Creates rank `rank` of an `nranks`-rank communicator on CUDA device
 *  `device` from a unique id. Collective: every rank must call it (from its
 *  own thread or process). timeout_seconds <= 0: MTRAIN_COMM_TIMEOUT or the
 *  default. Sets the calling thread's current device. */
MTRAIN_API mtrain_status_t mtrain_comm_create_nccl(const void *id, int nranks, int rank, int device,
                                                   double timeout_seconds, mtrain_comm_t **out);

/** Creates a communicator from an existing ncclComm_t (passed as void *):
 *  mtrain splits its own communicators off it (ncclCommSplit, collective over
 *  `nccl_comm`) and never uses or destroys the caller's. */
MTRAIN_API mtrain_status_t mtrain_comm_create_nccl_from(void *nccl_comm, int device,
                                                        double timeout_seconds,
                                                        mtrain_comm_t **out);

/** Orders the communicator's transfers after the work queued on `stream` (a
 *  cudaStream_t; NULL: the legacy default stream). */
MTRAIN_API mtrain_status_t mtrain_comm_nccl_set_data_stream(mtrain_comm_t *comm, void *stream);

#ifdef MTRAIN_HAVE_MPI
#include <mpi.h>
/** One process per GPU under mpiexec: rank 0 of `comm` makes the unique id
 *  and broadcasts it over MPI, then every rank creates its NCCL rank on
 *  `device` (< 0: the rank's index among the ranks of its host, modulo the
 *  host's device count). Collective over `comm`. */
MTRAIN_API mtrain_status_t mtrain_comm_create_nccl_mpi(MPI_Comm comm, int device,
                                                       double timeout_seconds, mtrain_comm_t **out);
#endif

/** 1 when comm is an NCCL communicator. */
MTRAIN_API int mtrain_comm_is_nccl(const mtrain_comm_t *comm);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_NCCL_H */
