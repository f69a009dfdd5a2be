// The grouped GEMM targets' list and FFI bindings, as the grouped GEMM contract
// fixes them, for builds whose csrc/common does not define them yet: where
// csrc/common/targets.h defines TE_JAX_GROUPED_GEMM_TARGETS (with the
// Bind<Stem> functions in csrc/common/bindings.h), this header adds nothing.
// Operands are in the contract's order; the bias operand is always passed
// (an empty [0] array of the out dtype when has_bias is false).
#pragma once

#include <utility>

#include "../common/bindings.h"
#include "../common/targets.h"

#ifndef TE_JAX_GROUPED_GEMM_TARGETS
#define TE_JAX_GROUPED_GEMM_TARGETS(X)                  \
  X(te_jax_grouped_gemm_fp8, GroupedGemmFp8)            \
  X(te_jax_grouped_gemm_fp8_block, GroupedGemmFp8Block) \
  X(te_jax_grouped_gemm_mxfp8, GroupedGemmMxfp8)        \
  X(te_jax_grouped_gemm_nvfp4, GroupedGemmNvfp4)

namespace te_jax {

// out and workspace, then group_axis and align.
template <typename Binder>
auto GroupedGemmResults(Binder&& b) {
  return std::move(b)
      .template Ret<ffi::AnyBuffer>()               // out
      .template Ret<ffi::AnyBuffer>()               // workspace
      .template Attr<int64_t>("group_axis")
      .template Attr<int64_t>("align");
}

// te_jax_grouped_gemm_fp8
template <typename Binder>
auto BindGroupedGemmFp8(Binder b) {
  return GroupedGemmResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // a
      .template Arg<ffi::AnyBuffer>()               // b
      .template Arg<ffi::AnyBuffer>()               // a_scale_inv
      .template Arg<ffi::AnyBuffer>()               // b_scale_inv
      .template Arg<ffi::AnyBuffer>()               // group_sizes
      .template Arg<ffi::AnyBuffer>())              // bias
      .template Attr<bool>("fast_accum")
      .template Attr<bool>("has_bias");
}

// te_jax_grouped_gemm_fp8_block
template <typename Binder>
auto BindGroupedGemmFp8Block(Binder b) {
  return GroupedGemmResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // a
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // b
      .template Arg<ffi::AnyBuffer>()               // b_s
      .template Arg<ffi::AnyBuffer>()               // group_sizes
      .template Arg<ffi::AnyBuffer>())              // bias
      .template Attr<bool>("a_block_2d")
      .template Attr<bool>("b_block_2d")
      .template Attr<bool>("has_bias");
}

// te_jax_grouped_gemm_mxfp8
template <typename Binder>
auto BindGroupedGemmMxfp8(Binder b) {
  return GroupedGemmResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // a
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // b
      .template Arg<ffi::AnyBuffer>()               // b_s
      .template Arg<ffi::AnyBuffer>()               // group_sizes
      .template Arg<ffi::AnyBuffer>())              // bias
      .template Attr<bool>("has_bias");
}

// te_jax_grouped_gemm_nvfp4
template <typename Binder>
auto BindGroupedGemmNvfp4(Binder b) {
  return GroupedGemmResults(std::move(b)
      .template Arg<ffi::AnyBuffer>()               // a
      .template Arg<ffi::AnyBuffer>()               // a_s
      .template Arg<ffi::AnyBuffer>()               // a_amax
      .template Arg<ffi::AnyBuffer>()               // b
      .template Arg<ffi::AnyBuffer>()               // b_s
      .template Arg<ffi::AnyBuffer>()               // b_amax
      .template Arg<ffi::AnyBuffer>()               // group_sizes
      .template Arg<ffi::AnyBuffer>())              // bias
      .template Attr<bool>("has_bias");
}

}  // namespace te_jax
#endif  // TE_JAX_GROUPED_GEMM_TARGETS
