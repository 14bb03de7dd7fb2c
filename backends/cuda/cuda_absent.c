/* cuda_absent.c: the public mtrain_cuda_* functions of a build without
 * CUDA: each reports MTRAIN_ERR_NOT_SUPPORTED (the device count is 0), so
 * programs link and run the same in every build. */
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_error.h"

static mtrain_status_t absent(const char *fn) {
  return mtrain_error(MTRAIN_ERR_NOT_SUPPORTED,
                      "%s: this build of mtrain has no CUDA backend (configure with "
                      "-DMTRAIN_WITH_CUDA=ON where nvcc is installed)",
                      fn);
}

int mtrain_cuda_device_count(void) { return 0; }
mtrain_status_t mtrain_cuda_set_stream(mtrain_context_t *ctx, void *stream) {
  (void)ctx;
  (void)stream;
  return absent(__func__);
}
mtrain_status_t mtrain_cuda_set_async(mtrain_context_t *ctx, int enabled) {
  (void)ctx;
  (void)enabled;
  return absent(__func__);
}
mtrain_status_t mtrain_cuda_set_variant(mtrain_context_t *ctx, mtrain_cuda_variant_t variant) {
  (void)ctx;
  (void)variant;
  return absent(__func__);
}
int mtrain_cuda_last_variant(const mtrain_context_t *ctx) {
  (void)ctx;
  return -1;
}
mtrain_status_t mtrain_cuda_malloc(size_t bytes, void **ptr) {
  (void)bytes;
  (void)ptr;
  return absent(__func__);
}
void mtrain_cuda_free(void *ptr) { (void)ptr; }
mtrain_status_t mtrain_cuda_memcpy_to_device(void *dst, const void *host_src, size_t bytes) {
  (void)dst;
  (void)host_src;
  (void)bytes;
  return absent(__func__);
}
mtrain_status_t mtrain_cuda_memcpy_to_host(void *host_dst, const void *src, size_t bytes) {
  (void)host_dst;
  (void)src;
  (void)bytes;
  return absent(__func__);
}
mtrain_status_t mtrain_cuda_memset(void *ptr, int value, size_t bytes) {
  (void)ptr;
  (void)value;
  (void)bytes;
  return absent(__func__);
}
mtrain_status_t mtrain_cuda_set_device(int device) {
  (void)device;
  return absent(__func__);
}
mtrain_status_t mtrain_cuda_device_synchronize(void) { return absent(__func__); }
mtrain_status_t mtrain_cuda_inject_fault(mtrain_cuda_fault_t kind, int64_t nth_launch) {
  (void)kind;
  (void)nth_launch;
  return absent(__func__);
}
int64_t mtrain_cuda_fault_pending(void) { return 0; }
