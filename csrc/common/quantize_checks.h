// The operand checks of the quantize and dequantize targets, shared by their
// CPU and CUDA handlers (the same contract, the same errors). Each checks
// every buffer and returns what the kernels need; what is platform-specific
// (alignment, empty batches, launches) stays with the handler.
#pragma once

#include <cstdint>
#include <string>

#include "ffi_common.h"

namespace te_jax {

// The input's matrix batch and the FP8 format of its quantized outputs.
struct Fp8Cast {
  MatrixBatch mb;
  Fp8Format fmt;
};

// ---- quantize ---------------------------------------------------------------

// x [B..., M, N] in high precision, and FP8 outputs q [B..., M, N] (when
// rowwise) and q_t [B..., N, M] (when colwise) of one FP8 dtype.
inline ffi::ErrorOr<Fp8Cast> CheckFp8Cast(const ffi::AnyBuffer& x, const ffi::AnyBuffer& q,
                                          const ffi::AnyBuffer& q_t, bool rowwise, bool colwise) {
  TE_RETURN_IF_ERROR_OR(CheckHighPrecision(x, "x"));
  auto mb = MatrixBatchOf(x, "x");
  if (mb.has_error()) return ffi::Unexpected(mb.error());
  auto f = Fp8FormatOf(q.element_type());
  if (!f || q_t.element_type() != q.element_type()) {
    return ffi::Unexpected(InvalidArgument("quantized outputs must both be float8_e4m3fn or float8_e5m2"));
  }
  const MatrixBatch& m = mb.value();
  TE_RETURN_IF_ERROR_OR(CheckOutput(q, "q", rowwise, m.batch, m.rows, m.cols));
  TE_RETURN_IF_ERROR_OR(CheckOutput(q_t, "q_t", colwise, m.batch, m.cols, m.rows));
  return Fp8Cast{m, *f};
}

// The block-divisibility a block-scaled copy needs: N for the rowwise copy,
// M for the columnwise one, both for 2D blocks.
inline ffi::Error CheckBlockExtents(const MatrixBatch& mb, int64_t block, bool rowwise, bool colwise,
                                    bool block_2d) {
  if (rowwise || block_2d) TE_RETURN_IF_ERROR(CheckDivisible(mb.cols, block, "the last axis (N)"));
  if (colwise || block_2d) TE_RETURN_IF_ERROR(CheckDivisible(mb.rows, block, "the row axis (M)"));
  return ffi::Error::Success();
}

// te_jax_quantize_fp8: a given scale, one per matrix.
inline ffi::ErrorOr<Fp8Cast> CheckQuantizeFp8Tensor(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& scale,
                                                    const ffi::AnyBuffer& q, const ffi::AnyBuffer& q_t,
                                                    bool rowwise, bool colwise) {
  auto c = CheckFp8Cast(x, q, q_t, rowwise, colwise);
  if (c.has_value() && static_cast<int64_t>(scale.element_count()) != c.value().mb.batch) {
    return ffi::Unexpected(InvalidArgument("scale must hold one value per matrix"));
  }
  return c;
}

// te_jax_quantize_mxfp8 (1 x kBlock blocks) and te_jax_quantize_fp8_block
// (block_rows 1 or kBlock): scales [B..., M/block_rows, N/kBlock] and, for
// the columnwise copy, [B..., N/block_rows, M/kBlock].
template <typename ScaleBuffer>
ffi::ErrorOr<Fp8Cast> CheckQuantizeFp8Blocks(const ffi::AnyBuffer& x, const ffi::AnyBuffer& q, const ScaleBuffer& s,
                                             const ffi::AnyBuffer& q_t, const ScaleBuffer& s_t, bool rowwise,
                                             bool colwise, int64_t block, int64_t block_rows) {
  auto c = CheckFp8Cast(x, q, q_t, rowwise, colwise);
  if (c.has_error()) return c;
  const MatrixBatch& mb = c.value().mb;
  TE_RETURN_IF_ERROR_OR(CheckBlockExtents(mb, block, rowwise, colwise, block_rows > 1));
  TE_RETURN_IF_ERROR_OR(CheckOutput(s, "s", rowwise, mb.batch, mb.rows / block_rows, mb.cols / block));
  TE_RETURN_IF_ERROR_OR(CheckOutput(s_t, "s_t", colwise, mb.batch, mb.cols / block_rows, mb.rows / block));
  return c;
}

// te_jax_quantize_nvfp4: packed E2M1 q [B..., M, N/2], E4M3 scales
// [B..., M, N/16], their columnwise twins, and a key [B..., 2].
inline ffi::ErrorOr<MatrixBatch> CheckQuantizeNvfp4(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::U32>& key,
                                                    const ffi::Buffer<ffi::U8>& q, const ffi::AnyBuffer& s,
                                                    const ffi::Buffer<ffi::U8>& q_t, const ffi::AnyBuffer& s_t,
                                                    bool rowwise, bool colwise, bool block_2d, bool rht) {
  TE_RETURN_IF_ERROR_OR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or;
  const MatrixBatch& mb = mb_or.value();
  if (rht && block_2d) {
    return ffi::Unexpected(InvalidArgument("the random Hadamard transform applies to 1D (1x16) blocks only"));
  }
  if (s.element_type() != ffi::DataType::F8E4M3FN || s_t.element_type() != ffi::DataType::F8E4M3FN) {
    return ffi::Unexpected(InvalidArgument("NVFP4 block scales must be float8_e4m3fn"));
  }
  TE_RETURN_IF_ERROR_OR(CheckBlockExtents(mb, kNvfp4Block, rowwise, colwise || rht, block_2d));
  TE_RETURN_IF_ERROR_OR(CheckOutput(q, "q", rowwise, mb.batch, mb.rows, mb.cols / 2));
  TE_RETURN_IF_ERROR_OR(CheckOutput(s, "s", rowwise, mb.batch, mb.rows, mb.cols / kNvfp4Block));
  TE_RETURN_IF_ERROR_OR(CheckOutput(q_t, "q_t", colwise, mb.batch, mb.cols, mb.rows / 2));
  TE_RETURN_IF_ERROR_OR(CheckOutput(s_t, "s_t", colwise, mb.batch, mb.cols, mb.rows / kNvfp4Block));
  if (static_cast<int64_t>(key.element_count()) != 2 * mb.batch) {
    return ffi::Unexpected(InvalidArgument("key must be uint32[..., 2]"));
  }
  return mb_or;
}

// ---- dequantize -------------------------------------------------------------

// data [B..., M, N / cols_per_byte] and a high-precision out [B..., M, N].
template <typename BufferT>
ffi::ErrorOr<MatrixBatch> CheckDequantOutput(const BufferT& data, int64_t cols_per_byte, const ffi::AnyBuffer& out) {
  auto mb_or = MatrixBatchOf(data, "data");
  if (mb_or.has_error()) return mb_or;
  MatrixBatch mb = mb_or.value();
  mb.cols *= cols_per_byte;
  TE_RETURN_IF_ERROR_OR(CheckHighPrecision(out, "the output"));
  TE_RETURN_IF_ERROR_OR(CheckOutput(out, "out", true, mb.batch, mb.rows, mb.cols));
  return mb;
}

// FP8 data and its out.
inline ffi::ErrorOr<Fp8Cast> CheckDequantizeFp8(const ffi::AnyBuffer& q, const ffi::AnyBuffer& out) {
  auto mb = CheckDequantOutput(q, 1, out);
  if (mb.has_error()) return ffi::Unexpected(mb.error());
  auto fmt = Fp8FormatOf(q.element_type());
  if (!fmt) return ffi::Unexpected(InvalidArgument("data must be float8_e4m3fn or float8_e5m2"));
  return Fp8Cast{mb.value(), *fmt};
}

// te_jax_dequantize_fp8: one scale_inv per matrix.
inline ffi::ErrorOr<Fp8Cast> CheckDequantizeFp8Tensor(const ffi::AnyBuffer& q,
                                                      const ffi::Buffer<ffi::F32>& scale_inv,
                                                      const ffi::AnyBuffer& out) {
  auto c = CheckDequantizeFp8(q, out);
  if (c.has_value() && static_cast<int64_t>(scale_inv.element_count()) != c.value().mb.batch) {
    return ffi::Unexpected(InvalidArgument("scale_inv must be [..., 1]"));
  }
  return c;
}

// te_jax_dequantize_mxfp8 / te_jax_dequantize_fp8_block: one scale per
// block_rows x block_cols block.
inline ffi::ErrorOr<Fp8Cast> CheckDequantizeFp8Blocks(const ffi::AnyBuffer& q, int64_t scale_elements,
                                                      const ffi::AnyBuffer& out, int64_t block_rows,
                                                      int64_t block_cols) {
  auto c = CheckDequantizeFp8(q, out);
  if (c.has_error()) return c;
  const MatrixBatch& mb = c.value().mb;
  TE_RETURN_IF_ERROR_OR(CheckDivisible(mb.cols, block_cols, "the last axis (N)"));
  TE_RETURN_IF_ERROR_OR(CheckDivisible(mb.rows, block_rows, "the row axis (M)"));
  if (scale_elements != mb.batch * (mb.rows / block_rows) * (mb.cols / block_cols)) {
    return ffi::Unexpected(InvalidArgument("scales do not match the data's block layout"));
  }
  return c;
}

// te_jax_dequantize_nvfp4: packed data, E4M3 scales [B..., M, N/16], amax [B..., 1].
inline ffi::ErrorOr<MatrixBatch> CheckDequantizeNvfp4(const ffi::Buffer<ffi::U8>& q, const ffi::AnyBuffer& s,
                                                      const ffi::Buffer<ffi::F32>& amax, const ffi::AnyBuffer& out) {
  auto mb_or = CheckDequantOutput(q, 2, out);
  if (mb_or.has_error()) return mb_or;
  const MatrixBatch& mb = mb_or.value();
  if (s.element_type() != ffi::DataType::F8E4M3FN) {
    return ffi::Unexpected(InvalidArgument("NVFP4 block scales must be float8_e4m3fn"));
  }
  TE_RETURN_IF_ERROR_OR(CheckDivisible(mb.cols, kNvfp4Block, "the last axis (N)"));
  TE_RETURN_IF_ERROR_OR(CheckOutput(s, "s", true, mb.batch, mb.rows, mb.cols / kNvfp4Block));
  if (static_cast<int64_t>(amax.element_count()) != mb.batch) {
    return ffi::Unexpected(InvalidArgument("amax must be [..., 1]"));
  }
  return mb_or;
}

}  // namespace te_jax
