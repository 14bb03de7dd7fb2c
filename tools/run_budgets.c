/* run_budgets.c: the per-head budgets of the online estimate from the
 * command line (--v-size/--s-size, --top-p, --budgets/--layer) and the
 * description of the pattern source for reports, shared by mtrain-run
 * (single rank and ring), mtrain-bench and mtrain-bench-cuda. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "run_common.h"
#include "tool_common.h"

/* The per-head budgets the options ask for (malloc'ed, heads entries);
 * messages start with `prog`. */
int run_make_budgets(const char *prog, const run_options_t *o, int32_t heads,
                     mtrain_head_budget_t **out) {
  mtrain_head_budget_t *b = calloc((size_t)heads, sizeof *b);
  mtrain_budgets_t *file = NULL;
  int rc = b == NULL;
  if (!rc && o->budgets_path) {
    rc = tool_failed(prog, o->budgets_path, mtrain_budgets_read(o->budgets_path, &file));
    if (!rc && mtrain_budgets_num_heads(file, o->layer) != heads) {
      fprintf(stderr,
              "%s: %s: layer %d has %d heads (of %d layers), the inputs have %d query heads\n",
              prog, o->budgets_path, o->layer, mtrain_budgets_num_heads(file, o->layer),
              mtrain_budgets_num_layers(file), heads);
      rc = 1;
    }
  }
  for (int32_t h = 0; h < heads && !rc; h++) {
    if (file) {
      rc = tool_failed(prog, o->budgets_path, mtrain_budgets_get(file, o->layer, h, &b[h]));
    } else if (o->top_p > 0) {
      b[h].kind = MTRAIN_BUDGET_TOP_P;
      b[h].p_v = b[h].p_s = o->top_p;
      b[h].cap_v = b[h].cap_s = o->top_p_cap;
    } else {
      b[h].kind = MTRAIN_BUDGET_TOP_K;
      b[h].v_size = o->v_size;
      b[h].s_size = o->s_size;
    }
  }
  mtrain_budgets_destroy(file);
  if (rc) {
    free(b);
    return 1;
  }
  *out = b;
  return 0;
}

/* What the pattern came from, for the report. */
const char *run_pattern_source(const run_options_t *o) {
  static char text[512];
  if (o->pattern_path) return o->pattern_path;
  if (o->budgets_path)
    snprintf(text, sizeof text, "estimated, budgets %s layer %d", o->budgets_path, o->layer);
  else if (o->top_p > 0)
    snprintf(text, sizeof text, "estimated, top-p %g cap %lld", o->top_p, (long long)o->top_p_cap);
  else if (o->v_size >= 0)
    snprintf(text, sizeof text, "estimated, top-k v_size %lld s_size %lld", (long long)o->v_size,
             (long long)o->s_size);
  else
    return "dense causal";
  if (o->top_p_forced && (o->top_p > 0 || o->budgets_path)) {
    const size_t n = strlen(text);
    snprintf(text + n, sizeof text - n, ", sinks and window forced in top-p");
  }
  return text;
}
