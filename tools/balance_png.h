/* balance_png.h: the heatmap picture of mtrain-balance: one panel per
 * layout, rows = ranks, columns = ring steps, colour = work relative to the
 * mean of a (rank, step), on one shared scale, with a colour bar and labels
 * in a built-in 5x7 font. Written with libpng. */
#ifndef MTRAIN_TOOLS_BALANCE_PNG_H
#define MTRAIN_TOOLS_BALANCE_PNG_H

#include <stddef.h>

typedef struct heat_panel {
  const char *title;    /**< first label line (upper-cased when drawn) */
  const char *subtitle; /**< second label line */
  const double *values; /**< [rows * cols], row-major: value of (rank, step) */
} heat_panel_t;

/** Writes the panels side by side to `path` as an RGB PNG; values are
 *  coloured on [0, vmax]. Returns 0, or 1 with a reason in err. */
int balance_png_write(const char *path, int rows, int cols, const heat_panel_t *panels,
                      int num_panels, const char *caption, double vmax, char *err, size_t err_cap);

#endif /* MTRAIN_TOOLS_BALANCE_PNG_H */
