// Host-side helpers for the CPU handlers: loading inputs as float32 and
// storing float32 results in the output dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/ffi_common.h"

namespace te_jax {

inline float HalfToFloat(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, sizeof(v));
  return static_cast<float>(v);
}

inline uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if (IsNanF(f)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline uint16_t FloatToHalf(float f) {
  const _Float16 v = static_cast<_Float16>(f);  // round to nearest even
  uint16_t h;
  std::memcpy(&h, &v, sizeof(h));
  return h;
}

// The whole buffer as float32 (exact for every supported input dtype).
inline std::vector<float> ToFloat(const ffi::AnyBuffer& x) {
  const size_t n = x.element_count();
  std::vector<float> out(n);
  const void* p = x.untyped_data();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      std::memcpy(out.data(), p, n * sizeof(float));
      break;
    case ffi::DataType::BF16:
      for (size_t i = 0; i < n; ++i) out[i] = BitsFloat(uint32_t{static_cast<const uint16_t*>(p)[i]} << 16);
      break;
    default:  // F16; callers check the dtype first
      for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(static_cast<const uint16_t*>(p)[i]);
      break;
  }
  return out;
}

// Writes float32 values into a float32/bfloat16/float16 buffer.
inline void StoreFloat(const std::vector<float>& values, ffi::AnyBuffer out) {
  void* p = out.untyped_data();
  const size_t n = values.size();
  switch (out.element_type()) {
    case ffi::DataType::F32:
      std::memcpy(p, values.data(), n * sizeof(float));
      break;
    case ffi::DataType::BF16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(p)[i] = FloatToBf16(values[i]);
      break;
    default:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(p)[i] = FloatToHalf(values[i]);
      break;
  }
}

inline std::vector<float> Transpose(const float* x, int64_t rows, int64_t cols) {
  std::vector<float> t(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = x[i * cols + j];
  return t;
}

}  // namespace te_jax
