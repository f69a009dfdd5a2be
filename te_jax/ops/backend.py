"""Which implementation the ops run: the FFI kernels (default) or the pure-JAX reference.

The choice lives in ``te_jax.ops.primitive`` (``use``, ``current``, ``resolve``);
this module keeps its public path ``te_jax.ops.backend.use("reference")``.
"""

from te_jax.ops.primitive import BACKENDS, current, resolve, use

__all__ = ["BACKENDS", "current", "resolve", "use"]
