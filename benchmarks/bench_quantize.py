"""Quantize benchmark on one GPU: te_jax's CUDA quantize kernels against XLA.

For bf16 ``x [M, N]`` (default 16384 x 8192, fresh normal data, ``--nbuf``
rotating input buffers so the 60 MB L2 cannot help) it times, side by side:

* (a) XLA fused per-tensor quantize + amax (rowwise) vs (b) ``quantize_fp8_tensor``;
* (c) XLA quantize + transpose + amax vs (d) ``quantize_fp8_tensor`` rowwise+colwise;
* (e) current scaling rowwise+colwise, XLA vs ``quantize_fp8_current``;
* (f) MXFP8 rowwise+colwise vs the jitted pure-JAX reference;
* (g) Float8 block scaling 1x128 and 128x128, rowwise+colwise, vs the reference;
* (h) NVFP4 1D (stochastic rounding on both copies, RHT on the columnwise one: gradients; RHT alone:
  inputs; neither), and 16x16 2D (weights), vs the reference.

Timing: warm-up, then ``--trials`` runs of ``--iters`` back-to-back calls
(cycling through the input buffers, ended by block_until_ready); the median
time per call is reported. Bytes count every input read once plus every
output written (scales included). A device copy of x (read + write) is timed
in the same run and is the bandwidth reference.

Before timing, ``--check`` (on by default) compares every CUDA kernel with the
pure-JAX reference bit for bit on small and odd shapes, every input dtype and
special values (Inf, NaN, subnormals, ties), and lists mismatches.

Usage: python benchmarks/bench_quantize.py [--m 16384 --n 8192] [--out r.json] [--md r.md] [--no-check]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax  # noqa: F401
from timing import bandwidth_main, result_markdown, result_row, selected, time_against_baseline, time_fn
from te_jax.ops import quantize as qops

try:
    from te_jax.ops import dequantize as dqops
    from te_jax.spec import reference as ref
except ImportError:  # a te_jax from before the floor plan (gpu_check --baseline-python with an older tree)
    from te_jax.quantize import reference as ref
    dqops = qops

E4M3 = jnp.float8_e4m3fn
F32 = jnp.float32


# ---- timing ----------------------------------------------------------------------------


# ---- the cases -------------------------------------------------------------------------


def xla_rowwise(x):
    scale = jnp.float32(0.5)
    q = jnp.clip(x.astype(F32) * scale, -448, 448).astype(E4M3)
    return q, jnp.max(jnp.abs(x))


def xla_rowwise_colwise(x):
    scale = jnp.float32(0.5)
    q = jnp.clip(x.astype(F32) * scale, -448, 448).astype(E4M3)
    return q, q.T, jnp.max(jnp.abs(x))


def xla_current(x):
    amax = jnp.max(jnp.abs(x)).astype(F32)
    scale = jnp.where(amax > 0, 448.0 / amax, 1.0)
    q = jnp.clip(x.astype(F32) * scale, -448, 448).astype(E4M3)
    return q, q.T, amax, scale, 1.0 / scale


def cases(m: int, n: int):
    """(group, label, ours, baseline, baseline label, bytes moved)."""
    el = m * n
    key = jnp.array([1234, 5678], jnp.uint32)
    one = jnp.ones((1,), F32) * 0.5
    nv_scales = 2 * el // 16
    return [
        ("a/b per-tensor rowwise + amax", lambda x: qops.quantize_fp8_tensor(x, one, qdtype=E4M3, rowwise=True),
         xla_rowwise, "XLA fused", 3 * el),
        ("c/d per-tensor row+col + amax",
         lambda x: qops.quantize_fp8_tensor(x, one, qdtype=E4M3, rowwise=True, colwise=True),
         xla_rowwise_colwise, "XLA", 4 * el),
        ("e current scaling row+col",
         lambda x: qops.quantize_fp8_current(x, qdtype=E4M3, rowwise=True, colwise=True),
         xla_current, "XLA", 4 * el),
        ("f MXFP8 row+col", lambda x: qops.quantize_mxfp8(x, qdtype=E4M3, rowwise=True, colwise=True),
         lambda x: ref.quantize_mxfp8(x, qdtype=E4M3, rowwise=True, colwise=True), "reference", 4 * el + 2 * el // 32),
        ("g Float8 block 1x128 row+col",
         lambda x: qops.quantize_fp8_block(x, qdtype=E4M3, rowwise=True, colwise=True),
         lambda x: ref.quantize_fp8_block(x, qdtype=E4M3, rowwise=True, colwise=True), "reference",
         4 * el + 2 * 4 * el // 128),
        ("g Float8 block 128x128 row+col",
         lambda x: qops.quantize_fp8_block(x, qdtype=E4M3, rowwise=True, colwise=True, block_2d=True),
         lambda x: ref.quantize_fp8_block(x, qdtype=E4M3, rowwise=True, colwise=True, block_2d=True), "reference",
         4 * el + 2 * 4 * el // (128 * 128)),
        ("h NVFP4 1D row+col, SR both, RHT colwise",
         lambda x: qops.quantize_nvfp4(x, key, rowwise=True, colwise=True, rht=True, stochastic_rounding=True),
         lambda x: ref.quantize_nvfp4(x, key, rowwise=True, colwise=True, rht=True, stochastic_rounding=True),
         "reference", 2 * el + el + nv_scales),
        ("h NVFP4 1D row+col, RHT colwise (inputs)",
         lambda x: qops.quantize_nvfp4(x, key, rowwise=True, colwise=True, rht=True),
         lambda x: ref.quantize_nvfp4(x, key, rowwise=True, colwise=True, rht=True), "reference",
         2 * el + el + nv_scales),
        ("h NVFP4 1D row+col, no RHT, no SR",
         lambda x: qops.quantize_nvfp4(x, key, rowwise=True, colwise=True),
         lambda x: ref.quantize_nvfp4(x, key, rowwise=True, colwise=True), "reference",
         2 * el + el + nv_scales),
        ("h NVFP4 16x16 row+col",
         lambda x: qops.quantize_nvfp4(x, rowwise=True, colwise=True, block_2d=True),
         lambda x: ref.quantize_nvfp4(x, rowwise=True, colwise=True, block_2d=True), "reference",
         2 * el + el + nv_scales),
    ]


def run_bench(args) -> dict:
    m, n = args.m, args.n
    keys = jax.random.split(jax.random.key(0), args.nbuf)
    xs = [jax.random.normal(k, (m, n), jnp.bfloat16) for k in keys]
    jax.block_until_ready(xs)
    el = m * n

    copy_ms = time_fn(jax.jit(jnp.copy), xs, args.iters, args.trials)
    scale_ms = time_fn(jax.jit(lambda x: x * jnp.bfloat16(2)), xs, args.iters, args.trials)
    copy_gbs = max(4 * el / copy_ms * 1e-6, 4 * el / scale_ms * 1e-6)
    print(f"device copy: {copy_ms:.4f} ms, x*2: {scale_ms:.4f} ms -> copy bandwidth {copy_gbs:.0f} GB/s")

    rows = []
    for group, ours, base, base_label, nbytes in selected(cases(m, n), args.only):
        entry = time_against_baseline(group, nbytes, ours, base,
                                      lambda fn: time_fn(fn, xs, args.iters, args.trials), copy_gbs)
        entry["base_label"] = base_label
        rows.append(entry)
        print(result_row(entry), flush=True)
    return {"shape": [m, n], "dtype": "bfloat16", "copy_ms": copy_ms, "scale_ms": scale_ms,
            "copy_gbs": copy_gbs, "device": str(jax.devices()[0]), "rows": rows}


def markdown(res: dict) -> str:
    m, n = res["shape"]
    title = (f"Quantize, bf16 x [{m}, {n}], {res['device']}. Copy bandwidth (measured, read+write): "
             f"{res['copy_gbs']:.0f} GB/s.")
    columns = ["case", "MB moved", "te_jax ms", "GB/s", "% copy", "baseline", "ms", "GB/s", "% copy", "speed-up"]
    return result_markdown(title, columns, res["rows"])


# ---- bitwise check against the reference -------------------------------------------------


def _nan_mask(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.dtype(jnp.float8_e4m3fn):
        u = a.view(np.uint8)
        return (u & 0x7F) == 0x7F
    if a.dtype == np.dtype(jnp.float8_e5m2):
        u = a.view(np.uint8)
        return (u & 0x7F) > 0x7C
    if np.issubdtype(a.dtype, np.floating) or a.dtype == np.dtype(jnp.bfloat16):
        return np.isnan(a.astype(np.float32))
    return np.zeros(a.shape, bool)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def same_bits(a, b) -> int:
    """Number of mismatching elements (NaN matches any NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return -1
    na, nb = _nan_mask(a), _nan_mask(b)
    diff = (_bits(a) != _bits(b)) & ~(na & nb)
    return int(diff.sum())


def special_input(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(rng.choice([1e-3, 1.0, 300.0]))
    flat = x.reshape(-1)
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -1e-40, 1e-38, 448.0, 464.0, -464.0,
                         0.25, 0.75, 1.25, 2.5, 5.0, 3.5, 1e30, 6.0, 2.0 ** -9, 2.0 ** -10], np.float32)
    if flat.size > 64:
        idx = rng.choice(flat.size, size=min(len(specials), flat.size // 8), replace=False)
        flat[idx] = specials[: len(idx)]
    return jnp.asarray(x).astype(dtype)


def _on_cpu(fn, *args, **kwargs):
    """Runs ``fn`` on XLA:CPU (FTZ/DAZ, where the spec's reference runs)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return fn(*[jax.device_put(a, cpu) for a in args], **kwargs)


def _on_gpu(fn, *args, **kwargs):
    """Runs ``fn`` on the default (GPU) device."""
    dev = jax.devices()[0]
    with jax.default_device(dev):
        return fn(*[jax.device_put(a, dev) for a in args], **kwargs)


def check_all() -> list[str]:
    """Every CUDA kernel (``backend="ffi"`` on the default GPU) against the reference on CPU."""
    failures = []
    e5 = jnp.float8_e5m2
    key = jnp.array([7, 11], jnp.uint32)

    def cmp(name, ours, theirs):
        ours, theirs = jax.block_until_ready(ours), jax.block_until_ready(theirs)
        ours, theirs = [np.asarray(o) for o in ours], [np.asarray(t) for t in theirs]
        if name.startswith("nvfp4"):
            # A block with a NaN scale decodes to NaN whatever its codes; the
            # codes' sign bits there follow the NaN's sign, which is unspecified.
            for qi in (0, 2):
                nan_blocks = _nan_mask(theirs[qi + 1]) & _nan_mask(ours[qi + 1])
                if nan_blocks.size:
                    mask = np.repeat(nan_blocks, 8, axis=-1)
                    ours[qi] = np.where(mask, 0, ours[qi]).astype(np.uint8)
                    theirs[qi] = np.where(mask, 0, theirs[qi]).astype(np.uint8)
        for i, (o, t) in enumerate(zip(ours, theirs)):
            bad = same_bits(o, t)
            if bad:
                failures.append(f"{name} output {i}: {bad} mismatches (shape {np.shape(o)} vs {np.shape(t)})")

    tensor_shapes = [(1, 1), (3, 5), (17, 33), (16, 16), (48, 80), (130, 260), (2, 64, 128), (256, 512)]
    block_shapes = [(128, 128), (256, 384), (2, 128, 256), (384, 128)]
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
        for si, shape in enumerate(tensor_shapes):
            x = special_input(shape, dtype, si)
            scale = jnp.full((*shape[:-2], 1), 0.75, F32)
            for qd in (E4M3, e5):
                for rw, cw in ((True, False), (True, True), (False, True)):
                    tag = f"{jnp.dtype(dtype).name} {shape} {jnp.dtype(qd).name} row={rw} col={cw}"
                    f = dict(qdtype=qd, rowwise=rw, colwise=cw)
                    cmp("fp8_tensor " + tag, _on_gpu(qops.quantize_fp8_tensor, x, scale, **f),
                        _on_cpu(qops.quantize_fp8_tensor, x, scale, backend="reference", **f))
                    for p2 in (False, True):
                        g = dict(f, power_2=p2, epsilon=1e-6 if p2 else 0.0)
                        cmp(f"fp8_current p2={p2} " + tag, _on_gpu(qops.quantize_fp8_current, x, **g),
                            _on_cpu(qops.quantize_fp8_current, x, backend="reference", **g))
            q, _, _, s_inv = _on_cpu(qops.quantize_fp8_tensor, x, scale, qdtype=E4M3, backend="reference")
            for od in (F32, jnp.bfloat16):
                cmp(f"dequant_fp8 {shape}", (_on_gpu(dqops.dequantize_fp8_tensor, q, s_inv, out_dtype=od),),
                    (_on_cpu(dqops.dequantize_fp8_tensor, q, s_inv, out_dtype=od, backend="reference"),))
        for si, shape in enumerate(block_shapes):
            x = special_input(shape, dtype, 100 + si)
            tag = f"{jnp.dtype(dtype).name} {shape}"
            for rw, cw in ((True, True), (True, False), (False, True)):
                f = dict(rowwise=rw, colwise=cw)
                cmp(f"mxfp8 {tag} {f}", _on_gpu(qops.quantize_mxfp8, x, qdtype=E4M3, **f),
                    _on_cpu(qops.quantize_mxfp8, x, qdtype=E4M3, backend="reference", **f))
                for b2 in (False, True):
                    for p2 in (True, False):
                        g = dict(f, block_2d=b2, power_2=p2)
                        cmp(f"fp8_block {tag} {g}", _on_gpu(qops.quantize_fp8_block, x, qdtype=E4M3, **g),
                            _on_cpu(qops.quantize_fp8_block, x, qdtype=E4M3, backend="reference", **g))
                for b2, rht, sr in ((False, False, False), (False, True, False), (False, True, True),
                                    (False, False, True), (True, False, False), (True, False, True)):
                    g = dict(f, block_2d=b2, rht=rht, stochastic_rounding=sr)
                    cmp(f"nvfp4 {tag} {g}", _on_gpu(qops.quantize_nvfp4, x, key, **g),
                        _on_cpu(qops.quantize_nvfp4, x, key, backend="reference", **g))
            q, s, _, _ = _on_cpu(qops.quantize_mxfp8, x, qdtype=E4M3, backend="reference")
            cmp(f"dequant_mxfp8 {tag}", (_on_gpu(dqops.dequantize_mxfp8, q, s),),
                (_on_cpu(dqops.dequantize_mxfp8, q, s, backend="reference"),))
            for b2 in (False, True):
                q, s, _, _ = _on_cpu(qops.quantize_fp8_block, x, qdtype=E4M3, block_2d=b2, backend="reference")
                cmp(f"dequant_fp8_block {tag} 2d={b2}", (_on_gpu(dqops.dequantize_fp8_block, q, s, block_2d=b2),),
                    (_on_cpu(dqops.dequantize_fp8_block, q, s, block_2d=b2, backend="reference"),))
            q, s, _, _, a, _ = _on_cpu(qops.quantize_nvfp4, x, backend="reference")
            cmp(f"dequant_nvfp4 {tag}", (_on_gpu(dqops.dequantize_nvfp4, q, s, a, out_dtype=jnp.float16),),
                (_on_cpu(dqops.dequantize_nvfp4, q, s, a, out_dtype=jnp.float16, backend="reference"),))
    # Shapes the tiled kernels do not take (simple fallback kernels).
    for shape, rw, cw in (((32, 40), False, True), ((96, 8), False, True), ((40, 64), True, False),
                          ((160, 24), False, True), ((2, 40, 96), True, False)):
        x = special_input(shape, jnp.bfloat16, 7)
        f = dict(qdtype=E4M3, rowwise=rw, colwise=cw)
        cmp(f"mxfp8 fallback {shape}", _on_gpu(qops.quantize_mxfp8, x, **f),
            _on_cpu(qops.quantize_mxfp8, x, backend="reference", **f))
    for shape, rw, cw in (((136, 128), True, False), ((128, 40), False, True), ((2, 8, 256), True, False)):
        x = special_input(shape, jnp.float16, 9)
        f = dict(qdtype=E4M3, rowwise=rw, colwise=cw)
        cmp(f"fp8_block fallback {shape}", _on_gpu(qops.quantize_fp8_block, x, **f),
            _on_cpu(qops.quantize_fp8_block, x, backend="reference", **f))
    for shape in ((16, 40), (48, 24)):
        x = special_input(shape, jnp.float32, 8)
        g = dict(rowwise=False, colwise=True, rht=True, stochastic_rounding=True)
        cmp(f"nvfp4 fallback {shape}", _on_gpu(qops.quantize_nvfp4, x, key, **g),
            _on_cpu(qops.quantize_nvfp4, x, key, backend="reference", **g))
    return failures


def main() -> int:
    return bandwidth_main(__doc__, "bench_quantize.json", check_all, run_bench, markdown)


if __name__ == "__main__":
    sys.exit(main())
