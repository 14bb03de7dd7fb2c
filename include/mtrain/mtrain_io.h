/* mtrain_io.h: the interchange formats of SPEC.md section 8.
 *
 * NumPy .npy tensors (format 1.0, 2.0 and 3.0, little-endian, C order,
 * float16/float32/float64) and the pattern JSON. Every malformed file is
 * rejected with MTRAIN_ERR_FORMAT (or MTRAIN_ERR_IO when it cannot be opened
 * or read) and a message naming the file, the place and the reason. Readers
 * allocate with malloc; the caller frees with free(). Thread-safe (no shared
 * state).
 */
#ifndef MTRAIN_IO_H
#define MTRAIN_IO_H

#include "mtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

/** A tensor read from a .npy file; `data` is malloc'ed and owned by the
 *  caller (free it with mtrain_npy_free). The dtype is the file's: F16, F32
 *  or F64. */
typedef struct mtrain_npy {
  mtrain_tensor_t tensor;
} mtrain_npy_t;

/** Reads a .npy file. An array with an extent 0 (empty, no data) is read;
 *  the product of its other extents must still be addressable, as the
 *  extents of every array (MTRAIN_ERR_FORMAT otherwise). */
MTRAIN_API mtrain_status_t mtrain_npy_read(const char *path, mtrain_npy_t *out);
/** Reads a .npy file and checks its number of dimensions, that every
 *  dimension is at least 1 (a tensor of the API is never empty), and, for
 *  each shape entry >= 0 in `expect_shape`, its extent; then converts it to
 *  `dtype`. MTRAIN_ERR_SHAPE_MISMATCH with a message naming the file and the
 *  dimension that disagrees, before any element is converted. */
MTRAIN_API mtrain_status_t mtrain_npy_read_as(const char *path, mtrain_dtype_t dtype, int32_t ndim,
                                              const int64_t *expect_shape, mtrain_npy_t *out);
MTRAIN_API void mtrain_npy_free(mtrain_npy_t *npy);
/** Writes a tensor as .npy (format 1.0). F16/F32/F64 are written as they
 *  are; BF16 is widened to float32 (.npy has no bfloat16). */
MTRAIN_API mtrain_status_t mtrain_npy_write(const char *path, const mtrain_tensor_t *tensor);

/** Reads a pattern JSON file:
 *  {"granularity": G, "seq_len": N, "heads": [{"diagonals": [...],
 *  "verticals": [...]}, ...]}. Validated (integers, sorted, unique, in range);
 *  diagonal 0 is added when absent. */
MTRAIN_API mtrain_status_t mtrain_pattern_read_json(const char *path, mtrain_pattern_t **out);
/** Parses the same format from a NUL-terminated string; `origin` names it in
 *  messages (for example a file name). */
MTRAIN_API mtrain_status_t mtrain_pattern_parse_json(const char *text, const char *origin,
                                                     mtrain_pattern_t **out);
/** Writes a pattern in the same format. Block-mask heads are written as
 *  {"block_mask": [[query_block, key_block], ...]}. */
MTRAIN_API mtrain_status_t mtrain_pattern_write_json(const char *path,
                                                     const mtrain_pattern_t *pattern);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_IO_H */
