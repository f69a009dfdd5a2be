// CPU FFI handlers that turn every quantized layout back into float values.
#include <cstdint>
#include <vector>

#include "../common/bindings.h"
#include "../common/quantize_checks.h"
#include "cpu_common.h"

namespace te_jax {
namespace {

ffi::Error DequantizeFp8Tensor(ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  auto c = CheckDequantizeFp8Tensor(q, scale_inv, *out);
  if (c.has_error()) return c.error();
  const MatrixBatch mb = c.value().mb;
  const Fp8Format fmt = c.value().fmt;
  const int64_t size = mb.rows * mb.cols;
  const auto* qd = static_cast<const uint8_t*>(q.untyped_data());
  std::vector<float> v(static_cast<size_t>(mb.batch * size));
  for (int64_t i = 0; i < mb.batch * size; ++i) v[i] = Fp8ToFloat(qd[i], fmt) * scale_inv.typed_data()[i / size];
  StoreFloat(v, *out);
  return ffi::Error::Success();
}

// Shared by MXFP8 and Float8 block scaling: value = fp8 * block_scale(i, j).
template <typename ScaleAt>
ffi::Error DequantizeFp8Blocks(ffi::AnyBuffer q, int64_t scale_elements,
                               ffi::Result<ffi::AnyBuffer> out, int64_t block_rows, int64_t block_cols,
                               ScaleAt scale_at) {
  auto c = CheckDequantizeFp8Blocks(q, scale_elements, *out, block_rows, block_cols);
  if (c.has_error()) return c.error();
  const MatrixBatch mb = c.value().mb;
  const Fp8Format fmt = c.value().fmt;
  const int64_t per = (mb.rows / block_rows) * (mb.cols / block_cols);
  const auto* qd = static_cast<const uint8_t*>(q.untyped_data());
  const int64_t size = mb.rows * mb.cols;
  std::vector<float> v(static_cast<size_t>(mb.batch * size));
  for (int64_t b = 0; b < mb.batch; ++b)
    for (int64_t i = 0; i < mb.rows; ++i)
      for (int64_t j = 0; j < mb.cols; ++j) {
        const int64_t idx = b * size + i * mb.cols + j;
        const int64_t sidx = b * per + (i / block_rows) * (mb.cols / block_cols) + j / block_cols;
        v[idx] = Fp8ToFloat(qd[idx], fmt) * scale_at(sidx);
      }
  StoreFloat(v, *out);
  return ffi::Error::Success();
}

ffi::Error DequantizeMxfp8(ffi::AnyBuffer q, ffi::Buffer<ffi::U8> s, ffi::Result<ffi::AnyBuffer> out) {
  const uint8_t* sd = s.typed_data();
  return DequantizeFp8Blocks(q, s.element_count(), out, 1, kMxfp8Block,
                             [sd](int64_t k) { return E8M0ToFloat(sd[k]); });
}

ffi::Error DequantizeFp8Block(ffi::AnyBuffer q, ffi::Buffer<ffi::F32> s, ffi::Result<ffi::AnyBuffer> out,
                              bool block_2d) {
  const float* sd = s.typed_data();
  return DequantizeFp8Blocks(q, s.element_count(), out, block_2d ? kFp8Block : 1, kFp8Block,
                             [sd](int64_t k) { return sd[k]; });
}

ffi::Error DequantizeNvfp4(ffi::Buffer<ffi::U8> q, ffi::AnyBuffer s, ffi::Buffer<ffi::F32> amax,
                           ffi::Result<ffi::AnyBuffer> out) {
  auto mb_or = CheckDequantizeNvfp4(q, s, amax, *out);
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  const int64_t size = mb.rows * mb.cols;
  const auto* qd = q.typed_data();
  const auto* sd = static_cast<const uint8_t*>(s.untyped_data());
  std::vector<float> v(static_cast<size_t>(mb.batch * size));
  for (int64_t b = 0; b < mb.batch; ++b) {
    const float s_dec = 1.0f / Nvfp4GlobalEncodeScale(amax.typed_data()[b]);
    for (int64_t k = 0; k < size; ++k) {
      const int64_t idx = b * size + k;
      const uint8_t byte = qd[idx / 2];
      const uint8_t code = (idx & 1) ? (byte >> 4) : (byte & 0xf);
      v[idx] = (E2M1ToFloat(code) * Fp8ToFloat(sd[idx / kNvfp4Block], kE4M3)) * s_dec;
    }
  }
  StoreFloat(v, *out);
  return ffi::Error::Success();
}

}  // namespace

TE_JAX_CPU_HANDLER(DequantizeFp8Tensor, DequantizeFp8Tensor);
TE_JAX_CPU_HANDLER(DequantizeMxfp8, DequantizeMxfp8);
TE_JAX_CPU_HANDLER(DequantizeFp8Block, DequantizeFp8Block);
TE_JAX_CPU_HANDLER(DequantizeNvfp4, DequantizeNvfp4);

}  // namespace te_jax
