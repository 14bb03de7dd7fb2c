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
#include "backends/cuda/select_kernels.cuh"
#include "mtrain/mtrain_error.h"

namespace {

size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

} // namespace

/* One sequence's checks and its heads' device budgets; NOT_SUPPORTED for
 * budgets the device cannot select. *sort_n grows to its largest top-p set. */
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
    const int64_t m = mv > ms ? mv : ms;
    if (m > sel::kSortMax)
      return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                          "cuda select: head %d is top-p with a cap of %lld candidates at N = "
                          "%lld; the device sorts at most %d (the host selects it)",
                          h, (long long)(b->cap_v > b->cap_s ? b->cap_v : b->cap_s), (long long)N,
                          sel::kSortMax);
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

extern "C" mtrain_status_t
cuda_pattern_select_batch(cuda_state_t *s, const mtrain_select_args_t *args, int32_t count) {
  if (count < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "cuda select: %d sequences (>= 1)", count);
  /* every sequence's checks before anything is queued */
  int64_t entries = 0;
  for (int32_t q = 0; q < count; q++) entries += args[q].num_heads > 0 ? args[q].num_heads : 0;
  sel::Head *heads = (sel::Head *)calloc((size_t)(entries > 0 ? entries : 1), sizeof(sel::Head));
  size_t *base = (size_t *)calloc((size_t)count, sizeof(size_t));
  if (!heads || !base) {
    free(heads);
    free(base);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  }
  mtrain_status_t st = MTRAIN_SUCCESS;
  int64_t sort_n = 0, e0 = 0, total_v = 0, total_d = 0;
  size_t bytes = 0;
  for (int32_t q = 0; q < count && !st; q++) {
    st = check_sequence(&args[q], q, heads + e0, &sort_n);
    if (st) break;
    const int64_t N = args[q].seq_len, nb = (N + args[q].granularity - 1) / args[q].granularity;
    base[q] = bytes;
    bytes += seq_scratch(N, args[q].num_heads, nb).bytes;
    e0 += args[q].num_heads;
    total_v += (int64_t)args[q].num_heads * N;
    total_d += (int64_t)args[q].num_heads * (nb + 1);
  }
  if (st) {
    free(heads);
    free(base);
    return st;
  }
  int64_t sort_pow2 = 1;
  while (sort_pow2 < sort_n) sort_pow2 <<= 1;
  const size_t smem = sort_n > 0 ? sel::smem_bytes(sort_pow2) : sel::kSmemFixed;
  /* after the sequences: every entry's counts, then the packed sets */
  const size_t o_count = bytes, o_pv = o_count + align_up((size_t)entries * 2 * sizeof(int32_t)),
               o_pd = o_pv + align_up((size_t)total_v * sizeof(int64_t)),
               all = o_pd + align_up((size_t)total_d * sizeof(int32_t));
  void *scr = NULL;
  st = cuda_scratch(s, all, &scr);
  char *dev = (char *)scr;
  int32_t *counts = (int32_t *)(dev + o_count);
  int64_t *packed_v = (int64_t *)(dev + o_pv);
  int32_t *packed_d = (int32_t *)(dev + o_pd);
  /* the budgets first (the sequences' parameters point at them), then the
   * packing table, the parameters and the two prefix tables in one upload */
  void *dev_heads = NULL, *dev_tables = NULL;
  int slot = -1, slot2 = -1;
  if (!st) st = cuda_upload_small(s, heads, (size_t)entries * sizeof(sel::Head), &dev_heads, &slot);
  free(heads);
  const size_t o_params = align_up((size_t)entries * sizeof(sel::PackEntry)),
               o_sums = o_params + align_up((size_t)count * sizeof(sel::Params)),
               o_ctas = o_sums + align_up((size_t)(count + 1) * sizeof(int64_t)),
               upload = o_ctas + (size_t)(count + 1) * sizeof(int64_t);
  char *staged = st ? NULL : (char *)malloc(upload);
  if (!st && !staged)
    st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  int64_t total_sums = 0, total_ctas = 0;
  if (!st) {
    sel::PackEntry *table = (sel::PackEntry *)staged;
    sel::Params *params = (sel::Params *)(staged + o_params);
    int64_t *first_sums = (int64_t *)(staged + o_sums), *first_ctas = (int64_t *)(staged + o_ctas);
    int64_t e = 0;
    for (int32_t q = 0; q < count; q++) {
      const mtrain_select_args_t *a = &args[q];
      const int64_t N = a->seq_len, G = a->granularity, nb = (N + G - 1) / G;
      const SeqScratch x = seq_scratch(N, a->num_heads, nb);
      char *b = dev + base[q];
      sel::Params *p = &params[q];
      memset(p, 0, sizeof *p);
      p->N = N;
      p->nb = nb;
      p->nv_cand = ((N - 1) / G) * G;
      p->G = (int32_t)G;
      p->slots = a->slots;
      p->Hq = a->num_heads;
      p->nf_v = a->num_sinks < p->nv_cand ? a->num_sinks : p->nv_cand;
      p->nf_s = a->window < N ? a->window : N;
      p->col = a->col;
      p->diag = a->diag;
      p->sscore = (double *)(b + x.sscore);
      p->heads = (const sel::Head *)dev_heads + e;
      p->verticals = (int64_t *)(b + x.vert);
      p->tokens = (int64_t *)(b + x.tok);
      p->bitmap = (uint8_t *)(b + x.bits);
      p->diags = (int32_t *)(b + x.diag);
      p->counts = counts + 2 * e;
      first_sums[q] = total_sums;
      first_ctas[q] = total_ctas;
      total_sums += (int64_t)a->num_heads * N;
      total_ctas += 2 * (int64_t)a->num_heads;
      for (int32_t h = 0; h < a->num_heads; h++, e++) {
        table[e].verticals = p->verticals + (size_t)h * (size_t)N;
        table[e].diags = p->diags + (size_t)h * (size_t)(nb + 1);
      }
    }
    first_sums[count] = total_sums;
    first_ctas[count] = total_ctas;
    st = cuda_upload_small(s, staged, upload, &dev_tables, &slot2);
  }
  free(staged);
  cudaStream_t str = (cudaStream_t)s->stream;
  static cuda_smem_attr_t attr, pack_attr;
  char who[96];
  snprintf(who, sizeof who, "select (top-p sorts of %lld)", (long long)sort_pow2);
  /* one launch of each kernel for the whole batch */
  if (!st) {
    const sel::Params *params = (const sel::Params *)((char *)dev_tables + o_params);
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
  if (!st)
    st = cuda_prepare_launch(s, (const void *)sel::pack_kernel, "select (pack)", "pack_kernel",
                             entries, 1, sel::kSmemPack, &pack_attr);
  if (!st) {
    sel::pack_kernel<<<(unsigned)entries, sel::kThreads, sel::kSmemPack, str>>>(
        (const sel::PackEntry *)dev_tables, counts, packed_v, packed_d);
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
  for (int64_t e = 0; e < entries && !st; e++) {
    kept_v += pairs[2 * e];
    kept_d += pairs[2 * e + 1];
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
  int64_t e = 0, off_v = 0, off_d = 0;
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
  free(base);
  mtrain_status_t st2 = slot >= 0 ? cuda_step_release(s, slot) : MTRAIN_SUCCESS;
  mtrain_status_t st3 = slot2 >= 0 ? cuda_step_release(s, slot2) : MTRAIN_SUCCESS;
  return st ? st : st2 ? st2 : st3;
}

extern "C" mtrain_status_t cuda_pattern_select(cuda_state_t *s, const mtrain_select_args_t *a) {
  return cuda_pattern_select_batch(s, a, 1);
}
