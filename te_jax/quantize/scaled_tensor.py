"""ScaledTensor: quantized data, its scales, and the layout they are in."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp

from te_jax.ops import quantize as qops
from te_jax.quantize import numerics as nm


class ScalingMode(enum.Enum):
    """How a ScaledTensor's scales are laid out."""

    FP8_TENSOR = "fp8_tensor"  # one float32 scale per tensor (delayed and current scaling)
    MXFP8 = "mxfp8"  # 1x32 blocks, E8M0 scales
    FP8_BLOCK = "fp8_block"  # 1x128 or 128x128 blocks, float32 scales
    NVFP4 = "nvfp4"  # 1x16 (or 16x16) blocks, E4M3 scales, float32 global amax


def flattened_shape(shape: tuple[int, ...], flatten_axis: int) -> tuple[int, int]:
    """``(M, N)``: the product of the axes before and from ``flatten_axis``."""
    axis = flatten_axis % len(shape) if flatten_axis < 0 else flatten_axis
    if not 0 < axis < len(shape) + (len(shape) == 1):
        raise ValueError(f"te_jax: flatten_axis {flatten_axis} is out of range for shape {shape}")
    return math.prod(shape[:axis]), math.prod(shape[axis:])


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale_inv", "colwise_data", "colwise_scale_inv", "amax", "colwise_amax"],
    meta_fields=["mode", "qdtype", "shape", "flatten_axis", "block_2d", "rht"],
)
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
    """A quantized tensor of logical shape ``shape``, viewed as a matrix ``[M, N]``.

    Attributes:
      data: rowwise quantized matrix ``[M, N]`` (NVFP4: ``[M, N/2]`` packed
        uint8), or None.
      scale_inv: rowwise decode scales: ``[1]`` float32 (per tensor),
        ``[M, N/32]`` uint8 E8M0 codes (MXFP8), ``[M, N/128]`` or
        ``[M/128, N/128]`` float32 (FP8 block), ``[M, N/16]`` E4M3 (NVFP4).
      colwise_data / colwise_scale_inv: the same for the transposed matrix
        ``[N, M]``, or None.
      amax: float32 ``[1]``: the tensor's amax (per-tensor modes; NVFP4's
        global amax), else None.
      colwise_amax: NVFP4's global amax of the columnwise copy (after the
        Hadamard transform when ``rht``), else None.
      mode, qdtype, shape, flatten_axis, block_2d, rht: static layout.
    """

    data: jax.Array | None
    scale_inv: jax.Array | None
    colwise_data: jax.Array | None
    colwise_scale_inv: jax.Array | None
    amax: jax.Array | None
    colwise_amax: jax.Array | None
    mode: ScalingMode
    qdtype: jnp.dtype
    shape: tuple[int, ...]
    flatten_axis: int = -1
    block_2d: bool = False
    rht: bool = False

    @property
    def matrix_shape(self) -> tuple[int, int]:
        return flattened_shape(self.shape, self.flatten_axis)

    @property
    def has_rowwise(self) -> bool:
        return self.data is not None

    @property
    def has_colwise(self) -> bool:
        return self.colwise_data is not None

    def dequantize(self, dtype=jnp.float32, backend: str | None = None) -> jax.Array:
        """The represented values, in the logical shape (from the rowwise copy if present)."""
        if self.has_rowwise:
            values = _dequantize_matrix(self, self.data, self.scale_inv, self.amax, dtype, backend)
        else:
            values = jnp.swapaxes(self.dequantize_colwise(dtype, backend, undo_rht=True), -1, -2)
        return values.reshape(*values.shape[:-2], *self.shape)

    def dequantize_colwise(self, dtype=jnp.float32, backend: str | None = None, undo_rht: bool = False):
        """The columnwise copy's values as the matrix ``[N, M]``.

        With ``rht`` these are Hadamard-domain values unless ``undo_rht``.
        """
        if not self.has_colwise:
            raise ValueError("te_jax: this ScaledTensor has no columnwise copy")
        amax = self.colwise_amax if self.mode is ScalingMode.NVFP4 else self.amax
        values = _dequantize_matrix(self, self.colwise_data, self.colwise_scale_inv, amax, jnp.float32, backend)
        if self.rht and undo_rht:
            values = nm.inverse_rht16(values)
        return values.astype(dtype)


def _dequantize_matrix(t: ScaledTensor, data, scales, amax, dtype, backend):
    if t.mode is ScalingMode.FP8_TENSOR:
        return qops.dequantize_fp8_tensor(data, scales, out_dtype=dtype, backend=backend)
    if t.mode is ScalingMode.MXFP8:
        return qops.dequantize_mxfp8(data, scales, out_dtype=dtype, backend=backend)
    if t.mode is ScalingMode.FP8_BLOCK:
        return qops.dequantize_fp8_block(data, scales, block_2d=t.block_2d, out_dtype=dtype, backend=backend)
    return qops.dequantize_nvfp4(data, scales, amax, out_dtype=dtype, backend=backend)
