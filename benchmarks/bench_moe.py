"""Mixture-of-experts benchmark (issue 23): the expert GEMMs, and the MoE layer forward+backward per recipe.

Part 1, the expert GEMMs: ``bench_grouped_gemm.bench_shape`` for its shapes (Mixtral- and DeepSeek-like gate+up
and down, and a skewed routing where one expert takes half the rows): te_jax's grouped GEMM per-tensor and
block FP8 against bf16 ``jax.lax.ragged_dot``, the bf16 batched einsum over equal experts and te_jax's dense
FP8 GEMM of the same total.

Part 2, the layer: ``te_jax.flax.MoE`` (router, top-k routing, permutation, two grouped GEMMs with the swiglu
between, un-permutation with the gates), forward and backward (gradients of the input and every parameter), for

* ``bf16 ragged_dot``: the layer with autocast off (its high-precision path is ``ragged_dot``; ``--no-ragged``
  leaves it out);
* ``bf16 einsum cap 1.0``: the same router and experts as a bf16 batched einsum over ``E`` equal buffers of
  ``T * k / E`` rows (capacity factor 1.0: rows past an expert's capacity are dropped), the best bf16 peer
  when routing is balanced;
* each recipe of ``--recipes`` (default: the per-tensor ``delayed`` and ``current`` and the ``block`` one; a
  per-tensor ``NAME+fast-backward`` is that recipe with ``backward_fast_accumulation=True``),
  with FP8 state trained for a few steps first (delayed scaling's amax histories and scales).

and the breakdown of the layer's time, each piece jitted and timed on its own in the same rounds:
``router`` (logits, top-k, load-balancing loss), ``permutation`` (permute and un-permute),
``expert FFN`` (what the layer runs: with a recipe ``grouped_mlp`` on the aligned rows, GEMMs, casts and the
fused activation; without, ``grouped_dense``, the activation, ``grouped_dense``) and ``casts`` (standalone
quantizations of tensors of the same shapes: the rows and weights of both GEMMs, rowwise and columnwise, and the
output gradients); ``expert FFN - casts`` estimates the GEMMs. ``--profile`` adds, per layer variant, a device trace of a few
steps (``bench_profile.py``'s): the GPU's busy time split into GEMM, te_jax and XLA kernels, and the kernels that
took longest.

Every variant is timed in turns in one process (benchmarks/timing.py: shuffled rounds, medians) on fresh
normal random inputs (two sets, alternated). TFLOP/s are counted on the real rows (``T * k``, no padding):
``3 * 2 * T * k * (H * 2F + F * H)`` per forward+backward. ``--tiny`` runs small shapes (CPU, seconds).

Usage: python benchmarks/bench_moe.py [--tiny] [--only REGEX] [--skip-gemms] [--recipes delayed,current,block]
       [--profile] [--iters 5] [--trials 5] [--out r.json] [--md r.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import jax
import jax.numpy as jnp
from jax import lax

import bench_grouped_gemm
import bench_profile
import te_jax
from te_jax import moe
from te_jax.core import DenseQuantizers
from te_jax.flax import MoE
from te_jax.core.grouped_dense import grouped_dense, init_state, span_alignment
from te_jax.core.grouped_mlp import grouped_mlp
from te_jax.core.layernorm_mlp import MLPQuantizers
from te_jax.train.step import apply_fp8_update
from te_jax.train import fp8_state_updates, value_and_grad
from timing import add_repeat_args, selected, time_interleaved, write_results

# (label, experts, top-k, tokens, hidden H, expert width F)
LAYERS = [("mixtral", 8, 2, 16384, 4096, 14336), ("deepseek", 64, 8, 8192, 7168, 2048)]
TINY_LAYERS = [("tiny", 4, 2, 256, 128, 128)]
# bench_grouped_gemm's shape rows: (label, experts, top-k, tokens, K, N, skewed)
TINY_GEMMS = [("tiny gate+up", 4, 2, 256, 128, 256, False), ("tiny down", 4, 2, 256, 128, 128, False),
              ("tiny gate+up skewed", 4, 2, 256, 128, 256, True)]
TRAIN_STEPS = 3
PROFILE_STEPS, PROFILE_TOP = 3, 20  # --profile: steps traced per variant, kernels listed


def _layer(experts, top_k, width):
    return MoE(experts, top_k, width, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _layer_step(layer, recipe):
    """Forward+backward of the layer: the gradients of the input, the parameters and the FP8 state."""

    def step(variables, x, cotangent):
        def loss(v):
            return jnp.sum((layer.apply({c: w for c, w in v.items() if c != "inputs"}, v["inputs"])
                            * cotangent).astype(jnp.float32))

        with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
            return value_and_grad(loss)({**variables, "inputs": x})[1]

    return step


def einsum_moe(params, x, top_k: int, capacity_factor: float = 1.0):
    """The MoE with equal expert buffers of ``ceil(T * k / E * capacity_factor)`` rows and batched einsums."""
    tokens, hidden = x.shape
    experts = params["wi"].shape[0]
    capacity = math.ceil(tokens * top_k / experts * capacity_factor)
    r = moe.route(jnp.dot(x.astype(jnp.float32), params["router"], precision=lax.Precision.HIGHEST), top_k)
    flat = r.expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=experts)
    sorted_experts = flat[order]
    position = jnp.arange(flat.shape[0]) - (jnp.cumsum(counts) - counts)[sorted_experts]
    slot = jnp.where(position < capacity, sorted_experts * capacity + position, experts * capacity)
    token = order // top_k
    buffers = jnp.zeros((experts * capacity + 1, hidden), x.dtype).at[slot].set(x[token])[:-1]
    h = jnp.einsum("ech,ehf->ecf", buffers.reshape(experts, capacity, hidden), params["wi"])
    a, g = jnp.split(h, 2, axis=-1)
    out = jnp.einsum("ecf,efh->ech", jax.nn.silu(a) * g, params["wo"]).reshape(-1, hidden)
    out = jnp.concatenate([out, jnp.zeros((1, hidden), out.dtype)])[slot]
    gates = r.gates.reshape(-1)[order].astype(out.dtype)
    return jnp.zeros_like(x).at[token].add(out * gates[:, None])


def _trained(variables, step, x, cotangent):
    """``variables`` after ``TRAIN_STEPS`` FP8 state updates (parameters unchanged): trained amax histories."""
    if "fp8_meta" not in variables:
        return variables
    for _ in range(TRAIN_STEPS):
        grads = step(variables, x, cotangent)
        variables = {**variables, "fp8_meta": apply_fp8_update(variables["fp8_meta"], grads["fp8_meta"])}
    return variables


def _pieces(params, x_sets, cot_sets, top_k, recipe):
    """The breakdown's jitted pieces (forward+backward each): name -> (fn, arg sets)."""
    experts = params["wi"].shape[0]
    q = {g: DenseQuantizers.from_recipe(recipe, ("MoE_0", g)) if recipe is not None else None for g in ("wi", "wo")}
    states = {g: init_state(q[g], experts) if q[g] is not None else {} for g in q}
    align = math.lcm(*(span_alignment(q[g]) for g in q))  # the layer's row layout (te_jax.flax.MoE)
    routed = [moe.route(jnp.dot(x.astype(jnp.float32), params["router"]), top_k) for x in x_sets]
    perms = [moe.permute(x, r.expert_ids, experts, align=align) for x, r in zip(x_sets, routed)]

    def router(w, x, c):
        def loss(w, x):
            r = moe.route(jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST), top_k)
            return jnp.sum(r.gates * c[:, :top_k].astype(jnp.float32)) + r.aux_loss
        return jax.grad(loss, argnums=(0, 1))(w, x)

    def permutation(x, ids, gates, c):
        def loss(x, gates):
            xs, perm = moe.permute(x, ids, experts, align=align)
            return jnp.sum((moe.unpermute(xs, perm, gates) * c).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(x, gates)

    pieces = {
        "router": (jax.jit(router), [(params["router"], x, c) for x, c in zip(x_sets, cot_sets)]),
        "permutation": (jax.jit(permutation), [(x, r.expert_ids, r.gates, c)
                                               for x, r, c in zip(x_sets, routed, cot_sets)]),
    }

    def ffn(xs, sizes, wi, wo, states, dy):
        def loss(xs, wi, wo, states):
            if recipe is not None:  # what the layer runs with a recipe
                y, _ = grouped_mlp(xs, wi, wo, sizes, activation="swiglu", quantizers=MLPQuantizers(q["wi"], q["wo"]),
                                   state=states, group_align=align)
            else:
                h, _ = grouped_dense(xs, wi, sizes)
                a, g = jnp.split(h, 2, axis=-1)
                y, _ = grouped_dense(jax.nn.silu(a) * g, wo, sizes)
            return jnp.sum((y * dy).astype(jnp.float32))
        with te_jax.autocast(enabled=False), fp8_state_updates():
            return jax.grad(loss, argnums=(0, 1, 2, 3))(xs, wi, wo, states)

    ffn_sets = [(xs, perm.group_sizes, params["wi"], params["wo"], states, xs) for xs, perm in perms]
    pieces["expert FFN"] = (jax.jit(ffn), ffn_sets)
    if recipe is not None:
        def casts(xs, dh, h, wi, wo, states):
            out = []
            for g, rows, grads, w in (("wi", xs, dh, wi), ("wo", h, xs, wo)):
                st = states[g]
                out.append(q[g].input.quantize(rows, st.get("linear_input"), colwise=True, flatten_axis=1))
                out.append(q[g].grad_output.quantize(grads, st.get("linear_grad_output"), colwise=True,
                                                     flatten_axis=1))
                out.append(jax.vmap(lambda w, s: q[g].weight.quantize(w, s, colwise=True, flatten_axis=1),
                                    in_axes=(0, 0 if "linear_weight" in st else None))(w, st.get("linear_weight")))
            return out
        width = params["wo"].shape[1]
        pieces["casts"] = (jax.jit(casts), [(xs, *_gradient_like(xs, width), params["wi"], params["wo"], states)
                                            for xs, _ in perms])
    return pieces


def _gradient_like(xs, width: int):
    """Random ``[M, 2F]`` (the first GEMM's output gradient) and ``[M, F]`` (the second GEMM's input)."""
    k1, k2 = jax.random.split(jax.random.key(xs.shape[0]))
    return (jax.random.normal(k1, (xs.shape[0], 2 * width), xs.dtype),
            jax.random.normal(k2, (xs.shape[0], width), xs.dtype))


def bench_layer(case, args) -> dict:
    label, experts, top_k, tokens, hidden, width = case
    keys = jax.random.split(jax.random.key(hash(label) % 2**31), 5)
    x_sets = [jax.random.normal(keys[i], (tokens, hidden), jnp.bfloat16) for i in range(2)]
    cot_sets = [jax.random.normal(keys[2 + i], (tokens, hidden), jnp.bfloat16) for i in range(2)]
    flops = 3 * 2.0 * tokens * top_k * (hidden * 2 * width + width * hidden)
    layer = _layer(experts, top_k, width)
    params = jax.jit(layer.init)(keys[4], x_sets[0][:8])["params"]
    calls = {}
    if not args.no_ragged:
        step_bf16 = jax.jit(_layer_step(layer, None))
        calls["bf16 ragged_dot"] = (step_bf16, [({"params": params}, x, c) for x, c in zip(x_sets, cot_sets)])

    def einsum_step(p, x, c):
        return jax.grad(lambda p, x: jnp.sum((einsum_moe(p, x, top_k) * c).astype(jnp.float32)), argnums=(0, 1))(p, x)

    calls["bf16 einsum cap 1.0"] = (jax.jit(einsum_step), [(params, x, c) for x, c in zip(x_sets, cot_sets)])
    breakdown_calls = {}
    for name in [None] + [n for n in args.recipes.split(",") if n]:
        recipe = None if name is None else bench_grouped_gemm.layer_recipe(name)[1]  # NAME or NAME+fast-backward
        tag = "bf16" if name is None else name
        if recipe is not None:
            with te_jax.autocast(recipe=recipe):
                variables = {**jax.jit(layer.init)(keys[4], x_sets[0][:8]), "params": params}
            step = jax.jit(_layer_step(layer, recipe))
            variables = _trained(variables, step, x_sets[0], cot_sets[0])
            calls[name] = (step, [(variables, x, c) for x, c in zip(x_sets, cot_sets)])
        for piece, call in _pieces(params, x_sets, cot_sets, top_k, recipe).items():
            if piece in ("router", "permutation") and recipe is not None:
                continue  # recipe-independent: timed once
            if piece == "expert FFN" and recipe is None and args.no_ragged:
                continue  # the high-precision expert FFN is ragged_dot
            breakdown_calls[f"{tag}: {piece}"] = call
    per_call = time_interleaved({**calls, **breakdown_calls}, args.warmup, args.iters, args.trials)
    ms = {name: 1e3 * statistics.median(t) for name, t in per_call.items()}
    best_bf16 = min(ms[name] for name in ("bf16 ragged_dot", "bf16 einsum cap 1.0") if name in ms)
    variants = {name: {"ms": ms[name], "tflops": flops / (ms[name] * 1e-3) / 1e12, "vs_best_bf16": best_bf16 / ms[name]}
                for name in calls}
    profiles = {}
    if args.profile:
        for name, (fn, sets) in calls.items():
            events, wall_ms = bench_profile.profile_step(fn, sets, PROFILE_STEPS)
            profiles[name] = {"wall_ms": wall_ms, **bench_profile.summarize(events, PROFILE_STEPS)}
            profiles[name]["kernels"] = profiles[name]["kernels"][:PROFILE_TOP]
    return {"layer": label, "experts": experts, "top_k": top_k, "tokens": tokens, "hidden": hidden,
            "width": width, "variants": variants, "breakdown_ms": {n: ms[n] for n in breakdown_calls},
            "profiles": profiles}


def layer_markdown(results: list[dict]) -> str:
    lines = ["| layer | variant | fwd+bwd ms | TFLOP/s | vs best bf16 |", "|---|---|---|---|---|"]
    for r in results:
        for name, v in r["variants"].items():
            lines.append(f"| {r['layer']} (E={r['experts']}, top-{r['top_k']}, H={r['hidden']}, F={r['width']}, "
                         f"T={r['tokens']}) | {name} | {v['ms']:.2f} | {v['tflops']:.3g} | {v['vs_best_bf16']:.2f}x |")
    lines += ["", "| layer | piece (fwd+bwd, jitted alone) | ms |", "|---|---|---|"]
    for r in results:
        for name, value in r["breakdown_ms"].items():
            lines.append(f"| {r['layer']} | {name} | {value:.2f} |")
        for tag in dict.fromkeys(n.split(":")[0] for n in r["breakdown_ms"]):
            ffn, casts = r["breakdown_ms"].get(f"{tag}: expert FFN"), r["breakdown_ms"].get(f"{tag}: casts")
            if ffn is not None and casts is not None:
                lines.append(f"| {r['layer']} | {tag}: expert FFN - casts (GEMMs, est.) | {ffn - casts:.2f} |")
    for r in results:
        for name, prof in r.get("profiles", {}).items():
            cats = ", ".join(f"{c} {v:.2f}" for c, v in prof["categories"].items())
            lines += bench_profile.kernel_table(
                f"**{r['layer']}, {name}** (device trace, {PROFILE_STEPS} steps): wall "
                f"{prof['wall_ms']:.2f} ms/step, GPU busy {prof['busy_ms']:.2f} ms ({cats})", prof["kernels"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU, seconds): proves the script runs")
    p.add_argument("--only", default="", help="regex over the GEMM shape and layer labels")
    p.add_argument("--skip-gemms", action="store_true", help="only the layer (part 2)")
    p.add_argument("--recipes", default="delayed,current,block", help="comma-separated recipe names for the layer")
    add_repeat_args(p, warmup=2, iters=5, trials=5)
    p.add_argument("--no-ragged", action="store_true",
                   help="leave out jax.lax.ragged_dot (the GEMM table's, and the layer with autocast off): at the "
                        "DeepSeek layer's shape XLA:GPU runs out of memory on a bf16 [T*k, E, H] intermediate")
    p.add_argument("--profile", action="store_true", help="a device trace of each layer variant (module doc)")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.iters, args.trials, args.warmup = min(args.iters, 2), min(args.trials, 2), 1
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    gemms = []
    if not args.skip_gemms:
        for shape in selected(TINY_GEMMS if args.tiny else bench_grouped_gemm.SHAPES, args.only):
            gemms.append(bench_grouped_gemm.bench_shape(shape, args))
            print(bench_grouped_gemm.markdown(gemms[-1:]), flush=True)
    layers = []
    for case in selected(TINY_LAYERS if args.tiny else LAYERS, args.only):
        try:
            layers.append(bench_layer(case, args))
        except jax.errors.JaxRuntimeError as err:  # e.g. out of memory at one shape: the other layers still run
            print(f"layer {case[0]}: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        print(layer_markdown(layers[-1:]), flush=True)
    md = (bench_grouped_gemm.markdown(gemms) if gemms else "") + "\n" + layer_markdown(layers)
    print(md)
    write_results(args.out, args.md, {"gemms": gemms, "layers": layers}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
