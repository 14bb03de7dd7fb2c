/* run_options.c: parses the command line of mtrain-run with getopt_long;
 * every malformed value is reported naming the option. Also takes the
 * granularity of a --pattern file when --granularity is not given, applies
 * MTRAIN_BACKEND to the backend under test, and warns about options that
 * have no effect. */
#include "run_options.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_io.h"

static const char usage[] =
    "usage: mtrain-run [options]\n"
    "       mpiexec -n W mtrain-run [options]\n"
    "Sparse attention forward and backward, with a report: on one rank, or under\n"
    "mpiexec on W ranks (the ring: each rank holds its tokens of the layout).\n"
    "Inputs (either files or generated):\n"
    "  --q FILE.npy --k FILE.npy --v FILE.npy [--do FILE.npy]\n"
    "                        [N, Hq, d] / [N, Hkv, d] tensors (float16/32/64)\n"
    "  --seq-len N           generated input length (default 4096)\n"
    "  --heads H --kv-heads H --head-dim D   (default 16, 2, 128)\n"
    "  --seed S              seed of the generated inputs (default 1)\n"
    "  --input structured|normal   generated inputs: RoPE'd vertical-slash structure\n"
    "                        (default) or plain normal noise\n"
    "  --input-scale S       multiply the generated q, k and v by S (default 1)\n"
    "Pattern (default: dense causal):\n"
    "  --pattern FILE.json   a fixed pattern (SPEC.md section 8)\n"
    "  --v-size N --s-size N estimate online, static top-k for every head\n"
    "  --top-p P [--top-p-cap C]  estimate online, top-p for every head (cap 4096)\n"
    "  --budgets FILE --layer L   estimate online with the per-head budgets of a\n"
    "                        MInference budget file\n"
    "  --last-q L            queries that score the keys (default 64)\n"
    "  --top-p-forced        top-p budgets force the sinks (30 keys) and the local window\n"
    "                        (100 token diagonals) too, as top-k does (SPEC.md section 2)\n"
    "  --granularity G       block size (default: a --pattern file's, else 128; when\n"
    "                        given with --pattern it must equal the file's)\n"
    "Several ranks (run under mpiexec -n W):\n"
    "  --layout contiguous|zigzag|striped|balanced   token layout (default striped)\n"
    "  --schedule flat|hier  ring schedule (default flat). hier: an inner ring per node\n"
    "                        and an outer ring over the nodes\n"
    "  --ranks-per-node n    ranks per node of the hierarchical ring, a divisor of W\n"
    "                        below W (needs --schedule hier). Not given: detected, the\n"
    "                        ranks that share memory (MPI_COMM_TYPE_SHARED), and the\n"
    "                        report says so; a run whose W ranks all share one node\n"
    "                        stops with an error (give --ranks-per-node, or use flat)\n"
    "  --timeout S           seconds any rank waits for the others, in the ring and\n"
    "                        in the tool's own gathers, before the job ends with a\n"
    "                        timeout error (default: MTRAIN_COMM_TIMEOUT, else 300)\n"
    "Computation:\n"
    "  --backend cpu|cpu-ref|cuda   backend (default cpu; MTRAIN_BACKEND overrides it)\n"
    "  --dtype fp32|bf16|fp16|fp64  storage type of the tensors (default fp32)\n"
    "  --cuda-variant auto|0|1|2|3  CUDA kernel variant: 0 SIMT, 2 tensor cores, 3 the\n"
    "                        Hopper (wgmma) kernels (2, 3: bf16/fp16, d 64/128); 1 only\n"
    "                        in builds with MTRAIN_CUDA_DEV_VARIANTS; default:\n"
    "                        MTRAIN_CUDA_VARIANT or auto. Under mpiexec\n"
    "                        cuda runs one GPU per rank through the NCCL communicator\n"
    "  --threads T           OpenMP threads (default: OpenMP's)\n"
    "  --forward-only        skip the backward\n"
    "  --repeat R            time R runs, report the median (default 1)\n"
    "Output:\n"
    "  --out DIR             write o.npy lse.npy dq.npy dk.npy dv.npy pattern.json\n"
    "  --check               compare with the fp64 reference (cpu-ref); exit 3 on failure.\n"
    "                        Bound: max|err| <= tol * max|ref|, tol 1e-4 for fp32 and\n"
    "                        fp64, 4 unit roundoffs for bf16 (4 * 2^-8) and fp16 (4 * 2^-11);\n"
    "                        dq and dk also have a floor from the accumulator's rounding\n"
    "                        (docs/USAGE.md)\n"
    "  --json                print the report as one JSON object\n"
    "  --help                this text\n"
    "Exit status: 0 success, 1 error, 2 bad command line, 3 check failed.\n";

static int parse_i64(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out) {
  char *end = NULL;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) {
    fprintf(stderr, "mtrain-run: --%s '%s' is not an integer in [%lld, %lld]\n", name, s,
            (long long)lo, (long long)hi);
    return 1;
  }
  *out = v;
  return 0;
}

/* A number in (0, hi]. */
static int parse_positive(const char *name, const char *s, double hi, double *out) {
  char *end = NULL;
  errno = 0;
  const double v = strtod(s, &end);
  if (errno || end == s || *end || !(v > 0.0 && v <= hi)) {
    fprintf(stderr, "mtrain-run: --%s '%s' is not a number in (0, %g]\n", name, s, hi);
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

int run_options_parse(int argc, char **argv, run_options_t *o) {
  memset(o, 0, sizeof *o);
  o->seq_len = 4096;
  o->heads = 16;
  o->kv_heads = 2;
  o->head_dim = 128;
  o->granularity = 128;
  o->seed = 1;
  o->backend = "cpu";
  o->dtype = MTRAIN_F32;
  o->repeat = 1;
  o->v_size = o->s_size = -1;
  o->top_p_cap = 4096;
  o->layer = -1;
  o->last_q = 64;
  o->input = "structured";
  o->layout = "striped";
  o->cuda_variant = RUN_CUDA_VARIANT_UNSET;
  o->input_scale = 1.0;
  static const struct option longs[] = {{"q", required_argument, 0, 'q'},
                                        {"k", required_argument, 0, 'k'},
                                        {"v", required_argument, 0, 'v'},
                                        {"do", required_argument, 0, 'o'},
                                        {"seq-len", required_argument, 0, 'N'},
                                        {"heads", required_argument, 0, 'H'},
                                        {"kv-heads", required_argument, 0, 'K'},
                                        {"head-dim", required_argument, 0, 'D'},
                                        {"seed", required_argument, 0, 's'},
                                        {"pattern", required_argument, 0, 'p'},
                                        {"granularity", required_argument, 0, 'G'},
                                        {"backend", required_argument, 0, 'b'},
                                        {"dtype", required_argument, 0, 't'},
                                        {"threads", required_argument, 0, 'T'},
                                        {"out", required_argument, 0, 'O'},
                                        {"check", no_argument, 0, 'c'},
                                        {"json", no_argument, 0, 'j'},
                                        {"forward-only", no_argument, 0, 'f'},
                                        {"repeat", required_argument, 0, 'r'},
                                        {"help", no_argument, 0, 'h'},
                                        {"v-size", required_argument, 0, 'V'},
                                        {"s-size", required_argument, 0, 'S'},
                                        {"top-p", required_argument, 0, 'P'},
                                        {"top-p-cap", required_argument, 0, 'C'},
                                        {"budgets", required_argument, 0, 'B'},
                                        {"layer", required_argument, 0, 'L'},
                                        {"last-q", required_argument, 0, 'Q'},
                                        {"top-p-forced", no_argument, 0, 'F'},
                                        {"input", required_argument, 0, 'I'},
                                        {"layout", required_argument, 0, 'y'},
                                        {"schedule", required_argument, 0, 'x'},
                                        {"ranks-per-node", required_argument, 0, 'R'},
                                        {"cuda-variant", required_argument, 0, 'u'},
                                        {"input-scale", required_argument, 0, 'X'},
                                        {"timeout", required_argument, 0, 'W'},
                                        {0, 0, 0, 0}};
  int c, bad = 0;
  int64_t seed = 0;
  int32_t repeat = 1;
  opterr = 0;
  while (!bad && (c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
    if (c > 0 && c < (int)sizeof o->given) o->given[c] = 1;
    switch (c) {
    case 'q':
      o->q_path = optarg;
      break;
    case 'k':
      o->k_path = optarg;
      break;
    case 'v':
      o->v_path = optarg;
      break;
    case 'o':
      o->do_path = optarg;
      break;
    case 'N':
      bad = parse_i64("seq-len", optarg, 1, (int64_t)1 << 40, &o->seq_len);
      break;
    case 'H':
      bad = parse_i32("heads", optarg, 1, 4096, &o->heads);
      break;
    case 'K':
      bad = parse_i32("kv-heads", optarg, 1, 4096, &o->kv_heads);
      break;
    case 'D':
      bad = parse_i32("head-dim", optarg, 1, 4096, &o->head_dim);
      break;
    case 's':
      bad = parse_i64("seed", optarg, 0, INT64_MAX, &seed);
      o->seed = (uint64_t)seed;
      break;
    case 'p':
      o->pattern_path = optarg;
      break;
    case 'G':
      bad = parse_i32("granularity", optarg, 1, 1 << 20, &o->granularity);
      o->granularity_given = 1;
      break;
    case 'b':
      o->backend = optarg;
      break;
    case 't':
      if (mtrain_dtype_parse(optarg, &o->dtype) != MTRAIN_SUCCESS) {
        fprintf(stderr, "mtrain-run: --dtype '%s': expected fp32, bf16, fp16 or fp64\n", optarg);
        bad = 1;
      }
      break;
    case 'T':
      bad = parse_i32("threads", optarg, 1, 1 << 16, &o->threads);
      break;
    case 'O':
      o->out_dir = optarg;
      break;
    case 'c':
      o->check = 1;
      break;
    case 'j':
      o->json = 1;
      break;
    case 'f':
      o->forward_only = 1;
      break;
    case 'r':
      bad = parse_i32("repeat", optarg, 1, 1000, &repeat);
      o->repeat = repeat;
      break;
    case 'V':
      bad = parse_i64("v-size", optarg, 0, (int64_t)1 << 40, &o->v_size);
      break;
    case 'S':
      bad = parse_i64("s-size", optarg, 0, (int64_t)1 << 40, &o->s_size);
      break;
    case 'P': {
      char *end = NULL;
      o->top_p = strtod(optarg, &end);
      if (end == optarg || *end || !(o->top_p > 0.0 && o->top_p <= 1.0)) {
        fprintf(stderr, "mtrain-run: --top-p '%s' is not a number in (0, 1]\n", optarg);
        bad = 1;
      }
      break;
    }
    case 'C':
      bad = parse_i64("top-p-cap", optarg, 0, (int64_t)1 << 40, &o->top_p_cap);
      break;
    case 'B':
      o->budgets_path = optarg;
      break;
    case 'L':
      bad = parse_i32("layer", optarg, 0, 1 << 20, &o->layer);
      break;
    case 'Q':
      bad = parse_i32("last-q", optarg, 1, 1 << 20, &o->last_q);
      break;
    case 'F':
      o->top_p_forced = 1;
      break;
    case 'I':
      if (strcmp(optarg, "structured") != 0 && strcmp(optarg, "normal") != 0) {
        fprintf(stderr, "mtrain-run: --input '%s': expected structured or normal\n", optarg);
        bad = 1;
      }
      o->input = optarg;
      break;
    case 'y':
      o->layout = optarg;
      break;
    case 'x':
      if (strcmp(optarg, "flat") != 0 && strcmp(optarg, "hier") != 0) {
        fprintf(stderr, "mtrain-run: --schedule '%s': expected flat or hier\n", optarg);
        bad = 1;
      }
      o->hierarchical = strcmp(optarg, "hier") == 0;
      break;
    case 'R':
      bad = parse_i32("ranks-per-node", optarg, 1, 1 << 20, &o->ranks_per_node);
      break;
    case 'u':
      if (strcmp(optarg, "auto") == 0) {
        o->cuda_variant = -1;
      } else if (optarg[0] >= '0' && optarg[0] <= '3' && optarg[1] == '\0') {
        o->cuda_variant = optarg[0] - '0';
      } else {
        fprintf(stderr, "mtrain-run: --cuda-variant '%s': expected auto, 0, 1, 2 or 3\n", optarg);
        bad = 1;
      }
      break;
    case 'X':
      bad = parse_positive("input-scale", optarg, 1e30, &o->input_scale);
      break;
    case 'W':
      bad = parse_positive("timeout", optarg, 1e9, &o->timeout);
      break;
    case 'h':
      fputs(usage, stdout);
      return 2;
    default:
      fprintf(stderr, "mtrain-run: unknown or incomplete option '%s'\n%s", argv[optind - 1], usage);
      return 1;
    }
  }
  if (bad) return 1;
  if (optind < argc) {
    fprintf(stderr, "mtrain-run: unexpected argument '%s'\n", argv[optind]);
    return 1;
  }
  /* MTRAIN_BACKEND picks the backend under test, as the library's contexts
   * would (include/mtrain/mtrain.h); taken here and removed, so that the
   * tool's own contexts (the --check reference, cpu-ref) keep their backend */
  static char env_backend[64];
  const char *env = getenv("MTRAIN_BACKEND");
  if (env) {
    snprintf(env_backend, sizeof env_backend, "%s", env);
    if (strcmp(env_backend, o->backend) != 0) o->backend_overridden = o->backend;
    o->backend = env_backend;
    unsetenv("MTRAIN_BACKEND");
  }
  const int files = (o->q_path != NULL) + (o->k_path != NULL) + (o->v_path != NULL);
  if (files != 0 && files != 3) {
    fprintf(stderr, "mtrain-run: --q, --k and --v must be given together\n");
    return 1;
  }
  if (o->do_path && files == 0) {
    fprintf(stderr, "mtrain-run: --do needs --q, --k and --v\n");
    return 1;
  }
  const int sources = (o->pattern_path != NULL) + (o->v_size >= 0 || o->s_size >= 0) +
                      (o->top_p > 0) + (o->budgets_path != NULL);
  if (sources > 1) {
    fprintf(stderr, "mtrain-run: choose one pattern source: --pattern, --v-size/--s-size, "
                    "--top-p or --budgets\n");
    return 1;
  }
  if ((o->v_size >= 0) != (o->s_size >= 0)) {
    fprintf(stderr, "mtrain-run: --v-size and --s-size must be given together\n");
    return 1;
  }
  if ((o->budgets_path != NULL) != (o->layer >= 0)) {
    fprintf(stderr, "mtrain-run: --budgets and --layer must be given together\n");
    return 1;
  }
  if (o->cuda_variant != RUN_CUDA_VARIANT_UNSET && strcmp(o->backend, "cuda") != 0) {
    fprintf(stderr, "mtrain-run: --cuda-variant needs --backend cuda\n");
    return 1;
  }
  if (o->ranks_per_node && !o->hierarchical) {
    fprintf(stderr,
            "mtrain-run: --ranks-per-node %d needs --schedule hier (the flat ring has no "
            "nodes)\n",
            o->ranks_per_node);
    return 1;
  }
  if (files == 0 && o->heads % o->kv_heads != 0) {
    fprintf(stderr, "mtrain-run: --heads %d is not a multiple of --kv-heads %d\n", o->heads,
            o->kv_heads);
    return 1;
  }
  return 0;
}

int run_options_resolve_pattern(const char *prog, run_options_t *o, int verbose) {
  if (!o->pattern_path) return 0;
  mtrain_pattern_t *p = NULL;
  const mtrain_status_t st = mtrain_pattern_read_json(o->pattern_path, &p);
  if (st != MTRAIN_SUCCESS) {
    if (verbose)
      fprintf(stderr, "%s: %s: %s: %s\n", prog, o->pattern_path, mtrain_status_name(st),
              mtrain_last_error());
    return 1;
  }
  const int32_t g = mtrain_pattern_granularity(p);
  mtrain_pattern_destroy(p);
  if (o->granularity_given && o->granularity != g) {
    if (verbose)
      fprintf(stderr,
              "%s: --granularity %d disagrees with the granularity %d of the pattern file %s "
              "(leave --granularity out to take the file's, or give --granularity %d)\n",
              prog, o->granularity, g, o->pattern_path, g);
    return 1;
  }
  o->granularity = g;
  return 0;
}

/* One warning: the option and why it has no effect. */
static void warn_one(const char *prog, const char *option, const char *why) {
  fprintf(stderr, "%s: warning: %s has no effect: %s\n", prog, option, why);
}

void run_options_warn(const char *prog, const run_options_t *o, int single_rank, int verbose) {
  if (!verbose) return;
  if (o->backend_overridden)
    fprintf(stderr,
            "%s: note: MTRAIN_BACKEND=%s overrides --backend %s%s (the --check reference stays "
            "cpu-ref)\n",
            prog, o->backend, o->backend_overridden, o->given['b'] ? "" : " (the default)");
  if (o->q_path) {
    static const struct {
      int c;
      const char *name;
    } generator[] = {{'N', "--seq-len"},  {'H', "--heads"}, {'K', "--kv-heads"},
                     {'D', "--head-dim"}, {'I', "--input"}, {'X', "--input-scale"}};
    for (size_t i = 0; i < sizeof generator / sizeof generator[0]; i++)
      if (o->given[generator[i].c])
        warn_one(prog, generator[i].name,
                 "the inputs are read from --q/--k/--v (their shapes come from the files)");
    if (o->do_path && o->given['s'])
      warn_one(prog, "--seed", "--do gives dout (the seed only draws dout without --do)");
  }
  if (o->do_path && o->forward_only)
    warn_one(prog, "--do", "--forward-only skips the backward, which alone reads dout");
  if (o->given['Q'] && !run_options_estimate(o))
    warn_one(prog, "--last-q",
             "the pattern is not estimated (give --v-size/--s-size, --top-p or --budgets)");
  if (o->given['F'] && !(o->top_p > 0) && !o->budgets_path)
    warn_one(prog, "--top-p-forced",
             "it forces the sinks and the window into top-p budgets, and none is given (--top-p "
             "or a --budgets file)");
  if (o->given['C'] && !(o->top_p > 0))
    warn_one(prog, "--top-p-cap", "it caps --top-p, which is not given");
  if (single_rank) {
    const char *text = "one rank has no ring (run under mpiexec -n W with W > 1 for the ring)";
    if (o->given['y']) warn_one(prog, "--layout", text);
    if (o->given['x']) warn_one(prog, "--schedule", text);
    if (o->given['W']) warn_one(prog, "--timeout", text);
  }
}
