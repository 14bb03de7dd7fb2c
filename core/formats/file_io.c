/* file_io.c: reading a whole file and the messages of failed file
 * operations, for the JSON readers and writers. */
#define _POSIX_C_SOURCE 200809L
#include "core/formats/file_io.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_error.h"

#define READ_CHUNK 65536

mtrain_status_t mtrain_io_error(const char *path, const char *what, int err) {
  char reason[128];
  if (strerror_r(err, reason, sizeof reason) != 0) snprintf(reason, sizeof reason, "error %d", err);
  return mtrain_error(MTRAIN_ERR_IO, "%s: %s: %s", path, what, reason);
}

mtrain_status_t mtrain_read_file(const char *path, char **text, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return mtrain_io_error(path, "cannot open for reading", errno);
  char *buf = NULL;
  size_t n = 0, cap = 0;
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (;;) {
    if (cap - n < READ_CHUNK) {
      char *grown = realloc(buf, cap + READ_CHUNK + 1);
      if (!grown) {
        st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "%s: out of memory reading the file", path);
        break;
      }
      buf = grown;
      cap += READ_CHUNK;
    }
    size_t got = fread(buf + n, 1, cap - n, f);
    n += got;
    if (got == 0) {
      if (ferror(f)) st = mtrain_io_error(path, "read error", errno);
      break;
    }
  }
  fclose(f);
  if (st != MTRAIN_SUCCESS) {
    free(buf);
    return st;
  }
  buf[n] = '\0';
  *text = buf;
  *len = n;
  return MTRAIN_SUCCESS;
}
