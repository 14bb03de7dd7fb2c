/* comm_nccl.c: the "nccl" communicator (mtrain_nccl.h): one NCCL
 * communicator and stream per traffic class, split from a base communicator
 * in non-blocking mode; receives deferred into the group of the next send of
 * their class; transfers ordered after the data stream through events;
 * host-side collectives staged through a device buffer, the device
 * all-reduce in place; every wait polled
 * against a deadline, with ncclCommAbort on timeout or NCCL error (every
 * communicator at once, one thread each), the first error kept as the cause
 * named by every later call. */
#include <cuda_runtime.h>
/* nccl.h declares a few functions without prototypes */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mtrain/mtrain_error.h"
#include "mtrain/mtrain_nccl.h"

enum { CH_P2P = 0, CH_OUTER = 1, CH_INNER_PARTIAL = 2, CH_PARTIAL = 3, CH_COLL = 4, CH_COUNT = 5 };

struct mtrain_comm_request {
  int channel, peer, tag, is_send, launched;
  void *buf;
  size_t bytes;
  cudaEvent_t done;
  struct mtrain_comm_request *next_pending; /* deferred receives of a channel */
};

typedef struct nccl_state {
  int rank, size, device, failed;
  double timeout;
  ncclComm_t base; /* owned unless borrowed */
  int borrowed;
  ncclComm_t ch[CH_COUNT];
  cudaStream_t stream[CH_COUNT];
  cudaStream_t data_stream;
  cudaEvent_t data_ready;
  mtrain_comm_request_t *pending[CH_COUNT];
  void *coll_buf;
  size_t coll_cap;
  char cause[512]; /* the error that aborted the communicators */
} nccl_state_t;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void nap(struct timespec *t) {
  nanosleep(t, NULL);
  if (t->tv_nsec < 1000000) t->tv_nsec *= 2;
}

typedef struct abort_job {
  ncclComm_t comm;
  int device, started;
  pthread_t thread;
} abort_job_t;

static void *abort_one(void *arg) {
  abort_job_t *j = arg;
  cudaSetDevice(j->device);
  ncclCommAbort(j->comm);
  return NULL;
}

/* Aborts every communicator at once, one thread each. One after another
 * would deadlock when a peer died with kernels of several channels in
 * flight: ncclCommAbort frees device memory, and cudaFree waits for the
 * whole device, so the first abort would wait for a kernel of a channel not
 * aborted yet, which spins until the dead peer answers. */
static void abort_all(nccl_state_t *s) {
  if (s->failed) return;
  s->failed = 1;
  abort_job_t jobs[CH_COUNT + 1];
  int n = 0;
  for (int c = 0; c < CH_COUNT; c++)
    if (s->ch[c]) jobs[n++] = (abort_job_t){.comm = s->ch[c], .device = s->device};
  if (s->base && !s->borrowed) jobs[n++] = (abort_job_t){.comm = s->base, .device = s->device};
  for (int i = 0; i < n; i++)
    jobs[i].started = pthread_create(&jobs[i].thread, NULL, abort_one, &jobs[i]) == 0;
  for (int i = 0; i < n; i++) {
    if (jobs[i].started)
      pthread_join(jobs[i].thread, NULL);
    else
      abort_one(&jobs[i]);
  }
  for (int c = 0; c < CH_COUNT; c++) s->ch[c] = NULL;
  s->base = NULL;
}

/* Records the message of the error that aborted the communicators (the
 * first) and returns its status. */
static mtrain_status_t keep_cause(nccl_state_t *s, mtrain_status_t st) {
  if (!s->cause[0]) snprintf(s->cause, sizeof s->cause, "%s", mtrain_last_error());
  return st;
}

static mtrain_status_t nccl_failed(nccl_state_t *s, ncclResult_t r, const char *what) {
  const char *last = ncclGetLastError(NULL);
  mtrain_status_t st =
      mtrain_error(MTRAIN_ERR_COMM, "rank %d: NCCL %s failed: %s%s%s", s->rank, what,
                   ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
  keep_cause(s, st);
  abort_all(s);
  return st;
}

static mtrain_status_t cuda_failed(nccl_state_t *s, cudaError_t e, const char *what) {
  cudaGetLastError();
  return mtrain_error(e == cudaErrorMemoryAllocation ? MTRAIN_ERR_OUT_OF_MEMORY : MTRAIN_ERR_COMM,
                      "rank %d: nccl communicator: %s: %s", s->rank, what, cudaGetErrorString(e));
}

static mtrain_status_t check_usable(nccl_state_t *s) {
  if (s->failed)
    return mtrain_error(MTRAIN_ERR_COMM,
                        "rank %d: the nccl communicator was aborted after an earlier error (%s); "
                        "destroy it",
                        s->rank, s->cause[0] ? s->cause : "no message");
  return MTRAIN_SUCCESS;
}

/* Waits (polling) until a non-blocking NCCL call on `comm` has settled. */
static mtrain_status_t settle(nccl_state_t *s, ncclComm_t comm, ncclResult_t r, const char *what) {
  if (r != ncclSuccess && r != ncclInProgress) return nccl_failed(s, r, what);
  const double deadline = now() + s->timeout;
  struct timespec t = {0, 10000};
  while (r == ncclInProgress) {
    ncclResult_t a = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm, &a);
    if (q != ncclSuccess) return nccl_failed(s, q, what);
    if (a != ncclInProgress) {
      if (a != ncclSuccess) return nccl_failed(s, a, what);
      break;
    }
    if (now() > deadline) {
      keep_cause(s, mtrain_error(MTRAIN_ERR_TIMEOUT,
                                 "rank %d: NCCL %s did not settle within %.1f s (a rank died or "
                                 "stopped answering)",
                                 s->rank, what, s->timeout));
      abort_all(s);
      return MTRAIN_ERR_TIMEOUT;
    }
    nap(&t);
  }
  return MTRAIN_SUCCESS;
}

/* Waits for an event, watching the channel's communicator for errors. */
static mtrain_status_t wait_event(nccl_state_t *s, cudaEvent_t ev, int channel, const char *what,
                                  int peer) {
  const double deadline = now() + s->timeout;
  struct timespec t = {0, 10000};
  for (;;) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return MTRAIN_SUCCESS;
    if (e != cudaErrorNotReady) return cuda_failed(s, e, what);
    ncclResult_t a = ncclSuccess;
    if (s->ch[channel] && ncclCommGetAsyncError(s->ch[channel], &a) == ncclSuccess &&
        a != ncclSuccess && a != ncclInProgress)
      return nccl_failed(s, a, what);
    if (now() > deadline) {
      if (peer >= 0)
        mtrain_error(MTRAIN_ERR_TIMEOUT,
                     "rank %d: %s with rank %d did not complete within %.1f s (the peer died or "
                     "stopped answering)",
                     s->rank, what, peer, s->timeout);
      else
        mtrain_error(MTRAIN_ERR_TIMEOUT,
                     "rank %d: %s did not complete within %.1f s (a rank died or stopped "
                     "answering)",
                     s->rank, what, s->timeout);
      keep_cause(s, MTRAIN_ERR_TIMEOUT);
      abort_all(s);
      return MTRAIN_ERR_TIMEOUT;
    }
    nap(&t);
  }
}

static int channel_of(int tag) {
  switch (tag) {
  case 11:
    return CH_P2P;
  case 12:
    return CH_OUTER;
  case 13:
    return CH_INNER_PARTIAL;
  default:
    return tag >= 100 ? CH_PARTIAL : CH_P2P;
  }
}

static int nccl_rank(void *state) { return ((nccl_state_t *)state)->rank; }
static int nccl_size(void *state) { return ((nccl_state_t *)state)->size; }

/* The channel stream waits for the work queued on the data stream so far. */
static mtrain_status_t after_data(nccl_state_t *s, int c) {
  cudaError_t e = cudaEventRecord(s->data_ready, s->data_stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(s->stream[c], s->data_ready, 0);
  return e == cudaSuccess ? MTRAIN_SUCCESS : cuda_failed(s, e, "ordering after the data stream");
}

/* Whether deferred receive q goes into the group launched for `send` (the
 * receives of its tag) or for the wait on `only` (itself alone). */
static int joins(const mtrain_comm_request_t *q, const mtrain_comm_request_t *send,
                 const mtrain_comm_request_t *only) {
  return send ? q->tag == send->tag : q == only;
}

/* Launches, as one NCCL group on channel c, either `send` with the deferred
 * receives of its tag, or (send == NULL) the deferred receive `only`; records
 * each launched request's completion event and unlinks it from the pending
 * list. */
static mtrain_status_t launch(nccl_state_t *s, int c, mtrain_comm_request_t *send,
                              mtrain_comm_request_t *only) {
  mtrain_status_t st = after_data(s, c);
  if (st) return st;
  ncclResult_t r = ncclGroupStart();
  for (mtrain_comm_request_t *q = s->pending[c]; q && r == ncclSuccess; q = q->next_pending)
    if (joins(q, send, only))
      r = ncclRecv(q->buf, q->bytes, ncclUint8, q->peer, s->ch[c], s->stream[c]);
  if (send && r == ncclSuccess)
    r = ncclSend(send->buf, send->bytes, ncclUint8, send->peer, s->ch[c], s->stream[c]);
  ncclResult_t r2 = ncclGroupEnd();
  if (r != ncclSuccess) return nccl_failed(s, r, "point-to-point group");
  if ((st = settle(s, s->ch[c], r2, "point-to-point group"))) return st;
  for (mtrain_comm_request_t **p = &s->pending[c]; *p;) {
    mtrain_comm_request_t *q = *p;
    if (!joins(q, send, only)) {
      p = &q->next_pending;
      continue;
    }
    q->launched = 1;
    cudaEventRecord(q->done, s->stream[c]);
    *p = q->next_pending;
    q->next_pending = NULL;
  }
  if (send) {
    send->launched = 1;
    cudaError_t e = cudaEventRecord(send->done, s->stream[c]);
    if (e != cudaSuccess) return cuda_failed(s, e, "cudaEventRecord");
  }
  return MTRAIN_SUCCESS;
}

static mtrain_status_t make_request(nccl_state_t *s, void *buf, size_t bytes, int peer, int tag,
                                    int is_send, mtrain_comm_request_t **out) {
  mtrain_status_t st = check_usable(s);
  if (st) return st;
  /* (a transfer to this rank itself is allowed: NCCL pairs it within the group) */
  if (peer < 0 || peer >= s->size)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "nccl %s: peer %d out of range [0, %d)",
                        is_send ? "send" : "receive", peer, s->size);
  mtrain_comm_request_t *r = calloc(1, sizeof *r);
  if (!r) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "nccl: out of host memory");
  cudaError_t e = cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    free(r);
    return cuda_failed(s, e, "cudaEventCreate");
  }
  r->channel = channel_of(tag);
  r->tag = tag;
  r->peer = peer;
  r->is_send = is_send;
  r->buf = buf;
  r->bytes = bytes;
  *out = r;
  return MTRAIN_SUCCESS;
}

static void request_free(mtrain_comm_request_t *r) {
  if (!r) return;
  cudaEventDestroy(r->done);
  free(r);
}

static mtrain_status_t nccl_isend(void *state, const void *buf, size_t bytes, int peer, int tag,
                                  mtrain_comm_request_t **req) {
  nccl_state_t *s = state;
  mtrain_comm_request_t *r = NULL;
  mtrain_status_t st = make_request(s, (void *)buf, bytes, peer, tag, 1, &r);
  if (st) return st;
  if ((st = launch(s, r->channel, r, NULL))) {
    request_free(r);
    return st;
  }
  *req = r;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t nccl_irecv(void *state, void *buf, size_t bytes, int peer, int tag,
                                  mtrain_comm_request_t **req) {
  nccl_state_t *s = state;
  mtrain_comm_request_t *r = NULL;
  mtrain_status_t st = make_request(s, buf, bytes, peer, tag, 0, &r);
  if (st) return st;
  /* appended, so a group posts receives in the order they were asked for */
  mtrain_comm_request_t **tail = &s->pending[r->channel];
  while (*tail) tail = &(*tail)->next_pending;
  *tail = r;
  *req = r;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t nccl_wait(void *state, mtrain_comm_request_t *req) {
  nccl_state_t *s = state;
  if (!req) return MTRAIN_SUCCESS;
  mtrain_status_t st = check_usable(s);
  if (!st && !req->launched) st = launch(s, req->channel, NULL, req);
  if (!st)
    st = wait_event(s, req->done, req->channel, req->is_send ? "a send" : "a receive", req->peer);
  /* a request that never launched is unlinked from its pending list */
  for (mtrain_comm_request_t **p = &s->pending[req->channel]; *p; p = &(*p)->next_pending)
    if (*p == req) {
      *p = req->next_pending;
      break;
    }
  request_free(req);
  return st;
}

static mtrain_status_t coll_buffer(nccl_state_t *s, size_t bytes) {
  if (bytes <= s->coll_cap) return MTRAIN_SUCCESS;
  if (s->coll_buf) cudaFree(s->coll_buf);
  s->coll_buf = NULL;
  s->coll_cap = 0;
  cudaError_t e = cudaMalloc(&s->coll_buf, bytes);
  if (e != cudaSuccess) return cuda_failed(s, e, "staging buffer of a collective");
  s->coll_cap = bytes;
  return MTRAIN_SUCCESS;
}

/* Runs one host-buffer collective through the device: copy in, op, copy out. */
static mtrain_status_t host_collective(nccl_state_t *s, const void *in, size_t in_bytes, void *outp,
                                       size_t out_bytes, int allgather, ncclDataType_t type,
                                       size_t count, ncclRedOp_t op, const char *what) {
  mtrain_status_t st = check_usable(s);
  if (st) return st;
  if ((st = coll_buffer(s, in_bytes + out_bytes + 16))) return st;
  cudaStream_t str = s->stream[CH_COLL];
  char *dev_in = s->coll_buf, *dev_out = allgather ? dev_in + in_bytes : dev_in;
  cudaError_t e = cudaMemcpyAsync(dev_in, in, in_bytes, cudaMemcpyHostToDevice, str);
  if (e != cudaSuccess) return cuda_failed(s, e, what);
  ncclResult_t r = allgather
                       ? ncclAllGather(dev_in, dev_out, in_bytes, ncclUint8, s->ch[CH_COLL], str)
                       : ncclAllReduce(dev_in, dev_out, count, type, op, s->ch[CH_COLL], str);
  if ((st = settle(s, s->ch[CH_COLL], r, what))) return st;
  /* the collective itself is waited for (bounded) before the copy out: a
   * copy to pageable host memory returns only once the stream has reached
   * it, so behind a collective that a stalled peer holds up it would block
   * the host for ever, past the timeout */
  cudaEvent_t ev;
  if ((e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) != cudaSuccess)
    return cuda_failed(s, e, what);
  cudaEventRecord(ev, str);
  st = wait_event(s, ev, CH_COLL, what, -1);
  if (!st &&
      (e = cudaMemcpyAsync(outp, dev_out, out_bytes, cudaMemcpyDeviceToHost, str)) != cudaSuccess)
    st = cuda_failed(s, e, what);
  if (!st) {
    cudaEventRecord(ev, str);
    st = wait_event(s, ev, CH_COLL, what, -1);
  }
  cudaEventDestroy(ev);
  return st;
}

static mtrain_status_t nccl_allreduce(void *state, void *buf, int64_t count, mtrain_dtype_t dtype,
                                      mtrain_reduce_op_t op) {
  nccl_state_t *s = state;
  if (dtype != MTRAIN_F32 && dtype != MTRAIN_F64)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "nccl allreduce: dtype %s not supported",
                        mtrain_dtype_name(dtype));
  if (count <= 0) return MTRAIN_SUCCESS;
  const size_t bytes = (size_t)count * mtrain_dtype_size(dtype);
  return host_collective(s, buf, bytes, buf, bytes, 0,
                         dtype == MTRAIN_F32 ? ncclFloat32 : ncclFloat64, (size_t)count,
                         op == MTRAIN_REDUCE_MAX ? ncclMax : ncclSum, "an all-reduce");
}

/* The optional device all-reduce: in place on the caller's device memory,
 * no staging; waited for (bounded) like the host collectives. */
static mtrain_status_t nccl_allreduce_device(void *state, void *buf, int64_t count,
                                             mtrain_dtype_t dtype, mtrain_reduce_op_t op) {
  nccl_state_t *s = state;
  if (dtype != MTRAIN_F32 && dtype != MTRAIN_F64)
    return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE,
                        "nccl device allreduce: dtype %s not supported", mtrain_dtype_name(dtype));
  if (count <= 0) return MTRAIN_SUCCESS;
  mtrain_status_t st = check_usable(s);
  if (st) return st;
  const char *what = "a device all-reduce";
  cudaStream_t str = s->stream[CH_COLL];
  ncclResult_t r =
      ncclAllReduce(buf, buf, (size_t)count, dtype == MTRAIN_F32 ? ncclFloat32 : ncclFloat64,
                    op == MTRAIN_REDUCE_MAX ? ncclMax : ncclSum, s->ch[CH_COLL], str);
  if ((st = settle(s, s->ch[CH_COLL], r, what))) return st;
  cudaEvent_t ev;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e != cudaSuccess) return cuda_failed(s, e, what);
  if ((e = cudaEventRecord(ev, str)) != cudaSuccess)
    st = cuda_failed(s, e, what);
  else
    st = wait_event(s, ev, CH_COLL, what, -1);
  cudaEventDestroy(ev);
  return st;
}

static mtrain_status_t nccl_allgather(void *state, const void *send, void *recv, size_t bytes) {
  nccl_state_t *s = state;
  if (bytes == 0) return MTRAIN_SUCCESS;
  return host_collective(s, send, bytes, recv, bytes * (size_t)s->size, 1, ncclUint8, 0, ncclSum,
                         "an all-gather");
}

static mtrain_status_t nccl_barrier(void *state) {
  float one = 1.0f;
  return nccl_allreduce(state, &one, 1, MTRAIN_F32, MTRAIN_REDUCE_SUM);
}

static mtrain_status_t wrap(ncclComm_t base, int borrowed, int device, double timeout,
                            mtrain_comm_t **out);

static mtrain_status_t nccl_split(void *state, int color, int key, mtrain_comm_t **out) {
  nccl_state_t *s = state;
  mtrain_status_t st = check_usable(s);
  if (st) return st;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t sub = NULL;
  ncclComm_t parent = s->ch[CH_COLL];
  /* non-blocking: the new communicator is the one to poll */
  ncclResult_t r = ncclCommSplit(parent, color, key, &sub, &cfg);
  if ((st = settle(s, sub ? sub : parent, r, "ncclCommSplit"))) return st;
  /* the split is an operation of the parent too: it must settle before the next */
  if ((st = settle(s, parent, ncclInProgress, "ncclCommSplit (parent)"))) return st;
  st = wrap(sub, 0, s->device, s->timeout, out);
  if (st && sub) ncclCommDestroy(sub);
  return st;
}

static void nccl_abort(void *state, int code) {
  (void)code;
  abort_all(state);
}

static void nccl_destroy(void *state) {
  nccl_state_t *s = state;
  if (!s) return;
  cudaSetDevice(s->device);
  for (int c = 0; c < CH_COUNT; c++) {
    while (s->pending[c]) {
      mtrain_comm_request_t *r = s->pending[c];
      s->pending[c] = r->next_pending;
      request_free(r);
    }
  }
  if (!s->failed) {
    for (int c = 0; c < CH_COUNT; c++)
      if (s->stream[c]) cudaStreamSynchronize(s->stream[c]);
    for (int c = 0; c < CH_COUNT; c++)
      if (s->ch[c]) ncclCommDestroy(s->ch[c]);
    if (s->base && !s->borrowed) ncclCommDestroy(s->base);
  }
  for (int c = 0; c < CH_COUNT; c++)
    if (s->stream[c]) cudaStreamDestroy(s->stream[c]);
  if (s->data_ready) cudaEventDestroy(s->data_ready);
  if (s->coll_buf) cudaFree(s->coll_buf);
  free(s);
}

static mtrain_status_t nccl_set_data_stream(void *state, void *stream);

static const mtrain_comm_ops_t nccl_ops = {
    .api_version = MTRAIN_API_VERSION,
    .name = "nccl",
    .memory_space = MTRAIN_MEMORY_DEVICE,
    .rank = nccl_rank,
    .size = nccl_size,
    .isend = nccl_isend,
    .irecv = nccl_irecv,
    .wait = nccl_wait,
    .allreduce = nccl_allreduce,
    .allgather = nccl_allgather,
    .barrier = nccl_barrier,
    .split = nccl_split,
    .set_data_stream = nccl_set_data_stream,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
    .allreduce_device = nccl_allreduce_device,
};

static mtrain_status_t resolve_timeout(double *timeout) {
  if (*timeout > 0) return MTRAIN_SUCCESS;
  const char *env = getenv("MTRAIN_COMM_TIMEOUT");
  char *end = NULL;
  *timeout = env ? strtod(env, &end) : MTRAIN_NCCL_DEFAULT_TIMEOUT;
  if (env && (end == env || *end || !(*timeout > 0)))
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "environment variable MTRAIN_COMM_TIMEOUT='%s' is not a positive number "
                        "of seconds",
                        env);
  return MTRAIN_SUCCESS;
}

/* Wraps `base` (owned unless borrowed): splits the channel communicators off
 * it and creates their streams. Collective over base. */
static mtrain_status_t wrap(ncclComm_t base, int borrowed, int device, double timeout,
                            mtrain_comm_t **out) {
  mtrain_comm_t *c = calloc(1, sizeof *c);
  nccl_state_t *s = calloc(1, sizeof *s);
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (!c || !s) {
    free(c);
    free(s);
    return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "nccl communicator: out of host memory");
  }
  s->base = base;
  s->borrowed = borrowed;
  s->device = device;
  s->timeout = timeout;
  ncclResult_t r = ncclCommUserRank(base, &s->rank);
  if (r == ncclSuccess) r = ncclCommCount(base, &s->size);
  if (r != ncclSuccess) {
    st = nccl_failed(s, r, "ncclCommUserRank");
    goto cleanup;
  }
  for (int ch = 0; ch < CH_COUNT; ch++) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    /* the base must have settled (its creation, the previous split) */
    if ((st = settle(s, base, ncclInProgress, "waiting for the base communicator"))) goto cleanup;
    /* non-blocking: the new communicator is the one to poll */
    ncclResult_t rs = ncclCommSplit(base, 0, s->rank, &s->ch[ch], &cfg);
    if ((st = settle(s, s->ch[ch] ? s->ch[ch] : base, rs,
                     ch == 0 ? "ncclCommSplit (first)" : "ncclCommSplit (later)")))
      goto cleanup;
    /* the split is an operation of the parent too: it must settle before the next */
    if ((st = settle(s, base, ncclInProgress, "ncclCommSplit (parent)"))) goto cleanup;
    cudaError_t e = cudaStreamCreateWithFlags(&s->stream[ch], cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      st = cuda_failed(s, e, "cudaStreamCreate");
      goto cleanup;
    }
  }
  {
    cudaError_t e = cudaEventCreateWithFlags(&s->data_ready, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      st = cuda_failed(s, e, "cudaEventCreate");
      goto cleanup;
    }
  }
  c->ops = &nccl_ops;
  c->state = s;
  *out = c;
  return MTRAIN_SUCCESS;
cleanup:
  if (borrowed) s->base = NULL; /* never destroy the caller's */
  nccl_destroy(s);
  free(c);
  return st;
}

mtrain_status_t mtrain_nccl_unique_id(void *id) {
  MTRAIN_CHECK_NOT_NULL(id);
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess)
    return mtrain_error(MTRAIN_ERR_COMM, "ncclGetUniqueId failed: %s", ncclGetErrorString(r));
  memcpy(id, &u, sizeof u < MTRAIN_NCCL_ID_BYTES ? sizeof u : MTRAIN_NCCL_ID_BYTES);
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_comm_create_nccl(const void *id, int nranks, int rank, int device,
                                        double timeout_seconds, mtrain_comm_t **out) {
  MTRAIN_CHECK_NOT_NULL(id);
  MTRAIN_CHECK_NOT_NULL(out);
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "nccl: rank %d of %d ranks", rank, nranks);
  mtrain_status_t st = resolve_timeout(&timeout_seconds);
  if (st) return st;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return mtrain_error(MTRAIN_ERR_COMM, "nccl: cudaSetDevice(%d): %s", device,
                        cudaGetErrorString(e));
  }
  ncclUniqueId u;
  memcpy(&u, id, sizeof u);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t base = NULL;
  nccl_state_t tmp = {.rank = rank, .timeout = timeout_seconds};
  ncclResult_t r = ncclCommInitRankConfig(&base, nranks, u, rank, &cfg);
  if ((st = settle(&tmp, base, r, "ncclCommInitRankConfig"))) {
    if (base && !tmp.failed) ncclCommAbort(base);
    return st;
  }
  return wrap(base, 0, device, timeout_seconds, out);
}

mtrain_status_t mtrain_comm_create_nccl_from(void *nccl_comm, int device, double timeout_seconds,
                                             mtrain_comm_t **out) {
  MTRAIN_CHECK_NOT_NULL(nccl_comm);
  MTRAIN_CHECK_NOT_NULL(out);
  mtrain_status_t st = resolve_timeout(&timeout_seconds);
  if (st) return st;
  return wrap((ncclComm_t)nccl_comm, 1, device, timeout_seconds, out);
}

static mtrain_status_t nccl_set_data_stream(void *state, void *stream) {
  ((nccl_state_t *)state)->data_stream = (cudaStream_t)stream;
  return MTRAIN_SUCCESS;
}

mtrain_status_t mtrain_comm_nccl_set_data_stream(mtrain_comm_t *comm, void *stream) {
  MTRAIN_CHECK_NOT_NULL(comm);
  if (!mtrain_comm_is_nccl(comm))
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT, "not an nccl communicator");
  ((nccl_state_t *)comm->state)->data_stream = (cudaStream_t)stream;
  return MTRAIN_SUCCESS;
}

int mtrain_comm_is_nccl(const mtrain_comm_t *comm) { return comm && comm->ops == &nccl_ops; }

#ifdef MTRAIN_HAVE_MPI
/* Polls a non-blocking MPI collective on the caller's communicator until it
 * completes or the timeout passes. On timeout it is abandoned, not cancelled
 * (MPI cannot cancel a collective), and MTRAIN_ERR_TIMEOUT names it; its
 * buffers must then stay allocated. */
static mtrain_status_t mpi_bounded(MPI_Request *req, double timeout, int rank, const char *what) {
  const double deadline = now() + timeout;
  struct timespec t = {0, 10000};
  for (;;) {
    int done = 0;
    if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
      return mtrain_error(MTRAIN_ERR_COMM, "rank %d: nccl: MPI %s failed", rank, what);
    if (done) return MTRAIN_SUCCESS;
    if (now() > deadline)
      return mtrain_error(MTRAIN_ERR_TIMEOUT,
                          "rank %d: nccl: the MPI %s did not complete within %.1f s (a rank died "
                          "or stopped answering); abandoned",
                          rank, what, timeout);
    nap(&t);
  }
}

mtrain_status_t mtrain_comm_create_nccl_mpi(MPI_Comm comm, int device, double timeout_seconds,
                                            mtrain_comm_t **out) {
  MTRAIN_CHECK_NOT_NULL(out);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  mtrain_status_t st = resolve_timeout(&timeout_seconds);
  if (st) return st;
  /* the MPI collectives below are bounded by the timeout: non-blocking, on
   * heap buffers that an abandoned one keeps (MPI may still write them) */
  struct {
    int ok, all_ok;
    unsigned char id[MTRAIN_NCCL_ID_BYTES];
  } *x = calloc(1, sizeof *x);
  if (!x) return mtrain_error(MTRAIN_ERR_OUT_OF_MEMORY, "nccl: out of memory");
  MPI_Request req;
  if (device < 0) {
    /* MPI_Comm_split_type blocks: it starts once every rank has arrived */
    if (MPI_Ibarrier(comm, &req) != MPI_SUCCESS) {
      free(x);
      return mtrain_error(MTRAIN_ERR_COMM, "rank %d: nccl: MPI_Ibarrier failed", rank);
    }
    if ((st = mpi_bounded(&req, timeout_seconds, rank, "barrier before MPI_Comm_split_type")))
      return st;
    MPI_Comm host;
    int local = 0, ndev = 0;
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host);
    MPI_Comm_rank(host, &local);
    MPI_Comm_free(&host);
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
      cudaGetLastError();
      free(x);
      return mtrain_error(MTRAIN_ERR_COMM, "rank %d: nccl: no CUDA device", rank);
    }
    device = local % ndev;
  }
  if (rank == 0) st = mtrain_nccl_unique_id(x->id);
  x->ok = st == MTRAIN_SUCCESS;
  if (MPI_Iallreduce(&x->ok, &x->all_ok, 1, MPI_INT, MPI_MIN, comm, &req) != MPI_SUCCESS) {
    free(x);
    return mtrain_error(MTRAIN_ERR_COMM, "rank %d: nccl: MPI_Iallreduce failed", rank);
  }
  mtrain_status_t wst = mpi_bounded(&req, timeout_seconds, rank, "all-reduce of the id's status");
  if (wst) return wst;
  if (!x->all_ok) {
    free(x);
    return st ? st
              : mtrain_error(MTRAIN_ERR_COMM, "rank %d: nccl: rank 0 could not make an id", rank);
  }
  if (MPI_Ibcast(x->id, MTRAIN_NCCL_ID_BYTES, MPI_BYTE, 0, comm, &req) != MPI_SUCCESS) {
    free(x);
    return mtrain_error(MTRAIN_ERR_COMM, "rank %d: nccl: MPI_Ibcast of the unique id failed", rank);
  }
  if ((wst = mpi_bounded(&req, timeout_seconds, rank, "broadcast of the unique id"))) return wst;
  st = mtrain_comm_create_nccl(x->id, size, rank, device, timeout_seconds, out);
  free(x);
  return st;
}
#endif
