"""The cost of te_jax.inspect: one GPT training step with inspection off and on (median of timed steps).

    python benchmarks/bench_inspect.py --preset 125m --recipes delayed,current,mxfp8
    python benchmarks/bench_inspect.py --preset 125m --recipes bf16,delayed --bare --loop   # where time goes
    python benchmarks/bench_inspect.py --preset tiny --batch 8 --seq-len 64      # CPU smoke run

Each recipe's steps are the training example's own (``examples.gpt.train.build_run``:
AdamW, fp8 state, jitted with the state's shardings over a one-device mesh),
compiled under ``te_jax.autocast(recipe=...)`` and with ``inspect=Sample(k)``
for each ``--sample`` stride k; after ``--warmup`` steps each, ``--iters``
steps of each variant are timed back to back, the variants taking turns in
an order shuffled each round (``--trials`` rounds, median per step). The
target is at most +10% on an H200 for the 125m preset. bf16 has no inspected step.

``--bare`` also times the same step jitted without shardings or mesh (the
example's sharding machinery should cost nothing on one device); ``--loop``
times the example's training loop (a host-made batch per step, device_put,
the step, a sync every 10 steps), to separate step time from loop overhead.
``--profile`` traces 3 steps of each variant and prints (and stores in the
JSON) where the device time goes, per HLO op kind (``device_profile.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: an installed te_jax wins

import jax  # noqa: E402

from examples.gpt import data as data_lib  # noqa: E402
from examples.gpt import train as gpt  # noqa: E402
from examples.gpt.presets import PRESETS  # noqa: E402
from benchmarks.device_profile import format_summary, profile_steps  # noqa: E402
from benchmarks.timing import add_repeat_args, time_interleaved  # noqa: E402
from te_jax import inspect as te_inspect  # noqa: E402


def time_step(step, state, batch_for, warmup: int, iters: int, trials: int, sync_every: int = 0) -> float:
    """Median ms per step over ``trials`` runs of ``iters`` steps; ``step`` donates the state, so it is threaded.

    ``batch_for(i)`` gives step i's tokens; ``sync_every`` > 0 waits for the metrics every that many steps.
    """
    for i in range(warmup):
        state, metrics = step(state, batch_for(i))
    jax.block_until_ready(metrics)
    per_step = []
    for _ in range(trials):
        start = time.perf_counter()
        for i in range(iters):
            state, metrics = step(state, batch_for(i))
            if sync_every and (i + 1) % sync_every == 0:
                jax.device_get(metrics)
        jax.block_until_ready(metrics)
        per_step.append(1e3 * (time.perf_counter() - start) / iters)
    return statistics.median(per_step)


def time_steps_interleaved(steps: dict, fresh, batch, warmup: int, iters: int, trials: int) -> dict[str, float]:
    """Median ms per step of each of ``steps`` (name -> step), their trials taken in turns (shuffled each round).

    Each step runs on its own copy of the state (``fresh()``), threaded from call to call: the steps donate it.
    """
    def threaded(step):
        state = fresh()

        def call():
            nonlocal state
            state, metrics = step(state, batch)
            return metrics
        return call

    per_call = time_interleaved({name: (threaded(step), [()]) for name, step in steps.items()}, warmup, iters, trials)
    return {name: 1e3 * statistics.median(v) for name, v in per_call.items()}


def bench(recipe_name: str, args, corpus) -> dict:
    cfg = gpt.RunConfig(preset=args.preset, recipe=recipe_name, batch=args.batch, seq_len=args.seq_len,
                        inspect="-").resolved()
    run = gpt.build_run(cfg)
    host = jax.device_get(run.state)
    fresh = lambda: jax.device_put(host, run.shardings)  # noqa: E731  (each timing gets its own copy: donated)
    tokens = jax.device_put(data_lib.train_batch(corpus, 0, cfg.batch, cfg.seq_len, cfg.seed), run.batch_sharding)
    timing = (args.warmup, args.iters, args.trials)
    # The plain step and every inspected variant, their trials taken in turns (a drift of the GPU or the
    # host reaches all of them alike).
    steps = {"plain": run.train_step}
    if run.inspect_step is not None:
        steps |= {every: run.jit_step(te_inspect.Sample(every)) for every in args.sample}
    ms = time_steps_interleaved(steps, fresh, tokens, *timing)
    out = {"recipe": recipe_name, "plain_ms": ms["plain"]}
    profiles = {}
    if args.profile:
        profiles["plain"] = profile_steps(run.train_step, fresh(), tokens)[1]
    for every in [k for k in steps if k != "plain"]:
        suffix = "" if every == 1 else f"_every{every}"
        out["inspect_ms" + suffix] = ms[every]
        out["overhead" + suffix] = ms[every] / ms["plain"] - 1
        if args.profile:
            profiles[f"inspect every {every}"] = profile_steps(steps[every], fresh(), tokens)[1]
    if profiles:
        out["profiles"] = profiles
        for name, summary in profiles.items():
            print(format_summary(f"{recipe_name} {name}", summary), flush=True)
    if args.bare:
        step = jax.jit(gpt.make_train_step(run.model, run.recipe, None, jax.random.key(1)), donate_argnums=0)
        bare_tokens = jax.device_put(jax.device_get(tokens))
        out["bare_ms"] = time_step(step, jax.device_put(host), lambda i: bare_tokens, *timing)
    if args.loop:
        def batch_for(i):
            return jax.device_put(data_lib.train_batch(corpus, i, cfg.batch, cfg.seq_len, cfg.seed),
                                  run.batch_sharding)

        out["loop_ms"] = time_step(run.train_step, fresh(), batch_for, *timing, sync_every=10)
    return out


def columns(samples: list[int]) -> list[tuple[str, str]]:
    """(result key, table heading) of every timing, in table order."""
    cols = [("plain_ms", "plain ms")]
    for every in samples:
        suffix, label = ("", "") if every == 1 else (f"_every{every}", f", every {every}th row")
        cols += [("inspect_ms" + suffix, "inspected ms" + label), ("overhead" + suffix, "cost" + label)]
    return cols + [("bare_ms", "bare jit ms"), ("loop_ms", "loop ms")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="125m", choices=sorted(PRESETS))
    p.add_argument("--recipes", default="delayed")
    p.add_argument("--batch", type=int, help="default: the preset's")
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    add_repeat_args(p, warmup=3, iters=10, trials=3)
    p.add_argument("--sample", default="1", type=lambda s: [int(k) for k in s.split(",") if k],
                   help="comma-separated row strides of te_jax.inspect.Sample to time (default 1: every row)")
    p.add_argument("--bare", action="store_true", help="also time the step jitted without shardings or mesh")
    p.add_argument("--loop", action="store_true", help="also time the example's training loop")
    p.add_argument("--profile", action="store_true", help="also print where the device time of each step goes")
    p.add_argument("--out", help="write the results as JSON")
    p.add_argument("--md", help="write a markdown table here")
    args = p.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({jax.default_backend()}), preset {args.preset}")
    corpus = data_lib.load(None, 16 << 20)
    results = []
    for name in [r.strip() for r in args.recipes.split(",") if r.strip()]:
        r = bench(name, args, corpus)
        results.append(r)
        print(f"{name:>8}: " + ", ".join(f"{label} {r[key]:+.1%}" if key.startswith("overhead") else
                                         f"{label} {r[key]:.2f}" for key, label in columns(args.sample) if key in r),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.md:
        cols = [(k, label) for k, label in columns(args.sample) if any(k in r for r in results)]
        cell = lambda r, k: ("-" if k not in r else f"{r[k]:+.1%}" if k.startswith("overhead")  # noqa: E731
                             else f"{r[k]:.2f}")
        rows = [f"| {r['recipe']} | " + " | ".join(cell(r, k) for k, _ in cols) + " |" for r in results]
        Path(args.md).write_text("\n".join([f"## Inspection cost ({args.preset} GPT training step, "
                                             f"{jax.devices()[0].device_kind})", "",
                                             "| recipe | " + " | ".join(label for _, label in cols) + " |",
                                             "|---" * (len(cols) + 1) + "|", *rows, ""]))


if __name__ == "__main__":
    main()
