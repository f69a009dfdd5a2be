// CPU side of the fused norm/activation handlers: the cast of a float32
// output matrix into the seven cast results (csrc/common/norm_act.h), and a
// pairwise float32 sum. Plain loops over numerics.h, like quantize_cpu.cc.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/norm_act_checks.h"
#include "cpu_common.h"

namespace te_jax {
namespace cpu_fused {

inline float Amax(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, AbsBits(x[i]));
  return BitsFloat(m);
}

// Pairwise float32 sum (halves until 8 elements, then left to right).
inline float PairwiseSum(const float* v, int64_t n) {
  if (n <= 8) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += v[i];
    return s;
  }
  const int64_t h = n / 2;
  return PairwiseSum(v, h) + PairwiseSum(v + h, n - h);
}

// Writes n float32 values at element offset `off` of a float32/bfloat16/float16 buffer.
inline void StoreAt(const ffi::AnyBuffer& out, int64_t off, const float* v, int64_t n) {
  void* p = out.untyped_data();
  switch (out.element_type()) {
    case ffi::DataType::F32:
      std::copy(v, v + n, static_cast<float*>(p) + off);
      break;
    case ffi::DataType::BF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(p)[off + i] = FloatToBf16(v[i]);
      break;
    default:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(p)[off + i] = FloatToHalf(v[i]);
      break;
  }
}

// Block-scaled FP8 (1D blocks along the rows of x [rows, cols]): MXFP8 (E8M0
// codes) or Float8 1x128 (float32 1/scale).
inline void Fp8BlocksRowwise(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, bool mx, bool power_2,
                             uint8_t* q, void* s) {
  const int64_t blk = mx ? kMxfp8Block : kFp8Block;
  const int64_t nb = cols / blk;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t jb = 0; jb < nb; ++jb) {
      const float* xb = x + i * cols + jb * blk;
      const float a = Amax(xb, blk);
      float mult;
      if (mx) {
        const uint8_t code = E8M0FromAmax(a, fmt.max_value);
        static_cast<uint8_t*>(s)[i * nb + jb] = code;
        mult = E8M0InverseToFloat(code);
      } else {
        mult = ScaleFromAmax(a, fmt.max_value, 0.0f, power_2);
        static_cast<float*>(s)[i * nb + jb] = 1.0f / mult;
      }
      for (int64_t k = 0; k < blk; ++k) q[i * cols + jb * blk + k] = FloatToFp8(xb[k] * mult, fmt);
    }
  }
}

// NVFP4 1x16 blocks given the global amax; `seed` non-null: stochastic rounding.
inline void Nvfp4Rowwise(const float* x, int64_t rows, int64_t cols, float global_amax, const uint32_t* seed,
                         uint8_t* q, uint8_t* s) {
  const float s_enc = Nvfp4GlobalEncodeScale(global_amax);
  const float s_dec = 1.0f / s_enc;
  const float factor = s_enc * (1.0f / 6.0f);
  const int64_t nb = cols / kNvfp4Block;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t jb = 0; jb < nb; ++jb) {
      const int64_t base = i * cols + jb * kNvfp4Block;
      const uint8_t sb = Nvfp4BlockScale(Amax(x + base, kNvfp4Block), factor);
      const float enc = Nvfp4BlockEncode(sb, s_dec);
      s[i * nb + jb] = sb;
      for (int64_t k = 0; k < kNvfp4Block; k += 2) {
        uint8_t c[2];
        for (int e = 0; e < 2; ++e) {
          const int64_t idx = base + k + e;
          const float v = x[idx] * enc;
          c[e] = seed ? FloatToE2M1Stochastic(v, RandomBits(*seed, static_cast<uint32_t>(idx))) : FloatToE2M1(v);
        }
        q[(base + k) / 2] = static_cast<uint8_t>(c[0] | (c[1] << 4));
      }
    }
  }
}

// Casts batch element b's float32 output y [rows, cols] into the results.
// `given_scale`: the fp8_tensor scale; key0/key1: the PRNG key words.
inline void CastMatrix(const float* y, int64_t rows, int64_t cols, int64_t b, const CastSpec& sp,
                       float given_scale, uint32_t key0, uint32_t key1, const FusedCastOut& r) {
  const int64_t size = rows * cols;
  const bool row = sp.rowwise, col = sp.colwise;
  if (sp.mode == CastMode::kNone) {
    StoreAt(r.q, b * size, y, size);
    return;
  }
  std::vector<float> yt;
  if (col || sp.rht) yt = Transpose(y, rows, cols);
  if (sp.mode == CastMode::kNvfp4) {
    const uint32_t row_seed = StreamSeed(key0, key1, kRowwiseStream);
    const uint32_t col_seed = StreamSeed(key0, key1, kColwiseStream);
    const float a = Amax(y, size);
    static_cast<float*>(r.amax.untyped_data())[b] = a;
    auto* q = static_cast<uint8_t*>(r.q.untyped_data());
    auto* s = static_cast<uint8_t*>(r.s.untyped_data());
    if (row) Nvfp4Rowwise(y, rows, cols, a, sp.sr ? &row_seed : nullptr, q + b * size / 2, s + b * size / kNvfp4Block);
    if (sp.rht) Rht16Groups(yt.data(), size);
    const float a_t = sp.rht ? Amax(yt.data(), size) : a;
    static_cast<float*>(r.amax_t.untyped_data())[b] = a_t;
    if (col) {
      auto* qt = static_cast<uint8_t*>(r.q_t.untyped_data());
      auto* st = static_cast<uint8_t*>(r.s_t.untyped_data());
      Nvfp4Rowwise(yt.data(), cols, rows, a_t, sp.sr ? &col_seed : nullptr, qt + b * size / 2,
                   st + b * size / kNvfp4Block);
    }
    return;
  }
  const Fp8Format fmt = *Fp8FormatOf(r.q.element_type());
  auto* q = static_cast<uint8_t*>(r.q.untyped_data()) + b * size;
  auto* qt = static_cast<uint8_t*>(r.q_t.untyped_data()) + b * size;
  if (IsPerTensor(sp.mode)) {
    const float a = Amax(y, size);
    const float scale = sp.mode == CastMode::kFp8Tensor ? given_scale
                                                         : ScaleFromAmax(a, fmt.max_value, sp.epsilon, sp.power_2);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const uint8_t c = FloatToFp8(y[i * cols + j] * scale, fmt);
        if (row) q[i * cols + j] = c;
        if (col) qt[j * rows + i] = c;
      }
    }
    static_cast<float*>(r.amax.untyped_data())[b] = a;
    static_cast<float*>(r.s.untyped_data())[b] = 1.0f / scale;
    if (sp.mode == CastMode::kFp8Current) static_cast<float*>(r.scale.untyped_data())[b] = scale;
    return;
  }
  const bool mx = sp.mode == CastMode::kMxfp8;
  const int64_t blk = mx ? kMxfp8Block : kFp8Block;
  const int64_t ssize = mx ? 1 : 4;
  if (row) {
    auto* s = static_cast<uint8_t*>(r.s.untyped_data()) + b * (size / blk) * ssize;
    Fp8BlocksRowwise(y, rows, cols, fmt, mx, sp.power_2, q, s);
  }
  if (col) {
    auto* st = static_cast<uint8_t*>(r.s_t.untyped_data()) + b * (size / blk) * ssize;
    Fp8BlocksRowwise(yt.data(), cols, rows, fmt, mx, sp.power_2, qt, st);
  }
}

}  // namespace cpu_fused
}  // namespace te_jax
