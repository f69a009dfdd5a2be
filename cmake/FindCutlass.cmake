# Finds the CUTLASS headers (include/cutlass, include/cute) for the grouped
# GEMM's sm_90a kernels. They come from the nvidia-cutlass wheel, a pinned
# build requirement (pyproject.toml), found through the build's Python the way
# nanobind is: its cutlass_library package holds source/include. The package is
# located without importing it (importing needs its run-time dependencies).
# -DTE_JAX_CUTLASS_DIR=<folder holding include/cutlass> overrides the search
# (tools/gpu_check.py passes an unpacked wheel's folder). Sets
# TE_JAX_CUTLASS_INCLUDE, or appends to _te_missing.
if(NOT TE_JAX_CUTLASS_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source') if s else '')"
    OUTPUT_VARIABLE TE_JAX_CUTLASS_DIR OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
find_path(TE_JAX_CUTLASS_INCLUDE cutlass/gemm/group_array_problem_shape.hpp
  HINTS "${TE_JAX_CUTLASS_DIR}/include" NO_DEFAULT_PATH)
if(NOT TE_JAX_CUTLASS_INCLUDE)
  set(_te_missing "CUTLASS headers (pip install nvidia-cutlass, or pass -DTE_JAX_CUTLASS_DIR)")
endif()
