// The grouped FP8 and bfloat16 GEMMs on the device (contract: the grouped GEMM
// custom calls of te_jax/ops/grouped_gemm.py). One call is a tiny setup kernel that reads
// group_sizes on the device and writes every group's problem shape, operand
// pointers, strides and alpha (the product of the scale_invs) into the
// workspace, then ONE CUTLASS pointer-array grouped GEMM launch (sm_90a), then
// the zeroing (and bias) kernels for the rows / groups no GEMM writes. Nothing
// is copied to the host, nothing is allocated, nothing synchronizes, so the
// call can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace te_jax {
namespace grouped {

namespace ffi = ::xla::ffi;

enum class Fp8Kind { kE4M3, kE5M2 };
enum class OutKind { kF32, kBf16, kF16 };

// The grouped layout of the contract. kRows (group_axis 0): A [M, K] with the
// groups' rows stacked, B [G, N, K], out [M, N]. kContraction (group_axis 1):
// A [M, K] and B [N, K] with the groups in aligned column spans of K, out
// [G, M, N]. (M, N, K here are P, Q, Kc of the contract for kContraction.)
enum class GroupAxis { kRows = 0, kContraction = 1 };

// The layouts of the bfloat16 grouped GEMM (te_jax_grouped_gemm_bf16), one
// kernel each. kForward (group_axis 0, b_kn): A [M, K], B [G, K, N], out
// [M, N]. kDgrad (group_axis 0, !b_kn): A [M, K], B [G, N, K], out [M, N].
// kWgrad (group_axis 1): A [R, P] and B [R, Q] with the groups' rows stacked,
// out [G, P, Q], out[g] = A_g^T @ B_g. (The call's m, n, k are M, N, K, and
// P, Q, R for kWgrad.)
enum class Bf16Layout { kForward, kDgrad, kWgrad };

// Everything one per-tensor-scaled grouped FP8 GEMM needs (device pointers).
// The bfloat16 grouped GEMM fills the same struct: a_kind, b_kind and every
// scale pointer unused (null), out_kind kBf16, align 1, bf16_layout set.
struct GroupedFp8Call {
  const char* target;             // the FFI target, for error messages
  GroupAxis axis;
  Fp8Kind a_kind, b_kind;
  OutKind out_kind;
  bool fast_accum;
  int64_t groups, m, n, k;
  int64_t align;                  // kContraction: the span alignment of K
  Bf16Layout bf16_layout;         // the bfloat16 call only
  const void* a;
  const void* b;
  const float* a_scale_inv;       // per-tensor: [1] or [groups]; nullptr in the block mode
  const float* b_scale_inv;
  bool a_scale_per_group, b_scale_per_group;
  // The block mode (te_jax_grouped_gemm_fp8_block): float32 1/scale per 1x128
  // block of A (row-major [rows, K/128]) and per b_scale_rows x 128 block of B
  // (b_scale_rows 128: [G, N/128, K/128]; 1: [G, N, K/128]).
  const float* a_s;
  const float* b_s;
  int b_scale_rows;
  const int32_t* group_sizes;     // [groups], on the device
  void* out;
  void* workspace;
  size_t workspace_bytes;
  int device;
};

// Enqueues the grouped GEMM of `call` on `stream` with the CUTLASS sm_90a
// kernel of these dtypes (defined in grouped_gemm_sm90_*.cu, for the entries
// of TE_JAX_GROUPED_FP8_KERNELS only; the caller checks the device is sm_90).
// Writes only the groups' rows / matrices: the rows past the groups' sum
// (kRows) and the matrices of empty groups (kContraction) are the caller's.
template <Fp8Kind kA, Fp8Kind kB, OutKind kOut, bool kFastAccum>
ffi::Error RunGroupedFp8(const GroupedFp8Call& call, cudaStream_t stream);

// The same for the block mode (1x128 A scales, b_scale_rows x 128 B scales),
// defined in grouped_gemm_sm90_block_*.cu for the entries of
// TE_JAX_GROUPED_FP8_BLOCK_KERNELS. kAxis kRows: K-major scales (a row's K
// blocks contiguous); kContraction: K-block-major scales [K/128, rows] (one
// row per K block), so each group's span is a compact slice.
template <Fp8Kind kA, Fp8Kind kB, OutKind kOut, int kBScaleRows, GroupAxis kAxis>
ffi::Error RunGroupedFp8Block(const GroupedFp8Call& call, cudaStream_t stream);

// The bfloat16 grouped GEMM of layout kLayout (bfloat16 A and B, float32
// accumulation, bfloat16 out), defined in grouped_gemm_sm90_bf16_*.cu for the
// entries of TE_JAX_GROUPED_BF16_KERNELS. Writes only the groups' rows /
// matrices, as RunGroupedFp8.
template <Bf16Layout kLayout>
ffi::Error RunGroupedBf16(const GroupedFp8Call& call, cudaStream_t stream);

// The instantiated kernels, X(a kind, b kind, out kind, fast_accum). Each is
// one source file grouped_gemm_sm90_<a>_<b>_<out>_<accum>.cu. The bfloat16
// ones serve the hot products of bfloat16 models directly: the forward (E4M3 x
// E4M3, fast), the HYBRID dgrad (E5M2 x E4M3) and wgrad (E4M3 x E5M2, whose
// [G, K, N] output would cost a float32 write and a cast), each with split
// accumulation and with fast accumulation (backward_fast_accumulation); every
// other combination of te_jax's recipes runs the float32 kernel of its dtype
// pair (split accumulation, which is at least as exact as fast) and the
// lowering casts the result (te_jax/ops/grouped/cuda.py keeps the same table
// in CUDA_FP8_KERNELS).
#define TE_JAX_GROUPED_FP8_KERNELS(X) \
  X(kE4M3, kE4M3, kBf16, true)        \
  X(kE5M2, kE4M3, kBf16, false)       \
  X(kE4M3, kE5M2, kBf16, false)       \
  X(kE5M2, kE4M3, kBf16, true)        \
  X(kE4M3, kE5M2, kBf16, true)        \
  X(kE4M3, kE4M3, kF32, false)        \
  X(kE5M2, kE4M3, kF32, false)        \
  X(kE4M3, kE5M2, kF32, false)

// The block mode's kernels, X(a kind, b kind, out kind, B scale rows, group
// axis): the forward and dgrad products (kRows) with 128x128 weight blocks to
// bfloat16 (hot) or float32, with 1x128 weight blocks to float32, and the
// wgrad product (kContraction, 1x128 blocks of both) to bfloat16 or float32.
// Other out dtypes are float32 and a cast (CUDA_BLOCK_KERNELS in
// te_jax/ops/grouped/cuda.py).
#define TE_JAX_GROUPED_FP8_BLOCK_KERNELS(X)        \
  X(kE4M3, kE4M3, kBf16, 128, GroupAxis::kRows)    \
  X(kE4M3, kE4M3, kF32, 128, GroupAxis::kRows)     \
  X(kE4M3, kE4M3, kF32, 1, GroupAxis::kRows)       \
  X(kE4M3, kE4M3, kBf16, 1, GroupAxis::kContraction) \
  X(kE4M3, kE4M3, kF32, 1, GroupAxis::kContraction)

// The bfloat16 kernels, X(layout), one source file grouped_gemm_sm90_bf16_<layout>.cu
// each: the forward (B N-major), the dgrad (B K-major) and the wgrad (A and B
// M- and N-major, the rows of each group contracted).
#define TE_JAX_GROUPED_BF16_KERNELS(X) \
  X(kForward)                          \
  X(kDgrad)                            \
  X(kWgrad)

}  // namespace grouped
}  // namespace te_jax
