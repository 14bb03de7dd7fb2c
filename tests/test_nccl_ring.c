/* test_nccl_ring.c: the distributed ring on GPUs, one process per GPU under
 * mpiexec, through the NCCL communicator (mtrain_comm_create_nccl_mpi) and
 * the "cuda" backend. Every rank generates the same inputs, computes the
 * single-GPU result (the "cuda" backend without a communicator) and the fp64
 * oracle ("cpu-ref" on the host), takes its slots of the layout, runs the
 * ring forward and backward on device memory, and compares its outputs at
 * the same global positions:
 *  - fp32 inputs (variant 0): within 1e-5 of the largest single-GPU value and
 *    within SPEC.md's fp32 rule (1e-4) of the oracle;
 *  - bf16 inputs (the automatic variant: 3 on Hopper): within 2^-7 of the largest single-GPU value
 *    (the outputs are rounded to bf16; the steps' merge order differs).
 * Cases: every layout; the flat ring and the hierarchical ring with every
 * ranks-per-node given on the command line (1: W nodes of 1 GPU; W: one node
 * of W GPUs); dense, random sparse, diagonal-only and budget-like patterns;
 * non-causal block masks (blocks above the diagonal, no causal mask; every
 * ring chunk's padding slots excluded all the same); GQA; lengths that are
 * not multiples of G * W; the distributed estimate equal to one GPU's
 * bitwise (top-p heads with and without top_p_forced). Inputs and patterns:
 * the ring tests' helpers of tests/support (as test_mpi_ring); faults:
 * test_nccl_fault. Skips (exit 77) where fewer GPUs than ranks are visible.
 * usage: mpiexec -n W test_nccl_ring [ranks_per_node ...] */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_layout.h"
#include "mtrain/mtrain_nccl.h"
#include "test_support.h"

typedef struct ring_case {
  mtrain_dtype_t dtype;
  mtrain_layout_kind_t layout;
  int32_t ranks_per_node; /* 0: flat */
  int64_t N;
  int32_t hq, hkv, d, G;
  int pattern; /* 0 dense, 1 random sparse, 2 diagonal only, 3 budget-like */
  uint64_t seed;
} ring_case_t;

static int rank_, world_;

/* Host tensors (fp32 values) of T tokens. */
typedef struct tensors {
  float *t[9]; /* q k v dout o lse dq dk dv */
} tensors_t;
enum { Q, K, V, DOUT, O, LSE, DQ, DK, DV };

static int64_t width(int x, const ring_case_t *c) {
  if (x == LSE) return c->hq;
  return (x == K || x == V || x == DK || x == DV ? c->hkv : c->hq) * c->d;
}

static void alloc_tensors(tensors_t *t, int64_t T, const ring_case_t *c) {
  for (int x = 0; x < 9; x++) t->t[x] = calloc((size_t)(T * width(x, c)) + 1, sizeof(float));
}

static void free_tensors(tensors_t *t) {
  for (int x = 0; x < 9; x++) free(t->t[x]);
}

/* Forward and backward on the host (cpu-ref, fp32 storage). */
static mtrain_status_t run_host(mtrain_context_t *ctx, mtrain_plan_t *plan, tensors_t *h, int64_t T,
                                const ring_case_t *c) {
  mtrain_tensor_t t[9];
  for (int x = 0; x < 9; x++)
    t[x] = x == LSE ? mtrain_tensor_2d(h->t[x], MTRAIN_F32, T, c->hq)
                    : mtrain_tensor_3d(h->t[x], MTRAIN_F32, T, width(x, c) / c->d, c->d);
  mtrain_status_t st = mtrain_attention_forward(ctx, plan, &t[Q], &t[K], &t[V], &t[O], &t[LSE]);
  if (!st)
    st = mtrain_attention_backward(ctx, plan, &t[Q], &t[K], &t[V], &t[O], &t[LSE], &t[DOUT], &t[DQ],
                                   &t[DK], &t[DV]);
  return st;
}

/* The same on the GPU: inputs uploaded in the case dtype, outputs back as
 * fp32 values (lse is fp32). */
static mtrain_status_t run_device(mtrain_context_t *ctx, mtrain_plan_t *plan, tensors_t *h,
                                  int64_t T, const ring_case_t *c) {
  void *dev[9] = {0}, *stage = NULL;
  mtrain_status_t st = MTRAIN_SUCCESS;
  const size_t esz = mtrain_dtype_size(c->dtype);
  size_t most = 0;
  for (int x = 0; x < 9; x++) {
    const size_t n = (size_t)(T * width(x, c));
    const size_t bytes = (x == LSE ? sizeof(float) : esz) * (n ? n : 1);
    if (bytes > most) most = bytes;
    if (!st) st = mtrain_cuda_malloc(bytes, &dev[x]);
  }
  stage = malloc(most);
  for (int x = 0; !st && x <= DOUT; x++) {
    const int64_t n = T * width(x, c);
    st = mtrain_convert(h->t[x], MTRAIN_F32, stage, c->dtype, n);
    if (!st) st = mtrain_cuda_memcpy_to_device(dev[x], stage, (size_t)n * esz);
  }
  mtrain_tensor_t t[9];
  for (int x = 0; x < 9; x++)
    t[x] = x == LSE ? mtrain_tensor_2d(dev[x], MTRAIN_F32, T, c->hq)
                    : mtrain_tensor_3d(dev[x], c->dtype, T, width(x, c) / c->d, c->d);
  if (!st) st = mtrain_attention_forward(ctx, plan, &t[Q], &t[K], &t[V], &t[O], &t[LSE]);
  if (!st)
    st = mtrain_attention_backward(ctx, plan, &t[Q], &t[K], &t[V], &t[O], &t[LSE], &t[DOUT], &t[DQ],
                                   &t[DK], &t[DV]);
  for (int x = O; !st && x <= DV; x++) {
    const int64_t n = T * width(x, c);
    const mtrain_dtype_t dt = x == LSE ? MTRAIN_F32 : c->dtype;
    st = mtrain_cuda_memcpy_to_host(stage, dev[x], (size_t)n * mtrain_dtype_size(dt));
    if (!st) st = mtrain_convert(stage, dt, h->t[x], MTRAIN_F32, n);
  }
  for (int x = 0; x < 9; x++) mtrain_cuda_free(dev[x]);
  free(stage);
  return st;
}

static int all_ranks(int ok) {
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all;
}

static int run_case(const ring_case_t *c, mtrain_comm_t *comm) {
  char what[256];
  snprintf(what, sizeof what, "%s %s %s N=%lld %d:%d d=%d G=%d pattern %d seed %llu",
           mtrain_dtype_name(c->dtype), mtrain_layout_kind_name(c->layout),
           c->ranks_per_node ? "hierarchical" : "flat", (long long)c->N, c->hq, c->hkv, c->d, c->G,
           c->pattern, (unsigned long long)c->seed);
  if (c->ranks_per_node)
    snprintf(what + strlen(what), sizeof what - strlen(what), " (%d x %d)",
             world_ / c->ranks_per_node, c->ranks_per_node);
  int ok = 1;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = c->G;
  cfg.num_threads = 1;
  mtrain_context_t *single = NULL, *oracle = NULL, *dist = NULL;
  mtrain_pattern_t *p = ts_ring_pattern(c->pattern, c->N, c->hq, c->G, c->seed);
  tensors_t g1, g64, loc;
  alloc_tensors(&g1, c->N, c);
  alloc_tensors(&g64, c->N, c);
  ts_rng_t rng = {c->seed};
  for (int x = Q; x <= DOUT; x++) {
    /* values exactly representable in bf16 (so every run sees the same inputs) */
    ts_ring_fill(g1.t[x], c->N * width(x, c), &rng, 1);
    memcpy(g64.t[x], g1.t[x], sizeof(float) * (size_t)(c->N * width(x, c)));
  }
  mtrain_plan_t *p1 = NULL, *pd = NULL, *po = NULL;
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &single);
  if (!st) st = mtrain_plan_create(single, NULL, pats, &p1);
  if (!st) st = run_device(single, p1, &g1, c->N, c);
  mtrain_config_t ocfg = cfg;
  ocfg.backend = "cpu-ref";
  if (!st) st = mtrain_context_create(&ocfg, NULL, &oracle);
  if (!st) st = mtrain_plan_create(oracle, NULL, pats, &po);
  if (!st) st = run_host(oracle, po, &g64, c->N, c);
  mtrain_layout_t *layout = NULL;
  mtrain_config_t dcfg = cfg;
  dcfg.check_inputs = 1; /* padding slots must not trip the NaN/Inf checks */
  if (!st) st = mtrain_context_create(&dcfg, comm, &dist);
  if (!st) st = mtrain_layout_create(c->layout, c->N, c->G, world_, NULL, &layout);
  if (!st)
    st = mtrain_plan_create_ring(dist, NULL, (const mtrain_layout_t *const[]){layout},
                                 c->ranks_per_node, (const mtrain_pattern_t *const[]){p}, &pd);
  int64_t T = 0, *index = NULL;
  if (!st) {
    T = mtrain_layout_local_tokens(layout, rank_);
    index = malloc(sizeof(int64_t) * (size_t)T);
    st = mtrain_layout_rank_token_index(layout, rank_, index);
  }
  if (!st) {
    alloc_tensors(&loc, T, c);
    for (int x = Q; x <= DOUT; x++) /* padding slots stay zero */
      ts_ring_gather(loc.t[x], g1.t[x], index, T, c->N, width(x, c));
    st = run_device(dist, pd, &loc, T, c);
    if (!st) {
      static const char *names[9] = {"q", "k", "v", "dout", "o", "lse", "dq", "dk", "dv"};
      const double single_tol = c->dtype == MTRAIN_F32 ? 1e-5 : 1.0 / 128;
      for (int x = O; x <= DV; x++) {
        double e1 = 0, r1 = 0, eo = 0, ro = 0;
        ts_ring_compare(loc.t[x], g1.t[x], index, T, c->N, width(x, c), &e1, &r1);
        ts_ring_compare(loc.t[x], g64.t[x], index, T, c->N, width(x, c), &eo, &ro);
        double v[4] = {e1, r1, eo, ro}, m[4];
        MPI_Allreduce(v, m, 4, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        const int oracle_ok = c->dtype != MTRAIN_F32 || m[2] <= 1e-4 * m[3];
        if (!(m[0] <= single_tol * m[1]) || !oracle_ok) {
          ok = 0;
          if (rank_ == 0)
            printf("  %s: %s differs: single-GPU err %.3g (bound %.3g), oracle err %.3g\n", what,
                   names[x], m[0], single_tol * m[1], m[2]);
        }
      }
    }
    free_tensors(&loc);
  }
  if (st) {
    ok = 0;
    printf("  rank %d: %s: %s: %s\n", rank_, what, mtrain_status_name(st), mtrain_last_error());
  }
  const int all = all_ranks(ok);
  if (rank_ == 0) printf("%s: W=%d %s\n", all ? "passed" : "FAILED", world_, what);
  free(index);
  mtrain_plan_destroy(p1);
  mtrain_plan_destroy(po);
  mtrain_plan_destroy(pd);
  mtrain_layout_destroy(layout);
  mtrain_context_destroy(single);
  mtrain_context_destroy(oracle);
  mtrain_context_destroy(dist);
  mtrain_pattern_destroy(p);
  free_tensors(&g1);
  free_tensors(&g64);
  return all;
}

/* The distributed estimate on GPUs equals one GPU's bitwise (indices). The
 * scores are combined on the GPUs (the nccl device all-reduce) and selected
 * there; `wide`: top-p caps above what the device selection sorts at a time
 * (8192 ranks), so that its walk goes through several chunks;
 * `forced`: the top-p heads force the sinks and the window (top_p_forced). */
static int estimate_case(mtrain_layout_kind_t kind, mtrain_comm_t *comm, uint64_t seed, int wide,
                         int32_t forced) {
  const int64_t N = wide ? 20000 + 64 * world_ + 7 : 64 * 2 * world_ * 3 + 53;
  const int32_t hq = 4, hkv = 2, d = 64, G = 64;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = G;
  mtrain_context_t *single = NULL, *dist = NULL;
  mtrain_layout_t *layout = NULL;
  mtrain_pattern_t *p1 = NULL, *pd = NULL;
  float *q = malloc(sizeof(float) * (size_t)(N * hq * d)),
        *k = malloc(sizeof(float) * (size_t)(N * hkv * d));
  ts_rng_t rng = {seed};
  ts_ring_fill(q, N * hq * d, &rng, 1);
  ts_ring_fill(k, N * hkv * d, &rng, 1);
  mtrain_head_budget_t b[4];
  ts_ring_estimate_budgets(b);
  if (wide)
    for (int h = 1; h < 4; h += 2) b[h].cap_v = b[h].cap_s = 12000;
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = 40;
  eo.top_p_forced = forced;
  void *dq = NULL, *dk = NULL, *lq = NULL, *lk = NULL;
  mtrain_status_t st = mtrain_cuda_malloc(sizeof(float) * (size_t)(N * hq * d), &dq);
  if (!st) st = mtrain_cuda_malloc(sizeof(float) * (size_t)(N * hkv * d), &dk);
  if (!st) st = mtrain_cuda_memcpy_to_device(dq, q, sizeof(float) * (size_t)(N * hq * d));
  if (!st) st = mtrain_cuda_memcpy_to_device(dk, k, sizeof(float) * (size_t)(N * hkv * d));
  mtrain_tensor_t tq = mtrain_tensor_3d(dq, MTRAIN_F32, N, hq, d);
  mtrain_tensor_t tk = mtrain_tensor_3d(dk, MTRAIN_F32, N, hkv, d);
  if (!st) st = mtrain_context_create(&cfg, NULL, &single);
  if (!st) st = mtrain_pattern_estimate(single, &tq, &tk, b, &eo, &p1);
  if (!st) st = mtrain_context_create(&cfg, comm, &dist);
  if (!st) st = mtrain_layout_create(kind, N, G, world_, NULL, &layout);
  float *hq_loc = NULL, *hk_loc = NULL;
  int64_t *index = NULL;
  if (!st) {
    const int64_t T = mtrain_layout_local_tokens(layout, rank_);
    hq_loc = calloc((size_t)(T * hq * d) + 1, sizeof(float));
    hk_loc = calloc((size_t)(T * hkv * d) + 1, sizeof(float));
    index = malloc(sizeof(int64_t) * (size_t)T);
    st = mtrain_layout_rank_token_index(layout, rank_, index);
    if (!st) {
      ts_ring_gather(hq_loc, q, index, T, N, hq * d);
      ts_ring_gather(hk_loc, k, index, T, N, hkv * d);
    }
    if (!st) st = mtrain_cuda_malloc(sizeof(float) * (size_t)(T * hq * d + 1), &lq);
    if (!st) st = mtrain_cuda_malloc(sizeof(float) * (size_t)(T * hkv * d + 1), &lk);
    if (!st) st = mtrain_cuda_memcpy_to_device(lq, hq_loc, sizeof(float) * (size_t)(T * hq * d));
    if (!st) st = mtrain_cuda_memcpy_to_device(lk, hk_loc, sizeof(float) * (size_t)(T * hkv * d));
    mtrain_tensor_t ltq = mtrain_tensor_3d(lq, MTRAIN_F32, T, hq, d);
    mtrain_tensor_t ltk = mtrain_tensor_3d(lk, MTRAIN_F32, T, hkv, d);
    if (!st) st = mtrain_pattern_estimate_ring(dist, layout, &ltq, &ltk, b, &eo, &pd);
  }
  int ok = st == MTRAIN_SUCCESS;
  if (st)
    printf("  rank %d: estimate: %s: %s\n", rank_, mtrain_status_name(st), mtrain_last_error());
  int32_t head = -1;
  if (ok && !(ok = ts_patterns_equal(p1, pd, hq, &head)))
    printf("  rank %d: head %d: distributed estimate differs\n", rank_, head);
  const int all = all_ranks(ok);
  if (rank_ == 0)
    printf("%s: W=%d distributed estimate on GPUs, %s layout, N=%lld%s%s: %s\n",
           all ? "passed" : "FAILED", world_, mtrain_layout_kind_name(kind), (long long)N,
           wide ? " (top-p caps 12000: chunks of 8192)" : "", forced ? ", top_p_forced" : "",
           all ? "bitwise equal to one GPU" : "differs");
  mtrain_cuda_free(dq), mtrain_cuda_free(dk), mtrain_cuda_free(lq), mtrain_cuda_free(lk);
  free(q), free(k), free(hq_loc), free(hk_loc), free(index);
  mtrain_pattern_destroy(p1);
  mtrain_pattern_destroy(pd);
  mtrain_layout_destroy(layout);
  mtrain_context_destroy(single);
  mtrain_context_destroy(dist);
  return all;
}

/* The communicator's own operations: all-reduce, all-gather, split. */
static int comm_case(mtrain_comm_t *comm) {
  int ok = 1;
  double x = rank_ + 1;
  ok = ok && comm->ops->allreduce(comm->state, &x, 1, MTRAIN_F64, MTRAIN_REDUCE_SUM) == 0 &&
       x == world_ * (world_ + 1) / 2.0;
  float m = (float)rank_;
  ok = ok && comm->ops->allreduce(comm->state, &m, 1, MTRAIN_F32, MTRAIN_REDUCE_MAX) == 0 &&
       m == (float)(world_ - 1);
  int *all = calloc((size_t)world_, sizeof(int));
  ok = ok && comm->ops->allgather(comm->state, &rank_, all, sizeof(int)) == 0;
  for (int r = 0; ok && r < world_; r++) ok = all[r] == r;
  free(all);
  mtrain_comm_t *sub = NULL;
  ok = ok && mtrain_comm_split(comm, rank_ % 2, rank_, &sub) == MTRAIN_SUCCESS &&
       mtrain_comm_rank(sub) == rank_ / 2 && mtrain_comm_size(sub) == (world_ + 1 - rank_ % 2) / 2;
  mtrain_comm_destroy(sub);
  if (!ok) printf("  rank %d: %s\n", rank_, mtrain_last_error());
  const int a = all_ranks(ok);
  if (rank_ == 0)
    printf("%s: W=%d nccl all-reduce, all-gather and split\n", a ? "passed" : "FAILED", world_);
  return a;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  int enough = mtrain_cuda_device_count() >= world_, all_enough = 0;
  MPI_Allreduce(&enough, &all_enough, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_enough) {
    if (rank_ == 0)
      printf("SKIPPED: %d ranks need %d GPUs of one host; %d visible\n", world_, world_,
             mtrain_cuda_device_count());
    MPI_Finalize();
    return 77;
  }
  mtrain_comm_t *comm = NULL;
  if (mtrain_comm_create_nccl_mpi(MPI_COMM_WORLD, -1, 120.0, &comm) != MTRAIN_SUCCESS) {
    fprintf(stderr, "rank %d: %s\n", rank_, mtrain_last_error());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  int passed = 0, failed = 0;
  comm_case(comm) ? passed++ : failed++;
  int32_t schedules[8] = {0};
  int nsched = 1;
  for (int a = 1; a < argc && nsched < 8; a++) schedules[nsched++] = atoi(argv[a]);
  const mtrain_layout_kind_t layouts[4] = {MTRAIN_LAYOUT_CONTIGUOUS, MTRAIN_LAYOUT_ZIGZAG,
                                           MTRAIN_LAYOUT_STRIPED, MTRAIN_LAYOUT_BALANCED};
  /* ts_ring_pattern kinds 0..3, and 5 (non-causal) with seeds of their own
   * (the other cases keep theirs) */
  uint64_t seed = 1, nc_seed = 1001;
  static const int kinds[5] = {0, 1, 2, 3, 5};
  for (int sc = 0; sc < nsched; sc++)
    for (int l = 0; l < 4; l++)
      for (int x = 0; x < 5; x++) {
        const int pat = kinds[x];
        uint64_t *next = pat == 5 ? &nc_seed : &seed;
        /* fp32 through variant 0 (G 32), bf16 through the automatic variant (G 64, d 64) */
        ring_case_t c = {MTRAIN_F32, layouts[l], schedules[sc], 0, 4, 2, 32, 32, pat, (*next)++};
        c.N = 32 * 2 * world_ * 3 + 37; /* never a multiple of G * W */
        if (pat == 1) c.hkv = 1;
        run_case(&c, comm) ? passed++ : failed++;
        ring_case_t b = {MTRAIN_BF16, layouts[l], schedules[sc], 0, 8, 2, 64, 64, pat, (*next)++};
        b.N = 64 * 3 * world_ * 2 + 45;
        run_case(&b, comm) ? passed++ : failed++;
      }
  for (int l = 0; l < 4; l++) estimate_case(layouts[l], comm, 500 + l, 0, 0) ? passed++ : failed++;
  estimate_case(MTRAIN_LAYOUT_STRIPED, comm, 510, 1, 0) ? passed++ : failed++;
  /* top-p with the sinks and the window forced, selected on the GPUs and on the host */
  estimate_case(MTRAIN_LAYOUT_STRIPED, comm, 520, 0, 1) ? passed++ : failed++;
  estimate_case(MTRAIN_LAYOUT_ZIGZAG, comm, 521, 1, 1) ? passed++ : failed++;
  /* a larger case: 16:2 heads, d 128, the real shape */
  ring_case_t big = {
      MTRAIN_BF16, MTRAIN_LAYOUT_STRIPED, schedules[nsched - 1], 4000, 16, 2, 128, 128, 3, 100};
  run_case(&big, comm) ? passed++ : failed++;
  if (rank_ == 0) printf("%d passed, %d failed\n", passed, failed);
  mtrain_comm_destroy(comm);
  MPI_Finalize();
  return failed ? 1 : 0;
}
