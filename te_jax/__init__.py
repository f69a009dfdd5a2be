"""te_jax: FP8 and FP4 training for JAX and Flax on NVIDIA GPUs.

The public face::

    te_jax.autocast, te_jax.recipe          how tensors are quantized, and where
    te_jax.MeshResource                     which mesh axes play which role
    te_jax.dense, layernorm_dense, layernorm_mlp, grouped_dense, grouped_mlp
                                            the functional ops
    te_jax.ragged_dot                       jax.lax.ragged_dot, quantized under autocast (MoE experts)
    te_jax.flax, te_jax.nnx                 Linen and NNX layers
    te_jax.train                            value_and_grad and TrainState for FP8 state
    te_jax.inspect                          quantization statistics
    te_jax.quantize, te_jax.ops             quantizers and primitives, for custom recipes and kernels

The package is layered, one folder a floor (docs/architecture.md):
``spec`` < ``ops`` < ``quantize`` < ``recipe`` < ``core`` < ``moe`` <
``train`` < ``flax`` / ``nnx`` < ``inspect``. ``flax``, ``nnx``, ``train``,
``inspect`` and ``moe`` are imported on first use, so ``import te_jax`` does
not load Flax's module system.
"""

import importlib

from te_jax import _compat

_compat.install()  # first: old import paths resolve from here on

from te_jax import ops, quantize, recipe  # noqa: E402
from te_jax.core.dense import dense  # noqa: E402
from te_jax.core.grouped_dense import grouped_dense  # noqa: E402
from te_jax.core.grouped_mlp import grouped_mlp  # noqa: E402
from te_jax.core.layernorm_dense import layernorm_dense  # noqa: E402
from te_jax.core.layernorm_mlp import layernorm_mlp  # noqa: E402
from te_jax.core.ragged_dot import ragged_dot  # noqa: E402
from te_jax.ops.sharding import MeshResource  # noqa: E402
from te_jax.recipe.autocast import autocast  # noqa: E402
from te_jax.spec.names import FP8_COLLECTION  # noqa: E402

__version__ = "0.1.0"

_LAZY_MODULES = ("flax", "inspect", "moe", "nnx", "train")

__all__ = [
    "FP8_COLLECTION", "MeshResource", "autocast", "dense", "flax", "grouped_dense", "grouped_mlp", "inspect",
    "layernorm_dense", "layernorm_mlp", "moe", "nnx", "ops", "quantize", "ragged_dot", "recipe", "train",
]

def __getattr__(name: str):
    if name not in _LAZY_MODULES:
        return _compat.moved_attribute(__name__, name)  # an old name warns once; any other raises AttributeError
    value = importlib.import_module(f"te_jax.{name}")
    globals()[name] = value
    return value
