/* test_gradcheck.c: the fp64 gradients are the gradients of the forward.
 * (a) Central finite differences (step 1e-6) of L = sum(O * R) computed with
 *     mtrain_cpu_dense_reference_forward against
 *     mtrain_cpu_dense_reference_backward with dout = R, on every element of
 *     q, k, v for the smallest shapes and on >= 50 random elements of each
 *     for the others.
 * (b) The same check for the "cpu-ref" backend through the public API (fp64
 *     tensors, fp64 lse).
 * (c) "cpu-ref" through the API equals the dense reference to 1e-12 relative
 *     (O, LSE, dQ, dK, dV), for single sequences and for a packed batch of 3
 *     sequences compared slice by slice with the reference of each sequence.
 * Tiny shapes (N 5, 37, 70; G 8 or 16; Hq:Hkv 4:2 and 2:1; d 8 or 16) and
 * dense, random sparse, diagonal-only and block-mask patterns. Seeds come
 * from MTRAIN_TEST_SEED when set and are printed on failure. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdint.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cpu.h"
#include "test_support.h"

#define FD_STEP 1e-6
#define FD_TOL 1e-6
#define FD_SUBSET 50
#define REF_TOL 1e-12

typedef struct gc_case {
  int64_t n;
  int32_t g, hq, hkv, d;
  ts_pattern_kind_t kind;
  double scale; /* 0: 1/sqrt(d) */
  int full;     /* 1: every element of q, k, v; 0: FD_SUBSET random ones each */
  uint64_t seed;
} gc_case_t;

static const gc_case_t gc_cases[] = {
    {5, 8, 4, 2, 8, TS_PATTERN_DENSE, 0.0, 1, 0x1001},
    {5, 16, 2, 1, 16, TS_PATTERN_DENSE, 0.0, 1, 0x1002},
    {37, 8, 4, 2, 16, TS_PATTERN_RANDOM_SPARSE, 0.0, 0, 0x1003},
    {37, 16, 2, 1, 8, TS_PATTERN_BLOCK_MASK, 0.3, 0, 0x1004},
    {37, 8, 2, 1, 16, TS_PATTERN_DIAGONAL_ONLY, 0.0, 0, 0x1005},
    {70, 16, 4, 2, 16, TS_PATTERN_BLOCK_MASK, 0.0, 0, 0x1006},
    {70, 8, 2, 1, 8, TS_PATTERN_RANDOM_SPARSE, 0.0, 0, 0x1007},
    {70, 16, 4, 2, 8, TS_PATTERN_DENSE, 0.0, 0, 0x1008},
};
#define NUM_GC_CASES ((int)(sizeof gc_cases / sizeof gc_cases[0]))

static const char *case_str(int idx, const gc_case_t *c, uint64_t seed) {
  static char buf[256];
  if (c->n == 0) /* a packed batch: the lengths and patterns are added by the caller */
    snprintf(buf, sizeof buf, "case %d (G=%d Hq=%d Hkv=%d d=%d scale=%g seed=0x%llx)", idx, c->g,
             c->hq, c->hkv, c->d, c->scale, (unsigned long long)seed);
  else
    snprintf(buf, sizeof buf,
             "case %d (N=%lld G=%d Hq=%d Hkv=%d d=%d pattern=%s scale=%g %s seed=0x%llx)", idx,
             (long long)c->n, c->g, c->hq, c->hkv, c->d, ts_pattern_kind_name(c->kind), c->scale,
             c->full ? "all elements" : "random subset", (unsigned long long)seed);
  return buf;
}

static double *normal_array(ts_rng_t *rng, int64_t count) {
  double *a = malloc(sizeof(double) * (size_t)(count > 0 ? count : 1));
  assert_non_null(a);
  ts_fill_normal(rng, a, MTRAIN_F64, count, 1.0, NULL);
  return a;
}

/* ---- the two fp64 implementations under check ----------------------------- */

/* Forward and backward of one implementation on [n, hq, d] / [n, hkv, d]
 * fp64 arrays. */
typedef struct impl {
  const char *name;
  mtrain_status_t (*fwd)(void *self, const double *q, const double *k, const double *v, double *o,
                         double *lse);
  mtrain_status_t (*bwd)(void *self, const double *q, const double *k, const double *v,
                         const double *o, const double *lse, const double *dout, double *dq,
                         double *dk, double *dv);
  void *self;
} impl_t;

typedef struct ref_impl {
  const mtrain_pattern_t *pattern;
  int32_t hkv, d;
  double scale;
} ref_impl_t;

static mtrain_status_t ref_fwd(void *self, const double *q, const double *k, const double *v,
                               double *o, double *lse) {
  const ref_impl_t *r = self;
  return mtrain_cpu_dense_reference_forward(r->pattern, r->hkv, r->d, r->scale, q, k, v, o, lse);
}

static mtrain_status_t ref_bwd(void *self, const double *q, const double *k, const double *v,
                               const double *o, const double *lse, const double *dout, double *dq,
                               double *dk, double *dv) {
  const ref_impl_t *r = self;
  return mtrain_cpu_dense_reference_backward(r->pattern, r->hkv, r->d, r->scale, q, k, v, o, lse,
                                             dout, dq, dk, dv);
}

typedef struct api_impl {
  mtrain_context_t *ctx;
  mtrain_plan_t *plan;
  int64_t tokens;
  int32_t hq, hkv, d;
} api_impl_t;

/* A "cpu-ref" context (granularity g, softmax scale `scale`) and its plan. */
static void api_open(api_impl_t *a, int32_t g, double scale, int32_t hkv, int32_t d,
                     const mtrain_seqs_t *seqs, const mtrain_pattern_t *const *patterns,
                     const char *desc) {
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cpu-ref";
  cfg.granularity = g;
  cfg.softmax_scale = scale;
  memset(a, 0, sizeof *a);
  mtrain_status_t st = mtrain_context_create(&cfg, NULL, &a->ctx);
  if (st)
    fail_msg("mtrain_context_create(cpu-ref) failed: %s (%s) in %s", mtrain_status_name(st),
             mtrain_last_error(), desc);
  if (strcmp(mtrain_context_backend_name(a->ctx), "cpu-ref") != 0)
    fail_msg("context runs backend '%s', not 'cpu-ref' (MTRAIN_BACKEND set?) in %s",
             mtrain_context_backend_name(a->ctx), desc);
  st = mtrain_plan_create(a->ctx, seqs, patterns, &a->plan);
  if (st)
    fail_msg("mtrain_plan_create failed: %s (%s) in %s", mtrain_status_name(st),
             mtrain_last_error(), desc);
  a->tokens = mtrain_plan_local_tokens(a->plan);
  a->hq = mtrain_plan_num_heads(a->plan);
  a->hkv = hkv;
  a->d = d;
}

static void api_close(api_impl_t *a) {
  mtrain_plan_destroy(a->plan);
  mtrain_context_destroy(a->ctx);
}

static mtrain_status_t api_fwd(void *self, const double *q, const double *k, const double *v,
                               double *o, double *lse) {
  const api_impl_t *a = self;
  mtrain_tensor_t tq = mtrain_tensor_3d((void *)q, MTRAIN_F64, a->tokens, a->hq, a->d);
  mtrain_tensor_t tk = mtrain_tensor_3d((void *)k, MTRAIN_F64, a->tokens, a->hkv, a->d);
  mtrain_tensor_t tv = mtrain_tensor_3d((void *)v, MTRAIN_F64, a->tokens, a->hkv, a->d);
  mtrain_tensor_t to = mtrain_tensor_3d(o, MTRAIN_F64, a->tokens, a->hq, a->d);
  mtrain_tensor_t tl = mtrain_tensor_2d(lse, MTRAIN_F64, a->tokens, a->hq);
  return mtrain_attention_forward(a->ctx, a->plan, &tq, &tk, &tv, &to, &tl);
}

static mtrain_status_t api_bwd(void *self, const double *q, const double *k, const double *v,
                               const double *o, const double *lse, const double *dout, double *dq,
                               double *dk, double *dv) {
  const api_impl_t *a = self;
  mtrain_tensor_t tq = mtrain_tensor_3d((void *)q, MTRAIN_F64, a->tokens, a->hq, a->d);
  mtrain_tensor_t tk = mtrain_tensor_3d((void *)k, MTRAIN_F64, a->tokens, a->hkv, a->d);
  mtrain_tensor_t tv = mtrain_tensor_3d((void *)v, MTRAIN_F64, a->tokens, a->hkv, a->d);
  mtrain_tensor_t to = mtrain_tensor_3d((void *)o, MTRAIN_F64, a->tokens, a->hq, a->d);
  mtrain_tensor_t tl = mtrain_tensor_2d((void *)lse, MTRAIN_F64, a->tokens, a->hq);
  mtrain_tensor_t tdo = mtrain_tensor_3d((void *)dout, MTRAIN_F64, a->tokens, a->hq, a->d);
  mtrain_tensor_t tdq = mtrain_tensor_3d(dq, MTRAIN_F64, a->tokens, a->hq, a->d);
  mtrain_tensor_t tdk = mtrain_tensor_3d(dk, MTRAIN_F64, a->tokens, a->hkv, a->d);
  mtrain_tensor_t tdv = mtrain_tensor_3d(dv, MTRAIN_F64, a->tokens, a->hkv, a->d);
  return mtrain_attention_backward(a->ctx, a->plan, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk,
                                   &tdv);
}

/* ---- the finite-difference check ------------------------------------------- */

/* Indices to check among `count`: all of them, or FD_SUBSET distinct random
 * ones (partial Fisher-Yates). Returns how many were written to idx. */
static int64_t pick_indices(ts_rng_t *rng, int64_t count, int full, int64_t *idx) {
  for (int64_t i = 0; i < count; i++) idx[i] = i;
  if (full || count <= FD_SUBSET) return count;
  for (int64_t i = 0; i < FD_SUBSET; i++) {
    int64_t j = i + ts_rng_below(rng, count - i);
    int64_t t = idx[i];
    idx[i] = idx[j];
    idx[j] = t;
  }
  return FD_SUBSET;
}

/* Checks the implementation's backward against central differences of
 * L = sum(O * R) of its forward. The loss difference is formed as
 * sum((O+ - O-) * R), which is L(x+h) - L(x-h) with the unchanged rows
 * cancelling exactly. Returns the largest |fd - an| / bound seen. */
static double fd_check(const impl_t *im, int idx, const gc_case_t *c, uint64_t seed) {
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  const int64_t nq = c->n * c->hq * c->d, nk = c->n * c->hkv * c->d, nl = c->n * c->hq;
  double *q = normal_array(&rng, nq), *k = normal_array(&rng, nk), *v = normal_array(&rng, nk);
  double *r = normal_array(&rng, nq);
  double *o = malloc(sizeof(double) * (size_t)nq), *lse = malloc(sizeof(double) * (size_t)nl);
  double *op = malloc(sizeof(double) * (size_t)nq), *om = malloc(sizeof(double) * (size_t)nq);
  double *dq = malloc(sizeof(double) * (size_t)nq), *dk = malloc(sizeof(double) * (size_t)nk);
  double *dv = malloc(sizeof(double) * (size_t)nk);
  int64_t *pick = malloc(sizeof(int64_t) * (size_t)nq);
  assert_true(o && lse && op && om && dq && dk && dv && pick);

  mtrain_status_t st = im->fwd(im->self, q, k, v, o, lse);
  if (st)
    fail_msg("%s forward failed: %s (%s) in %s", im->name, mtrain_status_name(st),
             mtrain_last_error(), case_str(idx, c, seed));
  st = im->bwd(im->self, q, k, v, o, lse, r, dq, dk, dv);
  if (st)
    fail_msg("%s backward failed: %s (%s) in %s", im->name, mtrain_status_name(st),
             mtrain_last_error(), case_str(idx, c, seed));

  double *inputs[3] = {q, k, v};
  const double *grads[3] = {dq, dk, dv};
  const int64_t counts[3] = {nq, nk, nk};
  static const char *const names[3] = {"q", "k", "v"};
  double worst = 0.0;
  int64_t checked = 0;
  for (int t = 0; t < 3; t++) {
    const double bound = FD_TOL * fmax(1.0, ts_max_abs(grads[t], counts[t]));
    if (ts_has_nonfinite(grads[t], counts[t]))
      fail_msg("%s: d%s holds NaN/Inf in %s", im->name, names[t], case_str(idx, c, seed));
    const int64_t m = pick_indices(&rng, counts[t], c->full, pick);
    for (int64_t e = 0; e < m; e++) {
      double *x = inputs[t] + pick[e];
      const double x0 = *x, xp = x0 + FD_STEP, xm = x0 - FD_STEP;
      *x = xp;
      st = im->fwd(im->self, q, k, v, op, lse);
      if (st == MTRAIN_SUCCESS) {
        *x = xm;
        st = im->fwd(im->self, q, k, v, om, lse);
      }
      *x = x0;
      if (st)
        fail_msg("%s forward failed: %s (%s) in %s", im->name, mtrain_status_name(st),
                 mtrain_last_error(), case_str(idx, c, seed));
      double dl = 0.0;
      for (int64_t i = 0; i < nq; i++) dl += (op[i] - om[i]) * r[i];
      const double fd = dl / (xp - xm), an = grads[t][pick[e]];
      const double err = fabs(fd - an);
      if (!(err <= bound))
        fail_msg("%s: d%s[%lld] (token %lld, head %lld, dim %lld): finite difference %.15g, "
                 "analytic %.15g, |diff| %.3g > bound %.3g, in %s",
                 im->name, names[t], (long long)pick[e],
                 (long long)(pick[e] / ((t == 0 ? c->hq : c->hkv) * c->d)),
                 (long long)((pick[e] / c->d) % (t == 0 ? c->hq : c->hkv)),
                 (long long)(pick[e] % c->d), fd, an, err, bound, case_str(idx, c, seed));
      if (err / bound > worst) worst = err / bound;
      checked++;
    }
  }
  print_message("%s: %s: %lld elements checked, worst |fd-an|/bound %.3g\n", im->name,
                case_str(idx, c, seed), (long long)checked, worst);
  free(q);
  free(k);
  free(v);
  free(r);
  free(o);
  free(lse);
  free(op);
  free(om);
  free(dq);
  free(dk);
  free(dv);
  free(pick);
  return worst;
}

/* (a) the dense reference's backward against its own forward */
static void test_fd_dense_reference(void **state) {
  (void)state;
  for (int i = 0; i < NUM_GC_CASES; i++) {
    const gc_case_t *c = &gc_cases[i];
    const uint64_t seed = ts_seed(c->seed);
    mtrain_pattern_t *p = ts_make_pattern(c->kind, c->n, c->hq, c->g, seed);
    ref_impl_t ri = {p, c->hkv, c->d, c->scale};
    impl_t im = {"dense reference", ref_fwd, ref_bwd, &ri};
    fd_check(&im, i, c, seed);
    mtrain_pattern_destroy(p);
  }
}

/* (b) the cpu-ref backend's backward against its own forward, via the API */
static void test_fd_cpu_ref_api(void **state) {
  (void)state;
  for (int i = 0; i < NUM_GC_CASES; i++) {
    const gc_case_t *c = &gc_cases[i];
    const uint64_t seed = ts_seed(c->seed);
    mtrain_pattern_t *p = ts_make_pattern(c->kind, c->n, c->hq, c->g, seed);
    const mtrain_pattern_t *pats[1] = {p};
    api_impl_t ai;
    api_open(&ai, c->g, c->scale, c->hkv, c->d, NULL, pats, case_str(i, c, seed));
    impl_t im = {"cpu-ref API", api_fwd, api_bwd, &ai};
    fd_check(&im, i, c, seed);
    api_close(&ai);
    mtrain_pattern_destroy(p);
  }
}

/* ---- (c) cpu-ref through the API equals the dense reference ---------------- */

/* max |a - b| <= REF_TOL * max |b| or fail, naming the tensor, sequence and case. */
static double check_close(const char *what, int seq, const double *a, const double *b,
                          int64_t count, const char *case_desc) {
  if (ts_has_nonfinite(a, count))
    fail_msg("cpu-ref %s (sequence %d) holds NaN/Inf in %s", what, seq, case_desc);
  const double err = ts_max_abs_diff(a, b, count), ref = ts_max_abs(b, count);
  const double bound = REF_TOL * (ref > 0.0 ? ref : 1.0);
  if (!(err <= bound))
    fail_msg("cpu-ref %s (sequence %d) differs from the dense reference: max |diff| %.3g > "
             "%.3g (1e-12 * max|ref| %.3g) in %s",
             what, seq, err, bound, ref, case_desc);
  return err / bound;
}

/* Runs "cpu-ref" through the API on a packed batch (num_seqs sequences of
 * lens[s] tokens, one pattern each) and compares every sequence's slice of
 * O, LSE, dQ, dK, dV with the dense reference of that sequence alone. */
static double compare_batch(int idx, const gc_case_t *c, uint64_t seed, int32_t num_seqs,
                            const int64_t *lens, const ts_pattern_kind_t *kinds) {
  char desc_copy[512];
  int len = snprintf(desc_copy, sizeof desc_copy, "%s", case_str(idx, c, seed));
  int64_t offsets[8] = {0};
  mtrain_pattern_t *pats[7] = {NULL};
  assert_true(num_seqs >= 1 && num_seqs <= 7);
  if (num_seqs > 1)
    for (int32_t s = 0; s < num_seqs && len > 0 && len < (int)sizeof desc_copy; s++)
      len += snprintf(desc_copy + len, sizeof desc_copy - (size_t)len, "%s%lld:%s%s",
                      s == 0 ? " [packed batch " : " ", (long long)lens[s],
                      ts_pattern_kind_name(kinds[s]), s == num_seqs - 1 ? "]" : ",");
  for (int32_t s = 0; s < num_seqs; s++) {
    offsets[s + 1] = offsets[s] + lens[s];
    pats[s] = ts_make_pattern(kinds[s], lens[s], c->hq, c->g, seed + (uint64_t)s);
  }
  const int64_t T = offsets[num_seqs], hq = c->hq, hkv = c->hkv, d = c->d;
  const int64_t nq = T * hq * d, nk = T * hkv * d, nl = T * hq;
  ts_rng_t rng;
  ts_rng_seed(&rng, seed);
  double *q = normal_array(&rng, nq), *k = normal_array(&rng, nk), *v = normal_array(&rng, nk);
  double *dout = normal_array(&rng, nq);

  api_impl_t ai;
  mtrain_seqs_t seqs = {num_seqs, offsets};
  api_open(&ai, c->g, c->scale, c->hkv, c->d, &seqs, (const mtrain_pattern_t *const *)pats,
           desc_copy);
  assert_int_equal(ai.tokens, T);
  ts_buf_t bo = ts_buf_alloc(sizeof(double) * (size_t)nq);
  ts_buf_t bl = ts_buf_alloc(sizeof(double) * (size_t)nl);
  ts_buf_t bdq = ts_buf_alloc(sizeof(double) * (size_t)nq);
  ts_buf_t bdk = ts_buf_alloc(sizeof(double) * (size_t)nk);
  ts_buf_t bdv = ts_buf_alloc(sizeof(double) * (size_t)nk);
  mtrain_status_t st = api_fwd(&ai, q, k, v, bo.data, bl.data);
  if (st)
    fail_msg("cpu-ref forward failed: %s (%s) in %s", mtrain_status_name(st), mtrain_last_error(),
             desc_copy);
  st = api_bwd(&ai, q, k, v, bo.data, bl.data, dout, bdq.data, bdk.data, bdv.data);
  if (st)
    fail_msg("cpu-ref backward failed: %s (%s) in %s", mtrain_status_name(st), mtrain_last_error(),
             desc_copy);
  ts_buf_t *bufs[5] = {&bo, &bl, &bdq, &bdk, &bdv};
  for (int b = 0; b < 5; b++)
    if (!ts_buf_guards_ok(bufs[b]))
      fail_msg("cpu-ref output %d: guard bytes overwritten in %s", b, desc_copy);

  double worst = 0.0;
  for (int32_t s = 0; s < num_seqs; s++) {
    const int64_t n = lens[s], off = offsets[s];
    const int64_t sq = n * hq * d, sk = n * hkv * d, sl = n * hq;
    double *ro = malloc(sizeof(double) * (size_t)sq), *rl = malloc(sizeof(double) * (size_t)sl);
    double *rdq = malloc(sizeof(double) * (size_t)sq), *rdk = malloc(sizeof(double) * (size_t)sk);
    double *rdv = malloc(sizeof(double) * (size_t)sk);
    assert_true(ro && rl && rdq && rdk && rdv);
    const double *qs = q + off * hq * d, *ks = k + off * hkv * d, *vs = v + off * hkv * d;
    const double *dos = dout + off * hq * d;
    st = mtrain_cpu_dense_reference_forward(pats[s], c->hkv, c->d, c->scale, qs, ks, vs, ro, rl);
    if (st == MTRAIN_SUCCESS)
      st = mtrain_cpu_dense_reference_backward(pats[s], c->hkv, c->d, c->scale, qs, ks, vs, ro, rl,
                                               dos, rdq, rdk, rdv);
    if (st)
      fail_msg("dense reference failed on sequence %d: %s (%s) in %s", s, mtrain_status_name(st),
               mtrain_last_error(), desc_copy);
    const double *ao = (const double *)bo.data + off * hq * d;
    const double *al = (const double *)bl.data + off * hq;
    const double *adq = (const double *)bdq.data + off * hq * d;
    const double *adk = (const double *)bdk.data + off * hkv * d;
    const double *adv = (const double *)bdv.data + off * hkv * d;
    double w;
    if ((w = check_close("O", s, ao, ro, sq, desc_copy)) > worst) worst = w;
    if ((w = check_close("LSE", s, al, rl, sl, desc_copy)) > worst) worst = w;
    if ((w = check_close("dQ", s, adq, rdq, sq, desc_copy)) > worst) worst = w;
    if ((w = check_close("dK", s, adk, rdk, sk, desc_copy)) > worst) worst = w;
    if ((w = check_close("dV", s, adv, rdv, sk, desc_copy)) > worst) worst = w;
    free(ro);
    free(rl);
    free(rdq);
    free(rdk);
    free(rdv);
  }
  print_message("cpu-ref API vs dense reference: %s, %d sequence(s), worst err/bound %.3g\n",
                desc_copy, num_seqs, worst);
  for (int b = 0; b < 5; b++) ts_buf_free(bufs[b]);
  api_close(&ai);
  for (int32_t s = 0; s < num_seqs; s++) mtrain_pattern_destroy(pats[s]);
  free(q);
  free(k);
  free(v);
  free(dout);
  return worst;
}

static void test_cpu_ref_matches_dense_reference(void **state) {
  (void)state;
  for (int i = 0; i < NUM_GC_CASES; i++) {
    const gc_case_t *c = &gc_cases[i];
    compare_batch(i, c, ts_seed(c->seed), 1, &c->n, &c->kind);
  }
}

static void test_cpu_ref_packed_batch_matches_dense_reference(void **state) {
  (void)state;
  /* 3 sequences of different lengths (partial last blocks), one pattern each */
  static const gc_case_t packed[] = {
      {0, 8, 4, 2, 16, TS_PATTERN_RANDOM_SPARSE, 0.0, 0, 0x2001},
      {0, 16, 2, 1, 8, TS_PATTERN_BLOCK_MASK, 0.25, 0, 0x2002},
  };
  static const int64_t lens[2][3] = {{37, 5, 70}, {70, 37, 16}};
  static const ts_pattern_kind_t kinds[2][3] = {
      {TS_PATTERN_RANDOM_SPARSE, TS_PATTERN_DENSE, TS_PATTERN_BLOCK_MASK},
      {TS_PATTERN_BLOCK_MASK, TS_PATTERN_RANDOM_SPARSE, TS_PATTERN_DENSE}};
  for (int i = 0; i < 2; i++)
    compare_batch(NUM_GC_CASES + i, &packed[i], ts_seed(packed[i].seed), 3, lens[i], kinds[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fd_dense_reference),
      cmocka_unit_test(test_fd_cpu_ref_api),
      cmocka_unit_test(test_cpu_ref_matches_dense_reference),
      cmocka_unit_test(test_cpu_ref_packed_batch_matches_dense_reference),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
