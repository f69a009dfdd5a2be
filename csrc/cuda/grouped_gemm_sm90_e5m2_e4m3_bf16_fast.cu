// One instantiation of the sm_90a grouped FP8 GEMM (grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

namespace te_jax {
namespace grouped {
TE_JAX_INSTANTIATE_GROUPED_FP8(kE5M2, kE4M3, kBf16, true)
}  // namespace grouped
}  // namespace te_jax
