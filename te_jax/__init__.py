"""te_jax: FP8 and FP4 training for JAX and Flax on NVIDIA GPUs."""

from te_jax import _ffi, backend, ops, quantize

__version__ = "0.1.0"
FP8_COLLECTION = "fp8_meta"

# Imported after FP8_COLLECTION, which te_jax.state reads from here.
from te_jax import inspect, recipe, sharding, state, train  # noqa: E402
from te_jax.autocast import autocast  # noqa: E402
from te_jax.dense import DenseQuantizers, dense  # noqa: E402
from te_jax.inspect.stats import STATS_COLLECTION  # noqa: E402
from te_jax.layernorm_dense import layernorm_dense  # noqa: E402
from te_jax.layernorm_mlp import MLPQuantizers, layernorm_mlp  # noqa: E402
from te_jax.sharding import MeshResource  # noqa: E402

__all__ = [
    "FP8_COLLECTION", "STATS_COLLECTION", "DenseQuantizers", "MLPQuantizers", "MeshResource", "autocast", "backend",
    "dense", "inspect", "layernorm_dense", "layernorm_mlp", "ops", "quantize", "recipe", "sharding", "state", "train",
]


def __getattr__(name: str):
    # te_jax.flax (the Linen layers) is imported on first use, not with te_jax.
    if name == "flax":
        import importlib

        return importlib.import_module("te_jax.flax")
    raise AttributeError(f"module 'te_jax' has no attribute {name!r}")
