"""te_jax ops: one module per op family, each a custom call with a pure-JAX reference twin."""

from te_jax.ops import quantize

__all__ = ["quantize"]
