// Shared by the cuBLASLt probes: error checks (a failed CUDA or cuBLAS call prints where and why, then exits)
// and the random values they fill their operands with.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace te_jax_probe {

[[noreturn]] inline void Fail(const char* file, int line, const char* expr, const std::string& why) {
  std::fprintf(stderr, "%s:%d %s: %s\n", file, line, expr, why.c_str());
  std::exit(1);
}

// A roughly standard normal value for element i: the sum of four uniforms from a hash (variance 1/3,
// so times sqrt(3)).
__device__ inline float HashNormal(int64_t i, uint32_t seed) {
  float sum = 0.0f;
  for (uint32_t j = 0; j < 4; ++j) {
    uint32_t h = static_cast<uint32_t>(i) * 4u + j + seed * 0x9E3779B9u;
    h ^= h >> 16;
    h *= 0x7feb352dU;
    h ^= h >> 15;
    h *= 0x846ca68bU;
    h ^= h >> 16;
    sum += static_cast<float>(h) * (1.0f / 4294967296.0f) - 0.5f;
  }
  return sum * 1.7320508f;
}

}  // namespace te_jax_probe

#define CHECK_CUDA(x)                                                                                  \
  do {                                                                                                 \
    if (cudaError_t e_ = (x); e_ != cudaSuccess)                                                       \
      te_jax_probe::Fail(__FILE__, __LINE__, #x, cudaGetErrorString(e_));                              \
  } while (0)
#define CHECK_LT(x)                                                                                    \
  do {                                                                                                 \
    if (cublasStatus_t s_ = (x); s_ != CUBLAS_STATUS_SUCCESS)                                          \
      te_jax_probe::Fail(__FILE__, __LINE__, #x, "cuBLAS status " + std::to_string(int(s_)));          \
  } while (0)
