/* comm_mpi.c: the "mpi" communicator (mtrain_mpi.h): point-to-point and
 * collectives on a duplicate of the caller's MPI_Comm with MPI_ERRORS_RETURN,
 * every wait bounded by a timeout (non-blocking operations polled with
 * MPI_Test), MPI errors mapped to MTRAIN_ERR_COMM with MPI's own text. Host
 * buffers.
 *
 * A timeout or an MPI error leaves the communicator broken: its later calls
 * fail at once with MTRAIN_ERR_COMM naming the first error (the ranks are out
 * of step, and a message of the abandoned exchange could otherwise be taken
 * for one of the next). A collective that timed out is abandoned, never
 * cancelled (MPI cannot cancel a non-blocking collective: Open MPI's
 * MPI_Cancel on one ends the job with MPI_ERR_REQUEST); it ran on private
 * copies of the caller's buffers, which stay allocated (with its request)
 * since MPI may still write to them, so the caller's memory is never touched
 * after the call returns. */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_mpi.h"

struct mtrain_comm_request {
  MPI_Request request;
  int peer, is_send;
  size_t bytes;
};

typedef struct mpi_state {
  MPI_Comm comm;
  int rank, size;
  double timeout;
  int broken;      /* a timeout or MPI error happened: every later call fails */
  char cause[512]; /* the message of that first error */
} mpi_state_t;

/* Marks the communicator broken after the error just reported (its message
 * is the last error) and returns its status. */
static mtrain_status_t set_broken(mpi_state_t *s, mtrain_status_t st) {
  if (!s->broken) snprintf(s->cause, sizeof s->cause, "%s", mtrain_last_error());
  s->broken = 1;
  return st;
}

/* Fails at once when an earlier call broke the communicator. */
static mtrain_status_t check_usable(const mpi_state_t *s, const char *what) {
  if (!s->broken) return MTRAIN_SUCCESS;
  return mtrain_error(MTRAIN_ERR_COMM,
                      "rank %d: %s on the mpi communicator refused: it is unusable after an "
                      "earlier error (%s); destroy it",
                      s->rank, what, s->cause);
}

static mtrain_status_t mpi_failed(int code, const char *what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return mtrain_error(MTRAIN_ERR_COMM, "MPI %s failed: %s", what, text);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Polls a request until done or the timeout. peer >= 0: a point-to-point
 * request, cancelled on timeout (MPI allows it); peer < 0: a collective,
 * abandoned on timeout (MPI does not allow cancelling it). Either way the
 * communicator is then broken. */
static mtrain_status_t wait_bounded(mpi_state_t *s, MPI_Request *req, const char *what, int peer,
                                    MPI_Status *status) {
  const double deadline = now() + s->timeout;
  struct timespec nap = {0, 20000}; /* 20 us, doubling to 1 ms */
  for (;;) {
    int done = 0;
    int rc = MPI_Test(req, &done, status ? status : MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      mtrain_status_t e = mpi_failed(rc, what);
      e = peer >= 0 ? mtrain_error_prefix(e, "rank %d, with rank %d", s->rank, peer)
                    : mtrain_error_prefix(e, "rank %d", s->rank);
      return set_broken(s, e);
    }
    if (done) return MTRAIN_SUCCESS;
    if (now() > deadline) {
      if (peer >= 0) {
        MPI_Cancel(req);
        return set_broken(s, mtrain_error(MTRAIN_ERR_TIMEOUT,
                                          "rank %d: %s with rank %d did not complete within %.1f "
                                          "s (the peer died or stopped answering)",
                                          s->rank, what, peer, s->timeout));
      }
      return set_broken(s, mtrain_error(MTRAIN_ERR_TIMEOUT,
                                        "rank %d: %s did not complete within %.1f s (a rank "
                                        "died or stopped answering); the collective was "
                                        "abandoned",
                                        s->rank, what, s->timeout));
    }
    nanosleep(&nap, NULL);
    if (nap.tv_nsec < 1000000) nap.tv_nsec *= 2;
  }
}

static int mpi_rank(void *state) { return ((mpi_state_t *)state)->rank; }
static int mpi_size(void *state) { return ((mpi_state_t *)state)->size; }

static mtrain_status_t check_p2p(mpi_state_t *s, size_t bytes, int peer, const char *what) {
  if (peer < 0 || peer >= s->size)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "mpi %s: peer %d out of range [0, %d)", what,
                        peer, s->size);
  if (bytes > INT_MAX)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                        "mpi %s: message of %zu bytes exceeds 2 GiB (split it)", what, bytes);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t post(mpi_state_t *s, void *buf, size_t bytes, int peer, int tag, int is_send,
                            mtrain_comm_request_t **out) {
  mtrain_status_t st = check_usable(s, is_send ? "a send" : "a receive");
  if (st) return st;
  st = check_p2p(s, bytes, peer, is_send ? "send" : "receive");
  if (st) return st;
  mtrain_comm_request_t *r = calloc(1, sizeof *r);
  if (!r) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "mpi: out of memory");
  r->peer = peer;
  r->is_send = is_send;
  r->bytes = bytes;
  int rc = is_send ? MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, tag, s->comm, &r->request)
                   : MPI_Irecv(buf, (int)bytes, MPI_BYTE, peer, tag, s->comm, &r->request);
  if (rc != MPI_SUCCESS) {
    free(r);
    return set_broken(s, mpi_failed(rc, is_send ? "Isend" : "Irecv"));
  }
  *out = r;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t mpi_isend(void *state, const void *buf, size_t bytes, int peer, int tag,
                                 mtrain_comm_request_t **req) {
  return post(state, (void *)buf, bytes, peer, tag, 1, req);
}

static mtrain_status_t mpi_irecv(void *state, void *buf, size_t bytes, int peer, int tag,
                                 mtrain_comm_request_t **req) {
  return post(state, buf, bytes, peer, tag, 0, req);
}

static mtrain_status_t mpi_wait(void *state, mtrain_comm_request_t *req) {
  if (!req) return MTRAIN_SUCCESS;
  mpi_state_t *s = state;
  MPI_Status status;
  mtrain_status_t st =
      check_usable(s, req->is_send ? "waiting for a send" : "waiting for a receive");
  if (st) {
    /* a request of the exchange that broke the communicator: dropped */
    int done = 0;
    MPI_Test(&req->request, &done, MPI_STATUS_IGNORE);
    if (!done) {
      MPI_Cancel(&req->request);
      MPI_Request_free(&req->request);
    }
    free(req);
    return st;
  }
  st = wait_bounded(s, &req->request, req->is_send ? "a send" : "a receive", req->peer, &status);
  if (!st && !req->is_send) {
    /* a shorter message completes a receive: a peer out of step must not
     * pass unnoticed */
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    if ((size_t)count != req->bytes)
      st = mtrain_error(MTRAIN_ERR_COMM,
                        "rank %d: received %d bytes from rank %d, expected %zu (the ranks do not "
                        "agree on the problem: tokens, heads or plan)",
                        s->rank, count, req->peer, req->bytes);
  }
  free(req);
  return st;
}

/* The buffer a collective runs on: private, because a collective that
 * timed out is abandoned and MPI may write to its buffer later. Freed only
 * when the collective completed. */
static void *private_buffer(size_t bytes) { return malloc(bytes ? bytes : 1); }

static mtrain_status_t mpi_allreduce(void *state, void *buf, int64_t count, mtrain_dtype_t dtype,
                                     mtrain_reduce_op_t op) {
  mpi_state_t *s = state;
  mtrain_status_t st = check_usable(s, "an all-reduce");
  if (st) return st;
  if (dtype != MTRAIN_F32 && dtype != MTRAIN_F64)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "mpi allreduce: dtype %s not supported",
                        mtrain_dtype_name(dtype));
  if (count < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "mpi allreduce: negative count %lld",
                        (long long)count);
  MPI_Datatype type = dtype == MTRAIN_F32 ? MPI_FLOAT : MPI_DOUBLE;
  const size_t esz = mtrain_dtype_size(dtype);
  /* chunks below 2^31 elements */
  for (int64_t off = 0; off < count; off += INT_MAX / 2) {
    const int n = (int)(count - off < INT_MAX / 2 ? count - off : INT_MAX / 2);
    char *mine = private_buffer((size_t)n * esz);
    if (!mine)
      return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "mpi allreduce: out of memory for %d values",
                          n);
    memcpy(mine, (char *)buf + (size_t)off * esz, (size_t)n * esz);
    MPI_Request req;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, mine, n, type,
                            op == MTRAIN_REDUCE_MAX ? MPI_MAX : MPI_SUM, s->comm, &req);
    if (rc != MPI_SUCCESS) {
      free(mine);
      return set_broken(s, mpi_failed(rc, "Iallreduce"));
    }
    char what[96];
    snprintf(what, sizeof what, "an all-reduce (%s of %d %s values)",
             op == MTRAIN_REDUCE_MAX ? "max" : "sum", n, mtrain_dtype_name(dtype));
    st = wait_bounded(s, &req, what, -1, NULL);
    if (st) return st; /* `mine` stays with the abandoned request */
    memcpy((char *)buf + (size_t)off * esz, mine, (size_t)n * esz);
    free(mine);
  }
  return MTRAIN_SUCCESS;
}

static mtrain_status_t mpi_allgather(void *state, const void *send, void *recv, size_t bytes) {
  mpi_state_t *s = state;
  mtrain_status_t st = check_usable(s, "an all-gather");
  if (st) return st;
  if (bytes > INT_MAX || bytes * (size_t)s->size / (size_t)s->size != bytes)
    return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED, "mpi allgather: %zu bytes per rank exceed 2 GiB",
                        bytes);
  char *mine = private_buffer(bytes * (size_t)(s->size + 1));
  if (!mine)
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "mpi allgather: out of memory for %zu bytes",
                        bytes * (size_t)(s->size + 1));
  memcpy(mine, send, bytes);
  MPI_Request req;
  int rc =
      MPI_Iallgather(mine, (int)bytes, MPI_BYTE, mine + bytes, (int)bytes, MPI_BYTE, s->comm, &req);
  if (rc != MPI_SUCCESS) {
    free(mine);
    return set_broken(s, mpi_failed(rc, "Iallgather"));
  }
  char what[96];
  snprintf(what, sizeof what, "an all-gather (%zu bytes per rank)", bytes);
  st = wait_bounded(s, &req, what, -1, NULL);
  if (st) return st; /* `mine` stays with the abandoned request */
  memcpy(recv, mine + bytes, bytes * (size_t)s->size);
  free(mine);
  return MTRAIN_SUCCESS;
}

static mtrain_status_t mpi_barrier(void *state) {
  mpi_state_t *s = state;
  mtrain_status_t st = check_usable(s, "a barrier");
  if (st) return st;
  MPI_Request req;
  int rc = MPI_Ibarrier(s->comm, &req);
  if (rc != MPI_SUCCESS) return set_broken(s, mpi_failed(rc, "Ibarrier"));
  return wait_bounded(s, &req, "a barrier", -1, NULL);
}

static mtrain_status_t wrap(MPI_Comm comm, double timeout, mtrain_comm_t **out);

/* MPI_Comm_split blocks and has no non-blocking form: the ranks first meet in
 * a bounded all-gather of their (color, key), so that a rank that died or
 * stalled ends the split with MTRAIN_ERR_TIMEOUT instead of a hang; the
 * split itself then starts only once every rank has arrived. */
static mtrain_status_t mpi_split(void *state, int color, int key, mtrain_comm_t **out) {
  mpi_state_t *s = state;
  mtrain_status_t st = check_usable(s, "a split");
  if (st) return st;
  const int mine[2] = {color, key};
  int *all = malloc(sizeof mine * (size_t)s->size);
  if (!all) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "mpi split: out of memory");
  st = mpi_allgather(s, mine, all, sizeof mine);
  free(all);
  if (st) return mtrain_error_prefix(st, "mpi split");
  MPI_Comm sub;
  int rc = MPI_Comm_split(s->comm, color, key, &sub);
  if (rc != MPI_SUCCESS) return set_broken(s, mpi_failed(rc, "Comm_split"));
  st = wrap(sub, s->timeout, out);
  if (st) MPI_Comm_free(&sub);
  return st;
}

static void mpi_abort(void *state, int code) { MPI_Abort(((mpi_state_t *)state)->comm, code); }

static void mpi_destroy(void *state) {
  mpi_state_t *s = state;
  int finalized = 0;
  MPI_Finalized(&finalized);
  /* a broken communicator may still have an abandoned collective on it:
   * its MPI communicator is left to MPI_Finalize */
  if (!finalized && !s->broken) MPI_Comm_free(&s->comm);
  free(s);
}

static const mtrain_comm_ops_t mpi_ops = {
    .api_version = MTRAIN_API_VERSION,
    .name = "mpi",
    .memory_space = MTRAIN_MEMORY_HOST,
    .rank = mpi_rank,
    .size = mpi_size,
    .isend = mpi_isend,
    .irecv = mpi_irecv,
    .wait = mpi_wait,
    .allreduce = mpi_allreduce,
    .allgather = mpi_allgather,
    .barrier = mpi_barrier,
    .split = mpi_split,
    .abort = mpi_abort,
    .destroy = mpi_destroy,
};

/* Takes ownership of `comm` (already private to mtrain). */
static mtrain_status_t wrap(MPI_Comm comm, double timeout, mtrain_comm_t **out) {
  mtrain_comm_t *c = calloc(1, sizeof *c);
  mpi_state_t *s = calloc(1, sizeof *s);
  if (!c || !s) {
    free(c);
    free(s);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "mpi communicator: out of memory");
  }
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  s->comm = comm;
  s->timeout = timeout;
  MPI_Comm_rank(comm, &s->rank);
  MPI_Comm_size(comm, &s->size);
  c->ops = &mpi_ops;
  c->state = s;
  *out = c;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_comm_create_mpi(MPI_Comm comm, double timeout_seconds, mtrain_comm_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized)
    return mtrain_error(MTRAIN_ERR_COMM, "mtrain_comm_create_mpi: MPI is not initialised "
                                         "(call MPI_Init_thread first)");
  if (timeout_seconds <= 0) {
    const char *env = getenv("MTRAIN_COMM_TIMEOUT");
    char *end = NULL;
    timeout_seconds = env ? strtod(env, &end) : MTRAIN_MPI_DEFAULT_TIMEOUT;
    if (env && (end == env || *end || !(timeout_seconds > 0)))
      return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                          "environment variable MTRAIN_COMM_TIMEOUT='%s' is not a positive number "
                          "of seconds",
                          env);
  }
  /* the duplication is collective: non-blocking and bounded too, so that a
   * rank that never calls ends it with MTRAIN_ERR_TIMEOUT */
  mpi_state_t tmp = {.comm = comm, .timeout = timeout_seconds};
  MPI_Comm_rank(comm, &tmp.rank);
  /* MPI writes the new handle when the duplication completes: heap memory,
   * left allocated if the duplication is abandoned */
  MPI_Comm *dup = malloc(sizeof *dup);
  if (!dup) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "mpi communicator: out of memory");
  MPI_Request req;
  int rc = MPI_Comm_idup(comm, dup, &req);
  if (rc != MPI_SUCCESS) {
    free(dup);
    return mpi_failed(rc, "Comm_idup");
  }
  mtrain_status_t st = wait_bounded(
      &tmp, &req, "mtrain_comm_create_mpi: the duplication of the communicator", -1, NULL);
  if (st) return st; /* abandoned with its request and `dup` */
  MPI_Comm made = *dup;
  free(dup);
  st = wrap(made, timeout_seconds, out);
  if (st) MPI_Comm_free(&made);
  return st;
}
