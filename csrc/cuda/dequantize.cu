// CUDA FFI handlers that turn every quantized layout back into float32,
// bfloat16 or float16 values: one elementwise kernel, 16 elements per thread
// (one 16-byte load of FP8 codes or 8 bytes of packed E2M1), one scale per
// 16-element vector, or one element per thread for unaligned shapes.
#include <cuda_bf16.h>

#include "cuda_common.cuh"
#include "../common/bindings.h"

namespace te_jax {
namespace cuda {
namespace {

enum class Dq { kTensor, kMx, kBlock, kNvfp4 };

struct DqArgs {
  const uint8_t* q;
  const void* s;
  const float* amax;  // kNvfp4
  int64_t rows, cols, blocks_per_matrix;
  int64_t block_rows, block_cols;  // kBlock
  void* out;
};

__device__ __forceinline__ uint16_t FromF(float v, Bf16) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ uint16_t FromF(float v, Half) { return __half_as_ushort(__float2half_rn(v)); }

template <typename OutT, int kVec>
__device__ __forceinline__ void StoreOut(void* out, int64_t idx, const float (&v)[kVec]) {
  if constexpr (kVec == 1) {
    if constexpr (sizeof(OutT) == 4) {
      static_cast<float*>(out)[idx] = v[0];
    } else {
      static_cast<uint16_t*>(out)[idx] = FromF(v[0], OutT{});
    }
  } else if constexpr (sizeof(OutT) == 4) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(out) + idx);
#pragma unroll
    for (int k = 0; k < kVec / 4; ++k) p[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  } else {
    uint32_t w[kVec / 2];
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) w[k] = uint32_t{FromF(v[2 * k], OutT{})} | (uint32_t{FromF(v[2 * k + 1], OutT{})} << 16);
    uint4* p = reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + idx);
#pragma unroll
    for (int k = 0; k < kVec / 8; ++k) p[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
  }
}

// Scale shared by the elements [idx, idx + vector) of matrix b.
template <Dq kMode>
__device__ __forceinline__ float ScaleAt(const DqArgs& a, int64_t b, int64_t idx) {
  const int64_t size = a.rows * a.cols;
  if constexpr (kMode == Dq::kTensor) {
    return static_cast<const float*>(a.s)[b];
  } else if constexpr (kMode == Dq::kMx) {
    return E8M0ToFloat(static_cast<const uint8_t*>(a.s)[(b * size + idx) / kMxfp8Block]);
  } else if constexpr (kMode == Dq::kNvfp4) {
    return Fp8ToFloat(static_cast<const uint8_t*>(a.s)[(b * size + idx) / kNvfp4Block], kE4M3);
  } else {
    const int64_t i = idx / a.cols, j = idx % a.cols, bpr = a.cols / a.block_cols;
    const int64_t per = (a.rows / a.block_rows) * bpr;
    return static_cast<const float*>(a.s)[b * per + (i / a.block_rows) * bpr + j / a.block_cols];
  }
}

template <typename OutT, Dq kMode, bool E5, int kVec>
__global__ void __launch_bounds__(256) DequantKernel(DqArgs a) {
  const int64_t b = blockIdx.x / a.blocks_per_matrix;
  const int64_t idx = ((blockIdx.x % a.blocks_per_matrix) * 256 + threadIdx.x) * kVec;
  const int64_t size = a.rows * a.cols;
  if (idx >= size) return;
  const int64_t g = b * size + idx;
  const float scale = ScaleAt<kMode>(a, b, idx);
  float v[kVec];
  if constexpr (kMode == Dq::kNvfp4) {
    const float s_dec = 1.0f / Nvfp4GlobalEncodeScale(a.amax[b]);
    uint32_t w[(kVec + 7) / 8];
    if constexpr (kVec == 16) {
      const uint2 p = *reinterpret_cast<const uint2*>(a.q + g / 2);
      w[0] = p.x;
      w[1] = p.y;
    } else {
      w[0] = a.q[g / 2] >> ((g & 1) * 4);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      v[k] = (E2M1ToFloat(static_cast<uint8_t>((w[k / 8] >> (4 * (k % 8))) & 0xfu)) * scale) * s_dec;
    }
  } else {
    const Fp8Format fmt = E5 ? kE5M2 : kE4M3;
    uint32_t w[(kVec + 3) / 4];
    if constexpr (kVec == 16) {
      const uint4 p = *reinterpret_cast<const uint4*>(a.q + g);
      w[0] = p.x;
      w[1] = p.y;
      w[2] = p.z;
      w[3] = p.w;
    } else {
      w[0] = a.q[g];
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = Fp8ToFloat(static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4))), fmt) * scale;
  }
  StoreOut<OutT, kVec>(a.out, g, v);
}

template <Dq kMode>
ffi::Error LaunchDequant(cudaStream_t stream, const MatrixBatch& mb, ffi::DataType out_type, bool e5, DqArgs a) {
  const int64_t size = mb.rows * mb.cols;
  if (mb.batch == 0 || size == 0) return ffi::Error::Success();
  const bool vec = size % 16 == 0 && Aligned16(a.out) &&
                   (kMode == Dq::kNvfp4 ? (reinterpret_cast<uintptr_t>(a.q) & 7u) == 0 : Aligned16(a.q));
  a.blocks_per_matrix = CeilDiv(size, 256 * (vec ? 16 : 1));
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(a.blocks_per_matrix * mb.batch, &grid));
  return DispatchInput(out_type, [&](auto tag) {
    using OutT = decltype(tag);
    return DispatchBool(e5, [&](auto e5c) {
      constexpr bool E5 = decltype(e5c)::value && kMode != Dq::kNvfp4;
      if (vec) {
        DequantKernel<OutT, kMode, E5, 16><<<grid, 256, 0, stream>>>(a);
      } else {
        DequantKernel<OutT, kMode, E5, 1><<<grid, 256, 0, stream>>>(a);
      }
      return LaunchError("DequantKernel");
    });
  });
}

ffi::Error DequantizeFp8Tensor(cudaStream_t stream, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale_inv,
                               ffi::Result<ffi::AnyBuffer> out) {
  auto c = CheckDequantizeFp8Tensor(q, scale_inv, *out);
  if (c.has_error()) return c.error();
  const MatrixBatch mb = c.value().mb;
  DqArgs a{static_cast<const uint8_t*>(q.untyped_data()), scale_inv.typed_data(), nullptr, mb.rows, mb.cols, 0, 1, 1,
           out->untyped_data()};
  return LaunchDequant<Dq::kTensor>(stream, mb, out->element_type(), c.value().fmt.mant_bits == 2, a);
}

ffi::Error DequantizeMxfp8(cudaStream_t stream, ffi::AnyBuffer q, ffi::Buffer<ffi::U8> s,
                           ffi::Result<ffi::AnyBuffer> out) {
  auto c = CheckDequantizeFp8Blocks(q, s.element_count(), *out, 1, kMxfp8Block);
  if (c.has_error()) return c.error();
  const MatrixBatch mb = c.value().mb;
  DqArgs a{static_cast<const uint8_t*>(q.untyped_data()), s.typed_data(), nullptr, mb.rows, mb.cols, 0, 1, kMxfp8Block,
           out->untyped_data()};
  return LaunchDequant<Dq::kMx>(stream, mb, out->element_type(), c.value().fmt.mant_bits == 2, a);
}

ffi::Error DequantizeFp8Block(cudaStream_t stream, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> s,
                              ffi::Result<ffi::AnyBuffer> out, bool block_2d) {
  const int64_t brows = block_2d ? kFp8Block : 1;
  auto c = CheckDequantizeFp8Blocks(q, s.element_count(), *out, brows, kFp8Block);
  if (c.has_error()) return c.error();
  const MatrixBatch mb = c.value().mb;
  DqArgs a{static_cast<const uint8_t*>(q.untyped_data()), s.typed_data(), nullptr, mb.rows, mb.cols, 0, brows,
           kFp8Block, out->untyped_data()};
  return LaunchDequant<Dq::kBlock>(stream, mb, out->element_type(), c.value().fmt.mant_bits == 2, a);
}

ffi::Error DequantizeNvfp4(cudaStream_t stream, ffi::Buffer<ffi::U8> q, ffi::AnyBuffer s, ffi::Buffer<ffi::F32> amax,
                           ffi::Result<ffi::AnyBuffer> out) {
  auto mb_or = CheckDequantizeNvfp4(q, s, amax, *out);
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  DqArgs a{q.typed_data(), s.untyped_data(), amax.typed_data(), mb.rows, mb.cols, 0, 1, kNvfp4Block,
           out->untyped_data()};
  return LaunchDequant<Dq::kNvfp4>(stream, mb, out->element_type(), false, a);
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_HANDLER(DequantizeFp8Tensor, cuda::DequantizeFp8Tensor);
TE_JAX_CUDA_HANDLER(DequantizeMxfp8, cuda::DequantizeMxfp8);
TE_JAX_CUDA_HANDLER(DequantizeFp8Block, cuda::DequantizeFp8Block);
TE_JAX_CUDA_HANDLER(DequantizeNvfp4, cuda::DequantizeNvfp4);

}  // namespace te_jax
