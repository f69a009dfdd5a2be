"""The recipe floor: roles, recipes, the autocast context and the recipe gallery.

A recipe is a frozen, hashable quantizer factory (``recipe.quantizer(role)``);
``te_jax.autocast`` is the one place a recipe and mesh axes come from context.
"""

from te_jax.recipe.gallery import load_recipe, recipe_names
from te_jax.recipe.recipes import (BUILTIN, GRADIENT_ROLES, LINEAR_GRAD_INPUT, LINEAR_GRAD_OUTPUT, LINEAR_INPUT,
                                   LINEAR_OUTPUT, LINEAR_WEIGHT, ROLES, BlockScaledRecipe, CustomRecipe,
                                   DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                                   MXFP8BlockScaling, NVFP4BlockScaling, Recipe, Role, as_role)

__all__ = [
    "BUILTIN", "GRADIENT_ROLES", "LINEAR_GRAD_INPUT", "LINEAR_GRAD_OUTPUT", "LINEAR_INPUT", "LINEAR_OUTPUT",
    "LINEAR_WEIGHT", "ROLES", "BlockScaledRecipe", "CustomRecipe", "DelayedScaling", "Float8BlockScaling",
    "Float8CurrentScaling", "Format", "MXFP8BlockScaling", "NVFP4BlockScaling", "Recipe", "Role", "as_role",
    "load_recipe", "recipe_names",
]
