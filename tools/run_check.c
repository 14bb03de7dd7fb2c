/* run_check.c: the bounds of mtrain-run --check (single rank and ring):
 * tol(dtype) * max|ref| plus, for dQ and dK, an absolute floor from the
 * rounding of the backend's accumulator (tool_check_floor); the report line
 * of each output; and the test hook that perturbs an output. */
#include <math.h>
#include <stdio.h>

#include "run_common.h"
#include "run_fault.h"
#include "tool_common.h"

static const char *const output_names[5] = {"o", "lse", "dq", "dk", "dv"};

void run_check_bounds(const mtrain_context_t *ctx, mtrain_dtype_t dtype, int32_t head_dim,
                      const double norms[6], int n, run_result_t *r) {
  const double rel = tool_check_tolerance(dtype);
  const double u = tool_accumulator_unit_roundoff(mtrain_context_backend_name(ctx));
  double scale = fabs(mtrain_context_config(ctx)->softmax_scale);
  if (scale == 0.0) scale = 1.0 / sqrt((double)head_dim); /* (0: the default) */
  r->check_ok = 1;
  for (int t = 0; t < n; t++) {
    /* dQ's cancelling terms are multiplied by k's elements, dK's by q's
     * (norms: ||q||, ||k||, ||v||, ||dout||, max|q|, max|k|) */
    r->floor[t] = t == 2   ? tool_check_floor(u, scale, norms[3], norms[2], norms[5])
                  : t == 3 ? tool_check_floor(u, scale, norms[3], norms[2], norms[4])
                           : 0.0;
    r->bound[t] = fmax(rel * r->ref_max[t], r->floor[t]);
    if (!(r->err[t] <= r->bound[t])) r->check_ok = 0;
  }
  r->checked = 1;
}

void run_check_print(const char *name, const run_result_t *r, int t) {
  char floor[48] = "";
  if (t == 2 || t == 3) snprintf(floor, sizeof floor, "  floor %.3e", r->floor[t]);
  printf("    %-4s max|err| %.3e  bound %.3e  (max|ref| %.3e)%s%s\n", name, r->err[t], r->bound[t],
         r->ref_max[t], floor, r->err[t] <= r->bound[t] ? "" : "  <-- FAIL");
}

void run_perturb_outputs(run_outputs_t *out, int n) {
  for (int t = 0; t < n; t++) {
    const double x = run_fault_add(output_names[t]);
    const mtrain_tensor_t *o = run_outputs_get(out, t);
    if (x == 0.0 || mtrain_tensor_numel(o) == 0) continue;
    double v = 0.0;
    mtrain_convert(o->data, o->dtype, &v, MTRAIN_F64, 1);
    v += x;
    mtrain_convert(&v, MTRAIN_F64, o->data, o->dtype, 1);
    fprintf(stderr, "mtrain-run: MTRAIN_RUN_FAULT=add-%s: added %g to %s[0] (test hook)\n",
            output_names[t], x, output_names[t]);
  }
}
