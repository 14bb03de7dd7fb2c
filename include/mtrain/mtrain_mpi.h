/* mtrain_mpi.h: the MPI communicator (built when MTRAIN_WITH_MPI is on).
 * mtrain joins the caller's process group: it duplicates the given MPI_Comm
 * (so its traffic never mixes with the caller's), sets MPI_ERRORS_RETURN on
 * the duplicate and maps MPI errors to mtrain statuses. Every wait, including
 * the collectives (run as non-blocking MPI operations), gives up after the
 * timeout with MTRAIN_ERR_TIMEOUT naming the peer or the operation, so a rank
 * that died or stopped answering never hangs the others forever. A timed-out
 * operation is abandoned (never cancelled: a collective cannot be) and the
 * communicator is broken from then on: its later calls fail at once with
 * MTRAIN_ERR_COMM naming the first error; create a new one. MPI must be
 * initialised by the caller (MPI_THREAD_FUNNELED or better is enough: mtrain
 * calls MPI from the thread that calls mtrain). */
#ifndef MTRAIN_MPI_H
#define MTRAIN_MPI_H

#include <mpi.h>

#include "mtrain_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Default timeout of waits, seconds (MTRAIN_COMM_TIMEOUT overrides it when
 *  the caller passes 0). */
#define MTRAIN_MPI_DEFAULT_TIMEOUT 300.0

/** Creates a communicator over `comm` (duplicated). timeout_seconds <= 0:
 *  MTRAIN_COMM_TIMEOUT from the environment, else the default. Collective
 *  over `comm`. */
MTRAIN_API mtrain_status_t mtrain_comm_create_mpi(MPI_Comm comm, double timeout_seconds,
                                                  mtrain_comm_t **out);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_MPI_H */
