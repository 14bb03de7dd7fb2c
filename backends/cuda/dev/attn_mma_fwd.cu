/* attn_mma_fwd.cu (development build only, see README.md): the forward step
 * of variant 1, the first tensor-core variant: cuda_mma_fwd. One CTA of 4 warps per (query head,
 * 64-row query tile); each warp owns 16 query rows, keeps its Q fragments,
 * the online-softmax state and the output accumulator in registers, and
 * streams the item's key tiles (run blocks 64 keys at a time, then the bars
 * gathered 64 at a time) through a double-buffered K/V tile pair filled by
 * cp.async. S = Q K^T and O += P V run on mma.sync m16n8k16; the step's
 * (LSE, O) is merged into o_acc/lse_acc straight from registers. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/dev/attn_mma1.cuh"
#include "backends/cuda/dev/attn_mma1.h"

namespace mma1 {

/* Dynamic shared memory of the forward: two stages of (K tile, V tile);
 * the Q tile is staged in stage 1's K tile before the key loop starts. */
template <int D> __host__ __device__ constexpr int fwd_smem_bytes() {
  return 2 * 2 * kTile * D * 2;
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, kFwdMinBlocks)
    mma_fwd_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                   const T *__restrict__ v, float *__restrict__ o_acc,
                   float *__restrict__ lse_acc) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int TB = kTile * D * 2; /* bytes of one tile */
  constexpr int NKS = D / 16;       /* k-slices of a QK^T product */
  constexpr int NDT = D / 8;        /* 8-column tiles of the output */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  mma2::QItem item; /* heaviest (last) query tiles first, the heads of one tile together */
  if (!mma2::q_item_begin<kTile>(st, item)) return;
  const int h = item.h, qb = item.qb, qt = item.qt, rows_here = item.rows;
  const int64_t gq = item.gq;
  const head_view hv = head_of(st, h);
  KeyWalk walk;
  walk.init(hv, qb, st.causal ? gq : -1, qt); /* non-causal: no diagonal block */
  KTile cur;
  if (!walk.next(st, cur)) return; /* no key for any row: nothing changes */

  const int hk = h / st.group;
  const int64_t q_stride = (int64_t)st.Hq * D, kv_stride = (int64_t)st.Hkv * D;
  const T *kbase = k + (int64_t)hk * D, *vbase = v + (int64_t)hk * D;
  const int64_t qrow0 = (int64_t)qb * st.G + (int64_t)qt * kTile;
  const uint32_t s0 = smem_u32(smem); /* stage x: K at s0 + 2*TB*x, V at + TB */
  const Frag<D> fr(lane);

  /* prologue: Q (into stage 1's K tile) and the first key tile (stage 0) */
  {
    int64_t rows[4];
    contiguous_rows(rows, qrow0, rows_here, tid);
    load_rows<D>(s0 + 2 * TB, q + (int64_t)h * D, q_stride, rows, tid);
  }
  load_kv_tile<D>(s0, s0 + TB, kbase, vbase, kv_stride, walk, cur, tid);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[NKS][4]; /* A fragments of the warp's 16 rows, k-slice kk */
#pragma unroll
  for (int kk = 0; kk < NKS; ++kk)
    ldsm_x4(s0 + 2 * TB + fr.A(warp * 16, 2 * kk), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
  __syncthreads(); /* stage 1 is overwritten by the next tile below */

  /* o[n]: C fragment of output columns 8n..8n+7; rows g (m[0], l[0]) and
   * g+8 (m[1], l[1]); m is the running max of the log2-domain logits,
   * l the thread's partial row sum (its 16 of the 64 columns per tile). */
  float o[NDT][4];
#pragma unroll
  for (int n = 0; n < NDT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = st.scale * kLog2e;
  const int row_a = warp * 16 + g; /* tile-local rows row_a and row_a + 8 */

  int stage = 0;
  for (;;) {
    KTile nxt;
    const bool more = walk.next(st, nxt);
    if (more) {
      const uint32_t sn = s0 + (uint32_t)((stage ^ 1) * 2 * TB);
      load_kv_tile<D>(sn, sn + TB, kbase, vbase, kv_stride, walk, nxt, tid);
    }
    cp_async_commit();
    cp_async_wait<1>(); /* the current tile has landed (this thread's part) */
    __syncthreads();    /* ... and every thread's */
    const uint32_t sK = s0 + (uint32_t)(stage * 2 * TB), sV = sK + TB;

    /* S = Q K^T: s[n] = columns (keys) 8n..8n+7 of the tile */
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < NKS; ++kk) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(sK + fr.B(np * 16, 2 * kk), b0, b1, b2, b3);
        mma16816<T>(s[2 * np], qf[kk], b0, b1);
        mma16816<T>(s[2 * np + 1], qf[kk], b2, b3);
      }
    }

    /* log2-domain logits; masked columns -inf */
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[n][j] *= sl2;
    if (cur.nvalid < kTile || cur.causal) {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int col = n * 8 + 2 * t4 + (j & 1), row = row_a + ((j >> 1) << 3);
          if (col >= cur.nvalid || (cur.causal && col > row)) s[n][j] = -INFINITY;
        }
    }

    /* online softmax (rows g: j = 0, 1; g+8: j = 2, 3) */
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mnew = fmaxf(m[i], mx);
      const float mu = mnew == -INFINITY ? 0.f : mnew; /* no key yet: exp2(-inf) = 0 */
      alpha[i] = fast_exp2(m[i] - mu);
      m[i] = mnew;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        s[n][2 * i] = fast_exp2(s[n][2 * i] - mu);
        s[n][2 * i + 1] = fast_exp2(s[n][2 * i + 1] - mu);
        sum += s[n][2 * i] + s[n][2 * i + 1];
      }
      l[i] = l[i] * alpha[i] + sum;
    }
#pragma unroll
    for (int n = 0; n < NDT; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    /* O += P V: k-slice j = keys 16j..16j+15; V B fragments by ldmatrix.trans */
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t pa[4];
      pack_a<T>(pa, s[2 * j], s[2 * j + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(sV + fr.A(16 * j, 2 * dp), b0, b1, b2, b3);
        mma16816<T>(o[2 * dp], pa, b0, b1);
        mma16816<T>(o[2 * dp + 1], pa, b2, b3);
      }
    }
    __syncthreads(); /* everyone is done with this stage before it is refilled */
    if (!more) break;
    cur = nxt;
    stage ^= 1;
  }

  /* merge the step's (lse_s, O / l) into the running values, row by row */
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    const int row = row_a + 8 * i;
    const bool valid = row < rows_here;
    const int64_t gi = (qrow0 + row) * st.Hq + h;
    /* one read of the old LSE per row, broadcast over the 4 lanes of the row,
     * so that lane t4 == 0's store below cannot race with a read */
    float lse_old = (valid && t4 == 0) ? lse_acc[gi] : 0.f;
    lse_old = __shfl_sync(0xffffffffu, lse_old, lane & ~3);
    if (valid && l[i] > 0.f) {
      const float lse_s = (m[i] + log2f(l[i])) * kLn2;
      const float inv = 1.f / l[i];
      float w_old, w_new;
      const float lse_new = merge_weights(lse_old, lse_s, &w_old, &w_new);
      const float a_new = w_new * inv;
      float *orow = o_acc + gi * D;
#pragma unroll
      for (int n = 0; n < NDT; ++n) {
        float2 *p = reinterpret_cast<float2 *>(orow + n * 8 + 2 * t4);
        float2 x = *p;
        x.x = w_old * x.x + a_new * o[n][2 * i];
        x.y = w_old * x.y + a_new * o[n][2 * i + 1];
        *p = x;
      }
      if (t4 == 0) lse_acc[gi] = lse_new;
    }
  }
}

/* ---- host side ---- */

template <int D, typename T>
static mtrain_status_t launch_fwd(cuda_state_t *s, const cuda_step_t *st,
                                  const mtrain_fwd_step_args_t *a) {
  static cuda_smem_attr_t attr;
  return mma2::launch_fwd_kernel(s, mma_fwd_kernel<D, T>, "variant 1", "mma_fwd_kernel",
                                 cuda_q_items(st, kTile), kThreads, fwd_smem_bytes<D>(), &attr, st,
                                 a);
}

} /* namespace mma1 */

extern "C" mtrain_status_t cuda_mma_fwd(cuda_state_t *s, const cuda_step_t *st,
                                        const mtrain_fwd_step_args_t *a) {
  const bool bf16 = a->dtype == MTRAIN_BF16;
  if (st->d == 64)
    return bf16 ? mma1::launch_fwd<64, __nv_bfloat16>(s, st, a)
                : mma1::launch_fwd<64, __half>(s, st, a);
  return bf16 ? mma1::launch_fwd<128, __nv_bfloat16>(s, st, a)
              : mma1::launch_fwd<128, __half>(s, st, a);
}
