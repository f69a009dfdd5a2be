"""The grouped GEMM's sharding rule on 4 fake CPU devices; run by tests/ops/test_grouped_gemm.py in a subprocess
with XLA_FLAGS=--xla_force_host_platform_device_count=4.

Cases: per-tensor FP8, Float8 block and bfloat16, each with its rows (group_axis 0) and its groups along the
contraction (group_axis 1); and wgrad's span operand from FP8 rows (``gather_transpose``) with the columns or the
rows of its data split over "ep", on an Auto and on an Explicit mesh. Prints one JSON line per case: whether the sharded call (groups sharded over "ep"
with their experts, the rest replicated) equals the one-device call bit for bit, the output's sharding, and the
collectives in the compiled HLO.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax.ops.grouped import gemm as GG
from te_jax.ops.grouped.spans import rows_to_spans_transposed
from te_jax.quantize import CurrentScalingQuantizer, Float8BlockQuantizer

G, M, K, N = 8, 96, 128, 128
KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute")


def _counts(hlo: str) -> dict[str, int]:
    return {k: len(re.findall(rf"^\s*(?:ROOT )?\S+ = .*\s{k}(?:-start)?\(", hlo, re.MULTILINE)) for k in KINDS}


def main() -> None:
    mesh = jax.make_mesh((4,), ("ep",))
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([20, 0, 13, 30, 1, 0, 17, 9], jnp.int32)  # sum 90 < M
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(G, K, N)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(G, N)), jnp.float32)
    for name, quantizer in (("fp8", CurrentScalingQuantizer()), ("block", Float8BlockQuantizer())):
        xq = quantizer.quantize(x, flatten_axis=1)
        wq = jax.vmap(lambda w: quantizer.quantize(w, colwise=True, flatten_axis=1))(w)
        ep = NamedSharding(mesh, P("ep"))
        f = jax.jit(lambda xq, wq, s, b: GG.grouped_gemm(xq, wq, s, bias=b, out_dtype=jnp.float32))
        want = f(xq, wq, sizes, bias)
        wq_ep = jax.tree.map(lambda a: jax.device_put(a, ep) if a.ndim >= 1 and a.shape[0] == G else a, wq)
        got = f(xq, wq_ep, sizes, jax.device_put(bias, ep))
        hlo = f.lower(xq, wq_ep, sizes, jax.device_put(bias, ep)).compile().as_text()
        print(json.dumps({"case": f"{name}:rows", "equal": bool(np.array_equal(np.asarray(got), np.asarray(want))),
                          "spec": str(got.sharding.spec), "collectives": _counts(hlo)}), flush=True)
        # group_axis 1: out [G, P, Q] wanted split over "ep" along G.
        align = GG.GROUP_ALIGN[quantizer.scaling_mode.family]
        spans = -(-(M + G * align) // align) * align
        group, index, member = GG.grouped_positions(sizes, spans, align)
        rows = jnp.clip((jnp.cumsum(sizes) - sizes)[group] + index, 0, M - 1)
        xs = jnp.where(member[:, None], x[rows], 0.0)
        aq = quantizer.quantize(xs, rowwise=False, colwise=True, flatten_axis=1)
        h = jax.jit(lambda aq, s: GG.grouped_gemm(aq, aq, s, (0, 0), group_axis=1, out_dtype=jnp.float32),
                    out_shardings=NamedSharding(mesh, P("ep", None, None)))
        want = jax.jit(lambda aq, s: GG.grouped_gemm(aq, aq, s, (0, 0), group_axis=1, out_dtype=jnp.float32))(aq,
                                                                                                              sizes)
        got = h(aq, sizes)
        hlo = h.lower(aq, sizes).compile().as_text()
        print(json.dumps({"case": f"{name}:spans", "equal": bool(np.array_equal(np.asarray(got), np.asarray(want))),
                          "spec": str(got.sharding.spec), "collectives": _counts(hlo)}), flush=True)
    _bf16_cases(mesh, x, w, bias, sizes, rng)
    _spans_cases(mesh, x, sizes)


def _bf16_cases(mesh, x, w, bias, sizes, rng) -> None:
    """The bfloat16 call: forward rows (b's experts over "ep") and the wgrad (out's groups over "ep"; the
    groups are rows of both operands)."""
    ep = NamedSharding(mesh, P("ep"))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    f = jax.jit(lambda x, w, s, b: GG.grouped_gemm_bf16(x, w, s, b))
    want = f(xb, wb, sizes, bias)
    args = (xb, jax.device_put(wb, ep), sizes, jax.device_put(bias, ep))
    got = f(*args)
    hlo = f.lower(*args).compile().as_text()
    print(json.dumps({"case": "bf16:rows", "equal": bool(np.array_equal(np.asarray(got), np.asarray(want))),
                      "spec": str(got.sharding.spec), "collectives": _counts(hlo)}), flush=True)
    dy = jnp.asarray(rng.normal(size=(M, N)), jnp.bfloat16)
    wgrad = lambda x, dy, s: GG.grouped_gemm_bf16(x, dy, s, group_axis=1)  # noqa: E731
    h = jax.jit(wgrad, out_shardings=NamedSharding(mesh, P("ep", None, None)))
    want = jax.jit(wgrad)(xb, dy, sizes)
    got = h(xb, dy, sizes)
    hlo = h.lower(xb, dy, sizes).compile().as_text()
    print(json.dumps({"case": "bf16:spans", "equal": bool(np.array_equal(np.asarray(got), np.asarray(want))),
                      "spec": str(got.sharding.spec), "collectives": _counts(hlo)}), flush=True)


def _spans_cases(mesh, x, sizes) -> None:
    """gather_transpose keeps a split of the columns (C, out's rows) and gathers split rows (a span may take its
    rows from any shard)."""
    codes = CurrentScalingQuantizer().quantize(x, flatten_axis=1).data
    f = jax.jit(lambda d, s: rows_to_spans_transposed(d, s, 256, 16))
    want = f(codes, sizes)
    explicit = jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Explicit,))
    for name, on, spec in (("cols", mesh, P(None, "ep")), ("rows", mesh, P("ep", None)),
                           ("explicit_cols", explicit, P(None, "ep")), ("explicit_rows", explicit, P("ep", None))):
        d = jax.device_put(codes, NamedSharding(on, spec))
        with jax.set_mesh(on):
            got = f(d, sizes)
            hlo = f.lower(d, sizes).compile().as_text()
        equal = np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
        print(json.dumps({"case": f"spans_t:{name}", "equal": bool(equal), "spec": str(got.sharding.spec),
                          "collectives": _counts(hlo)}), flush=True)


if __name__ == "__main__":
    main()
