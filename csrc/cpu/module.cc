// Python module _te_jax_cpu: the CPU FFI handlers, always built.
#include <nanobind/nanobind.h>

#include "../common/register_module.h"

namespace te_jax {
#define TE_DECLARE_CPU(name, stem) TE_JAX_DECLARE_HANDLER(name, stem, Cpu)
TE_JAX_FFI_TARGETS(TE_DECLARE_CPU)
TE_JAX_GEMM_TARGETS(TE_DECLARE_CPU)
TE_JAX_GROUPED_GEMM_TARGETS(TE_DECLARE_CPU)
TE_JAX_NORM_ACT_TARGETS(TE_DECLARE_CPU)
}  // namespace te_jax

NB_MODULE(_te_jax_cpu, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    using namespace te_jax;
#define TE_ADD_CPU(name, stem) TE_JAX_ADD_CAPSULE(name, stem, Cpu)
    TE_JAX_FFI_TARGETS(TE_ADD_CPU)
    TE_JAX_GEMM_TARGETS(TE_ADD_CPU)
    TE_JAX_GROUPED_GEMM_TARGETS(TE_ADD_CPU)
    TE_JAX_NORM_ACT_TARGETS(TE_ADD_CPU)
    return d;
  });
}
