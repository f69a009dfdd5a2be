// Python module _te_jax_cuda: the CUDA FFI handlers, built when nvcc and
// cuBLASLt are found. A GEMM target is a handler bundle, {"initialize",
// "execute"} (the initialize stage builds its cuBLASLt plans outside any
// CUDA-graph capture: gemm_handlers.cu); every other target is its execute
// handler alone.
#include <nanobind/nanobind.h>

#include "../common/register_module.h"

namespace te_jax {
#define TE_DECLARE_CUDA(name, stem) TE_JAX_DECLARE_HANDLER(name, stem, Cuda)
#define TE_DECLARE_CUDA_BUNDLE(name, stem) \
  TE_JAX_DECLARE_HANDLER(name, stem, InitializeCuda) TE_JAX_DECLARE_HANDLER(name, stem, Cuda)
TE_JAX_FFI_TARGETS(TE_DECLARE_CUDA)
TE_JAX_GEMM_TARGETS(TE_DECLARE_CUDA_BUNDLE)
TE_JAX_NORM_ACT_TARGETS(TE_DECLARE_CUDA)
TE_JAX_GROUPED_GEMM_TARGETS(TE_DECLARE_CUDA)
}  // namespace te_jax

NB_MODULE(_te_jax_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    using namespace te_jax;
#define TE_ADD_CUDA(name, stem) TE_JAX_ADD_CAPSULE(name, stem, Cuda)
#define TE_ADD_CUDA_BUNDLE(name, stem)                                                          \
  {                                                                                             \
    nanobind::dict bundle;                                                                      \
    bundle["initialize"] = nanobind::capsule(reinterpret_cast<void*>(&stem##InitializeCuda)); \
    bundle["execute"] = nanobind::capsule(reinterpret_cast<void*>(&stem##Cuda));               \
    d[#name] = bundle;                                                                          \
  }
    TE_JAX_FFI_TARGETS(TE_ADD_CUDA)
    TE_JAX_GEMM_TARGETS(TE_ADD_CUDA_BUNDLE)
    TE_JAX_NORM_ACT_TARGETS(TE_ADD_CUDA)
    TE_JAX_GROUPED_GEMM_TARGETS(TE_ADD_CUDA)
    return d;
  });
}
