// Shape, dtype and workspace bookkeeping shared by the CUDA GEMM handlers
// (docs/gemm_ffi.md is the contract these checks enforce).
#pragma once

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "../common/ffi_common.h"
#include "gemm_kernels.cuh"

namespace te_jax {
namespace gemm {

// The logical problem: `count` matrices A [m, k] against B [n, k] (one shared
// B when `b_shared`, else one per matrix of A), out [count, m, n].
struct Problem {
  const char* target;
  int64_t count = 1;  // product of A's leading axes
  int64_t m = 0, n = 0, k = 0;
  bool b_shared = true;
  std::string shapes;  // "A [..] B [..]" for messages

  int64_t b_count() const { return b_shared ? 1 : count; }
  bool empty() const { return count == 0 || m == 0 || n == 0; }  // nothing to compute
  std::string Describe() const;  // "<target> with A [..] B [..] (M=.. N=.. K=.. batch=..)"
};

// Parses A [..., M, K/k_div] and B [N, K/k_div] or [..., N, K/k_div] (k_div is
// 2 for packed NVFP4, else 1), checks out [..., M, N] and the 16-element
// alignment cuBLASLt needs for M, N and K.
ffi::ErrorOr<Problem> ParseProblem(const char* target, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                   int64_t k_div, const ffi::AnyBuffer& out);

// An FP8 operand dtype as cuBLASLt's, refusing E5M2 x E5M2 and non-FP8 dtypes.
ffi::Error CheckFp8Pair(const Problem& p, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                        cudaDataType_t* a_type, cudaDataType_t* b_type);

// Element count of a per-operand array: exactly `want`, else InvalidArgument.
ffi::Error CheckCount(const Problem& p, const ffi::AnyBuffer& buf, const char* name, int64_t want);

// A float32 per-tensor scalar (scale_inv or amax): 1 element, or one per matrix of its operand.
ffi::Error CheckScalars(const Problem& p, const ffi::AnyBuffer& buf, const char* name, int64_t matrices);

cudaDataType_t CudaTypeOf(ffi::DataType t);
OutType OutTypeOf(ffi::DataType t);

// How the result reaches `out`.
struct OutputPlan {
  bool bias = false;      // a bias is given
  bool epilogue = false;  // bias added by cuBLASLt's CUBLASLT_EPILOGUE_BIAS
  bool staged = false;    // GEMM writes float32 into the workspace, then a kernel casts (+ bias)
  bool post_add = false;  // float32 out: a kernel adds the float32 bias in place
  cudaDataType_t d_type = CUDA_R_32F;  // what cuBLASLt writes
};

// `narrow`: FP8/FP4 operands (cuBLASLt's FP8 bias rules); otherwise the
// bfloat16 emulation GEMM (no float16 D from bfloat16 operands).
ffi::ErrorOr<OutputPlan> PlanOutput(const Problem& p, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& out,
                                    bool narrow);

// Bump allocator over the workspace result: 256-byte aligned regions first,
// cuBLASLt's workspace is whatever remains.
class Workspace {
 public:
  explicit Workspace(ffi::AnyBuffer buf);
  void* Take(int64_t bytes);  // valid only once Check() succeeds
  ffi::Error Check(const Problem& p) const;
  void* cublas_workspace() const;
  size_t cublas_bytes() const;

 private:
  uintptr_t base_ = 0;  // aligned start
  int64_t size_ = 0;    // usable bytes from base_
  int64_t used_ = 0;
};

// Launch status -> ffi::Error naming the kernel and the problem.
ffi::Error Launched(cudaError_t status, const char* kernel, const Problem& p);

}  // namespace gemm
}  // namespace te_jax
