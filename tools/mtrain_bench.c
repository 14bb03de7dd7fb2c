/* mtrain_bench.c: the ring benchmark under mpiexec (W ranks; cpu backend
 * over MPI, or cuda with one GPU per rank through NCCL). For each length of
 * --tokens-list it times forward+backward of the dense ring (zigzag layout,
 * once per length) and, for each layer of --layers, of the sparse ring
 * (striped layout, the pattern estimated online and distributed from that
 * layer's budgets): warm-up, then the median of --repeat runs, slowest
 * rank. Each rank generates only its own slots of the inputs. The set-up,
 * the inputs, the estimate, the timed run and the figures over the ranks
 * are mtrain-run's (ring_common.c, run_attention.c); this file holds the
 * options and the sweep, bench_report.c the table and the JSON. Every
 * collective of the benchmark is timed (--timeout, ring_common.h), and a
 * failure on one rank ends the job on every rank (MPI_Abort). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_report.h"
#include "mtrain/mtrain_cuda.h"
#include "ring_common.h"
#include "run_fault.h"
#include "tool_common.h"

static const char *prog = "mtrain-bench";

static const char usage[] =
    "usage: mpiexec -n W mtrain-bench [options]\n"
    "Forward+backward of the sparse ring against the dense ring over W ranks: for each\n"
    "length, the dense ring (zigzag layout) once and the sparse ring (the pattern\n"
    "estimated online, distributed) per layer; warm-up, then the median of --repeat runs,\n"
    "slowest rank. The table goes to stdout, progress to stderr.\n"
    "The sweep:\n"
    "  --tokens-list N,N,...  sequence lengths (default 131072,524288,1048576)\n"
    "  --budgets FILE         per-head budgets (MInference budget file) ...\n"
    "  --layers L,L,...       ... of these layers (default 3,15,31)\n"
    "  --v-size N --s-size N  or, without --budgets, static top-k for every head\n"
    "  --top-p P              or top-p for every head, --top-p-cap C its cap (default 4096)\n"
    "  --last-q L             queries that score the keys in the estimate (default 64)\n"
    "  --top-p-forced         top-p budgets force the sinks (30 keys) and the local window\n"
    "                         (100 token diagonals) too, as top-k does (SPEC.md section 2)\n"
    "  --skip-dense-above N   no dense ring at lengths above N (default: never skip)\n"
    "  --warmup W             untimed runs before the timed ones (default 1)\n"
    "  --repeat R             timed runs, median reported (default 1)\n"
    "  --json FILE            write the results as JSON to FILE\n"
    "The problem (as mtrain-run):\n"
    "  --heads H --kv-heads H --head-dim D   (default 16, 2, 128)\n"
    "  --granularity G        block size (default 128)\n"
    "  --seed S               seed of the generated inputs (default 1)\n"
    "  --input structured|normal   generated inputs (default structured)\n"
    "  --input-scale S        multiply the generated q, k and v by S (default 1)\n"
    "The ring and the computation (as mtrain-run):\n"
    "  --layout contiguous|zigzag|striped|balanced   the sparse ring's layout (default\n"
    "                         striped)\n"
    "  --schedule flat|hier   ring schedule (default flat)\n"
    "  --ranks-per-node n     ranks per node of the hierarchical ring (needs --schedule hier;\n"
    "                         not given: detected from the ranks that share memory, and an\n"
    "                         error when all W ranks share one node)\n"
    "  --backend cpu|cuda     backend (default cpu; cuda: one GPU per rank, needs NCCL;\n"
    "                         MTRAIN_BACKEND overrides it)\n"
    "  --cuda-variant auto|0|1|2|3  CUDA kernel variant (see mtrain-run --help)\n"
    "  --dtype fp32|bf16|fp16 storage type (default fp32)\n"
    "  --threads T            OpenMP threads (default: OpenMP's)\n"
    "  --timeout S            seconds a rank waits for the others (in the ring and the\n"
    "                         benchmark's own reductions) before the job ends with a\n"
    "                         timeout error (default: MTRAIN_COMM_TIMEOUT, else 300)\n"
    "  --help                 this text\n"
    "mtrain-run's --q, --k, --v, --do, --pattern, --seq-len (use --tokens-list), --layer\n"
    "(use --layers), --out, --check and --forward-only are not options of the benchmark.\n"
    "Exit status: 0 success, 1 error, 2 bad command line.\n";

enum { MAX_LIST = 64 };

typedef struct bench_opts {
  int64_t tokens[MAX_LIST];
  int n_tokens;
  int64_t layers[MAX_LIST];
  int n_layers;
  const char *budgets, *json_path;
  int64_t skip_dense_above; /* -1: never skip */
  int64_t warmup;
  run_options_t run; /* the rest: mtrain-run's options */
} bench_opts_t;

/* A comma-separated list of integers in [lo, hi]. */
static int parse_list(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out,
                      int *n) {
  *n = 0;
  const char *p = s;
  while (*p) {
    char *end = NULL;
    const long long v = strtoll(p, &end, 10);
    if (end == p || (*end && *end != ',') || v < lo || v > hi || *n == MAX_LIST) {
      fprintf(stderr,
              "%s: --%s '%s': expected up to %d integers in [%lld, %lld], comma-separated\n", prog,
              name, s, MAX_LIST, (long long)lo, (long long)hi);
      return 1;
    }
    out[(*n)++] = v;
    p = *end ? end + 1 : end;
  }
  if (*n == 0) fprintf(stderr, "%s: --%s is empty\n", prog, name);
  return *n == 0;
}

/* The value of option `name` at argv[*i] ("--name VALUE" or "--name=VALUE"),
 * or NULL when argv[*i] is not that option; *i moves past a separate value. */
static const char *option_value(int argc, char **argv, int *i, const char *name, int *missing) {
  const size_t len = strlen(name);
  if (strncmp(argv[*i], name, len) != 0) return NULL;
  if (argv[*i][len] == '=') return argv[*i] + len + 1;
  if (argv[*i][len] != '\0') return NULL;
  if (*i + 1 >= argc) {
    fprintf(stderr, "%s: %s needs a value\n", prog, name);
    *missing = 1;
    return NULL;
  }
  return argv[++*i];
}

/* mtrain-run's options that have no meaning here: NULL when `arg` is none
 * of them, else what to use instead (possibly ""). */
static const char *run_only_option(const char *arg) {
  static const char *const names[][2] = {{"--q", ""},
                                         {"--k", ""},
                                         {"--v", ""},
                                         {"--do", ""},
                                         {"--pattern", ""},
                                         {"--seq-len", ": use --tokens-list"},
                                         {"--layer", ": use --layers"},
                                         {"--out", ""},
                                         {"--check", ""},
                                         {"--forward-only", ""}};
  for (size_t n = 0; n < sizeof names / sizeof names[0]; n++) {
    const size_t len = strlen(names[n][0]);
    if (strncmp(arg, names[n][0], len) == 0 && (arg[len] == '\0' || arg[len] == '='))
      return names[n][1];
  }
  return NULL;
}

/* The sparse pattern source and options that have no meaning here. */
static int check_options(bench_opts_t *b) {
  const run_options_t *o = &b->run;
  const char *bad = o->q_path         ? "--q/--k/--v"
                    : o->pattern_path ? "--pattern"
                    : o->out_dir      ? "--out"
                    : o->check        ? "--check"
                    : o->json         ? "--json without a file"
                    : o->forward_only ? "--forward-only"
                                      : NULL;
  if (bad) {
    fprintf(stderr, "%s: %s is not an option of the benchmark (see --help)\n", prog, bad);
    return 1;
  }
  if (!b->budgets && b->n_layers) {
    fprintf(stderr, "%s: --layers needs --budgets\n", prog);
    return 1;
  }
  if (b->budgets && run_options_estimate(o)) {
    fprintf(stderr,
            "%s: choose one sparse pattern source: --budgets, --v-size/--s-size or "
            "--top-p\n",
            prog);
    return 1;
  }
  if (!b->budgets && !run_options_estimate(o)) {
    fprintf(stderr,
            "%s: the sparse ring needs --budgets FILE (and --layers) or --v-size/--s-size "
            "or --top-p\n",
            prog);
    return 1;
  }
  if (b->budgets && !b->n_layers) {
    const int64_t deflt[3] = {3, 15, 31};
    memcpy(b->layers, deflt, sizeof deflt);
    b->n_layers = 3;
  }
  if (!b->budgets) b->n_layers = 1; /* one sparse row per length, layer -1 */
  return 0;
}

/* Parses argv: the benchmark's options here, the rest by run_options_parse.
 * Returns 0, 1 (bad command line, message printed) or 2 (--help). */
static int parse(int argc, char **argv, bench_opts_t *b) {
  memset(b, 0, sizeof *b);
  const int64_t deflt[3] = {131072, 524288, 1048576};
  memcpy(b->tokens, deflt, sizeof deflt);
  b->n_tokens = 3;
  b->skip_dense_above = -1;
  b->warmup = 1;
  char **rest = calloc((size_t)argc + 1, sizeof *rest);
  int n_rest = 1, bad = 0, missing = 0;
  if (!rest) return 1;
  rest[0] = argv[0];
  for (int i = 1; i < argc && !bad; i++) {
    const char *v;
    const char *not_here = run_only_option(argv[i]);
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(usage, stdout);
      free(rest);
      return 2;
    } else if (not_here) {
      fprintf(stderr, "%s: %s is not an option of the benchmark%s (see --help)\n", prog, argv[i],
              not_here);
      bad = 1;
    } else if ((v = option_value(argc, argv, &i, "--tokens-list", &missing))) {
      bad = parse_list("tokens-list", v, 1, (int64_t)1 << 40, b->tokens, &b->n_tokens);
    } else if ((v = option_value(argc, argv, &i, "--layers", &missing))) {
      bad = parse_list("layers", v, 0, 1 << 20, b->layers, &b->n_layers);
    } else if ((v = option_value(argc, argv, &i, "--budgets", &missing))) {
      b->budgets = v;
    } else if ((v = option_value(argc, argv, &i, "--json", &missing))) {
      b->json_path = v;
    } else if ((v = option_value(argc, argv, &i, "--skip-dense-above", &missing))) {
      int n = 0;
      bad = parse_list("skip-dense-above", v, 0, (int64_t)1 << 40, &b->skip_dense_above, &n) ||
            n != 1;
    } else if ((v = option_value(argc, argv, &i, "--warmup", &missing))) {
      int n = 0;
      bad = parse_list("warmup", v, 0, 1000, &b->warmup, &n) || n != 1;
    } else if (!missing) {
      rest[n_rest++] = argv[i];
    }
    bad = bad || missing;
  }
  int rc = bad ? 1 : run_options_parse(n_rest, rest, &b->run);
  free(rest);
  if (rc == 2) fputs(usage, stdout);
  if (rc) return rc;
  rc = check_options(b);
  b->run.budgets_path = b->budgets;
  return rc;
}

/* Warnings (rank 0) about options without effect: mtrain-run's, for a ring. */
static void warn(const bench_opts_t *b, int rank) { run_options_warn(prog, &b->run, 0, rank == 0); }

/* One layout's ring on this rank: the layout, the inputs in its slots and
 * outputs to match (device memory with cuda). */
typedef struct ring_data {
  mtrain_layout_t *layout;
  ring_inputs_t in;
  run_outputs_t out;
  double inputs_seconds; /* slowest rank */
} ring_data_t;

static void ring_data_free(const ring_env_t *env, ring_data_t *d) {
  if (env->device)
    run_outputs_free_device(&d->out);
  else
    run_outputs_free(&d->out);
  ring_inputs_free(&d->in);
  mtrain_layout_destroy(d->layout);
  memset(d, 0, sizeof *d);
}

/* (A failure ends the job: the other ranks wait in the next collective.) */
static void ring_data_make(const ring_env_t *env, const run_options_t *o, mtrain_layout_kind_t kind,
                           ring_data_t *d) {
  memset(d, 0, sizeof *d);
  int rc = tool_failed(
      prog, "layout",
      mtrain_layout_create(kind, o->seq_len, o->granularity, env->world, NULL, &d->layout));
  if (!rc) rc = ring_inputs_make(prog, env, o, d->layout, NULL, &d->in);
  if (!rc) {
    const run_inputs_t *h = &d->in.host;
    rc = env->device ? run_outputs_alloc_device(h, h->q.dtype, &d->out)
                     : run_outputs_alloc(h, h->q.dtype, &d->out);
  }
  if (rc) MPI_Abort(MPI_COMM_WORLD, 1);
  d->inputs_seconds = d->in.seconds;
  ring_allreduce(env, &d->inputs_seconds, 1, MTRAIN_REDUCE_MAX,
                 "the inputs: the slowest rank's time");
}

/* The plan of `pattern`, the warm-up runs and the timed runs; the slowest
 * rank's medians into *res, the computed pairs of all ranks into *pairs. */
static void measure(const ring_env_t *env, const bench_opts_t *b, ring_data_t *d,
                    const mtrain_pattern_t *pattern, bench_run_t *res, double *pairs) {
  mtrain_plan_t *plan = NULL;
  run_result_t r;
  memset(&r, 0, sizeof r);
  run_inputs_t *work = ring_inputs_work(env, &d->in);
  int rc = tool_failed(prog, "building the plan",
                       mtrain_plan_create_ring(
                           env->ctx, NULL, (const mtrain_layout_t *const[]){d->layout},
                           env->ranks_per_node, (const mtrain_pattern_t *const[]){pattern}, &plan));
  run_options_t warm = b->run;
  warm.repeat = (int)b->warmup;
  ring_abort_if(env, rc);
  ring_barrier(env, "before the warm-up");
  if (b->warmup > 0) rc = run_attention(prog, env->ctx, plan, work, &d->out, &warm, &r);
  ring_abort_if(env, rc);
  ring_barrier(env, "before the timed runs");
  ring_abort_if(env, run_attention(prog, env->ctx, plan, work, &d->out, &b->run, &r));
  run_fault_point(prog, "report", env->rank);
  ring_totals_t t;
  ring_totals_compute(env, plan, &r, 0, &t);
  *res = (bench_run_t){t.fwd, t.bwd, t.fwd_ratio, t.bwd_ratio};
  *pairs = t.pairs;
  mtrain_plan_destroy(plan);
}

/* The dense ring at the options' length (zigzag layout). */
static void bench_dense(const ring_env_t *env, const bench_opts_t *b, bench_run_t *res) {
  const run_options_t *o = &b->run;
  ring_data_t d;
  ring_data_make(env, o, MTRAIN_LAYOUT_ZIGZAG, &d);
  mtrain_pattern_t *dense = NULL;
  if (tool_failed(prog, "dense pattern",
                  mtrain_pattern_create_dense(o->seq_len, o->heads, o->granularity, &dense)))
    MPI_Abort(MPI_COMM_WORLD, 1);
  double pairs = 0;
  measure(env, b, &d, dense, res, &pairs);
  if (env->rank == 0)
    fprintf(stderr, "%s: N=%lld dense zigzag: inputs %.2f s, forward+backward %.4f s\n", prog,
            (long long)o->seq_len, d.inputs_seconds, res->fwd + res->bwd);
  mtrain_pattern_destroy(dense);
  ring_data_free(env, &d);
}

/* The sparse ring at the options' length for every layer: rows[0 ..
 * b->n_layers - 1]. */
static void bench_sparse(const ring_env_t *env, bench_opts_t *b, mtrain_layout_kind_t kind,
                         bench_row_t *rows) {
  run_options_t *o = &b->run;
  ring_data_t d;
  ring_data_make(env, o, kind, &d);
  const double dense_pairs = (double)o->heads * (double)o->seq_len * (double)(o->seq_len + 1) / 2;
  for (int l = 0; l < b->n_layers; l++) {
    bench_row_t *row = &rows[l];
    o->layer = b->budgets ? (int32_t)b->layers[l] : -1;
    row->tokens = o->seq_len;
    row->layer = o->layer;
    row->inputs_seconds = d.inputs_seconds;
    mtrain_pattern_t *pattern = NULL;
    if (ring_estimate(prog, env, o, d.layout, &d.in, &pattern, &row->estimate_seconds))
      MPI_Abort(MPI_COMM_WORLD, 1);
    double pairs = 0;
    measure(env, b, &d, pattern, &row->sparse, &pairs);
    row->sparsity = 1.0 - pairs / dense_pairs;
    if (env->rank == 0)
      fprintf(stderr, "%s: N=%lld layer %d: sparsity %.4f, forward+backward %.4f s\n", prog,
              (long long)o->seq_len, row->layer, row->sparsity, row->sparse.fwd + row->sparse.bwd);
    mtrain_pattern_destroy(pattern);
  }
  ring_data_free(env, &d);
}

int main(int argc, char **argv) {
  int provided = 0, rank = 0, world = 1;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  bench_opts_t b;
  int rc = parse(argc, argv, &b);
  if (rc) {
    MPI_Finalize();
    return rc == 2 ? 0 : 2;
  }
  warn(&b, rank);
  mtrain_layout_kind_t kind = MTRAIN_LAYOUT_STRIPED;
  ring_env_t env;
  rc = tool_failed(prog, "--layout", mtrain_layout_kind_parse(b.run.layout, &kind));
  if (!rc) rc = ring_env_open(prog, &b.run, rank, world, &env);
  if (rc == 2) { /* the schedule options cannot form the ring: every rank alike */
    ring_env_close(&env);
    MPI_Finalize();
    return 1;
  }
  if (rc) MPI_Abort(MPI_COMM_WORLD, 1);
  bench_row_t *rows = calloc((size_t)(b.n_tokens * b.n_layers), sizeof *rows);
  if (!rows) MPI_Abort(MPI_COMM_WORLD, 1);
  for (int t = 0; t < b.n_tokens; t++) {
    b.run.seq_len = b.tokens[t];
    bench_row_t *mine = rows + t * b.n_layers;
    bench_run_t dense = {0, 0, 0, 0};
    const int has_dense = b.skip_dense_above < 0 || b.tokens[t] <= b.skip_dense_above;
    if (has_dense) bench_dense(&env, &b, &dense);
    bench_sparse(&env, &b, kind, mine);
    for (int l = 0; l < b.n_layers; l++) {
      mine[l].has_dense = has_dense;
      mine[l].dense = dense;
    }
  }
  char source[1024];
  snprintf(source, sizeof source, "%s", run_pattern_source(&b.run));
  if (b.budgets) {
    int at = snprintf(source, sizeof source, "estimated, budgets %s layers", b.budgets);
    for (int l = 0; l < b.n_layers && at > 0 && (size_t)at < sizeof source; l++)
      at += snprintf(source + at, sizeof source - (size_t)at, "%s%lld", l ? "," : " ",
                     (long long)b.layers[l]);
  }
  if (rank == 0) {
    const bench_info_t info = {
        .backend = mtrain_context_backend_name(env.ctx),
        .dtype = mtrain_dtype_name(b.run.dtype),
        .input = b.run.input,
        .sparse_layout = mtrain_layout_kind_name(kind),
        .schedule = env.ranks_per_node ? "hierarchical" : "flat",
        .topology = ring_env_topology(&env),
        .ranks_per_node = env.ranks_per_node,
        .ranks_per_node_detected = env.ranks_per_node_detected,
        .pattern_source = source,
        .world = world,
        .cuda_variant = env.device ? mtrain_cuda_last_variant(env.ctx) : -1,
        .heads = b.run.heads,
        .kv_heads = b.run.kv_heads,
        .head_dim = b.run.head_dim,
        .granularity = b.run.granularity,
        .warmup = (int32_t)b.warmup,
        .repeat = b.run.repeat,
    };
    bench_print_table(&info, rows, b.n_tokens * b.n_layers);
    if (b.json_path) rc = bench_write_json(b.json_path, &info, rows, b.n_tokens * b.n_layers);
  }
  free(rows);
  ring_env_close(&env);
  MPI_Finalize();
  return rc;
}
