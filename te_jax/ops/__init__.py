"""te_jax ops: one module per op family, each a custom call with a pure-JAX reference twin."""

from te_jax.ops import activation, fused_cast, gemm, norm, quantize

__all__ = ["activation", "fused_cast", "gemm", "norm", "quantize"]
