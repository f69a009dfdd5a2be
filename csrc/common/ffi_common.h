// Shape and dtype checks shared by the CPU and CUDA FFI handlers.
//
// Every quantize kernel sees its input as a batch of matrices [B..., M, N]
// (the Python side flattens a tensor to 2D; vmap adds leading batch axes).
// The Python layer validates at trace time; these checks are the last line
// of defence and name the offending buffer.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "numerics.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

namespace ffi = xla::ffi;

struct MatrixBatch {
  int64_t batch;  // product of the leading axes
  int64_t rows;   // M
  int64_t cols;   // N
};

inline ffi::Error InvalidArgument(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

inline std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

template <typename BufferT>
ffi::ErrorOr<MatrixBatch> MatrixBatchOf(const BufferT& x, std::string_view name) {
  auto dims = x.dimensions();
  if (dims.size() < 2) {
    return ffi::Unexpected(InvalidArgument(std::string(name) + " must have rank >= 2, got shape " +
                                           DimsToString(dims)));
  }
  MatrixBatch mb{1, dims[dims.size() - 2], dims[dims.size() - 1]};
  for (size_t i = 0; i + 2 < dims.size(); ++i) mb.batch *= dims[i];
  return mb;
}

inline bool IsHighPrecision(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

inline ffi::Error CheckHighPrecision(const ffi::AnyBuffer& x, std::string_view name) {
  if (!IsHighPrecision(x.element_type())) {
    return InvalidArgument(std::string(name) + " must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

inline std::optional<Fp8Format> Fp8FormatOf(ffi::DataType t) {
  if (t == ffi::DataType::F8E4M3FN) return kE4M3;
  if (t == ffi::DataType::F8E5M2) return kE5M2;
  return std::nullopt;
}

// Checks that `buf` holds batch * last_two elements (the trailing two axes of
// an enabled output), or is empty when the output is disabled.
template <typename BufferT>
ffi::Error CheckOutput(const BufferT& buf, std::string_view name, bool enabled,
                              int64_t batch, int64_t rows, int64_t cols) {
  const int64_t want = enabled ? batch * rows * cols : 0;
  if (static_cast<int64_t>(buf.element_count()) != want) {
    return InvalidArgument(std::string(name) + ": expected " + std::to_string(want) +
                           " elements, got shape " + DimsToString(buf.dimensions()));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckDivisible(int64_t extent, int64_t block, std::string_view what) {
  if (extent % block != 0) {
    return InvalidArgument(std::string(what) + " (" + std::to_string(extent) +
                           ") must be a multiple of the block size " + std::to_string(block));
  }
  return ffi::Error::Success();
}

#define TE_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::xla::ffi::Error _te_err = (expr);       \
    if (_te_err.failure()) return _te_err;    \
  } while (0)

// The same inside a function that returns ffi::ErrorOr<T>.
#define TE_RETURN_IF_ERROR_OR(expr)                                   \
  do {                                                                \
    ::xla::ffi::Error _te_err = (expr);                               \
    if (_te_err.failure()) return ::xla::ffi::Unexpected(_te_err);    \
  } while (0)

constexpr int64_t kMxfp8Block = 32;
constexpr int64_t kNvfp4Block = 16;
constexpr int64_t kFp8Block = 128;

}  // namespace te_jax
