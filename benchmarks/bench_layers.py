"""Layer benchmark: te_jax.flax layers (forward + backward) against bf16 flax.linen and flax's FP8.

Sections (``--sections``), each timed as one jitted training step: the
forward, the loss ``sum(y * c)`` and the gradients of every parameter, of the
input and (te_jax) of the FP8 state, all bfloat16 activations and parameters:

* ``mlp``: LayerNormMLP at T=8192, H=8192, F=28672, gelu: flax.linen
  ``LayerNorm -> Dense -> gelu -> Dense`` in bf16, the same with flax's FP8
  dot_general injected into the Dense layers (``nn.Fp8DirectDotGeneralOp``,
  i.e. ``nn.Fp8DotGeneral``, and the deprecated ``nn.Fp8DotGeneralOp``), and
  ``te_jax.flax.LayerNormMLP`` under DelayedScaling, Float8CurrentScaling,
  Float8BlockScaling, MXFP8 and NVFP4 (the last two are emulated by bf16 GEMMs
  on Hopper, for information); and ``te_jax.nnx.LayerNormMLP`` ("te nnx
  delayed", "te nnx current"), the same layer in Flax NNX form, stepped by
  ``te_jax.nnx.value_and_grad``.
* ``lndense``: LayerNormDenseGeneral 8192 -> 28672 at T=8192 (flax: LayerNorm + Dense).
* ``dense``: DenseGeneral 8192 -> 28672 at T=8192.

The last two sections time te_jax under the per-tensor recipes (the fast-accumulating backward
variants included) and Float8BlockScaling.

FP8 state: before timing, ``--state-steps`` steps (default 3) run with their
FP8 state update fed back (te_jax's "fp8_meta", flax's
"_overwrite_with_gradient"), so delayed scaling is timed with the scales
training would reach, not the initial scale 1 (under which the small initial
weights quantize to mostly subnormal or zero codes, and GEMMs on such data draw
less power). The timed steps then reuse that state.

Breakdown: for each te_jax row (and bf16), the same forward, dgrad and wgrad
GEMMs are timed alone on operands quantized beforehand with the recipe's
quantizers (delayed scaling: with the scale of each operand's amax) ("GEMM ms"); the rest of the step ("other ms" = total - GEMM) is
casts, norm, activation, amax/state updates and the remaining elementwise work.

Timing: every variant of a section (and its GEMM-only function) is first
built, initialized, compiled and run once; then all of them are timed
together with ``timing.time_interleaved``: warm-up, then ``--trials`` rounds,
each running ``--iters`` back-to-back steps (alternating two input sets) of
every variant in turn, in an order shuffled each round. The median per step is
reported and every trial kept ("trial_ms", "gemm_trial_ms" in the JSON). So
the GPU slowing as it heats under its power cap reaches every variant alike
instead of favouring the one timed first. This holds all the section's
variants in memory at once (a few GB each for the MLP at full size);
``--sequential`` instead times each variant right after building it and frees
it before the next (less memory, but exposed to that drift). ``--quick`` uses
small shapes and few iterations (a CPU smoke run).

Usage: python benchmarks/bench_layers.py [--out r.json] [--md r.md] [--quick] [--sections mlp,lndense,dense]
       [--sequential]
"""

from __future__ import annotations

import argparse
import statistics
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.ops.gemm import gemm

try:
    from te_jax.core import DenseQuantizers
except ImportError:  # a te_jax from before the floor plan (gpu_check --baseline-python with an older tree)
    from te_jax import DenseQuantizers
from layer_variants import BF16, FLAX_FP8, _build_step, _step_inputs, _variants
from timing import add_repeat_args, time_interleaved, write_results

# The targets of issue 5 (H200): (section, row, at most ms or None, at least this many times faster than flax fp8).
TARGETS = [("mlp", "te delayed", 15.5, 1.14), ("mlp", "te current", None, 1.0), ("mlp", "te block", None, 1.0),
           ("lndense", "te delayed", None, 1.0), ("lndense", "te current", None, 1.0),
           ("dense", "te delayed", None, 1.0), ("dense", "te current", None, 1.0)]


# ---- GEMM-only steps (the breakdown) --------------------------------------------------------


def gemm_plan(section: str, t: int, h: int, n: int):
    """The GEMMs of one step: (lhs name, rhs name, contracting dims, forward?), and tensor shapes."""
    shapes = {"x": (t, h), "w1": (h, n), "dy1": (t, n)}
    gemms = [("x", "w1", ((1,), (0,)), True), ("dy1", "w1", ((1,), (1,)), False), ("x", "dy1", ((0,), (0,)), False)]
    if section == "mlp":
        shapes.update(a=(t, n), w2=(n, h), dy2=(t, h))
        gemms += [("a", "w2", ((1,), (0,)), True), ("dy2", "w2", ((1,), (1,)), False),
                  ("a", "dy2", ((0,), (0,)), False)]
    return gemms, shapes


def gemm_only_step(section: str, t: int, h: int, n: int, recipe, key, state_steps: int = 0):
    """``(fn, input_sets)`` computing just the step's GEMMs, on operands quantized beforehand."""
    gemms, shapes = gemm_plan(section, t, h, n)
    role = {"x": "input", "a": "input", "w1": "weight", "w2": "weight", "dy1": "grad_output", "dy2": "grad_output"}
    q = DenseQuantizers.from_recipe(recipe) if recipe is not None else None
    sets = []
    for s in range(2):
        ops = {}
        for i, (name, shape) in enumerate(sorted(shapes.items())):
            k = jax.random.fold_in(key, 10 * s + i)
            v = (jax.random.normal(k, shape, jnp.float32) * (0.05 if name.startswith("w") else 1.0)).astype(BF16)
            if q is not None:
                qz = getattr(q, role[name])
                st = qz.init_state() if hasattr(qz, "init_state") else None
                if st is not None and state_steps:  # delayed scaling's scale for this operand's amax, as in training
                    st = qz.update_state(st, jnp.max(jnp.abs(v.astype(jnp.float32))))
                v = jax.block_until_ready(jax.jit(lambda v, k, qz=qz, st=st: qz.quantize(
                    v, st, rowwise=True, colwise=True, key=k))(v, jax.random.key_data(k)))
            ops[name] = v
        sets.append((ops,))

    def run(ops):
        outs = []
        for lhs, rhs, dims, forward in gemms:
            if q is None:
                outs.append(lax.dot_general(ops[lhs], ops[rhs], (dims, ((), ()))))
            else:
                fast = q.fast_accum if forward else q.backward_fast_accum  # as the layers take it from the recipe
                outs.append(gemm(ops[lhs], ops[rhs], dims, out_dtype=BF16, fast_accum=fast))
        return outs

    return jax.jit(run), sets


def _build_gemms(section: str, t: int, h: int, n: int, recipe, key, state_steps: int = 0) -> tuple[Callable, list]:
    """The GEMM-only function and its inputs (``gemm_only_step``), compiled and run once."""
    fn, gsets = gemm_only_step(section, t, h, n, recipe, key, state_steps)
    jax.block_until_ready(fn(*gsets[0]))
    return fn, gsets


def _error(row: dict, err: Exception, verbose: bool, stage: str = "") -> None:
    """Records ``err`` in ``row`` (after any error already there); prints the traceback under ``--verbose``."""
    msg = f"{stage}{type(err).__name__}: {str(err)[:300]}"
    row["error"] = f"{row['error']}; {msg}" if "error" in row else msg
    if verbose:
        traceback.print_exc()


def _record(row: dict, times: dict[str, list[float]], flops: float) -> None:
    """Fills ``row`` from the seconds per trial of its step and, when timed, of its GEMM-only function."""
    step_s = times[row["name"]]
    sec = statistics.median(step_s)
    row.update(ms=sec * 1e3, tflops=flops / sec / 1e12, trial_ms=[s * 1e3 for s in step_s])
    gemm_s = times.get(f"{row['name']} [GEMMs]")
    if gemm_s is not None:
        row.update(gemm_ms=statistics.median(gemm_s) * 1e3, gemm_trial_ms=[s * 1e3 for s in gemm_s])
        row["other_ms"] = row["ms"] - row["gemm_ms"]


def _print_row(row: dict) -> None:
    """One progress line: the row's times and breakdown, and its error if any."""
    line = row.get("error", "")
    if "ms" in row:
        split = f"  (GEMMs {row['gemm_ms']:.3f} ms, other {row['other_ms']:.3f} ms)" if "gemm_ms" in row else ""
        line = f"{row['ms']:.3f} ms  {row['tflops']:.3g} TFLOP/s{split}" + (f"  [{line}]" if line else "")
    print(f"  {row['name']:40s} {line}", flush=True)


def bench_section(section: str, t: int, h: int, n: int, args) -> list[dict]:
    """One row per wanted variant of ``section``, their trials interleaved (one after another with --sequential).

    A variant whose step fails to build, compile or run is reported with its error and not timed; one
    whose GEMM-only function fails keeps its step's timing, the error recorded beside it.
    """
    key = jax.random.key(0)
    flops = (12.0 if section == "mlp" else 6.0) * t * h * n
    sets = _step_inputs(section, t, h, n, key)
    rows: list[dict] = []
    calls: dict[str, tuple[Callable, Sequence]] = {}
    times: dict[str, list[float]] = {}

    def add(label: str, fn: Callable, fn_sets: Sequence) -> None:
        """Queues ``fn`` for the interleaved timing, or under --sequential times it now (and keeps no reference)."""
        if args.sequential:
            times.update(time_interleaved({label: (fn, fn_sets)}, args.warmup, args.iters, args.trials))
        else:
            calls[label] = (fn, fn_sets)

    for name, impl, arg in _variants(section, args.only):
        row = dict(section=section, shape=dict(T=t, H=h, N=n), name=name)
        rows.append(row)
        try:
            add(name, _build_step(row, section, h, n, impl, arg, sets, args), sets)
        except Exception as err:  # noqa: BLE001 (benchmark: report and continue)
            _error(row, err, args.verbose)
            _print_row(row)
            continue
        if name == "bf16 flax" or impl == "te":
            try:
                add(f"{name} [GEMMs]", *_build_gemms(section, t, h, n, arg if impl == "te" else None,
                                                    jax.random.fold_in(key, 99), args.state_steps))
            except Exception as err:  # noqa: BLE001
                _error(row, err, args.verbose, "GEMM-only: ")
        if impl == "te" and name in ("te mxfp8", "te nvfp4") and _is_hopper():
            row["note"] = "bf16 GEMM emulation on sm_90"
        if args.sequential:
            _record(row, times, flops)
            _print_row(row)
    timed = [r for r in rows if r["name"] in calls]  # empty under --sequential
    if timed:
        if args.verbose:
            print(f"    timing {len(calls)} functions, their trials interleaved", flush=True)
        try:
            times.update(time_interleaved(calls, args.warmup, args.iters, args.trials))
        except Exception as err:  # noqa: BLE001
            for row in timed:
                _error(row, err, args.verbose, "interleaved timing (--sequential needs less memory): ")
        for row in timed:
            if row["name"] in times:
                _record(row, times, flops)
            _print_row(row)
    return rows


def _is_hopper() -> bool:
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


# ---- report ------------------------------------------------------------------------------------


def _flax_fp8_ms(group):
    times = [r["ms"] for r in group if r["name"] in FLAX_FP8 and "ms" in r]
    return min(times) if times else None


def table(rows: list[dict]) -> str:
    lines = ["| layer (T, H, N) | variant | median ms | TFLOP/s | vs bf16 | vs best flax fp8 | GEMM ms | other ms "
             "| GEMM share | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for section in dict.fromkeys(r["section"] for r in rows):
        group = [r for r in rows if r["section"] == section]
        base = next((r["ms"] for r in group if r["name"] == "bf16 flax" and "ms" in r), None)
        flax8 = _flax_fp8_ms(group)
        for r in group:
            s = r["shape"]
            label = f"{section} ({s['T']}, {s['H']}, {s['N']})"
            if "ms" not in r:
                lines.append(f"| {label} | {r['name']} | - | - | - | - | - | - | - | {r['error'][:120]} |")
                continue
            ms, g = r["ms"], r.get("gemm_ms")
            vs_bf16 = f"{base / ms:.2f}x" if base else "-"
            vs_flax = f"{flax8 / ms:.2f}x" if flax8 else "-"
            split = (f"{g:.3f} | {r['other_ms']:.3f} | {g / ms:.0%}" if g is not None else "- | - | -")
            note = "; ".join(filter(None, (r.get("note"), r.get("error", "")[:120])))
            lines.append(f"| {label} | {r['name']} | {ms:.3f} | {r['tflops']:.3g} | {vs_bf16} | {vs_flax} | {split} | "
                         f"{note} |")
    return "\n".join(lines)


def targets(rows: list[dict], quick: bool) -> list[dict]:
    """Issue 5's performance targets, checked against this run (informative only off an H200 / in --quick)."""
    out = []
    for section, name, max_ms, min_speedup in TARGETS:
        group = [r for r in rows if r["section"] == section]
        row = next((r for r in group if r["name"] == name and "ms" in r), None)
        flax8 = _flax_fp8_ms(group)
        if row is None or flax8 is None:
            continue
        speedup = flax8 / row["ms"]
        ok = speedup >= min_speedup and (max_ms is None or row["ms"] <= max_ms)
        want = (f"<= {max_ms} ms and " if max_ms else "") + f">= {min_speedup:.2f}x flax fp8"
        out.append(dict(section=section, name=name, ms=row["ms"], vs_flax_fp8=speedup, target=want,
                        ok=ok, binding=not quick))
    return out


def layer_parser(description: str, sections: str, only: str) -> argparse.ArgumentParser:
    """The options every layer-step script takes: outputs, sections, shape, bias, variants, --verbose."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--md", help="write the markdown report here")
    p.add_argument("--quick", action="store_true", help="small shapes (a CPU smoke run)")
    p.add_argument("--sections", default=sections)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=28672)
    p.add_argument("--bias", action="store_true", help="biases on the dense layers (default: none)")
    p.add_argument("--only", default=only, help="only the variants whose name matches this regex")
    p.add_argument("--state-steps", type=int, default=3,
                   help="steps run before timing, each feeding its FP8 state update (scales, amax history) "
                        "back, so delayed scaling is timed with the scales training would use (0: initial state)")
    p.add_argument("--verbose", action="store_true")
    return p


def step_shape(args) -> tuple[int, int, int]:
    """(T, H, N/F) of the step: the options', or small ones under --quick."""
    return (256, 256, 512) if args.quick else (args.tokens, args.hidden, args.ffn)


def main() -> int:
    p = layer_parser(__doc__.splitlines()[0], "mlp,lndense,dense", "")
    add_repeat_args(p, warmup=3, iters=10, trials=5)
    p.add_argument("--sequential", action="store_true",
                   help="time each variant right after building it and free it before the next (less memory; "
                        "default: build all, then time them with their trials interleaved)")
    args = p.parse_args()
    t, h, n = step_shape(args)
    if args.quick:
        args.warmup, args.iters, args.trials = 1, 2, 2
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}, T={t} H={h} N/F={n}, bias={args.bias}")
    rows = []
    for section in [s for s in args.sections.split(",") if s]:
        if section not in ("mlp", "lndense", "dense"):
            raise SystemExit(f"unknown section {section!r}; choose from mlp, lndense, dense")
        print(f"section {section}")
        rows += bench_section(section, t, h, n, args)
    checks = targets(rows, args.quick)
    md = table(rows)
    if checks:
        md += "\n\nIssue 5 targets" + (" (informative: --quick shapes)" if args.quick else "") + ":\n"
        verdict = lambda c: ("PASS" if c["ok"] else "FAIL") if c["binding"] else "info"  # noqa: E731
        md += "\n".join(f"- {verdict(c)} {c['section']} {c['name']}: {c['ms']:.3f} ms, "
                        f"{c['vs_flax_fp8']:.2f}x flax fp8 (target {c['target']})" for c in checks)
    print(md)
    result = dict(device=dev.device_kind, jax=jax.__version__, quick=args.quick, bias=args.bias, rows=rows,
                  targets=checks)
    write_results(args.out, args.md, result,
                  f"# te_jax layer benchmark ({dev.device_kind}, jax {jax.__version__})\n\n{md}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
