// Internal to gemm_cublaslt.cu and gemm_autotune.cu (not for the handlers):
// what a plan build needs from the autotuner, and what the autotuner needs
// from the plans to run a candidate.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gemm_cublaslt.cuh"

namespace te_jax {
namespace gemm {

// A cached cuBLASLt plan (handle, descriptor, layouts, algorithm), defined in
// gemm_cublaslt.cu; the autotuner only passes it back to Enqueue.
struct Plan;

// Defined in gemm_cublaslt.cu.

// ffi::Error::Internal naming the failed cuBLASLt call, its status and the shape.
ffi::Error LtError(const char* what, cublasStatus_t status, const MatmulSpec& spec);

// Enqueues one matmul with `algo` (the pointer attributes must be set).
cublasStatus_t Enqueue(const Plan& plan, const MatmulSpec& s, const MatmulPointers& p,
                       const cublasLtMatmulAlgo_t& algo, cudaStream_t stream);

// Defined in gemm_autotune.cu.

// The index in `candidates` (the heuristic's algorithms, in its order, at
// least one) of the algorithm `plan` keeps: 0 when s.autotune is off, there
// is only one, or `stream` is being captured; else the fastest on `stream`
// with the call's pointers (set in the descriptor), timed with device alpha
// and beta set to 1 and 0, and with p.d's bytes written back afterwards.
ffi::ErrorOr<size_t> ChooseCandidate(const Plan& plan, const MatmulSpec& s, const MatmulPointers& p,
                                     const std::vector<cublasLtMatmulAlgo_t>& candidates, cudaStream_t stream);

}  // namespace gemm
}  // namespace te_jax
