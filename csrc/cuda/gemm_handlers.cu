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
#include <string>

#include "gemm_cublaslt.cuh"
#include "gemm_kernels.cuh"
#include "gemm_problem.cuh"
#include "../common/bindings.h"

namespace te_jax {
namespace gemm {
namespace {

constexpr size_t kMinBlockScalingVersion = 120900;  // cuBLASLt 12.9

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

// Shared tail of every handler: the matmul call(s) into out (or the float32
// staging buffer), then the bias/cast kernel when the output plan needs one.
ffi::Error Finish(const Problem& p, const OutputPlan& op, Calls& c, const ffi::AnyBuffer& bias, ffi::AnyBuffer out,
                  float* staging, const Workspace& ws, cudaStream_t stream) {
  c.spec.bias = op.epilogue;
  c.first.bias = op.epilogue ? bias.untyped_data() : nullptr;
  c.first.d = op.staged ? static_cast<void*>(staging) : out.untyped_data();
  c.first.workspace = ws.cublas_workspace();
  c.spec.workspace_bytes = ws.cublas_bytes();
  TE_RETURN_IF_ERROR(RunMatmuls(c.spec, c.first, c.steps, stream));
  if (op.staged || op.post_add) {
    const float* src = op.staged ? staging : static_cast<const float*>(out.untyped_data());
    const void* b = op.bias ? bias.untyped_data() : nullptr;
    TE_RETURN_IF_ERROR(Launched(LaunchFinalize(src, b, OutTypeOf(bias.element_type()), out.untyped_data(),
                                               OutTypeOf(out.element_type()), p.count * p.m, p.n, stream),
                                "the bias/cast kernel", p));
  }
  return ffi::Error::Success();
}

float* TakeStaging(const Problem& p, const OutputPlan& op, Workspace& ws) {
  return op.staged ? static_cast<float*>(ws.Take(4 * p.count * p.m * p.n)) : nullptr;
}

// ---- te_jax_gemm_fp8 ------------------------------------------------------------------

ffi::Error GemmFp8(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                   ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> workspace, bool fast_accum) {
  DeviceGuard guard;
  TE_RETURN_IF_ERROR(guard.Enter(stream));
  auto p_or = ParseProblem("te_jax_gemm_fp8", a, b, 1, *out);
  if (p_or.has_error()) return p_or.error();
  const Problem& p = p_or.value();
  if (p.empty()) return ffi::Error::Success();
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
  float* a_slots = a_per_matrix || !aligned16(a_src) ? static_cast<float*>(ws.Take(kScalarSlotBytes * a_n)) : nullptr;
  float* b_slots = b_per_matrix || !aligned16(b_src) ? static_cast<float*>(ws.Take(kScalarSlotBytes * b_n)) : nullptr;
  TE_RETURN_IF_ERROR(ws.Check(p));
  if (a_slots != nullptr) {
    TE_RETURN_IF_ERROR(Launched(LaunchSpreadScalars(a_src, a_slots, a_n, stream), "the a_scale_inv copy", p));
  }
  if (b_slots != nullptr) {
    TE_RETURN_IF_ERROR(Launched(LaunchSpreadScalars(b_src, b_slots, b_n, stream), "the b_scale_inv copy", p));
  }

  c.spec.device = guard.device();
  c.spec.d_type = op.d_type;
  c.spec.a_scale = c.spec.b_scale = ScaleMode::kScalar;
  c.spec.fast_accum = fast_accum;
  SetLayout(p, a_per_matrix || b_per_matrix, 8, 8, &c);
  c.first.a = a.untyped_data();
  c.first.b = b.untyped_data();
  c.first.a_scale = a_slots != nullptr ? static_cast<const void*>(a_slots) : a_src;
  c.first.b_scale = b_slots != nullptr ? static_cast<const void*>(b_slots) : b_src;
  c.steps.a_scale = a_per_matrix ? kScalarSlotBytes : 0;
  c.steps.b_scale = b_per_matrix ? kScalarSlotBytes : 0;
  return Finish(p, op, c, bias, *out, staging, ws, stream);
}

// ---- te_jax_gemm_fp8_block ------------------------------------------------------------

ffi::Error GemmFp8Block(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b,
                        ffi::AnyBuffer b_s, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> workspace, bool a_block_2d, bool b_block_2d,
                        bool /*fast_accum: block-scaled kernels always promote per 128-K block*/) {
  DeviceGuard guard;
  TE_RETURN_IF_ERROR(guard.Enter(stream));
  auto p_or = ParseProblem("te_jax_gemm_fp8_block", a, b, 1, *out);
  if (p_or.has_error()) return p_or.error();
  const Problem& p = p_or.value();
  if (p.empty()) return ffi::Error::Success();
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
  cudaError_t st = a_block_2d ? LaunchPadScales(a_src, a_conv, a_mats, a_mat_rows, l, a_stride, stream)
                              : LaunchTransposeScales(a_src, a_conv, a_mats, a_mat_rows, l, a_stride, stream);
  TE_RETURN_IF_ERROR(Launched(st, "the A block-scale conversion", p));
  st = b_block_2d ? LaunchPadScales(b_src, b_conv, p.b_count(), b_rows, l, b_per, stream)
                  : LaunchTransposeScales(b_src, b_conv, p.b_count(), p.n, l, b_per, stream);
  TE_RETURN_IF_ERROR(Launched(st, "the B block-scale conversion", p));

  c.spec.device = guard.device();
  c.spec.d_type = op.d_type;
  c.spec.a_scale = a_block_2d ? ScaleMode::kBlk128x128 : ScaleMode::kVec128;
  c.spec.b_scale = b_block_2d ? ScaleMode::kBlk128x128 : ScaleMode::kVec128;
  SetLayout(p, loop, 8, 8, &c);
  c.first.a = a.untyped_data();
  c.first.b = b.untyped_data();
  c.first.a_scale = a_conv;
  c.first.b_scale = b_conv;
  c.steps.a_scale = loop ? 4 * a_per : 0;
  c.steps.b_scale = loop ? 4 * b_per : 0;
  ffi::Error err = Finish(p, op, c, bias, *out, staging, ws, stream);
  if (err.failure()) {
    auto cc = ComputeCapability(guard.device());
    if (cc.has_value() && cc.value() / 10 != 9) {
      return ffi::Error(*err.errc(), err.message() + ". Note: cuBLASLt documents 1x128/128x128 block scaling for "
                                                     "compute capability 9.0 only; this device is sm_" +
                                         std::to_string(cc.value()));
    }
  }
  return err;
}

// ---- MXFP8 / NVFP4 ------------------------------------------------------------------------

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

ffi::Error GemmMxfp8(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b,
                     ffi::AnyBuffer b_s, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> workspace, bool /*fast_accum: no effect, see docs*/) {
  DeviceGuard guard;
  TE_RETURN_IF_ERROR(guard.Enter(stream));
  auto p_or = ParseProblem("te_jax_gemm_mxfp8", a, b, 1, *out);
  if (p_or.has_error()) return p_or.error();
  const Problem& p = p_or.value();
  if (p.empty()) return ffi::Error::Success();
  Calls c;
  TE_RETURN_IF_ERROR(CheckFp8Pair(p, a, b, &c.spec.a_type, &c.spec.b_type));
  if (a_s.element_type() != ffi::DataType::U8 || b_s.element_type() != ffi::DataType::U8) {
    return InvalidArgument(p.Describe() + ": MXFP8 scales must be uint8 E8M0 codes");
  }
  TE_RETURN_IF_ERROR(CheckDivisible(p.k, kMxfp8Block, p.Describe() + ": K"));
  const int64_t sk = p.k / kMxfp8Block;
  TE_RETURN_IF_ERROR(CheckCount(p, a_s, "a_s", p.count * p.m * sk));
  TE_RETURN_IF_ERROR(CheckCount(p, b_s, "b_s", p.b_count() * p.n * sk));
  auto native = UseNative(p, guard.device());
  if (native.has_error()) return native.error();
  auto op_or = PlanOutput(p, bias, *out, /*narrow=*/native.value());
  if (op_or.has_error()) return op_or.error();
  const OutputPlan op = op_or.value();
  const auto* a_codes = static_cast<const uint8_t*>(a_s.untyped_data());
  const auto* b_codes = static_cast<const uint8_t*>(b_s.untyped_data());
  Workspace ws(*workspace);
  float* staging = TakeStaging(p, op, ws);
  c.spec.device = guard.device();
  c.spec.d_type = op.d_type;
  if (native.value()) {
    const bool loop = !p.b_shared;
    const int64_t a_per = loop ? SwizzledScaleBytes(p.m, sk) : SwizzledScaleBytes(p.count * p.m, sk);
    const int64_t b_per = SwizzledScaleBytes(p.n, sk);
    auto* a_swz = static_cast<uint8_t*>(ws.Take(loop ? p.count * a_per : a_per));
    auto* b_swz = static_cast<uint8_t*>(ws.Take(p.b_count() * b_per));
    TE_RETURN_IF_ERROR(ws.Check(p));
    TE_RETURN_IF_ERROR(Launched(loop ? LaunchSwizzleScales(a_codes, a_swz, p.count, p.m, sk, stream)
                                     : LaunchSwizzleScales(a_codes, a_swz, 1, p.count * p.m, sk, stream),
                                "the A scale swizzle", p));
    TE_RETURN_IF_ERROR(Launched(LaunchSwizzleScales(b_codes, b_swz, p.b_count(), p.n, sk, stream),
                                "the B scale swizzle", p));
    c.spec.a_scale = c.spec.b_scale = ScaleMode::kVec32Ue8m0;
    SetLayout(p, loop, 8, 8, &c);
    c.first.a = a.untyped_data();
    c.first.b = b.untyped_data();
    c.first.a_scale = a_swz;
    c.first.b_scale = b_swz;
    c.steps.a_scale = loop ? a_per : 0;
    c.steps.b_scale = loop ? b_per : 0;
  } else {
    auto* a_bf16 = static_cast<uint16_t*>(ws.Take(2 * p.count * p.m * p.k));
    auto* b_bf16 = static_cast<uint16_t*>(ws.Take(2 * p.b_count() * p.n * p.k));
    TE_RETURN_IF_ERROR(ws.Check(p));
    TE_RETURN_IF_ERROR(Launched(LaunchDequantMxfp8ToBf16(static_cast<const uint8_t*>(a.untyped_data()), a_codes,
                                                         c.spec.a_type == CUDA_R_8F_E5M2, a_bf16, p.count * p.m,
                                                         p.k, stream),
                                "the A MXFP8 dequantize", p));
    TE_RETURN_IF_ERROR(Launched(LaunchDequantMxfp8ToBf16(static_cast<const uint8_t*>(b.untyped_data()), b_codes,
                                                         c.spec.b_type == CUDA_R_8F_E5M2, b_bf16,
                                                         p.b_count() * p.n, p.k, stream),
                                "the B MXFP8 dequantize", p));
    c.spec.a_type = c.spec.b_type = CUDA_R_16BF;
    SetLayout(p, false, 16, 16, &c);
    c.first.a = a_bf16;
    c.first.b = b_bf16;
  }
  return Finish(p, op, c, bias, *out, staging, ws, stream);
}

ffi::Error GemmNvfp4(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer a_amax,
                     ffi::AnyBuffer b, ffi::AnyBuffer b_s, ffi::AnyBuffer b_amax, ffi::AnyBuffer bias,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                     bool /*fast_accum: no effect, see docs*/) {
  DeviceGuard guard;
  TE_RETURN_IF_ERROR(guard.Enter(stream));
  auto p_or = ParseProblem("te_jax_gemm_nvfp4", a, b, 2, *out);
  if (p_or.has_error()) return p_or.error();
  const Problem& p = p_or.value();
  if (p.empty()) return ffi::Error::Success();
  if (a.element_type() != ffi::DataType::U8 || b.element_type() != ffi::DataType::U8) {
    return InvalidArgument(p.Describe() + ": NVFP4 operands must be uint8 (two E2M1 codes per byte)");
  }
  if (a_s.element_type() != ffi::DataType::F8E4M3FN || b_s.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(p.Describe() + ": NVFP4 block scales must be float8_e4m3fn");
  }
  TE_RETURN_IF_ERROR(CheckDivisible(p.k, 2 * kNvfp4Block, p.Describe() + ": K (16-byte packed rows)"));
  const int64_t sk = p.k / kNvfp4Block;
  TE_RETURN_IF_ERROR(CheckCount(p, a_s, "a_s", p.count * p.m * sk));
  TE_RETURN_IF_ERROR(CheckCount(p, b_s, "b_s", p.b_count() * p.n * sk));
  TE_RETURN_IF_ERROR(CheckScalars(p, a_amax, "a_amax", p.count));
  TE_RETURN_IF_ERROR(CheckScalars(p, b_amax, "b_amax", p.b_count()));
  auto native = UseNative(p, guard.device());
  if (native.has_error()) return native.error();
  auto op_or = PlanOutput(p, bias, *out, /*narrow=*/native.value());
  if (op_or.has_error()) return op_or.error();
  const OutputPlan op = op_or.value();
  const int64_t a_amax_n = static_cast<int64_t>(a_amax.element_count());
  const int64_t b_amax_n = static_cast<int64_t>(b_amax.element_count());
  // One alpha per call: per-matrix amax (or native block scales of a batched B) need one call per matrix.
  const bool loop = a_amax_n > 1 || b_amax_n > 1 || (native.value() && !p.b_shared);
  const int64_t calls = loop ? p.count : 1;
  const auto* a_codes = static_cast<const uint8_t*>(a_s.untyped_data());
  const auto* b_codes = static_cast<const uint8_t*>(b_s.untyped_data());
  Workspace ws(*workspace);
  float* staging = TakeStaging(p, op, ws);
  auto* alpha = static_cast<float*>(ws.Take(8 * calls));  // alpha[calls] then beta[calls]
  Calls c;
  c.spec.device = guard.device();
  c.spec.d_type = op.d_type;
  c.spec.device_alpha = true;
  if (native.value()) {
    const int64_t a_per = loop ? SwizzledScaleBytes(p.m, sk) : SwizzledScaleBytes(p.count * p.m, sk);
    const int64_t b_per = SwizzledScaleBytes(p.n, sk);
    auto* a_swz = static_cast<uint8_t*>(ws.Take(loop ? p.count * a_per : a_per));
    auto* b_swz = static_cast<uint8_t*>(ws.Take(p.b_count() * b_per));
    TE_RETURN_IF_ERROR(ws.Check(p));
    TE_RETURN_IF_ERROR(Launched(loop ? LaunchSwizzleScales(a_codes, a_swz, p.count, p.m, sk, stream)
                                     : LaunchSwizzleScales(a_codes, a_swz, 1, p.count * p.m, sk, stream),
                                "the A scale swizzle", p));
    TE_RETURN_IF_ERROR(Launched(LaunchSwizzleScales(b_codes, b_swz, p.b_count(), p.n, sk, stream),
                                "the B scale swizzle", p));
    c.spec.a_type = c.spec.b_type = CUDA_R_4F_E2M1;
    c.spec.a_scale = c.spec.b_scale = ScaleMode::kVec16Ue4m3;
    SetLayout(p, loop, 4, 4, &c);
    c.first.a = a.untyped_data();
    c.first.b = b.untyped_data();
    c.first.a_scale = a_swz;
    c.first.b_scale = b_swz;
    c.steps.a_scale = loop ? a_per : 0;
    c.steps.b_scale = loop && !p.b_shared ? b_per : 0;
  } else {
    auto* a_bf16 = static_cast<uint16_t*>(ws.Take(2 * p.count * p.m * p.k));
    auto* b_bf16 = static_cast<uint16_t*>(ws.Take(2 * p.b_count() * p.n * p.k));
    TE_RETURN_IF_ERROR(ws.Check(p));
    TE_RETURN_IF_ERROR(Launched(LaunchDequantNvfp4ToBf16(static_cast<const uint8_t*>(a.untyped_data()), a_codes,
                                                         a_bf16, p.count * p.m, p.k, stream),
                                "the A NVFP4 dequantize", p));
    TE_RETURN_IF_ERROR(Launched(LaunchDequantNvfp4ToBf16(static_cast<const uint8_t*>(b.untyped_data()), b_codes,
                                                         b_bf16, p.b_count() * p.n, p.k, stream),
                                "the B NVFP4 dequantize", p));
    c.spec.a_type = c.spec.b_type = CUDA_R_16BF;
    SetLayout(p, loop, 16, 16, &c);
    c.first.a = a_bf16;
    c.first.b = b_bf16;
  }
  TE_RETURN_IF_ERROR(Launched(LaunchNvfp4Alpha(static_cast<const float*>(a_amax.untyped_data()), a_amax_n,
                                               static_cast<const float*>(b_amax.untyped_data()), b_amax_n, alpha,
                                               alpha + calls, calls, stream),
                              "the NVFP4 alpha kernel", p));
  c.first.alpha = alpha;
  c.first.beta = alpha + calls;
  c.steps.alpha = loop ? static_cast<int64_t>(sizeof(float)) : 0;
  return Finish(p, op, c, bias, *out, staging, ws, stream);
}

}  // namespace
}  // namespace gemm

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmFp8Cuda, gemm::GemmFp8,
                              BindGemmFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmFp8BlockCuda, gemm::GemmFp8Block,
                              BindGemmFp8Block(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmMxfp8Cuda, gemm::GemmMxfp8,
                              BindGemmMxfp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmNvfp4Cuda, gemm::GemmNvfp4,
                              BindGemmNvfp4(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

}  // namespace te_jax
