/* balance_png.c: draws the mtrain-balance heatmap (balance_png.h) on a
 * canvas (canvas.h: the tools' font and PNG writer). Drawn only when libpng
 * is found (MTRAIN_HAVE_PNG); otherwise balance_png_write reports that. */
#include "balance_png.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MTRAIN_HAVE_PNG

#include "canvas.h"

#define SCALE 2                               /* font pixels per glyph pixel */
#define CHAR_W (CANVAS_GLYPH_ADVANCE * SCALE) /* advance */
#define LINE_H (9 * SCALE)                    /* line height */
#define MARGIN 16

static void fill_rect(canvas_t *c, int x, int y, int w, int h, const unsigned char col[3]) {
  canvas_fill(c, x, y, w, h, col);
}

/* The labels are drawn in capitals (and 'x' as the times sign). */
static void text(canvas_t *c, int x, int y, const char *s) {
  static const unsigned char ink[3] = {20, 20, 20};
  char upper[256];
  size_t n = 0;
  for (; s[n] && n + 1 < sizeof upper; n++)
    upper[n] = s[n] == 'x' ? 'x' : (char)toupper((unsigned char)s[n]);
  upper[n] = '\0';
  canvas_text(c, x, y, SCALE, upper, ink);
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
  if (canvas_init(&c, c.w, c.h)) {
    snprintf(err, err_cap, "out of memory for a %d x %d picture", c.w, c.h);
    return 1;
  }
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
  const int rc = canvas_write_png(&c, path, err, err_cap);
  canvas_free(&c);
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
