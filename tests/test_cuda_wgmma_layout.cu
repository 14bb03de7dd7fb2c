/* test_cuda_wgmma_layout.cu: checks the shared-memory layout, descriptors and
 * register fragments that variant 3 feeds to wgmma (attn_wgmma_ptx.cuh) on
 * one tile, against a host computation: S = Q K^T (64 x 64, d = 128, K read
 * K-major from two 64-column panels) and O = P V (64 x 128, P = S rounded to
 * the storage type, from registers; V read N-major, two panels), and the
 * same with d = 64 (one panel), for bf16
 * and fp16 inputs with random values (fixed seed, printed). Exits 77 (ctest:
 * skipped) without a compute capability 9.0 GPU. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/attn_wgmma_ptx.cuh"

namespace {

constexpr int kRows = 64;

/* The 64-row panel-layout loader of attn_wgmma_fwd.cu, restated for one
 * tile of contiguous rows (128 threads). */
template <int kD, typename T> __device__ void load_panels(uint32_t sdst, const T *g, int tid) {
  const int i0 = tid >> 3, c0 = tid & 7, cx = c0 ^ (i0 & 7);
  for (int r = 0; r < kRows / 16; ++r) {
    const int i = i0 + 16 * r;
    for (int p = 0; p < kD / 64; ++p)
      mma::cp_async16(sdst + (uint32_t)(p * kRows * 128 + i * 128 + cx * 16),
                      g + (int64_t)i * kD + 64 * p + c0 * 8, true);
  }
}

template <int kD, typename T>
__global__ void __launch_bounds__(128)
    probe(const T *q, const T *k, const T *v, float *s_out, float *o_out) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();
#else
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t s0 = (mma::smem_u32(smem) + 1023u) & ~1023u;
  const uint32_t sK = s0, sV = s0 + kRows * kD * 2, sQ = s0 + 2 * kRows * kD * 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  load_panels<kD>(sK, k, tid);
  load_panels<kD>(sV, v, tid);
  {
    int64_t rows[mma2::LoadShape<128, kRows>::kRows];
    mma2::contiguous_rows_n<128, kRows>(rows, 0, kRows, tid);
    mma2::load_rows_n<kD, 128, kRows>(sQ, q, kD, rows, tid);
  }
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  wg::fence_proxy_async();
  __syncthreads();
  const mma::Frag<kD> fr(lane);
  uint32_t qf[kD / 16][4];
  for (int kk = 0; kk < kD / 16; ++kk)
    mma::ldsm_x4(sQ + fr.A(16 * warp, 2 * kk), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
  float s[32];
  for (int x = 0; x < 32; ++x) s[x] = 0.f;
  wg::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
    wg::wgmma_m64n64k16<T, 0>(
        s, qf[kk],
        wg::sw128_desc(sK + (uint32_t)((kk >> 2) * kRows * 128 + (kk & 3) * 32), 16, 1024));
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  for (int x = 0; x < 32; ++x) wg::reg_fence(s[x]);
  for (int x = 0; x < 32; ++x) {
    const int row = 16 * warp + g + 8 * ((x >> 1) & 1), col = 8 * (x >> 2) + 2 * t4 + (x & 1);
    s_out[row * 64 + col] = s[x];
  }
  uint32_t pa[4][4];
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < 4; ++r) pa[j][r] = mma::pack2<T>(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
  float o[kD / 2];
  for (int x = 0; x < kD / 2; ++x) o[x] = 0.f;
  wg::wgmma_fence();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint64_t vd = wg::sw128_desc(sV + (uint32_t)(j * 2048), kRows * 128, 1024);
    if constexpr (kD == 128)
      wg::wgmma_m64n128k16<T, 1>(o, pa[j], vd);
    else
      wg::wgmma_m64n64k16<T, 1>(o, pa[j], vd);
  }
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  for (int x = 0; x < kD / 2; ++x) wg::reg_fence(o[x]);
  for (int x = 0; x < kD / 2; ++x) {
    const int row = 16 * warp + g + 8 * ((x >> 1) & 1), col = 8 * (x >> 2) + 2 * t4 + (x & 1);
    o_out[row * kD + col] = o[x];
  }
#endif
}

template <typename T> float to_float(T x);
template <> float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> float to_float(__half x) { return __half2float(x); }
template <typename T> T from_float(float x);
template <> __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <> __half from_float(float x) { return __float2half_rn(x); }

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                                     \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

/* Returns 0 when S and O match the host within tolerance, 1 otherwise. */
template <int kD, typename T> int run(const char *name, unsigned seed) {
  srand(seed);
  const int nq = kRows * kD;
  std::vector<T> hq(nq), hk(nq), hv(nq);
  auto rnd = [] { return (float)rand() / RAND_MAX * 2.f - 1.f; };
  for (int i = 0; i < nq; ++i) {
    hq[i] = from_float<T>(rnd());
    hk[i] = from_float<T>(rnd());
    hv[i] = from_float<T>(rnd());
  }
  T *dq, *dk, *dv;
  float *ds, *dO;
  CK(cudaMalloc(&dq, nq * sizeof(T)));
  CK(cudaMalloc(&dk, nq * sizeof(T)));
  CK(cudaMalloc(&dv, nq * sizeof(T)));
  CK(cudaMalloc(&ds, kRows * 64 * sizeof(float)));
  CK(cudaMalloc(&dO, nq * sizeof(float)));
  CK(cudaMemcpy(dq, hq.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, hk.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, hv.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
  const int smem = 48 * 1024 + 1024;
  CK(cudaFuncSetAttribute(probe<kD, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  probe<kD, T><<<1, 128, smem>>>(dq, dk, dv, ds, dO);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> s(kRows * 64), o(nq);
  CK(cudaMemcpy(s.data(), ds, s.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.data(), dO, o.size() * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(ds);
  cudaFree(dO);
  double es = 0, eo = 0;
  int bad_r = -1, bad_c = -1;
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 64; ++c) {
      double ref = 0;
      for (int x = 0; x < kD; ++x)
        ref += (double)to_float(hq[r * kD + x]) * to_float(hk[c * kD + x]);
      const double e = fabs(ref - s[r * 64 + c]);
      if (!(e <= es)) es = e, bad_r = r, bad_c = c;
    }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kD; ++c) {
      double ref = 0;
      for (int x = 0; x < 64; ++x)
        ref += (double)to_float(from_float<T>(s[r * 64 + x])) * to_float(hv[x * kD + c]);
      const double e = fabs(ref - o[r * kD + c]);
      if (!(e <= eo)) eo = e;
    }
  const int ok = es < 1e-3 && eo < 1e-2;
  printf("%s d%d (seed %u): S = Q K^T max |err| %.3e (worst row %d column %d), O = P V max |err| "
         "%.3e: %s\n",
         name, kD, seed, es, bad_r, bad_c, eo, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

} // namespace

int main(void) {
  int n = 0;
  cudaDeviceProp prop;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
    printf("not a compute capability 9.0 GPU: skipped\n");
    return 77;
  }
  int fails = run<128, __nv_bfloat16>("bf16", 1234u);
  fails += run<128, __half>("fp16", 4321u);
  fails += run<64, __nv_bfloat16>("bf16", 1234u);
  fails += run<64, __half>("fp16", 4321u);
  return fails ? 1 : 0;
}
