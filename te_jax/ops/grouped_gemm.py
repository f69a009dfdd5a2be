"""Grouped GEMM op: one FP8 / Float8-block / MXFP8 / NVFP4 product per group (mixture-of-experts).

Two layouts, chosen by the static ``group_axis``; ``group_sizes`` is int32
``[G]`` on the device (data dependent, zeros allowed):

* ``group_axis=0`` (forward, dgrad): ``A [M, K]`` with its rows sorted by
  group (group g is rows ``[off_g, off_g + m_g)``, ``off_g = sum_{h<g} m_h``),
  ``B [G, N, K]``; ``out [M, N]`` holds ``A_g @ B_g^T`` in group g's rows and
  zeros in the rows past ``sum(m)``. An optional bias ``[G, N]`` adds
  ``bias[g]`` to group g's rows.
* ``group_axis=1`` (wgrad): ``A [P, Kc]`` and ``B [Q, Kc]`` grouped along the
  contraction in spans aligned to ``align``: group g is columns
  ``[s_g, s_g + m_g)`` with ``s_g = sum_{h<g} roundup(m_h, align)``; the columns
  between spans must be zero in both. ``out [G, P, Q]``, ``out[g] =
  A_span @ B_span^T`` (zeros for an empty group).

Groups reaching past M (past Kc) are cut there. Per-tensor values (FP8
``*_scale_inv``, NVFP4 ``*_amax``) are float32 ``[1]`` or ``[G]`` (one per
group). Block scales are as the dense GEMM's (``te_jax.ops.gemm``) for
``A`` and for each matrix of ``B``.

``grouped_gemm_fp8`` and friends take explicit operands and run the
``te_jax_grouped_gemm_*`` custom call or, with the "reference" backend, the
pure-JAX twin (dequantize as ``te_jax.quantize.reference``, float32 product
per group at HIGHEST precision, bias in float32, cast). ``grouped_gemm``
multiplies ScaledTensors, picking the rowwise or columnwise copy of each.

On a GPU, per-tensor FP8 and Float8 block run the CUTLASS sm_90a kernels
(docs/grouped_gemm_cuda.md): where no kernel writes the requested out dtype
(or fast accumulation) directly, the float32 split-accumulation kernel of the
dtype pair runs and the lowering casts its result; what no kernel can run is
refused at trace time with what to change. MXFP8, NVFP4 and every mode on a
GPU other than sm_90 run the emulation (``GemmEmulationWarning``): operands
dequantized to bfloat16, XLA's ragged dot accumulating in float32.

Sharding (``custom_partitioning``): the groups may be sharded with their
experts, that is B's G axis (and the bias's, and ``[G]`` per-tensor values)
for ``group_axis=0`` and ``group_sizes`` (with out's G) for ``group_axis=1``;
every other axis is gathered (A's rows and K, B's N, and for
``group_axis=1`` P, Q and Kc). With ``group_axis=0`` each device multiplies
the rows of its own groups and one all-reduce (psum) over the group axes
combines the row blocks; with ``group_axis=1`` each device writes its groups'
slices of out and nothing is exchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

import te_jax._ffi  # noqa: F401  (registers the FFI targets)
from te_jax import backend as backend_lib
from te_jax.ops.gemm import (CUBLAS_WORKSPACE_BYTES, check_block_scales, check_flag, check_operand_dtypes,
                             check_out_dtype)
from te_jax.ops.gemm_call import GemmEmulationWarning, _cuda_compute_capability
from te_jax.ops.partition import AxisClaims, device_local
from te_jax.quantize import modes
from te_jax.quantize import reference as ref
from te_jax.quantize.modes import ScalingMode
from te_jax.quantize.scaled_tensor import ScaledTensor

__all__ = ["GROUP_ALIGN", "grouped_gemm", "grouped_gemm_fp8", "grouped_gemm_fp8_block", "grouped_gemm_mxfp8",
           "grouped_gemm_nvfp4", "grouped_positions", "grouped_workspace_bytes"]

# The span alignment of group_axis=1 each mode's CUDA kernels need (a block never straddles two groups).
GROUP_ALIGN = {ScalingMode.FP8_TENSOR: 16, ScalingMode.FP8_BLOCK: 128, ScalingMode.MXFP8: 32, ScalingMode.NVFP4: 16}
# What the CUDA kernels tile: K and N (group_axis 0), P, Q and Kc (group_axis 1) multiples of these.
_CUDA_MULTIPLE = {ScalingMode.FP8_TENSOR: 16, ScalingMode.FP8_BLOCK: 128, ScalingMode.MXFP8: 32,
                  ScalingMode.NVFP4: 32}
# The grouped modes with CUDA kernels (sm_90); the others run the emulation (``_emulate``) on a GPU.
_CUDA_MODES = (ScalingMode.FP8_TENSOR, ScalingMode.FP8_BLOCK)
_CUDA_CAPABILITY = 9.0  # the CUTLASS kernels are built for sm_90a alone
_E4M3, _E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# The CUDA kernels (TE_JAX_GROUPED_FP8_KERNELS in csrc/cuda/grouped_gemm.cuh): (a, b, out, fast_accum).
_CUDA_FP8_KERNELS = frozenset({(_E4M3, _E4M3, _BF16, True), (_E5M2, _E4M3, _BF16, False),
                               (_E4M3, _E4M3, _F32, False), (_E5M2, _E4M3, _F32, False), (_E4M3, _E5M2, _F32, False)})
# TE_JAX_GROUPED_FP8_BLOCK_KERNELS: (a, b, out, b_block_2d, group_axis); a always 1x128 blocks.
_CUDA_BLOCK_KERNELS = frozenset({(_E4M3, _E4M3, _BF16, True, 0), (_E4M3, _E4M3, _F32, True, 0),
                                 (_E4M3, _E4M3, _F32, False, 0), (_E4M3, _E4M3, _F32, False, 1)})


def grouped_workspace_bytes(num_groups: int) -> int:
    """The CUDA handlers' workspace: 32 MiB plus 1 KiB per group (problem shapes, pointers, scales)."""
    return CUBLAS_WORKSPACE_BYTES + 1024 * int(num_groups)


# ---- where each group lies -----------------------------------------------------------


def grouped_positions(group_sizes: jax.Array, extent: int, align: int = 1):
    """Which group each of ``extent`` rows (spans when ``align`` > 1) belongs to, computed on the device.

    Groups follow each other in ``roundup(m_g, align)``-long spans from 0
    (``align=1``: the rows of group_axis 0). Returns ``(group, index, member)``,
    each ``[extent]``: the group of the span a position lies in (clipped to
    ``G - 1`` past the last span), its index inside that group, and whether it
    holds one of the group's ``m_g`` elements (False in the padding and past
    the last span). Negative sizes count as zero.
    """
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    spans = (sizes + (align - 1)) // align * align if align > 1 else sizes
    ends = jnp.cumsum(spans)
    pos = jnp.arange(extent, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, pos, side="right").astype(jnp.int32), sizes.shape[0] - 1)
    index = pos - (ends[group] - spans[group])
    member = (pos < ends[-1]) & (index < sizes[group])
    return group, index, member


# ---- validation ----------------------------------------------------------------------


def _check_group_sizes(group_sizes) -> int:
    if not hasattr(group_sizes, "dtype") or jnp.dtype(group_sizes.dtype) != jnp.int32 or group_sizes.ndim != 1:
        got = f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)}{list(getattr(group_sizes, 'shape', ()))}"
        raise TypeError(f"te_jax: group_sizes must be an int32 array [G] (one row count per group), got {got}; "
                        "pass group_sizes.astype(jnp.int32)")
    if group_sizes.shape[0] < 1:
        raise ValueError("te_jax: group_sizes must have at least one group")
    return group_sizes.shape[0]


def _check_layout(a, b, num_groups: int, group_axis, align, pack: int, block: int, label: str) -> int:
    """Checks the operand shapes of ``group_axis``; returns the contraction length K (Kc)."""
    if group_axis not in (0, 1) or isinstance(group_axis, bool):
        raise ValueError(f"te_jax: group_axis must be 0 (rows grouped) or 1 (contraction grouped), got {group_axis!r}")
    if not isinstance(align, (int, np.integer)) or isinstance(align, bool) or align < 1:
        raise ValueError(f"te_jax: align must be a positive int, got {align!r}")
    if group_axis == 0:
        if a.ndim != 2 or b.ndim != 3 or a.shape[-1] != b.shape[-1]:
            raise ValueError(f"te_jax: group_axis=0 needs A [M, K] and B [G, N, K] with one K; got A {a.shape} and "
                             f"B {b.shape}")
        if b.shape[0] != num_groups:
            raise ValueError(f"te_jax: B has {b.shape[0]} matrices but group_sizes has {num_groups} groups; give "
                             "one size per expert")
    elif a.ndim != 2 or b.ndim != 2 or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"te_jax: group_axis=1 needs A [P, Kc] and B [Q, Kc] with one Kc; got A {a.shape} and "
                         f"B {b.shape}")
    k = a.shape[-1] * pack
    if k % block:
        raise ValueError(f"te_jax: {label} grouped GEMM needs the contraction length ({k}) to be a multiple of "
                         f"{block}; pad it")
    if group_axis == 1 and align % block:
        raise ValueError(f"te_jax: {label} grouped GEMM with group_axis=1 needs align ({align}) to be a multiple of "
                         f"its block ({block}): a block must not straddle two groups")
    return k


def _group_value(s, num_groups: int, name: str):
    """A per-tensor float32 value: ``[1]`` or one per group ``[G]``."""
    s = jnp.asarray(s, jnp.float32)
    if s.size == 1:
        return s.reshape(1)
    if s.shape != (num_groups,):
        raise ValueError(f"te_jax: {name} must be float32 [1] or one value per group [{num_groups}], got shape "
                         f"{s.shape}")
    return s


def _check_bias(bias, group_axis: int, num_groups: int, n: int, out_dtype):
    if bias is None:
        return None
    if group_axis != 0:
        raise ValueError("te_jax: a grouped GEMM bias applies to group_axis=0 only (add a wgrad bias yourself)")
    bias = jnp.asarray(bias)
    if bias.shape != (num_groups, n):
        raise ValueError(f"te_jax: bias must be [G, N] = [{num_groups}, {n}], got shape {bias.shape}")
    return bias if jnp.dtype(bias.dtype) in (out_dtype, jnp.dtype(jnp.float32)) else bias.astype(jnp.float32)


# ---- the reference twin ----------------------------------------------------------------


def _per_group(dequantize, values, group_of, axis: int):
    """``dequantize(value)`` with a per-tensor value per group: each element takes its group's.

    ``values`` is ``[1]`` (one dequantization) or ``[G]``: then every group's
    dequantization is made and each element along ``axis`` (rows 0, columns
    1) picks its group's (``group_of``), so the values are bit-identical to
    dequantizing with that group's value alone.
    """
    if values.shape[0] == 1:
        return dequantize(values)
    every = jax.vmap(lambda v: dequantize(v.reshape(1)))(values)  # [G, R, C]
    index = group_of[None, :, None] if axis == 0 else group_of[None, None, :]
    return jnp.take_along_axis(every, index, axis=0)[0]


def _reference(da, db, group_sizes, group_axis: int, align: int, bias, out_dtype):
    """Float32 product per group of the dequantized operands, bias in float32, cast."""
    hi = lax.Precision.HIGHEST
    if group_axis == 0:
        group, _, member = grouped_positions(group_sizes, da.shape[0])
        every = jnp.einsum("mk,gnk->gmn", da, db, precision=hi, preferred_element_type=jnp.float32)
        out = jnp.take_along_axis(every, group[None, :, None], axis=0)[0]
        if bias is not None:
            out = out + bias.astype(jnp.float32)[group]
        out = jnp.where(member[:, None], out, 0.0)
    else:
        group, _, member = grouped_positions(group_sizes, da.shape[-1], align)
        mask = (group[None, :] == jnp.arange(group_sizes.shape[0])[:, None]) & member[None, :]  # [G, Kc]
        ma = jnp.where(mask[:, None, :], da[None], 0.0)
        mb = jnp.where(mask[:, None, :], db[None], 0.0)
        out = jnp.einsum("gpk,gqk->gpq", ma, mb, precision=hi, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _dequantize(lay: "GroupedLayout", args, group_sizes):
    """Both operands of the custom call's ``args`` (in ``lay.roles`` order) dequantized to float32.

    The block mode's scales of group_axis 1 arrive K-block-major (``[Kc/128, rows]``) and are read back.
    """
    x = dict(zip(lay.roles, args))
    a, b = x["a"], x["b"]
    k = a.shape[-1] * lay.pack
    if lay.mode is ScalingMode.FP8_TENSOR:
        return _deq_groups(group_sizes, lay.group_axis, lay.align, a.shape, k,
                           lambda v: ref.dequantize_fp8_tensor(a, v), lambda v: ref.dequantize_fp8_tensor(b, v),
                           x["a_t"], x["b_t"])
    if lay.mode is ScalingMode.FP8_BLOCK:
        a_s, b_s = (x["a_s"].T, x["b_s"].T) if lay.group_axis == 1 else (x["a_s"], x["b_s"])
        attrs = dict(lay.attrs)
        return (ref.dequantize_fp8_block(a, a_s, block_2d=attrs["a_block_2d"]),
                ref.dequantize_fp8_block(b, b_s, block_2d=attrs["b_block_2d"]))
    if lay.mode is ScalingMode.MXFP8:
        return ref.dequantize_mxfp8(a, x["a_s"]), ref.dequantize_mxfp8(b, x["b_s"])
    return _deq_groups(group_sizes, lay.group_axis, lay.align, a.shape, k,
                       lambda v: ref.dequantize_nvfp4(a, x["a_s"], v), lambda v: ref.dequantize_nvfp4(b, x["b_s"], v),
                       x["a_t"], x["b_t"])


def _emulate(lay: "GroupedLayout", *args):
    """The GPU emulation: operands dequantized to bfloat16, XLA's ragged dot accumulating in float32, bias, cast."""
    group_sizes, bias = args[len(lay.roles)], args[-1]
    da, db = (t.astype(jnp.bfloat16) for t in _dequantize(lay, args[:len(lay.roles)], group_sizes))
    sizes = jnp.maximum(group_sizes, 0)
    if lay.group_axis == 0:
        ends = jnp.minimum(jnp.cumsum(sizes), da.shape[0])  # groups past M are cut
        out = lax.ragged_dot(da, jnp.swapaxes(db, 1, 2), jnp.diff(ends, prepend=0),
                             preferred_element_type=jnp.float32)
        group, _, member = grouped_positions(group_sizes, da.shape[0])
        if lay.has_bias:
            out = out + bias.astype(jnp.float32)[group]
        out = jnp.where(member[:, None], out, 0.0)
    else:
        spans = (sizes + lay.align - 1) // lay.align * lay.align
        ends = jnp.minimum(jnp.cumsum(spans), da.shape[-1])  # spans past Kc are cut
        numbers = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                                lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
        out = lax.ragged_dot_general(da, db, jnp.diff(ends, prepend=0), numbers, preferred_element_type=jnp.float32)
    return out.astype(lay.out_dtype)


# ---- the custom call ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedLayout:
    """Static description of one grouped custom call.

    Roles: "a"/"b" the operands, "a_s"/"b_s" block scales, "a_t"/"b_t" per-tensor
    values (``[1]`` or ``[G]``), "sizes" the group sizes, "bias" (always passed;
    ``[0]`` without one).
    """

    mode: ScalingMode
    target: str
    roles: tuple[str, ...]
    group_axis: int
    align: int
    attrs: tuple[tuple[str, bool], ...] = ()
    out_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    has_bias: bool = False
    pack: int = 1
    k_block: int = 0

    @property
    def all_roles(self) -> tuple[str, ...]:
        return (*self.roles, "sizes", "bias")


def _check_cuda(lay: GroupedLayout, a_shape, b_shape) -> None:
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


def _cuda_kernel(lay: GroupedLayout, a_dtype, b_dtype) -> GroupedLayout:
    """The layout of the CUDA kernel that runs ``lay`` (its ``out_dtype`` may be float32, cast afterwards).

    A direct kernel when one exists; else, for a fast_accum request, the split-accumulation one (at least as
    exact); else the float32 kernel of the dtype pair. Raises, saying what to change, when none fits.
    """
    a_dtype, b_dtype, out = jnp.dtype(a_dtype), jnp.dtype(b_dtype), jnp.dtype(lay.out_dtype)
    attrs = dict(lay.attrs)
    if lay.mode is ScalingMode.FP8_TENSOR:
        for cand_out, fast in ((out, attrs["fast_accum"]), (out, False), (_F32, False)):
            if (a_dtype, b_dtype, cand_out, fast) in _CUDA_FP8_KERNELS:
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
        if (a_dtype, b_dtype, cand_out, attrs["b_block_2d"], lay.group_axis) in _CUDA_BLOCK_KERNELS:
            return dataclasses.replace(lay, out_dtype=cand_out)
    raise ValueError(f"te_jax: {lay.target} on CUDA has E4M3 x E4M3 kernels only, got {a_dtype.name} x "
                     f"{b_dtype.name}; use Float8BlockScaling(fp8_format=Format.E4M3) for the experts")


def _emulation_message(lay: GroupedLayout, capability: float | None) -> str:
    label = modes.mode_spec(lay.mode).label
    where = "this GPU" if capability is None else f"a GPU of compute capability {capability:.1f}"
    return (f"te_jax: grouped {label} GEMMs ({lay.target}) on {where} run the documented emulation: each operand "
            "is dequantized to bfloat16, then multiplied by XLA's bfloat16 ragged dot accumulating in float32 "
            "(docs/grouped_gemm_cuda.md), without the FP8 speed-up. Native grouped kernels: per-tensor FP8 and "
            "Float8 block on compute capability 9.0. Silence with "
            "warnings.filterwarnings('ignore', category=GemmEmulationWarning).")


def _cast(ctx, value, aval_in, aval_out):
    """Lowers ``value`` (of ``aval_in``) cast to ``aval_out``'s dtype."""
    cast = mlir.lower_fun(lambda v: v.astype(aval_out.dtype), multiple_results=False)
    return cast(ctx.replace(avals_in=[aval_in], avals_out=[aval_out]), value)[0]


def _lower(platform: str, ctx, *args, lay: GroupedLayout):
    a, b = ctx.avals_in[lay.roles.index("a")], ctx.avals_in[lay.roles.index("b")]
    size = 0
    out_aval = ctx.avals_out[0]
    run = lay
    if platform == "cuda":
        capability = _cuda_compute_capability()
        if lay.mode not in _CUDA_MODES or (capability is not None and capability != _CUDA_CAPABILITY):
            warnings.warn(_emulation_message(lay, capability), GemmEmulationWarning, stacklevel=2)
            return mlir.lower_fun(functools.partial(_emulate, lay), multiple_results=False)(ctx, *args)
        _check_cuda(lay, a.shape, b.shape)
        run = _cuda_kernel(lay, a.dtype, b.dtype)
        size = grouped_workspace_bytes(ctx.avals_in[len(lay.roles)].shape[0])
    kernel_aval = out_aval.update(dtype=run.out_dtype)
    bias_aval = ctx.avals_in[-1]
    if run.has_bias and bias_aval.dtype not in (_F32, kernel_aval.dtype):  # the float32 kernel takes a float32 bias
        args = (*args[:-1], _cast(ctx, args[-1], bias_aval, bias_aval.update(dtype=_F32)))
        ctx = ctx.replace(avals_in=[*ctx.avals_in[:-1], bias_aval.update(dtype=_F32)])
    call_ctx = ctx.replace(avals_out=[kernel_aval, jax.core.ShapedArray((size,), jnp.uint8)])
    attrs = {"group_axis": np.int64(run.group_axis), "align": np.int64(run.align), "has_bias": run.has_bias,
             **dict(run.attrs)}
    out = jax.ffi.ffi_lowering(run.target)(call_ctx, *args, **attrs)[0]
    if kernel_aval.dtype != out_aval.dtype:
        out = _cast(ctx, out, kernel_aval, out_aval)
    return [out]


def _abstract_eval(*avals, lay: GroupedLayout):
    a, b, sizes = avals[lay.roles.index("a")], avals[lay.roles.index("b")], avals[len(lay.roles)]
    if lay.group_axis == 0:
        return jax.core.ShapedArray((a.shape[0], b.shape[-2]), lay.out_dtype)
    return jax.core.ShapedArray((sizes.shape[0], a.shape[0], b.shape[0]), lay.out_dtype)


_grouped_p = Primitive("te_jax_grouped_gemm")
_grouped_p.def_abstract_eval(_abstract_eval)
_grouped_jit = jax.jit(lambda lay, *args: _grouped_p.bind(*args, lay=lay), static_argnums=0)
_grouped_p.def_impl(lambda *args, lay: _grouped_jit(lay, *args))
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(_grouped_p, functools.partial(_lower, _platform), platform=_platform)


def _ffi_call(lay: GroupedLayout, *args):
    return _grouped_p.bind(*args, lay=lay)


# ---- sharding: groups with their experts, the rest gathered ------------------------------


def _group_axes(lay: GroupedLayout, mesh, arg_shapes) -> tuple[str, ...] | None:
    """The mesh axes the groups are sharded over (B's G for group_axis 0, group_sizes' for 1), if they divide G."""
    source = arg_shapes[lay.roles.index("b")] if lay.group_axis == 0 else arg_shapes[len(lay.roles)]
    spec = tuple(getattr(source.sharding, "spec", ())) + (None,)
    num_groups = arg_shapes[len(lay.roles)].shape[0]
    if lay.group_axis == 0 and dict(lay.attrs).get("a_block_2d"):
        return None  # A's 128-row scale blocks cannot follow a group's row offset: all gathered
    return AxisClaims(mesh).take(spec[0], num_groups)


def _arg_specs(lay: GroupedLayout, arg_shapes, g) -> tuple[PartitionSpec, ...]:
    specs = []
    for role, shape in zip(lay.all_roles, arg_shapes):
        grouped = (lay.group_axis == 0 and role in ("b", "b_s", "bias") and len(shape.shape) >= 2) or (
            role in ("a_t", "b_t") and shape.shape[0] > 1)
        specs.append(PartitionSpec(g, *(None,) * (len(shape.shape) - 1)) if grouped and g else
                     PartitionSpec(*(None,) * len(shape.shape)))
    return tuple(specs)


def _out_spec(lay: GroupedLayout, g) -> PartitionSpec:
    return PartitionSpec(None, None) if lay.group_axis == 0 else PartitionSpec(g, None, None)


def _infer(lay: GroupedLayout, mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, _out_spec(lay, _group_axes(lay, mesh, arg_shapes)))


def _partition(lay: GroupedLayout, mesh, arg_shapes, result_shape):
    g = _group_axes(lay, mesh, arg_shapes)
    arg_shardings = tuple(NamedSharding(mesh, s) for s in _arg_specs(lay, arg_shapes, g))
    out_sharding = NamedSharding(mesh, _out_spec(lay, g))
    if not g:
        return mesh, device_local(functools.partial(_ffi_call, lay)), out_sharding, arg_shardings
    shards = math.prod(mesh.shape[x] for x in g)
    num_groups = arg_shapes[len(lay.roles)].shape[0]
    local = num_groups // shards

    def local_groups(*args):
        # This device's groups are [first, first + local): shift the operands so that they start at row
        # (column) 0, run the kernel on them, shift back.
        args = list(args)
        sizes = jnp.maximum(args[len(lay.roles)], 0)
        index = lax.axis_index(g)
        first = index * local
        mine = lax.dynamic_slice_in_dim(sizes, first, local)
        if lay.group_axis == 0:
            start = jnp.sum(jnp.where(jnp.arange(num_groups) < first, sizes, 0))
            rows = args[lay.roles.index("a")].shape[0]
            mine = jnp.diff(jnp.minimum(jnp.cumsum(mine), rows - start), prepend=0)  # cut at M, as the kernel does
            for role in ("a", "a_s"):  # one scale row per row of A (1D blocks)
                if role in lay.roles:
                    i = lay.roles.index(role)
                    args[i] = jnp.roll(args[i], -start, axis=0)
        else:
            spans = (sizes + lay.align - 1) // lay.align * lay.align
            start = jnp.sum(jnp.where(jnp.arange(num_groups) < first, spans, 0))
            for role in lay.roles:
                if role in ("a", "b", "a_s", "b_s"):
                    i = lay.roles.index(role)
                    per = lay.pack if role in ("a", "b") else lay.k_block
                    k_block_major = role in ("a_s", "b_s") and lay.mode is ScalingMode.FP8_BLOCK
                    args[i] = jnp.roll(args[i], -(start // per), axis=0 if k_block_major else -1)
        args[len(lay.roles)] = mine
        out = _ffi_call(lay, *args)
        if lay.group_axis == 0:
            out = lax.psum(jnp.roll(out, start, axis=0), g)
        return out

    return mesh, device_local(local_groups), out_sharding, arg_shardings


def _sharding_rule(lay: GroupedLayout, mesh, value_types, result_types):
    """Shardy rule: only the group axis may stay sharded (a reduction for group_axis 0); all else replicated."""
    names, factors = [], iter(f"x{i}" for i in range(64))
    for role, t in zip(lay.all_roles, value_types):
        dims = [next(factors) for _ in t.shape]
        grouped = (lay.group_axis == 0 and role in ("b", "b_s", "bias") and len(t.shape) >= 2) or (
            lay.group_axis == 1 and role == "sizes")
        if grouped:
            dims[0] = "g"
        names.append(dims)
    out = ["g" if (lay.group_axis == 1 and i == 0) else next(factors) for i in range(len(result_types[0].shape))]
    if not any("g" in d for d in names):
        names[lay.all_roles.index("sizes")][0] = "g"
    used = {f for d in names + [out] for f in d}
    rule = ", ".join(" ".join(d) for d in names) + " -> " + " ".join(out)
    replicated = tuple(sorted((f for f in used if f != "g"), key=lambda f: int(f[1:])))  # in order of appearance
    return rule, dict(reduction_factors=("g",) if lay.group_axis == 0 else (), need_replication_factors=replicated)


_partitioned = custom_partitioning(_ffi_call, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_sharding_rule)


# ---- the four ops ------------------------------------------------------------------------


def _run(lay: GroupedLayout, args: tuple, group_sizes, bias, out_dtype, backend):
    """Checks out_dtype and bias, then runs the custom call or its reference twin."""
    out_dtype = check_out_dtype(out_dtype)
    num_groups = group_sizes.shape[0]
    b = args[lay.roles.index("b")]
    bias = _check_bias(bias, lay.group_axis, num_groups, b.shape[-2], out_dtype)
    if backend_lib.resolve(backend) == "reference":
        da, db = _dequantize(lay, args, group_sizes)
        return _reference(da, db, group_sizes, lay.group_axis, lay.align, bias, out_dtype)
    lay = dataclasses.replace(lay, out_dtype=out_dtype, has_bias=bias is not None)
    return _partitioned(lay, *args, group_sizes, jnp.zeros((0,), out_dtype) if bias is None else bias)


def _deq_groups(group_sizes, group_axis: int, align: int, a_shape, k: int, deq_a, deq_b, a_values, b_values):
    """Dequantized (A, B) with per-tensor values ``[1]`` or ``[G]``: ``deq_a(value)``, ``deq_b(value)`` -> float32."""
    if group_axis == 0:
        rows_a = grouped_positions(group_sizes, a_shape[0])[0]
        return (_per_group(deq_a, a_values, rows_a, 0),
                deq_b(b_values.reshape(-1, 1) if b_values.shape[0] > 1 else b_values))
    cols = grouped_positions(group_sizes, k, align)[0]
    return _per_group(deq_a, a_values, cols, 1), _per_group(deq_b, b_values, cols, 1)


def _layout_args(group_sizes, a, b, group_axis, align, mode: modes.ModeSpec):
    num_groups = _check_group_sizes(group_sizes)
    block = mode.block_cols if mode.block else 1
    k = _check_layout(a, b, num_groups, group_axis, align, mode.pack, block, mode.label)
    return num_groups, k


def grouped_gemm_fp8(a, b, a_scale_inv, b_scale_inv, group_sizes, bias=None, *, group_axis: int = 0,
                     align: int = GROUP_ALIGN[ScalingMode.FP8_TENSOR], out_dtype=jnp.bfloat16, fast_accum=True,
                     backend=None):
    """Per-tensor FP8 grouped GEMM (layouts in the module docstring).

    Args:
      a, b: FP8 operands (not both E5M2): ``[M, K]`` and ``[G, N, K]`` (group_axis 0), ``[P, Kc]`` and
        ``[Q, Kc]`` (group_axis 1).
      a_scale_inv, b_scale_inv: float32 decode scales, ``[1]`` or one per group ``[G]``.
      group_sizes: int32 ``[G]``.
      bias: ``[G, N]`` (group_axis 0 only; out_dtype or float32) or None.
      group_axis: 0 (rows grouped) or 1 (contraction grouped in aligned spans).
      align: the span alignment of group_axis 1 (16 on CUDA; 1 allowed on CPU).
      out_dtype: float32, bfloat16 or float16.
      fast_accum: Hopper FP8 fast accumulation (ignored on CPU).
      backend: "ffi" or "reference" (default: ``te_jax.backend``'s context).
    """
    mode = modes.FP8_TENSOR
    check_operand_dtypes(a, b, mode.label)
    num_groups, _ = _layout_args(group_sizes, a, b, group_axis, align, mode)
    a_scale_inv = _group_value(a_scale_inv, num_groups, "a_scale_inv")
    b_scale_inv = _group_value(b_scale_inv, num_groups, "b_scale_inv")
    lay = GroupedLayout(ScalingMode.FP8_TENSOR, "te_jax_grouped_gemm_fp8", ("a", "b", "a_t", "b_t"), group_axis,
                        int(align), attrs=(("fast_accum", check_flag("fast_accum", fast_accum)),))
    return _run(lay, (a, b, a_scale_inv, b_scale_inv), group_sizes, bias, out_dtype, backend)


def grouped_gemm_fp8_block(a, a_s, b, b_s, group_sizes, bias=None, *, a_block_2d=False, b_block_2d=False,
                           group_axis: int = 0, align: int = GROUP_ALIGN[ScalingMode.FP8_BLOCK],
                           out_dtype=jnp.bfloat16, backend=None):
    """Float8 block-scaled grouped GEMM: float32 1/scale per 1x128 block (128x128 when ``*_block_2d``).

    ``a_s`` is ``[M, K/128]`` (2D: ``[M/128, K/128]``), ``b_s`` ``[G, N, K/128]``
    (2D: ``[G, N/128, K/128]``); with group_axis 1 ``[P, Kc/128]`` and
    ``[Q, Kc/128]`` (align a multiple of 128), which the custom call takes
    transposed, K-block-major (``[Kc/128, P]``, ``[Kc/128, Q]``). Other args as
    ``grouped_gemm_fp8``.
    """
    mode = modes.FP8_BLOCK
    check_operand_dtypes(a, b, mode.label)
    _, k = _layout_args(group_sizes, a, b, group_axis, align, mode)
    if a_block_2d and b_block_2d:
        raise ValueError("te_jax: 128x128 x 128x128 block-scaled GEMMs are not supported; quantize one operand "
                         "with 1x128 blocks (Float8BlockQuantizer(block_2d=False))")
    block = mode.block_cols
    for name, x, two_d in (("A", a, a_block_2d), ("B", b, b_block_2d)):
        if two_d and x.shape[-2] % block:
            raise ValueError(f"te_jax: the grouped GEMM's 128x128 blocks need {name}'s rows ({x.shape[-2]}) to be a "
                             f"multiple of {block}; use 1x128 blocks for it (Float8BlockQuantizer(block_2d=False))")
    a_s = check_block_scales(a_s, a, k, block if a_block_2d else 1, block, mode.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, block if b_block_2d else 1, block, mode.scale_dtype, "b_s")
    if group_axis == 1:  # the custom call takes them K-block-major: each group's span is whole rows
        a_s, b_s = a_s.T, b_s.T
    lay = GroupedLayout(ScalingMode.FP8_BLOCK, "te_jax_grouped_gemm_fp8_block", ("a", "a_s", "b", "b_s"), group_axis,
                        int(align), attrs=(("a_block_2d", bool(a_block_2d)), ("b_block_2d", bool(b_block_2d))),
                        k_block=block)
    return _run(lay, (a, a_s, b, b_s), group_sizes, bias, out_dtype, backend)


def grouped_gemm_mxfp8(a, a_s, b, b_s, group_sizes, bias=None, *, group_axis: int = 0,
                       align: int = GROUP_ALIGN[ScalingMode.MXFP8], out_dtype=jnp.bfloat16, backend=None):
    """MXFP8 grouped GEMM: uint8 E8M0 scales ``a_s [M, K/32]``, ``b_s [G, N, K/32]`` (group_axis 1: ``[P, Kc/32]``,
    ``[Q, Kc/32]``). Other args as ``grouped_gemm_fp8``; on a GPU the emulation runs (``GemmEmulationWarning``)."""
    mode = modes.MXFP8
    check_operand_dtypes(a, b, mode.label)
    _, k = _layout_args(group_sizes, a, b, group_axis, align, mode)
    a_s = check_block_scales(a_s, a, k, 1, mode.block_cols, mode.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, 1, mode.block_cols, mode.scale_dtype, "b_s")
    lay = GroupedLayout(ScalingMode.MXFP8, "te_jax_grouped_gemm_mxfp8", ("a", "a_s", "b", "b_s"), group_axis,
                        int(align), k_block=mode.block_cols)
    return _run(lay, (a, a_s, b, b_s), group_sizes, bias, out_dtype, backend)


def grouped_gemm_nvfp4(a, a_s, a_amax, b, b_s, b_amax, group_sizes, bias=None, *, group_axis: int = 0,
                       align: int = GROUP_ALIGN[ScalingMode.NVFP4], out_dtype=jnp.bfloat16, backend=None):
    """NVFP4 grouped GEMM: packed E2M1 operands (uint8, K/2 columns), E4M3 scales per 1x16 block, amax ``[1]`` or
    ``[G]``. Each operand decodes as ``e2m1 * s_b * S_dec`` (``te_jax.ops.gemm.gemm_nvfp4``), with its group's
    amax when there is one per group. Other args as ``grouped_gemm_fp8``; on a GPU the emulation runs
    (``GemmEmulationWarning``)."""
    mode = modes.NVFP4
    check_operand_dtypes(a, b, mode.label)
    num_groups, k = _layout_args(group_sizes, a, b, group_axis, align, mode)
    a_s = check_block_scales(a_s, a, k, 1, mode.block_cols, mode.scale_dtype, "a_s")
    b_s = check_block_scales(b_s, b, k, 1, mode.block_cols, mode.scale_dtype, "b_s")
    a_amax = _group_value(a_amax, num_groups, "a_amax")
    b_amax = _group_value(b_amax, num_groups, "b_amax")
    lay = GroupedLayout(ScalingMode.NVFP4, "te_jax_grouped_gemm_nvfp4", ("a", "a_s", "a_t", "b", "b_s", "b_t"),
                        group_axis, int(align), pack=mode.pack, k_block=mode.block_cols)
    return _run(lay, (a, a_s, a_amax, b, b_s, b_amax), group_sizes, bias, out_dtype, backend)


# ---- ScaledTensors -----------------------------------------------------------------------


def _copy(t: ScaledTensor, contract: int, side: str, per_group: bool):
    """(data, scale, amax, colwise) of the copy of ``t`` whose rows run along axis ``contract`` of its matrix.

    ``per_group``: ``t`` was quantized per group (``jax.vmap`` over G), so its arrays carry a leading G axis.
    """
    if len(t.shape) != 2 or t.flatten_axis % 2 != 1:
        raise ValueError(f"te_jax: grouped_gemm: {side} must be a ScaledTensor of a matrix (flatten_axis 1), "
                         f"got shape {t.shape} with flatten_axis {t.flatten_axis}")
    colwise = contract == 0
    if not (t.has_colwise if colwise else t.has_rowwise):
        which, flag = ("columnwise", "colwise") if colwise else ("rowwise", "rowwise")
        raise ValueError(f"te_jax: grouped_gemm: {side} contracts axis {contract}, which needs the {which} copy; "
                         f"quantize it with {flag}=True")
    data, scale = (t.colwise_data, t.colwise_scale_inv) if colwise else (t.data, t.scale_inv)
    if data.ndim != 2 + per_group:
        raise ValueError(f"te_jax: grouped_gemm: {side}'s data must be {'[G, R, C]' if per_group else '[R, C]'}, "
                         f"got {data.shape}")
    amax = t.colwise_amax if colwise and t.scaling_mode.global_amax else t.amax
    if t.scaling_mode.per_tensor:
        scale = scale.reshape(-1)
    if amax is not None:
        amax = amax.reshape(-1)
    return data, scale, amax, colwise


def grouped_gemm(lhs: ScaledTensor, rhs: ScaledTensor, group_sizes: jax.Array, contracting_dims=(1, 0), *,
                 group_axis: int = 0, align: int | None = None, bias=None, out_dtype=jnp.bfloat16,
                 fast_accum: bool | None = None, backend=None) -> jax.Array:
    """The grouped GEMM of two ScaledTensors (one scaling mode), like ``te_jax.ops.gemm.gemm``.

    ``group_axis=0``: ``lhs`` a matrix ``[M, K]`` with rows sorted by group and
    ``rhs`` G matrices quantized per group (``jax.vmap`` of a quantizer over
    ``[G, K, N]``; its arrays carry the leading G axis) contracted over
    ``contracting_dims = (lhs axis, rhs axis)`` (``(1, 0)``: ``x @ W_g``,
    ``(1, 1)``: ``dy @ W_g^T``); returns ``[M, N]``. ``group_axis=1``: both
    are matrices ``[Kc, P]`` and ``[Kc, Q]`` in aligned spans along axis 0
    (their columnwise copies are read; ``contracting_dims`` must be
    ``(0, 0)``); returns ``[G, P, Q]``. ``align`` defaults to the mode's
    ``GROUP_ALIGN``. ``fast_accum`` None: the mode's default (True for
    per-tensor FP8; the block modes have none). Other args as ``grouped_gemm_fp8``.
    """
    if not (isinstance(lhs, ScaledTensor) and isinstance(rhs, ScaledTensor)):
        raise TypeError("te_jax: grouped_gemm multiplies two ScaledTensors; quantize both operands (or call "
                        "te_jax.grouped_dense, which runs unquantized roles in high precision)")
    if lhs.mode is not rhs.mode:
        raise ValueError(f"te_jax: both grouped GEMM operands must use one scaling mode, got {lhs.mode.name} x "
                         f"{rhs.mode.name}")
    lc, rc = (int(d) % 2 for d in contracting_dims)
    if group_axis == 1 and (lc, rc) != (0, 0):
        raise ValueError(f"te_jax: grouped_gemm with group_axis=1 contracts axis 0 of both operands, got "
                         f"contracting_dims {contracting_dims}")
    mode = lhs.mode
    align = GROUP_ALIGN[mode] if align is None else align
    a, a_s, a_amax, _ = _copy(lhs, lc, "lhs", False)
    b, b_s, b_amax, b_col = _copy(rhs, rc, "rhs", group_axis == 0)
    kw = dict(group_axis=group_axis, align=align, out_dtype=out_dtype, backend=backend)
    if mode is ScalingMode.FP8_TENSOR:
        fast_accum = True if fast_accum is None else fast_accum
        return grouped_gemm_fp8(a, b, a_s, b_s, group_sizes, bias, fast_accum=fast_accum, **kw)
    if fast_accum:
        raise ValueError(f"te_jax: fast_accum=True does not apply to {mode.name} GEMMs: they always accumulate in "
                         "float32; pass fast_accum=None or False")
    if mode is ScalingMode.FP8_BLOCK:
        return grouped_gemm_fp8_block(a, a_s, b, b_s, group_sizes, bias, a_block_2d=lhs.block_2d,
                                      b_block_2d=rhs.block_2d, **kw)
    if mode is ScalingMode.MXFP8:
        return grouped_gemm_mxfp8(a, a_s, b, b_s, group_sizes, bias, **kw)
    if (lhs.rht and lc == 0) != (rhs.rht and b_col):
        raise ValueError("te_jax: an NVFP4 columnwise copy with the random Hadamard transform (rht=True) can only be "
                         "multiplied with another one (the transforms cancel); quantize both wgrad operands with "
                         "rht=True, or neither")
    return grouped_gemm_nvfp4(a, a_s, a_amax, b, b_s, b_amax, group_sizes, bias, **kw)
