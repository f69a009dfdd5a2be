// Per-matrix amax of a batch of matrices: one read of the input, a block
// reduction, and one atomicMax per block on the zeroed float32 output.
#pragma once

#include "cuda_common.cuh"

namespace te_jax {
namespace cuda {

constexpr int kAmaxThreads = 256;
constexpr int kAmaxUnroll = 4;

// Block i of matrix b = blockIdx.x / blocks_per_matrix reads kAmaxUnroll
// vectors of kVec elements per thread.
template <typename T, int kVec>
__global__ void __launch_bounds__(kAmaxThreads)
    AmaxKernel(const T* __restrict__ x, int64_t size, int64_t blocks_per_matrix, float* amax) {
  __shared__ uint32_t scratch[kAmaxThreads / 32];
  const int64_t b = blockIdx.x / blocks_per_matrix;
  const int64_t base = (blockIdx.x % blocks_per_matrix) * (int64_t{kAmaxThreads} * kVec * kAmaxUnroll);
  const T* xb = x + b * size;
  uint32_t m = 0;
  if constexpr (kVec == 8) {
    ForEachChunk8<kAmaxThreads, kAmaxUnroll>(xb, base, size,
                                             [&](int, const float(&f)[8]) { m = max(m, AbsMaxBits8(f)); });
  } else {
#pragma unroll
    for (int u = 0; u < kAmaxUnroll; ++u) {
      const int64_t idx = base + int64_t{u} * kAmaxThreads + threadIdx.x;
      if (idx < size) m = max(m, AbsBits(ToF(xb[idx])));
    }
  }
  BlockAmaxAtomic<kAmaxThreads>(m, scratch, amax + b);
}

// amax[b] = max |x[b]| (NaN-propagating), for every matrix of the batch.
template <typename T>
ffi::Error LaunchAmax(cudaStream_t stream, const T* x, const MatrixBatch& mb, float* amax) {
  TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(amax, 0, sizeof(float) * mb.batch, stream), "memset amax"));
  const int64_t size = mb.rows * mb.cols;
  if (size == 0 || mb.batch == 0) return ffi::Error::Success();
  const bool vec = size % 8 == 0 && Aligned16(x);
  const int64_t per_block = int64_t{kAmaxThreads} * kAmaxUnroll * (vec ? 8 : 1);
  const int64_t bpm = CeilDiv(size, per_block);
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(bpm * mb.batch, &grid));
  if (vec) {
    AmaxKernel<T, 8><<<grid, kAmaxThreads, 0, stream>>>(x, size, bpm, amax);
  } else {
    AmaxKernel<T, 1><<<grid, kAmaxThreads, 0, stream>>>(x, size, bpm, amax);
  }
  return LaunchError("AmaxKernel");
}

}  // namespace cuda
}  // namespace te_jax
