/* curves_png.c: the line chart of curves_png.h on a canvas. */
#include "curves_png.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "canvas.h"

int curves_add(curves_t *c, const char *name, double x, double y) {
  int s = 0;
  while (s < c->num_series && strcmp(c->name[s], name) != 0) s++;
  if (s == c->num_series) {
    if (c->num_series == CURVES_MAX_SERIES) return 1;
    c->name[c->num_series++] = name;
  }
  if (c->num_points[s] == CURVES_MAX_POINTS) return 1;
  c->x[s][c->num_points[s]] = x;
  c->y[s][c->num_points[s]] = y;
  c->num_points[s]++;
  return 0;
}

enum { W = 960, H = 650, LEFT = 80, RIGHT = 300, TOP = 60, BOTTOM = 70, DOT = 3 };

static const unsigned char palette[CURVES_MAX_SERIES][3] = {
    {31, 119, 180},  {255, 127, 14}, {44, 160, 44},   {214, 39, 40},
    {148, 103, 189}, {140, 86, 75},  {227, 119, 194}, {90, 90, 90}};

static int px(double x) { return LEFT + (int)lround(fmin(fmax(x, 0), 1) * (W - LEFT - RIGHT)); }
static int py(double y) {
  return H - BOTTOM - (int)lround(fmin(fmax(y, 0), 1) * (H - TOP - BOTTOM));
}

/* A 2-pixel line from (x0, y0) to (x1, y1) (canvas pixels), by steps of one pixel. */
static void line(canvas_t *cv, int x0, int y0, int x1, int y1, const unsigned char rgb[3]) {
  const int n = abs(x1 - x0) > abs(y1 - y0) ? abs(x1 - x0) : abs(y1 - y0);
  for (int i = 0; i <= n; i++) {
    const double t = n ? (double)i / n : 0.0;
    canvas_fill(cv, (int)lround(x0 + t * (x1 - x0)), (int)lround(y0 + t * (y1 - y0)), 2, 2, rgb);
  }
}

int curves_write_png(const curves_t *c, const char *path, char *err, size_t err_cap) {
  canvas_t cv;
  if (canvas_init(&cv, W, H)) {
    snprintf(err, err_cap, "%s: out of memory", path);
    return 1;
  }
  static const unsigned char ink[3] = {0, 0, 0}, grid[3] = {225, 225, 225};
  char label[32];
  for (int i = 0; i <= 10; i++) { /* grid, ticks and their labels */
    const double v = i / 10.0;
    canvas_fill(&cv, px(v), TOP, 1, H - TOP - BOTTOM, grid);
    canvas_fill(&cv, LEFT, py(v), W - LEFT - RIGHT, 1, grid);
    snprintf(label, sizeof label, "%.1f", v);
    canvas_text(&cv, px(v) - canvas_text_width(label, 2) / 2, H - BOTTOM + 8, 2, label, ink);
    canvas_text(&cv, LEFT - 8 - canvas_text_width(label, 2), py(v) - 7, 2, label, ink);
  }
  canvas_fill(&cv, LEFT, TOP, 1, H - TOP - BOTTOM, ink); /* axes */
  canvas_fill(&cv, LEFT, H - BOTTOM, W - LEFT - RIGHT, 1, ink);
  canvas_text(&cv, LEFT, 6, 2, c->title, ink);
  canvas_text(&cv, LEFT + (W - LEFT - RIGHT - canvas_text_width(c->x_label, 2)) / 2,
              H - BOTTOM + 34, 2, c->x_label, ink);
  canvas_text(&cv, 8, TOP - 22, 2, c->y_label, ink);
  for (int s = 0; s < c->num_series; s++) {
    const unsigned char *col = palette[s];
    for (int i = 0; i < c->num_points[s]; i++) {
      const int x = px(c->x[s][i]), y = py(c->y[s][i]);
      canvas_fill(&cv, x - DOT, y - DOT, 2 * DOT + 1, 2 * DOT + 1, col);
      if (i > 0) line(&cv, px(c->x[s][i - 1]), py(c->y[s][i - 1]), x, y, col);
    }
    const int ly = TOP + 10 + 24 * s; /* legend */
    canvas_fill(&cv, W - RIGHT + 16, ly + 2, 18, 10, col);
    canvas_text(&cv, W - RIGHT + 40, ly, 2, c->name[s], ink);
  }
  const int rc = canvas_write_png(&cv, path, err, err_cap);
  canvas_free(&cv);
  return rc;
}
