// emu_ptx_mma2.h: the emulated PTX wrappers of attn_mma2_common.cuh (inside namespace mma2).
__device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                        uint32_t r3) {
  uint32_t r[4] = {r0, r1, r2, r3};
  emu::stsm(addr, r);
}
__device__ __forceinline__ void red_add_v2(float *p, float a, float b) {
  if ((uintptr_t)p % 8) emu::fail("red.v2 misaligned");
  emu::red_add(p, a);
  emu::red_add(p + 1, b);
}
