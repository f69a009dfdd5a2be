"""Quantization statistics of the GPT example (``--inspect``; used by examples/gpt/train.py).

* ``StatsLog``: writes each inspected step's te_jax.inspect statistics to ``DIR/<recipe>.jsonl``
  (and TensorBoard), keeps the last, and draws their ranking report.
* ``write_report``: the report PNG of one or several recipes' statistics (needs matplotlib).
* ``inspect_overhead``: the measured cost of inspection per train step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax

from te_jax import inspect as te_inspect


class StatsLog:
    """Writes each inspected step's statistics to ``DIR/<label>.jsonl`` (and TensorBoard); keeps the last."""

    def __init__(self, directory: str, label: str, tensorboard: str | None):
        self.dir, self.label, self.last = Path(directory), label, []
        self.jsonl = te_inspect.JsonlWriter(self.dir / f"{label}.jsonl")
        self.tb = None
        if tensorboard:
            try:
                self.tb = te_inspect.TensorBoardWriter(Path(tensorboard) / label / "fp8_stats")
            except ImportError as err:
                print(f"(no TensorBoard statistics: {err})", file=sys.stderr)

    def write(self, stats, step: int) -> None:
        self.last = self.jsonl.write(stats, step=step, recipe=self.label)
        if self.tb:
            self.tb.write(self.last, step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb:
            self.tb.close()

    def report(self) -> str | None:
        """The ranking report of the last statistics, or None (with a message) without matplotlib."""
        return write_report({self.label: self.last}, self.dir / f"{self.label}_report.png")


def write_report(by_recipe: dict, path: Path) -> str | None:
    try:
        from te_jax.inspect.report import plot_report

        return str(plot_report(by_recipe, path))
    except ImportError as err:
        print(f"(no report: {err})", file=sys.stderr)
        return None


def inspect_overhead(train_step, inspect_step, state, shardings, tokens, iters: int = 10, trials: int = 3) -> dict:
    """Median ms per step without and with inspection, on a copy of ``state`` (the steps donate it).

    Steps run back to back, as in training, with one wait after ``iters`` of them (docs/inspect.md:
    waiting after each step measures far longer steps on a GPU).
    """
    import statistics

    def median_ms(step):
        s = jax.device_put(jax.device_get(state), shardings)
        s, m = step(s, tokens)  # warm-up (compiled already)
        jax.block_until_ready(m)
        times = []
        for _ in range(trials):
            t = time.perf_counter()
            for _ in range(iters):
                s, m = step(s, tokens)
            jax.block_until_ready(m)
            times.append(1e3 * (time.perf_counter() - t) / iters)
        return statistics.median(times)

    plain, inspected = median_ms(train_step), median_ms(inspect_step)
    return {"step_ms": plain, "inspect_step_ms": inspected, "overhead": inspected / plain - 1}
