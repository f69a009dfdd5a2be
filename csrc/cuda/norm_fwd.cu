// CUDA FFI handler te_jax_norm_fwd: LayerNorm/RMSNorm fused with the
// output's cast.
//
// Row kernel (H % 8 == 0, H <= 16384, aligned): a warp per row (H <= 1024) or
// a thread block per row keeps the row in registers (16-byte loads), computes
// mean and rsigma in float32 (two passes over the registers), then y. With
// only a rowwise copy in modes none / fp8_tensor / mxfp8 / fp8_block it casts
// y right there: one pass over x. Otherwise it writes the statistics (and y's
// amax for fp8_current / nvfp4), and the cast kernels (norm_act_cast.cuh)
// recompute y from x and the statistics in a second pass: y never goes to HBM
// in high precision. NVFP4 with the Hadamard transform takes one more pass for
// the transformed copy's amax. Other widths: a generic statistics kernel.
#include "norm_act_cast.cuh"
#include "../common/bindings.h"
#include "../common/norm_act_checks.h"

namespace te_jax {
namespace cuda {
namespace {

using fused::BatchCtx;
using fused::CastArgs;
using fused::CastBuffers;
using fused::kThreads;

__device__ __forceinline__ void Load8F(const float* p, float (&f)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

struct NormParams {
  const float* gamma;  // [B, H]
  const float* beta;   // [B, H] or nullptr
  int64_t rows, cols;  // M, H
  bool rms, zc;
  float eps;
};

// y = NormApply over 8 values at columns c0.. of batch element b.
__device__ __forceinline__ void NormY8(const NormParams& p, int64_t b, int64_t c0, const float (&v)[8], float mu,
                                       float rs, float (&y)[8]) {
  float g[8], bt[8];
  Load8F(p.gamma + b * p.cols + c0, g);
  if (p.beta) Load8F(p.beta + b * p.cols + c0, bt);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    y[k] = NormApply(v[k], mu, rs, NormWeight(g[k], p.zc), p.beta ? bt[k] : 0.0f, p.rms, p.beta != nullptr);
  }
}

// The norm's output recomputed from x and the statistics (for the cast kernels).
template <typename T>
struct NormProducer {
  const T* x;
  NormParams p;
  const float* mean;    // [B, M] or nullptr (rmsnorm)
  const float* rsigma;  // [B, M]
  int64_t rows, cols;
  bool vec_ok;
  using Raw = Raw8<T>;

  __device__ __forceinline__ Raw Fetch(int64_t b, int64_t r, int64_t c0) const {
    return LoadRaw8(x + (b * rows + r) * cols + c0);
  }

  __device__ __forceinline__ void Compute(const Raw& raw, int64_t b, int64_t r, int64_t c0, float (&f)[8]) const {
    float v[8];
    Unpack8(raw, v);
    const float mu = p.rms ? 0.0f : mean[b * rows + r];
    NormY8(p, b, c0, v, mu, rsigma[b * rows + r], f);
  }

  __device__ __forceinline__ float Load1(int64_t b, int64_t r, int64_t c) const {
    const float mu = p.rms ? 0.0f : mean[b * rows + r];
    const float w = NormWeight(p.gamma[b * cols + c], p.zc);
    const float bt = p.beta ? p.beta[b * cols + c] : 0.0f;
    return NormApply(ToF(x[(b * rows + r) * cols + c]), mu, rsigma[b * rows + r], w, bt, p.rms, p.beta != nullptr);
  }
};

// ---- row statistics ------------------------------------------------------------------------

// Sum over the threads of one row: a warp (warp_per_row) or the thread block.
// `red` holds one float per warp. Every thread calls it.
__device__ __forceinline__ float RowSum(float v, bool warp_per_row, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = AddRn(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (warp_per_row) return v;
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float s = red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) s = AddRn(s, red[w]);
  __syncthreads();
  return s;
}

// Amax bits of a row's values into out (atomicMax); every thread calls it.
__device__ __forceinline__ void RowAmax(uint32_t m, bool warp_per_row, bool active, uint32_t* scratch, float* out) {
  if (warp_per_row) {
    m = __reduce_max_sync(0xffffffffu, m);
    if ((threadIdx.x & 31) == 0 && active) atomicMax(reinterpret_cast<unsigned int*>(out), m);
    return;
  }
  BlockAmaxAtomic<kThreads>(m, scratch, out);
}

struct RowArgs {
  const void* x;
  NormParams p;
  float* mean;     // [B, M] or nullptr
  float* rsigma;   // [B, M]
  int64_t batch;
  bool warp_per_row;
  float* amax;     // kModeStats: y's amax [B] (zeroed), or nullptr
};

// kMode: fused::kModeNone / kModeTensor / kModeMx / kModeBlock (rowwise cast
// in the same pass) or kModeStats (statistics, and y's amax when ra.amax).
template <typename T, int kVec, int kMode>
__global__ void __launch_bounds__(kThreads) NormRowKernel(RowArgs ra, CastArgs a) {
  __shared__ float red[kThreads / 32];
  __shared__ uint32_t scratch[kThreads / 32];
  const NormParams& p = ra.p;
  const int tpr = ra.warp_per_row ? 32 : kThreads;
  const int lane = ra.warp_per_row ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t gidx = ra.warp_per_row ? int64_t{blockIdx.x} * (kThreads / 32) + threadIdx.x / 32 : blockIdx.x;
  const bool active = gidx < ra.batch * p.rows;
  const int64_t b = active ? gidx / p.rows : 0, r = active ? gidx % p.rows : 0;
  const T* xr = static_cast<const T*>(ra.x) + (b * p.rows + r) * p.cols;

  Raw8<T> raw[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int64_t c0 = (int64_t{j} * tpr + lane) * 8;
    raw[j] = (active && c0 < p.cols) ? LoadRaw8(xr + c0) : ZeroRaw8<T>();
  }
  const float hf = static_cast<float>(p.cols);
  float mu = 0.0f;
  float sq = 0.0f;
  if (!p.rms) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float v[8];
      Unpack8(raw[j], v);
#pragma unroll
      for (int k = 0; k < 8; ++k) sum = AddRn(sum, v[k]);
    }
    mu = DivRn(RowSum(sum, ra.warp_per_row, red), hf);
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const bool valid = (int64_t{j} * tpr + lane) * 8 < p.cols;
    float v[8];
    Unpack8(raw[j], v);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float d = p.rms ? v[k] : SubRn(v[k], mu);
      if (valid) sq = AddRn(sq, MulRn(d, d));
    }
  }
  const float rs = RsigmaOf(DivRn(RowSum(sq, ra.warp_per_row, red), hf), p.eps);
  if (active && lane == 0) {
    if (ra.mean) ra.mean[b * p.rows + r] = mu;
    ra.rsigma[b * p.rows + r] = rs;
  }

  if (kMode == fused::kModeStats && !ra.amax) return;  // uniform: statistics only
  const BatchCtx ctx = fused::MakeCtx(a, kMode, b, active && r == 0 && lane == 0);
  uint32_t amax = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int64_t c0 = (int64_t{j} * tpr + lane) * 8;
    const bool valid = active && c0 < p.cols;
    float v[8], y[8];
    Unpack8(raw[j], v);
    if (valid) NormY8(p, b, c0, v, mu, rs, y);
    amax = max(amax, fused::RowCast8<kMode>(a, ctx, b, r, c0, valid, y));
  }
  if (kMode == fused::kModeStats && ra.amax) RowAmax(amax, ra.warp_per_row, active, scratch, ra.amax + b);
  if (kMode == fused::kModeTensor && a.amax_out) RowAmax(amax, ra.warp_per_row, active, scratch, a.amax_out + b);
}

// Statistics for any width: a thread block per row, loops over global memory.
template <typename T>
__global__ void __launch_bounds__(kThreads) NormStatsGenericKernel(RowArgs ra) {
  __shared__ float red[kThreads / 32];
  __shared__ uint32_t scratch[kThreads / 32];
  const NormParams& p = ra.p;
  const int64_t b = blockIdx.x / p.rows, r = blockIdx.x % p.rows;
  const T* xr = static_cast<const T*>(ra.x) + (b * p.rows + r) * p.cols;
  const float hf = static_cast<float>(p.cols);
  float mu = 0.0f;
  if (!p.rms) {
    float sum = 0.0f;
    for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) sum = AddRn(sum, ToF(xr[c]));
    mu = DivRn(RowSum(sum, false, red), hf);
  }
  float sq = 0.0f;
  for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
    const float d = p.rms ? ToF(xr[c]) : SubRn(ToF(xr[c]), mu);
    sq = AddRn(sq, MulRn(d, d));
  }
  const float rs = RsigmaOf(DivRn(RowSum(sq, false, red), hf), p.eps);
  if (threadIdx.x == 0) {
    if (ra.mean) ra.mean[b * p.rows + r] = mu;
    ra.rsigma[b * p.rows + r] = rs;
  }
  if (!ra.amax) return;  // uniform
  uint32_t m = 0;
  for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
    const float w = NormWeight(p.gamma[b * p.cols + c], p.zc);
    const float bt = p.beta ? p.beta[b * p.cols + c] : 0.0f;
    m = max(m, AbsBits(NormApply(ToF(xr[c]), mu, rs, w, bt, p.rms, p.beta != nullptr)));
  }
  BlockAmaxAtomic<kThreads>(m, scratch, ra.amax + b);
}

template <typename T, int kMode>
ffi::Error LaunchRow(cudaStream_t stream, int vec, const RowArgs& ra, const CastArgs& a) {
  const int64_t rows = ra.batch * ra.p.rows;
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(ra.warp_per_row ? CeilDiv(rows, kThreads / 32) : rows, &grid));
  switch (vec) {
    case 1: NormRowKernel<T, 1, kMode><<<grid, kThreads, 0, stream>>>(ra, a); break;
    case 2: NormRowKernel<T, 2, kMode><<<grid, kThreads, 0, stream>>>(ra, a); break;
    case 4: NormRowKernel<T, 4, kMode><<<grid, kThreads, 0, stream>>>(ra, a); break;
    default: NormRowKernel<T, 8, kMode><<<grid, kThreads, 0, stream>>>(ra, a); break;
  }
  return LaunchError("NormRowKernel");
}

template <typename T>
ffi::Error LaunchRowMode(cudaStream_t stream, int vec, const RowArgs& ra, const CastArgs& a, int mode) {
  switch (mode) {
    case fused::kModeNone: return LaunchRow<T, fused::kModeNone>(stream, vec, ra, a);
    case fused::kModeTensor: return LaunchRow<T, fused::kModeTensor>(stream, vec, ra, a);
    case fused::kModeMx: return LaunchRow<T, fused::kModeMx>(stream, vec, ra, a);
    case fused::kModeBlock: return LaunchRow<T, fused::kModeBlock>(stream, vec, ra, a);
    default: return LaunchRow<T, fused::kModeStats>(stream, vec, ra, a);
  }
}

template <typename T>
ffi::Error RunNormFwd(cudaStream_t stream, const ffi::AnyBuffer& x, const NormParams& p, float* mean, float* rsigma,
                      int64_t batch, const CastSpec& sp, const CastBuffers& o, const float* scale_in,
                      const uint32_t* key) {
  const size_t nb = sizeof(float) * batch;
  const T* xp = static_cast<const T*>(x.untyped_data());
  bool warp_per_row = false;
  const bool vec_ok = p.cols % 8 == 0 && Aligned16(xp) && fused::AllAligned16({p.gamma, p.beta, o.q, o.q_t});
  const int vec = vec_ok ? fused::RowVectors(p.cols, &warp_per_row) : 0;
  RowArgs ra{xp, p, mean, rsigma, batch, warp_per_row, nullptr};
  CastArgs a = fused::CastArgsFor(sp, o, p.rows, p.cols, scale_in, key);
  if (o.amax) TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(o.amax, 0, nb, stream), "memset amax"));
  const int mode = fused::TileModeOf(sp.mode);
  const bool one_pass = vec > 0 && !sp.colwise && !NeedsAmaxPass(sp.mode);
  if (one_pass) return LaunchRowMode<T>(stream, vec, ra, a, mode);

  // Pass 1: statistics (and y's amax when the scale depends on it).
  ra.amax = NeedsAmaxPass(sp.mode) ? o.amax : nullptr;
  if (vec > 0) {
    TE_RETURN_IF_ERROR((LaunchRow<T, fused::kModeStats>(stream, vec, ra, CastArgs{})));
  } else {
    dim3 grid;
    TE_RETURN_IF_ERROR(GridOf(batch * p.rows, &grid));
    NormStatsGenericKernel<T><<<grid, kThreads, 0, stream>>>(ra);
    TE_RETURN_IF_ERROR(LaunchError("NormStatsGenericKernel"));
  }
  NormProducer<T> prod{xp, p, mean, rsigma, p.rows, p.cols, vec_ok};
  if (sp.mode == CastMode::kNvfp4) {
    if (sp.rht) {
      TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(o.amax_t, 0, nb, stream), "memset amax_t"));
      CastArgs st = fused::StatsArgsFor(sp, o, p.rows, p.cols);
      st.amax_acc = nullptr;  // the rowwise amax came from pass 1
      TE_RETURN_IF_ERROR(fused::LaunchPass(stream, prod, st, batch, fused::kModeStats));
    } else {
      TE_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(o.amax_t, o.amax, nb, cudaMemcpyDeviceToDevice, stream), "copy amax"));
    }
  }
  // Pass 2: recompute y from x and the statistics, and cast.
  return fused::LaunchPass(stream, prod, a, batch, mode);
}

ffi::Error NormFwd(cudaStream_t stream, const NormFwdCall& c) {
  const int64_t B = c.mb.batch, M = c.mb.rows, H = c.mb.cols;
  if (B * M == 0 || H == 0) return ffi::Error::Success();
  NormParams p{c.gamma, c.beta, M, H, c.na.rms, c.na.zero_centered_gamma, c.na.epsilon};
  const CastBuffers bufs = fused::BuffersOf(c.out);
  return DispatchInput(c.x.element_type(), [&](auto tag) {
    return RunNormFwd<decltype(tag)>(stream, c.x, p, c.mean, c.rsigma, B, c.sp, bufs, c.scale, c.key);
  });
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_ENTRY(NormFwd, cuda::NormFwd);

}  // namespace te_jax
