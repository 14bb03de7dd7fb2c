/* run_inputs.c: mtrain-run's input and output tensors (see run_inputs.h). */
#include "run_inputs.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_inputs.h"
#include "mtrain/mtrain_io.h"
#include "tool_common.h"

static const char *prog = "mtrain-run";

/* The normal numbers of mtrain-run's generated inputs: number g of the
 * seed's stream is Box-Muller (cosine only) on the splitmix64 outputs
 * 2g+1 and 2g+2 (splitmix64 is a counter: output c is the mix of seed + c *
 * golden ratio), so any element can be made on its own, by any thread. The
 * stream holds, in this order, q, k, v (normal inputs) or nothing
 * (structured inputs, from the library), then dout, each [N, heads, d] in
 * token order. */
static uint64_t splitmix_at(uint64_t seed, uint64_t c) {
  uint64_t z = seed + c * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static double normal_at(uint64_t seed, uint64_t g) {
  double u1 = ((double)(splitmix_at(seed, 2 * g + 1) >> 11) + 0.5) * 0x1.0p-53;
  double u2 = (double)(splitmix_at(seed, 2 * g + 2) >> 11) * 0x1.0p-53;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static int alloc_tensor(mtrain_tensor_t *t, mtrain_dtype_t dtype, int32_t ndim, int64_t a,
                        int64_t b, int64_t c) {
  *t = ndim == 3 ? mtrain_tensor_3d(NULL, dtype, a, b, c) : mtrain_tensor_2d(NULL, dtype, a, b);
  t->data = malloc(mtrain_dtype_size(dtype) * (size_t)(mtrain_tensor_numel(t) + 1));
  if (!t->data) {
    fprintf(stderr, "%s: out of memory allocating a [%lld, %lld, %lld] tensor\n", prog,
            (long long)a, (long long)b, (long long)c);
    return 1;
  }
  return 0;
}

/* Row r of t (width w) gets token index[r] (r when index is NULL) of a
 * tensor of n tokens that starts at number `first` of the seed's stream,
 * times `scale`; tokens >= n (padding) give zero rows. */
static int normal_rows(uint64_t seed, uint64_t first, const int64_t *index, int64_t n, double scale,
                       mtrain_tensor_t *t) {
  const int64_t rows = t->shape[0], w = mtrain_tensor_numel(t) / (rows > 0 ? rows : 1);
  const size_t es = mtrain_dtype_size(t->dtype);
  int failed = 0;
#pragma omp parallel
  {
    double *row = malloc(sizeof(double) * (size_t)(w + 1));
    if (!row) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      if (!row) continue;
      const int64_t i = index ? index[r] : r;
      for (int64_t c = 0; c < w; c++)
        row[c] = i < n ? scale * normal_at(seed, first + (uint64_t)(i * w + c)) : 0.0;
      mtrain_convert(row, MTRAIN_F64, (char *)t->data + (size_t)(r * w) * es, t->dtype, w);
    }
    free(row);
  }
  if (failed) fprintf(stderr, "%s: out of memory generating inputs\n", prog);
  return failed;
}

/* Multiplies every element of t by `scale` (in fp64, rounded once to the
 * tensor's dtype). */
static int scale_tensor(double scale, mtrain_tensor_t *t) {
  const int64_t rows = t->shape[0], w = mtrain_tensor_numel(t) / (rows > 0 ? rows : 1);
  const size_t es = mtrain_dtype_size(t->dtype);
  double *row = malloc(sizeof(double) * (size_t)(w + 1));
  if (!row) {
    fprintf(stderr, "%s: out of memory scaling the inputs\n", prog);
    return 1;
  }
  for (int64_t r = 0; r < rows; r++) {
    char *at = (char *)t->data + (size_t)(r * w) * es;
    mtrain_convert(at, t->dtype, row, MTRAIN_F64, w);
    for (int64_t c = 0; c < w; c++) row[c] *= scale;
    mtrain_convert(row, MTRAIN_F64, at, t->dtype, w);
  }
  free(row);
  return 0;
}

static int read_npy(const char *path, mtrain_dtype_t dtype, const int64_t *shape,
                    mtrain_tensor_t *t) {
  mtrain_npy_t npy;
  if (tool_failed(prog, path, mtrain_npy_read_as(path, dtype, 3, shape, &npy))) return 1;
  *t = npy.tensor;
  return 0;
}

int run_inputs_generate_rows(const run_options_t *o, const int64_t *index, int64_t count,
                             run_inputs_t *in) {
  *in = (run_inputs_t){0};
  const int64_t N = o->seq_len;
  in->tokens = count;
  in->heads = o->heads;
  in->kv_heads = o->kv_heads;
  in->head_dim = o->head_dim;
  if (alloc_tensor(&in->q, o->dtype, 3, count, in->heads, in->head_dim) ||
      alloc_tensor(&in->k, o->dtype, 3, count, in->kv_heads, in->head_dim) ||
      alloc_tensor(&in->v, o->dtype, 3, count, in->kv_heads, in->head_dim) ||
      alloc_tensor(&in->dout, o->dtype, 3, count, in->heads, in->head_dim))
    return 1;
  const uint64_t nq = (uint64_t)(N * in->heads * in->head_dim);
  const uint64_t nk = (uint64_t)(N * in->kv_heads * in->head_dim);
  uint64_t dout_first = 0; /* where dout starts in the stream */
  if (strcmp(o->input, "structured") == 0) {
    mtrain_structured_options_t so = MTRAIN_STRUCTURED_INIT;
    so.seed = o->seed;
    /* sinks fade beyond about rope_base / 2 tokens (mtrain_inputs.h): scale it */
    if (so.rope_base < 4.0 * (double)N) so.rope_base = 4.0 * (double)N;
    if (tool_failed(prog, "generating structured inputs",
                    mtrain_generate_structured_rows(&so, N, index, &in->q, &in->k, &in->v)))
      return 1;
    if (o->input_scale != 1.0 &&
        (scale_tensor(o->input_scale, &in->q) || scale_tensor(o->input_scale, &in->k) ||
         scale_tensor(o->input_scale, &in->v)))
      return 1;
  } else {
    const double s = o->input_scale;
    if (normal_rows(o->seed, 0, index, N, s, &in->q) ||
        normal_rows(o->seed, nq, index, N, s, &in->k) ||
        normal_rows(o->seed, nq + nk, index, N, s, &in->v))
      return 1;
    dout_first = nq + 2 * nk;
  }
  return normal_rows(o->seed, dout_first, index, N, 1.0, &in->dout);
}

int run_inputs_load_or_generate(const run_options_t *o, run_inputs_t *in) {
  if (!o->q_path) return run_inputs_generate_rows(o, NULL, o->seq_len, in);
  *in = (run_inputs_t){0};
  if (read_npy(o->q_path, o->dtype, NULL, &in->q)) return 1;
  in->tokens = in->q.shape[0];
  in->heads = (int32_t)in->q.shape[1];
  in->head_dim = (int32_t)in->q.shape[2];
  const int64_t kshape[3] = {in->tokens, -1, in->head_dim};
  if (read_npy(o->k_path, o->dtype, kshape, &in->k)) return 1;
  in->kv_heads = (int32_t)in->k.shape[1];
  const int64_t vshape[3] = {in->tokens, in->kv_heads, in->head_dim};
  if (read_npy(o->v_path, o->dtype, vshape, &in->v)) return 1;
  const int64_t qshape[3] = {in->tokens, in->heads, in->head_dim};
  if (o->do_path) return read_npy(o->do_path, o->dtype, qshape, &in->dout);
  return alloc_tensor(&in->dout, o->dtype, 3, in->tokens, in->heads, in->head_dim) ||
         normal_rows(o->seed, 0, NULL, in->tokens, 1.0, &in->dout);
}

/* The largest L2 norm of a row of width shape[last] of t (host memory),
 * and the largest |element| into *amax. */
static double max_row_norm(const mtrain_tensor_t *t, double *amax) {
  const int64_t d = t->shape[t->ndim - 1], rows = d > 0 ? mtrain_tensor_numel(t) / d : 0;
  double *row = malloc(sizeof(double) * (size_t)(d + 1)), m = 0.0;
  *amax = NAN;
  if (!row) return NAN; /* no floor: the bound is NaN, and the check fails */
  double a = 0.0;
  for (int64_t r = 0; r < rows; r++) {
    mtrain_convert((const char *)t->data + (size_t)(r * d) * mtrain_dtype_size(t->dtype), t->dtype,
                   row, MTRAIN_F64, d);
    double s = 0.0;
    for (int64_t c = 0; c < d; c++) {
      s += row[c] * row[c];
      a = fmax(a, fabs(row[c]));
    }
    if (sqrt(s) > m) m = sqrt(s);
  }
  free(row);
  *amax = a;
  return m;
}

void run_inputs_norms(const run_inputs_t *in, double norms[6]) {
  double unused;
  norms[0] = max_row_norm(&in->q, &norms[4]);
  norms[1] = max_row_norm(&in->k, &norms[5]);
  norms[2] = max_row_norm(&in->v, &unused);
  norms[3] = max_row_norm(&in->dout, &unused);
}

static int widen_one(const mtrain_tensor_t *src, mtrain_tensor_t *dst) {
  if (alloc_tensor(dst, MTRAIN_F64, 3, src->shape[0], src->shape[1], src->shape[2])) return 1;
  return tool_failed(
      prog, "widening",
      mtrain_convert(src->data, src->dtype, dst->data, MTRAIN_F64, mtrain_tensor_numel(src)));
}

int run_inputs_widen(const run_inputs_t *in, run_inputs_t *out) {
  *out = *in;
  out->q.data = out->k.data = out->v.data = out->dout.data = NULL;
  return widen_one(&in->q, &out->q) || widen_one(&in->k, &out->k) || widen_one(&in->v, &out->v) ||
         widen_one(&in->dout, &out->dout);
}

void run_inputs_free(run_inputs_t *in) {
  free(in->q.data);
  free(in->k.data);
  free(in->v.data);
  free(in->dout.data);
  *in = (run_inputs_t){0};
}

int run_outputs_alloc(const run_inputs_t *in, mtrain_dtype_t dtype, run_outputs_t *out) {
  const mtrain_dtype_t lse = dtype == MTRAIN_F64 ? MTRAIN_F64 : MTRAIN_F32;
  return alloc_tensor(&out->o, dtype, 3, in->tokens, in->heads, in->head_dim) ||
         alloc_tensor(&out->lse, lse, 2, in->tokens, in->heads, 0) ||
         alloc_tensor(&out->dq, dtype, 3, in->tokens, in->heads, in->head_dim) ||
         alloc_tensor(&out->dk, dtype, 3, in->tokens, in->kv_heads, in->head_dim) ||
         alloc_tensor(&out->dv, dtype, 3, in->tokens, in->kv_heads, in->head_dim);
}

const mtrain_tensor_t *run_outputs_get(const run_outputs_t *out, int t) {
  const mtrain_tensor_t *all[5] = {&out->o, &out->lse, &out->dq, &out->dk, &out->dv};
  return all[t];
}

void run_outputs_free(run_outputs_t *out) {
  free(out->o.data);
  free(out->lse.data);
  free(out->dq.data);
  free(out->dk.data);
  free(out->dv.data);
  *out = (run_outputs_t){0};
}

/* ---- device copies (the "cuda" backend) ---- */

/* A device tensor shaped like `like` (dtype `dtype`), uninitialised. */
static int alloc_device(const mtrain_tensor_t *like, mtrain_dtype_t dtype, mtrain_tensor_t *t) {
  *t = *like;
  t->dtype = dtype;
  t->data = NULL;
  const size_t bytes = mtrain_dtype_size(dtype) * (size_t)mtrain_tensor_numel(t);
  if (tool_failed(prog, "allocating device memory", mtrain_cuda_malloc(bytes, &t->data))) {
    t->data = NULL;
    return 1;
  }
  return 0;
}

/* A device copy of a host tensor. */
static int upload(const mtrain_tensor_t *host, mtrain_tensor_t *dev) {
  if (alloc_device(host, host->dtype, dev)) return 1;
  const size_t bytes = mtrain_dtype_size(host->dtype) * (size_t)mtrain_tensor_numel(host);
  return tool_failed(prog, "copying an input to the device",
                     mtrain_cuda_memcpy_to_device(dev->data, host->data, bytes));
}

int run_inputs_to_device(const run_inputs_t *host, run_inputs_t *dev) {
  *dev = *host;
  dev->q.data = dev->k.data = dev->v.data = dev->dout.data = NULL;
  return upload(&host->q, &dev->q) || upload(&host->k, &dev->k) || upload(&host->v, &dev->v) ||
         upload(&host->dout, &dev->dout);
}

void run_inputs_free_device(run_inputs_t *dev) {
  mtrain_cuda_free(dev->q.data);
  mtrain_cuda_free(dev->k.data);
  mtrain_cuda_free(dev->v.data);
  mtrain_cuda_free(dev->dout.data);
  *dev = (run_inputs_t){0};
}

int run_outputs_alloc_device(const run_inputs_t *in, mtrain_dtype_t dtype, run_outputs_t *out) {
  *out = (run_outputs_t){0};
  const mtrain_tensor_t lse = mtrain_tensor_2d(NULL, MTRAIN_F32, in->tokens, in->heads);
  return alloc_device(&in->q, dtype, &out->o) || alloc_device(&lse, MTRAIN_F32, &out->lse) ||
         alloc_device(&in->q, dtype, &out->dq) || alloc_device(&in->k, dtype, &out->dk) ||
         alloc_device(&in->k, dtype, &out->dv);
}

int run_outputs_download(const run_outputs_t *dev, run_outputs_t *host, int count) {
  for (int t = 0; t < count; t++) {
    const mtrain_tensor_t *d = run_outputs_get(dev, t), *h = run_outputs_get(host, t);
    const size_t bytes = mtrain_dtype_size(d->dtype) * (size_t)mtrain_tensor_numel(d);
    if (tool_failed(prog, "copying an output from the device",
                    mtrain_cuda_memcpy_to_host(h->data, d->data, bytes)))
      return 1;
  }
  return 0;
}

void run_outputs_free_device(run_outputs_t *out) {
  mtrain_cuda_free(out->o.data);
  mtrain_cuda_free(out->lse.data);
  mtrain_cuda_free(out->dq.data);
  mtrain_cuda_free(out->dk.data);
  mtrain_cuda_free(out->dv.data);
  *out = (run_outputs_t){0};
}

static double load(const mtrain_tensor_t *t, int64_t i) {
  double x = 0.0;
  mtrain_convert((const char *)t->data + i * (int64_t)mtrain_dtype_size(t->dtype), t->dtype, &x,
                 MTRAIN_F64, 1);
  return x;
}

void run_compare(const mtrain_tensor_t *a, const mtrain_tensor_t *ref, double *err,
                 double *ref_max) {
  const int64_t n = mtrain_tensor_numel(ref);
  double e = 0.0, m = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double x = load(a, i), y = load(ref, i), d = fabs(x - y);
    if (!isfinite(x)) e = INFINITY;
    if (d > e) e = d;
    if (fabs(y) > m) m = fabs(y);
  }
  *err = e;
  *ref_max = m;
}

mtrain_status_t run_write_f32(const char *path, const mtrain_tensor_t *t) {
  if (t->dtype == MTRAIN_F32 || t->dtype == MTRAIN_BF16) return mtrain_npy_write(path, t);
  mtrain_tensor_t f = *t;
  f.dtype = MTRAIN_F32;
  f.data = malloc(sizeof(float) * (size_t)(mtrain_tensor_numel(t) + 1));
  if (!f.data) return MTRAIN_ERR_OUT_OF_MEMORY;
  mtrain_status_t st =
      mtrain_convert(t->data, t->dtype, f.data, MTRAIN_F32, mtrain_tensor_numel(t));
  if (st == MTRAIN_SUCCESS) st = mtrain_npy_write(path, &f);
  free(f.data);
  return st;
}
