/* balance_calibrate.c: mtrain-balance-calibrate, the fitting tool of
 * SparseBalance's cost predictor (docs/BALANCE.md, "SparseBalance"). It
 * times one attention layer (forward + backward, the context's backend, on
 * this machine) for patterns the position model makes from a budget file at
 * several lengths, layers and budget scalings, measures a rate for the linear
 * layers (a blocked fp32 C loop with OpenMP: the backend's BLAS is not
 * public; labelled as such in the JSON), fits seconds = pair_s *
 * pairs + row_s * rows + seq_s * calls by weighted least squares on the
 * relative error (non-negative: the best non-negative subset), and writes the
 * calibration JSON with every measurement, the fit and the leave-one-out
 * prediction error. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_balance.h"
#include "mtrain/mtrain_inputs.h"
#include "tool_common.h"

static const char *prog = "mtrain-balance-calibrate";

static const char usage[] =
    "usage: mtrain-balance-calibrate --budgets FILE --out FILE [options]\n"
    "\n"
    "Times one attention layer (forward + backward) on this machine for the position\n"
    "model's patterns of a budget file, fits the cost predictor's calibration\n"
    "(seconds = pair_s * pairs + row_s * query rows * heads + seq_s per call) and writes\n"
    "it as JSON with every measurement and the leave-one-out prediction error.\n"
    "\n"
    "  --budgets FILE        MInference budget file (its layers are the patterns)\n"
    "  --out FILE            the calibration JSON to write\n"
    "  --device NAME         what the JSON calls this machine (default cpu)\n"
    "  --backend NAME        mtrain backend (default cpu)\n"
    "  --lengths LIST        comma-separated sequence lengths (default 2048,4096,8192)\n"
    "  --layers LIST         budget layers timed (default 0,15,31)\n"
    "  --contexts LIST       budget contexts: 0 = budgets as given, else counts scaled by\n"
    "                        N / C (default 0,131072)\n"
    "  --kv-heads K          K/V heads (default 2); query heads are the layer's\n"
    "  --head-dim D          (default 128)\n"
    "  --repeat R            timed runs per point after one warm-up, median (default 3)\n"
    "  --help                this text\n";

typedef struct opts {
  const char *budgets, *out, *device, *backend;
  int64_t lengths[32], contexts[8];
  int32_t layers[64], nlen, nctx, nlay, kv_heads, head_dim, repeat;
} opts_t;

static int parse_list(const char *name, const char *s, int64_t *out, int cap, int *n) {
  *n = 0;
  char *end = NULL;
  while (*s) {
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || errno || v < 0 || *n >= cap || (*end && *end != ',')) {
      fprintf(stderr, "%s: --%s: expected up to %d comma-separated integers >= 0\n", prog, name,
              cap);
      return 1;
    }
    out[(*n)++] = v;
    s = *end ? end + 1 : end;
  }
  if (*n == 0) {
    fprintf(stderr, "%s: --%s: empty list\n", prog, name);
    return 1;
  }
  return 0;
}

typedef struct point {
  int64_t N, context, pairs;
  int32_t layer, heads;
  double seconds;
} point_t;

/* Weighted least squares on x (n x 3) with weights 1/t^2 over the columns in
 * `use` (a bit mask); returns the coefficients (0 for unused) and the sum of
 * squared relative residuals, or -1 when singular. */
static double fit_subset(const point_t *p, int n, int use, double coef[3]) {
  double A[3][3] = {{0}}, b[3] = {0};
  int cols[3], m = 0;
  for (int c = 0; c < 3; c++)
    if (use >> c & 1) cols[m++] = c;
  for (int i = 0; i < n; i++) {
    const double x[3] = {(double)p[i].pairs, (double)p[i].N * p[i].heads, 1.0};
    const double w = 1.0 / (p[i].seconds * p[i].seconds);
    for (int a = 0; a < m; a++) {
      b[a] += w * x[cols[a]] * p[i].seconds;
      for (int c = 0; c < m; c++) A[a][c] += w * x[cols[a]] * x[cols[c]];
    }
  }
  /* Gaussian elimination with partial pivoting on the m x m system */
  for (int c = 0; c < m; c++) {
    int piv = c;
    for (int r = c + 1; r < m; r++)
      if (fabs(A[r][c]) > fabs(A[piv][c])) piv = r;
    if (fabs(A[piv][c]) < 1e-300) return -1;
    for (int k = 0; k < m; k++) {
      double t = A[c][k];
      A[c][k] = A[piv][k];
      A[piv][k] = t;
    }
    double t = b[c];
    b[c] = b[piv];
    b[piv] = t;
    for (int r = 0; r < m; r++) {
      if (r == c) continue;
      const double f = A[r][c] / A[c][c];
      for (int k = 0; k < m; k++) A[r][k] -= f * A[c][k];
      b[r] -= f * b[c];
    }
  }
  coef[0] = coef[1] = coef[2] = 0;
  for (int a = 0; a < m; a++) coef[cols[a]] = b[a] / A[a][a];
  double res = 0;
  for (int i = 0; i < n; i++) {
    const double pred =
        coef[0] * (double)p[i].pairs + coef[1] * (double)p[i].N * p[i].heads + coef[2];
    res += (pred - p[i].seconds) * (pred - p[i].seconds) / (p[i].seconds * p[i].seconds);
  }
  return res;
}

/* The best non-negative fit over the subsets that contain the pairs column. */
static void fit(const point_t *p, int n, double coef[3]) {
  double best = -1;
  for (int use = 1; use < 8; use += 2) {
    double c[3];
    const double r = fit_subset(p, n, use, c);
    if (r < 0 || c[0] < 0 || c[1] < 0 || c[2] < 0) continue;
    if (best < 0 || r < best) {
      best = r;
      memcpy(coef, c, sizeof c);
    }
  }
  if (best < 0) coef[0] = coef[1] = coef[2] = 0;
}

/* The linear layers' rate: C[n x h] += A[n x h] B[h x h] in a blocked loop
 * with OpenMP through the compiler's vectoriser (a measured stand-in for the
 * framework's GEMMs; labelled in the JSON). */
static double linear_rate(void) {
  const int n = 512, h = 1024;
  float *A = malloc(sizeof(float) * n * h), *B = malloc(sizeof(float) * h * h),
        *C = calloc((size_t)n * h, sizeof(float));
  for (int i = 0; i < n * h; i++) A[i] = (float)(i % 7) * 0.01f;
  for (int i = 0; i < h * h; i++) B[i] = (float)(i % 5) * 0.01f;
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    const double t0 = tool_now();
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++)
      for (int k = 0; k < h; k++) {
        const float a = A[(size_t)i * h + k];
        const float *b = B + (size_t)k * h;
        float *c = C + (size_t)i * h;
        for (int j = 0; j < h; j++) c[j] += a * b[j];
      }
    const double r = 2.0 * n * h * h / (tool_now() - t0);
    if (r > best) best = r;
  }
  free(A);
  free(B);
  free(C);
  return best;
}

static int measure(const opts_t *o, const mtrain_budgets_t *b, point_t *pt) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = o->backend;
  mtrain_context_t *ctx = NULL;
  mtrain_pattern_t *pat = NULL;
  mtrain_plan_t *plan = NULL;
  mtrain_position_model_t pm = MTRAIN_POSITION_MODEL_INIT;
  pm.budget_context = pt->context;
  const int64_t N = pt->N;
  const int32_t d = o->head_dim, hkv = o->kv_heads;
  float *buf[9] = {0};
  int rc = 1;
  if (tool_failed(prog, "context", mtrain_context_create(&cfg, NULL, &ctx)) ||
      tool_failed(prog, "pattern",
                  mtrain_pattern_from_budgets(b, pt->layer, N, cfg.granularity, &pm, &pat)))
    goto done;
  const int32_t hq = mtrain_pattern_num_heads(pat);
  pt->heads = hq;
  pt->pairs = 0;
  for (int32_t h = 0; h < hq; h++) pt->pairs += mtrain_pattern_count_pairs(pat, h);
  int64_t offsets[2] = {0, N};
  mtrain_seqs_t seqs = {1, offsets};
  const mtrain_pattern_t *pats[1] = {pat};
  if (tool_failed(prog, "plan", mtrain_plan_create(ctx, &seqs, pats, &plan))) goto done;
  const size_t nq = (size_t)N * hq * d, nk = (size_t)N * hkv * d;
  const size_t sizes[9] = {nq, nk, nk, nq, (size_t)N * hq, nq, nq, nk, nk};
  for (int i = 0; i < 9; i++)
    if (!(buf[i] = malloc(sizes[i] * sizeof(float)))) goto done;
  mtrain_tensor_t q = mtrain_tensor_3d(buf[0], MTRAIN_F32, N, hq, d),
                  k = mtrain_tensor_3d(buf[1], MTRAIN_F32, N, hkv, d),
                  v = mtrain_tensor_3d(buf[2], MTRAIN_F32, N, hkv, d),
                  out = mtrain_tensor_3d(buf[3], MTRAIN_F32, N, hq, d),
                  lse = mtrain_tensor_2d(buf[4], MTRAIN_F32, N, hq),
                  dout = mtrain_tensor_3d(buf[5], MTRAIN_F32, N, hq, d),
                  dq = mtrain_tensor_3d(buf[6], MTRAIN_F32, N, hq, d),
                  dk = mtrain_tensor_3d(buf[7], MTRAIN_F32, N, hkv, d),
                  dv = mtrain_tensor_3d(buf[8], MTRAIN_F32, N, hkv, d);
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  if (tool_failed(prog, "inputs", mtrain_generate_structured(&so, &q, &k, &v)) ||
      tool_failed(prog, "inputs", mtrain_generate_normal(7, 1.0, &dout)))
    goto done;
  double runs[32];
  const int reps = o->repeat < 32 ? o->repeat : 32;
  for (int r = -1; r < reps; r++) {
    const double t0 = tool_now();
    if (tool_failed(prog, "forward", mtrain_attention_forward(ctx, plan, &q, &k, &v, &out, &lse)) ||
        tool_failed(
            prog, "backward",
            mtrain_attention_backward(ctx, plan, &q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv)))
      goto done;
    if (r >= 0) runs[r] = tool_now() - t0;
  }
  pt->seconds = tool_median(runs, reps);
  rc = 0;
done:
  for (int i = 0; i < 9; i++) free(buf[i]);
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(pat);
  mtrain_context_destroy(ctx);
  return rc;
}

int main(int argc, char **argv) {
  static const struct option longs[] = {
      {"budgets", required_argument, 0, 'b'},  {"out", required_argument, 0, 'o'},
      {"device", required_argument, 0, 'D'},   {"backend", required_argument, 0, 'B'},
      {"lengths", required_argument, 0, 'n'},  {"layers", required_argument, 0, 'l'},
      {"contexts", required_argument, 0, 'c'}, {"kv-heads", required_argument, 0, 'k'},
      {"head-dim", required_argument, 0, 'd'}, {"repeat", required_argument, 0, 'r'},
      {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
  opts_t o;
  memset(&o, 0, sizeof o);
  o.device = "cpu";
  o.backend = "cpu";
  o.kv_heads = 2;
  o.head_dim = 128;
  o.repeat = 3;
  o.nlen = 3;
  o.lengths[0] = 2048;
  o.lengths[1] = 4096;
  o.lengths[2] = 8192;
  o.nctx = 2;
  o.contexts[1] = 131072;
  o.nlay = 3;
  o.layers[1] = 15;
  o.layers[2] = 31;
  int c, n;
  int64_t tmp[64];
  opterr = 0;
  while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
    switch (c) {
    case 'b':
      o.budgets = optarg;
      break;
    case 'o':
      o.out = optarg;
      break;
    case 'D':
      o.device = optarg;
      break;
    case 'B':
      o.backend = optarg;
      break;
    case 'n':
      if (parse_list("lengths", optarg, o.lengths, 32, &o.nlen)) return 2;
      break;
    case 'c':
      if (parse_list("contexts", optarg, o.contexts, 8, &o.nctx)) return 2;
      break;
    case 'l':
      if (parse_list("layers", optarg, tmp, 64, &n)) return 2;
      o.nlay = n;
      for (int i = 0; i < n; i++) o.layers[i] = (int32_t)tmp[i];
      break;
    case 'k':
      o.kv_heads = atoi(optarg);
      break;
    case 'd':
      o.head_dim = atoi(optarg);
      break;
    case 'r':
      o.repeat = atoi(optarg);
      break;
    case 'h':
      fputs(usage, stdout);
      return 0;
    default:
      fprintf(stderr, "%s: unknown or incomplete option '%s' (see --help)\n", prog,
              argv[optind - 1]);
      return 2;
    }
  }
  if (!o.budgets || !o.out || o.kv_heads < 1 || o.head_dim < 1 || o.repeat < 1) {
    fprintf(stderr,
            "%s: --budgets and --out are required; --kv-heads, --head-dim and --repeat "
            "must be >= 1 (see --help)\n",
            prog);
    return 2;
  }
  mtrain_budgets_t *b = NULL;
  if (tool_failed(prog, o.budgets, mtrain_budgets_read(o.budgets, &b))) return 1;
  const int np = o.nlen * o.nlay * o.nctx;
  point_t *pts = calloc((size_t)np, sizeof *pts);
  int m = 0;
  for (int a = 0; a < o.nlen; a++)
    for (int l = 0; l < o.nlay; l++)
      for (int x = 0; x < o.nctx; x++) {
        point_t *p = &pts[m];
        p->N = o.lengths[a];
        p->layer = o.layers[l];
        p->context = o.contexts[x];
        if (measure(&o, b, p)) return 1;
        fprintf(stderr, "%s: N=%lld layer %d context %lld: %lld pairs, %.4f s\n", prog,
                (long long)p->N, p->layer, (long long)p->context, (long long)p->pairs, p->seconds);
        m++;
      }
  double coef[3];
  fit(pts, m, coef);
  /* leave-one-out relative errors */
  json_t *meas = json_array();
  double max_loo = 0, sum_loo = 0, max_in = 0;
  point_t *rest = calloc((size_t)m, sizeof *rest);
  for (int i = 0; i < m; i++) {
    int r = 0;
    for (int j = 0; j < m; j++)
      if (j != i) rest[r++] = pts[j];
    double cl[3];
    fit(rest, r, cl);
    const double x1 = (double)pts[i].N * pts[i].heads;
    const double pin = coef[0] * (double)pts[i].pairs + coef[1] * x1 + coef[2];
    const double ploo = cl[0] * (double)pts[i].pairs + cl[1] * x1 + cl[2];
    const double ein = pin / pts[i].seconds - 1, eloo = ploo / pts[i].seconds - 1;
    max_in = fmax(max_in, fabs(ein));
    max_loo = fmax(max_loo, fabs(eloo));
    sum_loo += fabs(eloo);
    json_array_append_new(
        meas, json_pack("{s:I, s:i, s:I, s:i, s:I, s:f, s:f, s:f}", "seq_len", (json_int_t)pts[i].N,
                        "layer", pts[i].layer, "budget_context", (json_int_t)pts[i].context,
                        "heads", pts[i].heads, "pairs", (json_int_t)pts[i].pairs, "seconds",
                        pts[i].seconds, "rel_error_fit", ein, "rel_error_leave_one_out", eloo));
  }
  const double lin = linear_rate();
  char deriv[600];
  snprintf(deriv, sizeof deriv,
           "mtrain-balance-calibrate on this machine: one attention layer forward+backward "
           "(%s backend, fp32, %d kv heads, d %d, structured inputs), median of %d runs after a "
           "warm-up, for the position model's patterns of %s; weighted least squares on the "
           "relative error, non-negative; linear_flops: a blocked fp32 C loop "
           "([512 x 1024] x [1024 x 1024], OpenMP), not a BLAS GEMM",
           o.backend, o.kv_heads, o.head_dim, o.repeat, o.budgets);
  json_t *root =
      json_pack("{s:s, s:s, s:s, s:s, s:f, s:f, s:f, s:f, s:{s:f, s:f, s:f, s:i}, s:o}", "device",
                o.device, "backend", o.backend, "status", "measured", "derivation", deriv, "pair_s",
                coef[0], "row_s", coef[1], "seq_s", coef[2], "linear_flops", lin, "fit",
                "max_abs_rel_error_fit", max_in, "max_abs_rel_error_leave_one_out", max_loo,
                "mean_abs_rel_error_leave_one_out", sum_loo / m, "points", m, "measurements", meas);
  if (json_dump_file(root, o.out, JSON_INDENT(1) | JSON_REAL_PRECISION(6))) {
    fprintf(stderr, "%s: cannot write %s\n", prog, o.out);
    return 1;
  }
  printf("%s: %d points: pair_s %.4g, row_s %.4g, seq_s %.4g; linear %.3g FLOP/s\n", prog, m,
         coef[0], coef[1], coef[2], lin);
  printf("%s: relative error: fit max %.3f; leave-one-out max %.3f, mean %.3f\n", prog, max_in,
         max_loo, sum_loo / m);
  json_decref(root);
  free(rest);
  free(pts);
  mtrain_budgets_destroy(b);
  return 0;
}
