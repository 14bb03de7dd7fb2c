/* mtrain_pattern.c: the pattern viewer mtrain-pattern: draws one head of a
 * sparse pattern as a PNG, rows = query blocks (top to bottom), columns =
 * key blocks (left to right), with a title and a legend: computed blocks
 * dark blue, the causal part of the diagonal blocks teal, blocks that only
 * hold bars (verticals outside the computed blocks) orange, darker the more
 * verticals the key block has, causal blocks not computed white, the
 * non-causal part of a causal pattern light grey, the padding past seq_len of the last block
 * hatched grey. By default the plot has whole pixels per block and at
 * least 512 pixels a side (up to 512 blocks; one pixel per block up to 1024
 * blocks; above that the blocks are max-pooled to 1024 pixels: diagonal >
 * computed > bars > empty > padding > non-causal); --size sets the plot's
 * side, --no-legend leaves only the plot. The pattern comes from a file, or
 * is estimated online (SPEC.md section 2) from structured inputs generated
 * from a seed with per-head budgets (--estimate), or selected there by a
 * block-sparse method (--estimate --block, SPEC.md section 9). Exit 0 on success (and
 * after --help), 1 when the work fails (unreadable pattern, head out of
 * range, PNG not written), 2 on a bad command line. */
#define _POSIX_C_SOURCE 200809L /* tool_common.h: clock_gettime */

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "canvas.h"
#include "mtrain/mtrain.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_io.h"
#include "tool_common.h"

static const char *prog = "mtrain-pattern";

static const char usage[] =
    "usage: mtrain-pattern (--pattern FILE.json | --estimate ...) --head H --out FILE.png\n"
    "                      [--size PX] [--no-legend]\n"
    "Draws one head's block pattern: rows = query blocks (top to bottom), columns = key\n"
    "blocks (left to right), with a title and a legend.\n"
    "  --pattern FILE.json   a pattern file (SPEC.md section 8)\n"
    "  --estimate            estimate the pattern online from structured inputs\n"
    "                        (mtrain_inputs.h) with per-head budgets:\n"
    "  --budgets FILE --layer L   the budgets of layer L of a MInference budget file\n"
    "  --v-size N --s-size N      or static top-k for every head\n"
    "  --block METHOD        or a block-sparse selection instead (SPEC.md section 9):\n"
    "                        precise (from a dense forward's LSE), antidiag or meanpool\n"
    "  --top-p P             its top-p mass per query block (default 0.9; not meanpool)\n"
    "  --top-k K             or its top-k blocks per query block besides the forced ones\n"
    "  --seq-len N           tokens of the estimate's inputs (default 4096)\n"
    "  --heads H --kv-heads H --head-dim D   their shape (default 16, 2, 128)\n"
    "  --seed S              their seed (default 1)\n"
    "  --granularity G       block size of the estimate (default 128)\n"
    "  --last-q L            queries that score the keys (default 64)\n"
    "  --top-p-forced        the budget file's top-p heads force the sinks (30 keys) and\n"
    "                        the local window (100 token diagonals), as top-k does\n"
    "  --head H              the query head to draw (0-based)\n"
    "  --out FILE.png        the image to write\n"
    "  --size PX             the plot's width and height in pixels (default: whole pixels\n"
    "                        per block, at least 512 px; one pixel per block from 512\n"
    "                        to 1024 blocks; more blocks are max-pooled to 1024 px)\n"
    "  --no-legend           write the plot alone (PX x PX), without title and legend\n"
    "  --help                this text\n"
    "Colours: computed blocks dark blue; the causal part of a computed diagonal block teal;\n"
    "bars only (verticals) orange, darker with more verticals in the key block; causal\n"
    "but not computed white; above the diagonal of a causal pattern light grey; padding past "
    "seq_len hatched grey.\n"
    "Exit status: 0 success, 1 error, 2 bad command line.\n";

#define MIN_DEFAULT_PX 512
#define DEFAULT_MAX_PX 1024
#define MAX_SIZE_PX 16384

typedef struct viewer_options {
  const char *pattern_path; /* input source: a pattern file, or */
  int estimate;             /* estimated from structured inputs */
  const char *budgets_path;
  int32_t layer, v_size, s_size, heads, kv_heads, head_dim, granularity, last_q, seed, seq_len;
  const char *block_method; /* --block: a block selection instead of budgets */
  double top_p;
  int32_t top_k; /* -1: top-p */
  const char *out_path;
  int32_t head;
  int top_p_forced; /* --top-p-forced: the budget file's top-p heads force the sinks and window */
  int32_t size;     /* the plot's side; 0: default */
  int no_legend;    /* the plot alone */
} viewer_options_t;

/* Pixel classes, ordered for max-pooling. */
enum {
  CELL_NONCAUSAL = 0,
  CELL_PADDING = 1, /* tokens past seq_len in the last block */
  CELL_EMPTY = 2,
  CELL_BARS = 3,
  CELL_COMPUTED = 4,
  CELL_DIAGONAL = 5 /* the causal part of a computed diagonal block */
};

static int parse_int(const char *name, const char *s, long lo, long hi, int32_t *out) {
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) {
    fprintf(stderr, "%s: --%s '%s' is not an integer in [%ld, %ld]\n", prog, name, s, lo, hi);
    return 1;
  }
  *out = (int32_t)v;
  return 0;
}

/* 0: run; 1: bad command line; 2: --help printed. */
static int parse_options(int argc, char **argv, viewer_options_t *o) {
  memset(o, 0, sizeof *o);
  o->head = o->layer = o->v_size = o->s_size = -1;
  o->heads = 16;
  o->kv_heads = 2;
  o->head_dim = 128;
  o->granularity = 128;
  o->last_q = 64;
  o->seed = 1;
  o->seq_len = 4096;
  o->top_p = 0.9;
  o->top_k = -1;
  static const struct option longs[] = {{"pattern", required_argument, 0, 'p'},
                                        {"head", required_argument, 0, 'H'},
                                        {"out", required_argument, 0, 'o'},
                                        {"size", required_argument, 0, 's'},
                                        {"help", no_argument, 0, 'h'},
                                        {"estimate", no_argument, 0, 'e'},
                                        {"budgets", required_argument, 0, 'B'},
                                        {"layer", required_argument, 0, 'L'},
                                        {"v-size", required_argument, 0, 'V'},
                                        {"s-size", required_argument, 0, 'S'},
                                        {"seq-len", required_argument, 0, 'N'},
                                        {"heads", required_argument, 0, 'q'},
                                        {"kv-heads", required_argument, 0, 'k'},
                                        {"head-dim", required_argument, 0, 'd'},
                                        {"seed", required_argument, 0, 'r'},
                                        {"granularity", required_argument, 0, 'G'},
                                        {"last-q", required_argument, 0, 'l'},
                                        {"no-legend", no_argument, 0, 'n'},
                                        {"block", required_argument, 0, 'b'},
                                        {"top-p", required_argument, 0, 'P'},
                                        {"top-k", required_argument, 0, 'K'},
                                        {"top-p-forced", no_argument, 0, 'F'},
                                        {0, 0, 0, 0}};
  int c, bad = 0;
  opterr = 0;
  while (!bad && (c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
    switch (c) {
    case 'p':
      o->pattern_path = optarg;
      break;
    case 'H':
      bad = parse_int("head", optarg, 0, INT32_MAX, &o->head);
      break;
    case 'o':
      o->out_path = optarg;
      break;
    case 's':
      bad = parse_int("size", optarg, 1, MAX_SIZE_PX, &o->size);
      break;
    case 'e':
      o->estimate = 1;
      break;
    case 'n':
      o->no_legend = 1;
      break;
    case 'B':
      o->budgets_path = optarg;
      break;
    case 'L':
      bad = parse_int("layer", optarg, 0, INT32_MAX, &o->layer);
      break;
    case 'V':
      bad = parse_int("v-size", optarg, 0, INT32_MAX, &o->v_size);
      break;
    case 'S':
      bad = parse_int("s-size", optarg, 0, INT32_MAX, &o->s_size);
      break;
    case 'N':
      bad = parse_int("seq-len", optarg, 1, 1 << 24, &o->seq_len);
      break;
    case 'q':
      bad = parse_int("heads", optarg, 1, 1024, &o->heads);
      break;
    case 'k':
      bad = parse_int("kv-heads", optarg, 1, 1024, &o->kv_heads);
      break;
    case 'd':
      bad = parse_int("head-dim", optarg, 1, 1024, &o->head_dim);
      break;
    case 'r':
      bad = parse_int("seed", optarg, 0, INT32_MAX, &o->seed);
      break;
    case 'G':
      bad = parse_int("granularity", optarg, 1, 1 << 20, &o->granularity);
      break;
    case 'l':
      bad = parse_int("last-q", optarg, 1, 1 << 20, &o->last_q);
      break;
    case 'b':
      o->block_method = optarg;
      break;
    case 'P': {
      char *end = NULL;
      o->top_p = strtod(optarg, &end);
      bad = !end || *end || !(o->top_p > 0.0 && o->top_p <= 1.0);
      if (bad) fprintf(stderr, "%s: --top-p '%s' is not in (0, 1]\n", prog, optarg);
      break;
    }
    case 'K':
      bad = parse_int("top-k", optarg, 0, INT32_MAX, &o->top_k);
      break;
    case 'F':
      o->top_p_forced = 1;
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
  if (!!o->pattern_path + o->estimate != 1) {
    fprintf(stderr, "%s: give exactly one of --pattern FILE.json and --estimate\n%s", prog, usage);
    return 1;
  }
  if (o->estimate && !o->block_method &&
      !((o->budgets_path && o->layer >= 0) || (o->v_size >= 0 && o->s_size >= 0))) {
    fprintf(stderr,
            "%s: --estimate needs --budgets FILE --layer L, --v-size N --s-size N or --block "
            "METHOD\n",
            prog);
    return 1;
  }
  if (o->top_p_forced && !(o->estimate && o->budgets_path && !o->block_method)) {
    fprintf(stderr,
            "%s: --top-p-forced applies to the top-p heads of --estimate --budgets FILE (top-k "
            "budgets force the sinks and the window anyway; a --pattern file or a --block "
            "selection has none)\n",
            prog);
    return 1;
  }
  if (o->estimate && o->heads % o->kv_heads != 0) {
    fprintf(stderr, "%s: --heads %d is not a multiple of --kv-heads %d\n", prog, o->heads,
            o->kv_heads);
    return 1;
  }
  const char *missing = !o->pattern_path && !o->estimate ? "--pattern FILE.json"
                        : o->head < 0                    ? "--head H"
                        : !o->out_path                   ? "--out FILE.png"
                                                         : NULL;
  if (missing) {
    fprintf(stderr, "%s: %s is required\n%s", prog, missing, usage);
    return 1;
  }
  return 0;
}

/* Per-head budgets for --estimate (malloc'ed). */
static int estimate_budgets(const viewer_options_t *o, mtrain_head_budget_t **out) {
  mtrain_head_budget_t *b = calloc((size_t)o->heads, sizeof *b);
  mtrain_budgets_t *file = NULL;
  int rc = b == NULL;
  if (!rc && o->budgets_path) {
    rc = tool_failed(prog, o->budgets_path, mtrain_budgets_read(o->budgets_path, &file));
    for (int32_t h = 0; h < o->heads && !rc; h++) /* heads beyond the file's wrap around */
      rc = tool_failed(prog, o->budgets_path,
                       mtrain_budgets_get(file, o->layer,
                                          h % (mtrain_budgets_num_heads(file, o->layer) > 0
                                                   ? mtrain_budgets_num_heads(file, o->layer)
                                                   : 1),
                                          &b[h]));
  } else {
    for (int32_t h = 0; h < o->heads && !rc; h++) {
      b[h].kind = MTRAIN_BUDGET_TOP_K;
      b[h].v_size = o->v_size;
      b[h].s_size = o->s_size;
    }
  }
  mtrain_budgets_destroy(file);
  if (rc) {
    free(b);
    return 1;
  }
  *out = b;
  return 0;
}

/* The block selection of --block on "cpu" (the precise search from the LSE
 * of a dense forward of the same inputs). */
static int select_blocks(const viewer_options_t *o, mtrain_context_t *ctx, mtrain_tensor_t *tq,
                         mtrain_tensor_t *tk, mtrain_tensor_t *tv, mtrain_pattern_t **out) {
  mtrain_block_options_t bo = MTRAIN_BLOCK_OPTIONS_INIT;
  int rc = tool_failed(prog, "--block", mtrain_block_method_parse(o->block_method, &bo.method));
  if (o->top_k >= 0 || bo.method == MTRAIN_BLOCK_MEANPOOL) {
    bo.kind = MTRAIN_BUDGET_TOP_K;
    bo.top_k = o->top_k >= 0 ? o->top_k : 8;
  }
  bo.top_p = o->top_p;
  if (bo.method == MTRAIN_BLOCK_ANTIDIAG && o->granularity % bo.stride != 0) bo.stride = 1;
  const int64_t N = o->seq_len;
  float *out_o = NULL, *lse = NULL;
  mtrain_pattern_t *dense = NULL;
  mtrain_plan_t *plan = NULL;
  if (!rc && bo.method == MTRAIN_BLOCK_PRECISE) {
    out_o = malloc(sizeof(float) * (size_t)(N * o->heads * o->head_dim));
    lse = malloc(sizeof(float) * (size_t)(N * o->heads));
    rc = !out_o || !lse;
    if (rc) fprintf(stderr, "%s: out of memory for the dense forward\n", prog);
    if (!rc)
      rc = tool_failed(prog, "dense pattern",
                       mtrain_pattern_create_dense(N, o->heads, o->granularity, &dense));
    const mtrain_pattern_t *ps[] = {dense};
    if (!rc) rc = tool_failed(prog, "dense plan", mtrain_plan_create(ctx, NULL, ps, &plan));
    mtrain_tensor_t to = mtrain_tensor_3d(out_o, MTRAIN_F32, N, o->heads, o->head_dim);
    mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, N, o->heads);
    if (!rc)
      rc = tool_failed(prog, "dense forward",
                       mtrain_attention_forward(ctx, plan, tq, tk, tv, &to, &tl));
  }
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F32, N, o->heads);
  if (!rc)
    rc = tool_failed(prog, "selecting blocks",
                     mtrain_pattern_select_blocks(ctx, tq, tk, lse ? &tl : NULL, &bo, NULL, out));
  mtrain_plan_destroy(plan);
  mtrain_pattern_destroy(dense);
  free(out_o);
  free(lse);
  return rc;
}

/* Structured inputs from the seed, then the online estimate on "cpu". */
static int estimate_pattern(const viewer_options_t *o, mtrain_pattern_t **out) {
  const int64_t N = o->seq_len;
  float *q = malloc(sizeof(float) * (size_t)(N * o->heads * o->head_dim));
  float *k = malloc(sizeof(float) * (size_t)(N * o->kv_heads * o->head_dim));
  float *v = malloc(sizeof(float) * (size_t)(N * o->kv_heads * o->head_dim));
  mtrain_head_budget_t *budgets = NULL;
  mtrain_context_t *ctx = NULL;
  int rc = !q || !k || !v;
  if (rc) fprintf(stderr, "%s: out of memory for %lld tokens\n", prog, (long long)N);
  mtrain_tensor_t tq = mtrain_tensor_3d(q, MTRAIN_F32, N, o->heads, o->head_dim);
  mtrain_tensor_t tk = mtrain_tensor_3d(k, MTRAIN_F32, N, o->kv_heads, o->head_dim);
  mtrain_tensor_t tv = mtrain_tensor_3d(v, MTRAIN_F32, N, o->kv_heads, o->head_dim);
  mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
  so.seed = (uint64_t)o->seed;
  if (so.rope_base < 4.0 * (double)N) so.rope_base = 4.0 * (double)N; /* keeps the sinks */
  if (!rc)
    rc = tool_failed(prog, "generating inputs", mtrain_generate_structured(&so, &tq, &tk, &tv));
  if (!rc && !o->block_method) rc = estimate_budgets(o, &budgets);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = o->granularity;
  if (!rc) rc = tool_failed(prog, "context", mtrain_context_create(&cfg, NULL, &ctx));
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = o->last_q;
  eo.top_p_forced = o->top_p_forced;
  if (!rc && o->block_method)
    rc = select_blocks(o, ctx, &tq, &tk, &tv, out);
  else if (!rc)
    rc = tool_failed(prog, "estimating", mtrain_pattern_estimate(ctx, &tq, &tk, budgets, &eo, out));
  mtrain_context_destroy(ctx);
  free(budgets);
  free(q);
  free(k);
  free(v);
  return rc;
}

/* The pattern to draw, from the input source the options name. */
static int load_pattern(const viewer_options_t *o, mtrain_pattern_t **out) {
  if (o->estimate) return estimate_pattern(o, out);
  return tool_failed(prog, o->pattern_path, mtrain_pattern_read_json(o->pattern_path, out));
}

/* What one head looks like at block level: diagonal flags (vertical-slash
 * form) or a block-mask head, and the verticals per key block. */
typedef struct head_view {
  const mtrain_pattern_t *pattern;
  int32_t head;
  int64_t nb, seq_len, g;
  int block_mask;
  uint8_t *diag;   /* [nb]: block diagonal present */
  int64_t *vcount; /* [nb]: verticals in key block kb */
  int64_t verticals, computed_blocks;
} head_view_t;

static int view_init(const mtrain_pattern_t *p, int32_t head, head_view_t *v) {
  memset(v, 0, sizeof *v);
  v->pattern = p;
  v->head = head;
  v->nb = mtrain_pattern_num_blocks(p);
  v->seq_len = mtrain_pattern_seq_len(p);
  v->g = mtrain_pattern_granularity(p);
  v->block_mask = mtrain_pattern_head_is_block_mask(p, head);
  v->diag = calloc((size_t)v->nb, 1);
  v->vcount = calloc((size_t)v->nb, sizeof *v->vcount);
  if (!v->diag || !v->vcount) {
    fprintf(stderr, "%s: out of memory for %lld blocks\n", prog, (long long)v->nb);
    return 1;
  }
  const int32_t *diags = NULL;
  const int64_t *verts = NULL;
  int32_t nd = 0, nv = 0;
  if (tool_failed(prog, "reading the head",
                  mtrain_pattern_get_head(p, head, &diags, &nd, &verts, &nv)))
    return 1;
  for (int32_t e = 0; e < nd; e++) v->diag[diags[e]] = 1;
  for (int32_t e = 0; e < nv; e++) v->vcount[verts[e] / v->g]++;
  v->verticals = nv;
  return 0;
}

static void view_free(head_view_t *v) {
  free(v->diag);
  free(v->vcount);
}

/* Class of block (qb, kb); *bars: verticals drawn in it. */
static int view_cell(const head_view_t *v, int64_t qb, int64_t kb, int64_t *bars) {
  *bars = 0;
  if (kb > qb && mtrain_pattern_is_causal(v->pattern)) return CELL_NONCAUSAL;
  int computed;
  if (v->block_mask) { /* allowed() of the block's last row and first column */
    const int64_t i = (qb + 1) * v->g - 1 < v->seq_len ? (qb + 1) * v->g - 1 : v->seq_len - 1;
    computed = mtrain_pattern_allowed(v->pattern, v->head, i, kb * v->g);
  } else {
    computed = v->diag[qb - kb];
  }
  if (computed) return CELL_COMPUTED;
  if (kb < qb && v->vcount[kb] > 0) {
    *bars = v->vcount[kb];
    return CELL_BARS;
  }
  return CELL_EMPTY;
}

static void blend(const uint8_t lo[3], const uint8_t hi[3], double t, uint8_t *rgb) {
  for (int c = 0; c < 3; c++) rgb[c] = (uint8_t)lrint(lo[c] + t * (hi[c] - lo[c]));
}

static const uint8_t col_computed[3] = {31, 78, 154}, col_diagonal[3] = {38, 160, 150};
static const uint8_t col_empty[3] = {255, 255, 255}, col_noncausal[3] = {226, 226, 226};
static const uint8_t col_bar_lo[3] = {253, 208, 162}, col_bar_hi[3] = {166, 54, 3};
static const uint8_t col_pad_a[3] = {140, 140, 140}, col_pad_b[3] = {205, 205, 205};
static const uint8_t col_ink[3] = {20, 20, 20}, col_frame[3] = {90, 90, 90};

/* The colour of class cls at image pixel (x, y) (padding is hatched). */
static void cell_colour(int cls, int64_t bars, int64_t g, int x, int y, uint8_t *rgb) {
  switch (cls) {
  case CELL_DIAGONAL:
    memcpy(rgb, col_diagonal, 3);
    break;
  case CELL_COMPUTED:
    memcpy(rgb, col_computed, 3);
    break;
  case CELL_BARS: /* log scale: one vertical is visible, a full block of them darkest */
    blend(col_bar_lo, col_bar_hi, log1p((double)(bars - 1)) / log1p((double)(g > 1 ? g - 1 : 1)),
          rgb);
    break;
  case CELL_EMPTY:
    memcpy(rgb, col_empty, 3);
    break;
  case CELL_PADDING:
    memcpy(rgb, (x + y) / 3 % 2 ? col_pad_a : col_pad_b, 3);
    break;
  default:
    memcpy(rgb, col_noncausal, 3);
  }
}

/* The class of the pixel showing token pair (i, j) of blocks (i/G, j/G). */
static int token_class(const head_view_t *v, int64_t i, int64_t j, int64_t *bars) {
  *bars = 0;
  const int64_t qb = i / v->g, kb = j / v->g;
  if (mtrain_pattern_is_causal(v->pattern) && (kb > qb || (kb == qb && j > i)))
    return CELL_NONCAUSAL;
  if (i >= v->seq_len || j >= v->seq_len) return CELL_PADDING;
  const int cls = view_cell(v, qb, kb, bars);
  return cls == CELL_COMPUTED && qb == kb ? CELL_DIAGONAL : cls;
}

/* Renders the px x px plot at (x0, y0) of the canvas. At px >= blocks each
 * pixel shows the token pair at its centre (so the diagonal blocks' causal
 * triangle and the padding show); below, pixel (y, x) covers blocks
 * [y*nb/px, (y+1)*nb/px) in each direction and shows their maximum. */
static void render(const head_view_t *v, int32_t px, canvas_t *c, int x0, int y0) {
  const int64_t span = v->nb * v->g; /* tokens the blocks cover, padding included */
  for (int32_t y = 0; y < px; y++) {
    const int64_t q0 = (int64_t)y * v->nb / px;
    int64_t q1 = (int64_t)(y + 1) * v->nb / px;
    if (q1 <= q0) q1 = q0 + 1;
    for (int32_t x = 0; x < px; x++) {
      int best = CELL_NONCAUSAL;
      int64_t best_bars = 0;
      if (px >= v->nb) {
        const int64_t i = (int64_t)((2.0 * y + 1) * (double)span / (2.0 * px));
        const int64_t j = (int64_t)((2.0 * x + 1) * (double)span / (2.0 * px));
        best = token_class(v, i, j, &best_bars);
      } else {
        const int64_t k0 = (int64_t)x * v->nb / px;
        int64_t k1 = (int64_t)(x + 1) * v->nb / px;
        if (k1 <= k0) k1 = k0 + 1;
        for (int64_t qb = q0; qb < q1; qb++)
          for (int64_t kb = k0; kb < k1 && kb <= qb; kb++) {
            int64_t bars;
            int cls = view_cell(v, qb, kb, &bars);
            if (cls == CELL_COMPUTED && qb == kb) cls = CELL_DIAGONAL;
            if (cls > best || (cls == best && bars > best_bars)) {
              best = cls;
              best_bars = bars;
            }
          }
      }
      cell_colour(best, best_bars, v->g, x0 + x, y0 + y,
                  c->rgb + 3 * ((size_t)(y0 + y) * (size_t)c->w + (size_t)(x0 + x)));
    }
  }
}

static void count_computed(head_view_t *v) {
  const int causal = mtrain_pattern_is_causal(v->pattern);
  for (int64_t qb = 0; qb < v->nb; qb++)
    for (int64_t kb = 0; kb < (causal ? qb + 1 : v->nb); kb++) {
      int64_t bars;
      if (view_cell(v, qb, kb, &bars) == CELL_COMPUTED) v->computed_blocks++;
    }
}

/* ---- the picture: title, plot, legend ---------------------------------------- */

#define TEXT_SCALE 2
#define MARGIN 12
#define LINE_STEP ((CANVAS_GLYPH_HEIGHT + 2) * TEXT_SCALE)
#define SWATCH (CANVAS_GLYPH_HEIGHT * TEXT_SCALE)
#define NUM_LEGEND 6
#define NUM_TITLE 3

typedef struct picture {
  char title[NUM_TITLE][160];
  const char *legend[NUM_LEGEND];
  int32_t plot; /* the plot's side */
  int plot_x, plot_y;
  int w, h;
} picture_t;

/* Where everything goes: a title of NUM_TITLE lines, the framed plot, the
 * legend (a swatch and a label per line). */
static void picture_layout(const head_view_t *v, int32_t head, int32_t plot, int legend,
                           picture_t *p) {
  memset(p, 0, sizeof *p);
  p->plot = plot;
  if (!legend) {
    p->w = p->h = plot;
    return;
  }
  const int is_causal = mtrain_pattern_is_causal(v->pattern);
  const int64_t causal = is_causal ? v->nb * (v->nb + 1) / 2 : v->nb * v->nb;
  snprintf(p->title[0], sizeof p->title[0], "head %d: %lld tokens, %lld x %lld blocks of %lld",
           head, (long long)v->seq_len, (long long)v->nb, (long long)v->nb, (long long)v->g);
  snprintf(p->title[1], sizeof p->title[1], "%lld of %lld %sblocks computed, %lld verticals",
           (long long)v->computed_blocks, (long long)causal, is_causal ? "causal " : "",
           (long long)v->verticals);
  snprintf(p->title[2], sizeof p->title[2], "rows: query blocks, columns: key blocks");
  p->legend[0] = v->block_mask ? "computed block (block mask)" : "computed block (block diagonal)";
  p->legend[1] = is_causal ? "diagonal block: causal part computed" : "diagonal block (non-causal)";
  p->legend[2] = "bars only: verticals, darker = more";
  p->legend[3] = is_causal ? "causal, not computed" : "not computed";
  p->legend[4] = is_causal ? "not causal: key after query" : "(non-causal pattern: none)";
  p->legend[5] = "padding: tokens past seq_len";
  int text_w = plot + 2;
  for (int t = 0; t < NUM_TITLE; t++) {
    const int w = canvas_text_width(p->title[t], TEXT_SCALE);
    if (w > text_w) text_w = w;
  }
  for (int l = 0; l < NUM_LEGEND; l++) {
    const int w = SWATCH + 8 + canvas_text_width(p->legend[l], TEXT_SCALE);
    if (w > text_w) text_w = w;
  }
  p->w = text_w + 2 * MARGIN;
  p->plot_x = MARGIN + 1;
  p->plot_y = MARGIN + NUM_TITLE * LINE_STEP + 6 + 1;
  p->h = p->plot_y + plot + 1 + 12 + NUM_LEGEND * (LINE_STEP + 4) + MARGIN;
}

static void picture_decorate(const head_view_t *v, const picture_t *p, canvas_t *c) {
  for (int t = 0; t < NUM_TITLE; t++)
    canvas_text(c, MARGIN, MARGIN + t * LINE_STEP, TEXT_SCALE, p->title[t], col_ink);
  /* the frame around the plot */
  canvas_fill(c, p->plot_x - 1, p->plot_y - 1, p->plot + 2, 1, col_frame);
  canvas_fill(c, p->plot_x - 1, p->plot_y + p->plot, p->plot + 2, 1, col_frame);
  canvas_fill(c, p->plot_x - 1, p->plot_y - 1, 1, p->plot + 2, col_frame);
  canvas_fill(c, p->plot_x + p->plot, p->plot_y - 1, 1, p->plot + 2, col_frame);
  static const int classes[NUM_LEGEND] = {CELL_COMPUTED, CELL_DIAGONAL,  CELL_BARS,
                                          CELL_EMPTY,    CELL_NONCAUSAL, CELL_PADDING};
  for (int l = 0; l < NUM_LEGEND; l++) {
    const int y = p->plot_y + p->plot + 1 + 12 + l * (LINE_STEP + 4), x = MARGIN;
    canvas_fill(c, x, y, SWATCH, SWATCH, col_frame);
    for (int sy = 1; sy < SWATCH - 1; sy++)
      for (int sx = 1; sx < SWATCH - 1; sx++) {
        /* the bars' swatch shows its scale: few verticals left, many right */
        const int64_t bars = 1 + (v->g - 1) * (sx - 1) / (SWATCH - 3);
        cell_colour(classes[l], bars, v->g, x + sx, y + sy,
                    c->rgb + 3 * ((size_t)(y + sy) * (size_t)c->w + (size_t)(x + sx)));
      }
    canvas_text(c, x + SWATCH + 8, y, TEXT_SCALE, p->legend[l], col_ink);
  }
}

static int draw(const viewer_options_t *o, const mtrain_pattern_t *p, const char *source) {
  const int32_t heads = mtrain_pattern_num_heads(p);
  if (o->head >= heads) {
    fprintf(stderr, "%s: --head %d out of range: %s has %d heads (0 to %d)\n", prog, o->head,
            source, heads, heads - 1);
    return 1;
  }
  head_view_t v;
  int rc = view_init(p, o->head, &v);
  int32_t px = o->size;
  if (!px) /* whole pixels per block, at least MIN_DEFAULT_PX, pooled above DEFAULT_MAX_PX */
    px = v.nb <= MIN_DEFAULT_PX   ? (int32_t)(v.nb * ((MIN_DEFAULT_PX + v.nb - 1) / v.nb))
         : v.nb <= DEFAULT_MAX_PX ? (int32_t)v.nb
                                  : DEFAULT_MAX_PX;
  picture_t pic;
  canvas_t c = {0, 0, NULL};
  if (!rc) {
    count_computed(&v);
    picture_layout(&v, o->head, px, !o->no_legend, &pic);
    if (canvas_init(&c, pic.w, pic.h)) {
      fprintf(stderr, "%s: out of memory for a %d x %d image\n", prog, pic.w, pic.h);
      rc = 1;
    }
  }
  if (!rc) {
    render(&v, px, &c, pic.plot_x, pic.plot_y);
    if (!o->no_legend) picture_decorate(&v, &pic, &c);
    char err[4400];
    rc = canvas_write_png(&c, o->out_path, err, sizeof err);
    if (rc) fprintf(stderr, "%s: %s\n", prog, err);
  }
  if (!rc) {
    char scale[64];
    if (px % v.nb == 0)
      snprintf(scale, sizeof scale, "%lld px per block", (long long)(px / v.nb));
    else if (px >= v.nb)
      snprintf(scale, sizeof scale, "%.2f px per block", (double)px / (double)v.nb);
    else
      snprintf(scale, sizeof scale, "%.2f blocks per px, max-pooled", (double)v.nb / (double)px);
    printf("%s: head %d of %s: %lld x %lld blocks of %lld, %lld computed, %lld verticals%s -> "
           "%s (image %d x %d px, plot %d x %d px, %s%s)\n",
           prog, o->head, source, (long long)v.nb, (long long)v.nb, (long long)v.g,
           (long long)v.computed_blocks, (long long)v.verticals,
           v.block_mask ? " (block mask)" : "", o->out_path, pic.w, pic.h, px, px, scale,
           o->no_legend ? "" : ", with legend");
  }
  canvas_free(&c);
  view_free(&v);
  return rc;
}

int main(int argc, char **argv) {
  viewer_options_t o;
  int rc = parse_options(argc, argv, &o);
  if (rc) return rc == 2 ? 0 : 2;
  mtrain_pattern_t *pattern = NULL;
  rc = load_pattern(&o, &pattern);
  if (!rc) rc = draw(&o, pattern, o.pattern_path ? o.pattern_path : "the estimated pattern");
  mtrain_pattern_destroy(pattern);
  return rc ? 1 : 0;
}
