"""The injection routes against te_jax's own layers: the same GEMMs reached through flax's hooks.

Two timings of a training step (forward and backward, FP8 state trained a few steps), every variant timed in
turns in one process (``benchmarks.timing.time_interleaved``):

1. A projection ``[tokens, 8192] @ [8192, 28672]`` (bf16): ``te_jax.flax.DenseGeneral`` against
   ``nn.Dense(dot_general_cls=te_jax.flax.DotGeneral)`` (injection) and an unmodified ``nn.Dense`` under
   ``te_jax.qwix.Provider`` (when qwix is installed), per recipe; flax's bf16 ``nn.Dense`` as the baseline.
   Target: injection and Qwix within 3% of DenseGeneral.
2. An MoE's expert FFN (mixtral-like: 8 experts, ``[rows, 4096] -> 14336 -> 4096``, gelu, rows sorted by
   expert): ``te_jax.grouped_mlp`` (what ``te_jax.flax.MoE`` runs) against the same FFN written with two
   ``te_jax.ragged_dot`` calls, per stateless recipe; ``jax.lax.ragged_dot`` in bf16 as the baseline.
   Target: ragged_dot within 5% of grouped_mlp.

    python benchmarks/bench_inject.py --out inject.json --md inject.md     # a GPU
    python benchmarks/bench_inject.py --tiny                                # the CPU: proves it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.append(str(Path(__file__).resolve().parents[1]))  # appended: an installed te_jax wins

import te_jax  # noqa: E402
from benchmarks.timing import time_interleaved, write_results  # noqa: E402
from te_jax import recipe as R  # noqa: E402
from te_jax.core import MLPQuantizers  # noqa: E402
from te_jax.core.grouped_mlp import grouped_mlp  # noqa: E402
from te_jax.moe.experts import MoEQuantizers  # noqa: E402
from te_jax.train import TrainState  # noqa: E402

RECIPES = {"current": R.Float8CurrentScaling, "delayed": R.DelayedScaling, "block": R.Float8BlockScaling}
DENSE = (8192, 8192, 28672)  # tokens, in, out
TINY_DENSE = (256, 128, 256)
MOE = (8, 4096, 4096, 14336)  # experts, rows per expert (a multiple of 128: packed == aligned), H, F
TINY_MOE = (4, 128, 128, 256)


def _dense_variants(tokens: int, d_in: int, d_out: int, recipes) -> dict:
    """name -> (step, args): the projection's train step under each route, state trained 3 steps."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (tokens, d_in), jnp.bfloat16)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (tokens, d_out), jnp.bfloat16)
    models = {"DenseGeneral": te_jax.flax.DenseGeneral(d_out, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
              "inject": nn.Dense(d_out, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                 dot_general_cls=te_jax.flax.DotGeneral)}
    try:
        import qwix  # noqa: PLC0415
        from te_jax.qwix import Provider, Rule  # noqa: PLC0415
        models["qwix"] = qwix.quantize_model(nn.Dense(d_out, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
                                             Provider([Rule(module_path=".*")]))
    except ImportError:
        print("bench_inject: qwix is not installed: no Qwix variant")
    variants = {"bf16 nn.Dense": _dense_step(nn.Dense(d_out, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16), None,
                                             x, cot)}
    for rname in recipes:
        for mname, model in models.items():
            variants[f"{rname} {mname}"] = _dense_step(model, RECIPES[rname](), x, cot)
    return variants


def _dense_step(model, recipe, x, cot):
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
        variables = jax.jit(model.init)(jax.random.key(1), x)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.0))

    @jax.jit
    def step(state, x, cot):
        def loss(v):
            return jnp.sum((model.apply(v, x) * cot).astype(jnp.float32))

        with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
            _, grads = te_jax.train.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads)

    for _ in range(3):  # FP8 state trained a few steps
        state = step(state, x, cot)
    return (lambda s, x, c: step(s, x, c).params), [(state, x, cot)]


def _moe_variants(experts: int, rows: int, h: int, f: int, recipes) -> dict:
    key = jax.random.key(2)
    m = experts * rows
    x = jax.random.normal(key, (m, h), jnp.bfloat16)
    wi = (jax.random.normal(jax.random.fold_in(key, 1), (experts, h, f)) / h ** 0.5).astype(jnp.bfloat16)
    wo = (jax.random.normal(jax.random.fold_in(key, 2), (experts, f, h)) / f ** 0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.fold_in(key, 3), (m, h), jnp.bfloat16)
    gs = jnp.full((experts,), rows, jnp.int32)

    def ragged(ragged_dot, recipe):
        def loss(x, wi, wo):
            y = ragged_dot(nn.gelu(ragged_dot(x, wi, gs)), wo, gs)
            return jnp.sum((y * cot).astype(jnp.float32))

        def step(x, wi, wo):
            with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
                return jax.grad(loss, argnums=(0, 1, 2))(x, wi, wo)
        return jax.jit(step)

    def fused(recipe):
        moe_q = MoEQuantizers.from_recipe(recipe, (), experts)
        q = MLPQuantizers(moe_q.wi.q, moe_q.wo.q)  # as te_jax.flax.MoE hands them to grouped_mlp

        def loss(x, wi, wo):
            y, _ = grouped_mlp(x, wi, wo, gs, activation="gelu", quantizers=q, group_align=128)
            return jnp.sum((y * cot).astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    args = [(x, wi, wo)]
    variants = {"bf16 lax.ragged_dot": (ragged(jax.lax.ragged_dot, None), args)}
    for rname in recipes:
        if rname == "delayed":
            continue  # a plain function keeps no state: the modules do (docs/integrations.md)
        variants[f"{rname} grouped_mlp"] = (fused(RECIPES[rname]()), args)
        variants[f"{rname} te_jax.ragged_dot"] = (ragged(te_jax.ragged_dot, RECIPES[rname]()), args)
    return variants


def _table(title: str, seconds: dict[str, float], pairs: list[tuple[str, str]]) -> str:
    lines = [f"### {title}", "", "| variant | ms | vs bf16 |", "|---|---:|---:|"]
    base = next(v for k, v in seconds.items() if k.startswith("bf16"))
    lines += [f"| {k} | {v * 1e3:.3f} | {base / v:.2f}x |" for k, v in seconds.items()]
    lines += ["", "| route | against | time ratio |", "|---|---|---:|"]
    lines += [f"| {a} | {b} | {seconds[a] / seconds[b]:.3f} |" for a, b in pairs if a in seconds and b in seconds]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU, seconds): proves the script runs")
    p.add_argument("--recipes", default="current,delayed,block")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    iters, trials, warmup = (2, 2, 1) if args.tiny else (args.iters, args.trials, 3)
    dense = _dense_variants(*(TINY_DENSE if args.tiny else DENSE), recipes)
    moe = _moe_variants(*(TINY_MOE if args.tiny else MOE), recipes)
    out, md = {"device": jax.devices()[0].device_kind}, [f"device: {jax.devices()[0].device_kind}", ""]
    for title, variants, pairs in (
            ("projection", dense, [(f"{r} {m}", f"{r} DenseGeneral") for r in recipes for m in ("inject", "qwix")]),
            ("MoE expert FFN", moe, [(f"{r} te_jax.ragged_dot", f"{r} grouped_mlp") for r in recipes])):
        per_trial = time_interleaved(variants, warmup, iters, trials)
        seconds = {k: statistics.median(v) for k, v in per_trial.items()}
        out[title] = seconds
        md += [_table(title, seconds, pairs), ""]
    text = "\n".join(md)
    print(text)
    write_results(args.out, args.md, out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
