"""The speed and memory cost of te_jax's memory options on the GPT example's train step, timed in turns (issue 41).

    python benchmarks/bench_gpt_options.py --preset 1.3b --recipe delayed
    python benchmarks/bench_gpt_options.py --preset tiny --batch 2 --seq-len 32 --warmup 1 --iters 1 --trials 1  # CPU

The variants are the options of examples/gpt/train.py: ``none`` (no option), ``recompute_norm_act`` (te_jax's
layers recompute their norms' and activation's outputs in the backward) and ``remat:<policy>`` (every block under
``nn.remat`` with one of ``examples.gpt.config.REMAT_CHOICES``: fp8, fp8-pre-activation, nothing, offload-fp8).
They train the same parameters, so one train state (parameters, AdamW, FP8 state: ``train.build_run`` of the first
variant; about 14.5 GiB at 1.3b) serves them all, and each variant gets its own jitted step
(``steps.make_train_step`` with that variant's model, the state donated). A variant whose parameter tree is not
the state's ends the run before anything is compiled.

How it is timed: every step is compiled first (XLA's memory analysis of each gives the "temp" and "total"
columns; a step that cannot fit the device is reported and left out), then each variant runs ``--warmup`` steps
(so the delayed-scaling state is trained), then ``--trials`` rounds time ``--iters`` back-to-back steps of every
variant, in an order shuffled anew each round (``timing.time_interleaved``). The state is chained: each step's
returned state is the next step's input, whichever variant runs next. Each step takes one of a few pre-generated
random batches in turn. A variant's time is the median over its rounds; "time vs none" divides it by the ``none``
variant's. The device's measured peak is not given: in one process it is the largest over every variant run so
far, not one variant's own.

Usage: python benchmarks/bench_gpt_options.py [--preset 1.3b] [--recipe delayed]
       [--variants none,recompute_norm_act,remat:fp8,remat:fp8-pre-activation,remat:nothing] [--batch B]
       [--seq-len S] [--warmup 3] [--iters 5] [--trials 7] [--out r.json] [--md r.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # appended: an installed te_jax wins
sys.path.append(str(pathlib.Path(__file__).resolve().parent))  # siblings, when imported from elsewhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from examples.gpt import parallel  # noqa: E402
from examples.gpt import train as train_lib  # noqa: E402
from examples.gpt.config import REMAT_CHOICES, RunConfig, make_recipe  # noqa: E402
from examples.gpt.memory import StepTooLarge, check_fits, step_description  # noqa: E402
from examples.gpt.steps import make_train_step  # noqa: E402
from memory_analysis import memory_row  # noqa: E402
from memory_variants import gpt_built  # noqa: E402
from timing import add_repeat_args, time_interleaved, write_results  # noqa: E402

VARIANTS = ("none", "recompute_norm_act", *(f"remat:{p}" for p in REMAT_CHOICES if p != "none"))
DEFAULT_VARIANTS = "none,recompute_norm_act,remat:fp8,remat:fp8-pre-activation,remat:nothing"
BATCHES = 3  # pre-generated random batches, taken in turn


# ---- the variants ------------------------------------------------------------------------------------------


def variant_config(base: RunConfig, name: str) -> RunConfig:
    """``base`` with the memory option ``name`` (one of ``VARIANTS``), resolved and checked.

    Raises:
      ValueError: ``name`` is no variant, or the option does not apply to ``base``'s recipe.
    """
    if name not in VARIANTS:
        raise ValueError(f"--variants: no variant {name!r}; choose from {', '.join(VARIANTS)}")
    if name == "recompute_norm_act":
        base = dataclasses.replace(base, recompute_norm_act=True)
    elif name.startswith("remat:"):
        base = dataclasses.replace(base, remat=name.removeprefix("remat:"))
    cfg = base.resolved()
    cfg.check()
    make_recipe(cfg.recipe, cfg.model_config().layers)
    return cfg


def abstract_variables(cfg: RunConfig) -> Any:
    """The shapes of the variables (parameters and FP8 state) ``train.build_run`` initializes for ``cfg``."""
    return gpt_built(cfg, abstract_only=True).args[0].params


def first_difference(reference: Any, candidate: Any) -> str | None:
    """Where ``candidate``'s leaves first differ from ``reference``'s (path, shape, dtype), or None if nowhere."""
    ref = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(reference)[0]}
    cand = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(candidate)[0]}
    for path in sorted(ref.keys() | cand.keys()):
        if path not in cand:
            return f"{path} is missing"
        if path not in ref:
            return f"{path} is not in the shared state"
        a, b = ref[path], cand[path]
        if (tuple(a.shape), jnp.dtype(a.dtype)) != (tuple(b.shape), jnp.dtype(b.dtype)):
            return f"{path} is {b.dtype}{list(b.shape)}, the shared state's {a.dtype}{list(a.shape)}"
    if jax.tree.structure(reference) != jax.tree.structure(candidate):
        return f"the tree's structure: {jax.tree.structure(candidate)}"
    return None


def check_shares_state(reference: Any, first: str, variants: dict[str, Any]) -> None:
    """Raises SystemExit when a variant's variables (``variants``: name -> tree) differ from ``reference``, the
    variables of the shared state built from the variant ``first``."""
    for name, variables in variants.items():
        where = first_difference(reference, variables)
        if where is not None:
            raise SystemExit(f"te_jax: bench_gpt_options: variant {name!r} has another parameter tree than the "
                             f"state built from {first!r} ({where}); the variants must train the same parameters "
                             "to share one state: time this one in a run of its own")


def make_step(run: train_lib.Run, cfg: RunConfig) -> Callable:
    """The jitted train step of ``cfg``'s model on ``run``'s state (donated), as ``build_run``'s ``jit_step``.

    The state keeps ``run``'s ``apply_fn`` (a static field of its tree) in and out, so every variant's step takes
    and returns the same tree; the variant's own model is swapped in inside the step.
    """
    model = train_lib.gpt_model(cfg)
    shape = parallel.parse_mesh(cfg.mesh)
    quant_key = jax.random.split(jax.random.key(cfg.seed))[1]  # build_run's
    inner = make_train_step(model, run.recipe, parallel.mesh_resource(shape), quant_key, mesh=run.mesh)

    def step(state, tokens):
        new_state, metrics = inner(state.replace(apply_fn=model.apply), tokens)
        return new_state.replace(apply_fn=state.apply_fn), metrics

    step.__name__ = step.__qualname__ = "train_step_" + "".join(c if c.isalnum() else "_" for c in cfg.remat) + (
        "_recompute_norm_act" if cfg.recompute_norm_act else "")
    return jax.jit(step, in_shardings=(run.shardings, run.batch_sharding), out_shardings=(run.shardings, None),
                   donate_argnums=0)


# ---- timing, the state chained -----------------------------------------------------------------------------


def time_chained(steps: dict[str, Callable], state: Any, batches: list, warmup: int, iters: int,
                 trials: int) -> tuple[dict[str, list[float]], Any]:
    """``timing.time_interleaved`` of the steps on one chained state: every call takes the state the previous call
    returned (the steps donate it), whichever variant ran it. Returns the seconds per step of each variant per
    round, and the final state."""
    chained = [state]

    def call(step):
        def run(batch):
            chained[0], metrics = step(chained[0], batch)
            return chained[0], metrics
        return run

    sets = [(batch,) for batch in batches]
    per_step = time_interleaved({name: (call(step), sets) for name, step in steps.items()}, warmup, iters, trials)
    return per_step, chained[0]


# ---- the benchmark -----------------------------------------------------------------------------------------


def bench(args: argparse.Namespace, configs: dict[str, RunConfig]) -> dict:
    """Builds the shared state, compiles every variant's step, times them in turns; returns the result."""
    names = list(configs)
    first = configs[names[0]]
    variants = {name: abstract_variables(cfg) for name, cfg in configs.items()}
    check_shares_state(variants[names[0]], names[0], variants)
    run = train_lib.build_run(first)
    check_shares_state(run.state.params, names[0], variants)  # build_run's state, not only its shapes
    key = jax.random.key(first.seed + 1)
    batches = [jax.device_put(jax.random.randint(k, (first.batch, first.seq_len + 1), 0, 256, jnp.int32),
                              run.batch_sharding) for k in jax.random.split(key, BATCHES)]
    state = run.state
    rows, steps = {}, {}
    for name, cfg in configs.items():
        row = rows[name] = {"variant": name}
        start = time.perf_counter()
        try:
            compiled = make_step(run, cfg).lower(state, batches[0]).compile()
            row.update(memory_row(compiled))
            check_fits(compiled, f"{step_description(cfg)} ({name})")
        except (StepTooLarge, jax.errors.JaxRuntimeError) as err:
            row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
            print(f"{name}: not timed: {row['error']}", flush=True)
            continue
        steps[name] = compiled
        print(f"{name}: compiled in {time.perf_counter() - start:.0f} s, temp {row.get('temp_gib', 0):.3f} GiB",
              flush=True)
    per_step, state = time_chained(steps, state, batches, args.warmup, args.iters, args.trials)
    tokens = first.batch * first.seq_len
    for name, seconds in per_step.items():
        rows[name].update(ms=1e3 * statistics.median(seconds), trial_ms=[1e3 * s for s in seconds])
        rows[name]["tokens_per_s"] = tokens / statistics.median(seconds)
    base = rows.get("none", {}).get("ms")
    for row in rows.values():
        if base and "ms" in row:
            row["vs_none"] = row["ms"] / base
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "preset": first.preset, "recipe": first.recipe, "batch": first.batch, "seq_len": first.seq_len,
            "warmup": args.warmup, "iters": args.iters, "trials": args.trials,
            "steps_run": int(jax.device_get(state.step)), "rows": list(rows.values())}


def _gib(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "-"


def markdown(result: dict) -> str:
    """The result as a titled markdown table (variant | median ms | tokens/s | time vs none | temp GiB | total GiB)."""
    lines = [f"**GPT {result['preset']}, {result['batch']} x {result['seq_len']}, recipe {result['recipe']}, "
             f"{result['device']}: te_jax's memory options timed in turns (median of {result['trials']} rounds of "
             f"{result['iters']} steps, {result['warmup']} warm-up steps each, one state chained through all)**", "",
             "| variant | median ms | tokens/s | time vs none | temp GiB | total GiB |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['variant']} | not timed: {r.get('error', '')[:80]} | - | - | {_gib(r, 'temp_gib')} | "
                         f"{_gib(r, 'total_gib')} |")
            continue
        ratio = f"{r['vs_none']:.3f}x" if "vs_none" in r else "-"
        lines.append(f"| {r['variant']} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {ratio} | {_gib(r, 'temp_gib')} | "
                     f"{_gib(r, 'total_gib')} |")
    lines += ["", "temp and total: XLA's memory analysis of each compiled step (total = args + temp + out - aliased). "
              "The device's peak (peak_bytes_in_use) is not given: in one process it is the largest over every "
              "variant run so far, not one variant's own."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--recipe", default="delayed", help="one examples/gpt/train.py --recipe name")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--batch", type=int, help="global batch (sequences); default: the preset's")
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    add_repeat_args(p, warmup=3, iters=5, trials=7)
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    """The command line; returns the result. A bad flag exits with status 2 before anything is compiled."""
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    try:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"--variants {args.variants!r}: give one or more variants, each once")
        for flag, value, least in (("--warmup", args.warmup, 0), ("--iters", args.iters, 1),
                                   ("--trials", args.trials, 1)):
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")
        base = RunConfig(preset=args.preset, recipe=args.recipe, batch=args.batch, seq_len=args.seq_len,
                         progress=False)
        configs = {name: variant_config(base, name) for name in names}
    except ValueError as err:
        parser.error(str(err))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, preset {args.preset}, recipe {args.recipe}",
          flush=True)
    result = bench(args, configs)
    md = markdown(result)
    print(md)
    write_results(args.out, args.md, result, md)
    return result


if __name__ == "__main__":
    main()
