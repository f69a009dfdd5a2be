// One instantiation of the sm_90a grouped bfloat16 GEMM (grouped_gemm_sm90.cuh): the forward layout.
#include "grouped_gemm_sm90.cuh"

namespace te_jax {
namespace grouped {
TE_JAX_INSTANTIATE_GROUPED_BF16(kForward)
}  // namespace grouped
}  // namespace te_jax
