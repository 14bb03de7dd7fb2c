/* run_files.h: mtrain-run's --out files, all or nothing: the directory is
 * checked before the run, every output is written to a temporary name in
 * the same directory, and the temporaries are renamed to their names only
 * once all were written; after a failure they are removed, and an earlier
 * run's files stay as they were. */
#ifndef MTRAIN_RUN_FILES_H
#define MTRAIN_RUN_FILES_H

#include "mtrain/mtrain.h"

enum { RUN_FILES_MAX = 8 };

typedef struct run_files {
  const char *prog, *dir;
  int n;                          /* outputs added */
  char name[RUN_FILES_MAX][32];   /* "dq.npy" */
  char path[RUN_FILES_MAX][4096]; /* DIR/dq.npy */
  char tmp[RUN_FILES_MAX][4096];  /* DIR/.dq.npy.tmp-PID */
  int written[RUN_FILES_MAX];     /* the temporary holds the output */
  int discarded;                  /* run_files_discard ran */
} run_files_t;

/** The --out file names of a run: o.npy lse.npy [dq.npy dk.npy dv.npy]
 *  pattern.json; returns their count. */
int run_files_names(int forward_only, const char *names[RUN_FILES_MAX]);
/** Before the run: creates `dir` when missing (not its parents), checks that
 *  a file can be created in it and that none of the n `names` is taken by a
 *  directory. Returns 0, or 1 with a message starting with `prog`. */
int run_files_prepare(const char *prog, const char *dir, const char *const *names, int n);
/** Starts a set of outputs in `dir`. */
void run_files_begin(run_files_t *f, const char *prog, const char *dir);
/** Writes tensor `t` as float32 .npy (run_write_f32) to the temporary of
 *  `name`. Returns 0, or 1 (message printed; then run_files_discard). */
int run_files_write_tensor(run_files_t *f, const char *name, const mtrain_tensor_t *t);
/** Writes `pattern` as JSON to the temporary of `name`; as above. */
int run_files_write_pattern(run_files_t *f, const char *name, const mtrain_pattern_t *pattern);
/** Renames every temporary to its name (after checking again that no name
 *  is taken by a directory). Returns 0, or 1 with a message naming what is
 *  in place; the temporaries left are removed. */
int run_files_commit(run_files_t *f);
/** Removes the temporaries written so far and says so (once: later calls do
 *  nothing). */
void run_files_discard(run_files_t *f);

#endif /* MTRAIN_RUN_FILES_H */
