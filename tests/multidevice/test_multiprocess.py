"""Multi-process training: two CPU processes on localhost train the tiny GPT data-parallel and agree.

Each process runs examples/gpt/train.py with ``--distributed`` (jax.distributed
over a local coordinator, gloo collectives) and one CPU device; the global mesh
is dp=2. Both must report the same losses, equal to one process driving two
devices.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"
ARGS = ["--preset", "tiny", "--recipe", "delayed", "--steps", "6", "--eval-every", "3", "--eval-batches", "1",
        "--batch", "4", "--seq-len", "64", "--mesh", "dp=2", "--no-progress", "--log-every", "3"]
FINAL = re.compile(r"final train loss ([\d.]+), eval loss ([\d.]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def _final(output: str) -> tuple[float, float]:
    match = FINAL.search(output)
    assert match, output[-3000:]
    return float(match.group(1)), float(match.group(2))


def test_two_processes_agree_with_one(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(TRAIN), *ARGS, "--distributed", "--coordinator",
                               f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=tmp_path)
             for i in range(2)]
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        outputs.append(out)
        assert proc.returncode == 0, out[-3000:]
    for out in outputs:
        assert "devices: 2 x cpu" in out, out[:2000]
    first, second = (_final(out) for out in outputs)
    assert first == second
    single = subprocess.run([sys.executable, str(TRAIN), *ARGS], capture_output=True, text=True, env=_env(),
                            cwd=tmp_path, timeout=600)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    one = _final(single.stdout)
    assert abs(one[0] - first[0]) <= 1e-3 and abs(one[1] - first[1]) <= 1e-3, (one, first)
