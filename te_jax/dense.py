"""``dense``: ``y = x @ W + b`` with the forward, dgrad and wgrad GEMMs quantized.

The functional core the Flax layers are built on. It takes the quantizers
and their state explicitly and returns the new state::

    q = DenseQuantizers.from_recipe(recipe)            # one quantizer per role
    state = q.init_state()                              # {} unless a quantizer keeps state
    y, state = dense(x, kernel, bias, quantizers=q, state=state)

GEMMs (``te_jax.ops.gemm.gemm``, one quantization per tensor; the columnwise
copies come from the same quantize call as the rowwise ones)::

    forward  y  = x  (rowwise, linear_input)        @ W  (columnwise, linear_weight)
    dgrad    dx = dy (rowwise, linear_grad_output)  @ W^T (rowwise)
    wgrad    dW = x^T (columnwise)                  @ dy (columnwise)

A quantizer for "linear_output" quantizes then dequantizes ``y`` (after the
bias), one for "linear_grad_input" does the same to ``dx``; gradients pass
straight through those. A role whose quantizer is None stays in high
precision (the GEMM then dequantizes the other operand); with no quantizer at
all this is ``lax.dot_general`` plus bias, exactly what flax.linen computes.

State. ``state`` maps each role whose quantizer is stateful (delayed scaling)
to its state. The returned state is the forward-updated one (input, weight
and output amaxes recorded). The state after forward *and* backward comes
back as the gradient of ``state``: ``te_jax.train.value_and_grad`` returns
it and ``te_jax.state.apply_fp8_update`` (or ``te_jax.train.TrainState``)
applies it; see ``te_jax.quantize.delayed`` for its max-mergeable form.
Stateful amaxes are reduced across devices (``te_jax.sharding.reduce_amax``)
before the state is updated.

Statistics. With ``inspect=True`` (static; Flax layers take it from
``te_jax.autocast(..., inspect=True)``) every quantized tensor's statistics
(``te_jax.inspect.stats``) are computed from the copies already made: the
forward ones are a third output, and all of them, forward and backward, are
the gradient of the ``stats`` input, as the state update is that of ``state``.
Off, nothing of it is traced.

Randomness. Stochastic rounding (NVFP4 gradients) needs ``key``, a PRNG key
that must change every step (e.g. ``jax.random.fold_in(key, step)``); each
role draws from ``jax.random.fold_in(key, ROLES.index(role))``. Flax layers
take it from the "quantize" RNG stream (``te_jax.state.QUANTIZE_RNG``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_jax.autocast import current as current_autocast
from te_jax.autocast import with_plan_mesh
from te_jax.inspect.stats import Sample, as_sample, primary_copy, stats_cotangent, stats_input, stats_leaves, tensor_stats
from te_jax.ops.gemm import gemm
from te_jax.quantize.delayed import as_float32
from te_jax.recipe import ROLES, Recipe, Role
from te_jax.sharding import MeshResource, match_cotangent, reduce_amax, to_varying, varying_axes

QUANTIZED = "te_jax_quantized"  # checkpoint name of every forward quantized copy (inputs, weights, activations)

_FIELDS = ("input", "weight", "output", "grad_output", "grad_input")
_ROLE_OF = dict(zip(_FIELDS, ROLES))


@dataclasses.dataclass(frozen=True)
class DenseQuantizers:
    """The quantizer of each tensor of one dense layer (None: high precision).

    Attributes:
      input, weight, output, grad_output, grad_input: the quantizers for the
        roles "linear_input", "linear_weight", "linear_output",
        "linear_grad_output", "linear_grad_input".
      fast_accum: the forward GEMM's FP8 fast accumulation (the recipe's
        ``fast_accumulation``); None: the GEMM mode's default (True for
        per-tensor FP8; the block modes have none).
      backward_fast_accum: the same for the two backward GEMMs (the recipe's
        ``backward_fast_accumulation``; default: split accumulation).
    """

    input: Any = None
    weight: Any = None
    output: Any = None
    grad_output: Any = None
    grad_input: Any = None
    fast_accum: bool | None = None
    backward_fast_accum: bool = False

    @classmethod
    def from_recipe(cls, recipe: Recipe | None, path: tuple[str, ...] | str = ()) -> DenseQuantizers:
        """Asks ``recipe`` for each role, passing the layer's module ``path`` in the Role."""
        if recipe is None:
            return cls()
        return cls(**{f: recipe.quantizer(Role(r, path)) for f, r in _ROLE_OF.items()},
                   fast_accum=recipe.fast_accumulation,
                   backward_fast_accum=recipe.backward_fast_accumulation)

    @classmethod
    def from_mapping(cls, quantizers: Mapping[str, Any]) -> DenseQuantizers:
        unknown = set(map(str, quantizers)) - set(ROLES)
        if unknown:
            raise ValueError(f"te_jax: unknown roles {sorted(unknown)}; roles are {ROLES}")
        return cls(**{f: quantizers.get(r) for f, r in _ROLE_OF.items()})

    def by_role(self) -> dict[str, Any]:
        return {r: getattr(self, f) for f, r in _ROLE_OF.items()}

    @property
    def any(self) -> bool:
        return any(q is not None for q in self.by_role().values())

    def quantized_roles(self) -> tuple[str, ...]:
        """The roles that have a quantizer."""
        return tuple(r for r, q in self.by_role().items() if q is not None)

    def stateful(self) -> dict[str, Any]:
        """The roles whose quantizer keeps state, with that quantizer."""
        return {r: q for r, q in self.by_role().items() if q is not None and hasattr(q, "init_state")}

    def init_state(self) -> dict[str, Any]:
        """Initial state for every stateful role ({} for stateless recipes)."""
        return {r: q.init_state() for r, q in self.stateful().items()}


def as_quantizers(quantizers) -> DenseQuantizers:
    if quantizers is None:
        return DenseQuantizers()
    if isinstance(quantizers, DenseQuantizers):
        return quantizers
    if isinstance(quantizers, Mapping):
        return DenseQuantizers.from_mapping(quantizers)
    raise TypeError(f"te_jax: quantizers must be a DenseQuantizers, a mapping role -> quantizer, or None; "
                    f"got {type(quantizers).__name__}")


def _axes(dims, ndim: int, what: str) -> tuple[int, ...]:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    out = tuple(d % ndim for d in dims if -ndim <= d < ndim)
    if len(out) != len(dims) or len(set(out)) != len(out):
        raise ValueError(f"te_jax: dense: {what} contracting dims {dims} are not distinct axes of a rank-{ndim} array")
    return out


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    contracting_dims=((-1,), (0,)),
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    precision=None,
    inspect: bool | Sample = False,
    stats: Mapping[str, Any] | None = None,
) -> tuple:
    """``lax.dot_general(x, kernel, contracting_dims) + bias`` with quantized GEMMs.

    Args:
      x: the input, float32/bfloat16/float16.
      kernel: the weight; the output is x's free axes then kernel's free axes.
      bias: shaped like kernel's free axes, or None.
      contracting_dims: ``((x axes), (kernel axes))``, paired in order.
      quantizers: ``DenseQuantizers`` or a mapping role -> quantizer; None
        computes in high precision.
      state: role -> state for the stateful quantizers (``quantizers.init_state()``);
        other entries are returned unchanged.
      key: PRNG key for stochastic rounding; required when a quantizer uses it.
      mesh_resource: mesh axes amaxes are reduced over inside shard_map;
        None takes the active autocast's (and without one, every manual axis).
      precision: ``lax.dot_general`` precision of the high-precision path.
      inspect: also compute the statistics of every quantized tensor
        (``te_jax.inspect``): True for every row, a ``te_jax.inspect.Sample``
        for every k-th row of activations and gradients; a static choice,
        off by default (then nothing of it is traced).
      stats: with ``inspect``, the statistics input ``{role: {stat: f32[]}}``
        (``te_jax.inspect.zeros(quantizers.quantized_roles())``, the default).
        Its value is never read: its gradient is the statistics of every role,
        forward and backward, as the state update is the gradient of ``state``.

    Returns:
      ``(y, new_state)``: new_state is the forward-updated ``state`` (float32).
      With ``inspect``, ``(y, new_state, forward statistics)``.
    """
    q = as_quantizers(quantizers)
    inspect = as_sample(inspect)
    x_c = _axes(contracting_dims[0], x.ndim, "x")
    k_c = _axes(contracting_dims[1], kernel.ndim, "kernel")
    if len(x_c) != len(k_c) or any(x.shape[i] != kernel.shape[j] for i, j in zip(x_c, k_c)):
        raise ValueError(f"te_jax: dense: contracting dims {contracting_dims} pair axes of different sizes: "
                         f"x {x.shape}, kernel {kernel.shape}")
    k_free_shape = tuple(d for i, d in enumerate(kernel.shape) if i not in k_c)
    if bias is not None and tuple(bias.shape) != k_free_shape:
        raise ValueError(f"te_jax: dense: bias must have kernel's free shape {k_free_shape}, got {bias.shape}")
    if not q.any:
        y = lax.dot_general(x, kernel, ((x_c, k_c), ((), ())), precision=precision)
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)
        return (y, (None if state is None else dict(state))) + (({},) if inspect else ())

    stateful = q.stateful()
    state = dict(state or {})
    missing = [r for r in stateful if r not in state]
    if missing:
        raise ValueError(f"te_jax: dense: no state for the stateful quantizers of {missing}; pass "
                         "state=quantizers.init_state() (Flax layers: init the model under te_jax.autocast)")
    for r, qr in stateful.items():
        if hasattr(qr, "check_state"):
            qr.check_state(state[r])
    if key is None:
        _check_key(q, ("input", "weight", "output"))
    elif jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)

    # Contracting axes last on x, first on the kernel: flatten_axis then splits them off.
    x_free = tuple(i for i in range(x.ndim) if i not in x_c)
    k_free = tuple(i for i in range(kernel.ndim) if i not in k_c)
    x2 = jnp.transpose(x, x_free + x_c) if x_free + x_c != tuple(range(x.ndim)) else x
    k2 = jnp.transpose(kernel, k_c + k_free) if k_c + k_free != tuple(range(kernel.ndim)) else kernel
    if mesh_resource is None:
        mesh_resource = current_autocast().mesh_resource
    inner = {r: dict(state[r]) for r in stateful}
    leaves = tuple((r, n, v.dtype, varying_axes(v)) for r in sorted(inner) for n, v in sorted(inner[r].items()))
    vary = (varying_axes(x), varying_axes(kernel), frozenset() if bias is None else varying_axes(bias))
    qstats = stats_input(q.quantized_roles(), stats) if inspect else None
    plan = _Plan(q, len(x_free), len(x_c), len(k_free), mesh_resource, x.dtype, kernel.dtype,
                 None if bias is None else bias.dtype, leaves, vary, inspect, stats_leaves(qstats))
    y, new_inner, fwd_stats = _dense_vjp(plan, x2, k2, bias, inner, key, qstats)
    return (y, {**state, **new_inner}) + ((fwd_stats,) if inspect else ())


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one dense call."""

    q: DenseQuantizers
    nb: int  # x's free (batch) axes
    nk: int  # contracting axes
    nn: int  # kernel's free (output) axes
    mesh_resource: MeshResource | None
    x_dtype: Any
    k_dtype: Any
    bias_dtype: Any  # None: no bias
    state_leaves: tuple  # ((role, leaf name, dtype, varying axes), ...) of the incoming state
    vary: tuple  # varying axes (shard_map) of x, kernel, bias
    inspect: Sample | None = None  # record statistics (te_jax.inspect), reading these rows
    stats_leaves: tuple = ()  # as state_leaves, of the statistics input

    @property
    def all_vary(self) -> frozenset[str]:
        return frozenset().union(*self.vary)


def _check_key(q: DenseQuantizers, fields) -> None:
    needy = [_ROLE_OF[f] for f in fields if getattr(getattr(q, f), "stochastic_rounding", False)]
    if needy:
        raise ValueError(
            f"te_jax: dense: the quantizers of {needy} round stochastically and need key=<a PRNG key that "
            "changes every step> (Flax layers: apply with rngs={'quantize': key}); or disable it, e.g. "
            "NVFP4BlockScaling(disable_stochastic_rounding=True)"
        )


def _role_key(key, role: str):
    return None if key is None else jax.random.fold_in(key, ROLES.index(role))


def name_quantized(t):
    """``checkpoint_name(t, QUANTIZED)``, with FP8 leaves named as their uint8 bits.

    Remat inserts ``reduce_precision(x, **finfo(x.dtype))`` on saved float
    residuals, which for float8_e4m3fn follows IEEE rules and turns every value
    of magnitude >= 256 into NaN (jax 0.10). The bits saved as uint8 are left alone.
    """

    def one(v):
        if v is None or not (jnp.issubdtype(v.dtype, jnp.floating) and jnp.dtype(v.dtype).itemsize == 1):
            return checkpoint_name(v, QUANTIZED)
        bits = checkpoint_name(lax.bitcast_convert_type(v, jnp.uint8), QUANTIZED)
        return lax.bitcast_convert_type(bits, v.dtype)

    return jax.tree.map(one, t)


def _quantize(plan: _Plan, role: str, x, state, key, *, rowwise=True, colwise=False, flatten_axis, stats=None):
    """(ScaledTensor, forward-updated state, state gradient); the states are None when stateless.

    ``stats``: a dict that receives the tensor's statistics under ``role`` (None: not inspecting).
    """
    qz = plan.q.by_role()[role]
    t = qz.quantize(x, state, rowwise=rowwise, colwise=colwise, flatten_axis=flatten_axis, key=_role_key(key, role))
    t = name_quantized(t)  # before the state update reads its amax, so remat can save rather than recompute it
    if stats is not None:
        stats[role] = tensor_stats(x, t, primary_copy(role), plan.inspect)
    if state is None:
        return t, None, None
    if t.amax is None:
        raise ValueError(f"te_jax: the stateful quantizer of {role} returned a ScaledTensor without amax")
    amax = t.amax
    if getattr(qz, "reduce_amax", False):
        amax = reduce_amax(amax, getattr(qz, "amax_reduction", "max"), plan.mesh_resource)
    new = qz.update_state(state, amax)
    grad = qz.state_gradient(state, amax) if hasattr(qz, "state_gradient") else new
    return t, new, grad


def _qdq(plan: _Plan, role: str, y, state, key, flatten_axis, stats=None):
    """Quantize, then dequantize, a GEMM output (linear_output, linear_grad_input)."""
    t, new, grad = _quantize(plan, role, y, state, key, flatten_axis=flatten_axis, stats=stats)
    return t.dequantize(y.dtype), new, grad


def _either(quantized, x):
    return x if quantized is None else quantized


def _forward(plan: _Plan, x, kernel, bias, state, key):
    q, r = plan.q, ROLES
    st = {k: as_float32(v) for k, v in state.items()}
    new, grads = {}, {}
    stats = {} if plan.inspect else None
    xq = kq = None
    if q.input is not None:
        xq, new[r[0]], grads[r[0]] = _quantize(plan, r[0], x, st.get(r[0]), key, colwise=True, flatten_axis=plan.nb,
                                               stats=stats)
    if q.weight is not None:
        kq, new[r[1]], grads[r[1]] = _quantize(plan, r[1], kernel, st.get(r[1]), key, colwise=True,
                                               flatten_axis=plan.nk, stats=stats)
    dims = (tuple(range(plan.nb, plan.nb + plan.nk)), tuple(range(plan.nk)))
    y = gemm(_either(xq, x), _either(kq, kernel), dims, out_dtype=jnp.result_type(x.dtype, kernel.dtype), bias=bias,
             fast_accum=q.fast_accum)
    if q.output is not None:
        y, new[r[2]], grads[r[2]] = _qdq(plan, r[2], y, st.get(r[2]), key, plan.nb, stats)
    y = to_varying(y, plan.all_vary)  # custom calls drop shard_map's varying-axes types
    new_state = {k: (new[k] if new.get(k) is not None else v) for k, v in st.items()}
    # Keep only the copies the backward GEMMs read: x columnwise (wgrad), W rowwise (dgrad).
    x_res = x if xq is None else dataclasses.replace(xq, data=None, scale_inv=None)
    k_res = kernel if kq is None else dataclasses.replace(kq, colwise_data=None, colwise_scale_inv=None)
    fwd_grads = {k: v for k, v in grads.items() if v is not None}
    return y, new_state, stats, (x_res, k_res, st, fwd_grads, key, stats)


# The statistics input ``qstats`` is never read: its cotangent carries the statistics out of backward.
def _dense_primal(plan, x, kernel, bias, state, key, qstats):
    y, new_state, stats, _ = _forward(plan, x, kernel, bias, state, key)
    return y, new_state, stats


def _dense_fwd(plan, x, kernel, bias, state, key, qstats):
    y, new_state, stats, res = _forward(plan, x, kernel, bias, state, key)
    return (y, new_state, stats), res


def _dense_bwd(plan, res, cotangents):
    x_res, k_res, st, grads, key, fwd_stats = res
    dy = cotangents[0]
    q, r = plan.q, ROLES
    if key is None:
        _check_key(q, ("grad_output", "grad_input"))
    grads = dict(grads)
    dyq = None
    stats = dict(fwd_stats) if plan.inspect else None
    if q.grad_output is not None:
        dyq, _, grads[r[3]] = _quantize(plan, r[3], dy, st.get(r[3]), key, colwise=True, flatten_axis=plan.nb,
                                        stats=stats)
    dy_n = tuple(range(plan.nb, plan.nb + plan.nn))
    k_n = tuple(range(plan.nk, plan.nk + plan.nn))
    # Backward GEMMs split their accumulation unless the recipe asks otherwise (more exact gradients).
    dx = gemm(_either(dyq, dy), k_res, (dy_n, k_n), out_dtype=plan.x_dtype, fast_accum=q.backward_fast_accum)
    if q.grad_input is not None:
        dx, _, grads[r[4]] = _qdq(plan, r[4], dx, st.get(r[4]), key, plan.nb, stats)
    batch = tuple(range(plan.nb))
    dk = gemm(x_res, _either(dyq, dy), (batch, batch), out_dtype=plan.k_dtype, fast_accum=q.backward_fast_accum)
    dbias = None
    if plan.bias_dtype is not None:
        dbias = jnp.sum(dy.astype(jnp.float32), axis=batch).astype(plan.bias_dtype)
    # In shard_map: reduce over the axes an input does not vary over, as JAX's own transposes do.
    u = plan.all_vary
    dx, dk = match_cotangent(dx, u, plan.vary[0]), match_cotangent(dk, u, plan.vary[1])
    dbias = None if dbias is None else match_cotangent(dbias, u, plan.vary[2])
    dstate = {role: {} for role in st}
    for role, name, dtype, vary in plan.state_leaves:
        g = match_cotangent(grads[role][name], u, vary, "max")  # identical where amaxes were reduced
        dstate[role][name] = lax.convert_element_type(g, dtype)
    return dx, dk, dbias, dstate, None, stats_cotangent(plan.stats_leaves, stats, u)


_dense_vjp = jax.custom_vjp(_dense_primal, nondiff_argnums=(0,))
_dense_vjp.defvjp(_dense_fwd, with_plan_mesh(_dense_bwd))
