/* bench_mpi_block_select.c: times the distributed block selection (SPEC.md
 * section 9) under mpiexec and reports each rank's peak memory, for the
 * measurements of docs/PATTERNS.md. Each rank fills only its own token slots
 * (a hash of the global position, so the inputs do not depend on the world
 * size), runs mtrain_pattern_select_blocks_ring `reps` times and prints, on
 * rank 0, the slowest rank's best time and every rank's growth of the peak
 * resident set during the selections (getrusage ru_maxrss over the resident
 * set before them), its user CPU time (the whole process, inputs included)
 * and its backend peak (mtrain_context_memory's
 * backend_peak_bytes: the keys held and the score rows).
 * usage: mpiexec -n W bench_mpi_block_select N G Hq Hkv d method [layout] [reps] */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_layout.h"
#include "mtrain/mtrain_mpi.h"

/* A value in [-1, 1) from a position. */
static float hashed(uint64_t x) {
  x ^= x >> 33, x *= 0xff51afd7ed558ccdull, x ^= x >> 33, x *= 0xc4ceb9fe1a85ec53ull, x ^= x >> 33;
  return (float)((double)(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static long rss_kb(void) {
  long pages = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f) {
    if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

#define TRY(x)                                                                                     \
  do {                                                                                             \
    if ((x) != MTRAIN_SUCCESS) {                                                                   \
      fprintf(stderr, "rank %d: %s: %s\n", rank, #x, mtrain_last_error());                         \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                                \
    }                                                                                              \
  } while (0)

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (argc < 7) {
    if (rank == 0)
      fprintf(stderr, "usage: bench_mpi_block_select N G Hq Hkv d method [layout] [reps]\n");
    MPI_Finalize();
    return 2;
  }
  const int64_t N = atoll(argv[1]);
  const int32_t G = atoi(argv[2]), Hq = atoi(argv[3]), Hkv = atoi(argv[4]), d = atoi(argv[5]);
  mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
  mtrain_layout_kind_t kind = MTRAIN_LAYOUT_ZIGZAG;
  mtrain_comm_t *comm = NULL;
  TRY(mtrain_block_method_parse(argv[6], &o.method));
  if (argc > 7) TRY(mtrain_layout_kind_parse(argv[7], &kind));
  const int reps = argc > 8 ? atoi(argv[8]) : 3;
  o.kind = MTRAIN_BUDGET_TOP_K;
  o.top_k = 8;
  o.head_adaptive = o.method != MTRAIN_BLOCK_MEANPOOL;
  TRY(mtrain_comm_create_mpi(MPI_COMM_WORLD, 600.0, &comm));
  mtrain_layout_t *layout = NULL;
  TRY(mtrain_layout_create(kind, N, G, world, NULL, &layout));
  const int64_t T = mtrain_layout_local_tokens(layout, rank);
  int64_t *index = malloc(sizeof(int64_t) * (size_t)T);
  float *q = malloc(sizeof(float) * (size_t)(T * Hq * d));
  float *k = malloc(sizeof(float) * (size_t)(T * Hkv * d));
  float *lse = malloc(sizeof(float) * (size_t)(T * Hq));
  TRY(mtrain_layout_rank_token_index(layout, rank, index));
  for (int64_t i = 0; i < T; i++) {
    const int64_t g = index[i] < N ? index[i] : 0;
    for (int64_t x = 0; x < (int64_t)Hq * d; x++) q[i * Hq * d + x] = hashed(g * 4096 + x);
    for (int64_t x = 0; x < (int64_t)Hkv * d; x++)
      k[i * Hkv * d + x] = hashed(((uint64_t)1 << 40) + g * 4096 + x);
    for (int32_t h = 0; h < Hq; h++) lse[i * Hq + h] = (float)log((double)(g + 1)) + 1.0f;
  }
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  cfg.num_threads = 1;
  mtrain_context_t *ctx = NULL;
  TRY(mtrain_context_create(&cfg, comm, &ctx));
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, T, Hq, d);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, T, Hkv, d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, T, Hq);
  const long before = rss_kb();
  double best = 1e30;
  int64_t pairs = 0;
  for (int r = 0; r < reps; r++) {
    mtrain_pattern_t *p = NULL;
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    TRY(mtrain_pattern_select_blocks_ring(ctx, layout, &tq, &tk, &tl, &o, NULL, &p));
    double t = MPI_Wtime() - t0, slowest = 0;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    best = slowest < best ? slowest : best;
    pairs = 0;
    for (int32_t h = 0; h < Hq; h++) pairs += mtrain_pattern_count_pairs(p, h);
    mtrain_pattern_destroy(p);
  }
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  long grow = ru.ru_maxrss - before, all[256] = {0}, peaks[256] = {0};
  mtrain_memory_stats_t ms;
  TRY(mtrain_context_memory(ctx, &ms));
  long peak = (long)(ms.backend_peak_bytes >> 10);
  double cpu = (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec, cpus[256] = {0};
  MPI_Gather(&cpu, 1, MPI_DOUBLE, cpus, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Gather(&grow, 1, MPI_LONG, all, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  MPI_Gather(&peak, 1, MPI_LONG, peaks, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    printf("N %lld G %d heads %d/%d d %d %s top-k 8%s, %s layout, W %d: best of %d %.3f s, %lld "
           "token pairs; peak RSS growth per rank (MiB):",
           (long long)N, G, Hq, Hkv, d, mtrain_block_method_name(o.method),
           o.head_adaptive ? " head-adaptive" : "", mtrain_layout_kind_name(kind), world, reps,
           best, (long long)pairs);
    for (int r = 0; r < world && r < 256; r++) printf(" %.1f", all[r] / 1024.0);
    printf("; backend peak per rank (MiB):");
    for (int r = 0; r < world && r < 256; r++) printf(" %.1f", peaks[r] / 1024.0);
    printf("; user CPU s per rank (the whole process):");
    for (int r = 0; r < world && r < 256; r++) printf(" %.2f", cpus[r]);
    printf("\n");
  }
  mtrain_context_destroy(ctx);
  mtrain_layout_destroy(layout);
  mtrain_comm_destroy(comm);
  free(index), free(q), free(k), free(lse);
  MPI_Finalize();
  return 0;
}
