// One instantiation of the sm_90a block-scaled grouped FP8 GEMM (grouped_gemm_sm90.cuh):
// group_axis 1, K-block-major scales.
#include "grouped_gemm_sm90.cuh"

namespace te_jax {
namespace grouped {
TE_JAX_INSTANTIATE_GROUPED_FP8_BLOCK(kE4M3, kE4M3, kBf16, 1, GroupAxis::kContraction)
}  // namespace grouped
}  // namespace te_jax
