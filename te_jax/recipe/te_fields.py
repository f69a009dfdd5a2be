"""TransformerEngine recipe fields that te_jax's recipes do not have, each with what to do instead.

A TE recipe ported as written (``DelayedScaling(fp8_dpa=True)``) would get
Python's bare "unexpected keyword argument"; ``check_te_fields`` raises a
``TypeError`` that says what the field did in TransformerEngine and what
te_jax offers (or that it has nothing to offer), so the argument can be
dropped or replaced knowingly.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["TE_ONLY_FIELDS", "check_te_fields"]

_NO_FP8_ATTENTION = ("te_jax has no FP8 attention: attention (te_jax.flax.TransformerLayer's included) runs in the "
                     "model's compute dtype, e.g. bfloat16, under every recipe, and only the linear layers' GEMMs "
                     "are quantized; drop the argument")
_QPARAMS = ("te_jax has no per-tensor QParams: Float8CurrentScaling(use_power_2_scales=..., amax_epsilon=...) set "
            "them for every tensor, and a te_jax.recipe.CustomRecipe whose qfactory returns "
            "te_jax.quantize.CurrentScalingQuantizer(power_2_scales=..., amax_epsilon=...) per role sets them per "
            "tensor")
_MMPARAMS = ("te_jax has no per-GEMM MMParams: fast_accumulation=True (the forward GEMM) and "
             "backward_fast_accumulation=True (dgrad and wgrad) are MMParams(use_split_accumulator=False); the "
             "defaults are split accumulation in the backward GEMMs and fast accumulation in the forward one")
_NVFP4_QPARAMS = ("te_jax's NVFP4BlockScaling takes disable_rht, disable_stochastic_rounding and "
                  "disable_2d_quantization instead; a CustomRecipe returning te_jax.quantize.NVFP4Quantizer(...) per "
                  "role sets them per tensor")

TE_ONLY_FIELDS = {
    "fp8_dpa": _NO_FP8_ATTENTION,
    "fp8_mha": _NO_FP8_ATTENTION,
    "interval": ("te_jax updates a delayed-scaling scale after every step (TransformerEngine deprecated interval "
                 "and ignores it); drop the argument"),
    "override_linear_precision": (
        "te_jax has no per-GEMM precision override: to keep a tensor in high precision, use a "
        "te_jax.recipe.CustomRecipe whose qfactory returns None for its role (e.g. \"linear_grad_output\"; a GEMM "
        "with one unquantized operand runs in float32 on the other's dequantized values)"),
    "backward_override": ("te_jax has no backward override: a te_jax.recipe.CustomRecipe whose qfactory returns None "
                          "for \"linear_grad_output\" keeps the gradients in high precision"),
    "fp8_quant_fwd_inp": _QPARAMS,
    "fp8_quant_fwd_weight": _QPARAMS,
    "fp8_quant_bwd_grad": _QPARAMS,
    "fp8_gemm_fprop": _MMPARAMS,
    "fp8_gemm_dgrad": _MMPARAMS,
    "fp8_gemm_wgrad": _MMPARAMS,
    "fp4_format": "E2M1 is te_jax's only FP4 format; drop the argument",
    "fp4_quant_fwd_inp": _NVFP4_QPARAMS,
    "fp4_quant_fwd_weight": _NVFP4_QPARAMS,
    "fp4_quant_bwd_grad": _NVFP4_QPARAMS,
    "margin": ("only DelayedScaling has a margin in te_jax: the block recipes' scales come from each block's own "
               "amax (MXFP8's E8M0 scales round it to a power of two; TransformerEngine ignores margin there too); "
               "drop the argument"),
}
"""TransformerEngine recipe field -> what te_jax does instead (the end of the error's message)."""


def check_te_fields(recipe: str, fields: Iterable[str], given: Iterable[str]) -> None:
    """Raises ``TypeError`` when ``given`` (the keyword arguments) names a TE-only field ``recipe`` lacks.

    ``fields`` are the recipe's own fields (a field te_jax has, like
    DelayedScaling's margin, is never refused here).
    """
    for name in sorted(set(given) - set(fields)):
        if name in TE_ONLY_FIELDS:
            raise TypeError(f"te_jax: {recipe} has no {name}= (a TransformerEngine recipe field): "
                            f"{TE_ONLY_FIELDS[name]}")
