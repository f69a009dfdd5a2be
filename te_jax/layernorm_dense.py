"""``layernorm_dense``: ``y = norm(x) @ W + b`` with the norm fused into the input's quantization.

The functional core of ``te_jax.flax.LayerNormDenseGeneral`` (and, with
``norm_type=None``, of attention output projections). Like ``te_jax.dense``
it takes the quantizers and their state explicitly and returns the new state::

    q = DenseQuantizers.from_recipe(recipe)
    y, state = layernorm_dense(x, gamma, beta, kernel, bias, quantizers=q, state=q.init_state())

Kernels and GEMMs (``x`` viewed as ``[M, H]``, ``W`` as ``[H, N]``)::

    forward  ln, mean, rsigma = te_jax_norm_fwd(x)   ln written rowwise + columnwise by the "linear_input"
                                                     quantizer inside the norm kernel (no bf16 ln in HBM)
             y  = ln (rowwise)  @ W (columnwise, "linear_weight") + b
    dgrad    dln = dy (rowwise, "linear_grad_output") @ W^T (rowwise)
             dx, dgamma, dbeta = te_jax_norm_bwd(dln)
    wgrad    dW = ln^T (columnwise) @ dy (columnwise)

"linear_output" / "linear_grad_input" quantizers quantize-dequantize ``y`` /
``dln`` as in ``te_jax.dense``; a role whose quantizer is None stays in high
precision. Without any quantizer this is ``normalize(x) @ W + b`` on plain
autodiff, which is what flax.linen's LayerNorm followed by DenseGeneral computes.

State, keys and the state update carried as the gradient of ``state`` work
exactly as in ``te_jax.dense``. When nothing is differentiated (inference),
only the copies the forward GEMM reads are written.

Rematerialization. Every forward quantized copy is named
``checkpoint_name(..., QUANTIZED)`` and the norm statistics ``NORM_STATS``,
so ``save_fp8_policy`` (``jax.checkpoint`` / ``nn.remat`` policy) keeps the
FP8 copies and recomputes only GEMMs and elementwise work in backward, never a
cast (``fp8_checkpoint_policy(PRE_ACTIVATION)`` also keeps an MLP's first GEMM
output). FP8 leaves are named as their uint8 bits: see ``name_quantized``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_jax.autocast import current as current_autocast
from te_jax.autocast import with_plan_mesh
from te_jax.dense import QUANTIZED, DenseQuantizers, as_quantizers, name_quantized
from te_jax.inspect.stats import Sample, as_sample, primary_copy, stats_cotangent, stats_input, stats_leaves, tensor_stats
from te_jax.ops import norm as norm_ops
from te_jax.ops.gemm import gemm
from te_jax.quantize.delayed import as_float32
from te_jax.quantize.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_jax.quantize.scaled_tensor import ScaledTensor
from te_jax.recipe import ROLES
from te_jax.sharding import MeshResource, match_cotangent, reduce_amax, to_varying, varying_axes
from te_jax.state_grad import check_state_update_applied

NORM_TYPES = ("layernorm", "rmsnorm")
NORM_STATS = "te_jax_norm_stats"  # checkpoint name of the norm's mean and rsigma
PRE_ACTIVATION = "te_jax_pre_activation"  # checkpoint name of an MLP's first GEMM output
_FIELDS = ("input", "weight", "output", "grad_output", "grad_input")
_ROLE_OF = dict(zip(_FIELDS, ROLES))


def fp8_checkpoint_policy(*extra_names: str):
    """A remat policy that saves the FP8 copies and norm statistics (plus ``extra_names``)."""
    return jax.checkpoint_policies.save_only_these_names(QUANTIZED, NORM_STATS, *extra_names)


save_fp8_policy = fp8_checkpoint_policy()


# ---- shared by the fused cores (layernorm_dense, layernorm_mlp) ---------------------------


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """The norm in front of a GEMM: kind "layernorm" | "rmsnorm", zero-centred gamma, epsilon."""

    kind: str
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6


def as_norm(norm_type: str | None, zero_centered_gamma: bool, epsilon: float, gamma, beta, where: str):
    """Validates the norm arguments; None when ``norm_type`` is None."""
    if norm_type is None:
        if gamma is not None or beta is not None:
            raise ValueError(f"te_jax: {where}: norm_type=None takes no gamma/beta")
        return None
    if norm_type not in NORM_TYPES:
        raise ValueError(f"te_jax: {where}: norm_type must be one of {NORM_TYPES} or None, got {norm_type!r}")
    if gamma is None:
        raise ValueError(f"te_jax: {where}: a {norm_type} needs gamma (pass ones for no scale)")
    if beta is not None and norm_type == "rmsnorm":
        raise ValueError(f"te_jax: {where}: rmsnorm has no beta; pass beta=None")
    return NormSpec(norm_type, bool(zero_centered_gamma), float(epsilon))


def check_state(q: DenseQuantizers, state: Mapping | None, where: str) -> dict[str, Any]:
    """The states of ``q``'s stateful roles, checked (missing ones raise a clear error)."""
    stateful, state = q.stateful(), dict(state or {})
    missing = [r for r in stateful if r not in state]
    if missing:
        raise ValueError(f"te_jax: {where}: no state for the stateful quantizers of {missing}; pass "
                         "state=quantizers.init_state() (Flax layers: init the model under te_jax.autocast)")
    for r, qr in stateful.items():
        if hasattr(qr, "check_state"):
            qr.check_state(state[r])
    return {r: dict(state[r]) for r in stateful}


def check_key(q: DenseQuantizers, fields, where: str) -> None:
    needy = [_ROLE_OF[f] for f in fields if getattr(getattr(q, f), "stochastic_rounding", False)]
    if needy:
        raise ValueError(
            f"te_jax: {where}: the quantizers of {needy} round stochastically and need key=<a PRNG key that "
            "changes every step> (Flax layers: apply with rngs={'quantize': key}); or disable it, e.g. "
            "NVFP4BlockScaling(disable_stochastic_rounding=True)")


def raw_key(key):
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def _block_of(q) -> tuple[int, str] | None:
    if isinstance(q, MXFP8Quantizer):
        return 32, "MXFP8"
    if isinstance(q, Float8BlockQuantizer):
        return 128, "Float8 block scaling"
    if isinstance(q, NVFP4Quantizer):
        return 16, "NVFP4"
    return None


def check_blocks(q: DenseQuantizers, m: int, k: int, n: int, where: str) -> None:
    """Raises a clear error when the recipe's blocks do not tile a GEMM ``[m, k] x [k, n]``.

    Inputs, weights and output gradients are quantized rowwise and columnwise
    (forward, dgrad and wgrad each read one copy), so both axes of each must be
    multiples of the block size.
    """
    dims = {"input": (("tokens (the batch axes' product)", m), ("input features", k)),
            "weight": (("input features", k), ("output features", n)),
            "grad_output": (("tokens (the batch axes' product)", m), ("output features", n))}
    for field, axes in dims.items():
        block = _block_of(getattr(q, field))
        if block is None:
            continue
        size, mode = block
        for name, value in axes:
            if value % size:
                raise ValueError(
                    f"te_jax: {where}: {mode} quantizes the {_ROLE_OF[field]} tensor "
                    f"[{axes[0][1]}, {axes[1][1]}] in blocks of {size} along both axes, but its {name} ({value}) "
                    f"is not a multiple of {size}. Pad that axis, or give this layer a per-tensor recipe "
                    "(DelayedScaling, Float8CurrentScaling).")


class GemmQuant:
    """The quantizers of one GEMM inside a custom VJP, recording the state of stateful roles.

    Args:
      q: the GEMM's quantizers.
      state: role -> state of the stateful roles (float32 or max-merging leaves).
      key: raw PRNG key or None; role r draws from ``fold_in(key, ROLES.index(r))``.
      mesh_resource: the axes amaxes are reduced over.
      inspect: None, or the rows (``te_jax.inspect.Sample``) each quantized
        tensor's statistics read, recorded in ``stats``; None leaves ``stats``
        None and computes nothing.
    """

    def __init__(self, q: DenseQuantizers, state: Mapping, key, mesh_resource: MeshResource | None,
                 inspect: Sample | None = None):
        self.q, self.key, self.mesh_resource = q, key, mesh_resource
        self.st = {r: as_float32(v) for r, v in state.items()}
        self.new: dict[str, Any] = {}
        self.grads: dict[str, Any] = {}
        self.sample = inspect
        self.stats: dict[str, Any] | None = {} if inspect else None

    def has(self, field: str) -> bool:
        return getattr(self.q, field) is not None

    def run(self, field: str, fn: Callable, reference: jax.Array | Callable[[slice], jax.Array] | None = None):
        """``fn(quantizer, state, key) -> (ScaledTensor, *extras)``, recording the amax for stateful roles.

        The ScaledTensor is named ``QUANTIZED`` before anything reads it (the
        state update too), so a remat policy that saves it never reruns ``fn``.
        When inspecting, the statistics compare the quantized tensor with
        ``reference``: the high-precision tensor itself, or, for a fused
        kernel's output, a function that takes a row slice and returns those
        rows of the tensor (float32, ``[M', N]``), recomputed by the pure-JAX
        twin (bit-identical to the fused kernel) for just the rows the
        statistics read, where XLA fuses it into their reductions instead of
        writing and re-reading a float32 copy.
        """
        role, qz = _ROLE_OF[field], getattr(self.q, field)
        key = None if self.key is None else jax.random.fold_in(self.key, ROLES.index(role))
        out = fn(qz, self.st.get(role), key)
        out = (name_quantized(out[0]), *out[1:])
        if self.stats is not None:
            self.stats[role] = tensor_stats(reference, out[0], primary_copy(role), self.sample)
        if role in self.st:
            amax = out[0].amax
            if amax is None:
                raise ValueError(f"te_jax: the stateful quantizer of {role} returned a ScaledTensor without amax")
            if getattr(qz, "reduce_amax", False):
                amax = reduce_amax(amax, getattr(qz, "amax_reduction", "max"), self.mesh_resource)
            self.new[role] = qz.update_state(self.st[role], amax)
            self.grads[role] = qz.state_gradient(self.st[role], amax) if hasattr(qz, "state_gradient") \
                else self.new[role]
        return out

    def quantize(self, field: str, x, *, rowwise=True, colwise=False, flatten_axis=-1):
        """``x`` quantized by the role's quantizer, or ``x`` itself when it has none."""
        if not self.has(field):
            return x
        return self.run(field, lambda qz, st, key: (qz.quantize(x, st, rowwise=rowwise, colwise=colwise,
                                                                flatten_axis=flatten_axis, key=key),),
                        x)[0]

    def qdq(self, field: str, y):
        """Quantize-dequantize of a GEMM output (linear_output, linear_grad_input)."""
        t = self.quantize(field, y)
        return t.dequantize(y.dtype) if isinstance(t, ScaledTensor) else t

    def new_state(self) -> dict[str, Any]:
        return {r: self.new.get(r, v) for r, v in self.st.items()}


def keep(t, copy: str):
    """Only the ``copy`` ("rowwise" or "colwise") of a ScaledTensor, for the residuals."""
    if not isinstance(t, ScaledTensor):
        return t
    if copy == "colwise":
        return dataclasses.replace(t, data=None, scale_inv=None)
    return dataclasses.replace(t, colwise_data=None, colwise_scale_inv=None)


def norm_input(norm: NormSpec | None, g: GemmQuant, x, gamma, beta, dtype, training: bool):
    """The GEMM input ``[M, H]``: ``norm(x)`` written by the "input" quantizer inside the norm kernel.

    Returns ``(ln, (mean, rsigma))``; ln is a ScaledTensor (rowwise, and
    columnwise when ``training``) or, without an input quantizer, an array in ``dtype``.
    """
    if norm is None:
        ln = g.quantize("input", x, rowwise=True, colwise=training) if g.has("input") else x.astype(dtype)
        return ln, (None, None)

    def fn(qz, st, key):
        return norm_ops.norm(x, gamma, beta, qz, st, kind=norm.kind, zero_centered_gamma=norm.zero_centered_gamma,
                             epsilon=norm.epsilon, rowwise=True, colwise=training, key=key, out_dtype=dtype)

    def reference(rows: slice) -> jax.Array:  # a norm is row by row: the rows asked for need only those rows of x
        return norm_ops.norm(x[rows], gamma, beta, kind=norm.kind, zero_centered_gamma=norm.zero_centered_gamma,
                             epsilon=norm.epsilon, out_dtype=jnp.float32, backend="reference")[0]

    ln, mean, rsigma = g.run("input", fn, reference) if g.has("input") else fn(None, None, None)
    return ln, checkpoint_name((mean, rsigma), NORM_STATS)


def norm_backward(norm: NormSpec | None, dln, x, gamma, beta, stats, x_dtype):
    """``(dx, dgamma, dbeta)`` from the gradient of the norm's output (x is None without a norm)."""
    if norm is None:
        return dln.astype(x_dtype), None, None
    mean, rsigma = stats
    dx, dgamma, dbeta = norm_ops.norm_bwd(dln, x, mean, rsigma, gamma, kind=norm.kind,
                                          zero_centered_gamma=norm.zero_centered_gamma)
    return dx, dgamma.astype(gamma.dtype), (None if beta is None else dbeta.astype(beta.dtype))


def check_no_dot_general(where: str, dot_general, quantized: bool) -> None:
    """A custom ``dot_general`` serves the unquantized path only (te_jax's GEMMs replace it under a recipe)."""
    if dot_general is not None and quantized:
        raise ValueError(f"te_jax: {where}: a custom dot_general cannot be combined with quantizers (te_jax's "
                         "quantized GEMMs replace it); drop one of them")


def normalize_hp(norm: NormSpec | None, x, gamma, beta, dtype):
    """High-precision (unquantized, autodiff) norm in ``dtype``; x is widened first when dtype is wider."""
    if norm is None:
        return x.astype(dtype)
    wide = jnp.promote_types(x.dtype, dtype)
    y = norm_ops.normalize(x.astype(wide), gamma, beta, kind=norm.kind,
                           zero_centered_gamma=norm.zero_centered_gamma, epsilon=norm.epsilon)
    return y.astype(dtype)


def state_leaves(states: Mapping[str, Mapping]) -> tuple:
    """Static ``((role, leaf name, dtype, varying axes), ...)`` of the incoming role states."""
    return tuple((r, n, v.dtype, varying_axes(v)) for r in sorted(states) for n, v in sorted(states[r].items()))


def state_cotangent(leaves: tuple, grads: Mapping, all_vary) -> dict[str, dict]:
    """The state updates as the cotangent of the incoming state (its leaf dtypes and varying axes)."""
    out: dict[str, dict] = {}
    check_state_update_applied([role for role, *_ in leaves])
    for role, name, dtype, vary in leaves:
        g = match_cotangent(grads[role][name], all_vary, vary, "max")
        out.setdefault(role, {})[name] = lax.convert_element_type(g, dtype)
    return out


def cotangent(ct, all_vary, vary, like):
    """A parameter cotangent in shard_map's varying-axes type and ``like``'s dtype (None passes)."""
    if ct is None or like is None:
        return None
    return match_cotangent(ct.astype(like.dtype), all_vary, vary)


def vary_of(*xs) -> tuple:
    return tuple(frozenset() if x is None else varying_axes(x) for x in xs)


def check_high_precision(where: str, **arrays) -> None:
    for name, a in arrays.items():
        if a is not None and jnp.dtype(a.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                                         jnp.dtype(jnp.float16)):
            raise TypeError(f"te_jax: {where}: {name} must be float32, bfloat16 or float16, got {a.dtype}")


# ---- layernorm_dense ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    q: DenseQuantizers
    norm: NormSpec | None
    mesh_resource: MeshResource | None
    leaves: tuple  # state_leaves of the incoming state
    vary: tuple  # varying axes of x, gamma, beta, kernel, bias
    dtype: Any  # the kernel's dtype: the compute and output dtype
    x_dtype: Any
    bias_dtype: Any  # None: no bias
    inspect: Sample | None = None  # record statistics (te_jax.inspect), reading these rows
    stats_leaves: tuple = ()  # state_leaves of the statistics input

    @property
    def all_vary(self):
        return frozenset().union(*self.vary)


def layernorm_dense(
    x: jax.Array,
    gamma: jax.Array | None,
    beta: jax.Array | None,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    norm_type: str | None = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    quantizers: DenseQuantizers | Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    key: jax.Array | None = None,
    mesh_resource: MeshResource | None = None,
    precision=None,
    inspect: bool | Sample = False,
    stats: Mapping[str, Any] | None = None,
    dot_general=None,
) -> tuple:
    """``norm(x) @ kernel + bias`` over x's last axis, with the norm fused into the input's cast.

    Args:
      x: ``[..., H]``, float32/bfloat16/float16.
      gamma, beta: the norm's ``[H]`` scale and bias (beta None: no bias; rmsnorm has none).
        Both None with ``norm_type=None``.
      kernel: ``[H, *features]``; its dtype is the compute (output) dtype.
      bias: ``features``-shaped, or None.
      norm_type: "layernorm", "rmsnorm", or None (no norm: a dense layer on x's last axis).
      zero_centered_gamma: the norm scales by ``1 + gamma``.
      epsilon: added to the variance.
      quantizers, state, key, mesh_resource: as in ``te_jax.dense``.
      precision: ``lax.dot_general`` precision of the high-precision path.
      inspect, stats: quantization statistics, as in ``te_jax.dense``.
      dot_general: the product of the unquantized path instead of
        ``lax.dot_general`` (e.g. a flax ``Fp8DotGeneral`` instance); only without quantizers.

    Returns:
      ``(y [..., *features], new_state)``, and the forward statistics third when ``inspect``.
    """
    where = "layernorm_dense"
    q = as_quantizers(quantizers)
    inspect = as_sample(inspect)
    check_no_dot_general(where, dot_general, q.any)
    norm = as_norm(norm_type, zero_centered_gamma, epsilon, gamma, beta, where)
    check_high_precision(where, x=x, gamma=gamma, beta=beta, kernel=kernel, bias=bias)
    if x.ndim < 1 or kernel.ndim < 2 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(f"te_jax: {where}: x [..., H] and kernel [H, *features] must share H; got x {x.shape}, "
                         f"kernel {kernel.shape}")
    features = kernel.shape[1:]
    if bias is not None and tuple(bias.shape) != features:
        raise ValueError(f"te_jax: {where}: bias must have the kernel's feature shape {features}, got {bias.shape}")
    lead, h, n = x.shape[:-1], x.shape[-1], math.prod(features)
    dtype = kernel.dtype
    if not q.any:
        ln = normalize_hp(norm, x, gamma, beta, dtype)
        y = (dot_general or lax.dot_general)(ln, kernel, (((ln.ndim - 1,), (0,)), ((), ())), precision=precision)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        return (y, (None if state is None else dict(state))) + (({},) if inspect else ())
    check_blocks(q, math.prod(lead), h, n, where)
    inner = check_state(q, state, where)
    if key is None:
        check_key(q, ("input", "weight", "output"), where)
    if mesh_resource is None:
        mesh_resource = current_autocast().mesh_resource
    x2, k2 = x.reshape(-1, h), kernel.reshape(h, n)
    b2 = None if bias is None else bias.reshape(n)
    qstats = stats_input(q.quantized_roles(), stats) if inspect else None
    plan = _Plan(q, norm, mesh_resource, state_leaves(inner), vary_of(x, gamma, beta, kernel, bias), dtype,
                 x.dtype, None if bias is None else bias.dtype, inspect, stats_leaves(qstats))
    y, new_inner, fwd_stats = _vjp(plan, x2, gamma, beta, k2, b2, inner, raw_key(key), qstats)
    out = (y.reshape(*lead, *features), {**dict(state or {}), **new_inner})
    return out + ((fwd_stats,) if inspect else ())


def _forward(plan: _Plan, x, gamma, beta, kernel, bias, state, key, training: bool):
    g = GemmQuant(plan.q, state, key, plan.mesh_resource, plan.inspect)
    ln, stats = norm_input(plan.norm, g, x, gamma, beta, kernel.dtype, training)
    kq = g.quantize("weight", kernel, rowwise=training, colwise=True, flatten_axis=1)
    y = gemm(ln, kq, ((1,), (0,)), out_dtype=kernel.dtype, bias=bias, fast_accum=plan.q.fast_accum)
    y = to_varying(g.qdq("output", y), plan.all_vary)
    res = (None if plan.norm is None else x, gamma, beta, stats, keep(ln, "colwise"), keep(kq, "rowwise"), g.st,
           g.grads, key, g.stats)
    return (y, g.new_state(), g.stats), res


# The statistics input ``qstats`` is never read: its cotangent carries the statistics out of backward.
def _primal(plan, x, gamma, beta, kernel, bias, state, key, qstats):
    return _forward(plan, x, gamma, beta, kernel, bias, state, key, training=False)[0]


def _fwd(plan, x, gamma, beta, kernel, bias, state, key, qstats):
    return _forward(plan, x, gamma, beta, kernel, bias, state, key, training=True)


def _bwd(plan: _Plan, res, cts):
    x, gamma, beta, stats, ln, kq, st, grads, key, fwd_stats = res
    dy = cts[0]
    if key is None:
        check_key(plan.q, ("grad_output", "grad_input"), "layernorm_dense")
    g = GemmQuant(plan.q, st, key, plan.mesh_resource, plan.inspect)
    dyq = g.quantize("grad_output", dy, rowwise=True, colwise=True)
    # Backward GEMMs split their accumulation unless the recipe asks otherwise, as te_jax.dense does.
    fast = plan.q.backward_fast_accum
    dln = g.qdq("grad_input", gemm(dyq, kq, ((1,), (1,)), out_dtype=plan.dtype, fast_accum=fast))
    dk = gemm(ln, dyq, ((0,), (0,)), out_dtype=plan.dtype, fast_accum=fast)
    db = None if plan.bias_dtype is None else jnp.sum(dy.astype(jnp.float32), axis=0).astype(plan.bias_dtype)
    dx, dgamma, dbeta = norm_backward(plan.norm, dln, x, gamma, beta, stats, plan.x_dtype)
    u = plan.all_vary
    vx, vg, vb, vk, vbias = plan.vary
    return (match_cotangent(dx, u, vx), cotangent(dgamma, u, vg, gamma), cotangent(dbeta, u, vb, beta),
            match_cotangent(dk, u, vk), None if db is None else match_cotangent(db, u, vbias),
            state_cotangent(plan.leaves, {**grads, **g.grads}, u), None,
            stats_cotangent(plan.stats_leaves, {**fwd_stats, **g.stats}, u) if plan.inspect else None)


_vjp = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_vjp.defvjp(_fwd, with_plan_mesh(_bwd))
