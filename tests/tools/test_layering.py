"""The import graph follows the layers: csrc -> ops -> quantize -> recipe -> functional -> flax.

te_jax.ops takes explicit arguments only: no module under te_jax/ops imports
autocast, recipes, quantizer classes, the functional layers or Flax, not even
inside a function. The ops may read the quantize layer's leaves that import
no quantizer: the scaling-mode registry, ScaledTensor and the pure-JAX
reference twins.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "te_jax"

# What a module under te_jax/ops may import from te_jax (besides te_jax.ops itself).
OPS_MAY_IMPORT = {
    "te_jax.ops.ffi", "te_jax.spec.names", "te_jax.ops.backend", "te_jax.ops.sharding",
    "te_jax.spec.modes", "te_jax.spec.numerics", "te_jax.spec.reference", "te_jax.spec.reference_norm_act",
    "te_jax.spec.scaled_tensor",
}
# Never loaded by `import te_jax.ops` (nor by `import te_jax`).
NOT_LOADED_BY_OPS = ("flax", "optax", "te_jax.autocast", "te_jax.recipe", "te_jax.flax", "te_jax.quantize.quantizers",
                     "te_jax.quantize.delayed", "te_jax.quantize.fused", "te_jax.dense", "te_jax.grouped_dense",
                     "te_jax.layernorm_dense", "te_jax.layernorm_mlp", "te_jax.train.update", "te_jax.train", "te_jax.inspect")


def _module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def imports_in(source: str, package: str) -> set[str]:
    """Every module ``source`` (a module of ``package``) imports anywhere, top level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return found


def imported_modules(path: pathlib.Path) -> set[str]:
    module = _module_of(path)
    return imports_in(path.read_text(), module if path.name == "__init__.py" else module.rsplit(".", 1)[0])


OPS_FILES = sorted((PACKAGE / "ops").glob("*.py"))


def test_the_scan_sees_function_local_and_relative_imports():
    source = ("import jax\n"
              "def f():\n    from te_jax.recipe.autocast import current\n    import flax.linen\n"
              "class C:\n    def g(self):\n        from . import partition\n        from ..quantize import delayed\n")
    assert imports_in(source, "te_jax.ops") == {"jax", "te_jax.autocast", "flax.linen", "te_jax.ops.primitive",
                                                "te_jax.quantize.delayed"}


@pytest.mark.parametrize("path", OPS_FILES, ids=[p.name for p in OPS_FILES])
def test_ops_import_only_lower_layers(path):
    ours = {m for m in imported_modules(path) if m == "te_jax" or m.startswith(("te_jax.", "flax", "optax"))}
    bad = sorted(m for m in ours if not (m.startswith("te_jax.ops") or m in OPS_MAY_IMPORT))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}; te_jax/ops may import only {sorted(OPS_MAY_IMPORT)}"


@pytest.mark.parametrize("name", ["modes", "numerics", "reference", "ref_norm_act", "scaled_tensor"])
def test_quantize_leaves_that_ops_read_import_no_quantizer(name):
    ours = {m for m in imported_modules(PACKAGE / "quantize" / f"{name}.py") if m.startswith("te_jax")}
    bad = sorted(m for m in ours if m.startswith(NOT_LOADED_BY_OPS))
    assert not bad, f"te_jax/quantize/{name}.py imports {bad}"


def test_ffi_loader_imports_no_package_module():
    ours = {m for m in imported_modules(PACKAGE / "_ffi.py") if m.startswith("te_jax")}
    assert ours <= {"te_jax._te_jax_cpu", "te_jax._te_jax_cuda", "te_jax"}, ours
    tree = ast.parse((PACKAGE / "_ffi.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "te_jax" for a in n.names}
    assert names <= {"_te_jax_cpu", "_te_jax_cuda"}, names


def _fresh(code: str) -> str:
    """Runs ``code`` in a new interpreter that imports the same te_jax as this one (a source tree or an install)."""
    import te_jax  # noqa: PLC0415

    site = pathlib.Path(te_jax.__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir(),
                         env={"PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("statement", ["import te_jax.ops", "import te_jax", "import te_jax.spec.modes"])
def test_importing_the_ops_loads_no_upper_layer(statement):
    loaded = _fresh(f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))").split()
    bad = sorted(m for m in loaded if m.startswith(NOT_LOADED_BY_OPS))
    assert not bad, f"`{statement}` loaded {bad}"


def test_package_attributes_still_resolve():
    code = """
import te_jax
import te_jax.core.dense, te_jax.layernorm_dense, te_jax.layernorm_mlp, te_jax.autocast  # submodules of the same names
import te_jax.core.grouped_dense
assert callable(te_jax.dense) and callable(te_jax.layernorm_dense) and callable(te_jax.layernorm_mlp)
assert callable(te_jax.grouped_dense) and te_jax.core.grouped_dense.__module__ == "te_jax.grouped_dense"
assert callable(te_jax.autocast) and te_jax.recipe.autocast.__module__ == "te_jax.autocast"
assert te_jax.FP8_COLLECTION == "fp8_meta" and te_jax.STATS_COLLECTION == "fp8_stats"
from te_jax.core.stats import STATS_COLLECTION
from te_jax.train.update import FP8_COLLECTION
assert (FP8_COLLECTION, STATS_COLLECTION) == (te_jax.FP8_COLLECTION, te_jax.STATS_COLLECTION)
assert te_jax.train.TrainState and te_jax.train.update.apply_fp8_update and te_jax.flax.DenseGeneral
assert te_jax.DenseQuantizers and te_jax.MLPQuantizers and te_jax.recipe.DelayedScaling
from te_jax import dense, autocast, layernorm_mlp
assert callable(dense) and callable(autocast) and callable(layernorm_mlp)
from te_jax.quantize import DelayedScalingQuantizer, NVFP4Quantizer, ScaledTensor, ScalingMode
print("ok")
"""
    assert _fresh(code) == "ok"
