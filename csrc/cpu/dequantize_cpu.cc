// CPU FFI handlers that turn every quantized layout back into float values.
#include <cstdint>
#include <vector>

#include "../common/bindings.h"
#include "../common/ffi_common.h"
#include "cpu_common.h"

namespace te_jax {
namespace {

template <typename BufferT>
ffi::Error CheckDequantOutput(const BufferT& data, int64_t cols_per_byte, const ffi::AnyBuffer& out,
                              MatrixBatch* mb) {
  auto mb_or = MatrixBatchOf(data, "data");
  if (mb_or.has_error()) return mb_or.error();
  *mb = mb_or.value();
  mb->cols *= cols_per_byte;
  TE_RETURN_IF_ERROR(CheckHighPrecision(out, "the output"));
  return CheckOutput(out, "out", true, mb->batch, mb->rows, mb->cols);
}

ffi::Error DequantizeFp8Tensor(ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  MatrixBatch mb{};
  TE_RETURN_IF_ERROR(CheckDequantOutput(q, 1, *out, &mb));
  auto fmt = Fp8FormatOf(q.element_type());
  if (!fmt) return InvalidArgument("data must be float8_e4m3fn or float8_e5m2");
  if (static_cast<int64_t>(scale_inv.element_count()) != mb.batch) return InvalidArgument("scale_inv must be [..., 1]");
  const int64_t size = mb.rows * mb.cols;
  const auto* qd = static_cast<const uint8_t*>(q.untyped_data());
  std::vector<float> v(static_cast<size_t>(mb.batch * size));
  for (int64_t i = 0; i < mb.batch * size; ++i) v[i] = Fp8ToFloat(qd[i], *fmt) * scale_inv.typed_data()[i / size];
  StoreFloat(v, *out);
  return ffi::Error::Success();
}

// Shared by MXFP8 and Float8 block scaling: value = fp8 * block_scale(i, j).
template <typename ScaleAt>
ffi::Error DequantizeFp8Blocks(ffi::AnyBuffer q, int64_t scale_elements,
                               ffi::Result<ffi::AnyBuffer> out, int64_t block_rows, int64_t block_cols,
                               ScaleAt scale_at) {
  MatrixBatch mb{};
  TE_RETURN_IF_ERROR(CheckDequantOutput(q, 1, *out, &mb));
  auto fmt = Fp8FormatOf(q.element_type());
  if (!fmt) return InvalidArgument("data must be float8_e4m3fn or float8_e5m2");
  TE_RETURN_IF_ERROR(CheckDivisible(mb.cols, block_cols, "the last axis (N)"));
  TE_RETURN_IF_ERROR(CheckDivisible(mb.rows, block_rows, "the row axis (M)"));
  const int64_t per = (mb.rows / block_rows) * (mb.cols / block_cols);
  if (scale_elements != mb.batch * per) return InvalidArgument("scales do not match the data's block layout");
  const auto* qd = static_cast<const uint8_t*>(q.untyped_data());
  const int64_t size = mb.rows * mb.cols;
  std::vector<float> v(static_cast<size_t>(mb.batch * size));
  for (int64_t b = 0; b < mb.batch; ++b)
    for (int64_t i = 0; i < mb.rows; ++i)
      for (int64_t j = 0; j < mb.cols; ++j) {
        const int64_t idx = b * size + i * mb.cols + j;
        const int64_t sidx = b * per + (i / block_rows) * (mb.cols / block_cols) + j / block_cols;
        v[idx] = Fp8ToFloat(qd[idx], *fmt) * scale_at(sidx);
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
  MatrixBatch mb{};
  TE_RETURN_IF_ERROR(CheckDequantOutput(q, 2, *out, &mb));
  if (s.element_type() != ffi::DataType::F8E4M3FN) return InvalidArgument("NVFP4 block scales must be float8_e4m3fn");
  TE_RETURN_IF_ERROR(CheckDivisible(mb.cols, kNvfp4Block, "the last axis (N)"));
  TE_RETURN_IF_ERROR(CheckOutput(s, "s", true, mb.batch, mb.rows, mb.cols / kNvfp4Block));
  if (static_cast<int64_t>(amax.element_count()) != mb.batch) return InvalidArgument("amax must be [..., 1]");
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeFp8TensorCpu, DequantizeFp8Tensor,
                              BindDequantizeFp8Tensor(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeMxfp8Cpu, DequantizeMxfp8, BindDequantizeMxfp8(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeFp8BlockCpu, DequantizeFp8Block,
                              BindDequantizeFp8Block(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeNvfp4Cpu, DequantizeNvfp4, BindDequantizeNvfp4(ffi::Ffi::Bind()));

}  // namespace te_jax
