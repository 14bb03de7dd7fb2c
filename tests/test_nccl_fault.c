/* test_nccl_fault.c: a GPU peer that dies or stops answering in the middle
 * of the ring must not hang the other ranks. W >= 2 processes, one GPU each,
 * through the NCCL communicator with a short timeout (TIMEOUT_S), run under
 * mpiexec -n W --enable-recovery by test_nccl_fault.sh (so that the
 * survivors outlive a killed peer). All ranks first run two complete
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
 * Every other rank (the survivors: rank 0, and ranks 2..W-1, of which only
 * rank 2 exchanges with rank 1) goes on for up to MAX_ITER iterations: one of its
 * calls must fail with MTRAIN_ERR_TIMEOUT (a message stating the timeout) or
 * MTRAIN_ERR_COMM (NCCL's error) within the timeout plus a margin; a further
 * call must then fail at once; destroying its plan, context and
 * communicator must return. Each prints "rank r: PASS ..." or "rank r: FAIL
 * ...". With W > 2 each other survivor then writes its verdict into
 * DONE_DIR (no MPI collective can run beside a dead rank) and exits; rank 0
 * waits for every verdict, kills rank 1 (asleep, or gone; the ranks share
 * one host and swapped their process ids at the start) and ends the job
 * (MPI_Abort alone did not end the other survivors under --enable-recovery
 * on 4 H100s). A wall-clock guard (alarm) turns a
 * hang into a failure and prints where the main thread was. Skips (exit 77)
 * where fewer than W GPUs are visible.
 * usage: mpiexec -n W test_nccl_fault MODE [DONE_DIR] (DONE_DIR: W > 2) */
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

static int rank_, world_;
static int pids_[64]; /* every rank's process id (one host) */
static pthread_t main_thread_;
static volatile sig_atomic_t phase_ = 0; /* for the guard's message */
static const char *const phase_names[] = {"set-up", "warm-up", "faulty iteration", "destroy",
                                          "wait for the other survivors"};

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
  if (!st) st = mtrain_layout_create(MTRAIN_LAYOUT_STRIPED, N, G, world_, NULL, &layout);
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

/* A survivor: goes on until a call fails, then checks the failure, a
 * further call and the destroys. Returns 1 when every check passed. */
static int survive(ring_t *r, mtrain_comm_t *comm, const char *mode, double bound) {
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
    printf("rank %d: FAIL: mode %s: %d iterations returned success although rank 1 %s\n", rank_,
           mode, MAX_ITER, strncmp(mode, "kill", 4) == 0 ? "was killed" : "stalled");
    return 0;
  }
  printf("rank %d: %s of iteration %d failed after %.2f s: %s: %s\n", rank_, where, iter, t_fail,
         mtrain_status_name(st), msg);
  int ok = 1;
  if (st == MTRAIN_ERR_TIMEOUT) {
    ok = strstr(msg, "within") != NULL;
  } else if (st == MTRAIN_ERR_COMM) {
    ok = strstr(msg, "NCCL") != NULL || strstr(msg, "nccl") != NULL;
  } else {
    ok = 0;
  }
  if (!ok)
    printf("rank %d: FAIL: expected MTRAIN_ERR_TIMEOUT or an NCCL error (MTRAIN_ERR_COMM)\n",
           rank_);
  if (t_fail > bound) {
    printf("rank %d: FAIL: the error came after %.2f s, more than the bound %.2f s\n", rank_,
           t_fail, bound);
    ok = 0;
  }
  /* the communicator was aborted: a further call fails at once */
  const double t1 = now();
  const mtrain_status_t again = forward(r);
  const double t_again = now() - t1;
  printf("rank %d: a further forward returned %s after %.3f s: %s\n", rank_,
         mtrain_status_name(again), t_again, mtrain_last_error());
  if (again == MTRAIN_SUCCESS || t_again > TIMEOUT_S + 5.0) {
    printf("rank %d: FAIL: the call after the failure %s\n", rank_,
           again == MTRAIN_SUCCESS ? "succeeded" : "was not refused at once");
    ok = 0;
  }
  phase_ = 3;
  const double t2 = now();
  ring_destroy(r);
  mtrain_comm_destroy(comm);
  printf("rank %d: plan, context and communicator destroyed in %.3f s\n", rank_, now() - t2);
  if (ok)
    printf("rank %d: PASS: mode %s: the %s failed after %.2f s (timeout %.1f s), no hang\n", rank_,
           mode, where, t_fail, TIMEOUT_S);
  return ok;
}

/* W > 2: this survivor's verdict as a file DIR/rank-R holding 1 or 0. */
static void write_verdict(const char *dir, int ok) {
  char path[4096];
  snprintf(path, sizeof path, "%s/rank-%d", dir, rank_);
  FILE *f = fopen(path, "w");
  if (f) {
    fprintf(f, "%d\n", ok);
    fclose(f);
  }
}

/* Rank 0 with W > 2: waits (up to the guard) for every survivor's verdict;
 * returns 1 when all of them passed. */
static int all_verdicts(const char *dir) {
  int pass = 1;
  for (int r = 2; r < world_; r++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/rank-%d", dir, r);
    int v = -1;
    while (v < 0) {
      FILE *f = fopen(path, "r");
      if (f) {
        if (fscanf(f, "%d", &v) != 1) v = -1;
        fclose(f);
      }
      if (v < 0) {
        struct timespec t = {0, 50000000};
        nanosleep(&t, NULL);
      }
    }
    printf("rank 0: rank %d's verdict: %s\n", r, v ? "PASS" : "FAIL");
    pass &= v == 1;
  }
  return pass;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  const char *mode = argc > 1 ? argv[1] : "stall-fwd";
  const char *done_dir = argc > 2 ? argv[2] : NULL;
  const char *const modes[] = {"kill", "kill-fwd", "kill-bwd", "stall-fwd", "stall-bwd"};
  int known = 0;
  for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) known |= strcmp(mode, modes[m]) == 0;
  if (!known || world_ < 2 || world_ > 64 || (world_ > 2 && !done_dir)) {
    if (rank_ == 0)
      fprintf(stderr,
              "usage: mpiexec -n W test_nccl_fault kill|kill-fwd|kill-bwd|stall-fwd|"
              "stall-bwd [DONE_DIR] (2 <= W <= 64; DONE_DIR, an existing folder, when W > 2; got "
              "'%s' on %d ranks%s)\n",
              mode, world_, world_ > 2 && !done_dir ? " without DONE_DIR" : "");
    MPI_Finalize();
    return 2;
  }
  if (!all_ranks(mtrain_cuda_device_count() >= world_)) {
    if (rank_ == 0)
      printf("SKIPPED: %d ranks need %d GPUs of one host; %d visible\n", world_, world_,
             mtrain_cuda_device_count());
    MPI_Finalize();
    return 77;
  }
  const int me = (int)getpid();
  MPI_Allgather(&me, 1, MPI_INT, pids_, 1, MPI_INT, MPI_COMM_WORLD);
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
  /* the warm-up: all ranks, complete, twice (the second one timed) */
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
  /* the slowest rank's phase times: rank 1 fires its fault half-way through them */
  double times[2] = {t_fwd, t_bwd};
  MPI_Allreduce(MPI_IN_PLACE, times, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  t_fwd = times[0];
  t_bwd = times[1];
  MPI_Barrier(MPI_COMM_WORLD);
  phase_ = 2;
  if (rank_ == 1) rank1_fault(&r, mode, t_fwd, t_bwd); /* does not return */
  /* the bound: the iterations up to the fault, the timeout, a margin; a
   * survivor away from rank 1 may learn of the fault through a neighbour's
   * abort, one more timeout later at most */
  const double bound = 2.0 * (t_fwd + t_bwd) + (world_ > 2 ? 2.0 : 1.0) * TIMEOUT_S + 10.0;
  int ok = survive(&r, comm, mode, bound);
  if (world_ > 2) {
    phase_ = 4;
    if (rank_ != 0) {
      write_verdict(done_dir, ok);
      _exit(ok ? 0 : 1);
    }
    ok &= all_verdicts(done_dir);
  }
  kill((pid_t)pids_[1], SIGKILL); /* asleep, or already gone */
  MPI_Abort(MPI_COMM_WORLD, ok ? 0 : 1);
  return ok ? 0 : 1;
}
