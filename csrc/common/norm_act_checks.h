// The entry points of the norm and activation targets, shared by their CPU
// and CUDA handlers (the same contract, the same errors). Each entry is the
// handler the platform module registers (bindings.h: TE_JAX_CPU_ENTRY,
// TE_JAX_CUDA_ENTRY): it takes the target's operands, results and typed
// attributes, checks everything the platforms have in common and calls the
// platform's `kRun(ctx..., call)` with the checked call. What differs per
// platform (dtype agreement of gradients, the GPU workspace) stays with kRun.
#pragma once

#include <cstdint>

#include "ffi_common.h"
#include "norm_act.h"

namespace te_jax {

using F32Arg = ffi::Buffer<ffi::F32>;
using U32Arg = ffi::Buffer<ffi::U32>;
using AnyRet = ffi::Result<ffi::AnyBuffer>;
using F32Ret = ffi::Result<ffi::Buffer<ffi::F32>>;

// The seven cast results (see CheckCastResults).
struct FusedCastOut {
  ffi::AnyBuffer q, s, q_t, s_t, amax, amax_t, scale;
};

inline ffi::Error CheckCastOutputs(const CastSpec& sp, const MatrixBatch& mb, const FusedCastOut& r) {
  return CheckCastResults(sp, mb, r.q, r.s, r.q_t, r.s_t, r.amax, r.amax_t, r.scale);
}

// x in high precision, as a batch of matrices.
inline ffi::ErrorOr<MatrixBatch> InputBatch(const ffi::AnyBuffer& x) {
  TE_RETURN_IF_ERROR_OR(CheckHighPrecision(x, "x"));
  return MatrixBatchOf(x, "x");
}

// The cast's per-matrix operands: scale [B] and key [B, 2].
inline ffi::Error CheckCastOperands(const F32Arg& scale, const U32Arg& key, int64_t batch) {
  TE_RETURN_IF_ERROR(CheckCount(scale, batch, "scale"));
  return CheckCount(key, 2 * batch, "key");
}

// ---- te_jax_norm_fwd: x [B, M, H] -> the cast of norm(x), mean and rsigma [B, M] ----

struct NormFwdCall {
  ffi::AnyBuffer x;
  const float* gamma;  // [B, H]
  const float* beta;   // [B, H], or nullptr (no beta)
  const float* scale;  // [B]
  const uint32_t* key; // [B, 2]
  FusedCastOut out;
  float* mean;         // [B, M], or nullptr (rmsnorm)
  float* rsigma;       // [B, M]
  MatrixBatch mb;
  NormAttrs na;
  CastSpec sp;
};

template <auto kRun, typename... Ctx>
struct NormFwdEntry {
  static ffi::Error Call(Ctx... ctx, ffi::AnyBuffer x, F32Arg gamma, F32Arg beta, F32Arg scale, U32Arg key, AnyRet q,
                         AnyRet s, AnyRet q_t, AnyRet s_t, AnyRet amax, AnyRet amax_t, AnyRet scale_out, F32Ret mean,
                         F32Ret rsigma, NormFwdAttrs attrs) {
    auto mb = InputBatch(x);
    if (mb.has_error()) return mb.error();
    NormFwdCall c{x, gamma.typed_data(), nullptr, scale.typed_data(), key.typed_data(),
                  FusedCastOut{*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out}, nullptr, rsigma->typed_data(),
                  mb.value(), {}, {}};
    TE_RETURN_IF_ERROR(ParseNormAttrs(attrs.kind, attrs.zero_centered_gamma, attrs.epsilon, &c.na));
    TE_RETURN_IF_ERROR(ParseCastSpec(attrs, &c.sp));
    TE_RETURN_IF_ERROR(CheckCastOutputs(c.sp, c.mb, c.out));
    const int64_t B = c.mb.batch, M = c.mb.rows, H = c.mb.cols;
    TE_RETURN_IF_ERROR(CheckCount(gamma, B * H, "gamma"));
    if (beta.element_count() != 0) {
      TE_RETURN_IF_ERROR(CheckCount(beta, B * H, "beta"));
      if (c.na.rms) return InvalidArgument("rmsnorm takes no beta");
      c.beta = beta.typed_data();
    }
    TE_RETURN_IF_ERROR(CheckCastOperands(scale, key, B));
    TE_RETURN_IF_ERROR(CheckCount(*mean, c.na.rms ? 0 : B * M, "mean"));
    TE_RETURN_IF_ERROR(CheckCount(*rsigma, B * M, "rsigma"));
    if (!c.na.rms) c.mean = mean->typed_data();
    return kRun(ctx..., c);
  }
};

// ---- te_jax_norm_bwd: dx [B, M, H], dgamma and dbeta [B, H] (dtypes: kRun's) -------

struct NormBwdCall {
  ffi::AnyBuffer dy, x;
  const float* mean;    // [B, M], or nullptr (rmsnorm)
  const float* rsigma;  // [B, M]
  const float* gamma;   // [B, H]
  ffi::AnyBuffer dx;
  float* dgamma;        // [B, H]
  float* dbeta;         // [B, H], or nullptr (rmsnorm)
  float* workspace;
  int64_t workspace_elems;
  MatrixBatch mb;
  NormAttrs na;
};

template <auto kRun, typename... Ctx>
struct NormBwdEntry {
  static ffi::Error Call(Ctx... ctx, ffi::AnyBuffer dy, ffi::AnyBuffer x, F32Arg mean, F32Arg rsigma, F32Arg gamma,
                         AnyRet dx, F32Ret dgamma, F32Ret dbeta, F32Ret workspace, NormBwdAttrs attrs) {
    auto mb_or = MatrixBatchOf(x, "x");
    if (mb_or.has_error()) return mb_or.error();
    NormBwdCall c{dy, x, nullptr, rsigma.typed_data(), gamma.typed_data(), *dx, dgamma->typed_data(), nullptr,
                  workspace->typed_data(), static_cast<int64_t>(workspace->element_count()), mb_or.value(), {}};
    TE_RETURN_IF_ERROR(ParseNormAttrs(attrs.kind, attrs.zero_centered_gamma, 0.0f, &c.na));
    const int64_t B = c.mb.batch, M = c.mb.rows, H = c.mb.cols;
    const bool rms = c.na.rms;
    TE_RETURN_IF_ERROR(CheckCount(dy, B * M * H, "dy"));
    TE_RETURN_IF_ERROR(CheckCount(*dx, B * M * H, "dx"));
    TE_RETURN_IF_ERROR(CheckCount(mean, rms ? 0 : B * M, "mean"));
    TE_RETURN_IF_ERROR(CheckCount(rsigma, B * M, "rsigma"));
    TE_RETURN_IF_ERROR(CheckCount(gamma, B * H, "gamma"));
    TE_RETURN_IF_ERROR(CheckCount(*dgamma, B * H, "dgamma"));
    TE_RETURN_IF_ERROR(CheckCount(*dbeta, rms ? 0 : B * H, "dbeta"));
    if (!rms) {
      c.mean = mean.typed_data();
      c.dbeta = dbeta->typed_data();
    }
    return kRun(ctx..., c);
  }
};

// ---- te_jax_act_fwd / te_jax_act_bwd -------------------------------------------------

// act_fwd: x [B, M, N] -> the cast of act(x) [B, M, F]. act_bwd: dy [B, M, F]
// and x -> the cast of dx [B, M, N], and dbias [B, N] when asked (dtypes: kRun's).
struct ActCall {
  ffi::AnyBuffer dy;  // act_bwd only
  ffi::AnyBuffer x;
  const float* scale;
  const uint32_t* key;
  FusedCastOut out;
  float* dbias;       // act_bwd with dbias, else nullptr
  float* workspace;   // act_bwd only
  int64_t workspace_elems;
  MatrixBatch mb;     // x
  ActKind act;
  CastSpec sp;
  int64_t out_cols;   // F
};

// The checks act_fwd and act_bwd share; the cast is of the activation's output [B, M, F]
// (`cast_of_output`) or of dx [B, M, N].
template <typename Attrs>
ffi::Error CheckAct(const Attrs& attrs, const F32Arg& scale, const U32Arg& key, bool cast_of_output,
                    ActCall* c) {
  auto mb = InputBatch(c->x);
  if (mb.has_error()) return mb.error();
  c->mb = mb.value();
  TE_RETURN_IF_ERROR(ParseAct(attrs.act, &c->act));
  TE_RETURN_IF_ERROR(ParseCastSpec(attrs, &c->sp));
  TE_RETURN_IF_ERROR(OutCols(c->act, c->mb.cols, &c->out_cols));
  const MatrixBatch cast{c->mb.batch, c->mb.rows, cast_of_output ? c->out_cols : c->mb.cols};
  TE_RETURN_IF_ERROR(CheckCastOutputs(c->sp, cast, c->out));
  return CheckCastOperands(scale, key, c->mb.batch);
}

template <auto kRun, typename... Ctx>
struct ActFwdEntry {
  static ffi::Error Call(Ctx... ctx, ffi::AnyBuffer x, F32Arg scale, U32Arg key, AnyRet q, AnyRet s, AnyRet q_t,
                         AnyRet s_t, AnyRet amax, AnyRet amax_t, AnyRet scale_out, ActFwdAttrs attrs) {
    ActCall c{x, x, scale.typed_data(), key.typed_data(),
              FusedCastOut{*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out}, nullptr, nullptr, 0, {}, {}, {}, 0};
    TE_RETURN_IF_ERROR(CheckAct(attrs, scale, key, /*cast_of_output=*/true, &c));
    return kRun(ctx..., c);
  }
};

template <auto kRun, typename... Ctx>
struct ActBwdEntry {
  static ffi::Error Call(Ctx... ctx, ffi::AnyBuffer dy, ffi::AnyBuffer x, F32Arg scale, U32Arg key, AnyRet q,
                         AnyRet s, AnyRet q_t, AnyRet s_t, AnyRet amax, AnyRet amax_t, AnyRet scale_out, F32Ret dbias,
                         F32Ret workspace, ActBwdAttrs attrs) {
    ActCall c{dy, x, scale.typed_data(), key.typed_data(),
              FusedCastOut{*q, *s, *q_t, *s_t, *amax, *amax_t, *scale_out}, nullptr, workspace->typed_data(),
              static_cast<int64_t>(workspace->element_count()), {}, {}, {}, 0};
    TE_RETURN_IF_ERROR(CheckAct(attrs, scale, key, /*cast_of_output=*/false, &c));
    const int64_t B = c.mb.batch;
    TE_RETURN_IF_ERROR(CheckCount(dy, B * c.mb.rows * c.out_cols, "dy"));
    TE_RETURN_IF_ERROR(CheckCount(*dbias, attrs.dbias ? B * c.mb.cols : 0, "dbias"));
    if (attrs.dbias) c.dbias = dbias->typed_data();
    return kRun(ctx..., c);
  }
};

}  // namespace te_jax
