// CUDA FFI handler te_jax_norm_bwd: dx, dgamma, dbeta of LayerNorm/RMSNorm.
//
//   xhat = (x - mean) * rsigma (rmsnorm: x * rsigma), g = dy * w,
//   dx = rsigma * ((g - mean(g)) - xhat * mean(g * xhat))   (rmsnorm: no mean(g)),
//   dgamma = sum_rows dy * xhat, dbeta = sum_rows dy.
//
// Row kernel (H % 8 == 0, H <= 16384, aligned): the grid is (row groups,
// batch); a thread block takes the rows of its group one after another (a warp
// per row for H <= 1024), writes dx, and accumulates dgamma/dbeta for its
// columns in registers. The rows pass through a ring of up to 3 rows in shared
// memory filled by cp.async, so the next rows' loads overlap this row's work.
// Each group's partial sums go to the workspace ([2, B, G, H] float32, sized by
// the Python op), and a second kernel adds the G partials in order:
// deterministic, no atomics.
// Other widths: a generic dx kernel and a generic column kernel.
#include <cuda_bf16.h>

#include <algorithm>

#include "norm_act_cast.cuh"
#include "../common/bindings.h"
#include "../common/norm_act_checks.h"

namespace te_jax {
namespace cuda {
namespace {

using fused::kThreads;

struct BwdArgs {
  const void* dy;
  const void* x;
  const float* mean;    // [B, M] or nullptr (rmsnorm)
  const float* rsigma;  // [B, M]
  const float* gamma;   // [B, H]
  void* dx;             // [B, M, H], x's dtype
  float* ws;            // [2, B, G, H]
  int64_t rows, cols, groups, batch;
  bool rms, zc, warp_per_row;
};

__device__ __forceinline__ void Load8F(const float* p, float (&f)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

template <typename T>
__device__ __forceinline__ uint16_t To16(float v) {
  if constexpr (std::is_same_v<T, Bf16>) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return __half_as_ushort(__float2half_rn(v));
}

template <typename T>
__device__ __forceinline__ void StoreT8(T* p, const float (&f)[8]) {
  if constexpr (sizeof(T) == 4) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = uint32_t{To16<T>(f[2 * k])} | (uint32_t{To16<T>(f[2 * k + 1])} << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <typename T>
__device__ __forceinline__ void StoreT1(T* p, float v) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float*>(p) = v;
  } else {
    *reinterpret_cast<uint16_t*>(p) = To16<T>(v);
  }
}

// Sums of u and v over the threads of one row (a warp, or the block); every
// thread calls it. One barrier: the caller must not reuse `red` before the next.
__device__ __forceinline__ void RowSum2(float& u, float& v, bool warp_per_row, float (*red)[kThreads / 32]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    u = AddRn(u, __shfl_xor_sync(0xffffffffu, u, o));
    v = AddRn(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  if (warp_per_row) return;
  if ((threadIdx.x & 31) == 0) red[0][threadIdx.x / 32] = u, red[1][threadIdx.x / 32] = v;
  __syncthreads();
  u = red[0][0], v = red[1][0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) u = AddRn(u, red[0][w]), v = AddRn(v, red[1][w]);
}

__device__ __forceinline__ void CpAsync16(uint4* dst, const void* src) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory"); }

// Two blocks per SM when the accumulators leave room (all 256 groups of a
// large M resident at once); the ring takes up to 192 KiB of shared memory per SM.
template <typename T, int kVec>
constexpr int kRowMinBlocks = kVec * sizeof(T) <= 8 ? 2 : 1;
template <typename T, int kVec>
constexpr int64_t kStageBytes = int64_t{2} * kVec * kThreads * sizeof(Raw8<T>);  // one row of dy and x
template <typename T, int kVec>
constexpr int kStages =
    std::max<int64_t>(1, std::min<int64_t>(3, (192 << 10) / kRowMinBlocks<T, kVec> / kStageBytes<T, kVec>));

__device__ __forceinline__ float DxOf(float g, float xhat, float mg, float mgx, float rs, bool rms) {
  const float c = rms ? g : SubRn(g, mg);
  return MulRn(rs, SubRn(c, MulRn(xhat, mgx)));
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, kRowMinBlocks<T, kVec>) NormBwdRowKernel(BwdArgs a) {
  // kStages rows of dy and x, as 16-byte words [stage][dy, x][j][word][thread];
  // warp_per_row: after the loop, [8][H] float partial sums.
  extern __shared__ uint4 ring[];
  __shared__ float red[2][2][kThreads / 32];  // RowSum2's, alternating by row (kRowStaticSmem bytes)
  constexpr int kS = kStages<T, kVec>, kW = sizeof(T) / 2;
  const int64_t g = blockIdx.x, b = blockIdx.y;
  const int64_t per = (a.rows + a.groups - 1) / a.groups;
  const int64_t r_begin = g * per, r_end = min(a.rows, r_begin + per);
  const int tpr = a.warp_per_row ? 32 : kThreads;
  const int lane = a.warp_per_row ? (threadIdx.x & 31) : threadIdx.x;
  const int warp = threadIdx.x / 32;
  const int64_t H = a.cols;
  const float hf = static_cast<float>(H);
  const float* gam = a.gamma + b * H;
  float dg[kVec][8], db[kVec][8];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
#pragma unroll
    for (int k = 0; k < 8; ++k) dg[j][k] = db[j][k] = 0.0f;
  }

  // body(j, c0) for each vector j of this thread's part of a row (columns c0 .. c0 + 7) that lies inside it.
  const auto each_vec = [&](auto&& body) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c0 = (int64_t{j} * tpr + lane) * 8;
      if (c0 < H) body(j, c0);
    }
  };
  // A thread copies and later reads only its own slots, so the ring needs no block barrier.
  const auto slot = [&](int stage, int which, int j, int k) {
    return ring + (((stage * 2 + which) * kVec + j) * kW + k) * kThreads + threadIdx.x;
  };
  // One commit group per call, empty past the group's last row.
  const auto fetch = [&](int64_t r, int stage) {
    if (r < r_end) {
      const int64_t row = b * a.rows + r;
      const T* src[2] = {static_cast<const T*>(a.dy) + row * H, static_cast<const T*>(a.x) + row * H};
      each_vec([&](int j, int64_t c0) {
#pragma unroll
        for (int which = 0; which < 2; ++which) {
          const uint4* p = reinterpret_cast<const uint4*>(src[which] + c0);
#pragma unroll
          for (int k = 0; k < kW; ++k) CpAsync16(slot(stage, which, j, k), p + k);
        }
      });
    }
    CpAsyncCommit();
  };
  const auto unpack = [&](int stage, int which, int j, float (&f)[8]) {
    Raw8<T> raw;
#pragma unroll
    for (int k = 0; k < kW; ++k) raw.w[k] = *slot(stage, which, j, k);
    Unpack8(raw, f);
  };
  // Vector j (columns c0 ..) of the staged row's dy and x, and of gamma.
  const auto load = [&](int stage, int j, int64_t c0, float (&d)[8], float (&v)[8], float (&w)[8]) {
    unpack(stage, 0, j, d);
    unpack(stage, 1, j, v);
    Load8F(gam + c0, w);
  };

  const int64_t step = a.warp_per_row ? kThreads / 32 : 1;
  const int64_t r0 = r_begin + (a.warp_per_row ? warp : 0);
#pragma unroll
  for (int s = 0; s + 1 < kS; ++s) fetch(r0 + s * step, s);
  float mu_next = 0.0f, rs_next = 0.0f;  // the row's mean and rsigma, loaded a row ahead
  if (r0 < r_end) {
    mu_next = a.rms ? 0.0f : a.mean[b * a.rows + r0];
    rs_next = a.rsigma[b * a.rows + r0];
  }
  int stage = 0, parity = 0;
  for (int64_t r = r0; r < r_end; r += step) {
    fetch(r + (kS - 1) * step, stage == 0 ? kS - 1 : stage - 1);  // the stage the previous row used
    const int64_t row = b * a.rows + r;
    const float mu = mu_next, rs = rs_next;
    if (r + step < r_end) {
      mu_next = a.rms ? 0.0f : a.mean[row + step];
      rs_next = a.rsigma[row + step];
    }
    CpAsyncWait<kS - 1>();  // this row's group has landed
    float sg = 0.0f, sgx = 0.0f;
    each_vec([&](int j, int64_t c0) {
      float d[8], v[8], w[8];
      load(stage, j, c0, d, v, w);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float xhat = NormXhat(v[k], mu, rs, a.rms);
        const float gk = MulRn(d[k], NormWeight(w[k], a.zc));
        sg = AddRn(sg, gk);
        sgx = AddRn(sgx, MulRn(gk, xhat));
        dg[j][k] = AddRn(dg[j][k], MulRn(d[k], xhat));
        db[j][k] = AddRn(db[j][k], d[k]);
      }
    });
    RowSum2(sg, sgx, a.warp_per_row, red[parity]);
    const float mg = a.rms ? 0.0f : DivRn(sg, hf);
    const float mgx = DivRn(sgx, hf);
    T* dxr = static_cast<T*>(a.dx) + row * H;
    each_vec([&](int j, int64_t c0) {
      float d[8], v[8], w[8], o[8];
      load(stage, j, c0, d, v, w);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float xhat = NormXhat(v[k], mu, rs, a.rms);
        o[k] = DxOf(MulRn(d[k], NormWeight(w[k], a.zc)), xhat, mg, mgx, rs, a.rms);
      }
      StoreT8(dxr + c0, o);
    });
    stage = stage + 1 == kS ? 0 : stage + 1;
    parity ^= 1;
  }

  // Partial sums of this group: [2, B, G, H].
  float* ws_dg = a.ws + (b * a.groups + g) * H;
  float* ws_db = a.ws + (a.batch * a.groups + b * a.groups + g) * H;
  if (!a.warp_per_row) {
    each_vec([&](int j, int64_t c0) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        ws_dg[c0 + k] = dg[j][k];
        ws_db[c0 + k] = db[j][k];
      }
    });
    return;
  }
  // A warp per row: the 8 warps' sums for the same columns, added in warp order.
  float* part = reinterpret_cast<float*>(ring);
  CpAsyncWait<0>();
  __syncthreads();  // part overlays the ring other warps may still be reading
  for (int which = 0; which < 2; ++which) {
    each_vec([&](int j, int64_t c0) {
#pragma unroll
      for (int k = 0; k < 8; ++k) part[warp * H + c0 + k] = which ? db[j][k] : dg[j][k];
    });
    __syncthreads();
    for (int64_t c = threadIdx.x; c < H; c += kThreads) {
      float s = part[c];
#pragma unroll
      for (int w = 1; w < kThreads / 32; ++w) s = AddRn(s, part[w * H + c]);
      (which ? ws_db : ws_dg)[c] = s;
    }
    __syncthreads();
  }
}

// dx for any width: a thread block per row, two passes over global memory.
template <typename T>
__global__ void __launch_bounds__(kThreads) NormBwdGenericRowKernel(BwdArgs a) {
  __shared__ float red[2][kThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t b = row / a.rows;
  const int64_t H = a.cols;
  const T* dyr = static_cast<const T*>(a.dy) + row * H;
  const T* xr = static_cast<const T*>(a.x) + row * H;
  const float* gam = a.gamma + b * H;
  const float mu = a.rms ? 0.0f : a.mean[row];
  const float rs = a.rsigma[row];
  float sg = 0.0f, sgx = 0.0f;
  for (int64_t c = threadIdx.x; c < H; c += kThreads) {
    const float xhat = NormXhat(ToF(xr[c]), mu, rs, a.rms);
    const float gk = MulRn(ToF(dyr[c]), NormWeight(gam[c], a.zc));
    sg = AddRn(sg, gk);
    sgx = AddRn(sgx, MulRn(gk, xhat));
  }
  const float hf = static_cast<float>(H);
  RowSum2(sg, sgx, false, red);
  const float mg = a.rms ? 0.0f : DivRn(sg, hf);
  const float mgx = DivRn(sgx, hf);
  T* dxr = static_cast<T*>(a.dx) + row * H;
  for (int64_t c = threadIdx.x; c < H; c += kThreads) {
    const float xhat = NormXhat(ToF(xr[c]), mu, rs, a.rms);
    StoreT1(dxr + c, DxOf(MulRn(ToF(dyr[c]), NormWeight(gam[c], a.zc)), xhat, mg, mgx, rs, a.rms));
  }
}

// dgamma/dbeta partials for any width: a thread per (group, column).
template <typename T>
__global__ void __launch_bounds__(kThreads) NormBwdGenericColKernel(BwdArgs a) {
  const int64_t id = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int64_t b = blockIdx.y;
  const int64_t H = a.cols;
  if (id >= a.groups * H) return;
  const int64_t g = id / H, c = id % H;
  const int64_t per = (a.rows + a.groups - 1) / a.groups;
  const int64_t r1 = min(a.rows, (g + 1) * per);
  float sdg = 0.0f, sdb = 0.0f;
  for (int64_t r = g * per; r < r1; ++r) {
    const int64_t row = b * a.rows + r;
    const float d = ToF(static_cast<const T*>(a.dy)[row * H + c]);
    const float xhat = NormXhat(ToF(static_cast<const T*>(a.x)[row * H + c]), a.rms ? 0.0f : a.mean[row],
                                a.rsigma[row], a.rms);
    sdg = AddRn(sdg, MulRn(d, xhat));
    sdb = AddRn(sdb, d);
  }
  a.ws[(b * a.groups + g) * H + c] = sdg;
  a.ws[(a.batch * a.groups + b * a.groups + g) * H + c] = sdb;
}

// dgamma[b, c] (and dbeta) = the group partials added in order.
__global__ void __launch_bounds__(kThreads) NormBwdReduceKernel(const float* ws, int64_t groups, int64_t cols,
                                                                 int64_t batch, float* dgamma, float* dbeta) {
  const int64_t id = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (id >= batch * cols) return;
  const int64_t b = id / cols, c = id % cols;
  const float* p = ws + b * groups * cols + c;
  float s = 0.0f;
  for (int64_t g = 0; g < groups; ++g) s = AddRn(s, p[g * cols]);
  dgamma[id] = s;
  if (dbeta) {
    const float* q = ws + (batch * groups + b * groups) * cols + c;
    float t = 0.0f;
    for (int64_t g = 0; g < groups; ++g) t = AddRn(t, q[g * cols]);
    dbeta[id] = t;
  }
}

// NormBwdRowKernel's static shared memory; the dynamic part may use the rest of the default 48 KiB.
constexpr int kRowStaticSmem = static_cast<int>(sizeof(float)) * 2 * 2 * (kThreads / 32);

template <typename T, int kVec>
ffi::Error LaunchRow(cudaStream_t stream, const BwdArgs& a, dim3 grid) {
  const int64_t part = a.warp_per_row ? int64_t{sizeof(float)} * (kThreads / 32) * a.cols : 0;
  const int smem = static_cast<int>(std::max(kStages<T, kVec> * kStageBytes<T, kVec>, part));
  auto kernel = NormBwdRowKernel<T, kVec>;
  if (smem + kRowStaticSmem > 48 * 1024) {  // beyond the default limit, which counts static and dynamic
    TE_RETURN_IF_ERROR(AllowDynamicSmem(kernel, smem));
  }
  kernel<<<grid, kThreads, smem, stream>>>(a);
  return LaunchError("NormBwdRowKernel");
}

template <typename T>
ffi::Error RunNormBwd(cudaStream_t stream, BwdArgs a, float* dgamma, float* dbeta) {
  const int64_t H = a.cols;
  bool warp_per_row = false;
  const bool vec_ok = H % 8 == 0 && fused::AllAligned16({a.dy, a.x, a.dx, a.gamma});
  const int vec = vec_ok ? fused::RowVectors(H, &warp_per_row) : 0;
  a.warp_per_row = warp_per_row;
  if (a.groups > 65535 || a.batch > 65535) return ffi::Error::Internal("te_jax CUDA: norm backward grid too large");
  if (vec > 0) {
    const dim3 grid(static_cast<unsigned>(a.groups), static_cast<unsigned>(a.batch));
    auto launch = vec == 1 ? LaunchRow<T, 1>
                  : vec == 2 ? LaunchRow<T, 2>
                  : vec == 4 ? LaunchRow<T, 4>
                             : LaunchRow<T, 8>;
    TE_RETURN_IF_ERROR(launch(stream, a, grid));
  } else {
    dim3 grid;
    TE_RETURN_IF_ERROR(GridOf(a.batch * a.rows, &grid));
    NormBwdGenericRowKernel<T><<<grid, kThreads, 0, stream>>>(a);
    TE_RETURN_IF_ERROR(LaunchError("NormBwdGenericRowKernel"));
    TE_RETURN_IF_ERROR(fused::GridFor(a.groups * H, a.batch, &grid));
    NormBwdGenericColKernel<T><<<grid, kThreads, 0, stream>>>(a);
    TE_RETURN_IF_ERROR(LaunchError("NormBwdGenericColKernel"));
  }
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(CeilDiv(a.batch * H, kThreads), &grid));
  NormBwdReduceKernel<<<grid, kThreads, 0, stream>>>(a.ws, a.groups, H, a.batch, dgamma, dbeta);
  return LaunchError("NormBwdReduceKernel");
}

ffi::Error NormBwd(cudaStream_t stream, const NormBwdCall& c) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(c.x, "x"));
  if (c.dy.element_type() != c.x.element_type() || c.dx.element_type() != c.x.element_type()) {
    return InvalidArgument("dy, x and dx must have the same dtype");
  }
  const int64_t B = c.mb.batch, M = c.mb.rows, H = c.mb.cols;
  if (B * H == 0) return ffi::Error::Success();
  const int64_t groups = c.workspace_elems / (2 * B * H);
  if (groups < 1) {
    return InvalidArgument("workspace: need 2 * G * H float32 elements per matrix (G >= 1), got " +
                           std::to_string(c.workspace_elems));
  }
  if (M == 0) {
    TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(c.dgamma, 0, sizeof(float) * B * H, stream), "memset"));
    if (c.dbeta) TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(c.dbeta, 0, sizeof(float) * B * H, stream), "memset"));
    return ffi::Error::Success();
  }
  // G = min(what the workspace holds, M); the kernels lay the partials out as [2, B, G, H].
  BwdArgs a{c.dy.untyped_data(), c.x.untyped_data(), c.mean, c.rsigma, c.gamma, c.dx.untyped_data(), c.workspace,
            M, H, groups < M ? groups : M, B, c.na.rms, c.na.zero_centered_gamma, false};
  return DispatchInput(c.x.element_type(),
                       [&](auto tag) { return RunNormBwd<decltype(tag)>(stream, a, c.dgamma, c.dbeta); });
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_ENTRY(NormBwd, cuda::NormBwd);

}  // namespace te_jax
