"""The cost of te_jax.inspect: one GPT training step with inspection off and on (median of timed steps).

    python benchmarks/bench_inspect.py --preset 125m --recipes delayed,current,mxfp8
    python benchmarks/bench_inspect.py --preset tiny --batch 8 --seq-len 64      # CPU smoke run

Each recipe's step (examples/gpt's, AdamW, fp8 state) is compiled twice, under
``te_jax.autocast(recipe=...)`` and ``te_jax.autocast(recipe=..., inspect=True)``;
after ``--warmup`` steps each, ``--iters`` steps are timed back to back
(``--trials`` times, median per step). The target is at most +10% on an H200
for the 125m preset.
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
import jax.numpy as jnp  # noqa: E402

from examples.gpt import train as gpt  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from examples.gpt.presets import PRESETS  # noqa: E402
from te_jax.train import TrainState  # noqa: E402


def time_step(step, state, tokens, warmup: int, iters: int, trials: int) -> float:
    """Median ms per step; ``step`` donates the state, so it is threaded through."""
    for _ in range(warmup):
        state, metrics = step(state, tokens)
    jax.block_until_ready(metrics)
    per_step = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            state, metrics = step(state, tokens)
        jax.block_until_ready(metrics)
        per_step.append(1e3 * (time.perf_counter() - start) / iters)
    return statistics.median(per_step)


def bench(recipe_name: str, args) -> dict:
    cfg = gpt.RunConfig(preset=args.preset, recipe=recipe_name, batch=args.batch, seq_len=args.seq_len,
                        inspect="-").resolved()
    recipe = gpt.make_recipe(recipe_name)
    model = GPT(cfg.model_config())
    init_key, quant_key = jax.random.split(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq_len + 1), 0, 256, jnp.int32)
    with gpt.autocast_for(recipe, None, inspect=recipe is not None):
        variables = jax.jit(model.init)({"params": init_key, "quantize": quant_key}, tokens[:, :-1])
    out = {"recipe": recipe_name}
    for inspect in (False, True):
        params = jax.tree.map(jnp.copy, dict(variables))  # the step donates its state
        state = TrainState.create(apply_fn=model.apply, params=params, tx=gpt.make_optimizer(cfg))
        state = state.replace(step=jnp.asarray(0, jnp.int32))
        step = jax.jit(gpt.make_train_step(model, recipe, None, quant_key, inspect=inspect), donate_argnums=0)
        out["inspect_ms" if inspect else "plain_ms"] = time_step(step, state, tokens, args.warmup, args.iters,
                                                                 args.trials)
    out["overhead"] = out["inspect_ms"] / out["plain_ms"] - 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="125m", choices=sorted(PRESETS))
    p.add_argument("--recipes", default="delayed")
    p.add_argument("--batch", type=int, help="default: the preset's")
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON")
    p.add_argument("--md", help="write a markdown table here")
    args = p.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({jax.default_backend()}), preset {args.preset}")
    results = []
    for name in [r.strip() for r in args.recipes.split(",") if r.strip()]:
        r = bench(name, args)
        results.append(r)
        print(f"{name:>8}: {r['plain_ms']:9.2f} ms/step, with inspect {r['inspect_ms']:9.2f} ms/step "
              f"({r['overhead']:+.1%})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.md:
        rows = [f"| {r['recipe']} | {r['plain_ms']:.2f} | {r['inspect_ms']:.2f} | {r['overhead']:+.1%} |"
                for r in results]
        Path(args.md).write_text("\n".join([f"## Inspection cost ({args.preset} GPT training step, "
                                             f"{jax.devices()[0].device_kind})", "",
                                             "| recipe | plain ms | inspected ms | cost |", "|---|---|---|---|",
                                             *rows, ""]))


if __name__ == "__main__":
    main()
