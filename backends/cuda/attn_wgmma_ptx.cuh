/* attn_wgmma_ptx.cuh (private): the Hopper instructions of variant 3
 * (sm_90a): warpgroup MMA (wgmma.mma_async m64nNk16, A from registers, B
 * from shared memory through a matrix descriptor, fp32 accumulators), its
 * fence / commit / wait, the async-proxy fence that makes shared-memory
 * writes of cp.async visible to wgmma, the 128-byte-swizzle shared
 * memory descriptor, mbarriers, named barriers and setmaxnreg (registers
 * moved between warpgroups).
 *
 * Shared-memory operand layout (every B operand of variant 3): a tile of R
 * rows x C 16-bit columns is stored as C / 64 panels of R rows x 128 bytes,
 * panel p at byte p * R * 128 of the tile, row r of a panel at r * 128, and
 * its 16-byte chunk c (columns 64p + 8c .. + 7) at chunk c ^ (r & 7): the
 * 128-byte swizzle (address bits 4-6 XOR bits 7-9), so tiles start at a
 * multiple of 1024 bytes. For a B operand read K-major (key rows of K in
 * S = Q K^T, TNSP 0) one k16 slice is 32 bytes of every row: start address
 * + 32 * (slice % 4) in panel slice / 4, 8-row groups SBO = 1024 bytes
 * apart (LBO unused). For a B operand read N-major (V in O = P V, TNSP 1,
 * rows = the k dimension) a k16 slice is 16 rows: start + 2048 * slice, the
 * 8-row groups SBO = 1024 apart and the 64-column panels LBO = R * 128
 * apart.
 *
 * Register fragments are those of mma.sync m16n8k16 (attn_mma_common.cuh)
 * for each warp's 16 rows of the warpgroup's 64: warp w of the warpgroup
 * holds rows 16w .. 16w + 15 of A and of the accumulator. */
#ifndef MTRAIN_ATTN_WGMMA_PTX_CUH
#define MTRAIN_ATTN_WGMMA_PTX_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace wg {

/* ---- PTX wrappers of variant 3 ---- */

/* The 64-bit shared-memory matrix descriptor: start address, leading and
 * stride byte offsets (all in 16-byte units), swizzle mode 1 (128 bytes). */
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo & 0x3FFFFu) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

/* Orders the warpgroup's register and shared-memory accesses before the
 * wgmma instructions that follow (needed whenever accumulator or A
 * registers were written by other instructions). */
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

/* Closes the group of wgmma instructions issued since the last commit. */
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Waits until at most N committed wgmma groups are pending. */
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving reads or writes of accumulator x across
 * the wgmma wait (or issue) next to it. */
__device__ __forceinline__ void reg_fence(float &x) { asm volatile("" : "+f"(x)::"memory"); }

/* ... and an A fragment register, so that it stays allocated (and
 * unchanged) until the wait that ends the wgmma reading it. */
__device__ __forceinline__ void reg_fence_u(uint32_t &x) { asm volatile("" : "+r"(x)::"memory"); }

/* Makes this thread's completed generic-proxy writes to shared memory (its
 * cp.async copies, once waited for) visible to the async proxy that wgmma
 * reads through; then a barrier publishes them to the warpgroup. */
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* wgmma.mma_async.sync.aligned.m64n<N>k16.f32.<TY>.<TY>: D[64 x N] += A[64 x
 * 16] x B[16 x N]; A from registers (the mma.sync A fragment of each warp's
 * 16 rows), B from shared memory through the descriptor bdesc; TNSP = 0:
 * B stored K-major (element (k, n) at row n, column k), 1: N-major (row k,
 * column n). d[4j + e] holds the C fragment of columns 8j.. of mma.sync
 * (e = 0, 1: row g; 2, 3: row g + 8). Scale-d is 1 (accumulate).
 * MTRAIN_WG_MMA writes one such instruction: REGS names the N/2
 * accumulator placeholders, A, DESC, SC, TN the placeholders after them,
 * OUTS the accumulator operands. */
#define MTRAIN_WG_MMA(N, TY, REGS, A, DESC, SC, TN, OUTS)                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n"                                     \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, {" A      \
               "}, " DESC ", p, 1, 1, " TN ";\n}\n"                                                \
               : OUTS                                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "n"(1), "n"(TNSP))

#define MTRAIN_WG_OUT16                                                                            \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),     \
      "+f"(d[15])
#define MTRAIN_WG_OUT32                                                                            \
  MTRAIN_WG_OUT16, "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),   \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),   \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MTRAIN_WG_OUT64                                                                            \
  MTRAIN_WG_OUT32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),   \
      "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]),   \
      "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),   \
      "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]),   \
      "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define MTRAIN_WG_REG16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define MTRAIN_WG_REG32                                                                            \
  MTRAIN_WG_REG16 ", "                                                                             \
                  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MTRAIN_WG_REG64                                                                            \
  MTRAIN_WG_REG32                                                                                  \
  ", "                                                                                             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "     \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

#define MTRAIN_WG_WRAPPER(N, NR, A, DESC, SC, TN)                                                  \
  template <typename T, int TNSP>                                                                  \
  __device__ __forceinline__ void wgmma_m64n##N##k16(float(&d)[NR], const uint32_t(&a)[4],         \
                                                     uint64_t bdesc) {                             \
    static_assert(TNSP == 0 || TNSP == 1, "transpose flag");                                       \
    if constexpr (std::is_same<T, __nv_bfloat16>::value)                                           \
      MTRAIN_WG_MMA(N, "bf16", MTRAIN_WG_REG##NR, A, DESC, SC, TN, MTRAIN_WG_OUT##NR);             \
    else                                                                                           \
      MTRAIN_WG_MMA(N, "f16", MTRAIN_WG_REG##NR, A, DESC, SC, TN, MTRAIN_WG_OUT##NR);              \
  }

MTRAIN_WG_WRAPPER(64, 32, "%32, %33, %34, %35", "%36", "%37", "%38")
MTRAIN_WG_WRAPPER(128, 64, "%64, %65, %66, %67", "%68", "%69", "%70")

/* wgmma.mma_async ... with A from shared memory too (SS): D[64 x N] += A[64
 * x 16] x B[16 x N], A through the descriptor adesc (TA = 0: stored K-major,
 * element (m, k) at row m, column k; 1: M-major, row k, column m), B as
 * above. MTRAIN_WG_MMA_SS writes one such instruction. */
#define MTRAIN_WG_MMA_SS(N, TY, REGS, ADESC, BDESC, SC, TA, TB, OUTS)                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n"                                     \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, " ADESC   \
               ", " BDESC ", p, 1, 1, " TA ", " TB ";\n}\n"                                        \
               : OUTS                                                                              \
               : "l"(adesc), "l"(bdesc), "n"(1), "n"(TNSPA), "n"(TNSPB))

#define MTRAIN_WG_WRAPPER_SS(N, NR, ADESC, BDESC, SC, TA, TB)                                      \
  template <typename T, int TNSPA, int TNSPB>                                                      \
  __device__ __forceinline__ void wgmma_ss_m64n##N##k16(float(&d)[NR], uint64_t adesc,             \
                                                        uint64_t bdesc) {                          \
    static_assert((TNSPA == 0 || TNSPA == 1) && (TNSPB == 0 || TNSPB == 1), "transpose flags");    \
    if constexpr (std::is_same<T, __nv_bfloat16>::value)                                           \
      MTRAIN_WG_MMA_SS(N, "bf16", MTRAIN_WG_REG##NR, ADESC, BDESC, SC, TA, TB, MTRAIN_WG_OUT##NR); \
    else                                                                                           \
      MTRAIN_WG_MMA_SS(N, "f16", MTRAIN_WG_REG##NR, ADESC, BDESC, SC, TA, TB, MTRAIN_WG_OUT##NR);  \
  }

MTRAIN_WG_WRAPPER_SS(64, 32, "%32", "%33", "%34", "%35", "%36")
MTRAIN_WG_WRAPPER_SS(128, 64, "%64", "%65", "%66", "%67", "%68")

#undef MTRAIN_WG_WRAPPER_SS
#undef MTRAIN_WG_MMA_SS
#undef MTRAIN_WG_WRAPPER
#undef MTRAIN_WG_MMA
#undef MTRAIN_WG_OUT16
#undef MTRAIN_WG_OUT32
#undef MTRAIN_WG_OUT64
#undef MTRAIN_WG_REG16
#undef MTRAIN_WG_REG32
#undef MTRAIN_WG_REG64

/* mbarrier (shared memory, CTA scope): init with the expected arrivals;
 * arrive (release); try_wait on the phase of the given parity (acquire):
 * true once that phase has completed. */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
               "selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(ok)
               : "r"(bar), "r"(parity)
               : "memory");
  return ok != 0;
}

/* Barrier `id` (1..15) over `count` threads (a multiple of 32). */
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

/* The calling threads' arrival on barrier `id` of `count` threads, without
 * waiting for it (bar.arrive: the threads that wait are the others'
 * named_barrier). */
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

/* setmaxnreg (sm_90a): the executing warpgroup's per-thread register limit
 * becomes N (a multiple of 8 in [24, 256]); dec returns registers to the
 * CTA's pool, inc takes them from it (blocking until the pool has them).
 * Executed by all 128 threads of a warpgroup, once per warpgroup here. */
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg count");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg count");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* ---- end of PTX wrappers of variant 3 ---- */

/* acc[64 x D] += A[64 x 64] B[64 x D] as 4 wgmma k-slices: A's k-slice j
 * (columns 16 j ..) as the A fragments a[j] in registers, B a 64-row panel
 * tile at sB read N-major (k-slice j = rows 16 j ..): O += P V of the
 * forward, dV += P^T dO and dK += dS^T Q of the backward. */
template <int D, typename T>
__device__ __forceinline__ void wgmma_regs_by_rows64(float (&acc)[D / 2], const uint32_t (&a)[4][4],
                                                     uint32_t sB) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint64_t bd = sw128_desc(sB + (uint32_t)(j * 16 * 128), 64 * 128, 1024);
    if constexpr (D == 128)
      wgmma_m64n128k16<T, 1>(acc, a[j], bd);
    else
      wgmma_m64n64k16<T, 1>(acc, a[j], bd);
  }
}

} /* namespace wg */

#endif /* MTRAIN_ATTN_WGMMA_PTX_CUH */
