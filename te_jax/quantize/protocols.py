"""The quantizer interfaces the layers call, declared.

``Quantizer`` is all a quantizer must have: a ``CustomRecipe`` may return any
object with a ``quantize`` method. Everything else is an optional capability,
each declared here as its own ``Protocol`` (``runtime_checkable``): the core
asks ``isinstance(q, Capability)`` (or the helpers of ``te_jax.core.bundles``) and a quantizer
without one takes the fallback written next to it.

* ``StatefulQuantizer``: keeps state across steps (delayed scaling). A role
  whose quantizer has it gets an "fp8_meta" entry; the quantizer must accept
  that state in ``quantize``. The documented minimum of a custom stateful
  quantizer is ``init_state`` and ``update_state`` (``KeepsState``);
  ``as_stateful`` completes such a one with the defaults of
  ``StateDefaults``.
* ``HasScalingMode``: ``scaling_mode``, the ``te_jax.spec.modes`` entry it
  writes (block-shape checks, grouped span alignment). Without: no block
  checks, alignment 1.
* ``StochasticRounding``: ``stochastic_rounding``; True means ``quantize``
  needs a ``key``. Without: False.
* ``FusedCast``: ``fused_cast(state, *, rowwise, colwise)``, the ``(CastSpec,
  scale)`` that writes the same ScaledTensor from inside a fused norm /
  activation kernel, or None (``te_jax.quantize.fused``; such a quantizer also
  has ``dtype``). Without: the unfused path.
* ``QuantizeLike``: ``quantize_like(x, like, *, rowwise, colwise,
  flatten_axis)``, ``x`` cast with the scale ``like`` was cast with. Without:
  ``quantize`` with the role's state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

from te_jax.spec import modes
from te_jax.spec.modes import CastSpec, ScaledTensor


@runtime_checkable
class Quantizer(Protocol):
    """Turns a high-precision tensor into a ``ScaledTensor``.

    ``x`` is viewed as the matrix ``[prod(shape[:flatten_axis]),
    prod(shape[flatten_axis:])]``; the columnwise copy is the quantization of
    its transpose. ``state`` is None for stateless quantizers; ``key`` a PRNG
    key (stochastic rounding) or None.
    """

    def quantize(self, x: jax.Array, state: Any = None, *, rowwise: bool = True, colwise: bool = False,
                 flatten_axis: int = -1, key: jax.Array | None = None) -> ScaledTensor: ...


@runtime_checkable
class KeepsState(Quantizer, Protocol):
    """The documented minimum of a stateful quantizer: an initial state and its update from a step's amax."""

    def init_state(self) -> Any: ...

    def update_state(self, state: Any, amax: jax.Array) -> Any: ...


@runtime_checkable
class StatefulQuantizer(KeepsState, Protocol):
    """A quantizer with state, as the core drives it (``te_jax.core.gemm_quant.GemmQuant``).

    Attributes:
      reduce_amax: reduce this tensor's amax across devices before ``update_state``.
      amax_reduction: "max" or "mean", the reduction ``reduce_amax`` asks for.

    Methods:
      init_state(): the initial state (a pytree of float32 arrays).
      update_state(state, amax): the state after a step whose tensor had amax ``amax``.
      state_gradient(state, amax): that update in the form training carries as the
        gradient of the state (merged across uses by elementwise max); for delayed
        scaling, ``te_jax.quantize.delayed.StateUpdate``.
      check_state(state): raises a clear ValueError when ``state`` does not fit.
    """

    reduce_amax: bool
    amax_reduction: str

    def state_gradient(self, state: Any, amax: jax.Array) -> Any: ...

    def check_state(self, state: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class StateDefaults:
    """A ``KeepsState`` quantizer completed to a ``StatefulQuantizer``: its update is its own gradient form,
    any state passes ``check_state``, and its amax is not reduced across devices."""

    inner: Any
    reduce_amax = False
    amax_reduction = "max"

    def quantize(self, x, state=None, **kwargs):
        return self.inner.quantize(x, state, **kwargs)

    def init_state(self):
        return self.inner.init_state()

    def update_state(self, state, amax):
        return self.inner.update_state(state, amax)

    def state_gradient(self, state, amax):
        return self.inner.update_state(state, amax)

    def check_state(self, state) -> None:
        return None


@runtime_checkable
class HasScalingMode(Protocol):
    scaling_mode: modes.ModeSpec


@runtime_checkable
class StochasticRounding(Protocol):
    stochastic_rounding: bool


@runtime_checkable
class FusedCast(Protocol):
    def fused_cast(self, state: Any = None, *, rowwise: bool = True,
                   colwise: bool = False) -> tuple[CastSpec, Any] | None: ...


@runtime_checkable
class QuantizeLike(Protocol):
    def quantize_like(self, x: jax.Array, like: ScaledTensor, *, rowwise: bool = True, colwise: bool = False,
                      flatten_axis: int = -1) -> ScaledTensor: ...


__all__ = ["FusedCast", "HasScalingMode", "KeepsState", "QuantizeLike", "Quantizer", "StateDefaults",
           "StatefulQuantizer", "StochasticRounding"]
