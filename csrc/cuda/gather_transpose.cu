// CUDA FFI handler of te_jax_gather_transpose (layout_checks.h): out[c, p] =
// data[sources[p], c], or 0 where sources[p] names no row. Each block moves a
// tile of 64 positions x 64 columns through shared memory: 256 threads load
// its 64 source rows and store its 64 output rows (along the positions), 16
// bytes a thread, four threads a row; blockIdx.z is the matrix of a batch.
// Unless C and S are multiples of 16 and both buffers 16-byte aligned, the
// same tiles move a byte at a time.
#include "cuda_common.cuh"
#include "../common/bindings.h"
#include "../common/layout_checks.h"

namespace te_jax {
namespace cuda {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;
constexpr int kChunk = 16;                   // bytes a thread moves per row
constexpr int kChunksPerRow = kTile / kChunk;  // 4 threads cover a tile row
constexpr int kPitch = kTile + 4;            // shared row pitch: 4-byte aligned, staggers the banks

template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    GatherTransposeKernel(const uint8_t* __restrict__ in, const int32_t* __restrict__ sources,
                          uint8_t* __restrict__ out, int64_t rows, int64_t cols, int64_t positions) {
  __shared__ __align__(16) uint8_t tile[kTile][kPitch];  // [position][column]
  const int64_t b = blockIdx.z;
  in += b * rows * cols;
  sources += b * positions;
  out += b * cols * positions;
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int t = threadIdx.x;
  {
    const int pi = t / kChunksPerRow, ci = (t % kChunksPerRow) * kChunk;
    const int64_t p = p0 + pi;
    const int64_t r = p < positions ? sources[p] : -1;
    const bool have = r >= 0 && r < rows;
    if constexpr (kVec) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (have && c0 + ci < cols) v = *reinterpret_cast<const uint4*>(in + r * cols + c0 + ci);
      uint32_t* dst = reinterpret_cast<uint32_t*>(&tile[pi][ci]);
      dst[0] = v.x;
      dst[1] = v.y;
      dst[2] = v.z;
      dst[3] = v.w;
    } else {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        const int64_t c = c0 + ci + k;
        tile[pi][ci + k] = have && c < cols ? in[r * cols + c] : uint8_t{0};
      }
    }
  }
  __syncthreads();
  const int cj = t / kChunksPerRow, pj = (t % kChunksPerRow) * kChunk;
  const int64_t c = c0 + cj;
  if (c >= cols) return;
  uint8_t* dst = out + c * positions + p0 + pj;
  if constexpr (kVec) {
    if (p0 + pj >= positions) return;
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w[q] = uint32_t{tile[pj + 4 * q][cj]} | (uint32_t{tile[pj + 4 * q + 1][cj]} << 8) |
             (uint32_t{tile[pj + 4 * q + 2][cj]} << 16) | (uint32_t{tile[pj + 4 * q + 3][cj]} << 24);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      if (p0 + pj + k < positions) dst[k] = tile[pj + k][cj];
    }
  }
}

ffi::Error GatherTranspose(cudaStream_t stream, ffi::AnyBuffer data, ffi::Buffer<ffi::S32> sources,
                           ffi::Result<ffi::AnyBuffer> out) {
  auto c = CheckGatherTranspose(data, sources, *out);
  if (c.has_error()) return c.error();
  const GatherTransposeShape s = c.value();
  if (s.batch == 0 || s.cols == 0 || s.positions == 0) return ffi::Error::Success();
  const auto* in = static_cast<const uint8_t*>(data.untyped_data());
  auto* o = static_cast<uint8_t*>(out->untyped_data());
  const int64_t tiles_p = CeilDiv(s.positions, kTile), tiles_c = CeilDiv(s.cols, kTile);
  if (tiles_c > 65535) return InvalidArgument("gather_transpose: more than 4194240 columns (C) for one launch");
  if (tiles_p > 0x7fffffff) return InvalidArgument("gather_transpose: more than 2^37 positions (S) for one launch");
  if (s.batch > 65535) return InvalidArgument("gather_transpose: more than 65535 matrices for one launch");
  const dim3 grid(static_cast<unsigned>(tiles_p), static_cast<unsigned>(tiles_c), static_cast<unsigned>(s.batch));
  const bool vec = s.cols % kChunk == 0 && s.positions % kChunk == 0 && Aligned16(in) && Aligned16(o);
  if (vec) {
    GatherTransposeKernel<true><<<grid, kThreads, 0, stream>>>(in, sources.typed_data(), o, s.rows, s.cols,
                                                               s.positions);
  } else {
    GatherTransposeKernel<false><<<grid, kThreads, 0, stream>>>(in, sources.typed_data(), o, s.rows, s.cols,
                                                                s.positions);
  }
  return LaunchError("GatherTransposeKernel");
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_HANDLER(GatherTranspose, cuda::GatherTranspose);

}  // namespace te_jax
