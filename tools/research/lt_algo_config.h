// "id=.. tile=.. stages=.. ..." of a cuBLASLt algorithm: its configuration
// attributes, as lt_probe.cu prints it.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <string>

namespace te_jax {

inline std::string AlgoConfig(const cublasLtMatmulAlgo_t& algo) {
  struct Field {
    const char* name;
    cublasLtMatmulAlgoConfigAttributes_t attr;
  };
  constexpr Field kFields[] = {{"id", CUBLASLT_ALGO_CONFIG_ID},
                               {"tile", CUBLASLT_ALGO_CONFIG_TILE_ID},
                               {"stages", CUBLASLT_ALGO_CONFIG_STAGES_ID},
                               {"splitk", CUBLASLT_ALGO_CONFIG_SPLITK_NUM},
                               {"reduction", CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME},
                               {"swizzle", CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING},
                               {"cluster", CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID},
                               {"inner", CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID},
                               {"custom", CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION}};
  std::string out;
  for (const Field& f : kFields) {
    // The size must match the attribute's (16 or 32 bits): ask for it first.
    size_t size = 0;
    uint64_t value = 0;  // little-endian: a narrower attribute lands in the low bytes
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, f.attr, nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS ||
        size > sizeof(value) ||
        cublasLtMatmulAlgoConfigGetAttribute(&algo, f.attr, &value, size, &size) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    out += std::string(out.empty() ? "" : " ") + f.name + "=" + std::to_string(value);
  }
  return out;
}

}  // namespace te_jax
