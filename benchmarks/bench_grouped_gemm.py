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
the backward table calls ``te_jax.ops.grouped.gemm``.

Usage: python benchmarks/bench_grouped_gemm.py [--only REGEX] [--backward] [--iters 5] [--trials 5] [--no-ragged]
       [--out r.json] [--md r.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax  # noqa: F401  (registers the FFI targets)
from te_jax.ops import gemm as gemm_ops
from te_jax.ops.grouped import gemm as gg
from timing import add_repeat_args, selected, time_interleaved, write_results

# (label, experts, top-k, tokens, K, N, skewed): issue 23's forward GEMMs.
SHAPES = [
    ("mixtral gate+up", 8, 2, 16384, 4096, 2 * 14336, False),
    ("mixtral down", 8, 2, 16384, 14336, 4096, False),
    ("deepseek gate+up", 64, 8, 8192, 7168, 2 * 2048, False),
    ("deepseek down", 64, 8, 8192, 2048, 7168, False),
    ("mixtral gate+up skewed", 8, 2, 16384, 4096, 2 * 14336, True),
]


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
    """Balanced sizes, or one expert taking half the rows and the others sharing the rest."""
    if not skewed:
        return np.full(experts, rows // experts, np.int32)
    rest = rows // 2 // (experts - 1)
    sizes = np.full(experts, rest, np.int32)
    sizes[0] = rows - rest * (experts - 1)
    return sizes


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
    """The forward, dgrad and wgrad GEMMs of ``grouped_dense`` at ``shape`` (per-tensor and block; module doc)."""
    label, experts, topk, tokens, k, n, skewed = shape
    rows = tokens * topk
    sizes_np = group_sizes(experts, rows, skewed)
    if np.any(sizes_np % 128):
        raise ValueError(f"bench_backward: {label}: group sizes {sizes_np} must be multiples of 128 (the block spans)")
    sizes = jnp.asarray(sizes_np)
    flops = 2.0 * sizes_np.sum() * n * k
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
    result = {"shape": label, "experts": experts, "top_k": topk, "tokens": tokens, "k": k, "n": n,
              "group_sizes": sizes_np.tolist(), "variants": {}}
    for name, times in per_call.items():
        ms = 1e3 * statistics.median(times)
        result["variants"][name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
    return result


def backward_markdown(results: list[dict]) -> str:
    names = ["fwd fast", "fwd split", "dgrad split", "wgrad split", "dense fwd fast", "dense dgrad split",
             "block fwd", "block dgrad", "block wgrad"]
    lines = ["| shape | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in results:
        v = r["variants"]
        lines.append(f"| {r['shape']} | " + " | ".join(
            f"{v[x]['ms']:.2f} ms ({v[x]['tflops']:.0f})" if x in v else "-" for x in names) + " |")
    return "\n".join(lines) + "\n"


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
    p.add_argument("--only", default="", help="regex over the shape labels")
    add_repeat_args(p, warmup=2, iters=5, trials=5)
    p.add_argument("--no-ragged", action="store_true", help="leave out jax.lax.ragged_dot (slow)")
    p.add_argument("--backward", action="store_true",
                   help="time grouped_dense's forward, dgrad and wgrad GEMMs instead (module doc)")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    bench, table = (bench_backward, backward_markdown) if args.backward else (bench_shape, markdown)
    results = []
    for shape in selected(SHAPES, args.only):
        if args.backward and shape[6]:
            continue  # the skewed sizes are not whole 128-row spans
        results.append(bench(shape, args))
        print(table(results[-1:]), flush=True)
    md = table(results)
    print(md)
    write_results(args.out, args.md, {"results": results}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
