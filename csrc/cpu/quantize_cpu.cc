// CPU FFI handlers for every quantization mode.
//
// Straightforward loops over numerics.h: each mode has one rowwise routine
// over a float32 matrix, and the columnwise copy is that routine applied to
// the transposed matrix (see te_jax/quantize/reference.py).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/bindings.h"
#include "../common/ffi_common.h"
#include "cpu_common.h"

namespace te_jax {
namespace {

// ---- per-tensor FP8 --------------------------------------------------------------

float AmaxOf(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, AbsBits(x[i]));
  return BitsFloat(m);
}

ffi::Error CheckFp8TensorOutputs(const MatrixBatch& mb, ffi::AnyBuffer q, ffi::AnyBuffer q_t,
                                 bool rowwise, bool colwise, Fp8Format* fmt) {
  auto f = Fp8FormatOf(q.element_type());
  if (!f || q_t.element_type() != q.element_type()) {
    return InvalidArgument("quantized outputs must both be float8_e4m3fn or float8_e5m2");
  }
  *fmt = *f;
  TE_RETURN_IF_ERROR(CheckOutput(q, "q", rowwise, mb.batch, mb.rows, mb.cols));
  return CheckOutput(q_t, "q_t", colwise, mb.batch, mb.cols, mb.rows);
}

void CastFp8(const float* x, float scale, const MatrixBatch& mb, Fp8Format fmt, uint8_t* q,
             uint8_t* q_t) {
  for (int64_t i = 0; i < mb.rows; ++i) {
    for (int64_t j = 0; j < mb.cols; ++j) {
      const uint8_t c = FloatToFp8(x[i * mb.cols + j] * scale, fmt);
      if (q) q[i * mb.cols + j] = c;
      if (q_t) q_t[j * mb.rows + i] = c;
    }
  }
}

ffi::Error QuantizeFp8Tensor(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> q,
                             ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, bool rowwise, bool colwise) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  Fp8Format fmt;
  TE_RETURN_IF_ERROR(CheckFp8TensorOutputs(mb, *q, *q_t, rowwise, colwise, &fmt));
  if (static_cast<int64_t>(scale.element_count()) != mb.batch) return InvalidArgument("scale must hold one value per matrix");
  const std::vector<float> xf = ToFloat(x);
  const int64_t size = mb.rows * mb.cols;
  auto* qd = static_cast<uint8_t*>(q->untyped_data());
  auto* qtd = static_cast<uint8_t*>(q_t->untyped_data());
  for (int64_t b = 0; b < mb.batch; ++b) {
    const float* xb = xf.data() + b * size;
    const float s = scale.typed_data()[b];
    CastFp8(xb, s, mb, fmt, rowwise ? qd + b * size : nullptr, colwise ? qtd + b * size : nullptr);
    amax->typed_data()[b] = AmaxOf(xb, size);
    scale_inv->typed_data()[b] = 1.0f / s;
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeFp8Current(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> q_t,
                              ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::F32>> scale,
                              ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, bool rowwise, bool colwise,
                              bool power_2, float epsilon) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  Fp8Format fmt;
  TE_RETURN_IF_ERROR(CheckFp8TensorOutputs(mb, *q, *q_t, rowwise, colwise, &fmt));
  const std::vector<float> xf = ToFloat(x);
  const int64_t size = mb.rows * mb.cols;
  auto* qd = static_cast<uint8_t*>(q->untyped_data());
  auto* qtd = static_cast<uint8_t*>(q_t->untyped_data());
  for (int64_t b = 0; b < mb.batch; ++b) {
    const float* xb = xf.data() + b * size;
    const float a = AmaxOf(xb, size);
    const float s = ScaleFromAmax(a, fmt.max_value, epsilon, power_2);
    CastFp8(xb, s, mb, fmt, rowwise ? qd + b * size : nullptr, colwise ? qtd + b * size : nullptr);
    amax->typed_data()[b] = a;
    scale->typed_data()[b] = s;
    scale_inv->typed_data()[b] = 1.0f / s;
  }
  return ffi::Error::Success();
}

// ---- block modes: one rowwise routine per mode ---------------------------------------

// MXFP8 over a rows x cols float matrix: 1x32 blocks, E8M0 codes.
void Mxfp8Rowwise(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, uint8_t* q, uint8_t* s) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t jb = 0; jb < cols / kMxfp8Block; ++jb) {
      const float* blk = x + i * cols + jb * kMxfp8Block;
      const uint8_t code = E8M0FromAmax(AmaxOf(blk, kMxfp8Block), fmt.max_value);
      const float mult = E8M0InverseToFloat(code);
      for (int64_t k = 0; k < kMxfp8Block; ++k) q[i * cols + jb * kMxfp8Block + k] = FloatToFp8(blk[k] * mult, fmt);
      s[i * (cols / kMxfp8Block) + jb] = code;
    }
  }
}

// Float8 block scaling: 1x128 (block_2d false) or 128x128 blocks; s holds 1/scale.
void Fp8BlockRowwise(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, bool block_2d, bool power_2,
                     uint8_t* q, float* s) {
  const int64_t brows = block_2d ? kFp8Block : 1;
  const int64_t ncb = cols / kFp8Block;
  for (int64_t ib = 0; ib < rows / brows; ++ib) {
    for (int64_t jb = 0; jb < ncb; ++jb) {
      uint32_t m = 0;
      for (int64_t i = ib * brows; i < (ib + 1) * brows; ++i)
        for (int64_t j = jb * kFp8Block; j < (jb + 1) * kFp8Block; ++j) m = std::max(m, AbsBits(x[i * cols + j]));
      const float scale = ScaleFromAmax(BitsFloat(m), fmt.max_value, 0.0f, power_2);
      for (int64_t i = ib * brows; i < (ib + 1) * brows; ++i)
        for (int64_t j = jb * kFp8Block; j < (jb + 1) * kFp8Block; ++j)
          q[i * cols + j] = FloatToFp8(x[i * cols + j] * scale, fmt);
      s[ib * ncb + jb] = 1.0f / scale;
    }
  }
}

// NVFP4 given the matrix's global amax: 1x16 or 16x16 blocks, packed E2M1,
// E4M3 scales stored per (row, 16 columns). `random` seeds stochastic rounding
// (nullptr for round to nearest even).
void Nvfp4Rowwise(const float* x, int64_t rows, int64_t cols, float global_amax, bool block_2d,
                  const uint32_t* seed, uint8_t* q, uint8_t* s) {
  const float s_enc = Nvfp4GlobalEncodeScale(global_amax);
  const float s_dec = 1.0f / s_enc;
  const float factor = s_enc * (1.0f / 6.0f);
  const int64_t brows = block_2d ? kNvfp4Block : 1;
  const int64_t ncb = cols / kNvfp4Block;
  for (int64_t ib = 0; ib < rows / brows; ++ib) {
    for (int64_t jb = 0; jb < ncb; ++jb) {
      uint32_t m = 0;
      for (int64_t i = ib * brows; i < (ib + 1) * brows; ++i)
        for (int64_t j = jb * kNvfp4Block; j < (jb + 1) * kNvfp4Block; ++j) m = std::max(m, AbsBits(x[i * cols + j]));
      const uint8_t sb = Nvfp4BlockScale(BitsFloat(m), factor);
      const float enc = Nvfp4BlockEncode(sb, s_dec);
      for (int64_t i = ib * brows; i < (ib + 1) * brows; ++i) {
        s[i * ncb + jb] = sb;
        for (int64_t j = jb * kNvfp4Block; j < (jb + 1) * kNvfp4Block; j += 2) {
          uint8_t c[2];
          for (int k = 0; k < 2; ++k) {
            const int64_t idx = i * cols + j + k;
            const float v = x[idx] * enc;
            c[k] = seed ? FloatToE2M1Stochastic(v, RandomBits(*seed, static_cast<uint32_t>(idx))) : FloatToE2M1(v);
          }
          q[(i * cols + j) / 2] = static_cast<uint8_t>(c[0] | (c[1] << 4));
        }
      }
    }
  }
}

ffi::Error CheckBlockOutputs(const MatrixBatch& mb, int64_t block, bool rowwise, bool colwise, bool block_2d) {
  if (rowwise || block_2d) TE_RETURN_IF_ERROR(CheckDivisible(mb.cols, block, "the last axis (N)"));
  if (colwise || block_2d) TE_RETURN_IF_ERROR(CheckDivisible(mb.rows, block, "the row axis (M)"));
  return ffi::Error::Success();
}

ffi::Error QuantizeMxfp8(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::U8>> s,
                         ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::U8>> s_t, bool rowwise,
                         bool colwise) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  Fp8Format fmt;
  TE_RETURN_IF_ERROR(CheckFp8TensorOutputs(mb, *q, *q_t, rowwise, colwise, &fmt));
  TE_RETURN_IF_ERROR(CheckBlockOutputs(mb, kMxfp8Block, rowwise, colwise, false));
  TE_RETURN_IF_ERROR(CheckOutput(*s, "s", rowwise, mb.batch, mb.rows, mb.cols / kMxfp8Block));
  TE_RETURN_IF_ERROR(CheckOutput(*s_t, "s_t", colwise, mb.batch, mb.cols, mb.rows / kMxfp8Block));
  const std::vector<float> xf = ToFloat(x);
  const int64_t size = mb.rows * mb.cols;
  for (int64_t b = 0; b < mb.batch; ++b) {
    const float* xb = xf.data() + b * size;
    if (rowwise) {
      Mxfp8Rowwise(xb, mb.rows, mb.cols, fmt, static_cast<uint8_t*>(q->untyped_data()) + b * size,
                   s->typed_data() + b * size / kMxfp8Block);
    }
    if (colwise) {
      const std::vector<float> xt = Transpose(xb, mb.rows, mb.cols);
      Mxfp8Rowwise(xt.data(), mb.cols, mb.rows, fmt, static_cast<uint8_t*>(q_t->untyped_data()) + b * size,
                   s_t->typed_data() + b * size / kMxfp8Block);
    }
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeFp8Block(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> s,
                            ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> s_t, bool rowwise,
                            bool colwise, bool block_2d, bool power_2) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  Fp8Format fmt;
  TE_RETURN_IF_ERROR(CheckFp8TensorOutputs(mb, *q, *q_t, rowwise, colwise, &fmt));
  TE_RETURN_IF_ERROR(CheckBlockOutputs(mb, kFp8Block, rowwise, colwise, block_2d));
  const int64_t brows = block_2d ? kFp8Block : 1;
  TE_RETURN_IF_ERROR(CheckOutput(*s, "s", rowwise, mb.batch, mb.rows / brows, mb.cols / kFp8Block));
  TE_RETURN_IF_ERROR(CheckOutput(*s_t, "s_t", colwise, mb.batch, mb.cols / brows, mb.rows / kFp8Block));
  const std::vector<float> xf = ToFloat(x);
  const int64_t size = mb.rows * mb.cols;
  const int64_t nscale = size / (brows * kFp8Block);
  for (int64_t b = 0; b < mb.batch; ++b) {
    const float* xb = xf.data() + b * size;
    if (rowwise) {
      Fp8BlockRowwise(xb, mb.rows, mb.cols, fmt, block_2d, power_2,
                      static_cast<uint8_t*>(q->untyped_data()) + b * size, s->typed_data() + b * nscale);
    }
    if (colwise) {
      const std::vector<float> xt = Transpose(xb, mb.rows, mb.cols);
      Fp8BlockRowwise(xt.data(), mb.cols, mb.rows, fmt, block_2d, power_2,
                      static_cast<uint8_t*>(q_t->untyped_data()) + b * size, s_t->typed_data() + b * nscale);
    }
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeNvfp4(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> key, ffi::Result<ffi::Buffer<ffi::U8>> q,
                         ffi::Result<ffi::AnyBuffer> s, ffi::Result<ffi::Buffer<ffi::U8>> q_t,
                         ffi::Result<ffi::AnyBuffer> s_t, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                         ffi::Result<ffi::Buffer<ffi::F32>> amax_t, bool rowwise, bool colwise, bool block_2d,
                         bool rht, bool stochastic_rounding) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  if (rht && block_2d) return InvalidArgument("the random Hadamard transform applies to 1D (1x16) blocks only");
  if (s->element_type() != ffi::DataType::F8E4M3FN || s_t->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument("NVFP4 block scales must be float8_e4m3fn");
  }
  TE_RETURN_IF_ERROR(CheckBlockOutputs(mb, kNvfp4Block, rowwise, colwise || rht, block_2d));
  TE_RETURN_IF_ERROR(CheckOutput(*q, "q", rowwise, mb.batch, mb.rows, mb.cols / 2));
  TE_RETURN_IF_ERROR(CheckOutput(*s, "s", rowwise, mb.batch, mb.rows, mb.cols / kNvfp4Block));
  TE_RETURN_IF_ERROR(CheckOutput(*q_t, "q_t", colwise, mb.batch, mb.cols, mb.rows / 2));
  TE_RETURN_IF_ERROR(CheckOutput(*s_t, "s_t", colwise, mb.batch, mb.cols, mb.rows / kNvfp4Block));
  if (static_cast<int64_t>(key.element_count()) != 2 * mb.batch) return InvalidArgument("key must be uint32[..., 2]");
  const std::vector<float> xf = ToFloat(x);
  const int64_t size = mb.rows * mb.cols;
  for (int64_t b = 0; b < mb.batch; ++b) {
    const float* xb = xf.data() + b * size;
    const uint32_t k0 = key.typed_data()[2 * b], k1 = key.typed_data()[2 * b + 1];
    const uint32_t row_seed = StreamSeed(k0, k1, kRowwiseStream);
    const uint32_t col_seed = StreamSeed(k0, k1, kColwiseStream);
    const float a = AmaxOf(xb, size);
    amax->typed_data()[b] = a;
    if (rowwise) {
      Nvfp4Rowwise(xb, mb.rows, mb.cols, a, block_2d, stochastic_rounding ? &row_seed : nullptr,
                   q->typed_data() + b * size / 2,
                   static_cast<uint8_t*>(s->untyped_data()) + b * size / kNvfp4Block);
    }
    if (!colwise && !rht) {
      amax_t->typed_data()[b] = a;
      continue;
    }
    std::vector<float> xt = Transpose(xb, mb.rows, mb.cols);
    if (rht) {
      for (int64_t i = 0; i < size; i += 16) Rht16(xt.data() + i);
    }
    const float a_t = rht ? AmaxOf(xt.data(), size) : a;
    amax_t->typed_data()[b] = a_t;
    if (colwise) {
      Nvfp4Rowwise(xt.data(), mb.cols, mb.rows, a_t, block_2d, stochastic_rounding ? &col_seed : nullptr,
                   q_t->typed_data() + b * size / 2,
                   static_cast<uint8_t*>(s_t->untyped_data()) + b * size / kNvfp4Block);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeFp8TensorCpu, QuantizeFp8Tensor,
                              BindQuantizeFp8Tensor(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeFp8CurrentCpu, QuantizeFp8Current,
                              BindQuantizeFp8Current(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeMxfp8Cpu, QuantizeMxfp8, BindQuantizeMxfp8(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeFp8BlockCpu, QuantizeFp8Block, BindQuantizeFp8Block(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeNvfp4Cpu, QuantizeNvfp4, BindQuantizeNvfp4(ffi::Ffi::Bind()));

}  // namespace te_jax
