"""ScaledTensor: quantized data, its scales, and the layout they are in (``te_jax.spec.modes``)."""

from __future__ import annotations

import dataclasses
import functools
import math

from typing import Any, NamedTuple

import jax
import numpy as np
import jax.numpy as jnp

from te_jax.spec import modes
from te_jax.spec.modes import ModeSpec, ScalingMode, mode_spec


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
    ``te_jax.ops.quantize.dequantize`` returns the logical shape.

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


@dataclasses.dataclass(frozen=True)
class CastSpec:
    """How a fused kernel writes its output (the FFI attribute contract of the cast).

    Attributes:
      mode: "none" (unquantized), "fp8_tensor" (given scale, delayed scaling),
        "fp8_current", "mxfp8", "fp8_block" (1x128), "nvfp4" (1x16).
      qdtype: the FP8 dtype (FP8 modes), the output dtype ("none"; None: the
        input's dtype), ignored for "nvfp4".
      rowwise, colwise: which copies ("none": rowwise only).
      power_2: power-of-two scales ("fp8_current", "fp8_block").
      epsilon: amax lower bound ("fp8_current").
      rht: random Hadamard transform of the columnwise copy ("nvfp4").
      stochastic_rounding: ("nvfp4"), needs a PRNG key.
    """

    mode: str = "none"
    qdtype: Any = None
    rowwise: bool = True
    colwise: bool = False
    power_2: bool = False
    epsilon: float = 0.0
    rht: bool = False
    stochastic_rounding: bool = False

    @property
    def attrs(self) -> dict:
        """The FFI attributes of the cast (``csrc/common/norm_act.h``: ParseCastSpec)."""
        return dict(
            mode=self.mode, rowwise=bool(self.rowwise), colwise=bool(self.colwise), power_2=bool(self.power_2),
            amax_epsilon=np.float32(self.epsilon), rht=bool(self.rht and self.colwise),
            stochastic_rounding=bool(self.stochastic_rounding),
        )

    @property
    def scaling_mode(self) -> modes.ModeSpec:
        """The registry entry this cast writes (not defined for "none")."""
        return modes.by_cast_mode(self.mode)


class CastOutputs(NamedTuple):
    """The seven cast results of a fused op (empty ``[0]`` arrays where not produced)."""

    q: jax.Array
    s: jax.Array
    q_t: jax.Array
    s_t: jax.Array
    amax: jax.Array
    amax_t: jax.Array
    scale: jax.Array
