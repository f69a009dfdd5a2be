// CPU FFI handlers for the fused activation forward (with the output's cast)
// and backward (with the gradient's cast and dbias). Contract:
// te_jax/ops/activation.py; formulas: csrc/common/norm_act.h.
#include <cstdint>
#include <vector>

#include "../common/bindings.h"
#include "norm_act_cpu.h"

namespace te_jax {
namespace {

ffi::Error ActFwd(const ActCall& c) {
  const ActKind act = c.act;
  const int64_t F = c.out_cols;
  const int64_t M = c.mb.rows, N = c.mb.cols;
  const std::vector<float> xf = ToFloat(c.x);
  std::vector<float> y(static_cast<size_t>(M * F));
  for (int64_t b = 0; b < c.mb.batch; ++b) {
    for (int64_t i = 0; i < M; ++i) {
      const float* xr = xf.data() + (b * M + i) * N;
      for (int64_t j = 0; j < F; ++j) {
        y[i * F + j] = IsGated(act) ? ActForwardGated(act, xr[j], xr[F + j]) : ActValue(act, xr[j]);
      }
    }
    cpu_fused::CastMatrix(y.data(), M, F, b, c.sp, c.scale[b], c.key[2 * b], c.key[2 * b + 1], c.out);
  }
  return ffi::Error::Success();
}

ffi::Error ActBwd(const ActCall& c) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(c.dy, "dy"));
  const ActKind act = c.act;
  const int64_t F = c.out_cols;
  const int64_t B = c.mb.batch, M = c.mb.rows, N = c.mb.cols;
  const std::vector<float> xf = ToFloat(c.x), dyf = ToFloat(c.dy);
  std::vector<float> dx(static_cast<size_t>(M * N));
  std::vector<double> db(static_cast<size_t>(N));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < M; ++i) {
      const float* xr = xf.data() + (b * M + i) * N;
      const float* dyr = dyf.data() + (b * M + i) * F;
      float* d = dx.data() + i * N;
      for (int64_t j = 0; j < F; ++j) {
        if (IsGated(act)) {
          d[j] = ActGradGatedA(act, dyr[j], xr[j], xr[F + j]);
          d[F + j] = ActGradGatedG(act, dyr[j], xr[j]);
        } else {
          d[j] = ActGradPlain(act, dyr[j], xr[j]);
        }
      }
    }
    if (c.dbias) {
      std::fill(db.begin(), db.end(), 0.0);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) db[j] += static_cast<double>(dx[i * N + j]);
      for (int64_t j = 0; j < N; ++j) c.dbias[b * N + j] = static_cast<float>(db[j]);
    }
    cpu_fused::CastMatrix(dx.data(), M, N, b, c.sp, c.scale[b], c.key[2 * b], c.key[2 * b + 1], c.out);
  }
  return ffi::Error::Success();
}

}  // namespace

TE_JAX_CPU_ENTRY(ActFwd, ActFwd);
TE_JAX_CPU_ENTRY(ActBwd, ActBwd);

}  // namespace te_jax
