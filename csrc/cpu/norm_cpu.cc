// CPU FFI handlers for the fused LayerNorm/RMSNorm forward (with the output's
// cast) and backward. Contract: te_jax/ops/norm.py; formulas:
// csrc/common/norm_act.h and te_jax/quantize/ref_norm_act.py.
#include <cstdint>
#include <string_view>
#include <vector>

#include "../common/bindings.h"
#include "../common/norm_act_checks.h"
#include "norm_act_cpu.h"

namespace te_jax {
namespace {

using cpu_fused::CastResults;

// mean/rsigma of one row (mean 0 for rmsnorm).
void RowStats(const float* x, int64_t h, const NormAttrs& na, std::vector<float>& tmp, float* mean, float* rsigma) {
  const float hf = static_cast<float>(h);
  float mu = 0.0f;
  if (na.rms) {
    for (int64_t j = 0; j < h; ++j) tmp[j] = x[j] * x[j];
  } else {
    mu = cpu_fused::PairwiseSum(x, h) / hf;
    for (int64_t j = 0; j < h; ++j) {
      const float d = x[j] - mu;
      tmp[j] = d * d;
    }
  }
  const float var = cpu_fused::PairwiseSum(tmp.data(), h) / hf;
  *mean = mu;
  *rsigma = RsigmaOf(var, na.epsilon);
}

ffi::Error NormFwd(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> gamma, ffi::Buffer<ffi::F32> beta,
                   ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::U32> key, ffi::Result<ffi::AnyBuffer> q,
                   ffi::Result<ffi::AnyBuffer> s, ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::AnyBuffer> s_t,
                   ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> amax_t,
                   ffi::Result<ffi::AnyBuffer> scale_out, ffi::Result<ffi::Buffer<ffi::F32>> mean,
                   ffi::Result<ffi::Buffer<ffi::F32>> rsigma, ffi::Dictionary attrs) {
  NormFwdArgs args;
  TE_RETURN_IF_ERROR(CheckNormFwd(x, gamma, beta, scale, key, {*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out},
                                  *mean, *rsigma, attrs, &args));
  const NormAttrs& na = args.na;
  const CastSpec& sp = args.sp;
  const bool has_beta = args.has_beta;
  const int64_t B = args.mb.batch, M = args.mb.rows, H = args.mb.cols;
  const std::vector<float> xf = ToFloat(x);
  CastResults r{*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out};
  std::vector<float> y(static_cast<size_t>(M * H)), tmp(static_cast<size_t>(H));
  for (int64_t b = 0; b < B; ++b) {
    const float* g = gamma.typed_data() + b * H;
    const float* bt = has_beta ? beta.typed_data() + b * H : nullptr;
    for (int64_t i = 0; i < M; ++i) {
      const float* xr = xf.data() + (b * M + i) * H;
      float mu, rs;
      RowStats(xr, H, na, tmp, &mu, &rs);
      if (!na.rms) mean->typed_data()[b * M + i] = mu;
      rsigma->typed_data()[b * M + i] = rs;
      for (int64_t j = 0; j < H; ++j) {
        y[i * H + j] = NormApply(xr[j], mu, rs, NormWeight(g[j], na.zero_centered_gamma), bt ? bt[j] : 0.0f, na.rms,
                                 bt != nullptr);
      }
    }
    cpu_fused::CastMatrix(y.data(), M, H, b, sp, scale.typed_data()[b], key.typed_data()[2 * b],
                          key.typed_data()[2 * b + 1], r);
  }
  return ffi::Error::Success();
}

ffi::Error NormBwd(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rsigma,
                   ffi::Buffer<ffi::F32> gamma, ffi::Result<ffi::AnyBuffer> dx,
                   ffi::Result<ffi::Buffer<ffi::F32>> dgamma, ffi::Result<ffi::Buffer<ffi::F32>> dbeta,
                   ffi::Result<ffi::Buffer<ffi::F32>> workspace, ffi::Dictionary attrs) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  TE_RETURN_IF_ERROR(CheckHighPrecision(dy, "dy"));
  TE_RETURN_IF_ERROR(CheckHighPrecision(*dx, "dx"));
  MatrixBatch mb;
  NormAttrs na;
  TE_RETURN_IF_ERROR(CheckNormBwd(dy, x, mean, rsigma, gamma, *dx, *dgamma, *dbeta, attrs, &mb, &na));
  const int64_t B = mb.batch, M = mb.rows, H = mb.cols;
  const std::vector<float> xf = ToFloat(x), dyf = ToFloat(dy);
  std::vector<float> dxf(xf.size()), g(static_cast<size_t>(H)), gx(static_cast<size_t>(H));
  std::vector<double> dg(static_cast<size_t>(H)), db(static_cast<size_t>(H));
  const float hf = static_cast<float>(H);
  for (int64_t b = 0; b < B; ++b) {
    const float* gam = gamma.typed_data() + b * H;
    std::fill(dg.begin(), dg.end(), 0.0);
    std::fill(db.begin(), db.end(), 0.0);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t row = b * M + i;
      const float* xr = xf.data() + row * H;
      const float* dyr = dyf.data() + row * H;
      const float mu = na.rms ? 0.0f : mean.typed_data()[row];
      const float rs = rsigma.typed_data()[row];
      for (int64_t j = 0; j < H; ++j) {
        const float xhat = NormXhat(xr[j], mu, rs, na.rms);
        g[j] = dyr[j] * NormWeight(gam[j], na.zero_centered_gamma);
        gx[j] = g[j] * xhat;
        dg[j] += static_cast<double>(dyr[j] * xhat);
        db[j] += static_cast<double>(dyr[j]);
      }
      const float mgx = cpu_fused::PairwiseSum(gx.data(), H) / hf;
      const float mg = na.rms ? 0.0f : cpu_fused::PairwiseSum(g.data(), H) / hf;
      for (int64_t j = 0; j < H; ++j) {
        const float xhat = NormXhat(xr[j], mu, rs, na.rms);
        const float c = na.rms ? g[j] : g[j] - mg;
        dxf[row * H + j] = rs * (c - xhat * mgx);
      }
    }
    for (int64_t j = 0; j < H; ++j) {
      dgamma->typed_data()[b * H + j] = static_cast<float>(dg[j]);
      if (!na.rms) dbeta->typed_data()[b * H + j] = static_cast<float>(db[j]);
    }
  }
  cpu_fused::StoreAt(*dx, 0, dxf.data(), static_cast<int64_t>(dxf.size()));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NormFwdCpu, NormFwd, BindNormFwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NormBwdCpu, NormBwd, BindNormBwd(ffi::Ffi::Bind()));

}  // namespace te_jax
