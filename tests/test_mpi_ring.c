/* test_mpi_ring.c: the distributed ring under mpiexec (SPEC.md section 5).
 * Every rank generates the same inputs, computes the single-rank results
 * itself (the fast backend and the fp64 oracle), takes its slots of the
 * layout, runs the ring forward and backward, and compares its outputs with
 * the single-rank ones at the same global positions: within fp32 rounding of
 * the single-rank run (1e-5 of the largest value) and within SPEC.md's fp32
 * rule of the oracle (1e-4). Cases: every layout, the flat ring and (when the
 * world size allows) the hierarchical ring, dense, random sparse, diagonal-only
 * (query blocks with no key in most steps), real-budget patterns and block
 * masks (heads of both forms in one pattern, as the block selections give),
 * non-causal block masks (mtrain_pattern_create_noncausal), GQA,
 * lengths that are not multiples of G * W, both backends; and packed batches
 * (varlen: several sequences of uneven lengths, each with its own pattern
 * and layout, bars in the ring and gathered in one batch) against the
 * single-rank packed plan and the oracle. The distributed estimate
 * (mtrain_pattern_estimate_ring, every layout, both backends, top-p heads
 * with and without top_p_forced) equals the single-rank estimate bitwise.
 * Exit 0 when every rank passed
 * every case; rank 0 prints one line per case and the summary.
 * usage: mpiexec -n W test_mpi_ring [ranks_per_node ...] */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_layout.h"
#include "mtrain/mtrain_mpi.h"
#include "test_support.h"

typedef struct ring_case {
  const char *backend;
  mtrain_layout_kind_t layout;
  int32_t ranks_per_node; /* 0: flat */
  int64_t N;
  int32_t hq, hkv, d, G;
  int pattern; /* 0 dense, 1 random sparse, 2 diagonal only, 3 budget-like, 4 block masks,
                  5 non-causal block masks */
  uint64_t seed;
} ring_case_t;

static int rank_, world_;

typedef struct tensors {
  float *q, *k, *v, *dout, *o, *lse, *dq, *dk, *dv;
} tensors_t;

static void alloc_tensors(tensors_t *t, int64_t T, const ring_case_t *c) {
  const size_t nq = (size_t)(T * c->hq * c->d), nk = (size_t)(T * c->hkv * c->d);
  t->q = calloc(nq, sizeof(float));
  t->dout = calloc(nq, sizeof(float));
  t->o = calloc(nq, sizeof(float));
  t->dq = calloc(nq, sizeof(float));
  t->k = calloc(nk, sizeof(float));
  t->v = calloc(nk, sizeof(float));
  t->dk = calloc(nk, sizeof(float));
  t->dv = calloc(nk, sizeof(float));
  t->lse = calloc((size_t)(T * c->hq), sizeof(float));
}

static void free_tensors(tensors_t *t) {
  free(t->q), free(t->k), free(t->v), free(t->dout), free(t->o), free(t->lse), free(t->dq);
  free(t->dk), free(t->dv);
}

/* Forward and backward of a context and plan on tensors of T tokens. */
static mtrain_status_t run(mtrain_context_t *ctx, mtrain_plan_t *plan, tensors_t *t, int64_t T,
                           const ring_case_t *c) {
  mtrain_tensor_t q = mtrain_tensor_3d(t->q, MTRAIN_F32, T, c->hq, c->d);
  mtrain_tensor_t k = mtrain_tensor_3d(t->k, MTRAIN_F32, T, c->hkv, c->d);
  mtrain_tensor_t v = mtrain_tensor_3d(t->v, MTRAIN_F32, T, c->hkv, c->d);
  mtrain_tensor_t o = mtrain_tensor_3d(t->o, MTRAIN_F32, T, c->hq, c->d);
  mtrain_tensor_t l = mtrain_tensor_2d(t->lse, MTRAIN_F32, T, c->hq);
  mtrain_tensor_t dout = mtrain_tensor_3d(t->dout, MTRAIN_F32, T, c->hq, c->d);
  mtrain_tensor_t dq = mtrain_tensor_3d(t->dq, MTRAIN_F32, T, c->hq, c->d);
  mtrain_tensor_t dk = mtrain_tensor_3d(t->dk, MTRAIN_F32, T, c->hkv, c->d);
  mtrain_tensor_t dv = mtrain_tensor_3d(t->dv, MTRAIN_F32, T, c->hkv, c->d);
  mtrain_status_t st = mtrain_attention_forward(ctx, plan, &q, &k, &v, &o, &l);
  if (st == MTRAIN_SUCCESS)
    st = mtrain_attention_backward(ctx, plan, &q, &k, &v, &o, &l, &dout, &dq, &dk, &dv);
  return st;
}

static int run_case(const ring_case_t *c, mtrain_comm_t *comm) {
  char what[256];
  snprintf(what, sizeof what, "%s %s %s N=%lld %d:%d d=%d G=%d pattern %d seed %llu", c->backend,
           mtrain_layout_kind_name(c->layout), c->ranks_per_node ? "hierarchical" : "flat",
           (long long)c->N, c->hq, c->hkv, c->d, c->G, c->pattern, (unsigned long long)c->seed);
  if (c->ranks_per_node)
    snprintf(what + strlen(what), sizeof what - strlen(what), " (%d x %d)",
             world_ / c->ranks_per_node, c->ranks_per_node);
  int ok = 1;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = c->backend;
  cfg.granularity = c->G;
  cfg.num_threads = 1;
  mtrain_context_t *single = NULL, *oracle = NULL, *dist = NULL;
  mtrain_pattern_t *p = ts_ring_pattern(c->pattern, c->N, c->hq, c->G, c->seed);
  tensors_t g1, g64, loc;
  alloc_tensors(&g1, c->N, c);
  alloc_tensors(&g64, c->N, c);
  ts_rng_t rng = {c->seed};
  ts_ring_fill(g1.q, c->N * c->hq * c->d, &rng, 0);
  ts_ring_fill(g1.k, c->N * c->hkv * c->d, &rng, 0);
  ts_ring_fill(g1.v, c->N * c->hkv * c->d, &rng, 0);
  ts_ring_fill(g1.dout, c->N * c->hq * c->d, &rng, 0);
  memcpy(g64.q, g1.q, sizeof(float) * (size_t)(c->N * c->hq * c->d));
  memcpy(g64.k, g1.k, sizeof(float) * (size_t)(c->N * c->hkv * c->d));
  memcpy(g64.v, g1.v, sizeof(float) * (size_t)(c->N * c->hkv * c->d));
  memcpy(g64.dout, g1.dout, sizeof(float) * (size_t)(c->N * c->hq * c->d));
  mtrain_plan_t *p1 = NULL, *pd = NULL, *po = NULL;
  const mtrain_pattern_t *pats[1] = {p};
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &single);
  if (!st) st = mtrain_plan_create(single, NULL, pats, &p1);
  if (!st) st = run(single, p1, &g1, c->N, c);
  /* the oracle: cpu-ref on one rank (fp32 storage, fp64 accumulation) */
  mtrain_config_t ocfg = cfg;
  ocfg.backend = "cpu-ref";
  if (!st) st = mtrain_context_create(&ocfg, NULL, &oracle);
  if (!st) st = mtrain_plan_create(oracle, NULL, pats, &po);
  if (!st) st = run(oracle, po, &g64, c->N, c);
  /* the distributed run */
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
    /* padding slots stay zero */
    const int64_t wq = c->hq * c->d, wk = c->hkv * c->d;
    ts_ring_gather(loc.q, g1.q, index, T, c->N, wq);
    ts_ring_gather(loc.dout, g1.dout, index, T, c->N, wq);
    ts_ring_gather(loc.k, g1.k, index, T, c->N, wk);
    ts_ring_gather(loc.v, g1.v, index, T, c->N, wk);
    st = run(dist, pd, &loc, T, c);
    if (!st) {
      const struct {
        const char *name;
        const float *l, *g, *o;
        int64_t w;
      } t[5] = {{"o", loc.o, g1.o, g64.o, wq},
                {"lse", loc.lse, g1.lse, g64.lse, c->hq},
                {"dq", loc.dq, g1.dq, g64.dq, wq},
                {"dk", loc.dk, g1.dk, g64.dk, wk},
                {"dv", loc.dv, g1.dv, g64.dv, wk}};
      for (int x = 0; x < 5; x++) {
        double e1 = 0, r1 = 0, eo = 0, ro = 0;
        ts_ring_compare(t[x].l, t[x].g, index, T, c->N, t[x].w, &e1, &r1);
        ts_ring_compare(t[x].l, t[x].o, index, T, c->N, t[x].w, &eo, &ro);
        double v[4] = {e1, r1, eo, ro}, m[4];
        MPI_Allreduce(v, m, 4, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (!(m[0] <= 1e-5 * m[1]) || !(m[2] <= 1e-4 * m[3])) {
          ok = 0;
          if (rank_ == 0)
            printf("  %s: %s differs: single-rank err %.3g (bound %.3g), oracle err %.3g "
                   "(bound %.3g)\n",
                   what, t[x].name, m[0], 1e-5 * m[1], m[2], 1e-4 * m[3]);
        }
      }
    }
    free_tensors(&loc);
  }
  if (st) {
    ok = 0;
    printf("  rank %d: %s: %s: %s\n", rank_, what, mtrain_status_name(st), mtrain_last_error());
  }
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
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

/* A packed batch (varlen) over the ring: sequence s has length lens[s], its
 * own pattern and its own layout kind; this rank's tensors hold its slots of
 * each sequence, one after another. Compared with the single-rank packed
 * plan (fast backend, 1e-5) and the oracle (1e-4) at the same global rows. */
static int varlen_case(const char *backend, int32_t ranks_per_node, uint64_t seed,
                       mtrain_comm_t *comm) {
  enum { S = 3 };
  const int32_t G = 16;
  const int64_t lens[S] = {G * world_ + 5, 3 * G * world_ + 29, 1 + (world_ > 1 ? 0 : 40)};
  const mtrain_layout_kind_t kinds[S] = {MTRAIN_LAYOUT_ZIGZAG, MTRAIN_LAYOUT_BALANCED,
                                         MTRAIN_LAYOUT_STRIPED};
  const int pats[S] = {5, 4, 3}; /* non-causal, mixed block masks, budget-like */
  ring_case_t c = {backend, MTRAIN_LAYOUT_STRIPED, ranks_per_node, 0, 4, 2, 16, G, 0, seed};
  int64_t offsets[S + 1] = {0};
  for (int s = 0; s < S; s++) offsets[s + 1] = offsets[s] + lens[s];
  c.N = offsets[S];
  char what[200];
  snprintf(what, sizeof what, "%s packed batch of %d sequences (%lld, %lld, %lld tokens), %s",
           backend, S, (long long)lens[0], (long long)lens[1], (long long)lens[2],
           ranks_per_node ? "hierarchical" : "flat");
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  cfg.num_threads = 1;
  mtrain_pattern_t *p[S] = {NULL};
  mtrain_layout_t *lay[S] = {NULL};
  for (int s = 0; s < S; s++) p[s] = ts_ring_pattern(pats[s], lens[s], c.hq, G, seed + 7 * s);
  const mtrain_pattern_t *cp[S] = {p[0], p[1], p[2]};
  const mtrain_seqs_t seqs = {S, offsets};
  tensors_t g1, g64, loc;
  alloc_tensors(&g1, c.N, &c);
  alloc_tensors(&g64, c.N, &c);
  ts_rng_t rng = {seed};
  const int64_t wq = c.hq * c.d, wk = c.hkv * c.d;
  ts_ring_fill(g1.q, c.N * wq, &rng, 0);
  ts_ring_fill(g1.k, c.N * wk, &rng, 0);
  ts_ring_fill(g1.v, c.N * wk, &rng, 0);
  ts_ring_fill(g1.dout, c.N * wq, &rng, 0);
  memcpy(g64.q, g1.q, sizeof(float) * (size_t)(c.N * wq));
  memcpy(g64.k, g1.k, sizeof(float) * (size_t)(c.N * wk));
  memcpy(g64.v, g1.v, sizeof(float) * (size_t)(c.N * wk));
  memcpy(g64.dout, g1.dout, sizeof(float) * (size_t)(c.N * wq));
  mtrain_context_t *single = NULL, *oracle = NULL, *dist = NULL;
  mtrain_plan_t *p1 = NULL, *po = NULL, *pd = NULL;
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &single);
  if (!st) st = mtrain_plan_create(single, &seqs, cp, &p1);
  if (!st) st = run(single, p1, &g1, c.N, &c);
  mtrain_config_t ocfg = cfg;
  ocfg.backend = "cpu-ref";
  if (!st) st = mtrain_context_create(&ocfg, NULL, &oracle);
  if (!st) st = mtrain_plan_create(oracle, &seqs, cp, &po);
  if (!st) st = run(oracle, po, &g64, c.N, &c);
  mtrain_config_t dcfg = cfg;
  dcfg.check_inputs = 1;
  if (!st) st = mtrain_context_create(&dcfg, comm, &dist);
  for (int s = 0; !st && s < S; s++)
    st = mtrain_layout_create(kinds[s], lens[s], G, world_, NULL, &lay[s]);
  if (!st)
    st = mtrain_plan_create_ring(dist, &seqs, (const mtrain_layout_t *const *)lay, ranks_per_node,
                                 cp, &pd);
  /* index: the packed global row of each local slot (>= N: padding) */
  int64_t T = 0, *index = NULL;
  if (!st) {
    T = mtrain_plan_local_tokens(pd);
    index = malloc(sizeof(int64_t) * (size_t)(T + 1));
    for (int s = 0; !st && s < S; s++) {
      const int64_t off = mtrain_plan_seq_local_offset(pd, s);
      const int64_t n = mtrain_layout_local_tokens(lay[s], rank_);
      st = mtrain_layout_rank_token_index(lay[s], rank_, index + off);
      for (int64_t i = 0; i < n; i++)
        index[off + i] = index[off + i] < lens[s] ? offsets[s] + index[off + i] : c.N;
    }
  }
  int ok = 1;
  if (!st) {
    alloc_tensors(&loc, T, &c);
    ts_ring_gather(loc.q, g1.q, index, T, c.N, wq);
    ts_ring_gather(loc.dout, g1.dout, index, T, c.N, wq);
    ts_ring_gather(loc.k, g1.k, index, T, c.N, wk);
    ts_ring_gather(loc.v, g1.v, index, T, c.N, wk);
    st = run(dist, pd, &loc, T, &c);
    if (!st) {
      const struct {
        const char *name;
        const float *l, *g, *o;
        int64_t w;
      } t[5] = {{"o", loc.o, g1.o, g64.o, wq},
                {"lse", loc.lse, g1.lse, g64.lse, c.hq},
                {"dq", loc.dq, g1.dq, g64.dq, wq},
                {"dk", loc.dk, g1.dk, g64.dk, wk},
                {"dv", loc.dv, g1.dv, g64.dv, wk}};
      for (int x = 0; x < 5; x++) {
        double e1 = 0, r1 = 0, eo = 0, ro = 0;
        ts_ring_compare(t[x].l, t[x].g, index, T, c.N, t[x].w, &e1, &r1);
        ts_ring_compare(t[x].l, t[x].o, index, T, c.N, t[x].w, &eo, &ro);
        double v[4] = {e1, r1, eo, ro}, m[4];
        MPI_Allreduce(v, m, 4, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (!(m[0] <= 1e-5 * m[1]) || !(m[2] <= 1e-4 * m[3])) {
          ok = 0;
          if (rank_ == 0)
            printf("  %s seed %llu: %s differs: single-rank err %.3g (bound %.3g), oracle err "
                   "%.3g (bound %.3g)\n",
                   what, (unsigned long long)seed, t[x].name, m[0], 1e-5 * m[1], m[2], 1e-4 * m[3]);
        }
      }
    }
    free_tensors(&loc);
  }
  if (st) {
    ok = 0;
    printf("  rank %d: %s: %s: %s\n", rank_, what, mtrain_status_name(st), mtrain_last_error());
  }
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank_ == 0)
    printf("%s: W=%d %s seed %llu\n", all ? "passed" : "FAILED", world_, what,
           (unsigned long long)seed);
  free(index);
  mtrain_plan_destroy(p1);
  mtrain_plan_destroy(po);
  mtrain_plan_destroy(pd);
  for (int s = 0; s < S; s++) {
    mtrain_layout_destroy(lay[s]);
    mtrain_pattern_destroy(p[s]);
  }
  mtrain_context_destroy(single);
  mtrain_context_destroy(oracle);
  mtrain_context_destroy(dist);
  free_tensors(&g1);
  free_tensors(&g64);
  return all;
}

/* The distributed estimate equals the single-rank one bitwise (indices);
 * top_p_forced: the top-p heads force the sinks and the window too. */
static int estimate_case(mtrain_layout_kind_t kind, const char *backend, mtrain_comm_t *comm,
                         uint64_t seed, int32_t top_p_forced) {
  const int64_t N = 16 * 2 * world_ * 3 + 53;
  const int32_t hq = 4, hkv = 2, d = 16, G = 16;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = G;
  cfg.num_threads = 1;
  mtrain_context_t *single = NULL, *dist = NULL;
  mtrain_layout_t *layout = NULL;
  mtrain_pattern_t *p1 = NULL, *pd = NULL;
  float *q = malloc(sizeof(float) * (size_t)(N * hq * d)),
        *k = malloc(sizeof(float) * (size_t)(N * hkv * d));
  ts_rng_t rng = {seed};
  ts_ring_fill(q, N * hq * d, &rng, 0);
  ts_ring_fill(k, N * hkv * d, &rng, 0);
  mtrain_head_budget_t b[4];
  ts_ring_estimate_budgets(b);
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = 40;
  eo.top_p_forced = top_p_forced;
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, hq, d);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, hkv, d);
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &single);
  if (!st) st = mtrain_pattern_estimate(single, &tq, &tk, b, &eo, &p1);
  if (!st) st = mtrain_context_create(&cfg, comm, &dist);
  if (!st) st = mtrain_layout_create(kind, N, G, world_, NULL, &layout);
  float *lq = NULL, *lk = NULL;
  int64_t *index = NULL;
  if (!st) {
    const int64_t T = mtrain_layout_local_tokens(layout, rank_);
    lq = calloc((size_t)(T * hq * d), sizeof(float));
    lk = calloc((size_t)(T * hkv * d), sizeof(float));
    index = malloc(sizeof(int64_t) * (size_t)T);
    st = mtrain_layout_rank_token_index(layout, rank_, index);
    if (!st) {
      ts_ring_gather(lq, q, index, T, N, hq * d);
      ts_ring_gather(lk, k, index, T, N, hkv * d);
    }
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
  /* top_p_forced reached the ring's selection: its top-p heads keep the sinks */
  const int64_t nv_cand = ((N - 1) / G) * G;
  for (int32_t h = 0; ok && top_p_forced && h < hq; h++) {
    if (b[h].kind != MTRAIN_BUDGET_TOP_P) continue;
    int64_t sinks = eo.num_sinks < nv_cand ? eo.num_sinks : nv_cand;
    sinks = sinks < b[h].cap_v ? sinks : b[h].cap_v;
    const int32_t *diags = NULL;
    const int64_t *v = NULL;
    int32_t nd = 0, nv = 0;
    mtrain_pattern_get_head(pd, h, &diags, &nd, &v, &nv);
    for (int64_t j = 0; ok && j < sinks; j++) ok = j < nv && v[j] == j;
    if (!ok) printf("  rank %d: head %d: a forced sink is missing\n", rank_, h);
  }
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank_ == 0)
    printf("%s: W=%d distributed estimate, %s layout, %s, N=%lld, top_p_forced %d, seed %llu: "
           "%s\n",
           all ? "passed" : "FAILED", world_, mtrain_layout_kind_name(kind), backend, (long long)N,
           top_p_forced, (unsigned long long)seed, all ? "bitwise equal to one rank" : "differs");
  free(q), free(k), free(lq), free(lk), free(index);
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
  int passed = 0, failed = 0;
  /* split: two sub-communicators (even and odd ranks) with their own ranks and sums */
  {
    mtrain_comm_t *sub = NULL;
    int ok = mtrain_comm_split(comm, rank_ % 2, rank_, &sub) == MTRAIN_SUCCESS;
    const int want_size = (world_ + 1 - rank_ % 2) / 2;
    ok = ok && mtrain_comm_size(sub) == want_size && mtrain_comm_rank(sub) == rank_ / 2;
    double x = rank_;
    ok = ok &&
         sub->ops->allreduce(sub->state, &x, 1, MTRAIN_F64, MTRAIN_REDUCE_SUM) == MTRAIN_SUCCESS;
    double want = 0;
    for (int r = rank_ % 2; r < world_; r += 2) want += r;
    ok = ok && x == want;
    mtrain_comm_destroy(sub);
    int all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank_ == 0)
      printf("%s: W=%d communicator split into even and odd ranks\n", all ? "passed" : "FAILED",
             world_);
    all ? passed++ : failed++;
  }
  /* a configuration that differs on one rank fails on every rank, naming it */
  if (world_ > 1) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.granularity = rank_ == 1 ? 32 : 16;
    mtrain_context_t *ctx = NULL;
    const mtrain_status_t st = mtrain_context_create(&cfg, comm, &ctx);
    int ok = st == MTRAIN_ERR_INVALID_CONFIG && ctx == NULL &&
             strstr(mtrain_last_error(), "config.granularity differs between rank 0 and rank 1");
    if (!ok) printf("  rank %d: %s: %s\n", rank_, mtrain_status_name(st), mtrain_last_error());
    mtrain_context_destroy(ctx);
    int all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank_ == 0)
      printf("%s: W=%d mismatched configuration rejected on every rank\n",
             all ? "passed" : "FAILED", world_);
    all ? passed++ : failed++;
  }
  /* schedules: flat, plus every ranks-per-node given on the command line */
  int32_t schedules[8] = {0};
  int nsched = 1;
  for (int a = 1; a < argc && nsched < 8; a++) schedules[nsched++] = atoi(argv[a]);
  const mtrain_layout_kind_t layouts[4] = {MTRAIN_LAYOUT_CONTIGUOUS, MTRAIN_LAYOUT_ZIGZAG,
                                           MTRAIN_LAYOUT_STRIPED, MTRAIN_LAYOUT_BALANCED};
  uint64_t seed = 1;
  for (int sc = 0; sc < nsched; sc++)
    for (int l = 0; l < 4; l++)
      for (int pat = 0; pat < 6; pat++) {
        ring_case_t c = {"cpu", layouts[l], schedules[sc], 0, 4, 2, 16, 16, pat, seed++};
        c.N = 16 * 2 * world_ * 3 + 37; /* never a multiple of G * W */
        if (pat == 1) c.hkv = 1, c.d = 32;
        run_case(&c, comm) ? passed++ : failed++;
      }
  for (int l = 0; l < 4; l++) {
    estimate_case(layouts[l], "cpu", comm, 500 + l, 0) ? passed++ : failed++;
    estimate_case(layouts[l], "cpu-ref", comm, 600 + l, 0) ? passed++ : failed++;
    estimate_case(layouts[l], "cpu", comm, 550 + l, 1) ? passed++ : failed++;
    estimate_case(layouts[l], "cpu-ref", comm, 650 + l, 1) ? passed++ : failed++;
  }
  /* packed batches (varlen) on every schedule, both CPU backends */
  for (int sc = 0; sc < nsched; sc++) {
    varlen_case("cpu", schedules[sc], 700 + (uint64_t)sc, comm) ? passed++ : failed++;
    varlen_case("cpu-ref", schedules[sc], 800 + (uint64_t)sc, comm) ? passed++ : failed++;
  }
  /* the oracle itself distributed, and a larger GQA case */
  ring_case_t ref = {"cpu-ref", MTRAIN_LAYOUT_STRIPED, schedules[nsched - 1], 300, 4, 4, 8, 16, 1,
                     99};
  run_case(&ref, comm) ? passed++ : failed++;
  ring_case_t big = {"cpu", MTRAIN_LAYOUT_ZIGZAG, 0, 1000, 8, 1, 64, 32, 3, 100};
  run_case(&big, comm) ? passed++ : failed++;
  if (rank_ == 0) printf("%d passed, %d failed\n", passed, failed);
  mtrain_comm_destroy(comm);
  MPI_Finalize();
  return failed ? 1 : 0;
}
