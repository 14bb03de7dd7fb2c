/* cuda_fault.cu: the check after every kernel launch of the CUDA backend
 * (cuda_check_launch) and the fault injection that tests its error paths
 * (mtrain_cuda_inject_fault): when armed, the n-th checked launch is followed
 * by a launch that really fails, either at launch (an invalid configuration,
 * a non-sticky error) or on the device (a kernel that traps, a sticky error
 * that ends the process's CUDA context). Nothing is simulated: the error
 * returned is the one the CUDA runtime reports. */
#include <cuda_runtime.h>

#include <atomic>

#include "backends/cuda/cuda_internal.h"
#include "mtrain/mtrain_cuda.h"
#include "mtrain/mtrain_error.h"

namespace {

std::atomic<int> g_fault_kind{MTRAIN_CUDA_FAULT_NONE};
std::atomic<long long> g_fault_countdown{0}; /* launches left before the fault; 0: none */

__global__ void fault_trap_kernel() { __trap(); }

/* Consumes one launch of the countdown; the fault kind when this is the
 * launch that fails, else MTRAIN_CUDA_FAULT_NONE. */
int take_fault() {
  long long left = g_fault_countdown.load();
  while (left > 0) {
    if (g_fault_countdown.compare_exchange_weak(left, left - 1))
      return left == 1 ? g_fault_kind.load() : (int)MTRAIN_CUDA_FAULT_NONE;
  }
  return MTRAIN_CUDA_FAULT_NONE;
}

} // namespace

extern "C" mtrain_status_t cuda_check_launch(const char *kernel) {
  mtrain_status_t st = cuda_check((int)cudaGetLastError(), kernel);
  if (st) return st;
  const int fault = take_fault();
  if (fault == MTRAIN_CUDA_FAULT_LAUNCH) {
    /* more threads per block than any GPU allows: the launch itself fails */
    fault_trap_kernel<<<1, 4096>>>();
    return cuda_check((int)cudaGetLastError(), kernel);
  }
  if (fault == MTRAIN_CUDA_FAULT_TRAP) {
    /* a kernel that stops on the device; waited for, so that the error
     * shows here and not at some later synchronisation */
    fault_trap_kernel<<<1, 1>>>();
    return cuda_check((int)cudaDeviceSynchronize(), kernel);
  }
  return MTRAIN_SUCCESS;
}

extern "C" mtrain_status_t mtrain_cuda_inject_fault(mtrain_cuda_fault_t kind, int64_t nth_launch) {
  if (kind != MTRAIN_CUDA_FAULT_NONE && kind != MTRAIN_CUDA_FAULT_LAUNCH &&
      kind != MTRAIN_CUDA_FAULT_TRAP)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "mtrain_cuda_inject_fault: kind %d is not NONE (0), LAUNCH (1) or TRAP (2)",
                        (int)kind);
  if (kind != MTRAIN_CUDA_FAULT_NONE && nth_launch < 1)
    return mtrain_error(MTRAIN_ERR_INVALID_ARGUMENT,
                        "mtrain_cuda_inject_fault: nth_launch %lld must be at least 1",
                        (long long)nth_launch);
  g_fault_countdown.store(0);
  g_fault_kind.store(kind);
  if (kind != MTRAIN_CUDA_FAULT_NONE) g_fault_countdown.store(nth_launch);
  return MTRAIN_SUCCESS;
}

extern "C" int64_t mtrain_cuda_fault_pending(void) { return g_fault_countdown.load(); }
