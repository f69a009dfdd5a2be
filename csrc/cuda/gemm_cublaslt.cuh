// One cuBLASLt matmul in te_jax's row-major, contraction-last terms, with a
// process-wide cache of handles, descriptors and heuristic results.
//
//   out[b, m, n] = alpha * sum_k A[b, m, k] * B[b, n, k]   (times the operand scales)
//
// cuBLASLt is column-major, so each call computes D^T = op(B) . op(A) with
// cuBLAS-A = our B (K x N column-major, transa = T), cuBLAS-B = our A (K x M
// column-major, transb = N) and D = out viewed as N x M column-major (ldd = N):
// the "TN" layout that FP8 on Hopper requires. Hence cuBLAS's A_SCALE_* and
// B_SCALE_* attributes carry *our B's* and *our A's* scales respectively.
//
// Caching (CUDA-graph safe): the first call for a configuration (device,
// shapes, dtypes, scale modes, fast_accum, bias, pointer mode, workspace size,
// and the alignment of every pointer) creates the cuBLASLt handle of the
// device, the matmul descriptor, the matrix layouts and the heuristic's
// algorithm, with the thread's stream-capture mode relaxed for that one-time
// host work. Every later call only takes the plan's mutex, sets the pointer
// attributes (host-only, no allocation) and enqueues cublasLtMatmul. Nothing
// in the steady state allocates, synchronises or creates a descriptor.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace te_jax {
namespace gemm {

namespace ffi = xla::ffi;

// How cuBLASLt reads an operand's scale pointer.
enum class ScaleMode : int {
  kNone = 0,     // no scale (bfloat16 operands)
  kScalar,       // one float32 (per-tensor FP8)
  kVec128,       // CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (1x128 blocks)
  kBlk128x128,   // CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
  kVec32Ue8m0,   // CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 (MXFP8, sm_100+)
  kVec16Ue4m3,   // CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 (NVFP4, sm_100+)
};

struct MatmulSpec {
  int device = 0;
  int64_t m = 0, n = 0, k = 0;  // per matrix, in elements
  int64_t batch = 1;            // strided batch: A, B and out advance by one matrix each
  cudaDataType_t a_type = CUDA_R_8F_E4M3, b_type = CUDA_R_8F_E4M3, d_type = CUDA_R_16BF;
  ScaleMode a_scale = ScaleMode::kNone, b_scale = ScaleMode::kNone;
  bool fast_accum = false;    // CUBLASLT_MATMUL_DESC_FAST_ACCUM (only with kScalar scales)
  bool bias = false;          // CUBLASLT_EPILOGUE_BIAS with a bias of dtype d_type, length n
  bool device_alpha = false;  // CUBLASLT_POINTER_MODE_DEVICE: alpha/beta are device floats
  size_t workspace_bytes = 0;
};

struct MatmulPointers {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* a_scale = nullptr;
  const void* b_scale = nullptr;
  const void* bias = nullptr;
  const float* alpha = nullptr;  // device pointers when spec.device_alpha, else unused (1, 0)
  const float* beta = nullptr;
  void* workspace = nullptr;     // 256-byte aligned, spec.workspace_bytes long
};

// Enqueues one (strided-batched) matmul on `stream`. The current device must
// be spec.device (see DeviceGuard).
ffi::Error RunMatmul(const MatmulSpec& spec, const MatmulPointers& ptrs, cudaStream_t stream);

// "M=.. N=.. K=.. batch=.." for error messages.
std::string ShapeString(const MatmulSpec& spec);

// The device that owns `stream`, made current for the guard's lifetime (the
// previous current device is restored on destruction).
class DeviceGuard {
 public:
  DeviceGuard() = default;
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ffi::Error Enter(cudaStream_t stream);
  int device() const { return device_; }

 private:
  int device_ = 0;
  int previous_ = -1;
};

// Compute capability (major * 10 + minor) of `device`, cached per device.
ffi::ErrorOr<int> ComputeCapability(int device);

// cuBLASLt's run-time version (major * 10000 + minor * 100 + patch).
size_t CublasLtVersion();

// ffi::Error::Internal naming the failed CUDA call, its status and the shape.
ffi::Error CudaError(const char* what, cudaError_t status, const std::string& shape);

}  // namespace gemm
}  // namespace te_jax
