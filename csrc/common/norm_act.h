// Shared by the CPU and CUDA norm/activation handlers: the cast modes and
// their typed FFI attributes, explicitly rounded float32 arithmetic, and the
// activation functions and their derivatives. The float32 formulas here are
// the same as te_jax/quantize/ref_norm_act.py, operation for operation.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "ffi_common.h"
#include "numerics.h"

namespace te_jax {

// ---- the fused cast: modes and attributes ------------------------------------------

// How the op's output is written (te_jax/ops/fused_cast.py has the Python side).
enum class CastMode : int {
  kNone = 0,   // unquantized, in the dtype of result `q`
  kFp8Tensor,  // per-tensor FP8 with the given scale (delayed scaling); amax of the output too
  kFp8Current, // per-tensor FP8, scale from the output's own amax (statistics pass first)
  kMxfp8,      // 1x32 blocks, E8M0 scales
  kFp8Block,   // 1x128 blocks, float32 1/scale
  kNvfp4,      // 1x16 blocks, E4M3 scales, float32 global amax (statistics pass first)
};

struct CastSpec {
  CastMode mode = CastMode::kNone;
  bool rowwise = true;
  bool colwise = false;
  bool power_2 = false;   // kFp8Current, kFp8Block
  float epsilon = 0.0f;   // kFp8Current: amax lower bound
  bool rht = false;       // kNvfp4: Hadamard transform on the columnwise copy
  bool sr = false;        // kNvfp4: stochastic rounding
};

inline bool NeedsAmaxPass(CastMode m) { return m == CastMode::kFp8Current || m == CastMode::kNvfp4; }
inline bool IsFp8Mode(CastMode m) { return m != CastMode::kNone && m != CastMode::kNvfp4; }
inline bool IsPerTensor(CastMode m) { return m == CastMode::kFp8Tensor || m == CastMode::kFp8Current; }

// Block length along the blocked axis (0: no blocks).
inline int64_t BlockOf(CastMode m) {
  switch (m) {
    case CastMode::kMxfp8: return kMxfp8Block;
    case CastMode::kFp8Block: return kFp8Block;
    case CastMode::kNvfp4: return kNvfp4Block;
    default: return 0;
  }
}

// The typed FFI attributes of the norm/activation targets (decoded by XLA,
// names and types checked; registered at the end of this file). Each target
// takes the seven cast attributes of te_jax/ops/fused_cast.py's CastSpec
// after its own: mode (string), rowwise, colwise, power_2, amax_epsilon, rht,
// stochastic_rounding.
#define TE_JAX_CAST_ATTR_FIELDS \
  std::string_view mode;        \
  bool rowwise;                 \
  bool colwise;                 \
  bool power_2;                 \
  float amax_epsilon;           \
  bool rht;                     \
  bool stochastic_rounding;
#define TE_JAX_CAST_ATTR_MEMBERS                                                                         \
  ::xla::ffi::StructMember<std::string_view>("mode"), ::xla::ffi::StructMember<bool>("rowwise"),         \
      ::xla::ffi::StructMember<bool>("colwise"), ::xla::ffi::StructMember<bool>("power_2"),              \
      ::xla::ffi::StructMember<float>("amax_epsilon"), ::xla::ffi::StructMember<bool>("rht"),            \
      ::xla::ffi::StructMember<bool>("stochastic_rounding")

struct NormFwdAttrs {  // te_jax_norm_fwd
  std::string_view kind;  // "layernorm" | "rmsnorm"
  bool zero_centered_gamma;
  float epsilon;
  TE_JAX_CAST_ATTR_FIELDS
};
struct NormBwdAttrs {  // te_jax_norm_bwd
  std::string_view kind;
  bool zero_centered_gamma;
};
struct ActFwdAttrs {  // te_jax_act_fwd
  std::string_view act;
  TE_JAX_CAST_ATTR_FIELDS
};
struct ActBwdAttrs {  // te_jax_act_bwd
  std::string_view act;
  bool dbias;
  TE_JAX_CAST_ATTR_FIELDS
};

// The CastSpec of a target's cast attributes (any of the structs above but NormBwdAttrs).
template <typename Attrs>
ffi::Error ParseCastSpec(const Attrs& attrs, CastSpec* spec) {
  const std::string_view m = attrs.mode;
  if (m == "none") spec->mode = CastMode::kNone;
  else if (m == "fp8_tensor") spec->mode = CastMode::kFp8Tensor;
  else if (m == "fp8_current") spec->mode = CastMode::kFp8Current;
  else if (m == "mxfp8") spec->mode = CastMode::kMxfp8;
  else if (m == "fp8_block") spec->mode = CastMode::kFp8Block;
  else if (m == "nvfp4") spec->mode = CastMode::kNvfp4;
  else return InvalidArgument("unknown cast mode '" + std::string(m) + "'");
  spec->rowwise = attrs.rowwise;
  spec->colwise = attrs.colwise;
  spec->power_2 = attrs.power_2;
  spec->rht = attrs.rht;
  spec->sr = attrs.stochastic_rounding;
  spec->epsilon = attrs.amax_epsilon;
  if (!spec->rowwise && !spec->colwise) return InvalidArgument("ask for at least one of rowwise or colwise");
  if (spec->mode == CastMode::kNone && spec->colwise) return InvalidArgument("an unquantized output has no columnwise copy");
  if (spec->rht && !(spec->mode == CastMode::kNvfp4 && spec->colwise)) spec->rht = false;
  return ffi::Error::Success();
}

// The seven cast results every norm/activation target writes, in this order:
//   q     [B, M, N] (kNone: the output itself; kNvfp4: [B, M, N/2] packed) or empty
//   s     rowwise scales: per-tensor modes scale_inv [B, 1]; block modes [B, M, N/blk]; else empty
//   q_t   [B, N, M] ([B, N, M/2] packed) or empty
//   s_t   [B, N, M/blk] (block modes) or empty
//   amax  [B, 1]: kFp8Tensor, kFp8Current, kNvfp4 (amax of the output); else empty
//   amax_t [B, 1]: kNvfp4 (of the columnwise copy, after the Hadamard transform); else empty
//   scale [B, 1]: kFp8Current (the computed scale); else empty
// Checks their element types and sizes for a batch of `mb` matrices.
inline ffi::Error CheckCastResults(const CastSpec& sp, const MatrixBatch& mb, const ffi::AnyBuffer& q,
                                   const ffi::AnyBuffer& s, const ffi::AnyBuffer& q_t, const ffi::AnyBuffer& s_t,
                                   const ffi::AnyBuffer& amax, const ffi::AnyBuffer& amax_t,
                                   const ffi::AnyBuffer& scale) {
  const int64_t B = mb.batch, M = mb.rows, N = mb.cols;
  const bool row = sp.rowwise, col = sp.colwise;
  const bool per_tensor = IsPerTensor(sp.mode);
  const int64_t blk = BlockOf(sp.mode);
  if (blk) {
    if (row) TE_RETURN_IF_ERROR(CheckDivisible(N, blk, "the last axis (N)"));
    if (col || sp.rht) TE_RETURN_IF_ERROR(CheckDivisible(M, blk, "the row axis (M)"));
  }
  if (sp.mode == CastMode::kNone) {
    if (!IsHighPrecision(q.element_type())) return InvalidArgument("q: the unquantized output must be float32, bfloat16 or float16");
  } else if (sp.mode == CastMode::kNvfp4) {
    if (q.element_type() != ffi::DataType::U8 || q_t.element_type() != ffi::DataType::U8) {
      return InvalidArgument("NVFP4 data must be uint8");
    }
    if (s.element_type() != ffi::DataType::F8E4M3FN || s_t.element_type() != ffi::DataType::F8E4M3FN) {
      return InvalidArgument("NVFP4 block scales must be float8_e4m3fn");
    }
  } else {
    auto f = Fp8FormatOf(q.element_type());
    if (!f || q_t.element_type() != q.element_type()) {
      return InvalidArgument("quantized outputs must both be float8_e4m3fn or float8_e5m2");
    }
    const ffi::DataType st = sp.mode == CastMode::kMxfp8 ? ffi::DataType::U8 : ffi::DataType::F32;
    if (s.element_type() != st || (blk && s_t.element_type() != st)) return InvalidArgument("scales have the wrong dtype");
  }
  const int64_t pack = sp.mode == CastMode::kNvfp4 ? 2 : 1;
  TE_RETURN_IF_ERROR(CheckOutput(q, "q", row, B, M, N / pack));
  TE_RETURN_IF_ERROR(CheckOutput(q_t, "q_t", col, B, N, M / pack));
  if (per_tensor) {
    TE_RETURN_IF_ERROR(CheckOutput(s, "s", true, B, 1, 1));
    TE_RETURN_IF_ERROR(CheckOutput(s_t, "s_t", false, B, 1, 1));
  } else if (blk) {
    TE_RETURN_IF_ERROR(CheckOutput(s, "s", row, B, M, N / blk));
    TE_RETURN_IF_ERROR(CheckOutput(s_t, "s_t", col, B, N, M / blk));
  } else {
    TE_RETURN_IF_ERROR(CheckOutput(s, "s", false, B, 1, 1));
    TE_RETURN_IF_ERROR(CheckOutput(s_t, "s_t", false, B, 1, 1));
  }
  const bool has_amax = per_tensor || sp.mode == CastMode::kNvfp4;
  TE_RETURN_IF_ERROR(CheckOutput(amax, "amax", has_amax, B, 1, 1));
  TE_RETURN_IF_ERROR(CheckOutput(amax_t, "amax_t", sp.mode == CastMode::kNvfp4, B, 1, 1));
  TE_RETURN_IF_ERROR(CheckOutput(scale, "scale", sp.mode == CastMode::kFp8Current, B, 1, 1));
  for (const ffi::AnyBuffer* b : {&amax, &amax_t, &scale}) {
    if (b->element_count() && b->element_type() != ffi::DataType::F32) return InvalidArgument("amax/scale results must be float32");
  }
  return ffi::Error::Success();
}

// Checks that an input/output holds `want` elements.
template <typename BufferT>
ffi::Error CheckCount(const BufferT& b, int64_t want, const char* name) {
  if (static_cast<int64_t>(b.element_count()) != want) {
    return InvalidArgument(std::string(name) + ": expected " + std::to_string(want) + " elements, got shape " +
                           DimsToString(b.dimensions()));
  }
  return ffi::Error::Success();
}

// ---- explicitly rounded float32 arithmetic ----------------------------------------------
// No multiply-add contraction: the CUDA build uses the _rn intrinsics, the CPU
// sources are compiled with -ffp-contract=off.

TE_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TE_HD float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TE_HD float SubRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TE_HD float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ---- normalization -----------------------------------------------------------------------

// xhat = (x - mean) * rsigma (layernorm) or x * rsigma (rmsnorm); then
// y = xhat * w + b (no "+ b" without a bias), each operation rounded to float32.
TE_HD float NormXhat(float x, float mean, float rsigma, bool rms) {
  return rms ? MulRn(x, rsigma) : MulRn(SubRn(x, mean), rsigma);
}
TE_HD float NormApply(float x, float mean, float rsigma, float w, float b, bool rms, bool has_beta) {
  const float t = MulRn(NormXhat(x, mean, rsigma, rms), w);
  return has_beta ? AddRn(t, b) : t;
}
// The weight: gamma or, with zero-centred gamma, 1 + gamma.
TE_HD float NormWeight(float gamma, bool zero_centered) { return zero_centered ? AddRn(1.0f, gamma) : gamma; }

// The norm's attributes: kind ("layernorm" | "rmsnorm"), zero_centered_gamma, epsilon.
struct NormAttrs {
  bool rms = false;
  bool zero_centered_gamma = false;
  float epsilon = 0.0f;
};

inline ffi::Error ParseNormAttrs(std::string_view kind, bool zero_centered_gamma, float epsilon, NormAttrs* na) {
  if (kind == "rmsnorm") na->rms = true;
  else if (kind != "layernorm") return InvalidArgument("norm kind must be layernorm or rmsnorm");
  na->zero_centered_gamma = zero_centered_gamma;
  na->epsilon = epsilon;
  return ffi::Error::Success();
}


// rsigma = 1 / sqrt(var + eps), correctly rounded sqrt and division.
TE_HD float RsigmaOf(float var, float eps) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
#else
  return 1.0f / std::sqrt(var + eps);
#endif
}

// ---- activations -------------------------------------------------------------------------

enum class ActKind : int { kGelu = 0, kRelu, kSilu, kSrelu, kSwiglu, kGeglu };

inline ffi::Error ParseAct(std::string_view a, ActKind* act) {
  if (a == "gelu") *act = ActKind::kGelu;
  else if (a == "relu") *act = ActKind::kRelu;
  else if (a == "silu") *act = ActKind::kSilu;
  else if (a == "squared_relu") *act = ActKind::kSrelu;
  else if (a == "swiglu") *act = ActKind::kSwiglu;
  else if (a == "geglu") *act = ActKind::kGeglu;
  else return InvalidArgument("unknown activation '" + std::string(a) + "'");
  return ffi::Error::Success();
}

TE_HD bool IsGated(ActKind k) { return k == ActKind::kSwiglu || k == ActKind::kGeglu; }

// Calls f(std::integral_constant<ActKind, k>{}) for the run-time kind k: the
// kernels apply the activation to 8 values inside f, so the kind's switch
// runs once per 8 values instead of once per value.
template <class F>
TE_HD void WithActKind(ActKind k, F&& f) {
  switch (k) {
    case ActKind::kGelu: f(std::integral_constant<ActKind, ActKind::kGelu>{}); return;
    case ActKind::kRelu: f(std::integral_constant<ActKind, ActKind::kRelu>{}); return;
    case ActKind::kSilu: f(std::integral_constant<ActKind, ActKind::kSilu>{}); return;
    case ActKind::kSrelu: f(std::integral_constant<ActKind, ActKind::kSrelu>{}); return;
    case ActKind::kSwiglu: f(std::integral_constant<ActKind, ActKind::kSwiglu>{}); return;
    default: f(std::integral_constant<ActKind, ActKind::kGeglu>{}); return;
  }
}

// Output columns of the activation for an input with n columns.
inline ffi::Error OutCols(ActKind act, int64_t n, int64_t* out) {
  if (IsGated(act) && n % 2) return InvalidArgument("a gated activation needs an even last axis [..., 2F]");
  *out = IsGated(act) ? n / 2 : n;
  return ffi::Error::Success();
}

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK = 0.044715f;

// tanh and exp of the CPU's activations (the GPU's take LogisticGpu below).
inline float TanhF(float x) { return std::tanh(x); }
inline float ExpF(float x) { return std::exp(x); }

#if defined(__CUDA_ARCH__)
// The GPU's logistic 1 / (1 + exp(-v)) with the hardware exp2 and reciprocal
// (MUFU.EX2, MUFU.RCP: a few ulps, no slow paths). gelu's 0.5 (1 + tanh(u))
// equals the logistic of 2u, and silu's is the logistic of x: the GPU
// computes both that way, in about a third of tanhf's or expf's and a
// division's instructions. exp(-v) = inf gives 0 and NaN gives NaN, as the
// CPU's formulas do (docs/norm_act.md).
__device__ __forceinline__ float LogisticGpu(float v) { return __fdividef(1.0f, 1.0f + __expf(-v)); }
#endif

// The activation applied to x (the activated half for the gated kinds).
//   gelu: x * (0.5 * (1 + tanh(c * (x + k * (x * x * x)))))
//   relu: x > 0 ? x : 0 (NaN stays NaN); squared_relu: relu(x)^2
//   silu: x * (1 / (1 + exp(-x)))
// On the GPU gelu and silu use LogisticGpu (equal in exact arithmetic).
TE_HD float ActValue(ActKind k, float x) {
  switch (k) {
    case ActKind::kGelu:
    case ActKind::kGeglu: {
      const float inner = MulRn(kGeluC, AddRn(x, MulRn(kGeluK, MulRn(MulRn(x, x), x))));
#if defined(__CUDA_ARCH__)
      return MulRn(x, LogisticGpu(2.0f * inner));
#else
      return MulRn(x, MulRn(0.5f, AddRn(1.0f, TanhF(inner))));
#endif
    }
    case ActKind::kSilu:
    case ActKind::kSwiglu:
#if defined(__CUDA_ARCH__)
      return MulRn(x, LogisticGpu(x));
#else
      return MulRn(x, DivRn(1.0f, AddRn(1.0f, ExpF(-x))));
#endif
    case ActKind::kRelu:
      return (x > 0.0f || IsNanF(x)) ? x : 0.0f;
    default: {  // kSrelu
      const float r = (x > 0.0f || IsNanF(x)) ? x : 0.0f;
      return MulRn(r, r);
    }
  }
}

// d act / dx at x.
//   gelu: 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 k x^2), t = tanh(c (x + k x^3))
//   silu: s (1 + x (1 - s)), s = 1 / (1 + exp(-x)); relu: x > 0; squared_relu: 2 relu(x)
TE_HD float ActGrad(ActKind k, float x) {
  switch (k) {
    case ActKind::kGelu:
    case ActKind::kGeglu: {
#if defined(__CUDA_ARCH__)
      // With s = 0.5 (1 + t) = logistic(2u): 0.5 (1 - t^2) = 2 s (1 - s).
      const float x2 = x * x;
      const float s = LogisticGpu(2.0f * (kGeluC * (x + kGeluK * (x2 * x))));
      return s + 2.0f * x * (s * (1.0f - s)) * (kGeluC * (1.0f + 3.0f * kGeluK * x2));
#else
      const float x2 = MulRn(x, x);
      const float t = TanhF(MulRn(kGeluC, AddRn(x, MulRn(kGeluK, MulRn(x2, x)))));
      const float left = MulRn(0.5f, AddRn(1.0f, t));
      const float dinner = MulRn(kGeluC, AddRn(1.0f, MulRn(3.0f * kGeluK, x2)));
      const float right = MulRn(MulRn(MulRn(0.5f, x), SubRn(1.0f, MulRn(t, t))), dinner);
      return AddRn(left, right);
#endif
    }
    case ActKind::kSilu:
    case ActKind::kSwiglu: {
#if defined(__CUDA_ARCH__)
      const float s = LogisticGpu(x);
#else
      const float s = DivRn(1.0f, AddRn(1.0f, ExpF(-x)));
#endif
      return MulRn(s, AddRn(1.0f, MulRn(x, SubRn(1.0f, s))));
    }
    case ActKind::kRelu:
      return IsNanF(x) ? x : (x > 0.0f ? 1.0f : 0.0f);
    default: {  // kSrelu
      const float r = (x > 0.0f || IsNanF(x)) ? x : 0.0f;
      return MulRn(2.0f, r);
    }
  }
}

// Forward of element (row, j) of the output. Gated: a = x[j], g = x[F + j]:
// act(a) * g. Plain: act(x[j]).
TE_HD float ActForwardGated(ActKind k, float a, float g) { return MulRn(ActValue(k, a), g); }

// Backward of a gated activation: d a = dy * g * act'(a), d g = dy * act(a).
TE_HD float ActGradGatedA(ActKind k, float dy, float a, float g) { return MulRn(MulRn(dy, g), ActGrad(k, a)); }
TE_HD float ActGradGatedG(ActKind k, float dy, float a) { return MulRn(dy, ActValue(k, a)); }
TE_HD float ActGradPlain(ActKind k, float dy, float x) { return MulRn(dy, ActGrad(k, x)); }

}  // namespace te_jax

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::te_jax::NormFwdAttrs, ::xla::ffi::StructMember<std::string_view>("kind"),
                                      ::xla::ffi::StructMember<bool>("zero_centered_gamma"),
                                      ::xla::ffi::StructMember<float>("epsilon"), TE_JAX_CAST_ATTR_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::te_jax::NormBwdAttrs, ::xla::ffi::StructMember<std::string_view>("kind"),
                                      ::xla::ffi::StructMember<bool>("zero_centered_gamma"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::te_jax::ActFwdAttrs, ::xla::ffi::StructMember<std::string_view>("act"),
                                      TE_JAX_CAST_ATTR_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::te_jax::ActBwdAttrs, ::xla::ffi::StructMember<std::string_view>("act"),
                                      ::xla::ffi::StructMember<bool>("dbias"), TE_JAX_CAST_ATTR_MEMBERS);
