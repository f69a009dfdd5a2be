// Cast + transpose for FP8 with one scale per 128x128 tile region: per-tensor
// scaling (given scale, or current scaling from a precomputed amax) and
// Float8 128x128 block scaling. Every element of a tile shares one scale, so
// the rowwise and columnwise copies hold the same codes: a thread block reads
// a 128x128 tile once (16-byte loads), writes the rowwise codes straight from
// registers and the codes into shared memory, then writes the columnwise
// (transposed) codes as 16-byte stores after a 4x4 byte transpose in
// registers. Needs rows and cols multiples of 16 and 16-byte aligned buffers.
#pragma once

#include "cuda_common.cuh"

namespace te_jax {
namespace cuda {

constexpr int kCtTile = 128;
constexpr int kCtThreads = 256;

enum class CtScale {
  kGiven,    // scale_src[b] is the scale; amax_out[b] gets the amax (atomicMax)
  kCurrent,  // scale_src[b] is the amax; scale_out/scale_inv_out get the scale
  kBlock2d,  // one scale per tile from the tile's amax; s/s_t get 1/scale
};

struct CtArgs {
  const void* x;
  int64_t rows, cols;
  int tiles_m, tiles_n;
  const float* scale_src;
  float epsilon;
  bool power_2;
  uint8_t* q;           // rowwise codes or nullptr
  uint8_t* q_t;         // columnwise codes or nullptr
  float* amax_out;      // kGiven
  float* scale_out;     // kCurrent
  float* scale_inv_out; // kGiven/kCurrent: [batch]; kBlock2d: s [batch, tiles_m, tiles_n] or nullptr
  float* s_t_out;       // kBlock2d: [batch, tiles_n, tiles_m] or nullptr
};

template <typename T, bool E5, CtScale kMode>
__global__ void __launch_bounds__(kCtThreads) Fp8CastTransposeKernel(CtArgs a) {
  // Codes of the tile, row r at byte r * 128; its 16-byte chunk c sits at
  // chunk c ^ ((r >> 4) & 7) so the column reads below are conflict-free.
  __shared__ uint4 tile_mem[kCtTile * kCtTile / 16];
  __shared__ uint32_t scratch[kCtThreads / 32];
  uint8_t* tile = reinterpret_cast<uint8_t*>(tile_mem);
  const int tid = threadIdx.x;
  const int64_t tiles = int64_t{a.tiles_m} * a.tiles_n;
  const int64_t b = blockIdx.x / tiles;
  const int t_in = static_cast<int>(blockIdx.x % tiles);
  const int tm = t_in / a.tiles_n, tn = t_in % a.tiles_n;
  const int64_t size = a.rows * a.cols;
  const int64_t row0 = int64_t{tm} * kCtTile, col0 = int64_t{tn} * kCtTile;
  const T* x = static_cast<const T*>(a.x) + b * size;

  // Each thread: 8 vectors of 8 elements; a warp covers 2 rows of 128.
  constexpr int kVpt = kCtTile * kCtTile / 8 / kCtThreads;
  Raw8<T> raw[kVpt];
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int v = tid + kCtThreads * i, r = v >> 4, cv = v & 15;
    const int64_t gr = row0 + r, gc = col0 + cv * 8;
    raw[i] = (gr < a.rows && gc < a.cols) ? LoadRaw8(x + gr * a.cols + gc) : ZeroRaw8<T>();
  }
  uint32_t m = 0;
  if constexpr (kMode != CtScale::kCurrent) {
#pragma unroll
    for (int i = 0; i < kVpt; ++i) {
      float f[8];
      Unpack8(raw[i], f);
      m = max(m, AbsMaxBits8(f));
    }
  }
  float scale;
  if constexpr (kMode == CtScale::kBlock2d) {
    m = WarpMax(m);
    if ((tid & 31) == 0) scratch[tid / 32] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kCtThreads / 32; ++w) m = max(m, scratch[w]);
    scale = ScaleFromAmax(BitsFloat(m), Fp8MaxOf<E5>(), 0.0f, a.power_2);
    if (tid == 0 && a.scale_inv_out) a.scale_inv_out[b * tiles + int64_t{tm} * a.tiles_n + tn] = 1.0f / scale;
    if (tid == 0 && a.s_t_out) a.s_t_out[b * tiles + int64_t{tn} * a.tiles_m + tm] = 1.0f / scale;
  } else {
    scale = kMode == CtScale::kGiven ? a.scale_src[b]
                                      : ScaleFromAmax(a.scale_src[b], Fp8MaxOf<E5>(), a.epsilon, a.power_2);
    if (t_in == 0 && tid == 0) {
      a.scale_inv_out[b] = 1.0f / scale;
      if constexpr (kMode == CtScale::kCurrent) a.scale_out[b] = scale;
    }
  }

  uint8_t* q = a.q ? a.q + b * size : nullptr;
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int v = tid + kCtThreads * i, r = v >> 4, cv = v & 15;
    const int64_t gr = row0 + r, gc = col0 + cv * 8;
    float f[8];
    Unpack8(raw[i], f);
    const uint2 c = Fp8x8<E5>(f, scale);
    if (q && gr < a.rows && gc < a.cols) *reinterpret_cast<uint2*>(q + gr * a.cols + gc) = c;
    const int chunk = (cv >> 1) ^ ((r >> 4) & 7);
    *reinterpret_cast<uint2*>(tile + r * kCtTile + chunk * 16 + (cv & 1) * 8) = c;
  }
  if constexpr (kMode == CtScale::kGiven) {
    m = WarpMax(m);
    if ((tid & 31) == 0) scratch[tid / 32] = m;
  }
  __syncthreads();
  if constexpr (kMode == CtScale::kGiven) {
    if (tid == 0) {
      uint32_t mm = 0;
#pragma unroll
      for (int w = 0; w < kCtThreads / 32; ++w) mm = max(mm, scratch[w]);
      atomicMax(reinterpret_cast<unsigned int*>(a.amax_out + b), mm);
    }
  }
  if (a.q_t == nullptr) return;

  // Thread: 16 rows (segment seg) x 4 columns (group cg); the 8 lanes of one
  // column group write 8 consecutive 16-byte pieces of each q_t row.
  const int seg = tid & 7, cg = tid >> 3;
  uint32_t w[16];
  const int off = (((cg >> 2) ^ seg) * 16) + (cg & 3) * 4;
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i] = *reinterpret_cast<const uint32_t*>(tile + (seg * 16 + i) * kCtTile + off);
  uint32_t col[4][4];  // col[j][k]: rows 4k..4k+3 of column j
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t in[4] = {w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]};
    uint32_t out[4];
    Transpose4x4(in, out);
#pragma unroll
    for (int j = 0; j < 4; ++j) col[j][k] = out[j];
  }
  const int64_t gc0 = col0 + cg * 4, gr0 = row0 + seg * 16;
  if (gc0 < a.cols && gr0 < a.rows) {
    uint8_t* qt = a.q_t + b * size;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<uint4*>(qt + (gc0 + j) * a.rows + gr0) = make_uint4(col[j][0], col[j][1], col[j][2], col[j][3]);
    }
  }
}

template <typename T, bool E5, CtScale kMode>
ffi::Error LaunchFp8CastTranspose(cudaStream_t stream, const MatrixBatch& mb, CtArgs a) {
  a.tiles_m = static_cast<int>(CeilDiv(mb.rows, kCtTile));
  a.tiles_n = static_cast<int>(CeilDiv(mb.cols, kCtTile));
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(int64_t{a.tiles_m} * a.tiles_n * mb.batch, &grid));
  Fp8CastTransposeKernel<T, E5, kMode><<<grid, kCtThreads, 0, stream>>>(a);
  return LaunchError("Fp8CastTransposeKernel");
}

// Whether the cast-transpose kernel can take these buffers.
inline bool CastTransposeFits(const MatrixBatch& mb, const void* x, const void* q, const void* q_t) {
  return TileFriendly(mb) && Aligned16(x) && Aligned16(q) && Aligned16(q_t);
}

}  // namespace cuda
}  // namespace te_jax
