/* attn_simt.cu: kernel variant 0 of the CUDA backend: plain SIMT kernels,
 * one warp per query row (forward, dQ) or per key row (dK/dV), each lane
 * holding head_dim/32 elements. Every (query, key) pair of the step is
 * visited in the plan's order by one warp, so results do not depend on
 * scheduling. Written for exactness and coverage (fp32, bf16, fp16, any
 * head_dim that is a multiple of 32 up to 256, any granularity), not speed;
 * variants 2 and 3 (attn_mma2_*.cu, attn_wgmma_*.cu) are the fast paths. */
#include <cuda_runtime.h>
#include <math.h>

#include <type_traits>

#include "backends/cuda/cuda_device.cuh"
#include "mtrain/mtrain_error.h"

namespace {

constexpr int kWarps = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <int DPL, typename T>
__device__ __forceinline__ void load_row(float (&x)[DPL], const T *p, int lane) {
#pragma unroll
  for (int t = 0; t < DPL; t++) x[t] = ld(p, lane + 32 * t);
}

template <int DPL, typename T>
__device__ __forceinline__ float dot_row(const float (&x)[DPL], const T *p, int lane) {
  float acc = 0.f;
#pragma unroll
  for (int t = 0; t < DPL; t++) acc += x[t] * ld(p, lane + 32 * t);
  return warp_sum(acc);
}

/* Calls f(key) for every key of (h, qb) row r in plan order (a causal step:
 * on the diagonal block the keys c <= r only). */
template <typename F>
__device__ __forceinline__ void for_each_key(const cuda_step_t &st, const head_view &hv, int qb,
                                             int r, F &&f) {
  const int64_t gq = st.q_block_global[qb];
  for (int e = hv.run_off[qb]; e < hv.run_off[qb + 1]; e++)
    for (int kb = hv.runs[2 * e]; kb < hv.runs[2 * e + 1]; kb++) {
      const int64_t gk = st.k_block_global[kb];
      int nc = block_rows_dev(st.k_tokens, st.G, kb, gk, st.seq_len);
      if (st.causal && gk == gq && nc > r + 1) nc = r + 1;
      for (int c = 0; c < nc; c++) f((int64_t)kb * st.G + c);
    }
  for (int sg = hv.seg_off[qb]; sg < hv.seg_off[qb + 1]; sg++)
    for (int b = hv.segs[2 * sg]; b < hv.segs[2 * sg + 1]; b++) f((int64_t)hv.bars[b]);
}

/* Forward: one warp per (local query row i, head h). */
template <int DPL, typename T>
__global__ void __launch_bounds__(32 * kWarps)
    fwd_kernel(cuda_step_t st, const T *q, const T *k, const T *v, float *o_acc, float *lse_acc) {
  const int lane = threadIdx.x % 32, h = blockIdx.y, hk = h / st.group;
  const int64_t i = blockIdx.x * (int64_t)kWarps + threadIdx.x / 32;
  if (i >= st.q_tokens) return;
  const int qb = (int)(i / st.G), r = (int)(i % st.G);
  if (r >= block_rows_dev(st.q_tokens, st.G, qb, st.q_block_global[qb], st.seq_len)) return;
  const head_view hv = head_of(st, h);
  const int d = st.d;
  float qr[DPL], acc[DPL];
  load_row<DPL>(qr, q + (i * st.Hq + h) * d, lane);
  const float sl2 = st.scale * kLog2e;
#pragma unroll
  for (int t = 0; t < DPL; t++) {
    qr[t] *= sl2;
    acc[t] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for_each_key(st, hv, qb, r, [&](int64_t j) {
    const float s = dot_row<DPL>(qr, k + (j * st.Hkv + hk) * d, lane);
    const float mn = fmaxf(m, s), corr = exp2f(m - mn), p = exp2f(s - mn);
    l = l * corr + p;
    const T *vj = v + (j * st.Hkv + hk) * d;
#pragma unroll
    for (int t = 0; t < DPL; t++) acc[t] = acc[t] * corr + p * ld(vj, lane + 32 * t);
    m = mn;
  });
  if (l == 0.f) return; /* no key in this step */
  const float lse_s = (m + log2f(l)) * kLn2;
  float *li = lse_acc + i * st.Hq + h, *oi = o_acc + (i * st.Hq + h) * d;
  float w_old, w_new;
  const float lnew = merge_weights(*li, lse_s, &w_old, &w_new);
  const float inv_l = 1.f / l;
#pragma unroll
  for (int t = 0; t < DPL; t++) {
    const int c = lane + 32 * t;
    oi[c] = (w_old == 0.f ? 0.f : w_old * oi[c]) + w_new * acc[t] * inv_l;
  }
  __syncwarp();
  if (lane == 0) *li = lnew;
}

/* dQ: one warp per (local query row i, head h). */
template <int DPL, typename T>
__global__ void __launch_bounds__(32 * kWarps)
    dq_kernel(cuda_step_t st, const T *q, const T *k, const T *v, const T *dout,
              const float *lse_acc, const float *delta_acc, float *dq_acc) {
  const int lane = threadIdx.x % 32, h = blockIdx.y, hk = h / st.group;
  const int64_t i = blockIdx.x * (int64_t)kWarps + threadIdx.x / 32;
  if (i >= st.q_tokens) return;
  const int qb = (int)(i / st.G), r = (int)(i % st.G);
  if (r >= block_rows_dev(st.q_tokens, st.G, qb, st.q_block_global[qb], st.seq_len)) return;
  const head_view hv = head_of(st, h);
  const int d = st.d;
  float qr[DPL], dor[DPL], acc[DPL];
  load_row<DPL>(qr, q + (i * st.Hq + h) * d, lane);
  load_row<DPL>(dor, dout + (i * st.Hq + h) * d, lane);
#pragma unroll
  for (int t = 0; t < DPL; t++) acc[t] = 0.f;
  const float lse = lse_acc[i * st.Hq + h], delta = delta_acc[i * st.Hq + h];
  bool any = false;
  for_each_key(st, hv, qb, r, [&](int64_t j) {
    const T *kj = k + (j * st.Hkv + hk) * d, *vj = v + (j * st.Hkv + hk) * d;
    const float p = expf(st.scale * dot_row<DPL>(qr, kj, lane) - lse);
    const float ds = p * (dot_row<DPL>(dor, vj, lane) - delta);
#pragma unroll
    for (int t = 0; t < DPL; t++) acc[t] += st.scale * ds * ld(kj, lane + 32 * t);
    any = true;
  });
  if (!any) return;
  float *dqi = dq_acc + (i * st.Hq + h) * d;
#pragma unroll
  for (int t = 0; t < DPL; t++) dqi[lane + 32 * t] += acc[t];
}

/* Accumulates the contributions of the valid rows r >= r0 of query block qb
 * (head h) to key row j's dK/dV held in registers. */
template <int DPL, typename T>
__device__ __forceinline__ void
key_rows(const cuda_step_t &st, int h, int qb, int r0, const float (&kr)[DPL],
         const float (&vr)[DPL], const T *q, const T *dout, const float *lse_acc,
         const float *delta_acc, float (&dk)[DPL], float (&dv)[DPL], int lane) {
  const int nr = block_rows_dev(st.q_tokens, st.G, qb, st.q_block_global[qb], st.seq_len);
  const int d = st.d;
  for (int r = r0; r < nr; r++) {
    const int64_t i = (int64_t)qb * st.G + r;
    const T *qi = q + (i * st.Hq + h) * d, *doi = dout + (i * st.Hq + h) * d;
    const float p = expf(st.scale * dot_row<DPL>(kr, qi, lane) - lse_acc[i * st.Hq + h]);
    const float ds = p * (dot_row<DPL>(vr, doi, lane) - delta_acc[i * st.Hq + h]);
#pragma unroll
    for (int t = 0; t < DPL; t++) {
      dv[t] += p * ld(doi, lane + 32 * t);
      dk[t] += st.scale * ds * ld(qi, lane + 32 * t);
    }
  }
}

/* dK/dV of the runs: one warp per (local key row j, kv head hk). */
template <int DPL, typename T>
__global__ void __launch_bounds__(32 * kWarps)
    dkdv_kernel(cuda_step_t st, const T *q, const T *k, const T *v, const T *dout,
                const float *lse_acc, const float *delta_acc, float *dk_acc, float *dv_acc) {
  const int lane = threadIdx.x % 32, hk = blockIdx.y;
  const int64_t j = blockIdx.x * (int64_t)kWarps + threadIdx.x / 32;
  if (j >= st.k_tokens) return;
  const int kb = (int)(j / st.G), c = (int)(j % st.G);
  const int64_t gk = st.k_block_global[kb];
  if (c >= block_rows_dev(st.k_tokens, st.G, kb, gk, st.seq_len)) return;
  const int e0 = st.kv_off[(int64_t)hk * st.num_k_blocks + kb];
  const int e1 = st.kv_off[(int64_t)hk * st.num_k_blocks + kb + 1];
  if (e0 == e1) return;
  const int d = st.d;
  float kr[DPL], vr[DPL], dk[DPL], dv[DPL];
  load_row<DPL>(kr, k + (j * st.Hkv + hk) * d, lane);
  load_row<DPL>(vr, v + (j * st.Hkv + hk) * d, lane);
#pragma unroll
  for (int t = 0; t < DPL; t++) dk[t] = dv[t] = 0.f;
  for (int e = e0; e < e1; e++) {
    const int h = st.kv_ent[2 * e], qb = st.kv_ent[2 * e + 1];
    const int r0 = st.causal && st.q_block_global[qb] == gk ? c : 0; /* causal: rows r >= c */
    key_rows<DPL>(st, h, qb, r0, kr, vr, q, dout, lse_acc, delta_acc, dk, dv, lane);
  }
  float *dkj = dk_acc + (j * st.Hkv + hk) * d, *dvj = dv_acc + (j * st.Hkv + hk) * d;
#pragma unroll
  for (int t = 0; t < DPL; t++) {
    dkj[lane + 32 * t] += dk[t];
    dvj[lane + 32 * t] += dv[t];
  }
}

/* dK/dV of the bars: one warp per bar of a tile; writes the scratch row. */
template <int DPL, typename T>
__global__ void __launch_bounds__(32 * kWarps)
    bars_kernel(cuda_step_t st, const T *q, const T *k, const T *v, const T *dout,
                const float *lse_acc, const float *delta_acc, float *dk_bar, float *dv_bar) {
  const int lane = threadIdx.x % 32, tile = blockIdx.x;
  const int h = st.bt_tile[3 * tile], b0 = st.bt_tile[3 * tile + 1], b1 = st.bt_tile[3 * tile + 2];
  const int b = b0 + blockIdx.y * kWarps + threadIdx.x / 32;
  if (b >= b1) return;
  const head_view hv = head_of(st, h);
  const int hk = h / st.group, d = st.d;
  const int64_t j = hv.bars[b];
  float kr[DPL], vr[DPL], dk[DPL], dv[DPL];
  load_row<DPL>(kr, k + (j * st.Hkv + hk) * d, lane);
  load_row<DPL>(vr, v + (j * st.Hkv + hk) * d, lane);
#pragma unroll
  for (int t = 0; t < DPL; t++) dk[t] = dv[t] = 0.f;
  for (int e = st.bt_off[tile]; e < st.bt_off[tile + 1]; e++) {
    const int qb = st.bt_ent[3 * e], lo = st.bt_ent[3 * e + 1], hi = st.bt_ent[3 * e + 2];
    if (b < lo || b >= hi) continue;
    key_rows<DPL>(st, h, qb, 0, kr, vr, q, dout, lse_acc, delta_acc, dk, dv, lane);
  }
  float *dkb = dk_bar + ((int64_t)hv.bar_base + b) * d,
        *dvb = dv_bar + ((int64_t)hv.bar_base + b) * d;
#pragma unroll
  for (int t = 0; t < DPL; t++) {
    dkb[lane + 32 * t] = dk[t];
    dvb[lane + 32 * t] = dv[t];
  }
}

template <int DPL, typename T>
mtrain_status_t fwd_launch(cuda_state_t *s, const cuda_step_t *st,
                           const mtrain_fwd_step_args_t *a) {
  if (st->q_tokens == 0 || st->Hq == 0) return MTRAIN_SUCCESS;
  const int64_t gx = (st->q_tokens + kWarps - 1) / kWarps;
  mtrain_status_t e = cuda_prepare_launch(s, (const void *)fwd_kernel<DPL, T>, "variant 0",
                                          "simt fwd_kernel", gx, st->Hq, 0, NULL);
  if (e) return e;
  fwd_kernel<DPL, T>
      <<<dim3((unsigned)gx, (unsigned)st->Hq), 32 * kWarps, 0, (cudaStream_t)s->stream>>>(
          *st, (const T *)a->q, (const T *)a->k, (const T *)a->v, (float *)a->o_acc,
          (float *)a->lse_acc);
  return cuda_check_launch("simt fwd_kernel");
}

template <int DPL, typename T>
mtrain_status_t bwd_launch(cuda_state_t *s, const cuda_step_t *st, const mtrain_bwd_step_args_t *a,
                           float *dk_bar, float *dv_bar) {
  cudaStream_t str = (cudaStream_t)s->stream;
  const T *q = (const T *)a->q, *k = (const T *)a->k, *v = (const T *)a->v;
  const T *dout = (const T *)a->dout;
  const float *lse = (const float *)a->lse_acc, *delta = (const float *)a->delta_acc;
  mtrain_status_t e;
  if (st->q_tokens > 0) {
    const int64_t gx = (st->q_tokens + kWarps - 1) / kWarps;
    if ((e = cuda_prepare_launch(s, (const void *)dq_kernel<DPL, T>, "variant 0", "simt dq_kernel",
                                 gx, st->Hq, 0, NULL)))
      return e;
    dq_kernel<DPL, T><<<dim3((unsigned)gx, (unsigned)st->Hq), 32 * kWarps, 0, str>>>(
        *st, q, k, v, dout, lse, delta, (float *)a->dq_acc);
    if ((e = cuda_check_launch("simt dq_kernel"))) return e;
  }
  if (st->k_tokens > 0) {
    const int64_t gx = (st->k_tokens + kWarps - 1) / kWarps;
    if ((e = cuda_prepare_launch(s, (const void *)dkdv_kernel<DPL, T>, "variant 0",
                                 "simt dkdv_kernel", gx, st->Hkv, 0, NULL)))
      return e;
    dkdv_kernel<DPL, T><<<dim3((unsigned)gx, (unsigned)st->Hkv), 32 * kWarps, 0, str>>>(
        *st, q, k, v, dout, lse, delta, (float *)a->dk_acc, (float *)a->dv_acc);
    if ((e = cuda_check_launch("simt dkdv_kernel"))) return e;
  }
  if (st->num_bar_tiles > 0) {
    if ((e = cuda_prepare_launch(s, (const void *)bars_kernel<DPL, T>, "variant 0",
                                 "simt bars_kernel", st->num_bar_tiles, CUDA_BAR_TILE / kWarps, 0,
                                 NULL)))
      return e;
    dim3 grid((unsigned)st->num_bar_tiles, CUDA_BAR_TILE / kWarps);
    bars_kernel<DPL, T>
        <<<grid, 32 * kWarps, 0, str>>>(*st, q, k, v, dout, lse, delta, dk_bar, dv_bar);
    if ((e = cuda_check_launch("simt bars_kernel"))) return e;
  }
  return MTRAIN_SUCCESS;
}

template <typename T> struct type_tag { using type = T; };

/* Calls f(type_tag<T>(), std::integral_constant<int, d / 32>()) with T the
 * storage type of dtype, for head_dim d = 32, 64, ..., 256: the one dispatch
 * of a call's dtype and head_dim to the kernels' template arguments. */
template <typename T, typename F> mtrain_status_t by_dim(int d, F &&f) {
  const type_tag<T> t;
  switch (d % 32 == 0 ? d / 32 : 0) {
  case 1:
    return f(t, std::integral_constant<int, 1>());
  case 2:
    return f(t, std::integral_constant<int, 2>());
  case 3:
    return f(t, std::integral_constant<int, 3>());
  case 4:
    return f(t, std::integral_constant<int, 4>());
  case 5:
    return f(t, std::integral_constant<int, 5>());
  case 6:
    return f(t, std::integral_constant<int, 6>());
  case 7:
    return f(t, std::integral_constant<int, 7>());
  case 8:
    return f(t, std::integral_constant<int, 8>());
  }
  return mtrain_error(MTRAIN_ERR_UNSUPPORTED_HEAD_DIM, "cuda simt: head_dim %d", d);
}

template <typename F> mtrain_status_t by_dtype_dim(mtrain_dtype_t dtype, int d, F &&f) {
  switch (dtype) {
  case MTRAIN_F32:
    return by_dim<float>(d, f);
  case MTRAIN_BF16:
    return by_dim<__nv_bfloat16>(d, f);
  case MTRAIN_F16:
    return by_dim<__half>(d, f);
  default:
    break;
  }
  return mtrain_error(MTRAIN_ERR_UNSUPPORTED_DTYPE, "cuda simt: dtype %s",
                      mtrain_dtype_name(dtype));
}

} // namespace

extern "C" mtrain_status_t cuda_simt_fwd(cuda_state_t *s, const cuda_step_t *st,
                                         const mtrain_fwd_step_args_t *a) {
  return by_dtype_dim(a->dtype, st->d, [&](auto t, auto dpl) {
    return fwd_launch<decltype(dpl)::value, typename decltype(t)::type>(s, st, a);
  });
}

extern "C" mtrain_status_t cuda_simt_bwd(cuda_state_t *s, const cuda_step_t *st,
                                         const mtrain_bwd_step_args_t *a, float *dk_bar,
                                         float *dv_bar) {
  return by_dtype_dim(a->dtype, st->d, [&](auto t, auto dpl) {
    return bwd_launch<decltype(dpl)::value, typename decltype(t)::type>(s, st, a, dk_bar, dv_bar);
  });
}
