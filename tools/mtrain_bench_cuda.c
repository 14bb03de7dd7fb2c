/* mtrain_bench_cuda.c: the kernel benchmark of the "cuda" backend (issue 6).
 *
 * One sequence of N tokens (--seq-len, default 32768) of the Qwen2.5-3B
 * attention shape (16 query heads, 2 kv heads, head_dim 128), bf16, causal,
 * for two patterns: dense causal, and vertical-slash (by default about 93%
 * sparse) estimated online the way mtrain-run does it: mtrain-run's
 * structured inputs (run_inputs_load_or_generate), its budgets
 * (run_make_budgets: --v-size/--s-size or --budgets/--layer) and
 * mtrain_pattern_estimate on a "cpu" context. The density printed is
 * mtrain_plan_computed_pairs over the causal pairs.
 *
 * Each kernel variant (--variants, default 0,2,3: variant 1 exists only in
 * builds with MTRAIN_CUDA_DEV_VARIANTS=ON) is first validated on a
 * small problem (--validate-len, default 2048; the budgets' top-k sizes
 * scaled by the length ratio) against the "cpu" backend on the host: every
 * output of the forward and backward within tool_check_tolerance_between
 * (tool_common.h: twice the bound mtrain-run --check uses against the fp64
 * reference, as both sides carry an error: 8 unit roundoffs of the storage
 * type for bf16/fp16, 2e-4 for fp32) times max|cpu| for O, LSE, dQ,
 * dK and dV, nothing non-finite, and the call ran the variant asked for. A variant that fails is
 * not timed (the exit status is then 3). Then, on random N(0, 1) inputs (never zeros), two input
 * sets used in turn, on a stream of this program set with mtrain_cuda_set_stream: --warmup (3)
 * forward+backward runs, then --reps (10) forwards and --reps forward+backward pairs, each timed
 * with cudaEventRecord before and after on that stream; the medians are reported. Effective FLOPs
 * (SPEC.md section 6): forward 4 * d * pairs, forward+backward 3.5 times that (the backward
 * counts 2.5 forwards), with pairs = mtrain_plan_computed_pairs; TFLOP/s divide them by the median.
 *
 * --pattern-out writes the timed vertical-slash pattern (pattern JSON,
 * mtrain_io.h) so that a peer (tools/bench_cuda_peers.py) computes the same
 * pairs; --dump-dir writes the validation problems (inputs, pattern,
 * meta.json and every variant's outputs, .npy) for an independent check;
 * --json writes the results as one JSON object. The table goes to stdout,
 * progress to stderr. */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_io.h"
#include "run_common.h"
#include "run_inputs.h"
#include "tool_common.h"

static const char *prog = "mtrain-bench-cuda";

enum { PAT_DENSE, PAT_VS, NUM_PATTERNS };
static const char *const pattern_names[NUM_PATTERNS] = {"dense", "vertical-slash"};
static const char *const pattern_dirs[NUM_PATTERNS] = {"dense", "vs"};
enum { NUM_VARIANTS = 4 };
static const char *const out_names[5] = {"o", "lse", "dq", "dk", "dv"};

typedef struct bench_opts {
  int64_t seq_len, validate_len;
  int32_t heads, kv_heads, head_dim, granularity, reps, warmup, device;
  mtrain_dtype_t dtype;
  uint64_t seed;
  run_options_t src; /* the vertical-slash pattern's source, as mtrain-run reads it */
  int variant_on[NUM_VARIANTS], pattern_on[NUM_PATTERNS];
  const char *pattern_out, *dump_dir, *json_path;
} bench_opts_t;

/* What one (pattern, variant) gave. */
typedef struct bench_cell {
  int tried, valid;        /* validated; passed */
  int unsupported;         /* the variant cannot compute this shape (not an error) */
  double err[5], bound[5]; /* validation: max|cuda - cpu| and its bound per output */
  double fwd_ms, fb_ms;    /* medians */
  double fwd_tflops, fb_tflops;
  int timed;
} bench_cell_t;

typedef struct bench_pattern {
  mtrain_pattern_t *big, *small; /* the timed pattern and the validation one */
  long long pairs, small_pairs;  /* mtrain_plan_computed_pairs */
  double density;
} bench_pattern_t;

/* Reports a failed CUDA runtime call; returns 1 when err is an error. */
static int cuda_failed(const char *what, cudaError_t err) {
  if (err == cudaSuccess) return 0;
  fprintf(stderr, "%s: %s: %s\n", prog, what, cudaGetErrorString(err));
  return 1;
}

/* ---- options ------------------------------------------------------------------ */

static const char usage[] =
    "usage: mtrain-bench-cuda [options]\n"
    "Times the cuda backend's kernel variants on dense and vertical-slash attention.\n"
    "  --seq-len N           tokens of the timed sequence (default 32768)\n"
    "  --heads H --kv-heads H --head-dim D --granularity G  (default 16, 2, 128, 128)\n"
    "  --dtype bf16|fp16|fp32  (default bf16)\n"
    "  --v-size V --s-size S vertical-slash pattern: static top-k for every head (default\n"
    "                        1024 and 106: 93.4% sparse at 32768 tokens with seed 1)\n"
    "  --budgets FILE --layer L   or the per-head budgets of a MInference budget file\n"
    "  --last-q L            queries that score the keys in the estimate (default 64)\n"
    "  --patterns LIST       dense,vs (default both)\n"
    "  --variants LIST       0,1,2,3 (default 0,2,3; 1: MTRAIN_CUDA_DEV_VARIANTS builds)\n"
    "  --reps R --warmup W   timed runs (median) and warm-up runs (default 10, 3)\n"
    "  --validate-len N      tokens of the validation against the cpu backend (default 2048)\n"
    "  --seed S              seed of the inputs (default 1)\n"
    "  --device D            CUDA device (default 0)\n"
    "  --pattern-out FILE    write the timed vertical-slash pattern (pattern JSON)\n"
    "  --dump-dir DIR        write the validation problems and outputs (.npy) under DIR\n"
    "  --json FILE           write the results as JSON to FILE\n"
    "  --help                this text\n"
    "Validation against the cpu backend: every output within twice the bound of mtrain-run's\n"
    "check (8 unit roundoffs of bf16/fp16, 2e-4 for fp32) times max|cpu|.\n"
    "Exit status: 0 success, 1 error, 2 bad command line, 3 a variant failed validation.\n";

/* Parses an integer option value in [lo, hi]; 1 (message printed) when it is not one. */
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

/* Parses a comma-separated list of the given names into flags. */
static int parse_list(const char *opt, const char *s, const char *const *names, int count,
                      int *on) {
  for (int i = 0; i < count; i++) on[i] = 0;
  char buf[128];
  snprintf(buf, sizeof buf, "%s", s);
  for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
    int found = 0;
    for (int i = 0; i < count; i++)
      if (strcmp(tok, names[i]) == 0) on[i] = found = 1;
    if (!found) {
      fprintf(stderr, "%s: --%s: unknown entry '%s'\n", prog, opt, tok);
      return 1;
    }
  }
  return 0;
}

/* The command line; 0, 1 on a bad one (message printed), 2 after --help. */
static int parse(int argc, char **argv, bench_opts_t *o) {
  memset(o, 0, sizeof *o);
  o->seq_len = 32768;
  o->validate_len = 2048;
  o->heads = 16, o->kv_heads = 2, o->head_dim = 128, o->granularity = 128;
  o->reps = 10, o->warmup = 3;
  o->dtype = MTRAIN_BF16;
  o->seed = 1;
  o->variant_on[0] = o->variant_on[2] = o->variant_on[3] = 1; /* 1: development builds */
  o->pattern_on[PAT_DENSE] = o->pattern_on[PAT_VS] = 1;
  o->src.v_size = o->src.s_size = -1;
  o->src.layer = -1;
  o->src.last_q = 64;
  o->src.input_scale = 1.0; /* the inputs as generated (mtrain-run's --input-scale) */
  static const struct option longs[] = {{"seq-len", required_argument, 0, 'N'},
                                        {"heads", required_argument, 0, 'H'},
                                        {"kv-heads", required_argument, 0, 'K'},
                                        {"head-dim", required_argument, 0, 'D'},
                                        {"granularity", required_argument, 0, 'G'},
                                        {"dtype", required_argument, 0, 't'},
                                        {"v-size", required_argument, 0, 'V'},
                                        {"s-size", required_argument, 0, 'S'},
                                        {"budgets", required_argument, 0, 'B'},
                                        {"layer", required_argument, 0, 'L'},
                                        {"last-q", required_argument, 0, 'Q'},
                                        {"patterns", required_argument, 0, 'p'},
                                        {"variants", required_argument, 0, 'v'},
                                        {"reps", required_argument, 0, 'r'},
                                        {"warmup", required_argument, 0, 'w'},
                                        {"validate-len", required_argument, 0, 'n'},
                                        {"seed", required_argument, 0, 's'},
                                        {"device", required_argument, 0, 'd'},
                                        {"pattern-out", required_argument, 0, 'P'},
                                        {"dump-dir", required_argument, 0, 'O'},
                                        {"json", required_argument, 0, 'j'},
                                        {"help", no_argument, 0, 'h'},
                                        {0, 0, 0, 0}};
  static const char *const variant_names[NUM_VARIANTS] = {"0", "1", "2", "3"};
  static const char *const pattern_opts[NUM_PATTERNS] = {"dense", "vs"};
  int c, bad = 0;
  long long x = 0;
  opterr = 0;
  while (!bad && (c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
    switch (c) {
    case 'N':
      bad = parse_int("seq-len", optarg, 1, 1LL << 24, &x), o->seq_len = x;
      break;
    case 'H':
      bad = parse_int("heads", optarg, 1, 1024, &x), o->heads = (int32_t)x;
      break;
    case 'K':
      bad = parse_int("kv-heads", optarg, 1, 1024, &x), o->kv_heads = (int32_t)x;
      break;
    case 'D':
      bad = parse_int("head-dim", optarg, 1, 1024, &x), o->head_dim = (int32_t)x;
      break;
    case 'G':
      bad = parse_int("granularity", optarg, 1, 1 << 16, &x), o->granularity = (int32_t)x;
      break;
    case 't':
      if (mtrain_dtype_parse(optarg, &o->dtype) != MTRAIN_SUCCESS || o->dtype == MTRAIN_F64) {
        fprintf(stderr, "%s: --dtype '%s': expected bf16, fp16 or fp32\n", prog, optarg);
        bad = 1;
      }
      break;
    case 'V':
      bad = parse_int("v-size", optarg, 0, 1LL << 40, &x), o->src.v_size = x;
      break;
    case 'S':
      bad = parse_int("s-size", optarg, 0, 1LL << 40, &x), o->src.s_size = x;
      break;
    case 'B':
      o->src.budgets_path = optarg;
      break;
    case 'L':
      bad = parse_int("layer", optarg, 0, 1 << 20, &x), o->src.layer = (int32_t)x;
      break;
    case 'Q':
      bad = parse_int("last-q", optarg, 1, 1 << 20, &x), o->src.last_q = (int32_t)x;
      break;
    case 'p':
      bad = parse_list("patterns", optarg, pattern_opts, NUM_PATTERNS, o->pattern_on);
      break;
    case 'v':
      bad = parse_list("variants", optarg, variant_names, NUM_VARIANTS, o->variant_on);
      break;
    case 'r':
      bad = parse_int("reps", optarg, 1, 100000, &x), o->reps = (int32_t)x;
      break;
    case 'w':
      bad = parse_int("warmup", optarg, 0, 100000, &x), o->warmup = (int32_t)x;
      break;
    case 'n':
      bad = parse_int("validate-len", optarg, 1, 1 << 20, &x), o->validate_len = x;
      break;
    case 's':
      bad = parse_int("seed", optarg, 0, LLONG_MAX, &x), o->seed = (uint64_t)x;
      break;
    case 'd':
      bad = parse_int("device", optarg, 0, 1024, &x), o->device = (int32_t)x;
      break;
    case 'P':
      o->pattern_out = optarg;
      break;
    case 'O':
      o->dump_dir = optarg;
      break;
    case 'j':
      o->json_path = optarg;
      break;
    case 'h':
      fputs(usage, stdout);
      return 2;
    default:
      fprintf(stderr, "%s: unknown or incomplete option '%s'\n%s", prog, argv[optind - 1], usage);
      return 1;
    }
  }
  if (bad) return 1;
  if (optind < argc) {
    fprintf(stderr, "%s: unexpected argument '%s'\n", prog, argv[optind]);
    return 1;
  }
  if ((o->src.v_size >= 0) != (o->src.s_size >= 0) ||
      (o->src.budgets_path != NULL) != (o->src.layer >= 0) ||
      (o->src.v_size >= 0 && o->src.budgets_path)) {
    fprintf(stderr, "%s: give --v-size with --s-size, or --budgets with --layer\n", prog);
    return 1;
  }
  if (!o->src.budgets_path && o->src.v_size < 0) o->src.v_size = 1024, o->src.s_size = 106;
  if (o->heads % o->kv_heads != 0) {
    fprintf(stderr, "%s: --heads %d is not a multiple of --kv-heads %d\n", prog, o->heads,
            o->kv_heads);
    return 1;
  }
  if (o->validate_len > o->seq_len) o->validate_len = o->seq_len;
  return 0;
}

/* ---- patterns ------------------------------------------------------------------- */

/* The vertical-slash pattern of n tokens, as mtrain-run estimates it:
 * structured inputs from the seed, the budgets of the options, the online
 * estimate on a "cpu" context. At the validation length the top-k vertical
 * counts are scaled by n / seq_len (the slash counts are kept: they hold
 * the local window, whatever the length). */
static int build_vs_pattern(const bench_opts_t *o, int64_t n, mtrain_pattern_t **out) {
  run_options_t ro = o->src;
  ro.seq_len = n;
  ro.heads = o->heads, ro.kv_heads = o->kv_heads, ro.head_dim = o->head_dim;
  ro.granularity = o->granularity;
  ro.seed = o->seed;
  ro.dtype = o->dtype;
  ro.input = "structured";
  ro.backend = "cpu";
  run_inputs_t in = {0};
  mtrain_head_budget_t *budgets = NULL;
  mtrain_context_t *ctx = NULL;
  int rc = run_inputs_load_or_generate(&ro, &in);
  if (!rc) rc = run_make_budgets(prog, &ro, o->heads, &budgets);
  if (!rc && n != o->seq_len) {
    const double f = (double)n / (double)o->seq_len;
    for (int32_t h = 0; h < o->heads; h++) {
      if (budgets[h].kind != MTRAIN_BUDGET_TOP_K) continue;
      budgets[h].v_size = (int64_t)llround((double)budgets[h].v_size * f);
    }
  }
  if (!rc) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.backend = "cpu";
    cfg.granularity = o->granularity;
    rc = tool_failed(prog, "context", mtrain_context_create(&cfg, NULL, &ctx));
  }
  if (!rc) {
    mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
    eo.last_q = o->src.last_q;
    rc = tool_failed(prog, "estimating the pattern",
                     mtrain_pattern_estimate(ctx, &in.q, &in.k, budgets, &eo, out));
  }
  mtrain_context_destroy(ctx);
  free(budgets);
  run_inputs_free(&in);
  return rc;
}

/* The pattern of kind `kind` and n tokens. */
static int build_pattern(const bench_opts_t *o, int kind, int64_t n, mtrain_pattern_t **out) {
  if (kind == PAT_DENSE)
    return tool_failed(prog, "dense pattern",
                       mtrain_pattern_create_dense(n, o->heads, o->granularity, out));
  return build_vs_pattern(o, n, out);
}

/* mtrain_plan_computed_pairs of a pattern (plan built on a "cpu" context). */
static int count_pairs(const bench_opts_t *o, const mtrain_pattern_t *p, long long *pairs) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cpu";
  cfg.granularity = o->granularity;
  mtrain_context_t *ctx = NULL;
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *pats[1] = {p};
  int rc = tool_failed(prog, "context", mtrain_context_create(&cfg, NULL, &ctx));
  if (!rc) rc = tool_failed(prog, "plan", mtrain_plan_create(ctx, NULL, pats, &plan));
  if (!rc) *pairs = mtrain_plan_computed_pairs(plan);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  return rc;
}

/* ---- tensors ------------------------------------------------------------------ */

/* The nine attention tensors of one problem (host or device memory). */
typedef struct tensors {
  mtrain_tensor_t q, k, v, dout, o, lse, dq, dk, dv;
} tensors_t;

/* Tensor i in the order q, k, v, dout, o, lse, dq, dk, dv. */
static mtrain_tensor_t *tensor_at(tensors_t *t, int i) {
  mtrain_tensor_t *all[9] = {&t->q, &t->k, &t->v, &t->dout, &t->o, &t->lse, &t->dq, &t->dk, &t->dv};
  return all[i];
}

/* Bytes of a tensor's data. */
static size_t tensor_bytes(const mtrain_tensor_t *t) {
  return mtrain_dtype_size(t->dtype) * (size_t)mtrain_tensor_numel(t);
}

/* Shapes of a problem of n tokens (data NULL). */
static tensors_t shapes(const bench_opts_t *o, int64_t n) {
  tensors_t t;
  t.q = mtrain_tensor_3d(NULL, o->dtype, n, o->heads, o->head_dim);
  t.k = mtrain_tensor_3d(NULL, o->dtype, n, o->kv_heads, o->head_dim);
  t.v = t.k, t.dout = t.q, t.o = t.q, t.dq = t.q, t.dk = t.k, t.dv = t.k;
  t.lse = mtrain_tensor_2d(NULL, MTRAIN_F32, n, o->heads);
  return t;
}

/* Host buffers for every tensor; the inputs N(0, 1) from `seed`. */
static int host_alloc(const bench_opts_t *o, int64_t n, uint64_t seed, tensors_t *t) {
  *t = shapes(o, n);
  for (int i = 0; i < 9; i++) {
    mtrain_tensor_t *x = tensor_at(t, i);
    x->data = malloc(tensor_bytes(x) + 1);
    if (!x->data) {
      fprintf(stderr, "%s: out of host memory\n", prog);
      return 1;
    }
    if (i < 4 && tool_failed(prog, "inputs", mtrain_generate_normal(seed + (uint64_t)i, 1.0, x)))
      return 1;
  }
  return 0;
}

/* Frees host_alloc's buffers. */
static void host_free(tensors_t *t) {
  for (int i = 0; i < 9; i++) free(tensor_at(t, i)->data), tensor_at(t, i)->data = NULL;
}

/* Device buffers shaped like `host`; with `copy_inputs` the inputs are
 * copied from it. The outputs are poisoned (0xFF bytes: NaN). */
static int device_alloc(const tensors_t *host, int copy_inputs, tensors_t *dev) {
  *dev = *host;
  for (int i = 0; i < 9; i++) tensor_at(dev, i)->data = NULL;
  for (int i = 0; i < 9; i++) {
    mtrain_tensor_t *x = tensor_at(dev, i);
    const size_t bytes = tensor_bytes(x);
    if (tool_failed(prog, "device memory", mtrain_cuda_malloc(bytes, &x->data))) return 1;
    mtrain_status_t st =
        i < 4 ? (copy_inputs ? mtrain_cuda_memcpy_to_device(
                                   x->data, tensor_at((tensors_t *)host, i)->data, bytes)
                             : MTRAIN_SUCCESS)
              : mtrain_cuda_memset(x->data, 0xFF, bytes);
    if (tool_failed(prog, "device memory", st)) return 1;
  }
  return 0;
}

/* Frees device_alloc's buffers (NULL ones are skipped). */
static void device_free(tensors_t *t) {
  for (int i = 0; i < 9; i++) mtrain_cuda_free(tensor_at(t, i)->data), tensor_at(t, i)->data = NULL;
}

/* Forward, or forward then backward, on one set of tensors. */
static mtrain_status_t attention(mtrain_context_t *ctx, const mtrain_plan_t *plan, tensors_t *t,
                                 int backward) {
  mtrain_status_t st = mtrain_attention_forward(ctx, plan, &t->q, &t->k, &t->v, &t->o, &t->lse);
  if (st == MTRAIN_SUCCESS && backward)
    st = mtrain_attention_backward(ctx, plan, &t->q, &t->k, &t->v, &t->o, &t->lse, &t->dout, &t->dq,
                                   &t->dk, &t->dv);
  return st;
}

/* A "cuda" context on the stream with the variant, and its plan. */
static int cuda_context(const bench_opts_t *o, void *stream, int variant, const mtrain_pattern_t *p,
                        mtrain_context_t **ctx, mtrain_plan_t **plan) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = o->granularity;
  const mtrain_pattern_t *pats[1] = {p};
  *ctx = NULL, *plan = NULL;
  return tool_failed(prog, "cuda context", mtrain_context_create(&cfg, NULL, ctx)) ||
         tool_failed(prog, "mtrain_cuda_set_stream", mtrain_cuda_set_stream(*ctx, stream)) ||
         tool_failed(prog, "mtrain_cuda_set_variant",
                     mtrain_cuda_set_variant(*ctx, (mtrain_cuda_variant_t)variant)) ||
         tool_failed(prog, "plan", mtrain_plan_create(*ctx, NULL, pats, plan));
}

/* ---- validation ----------------------------------------------------------------- */

/* Creates a folder unless it exists; 1 on failure (message printed). */
static int make_dir(const char *path) {
  if (mkdir(path, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "%s: cannot create '%s': %s\n", prog, path, strerror(errno));
    return 1;
  }
  return 0;
}

/* Writes the validation problem of one pattern: inputs, pattern, meta. */
static int dump_problem(const bench_opts_t *o, int kind, const tensors_t *host,
                        const mtrain_pattern_t *p, long long pairs) {
  char dir[4096], path[4200];
  snprintf(dir, sizeof dir, "%s/%s", o->dump_dir, pattern_dirs[kind]);
  if (make_dir(o->dump_dir) || make_dir(dir)) return 1;
  static const char *const in_names[4] = {"q", "k", "v", "dout"};
  for (int i = 0; i < 4; i++) {
    snprintf(path, sizeof path, "%s/%s.npy", dir, in_names[i]);
    if (tool_failed(prog, path, run_write_f32(path, tensor_at((tensors_t *)host, i)))) return 1;
  }
  snprintf(path, sizeof path, "%s/pattern.json", dir);
  if (tool_failed(prog, path, mtrain_pattern_write_json(path, p))) return 1;
  json_t *j = json_object();
  json_object_set_new(j, "pattern", json_string(pattern_names[kind]));
  json_object_set_new(j, "seq_len", json_integer(host->q.shape[0]));
  json_object_set_new(j, "heads", json_integer(o->heads));
  json_object_set_new(j, "kv_heads", json_integer(o->kv_heads));
  json_object_set_new(j, "head_dim", json_integer(o->head_dim));
  json_object_set_new(j, "granularity", json_integer(o->granularity));
  json_object_set_new(j, "dtype", json_string(mtrain_dtype_name(o->dtype)));
  json_object_set_new(j, "softmax_scale", json_real(1.0 / sqrt((double)o->head_dim)));
  json_object_set_new(j, "computed_pairs", json_integer(pairs));
  snprintf(path, sizeof path, "%s/meta.json", dir);
  const int rc = json_dump_file(j, path, JSON_INDENT(2)) != 0;
  json_decref(j);
  if (rc) fprintf(stderr, "%s: cannot write %s\n", prog, path);
  return rc;
}

/* Writes one variant's outputs (o_v0.npy, lse_v0.npy, ...). */
static int dump_outputs(const bench_opts_t *o, int kind, int variant, const tensors_t *got) {
  char path[4200];
  for (int i = 0; i < 5; i++) {
    snprintf(path, sizeof path, "%s/%s/%s_v%d.npy", o->dump_dir, pattern_dirs[kind], out_names[i],
             variant);
    if (tool_failed(prog, path, run_write_f32(path, tensor_at((tensors_t *)got, 4 + i)))) return 1;
  }
  return 0;
}

/* Validates every selected variant on pattern `kind` at the validation
 * length against the "cpu" backend. Returns 1 on an error that stops the
 * run (a failed comparison only marks the cell invalid). */
static int validate(const bench_opts_t *o, int kind, bench_pattern_t *bp, void *stream,
                    bench_cell_t *cells) {
  const int64_t n = bp->small ? mtrain_pattern_seq_len(bp->small) : 0;
  tensors_t ref, got, dev;
  memset(&dev, 0, sizeof dev);
  int rc = host_alloc(o, n, o->seed + 100, &ref) || host_alloc(o, n, o->seed + 100, &got);
  /* the reference: the cpu backend on the host */
  if (!rc) {
    mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
    cfg.backend = "cpu";
    cfg.granularity = o->granularity;
    mtrain_context_t *ctx = NULL;
    mtrain_plan_t *plan = NULL;
    const mtrain_pattern_t *pats[1] = {bp->small};
    rc = tool_failed(prog, "cpu context", mtrain_context_create(&cfg, NULL, &ctx)) ||
         tool_failed(prog, "cpu plan", mtrain_plan_create(ctx, NULL, pats, &plan)) ||
         tool_failed(prog, "cpu reference", attention(ctx, plan, &ref, 1));
    mtrain_plan_destroy(plan);
    mtrain_context_destroy(ctx);
  }
  if (!rc && o->dump_dir) rc = dump_problem(o, kind, &ref, bp->small, bp->small_pairs);
  if (!rc) rc = device_alloc(&ref, 1, &dev);
  /* cuda against cpu, two approximations: twice the tools' bound
   * (tool_common.h; 8 unit roundoffs of bf16/fp16, 2e-4 for fp32) */
  const double rel = tool_check_tolerance_between(o->dtype);
  for (int v = 0; v < NUM_VARIANTS && !rc; v++) {
    if (!o->variant_on[v]) continue;
    bench_cell_t *c = &cells[v];
    c->tried = 1;
    mtrain_context_t *ctx = NULL;
    mtrain_plan_t *plan = NULL;
    fprintf(stderr, "%s: validating variant %d on %s, N=%lld\n", prog, v, pattern_names[kind],
            (long long)n);
    for (int i = 4; i < 9; i++) /* poison the outputs: an unwritten element fails */
      mtrain_cuda_memset(tensor_at(&dev, i)->data, 0xFF, tensor_bytes(tensor_at(&dev, i)));
    rc = cuda_context(o, stream, v, bp->small, &ctx, &plan);
    mtrain_status_t st = rc ? MTRAIN_SUCCESS : attention(ctx, plan, &dev, 1);
    const int ran = rc ? -1 : mtrain_cuda_last_variant(ctx);
    if (!rc && st != MTRAIN_SUCCESS) {
      /* a variant that cannot compute this shape is reported, not timed */
      c->unsupported = st == MTRAIN_ERR_NOT_SUPPORTED || st == MTRAIN_ERR_UNSUPPORTED_DTYPE ||
                       st == MTRAIN_ERR_UNSUPPORTED_HEAD_DIM;
      fprintf(stderr, "%s: variant %d on %s: %s: %s%s\n", prog, v, pattern_names[kind],
              mtrain_status_name(st), mtrain_last_error(),
              c->unsupported ? " (not timed)" : " (FAILED, not timed)");
    } else if (!rc) {
      for (int i = 4; i < 9 && !rc; i++)
        rc = tool_failed(prog, "copying an output to the host",
                         mtrain_cuda_memcpy_to_host(tensor_at(&got, i)->data,
                                                    tensor_at(&dev, i)->data,
                                                    tensor_bytes(tensor_at(&dev, i))));
      int ok = !rc && ran == v;
      if (!rc && ran != v)
        fprintf(stderr, "%s: variant %d was asked for, variant %d ran\n", prog, v, ran);
      for (int i = 0; i < 5 && !rc; i++) {
        double ref_max = 0.0;
        run_compare(tensor_at(&got, 4 + i), tensor_at(&ref, 4 + i), &c->err[i], &ref_max);
        c->bound[i] = rel * ref_max;
        if (!(c->err[i] <= c->bound[i])) ok = 0;
      }
      c->valid = ok;
      if (!rc && o->dump_dir) rc = dump_outputs(o, kind, v, &got);
      fprintf(stderr,
              "%s: variant %d on %s: %s (max|cuda - cpu| / bound: o %.2g/%.2g lse %.2g/%.2g dq "
              "%.2g/%.2g dk %.2g/%.2g dv %.2g/%.2g)\n",
              prog, v, pattern_names[kind], ok ? "ok" : "FAILED", c->err[0], c->bound[0], c->err[1],
              c->bound[1], c->err[2], c->bound[2], c->err[3], c->bound[3], c->err[4], c->bound[4]);
    }
    mtrain_plan_destroy(plan);
    mtrain_context_destroy(ctx);
  }
  device_free(&dev);
  host_free(&ref);
  host_free(&got);
  return rc;
}

/* ---- timing --------------------------------------------------------------------- */

/* Median milliseconds of `reps` runs (forward, or forward+backward) timed
 * with events on the stream, alternating between the two input sets. */
static int time_runs(const bench_opts_t *o, mtrain_context_t *ctx, const mtrain_plan_t *plan,
                     tensors_t *sets, void *stream, int backward, double *ms) {
  cudaEvent_t ev[2];
  if (cuda_failed("cudaEventCreate", cudaEventCreate(&ev[0]))) return 1;
  if (cuda_failed("cudaEventCreate", cudaEventCreate(&ev[1]))) {
    cudaEventDestroy(ev[0]);
    return 1;
  }
  double *t = malloc(sizeof(double) * (size_t)o->reps);
  int rc = t == NULL;
  for (int r = 0; r < o->reps && !rc; r++) {
    float elapsed = 0.0f;
    rc = cuda_failed("cudaEventRecord", cudaEventRecord(ev[0], (cudaStream_t)stream)) ||
         tool_failed(prog, backward ? "forward+backward" : "forward",
                     attention(ctx, plan, &sets[r % 2], backward)) ||
         cuda_failed("cudaEventRecord", cudaEventRecord(ev[1], (cudaStream_t)stream)) ||
         cuda_failed("cudaEventSynchronize", cudaEventSynchronize(ev[1])) ||
         cuda_failed("cudaEventElapsedTime", cudaEventElapsedTime(&elapsed, ev[0], ev[1]));
    if (!rc) t[r] = elapsed;
  }
  if (!rc) *ms = tool_median(t, o->reps);
  free(t);
  cudaEventDestroy(ev[0]);
  cudaEventDestroy(ev[1]);
  return rc;
}

/* Times every validated variant on pattern `kind` at the full length. */
static int time_pattern(const bench_opts_t *o, int kind, bench_pattern_t *bp, tensors_t *sets,
                        void *stream, bench_cell_t *cells) {
  int rc = 0;
  for (int v = 0; v < NUM_VARIANTS && !rc; v++) {
    bench_cell_t *c = &cells[v];
    if (!c->tried || !c->valid) continue;
    mtrain_context_t *ctx = NULL;
    mtrain_plan_t *plan = NULL;
    rc = cuda_context(o, stream, v, bp->big, &ctx, &plan);
    if (!rc && mtrain_plan_computed_pairs(plan) != bp->pairs) {
      fprintf(stderr, "%s: the cuda plan computes %lld pairs, the cpu plan %lld\n", prog,
              (long long)mtrain_plan_computed_pairs(plan), bp->pairs);
      rc = 1;
    }
    fprintf(stderr, "%s: timing variant %d on %s, N=%lld: %d warm-up, %d runs\n", prog, v,
            pattern_names[kind], (long long)o->seq_len, o->warmup, o->reps);
    for (int w = 0; w < o->warmup && !rc; w++)
      rc = tool_failed(prog, "warm-up", attention(ctx, plan, &sets[w % 2], 1));
    if (!rc) rc = time_runs(o, ctx, plan, sets, stream, 0, &c->fwd_ms);
    if (!rc) rc = time_runs(o, ctx, plan, sets, stream, 1, &c->fb_ms);
    if (!rc && mtrain_cuda_last_variant(ctx) != v) {
      fprintf(stderr, "%s: variant %d was asked for, variant %d ran\n", prog, v,
              mtrain_cuda_last_variant(ctx));
      rc = 1;
    }
    if (!rc) {
      const double flops = tool_fwd_flops(bp->pairs, o->head_dim);
      c->fwd_tflops = flops / (c->fwd_ms * 1e-3) * 1e-12;
      c->fb_tflops = 3.5 * flops / (c->fb_ms * 1e-3) * 1e-12;
      c->timed = 1;
    }
    mtrain_plan_destroy(plan);
    mtrain_context_destroy(ctx);
  }
  return rc;
}

/* ---- report --------------------------------------------------------------------- */

/* The results table on stdout. */
static void print_table(const bench_opts_t *o, const char *device, const bench_pattern_t *bp,
                        bench_cell_t cells[NUM_PATTERNS][NUM_VARIANTS]) {
  printf("mtrain-bench-cuda: %s, N=%lld Hq=%d Hkv=%d d=%d G=%d %s causal; median of %d runs "
         "after %d warm-up, CUDA events\n",
         device, (long long)o->seq_len, o->heads, o->kv_heads, o->head_dim, o->granularity,
         mtrain_dtype_name(o->dtype), o->reps, o->warmup);
  printf("effective FLOPs: forward 4*d*pairs, forward+backward 3.5x that (SPEC.md section 6)\n");
  printf("%-15s %9s %7s %11s %10s %11s %12s %11s\n", "pattern", "density", "variant", "check",
         "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "TFLOP/s");
  for (int k = 0; k < NUM_PATTERNS; k++) {
    if (!o->pattern_on[k]) continue;
    for (int v = 0; v < NUM_VARIANTS; v++) {
      const bench_cell_t *c = &cells[k][v];
      if (!c->tried) continue;
      if (c->timed)
        printf("%-15s %8.2f%% %7d %11s %10.3f %11.1f %12.3f %11.1f\n", pattern_names[k],
               100.0 * bp[k].density, v, "ok", c->fwd_ms, c->fwd_tflops, c->fb_ms, c->fb_tflops);
      else
        printf("%-15s %8.2f%% %7d %11s %10s %11s %12s %11s\n", pattern_names[k],
               100.0 * bp[k].density, v,
               c->unsupported ? "unsupported"
               : c->valid     ? "ok"
                              : "FAILED",
               "-", "-", "-", "-");
    }
  }
}

/* The results as one JSON object in --json's file. */
static int write_json(const bench_opts_t *o, const char *device, const bench_pattern_t *bp,
                      bench_cell_t cells[NUM_PATTERNS][NUM_VARIANTS]) {
  json_t *j = json_object(), *arr = json_array();
  json_object_set_new(j, "device", json_string(device));
  json_object_set_new(j, "seq_len", json_integer(o->seq_len));
  json_object_set_new(j, "heads", json_integer(o->heads));
  json_object_set_new(j, "kv_heads", json_integer(o->kv_heads));
  json_object_set_new(j, "head_dim", json_integer(o->head_dim));
  json_object_set_new(j, "granularity", json_integer(o->granularity));
  json_object_set_new(j, "dtype", json_string(mtrain_dtype_name(o->dtype)));
  json_object_set_new(j, "reps", json_integer(o->reps));
  json_object_set_new(j, "warmup", json_integer(o->warmup));
  json_object_set_new(j, "validate_len", json_integer(o->validate_len));
  json_object_set_new(j, "flops", json_string("forward 4*d*pairs; forward+backward 3.5x"));
  if (o->src.budgets_path) {
    json_object_set_new(j, "budgets", json_string(o->src.budgets_path));
    json_object_set_new(j, "layer", json_integer(o->src.layer));
  } else {
    json_object_set_new(j, "v_size", json_integer(o->src.v_size));
    json_object_set_new(j, "s_size", json_integer(o->src.s_size));
  }
  if (o->pattern_out) json_object_set_new(j, "pattern_file", json_string(o->pattern_out));
  for (int k = 0; k < NUM_PATTERNS; k++) {
    if (!o->pattern_on[k]) continue;
    for (int v = 0; v < NUM_VARIANTS; v++) {
      const bench_cell_t *c = &cells[k][v];
      if (!c->tried) continue;
      json_t *e = json_object(), *val = json_object();
      json_object_set_new(e, "pattern", json_string(pattern_names[k]));
      json_object_set_new(e, "variant", json_integer(v));
      json_object_set_new(e, "computed_pairs", json_integer(bp[k].pairs));
      json_object_set_new(e, "density", json_real(bp[k].density));
      json_object_set_new(e, "validated", json_boolean(c->valid));
      json_object_set_new(e, "unsupported", json_boolean(c->unsupported));
      for (int i = 0; i < 5; i++) {
        json_t *x = json_object();
        json_object_set_new(x, "max_abs_error_vs_cpu", json_real(c->err[i]));
        json_object_set_new(x, "bound", json_real(c->bound[i]));
        json_object_set_new(val, out_names[i], x);
      }
      json_object_set_new(e, "validation", val);
      if (c->timed) {
        json_object_set_new(e, "forward_ms", json_real(c->fwd_ms));
        json_object_set_new(e, "forward_tflops", json_real(c->fwd_tflops));
        json_object_set_new(e, "forward_backward_ms", json_real(c->fb_ms));
        json_object_set_new(e, "forward_backward_tflops", json_real(c->fb_tflops));
      }
      json_array_append_new(arr, e);
    }
  }
  json_object_set_new(j, "results", arr);
  const int rc = json_dump_file(j, o->json_path, JSON_INDENT(2) | JSON_REAL_PRECISION(6)) != 0;
  json_decref(j);
  if (rc) fprintf(stderr, "%s: cannot write %s\n", prog, o->json_path);
  return rc;
}

/* ---- main ----------------------------------------------------------------------- */

int main(int argc, char **argv) {
  bench_opts_t o;
  const int prc = parse(argc, argv, &o);
  if (prc) return prc == 2 ? 0 : 2;
  bench_pattern_t bp[NUM_PATTERNS];
  bench_cell_t cells[NUM_PATTERNS][NUM_VARIANTS];
  memset(bp, 0, sizeof bp);
  memset(cells, 0, sizeof cells);
  const double dense_pairs = (double)o.heads * (double)o.seq_len * (double)(o.seq_len + 1) / 2;
  int rc = 0;

  /* a device first: fail early */
  if (mtrain_cuda_device_count() == 0) {
    fprintf(stderr, "%s: no CUDA device is visible (or this build has no cuda backend)\n", prog);
    return 1;
  }

  /* the patterns (host only) */
  for (int k = 0; k < NUM_PATTERNS && !rc; k++) {
    if (!o.pattern_on[k]) continue;
    fprintf(stderr, "%s: building the %s pattern (N=%lld and %lld)\n", prog, pattern_names[k],
            (long long)o.seq_len, (long long)o.validate_len);
    rc = build_pattern(&o, k, o.seq_len, &bp[k].big) ||
         build_pattern(&o, k, o.validate_len, &bp[k].small) ||
         count_pairs(&o, bp[k].big, &bp[k].pairs) ||
         count_pairs(&o, bp[k].small, &bp[k].small_pairs);
    if (!rc) {
      bp[k].density = (double)bp[k].pairs / dense_pairs;
      const double nv = (double)o.validate_len;
      fprintf(stderr,
              "%s: %s pattern: %lld of %.0f causal pairs, density %.2f%% (sparsity %.2f%%); "
              "validation pattern (N=%lld): density %.2f%%\n",
              prog, pattern_names[k], bp[k].pairs, dense_pairs, 100.0 * bp[k].density,
              100.0 * (1.0 - bp[k].density), (long long)o.validate_len,
              100.0 * (double)bp[k].small_pairs / ((double)o.heads * nv * (nv + 1) / 2));
    }
  }
  if (!rc && o.pattern_out && o.pattern_on[PAT_VS])
    rc = tool_failed(prog, o.pattern_out, mtrain_pattern_write_json(o.pattern_out, bp[PAT_VS].big));

  /* the device */
  char device[256] = "no device";
  cudaStream_t stream = NULL;
  if (!rc) rc = tool_failed(prog, "--device", mtrain_cuda_set_device(o.device));
  if (!rc) {
    struct cudaDeviceProp prop;
    rc = cuda_failed("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, o.device));
    if (!rc) snprintf(device, sizeof device, "%s", prop.name);
  }
  if (!rc)
    rc = cuda_failed("cudaStreamCreate", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  /* validation, then timing */
  for (int k = 0; k < NUM_PATTERNS && !rc; k++)
    if (o.pattern_on[k]) rc = validate(&o, k, &bp[k], stream, cells[k]);
  tensors_t host[2], sets[2];
  memset(host, 0, sizeof host), memset(sets, 0, sizeof sets);
  int to_time = 0;
  for (int k = 0; k < NUM_PATTERNS; k++)
    for (int v = 0; v < NUM_VARIANTS; v++) to_time |= cells[k][v].valid;
  if (!rc && to_time) {
    fprintf(stderr, "%s: generating two input sets of N=%lld\n", prog, (long long)o.seq_len);
    for (int s = 0; s < 2 && !rc; s++) {
      rc = host_alloc(&o, o.seq_len, o.seed + 10 * (uint64_t)s, &host[s]) ||
           device_alloc(&host[s], 1, &sets[s]);
      host_free(&host[s]);
    }
    /* the second set shares the first one's outputs */
    if (!rc)
      for (int i = 4; i < 9; i++) {
        mtrain_cuda_free(tensor_at(&sets[1], i)->data);
        tensor_at(&sets[1], i)->data = tensor_at(&sets[0], i)->data;
      }
  }
  for (int k = 0; k < NUM_PATTERNS && !rc; k++)
    if (o.pattern_on[k]) rc = time_pattern(&o, k, &bp[k], sets, stream, cells[k]);
  for (int i = 4; i < 9; i++) tensor_at(&sets[1], i)->data = NULL;
  device_free(&sets[0]);
  device_free(&sets[1]);

  int all_valid = 1;
  for (int k = 0; k < NUM_PATTERNS; k++)
    for (int v = 0; v < NUM_VARIANTS; v++)
      if (cells[k][v].tried && !cells[k][v].valid && !cells[k][v].unsupported) all_valid = 0;
  if (!rc) {
    print_table(&o, device, bp, cells);
    if (o.json_path) rc = write_json(&o, device, bp, cells);
  }
  if (stream) cudaStreamDestroy(stream);
  for (int k = 0; k < NUM_PATTERNS; k++) {
    mtrain_pattern_destroy(bp[k].big);
    mtrain_pattern_destroy(bp[k].small);
  }
  if (rc) return 1;
  if (!all_valid) {
    fprintf(stderr, "%s: a variant failed its validation and was not timed\n", prog);
    return 3;
  }
  return 0;
}
