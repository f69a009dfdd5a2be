"""Accuracy spread: the 200-step training task of tests/flax/test_flax_accuracy.py, per recipe, over many rounding keys.

The accuracy test trains one trajectory per recipe and compares its final loss
with the bf16 run's. A recipe that rounds stochastically (NVFP4's gradients)
draws a different trajectory for each key, so one run is one sample. This
script runs the test's task (same model, batches, initial parameters and
schedule; the task is defined once, in the test module) for each recipe and
each key in ``--keys``, and reports each final loss relative to bf16, with
their mean, standard deviation and range. Recipes without stochastic rounding
give the same trajectory for every key, so they run once.

Usage: python benchmarks/bench_accuracy.py [--recipes nvfp4,delayed] [--keys 9-16] [--out r.json] [--md r.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_flax_accuracy as task  # noqa: E402 (the task lives with the test that asserts on it)

from te_jax import recipe as R  # noqa: E402
from timing import write_results  # noqa: E402

RECIPES = {
    "delayed": R.DelayedScaling,
    "current": R.Float8CurrentScaling,
    "mxfp8": R.MXFP8BlockScaling,
    "block": R.Float8BlockScaling,
    "nvfp4": R.NVFP4BlockScaling,
    "nvfp4_no_sr": lambda: R.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
STOCHASTIC = {"nvfp4"}


def parse_keys(text: str) -> list[int]:
    """``"9-12,20"`` -> [9, 10, 11, 12, 20]."""
    keys = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        keys.extend(range(int(lo), int(hi or lo) + 1))
    return keys


def markdown(bf16: float, rows: list[dict]) -> str:
    lines = [f"bf16 final loss {bf16:.5f}; the test's key is {task.ROUNDING_KEY}.", "",
             "| recipe | keys | mean vs bf16 | std | min | max | per key |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = r["relative"]
        per_key = ", ".join(f"{k}: {v:+.2%}" for k, v in zip(r["keys"], rel))
        std = statistics.stdev(rel) if len(rel) > 1 else 0.0
        lines.append(f"| {r['recipe']} | {len(rel)} | {statistics.mean(rel):+.2%} | {std:.2%} | {min(rel):+.2%} "
                     f"| {max(rel):+.2%} | {per_key} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="nvfp4", help=f"comma-separated, from {sorted(RECIPES)}")
    p.add_argument("--keys", default="9-16", help="rounding keys, e.g. 9-16 or 9,12")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args()
    keys = parse_keys(args.keys)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    t0 = time.perf_counter()
    bf16 = task.final_loss(None)
    print(f"bf16 {bf16:.5f} ({time.perf_counter() - t0:.1f} s)", flush=True)
    rows = []
    for name in [n for n in args.recipes.split(",") if n]:
        recipe = RECIPES[name]()
        row = dict(recipe=name, keys=keys if name in STOCHASTIC else keys[:1], losses=[], relative=[])
        for key in row["keys"]:
            t0 = time.perf_counter()
            loss = task.final_loss(recipe, key)
            row["losses"].append(loss)
            row["relative"].append(loss / bf16 - 1)
            print(f"{name} key {key}: {loss:.5f} ({loss / bf16 - 1:+.2%}, {time.perf_counter() - t0:.1f} s)", flush=True)
        rows.append(row)
    md = markdown(bf16, rows)
    print(md)
    device = jax.devices()[0].device_kind
    write_results(args.out, args.md, dict(device=device, jax=jax.__version__, bf16=bf16, rows=rows),
                  f"# te_jax accuracy spread ({device})\n\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
