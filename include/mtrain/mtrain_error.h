/* mtrain_error.h: setting the thread-local last-error message, and the check
 * macros; for authors of backends and communicators (and used across the
 * library). Every error path goes through mtrain_error(), which formats the
 * message and returns the status, so a failing function reads
 * `return mtrain_error(MTRAIN_ERR_X, "...", ...);`. The message is what
 * mtrain_last_error() then gives the caller, on the calling thread. */
#ifndef MTRAIN_ERROR_H
#define MTRAIN_ERROR_H

#include "mtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MTRAIN_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MTRAIN_PRINTF(a, b)
#endif

/** Formats the thread's last-error message and returns `status`. */
MTRAIN_API mtrain_status_t mtrain_error(mtrain_status_t status, const char *fmt, ...)
    MTRAIN_PRINTF(2, 3);
/** Prefixes the current message with more context ("reading q.npy: ...")
 *  and returns `status` unchanged. */
MTRAIN_API mtrain_status_t mtrain_error_prefix(mtrain_status_t status, const char *fmt, ...)
    MTRAIN_PRINTF(2, 3);

/** Evaluates an expression returning mtrain_status_t; on error stores it in
 *  the local `st` and jumps to the local label `cleanup`. */
#define MTRAIN_TRY(expr)                                                                           \
  do {                                                                                             \
    st = (expr);                                                                                   \
    if (st != MTRAIN_SUCCESS) goto cleanup;                                                        \
  } while (0)

/** Fails with `status` and a message (jumping to cleanup) when cond holds. */
#define MTRAIN_FAIL_IF(cond, status, ...)                                                          \
  do {                                                                                             \
    if (cond) {                                                                                    \
      st = mtrain_error((status), __VA_ARGS__);                                                    \
      goto cleanup;                                                                                \
    }                                                                                              \
  } while (0)

/** Returns MTRAIN_ERR_NULL_POINTER naming the argument when it is NULL. */
#define MTRAIN_CHECK_NOT_NULL(ptr)                                                                 \
  do {                                                                                             \
    if ((ptr) == NULL)                                                                             \
      return mtrain_error(MTRAIN_ERR_NULL_POINTER, "%s: argument '%s' is NULL", __func__, #ptr);   \
  } while (0)

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_ERROR_H */
