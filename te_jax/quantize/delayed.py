"""Delayed scaling: per-tensor FP8 quantized with a scale derived from past amaxes.

The state of one tensor is ``{"amax_history": f32[L], "scale": f32[1]}``,
initially zeros and one. Each step:

1. quantize with the stored scale (the kernel returns this step's amax from
   the same pass);
2. ``history[0] = amax``; an amax that is NaN or Inf (one bad micro-batch)
   is recorded as 0, so it leaves the scale to the rest of the window instead
   of freezing it for the window's length (TransformerEngine's history
   reduction skips NaN too); the step counts as skipped;
3. ``a = max(history)`` ("max"), ``history[0]`` ("most_recent"), or
   ``amax_compute_algo(history)``;
4. ``scale = (fp8_max / a) / 2**margin`` (or ``scaling_factor_compute_algo(a,
   scale, fp8_max, margin)``), keeping the old scale when ``a`` is 0 or not
   finite, or when ``scaling_factor_compute_algo`` returns a scale that is not
   finite and positive (counted as skipped); the scale is at most 2^126
   (te_jax's largest scale, docs/numerics.md);
5. roll the history by -1 and zero ``history[0]``.

A skipped step (``update_skipped``: a non-finite amax in step 2, a non-finite
``a`` or a rejected scale in step 4) is reported by the quantization
statistics as ``skipped_update`` (``te_jax.core.stats``, ``te_jax.inspect``).
A callable that returns an array of the wrong shape raises a ValueError at
trace time naming the recipe field and the shape it must return.

``init_state`` and ``update_state`` are pure; nothing is mutated.

Types. ``DelayedState`` names the state (``amax_history``, ``scale``) and
``StateUpdate`` its update form; both are NamedTuples (pytrees) the code
works with. What is *stored* (Flax's "fp8_meta" collection, nnx ``FP8Meta``
variables, checkpoints) is the documented dict layout
``{"amax_history": f32[L], "scale": f32[1]}`` of either: ``DelayedState.of``
/ ``StateUpdate.of`` read that dict, ``_asdict`` writes it. (The dict stays
the storage so that checkpoints, ``state["scale"]`` indexing and the
collections' layout are those of before; ``is_state`` recognises it.)

The update form (``StateUpdate``). Training carries the update as the
*gradient* of the state (see ``te_jax.train``); ``state_gradient`` gives that
form (``encode_update``) and ``apply_state_gradient`` turns it back into the
new state (``decode_update``). The form is made so that the elementwise max
of two of them is the form of one update with the larger amax: that is how a
tensor quantized twice in a step (a layer applied twice, micro-batches)
merges. Encoding:

* ``amax_history``: the new history as it is (finite: a non-finite amax is
  recorded as 0);
* ``scale``: the new scale *negated* (so max picks the smaller scale, that of
  the larger amax), or ``KEEP_ZERO_AMAX = -inf`` for "amax was 0, keep the
  old scale", or ``KEEP_NONFINITE_AMAX = +inf`` for "``a`` was not finite or
  the scale ``scaling_factor_compute_algo`` gave was rejected, keep the old
  scale";
* all ``-inf`` (``UNUSED``, the zero of the max-merge): "not used this step",
  keeps the old state (history and scale).

The merge is exact when ``amax_compute_algo`` is non-decreasing in each
history entry and the scale non-increasing in the amax, as the built-in
algorithms are; a non-finite amax merges as 0 (two uses, one with a NaN
amax: the update of the other's amax).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.ops import quantize as qops
from te_jax.ops.quantize import as_matrix
from te_jax.spec import modes
from te_jax.spec import numerics as nm
from te_jax.spec.modes import CastSpec, ScaledTensor

State = dict[str, jax.Array]  # the stored layout: {"amax_history": f32[L], "scale": f32[1]}
FIELDS = ("amax_history", "scale")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
AMAX_REDUCTIONS = ("max", "mean")
KEEP_ZERO_AMAX = -float("inf")  # StateUpdate.scale: amax was 0, keep the old scale (also: unused)
KEEP_NONFINITE_AMAX = float("inf")  # StateUpdate.scale: amax was inf or nan, keep the old scale


def _f32(v: jax.Array) -> jax.Array:
    return v if v.dtype == jnp.float32 else lax.convert_element_type(v, jnp.float32)


class DelayedState(NamedTuple):
    """One tensor's delayed-scaling state: ``amax_history f32[..., L]`` (newest amax at index 0 during a step)
    and ``scale f32[..., 1]`` (the encode scale the next step quantizes with)."""

    amax_history: jax.Array
    scale: jax.Array

    @classmethod
    def of(cls, state: Any) -> DelayedState:
        """The typed view of a stored state (the dict layout, or a DelayedState), leaves as float32 (training
        helpers hand them in as a max-merging dtype)."""
        if isinstance(state, Mapping):
            return cls(_f32(state["amax_history"]), _f32(state["scale"]))
        return cls(_f32(state.amax_history), _f32(state.scale))


class StateUpdate(NamedTuple):
    """A ``DelayedState``'s update in the max-mergeable form carried as its gradient (module docstring):
    ``amax_history`` the new history, ``scale`` the new scale negated or a ``KEEP_*`` sentinel; all -inf
    means unused."""

    amax_history: jax.Array
    scale: jax.Array

    @classmethod
    def of(cls, update: Any) -> StateUpdate:
        """The typed view of a stored (dict) update, leaves as float32."""
        return cls(*DelayedState.of(update))


def encode_update(new: DelayedState, a: jax.Array, scale_ok: jax.Array | bool = True) -> StateUpdate:
    """The update form of the new state ``new``, computed from the amax ``a`` the scale was derived from
    (``scale_ok``: whether the scale computed from it was accepted)."""
    finite = nm.is_finite(a) & scale_ok
    flag = jnp.where(finite, jnp.float32(KEEP_ZERO_AMAX), jnp.float32(KEEP_NONFINITE_AMAX))
    ok = (a > 0) & finite
    return StateUpdate(new.amax_history, jnp.where(ok, -new.scale, flag))


def decode_update(old: DelayedState, update: StateUpdate) -> DelayedState:
    """The new state from the old one and a (max-merged) update: every sentinel keeps the old value."""
    history = jnp.where(update.amax_history == -jnp.inf, old.amax_history, update.amax_history)
    scale = jnp.where(nm.is_finite(update.scale), -update.scale, old.scale)
    return DelayedState(history, scale)


def init_state(amax_history_len: int = 1024) -> State:
    """The initial state: a zero amax history of length ``amax_history_len`` and scale 1."""
    return DelayedState(jnp.zeros((amax_history_len,), jnp.float32), jnp.ones((1,), jnp.float32))._asdict()


def as_float32(state: State) -> State:
    """The state (any pytree) with float32 leaves (training helpers hand them in as a max-merging dtype)."""
    return jax.tree.map(_f32, state)


class _Step(NamedTuple):
    """One update (steps 2-5): the new state, the amax ``a`` its scale came from, whether the scale computed
    from ``a`` was accepted, and whether the step counts as skipped (float32 1 or 0, like ``a``)."""

    new: DelayedState
    a: jax.Array
    scale_ok: jax.Array
    skipped: jax.Array


def _shaped(value, shape: tuple, field: str, wanted: str):
    """``value`` as float32 of ``shape``; a ValueError at trace time naming ``field`` when its size differs."""
    value = jnp.asarray(value)
    if value.size != math.prod(shape):
        raise ValueError(f"te_jax: DelayedScaling.{field} (DelayedScalingQuantizer.{field}) returned shape "
                         f"{value.shape}; it must return {wanted}, shape {shape}")
    return _f32(value).reshape(shape)


def _update(state: State, amax, fp8_max: float, margin: int, amax_compute_algo,
            scaling_factor_compute_algo) -> _Step:
    history, scale = DelayedState.of(state)
    amax = jnp.asarray(amax, jnp.float32).reshape(history.shape[:-1])
    amax_ok = nm.is_finite(amax)
    # A NaN or Inf amax is skipped (recorded as 0); so are those a state written before this rule holds.
    history = jnp.where(nm.is_finite(history), history, 0).at[..., 0].set(jnp.where(amax_ok, amax, 0))
    if amax_compute_algo == "max":
        a = jnp.max(history, axis=-1, keepdims=True)
    elif amax_compute_algo == "most_recent":
        a = history[..., :1]
    else:
        a = _shaped(amax_compute_algo(history), scale.shape, "amax_compute_algo",
                    "one amax per history (f32[1] for an f32[L] history)")
    a_ok = (a > 0) & nm.is_finite(a)
    if scaling_factor_compute_algo is None:
        new = (jnp.float32(fp8_max) / a) / jnp.float32(2.0**margin)
        scale_ok = jnp.ones(scale.shape, bool)
    else:
        new = _shaped(scaling_factor_compute_algo(a, scale, fp8_max, margin), scale.shape,
                      "scaling_factor_compute_algo", "the new scale shaped like its `scale` argument")
        scale_ok = (new > 0) & nm.is_finite(new)  # NaN, Inf, 0 or negative: keep the old scale (counted)
    new = jnp.where(new <= nm.MAX_SCALE, new, nm.MAX_SCALE)
    new_scale = jnp.where(a_ok & scale_ok, new, scale)
    new_history = jnp.roll(history, -1, axis=-1).at[..., 0].set(0.0)
    skipped = ~amax_ok[..., None] | ~nm.is_finite(a) | (a_ok & ~scale_ok)
    return _Step(DelayedState(new_history, new_scale), a, scale_ok, skipped.astype(jnp.float32))


def update_state(
    state: State,
    amax: jax.Array,
    *,
    fp8_max: float,
    margin: int = 0,
    amax_compute_algo: str | Callable = "max",
    scaling_factor_compute_algo: Callable | None = None,
) -> State:
    """The state after a step whose tensor had amax ``amax`` (steps 2-5 above)."""
    return _update(state, amax, fp8_max, margin, amax_compute_algo, scaling_factor_compute_algo).new._asdict()


def state_gradient(state: State, amax: jax.Array, **config) -> State:
    """``update_state``'s result in the max-mergeable form the training helpers carry as a gradient
    (``encode_update``; stored as a dict, like the state)."""
    step = _update(state, amax, **config)
    return encode_update(step.new, step.a, step.scale_ok)._asdict()


def update_skipped(state: State, amax: jax.Array, **config) -> jax.Array:
    """Whether ``update_state`` skips this step (f32 1 or 0, shaped like ``state["scale"]``): ``amax`` is NaN or
    Inf, the amax the history gives is not finite, or ``scaling_factor_compute_algo``'s scale was rejected."""
    return _update(state, amax, **config).skipped


def apply_state_gradient(state: State, grad: State) -> State:
    """The new state from the old one and a (max-merged) ``state_gradient`` (``decode_update``)."""
    return decode_update(DelayedState.of(state), StateUpdate.of(grad))._asdict()


def check_config(owner: str, *, margin, amax_history_len, amax_compute_algo, scaling_factor_compute_algo,
                 amax_reduction) -> None:
    """Raises a ValueError naming ``owner``'s field when a delayed-scaling setting is out of range."""
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"te_jax: {owner}.margin must be an int >= 0, got {margin!r}")
    if isinstance(amax_history_len, bool) or not isinstance(amax_history_len, int) or amax_history_len < 1:
        raise ValueError(f"te_jax: {owner}.amax_history_len must be an int >= 1, got {amax_history_len!r}")
    if not callable(amax_compute_algo) and (isinstance(amax_compute_algo, bool)
                                            or amax_compute_algo not in AMAX_COMPUTE_ALGOS):
        raise ValueError(f"te_jax: {owner}.amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS} or a callable, "
                         f"got {amax_compute_algo!r}")
    if scaling_factor_compute_algo is not None and not callable(scaling_factor_compute_algo):
        raise ValueError(f"te_jax: {owner}.scaling_factor_compute_algo must be None or a callable "
                         f"f(amax, scale, fp8_max, margin), got {scaling_factor_compute_algo!r}")
    if isinstance(amax_reduction, bool) or amax_reduction not in AMAX_REDUCTIONS:
        raise ValueError(f"te_jax: {owner}.amax_reduction must be one of {AMAX_REDUCTIONS}, got {amax_reduction!r}")


def is_state(tree: Any) -> bool:
    """Whether ``tree`` is a delayed-scaling state (or its update): a ``DelayedState`` / ``StateUpdate``, or
    the stored dict layout of one."""
    return isinstance(tree, (DelayedState, StateUpdate)) or (isinstance(tree, dict) and set(tree) == set(FIELDS))


@dataclasses.dataclass(frozen=True)
class DelayedScalingQuantizer:
    """Per-tensor FP8 quantized with the stored scale of an amax-history state.

    Attributes:
      dtype: jnp.float8_e4m3fn or jnp.float8_e5m2.
      margin, amax_history_len, amax_compute_algo: as in ``te_jax.recipe.DelayedScaling``.
      scaling_factor_compute_algo: None or ``f(amax, scale, fp8_max, margin)``; the recipe binds its own
        TransformerEngine-style ``f(amax, scale, fp8_max, recipe)`` to this form.
      reduce_amax: callers reduce this tensor's amax across devices before
        ``update_state`` (``te_jax.ops.sharding.reduce_amax``).
      amax_reduction: "max" or "mean".
    """

    dtype: Any = jnp.float8_e4m3fn
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable = "max"
    scaling_factor_compute_algo: Callable | None = None
    reduce_amax: bool = True
    amax_reduction: str = "max"

    def __post_init__(self):
        object.__setattr__(self, "dtype", qops.check_fp8_dtype(self.dtype))
        check_config("DelayedScalingQuantizer", margin=self.margin, amax_history_len=self.amax_history_len,
                     amax_compute_algo=self.amax_compute_algo,
                     scaling_factor_compute_algo=self.scaling_factor_compute_algo, amax_reduction=self.amax_reduction)

    scaling_mode = modes.FP8_TENSOR

    @property
    def fp8_max(self) -> float:
        return nm.fp8_max(self.dtype)

    def _config(self) -> dict:
        return dict(fp8_max=self.fp8_max, margin=self.margin, amax_compute_algo=self.amax_compute_algo,
                    scaling_factor_compute_algo=self.scaling_factor_compute_algo)

    def init_state(self) -> State:
        return init_state(self.amax_history_len)

    def update_state(self, state: State, amax: jax.Array) -> State:
        return update_state(state, amax, **self._config())

    def state_gradient(self, state: State, amax: jax.Array) -> State:
        return state_gradient(state, amax, **self._config())

    def update_skipped(self, state: State, amax: jax.Array) -> jax.Array:
        """1 where this step's update is skipped (``te_jax.quantize.delayed.update_skipped``), else 0."""
        return update_skipped(state, amax, **self._config())

    def check_state(self, state: Any) -> None:
        if state is None:
            raise ValueError("te_jax: DelayedScalingQuantizer needs its state; create it with init_state() "
                             "(Flax layers keep it in the \"fp8_meta\" collection: init the model under autocast)")
        if not is_state(state):
            raise ValueError(f"te_jax: a delayed-scaling state is {{'amax_history', 'scale'}}, got {type(state)}")
        view = DelayedState.of(state)
        shape, scale_shape = view.amax_history.shape, view.scale.shape
        if shape != (self.amax_history_len,) or scale_shape != (1,):
            raise ValueError(
                f"te_jax: delayed-scaling state has amax_history {shape} and scale {scale_shape}; "
                f"the recipe wants ({self.amax_history_len},) and (1,). Re-initialize fp8_meta after changing "
                "amax_history_len."
            )

    def fused_cast(self, state=None, *, rowwise=True, colwise=False):
        """The fused cast with the stored scale (the kernel returns this step's amax)."""
        self.check_state(state)
        return CastSpec("fp8_tensor", self.dtype, rowwise, colwise), DelayedState.of(state).scale

    def quantize(self, x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1, key=None, backend=None):
        """Quantizes with ``state["scale"]``; the result's ``amax`` is this step's amax."""
        self.check_state(state)
        x2 = as_matrix(x, flatten_axis)
        scale = DelayedState.of(state).scale
        q, q_t, amax, scale_inv = qops.quantize_fp8_tensor(
            x2, scale, qdtype=self.dtype, rowwise=rowwise, colwise=colwise, backend=backend
        )
        return ScaledTensor.from_kernel_outputs(self.scaling_mode, self.dtype, x.shape, q=q, s=scale_inv, q_t=q_t,
                                                amax=amax, rowwise=rowwise, colwise=colwise, flatten_axis=flatten_axis)
