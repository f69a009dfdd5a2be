// The FFI binding (operands, results, attributes, in order) of every target in
// targets.h, written once and used by both platform modules:
//
//   CPU:  TE_JAX_CPU_HANDLER(QuantizeFp8Tensor, QuantizeFp8Tensor);
//   CUDA: TE_JAX_CUDA_HANDLER(QuantizeFp8Tensor, cuda::QuantizeFp8Tensor);
//
// define the exported symbols QuantizeFp8TensorCpu / QuantizeFp8TensorCuda
// with BindQuantizeFp8Tensor (the CUDA one on a binder that already holds the
// stream context), so the CPU handlers, which CI runs, check the same contract
// the CUDA ones are compiled against. (The CUDA GEMM targets bind the same
// Bind<Stem> twice, for their initialize and execute stages: gemm_handlers.cu.)
// Each Bind<Stem> appends the target's operands, results and attributes to the
// binder it is given; the comments name the handler parameter each one binds.
// The norm/activation targets decode their attributes into one typed struct
// each (norm_act.h), and their handlers are the shared entries of
// norm_act_checks.h, which check the call and hand it to the platform's
// `Run(ctx..., call)`:
//
//   TE_JAX_CPU_ENTRY(NormFwd, NormFwd);  TE_JAX_CUDA_ENTRY(NormFwd, cuda::NormFwd);
//
// No CUDA headers here: the CPU build has none (the CUDA macros are expanded
// in CUDA sources only).
#pragma once

#include <utility>

#include "ffi_common.h"
#include "norm_act.h"

#define TE_JAX_DEFINE_HANDLER(stem, suffix, fn, binder, ...) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(stem##suffix, fn, ::te_jax::Bind##stem(binder), ##__VA_ARGS__)
#define TE_JAX_CPU_HANDLER(stem, fn) TE_JAX_DEFINE_HANDLER(stem, Cpu, fn, ::xla::ffi::Ffi::Bind())
#define TE_JAX_CUDA_BINDER ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()
// Every CUDA execute handler may be captured into a CUDA graph (an XLA command
// buffer) from its first call: it only enqueues work on its stream, and
// whatever it must prepare outside capture (the GEMM's cuBLASLt plans) it
// builds in its initialize stage (docs/gemm_ffi.md, "CUDA graphs").
#define TE_JAX_CUDA_TRAITS {::xla::ffi::Traits::kCmdBufferCompatible}
#define TE_JAX_CUDA_HANDLER(stem, fn) TE_JAX_DEFINE_HANDLER(stem, Cuda, fn, TE_JAX_CUDA_BINDER, TE_JAX_CUDA_TRAITS)
// The same for a handler that also takes XLA's device ordinal of the call
// (int32_t, after the stream): a stream's device cannot be queried while it
// is being captured.
#define TE_JAX_CUDA_DEVICE_BINDER TE_JAX_CUDA_BINDER.Ctx<::xla::ffi::DeviceOrdinal>()
#define TE_JAX_CUDA_DEVICE_HANDLER(stem, fn) \
  TE_JAX_DEFINE_HANDLER(stem, Cuda, fn, TE_JAX_CUDA_DEVICE_BINDER, TE_JAX_CUDA_TRAITS)
#define TE_JAX_CPU_ENTRY(stem, run) \
  TE_JAX_DEFINE_HANDLER(stem, Cpu, (::te_jax::stem##Entry<&run>::Call), ::xla::ffi::Ffi::Bind())
#define TE_JAX_CUDA_ENTRY(stem, run)                                                                   \
  TE_JAX_DEFINE_HANDLER(stem, Cuda, (::te_jax::stem##Entry<&run, cudaStream_t>::Call), TE_JAX_CUDA_BINDER, \
                        TE_JAX_CUDA_TRAITS)

namespace te_jax {

// ---- pieces several targets share -------------------------------------------
// (They take the binder by reference: a binding can be moved into the next
// one's method, but not copied or moved into a by-value parameter.)

template <typename Binder>
auto RowColAttrs(Binder&& b) {
  return std::move(b)
      .template Attr<bool>("rowwise")
      .template Attr<bool>("colwise");
}

// q, s, q_t, s_t of a block-scaled quantize (s and s_t of dtype kScale).
template <ffi::DataType kScale, typename Binder>
auto BlockCastResults(Binder&& b) {
  return std::move(b)
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::Buffer<kScale>>()          // s
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::Buffer<kScale>>();         // s_t
}

// The seven results of a fused cast (norm/activation; see norm_act.h).
template <typename Binder>
auto FusedCastResults(Binder&& b) {
  return std::move(b)
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::AnyBuffer>()               // s
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::AnyBuffer>()               // s_t
      .template Ret<ffi::AnyBuffer>()               // amax
      .template Ret<ffi::AnyBuffer>()               // amax_t
      .template Ret<ffi::AnyBuffer>();              // scale_out
}

// A, a_s, B and b_s of a block-scaled GEMM (dense or grouped).
template <typename Binder>
auto BlockScaledOperands(Binder&& b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // B
      .template Arg<ffi::AnyBuffer>();              // b_s
}

// A, a_s, B, b_s and bias of a block-scaled FP8 GEMM.
template <typename Binder>
auto BlockScaledGemmArgs(Binder&& b) {
  return BlockScaledOperands(std::move(b)).template Arg<ffi::AnyBuffer>();  // bias
}

// out and workspace, then the `autotune` attribute every GEMM target takes.
template <typename Binder>
auto GemmResults(Binder&& b) {
  return std::move(b)
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::AnyBuffer>()               // workspace
      .template Attr<bool>("autotune");
}

// ---- quantize ---------------------------------------------------------------

// te_jax_quantize_fp8
template <typename Binder>
auto BindQuantizeFp8Tensor(Binder b) {
  return RowColAttrs(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::Buffer<ffi::F32>>()        // amax
      .template Ret<ffi::Buffer<ffi::F32>>());      // scale_inv
}

// te_jax_quantize_fp8_current
template <typename Binder>
auto BindQuantizeFp8Current(Binder b) {
  return RowColAttrs(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::Buffer<ffi::F32>>()        // amax
      .template Ret<ffi::Buffer<ffi::F32>>()        // scale
      .template Ret<ffi::Buffer<ffi::F32>>())       // scale_inv
      .template Attr<bool>("power_2")
      .template Attr<float>("epsilon");
}

// te_jax_quantize_mxfp8
template <typename Binder>
auto BindQuantizeMxfp8(Binder b) {
  return RowColAttrs(BlockCastResults<ffi::U8>(std::move(b).template Arg<ffi::AnyBuffer>()));  // x
}

// te_jax_quantize_fp8_block
template <typename Binder>
auto BindQuantizeFp8Block(Binder b) {
  return RowColAttrs(BlockCastResults<ffi::F32>(std::move(b).template Arg<ffi::AnyBuffer>()))  // x
      .template Attr<bool>("block_2d")
      .template Attr<bool>("power_2");
}

// te_jax_quantize_nvfp4
template <typename Binder>
auto BindQuantizeNvfp4(Binder b) {
  return RowColAttrs(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::U32>>()        // key
      .template Ret<ffi::Buffer<ffi::U8>>()         // q
      .template Ret<ffi::AnyBuffer>()               // s
      .template Ret<ffi::Buffer<ffi::U8>>()         // q_t
      .template Ret<ffi::AnyBuffer>()               // s_t
      .template Ret<ffi::Buffer<ffi::F32>>()        // amax
      .template Ret<ffi::Buffer<ffi::F32>>())       // amax_t
      .template Attr<bool>("block_2d")
      .template Attr<bool>("rht")
      .template Attr<bool>("stochastic_rounding");
}

// ---- dequantize -------------------------------------------------------------

// te_jax_dequantize_fp8
template <typename Binder>
auto BindDequantizeFp8Tensor(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // q
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale_inv
      .template Ret<ffi::AnyBuffer>();              // out
}

// te_jax_dequantize_mxfp8
template <typename Binder>
auto BindDequantizeMxfp8(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // q
      .template Arg<ffi::Buffer<ffi::U8>>()         // s
      .template Ret<ffi::AnyBuffer>();              // out
}

// te_jax_dequantize_fp8_block
template <typename Binder>
auto BindDequantizeFp8Block(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // q
      .template Arg<ffi::Buffer<ffi::F32>>()        // s
      .template Ret<ffi::AnyBuffer>()               // out
      .template Attr<bool>("block_2d");
}

// te_jax_dequantize_nvfp4
template <typename Binder>
auto BindDequantizeNvfp4(Binder b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::U8>>()         // q
      .template Arg<ffi::AnyBuffer>()               // s
      .template Arg<ffi::Buffer<ffi::F32>>()        // amax
      .template Ret<ffi::AnyBuffer>();              // out
}

// ---- layout ------------------------------------------------------------------

// te_jax_gather_transpose (layout_checks.h)
template <typename Binder>
auto BindGatherTranspose(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // data
      .template Arg<ffi::Buffer<ffi::S32>>()        // sources
      .template Ret<ffi::AnyBuffer>();              // out
}

// ---- GEMM (docs/gemm_ffi.md) ------------------------------------------------

// te_jax_gemm_fp8
template <typename Binder>
auto BindGemmFp8(Binder b) {
  return GemmResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A
      .template Arg<ffi::AnyBuffer>()               // B
      .template Arg<ffi::AnyBuffer>()               // a_scale_inv
      .template Arg<ffi::AnyBuffer>()               // b_scale_inv
      .template Arg<ffi::AnyBuffer>())              // bias
      .template Attr<bool>("fast_accum");
}

// te_jax_gemm_fp8_block
template <typename Binder>
auto BindGemmFp8Block(Binder b) {
  return GemmResults(BlockScaledGemmArgs(std::move(b)))
      .template Attr<bool>("a_block_2d")
      .template Attr<bool>("b_block_2d");
}

// te_jax_gemm_mxfp8
template <typename Binder>
auto BindGemmMxfp8(Binder b) {
  return GemmResults(BlockScaledGemmArgs(std::move(b)));
}

// te_jax_gemm_nvfp4
template <typename Binder>
auto BindGemmNvfp4(Binder b) {
  return GemmResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A (packed)
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // a_amax
      .template Arg<ffi::AnyBuffer>()               // B (packed)
      .template Arg<ffi::AnyBuffer>()               // b_s
      .template Arg<ffi::AnyBuffer>()               // b_amax
      .template Arg<ffi::AnyBuffer>());             // bias
}

// ---- grouped GEMM (te_jax/ops/grouped_gemm.py) -------------------------------
// The operands of each target, then group_sizes (int32 [G]) and the bias (always
// passed: an empty [0] array when has_bias is false), the results out and
// workspace, the group layout's attributes (group_axis 0: rows of A grouped;
// 1: the contraction grouped in spans aligned to `align`), then the target's own.

template <typename Binder>
auto GroupedGemmTail(Binder&& b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // group_sizes
      .template Arg<ffi::AnyBuffer>()               // bias
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::AnyBuffer>()               // workspace
      .template Attr<int64_t>("group_axis")
      .template Attr<int64_t>("align")
      .template Attr<bool>("has_bias");
}

// te_jax_grouped_gemm_fp8
template <typename Binder>
auto BindGroupedGemmFp8(Binder b) {
  return GroupedGemmTail(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A
      .template Arg<ffi::AnyBuffer>()               // B
      .template Arg<ffi::AnyBuffer>()               // a_scale_inv
      .template Arg<ffi::AnyBuffer>())              // b_scale_inv
      .template Attr<bool>("fast_accum");
}

// te_jax_grouped_gemm_fp8_block
template <typename Binder>
auto BindGroupedGemmFp8Block(Binder b) {
  return GroupedGemmTail(BlockScaledOperands(std::move(b)))
      .template Attr<bool>("a_block_2d")
      .template Attr<bool>("b_block_2d");
}

// te_jax_grouped_gemm_bf16 (no align: group_axis 1 stacks the groups' rows unpadded)
template <typename Binder>
auto BindGroupedGemmBf16(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A
      .template Arg<ffi::AnyBuffer>()               // B
      .template Arg<ffi::AnyBuffer>()               // group_sizes
      .template Arg<ffi::AnyBuffer>()               // bias
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::AnyBuffer>()               // workspace
      .template Attr<int64_t>("group_axis")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("b_kn");
}

// te_jax_grouped_gemm_mxfp8
template <typename Binder>
auto BindGroupedGemmMxfp8(Binder b) {
  return GroupedGemmTail(BlockScaledOperands(std::move(b)));
}

// te_jax_grouped_gemm_nvfp4
template <typename Binder>
auto BindGroupedGemmNvfp4(Binder b) {
  return GroupedGemmTail(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A (packed)
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // a_amax
      .template Arg<ffi::AnyBuffer>()               // B (packed)
      .template Arg<ffi::AnyBuffer>()               // b_s
      .template Arg<ffi::AnyBuffer>());             // b_amax
}

// ---- fused norm / activation (typed attribute structs, see norm_act.h) ------

// te_jax_norm_fwd
template <typename Binder>
auto BindNormFwd(Binder b) {
  return FusedCastResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // gamma
      .template Arg<ffi::Buffer<ffi::F32>>()        // beta
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Arg<ffi::Buffer<ffi::U32>>())       // key
      .template Ret<ffi::Buffer<ffi::F32>>()        // mean
      .template Ret<ffi::Buffer<ffi::F32>>()        // rsigma
      .template Attrs<NormFwdAttrs>();              // attrs
}

// te_jax_norm_bwd
template <typename Binder>
auto BindNormBwd(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // dy
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // mean
      .template Arg<ffi::Buffer<ffi::F32>>()        // rsigma
      .template Arg<ffi::Buffer<ffi::F32>>()        // gamma
      .template Ret<ffi::AnyBuffer>()               // dx
      .template Ret<ffi::Buffer<ffi::F32>>()        // dgamma
      .template Ret<ffi::Buffer<ffi::F32>>()        // dbeta
      .template Ret<ffi::Buffer<ffi::F32>>()        // workspace
      .template Attrs<NormBwdAttrs>();              // attrs
}

// te_jax_act_fwd
template <typename Binder>
auto BindActFwd(Binder b) {
  return FusedCastResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Arg<ffi::Buffer<ffi::U32>>())       // key
      .template Attrs<ActFwdAttrs>();               // attrs
}

// te_jax_act_bwd
template <typename Binder>
auto BindActBwd(Binder b) {
  return FusedCastResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // dy
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Arg<ffi::Buffer<ffi::U32>>())       // key
      .template Ret<ffi::Buffer<ffi::F32>>()        // dbias
      .template Ret<ffi::Buffer<ffi::F32>>()        // workspace
      .template Attrs<ActBwdAttrs>();               // attrs
}

}  // namespace te_jax
