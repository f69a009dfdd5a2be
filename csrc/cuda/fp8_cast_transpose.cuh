// Cast + transpose for FP8 by 128x128 tiles: per-tensor scaling (given scale,
// or current scaling from a precomputed amax) and Float8 block scaling. With
// one scale per tile (per-tensor, 128x128 blocks) the rowwise and columnwise
// copies hold the same codes: a thread block reads a 128x128 tile once
// (16-byte loads), writes the rowwise codes straight from registers and the
// codes into shared memory, then writes the columnwise (transposed) codes as
// 16-byte stores after a 4x4 byte transpose in registers. With 1x128 blocks
// (kBlock1d) a tile row is a rowwise block and a tile column a columnwise
// block: the tile stays in registers while the column amaxes are reduced
// through shared memory, then the rowwise codes (row scales) go to global
// memory and the columnwise codes (column scales) through the same transpose.
// Needs rows and cols multiples of 16 (kBlock1d: of 128) and 16-byte aligned
// buffers. A producer's 1x128 cast keeps the tile's float32 values in
// registers (its inputs, up to 48 bytes per vector, would not fit) and runs at
// two blocks per SM.
//
// The values come from a producer: the input itself (PlainInput, the plain
// quantize) or a fused op's output computed from its inputs on the fly (a
// norm, an activation or its gradient: norm_act_kernels.cuh describes the
// interface), for the per-tensor cast pass of the fused ops, with the
// activation gradient's dbias partials.
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
  kBlock1d,  // 1x128 blocks: a scale per tile row (rowwise) and per tile column (columnwise); s/s_t get 1/scale
  kStats,    // no cast: amax_out[b] gets the values' amax (the amax pass of the fused current-scaling casts)
};

struct CtArgs {
  const void* x;        // the plain quantize's input (LaunchFp8CastTranspose wraps it in a PlainInput)
  int64_t rows, cols;
  int tiles_m, tiles_n;
  const float* scale_src;
  float epsilon;
  bool power_2;
  uint8_t* q;           // rowwise codes or nullptr
  uint8_t* q_t;         // columnwise codes or nullptr
  float* amax_out;      // kGiven
  float* scale_out;     // kCurrent
  float* scale_inv_out; // kGiven/kCurrent: [batch]; kBlock2d: s [batch, tiles_m, tiles_n];
                        // kBlock1d: s [batch, rows, tiles_n]; or nullptr
  float* s_t_out;       // kBlock2d: [batch, tiles_n, tiles_m]; kBlock1d: [batch, cols, tiles_m]; or nullptr
  float* dbias_ws;      // with kDbias: the dbias partials [batch, ceil(rows / kDbiasRows), cols]
};

// dbias partials: column sums per group of kDbiasRows rows, in one summation
// order that the fused ops' tile kernel (norm_act_kernels.cuh) shares, so a
// column's dbias has the same bits whichever kernel wrote the cast. With y[r]
// the group's row r, s(a) = ((y[a] + y[a + 16]) + y[a + 32]) + y[a + 48] and
// S_w = s(2w) + s(2w + 1), the partial is S_0 + S_1 + ... + S_7, left to
// right (each sum starting from 0.0f). Here s(a) is one thread's rows and
// S_w one warp's.
constexpr int kDbiasRows = 64;
constexpr int kDbiasPairs = 8;  // the S_w of a group

// The input itself as the values to cast (the plain quantize). A producer
// (norm_act_kernels.cuh) computes 8 float32 values of row r, columns c0.. of
// batch element b from the 16-byte loads Fetch issued.
template <typename T>
struct PlainInput {
  const T* x;
  int64_t rows, cols;
  using Raw = Raw8<T>;
  __device__ __forceinline__ Raw Fetch(int64_t b, int64_t r, int64_t c0) const {
    return LoadRaw8(x + (b * rows + r) * cols + c0);
  }
  __device__ __forceinline__ void Compute(const Raw& raw, int64_t, int64_t, int64_t, float (&f)[8]) const {
    Unpack8(raw, f);
  }
};

template <class P>
struct IsPlainInput : std::false_type {};
template <typename T>
struct IsPlainInput<PlainInput<T>> : std::true_type {};

// Whether the mode needs the tile's amax (or its rows' and columns') before any code.
constexpr bool CtWholeTile(CtScale mode) { return mode == CtScale::kBlock2d || mode == CtScale::kBlock1d; }

// Whether the kernel computes a thread's 64 values first and keeps them (a
// producer's 1x128 cast), rather than keeping its raw inputs until the scales
// are known (the plain quantize's block casts).
template <class P, CtScale kMode>
constexpr bool CtValuesFirst() {
  return kMode == CtScale::kBlock1d && !IsPlainInput<P>::value;
}

// Resident blocks per SM the kernel is compiled for (256 threads each): the
// plain cast of 2-byte inputs fits 64 registers (4 blocks), block scaling
// keeps the whole tile's inputs (one block fewer); a producer's math (a norm's
// gamma and beta, an activation) needs 80 (3 blocks), and with its 64 values
// kept for 1x128 blocks 128 (2 blocks).
template <class P, CtScale kMode>
constexpr int CtMinBlocks() {
  if constexpr (IsPlainInput<P>::value) {
    return (sizeof(typename P::Raw) <= 16 ? 4 : 3) - (CtWholeTile(kMode) ? 1 : 0);
  }
  return CtValuesFirst<P, kMode>() ? 2 : 3;
}

// kDbias: also the column sums of the values, per 64-row group, into
// a.dbias_ws (rows past the matrix count as zeros).
template <class P, bool E5, CtScale kMode, bool kDbias>
__global__ void __launch_bounds__(kCtThreads, CtMinBlocks<P, kMode>()) Fp8CastTransposeKernel(P prod, CtArgs a) {
  // Codes of the tile, row r at byte r * 128; its 16-byte chunk c sits at
  // chunk c ^ ((r >> 4) & 7) so the column reads below are conflict-free.
  __shared__ uint4 tile_mem[kCtTile * kCtTile / 16];
  __shared__ uint32_t scratch[kCtThreads / 32];
  constexpr int kWarps = kCtThreads / 32;
  static_assert(kCtTile == 2 * kDbiasRows && kWarps == kDbiasPairs && kCtThreads / 16 == 16,
                "the dbias order above: two groups per tile, a warp per S_w, rows 16 apart per thread");
  __shared__ float dbias_part[kDbias ? kWarps * 2 * kCtTile : 1];  // [warp][64-row group][column]
  constexpr bool k1d = kMode == CtScale::kBlock1d;
  __shared__ uint32_t col_amax[k1d ? kWarps * kCtTile : 1];  // [warp][column]: the warp's two rows per thread
  __shared__ float col_scale[k1d ? kCtTile : 1];
  __shared__ float row_scale[k1d ? kCtTile : 1];  // (in shared memory: fewer live registers across the barriers)
  uint8_t* tile = reinterpret_cast<uint8_t*>(tile_mem);
  const int tid = threadIdx.x;
  const int64_t tiles = int64_t{a.tiles_m} * a.tiles_n;
  const int64_t b = blockIdx.x / tiles;
  const int t_in = static_cast<int>(blockIdx.x % tiles);
  const int tm = t_in / a.tiles_n, tn = t_in % a.tiles_n;
  const int64_t size = a.rows * a.cols;
  const int64_t row0 = int64_t{tm} * kCtTile, col0 = int64_t{tn} * kCtTile;

  // Each thread: 8 vectors of 8 values (rows tid / 16 + 16 i, columns
  // (tid % 16) * 8..); a warp covers 2 rows of 128. Loads are issued a batch
  // at a time: the plain cast of 2-byte inputs, and 128x128 blocks (the scale
  // needs the whole tile), take all 8 at once; otherwise 4 vectors (inputs of
  // up to 32 bytes each) or 2, which leaves a producer registers for its math.
  constexpr int kVpt = kCtTile * kCtTile / 8 / kCtThreads;
  constexpr int kRawBytes = static_cast<int>(sizeof(typename P::Raw));
  constexpr bool kValuesFirst = CtValuesFirst<P, kMode>();
  constexpr int kBatch = ((CtWholeTile(kMode) && !kValuesFirst) || (IsPlainInput<P>::value && kRawBytes <= 16) ||
                          (kMode == CtScale::kStats && kRawBytes <= 16))
                             ? kVpt
                             : (kRawBytes <= 32 ? kVpt / 2 : kVpt / 4);
  float scale = 1.0f;
  uint8_t* q = a.q ? a.q + b * size : nullptr;
  uint32_t m = 0;
  float my_col_scale[k1d ? 8 : 1];
  float dsum[2][8];
#pragma unroll
  for (int k = 0; k < 8; ++k) dsum[0][k] = dsum[1][k] = 0.0f;
  float vals[kValuesFirst ? kVpt : 1][8];  // kValuesFirst: the thread's values, vector i at vals[i]
  if constexpr (kValuesFirst) {  // full tiles (the launcher checks)
#pragma unroll
    for (int i0 = 0; i0 < kVpt; i0 += kBatch) {
      typename P::Raw raw[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int v = tid + kCtThreads * (i0 + i);
        raw[i] = prod.Fetch(b, row0 + (v >> 4), col0 + (v & 15) * 8);
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int v = tid + kCtThreads * (i0 + i);
        prod.Compute(raw[i], b, row0 + (v >> 4), col0 + (v & 15) * 8, vals[i0 + i]);
      }
    }
  }
#pragma unroll
  for (int i0 = 0; i0 < kVpt; i0 += kBatch) {
    typename P::Raw raw[kValuesFirst ? 1 : kBatch];
    if constexpr (!kValuesFirst) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int v = tid + kCtThreads * (i0 + i), r = v >> 4, cv = v & 15;
        const int64_t gr = row0 + r, gc = col0 + cv * 8;
        raw[i] = (gr < a.rows && gc < a.cols) ? prod.Fetch(b, gr, gc) : typename P::Raw{};
      }
    }
    if constexpr (kMode == CtScale::kBlock2d) {  // one scale per tile, from the tile's amax
#pragma unroll
      for (int i = 0; i < kVpt; ++i) {
        const int v = tid + kCtThreads * i;
        float f[8];
        prod.Compute(raw[i], b, row0 + (v >> 4), col0 + (v & 15) * 8, f);
        if (row0 + (v >> 4) < a.rows && col0 + (v & 15) * 8 < a.cols) m = max(m, AbsMaxBits8(f));
      }
      m = WarpMax(m);
      if ((tid & 31) == 0) scratch[tid / 32] = m;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m = max(m, scratch[w]);
      scale = ScaleFromAmax(BitsFloat(m), Fp8MaxOf<E5>(), 0.0f, a.power_2);
      if (tid == 0 && a.scale_inv_out) a.scale_inv_out[b * tiles + int64_t{tm} * a.tiles_n + tn] = 1.0f / scale;
      if (tid == 0 && a.s_t_out) a.s_t_out[b * tiles + int64_t{tn} * a.tiles_m + tm] = 1.0f / scale;
    } else if constexpr (k1d) {  // full tiles (the launcher checks): every value is in the matrix
      if (i0 == 0) {  // once: all values are loaded (kValuesFirst: computed) by now
        // Rows: lanes 16j..16j+15 share a row. Columns: a thread's 8 rows, the
        // other half-warp's, then the 8 warps' partials through shared memory.
        uint32_t cm[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) cm[k] = 0;
        // The tile's first rowwise scale (a base pointer keeps the loop's index math in 32 bits).
        float* s_row = a.scale_inv_out ? a.scale_inv_out + (b * a.rows + row0) * a.tiles_n + tn : nullptr;
#pragma unroll
        for (int i = 0; i < kVpt; ++i) {
          const int v = tid + kCtThreads * i;
          float f[8];
          if constexpr (kValuesFirst) {
#pragma unroll
            for (int k = 0; k < 8; ++k) f[k] = vals[i][k];
          } else {
            prod.Compute(raw[i], b, row0 + (v >> 4), col0 + (v & 15) * 8, f);
          }
#pragma unroll
          for (int k = 0; k < 8; ++k) cm[k] = max(cm[k], AbsBits(f[k]));
          const uint32_t rm = GroupMax<16>(AbsMaxBits8(f));
          if ((tid & 15) == 0) {
            const float rs = ScaleFromAmax(BitsFloat(rm), Fp8MaxOf<E5>(), 0.0f, a.power_2);
            row_scale[v >> 4] = rs;
            if (s_row) s_row[(v >> 4) * a.tiles_n] = 1.0f / rs;
          }
        }
        const int lane = tid & 31;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          cm[k] = max(cm[k], __shfl_xor_sync(0xffffffffu, cm[k], 16));
          if (lane < 16) col_amax[(tid / 32) * kCtTile + lane * 8 + k] = cm[k];
        }
        __syncthreads();
        if (tid < kCtTile) {
          uint32_t cmax = 0;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) cmax = max(cmax, col_amax[w * kCtTile + tid]);
          const float cs = ScaleFromAmax(BitsFloat(cmax), Fp8MaxOf<E5>(), 0.0f, a.power_2);
          col_scale[tid] = cs;
          if (a.s_t_out) a.s_t_out[(b * a.cols + col0 + tid) * a.tiles_m + tm] = 1.0f / cs;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 8; ++k) my_col_scale[k] = col_scale[(tid & 15) * 8 + k];
      }
    } else if (kMode != CtScale::kStats && i0 == 0) {  // after the first loads are issued (fewer live registers)
      scale = kMode == CtScale::kGiven ? a.scale_src[b]
                                       : ScaleFromAmax(a.scale_src[b], Fp8MaxOf<E5>(), a.epsilon, a.power_2);
      if (t_in == 0 && tid == 0) {
        if (a.scale_inv_out) a.scale_inv_out[b] = 1.0f / scale;
        if constexpr (kMode == CtScale::kCurrent) {
          if (a.scale_out) a.scale_out[b] = scale;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int v = tid + kCtThreads * (i0 + i), r = v >> 4, cv = v & 15;
      const int64_t gr = row0 + r, gc = col0 + cv * 8;
      const bool valid = gr < a.rows && gc < a.cols;
      float f[8];
      if constexpr (kValuesFirst) {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = vals[i0 + i][k];
      } else {
        prod.Compute(raw[i], b, gr, gc, f);
      }
      if (!valid) {  // a producer's value of zero inputs need not be zero (a norm's beta)
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = 0.0f;
      }
      if constexpr (kMode == CtScale::kGiven || kMode == CtScale::kStats) m = max(m, AbsMaxBits8(f));
      if constexpr (kMode == CtScale::kStats) continue;
      if constexpr (kDbias) {
#pragma unroll
        for (int k = 0; k < 8; ++k) dsum[(i0 + i) / (kVpt / 2)][k] += f[k];
      }
      const uint2 c = Fp8x8<E5>(f, k1d ? row_scale[k1d ? r : 0] : scale);
      if (q && valid) *reinterpret_cast<uint2*>(q + gr * a.cols + gc) = c;
      const int chunk = (cv >> 1) ^ ((r >> 4) & 7);
      uint2 c_t = c;
      if constexpr (k1d) {  // the columnwise codes take the column scales: scaled first, times 1 is exact
        float g[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) g[k] = f[k] * my_col_scale[k];
        c_t = Fp8x8<E5>(g, 1.0f);
      }
      *reinterpret_cast<uint2*>(tile + r * kCtTile + chunk * 16 + (cv & 1) * 8) = c_t;
    }
  }
  if constexpr (kMode == CtScale::kGiven || kMode == CtScale::kStats) {
    m = WarpMax(m);
    if ((tid & 31) == 0) scratch[tid / 32] = m;
  }
  if constexpr (kDbias) {
    // Lanes l and l + 16 hold rows 2w and 2w + 1 of the same columns.
    const int warp = tid / 32, lane = tid & 31;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float s = dsum[g][k] + __shfl_xor_sync(0xffffffffu, dsum[g][k], 16);
        if (lane < 16) dbias_part[(warp * 2 + g) * kCtTile + lane * 8 + k] = s;
      }
    }
  }
  __syncthreads();
  if constexpr (kMode == CtScale::kGiven || kMode == CtScale::kStats) {
    if (tid == 0 && a.amax_out) {
      uint32_t mm = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mm = max(mm, scratch[w]);
      atomicMax(reinterpret_cast<unsigned int*>(a.amax_out + b), mm);
    }
  }
  if constexpr (kDbias) {
    // One thread per (64-row group, column): the warps' partial sums in order.
    const int g = tid / kCtTile, c = tid % kCtTile;
    const int64_t groups = (a.rows + kDbiasRows - 1) / kDbiasRows, gg = row0 / kDbiasRows + g;
    if (col0 + c < a.cols && gg < groups) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += dbias_part[(w * 2 + g) * kCtTile + c];
      a.dbias_ws[(b * groups + gg) * a.cols + col0 + c] = s;
    }
  }
  if (kMode == CtScale::kStats || a.q_t == nullptr) return;

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

inline ffi::Error CtGrid(CtArgs& a, int64_t batch, dim3* grid) {
  a.tiles_m = static_cast<int>(CeilDiv(a.rows, kCtTile));
  a.tiles_n = static_cast<int>(CeilDiv(a.cols, kCtTile));
  return GridOf(int64_t{a.tiles_m} * a.tiles_n * batch, grid);
}

// The cast-transpose of producer `prod`'s values over a batch of [rows, cols]
// matrices (rows and cols multiples of 16, of 128 for kBlock1d; q, q_t
// 16-byte aligned), with dbias partials when a.dbias_ws is set.
template <class P, bool E5, CtScale kMode>
ffi::Error LaunchCastTranspose(cudaStream_t stream, const P& prod, int64_t batch, CtArgs a) {
  static_assert(kMode != CtScale::kBlock2d, "the fused casts are per-tensor or 1x128 blocks");
  dim3 grid;
  TE_RETURN_IF_ERROR(CtGrid(a, batch, &grid));
  if (a.dbias_ws != nullptr) {
    Fp8CastTransposeKernel<P, E5, kMode, true><<<grid, kCtThreads, 0, stream>>>(prod, a);
  } else {
    Fp8CastTransposeKernel<P, E5, kMode, false><<<grid, kCtThreads, 0, stream>>>(prod, a);
  }
  return LaunchError("Fp8CastTransposeKernel");
}

// The plain quantize of a.x.
template <typename T, bool E5, CtScale kMode>
ffi::Error LaunchFp8CastTranspose(cudaStream_t stream, const MatrixBatch& mb, CtArgs a) {
  a.rows = mb.rows;
  a.cols = mb.cols;
  dim3 grid;
  TE_RETURN_IF_ERROR(CtGrid(a, mb.batch, &grid));
  const PlainInput<T> prod{static_cast<const T*>(a.x), mb.rows, mb.cols};
  Fp8CastTransposeKernel<PlainInput<T>, E5, kMode, false><<<grid, kCtThreads, 0, stream>>>(prod, a);
  return LaunchError("Fp8CastTransposeKernel");
}

// Whether the cast-transpose kernel can take these buffers.
inline bool CastTransposeFits(const MatrixBatch& mb, const void* x, const void* q, const void* q_t) {
  return TileFriendly(mb) && Aligned16(x) && Aligned16(q) && Aligned16(q_t);
}

}  // namespace cuda
}  // namespace te_jax
