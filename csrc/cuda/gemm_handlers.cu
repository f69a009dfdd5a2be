// CUDA FFI handlers for the GEMM targets (contract: docs/gemm_ffi.md):
//   te_jax_gemm_fp8        -> GemmFp8Cuda       per-tensor FP8, cuBLASLt scalar scales
//   te_jax_gemm_fp8_block  -> GemmFp8BlockCuda  1x128 / 128x128 float32 block scales (cuBLASLt >= 12.9, sm_90)
//   te_jax_gemm_mxfp8      -> GemmMxfp8Cuda     sm_100+: native VEC32_UE8M0; sm_90: bf16 emulation
//   te_jax_gemm_nvfp4      -> GemmNvfp4Cuda     sm_100+: native VEC16_UE4M3; sm_90: bf16 emulation
//
// Every handler: validate, carve the workspace result, enqueue the scale
// conversion / dequantize kernels, then one cuBLASLt matmul (strided-batched
// or with A's leading axes folded into M) or one per matrix when per-matrix
// scales or block scales of a batched B make that necessary (all with one
// plan, whose alignment assumptions hold for every matrix), then the
// bias/cast kernel if cuBLASLt's epilogue cannot produce the output itself.
//
// Each target is an FFI handler bundle (docs/gemm_ffi.md, "CUDA graphs"):
// <stem>InitializeCuda runs the same body in Stage::kInitialize, where it
// validates, carves the workspace and builds the cuBLASLt plans
// (PlanMatmuls), launching nothing else; <stem>Cuda, the execute stage,
// carries the command-buffer trait and only enqueues kernels and matmuls
// with the plans built there (RunMatmuls).
#include <string>

#include "gemm_cublaslt.cuh"
#include "gemm_kernels.cuh"
#include "gemm_problem.cuh"
#include "../common/bindings.h"

namespace te_jax {
namespace gemm {
namespace {

constexpr size_t kMinBlockScalingVersion = 120900;  // cuBLASLt 12.9

// The FFI stage a handler call serves (see the top of this file).
enum class Stage { kInitialize, kExecute };

// One handler call: where it runs, and whether it executes or only plans.
struct StageCall {
  cudaStream_t stream;
  int device;
  Stage stage;

  // Enqueues a small kernel (`launch()` returns its launch status); nothing
  // in the initialize stage, whose buffers hold no data yet.
  template <typename Launch>
  ffi::Error Kernel(Launch launch, const char* kernel, const Problem& p) const {
    if (stage == Stage::kInitialize) return ffi::Error::Success();
    return Launched(launch(), kernel, p);
  }
};

// One GEMM as `steps.calls` identical cuBLASLt calls whose pointers advance by the steps.
struct Calls {
  MatmulSpec spec;
  MatmulPointers first;
  MatmulSteps steps;
};

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Per-matrix calls (`loop`), one strided-batched call, or one call with A's
// leading axes folded into M (shared B).
void SetLayout(const Problem& p, bool loop, int64_t a_bits, int64_t b_bits, Calls* c) {
  const int64_t d_bits = c->spec.d_type == CUDA_R_32F ? 32 : 16;
  c->spec.n = p.n;
  c->spec.k = p.k;
  c->spec.m = p.m;
  c->spec.batch = 1;
  if (loop) {
    c->steps.calls = p.count;
    c->steps.a = p.m * p.k * a_bits / 8;
    c->steps.b = p.b_shared ? 0 : p.n * p.k * b_bits / 8;
    c->steps.d = p.m * p.n * d_bits / 8;
  } else if (p.b_shared) {
    c->spec.m = p.count * p.m;
  } else {
    c->spec.batch = p.count;
  }
}

// Shared tail of every handler: the plans (initialize stage), or the matmul
// call(s) into out (or the float32 staging buffer), then the bias/cast kernel
// when the output plan needs one.
ffi::Error Finish(const StageCall& call, const Problem& p, const OutputPlan& op, Calls& c,
                  const ffi::AnyBuffer& bias, ffi::AnyBuffer out, float* staging, const Workspace& ws) {
  c.spec.bias = op.epilogue;
  c.first.bias = op.epilogue ? bias.untyped_data() : nullptr;
  c.first.d = op.staged ? static_cast<void*>(staging) : out.untyped_data();
  c.first.workspace = ws.cublas_workspace();
  c.spec.workspace_bytes = ws.cublas_bytes();
  if (call.stage == Stage::kInitialize) return PlanMatmuls(c.spec, c.first, c.steps, call.stream);
  TE_RETURN_IF_ERROR(RunMatmuls(c.spec, c.first, c.steps, call.stream));
  if (op.staged || op.post_add) {
    const float* src = op.staged ? staging : static_cast<const float*>(out.untyped_data());
    const void* b = op.bias ? bias.untyped_data() : nullptr;
    TE_RETURN_IF_ERROR(Launched(LaunchFinalize(src, b, OutTypeOf(bias.element_type()), out.untyped_data(),
                                               OutTypeOf(out.element_type()), p.count * p.m, p.n, call.stream),
                                "the bias/cast kernel", p));
  }
  return ffi::Error::Success();
}

float* TakeStaging(const Problem& p, const OutputPlan& op, Workspace& ws) {
  return op.staged ? static_cast<float*>(ws.Take(4 * p.count * p.m * p.n)) : nullptr;
}

// The prologue every handler shares: enter the call's device, parse and
// check the shapes, skip an empty product; then `body(problem, call)`.
template <Stage kStage, typename Body>
ffi::Error WithProblem(cudaStream_t stream, int32_t device, const char* target, const ffi::AnyBuffer& a,
                       const ffi::AnyBuffer& b, int64_t k_div, const ffi::AnyBuffer& out, Body body) {
  DeviceGuard guard;
  TE_RETURN_IF_ERROR(guard.Enter(device));
  auto p_or = ParseProblem(target, a, b, k_div, out);
  if (p_or.has_error()) return p_or.error();
  if (p_or.value().empty()) return ffi::Error::Success();
  return body(p_or.value(), StageCall{stream, device, kStage});
}

// ---- te_jax_gemm_fp8 ------------------------------------------------------------------

template <Stage kStage>
ffi::Error GemmFp8(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, bool autotune,
                   bool fast_accum) {
  return WithProblem<kStage>(stream, device, "te_jax_gemm_fp8", a, b, 1, *out,
                             [&](const Problem& p, const StageCall& call) {
    Calls c;
    TE_RETURN_IF_ERROR(CheckFp8Pair(p, a, b, &c.spec.a_type, &c.spec.b_type));
    TE_RETURN_IF_ERROR(CheckScalars(p, a_scale_inv, "a_scale_inv", p.count));
    TE_RETURN_IF_ERROR(CheckScalars(p, b_scale_inv, "b_scale_inv", p.b_count()));
    const int64_t a_n = static_cast<int64_t>(a_scale_inv.element_count());
    const int64_t b_n = static_cast<int64_t>(b_scale_inv.element_count());
    const bool a_per_matrix = a_n > 1, b_per_matrix = b_n > 1;
    auto op_or = PlanOutput(p, bias, *out, /*narrow=*/true);
    if (op_or.has_error()) return op_or.error();
    const OutputPlan op = op_or.value();
    Workspace ws(*workspace);
    float* staging = TakeStaging(p, op, ws);
    // cuBLASLt needs 16-byte aligned scale pointers: per-matrix values (4 bytes
    // apart), or a scale XLA placed at a smaller alignment, go through 256-byte
    // slots in the workspace (so every matrix of a loop has the same alignment).
    const auto* a_src = static_cast<const float*>(a_scale_inv.untyped_data());
    const auto* b_src = static_cast<const float*>(b_scale_inv.untyped_data());
    auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
    float* a_slots =
        a_per_matrix || !aligned16(a_src) ? static_cast<float*>(ws.Take(kScalarSlotBytes * a_n)) : nullptr;
    float* b_slots =
        b_per_matrix || !aligned16(b_src) ? static_cast<float*>(ws.Take(kScalarSlotBytes * b_n)) : nullptr;
    TE_RETURN_IF_ERROR(ws.Check(p));
    if (a_slots != nullptr) {
      TE_RETURN_IF_ERROR(call.Kernel([&] { return LaunchSpreadScalars(a_src, a_slots, a_n, call.stream); },
                                     "the a_scale_inv copy", p));
    }
    if (b_slots != nullptr) {
      TE_RETURN_IF_ERROR(call.Kernel([&] { return LaunchSpreadScalars(b_src, b_slots, b_n, call.stream); },
                                     "the b_scale_inv copy", p));
    }

    c.spec.device = call.device;
    c.spec.d_type = op.d_type;
    c.spec.a_scale = c.spec.b_scale = ScaleMode::kScalar;
    c.spec.fast_accum = fast_accum;
    c.spec.autotune = autotune;
    SetLayout(p, a_per_matrix || b_per_matrix, 8, 8, &c);
    c.first.a = a.untyped_data();
    c.first.b = b.untyped_data();
    c.first.a_scale = a_slots != nullptr ? static_cast<const void*>(a_slots) : a_src;
    c.first.b_scale = b_slots != nullptr ? static_cast<const void*>(b_slots) : b_src;
    c.steps.a_scale = a_per_matrix ? kScalarSlotBytes : 0;
    c.steps.b_scale = b_per_matrix ? kScalarSlotBytes : 0;
    return Finish(call, p, op, c, bias, *out, staging, ws);
  });
}

// ---- te_jax_gemm_fp8_block ------------------------------------------------------------

// No fast_accum: the block-scaled kernels always promote every 128-long K block into float32 sums.
template <Stage kStage>
ffi::Error GemmFp8Block(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b,
                        ffi::AnyBuffer b_s, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> workspace, bool autotune, bool a_block_2d, bool b_block_2d) {
  return WithProblem<kStage>(stream, device, "te_jax_gemm_fp8_block", a, b, 1, *out,
                             [&](const Problem& p, const StageCall& call) {
    Calls c;
    TE_RETURN_IF_ERROR(CheckFp8Pair(p, a, b, &c.spec.a_type, &c.spec.b_type));
    if (a_block_2d && b_block_2d) {
      return InvalidArgument(p.Describe() + ": cuBLASLt does not support 128x128 x 128x128 block scaling; "
                                            "quantize one operand with 1x128 blocks");
    }
    if (a_s.element_type() != ffi::DataType::F32 || b_s.element_type() != ffi::DataType::F32) {
      return InvalidArgument(p.Describe() + ": FP8 block scales must be float32");
    }
    TE_RETURN_IF_ERROR(CheckDivisible(p.k, kFp8Block, p.Describe() + ": K"));
    if (a_block_2d) TE_RETURN_IF_ERROR(CheckDivisible(p.m, kFp8Block, p.Describe() + ": M (A has 128x128 blocks)"));
    if (b_block_2d) TE_RETURN_IF_ERROR(CheckDivisible(p.n, kFp8Block, p.Describe() + ": N (B has 128x128 blocks)"));
    const int64_t l = p.k / kFp8Block, l4 = (l + 3) / 4 * 4;
    const int64_t a_rows = a_block_2d ? p.m / kFp8Block : p.m, b_rows = b_block_2d ? p.n / kFp8Block : p.n;
    TE_RETURN_IF_ERROR(CheckCount(p, a_s, "a_s", p.count * a_rows * l));
    TE_RETURN_IF_ERROR(CheckCount(p, b_s, "b_s", p.b_count() * b_rows * l));
    if (CublasLtVersion() < kMinBlockScalingVersion) {
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        p.Describe() + ": Float8 block scaling needs cuBLASLt >= 12.9, found version " +
                            std::to_string(CublasLtVersion()) + "; upgrade the nvidia-cublas package");
    }
    auto op_or = PlanOutput(p, bias, *out, /*narrow=*/true);
    if (op_or.has_error()) return op_or.error();
    const OutputPlan op = op_or.value();
    const bool loop = !p.b_shared;  // scale tensors have no batch stride in cuBLASLt
    // Per matrix (loop) or per folded matrix, the converted scales in floats;
    // in a loop each matrix's region starts 256-byte aligned, so one plan's
    // alignment assumptions hold for every matrix.
    const int64_t a_per = RoundUp(a_block_2d ? a_rows * l4 : a_rows * l, loop ? kScalarSlotBytes / 4 : 1);
    const int64_t b_per = RoundUp(b_block_2d ? b_rows * l4 : b_rows * l, loop ? kScalarSlotBytes / 4 : 1);
    Workspace ws(*workspace);
    float* staging = TakeStaging(p, op, ws);
    auto* a_conv = static_cast<float*>(ws.Take(4 * p.count * a_per));
    auto* b_conv = static_cast<float*>(ws.Take(4 * p.b_count() * b_per));
    TE_RETURN_IF_ERROR(ws.Check(p));

    const auto* a_src = static_cast<const float*>(a_s.untyped_data());
    const auto* b_src = static_cast<const float*>(b_s.untyped_data());
    // A: one region per matrix (loop), or A's leading axes folded into one matrix.
    const int64_t a_mats = loop ? p.count : 1, a_mat_rows = loop ? a_rows : p.count * a_rows;
    const int64_t a_stride = loop ? a_per : p.count * a_per;
    TE_RETURN_IF_ERROR(call.Kernel(
        [&] {
          return a_block_2d ? LaunchPadScales(a_src, a_conv, a_mats, a_mat_rows, l, a_stride, call.stream)
                            : LaunchTransposeScales(a_src, a_conv, a_mats, a_mat_rows, l, a_stride, call.stream);
        },
        "the A block-scale conversion", p));
    TE_RETURN_IF_ERROR(call.Kernel(
        [&] {
          return b_block_2d ? LaunchPadScales(b_src, b_conv, p.b_count(), b_rows, l, b_per, call.stream)
                            : LaunchTransposeScales(b_src, b_conv, p.b_count(), p.n, l, b_per, call.stream);
        },
        "the B block-scale conversion", p));

    c.spec.device = call.device;
    c.spec.d_type = op.d_type;
    c.spec.autotune = autotune;
    c.spec.a_scale = a_block_2d ? ScaleMode::kBlk128x128 : ScaleMode::kVec128;
    c.spec.b_scale = b_block_2d ? ScaleMode::kBlk128x128 : ScaleMode::kVec128;
    SetLayout(p, loop, 8, 8, &c);
    c.first.a = a.untyped_data();
    c.first.b = b.untyped_data();
    c.first.a_scale = a_conv;
    c.first.b_scale = b_conv;
    c.steps.a_scale = loop ? 4 * a_per : 0;
    c.steps.b_scale = loop ? 4 * b_per : 0;
    ffi::Error err = Finish(call, p, op, c, bias, *out, staging, ws);
    if (err.failure()) {
      auto cc = ComputeCapability(call.device);
      if (cc.has_value() && cc.value() / 10 != 9) {
        return ffi::Error(*err.errc(), err.message() + ". Note: cuBLASLt documents 1x128/128x128 block scaling for "
                                                       "compute capability 9.0 only; this device is sm_" +
                                           std::to_string(cc.value()));
      }
    }
    return err;
  });
}

// ---- MXFP8 / NVFP4 ------------------------------------------------------------------------
//
// No fast_accum: the sums are float32 both on the native path (block-scaled
// MMA) and in the emulation (a bfloat16 GEMM with float32 accumulation).

// Native block-scaled path (sm_100+) or the bf16 emulation (sm_90).
ffi::ErrorOr<bool> UseNative(const Problem& p, int device) {
  auto cc = ComputeCapability(device);
  if (cc.has_error()) return ffi::Unexpected(cc.error());
  if (cc.value() >= 100) return true;
  if (cc.value() >= 90) return false;
  return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kUnimplemented,
                                    p.Describe() + ": needs compute capability 9.0 (emulated with a bfloat16 GEMM) "
                                                   "or 10.0+ (native block scaling); this device is sm_" +
                                        std::to_string(cc.value())));
}

// One MXFP8 or NVFP4 operand pair: the packed operands, their uint8 block-scale
// codes (K / block per row) and how each path reads them.
struct MicroScaled {
  const ffi::AnyBuffer& a;
  const ffi::AnyBuffer& b;
  const uint8_t* a_codes;
  const uint8_t* b_codes;
  int64_t sk;          // scale codes per row
  int64_t bits;        // bits per native element (8 or 4)
  ScaleMode mode;      // the native scale mode
  const char* name;    // "MXFP8" or "NVFP4", for messages
};

// Native path: swizzles both operands' scale codes into the workspace (one
// region per matrix of A when `loop`, else A's matrices folded into one) and
// points `c` at the native operands.
ffi::Error PlanNative(const StageCall& call, const Problem& p, const MicroScaled& op, bool loop, Workspace& ws,
                      Calls* c) {
  const int64_t a_per = loop ? SwizzledScaleBytes(p.m, op.sk) : SwizzledScaleBytes(p.count * p.m, op.sk);
  const int64_t b_per = SwizzledScaleBytes(p.n, op.sk);
  auto* a_swz = static_cast<uint8_t*>(ws.Take(loop ? p.count * a_per : a_per));
  auto* b_swz = static_cast<uint8_t*>(ws.Take(p.b_count() * b_per));
  TE_RETURN_IF_ERROR(ws.Check(p));
  TE_RETURN_IF_ERROR(call.Kernel(
      [&] {
        return loop ? LaunchSwizzleScales(op.a_codes, a_swz, p.count, p.m, op.sk, call.stream)
                    : LaunchSwizzleScales(op.a_codes, a_swz, 1, p.count * p.m, op.sk, call.stream);
      },
      "the A scale swizzle", p));
  TE_RETURN_IF_ERROR(call.Kernel(
      [&] { return LaunchSwizzleScales(op.b_codes, b_swz, p.b_count(), p.n, op.sk, call.stream); },
      "the B scale swizzle", p));
  c->spec.a_scale = c->spec.b_scale = op.mode;
  SetLayout(p, loop, op.bits, op.bits, c);
  c->first.a = op.a.untyped_data();
  c->first.b = op.b.untyped_data();
  c->first.a_scale = a_swz;
  c->first.b_scale = b_swz;
  c->steps.a_scale = loop ? a_per : 0;
  c->steps.b_scale = loop && !p.b_shared ? b_per : 0;
  return ffi::Error::Success();
}

// Emulation: `dequant(data, codes, side (0: A, 1: B), bf16 out, rows)` expands
// each operand to bfloat16 in the workspace; one bfloat16 GEMM follows.
template <typename Dequant>
ffi::Error PlanEmulated(const StageCall& call, const Problem& p, const MicroScaled& op, bool loop, Workspace& ws,
                        Dequant dequant, Calls* c) {
  auto* a_bf16 = static_cast<uint16_t*>(ws.Take(2 * p.count * p.m * p.k));
  auto* b_bf16 = static_cast<uint16_t*>(ws.Take(2 * p.b_count() * p.n * p.k));
  TE_RETURN_IF_ERROR(ws.Check(p));
  const std::string side[2] = {std::string("the A ") + op.name + " dequantize",
                               std::string("the B ") + op.name + " dequantize"};
  TE_RETURN_IF_ERROR(call.Kernel(
      [&] { return dequant(static_cast<const uint8_t*>(op.a.untyped_data()), op.a_codes, 0, a_bf16, p.count * p.m); },
      side[0].c_str(), p));
  TE_RETURN_IF_ERROR(call.Kernel(
      [&] {
        return dequant(static_cast<const uint8_t*>(op.b.untyped_data()), op.b_codes, 1, b_bf16, p.b_count() * p.n);
      },
      side[1].c_str(), p));
  c->spec.a_type = c->spec.b_type = CUDA_R_16BF;
  SetLayout(p, loop, 16, 16, c);
  c->first.a = a_bf16;
  c->first.b = b_bf16;
  return ffi::Error::Success();
}

// Checks the block-scale codes of both operands: [count, M, sk] and [b_count, N, sk].
ffi::Error CheckCodes(const Problem& p, const ffi::AnyBuffer& a_s, const ffi::AnyBuffer& b_s, int64_t sk) {
  TE_RETURN_IF_ERROR(CheckCount(p, a_s, "a_s", p.count * p.m * sk));
  return CheckCount(p, b_s, "b_s", p.b_count() * p.n * sk);
}

template <Stage kStage>
ffi::Error GemmMxfp8(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b,
                     ffi::AnyBuffer b_s, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> workspace, bool autotune) {
  return WithProblem<kStage>(stream, device, "te_jax_gemm_mxfp8", a, b, 1, *out,
                             [&](const Problem& p, const StageCall& call) {
    Calls c;
    TE_RETURN_IF_ERROR(CheckFp8Pair(p, a, b, &c.spec.a_type, &c.spec.b_type));
    if (a_s.element_type() != ffi::DataType::U8 || b_s.element_type() != ffi::DataType::U8) {
      return InvalidArgument(p.Describe() + ": MXFP8 scales must be uint8 E8M0 codes");
    }
    TE_RETURN_IF_ERROR(CheckDivisible(p.k, kMxfp8Block, p.Describe() + ": K"));
    const int64_t sk = p.k / kMxfp8Block;
    TE_RETURN_IF_ERROR(CheckCodes(p, a_s, b_s, sk));
    auto native = UseNative(p, call.device);
    if (native.has_error()) return native.error();
    auto op_or = PlanOutput(p, bias, *out, /*narrow=*/native.value());
    if (op_or.has_error()) return op_or.error();
    const OutputPlan op = op_or.value();
    const MicroScaled ms{a, b, static_cast<const uint8_t*>(a_s.untyped_data()),
                         static_cast<const uint8_t*>(b_s.untyped_data()), sk, 8, ScaleMode::kVec32Ue8m0, "MXFP8"};
    Workspace ws(*workspace);
    float* staging = TakeStaging(p, op, ws);
    c.spec.device = call.device;
    c.spec.d_type = op.d_type;
    c.spec.autotune = autotune;
    const bool e5[2] = {c.spec.a_type == CUDA_R_8F_E5M2, c.spec.b_type == CUDA_R_8F_E5M2};
    auto dequant = [&](const uint8_t* q, const uint8_t* codes, int side, uint16_t* dst, int64_t rows) {
      return LaunchDequantMxfp8ToBf16(q, codes, e5[side], dst, rows, p.k, call.stream);
    };
    TE_RETURN_IF_ERROR(native.value() ? PlanNative(call, p, ms, !p.b_shared, ws, &c)
                                      : PlanEmulated(call, p, ms, false, ws, dequant, &c));
    return Finish(call, p, op, c, bias, *out, staging, ws);
  });
}

template <Stage kStage>
ffi::Error GemmNvfp4(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer a_amax,
                     ffi::AnyBuffer b, ffi::AnyBuffer b_s, ffi::AnyBuffer b_amax, ffi::AnyBuffer bias,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, bool autotune) {
  return WithProblem<kStage>(stream, device, "te_jax_gemm_nvfp4", a, b, 2, *out,
                             [&](const Problem& p, const StageCall& call) {
    if (a.element_type() != ffi::DataType::U8 || b.element_type() != ffi::DataType::U8) {
      return InvalidArgument(p.Describe() + ": NVFP4 operands must be uint8 (two E2M1 codes per byte)");
    }
    if (a_s.element_type() != ffi::DataType::F8E4M3FN || b_s.element_type() != ffi::DataType::F8E4M3FN) {
      return InvalidArgument(p.Describe() + ": NVFP4 block scales must be float8_e4m3fn");
    }
    TE_RETURN_IF_ERROR(CheckDivisible(p.k, 2 * kNvfp4Block, p.Describe() + ": K (16-byte packed rows)"));
    const int64_t sk = p.k / kNvfp4Block;
    TE_RETURN_IF_ERROR(CheckCodes(p, a_s, b_s, sk));
    TE_RETURN_IF_ERROR(CheckScalars(p, a_amax, "a_amax", p.count));
    TE_RETURN_IF_ERROR(CheckScalars(p, b_amax, "b_amax", p.b_count()));
    auto native = UseNative(p, call.device);
    if (native.has_error()) return native.error();
    auto op_or = PlanOutput(p, bias, *out, /*narrow=*/native.value());
    if (op_or.has_error()) return op_or.error();
    const OutputPlan op = op_or.value();
    const int64_t a_amax_n = static_cast<int64_t>(a_amax.element_count());
    const int64_t b_amax_n = static_cast<int64_t>(b_amax.element_count());
    // One alpha per call: per-matrix amax (or native block scales of a batched B) need one call per matrix.
    const bool loop = a_amax_n > 1 || b_amax_n > 1 || (native.value() && !p.b_shared);
    const int64_t calls = loop ? p.count : 1;
    const MicroScaled ms{a, b, static_cast<const uint8_t*>(a_s.untyped_data()),
                         static_cast<const uint8_t*>(b_s.untyped_data()), sk, 4, ScaleMode::kVec16Ue4m3, "NVFP4"};
    Workspace ws(*workspace);
    float* staging = TakeStaging(p, op, ws);
    auto* alpha = static_cast<float*>(ws.Take(8 * calls));  // alpha[calls] then beta[calls]
    Calls c;
    c.spec.device = call.device;
    c.spec.d_type = op.d_type;
    c.spec.autotune = autotune;
    c.spec.device_alpha = true;
    if (native.value()) {
      c.spec.a_type = c.spec.b_type = CUDA_R_4F_E2M1;
      TE_RETURN_IF_ERROR(PlanNative(call, p, ms, loop, ws, &c));
    } else {
      auto dequant = [&](const uint8_t* q, const uint8_t* codes, int /*side*/, uint16_t* dst, int64_t rows) {
        return LaunchDequantNvfp4ToBf16(q, codes, dst, rows, p.k, call.stream);
      };
      TE_RETURN_IF_ERROR(PlanEmulated(call, p, ms, loop, ws, dequant, &c));
    }
    TE_RETURN_IF_ERROR(call.Kernel(
        [&] {
          return LaunchNvfp4Alpha(static_cast<const float*>(a_amax.untyped_data()), a_amax_n,
                                  static_cast<const float*>(b_amax.untyped_data()), b_amax_n, alpha, alpha + calls,
                                  calls, call.stream);
        },
        "the NVFP4 alpha kernel", p));
    c.first.alpha = alpha;
    c.first.beta = alpha + calls;
    c.steps.alpha = loop ? static_cast<int64_t>(sizeof(float)) : 0;
    return Finish(call, p, op, c, bias, *out, staging, ws);
  });
}

}  // namespace
}  // namespace gemm

// <stem>InitializeCuda and <stem>Cuda: the bundle's initialize and execute
// stages (module.cc registers them together), both given XLA's device ordinal.
#define TE_JAX_GEMM_INITIALIZE_BINDER \
  ::xla::ffi::Ffi::BindInitialize().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>().Ctx<::xla::ffi::DeviceOrdinal>()
#define TE_JAX_GEMM_HANDLERS(stem)                                                                                 \
  TE_JAX_DEFINE_HANDLER(stem, InitializeCuda, gemm::stem<gemm::Stage::kInitialize>, TE_JAX_GEMM_INITIALIZE_BINDER); \
  TE_JAX_CUDA_DEVICE_HANDLER(stem, gemm::stem<gemm::Stage::kExecute>)

TE_JAX_GEMM_HANDLERS(GemmFp8);
TE_JAX_GEMM_HANDLERS(GemmFp8Block);
TE_JAX_GEMM_HANDLERS(GemmMxfp8);
TE_JAX_GEMM_HANDLERS(GemmNvfp4);

}  // namespace te_jax
