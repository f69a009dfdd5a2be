// The FFI binding (operands, results, attributes, in order) of every target in
// targets.h, written once and used by both platform modules:
//
//   CPU:  XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmFp8Cpu, GemmFp8, BindGemmFp8(ffi::Ffi::Bind()));
//   CUDA: XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmFp8Cuda, gemm::GemmFp8,
//             BindGemmFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
//
// so the CPU handlers, which CI runs, check the same contract the CUDA ones
// are compiled against. Each Bind<Stem> appends the target's operands, results
// and attributes to the binder it is given (the CUDA one already holds the
// stream context); the comments name the handler parameter each one binds.
// The norm/activation targets take their attributes as one dictionary, parsed
// by norm_act.h. No CUDA headers here: the CPU build has none.
#pragma once

#include <utility>

#include "ffi_common.h"

namespace te_jax {

// ---- quantize ---------------------------------------------------------------

// te_jax_quantize_fp8
template <typename Binder>
auto BindQuantizeFp8Tensor(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::Buffer<ffi::F32>>()        // amax
      .template Ret<ffi::Buffer<ffi::F32>>()        // scale_inv
      .template Attr<bool>("rowwise")
      .template Attr<bool>("colwise");
}

// te_jax_quantize_fp8_current
template <typename Binder>
auto BindQuantizeFp8Current(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::Buffer<ffi::F32>>()        // amax
      .template Ret<ffi::Buffer<ffi::F32>>()        // scale
      .template Ret<ffi::Buffer<ffi::F32>>()        // scale_inv
      .template Attr<bool>("rowwise")
      .template Attr<bool>("colwise")
      .template Attr<bool>("power_2")
      .template Attr<float>("epsilon");
}

// te_jax_quantize_mxfp8
template <typename Binder>
auto BindQuantizeMxfp8(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::Buffer<ffi::U8>>()         // s
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::Buffer<ffi::U8>>()         // s_t
      .template Attr<bool>("rowwise")
      .template Attr<bool>("colwise");
}

// te_jax_quantize_fp8_block
template <typename Binder>
auto BindQuantizeFp8Block(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::Buffer<ffi::F32>>()        // s
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::Buffer<ffi::F32>>()        // s_t
      .template Attr<bool>("rowwise")
      .template Attr<bool>("colwise")
      .template Attr<bool>("block_2d")
      .template Attr<bool>("power_2");
}

// te_jax_quantize_nvfp4
template <typename Binder>
auto BindQuantizeNvfp4(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::U32>>()        // key
      .template Ret<ffi::Buffer<ffi::U8>>()         // q
      .template Ret<ffi::AnyBuffer>()               // s
      .template Ret<ffi::Buffer<ffi::U8>>()         // q_t
      .template Ret<ffi::AnyBuffer>()               // s_t
      .template Ret<ffi::Buffer<ffi::F32>>()        // amax
      .template Ret<ffi::Buffer<ffi::F32>>()        // amax_t
      .template Attr<bool>("rowwise")
      .template Attr<bool>("colwise")
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

// ---- GEMM (docs/gemm_ffi.md) ------------------------------------------------

// te_jax_gemm_fp8
template <typename Binder>
auto BindGemmFp8(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A
      .template Arg<ffi::AnyBuffer>()               // B
      .template Arg<ffi::AnyBuffer>()               // a_scale_inv
      .template Arg<ffi::AnyBuffer>()               // b_scale_inv
      .template Arg<ffi::AnyBuffer>()               // bias
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::AnyBuffer>()               // workspace
      .template Attr<bool>("fast_accum");
}

// te_jax_gemm_fp8_block
template <typename Binder>
auto BindGemmFp8Block(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // B
      .template Arg<ffi::AnyBuffer>()               // b_s
      .template Arg<ffi::AnyBuffer>()               // bias
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::AnyBuffer>()               // workspace
      .template Attr<bool>("a_block_2d")
      .template Attr<bool>("b_block_2d")
      .template Attr<bool>("fast_accum");
}

// te_jax_gemm_mxfp8
template <typename Binder>
auto BindGemmMxfp8(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // B
      .template Arg<ffi::AnyBuffer>()               // b_s
      .template Arg<ffi::AnyBuffer>()               // bias
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::AnyBuffer>()               // workspace
      .template Attr<bool>("fast_accum");
}

// te_jax_gemm_nvfp4
template <typename Binder>
auto BindGemmNvfp4(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // A (packed)
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // a_amax
      .template Arg<ffi::AnyBuffer>()               // B (packed)
      .template Arg<ffi::AnyBuffer>()               // b_s
      .template Arg<ffi::AnyBuffer>()               // b_amax
      .template Arg<ffi::AnyBuffer>()               // bias
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::AnyBuffer>()               // workspace
      .template Attr<bool>("fast_accum");
}

// ---- fused norm / activation (attributes: one dictionary, see norm_act.h) ---

// te_jax_norm_fwd
template <typename Binder>
auto BindNormFwd(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // gamma
      .template Arg<ffi::Buffer<ffi::F32>>()        // beta
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Arg<ffi::Buffer<ffi::U32>>()        // key
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::AnyBuffer>()               // s
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::AnyBuffer>()               // s_t
      .template Ret<ffi::AnyBuffer>()               // amax
      .template Ret<ffi::AnyBuffer>()               // amax_t
      .template Ret<ffi::AnyBuffer>()               // scale_out
      .template Ret<ffi::Buffer<ffi::F32>>()        // mean
      .template Ret<ffi::Buffer<ffi::F32>>()        // rsigma
      .Attrs();                                     // attrs
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
      .Attrs();                                     // attrs
}

// te_jax_act_fwd
template <typename Binder>
auto BindActFwd(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Arg<ffi::Buffer<ffi::U32>>()        // key
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::AnyBuffer>()               // s
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::AnyBuffer>()               // s_t
      .template Ret<ffi::AnyBuffer>()               // amax
      .template Ret<ffi::AnyBuffer>()               // amax_t
      .template Ret<ffi::AnyBuffer>()               // scale_out
      .Attrs();                                     // attrs
}

// te_jax_act_bwd
template <typename Binder>
auto BindActBwd(Binder b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // dy
      .template Arg<ffi::AnyBuffer>()               // x
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Arg<ffi::Buffer<ffi::U32>>()        // key
      .template Ret<ffi::AnyBuffer>()               // q
      .template Ret<ffi::AnyBuffer>()               // s
      .template Ret<ffi::AnyBuffer>()               // q_t
      .template Ret<ffi::AnyBuffer>()               // s_t
      .template Ret<ffi::AnyBuffer>()               // amax
      .template Ret<ffi::AnyBuffer>()               // amax_t
      .template Ret<ffi::AnyBuffer>()               // scale_out
      .template Ret<ffi::Buffer<ffi::F32>>()        // dbias
      .template Ret<ffi::Buffer<ffi::F32>>()        // workspace
      .Attrs();                                     // attrs
}

}  // namespace te_jax
