// CPU FFI handler of the layout target te_jax_gather_transpose: the rows that
// sources names, transposed (layout_checks.h has the contract).
#include <cstdint>
#include <cstring>

#include "../common/bindings.h"
#include "../common/layout_checks.h"
#include "cpu_common.h"

namespace te_jax {
namespace {

ffi::Error GatherTranspose(ffi::AnyBuffer data, ffi::Buffer<ffi::S32> sources, ffi::Result<ffi::AnyBuffer> out) {
  auto c = CheckGatherTranspose(data, sources, *out);
  if (c.has_error()) return c.error();
  const GatherTransposeShape s = c.value();
  const auto* in = static_cast<const uint8_t*>(data.untyped_data());
  const int32_t* src = sources.typed_data();
  auto* o = static_cast<uint8_t*>(out->untyped_data());
  const int64_t out_size = s.cols * s.positions;
  if (s.batch * out_size == 0) return ffi::Error::Success();
  std::memset(o, 0, static_cast<size_t>(s.batch * out_size));
  for (int64_t b = 0; b < s.batch; ++b) {
    const uint8_t* matrix = in + b * s.rows * s.cols;
    uint8_t* dst = o + b * out_size;
    for (int64_t p = 0; p < s.positions; ++p) {
      const int64_t r = src[b * s.positions + p];
      if (r < 0 || r >= s.rows) continue;
      const uint8_t* row = matrix + r * s.cols;
      for (int64_t col = 0; col < s.cols; ++col) dst[col * s.positions + p] = row[col];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

TE_JAX_CPU_HANDLER(GatherTranspose, GatherTranspose);

}  // namespace te_jax
