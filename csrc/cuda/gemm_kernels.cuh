// Small CUDA kernels around the cuBLASLt GEMMs: scale-layout conversions,
// the Hopper dequantize-to-bfloat16 emulation of MXFP8/NVFP4, the NVFP4 alpha,
// and the bias/cast finalisation. Each launcher enqueues on `stream` and
// returns the launch status (cudaGetLastError after the launch); none of them
// allocates or synchronises, so they are safe inside a CUDA graph capture.
//
// Layouts are documented in docs/gemm_ffi.md ("CUDA handlers").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace te_jax {
namespace gemm {

// Float8 1x128 block scales, cuBLASLt CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F:
// per matrix, src [rows, L] row-major (ours) -> dst [L, rows] ("rows-major",
// the outer dimension contiguous). `batch` matrices, back to back in src and
// `dst_stride` (>= rows * L) floats apart in dst (the gaps are not written).
cudaError_t LaunchTransposeScales(const float* src, float* dst, int64_t batch, int64_t rows, int64_t l,
                                  int64_t dst_stride, cudaStream_t stream);

// Float8 128x128 block scales, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F:
// per matrix, src [row_blocks, L] row-major -> dst [row_blocks, L4] with
// L4 = round_up(L, 4) and zeros in the padding (cuBLASLt's "K-major, column
// stride a multiple of 4"). `batch` matrices, back to back in src and
// `dst_stride` (>= row_blocks * L4) floats apart in dst.
cudaError_t LaunchPadScales(const float* src, float* dst, int64_t batch, int64_t row_blocks, int64_t l,
                            int64_t dst_stride, cudaStream_t stream);

// Bytes of one matrix's scales in cuBLASLt's 128x4 tiled layout
// (VEC32_UE8M0 / VEC16_UE4M3): round_up(rows, 128) * round_up(cols, 4).
int64_t SwizzledScaleBytes(int64_t rows, int64_t cols);

// 8-bit block scales [rows, cols] row-major (cols = K / block) -> cuBLASLt's
// 128x4 tiled layout, zero padded; `batch` matrices, each in its own region of
// SwizzledScaleBytes(rows, cols) bytes.
cudaError_t LaunchSwizzleScales(const uint8_t* src, uint8_t* dst, int64_t batch, int64_t rows, int64_t cols,
                                cudaStream_t stream);

// Hopper emulation: MXFP8 [rows, k] FP8 codes with E8M0 scales [rows, k/32]
// -> bfloat16 [rows, k] holding q * 2^e computed in float32 and rounded to
// nearest even (exact unless the value leaves bfloat16's range). `e5m2` picks the FP8 format.
cudaError_t LaunchDequantMxfp8ToBf16(const uint8_t* q, const uint8_t* s, bool e5m2, uint16_t* out,
                                     int64_t rows, int64_t k, cudaStream_t stream);

// Hopper emulation: NVFP4 packed E2M1 [rows, k/2] (element 2j in the low
// nibble) with E4M3 block scales [rows, k/16] -> bfloat16 e2m1 * s_b (exact).
// The global decode scale is not applied here (it is the GEMM's alpha).
cudaError_t LaunchDequantNvfp4ToBf16(const uint8_t* q, const uint8_t* s, uint16_t* out, int64_t rows,
                                     int64_t k, cudaStream_t stream);

// NVFP4 alpha/beta for CUBLASLT_POINTER_MODE_DEVICE, one pair per matrix:
// alpha[i] = S_dec(a_amax[i or 0]) * S_dec(b_amax[i or 0]) with
// S_dec = 1 / nvfp4_global_encode_scale(amax) in float32; beta[i] = 0.
// A count of 1 broadcasts that amax over the `count` matrices.
cudaError_t LaunchNvfp4Alpha(const float* a_amax, int64_t a_count, const float* b_amax, int64_t b_count,
                             float* alpha, float* beta, int64_t count, cudaStream_t stream);

// Bytes between per-tensor scalars copied by LaunchSpreadScalars: a slot keeps
// every copy at the workspace's own 256-byte alignment, so one cuBLASLt plan
// (keyed by pointer alignment) serves every matrix of a loop.
constexpr int64_t kScalarSlotBytes = 256;

// Per-tensor float32 scalars into aligned slots: dst[i * kScalarSlotBytes / 4]
// = src[i] for i < count (cuBLASLt reads scale pointers that must be 16-byte
// aligned; values of a [..., 1] array are 4 bytes apart).
cudaError_t LaunchSpreadScalars(const float* src, float* dst, int64_t count, cudaStream_t stream);

// Output dtypes of the finalisation kernel.
enum class OutType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// out[i, j] = cast(src[i, j] + bias[j]) over `rows` x `n` (bias may be null;
// its dtype is bias_type). `src` is float32 and may alias `out` when out is
// float32 (in-place bias add).
cudaError_t LaunchFinalize(const float* src, const void* bias, OutType bias_type, void* out, OutType out_type,
                           int64_t rows, int64_t n, cudaStream_t stream);

}  // namespace gemm
}  // namespace te_jax
