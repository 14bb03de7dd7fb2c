/* mtrain_pattern.c: the pattern viewer mtrain-pattern: draws one head of a
 * sparse pattern as a PNG, rows = query blocks, columns = key blocks:
 * computed blocks dark blue, blocks that only hold bars (verticals outside
 * the computed blocks) orange, darker the more verticals the key block has,
 * causal blocks not computed white, the non-causal upper triangle light grey.
 * One pixel per block up to 1024 blocks; larger patterns (or --size) are
 * max-pooled (computed > bars > empty > non-causal); a --size above the block
 * count enlarges the blocks. The pattern comes from a file, or is estimated
 * online (SPEC.md section 2) from structured inputs generated from a seed
 * with per-head budgets (--estimate). Exit 0 on success, 1
 * when the work fails (unreadable pattern, head out of range, PNG not
 * written), 2 on a bad command line. */
#define _POSIX_C_SOURCE 200809L /* tool_common.h: clock_gettime */

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_io.h"
#include "tool_common.h"

static const char *prog = "mtrain-pattern";

static const char usage[] =
    "usage: mtrain-pattern (--pattern FILE.json | --estimate ...) --head H --out FILE.png\n"
    "                      [--size PX]\n"
    "Draws one head's block pattern: rows = query blocks, columns = key blocks.\n"
    "  --pattern FILE.json   a pattern file (SPEC.md section 8)\n"
    "  --estimate            estimate the pattern online from structured inputs\n"
    "                        (mtrain_inputs.h) with --budgets FILE --layer L, or\n"
    "                        --v-size N --s-size N; --seq-len N (4096) --heads H (16)\n"
    "                        --kv-heads H (2) --head-dim D (128) --seed S (1)\n"
    "                        --granularity G (128) --last-q L (64)\n"
    "  --head H              the query head to draw (0-based)\n"
    "  --out FILE.png        the image to write\n"
    "  --size PX             image width and height in pixels (default: one pixel\n"
    "                        per block, at most 1024; fewer pixels max-pool blocks)\n"
    "Colours: computed blocks blue; bars only (verticals) orange, darker with more\n"
    "verticals in the key block; causal but not computed white; non-causal grey.\n";

#define DEFAULT_MAX_PX 1024
#define MAX_SIZE_PX 16384

typedef struct viewer_options {
  const char *pattern_path; /* input source: a pattern file, or */
  int estimate;             /* estimated from structured inputs */
  const char *budgets_path;
  int32_t layer, v_size, s_size, heads, kv_heads, head_dim, granularity, last_q, seed, seq_len;
  const char *out_path;
  int32_t head;
  int32_t size; /* 0: default */
} viewer_options_t;

/* Block classes, ordered for max-pooling. */
enum { CELL_NONCAUSAL = 0, CELL_EMPTY = 1, CELL_BARS = 2, CELL_COMPUTED = 3 };

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
  static const struct option longs[] = {
      {"pattern", required_argument, 0, 'p'},  {"head", required_argument, 0, 'H'},
      {"out", required_argument, 0, 'o'},      {"size", required_argument, 0, 's'},
      {"help", no_argument, 0, 'h'},           {"estimate", no_argument, 0, 'e'},
      {"budgets", required_argument, 0, 'B'},  {"layer", required_argument, 0, 'L'},
      {"v-size", required_argument, 0, 'V'},   {"s-size", required_argument, 0, 'S'},
      {"seq-len", required_argument, 0, 'N'},  {"heads", required_argument, 0, 'q'},
      {"kv-heads", required_argument, 0, 'k'}, {"head-dim", required_argument, 0, 'd'},
      {"seed", required_argument, 0, 'r'},     {"granularity", required_argument, 0, 'G'},
      {"last-q", required_argument, 0, 'l'},   {0, 0, 0, 0}};
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
  if (o->estimate && !((o->budgets_path && o->layer >= 0) || (o->v_size >= 0 && o->s_size >= 0))) {
    fprintf(stderr, "%s: --estimate needs --budgets FILE --layer L or --v-size N --s-size N\n",
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
  if (!rc) rc = estimate_budgets(o, &budgets);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.granularity = o->granularity;
  if (!rc) rc = tool_failed(prog, "context", mtrain_context_create(&cfg, NULL, &ctx));
  mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
  eo.last_q = o->last_q;
  if (!rc)
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
  if (kb > qb) return CELL_NONCAUSAL;
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

static void cell_colour(int cls, int64_t bars, int64_t g, uint8_t *rgb) {
  static const uint8_t noncausal[3] = {232, 232, 232}, empty[3] = {255, 255, 255};
  static const uint8_t computed[3] = {31, 78, 154};
  static const uint8_t bar_lo[3] = {253, 208, 162}, bar_hi[3] = {166, 54, 3};
  switch (cls) {
  case CELL_COMPUTED:
    memcpy(rgb, computed, 3);
    break;
  case CELL_BARS: /* log scale: one vertical is visible, a full block of them darkest */
    blend(bar_lo, bar_hi, log1p((double)(bars - 1)) / log1p((double)(g > 1 ? g - 1 : 1)), rgb);
    break;
  case CELL_EMPTY:
    memcpy(rgb, empty, 3);
    break;
  default:
    memcpy(rgb, noncausal, 3);
  }
}

/* Renders px x px RGB: pixel (y, x) covers blocks [y*nb/px, (y+1)*nb/px) (at
 * least one) in each direction and shows their maximum. */
static void render(head_view_t *v, int32_t px, uint8_t *image) {
  for (int32_t y = 0; y < px; y++) {
    const int64_t q0 = (int64_t)y * v->nb / px;
    int64_t q1 = (int64_t)(y + 1) * v->nb / px;
    if (q1 <= q0) q1 = q0 + 1;
    for (int32_t x = 0; x < px; x++) {
      const int64_t k0 = (int64_t)x * v->nb / px;
      int64_t k1 = (int64_t)(x + 1) * v->nb / px;
      if (k1 <= k0) k1 = k0 + 1;
      int best = CELL_NONCAUSAL;
      int64_t best_bars = 0;
      for (int64_t qb = q0; qb < q1; qb++)
        for (int64_t kb = k0; kb < k1 && kb <= qb; kb++) {
          int64_t bars;
          const int cls = view_cell(v, qb, kb, &bars);
          if (cls > best || (cls == best && bars > best_bars)) {
            best = cls;
            best_bars = bars;
          }
        }
      cell_colour(best, best_bars, v->g, image + ((size_t)y * px + x) * 3);
    }
  }
  for (int64_t qb = 0; qb < v->nb; qb++)
    for (int64_t kb = 0; kb <= qb; kb++) {
      int64_t bars;
      if (view_cell(v, qb, kb, &bars) == CELL_COMPUTED) v->computed_blocks++;
    }
}

/* Writes an RGB image; libpng reports its errors through longjmp. */
static int write_png(const char *path, const uint8_t *image, int32_t px) {
  FILE *f = fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "%s: cannot write PNG '%s': %s\n", prog, path, strerror(errno));
    return 1;
  }
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
  png_infop info = png ? png_create_info_struct(png) : NULL;
  if (!png || !info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    fclose(f);
    fprintf(stderr, "%s: cannot write PNG '%s': libpng failed\n", prog, path);
    return 1;
  }
  png_init_io(png, f);
  png_set_IHDR(png, info, (png_uint_32)px, (png_uint_32)px, 8, PNG_COLOR_TYPE_RGB,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int32_t y = 0; y < px; y++)
    png_write_row(png, (png_const_bytep)(image + (size_t)y * px * 3));
  png_write_end(png, NULL);
  png_destroy_write_struct(&png, &info);
  if (fclose(f) != 0) {
    fprintf(stderr, "%s: cannot write PNG '%s': %s\n", prog, path, strerror(errno));
    return 1;
  }
  return 0;
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
  const int32_t px = o->size ? o->size : v.nb < DEFAULT_MAX_PX ? (int32_t)v.nb : DEFAULT_MAX_PX;
  uint8_t *image = rc ? NULL : malloc((size_t)px * (size_t)px * 3);
  if (!rc && !image) {
    fprintf(stderr, "%s: out of memory for a %d x %d image\n", prog, px, px);
    rc = 1;
  }
  if (!rc) {
    render(&v, px, image);
    rc = write_png(o->out_path, image, px);
  }
  if (!rc)
    printf("%s: head %d of %s: %lld x %lld blocks of %lld, %lld computed, %lld verticals%s -> "
           "%s (%d x %d px)\n",
           prog, o->head, source, (long long)v.nb, (long long)v.nb, (long long)v.g,
           (long long)v.computed_blocks, (long long)v.verticals,
           v.block_mask ? " (block mask)" : "", o->out_path, px, px);
  free(image);
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
