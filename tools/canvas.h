/* canvas.h: an RGB drawing surface for the tools' PNG pictures (the pattern
 * viewer, the balance heatmap): filled rectangles, text in a built-in 5x7
 * bitmap font (printable ASCII, scaled by whole pixels) and writing the
 * picture with libpng. In canvas.c. */
#ifndef MTRAIN_TOOLS_CANVAS_H
#define MTRAIN_TOOLS_CANVAS_H

#include <stddef.h>

/** Glyph cell of the font, in font pixels: 5 wide plus 1 of spacing, 7 tall
 *  plus 1 for descenders (g, j, p, q, y). Multiply by the scale. */
#define CANVAS_GLYPH_ADVANCE 6
#define CANVAS_GLYPH_HEIGHT 8

typedef struct canvas {
  int w, h;
  unsigned char *rgb; /**< [h][w][3], row-major */
} canvas_t;

/** A w x h canvas, white. Returns 0, or 1 when out of memory. */
int canvas_init(canvas_t *c, int w, int h);
void canvas_free(canvas_t *c);
/** Fills [x, x + w) x [y, y + h), clipped to the canvas. */
void canvas_fill(canvas_t *c, int x, int y, int w, int h, const unsigned char rgb[3]);
/** Draws s with its top-left corner at (x, y), each font pixel scale x scale
 *  canvas pixels. Characters the font lacks are drawn blank. */
void canvas_text(canvas_t *c, int x, int y, int scale, const char *s, const unsigned char ink[3]);
/** Width in canvas pixels of s drawn at `scale`. */
int canvas_text_width(const char *s, int scale);
/** Writes the canvas as an 8-bit RGB PNG. Returns 0, or 1 with the reason
 *  (naming the file) in err. */
int canvas_write_png(const canvas_t *c, const char *path, char *err, size_t err_cap);

#endif /* MTRAIN_TOOLS_CANVAS_H */
