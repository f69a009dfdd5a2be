"""tools/trace_files.py: the te_jax files Python enters while tracing one DelayedScaling LayerNormMLP train step."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "trace_files.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    """The tool in a fresh interpreter, from outside the source tree, importing the te_jax this test imports."""
    import te_jax  # noqa: PLC0415

    site = pathlib.Path(te_jax.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir(), timeout=600, check=False)


def test_counts_te_jax_files_entered_while_tracing_the_step():
    out = _run("--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    files = report["files"]
    assert report["total_files"] == len(files) > 0 and report["total_calls"] == sum(files.values()) > 0
    assert all(path.startswith("te_jax/") and path.endswith(".py") and calls > 0 for path, calls in files.items())
    assert all((ROOT / path).is_file() or not (ROOT / "te_jax").is_dir() for path in files), files
    # the step's path, top to bottom: the Linen layer, the functional op, the primitives, FP8 state via train
    floors = {path.split("/")[1] for path in files}
    assert {"flax", "core", "ops", "train"} <= floors, sorted(floors)
    assert report["over"] is False and report["max"] is None


def test_max_fails_when_more_files_are_entered():
    out = _run("--max", "1")
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].split()[0].isdigit() and int(lines[-1].split()[0]) > 1, lines[-1]
    assert all(line.split()[1].startswith("te_jax/") for line in lines[:-1]) and len(lines) > 1, lines
    assert "more than --max 1" in out.stderr


# The floor plan's budget: the DelayedScaling LayerNormMLP step enters at most this many te_jax files (24 today:
# the forward-update recorder, the dtype rule, the sharding types and the gradient mix check joined the path).
FILE_BUDGET = 25


def test_the_layernorm_mlp_step_enters_at_most_the_budgeted_files():
    out = _run("--max", str(FILE_BUDGET))
    assert out.returncode == 0, (f"the step entered more than {FILE_BUDGET} te_jax files:\n"
                                 f"{out.stdout}{out.stderr[-2000:]}")
