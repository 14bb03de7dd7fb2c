/* error.c: status strings (from the X-macro table in mtrain.h) and the
 * thread-local last-error message. */
#include "mtrain/mtrain_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define MTRAIN_ERROR_CAPACITY 1024

static _Thread_local char last_error[MTRAIN_ERROR_CAPACITY];

const char *mtrain_status_string(mtrain_status_t status) {
  switch (status) {
#define MTRAIN_STATUS_TEXT_(name, value, text)                                                     \
  case name:                                                                                       \
    return text;
    MTRAIN_STATUS_TABLE(MTRAIN_STATUS_TEXT_)
#undef MTRAIN_STATUS_TEXT_
  }
  return "unknown status";
}

const char *mtrain_status_name(mtrain_status_t status) {
  switch (status) {
#define MTRAIN_STATUS_NAME_(name, value, text)                                                     \
  case name:                                                                                       \
    return #name;
    MTRAIN_STATUS_TABLE(MTRAIN_STATUS_NAME_)
#undef MTRAIN_STATUS_NAME_
  }
  return "unknown";
}

const char *mtrain_last_error(void) { return last_error; }

void mtrain_clear_error(void) { last_error[0] = '\0'; }

mtrain_status_t mtrain_error(mtrain_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return status;
}

mtrain_status_t mtrain_error_prefix(mtrain_status_t status, const char *fmt, ...) {
  char prefix[MTRAIN_ERROR_CAPACITY];
  char old[MTRAIN_ERROR_CAPACITY];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, last_error, sizeof old);
  size_t n = strlen(prefix);
  if (n > sizeof last_error - 3) n = sizeof last_error - 3;
  memcpy(last_error, prefix, n);
  memcpy(last_error + n, ": ", 2);
  size_t room = sizeof last_error - n - 2;
  size_t m = strnlen(old, room - 1);
  memcpy(last_error + n + 2, old, m);
  last_error[n + 2 + m] = '\0';
  return status;
}
