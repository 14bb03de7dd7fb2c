/* cuda_select.cu: the pattern_select slot of the "cuda" backend: the
 * vertical-slash selection (select_kernels.cuh) on the GPU, so that the
 * estimate's scores (Hq x N x (S + 1) doubles) stay on the device and only
 * the pattern comes back: the heads' counts, then their verticals and block
 * diagonals. Bitwise the host selection's result for the same scores. */
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

extern "C" mtrain_status_t cuda_pattern_select(cuda_state_t *s, const mtrain_select_args_t *a) {
  const int64_t N = a->seq_len;
  const int32_t Hq = a->num_heads, G = a->granularity;
  if (N < 1 || Hq < 1 || G < 1 || a->slots < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda select: seq_len %lld, heads %d, granularity %d, slots %d (each >= 1)",
                        (long long)N, Hq, G, a->slots);
  if (N > INT32_MAX)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "cuda select: seq_len %lld beyond the 32-bit counts of the selection",
                        (long long)N);
  const int64_t nb = (N + G - 1) / G, nv_cand = ((N - 1) / G) * G;
  /* budgets: the device copy, and the largest top-p set to sort */
  sel::Head *heads = (sel::Head *)calloc((size_t)Hq, sizeof(sel::Head));
  if (!heads) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  int64_t sort_n = 0;
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
    if (m > sel::kSortMax) {
      free(heads);
      return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                          "cuda select: head %d is top-p with a cap of %lld candidates at N = "
                          "%lld; the device sorts at most %d (the host selects it)",
                          h, (long long)(b->cap_v > b->cap_s ? b->cap_v : b->cap_s), (long long)N,
                          sel::kSortMax);
    }
    if (m > sort_n) sort_n = m;
  }
  int64_t sort_pow2 = 1;
  while (sort_pow2 < sort_n) sort_pow2 <<= 1;
  const size_t smem = sort_n > 0 ? sel::smem_bytes(sort_pow2) : sel::kSmemFixed;
  /* device scratch: slash scores, kept verticals and tokens, bitmap,
   * diagonals, counts */
  const size_t hn = (size_t)Hq * (size_t)N;
  const size_t o_sscore = 0, o_vert = o_sscore + align_up(hn * sizeof(double)),
               o_tok = o_vert + align_up(hn * sizeof(int64_t)),
               o_bits = o_tok + align_up(hn * sizeof(int64_t)),
               o_diag = o_bits + align_up((size_t)Hq * (size_t)nb),
               o_count = o_diag + align_up((size_t)Hq * (size_t)(nb + 1) * sizeof(int32_t)),
               bytes = o_count + align_up((size_t)Hq * 2 * sizeof(int32_t));
  void *scr = NULL;
  mtrain_status_t st = cuda_scratch(s, bytes, &scr);
  void *dev_heads = NULL;
  int slot = -1;
  if (!st) st = cuda_upload_small(s, heads, sizeof(sel::Head) * (size_t)Hq, &dev_heads, &slot);
  free(heads);
  if (st) return st;
  char *base = (char *)scr;
  sel::Params p;
  p.N = N;
  p.nb = nb;
  p.nv_cand = nv_cand;
  p.G = G;
  p.slots = a->slots;
  p.Hq = Hq;
  p.nf_v = a->num_sinks < nv_cand ? a->num_sinks : nv_cand;
  p.nf_s = a->window < N ? a->window : N;
  p.col = a->col;
  p.diag = a->diag;
  p.sscore = (double *)(base + o_sscore);
  p.heads = (const sel::Head *)dev_heads;
  p.verticals = (int64_t *)(base + o_vert);
  p.tokens = (int64_t *)(base + o_tok);
  p.bitmap = (uint8_t *)(base + o_bits);
  p.diags = (int32_t *)(base + o_diag);
  p.counts = (int32_t *)(base + o_count);
  cudaStream_t str = (cudaStream_t)s->stream;
  static cuda_smem_attr_t attr;
  char who[96];
  snprintf(who, sizeof who, "select (top-p sorts of %lld)", (long long)sort_pow2);
  const int64_t sum_blocks = (int64_t)((hn + sel::kThreads - 1) / sel::kThreads);
  sel::slash_sums_kernel<<<(unsigned)(sum_blocks < 4096 ? sum_blocks : 4096), sel::kThreads, 0,
                           str>>>(p);
  st = cuda_check_launch("slash_sums_kernel");
  if (!st)
    st = cuda_prepare_launch(s, (const void *)sel::select_kernel, who, "select_kernel", 2 * Hq, 1,
                             smem, &attr);
  if (!st) {
    sel::select_kernel<<<(unsigned)(2 * Hq), sel::kThreads, smem, str>>>(p);
    st = cuda_check_launch("select_kernel");
  }
  /* the counts (pairs: verticals, diagonals), then each head's kept
   * verticals and block diagonals */
  int32_t *pairs = NULL;
  if (!st) {
    pairs = (int32_t *)malloc(sizeof(int32_t) * 2 * (size_t)Hq);
    if (!pairs) st = mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cuda select: out of host memory");
  }
  if (!st)
    st = cuda_check(cudaMemcpyAsync(pairs, p.counts, sizeof(int32_t) * 2 * (size_t)Hq,
                                    cudaMemcpyDeviceToHost, str),
                    "select counts to the host");
  if (!st) st = cuda_check(cudaStreamSynchronize(str), "select (wait for the counts)");
  for (int32_t h = 0; h < Hq && !st; h++) {
    a->num_verticals[h] = pairs[2 * h];
    a->num_diagonals[h] = pairs[2 * h + 1];
  }
  free(pairs);
  for (int32_t h = 0; h < Hq && !st; h++) {
    const size_t nv = (size_t)a->num_verticals[h], nd = (size_t)a->num_diagonals[h];
    if (nv)
      st = cuda_check(cudaMemcpyAsync(a->verticals + (size_t)h * N, p.verticals + (size_t)h * N,
                                      nv * sizeof(int64_t), cudaMemcpyDeviceToHost, str),
                      "selected verticals to the host");
    if (!st && nd)
      st = cuda_check(cudaMemcpyAsync(a->diagonals + (size_t)h * (nb + 1),
                                      p.diags + (size_t)h * (nb + 1), nd * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, str),
                      "selected diagonals to the host");
  }
  if (!st) st = cuda_check(cudaStreamSynchronize(str), "select (wait for the pattern)");
  mtrain_status_t st2 = cuda_step_release(s, slot);
  return st ? st : st2;
}
