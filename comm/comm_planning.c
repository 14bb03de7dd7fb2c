/* comm_planning.c: the planning communicator ("planning"): one process
 * stands for any rank of a ring of any size, for the work that needs only
 * the rank, the size and all-gathers of what every rank would contribute
 * alike (building a rank's plan, its memory bound, its predicted cost). Its
 * all-gather gives every slot this rank's contribution; point-to-point,
 * all-reduce and split fail, naming the operation. No dependency. */
#include <stdlib.h>
#include <string.h>

#include "mtrain/mtrain_comm.h"
#include "mtrain/mtrain_error.h"

typedef struct planning_state {
  int rank, size;
} planning_state_t;

static int planning_rank(void *state) { return ((planning_state_t *)state)->rank; }

static int planning_size(void *state) { return ((planning_state_t *)state)->size; }

static mtrain_status_t refuse(const char *what) {
  return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                      "planning communicator: %s is not available (it stands for one rank of a "
                      "ring in one process, to build plans; run attention over a real "
                      "communicator)",
                      what);
}

static mtrain_status_t planning_isend(void *state, const void *buf, size_t bytes, int peer, int tag,
                                      mtrain_comm_request_t **req) {
  (void)state, (void)buf, (void)bytes, (void)peer, (void)tag, (void)req;
  return refuse("isend");
}

static mtrain_status_t planning_irecv(void *state, void *buf, size_t bytes, int peer, int tag,
                                      mtrain_comm_request_t **req) {
  (void)state, (void)buf, (void)bytes, (void)peer, (void)tag, (void)req;
  return refuse("irecv");
}

static mtrain_status_t planning_wait(void *state, mtrain_comm_request_t *req) {
  (void)state;
  return req ? refuse("wait") : MTRAIN_SUCCESS;
}

static mtrain_status_t planning_allreduce(void *state, void *buf, int64_t count,
                                          mtrain_dtype_t dtype, mtrain_reduce_op_t op) {
  (void)state, (void)buf, (void)count, (void)dtype, (void)op;
  return refuse("allreduce");
}

static mtrain_status_t planning_allgather(void *state, const void *send, void *recv, size_t bytes) {
  const planning_state_t *s = state;
  for (int r = 0; r < s->size; r++) memmove((char *)recv + (size_t)r * bytes, send, bytes);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t planning_barrier(void *state) {
  (void)state;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t planning_split(void *state, int color, int key, mtrain_comm_t **out) {
  (void)state, (void)color, (void)key, (void)out;
  return refuse("split");
}

static void planning_abort(void *state, int code) { (void)state, (void)code; }

static void planning_destroy(void *state) { free(state); }

static const mtrain_comm_ops_t planning_ops = {
    .api_version = MTRAIN_API_VERSION,
    .name = "planning",
    .memory_space = MTRAIN_MEMORY_ANY,
    .rank = planning_rank,
    .size = planning_size,
    .isend = planning_isend,
    .irecv = planning_irecv,
    .wait = planning_wait,
    .allreduce = planning_allreduce,
    .allgather = planning_allgather,
    .barrier = planning_barrier,
    .split = planning_split,
    .abort = planning_abort,
    .destroy = planning_destroy,
};

mtrain_status_t mtrain_comm_create_planning(int rank, int size, mtrain_comm_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  if (size < 1 || rank < 0 || rank >= size)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "planning communicator: rank %d of size %d (need 0 <= rank < size)", rank,
                        size);
  mtrain_comm_t *c = calloc(1, sizeof *c);
  planning_state_t *s = calloc(1, sizeof *s);
  if (!c || !s) {
    free(c);
    free(s);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "planning communicator: out of memory");
  }
  s->rank = rank;
  s->size = size;
  c->ops = &planning_ops;
  c->state = s;
  *out = c;
  return MTRAIN_SUCCESS;
}
