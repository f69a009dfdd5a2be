"""The quantizer bundles of the functional ops: one quantizer per tensor role of a GEMM.

``DenseQuantizers`` holds the five roles of one GEMM (``te_jax.dense``,
``te_jax.layernorm_dense``); ``MLPQuantizers`` one bundle per GEMM of
``te_jax.layernorm_mlp``. The field <-> role map is ``ROLE_OF``.

``QuantizerBundle`` declares what the layers call on a bundle: it holds for
``DenseQuantizers`` and ``MLPQuantizers`` here and for the MoE's
``ExpertQuantizers`` and ``MoEQuantizers`` (``te_jax.moe.experts``); the
one-GEMM bundles (``DenseQuantizers``, ``ExpertQuantizers``) are also
``GemmBundle``s, the two-GEMM ones ``MultiGemmBundle``s. The quantizers in a
bundle follow ``te_jax.quantize.protocols``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from te_jax.quantize.protocols import HasScalingMode, KeepsState, StateDefaults, StatefulQuantizer, StochasticRounding
from te_jax.recipe import ROLES, Recipe, Role
from te_jax.spec.modes import ModeSpec


FIELDS = ("input", "weight", "output", "grad_output", "grad_input")
ROLE_OF = dict(zip(FIELDS, ROLES))  # field -> role ("input" -> "linear_input", ...)
FORWARD_FIELDS = ("input", "weight", "output")
BACKWARD_FIELDS = ("grad_output", "grad_input")
GEMMS = ("wi", "wo")  # the GEMMs of an MLP


@runtime_checkable
class QuantizerBundle(Protocol):
    """The quantizers of one layer's GEMM(s), as the layers use them.

    ``any``: whether anything is quantized; ``quantized_roles()``: the roles
    with a quantizer (a tuple, or ``{gemm: tuple}``); ``init_state()``: the
    initial FP8 state of the stateful roles (``{role: state}``, or
    ``{gemm: {role: state}}``), the layout of the layer's "fp8_meta" entries.
    """

    @property
    def any(self) -> bool: ...

    def quantized_roles(self) -> tuple[str, ...] | dict[str, tuple[str, ...]]: ...

    def init_state(self) -> dict[str, Any]: ...


@runtime_checkable
class GemmBundle(QuantizerBundle, Protocol):
    """A bundle of one GEMM: ``stateful()`` is ``{role: StatefulQuantizer}`` of the roles that keep state."""

    def stateful(self) -> dict[str, StatefulQuantizer]: ...


@runtime_checkable
class MultiGemmBundle(QuantizerBundle, Protocol):
    """A bundle of several GEMMs (an MLP's "wi" and "wo"): ``by_gemm()`` is ``{gemm: GemmBundle}``."""

    def by_gemm(self) -> dict[str, GemmBundle]: ...


# ---- what the core asks of a quantizer (te_jax.quantize.protocols) ----


def as_stateful(q: Any) -> StatefulQuantizer | None:
    """``q`` as a ``StatefulQuantizer`` (completed by ``StateDefaults`` when it has the minimum only), or None
    when it keeps no state (None included)."""
    if isinstance(q, StatefulQuantizer):
        return q
    if isinstance(q, KeepsState):
        return StateDefaults(q)
    return None


def scaling_mode_of(q: Any) -> ModeSpec | None:
    """``q.scaling_mode``, or None for no quantizer or one that does not declare it."""
    return q.scaling_mode if isinstance(q, HasScalingMode) else None


def rounds_stochastically(q: Any) -> bool:
    """Whether ``q`` rounds stochastically (and so needs a key)."""
    return isinstance(q, StochasticRounding) and bool(q.stochastic_rounding)


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
      autotune: the GEMMs time cuBLASLt's candidates on first use and keep
        the fastest (the recipe's ``gemm_autotune``; default off, so results
        are the same bits in every run).
    """

    input: Any = None
    weight: Any = None
    output: Any = None
    grad_output: Any = None
    grad_input: Any = None
    fast_accum: bool | None = None
    backward_fast_accum: bool = False
    autotune: bool = False

    @classmethod
    def from_recipe(cls, recipe: Recipe | None, path: tuple[str, ...] | str = ()) -> DenseQuantizers:
        """Asks ``recipe`` for each role, passing the layer's module ``path`` in the Role."""
        if recipe is None:
            return cls()
        return cls(**{f: recipe.quantizer(Role(r, path)) for f, r in ROLE_OF.items()},
                   fast_accum=recipe.fast_accumulation,
                   backward_fast_accum=recipe.backward_fast_accumulation, autotune=recipe.gemm_autotune)

    @classmethod
    def from_mapping(cls, quantizers: Mapping[str, Any]) -> DenseQuantizers:
        """From ``{role: quantizer}``; roles left out stay in high precision."""
        unknown = set(map(str, quantizers)) - set(ROLES)
        if unknown:
            raise ValueError(f"te_jax: unknown roles {sorted(unknown)}; roles are {ROLES}")
        return cls(**{f: quantizers.get(r) for f, r in ROLE_OF.items()})

    def by_role(self) -> dict[str, Any]:
        """``{role: quantizer}`` for every role (None where high precision)."""
        return {r: getattr(self, f) for f, r in ROLE_OF.items()}

    @property
    def any(self) -> bool:
        """Whether any role has a quantizer."""
        return any(q is not None for q in self.by_role().values())

    def quantized_roles(self) -> tuple[str, ...]:
        """The roles that have a quantizer."""
        return tuple(r for r, q in self.by_role().items() if q is not None)

    def stateful(self) -> dict[str, StatefulQuantizer]:
        """The roles whose quantizer keeps state, with that quantizer (``as_stateful``:
        a custom one with only ``init_state``/``update_state`` comes completed with the defaults)."""
        return {r: s for r, s in ((r, as_stateful(q)) for r, q in self.by_role().items()) if s is not None}

    def init_state(self, num_groups: int | None = None) -> dict[str, Any]:
        """Initial state for every stateful role ({} for stateless recipes).

        ``num_groups``: the state of ``te_jax.grouped_dense`` over that many
        experts, whose "linear_weight" state has a leading ``num_groups`` axis
        (one amax history per expert weight).
        """
        state = {r: q.init_state() for r, q in self.stateful().items()}
        weight = ROLE_OF["weight"]
        if num_groups is not None and weight in state:
            state[weight] = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_groups, *a.shape)), state[weight])
        return state


def as_quantizers(quantizers: DenseQuantizers | Mapping[str, Any] | None) -> DenseQuantizers:
    """A ``DenseQuantizers`` from what a functional op accepts (a bundle, ``{role: quantizer}`` or None)."""
    if quantizers is None:
        return DenseQuantizers()
    if isinstance(quantizers, DenseQuantizers):
        return quantizers
    if isinstance(quantizers, Mapping):
        return DenseQuantizers.from_mapping(quantizers)
    raise TypeError(f"te_jax: quantizers must be a DenseQuantizers, a mapping role -> quantizer, or None; "
                    f"got {type(quantizers).__name__}")


@dataclasses.dataclass(frozen=True)
class MLPQuantizers:
    """The quantizers of the MLP's two GEMMs.

    Attributes:
      wi: the first GEMM's (its "linear_input" writes the norm output, its
        "linear_grad_output" the activation's gradient).
      wo: the second GEMM's (its "linear_input" writes the activation output).
    """

    wi: DenseQuantizers = DenseQuantizers()
    wo: DenseQuantizers = DenseQuantizers()

    @classmethod
    def from_recipe(cls, recipe: Recipe | None, path: tuple[str, ...] = ()) -> MLPQuantizers:
        """Asks ``recipe`` per role with the paths ``path + ("wi",)`` and ``path + ("wo",)``."""
        path = tuple(path)
        return cls(*(DenseQuantizers.from_recipe(recipe, path + (g,)) for g in GEMMS))

    def by_gemm(self) -> dict[str, DenseQuantizers]:
        """``{"wi": ..., "wo": ...}``."""
        return {g: getattr(self, g) for g in GEMMS}

    @property
    def any(self) -> bool:
        """Whether any role of either GEMM has a quantizer."""
        return self.wi.any or self.wo.any

    def init_state(self, num_groups: int | None = None) -> dict[str, dict]:
        """``{"wi": {...}, "wo": {...}}``: the initial state of each GEMM's stateful roles (``num_groups``: of
        ``te_jax.grouped_mlp`` over that many experts, as ``DenseQuantizers.init_state`` says)."""
        return {g: q.init_state(num_groups) for g, q in self.by_gemm().items()}

    def quantized_roles(self) -> dict[str, tuple[str, ...]]:
        """``{"wi": roles, "wo": roles}``: each GEMM's roles that have a quantizer."""
        return {g: q.quantized_roles() for g, q in self.by_gemm().items()}


def as_mlp_quantizers(quantizers: MLPQuantizers | Mapping | None) -> MLPQuantizers:
    """An ``MLPQuantizers`` from a bundle, ``{"wi": ..., "wo": ...}`` (each as ``as_quantizers`` takes) or None."""
    if quantizers is None:
        return MLPQuantizers()
    if isinstance(quantizers, MLPQuantizers):
        return quantizers
    if isinstance(quantizers, Mapping) and set(quantizers) <= set(GEMMS):
        return MLPQuantizers(*(as_quantizers(quantizers.get(g)) for g in GEMMS))
    raise TypeError(f"te_jax: layernorm_mlp: quantizers must be an MLPQuantizers, a mapping {{'wi': ..., 'wo': ...}} "
                    f"or None; got {type(quantizers).__name__}")


HIGH_PRECISION = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_high_precision(where: str, **arrays) -> None:
    """Every array given (None skipped) must be float32, bfloat16 or float16."""
    for name, a in arrays.items():
        if a is not None and jnp.dtype(a.dtype) not in HIGH_PRECISION:
            raise TypeError(f"te_jax: {where}: {name} must be float32, bfloat16 or float16, got {a.dtype}")


def check_no_dot_general(where: str, dot_general, quantized: bool) -> None:
    """A custom ``dot_general`` serves the unquantized path only (te_jax's GEMMs replace it under a recipe)."""
    if dot_general is not None and quantized:
        raise ValueError(f"te_jax: {where}: a custom dot_general cannot be combined with quantizers (te_jax's "
                         "quantized GEMMs replace it); drop one of them")


def contracting_axes(dims, ndim: int, what: str, where: str) -> tuple[int, ...]:
    """``dims`` (an int or ints, negative allowed) as distinct non-negative axes of a rank-``ndim`` array."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    out = tuple(d % ndim for d in dims if -ndim <= d < ndim)
    if len(out) != len(dims) or len(set(out)) != len(out):
        raise ValueError(f"te_jax: {where}: {what} contracting dims {dims} are not distinct axes of a "
                         f"rank-{ndim} array")
    return out


def check_state(q: DenseQuantizers, state: Mapping | None, where: str,
                init: str = "quantizers.init_state()") -> dict[str, Any]:
    """The states of ``q``'s stateful roles, checked (missing or malformed ones raise a clear error).

    ``init``: the call that makes the state, as the message names it.
    """
    stateful, state = q.stateful(), dict(state or {})
    missing = [r for r in stateful if r not in state]
    if missing:
        raise ValueError(f"te_jax: {where}: no state for the stateful quantizers of {missing}; pass "
                         f"state={init} (Flax layers: init the model under te_jax.autocast)")
    for r, qr in stateful.items():
        qr.check_state(state[r])
    return {r: dict(state[r]) for r in stateful}


def check_key(q: DenseQuantizers, fields, where: str) -> None:
    """Raises when a quantizer of ``fields`` rounds stochastically (it needs a key and none was given)."""
    needy = [ROLE_OF[f] for f in fields if rounds_stochastically(getattr(q, f))]
    if needy:
        raise ValueError(
            f"te_jax: {where}: the quantizers of {needy} round stochastically and need key=<a PRNG key that "
            "changes every step> (Flax layers: apply with rngs={'quantize': key}); or disable it, e.g. "
            "NVFP4BlockScaling(disable_stochastic_rounding=True)")


def check_gemm(q: DenseQuantizers, state: Mapping | None, key, where: str) -> dict[str, Any]:
    """The checks of one quantized GEMM, in one order: state, forward key.

    Every shape is accepted: block-scaled quantizers give a partial block its
    own scale and the GEMM zero pads the contraction axis.
    Returns the states of the stateful roles (``check_state``). The backward
    roles' key is checked when the backward is traced (``GemmQuant``).
    """
    inner = check_state(q, state, where)
    if key is None:
        check_key(q, FORWARD_FIELDS, where)
    return inner


def raw_key(key: jax.Array | None) -> jax.Array | None:
    """A typed PRNG key as its raw uint32 data (what ``jax.random.fold_in`` inside a custom VJP takes)."""
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key
