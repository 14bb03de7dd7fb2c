/* attn_mma2_fwd.cu: the forward step of variant 2 (tensor cores, tuned):
 * cuda_mma2_fwd, with cuda_mma2_supports (the shapes of every tensor-core
 * variant) and cuda_mma2_config_from_env (the tile configuration, read once
 * per context). One CTA per (query head, query tile
 * of BM = NW * WM rows): NW warps own WM query rows each (one or two 16-row
 * MMA tiles) and keep the online-softmax state and the output accumulator in
 * registers; the item's key tiles (run blocks 64 keys at a time, then the
 * bars gathered 64 at a time) stream through two cp.async stages of (K, V).
 * Differences from variant 1 (dev/attn_mma_fwd.cu, which it replaced):
 *  - 128-row query tiles (G a multiple of 128): every K/V tile brought to
 *    shared memory serves twice the rows; with 4 warps x 32 rows every K/V
 *    fragment read from shared memory also feeds two MMA row tiles;
 *  - one barrier per key tile (wait, barrier, then the next tile's loads);
 *  - the softmax scale folded into one FFMA per score (max taken on the raw
 *    scores, the scale is positive), and the O rescale skipped when no row
 *    maximum of the warp changed (exact: the factor would be 1);
 *  - a warp whose rows see no key of a tile (causal diagonal, padding rows)
 *    skips its MMAs;
 * The kernel shapes are template parameters; the context's tile
 * configuration (MTRAIN_CUDA_MMA2_CONFIG) picks one (attn_mma2_common.cuh). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "backends/cuda/attn_mma2.h"
#include "backends/cuda/attn_mma2_common.cuh"
#include "backends/cuda/cuda_internal.h"
#include "mtrain/mtrain_error.h"

namespace mma2 {

/* Shape of a forward kernel: NW warps x WM rows; QREG: Q fragments kept in
 * registers (staged once in the second K/V stage) instead of re-read from a
 * resident Q tile per key tile. */
template <int D, int NW, int WM, bool QREG> struct FwdShape {
  static_assert(WM == 16 || WM == 32, "16 or 32 query rows per warp");
  static constexpr int NT = 32 * NW, BM = NW * WM, MT = WM / 16;
  static constexpr int TBK = kKT * D * 2; /* one K or V tile */
  static constexpr int TBQ = BM * D * 2;  /* the Q tile */
  static constexpr int kRingOff = (QREG ? 0 : TBQ) + 4 * TBK;
  static constexpr int kSmem = kRingOff + kRingBytes;
  static_assert(!QREG || TBQ <= 2 * TBK, "Q is staged in the second K/V stage");
};

/* The forward kinds of attn_mma2_common.cuh: shape and __launch_bounds__
 * minimum of resident CTAs (registers <= 65536 / (NT * MINB)). */
template <int D, int KIND> struct FwdKind;
template <int D> struct FwdKind<D, kFwd4x32> {
  static constexpr int NW = 4, WM = 32, MINB = 2;
  static constexpr bool QREG = D == 64;
};
template <int D> struct FwdKind<D, kFwd8x16> {
  /* at d = 128 the 128-register cap of two CTAs spills (with Q re-read
   * from shared memory too): one CTA of 8 warps per SM */
  static constexpr int NW = 8, WM = 16, MINB = D == 64 ? 2 : 1;
  static constexpr bool QREG = true;
};
template <int D> struct FwdKind<D, kFwd4x16> {
  static constexpr int NW = 4, WM = 16, MINB = 3;
  static constexpr bool QREG = true;
};

template <int D, int KIND> struct FwdKindCheck {
  using K = FwdKind<D, KIND>;
  static_assert(fits_sm90(FwdShape<D, K::NW, K::WM, K::QREG>::kSmem, K::MINB),
                "shared memory per SM");
  static constexpr bool ok = true;
};
static_assert(FwdKindCheck<64, kFwd4x32>::ok && FwdKindCheck<64, kFwd8x16>::ok &&
                  FwdKindCheck<64, kFwd4x16>::ok && FwdKindCheck<128, kFwd4x32>::ok &&
                  FwdKindCheck<128, kFwd8x16>::ok && FwdKindCheck<128, kFwd4x16>::ok,
              "forward kinds");

template <int D, typename T, int NW, int WM, bool QREG, int MINB>
__global__ void __launch_bounds__(32 * NW, MINB)
    mma2_fwd_kernel(const cuda_step_t st, const T *__restrict__ q, const T *__restrict__ k,
                    const T *__restrict__ v, float *__restrict__ o_acc,
                    float *__restrict__ lse_acc) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = FwdShape<D, NW, WM, QREG>;
  constexpr int NT = S::NT, BM = S::BM, MT = S::MT, TBK = S::TBK;
  constexpr int NKS = D / 16; /* k-slices of Q K^T */
  constexpr int NDT = D / 8;  /* 8-column tiles of O */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  QItem item; /* heaviest (last) query tiles first, the heads of one tile together */
  if (!q_item_begin<BM>(st, item)) return;
  const int h = item.h, qb = item.qb, qt = item.qt, rows_here = item.rows;
  TileRing &ring = *reinterpret_cast<TileRing *>(smem + S::kRingOff);
  if (tid == 0) ring.start(st, item, BM);
  __syncthreads();
  if (ring.d[0].kind == 0) return; /* no key for any row: nothing changes */

  const int hk = h / st.group;
  const int64_t q_stride = (int64_t)st.Hq * D, kv_stride = (int64_t)st.Hkv * D;
  const T *kbase = k + (int64_t)hk * D, *vbase = v + (int64_t)hk * D;
  const int64_t qrow0 = (int64_t)qb * st.G + (int64_t)qt * BM;
  const uint32_t s0 = smem_u32(smem);
  /* QREG: Q staged in stage 1; else a resident Q tile before the stages.
   * Stage x: K at sKV + 2 * TBK * x, V at + TBK. */
  const uint32_t sQ = QREG ? s0 + 2 * TBK : s0;
  const uint32_t sKV = QREG ? s0 : s0 + (uint32_t)S::TBQ;
  const Frag<D> fr(lane);

  {
    int64_t rows[LoadShape<NT, BM>::kRows];
    contiguous_rows_n<NT, BM>(rows, qrow0, rows_here, tid);
    load_rows_n<D, NT, BM>(sQ, q + (int64_t)h * D, q_stride, rows, tid);
  }
  ring.load<D, NT>(st, sKV, sKV + TBK, kbase, vbase, kv_stride, ring.d[0], tid);
  cp_async_commit();

  const int wr0 = warp * WM; /* the warp's first tile row */
  uint32_t qf[QREG ? MT : 1][QREG ? NKS : 1][4];
  if constexpr (QREG) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int kk = 0; kk < NKS; ++kk)
        ldsm_x4(sQ + fr.A(wr0 + 16 * i, 2 * kk), qf[i][kk][0], qf[i][kk][1], qf[i][kk][2],
                qf[i][kk][3]);
    __syncthreads(); /* stage 1 is refilled below */
  }

  /* o[i][n]: C fragment of rows wr0 + 16i (+g, +g+8), output columns
   * 8n..8n+7. m[i][hh]: running max of row wr0 + 16i + 8hh + g in the log2
   * domain (scale * log2 e folded in); l[i][hh]: the thread's partial row
   * sum (its 16 of 64 columns per tile). */
  float o[MT][NDT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int n = 0; n < NDT; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.f;
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) m[i][0] = m[i][1] = -INFINITY, l[i][0] = l[i][1] = 0.f;
  const float sl2 = st.scale * kLog2e;

  int it = 0; /* tile index: ring slot it % 3, stage it % 2 */
  for (;;) {
    cp_async_wait<0>(); /* tile it has landed (this thread's part) */
    __syncthreads();    /* ... every thread's; the other stage is free */
    const int slot = it % 3, slot1 = slot == 2 ? 0 : slot + 1;
    const KTile2 nxt = ring.d[slot1];
    const bool more = nxt.kind != 0;
    const int stage = it & 1;
    if (more) {
      const uint32_t sn = sKV + (uint32_t)((stage ^ 1) * 2 * TBK);
      ring.load<D, NT>(st, sn, sn + TBK, kbase, vbase, kv_stride, nxt, tid);
      cp_async_commit();
      if (tid == 0) ring.produce(st, slot1 == 2 ? 0 : slot1 + 1);
    }
    const int c_nvalid = ring.d[slot].nvalid, c_causal = ring.d[slot].causal;
    const int c_off = ring.d[slot].off;
    const uint32_t sK = sKV + (uint32_t)(stage * 2 * TBK), sV = sK + TBK;
    /* rows wr0 .. wr0 + WM - 1 all padding, or all before the tile's keys
     * (only with 128-row tiles: a 64-row tile starts at its diagonal key
     * tile, and the test costs variant 1's tiling registers it lacks) */
    const bool skip = BM > kKT && (wr0 >= rows_here || (c_causal && c_off > wr0 + WM - 1));
    if (!skip) {
      /* S = Q K^T: s[i][n] = rows of MMA tile i, keys 8n..8n+7 */
      float s[MT][8][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int n = 0; n < 8; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < NKS; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          if constexpr (QREG) {
            a[i][0] = qf[i][kk][0];
            a[i][1] = qf[i][kk][1];
            a[i][2] = qf[i][kk][2];
            a[i][3] = qf[i][kk][3];
          } else {
            ldsm_x4(sQ + fr.A(wr0 + 16 * i, 2 * kk), a[i][0], a[i][1], a[i][2], a[i][3]);
          }
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sK + fr.B(np * 16, 2 * kk), b0, b1, b2, b3);
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            mma16816<T>(s[i][2 * np], a[i], b0, b1);
            mma16816<T>(s[i][2 * np + 1], a[i], b2, b3);
          }
        }
      }

      /* masked scores -inf (raw scores; the scale is applied below) */
      if (c_nvalid < kKT || (c_causal && c_off + kKT - 1 > wr0)) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int col = n * 8 + 2 * t4 + (j & 1);
              const int row = wr0 + 16 * i + g + ((j >> 1) << 3);
              if (col >= c_nvalid || (c_causal && col + c_off > row)) s[i][n][j] = -INFINITY;
            }
      }

      /* online softmax, rows (i, hh): s[i][n][2hh], s[i][n][2hh + 1] */
      bool changed = false;
      float alpha[MT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[i][n][2 * hh], s[i][n][2 * hh + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mnew = fmaxf(m[i][hh], mx * sl2);
          changed |= mnew != m[i][hh];
          const float mu = mnew == -INFINITY ? 0.f : mnew; /* no key yet: exp2(-inf) = 0 */
          alpha[i][hh] = fast_exp2(m[i][hh] - mu);
          m[i][hh] = mnew;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < 8; ++n) {
            s[i][n][2 * hh] = fast_exp2(fmaf(s[i][n][2 * hh], sl2, -mu));
            s[i][n][2 * hh + 1] = fast_exp2(fmaf(s[i][n][2 * hh + 1], sl2, -mu));
            sum += s[i][n][2 * hh] + s[i][n][2 * hh + 1];
          }
          l[i][hh] = l[i][hh] * alpha[i][hh] + sum;
        }
      if (__any_sync(0xffffffffu, changed)) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int n = 0; n < NDT; ++n) {
            o[i][n][0] *= alpha[i][0];
            o[i][n][1] *= alpha[i][0];
            o[i][n][2] *= alpha[i][1];
            o[i][n][3] *= alpha[i][1];
          }
      }

      /* O += P V: k-slice j = keys 16j..16j+15; V B fragments by .trans,
       * each feeding the warp's MT row tiles */
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) pack_a<T>(pa[i], s[i][2 * j], s[i][2 * j + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(sV + fr.A(16 * j, 2 * dp), b0, b1, b2, b3);
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            mma16816<T>(o[i][2 * dp], pa[i], b0, b1);
            mma16816<T>(o[i][2 * dp + 1], pa[i], b2, b3);
          }
        }
      }
    }
    if (!more) break;
    ++it;
  }

  /* merge the step's (lse_s, O / l) into the running values, row by row */
  const int64_t e_row0 = ring.row0;
  const int e_rows = ring.rows, e_h = ring.h;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float li = l[i][hh];
      li += __shfl_xor_sync(0xffffffffu, li, 1);
      li += __shfl_xor_sync(0xffffffffu, li, 2);
      const int row = wr0 + 16 * i + 8 * hh + g;
      const bool valid = row < e_rows;
      const int64_t gi = (e_row0 + row) * st.Hq + e_h;
      /* one read of the old LSE per row, broadcast over the row's 4 lanes,
       * so that lane t4 == 0's store below cannot race with a read */
      float lse_old = (valid && t4 == 0) ? lse_acc[gi] : 0.f;
      lse_old = __shfl_sync(0xffffffffu, lse_old, lane & ~3);
      if (valid && li > 0.f) {
        const float lse_s = (m[i][hh] + log2f(li)) * kLn2;
        const float inv = 1.f / li;
        float w_old, w_new;
        const float lse_new = merge_weights(lse_old, lse_s, &w_old, &w_new);
        const float a_new = w_new * inv;
        float *orow = o_acc + gi * D;
#pragma unroll
        for (int n = 0; n < NDT; ++n) {
          float2 *p = reinterpret_cast<float2 *>(orow + n * 8 + 2 * t4);
          float2 x = *p;
          x.x = w_old * x.x + a_new * o[i][n][2 * hh];
          x.y = w_old * x.y + a_new * o[i][n][2 * hh + 1];
          *p = x;
        }
        if (t4 == 0) lse_acc[gi] = lse_new;
      }
    }
}

/* ---- host side ---- */

template <int D, typename T, int KIND>
static mtrain_status_t launch_fwd(cuda_state_t *s, const cuda_step_t *st,
                                  const mtrain_fwd_step_args_t *a) {
  using K = FwdKind<D, KIND>;
  using S = FwdShape<D, K::NW, K::WM, K::QREG>;
  static cuda_smem_attr_t attr;
  return launch_fwd_kernel(s, mma2_fwd_kernel<D, T, K::NW, K::WM, K::QREG, K::MINB>, "variant 2",
                           "mma2_fwd_kernel", cuda_q_items(st, S::BM), S::NT, S::kSmem, &attr, st,
                           a);
}

template <int D, typename T>
static mtrain_status_t fwd_kind(cuda_state_t *s, const cuda_step_t *st,
                                const mtrain_fwd_step_args_t *a, int kind) {
  switch (kind) {
  case kFwd4x32:
    return launch_fwd<D, T, kFwd4x32>(s, st, a);
  case kFwd8x16:
    return launch_fwd<D, T, kFwd8x16>(s, st, a);
  default:
    return launch_fwd<D, T, kFwd4x16>(s, st, a);
  }
}

} /* namespace mma2 */

extern "C" mtrain_status_t cuda_mma2_config_from_env(int *index) {
  const char *e = getenv("MTRAIN_CUDA_MMA2_CONFIG");
  *index = 0;
  if (!e || !*e) return MTRAIN_SUCCESS;
  if (e[0] >= '0' && e[0] < '0' + CUDA_MMA2_NUM_CONFIGS && e[1] == '\0') {
    *index = e[0] - '0';
    return MTRAIN_SUCCESS;
  }
  return mtrain_error(MTRAIN_ERR_INVALID_CONFIG,
                      "backend 'cuda': environment variable MTRAIN_CUDA_MMA2_CONFIG='%s': "
                      "expected 0 (4 warps x 32 query rows forward, 128-row dQ, 128-key dK/dV), "
                      "1 (8 warps x 16 query rows forward, 64-row dQ, 128-key dK/dV) or 2 "
                      "(64-row and 64-key tiles everywhere)",
                      e);
}

/* The shapes of every tensor-core variant (variant 3 and the development
 * variant 1 take the same). */
extern "C" int cuda_mma2_supports(mtrain_dtype_t dtype, int32_t d, int32_t G, const char **why) {
  const char *reason = NULL;
  if (dtype != MTRAIN_BF16 && dtype != MTRAIN_F16)
    reason = "the tensor-core variants compute bf16 and fp16 inputs only";
  else if (d != 64 && d != 128)
    reason = "the tensor-core variants compute head_dim 64 and 128 only";
  else if (G <= 0 || G % 64 != 0)
    reason = "the tensor-core variants need a granularity that is a multiple of 64";
  if (reason) {
    if (why) *why = reason;
    return 0;
  }
  return 1;
}

extern "C" mtrain_status_t cuda_mma2_fwd(cuda_state_t *s, const cuda_step_t *st,
                                         const mtrain_fwd_step_args_t *a) {
  const int kind = mma2::effective_config(s->mma2_config, st->G).fwd;
  const bool bf16 = a->dtype == MTRAIN_BF16;
  if (st->d == 64)
    return bf16 ? mma2::fwd_kind<64, __nv_bfloat16>(s, st, a, kind)
                : mma2::fwd_kind<64, __half>(s, st, a, kind);
  return bf16 ? mma2::fwd_kind<128, __nv_bfloat16>(s, st, a, kind)
              : mma2::fwd_kind<128, __half>(s, st, a, kind);
}
