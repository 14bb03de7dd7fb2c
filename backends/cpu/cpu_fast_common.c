/* cpu_fast_common.c: step input preparation for the fast CPU path (fp32
 * widening, bar gathering) and OpenBLAS thread control. */
#include <cblas.h>
#include <pthread.h>
#include <stdlib.h>

#include "backends/cpu/cpu_fast_common.h"
#include "mtrain/mtrain_error.h"

/* OpenBLAS's thread controls (declared in its cblas.h on Debian; repeated
 * here so that other CBLAS headers work too). */
void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);

/* OpenBLAS's thread count is one setting for the whole process, and its
 * threaded sgemm is not safe to enter from several threads at once. So the
 * single-threaded sections of all contexts (ranks run as threads, or a
 * caller's threads with a context each) share one count: the first to enter
 * sets one thread, the last to leave restores what it found. Restoring per
 * caller let one context turn threading back on while another was still
 * calling sgemm from its OpenMP threads: the distributed block selection's
 * bitwise test then failed in 2 runs of 3 (2026-11-27). */
static pthread_mutex_t blas_lock = PTHREAD_MUTEX_INITIALIZER;
static int blas_users, blas_saved = 1;

int cpu_blas_single_begin(void) {
  pthread_mutex_lock(&blas_lock);
  if (blas_users++ == 0) {
    blas_saved = openblas_get_num_threads();
    if (blas_saved != 1) openblas_set_num_threads(1);
  }
  const int saved = blas_saved;
  pthread_mutex_unlock(&blas_lock);
  return saved;
}

void cpu_blas_single_end(int previous) {
  (void)previous;
  pthread_mutex_lock(&blas_lock);
  if (--blas_users == 0 && blas_saved != 1) openblas_set_num_threads(blas_saved);
  pthread_mutex_unlock(&blas_lock);
}

/* fp32 view of a buffer: borrowed when already fp32, else a widened copy. */
static const float *as_f32(cpu_state_t *s, const void *p, mtrain_dtype_t dtype, int64_t count,
                           void **owned) {
  *owned = NULL;
  if (dtype == MTRAIN_F32) return p;
  float *w = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
  if (!w) return NULL;
  if (mtrain_cpu_convert(s, p, dtype, w, MTRAIN_F32, count) != MTRAIN_SUCCESS) {
    free(w);
    return NULL;
  }
  *owned = w;
  return w;
}

void cpu_step_inputs_release(cpu_step_inputs_t *in) {
  for (int i = 0; i < 5; i++) free(in->owned[i]);
  if (in->kbar && in->view)
    for (int32_t h = 0; h < in->view->num_heads; h++) {
      free(in->kbar[h]);
      free(in->vbar[h]);
    }
  free(in->kbar);
  free(in->vbar);
  in->kbar = in->vbar = NULL;
}

mtrain_status_t cpu_step_inputs_prepare(cpu_state_t *s, const mtrain_step_view_t *v, int32_t hkv,
                                        int32_t d, mtrain_dtype_t dtype, const void *q,
                                        const void *k, const void *vv, const void *dout,
                                        cpu_step_inputs_t *in) {
  const int32_t Hq = v->num_heads, group = Hq / hkv;
  *in = (cpu_step_inputs_t){.view = v, .hkv = hkv, .d = d};
  in->ldq = (int64_t)Hq * d;
  in->ldk = (int64_t)hkv * d;
  in->q = as_f32(s, q, dtype, v->q_tokens * in->ldq, &in->owned[0]);
  in->k = as_f32(s, k, dtype, v->k_tokens * in->ldk, &in->owned[1]);
  in->v = as_f32(s, vv, dtype, v->k_tokens * in->ldk, &in->owned[2]);
  if (dout) in->dout = as_f32(s, dout, dtype, v->q_tokens * in->ldq, &in->owned[3]);
  in->kbar = calloc((size_t)Hq, sizeof *in->kbar);
  in->vbar = calloc((size_t)Hq, sizeof *in->vbar);
  int failed = !in->q || !in->k || !in->v || (dout && !in->dout) || !in->kbar || !in->vbar;
  for (int32_t h = 0; h < Hq && !failed; h++) {
    const mtrain_step_head_t *hd = &v->heads[h];
    if (hd->num_bars == 0) continue;
    in->kbar[h] = malloc(sizeof(float) * (size_t)hd->num_bars * d);
    in->vbar[h] = malloc(sizeof(float) * (size_t)hd->num_bars * d);
    if (!in->kbar[h] || !in->vbar[h]) {
      failed = 1;
      break;
    }
    const int64_t hk = h / group;
    for (int32_t b = 0; b < hd->num_bars; b++)
      for (int32_t c = 0; c < d; c++) {
        in->kbar[h][(int64_t)b * d + c] = in->k[hd->bars[b] * in->ldk + hk * d + c];
        in->vbar[h][(int64_t)b * d + c] = in->v[hd->bars[b] * in->ldk + hk * d + c];
      }
  }
  if (failed) {
    cpu_step_inputs_release(in);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "cpu backend: out of memory preparing a step");
  }
  return MTRAIN_SUCCESS;
}
