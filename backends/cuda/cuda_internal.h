/* cuda_internal.h (private): the CUDA backend's state, the device-side copy
 * of one plan step that every attention kernel reads, the launch checks and
 * grid sizes that every kernel uses, and the entry points of variant 0 and
 * of the element-wise kernels (variants 2 and 3: attn_mma2.h,
 * attn_wgmma.h; the development variant 1: dev/attn_mma1.h). Included by
 * the C files and the .cu files (plain C types only; no CUDA headers here).
 *
 * Work decomposition shared by every variant (SPEC.md sections 1 and 4):
 *  - forward and dQ are query-major: one work item per (query head h, local
 *    query block qb) walks qb's runs of key blocks (causal mask on the block
 *    whose global index equals qb's, only where cuda_step_t.causal is 1: a
 *    non-causal plan lists blocks on both sides of the diagonal and masks
 *    none) and then its bar segments (gathered key rows bars[b], never
 *    masked: the plan puts bars before the diagonal);
 *  - dK/dV of the runs are key-major: one item per (kv head hk, local key
 *    block kb) walks the (h, qb) entries that list kb, h in hk's group, in a
 *    fixed order, and adds to dk_acc/dv_acc rows it alone owns; variants 2
 *    and 3 cut an item of many entries (a "sink" key block listed by every
 *    query block) into parts of consecutive entries that write scratch
 *    rows, added into the item's rows in part order afterwards (cuda_step_t
 *    kv_work; CUDA_KERNELS.md "Long key-major items split");
 *  - dK/dV of the bars: one item per (head h, tile of CUDA_BAR_TILE bars of
 *    h) walks the (qb, lo, hi) entries of query blocks whose segments meet
 *    the tile and WRITES the tile's rows of a per-step scratch
 *    (bar_base[h] + b); the dispatcher then adds the scratch into
 *    dk_acc/dv_acc group position by group position (deterministic).
 * Padding rows and columns (mtrain_block_rows) never take part. The
 * tensor-core kernels run one CTA per item: cuda_q_items and cuda_kv_items
 * below count their grids, q_item_begin and kv_item_begin
 * (attn_mma2_common.cuh) decode a CTA's item. */
#ifndef MTRAIN_CUDA_INTERNAL_H
#define MTRAIN_CUDA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CUDA_BAR_TILE 64
#define CUDA_STAGE_SLOTS 4      /* staging slots made at init */
#define CUDA_STAGE_SLOTS_MAX 16 /* more are added while all are in use (never waits below) */
#define CUDA_DEFERRED_MAX 32    /* deferred scans in flight (stream-ordered mode) */

/* Per-head offsets into cuda_step_t.idx (int32 units) and sizes. */
enum {
  CUDA_HM_RUN_OFF = 0, /* [num_q_blocks + 1] */
  CUDA_HM_RUNS = 1,    /* [2 * num_runs] local key block ranges [b0, b1) */
  CUDA_HM_SEG_OFF = 2, /* [num_q_blocks + 1] */
  CUDA_HM_SEGS = 3,    /* [2 * num_segs] bar index ranges [s0, s1) */
  CUDA_HM_BARS = 4,    /* [num_bars] local key positions */
  CUDA_HM_NUM_BARS = 5,
  CUDA_HM_BAR_BASE = 6, /* sum of num_bars of heads before h */
  CUDA_HM_STRIDE = 8
};

/* One plan step in device memory (all pointers device pointers into one
 * staging allocation, valid while the step's kernels run). */
typedef struct cuda_step {
  int32_t G, Hq, Hkv, group, d;
  int32_t num_q_blocks, num_k_blocks;
  int32_t causal; /* 1: the token-level mask j <= i on the diagonal block (the
                     key block whose global index is the query block's); 0: a
                     non-causal plan, no mask but the keys past seq_len */
  int64_t seq_len, q_tokens, k_tokens;
  float scale;                   /* softmax scale */
  const int64_t *q_block_global; /* [num_q_blocks] */
  const int64_t *k_block_global; /* [num_k_blocks] */
  const int32_t *head_meta;      /* [Hq * CUDA_HM_STRIDE] */
  const int32_t *idx;            /* the per-head arrays */
  /* backward only (NULL/0 in the forward) */
  const int32_t *kv_off;  /* [Hkv * num_k_blocks + 1] entry ranges of (hk, kb) */
  const int32_t *kv_ent;  /* [2 * n] (h, qb), h ascending then qb ascending */
  const int32_t *bt_tile; /* [3 * num_bar_tiles] (h, b0, b1): bars [b0, b1) of head h */
  const int32_t *bt_off;  /* [num_bar_tiles + 1] */
  const int32_t *bt_ent;  /* [3 * n] (qb, lo, hi): qb's segments cover bars [lo, hi) */
  int32_t num_bar_tiles;
  int32_t total_bars;        /* sum over heads of num_bars (scratch rows) */
  int32_t max_runs_per_item; /* informational */
  /* backward of variants 2 and 3 only (NULL otherwise: one CTA per bar or
   * run item over its whole entry range): the work list of the long-item
   * split (kv_split_schedule_kernel, attn_mma2_bwd.cu), written on the device
   * before the key-major launch: [0] parts, [1] scratch slots, [2] chunk C,
   * [3] split items, then per part (item, e0, e1, slot), item < num_bar_tiles
   * a bar tile, else num_bar_tiles + the run item */
  const int32_t *kv_work;
  float *kv_dk_part, *kv_dv_part; /* [slots * BN, d] fp32: the split parts' rows */
} cuda_step_t;

/* The long-item split of the key-major backward (variants 2 and 3; see
 * CUDA_KERNELS.md "Long key-major items split"): an item, bar or run, of more
 * than C entries is walked by ceil(len / C) CTAs, C = max(C_MIN, ceil(W /
 * (2 SMs))), W = tiles per block x the step's run entries + the bar items'
 * entries. C_MIN is CUDA_KV_SPLIT_MIN unless MTRAIN_CUDA_KV_SPLIT_CHUNK says
 * otherwise (cuda_state_t.kv_split_min). */
#define CUDA_KV_SPLIT_MIN 8
#define CUDA_KV_WORK_HEADER 4 /* int32 header of the work list */

/* Host staging of step metadata: pinned host + device buffers in a ring of
 * slots (CUDA_STAGE_SLOTS at first, up to CUDA_STAGE_SLOTS_MAX), each guarded
 * by an event recorded after the kernels that read it. */
typedef struct cuda_stage_slot {
  void *host;
  void *dev;
  size_t cap;
  void *event; /* cudaEvent_t */
} cuda_stage_slot_t;

/* One deferred NaN/Inf scan of a stream-ordered call: the scan's result is
 * copied to pinned host memory (cuda_state_t.deferred_host[i]) behind
 * `event`; `what` and the geometry turn a finding into the message. */
typedef struct cuda_deferred {
  void *event; /* cudaEvent_t */
  int pending;
  int64_t row0, row_width, head_dim;
  char what[512];
} cuda_deferred_t;

typedef struct cuda_state {
  int device;
  void *stream;     /* cudaStream_t in use */
  void *own_stream; /* the backend's own stream */
  int variant;      /* mtrain_cuda_variant_t requested */
  int last_variant; /* the variant the last step ran */
  int deterministic;
  int mma2_config;          /* variant 2's tile configuration (MTRAIN_CUDA_MMA2_CONFIG) */
  int wgmma_bwd;            /* variant 3's backward kernel: 1 or 2 (MTRAIN_CUDA_WGMMA_BWD) */
  int wgmma_fwd_persistent; /* variant 3's forward kernel: 1 persistent, 0 one CTA per item
                               (MTRAIN_CUDA_WGMMA_FWD_PERSISTENT) */
  /* read once from the device at init: */
  int num_sms;
  int cc_major, cc_minor; /* compute capability of the device */
  size_t max_smem_optin;  /* dynamic shared memory a block may opt in to */
  cuda_stage_slot_t slots[CUDA_STAGE_SLOTS_MAX];
  int num_slots; /* slots made so far */
  int next_slot;
  void *switch_event; /* cudaEvent_t: a new stream waits for the old one's work */
  /* stream-ordered mode (mtrain_cuda_set_async) */
  int async;
  cuda_deferred_t deferred[CUDA_DEFERRED_MAX];
  unsigned long long *deferred_host; /* pinned [CUDA_DEFERRED_MAX], made on first use */
  unsigned long long *deferred_dev;  /* device [CUDA_DEFERRED_MAX] */
  int deferred_next;                 /* the record to use next (the oldest) */
  void *scratch;                     /* device scratch for bar dK/dV (2 * total_bars * d floats) */
  size_t scratch_cap;
  int kv_split_min; /* C_MIN of the long-item split (MTRAIN_CUDA_KV_SPLIT_CHUNK) */
  void *kv_split;   /* device scratch of the split: work list, then the parts' rows */
  size_t kv_split_cap;
  void **timers; /* cudaEvent_t slots of timer_mark, created on demand */
  int num_timers;
} cuda_state_t;

/* Maps a CUDA runtime error (as int) to a status with a message naming what
 * failed; cudaErrorMemoryAllocation becomes MTRAIN_ERR_OUT_OF_MEMORY. */
mtrain_status_t cuda_check(int err, const char *what);
/* Checks the launch just queued (cudaGetLastError). */
mtrain_status_t cuda_check_launch(const char *kernel);

/* Devices whose kernel attributes are remembered (cuda_smem_attr_t). */
#define CUDA_MAX_DEVICES 64

/* The dynamic shared-memory limit a kernel has been raised to, per device
 * (0: not yet): a zero-initialised static next to the kernel's launch, so
 * that cudaFuncSetAttribute runs once per (kernel, device), not per launch. */
typedef struct cuda_smem_attr {
  int bytes[CUDA_MAX_DEVICES];
} cuda_smem_attr_t;

/* The checks before every attention and scores kernel launch, in one
 * place: a grid of grid_x x grid_y blocks within the device's limits (x <
 * 2^31, y < 2^16), `smem` bytes of dynamic shared memory within the opt-in
 * limit read at init; then the kernel's dynamic shared-memory limit raised
 * to `smem` on s->device unless *attr says it is already (attr NULL: the
 * kernel uses at most the default 48 KB). Errors name `who` and the kernel:
 * MTRAIN_ERR_NOT_SUPPORTED for the grid and the shared memory, the CUDA
 * error (cuda_check) for the attribute. */
mtrain_status_t cuda_prepare_launch(const cuda_state_t *s, const void *kernel, const char *who,
                                    const char *name, int64_t grid_x, int64_t grid_y, size_t smem,
                                    cuda_smem_attr_t *attr);

/* Blocks of a query-major launch over query tiles of bm rows (bm divides
 * G): one per (query tile, query head). */
static inline int64_t cuda_q_items(const cuda_step_t *st, int32_t bm) {
  return (int64_t)st->num_q_blocks * (st->G / bm) * st->Hq;
}

/* Blocks of a key-major launch over key items of bn keys (bn divides G):
 * one per bar tile first, then one per (key tile, kv head). */
static inline int64_t cuda_kv_items(const cuda_step_t *st, int32_t bn) {
  return (int64_t)st->num_k_blocks * (st->G / bn) * st->Hkv + st->num_bar_tiles;
}

/* Builds and uploads a step's metadata (backward lists when `backward`). */
mtrain_status_t cuda_step_upload(cuda_state_t *s, const mtrain_step_view_t *v, int32_t hkv,
                                 int32_t d, double scale, int backward, cuda_step_t *out,
                                 int *slot);
/* Marks the slot's metadata as in use by the kernels queued so far. */
mtrain_status_t cuda_step_release(cuda_state_t *s, int slot);

/* Variant 0 (SIMT): any call that the backend accepts (cuda_supports).
 * Every variant queues its kernels on s->stream. fwd: merges the step into
 * o_acc/lse_acc (fp32). bwd: adds dQ into dq_acc, the runs' dK/dV into
 * dk_acc/dv_acc, and WRITES every bar's dK/dV to dk_bar/dv_bar [total_bars,
 * d] fp32 (zero rows where a bar has no entries). */
mtrain_status_t cuda_simt_fwd(cuda_state_t *s, const cuda_step_t *st,
                              const mtrain_fwd_step_args_t *a);
mtrain_status_t cuda_simt_bwd(cuda_state_t *s, const cuda_step_t *st,
                              const mtrain_bwd_step_args_t *a, float *dk_bar, float *dv_bar);

/* Adds the bar scratch into dk_acc/dv_acc ([k_tokens, Hkv, d] fp32). */
mtrain_status_t cuda_bars_reduce(cuda_state_t *s, const cuda_step_t *st, const float *dk_bar,
                                 const float *dv_bar, float *dk_acc, float *dv_acc);

/* Elementwise and misc kernels (cuda_misc.cu). */
mtrain_status_t cuda_fwd_init(cuda_state_t *s, float *o_acc, float *lse_acc, int64_t rows,
                              int32_t heads, int32_t d);
/* The estimate's row statistics (the fill_f64 and row_sums_f64 slots). */
mtrain_status_t cuda_fill_f64(cuda_state_t *s, double *dst, double value, int64_t count);
mtrain_status_t cuda_row_sums_f64(cuda_state_t *s, const double *in, double *out, int64_t rows,
                                  int64_t cols);
mtrain_status_t cuda_add(cuda_state_t *s, void *dst, const void *src, mtrain_dtype_t dtype,
                         int64_t count);
mtrain_status_t cuda_convert(cuda_state_t *s, const void *src, mtrain_dtype_t src_dtype, void *dst,
                             mtrain_dtype_t dst_dtype, int64_t count);
mtrain_status_t cuda_find_nonfinite(cuda_state_t *s, const void *ptr, mtrain_dtype_t dtype,
                                    int64_t count, int64_t *bad_index);
/* Stream-ordered mode (cuda_deferred.c): the table's async, deferred_scan
 * and deferred_poll slots, and the release of the records' resources. */
int cuda_async_op(void *state);
mtrain_status_t cuda_deferred_scan_op(void *state, const void *ptr, mtrain_dtype_t dtype,
                                      int64_t count, int64_t row0, int64_t row_width,
                                      int64_t head_dim, const char *what);
mtrain_status_t cuda_deferred_poll_op(void *state, int blocking);
void cuda_deferred_free(cuda_state_t *s);
/* Queues a NaN/Inf scan on the state's stream: *first_dev (device memory)
 * is set to ~0, then to the index of the first non-finite element if any.
 * Does not wait. */
mtrain_status_t cuda_queue_nonfinite(cuda_state_t *s, const void *ptr, mtrain_dtype_t dtype,
                                     int64_t count, unsigned long long *first_dev);
mtrain_status_t cuda_permute(cuda_state_t *s, void *dst, const void *src, size_t row_bytes,
                             const int64_t *index, int64_t count, int64_t other_rows, int scatter);
mtrain_status_t cuda_bwd_delta(cuda_state_t *s, const void *o, const void *dout,
                               mtrain_dtype_t dtype, float *delta, int64_t rows, int32_t heads,
                               int32_t d);
mtrain_status_t cuda_pattern_scores(cuda_state_t *s, const mtrain_scores_args_t *a);
/* The pattern_scores_batch slot (cuda_scores.cu; pattern_scores is
 * cuda_pattern_scores above). */
mtrain_status_t cuda_pattern_scores_batch(cuda_state_t *s, const mtrain_scores_args_t *args,
                                          int32_t count);
/* The pattern_select and pattern_select_batch slots (cuda_select.cu). */
mtrain_status_t cuda_pattern_select(cuda_state_t *s, const mtrain_select_args_t *a);
mtrain_status_t cuda_pattern_select_batch(cuda_state_t *s, const mtrain_select_args_t *args,
                                          int32_t count);
/* The block scores of SPEC.md section 9 (the block_scores slot; cuda_block_scores.cu). */
mtrain_status_t cuda_block_scores(void *state, const mtrain_block_scores_args_t *a);

/* Device scratch of at least `bytes` (grown on demand, kept). */
mtrain_status_t cuda_scratch(cuda_state_t *s, size_t bytes, void **out);
/* The same for the long-item split's work list and part rows (a buffer of
 * its own: the bar scratch handed to the kernels stays valid). */
mtrain_status_t cuda_kv_split_scratch(cuda_state_t *s, size_t bytes, void **out);
/* C_MIN from MTRAIN_CUDA_KV_SPLIT_CHUNK (unset: CUDA_KV_SPLIT_MIN); an error
 * unless a positive integer. */
mtrain_status_t cuda_kv_split_min_from_env(int *out);
/* Staging of small host arrays to device (uses a stage slot). */
mtrain_status_t cuda_upload_small(cuda_state_t *s, const void *host, size_t bytes, void **dev,
                                  int *slot);
/* The same in two parts, for tables that hold their own device address:
 * reserve gives the slot and its device memory (at least `bytes`), commit
 * copies `host` into it and queues the upload. The caller releases the slot
 * (cuda_step_release) after the work that reads it, or on error. */
mtrain_status_t cuda_upload_reserve(cuda_state_t *s, size_t bytes, void **dev, int *slot);
mtrain_status_t cuda_upload_commit(cuda_state_t *s, int slot, const void *host, size_t bytes);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_CUDA_INTERNAL_H */
