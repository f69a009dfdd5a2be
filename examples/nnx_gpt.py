"""A byte-level GPT built from te_jax.nnx layers, trained with each recipe in turn (flax.nnx's API).

    tokens -> nnx.Embed -> TransformerLayer_0 .. TransformerLayer_{n-1} -> LayerNorm -> Linear head -> logits

The model, data and presets are examples/gpt's (``--preset tiny`` trains on
CPU in a minute or two); the layers are ``te_jax.nnx``'s, the optimizer is
``nnx.Optimizer(model, tx, wrt=nnx.Param)``, and each step differentiates
with ``te_jax.nnx.value_and_grad``, which also steps the FP8 state of
recipes that keep one. The output head stays in high precision. ::

    .venv/bin/python -m examples.nnx_gpt --recipe bf16,delayed,current,block,mxfp8,nvfp4 --steps 100
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import te_jax
from te_jax import nnx as te_nnx
from examples.gpt import data as data_lib
from examples.gpt.config import make_recipe
from examples.gpt.presets import PRESETS, ModelConfig

INIT_STD = 0.02


class GPT(nnx.Module):
    """The decoder of examples/gpt/model.py in NNX form; blocks carry the paths ``TransformerLayer_<i>``."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        dtype, init = jnp.dtype(c.dtype), nnx.initializers.normal(INIT_STD)
        self.embed = nnx.Embed(c.vocab, c.hidden, embedding_init=init, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([
            te_nnx.TransformerLayer(c.hidden, c.heads, num_gqa_groups=c.kv_heads, intermediate_dim=c.mlp_hidden,
                                    enable_rotary_pos_emb=c.rotary, dtype=dtype, kernel_init=init, rngs=rngs,
                                    path=f"TransformerLayer_{i}")
            for i in range(c.layers)])
        self.ln_f = te_nnx.LayerNorm(c.hidden, dtype=dtype, rngs=rngs)
        self.head = te_nnx.Linear(c.hidden, c.vocab, dtype=dtype, kernel_init=init, rngs=rngs, path="head")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int32[batch, seq] byte tokens -> float32[batch, seq, vocab] logits."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        with te_jax.autocast(enabled=False):  # the logits' GEMM stays in high precision
            return self.head(x).astype(jnp.float32)


def next_byte_loss(model: GPT, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def train_one(recipe_name: str, args: argparse.Namespace, corpus: data_lib.Corpus) -> dict:
    """Trains a fresh model with one recipe; its final train and held-out losses and throughput."""
    preset = PRESETS[args.preset]
    recipe = make_recipe(recipe_name, preset.model.layers)
    quantized = dict(enabled=recipe is not None, recipe=recipe)
    with te_jax.autocast(**quantized):  # a recipe with state creates each layer's FP8Meta here
        model = GPT(preset.model, nnx.Rngs(args.seed, quantize=args.seed + 1))
    warmup = min(preset.warmup, args.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, preset.lr, warmup, max(args.steps, warmup + 1))
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)),
                              wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        with te_jax.autocast(**quantized):
            loss, grads = te_nnx.value_and_grad(next_byte_loss)(model, tokens)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def eval_loss(model, tokens):
        with te_jax.autocast(**quantized):
            return next_byte_loss(model, tokens)

    losses, start = [], None
    for step in range(args.steps):
        tokens = jnp.asarray(data_lib.train_batch(corpus, step, args.batch, args.seq_len, args.seed), jnp.int32)
        losses.append(float(train_step(model, optimizer, tokens)))
        if step == 0:
            start = time.perf_counter()  # after the first step's compilation
    elapsed = time.perf_counter() - start
    held_out = [float(eval_loss(model, jnp.asarray(b, jnp.int32)))
                for b in data_lib.eval_batches(corpus, args.eval_batches, args.batch, args.seq_len)]
    tokens_per_s = (args.steps - 1) * args.batch * args.seq_len / elapsed if args.steps > 1 else float("nan")
    return dict(recipe=recipe_name, losses=losses, final_loss=losses[-1], eval_loss=float(np.mean(held_out)),
                tokens_per_s=tokens_per_s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--recipe", default="bf16,delayed,current,block,mxfp8,nvfp4",
                   help="comma-separated: bf16 or a te_jax.recipe.load_recipe name, one run each")
    p.add_argument("--steps", type=int, help="default: the preset's")
    p.add_argument("--batch", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="train on this text file instead of the Python standard library")
    p.add_argument("--data-bytes", type=int, default=4 << 20, help="read at most this many bytes")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    preset = PRESETS[args.preset]
    args.steps = args.steps or preset.steps
    args.batch = args.batch or preset.batch
    args.seq_len = args.seq_len or preset.seq_len
    if min(args.steps, args.batch, args.seq_len, args.eval_batches) < 1:
        raise SystemExit("--steps, --batch, --seq-len and --eval-batches must be at least 1")
    corpus = data_lib.load(args.data, args.data_bytes)
    data_lib.check_seq_len(corpus, args.seq_len)
    print(corpus.describe())
    results = []
    for name in [r.strip() for r in args.recipe.split(",") if r.strip()]:
        result = train_one(name, args, corpus)
        results.append(result)
        print(f"{name:>8}: train loss {result['final_loss']:.4f}  held-out {result['eval_loss']:.4f}  "
              f"{result['tokens_per_s']:,.0f} tokens/s", flush=True)
    return results


if __name__ == "__main__":
    main()
