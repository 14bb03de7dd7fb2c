/* mtrain_run.c: the main job, single-rank form: sparse attention forward and
 * backward on generated or .npy inputs with a fixed, dense or estimated
 * pattern, timed, optionally checked against the fp64 reference and written
 * out, with a text or JSON report. With --backend cuda the inputs are
 * copied to the device, the pattern is estimated and the attention computed
 * there, and the outputs are copied back for the check and the files, which
 * are written all or nothing (run_files.h). The multi-rank form under
 * mpiexec is run_ring.c (cuda there runs one GPU per rank through the NCCL
 * communicator). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_io.h"
#include "run_common.h"
#include "run_files.h"
#include "run_inputs.h"
#include "run_options.h"
#include "tool_common.h"

static const char *prog = "mtrain-run";

static const char *const tensor_names[5] = {"o", "lse", "dq", "dk", "dv"};

/* The pattern: estimated online from q and k, read from a file, or dense;
 * it must agree with the inputs. */
static int make_pattern(mtrain_context_t *ctx, const run_options_t *o, run_inputs_t *in,
                        mtrain_pattern_t **out, run_result_t *r) {
  if (run_options_estimate(o)) {
    mtrain_head_budget_t *budgets = NULL;
    if (run_make_budgets(prog, o, in->heads, &budgets)) return 1;
    mtrain_estimate_options_t eo = MTRAIN_ESTIMATE_INIT;
    eo.last_q = o->last_q;
    eo.top_p_forced = o->top_p_forced;
    const double t0 = tool_now();
    int rc = tool_failed(prog, "estimating the pattern",
                         mtrain_pattern_estimate(ctx, &in->q, &in->k, budgets, &eo, out));
    r->t_estimate = tool_now() - t0;
    free(budgets);
    return rc;
  }
  if (!o->pattern_path)
    return tool_failed(prog, "dense pattern",
                       mtrain_pattern_create_dense(in->tokens, in->heads, o->granularity, out));
  if (tool_failed(prog, o->pattern_path, mtrain_pattern_read_json(o->pattern_path, out))) return 1;
  const char *problem = NULL;
  if (mtrain_pattern_seq_len(*out) != in->tokens)
    problem = "its seq_len differs from the inputs' token count";
  else if (mtrain_pattern_num_heads(*out) != in->heads)
    problem = "its head count differs from the inputs' query heads";
  else if (mtrain_pattern_granularity(*out) != o->granularity)
    problem = "its granularity differs from --granularity";
  if (!problem) return 0;
  fprintf(stderr, "%s: %s: %s (pattern: N=%lld heads=%d G=%d; inputs: N=%lld heads=%d G=%d)\n",
          prog, o->pattern_path, problem, (long long)mtrain_pattern_seq_len(*out),
          mtrain_pattern_num_heads(*out), mtrain_pattern_granularity(*out), (long long)in->tokens,
          in->heads, o->granularity);
  mtrain_pattern_destroy(*out);
  *out = NULL;
  return 1;
}

/* The "cuda" backend's set-up: the kernel variant asked for, and device
 * copies of the inputs. */
static int setup_cuda(mtrain_context_t *ctx, const run_options_t *o, const run_inputs_t *in,
                      run_inputs_t *dev) {
  if (o->cuda_variant != RUN_CUDA_VARIANT_UNSET &&
      tool_failed(prog, "--cuda-variant",
                  mtrain_cuda_set_variant(ctx, (mtrain_cuda_variant_t)o->cuda_variant)))
    return 1;
  return run_inputs_to_device(in, dev);
}

/* Runs cpu-ref in fp64 on the same (rounded) inputs and compares; `ctx` is
 * the context under test (its backend and softmax scale set the floor). */
static int check_against_reference(const run_options_t *o, const mtrain_context_t *ctx,
                                   const mtrain_pattern_t *pattern, run_inputs_t *in,
                                   run_outputs_t *out, run_result_t *r) {
  double t0 = tool_now();
  mtrain_context_t *ref = NULL;
  mtrain_plan_t *plan = NULL;
  run_inputs_t in64 = {0};
  run_outputs_t out64 = {0};
  int rc = run_make_context(prog, o, "cpu-ref", NULL, &ref);
  const mtrain_pattern_t *pats[1] = {pattern};
  if (!rc) rc = tool_failed(prog, "reference plan", mtrain_plan_create(ref, NULL, pats, &plan));
  if (!rc) rc = run_inputs_widen(in, &in64);
  if (!rc) rc = run_outputs_alloc(&in64, MTRAIN_F64, &out64);
  run_options_t once = *o;
  once.repeat = 1;
  run_result_t scratch = {0};
  if (!rc) rc = run_attention(prog, ref, plan, &in64, &out64, &once, &scratch);
  if (!rc) {
    /* the tools' one bound (tool_common.h, run_check.c; the unit tests apply
     * the stricter FlashAttention rule) */
    const int n = o->forward_only ? 2 : 5;
    for (int t = 0; t < n; t++)
      run_compare(run_outputs_get(out, t), run_outputs_get(&out64, t), &r->err[t], &r->ref_max[t]);
    double norms[6];
    run_inputs_norms(in, norms);
    run_check_bounds(ctx, in->q.dtype, in->head_dim, norms, n, r);
  }
  run_outputs_free(&out64);
  run_inputs_free(&in64);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ref);
  r->t_check = tool_now() - t0;
  return rc;
}

/* The --out files, all or nothing (run_files.h). */
static int write_outputs(const run_options_t *o, const run_outputs_t *out,
                         const mtrain_pattern_t *pattern) {
  const char *names[RUN_FILES_MAX];
  const int n = run_files_names(o->forward_only, names);
  run_files_t files;
  run_files_begin(&files, prog, o->out_dir);
  int rc = 0;
  for (int t = 0; t < n - 1 && !rc; t++)
    rc = run_files_write_tensor(&files, names[t], run_outputs_get(out, t));
  if (!rc) rc = run_files_write_pattern(&files, names[n - 1], pattern);
  if (!rc) return run_files_commit(&files);
  run_files_discard(&files);
  return 1;
}

static void report_text(const run_options_t *o, const run_inputs_t *in, const run_result_t *r) {
  const double fwd_flops = tool_fwd_flops(r->pairs, in->head_dim);
  printf("mtrain-run: backend %s, dtype %s, 1 rank\n", r->backend, mtrain_dtype_name(in->q.dtype));
  printf("  shape      N=%lld Hq=%d Hkv=%d d=%d G=%d\n", (long long)in->tokens, in->heads,
         in->kv_heads, in->head_dim, o->granularity);
  printf("  pattern    %s: %lld of %lld causal pairs computed, sparsity %.2f%%\n",
         run_pattern_source(o), r->pairs, r->dense_pairs,
         100.0 * (1.0 - (double)r->pairs / (double)r->dense_pairs));
  if (run_options_estimate(o))
    printf("  estimate   %.3f ms (last %d queries), %.1f%% of the forward time\n",
           1e3 * r->t_estimate, o->last_q, 100.0 * r->t_estimate / r->t_fwd);
  printf("  plan       %.3f ms, %.1f KiB\n", 1e3 * r->t_plan, (double)r->plan_bytes / 1024.0);
  if (r->cuda_variant >= 0)
    printf("  cuda       kernel variant %d (%s)\n", r->cuda_variant,
           r->cuda_variant == MTRAIN_CUDA_VARIANT_SIMT    ? "SIMT"
           : r->cuda_variant == MTRAIN_CUDA_VARIANT_WGMMA ? "wgmma forward and backward"
                                                          : "tensor cores");
  printf("  forward    %.3f ms, %.2f effective GFLOP/s\n", 1e3 * r->t_fwd,
         fwd_flops / r->t_fwd * 1e-9);
  if (!o->forward_only)
    printf("  backward   %.3f ms, %.2f effective GFLOP/s\n", 1e3 * r->t_bwd,
           2.5 * fwd_flops / r->t_bwd * 1e-9);
  if (r->checked) {
    printf("  check      against cpu-ref (fp64), %.3f s: %s\n", r->t_check,
           r->check_ok ? "PASS" : "FAIL");
    for (int t = 0; t < (o->forward_only ? 2 : 5); t++) run_check_print(tensor_names[t], r, t);
  }
}

static void report_json(const run_options_t *o, const run_inputs_t *in, const run_result_t *r) {
  const double fwd_flops = tool_fwd_flops(r->pairs, in->head_dim);
  json_t *j = json_object();
  json_object_set_new(j, "backend", json_string(r->backend));
  if (r->cuda_variant >= 0) json_object_set_new(j, "cuda_variant", json_integer(r->cuda_variant));
  json_object_set_new(j, "dtype", json_string(mtrain_dtype_name(in->q.dtype)));
  json_object_set_new(j, "world", json_integer(1));
  json_object_set_new(j, "seq_len", json_integer(in->tokens));
  json_object_set_new(j, "heads", json_integer(in->heads));
  json_object_set_new(j, "kv_heads", json_integer(in->kv_heads));
  json_object_set_new(j, "head_dim", json_integer(in->head_dim));
  json_object_set_new(j, "granularity", json_integer(o->granularity));
  json_object_set_new(j, "pattern", json_string(run_pattern_source(o)));
  if (run_options_estimate(o)) {
    json_object_set_new(j, "estimate_seconds", json_real(r->t_estimate));
    json_object_set_new(j, "last_q", json_integer(o->last_q));
    json_object_set_new(j, "top_p_forced", json_boolean(o->top_p_forced));
  }
  json_object_set_new(j, "computed_pairs", json_integer(r->pairs));
  json_object_set_new(j, "dense_pairs", json_integer(r->dense_pairs));
  json_object_set_new(j, "sparsity", json_real(1.0 - (double)r->pairs / (double)r->dense_pairs));
  json_object_set_new(j, "plan_seconds", json_real(r->t_plan));
  json_object_set_new(j, "plan_bytes", json_integer((json_int_t)r->plan_bytes));
  json_object_set_new(j, "forward_seconds", json_real(r->t_fwd));
  json_object_set_new(j, "forward_gflops", json_real(fwd_flops / r->t_fwd * 1e-9));
  if (!o->forward_only) {
    json_object_set_new(j, "backward_seconds", json_real(r->t_bwd));
    json_object_set_new(j, "backward_gflops", json_real(2.5 * fwd_flops / r->t_bwd * 1e-9));
  }
  if (r->checked) {
    json_t *c = json_object();
    json_object_set_new(c, "passed", json_boolean(r->check_ok));
    json_object_set_new(c, "seconds", json_real(r->t_check));
    for (int t = 0; t < (o->forward_only ? 2 : 5); t++) {
      json_t *e = json_object();
      json_object_set_new(e, "max_abs_error", json_real(r->err[t]));
      json_object_set_new(e, "bound", json_real(r->bound[t]));
      json_object_set_new(e, "max_abs_reference", json_real(r->ref_max[t]));
      json_object_set_new(e, "floor", json_real(r->floor[t]));
      json_object_set_new(c, tensor_names[t], e);
    }
    json_object_set_new(j, "check", c);
  }
  char *s = json_dumps(j, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
  if (s) puts(s);
  free(s);
  json_decref(j);
}

#ifdef MTRAIN_HAVE_MPI
#include "run_ring.h"
#endif

/* The single-rank run: whole tensors, no layout. With the "cuda" backend
 * the estimate and the attention run on device copies of the inputs, and
 * the outputs come back to the host for the check and the files. */
static int run_single(const run_options_t *o_in) {
  run_options_t o = *o_in;
  const int device = strcmp(o.backend, "cuda") == 0;
  int rc = 0;
  run_inputs_t in = {0}, dev_in = {0};
  run_outputs_t out = {0}, dev_out = {0};
  run_result_t r = {0};
  r.cuda_variant = -1;
  mtrain_pattern_t *pattern = NULL;
  mtrain_context_t *ctx = NULL;
  mtrain_plan_t *plan = NULL;
  run_inputs_t *work_in = device ? &dev_in : &in;
  run_outputs_t *work_out = device ? &dev_out : &out;
  /* --out before the work: a directory that cannot be written stops the run now */
  if (o.out_dir) {
    const char *names[RUN_FILES_MAX];
    rc = run_files_prepare(prog, o.out_dir, names, run_files_names(o.forward_only, names));
  }
  if (!rc) rc = run_inputs_load_or_generate(&o, &in);
  if (!rc) rc = run_make_context(prog, &o, o.backend, NULL, &ctx);
  if (!rc) r.backend = mtrain_context_backend_name(ctx);
  if (!rc && device) rc = setup_cuda(ctx, &o, &in, &dev_in);
  if (!rc) rc = make_pattern(ctx, &o, work_in, &pattern, &r);
  if (!rc) {
    const mtrain_pattern_t *pats[1] = {pattern};
    double t0 = tool_now();
    rc = tool_failed(prog, "building the plan", mtrain_plan_create(ctx, NULL, pats, &plan));
    r.t_plan = tool_now() - t0;
  }
  if (!rc) {
    r.pairs = mtrain_plan_computed_pairs(plan);
    r.dense_pairs = (long long)in.heads * in.tokens * (in.tokens + 1) / 2;
    r.plan_bytes = mtrain_plan_bytes(plan);
    rc = run_outputs_alloc(&in, in.q.dtype, &out);
    if (!rc && device) rc = run_outputs_alloc_device(&in, in.q.dtype, &dev_out);
  }
  if (!rc) rc = run_attention(prog, ctx, plan, work_in, work_out, &o, &r);
  if (!rc && device) {
    r.cuda_variant = mtrain_cuda_last_variant(ctx);
    if (o.check || o.out_dir) rc = run_outputs_download(&dev_out, &out, o.forward_only ? 2 : 5);
  }
  if (!rc) run_perturb_outputs(&out, o.forward_only ? 2 : 5);
  if (!rc && o.check) rc = check_against_reference(&o, ctx, pattern, &in, &out, &r);
  if (!rc && o.out_dir) rc = write_outputs(&o, &out, pattern);
  if (!rc) {
    if (o.json)
      report_json(&o, &in, &r);
    else
      report_text(&o, &in, &r);
  }
  run_outputs_free_device(&dev_out);
  run_inputs_free_device(&dev_in);
  run_outputs_free(&out);
  run_inputs_free(&in);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  mtrain_pattern_destroy(pattern);
  if (rc) return 1;
  return r.checked && !r.check_ok ? 3 : 0;
}

int main(int argc, char **argv) {
#ifdef MTRAIN_HAVE_MPI
  int provided = 0, rank = 0, world = 1;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
#endif
#ifndef MTRAIN_HAVE_MPI
  const int rank = 0, world = 1;
#endif
  run_options_t o;
  int rc = run_options_parse(argc, argv, &o);
  if (rc == 0 && o.hierarchical && world == 1) {
    fprintf(stderr,
            "%s: --schedule hier needs several ranks (run under mpiexec -n W%s); one rank has no "
            "ring\n",
            prog,
#ifdef MTRAIN_HAVE_MPI
            ""
#else
            " with a build that has MPI"
#endif
    );
    rc = 1;
  }
  /* a --pattern file's granularity, unless --granularity says it */
  if (rc == 0) rc = run_options_resolve_pattern(prog, &o, rank == 0) ? 3 : 0;
  if (rc == 0) run_options_warn(prog, &o, world == 1, rank == 0);
  if (rc == 0) {
#ifdef MTRAIN_HAVE_MPI
    rc = world > 1 ? run_ring(&o, rank, world) : run_single(&o);
#else
    rc = run_single(&o);
#endif
  } else {
    rc = rc == 2 ? 0 : rc == 3 ? 1 : 2; /* 3: the pattern file failed: an error, not usage */
  }
#ifdef MTRAIN_HAVE_MPI
  MPI_Finalize();
#endif
  return rc;
}
