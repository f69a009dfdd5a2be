// CPU FFI handlers for every quantization mode.
//
// Straightforward loops over numerics.h: each mode has one rowwise routine
// over a float32 matrix, and the columnwise copy is that routine applied to
// the transposed matrix (see te_jax/quantize/reference.py).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/bindings.h"
#include "../common/quantize_checks.h"
#include "cpu_common.h"

namespace te_jax {
namespace {

// ---- per-tensor FP8 --------------------------------------------------------------

float AmaxOf(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, AbsBits(x[i]));
  return BitsFloat(m);
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

// Per-tensor FP8 of every matrix of x: scale_of(b, amax of matrix b) gives its scale.
template <typename ScaleOf>
ffi::Error QuantizePerTensor(const ffi::AnyBuffer& x, const ffi::ErrorOr<Fp8Cast>& cast, ffi::AnyBuffer& q,
                             ffi::AnyBuffer& q_t, bool rowwise, bool colwise, float* amax, float* scale_inv,
                             ScaleOf scale_of) {
  if (cast.has_error()) return cast.error();
  const MatrixBatch& mb = cast.value().mb;
  const std::vector<float> xf = ToFloat(x);
  const int64_t size = mb.rows * mb.cols;
  auto* qd = static_cast<uint8_t*>(q.untyped_data());
  auto* qtd = static_cast<uint8_t*>(q_t.untyped_data());
  for (int64_t b = 0; b < mb.batch; ++b) {
    const float* xb = xf.data() + b * size;
    const float a = AmaxOf(xb, size);
    const float s = scale_of(b, a);
    CastFp8(xb, s, mb, cast.value().fmt, rowwise ? qd + b * size : nullptr, colwise ? qtd + b * size : nullptr);
    amax[b] = a;
    scale_inv[b] = 1.0f / s;
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeFp8Tensor(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> q,
                             ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, bool rowwise, bool colwise) {
  return QuantizePerTensor(x, CheckQuantizeFp8Tensor(x, scale, *q, *q_t, rowwise, colwise), *q, *q_t, rowwise,
                           colwise, amax->typed_data(), scale_inv->typed_data(),
                           [&](int64_t b, float) { return scale.typed_data()[b]; });
}

ffi::Error QuantizeFp8Current(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> q_t,
                              ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::F32>> scale,
                              ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, bool rowwise, bool colwise,
                              bool power_2, float epsilon) {
  auto cast = CheckFp8Cast(x, *q, *q_t, rowwise, colwise);
  const float fp8_max = cast.has_value() ? cast.value().fmt.max_value : 0.0f;
  return QuantizePerTensor(x, cast, *q, *q_t, rowwise, colwise, amax->typed_data(), scale_inv->typed_data(),
                           [&](int64_t b, float a) {
                             const float s = ScaleFromAmax(a, fp8_max, epsilon, power_2);
                             scale->typed_data()[b] = s;
                             return s;
                           });
}

// ---- block modes: one rowwise routine per mode ---------------------------------------

// The amax of the block of `rows` x `cols_in_block` values at (i0, j0) of a row-major matrix with `cols` columns.
float BlockAmax(const float* x, int64_t cols, int64_t i0, int64_t rows, int64_t j0, int64_t cols_in_block) {
  uint32_t m = 0;
  for (int64_t i = i0; i < i0 + rows; ++i)
    for (int64_t j = j0; j < j0 + cols_in_block; ++j) m = std::max(m, AbsBits(x[i * cols + j]));
  return BitsFloat(m);
}

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
      const float amax = BlockAmax(x, cols, ib * brows, brows, jb * kFp8Block, kFp8Block);
      const float scale = ScaleFromAmax(amax, fmt.max_value, 0.0f, power_2);
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
      const float amax = BlockAmax(x, cols, ib * brows, brows, jb * kNvfp4Block, kNvfp4Block);
      const uint8_t sb = Nvfp4BlockScale(amax, factor);
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

ffi::Error QuantizeMxfp8(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::U8>> s,
                         ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::U8>> s_t, bool rowwise,
                         bool colwise) {
  auto cast = CheckQuantizeFp8Blocks(x, *q, *s, *q_t, *s_t, rowwise, colwise, kMxfp8Block, 1);
  if (cast.has_error()) return cast.error();
  const MatrixBatch mb = cast.value().mb;
  const Fp8Format fmt = cast.value().fmt;
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
  const int64_t brows = block_2d ? kFp8Block : 1;
  auto cast = CheckQuantizeFp8Blocks(x, *q, *s, *q_t, *s_t, rowwise, colwise, kFp8Block, brows);
  if (cast.has_error()) return cast.error();
  const MatrixBatch mb = cast.value().mb;
  const Fp8Format fmt = cast.value().fmt;
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
  auto mb_or = CheckQuantizeNvfp4(x, key, *q, *s, *q_t, *s_t, rowwise, colwise, block_2d, rht);
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
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
    if (rht) Rht16Groups(xt.data(), size);
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

TE_JAX_CPU_HANDLER(QuantizeFp8Tensor, QuantizeFp8Tensor);
TE_JAX_CPU_HANDLER(QuantizeFp8Current, QuantizeFp8Current);
TE_JAX_CPU_HANDLER(QuantizeMxfp8, QuantizeMxfp8);
TE_JAX_CPU_HANDLER(QuantizeFp8Block, QuantizeFp8Block);
TE_JAX_CPU_HANDLER(QuantizeNvfp4, QuantizeNvfp4);

}  // namespace te_jax
