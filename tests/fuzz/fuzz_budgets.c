/* fuzz_budgets.c: libFuzzer target: any bytes given to the budget-file
 * parser either give budgets whose every entry validates, or an error with a
 * message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  memcpy(text, data, size);
  text[size] = '\0';
  mtrain_budgets_t *b = NULL;
  mtrain_status_t st = mtrain_budgets_parse(text, "fuzz", &b);
  if (st == MTRAIN_SUCCESS) {
    for (int32_t l = 0; l < mtrain_budgets_num_layers(b); l++)
      for (int32_t h = 0; h < mtrain_budgets_num_heads(b, l); h++) {
        mtrain_head_budget_t hb;
        if (mtrain_budgets_get(b, l, h, &hb) != MTRAIN_SUCCESS) abort();
        if (mtrain_head_budget_validate(&hb) != MTRAIN_SUCCESS) abort();
      }
  } else if (mtrain_last_error()[0] == '\0') {
    abort();
  }
  mtrain_budgets_destroy(b);
  free(text);
  return 0;
}
