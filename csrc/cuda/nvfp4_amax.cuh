// NVFP4 pass 1 and the amax helpers both passes use (quantize_nvfp4.cu has the
// layout of the tile this shares): block maxima of |x| from 16-byte vectors, and
// the kernels that find a matrix's amax and, with the random Hadamard
// transform, the amax of the transformed columnwise copy.
#pragma once

#include "amax.cuh"
#include "nvfp4_math.cuh"

namespace te_jax {
namespace cuda {

// ---- block amax helpers -----------------------------------------------------------
//
// Maxima of AbsBits(float32 value). For bfloat16 and float32 they are the
// exact max of the bit patterns; for float16 the value (and NaN-ness) is
// exact, a NaN's payload may differ from the per-element conversion, which
// does not matter for a block scale (E4M3 of any NaN is the NaN code).

constexpr uint32_t kAbs16x2 = 0x7fff7fffu;

// AbsBits of the float32 value of a 2-byte element's |bits| (0..0x7fff).
template <typename T>
__device__ __forceinline__ uint32_t AbsBitsOf16(uint32_t h) {
  if constexpr (std::is_same_v<T, Bf16>) {
    return h << 16;
  } else {
    return AbsBits(ToF(Half{static_cast<uint16_t>(h)}));
  }
}

// Max of the two 16-bit halves of packed |bits|, as float32 AbsBits.
template <typename T>
__device__ __forceinline__ uint32_t FoldAbs16x2(uint32_t p) {
  return AbsBitsOf16<T>(max(p >> 16, p & 0xffffu));
}

// Max |x| over the 16 / sizeof(T) elements of a 16-byte vector (AbsBits).
template <typename T>
__device__ __forceinline__ uint32_t VecAbsMax(const uint4& w) {
  if constexpr (sizeof(T) == 4) {
    return __vimax3_u32(max(AbsBits(__uint_as_float(w.x)), AbsBits(__uint_as_float(w.y))),
                        AbsBits(__uint_as_float(w.z)), AbsBits(__uint_as_float(w.w)));
  } else {
    return FoldAbs16x2<T>(__vimax3_u16x2(__vmaxu2(w.x & kAbs16x2, w.y & kAbs16x2), w.z & kAbs16x2, w.w & kAbs16x2));
  }
}

// Packed 16-bit twin of nvfp4::AbsMaxAcc (signed and unsigned max per half).
struct AbsMaxAcc16x2 {
  uint32_t smax = 0x80008000u, umax = 0u;
  __device__ __forceinline__ void Add2(uint32_t a, uint32_t b) {
    smax = __vimax3_s16x2(smax, a, b);
    umax = __vimax3_u16x2(umax, a, b);
  }
  // Per half: the max of |bits| (0..0x7fff).
  __device__ __forceinline__ uint32_t Result() const { return __vmaxu2(smax & kAbs16x2, umax & kAbs16x2); }
};

// Max |x| over all 16 vectors (a lane's 16 x V part of a 16x16 block).
template <typename T>
__device__ __forceinline__ uint32_t TileAbsMax(const uint4 (&raw)[16]) {
  if constexpr (sizeof(T) == 4) {
    nvfp4::AbsMaxAcc acc;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      acc.Add2(raw[i].x, raw[i].y);
      acc.Add2(raw[i].z, raw[i].w);
    }
    return acc.Result();
  } else {
    AbsMaxAcc16x2 acc;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      acc.Add2(raw[i].x, raw[i].y);
      acc.Add2(raw[i].z, raw[i].w);
    }
    return FoldAbs16x2<T>(acc.Result());
  }
}

// Max AbsBits of 16 floats.
__device__ __forceinline__ uint32_t AbsMax16(const float (&v)[16]) {
  nvfp4::AbsMaxAcc acc;
#pragma unroll
  for (int i = 0; i < 16; i += 2) acc.Add2(FloatBits(v[i]), FloatBits(v[i + 1]));
  return acc.Result();
}

// Word q (0..3) of a 16-byte vector.
__device__ __forceinline__ uint32_t WordOf(const uint4& w, int q) {
  return q == 0 ? w.x : (q == 1 ? w.y : (q == 2 ? w.z : w.w));
}

__device__ __forceinline__ bool NanBits(uint32_t abs_bits) { return abs_bits > 0x7f800000u; }

// 16-byte load of data that this pass reads once.
__device__ __forceinline__ uint4 LoadOnce(const void* p) { return __ldcs(static_cast<const uint4*>(p)); }

// amax of x (plain) and amax_t of the RHT of x^T, vectorized: each warp takes
// a 16 x 32V tile (the quantize kernel's per-warp tile: 16 rows of one
// 16-byte vector per lane), each lane the RHT of its V columns. amax_t is
// the max of |butterfly| (an FADD result, so a NaN there is canonical) times
// 1/4: scaling is monotone, so that equals the max over the scaled values.
// A block's 8 warps are in one matrix (one atomicMax per output per block).
constexpr int kRhtAmaxWarps = 8;

template <typename T>
__global__ void __launch_bounds__(32 * kRhtAmaxWarps) RhtAmaxTileKernel(const T* x, int64_t rows, int64_t cols,
                                                                       int64_t col_groups, int64_t warp_tiles,
                                                                       int64_t blocks_per_matrix, float* amax,
                                                                       float* amax_t) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  __shared__ uint32_t scratch[2][kRhtAmaxWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.x / blocks_per_matrix;
  const int64_t wt = (blockIdx.x % blocks_per_matrix) * kRhtAmaxWarps + warp;
  const int64_t r0 = (wt / col_groups) * 16, c = (wt % col_groups) * (32 * V) + lane * V;
  uint32_t m = 0, mt = 0;
  if (wt < warp_tiles && c < cols) {
    const T* p = x + b * rows * cols + r0 * cols + c;
    uint4 raw[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) raw[i] = __ldg(reinterpret_cast<const uint4*>(p + i * cols));
    if constexpr (std::is_same_v<T, Bf16>) {
      m = TileAbsMax<T>(raw);  // bfloat16 -> float32 is a shift: the max of |bits| is exact
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = ElemOf<T>(raw[i], j);
      if constexpr (!std::is_same_v<T, Bf16>) m = max(m, AbsMax16(v));
      Rht16Butterfly(v);
      mt = max(mt, AbsMax16(v));
    }
    mt = AbsBits(BitsFloat(mt) * 0.25f);
  }
  BlockAmaxAtomic<32 * kRhtAmaxWarps>(m, scratch[0], amax + b);
  BlockAmaxAtomic<32 * kRhtAmaxWarps>(mt, scratch[1], amax_t + b);
}

// The same for any number of columns: each thread takes 16 rows of one column.
template <typename T>
__global__ void __launch_bounds__(256) RhtAmaxKernel(const T* x, int64_t rows, int64_t cols, int64_t col_blocks,
                                                     float* amax, float* amax_t) {
  __shared__ uint32_t scratch[2][8];
  const int64_t per_matrix = (rows / 16) * col_blocks;
  const int64_t b = blockIdx.x / per_matrix, rem = blockIdx.x % per_matrix;
  const int64_t seg = rem / col_blocks, c0 = (rem % col_blocks) * 256 + threadIdx.x;
  uint32_t m = 0, mt = 0;
  if (c0 < cols) {
    const T* p = x + b * rows * cols + seg * 16 * cols + c0;
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[i] = ToF(p[i * cols]);
      m = max(m, AbsBits(v[i]));
    }
    Rht16(v);
#pragma unroll
    for (int i = 0; i < 16; ++i) mt = max(mt, AbsBits(v[i]));
  }
  BlockAmaxAtomic<256>(m, scratch[0], amax + b);
  BlockAmaxAtomic<256>(mt, scratch[1], amax_t + b);
}

template <typename T>
ffi::Error LaunchRhtAmax(cudaStream_t stream, const T* x, const MatrixBatch& mb, float* amax, float* amax_t) {
  TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(amax, 0, sizeof(float) * mb.batch, stream), "memset amax"));
  TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(amax_t, 0, sizeof(float) * mb.batch, stream), "memset amax_t"));
  if (mb.rows == 0 || mb.cols == 0) return ffi::Error::Success();
  dim3 grid;
  if ((mb.cols * sizeof(T)) % 16 == 0 && Aligned16(x)) {
    constexpr int64_t V = 16 / sizeof(T);
    const int64_t col_groups = CeilDiv(mb.cols, 32 * V);
    const int64_t warp_tiles = (mb.rows / 16) * col_groups;
    const int64_t bpm = CeilDiv(warp_tiles, kRhtAmaxWarps);
    TE_RETURN_IF_ERROR(GridOf(mb.batch * bpm, &grid));
    RhtAmaxTileKernel<T><<<grid, 32 * kRhtAmaxWarps, 0, stream>>>(x, mb.rows, mb.cols, col_groups, warp_tiles, bpm,
                                                                  amax, amax_t);
    return LaunchError("RhtAmaxTileKernel");
  }
  const int64_t col_blocks = CeilDiv(mb.cols, 256);
  TE_RETURN_IF_ERROR(GridOf(mb.batch * (mb.rows / 16) * col_blocks, &grid));
  RhtAmaxKernel<T><<<grid, 256, 0, stream>>>(x, mb.rows, mb.cols, col_blocks, amax, amax_t);
  return LaunchError("RhtAmaxKernel");
}

}  // namespace cuda
}  // namespace te_jax
