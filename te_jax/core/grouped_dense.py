"""``grouped_dense``: one dense layer per expert, ``y[rows of g] = x[rows of g] @ W_g + b_g``, quantized.

The functional core of the mixture-of-experts layer, with the state contract
of ``te_jax.dense``::

    q = DenseQuantizers.from_recipe(recipe)
    state = q.init_state(num_groups=num_groups)        # {} unless a quantizer keeps state
    y, state = grouped_dense(x, kernel, group_sizes, quantizers=q, state=state)

``x [M, K]`` has its rows sorted by group (expert), ``kernel [G, K, N]``,
``group_sizes`` int32 ``[G]`` on the device (zeros allowed, ``sum <= M``;
the rows past the sum give zeros and get zero gradients), ``bias [G, N]``.

GEMMs (``te_jax.ops.grouped.gemm``)::

    forward  y  = x  (rowwise, linear_input)       @ W_g   (columnwise, per expert)   group_axis 0
    dgrad    dx = dy (rowwise, linear_grad_output) @ W_g^T (rowwise, per expert)      group_axis 0
    wgrad    dW_g = x_g^T @ dy_g                                                      group_axis 1

For wgrad x and dy are laid out in spans aligned to the mode's block
(``GROUP_ALIGN``), zero-padded (zeros add nothing: exact), from positions
computed on the device from ``group_sizes``. Per-tensor scaling (delayed,
current) moves the rowwise copies' FP8 bytes into the spans, transposed, in
one custom call (``te_jax.ops.grouped.spans``: the columnwise copy of a
per-tensor cast is the rowwise one transposed); the block modes gather x and
dy and quantize the spans columnwise with the rowwise copies' state (NVFP4:
the amax of the rows in groups, which is x's own when every row is in one).
With ``group_align`` (a multiple of ``span_alignment``) x already has that
layout: x and dy are quantized once with both copies, the row-grouped GEMMs
run on whole spans (zero padding rows) and wgrad takes the columnwise copies
as they are. Under per-tensor scaling K and N are zero padded to multiples
of 16 on every platform (``te_jax.core.grouped_tiles``: the CUDA kernels'
tile; exact). The weight of each expert is quantized on its own
(``jax.vmap`` of the weight quantizer), so per-tensor recipes scale each
expert separately.

State. Delayed scaling keeps one amax history per expert weight: the
"linear_weight" state has a leading G axis (``q.init_state(num_groups=G)``,
or ``init_state(q, G)`` here). The inputs of
all experts share one "linear_input" state and their output gradients one
"linear_grad_output" state (one per-tensor scale for the whole ``[M, K]``
activation, as it is quantized in one piece). The returned state is the
forward-updated one; the state after forward and backward comes back as the
gradient of ``state``, exactly as for ``te_jax.dense`` (``te_jax.train``
applies it).

"linear_output" / "linear_grad_input" quantizers quantize-dequantize ``y``
and ``dx`` as in ``te_jax.dense``. With no quantizer at all this is the
per-group ``lax.dot_general`` (the high-precision reference).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
from jax import lax

from te_jax.core import (DenseQuantizers, GemmQuant, Plan, as_quantizers, cotangent, keep,
                          mesh_resource_or_autocast, raw_key, state_cotangent, state_leaves, updated_state, vary_of)
from te_jax.core.bundles import FORWARD_FIELDS, ROLE_OF, check_key, check_state, scaling_mode_of
from te_jax.core.gemm_quant import name_quantized
from te_jax.core.grouped_tiles import feature_tile, pad_axis
from te_jax.core.unquantized import check_dtypes
from te_jax.ops.grouped import gemm as gg
from te_jax.ops.grouped.layout import regroup_rows, span_lengths, valid_group_sizes
from te_jax.ops.grouped.spans import rows_to_spans_transposed
from te_jax.ops.sharding import MeshResource, to_varying
from te_jax.ops.sharding_types import dim_spec, specs_like, untyped_op
from te_jax.quantize import CurrentScalingQuantizer, DelayedScalingQuantizer, dequantize
from te_jax.quantize.protocols import QuantizeLike
from te_jax.recipe import ROLES
from te_jax.recipe.autocast import with_plan_mesh
from te_jax.spec.modes import ScaledTensor

__all__ = ["grouped_dense", "init_state", "span_alignment"]

_WHERE = "grouped_dense"
_WEIGHT = ROLE_OF["weight"]


def init_state(quantizers: DenseQuantizers | Mapping[str, Any] | None, num_groups: int) -> dict[str, Any]:
    """The initial state of ``grouped_dense``: the weight's (delayed scaling) with a leading ``num_groups`` axis
    (``DenseQuantizers.init_state(num_groups=...)``)."""
    return as_quantizers(quantizers).init_state(num_groups=num_groups)


def check_grouped_inputs(x, kernel, group_sizes, bias, where: str = _WHERE, quantized: bool = True) -> int:
    """G, once x ``[M, K]``, kernel ``[G, K, N]``, group_sizes int32 ``[G]`` and bias ``[G, N]`` agree (float64
    too when not ``quantized``)."""
    check_dtypes(where, quantized, x=x, kernel=kernel, bias=bias)
    if x.ndim != 2 or kernel.ndim != 3 or x.shape[1] != kernel.shape[1]:
        raise ValueError(f"te_jax: {where}: x must be [M, K] and kernel [G, K, N] with one K; got x {x.shape} and "
                         f"kernel {kernel.shape}")
    if (not hasattr(group_sizes, "dtype") or jnp.dtype(group_sizes.dtype) != jnp.int32
            or tuple(group_sizes.shape) != (kernel.shape[0],)):
        got = f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)}{list(getattr(group_sizes, 'shape', ()))}"
        raise TypeError(f"te_jax: {where}: group_sizes must be int32 [G] = [{kernel.shape[0]}] (one row count per "
                        f"expert of the kernel), got {got}")
    if kernel.shape[0] == 0:
        raise ValueError(f"te_jax: {where}: the kernel has no expert (G = 0); give it at least one")
    if bias is not None and tuple(bias.shape) != (kernel.shape[0], kernel.shape[2]):
        raise ValueError(f"te_jax: {where}: bias must be [G, N] = {[kernel.shape[0], kernel.shape[2]]}, "
                         f"got {bias.shape}")
    return kernel.shape[0]


def span_alignment(quantizers: DenseQuantizers | Mapping[str, Any] | None) -> int:
    """The row alignment of wgrad's grouped operands under ``quantizers``: what the input and grad_output
    quantizers' modes need (16 per-tensor FP8 and NVFP4, 32 MXFP8, 128 Float8 block; 1 with neither)."""
    q = as_quantizers(quantizers)
    found = (scaling_mode_of(getattr(q, f)) for f in ("input", "grad_output"))
    aligns = [gg.GROUP_ALIGN[mode.family] for mode in found if mode is not None]
    return math.lcm(*aligns) if aligns else 1


def _check_group_align(q: DenseQuantizers, group_align) -> int:
    if isinstance(group_align, bool) or not isinstance(group_align, int) or group_align < 1:
        raise ValueError(f"te_jax: {_WHERE}: group_align must be a positive int, got {group_align!r}")
    need = span_alignment(q)
    if group_align > 1 and group_align % need:
        raise ValueError(f"te_jax: {_WHERE}: with these quantizers group_align must be 1 or a multiple of {need} "
                         f"(span_alignment: the alignment wgrad's quantized operands need), got {group_align}")
    return group_align


def check_grouped_state(q: DenseQuantizers, state: Mapping | None, num_groups: int,
                        where: str = _WHERE) -> dict[str, Any]:
    """The stateful roles' states; the weight's has a leading G axis (checked per expert). Shared with
    ``te_jax.grouped_mlp``, as are the checks, ``aligned_row_layout``, ``bias_grad``, ``in_groups``,
    ``quantize_expert_weights`` and ``grouped_matmul``."""
    state = dict(state or {})
    weight = state.get(_WEIGHT)
    if _WEIGHT in q.stateful() and weight is not None:
        leaves = jax.tree.leaves(weight)
        if not leaves or any(a.ndim < 1 or a.shape[0] != num_groups for a in leaves):
            raise ValueError(f"te_jax: {where}: the {_WEIGHT} state must have a leading axis of the {num_groups} "
                             f"experts (one amax history per expert); create it with "
                             f"{_init_call(num_groups)}")
        state[_WEIGHT] = jax.tree.map(lambda a: a[0], weight)
    check_state(q, state, where, _init_call(num_groups))
    return {r: dict(weight if r == _WEIGHT else state[r]) for r in q.stateful()}


def _init_call(num_groups: int) -> str:
    """The call that makes a grouped op's state, as its errors name it: the ``init_state`` of the bundle passed as
    ``quantizers=`` (a ``DenseQuantizers``; for grouped_mlp an ``MLPQuantizers``, whose state is the whole
    ``{"wi": .., "wo": ..}``)."""
    return f"quantizers.init_state(num_groups={num_groups})"


def check_blocks(q: DenseQuantizers, spans: int, k: int, n: int, where: str = _WHERE) -> None:
    """Raises a clear error when a block recipe's blocks do not tile the grouped GEMMs' operands.

    The grouped kernels take whole blocks only (``te_jax.dense`` pads partial
    ones; the grouped op does not), and each tensor is quantized rowwise and
    columnwise: x ``[spans, K]``, the expert weights ``[K, N]``, dy ``[spans, N]``.
    """
    dims = {"input": ("input features", (spans, k)), "weight": ("input and output features", (k, n)),
            "grad_output": ("output features", (spans, n))}
    for field, (what, shape) in dims.items():
        mode = scaling_mode_of(getattr(q, field))
        if mode is not None and not mode.tiles(shape, rowwise=True, colwise=True):
            raise ValueError(
                f"te_jax: {where}: {mode.label} quantizes the {ROLE_OF[field]} tensor in blocks of "
                f"{mode.block_cols}, and the grouped GEMM takes whole blocks only, but its shape is {list(shape)}: "
                f"make each of the {what} a multiple of {mode.block_cols}, or give this layer a per-tensor recipe "
                "(DelayedScaling, Float8CurrentScaling)")


# Under an Explicit mesh: with the mesh's axes Auto (jax types neither its row gathers nor ragged products);
# y keeps x's split of the rows and the kernel's of N, the new state the given state's types.
@untyped_op(lambda out, a: (P(dim_spec(a["x"], 0), dim_spec(a["kernel"], 2)), specs_like(out[1], a["state"])))
def grouped_dense(
    x: jax.Array,
    kernel: jax.Array,
    group_sizes: jax.Array,
    bias: jax.Array | None = None,
    *,
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    group_align: int = 1,
) -> tuple[jax.Array, dict[str, Any] | None]:
    """Per-expert ``x_g @ kernel[g] + bias[g]`` over the row groups of ``x``, with quantized grouped GEMMs.

    Args:
      x: ``[M, K]`` float32/bfloat16/float16, rows sorted by group.
      kernel: ``[G, K, N]``, one weight per expert.
      group_sizes: int32 ``[G]``: the rows of each expert, in order; a negative size counts as 0 and the groups
        are cut at M (docs/numerics.md, "Edges").
      bias: ``[G, N]`` or None.
      quantizers: ``DenseQuantizers`` or a mapping role -> quantizer; None computes in high precision.
      state: role -> state of the stateful quantizers (``init_state(quantizers, G)``).
      key: PRNG key for stochastic rounding; required when a quantizer uses it.
      mesh_resource: mesh axes amaxes are reduced over inside shard_map; None takes the active autocast's.
      group_align: the row layout of ``x``: group g starts at row ``sum_{h<g} roundup(m_h, group_align)``; the
        rows between groups belong to none (zeros in ``y`` and in the gradient of ``x``, whatever ``x`` holds
        there). 1: the groups follow each other. With quantizers it is 1 or a multiple of
        ``span_alignment(quantizers)``; then wgrad multiplies x and dy as they are (no span copies) and each
        is quantized once, both copies in one pass.

    Returns:
      ``(y [M, N], new_state)`` as ``te_jax.dense`` returns them (new_state None when ``state`` is None and
      nothing is quantized).
    """
    q = as_quantizers(quantizers)
    num_groups = check_grouped_inputs(x, kernel, group_sizes, bias, quantized=q.any)
    group_align = _check_group_align(q, group_align)
    m, k = x.shape
    group_sizes = valid_group_sizes(group_sizes, m, group_align)  # one meaning of any sizes, on every path
    n = kernel.shape[2]
    if not q.any:
        return _aligned_high_precision(x, kernel, group_sizes, bias, group_align), \
            None if state is None else dict(state)
    if group_align > 1:  # x is already in aligned spans: wgrad's operands as they are
        if m % group_align:
            raise ValueError(f"te_jax: {_WHERE}: with group_align {group_align} and quantizers, x's rows ({m}) must "
                             f"be a multiple of it (te_jax.moe.aligned_rows gives such a count)")
        align, spans = group_align, m
    else:
        align = span_alignment(q)
        spans = -(-(m + num_groups * (align - 1)) // align) * align  # room for every group's aligned span
    check_blocks(q, spans, k, n)
    tile = feature_tile(q)  # K and N zero padded to the CUDA kernels' tile on every platform (exact)
    x, kernel, bias = pad_axis(x, 1, tile), pad_axis(pad_axis(kernel, 1, tile), 2, tile), pad_axis(bias, 1, tile)
    inner = check_grouped_state(q, state, num_groups)
    if key is None:
        check_key(q, FORWARD_FIELDS, _WHERE)
    mesh_resource = mesh_resource_or_autocast(mesh_resource, x, where=_WHERE)
    plan = _GroupedPlan(mesh_resource, state_leaves(inner), (), vary_of(x, kernel, bias),
                        None, q, align, spans, x.dtype, kernel.dtype, None if bias is None else bias.dtype,
                        group_align > 1)
    y, new_inner = _vjp(plan, x, kernel, group_sizes, bias, inner, raw_key(key))
    return (y if y.shape[1] == n else y[:, :n]), updated_state(state, new_inner, None)


def _aligned_high_precision(x, kernel, group_sizes, bias, group_align: int):
    """``_high_precision`` on the aligned row layout: zeros between the groups, each group its rounded span."""
    if group_align == 1:
        return _high_precision(x, kernel, group_sizes, bias)
    sizes, member = aligned_row_layout(group_sizes, x.shape[0], group_align)
    return in_groups(_high_precision(in_groups(x, member), kernel, sizes, bias), member)


def _high_precision(x, kernel, group_sizes, bias):
    """What a loop of ``lax.dot_general`` over the groups computes, rows past the groups zero.

    bfloat16 operands whose K and N are multiples of 8 (and a bfloat16 bias or none) run te_jax's bfloat16
    grouped GEMM on a GPU (``_grouped_bf16``); everything else, and every CPU, runs XLA's ragged dot.
    """
    bf16 = jnp.dtype(jnp.bfloat16)
    if (jnp.dtype(x.dtype) == bf16 and jnp.dtype(kernel.dtype) == bf16 and x.shape[1] % 8 == 0
            and kernel.shape[2] % 8 == 0 and (bias is None or jnp.dtype(bias.dtype) == bf16)):
        return lax.platform_dependent(x, kernel, group_sizes, bias, cuda=_grouped_bf16, default=_ragged)
    return _ragged(x, kernel, group_sizes, bias)


@jax.custom_vjp
def _grouped_bf16(x, kernel, group_sizes, bias):
    """``_ragged`` with te_jax's bfloat16 grouped GEMMs: forward, dgrad and wgrad in the operands' layouts."""
    return gg.grouped_gemm_bf16(x, kernel, group_sizes, bias, group_axis=0, b_kn=True)


def _grouped_bf16_fwd(x, kernel, group_sizes, bias):
    return _grouped_bf16(x, kernel, group_sizes, bias), (x, kernel, group_sizes, bias is not None)


def _grouped_bf16_bwd(res, dy):
    x, kernel, group_sizes, has_bias = res
    dx = gg.grouped_gemm_bf16(dy, kernel, group_sizes, group_axis=0, b_kn=False)
    dk = gg.grouped_gemm_bf16(x, dy, group_sizes, group_axis=1)
    return dx, dk, None, bias_grad(dy, group_sizes, 1, dy.dtype) if has_bias else None


_grouped_bf16.defvjp(_grouped_bf16_fwd, _grouped_bf16_bwd)


def _ragged(x, kernel, group_sizes, bias):
    """XLA's ragged dot (its own gradients), the bias, zeros past the groups."""
    group, _, member = gg.grouped_positions(group_sizes, x.shape[0])
    y = lax.ragged_dot(x, kernel, group_sizes)
    if bias is not None:
        y = y + bias[group]
    return jnp.where(member[:, None], y, jnp.zeros((), y.dtype))


@dataclasses.dataclass(frozen=True)
class _GroupedPlan(Plan):
    """The static facts of one grouped_dense call (``vary``: x, kernel, bias)."""

    q: DenseQuantizers
    align: int  # the wgrad spans' alignment
    spans: int  # rows of the span layout
    x_dtype: Any
    k_dtype: Any
    bias_dtype: Any  # None: no bias
    aligned: bool  # x's groups start at align-rounded rows (group_align): wgrad takes x and dy as they are


def _in_spans(t: jax.Array, group_sizes, plan: _GroupedPlan) -> jax.Array:
    """``t [M, C]``'s group rows laid out in aligned spans ``[spans, C]``, zeros between (one gather)."""
    return regroup_rows(t, group_sizes, plan.spans, 1, plan.align)


def _quantize_spans(g: GemmQuant, field: str, t: jax.Array, rowwise):
    """The columnwise copy of the span layout ``t``, with the role's state (not recorded again) and its own key.

    ``rowwise`` is the role's quantized tensor whose rows ``t`` rearranges. A custom quantizer with
    ``quantize_like`` casts ``t`` with ``rowwise``'s scale: the tensor's amax, as one quantization with both
    copies would use, and no second amax pass. (Rows past the groups count in it, as they do for the rowwise
    copy.)
    """
    qz = getattr(g.q, field)
    if qz is None:
        return t
    if isinstance(qz, QuantizeLike) and isinstance(rowwise, ScaledTensor):
        return name_quantized(qz.quantize_like(t, rowwise, rowwise=False, colwise=True, flatten_axis=1))
    role = ROLE_OF[field]
    key = None if g.key is None else jax.random.fold_in(jax.random.fold_in(g.key, ROLES.index(role)), 1)
    return name_quantized(qz.quantize(t, g.st.get(role), rowwise=False, colwise=True, flatten_axis=1, key=key))


def _columnwise_spans(g: GemmQuant, field: str, t: jax.Array, rowwise, group_sizes, plan: _GroupedPlan):
    """wgrad's operand: the columnwise copy of ``t [M, C]``'s group rows in the aligned span layout.

    Under te_jax's per-tensor scaling (delayed, current) the columnwise copy is the rowwise copy transposed (one
    scale, an elementwise cast), so ``rowwise``'s bytes are moved into the spans and transposed in one pass and
    ``t`` is not read again. Other quantizers (block modes, a CustomRecipe's own, a subclass of te_jax's, which
    may cast otherwise) quantize the spans of ``t`` (``_quantize_spans``).
    """
    own_cast = type(getattr(g.q, field)) in (CurrentScalingQuantizer, DelayedScalingQuantizer)
    if own_cast and isinstance(rowwise, ScaledTensor) and rowwise.has_rowwise and rowwise.scaling_mode.per_tensor:
        colwise = rows_to_spans_transposed(rowwise.data, group_sizes, plan.spans, plan.align)
        return name_quantized(dataclasses.replace(rowwise, data=None, scale_inv=None, colwise_data=colwise,
                                                  colwise_scale_inv=rowwise.scale_inv,
                                                  shape=(plan.spans, t.shape[1])))
    return _quantize_spans(g, field, _in_spans(t, group_sizes, plan), rowwise)


def quantize_expert_weights(g: GemmQuant, kernel: jax.Array):
    """Each expert's weight quantized on its own (rowwise and columnwise), its state per expert."""
    if not g.has("weight"):
        return kernel
    groups = jnp.arange(kernel.shape[0], dtype=jnp.uint32)

    def run(qz, st, key):
        def one(w, s, i):
            k = None if key is None else jax.random.fold_in(key, i)
            return qz.quantize(w, s, colwise=True, flatten_axis=1, key=k)
        return (jax.vmap(one, in_axes=(0, None if st is None else 0, 0))(kernel, st, groups),)

    return g.run("weight", run)[0]


def _expert(t, e: int):
    return jax.tree.map(lambda a: a[e], t)


def grouped_matmul(a, b, group_sizes, contracting, *, group_axis, align, out_dtype, bias=None, fast_accum=None):
    """``te_jax.ops.grouped.gemm.grouped_gemm``, or, when either side is unquantized, its float32 equivalent."""
    if isinstance(a, ScaledTensor) and isinstance(b, ScaledTensor):
        return gg.grouped_gemm(a, b, group_sizes, contracting, group_axis=group_axis, align=align, bias=bias,
                               out_dtype=out_dtype, fast_accum=fast_accum)
    # A custom recipe left a role in high precision: dequantize the other side, multiply in float32.
    da = dequantize(a, jnp.float32) if isinstance(a, ScaledTensor) else a.astype(jnp.float32)
    if isinstance(b, ScaledTensor):
        db = jnp.stack([dequantize(_expert(b, e), jnp.float32) for e in range(group_sizes.shape[0])]) \
            if group_axis == 0 else dequantize(b, jnp.float32)
    else:
        db = b.astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    if group_axis == 0:
        w = db if contracting[1] == 0 else jnp.swapaxes(db, 1, 2)
        out = _high_precision(da, w, group_sizes, None if bias is None else bias.astype(jnp.float32))
        return out.astype(out_dtype)
    group, _, member = gg.grouped_positions(group_sizes, da.shape[0], align)
    mask = ((group[None] == jnp.arange(group_sizes.shape[0])[:, None]) & member[None])[:, :, None]  # [G, spans, 1]
    return jnp.einsum("gmp,gmq->gpq", jnp.where(mask, da[None], 0.0), jnp.where(mask, db[None], 0.0),
                      precision=hi).astype(out_dtype)


def aligned_row_layout(group_sizes, rows: int, align: int):
    """The aligned layout's sizes for the row-grouped GEMMs and ``member [rows, 1]``, the rows holding a group's
    element: each group's whole rounded span, whose padding rows are zero in the operands, so the GEMMs write
    zeros there."""
    return span_lengths(group_sizes, align), gg.grouped_positions(group_sizes, rows, align)[2][:, None]


def bias_grad(dy, group_sizes, align: int, dtype):
    """Per-group float32 sums of ``dy``'s rows in groups (groups starting at ``align``-rounded rows), cast."""
    group, _, member = gg.grouped_positions(group_sizes, dy.shape[0], align)
    rows = jnp.where(member[:, None], dy.astype(jnp.float32), 0.0)
    return jax.ops.segment_sum(rows, group, num_segments=group_sizes.shape[0]).astype(dtype)


def _row_layout(plan: _GroupedPlan, group_sizes, rows: int):
    """The group sizes the row-grouped GEMMs take, and the rows in groups (None: every row up to the sum)."""
    return aligned_row_layout(group_sizes, rows, plan.align) if plan.aligned else (group_sizes, None)


def in_groups(t, member):
    """``t`` with the rows outside the groups zeroed (aligned layout), or ``t``."""
    return t if member is None else jnp.where(member, t, jnp.zeros((), t.dtype))


class _Residuals(NamedTuple):
    """What grouped_dense's backward reads (a pytree)."""

    x_spans: Any  # x's columnwise copy in the wgrad span layout (or x itself, unquantized)
    kernel: Any  # the expert weights quantized, rowwise copies only (dgrad)
    group_sizes: Any
    state: dict  # role -> incoming state (float32)
    state_grads: dict  # role -> the forward roles' state updates (update form)
    key: Any  # raw PRNG key or None


def _forward(plan: _GroupedPlan, x, kernel, group_sizes, bias, state, key):
    g = GemmQuant(plan.q, state, key, plan.mesh_resource)
    row_sizes, member = _row_layout(plan, group_sizes, x.shape[0])
    x = in_groups(x, member)
    xq = g.quantize("input", x, colwise=plan.aligned, flatten_axis=1)
    kq = quantize_expert_weights(g, kernel)
    y = grouped_matmul(keep(xq, "rowwise"), kq, row_sizes, (1, 0), group_axis=0, align=plan.align, bias=bias,
                        out_dtype=jnp.result_type(x.dtype, kernel.dtype), fast_accum=plan.q.fast_accum)
    if bias is not None:
        y = in_groups(y, member)  # the padding rows got the bias
    y = to_varying(g.qdq("output", y, flatten_axis=1), plan.all_vary)
    if plan.aligned:
        xs = keep(xq, "colwise")
    else:
        xs = _columnwise_spans(g, "input", x, xq, group_sizes, plan)
    res = _Residuals(xs, keep(kq, "rowwise"), group_sizes, g.st, g.grads, key)
    return (y, g.new_state()), res


def _primal(plan, x, kernel, group_sizes, bias, state, key):
    return _forward(plan, x, kernel, group_sizes, bias, state, key)[0]


def _fwd(plan, x, kernel, group_sizes, bias, state, key):
    return _forward(plan, x, kernel, group_sizes, bias, state, key)


def _bwd(plan: _GroupedPlan, res: _Residuals, cotangents):
    group_sizes = res.group_sizes
    dy = cotangents[0]
    g = GemmQuant.backward(plan.q, res.state, res.key, plan.mesh_resource, None, _WHERE)
    fast = plan.q.backward_fast_accum
    row_sizes, member = _row_layout(plan, group_sizes, dy.shape[0])
    dy = in_groups(dy, member)
    dyq = g.quantize("grad_output", dy, colwise=plan.aligned, flatten_axis=1)
    dx = grouped_matmul(keep(dyq, "rowwise"), res.kernel, row_sizes, (1, 1), group_axis=0, align=plan.align,
                         out_dtype=plan.x_dtype, fast_accum=fast)
    dx = g.qdq("grad_input", dx, flatten_axis=1)
    if plan.aligned:
        dys = keep(dyq, "colwise")
    else:
        dys = _columnwise_spans(g, "grad_output", dy, dyq, group_sizes, plan)
    dk = grouped_matmul(res.x_spans, dys, group_sizes, (0, 0), group_axis=1, align=plan.align, out_dtype=plan.k_dtype,
                         fast_accum=fast)
    dbias = None
    if plan.bias_dtype is not None:
        dbias = bias_grad(dy, group_sizes, plan.align if plan.aligned else 1, plan.bias_dtype)
    u = plan.all_vary
    vx, vk, vbias = plan.vary
    return (cotangent(dx, u, vx), cotangent(dk, u, vk), None, cotangent(dbias, u, vbias),
            state_cotangent(plan.state_leaves, {**res.state_grads, **g.grads}, u), None)


_vjp = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_vjp.defvjp(_fwd, with_plan_mesh(_bwd))
