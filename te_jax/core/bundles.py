"""The quantizer bundles of the functional ops: one quantizer per tensor role of a GEMM.

``DenseQuantizers`` holds the five roles of one GEMM (``te_jax.dense``,
``te_jax.layernorm_dense``); ``MLPQuantizers`` one bundle per GEMM of
``te_jax.layernorm_mlp``. The field <-> role map is ``ROLE_OF``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from te_jax.recipe import ROLES, Recipe, Role

FIELDS = ("input", "weight", "output", "grad_output", "grad_input")
ROLE_OF = dict(zip(FIELDS, ROLES))  # field -> role ("input" -> "linear_input", ...)
FORWARD_FIELDS = ("input", "weight", "output")
BACKWARD_FIELDS = ("grad_output", "grad_input")
GEMMS = ("wi", "wo")  # the GEMMs of an MLP


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

    def stateful(self) -> dict[str, Any]:
        """The roles whose quantizer keeps state, with that quantizer."""
        return {r: q for r, q in self.by_role().items() if q is not None and hasattr(q, "init_state")}

    def init_state(self) -> dict[str, Any]:
        """Initial state for every stateful role ({} for stateless recipes)."""
        return {r: q.init_state() for r, q in self.stateful().items()}


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

    def init_state(self) -> dict[str, dict]:
        """``{"wi": {...}, "wo": {...}}``: the initial state of each GEMM's stateful roles."""
        return {g: q.init_state() for g, q in self.by_gemm().items()}

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
