/* example_mpi.c: a program on mtrain's MPI communicator (mtrain_mpi.h),
 * built against an installed mtrain by the install test (with pkg-config
 * mtrain-mpi, and with find_package(mtrain) when mtrain_WITH_MPI): each
 * rank wraps MPI_COMM_WORLD in an mtrain communicator, checks that its rank
 * and size are MPI's, creates a "cpu" context over it and prints one line.
 * Exit 0 on success. Runs alone (one rank) or under mpiexec. */
#include <mpi.h>
#include <stdio.h>

#include <mtrain/mtrain.h>
#include <mtrain/mtrain_mpi.h>

int main(int argc, char **argv) {
  int provided = 0, rank = 0, world = 1, rc = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  mtrain_comm_t *comm = NULL;
  mtrain_context_t *ctx = NULL;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  mtrain_status_t st = mtrain_comm_create_mpi(MPI_COMM_WORLD, 0, &comm);
  if (st == MTRAIN_SUCCESS) st = mtrain_context_create(&cfg, comm, &ctx);
  if (st != MTRAIN_SUCCESS) {
    fprintf(stderr, "rank %d: %s: %s\n", rank, mtrain_status_name(st), mtrain_last_error());
    rc = 1;
  } else if (mtrain_comm_rank(comm) != rank || mtrain_comm_size(comm) != world) {
    fprintf(stderr, "rank %d: the communicator says rank %d of %d, MPI says %d of %d\n", rank,
            mtrain_comm_rank(comm), mtrain_comm_size(comm), rank, world);
    rc = 1;
  } else {
    printf("rank %d of %d: a cpu context over the MPI communicator\n", rank, world);
  }
  mtrain_context_destroy(ctx);
  mtrain_comm_destroy(comm);
  MPI_Finalize();
  return rc;
}
