/* run_attention.c: the context and the timed attention of mtrain-run
 * (single rank and ring) and mtrain-bench: a context configured from the
 * options; forward and backward --repeat times on it, medians of the times
 * and the ring statistics of the last run. */
#include <stdlib.h>

#include "run_common.h"
#include "tool_common.h"

int run_make_context(const char *prog, const run_options_t *o, const char *backend,
                     mtrain_comm_t *comm, mtrain_context_t **ctx) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = backend;
  cfg.granularity = o->granularity;
  cfg.num_threads = o->threads;
  cfg.check_inputs = 1;
  return tool_failed(prog, "creating the context", mtrain_context_create(&cfg, comm, ctx));
}

/* Forward (and backward) on one context with tensors of in->dtype. */
int run_attention(const char *prog, mtrain_context_t *ctx, const mtrain_plan_t *plan,
                  run_inputs_t *in, run_outputs_t *out, const run_options_t *o, run_result_t *r) {
  double *tf = calloc((size_t)o->repeat, sizeof *tf), *tb = calloc((size_t)o->repeat, sizeof *tb);
  int rc = !tf || !tb;
  for (int i = 0; i < o->repeat && !rc; i++) {
    double t0 = tool_now();
    rc = tool_failed(
        prog, "forward",
        mtrain_attention_forward(ctx, plan, &in->q, &in->k, &in->v, &out->o, &out->lse));
    tf[i] = tool_now() - t0;
    if (!rc) mtrain_context_last_stats(ctx, &r->fwd_stats);
    if (rc || o->forward_only) continue;
    t0 = tool_now();
    rc = tool_failed(prog, "backward",
                     mtrain_attention_backward(ctx, plan, &in->q, &in->k, &in->v, &out->o,
                                               &out->lse, &in->dout, &out->dq, &out->dk, &out->dv));
    tb[i] = tool_now() - t0;
    if (!rc) mtrain_context_last_stats(ctx, &r->bwd_stats);
  }
  if (!rc) {
    r->t_fwd = tool_median(tf, o->repeat);
    r->t_bwd = o->forward_only ? 0.0 : tool_median(tb, o->repeat);
  }
  free(tf);
  free(tb);
  return rc;
}
