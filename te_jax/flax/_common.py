"""Helpers shared by the te_jax.flax modules: parameters, dtypes, recipes, FP8 state, keys."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import meta

from te_jax.core import layer_support as L
from te_jax.core import split_stats, with_stats
from te_jax.core import stats as inspect_stats
from te_jax.core.layer_support import (  # noqa: F401  (shared with the modules)
    HIGH_PRECISION, Initializer, canonical_input, compute_dtype)
from te_jax.core.layer_support import located, norm_uses_bias
from te_jax.core.forward_updates import record_forward_updates
from te_jax.core.gemm_quant import missing_state_error
from te_jax.core.stats import STATS_COLLECTION
from te_jax.recipe.autocast import current_recipe, inspect_sample, inspecting
from te_jax.spec.names import FP8_COLLECTION
from te_jax.spec.names import QUANTIZE_RNG
from te_jax.train.step import apply_fp8_update, merge_fp8_updates


def module_path(module) -> tuple[str, ...]:
    """A Flax module's path (its scope's names), e.g. ``("TransformerLayer_0", "mlp", "wi")``."""
    scope = getattr(module, "scope", None)
    return tuple(getattr(scope, "path", ()) or ())


def where(module: nn.Module) -> str:
    """``"LayerNormMLP at TransformerLayer_0/mlp"`` for error messages."""
    return L.describe(module, module_path(module))


def check_dtypes(module: nn.Module, x: jax.Array | None = None) -> None:
    """Input, ``dtype`` and ``param_dtype`` must be float32, bfloat16 or float16 (a clear error otherwise)."""
    L.check_dtypes(where(module), getattr(module, "dtype", None), getattr(module, "param_dtype", None), x)


def canonical_axes(axes, ndim: int, module: nn.Module, what: str = "axis") -> tuple[int, ...]:
    return L.canonical_axes(axes, ndim, where(module), what)


def flat_init(init: Initializer, n_in: int) -> Initializer:
    """``init`` applied to the kernel viewed as ``[prod(in axes), prod(out axes)]``, as flax's DenseGeneral does."""

    def wrapped(rng, shape, dtype=jnp.float32):
        flat = (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:])))
        value = init(rng, flat, dtype)
        if isinstance(value, meta.AxisMetadata):
            return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
        return jnp.reshape(value, shape)

    return wrapped


def flat_bias_init(init: Initializer) -> Initializer:
    """``init`` applied to the bias viewed as a vector, as flax's DenseGeneral does."""

    def wrapped(rng, shape, dtype=jnp.float32):
        value = init(rng, (int(np.prod(shape)),), dtype)
        if isinstance(value, meta.AxisMetadata):
            return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
        return jnp.reshape(value, shape)

    return wrapped


def param(module: nn.Module, name: str, init: Initializer, shape: Sequence[int], dtype, axes: Sequence[str] = ()):
    """``module.param`` with logical axis names (``nn.with_logical_partitioning``) when ``axes`` is given.

    An existing parameter of another shape raises a te_jax error that names
    the parameter and the shape the input needs.
    """
    shape = tuple(int(d) for d in shape)
    if axes:
        axes = tuple(axes)
        if len(axes) != len(shape):
            raise ValueError(f"te_jax: {where(module)}: {name} has {len(shape)} axes {shape} but its logical axis "
                             f"names are {axes}")
        init = nn.with_logical_partitioning(init, axes)
    if module.has_variable("params", name):
        have = module.get_variable("params", name)
        have = have.unbox() if isinstance(have, meta.AxisMetadata) else have
        if tuple(np.shape(have)) != shape:
            raise ValueError(f"te_jax: {where(module)}: parameter {name!r} has shape {tuple(np.shape(have))}, but "
                             f"this input needs {shape}; check the input's feature size")
    return module.param(name, init, shape, dtype)


def recipe_or_none():
    """The active autocast's recipe (None outside autocast or when disabled)."""
    return current_recipe()


def recipe_of_dense(module: nn.Module):
    """``recipe_or_none()`` for a Dense-like ``module``, refusing a custom ``dot_general`` / ``dot_general_cls``
    under a recipe (te_jax's quantized GEMMs replace it)."""
    recipe = recipe_or_none()
    if recipe is not None and (module.dot_general is not None or module.dot_general_cls is not None):
        raise ValueError(f"te_jax: {where(module)}: dot_general / dot_general_cls cannot be combined with "
                         "te_jax.autocast (te_jax's quantized GEMMs replace them); drop them")
    return recipe


def gemm_state(module: nn.Module, quantizers, name: str | None = None) -> dict[str, Any]:
    """A GEMM's state from ``fp8_meta`` (created when initializing).

    With ``name`` None each role is a variable of the module (``fp8_meta/<path>/<role>``);
    otherwise one variable ``name`` holds ``{role: state}`` (``fp8_meta/<path>/<name>/<role>``).
    """
    stateful = quantizers.stateful()
    if not stateful:
        return {}
    names = [name] if name is not None else list(stateful)
    for n in names:
        if not module.has_variable(FP8_COLLECTION, n) and not module.is_mutable_collection(FP8_COLLECTION):
            raise missing_state_error(where(module), n)
    if name is None:
        value = {r: module.variable(FP8_COLLECTION, r, q.init_state).value for r, q in stateful.items()}
    else:
        value = dict(module.variable(FP8_COLLECTION, name, quantizers.init_state).value)
        missing = [r for r in stateful if r not in value]
        if missing:
            raise ValueError(f"te_jax: {where(module)}: {FP8_COLLECTION} state {name!r} lacks {missing}; "
                             "re-initialize the model under this recipe")
    # A layer called again in a mutable apply quantizes with the state the apply started from, as in training.
    written = _written(module).get((FP8_COLLECTION, module_path(module), name)) if _writes(module) else None
    return value if written is None else dict(written.start)


def store_gemm_state(module: nn.Module, new_state: dict | None, name: str | None = None) -> None:
    """Writes the forward-updated state back when ``fp8_meta`` is mutable (not while initializing)."""
    _store(module, FP8_COLLECTION, new_state, name)


def inspect_arg(*stats_inputs) -> inspect_stats.Sample | bool:
    """The ``inspect`` argument of a functional op: the autocast's Sample when a statistics input exists, else False."""
    return inspect_sample() if any(s is not None for s in stats_inputs) else False


def stats_input(module: nn.Module, quantizers, name: str | None = None) -> dict[str, Any] | None:
    """The GEMM's statistics input from "fp8_stats" when inspecting, else None (``te_jax.inspect``).

    Laid out like ``gemm_state``: ``fp8_stats/<path>/<role>/<stat>`` (or
    ``.../<name>/<role>/<stat>``), one entry per quantized role. The value is
    never read; its gradient carries the statistics.
    """
    if not inspecting() or not quantizers.any:
        return None
    roles = quantizers.quantized_roles()
    names = [name] if name is not None else list(roles)
    for n in names:
        if not module.has_variable(STATS_COLLECTION, n) and not module.is_mutable_collection(STATS_COLLECTION):
            raise ValueError(
                f"te_jax: {where(module)} has no {STATS_COLLECTION} entry {n!r}, which inspect=True needs: initialize "
                f"the model under te_jax.autocast(..., inspect=True) and pass variables[{STATS_COLLECTION!r}] to "
                f"apply (or apply with mutable=[{STATS_COLLECTION!r}] for the forward statistics only)")
    if name is None:
        return {r: module.variable(STATS_COLLECTION, r, lambda r=r: inspect_stats.zeros([r])[r]).value for r in roles}
    value = dict(module.variable(STATS_COLLECTION, name, lambda: inspect_stats.zeros(roles)).value)
    missing = [r for r in roles if r not in value]
    if missing:
        raise ValueError(f"te_jax: {where(module)}: {STATS_COLLECTION} entry {name!r} lacks {missing}; re-initialize "
                         "the model under this recipe with inspect=True")
    return value


def store_stats(module: nn.Module, stats: dict | None = None, name: str | None = None) -> None:
    """Writes the forward statistics when "fp8_stats" is mutable (not while initializing); a layer called again
    in one apply merges its statistics with those of its earlier calls by max, as training does."""
    if stats and _writes(module, STATS_COLLECTION):
        written, key = _written(module), (STATS_COLLECTION, module_path(module), name)
        if key in written:
            stored = (module.get_variable(STATS_COLLECTION, name) if name is not None else
                      {r: module.get_variable(STATS_COLLECTION, r) for r in stats})
            stats = {r: {k: jnp.maximum(stored[r][k], v) if k in stored.get(r, {}) else v for k, v in s.items()}
                     for r, s in stats.items()}
        written[key] = True
    _store(module, STATS_COLLECTION, stats, name, merge=True)


# ---- a mutable apply: the uses of one layer merge as in training ----------------------------------------------

_WRITTEN = "_te_jax_fp8_written"  # the attribute of an apply's root flax Scope: what the apply has written


class _Written(NamedTuple):
    """An "fp8_meta" entry a mutable apply wrote: the state the apply started from, the update forms merged so far."""

    start: Any
    update: Any


def _written(module: nn.Module) -> dict:
    """What this apply has written into "fp8_meta" and "fp8_stats", by ``(collection, module path, name)``.

    Kept on the apply's root scope, which every ``apply`` (and the body of a lifted transformation) creates
    afresh, so that a layer called again finds the state the apply started from.
    """
    root = module.scope.root
    if not hasattr(root, _WRITTEN):
        setattr(root, _WRITTEN, {})
    return getattr(root, _WRITTEN)


def _writes(module: nn.Module, collection: str = FP8_COLLECTION) -> bool:
    """Whether this call stores into ``collection``: mutable, and not while initializing."""
    return module.is_mutable_collection(collection) and not module.is_initializing()


def _merge_into_apply(module: nn.Module, state: dict, update: dict, gemms: Sequence[str] | None) -> dict:
    """The state to store after this call: the start of the apply with this call's update forms max-merged into
    those of the layer's earlier calls in the apply (``te_jax.train.merge_fp8_updates``), as training merges them."""
    written, path, out = _written(module), module_path(module), {}
    for name in [None] if gemms is None else gemms:
        start, upd = (state, update) if name is None else (state[name], update[name])
        earlier = written.get((FP8_COLLECTION, path, name))
        if earlier is not None:
            upd = merge_fp8_updates(earlier.update, upd)
        written[(FP8_COLLECTION, path, name)] = _Written(start, upd)
        new = apply_fp8_update(start, upd)
        out = new if name is None else {**out, name: new}
    return out


def _store(module: nn.Module, collection: str, entries: dict | None, name: str | None, merge: bool = False) -> None:
    """Writes ``entries`` ({role: value}) into ``collection`` when it is mutable (not while initializing).

    Each role is a variable of its own, or, with ``name``, one variable
    ``name`` holds them all (merged into its value when ``merge``).
    """
    if not entries or module.is_initializing() or not module.is_mutable_collection(collection):
        return
    if name is None:
        for role, value in entries.items():
            module.put_variable(collection, role, value)
    else:
        old = module.get_variable(collection, name) if merge else {}
        module.put_variable(collection, name, {**old, **entries})


def quantize_key(module: nn.Module, quantized: bool):
    """A key from the "quantize" RNG stream when quantizing and the stream is given, else None."""
    if quantized and module.has_rng(QUANTIZE_RNG):
        return module.make_rng(QUANTIZE_RNG)
    return None


def dropout_mask(module: nn.Module, rate: float, shape, broadcast_dims, rng_name: str, dtype, deterministic: bool):
    """``bernoulli(1 - rate) / (1 - rate)`` of ``shape`` (size 1 along ``broadcast_dims``), or None."""
    return L.dropout_mask(lambda: module.make_rng(rng_name), rate, shape, broadcast_dims, dtype, deterministic,
                          where(module))


def dot_general_of(module: nn.Module, dot_general_cls, quantized: bool):
    """An instance of ``dot_general_cls`` (a submodule, as flax.linen.DenseGeneral makes it), or None.

    Raises a clear error when the layer also quantizes: te_jax's GEMMs replace a custom dot_general.
    """
    if dot_general_cls is None:
        return None
    if quantized:
        raise ValueError(f"te_jax: {where(module)}: dot_general_cls cannot be combined with te_jax.autocast "
                         "(te_jax's quantized GEMMs replace it); drop one of them")
    return dot_general_cls()


def call_op(module: nn.Module, quantizers, op: Callable, gemms: Sequence[str] | None = None) -> jax.Array:
    """``op(state=..., key=..., inspect=...) -> (y, new_state)`` with the layer's FP8 state and statistics.

    Args:
      module: the layer (call from its compact ``__call__``).
      quantizers: its quantizers: a ``DenseQuantizers``, or with ``gemms`` a
        bundle with one ``DenseQuantizers`` attribute per GEMM (``MLPQuantizers``).
      op: the functional op with every other argument bound.
      gemms: None for a layer with one GEMM (entries ``<path>/<role>``), else
        the GEMMs' names (entries ``<path>/<gemm>/<role>``).

    Returns:
      y. The forward-updated state and the forward statistics are stored in
      "fp8_meta" and "fp8_stats" where those collections are mutable; the op's
      errors name the module. A layer called several times in one apply
      quantizes each time with the state the apply started from, and stores
      that state with the calls' updates merged by max, as
      ``te_jax.train.value_and_grad`` merges them (statistics by max too).
    """
    if gemms is None:
        state, stats = gemm_state(module, quantizers), stats_input(module, quantizers)
        inspect = inspect_arg(stats)
    else:
        state = {g: gemm_state(module, quantizers.by_gemm()[g], g) for g in gemms}
        each = {g: stats_input(module, quantizers.by_gemm()[g], g) for g in gemms}
        inspect = inspect_arg(*each.values())
        stats = {g: v for g, v in each.items() if v is not None} if inspect else None
    writes = _writes(module) and bool(jax.tree.leaves(state))
    try:
        with record_forward_updates(state) if writes else contextlib.nullcontext() as forward:
            y, new_state = op(state=with_stats(state, stats), key=quantize_key(module, quantizers.any),
                              inspect=inspect)
    except ValueError as err:
        raise located(err, where(module)) from None
    new_state, fwd_stats = split_stats(new_state)
    if writes:
        new_state = _merge_into_apply(module, state, forward.updates(), gemms)
    if gemms is None:
        store_gemm_state(module, new_state)
        store_stats(module, fwd_stats)
    else:
        for g in gemms:
            store_gemm_state(module, new_state.get(g), g)
            store_stats(module, (fwd_stats or {}).get(g), g)
    return y


def norm_params(module: nn.Module, x: jax.Array, *, layernorm_type: str, zero_centered_gamma: bool, use_scale: bool,
                use_bias: bool | None, scale_init, bias_init, scale_axes, bias_axes, bias_name: str):
    """The norm's ``(gamma, beta, zero_centered_gamma)`` as the kernels take them (``[H]`` arrays)."""
    use_bias = norm_uses_bias(layernorm_type, use_bias, where(module))
    h = x.shape[-1]
    gamma, zcg = None, bool(zero_centered_gamma)
    if use_scale:
        init = scale_init if scale_init is not None else (nn.initializers.zeros if zcg else nn.initializers.ones)
        gamma = param(module, "scale", init, (h,), module.param_dtype, scale_axes)
    else:
        gamma, zcg = jnp.ones((h,), jnp.float32), False
    beta = param(module, bias_name, bias_init, (h,), module.param_dtype, bias_axes) if use_bias else None
    return gamma, beta, zcg


def gemm_norm_params(module: nn.Module, x: jax.Array):
    """``(gamma, beta, zero_centered_gamma, norm_type)`` of the norm in front of a layer's first GEMM.

    Reads the layer's ``enable_layernorm``, ``layernorm_type``,
    ``zero_centered_gamma``, ``use_scale``, ``scale_init``, ``use_ln_bias``,
    ``ln_bias_init``, ``scale_axes`` and ``ln_bias_axes`` (parameters "scale"
    and "ln_bias"); ``(None, None, False, None)`` without a norm.
    """
    if not module.enable_layernorm:
        return None, None, False, None
    gamma, beta, zcg = norm_params(module, x, layernorm_type=module.layernorm_type,
                                   zero_centered_gamma=module.zero_centered_gamma, use_scale=module.use_scale,
                                   use_bias=module.use_ln_bias, scale_init=module.scale_init,
                                   bias_init=module.ln_bias_init, scale_axes=module.scale_axes,
                                   bias_axes=module.ln_bias_axes, bias_name="ln_bias")
    return gamma, beta, zcg, module.layernorm_type
