"""te_jax: FP8 and FP4 training for JAX and Flax on NVIDIA GPUs."""

from te_jax import _ffi, backend, ops, quantize

__version__ = "0.1.0"
FP8_COLLECTION = "fp8_meta"

__all__ = ["FP8_COLLECTION", "backend", "ops", "quantize"]
