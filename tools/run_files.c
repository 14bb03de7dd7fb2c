/* run_files.c: mtrain-run's --out files, all or nothing (run_files.h). */
#include "run_files.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mtrain/mtrain_io.h"
#include "run_fault.h"
#include "run_inputs.h"
#include "tool_common.h"

int run_files_names(int forward_only, const char *names[RUN_FILES_MAX]) {
  static const char *const all[6] = {"o.npy",  "lse.npy", "dq.npy",
                                     "dk.npy", "dv.npy",  "pattern.json"};
  int n = 0;
  for (int i = 0; i < 6; i++)
    if (!forward_only || i < 2 || i == 5) names[n++] = all[i];
  return n;
}

/* 1 (message printed) when DIR/name exists as a directory: rename cannot
 * put a file there. */
static int taken_by_directory(const char *prog, const char *dir, const char *name) {
  char path[4096];
  struct stat st;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) return 0;
  fprintf(stderr, "%s: --out: %s is a directory: the output %s cannot be written there\n", prog,
          path, name);
  return 1;
}

int run_files_prepare(const char *prog, const char *dir, const char *const *names, int n) {
  struct stat st;
  if (mkdir(dir, 0755) != 0 && (errno != EEXIST || stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))) {
    fprintf(stderr, "%s: cannot create the --out directory %s: %s\n", prog, dir,
            errno == EEXIST ? "a file of that name exists" : strerror(errno));
    return 1;
  }
  char probe[4096];
  snprintf(probe, sizeof probe, "%s/.mtrain-out-probe-%ld", dir, (long)getpid());
  const int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) {
    fprintf(stderr, "%s: cannot create files in the --out directory %s: %s\n", prog, dir,
            strerror(errno));
    return 1;
  }
  close(fd);
  unlink(probe);
  for (int i = 0; i < n; i++)
    if (taken_by_directory(prog, dir, names[i])) return 1;
  return 0;
}

void run_files_begin(run_files_t *f, const char *prog, const char *dir) {
  memset(f, 0, sizeof *f);
  f->prog = prog;
  f->dir = dir;
}

/* Records output `name`; its index, or -1 (message printed) when full. */
static int add(run_files_t *f, const char *name) {
  if (f->n == RUN_FILES_MAX) {
    fprintf(stderr, "%s: --out: too many outputs\n", f->prog);
    return -1;
  }
  const int i = f->n++;
  snprintf(f->name[i], sizeof f->name[i], "%s", name);
  snprintf(f->path[i], sizeof f->path[i], "%s/%s", f->dir, name);
  snprintf(f->tmp[i], sizeof f->tmp[i], "%s/.%s.tmp-%ld", f->dir, name, (long)getpid());
  return i;
}

/* The status of writing output i (the test hook may make it fail). */
static int finish(run_files_t *f, int i, const char *hook_name, mtrain_status_t st) {
  char what[4200];
  snprintf(what, sizeof what, "writing %s", f->path[i]);
  f->written[i] = st == MTRAIN_SUCCESS;
  if (st != MTRAIN_SUCCESS) {
    unlink(f->tmp[i]); /* a partial temporary */
    return tool_failed(f->prog, what, st);
  }
  if (!run_fault_write(hook_name)) return 0;
  fprintf(stderr,
          "%s: %s: %s: MTRAIN_RUN_FAULT=fail-write:%s: a simulated write failure (test "
          "hook)\n",
          f->prog, what, mtrain_status_name(MTRAIN_ERR_IO), hook_name);
  return 1;
}

/* "dq" of "dq.npy", for the test hook. */
static void stem(const char *name, char *out, size_t cap) {
  snprintf(out, cap, "%s", name);
  char *dot = strchr(out, '.');
  if (dot) *dot = '\0';
}

int run_files_write_tensor(run_files_t *f, const char *name, const mtrain_tensor_t *t) {
  const int i = add(f, name);
  if (i < 0) return 1;
  char hook[32];
  stem(name, hook, sizeof hook);
  return finish(f, i, hook, run_write_f32(f->tmp[i], t));
}

int run_files_write_pattern(run_files_t *f, const char *name, const mtrain_pattern_t *pattern) {
  const int i = add(f, name);
  if (i < 0) return 1;
  char hook[32];
  stem(name, hook, sizeof hook);
  return finish(f, i, hook, mtrain_pattern_write_json(f->tmp[i], pattern));
}

void run_files_discard(run_files_t *f) {
  if (f->discarded) return;
  f->discarded = 1;
  int removed = 0;
  for (int i = 0; i < f->n; i++) {
    if (!f->written[i]) continue;
    removed += unlink(f->tmp[i]) == 0;
    f->written[i] = 0;
  }
  fprintf(stderr,
          "%s: --out %s: nothing written (%d temporar%s removed; files of an earlier run "
          "left as they were)\n",
          f->prog, f->dir, removed, removed == 1 ? "y" : "ies");
}

int run_files_commit(run_files_t *f) {
  for (int i = 0; i < f->n; i++)
    if (taken_by_directory(f->prog, f->dir, f->name[i])) {
      run_files_discard(f);
      return 1;
    }
  for (int i = 0; i < f->n; i++) {
    if (rename(f->tmp[i], f->path[i]) == 0) {
      f->written[i] = 0;
      continue;
    }
    const int e = errno;
    char done[512] = "";
    size_t at = 0;
    for (int j = 0; j < i && at < sizeof done; j++)
      at += (size_t)snprintf(done + at, sizeof done - at, " %s", f->name[j]);
    fprintf(stderr, "%s: --out: renaming %s to %s: %s (already replaced:%s)\n", f->prog, f->tmp[i],
            f->path[i], strerror(e), i ? done : " none");
    run_files_discard(f);
    return 1;
  }
  return 0;
}
