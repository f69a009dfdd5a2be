"""Stateless quantizers: one small frozen dataclass per scaling mode.

A quantizer turns a high-precision tensor into a ``ScaledTensor``::

    q = CurrentScalingQuantizer(jnp.float8_e4m3fn).quantize(x, colwise=True)

The protocol every quantizer follows (custom recipes may return their own;
declared in ``te_jax.quantize.protocols``):

* ``quantize(x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1,
  key=None) -> ScaledTensor``; ``x`` is viewed as the matrix
  ``[prod(shape[:flatten_axis]), prod(shape[flatten_axis:])]`` and the
  columnwise copy is the transpose of that matrix.
* stateful quantizers (delayed scaling) also have ``init_state()`` and
  ``update_state(state, amax)``; stateless ones take ``state=None``.
* optional: ``quantize_like(x, like, *, rowwise, colwise, flatten_axis)``,
  ``x`` quantized with the scale that quantized ``like`` (a ScaledTensor of
  this quantizer whose values include all of ``x``'s, such as a
  rearrangement of some of its rows), without an amax pass of its own.
* optional: ``scaling_mode`` (the ``te_jax.spec.modes`` entry it
  writes) and ``fused_cast(state, *, rowwise, colwise)``, the
  ``(CastSpec, scale)`` that writes the same ScaledTensor from inside a fused
  norm / activation kernel, or None when it cannot be fused
  (``te_jax.quantize.fused``).

Quantizers are frozen and hashable, so they can be static arguments of jit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from te_jax.ops import quantize as qops
from te_jax.ops.quantize import as_matrix
from te_jax.quantize.protocols import Quantizer  # noqa: F401  (declared in protocols; re-exported)
from te_jax.spec import modes
from te_jax.spec import numerics as nm
from te_jax.spec.modes import CastSpec, ScaledTensor


def _fp8_dtype(dtype) -> jnp.dtype:
    return qops.check_fp8_dtype(dtype)


def _if_fused(quantizer, spec: CastSpec) -> tuple[CastSpec, None] | None:
    """``(spec, None)`` when the kernels fuse ``quantizer``'s mode into a norm / activation, else None."""
    return (spec, None) if spec.mode in quantizer.scaling_mode.cast_modes else None


@dataclasses.dataclass(frozen=True)
class CurrentScalingQuantizer:
    """Per-tensor FP8 with the scale computed from this tensor's own amax.

    Attributes:
      dtype: jnp.float8_e4m3fn or jnp.float8_e5m2.
      power_2_scales: round the scale down to a power of two.
      amax_epsilon: lower bound on the amax used for the scale.
    """

    dtype: Any = jnp.float8_e4m3fn
    power_2_scales: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "dtype", _fp8_dtype(self.dtype))
        if not (self.amax_epsilon >= 0 and self.amax_epsilon < float("inf")):
            raise ValueError(f"amax_epsilon must be a finite number >= 0, got {self.amax_epsilon}")

    scaling_mode = modes.FP8_TENSOR

    def fused_cast(self, state=None, *, rowwise=True, colwise=False):
        return CastSpec("fp8_current", self.dtype, rowwise, colwise, self.power_2_scales, self.amax_epsilon), None

    def quantize(self, x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1, key=None, backend=None):
        x2 = as_matrix(x, flatten_axis)
        q, q_t, amax, _, scale_inv = qops.quantize_fp8_current(
            x2, qdtype=self.dtype, rowwise=rowwise, colwise=colwise,
            power_2=self.power_2_scales, epsilon=self.amax_epsilon, backend=backend,
        )
        return ScaledTensor.from_kernel_outputs(self.scaling_mode, self.dtype, x.shape, q=q, s=scale_inv, q_t=q_t,
                                                amax=amax, rowwise=rowwise, colwise=colwise, flatten_axis=flatten_axis)

    def quantize_like(self, x, like: ScaledTensor, *, rowwise=True, colwise=False, flatten_axis=-1, backend=None):
        """``x`` cast with the scale ``like`` was cast with, computed again from ``like.amax`` (one pass, no amax
        pass first). Meant for a tensor whose values are among ``like``'s, so that the scale fits it; the
        result's amax is ``like``'s."""
        if like.amax is None:
            raise ValueError("te_jax: quantize_like needs a ScaledTensor with its amax (current scaling's output)")
        x2 = as_matrix(x, flatten_axis)
        scale = nm.scale_from_amax(like.amax, nm.fp8_max(self.dtype), self.amax_epsilon, self.power_2_scales)
        q, q_t, _, scale_inv = qops.quantize_fp8_tensor(x2, scale, qdtype=self.dtype, rowwise=rowwise,
                                                        colwise=colwise, backend=backend)
        return ScaledTensor.from_kernel_outputs(self.scaling_mode, self.dtype, x.shape, q=q, s=scale_inv, q_t=q_t,
                                                amax=like.amax, rowwise=rowwise, colwise=colwise,
                                                flatten_axis=flatten_axis)


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer:
    """MXFP8: 1x32 blocks along the contraction axis with E8M0 (power-of-two) scales."""

    dtype: Any = jnp.float8_e4m3fn

    def __post_init__(self):
        object.__setattr__(self, "dtype", _fp8_dtype(self.dtype))

    scaling_mode = modes.MXFP8

    def fused_cast(self, state=None, *, rowwise=True, colwise=False):
        return CastSpec("mxfp8", self.dtype, rowwise, colwise), None

    def quantize(self, x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1, key=None, backend=None):
        x2 = as_matrix(x, flatten_axis)
        q, s, q_t, s_t = qops.quantize_mxfp8(x2, qdtype=self.dtype, rowwise=rowwise, colwise=colwise, backend=backend)
        return ScaledTensor.from_kernel_outputs(self.scaling_mode, self.dtype, x.shape, q=q, s=s, q_t=q_t, s_t=s_t,
                                                rowwise=rowwise, colwise=colwise, flatten_axis=flatten_axis)


@dataclasses.dataclass(frozen=True)
class Float8BlockQuantizer:
    """Float8 block scaling: 1x128 blocks, or 128x128 with ``block_2d``.

    Attributes:
      dtype: jnp.float8_e4m3fn or jnp.float8_e5m2.
      block_2d: 128x128 blocks (weights) instead of 1x128 (inputs, gradients).
      power_2_scales: power-of-two scales (False: float32 scales).
    """

    dtype: Any = jnp.float8_e4m3fn
    block_2d: bool = False
    power_2_scales: bool = True

    def __post_init__(self):
        object.__setattr__(self, "dtype", _fp8_dtype(self.dtype))

    @property
    def scaling_mode(self) -> modes.ModeSpec:
        return modes.mode_spec(modes.ScalingMode.FP8_BLOCK, self.block_2d)

    def fused_cast(self, state=None, *, rowwise=True, colwise=False):
        """The fused cast, or None for 128x128 blocks (the kernels fuse 1x128 blocks only)."""
        spec = CastSpec("fp8_block", self.dtype, rowwise, colwise, self.power_2_scales)
        return _if_fused(self, spec)

    def quantize(self, x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1, key=None, backend=None):
        x2 = as_matrix(x, flatten_axis)
        q, s, q_t, s_t = qops.quantize_fp8_block(
            x2, qdtype=self.dtype, rowwise=rowwise, colwise=colwise, block_2d=self.block_2d,
            power_2=self.power_2_scales, backend=backend,
        )
        return ScaledTensor.from_kernel_outputs(self.scaling_mode, self.dtype, x.shape, q=q, s=s, q_t=q_t, s_t=s_t,
                                                rowwise=rowwise, colwise=colwise, flatten_axis=flatten_axis)


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer:
    """NVFP4: E2M1 values in 1x16 (or 16x16) blocks with E4M3 scales and a float32 global scale.

    Attributes:
      block_2d: 16x16 blocks (weights).
      rht: random Hadamard transform on the columnwise copy (wgrad operands).
      stochastic_rounding: round stochastically (gradients); needs ``key``.
    """

    block_2d: bool = False
    rht: bool = False
    stochastic_rounding: bool = False

    def __post_init__(self):
        if self.rht and self.block_2d:
            raise ValueError("NVFP4Quantizer: rht applies to 1D blocks; it cannot be combined with block_2d")

    @property
    def dtype(self):
        return jnp.dtype(jnp.float4_e2m1fn)

    @property
    def scaling_mode(self) -> modes.ModeSpec:
        return modes.mode_spec(modes.ScalingMode.NVFP4, self.block_2d)

    def fused_cast(self, state=None, *, rowwise=True, colwise=False):
        """The fused cast, or None for 16x16 blocks (the kernels fuse 1x16 blocks only)."""
        spec = CastSpec("nvfp4", jnp.uint8, rowwise, colwise, rht=self.rht and colwise,
                        stochastic_rounding=self.stochastic_rounding)
        return _if_fused(self, spec)

    def quantize(self, x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1, key=None, backend=None):
        x2 = as_matrix(x, flatten_axis)
        q, s, q_t, s_t, amax, amax_t = qops.quantize_nvfp4(
            x2, key, rowwise=rowwise, colwise=colwise, block_2d=self.block_2d, rht=self.rht and colwise,
            stochastic_rounding=self.stochastic_rounding, backend=backend,
        )
        return ScaledTensor.from_kernel_outputs(self.scaling_mode, self.dtype, x.shape, q=q, s=s, q_t=q_t, s_t=s_t,
                                                amax=amax, amax_t=amax_t, rowwise=rowwise, colwise=colwise,
                                                flatten_axis=flatten_axis, rht=self.rht)
