// emu_ptx_mma1.h: the emulated PTX wrappers of attn_mma_common.cuh (inside namespace mma).
__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  const unsigned char *b = emu::smem_base();
  const unsigned char *c = (const unsigned char *)p;
  if (c < b || c >= b + emu::smem_size()) emu::fail("smem_u32 of a non-shared pointer");
  return (uint32_t)(c - b);
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
  emu::cp_async(dst, src, 16, valid);
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, bool valid) {
  emu::cp_async(dst, src, 4, valid);
}
__device__ __forceinline__ void cp_async_commit() { emu::cp_commit(); }
template <int N> __device__ __forceinline__ void cp_async_wait() { emu::cp_wait(N); }
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                        uint32_t &r3) {
  uint32_t r[4];
  emu::ldsm(addr, r, false);
  r0 = r[0];
  r1 = r[1];
  r2 = r[2];
  r3 = r[3];
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                          uint32_t &r3) {
  uint32_t r[4];
  emu::ldsm(addr, r, true);
  r0 = r[0];
  r1 = r[1];
  r2 = r[2];
  r3 = r[3];
}
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  emu::mma(c, a, b0, b1, std::is_same<T, __nv_bfloat16>::value);
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y = exp2f(x);
  return y < 1.1754943508222875e-38f ? 0.f : y;
}
