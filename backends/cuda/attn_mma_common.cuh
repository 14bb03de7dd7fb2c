/* attn_mma_common.cuh (private): the mma.sync building blocks of the
 * tensor-core kernels (namespace mma), used by variants 2 and 3
 * (attn_mma2_*.cu, attn_wgmma_*.cu) and by the development variant 1
 * (dev/): the PTX wrappers (cp.async, ldmatrix, mma.sync m16n8k16 with
 * bf16/fp16 inputs and fp32 accumulators, ex2), the packing of C fragments
 * into A fragments, the ldmatrix addressing of the swizzled shared-memory
 * layout of a tile, and the bar cursor of a query block's segments.
 *
 * Fragment layouts of mma.sync.aligned.m16n8k16 (g = lane / 4, t = lane % 4,
 * "{x, y}" = one 32-bit register holding two 16-bit values, x in the low
 * half):
 *  - A (16x16, row-major) in 4 registers: R0 = {A[g][2t], A[g][2t+1]},
 *    R1 = {A[g+8][2t], A[g+8][2t+1]}, R2 = {A[g][2t+8], A[g][2t+9]},
 *    R3 = {A[g+8][2t+8], A[g+8][2t+9]};
 *  - B (16x8, "col": k contiguous for a fixed column n) in 2 registers:
 *    R0 = {B[2t][g], B[2t+1][g]}, R1 = {B[2t+8][g], B[2t+9][g]};
 *  - C/D (16x8 fp32) in 4 floats: c0, c1 = C[g][2t], C[g][2t+1];
 *    c2, c3 = C[g+8][2t], C[g+8][2t+1].
 * So the C fragments of two adjacent 16x8 tiles (columns 16j..16j+7 and
 * 16j+8..16j+15) packed pairwise to 16 bits are exactly the A fragment of
 * the 16x16 k-slice j (pack_a below): this is how P and dS feed the next
 * product without going through shared memory.
 *
 * ldmatrix.x4: lanes 8i..8i+7 give the row addresses (16 bytes each) of
 * 8x8 matrix i, and register i of lane l receives {M_i[l/4][2(l%4)],
 * M_i[l/4][2(l%4)+1]}; with .trans it receives {M_i[2(l%4)][l/4],
 * M_i[2(l%4)+1][l/4]} (the stored matrix transposed).
 *
 * Shared-memory tile: 64 rows of D 16-bit elements, row r at byte r*2D,
 * its 16-byte chunk c (elements 8c..8c+7) stored at chunk c ^ (r & 7). The
 * 8 row addresses of one ldmatrix phase are 8 consecutive rows at one
 * logical chunk, hence 8 distinct physical chunks of a 128-byte line: no
 * bank conflicts; cp.async stores of 8 threads covering one row's 8
 * consecutive chunks are conflict-free as well. */
#ifndef MTRAIN_ATTN_MMA_COMMON_CUH
#define MTRAIN_ATTN_MMA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

namespace mma {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/* ---- PTX wrappers (the only inline assembly of this file) ---- */

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte global -> shared copy; valid == false zero-fills the 16 bytes
 * without reading (src must still be a mapped address). */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

/* 4-byte global -> shared copy with the same zero-fill rule. */
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until at most N of this thread's committed groups are pending. */
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                        uint32_t &r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                          uint32_t &r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

/* D = A B + D, 16x8x16, fp32 accumulators. */
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 2^x, one MUFU.EX2 (flushes results below 2^-126 to 0; 2^-inf = 0),
 * without exp2f's denormal fix-up of every call. */
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/* ---- end of PTX wrappers ---- */

/* Two floats rounded to the storage type, lo in the low 16 bits. */
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}

/* The A fragment of k-slice j from the C fragments of columns 16j..16j+7
 * (c_lo) and 16j+8..16j+15 (c_hi) of the same 16 rows. */
template <typename T>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c_lo)[4],
                                       const float (&c_hi)[4]) {
  a[0] = pack2<T>(c_lo[0], c_lo[1]);
  a[1] = pack2<T>(c_lo[2], c_lo[3]);
  a[2] = pack2<T>(c_hi[0], c_hi[1]);
  a[3] = pack2<T>(c_hi[2], c_hi[3]);
}

/* Per-lane ldmatrix.x4 addressing of a swizzled tile (row 16-aligned base
 * m0, even logical chunk c2 = 2 * (k-slice or column pair)):
 *  - A(m0, c2): lane row m0 + (lane & 15), logical chunk c2 + (lane >> 4).
 *    Non-transposed it yields the A fragment of rows m0..m0+15, columns
 *    8*c2..8*c2+15; with .trans on a [k][n] tile (rows = k) it yields the B
 *    fragments of k-rows m0..m0+15 for the two 8-column tiles 8*c2 (R0, R1)
 *    and 8*c2 + 8 (R2, R3).
 *  - B(m0, c2): lane row m0 + (lane & 7) + 8 * (lane >> 4), logical chunk
 *    c2 + ((lane >> 3) & 1). Non-transposed on an [n][k] tile (rows = n) it
 *    yields the B fragments of n-rows m0..m0+7 (R0, R1) and m0+8..m0+15
 *    (R2, R3) for k = 8*c2..8*c2+15.
 * The lane's row & 7 is lane & 7 (m0 is a multiple of 16), so its physical
 * chunk is (c2 + off) ^ (lane & 7) = 8 * (c2 / 8) + ((c2 % 8) ^ x) with
 * x = off ^ (lane & 7) < 8 (c2 even, off < 2): four per-lane offsets (one
 * per c2 % 8) plus compile-time immediates address every fragment. */
template <int D> struct Frag {
  static constexpr int RB = D * 2; /* bytes per tile row */
  uint32_t a[4], b[4];
  __device__ __forceinline__ explicit Frag(int lane) {
    const int xa = (lane >> 4) ^ (lane & 7), xb = ((lane >> 3) & 1) ^ (lane & 7);
    const int ra = lane & 15, rb = (lane & 7) | ((lane >> 4) << 3);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = (uint32_t)(ra * RB + (((2 * i) ^ xa) << 4));
      b[i] = (uint32_t)(rb * RB + (((2 * i) ^ xb) << 4));
    }
  }
  __device__ __forceinline__ uint32_t A(int m0, int c2) const {
    return a[(c2 >> 1) & 3] + (uint32_t)(m0 * RB + ((c2 >> 3) << 7));
  }
  __device__ __forceinline__ uint32_t B(int m0, int c2) const {
    return b[(c2 >> 1) & 3] + (uint32_t)(m0 * RB + ((c2 >> 3) << 7));
  }
};

/* Byte offset in a tile of D columns: row `row`, physical chunk `pchunk`. */
template <int D> __device__ __forceinline__ uint32_t toff(int row, int pchunk) {
  return (uint32_t)(row * (D * 2) + (pchunk << 4));
}

/* Moves the bar cursor (segment s, bar index b) p bars forward through the
 * segments [s, s_end) (segs[2s] <= b <= segs[2s+1]); past the last bar it
 * stops with s == s_end. p == 0 skips empty segments. */
__device__ __forceinline__ void seg_walk(const int32_t *segs, int s_end, int &s, int &b, int p) {
  while (s < s_end) {
    const int avail = segs[2 * s + 1] - b;
    if (p < avail) {
      b += p;
      return;
    }
    p -= avail;
    if (++s < s_end) b = segs[2 * s];
  }
}

} /* namespace mma */

#endif /* MTRAIN_ATTN_MMA_COMMON_CUH */
