// One cuBLASLt matmul (or several identical ones over consecutive matrices)
// in te_jax's row-major, contraction-last terms, with a process-wide cache of
// handles, descriptors and autotuned algorithms.
//
//   out[b, m, n] = alpha * sum_k A[b, m, k] * B[b, n, k]   (times the operand scales)
//
// cuBLASLt is column-major, so each call computes D^T = op(B) . op(A) with
// cuBLAS-A = our B (K x N column-major, transa = T), cuBLAS-B = our A (K x M
// column-major, transb = N) and D = out viewed as N x M column-major (ldd = N):
// the "TN" layout that FP8 on Hopper requires. Hence cuBLAS's A_SCALE_* and
// B_SCALE_* attributes carry *our B's* and *our A's* scales respectively.
//
// Plans (CUDA graphs): a plan is keyed by everything that selects a
// descriptor, layouts or algorithm (device, shapes, dtypes, scale modes,
// fast_accum, autotune, bias, pointer mode, workspace size) and by the
// *guaranteed* alignment of every pointer over all the matrices it will be
// used for (the first pointer combined with the batch stride and the per-call
// step), so one plan serves every matrix of a RunMatmuls call and its
// assumptions hold for each. Plans are built by PlanMatmuls, which the GEMM
// handlers call in their FFI initialize stage (outside any stream capture,
// with the execution's real buffer addresses): under the plan's own mutex
// (not the cache's, so other devices' threads never wait on it), the
// device's cuBLASLt handle, the matmul descriptor, the layouts, up to
// kMaxCandidates heuristic algorithms and, when the spec asks for
// autotuning, the fastest of them timed on the stream (gemm_autotune.cu,
// "Autotuning"); otherwise the heuristic's first. RunMatmuls, the execute
// stage, only looks the plan up (a missing plan is an error, never built
// there), takes the plan's mutex, sets the pointer attributes (host-only, no
// allocation) and enqueues cublasLtMatmul: it neither allocates,
// synchronises nor creates a descriptor, so XLA may capture it into a CUDA
// graph (command buffer) from its first call.
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
  bool autotune = false;      // time the heuristic's candidates when the plan is built (else its first)
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
  // Device floats in the GEMM's scratch when spec.device_alpha, else unused
  // (1, 0). Autotuning sets the first call's to 1 and 0 while it times.
  float* alpha = nullptr;
  float* beta = nullptr;
  void* workspace = nullptr;     // 256-byte aligned, spec.workspace_bytes long
};

// `calls` matmuls of one spec, call i using the first call's pointers advanced
// by i * step (bytes). Steps of 0 share a buffer between calls.
struct MatmulSteps {
  int64_t calls = 1;
  int64_t a = 0, b = 0, d = 0;
  int64_t a_scale = 0, b_scale = 0;
  int64_t alpha = 0;  // alpha and beta advance together
};

// Builds the plan RunMatmuls will need for these pointers, unless it exists
// (the initialize stage; buffer contents may be undefined). With
// spec.autotune and more than one candidate, the candidates are timed on
// `stream` with these pointers: they write the first call's d and the
// workspace; d's previous bytes are restored afterwards (d may be a donated
// input the program has not read yet). The current device must be
// spec.device (see DeviceGuard).
ffi::Error PlanMatmuls(const MatmulSpec& spec, const MatmulPointers& first, const MatmulSteps& steps,
                       cudaStream_t stream);

// Enqueues the (strided-batched) matmul(s) on `stream`, back to back, all with
// the plan PlanMatmuls built for the same spec and pointer alignments (an
// Internal error names the shape if there is none). Capturable.
ffi::Error RunMatmuls(const MatmulSpec& spec, const MatmulPointers& first, const MatmulSteps& steps,
                      cudaStream_t stream);

// "M=.. N=.. K=.. batch=.." for error messages.
std::string ShapeString(const MatmulSpec& spec);

// Makes `device` (XLA's device ordinal of the call: a stream's device cannot
// be queried while it is being captured) current for the guard's lifetime;
// the previous current device is restored on destruction.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ffi::Error Enter(int device);
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
