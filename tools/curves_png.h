/* curves_png.h: a line chart of (x, y) series as a PNG (the recall against
 * density curves of mtrain-block-curves): axes from 0 to 1 on both sides,
 * grid lines every 0.1, one colour and a legend entry per series, points
 * joined in the order given. In curves_png.c (canvas.c draws and writes). */
#ifndef MTRAIN_TOOLS_CURVES_PNG_H
#define MTRAIN_TOOLS_CURVES_PNG_H

#include <stddef.h>

enum { CURVES_MAX_SERIES = 8, CURVES_MAX_POINTS = 16 };

typedef struct curves {
  const char *title, *x_label, *y_label;
  int num_series;
  const char *name[CURVES_MAX_SERIES];
  int num_points[CURVES_MAX_SERIES];
  double x[CURVES_MAX_SERIES][CURVES_MAX_POINTS], y[CURVES_MAX_SERIES][CURVES_MAX_POINTS];
} curves_t;

/** Adds point (x, y) to the series named `name` (made on first use). Returns
 *  0, or 1 when the series or points are full (the point is then dropped). */
int curves_add(curves_t *c, const char *name, double x, double y);

/** Draws the chart (x and y in [0, 1]; points outside are clipped) and
 *  writes it to path. Returns 0, or 1 with the reason in err. */
int curves_write_png(const curves_t *c, const char *path, char *err, size_t err_cap);

#endif /* MTRAIN_TOOLS_CURVES_PNG_H */
