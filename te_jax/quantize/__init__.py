"""Quantization: ScaledTensor, scaling modes, quantizers and the reference numerics."""

from te_jax.quantize import numerics, reference
from te_jax.quantize.scaled_tensor import ScaledTensor, ScalingMode, flattened_shape
from te_jax.quantize.delayed import DelayedScalingQuantizer
from te_jax.quantize.quantizers import (
    CurrentScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
    as_matrix,
)

__all__ = [
    "CurrentScalingQuantizer",
    "DelayedScalingQuantizer",
    "Float8BlockQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "Quantizer",
    "ScaledTensor",
    "ScalingMode",
    "as_matrix",
    "flattened_shape",
    "numerics",
    "reference",
]
