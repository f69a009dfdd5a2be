"""Builds and installs the te_jax wheel for the GPU check (used by tools/gpu_check.py).

* ``step``: runs a setup command with its output appended to a log; stops the check on failure.
* ``cutlass_source`` / ``cutlass_build_flags``: where the build finds CUTLASS's headers.
* ``install``: ``pip install --target`` of a wheel into a private folder, then an import check.
* ``overlay_python``: puts this checkout's Python files over an installed wheel's
  (``--python-from-checkout``, ``--baseline-python``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import shutil
import subprocess
import time
import zipfile

import gpu_jobs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def step(what: str, argv: list[str], log: pathlib.Path, **kwargs) -> None:
    """Runs a setup command, its output appended to ``log``; stops the check with its tail on failure."""
    start = time.monotonic()
    with log.open("a") as f:
        f.write(f"$ {shlex.join(argv)}\n")
        f.flush()
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, **kwargs).returncode
    if code != 0:
        raise SystemExit(f"gpu_check: {what} failed (exit {code}):\n{gpu_jobs.tail(log, 40)}")
    print(f"gpu_check: {what} ({time.monotonic() - start:.0f} s)", flush=True)


def cutlass_source(args: argparse.Namespace) -> pathlib.Path | None:
    """The nvidia-cutlass wheel the build takes CUTLASS's headers from, or None: the build's Python finds them."""
    if args.cutlass_wheel is not None:
        return args.cutlass_wheel.resolve()
    wheels = sorted((ROOT / ".cache" / "cutlass").glob("nvidia_cutlass-*.whl"))
    return wheels[-1] if wheels else None


def cutlass_build_flags(wheel: pathlib.Path | None, work: pathlib.Path, python: str) -> list[str]:
    """The CMake define that points the build at CUTLASS's headers unpacked from ``wheel`` (cmake/FindCutlass.cmake).

    No flags when the build's Python already has the cutlass_library package; the headers of ``wheel`` otherwise
    (unpacked with zipfile, so no network and no install are needed).
    """
    found = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('cutlass_library') is None)"]).returncode == 0
    if found:
        return []
    if wheel is None:
        raise SystemExit("gpu_check: the build needs CUTLASS's headers: pip install nvidia-cutlass, or run "
                         "tools/compile_cuda.sh once (it downloads the wheel into .cache/cutlass), or pass "
                         "--cutlass-wheel")
    dest = work / "cutlass"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("cutlass_library/source/include/")])
    return ["-C", f"cmake.define.TE_JAX_CUTLASS_DIR={dest / 'cutlass_library' / 'source'}"]


def overlay_python(site: pathlib.Path, root: pathlib.Path = ROOT) -> int:
    """Makes the Python files of the package installed in ``site`` the ones a build of this checkout installs:
    ``te_jax/**/*.py``, and ``recipes/*.py`` as ``te_jax/gallery/`` (CMakeLists.txt's install rule). They are copied
    over and installed Python files the checkout lacks are removed; compiled modules and other files stay. Returns
    how many were copied."""
    package, installed = root / "te_jax", site / "te_jax"
    if not package.is_dir():
        raise SystemExit(f"gpu_check: {root} has no te_jax/ to put over the installed wheel")
    sources = {src.relative_to(package): src for src in package.rglob("*.py")}
    sources.update({pathlib.Path("gallery") / src.name: src for src in (root / "recipes").glob("*.py")})
    for old in installed.rglob("*.py"):
        if old.relative_to(installed) not in sources:
            old.unlink()
    for rel, src in sources.items():
        (installed / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, installed / rel)
    return len(sources)


def install_extras(wheels: list[pathlib.Path], site: pathlib.Path, log: pathlib.Path, python: str) -> None:
    """Adds ``wheels`` (without their dependencies, e.g. an optional extra's package such as qwix) to ``site``."""
    if wheels:
        step(f"install {', '.join(w.name for w in wheels)} into {site}",
             [python, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), *map(str, wheels)],
             log)


def install(wheel: pathlib.Path, site: pathlib.Path, log: pathlib.Path, python: str) -> None:
    """Installs ``wheel`` (without dependencies) into ``site`` and checks that jobs import it, CUDA module included."""
    shutil.rmtree(site, ignore_errors=True)
    step(f"install {wheel.name} into {site}", [python, "-m", "pip", "install", "--no-deps", "--no-index",
                                                "--target", str(site), str(wheel)], log)
    check = ("import pathlib, sys, te_jax; site = pathlib.Path(sys.argv[1]).resolve(); "
             "pkg = pathlib.Path(te_jax.__file__).resolve().parent; "
             "assert pkg.parent == site, f'imported {pkg}, not the one in {site}'; "
             "assert list(pkg.glob('_te_jax_cuda*')), f'{pkg} has no CUDA module'; print('te_jax from', pkg)")
    step(f"import check of {site}", [python, "-c", check, str(site)], log, cwd=str(ROOT / "tests"),
         env=dict(os.environ, PYTHONPATH=str(site)))
