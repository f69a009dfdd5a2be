"""The demo: train the tiny byte-level GPT with bf16 and two FP8 recipes, then compare them.

    bash tools/demo.sh                       # makes .venv, builds te_jax, runs this
    .venv/bin/python examples/gpt/demo.py [--steps N] [--recipes bf16,current,delayed] [--out DIR]

Trains on the Python standard library's source (no download), prints a table
of final train/eval loss and tokens/s per recipe, and writes a loss-curve PNG
and results.json to ``--out``. Runs on whatever JAX finds: the GPU when jax
has its CUDA plugin, else the CPU (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples.gpt` importable
    # appended, not prepended: an installed te_jax (with its compiled modules) wins over the source tree
    sys.path.append(str(Path(__file__).resolve().parents[2]))

import jax

import te_jax
from examples.gpt import report
from examples.gpt import train as train_lib

DEFAULT_OUT = Path(__file__).resolve().parent / "demo_out"
DEMO_STEPS = 120  # with the tiny preset: about two and a half minutes for three recipes on 2 CPU cores


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="te_jax demo: bf16 vs FP8 on a tiny GPT")
    p.add_argument("--recipes", default="bf16,current,delayed", help="comma-separated (see train.py --recipe)")
    p.add_argument("--preset", default="tiny", choices=sorted(train_lib.PRESETS))
    p.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"training steps per recipe (default {DEMO_STEPS})")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--data", help="a text file instead of the Python standard library")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="where the plot and results.json go")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of tqdm bars")
    return p


def choose_backend() -> str:
    """The te_jax backend for this machine; on a GPU without te_jax's CUDA kernels, the reference (said aloud)."""
    from te_jax.ops import ffi as _ffi

    if jax.default_backend() == "gpu" and not _ffi.CUDA_BUILT:
        print("demo: te_jax's CUDA kernels are not built, so the FP8 runs use the pure-JAX reference "
              f"(te_jax.ops.backend 'reference'): correct, not fast. To fix: {_ffi.REBUILD_HINT}")
        return "reference"
    return "ffi"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    configs = [train_lib.RunConfig(preset=args.preset, recipe=name, steps=args.steps, batch=args.batch,
                                   seq_len=args.seq_len, eval_every=args.eval_every, data=args.data,
                                   progress=not args.no_progress).resolved() for name in recipes]
    try:
        if not configs:
            raise ValueError(f"--recipes {args.recipes!r} names no recipe")
        train_lib.check_configs(configs)
        corpus = train_lib.load_corpus(args.data, configs[0].data_bytes, configs[0].seq_len)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    devices = jax.devices()
    print(f"te_jax {te_jax.__version__}, jax {jax.__version__}: {len(devices)} x {devices[0].device_kind} "
          f"({jax.default_backend()})")
    print(f"data: {corpus.describe()}")
    start = time.perf_counter()
    results = []
    with te_jax.ops.backend.use(choose_backend()):
        for cfg in configs:
            results.append(train_lib.train(cfg, corpus))
    r0 = results[0]
    print(f"\n{args.preset} model: {r0['params'] / 1e6:.2f}M parameters, {r0['steps']} steps of "
          f"{r0['tokens_per_step']:,} tokens per recipe, {time.perf_counter() - start:.0f} s in all "
          f"({r0['backend']})\n")
    print(train_lib.format_table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot = report.plot_curves(results, out / "loss_curves.png")
    print()
    if plot:
        print(f"loss curves: {plot}")
    print(f"results:     {(out / 'results.json').resolve()}")
    return results


if __name__ == "__main__":
    main()
