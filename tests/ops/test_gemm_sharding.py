"""GEMM sharding rule: sharded operands stay put, a sharded contraction costs exactly one all-reduce.

The checks need 8 devices, so they run in a subprocess (this file run as a
script) whose XLA_FLAGS asks for 8 fake CPU devices; the pytest process's own
jax is left alone. The child prints one JSON line per case: the output's
sharding, the collectives in the compiled HLO, the custom call's local output
shape and the error against the unsharded result.
"""

from __future__ import annotations

import json

import pytest

MESH = (("x", 2), ("y", 4))
M, N, K = 256, 512, 512
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
MODES = ("fp8", "block", "mxfp8", "nvfp4")
LAYOUTS = {  # A [M, K] spec, B [N, K] spec -> out spec, all-reduces, local out shape
    "rows_of_A": (("x", None), (None, None), ("x", None), 0, (M // 2, N)),
    "cols_of_B": ((None, None), ("y", None), (None, "y"), 0, (M, N // 4)),
    "rows_of_A_cols_of_B": (("x", None), ("y", None), ("x", "y"), 0, (M // 2, N // 4)),
    "contraction": ((None, "y"), (None, "y"), (None, None), 1, (M, N)),
    "rows_of_A_contraction": (("x", "y"), (None, "y"), ("x", None), 1, (M // 2, N)),
}
DENSE = {  # dense-layer GEMMs on ScaledTensors -> out spec, all-reduces
    "fwd_dp_tp": (("x", None, "y"), 0),  # x rows on x, W columns (N) on y
    "dgrad_tp": ((None, None, None), 1),  # dy and W sharded along F, the contraction
    "wgrad_dp": ((None, None), 1),  # x and dy sharded along the tokens, the contraction
    "wgrad_dp_nvfp4_rht": ((None, None), 1),
    "vmap_batch": (("x", None, "y"), 0),  # a vmapped batch axis on x, B shared and N-sharded
    "per_matrix_scales": (("x", None, "y"), 0),  # the same with one per-tensor FP8 scale per matrix
}


def _child() -> None:
    import dataclasses
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from te_jax.ops import gemm as G
    from te_jax.quantize import MXFP8Quantizer, NVFP4Quantizer
    from te_jax.spec import reference as ref

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731

    def report(name, fn, args, specs):
        want = jax.jit(fn)(*args)
        sharded = [put(a, s) for a, s in zip(args, specs)]
        f = jax.jit(fn)
        out = f(*sharded)
        hlo = f.lower(*sharded).compile().as_text()
        local = re.findall(r"\(f32\[([\d,]*)\][^)]*\) custom-call\([^\n]*custom_call_target=\"te_jax_gemm", hlo)
        spec = tuple(out.sharding.spec) + (None,) * (out.ndim - len(out.sharding.spec))
        print(json.dumps(dict(
            case=name, spec=[s if s is None or isinstance(s, str) else "+".join(s) for s in spec],
            counts={k: len(re.findall(rf"= [^\n=]*? {k}(?:-start)?\(", hlo)) for k in KINDS},
            local=[[int(d) for d in shape.split(",")] for shape in local],
            err=float(jnp.abs(out - want).max() / jnp.abs(want).max()),
        )), flush=True)

    x, w, bias = normal(M, K), normal(N, K), normal(N)
    e4 = jnp.float8_e4m3fn
    ops = {
        "fp8": (lambda *a: G.gemm_fp8(*a, out_dtype=jnp.float32),
                ref.quantize_fp8_current(x, qdtype=e4)[::4], ref.quantize_fp8_current(w, qdtype=e4)[::4]),
        "block": (lambda *a: G.gemm_fp8_block(*a, b_block_2d=True, out_dtype=jnp.float32),
                  ref.quantize_fp8_block(x, qdtype=e4)[:2], ref.quantize_fp8_block(w, qdtype=e4, block_2d=True)[:2]),
        "mxfp8": (lambda *a: G.gemm_mxfp8(*a, out_dtype=jnp.float32),
                  ref.quantize_mxfp8(x, qdtype=e4)[:2], ref.quantize_mxfp8(w, qdtype=e4)[:2]),
        "nvfp4": (lambda *a: G.gemm_nvfp4(*a, out_dtype=jnp.float32),
                  ref.quantize_nvfp4(x)[:2] + ref.quantize_nvfp4(x)[4:5],
                  ref.quantize_nvfp4(w)[:2] + ref.quantize_nvfp4(w)[4:5]),
    }
    for mode, (fn, a_args, b_args) in ops.items():
        if mode == "fp8":  # (q, scale_inv) pairs; the call takes A, B, a_scale_inv, b_scale_inv
            args = (a_args[0], b_args[0], a_args[1], b_args[1])
            roles = ("a", "b", "t", "t")
        else:
            args = (*a_args, *b_args)
            roles = ("a",) * len(a_args) + ("b",) * len(b_args)
        for layout, (a_spec, b_spec, out_spec, _, _) in LAYOUTS.items():
            specs = [(None,) if a.shape == (1,) or r == "t" else (a_spec if r == "a" else b_spec)
                     for a, r in zip(args, roles)]
            report(f"{mode}/{layout}", lambda *a, fn=fn: fn(*a[:-1], a[-1]), (*args, bias), (*specs, (b_spec[0],)))

    # Dense-layer GEMMs on ScaledTensors whose leaves are sharded like their data.
    q = MXFP8Quantizer()
    xs, ws, dys = normal(2, M // 2, K), normal(K, N), normal(2, M // 2, N)
    xq, wq, gq = q.quantize(xs, colwise=True), q.quantize(ws, colwise=True), q.quantize(dys, colwise=True)

    def leaves(t, row_spec=(None, None), col_spec=(None, None)):
        return [t.data, t.scale_inv, t.colwise_data, t.colwise_scale_inv], [row_spec, row_spec, col_spec, col_spec]

    def rebuild(t, vals):
        return dataclasses.replace(t, data=vals[0], scale_inv=vals[1], colwise_data=vals[2], colwise_scale_inv=vals[3])

    def two(name, t1, t2, dims, l1, l2):
        fn = lambda *v: G.gemm(rebuild(t1, v[:4]), rebuild(t2, v[4:]), dims, out_dtype=jnp.float32)  # noqa: E731
        report(name, fn, (*l1[0], *l2[0]), (*l1[1], *l2[1]))

    two("fwd_dp_tp", xq, wq, ((2,), (0,)), leaves(xq, row_spec=("x", None)), leaves(wq, col_spec=("y", None)))
    two("dgrad_tp", gq, wq, ((2,), (1,)), leaves(gq, row_spec=(None, "y")), leaves(wq, row_spec=(None, "y")))
    two("wgrad_dp", xq, gq, ((0, 1), (0, 1)), leaves(xq, col_spec=(None, "x")), leaves(gq, col_spec=(None, "x")))
    rht = NVFP4Quantizer(rht=True)
    xr, gr = rht.quantize(xs, colwise=True), rht.quantize(dys, colwise=True)
    report("wgrad_dp_nvfp4_rht",
           lambda a, sa, aa, b, sb, ab: G.gemm(
               dataclasses.replace(xr, colwise_data=a, colwise_scale_inv=sa, colwise_amax=aa),
               dataclasses.replace(gr, colwise_data=b, colwise_scale_inv=sb, colwise_amax=ab),
               ((0, 1), (0, 1)), out_dtype=jnp.float32),
           (xr.colwise_data, xr.colwise_scale_inv, xr.colwise_amax, gr.colwise_data, gr.colwise_scale_inv,
            gr.colwise_amax),
           ((None, "x"), (None, "x"), (None,), (None, "x"), (None, "x"), (None,)))
    batch = ref.quantize_mxfp8(normal(2, M // 2, K), qdtype=e4)[:2]
    report("vmap_batch", jax.vmap(lambda a, sa, b, sb: G.gemm_mxfp8(a, sa, b, sb, out_dtype=jnp.float32),
                                  in_axes=(0, 0, None, None)),
           (*batch, *ops["mxfp8"][2]), (("x", None, None), ("x", None, None), ("y", None), ("y", None)))
    qx, _, _, _, sx = ref.quantize_fp8_current(normal(2, M // 2, K), qdtype=e4)  # sx: [2, 1]
    report("per_matrix_scales", lambda a, b, sa, sb: G.gemm_fp8(a, b, sa, sb, out_dtype=jnp.float32),
           (qx, ops["fp8"][2][0], sx, ops["fp8"][2][1]), (("x", None, None), ("y", None), ("x", None), (None,)))


@pytest.fixture(scope="module")
def results() -> dict:
    from qtest_util import run_on_fake_devices  # not at the top: the child this file also is needs no jax yet

    proc = run_on_fake_devices([__file__])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


def _check(r: dict, out_spec, all_reduces: int) -> None:
    assert tuple(r["spec"]) == out_spec
    assert r["counts"] == {k: all_reduces if k == "all-reduce" else 0 for k in KINDS}
    assert len(r["local"]) == 1  # one custom call, on this device's shards
    # Without a sharded contraction each output element is summed in the same order.
    assert r["err"] <= (1e-6 if all_reduces else 0.0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_low_level_gemm_sharding(results, mode, layout):
    _, _, out_spec, all_reduces, local = LAYOUTS[layout]
    r = results[f"{mode}/{layout}"]
    _check(r, out_spec, all_reduces)
    assert tuple(r["local"][0]) == local


@pytest.mark.parametrize("case", DENSE)
def test_dense_gemm_sharding(results, case):
    _check(results[case], *DENSE[case])


if __name__ == "__main__":
    _child()
