"""te_jax: FP8 and FP4 training for JAX and Flax on NVIDIA GPUs.

``import te_jax`` loads the ops, quantization and sharding layers; the
functional layers (``dense``, ``grouped_dense``, ``grouped_mlp``, ``layernorm_dense``,
``layernorm_mlp``), the recipes, ``autocast``, the Flax helpers (``state``, ``train``, ``flax``, ``nnx``) and
``inspect`` are imported on first use, so that ``import te_jax.ops`` never
loads Flax or anything above the ops layer.
"""

import importlib
import sys
import types

from te_jax import _ffi, backend, ops, quantize, sharding
from te_jax._names import FP8_COLLECTION, STATS_COLLECTION
from te_jax.sharding import MeshResource

__version__ = "0.1.0"

_LAZY_MODULES = ("autocast", "dense", "flax", "grouped_dense", "grouped_mlp", "inspect", "layernorm_dense",
                 "layernorm_mlp", "nnx", "recipe", "state", "train")
_LAZY_NAMES = {
    "DenseQuantizers": "te_jax.dense",
    "MLPQuantizers": "te_jax.layernorm_mlp",
    "dense": "te_jax.dense",
    "grouped_dense": "te_jax.grouped_dense",
    "grouped_mlp": "te_jax.grouped_mlp",
    "layernorm_dense": "te_jax.layernorm_dense",
    "layernorm_mlp": "te_jax.layernorm_mlp",
    "autocast": "te_jax.autocast",
}

__all__ = [
    "FP8_COLLECTION", "STATS_COLLECTION", "DenseQuantizers", "MLPQuantizers", "MeshResource", "autocast", "backend",
    "dense", "grouped_dense", "grouped_mlp", "inspect", "layernorm_dense", "layernorm_mlp", "nnx", "ops", "quantize", "recipe",
    "sharding", "state", "train",
]


def __getattr__(name: str):
    # The functions dense / grouped_dense / grouped_mlp / layernorm_dense / layernorm_mlp / autocast share their
    # module's name:
    # the function wins.
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f"te_jax.{name}")
    else:
        raise AttributeError(f"module 'te_jax' has no attribute {name!r}")
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """te_jax's module type: importing the submodule ``te_jax.dense`` (etc.) keeps ``te_jax.dense`` the function."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAZY_NAMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
