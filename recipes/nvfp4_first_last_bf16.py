"""NVFP4 everywhere except the first and last transformer blocks, which stay in bf16.

This follows NVIDIA's NVFP4 pretraining recipe: the blocks at both ends of
the network are the most sensitive to quantization and keep high precision;
all other blocks use ``te_jax.recipe.NVFP4BlockScaling()`` (16x16 weight
blocks, random Hadamard transform on the wgrad operands, stochastic rounding
of gradients, so apply the model with ``rngs={"quantize": key}`` and a new key
every step).

A layer's block is read from its module path (``role.path``): the first path
component named like ``TransformerLayer_3``, ``layers_3`` or ``block_3``.
Layers outside numbered blocks (embedding projections, the output head) stay
in bf16 too. Blocks inside ``nn.scan`` share one path, so unroll them to use
this recipe.

Set ``NUM_LAYERS`` to your model's depth, or build a factory for it with
``make_qfactory(num_layers)``.
"""

import re

from te_jax.recipe import NVFP4BlockScaling

NUM_LAYERS = 12
BLOCK_PATTERN = re.compile(r"^(?:.*layers?|.*blocks?|.*TransformerLayer)_(\d+)$", re.IGNORECASE)


def block_index(path):
    """The index of the transformer block a module path lies in, or None."""
    for name in path:
        match = BLOCK_PATTERN.match(name)
        if match:
            return int(match.group(1))
    return None


def make_qfactory(num_layers, inner=NVFP4BlockScaling()):
    """A qfactory: ``inner``'s quantizers for blocks 1 .. num_layers - 2, None (bf16) elsewhere."""

    def qfactory(role):
        index = block_index(getattr(role, "path", ()))
        if index is None or index == 0 or index >= num_layers - 1:
            return None
        return inner.quantizer(role)

    return qfactory


qfactory = make_qfactory(NUM_LAYERS)
