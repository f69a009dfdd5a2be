"""Where a jitted step's device time goes: a jax.profiler trace of a few steps, summed per HLO op.

    from benchmarks.device_profile import profile_steps
    summary = profile_steps(step, state, batch, steps=3)   # step(state, batch) -> (state, metrics)

Reads the trace with ``jax.profiler.ProfileData`` (no TensorBoard needed). On a
GPU the kernels are the events of the device plane's stream lines; each names
its HLO op (a fusion, a custom call, a GEMM) in its ``hlo_op`` stat. The
summary gives the device time per step, the kernel count per step, and time
per op *kind*: the op's name without its ``.N`` / ``_N`` suffix (``loop_multiply_fusion``,
``input_reduce_fusion``, ``command_buffer``...), so two programs compare kind by kind
even where XLA numbered their ops differently. Kernels that run inside an XLA
command buffer (CUDA graph) carry the command buffer's name, not their fusion's:
profile with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` to see the fusions.
"""

from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path

import jax
from jax.profiler import ProfileData

_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "TensorFlow Ops", "Framework", "Source", "XLA TraceMe",
                  "TensorFlow Name Scope", "Launch Stats")


def _kind(op: str) -> str:
    """``op`` without XLA's numbering (``fusion.12`` -> ``fusion``, ``command_buffer_1615`` -> ``command_buffer``)."""
    return re.sub(r"([._]\d+)+$", "", op)


def _device_events(data: ProfileData, seen_lines: list | None = None):
    """``(hlo_op or kernel name, duration ns)`` of every device kernel (CPU: the XLA client's thunks).

    ``seen_lines`` collects ``(plane, line, events)`` of the lines read (to check the trace's layout).
    """
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            lines = [ln for ln in plane.lines if not ln.name.startswith(_DERIVED_LINES)]
        elif plane.name == "/host:CPU":  # CPU backend: the thunks run on the client's threads
            lines = [ln for ln in plane.lines if ln.name.startswith("tf_XLAPjRtCpuClient")]
        else:
            continue
        for line in lines:
            if seen_lines is not None:
                seen_lines.append((plane.name, line.name, sum(1 for _ in line.events)))
            for ev in line.events:
                stats = dict(ev.stats)
                op = stats.get("hlo_op")
                if op is None and not plane.name.startswith("/device:"):
                    continue
                yield str(op or ev.name), float(ev.duration_ns)


def summarize(trace_dir: str | Path, steps: int, top: int = 25) -> dict:
    """Per step: device ms, kernels, and the ``top`` op kinds and ops by time (ms)."""
    files = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    if not files:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    by_kind: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    kinds_n: collections.Counter = collections.Counter()
    total, count, lines = 0.0, 0, []
    for op, ns in _device_events(ProfileData.from_file(str(files[-1])), lines):
        by_kind[_kind(op)] += ns
        kinds_n[_kind(op)] += 1
        by_op[op] += ns
        total += ns
        count += 1
    per = lambda ns: round(ns / steps / 1e6, 4)  # noqa: E731
    return {"device_ms": per(total), "kernels": count / steps,
            "kinds": [{"kind": k, "ms": per(ns), "kernels": kinds_n[k] / steps} for k, ns in by_kind.most_common(top)],
            "ops": [{"op": k, "ms": per(ns)} for k, ns in by_op.most_common(top)],
            "lines": [f"{plane} | {line} | {n} events" for plane, line, n in lines]}


def profile_steps(step, state, batch, steps: int = 3, top: int = 25):
    """Run ``step`` once untraced, then ``steps`` times under the profiler; ``(state, summary)``."""
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(steps):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
        return state, summarize(folder, steps, top)


def format_summary(name: str, s: dict, rows: int = 12) -> str:
    """A few lines: device ms and kernels per step, then the ``rows`` op kinds that took longest."""
    lines = [f"{name}: {s['device_ms']:.2f} device ms/step, {s['kernels']:.0f} kernels/step"]
    lines += [f"  {k['ms']:9.3f} ms {k['kernels']:7.0f} x  {k['kind']}" for k in s["kinds"][:rows]]
    return "\n".join(lines)
