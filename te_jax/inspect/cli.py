"""Compare recipes layer by layer: train a small model a few steps under each, print the statistics.

    python -m te_jax.inspect.cli --recipes delayed,current,mxfp8,nvfp4,recipes/mixed_per_layer.py --steps 3
    python -m te_jax.inspect.cli --recipes mxfp8,nvfp4 --png report.png --jsonl stats.jsonl

Each recipe trains the same built-in byte-level language model (an embedding,
``--layers`` te_jax ``TransformerLayer`` blocks, a final LayerNorm and a
high-precision output head) from the same initialization on the same batches
(bytes of Python's standard library, or ``--data FILE``) for ``--steps``
AdamW steps under ``te_jax.autocast(recipe=..., inspect=True)``. The tables
average each tensor's statistics over the steps after the first ``--skip``
(delayed scaling's first step quantizes with its initial scale 1).

``--recipes`` takes delayed, current, mxfp8, nvfp4, block (the built-in
recipes with default fields) and anything ``te_jax.recipe.load_recipe``
accepts (a recipes/*.py path, a gallery name, a class name).
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from te_jax import recipe as R
from te_jax.core.stats import STATS_COLLECTION, STAT_NAMES
from te_jax.flax import LayerNorm, TransformerLayer
from te_jax.inspect.records import Row, compare_table, format_table, mean_over, render, to_rows
from te_jax.recipe.autocast import autocast
from te_jax.train import TrainState, value_and_grad

SHORT_NAMES = {"delayed": R.DelayedScaling, "current": R.Float8CurrentScaling, "mxfp8": R.MXFP8BlockScaling,
               "nvfp4": R.NVFP4BlockScaling, "block": R.Float8BlockScaling}
VOCAB = 256


def make_recipe(name: str, num_layers: int | None = None) -> R.Recipe:
    """A short name (``SHORT_NAMES``) or anything ``te_jax.recipe.load_recipe`` accepts."""
    return SHORT_NAMES[name]() if name in SHORT_NAMES else R.load_recipe(name, num_layers=num_layers)


def recipe_label(name: str) -> str:
    return Path(name).stem if name.endswith(".py") else name


class TinyLM(nn.Module):
    """Embedding, ``layers`` TransformerLayer blocks, LayerNorm, and a high-precision head."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    mlp_hidden: int = 512
    dtype: str = "bfloat16"

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.normal(0.02)
        x = nn.Embed(VOCAB, self.hidden, embedding_init=init, dtype=self.dtype, name="embed")(tokens)
        for i in range(self.layers):
            x = TransformerLayer(num_attention_heads=self.heads, num_gqa_groups=max(1, self.heads // 2),
                                 intermediate_dim=self.mlp_hidden, dtype=self.dtype, kernel_init=init,
                                 name=f"TransformerLayer_{i}")(x)
        x = LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(VOCAB, dtype=self.dtype, kernel_init=init, name="head")(x).astype(jnp.float32)


def load_tokens(path: str | None, max_bytes: int = 2 << 20) -> np.ndarray:
    """Bytes of ``path``, or of the standard library's .py files in sorted order, as uint8 tokens."""
    if path:
        data = Path(path).read_bytes()[:max_bytes]
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for f in sorted(root.glob("*.py")):
            if total >= max_bytes:
                break
            chunks.append(f.read_bytes()[:max_bytes - total])
            total += len(chunks[-1])
        data = b"\n".join(chunks)
    if len(data) < 4096:
        raise SystemExit(f"te_jax.inspect.cli: need at least 4 KiB of text, got {len(data)} bytes")
    return np.frombuffer(data, np.uint8)


def batch(tokens: np.ndarray, step: int, size: int, seq_len: int, seed: int) -> np.ndarray:
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq_len - 1, size=size)
    return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def run_recipe(recipe: R.Recipe, model: nn.Module, tokens: np.ndarray, args) -> tuple[list[list[Row]], list[float],
                                                                                         float]:
    """Trains ``args.steps`` steps; returns the statistics rows per step, the losses and the seconds taken."""
    init_key, quant_key = jax.random.split(jax.random.key(args.seed))
    first = jnp.asarray(batch(tokens, 0, args.batch, args.seq_len, args.seed))
    with autocast(recipe=recipe, inspect=True):
        variables = jax.jit(model.init)({"params": init_key, "quantize": quant_key}, first[:, :-1])
    state = TrainState.create(apply_fn=model.apply, params=dict(variables), tx=optax.adamw(args.lr))

    @jax.jit
    def step(state: TrainState, tokens: jax.Array):
        key = jax.random.fold_in(quant_key, state.step)

        def loss_fn(v):
            logits = state.apply_fn(v, tokens[:, :-1], rngs={"quantize": key})
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

        with autocast(recipe=recipe, inspect=True):
            loss, grads = value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads[STATS_COLLECTION]

    per_step, losses = [], []
    start = time.perf_counter()
    for i in range(args.steps):
        state, loss, stats = step(state, jnp.asarray(batch(tokens, i, args.batch, args.seq_len, args.seed)))
        per_step.append(to_rows(jax.device_get(stats), step=i))
        losses.append(float(loss))
    return per_step, losses, time.perf_counter() - start


def summary_table(by_recipe: dict[str, list[Row]], losses: dict[str, list[float]]) -> str:
    """Per recipe: mean and worst relative error, mean underflow, worst saturation, the loss."""
    body = []
    for name, rows in by_recipe.items():
        err = [r["rel_error"] for r in rows]
        worst = max(rows, key=lambda r: r["rel_error"]) if rows else None
        body.append((name, len(rows), float(np.mean(err)) if err else "-", float(np.max(err)) if err else "-",
                     f"{worst['layer']} {worst['role']}" if worst else "-",
                     float(np.mean([r["underflow"] for r in rows])) if rows else "-",
                     float(np.max([r["saturation"] for r in rows])) if rows else "-",
                     f"{losses[name][0]:.3f} -> {losses[name][-1]:.3f}"))
    return render(("recipe", "tensors", "mean rel_error", "max rel_error", "worst tensor", "mean underflow",
                   "max saturation", "loss"), body)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m te_jax.inspect.cli", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--recipes", default="delayed,current,mxfp8,nvfp4",
                   help="comma-separated: delayed, current, mxfp8, nvfp4, block, or recipes/*.py paths")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", type=int, default=1, help="leave the first N steps out of the tables")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp-hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="a text file to train on instead of the standard library's sources")
    p.add_argument("--stat", default="rel_error", choices=STAT_NAMES, help="the statistic of the comparison table")
    p.add_argument("--detail", action="store_true", help="also print every statistic of every recipe")
    p.add_argument("--jsonl", metavar="FILE", help="write every step's statistics as JSON lines")
    p.add_argument("--png", metavar="FILE", help="write the matplotlib report (ranking, two recipes compared)")
    p.add_argument("--compare", metavar="A,B", help="the two recipes the report compares (default: the first two)")
    p.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars and histograms (DIR/<recipe>)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, list[Row]]:
    """Runs the comparison; returns recipe label -> the averaged rows."""
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    if not names:
        raise SystemExit("te_jax.inspect.cli: --recipes is empty")
    if not 0 <= args.skip < args.steps:
        raise SystemExit(f"te_jax.inspect.cli: --skip {args.skip} must be in [0, --steps {args.steps})")
    recipes = {recipe_label(n): make_recipe(n, args.layers) for n in names}  # a bad name fails before any work
    order = [n.strip() for n in (args.compare or "").split(",") if n.strip()]
    if [n for n in order if n not in recipes]:
        raise SystemExit(f"te_jax.inspect.cli: --compare {args.compare!r} must name recipes among {list(recipes)}")
    tokens = load_tokens(args.data)
    model = TinyLM(args.layers, args.hidden, args.heads, args.mlp_hidden)
    print(f"te_jax.inspect: {len(recipes)} recipes x {args.steps} steps, {args.layers} layers, hidden {args.hidden}, "
          f"{args.batch}x{args.seq_len} tokens per step ({jax.default_backend()})")
    jsonl = tb = None
    if args.jsonl:
        from te_jax.inspect.writers import JsonlWriter

        jsonl = JsonlWriter(args.jsonl)
    averaged, losses = {}, {}
    for label, recipe in recipes.items():
        per_step, losses[label], seconds = run_recipe(recipe, model, tokens, args)
        averaged[label] = mean_over([r for rows in per_step[args.skip:] for r in rows])
        print(f"  {label}: {len(averaged[label])} quantized tensors, loss {losses[label][0]:.3f} -> "
              f"{losses[label][-1]:.3f}, {seconds:.1f} s (compile included)")
        if jsonl:
            for rows in per_step:
                jsonl.write(rows, recipe=label)
        if args.tensorboard:
            from te_jax.inspect.writers import TensorBoardWriter

            with TensorBoardWriter(Path(args.tensorboard) / label) as tb:
                for i, rows in enumerate(per_step):
                    tb.write(rows, step=i)
    if jsonl:
        jsonl.close()
        print(f"statistics: {args.jsonl}")
    print()
    print(compare_table(averaged, args.stat))
    print()
    print(summary_table(averaged, losses))
    if args.detail:
        for label, rows in averaged.items():
            print(f"\n{label}\n{format_table(rows)}")
    if args.png:
        from te_jax.inspect.report import plot_report

        ordered = {n: averaged[n] for n in [*order, *averaged] if n in averaged}
        print(f"report: {plot_report(ordered, args.png, stat=args.stat)}")
    return averaged


if __name__ == "__main__":
    main()
