// CPU FFI handlers for the fused LayerNorm/RMSNorm forward (with the output's
// cast) and backward. Contract: te_jax/ops/norm.py; formulas:
// csrc/common/norm_act.h and te_jax/quantize/ref_norm_act.py.
#include <cstdint>
#include <string_view>
#include <vector>

#include "../common/bindings.h"
#include "norm_act_cpu.h"

namespace te_jax {
namespace {

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

ffi::Error NormFwd(const NormFwdCall& c) {
  const NormAttrs& na = c.na;
  const int64_t B = c.mb.batch, M = c.mb.rows, H = c.mb.cols;
  const std::vector<float> xf = ToFloat(c.x);
  std::vector<float> y(static_cast<size_t>(M * H)), tmp(static_cast<size_t>(H));
  for (int64_t b = 0; b < B; ++b) {
    const float* g = c.gamma + b * H;
    const float* bt = c.beta ? c.beta + b * H : nullptr;
    for (int64_t i = 0; i < M; ++i) {
      const float* xr = xf.data() + (b * M + i) * H;
      float mu, rs;
      RowStats(xr, H, na, tmp, &mu, &rs);
      if (c.mean) c.mean[b * M + i] = mu;
      c.rsigma[b * M + i] = rs;
      for (int64_t j = 0; j < H; ++j) {
        y[i * H + j] = NormApply(xr[j], mu, rs, NormWeight(g[j], na.zero_centered_gamma), bt ? bt[j] : 0.0f, na.rms,
                                 bt != nullptr);
      }
    }
    cpu_fused::CastMatrix(y.data(), M, H, b, c.sp, c.scale[b], c.key[2 * b], c.key[2 * b + 1], c.out);
  }
  return ffi::Error::Success();
}

ffi::Error NormBwd(const NormBwdCall& c) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(c.x, "x"));
  TE_RETURN_IF_ERROR(CheckHighPrecision(c.dy, "dy"));
  TE_RETURN_IF_ERROR(CheckHighPrecision(c.dx, "dx"));
  const NormAttrs& na = c.na;
  const int64_t B = c.mb.batch, M = c.mb.rows, H = c.mb.cols;
  const std::vector<float> xf = ToFloat(c.x), dyf = ToFloat(c.dy);
  std::vector<float> dxf(xf.size()), g(static_cast<size_t>(H)), gx(static_cast<size_t>(H));
  std::vector<double> dg(static_cast<size_t>(H)), db(static_cast<size_t>(H));
  const float hf = static_cast<float>(H);
  for (int64_t b = 0; b < B; ++b) {
    const float* gam = c.gamma + b * H;
    std::fill(dg.begin(), dg.end(), 0.0);
    std::fill(db.begin(), db.end(), 0.0);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t row = b * M + i;
      const float* xr = xf.data() + row * H;
      const float* dyr = dyf.data() + row * H;
      const float mu = na.rms ? 0.0f : c.mean[row];
      const float rs = c.rsigma[row];
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
        const float centered = na.rms ? g[j] : g[j] - mg;
        dxf[row * H + j] = rs * (centered - xhat * mgx);
      }
    }
    for (int64_t j = 0; j < H; ++j) {
      c.dgamma[b * H + j] = static_cast<float>(dg[j]);
      if (c.dbeta) c.dbeta[b * H + j] = static_cast<float>(db[j]);
    }
  }
  cpu_fused::StoreAt(c.dx, 0, dxf.data(), static_cast<int64_t>(dxf.size()));
  return ffi::Error::Success();
}

}  // namespace

TE_JAX_CPU_ENTRY(NormFwd, NormFwd);
TE_JAX_CPU_ENTRY(NormBwd, NormBwd);

}  // namespace te_jax
