"""benchmarks/bench_moe.py --tiny on CPU: the script runs end to end and writes its table (the H200 runs the
real sizes with tools/gpu_check.py --bench moe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import te_jax

ROOT = Path(__file__).resolve().parents[2]


def test_bench_moe_tiny_runs(tmp_path):
    out, md = tmp_path / "moe.json", tmp_path / "moe.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--tiny", "--recipes",
                           "delayed,block,current+fast-backward", "--profile", "--out", str(out), "--md", str(md)], capture_output=True, text=True, cwd=ROOT / "benchmarks", timeout=1200,
                          env={**os.environ, "JAX_PLATFORMS": "cpu",
                               # the te_jax under test first (on a GPU machine, an installed wheel), then this tree
                               "PYTHONPATH": os.pathsep.join([str(Path(te_jax.__file__).resolve().parents[1]),
                                                              str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert {g["shape"] for g in result["gemms"]} == {"tiny gate+up", "tiny down", "tiny gate+up skewed"}
    (layer,) = result["layers"]
    assert set(layer["variants"]) == {"bf16 ragged_dot", "bf16 einsum cap 1.0", "delayed", "block",
                                      "current+fast-backward"}
    assert set(layer["profiles"]) == set(layer["variants"])  # --profile: one device trace per variant
    assert all(v["ms"] > 0 and v["tflops"] > 0 for v in layer["variants"].values())
    pieces = {name.split(": ")[1] for name in layer["breakdown_ms"]}
    assert pieces == {"router", "permutation", "expert FFN", "casts"}
    assert "vs best bf16" in md.read_text()
