/* config.c: validation of the context configuration and its MTRAIN_*
 * environment overrides (read once per process, NCCL-style).
 *
 * Threads: a context runs at most max_threads() OpenMP threads,
 * min(omp_get_thread_limit(), 4 x omp_get_num_procs()). The first is what
 * OpenMP itself allows (OMP_THREAD_LIMIT); the second keeps oversubscription
 * sane: thread counts in the tens of thousands were accepted before and then
 * crashed or ended the process inside libgomp (65536: a segmentation fault;
 * 32768: libgomp exits). config.num_threads, MTRAIN_NUM_THREADS and, when
 * num_threads is 0, OpenMP's default (OMP_NUM_THREADS) are all checked. */
#include <errno.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/runtime/context_internal.h"
#include "mtrain/mtrain_error.h"

typedef struct env_snapshot {
  char backend[64];
  const char *granularity;
  const char *num_threads;
  const char *check_inputs;
  const char *deterministic;
  const char *reuse_limit;
  char granularity_buf[32], num_threads_buf[32], check_inputs_buf[32], deterministic_buf[32],
      reuse_limit_buf[32];
  int has_backend;
} env_snapshot_t;

static env_snapshot_t env;
static pthread_once_t env_once = PTHREAD_ONCE_INIT;

static const char *copy_env(const char *name, char *buf, size_t cap) {
  const char *v = getenv(name);
  if (!v) return NULL;
  strncpy(buf, v, cap - 1);
  buf[cap - 1] = '\0';
  return buf;
}

static void read_env_once(void) {
  env.has_backend = copy_env("MTRAIN_BACKEND", env.backend, sizeof env.backend) != NULL;
  env.granularity = copy_env("MTRAIN_GRANULARITY", env.granularity_buf, sizeof env.granularity_buf);
  env.num_threads = copy_env("MTRAIN_NUM_THREADS", env.num_threads_buf, sizeof env.num_threads_buf);
  env.check_inputs =
      copy_env("MTRAIN_CHECK_INPUTS", env.check_inputs_buf, sizeof env.check_inputs_buf);
  env.deterministic =
      copy_env("MTRAIN_DETERMINISTIC", env.deterministic_buf, sizeof env.deterministic_buf);
  env.reuse_limit = copy_env("MTRAIN_REUSE_LIMIT", env.reuse_limit_buf, sizeof env.reuse_limit_buf);
}

mtrain_status_t mtrain_env_reuse_limit(size_t *out) {
  pthread_once(&env_once, read_env_once);
  *out = MTRAIN_REUSE_LIMIT_PEAK;
  if (!env.reuse_limit || strcmp(env.reuse_limit, "peak") == 0) return MTRAIN_SUCCESS;
  char *end = NULL;
  errno = 0;
  const unsigned long long v = strtoull(env.reuse_limit, &end, 10);
  if (errno || end == env.reuse_limit || *end != '\0' || env.reuse_limit[0] == '-' ||
      v >= (unsigned long long)MTRAIN_REUSE_LIMIT_PEAK)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "environment variable MTRAIN_REUSE_LIMIT='%s' is neither 'peak' nor a "
                        "byte count",
                        env.reuse_limit);
  *out = (size_t)v;
  return MTRAIN_SUCCESS;
}

static mtrain_status_t parse_int_env(const char *name, const char *text, int32_t lo, int32_t hi,
                                     int32_t *out) {
  char *end = NULL;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno || end == text || *end != '\0' || v < lo || v > hi)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "environment variable %s='%s' is not an integer in [%d, %d]", name, text,
                        lo, hi);
  *out = (int32_t)v;
  return MTRAIN_SUCCESS;
}

/* The most threads a context may use (see the top of this file). */
static int32_t max_threads(void) {
  const int limit = omp_get_thread_limit(), procs = omp_get_num_procs();
  const int64_t cap = 4 * (int64_t)(procs > 0 ? procs : 1);
  return (int32_t)(limit > 0 && limit < cap ? limit : cap);
}

mtrain_status_t mtrain_config_apply_env(mtrain_config_t *config) {
  pthread_once(&env_once, read_env_once);
  mtrain_status_t st = MTRAIN_SUCCESS;
  if (env.has_backend) config->backend = env.backend;
  if (env.granularity)
    st = parse_int_env("MTRAIN_GRANULARITY", env.granularity, 1, 1 << 20, &config->granularity);
  if (st == MTRAIN_SUCCESS && env.num_threads) {
    st = parse_int_env("MTRAIN_NUM_THREADS", env.num_threads, 0, 1 << 16, &config->num_threads);
    const int32_t most = max_threads();
    if (st == MTRAIN_SUCCESS && config->num_threads > most)
      st = mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "environment variable MTRAIN_NUM_THREADS='%s' exceeds the %d threads a "
                        "context may use (min(omp_get_thread_limit() = %d, 4 x %d processors))",
                        env.num_threads, most, omp_get_thread_limit(), omp_get_num_procs());
  }
  if (st == MTRAIN_SUCCESS && env.check_inputs)
    st = parse_int_env("MTRAIN_CHECK_INPUTS", env.check_inputs, 0, 1, &config->check_inputs);
  if (st == MTRAIN_SUCCESS && env.deterministic)
    st = parse_int_env("MTRAIN_DETERMINISTIC", env.deterministic, 0, 1, &config->deterministic);
  return st;
}

mtrain_status_t mtrain_config_validate(const mtrain_config_t *c) {
  if (c->api_version != MTRAIN_API_VERSION)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "config.api_version is %d, this library is version %d (initialise the "
                        "config with MTRAIN_CONFIG_INIT)",
                        c->api_version, MTRAIN_API_VERSION);
  if (!c->backend || !c->backend[0])
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG, "config.backend is empty");
  if (c->granularity < 1 || c->granularity > (1 << 20))
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG, "config.granularity %d not in [1, 2^20]",
                        c->granularity);
  if (c->num_threads < 0)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG, "config.num_threads %d is negative",
                        c->num_threads);
  const int32_t most = max_threads();
  if (c->num_threads > most)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "config.num_threads %d exceeds the %d threads a context may use "
                        "(min(omp_get_thread_limit() = %d, 4 x %d processors))",
                        c->num_threads, most, omp_get_thread_limit(), omp_get_num_procs());
  if (c->num_threads == 0 && omp_get_max_threads() > most)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "config.num_threads 0 takes OpenMP's default of %d threads "
                        "(OMP_NUM_THREADS), which exceeds the %d threads a context may use "
                        "(min(omp_get_thread_limit() = %d, 4 x %d processors)); set "
                        "num_threads or OMP_NUM_THREADS lower",
                        omp_get_max_threads(), most, omp_get_thread_limit(), omp_get_num_procs());
  if (c->check_inputs != 0 && c->check_inputs != 1)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG, "config.check_inputs %d is not 0 or 1",
                        c->check_inputs);
  if (c->deterministic != 0 && c->deterministic != 1)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG, "config.deterministic %d is not 0 or 1",
                        c->deterministic);
  if (!(c->softmax_scale >= 0.0) || c->softmax_scale > 1e30)
    return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                        "config.softmax_scale %g must be finite and >= 0 (0 = 1/sqrt(d))",
                        c->softmax_scale);
  return MTRAIN_SUCCESS;
}
