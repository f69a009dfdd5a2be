"""``te_jax.ragged_dot``: a drop-in for ``jax.lax.ragged_dot`` on te_jax's quantized grouped GEMMs.

Most JAX mixture-of-experts models compute their experts with
``jax.lax.ragged_dot(lhs [m, k], rhs [g, k, n], group_sizes [g])``: the
first ``group_sizes[0]`` rows of ``lhs`` times ``rhs[0]``, the next
``group_sizes[1]`` times ``rhs[1]``, and so on; the rows past
``sum(group_sizes)`` give zeros. Swapping in ``te_jax.ragged_dot`` changes
nothing outside ``te_jax.autocast``: it *is* ``jax.lax.ragged_dot`` there
(same bits, same gradients). Under ``te_jax.autocast(recipe=...)`` the
forward, dgrad and wgrad GEMMs run quantized with the recipe on
``te_jax.grouped_dense`` (one weight quantization per expert, the wgrad
operands in aligned spans; docs/moe.md).

What a recipe changes, and what it needs:

* ``precision`` serves the unquantized path only (the quantized GEMMs
  accumulate in float32 whatever it says); ``preferred_element_type`` is the
  output dtype, as for lax (a wider float than the operands' makes the grouped
  GEMM write it directly).
* K and N are zero-padded to the multiple the grouped kernels take (16
  per-tensor FP8 and NVFP4, 32 MXFP8, 128 Float8 block), which is exact:
  zeros add nothing to a product and change no amax. Group spans of any
  length work (grouped_dense lays wgrad's operands out in aligned spans).
* Stochastic rounding (NVFP4's gradients) needs ``key=``, a PRNG key that
  changes every step; the module classes draw it from the "quantize" RNG
  stream.
* Stateful recipes (delayed scaling) keep an amax history per call site,
  which a function has nowhere to keep: ``ragged_dot`` raises unless
  ``state=`` is given (``te_jax.core.grouped_dense.init_state(quantizers, g)``;
  its update after forward and backward is its gradient, applied with
  ``te_jax.train.apply_fp8_update``, as for every functional op). The layers
  ``te_jax.flax.RaggedDot`` and ``te_jax.nnx.RaggedDot`` keep it for you.
* ``group_offset`` is refused everywhere with a clear error (``jax.lax.ragged_dot``
  in jax 0.10 fails on any array there). ``out_sharding`` is lax's without a
  recipe; under one the result is resharded to it (``jax.sharding.reshard``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.core.bundles import (BACKWARD_FIELDS, FORWARD_FIELDS, HIGH_PRECISION, DenseQuantizers, as_quantizers,
                                 rounds_stochastically, scaling_mode_of)
from te_jax.core.bundles import ROLE_OF
from te_jax.core.grouped_dense import grouped_dense
from te_jax.core.grouped_tiles import pad_axis
from te_jax.ops.grouped.gemm import GROUP_ALIGN
from te_jax.ops.sharding import MeshResource
from te_jax.recipe.autocast import current_recipe

__all__ = ["pad_multiple", "quantizers_for", "ragged_dot", "ragged_dot_with_state"]

_WHERE = "ragged_dot"
_LAYERS = "te_jax.flax.RaggedDot (Linen) or te_jax.nnx.RaggedDot(num_groups) (NNX)"


def quantizers_for(path: str | Sequence[str] = ()) -> DenseQuantizers:
    """The active autocast recipe's quantizers for a ragged dot at module ``path`` (none outside autocast)."""
    path = tuple(p for p in path.split("/") if p) if isinstance(path, str) else tuple(str(p) for p in path)
    return DenseQuantizers.from_recipe(current_recipe(), path)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
    group_offset: jax.Array | None = None,
    out_sharding=None,
    *,
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    path: str | Sequence[str] = (),
    mesh_resource: MeshResource | None = None,
) -> jax.Array:
    """``jax.lax.ragged_dot``, with its GEMMs quantized under ``te_jax.autocast(recipe=...)``.

    Args:
      lhs: ``[m, k]``, rows sorted by group.
      rhs: ``[g, k, n]``, one matrix per group.
      group_sizes: ``[g]`` integer (any integer dtype), the rows of each group in order; rows past the sum give
        zeros, groups reaching past ``m`` are cut there (as lax does). Sizes are meant to be >= 0 (with a
        negative one lax's groups overlap; under a recipe no rows overlap: a group ends at its cumulative size
        but never before the furthest end of the groups before it).
      precision: as for ``jax.lax.ragged_dot``; unquantized path only.
      preferred_element_type: the output dtype, as for ``jax.lax.ragged_dot``.
      group_offset: must be None (refused with a clear error; see the module docstring).
      out_sharding: as for ``jax.lax.ragged_dot``; under a recipe the result is resharded to it.
      quantizers: the quantizers to use (a ``DenseQuantizers`` or ``{role: quantizer}``), overriding the
        autocast's recipe; None: the recipe's for ``path`` (none outside autocast).
      state: the state of stateful quantizers (delayed scaling): ``init_state(quantizers, g)`` of
        ``te_jax.core.grouped_dense``, differentiated inside ``te_jax.train.fp8_state_updates()``.
      key: PRNG key for stochastic rounding (NVFP4 gradients); required when a quantizer rounds stochastically.
      path: the module path the recipe's roles carry (``te_jax.recipe.Role.path``), for per-layer recipes.
      mesh_resource: mesh axes amaxes are reduced over; None takes the active autocast's.

    Returns:
      ``[m, n]`` in lax's output dtype. Without a quantizer: exactly ``jax.lax.ragged_dot(lhs, rhs,
      group_sizes, precision, preferred_element_type, out_sharding=out_sharding)``.

    Raises:
      ValueError: group_offset given; under a stateful recipe without ``state`` (use the layers named in the
        message); a stochastic-rounding quantizer without ``key``.
    """
    q = quantizers_for(path) if quantizers is None else as_quantizers(quantizers)
    if q.any:
        _check_function_call(q, state, key)
    y, _ = ragged_dot_with_state(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                                 out_sharding, quantizers=q, state=state, key=key, mesh_resource=mesh_resource)
    return y


def _check_function_call(q: DenseQuantizers, state, key) -> None:
    """What a plain function call needs under quantizers: state for stateful roles, and a key for every stochastic
    role (forward and backward: a function has no other place to get one)."""
    stateful = sorted(q.stateful())
    if stateful and state is None:
        raise ValueError(
            f"te_jax: {_WHERE}: the recipe keeps state for {stateful} (delayed scaling: an amax history per "
            f"call site and expert), which a plain function has nowhere to keep between steps. Use {_LAYERS} as "
            "your MoE layer's ragged_dot: they keep it in \"fp8_meta\" / FP8Meta and te_jax.train.value_and_grad / "
            "te_jax.nnx.value_and_grad step it; or pass quantizers=... and state=te_jax.core.grouped_dense."
            "init_state(quantizers, num_groups) and apply the state's gradient with te_jax.train.apply_fp8_update; "
            "or use a stateless recipe (Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, "
            "NVFP4BlockScaling)")
    needy = [ROLE_OF[f] for f in FORWARD_FIELDS + BACKWARD_FIELDS if rounds_stochastically(getattr(q, f))]
    if needy and key is None:
        raise ValueError(
            f"te_jax: {_WHERE}: the quantizers of {needy} round stochastically and need key=<a PRNG key that "
            "changes every step>, e.g. te_jax.ragged_dot(..., key=jax.random.fold_in(key, step)); the layers "
            f"{_LAYERS} draw it from the \"quantize\" RNG stream; or disable it, e.g. "
            "NVFP4BlockScaling(disable_stochastic_rounding=True)")


def ragged_dot_with_state(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
    group_offset: jax.Array | None = None,
    out_sharding=None,
    *,
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    inspect=False,
    where: str = _WHERE,
) -> tuple[jax.Array, dict[str, Any] | None]:
    """``ragged_dot`` with explicit quantizers, in the functional ops' form: ``(y, new_state)``.

    What the layers run (``call_op`` / ``run_op`` bind every argument but ``state``, ``key`` and ``inspect``).
    No quantizer: ``jax.lax.ragged_dot`` exactly, ``state`` returned as given. Otherwise
    ``te_jax.grouped_dense`` on the padded operands; ``new_state`` is the forward-updated state (the weight's
    with the leading ``g`` axis) and the state after forward and backward is the gradient of ``state``.
    Keys are checked as ``grouped_dense`` checks them (forward roles now, gradient roles when the backward is
    traced). ``where`` names the caller in errors.
    """
    if group_offset is not None:
        raise ValueError(
            f"te_jax: {where}: group_offset is not supported: pass group_offset=None (jax.lax.ragged_dot in jax 0.10 "
            "fails on any array there too). To compute some groups only, compute them all and zero the rows of the "
            "others in the result")
    q = as_quantizers(quantizers)
    if not q.any:
        y = lax.ragged_dot(lhs, rhs, group_sizes, precision=precision, preferred_element_type=preferred_element_type,
                           out_sharding=out_sharding)
        return y, None if state is None else dict(state)
    if inspect:
        raise ValueError(f"te_jax: {where}: inspect=True (quantization statistics) does not cover ragged_dot yet; "
                         "inspect the other layers with a CustomRecipe that leaves this path unquantized")
    out = jax.eval_shape(lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=preferred_element_type,
                                                        out_sharding=out_sharding),
                         lhs, rhs, group_sizes)  # lax's own shape and dtype checks, and its output dtype
    _check_quantizable(lhs, rhs, where)
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    if 0 in (m, k, n, g):  # nothing to multiply: zeros (or nothing), exactly as lax gives them
        y = lax.ragged_dot(lhs, rhs, group_sizes, precision=precision, preferred_element_type=preferred_element_type,
                           out_sharding=out_sharding)
        return y, None if state is None else dict(state)
    sizes = _cut(group_sizes, m)
    multiple = pad_multiple(q)
    x, w = pad_axis(_widened(lhs, rhs, out.dtype), 1, multiple), pad_axis(pad_axis(rhs, 1, multiple), 2, multiple)
    try:
        y, new_state = grouped_dense(x, w, sizes, quantizers=q, state=state, key=key, mesh_resource=mesh_resource)
    except ValueError as err:  # grouped_dense's checks, named as this op (its subclasses pass as they are)
        if type(err) is not ValueError:
            raise
        raise ValueError(str(err).replace("te_jax: grouped_dense", f"te_jax: {where}", 1)) from None
    y = y[:, :n].astype(out.dtype)
    return (y if out_sharding is None else jax.sharding.reshard(y, out_sharding)), new_state


def _check_quantizable(lhs, rhs, where: str) -> None:
    """The quantized path takes ``[m, k] x [g, k, n]`` float32/bfloat16/float16 operands."""
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if jnp.dtype(a.dtype) not in HIGH_PRECISION:
            raise TypeError(f"te_jax: {where}: under a recipe {name} must be float32, bfloat16 or float16, got "
                            f"{a.dtype}; cast it, or call it outside te_jax.autocast")
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"te_jax: {where}: lhs must be [m, k] and rhs [g, k, n], got {lhs.shape} and {rhs.shape}")


def _cut(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 sizes whose groups end at ``rows`` at the latest (lax cuts a group reaching past the rows).

    The group ends are kept in ``[0, rows]`` and non-decreasing, so every size is >= 0 and the kernels stay in
    bounds whatever the sizes hold (a negative size, which makes lax's groups overlap, gives an empty group).
    """
    ends = lax.cummax(jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, rows))
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def _widened(lhs: jax.Array, rhs: jax.Array, out_dtype) -> jax.Array:
    """``lhs`` cast up (exactly) when the output dtype is a wider float than the operands' product, so the grouped
    GEMM writes its float32 accumulation in that dtype rather than rounding it to the operands' first."""
    compute = jnp.result_type(lhs.dtype, rhs.dtype)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype != compute and out_dtype in HIGH_PRECISION and jnp.promote_types(compute, out_dtype) == out_dtype:
        return lhs.astype(out_dtype)
    return lhs


def pad_multiple(q: DenseQuantizers) -> int:
    """What K and N are padded to a multiple of under ``q``: each quantized mode's group alignment (the row
    alignment of its grouped kernels, a multiple of its block and of the CUDA kernels' K and N tiles)."""
    modes = (scaling_mode_of(getattr(q, f)) for f in ("input", "weight", "grad_output"))
    return math.lcm(1, *(GROUP_ALIGN[mode.family] for mode in modes if mode is not None))
