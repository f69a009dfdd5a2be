// CPU FFI handlers for the fused activation forward (with the output's cast)
// and backward (with the gradient's cast and dbias). Contract:
// te_jax/ops/activation.py; formulas: csrc/common/norm_act.h.
#include <cstdint>
#include <vector>

#include "../common/bindings.h"
#include "../common/norm_act_checks.h"
#include "norm_act_cpu.h"

namespace te_jax {
namespace {

using cpu_fused::CastResults;


ffi::Error ActFwd(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::U32> key,
                  ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> s, ffi::Result<ffi::AnyBuffer> q_t,
                  ffi::Result<ffi::AnyBuffer> s_t, ffi::Result<ffi::AnyBuffer> amax,
                  ffi::Result<ffi::AnyBuffer> amax_t, ffi::Result<ffi::AnyBuffer> scale_out, ffi::Dictionary attrs) {
  ActArgs args;
  TE_RETURN_IF_ERROR(CheckActFwd(x, scale, key, {*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out}, attrs, &args));
  const MatrixBatch in = args.mb;
  const ActKind act = args.act;
  const CastSpec& sp = args.sp;
  const int64_t F = args.out_cols;
  const std::vector<float> xf = ToFloat(x);
  CastResults r{*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out};
  const int64_t M = in.rows, N = in.cols;
  std::vector<float> y(static_cast<size_t>(M * F));
  for (int64_t b = 0; b < in.batch; ++b) {
    for (int64_t i = 0; i < M; ++i) {
      const float* xr = xf.data() + (b * M + i) * N;
      for (int64_t j = 0; j < F; ++j) {
        y[i * F + j] = IsGated(act) ? ActForwardGated(act, xr[j], xr[F + j]) : ActValue(act, xr[j]);
      }
    }
    cpu_fused::CastMatrix(y.data(), M, F, b, sp, scale.typed_data()[b], key.typed_data()[2 * b],
                          key.typed_data()[2 * b + 1], r);
  }
  return ffi::Error::Success();
}

ffi::Error ActBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::U32> key,
                  ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> s, ffi::Result<ffi::AnyBuffer> q_t,
                  ffi::Result<ffi::AnyBuffer> s_t, ffi::Result<ffi::AnyBuffer> amax,
                  ffi::Result<ffi::AnyBuffer> amax_t, ffi::Result<ffi::AnyBuffer> scale_out,
                  ffi::Result<ffi::Buffer<ffi::F32>> dbias, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                  ffi::Dictionary attrs) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  TE_RETURN_IF_ERROR(CheckHighPrecision(dy, "dy"));
  ActArgs args;
  TE_RETURN_IF_ERROR(CheckActBwd(x, scale, key, {*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out}, *dbias, attrs,
                                 &args));
  const MatrixBatch mb = args.mb;
  const ActKind act = args.act;
  const CastSpec& sp = args.sp;
  const int64_t F = args.out_cols;
  const int64_t B = mb.batch, M = mb.rows, N = mb.cols;
  if (static_cast<int64_t>(dy.element_count()) != B * M * F) return InvalidArgument("dy must be [..., M, N_out]");
  const std::vector<float> xf = ToFloat(x), dyf = ToFloat(dy);
  CastResults r{*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out};
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
    if (args.dbias) {
      std::fill(db.begin(), db.end(), 0.0);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) db[j] += static_cast<double>(dx[i * N + j]);
      for (int64_t j = 0; j < N; ++j) dbias->typed_data()[b * N + j] = static_cast<float>(db[j]);
    }
    cpu_fused::CastMatrix(dx.data(), M, N, b, sp, scale.typed_data()[b], key.typed_data()[2 * b],
                          key.typed_data()[2 * b + 1], r);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActFwdCpu, ActFwd, BindActFwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActBwdCpu, ActBwd, BindActBwd(ffi::Ffi::Bind()));

}  // namespace te_jax
