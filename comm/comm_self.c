/* comm_self.c: the single-rank communicator ("self"). Collectives are the
 * identity; point-to-point to rank 0 copies through a one-message mailbox so
 * that a one-rank ring behaves like any other ring. No dependency. */
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_error.h"

struct mtrain_comm_request {
  int is_send;
  void *buf;
  size_t bytes;
};

typedef struct self_state {
  const void *pending_send; /* posted send waiting for its receive */
  size_t pending_bytes;
} self_state_t;

static int self_rank(void *state) {
  (void)state;
  return 0;
}

static int self_size(void *state) {
  (void)state;
  return 1;
}

static mtrain_status_t check_peer(int peer) {
  if (peer != 0)
    return mtrain_error(MTRAIN_ERR_COMM, "self communicator: peer %d does not exist (size 1)",
                        peer);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t self_isend(void *state, const void *buf, size_t bytes, int peer, int tag,
                                  mtrain_comm_request_t **req) {
  (void)tag;
  self_state_t *s = state;
  mtrain_status_t st = check_peer(peer);
  if (st) return st;
  if (s->pending_send)
    return mtrain_error(MTRAIN_ERR_COMM, "self communicator: a send is already pending");
  mtrain_comm_request_t *r = calloc(1, sizeof *r);
  if (!r) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "self communicator: out of memory");
  s->pending_send = buf;
  s->pending_bytes = bytes;
  r->is_send = 1;
  *req = r;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t self_irecv(void *state, void *buf, size_t bytes, int peer, int tag,
                                  mtrain_comm_request_t **req) {
  (void)state;
  (void)tag;
  mtrain_status_t st = check_peer(peer);
  if (st) return st;
  mtrain_comm_request_t *r = calloc(1, sizeof *r);
  if (!r) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "self communicator: out of memory");
  r->buf = buf;
  r->bytes = bytes;
  *req = r;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t self_wait(void *state, mtrain_comm_request_t *req) {
  self_state_t *s = state;
  if (!req) return MTRAIN_SUCCESS;
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (!req->is_send) {
    if (!s->pending_send)
      st = mtrain_error(MTRAIN_ERR_TIMEOUT, "self communicator: receive from rank 0 has no "
                                            "matching send (would wait forever)");
    else if (s->pending_bytes != req->bytes)
      st = mtrain_error(MTRAIN_ERR_COMM,
                        "self communicator: receive of %zu bytes matched a send of %zu bytes",
                        req->bytes, s->pending_bytes);
    else {
      memmove(req->buf, s->pending_send, req->bytes);
      s->pending_send = NULL;
    }
  }
  free(req);
  return st;
}

static mtrain_status_t self_allreduce(void *state, void *buf, int64_t count, mtrain_dtype_t dtype,
                                      mtrain_reduce_op_t op) {
  (void)state;
  (void)buf;
  (void)count;
  (void)op;
  if (dtype != MTRAIN_F32 && dtype != MTRAIN_F64)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "allreduce: dtype %s not supported",
                        mtrain_dtype_name(dtype));
  return MTRAIN_SUCCESS;
}

static mtrain_status_t self_allgather(void *state, const void *send, void *recv, size_t bytes) {
  (void)state;
  memmove(recv, send, bytes);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t self_barrier(void *state) {
  (void)state;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t self_split(void *state, int color, int key, mtrain_comm_t **out) {
  (void)state;
  (void)color;
  (void)key;
  return mtrain_comm_create_self(out);
}

static void self_abort(void *state, int code) {
  (void)state;
  (void)code;
}

static void self_destroy(void *state) { free(state); }

static const mtrain_comm_ops_t self_ops = {
    .api_version = MTRAIN_API_VERSION,
    .name = "self",
    .memory_space = MTRAIN_MEMORY_ANY,
    .rank = self_rank,
    .size = self_size,
    .isend = self_isend,
    .irecv = self_irecv,
    .wait = self_wait,
    .allreduce = self_allreduce,
    .allgather = self_allgather,
    .barrier = self_barrier,
    .split = self_split,
    .abort = self_abort,
    .destroy = self_destroy,
};

mtrain_status_t mtrain_comm_create_self(mtrain_comm_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_comm_t *c = calloc(1, sizeof *c);
  self_state_t *s = calloc(1, sizeof *s);
  if (!c || !s) {
    free(c);
    free(s);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "self communicator: out of memory");
  }
  c->ops = &self_ops;
  c->state = s;
  *out = c;
  return MTRAIN_SUCCESS;
}

void mtrain_comm_destroy(mtrain_comm_t *comm) {
  if (!comm) return;
  if (comm->ops && comm->ops->destroy) comm->ops->destroy(comm->state);
  free(comm);
}

mtrain_status_t mtrain_comm_split(mtrain_comm_t *comm, int color, int key, mtrain_comm_t **out) {
  MTRAIN_CHECK_NOT_NULL(comm);
  MTRAIN_CHECK_NOT_NULL(out);
  if (color < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "comm split: color %d is negative", color);
  return comm->ops->split(comm->state, color, key, out);
}

int mtrain_comm_rank(const mtrain_comm_t *comm) {
  return comm && comm->ops ? comm->ops->rank(comm->state) : 0;
}

int mtrain_comm_size(const mtrain_comm_t *comm) {
  return comm && comm->ops ? comm->ops->size(comm->state) : 1;
}
