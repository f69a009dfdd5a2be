"""Per-tensor current scaling, written as a custom recipe: the reference example.

E4M3 for the input and weight, E5M2 for the output and the output gradient
(the output is quantized, then dequantized), and the dgrad output (role
"linear_grad_input") left in high precision. Use it with::

    recipe = te_jax.recipe.load_recipe("recipes/current_scaling_ref.py")
    with te_jax.autocast(recipe=recipe):
        ...
"""

import jax.numpy as jnp

from te_jax.quantize import CurrentScalingQuantizer


def current_scaling_ref_quantizer_factory(role):
    if role in ("linear_input", "linear_weight"):
        dtype = jnp.float8_e4m3fn
    elif role in ("linear_output", "linear_grad_output"):
        dtype = jnp.float8_e5m2
    else:
        return None
    return CurrentScalingQuantizer(dtype=dtype)


qfactory = current_scaling_ref_quantizer_factory
