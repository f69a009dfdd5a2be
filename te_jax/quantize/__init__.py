"""Quantization: scaling modes, ScaledTensor, quantizers and the reference numerics.

The scaling-mode registry (``modes``), ``ScaledTensor`` and the reference
twins are imported with this package; the quantizers (``quantizers``,
``delayed``) and the quantizer-level fused ops (``fused``) are imported on
first use, so that the ops layer, which imports the reference twins from
here, never loads them.
"""

import importlib

from te_jax.quantize import modes, numerics, reference
from te_jax.quantize.modes import ModeSpec, ScalingMode
from te_jax.quantize.scaled_tensor import ScaledTensor, flattened_shape

_LAZY = {
    "CurrentScalingQuantizer": "te_jax.quantize.quantizers",
    "Float8BlockQuantizer": "te_jax.quantize.quantizers",
    "MXFP8Quantizer": "te_jax.quantize.quantizers",
    "NVFP4Quantizer": "te_jax.quantize.quantizers",
    "Quantizer": "te_jax.quantize.quantizers",
    "as_matrix": "te_jax.quantize.quantizers",
    "DelayedScalingQuantizer": "te_jax.quantize.delayed",
}
_LAZY_MODULES = ("delayed", "fused", "quantizers", "ref_norm_act")

__all__ = [
    "CurrentScalingQuantizer",
    "DelayedScalingQuantizer",
    "Float8BlockQuantizer",
    "MXFP8Quantizer",
    "ModeSpec",
    "NVFP4Quantizer",
    "Quantizer",
    "ScaledTensor",
    "ScalingMode",
    "as_matrix",
    "flattened_shape",
    "modes",
    "numerics",
    "reference",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"te_jax.quantize.{name}")
    raise AttributeError(f"module 'te_jax.quantize' has no attribute {name!r}")
