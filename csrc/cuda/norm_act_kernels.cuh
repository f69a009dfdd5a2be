// The cast half of the fused norm/activation CUDA kernels: a tile kernel that
// takes float32 values from a *producer* (the norm, an activation or its
// gradient, computed from the op's inputs on the fly) and writes every copy
// the cast spec asks for, so the high-precision output never goes to HBM.
//
// A producer P provides, for its output matrix [rows, cols] per batch element:
//   using Raw = ...;                                      the 16-byte loads of 8 outputs' inputs
//   Raw Fetch(b, r, c0) const;                            issue them (c0 % 8 == 0)
//   void Compute(const Raw&, b, r, c0, float (&f)[8]) const;  the 8 float32 outputs
//   float Load1(b, r, c) const;                           one output (generic kernels)
//   bool vec_ok;                                          Fetch may be used (widths % 8, alignment)
//
// Tile kernel (vec_ok): a 64x64 tile (128x128 for Float8 1x128 blocks) per
// thread block. Row phase: each thread produces 8-value vectors, writes the
// rowwise copy from registers (block amax by shuffles over adjacent lanes)
// and the values into shared memory. Column phase (columnwise copy, dbias, or
// the Hadamard-transformed amax): thread (column c, segment of rows) reads
// its column from shared memory, and writes 16 codes per 16-byte store.
// Generic kernels (any shape, norm_act_generic.cuh): one thread per block (or
// element) per copy. Per-tensor casts of shapes in 16s, and Float8 1x128
// casts with a columnwise copy of shapes in 128s, take the plain quantize's
// cast-transpose kernel instead (fp8_cast_transpose.cuh).
//
// This header holds the producer contract's device side (the cast arguments,
// the tile geometry, the tile kernel, the dbias reduction);
// norm_act_cast.cuh picks and launches the kernels.
#pragma once

#include <cuda_bf16.h>

#include "cuda_common.cuh"
#include "fp8_cast_transpose.cuh"
#include "../common/norm_act.h"

namespace te_jax {
namespace cuda {
namespace fused {

constexpr int kThreads = 256;

enum TileMode : int { kModeNone = 0, kModeTensor, kModeMx, kModeBlock, kModeNv, kModeStats };

template <int kMode>
struct TileGeom {
  static constexpr int kTM = kMode == kModeBlock ? 128 : 64;
  static constexpr int kTN = kMode == kModeBlock ? 128 : 64;
  static constexpr int kSegRows = kTM * kTN / kThreads;  // rows per thread in the column phase
  static constexpr int kSegs = kTM / kSegRows;
  static constexpr int kVpt = kTM * kTN / 8 / kThreads;  // row-phase vectors per thread
  static constexpr int kBlk =
      static_cast<int>(kMode == kModeMx ? kMxfp8Block : (kMode == kModeBlock ? kFp8Block : kNvfp4Block));
};

struct CastArgs {
  int64_t rows = 0, cols = 0;  // the produced matrix, per batch element
  int tiles_m = 0, tiles_n = 0;
  bool e5 = false;
  int out_type = 0;  // kModeNone: 0 float32, 1 bfloat16, 2 float16
  // per-tensor FP8
  const float* scale_in = nullptr;  // given scale [B]; nullptr: current scaling from amax_in
  float epsilon = 0.0f;
  bool power_2 = false;             // also Float8 blocks
  float* amax_out = nullptr;        // given scale: atomicMax of the output's amax [B] (zeroed)
  float* scale_out = nullptr;       // current scaling: the scale [B]
  float* scale_inv_out = nullptr;   // per-tensor: 1/scale [B]
  // NVFP4 (and current scaling: amax_in)
  const float* amax_in = nullptr;   // [B]
  const float* amax_t_in = nullptr; // [B]
  const uint32_t* key = nullptr;    // [B, 2]; nullptr: round to nearest
  bool rht = false;
  // outputs (nullptr when not requested)
  void* q = nullptr;
  void* s = nullptr;
  void* q_t = nullptr;
  void* s_t = nullptr;
  // kModeStats: atomicMax targets (zeroed); amax_t_acc only with rht
  float* amax_acc = nullptr;
  float* amax_t_acc = nullptr;
  // dbias partial column sums [B, ceil(rows / 64), cols], or nullptr
  float* dbias_ws = nullptr;
};


__device__ __forceinline__ float BitsToF(uint32_t m) { return BitsFloat(m); }

__device__ __forceinline__ uint32_t Fp8Code(float v, bool e5) {
  return e5 ? (Fp8x2<true>(v, 0.0f) & 0xffu) : (Fp8x2<false>(v, 0.0f) & 0xffu);
}

__device__ __forceinline__ uint2 Fp8Codes8(const float (&f)[8], float mult, bool e5) {
  return e5 ? Fp8x8<true>(f, mult) : Fp8x8<false>(f, mult);
}

__device__ __forceinline__ uint16_t Bf16Bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ uint16_t HalfBits(float v) { return __half_as_ushort(__float2half_rn(v)); }

// Stores 8 float32 values at element `idx` of an unquantized output.
__device__ __forceinline__ void StoreOut8(void* out, int64_t idx, const float (&f)[8], int out_type) {
  if (out_type == 0) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(out) + idx);
    p[0] = make_float4(f[0], f[1], f[2], f[3]);
    p[1] = make_float4(f[4], f[5], f[6], f[7]);
    return;
  }
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t lo = out_type == 1 ? Bf16Bits(f[2 * k]) : HalfBits(f[2 * k]);
    const uint32_t hi = out_type == 1 ? Bf16Bits(f[2 * k + 1]) : HalfBits(f[2 * k + 1]);
    w[k] = lo | (hi << 16);
  }
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + idx) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void StoreOut1(void* out, int64_t idx, float v, int out_type) {
  if (out_type == 0) {
    static_cast<float*>(out)[idx] = v;
  } else {
    static_cast<uint16_t*>(out)[idx] = out_type == 1 ? Bf16Bits(v) : HalfBits(v);
  }
}

// Per-batch-element constants of the cast.
struct BatchCtx {
  float scale = 1.0f;   // per-tensor scale
  float s_dec = 1.0f;   // NVFP4 rowwise: 1 / S_enc
  float factor = 1.0f;  // NVFP4 rowwise: S_enc / 6
  float s_dec_t = 1.0f; // NVFP4 columnwise
  float factor_t = 1.0f;
  uint32_t seed = 0, seed_t = 0;
};

// Computes the batch constants; the caller that passes `write` stores the
// per-tensor scale outputs.
__device__ __forceinline__ BatchCtx MakeCtx(const CastArgs& a, int mode, int64_t b, bool write) {
  BatchCtx c;
  if (mode == kModeTensor) {
    const float fmax = a.e5 ? kE5M2Max : kE4M3Max;
    c.scale = a.scale_in ? a.scale_in[b] : ScaleFromAmax(a.amax_in[b], fmax, a.epsilon, a.power_2);
    if (write) {
      if (a.scale_inv_out) a.scale_inv_out[b] = 1.0f / c.scale;
      if (a.scale_out) a.scale_out[b] = c.scale;
    }
  } else if (mode == kModeNv) {
    const float e = Nvfp4GlobalEncodeScale(a.amax_in[b]);
    c.s_dec = 1.0f / e;
    c.factor = e * (1.0f / 6.0f);
    const float et = Nvfp4GlobalEncodeScale(a.amax_t_in[b]);
    c.s_dec_t = 1.0f / et;
    c.factor_t = et * (1.0f / 6.0f);
    if (a.key) {
      c.seed = StreamSeed(a.key[2 * b], a.key[2 * b + 1], kRowwiseStream);
      c.seed_t = StreamSeed(a.key[2 * b], a.key[2 * b + 1], kColwiseStream);
    }
  }
  return c;
}

// E2M1 code of v (nearest or stochastic).
__device__ __forceinline__ uint32_t E2M1Code(float v, bool sr, uint32_t seed, uint32_t index) {
  return sr ? FloatToE2M1Stochastic(v, RandomBits(seed, index)) : FloatToE2M1(v);
}

// ---- the row phase: 8 consecutive values of one row -------------------------------------

// Writes the rowwise copy of f = outputs (b, r, c0..c0+7) (kModeStats: nothing).
// Every lane of the warp must call it (block amaxes are shuffles over adjacent
// lanes); `valid` says whether these 8 outputs exist (else f becomes zeros).
// Returns the amax bits of f.
template <int kMode>
__device__ __forceinline__ uint32_t RowCast8(const CastArgs& a, const BatchCtx& ctx, int64_t b, int64_t r,
                                             int64_t c0, bool valid, float (&f)[8]) {
  if (!valid) {
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = 0.0f;
  }
  const uint32_t m8 = AbsMaxBits8(f);
  const int64_t idx = (b * a.rows + r) * a.cols + c0;
  if constexpr (kMode == kModeNone) {
    if (valid) StoreOut8(a.q, idx, f, a.out_type);
  } else if constexpr (kMode == kModeTensor) {
    if (valid && a.q) *reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.q) + idx) = Fp8Codes8(f, ctx.scale, a.e5);
  } else if constexpr (kMode == kModeMx || kMode == kModeBlock) {
    constexpr int kBlk = TileGeom<kMode>::kBlk;
    const uint32_t m = GroupMax<kBlk / 8>(m8);
    if (a.q) {
      const float fmax = a.e5 ? kE5M2Max : kE4M3Max;
      const int64_t sidx = (b * a.rows + r) * (a.cols / kBlk) + c0 / kBlk;
      const bool first = (c0 % kBlk) == 0;
      float mult;
      if constexpr (kMode == kModeMx) {
        const uint8_t code = E8M0FromAmax(BitsToF(m), fmax);
        if (valid && first) static_cast<uint8_t*>(a.s)[sidx] = code;
        mult = E8M0InverseToFloat(code);
      } else {
        mult = ScaleFromAmax(BitsToF(m), fmax, 0.0f, a.power_2);
        if (valid && first) static_cast<float*>(a.s)[sidx] = 1.0f / mult;
      }
      if (valid) *reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.q) + idx) = Fp8Codes8(f, mult, a.e5);
    }
  } else if constexpr (kMode == kModeNv) {
    const uint32_t m = GroupMax<2>(m8);
    if (a.q) {
      const uint8_t sb = Nvfp4BlockScale(BitsToF(m), ctx.factor);
      const float enc = Nvfp4BlockEncode(sb, ctx.s_dec);
      uint32_t w = 0;
      const uint32_t i0 = static_cast<uint32_t>(r * a.cols + c0);
#pragma unroll
      for (int k = 0; k < 8; ++k) w |= E2M1Code(f[k] * enc, a.key != nullptr, ctx.seed, i0 + k) << (4 * k);
      if (valid) {
        *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(a.q) + idx / 2) = w;
        if (c0 % 16 == 0) static_cast<uint8_t*>(a.s)[(b * a.rows + r) * (a.cols / 16) + c0 / 16] = sb;
      }
    }
  }
  return m8;
}

// Block-wide max of amax bits folded into *out (all threads call it).
__device__ __forceinline__ void BlockMaxToGlobal(uint32_t m, uint32_t* scratch, float* out) {
  BlockAmaxAtomic<kThreads>(m, scratch, out);
}

// ---- column phase helpers ---------------------------------------------------------------

// Writes n (<= 16) FP8 codes (byte k of w = code k) at p: one 16-byte store
// when all 16 are there and p is aligned, else bytes.
__device__ __forceinline__ void StoreCodes16(uint8_t* p, const uint32_t (&w)[4], int n) {
  if (n == 16 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    if (k < n) p[k] = static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4)));
  }
}

// ---- the tile kernel --------------------------------------------------------------------

// Whether the column phase runs (and the tile goes to shared memory).
inline bool NeedsColumnPhase(const CastArgs& a) {
  return a.q_t != nullptr || a.dbias_ws != nullptr || (a.rht && a.amax_t_acc != nullptr);
}

template <int kMode>
inline int TileSmemBytes(const CastArgs& a) {
  using G = TileGeom<kMode>;
  if (!NeedsColumnPhase(a)) return 0;
  const int dbias_floats = a.dbias_ws ? kDbiasPairs * (G::kTM / kDbiasRows) * G::kTN : 0;
  return (G::kTM * G::kTN + G::kSegs * G::kTN + dbias_floats) * static_cast<int>(sizeof(float));
}

template <class P, int kMode>
__global__ void __launch_bounds__(kThreads) CastTileKernel(P prod, CastArgs a) {
  using G = TileGeom<kMode>;
  constexpr int kTM = G::kTM, kTN = G::kTN, kVpt = G::kVpt, kVecPerRow = kTN / 8;
  constexpr int kBatchVecs = kVpt < 4 ? kVpt : 4;
  extern __shared__ float smem[];
  __shared__ uint32_t scratch[kThreads / 32];
  const int tid = threadIdx.x;
  const int64_t tiles = int64_t{a.tiles_m} * a.tiles_n;
  const int64_t b = blockIdx.x / tiles;
  const int t_in = static_cast<int>(blockIdx.x % tiles);
  const int64_t row0 = int64_t{t_in / a.tiles_n} * kTM, col0 = int64_t{t_in % a.tiles_n} * kTN;
  const bool col_phase = a.q_t != nullptr || a.dbias_ws != nullptr || (a.rht && a.amax_t_acc != nullptr);
  const BatchCtx ctx = MakeCtx(a, kMode, b, t_in == 0 && tid == 0);

  // Row phase.
  uint32_t amax_bits = 0;
#pragma unroll
  for (int i0 = 0; i0 < kVpt; i0 += kBatchVecs) {
    typename P::Raw raw[kBatchVecs];
#pragma unroll
    for (int i = 0; i < kBatchVecs; ++i) {
      const int v = tid + kThreads * (i0 + i), r = v / kVecPerRow, cv = v % kVecPerRow;
      const int64_t gr = row0 + r, gc = col0 + cv * 8;
      if (gr < a.rows && gc < a.cols) raw[i] = prod.Fetch(b, gr, gc);
    }
#pragma unroll
    for (int i = 0; i < kBatchVecs; ++i) {
      const int v = tid + kThreads * (i0 + i), r = v / kVecPerRow, cv = v % kVecPerRow;
      const int64_t gr = row0 + r, gc = col0 + cv * 8;
      const bool valid = gr < a.rows && gc < a.cols;
      float f[8];
      if (valid) prod.Compute(raw[i], b, gr, gc, f);
      const uint32_t m = RowCast8<kMode>(a, ctx, b, gr, gc, valid, f);
      amax_bits = max(amax_bits, m);
      if (col_phase) {
        float4* p = reinterpret_cast<float4*>(smem + r * kTN + cv * 8);
        p[0] = make_float4(f[0], f[1], f[2], f[3]);
        p[1] = make_float4(f[4], f[5], f[6], f[7]);
      }
    }
  }
  if constexpr (kMode == kModeStats) {
    if (a.amax_acc) BlockMaxToGlobal(amax_bits, scratch, a.amax_acc + b);
  } else if constexpr (kMode == kModeTensor) {
    if (a.amax_out) BlockMaxToGlobal(amax_bits, scratch, a.amax_out + b);
  }
  if (!col_phase) return;
  __syncthreads();

  // Column phase: thread (c, seg) owns rows seg*kSegRows.. of column c.
  constexpr int kSegRows = G::kSegRows, kSegs = G::kSegs;
  float* part = smem + kTM * kTN;   // [kSegs][kTN]: per-segment amax (as bits)
  float* pairs = part + kSegs * kTN;  // dbias: [kTM / kDbiasRows][kDbiasPairs][kTN], the S_w of fp8_cast_transpose.cuh
  const int c = tid % kTN, seg = tid / kTN;
  const int64_t gc = col0 + c;
  const int64_t gr0 = row0 + seg * kSegRows;
  const bool valid_c = gc < a.cols;
  const float* col = smem + seg * kSegRows * kTN + c;  // element i at col[i * kTN]

  if (a.dbias_ws) {
    constexpr int kItems = (kTM / kDbiasRows) * kDbiasPairs * kTN;
    for (int it = tid; it < kItems; it += kThreads) {
      const int cc = it % kTN, w = (it / kTN) % kDbiasPairs, g = it / (kTN * kDbiasPairs);
      const float* y = smem + g * kDbiasRows * kTN + cc;
      float s2[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int a0 = 2 * w + h;
        s2[h] = (((0.0f + y[a0 * kTN]) + y[(a0 + 16) * kTN]) + y[(a0 + 32) * kTN]) + y[(a0 + 48) * kTN];
      }
      pairs[it] = s2[0] + s2[1];
    }
  }

  if constexpr (kMode == kModeStats) {
    // Amax of the Hadamard-transformed columnwise copy (16-row groups).
    uint32_t m = 0;
    if (a.rht && a.amax_t_acc) {
      for (int i0 = 0; i0 < kSegRows; i0 += 16) {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = col[(i0 + i) * kTN];
        Rht16(v);
#pragma unroll
        for (int i = 0; i < 16; ++i) m = max(m, AbsBits(v[i]));
      }
    }
    if (a.rht && a.amax_t_acc) BlockMaxToGlobal(m, scratch, a.amax_t_acc + b);
  } else if constexpr (kMode == kModeTensor) {
    if (a.q_t && valid_c) {
      uint8_t* qt = static_cast<uint8_t*>(a.q_t) + (b * a.cols + gc) * a.rows;
      for (int i0 = 0; i0 < kSegRows; i0 += 16) {
        const int64_t r = gr0 + i0;
        if (r >= a.rows) break;
        uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i / 4] |= Fp8Code(col[(i0 + i) * kTN] * ctx.scale, a.e5) << (8 * (i % 4));
        StoreCodes16(qt + r, w, static_cast<int>(a.rows - r < 16 ? a.rows - r : 16));
      }
    }
  } else if constexpr (kMode == kModeMx || kMode == kModeBlock) {
    constexpr int kBlk = G::kBlk;
    constexpr int kSegPerBlk = kBlk / kSegRows;  // 2: a block spans two segments
    static_assert(kSegPerBlk == 2, "column blocks span two segments");
    uint32_t m = 0;
    if (a.q_t) {
      for (int i = 0; i < kSegRows; ++i) m = max(m, AbsBits(col[i * kTN]));
      reinterpret_cast<uint32_t*>(part)[seg * kTN + c] = m;
    }
    __syncthreads();
    if (a.q_t && valid_c && gr0 < a.rows) {
      const int s0 = seg & ~1;
      m = max(reinterpret_cast<uint32_t*>(part)[s0 * kTN + c], reinterpret_cast<uint32_t*>(part)[(s0 + 1) * kTN + c]);
      const float fmax = a.e5 ? kE5M2Max : kE4M3Max;
      const int64_t sidx = (b * a.cols + gc) * (a.rows / kBlk) + gr0 / kBlk;
      float mult;
      if constexpr (kMode == kModeMx) {
        const uint8_t code = E8M0FromAmax(BitsToF(m), fmax);
        if ((seg & 1) == 0) static_cast<uint8_t*>(a.s_t)[sidx] = code;
        mult = E8M0InverseToFloat(code);
      } else {
        mult = ScaleFromAmax(BitsToF(m), fmax, 0.0f, a.power_2);
        if ((seg & 1) == 0) static_cast<float*>(a.s_t)[sidx] = 1.0f / mult;
      }
      uint8_t* qt = static_cast<uint8_t*>(a.q_t) + (b * a.cols + gc) * a.rows;
      for (int i0 = 0; i0 < kSegRows; i0 += 16) {
        uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i / 4] |= Fp8Code(col[(i0 + i) * kTN] * mult, a.e5) << (8 * (i % 4));
        StoreCodes16(qt + gr0 + i0, w, 16);
      }
    }
  } else if constexpr (kMode == kModeNv) {
    static_assert(kSegRows == 16, "an NVFP4 column block is one segment");
    if (a.q_t && valid_c && gr0 < a.rows) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = col[i * kTN];
      if (a.rht) Rht16(v);
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, AbsBits(v[i]));
      const uint8_t sb = Nvfp4BlockScale(BitsToF(m), ctx.factor_t);
      const float enc = Nvfp4BlockEncode(sb, ctx.s_dec_t);
      const uint32_t i0 = static_cast<uint32_t>(gc * a.rows + gr0);
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int i = 0; i < 16; ++i) w[i / 8] |= E2M1Code(v[i] * enc, a.key != nullptr, ctx.seed_t, i0 + i) << (4 * (i % 8));
      const int64_t off = ((b * a.cols + gc) * a.rows + gr0) / 2;
      *reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.q_t) + off) = make_uint2(w[0], w[1]);
      static_cast<uint8_t*>(a.s_t)[(b * a.cols + gc) * (a.rows / 16) + gr0 / 16] = sb;
    }
  }

  if (a.dbias_ws) {
    __syncthreads();
    // One thread per (column, 64-row group): the S_w in order.
    constexpr int kGroupsPerTile = kTM / kDbiasRows;
    const int64_t groups = (a.rows + kDbiasRows - 1) / kDbiasRows;
    for (int it = tid; it < kTN * kGroupsPerTile; it += kThreads) {
      const int cc = it % kTN, g = it / kTN;
      const int64_t gg = row0 / kDbiasRows + g;
      if (col0 + cc >= a.cols || gg >= groups) continue;
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kDbiasPairs; ++w) sum += pairs[(g * kDbiasPairs + w) * kTN + cc];
      a.dbias_ws[(b * groups + gg) * a.cols + col0 + cc] = sum;
    }
  }
}

// dbias[b, c] = sum over the groups of the partials, in order.
static __global__ void __launch_bounds__(kThreads) DbiasReduceKernel(const float* ws, int64_t groups, int64_t cols,
                                                               int64_t batch, float* out) {
  const int64_t id = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (id >= batch * cols) return;
  const int64_t b = id / cols, c = id % cols;
  float sum = 0.0f;
  for (int64_t g = 0; g < groups; ++g) sum += ws[(b * groups + g) * cols + c];
  out[id] = sum;
}

}  // namespace fused
}  // namespace cuda
}  // namespace te_jax
