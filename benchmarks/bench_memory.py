"""Memory benchmark (issue 41): a train step's device memory, te_jax's layers against flax.linen's, per recipe.

For every variant, the memory of one training step (forward, backward, and for the GPT presets the optimizer
update), from XLA's analysis of the compiled step (``compiled.memory_analysis()``: temporaries, arguments,
outputs, the part of the outputs aliased to donated arguments) and, on a GPU, the device's measured
``peak_bytes_in_use`` over ``--steps`` steps (each variant in a process of its own, so that every peak is its
own). Also the bytes the differentiated function keeps for its backward, before XLA sees it
("residuals": ``jax.ad_checkpoint``'s saved residuals that are not arguments, i.e. activations).

Sections (``--sections``):

* ``mlp``: LayerNormMLP at bench_layers.py's shape (T=8192, H=8192, F=28672, gelu, bf16): flax.linen
  LayerNorm -> Dense -> gelu -> Dense in bf16 and with flax's FP8 (``nn.Fp8DirectDotGeneralOp``), and
  ``te_jax.flax.LayerNormMLP`` with autocast off and under each ``--recipes`` recipe (and TransformerEngine-JAX's
  LayerNormMLP where it is importable);
* ``moe``: ``te_jax.flax.MoE`` at bench_moe.py's layer shapes (autocast off: ragged_dot; each recipe) and
  bench_moe's bf16 batched-einsum MoE (capacity 1.0);
* ``gpt``: examples/gpt's train step (its model, optimizer and step functions) for ``--presets``: ``flax``
  (flax.linen's own blocks, bf16), ``flax-fp8`` (the blocks through flax's FP8), ``bf16`` (te_jax's
  layers, autocast off) and each recipe; and te_jax's memory options (``--options``): the layers'
  ``recompute_norm_act`` and the blocks under ``nn.remat`` with te_jax.flax's policies (``--remat``).

``--analysis-only`` compiles with abstract inputs (``jax.ShapeDtypeStruct``; nothing is allocated) and runs
anywhere, a CPU included. The CPU's figures are not a GPU's; their ratios point at the differences. Two
things make them closer to a GPU's: (1) XLA:CPU expands the optimization barriers with which ``jax.checkpoint``
keeps a recomputation from being merged back into the forward, so every remat would look free of effect:
on a CPU this script disables that pass (``--xla_disable_hlo_passes=cse_barrier_expander``, set before jax
starts); (2) on a CPU attention is XLA's, which keeps the ``[B, N, T, T]`` scores for its backward, while a
GPU runs cuDNN's fused attention, which keeps q, k, v, the output and ``[B, N, T]`` float32 statistics:
``--attention standin`` (the CPU's default) replaces it by a stand-in that keeps exactly those (its values
are not attention's; only the memory is compared). On a CPU, XLA also computes bf16 dots in float32 and may
keep float32 copies of their saved inputs, which inflates the bf16 variants (not te_jax's FP8 GEMMs).

``--per-block`` (gpt) compiles each variant at 2 and 4 blocks and reports the temporaries per block and the
estimate at the preset's depth; ``--layers N`` compiles at N blocks. ``--breakdown`` lists, per variant, the
largest values live at the peak of the compiled step, grouped by the op that made them (from XLA's buffer
assignment) and the largest saved residuals by source. ``--largest-batch GIB`` (gpt, with ``--analysis-only``)
adds the largest batch whose compiled step (arguments + temporaries + outputs - aliased) fits GIB, the figure
examples/gpt/train.py's memory check compares with the device's limit (``0``: that limit, on a GPU):

    python benchmarks/bench_memory.py --analysis-only --sections gpt --presets 1.3b --recipes delayed,block \
        --options none --remat "" --largest-batch 0

``--no-xla-remat`` (GPU) compiles without XLA's rematerialization down to the device's memory, so a step
near or over the limit reports what it needs rather than what XLA squeezed it to. ``--jobs N`` analyses N
variants at a time, each in a child process (the 1.3b step compiles in 30-60 s on a GPU machine and a
largest-batch search takes several compiles; compiles running side by side autotune side by side too).

The variants are built in memory_variants.py, measured and tabulated in memory_analysis.py; results and their
commands: benchmarks/README.md, "Memory".

Usage: python benchmarks/bench_memory.py [--analysis-only] [--sections mlp,moe,gpt] [--presets 125m,1.3b,moe-1b]
       [--recipes delayed,current,mxfp8,block] [--options none,recompute_norm_act] [--remat fp8,nothing]
       [--per-block | --layers N] [--steps 3] [--only REGEX] [--breakdown] [--largest-batch GIB] [--no-xla-remat]
       [--jobs N] [--out r.json] [--md r.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_variants, memory_analysis, layer_variants, ...

import jax  # noqa: E402

from memory_analysis import add_per_block, analyze, largest_batch, live_at_peak, markdown, measure  # noqa: E402
from memory_variants import PRESETS, RECIPES, SECTIONS, Variant  # noqa: E402
from timing import write_results  # noqa: E402

CPU_BARRIER_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"


def rows_from_children(variants: list[Variant], argv: list[str], jobs: int, timeout: float,
                       preallocate: bool) -> dict[str, dict]:
    """Each variant's row from a child process of its own (``--child KEY``), ``jobs`` at a time: the measured
    runs one at a time, each with the device to itself; the analysis several at once (the 1.3b step takes
    30-60 s to compile on a GPU machine, and a largest-batch search several compiles), their device clients
    then without preallocation (``preallocate`` False; the allocator's limit, which XLA and
    ``--largest-batch 0`` read, is the same). Returns key -> row (a child's failure is an "error" row).
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), *strip_jobs(argv)]
    env = dict(os.environ) if preallocate else {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    pending, running, rows = list(variants), {}, {}
    started: dict[str, float] = {}
    while pending or running:
        while pending and len(running) < jobs:
            v = pending.pop(0)
            out = tempfile.TemporaryFile(mode="w+")
            running[v.key] = (subprocess.Popen([*cmd, "--child", v.key], stdout=out, stderr=subprocess.STDOUT,
                                               text=True, env=env), out)
            started[v.key] = time.monotonic()
            print(f"{v.key} ...", flush=True)
        time.sleep(1.0)
        for key, (proc, out) in list(running.items()):
            timed_out = time.monotonic() - started[key] > timeout
            if proc.poll() is None and not timed_out:
                continue
            if timed_out and proc.poll() is None:
                proc.kill()
                proc.wait()
            out.seek(0)
            lines = out.read().splitlines()
            out.close()
            row = next((json.loads(line) for line in reversed(lines) if line.startswith("{")), None)
            if row is None:
                why = f"timed out after {timeout:.0f} s" if timed_out else f"exit {proc.returncode}"
                row = {"error": f"{why}: {' | '.join(lines[-3:])[:400]}"}
            rows[key] = row
            del running[key]
            print(f"{key}:", summary(row), flush=True)
    return rows


def summary(row: dict) -> dict:
    """A row as the progress lines print it: floats rounded, the long breakdowns left out."""
    return {k: (round(x, 3) if isinstance(x, float) else x) for k, x in row.items()
            if k not in ("top_residuals", "live_at_peak")}


def strip_jobs(argv: list[str]) -> list[str]:
    """``argv`` without ``--jobs N`` / ``--jobs=N`` (a child analyses one variant itself)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--jobs":
            skip = True
        elif not a.startswith("--jobs="):
            out.append(a)
    return out


# ---- command line ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p.add_argument("--analysis-only", action="store_true", help="compile on abstract inputs only (any platform)")
    p.add_argument("--sections", type=split, default=["mlp", "moe", "gpt"])
    p.add_argument("--presets", type=split, default=split(PRESETS))
    p.add_argument("--recipes", type=split, default=split(RECIPES))
    p.add_argument("--options", type=split, default=["none", "recompute_norm_act"],
                   help="te_jax variants: none, recompute_norm_act (the layers' option)")
    p.add_argument("--remat", type=split, default=["fp8", "nothing"],
                   help="gpt: also each te recipe of --remat-recipes with every block under nn.remat with this "
                        "policy (examples/gpt --remat: fp8, fp8-pre-activation, nothing, offload-fp8)")
    p.add_argument("--remat-recipes", type=split, default=["delayed"])
    p.add_argument("--layers", type=int, default=0, help="gpt: compile at this many blocks (0: the preset's)")
    p.add_argument("--per-block", action="store_true", help="gpt: at 2 and 4 blocks, per block and estimate")
    p.add_argument("--batch", type=int, help="gpt: batch (default the preset's)")
    p.add_argument("--seq-len", type=int, help="gpt: sequence length (default the preset's)")
    p.add_argument("--tiny", action="store_true", help="mlp/moe: small shapes")
    p.add_argument("--attention", choices=["auto", "native", "standin"], default="auto",
                   help="auto: the stand-in on a CPU, jax's attention on a GPU")
    p.add_argument("--steps", type=int, default=3, help="measured runs: steps before reading the peak")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds per variant run in a child process (measured, or --jobs > 1)")
    p.add_argument("--only", default="", help="regex over 'section | case | variant'")
    p.add_argument("--breakdown", action="store_true", help="the largest values live at the peak, and residuals")
    p.add_argument("--largest-batch", type=float, metavar="GIB",
                   help="gpt, with --analysis-only: also the largest batch whose compiled step fits GIB (0: the "
                        "device's allocator limit, a GPU's), searched by compiling at a few batch sizes")
    p.add_argument("--no-xla-remat", action="store_true",
                   help="with --analysis-only on a GPU: compile as if the device had 100x its memory, so XLA's "
                        "own rematerialization (which trades speed to fit the device) leaves the step as written: "
                        "what each variant needs, comparable across variants")
    p.add_argument("--jobs", type=int, default=1,
                   help="with --analysis-only: analyse this many variants at a time, each in a child process")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out")
    p.add_argument("--md")
    return p


NO_REMAT_SLOP_FACTOR = 10_000


def largest_batch_limit_gib(args) -> float | None:
    """``--largest-batch``'s limit in GiB: as given, or (0) the device's allocator limit."""
    if args.largest_batch is None:
        return None
    if args.largest_batch > 0:
        return args.largest_batch
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    if not limit:
        raise SystemExit("bench_memory: --largest-batch 0 takes the device's allocator limit, and this device "
                         f"({jax.default_backend()}) reports none: give the GiB")
    return limit / 2**30


def analysis_row(v: Variant, args, att: str, dump_dir: str | None) -> dict:
    """``v``'s compiled memory analysis (and, with --largest-batch, its largest batch); an error is its row."""
    row: dict = {}
    try:
        row.update(analyze(v, att, args.breakdown))
        if dump_dir:
            row["live_at_peak"] = live_at_peak(dump_dir, row["module"])
        if args.largest_batch is not None and v.at_batch is not None:
            start = args.batch or gpt_preset_batch(v.case)
            row.update(largest_batch(v, largest_batch_limit_gib(args), att, start=start,
                                     known={start: row["total_gib"]}))
    except Exception as err:  # noqa: BLE001  (one variant's failure is its row; the others still run)
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}" if str(err) else repr(err)
        traceback.print_exc()
    return row


def gpt_preset_batch(case: str) -> int:
    """The batch of the GPT preset a case names ("GPT 1.3b @ 4 blocks" -> 16)."""
    from examples.gpt.presets import PRESETS as GPT_PRESETS

    return GPT_PRESETS[case.split()[1]].batch


def gpu_plugin_installed() -> bool:
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    dump_dir = None
    if args.no_xla_remat and not args.analysis_only:
        raise SystemExit("bench_memory: --no-xla-remat changes the compiled step: give --analysis-only")
    if args.largest_batch is not None and not args.analysis_only:
        raise SystemExit("bench_memory: --largest-batch searches by compiling: give --analysis-only")
    if args.analysis_only:  # before jax starts its backend: XLA reads the flags once
        if args.jobs > 1:  # this process compiles nothing: it leaves the device's memory to its children
            os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        flags = [] if gpu_plugin_installed() else [CPU_BARRIER_FLAG]
        if args.no_xla_remat:  # XLA:GPU rematerializes down to (device memory - I/O) x this factor / 100
            flags.append(f"--xla_gpu_memory_limit_slop_factor={NO_REMAT_SLOP_FACTOR}")
        if args.breakdown:  # XLA's buffer assignment of every step, read by live_at_peak (a GPU's too)
            dump_dir = tempfile.mkdtemp(prefix="bench_memory_")
            flags += [f"--xla_dump_to={dump_dir}", "--xla_dump_hlo_as_text", "--xla_dump_hlo_module_re=step_"]
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    variants = [v for s in args.sections for v in SECTIONS[s](args) if not args.only or re.search(args.only, v.key)]
    if args.jobs < 1 or (args.jobs > 1 and not args.analysis_only):
        raise SystemExit("bench_memory: --jobs takes a number >= 1, and more than 1 only with --analysis-only "
                         "(measured variants run one at a time, each with the device to itself)")
    measured = not args.analysis_only  # then the variants run in child processes: this one leaves the device alone
    platform = "measured" if measured else jax.default_backend()
    att = args.attention if args.attention != "auto" else ("standin" if platform == "cpu" else "native")
    if args.child:  # one variant, in its own process
        (variant,) = [v for v in variants if v.key == args.child]
        row = measure(variant, args.steps) if measured else analysis_row(variant, args, att, dump_dir)
        print(json.dumps(row), flush=True)
        return 0
    in_children = rows_from_children(variants, argv, args.jobs, args.timeout, preallocate=measured) \
        if measured or args.jobs > 1 else {}
    rows = []
    for v in variants:
        row = {"section": v.section, "case": v.case, "variant": v.name}
        if v.key not in in_children:
            print(f"{v.key} ...", flush=True)
            row.update(analysis_row(v, args, att, dump_dir))
            print("   ", summary(row), flush=True)
        rows.append({**row, **in_children.get(v.key, {})})
    if args.per_block:
        add_per_block(rows)
    if measured:
        platform = next((r["device"] for r in rows if "device" in r), platform)
    md = markdown(rows, args.analysis_only, platform)
    print(md)
    result = {"platform": platform, "attention": att, "analysis_only": args.analysis_only,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}
    write_results(args.out, args.md, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
