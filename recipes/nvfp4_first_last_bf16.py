"""NVFP4 everywhere except the first and last transformer blocks, which stay in bf16.

This follows NVIDIA's NVFP4 pretraining recipe: the blocks at both ends of
the network are the most sensitive to quantization and keep high precision;
all other blocks use ``te_jax.recipe.NVFP4BlockScaling()`` (16x16 weight
blocks, random Hadamard transform on the wgrad operands, stochastic rounding
of gradients, so apply the model with ``rngs={"quantize": key}`` and a new key
every step).

A layer's block is read from its module path (``role.path``): the first path
component named like ``TransformerLayer_3``, ``layers_3`` or ``block_3``
(Linen's names), or a number after a component named like ``layers`` or
``blocks`` (an NNX model's list of blocks: ``("blocks", "3", ...)``).
Layers outside numbered blocks (embedding projections, the output head) stay
in bf16 too. Blocks inside ``nn.scan`` share one path, so unroll them to use
this recipe.

Which block is the last depends on the model, so this recipe has no default
depth: load it with the model's number of blocks, ::

    recipe = te_jax.recipe.load_recipe("nvfp4_first_last_bf16", num_layers=model_depth)

(``load_recipe`` without ``num_layers`` is an error that says so), or build
the factory yourself with ``make_qfactory(num_layers)``. A layer whose path
lies in a block past ``num_layers - 1`` raises an error when it asks for its
quantizer: the recipe was built for a shallower model than the one it runs.
"""

import re

from te_jax.recipe import NVFP4BlockScaling

BLOCKS = r"(?:.*layers?|.*blocks?|.*TransformerLayers?)"
BLOCK_PATTERN = re.compile(rf"^{BLOCKS}_(\d+)$", re.IGNORECASE)  # Linen: "layers_3"
BLOCK_LIST = re.compile(rf"^{BLOCKS}$", re.IGNORECASE)  # NNX: "blocks", then "3"


def block_index(path):
    """The index of the transformer block a module path lies in, or None."""
    path = [str(name) for name in path]
    for i, name in enumerate(path):
        match = BLOCK_PATTERN.match(name)
        if match:
            return int(match.group(1))
        if BLOCK_LIST.match(name) and i + 1 < len(path) and path[i + 1].isdigit():
            return int(path[i + 1])
    return None


def make_qfactory(num_layers, inner=NVFP4BlockScaling()):
    """A qfactory for a model of ``num_layers`` blocks: ``inner``'s quantizers for blocks 1 .. num_layers - 2,
    None (bf16) for blocks 0 and num_layers - 1 and outside numbered blocks."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"te_jax: nvfp4_first_last_bf16: num_layers must be a positive int (the model's number of "
                         f"transformer blocks), got {num_layers!r}")

    def qfactory(role):
        path = getattr(role, "path", ())
        index = block_index(path)
        if index is not None and index >= num_layers:
            raise ValueError(
                f"te_jax: nvfp4_first_last_bf16 was built for num_layers={num_layers}, but the layer at "
                f"{'/'.join(path)} lies in block {index}: load it with the model's depth, "
                "load_recipe('nvfp4_first_last_bf16', num_layers=<number of blocks>)")
        if index is None or index == 0 or index == num_layers - 1:
            return None
        return inner.quantizer(role)

    return qfactory
