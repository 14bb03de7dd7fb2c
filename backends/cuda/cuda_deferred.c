/* cuda_deferred.c: stream-ordered calls of the CUDA backend
 * (mtrain_cuda_set_async): the backend table's async, deferred_scan and
 * deferred_poll slots. A deferred scan queues the NaN/Inf kernel, copies its
 * result into a pinned host word and records an event behind it; nothing
 * waits for the device until a record is reused CUDA_DEFERRED_MAX scans
 * later or the caller asks (mtrain_context_check_deferred). */
#include <cuda_runtime.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "backends/cuda/cuda_internal.h"
#include "mtrain/mtrain_error.h"

static const unsigned long long kNone = ~0ull;

int cuda_async_op(void *state) { return ((cuda_state_t *)state)->async; }

/* The pinned results, the device words and the events, made on first use. */
static mtrain_status_t deferred_ready(cuda_state_t *s) {
  if (s->deferred_host) return MTRAIN_SUCCESS;
  mtrain_status_t st = MTRAIN_SUCCESS;
  void *host = NULL, *dev = NULL;
  const size_t bytes = CUDA_DEFERRED_MAX * sizeof(unsigned long long);
  if ((st = cuda_check(cudaMallocHost(&host, bytes), "cudaMallocHost (deferred scans)"))) return st;
  if ((st = cuda_check(cudaMalloc(&dev, bytes), "cudaMalloc (deferred scans)"))) {
    cudaFreeHost(host);
    return st;
  }
  for (int i = 0; i < CUDA_DEFERRED_MAX && !st; i++) {
    cudaEvent_t ev = NULL;
    st = cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                    "cudaEventCreateWithFlags (deferred scans)");
    s->deferred[i].event = ev;
  }
  s->deferred_host = host;
  s->deferred_dev = dev;
  return st;
}

/* Reads record i if its scan is done (or, blocking, once it is): its finding
 * as MTRAIN_ERR_NONFINITE; the record is forgotten either way once read.
 * *done is 0 when a non-blocking read found the scan still running. */
static mtrain_status_t read_record(cuda_state_t *s, int i, int blocking, int *done) {
  cuda_deferred_t *r = &s->deferred[i];
  *done = 1;
  if (!r->pending) return MTRAIN_SUCCESS;
  cudaError_t e = blocking ? cudaEventSynchronize((cudaEvent_t)r->event)
                           : cudaEventQuery((cudaEvent_t)r->event);
  if (e == cudaErrorNotReady) {
    cudaGetLastError(); /* not an error: still running */
    *done = 0;
    return MTRAIN_SUCCESS;
  }
  r->pending = 0;
  if (e != cudaSuccess) return cuda_check(e, "waiting for a deferred output scan");
  const unsigned long long first = s->deferred_host[i];
  if (first == kNone) return MTRAIN_SUCCESS;
  const int64_t bad = (int64_t)first + r->row0 * r->row_width;
  return mtrain_error(MTRAIN_ERR_NONFINITE,
                      "%s at element %" PRId64 " (token %" PRId64 ", head %" PRId64
                      "); found by the scan of a stream-ordered call after the call had "
                      "returned (mtrain_cuda_set_async)",
                      r->what, bad, bad / r->row_width, (bad % r->row_width) / r->head_dim);
}

mtrain_status_t cuda_deferred_poll_op(void *state, int blocking) {
  cuda_state_t *s = state;
  if (!s->deferred_host) return MTRAIN_SUCCESS;
  cudaSetDevice(s->device);
  mtrain_status_t first = MTRAIN_SUCCESS;
  char message[1024] = "";
  /* oldest first: deferred_next is the next to be reused, the oldest */
  for (int n = 0; n < CUDA_DEFERRED_MAX; n++) {
    const int i = (s->deferred_next + n) % CUDA_DEFERRED_MAX;
    int done = 1;
    mtrain_status_t st = read_record(s, i, blocking, &done);
    if (st && !first) {
      first = st;
      snprintf(message, sizeof message, "%s", mtrain_last_error());
    }
  }
  if (first) return mtrain_error(first, "%s", message);
  return MTRAIN_SUCCESS;
}

mtrain_status_t cuda_deferred_scan_op(void *state, const void *ptr, mtrain_dtype_t dtype,
                                      int64_t count, int64_t row0, int64_t row_width,
                                      int64_t head_dim, const char *what) {
  cuda_state_t *s = state;
  if (!s->async)
    return mtrain_error(
        MTRAIN_ERR_NOT_SUPPORTED,
        "cuda: a deferred scan outside stream-ordered mode (mtrain_cuda_set_async)");
  if (row_width < 1 || head_dim < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "cuda deferred scan: row_width %" PRId64 " and head_dim %" PRId64
                        " must be positive",
                        row_width, head_dim);
  mtrain_status_t st = deferred_ready(s);
  if (st) return st;
  const int i = s->deferred_next;
  int done = 1;
  /* the record's previous scan, CUDA_DEFERRED_MAX scans ago: read before reuse */
  if ((st = read_record(s, i, 1, &done))) return st;
  cudaStream_t str = (cudaStream_t)s->stream;
  unsigned long long *word = s->deferred_dev + i;
  if ((st = cuda_queue_nonfinite(s, ptr, dtype, count, word))) return st;
  if ((st = cuda_check(
           cudaMemcpyAsync(s->deferred_host + i, word, sizeof *word, cudaMemcpyDeviceToHost, str),
           "deferred scan result")))
    return st;
  if ((st = cuda_check(cudaEventRecord((cudaEvent_t)s->deferred[i].event, str),
                       "cudaEventRecord (deferred scan)")))
    return st;
  cuda_deferred_t *r = &s->deferred[i];
  r->pending = 1;
  r->row0 = row0;
  r->row_width = row_width;
  r->head_dim = head_dim;
  snprintf(r->what, sizeof r->what, "%s", what ? what : "a tensor holds NaN or Inf");
  s->deferred_next = (i + 1) % CUDA_DEFERRED_MAX;
  return MTRAIN_SUCCESS;
}

void cuda_deferred_free(cuda_state_t *s) {
  for (int i = 0; i < CUDA_DEFERRED_MAX; i++)
    if (s->deferred[i].event) cudaEventDestroy((cudaEvent_t)s->deferred[i].event);
  if (s->deferred_host) cudaFreeHost(s->deferred_host);
  if (s->deferred_dev) cudaFree(s->deferred_dev);
  s->deferred_host = NULL;
  s->deferred_dev = NULL;
}
