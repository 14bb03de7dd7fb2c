/* block_scan.cuh (private): the CTA-wide exclusive prefix sum that the plan
 * builder's kernels (plan_kernels.cuh) and the vertical-slash selection's
 * (select_kernels.cuh) share. One 64-bit value per thread, scanned in shared
 * memory in log2(threads) rounds, each adding the running sum `off` threads
 * back (off = 1, 2, 4, ...): the same additions in the same order for every
 * caller, so its results are exact and reproducible. Written in the subset of
 * CUDA that the CPU emulator of tests/cuda_emu runs (block barriers, shared
 * memory). */
#ifndef MTRAIN_CUDA_BLOCK_SCAN_CUH
#define MTRAIN_CUDA_BLOCK_SCAN_CUH

namespace bscan {

/* Exclusive prefix sum over the CTA of one value per thread; *total gets the
 * sum. kThreads: the CTA's threads (blockDim.x). Every thread must call it;
 * buf: kThreads entries of shared memory, free again on return. */
template <int kThreads>
__device__ __forceinline__ long long block_scan(long long v, long long *buf, long long *total) {
  const int t = (int)threadIdx.x;
  buf[t] = v;
  __syncthreads();
  for (int off = 1; off < kThreads; off <<= 1) {
    const long long x = t >= off ? buf[t - off] : 0;
    __syncthreads();
    buf[t] += x;
    __syncthreads();
  }
  const long long incl = buf[t];
  *total = buf[kThreads - 1];
  __syncthreads();
  return incl - v;
}

} /* namespace bscan */

#endif /* MTRAIN_CUDA_BLOCK_SCAN_CUH */
