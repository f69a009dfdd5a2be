"""The grouped GEMM custom call as a primitive: lowered per platform and partitioned with its experts.

``call(layout, *args)`` runs one ``te_jax_grouped_gemm_*`` custom call
(``args``: the operands in ``layout.roles`` order, the int32 group sizes, the
bias or ``[0]``). On CPU the lowering is the custom call. For CUDA it picks
the kernel (``te_jax.ops.grouped.cuda``), casting a float32 kernel's result to
the requested out dtype, or, where no native kernel exists, lowers the
emulation with a ``GemmEmulationWarning``: on sm_90 MXFP8 and NVFP4 are
dequantized to bfloat16 and multiplied by the bfloat16 kernel
(``_emulate_with_bf16_kernel``) where it tiles them, else
``te_jax.ops.grouped.reference.emulate`` runs XLA's ragged dot.

Sharding (``custom_partitioning``): the groups may be sharded with their
experts, that is B's G axis (and the bias's, and ``[G]`` per-tensor values)
for ``group_axis=0`` and ``group_sizes`` (with out's G) for ``group_axis=1``;
every other axis is gathered (A's rows and K, B's N, and for
``group_axis=1`` P, Q and Kc). With ``group_axis=0`` each device multiplies
the rows of its own groups and one all-reduce (psum) over the group axes
combines the row blocks; with ``group_axis=1`` each device writes its groups'
slices of out and nothing is exchanged. The bfloat16 call shards the same
way (its group_axis 1 groups are rows of A and B, shifted along axis 0).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

import te_jax.ops.ffi  # noqa: F401  (registers the FFI targets)
from te_jax.ops.gemm_call import GemmEmulationWarning, _cuda_compute_capability
from te_jax.ops.grouped.cuda import (bf16_kernel_emulates, block_emulation_message, check_cuda, cuda_kernel,
                                     emulation_message, grouped_workspace_bytes)
from te_jax.ops.grouped.layout import GroupedLayout, cut_sizes, span_lengths
from te_jax.ops.grouped.reference import emulate, emulation_operands
from te_jax.ops.partitioned import CustomCallPrimitive, Partitioned
from te_jax.ops.sharding import AxisClaims
from te_jax.spec.modes import ScalingMode

__all__ = ["call"]

_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


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
        bf16_kernel = bf16_kernel_emulates(lay, capability, a.shape, b.shape)
        message = emulation_message(lay, capability, bf16_kernel) or block_emulation_message(lay, a.dtype, b.dtype)
        if message:
            warnings.warn(message, GemmEmulationWarning, stacklevel=2)
            run_emulation = _emulate_with_bf16_kernel if bf16_kernel else emulate
            return mlir.lower_fun(functools.partial(run_emulation, lay), multiple_results=False)(ctx, *args)
        check_cuda(lay, a.shape, b.shape)
        run = cuda_kernel(lay, a.dtype, b.dtype)
        size = grouped_workspace_bytes(ctx.avals_in[len(lay.roles)].shape[0])
    kernel_aval = out_aval.update(dtype=run.out_dtype)
    bias_aval = ctx.avals_in[-1]
    if run.has_bias and bias_aval.dtype not in (_F32, kernel_aval.dtype):  # the float32 kernel takes a float32 bias
        args = (*args[:-1], _cast(ctx, args[-1], bias_aval, bias_aval.update(dtype=_F32)))
        ctx = ctx.replace(avals_in=[*ctx.avals_in[:-1], bias_aval.update(dtype=_F32)])
    call_ctx = ctx.replace(avals_out=[kernel_aval, jax.core.ShapedArray((size,), jnp.uint8)])
    attrs = {"group_axis": np.int64(run.group_axis), "has_bias": run.has_bias, **dict(run.attrs)}
    if run.mode is not None:  # the bfloat16 call has no align (its group_axis 1 rows are unpadded)
        attrs["align"] = np.int64(run.align)
    out = jax.ffi.ffi_lowering(run.target)(call_ctx, *args, **attrs)[0]
    if kernel_aval.dtype != out_aval.dtype:
        out = _cast(ctx, out, kernel_aval, out_aval)
    return [out]


def _emulate_with_bf16_kernel(lay: GroupedLayout, *args):
    """``emulate`` with the bfloat16 grouped kernel as the product: operands dequantized to bfloat16, the product
    accumulated in float32 and rounded to bfloat16, the bias added by the kernel, cast to ``lay.out_dtype``.

    group_axis 1 passes each group's whole span (padding included, cut at Kc) as its rows, as ``emulate`` does.
    """
    bias = args[-1]
    a, b, sizes = emulation_operands(lay, args)
    if lay.group_axis == 1:  # A [P, Kc], B [Q, Kc]: the kernel takes the spans as rows
        a, b = a.T, b.T
    if lay.has_bias and jnp.dtype(bias.dtype) not in (_F32, _BF16):
        bias = bias.astype(jnp.float32)
    bf16 = GroupedLayout(None, "te_jax_grouped_gemm_bf16", ("a", "b"), lay.group_axis, 1,
                         attrs=(("b_kn", False),), out_dtype=_BF16, has_bias=lay.has_bias)
    return _grouped_p.bind(a, b, sizes, bias, lay=bf16).astype(lay.out_dtype)


def _abstract_eval(*avals, lay: GroupedLayout):
    a, b, sizes = avals[lay.roles.index("a")], avals[lay.roles.index("b")], avals[len(lay.roles)]
    return jax.core.ShapedArray(lay.out_shape(a.shape, b.shape, sizes.shape[0]), lay.out_dtype)


_grouped_p = CustomCallPrimitive("te_jax_grouped_gemm", abstract_eval=_abstract_eval, lower=_lower)


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
        return mesh, functools.partial(_ffi_call, lay), out_sharding, arg_shardings
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
            mine = cut_sizes(mine, rows - start)  # cut at M, as the kernel does
            for role in ("a", "a_s"):  # one scale row per row of A (1D blocks)
                if role in lay.roles:
                    i = lay.roles.index(role)
                    args[i] = jnp.roll(args[i], -start, axis=0)
        else:
            spans = span_lengths(sizes, lay.align)
            start = jnp.sum(jnp.where(jnp.arange(num_groups) < first, spans, 0))
            for role in lay.roles:
                if role in ("a", "b", "a_s", "b_s"):
                    i = lay.roles.index(role)
                    per = lay.pack if role in ("a", "b") else lay.k_block
                    k_block_major = role in ("a_s", "b_s") and lay.mode is ScalingMode.FP8_BLOCK
                    args[i] = jnp.roll(args[i], -(start // per), axis=0 if k_block_major else lay.span_axis)
            if lay.align == 1:  # unpadded spans are the sizes: cut at the grouped extent, as the kernel does
                a = args[lay.roles.index("a")]
                extent = a.shape[lay.span_axis] * (lay.pack if lay.span_axis == -1 else 1)
                mine = cut_sizes(mine, extent - start)
        args[len(lay.roles)] = mine
        out = _ffi_call(lay, *args)
        if lay.group_axis == 0:
            out = lax.psum(jnp.roll(out, start, axis=0), g)
        return out

    return mesh, local_groups, out_sharding, arg_shardings


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


_partitioned = Partitioned(_ffi_call, partition=_partition, infer=_infer, sharding_rule=_sharding_rule)


def call(lay: GroupedLayout, *args):
    """Runs the grouped custom call of ``lay`` on ``args`` (``lay.roles``, group sizes, bias or ``[0]``)."""
    return _partitioned(lay, *args)
