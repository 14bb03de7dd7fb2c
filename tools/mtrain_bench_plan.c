/* mtrain_bench_plan.c: the host side of a training step's pattern and plan
 * (issue 20), timed per layer as training pays it: for every chosen layer of
 * a budget file, on structured inputs of --tokens tokens, the online
 * estimate (its scoring on the backend and its selection on the host,
 * mtrain_estimate_last_times), the plan of every --world size (W = 1:
 * mtrain_plan_create; W > 1: mtrain_plan_create_ring for one rank, built in
 * this process with the planning communicator) and, with --cuda-step, the
 * host tables the cuda backend makes from each step of that plan, forward
 * and backward (the backend's own packing, backends/cuda/cuda_step_tables.c:
 * the host work only, no device). One cold call, then --steps warm calls;
 * the table gives the medians, --json all of it. Exit 0 on success (and after
 * --help), 1 when the work fails, 2 on a bad command line. */
#include <getopt.h>
#include <jansson.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/plan_internal.h"
#include "core/runtime/select.h"
#include "mtrain/mtrain.h"
#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_layout.h"
#include "tool_common.h"

#include "backends/cuda/cuda_step_tables.h"
#include "mtrain/mtrain_error.h"

static const char *prog = "mtrain-bench-plan";

enum { MAX_WORLDS = 16 };

typedef struct opts {
  const char *budgets, *json, *layers, *layout, *backend;
  int64_t tokens;
  int32_t granularity, kv_heads, head_dim, last_q, steps, threads, rank, ranks_per_node;
  int32_t worlds[MAX_WORLDS], num_worlds;
  int cuda_step;
  mtrain_dtype_t dtype;
} opts_t;

static void usage(FILE *f) {
  fprintf(f,
          "usage: %s [options]\n"
          "Times, per layer of a budget file, what a training step does on the host before\n"
          "its sparse attention: the online estimate (scoring on --backend, selection\n"
          "on the host), the plan for each world size and (--cuda-step) the host tables\n"
          "of the cuda backend's step upload. One cold call, then --steps warm.\n"
          "  --budgets FILE        budget file (default "
          "data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json)\n"
          "  --layers LIST         all (default) or a comma list of layers and ranges (0,5-7)\n"
          "  --tokens N            sequence length (default 131072)\n"
          "  --granularity G       block size (default 128)\n"
          "  --kv-heads H          kv heads of the inputs (default 2; query heads: the file's)\n"
          "  --head-dim D          head dimension (default 128)\n"
          "  --dtype T             storage dtype of q and k: fp32, bf16 (default), fp16\n"
          "  --last-q L            the estimate's last queries (default 64)\n"
          "  --world LIST          world sizes to plan for, comma list (default 1); W > 1 builds\n"
          "                        rank --rank's ring plan in this process\n"
          "  --rank R              the rank planned for W > 1 (default 0)\n"
          "  --layout KIND         contiguous, zigzag, striped (default) or balanced\n"
          "  --ranks-per-node P    hierarchical ring with P ranks per node (default 0: flat)\n"
          "  --steps S             warm repetitions after the cold one (default 3)\n"
          "  --threads T           OpenMP threads (default: OpenMP's)\n"
          "  --cuda-step           also time the cuda step tables of every plan step, forward\n"
          "                        and backward (the backend's host packing, no GPU needed)\n"
          "  --backend NAME        backend of the estimate's scoring: cpu (default) or cuda\n"
          "                        (q and k copied to the device once; plans stay on the host)\n"
          "  --json FILE           write every time to FILE\n"
          "  --help                this text\n",
          prog);
}

static int parse_i64(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out) {
  char *end = NULL;
  long long v = strtoll(s, &end, 10);
  if (!*s || *end || v < lo || v > hi) {
    fprintf(stderr, "%s: --%s %s: expected an integer in [%lld, %lld]\n", prog, name, s,
            (long long)lo, (long long)hi);
    return 1;
  }
  *out = v;
  return 0;
}

static int parse_i32(const char *name, const char *s, int32_t lo, int32_t hi, int32_t *out) {
  int64_t v = 0;
  if (parse_i64(name, s, lo, hi, &v)) return 1;
  *out = (int32_t)v;
  return 0;
}

static int parse_worlds(const char *s, opts_t *o) {
  char *copy = strdup(s), *save = NULL;
  int bad = copy == NULL;
  o->num_worlds = 0;
  for (char *t = copy ? strtok_r(copy, ",", &save) : NULL; t && !bad;
       t = strtok_r(NULL, ",", &save)) {
    if (o->num_worlds == MAX_WORLDS) {
      fprintf(stderr, "%s: --world: at most %d sizes\n", prog, MAX_WORLDS);
      bad = 1;
      break;
    }
    bad = parse_i32("world", t, 1, 4096, &o->worlds[o->num_worlds++]);
  }
  free(copy);
  return bad || o->num_worlds == 0;
}

/* Marks the layers of LIST ("all", or "a,b-c") in use[0..n). */
static int parse_layers(const char *s, int32_t n, uint8_t *use) {
  if (!strcmp(s, "all")) {
    memset(use, 1, (size_t)n);
    return 0;
  }
  memset(use, 0, (size_t)n);
  char *copy = strdup(s), *save = NULL;
  int bad = copy == NULL;
  for (char *t = copy ? strtok_r(copy, ",", &save) : NULL; t && !bad;
       t = strtok_r(NULL, ",", &save)) {
    char *dash = strchr(t, '-');
    int32_t a = 0, b = 0;
    if (dash) *dash = 0;
    bad = parse_i32("layers", t, 0, n - 1, &a);
    b = a;
    if (!bad && dash) bad = parse_i32("layers", dash + 1, a, n - 1, &b);
    for (int32_t l = a; !bad && l <= b; l++) use[l] = 1;
  }
  free(copy);
  return bad;
}

static int parse(int argc, char **argv, opts_t *o) {
  static const struct option table[] = {{"budgets", required_argument, 0, 'b'},
                                        {"layers", required_argument, 0, 'l'},
                                        {"tokens", required_argument, 0, 'n'},
                                        {"granularity", required_argument, 0, 'G'},
                                        {"kv-heads", required_argument, 0, 'k'},
                                        {"head-dim", required_argument, 0, 'd'},
                                        {"dtype", required_argument, 0, 't'},
                                        {"last-q", required_argument, 0, 'L'},
                                        {"world", required_argument, 0, 'W'},
                                        {"rank", required_argument, 0, 'r'},
                                        {"layout", required_argument, 0, 'y'},
                                        {"ranks-per-node", required_argument, 0, 'P'},
                                        {"steps", required_argument, 0, 's'},
                                        {"threads", required_argument, 0, 'T'},
                                        {"cuda-step", no_argument, 0, 'c'},
                                        {"json", required_argument, 0, 'j'},
                                        {"backend", required_argument, 0, 'B'},
                                        {"help", no_argument, 0, 'h'},
                                        {0, 0, 0, 0}};
  memset(o, 0, sizeof *o);
  o->budgets = "data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json";
  o->layers = "all";
  o->layout = "striped";
  o->backend = "cpu";
  o->tokens = 131072;
  o->granularity = 128;
  o->kv_heads = 2;
  o->head_dim = 128;
  o->last_q = 64;
  o->steps = 3;
  o->worlds[0] = 1;
  o->num_worlds = 1;
  o->dtype = MTRAIN_BF16;
  int c, bad = 0;
  opterr = 0;
  while (!bad && (c = getopt_long(argc, argv, "", table, NULL)) != -1) {
    switch (c) {
    case 'b':
      o->budgets = optarg;
      break;
    case 'l':
      o->layers = optarg;
      break;
    case 'n':
      bad = parse_i64("tokens", optarg, 1, (int64_t)1 << 40, &o->tokens);
      break;
    case 'G':
      bad = parse_i32("granularity", optarg, 1, 1 << 20, &o->granularity);
      break;
    case 'k':
      bad = parse_i32("kv-heads", optarg, 1, 1024, &o->kv_heads);
      break;
    case 'd':
      bad = parse_i32("head-dim", optarg, 1, 1024, &o->head_dim);
      break;
    case 't':
      bad = mtrain_dtype_parse(optarg, &o->dtype) != MTRAIN_SUCCESS;
      if (bad) fprintf(stderr, "%s: --dtype %s: unknown dtype\n", prog, optarg);
      break;
    case 'L':
      bad = parse_i32("last-q", optarg, 1, 1 << 20, &o->last_q);
      break;
    case 'W':
      bad = parse_worlds(optarg, o);
      break;
    case 'r':
      bad = parse_i32("rank", optarg, 0, 4095, &o->rank);
      break;
    case 'y':
      o->layout = optarg;
      break;
    case 'P':
      bad = parse_i32("ranks-per-node", optarg, 0, 4096, &o->ranks_per_node);
      break;
    case 's':
      bad = parse_i32("steps", optarg, 1, 1000, &o->steps);
      break;
    case 'T':
      bad = parse_i32("threads", optarg, 1, 1024, &o->threads);
      break;
    case 'c':
      o->cuda_step = 1;
      break;
    case 'j':
      o->json = optarg;
      break;
    case 'B':
      o->backend = optarg;
      break;
    case 'h':
      usage(stdout);
      exit(0);
    default:
      fprintf(stderr, "%s: unknown or incomplete option '%s' (see --help)\n", prog,
              argv[optind - 1]);
      bad = 1;
    }
  }
  if (!bad && optind < argc) {
    fprintf(stderr, "%s: unexpected argument '%s'\n", prog, argv[optind]);
    bad = 1;
  }
  for (int i = 0; !bad && i < o->num_worlds; i++)
    if (o->worlds[i] > 1 && o->rank >= o->worlds[i]) {
      fprintf(stderr, "%s: --rank %d is not a rank of world size %d\n", prog, o->rank,
              o->worlds[i]);
      bad = 1;
    }
  return bad;
}

/* ---- timing ---------------------------------------------------------------- */

/* One quantity: the cold call and the warm ones. */
typedef struct timing {
  double cold;
  double *warm; /* [steps] */
} timing_t;

static double warm_median(const timing_t *t, int n) {
  double *v = malloc(sizeof(double) * (size_t)n);
  if (!v) return 0.0;
  memcpy(v, t->warm, sizeof(double) * (size_t)n);
  const double m = tool_median(v, n);
  free(v);
  return m;
}

static void timing_put(timing_t *t, int call, double s) {
  if (call == 0)
    t->cold = s;
  else
    t->warm[call - 1] = s;
}

static json_t *timing_json(const timing_t *t, int n) {
  json_t *warm = json_array();
  for (int i = 0; i < n; i++) json_array_append_new(warm, json_real(t->warm[i]));
  return json_pack("{s:f, s:f, s:o}", "cold_s", t->cold, "warm_median_s", warm_median(t, n),
                   "warm_s", warm);
}

/* The per-layer results. */
typedef struct layer_result {
  int32_t layer;
  timing_t estimate, scores, select, stages, copies, reduce;
  timing_t plan[MAX_WORLDS], cuda[MAX_WORLDS];
  int64_t pairs[MAX_WORLDS], diagonals, verticals;
  double density; /* computed pairs / causal pairs of W = 1 */
} layer_result_t;

/* Packs one step view as the cuda backend does before its kernels
 * (cuda_step_tables.c, the backend's own code), into a reused buffer. */
static mtrain_status_t pack_step(const mtrain_step_view_t *v, int32_t hkv, int backward, char **buf,
                                 size_t *cap) {
  cuda_step_tables_t t;
  mtrain_status_t st = cuda_step_tables_size(v, hkv, backward, &t);
  if (st) return st;
  if (t.bytes > *cap) {
    char *p = realloc(*buf, t.bytes);
    if (!p) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda step tables: out of memory");
    *buf = p;
    *cap = t.bytes;
  }
  return cuda_step_tables_pack(v, hkv, backward, *buf, &t);
}

/* The cuda backend's host work for every step of a plan: the forward and
 * the backward tables. */
static mtrain_status_t time_cuda_steps(const mtrain_plan_t *plan, int32_t hkv, double *seconds) {
  char *buf = NULL;
  size_t cap = 0;
  mtrain_status_t st = MTRAIN_SUCCESS;
  const double t0 = tool_now();
  for (int32_t s = 0; s < plan->num_seqs && !st; s++)
    for (int32_t t = 0; t < plan->num_steps && !st; t++)
      for (int backward = 0; backward < 2 && !st; backward++) {
        st = pack_step(&plan->seqs[s].steps[t].view, hkv, backward, &buf, &cap);
        if (!st && plan->seqs[s].bar_steps)
          st = pack_step(&plan->seqs[s].bar_steps[t].view, hkv, backward, &buf, &cap);
      }
  *seconds = tool_now() - t0;
  free(buf);
  return st;
}

/* The plan of world size W (rank o->rank), timed, and its cuda step tables. */
static int plan_once(const opts_t *o, const mtrain_pattern_t *p, int32_t W, double *t_plan,
                     double *t_cuda, int64_t *pairs) {
  mtrain_comm_t *comm = NULL;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = o->granularity;
  cfg.num_threads = o->threads;
  mtrain_context_t *ctx = NULL;
  mtrain_layout_t *layout = NULL;
  mtrain_plan_t *plan = NULL;
  int rc = tool_failed(prog, "planning communicator",
                       mtrain_comm_create_planning(W > 1 ? o->rank : 0, W, &comm)) ||
           tool_failed(prog, "context", mtrain_context_create(&cfg, W > 1 ? comm : NULL, &ctx));
  mtrain_layout_kind_t kind = MTRAIN_LAYOUT_STRIPED;
  if (!rc && W > 1)
    rc = tool_failed(prog, "--layout", mtrain_layout_kind_parse(o->layout, &kind)) ||
         tool_failed(prog, "layout",
                     mtrain_layout_create(kind, o->tokens, o->granularity, W, NULL, &layout));
  if (!rc) {
    const double t0 = tool_now();
    rc = tool_failed(
        prog, "plan",
        W > 1 ? mtrain_plan_create_ring(ctx, NULL, (const mtrain_layout_t *const[]){layout},
                                        o->ranks_per_node, (const mtrain_pattern_t *const[]){p},
                                        &plan)
              : mtrain_plan_create(ctx, NULL, (const mtrain_pattern_t *const[]){p}, &plan));
    *t_plan = tool_now() - t0;
  }
  if (!rc) *pairs = mtrain_plan_computed_pairs(plan);
  if (!rc && o->cuda_step)
    rc = tool_failed(prog, "cuda step tables", time_cuda_steps(plan, o->kv_heads, t_cuda));
  mtrain_plan_destroy(plan);
  mtrain_layout_destroy(layout);
  mtrain_context_destroy(ctx);
  mtrain_comm_destroy(comm);
  return rc;
}

/* The inputs: structured q, k (and v, which the generator fills) of N tokens. */
typedef struct inputs {
  mtrain_tensor_t q, k, v;
  mtrain_tensor_t dq, dk; /* device copies of q and k (--backend cuda), else NULL data */
} inputs_t;

static void inputs_free(inputs_t *in) {
  free(in->q.data);
  free(in->k.data);
  free(in->v.data);
  mtrain_cuda_free(in->dq.data);
  mtrain_cuda_free(in->dk.data);
}

/* Device copy of a host tensor (same shape and dtype). */
static int to_device(const mtrain_tensor_t *h, mtrain_tensor_t *d) {
  const size_t bytes = (size_t)mtrain_tensor_numel(h) * mtrain_dtype_size(h->dtype);
  *d = *h;
  d->data = NULL;
  return tool_failed(prog, "device copy", mtrain_cuda_malloc(bytes, &d->data)) ||
         tool_failed(prog, "device copy", mtrain_cuda_memcpy_to_device(d->data, h->data, bytes));
}

static int inputs_make(const opts_t *o, int32_t heads, inputs_t *in) {
  const size_t es = mtrain_dtype_size(o->dtype), N = (size_t)o->tokens;
  memset(in, 0, sizeof *in);
  in->q = mtrain_tensor_3d(malloc(N * (size_t)heads * o->head_dim * es), o->dtype, o->tokens, heads,
                           o->head_dim);
  in->k = mtrain_tensor_3d(malloc(N * (size_t)o->kv_heads * o->head_dim * es), o->dtype, o->tokens,
                           o->kv_heads, o->head_dim);
  in->v = mtrain_tensor_3d(malloc(N * (size_t)o->kv_heads * o->head_dim * es), o->dtype, o->tokens,
                           o->kv_heads, o->head_dim);
  if (!in->q.data || !in->k.data || !in->v.data) {
    fprintf(stderr, "%s: out of memory for the inputs\n", prog);
    return 1;
  }
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  return tool_failed(prog, "inputs", mtrain_generate_structured(&so, &in->q, &in->k, &in->v));
}

/* One layer: cold + warm estimates and plans. */
static int run_layer(const opts_t *o, mtrain_context_t *ctx, const mtrain_budgets_t *file,
                     int32_t layer, const inputs_t *in, layer_result_t *r) {
  const int32_t heads = (int32_t)in->q.shape[1];
  mtrain_head_budget_t *b = calloc((size_t)heads, sizeof *b);
  int rc = b == NULL;
  for (int32_t h = 0; h < heads && !rc; h++)
    rc = tool_failed(prog, o->budgets, mtrain_budgets_get(file, layer, h, &b[h]));
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = o->last_q;
  r->layer = layer;
  for (int call = 0; call <= o->steps && !rc; call++) {
    mtrain_pattern_t *p = NULL;
    const double t0 = tool_now();
    const int dev = in->dq.data != NULL;
    rc = tool_failed(
        prog, "estimate",
        mtrain_pattern_estimate(ctx, dev ? &in->dq : &in->q, dev ? &in->dk : &in->k, b, &eo, &p));
    const double t1 = tool_now();
    const mtrain_estimate_times_t et = mtrain_estimate_last_times();
    timing_put(&r->estimate, call, t1 - t0);
    timing_put(&r->scores, call, et.scores);
    timing_put(&r->select, call, et.select);
    timing_put(&r->stages, call, et.stages);
    timing_put(&r->copies, call, et.copies);
    timing_put(&r->reduce, call, et.reduce);
    for (int w = 0; w < o->num_worlds && !rc; w++) {
      double tp = 0.0, tc = 0.0;
      rc = plan_once(o, p, o->worlds[w], &tp, &tc, &r->pairs[w]);
      timing_put(&r->plan[w], call, tp);
      timing_put(&r->cuda[w], call, tc);
    }
    if (!rc && call == 0) {
      r->diagonals = r->verticals = 0;
      for (int32_t h = 0; h < heads; h++) {
        int32_t nd = 0, nv = 0;
        mtrain_pattern_get_head(p, h, NULL, &nd, NULL, &nv);
        r->diagonals += nd;
        r->verticals += nv;
      }
      const double causal = (double)o->tokens * (double)(o->tokens + 1) / 2 * heads;
      r->density = o->worlds[0] == 1 ? (double)r->pairs[0] / causal : 0.0;
    }
    mtrain_pattern_destroy(p);
  }
  free(b);
  return rc;
}

static int timing_alloc(timing_t *t, int n) {
  t->warm = calloc((size_t)n, sizeof(double));
  return t->warm == NULL;
}

int main(int argc, char **argv) {
  opts_t o;
  if (parse(argc, argv, &o)) return 2;
  if (o.threads) omp_set_num_threads(o.threads);
  mtrain_budgets_t *file = NULL;
  if (tool_failed(prog, o.budgets, mtrain_budgets_read(o.budgets, &file))) return 1;
  const int32_t nl = mtrain_budgets_num_layers(file);
  uint8_t *use = calloc((size_t)nl, 1);
  if (!use || parse_layers(o.layers, nl, use)) {
    mtrain_budgets_destroy(file);
    free(use);
    return 2;
  }
  const int32_t heads = mtrain_budgets_num_heads(file, 0);
  if (heads % o.kv_heads != 0) {
    fprintf(stderr, "%s: %d query heads are not a multiple of --kv-heads %d\n", prog, heads,
            o.kv_heads);
    return 2;
  }
  inputs_t in;
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = o.granularity;
  cfg.num_threads = o.threads;
  mtrain_context_t *ctx = NULL;
  fprintf(stderr, "%s: generating %lld tokens of structured inputs (%d/%d heads, d %d, %s)\n", prog,
          (long long)o.tokens, heads, o.kv_heads, o.head_dim, mtrain_dtype_name(o.dtype));
  int rc = inputs_make(&o, heads, &in);
  cfg.backend = o.backend;
  if (!rc && strcmp(o.backend, "cuda") == 0)
    rc = to_device(&in.q, &in.dq) || to_device(&in.k, &in.dk);
  if (!rc) rc = tool_failed(prog, "context", mtrain_context_create(&cfg, NULL, &ctx));
  layer_result_t *res = calloc((size_t)nl, sizeof *res);
  int32_t n_res = 0;
  rc = rc || res == NULL;
  for (int32_t l = 0; l < nl && !rc; l++) {
    if (!use[l]) continue;
    layer_result_t *r = &res[n_res];
    rc = timing_alloc(&r->estimate, o.steps) || timing_alloc(&r->scores, o.steps) ||
         timing_alloc(&r->select, o.steps) || timing_alloc(&r->stages, o.steps) ||
         timing_alloc(&r->copies, o.steps) || timing_alloc(&r->reduce, o.steps);
    for (int w = 0; w < o.num_worlds && !rc; w++)
      rc = timing_alloc(&r->plan[w], o.steps) || timing_alloc(&r->cuda[w], o.steps);
    if (!rc) rc = run_layer(&o, ctx, file, l, &in, r);
    if (rc) break;
    n_res++;
    fprintf(stderr, "%s: layer %d done\n", prog, l);
  }
  if (!rc) {
    printf("%s: %lld tokens, G %d, %d/%d heads, d %d, %s, last_q %d, %d threads, scoring on %s, "
           "%s\n",
           prog, (long long)o.tokens, o.granularity, heads, o.kv_heads, o.head_dim,
           mtrain_dtype_name(o.dtype), o.last_q, omp_get_max_threads(), o.backend, o.budgets);
    printf("warm medians of %d steps, ms per layer (plan W>1: rank %d, layout %s)\n", o.steps,
           o.rank, o.layout);
    printf("%5s %8s %9s %8s %8s %8s %8s %8s", "layer", "density", "estimate", "scores", "stages",
           "copies", "reduce", "select");
    for (int w = 0; w < o.num_worlds; w++) {
      char h[32];
      snprintf(h, sizeof h, "plan W=%d", o.worlds[w]);
      printf(" %10s", h);
      if (o.cuda_step) {
        snprintf(h, sizeof h, "cuda W=%d", o.worlds[w]);
        printf(" %10s", h);
      }
    }
    printf("\n");
    double sum_e = 0, sum_sc = 0, sum_se = 0, sum_p[MAX_WORLDS] = {0}, sum_c[MAX_WORLDS] = {0};
    for (int32_t i = 0; i < n_res; i++) {
      const layer_result_t *r = &res[i];
      const double e = warm_median(&r->estimate, o.steps), sc = warm_median(&r->scores, o.steps),
                   se = warm_median(&r->select, o.steps);
      sum_e += e, sum_sc += sc, sum_se += se;
      printf("%5d %8.4f %9.1f %8.1f %8.1f %8.1f %8.1f %8.1f", r->layer, r->density, 1e3 * e,
             1e3 * sc, 1e3 * warm_median(&r->stages, o.steps),
             1e3 * warm_median(&r->copies, o.steps), 1e3 * warm_median(&r->reduce, o.steps),
             1e3 * se);
      for (int w = 0; w < o.num_worlds; w++) {
        const double p = warm_median(&r->plan[w], o.steps), c = warm_median(&r->cuda[w], o.steps);
        sum_p[w] += p, sum_c[w] += c;
        printf(" %10.1f", 1e3 * p);
        if (o.cuda_step) printf(" %10.1f", 1e3 * c);
      }
      printf("\n");
    }
    if (n_res > 0) {
      printf("%5s %8s %9.1f %8.1f %8s %8s %8s %8.1f", "mean", "", 1e3 * sum_e / n_res,
             1e3 * sum_sc / n_res, "", "", "", 1e3 * sum_se / n_res);
      for (int w = 0; w < o.num_worlds; w++) {
        printf(" %10.1f", 1e3 * sum_p[w] / n_res);
        if (o.cuda_step) printf(" %10.1f", 1e3 * sum_c[w] / n_res);
      }
      printf("\n");
    }
  }
  if (!rc && o.json) {
    json_t *layers = json_array();
    for (int32_t i = 0; i < n_res; i++) {
      const layer_result_t *r = &res[i];
      json_t *plans = json_array();
      for (int w = 0; w < o.num_worlds; w++) {
        json_t *pw = json_pack("{s:i, s:I, s:o}", "world", o.worlds[w], "computed_pairs",
                               (json_int_t)r->pairs[w], "plan", timing_json(&r->plan[w], o.steps));
        if (o.cuda_step)
          json_object_set_new(pw, "cuda_step_host", timing_json(&r->cuda[w], o.steps));
        json_array_append_new(plans, pw);
      }
      json_array_append_new(layers,
                            json_pack("{s:i, s:f, s:I, s:I, s:o, s:o, s:o, s:o}", "layer", r->layer,
                                      "density", r->density, "diagonals", (json_int_t)r->diagonals,
                                      "verticals", (json_int_t)r->verticals, "estimate",
                                      timing_json(&r->estimate, o.steps), "scores",
                                      timing_json(&r->scores, o.steps), "select",
                                      timing_json(&r->select, o.steps), "plans", plans));
      json_t *last = json_array_get(layers, json_array_size(layers) - 1);
      json_object_set_new(last, "scores_stages", timing_json(&r->stages, o.steps));
      json_object_set_new(last, "scores_copies", timing_json(&r->copies, o.steps));
      json_object_set_new(last, "scores_reduce", timing_json(&r->reduce, o.steps));
    }
    json_t *root = json_pack(
        "{s:s, s:s, s:I, s:i, s:i, s:i, s:i, s:s, s:i, s:i, s:s, s:i, s:i, s:i, s:o}", "tool", prog,
        "budgets", o.budgets, "tokens", (json_int_t)o.tokens, "granularity", o.granularity, "heads",
        heads, "kv_heads", o.kv_heads, "head_dim", o.head_dim, "dtype", mtrain_dtype_name(o.dtype),
        "last_q", o.last_q, "threads", omp_get_max_threads(), "layout", o.layout, "rank", o.rank,
        "ranks_per_node", o.ranks_per_node, "steps", o.steps, "layers", layers);
    json_object_set_new(root, "backend", json_string(o.backend));
    if (json_dump_file(root, o.json, JSON_INDENT(1)) != 0) {
      fprintf(stderr, "%s: cannot write %s\n", prog, o.json);
      rc = 1;
    }
    json_decref(root);
  }
  for (int32_t i = 0; res && i < nl; i++) {
    free(res[i].estimate.warm);
    free(res[i].scores.warm);
    free(res[i].select.warm);
    free(res[i].stages.warm);
    free(res[i].copies.warm);
    free(res[i].reduce.warm);
    for (int w = 0; w < MAX_WORLDS; w++) {
      free(res[i].plan[w].warm);
      free(res[i].cuda[w].warm);
    }
  }
  free(res);
  free(use);
  inputs_free(&in);
  mtrain_context_destroy(ctx);
  mtrain_budgets_destroy(file);
  return rc;
}
