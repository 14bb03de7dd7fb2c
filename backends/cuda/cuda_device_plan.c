/* cuda_device_plan.c: the device_plan slots of the "cuda" backend
 * (mtrain_backend.h): a packed batch's vertical-slash selection
 * (cuda_select.h) writes its kept sets into the plan's memory instead of
 * the scratch, and the step tables are built from them on the device
 * (cuda_plan_build.h), both queued on the backend's stream without a host
 * wait. The handle holds each sequence's cuda_step_t, which the attention
 * slots use instead of uploading a host-packed step (cuda_backend.c). The
 * patterns and pairs come back only on request (device_plan_read). */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_device_plan.h"
#include "backends/cuda/cuda_plan_build.h"
#include "backends/cuda/cuda_select.h"
#include "mtrain/mtrain_error.h"

static size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

/* Where the parts of a device plan lie in its memory (byte offsets): every
 * (sequence, head)'s counts, each sequence's verticals [Hq * N] int64 and
 * block diagonals [Hq * (nb + 1)] int32, then the step tables. */
typedef struct plan_layout {
  size_t counts, *verticals, *diags, tables, bytes;
} plan_layout_t;

/* The capacities of sequence q's tables from its budgets: the most verticals
 * and block diagonals any head can keep (select_kernels.cuh: top-k keeps
 * min(k, candidates), top-p at most min(cap, candidates); every kept token
 * diagonal marks at most two block diagonals, and diagonal 0 is always in). */
static void seq_caps(const mtrain_select_args_t *a, cuda_plan_seq_t *out) {
  const int64_t N = a->seq_len, G = a->granularity, nb = (N + G - 1) / G;
  const int64_t nv_cand = ((N - 1) / G) * G;
  int64_t cap_v = 0, cap_s = 0;
  for (int32_t h = 0; h < a->num_heads; h++) {
    const mtrain_head_budget_t *b = &a->budgets[h];
    const int64_t v = b->kind == MTRAIN_BUDGET_TOP_P ? b->cap_v : b->v_size;
    const int64_t t = b->kind == MTRAIN_BUDGET_TOP_P ? b->cap_s : b->s_size;
    const int64_t nv = v < 0 ? 0 : v < nv_cand ? v : nv_cand;
    const int64_t ns = t < 0 ? 0 : t < N ? t : N;
    if (nv > cap_v) cap_v = nv;
    if (ns > cap_s) cap_s = ns;
  }
  const int64_t cap_d = 1 + 2 * cap_s < nb ? 1 + 2 * cap_s : nb;
  out->seq_len = N;
  out->cap_verticals = (int32_t)cap_v;
  out->cap_diagonals = (int32_t)(cap_d > 0 ? cap_d : 1);
}

/* The selection plan, the capacities and the layout of a batch; frees
 * nothing on error but what it made. */
static mtrain_status_t plan_sizes(const mtrain_device_plan_args_t *a, cuda_select_plan_t *sel,
                                  cuda_plan_seq_t *seqs, plan_layout_t *lay) {
  const int32_t count = a->count;
  if (count < 1 || !a->select)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda device plan: %d sequences (>= 1)",
                        count);
  const int32_t Hq = a->select[0].num_heads, G = a->select[0].granularity;
  if (a->num_kv_heads < 1 || Hq % a->num_kv_heads != 0)
    return mtrain_error(MTRAIN_ERR_HEAD_MISMATCH,
                        "cuda device plan: %d query heads, %d kv heads (must divide)", Hq,
                        a->num_kv_heads);
  for (int32_t q = 1; q < count; q++)
    if (a->select[q].num_heads != Hq || a->select[q].granularity != G)
      return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                          "cuda device plan: sequence %d has %d heads and granularity %d, "
                          "sequence 0 %d and %d",
                          q, a->select[q].num_heads, a->select[q].granularity, Hq, G);
  mtrain_status_t st = cuda_select_plan(a->select, count, sel);
  if (st) return st;
  size_t off = 0;
  lay->counts = off;
  off += align_up(sizeof(int32_t) * 2 * (size_t)sel->entries);
  for (int32_t q = 0; q < count; q++) {
    const int64_t N = a->select[q].seq_len, nb = (N + G - 1) / G;
    lay->verticals[q] = off;
    off += align_up(sizeof(int64_t) * (size_t)Hq * (size_t)N);
    lay->diags[q] = off;
    off += align_up(sizeof(int32_t) * (size_t)Hq * (size_t)(nb + 1));
    seq_caps(&a->select[q], &seqs[q]);
  }
  lay->tables = off;
  const cuda_plan_geom_t g = {.num_heads = Hq,
                              .num_kv_heads = a->num_kv_heads,
                              .granularity = G,
                              .count = count,
                              .seqs = seqs};
  size_t tables = 0;
  st = cuda_plan_build_bytes(&g, &tables);
  if (st) {
    cuda_select_plan_free(sel);
    return st;
  }
  lay->bytes = off + align_up(tables);
  return MTRAIN_SUCCESS;
}

/* Host arrays of plan_sizes for `count` sequences. */
typedef struct plan_arrays {
  cuda_plan_seq_t *seqs;
  size_t *offsets; /* [2 * count]: verticals, then diagonals */
} plan_arrays_t;

static mtrain_status_t arrays_alloc(int32_t count, plan_arrays_t *x, plan_layout_t *lay) {
  x->seqs = calloc((size_t)(count > 0 ? count : 1), sizeof *x->seqs);
  x->offsets = calloc(2 * (size_t)(count > 0 ? count : 1), sizeof *x->offsets);
  if (!x->seqs || !x->offsets) {
    free(x->seqs);
    free(x->offsets);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda device plan: out of host memory");
  }
  lay->verticals = x->offsets;
  lay->diags = x->offsets + count;
  return MTRAIN_SUCCESS;
}

static void arrays_free(plan_arrays_t *x) {
  free(x->seqs);
  free(x->offsets);
}

mtrain_status_t cuda_device_plan_size(void *state, const mtrain_device_plan_args_t *a,
                                      size_t *bytes) {
  (void)state;
  MTRAIN_CHECK_NOT_NULL(a);
  MTRAIN_CHECK_NOT_NULL(bytes);
  plan_arrays_t x;
  plan_layout_t lay;
  mtrain_status_t st = arrays_alloc(a->count, &x, &lay);
  if (st) return st;
  cuda_select_plan_t sel;
  st = plan_sizes(a, &sel, x.seqs, &lay);
  if (!st) {
    *bytes = lay.bytes;
    cuda_select_plan_free(&sel);
  }
  arrays_free(&x);
  return st;
}

/* The handle: what the attention slots and the read need. */
struct cuda_device_plan {
  int32_t count, num_heads;
  cuda_select_plan_t sel;
  int64_t **verticals; /* device, [count] */
  int32_t **diags;     /* device, [count] */
  int32_t *counts;     /* device */
  int64_t *pairs;      /* device [count * Hq] */
  char *tables;        /* device: the builder's memory (its error word first) */
  cuda_step_t *steps;  /* [count] */
};

void cuda_device_plan_release(void *state, void *handle) {
  (void)state;
  cuda_device_plan_t *p = handle;
  if (!p) return;
  cuda_select_plan_free(&p->sel);
  free(p->verticals);
  free(p->diags);
  free(p->steps);
  free(p);
}

mtrain_status_t cuda_device_plan_build(void *state, const mtrain_device_plan_args_t *a,
                                       void *memory, void **handle) {
  cuda_state_t *s = state;
  MTRAIN_CHECK_NOT_NULL(a);
  MTRAIN_CHECK_NOT_NULL(memory);
  MTRAIN_CHECK_NOT_NULL(handle);
  *handle = NULL;
  plan_arrays_t x;
  plan_layout_t lay;
  mtrain_status_t st = arrays_alloc(a->count, &x, &lay);
  if (st) return st;
  cuda_device_plan_t *p = calloc(1, sizeof *p);
  if (!p) {
    arrays_free(&x);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda device plan: out of host memory");
  }
  st = plan_sizes(a, &p->sel, x.seqs, &lay);
  if (st) {
    free(p);
    arrays_free(&x);
    return st;
  }
  const int32_t count = a->count, Hq = a->select[0].num_heads;
  char *mem = memory;
  p->count = count;
  p->num_heads = Hq;
  p->counts = (int32_t *)(mem + lay.counts);
  p->verticals = malloc(sizeof *p->verticals * (size_t)count);
  p->diags = malloc(sizeof *p->diags * (size_t)count);
  p->steps = calloc((size_t)count, sizeof *p->steps);
  if (!p->verticals || !p->diags || !p->steps)
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda device plan: out of host memory");
  for (int32_t q = 0; q < count && !st; q++) {
    p->verticals[q] = (int64_t *)(mem + lay.verticals[q]);
    p->diags[q] = (int32_t *)(mem + lay.diags[q]);
    x.seqs[q].counts = p->counts + 2 * (size_t)q * (size_t)Hq;
    x.seqs[q].verticals = p->verticals[q];
    x.seqs[q].diagonals = p->diags[q];
  }
  /* the selection: its scratch is the backend's (used only by these kernels) */
  void *scratch = NULL;
  if (!st) st = cuda_scratch(s, p->sel.bytes, &scratch);
  if (!st)
    st =
        cuda_select_queue(s, a->select, count, &p->sel, scratch, p->counts, p->verticals, p->diags);
  const cuda_plan_geom_t g = {.num_heads = Hq,
                              .num_kv_heads = a->num_kv_heads,
                              .granularity = a->select[0].granularity,
                              .count = count,
                              .seqs = x.seqs};
  p->tables = mem + lay.tables;
  if (!st) st = cuda_plan_build(s, &g, p->tables, p->steps, &p->pairs);
  arrays_free(&x);
  if (st) {
    cuda_device_plan_release(s, p);
    return st;
  }
  *handle = p;
  return MTRAIN_SUCCESS;
}

mtrain_status_t cuda_device_plan_read(void *state, void *handle, const mtrain_device_plan_args_t *a,
                                      int64_t *pairs) {
  cuda_state_t *s = state;
  cuda_device_plan_t *p = handle;
  MTRAIN_CHECK_NOT_NULL(p);
  MTRAIN_CHECK_NOT_NULL(a);
  if (a->count != p->count)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda device plan: read of %d sequences, the plan has %d", a->count,
                        p->count);
  void *pack = NULL;
  mtrain_status_t st = cuda_scratch(s, cuda_select_read_bytes(&p->sel), &pack);
  if (!st)
    st = cuda_select_read(s, a->select, p->count, &p->sel, p->verticals, p->diags, p->counts, pack);
  if (!st && pairs)
    st = cuda_check(cudaMemcpyAsync(pairs, p->pairs,
                                    sizeof(int64_t) * (size_t)p->count * (size_t)p->num_heads,
                                    cudaMemcpyDeviceToHost, (cudaStream_t)s->stream),
                    "device plan pairs to the host");
  uint32_t err = 0;
  if (!st)
    st = cuda_check(cudaMemcpyAsync(&err, p->tables + CUDA_PLAN_ERR_OFFSET, sizeof err,
                                    cudaMemcpyDeviceToHost, (cudaStream_t)s->stream),
                    "device plan error word to the host");
  if (!st)
    st = cuda_check(cudaStreamSynchronize((cudaStream_t)s->stream), "device plan (read back)");
  /* the selection's output always keeps the builder's contract: a set bit is a bug */
  if (!st && err)
    st = mtrain_error(MTRAIN_ERR_INTERNAL,
                      "cuda device plan: the table builder found %s%s%s (error word 0x%x): the "
                      "plan's results are not to be trusted",
                      err & CUDA_PLAN_ERR_CAPACITY ? "a count above its capacity " : "",
                      err & CUDA_PLAN_ERR_PATTERN ? "a malformed selection " : "",
                      err & CUDA_PLAN_ERR_INTERNAL ? "a table beyond its bound " : "", err);
  return st;
}

mtrain_status_t cuda_device_plan_step(const void *handle, int32_t seq, cuda_step_t *out) {
  const cuda_device_plan_t *p = handle;
  if (!p || seq < 0 || seq >= p->count)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda: step view of device-plan sequence %d, the plan has %d", seq,
                        p ? p->count : 0);
  *out = p->steps[seq];
  return MTRAIN_SUCCESS;
}
