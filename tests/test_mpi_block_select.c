/* test_mpi_block_select.c: the distributed block selection (SPEC.md section
 * 9) under mpiexec, over the MPI communicator. Every rank generates the same
 * inputs, runs the single-rank selection itself, takes its slots of the
 * layout and runs mtrain_pattern_select_blocks_ring (each rank scores its
 * own query block rows against the key chunks passed around the ring, or
 * against every key gathered with MTRAIN_BLOCK_KEY_GATHER=1, both run here,
 * and selects them; the selected rows are all-gathered);
 * the pattern and the report (per-head recall, top-k budget, blocks) must be
 * bitwise the single-rank ones on every rank. Cases: the contiguous, zigzag
 * and striped layouts, precise top-p, precise and antidiagonal head-adaptive
 * top-k, antidiagonal top-p (stride 8; and non-causal, stride 4), meanpool
 * top-k, GQA, N not a multiple of G * W, both CPU backends, fp32 inputs and
 * (zigzag, cpu) bf16 inputs.
 * The seed is printed; MTRAIN_TEST_SEED overrides it. Exit 0 when every rank
 * passed every case.
 * usage: mpiexec -n W test_mpi_block_select */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_layout.h"
#include "mtrain/mtrain_mpi.h"
#include "test_support.h"

static int rank_, world_;

enum { HQ = 4, HKV = 2, D = 32, G = 16, NCASES = 6 };

typedef struct inputs {
  int64_t N;
  float *q, *k, *lse; /* the whole sequence, the same on every rank */
} inputs_t;

static void inputs_make(inputs_t *in, int64_t N, uint64_t seed) {
  in->N = N;
  in->q = malloc(sizeof(float) * (size_t)(N * HQ * D));
  in->k = malloc(sizeof(float) * (size_t)(N * HKV * D));
  in->lse = malloc(sizeof(float) * (size_t)(N * HQ));
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  ts_ring_fill(in->q, N * HQ * D, &rng, 0);
  ts_ring_fill(in->k, N * HKV * D, &rng, 0);
  /* any LSE gives well-defined masses; about that of a causal softmax */
  for (int64_t i = 0; i < N; i++)
    for (int32_t h = 0; h < HQ; h++)
      in->lse[i * HQ + h] = (float)(log((double)(i + 1)) + 0.3 * ts_rng_uniform(&rng));
}

static void inputs_free(inputs_t *in) { free(in->q), free(in->k), free(in->lse); }

static mtrain_block_options_t options(int c) {
  mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
  o.stride = 4;
  switch (c) {
  case 0: /* precise top-p */
    o.top_p = 0.85;
    break;
  case 1: /* precise head-adaptive top-k, no sink, two local blocks */
    o.kind = MTRAIN_BUDGET_TOP_K, o.top_k = 2, o.head_adaptive = 1, o.sink_blocks = 0;
    o.local_blocks = 2;
    break;
  case 2: /* antidiagonal head-adaptive top-k */
    o.method = MTRAIN_BLOCK_ANTIDIAG, o.kind = MTRAIN_BUDGET_TOP_K, o.top_k = 3;
    o.head_adaptive = 1;
    break;
  case 3: /* antidiagonal top-p, stride 8 */
    o.method = MTRAIN_BLOCK_ANTIDIAG, o.top_p = 0.8, o.stride = 8;
    break;
  case 4: /* antidiagonal non-causal top-p */
    o.method = MTRAIN_BLOCK_ANTIDIAG, o.top_p = 0.7, o.noncausal = 1;
    break;
  default: /* meanpool top-k */
    o.method = MTRAIN_BLOCK_MEANPOOL, o.kind = MTRAIN_BUDGET_TOP_K, o.top_k = 2;
  }
  return o;
}

typedef struct result {
  double recall[HQ];
  int32_t top_k[HQ];
  int64_t blocks[HQ];
} result_t;

static int same_report(const result_t *a, const result_t *b) {
  return !memcmp(a->recall, b->recall, sizeof a->recall) &&
         !memcmp(a->top_k, b->top_k, sizeof a->top_k) &&
         !memcmp(a->blocks, b->blocks, sizeof a->blocks);
}

static int select_case(const inputs_t *in, mtrain_layout_kind_t kind, const char *backend, int c,
                       mtrain_dtype_t dtype, mtrain_comm_t *comm, uint64_t seed) {
  const int64_t N = in->N;
  const size_t esz = mtrain_dtype_size(dtype);
  const mtrain_block_options_t o = options(c);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  cfg.num_threads = 1;
  mtrain_context_t *single = NULL, *dist = NULL;
  mtrain_layout_t *layout = NULL;
  mtrain_pattern_t *p1 = NULL, *pd = NULL;
  result_t r1, rd;
  mtrain_block_report_t rep1 = {r1.recall, r1.top_k, r1.blocks};
  mtrain_block_report_t repd = {rd.recall, rd.top_k, rd.blocks};
  /* q and k in `dtype` (bf16: rounded from the fp32 inputs) */
  void *gq = malloc(esz * (size_t)(N * HQ * D)), *gk = malloc(esz * (size_t)(N * HKV * D));
  if (!gq || !gk || mtrain_convert(in->q, MTRAIN_F32, gq, dtype, N * HQ * D) ||
      mtrain_convert(in->k, MTRAIN_F32, gk, dtype, N * HKV * D)) {
    printf("  rank %d: out of memory\n", rank_);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  mtrain_tensor_t tq = mtrain_tensor_3d(gq, dtype, N, HQ, D);
  mtrain_tensor_t tk = mtrain_tensor_3d(gk, dtype, N, HKV, D);
  mtrain_tensor_t tl = mtrain_tensor_2d(in->lse, MTRAIN_F32, N, HQ);
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &single);
  if (!st) st = mtrain_pattern_select_blocks(single, &tq, &tk, &tl, &o, &rep1, &p1);
  if (!st) st = mtrain_context_create(&cfg, comm, &dist);
  if (!st) st = mtrain_layout_create(kind, N, G, world_, NULL, &layout);
  char *lq = NULL, *lk = NULL;
  float *ll = NULL;
  int64_t *index = NULL;
  if (!st) {
    const int64_t T = mtrain_layout_local_tokens(layout, rank_);
    lq = calloc((size_t)(T * HQ * D), esz);
    lk = calloc((size_t)(T * HKV * D), esz);
    ll = calloc((size_t)(T * HQ), sizeof(float));
    index = malloc(sizeof(int64_t) * (size_t)T);
    st = mtrain_layout_rank_token_index(layout, rank_, index);
    if (!st) {
      for (int64_t i = 0; i < T; i++)
        if (index[i] < N) {
          memcpy(lq + (size_t)i * HQ * D * esz, (char *)gq + (size_t)index[i] * HQ * D * esz,
                 (size_t)HQ * D * esz);
          memcpy(lk + (size_t)i * HKV * D * esz, (char *)gk + (size_t)index[i] * HKV * D * esz,
                 (size_t)HKV * D * esz);
        }
      ts_ring_gather(ll, in->lse, index, T, N, HQ);
    }
    mtrain_tensor_t ltq = mtrain_tensor_3d(lq, dtype, T, HQ, D);
    mtrain_tensor_t ltk = mtrain_tensor_3d(lk, dtype, T, HKV, D);
    mtrain_tensor_t ltl = mtrain_tensor_2d(ll, MTRAIN_F32, T, HQ);
    if (!st) st = mtrain_pattern_select_blocks_ring(dist, layout, &ltq, &ltk, &ltl, &o, &repd, &pd);
  }
  int ok = st == MTRAIN_SUCCESS;
  if (st)
    printf("  rank %d: block selection: %s: %s\n", rank_, mtrain_status_name(st),
           mtrain_last_error());
  int32_t head = -1;
  if (ok && !(ok = ts_patterns_equal(p1, pd, HQ, &head)))
    printf("  rank %d: head %d: the distributed pattern differs\n", rank_, head);
  if (ok && !(ok = same_report(&r1, &rd)))
    printf("  rank %d: the distributed report differs\n", rank_);
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank_ == 0)
    printf("%s: W=%d block selection (%s, case %d), %s layout, %s, %s, N=%lld, seed %llu: %s\n",
           all ? "passed" : "FAILED", world_, mtrain_block_method_name(o.method), c,
           mtrain_layout_kind_name(kind), backend, mtrain_dtype_name(dtype), (long long)N,
           (unsigned long long)seed, all ? "bitwise equal to one rank" : "differs");
  free(lq), free(lk), free(ll), free(index), free(gq), free(gk);
  mtrain_pattern_destroy(p1);
  mtrain_pattern_destroy(pd);
  mtrain_layout_destroy(layout);
  mtrain_context_destroy(single);
  mtrain_context_destroy(dist);
  return all;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  mtrain_comm_t *comm = NULL;
  if (mtrain_comm_create_mpi(MPI_COMM_WORLD, 60.0, &comm) != MTRAIN_SUCCESS) {
    fprintf(stderr, "rank %d: %s\n", rank_, mtrain_last_error());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const uint64_t seed = ts_seed(900);
  inputs_t in;
  inputs_make(&in, (int64_t)G * 2 * world_ * 3 + 37, seed); /* never a multiple of G * W */
  static const mtrain_layout_kind_t kinds[3] = {MTRAIN_LAYOUT_CONTIGUOUS, MTRAIN_LAYOUT_ZIGZAG,
                                                MTRAIN_LAYOUT_STRIPED};
  static const char *backends[2] = {"cpu", "cpu-ref"};
  int passed = 0, failed = 0;
  /* the keys passed around the ring (every method; antidiag in three passes), then every key
   * gathered */
  for (int gather = 0; gather < 2; gather++) {
    if (gather) setenv("MTRAIN_BLOCK_KEY_GATHER", "1", 1);
    if (rank_ == 0) printf("keys %s\n", gather ? "gathered" : "passed around the ring");
    for (int b = 0; b < 2; b++)
      for (int l = 0; l < 3; l++)
        for (int c = 0; c < NCASES; c++)
          select_case(&in, kinds[l], backends[b], c, MTRAIN_F32, comm, seed) ? passed++ : failed++;
    /* bf16 inputs (chunks of 2-byte elements), the fast backend */
    for (int c = 0; c < NCASES; c++)
      select_case(&in, MTRAIN_LAYOUT_ZIGZAG, "cpu", c, MTRAIN_BF16, comm, seed) ? passed++
                                                                                : failed++;
  }
  if (rank_ == 0) printf("%d passed, %d failed\n", passed, failed);
  inputs_free(&in);
  mtrain_comm_destroy(comm);
  MPI_Finalize();
  return failed ? 1 : 0;
}
