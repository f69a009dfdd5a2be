"""te_jax ops: one module per op family, each a custom call with a pure-JAX reference twin."""

from te_jax.ops import gemm, quantize

__all__ = ["gemm", "quantize"]
