"""The primitives floor: one module per op family, each a custom call with a pure-JAX reference twin.

Every primitive takes explicit arguments only (arrays, static options, mesh
axes); nothing here reads an autocast, a recipe or a quantizer.
"""

from te_jax.ops import backend, cast, dequantize, gemm, norm_act, quantize, sharding

__all__ = ["backend", "cast", "dequantize", "gemm", "norm_act", "quantize", "sharding"]
