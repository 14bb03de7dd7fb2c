/* test_nccl_fault.c: a GPU peer that dies or stops answering in the middle
 * of the ring must not hang the other rank. Two processes, one GPU each,
 * through the NCCL communicator with a short timeout (TIMEOUT_S), run under
 * mpiexec -n 2 --enable-recovery by test_nccl_fault.sh (so that the
 * survivor outlives a killed peer). Both ranks first run two complete
 * iterations (forward and backward of the dense striped ring: they set up
 * NCCL's connections, and the second times the phases); in the next
 * iteration rank 1 injects the fault:
 *   kill       SIGKILL just before its forward;
 *   kill-fwd   SIGKILL half-way through its forward (a timer thread);
 *   kill-bwd   SIGKILL half-way through its backward;
 *   stall-fwd  its main thread stops (a signal handler that sleeps) half-way
 *              through its forward;
 *   stall-bwd  the same in its backward.
 * (With 2 ranks the forward's one exchange is posted at its start, so a
 * fault half-way through the forward reaches the survivor in its backward.)
 * Rank 0 goes on for up to MAX_ITER iterations: one of its calls must fail
 * with MTRAIN_ERR_TIMEOUT (a message stating the timeout) or MTRAIN_ERR_COMM
 * (NCCL's error) within the timeout plus a margin; a further call must then
 * fail at once; destroying its plan, context and communicator must return.
 * It prints "rank 0: PASS ..." or "rank 0: FAIL ..." and ends the job
 * (MPI_Abort: its peer is dead or asleep). A wall-clock guard (alarm) turns
 * a hang into a failure and prints where the main thread was. Skips (exit
 * 77) where fewer than 2 GPUs are visible.
 * usage: mpiexec -n 2 test_nccl_fault MODE */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <execinfo.h>
#include <mpi.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mtrain/mtrain.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_layout.h"
#include "mtrain/mtrain_nccl.h"

enum { N = 262144, HQ = 16, HKV = 2, D = 128, G = 128, MAX_ITER = 4 };
#define TIMEOUT_S 5.0 /* the communicator's timeout */
#define GUARD_S 120   /* the whole run's wall-clock limit */
#define STALL_S 600   /* how long a stalled rank sleeps (the job ends first) */

static int rank_;
static pthread_t main_thread_;
static volatile sig_atomic_t phase_ = 0; /* for the guard's message */
static const char *const phase_names[] = {"set-up", "warm-up", "faulty iteration", "destroy"};

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Writes a message with write(2) only (callable from signal handlers and
 * just before SIGKILL). */
static void say(const char *msg) {
  ssize_t unused = write(STDOUT_FILENO, msg, strlen(msg));
  (void)unused;
}

/* SIGALRM: the guard. Any thread may take the signal: it is passed on to
 * the main thread, which prints where it was and ends the process. */
static void guard_expired(int sig) {
  if (!pthread_equal(pthread_self(), main_thread_)) {
    pthread_kill(main_thread_, sig);
    return;
  }
  char msg[160];
  snprintf(msg, sizeof msg,
           "rank %d: FAIL: wall-clock guard (%d s) expired during the %s: a hang; main thread:\n",
           rank_, GUARD_S, phase_names[phase_]);
  say(msg);
  void *frames[48];
  backtrace_symbols_fd(frames, backtrace(frames, 48), STDOUT_FILENO);
  _exit(3);
}

static void stall_here(int sig) {
  (void)sig;
  struct timespec t = {STALL_S, 0};
  while (nanosleep(&t, &t) == -1 && errno == EINTR) {
  }
}

/* The fault of rank 1, fired by a timer thread after `delay` seconds. */
typedef struct fault {
  double delay;
  int kill; /* 1: SIGKILL the process; 0: stall the main thread */
  pthread_t main;
} fault_t;

static void *fire(void *arg) {
  const fault_t *f = arg;
  struct timespec t = {(time_t)f->delay, (long)((f->delay - (double)(time_t)f->delay) * 1e9)};
  nanosleep(&t, NULL);
  char msg[128];
  snprintf(msg, sizeof msg, "rank 1: fault: %s after %.3f s\n", f->kill ? "SIGKILL" : "stall",
           f->delay);
  say(msg);
  if (f->kill) raise(SIGKILL);
  pthread_kill(f->main, SIGUSR1);
  return NULL;
}

typedef struct ring {
  mtrain_context_t *ctx;
  mtrain_plan_t *plan;
  mtrain_tensor_t t[9]; /* q k v dout o lse dq dk dv, device memory */
} ring_t;

static mtrain_status_t forward(ring_t *r) {
  return mtrain_attention_forward(r->ctx, r->plan, &r->t[0], &r->t[1], &r->t[2], &r->t[4],
                                  &r->t[5]);
}

static mtrain_status_t backward(ring_t *r) {
  return mtrain_attention_backward(r->ctx, r->plan, &r->t[0], &r->t[1], &r->t[2], &r->t[4],
                                   &r->t[5], &r->t[3], &r->t[6], &r->t[7], &r->t[8]);
}

/* The dense striped ring on device tensors of constant, non-zero values. */
static mtrain_status_t ring_create(mtrain_comm_t *comm, ring_t *r) {
  memset(r, 0, sizeof *r);
  mtrain_config_t cfg = MTRAIN_CONFIG_INIT;
  cfg.backend = "cuda";
  cfg.granularity = G;
  mtrain_layout_t *layout = NULL;
  mtrain_pattern_t *pattern = NULL;
  mtrain_status_t st = mtrain_context_create(&cfg, comm, &r->ctx);
  if (!st) st = mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, N, G, 2, NULL, &layout);
  if (!st) st = mtrain_pattern_create_dense(N, HQ, G, &pattern);
  if (!st)
    st = mtrain_plan_create_ring(r->ctx, NULL, (const mtrain_layout_t *const[]){layout}, 0,
                                 (const mtrain_pattern_t *const[]){pattern}, &r->plan);
  const int64_t T = st ? 0 : mtrain_layout_local_tokens(layout, rank_);
  const int32_t heads[9] = {HQ, HKV, HKV, HQ, HQ, HQ, HQ, HKV, HKV};
  for (int x = 0; x < 9 && !st; x++) {
    const mtrain_dtype_t dt = x == 5 ? MTRAIN_F32 : MTRAIN_BF16;
    r->t[x] =
        x == 5 ? mtrain_tensor_2d(NULL, dt, T, HQ) : mtrain_tensor_3d(NULL, dt, T, heads[x], D);
    const size_t bytes = (size_t)mtrain_tensor_numel(&r->t[x]) * mtrain_dtype_size(dt);
    st = mtrain_cuda_malloc(bytes, &r->t[x].data);
    if (!st && x <= 3) st = mtrain_cuda_memset(r->t[x].data, 0x3C, bytes); /* bf16 0.0115 */
  }
  mtrain_pattern_destroy(pattern);
  mtrain_layout_destroy(layout);
  return st;
}

static void ring_destroy(ring_t *r) {
  for (int x = 0; x < 9; x++) mtrain_cuda_free(r->t[x].data);
  mtrain_plan_destroy(r->plan);
  mtrain_context_destroy(r->ctx);
}

static int all_ranks(int ok) {
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all;
}

/* Rank 1: the warm-up's phase times tell when "half-way" is; the fault
 * fires, then this rank waits for its end (killed, or asleep). */
static void rank1_fault(ring_t *r, const char *mode, double t_fwd, double t_bwd) {
  static fault_t f;
  f.kill = strncmp(mode, "kill", 4) == 0;
  f.main = pthread_self();
  const int in_backward = strstr(mode, "-bwd") != NULL;
  f.delay = in_backward ? 0.5 * t_bwd : 0.5 * t_fwd;
  if (strcmp(mode, "kill") == 0) {
    say("rank 1: fault: SIGKILL before the forward\n");
    raise(SIGKILL);
  }
  pthread_t timer;
  int started = 0;
  if (!in_backward) started = pthread_create(&timer, NULL, fire, &f) == 0;
  mtrain_status_t st = forward(r);
  if (in_backward) {
    started = pthread_create(&timer, NULL, fire, &f) == 0;
    if (!st) st = backward(r);
  }
  printf("rank 1: faulty iteration returned %s (the fault comes or came)\n",
         mtrain_status_name(st));
  if (started) pthread_join(timer, NULL);
  stall_here(0);
}

/* Rank 0: goes on until a call fails, then checks the failure, a further
 * call and the destroys. Returns 1 when every check passed. */
static int rank0_survive(ring_t *r, mtrain_comm_t *comm, const char *mode, double bound) {
  const double t0 = now();
  mtrain_status_t st = MTRAIN_SUCCESS;
  const char *where = "";
  int iter = 0;
  for (; iter < MAX_ITER && !st; iter++) {
    where = "forward";
    st = forward(r);
    if (!st) {
      where = "backward";
      st = backward(r);
    }
  }
  const double t_fail = now() - t0;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", mtrain_last_error());
  if (!st) {
    printf("rank 0: FAIL: mode %s: %d iterations returned success although rank 1 %s\n", mode,
           MAX_ITER, strncmp(mode, "kill", 4) == 0 ? "was killed" : "stalled");
    return 0;
  }
  printf("rank 0: %s of iteration %d failed after %.2f s: %s: %s\n", where, iter, t_fail,
         mtrain_status_name(st), msg);
  int ok = 1;
  if (st == MTRAIN_ERR_TIMEOUT) {
    ok = strstr(msg, "within") != NULL;
  } else if (st == MTRAIN_ERR_COMM) {
    ok = strstr(msg, "NCCL") != NULL || strstr(msg, "nccl") != NULL;
  } else {
    ok = 0;
  }
  if (!ok) printf("rank 0: FAIL: expected MTRAIN_ERR_TIMEOUT or an NCCL error (MTRAIN_ERR_COMM)\n");
  if (t_fail > bound) {
    printf("rank 0: FAIL: the error came after %.2f s, more than the bound %.2f s\n", t_fail,
           bound);
    ok = 0;
  }
  /* the communicator was aborted: a further call fails at once */
  const double t1 = now();
  const mtrain_status_t again = forward(r);
  const double t_again = now() - t1;
  printf("rank 0: a further forward returned %s after %.3f s: %s\n", mtrain_status_name(again),
         t_again, mtrain_last_error());
  if (again == MTRAIN_SUCCESS || t_again > TIMEOUT_S + 5.0) {
    printf("rank 0: FAIL: the call after the failure %s\n",
           again == MTRAIN_SUCCESS ? "succeeded" : "was not refused at once");
    ok = 0;
  }
  phase_ = 3;
  const double t2 = now();
  ring_destroy(r);
  mtrain_comm_destroy(comm);
  printf("rank 0: plan, context and communicator destroyed in %.3f s\n", now() - t2);
  if (ok)
    printf("rank 0: PASS: mode %s: the %s failed after %.2f s (timeout %.1f s), no hang\n", mode,
           where, t_fail, TIMEOUT_S);
  return ok;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const char *mode = argc > 1 ? argv[1] : "stall-fwd";
  const char *const modes[] = {"kill", "kill-fwd", "kill-bwd", "stall-fwd", "stall-bwd"};
  int known = 0;
  for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) known |= strcmp(mode, modes[m]) == 0;
  if (!known || world != 2) {
    if (rank_ == 0)
      fprintf(stderr,
              "usage: mpiexec -n 2 test_nccl_fault kill|kill-fwd|kill-bwd|stall-fwd|"
              "stall-bwd (got '%s' on %d ranks)\n",
              mode, world);
    MPI_Finalize();
    return 2;
  }
  if (!all_ranks(mtrain_cuda_device_count() >= 2)) {
    if (rank_ == 0)
      printf("SKIPPED: 2 ranks need 2 GPUs of one host; %d visible\n", mtrain_cuda_device_count());
    MPI_Finalize();
    return 77;
  }
  main_thread_ = pthread_self();
  signal(SIGALRM, guard_expired);
  signal(SIGUSR1, stall_here);
  alarm(GUARD_S);
  setvbuf(stdout, NULL, _IOLBF, 0);
  mtrain_comm_t *comm = NULL;
  ring_t r;
  mtrain_status_t st = mtrain_comm_create_nccl_mpi(MPI_COMM_WORLD, -1, TIMEOUT_S, &comm);
  if (!st) st = ring_create(comm, &r);
  if (!all_ranks(st == MTRAIN_SUCCESS)) {
    printf("rank %d: FAIL: set-up: %s: %s\n", rank_, mtrain_status_name(st), mtrain_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  /* the warm-up: both ranks, complete, twice (the second one timed) */
  phase_ = 1;
  double t_fwd = 0, t_bwd = 0;
  for (int w = 0; w < 2 && !st; w++) {
    double t = now();
    st = forward(&r);
    t_fwd = now() - t;
    t = now();
    if (!st) st = backward(&r);
    t_bwd = now() - t;
  }
  if (!all_ranks(st == MTRAIN_SUCCESS)) {
    printf("rank %d: FAIL: warm-up: %s: %s\n", rank_, mtrain_status_name(st), mtrain_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  printf("rank %d: warm-up forward %.3f s, backward %.3f s\n", rank_, t_fwd, t_bwd);
  MPI_Barrier(MPI_COMM_WORLD);
  phase_ = 2;
  if (rank_ == 1) rank1_fault(&r, mode, t_fwd, t_bwd); /* does not return */
  /* the bound: the iterations up to the fault, the timeout, a margin */
  const double bound = 2.0 * (t_fwd + t_bwd) + TIMEOUT_S + 10.0;
  const int ok = rank0_survive(&r, comm, mode, bound);
  MPI_Abort(MPI_COMM_WORLD, ok ? 0 : 1); /* ends the peer too (asleep, or gone) */
  return ok ? 0 : 1;
}
