"""What the grouped ops hold every platform to, so that a grouped op that runs on CPU runs on a GPU too.

The CUDA grouped kernels (``te_jax.ops.grouped.cuda``) refuse when lowering
what the CPU handler takes: per-tensor FP8 K and N that are not multiples of
16, and Float8 block-scaled operands other than E4M3 ones with 1x128 blocks on
the left (on both sides for wgrad). ``grouped_dense`` and ``grouped_mlp`` zero
pad K and N to ``feature_tile`` (exact: zeros add nothing to a product and
change no amax; the output is cut back) and refuse the block-scaled operands
the CUDA kernels have no kernel for on every platform, at trace time
(``check_block_operands``), naming the op and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.core.bundles import DenseQuantizers, scaling_mode_of
from te_jax.ops.grouped.layout import GROUP_ALIGN
from te_jax.spec.modes import ScaledTensor, ScalingMode

__all__ = ["check_block_operands", "feature_tile", "pad_axis"]

_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
# The grouped GEMM each (group_axis, contracting dims) is, and the roles of its operands.
_GEMMS = {(0, (1, 0)): ("forward", "linear_input", "linear_weight"),
          (0, (1, 1)): ("dgrad", "linear_grad_output", "linear_weight"),
          (1, (0, 0)): ("wgrad", "linear_input", "linear_grad_output")}


def feature_tile(*bundles: DenseQuantizers) -> int:
    """What a grouped op pads K and N to a multiple of: the CUDA per-tensor FP8 grouped kernels' tile (16) when a
    quantizer of ``bundles`` scales per tensor, else 1 (the block modes need whole blocks, which ``check_blocks``
    asks for on every platform; MXFP8 and NVFP4 run an emulation on a GPU, which takes any K and N)."""
    found = (scaling_mode_of(getattr(q, f)) for q in bundles for f in ("input", "weight", "grad_output"))
    return GROUP_ALIGN[ScalingMode.FP8_TENSOR] if any(m is not None and m.per_tensor for m in found) else 1


def pad_axis(a: jax.Array | None, axis: int, multiple: int, halves: int = 1) -> jax.Array | None:
    """``a`` zero padded at the end of ``axis`` to a multiple of ``multiple``; with ``halves`` 2 (the two halves
    of a gated activation's width) each half is padded. ``a`` itself (or None) when nothing is padded."""
    if a is None or multiple == 1:
        return a
    axis %= a.ndim
    size = a.shape[axis] // halves
    extra = -size % multiple
    if not extra:
        return a
    split = a.reshape(*a.shape[:axis], halves, size, *a.shape[axis + 1:])
    widths = [(0, 0)] * split.ndim
    widths[axis + 1] = (0, extra)
    return jnp.pad(split, widths).reshape(*a.shape[:axis], halves * (size + extra), *a.shape[axis + 1:])


def check_block_operands(a: ScaledTensor, b: ScaledTensor, group_axis: int, contracting, where: str) -> None:
    """Refuses, on every platform, the Float8 block-scaled grouped GEMMs the CUDA kernels have no kernel for.

    The kernels (sm_90) multiply E4M3 x E4M3 with 1x128 blocks on the left operand (activations, gradients) and,
    for wgrad, on both; the CPU handler takes every combination, so without this check a model would train on
    CPU and fail to lower on the GPU.
    """
    if a.mode is not ScalingMode.FP8_BLOCK or b.mode is not ScalingMode.FP8_BLOCK:
        return
    gemm, lhs, rhs = _GEMMS[(group_axis, tuple(int(d) for d in contracting))]
    head = f"te_jax: {where}: the {gemm} grouped GEMM multiplies Float8 block-scaled {lhs} x {rhs}"
    dtypes = (jnp.dtype(a.qdtype), jnp.dtype(b.qdtype))
    if dtypes != (_E4M3, _E4M3):
        raise ValueError(f"{head} of {dtypes[0].name} x {dtypes[1].name}, but the grouped kernels (CUDA) take "
                         "E4M3 x E4M3 only; use Float8BlockScaling(fp8_format=Format.E4M3) for these layers, or a "
                         "per-tensor recipe (DelayedScaling, Float8CurrentScaling) for E5M2 gradients")
    two_d = [role for role, t in ((lhs, a), (rhs, b)) if t.block_2d and (t is a or group_axis == 1)]
    if two_d:
        raise ValueError(f"{head} with 128x128 blocks for {' and '.join(two_d)}, but the grouped kernels (CUDA) take "
                         f"1x128 blocks for {'both operands of wgrad' if group_axis == 1 else 'the left operand'}; "
                         "use Float8BlockScaling(x_block_scaling_dim=1, grad_block_scaling_dim=1) for these layers")
