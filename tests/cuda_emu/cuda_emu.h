// cuda_emu.h: force-included (-include) into the CPU build of test_cuda_emu: the CUDA
// execution model emulated on the host for the tensor-core kernels of variants 2 and 3
// (thread and block indices, barriers, shuffles, warp- and warpgroup-collective
// matrix instructions, cp.async, mbarriers, setmaxnreg), implemented in cuda_emu_rt.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
using std::max;
using std::min;

namespace emu {
struct Dim3 {
  unsigned x, y, z;
};
struct Fiber;
Fiber *cur();
const Dim3 &tid3();
const Dim3 &bid3();
extern Dim3 g_grid, g_block;
void syncthreads();
float shfl(float v, int src_lane, bool xor_mode);
unsigned char *smem_base();
uint32_t smem_size();
// warp collectives
void ldsm(uint32_t addr, uint32_t *r, bool trans);
void mma(float *c, const uint32_t *a, uint32_t b0, uint32_t b1, bool bf16);
void cp_async(uint32_t dst, const void *src, int bytes, bool valid);
void cp_commit();
void cp_wait(int n);
void stsm(uint32_t addr, const uint32_t *r);
int any(int pred);
void mbar_init(uint32_t bar, int count);
void mbar_arrive(uint32_t bar);
bool mbar_try_wait(uint32_t bar, uint32_t parity);
void named_barrier(int id, int count);
void named_barrier_arrive(int id, int count);
void setmaxnreg(int n, bool inc);
void set_launch_regs(int n);
void wgmma(float *d, const uint32_t *a, uint64_t desc, int N, int tnsp, bool bf16);
void wgmma_ss(float *d, uint64_t adesc, int tnsp_a, uint64_t desc, int N, int tnsp, bool bf16);
void wgmma_commit();
void wgmma_wait(int n);
void red_add(float *p, float v);
[[noreturn]] void fail(const char *fmt, ...);
} // namespace emu

#define threadIdx (emu::tid3())
#define blockIdx (emu::bid3())
#define gridDim (emu::g_grid)
#define blockDim (emu::g_block)
#define __syncthreads() emu::syncthreads()
static inline float __shfl_xor_sync(unsigned, float v, int m) { return emu::shfl(v, m, true); }
static inline float __shfl_sync(unsigned, float v, int s) { return emu::shfl(v, s, false); }
static inline int __any_sync(unsigned, int pred) { return emu::any(pred); }
// a CTA's fibers switch only at barriers and collectives: a read-modify-write is atomic
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
static inline unsigned atomicOr(unsigned *p, unsigned v) {
  const unsigned old = *p;
  *p = old | v;
  return old;
}
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __global__
#define __global__
