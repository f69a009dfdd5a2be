"""GEMM benchmark on one GPU: XLA bf16 and FP8 against te_jax's GEMM custom calls.

For each shape (M, N, K) it times ``out[M, N] = A[M, K] . B[N, K]^T`` as

* ``bf16 XLA``: ``lax.dot_general`` on bfloat16 operands;
* ``fp8 XLA``: XLA's native FP8 GEMM, written as flax's ``Fp8DirectDotGeneralOp``
  does it (``dot_general`` of float8_e4m3fn operands with
  ``preferred_element_type=bfloat16``, then the decode scales on the output);
  the compiled HLO is checked for ``__cublas$lt$matmul$f8`` (the dequantize
  pattern ``dot(q_a.astype(bf16) * s_a, q_b.astype(bf16) * s_b)`` is checked
  too and timed only if XLA turns it into an FP8 GEMM);
* te_jax ``gemm_fp8`` (per-tensor, fast_accum on and off), ``gemm_fp8_block``
  (1x128 A x 128x128 B, and 1x128 x 1x128 as a wgrad multiplies; cuBLASLt),
  ``gemm_mxfp8`` and ``gemm_nvfp4`` (emulated with a bfloat16 GEMM on Hopper),
  all with bfloat16 output;
* the same two block-scaled products through te_jax's CUTLASS grouped kernel
  with one group (``grouped_gemm_fp8_block``, group sizes on the device): the
  other block-scaled GEMM te_jax has, against cuBLASLt's.

Operands are fresh normal random data, quantized with te_jax's quantizers
outside the timed region. Each row: warm-up, then ``--trials`` runs of
``--iters`` back-to-back calls (alternating two input sets, ended by
block_until_ready), median time per call. The trials of all the rows of one
shape are interleaved (an order shuffled each round), so that the GPU's
clocks falling as it heats under its power cap cannot favour the row timed
first. Reported: median ms, TFLOP/s,
fraction of the 1979 TFLOP/s dense FP8 peak, speed-up vs bf16 and vs XLA FP8.

Before timing, ``--check`` (on by default) runs every te_jax GEMM on small
shapes (batched operands, bias, every output dtype) against a float64 product
of the dequantized operands and reports the worst error relative to the
float32-accumulation tolerance.

Autotuning: with ``--autotune on`` (the default here) te_jax's GEMMs are
called with ``autotune=True``: the CUDA handlers time up to 16 cuBLASLt
heuristic algorithms when a configuration is first used (the warm-up calls pay
for it) and keep the fastest; ``--autotune off`` calls them as the recipes do
by default (``autotune=False``: the heuristic's first algorithm).
``--compare-heuristic`` adds the per-tensor te_jax rows with the other setting
as "... [heuristic #0]" rows, timed in turns with the rest. ``--xla-heuristic`` adds XLA's FP8
GEMM compiled with XLA's autotuning off; the algorithm index XLA's autotuner
chose is printed from the compiled HLO.

Usage: python benchmarks/bench_gemm.py [--out r.json] [--md r.md] [--no-check]
       [--autotune on|off] [--compare-heuristic] [--only REGEX]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import te_jax  # noqa: F401
from te_jax.ops import gemm as gemm_ops
from te_jax.ops.grouped import gemm as grouped_ops
from timing import add_repeat_args, time_interleaved, write_results
from te_jax.quantize import (CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer)
from te_jax.quantize import dequantize

FP8_PEAK_TFLOPS = 1979.0
SHAPES = [(8192, 8192, 8192), (8192, 28672, 8192), (28672, 8192, 8192), (16384, 8192, 8192)]
NT = (((1,), (1,)), ((), ()))  # contract the last axis of both: A [M, K] . B [N, K]^T
F8_GEMM = "__cublas$lt$matmul$f8"


# ---- quantized operands -----------------------------------------------------------------


def _quantize(quantizer, x):
    """Rowwise quantization with the FFI kernels, or the reference if those fail (noted once)."""
    try:
        return jax.block_until_ready(quantizer.quantize(x))
    except Exception as err:  # noqa: BLE001  (benchmark: report and continue)
        if not getattr(_quantize, "warned", False):
            print(f"note: FFI quantize failed ({type(err).__name__}: {str(err)[:200]}); using the reference quantizer")
            _quantize.warned = True
        return jax.block_until_ready(quantizer.quantize(x, backend="reference"))


def _shaped(st, like):
    """A ScaledTensor's rowwise data and scales with ``like``'s leading axes (they come back as matrices)."""
    lead = like.shape[:-2]
    data = st.data.reshape(*lead, -1, st.data.shape[-1])
    scale = st.scale_inv if st.scale_inv.size == 1 else st.scale_inv.reshape(*lead, -1, st.scale_inv.shape[-1])
    return data, scale


def operands(mode: str, a, b, a_block_2d=False, b_block_2d=True):
    """(args, kwargs, (qa, qb)) for the te_jax GEMM of ``mode`` from A [..., M, K] and B [..., N, K].

    Float8 block: A 1x128 and B 128x128 unless told otherwise; NVFP4: B with 16x16 blocks.
    """
    if mode == "fp8":
        qa, qb = (_quantize(CurrentScalingQuantizer(jnp.float8_e4m3fn), x) for x in (a, b))
        (da, sa), (db, sb) = _shaped(qa, a), _shaped(qb, b)
        return (da, db, sa.reshape(1), sb.reshape(1)), {}, (qa, qb)
    if mode == "fp8_block":
        qa = _quantize(Float8BlockQuantizer(block_2d=a_block_2d), a)
        qb = _quantize(Float8BlockQuantizer(block_2d=b_block_2d), b)
        kw = dict(a_block_2d=a_block_2d, b_block_2d=b_block_2d)
    elif mode == "mxfp8":
        qa, qb = _quantize(MXFP8Quantizer(), a), _quantize(MXFP8Quantizer(), b)
        kw = {}
    else:
        qa, qb = _quantize(NVFP4Quantizer(), a), _quantize(NVFP4Quantizer(block_2d=True), b)
        (da, sa), (db, sb) = _shaped(qa, a), _shaped(qb, b)
        return (da, sa, qa.amax.reshape(1), db, sb, qb.amax.reshape(1)), {}, (qa, qb)
    (da, sa), (db, sb) = _shaped(qa, a), _shaped(qb, b)
    return (da, sa, db, sb), kw, (qa, qb)


GEMMS = {
    "fp8": gemm_ops.gemm_fp8,
    "fp8_block": gemm_ops.gemm_fp8_block,
    "mxfp8": gemm_ops.gemm_mxfp8,
    "nvfp4": gemm_ops.gemm_nvfp4,
}


def dequantized(qa, qb) -> tuple[np.ndarray, np.ndarray]:
    """The operands' represented values in float64, from the reference dequantization."""
    to64 = lambda st: np.asarray(jax.device_get(dequantize(st, jnp.float32, backend="reference")), np.float64)  # noqa: E731
    return to64(qa), to64(qb)


# ---- correctness check ---------------------------------------------------------------------


def _accumulation_eps(mode: str, fast_accum: bool) -> float:
    """Per-term accumulation error allowed (tolerance = K * eps * sum|a*b|).

    float32 accumulation: 2^-23. Hopper's FP8 tensor cores accumulate with
    ~14 mantissa bits between promotions to float32: fast accumulation never
    promotes (2^-13); split accumulation and the block-scaled kernels promote
    every K block (2^-16). The sm_90 MXFP8/NVFP4 emulation is a bfloat16 GEMM
    with float32 accumulation.
    """
    native_block = not _is_hopper()
    if mode == "fp8" and fast_accum:
        return 2.0**-13
    if mode in ("fp8", "fp8_block") or native_block:
        return 2.0**-16
    return 2.0**-23



def check(key) -> list[dict]:
    """Every te_jax GEMM on small shapes vs the float64 product of the dequantized operands."""
    cases = []  # (mode, a shape, b shape, out dtype, bias dtype or None, extra kwargs)
    for mode in GEMMS:
        cases += [
            (mode, (256, 512), (384, 512), jnp.bfloat16, None, {}),
            (mode, (256, 512), (384, 512), jnp.float32, jnp.float32, {}),
            (mode, (256, 512), (384, 512), jnp.bfloat16, jnp.bfloat16, {}),
            (mode, (256, 512), (384, 512), jnp.float16, jnp.float32, {}),
            (mode, (2, 128, 512), (384, 512), jnp.bfloat16, None, {}),  # leading axes folded into M
            (mode, (2, 128, 512), (2, 256, 512), jnp.float32, None, {}),  # batched B
        ]
    cases.append(("fp8", (256, 512), (384, 512), jnp.float32, None, dict(fast_accum=False)))
    cases.append(("fp8_block", (256, 512), (384, 512), jnp.float32, None, dict(a_block_2d=True)))
    cases.append(("fp8_block", (256, 512), (384, 512), jnp.float32, None, dict(b_block_2d=True)))
    results = []
    for i, (mode, sa, sb, out_dtype, bias_dtype, extra) in enumerate(cases):
        name = (f"{mode} A{list(sa)} B{list(sb)} out={jnp.dtype(out_dtype).name} "
                f"bias={jnp.dtype(bias_dtype).name if bias_dtype else None} {extra or ''}").strip()
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, i), 3)
        a = jax.random.normal(k1, sa, jnp.float32)
        b = jax.random.normal(k2, sb, jnp.float32)
        bias = None if bias_dtype is None else jax.random.normal(k3, (sb[-2],), jnp.float32).astype(bias_dtype)
        try:
            blocks = {k: extra[k] for k in ("a_block_2d", "b_block_2d") if k in extra}
            if blocks:
                blocks = dict(a_block_2d=blocks.get("a_block_2d", False), b_block_2d=blocks.get("b_block_2d", False))
            args, kw, (qa, qb) = operands(mode, a, b, **blocks)
            call_kw = {**kw, **extra}
            out = jax.jit(lambda *x: GEMMS[mode](*x, bias=bias, out_dtype=out_dtype, **call_kw))(*args)
            got = np.asarray(jax.device_get(out.astype(jnp.float32)), np.float64)
            da, db = dequantized(qa, qb)
            want = np.matmul(da, np.swapaxes(db, -1, -2))
            mag = np.matmul(np.abs(da), np.abs(np.swapaxes(db, -1, -2)))
            if bias is not None:
                bias64 = np.asarray(jax.device_get(bias.astype(jnp.float32)), np.float64)
                want, mag = want + bias64, mag + np.abs(bias64)
            k = sa[-1]
            acc_eps = _accumulation_eps(mode, extra.get("fast_accum", True))
            out_eps = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}[jnp.dtype(out_dtype).name]
            tol = k * acc_eps * mag + out_eps * np.abs(want) + 1e-30
            ratio = float(np.max(np.abs(got - want) / tol))
            rel = float(np.max(np.abs(got - want) / (mag + 1e-30)))
            ok = bool(ratio <= 1.0 and np.all(np.isfinite(got)))
            results.append(dict(case=name, ok=ok, err_over_tol=ratio, err_over_sum_abs=rel))
        except Exception as err:  # noqa: BLE001
            results.append(dict(case=name, ok=False, error=f"{type(err).__name__}: {str(err)[:400]}"))
        r = results[-1]
        print(f"check {'PASS' if r['ok'] else 'FAIL'} {name}: "
              + (f"max err/tol {r['err_over_tol']:.3g}, max err/sum|a*b| {r['err_over_sum_abs']:.2e}"
                 if "err_over_tol" in r else r.get("error", "")), flush=True)
    return results


# ---- timing ----------------------------------------------------------------------------


def xla_fp8_fns():
    direct = jax.jit(lambda qa, qb, sa, sb: lax.dot_general(qa, qb, NT, preferred_element_type=jnp.bfloat16)
                     * (sa * sb).astype(jnp.bfloat16))
    dq = jax.jit(lambda qa, qb, sa, sb: lax.dot_general(qa.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16),
                                                        qb.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16), NT,
                                                        preferred_element_type=jnp.bfloat16))
    return {"direct": direct, "dequantize": dq}


def bench_shape(m, n, k, key, args) -> list[dict]:
    """Every variant at one shape, timed with their trials interleaved (timing.time_interleaved)."""
    rows = []
    flops = 2.0 * m * n * k
    keys = jax.random.split(key, 4)
    bf16_sets = [(jax.random.normal(keys[2 * s], (m, k), jnp.bfloat16),
                  jax.random.normal(keys[2 * s + 1], (n, k), jnp.bfloat16)) for s in range(2)]
    wanted = lambda label: not args.only or re.search(args.only, label)  # noqa: E731
    calls: dict[str, tuple] = {}  # name -> (fn, arg sets, note)

    def error(name, err, stage=""):
        rows.append(dict(shape=[m, n, k], name=name, error=f"{stage}{type(err).__name__}: {str(err)[:300]}"))
        print(f"  {name:28s} {rows[-1]['error']}", flush=True)
        if args.verbose:
            traceback.print_exc()

    if wanted("bf16 XLA"):
        calls["bf16 XLA"] = (jax.jit(lambda a, b: lax.dot_general(a, b, NT)), bf16_sets, "")

    fp8_sets = [operands("fp8", a, b)[0] for a, b in bf16_sets]
    for variant, fn in xla_fp8_fns().items():
        try:
            hlo = fn.lower(*fp8_sets[0]).compile().as_text()
            hit = F8_GEMM in hlo
        except Exception as err:  # noqa: BLE001
            hit, hlo = False, f"{type(err).__name__}: {err}"
        label = f"fp8 XLA ({variant})"
        algo = re.findall(r'"selected_algorithm":"?(-?\d+)', hlo)
        print(f"  XLA fp8 ({variant}): compiled HLO {'contains' if hit else 'does NOT contain'} {F8_GEMM}"
              + (f", cuBLASLt algorithm index {algo[0]} (XLA's autotuning)" if algo else ""))
        if wanted(label) and (variant == "direct" or hit):
            calls[label] = (fn, fp8_sets, "" if hit else f"(no {F8_GEMM} in HLO)")
        if variant == "direct" and hit and args.xla_heuristic and wanted("fp8 XLA (direct, autotune off)"):
            # XLA's own GEMM with its autotuning off: the heuristic's first algorithm. Against the row above,
            # how much XLA's algorithm choice is worth.
            try:
                fixed = fn.lower(*fp8_sets[0]).compile(compiler_options={"xla_gpu_autotune_level": 0})
                calls["fp8 XLA (direct, autotune off)"] = (fixed, fp8_sets, "")
            except Exception as err:  # noqa: BLE001
                error("fp8 XLA (direct, autotune off)", err, "compile: ")

    autotune = args.autotune == "on"
    variants = [("fp8", "te fp8 fast_accum", dict(fast_accum=True)),
                ("fp8", "te fp8 split_accum", dict(fast_accum=False)),
                ("fp8_block", "te fp8_block 1x128 x 128x128", {}),
                ("fp8_block", "te fp8_block 1x128 x 1x128", dict(b_block_2d=False)),
                ("mxfp8", "te mxfp8", {}),
                ("nvfp4", "te nvfp4", {})]
    variants = [(mode, label, {**extra, "autotune": autotune}) for mode, label, extra in variants]
    if args.compare_heuristic and autotune:
        variants += [(mode, f"{label} [heuristic #0]", {**extra, "autotune": False})
                     for mode, label, extra in variants[:2]]
    for mode, label, extra in variants:
        if not wanted(label):
            continue
        try:
            sets, kw = [], {}
            blocks = {k: extra.pop(k) for k in ("b_block_2d",) if k in extra}
            for a, b in bf16_sets:
                ops_args, kw, _ = operands(mode, a, b, **blocks)
                sets.append(ops_args)
            kw = {**kw, **extra}
            fn = jax.jit(lambda *x, _m=mode, _kw=tuple(kw.items()): GEMMS[_m](*x, out_dtype=jnp.bfloat16, **dict(_kw)))
        except Exception as err:  # noqa: BLE001
            error(label, err, "quantize: ")
            continue
        note = "(bf16 emulation on sm_90)" if mode in ("mxfp8", "nvfp4") and _is_hopper() else ""
        calls[label] = (fn, sets, note)

    for b_block_2d, label in ((True, "te fp8_block 1x128 x 128x128, CUTLASS grouped (1 group)"),
                              (False, "te fp8_block 1x128 x 1x128, CUTLASS grouped (1 group)")):
        if not wanted(label):
            continue
        try:
            sets = []
            for a, b in bf16_sets:
                (da, sa, db, sb), _, _ = operands("fp8_block", a, b, b_block_2d=b_block_2d)
                sets.append((da, sa, db[None], sb[None], jnp.full((1,), m, jnp.int32)))
            fn = jax.jit(lambda a, a_s, b, b_s, sizes, _b2d=b_block_2d: grouped_ops.grouped_gemm_fp8_block(
                a, a_s, b, b_s, sizes, b_block_2d=_b2d, out_dtype=jnp.bfloat16))
        except Exception as err:  # noqa: BLE001
            error(label, err, "quantize: ")
            continue
        calls[label] = (fn, sets, "")

    # Compile and warm up each alone, so that a failing variant is reported and left out.
    runnable = {}
    for name, (fn, sets, note) in calls.items():
        try:
            for i in range(args.warmup):
                jax.block_until_ready(fn(*sets[i % len(sets)]))
            runnable[name] = (fn, sets)
        except Exception as err:  # noqa: BLE001
            error(name, err)
    per_trial = time_interleaved(runnable, 1, args.iters, args.trials)
    for name, times in per_trial.items():
        t = statistics.median(times)
        note = calls[name][2]
        rows.append(dict(shape=[m, n, k], name=name, ms=t * 1e3, tflops=flops / t / 1e12, note=note,
                         trial_ms=[x * 1e3 for x in times]))
        print(f"  {name:28s} {t * 1e3:.3f} ms  {flops / t / 1e12:.0f} TFLOP/s "
              f"(trials {min(times) * 1e3:.3f}-{max(times) * 1e3:.3f}) {note}", flush=True)
    return rows


def _is_hopper() -> bool:
    cc = getattr(jax.devices()[0], "compute_capability", "")
    return str(cc).startswith("9")


def table(rows: list[dict]) -> str:
    lines = ["| M x N x K | GEMM | median ms | TFLOP/s | of FP8 peak | vs bf16 | vs XLA fp8 | note |",
             "|---|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(tuple(r["shape"]) for r in rows):
        group = [r for r in rows if tuple(r["shape"]) == shape]
        base = next((r["ms"] for r in group if r["name"] == "bf16 XLA" and "ms" in r), None)
        xla = next((r["ms"] for r in group if r["name"] == "fp8 XLA (direct)" and "ms" in r), None)
        for r in group:
            dims = " x ".join(map(str, shape))
            if "ms" not in r:
                lines.append(f"| {dims} | {r['name']} | - | - | - | - | - | {r['error'][:120]} |")
                continue
            vs_bf16 = f"{base / r['ms']:.2f}x" if base else "-"
            vs_xla = f"{xla / r['ms']:.2f}x" if xla else "-"
            lines.append(f"| {dims} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                         f"{r['tflops'] / FP8_PEAK_TFLOPS:.1%} | {vs_bf16} | {vs_xla} | {r.get('note', '')} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--md", help="write the markdown table here")
    add_repeat_args(p, warmup=5, iters=20, trials=9)
    p.add_argument("--shapes", default="", help="M,N,K;M,N,K;... (default: the four standard shapes)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--autotune", choices=("on", "off"), default="on",
                   help="te_jax's GEMMs with autotune=True (time cuBLASLt's candidates on first use) or False")
    p.add_argument("--compare-heuristic", action="store_true",
                   help="with --autotune on, also time the te fp8 rows with autotuning off, in turns with the rest")
    p.add_argument("--xla-heuristic", action="store_true",
                   help="also time XLA's FP8 GEMM compiled with its autotuning off (xla_gpu_autotune_level=0)")
    p.add_argument("--only", default="", help="time only the GEMMs whose label matches this regex")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s] or SHAPES
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} (compute capability {getattr(dev, 'compute_capability', '?')}), "
          f"jax {jax.__version__}, te_jax GEMM autotuning {args.autotune}")
    key = jax.random.PRNGKey(0)
    checks = [] if args.no_check else check(jax.random.fold_in(key, 1))
    rows = []
    for i, (m, n, k) in enumerate(shapes):
        print(f"shape M={m} N={n} K={k}")
        rows += bench_shape(m, n, k, jax.random.fold_in(key, 100 + i), args)
    md = table(rows)
    n_fail = sum(not c["ok"] for c in checks)
    if checks:
        md += f"\n\ncorrectness check: {len(checks) - n_fail}/{len(checks)} passed"
        md += "".join(f"\n- FAIL {c['case']}: {c.get('error', c.get('err_over_tol'))}" for c in checks if not c["ok"])
    print(md)
    result = dict(device=dev.device_kind, jax=jax.__version__, fp8_peak_tflops=FP8_PEAK_TFLOPS,
                  autotune=args.autotune, rows=rows, check=checks)
    write_results(args.out, args.md, result, md + "\n")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
