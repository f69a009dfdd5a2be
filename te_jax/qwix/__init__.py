"""te_jax's Qwix provider (the optional extra ``te_jax[qwix]``): FP8 for unmodified Linen and NNX models.

``qwix.quantize_model(model, te_jax.qwix.Provider(rules))`` routes the
model's ``dot_general``, ``einsum`` and ``ragged_dot`` calls to te_jax's
kernels under ``te_jax.autocast``, the rules (``te_jax.qwix.Rule``) choosing
the recipe per module path (``te_jax/qwix/provider.py``; docs/integrations.md).
"""

from te_jax.qwix.provider import Provider, Rule

__all__ = ["Provider", "Rule"]
