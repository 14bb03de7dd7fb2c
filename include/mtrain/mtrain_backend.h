/* mtrain_backend.h: the backend table, for authors of backends.
 *
 * A backend is a const table of function pointers plus an opaque state. The
 * core reaches it only through checked wrappers (core/runtime/backend.c); it never
 * contains kernel math, and backends never contain schedule logic: a backend
 * computes exactly the (query, key) pairs a plan step view lists.
 *
 * Memory passed to a backend is the backend's memory space (host for CPU
 * backends, device for CUDA). "acc" buffers have the backend's accumulator
 * dtype (fp32 for fast backends, fp64 for the cpu-ref oracle).
 */
#ifndef MTRAIN_BACKEND_H
#define MTRAIN_BACKEND_H

#include "mtrain.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The plan of one ring step for one head (SPEC.md section 4), compact:
 *  - key blocks of local query block qb: runs [runs[2r], runs[2r+1]) of local
 *    key blocks of the chunk, r in [run_off[qb], run_off[qb+1]);
 *  - bar columns of qb: bars[b] for b in [segs[2s], segs[2s+1]),
 *    s in [seg_off[qb], seg_off[qb+1]); bars are local key positions of the
 *    chunk, increasing. Segments of one query block are disjoint.
 *  A key block whose global index equals the query block's global index is
 *  the causal diagonal block: mask j > i there (only where the step view's
 *  `causal` is 1; a non-causal step computes every pair of its blocks). Rows
 *  and columns whose global position is >= seq_len (padding) never take part. */
typedef struct mtrain_step_head {
  const int32_t *run_off;
  const int32_t *runs;
  const int32_t *seg_off;
  const int32_t *segs;
  const int32_t *bars;
  int32_t num_runs;
  int32_t num_segs;
  int32_t num_bars;
} mtrain_step_head_t;

/** One ring step of one sequence on this rank. */
typedef struct mtrain_step_view {
  int32_t step;     /**< ring step index */
  int32_t src_rank; /**< rank the K/V chunk in hand originated on */
  int32_t granularity;
  int32_t num_heads; /**< query heads */
  int64_t seq_len;   /**< global length N of the sequence */
  int64_t q_tokens;  /**< local query tokens of this sequence on this rank */
  int64_t k_tokens;  /**< tokens of the chunk in hand */
  int32_t num_q_blocks;
  int32_t num_k_blocks;
  const int64_t *q_block_global;   /**< [num_q_blocks] global block of each local q block */
  const int64_t *k_block_global;   /**< [num_k_blocks] global block of each chunk key block */
  const mtrain_step_head_t *heads; /**< [num_heads]; NULL in a plan built on the device */
  int32_t causal; /**< 1: mask j > i in diagonal blocks; 0: non-causal (block masks only) */
  /** NULL, or (a plan built on the device, mtrain_plan_create_estimated) the
   *  backend's handle of the batch's device-built tables (device_plan_build):
   *  `heads` is then NULL and the backend computes sequence `device_seq` of
   *  that handle; the view's other fields still describe the step. */
  const void *device_tables;
  int32_t device_seq;
} mtrain_step_view_t;

/** Number of valid rows of local block lb of a side with `tokens` local
 *  tokens whose global block is gb (padding and the partial tail excluded). */
static inline int32_t mtrain_block_rows(int64_t tokens, int32_t granularity, int32_t lb, int64_t gb,
                                        int64_t seq_len) {
  int64_t local_left = tokens - (int64_t)lb * granularity;
  int64_t global_left = seq_len - gb * granularity;
  int64_t n = local_left < global_left ? local_left : global_left;
  if (n > granularity) n = granularity;
  return n < 0 ? 0 : (int32_t)n;
}

typedef struct mtrain_fwd_step_args {
  const mtrain_step_view_t *view;
  int32_t num_kv_heads;
  int32_t head_dim;
  double scale;
  mtrain_dtype_t dtype; /**< storage dtype of q, k, v */
  const void *q;        /**< [q_tokens, Hq, d] */
  const void *k;        /**< [k_tokens, Hkv, d] */
  const void *v;        /**< [k_tokens, Hkv, d] */
  void *o_acc;          /**< [q_tokens, Hq, d] acc dtype, running output (normalised) */
  void *lse_acc;        /**< [q_tokens, Hq] acc dtype, running LSE (-inf = no key yet) */
} mtrain_fwd_step_args_t;

typedef struct mtrain_bwd_step_args {
  const mtrain_step_view_t *view;
  int32_t num_kv_heads;
  int32_t head_dim;
  double scale;
  mtrain_dtype_t dtype;  /**< storage dtype of q, k, v, dout */
  const void *q;         /**< [q_tokens, Hq, d] */
  const void *k;         /**< [k_tokens, Hkv, d] */
  const void *v;         /**< [k_tokens, Hkv, d] */
  const void *dout;      /**< [q_tokens, Hq, d] */
  const void *lse_acc;   /**< [q_tokens, Hq] acc dtype: the final LSE */
  const void *delta_acc; /**< [q_tokens, Hq] acc dtype: rowsum(dout * o) */
  void *dq_acc;          /**< [q_tokens, Hq, d] acc dtype, accumulated */
  void *dk_acc;          /**< [k_tokens, Hkv, d] acc dtype, accumulated (travels with the chunk) */
  void *dv_acc;          /**< [k_tokens, Hkv, d] acc dtype, accumulated */
} mtrain_bwd_step_args_t;

/** Stages of the pattern scores (SPEC.md section 2). A = scale * q_last k^T
 *  over the last L queries (global positions N-L..N-1) and the chunk's keys,
 *  masked causally (key position <= query position; padding keys never
 *  count). Every output is indexed by GLOBAL key position or block, so the
 *  partial results of several ranks combine exactly by summation (each entry
 *  has one contributor). */
typedef enum mtrain_scores_stage {
  /** row_out[h*L + r] = max over the chunk's causal keys of A (-inf if none). */
  MTRAIN_SCORES_ROW_MAX = 0,
  /** row_out[(h*L + r)*nb + gb] = sum over the chunk's causal keys j of global
   *  block gb, in key order, of exp(A - row_max[h*L + r]); nb = ceil(N/G). */
  MTRAIN_SCORES_ROW_BLOCK_SUMS = 1,
  /** For each head, the score matrix is A itself (probs[h] == 0) or
   *  exp(A - row_max) / row_norm / L (probs[h] == 1). Writes
   *  col_out[h*N + j] = sum over rows r (ascending) of score[r, j] for the
   *  chunk's keys j, and diag_out[(h*N + t)*S + (b - b0(t))] = sum over rows r
   *  (ascending) with key j = N-L+r-t in global block b of score[r, j], where
   *  b0(t) = max(0, N-L-t) / G and S = mtrain_scores_slots(L, G). */
  MTRAIN_SCORES_SUMS = 2,
} mtrain_scores_stage_t;

/** Number of key blocks one token diagonal of L rows can span. */
static inline int32_t mtrain_scores_slots(int32_t last_q, int32_t granularity) {
  return (last_q + granularity - 1) / granularity + 1;
}

typedef struct mtrain_scores_args {
  mtrain_scores_stage_t stage;
  int64_t seq_len;     /**< N */
  int32_t last_q;      /**< L (<= N) */
  int32_t granularity; /**< G */
  int32_t num_heads, num_kv_heads, head_dim;
  double scale;
  mtrain_dtype_t dtype;   /**< storage dtype of k */
  mtrain_dtype_t q_dtype; /**< storage dtype of q_last (fp32 when gathered from ranks) */
  const void *q_last;     /**< [L, Hq, d] */
  const void *k;          /**< [k_tokens, Hkv, d] the keys this rank holds */
  int64_t k_tokens;
  int32_t num_k_blocks;
  const int64_t *k_block_global; /**< [num_k_blocks] global block of each local key block */
  const uint8_t *probs;          /**< [Hq] host flags: 1 = top-p head (probabilities) */
  const double *row_max;         /**< [Hq*L] global row max (stages 1 and 2 with probs) */
  const double *row_norm;        /**< [Hq*L] global sum of exp(A - row_max) (stage 2 with probs) */
  double *row_out;               /**< stages 0 and 1 (overwritten where this chunk contributes) */
  double *col_out;               /**< stage 2, zero-initialised by the caller, [Hq*N] */
  double *diag_out;              /**< stage 2, zero-initialised by the caller, [Hq*N*S] */
} mtrain_scores_args_t;

/** The state of one strided row (SPEC.md 9.2) between the passes of the
 *  antidiagonal method's key-chunk form (mtrain_block_scores_args_t
 *  antidiag_pass): the row maximum and its normaliser as an exact
 *  fixed-point sum. The core sets max to -infinity and the rest to zero
 *  before pass 1; only the backend reads or changes it after that. */
typedef struct mtrain_antidiag_row {
  double max;    /**< pass 1: the largest X(a, c) of the defined columns seen (-inf: none) */
  uint64_t z[3]; /**< pass 2: the sum of exp(X - max) in units of 2^-128, z[0] lowest */
  uint64_t nan;  /**< pass 2: 1 when a term was NaN (the normaliser is then NaN) */
} mtrain_antidiag_row_t;

/** Bits of mtrain_backend_ops_t.block_scores_key_chunks: which methods the
 *  block_scores slot scores from key chunks (k_block_global). */
#define MTRAIN_BLOCK_CHUNKS_SUMS 1     /**< precise and meanpool (one call per chunk) */
#define MTRAIN_BLOCK_CHUNKS_ANTIDIAG 2 /**< antidiag: three passes (antidiag_pass 1, 2, 3) */

/** The block scores of SPEC.md section 9 (the optional block_scores slot).
 *  nb = ceil(N/G); the scores of a head form a lower triangle: the entry of
 *  (query block qb, key block kb <= qb) of head h is
 *  scores[h * tri + qb * (qb + 1) / 2 + kb], tri = nb * (nb + 1) / 2, when
 *  scores_row is NULL. With scores_row (the compact form the core uses since
 *  API version 5), the row of local block lb (its gb + 1 entries, gb its
 *  global block) of head h starts at scores[h * scores_head_stride +
 *  scores_row[lb]]: only this rank's rows are held. The slot writes the rows
 *  of this rank's query blocks (global index < nb) and leaves every other
 *  entry as it found it (the caller zeroes the buffer). Each entry is
 *  computed from its own query block and the keys alone, in the order the
 *  spec gives: the same bits whichever rank computes it, in either form. */
typedef struct mtrain_block_scores_args {
  mtrain_block_method_t method;
  int64_t seq_len;     /**< N */
  int32_t granularity; /**< G */
  int32_t num_heads, num_kv_heads, head_dim;
  double scale;
  int32_t stride;                /**< antidiag: S, divides G */
  mtrain_dtype_t q_dtype;        /**< storage dtype of q */
  const void *q;                 /**< [q_tokens, Hq, d] this rank's query slots */
  int64_t q_tokens;              /**< local query slots */
  int32_t num_q_blocks;          /**< local query blocks */
  const int64_t *q_block_global; /**< [num_q_blocks] host: global block of each local block */
  mtrain_dtype_t k_dtype;        /**< storage dtype of k */
  const void *k;                 /**< [N, Hkv, d] every key of the sequence, in global order */
  mtrain_dtype_t lse_dtype;      /**< precise: fp32 or fp64 */
  const void *lse;               /**< precise: [q_tokens, Hq], the rows of q */
  double *scores;                /**< fp64, backend memory: [Hq * tri], or with scores_row
                                      [Hq * scores_head_stride] */
  const int64_t *scores_row;     /**< NULL, or [num_q_blocks] host: the offset of each local
                                      block's row within a head (padding blocks: unused) */
  int64_t scores_head_stride;    /**< with scores_row: doubles per head */
  /** NULL: k holds all N keys in global order. Else (a backend with
   *  block_scores_key_chunks for the method) k holds one chunk of key
   *  blocks: [k_tokens, Hkv, d], its G-slot block x being global key block
   *  k_block_global[x] (host; >= nb: padding), and only the entries (qb, kb)
   *  of these key blocks are written, each with the same bits as from all
   *  keys: the ring pass of the distributed selection. The antidiagonal
   *  method takes three ring passes (antidiag_pass). */
  const int64_t *k_block_global;
  int32_t num_k_blocks; /**< with k_block_global: key blocks in k */
  int64_t k_tokens;     /**< with k_block_global: key slots in k */
  /** 0: causal scores as above. 1 (only given to a backend that sets
   *  block_scores_noncausal): the non-causal scores of SPEC.md section 9.7,
   *  every key block kb < nb of every row over all its keys; the row of
   *  query block gb then holds nb entries (scores[h * nb * nb + gb * nb +
   *  kb] without scores_row; with it, nb entries from scores_row[lb]). */
  int32_t noncausal;
  /** antidiag with k_block_global (MTRAIN_BLOCK_CHUNKS_ANTIDIAG): 1 folds
   *  the chunk's columns into the row maxima of row_state, 2 adds their
   *  exp(X - max) to the exact normalisers, 3 adds their P(a, c) = exp(X -
   *  max) / Z to the scores (SPEC.md 9.6); scores are written in pass 3
   *  only. The core runs pass p over every chunk before pass p + 1. 0
   *  without k_block_global (k holds every key: all at once). */
  int32_t antidiag_pass;
  /** with antidiag_pass: host [Hq * num_q_blocks * (G / S)], the strided
   *  row r of local block lb of head h at (h * num_q_blocks + lb) * (G / S)
   *  + r. */
  mtrain_antidiag_row_t *row_state;
} mtrain_block_scores_args_t;

/** The vertical-slash selection of SPEC.md section 2 on the backend (the
 *  optional pattern_select slot): from the final column and slash scores in
 *  the backend's memory (the pattern_scores stage MTRAIN_SCORES_SUMS of one
 *  rank that holds every key) to every head's verticals and block diagonals
 *  in host memory, bitwise what the host selection (core/runtime/select.c)
 *  gives for the same scores. The slot returns MTRAIN_ERR_NOT_SUPPORTED,
 *  having queued nothing, for budgets it cannot select (the caller then
 *  selects on the host); otherwise it waits for its results. */
typedef struct mtrain_select_args {
  int64_t seq_len;     /**< N */
  int32_t granularity; /**< G */
  int32_t num_heads;   /**< Hq */
  int32_t slots;       /**< S = mtrain_scores_slots(L, G) */
  int32_t num_sinks;   /**< top-k (top-p with top_p_forced): the first num_sinks vertical
                            candidates are forced */
  int32_t window;      /**< top-k (top-p with top_p_forced): token diagonals 0..window-1
                            are forced */
  const mtrain_head_budget_t *budgets; /**< host [Hq] */
  const double *col;                   /**< backend memory [Hq * N] column scores */
  const double *diag;                  /**< backend memory [Hq * N * S] slash partial sums */
  int64_t *verticals;     /**< host [Hq * N]: head h's kept key columns, increasing, at h * N */
  int32_t *num_verticals; /**< host [Hq] */
  int32_t *diagonals;     /**< host [Hq * (nb + 1)], nb = ceil(N / G): head h's block
                               diagonals, increasing, at h * (nb + 1) */
  int32_t *num_diagonals; /**< host [Hq] */
  /** 1 (since MTRAIN_API_VERSION 8): top-p budgets force num_sinks and
   *  window too (mtrain_estimate_options_t.top_p_forced, SPEC.md section 2);
   *  0: nothing is forced in top-p mode. */
  int32_t top_p_forced;
} mtrain_select_args_t;

/** The plan of a packed batch on one rank built on the backend from the
 *  estimate's scores without a host round trip (mtrain_plan_create_estimated):
 *  the selection of every sequence (select[s], as pattern_select_batch takes
 *  it; its host outputs are not written) and the step tables that the
 *  attention slots then read (mtrain_step_view_t.device_tables). */
typedef struct mtrain_device_plan_args {
  int32_t count;                      /**< sequences */
  int32_t num_kv_heads;               /**< Hkv (Hq, G, N are select[s]'s) */
  const mtrain_select_args_t *select; /**< [count] */
} mtrain_device_plan_args_t;

/** Where a backend keeps tensor memory, and where a communicator's
 *  point-to-point buffers must live. A context pairs a backend with a
 *  communicator only when the spaces agree (MTRAIN_MEMORY_ANY agrees with
 *  both: the communicator moves no tensor data itself, as "self" on one
 *  rank). */
typedef enum mtrain_memory_space {
  MTRAIN_MEMORY_HOST = 0,   /**< ordinary host memory */
  MTRAIN_MEMORY_DEVICE = 1, /**< accelerator memory (CUDA device pointers) */
  MTRAIN_MEMORY_ANY = 2,    /**< communicators only: takes either */
} mtrain_memory_space_t;

/** The backend table. Slots marked optional may be NULL; the core reports
 *  MTRAIN_ERR_NOT_SUPPORTED when one is needed. Every other slot is
 *  required: mtrain_context_create refuses, with MTRAIN_ERR_INVALID_CONFIG
 *  naming the table and the field, a table whose api_version is not
 *  MTRAIN_API_VERSION or whose required slot is NULL (and one that sets only
 *  one of the two timer slots). Every slot returns a status and sets the
 *  last-error message on failure. */
typedef struct mtrain_backend_ops {
  int32_t api_version; /**< MTRAIN_API_VERSION */
  const char *name;
  mtrain_dtype_t acc_dtype;           /**< dtype of running O/LSE and gradient accumulators */
  mtrain_memory_space_t memory_space; /**< where its tensors live (HOST or DEVICE) */

  mtrain_status_t (*init)(const mtrain_config_t *config, void **state);
  void (*fini)(void *state);
  /** MTRAIN_SUCCESS if q/k/v of `dtype` and this head_dim can be computed. */
  mtrain_status_t (*supports)(void *state, mtrain_dtype_t dtype, int32_t head_dim);

  /* memory */
  mtrain_status_t (*alloc)(void *state, size_t bytes, void **ptr);
  void (*free)(void *state, void *ptr);
  mtrain_status_t (*memset_zero)(void *state, void *ptr, size_t bytes);
  mtrain_status_t (*copy_to_host)(void *state, void *host_dst, const void *src, size_t bytes);
  mtrain_status_t (*copy_from_host)(void *state, void *dst, const void *host_src, size_t bytes);
  /** Copies within the backend's memory (regions do not overlap). */
  mtrain_status_t (*copy)(void *state, void *dst, const void *src, size_t bytes);
  /** dst += src element-wise, `count` elements of `dtype` (fp32 or fp64). */
  mtrain_status_t (*add)(void *state, void *dst, const void *src, mtrain_dtype_t dtype,
                         int64_t count);
  /** Row permutation within the backend's memory. gather (scatter == 0):
   *  dst row i = src row index[i] for i < count, a zero row where index[i]
   *  >= src_rows (padding). scatter (scatter == 1): dst row index[i] = src
   *  row i where index[i] < dst_rows; other rows are left alone. `index`
   *  is host memory. */
  mtrain_status_t (*permute)(void *state, void *dst, const void *src, size_t row_bytes,
                             const int64_t *index, int64_t count, int64_t other_rows, int scatter);
  /** Element-wise dtype conversion within the backend's memory. */
  mtrain_status_t (*convert)(void *state, const void *src, mtrain_dtype_t src_dtype, void *dst,
                             mtrain_dtype_t dst_dtype, int64_t count);
  /** *bad_index = index of the first NaN/Inf element, or -1. */
  mtrain_status_t (*find_nonfinite)(void *state, const void *ptr, mtrain_dtype_t dtype,
                                    int64_t count, int64_t *bad_index);

  /* attention */
  /** Sets o_acc to 0 and lse_acc to -inf for `rows` rows of Hq heads. */
  mtrain_status_t (*attn_fwd_init)(void *state, void *o_acc, void *lse_acc, int64_t rows,
                                   int32_t num_heads, int32_t head_dim);
  /** Computes one step's listed pairs and merges them into o_acc/lse_acc. */
  mtrain_status_t (*attn_fwd_step)(void *state, const mtrain_fwd_step_args_t *args);
  /** delta_acc[i,h] = sum_d dout[i,h,:] * o[i,h,:] (o and dout of `dtype`). */
  mtrain_status_t (*attn_bwd_prepare)(void *state, const void *o, const void *dout,
                                      mtrain_dtype_t dtype, void *delta_acc, int64_t rows,
                                      int32_t num_heads, int32_t head_dim);
  /** Accumulates one step's contributions into dq_acc, dk_acc, dv_acc. */
  mtrain_status_t (*attn_bwd_step)(void *state, const mtrain_bwd_step_args_t *args);
  /** Pattern scores of SPEC.md section 2, one stage (optional). Outputs are
   *  fp64 in the backend's memory. */
  mtrain_status_t (*pattern_scores)(void *state, const mtrain_scores_args_t *args);

  /** Optional: the stream (a cudaStream_t for CUDA) the backend queues its
   *  work on, which a communicator of the same memory space orders its
   *  transfers after (mtrain_comm_ops_t.set_data_stream). NULL slot or NULL
   *  result: the backend's work is done when each slot returns. */
  void *(*data_stream)(void *state);

  /** Waits for all work queued by this backend (no-op on the CPU). */
  mtrain_status_t (*synchronize)(void *state);

  /** Optional device-side timing (NULL where the host clock is exact): mark
   *  records a timestamp into slot `index` (0 <= index < 4096) behind the work
   *  queued so far; elapsed waits for two recorded slots and gives the seconds
   *  between them. The ring driver uses them for its step statistics. */
  mtrain_status_t (*timer_mark)(void *state, int index);
  mtrain_status_t (*timer_elapsed)(void *state, int from, int to, double *seconds);

  /** Optional, all three or none: stream-ordered calls. async returns 1 when
   *  the state is in stream-ordered mode (mtrain_cuda_set_async): a call on a
   *  single rank then returns once its work is queued, without waiting for it,
   *  and checks its outputs with deferred scans instead of find_nonfinite.
   *  deferred_scan queues a NaN/Inf scan of `count` elements of `ptr` and
   *  never waits for the device (except for a scan queued many calls ago
   *  whose record it reuses); a finding is reported later as
   *  "<what>: element E (token E / row_width, head (E % row_width) /
   *  head_dim)", E counted from row `row0` of a [tokens, row_width] tensor;
   *  `what` is copied. deferred_poll reports the first finding among the
   *  completed scans (blocking != 0: it waits for every queued scan first) as
   *  MTRAIN_ERR_NONFINITE, once, and forgets the scans it has read. */
  int (*async)(void *state);
  mtrain_status_t (*deferred_scan)(void *state, const void *ptr, mtrain_dtype_t dtype,
                                   int64_t count, int64_t row0, int64_t row_width, int64_t head_dim,
                                   const char *what);
  mtrain_status_t (*deferred_poll)(void *state, int blocking);

  /** Optional: the block scores of SPEC.md section 9 for this rank's query
   *  blocks (mtrain_block_scores_args_t). NULL: mtrain_pattern_select_blocks
   *  reports MTRAIN_ERR_NOT_SUPPORTED naming the backend. */
  mtrain_status_t (*block_scores)(void *state, const mtrain_block_scores_args_t *args);
  /** The methods block_scores scores from key chunks (k_block_global), a
   *  mask of MTRAIN_BLOCK_CHUNKS_SUMS (precise and meanpool; 1, as before)
   *  and MTRAIN_BLOCK_CHUNKS_ANTIDIAG: the distributed selection then passes
   *  the keys around the ring instead of gathering them all (host memory
   *  only). */
  int block_scores_key_chunks;
  /** 1 when the attention slots compute non-causal step views (`causal`
   *  0: no mask in the diagonal block). 0: the core refuses a plan that
   *  holds a non-causal pattern with MTRAIN_ERR_NOT_SUPPORTED naming the
   *  backend, before any work (mtrain_attention_forward / _backward). */
  int noncausal;

  /** Optional: the vertical-slash selection on the backend
   *  (mtrain_select_args_t). NULL: the estimate copies the scores to the
   *  host and selects there. Used on one rank, and on W > 1 ranks when the
   *  communicator has allreduce_device (the scores are combined on the
   *  devices first; otherwise they are combined and selected on the host). */
  mtrain_status_t (*pattern_select)(void *state, const mtrain_select_args_t *args);
  /** 1 when block_scores computes the non-causal scores (args.noncausal).
   *  0: a non-causal block selection is refused with MTRAIN_ERR_NOT_SUPPORTED
   *  naming the backend, before any work. */
  int block_scores_noncausal;
  /** Optional (only with pattern_select): the selection of `count`
   *  sequences at once, args[s] each as pattern_select takes it, their
   *  patterns back with one wait for the device; bitwise pattern_select's
   *  result for each. MTRAIN_ERR_NOT_SUPPORTED, having queued nothing, when
   *  any sequence's budgets cannot be selected. NULL: the core calls
   *  pattern_select once per sequence. */
  mtrain_status_t (*pattern_select_batch)(void *state, const mtrain_select_args_t *args,
                                          int32_t count);
  /** Optional (only with pattern_scores): one stage for `count` sequences
   *  at once (args[s] each as pattern_scores takes it; the same stage,
   *  heads, head_dim, granularity, dtypes and probs), each sequence's
   *  outputs exactly pattern_scores'. NULL: the core calls pattern_scores
   *  once per sequence. */
  mtrain_status_t (*pattern_scores_batch)(void *state, const mtrain_scores_args_t *args,
                                          int32_t count);

  /** Optional, all four or none (since MTRAIN_API_VERSION 7): plans built on
   *  the backend (mtrain_plan_create_estimated on one rank). device_plan_size
   *  gives the bytes of backend memory a build needs (host arithmetic only;
   *  MTRAIN_ERR_NOT_SUPPORTED, having done nothing, for budgets it cannot
   *  select or shapes it cannot build). device_plan_build queues the
   *  selection and the tables into `memory` (that many bytes, the core's, kept
   *  until device_plan_release) without waiting for the device, and returns
   *  the handle that step views carry. device_plan_read waits for the device
   *  and writes every sequence's selection into the host outputs of
   *  args->select[s] (as pattern_select_batch does) and, when `pairs` is not
   *  NULL, the pairs each head computes into pairs[s * Hq + h]. An error the
   *  build's kernels found (a capacity overrun: an internal error) is
   *  reported here. device_plan_release frees the handle (not `memory`). */
  mtrain_status_t (*device_plan_size)(void *state, const mtrain_device_plan_args_t *args,
                                      size_t *bytes);
  mtrain_status_t (*device_plan_build)(void *state, const mtrain_device_plan_args_t *args,
                                       void *memory, void **handle);
  mtrain_status_t (*device_plan_read)(void *state, void *handle,
                                      const mtrain_device_plan_args_t *args, int64_t *pairs);
  void (*device_plan_release)(void *state, void *handle);

  /** Optional, both or none (since MTRAIN_API_VERSION 7): the estimate's top-p
   *  row statistics kept in backend memory on one rank, so that a plan built
   *  on the device needs no host round trip with top-p heads either.
   *  fill_f64 sets `count` doubles of dst to `value`; row_sums_f64 sets
   *  out[r] to the sum of in[r * cols + c] for c = 0 .. cols - 1, added in
   *  that order from 0.0 (bitwise the host's loop), for r < rows. Both are
   *  queued on the backend's stream and never wait. */
  mtrain_status_t (*fill_f64)(void *state, double *dst, double value, int64_t count);
  mtrain_status_t (*row_sums_f64)(void *state, const double *in, double *out, int64_t rows,
                                  int64_t cols);
} mtrain_backend_ops_t;

/** The state of the context's backend when the context uses the table
 *  `ops`, else NULL: how a backend's own API (mtrain_cuda.h, for example)
 *  reaches its state from a context. Not thread-safe against destroy. */
MTRAIN_API void *mtrain_context_backend_state(const mtrain_context_t *ctx,
                                              const mtrain_backend_ops_t *ops);

/** Tells the context's communicator the backend's current data stream
 *  (mtrain_backend_ops_t.data_stream); a backend calls it when its stream
 *  changes. A no-op where either slot is absent. */
MTRAIN_API mtrain_status_t mtrain_context_bind_stream(mtrain_context_t *ctx);

/** Finds a compiled-in backend by name; NULL if none. */
MTRAIN_API const mtrain_backend_ops_t *mtrain_backend_find(const char *name);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_BACKEND_H */
