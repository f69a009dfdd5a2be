"""Old import paths of moved public modules: they keep working for one release and warn once.

``import te_jax.sharding`` (and every other path in ``MOVED``) returns the
module at its new path, after one ``DeprecationWarning`` that names it.
The table is the whole mechanism: an import finder looks names up in it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    "te_jax.backend": "te_jax.ops.backend",
    "te_jax.sharding": "te_jax.ops.sharding",
    "te_jax.state": "te_jax.train.step",
    "te_jax.state_grad": "te_jax.core.gemm_quant",
    "te_jax.inspect.stats": "te_jax.core.stats",
    "te_jax.quantize.modes": "te_jax.spec.modes",
    "te_jax.quantize.numerics": "te_jax.spec.numerics",
    "te_jax.quantize.reference": "te_jax.spec.reference",
    "te_jax.quantize.ref_norm_act": "te_jax.spec.reference_norm_act",
    "te_jax.quantize.scaled_tensor": "te_jax.spec.modes",
    "te_jax.ops.fused_cast": "te_jax.ops.cast",
    "te_jax.ops.partition": "te_jax.ops.primitive",
    "te_jax.ops.grouped_gemm": "te_jax.ops.grouped.gemm",
    "te_jax.ops.grouped_layout": "te_jax.ops.grouped.layout",
    "te_jax.ops.grouped_reference": "te_jax.ops.grouped.reference",
    "te_jax.ops.norm": "te_jax.ops.norm_act",
    "te_jax.ops.activation": "te_jax.ops.norm_act",
}
"""Old module path -> new module path."""

MOVED_ATTRIBUTES = {
    "te_jax.DenseQuantizers": ("te_jax.core.bundles", "DenseQuantizers"),
    "te_jax.MLPQuantizers": ("te_jax.core.bundles", "MLPQuantizers"),
    "te_jax.STATS_COLLECTION": ("te_jax.spec.names", "STATS_COLLECTION"),
}
"""Old package attribute -> (its module now, its name there)."""

_warned: set[str] = set()


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    """One DeprecationWarning per old name and process."""
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"te_jax: {old} moved to {new}; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=stacklevel)


def moved_attribute(package: str, name: str):
    """What the old attribute ``package.name`` stands for now: a moved module (``MOVED``) or a name
    (``MOVED_ATTRIBUTES``), after one DeprecationWarning; AttributeError for any other name.

    A package's ``__getattr__`` calls it for names it does not have.
    """
    old = f"{package}.{name}"
    if old in MOVED:
        warn_moved(old, MOVED[old], stacklevel=4)
        return importlib.import_module(MOVED[old])
    if old in MOVED_ATTRIBUTES:
        module, attr = MOVED_ATTRIBUTES[old]
        warn_moved(old, f"{module}.{attr}", stacklevel=4)
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


class _MovedLoader(importlib.abc.Loader):
    def create_module(self, spec):
        new = MOVED[spec.name]
        warn_moved(spec.name, new)
        module = importlib.import_module(new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec  # the import system set the old name's spec; the module keeps its own


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, _MovedLoader())
        return None


def install() -> None:
    """Puts the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
