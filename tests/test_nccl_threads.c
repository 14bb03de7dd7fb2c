/* test_nccl_threads.c: one process driving every GPU of the host with a
 * thread each (no MPI): rank 0 makes the NCCL unique id, every thread
 * creates its rank with mtrain_comm_create_nccl on its own device and a
 * "cuda" context over it, and runs the striped ring forward and backward
 * (bf16, 16:2 heads, d 128, a budget-like vertical-slash pattern, N not a
 * multiple of G * W). Each thread's rows must equal the single-GPU result
 * (computed first on device 0) within 2^-7 of its largest value (the outputs
 * are bf16; the steps' merge order differs). Skips (exit 77) with fewer than
 * two GPUs. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_layout.h"
#include "mtrain/mtrain_nccl.h"

enum { HQ = 16, HKV = 2, D = 128, G = 128 };
static const int64_t N = 128 * 2 * 3 * 2 + 77;

static int world_;
static unsigned char id_[MTRAIN_NCCL_ID_BYTES];
static uint16_t *in_[4]; /* q k v dout, bf16, global */
static float *ref_[5];   /* o lse dq dk dv of the single-GPU run, as floats */
static mtrain_pattern_t *pattern_;
static mtrain_layout_t *layout_;

static int64_t width(int x) { /* 0..3 inputs q k v dout; 4.. outputs o lse dq dk dv */
  static const int64_t w[9] = {HQ * D, HKV * D, HKV * D, HQ * D, HQ * D,
                               HQ,     HQ * D,  HKV * D, HKV * D};
  return w[x];
}

static uint64_t mix(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Forward and backward of tokens T on device; outputs as floats in out[5]. */
static mtrain_status_t run(mtrain_context_t *ctx, const mtrain_plan_t *plan, uint16_t *const *in,
                           int64_t T, float **out) {
  void *dev[9] = {0};
  mtrain_status_t st = MTRAIN_SUCCESS;
  for (int x = 0; x < 9 && !st; x++)
    st = mtrain_cuda_malloc((size_t)(T * width(x)) * (x == 5 ? 4 : 2) + 16, &dev[x]);
  for (int x = 0; x < 4 && !st; x++)
    st = mtrain_cuda_memcpy_to_device(dev[x], in[x], (size_t)(T * width(x)) * 2);
  mtrain_tensor_t t[9];
  for (int x = 0; x < 9; x++)
    t[x] = x == 5 ? mtrain_tensor_2d(dev[x], MTRAIN_F32, T, HQ)
                  : mtrain_tensor_3d(dev[x], MTRAIN_BF16, T, width(x) / D, D);
  if (!st) st = mtrain_attention_forward(ctx, plan, &t[0], &t[1], &t[2], &t[4], &t[5]);
  if (!st)
    st = mtrain_attention_backward(ctx, plan, &t[0], &t[1], &t[2], &t[4], &t[5], &t[3], &t[6],
                                   &t[7], &t[8]);
  uint16_t *h = malloc((size_t)(T * HQ * D) * 4 + 16);
  for (int x = 4; x < 9 && !st; x++) {
    const mtrain_dtype_t dt = x == 5 ? MTRAIN_F32 : MTRAIN_BF16;
    st = mtrain_cuda_memcpy_to_host(h, dev[x], (size_t)(T * width(x)) * mtrain_dtype_size(dt));
    if (!st) st = mtrain_convert(h, dt, out[x - 4], MTRAIN_F32, T * width(x));
  }
  free(h);
  for (int x = 0; x < 9; x++) mtrain_cuda_free(dev[x]);
  return st;
}

static void *rank_main(void *arg) {
  const int rank = (int)(intptr_t)arg;
  intptr_t ok = 0;
  mtrain_comm_t *comm = NULL;
  mtrain_context_t *ctx = NULL;
  mtrain_plan_t *plan = NULL;
  const int64_t T = mtrain_layout_local_tokens(layout_, rank);
  int64_t *index = malloc(sizeof(int64_t) * (size_t)T);
  uint16_t *loc[4];
  float *out[5];
  for (int x = 0; x < 4; x++) loc[x] = calloc((size_t)(T * width(x)) + 8, 2);
  for (int x = 0; x < 5; x++) out[x] = calloc((size_t)(T * width(x + 4)) + 8, 4);
  mtrain_status_t st = mtrain_cuda_set_device(rank);
  if (!st) st = mtrain_comm_create_nccl(id_, world_, rank, rank, 120.0, &comm);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = G;
  if (!st) st = mtrain_context_create(&cfg, comm, &ctx);
  if (!st) st = mtrain_layout_rank_token_index(layout_, rank, index);
  if (!st)
    st = mtrain_plan_create_ring(ctx, NULL, (const mtrain_layout_t *const[]){layout_}, 0,
                                 (const mtrain_pattern_t *const[]){pattern_}, &plan);
  for (int64_t i = 0; !st && i < T; i++)
    for (int x = 0; x < 4 && index[i] < N; x++)
      memcpy(loc[x] + i * width(x), in_[x] + index[i] * width(x), (size_t)width(x) * 2);
  if (!st) st = run(ctx, plan, loc, T, out);
  if (st) {
    printf("  rank %d: %s: %s\n", rank, mtrain_status_name(st), mtrain_last_error());
  } else {
    static const char *names[5] = {"o", "lse", "dq", "dk", "dv"};
    ok = 1;
    for (int x = 0; x < 5; x++) {
      const int64_t w = width(x + 4);
      double err = 0, big = 0;
      for (int64_t i = 0; i < T; i++)
        for (int64_t c = 0; c < w && index[i] < N; c++) {
          const double g = ref_[x][index[i] * w + c], l = out[x][i * w + c];
          if (!(fabs(l - g) <= err)) err = isnan(l) ? INFINITY : fabs(l - g);
          if (fabs(g) > big) big = fabs(g);
        }
      if (!(err <= big / 128)) {
        ok = 0;
        printf("  rank %d: %s differs from one GPU: %.3g (bound %.3g)\n", rank, names[x], err,
               big / 128);
      }
    }
  }
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(ctx);
  mtrain_comm_destroy(comm);
  for (int x = 0; x < 4; x++) free(loc[x]);
  for (int x = 0; x < 5; x++) free(out[x]);
  free(index);
  return (void *)ok;
}

int main(void) {
  world_ = mtrain_cuda_device_count();
  if (world_ < 2) {
    printf("SKIPPED: one process driving several GPUs needs two or more (%d visible)\n", world_);
    return 77;
  }
  if (world_ > 8) world_ = 8;
  uint64_t s = 2024;
  for (int x = 0; x < 4; x++) {
    in_[x] = malloc((size_t)(N * width(x)) * 2);
    for (int64_t i = 0; i < N * width(x); i++)
      in_[x][i] = mtrain_float_to_bf16((float)((double)(mix(&s) >> 11) * 0x1.0p-52 - 1.0));
  }
  for (int x = 0; x < 5; x++) ref_[x] = malloc((size_t)(N * width(x + 4)) * 4);
  /* a budget-like vertical-slash pattern */
  mtrain_pattern_create(N, HQ, G, &pattern_);
  const int64_t nb = (N + G - 1) / G;
  int32_t *dg = malloc(sizeof(int32_t) * (size_t)nb);
  int64_t *vt = malloc(sizeof(int64_t) * (size_t)N);
  for (int h = 0; h < HQ; h++) {
    int32_t nd = 0, nv = 0;
    for (int64_t t = 0; t < nb; t++)
      if (t < 2 || (mix(&s) & 7) == 0) dg[nd++] = (int32_t)t;
    for (int64_t j = 0; j < N; j++)
      if (j < 16 || (mix(&s) % 50) == 0) vt[nv++] = j;
    mtrain_pattern_set_head(pattern_, h, dg, nd, vt, nv);
  }
  free(dg);
  free(vt);
  /* the single-GPU result on device 0 */
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = G;
  mtrain_context_t *one = NULL;
  mtrain_plan_t *plan = NULL;
  const mtrain_pattern_t *pats[1] = {pattern_};
  mtrain_status_t st = mtrain_cuda_set_device(0);
  if (!st) st = mtrain_context_create(&cfg, NULL, &one);
  if (!st) st = mtrain_plan_create(one, NULL, pats, &plan);
  if (!st) st = run(one, plan, in_, N, ref_);
  mtrain_plan_destroy(plan);
  mtrain_context_destroy(one);
  if (!st) st = mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, N, G, world_, NULL, &layout_);
  if (!st) st = mtrain_nccl_unique_id(id_);
  if (st) {
    printf("FAILED: set-up: %s: %s\n", mtrain_status_name(st), mtrain_last_error());
    return 1;
  }
  pthread_t th[8];
  for (int r = 0; r < world_; r++) pthread_create(&th[r], NULL, rank_main, (void *)(intptr_t)r);
  int all = 1;
  for (int r = 0; r < world_; r++) {
    void *ok = NULL;
    pthread_join(th[r], &ok);
    all = all && ok;
  }
  printf("%s: %d GPUs driven by threads of one process, striped ring, bf16, N=%lld\n",
         all ? "passed" : "FAILED", world_, (long long)N);
  mtrain_layout_destroy(layout_);
  mtrain_pattern_destroy(pattern_);
  for (int x = 0; x < 4; x++) free(in_[x]);
  for (int x = 0; x < 5; x++) free(ref_[x]);
  return all ? 0 : 1;
}
