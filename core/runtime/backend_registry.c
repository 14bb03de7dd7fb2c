/* backend_registry.c: the compiled-in backends, by name. Tools and tests pick
 * one at run time and check one against another. */
#include <string.h>

#include "backends/cpu/cpu_backend.h"
#ifdef MTRAIN_HAVE_CUDA
#include "backends/cuda/cuda_backend.h"
#endif
#include "mtrain/mtrain_backend.h"

static const mtrain_backend_ops_t *const registry[] = {
    &mtrain_cpu_ref_backend,
    &mtrain_cpu_backend,
#ifdef MTRAIN_HAVE_CUDA
    &mtrain_cuda_backend,
#endif
};

#define REGISTRY_SIZE ((int)(sizeof registry / sizeof registry[0]))

const mtrain_backend_ops_t *mtrain_backend_find(const char *name) {
  if (!name) return NULL;
  for (int i = 0; i < REGISTRY_SIZE; i++)
    if (strcmp(registry[i]->name, name) == 0) return registry[i];
  return NULL;
}

int mtrain_backend_list(const char **names, int cap) {
  for (int i = 0; i < REGISTRY_SIZE && i < cap; i++) names[i] = registry[i]->name;
  return REGISTRY_SIZE;
}
