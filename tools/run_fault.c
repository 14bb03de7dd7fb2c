/* run_fault.c: the MTRAIN_RUN_FAULT test hook (run_fault.h). */
#include "run_fault.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The argument after "ACTION-SUBJECT:" when the hook is that fault, else
 * NULL. */
static const char *fault_arg(const char *action, const char *subject) {
  const char *spec = getenv("MTRAIN_RUN_FAULT");
  const size_t a = strlen(action), s = strlen(subject);
  if (!spec || strncmp(spec, action, a) != 0 || spec[a] != '-') return NULL;
  if (strncmp(spec + a + 1, subject, s) != 0 || spec[a + 1 + s] != ':') return NULL;
  return spec + a + s + 2;
}

/* 1 when `arg` is the decimal `rank`. */
static int is_rank(const char *arg, int rank) {
  char *end = NULL;
  const long r = arg ? strtol(arg, &end, 10) : -1;
  return arg && end != arg && *end == '\0' && r == rank;
}

void run_fault_point(const char *prog, const char *point, int rank) {
  if (is_rank(fault_arg("stall", point), rank)) {
    fprintf(stderr, "%s: rank %d: MTRAIN_RUN_FAULT=stall-%s:%d: stalling at '%s' (test hook)\n",
            prog, rank, point, rank, point);
    fflush(stderr);
    for (;;) sleep(60);
  }
  if (is_rank(fault_arg("kill", point), rank)) {
    fprintf(stderr, "%s: rank %d: MTRAIN_RUN_FAULT=kill-%s:%d: killed at '%s' (test hook)\n", prog,
            rank, point, rank, point);
    fflush(stderr);
    raise(SIGKILL);
  }
}

int run_fault_write(const char *name) {
  const char *spec = getenv("MTRAIN_RUN_FAULT");
  return spec && strncmp(spec, "fail-write:", 11) == 0 && strcmp(spec + 11, name) == 0;
}

double run_fault_add(const char *name) {
  const char *arg = fault_arg("add", name);
  char *end = NULL;
  const double x = arg ? strtod(arg, &end) : 0.0;
  return arg && end != arg && *end == '\0' ? x : 0.0;
}
