// Python module _te_jax_cuda: the CUDA FFI handlers, built when nvcc and
// cuBLASLt are found.
#include <nanobind/nanobind.h>

#include "../common/register_module.h"

namespace te_jax {
#define TE_DECLARE_CUDA(name, stem) TE_JAX_DECLARE_HANDLER(name, stem, Cuda)
TE_JAX_FFI_TARGETS(TE_DECLARE_CUDA)
TE_JAX_GEMM_TARGETS(TE_DECLARE_CUDA)
TE_JAX_NORM_ACT_TARGETS(TE_DECLARE_CUDA)
TE_JAX_GROUPED_GEMM_TARGETS(TE_DECLARE_CUDA)
}  // namespace te_jax

NB_MODULE(_te_jax_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    using namespace te_jax;
#define TE_ADD_CUDA(name, stem) TE_JAX_ADD_CAPSULE(name, stem, Cuda)
    TE_JAX_FFI_TARGETS(TE_ADD_CUDA)
    TE_JAX_GEMM_TARGETS(TE_ADD_CUDA)
    TE_JAX_NORM_ACT_TARGETS(TE_ADD_CUDA)
    TE_JAX_GROUPED_GEMM_TARGETS(TE_ADD_CUDA)
    return d;
  });
}
