"""``register()``: MaxText's ``quantization=te_jax_<recipe>`` selects a te_jax recipe.

MaxText 0.2.5 has no plug-in point for a quantization backend: its config
validates ``quantization`` against a closed enum (``maxtext.configs.types.
QuantizationType``) and ``maxtext.layers.quantizations.configure_quantization``
maps the names to its own classes. ``register`` changes exactly those two
things, once per process, before MaxText reads its config:

1. the ``quantization`` field of ``MaxTextConfig`` also accepts the registered
   names (the field's type gains a ``Literal`` of them; pydantic rebuilds the
   validator, so any other name is still refused, now listing these too);
2. ``configure_quantization`` returns ``TeJaxQuantization(name, recipe)`` for
   them and calls MaxText's own function for every other name.

It also routes the MoE layer's dropless experts (``sparse_matmul=True``) to
``te_jax.ragged_dot`` under the chosen recipe (``te_jax.maxtext.experts``); with
``megablox`` or ``use_tokamax_gmm``, which never reach ``ragged_dot``,
``configure_quantization`` refuses a te_jax name for an MoE model instead of
leaving its experts in bfloat16.

Everything else is MaxText's: its train step, its "_overwrite_with_gradient"
handling, its MoE layer. ``configure_quantization`` also refuses a stateful
recipe (delayed scaling) together with ``gradient_accumulation_steps > 1``, as
MaxText refuses its own ``fp8``: MaxText's accumulation loop differentiates
the parameters only, so the FP8 state could not be stepped (te_jax would also
refuse it when tracing, with ``FP8StateError``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal

from te_jax.maxtext.ops import QUANTIZATION_PREFIX, builtin_quantizations
from te_jax.recipe.recipes import Recipe

__all__ = ["register", "registered"]

_WHERE = "te_jax.maxtext.register"


def _maxtext():
    try:
        from maxtext.configs import types  # pylint: disable=import-outside-toplevel
        from maxtext.layers import moe, quantizations  # pylint: disable=import-outside-toplevel
    except ImportError as err:
        raise ImportError(f"te_jax: {_WHERE}: MaxText is not importable ({err}); install maxtext (Python >= 3.12: "
                          "pip install maxtext==0.2.5 and the packages its train step imports, docs/integrations.md)"
                          ) from err
    return types, quantizations, moe


def registered() -> dict[str, Recipe]:
    """The names ``register`` added so far and their recipes (empty before the first call)."""
    _, quantizations, _ = _maxtext()
    configure = quantizations.configure_quantization
    return dict(getattr(configure, "te_jax_recipes", {}))


def register(recipes: Mapping[str, Recipe] | None = None) -> dict[str, Recipe]:
    """Let MaxText's ``quantization=`` choose te_jax recipes; call it before MaxText reads its config.

    Args:
      recipes: ``{name: recipe}``; None registers te_jax's built-ins,
        ``te_jax_delayed``, ``te_jax_current``, ``te_jax_block``,
        ``te_jax_mxfp8`` and ``te_jax_nvfp4`` (``te_jax.recipe.BUILTIN``, default
        fields). A name must start with "te_jax_" (MaxText's own names stay
        MaxText's); registering a name again replaces its recipe.

    Returns:
      Every registered name and its recipe.

    Raises:
      ValueError: a name without the prefix, or a value that is not a te_jax recipe.
      ImportError: MaxText is not importable.
    """
    types, quantizations, moe = _maxtext()
    from te_jax.maxtext.experts import route_sparse_experts  # pylint: disable=import-outside-toplevel
    from te_jax.maxtext.quantization import TeJaxQuantization  # pylint: disable=import-outside-toplevel  # MaxText's

    new = builtin_quantizations() if recipes is None else dict(recipes)
    for name, recipe in new.items():
        if not isinstance(name, str) or not name.startswith(QUANTIZATION_PREFIX) or name == QUANTIZATION_PREFIX:
            raise ValueError(f"te_jax: {_WHERE}: quantization name {name!r} must start with {QUANTIZATION_PREFIX!r} "
                             "and name a recipe after it (MaxText's own names stay MaxText's)")
        if not isinstance(recipe, Recipe):
            raise ValueError(f"te_jax: {_WHERE}: {name!r} maps to {recipe!r}, not a te_jax recipe; pass an instance "
                             "such as te_jax.recipe.Float8CurrentScaling()")
    table = {**registered(), **new}
    _accept_names(types, tuple(table))
    original = getattr(quantizations.configure_quantization, "te_jax_original", quantizations.configure_quantization)
    quantizations.configure_quantization = _configure_quantization(original, table, TeJaxQuantization)
    route_sparse_experts(moe, TeJaxQuantization)
    return dict(table)


def _accept_names(types, names: tuple[str, ...]) -> None:
    """``MaxTextConfig.quantization`` accepts MaxText's enum or one of ``names`` (the validator rebuilt)."""
    config_class = types.MaxTextConfig
    field = config_class.model_fields["quantization"]
    field.annotation = None | types.QuantizationType | Literal[names]  # type: ignore[valid-type]
    config_class.model_rebuild(force=True)


def _configure_quantization(original, table: dict[str, Recipe], quantization_class):
    """MaxText's ``configure_quantization`` with ``table``'s names answered by ``TeJaxQuantization``."""

    @functools.wraps(original)
    def configure_quantization(config: Any, quant_mode_str: str = "train"):
        name = str(getattr(config, "quantization", "") or "")
        if name not in table:
            return original(config, quant_mode_str=quant_mode_str)
        if quant_mode_str != "train":
            raise ValueError(f"te_jax: MaxText quantization={name!r}: te_jax quantizes in training only; MaxText asked "
                             f"for quant mode {quant_mode_str!r} (its serve/convert modes are AQT's). Use another "
                             "quantization for serving")
        experts = int(getattr(config, "num_experts", 1) or 1)
        if experts > 1 and getattr(config, "sparse_matmul", False) and (
                getattr(config, "megablox", False) or getattr(config, "use_tokamax_gmm", False)):
            raise ValueError(
                f"te_jax: MaxText quantization={name!r}: the MoE experts' megablox/tokamax kernels take no te_jax "
                "recipe, so the experts would stay in bfloat16: set megablox=False and use_tokamax_gmm=False (the "
                "experts then run on te_jax.ragged_dot), or sparse_matmul=False (the experts' einsums)")
        quant = quantization_class(name, table[name], num_experts=experts if experts > 1 else None)
        accumulation = int(getattr(config, "gradient_accumulation_steps", 1) or 1)
        if quant.stateful and accumulation > 1:
            raise ValueError(
                f"te_jax: MaxText quantization={name!r} keeps FP8 state (delayed scaling), which MaxText's gradient "
                f"accumulation (gradient_accumulation_steps={accumulation}) does not differentiate, so it could not "
                "be stepped: set gradient_accumulation_steps=1, or choose a stateless recipe (te_jax_current, "
                "te_jax_block, te_jax_mxfp8)")
        return quant

    configure_quantization.te_jax_original = original
    configure_quantization.te_jax_recipes = dict(table)
    return configure_quantization
