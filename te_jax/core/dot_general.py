"""``dot_general`` and ``einsum``: ``lax.dot_general`` / ``jnp.einsum`` semantics on te_jax's quantized GEMMs.

The functional form of an injected product (``flax.linen``'s ``dot_general_cls``,
an NNX layer's ``dot_general``, an einsum layer): the rhs is the weight, so the
roles are those of ``te_jax.dense`` ("linear_input" = lhs, "linear_weight" =
rhs, "linear_grad_output" = the output's gradient)::

    q = DenseQuantizers.from_recipe(recipe, path)
    state = q.init_state()                       # batch axes: q.init_state(num_groups=prod(batch sizes))
    y, state = dot_general(x, w, (((1,), (0,)), ((), ())), quantizers=q, state=state)
    y, state = einsum("bsd,dhk->bshk", x, w, quantizers=q, state=state)

Routes. With no quantizer quantizing anything ``dot_general`` *is*
``lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)``
(the same call, so the same bits) and ``einsum`` *is*
``jnp.einsum(equation, lhs, rhs, precision, preferred_element_type)``
(the same call: jnp.einsum's contraction path, operand order and named
scope, so the same program and bits on every backend, eagerly too).
Quantized:

* no batch axes: ``te_jax.dense`` with ``contracting_dims``: any number and
  order of contracting axes (dense moves them last on lhs and first on rhs,
  paired in the given order; the output is lhs's free axes then rhs's, as
  lax's is), fused quantize kernels, the FP8 GEMMs forward, dgrad and wgrad;
* batch axes (heads shared by lhs and rhs): the grouped GEMM,
  ``te_jax.grouped_dense`` with equal group sizes. lhs becomes
  ``[B*M, K]`` (batch, free, contracting axes flattened, the batch element
  the group of its rows), rhs ``[B, K, N]``. This is the kernel family built
  for "one product per batch element": its wgrad contracts each group's own
  rows (group_axis 1), which a batched dense GEMM cannot do from one
  quantization (the columnwise copy of ``[B*M, K]`` runs across batch
  elements). When ``M`` is a multiple of the recipe's span alignment the
  rows are passed as aligned groups (``group_align``) and wgrad reads x and
  dy as they are. As in ``grouped_dense``, each batch element of the weight is
  quantized on its own; the inputs share one scale (one "linear_input"
  state), and a delayed-scaling weight keeps one amax history per batch
  element: its "linear_weight" state has a leading ``B = prod(batch sizes)``
  axis (``quantizers.init_state(num_groups=B)``). Under per-tensor scaling
  grouped_dense zero pads K and N to multiples of 16, the tile of the CUDA
  grouped kernels, on every platform (exact: zeros add nothing to a product and
  change no amax), so any K and N run on CPU and GPU alike. The grouped
  kernels take whole blocks only: a block recipe needs K and N multiples of
  its block.

What the kernels cannot serve raises at trace time, naming the limit: a
product with no contracting axis (an outer product: nothing for a GEMM to
contract), non-float operands or output type, statistics
(``inspect``) together with batch axes (the grouped GEMM records none).

A weight with no free axis (a vector: the dot product of two vectors, a
matrix-vector product) gets one output column for the GEMM, dropped after
it, so the output has lax's shape.

``preferred_element_type`` is the output dtype (without it, lax's: float16
x bfloat16 gives bfloat16, where ``jnp.result_type`` says float32). When it
is wider than the operands (float32 from bfloat16) the operands are widened
first (exactly: the quantizers see the same values) and the GEMM writes
float32 as lax would; a narrower one casts the output.

State, keys, statistics and the mesh axes are those of ``te_jax.dense``.
"""

from __future__ import annotations

import math
import string
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.core.bundles import DenseQuantizers, as_quantizers, check_high_precision
from te_jax.core.dense import dense
from te_jax.core.gemm_quant import high_precision_state
from te_jax.core.grouped_dense import grouped_dense, span_alignment
from te_jax.core.stats import Sample, as_sample
from te_jax.ops.sharding import MeshResource
from te_jax.ops.sharding_types import product_type, reshape, retype

__all__ = ["dot_general", "einsum", "parse_einsum"]

_WHERE = "dot_general"


def _axes(dims, ndim: int, what: str) -> tuple[int, ...]:
    dims = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    out = tuple(int(d) % ndim for d in dims if -ndim <= int(d) < ndim)
    if len(out) != len(dims) or len(set(out)) != len(out):
        raise ValueError(f"te_jax: {_WHERE}: {what} {dims} are not distinct axes of a rank-{ndim} operand")
    return out


def _dimension_numbers(lhs, rhs, dimension_numbers) -> tuple[tuple[int, ...], ...]:
    """``(lc, rc, lb, rb)`` as non-negative axes, checked as lax checks them (a te_jax error)."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise ValueError(f"te_jax: {_WHERE}: dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                         f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None
    lc, lb = _axes(lc, lhs.ndim, "lhs contracting dims"), _axes(lb, lhs.ndim, "lhs batch dims")
    rc, rb = _axes(rc, rhs.ndim, "rhs contracting dims"), _axes(rb, rhs.ndim, "rhs batch dims")
    if len(lc) != len(rc) or len(lb) != len(rb) or set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(f"te_jax: {_WHERE}: dimension_numbers {dimension_numbers} must pair as many lhs as rhs "
                         "axes, contracting and batch axes distinct")
    for what, a, b in (("contracting", lc, rc), ("batch", lb, rb)):
        if [lhs.shape[i] for i in a] != [rhs.shape[j] for j in b]:
            raise ValueError(f"te_jax: {_WHERE}: {what} dims {a} of lhs {lhs.shape} and {b} of rhs {rhs.shape} "
                             "differ in size")
    return lc, rc, lb, rb


def _output_dtype(lhs, rhs, dimension_numbers, preferred_element_type) -> tuple[Any, Any]:
    """``(compute dtype of the operands, output dtype)`` of a quantized product. Without a preferred type the
    output has ``lax.dot_general``'s dtype, which is not always ``jnp.result_type``'s (float16 x bfloat16 gives
    bfloat16, not float32)."""
    natural = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dimension_numbers), lhs, rhs).dtype
    if preferred_element_type is None:
        return natural, natural
    out = jnp.dtype(preferred_element_type)
    if not jnp.issubdtype(out, jnp.floating) or out.itemsize == 1:
        raise TypeError(f"te_jax: {_WHERE}: a quantized product writes float32, bfloat16 or float16; "
                        f"preferred_element_type={out} is none of them (compute it outside te_jax.autocast)")
    widens = out != natural and jnp.promote_types(natural, out) == out
    return (out if widens else natural), out


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    *,
    precision=None,
    preferred_element_type=None,
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    inspect: bool | Sample = False,
) -> tuple[jax.Array, dict[str, Any] | None]:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with the GEMMs quantized (rhs: the weight).

    Args:
      lhs: the input (role "linear_input").
      rhs: the weight (role "linear_weight").
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` as lax takes them.
        The output is ``[*batch, *lhs free axes, *rhs free axes]``.
      precision: lax's precision (the unquantized product).
      preferred_element_type: the output dtype (None: lax's).
      quantizers: ``DenseQuantizers`` or ``{role: quantizer}``; None (or nothing quantized): ``lax.dot_general``.
      state: as for ``te_jax.dense``; with batch axes the "linear_weight" state has a leading axis of the
        product of the batch sizes (module docstring).
      key: PRNG key for stochastic rounding.
      mesh_resource: as for ``te_jax.dense``.
      inspect: statistics, as for ``te_jax.dense`` (products without batch axes).

    Returns:
      ``(y, new_state)`` as ``te_jax.dense`` returns them.
    """
    q = as_quantizers(quantizers)
    sample = as_sample(inspect)
    if not q.any:
        y = lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                            preferred_element_type=preferred_element_type)
        return y, high_precision_state(state, sample)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    check_high_precision(_WHERE, lhs=lhs, rhs=rhs)
    lc, rc, lb, rb = _dimension_numbers(lhs, rhs, dimension_numbers)
    if not lc:
        raise ValueError(f"te_jax: {_WHERE}: dimension_numbers {dimension_numbers} contract no axis (an outer "
                         "product); te_jax's quantized GEMMs need at least one contracting axis: compute this "
                         "product outside te_jax.autocast, or give its layer a recipe role of None")
    compute, out = _output_dtype(lhs, rhs, dimension_numbers, preferred_element_type)
    lhs, rhs = lhs.astype(compute), rhs.astype(compute)
    # A weight with no free axis (a vector, as in a dot product of two vectors) gets one output column, which
    # the GEMMs need, dropped again after the product.
    vector = rhs.ndim == len(rc) + len(rb)
    if vector:
        rhs = rhs[..., None]
    if not lb:
        y, new_state = dense(lhs, rhs, contracting_dims=(lc, rc), quantizers=q, state=state, key=key,
                             mesh_resource=mesh_resource, precision=precision, inspect=sample or False)
    else:
        if sample is not None:
            raise ValueError(f"te_jax: {_WHERE}: statistics (inspect) are not recorded for products with batch axes "
                             f"{lb}/{rb} (they run on the grouped GEMM); turn inspect off for this layer")
        y, new_state = _batched(lhs, rhs, lc, rc, lb, rb, q, state, key, mesh_resource)
    return (y[..., 0] if vector else y).astype(out), new_state


def _batched(lhs, rhs, lc, rc, lb, rb, q: DenseQuantizers, state, key, mesh_resource):
    """The product with batch axes as ``grouped_dense`` over equal groups (module docstring)."""
    lf = tuple(i for i in range(lhs.ndim) if i not in lc + lb)
    rf = tuple(i for i in range(rhs.ndim) if i not in rc + rb)
    batch_shape = tuple(lhs.shape[i] for i in lb)
    lf_shape, rf_shape = tuple(lhs.shape[i] for i in lf), tuple(rhs.shape[i] for i in rf)
    b, m, n = math.prod(batch_shape), math.prod(lf_shape), math.prod(rf_shape)
    k = math.prod(lhs.shape[i] for i in lc)
    x = reshape(jnp.transpose(lhs, lb + lf + lc), (b * m, k))
    w = reshape(jnp.transpose(rhs, rb + rc + rf), (b, k, n))
    align = span_alignment(q)
    group_align = align if align > 1 and m % align == 0 else 1
    try:
        y, new_state = grouped_dense(x, w, jnp.full((b,), m, jnp.int32), quantizers=q, state=state, key=key,
                                     mesh_resource=mesh_resource, group_align=group_align)
    except ValueError as err:
        raise ValueError(str(err).replace(
            "te_jax: grouped_dense", f"te_jax: {_WHERE} (batch axes run on the grouped GEMM, te_jax.grouped_dense "
            f"over {b} groups of {m} rows)", 1)) from None
    return retype(reshape(y, batch_shape + lf_shape + rf_shape), product_type(lhs, lb + lf, rhs, rf)), new_state


# ---- einsum ------------------------------------------------------------------------------------------------


class EinsumPlan(NamedTuple):
    """A two-operand einsum as a ``dot_general`` (all axes as indices of the operands after ``*_sum``)."""

    lhs_squeeze: tuple[int, ...]  # lhs axes of size 1 against a larger rhs axis, squeezed first (broadcast)
    rhs_squeeze: tuple[int, ...]
    lhs_sum: tuple[int, ...]  # lhs axes (after the squeeze) of letters only lhs has, summed before the product
    rhs_sum: tuple[int, ...]
    dimension_numbers: tuple  # ((lc, rc), (lb, rb)) of the summed operands
    transpose: tuple[int, ...] | None  # from lax's (batch, lhs free, rhs free) order to the output, None: identity


def _einsum_error(equation: str, why: str) -> ValueError:
    return ValueError(f"te_jax: einsum {equation!r}: {why}")


def _expand_ellipsis(equation: str, spec: str, ndim: int, letters: str) -> str:
    if "..." not in spec:
        return spec
    if spec.count("...") > 1 or "." in spec.replace("...", "", 1):
        raise _einsum_error(equation, f"malformed ellipsis in {spec!r}")
    count = ndim - (len(spec) - 3)
    if count < 0:
        raise _einsum_error(equation, f"{spec!r} names more axes than the operand's {ndim}")
    return spec.replace("...", letters[len(letters) - count:] if count else "")


def parse_einsum(equation: str, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]) -> EinsumPlan:
    """The dot_general of a two-operand einsum (``jnp.einsum``'s contraction, raising te_jax errors).

    A letter only in one operand and absent from the output is summed first;
    a size-1 axis against a larger one is broadcast (summed away, as
    ``jnp.einsum`` does); an ellipsis stands for the same trailing-aligned
    axes in every operand. Raises on more or fewer than two operands, a
    letter repeated within one operand or in the output, an output letter no
    operand has, and axes of one letter that differ in size.
    """
    eq = equation.replace(" ", "")
    inputs, arrow, output = eq.partition("->")
    specs = inputs.split(",")
    if len(specs) != 2:
        raise _einsum_error(equation, f"te_jax takes exactly two operands (the input and the weight), got "
                                      f"{len(specs)}; split it into two-operand einsums")
    if "->" in output:
        raise _einsum_error(equation, "more than one '->'")
    unused = "".join(c for c in string.ascii_letters if c not in eq)
    n_ell = max(nd - (len(s) - 3) if "..." in s else 0 for s, nd in zip(specs, (len(lhs_shape), len(rhs_shape))))
    ell = unused[:max(n_ell, 0)]
    lhs_s, rhs_s = (_expand_ellipsis(equation, s, len(shape), ell) for s, shape in zip(specs, (lhs_shape, rhs_shape)))
    if arrow:
        if "..." not in output and any("..." in s for s in specs) and ell:
            raise _einsum_error(equation, "the operands have an ellipsis and the output does not; write '...' in "
                                          "the output (te_jax does not sum over an ellipsis)")
        out_s = output.replace("...", ell) if "..." in output else output
    else:
        counts = Counter(lhs_s + rhs_s)
        out_s = ell + "".join(sorted(c for c in counts if counts[c] == 1 and c not in ell))
    for name, s, shape in (("lhs", lhs_s, lhs_shape), ("rhs", rhs_s, rhs_shape), ("output", out_s, None)):
        if not all(c in string.ascii_letters for c in s):
            raise _einsum_error(equation, f"the {name} subscripts {s!r} must be letters (and one '...')")
        if len(set(s)) != len(s):
            raise _einsum_error(equation, f"a letter repeats within the {name} subscripts {s!r} (a diagonal or "
                                          "trace); te_jax does not take one")
        if shape is not None and len(s) != len(shape):
            raise _einsum_error(equation, f"{name} {s!r} names {len(s)} axes, the operand has {len(shape)}")
    missing = [c for c in out_s if c not in lhs_s + rhs_s]
    if missing:
        raise _einsum_error(equation, f"output letters {missing} appear in no operand")
    size_l, size_r = dict(zip(lhs_s, lhs_shape)), dict(zip(rhs_s, rhs_shape))
    for c in set(size_l) & set(size_r):
        if size_l[c] != size_r[c] and 1 not in (size_l[c], size_r[c]):
            raise _einsum_error(equation, f"letter {c!r} is {size_l[c]} in lhs and {size_r[c]} in rhs")
    # jnp.einsum's order: broadcast size-1 axes away, then sum the letters only one side has.
    drop_l = [c for c in lhs_s if c in size_r and size_l[c] == 1 and size_r[c] != 1]
    drop_r = [c for c in rhs_s if c in size_l and size_r[c] == 1 and size_l[c] != 1]
    kept_l = "".join(c for c in lhs_s if c not in drop_l)
    kept_r = "".join(c for c in rhs_s if c not in drop_r)
    uniq_l = [c for c in kept_l if c not in out_s and c not in kept_r]
    uniq_r = [c for c in kept_r if c not in out_s and c not in kept_l]
    lhs_n = "".join(c for c in kept_l if c not in uniq_l)
    rhs_n = "".join(c for c in kept_r if c not in uniq_r)
    contracted = sorted(c for c in lhs_n if c in rhs_n and c not in out_s)
    batch = [c for c in out_s if c in lhs_n and c in rhs_n]
    lc, rc = tuple(lhs_n.index(c) for c in contracted), tuple(rhs_n.index(c) for c in contracted)
    lb, rb = tuple(lhs_n.index(c) for c in batch), tuple(rhs_n.index(c) for c in batch)
    lf = "".join(c for c in lhs_n if c not in contracted and c not in batch)
    rf = "".join(c for c in rhs_n if c not in contracted and c not in batch)

    def perm(names: str) -> tuple[int, ...] | None:
        return None if names == out_s else tuple(names.index(c) for c in out_s)

    return EinsumPlan(tuple(lhs_s.index(c) for c in drop_l), tuple(rhs_s.index(c) for c in drop_r),
                      tuple(kept_l.index(c) for c in uniq_l), tuple(kept_r.index(c) for c in uniq_r),
                      ((lc, rc), (lb, rb)), perm("".join(batch) + lf + rf))


def _sum_axes(x: jax.Array, axes: tuple[int, ...], dtype) -> jax.Array:
    """``x`` summed over ``axes`` as ``jnp.einsum`` sums (widened to ``dtype`` first when that is wider)."""
    if not axes:
        return x
    if jnp.result_type(x, dtype) != x.dtype:
        x = x.astype(dtype)
    return lax.reduce(x, np.array(0, x.dtype), lax.add, axes)


def einsum(
    equation: str,
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    precision=None,
    preferred_element_type=None,
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    inspect: bool | Sample = False,
) -> tuple[jax.Array, dict[str, Any] | None]:
    """A two-operand ``jnp.einsum(equation, lhs, rhs)`` on ``dot_general`` (rhs: the weight).

    ``parse_einsum`` turns the equation into dimension numbers plus the
    output transpose (and raises te_jax's errors on every route).
    Unquantized it *is* ``jnp.einsum(equation, lhs, rhs, precision=...,
    preferred_element_type=...)``: the same call builds the same program, so
    the same bits on every backend (the same sums and product rebuilt here
    are other programs, eagerly one per op, which a GPU may fuse, order and
    round otherwise). Quantized, lhs stays the input and rhs the weight. The
    keyword arguments are ``dot_general``'s.

    Returns:
      ``(y, new_state)``.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    plan = parse_einsum(equation, lhs.shape, rhs.shape)
    if not as_quantizers(quantizers).any:
        y = jnp.einsum(equation, lhs, rhs, precision=precision, preferred_element_type=preferred_element_type)
        return y, high_precision_state(state, as_sample(inspect))
    out = jnp.result_type(lhs, rhs) if preferred_element_type is None else jnp.dtype(preferred_element_type)
    lhs = _sum_axes(lax.squeeze(lhs, plan.lhs_squeeze), plan.lhs_sum, out)
    rhs = _sum_axes(lax.squeeze(rhs, plan.rhs_squeeze), plan.rhs_sum, out)
    y, new_state = dot_general(lhs, rhs, plan.dimension_numbers, precision=precision, preferred_element_type=out,
                               quantizers=quantizers, state=state, key=key, mesh_resource=mesh_resource,
                               inspect=inspect)
    if plan.transpose is not None:
        y = lax.transpose(y, plan.transpose)
    return y.astype(out), new_state
