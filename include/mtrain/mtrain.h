/* mtrain.h: the public API of mtrain, distributed dynamic sparse attention.
 *
 * What is computed is SPEC.md (causal attention restricted to a vertical-slash
 * pattern, forward and backward). This header holds status codes, data types,
 * tensor descriptors, the configuration, the context, patterns, plans and the
 * attention calls. File formats live in mtrain_io.h, the CPU oracle in
 * mtrain_cpu.h, the backend and communicator tables in mtrain_backend.h and
 * mtrain_comm.h.
 *
 * Conventions: every function returns an mtrain_status_t (0 = success,
 * negative = error) and on error leaves a message naming the problem in a
 * thread-local buffer (mtrain_last_error()). Output arguments come last and are
 * written only on success. Every create has one destroy; destroy(NULL) is a
 * no-op. Nothing here prints, exits or aborts.
 */
#ifndef MTRAIN_MTRAIN_H
#define MTRAIN_MTRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "mtrain_export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MTRAIN_VERSION_MAJOR 0
#define MTRAIN_VERSION_MINOR 1
#define MTRAIN_VERSION_PATCH 0
/** Version of the config struct and of the backend/communicator tables
 *  (6: the communicator's allreduce_device, the backend's
 *  block_scores_noncausal and mtrain_block_options_t.noncausal; 8:
 *  mtrain_estimate_options_t.top_p_forced and mtrain_select_args_t's
 *  top_p_forced). */
#define MTRAIN_API_VERSION 8

/* ------------------------------------------------------------------------ */
/* Status codes                                                              */
/* ------------------------------------------------------------------------ */

/* X-macro: name, value, description. One table gives the enum and the strings. */
#define MTRAIN_STATUS_TABLE(X)                                                                     \
  X(MTRAIN_SUCCESS, 0, "success")                                                                  \
  X(MTRAIN_ERR_NULL_POINTER, -1, "a required pointer argument is NULL")                            \
  X(MTRAIN_ERR_INVALID_ARGUMENT, -2, "an argument has an invalid value")                           \
  X(MTRAIN_ERR_SHAPE_MISMATCH, -3, "tensor shapes do not agree")                                   \
  X(MTRAIN_ERR_HEAD_MISMATCH, -4, "head counts do not agree")                                      \
  X(MTRAIN_ERR_UNSUPPORTED_DTYPE, -5, "data type not supported here")                              \
  X(MTRAIN_ERR_UNSUPPORTED_HEAD_DIM, -6, "head dimension not supported")                           \
  X(MTRAIN_ERR_INVALID_PATTERN, -7, "invalid sparse pattern")                                      \
  X(MTRAIN_ERR_NONFINITE, -8, "NaN or Inf in an input tensor")                                     \
  X(MTRAIN_ERR_OUT_OF_MEMORY, -9, "out of memory")                                                 \
  X(MTRAIN_ERR_IO, -10, "file could not be opened, read or written")                               \
  X(MTRAIN_ERR_FORMAT, -11, "malformed file contents")                                             \
  X(MTRAIN_ERR_BACKEND_NOT_FOUND, -12, "no backend or communicator of that name")                  \
  X(MTRAIN_ERR_BACKEND, -13, "backend failure")                                                    \
  X(MTRAIN_ERR_COMM, -14, "communication failure")                                                 \
  X(MTRAIN_ERR_TIMEOUT, -15, "timed out waiting for a peer")                                       \
  X(MTRAIN_ERR_NOT_SUPPORTED, -16, "operation not supported by this build or backend")             \
  X(MTRAIN_ERR_INVALID_CONFIG, -17, "invalid configuration")                                       \
  X(MTRAIN_ERR_INVALID_BUDGET, -18, "invalid sparse budget")                                       \
  X(MTRAIN_ERR_INTERNAL, -19, "internal error (a bug in mtrain)")

typedef enum mtrain_status {
#define MTRAIN_STATUS_ENUM_(name, value, text) name = value,
  MTRAIN_STATUS_TABLE(MTRAIN_STATUS_ENUM_)
#undef MTRAIN_STATUS_ENUM_
} mtrain_status_t;

/** Short constant description of a status; "unknown status" for others. */
MTRAIN_API const char *mtrain_status_string(mtrain_status_t status);
/** Name of a status ("MTRAIN_ERR_SHAPE_MISMATCH"); "unknown" for others. */
MTRAIN_API const char *mtrain_status_name(mtrain_status_t status);
/** The detailed message of the last error raised on this thread (which
 *  argument, which value). Valid until the next mtrain call on this thread;
 *  "" when there was none. Thread-safe (thread-local storage). */
MTRAIN_API const char *mtrain_last_error(void);
/** Clears this thread's last-error message. */
MTRAIN_API void mtrain_clear_error(void);

/* ------------------------------------------------------------------------ */
/* Data types and tensors                                                    */
/* ------------------------------------------------------------------------ */

typedef enum mtrain_dtype {
  MTRAIN_F32 = 0,  /**< IEEE binary32 */
  MTRAIN_BF16 = 1, /**< bfloat16 storage, fp32 arithmetic */
  MTRAIN_F16 = 2,  /**< IEEE binary16 storage, fp32 arithmetic */
  MTRAIN_F64 = 3,  /**< binary64: only the cpu-ref backend (the oracle) */
} mtrain_dtype_t;

/** Bytes per element; 0 for an unknown dtype. */
MTRAIN_API size_t mtrain_dtype_size(mtrain_dtype_t dtype);
/** "fp32", "bf16", "fp16", "fp64"; "unknown" otherwise. */
MTRAIN_API const char *mtrain_dtype_name(mtrain_dtype_t dtype);
/** Parses "fp32"/"f32"/"float32", "bf16"/"bfloat16", "fp16"/"f16"/"float16",
 *  "fp64"/"f64"/"float64". */
MTRAIN_API mtrain_status_t mtrain_dtype_parse(const char *name, mtrain_dtype_t *out);

#define MTRAIN_MAX_DIMS 4

/** A dense, contiguous, row-major (C order) tensor in caller-owned memory.
 *  Attention tensors are token-major: q, o, dq, dout [tokens, Hq, d];
 *  k, v, dk, dv [tokens, Hkv, d]; lse [tokens, Hq]. For the CPU backends
 *  `data` is host memory; for the CUDA backend it is device memory. mtrain
 *  never frees it. */
typedef struct mtrain_tensor {
  void *data;
  mtrain_dtype_t dtype;
  int32_t ndim;
  int64_t shape[MTRAIN_MAX_DIMS];
} mtrain_tensor_t;

/** Convenience: a [tokens, heads, dim] descriptor. */
MTRAIN_API mtrain_tensor_t mtrain_tensor_3d(void *data, mtrain_dtype_t dtype, int64_t tokens,
                                            int64_t heads, int64_t dim);
/** Convenience: a [tokens, heads] descriptor (for lse). */
MTRAIN_API mtrain_tensor_t mtrain_tensor_2d(void *data, mtrain_dtype_t dtype, int64_t tokens,
                                            int64_t heads);
/** Number of elements (product of the shape); 0 when ndim is out of range
 *  or an extent is negative or 0; -1 when the product overflows int64. */
MTRAIN_API int64_t mtrain_tensor_numel(const mtrain_tensor_t *t);

/** Host-side conversions between storage types (round to nearest even).
 *  `src` and `dst` must not overlap. */
MTRAIN_API mtrain_status_t mtrain_convert(const void *src, mtrain_dtype_t src_dtype, void *dst,
                                          mtrain_dtype_t dst_dtype, int64_t count);
MTRAIN_API float mtrain_bf16_to_float(uint16_t x);
MTRAIN_API uint16_t mtrain_float_to_bf16(float x);
MTRAIN_API float mtrain_half_to_float(uint16_t x);
MTRAIN_API uint16_t mtrain_float_to_half(float x);

/* ------------------------------------------------------------------------ */
/* Configuration and context                                                 */
/* ------------------------------------------------------------------------ */

/** Context configuration. Initialise with MTRAIN_CONFIG_INIT, then set fields.
 *  mtrain_context_create applies MTRAIN_* environment overrides (read once per
 *  process) on top: MTRAIN_BACKEND, MTRAIN_GRANULARITY, MTRAIN_NUM_THREADS,
 *  MTRAIN_CHECK_INPUTS, MTRAIN_DETERMINISTIC. */
typedef struct mtrain_config {
  int32_t api_version;   /**< must be MTRAIN_API_VERSION */
  const char *backend;   /**< "cpu" (default), "cpu-ref", "cuda" */
  int32_t granularity;   /**< block size G of patterns and plans (default 128; 1 to 2^20,
                              all computed by the CPU backends; "cuda" refuses at context
                              creation a G above its device's limit, naming it) */
  int32_t num_threads;   /**< CPU threads; 0 = OpenMP's default. At most
                              min(omp_get_thread_limit(), 4 x omp_get_num_procs()), OpenMP's
                              default included (INVALID_CONFIG above it) */
  int32_t check_inputs;  /**< 1: reject NaN/Inf inputs with MTRAIN_ERR_NONFINITE (costs a pass) */
  double softmax_scale;  /**< 0 = 1/sqrt(head_dim) */
  int32_t deterministic; /**< 1 (default): two runs on the same inputs, world size and thread
                              count give bitwise identical outputs and gradients; 0: the
                              backward is scheduled for load balance, faster, and its gradients
                              may differ in the last bits between runs */
} mtrain_config_t;

#define MTRAIN_CONFIG_INIT                                                                         \
  { MTRAIN_API_VERSION, "cpu", 128, 0, 0, 0.0, 1 }

typedef struct mtrain_context mtrain_context_t;
typedef struct mtrain_comm mtrain_comm_t; /* see mtrain_comm.h */

/** Creates a context: picks the backend by name from the registry and binds
 *  the communicator. `comm` may be NULL for a single rank (the built-in "self"
 *  communicator); otherwise the context borrows it (the caller destroys it
 *  after the context). Collective when comm has several ranks: every rank
 *  must call it, and the configurations (api_version, backend, granularity,
 *  check_inputs, deterministic, softmax_scale) must agree: otherwise every
 *  rank fails with MTRAIN_ERR_INVALID_CONFIG naming the field and a rank. Not thread-safe with
 * respect to the same context: one context is used by one thread at a time. */
MTRAIN_API mtrain_status_t mtrain_context_create(const mtrain_config_t *config, mtrain_comm_t *comm,
                                                 mtrain_context_t **out);
/** Destroys a context and everything it owns. NULL is a no-op. */
MTRAIN_API void mtrain_context_destroy(mtrain_context_t *ctx);

/** The caller's allocator for the memory the library takes from the backend
 *  during a call (accumulators, ring buffers, gathered bars, estimation
 *  scores): alloc(bytes, user) returns memory in the backend's memory space
 *  (device memory usable on the backend's stream for "cuda", host memory for
 *  the CPU backends), or NULL when it has none (the call then fails with
 *  MTRAIN_ERR_OUT_OF_MEMORY); free(ptr, bytes, user) takes it back with the
 *  size it was asked for. Frameworks pass their caching allocator (PyTorch's,
 *  on the stream given to mtrain_cuda_set_stream), so no call allocates from
 *  the driver. Called on the thread of the call that allocates. */
typedef struct mtrain_allocator {
  void *(*alloc)(size_t bytes, void *user);
  void (*free)(void *ptr, size_t bytes, void *user);
  void *user;
} mtrain_allocator_t;

/** Sets (or with NULL removes) the context's allocator. The functions are
 *  copied; `user` is borrowed until the context is destroyed or another
 *  allocator is set. Fails with MTRAIN_ERR_INVALID_ARGUMENT while blocks
 *  of the context are live (set it between calls). Not thread-safe against
 *  calls on the same context. Local (not collective). */
MTRAIN_API mtrain_status_t mtrain_context_set_allocator(mtrain_context_t *ctx,
                                                        const mtrain_allocator_t *allocator);
/** Block reuse. Without a caller's allocator, the blocks a call gives back
 *  (accumulators, ring buffers, gathered bars, estimation scores) are kept by
 *  the context, and a later request that a kept block holds with at most an
 *  eighth to spare gets it instead of a fresh one from the backend: a loop
 *  that repeats its shapes touches no fresh host pages (CPU backends) and
 *  calls no cudaMalloc/cudaFree (which waits for the device) on "cuda". At
 *  most `max_bytes` stay kept, the oldest blocks freed beyond it; the default
 *  MTRAIN_REUSE_LIMIT_PEAK keeps at most the highest backend bytes the
 *  context ever had live at once (so between calls it holds at most what its
 *  largest call needed), 0 turns reuse off and frees what is kept. The
 *  environment variable MTRAIN_REUSE_LIMIT (a byte count, or "peak") sets the
 *  default of new contexts. A failed allocation frees the kept blocks and
 *  tries once more. With a caller's allocator nothing is kept (setting one
 *  frees the kept blocks). Kept bytes are not counted as live in
 *  mtrain_context_memory (docs/MEMORY.md). Local (not collective); not
 *  thread-safe with respect to ctx. */
#define MTRAIN_REUSE_LIMIT_PEAK ((size_t)-1)
MTRAIN_API mtrain_status_t mtrain_context_set_reuse_limit(mtrain_context_t *ctx, size_t max_bytes);
/** Frees every kept block now (the next call allocates afresh). Local. */
MTRAIN_API mtrain_status_t mtrain_context_release_kept(mtrain_context_t *ctx);
/** The bytes kept now and the allocations served from kept blocks since the
 *  context was created (either output may be NULL). Local. */
MTRAIN_API mtrain_status_t mtrain_context_kept(const mtrain_context_t *ctx, size_t *kept_bytes,
                                               int64_t *reused_blocks);
/** Waits for the work of the context's stream-ordered calls (a backend's
 *  async mode: mtrain_cuda_set_async) and reports the first NaN/Inf that
 *  their deferred output checks found, as MTRAIN_ERR_NONFINITE naming the
 *  call, the tensor, the token and the head; each finding is reported once
 *  (by this function or by the first later call on ctx that sees it
 *  complete). MTRAIN_SUCCESS at once for a backend that finishes every call
 *  before returning. Local; not thread-safe with respect to ctx. */
MTRAIN_API mtrain_status_t mtrain_context_check_deferred(mtrain_context_t *ctx);
/** The effective configuration (after environment overrides). */
MTRAIN_API const mtrain_config_t *mtrain_context_config(const mtrain_context_t *ctx);
/** The name of the backend the context uses. */
MTRAIN_API const char *mtrain_context_backend_name(const mtrain_context_t *ctx);
/** Rank and world size of the context's communicator. */
MTRAIN_API int mtrain_context_rank(const mtrain_context_t *ctx);
MTRAIN_API int mtrain_context_world(const mtrain_context_t *ctx);

/** Timing of the last attention call on a context (host clock for the CPU
 *  backends, which compute synchronously; for the ring on the "cuda" backend
 *  ring_seconds and compute_seconds come from device events around each
 *  step). ring_seconds is the time from the first ring step to the last;
 *  compute_seconds the sum of the steps' compute;
 *  ring_seconds / compute_seconds near 1 means the transfers were hidden
 *  behind the compute. */
typedef struct mtrain_call_stats {
  double seconds;         /**< the whole call */
  double ring_seconds;    /**< the step loop, transfers included */
  double compute_seconds; /**< the steps' compute, summed */
  double wait_seconds;    /**< waiting for transfers after a step's compute */
  int32_t steps;
} mtrain_call_stats_t;

/** The statistics of the last mtrain_attention_forward/backward on ctx. */
MTRAIN_API mtrain_status_t mtrain_context_last_stats(const mtrain_context_t *ctx,
                                                     mtrain_call_stats_t *out);

/** Memory of a context and of the process (docs/MEMORY.md). Backend bytes
 *  are the sizes requested from the context's backend (host memory for the
 *  CPU backends, device memory for "cuda") by the library's own buffers:
 *  the accumulators and bars of the attention calls, the ring's chunk and
 *  partial buffers, and the estimation's score buffers. Not counted: the
 *  caller's tensors, host memory of plans and patterns (see
 *  mtrain_plan_bytes), host staging inside core, and a backend's internal
 *  scratch (per-thread tiles, widened copies of non-fp32 inputs). The
 *  process figures cover everything the process holds, every context and
 *  the caller's own memory included. */
typedef struct mtrain_memory_stats {
  size_t backend_current_bytes;  /**< live now (0 between calls) */
  size_t backend_peak_bytes;     /**< the most live at once since creation or the last reset */
  int64_t backend_live_blocks;   /**< live allocations now */
  int64_t backend_allocations;   /**< allocations since the context was created */
  size_t process_peak_rss_bytes; /**< the process's peak resident set (getrusage ru_maxrss); 0
                                      where unavailable */
  size_t process_rss_bytes;      /**< its resident set now (/proc/self/statm; 0 elsewhere) */
} mtrain_memory_stats_t;

/** The memory figures of ctx and of the process. Local (not collective);
 *  not to be called while another thread uses ctx. */
MTRAIN_API mtrain_status_t mtrain_context_memory(const mtrain_context_t *ctx,
                                                 mtrain_memory_stats_t *out);
/** Starts a new peak: backend_peak_bytes becomes backend_current_bytes (the
 *  process peak RSS cannot be reset). Same threading as mtrain_context_memory. */
MTRAIN_API mtrain_status_t mtrain_context_reset_peak_memory(mtrain_context_t *ctx);

/** Names of the compiled-in backends ("cpu-ref", "cpu", ...). Writes at most
 *  `cap` pointers to static strings into names; returns the total count. */
MTRAIN_API int mtrain_backend_list(const char **names, int cap);

/* ------------------------------------------------------------------------ */
/* Patterns (SPEC.md section 1)                                              */
/* ------------------------------------------------------------------------ */

/** A sparse pattern of one sequence: for each query head either
 *  vertical-slash form (block diagonals D_h with diagonal 0 always present,
 *  sorted vertical key positions V_h) or a generic block mask (a set of
 *  (query block, key block) pairs with key block <= query block; any key
 *  block in a non-causal pattern, mtrain_pattern_create_noncausal). */
typedef struct mtrain_pattern mtrain_pattern_t;

/** Most query blocks (ceil(seq_len / granularity)) of a pattern with a
 *  block-mask head: 2^24, i.e. 2^31 tokens at G = 128. A block mask takes
 *  memory in proportion to its blocks, so the limit keeps a small pattern
 *  file from asking for gigabytes; vertical-slash heads have no such limit. */
#define MTRAIN_PATTERN_MAX_MASK_BLOCKS ((int64_t)1 << 24)

/** An empty pattern: every head has only diagonal 0 and no verticals.
 *  seq_len >= 1, num_heads >= 1, granularity >= 1, fewer than 2^31 blocks. */
MTRAIN_API mtrain_status_t mtrain_pattern_create(int64_t seq_len, int32_t num_heads,
                                                 int32_t granularity, mtrain_pattern_t **out);
/** The dense causal pattern (all block diagonals 0..nb-1, no verticals). */
MTRAIN_API mtrain_status_t mtrain_pattern_create_dense(int64_t seq_len, int32_t num_heads,
                                                       int32_t granularity, mtrain_pattern_t **out);
/** A non-causal pattern (SPEC.md section 1, "Non-causal patterns"): every query may attend to
 *  keys after it, within its head's block mask (the bidirectional attention
 *  of encoders and video DiTs). Every head starts as the block mask of the
 *  diagonal blocks only; set heads with mtrain_pattern_set_block_mask, whose
 *  entries may then lie above the diagonal. Vertical-slash heads are causal:
 *  mtrain_pattern_set_head refuses them here. Runs on every backend ("cpu",
 *  "cpu-ref", "cuda"). At most MTRAIN_PATTERN_MAX_MASK_BLOCKS query blocks
 *  (else MTRAIN_ERR_INVALID_ARGUMENT, before anything is allocated). */
MTRAIN_API mtrain_status_t mtrain_pattern_create_noncausal(int64_t seq_len, int32_t num_heads,
                                                           int32_t granularity,
                                                           mtrain_pattern_t **out);
/** 1 for a causal pattern (every pattern but those of
 *  mtrain_pattern_create_noncausal and their clones), 0 otherwise. */
MTRAIN_API int mtrain_pattern_is_causal(const mtrain_pattern_t *pattern);
MTRAIN_API void mtrain_pattern_destroy(mtrain_pattern_t *pattern);
/** Deep copy. */
MTRAIN_API mtrain_status_t mtrain_pattern_clone(const mtrain_pattern_t *pattern,
                                                mtrain_pattern_t **out);

/** Sets head h to vertical-slash form. `diagonals` are block diagonals in
 *  [0, nb) and `verticals` key positions in [0, seq_len); both strictly
 *  increasing (else MTRAIN_ERR_INVALID_PATTERN naming head and index).
 *  Diagonal 0 is added when absent. The arrays are copied. */
MTRAIN_API mtrain_status_t mtrain_pattern_set_head(mtrain_pattern_t *pattern, int32_t head,
                                                   const int32_t *diagonals, int32_t num_diagonals,
                                                   const int64_t *verticals, int32_t num_verticals);
/** Sets head h to block-mask form: `mask` is nb*nb bytes, row-major
 *  [query block][key block], nonzero = computed. Entries above the block
 *  diagonal are rejected in a causal pattern (allowed in a non-causal one);
 *  the block diagonal is forced on. Copied. */
MTRAIN_API mtrain_status_t mtrain_pattern_set_block_mask(mtrain_pattern_t *pattern, int32_t head,
                                                         const uint8_t *mask);

MTRAIN_API int64_t mtrain_pattern_seq_len(const mtrain_pattern_t *pattern);
MTRAIN_API int32_t mtrain_pattern_num_heads(const mtrain_pattern_t *pattern);
MTRAIN_API int32_t mtrain_pattern_granularity(const mtrain_pattern_t *pattern);
/** Number of G-blocks, ceil(seq_len / G). */
MTRAIN_API int64_t mtrain_pattern_num_blocks(const mtrain_pattern_t *pattern);
/** 1 when head h is in block-mask form. */
MTRAIN_API int mtrain_pattern_head_is_block_mask(const mtrain_pattern_t *pattern, int32_t head);
/** A 128-bit digest of the content of patterns[0 .. count - 1], in order: each
 *  pattern's seq_len, heads, granularity and causality, and every head's
 *  diagonals and verticals or block mask. Equal lists give equal digests;
 *  different lists differ except with a chance of about 2^-64 per pair (not
 *  cryptographic: meant for caches of plans, such as the Python package's, not
 *  for untrusted input). Reads only; any thread, while no thread changes the
 *  patterns. count may be 0. */
MTRAIN_API mtrain_status_t mtrain_pattern_digest(const mtrain_pattern_t *const *patterns,
                                                 int32_t count, uint64_t digest[2]);
/** Borrowed views of head h's vertical-slash sets (valid until the pattern
 *  changes). For a block-mask head both counts are 0. */
MTRAIN_API mtrain_status_t mtrain_pattern_get_head(const mtrain_pattern_t *pattern, int32_t head,
                                                   const int32_t **diagonals,
                                                   int32_t *num_diagonals,
                                                   const int64_t **verticals,
                                                   int32_t *num_verticals);
/** SPEC.md allowed(h, i, j): 1 if query i attends to key j under head h. */
MTRAIN_API int mtrain_pattern_allowed(const mtrain_pattern_t *pattern, int32_t head, int64_t i,
                                      int64_t j);
/** Number of allowed (i, j) pairs of head h (exact count). */
MTRAIN_API int64_t mtrain_pattern_count_pairs(const mtrain_pattern_t *pattern, int32_t head);

/* ------------------------------------------------------------------------ */
/* Sequences and plans (SPEC.md section 4)                                   */
/* ------------------------------------------------------------------------ */

/** A batch of packed sequences (FlashAttention varlen convention): sequence
 *  s holds global tokens [offsets[s], offsets[s+1]) of the packed tensors;
 *  offsets[0] == 0 and offsets are strictly increasing. */
typedef struct mtrain_seqs {
  int32_t num_seqs;
  const int64_t *offsets; /**< num_seqs + 1 entries */
} mtrain_seqs_t;

/** The plan: for this rank, every ring step and every head, the key blocks
 *  (as runs of local key blocks) and the bar columns (as segments of the
 *  chunk's vertical list) each local query block computes. Backend-agnostic
 *  host data; immutable after creation; may be shared by threads. */
typedef struct mtrain_plan mtrain_plan_t;

/** Builds the plan of a single-rank context for a packed batch: one pattern
 *  per sequence (patterns[s]->seq_len must equal the sequence's length; all
 *  must have the same head count and the context's granularity). With seqs
 *  == NULL the batch is one sequence of patterns[0]->seq_len tokens. The
 *  attention tensors hold the batch's tokens in order, no padding. A context
 *  with several ranks gets MTRAIN_ERR_NOT_SUPPORTED: use
 *  mtrain_plan_create_ring. The patterns are copied. */
MTRAIN_API mtrain_status_t mtrain_plan_create(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                              const mtrain_pattern_t *const *patterns,
                                              mtrain_plan_t **out);
/** Builds this rank's plan for the ring of the context's communicator
 *  (SPEC.md sections 4 and 5) for a packed batch: sequence s (tokens
 *  [offsets[s], offsets[s+1]) of the global batch, seqs == NULL: one
 *  sequence) has the pattern patterns[s] and is laid out over the ranks by
 *  layouts[s] (mtrain_layout.h: that sequence's length, the context's
 *  granularity and world size). The attention tensors of this rank hold,
 *  sequence after sequence, its local token slots of each in layout order
 *  (padding slots included: see mtrain_layout_rank_token_index); sequence s
 *  starts at local row mtrain_plan_seq_local_offset(plan, s), and the first
 *  dimension is mtrain_plan_local_tokens(plan). ranks_per_node 0 is the flat
 *  ring, a proper divisor of the world size the hierarchical ring with that
 *  many ranks per node. Bars follow each layout's bars mode: computed in the
 *  ring step where their key passes, or (bars gathered, the balanced layout)
 *  against the vertical K/V rows gathered before the ring, a share per step
 *  (docs/BALANCE.md). On one rank this is the ring of one. Collective on
 *  ctx's communicator: the ranks compare their batches (sequence count and
 *  lengths), head count, ranks_per_node and local slots, and all fail with
 *  MTRAIN_ERR_SHAPE_MISMATCH naming two ranks when any differs (a peer
 *  planning another problem would send chunks of another size). The
 *  patterns are copied; the layouts are only read during the call. */
struct mtrain_layout; /* mtrain_layout.h */
MTRAIN_API mtrain_status_t mtrain_plan_create_ring(mtrain_context_t *ctx, const mtrain_seqs_t *seqs,
                                                   const struct mtrain_layout *const *layouts,
                                                   int32_t ranks_per_node,
                                                   const mtrain_pattern_t *const *patterns,
                                                   mtrain_plan_t **out);
MTRAIN_API void mtrain_plan_destroy(mtrain_plan_t *plan);
/** Rank the plan was built for, and the ring's ranks per node (0: flat). */
MTRAIN_API int32_t mtrain_plan_rank(const mtrain_plan_t *plan);
MTRAIN_API int32_t mtrain_plan_ranks_per_node(const mtrain_plan_t *plan);
/** Sequences of the plan's batch, and the first local row of sequence `seq`
 *  in this rank's attention tensors (-1 for a sequence out of range). */
MTRAIN_API int32_t mtrain_plan_num_seqs(const mtrain_plan_t *plan);
MTRAIN_API int64_t mtrain_plan_seq_local_offset(const mtrain_plan_t *plan, int32_t seq);
/** Tokens of the whole batch held by this rank (the first dimension every
 *  attention tensor must have). */
MTRAIN_API int64_t mtrain_plan_local_tokens(const mtrain_plan_t *plan);
MTRAIN_API int32_t mtrain_plan_num_heads(const mtrain_plan_t *plan);
/** Number of ring steps (world size). */
MTRAIN_API int32_t mtrain_plan_num_steps(const mtrain_plan_t *plan);
/** Number of (query, key) pairs the plan computes on this rank, summed over
 *  heads and steps (what effective FLOP counts are based on). A plan built
 *  on the device (mtrain_plan_on_device) counts them there: the first call
 *  waits for the device and reads them back (-1 if that fails;
 *  mtrain_last_error says why). */
MTRAIN_API int64_t mtrain_plan_computed_pairs(const mtrain_plan_t *plan);
/** Plan memory in bytes (host memory, plus the backend memory of a plan
 *  built on the device). */
MTRAIN_API size_t mtrain_plan_bytes(const mtrain_plan_t *plan);
/** 1 when the plan's step tables were built on the backend's device by
 *  mtrain_plan_create_estimated (no host round trip), else 0. */
MTRAIN_API int mtrain_plan_on_device(const mtrain_plan_t *plan);
/** The pattern of sequence `seq` of the plan, borrowed (valid while the
 *  plan lives). A plan built on the device reads its patterns back on the
 *  first call, waiting for the device. Not thread-safe against other calls
 *  on the plan or its context. */
MTRAIN_API mtrain_status_t mtrain_plan_pattern(mtrain_plan_t *plan, int32_t seq,
                                               const mtrain_pattern_t **out);

/** The backend memory of the calls on one plan, derived from the shapes
 *  (docs/MEMORY.md gives the formula). All in bytes, requested sizes as
 *  counted by mtrain_context_memory. */
typedef struct mtrain_memory_bound {
  size_t estimate_bytes;    /**< with top-p heads: W > 1, one mtrain_pattern_estimate_ring of
                                 the plan's longest sequence; one rank, one
                                 mtrain_pattern_estimate_batch of all its sequences (the sum of
                                 theirs). The single-rank estimate takes L x Hq x d x 4 less (L
                                 of the longest sequence), top-k budgets alone
                                 Hq x L x (ceil(N/G) + 2) x 8 less per sequence; 0 if last_q 0 */
  size_t forward_bytes;     /**< one mtrain_attention_forward */
  size_t backward_bytes;    /**< one mtrain_attention_backward */
  size_t backend_bytes;     /**< the largest of the three: the bound on backend_peak_bytes of a
                                 context that runs these calls one after another */
  size_t plan_bytes;        /**< host memory of the plan (mtrain_plan_bytes less the next) */
  size_t device_plan_bytes; /**< backend memory a plan built on the device holds from its
                                 estimate to its destruction (counted in each of the above) */
} mtrain_memory_bound_t;

/** The memory bound of estimating, running forward and backward on `plan`
 *  with ctx's backend, for k/v of `kv_heads` heads, `head_dim` and inputs of
 *  `dtype`; last_q is the estimation's L (0: no estimation). For T local
 *  tokens it is O(T (Hq + Hkv) d) per rank plus the estimation's
 *  O(Hq N) score vectors, which do not shrink with the world size.
 *  Local; pure (reads the plan and the backend's accumulator dtype). */
MTRAIN_API mtrain_status_t mtrain_memory_bound(const mtrain_context_t *ctx,
                                               const mtrain_plan_t *plan, int32_t kv_heads,
                                               int32_t head_dim, mtrain_dtype_t dtype,
                                               int32_t last_q, mtrain_memory_bound_t *out);

/* ------------------------------------------------------------------------ */
/* Budgets and online pattern estimation (SPEC.md section 2)                 */
/* ------------------------------------------------------------------------ */

typedef enum mtrain_budget_kind {
  MTRAIN_BUDGET_TOP_K = 0, /**< static: keep v_size verticals and s_size slashes */
  MTRAIN_BUDGET_TOP_P = 1, /**< online: keep the fewest whose mass stays below p, at most cap */
} mtrain_budget_kind_t;

/** The budget of one query head. */
typedef struct mtrain_head_budget {
  mtrain_budget_kind_t kind;
  int64_t v_size, s_size; /**< top-k: verticals (key columns) and slashes (token diagonals) */
  double p_v, p_s;        /**< top-p: mass thresholds in (0, 1] */
  int64_t cap_v, cap_s;   /**< top-p: most verticals / slashes kept */
} mtrain_head_budget_t;

/** Per layer and head budgets, as in the MInference budget files. */
typedef struct mtrain_budgets mtrain_budgets_t;

/** Reads a MInference budget file (a list with one object per layer mapping
 *  the head index to ["vertical_and_slash", v, s, score] or
 *  ["flex_vertical_and_slash", [p_v, cap_v], [p_s, cap_s], score]).
 *  Malformed files: MTRAIN_ERR_FORMAT or MTRAIN_ERR_INVALID_BUDGET with the
 *  file, the place ("layer 3, head \"7\"") and the reason. */
MTRAIN_API mtrain_status_t mtrain_budgets_read(const char *path, mtrain_budgets_t **out);
/** The same from a NUL-terminated string; `origin` names it in messages. */
MTRAIN_API mtrain_status_t mtrain_budgets_parse(const char *text, const char *origin,
                                                mtrain_budgets_t **out);
MTRAIN_API void mtrain_budgets_destroy(mtrain_budgets_t *budgets);
MTRAIN_API int32_t mtrain_budgets_num_layers(const mtrain_budgets_t *budgets);
/** Heads of a layer (0 when the layer is out of range). */
MTRAIN_API int32_t mtrain_budgets_num_heads(const mtrain_budgets_t *budgets, int32_t layer);
/** The budget of (layer, head); MTRAIN_ERR_INVALID_ARGUMENT naming the layer
 *  or head when out of range. */
MTRAIN_API mtrain_status_t mtrain_budgets_get(const mtrain_budgets_t *budgets, int32_t layer,
                                              int32_t head, mtrain_head_budget_t *out);
/** Checks one budget's values (sizes >= 0, p in (0, 1], caps >= 0). */
MTRAIN_API mtrain_status_t mtrain_head_budget_validate(const mtrain_head_budget_t *budget);

/** Options of the estimation. Initialise with MTRAIN_ESTIMATE_INIT (fields
 *  added later go at the end, so that the initialiser keeps its order). The
 *  estimate refuses with MTRAIN_ERR_INVALID_ARGUMENT, naming the field and
 *  its value, last_q < 1, num_sinks < 0, window < 0 and a top_p_forced
 *  other than 0 or 1. */
typedef struct mtrain_estimate_options {
  int32_t last_q;       /**< L: the last L queries score the keys (default 64; clamped to N) */
  int32_t num_sinks;    /**< top-k mode (and top-p with top_p_forced): first keys forced in as
                             verticals (default 30) */
  int32_t window;       /**< top-k mode (and top-p with top_p_forced): token diagonals
                             0..window-1 forced in (default 100) */
  int32_t top_p_forced; /**< 1: top-p budgets force the sinks and the window too (as top-k
                             does); 0 (default): nothing forced in top-p mode (SPEC.md
                             section 2) */
} mtrain_estimate_options_t;

#define MTRAIN_ESTIMATE_INIT                                                                       \
  { 64, 30, 100, 0 }

/** Estimates the vertical-slash pattern of one sequence from its post-RoPE q
 *  [N, Hq, d] and k [N, Hkv, d] (SPEC.md section 2): per query head h,
 *  budgets[h] selects verticals and slashes from the last-L query scores.
 *  The scores are computed by the context's backend; the selection is the
 *  same code for every backend. Deterministic: the same inputs give the same
 *  pattern bitwise on one backend. The result has the context's granularity;
 *  the caller destroys it. Single rank for now (the distributed form comes
 *  with the distributed ring). */
MTRAIN_API mtrain_status_t mtrain_pattern_estimate(mtrain_context_t *ctx, const mtrain_tensor_t *q,
                                                   const mtrain_tensor_t *k,
                                                   const mtrain_head_budget_t *budgets,
                                                   const mtrain_estimate_options_t *options,
                                                   mtrain_pattern_t **out);

/** Estimates the patterns of the packed sequences of a batch on one rank:
 *  sequence s holds the rows [offsets[s], offsets[s+1]) of q [T, Hq, d] and
 *  k [T, Hkv, d] (T = offsets[num_seqs]), and out[s] (an array of num_seqs)
 *  receives its pattern, bitwise the one mtrain_pattern_estimate gives for
 *  those rows alone. Every stage is queued for all the sequences before the
 *  backend is waited for, and the backend's selection returns every
 *  sequence's pattern with one wait, so a batch of many short documents
 *  costs about one estimate instead of one per document. The caller
 *  destroys the patterns; on error none is returned (out[] is all NULL).
 *  Single rank (world 1): on a ring, estimate each sequence with
 *  mtrain_pattern_estimate_ring. Thread-safety as mtrain_pattern_estimate:
 *  one call at a time per context. */
MTRAIN_API mtrain_status_t mtrain_pattern_estimate_batch(
    mtrain_context_t *ctx, const mtrain_seqs_t *seqs, const mtrain_tensor_t *q,
    const mtrain_tensor_t *k, const mtrain_head_budget_t *budgets,
    const mtrain_estimate_options_t *options, mtrain_pattern_t **out);

/** Estimates the patterns of the packed sequences of a batch on one rank and
 *  builds their plan, in one call: the plan that mtrain_plan_create builds
 *  from the patterns that mtrain_pattern_estimate_batch gives (the same
 *  pattern bitwise, the same pairs; forward and backward compute the same
 *  results). Where the backend builds plans itself ("cuda": budgets its
 *  selection takes, that is top-k, and top-p with caps up to 8192
 *  candidates) the selection and the plan's step tables stay in device
 *  memory and are queued on the backend's stream (the top-p row statistics
 *  too): the call returns without waiting for the device; the patterns come
 *  to the host only when asked for (mtrain_plan_pattern,
 *  mtrain_plan_computed_pairs, which then wait). Elsewhere (the CPU
 *  backends, other budgets, several ranks) it is those two calls.
 *  MTRAIN_PLAN_ON_HOST=1 in the environment makes every plan on the host
 *  (comparisons). A plan built on the device holds backend memory of `ctx`
 *  (counted by mtrain_context_memory): destroy it before the context.
 *  Single rank; one call at a time per context. */
MTRAIN_API mtrain_status_t mtrain_plan_create_estimated(
    mtrain_context_t *ctx, const mtrain_seqs_t *seqs, const mtrain_tensor_t *q,
    const mtrain_tensor_t *k, const mtrain_head_budget_t *budgets,
    const mtrain_estimate_options_t *options, mtrain_plan_t **out);

/** The distributed estimate (SPEC.md section 2): q and k are this rank's
 *  [local tokens, heads, d] slots of a sequence laid out by `layout` (as the
 *  attention tensors of mtrain_plan_create_ring). The last L queries are
 *  gathered, every rank scores the keys it holds, the partial sums are
 *  combined exactly (each entry has one contributor) and every rank selects
 *  the same pattern, bitwise equal to the single-rank estimate of the
 *  gathered sequence on the same backend. Collective over the context's
 *  communicator. */
MTRAIN_API mtrain_status_t mtrain_pattern_estimate_ring(
    mtrain_context_t *ctx, const struct mtrain_layout *layout, const mtrain_tensor_t *q,
    const mtrain_tensor_t *k, const mtrain_head_budget_t *budgets,
    const mtrain_estimate_options_t *options, mtrain_pattern_t **out);

/** Wall-clock seconds of the parts of the calling thread's last estimate
 *  (mtrain_pattern_estimate, _batch or _ring; a batch's parts summed over its
 *  sequences), for diagnostics and benchmarks:
 *  `scores` from the first backend stage to the combined scores (`stages`:
 *  the backend's scoring until the device is done, with top-p its
 *  row-maximum and normaliser passes and their reductions; `reduce`: the
 *  combination over the ranks, on the devices or on the host; `copies`: the
 *  scores' copies to the host, 0 when the backend selects), `select` the
 *  selection of every head into the pattern (on the backend's device or on
 *  the host, with the copy of the pattern back). Thread-local; all zero
 *  before any estimate on this thread. */
typedef struct mtrain_estimate_times {
  double scores, select;
  double stages, copies, reduce;
} mtrain_estimate_times_t;
MTRAIN_API mtrain_estimate_times_t mtrain_estimate_last_times(void);

/* ------------------------------------------------------------------------ */
/* Attention                                                                 */
/* ------------------------------------------------------------------------ */

/** Sparse attention forward (SPEC.md section 1) over the plan.
 *  q [T, Hq, d], k and v [T, Hkv, d] of one dtype; o [T, Hq, d] of the same
 *  dtype; lse [T, Hq] fp32 (fp64 allowed with fp64 inputs). T is
 *  mtrain_plan_local_tokens(plan), Hq the plan's head count, Hq % Hkv == 0.
 *  Outputs are written fully and only on success. Collective over the
 *  context's communicator. */
MTRAIN_API mtrain_status_t mtrain_attention_forward(
    mtrain_context_t *ctx, const mtrain_plan_t *plan, const mtrain_tensor_t *q,
    const mtrain_tensor_t *k, const mtrain_tensor_t *v, mtrain_tensor_t *o, mtrain_tensor_t *lse);

/** Sparse attention backward: given the forward's inputs, its outputs o and
 *  lse, and dout (shaped like o), writes dq (like q), dk and dv (like k).
 *  Gradients of keys shared by a GQA group are summed over the group. */
MTRAIN_API mtrain_status_t mtrain_attention_backward(
    mtrain_context_t *ctx, const mtrain_plan_t *plan, const mtrain_tensor_t *q,
    const mtrain_tensor_t *k, const mtrain_tensor_t *v, const mtrain_tensor_t *o,
    const mtrain_tensor_t *lse, const mtrain_tensor_t *dout, mtrain_tensor_t *dq,
    mtrain_tensor_t *dk, mtrain_tensor_t *dv);

/* ------------------------------------------------------------------------ */
/* Block-sparse selection (SPEC.md section 9)                                */
/* ------------------------------------------------------------------------ */

/** How the (query block, key block) pairs are scored (SPEC.md section 9). */
typedef enum mtrain_block_method {
  /** AdaSpa-style precise search: the exact attention mass of each block,
   *  sum of exp(s q.k - lse) over its causal pairs, from the LSE a forward
   *  already produced (one pass, no second softmax). Needs lse. */
  MTRAIN_BLOCK_PRECISE = 0,
  /** XAttention-style: strided antidiagonal sums within each block (stride
   *  S), softmaxed per strided row: a cheap estimate of the block mass. */
  MTRAIN_BLOCK_ANTIDIAG = 1,
  /** MoBA-style gating: each query block's mean query against every earlier
   *  key block's mean key; top-k only. */
  MTRAIN_BLOCK_MEANPOOL = 2,
} mtrain_block_method_t;

/** "precise", "antidiag", "meanpool"; "unknown" otherwise. */
MTRAIN_API const char *mtrain_block_method_name(mtrain_block_method_t method);
/** Parses the names above; MTRAIN_ERR_INVALID_ARGUMENT naming `name` else. */
MTRAIN_API mtrain_status_t mtrain_block_method_parse(const char *name, mtrain_block_method_t *out);

/** Options of a block selection. Initialise with MTRAIN_BLOCK_OPTIONS_INIT. */
typedef struct mtrain_block_options {
  mtrain_block_method_t method;
  mtrain_budget_kind_t kind; /**< MTRAIN_BUDGET_TOP_K or _TOP_P (meanpool: top-k only) */
  int32_t top_k;             /**< top-k: key blocks kept per query block besides the forced ones */
  double top_p;              /**< top-p: the share of each query block's scored mass to reach,
                                  forced blocks counted, in (0, 1] */
  int32_t sink_blocks;       /**< key blocks [0, sink_blocks) forced in (default 1) */
  int32_t local_blocks;      /**< key blocks (qb - local_blocks, qb] forced in (default 1: the
                                  diagonal block, which is always in) */
  int32_t stride;            /**< antidiag: the stride S, a divisor of G (default 8) */
  int32_t head_adaptive;     /**< top-k with precise or antidiag: 1 redistributes the total budget
                                  Hq * top_k between heads (SPEC.md section 9.5) */
  int32_t noncausal;         /**< 0 (default): causal, key blocks kb <= qb. 1: bidirectional
                                  (SPEC.md section 9.7): every key block scored over all its keys
                                  and a candidate, local blocks |kb - qb| < local_blocks, and the
                                  result a non-causal pattern (mtrain_pattern_create_noncausal);
                                  backends without it refuse (MTRAIN_ERR_NOT_SUPPORTED) */
} mtrain_block_options_t;

#define MTRAIN_BLOCK_OPTIONS_INIT                                                                  \
  { MTRAIN_BLOCK_PRECISE, MTRAIN_BUDGET_TOP_P, 8, 0.9, 1, 1, 8, 0, 0 }

/** Optional per-head results of a block selection; each array, when not
 *  NULL, has Hq entries owned by the caller and is written on success. */
typedef struct mtrain_block_report {
  double *head_recall;  /**< the share of the head's scored mass the selection keeps (precise
                             with the dense LSE: exactly the pattern's recall); NaN for meanpool */
  int32_t *head_top_k;  /**< the top-k budget the head got (top_k unless head_adaptive); -1 in
                             top-p mode */
  int64_t *head_blocks; /**< the head's selected (query block, key block) pairs, forced included */
} mtrain_block_report_t;

/** Selects a block-mask pattern (every head in block-mask form) of one
 *  sequence from its post-RoPE q [N, Hq, d] and k [N, Hkv, d], and for
 *  MTRAIN_BLOCK_PRECISE the forward's lse [N, Hq] (fp32, or fp64; the LSE of
 *  dense attention makes the masses exact shares; NULL for the other
 *  methods). The context's backend scores (its optional block_scores slot:
 *  MTRAIN_ERR_NOT_SUPPORTED naming the backend where it has none); the
 *  selection is host code shared by every backend. Deterministic: the same
 *  inputs give the same pattern bitwise on one backend, at every thread
 *  count. The result has the context's granularity; the caller destroys
 *  it. `report` may be NULL. Single rank (world 1). Host memory: the Hq
 *  lower-triangular score matrices, Hq nb (nb + 1) / 2 doubles. */
MTRAIN_API mtrain_status_t mtrain_pattern_select_blocks(
    mtrain_context_t *ctx, const mtrain_tensor_t *q, const mtrain_tensor_t *k,
    const mtrain_tensor_t *lse, const mtrain_block_options_t *options,
    const mtrain_block_report_t *report, mtrain_pattern_t **out);

/** The distributed block selection: q, k (and lse) are this rank's
 *  [local tokens, ...] slots of a sequence laid out by `layout` (as the
 *  attention tensors of mtrain_plan_create_ring). Each rank scores only the
 *  query blocks it owns: for the precise and meanpool methods on the CPU
 *  backends against the key chunks passed around the ring (W steps, two
 *  chunks held at a time), otherwise (antidiag, cuda, or
 *  MTRAIN_BLOCK_KEY_GATHER=1) against every key gathered (all N x Hkv x d,
 *  in fp32, or fp64 for fp64 inputs). Each rank then selects its own rows
 *  (the head-adaptive budgets from exact per-head sums, all-reduced) and the
 *  selected rows are all-gathered in compact form (per head and query block:
 *  kept and total score, count, key blocks), so every rank ends with the same
 *  pattern, bitwise equal to mtrain_pattern_select_blocks of the whole
 *  sequence on the same backend, for every world size and layout.
 *  Collective over the context's communicator (point-to-point on the ring,
 *  all-reduces and one all-gather); `report` as above, the same on every
 *  rank. Host memory per rank: the scores of its own rows, Hq times the sum
 *  of qb + 1 over its query blocks qb (about Hq nb^2 / (2W) doubles with
 *  zigzag or striped layouts), the gathered selection (about 4 bytes per
 *  selected block pair of the whole pattern) and the keys (two chunks on the
 *  ring, all of them gathered) (SPEC.md section 9.6). */
MTRAIN_API mtrain_status_t mtrain_pattern_select_blocks_ring(
    mtrain_context_t *ctx, const struct mtrain_layout *layout, const mtrain_tensor_t *q,
    const mtrain_tensor_t *k, const mtrain_tensor_t *lse, const mtrain_block_options_t *options,
    const mtrain_block_report_t *report, mtrain_pattern_t **out);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_MTRAIN_H */
