# Decides whether to build the CUDA handlers (module _te_jax_cuda) and finds
# cuBLASLt: first in the CUDA toolkit, then in the nvidia-cublas wheel, the
# same place jax's CUDA plugin loads it from at run time.
if(TE_JAX_CUDA STREQUAL "OFF")
  message(STATUS "te_jax: CUDA handlers disabled (TE_JAX_CUDA=OFF)")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
set(_te_missing "")
if(NOT CMAKE_CUDA_COMPILER)
  set(_te_missing "nvcc")
else()
  # Our default targets Hopper and Blackwell; CMake's own default (sm_75 with
  # nvcc 13) would run only through PTX JIT, without the FP8 instructions.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "90a;100a")
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__))"
    OUTPUT_VARIABLE _te_wheel_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT _te_wheel_dir)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import nvidia, os; d=os.path.join(list(nvidia.__path__)[0], 'cu13'); print(d if os.path.isdir(d) else '')"
      OUTPUT_VARIABLE _te_wheel_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  find_path(TE_JAX_CUBLASLT_INCLUDE cublasLt.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} "${_te_wheel_dir}/include")
  find_library(TE_JAX_CUBLASLT_LIBRARY NAMES cublasLt libcublasLt.so.13 libcublasLt.so.12
    HINTS ${CUDAToolkit_LIBRARY_DIR} "${_te_wheel_dir}/lib")
  if(NOT TE_JAX_CUBLASLT_INCLUDE OR NOT TE_JAX_CUBLASLT_LIBRARY)
    set(_te_missing "cuBLASLt (install the CUDA toolkit's cuBLAS or the nvidia-cublas wheel)")
  endif()
  if(NOT _te_missing)
    include("${CMAKE_CURRENT_LIST_DIR}/FindCutlass.cmake")
  endif()
endif()

if(_te_missing)
  if(TE_JAX_CUDA STREQUAL "ON")
    message(FATAL_ERROR "te_jax: TE_JAX_CUDA=ON but ${_te_missing} was not found")
  endif()
  message(STATUS "te_jax: building without CUDA handlers: ${_te_missing} not found")
  return()
endif()

message(STATUS "te_jax: CUDA handlers for ${CMAKE_CUDA_ARCHITECTURES}, cuBLASLt ${TE_JAX_CUBLASLT_LIBRARY}, "
               "CUTLASS ${TE_JAX_CUTLASS_INCLUDE}")

file(GLOB TE_JAX_CUDA_SOURCES CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/csrc/cuda/*.cu"
     "${PROJECT_SOURCE_DIR}/csrc/cuda/*.cc")
# The CUTLASS kernels (*_sm90_*.cu) use Hopper-only instructions: built for
# sm_90a alone, whatever CMAKE_CUDA_ARCHITECTURES says (their handlers refuse
# other devices with an error naming the architecture).
file(GLOB TE_JAX_CUDA_SM90_SOURCES CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/csrc/cuda/*_sm90_*.cu")
list(REMOVE_ITEM TE_JAX_CUDA_SOURCES ${TE_JAX_CUDA_SM90_SOURCES})
add_library(_te_jax_cuda_sm90 OBJECT ${TE_JAX_CUDA_SM90_SOURCES})
set_target_properties(_te_jax_cuda_sm90 PROPERTIES CUDA_ARCHITECTURES 90a POSITION_INDEPENDENT_CODE ON
                                                   CUDA_RUNTIME_LIBRARY Static CUDA_VISIBILITY_PRESET hidden)
target_include_directories(_te_jax_cuda_sm90 SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}" "${TE_JAX_CUTLASS_INCLUDE}")
target_include_directories(_te_jax_cuda_sm90 PRIVATE "${PROJECT_SOURCE_DIR}/csrc")
target_compile_options(_te_jax_cuda_sm90 PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3 --expt-relaxed-constexpr>)
nanobind_add_module(_te_jax_cuda NB_STATIC ${TE_JAX_CUDA_SOURCES} $<TARGET_OBJECTS:_te_jax_cuda_sm90>)
set_target_properties(_te_jax_cuda PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
                                              CUDA_RUNTIME_LIBRARY Static)
target_include_directories(_te_jax_cuda SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}" "${TE_JAX_CUBLASLT_INCLUDE}")
target_include_directories(_te_jax_cuda PRIVATE "${PROJECT_SOURCE_DIR}/csrc")
# --ftz=true: float32 subnormals flush to zero, as on XLA:CPU, where the
# reference runs; the spec (docs/numerics.md) is float32 with FTZ/DAZ.
target_compile_options(_te_jax_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 --expt-relaxed-constexpr --ftz=true --prec-div=true --prec-sqrt=true>)
target_link_libraries(_te_jax_cuda PRIVATE "${TE_JAX_CUBLASLT_LIBRARY}")
# cuBLASLt is loaded at run time from wherever jax's CUDA plugin found it.
set_target_properties(_te_jax_cuda PROPERTIES INSTALL_RPATH "$ORIGIN/../nvidia/cu13/lib;$ORIGIN/../nvidia/cublas/lib")
install(TARGETS _te_jax_cuda LIBRARY DESTINATION te_jax)
