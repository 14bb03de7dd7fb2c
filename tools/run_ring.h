/* run_ring.h: mtrain-run on several ranks under mpiexec (run_ring.c). */
#ifndef MTRAIN_RUN_RING_H
#define MTRAIN_RUN_RING_H

#include <mpi.h>

#include "run_options.h"

/** The whole run on `world` ranks of MPI_COMM_WORLD; collective. Returns
 *  the exit status: 0 success, 1 error, 3 check failed. */
int run_ring(const run_options_t *o, int rank, int world);

#endif /* MTRAIN_RUN_RING_H */
