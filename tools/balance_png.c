/* balance_png.c: draws the mtrain-balance heatmap (balance_png.h) into an
 * RGB buffer and writes it with libpng. Built only when libpng is found
 * (MTRAIN_HAVE_PNG); otherwise balance_png_write reports that. */
#include "balance_png.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MTRAIN_HAVE_PNG
#include <png.h>

/* ---- a 5x7 font: rows top to bottom, bit 4 is the leftmost pixel ---------- */

typedef struct glyph {
  char c;
  unsigned char rows[7];
} glyph_t;

static const glyph_t font[] = {
    {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}},
    {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}},
    {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
    {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}},
    {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
    {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}},
    {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
    {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}},
    {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
    {'A', {0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11}},
    {'B', {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}},
    {'C', {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}},
    {'D', {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}},
    {'E', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}},
    {'F', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}},
    {'G', {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}},
    {'H', {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}},
    {'I', {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}},
    {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}},
    {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}},
    {'M', {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}},
    {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}},
    {'O', {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}},
    {'P', {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}},
    {'Q', {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}},
    {'R', {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}},
    {'S', {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}},
    {'T', {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}},
    {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}},
    {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}},
    {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}},
    {'X', {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}},
    {'Y', {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04}},
    {'Z', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}},
    {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}},
    {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}},
    {'+', {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}},
    {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}},
    {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}},
    {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}},
    {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}},
    {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
    {'/', {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}},
    {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}},
    {'>', {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08}},
    {'x', {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11}},
};

#define SCALE 2            /* font pixels per glyph pixel */
#define CHAR_W (6 * SCALE) /* advance */
#define LINE_H (9 * SCALE) /* line height */
#define MARGIN 16

typedef struct canvas {
  int w, h;
  unsigned char *rgb;
} canvas_t;

static void put(canvas_t *c, int x, int y, const unsigned char col[3]) {
  if (x < 0 || y < 0 || x >= c->w || y >= c->h) return;
  memcpy(c->rgb + 3 * ((size_t)y * (size_t)c->w + (size_t)x), col, 3);
}

static void fill_rect(canvas_t *c, int x, int y, int w, int h, const unsigned char col[3]) {
  for (int j = 0; j < h; j++)
    for (int i = 0; i < w; i++) put(c, x + i, y + j, col);
}

static const glyph_t *find_glyph(char ch) {
  if (ch != 'x') ch = (char)toupper((unsigned char)ch);
  for (size_t i = 0; i < sizeof font / sizeof *font; i++)
    if (font[i].c == ch) return &font[i];
  return NULL; /* space and anything unknown: blank */
}

static void text(canvas_t *c, int x, int y, const char *s) {
  static const unsigned char ink[3] = {20, 20, 20};
  for (; *s; s++, x += CHAR_W) {
    const glyph_t *g = find_glyph(*s);
    if (!g) continue;
    for (int r = 0; r < 7; r++)
      for (int b = 0; b < 5; b++)
        if (g->rows[r] >> (4 - b) & 1)
          fill_rect(c, x + b * SCALE, y + r * SCALE, SCALE, SCALE, ink);
  }
}

/* A perceptual sequential map (viridis, 6 anchors, linear between). */
static void colour(double v, unsigned char out[3]) {
  static const double anchors[6][3] = {{68, 1, 84},    {65, 68, 135},  {42, 120, 142},
                                       {34, 168, 132}, {122, 209, 81}, {253, 231, 37}};
  if (!(v >= 0)) v = 0; /* also NaN */
  if (v > 1) v = 1;
  const double x = v * 5;
  int i = (int)x;
  if (i > 4) i = 4;
  const double f = x - i;
  for (int k = 0; k < 3; k++)
    out[k] = (unsigned char)lround(anchors[i][k] + f * (anchors[i + 1][k] - anchors[i][k]));
}

static int write_file(const char *path, const canvas_t *c, char *err, size_t cap) {
  FILE *f = fopen(path, "wb");
  if (!f) {
    snprintf(err, cap, "cannot open '%s' for writing: %s", path, strerror(errno));
    return 1;
  }
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
  png_infop info = png ? png_create_info_struct(png) : NULL;
  if (!png || !info) {
    png_destroy_write_struct(&png, NULL);
    fclose(f);
    snprintf(err, cap, "libpng: out of memory");
    return 1;
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    fclose(f);
    snprintf(err, cap, "libpng failed writing '%s'", path);
    return 1;
  }
  png_init_io(png, f);
  png_set_IHDR(png, info, (png_uint_32)c->w, (png_uint_32)c->h, 8, PNG_COLOR_TYPE_RGB,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < c->h; y++) png_write_row(png, c->rgb + 3 * (size_t)y * (size_t)c->w);
  png_write_end(png, NULL);
  png_destroy_write_struct(&png, &info);
  if (fclose(f) != 0) {
    snprintf(err, cap, "error closing '%s': %s", path, strerror(errno));
    return 1;
  }
  return 0;
}

int balance_png_write(const char *path, int rows, int cols, const heat_panel_t *panels,
                      int num_panels, const char *caption, double vmax, char *err, size_t err_cap) {
  int cell = 512 / (rows > cols ? rows : cols);
  if (cell > 24) cell = 24;
  if (cell < 1) cell = 1;
  const int pw = cols * cell, ph = rows * cell;
  int label_w = 0;
  for (int p = 0; p < num_panels; p++) {
    const int a = (int)strlen(panels[p].title), b = (int)strlen(panels[p].subtitle);
    label_w = label_w > a ? label_w : a;
    label_w = label_w > b ? label_w : b;
  }
  const int col_w = (pw > label_w * CHAR_W ? pw : label_w * CHAR_W) + 2 * MARGIN;
  const int bar_w = 16, bar_x = MARGIN + num_panels * col_w;
  canvas_t c;
  c.w = bar_x + bar_w + 8 * CHAR_W + MARGIN;
  const int cap_w = (int)strlen(caption) * CHAR_W + 2 * MARGIN;
  if (c.w < cap_w) c.w = cap_w;
  const int top = MARGIN + LINE_H + MARGIN; /* caption line */
  c.h = top + 2 * LINE_H + 4 + ph + LINE_H + MARGIN;
  c.rgb = malloc((size_t)c.w * (size_t)c.h * 3);
  if (!c.rgb) {
    snprintf(err, err_cap, "out of memory for a %d x %d picture", c.w, c.h);
    return 1;
  }
  memset(c.rgb, 255, (size_t)c.w * (size_t)c.h * 3);
  text(&c, MARGIN, MARGIN, caption);
  unsigned char col[3];
  for (int p = 0; p < num_panels; p++) {
    const int x0 = MARGIN + p * col_w, y0 = top + 2 * LINE_H + 4;
    text(&c, x0, top, panels[p].title);
    text(&c, x0, top + LINE_H, panels[p].subtitle);
    for (int r = 0; r < rows; r++)
      for (int s = 0; s < cols; s++) {
        colour(vmax > 0 ? panels[p].values[(size_t)r * cols + s] / vmax : 0, col);
        fill_rect(&c, x0 + s * cell, y0 + r * cell, cell, cell, col);
      }
    text(&c, x0, y0 + ph + 4, "STEP ->");
  }
  /* colour bar: vmax at the top, 0 at the bottom, a tick at 1.0 (the mean) */
  const int y0 = top + 2 * LINE_H + 4;
  for (int j = 0; j < ph; j++) {
    colour(1.0 - (double)j / (ph > 1 ? ph - 1 : 1), col);
    fill_rect(&c, bar_x, y0 + j, bar_w, 1, col);
  }
  char label[32];
  snprintf(label, sizeof label, "%.2f", vmax);
  text(&c, bar_x + bar_w + 4, y0, label);
  const int y1 = y0 + (int)lround((1.0 - 1.0 / vmax) * (ph - 1)); /* where 1.0 sits */
  if (y0 + ph - y1 > 12 * SCALE) text(&c, bar_x + bar_w + 4, y0 + ph - 7 * SCALE, "0");
  if (vmax > 1.0) {
    static const unsigned char black[3] = {0, 0, 0};
    fill_rect(&c, bar_x - 4, y1, bar_w + 8, 1, black);
    text(&c, bar_x + bar_w + 4, y1 - 3 * SCALE, "1 MEAN");
  }
  const int rc = write_file(path, &c, err, err_cap);
  free(c.rgb);
  return rc;
}

#else /* no libpng */

int balance_png_write(const char *path, int rows, int cols, const heat_panel_t *panels,
                      int num_panels, const char *caption, double vmax, char *err, size_t err_cap) {
  (void)rows, (void)cols, (void)panels, (void)num_panels, (void)caption, (void)vmax;
  snprintf(err, err_cap, "cannot write '%s': this build has no libpng (apt-get install libpng-dev)",
           path);
  return 1;
}

#endif
