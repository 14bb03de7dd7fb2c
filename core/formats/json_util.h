/* json_util.h (private): what the JSON readers (pattern files, budget files)
 * share: the name of a JSON value's type for messages. */
#ifndef MTRAIN_CORE_JSON_UTIL_H
#define MTRAIN_CORE_JSON_UTIL_H

#include <jansson.h>

/** "an object", "an array", "a string", ... for messages. */
static inline const char *mtrain_json_type_name(const json_t *v) {
  switch (json_typeof(v)) {
  case JSON_OBJECT:
    return "an object";
  case JSON_ARRAY:
    return "an array";
  case JSON_STRING:
    return "a string";
  case JSON_INTEGER:
    return "an integer";
  case JSON_REAL:
    return "a non-integer number";
  case JSON_TRUE:
  case JSON_FALSE:
    return "a boolean";
  case JSON_NULL:
    return "null";
  }
  return "an unknown value";
}

#endif /* MTRAIN_CORE_JSON_UTIL_H */
