// emu_ptx_wgmma.h: the emulated PTX wrappers of attn_wgmma_ptx.cuh (inside namespace wg).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo & 0x3FFFFu) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() {}
__device__ __forceinline__ void wgmma_commit() { emu::wgmma_commit(); }
template <int N> __device__ __forceinline__ void wgmma_wait() { emu::wgmma_wait(N); }
__device__ __forceinline__ void reg_fence(float &) {}
__device__ __forceinline__ void reg_fence_u(uint32_t &) {}
__device__ __forceinline__ void fence_proxy_async() {}
template <typename T, int TNSP>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t (&a)[4],
                                                uint64_t b) {
  emu::wgmma(d, a, b, 64, TNSP, std::is_same<T, __nv_bfloat16>::value);
}
template <typename T, int TNSP>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], const uint32_t (&a)[4],
                                                 uint64_t b) {
  emu::wgmma(d, a, b, 128, TNSP, std::is_same<T, __nv_bfloat16>::value);
}
template <typename T, int TA, int TB>
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[32], uint64_t a, uint64_t b) {
  emu::wgmma_ss(d, a, TA, b, 64, TB, std::is_same<T, __nv_bfloat16>::value);
}
template <typename T, int TA, int TB>
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[64], uint64_t a, uint64_t b) {
  emu::wgmma_ss(d, a, TA, b, 128, TB, std::is_same<T, __nv_bfloat16>::value);
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) { emu::mbar_init(bar, count); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) { emu::mbar_arrive(bar); }
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  return emu::mbar_try_wait(bar, parity);
}
__device__ __forceinline__ void named_barrier(int id, int count) { emu::named_barrier(id, count); }
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  emu::named_barrier_arrive(id, count);
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() { emu::setmaxnreg(N, true); }
template <int N> __device__ __forceinline__ void setmaxnreg_dec() { emu::setmaxnreg(N, false); }
