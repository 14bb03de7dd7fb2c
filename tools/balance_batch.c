/* balance_batch.c: `mtrain-balance batch`, SparseBalance's simulator
 * (docs/BALANCE.md, "SparseBalance"). Reads sequence lengths (a file, or the
 * documented long-tail generator), a budget file, a calibration table and R
 * ranks; predicts each rank's step seconds for token-count balancing,
 * length-sorted batching, cost batching and cost batching with
 * bidirectional sparsity tuning, and with --split-above the same with the
 * largest documents split over several ranks as a ring (token and cost
 * batching, cost with tuning); prints a per-rank table and the summary
 * (max, mean, max/mean, the step ratio to token-count balancing, recall),
 * or JSON, and draws the ranks' bars as a PNG. Everything is a prediction
 * of the cost predictor, never a measurement. */
#include "balance_batch.h"

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

#ifdef MTRAIN_HAVE_PNG
#include "canvas.h"
#endif

static const char *prog = "mtrain-balance batch";

static const char usage[] =
    "usage: mtrain-balance batch --budgets FILE --calibration FILE (--lengths FILE | --long-tail)\n"
    "                            [options]\n"
    "\n"
    "SparseBalance, predicted: deals a global batch of sequences to R data-parallel ranks\n"
    "by token count (the usual practice), by sorted length, and by predicted cost, then\n"
    "tunes each rank's per-head budget levels in both directions; prints each rank's\n"
    "predicted step seconds, max/mean and the step ratio to token-count balancing, and\n"
    "the mean and worst per-head recall (attention mass kept) before and after tuning.\n"
    "All figures are predictions of the calibrated cost predictor (docs/BALANCE.md).\n"
    "\n"
    "  --budgets FILE        MInference budget file: every layer and head\n"
    "  --calibration FILE    calibration JSON (data/calibration/)\n"
    "  --lengths FILE        sequence lengths, one integer per line ('#' starts a comment)\n"
    "  --long-tail           generate the long-tail mix: each document is long with\n"
    "                        probability --long-prob, length log-uniform in [131072, 524288],\n"
    "                        else log-uniform in [1024, 16384]; lengths rounded up to a\n"
    "                        multiple of 128; documents drawn until the batch holds\n"
    "                        --tokens-per-rank * --world tokens\n"
    "  --long-prob P         (default 0.02: about half the tokens in long documents)\n"
    "  --tokens-per-rank T   (default 1048576)\n"
    "  --seed S              generator seed (default 1)\n"
    "  --world R             data-parallel ranks (default 8)\n"
    "  --micro-batches M     micro-batches per rank (default 1)\n"
    "  --levels LIST         budget scales, increasing; 1 is the untuned budget\n"
    "                        (default 0.25,0.5,0.75,1,1.5,2)\n"
    "  --bounds LO,HI        the tuner's bounds as scales (default: the first and last level)\n"
    "  --target S            step target in seconds (default: the mean rank time)\n"
    "  --split-above X       also split every document whose predicted seconds (token\n"
    "                        count for tokens+split) exceed X times the mean rank load over\n"
    "                        the fewest ranks that bring its per-rank share under it, as a\n"
    "                        context-parallel ring (methods tokens+split, cost+split,\n"
    "                        cost+split+tuned; default 0: off)\n"
    "  --ring-overhead F     factor on a split document's attention share per rank\n"
    "                        (default 1.01: ring/compute and layout imbalance measured)\n"
    "  --max-split K         most ranks one document may span (default 0: --world)\n"
    "  --budget-context C    scale budget counts by N / C per sequence (default 0: as given)\n"
    "  --spread even|local   the position model's placement of the verticals and slashes\n"
    "                        beyond the sinks and the window (default even)\n"
    "  --row-pairs FILE      price every head by a measured table on a length grid\n"
    "                        (tools/balance_row_pairs.py; interpolated in log N) instead\n"
    "                        of the position model; budgets as given (no --budget-context)\n"
    "  --profile-len N       tokens of the structured inputs the heads' mass curves are\n"
    "                        computed on (default 2048)\n"
    "  --profile-context C   the budgets are scaled by N / C for the profile (default 131072)\n"
    "  --hidden H --intermediate I --vocab V --kv-heads K --head-dim D\n"
    "                        model dimensions of the linear layers (default Qwen2.5-3B:\n"
    "                        2048, 11008, 151936, 2, 128)\n"
    "  --json                one JSON object on stdout instead of the table\n"
    "  --png FILE            bars of every rank's predicted seconds per method\n"
    "  --help                this text\n";

typedef struct bopts {
  const char *budgets, *calibration, *lengths, *png, *row_pairs;
  int long_tail, json;
  double long_prob, levels[16], lo_scale, hi_scale, target, split_above, ring_overhead;
  int64_t tokens_per_rank, budget_context, profile_len, profile_context;
  uint64_t seed;
  int32_t world, micro, nlevels, max_split;
  mtrain_spread_t spread;
  mtrain_balance_model_t model;
} bopts_t;

static int bad_value(const char *name, const char *s) {
  fprintf(stderr, "%s: --%s '%s': not a valid value (see --help)\n", prog, name, s);
  return 1;
}

static int get_i64(const char *name, const char *s, int64_t lo, int64_t *out) {
  char *end = NULL;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (end == s || *end || errno || v < lo) return bad_value(name, s);
  *out = v;
  return 0;
}

static int get_f(const char *name, const char *s, double *out) {
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || *end || !isfinite(v) || v < 0) return bad_value(name, s);
  *out = v;
  return 0;
}

static int parse(int argc, char **argv, bopts_t *o) {
  static const struct option longs[] = {{"budgets", required_argument, 0, 'b'},
                                        {"calibration", required_argument, 0, 'c'},
                                        {"lengths", required_argument, 0, 'L'},
                                        {"long-tail", no_argument, 0, 't'},
                                        {"long-prob", required_argument, 0, 'p'},
                                        {"tokens-per-rank", required_argument, 0, 'T'},
                                        {"seed", required_argument, 0, 's'},
                                        {"world", required_argument, 0, 'W'},
                                        {"micro-batches", required_argument, 0, 'M'},
                                        {"levels", required_argument, 0, 'l'},
                                        {"bounds", required_argument, 0, 'B'},
                                        {"target", required_argument, 0, 'g'},
                                        {"budget-context", required_argument, 0, 'C'},
                                        {"spread", required_argument, 0, 'S'},
                                        {"row-pairs", required_argument, 0, 'R'},
                                        {"profile-len", required_argument, 0, 'P'},
                                        {"profile-context", required_argument, 0, 'Q'},
                                        {"hidden", required_argument, 0, 'H'},
                                        {"intermediate", required_argument, 0, 'I'},
                                        {"vocab", required_argument, 0, 'V'},
                                        {"kv-heads", required_argument, 0, 'K'},
                                        {"head-dim", required_argument, 0, 'D'},
                                        {"split-above", required_argument, 0, 'x'},
                                        {"ring-overhead", required_argument, 0, 'o'},
                                        {"max-split", required_argument, 0, 'k'},
                                        {"json", no_argument, 0, 'j'},
                                        {"png", required_argument, 0, 'G'},
                                        {"help", no_argument, 0, 'h'},
                                        {0, 0, 0, 0}};
  const mtrain_balance_model_t model = MTRAIN_BALANCE_MODEL_INIT;
  static const double levels[] = {0.25, 0.5, 0.75, 1.0, 1.5, 2.0};
  memset(o, 0, sizeof *o);
  o->long_prob = 0.02;
  o->tokens_per_rank = 1048576;
  o->seed = 1;
  o->world = 8;
  o->micro = 1;
  o->nlevels = 6;
  memcpy(o->levels, levels, sizeof levels);
  o->lo_scale = o->hi_scale = -1;
  o->profile_len = 2048;
  o->profile_context = 131072;
  o->model = model;
  o->ring_overhead = 1.01;
  int c, bad = 0;
  int64_t v = 0;
  optind = 1;
  opterr = 0;
  while (!bad && (c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
    switch (c) {
    case 'b':
      o->budgets = optarg;
      break;
    case 'c':
      o->calibration = optarg;
      break;
    case 'L':
      o->lengths = optarg;
      break;
    case 't':
      o->long_tail = 1;
      break;
    case 'p':
      bad = get_f("long-prob", optarg, &o->long_prob) || o->long_prob > 1 ||
            (o->long_prob > 1 && bad_value("long-prob", optarg));
      break;
    case 'T':
      bad = get_i64("tokens-per-rank", optarg, 1, &o->tokens_per_rank);
      break;
    case 's':
      bad = get_i64("seed", optarg, 0, &v);
      o->seed = (uint64_t)v;
      break;
    case 'W':
      bad = get_i64("world", optarg, 1, &v) || (v > 65536 && bad_value("world", optarg));
      o->world = (int32_t)v;
      break;
    case 'M':
      bad = get_i64("micro-batches", optarg, 1, &v) ||
            (v > 4096 && bad_value("micro-batches", optarg));
      o->micro = (int32_t)v;
      break;
    case 'l': {
      o->nlevels = 0;
      const char *s = optarg;
      while (*s && !bad) {
        char *end = NULL;
        const double x = strtod(s, &end);
        if (end == s || !(x > 0) || !isfinite(x) || o->nlevels >= 16 || (*end && *end != ','))
          bad = bad_value("levels", optarg);
        else
          o->levels[o->nlevels++] = x;
        s = *end ? end + 1 : end;
      }
      if (!bad && o->nlevels == 0) bad = bad_value("levels", optarg);
      break;
    }
    case 'B':
      if (sscanf(optarg, "%lf,%lf", &o->lo_scale, &o->hi_scale) != 2 || !(o->lo_scale > 0) ||
          !(o->hi_scale >= o->lo_scale))
        bad = bad_value("bounds", optarg);
      break;
    case 'g':
      bad = get_f("target", optarg, &o->target);
      break;
    case 'C':
      bad = get_i64("budget-context", optarg, 0, &o->budget_context);
      break;
    case 'S':
      if (strcmp(optarg, "even") == 0)
        o->spread = MTRAIN_SPREAD_EVEN;
      else if (strcmp(optarg, "local") == 0)
        o->spread = MTRAIN_SPREAD_LOCAL;
      else
        bad = bad_value("spread", optarg);
      break;
    case 'R':
      o->row_pairs = optarg;
      break;
    case 'P':
      bad = get_i64("profile-len", optarg, 256, &o->profile_len);
      break;
    case 'Q':
      bad = get_i64("profile-context", optarg, 0, &o->profile_context);
      break;
    case 'H':
      bad = get_i64("hidden", optarg, 0, &o->model.hidden);
      break;
    case 'I':
      bad = get_i64("intermediate", optarg, 0, &o->model.intermediate);
      break;
    case 'V':
      bad = get_i64("vocab", optarg, 0, &o->model.vocab);
      break;
    case 'K':
      bad = get_i64("kv-heads", optarg, 1, &v);
      o->model.kv_heads = (int32_t)v;
      break;
    case 'D':
      bad = get_i64("head-dim", optarg, 1, &v);
      o->model.head_dim = (int32_t)v;
      break;
    case 'x':
      bad = get_f("split-above", optarg, &o->split_above);
      break;
    case 'o':
      bad = get_f("ring-overhead", optarg, &o->ring_overhead) ||
            (o->ring_overhead < 1 && bad_value("ring-overhead", optarg));
      break;
    case 'k':
      bad = get_i64("max-split", optarg, 0, &v) || (v > 65536 && bad_value("max-split", optarg));
      o->max_split = (int32_t)v;
      break;
    case 'j':
      o->json = 1;
      break;
    case 'G':
      o->png = optarg;
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
    fprintf(stderr, "%s: unexpected argument '%s'\n", prog, argv[optind]);
    return 1;
  }
  if (o->max_split > o->world) {
    fprintf(stderr, "%s: --max-split %d exceeds --world %d\n", prog, o->max_split, o->world);
    return 1;
  }
  if (o->row_pairs && (o->budget_context || o->spread != MTRAIN_SPREAD_EVEN)) {
    fprintf(stderr,
            "%s: --row-pairs prices the budgets as given by its measured table: "
            "--budget-context and --spread do not apply\n",
            prog);
    return 1;
  }
  if (!o->budgets || !o->calibration || !o->lengths == !o->long_tail) {
    fprintf(stderr,
            "%s: give --budgets, --calibration and exactly one of --lengths FILE or "
            "--long-tail (see --help)\n",
            prog);
    return 1;
  }
  return 0;
}

/* ---- lengths --------------------------------------------------------------------------- */

static uint64_t mix64(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static double unit(uint64_t *s) { return (double)(mix64(s) >> 11) * 0x1.0p-53; }

static int64_t *long_tail(const bopts_t *o, int32_t *n) {
  const double total = (double)o->tokens_per_rank * o->world;
  int32_t cap = 1024, m = 0;
  int64_t *len = malloc((size_t)cap * sizeof *len);
  uint64_t s = o->seed;
  double sum = 0;
  while (len && sum < total) {
    const int is_long = unit(&s) < o->long_prob;
    const double lo = is_long ? 131072 : 1024, hi = is_long ? 524288 : 16384;
    const double x = lo * exp(unit(&s) * log(hi / lo));
    int64_t v = ((int64_t)ceil(x) + 127) / 128 * 128;
    if (m == cap) {
      int64_t *g = realloc(len, (size_t)(cap *= 2) * sizeof *len);
      if (!g) {
        free(len);
        return NULL;
      }
      len = g;
    }
    len[m++] = v;
    sum += (double)v;
  }
  *n = m;
  return len;
}

static int64_t *read_lengths(const char *path, int32_t *n) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "%s: %s: %s\n", prog, path, strerror(errno));
    return NULL;
  }
  int32_t cap = 1024, m = 0, line = 0;
  int64_t *len = malloc((size_t)cap * sizeof *len);
  char buf[256];
  while (len && fgets(buf, sizeof buf, f)) {
    line++;
    char *hash = strchr(buf, '#');
    if (hash) *hash = '\0';
    char *p = buf, *end = NULL;
    while (*p == ' ' || *p == '\t') p++;
    if (!*p || *p == '\n' || *p == '\r') continue;
    errno = 0;
    long long v = strtoll(p, &end, 10);
    while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r') end++;
    if (end == p || *end || errno || v < 1) {
      fprintf(stderr, "%s: %s: line %d: expected one length >= 1\n", prog, path, line);
      free(len);
      fclose(f);
      return NULL;
    }
    if (m == cap) {
      int64_t *g = realloc(len, (size_t)(cap *= 2) * sizeof *len);
      if (!g) break;
      len = g;
    }
    len[m++] = v;
  }
  fclose(f);
  if (len && m == 0) {
    fprintf(stderr, "%s: %s: no lengths\n", prog, path);
    free(len);
    return NULL;
  }
  *n = m;
  return len;
}

/* ---- mass curves from structured inputs -------------------------------------------------- */

static double *mass_curves(const bopts_t *o, const mtrain_budgets_t *b, int32_t heads) {
  const int32_t nl = mtrain_budgets_num_layers(b), K = o->nlevels, d = o->model.head_dim;
  double *mass = malloc((size_t)heads * K * sizeof *mass);
  const int64_t N = o->profile_len;
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  int rc = mass == NULL;
  for (int32_t l = 0, g = 0; l < nl && !rc; l++) {
    const int32_t hq = mtrain_budgets_num_heads(b, l), hkv = o->model.kv_heads;
    float *q = malloc(sizeof(float) * (size_t)N * hq * d),
          *k = malloc(sizeof(float) * (size_t)N * hkv * d),
          *v = malloc(sizeof(float) * (size_t)N * hkv * d);
    mtrain_head_budget_t *hb = malloc(sizeof *hb * (size_t)hq);
    rc = !q || !k || !v || !hb;
    for (int32_t h = 0; h < hq && !rc; h++) rc = mtrain_budgets_get(b, l, h, &hb[h]) != 0;
    if (!rc) {
      mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, hq, d),
                      tk = mtrain_tensor_3d(k, MTRAIN_F32, N, hkv, d),
                      tv = mtrain_tensor_3d(v, MTRAIN_F32, N, hkv, d);
      mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
      so.seed = 1000 + (uint64_t)l;
      rc = tool_failed(prog, "profile inputs", mtrain_generate_structured(&so, &tq, &tk, &tv)) ||
           tool_failed(prog, "mass curve",
                       mtrain_balance_mass_curve(q, k, N, hq, hkv, d, 128, hb, o->levels, K,
                                                 o->profile_context, &eo, mass + (size_t)g * K));
    }
    g += hq;
    free(q);
    free(k);
    free(v);
    free(hb);
  }
  if (rc) {
    free(mass);
    return NULL;
  }
  return mass;
}

/* ---- the methods: four, and three more with splitting ------------------------------------ */

enum { M_TOKENS, M_SORTED, M_COST, M_TUNED, M_TSPLIT, M_SPLIT, M_SPLIT_TUNED, M_COUNT };
static const char *method_names[M_COUNT] = {
    "tokens", "sorted", "cost", "cost+tuned", "tokens+split", "cost+split", "cost+split+tuned"};

static int is_tuned(int m) { return m == M_TUNED || m == M_SPLIT_TUNED; }
static int is_split(int m) { return m >= M_TSPLIT; }

typedef struct run {
  int32_t *rank_of, *micro_of, *levels;
  double *before, *after;
  mtrain_balance_report_t rep;
  mtrain_balance_split_t split; /* the split methods' assignment (seconds) */
} run_t;

/* The rank seconds a method is judged by: after tuning for the tuned ones. */
static const double *rank_seconds(const run_t *runs, int m) {
  return is_tuned(m) ? runs[m].after : runs[m].before;
}

/* Waits of the split phase: the largest of any rank and their sum. */
static void split_idle(const run_t *r, int32_t R, double *mx, double *sum) {
  *mx = *sum = 0;
  for (int32_t q = 0; q < R; q++) {
    *mx = r->split.rank_idle[q] > *mx ? r->split.rank_idle[q] : *mx;
    *sum += r->split.rank_idle[q];
  }
}

#ifdef MTRAIN_HAVE_PNG
static int draw(const bopts_t *o, run_t *runs, int nm) {
  const int R = o->world, bar = R > 64 ? 2 : R > 16 ? 6 : 16, gap = R > 64 ? 0 : 2;
  const int pw = 260, ph = R * (bar + gap), top = 60, left = 16;
  canvas_t cv;
  if (canvas_init(&cv, left + nm * (pw + 24), top + ph + 40)) return 1;
  double vmax = 0;
  for (int m = 0; m < nm; m++)
    for (int r = 0; r < R; r++) {
      const double x = rank_seconds(runs, m)[r];
      vmax = x > vmax ? x : vmax;
    }
  static const unsigned char ink[3] = {20, 20, 20},
                             fill[M_COUNT][3] = {{200, 90, 70}, {220, 160, 60}, {70, 130, 200},
                                                 {60, 160, 90}, {170, 80, 150}, {40, 150, 170},
                                                 {30, 110, 60}};
  static const unsigned char meanc[3] = {0, 0, 0};
  char line[160];
  snprintf(line, sizeof line, "PREDICTED SECONDS PER RANK, R=%d (PREDICTIONS, NOT MEASURED)", R);
  canvas_text(&cv, left, 8, 2, line, ink);
  for (int m = 0; m < nm; m++) {
    const int x0 = left + m * (pw + 24);
    const double *v = rank_seconds(runs, m);
    double mean = 0, mx = 0;
    for (int r = 0; r < R; r++) {
      mean += v[r] / R;
      mx = v[r] > mx ? v[r] : mx;
      const int w = (int)lround(pw * v[r] / vmax);
      canvas_fill(&cv, x0, top + r * (bar + gap), w, bar, fill[m]);
    }
    canvas_fill(&cv, x0 + (int)lround(pw * mean / vmax), top - 4, 2, ph + 8, meanc);
    snprintf(line, sizeof line, "%s", method_names[m]);
    for (char *c = line; *c; c++) *c = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
    canvas_text(&cv, x0, top - 34, 2, line, ink);
    snprintf(line, sizeof line, "MAX/MEAN %.3f", mx / mean);
    canvas_text(&cv, x0, top - 18, 1, line, ink);
    snprintf(line, sizeof line, "MAX %.1fS", mx);
    canvas_text(&cv, x0, top + ph + 8, 1, line, ink);
  }
  char err[300];
  const int rc = canvas_write_png(&cv, o->png, err, sizeof err);
  if (rc) fprintf(stderr, "%s: --png: %s\n", prog, err);
  canvas_free(&cv);
  return rc;
}
#else
static int draw(const bopts_t *o, run_t *runs, int nm) {
  (void)runs;
  (void)nm;
  fprintf(stderr, "%s: --png %s: this build has no libpng\n", prog, o->png);
  return 1;
}
#endif

int balance_batch_main(int argc, char **argv) {
  bopts_t o;
  const int prc = parse(argc, argv, &o);
  if (prc) return prc == 2 ? 0 : 2;
  int rc = 1;
  mtrain_budgets_t *b = NULL;
  mtrain_balance_predictor_t *pred = NULL;
  mtrain_balance_calibration_t cal;
  int64_t *len = NULL;
  double *mass = NULL;
  run_t runs[M_COUNT];
  memset(runs, 0, sizeof runs);
  int32_t n = 0, base = -1, lo = 0, hi = o.nlevels - 1;
  for (int32_t k = 0; k < o.nlevels; k++) {
    if (o.levels[k] == 1.0) base = k;
    if (k && !(o.levels[k] > o.levels[k - 1])) base = -2;
  }
  if (base < 0) {
    fprintf(stderr, "%s: --levels must be strictly increasing and hold 1 (the untuned budget)\n",
            prog);
    return 2;
  }
  if (o.lo_scale > 0) {
    lo = hi = -1;
    for (int32_t k = 0; k < o.nlevels; k++) {
      if (lo < 0 && o.levels[k] >= o.lo_scale * (1 - 1e-12)) lo = k;
      if (o.levels[k] <= o.hi_scale * (1 + 1e-12)) hi = k;
    }
    if (lo < 0 || hi < lo) {
      fprintf(stderr, "%s: --bounds %g,%g hold no level of --levels\n", prog, o.lo_scale,
              o.hi_scale);
      return 2;
    }
  }
  if (tool_failed(prog, o.budgets, mtrain_budgets_read(o.budgets, &b)) ||
      tool_failed(prog, o.calibration, mtrain_balance_calibration_read(o.calibration, &cal)))
    goto done;
  len = o.long_tail ? long_tail(&o, &n) : read_lengths(o.lengths, &n);
  if (!len) goto done;
  mtrain_position_model_t pm = MTRAIN_POSITION_MODEL_INIT;
  pm.budget_context = o.budget_context;
  pm.spread = o.spread;
  if (tool_failed(prog, "predictor",
                  mtrain_balance_predictor_create(b, o.levels, o.nlevels, base, &pm, 128, &cal,
                                                  &o.model, &pred)))
    goto done;
  if (o.row_pairs &&
      tool_failed(prog, o.row_pairs, mtrain_balance_predictor_read_row_pairs(pred, o.row_pairs)))
    goto done;
  const int32_t H = mtrain_balance_predictor_num_heads(pred), R = o.world;
  const double t0 = tool_now();
  mass = mass_curves(&o, b, H);
  if (!mass) goto done;
  const double t_mass = tool_now() - t0;
  const int nm = o.split_above > 0 ? M_COUNT : M_TSPLIT;
  double t_batch[M_COUNT];
  for (int m = 0; m < nm; m++) {
    run_t *r = &runs[m];
    r->rank_of = malloc((size_t)n * sizeof(int32_t));
    r->micro_of = malloc((size_t)n * sizeof(int32_t));
    r->levels = malloc((size_t)R * H * sizeof(int32_t));
    r->before = malloc((size_t)R * sizeof(double));
    r->after = malloc((size_t)R * sizeof(double));
    if (!r->rank_of || !r->micro_of || !r->levels || !r->before || !r->after) goto done;
    mtrain_balance_batch_options_t bo = MTRAIN_BALANCE_BATCH_INIT;
    bo.ranks = R;
    bo.micro_batches = o.micro;
    bo.method = m == M_TOKENS || m == M_TSPLIT ? MTRAIN_BATCH_TOKENS
                : m == M_SORTED                ? MTRAIN_BATCH_SORTED
                                               : MTRAIN_BATCH_COST;
    bo.tune = is_tuned(m);
    bo.min_level = lo;
    bo.max_level = hi;
    bo.target_s = o.target;
    const double t1 = tool_now();
    mtrain_status_t st;
    if (is_split(m)) {
      mtrain_balance_split_options_t so = MTRAIN_BALANCE_SPLIT_INIT;
      so.split_above = o.split_above;
      so.ring_overhead = o.ring_overhead;
      so.max_ranks = o.max_split;
      st = mtrain_balance_batch_split(pred, len, n, mass, &bo, &so, &r->split, r->levels, r->before,
                                      r->after, &r->rep);
      if (st == MTRAIN_SUCCESS) {
        memcpy(r->rank_of, r->split.rank_of, (size_t)n * sizeof(int32_t));
        memcpy(r->micro_of, r->split.micro_of, (size_t)n * sizeof(int32_t));
      }
    } else {
      st = mtrain_balance_batch(pred, len, n, mass, &bo, r->rank_of, r->micro_of, r->levels,
                                r->before, r->after, &r->rep);
    }
    if (tool_failed(prog, method_names[m], st)) goto done;
    t_batch[m] = tool_now() - t1;
  }
  double tokens = 0;
  int32_t longs = 0;
  for (int32_t i = 0; i < n; i++) {
    tokens += (double)len[i];
    longs += len[i] >= 131072;
  }
  const double step_tok = runs[M_TOKENS].rep.max_before;
  if (o.json) {
    json_t *methods = json_object();
    for (int m = 0; m < nm; m++) {
      const mtrain_balance_report_t *p = &runs[m].rep;
      const int tuned = is_tuned(m);
      const double mx = tuned ? p->max_after : p->max_before,
                   mean = tuned ? p->mean_after : p->mean_before;
      json_t *ranks = json_array();
      for (int32_t r = 0; r < R; r++)
        json_array_append_new(ranks, json_real(rank_seconds(runs, m)[r]));
      json_t *obj = json_pack(
          "{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:i, s:i, s:I, s:I, s:f, s:o}", "max_s", mx,
          "mean_s", mean, "max_over_mean", mx / mean, "step_ratio_vs_tokens", step_tok / mx,
          "recall_mean", tuned ? p->recall_after : p->recall_before, "recall_worst",
          tuned ? p->worst_recall_after : p->worst_recall_before, "target_s", p->target_s,
          "recall_mean_untuned", p->recall_before, "ranks_over_target", p->ranks_over_target,
          "empty_ranks", p->empty_ranks, "moves_down", (json_int_t)p->moves_down, "moves_up",
          (json_int_t)p->moves_up, "seconds_to_solve", t_batch[m], "rank_seconds", ranks);
      if (is_split(m)) {
        const mtrain_balance_split_t *sp = &runs[m].split;
        json_t *docs = json_array();
        for (int32_t j = 0; j < sp->num_split; j++) {
          const int32_t i = sp->split_order[j];
          json_t *g = json_array();
          for (int32_t q = sp->offset[i]; q < sp->offset[i + 1]; q++)
            json_array_append_new(g, json_integer(sp->group[q]));
          json_array_append_new(docs,
                                json_pack("{s:i, s:I, s:i, s:f, s:f, s:o}", "document", i, "tokens",
                                          (json_int_t)len[i], "ranks", sp->num_ranks[i], "share_s",
                                          sp->share[i], "start_s", sp->start[i], "group", g));
        }
        double imx, isum;
        split_idle(&runs[m], R, &imx, &isum);
        json_object_set_new(obj, "split_documents", docs);
        json_object_set_new(obj, "split_idle_max_s", json_real(imx));
        json_object_set_new(obj, "split_idle_sum_s", json_real(isum));
      }
      json_object_set_new(methods, method_names[m], obj);
    }
    json_t *root =
        json_pack("{s:s, s:s, s:s, s:i, s:i, s:i, s:f, s:i, s:I, s:f, s:f, s:i, s:f, s:o}", "tool",
                  "mtrain-balance batch", "budgets", o.budgets, "calibration", o.calibration,
                  "world", R, "sequences", n, "long_sequences", longs, "tokens", tokens,
                  "micro_batches", o.micro, "budget_context", (json_int_t)o.budget_context,
                  "split_above", o.split_above, "ring_overhead", o.ring_overhead, "max_split",
                  o.max_split, "mass_curve_seconds", t_mass, "methods", methods);
    json_dumpf(root, stdout, JSON_INDENT(1) | JSON_REAL_PRECISION(8));
    fputc('\n', stdout);
    json_decref(root);
  } else {
    printf(
        "mtrain-balance batch: %d sequences (%d of >= 128K), %.0f tokens, R=%d, %d micro-batch%s;"
        " budgets %s (%s), calibration %s\n",
        n, longs, tokens, R, o.micro, o.micro > 1 ? "es" : "", o.budgets,
        o.budget_context ? "scaled by N/C" : "as given", o.calibration);
    printf("PREDICTED seconds per rank (forward + backward of one step; cost predictor, not "
           "measured)\n");
    printf("%5s", "rank");
    for (int m = 0; m < nm; m++) printf(" %*s", m < M_TSPLIT ? 12 : 17, method_names[m]);
    printf("\n");
    for (int32_t r = 0; r < R; r++) {
      printf("%5d", r);
      for (int m = 0; m < nm; m++)
        printf(" %*.3f", m < M_TSPLIT ? 12 : 17, rank_seconds(runs, m)[r]);
      printf("\n");
    }
    printf("\n%-16s %10s %10s %9s %11s %12s %12s\n", "method", "max s", "mean s", "max/mean",
           "step ratio", "mean recall", "worst recall");
    for (int m = 0; m < nm; m++) {
      const mtrain_balance_report_t *p = &runs[m].rep;
      const int tuned = is_tuned(m);
      const double mx = tuned ? p->max_after : p->max_before,
                   mean = tuned ? p->mean_after : p->mean_before;
      printf("%-16s %10.3f %10.3f %9.4f %10.3fx %12.4f %12.4f\n", method_names[m], mx, mean,
             mx / mean, step_tok / mx, tuned ? p->recall_after : p->recall_before,
             tuned ? p->worst_recall_after : p->worst_recall_before);
    }
    for (int m = M_TUNED; m < nm; m += M_SPLIT_TUNED - M_TUNED) {
      const mtrain_balance_report_t *p = &runs[m].rep;
      printf("\n%s: target %.3f s, levels in [%g, %g] x budget, %lld steps down, %lld up, %d "
             "rank(s) over the target (fallback: lowest allowed levels)%s\n",
             method_names[m], p->target_s, o.levels[lo], o.levels[hi], (long long)p->moves_down,
             (long long)p->moves_up, p->ranks_over_target,
             p->empty_ranks ? "; some ranks got no sequence" : "");
    }
    for (int m = M_TSPLIT; m < nm; m++) {
      const mtrain_balance_split_t *sp = &runs[m].split;
      int32_t hist[8] = {0}; /* k = 2..8, and more */
      int32_t kmax = 1;
      for (int32_t i = 0; i < n; i++) {
        const int32_t k = sp->num_ranks[i];
        if (k > 1) hist[k - 2 < 7 ? k - 2 : 7]++;
        kmax = k > kmax ? k : kmax;
      }
      double imx, isum;
      split_idle(&runs[m], R, &imx, &isum);
      printf("%s: %d document(s) split (above %g x the mean rank load, ring overhead %g):",
             method_names[m], sp->num_split, o.split_above, o.ring_overhead);
      for (int k = 0; k < 8; k++)
        if (hist[k]) printf(" %d over %s%d,", hist[k], k == 7 ? ">= " : "", k + 2);
      printf(" the most %d ranks; split-phase waits: largest %.3f s, sum %.3f s\n", kmax, imx,
             isum);
    }
    printf("solve seconds: mass curves %.2f", t_mass);
    for (int m = 0; m < nm; m++) printf("; %s %.2f", method_names[m], t_batch[m]);
    printf("\n");
  }
  rc = o.png ? draw(&o, runs, nm) : 0;
done:
  for (int m = 0; m < M_COUNT; m++) {
    free(runs[m].rank_of);
    free(runs[m].micro_of);
    free(runs[m].levels);
    free(runs[m].before);
    free(runs[m].after);
    mtrain_balance_split_free(&runs[m].split);
  }
  free(mass);
  free(len);
  mtrain_balance_predictor_destroy(pred);
  mtrain_budgets_destroy(b);
  return rc;
}
