/* cpu_fast_common.h (private): what the fast CPU forward and backward steps
 * share: the step's inputs widened to fp32 (or borrowed when already fp32),
 * the per-head gathered bar rows, tile operand lookup and OpenBLAS thread
 * control (one BLAS thread per OpenMP thread inside a step). */
#ifndef MTRAIN_CPU_FAST_COMMON_H
#define MTRAIN_CPU_FAST_COMMON_H

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_tiles.h"

/** Columns per score tile. */
#define MTRAIN_CPU_TILE 256
/** Query rows per work item at most: a query block of more rows (granularity
 *  above this) is computed in chunks of this many rows, so the per-thread
 *  buffers ([rows x TILE] scores, [rows x d] outputs) do not grow with the
 *  granularity and every granularity the configuration accepts is computed. */
#define MTRAIN_CPU_ROWS 256

/** First masked column of row r (of a chunk starting at row0 of the query
 *  block) in a causal tile: columns c with diag_col + c > row0 + r are above
 *  the diagonal. Returns a value in [0, n]. */
static inline int32_t cpu_causal_first_masked(const cpu_tile_t *t, int32_t row0, int32_t r,
                                              int32_t n) {
  const int64_t c = (int64_t)row0 + r - t->diag_col + 1;
  return c < 0 ? 0 : c > n ? n : (int32_t)c;
}

typedef struct cpu_step_inputs {
  const mtrain_step_view_t *view;
  int32_t hkv, d;
  const float *q, *k, *v, *dout; /* fp32 views, token-major */
  int64_t ldq, ldk;              /* row strides: Hq*d and Hkv*d */
  float **kbar, **vbar;          /* [Hq] gathered bar rows, [num_bars x d] */
  void *owned[5];                /* widened copies to free */
} cpu_step_inputs_t;

/** Widens q, k, v (and dout when not NULL) to fp32 and gathers bar rows. */
mtrain_status_t cpu_step_inputs_prepare(cpu_state_t *s, const mtrain_step_view_t *view, int32_t hkv,
                                        int32_t d, mtrain_dtype_t dtype, const void *q,
                                        const void *k, const void *v, const void *dout,
                                        cpu_step_inputs_t *out);
void cpu_step_inputs_release(cpu_step_inputs_t *in);

/** K and V operands of a tile for head h (kv head hk), with their row stride. */
static inline void cpu_tile_operands(const cpu_step_inputs_t *in, int32_t h, int32_t hk,
                                     const cpu_tile_t *t, const float **k, const float **v,
                                     int64_t *ld) {
  if (t->is_bar) {
    *k = in->kbar[h] + t->first * in->d;
    *v = in->vbar[h] + t->first * in->d;
    *ld = in->d;
  } else {
    *k = in->k + t->first * in->ldk + (int64_t)hk * in->d;
    *v = in->v + t->first * in->ldk + (int64_t)hk * in->d;
    *ld = in->ldk;
  }
}

/** 1 where the AVX-512 forward kernels (cpu_fwd_avx512.c) are built: x86-64
 *  with gcc or clang (the target attribute), unless MTRAIN_NO_AVX512_KERNELS
 *  is defined (a build to test the OpenBLAS path on an AVX-512 machine). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) &&                            \
    !defined(MTRAIN_NO_AVX512_KERNELS)
#define MTRAIN_CPU_HAVE_AVX512 1
#else
#define MTRAIN_CPU_HAVE_AVX512 0
#endif

/** Per-thread buffers of the AVX-512 forward item, all 64-byte aligned, for
 *  rp = rows rounded up to 32 (at most MTRAIN_CPU_ROWS rounded up). */
typedef struct cpu_fwd_avx512_ws {
  float *qt;   /* [d][rp] scaled queries, transposed */
  float *ot;   /* [d][rp] unnormalised output, transposed */
  float *orow; /* [rp][d] the same by rows, the item's result */
  float *st;   /* [MTRAIN_CPU_TILE][32] one slab of scores / probabilities */
  float *m;    /* [rp] running max, the item's result */
  float *l;    /* [rp] running sum, the item's result */
} cpu_fwd_avx512_ws_t;

/** 1 when the AVX-512 forward kernels can run here (built, and the processor
 *  has AVX-512F). */
int cpu_fwd_avx512_available(void);

/** The forward of one work item with the AVX-512 kernels: head h (kv head
 *  hk), query block qb, its rows [row0, row0 + nr), nr <= MTRAIN_CPU_ROWS,
 *  into ws->orow, ws->m and ws->l. Only where cpu_fwd_avx512_available(). */
void cpu_fwd_avx512_item(const cpu_step_inputs_t *in, int32_t h, int32_t hk, int32_t qb,
                         int32_t row0, int32_t nr, float scale, cpu_fwd_avx512_ws_t *ws);

/** Enters a section that calls OpenBLAS from OpenMP threads: OpenBLAS runs
 *  single-threaded until the last such section of the process ends (a
 *  process-wide count under a mutex; thread-safe). Returns the thread count
 *  found by the first to enter; cpu_blas_single_end takes it back. */
int cpu_blas_single_begin(void);
void cpu_blas_single_end(int previous);

#endif /* MTRAIN_CPU_FAST_COMMON_H */
