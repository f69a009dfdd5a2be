"""MaxText on te_jax: ``quantization=te_jax_current`` (``_delayed``, ``_block``, ...) in MaxText's own trainer.

::

    import te_jax.maxtext
    te_jax.maxtext.register()        # before MaxText reads its config
    from maxtext.trainers.pre_train import train
    train.main([None, "base.yml", "quantization=te_jax_current", ...])

or, from a shell, ``python -m te_jax.maxtext.train base.yml quantization=te_jax_current ...``
(MaxText's ``python -m maxtext.trainers.pre_train.train`` after ``register()``).

``register`` (te_jax.maxtext.register) makes MaxText's config accept the names
and its ``configure_quantization`` answer them with ``TeJaxQuantization``
(``te_jax.maxtext.quantization``, which imports MaxText; this package
imports it only when ``register`` runs), whose ``dot_general_cls`` and ``einsum`` run
te_jax's quantized GEMMs under the chosen recipe: every ``DenseGeneral``
MaxText gives its quantization object (attention projections, MLP, MoE
router; not the logits projection, as with MaxText's ``fp8``) and, with
``sparse_matmul=False``, the MoE experts' einsums. In MaxText's dropless path
(``sparse_matmul=True, megablox=False``) the experts' ``ragged_dot`` calls run on
``te_jax.ragged_dot`` under the recipe (``te_jax.maxtext.experts``; stateless
recipes); megablox and tokamax experts are refused at config time. A leaf of
te_jax: nothing in te_jax imports it.
"""

from te_jax.maxtext.ops import QUANTIZATION_PREFIX, DotGeneralOp, EinsumOp, builtin_quantizations
from te_jax.maxtext.register import register, registered

__all__ = ["DotGeneralOp", "EinsumOp", "QUANTIZATION_PREFIX", "builtin_quantizations", "register", "registered"]
