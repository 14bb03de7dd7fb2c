/* mtrain_block_curves.c: the measurements of docs/PATTERNS.md for the block
 * selections (SPEC.md section 9). Not installed.
 *
 * usage: mtrain-block-curves recall [SEED] [--png FILE]   recall against
 *          density of every method and of vertical-slash on structured inputs
 *          (N 2048, 4 query and 2 kv heads, d 64, G 64), fp64 recall
 *          (mtrain_cpu_pattern_recall); --png also draws the curves (builds
 *          with libpng)
 *        mtrain-block-curves cost N [SEED]    seconds of each selection against
 *          the cpu forward of the pattern it selects (8 query heads, 2 kv, d 128,
 *          G 128), fp32, this machine's threads
 *        mtrain-block-curves cache [SEED]     the recall drop of a cached block
 *          pattern (mtrain_block_cache_*, refresh every 8 steps) against a fresh
 *          selection at each step since the refresh, on inputs that drift step to
 *          step (two structured inputs turned into each other by a growing
 *          angle: a stand-in for training steps)
 *        mtrain-block-curves gpucost N [SEED]  seconds of each selection on the
 *          cuda backend (bf16 device tensors, 8 query and 2 kv heads, d 128,
 *          G 128) against the cuda dense forward, precise and antidiag scored
 *          by the tensor-core kernels (the default) and by the exact fp64 ones
 *          (MTRAIN_CUDA_BLOCK_SCORES=fp64, set between the rows)
 * Prints markdown tables on stdout. Exit 0 on success, 1 on failure. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_block_cache.h"
#include "mtrain/mtrain_cpu.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"

#ifdef MTRAIN_HAVE_PNG
#include "curves_png.h"
#endif

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define TRY(x)                                                                                     \
  do {                                                                                             \
    mtrain_status_t st_ = (x);                                                                     \
    if (st_) {                                                                                     \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, mtrain_status_name(st_),              \
              mtrain_last_error());                                                                \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

typedef struct inputs {
  int64_t N;
  int32_t Hq, Hkv, d, G;
  float *q, *k, *v, *lse;
  double *qd, *kd;
} inputs_t;

static void make_inputs(inputs_t *in, uint64_t seed, int with_double) {
  const int64_t nq = in->N * in->Hq * in->d, nk = in->N * in->Hkv * in->d;
  in->q = malloc(sizeof(float) * (size_t)nq);
  in->k = malloc(sizeof(float) * (size_t)nk);
  in->v = malloc(sizeof(float) * (size_t)nk);
  in->lse = malloc(sizeof(float) * (size_t)(in->N * in->Hq));
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = seed;
  so.rope_base = 4.0 * (double)in->N;
  mtrain_tensor_t tq = mtrain_tensor_3d(in->q, MTRAIN_F32, in->N, in->Hq, in->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(in->k, MTRAIN_F32, in->N, in->Hkv, in->d);
  mtrain_tensor_t tv = mtrain_tensor_3d(in->v, MTRAIN_F32, in->N, in->Hkv, in->d);
  TRY(mtrain_generate_structured(&so, &tq, &tk, &tv));
  in->qd = in->kd = NULL;
  if (with_double) {
    in->qd = malloc(sizeof(double) * (size_t)nq);
    in->kd = malloc(sizeof(double) * (size_t)nk);
    for (int64_t i = 0; i < nq; i++) in->qd[i] = in->q[i];
    for (int64_t i = 0; i < nk; i++) in->kd[i] = in->k[i];
  }
}

static mtrain_context_t *context(int32_t G) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = G;
  mtrain_context_t *ctx = NULL;
  TRY(mtrain_context_create(&cfg, NULL, &ctx));
  return ctx;
}

/* A forward of `p` on ctx: seconds; lse (fp32) written when not NULL. */
static double forward(mtrain_context_t *ctx, const inputs_t *in, const mtrain_pattern_t *p,
                      float *lse) {
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *ps[] = {p};
  TRY(mtrain_plan_create(ctx, NULL, ps, &plan));
  float *o = malloc(sizeof(float) * (size_t)(in->N * in->Hq * in->d));
  float *l = lse ? lse : malloc(sizeof(float) * (size_t)(in->N * in->Hq));
  mtrain_tensor_t tq = mtrain_tensor_3d(in->q, MTRAIN_F32, in->N, in->Hq, in->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(in->k, MTRAIN_F32, in->N, in->Hkv, in->d);
  mtrain_tensor_t tv = mtrain_tensor_3d(in->v, MTRAIN_F32, in->N, in->Hkv, in->d);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F32, in->N, in->Hq, in->d);
  mtrain_tensor_t tl = mtrain_tensor_2d(l, MTRAIN_F32, in->N, in->Hq);
  const double t0 = now_s();
  TRY(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl));
  const double t = now_s() - t0;
  mtrain_plan_destroy(plan);
  free(o);
  if (!lse) free(l);
  return t;
}

static double density(const mtrain_pattern_t *p, const inputs_t *in) {
  int64_t pairs = 0;
  for (int32_t h = 0; h < in->Hq; h++) pairs += mtrain_pattern_count_pairs(p, h);
  return (double)pairs / ((double)in->Hq * (double)in->N * (double)(in->N + 1) / 2);
}

static double recall(const mtrain_pattern_t *p, const inputs_t *in) {
  double mean = 0.0;
  TRY(mtrain_cpu_pattern_recall(p, in->Hkv, in->d, 0.0, in->qd, in->kd, NULL, &mean));
  return mean;
}

static mtrain_pattern_t *select_blocks(mtrain_context_t *ctx, const inputs_t *in,
                                       const mtrain_block_options_t *o, double *seconds) {
  mtrain_tensor_t tq = mtrain_tensor_3d(in->q, MTRAIN_F32, in->N, in->Hq, in->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(in->k, MTRAIN_F32, in->N, in->Hkv, in->d);
  mtrain_tensor_t tl = mtrain_tensor_2d(in->lse, MTRAIN_F32, in->N, in->Hq);
  mtrain_pattern_t *p = NULL;
  const double t0 = now_s();
  TRY(mtrain_pattern_select_blocks(ctx, &tq, &tk, &tl, o, NULL, &p));
  if (seconds) *seconds = now_s() - t0;
  return p;
}

static mtrain_pattern_t *select_vs(mtrain_context_t *ctx, const inputs_t *in, int64_t v, int64_t s,
                                   double *seconds) {
  mtrain_tensor_t tq = mtrain_tensor_3d(in->q, MTRAIN_F32, in->N, in->Hq, in->d);
  mtrain_tensor_t tk = mtrain_tensor_3d(in->k, MTRAIN_F32, in->N, in->Hkv, in->d);
  mtrain_head_budget_t *b = calloc((size_t)in->Hq, sizeof *b);
  for (int32_t h = 0; h < in->Hq; h++)
    b[h].kind = MTRAIN_BUDGET_TOP_K, b[h].v_size = v, b[h].s_size = s;
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  mtrain_pattern_t *p = NULL;
  const double t0 = now_s();
  TRY(mtrain_pattern_estimate(ctx, &tq, &tk, b, &eo, &p));
  if (seconds) *seconds = now_s() - t0;
  free(b);
  return p;
}

static mtrain_block_options_t opts(mtrain_block_method_t m, mtrain_budget_kind_t kind, int32_t k,
                                   double p, int adaptive) {
  mtrain_block_options_t o = MTRAIN_BLOCK_OPTIONS_INIT;
  o.method = m;
  o.kind = kind;
  o.top_k = k;
  o.top_p = p;
  o.head_adaptive = adaptive;
  o.stride = 8;
  return o;
}

#ifdef MTRAIN_HAVE_PNG
static curves_t curves; /* recall's points, by series, for --png */
#endif

/* One table row; with series (the curve it belongs to) also a point of --png's chart. */
static void row(const char *method, const char *budget, const mtrain_pattern_t *p,
                const inputs_t *in, const char *series) {
  const double dens = density(p, in), rec = recall(p, in);
  printf("| %s | %s | %.3f | %.4f |\n", method, budget, dens, rec);
  fflush(stdout);
#ifdef MTRAIN_HAVE_PNG
  if (series) curves_add(&curves, series, dens, rec);
#else
  (void)series;
#endif
}

static int run_recall(uint64_t seed, const char *png) {
#ifndef MTRAIN_HAVE_PNG
  if (png) {
    fprintf(stderr, "mtrain-block-curves: --png %s: this build has no libpng\n", png);
    return 1;
  }
#endif
  inputs_t in = {.N = 2048, .Hq = 4, .Hkv = 2, .d = 64, .G = 64};
  make_inputs(&in, seed, 1);
  mtrain_context_t *ctx = context(in.G);
  mtrain_pattern_t *dense = NULL;
  TRY(mtrain_pattern_create_dense(in.N, in.Hq, in.G, &dense));
  forward(ctx, &in, dense, in.lse); /* the LSE the precise search reuses */
  mtrain_pattern_destroy(dense);
  printf("structured inputs seed %llu, N %lld, heads %d/%d, d %d, G %d, cpu backend\n\n",
         (unsigned long long)seed, (long long)in.N, in.Hq, in.Hkv, in.d, in.G);
  printf("| method | budget | density | recall |\n|---|---|---|---|\n");
  static const double ps[] = {0.5, 0.7, 0.8, 0.9, 0.95, 0.99};
  static const int32_t ks[] = {1, 2, 4, 8};
  char b[64];
  for (int m = 0; m < 2; m++)
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
      mtrain_block_options_t o =
          opts(m ? MTRAIN_BLOCK_ANTIDIAG : MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_P, 0, ps[i], 0);
      mtrain_pattern_t *p = select_blocks(ctx, &in, &o, NULL);
      snprintf(b, sizeof b, "top-p %.2f", ps[i]);
      row(m ? "antidiag (S 8)" : "precise", b, p, &in, m ? "antidiag top-p" : "precise top-p");
      mtrain_pattern_destroy(p);
    }
  for (int m = 0; m < 4; m++)
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
      const mtrain_block_method_t meth = m == 3   ? MTRAIN_BLOCK_MEANPOOL
                                         : m == 2 ? MTRAIN_BLOCK_ANTIDIAG
                                                  : MTRAIN_BLOCK_PRECISE;
      mtrain_block_options_t o = opts(meth, MTRAIN_BUDGET_TOP_K, ks[i], 0.0, m == 1);
      mtrain_pattern_t *p = select_blocks(ctx, &in, &o, NULL);
      snprintf(b, sizeof b, "top-k %d%s", ks[i], m == 1 ? " head-adaptive" : "");
      static const char *const series[] = {"precise top-k", "precise top-k adapt.",
                                           "antidiag top-k", "meanpool top-k"};
      row(m == 3 ? "meanpool" : m == 2 ? "antidiag (S 8)" : "precise", b, p, &in, series[m]);
      mtrain_pattern_destroy(p);
    }
  static const int64_t vs[][2] = {{32, 32},   {64, 64},   {64, 128},
                                  {128, 128}, {128, 192}, {256, 256}};
  for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++) {
    mtrain_pattern_t *p = select_vs(ctx, &in, vs[i][0], vs[i][1], NULL);
    snprintf(b, sizeof b, "v %lld, s %lld", (long long)vs[i][0], (long long)vs[i][1]);
    row("vertical-slash (top-k)", b, p, &in, "vertical-slash");
    mtrain_pattern_destroy(p);
  }
  mtrain_context_destroy(ctx);
#ifdef MTRAIN_HAVE_PNG
  if (png) {
    char title[128], err[256];
    snprintf(title, sizeof title, "recall against density, structured inputs (seed %llu), N %lld",
             (unsigned long long)seed, (long long)in.N);
    curves.title = title;
    curves.x_label = "density (computed pairs / causal pairs)";
    curves.y_label = "recall (attention mass kept)";
    if (curves_write_png(&curves, png, err, sizeof err)) {
      fprintf(stderr, "mtrain-block-curves: %s\n", err);
      return 1;
    }
    fprintf(stderr, "mtrain-block-curves: wrote %s\n", png);
  }
#endif
  return 0;
}

static int run_cost(int64_t N, uint64_t seed) {
  inputs_t in = {.N = N, .Hq = 8, .Hkv = 2, .d = 128, .G = 128};
  make_inputs(&in, seed, 0);
  mtrain_context_t *ctx = context(in.G);
  mtrain_pattern_t *dense = NULL;
  TRY(mtrain_pattern_create_dense(in.N, in.Hq, in.G, &dense));
  const double t_dense = forward(ctx, &in, dense, in.lse);
  mtrain_pattern_destroy(dense);
  printf("structured inputs seed %llu, N %lld, heads %d/%d, d %d, G %d, cpu backend, fp32; dense "
         "forward %.3f s\n\n",
         (unsigned long long)seed, (long long)N, in.Hq, in.Hkv, in.d, in.G, t_dense);
  printf("| method | budget | density | selection s | forward s | selection / forward | "
         "selection / dense forward |\n|---|---|---|---|---|---|---|\n");
  for (int m = 0; m < 5; m++) {
    double ts = 0.0;
    mtrain_pattern_t *p = NULL;
    const char *name = NULL, *budget = NULL;
    if (m == 0) {
      mtrain_block_options_t o = opts(MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_P, 0, 0.9, 0);
      p = select_blocks(ctx, &in, &o, &ts), name = "precise", budget = "top-p 0.90";
    } else if (m == 1) {
      mtrain_block_options_t o = opts(MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_K, 4, 0.0, 1);
      p = select_blocks(ctx, &in, &o, &ts), name = "precise", budget = "top-k 4 head-adaptive";
    } else if (m == 2) {
      mtrain_block_options_t o = opts(MTRAIN_BLOCK_ANTIDIAG, MTRAIN_BUDGET_TOP_P, 0, 0.9, 0);
      p = select_blocks(ctx, &in, &o, &ts), name = "antidiag (S 8)", budget = "top-p 0.90";
    } else if (m == 3) {
      mtrain_block_options_t o = opts(MTRAIN_BLOCK_MEANPOOL, MTRAIN_BUDGET_TOP_K, 4, 0.0, 0);
      p = select_blocks(ctx, &in, &o, &ts), name = "meanpool", budget = "top-k 4";
    } else {
      p = select_vs(ctx, &in, 256, 256, &ts), name = "vertical-slash", budget = "v 256, s 256";
    }
    const double tf = forward(ctx, &in, p, NULL);
    printf("| %s | %s | %.3f | %.3f | %.3f | %.1f%% | %.1f%% |\n", name, budget, density(p, &in),
           ts, tf, 100.0 * ts / tf, 100.0 * ts / t_dense);
    fflush(stdout);
    mtrain_pattern_destroy(p);
  }
  mtrain_context_destroy(ctx);
  return 0;
}

/* ---- the pattern cache under drift ------------------------------------------------------ */

/* The drift model of the cache measurement: two structured inputs of
 * independent seeds, A and B (their own slash directions, outlier keys and
 * noise), turned into each other by an angle that grows by `omega` per step:
 * q_t = cos(omega t) q_A + sin(omega t) q_B, the same for k. Each step keeps
 * the statistics of one structured input while its outlier keys and slash
 * phases move from A's to B's. */
static void drift(inputs_t *in, const inputs_t *A, const inputs_t *B, double angle) {
  const double c = cos(angle), sn = sin(angle);
  const int64_t nq = in->N * in->Hq * in->d, nk = in->N * in->Hkv * in->d;
  for (int64_t i = 0; i < nq; i++)
    in->q[i] = (float)(c * A->q[i] + sn * B->q[i]), in->qd[i] = in->q[i];
  for (int64_t i = 0; i < nk; i++)
    in->k[i] = (float)(c * A->k[i] + sn * B->k[i]), in->kd[i] = in->k[i];
}

static void free_inputs(inputs_t *in) {
  free(in->q), free(in->k), free(in->v), free(in->lse), free(in->qd), free(in->kd);
}

#define CACHE_STEPS 24
#define CACHE_REFRESH 8
#define CACHE_METHODS 3

static int run_cache(uint64_t seed) {
  static const double omegas[] = {0.02, 0.05, 0.1}; /* omega, radians per step */
  const char *names[CACHE_METHODS] = {"precise", "antidiag (S 8)", "meanpool"};
  const char *budgets[CACHE_METHODS] = {"top-p 0.90", "top-p 0.90", "top-k 4"};
  mtrain_block_options_t os[CACHE_METHODS] = {
      opts(MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_P, 0, 0.9, 0),
      opts(MTRAIN_BLOCK_ANTIDIAG, MTRAIN_BUDGET_TOP_P, 0, 0.9, 0),
      opts(MTRAIN_BLOCK_MEANPOOL, MTRAIN_BUDGET_TOP_K, 4, 0.0, 0)};
  printf("structured inputs seeds %llu and %llu, N 2048, heads 4/2, d 64, G 64, cpu backend; "
         "drift: q_t = cos(omega t) q_A + sin(omega t) q_B, the same for k; %d steps, refresh "
         "every %d; recall in fp64 against each step's own dense attention\n",
         (unsigned long long)seed, (unsigned long long)seed + 1, CACHE_STEPS, CACHE_REFRESH);
  double summary[3][CACHE_METHODS][2];
  for (size_t e = 0; e < sizeof omegas / sizeof omegas[0]; e++) {
    inputs_t in = {.N = 2048, .Hq = 4, .Hkv = 2, .d = 64, .G = 64}, A = in, B = in;
    make_inputs(&in, seed, 1);
    make_inputs(&A, seed, 0);
    make_inputs(&B, seed + 1, 0);
    mtrain_context_t *ctx = context(in.G);
    mtrain_block_cache_t *cache = NULL;
    TRY(mtrain_block_cache_create(CACHE_METHODS, CACHE_REFRESH, &cache));
    mtrain_pattern_t *dense = NULL;
    TRY(mtrain_pattern_create_dense(in.N, in.Hq, in.G, &dense));
    /* sums per (method, age): cached recall, fresh recall, cached density, fresh density */
    double acc[CACHE_METHODS][CACHE_REFRESH][4] = {{{0}}};
    int count[CACHE_REFRESH] = {0};
    for (int t = 0; t < CACHE_STEPS; t++) {
      drift(&in, &A, &B, omegas[e] * t);
      forward(ctx, &in, dense, in.lse); /* this step's LSE (the precise search reuses it) */
      mtrain_tensor_t tq = mtrain_tensor_3d(in.q, MTRAIN_F32, in.N, in.Hq, in.d);
      mtrain_tensor_t tk = mtrain_tensor_3d(in.k, MTRAIN_F32, in.N, in.Hkv, in.d);
      mtrain_tensor_t tl = mtrain_tensor_2d(in.lse, MTRAIN_F32, in.N, in.Hq);
      int32_t age = 0;
      for (int m = 0; m < CACHE_METHODS; m++) {
        const mtrain_pattern_t *cached = NULL;
        TRY(mtrain_block_cache_select(cache, m, ctx, &tq, &tk, &tl, &os[m], NULL, &cached, &age));
        mtrain_pattern_t *fresh = select_blocks(ctx, &in, &os[m], NULL);
        const double rf = recall(fresh, &in), rc = age == 0 ? rf : recall(cached, &in);
        acc[m][age][0] += rc, acc[m][age][1] += rf;
        acc[m][age][2] += density(cached, &in), acc[m][age][3] += density(fresh, &in);
        mtrain_pattern_destroy(fresh);
      }
      count[age]++;
    }
    printf(
        "\ndrift omega %.2f per step\n\n| method | budget | steps since refresh | cached recall | "
        "fresh recall | drop | cached density | fresh density |\n"
        "|---|---|---|---|---|---|---|---|\n",
        omegas[e]);
    for (int m = 0; m < CACHE_METHODS; m++) {
      double drop_sum = 0.0;
      for (int a = 0; a < CACHE_REFRESH; a++) {
        const double n = (double)count[a], rc = acc[m][a][0] / n, rf = acc[m][a][1] / n;
        printf("| %s | %s | %d | %.4f | %.4f | %.4f | %.3f | %.3f |\n", names[m], budgets[m], a, rc,
               rf, rf - rc, acc[m][a][2] / n, acc[m][a][3] / n);
        if (a > 0) drop_sum += rf - rc;
      }
      summary[e][m][0] = drop_sum / (CACHE_REFRESH - 1);
      summary[e][m][1] = (acc[m][CACHE_REFRESH - 1][1] - acc[m][CACHE_REFRESH - 1][0]) /
                         (double)count[CACHE_REFRESH - 1];
    }
    fflush(stdout);
    mtrain_pattern_destroy(dense);
    mtrain_block_cache_destroy(cache);
    mtrain_context_destroy(ctx);
    free_inputs(&in), free_inputs(&A), free_inputs(&B);
  }
  printf(
      "\n| drift omega | method | budget | mean drop, steps 1-%d since refresh | drop at step %d "
      "|\n|---|---|---|---|---|\n",
      CACHE_REFRESH - 1, CACHE_REFRESH - 1);
  for (size_t e = 0; e < sizeof omegas / sizeof omegas[0]; e++)
    for (int m = 0; m < CACHE_METHODS; m++)
      printf("| %.2f | %s | %s | %.4f | %.4f |\n", omegas[e], names[m], budgets[m],
             summary[e][m][0], summary[e][m][1]);
  return 0;
}

/* ---- the cuda scores against the cuda dense forward ------------------------------------- */

static void *upload(const void *host, size_t bytes) {
  void *d = NULL;
  TRY(mtrain_cuda_malloc(bytes, &d));
  TRY(mtrain_cuda_memcpy_to_device(d, host, bytes));
  return d;
}

static int run_gpucost(int64_t N, uint64_t seed) {
  if (mtrain_cuda_device_count() < 1) {
    fprintf(stderr, "gpucost: no CUDA device (or a build without the cuda backend)\n");
    return 1;
  }
  inputs_t in = {.N = N, .Hq = 8, .Hkv = 2, .d = 128, .G = 128};
  make_inputs(&in, seed, 0);
  const int64_t nq = N * in.Hq * in.d, nk = N * in.Hkv * in.d;
  uint16_t *hb = malloc(2 * (size_t)nq);
  TRY(mtrain_convert(in.q, MTRAIN_F32, hb, MTRAIN_BF16, nq));
  void *q = upload(hb, 2 * (size_t)nq), *o = upload(hb, 2 * (size_t)nq);
  TRY(mtrain_convert(in.k, MTRAIN_F32, hb, MTRAIN_BF16, nk));
  void *k = upload(hb, 2 * (size_t)nk);
  TRY(mtrain_convert(in.v, MTRAIN_F32, hb, MTRAIN_BF16, nk));
  void *v = upload(hb, 2 * (size_t)nk), *lse = NULL; /* lse: written by the dense forward */
  TRY(mtrain_cuda_malloc(sizeof(float) * (size_t)(N * in.Hq), &lse));
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = in.G;
  mtrain_context_t *ctx = NULL;
  TRY(mtrain_context_create(&cfg, NULL, &ctx));
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_BF16, N, in.Hq, in.d);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_BF16, N, in.Hkv, in.d);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_BF16, N, in.Hkv, in.d);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_BF16, N, in.Hq, in.d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, N, in.Hq);
  mtrain_pattern_t *dense = NULL;
  TRY(mtrain_pattern_create_dense(N, in.Hq, in.G, &dense));
  const mtrain_pattern_t *ps[] = {dense};
  mtrain_plan_t *plan = NULL;
  TRY(mtrain_plan_create(ctx, NULL, ps, &plan));
  double t_dense = INFINITY;
  for (int r = 0; r < 4; r++) { /* a warm-up, then the best of three */
    TRY(mtrain_cuda_device_synchronize());
    const double t0 = now_s();
    TRY(mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl));
    TRY(mtrain_cuda_device_synchronize());
    if (r > 0 && now_s() - t0 < t_dense) t_dense = now_s() - t0;
  }
  printf("structured inputs seed %llu, N %lld, heads %d/%d, d %d, G %d, cuda backend, bf16; dense "
         "forward %.4f s (best of 3)\n\n| method | budget | scores | density | selection s (best "
         "of 3) | selection / dense forward |\n|---|---|---|---|---|---|\n",
         (unsigned long long)seed, (long long)N, in.Hq, in.Hkv, in.d, in.G, t_dense);
  const char *saved = getenv("MTRAIN_CUDA_BLOCK_SCORES");
  char *keep = saved ? strdup(saved) : NULL;
  for (int row = 0; row < 5; row++) { /* precise, antidiag on tensor cores, then fp64; meanpool */
    const int m = row < 4 ? row % 2 : 2, exact = row == 2 || row == 3;
    if (exact)
      setenv("MTRAIN_CUDA_BLOCK_SCORES", "fp64", 1);
    else
      unsetenv("MTRAIN_CUDA_BLOCK_SCORES");
    const mtrain_block_options_t o3[3] = {
        opts(MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_P, 0, 0.9, 0),
        opts(MTRAIN_BLOCK_ANTIDIAG, MTRAIN_BUDGET_TOP_P, 0, 0.9, 0),
        opts(MTRAIN_BLOCK_MEANPOOL, MTRAIN_BUDGET_TOP_K, 4, 0.0, 0)};
    double best = INFINITY;
    mtrain_pattern_t *p = NULL;
    for (int r = 0; r < 4; r++) {
      mtrain_pattern_destroy(p);
      p = NULL;
      TRY(mtrain_cuda_device_synchronize());
      const double t0 = now_s();
      TRY(mtrain_pattern_select_blocks(ctx, &tq, &tk, &tl, &o3[m], NULL, &p));
      if (r > 0 && now_s() - t0 < best) best = now_s() - t0;
    }
    printf("| %s | %s | %s | %.3f | %.4f | %.1fx |\n",
           m == 0   ? "precise"
           : m == 1 ? "antidiag (S 8)"
                    : "meanpool",
           m == 2 ? "top-k 4" : "top-p 0.90",
           m == 2  ? "fp64 (CUDA cores)"
           : exact ? "fp64 (MTRAIN_CUDA_BLOCK_SCORES=fp64)"
                   : "tensor cores",
           density(p, &in), best, best / t_dense);
    fflush(stdout);
    mtrain_pattern_destroy(p);
  }
  if (keep)
    setenv("MTRAIN_CUDA_BLOCK_SCORES", keep, 1);
  else
    unsetenv("MTRAIN_CUDA_BLOCK_SCORES");
  free(keep);
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(dense);
  mtrain_context_destroy(ctx);
  mtrain_cuda_free(q), mtrain_cuda_free(k), mtrain_cuda_free(v), mtrain_cuda_free(o);
  mtrain_cuda_free(lse);
  free(hb);
  free_inputs(&in);
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "recall") == 0) {
    uint64_t seed = 2024;
    const char *png = NULL;
    for (int i = 2; i < argc; i++) {
      if (strcmp(argv[i], "--png") == 0 && i + 1 < argc) {
        png = argv[++i];
      } else {
        char *end = NULL;
        seed = strtoull(argv[i], &end, 10);
        if (end == argv[i] || *end) {
          fprintf(stderr, "%s recall: '%s' is neither a seed nor --png FILE\n", argv[0], argv[i]);
          return 1;
        }
      }
    }
    return run_recall(seed, png);
  }
  if (argc >= 3 && strcmp(argv[1], "cost") == 0)
    return run_cost(strtoll(argv[2], NULL, 10), argc >= 4 ? strtoull(argv[3], NULL, 10) : 2024);
  if (argc >= 2 && strcmp(argv[1], "cache") == 0)
    return run_cache(argc >= 3 ? strtoull(argv[2], NULL, 10) : 2024);
  if (argc >= 3 && strcmp(argv[1], "gpucost") == 0)
    return run_gpucost(strtoll(argv[2], NULL, 10), argc >= 4 ? strtoull(argv[3], NULL, 10) : 2024);
  fprintf(stderr,
          "usage: %s recall [SEED] [--png FILE] | cost N [SEED] | cache [SEED] | gpucost N "
          "[SEED]\n",
          argv[0]);
  return 1;
}
