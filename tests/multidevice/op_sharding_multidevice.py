"""Sharding checks of the quantize / dequantize / norm / activation ops on 8 fake CPU devices.

Run by tests/ops/test_op_sharding.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. For every case it prints one
JSON line (name, ok, what failed) and, when all pass, "ALL OK". A case compares
the op under jit on sharded operands with the unsharded op: the same bits
(float32 reductions: 1e-5), the expected output shardings, and the collectives
in the compiled HLO per kind.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from te_jax.ops import norm_act as A
from te_jax.ops import norm_act as N
from te_jax.ops import dequantize as DQ
from te_jax.ops import quantize as Q
from te_jax.ops.cast import CastSpec
from te_jax.spec import reference as ref

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
E4 = jnp.float8_e4m3fn
ROWS, COLS = 1024, 512
RESULTS: list[dict] = []


def _counts(hlo: str) -> dict[str, int]:
    return {k: len(re.findall(rf"= [^\n=]*? {k}(?:-start)?\(", hlo)) for k in KINDS}


def _spec(a) -> list:
    spec = tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
    return [s if s is None or isinstance(s, str) else "+".join(s) for s in spec]


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def _pick(outs):
    """Per-tensor results ``(q, q_t, amax, ...)`` reordered as ``(q, amax, q_t, ...)``."""
    return (outs[0], outs[2], outs[1], *outs[3:])


def case(name, fn, args, specs, mesh, *, outs=None, all_reduce=0, gathered=False, close=(), want_fn=None):
    """Runs one case and records it.

    Args:
      outs: {result index: expected spec (tuple of mesh axis names / None)}.
      all_reduce: the exact number of all-reduces.
      gathered: True when an operand must be gathered (misaligned or unsupported
        sharding); False means no all-gather / all-to-all at all.
      close: result indices compared to 1e-5 (float32 reductions) instead of bits.
      want_fn: the unsharded function to compare with (default ``fn``).
    """
    want = jax.tree.leaves(jax.jit(want_fn or fn)(*args))
    sharded = [jax.device_put(a, NamedSharding(mesh, P(*s))) for a, s in zip(args, specs)]
    f = jax.jit(fn)
    got = jax.tree.leaves(f(*sharded))
    counts = _counts(f.lower(*sharded).compile().as_text())
    errors = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            errors.append(f"result {i}: shape {g.shape} != {w.shape}")
        elif i in close:
            if not np.allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5):
                errors.append(f"result {i}: not close")
        elif not np.array_equal(_bits(g), _bits(w)):
            errors.append(f"result {i}: bits differ")
    for i, spec in (outs or {}).items():
        if _spec(got[i]) != list(spec):
            errors.append(f"result {i}: spec {_spec(got[i])} != {list(spec)}")
    if counts["all-reduce"] != all_reduce:
        errors.append(f"all-reduce {counts['all-reduce']} != {all_reduce}")
    moved = counts["all-gather"] + counts["all-to-all"]
    if gathered != (moved > 0):
        errors.append(f"all-gather + all-to-all = {moved}, expected {'some' if gathered else 'none'}")
    RESULTS.append(dict(case=name, ok=not errors, errors=errors, counts=counts))
    print(json.dumps(RESULTS[-1]), flush=True)


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    devs = np.array(jax.devices())
    rows8 = Mesh(devs, ("d",))
    grid = Mesh(devs.reshape(2, 4), ("x", "y"))
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    x = normal(ROWS, COLS)
    layouts = {  # name: (mesh, x spec, rows axes, cols axes)
        "rows": (rows8, ("d", None), "d", None),
        "grid": (grid, ("x", "y"), "x", "y"),
        "cols": (grid, (None, "y"), None, "y"),
    }

    # ---- quantize / dequantize -------------------------------------------------------
    quant = {  # name: (fn, all-reduces); results 0 and 2 are the rowwise and columnwise data
        "fp8_tensor": (lambda x, s: _pick(Q.quantize_fp8_tensor(x, s, rowwise=True, colwise=True)), 1),
        "fp8_current": (lambda x: _pick(Q.quantize_fp8_current(x, rowwise=True, colwise=True, power_2=True)), 1),
        "mxfp8": (lambda x: Q.quantize_mxfp8(x, rowwise=True, colwise=True), 0),
        "block_1x128": (lambda x: Q.quantize_fp8_block(x, rowwise=True, colwise=True), 0),
        "block_128x128": (lambda x: Q.quantize_fp8_block(x, rowwise=True, colwise=True, block_2d=True), 0),
        "nvfp4_rht": (lambda x: Q.quantize_nvfp4(x, rowwise=True, colwise=True, rht=True), 1),
        "nvfp4_16x16": (lambda x: Q.quantize_nvfp4(x, rowwise=True, colwise=True, block_2d=True), 1),
        "nvfp4_col_rht_bf16": (lambda x: (lambda o: (x, o[4], o[2], o[3]))(  # noqa: E731
            Q.quantize_nvfp4(x.astype(jnp.bfloat16), rowwise=False, colwise=True, rht=True)), 1),
    }
    scale = jnp.full((1,), 3.0, jnp.float32)
    for layout, (mesh, spec, r, c) in layouts.items():
        for name, (fn, ar) in quant.items():
            args, specs = ((x, scale), (spec, (None,))) if name == "fp8_tensor" else ((x,), (spec,))
            case(f"quantize/{name}/{layout}", fn, args, specs, mesh, outs={0: (r, c), 2: (c, r)}, all_reduce=ar)

    # Dequantize, sharded like the data (block scales follow it).
    mx = ref.quantize_mxfp8(x, qdtype=E4)
    b2 = ref.quantize_fp8_block(x, qdtype=E4, block_2d=True)
    nv = ref.quantize_nvfp4(x)
    cur = ref.quantize_fp8_current(x, qdtype=E4)
    mesh, spec, r, c = layouts["grid"]
    deq = {
        "fp8": (lambda q, s: DQ.dequantize_fp8_tensor(q, s), (cur[0], cur[4]), (spec, (None,))),
        "mxfp8": (lambda q, s: DQ.dequantize_mxfp8(q, s), mx[:2], (spec, spec)),
        "block_128x128": (lambda q, s: DQ.dequantize_fp8_block(q, s, block_2d=True), b2[:2], (spec, spec)),
        "nvfp4": (lambda q, s, a: DQ.dequantize_nvfp4(q, s, a), (nv[0], nv[1], nv[4]), (spec, spec, (None,))),
    }
    for name, (fn, args, specs) in deq.items():
        case(f"dequantize/{name}/grid", fn, args, specs, mesh, outs={0: (r, c)})

    # A batch of matrices under vmap: the batch axis and the columns stay sharded.
    xb = normal(4, 256, COLS)
    case("quantize/vmap_mxfp8/grid", jax.vmap(lambda x: Q.quantize_mxfp8(x, rowwise=True, colwise=True)), (xb,),
         (("x", None, "y"),), grid, outs={0: ("x", None, "y"), 2: ("x", "y", None)})
    case("quantize/vmap_current/grid", jax.vmap(lambda x: Q.quantize_fp8_current(x, colwise=True)), (xb,),
         ((None, "x", "y"),), grid, outs={0: (None, "x", "y"), 1: (None, "y", "x")}, all_reduce=1)

    # Misaligned: 4-way columns of 96 (24 < one MXFP8 block), 8-way rows of 64 (8 < one Hadamard group).
    xm = normal(64, 96)
    case("misaligned/mxfp8_cols", lambda x: Q.quantize_mxfp8(x, rowwise=True, colwise=True), (xm,),
         ((None, "y"),), grid, gathered=True)
    case("misaligned/nvfp4_rht_rows", lambda x: Q.quantize_nvfp4(x, colwise=True, rht=True), (normal(64, 64),),
         (("d", None),), rows8, all_reduce=0, gathered=True)
    case("misaligned/block_2d_rows", lambda x: Q.quantize_fp8_block(x, block_2d=True), (normal(512, 256),),
         (("d", None),), rows8, gathered=True)

    # ---- NVFP4 stochastic rounding ---------------------------------------------------
    key = jax.random.key(7)
    sr = lambda x, k: Q.quantize_nvfp4(x, k, rowwise=True, colwise=True, rht=True,  # noqa: E731
                                       stochastic_rounding=True)
    kd = jax.random.key_data(key)
    case("nvfp4_sr/one_shard", lambda x, k: sr(x, jax.random.wrap_key_data(k)), (x, kd), ((None, None), (None,)),
         rows8)
    case("nvfp4_sr/batch_axis", jax.vmap(lambda x, k: sr(x, jax.random.wrap_key_data(k)), in_axes=(0, None)),
         (normal(8, 128, 256), kd), (("d", None, None), (None,)), rows8, outs={0: ("d", None, None)})
    _sr_unbiased(rows8, key)

    # ---- norms ------------------------------------------------------------------------
    gamma, beta = normal(COLS) * 0.1 + 1, normal(COLS) * 0.1
    specs_nf = {
        "mxfp8": (CastSpec("mxfp8", E4, True, True), 0),
        "fp8_tensor": (CastSpec("fp8_tensor", E4, True, True), 1),
        "current": (CastSpec("fp8_current", E4, True, True), 1),
        "nvfp4_rht": (CastSpec("nvfp4", None, True, True, rht=True), 1),
        "none": (CastSpec("none", jnp.bfloat16), 0),
    }
    for name, (cs, ar) in specs_nf.items():
        fn = lambda x, g, b, cs=cs: N.norm_fwd(x, g, b, spec=cs, scale=jnp.full((1,), 2.0))  # noqa: E731
        case(f"norm_fwd/{name}/rows", fn, (x, gamma, beta), (("d", None), (None,), (None,)), rows8,
             outs={0: ("d", None)}, all_reduce=ar)
    # An H split is gathered (a norm needs whole rows; x and gamma: two all-gathers), rows stay split
    # (the outputs may be sliced back to the input's H split afterwards: no collective).
    case("norm_fwd/rmsnorm_current/grid", lambda x, g: N.norm_fwd(x, g, kind="rmsnorm",
                                                                  spec=specs_nf["current"][0]),
         (x, gamma), (("x", "y"), ("y",)), grid, outs={7: ("x",)}, all_reduce=1, gathered=True)
    fwd = N.norm_fwd(x, gamma, beta)
    dy = normal(ROWS, COLS)
    for kind in ("layernorm", "rmsnorm"):
        mean = fwd.mean if kind == "layernorm" else None
        fn = lambda dy, x, r, g, m=mean, kind=kind: N.norm_bwd(dy, x, m, r, g, kind=kind)  # noqa: E731
        case(f"norm_bwd/{kind}/rows", fn, (dy, x, fwd.rsigma, gamma), (("d", None), ("d", None), ("d",), (None,)),
             rows8, outs={0: ("d", None), 1: (None,)}, all_reduce=1, close=(1, 2))

    # ---- activations ---------------------------------------------------------------------
    for layout, (mesh, spec, r, c) in layouts.items():
        for name, cs, ar in (("mxfp8", CastSpec("mxfp8", E4, True, True), 0),
                             ("current", CastSpec("fp8_current", E4, True, True), 1),
                             ("nvfp4_rht", CastSpec("nvfp4", None, True, True, rht=True), 1)):
            case(f"act_fwd/gelu_{name}/{layout}", lambda x, cs=cs: A.act_fwd(x, act="gelu", spec=cs), (x,), (spec,),
                 mesh, outs={0: (r, c), 2: (c, r)}, all_reduce=ar)
        case(f"act_bwd/gelu_block_dbias/{layout}",
             lambda dy, x: A.act_bwd(dy, x, act="gelu", spec=CastSpec("fp8_block", E4, True, True), dbias=True),
             (dy, x), (spec, spec), mesh, outs={0: (r, c), 2: (c, r), 7: (c,)}, all_reduce=1 if r else 0,
             close=(7,))

    # Gated, tensor parallel: x [M, 2, F] with F split keeps it split; [M, 2F] gathers its columns.
    f = COLS // 2
    xp = x.reshape(ROWS, 2, f)
    dyf = normal(ROWS, f)
    pair_spec = ("x", None, "y")
    for name, cs, ar in (("mxfp8", CastSpec("mxfp8", E4, True, True), 0),
                         ("nvfp4_rht", CastSpec("nvfp4", None, True, True, rht=True), 1)):
        case(f"act_fwd/swiglu_pair_{name}/grid",
             lambda x, cs=cs: A.act_fwd(x, act="swiglu", spec=cs, pair_axis=True), (xp,), (pair_spec,), grid,
             outs={0: ("x", "y"), 2: ("y", "x")}, all_reduce=ar,
             want_fn=lambda x, cs=cs: A.act_fwd(x.reshape(ROWS, COLS), act="swiglu", spec=cs))
        case(f"act_bwd/swiglu_pair_{name}_dbias/grid",
             lambda dy, x, cs=cs: A.act_bwd(dy, x, act="swiglu", spec=cs, dbias=True, pair_axis=True),
             (dyf, xp), (("x", "y"), pair_spec), grid,
             outs={0: ("x", None, "y"), 2: (None, "y", "x"), 7: (None, "y")}, all_reduce=ar + 1, close=(7,),
             want_fn=lambda dy, x, cs=cs: A.act_bwd(dy, x, act="swiglu", spec=cs, dbias=True, pair_axis=True))
    case("act_fwd/swiglu_flat_mxfp8/grid",
         lambda x: A.act_fwd(x, act="swiglu", spec=CastSpec("mxfp8", E4, True, True)), (x,), (("x", "y"),), grid,
         outs={0: ("x", None)}, gathered=True)

    bad = [r["case"] for r in RESULTS if not r["ok"]]
    print("FAILED: " + ", ".join(bad) if bad else "ALL OK", flush=True)


def _sr_unbiased(mesh, key) -> None:
    """Rows split 8 ways: the bits differ per block (the key gets the block's index) and stay unbiased."""
    rng = np.random.default_rng(1)
    block = rng.uniform(0.5, 6.0, size=(ROWS // 8, COLS)).astype(np.float32)
    x = jnp.asarray(np.tile(block, (8, 1)))  # every device's rows are the same values

    def fn(x):
        q, s, *_, amax, _ = Q.quantize_nvfp4(x, key, rowwise=True, stochastic_rounding=True)
        return DQ.dequantize_nvfp4(q, s, amax), q

    xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
    deq, q = jax.jit(fn)(xs)
    deq_rne = DQ.dequantize_nvfp4(*[Q.quantize_nvfp4(x)[i] for i in (0, 1, 4)])
    err = np.asarray(deq) - np.asarray(x)
    n = err.size
    errors = []
    blocks = np.asarray(q).reshape(8, ROWS // 8, -1)
    if all(np.array_equal(blocks[0], b) for b in blocks[1:]):
        errors.append("every block drew the same random bits")
    if abs(err.mean()) > 4 * err.std() / np.sqrt(n):
        errors.append(f"biased: mean error {err.mean()} (std {err.std()}, n {n})")
    if not np.all(np.abs(err) <= 2 * np.abs(np.asarray(deq_rne) - np.asarray(x)).max() + 1e-6):
        errors.append("an SR value is not a neighbouring grid point")
    RESULTS.append(dict(case="nvfp4_sr/unbiased_rows", ok=not errors, errors=errors, counts={}))
    print(json.dumps(RESULTS[-1]), flush=True)


if __name__ == "__main__":
    main()
