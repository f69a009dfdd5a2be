// CUDA FFI handlers for per-tensor FP8: a given scale (delayed scaling) and
// current scaling. Rowwise only: one elementwise pass (16-byte loads, amax
// fused). With a columnwise copy: the tiled cast-transpose kernel. Current
// scaling first runs the amax kernel; the cast kernels then derive the scale
// from the amax output in every block.
#include <algorithm>

#include "amax.cuh"
#include "fp8_cast_transpose.cuh"
#include "../common/bindings.h"

namespace te_jax {
namespace cuda {
namespace {

constexpr int kCastThreads = 256;
constexpr int kCastUnroll = 4;

struct CastArgs {
  const void* x;
  int64_t rows, cols, blocks_per_matrix;
  const float* scale_src;  // scale (given) or amax (current)
  float epsilon;
  bool power_2;
  uint8_t* q;              // or nullptr
  uint8_t* q_t;            // only with kVec == 1, or nullptr
  float* amax_out;         // given: atomicMax target
  float* scale_out;        // current
  float* scale_inv_out;
};

template <typename T, bool E5, int kVec, bool kCurrent>
__global__ void __launch_bounds__(kCastThreads) Fp8CastKernel(CastArgs a) {
  __shared__ uint32_t scratch[kCastThreads / 32];
  const int64_t b = blockIdx.x / a.blocks_per_matrix;
  const int64_t chunk = blockIdx.x % a.blocks_per_matrix;
  const int64_t size = a.rows * a.cols;
  const float scale = kCurrent ? ScaleFromAmax(a.scale_src[b], Fp8MaxOf<E5>(), a.epsilon, a.power_2) : a.scale_src[b];
  if (chunk == 0 && threadIdx.x == 0) {
    a.scale_inv_out[b] = 1.0f / scale;
    if constexpr (kCurrent) a.scale_out[b] = scale;
  }
  const T* x = static_cast<const T*>(a.x) + b * size;
  uint8_t* q = a.q ? a.q + b * size : nullptr;
  const int64_t base = chunk * (int64_t{kCastThreads} * kVec * kCastUnroll);
  uint32_t m = 0;
  if constexpr (kVec == 8) {
    ForEachChunk8<kCastThreads, kCastUnroll>(x, base, size, [&](int u, const float(&f)[8]) {
      const int64_t idx = base + (int64_t{u} * kCastThreads + threadIdx.x) * 8;
      if constexpr (!kCurrent) m = max(m, AbsMaxBits8(f));
      if (q && idx < size) *reinterpret_cast<uint2*>(q + idx) = Fp8x8<E5>(f, scale);
    });
  } else {
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) {
      const int64_t idx = base + int64_t{u} * kCastThreads + threadIdx.x;
      if (idx >= size) continue;
      const float f = ToF(x[idx]);
      if constexpr (!kCurrent) m = max(m, AbsBits(f));
      const uint8_t c = static_cast<uint8_t>(Fp8x2<E5>(f * scale, 0.0f));
      if (q) q[idx] = c;
      if (a.q_t) a.q_t[b * size + (idx % a.cols) * a.rows + idx / a.cols] = c;
    }
  }
  if constexpr (!kCurrent) BlockAmaxAtomic<kCastThreads>(m, scratch, a.amax_out + b);
}

template <typename T, bool E5, bool kCurrent>
ffi::Error LaunchCast(cudaStream_t stream, const MatrixBatch& mb, CastArgs a) {
  const int64_t size = mb.rows * mb.cols;
  const bool vec = a.q_t == nullptr && size % 8 == 0 && Aligned16(a.x) && Aligned16(a.q);
  a.blocks_per_matrix = std::max<int64_t>(1, CeilDiv(size, int64_t{kCastThreads} * kCastUnroll * (vec ? 8 : 1)));
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(a.blocks_per_matrix * mb.batch, &grid));
  if (vec) {
    Fp8CastKernel<T, E5, 8, kCurrent><<<grid, kCastThreads, 0, stream>>>(a);
  } else {
    Fp8CastKernel<T, E5, 1, kCurrent><<<grid, kCastThreads, 0, stream>>>(a);
  }
  return LaunchError("Fp8CastKernel");
}

// Rowwise and/or columnwise cast with the scale source in `a`; picks the
// tiled cast-transpose kernel when there is a columnwise copy and the shape
// allows it.
template <bool kCurrent>
ffi::Error LaunchPerTensor(cudaStream_t stream, ffi::DataType dtype, bool e5, const MatrixBatch& mb, CastArgs a) {
  return DispatchInput(dtype, [&](auto tag) {
    using T = decltype(tag);
    return DispatchBool(e5, [&](auto e5c) {
      constexpr bool E5 = decltype(e5c)::value;
      if (a.q_t != nullptr && CastTransposeFits(mb, a.x, a.q, a.q_t)) {
        CtArgs c{};
        c.x = a.x;
        c.rows = mb.rows;
        c.cols = mb.cols;
        c.scale_src = a.scale_src;
        c.epsilon = a.epsilon;
        c.power_2 = a.power_2;
        c.q = a.q;
        c.q_t = a.q_t;
        c.amax_out = a.amax_out;
        c.scale_out = a.scale_out;
        c.scale_inv_out = a.scale_inv_out;
        constexpr CtScale kMode = kCurrent ? CtScale::kCurrent : CtScale::kGiven;
        return LaunchFp8CastTranspose<T, E5, kMode>(stream, mb, c);
      }
      return LaunchCast<T, E5, kCurrent>(stream, mb, a);
    });
  });
}

ffi::Error QuantizeFp8Tensor(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                             ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> q_t,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                             bool rowwise, bool colwise) {
  auto cast = CheckQuantizeFp8Tensor(x, scale, *q, *q_t, rowwise, colwise);
  if (cast.has_error()) return cast.error();
  const MatrixBatch mb = cast.value().mb;
  const Fp8Format fmt = cast.value().fmt;
  if (mb.batch == 0) return ffi::Error::Success();
  TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(amax->typed_data(), 0, sizeof(float) * mb.batch, stream), "memset amax"));
  CastArgs a{};
  a.x = x.untyped_data();
  a.rows = mb.rows;
  a.cols = mb.cols;
  a.scale_src = scale.typed_data();
  a.q = rowwise ? DataOf<uint8_t>(*q) : nullptr;
  a.q_t = colwise ? DataOf<uint8_t>(*q_t) : nullptr;
  a.amax_out = amax->typed_data();
  a.scale_inv_out = scale_inv->typed_data();
  return LaunchPerTensor<false>(stream, x.element_type(), fmt.mant_bits == 2, mb, a);
}

ffi::Error QuantizeFp8Current(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                              ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                              ffi::Result<ffi::Buffer<ffi::F32>> scale, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                              bool rowwise, bool colwise, bool power_2, float epsilon) {
  auto cast = CheckFp8Cast(x, *q, *q_t, rowwise, colwise);
  if (cast.has_error()) return cast.error();
  const MatrixBatch mb = cast.value().mb;
  const Fp8Format fmt = cast.value().fmt;
  if (mb.batch == 0) return ffi::Error::Success();
  TE_RETURN_IF_ERROR(DispatchInput(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return LaunchAmax<T>(stream, static_cast<const T*>(x.untyped_data()), mb, amax->typed_data());
  }));
  CastArgs a{};
  a.x = x.untyped_data();
  a.rows = mb.rows;
  a.cols = mb.cols;
  a.scale_src = amax->typed_data();
  a.epsilon = epsilon;
  a.power_2 = power_2;
  a.q = rowwise ? DataOf<uint8_t>(*q) : nullptr;
  a.q_t = colwise ? DataOf<uint8_t>(*q_t) : nullptr;
  a.scale_out = scale->typed_data();
  a.scale_inv_out = scale_inv->typed_data();
  return LaunchPerTensor<true>(stream, x.element_type(), fmt.mant_bits == 2, mb, a);
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_HANDLER(QuantizeFp8Tensor, cuda::QuantizeFp8Tensor);
TE_JAX_CUDA_HANDLER(QuantizeFp8Current, cuda::QuantizeFp8Current);

}  // namespace te_jax
