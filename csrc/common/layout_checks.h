// The operand checks of the layout targets, shared by their CPU and CUDA
// handlers (the same contract, the same errors).
#pragma once

#include <cstdint>
#include <string>

#include "ffi_common.h"

namespace te_jax {

// The extents of one te_jax_gather_transpose call.
struct GatherTransposeShape {
  int64_t batch;      // product of the leading axes
  int64_t rows;       // M: rows of data
  int64_t cols;       // C: columns of data, rows of out
  int64_t positions;  // S: entries of sources, columns of out
};

// The element types gather_transpose moves: whole bytes (not the packed 4-bit
// types, nor PRED, whose ByteWidth is 1 as well).
inline bool IsByteElement(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U8:
    case ffi::DataType::S8:
    case ffi::DataType::F8E5M2:
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E4M3:
    case ffi::DataType::F8E3M4:
    case ffi::DataType::F8E4M3B11FNUZ:
    case ffi::DataType::F8E5M2FNUZ:
    case ffi::DataType::F8E4M3FNUZ:
    case ffi::DataType::F8E8M0FNU:
      return true;
    default:
      return false;
  }
}

// te_jax_gather_transpose: data [B..., M, C] of one-byte elements (FP8 codes),
// sources int32 [B..., S], out [B..., C, S] of data's element type, where
// out[b, c, p] = data[b, sources[b, p], c] for 0 <= sources[b, p] < M and 0
// otherwise.
inline ffi::ErrorOr<GatherTransposeShape> CheckGatherTranspose(const ffi::AnyBuffer& data,
                                                               const ffi::Buffer<ffi::S32>& sources,
                                                               const ffi::AnyBuffer& out) {
  const auto d = data.dimensions();
  const auto src = sources.dimensions();
  if (d.size() < 2) {
    return ffi::Unexpected(InvalidArgument("gather_transpose: data must be [B..., M, C], got shape " +
                                           DimsToString(d)));
  }
  if (!IsByteElement(data.element_type())) {
    return ffi::Unexpected(InvalidArgument("gather_transpose: data must have 8-bit elements (an FP8 type, uint8 or "
                                           "int8)"));
  }
  const size_t lead = d.size() - 2;
  bool same_lead = src.size() == lead + 1;
  int64_t batch = 1;
  for (size_t i = 0; i < lead; ++i) {
    batch *= d[i];
    same_lead = same_lead && src[i] == d[i];
  }
  if (!same_lead) {
    return ffi::Unexpected(InvalidArgument("gather_transpose: sources must be int32 [B..., S] with data's leading "
                                           "axes, got shape " + DimsToString(src) + " for data " +
                                           DimsToString(d)));
  }
  const GatherTransposeShape s{batch, d[lead], d[lead + 1], src[lead]};
  const auto o = out.dimensions();
  bool out_ok = out.element_type() == data.element_type() && o.size() == d.size() && o[lead] == s.cols &&
                o[lead + 1] == s.positions;
  for (size_t i = 0; out_ok && i < lead; ++i) out_ok = o[i] == d[i];
  if (!out_ok) {
    return ffi::Unexpected(InvalidArgument("gather_transpose: out must be [B..., C, S] = [..., " +
                                           std::to_string(s.cols) + ", " + std::to_string(s.positions) +
                                           "] of data's dtype, got shape " + DimsToString(o)));
  }
  return s;
}

}  // namespace te_jax
