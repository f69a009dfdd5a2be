"""Timing and command-line helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
import traceback
from collections.abc import Callable, Sequence

import jax


def time_call(fn, arg_sets, warmup: int, iters: int, trials: int) -> float:
    """Median seconds per call of ``fn(*args)``, cycling through ``arg_sets``.

    Each trial runs ``iters`` calls back to back and waits for the last result,
    so launch gaps overlap as they do in a training step.
    """
    return statistics.median(time_interleaved({"fn": (fn, arg_sets)}, warmup, iters, trials)["fn"])


def round_orders(names: Sequence, rounds: int, seed: int = 0) -> list[list]:
    """``rounds`` orders of ``names``, each a seeded shuffle (for timing variants in turns)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def time_interleaved(calls: dict[str, tuple[Callable, Sequence]], warmup: int, iters: int,
                     trials: int) -> dict[str, list[float]]:
    """Seconds per call of each ``fn(*args)`` per trial, the variants' trials interleaved.

    ``calls`` maps a name to ``(fn, arg_sets)``. Every variant is warmed up,
    then each round times ``iters`` back-to-back calls of every variant, in
    an order shuffled anew each round (seeded: the same orders every run). So
    a slow drift of the GPU (clocks falling as it heats under a power cap)
    reaches every variant alike, instead of favouring whichever was timed
    first, and no variant always follows the same other one.
    """
    names = list(calls)
    if not names:
        return {}
    for name in names:
        fn, sets = calls[name]
        for i in range(warmup):
            jax.block_until_ready(fn(*sets[i % len(sets)]))
    per_call: dict[str, list[float]] = {name: [] for name in names}
    for order in round_orders(names, trials):
        for name in order:
            fn, sets = calls[name]
            start = time.perf_counter()
            out = None
            for i in range(iters):
                out = fn(*sets[i % len(sets)])
            jax.block_until_ready(out)
            per_call[name].append((time.perf_counter() - start) / iters)
    return per_call


def time_fn(fn, inputs, iters: int, trials: int, warmup: int = 3) -> float:
    """Median milliseconds per call of ``fn(x)`` over ``inputs`` (cycled)."""
    return 1e3 * time_call(fn, [(x,) for x in inputs], warmup, iters, trials)


def time_against_baseline(label: str, nbytes: int, ours: Callable, base: Callable, time_ms: Callable,
                          copy_gbs: float) -> dict:
    """A result row: ``ours`` and the baseline ``base``, each jitted and timed by ``time_ms(fn)`` (milliseconds).

    Each side gets ``ms``, ``gbs`` (``nbytes`` moved per call) and ``pct_copy`` (of ``copy_gbs``), or ``error``
    when it failed (printed, and the benchmark goes on); ``speedup`` is base over ours where both ran.
    """
    entry = {"case": label, "bytes": nbytes}
    for who, fn in (("ours", ours), ("base", base)):
        try:
            ms = time_ms(jax.jit(fn))
            entry[who] = {"ms": ms, "gbs": nbytes / ms * 1e-6, "pct_copy": 100 * nbytes / ms * 1e-6 / copy_gbs}
        except Exception as err:  # noqa: BLE001  (benchmark: report and continue)
            entry[who] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            traceback.print_exc(limit=2)
    if "ms" in entry["ours"] and "ms" in entry["base"]:
        entry["speedup"] = entry["base"]["ms"] / entry["ours"]["ms"]
    return entry


def _timing_cells(timing: dict) -> str:
    if "error" in timing:
        return "error | - | -"
    return f"{timing['ms']:.4f} | {timing['gbs']:.0f} | {timing['pct_copy']:.0f}%"


def result_row(entry: dict) -> str:
    """A ``time_against_baseline`` row as a markdown table row (with its ``base_label`` cell where it has one)."""
    base = f"{entry['base_label']} | " if "base_label" in entry else ""
    speedup = f"{entry['speedup']:.2f}x" if "speedup" in entry else "-"
    return (f"| {entry['case']} | {entry['bytes'] / 1e6:.1f} | {_timing_cells(entry['ours'])} | {base}"
            f"{_timing_cells(entry['base'])} | {speedup} |")


def result_markdown(title: str, columns: Sequence[str], rows: Sequence[dict]) -> str:
    """A benchmark's markdown: ``title``, a blank line, then a table of ``columns`` over the ``result_row`` s."""
    header = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join([title, "", *header, *map(result_row, rows)]) + "\n"


def add_repeat_args(p: argparse.ArgumentParser, warmup: int, iters: int, trials: int) -> argparse.ArgumentParser:
    """Adds ``--warmup``, ``--iters`` and ``--trials`` (the ``time_interleaved`` counts) with these defaults."""
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--trials", type=int, default=trials)
    return p


def bandwidth_parser(description: str, out_default: str) -> argparse.ArgumentParser:
    """The arguments of the memory-bound benchmarks: shape, repetitions, outputs, check."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--nbuf", type=int, default=3, help="rotating input buffers")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--out", default=out_default)
    p.add_argument("--md", default=None)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--only", default="", help="time only the cases whose label matches this regex")
    return p


def selected(cases, only: str, label: Callable = lambda case: case[0]):
    """The cases whose ``label(case)`` (default: a tuple's first item) matches the regex ``only`` (all if empty)."""
    return [c for c in cases if not only or re.search(only, label(c))]


def write_results(out: str | None, md_path: str | None, result: dict, md: str, indent: int = 1) -> None:
    """Writes a benchmark's result as JSON to ``out`` and its markdown ``md`` to ``md_path`` (each if set)."""
    import json

    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=indent)
    if md_path:
        with open(md_path, "w") as fh:
            fh.write(md)


def bandwidth_main(description: str, out_default: str, check, run_bench, markdown) -> int:
    """The shared main of the memory-bound benchmarks: optional check, timing, JSON and markdown out.

    ``check()`` returns a list of failure strings; ``run_bench(args)`` a result dict;
    ``markdown(result)`` its table. Exits non-zero when the check found failures.
    """
    args = bandwidth_parser(description, out_default).parse_args()
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    failures = []
    if args.check:
        start = time.perf_counter()
        failures = check()
        print(f"check: {len(failures)} failures ({time.perf_counter() - start:.0f} s)")
        for f in failures[:50]:
            print("  CHECK", f)
    res = run_bench(args)
    res["check_failures"] = failures
    md = markdown(res)
    print()
    print(md)
    write_results(args.out, args.md, res, md, indent=2)
    return 1 if failures else 0
