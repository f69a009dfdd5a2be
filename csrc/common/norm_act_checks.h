// The operand checks of the norm and activation targets, shared by their CPU
// and CUDA handlers (the same contract, the same errors). Each parses the
// attributes and checks every operand and result the handlers have in common;
// what differs per platform (dtype agreement of gradients, the GPU workspace)
// stays with the handler.
#pragma once

#include <cstdint>

#include "ffi_common.h"
#include "norm_act.h"

namespace te_jax {

// The seven cast results, as the handlers receive them.
struct CastOutputRefs {
  const ffi::AnyBuffer &q, &s, &q_t, &s_t, &amax, &amax_t, &scale;
};

inline ffi::Error CheckCastOutputs(const CastSpec& sp, const MatrixBatch& mb, const CastOutputRefs& r) {
  return CheckCastResults(sp, mb, r.q, r.s, r.q_t, r.s_t, r.amax, r.amax_t, r.scale);
}

// te_jax_norm_fwd: x [B, M, H] -> the cast of norm(x), mean and rsigma [B, M].
struct NormFwdArgs {
  MatrixBatch mb;
  NormAttrs na;
  CastSpec sp;
  bool has_beta = false;
};

inline ffi::Error CheckNormFwd(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& gamma,
                               const ffi::Buffer<ffi::F32>& beta, const ffi::Buffer<ffi::F32>& scale,
                               const ffi::Buffer<ffi::U32>& key, const CastOutputRefs& out,
                               const ffi::Buffer<ffi::F32>& mean, const ffi::Buffer<ffi::F32>& rsigma,
                               const ffi::Dictionary& attrs, NormFwdArgs* a) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  a->mb = mb_or.value();
  TE_RETURN_IF_ERROR(ParseNormAttrs(attrs, true, &a->na));
  TE_RETURN_IF_ERROR(ParseCastSpec(attrs, &a->sp));
  TE_RETURN_IF_ERROR(CheckCastOutputs(a->sp, a->mb, out));
  const int64_t B = a->mb.batch, M = a->mb.rows, H = a->mb.cols;
  TE_RETURN_IF_ERROR(CheckCount(gamma, B * H, "gamma"));
  a->has_beta = beta.element_count() != 0;
  if (a->has_beta) TE_RETURN_IF_ERROR(CheckCount(beta, B * H, "beta"));
  if (a->has_beta && a->na.rms) return InvalidArgument("rmsnorm takes no beta");
  TE_RETURN_IF_ERROR(CheckCount(scale, B, "scale"));
  TE_RETURN_IF_ERROR(CheckCount(key, 2 * B, "key"));
  TE_RETURN_IF_ERROR(CheckCount(mean, a->na.rms ? 0 : B * M, "mean"));
  return CheckCount(rsigma, B * M, "rsigma");
}

// te_jax_norm_bwd: the shapes of dy, x, the statistics, gamma and the gradients (dtypes: the handler's).
inline ffi::Error CheckNormBwd(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& mean,
                               const ffi::Buffer<ffi::F32>& rsigma, const ffi::Buffer<ffi::F32>& gamma,
                               const ffi::AnyBuffer& dx, const ffi::Buffer<ffi::F32>& dgamma,
                               const ffi::Buffer<ffi::F32>& dbeta, const ffi::Dictionary& attrs, MatrixBatch* mb,
                               NormAttrs* na) {
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  *mb = mb_or.value();
  TE_RETURN_IF_ERROR(ParseNormAttrs(attrs, false, na));
  const int64_t B = mb->batch, M = mb->rows, H = mb->cols;
  TE_RETURN_IF_ERROR(CheckCount(dy, B * M * H, "dy"));
  TE_RETURN_IF_ERROR(CheckCount(dx, B * M * H, "dx"));
  TE_RETURN_IF_ERROR(CheckCount(mean, na->rms ? 0 : B * M, "mean"));
  TE_RETURN_IF_ERROR(CheckCount(rsigma, B * M, "rsigma"));
  TE_RETURN_IF_ERROR(CheckCount(gamma, B * H, "gamma"));
  TE_RETURN_IF_ERROR(CheckCount(dgamma, B * H, "dgamma"));
  return CheckCount(dbeta, na->rms ? 0 : B * H, "dbeta");
}

// te_jax_act_fwd: x [B, M, N] -> the cast of act(x) [B, M, F].
struct ActArgs {
  MatrixBatch mb;  // x
  ActKind act = ActKind::kGelu;
  CastSpec sp;
  int64_t out_cols = 0;  // F
  bool dbias = false;    // act_bwd only
};

inline ffi::Error CheckActFwd(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& scale,
                              const ffi::Buffer<ffi::U32>& key, const CastOutputRefs& out,
                              const ffi::Dictionary& attrs, ActArgs* a) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  a->mb = mb_or.value();
  TE_RETURN_IF_ERROR(ParseAct(attrs, &a->act));
  TE_RETURN_IF_ERROR(ParseCastSpec(attrs, &a->sp));
  TE_RETURN_IF_ERROR(OutCols(a->act, a->mb.cols, &a->out_cols));
  TE_RETURN_IF_ERROR(CheckCastOutputs(a->sp, MatrixBatch{a->mb.batch, a->mb.rows, a->out_cols}, out));
  TE_RETURN_IF_ERROR(CheckCount(scale, a->mb.batch, "scale"));
  return CheckCount(key, 2 * a->mb.batch, "key");
}

// te_jax_act_bwd: dx (the cast results) [B, M, N], dbias [B, N] when asked (dy and dtypes: the handler's).
inline ffi::Error CheckActBwd(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& scale,
                              const ffi::Buffer<ffi::U32>& key, const CastOutputRefs& out,
                              const ffi::Buffer<ffi::F32>& dbias, const ffi::Dictionary& attrs, ActArgs* a) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  a->mb = mb_or.value();
  TE_RETURN_IF_ERROR(ParseAct(attrs, &a->act));
  TE_RETURN_IF_ERROR(ParseCastSpec(attrs, &a->sp));
  auto want_dbias = attrs.get<bool>("dbias");
  if (want_dbias.has_error()) return want_dbias.error();
  a->dbias = want_dbias.value();
  TE_RETURN_IF_ERROR(OutCols(a->act, a->mb.cols, &a->out_cols));
  TE_RETURN_IF_ERROR(CheckCastOutputs(a->sp, a->mb, out));
  const int64_t B = a->mb.batch;
  TE_RETURN_IF_ERROR(CheckCount(dbias, a->dbias ? B * a->mb.cols : 0, "dbias"));
  TE_RETURN_IF_ERROR(CheckCount(scale, B, "scale"));
  return CheckCount(key, 2 * B, "key");
}

}  // namespace te_jax
