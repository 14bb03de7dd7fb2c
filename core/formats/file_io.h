/* file_io.h (private): what the file readers and writers share: reading a
 * whole file and the message of a failed file operation. */
#ifndef MTRAIN_CORE_FILE_IO_H
#define MTRAIN_CORE_FILE_IO_H

#include <stddef.h>

#include "mtrain/mtrain.h"

/** Returns MTRAIN_ERR_IO with "<path>: <what>: <strerror(err)>". */
mtrain_status_t mtrain_io_error(const char *path, const char *what, int err);
/** Reads a whole file into a malloc'ed, NUL-terminated buffer (*len bytes
 *  before the NUL); the caller frees it. */
mtrain_status_t mtrain_read_file(const char *path, char **text, size_t *len);

#endif /* MTRAIN_CORE_FILE_IO_H */
