// What the CPU GEMM handlers share (dense: gemm_cpu.cc, grouped: grouped_gemm_cpu.cc):
// the checks every target runs, dequantizing an operand to float32 with the
// mode's numerics (numerics.h, the twin of te_jax/quantize/reference.py) and
// the float32 matrix product.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "../common/ffi_common.h"
#include "cpu_common.h"

namespace te_jax {
namespace gemm_cpu {

inline ffi::Error Fail(std::string_view target, const std::string& msg) {
  return InvalidArgument("te_jax: " + std::string(target) + ": " + msg);
}

inline ffi::Error CheckDtype(std::string_view target, const ffi::AnyBuffer& x, ffi::DataType t,
                             std::string_view name, std::string_view want) {
  if (x.element_type() != t) return Fail(target, std::string(name) + " must be " + std::string(want));
  return ffi::Error::Success();
}

// Block scales of an operand `data` [..., R, K/pack]: [..., R/row_block, K/k_block].
ffi::Error CheckBlockScales(std::string_view target, const ffi::AnyBuffer& s, std::string_view name,
                            const ffi::AnyBuffer& data, int64_t k, int64_t row_block, int64_t k_block);

// FP8 operand formats; E5M2 x E5M2 has no tensor-core kernel and is refused.
ffi::Error Fp8Pair(std::string_view target, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, Fp8Format* fa,
                   Fp8Format* fb);

// The row-major [rows, k] float32 values of an operand: value_at(r, c).
template <typename ValueAt>
std::vector<float> Dequantize(int64_t rows, int64_t k, ValueAt value_at) {
  std::vector<float> v(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) v[r * k + c] = value_at(r, c);
  return v;
}

// value = fp8 * (per-block scale), shared by Float8 block scaling and MXFP8: scale_at(index of the block).
template <typename ScaleAt>
std::vector<float> DequantizeFp8Blocks(const ffi::AnyBuffer& q, Fp8Format fmt, int64_t rows, int64_t k,
                                       int64_t row_block, int64_t k_block, ScaleAt scale_at) {
  const auto* qd = static_cast<const uint8_t*>(q.untyped_data());
  const int64_t kb = k / k_block;
  return Dequantize(rows, k, [&](int64_t r, int64_t c) {
    return Fp8ToFloat(qd[r * k + c], fmt) * scale_at((r / row_block) * kb + c / k_block);
  });
}

// An NVFP4 value before its global scale: e2m1 * s_b (codes packed two per byte, low nibble first).
inline float Nvfp4BlockValue(const uint8_t* q, const uint8_t* s, int64_t r, int64_t c, int64_t k) {
  const int64_t idx = r * k + c;
  const uint8_t code = (idx & 1) ? (q[idx / 2] >> 4) : (q[idx / 2] & 0xf);
  return E2M1ToFloat(code) * Fp8ToFloat(s[r * (k / kNvfp4Block) + c / kNvfp4Block], kE4M3);
}

// c[m, n] = sum_k a[m, k] * b[n, k] in float32.
void MatMulNT(const float* a, const float* b, int64_t m, int64_t n, int64_t k, float* c);

}  // namespace gemm_cpu
}  // namespace te_jax
