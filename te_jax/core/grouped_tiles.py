"""What the grouped ops hold every platform to, so that a grouped op that runs on CPU runs on a GPU too.

The CUDA grouped kernels (``te_jax.ops.grouped.cuda``) refuse when lowering
per-tensor FP8 K and N that are not multiples of 16, which the CPU handler
takes. ``grouped_dense`` and ``grouped_mlp`` zero pad K and N to
``feature_tile`` on every platform (exact: zeros add nothing to a product and
change no amax; the output is cut back). (Float8 block layouts without a CUDA
kernel run the emulation there, with a warning: ``te_jax.ops.grouped.cuda``.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.core.bundles import DenseQuantizers, scaling_mode_of
from te_jax.ops.grouped.layout import GROUP_ALIGN
from te_jax.spec.modes import ScalingMode

__all__ = ["feature_tile", "pad_axis"]


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
