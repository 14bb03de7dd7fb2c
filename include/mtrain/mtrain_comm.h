/* mtrain_comm.h: the communicator table, for users who bring their own
 * process groups and for authors of communicators.
 *
 * A communicator is a const table of operations plus an opaque state. The
 * ring driver uses it for K/V and dK/dV transfers and for the small
 * collectives of pattern estimation. Built in: "self" (one rank, no
 * dependency). "mpi" and "nccl" come with the distributed issues.
 */
#ifndef MTRAIN_COMM_H
#define MTRAIN_COMM_H

#include "mtrain.h"
#include "mtrain_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mtrain_comm_request mtrain_comm_request_t;

typedef enum mtrain_reduce_op { MTRAIN_REDUCE_SUM = 0, MTRAIN_REDUCE_MAX = 1 } mtrain_reduce_op_t;

/** The message tags of the ring driver. A communicator may use them to keep
 *  the ring's streams of messages apart (NCCL's channels, for example);
 *  the node partials of the backward pass use MTRAIN_TAG_RING_PARTIAL + o
 *  for outer step o. Tags below MTRAIN_TAG_USER are the library's. */
typedef enum mtrain_comm_tag {
  MTRAIN_TAG_RING_INNER = 11,         /**< K/V chunks around a node's inner ring */
  MTRAIN_TAG_RING_OUTER = 12,         /**< K/V chunks to the next node */
  MTRAIN_TAG_RING_INNER_PARTIAL = 13, /**< backward: dK/dV partial sums along the inner ring */
  MTRAIN_TAG_BLOCK_KEYS = 14,         /**< block selection: key chunks around the ring */
  MTRAIN_TAG_RING_PARTIAL = 100,      /**< backward: node partials to the chunk owner, + o */
  MTRAIN_TAG_USER = 1 << 20,          /**< first tag free for other users of the table */
} mtrain_comm_tag_t;

/** The communicator table. Every slot but set_data_stream and
 *  allreduce_device is required:
 *  mtrain_context_create refuses, with MTRAIN_ERR_INVALID_CONFIG naming the
 *  table and the field, a table whose api_version is not MTRAIN_API_VERSION
 *  or whose required slot is NULL. */
typedef struct mtrain_comm_ops {
  int32_t api_version; /**< MTRAIN_API_VERSION */
  const char *name;
  /** Where isend/irecv buffers must live (HOST, DEVICE, or ANY); the small
   *  collectives (allreduce, allgather) always take host buffers. */
  mtrain_memory_space_t memory_space;
  int (*rank)(void *state);
  int (*size)(void *state);
  /** Non-blocking point-to-point; buffers must stay valid until wait. */
  mtrain_status_t (*isend)(void *state, const void *buf, size_t bytes, int peer, int tag,
                           mtrain_comm_request_t **req);
  mtrain_status_t (*irecv)(void *state, void *buf, size_t bytes, int peer, int tag,
                           mtrain_comm_request_t **req);
  /** Completes and frees a request; fails with MTRAIN_ERR_TIMEOUT naming the
   *  peer after the communicator's timeout. */
  mtrain_status_t (*wait)(void *state, mtrain_comm_request_t *req);
  /** In-place all-reduce of `count` fp32 or fp64 elements. */
  mtrain_status_t (*allreduce)(void *state, void *buf, int64_t count, mtrain_dtype_t dtype,
                               mtrain_reduce_op_t op);
  /** Gathers `bytes` from every rank into recv (size * bytes, rank order). */
  mtrain_status_t (*allgather)(void *state, const void *send, void *recv, size_t bytes);
  mtrain_status_t (*barrier)(void *state);
  /** Collective: ranks with the same color form a new communicator, ordered
   *  by key then old rank (for the inner and outer rings). */
  mtrain_status_t (*split)(void *state, int color, int key, struct mtrain_comm **out);
  /** Optional: orders this communicator's transfers after the work queued
   *  on `stream` (the backend's data_stream). Called by the context when it
   *  is created and whenever the backend's stream changes. */
  mtrain_status_t (*set_data_stream)(void *state, void *stream);
  /** Ends the job's communication after an unrecoverable error. */
  void (*abort)(void *state, int code);
  void (*destroy)(void *state);
  /** Optional (since MTRAIN_API_VERSION 6): in-place all-reduce of `count`
   *  fp32 or fp64 elements in device memory of the device the communicator
   *  serves (where the backend allocates). Collective; blocking: returns once
   *  the result is in `buf`, and fails with MTRAIN_ERR_TIMEOUT after the
   *  communicator's timeout. The caller has finished the work that wrote
   *  `buf` (the library synchronises its backend first). NULL: the library
   *  copies such data to the host and uses `allreduce` (the pattern
   *  estimate's score arrays; with "nccl" they stay on the GPU). */
  mtrain_status_t (*allreduce_device)(void *state, void *buf, int64_t count, mtrain_dtype_t dtype,
                                      mtrain_reduce_op_t op);
} mtrain_comm_ops_t;

/** A communicator: a table plus its state. Owned by whoever created it. */
struct mtrain_comm {
  const mtrain_comm_ops_t *ops;
  void *state;
};

/** Collective split of a communicator (see mtrain_comm_ops_t.split); the
 *  caller destroys the result. */
MTRAIN_API mtrain_status_t mtrain_comm_split(mtrain_comm_t *comm, int color, int key,
                                             mtrain_comm_t **out);

/** Creates the single-rank communicator. */
MTRAIN_API mtrain_status_t mtrain_comm_create_self(mtrain_comm_t **out);
/** Creates the planning communicator: this process stands for rank `rank`
 *  of a ring of `size` ranks (0 <= rank < size, else
 *  MTRAIN_ERR_INVALID_ARGUMENT), so that a context over it builds that
 *  rank's plan (mtrain_plan_create_ring), memory bound and predicted cost
 *  without launching the other ranks. It assumes every rank plans the same
 *  problem: its all-gather gives every slot this rank's contribution, its
 *  barrier returns at once; point-to-point, all-reduce and split fail with
 *  MTRAIN_ERR_NOT_SUPPORTED naming the operation, so attention calls and
 *  estimates over it fail. Not collective; the caller destroys it (after
 *  the contexts that borrow it). */
MTRAIN_API mtrain_status_t mtrain_comm_create_planning(int rank, int size, mtrain_comm_t **out);
/** Destroys a communicator created by mtrain. NULL is a no-op. */
MTRAIN_API void mtrain_comm_destroy(mtrain_comm_t *comm);
MTRAIN_API int mtrain_comm_rank(const mtrain_comm_t *comm);
MTRAIN_API int mtrain_comm_size(const mtrain_comm_t *comm);

#ifdef __cplusplus
}
#endif

#endif /* MTRAIN_COMM_H */
