"""Where the GPT example's training step spends its GPU time, per recipe: kernels by category from a device trace.

    python benchmarks/bench_step_profile.py --preset 125m,1.3b --recipes bf16,delayed,current,block
    python benchmarks/bench_step_profile.py --preset tiny --batch 4 --seq-len 64 --steps 2   # CPU smoke run

Each recipe's step is the example's own (``examples.gpt.train.build_run``: AdamW, FP8 state, jitted with
the state donated), run ``--warmup`` times, then ``--steps`` times under ``jax.profiler.trace``. The GPU
kernels of the trace are summed per step by category (``bench_profile.category``): GEMMs (cuBLAS, cuBLASLt,
CUTLASS), attention (cuDNN's fused attention), te_jax's own kernels (norm, activation, cast, amax),
collectives (NCCL) and XLA's fusions and copies (the optimizer and XLA's share of the FP8 state updates
among them). "gaps" is the step's wall time less the GPU's busy time: launches, host work, idle GPU.
"kernels" counts the step's kernel launches, and the kernels under 10 us (count and time), which mostly
cost their launch.

A diagnostic, not a timing to quote: the profiler stretches each kernel a little, and steps run one
recipe at a time. examples/gpt/train.py gives tokens/s. On the CPU the trace holds no GPU kernels, so
only the wall times are filled.

Usage: python benchmarks/bench_step_profile.py [--preset 125m[,1.3b]] [--recipes bf16,delayed,current,block]
       [--batch B] [--seq-len S] [--warmup 3] [--steps 5] [--top 15] [--out r.json] [--md r.md]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # appended: an installed te_jax wins

import jax  # noqa: E402

import bench_profile  # noqa: E402  (a sibling script: this folder is sys.path[0])
from examples.gpt import data as data_lib  # noqa: E402
from examples.gpt import train as gpt  # noqa: E402
from timing import write_results  # noqa: E402


def profile_recipe(preset: str, recipe: str, args, corpus) -> dict:
    """The recipe's step: wall ms per step and the GPU's kernels by category and by name, per step."""
    cfg = gpt.RunConfig(preset=preset, recipe=recipe, batch=args.batch, seq_len=args.seq_len).resolved()
    run = gpt.build_run(cfg)
    tokens = jax.device_put(data_lib.train_batch(corpus, 0, cfg.batch, cfg.seq_len, cfg.seed), run.batch_sharding)
    state, metrics = run.state, None
    for _ in range(args.warmup):
        state, metrics = run.train_step(state, tokens)  # the step donates its state: thread it
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            start = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = run.train_step(state, tokens)
            jax.block_until_ready(metrics)
            wall_ms = 1e3 * (time.perf_counter() - start) / args.steps
        summary = bench_profile.summarize(bench_profile.kernel_events(pathlib.Path(folder)), args.steps)
    summary["kernels"] = summary["kernels"][: args.top]
    return {"recipe": recipe, "preset": cfg.preset, "batch": cfg.batch, "seq_len": cfg.seq_len, "wall_ms": wall_ms,
            "gaps_ms": wall_ms - summary["busy_ms"], **summary}


def markdown(rows: list[dict]) -> str:
    cats = bench_profile.CATEGORIES
    short = f"under {bench_profile.SHORT_KERNEL_US:g} us"
    lines = ["| preset | recipe | wall ms/step | GPU busy | " + " | ".join(cats) + " | gaps | kernels | "
             f"kernels {short} | ms {short} |", "|---" * (len(cats) + 8) + "|"]
    for r in rows:
        c = r["categories"]
        lines.append(f"| {r['preset']} | {r['recipe']} | {r['wall_ms']:.2f} | {r['busy_ms']:.2f} | "
                     + " | ".join(f"{c.get(k, 0.0):.2f}" for k in cats) + f" | {r['gaps_ms']:.2f} | "
                     f"{r['launches']:.0f} | {r['short_launches']:.0f} | {r['short_ms']:.2f} |")
    for r in rows:
        lines += bench_profile.kernel_table(f"**{r['preset']} {r['recipe']}**: the kernels that took longest, per step",
                                            r["kernels"], kind="category")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="125m", help="one preset or several, comma separated")
    p.add_argument("--recipes", default="bf16,delayed,current,block")
    p.add_argument("--batch", type=int, help="global batch (sequences); default: the preset's")
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="traced steps per recipe")
    p.add_argument("--top", type=int, default=15, help="kernels listed per recipe")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, preset {args.preset}", flush=True)
    corpus = data_lib.load(None, 16 << 20)
    rows = []
    for preset in [p for p in args.preset.split(",") if p]:
        for recipe in [r for r in args.recipes.split(",") if r]:
            rows.append(profile_recipe(preset, recipe, args, corpus))
            print(markdown(rows[-1:]), flush=True)
    md = markdown(rows)
    print(md)
    write_results(args.out, args.md, {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
                  md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
