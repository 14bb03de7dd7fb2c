/* run_fault.h: the test hook of mtrain-run and mtrain-bench, the
 * environment variable MTRAIN_RUN_FAULT (docs/USAGE.md, "Test hooks"): one
 * fault per run, for the tools' own tests. Unset, nothing happens. */
#ifndef MTRAIN_RUN_FAULT_H
#define MTRAIN_RUN_FAULT_H

/** At the named point of a run on several ranks ("inputs": the inputs are
 *  made; "report": before the figures are gathered): "stall-POINT:R" makes
 *  rank R say so on stderr and sleep until the job is ended; "kill-POINT:R"
 *  kills rank R (SIGKILL). Other ranks go on. */
void run_fault_point(const char *prog, const char *point, int rank);
/** 1 when MTRAIN_RUN_FAULT is "fail-write:NAME" with `name` NAME (o, lse,
 *  dq, dk, dv, pattern): the write of that --out file is to fail. */
int run_fault_write(const char *name);
/** X when MTRAIN_RUN_FAULT is "add-NAME:X" with `name` NAME (o, lse, dq, dk,
 *  dv): X is to be added to the first element of that output before
 *  --check; else 0. */
double run_fault_add(const char *name);

#endif /* MTRAIN_RUN_FAULT_H */
