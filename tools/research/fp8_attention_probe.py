"""Does jax's cuDNN FP8 fused attention run here, how accurate is it, and how fast against bf16 cuDNN?

jax ships cuDNN's FP8 flash attention (forward and backward) only behind a private module,
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., use_fp8=True)``: E4M3 query,
key, value and output-gradient, FP8 output and gradients, per-tensor scales and descales as
``[1, 1, 1, 1]`` float32 operands, and the amaxes of S, O, dQ, dK, dV and dP as extra results. For
training it takes head dim 128 and sequence lengths divisible by 128: the 1.3b preset's attention
(``examples/gpt``: batch 16, 2048 tokens, 16 query heads, 8 key/value heads, head dim 128, causal).

The probe quantizes bf16 inputs per tensor (scale = 448 / amax), runs the FP8 forward and backward
at that shape, dequantizes, compares with bf16 cuDNN attention (``jax.nn.dot_product_attention``,
implementation "cudnn") and times both, forward + backward, in turns. The scales of the outputs it
cannot know in advance (dP, dQ, dK, dV) come from a first FP8 call's amaxes, as delayed scaling
would set them. Any failure is printed with its message. From the repository root on a GPU
machine::

    python3 tools/research/fp8_attention_probe.py [--batch 16] [--seq 2048] [--heads 16] [--kv-heads 8]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from timing import time_call  # noqa: E402  (the benchmarks' timing loop)

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0


def _param(x) -> jax.Array:
    return jnp.full((1, 1, 1, 1), x, jnp.float32)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(E4M3 codes, descale)`` of ``x`` with scale ``448 / amax(x)``."""
    scale = E4M3_MAX / jnp.maximum(_amax(x), 1e-12)
    return jnp.clip(x.astype(jnp.float32) * scale, -E4M3_MAX, E4M3_MAX).astype(E4M3), 1.0 / scale


def bf16_attention(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                    implementation="cudnn"), q, k, v)
    return (out, *vjp(do))


def fp8_attention(q, k, v, do, out_amaxes):
    """FP8 forward + backward with the casts; ``out_amaxes`` = (dQ, dK, dV, dP) amaxes that set the output scales."""
    q8, dsq = _quantize(q)
    k8, dsk = _quantize(k)
    v8, dsv = _quantize(v)
    do8, dsdo = _quantize(do)
    # |O| <= amax(v): each output row is a convex combination of value rows, so O takes V's scale.
    scale_o = 1.0 / dsv
    amax_dq, amax_dk, amax_dv, amax_dp = out_amaxes
    params = {
        "amax_dQ": _param(0.0), "amax_dK": _param(0.0), "amax_dV": _param(0.0), "amax_dP": _param(0.0),
        "descale_q": _param(dsq), "descale_k": _param(dsk), "descale_v": _param(dsv),
        "descale_s": _param(1.0 / E4M3_MAX), "scale_s": _param(E4M3_MAX),
        "scale_o": _param(scale_o), "descale_o": _param(1.0 / scale_o), "descale_dO": _param(dsdo),
        "descale_dP": _param(amax_dp / E4M3_MAX), "scale_dQ": _param(E4M3_MAX / amax_dq),
        "scale_dK": _param(E4M3_MAX / amax_dk), "scale_dV": _param(E4M3_MAX / amax_dv),
        "scale_dP": _param(E4M3_MAX / amax_dp),
    }
    scale = q.shape[-1] ** -0.5
    dq8, dk8, dv8, o8, dparams = fp8_kernels(q8, k8, v8, do8, params, scale)
    o = o8.astype(jnp.float32) / scale_o
    grads = (dq8.astype(jnp.float32) * amax_dq / E4M3_MAX, dk8.astype(jnp.float32) * amax_dk / E4M3_MAX,
             dv8.astype(jnp.float32) * amax_dv / E4M3_MAX)
    new_amaxes = tuple(jnp.reshape(dparams[k], ()) for k in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP"))
    return o, grads, new_amaxes


def fp8_kernels(q8, k8, v8, do8, params, scale):
    """cuDNN's FP8 forward and backward alone, on E4M3 inputs: ``(dQ, dK, dV, O, the params' cotangents)``."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def run(q8, k8, v8, params):
        return fa.dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale, mask_type=fa.MaskType.CAUSAL,
                                        qkv_layout="BTNH", use_fp8=True)

    (o8, _, _), vjp = jax.vjp(run, q8, k8, v8, params)
    zero = jnp.zeros((1, 1, 1, 1), jnp.float32)
    dq8, dk8, dv8, dparams = vjp((do8, zero, zero))
    return dq8, dk8, dv8, o8, dparams


def _median_ms(fn, args) -> float:
    """Median milliseconds per call: 3 warm-up calls, 7 trials of 10 back-to-back calls."""
    return 1e3 * time_call(fn, [args], warmup=3, iters=10, trials=7)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from jax._src.lib import cuda_versions

    report: dict = {"jax": jax.__version__, "device": str(jax.devices()[0])}
    try:
        report["cudnn"] = fa.check_cudnn_version()
        report["cuda_runtime"] = cuda_versions.cuda_runtime_get_version() if cuda_versions else None
    except Exception as err:  # a probe reports what it finds
        report["version_error"] = repr(err)
    b, t, n, kv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kv, d), jnp.bfloat16)
    do = (jax.random.normal(keys[3], (b, t, n, d), jnp.float32) * 1e-3).astype(jnp.bfloat16)

    bf16 = jax.jit(bf16_attention)
    o_ref, *g_ref = bf16(q, k, v, do)
    flops = 4 * b * n * t * t * d / 2 * 3.5  # causal: half the scores; fwd 2 GEMMs, bwd 5
    report["bf16_ms"] = _median_ms(bf16, (q, k, v, do))
    report["bf16_tflops"] = flops / report["bf16_ms"] / 1e9
    try:
        fp8 = jax.jit(fp8_attention)
        ones = tuple(jnp.float32(1.0) for _ in range(4))
        _, _, amaxes = fp8(q, k, v, do, ones)
        ref_amaxes = tuple(_amax(g) for g in g_ref)
        report["fp8_first_call_amaxes"] = [float(a) for a in amaxes]
        report["bf16_grad_amaxes"] = [float(a) for a in ref_amaxes]
        amaxes = tuple(jnp.where(a > 0, a, 1.0) for a in amaxes)
        o, grads, _ = fp8(q, k, v, do, amaxes)

        def rel(a, ref):
            ref = ref.astype(jnp.float32)
            return float(jnp.linalg.norm(a - ref) / jnp.linalg.norm(ref))

        report["fp8_rel_err"] = {"o": rel(o, o_ref), "dq": rel(grads[0], g_ref[0]), "dk": rel(grads[1], g_ref[1]),
                                 "dv": rel(grads[2], g_ref[2])}
        report["fp8_ms"] = _median_ms(fp8, (q, k, v, do, amaxes))
        report["fp8_tflops"] = flops / report["fp8_ms"] / 1e9
        # The kernels alone, on inputs quantized beforehand, every scale 1 (timing only).
        q8, k8, v8, do8 = (_quantize(x)[0] for x in (q, k, v, do))
        unit = {name: _param(1.0) for name in fa.fp8_params_keys}
        kernels = jax.jit(functools.partial(fp8_kernels, scale=d ** -0.5))
        report["fp8_kernels_ms"] = _median_ms(kernels, (q8, k8, v8, do8, unit))
        report["fp8_kernels_tflops"] = flops / report["fp8_kernels_ms"] / 1e9
        # Accuracy with every scale 1 (jax's own test's setting): unit-normal inputs already on the E4M3 grid,
        # against bf16 attention of the same values.
        u = [jax.random.normal(kk, x.shape, jnp.float32).astype(E4M3) for kk, x in zip(keys, (q, k, v, do))]
        dq8, dk8, dv8, o8, _ = kernels(*u, unit)
        o_u, *g_u = bf16(*(x.astype(jnp.bfloat16) for x in u))
        report["fp8_rel_err_unit_scales"] = {name: rel(a.astype(jnp.float32), ref) for name, a, ref in
                                             (("o", o8, o_u), ("dq", dq8, g_u[0]), ("dk", dk8, g_u[1]),
                                              ("dv", dv8, g_u[2]))}
        report["bf16_ms_after"] = _median_ms(bf16, (q, k, v, do))
        bf16_ms = (report["bf16_ms"] + report["bf16_ms_after"]) / 2
        report["speedup"] = bf16_ms / report["fp8_ms"]
        report["speedup_kernels_only"] = bf16_ms / report["fp8_kernels_ms"]
    except Exception as err:  # the probe's answer may be that it does not run
        report["fp8_error"] = f"{type(err).__name__}: {err}"[:4000]
        traceback.print_exc()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
