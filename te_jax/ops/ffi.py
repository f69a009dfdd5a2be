"""Loads the compiled FFI handlers and registers them with XLA.

The CPU handlers are always built. The CUDA handlers exist when te_jax was
built with nvcc and cuBLASLt; on a machine with a CUDA jax plugin but without
them, importing te_jax warns once. A custom call is never swapped for
something else: without the CUDA handlers, compiling a te_jax op for a GPU
fails with XLA's "no registered implementation" error.
"""

from __future__ import annotations

import importlib.util
import warnings

import jax

from te_jax import _te_jax_cpu

for _name, _capsule in _te_jax_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

TARGETS: tuple[str, ...] = tuple(sorted(_te_jax_cpu.registrations()))

try:
    from te_jax import _te_jax_cuda  # noqa: F401  (optional build product)
except ImportError as _err:  # built without CUDA, or libcublasLt not loadable
    CUDA_BUILT = False
    _cuda_import_error = str(_err)
else:
    CUDA_BUILT = True
    _cuda_import_error = ""
    # A GEMM target's value is a handler bundle {"initialize": ..., "execute": ...}: its initialize stage builds
    # the cuBLASLt plans outside any CUDA-graph capture (docs/gemm_ffi.md, "CUDA graphs").
    for _name, _handler in _te_jax_cuda.registrations().items():
        jax.ffi.register_ffi_target(_name, _handler, platform="CUDA")

REBUILD_HINT = (
    "rebuild te_jax on a machine with nvcc and cuBLASLt: "
    "pip install --no-build-isolation --no-deps -C cmake.define.TE_JAX_CUDA=ON ."
)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _cuda_plugin_installed() -> bool:
    names = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
    return any(_module_exists(name) for name in names)


if not CUDA_BUILT and _cuda_plugin_installed():
    warnings.warn(
        "te_jax: jax has a CUDA plugin but te_jax's CUDA kernels are not built "
        f"({_cuda_import_error or 'module _te_jax_cuda missing'}); te_jax ops compiled for a GPU "
        f"will fail. To fix: {REBUILD_HINT}",
        RuntimeWarning,
        stacklevel=2,
    )
