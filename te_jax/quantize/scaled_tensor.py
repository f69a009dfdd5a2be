"""ScaledTensor: quantized data, its scales, and the layout they are in (``te_jax.quantize.modes``)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from te_jax.ops import quantize as qops
from te_jax.quantize import numerics as nm
from te_jax.quantize.modes import ModeSpec, ScalingMode, mode_spec


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

    In the block modes each copy's last axis is zero padded to whole blocks
    (``N'``, ``M'`` below: ``N``, ``M`` rounded up to the block; equal to them
    when the blocks tile the matrix), so a partial block has its own scale;
    ``dequantize`` returns the logical shape.

    Attributes:
      data: rowwise quantized matrix ``[M, N]`` (block modes ``[M, N']``;
        NVFP4: ``[M, N'/2]`` packed uint8), or None.
      scale_inv: rowwise decode scales: ``[1]`` float32 (per tensor),
        ``[M, N'/32]`` uint8 E8M0 codes (MXFP8), ``[M, N'/128]`` or
        ``[ceil(M/128), N'/128]`` float32 (FP8 block), ``[M, N'/16]`` E4M3 (NVFP4).
      colwise_data / colwise_scale_inv: the same for the transposed matrix
        ``[N, M]``, or None.
      amax: float32 ``[1]``: the tensor's amax (per-tensor modes; NVFP4's
        global amax), else None.
      colwise_amax: NVFP4's global amax of the columnwise copy (after the
        Hadamard transform when ``rht``), else None.
      mode, qdtype, shape, flatten_axis, block_2d, rht: static layout;
        ``(mode, block_2d)`` names the registry entry ``scaling_mode``.
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

    @classmethod
    def from_kernel_outputs(
        cls, spec: ModeSpec, qdtype, shape, *, q, s, q_t=None, s_t=None, amax=None, amax_t=None, rowwise=True,
        colwise=False, flatten_axis: int = -1, rht: bool = False,
    ) -> ScaledTensor:
        """The ScaledTensor of logical ``shape`` from what a quantize kernel of mode ``spec`` wrote.

        ``q, s, q_t, s_t, amax, amax_t`` are the kernel's outputs in the layouts
        of ``te_jax.ops.quantize``; the mode decides which are kept: a
        per-tensor scale ``s`` serves both copies (``s_t`` is ignored), the
        amax is kept by per-tensor modes and NVFP4 (which also keeps the
        columnwise ``amax_t``), and ``rht`` marks NVFP4's transformed
        columnwise copy. Outputs of a copy that was not asked for are dropped.
        """
        if rht and not spec.hadamard:
            raise ValueError(f"te_jax: the Hadamard transform (rht) applies to NVFP4 1x16 blocks, not {spec.name}")
        return cls(
            data=q if rowwise else None,
            scale_inv=s if rowwise else None,
            colwise_data=q_t if colwise else None,
            colwise_scale_inv=(s if spec.per_tensor else s_t) if colwise else None,
            amax=amax if spec.per_tensor or spec.global_amax else None,
            colwise_amax=amax_t if spec.global_amax and colwise else None,
            mode=spec.family,
            qdtype=jnp.dtype(qdtype),
            shape=tuple(shape),
            flatten_axis=flatten_axis,
            block_2d=spec.block_2d,
            rht=bool(rht and colwise),
        )

    @property
    def scaling_mode(self) -> ModeSpec:
        """This tensor's entry in the scaling-mode registry."""
        return mode_spec(self.mode, self.block_2d)

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
            values = _first_columns(values, self.matrix_shape[1])
        else:
            values = jnp.swapaxes(self.dequantize_colwise(dtype, backend, undo_rht=True), -1, -2)
        return values.reshape(*values.shape[:-2], *self.shape)

    def dequantize_colwise(self, dtype=jnp.float32, backend: str | None = None, undo_rht: bool = False):
        """The columnwise copy's values as the matrix ``[N, M]``.

        With ``rht`` these are Hadamard-domain values unless ``undo_rht``:
        then a partial 16-group's transformed padding is part of them, so
        they are ``[N, M']`` with ``M'`` rounded up to whole groups.
        """
        if not self.has_colwise:
            raise ValueError("te_jax: this ScaledTensor has no columnwise copy")
        amax = self.colwise_amax if self.scaling_mode.global_amax else self.amax
        values = _dequantize_matrix(self, self.colwise_data, self.colwise_scale_inv, amax, jnp.float32, backend)
        if self.rht and not undo_rht:
            return values.astype(dtype)
        if self.rht:
            values = nm.inverse_rht16(values)
        return _first_columns(values, self.matrix_shape[0]).astype(dtype)


def _first_columns(values: jax.Array, count: int) -> jax.Array:
    """``values [..., R, C]`` without the block padding after column ``count`` (as it is when there is none)."""
    return values if values.shape[-1] == count else values[..., :count]


def _dequantize_matrix(t: ScaledTensor, data, scales, amax, dtype, backend):
    return qops.dequantize(t.scaling_mode, data, scales, amax, out_dtype=dtype, backend=backend)
