/* mtrain_balance.c: the balance analyser. No tensors: the workload is a
 * budget file under the position model (all layers and heads) or a pattern
 * file; for each layout asked for it evaluates the cost model (worker
 * imbalance, ring-sync slowdown of the whole model, of every layer and
 * head, flat and hierarchical rings) and the time model, and prints a
 * table, one JSON object (--json) and a heatmap of work per rank and ring
 * step (--png). docs/BALANCE.md describes the models. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "balance_batch.h"
#include "balance_png.h"
#include "mtrain/mtrain.h"
#include "mtrain/mtrain_balance.h"
#include "mtrain/mtrain_io.h"
#include "tool_common.h"

static const char *prog = "mtrain-balance";

static const char usage[] =
    "usage: mtrain-balance (--budgets FILE --seq-len N | --pattern FILE) [options]\n"
    "\n"
    "Balance of sparse ring attention under the cost model of SPEC.md section 6, without\n"
    "tensors: worker imbalance (max/mean of each rank's total work) and ring-sync slowdown\n"
    "(sum over layers and steps of the max over ranks / the same of the mean) of the whole\n"
    "model, of each layer and of each head, for the flat and the hierarchical ring, and the\n"
    "predicted ring time. docs/BALANCE.md explains the layouts and the models.\n"
    "\n"
    "workload:\n"
    "  --budgets FILE        MInference budget file: every layer and head (static top-k\n"
    "                        entries; top-p entries use their caps as the counts)\n"
    "  --pattern FILE        pattern JSON (SPEC.md section 8): one layer, used as it is\n"
    "  --seq-len N           tokens (required with --budgets; with --pattern it must match)\n"
    "  --granularity G       block size (default 128; with --pattern, the file's)\n"
    "position model (with --budgets): each head gets v verticals and s token slashes\n"
    "  (its v_size and s_size), placed as SPEC.md section 2 forces them first:\n"
    "    verticals: keys 0..min(v, sinks)-1, the rest spread over the later keys\n"
    "               outside the last G-block (never selectable)\n"
    "    slashes:   token diagonals 0..min(s, window)-1, the rest spread over the later\n"
    "               diagonals; token diagonal t = a*G + b -> block diagonals a and\n"
    "               (b > 0) a+1\n"
    "  --sinks K             sink keys (default 30)\n"
    "  --window T            local-window token diagonals (default 100)\n"
    "  --spread MODE         the rest: even (evenly spaced midpoints, default), random\n"
    "                        (uniform without replacement, seeded per (seed, layer, head))\n"
    "                        or local (packed right after the sinks and the window)\n"
    "  --seed S              seed of --spread random (default 0)\n"
    "  --budget-context C    scale v and s by N / C (default: budgets used as given)\n"
    "layouts and cluster:\n"
    "  --world W             ranks (default 32)\n"
    "  --ranks-per-node L    GPUs per node, a divisor of W: the hierarchical ring's inner\n"
    "                        ring and which links are intra-node (default 8 when it divides\n"
    "                        W, else W: one node)\n"
    "  --layout K            contiguous, zigzag, striped, balanced or all (default all)\n"
    "  --schedule flat|hier  the ring the table, JSON metrics and picture lead with, and\n"
    "                        the one the balanced layout is optimised for (default flat)\n"
    "  --bars MODE           layout (default: each layout's own), in_ring or gathered\n"
    "time model (assumed machine, not measured):\n"
    "  --tflops X            effective attention TFLOP/s of one GPU (default 150)\n"
    "  --bw-intra GBPS       GB/s one GPU sends inside its node (default 150)\n"
    "  --bw-inter GBPS       GB/s one GPU sends to another node (default 25)\n"
    "  --latency-us US       per message (default 10)\n"
    "  --head-dim D          (default 128)\n"
    "  --kv-heads K          K/V heads per layer (default: the query heads)\n"
    "  --dtype-bytes B       bytes per stored K/V element (default 2)\n"
    "output:\n"
    "  --json                one JSON object on stdout instead of the table\n"
    "  --png FILE            heatmap: one panel per layout, rows = ranks, columns = ring\n"
    "                        steps, colour = whole-model work / mean work of a (rank, step)\n"
    "  --steps               also print that work table per layout (text)\n"
    "  --head L,H            picture and --steps table of head H of layer L alone (same\n"
    "                        layout and bars mode) instead of the whole model\n"
    "  --help                this text\n"
    "\n"
    "SparseBalance (sparsity-aware batching and sparsity tuning, predicted): a mode of\n"
    "its own, with its own options: mtrain-balance batch --help\n";

typedef struct options {
  const char *budgets, *pattern, *png;
  int64_t seq_len;
  int32_t granularity, world, ranks_per_node, json, steps;
  int32_t focus_layer, focus_head; /* --head L,H; -1: the whole model */
  int32_t layouts[4], num_layouts;
  mtrain_ring_kind_t ring;
  int32_t bars_mode; /* -1: the layout's */
  mtrain_position_model_t model;
  mtrain_time_params_t time;
} options_t;

/* ---- option parsing ------------------------------------------------------------- */

static int parse_i64(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out) {
  char *end = NULL;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (end == s || *end || errno || v < lo || v > hi) {
    fprintf(stderr, "%s: --%s '%s': expected an integer in [%lld, %lld]\n", prog, name, s,
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

static int parse_pos(const char *name, const char *s, double scale, double *out) {
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || *end || !(v > 0) || !isfinite(v)) {
    fprintf(stderr, "%s: --%s '%s': expected a positive number\n", prog, name, s);
    return 1;
  }
  *out = v * scale;
  return 0;
}

/* Returns 0 to run, 1 on a usage error, 2 after --help. */
static int parse_options(int argc, char **argv, options_t *o) {
  static const struct option longs[] = {{"budgets", required_argument, 0, 'B'},
                                        {"pattern", required_argument, 0, 'p'},
                                        {"seq-len", required_argument, 0, 'N'},
                                        {"granularity", required_argument, 0, 'G'},
                                        {"sinks", required_argument, 0, 'k'},
                                        {"window", required_argument, 0, 'w'},
                                        {"spread", required_argument, 0, 'S'},
                                        {"seed", required_argument, 0, 's'},
                                        {"budget-context", required_argument, 0, 'C'},
                                        {"world", required_argument, 0, 'W'},
                                        {"ranks-per-node", required_argument, 0, 'L'},
                                        {"layout", required_argument, 0, 'l'},
                                        {"schedule", required_argument, 0, 'r'},
                                        {"bars", required_argument, 0, 'b'},
                                        {"tflops", required_argument, 0, 'F'},
                                        {"bw-intra", required_argument, 0, 'I'},
                                        {"bw-inter", required_argument, 0, 'E'},
                                        {"latency-us", required_argument, 0, 'T'},
                                        {"head-dim", required_argument, 0, 'D'},
                                        {"kv-heads", required_argument, 0, 'K'},
                                        {"dtype-bytes", required_argument, 0, 'y'},
                                        {"json", no_argument, 0, 'j'},
                                        {"png", required_argument, 0, 'P'},
                                        {"steps", no_argument, 0, 't'},
                                        {"head", required_argument, 0, 'H'},
                                        {"help", no_argument, 0, 'h'},
                                        {0, 0, 0, 0}};
  const mtrain_position_model_t model = MTRAIN_POSITION_MODEL_INIT;
  const mtrain_time_params_t time = MTRAIN_TIME_PARAMS_INIT;
  memset(o, 0, sizeof *o);
  o->granularity = 0;
  o->world = 32;
  o->ranks_per_node = -1;
  o->ring = MTRAIN_RING_FLAT;
  o->bars_mode = -1;
  o->model = model;
  o->time = time;
  o->num_layouts = 4;
  o->focus_layer = o->focus_head = -1;
  for (int k = 0; k < 4; k++) o->layouts[k] = k;
  int c, bad = 0;
  int64_t seed = 0;
  double us = 0;
  opterr = 0;
  while (!bad && (c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
    switch (c) {
    case 'B':
      o->budgets = optarg;
      break;
    case 'p':
      o->pattern = optarg;
      break;
    case 'N':
      bad = parse_i64("seq-len", optarg, 1, (int64_t)1 << 40, &o->seq_len);
      break;
    case 'G':
      bad = parse_i32("granularity", optarg, 1, 1 << 20, &o->granularity);
      break;
    case 'k':
      bad = parse_i32("sinks", optarg, 0, 1 << 30, &o->model.num_sinks);
      break;
    case 'w':
      bad = parse_i32("window", optarg, 0, 1 << 30, &o->model.window);
      break;
    case 'S':
      if (strcmp(optarg, "even") == 0) {
        o->model.spread = MTRAIN_SPREAD_EVEN;
      } else if (strcmp(optarg, "random") == 0) {
        o->model.spread = MTRAIN_SPREAD_RANDOM;
      } else if (strcmp(optarg, "local") == 0) {
        o->model.spread = MTRAIN_SPREAD_LOCAL;
      } else {
        fprintf(stderr, "%s: --spread '%s': expected even, random or local\n", prog, optarg);
        bad = 1;
      }
      break;
    case 's':
      bad = parse_i64("seed", optarg, 0, INT64_MAX, &seed);
      o->model.seed = (uint64_t)seed;
      break;
    case 'C':
      bad = parse_i64("budget-context", optarg, 1, (int64_t)1 << 40, &o->model.budget_context);
      break;
    case 'W':
      bad = parse_i32("world", optarg, 1, 1 << 16, &o->world);
      break;
    case 'L':
      bad = parse_i32("ranks-per-node", optarg, 1, 1 << 16, &o->ranks_per_node);
      break;
    case 'l':
      if (strcmp(optarg, "all") == 0) break;
      mtrain_layout_kind_t k;
      if (mtrain_layout_kind_parse(optarg, &k) != MTRAIN_SUCCESS) {
        fprintf(stderr,
                "%s: --layout '%s': expected contiguous, zigzag, striped, balanced or all\n", prog,
                optarg);
        bad = 1;
        break;
      }
      o->layouts[0] = (int32_t)k;
      o->num_layouts = 1;
      break;
    case 'r':
      if (strcmp(optarg, "flat") == 0) {
        o->ring = MTRAIN_RING_FLAT;
      } else if (strcmp(optarg, "hier") == 0 || strcmp(optarg, "hierarchical") == 0) {
        o->ring = MTRAIN_RING_HIERARCHICAL;
      } else {
        fprintf(stderr, "%s: --schedule '%s': expected flat or hier\n", prog, optarg);
        bad = 1;
      }
      break;
    case 'b':
      if (strcmp(optarg, "layout") == 0) {
        o->bars_mode = -1;
      } else if (strcmp(optarg, "in_ring") == 0 || strcmp(optarg, "ring") == 0) {
        o->bars_mode = MTRAIN_BARS_IN_RING;
      } else if (strcmp(optarg, "gathered") == 0) {
        o->bars_mode = MTRAIN_BARS_GATHERED;
      } else {
        fprintf(stderr, "%s: --bars '%s': expected layout, in_ring or gathered\n", prog, optarg);
        bad = 1;
      }
      break;
    case 'F':
      bad = parse_pos("tflops", optarg, 1e12, &o->time.flops);
      break;
    case 'I':
      bad = parse_pos("bw-intra", optarg, 1e9, &o->time.bw_intra);
      break;
    case 'E':
      bad = parse_pos("bw-inter", optarg, 1e9, &o->time.bw_inter);
      break;
    case 'T':
      bad = parse_pos("latency-us", optarg, 1e-6, &us);
      o->time.latency = us;
      break;
    case 'D':
      bad = parse_i32("head-dim", optarg, 1, 1 << 16, &o->time.head_dim);
      break;
    case 'K':
      bad = parse_i32("kv-heads", optarg, 1, 1 << 16, &o->time.kv_heads);
      break;
    case 'y':
      bad = parse_i32("dtype-bytes", optarg, 1, 16, &o->time.dtype_bytes);
      break;
    case 'j':
      o->json = 1;
      break;
    case 'P':
      o->png = optarg;
      break;
    case 't':
      o->steps = 1;
      break;
    case 'H': {
      int a = -1, b = -1, used = 0;
      if (sscanf(optarg, "%d,%d%n", &a, &b, &used) != 2 || optarg[used] || a < 0 || b < 0) {
        fprintf(stderr, "%s: --head '%s': expected LAYER,HEAD (two integers >= 0)\n", prog, optarg);
        bad = 1;
      }
      o->focus_layer = a;
      o->focus_head = b;
      break;
    }
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
  if (!o->budgets == !o->pattern) {
    fprintf(stderr, "%s: give exactly one of --budgets FILE or --pattern FILE (see --help)\n",
            prog);
    return 1;
  }
  if (o->budgets && o->seq_len == 0) {
    fprintf(stderr, "%s: --budgets needs --seq-len N\n", prog);
    return 1;
  }
  if (o->ranks_per_node < 0) o->ranks_per_node = o->world % 8 == 0 ? 8 : o->world;
  if (o->ranks_per_node > o->world || o->world % o->ranks_per_node != 0) {
    fprintf(stderr, "%s: --ranks-per-node %d must divide --world %d\n", prog, o->ranks_per_node,
            o->world);
    return 1;
  }
  return 0;
}

/* ---- the workload ------------------------------------------------------------------ */

typedef struct workload {
  mtrain_pattern_t **patterns;
  mtrain_pattern_t *focus; /* --head: a one-head copy of that head */
  int32_t num_layers, num_heads, top_p_entries;
  int64_t seq_len;
  int32_t granularity;
} workload_t;

static void workload_free(workload_t *w) {
  mtrain_pattern_destroy(w->focus);
  for (int32_t l = 0; w->patterns && l < w->num_layers; l++) mtrain_pattern_destroy(w->patterns[l]);
  free(w->patterns);
}

static int load_workload(options_t *o, workload_t *w) {
  memset(w, 0, sizeof *w);
  if (o->pattern) {
    w->patterns = calloc(1, sizeof *w->patterns);
    if (!w->patterns) return 1;
    if (tool_failed(prog, o->pattern, mtrain_pattern_read_json(o->pattern, &w->patterns[0])))
      return 1;
    w->num_layers = 1;
    w->seq_len = mtrain_pattern_seq_len(w->patterns[0]);
    w->granularity = mtrain_pattern_granularity(w->patterns[0]);
    w->num_heads = mtrain_pattern_num_heads(w->patterns[0]);
    if (o->seq_len && o->seq_len != w->seq_len) {
      fprintf(stderr, "%s: %s: the pattern has seq_len %lld, --seq-len says %lld\n", prog,
              o->pattern, (long long)w->seq_len, (long long)o->seq_len);
      return 1;
    }
    if (o->granularity && o->granularity != w->granularity) {
      fprintf(stderr, "%s: %s: the pattern has granularity %d, --granularity says %d\n", prog,
              o->pattern, w->granularity, o->granularity);
      return 1;
    }
    o->seq_len = w->seq_len;
    o->granularity = w->granularity;
    return 0;
  }
  if (!o->granularity) o->granularity = 128;
  mtrain_budgets_t *b = NULL;
  if (tool_failed(prog, o->budgets, mtrain_budgets_read(o->budgets, &b))) return 1;
  const int32_t nl = mtrain_budgets_num_layers(b);
  w->patterns = calloc((size_t)nl, sizeof *w->patterns);
  int rc = w->patterns == NULL;
  for (int32_t l = 0; l < nl && !rc; l++) {
    char what[64];
    snprintf(what, sizeof what, "layer %d", l);
    rc = tool_failed(
        prog, what,
        mtrain_pattern_from_budgets(b, l, o->seq_len, o->granularity, &o->model, &w->patterns[l]));
    if (!rc) w->num_layers++;
    for (int32_t h = 0; h < mtrain_budgets_num_heads(b, l) && !rc; h++) {
      mtrain_head_budget_t hb;
      mtrain_budgets_get(b, l, h, &hb);
      w->top_p_entries += hb.kind == MTRAIN_BUDGET_TOP_P;
      w->num_heads++;
    }
  }
  mtrain_budgets_destroy(b);
  w->seq_len = o->seq_len;
  w->granularity = o->granularity;
  return rc;
}

/* The one-head pattern of --head L,H. */
static int make_focus(const options_t *o, workload_t *w) {
  if (o->focus_layer < 0) return 0;
  if (o->focus_layer >= w->num_layers ||
      o->focus_head >= mtrain_pattern_num_heads(w->patterns[o->focus_layer])) {
    fprintf(stderr, "%s: --head %d,%d: the workload has %d layers%s\n", prog, o->focus_layer,
            o->focus_head, w->num_layers,
            o->focus_layer < w->num_layers ? " and fewer heads in that layer" : "");
    return 1;
  }
  const mtrain_pattern_t *p = w->patterns[o->focus_layer];
  if (mtrain_pattern_head_is_block_mask(p, o->focus_head)) {
    fprintf(stderr, "%s: --head %d,%d is a block-mask head (only vertical-slash heads)\n", prog,
            o->focus_layer, o->focus_head);
    return 1;
  }
  const int32_t *d;
  const int64_t *v;
  int32_t nd, nv;
  mtrain_pattern_get_head(p, o->focus_head, &d, &nd, &v, &nv);
  return tool_failed(prog, "--head",
                     mtrain_pattern_create(w->seq_len, 1, w->granularity, &w->focus)) ||
         tool_failed(prog, "--head", mtrain_pattern_set_head(w->focus, 0, d, nd, v, nv));
}

/* Layer and head of a global head index. */
static void head_place(const workload_t *w, int32_t index, int32_t *layer, int32_t *head) {
  int32_t l = 0;
  while (l + 1 < w->num_layers && index >= mtrain_pattern_num_heads(w->patterns[l])) {
    index -= mtrain_pattern_num_heads(w->patterns[l]);
    l++;
  }
  *layer = l;
  *head = index;
}

/* ---- one layout --------------------------------------------------------------------- */

typedef struct result {
  mtrain_layout_t *layout;
  mtrain_cost_t *cost;
  mtrain_cost_t *focus;       /* --head: that head alone; NULL otherwise */
  mtrain_cost_metrics_t m[2]; /* [ring] */
  mtrain_time_prediction_t t[2];
  double seconds;
} result_t;

static int analyse(const options_t *o, const workload_t *w, mtrain_layout_kind_t kind,
                   result_t *r) {
  const double t0 = tool_now();
  const mtrain_pattern_t *const *pats = (const mtrain_pattern_t *const *)w->patterns;
  mtrain_balance_options_t bo = MTRAIN_BALANCE_OPTIONS_INIT;
  bo.patterns = pats;
  bo.num_patterns = w->num_layers;
  bo.ranks_per_node = o->ring == MTRAIN_RING_HIERARCHICAL ? o->ranks_per_node : 0;
  char what[64];
  snprintf(what, sizeof what, "%s layout", mtrain_layout_kind_name(kind));
  if (tool_failed(
          prog, what,
          mtrain_layout_create(kind, w->seq_len, w->granularity, o->world, &bo, &r->layout)))
    return 1;
  mtrain_cost_options_t co = MTRAIN_COST_OPTIONS_INIT;
  co.ranks_per_node = o->ranks_per_node == o->world ? 0 : o->ranks_per_node;
  co.bars_mode = o->bars_mode;
  if (tool_failed(prog, "cost model",
                  mtrain_cost_evaluate(r->layout, pats, w->num_layers, &co, &r->cost)))
    return 1;
  for (int ring = 0; ring < 2; ring++)
    mtrain_cost_metrics(r->cost, (mtrain_ring_kind_t)ring, &r->m[ring]);
  if (tool_failed(prog, "time model",
                  mtrain_time_predict(r->cost, r->layout, pats, w->num_layers, &o->time, r->t)))
    return 1;
  if (w->focus) {
    co.bars_mode = mtrain_cost_bars_mode(r->cost);
    const mtrain_pattern_t *one[1] = {w->focus};
    if (tool_failed(prog, "cost model of --head",
                    mtrain_cost_evaluate(r->layout, one, 1, &co, &r->focus)))
      return 1;
  }
  r->seconds = tool_now() - t0;
  return 0;
}

/* Work of (rank, step) of the whole model (or of the --head) relative to
 * the mean of a (rank, step). */
static double *relative_work(const options_t *o, const result_t *r) {
  const int32_t W = o->world;
  const mtrain_cost_t *c = r->focus ? r->focus : r->cost;
  mtrain_cost_metrics_t m;
  double *v = malloc((size_t)W * (size_t)W * sizeof *v);
  if (!v) return NULL;
  mtrain_cost_metrics(c, o->ring, &m);
  const double mean = m.total_work / ((double)W * W);
  for (int32_t rank = 0; rank < W; rank++)
    for (int32_t t = 0; t < W; t++)
      v[rank * W + t] = mtrain_cost_work(c, o->ring, -1, rank, t) / mean;
  return v;
}

/* "the whole model" or "layer L head H". */
static void subject(const options_t *o, char *buf, size_t cap) {
  if (o->focus_layer < 0)
    snprintf(buf, cap, "whole-model");
  else
    snprintf(buf, cap, "layer %d head %d", o->focus_layer, o->focus_head);
}

/* ---- output ------------------------------------------------------------------------- */

static const char *spread_name(mtrain_spread_t s) {
  return s == MTRAIN_SPREAD_RANDOM ? "random" : s == MTRAIN_SPREAD_LOCAL ? "local" : "even";
}

static void print_table(const options_t *o, const workload_t *w, const result_t *res, int n) {
  const int32_t L = o->ranks_per_node;
  printf("mtrain-balance: %s: %d layers, %d heads, N=%lld, G=%d, W=%d (%d node%s x %d)\n",
         o->budgets ? o->budgets : o->pattern, w->num_layers, w->num_heads, (long long)w->seq_len,
         w->granularity, o->world, o->world / L, o->world / L > 1 ? "s" : "", L);
  if (o->budgets) {
    printf("position model: %d sinks, window %d, %s spread", o->model.num_sinks, o->model.window,
           spread_name(o->model.spread));
    if (o->model.spread == MTRAIN_SPREAD_RANDOM)
      printf(" (seed %llu)", (unsigned long long)o->model.seed);
    if (o->model.budget_context)
      printf(", budgets scaled by N/%lld\n", (long long)o->model.budget_context);
    else
      printf(", budgets as given\n");
  }
  const char *lead = mtrain_ring_kind_name(o->ring);
  const mtrain_ring_kind_t other =
      o->ring == MTRAIN_RING_FLAT ? MTRAIN_RING_HIERARCHICAL : MTRAIN_RING_FLAT;
  printf("\ncost model (%s ring; \"other\" = %s ring):\n", lead, mtrain_ring_kind_name(other));
  printf("%-11s %-20s %-9s %9s %8s %9s %-22s %9s %9s\n", "layout", "design", "bars", "padded",
         "worker", "ring-sync", "worst head (layer,head)", "other", "other");
  printf("%-11s %-20s %-9s %9s %8s %9s %-22s %9s %9s\n", "", "", "", "tokens", "imbal.", "slowdown",
         "", "sync", "worst");
  for (int i = 0; i < n; i++) {
    const result_t *r = &res[i];
    const mtrain_cost_metrics_t *m = &r->m[o->ring], *x = &r->m[other];
    int32_t hl, hh;
    head_place(w, m->worst_head, &hl, &hh);
    char worst[40];
    snprintf(worst, sizeof worst, "%.4f (%d,%d)", m->worst_head_slowdown, hl, hh);
    printf("%-11s %-20s %-9s %9lld %8.4f %9.4f %-22s %9.4f %9.4f\n",
           mtrain_layout_kind_name(mtrain_layout_kind(r->layout)), mtrain_layout_variant(r->layout),
           mtrain_bars_mode_name(mtrain_cost_bars_mode(r->cost)),
           (long long)mtrain_layout_padded_len(r->layout), m->worker_imbalance,
           m->ring_sync_slowdown, worst, x->ring_sync_slowdown, x->worst_head_slowdown);
  }
  char kv[32];
  if (o->time.kv_heads)
    snprintf(kv, sizeof kv, "%d", o->time.kv_heads);
  else
    snprintf(kv, sizeof kv, "= query heads");
  printf("\ntime model, whole model, seconds (%.0f TFLOP/s, %.0f GB/s intra-node, %.0f GB/s "
         "inter-node, %.0f us, d=%d, kv heads %s, %d-byte K/V):\n",
         o->time.flops / 1e12, o->time.bw_intra / 1e9, o->time.bw_inter / 1e9,
         o->time.latency * 1e6, o->time.head_dim, kv, o->time.dtype_bytes);
  printf("%-11s %10s %10s %10s %10s %12s %10s %9s %8s\n", "layout", "flat fwd", "flat bwd",
         "hier fwd", "hier bwd", "ideal comp.", "gather", "gath. MB", "eval s");
  for (int i = 0; i < n; i++) {
    const result_t *r = &res[i];
    printf("%-11s %9.3fs %9.3fs %9.3fs %9.3fs %11.3fs %9.4fs %9.1f %8.2f\n",
           mtrain_layout_kind_name(mtrain_layout_kind(r->layout)), r->t[0].forward,
           r->t[0].backward, r->t[1].forward, r->t[1].backward, r->t[0].compute_ideal,
           r->t[0].gather, r->t[0].gather_bytes / 1e6, r->seconds);
  }
  if (!o->steps) return;
  for (int i = 0; i < n; i++) {
    double *v = relative_work(o, &res[i]);
    if (!v) return;
    char who[64];
    subject(o, who, sizeof who);
    printf("\n%s (%s): %s work of (rank, %s step) / mean; rows = ranks\n",
           mtrain_layout_kind_name(mtrain_layout_kind(res[i].layout)),
           mtrain_layout_variant(res[i].layout), who, lead);
    for (int32_t r = 0; r < o->world; r++) {
      printf("%4d:", r);
      for (int32_t t = 0; t < o->world; t++) printf(" %5.2f", v[r * o->world + t]);
      printf("\n");
    }
    free(v);
  }
}

static json_t *metrics_json(const mtrain_cost_metrics_t *m, const workload_t *w) {
  int32_t hl, hh;
  head_place(w, m->worst_head, &hl, &hh);
  return json_pack("{s:f, s:f, s:f, s:f, s:{s:i, s:i, s:i, s:f}}", "ring_sync_slowdown",
                   m->ring_sync_slowdown, "worker_imbalance", m->worker_imbalance, "max_rank_work",
                   m->max_rank_work, "total_work", m->total_work, "worst_head", "index",
                   m->worst_head, "layer", hl, "head", hh, "ring_sync_slowdown",
                   m->worst_head_slowdown);
}

static json_t *time_json(const mtrain_time_prediction_t *t) {
  return json_pack("{s:f, s:f, s:f, s:f, s:f, s:f}", "forward_s", t->forward, "backward_s",
                   t->backward, "total_s", t->forward + t->backward, "compute_ideal_s",
                   t->compute_ideal, "gather_s", t->gather, "gather_bytes", t->gather_bytes);
}

static json_t *layout_json(const options_t *o, const workload_t *w, const result_t *r) {
  const mtrain_cost_metrics_t *m = &r->m[o->ring];
  json_t *heads = json_array(), *layers = json_array();
  for (int32_t h = 0; h < w->num_heads; h++)
    json_array_append_new(heads, json_real(mtrain_cost_head_ring_sync(r->cost, o->ring, h)));
  for (int32_t l = 0; l < w->num_layers; l++)
    json_array_append_new(layers, json_real(mtrain_cost_layer_ring_sync(r->cost, o->ring, l)));
  int32_t hl, hh;
  head_place(w, m->worst_head, &hl, &hh);
  json_t *j = json_pack(
      "{s:s, s:s, s:s, s:s, s:I, s:i, s:f, s:f, s:f, s:f, s:{s:i, s:i, s:i, s:f}, s:o, s:o}",
      "layout", mtrain_layout_kind_name(mtrain_layout_kind(r->layout)), "variant",
      mtrain_layout_variant(r->layout), "bars",
      mtrain_bars_mode_name(mtrain_cost_bars_mode(r->cost)), "schedule",
      mtrain_ring_kind_name(o->ring), "padded_len", (json_int_t)mtrain_layout_padded_len(r->layout),
      "blocks_per_rank", mtrain_layout_rank_num_blocks(r->layout, 0), "ring_sync_slowdown",
      m->ring_sync_slowdown, "worker_imbalance", m->worker_imbalance, "max_rank_work",
      m->max_rank_work, "total_work", m->total_work, "worst_head", "index", m->worst_head, "layer",
      hl, "head", hh, "ring_sync_slowdown", m->worst_head_slowdown, "head_ring_sync_slowdown",
      heads, "layer_ring_sync_slowdown", layers);
  json_object_set_new(j, "flat", metrics_json(&r->m[MTRAIN_RING_FLAT], w));
  json_object_set_new(j, "hierarchical", metrics_json(&r->m[MTRAIN_RING_HIERARCHICAL], w));
  json_object_set_new(
      j, "time",
      json_pack("{s:o, s:o}", "flat", time_json(&r->t[0]), "hierarchical", time_json(&r->t[1])));
  json_object_set_new(j, "seconds", json_real(r->seconds));
  return j;
}

static int print_json(const options_t *o, const workload_t *w, const result_t *res, int n) {
  json_t *model = o->budgets
                      ? json_pack("{s:i, s:i, s:s, s:I, s:I}", "sinks", o->model.num_sinks,
                                  "window", o->model.window, "spread", spread_name(o->model.spread),
                                  "seed", (json_int_t)o->model.seed, "budget_context",
                                  (json_int_t)o->model.budget_context)
                      : json_null();
  json_t *root = json_pack(
      "{s:s, s:{s:s?, s:s?, s:I, s:i, s:i, s:i, s:i, s:o}, s:{s:i, s:i, s:i}, s:s, "
      "s:{s:f, s:f, s:f, s:f, s:i, s:i, s:i}}",
      "tool", "mtrain-balance", "input", "budgets", o->budgets, "pattern", o->pattern, "seq_len",
      (json_int_t)w->seq_len, "granularity", w->granularity, "layers", w->num_layers, "heads",
      w->num_heads, "top_p_entries", w->top_p_entries, "position_model", model, "cluster", "world",
      o->world, "ranks_per_node", o->ranks_per_node, "nodes", o->world / o->ranks_per_node,
      "schedule", mtrain_ring_kind_name(o->ring), "time_params", "tflops", o->time.flops / 1e12,
      "bw_intra_gbps", o->time.bw_intra / 1e9, "bw_inter_gbps", o->time.bw_inter / 1e9,
      "latency_us", o->time.latency * 1e6, "head_dim", o->time.head_dim, "kv_heads",
      o->time.kv_heads ? o->time.kv_heads : mtrain_pattern_num_heads(w->patterns[0]), "dtype_bytes",
      o->time.dtype_bytes);
  if (!root) {
    fprintf(stderr, "%s: building the JSON report failed\n", prog);
    return 1;
  }
  json_t *list = json_array();
  for (int i = 0; i < n; i++) json_array_append_new(list, layout_json(o, w, &res[i]));
  if (n == 1) json_object_update(root, json_array_get(list, 0)); /* the layout analysed */
  json_object_set_new(root, "layouts", list);
  json_dumpf(root, stdout, JSON_INDENT(1) | JSON_REAL_PRECISION(10));
  fputc('\n', stdout);
  json_decref(root);
  return 0;
}

static int write_png(const options_t *o, const workload_t *w, const result_t *res, int n) {
  heat_panel_t panels[4];
  double *values[4] = {0};
  char titles[4][64], subs[4][64], caption[200];
  double vmax = 1.0;
  int rc = 0;
  for (int i = 0; i < n && !rc; i++) {
    values[i] = relative_work(o, &res[i]);
    if (!values[i]) {
      fprintf(stderr, "%s: out of memory for the picture\n", prog);
      rc = 1;
      break;
    }
    for (int32_t k = 0; k < o->world * o->world; k++)
      if (values[i][k] > vmax) vmax = values[i][k];
    snprintf(titles[i], sizeof titles[i], "%s", mtrain_layout_variant(res[i].layout));
    mtrain_cost_metrics_t m = res[i].m[o->ring];
    if (res[i].focus) mtrain_cost_metrics(res[i].focus, o->ring, &m);
    snprintf(subs[i], sizeof subs[i], "sync %.4f imb %.4f", m.ring_sync_slowdown,
             m.worker_imbalance);
    panels[i].title = titles[i];
    panels[i].subtitle = subs[i];
    panels[i].values = values[i];
  }
  char who[64];
  subject(o, who, sizeof who);
  snprintf(caption, sizeof caption, "%s work / mean per rank (rows) and %s ring step, N=%lld W=%d",
           who, mtrain_ring_kind_name(o->ring), (long long)w->seq_len, o->world);
  char err[300];
  if (!rc &&
      balance_png_write(o->png, o->world, o->world, panels, n, caption, vmax, err, sizeof err)) {
    fprintf(stderr, "%s: --png: %s\n", prog, err);
    rc = 1;
  }
  for (int i = 0; i < n; i++) free(values[i]);
  return rc;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "batch") == 0) return balance_batch_main(argc - 1, argv + 1);
  options_t o;
  const int prc = parse_options(argc, argv, &o);
  if (prc) return prc == 2 ? 0 : 2;
  workload_t w;
  result_t res[4];
  memset(res, 0, sizeof res);
  int rc = load_workload(&o, &w);
  if (!rc) rc = make_focus(&o, &w);
  if (!rc && w.top_p_entries)
    fprintf(stderr,
            "%s: note: %d top-p (flex) entries: the position model uses their caps as the "
            "counts (an upper bound)\n",
            prog, w.top_p_entries);
  int n = 0;
  for (; !rc && n < o.num_layouts; n++)
    rc = analyse(&o, &w, (mtrain_layout_kind_t)o.layouts[n], &res[n]);
  if (!rc) rc = o.json ? print_json(&o, &w, res, n) : (print_table(&o, &w, res, n), 0);
  if (!rc && o.png) rc = write_png(&o, &w, res, n);
  for (int i = 0; i < 4; i++) {
    mtrain_cost_destroy(res[i].focus);
    mtrain_cost_destroy(res[i].cost);
    mtrain_layout_destroy(res[i].layout);
  }
  workload_free(&w);
  return rc;
}
