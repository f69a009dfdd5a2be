"""Grouped FP8 GEMM benchmark on one GPU: te_jax's CUDA grouped GEMM against its peers (issue 23's shapes).

For each shape, ``x [rows, K]`` (rows sorted by expert, ``group_sizes`` on the device) times ``W [E, N, K]``
(contraction-last, as the grouped GEMM contract lays it out), the variants are

* ``fp8 grouped``: te_jax_grouped_gemm_fp8 (per-tensor scales, fast accumulation, bfloat16 out), one setup
  kernel and one CUTLASS launch, group sizes read on the device;
* ``fp8 dense (ceiling)``: te_jax's dense ``gemm_fp8`` of the same total size, ``[rows, K] x [N, K]^T``;
* ``fp8 block grouped``: te_jax_grouped_gemm_fp8_block, 1x128 blocks of x and 128x128 blocks of W (the
  DeepSeek-V3 recipe's layout), bfloat16 out; ``fp8 block dense``: te_jax's ``gemm_fp8_block`` of the same total;
* ``bf16 grouped``: te_jax_grouped_gemm_bf16 (``grouped_gemm_bf16``, the weight as stored ``[E, K, N]``), the
  kernel of ``grouped_dense`` with autocast off;
* ``bf16 ragged_dot``: ``jax.lax.ragged_dot`` on bfloat16 operands;
* ``bf16 batched einsum``: the experts as a batch of equal-size groups (balanced routing only; its best case).

With ``--backward`` each shape's table is instead the three GEMMs of ``te_jax.grouped_dense`` as its forward and
backward issue them (``te_jax.ops.grouped.gemm``'s public ops), for the per-tensor recipes (fast accumulation
forward, split accumulation backward, as ``DenseQuantizers`` default) and the block recipe:

* ``fwd fast`` / ``fwd split``: ``x [rows, K] (E4M3) @ W_g^T``, fast or split accumulation, bfloat16 out;
* ``dgrad split``: ``dy [rows, N] (E5M2) @ W_g [E, K, N]`` (E4M3), split accumulation, bfloat16 out;
* ``wgrad split``: ``x^T [K, rows] (E4M3)`` times ``dy^T [N, rows] (E5M2)`` grouped along the rows (group_axis 1),
  split accumulation, bfloat16 out (the float32 kernel and a cast);
* ``dense fwd fast`` / ``dense dgrad split``: te_jax's dense ``gemm_fp8`` of the same total (the ceilings);
* ``block fwd`` / ``block dgrad`` / ``block wgrad``: the same three with 1x128 blocks of x and dy and 128x128
  blocks of W.

Operands are fresh normal random data (two input sets, alternated), cast to FP8 outside the timed region. Each
variant is warmed up, then ``--trials`` rounds each time ``--iters`` back-to-back calls of every variant in a
shuffled order (benchmarks/timing.py); reported: the median ms per call and TFLOP/s counted on the real rows
(``2 * sum(group_sizes) * N * K``). A spot check compares the grouped GEMM's first group with the dense GEMM of
the same rows.

The forward table makes the custom calls with ``jax.ffi.ffi_call`` (the kernels alone, no trace-time checks);
the backward table calls ``te_jax.ops.grouped.gemm``. The backward's GEMM table needs whole 128-row groups (the
block spans): the skewed shape has none, only its layer table.

``--backward`` also times, per shape and in its own shuffled rounds, the whole grouped layer forward+backward
(``y``, ``dx`` and ``dW`` of bfloat16 ``x [M, K]`` and ``W [E, K, N]``, one weight for both input sets) for each
recipe of ``--recipes`` (FP8 state trained ``TRAIN_STEPS`` steps first where the recipe keeps it; an entry
``NAME+fast-backward`` is that recipe with ``backward_fast_accumulation=True``, dgrad and wgrad with fast
accumulation as TransformerEngine-JAX's; default: delayed and current, each plain and with fast-backward):

* ``te_jax <recipe>``: ``te_jax.core.grouped_dense`` on the routed rows, packed (``M = sum(group_sizes)``);
* ``te_jax <recipe> aligned``: the same on the MoE layer's row layout (``group_align = span_alignment``: each
  expert's rows start at a multiple of it, ``te_jax.moe.aligned_rows`` rows in all, the rest zero);
* ``TransformerEngine-JAX <recipe>`` (delayed and current, where ``transformer_engine`` is importable; else the
  script prints one line saying so): ``transformer_engine.jax.dense.grouped_dense`` on the packed rows (its
  grouped GEMM requires ``sum(group_sizes) == M``), per-expert quantizers (``QuantizerFactory.create_set`` with
  ``n_groups=E``), its FP8 state trained as te_jax's; a cross-check gives the relative L2 difference of its
  ``y``, ``dx`` and ``dW`` from te_jax's (both FP8: reported, not asserted).

TFLOP/s of the layer: ``6 * sum(group_sizes) * K * N`` (three GEMMs on the routed rows). ``--tiny`` runs small
shapes (CPU, seconds).

Usage: python benchmarks/bench_grouped_gemm.py [--tiny] [--only REGEX] [--backward] [--recipes delayed,current,...]
       [--iters 5] [--trials 5] [--no-ragged] [--out r.json] [--md r.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import statistics
import sys
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import te_jax  # noqa: F401  (registers the FFI targets)
from te_jax import moe
from te_jax import recipe as R
from te_jax.core import DenseQuantizers
from te_jax.core.grouped_dense import grouped_dense, init_state, span_alignment
from te_jax.ops import gemm as gemm_ops
from te_jax.ops.grouped import gemm as gg
from te_jax.train import apply_fp8_update, fp8_state_updates
from timing import add_repeat_args, selected, time_interleaved, write_results

# (label, experts, top-k, tokens, K, N, skewed): issue 23's forward GEMMs.
SHAPES = [
    ("mixtral gate+up", 8, 2, 16384, 4096, 2 * 14336, False),
    ("mixtral down", 8, 2, 16384, 14336, 4096, False),
    ("deepseek gate+up", 64, 8, 8192, 7168, 2 * 2048, False),
    ("deepseek down", 64, 8, 8192, 2048, 7168, False),
    ("mixtral gate+up skewed", 8, 2, 16384, 4096, 2 * 14336, True),
]
# --backward only: DeepSeek-V3's 256 experts at H=7168 (a bfloat16 gate+up weight alone is 15 GB).
V3_SHAPES = [
    ("deepseek-v3 E256 gate+up", 256, 8, 8192, 7168, 2 * 2048, False),
    ("deepseek-v3 E256 down", 256, 8, 8192, 2048, 7168, False),
]
TINY_SHAPES = [("tiny gate+up", 4, 2, 256, 128, 256, False), ("tiny down", 4, 2, 256, 128, 128, False),
               ("tiny gate+up skewed", 4, 2, 256, 128, 256, True)]
TE_RECIPES = ("delayed", "current")  # the per-tensor recipes TransformerEngine-JAX's grouped GEMM anchors
# A --recipes entry "NAME+fast-backward": the recipe with backward_fast_accumulation=True, te_jax's setting that
# accumulates as TransformerEngine-JAX's grouped GEMM does (fast, in all three GEMMs).
FAST_BACKWARD = "fast-backward"
DEFAULT_LAYER_RECIPES = ",".join([*TE_RECIPES, *(f"{r}+{FAST_BACKWARD}" for r in TE_RECIPES)])
TE_NAME = "TransformerEngine-JAX"
TE_NOT_FOUND = (f"{TE_NAME} not found (importlib.util.find_spec('transformer_engine') is None): no {TE_NAME} rows; "
                "on the GPU machine tools/te_carry.py installs it (benchmarks/README.md)")
TRAIN_STEPS = 3  # FP8 state updates before timing (delayed scaling's amax histories and scales)


def grouped_fp8(x, w, x_si, w_si, sizes):
    """te_jax_grouped_gemm_fp8, group_axis 0: bfloat16 ``[rows, N]``."""
    results = (jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.bfloat16),
               jax.ShapeDtypeStruct((32 * 2**20 + 1024 * sizes.shape[0],), jnp.uint8))
    out, _ = jax.ffi.ffi_call("te_jax_grouped_gemm_fp8", results)(
        x, w, x_si, w_si, sizes, jnp.zeros((0,), jnp.bfloat16), group_axis=np.int64(0), align=np.int64(16),
        fast_accum=True, has_bias=False)
    return out


def grouped_fp8_block(x, x_s, w, w_s, sizes):
    """te_jax_grouped_gemm_fp8_block, group_axis 0, 128x128 blocks of W: bfloat16 ``[rows, N]``."""
    results = (jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.bfloat16),
               jax.ShapeDtypeStruct((32 * 2**20 + 1024 * sizes.shape[0],), jnp.uint8))
    out, _ = jax.ffi.ffi_call("te_jax_grouped_gemm_fp8_block", results)(
        x, x_s, w, w_s, sizes, jnp.zeros((0,), jnp.bfloat16), group_axis=np.int64(0), align=np.int64(128),
        a_block_2d=False, b_block_2d=True, has_bias=False)
    return out


def group_sizes(experts: int, rows: int, skewed: bool) -> np.ndarray:
    """Balanced sizes (the first ``rows % experts`` one row larger), or one expert taking half the rows and the
    others sharing the rest; int32, summing to ``rows`` (TransformerEngine's grouped GEMM needs ``sum == M``)."""
    if experts < 1 or rows < 0 or (skewed and experts < 2):
        raise ValueError(f"bench_grouped_gemm: group_sizes needs rows >= 0 and experts >= 1 (>= 2 when skewed), got "
                         f"{rows} rows over {experts} experts")
    if not skewed:
        sizes = np.full(experts, rows // experts, np.int32)
        sizes[:rows % experts] += 1
        return sizes
    rest = rows // 2 // (experts - 1)
    sizes = np.full(experts, rest, np.int32)
    sizes[0] = rows - rest * (experts - 1)
    return sizes


def fwd_bwd_flops(sizes, k: int, n: int) -> float:
    """The forward, dgrad and wgrad GEMMs' FLOPs on the routed rows: ``3 * 2 * sum(sizes) * K * N``."""
    return 6.0 * float(np.sum(np.asarray(sizes, np.int64))) * k * n


def aligned_row_index(sizes, align: int) -> np.ndarray:
    """Where each routed row goes in the MoE layer's aligned layout: int32 ``[sum(sizes)]``.

    Rows sorted by group (``sizes[g]`` rows of group g, packed) move to the layout ``grouped_dense(...,
    group_align=align)`` takes: group g starts at row ``sum_{h<g} roundup(sizes[h], align)``.
    """
    sizes = np.asarray(sizes, np.int64)
    if sizes.ndim != 1 or np.any(sizes < 0) or isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"bench_grouped_gemm: aligned_row_index needs sizes >= 0 [G] and an int align >= 1, got "
                         f"sizes {sizes.tolist()} and align {align!r}")
    spans = -(-sizes // align) * align
    starts = np.cumsum(spans) - spans
    packed_starts = np.cumsum(sizes) - sizes
    group = np.repeat(np.arange(sizes.size), sizes)
    return (np.arange(int(sizes.sum())) - packed_starts[group] + starts[group]).astype(np.int32)


@jax.jit
def relative_l2(a: jax.Array, b: jax.Array) -> jax.Array:
    """``||a - b|| / ||b||`` in float32 on the device (0 where both are zero): the cross-check's measure."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    diff, ref = jnp.sqrt(jnp.sum(jnp.square(a - b))), jnp.sqrt(jnp.sum(jnp.square(b)))
    return jnp.where(diff == 0, 0.0, diff / ref)


def bench_shape(shape, args) -> dict:
    label, experts, topk, tokens, k, n, skewed = shape
    rows = tokens * topk
    sizes_np = group_sizes(experts, rows, skewed)
    sizes = jnp.asarray(sizes_np)
    flops = 2.0 * sizes_np.sum() * n * k
    keys = jax.random.split(jax.random.key(hash(label) % 2**31), 4)
    e4m3 = jnp.float8_e4m3fn
    sets = []
    for i in range(2):
        kx, kw = jax.random.split(keys[i])
        x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
        w = jax.random.normal(kw, (experts, n, k), jnp.bfloat16) * 0.05
        sets.append((x, w))
    one = jnp.ones((1,), jnp.float32)
    fp8_sets = [(x.astype(e4m3), w.astype(e4m3), one, one, sizes) for x, w in sets]
    dense_sets = [(x8, w8[0], s1, s2) for x8, w8, s1, s2, _ in fp8_sets]
    calls = {
        "fp8 grouped": (jax.jit(grouped_fp8), fp8_sets),
        "fp8 dense (ceiling)": (jax.jit(lambda a, b, sa, sb: gemm_ops.gemm_fp8(a, b, sa, sb, out_dtype=jnp.bfloat16,
                                                                                 fast_accum=True)), dense_sets),
    }
    block_sets = [(x8, jnp.ones((rows, k // 128), jnp.float32), w8, jnp.ones((experts, n // 128, k // 128), jnp.float32),
                   sz) for x8, w8, _, _, sz in fp8_sets]
    calls["fp8 block grouped"] = (jax.jit(grouped_fp8_block), block_sets)
    calls["fp8 block dense"] = (jax.jit(lambda a, a_s, b, b_s: gemm_ops.gemm_fp8_block(
        a, a_s, b, b_s, b_block_2d=True, out_dtype=jnp.bfloat16)),
        [(x8, x_s, w8[0], w_s[0]) for x8, x_s, w8, w_s, _ in block_sets])
    # ragged_dot and grouped_gemm_bf16 take the weight as stored, [E, K, N].
    rd_sets = [(x, jnp.swapaxes(w, 1, 2), sizes) for x, w in sets]
    calls["bf16 grouped"] = (jax.jit(lambda x, w, s: gg.grouped_gemm_bf16(x, w, s)), rd_sets)
    if not args.no_ragged:
        calls["bf16 ragged_dot"] = (jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)), rd_sets)
    if not skewed:
        bt_sets = [(x.reshape(experts, rows // experts, k), w) for x, w in sets]
        calls["bf16 batched einsum"] = (jax.jit(lambda x, w: jnp.einsum("egk,enk->egn", x, w)), bt_sets)

    # Spot check: group 0 of the grouped GEMM against the dense FP8 GEMM of the same rows and weight (the dense
    # GEMM takes multiples of 16 rows).
    x8, w8, s1, s2, _ = fp8_sets[0]
    rows0 = int(sizes_np[0]) // 16 * 16
    ours = grouped_fp8(x8, w8, s1, s2, sizes)[:rows0].astype(jnp.float32)
    dense = gemm_ops.gemm_fp8(x8[:rows0], w8[0], s1, s2, out_dtype=jnp.bfloat16).astype(jnp.float32)
    spot = float(jnp.max(jnp.abs(ours - dense)) / jnp.maximum(jnp.max(jnp.abs(dense)), 1e-30))

    per_call = time_interleaved(calls, args.warmup, args.iters, args.trials)
    result = {"shape": label, "experts": experts, "top_k": topk, "tokens": tokens, "k": k, "n": n,
              "group_sizes": sizes_np.tolist(), "spot_check_max_rel_diff": spot, "variants": {}}
    for name, times in per_call.items():
        ms = 1e3 * statistics.median(times)
        result["variants"][name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
    return result


def bench_backward(shape, args) -> dict:
    """At ``shape``: the forward, dgrad and wgrad GEMMs of ``grouped_dense`` (per-tensor and block) where the
    groups are whole 128-row spans, then the layer forward+backward per recipe (module doc)."""
    label, experts, topk, tokens, k, n, skewed = shape
    sizes_np = group_sizes(experts, tokens * topk, skewed)
    result = {"shape": label, "experts": experts, "top_k": topk, "tokens": tokens, "k": k, "n": n,
              "group_sizes": sizes_np.tolist(), "variants": {}}
    if np.any(sizes_np % 128):
        result["gemms_skipped"] = "group sizes are not whole 128-row spans (the block GEMMs' and wgrad's layout)"
    else:
        try:
            result["variants"] = backward_gemms(label, k, n, sizes_np, args)
        except jax.errors.JaxRuntimeError as err:  # e.g. out of memory at one shape: the layer table still runs
            result["gemms_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"{label}: the GEMM table failed: {result['gemms_error']}", flush=True)
    try:
        result["fwd_bwd"] = bench_fwd_bwd(shape, sizes_np, args)
    except jax.errors.JaxRuntimeError as err:  # e.g. out of memory while training the FP8 state: the next shape runs
        result["fwd_bwd_error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"{label}: the layer table failed: {result['fwd_bwd_error']}", flush=True)
    return result


def backward_gemms(label: str, k: int, n: int, sizes_np: np.ndarray, args) -> dict:
    """The backward table's GEMMs (module doc), timed in turns: name -> ``{"ms", "tflops"}``."""
    experts, rows = sizes_np.shape[0], int(sizes_np.sum())
    sizes = jnp.asarray(sizes_np)
    flops = 2.0 * rows * n * k
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    one = jnp.ones((1,), jnp.float32)
    sets = []
    for key in jax.random.split(jax.random.key(hash(label) % 2**31 + 1), 2):
        kx, kw, kd = jax.random.split(key, 3)
        x = jax.random.normal(kx, (rows, k), jnp.float32).astype(e4m3)
        w = jax.random.normal(kw, (experts, n, k), jnp.float32).astype(e4m3)  # W_g^T, [N, K]
        dy = jax.random.normal(kd, (rows, n), jnp.float32).astype(e5m2)
        wt = jnp.swapaxes(w, 1, 2)  # W_g, [K, N]: dgrad's operand
        sets.append(dict(x=x, w=w, dy=dy, wt=wt, xt=x.T, dyt=dy.T, dy4=dy.astype(e4m3), dyt4=dy.T.astype(e4m3)))
    bf16 = jnp.bfloat16

    def fp8(a, b, group_axis, fast, align=16):
        return gg.grouped_gemm_fp8(a, b, one, one, sizes, group_axis=group_axis, align=align, out_dtype=bf16,
                                   fast_accum=fast)

    def block(a, b, group_axis, b_2d):
        a_s = jnp.ones((a.shape[0], a.shape[1] // 128), jnp.float32)
        b_s = (jnp.ones((b.shape[0], b.shape[1] // 128, b.shape[2] // 128), jnp.float32) if b_2d
               else jnp.ones((b.shape[0], b.shape[1] // 128), jnp.float32))
        return gg.grouped_gemm_fp8_block(a, a_s, b, b_s, sizes, b_block_2d=b_2d, group_axis=group_axis, align=128,
                                         out_dtype=bf16)

    variants = {
        "fwd fast": (lambda d: fp8(d["x"], d["w"], 0, True), ("x", "w")),
        "fwd split": (lambda d: fp8(d["x"], d["w"], 0, False), ("x", "w")),
        "dgrad split": (lambda d: fp8(d["dy"], d["wt"], 0, False), ("dy", "wt")),
        "wgrad split": (lambda d: fp8(d["xt"], d["dyt"], 1, False), ("xt", "dyt")),
        "dense fwd fast": (lambda d: gemm_ops.gemm_fp8(d["x"], d["w"][0], one, one, out_dtype=bf16, fast_accum=True),
                           ("x", "w")),
        "dense dgrad split": (lambda d: gemm_ops.gemm_fp8(d["dy"], d["wt"][0], one, one, out_dtype=bf16,
                                                          fast_accum=False), ("dy", "wt")),
        "block fwd": (lambda d: block(d["x"], d["w"], 0, True), ("x", "w")),
        "block dgrad": (lambda d: block(d["dy4"], d["wt"], 0, True), ("dy4", "wt")),
        "block wgrad": (lambda d: block(d["xt"], d["dyt4"], 1, False), ("xt", "dyt4")),
    }
    calls = {}
    for name, (fn, keys) in variants.items():
        jitted = jax.jit(lambda *ops, fn=fn, keys=keys: fn(dict(zip(keys, ops))))
        calls[name] = (jitted, [tuple(d[key] for key in keys) for d in sets])
    per_call = time_interleaved(calls, args.warmup, args.iters, args.trials)
    return {name: {"ms": 1e3 * statistics.median(times), "tflops": flops / statistics.median(times) / 1e12}
            for name, times in per_call.items()}


def te_jax_step(q: DenseQuantizers, group_align: int):
    """``te_jax.core.grouped_dense`` forward+backward: ``(x, kernel, sizes, state, dy) -> (y, dx, dkernel, state
    update)``, the update to apply with ``te_jax.train.apply_fp8_update``."""

    def step(x, kernel, sizes, state, dy):
        def forward(x, kernel, state):
            return grouped_dense(x, kernel, sizes, quantizers=q, state=state, group_align=group_align)[0]

        with fp8_state_updates():
            y, vjp = jax.vjp(forward, x, kernel, state)
            return (y, *vjp(dy))

    return step


def te_grouped_anchor(recipe_name: str, num_groups: int):
    """TransformerEngine-JAX's ``grouped_dense`` forward+backward for a per-tensor recipe, where importable.

    Returns None where ``transformer_engine`` is not importable, else ``(step, quantizer_set)``: ``step(x, kernel,
    sizes, quantizer_set, dy) -> (y, dx, dkernel, new quantizer_set)`` (TE's backward returns the quantizer set,
    its delayed-scaling state updated, as that argument's gradient), and the initial set: one quantizer per expert
    for x, the kernel and dy, E4M3 forward and E5M2 backward.
    """
    if recipe_name not in TE_RECIPES:
        raise ValueError(f"bench_grouped_gemm: the {TE_NAME} anchor takes the recipes {TE_RECIPES}, got "
                         f"{recipe_name!r}")
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    from transformer_engine.jax.dense import grouped_dense as te_grouped_dense
    from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode

    modes = {"delayed": ScalingMode.DELAYED_TENSOR_SCALING, "current": ScalingMode.CURRENT_TENSOR_SCALING}
    quantizer_set = QuantizerFactory.create_set(scaling_mode=modes[recipe_name], fwd_dtype=jnp.float8_e4m3fn,
                                                bwd_dtype=jnp.float8_e5m2, n_groups=num_groups)

    def step(x, kernel, sizes, quantizer_set, dy):
        def forward(x, kernel, quantizer_set):
            return te_grouped_dense(x, kernel, sizes, quantizer_set=quantizer_set)

        y, vjp = jax.vjp(forward, x, kernel, quantizer_set)
        return (y, *vjp(dy))

    return step, quantizer_set


def layer_recipe(spec: str):
    """A ``--recipes`` entry: ``(base recipe name, recipe)``; ``NAME+fast-backward`` sets the recipe's
    ``backward_fast_accumulation``."""
    name, plus, option = spec.partition("+")
    recipe = R.load_recipe(name)
    if plus:
        if option != FAST_BACKWARD:
            raise ValueError(f"bench_grouped_gemm: --recipes entry {spec!r}: the one option is +{FAST_BACKWARD}")
        recipe = dataclasses.replace(recipe, backward_fast_accumulation=True)
    return name, recipe


def _layer_inputs(label: str, experts: int, rows: int, k: int, n: int):
    """Two sets of bfloat16 ``x [rows, K]`` and ``dy [rows, N]``, and one ``W [E, K, N]`` (entries ~ N(0, 1/K))."""
    kx, kw, kd = jax.random.split(jax.random.key(zlib.crc32(label.encode()) % 2**31), 3)
    xs = [jax.random.normal(key, (rows, k), jnp.bfloat16) for key in jax.random.split(kx, 2)]
    dys = [jax.random.normal(key, (rows, n), jnp.bfloat16) for key in jax.random.split(kd, 2)]
    kernel = jax.jit(lambda key: jax.random.normal(key, (experts, k, n), jnp.bfloat16)
                     * jnp.bfloat16(1 / math.sqrt(k)))(kw)
    return xs, dys, kernel


def _trained(step, state, args: tuple, apply):
    """``state`` after ``TRAIN_STEPS`` steps of ``step(*args[:3], state, args[3])``, each update applied by
    ``apply(state, update)``; unchanged when it has no leaves (stateless recipes)."""
    if not jax.tree.leaves(state):
        return state
    x, kernel, sizes, dy = args
    for _ in range(TRAIN_STEPS):
        state = apply(state, step(x, kernel, sizes, state, dy)[3])
    return state


def layer_calls(label: str, sizes_np: np.ndarray, k: int, n: int, recipes: list[str]):
    """The layer table's variants (module doc): name -> ``(jitted step, arg sets)``, name -> ``{"recipe", "rows"}``
    (the rows of its x) and name -> the error that stopped building it (the anchor's only: printed, reported). Per
    recipe: te_jax packed, TransformerEngine-JAX (where importable, per-tensor recipes), te_jax aligned."""
    experts, rows = sizes_np.shape[0], int(sizes_np.sum())
    sizes = jnp.asarray(sizes_np)
    xs, dys, kernel = _layer_inputs(label, experts, rows, k, n)
    packed = list(zip(xs, dys))
    calls, info, failed, aligned = {}, {}, {}, {}

    def add(name, recipe, step, state, sets):
        calls[name] = (step, [(x, kernel, sizes, state, dy) for x, dy in sets])
        info[name] = {"recipe": recipe, "rows": sets[0][0].shape[0]}

    anchored = set()  # the base recipes with a TransformerEngine-JAX row (one each)
    # Plain recipes first: each anchor then comes right after its plain te_jax row, which it is cross-checked with.
    for recipe in sorted(recipes, key=lambda spec: "+" in spec):
        base, loaded = layer_recipe(recipe)
        q = DenseQuantizers.from_recipe(loaded)
        align = span_alignment(q)
        if align not in aligned:  # the MoE layer's layout, shared by the recipes of one alignment
            room, index = moe.aligned_rows(rows, experts, align), jnp.asarray(aligned_row_index(sizes_np, align))
            aligned[align] = [(jnp.zeros((room, k), x.dtype).at[index].set(x),
                               jnp.zeros((room, n), dy.dtype).at[index].set(dy)) for x, dy in packed]
        steps = {"": (jax.jit(te_jax_step(q, 1)), packed), " aligned": (jax.jit(te_jax_step(q, align)), aligned[align])}
        states = {suffix: _trained(step, init_state(q, experts), (sets[0][0], kernel, sizes, sets[0][1]),
                                   apply_fp8_update) for suffix, (step, sets) in steps.items()}
        add(f"te_jax {recipe}", recipe, steps[""][0], states[""], packed)
        info[f"te_jax {recipe}"]["anchor"] = base
        anchor = te_grouped_anchor(base, experts) if base in TE_RECIPES and base not in anchored else None
        if anchor is not None:
            anchored.add(base)
            name = f"{TE_NAME} {base}"
            try:
                step = jax.jit(anchor[0])
                add(name, base, step,
                    _trained(step, anchor[1], (xs[0], kernel, sizes, dys[0]), lambda old, new: new), packed)
            except Exception as err:  # noqa: BLE001  (benchmark: the te_jax rows still run)
                print(f"{name}: failed", flush=True)
                traceback.print_exc(limit=3)
                failed[name], info[name] = f"{type(err).__name__}: {str(err)[:300]}", {"recipe": base, "rows": rows}
        add(f"te_jax {recipe} aligned", recipe, steps[" aligned"][0], states[" aligned"], aligned[align])
        info[f"te_jax {recipe} aligned"]["anchor"] = base
    return calls, info, failed


def _first_run(name: str, fn, sets):
    """``fn(*sets[0])`` (compiles and runs the variant once), or the error it raised as a string (printed)."""
    try:
        return jax.block_until_ready(fn(*sets[0])), None
    except Exception as err:  # noqa: BLE001  (benchmark: report and continue, e.g. out of memory at one shape)
        print(f"{name}: failed", flush=True)
        traceback.print_exc(limit=3)
        return None, f"{type(err).__name__}: {str(err)[:300]}"


def bench_fwd_bwd(shape, sizes_np: np.ndarray, args) -> dict:
    """The layer table at ``shape``: each variant run once (the cross-check of TransformerEngine-JAX's ``y``,
    ``dx``, ``dW`` against te_jax's packed variant, same inputs), then the variants that ran timed in turns."""
    label, _, _, _, k, n, _ = shape
    calls, info, failed = layer_calls(label, sizes_np, k, n, [r for r in args.recipes.split(",") if r])
    flops = fwd_bwd_flops(sizes_np, k, n)
    variants = {name: {**info[name], "error": error} for name, error in failed.items()}
    cross_check, runnable, ours = {}, {}, {}
    for name, (fn, sets) in calls.items():
        out, error = _first_run(name, fn, sets)
        if error is not None:
            variants[name] = {**info[name], "error": error}
            if name.startswith(TE_NAME):
                ours.pop(info[name]["recipe"], None)
            continue
        runnable[name] = (fn, sets)
        recipe = info[name]["recipe"]
        if name == f"te_jax {recipe}" and f"{TE_NAME} {recipe}" in calls:
            ours[recipe] = out[:3]  # y, dx, dW, kept until the anchor's first run
        elif name == f"{TE_NAME} {recipe}" and recipe in ours:
            mine = ours.pop(recipe)
            try:
                cross_check[recipe] = {what: float(relative_l2(a, b)) for what, a, b in zip(("y", "dx", "dw"), out[:3],
                                                                                           mine)}
            except jax.errors.JaxRuntimeError as err:  # e.g. out of memory: reported, the timing still runs
                cross_check[recipe] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            del mine
        del out
    ours.clear()
    for name in runnable:
        if name.startswith(TE_NAME) and info[name]["recipe"] not in cross_check:
            cross_check[info[name]["recipe"]] = {"error": "no plain te_jax row of this recipe to compare with"}
    per_call = time_interleaved(runnable, args.warmup, args.iters, args.trials)
    for name, times in per_call.items():
        ms = 1e3 * statistics.median(times)
        variants[name] = {**info[name], "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
    return {"rows": int(sizes_np.sum()), "flops": flops, "variants": {name: variants[name] for name in info},
            "cross_check": cross_check}


def fwd_bwd_markdown(results: list[dict]) -> str:
    """The layer table (ms, TFLOP/s, speed over TransformerEngine-JAX's same recipe) and the cross-check table."""
    lines = [f"Layer forward+backward (y, dx, dW), bfloat16 x [M, K] and W [E, K, N]; M = sum(group_sizes), the "
             f"routed rows, as {TE_NAME}'s grouped GEMM requires; 'aligned': te_jax's MoE row layout "
             f"(te_jax.moe.aligned_rows rows); TFLOP/s = 6 * M * K * N / time; FP8 state trained {TRAIN_STEPS} "
             f"steps. {TE_NAME} scales x, dy and W per expert and accumulates fast in all three GEMMs; te_jax's "
             "per-tensor recipes scale x and dy per tensor, W per expert, and split the backward's accumulation "
             f"unless '+{FAST_BACKWARD}' (backward_fast_accumulation=True); 'vs {TE_NAME}' compares with its row "
             "of the same base recipe.", "",
             f"| shape | variant | rows | fwd+bwd ms | TFLOP/s | vs {TE_NAME} |", "|---|---|---|---|---|---|"]
    for r in results:
        if "fwd_bwd_error" in r:
            lines.append(f"| {r['shape']} | (every variant) | - | error | - | - |")
        variants = r.get("fwd_bwd", {}).get("variants", {})
        for name, v in variants.items():
            if "error" in v:
                lines.append(f"| {r['shape']} | {name} | {v['rows']} | error | - | - |")
                continue
            te = variants.get(f"{TE_NAME} {v.get('anchor', v['recipe'])}", {})
            vs = f"{te['ms'] / v['ms']:.2f}x" if "ms" in te and not name.startswith(TE_NAME) else "-"
            lines.append(f"| {r['shape']} | {name} | {v['rows']} | {v['ms']:.2f} | {v['tflops']:.0f} | {vs} |")
    checks = [(r["shape"], recipe, c) for r in results
              for recipe, c in r.get("fwd_bwd", {}).get("cross_check", {}).items()]
    if checks:
        lines += ["", f"Cross-check, relative L2 difference of {TE_NAME}'s result from te_jax's (packed rows, same "
                      "inputs; both FP8):", "", "| shape | recipe | y | dx | dW |", "|---|---|---|---|---|"]
        lines += [f"| {shape} | {recipe} | " + (" | ".join(f"{c[x]:.2e}" for x in ("y", "dx", "dw")) if "error" not in c
                                                 else "error | error | error") + " |" for shape, recipe, c in checks]
    return "\n".join(lines) + "\n"


def backward_markdown(results: list[dict]) -> str:
    names = ["fwd fast", "fwd split", "dgrad split", "wgrad split", "dense fwd fast", "dense dgrad split",
             "block fwd", "block dgrad", "block wgrad"]
    lines = ["| shape | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in results:
        v = r["variants"]
        if not v:  # skewed (no whole 128-row groups) or failed: the layer table only
            lines.append(f"| {r['shape']} | " + " | ".join("-" for _ in names) + " |")
            continue
        lines.append(f"| {r['shape']} | " + " | ".join(
            f"{v[x]['ms']:.2f} ms ({v[x]['tflops']:.0f})" if x in v else "-" for x in names) + " |")
    return "\n".join(lines) + "\n\n" + fwd_bwd_markdown(results)


def markdown(results: list[dict]) -> str:
    names = ["fp8 grouped", "fp8 dense (ceiling)", "fp8 block grouped", "fp8 block dense", "bf16 grouped",
             "bf16 ragged_dot", "bf16 batched einsum"]
    lines = ["| shape | " + " | ".join(names) + " | grouped / dense | grouped vs einsum | block vs einsum | spot check |",
             "|---" * (len(names) + 5) + "|"]
    for r in results:
        v = r["variants"]
        cells = [f"{v[x]['ms']:.2f} ms ({v[x]['tflops']:.0f})" if x in v else "-" for x in names]
        g = v["fp8 grouped"]["ms"]
        ratio = f"{v['fp8 dense (ceiling)']['ms'] / g:.2f}"
        vs = f"{v['bf16 batched einsum']['ms'] / g:.2f}x" if "bf16 batched einsum" in v else "-"
        bvs = (f"{v['bf16 batched einsum']['ms'] / v['fp8 block grouped']['ms']:.2f}x"
               if "bf16 batched einsum" in v and "fp8 block grouped" in v else "-")
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {ratio} | {vs} | {bvs} | "
                     f"{r['spot_check_max_rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU, seconds): proves the script runs")
    p.add_argument("--only", default="", help="regex over the shape labels")
    add_repeat_args(p, warmup=2, iters=5, trials=5)
    p.add_argument("--no-ragged", action="store_true", help="leave out jax.lax.ragged_dot (slow)")
    p.add_argument("--backward", action="store_true",
                   help="time grouped_dense's forward, dgrad and wgrad GEMMs and the layer forward+backward instead "
                        "(module doc)")
    p.add_argument("--recipes", default=DEFAULT_LAYER_RECIPES,
                   help="comma-separated recipe names of --backward's layer table, each optionally "
                        f"NAME+{FAST_BACKWARD} (TransformerEngine-JAX's rows: delayed and current)")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.iters, args.trials, args.warmup = min(args.iters, 2), min(args.trials, 2), 1
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    te_found = importlib.util.find_spec("transformer_engine") is not None
    if args.backward and not te_found:
        print(TE_NOT_FOUND, flush=True)
    bench, table = (bench_backward, backward_markdown) if args.backward else (bench_shape, markdown)
    shapes = TINY_SHAPES if args.tiny else SHAPES + V3_SHAPES if args.backward else SHAPES
    results = []
    for shape in selected(shapes, args.only):
        results.append(bench(shape, args))
        print(table(results[-1:]), flush=True)
    md = table(results)
    print(md)
    write_results(args.out, args.md, {"results": results, **({"transformer_engine_found": te_found} if args.backward
                                                               else {})}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
