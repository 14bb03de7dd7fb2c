/* cuda_select.cu: the pattern_select and pattern_select_batch slots of the
 * "cuda" backend: the vertical-slash selection (select_kernels.cuh) on the
 * GPU, so that the estimate's scores (Hq x N x (S + 1) doubles) stay on the
 * device and only the patterns come back. A batch of sequences is selected
 * with one launch of each kernel for all of them (the sequences' parameters
 * in a device table, each CTA finding its sequence), then one packing kernel
 * puts every head's kept verticals and block diagonals one after another:
 * the counts come back, then the packed sets in two copies (two waits for
 * the whole batch). Bitwise the host selection's result for the same scores. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/cuda_select.h"
#include "backends/cuda/select_kernels.cuh"
#include "mtrain/mtrain_error.h"

namespace {

size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

} // namespace

/* One sequence's checks and its heads' device budgets; NOT_SUPPORTED for
 * lengths the device cannot select. *sort_n grows to its largest top-p sort
 * (a cap's candidates, at most sel::kSortMax: the chunk of the walk). */
static mtrain_status_t check_sequence(const mtrain_select_args_t *a, int32_t s, sel::Head *heads,
                                      int64_t *sort_n) {
  const int64_t N = a->seq_len;
  const int32_t Hq = a->num_heads, G = a->granularity;
  if (N < 1 || Hq < 1 || G < 1 || a->slots < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda select: sequence %d: seq_len %lld, heads %d, granularity %d, slots "
                        "%d (each >= 1)",
                        s, (long long)N, Hq, G, a->slots);
  if (N > INT32_MAX)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda select: seq_len %lld beyond the 32-bit counts of the selection",
                        (long long)N);
  const int64_t nv_cand = ((N - 1) / G) * G;
  for (int32_t h = 0; h < Hq; h++) {
    const mtrain_head_budget_t *b = &a->budgets[h];
    sel::Head *d = &heads[h];
    d->top_p = b->kind == MTRAIN_BUDGET_TOP_P;
    d->k_v = b->v_size;
    d->k_s = b->s_size;
    d->cap_v = b->cap_v;
    d->cap_s = b->cap_s;
    d->p_v = b->p_v;
    d->p_s = b->p_s;
    if (!d->top_p) continue;
    const int64_t mv = b->cap_v < nv_cand ? b->cap_v : nv_cand, ms = b->cap_s < N ? b->cap_s : N;
    int64_t m = mv > ms ? mv : ms;
    if (m > sel::kSortMax) m = sel::kSortMax; /* larger caps walk in chunks of it */
    if (m > *sort_n) *sort_n = m;
  }
  return MTRAIN_SUCCESS;
}

/* Device scratch of one sequence's selection: slash scores, kept verticals
 * and tokens, bitmap, block diagonals (byte offsets from its base). */
struct SeqScratch {
  size_t sscore, vert, tok, bits, diag, bytes;
};

static SeqScratch seq_scratch(int64_t N, int32_t Hq, int64_t nb) {
  const size_t hn = (size_t)Hq * (size_t)N;
  SeqScratch x;
  x.sscore = 0;
  x.vert = x.sscore + align_up(hn * sizeof(double));
  x.tok = x.vert + align_up(hn * sizeof(int64_t));
  x.bits = x.tok + align_up(hn * sizeof(int64_t));
  x.diag = x.bits + align_up((size_t)Hq * (size_t)nb);
  x.bytes = x.diag + align_up((size_t)Hq * (size_t)(nb + 1) * sizeof(int32_t));
  return x;
}

extern "C" void cuda_select_plan_free(cuda_select_plan_t *p) {
  free(p->heads);
  free(p->base);
  p->heads = NULL;
  p->base = NULL;
}

extern "C" mtrain_status_t cuda_select_plan(const mtrain_select_args_t *args, int32_t count,
                                            cuda_select_plan_t *p) {
  memset(p, 0, sizeof *p);
  if (count < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda select: %d sequences (>= 1)", count);
  for (int32_t q = 0; q < count; q++) p->entries += args[q].num_heads > 0 ? args[q].num_heads : 0;
  p->heads = calloc((size_t)(p->entries > 0 ? p->entries : 1), sizeof(sel::Head));
  p->base = (size_t *)calloc((size_t)count, sizeof(size_t));
  if (!p->heads || !p->base) {
    cuda_select_plan_free(p);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  }
  int64_t sort_n = 0, e0 = 0;
  for (int32_t q = 0; q < count; q++) {
    mtrain_status_t st = check_sequence(&args[q], q, (sel::Head *)p->heads + e0, &sort_n);
    if (st) {
      cuda_select_plan_free(p);
      return st;
    }
    const int64_t N = args[q].seq_len, nb = (N + args[q].granularity - 1) / args[q].granularity;
    p->base[q] = p->bytes;
    p->bytes += seq_scratch(N, args[q].num_heads, nb).bytes;
    e0 += args[q].num_heads;
    p->total_v += (int64_t)args[q].num_heads * N;
    p->total_d += (int64_t)args[q].num_heads * (nb + 1);
  }
  p->sort_pow2 = 1;
  while (p->sort_pow2 < sort_n) p->sort_pow2 <<= 1;
  if (sort_n == 0) p->sort_pow2 = 0;
  return MTRAIN_SUCCESS;
}

extern "C" mtrain_status_t cuda_select_queue(cuda_state_t *s, const mtrain_select_args_t *args,
                                             int32_t count, const cuda_select_plan_t *p,
                                             void *scratch, int32_t *counts,
                                             int64_t *const *verticals, int32_t *const *diags) {
  char *dev = (char *)scratch;
  void *dev_heads = NULL, *dev_tables = NULL;
  int slot = -1, slot2 = -1;
  mtrain_status_t st =
      cuda_upload_small(s, p->heads, (size_t)p->entries * sizeof(sel::Head), &dev_heads, &slot);
  const size_t o_sums = align_up((size_t)count * sizeof(sel::Params)),
               o_ctas = o_sums + align_up((size_t)(count + 1) * sizeof(int64_t)),
               upload = o_ctas + (size_t)(count + 1) * sizeof(int64_t);
  char *staged = st ? NULL : (char *)malloc(upload);
  if (!st && !staged)
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  int64_t total_sums = 0, total_ctas = 0;
  if (!st) {
    sel::Params *params = (sel::Params *)staged;
    int64_t *first_sums = (int64_t *)(staged + o_sums), *first_ctas = (int64_t *)(staged + o_ctas);
    int64_t e = 0;
    for (int32_t q = 0; q < count; q++) {
      const mtrain_select_args_t *a = &args[q];
      const int64_t N = a->seq_len, G = a->granularity, nb = (N + G - 1) / G;
      const SeqScratch x = seq_scratch(N, a->num_heads, nb);
      char *b = dev + p->base[q];
      sel::Params *pr = &params[q];
      memset(pr, 0, sizeof *pr);
      pr->N = N;
      pr->nb = nb;
      pr->nv_cand = ((N - 1) / G) * G;
      pr->G = (int32_t)G;
      pr->slots = a->slots;
      pr->Hq = a->num_heads;
      pr->nf_v = a->num_sinks < pr->nv_cand ? a->num_sinks : pr->nv_cand;
      pr->nf_s = a->window < N ? a->window : N;
      pr->top_p_forced = a->top_p_forced ? 1 : 0;
      pr->sort_chunk = sel::kSortMax;
      pr->col = a->col;
      pr->diag = a->diag;
      pr->sscore = (double *)(b + x.sscore);
      pr->heads = (const sel::Head *)dev_heads + e;
      pr->verticals = verticals ? verticals[q] : (int64_t *)(b + x.vert);
      pr->tokens = (int64_t *)(b + x.tok);
      pr->bitmap = (uint8_t *)(b + x.bits);
      pr->diags = diags ? diags[q] : (int32_t *)(b + x.diag);
      pr->counts = counts + 2 * e;
      first_sums[q] = total_sums;
      first_ctas[q] = total_ctas;
      total_sums += (int64_t)a->num_heads * N;
      total_ctas += 2 * (int64_t)a->num_heads;
      e += a->num_heads;
    }
    first_sums[count] = total_sums;
    first_ctas[count] = total_ctas;
    st = cuda_upload_small(s, staged, upload, &dev_tables, &slot2);
  }
  free(staged);
  cudaStream_t str = (cudaStream_t)s->stream;
  static cuda_smem_attr_t attr;
  char who[96];
  snprintf(who, sizeof who, "select (top-p sorts of %lld)", (long long)p->sort_pow2);
  const size_t smem = p->sort_pow2 > 0 ? sel::smem_bytes(p->sort_pow2) : sel::kSmemFixed;
  /* one launch of each kernel for the whole batch */
  if (!st) {
    const sel::Params *params = (const sel::Params *)dev_tables;
    const int64_t *first_sums = (const int64_t *)((char *)dev_tables + o_sums);
    const int64_t *first_ctas = (const int64_t *)((char *)dev_tables + o_ctas);
    const int64_t sum_blocks = (total_sums + sel::kThreads - 1) / sel::kThreads;
    sel::slash_sums_batch_kernel<<<(unsigned)(sum_blocks < 4096 ? sum_blocks : 4096), sel::kThreads,
                                   0, str>>>(params, first_sums, count);
    st = cuda_check_launch("slash_sums_batch_kernel");
    if (!st)
      st = cuda_prepare_launch(s, (const void *)sel::select_batch_kernel, who,
                               "select_batch_kernel", total_ctas, 1, smem, &attr);
    if (!st) {
      sel::select_batch_kernel<<<(unsigned)total_ctas, sel::kThreads, smem, str>>>(
          params, first_ctas, count);
      st = cuda_check_launch("select_batch_kernel");
    }
  }
  mtrain_status_t st2 = slot >= 0 ? cuda_step_release(s, slot) : MTRAIN_SUCCESS;
  mtrain_status_t st3 = slot2 >= 0 ? cuda_step_release(s, slot2) : MTRAIN_SUCCESS;
  return st ? st : st2 ? st2 : st3;
}

extern "C" size_t cuda_select_read_bytes(const cuda_select_plan_t *p) {
  return align_up((size_t)p->total_v * sizeof(int64_t)) +
         align_up((size_t)p->total_d * sizeof(int32_t));
}

extern "C" mtrain_status_t cuda_select_read(cuda_state_t *s, const mtrain_select_args_t *args,
                                            int32_t count, const cuda_select_plan_t *p,
                                            int64_t *const *verticals, int32_t *const *diags,
                                            const int32_t *counts, void *pack_scratch) {
  char *pack = (char *)pack_scratch;
  const int64_t entries = p->entries;
  int64_t *packed_v = (int64_t *)pack;
  int32_t *packed_d = (int32_t *)(pack + align_up((size_t)p->total_v * sizeof(int64_t)));
  sel::PackEntry *table =
      (sel::PackEntry *)malloc(sizeof(sel::PackEntry) * (size_t)(entries > 0 ? entries : 1));
  if (!table) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  int64_t e = 0;
  for (int32_t q = 0; q < count; q++) {
    const int64_t N = args[q].seq_len, nb = (N + args[q].granularity - 1) / args[q].granularity;
    for (int32_t h = 0; h < args[q].num_heads; h++, e++) {
      table[e].verticals = verticals[q] + (size_t)h * (size_t)N;
      table[e].diags = diags[q] + (size_t)h * (size_t)(nb + 1);
    }
  }
  void *dev_table = NULL;
  int slot = -1;
  mtrain_status_t st =
      cuda_upload_small(s, table, sizeof(sel::PackEntry) * (size_t)entries, &dev_table, &slot);
  free(table);
  cudaStream_t str = (cudaStream_t)s->stream;
  static cuda_smem_attr_t pack_attr;
  if (!st)
    st = cuda_prepare_launch(s, (const void *)sel::pack_kernel, "select (pack)", "pack_kernel",
                             entries, 1, sel::kSmemPack, &pack_attr);
  if (!st) {
    sel::pack_kernel<<<(unsigned)entries, sel::kThreads, sel::kSmemPack, str>>>(
        (const sel::PackEntry *)dev_table, counts, packed_v, packed_d);
    st = cuda_check_launch("pack_kernel");
  }
  /* the counts, then the packed sets, then each head's share to its place */
  int32_t *pairs = NULL;
  int64_t *host_v = NULL;
  int32_t *host_d = NULL;
  if (!st) {
    pairs = (int32_t *)malloc(sizeof(int32_t) * 2 * (size_t)entries);
    if (!pairs) st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  }
  if (!st)
    st = cuda_check(cudaMemcpyAsync(pairs, counts, sizeof(int32_t) * 2 * (size_t)entries,
                                    cudaMemcpyDeviceToHost, str),
                    "select counts to the host");
  if (!st) st = cuda_check(cudaStreamSynchronize(str), "select (wait for the counts)");
  int64_t kept_v = 0, kept_d = 0;
  for (int64_t i = 0; i < entries && !st; i++) {
    kept_v += pairs[2 * i];
    kept_d += pairs[2 * i + 1];
  }
  if (!st) {
    host_v = (int64_t *)malloc(sizeof(int64_t) * (size_t)(kept_v > 0 ? kept_v : 1));
    host_d = (int32_t *)malloc(sizeof(int32_t) * (size_t)(kept_d > 0 ? kept_d : 1));
    if (!host_v || !host_d)
      st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  }
  if (!st && kept_v)
    st = cuda_check(cudaMemcpyAsync(host_v, packed_v, sizeof(int64_t) * (size_t)kept_v,
                                    cudaMemcpyDeviceToHost, str),
                    "selected verticals to the host");
  if (!st && kept_d)
    st = cuda_check(cudaMemcpyAsync(host_d, packed_d, sizeof(int32_t) * (size_t)kept_d,
                                    cudaMemcpyDeviceToHost, str),
                    "selected diagonals to the host");
  if (!st) st = cuda_check(cudaStreamSynchronize(str), "select (wait for the patterns)");
  int64_t off_v = 0, off_d = 0;
  e = 0;
  for (int32_t q = 0; q < count && !st; q++) {
    const mtrain_select_args_t *a = &args[q];
    const int64_t N = a->seq_len, nb = (N + a->granularity - 1) / a->granularity;
    for (int32_t h = 0; h < a->num_heads; h++, e++) {
      const int32_t nv = pairs[2 * e], nd = pairs[2 * e + 1];
      a->num_verticals[h] = nv;
      a->num_diagonals[h] = nd;
      memcpy(a->verticals + (size_t)h * (size_t)N, host_v + off_v, sizeof(int64_t) * (size_t)nv);
      memcpy(a->diagonals + (size_t)h * (size_t)(nb + 1), host_d + off_d,
             sizeof(int32_t) * (size_t)nd);
      off_v += nv;
      off_d += nd;
    }
  }
  free(pairs);
  free(host_v);
  free(host_d);
  mtrain_status_t st2 = slot >= 0 ? cuda_step_release(s, slot) : MTRAIN_SUCCESS;
  return st ? st : st2;
}

extern "C" mtrain_status_t
cuda_pattern_select_batch(cuda_state_t *s, const mtrain_select_args_t *args, int32_t count) {
  cuda_select_plan_t p;
  mtrain_status_t st =
      cuda_select_plan(args, count, &p); /* every check before anything is queued */
  if (st) return st;
  /* the sequences' scratch, every entry's counts, then the packed sets */
  const size_t o_count = p.bytes,
               o_pack = o_count + align_up((size_t)p.entries * 2 * sizeof(int32_t)),
               all = o_pack + cuda_select_read_bytes(&p);
  void *scr = NULL;
  st = cuda_scratch(s, all, &scr);
  char *dev = (char *)scr;
  int32_t *counts = st ? NULL : (int32_t *)(dev + o_count);
  if (!st) st = cuda_select_queue(s, args, count, &p, dev, counts, NULL, NULL);
  int64_t **verticals = NULL;
  int32_t **diags = NULL;
  if (!st) {
    verticals = (int64_t **)malloc(sizeof(int64_t *) * (size_t)count);
    diags = (int32_t **)malloc(sizeof(int32_t *) * (size_t)count);
    if (!verticals || !diags)
      st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  }
  for (int32_t q = 0; q < count && !st; q++) {
    const int64_t N = args[q].seq_len, nb = (N + args[q].granularity - 1) / args[q].granularity;
    const SeqScratch x = seq_scratch(N, args[q].num_heads, nb);
    verticals[q] = (int64_t *)(dev + p.base[q] + x.vert);
    diags[q] = (int32_t *)(dev + p.base[q] + x.diag);
  }
  if (!st) st = cuda_select_read(s, args, count, &p, verticals, diags, counts, dev + o_pack);
  free(verticals);
  free(diags);
  cuda_select_plan_free(&p);
  return st;
}

extern "C" mtrain_status_t cuda_pattern_select(cuda_state_t *s, const mtrain_select_args_t *a) {
  return cuda_pattern_select_batch(s, a, 1);
}
