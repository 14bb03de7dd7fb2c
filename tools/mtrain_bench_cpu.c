/* mtrain_bench_cpu.c: benchmark of the "cpu" backend. Measures, in one run
 * on one machine, the effective GFLOP/s (SPEC.md section 6) of the sparse
 * attention forward and backward for a dense and a vertical-slash pattern,
 * next to the OpenBLAS sgemm rate on the same tile shapes the backend uses
 * (G x tile x d scores and G x d x tile outputs), run with the same threads
 * the same way (one single-threaded sgemm per OpenMP thread). With --paired
 * the sgemm rate is also measured right before every timed attention run and
 * each run's share of it reported (median, least and most): robust to a
 * shared machine's load changing during the run. Progress goes to stderr; the table (or --json) to
 * stdout. Exit 0 on success (and after
 * --help), 1 when the work fails, 2 on a bad command line. */
#include <cblas.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_fast_common.h"
#include "mtrain/mtrain.h"
#include "tool_common.h"

char *openblas_get_corename(void);
void openblas_set_num_threads(int num_threads);

static const char *prog = "mtrain-bench-cpu";

typedef struct bench_opts {
  int64_t seq_len;
  int32_t heads, kv_heads, head_dim, granularity, repeat, threads;
  double density; /* share of block diagonals kept by the sparse pattern */
  int json, paired;
} bench_opts_t;

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Best sgemm GFLOP/s on the backend's two tile shapes and operand strides (q rows
 * strided by Hq*d, k rows by Hkv*d, as in [tokens, heads, d] tensors), all
 * threads at once. */
static double sgemm_rate(int threads, int G, int d, int tile, int hq, int hkv, int repeat) {
  const int ldq = hq * d, ldk = hkv * d;
  const int iters = 200;
  double *runs = malloc(sizeof(double) * (size_t)repeat);
  openblas_set_num_threads(1);
  for (int r = 0; r < repeat; r++) {
    double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads)
    {
      float *q = malloc(sizeof(float) * (size_t)G * ldq),
            *k = malloc(sizeof(float) * (size_t)tile * ldk);
      float *s = malloc(sizeof(float) * (size_t)G * tile),
            *o = malloc(sizeof(float) * (size_t)G * d);
      for (int i = 0; i < G * ldq; i++) q[i] = (float)((i % 7) - 3) * 0.1f;
      for (int i = 0; i < tile * ldk; i++) k[i] = (float)((i % 5) - 2) * 0.1f;
      for (int i = 0; i < G * tile; i++) s[i] = 0.01f * (float)(i % 3);
#pragma omp barrier
#pragma omp master
      t0 = tool_now();
#pragma omp barrier
      for (int it = 0; it < iters; it++) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, G, tile, d, 1.0f, q, ldq, k, ldk, 0.0f,
                    s, tile);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, G, d, tile, 1.0f, s, tile, k, ldk,
                    1.0f, o, d);
      }
#pragma omp barrier
#pragma omp master
      t1 = tool_now();
      free(q);
      free(k);
      free(s);
      free(o);
    }
    runs[r] = 4.0 * G * tile * d * iters * threads / (t1 - t0) * 1e-9;
  }
  /* the best run: a conservative peer (the attention figures are medians) */
  qsort(runs, (size_t)repeat, sizeof *runs, cmp_double);
  double rate = runs[repeat - 1];
  free(runs);
  return rate;
}

typedef struct bench_result {
  const char *pattern;
  double sparsity, fwd_s, bwd_s, fwd_gflops, bwd_gflops;
  double fwd_share[3], bwd_share[3]; /* --paired: median, least, most */
  long long pairs;
} bench_result_t;

/* Median, least and most of the n > 0 values of v (sorts v). */
static void spread(double *v, int n, double out[3]) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  out[0] = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  out[1] = v[0];
  out[2] = v[n - 1];
}

static mtrain_pattern_t *sparse_pattern(const bench_opts_t *o) {
  mtrain_pattern_t *p = NULL;
  if (tool_failed(prog, "pattern", mtrain_pattern_create(o->seq_len, o->heads, o->granularity, &p)))
    return NULL;
  const int64_t nb = (o->seq_len + o->granularity - 1) / o->granularity;
  int32_t *diags = malloc(sizeof(int32_t) * (size_t)nb);
  int64_t *verts = malloc(sizeof(int64_t) * 1024);
  uint64_t x = 12345;
  for (int32_t h = 0; h < o->heads; h++) {
    int32_t nd = 0, nv = 0;
    for (int64_t t = 0; t < nb; t++) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      if (t < 2 || (double)(x >> 11) * 0x1.0p-53 < o->density) diags[nd++] = (int32_t)t;
    }
    for (int64_t j = 0; j < o->seq_len && nv < 1024; j += o->seq_len / 512 + 1) verts[nv++] = j;
    if (tool_failed(prog, "pattern", mtrain_pattern_set_head(p, h, diags, nd, verts, nv))) break;
  }
  free(diags);
  free(verts);
  return p;
}

static int bench_pattern(const bench_opts_t *o, mtrain_context_t *ctx, mtrain_pattern_t *p,
                         const char *name, bench_result_t *r) {
  const int64_t N = o->seq_len;
  const size_t nq = (size_t)(N * o->heads * o->head_dim),
               nk = (size_t)(N * o->kv_heads * o->head_dim);
  float *buf = malloc(sizeof(float) * (4 * nq + 4 * nk + (size_t)(N * o->heads)));
  if (!buf) return 1;
  float *q = buf, *dout = q + nq, *out = dout + nq, *dq = out + nq, *k = dq + nq, *v = k + nk,
        *dk = v + nk, *dv = dk + nk, *lse = dv + nk;
  uint64_t x = 99;
  for (size_t i = 0; i < 2 * nq; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    q[i] = (float)((double)(x >> 11) * 0x1.0p-53 - 0.5) * 2.0f;
  }
  for (size_t i = 0; i < 2 * nk; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    k[i] = (float)((double)(x >> 11) * 0x1.0p-53 - 0.5) * 2.0f;
  }
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, o->heads, o->head_dim);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, o->kv_heads, o->head_dim);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F32, N, o->kv_heads, o->head_dim);
  mtrain_tensor_t to = mtrain_tensor_3d(out, MTRAIN_F32, N, o->heads, o->head_dim);
  mtrain_tensor_t tdo = mtrain_tensor_3d(dout, MTRAIN_F32, N, o->heads, o->head_dim);
  mtrain_tensor_t tdq = mtrain_tensor_3d(dq, MTRAIN_F32, N, o->heads, o->head_dim);
  mtrain_tensor_t tdk = mtrain_tensor_3d(dk, MTRAIN_F32, N, o->kv_heads, o->head_dim);
  mtrain_tensor_t tdv = mtrain_tensor_3d(dv, MTRAIN_F32, N, o->kv_heads, o->head_dim);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, N, o->heads);
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *pats[1] = {p};
  int rc = tool_failed(prog, "plan", mtrain_plan_create(ctx, NULL, pats, &plan));
  double *tf = calloc((size_t)o->repeat + 1, sizeof *tf),
         *tb = calloc((size_t)o->repeat + 1, sizeof *tb),
         *sg = calloc((size_t)o->repeat + 1, sizeof *sg);
  const int threads = o->threads > 0 ? o->threads : omp_get_max_threads();
  for (int i = 0; i <= o->repeat && !rc; i++) { /* run 0 warms up */
    fprintf(stderr, "%s: %s run %d/%d\n", prog, name, i, o->repeat);
    if (o->paired && i > 0)
      sg[i] = sgemm_rate(threads, o->granularity, o->head_dim, MTRAIN_CPU_TILE, o->heads,
                         o->kv_heads, 3);
    double t0 = tool_now();
    rc = tool_failed(prog, "forward", mtrain_attention_forward(ctx, plan, &tq, &tk, &tv, &to, &tl));
    double t1 = tool_now();
    if (!rc)
      rc = tool_failed(
          prog, "backward",
          mtrain_attention_backward(ctx, plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv));
    tf[i] = t1 - t0;
    tb[i] = tool_now() - t1;
  }
  if (!rc) {
    const long long pairs = mtrain_plan_computed_pairs(plan);
    double *share = calloc((size_t)o->repeat, sizeof *share);
    for (int bwd = 0; bwd < 2 && o->paired && share; bwd++) {
      for (int i = 1; i <= o->repeat; i++)
        share[i - 1] = (bwd ? 2.5 : 1.0) * tool_fwd_flops(pairs, o->head_dim) /
                       (bwd ? tb[i] : tf[i]) * 1e-9 / sg[i];
      spread(share, o->repeat, bwd ? r->bwd_share : r->fwd_share);
    }
    free(share);
    qsort(tf + 1, (size_t)o->repeat, sizeof *tf, cmp_double);
    qsort(tb + 1, (size_t)o->repeat, sizeof *tb, cmp_double);
    r->pattern = name;
    r->pairs = mtrain_plan_computed_pairs(plan);
    r->sparsity = 1.0 - (double)r->pairs / ((double)o->heads * N * (N + 1) / 2);
    r->fwd_s = tf[1 + o->repeat / 2];
    r->bwd_s = tb[1 + o->repeat / 2];
    r->fwd_gflops = tool_fwd_flops(r->pairs, o->head_dim) / r->fwd_s * 1e-9;
    r->bwd_gflops = 2.5 * tool_fwd_flops(r->pairs, o->head_dim) / r->bwd_s * 1e-9;
  }
  free(tf);
  free(tb);
  free(sg);
  mtrain_plan_destroy(plan);
  free(buf);
  return rc;
}

static const char usage[] =
    "usage: mtrain-bench-cpu [options]\n"
    "Effective GFLOP/s (SPEC.md section 6) of the cpu backend's forward and backward for a\n"
    "dense and a vertical-slash pattern, next to the OpenBLAS sgemm rate on the backend's\n"
    "tile shapes, measured in the same run. Progress on stderr, the table on stdout.\n"
    "  --seq-len N           tokens (default 8192)\n"
    "  --heads H             query heads (default 16)\n"
    "  --kv-heads H          K/V heads, a divisor of --heads (default 2)\n"
    "  --head-dim D          head dimension (default 128)\n"
    "  --granularity G       block size (default 128)\n"
    "  --density F           share of the block diagonals the vertical-slash pattern keeps,\n"
    "                        in (0, 1] (default 0.1)\n"
    "  --repeat R            timed runs after one warm-up, median reported (default 5)\n"
    "  --threads T           OpenMP threads (default: OpenMP's)\n"
    "  --paired              also measure the sgemm rate right before every timed run and\n"
    "                        report each run's share of it: median, least, most\n"
    "  --json                print the results as one JSON object instead of the table\n"
    "  --help                this text\n"
    "Exit status: 0 success, 1 error, 2 bad command line.\n";

/* An integer option value in [lo, hi]; 1 (message printed) when it is not one. */
static int parse_int(const char *name, const char *s, long long lo, long long hi, long long *out) {
  char *end = NULL;
  errno = 0;
  const long long v = strtoll(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) {
    fprintf(stderr, "%s: --%s '%s' is not an integer in [%lld, %lld]\n", prog, name, s, lo, hi);
    return 1;
  }
  *out = v;
  return 0;
}

/* 0: run; 1: bad command line (message printed); 2: --help printed. */
static int parse(int argc, char **argv, bench_opts_t *o) {
  *o = (bench_opts_t){8192, 16, 2, 128, 128, 5, 0, 0.1, 0, 0};
  static const struct option longs[] = {{"seq-len", required_argument, 0, 'N'},
                                        {"heads", required_argument, 0, 'H'},
                                        {"kv-heads", required_argument, 0, 'K'},
                                        {"head-dim", required_argument, 0, 'D'},
                                        {"granularity", required_argument, 0, 'G'},
                                        {"repeat", required_argument, 0, 'r'},
                                        {"threads", required_argument, 0, 'T'},
                                        {"density", required_argument, 0, 'd'},
                                        {"json", no_argument, 0, 'j'},
                                        {"paired", no_argument, 0, 'p'},
                                        {"help", no_argument, 0, 'h'},
                                        {0, 0, 0, 0}};
  int c, bad = 0;
  long long x = 0;
  opterr = 0;
  while (!bad && (c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
    switch (c) {
    case 'N':
      bad = parse_int("seq-len", optarg, 1, 1LL << 30, &x), o->seq_len = x;
      break;
    case 'H':
      bad = parse_int("heads", optarg, 1, 4096, &x), o->heads = (int32_t)x;
      break;
    case 'K':
      bad = parse_int("kv-heads", optarg, 1, 4096, &x), o->kv_heads = (int32_t)x;
      break;
    case 'D':
      bad = parse_int("head-dim", optarg, 1, 4096, &x), o->head_dim = (int32_t)x;
      break;
    case 'G':
      bad = parse_int("granularity", optarg, 1, 1 << 20, &x), o->granularity = (int32_t)x;
      break;
    case 'r':
      bad = parse_int("repeat", optarg, 1, 1000, &x), o->repeat = (int32_t)x;
      break;
    case 'T':
      bad = parse_int("threads", optarg, 1, 1 << 16, &x), o->threads = (int32_t)x;
      break;
    case 'd': {
      char *end = NULL;
      o->density = strtod(optarg, &end);
      if (end == optarg || *end || !(o->density > 0.0 && o->density <= 1.0)) {
        fprintf(stderr, "%s: --density '%s' is not a number in (0, 1]\n", prog, optarg);
        bad = 1;
      }
      break;
    }
    case 'j':
      o->json = 1;
      break;
    case 'p':
      o->paired = 1;
      break;
    case 'h':
      fputs(usage, stdout);
      return 2;
    default:
      fprintf(stderr, "%s: unknown or incomplete option '%s' (see --help)\n", prog,
              argv[optind - 1]);
      return 1;
    }
  }
  if (bad) return 1;
  if (optind < argc) {
    fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, argv[optind]);
    return 1;
  }
  if (o->heads % o->kv_heads != 0) {
    fprintf(stderr, "%s: --heads %d is not a multiple of --kv-heads %d\n", prog, o->heads,
            o->kv_heads);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  bench_opts_t o;
  const int parsed = parse(argc, argv, &o);
  if (parsed) return parsed == 2 ? 0 : 2;
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = o.granularity;
  cfg.num_threads = threads;
  mtrain_context_t *ctx = NULL;
  if (tool_failed(prog, "context", mtrain_context_create(&cfg, NULL, &ctx))) return 1;
  fprintf(stderr, "%s: sgemm on the tile shapes\n", prog);
  const double sgemm =
      sgemm_rate(threads, o.granularity, o.head_dim, MTRAIN_CPU_TILE, o.heads, o.kv_heads, 9);
  bench_result_t res[2];
  mtrain_pattern_t *dense = NULL, *sparse = sparse_pattern(&o);
  int rc = sparse == NULL ||
           tool_failed(prog, "pattern",
                       mtrain_pattern_create_dense(o.seq_len, o.heads, o.granularity, &dense));
  if (!rc) rc = bench_pattern(&o, ctx, dense, "dense", &res[0]);
  if (!rc) rc = bench_pattern(&o, ctx, sparse, "vertical-slash", &res[1]);
  if (!rc && o.json) {
    json_t *j = json_object(), *arr = json_array();
    json_object_set_new(j, "openblas_core", json_string(openblas_get_corename()));
    json_object_set_new(j, "threads", json_integer(threads));
    json_object_set_new(j, "seq_len", json_integer(o.seq_len));
    json_object_set_new(j, "head_dim", json_integer(o.head_dim));
    json_object_set_new(j, "granularity", json_integer(o.granularity));
    json_object_set_new(j, "sgemm_gflops", json_real(sgemm));
    for (int i = 0; i < 2; i++) {
      json_t *e = json_object();
      json_object_set_new(e, "pattern", json_string(res[i].pattern));
      json_object_set_new(e, "sparsity", json_real(res[i].sparsity));
      json_object_set_new(e, "forward_seconds", json_real(res[i].fwd_s));
      json_object_set_new(e, "backward_seconds", json_real(res[i].bwd_s));
      json_object_set_new(e, "forward_gflops", json_real(res[i].fwd_gflops));
      json_object_set_new(e, "backward_gflops", json_real(res[i].bwd_gflops));
      json_object_set_new(e, "forward_share_of_sgemm", json_real(res[i].fwd_gflops / sgemm));
      json_object_set_new(e, "backward_share_of_sgemm", json_real(res[i].bwd_gflops / sgemm));
      if (o.paired) {
        static const char *const keys[3] = {"median", "least", "most"};
        json_t *f = json_object(), *b = json_object();
        for (int k = 0; k < 3; k++) {
          json_object_set_new(f, keys[k], json_real(res[i].fwd_share[k]));
          json_object_set_new(b, keys[k], json_real(res[i].bwd_share[k]));
        }
        json_object_set_new(e, "forward_share_paired", f);
        json_object_set_new(e, "backward_share_paired", b);
      }
      json_array_append_new(arr, e);
    }
    json_object_set_new(j, "results", arr);
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_REAL_PRECISION(5));
    puts(s);
    free(s);
    json_decref(j);
  } else if (!rc) {
    printf("cpu backend, N=%lld Hq=%d Hkv=%d d=%d G=%d, %d threads, OpenBLAS core %s\n",
           (long long)o.seq_len, o.heads, o.kv_heads, o.head_dim, o.granularity, threads,
           openblas_get_corename());
    printf("sgemm on the tile shapes (%dx%dx%d + %dx%dx%d): %.1f GFLOP/s\n", o.granularity,
           MTRAIN_CPU_TILE, o.head_dim, o.granularity, o.head_dim, MTRAIN_CPU_TILE, sgemm);
    printf("%-15s %9s %11s %11s %9s %11s %9s\n", "pattern", "sparsity", "fwd ms", "fwd GF/s",
           "of sgemm", "bwd GF/s", "of sgemm");
    for (int i = 0; i < 2; i++)
      printf("%-15s %8.1f%% %11.1f %11.1f %8.0f%% %11.1f %8.0f%%\n", res[i].pattern,
             100 * res[i].sparsity, 1e3 * res[i].fwd_s, res[i].fwd_gflops,
             100 * res[i].fwd_gflops / sgemm, res[i].bwd_gflops, 100 * res[i].bwd_gflops / sgemm);
    if (o.paired)
      for (int i = 0; i < 2; i++)
        printf("%-15s paired with the sgemm run before each: fwd %.0f%% (%.0f-%.0f%%), bwd %.0f%% "
               "(%.0f-%.0f%%)\n",
               res[i].pattern, 100 * res[i].fwd_share[0], 100 * res[i].fwd_share[1],
               100 * res[i].fwd_share[2], 100 * res[i].bwd_share[0], 100 * res[i].bwd_share[1],
               100 * res[i].bwd_share[2]);
  }
  mtrain_pattern_destroy(dense);
  mtrain_pattern_destroy(sparse);
  mtrain_context_destroy(ctx);
  return rc;
}
