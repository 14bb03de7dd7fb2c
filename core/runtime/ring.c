/* ring.c: the ring driver (SPEC.md section 5): walks a ring plan's steps,
 * moving K/V chunks between ranks through the communicator while the
 * backend computes the current step. One algorithm covers both schedules:
 * the flat ring is the hierarchical one with a single node of W ranks. For
 * each outer step o the chunk held at its start is posted to the same local
 * rank of the next node, the inner ring runs L steps (double-buffered: the
 * next chunk is received from the previous local rank while the current one
 * is computed and sent on), then the received outer chunk is taken.
 * Backward: an fp32 (acc dtype) dK/dV partial travels with the chunk through
 * the inner ring: each rank computes its contribution from zero while the
 * partial of the ranks before it arrives, adds it, and sends the sum on at
 * the start of the next step, right after posting that step's receive (so
 * the sum has one fixed shape, whatever the message timing, and a
 * communicator that pairs a receive with the next send of its tag, as NCCL's
 * does, sees matched pairs around the ring). At the end of
 * each outer step the node's partial goes to the chunk's owner, which adds
 * the partials of the n nodes in outer-step order. A single rank is the ring
 * of one: one step on its own chunk, nothing copied or sent. */
#include <stdlib.h>
#include <string.h>

#include "core/layout/schedule.h"
#include "core/runtime/backend.h"
#include "core/runtime/context_internal.h"
#include "core/runtime/plan_internal.h"
#include "core/runtime/ring.h"
#include "mtrain/mtrain_error.h"

typedef struct comm_pair {
  mtrain_comm_request_t *send, *recv;
} comm_pair_t;

static mtrain_status_t exchange(mtrain_context_t *ctx, const void *send, void *recv, size_t bytes,
                                int to, int from, int tag, comm_pair_t *p) {
  mtrain_status_t st = mtrain_cm_irecv(ctx, recv, bytes, from, tag, &p->recv);
  if (st) return st;
  return mtrain_cm_isend(ctx, send, bytes, to, tag, &p->send);
}

static mtrain_status_t finish(mtrain_context_t *ctx, comm_pair_t *p) {
  mtrain_status_t st = MTRAIN_SUCCESS, st2 = MTRAIN_SUCCESS;
  if (p->send) st = mtrain_cm_wait(ctx, p->send);
  if (p->recv) st2 = mtrain_cm_wait(ctx, p->recv);
  p->send = p->recv = NULL;
  return st ? st : st2;
}

/* Everything one ring call holds, released in one place. */
typedef struct ring_buffers {
  void *chunk[4];    /* A, B: outer; C, D: inner. [K | V] (+ [dK | dV] backward) */
  void **partial_in; /* [n] partials arriving at this owner */
  void **partial_out;
  void *inner_partial; /* a partial arriving through the inner ring */
  int32_t n;
} ring_buffers_t;

static void buffers_free(mtrain_context_t *ctx, ring_buffers_t *b) {
  for (int i = 0; i < 4; i++) mtrain_be_free(ctx, b->chunk[i]);
  for (int32_t o = 0; b->partial_in && o < b->n; o++) {
    mtrain_be_free(ctx, b->partial_in[o]);
    mtrain_be_free(ctx, b->partial_out[o]);
  }
  mtrain_be_free(ctx, b->inner_partial);
  free(b->partial_in);
  free(b->partial_out);
}

/* Records the device timestamps of the steps (a device backend runs them
 * asynchronously) into the call's statistics: compute is the steps' own
 * spans, ring the first step's start to the last's end. */
static mtrain_status_t device_step_times(mtrain_context_t *ctx, int32_t total_steps) {
  double sum = 0.0, span = 0.0;
  for (int32_t t = 0; t < total_steps; t++) {
    double x = 0.0;
    mtrain_status_t st = mtrain_be_timer_elapsed(ctx, 2 * t, 2 * t + 1, &x);
    if (st) return st;
    sum += x;
  }
  mtrain_status_t st = mtrain_be_timer_elapsed(ctx, 0, 2 * total_steps - 1, &span);
  if (st) return st;
  ctx->last_stats.compute_seconds = sum;
  ctx->last_stats.ring_seconds = span;
  return MTRAIN_SUCCESS;
}

/* The ring of one: the rank's own chunk, gradients in place. */
static mtrain_status_t run_alone(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                 const mtrain_ring_args_t *a) {
  /* reading device timers waits for the step: not in stream-ordered mode */
  const int device_timing = mtrain_be_has_timer(ctx) && !mtrain_be_async(ctx);
  const double t0 = mtrain_now();
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (device_timing) MTRAIN_TRY(mtrain_be_timer_mark(ctx, 0));
  MTRAIN_TRY(a->step(ctx, plan, 0, a->k, a->v, a->backward ? a->dk_own : NULL,
                     a->backward ? a->dv_own : NULL, a->user));
  if (device_timing) MTRAIN_TRY(mtrain_be_timer_mark(ctx, 1));
  ctx->last_stats.compute_seconds = ctx->last_stats.ring_seconds = mtrain_now() - t0;
  ctx->last_stats.steps = 1;
  if (device_timing) MTRAIN_TRY(device_step_times(ctx, 1));
cleanup:
  return st;
}

mtrain_status_t mtrain_ring_run(mtrain_context_t *ctx, const mtrain_plan_t *plan,
                                const mtrain_ring_args_t *a) {
  if (plan->world == 1) return run_alone(ctx, plan, a);
  mtrain_ring_geometry_t g;
  const int backward = a->backward;
  const size_t kv_bytes = a->chunk_elems * mtrain_dtype_size(a->dtype);
  const size_t acc_bytes = a->chunk_elems * mtrain_dtype_size(mtrain_be_acc_dtype(ctx));
  const size_t chunk_bytes = 2 * kv_bytes + (backward ? 2 * acc_bytes : 0);
  mtrain_status_t st = mtrain_ring_geometry(plan->world, plan->ranks_per_node, plan->rank, &g);
  if (st != MTRAIN_SUCCESS) return st;
  ring_buffers_t b;
  memset(&b, 0, sizeof b);
  comm_pair_t inner = {0}, outer = {0};
  mtrain_comm_request_t **partial_recv = NULL, **partial_send = NULL, *pending_partial = NULL;
  b.n = g.n;
  /* only the buffers the schedule uses: B when there are several nodes, C
   * with an inner ring, D with an inner ring of three ranks or more */
  const int used[4] = {1, g.n > 1, g.L > 1, g.L > 2};
  for (int i = 0; i < 4; i++)
    if (used[i]) MTRAIN_TRY(mtrain_be_alloc(ctx, chunk_bytes, &b.chunk[i]));
  if (backward) {
    MTRAIN_TRY(mtrain_be_alloc(ctx, 2 * acc_bytes, &b.inner_partial));
    b.partial_in = calloc((size_t)g.n, sizeof(void *));
    b.partial_out = calloc((size_t)g.n, sizeof(void *));
    partial_recv = calloc((size_t)g.n, sizeof *partial_recv);
    partial_send = calloc((size_t)g.n, sizeof *partial_send);
    MTRAIN_FAIL_IF(!b.partial_in || !b.partial_out || !partial_recv || !partial_send,
                   MTRAIN_ERR_OUT_OF_MEMORY, "ring: out of memory");
    for (int32_t o = 0; o < g.n; o++) {
      MTRAIN_TRY(mtrain_be_alloc(ctx, 2 * acc_bytes, &b.partial_in[o]));
      MTRAIN_TRY(mtrain_be_alloc(ctx, 2 * acc_bytes, &b.partial_out[o]));
      const int from = mtrain_ring_geometry_partial_from(&g, o);
      MTRAIN_TRY(mtrain_cm_irecv(ctx, b.partial_in[o], 2 * acc_bytes, from,
                                 MTRAIN_TAG_RING_PARTIAL + o, &partial_recv[o]));
    }
  }
  const double ring_start = mtrain_now();
  /* a device backend's steps run asynchronously: time them on the device */
  const int32_t total_steps = g.n * g.L;
  const int device_timing = mtrain_be_has_timer(ctx) && total_steps <= 2048;
  /* the chunk held at the start of outer step 0 is this rank's own */
  MTRAIN_TRY(mtrain_be_copy(ctx, b.chunk[0], a->k, kv_bytes));
  MTRAIN_TRY(mtrain_be_copy(ctx, (char *)b.chunk[0] + kv_bytes, a->v, kv_bytes));
  int held = 0; /* index of the outer chunk in hand: 0 (A) or 1 (B) */
  for (int32_t o = 0; o < g.n; o++) {
    if (o + 1 < g.n)
      MTRAIN_TRY(exchange(ctx, b.chunk[held], b.chunk[1 - held], 2 * kv_bytes, g.outer_next,
                          g.outer_prev, MTRAIN_TAG_RING_OUTER, &outer));
    if (backward)
      MTRAIN_TRY(mtrain_be_memset_zero(ctx, (char *)b.chunk[held] + 2 * kv_bytes, 2 * acc_bytes));
    int cur = held, spare = 2;
    char *prev_chunk = NULL; /* the buffer of the previous inner step */
    for (int32_t i = 0; i < g.L; i++) {
      const int32_t t = o * g.L + i;
      char *chunk = b.chunk[cur];
      if (i + 1 < g.L) /* K/V of the chunk in hand go on while it is computed */
        MTRAIN_TRY(exchange(ctx, chunk, b.chunk[spare], 2 * kv_bytes, g.inner_next, g.inner_prev,
                            MTRAIN_TAG_RING_INNER, &inner));
      mtrain_comm_request_t *incoming = NULL;
      if (backward) {
        /* the send of two steps back read this buffer: done before it is zeroed */
        if (pending_partial) {
          MTRAIN_TRY(mtrain_cm_wait(ctx, pending_partial));
          pending_partial = NULL;
        }
        /* this rank's contribution starts from zero; the partial of the ranks
         * before it in the inner ring arrives meanwhile and is added after */
        MTRAIN_TRY(mtrain_be_memset_zero(ctx, chunk + 2 * kv_bytes, 2 * acc_bytes));
        if (i > 0) {
          MTRAIN_TRY(mtrain_cm_irecv(ctx, b.inner_partial, 2 * acc_bytes, g.inner_prev,
                                     MTRAIN_TAG_RING_INNER_PARTIAL, &incoming));
          /* the previous step's sum goes on now, posted after the receive so
           * that a communicator may pair them (NCCL groups them: a chain of
           * lone sends and receives around the ring could deadlock) */
          MTRAIN_TRY(mtrain_cm_isend(ctx, prev_chunk + 2 * kv_bytes, 2 * acc_bytes, g.inner_next,
                                     MTRAIN_TAG_RING_INNER_PARTIAL, &pending_partial));
        }
      }
      const double t0 = mtrain_now();
      if (device_timing) MTRAIN_TRY(mtrain_be_timer_mark(ctx, 2 * t));
      MTRAIN_TRY(a->step(ctx, plan, t, chunk, chunk + kv_bytes,
                         backward ? chunk + 2 * kv_bytes : NULL,
                         backward ? chunk + 2 * kv_bytes + acc_bytes : NULL, a->user));
      if (device_timing) MTRAIN_TRY(mtrain_be_timer_mark(ctx, 2 * t + 1));
      const double t1 = mtrain_now();
      ctx->last_stats.compute_seconds += t1 - t0;
      ctx->last_stats.steps++;
      if (backward) {
        if (incoming) {
          MTRAIN_TRY(mtrain_cm_wait(ctx, incoming));
          MTRAIN_TRY(mtrain_be_add(ctx, chunk + 2 * kv_bytes, b.inner_partial,
                                   mtrain_be_acc_dtype(ctx), 2 * (int64_t)a->chunk_elems));
        }
        prev_chunk = chunk; /* its sum is sent at the next step */
      }
      if (i + 1 < g.L) {
        const double w0 = mtrain_now();
        MTRAIN_TRY(finish(ctx, &inner));
        ctx->last_stats.wait_seconds += mtrain_now() - w0;
        const int next = spare;
        spare = cur == held ? 3 : cur;
        cur = next;
      }
    }
    if (pending_partial) {
      MTRAIN_TRY(mtrain_cm_wait(ctx, pending_partial));
      pending_partial = NULL;
    }
    if (backward) {
      /* the node's partial of the chunk in hand goes to the chunk's owner */
      const int32_t owner = mtrain_ring_geometry_source(&g, o * g.L + g.L - 1);
      MTRAIN_TRY(mtrain_be_copy(ctx, b.partial_out[o], (char *)b.chunk[cur] + 2 * kv_bytes,
                                2 * acc_bytes));
      MTRAIN_TRY(mtrain_cm_isend(ctx, b.partial_out[o], 2 * acc_bytes, owner,
                                 MTRAIN_TAG_RING_PARTIAL + o, &partial_send[o]));
    }
    if (o + 1 < g.n) {
      const double w0 = mtrain_now();
      MTRAIN_TRY(finish(ctx, &outer));
      ctx->last_stats.wait_seconds += mtrain_now() - w0;
      held = 1 - held;
    }
  }
  if (backward) {
    /* this rank's own dK/dV: the partials added in outer-step order */
    for (int32_t o = 0; o < g.n; o++) {
      MTRAIN_TRY(mtrain_cm_wait(ctx, partial_recv[o]));
      partial_recv[o] = NULL;
      MTRAIN_TRY(mtrain_be_add(ctx, a->dk_own, b.partial_in[o], mtrain_be_acc_dtype(ctx),
                               (int64_t)a->chunk_elems));
      MTRAIN_TRY(mtrain_be_add(ctx, a->dv_own, (char *)b.partial_in[o] + acc_bytes,
                               mtrain_be_acc_dtype(ctx), (int64_t)a->chunk_elems));
    }
    for (int32_t o = 0; o < g.n; o++) {
      MTRAIN_TRY(mtrain_cm_wait(ctx, partial_send[o]));
      partial_send[o] = NULL;
    }
  }
  ctx->last_stats.ring_seconds = mtrain_now() - ring_start;
  if (device_timing) MTRAIN_TRY(device_step_times(ctx, total_steps));
cleanup:
  free(partial_recv); /* requests still posted after an error are abandoned with the job */
  free(partial_send);
  buffers_free(ctx, &b);
  return st;
}
