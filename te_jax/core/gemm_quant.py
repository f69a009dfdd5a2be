"""One GEMM's quantization inside a custom VJP, and what every functional op carries in and out.

``GemmQuant`` is what a functional op's forward and backward call for every
tensor they quantize and every GEMM they run; the helpers below it turn what
it recorded into the cotangents of the op's state and parameters. Below
them: the rematerialization names and policies, the norm fused in front of a
GEMM, the ``Plan`` every custom VJP carries with the op's state in and out,
and the state guard (``fp8_state_updates``, ``FP8StateError``): who may
differentiate through FP8 state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from te_jax.core import forward_updates
from te_jax.core.bundles import BACKWARD_FIELDS, DenseQuantizers, ROLE_OF, check_key
from te_jax.core.forward_updates import ForwardUpdate
from te_jax.core.stats import STATS_COLLECTION, Sample, primary_copy, tensor_stats, with_skipped_update
from te_jax.ops import gemm as gemm_ops
from te_jax.ops import norm_act as norm_ops
from te_jax.ops.sharding import MeshResource, check_mesh_axes, match_cotangent, reduce_amax, varying_axes
from te_jax.ops.sharding_types import ArgType, arg_type, cotangent_as
from te_jax.quantize import dequantize, fused
from te_jax.quantize.delayed import DelayedScalingQuantizer, as_float32
from te_jax.recipe import ROLES
from te_jax.recipe.autocast import current as current_autocast
from te_jax.spec.modes import ScaledTensor


def mesh_resource_or_autocast(mesh_resource: MeshResource | None, *arrays, where: str = "te_jax") -> \
        MeshResource | None:
    """``mesh_resource``, or the active autocast's when None (the one place a functional op reads the autocast).

    Its axes are checked against the mesh in scope (``arrays``: the op's
    operands, whose types name it under plain jit): a misspelled axis raises.
    """
    mesh_resource = current_autocast().mesh_resource if mesh_resource is None else mesh_resource
    check_mesh_axes(mesh_resource, *arrays, where=where)
    return mesh_resource


class GemmQuant:
    """The quantizers of one GEMM inside a custom VJP, recording the state of stateful roles.

    Args:
      q: the GEMM's quantizers.
      state: role -> state of the stateful roles (float32 or max-merging leaves).
      key: raw PRNG key or None; role r draws from ``fold_in(key, ROLES.index(r))``.
      mesh_resource: the axes amaxes are reduced over and the GEMMs are partitioned by.
      inspect: None, or the rows (``te_jax.inspect.Sample``) each quantized
        tensor's statistics read, recorded in ``stats``; None leaves ``stats``
        None and computes nothing.
    """

    def __init__(self, q: DenseQuantizers, state: Mapping, key, mesh_resource: MeshResource | None,
                 inspect: Sample | None = None):
        self.q, self.key, self.mesh_resource = q, key, mesh_resource
        self.st = {r: as_float32(v) for r, v in state.items()}
        self.stateful = q.stateful()  # role -> StatefulQuantizer (te_jax.quantize.protocols)
        self.new: dict[str, Any] = {}
        self.grads: dict[str, Any] = {}
        self.sample = inspect
        self.stats: dict[str, Any] | None = {} if inspect else None

    @classmethod
    def backward(cls, q: DenseQuantizers, state: Mapping, key, mesh_resource: MeshResource | None,
                 inspect: Sample | None, where: str) -> GemmQuant:
        """The GemmQuant of a backward pass: first checks that the gradient roles have the key they need."""
        if key is None:
            check_key(q, BACKWARD_FIELDS, where)
        return cls(q, state, key, mesh_resource, inspect)

    def has(self, field: str) -> bool:
        """Whether the role of ``field`` ("input", "weight", ...) has a quantizer."""
        return getattr(self.q, field) is not None

    def run(self, field: str, fn: Callable, reference: jax.Array | Callable[[slice], jax.Array] | None = None,
            name: str | None = None):
        """``fn(quantizer, state, key) -> (ScaledTensor, *extras)``, recording the amax for stateful roles.

        The ScaledTensor is named ``name`` (default ``QUANTIZED``; a norm's or
        activation's output ``NORM_ACT_OUTPUT``) before anything reads it (the
        state update too), so a remat policy that saves it never reruns ``fn``.
        When inspecting, the statistics compare the quantized tensor with
        ``reference``: the high-precision tensor itself, or, for a fused
        kernel's output, a function that takes a row slice and returns those
        rows of the tensor (float32, ``[M', N]``), recomputed by the pure-JAX
        twin (bit-identical to the fused kernel) for just the rows the
        statistics read, where XLA fuses it into their reductions instead of
        writing and re-reading a float32 copy.
        """
        role, qz = ROLE_OF[field], getattr(self.q, field)
        key = None if self.key is None else jax.random.fold_in(self.key, ROLES.index(role))
        out = fn(qz, self.st.get(role), key)
        out = (name_quantized(out[0], name or QUANTIZED), *out[1:])
        if self.stats is not None:
            self.stats[role] = tensor_stats(reference, out[0], primary_copy(role), self.sample)
        if role in self.st:
            amax = out[0].amax
            if amax is None:
                raise ValueError(f"te_jax: the stateful quantizer of {role} returned a ScaledTensor without amax")
            sq = self.stateful[role]
            if sq.reduce_amax:
                amax = reduce_amax(amax, sq.amax_reduction, self.mesh_resource)
            self.new[role] = sq.update_state(self.st[role], amax)
            self.grads[role] = sq.state_gradient(self.st[role], amax)
            if self.stats is not None and isinstance(sq, DelayedScalingQuantizer):
                self.stats[role] = with_skipped_update(self.stats[role], sq.update_skipped(self.st[role], amax))
        return out

    def quantize(self, field: str, x, *, rowwise=True, colwise=False, flatten_axis=-1, name: str | None = None):
        """``x`` quantized by the role's quantizer (named as in ``run``), or ``x`` itself when it has none."""
        if not self.has(field):
            return x
        return self.run(field, lambda qz, st, key: (qz.quantize(x, st, rowwise=rowwise, colwise=colwise,
                                                                flatten_axis=flatten_axis, key=key),),
                        x, name)[0]

    def qdq(self, field: str, y, flatten_axis=-1):
        """Quantize-dequantize of a GEMM output (linear_output, linear_grad_input); ``y`` itself without a quantizer."""
        t = self.quantize(field, y, flatten_axis=flatten_axis)
        return dequantize(t, y.dtype) if isinstance(t, ScaledTensor) else t

    def gemm(self, a, b, dims, *, out_dtype, bias=None, fast_accum: bool | None):
        """``te_jax.ops.gemm.gemm`` for this GEMM: every GEMM of the functional ops runs through here.

        The primitive takes its sharding plan's mesh axes from
        ``self.mesh_resource`` (the op's, or the autocast's when the op was
        given none), the same in the forward and the backward.
        """
        return gemm_ops.gemm(a, b, dims, out_dtype=out_dtype, bias=bias, fast_accum=fast_accum,
                             autotune=self.q.autotune, mesh_resource=self.mesh_resource)

    def new_state(self) -> dict[str, Any]:
        """The forward-updated state of every stateful role: a ``ForwardUpdate`` (state and update form) for each
        role the forward quantized, the incoming state for the others (``updated_state`` splits them)."""
        return {r: ForwardUpdate(self.new[r], self.grads[r]) if r in self.new else v for r, v in self.st.items()}


def keep(t, copy: str):
    """Only the ``copy`` ("rowwise" or "colwise") of a ScaledTensor, for the residuals."""
    if not isinstance(t, ScaledTensor):
        return t
    if copy == "colwise":
        return dataclasses.replace(t, data=None, scale_inv=None)
    return dataclasses.replace(t, colwise_data=None, colwise_scale_inv=None)


class StateLeaves(NamedTuple):
    """What a backward needs of the incoming role states, recorded when the forward builds its plan (static).

    Attributes:
      roles: ``((role, ((leaf name, dtype, varying axes), ...)), ...)``.
      declared: whether ``fp8_state_updates()`` was active then: a caller that
        applies the update may declare it around the forward (the
        overwrite-with-gradient route does) instead of around the backward.
    """

    roles: tuple
    declared: bool


def state_leaves(states: Mapping[str, Mapping]) -> StateLeaves:
    """The ``StateLeaves`` of the incoming role states (call it in the forward, where the plan is built)."""
    return StateLeaves(tuple((r, tuple((n, v.dtype, varying_axes(v)) for n, v in sorted(states[r].items())))
                             for r in sorted(states)), applies_fp8_state_updates())


def state_cotangent(leaves: tuple, grads: Mapping, all_vary) -> dict[str, dict]:
    """The state updates as the cotangent of the incoming state (its leaf dtypes and varying axes).

    ``leaves`` is ``state_leaves`` of the incoming state, ``grads`` the
    ``GemmQuant.grads`` of forward and backward merged. In shard_map each leaf
    is reduced by max over the axes it does not vary over (identical where the
    amaxes were reduced already). Raises ``te_jax.train.FP8StateError``
    when the caller did not declare that it applies the update.
    """
    check_state_update_applied([role for role, _ in leaves.roles], leaves.declared)
    return {role: {name: lax.convert_element_type(match_cotangent(grads[role][name], all_vary, vary, "max"), dtype)
                   for name, dtype, vary in names}
            for role, names in leaves.roles}


def cotangent(ct, all_vary, arg: ArgType):
    """``ct`` typed as its primal ``arg``: reduced over the manual axes the primal does not vary over (shard_map),
    with the primal's sharding type (Explicit meshes); None passes."""
    return cotangent_as(ct, all_vary, arg)


def vary_of(*xs) -> tuple[ArgType, ...]:
    """The type of each array argument (varying axes in shard_map, sharding type; empty for None)."""
    return tuple(arg_type(x) for x in xs)


QUANTIZED = "te_jax_quantized"  # the forward quantized copies (weights, inputs) but those named below
NORM_ACT_OUTPUT = "te_jax_norm_act_output"  # a norm's or an MLP activation's output a GEMM reads (FP8 or not)
NORM_STATS = "te_jax_norm_stats"  # a norm's mean and rsigma
PRE_ACTIVATION = "te_jax_pre_activation"  # an MLP's first GEMM output

# Remat policies (``jax.checkpoint`` / ``nn.remat``), named by what the backward keeps of a rematerialized block;
# the rest is recomputed. Memory per block: benchmarks/README.md, "Memory".
save_nothing_policy = jax.checkpoint_policies.nothing_saveable  # only the block's inputs: the whole forward again


def fp8_checkpoint_policy(*extra_names: str):
    """A remat policy that saves the FP8 copies and norm statistics (plus ``extra_names``)."""
    return jax.checkpoint_policies.save_only_these_names(QUANTIZED, NORM_ACT_OUTPUT, NORM_STATS, *extra_names)


save_fp8_policy = fp8_checkpoint_policy()  # the FP8 copies only: GEMMs and attention again, never a cast
save_fp8_and_pre_activation_policy = fp8_checkpoint_policy(PRE_ACTIVATION)  # also an MLP's first GEMM output
# The ops' own ``recompute_norm_act``: everything but norm and activation outputs, recomputed from the kept
# input and pre-activation (a fused kernel each, no GEMM).
recompute_norm_act_policy = jax.checkpoint_policies.save_only_these_names(QUANTIZED, NORM_STATS, PRE_ACTIVATION)


def offload_fp8_policy(offload_dst: str = "pinned_host"):
    """``save_fp8_policy`` with the FP8 copies moved to host memory (JAX memory kind ``offload_dst``) between
    the forward and the backward instead of staying in device memory; the norm statistics stay."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(NORM_STATS,), names_which_can_be_offloaded=(QUANTIZED, NORM_ACT_OUTPUT),
        offload_src="device", offload_dst=offload_dst)


def check_recompute(where: str, recompute_norm_act: bool, dot_general) -> None:
    """``recompute_norm_act`` wraps the op in ``jax.checkpoint``, inside which a custom product given as a flax
    module (``dot_general``/``dot_generals``) cannot run: raises instead of dropping the option."""
    if recompute_norm_act and dot_general:
        raise ValueError(f"te_jax: {where}: recompute_norm_act=True cannot be combined with a custom dot_general "
                         "(a flax module cannot run inside the jax.checkpoint that recomputes the norm and "
                         "activation); drop one of them, or wrap the layer in nn.remat instead")


def recomputing_norm_act(fn: Callable, enabled: bool, static_argnums: tuple[int, ...] = ()) -> Callable:
    """``fn`` under ``jax.checkpoint(policy=recompute_norm_act_policy)`` when ``enabled``, else ``fn`` itself."""
    return jax.checkpoint(fn, policy=recompute_norm_act_policy, static_argnums=static_argnums) if enabled else fn


def name_quantized(t, name: str = QUANTIZED):
    """``checkpoint_name(t, name)``, with FP8 leaves named as their uint8 bits.

    Remat inserts ``reduce_precision(x, **finfo(x.dtype))`` on saved float
    residuals, which for float8_e4m3fn follows IEEE rules and turns every value
    of magnitude >= 256 into NaN (jax 0.10). The bits saved as uint8 are left alone.
    """

    def one(v):
        if v is None or not (jnp.issubdtype(v.dtype, jnp.floating) and jnp.dtype(v.dtype).itemsize == 1):
            return checkpoint_name(v, name)
        bits = checkpoint_name(lax.bitcast_convert_type(v, jnp.uint8), name)
        return lax.bitcast_convert_type(bits, v.dtype)

    return jax.tree.map(one, t)


NORM_TYPES = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """The norm in front of a GEMM: kind "layernorm" | "rmsnorm", zero-centred gamma, epsilon."""

    kind: str
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6


def as_norm(norm_type: str | None, zero_centered_gamma: bool, epsilon: float, gamma, beta,
            where: str) -> NormSpec | None:
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


def norm_input(norm: NormSpec | None, g: GemmQuant, x, gamma, beta, dtype, training: bool,
               input_name: str | None = None):
    """The GEMM input ``[M, H]``: ``norm(x)`` written by the "input" quantizer inside the norm kernel.

    Returns ``(ln, (mean, rsigma))``; ln is a ScaledTensor (rowwise, and
    columnwise when ``training``) or, without an input quantizer, an array in ``dtype``.
    A norm's output is named ``NORM_ACT_OUTPUT``; without a norm, x's quantized
    copy is named ``input_name`` (default ``QUANTIZED``).
    """
    if norm is None:
        ln = g.quantize("input", x, rowwise=True, colwise=training, name=input_name) if g.has("input") \
            else x.astype(dtype)
        return ln, (None, None)

    def fn(qz, st, key):
        return fused.norm(x, gamma, beta, qz, st, kind=norm.kind, zero_centered_gamma=norm.zero_centered_gamma,
                          epsilon=norm.epsilon, rowwise=True, colwise=training, key=key, out_dtype=dtype)

    def reference(rows: slice) -> jax.Array:  # a norm is row by row: the rows asked for need only those rows of x
        return fused.norm(x[rows], gamma, beta, kind=norm.kind, zero_centered_gamma=norm.zero_centered_gamma,
                          epsilon=norm.epsilon, out_dtype=jnp.float32, backend="reference")[0]

    ln, mean, rsigma = g.run("input", fn, reference, NORM_ACT_OUTPUT) if g.has("input") else fn(None, None, None)
    return ln, checkpoint_name((mean, rsigma), NORM_STATS)


def norm_backward(norm: NormSpec | None, dln, x, gamma, beta, stats, x_dtype):
    """``(dx, dgamma, dbeta)`` from the gradient of the norm's output (x is None without a norm)."""
    if norm is None:
        return dln.astype(x_dtype), None, None
    mean, rsigma = stats
    dx, dgamma, dbeta = norm_ops.norm_bwd(dln, x, mean, rsigma, gamma, kind=norm.kind,
                                          zero_centered_gamma=norm.zero_centered_gamma)
    return dx, dgamma.astype(gamma.dtype), (None if beta is None else dbeta.astype(beta.dtype))


def normalize_hp(norm: NormSpec | None, x, gamma, beta, dtype):
    """High-precision (unquantized, autodiff) norm in ``dtype``; x is widened first when dtype is wider."""
    if norm is None:
        return x.astype(dtype)
    wide = jnp.promote_types(x.dtype, dtype)
    y = norm_ops.normalize(x.astype(wide), gamma, beta, kind=norm.kind,
                           zero_centered_gamma=norm.zero_centered_gamma, epsilon=norm.epsilon)
    return y.astype(dtype)


STATS = STATS_COLLECTION  # the key of the statistics in a functional op's state


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static facts of one functional-op call every custom VJP needs (its hashable nondiff argument).

    Attributes:
      mesh_resource: the mesh axes amaxes are reduced over and GEMMs partitioned by.
      state_leaves: ``state_leaves`` of the incoming role states (per GEMM for an MLP).
      stats_leaves: ``te_jax.core.stats.stats_leaves`` of the statistics input (per GEMM for an MLP).
      vary: the ``ArgType`` (varying axes in shard_map, sharding type) of the op's array arguments, in order.
      inspect: the rows statistics read (None: not inspecting).
    """

    mesh_resource: MeshResource | None
    state_leaves: tuple
    stats_leaves: tuple
    vary: tuple
    inspect: Sample | None

    @property
    def all_vary(self) -> frozenset[str]:
        """Every axis some argument varies over."""
        return frozenset().union(*(a.vary for a in self.vary))


def given_stats(state: Mapping | None) -> Any:
    """The statistics input in ``state`` (None when it has none)."""
    return None if state is None else state.get(STATS)


def high_precision_state(state: Mapping | None, inspect: Sample | None) -> dict | None:
    """The new state of an unquantized call: ``state`` unchanged, with no forward statistics when inspecting."""
    if state is None and not inspect:
        return None
    return {**dict(state or {}), **({STATS: {}} if inspect else {})}


def updated_state(state: Mapping | None, updates: Mapping, fwd_stats: Any) -> dict:
    """``state`` with ``updates`` (the forward-updated entries) and, when not None, ``fwd_stats`` under ``STATS``.

    Each ``ForwardUpdate`` in ``updates`` (``GemmQuant.new_state``) becomes its
    state; its update form, and ``fwd_stats``, go to the recorders of
    ``te_jax.core.forward_updates`` open around the call.
    """
    updates = forward_updates.split(state, updates, given_stats(state), fwd_stats)
    return {**dict(state or {}), **updates, **({} if fwd_stats is None else {STATS: fwd_stats})}


def with_stats(state: Mapping | None, stats: Any) -> dict | None:
    """``state`` with the statistics input ``stats`` under ``STATS`` (``state`` itself when ``stats`` is None)."""
    return state if stats is None else {**dict(state or {}), STATS: stats}


def split_stats(new_state: Mapping | None) -> tuple[dict, Any]:
    """``(the state without STATS, the forward statistics or None)`` of an op's returned state."""
    new_state = dict(new_state or {})
    return new_state, new_state.pop(STATS, None)


_applies_updates = jax.make_user_context(default_value=False)

FIX = (
    "differentiate with te_jax.train.value_and_grad (or te_jax.train.grad) over the whole variables dict, "
    "\"fp8_meta\" included, and step with te_jax.train.TrainState (or te_jax.train.apply_gradients), "
    "not with jax.grad / jax.value_and_grad, flax.training.train_state.TrainState or optax.apply_updates. "
    "A te_jax.nnx model: differentiate with te_jax.nnx.value_and_grad (or te_jax.nnx.grad), which applies the "
    "update. Calling te_jax.dense / te_jax.layernorm_dense / te_jax.layernorm_mlp with state=... directly: "
    "differentiate inside `with te_jax.train.fp8_state_updates():` and apply the state's gradient with "
    "te_jax.train.apply_fp8_update"
)


class FP8StateError(ValueError):
    """A step would corrupt FP8 state or leave it stale."""


def fp8_state_updates(enabled: bool = True):
    """Context manager: the caller applies the FP8 state updates that differentiation returns.

    Inside it, stateful layers may be differentiated; the gradient of their
    state is its update, to apply with ``te_jax.train.apply_fp8_update``,
    never to hand to an optimizer. ``enabled=False`` withdraws the
    declaration for its body.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"te_jax: fp8_state_updates(enabled=...) must be True or False, got {enabled!r}")
    return _applies_updates(enabled)


def applies_fp8_state_updates() -> bool:
    """Whether the innermost ``fp8_state_updates`` declares that the caller applies state updates."""
    return _applies_updates.value


def check_state_update_applied(roles, declared_in_forward: bool = False) -> None:
    """Raises ``FP8StateError`` unless the caller applies state updates; a no-op when ``roles`` is empty.

    Called by the backward rule of every layer, at trace time, with the roles
    whose state it returns an update for. The declaration counts when
    ``fp8_state_updates()`` is active now (the backward's trace) or was when
    the forward built the plan (``declared_in_forward``, ``StateLeaves.declared``).
    """
    if roles and not (declared_in_forward or applies_fp8_state_updates()):
        raise FP8StateError(
            f"te_jax: this model keeps FP8 state (delayed scaling: the \"fp8_meta\" collection, here for "
            f"{sorted(set(roles))}), and its update after each step comes back as the gradient of that state; "
            f"an optimizer would change it like a parameter, and dropping it leaves the scales stale. To train, "
            f"{FIX}."
        )


def missing_state_error(layer: str, name: str) -> ValueError:
    """The error of a layer applied without the "fp8_meta" entry ``name`` that its recipe keeps."""
    return ValueError(
        f"te_jax: {layer} has no fp8_meta state {name!r}, which this recipe keeps: initialize the model "
        f"under te_jax.autocast with it and apply the whole variables dict that init returns; to train, {FIX}")
