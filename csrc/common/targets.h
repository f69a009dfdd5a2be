// The FFI targets te_jax registers, as (target name, handler stem) pairs.
// The CPU module registers <stem>Cpu and the CUDA module <stem>Cuda for each,
// so both platforms always expose the same set.
#pragma once

#define TE_JAX_FFI_TARGETS(X)                          \
  X(te_jax_quantize_fp8, QuantizeFp8Tensor)            \
  X(te_jax_quantize_fp8_current, QuantizeFp8Current)   \
  X(te_jax_quantize_mxfp8, QuantizeMxfp8)              \
  X(te_jax_quantize_fp8_block, QuantizeFp8Block)       \
  X(te_jax_quantize_nvfp4, QuantizeNvfp4)              \
  X(te_jax_dequantize_fp8, DequantizeFp8Tensor)        \
  X(te_jax_dequantize_mxfp8, DequantizeMxfp8)          \
  X(te_jax_dequantize_fp8_block, DequantizeFp8Block)   \
  X(te_jax_dequantize_nvfp4, DequantizeNvfp4)          \
  X(te_jax_gather_transpose, GatherTranspose)

// The GEMM custom calls (docs/gemm_ffi.md), registered by each platform module
// like TE_JAX_FFI_TARGETS.
#define TE_JAX_GEMM_TARGETS(X)            \
  X(te_jax_gemm_fp8, GemmFp8)             \
  X(te_jax_gemm_fp8_block, GemmFp8Block)  \
  X(te_jax_gemm_mxfp8, GemmMxfp8)         \
  X(te_jax_gemm_nvfp4, GemmNvfp4)

// The grouped GEMM custom calls (te_jax/ops/grouped_gemm.py), registered by each
// platform module like TE_JAX_FFI_TARGETS.
#define TE_JAX_GROUPED_GEMM_TARGETS(X)                  \
  X(te_jax_grouped_gemm_fp8, GroupedGemmFp8)            \
  X(te_jax_grouped_gemm_fp8_block, GroupedGemmFp8Block) \
  X(te_jax_grouped_gemm_bf16, GroupedGemmBf16)          \
  X(te_jax_grouped_gemm_mxfp8, GroupedGemmMxfp8)        \
  X(te_jax_grouped_gemm_nvfp4, GroupedGemmNvfp4)

// The fused norm and activation custom calls (te_jax/ops/norm.py,
// te_jax/ops/activation.py), registered by each platform module likewise.
#define TE_JAX_NORM_ACT_TARGETS(X)  \
  X(te_jax_norm_fwd, NormFwd)       \
  X(te_jax_norm_bwd, NormBwd)       \
  X(te_jax_act_fwd, ActFwd)         \
  X(te_jax_act_bwd, ActBwd)
