"""Which CUDA kernel runs a grouped custom call, or why none can (docs/grouped_gemm_cuda.md).

Per-tensor FP8 and Float8 block run the CUTLASS sm_90a kernels: where no
kernel writes the requested out dtype (or fast accumulation) directly, the
float32 split-accumulation kernel of the dtype pair runs and the lowering
casts its result (``cuda_kernel``); shapes the kernels cannot tile are
refused at trace time with what to change (``check_cuda``; the grouped ops
pad per-tensor K and N on every platform). MXFP8, NVFP4, the Float8 block
layouts without a kernel (E5M2 operands, 128x128 activation or gradient
blocks: ``block_emulation_message``) and every mode on a GPU other than
sm_90 run the emulation (``te_jax.ops.grouped.reference.emulate``;
``emulation_message``), with a ``GemmEmulationWarning``; on sm_90
the emulation of MXFP8 and NVFP4 multiplies with the bfloat16 kernel where its
shapes fit (``bf16_kernel_emulates``). The
bfloat16 call (``GroupedLayout.mode`` None) runs one CUTLASS sm_90a kernel per
layout (``CUDA_BF16_KERNELS``), likewise emulated on other GPUs.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from te_jax.ops.gemm_call import CUBLAS_WORKSPACE_BYTES
from te_jax.ops.grouped.layout import GROUP_ALIGN, GroupedLayout
from te_jax.spec import modes
from te_jax.spec.modes import ScalingMode

__all__ = ["CUDA_BF16_KERNELS", "CUDA_BLOCK_KERNELS", "CUDA_FP8_KERNELS", "bf16_kernel_emulates", "check_cuda",
           "block_emulation_message", "cuda_kernel", "emulation_message", "grouped_workspace_bytes"]

# What the CUDA kernels tile: K and N (group_axis 0), P, Q and Kc (group_axis 1) multiples of these.
_CUDA_MULTIPLE = {ScalingMode.FP8_TENSOR: 16, ScalingMode.FP8_BLOCK: 128, ScalingMode.MXFP8: 32,
                  ScalingMode.NVFP4: 32}
# The grouped modes with CUDA kernels (sm_90); the others run the emulation on a GPU.
_CUDA_MODES = (ScalingMode.FP8_TENSOR, ScalingMode.FP8_BLOCK)
_CUDA_CAPABILITY = 9.0  # the CUTLASS kernels are built for sm_90a alone
_E4M3, _E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# The CUDA kernels (TE_JAX_GROUPED_FP8_KERNELS in csrc/cuda/grouped_gemm.cuh): (a, b, out, fast_accum).
CUDA_FP8_KERNELS = frozenset({(_E4M3, _E4M3, _BF16, True), (_E5M2, _E4M3, _BF16, False),
                              (_E4M3, _E5M2, _BF16, False), (_E5M2, _E4M3, _BF16, True),
                              (_E4M3, _E5M2, _BF16, True), (_E4M3, _E4M3, _F32, False),
                              (_E5M2, _E4M3, _F32, False), (_E4M3, _E5M2, _F32, False)})
# TE_JAX_GROUPED_FP8_BLOCK_KERNELS: (a, b, out, b_block_2d, group_axis); a always 1x128 blocks.
CUDA_BLOCK_KERNELS = frozenset({(_E4M3, _E4M3, _BF16, True, 0), (_E4M3, _E4M3, _F32, True, 0),
                                (_E4M3, _E4M3, _F32, False, 0), (_E4M3, _E4M3, _BF16, False, 1),
                                (_E4M3, _E4M3, _F32, False, 1)})
# TE_JAX_GROUPED_BF16_KERNELS: (group_axis, b_kn) of the bfloat16 layouts (forward, dgrad, wgrad).
CUDA_BF16_KERNELS = frozenset({(0, True), (0, False), (1, False)})
# The bfloat16 kernels' TMA needs 16-byte rows: K and N (group_axis 0), P and Q (1) multiples of 8.
_BF16_MULTIPLE = 8


def grouped_workspace_bytes(num_groups: int) -> int:
    """The CUDA handlers' workspace: 32 MiB plus 1 KiB per group (problem shapes, pointers, scales)."""
    return CUBLAS_WORKSPACE_BYTES + 1024 * int(num_groups)


def bf16_kernel_emulates(lay: GroupedLayout, capability: float | None, a_shape, b_shape) -> bool:
    """Whether the emulation of ``lay`` multiplies with the bfloat16 CUTLASS kernel instead of XLA's ragged dot.

    True for MXFP8 and NVFP4 on compute capability 9.0 (or an unknown one, as for the native kernels) when the
    bfloat16 kernel tiles the dequantized operands: K and N (group_axis 0), P and Q (group_axis 1) multiples of 8.
    """
    if lay.mode is None or lay.mode in _CUDA_MODES or capability not in (None, _CUDA_CAPABILITY):
        return False
    dims = (a_shape[-1] * lay.pack, b_shape[-2]) if lay.group_axis == 0 else (a_shape[0], b_shape[0])
    return all(d % _BF16_MULTIPLE == 0 for d in dims)


def emulation_message(lay: GroupedLayout, capability: float | None, bf16_kernel: bool = False) -> str | None:
    """The warning for lowering ``lay`` for a GPU of ``capability``, or None when a CUDA kernel runs it.

    None for per-tensor FP8, Float8 block and bfloat16 on compute capability 9.0 or an unknown one (None).
    ``bf16_kernel`` says that the emulation multiplies with the bfloat16 kernel (``bf16_kernel_emulates``).
    """
    if (lay.mode is None or lay.mode in _CUDA_MODES) and (capability is None or capability == _CUDA_CAPABILITY):
        return None
    silence = "Silence with warnings.filterwarnings('ignore', category=GemmEmulationWarning)."
    if lay.mode is None:
        return (f"te_jax: grouped bfloat16 GEMMs ({lay.target}) on a GPU of compute capability {capability:.1f} run "
                "the documented emulation: XLA's bfloat16 ragged dot accumulating in float32 "
                "(docs/grouped_gemm_cuda.md), which expands into one masked GEMM per group (G times the FLOPs). "
                f"The native grouped kernel runs on compute capability 9.0. {silence}")
    label = modes.mode_spec(lay.mode).label
    where = "this GPU" if capability is None else f"a GPU of compute capability {capability:.1f}"
    product = ("te_jax's bfloat16 grouped kernel (float32 accumulation, a bfloat16 result)" if bf16_kernel else
               "XLA's bfloat16 ragged dot accumulating in float32")
    return (f"te_jax: grouped {label} GEMMs ({lay.target}) on {where} run the documented emulation: each operand "
            f"is dequantized to bfloat16, then multiplied by {product} (docs/grouped_gemm_cuda.md), without the "
            "FP8 speed-up. Native grouped kernels: per-tensor FP8 and Float8 block on compute capability 9.0. "
            f"{silence}")


def block_emulation_message(lay: GroupedLayout, a_dtype, b_dtype) -> str | None:
    """The warning for a Float8 block layout the sm_90 kernels do not cover, or None.

    The kernels multiply E4M3 x E4M3 with 1x128 blocks on the left operand (on both for wgrad, group_axis 1);
    E5M2 operands (a HYBRID recipe's gradients) and 128x128 activation or gradient blocks run the emulation
    instead, with this warning, as every platform but sm_90 runs them.
    """
    if lay.mode is not ScalingMode.FP8_BLOCK:
        return None
    attrs = dict(lay.attrs)
    why = []
    if (jnp.dtype(a_dtype), jnp.dtype(b_dtype)) != (_E4M3, _E4M3):
        why.append(f"E4M3 x E4M3 operands (got {jnp.dtype(a_dtype).name} x {jnp.dtype(b_dtype).name}: use "
                   "Float8BlockScaling(fp8_format=Format.E4M3))")
    if attrs["a_block_2d"] or (lay.group_axis == 1 and attrs["b_block_2d"]):
        why.append("1x128 blocks on the left operand, on both for wgrad (use Float8BlockScaling("
                   "x_block_scaling_dim=1, grad_block_scaling_dim=1))")
    if not why:
        return None
    return (f"te_jax: grouped Float8 block GEMMs ({lay.target}, group_axis {lay.group_axis}) on compute capability "
            f"9.0 have kernels for {' and '.join(why)}; this one runs the documented emulation: each operand is "
            "dequantized to bfloat16, then multiplied by XLA's bfloat16 ragged dot accumulating in float32 "
            "(docs/grouped_gemm_cuda.md), without the FP8 speed-up. Silence with "
            "warnings.filterwarnings('ignore', category=GemmEmulationWarning).")


def check_cuda(lay: GroupedLayout, a_shape, b_shape) -> None:
    """Checks that the CUDA kernels tile the operands ``a_shape``, ``b_shape`` and ``lay.align``."""
    if lay.mode is None:
        _check_cuda_bf16(lay, a_shape, b_shape)
        return
    multiple = _CUDA_MULTIPLE[lay.mode]
    if lay.group_axis == 0:
        dims = {"K": a_shape[-1] * lay.pack, "N": b_shape[-2]}
    else:
        dims = {"P": a_shape[0], "Q": b_shape[0], "Kc": a_shape[-1] * lay.pack}
    bad = {k: v for k, v in dims.items() if v % multiple}
    if bad:
        raise ValueError(f"te_jax: {lay.target} on CUDA needs {', '.join(dims)} to be multiples of {multiple}, got "
                         f"{bad}; pad those axes")
    if lay.group_axis == 1 and lay.align % GROUP_ALIGN[lay.mode]:
        raise ValueError(f"te_jax: {lay.target} on CUDA needs align to be a multiple of {GROUP_ALIGN[lay.mode]}, got "
                         f"{lay.align}")


def _check_cuda_bf16(lay: GroupedLayout, a_shape, b_shape) -> None:
    """The bfloat16 call's checks: K and N (group_axis 0) or P and Q (1) multiples of 8; unpadded groups."""
    if lay.group_axis == 0:
        dims = {"K": a_shape[-1], "N": lay.out_shape(a_shape, b_shape, b_shape[0])[-1]}
    else:
        dims = {"P": a_shape[-1], "Q": b_shape[-1]}
    bad = {k: v for k, v in dims.items() if v % _BF16_MULTIPLE}
    if bad:
        raise ValueError(f"te_jax: {lay.target} on CUDA needs {', '.join(dims)} to be multiples of {_BF16_MULTIPLE} "
                         f"(16-byte rows for TMA), got {bad}; pad those axes")
    if lay.align != 1:
        raise ValueError(f"te_jax: {lay.target} takes unpadded groups (align 1), got align {lay.align}")


def cuda_kernel(lay: GroupedLayout, a_dtype, b_dtype) -> GroupedLayout:
    """The layout of the CUDA kernel that runs ``lay`` (its ``out_dtype`` may be float32, cast afterwards).

    A direct kernel when one exists; else, for a fast_accum request, the split-accumulation one (at least as
    exact); else the float32 kernel of the dtype pair. Raises, saying what to change, when none fits.
    """
    a_dtype, b_dtype, out = jnp.dtype(a_dtype), jnp.dtype(b_dtype), jnp.dtype(lay.out_dtype)
    attrs = dict(lay.attrs)
    if lay.mode is None:
        if (a_dtype, b_dtype, out) != (_BF16, _BF16, _BF16) or (lay.group_axis, attrs["b_kn"]) not in CUDA_BF16_KERNELS:
            raise ValueError(f"te_jax: {lay.target} on CUDA has bfloat16 x bfloat16 -> bfloat16 kernels for "
                             f"group_axis 0 (b_kn True or False) and group_axis 1 (b_kn False), got {a_dtype.name} x "
                             f"{b_dtype.name} -> {out.name}, group_axis {lay.group_axis}, b_kn {attrs['b_kn']}")
        return lay
    if lay.mode is ScalingMode.FP8_TENSOR:
        for cand_out, fast in ((out, attrs["fast_accum"]), (out, False), (_F32, False)):
            if (a_dtype, b_dtype, cand_out, fast) in CUDA_FP8_KERNELS:
                return dataclasses.replace(lay, out_dtype=cand_out, attrs=(("fast_accum", fast),))
        raise ValueError(f"te_jax: {lay.target} on CUDA has no kernel for {a_dtype.name} x {b_dtype.name}; use "
                         "E4M3 or E5M2 operands, not both E5M2")
    if attrs["a_block_2d"]:
        raise ValueError(f"te_jax: {lay.target} on CUDA needs 1x128 blocks for the left operand (activations and "
                         "gradients); use Float8BlockScaling(x_block_scaling_dim=1, grad_block_scaling_dim=1)")
    if lay.group_axis == 1 and attrs["b_block_2d"]:
        raise ValueError(f"te_jax: {lay.target} on CUDA (group_axis=1, wgrad) needs 1x128 blocks for both operands; "
                         "use Float8BlockScaling(x_block_scaling_dim=1, grad_block_scaling_dim=1)")
    for cand_out in (out, _F32):
        if (a_dtype, b_dtype, cand_out, attrs["b_block_2d"], lay.group_axis) in CUDA_BLOCK_KERNELS:
            return dataclasses.replace(lay, out_dtype=cand_out)
    raise ValueError(f"te_jax: {lay.target} on CUDA has E4M3 x E4M3 kernels only, got {a_dtype.name} x "
                     f"{b_dtype.name}; use Float8BlockScaling(fp8_format=Format.E4M3) for the experts")
