"""The quantize floor: quantizers (one frozen dataclass per scaling mode), fused casts and dequantize.

A quantizer turns a high-precision array into a ``ScaledTensor``
(``te_jax.spec``) through the primitives of ``te_jax.ops``.
"""

from te_jax.ops.dequantize import dequantize, dequantize_colwise
from te_jax.quantize import delayed, fused, protocols
from te_jax.quantize.delayed import DelayedScalingQuantizer, DelayedState, StateUpdate
from te_jax.quantize.quantizers import (CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer,
                                        NVFP4Quantizer, as_matrix)
from te_jax.quantize.protocols import Quantizer, StatefulQuantizer
from te_jax.spec import ModeSpec, ScaledTensor, ScalingMode, flattened_shape

__all__ = [
    "CurrentScalingQuantizer", "DelayedScalingQuantizer", "DelayedState", "Float8BlockQuantizer", "MXFP8Quantizer",
    "ModeSpec", "NVFP4Quantizer", "Quantizer", "ScaledTensor", "ScalingMode", "StateUpdate", "StatefulQuantizer",
    "as_matrix", "delayed", "dequantize", "dequantize_colwise", "flattened_shape", "fused", "protocols",
]
