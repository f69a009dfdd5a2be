"""Grouped GEMM op: the CPU handlers vs the reference twin and vs float64 products per group.

The CPU handler and the twin dequantize identically (bit for bit) and both
multiply in float32, but in different summation orders (the handler's i-k-j
loop, XLA's dot), so they agree to float32 rounding: relative error <= 1e-5
of the output's scale, as the dense GEMM (tests/ops/test_gemm.py). What the
grouping decides exactly (which rows or columns belong to which group, the
zeros past the groups, NaN confined to its group) is checked exactly.
"""

from __future__ import annotations

import json
import pathlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qtest_util import run_on_fake_devices

from te_jax.ops import gemm as dense_gemm
from te_jax.ops.grouped import gemm as GG
from te_jax.quantize import CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_jax.ops.dequantize import dequantize, dequantize_colwise

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
G, M, K, N = 4, 160, 256, 128

# name -> (quantizer of A, quantizer of B)
MODES = {
    "fp8_e4m3xe4m3": (CurrentScalingQuantizer(E4), CurrentScalingQuantizer(E4)),
    "fp8_e5m2xe4m3": (CurrentScalingQuantizer(E5), CurrentScalingQuantizer(E4)),
    "block_1x128x128x128": (Float8BlockQuantizer(), Float8BlockQuantizer(block_2d=True)),
    "block_1x128x1x128": (Float8BlockQuantizer(), Float8BlockQuantizer()),
    "mxfp8": (MXFP8Quantizer(), MXFP8Quantizer()),
    "nvfp4": (NVFP4Quantizer(), NVFP4Quantizer(block_2d=True)),
}
WGRAD_MODES = {  # both wgrad operands are activations / gradients: 1D blocks (RHT on both for NVFP4)
    "fp8_e4m3xe5m2": (CurrentScalingQuantizer(E4), CurrentScalingQuantizer(E5)),
    "block_1x128": (Float8BlockQuantizer(), Float8BlockQuantizer()),
    "mxfp8": (MXFP8Quantizer(), MXFP8Quantizer()),
    "nvfp4_rht": (NVFP4Quantizer(rht=True), NVFP4Quantizer(rht=True)),
}
SIZES = {
    "random_with_zeros": [70, 0, 41, 33],
    "all_in_one": [0, 0, M, 0],
    "tail_rows": [20, 5, 0, 31],  # sum < M: the rest of out is zero
    "empty": [0, 0, 0, 0],
}


@pytest.fixture(autouse=True)
def _on_cpu():
    """Runs on XLA:CPU on every machine: these tests check the CPU handlers (and the CPU-only align=1); the CUDA
    grouped kernels are tested against the reference twin in test_grouped_gemm_gpu.py."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _rng(*names) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(names).encode()))


def _data(rng, *shape) -> jax.Array:
    x = rng.normal(size=shape) * np.exp(rng.uniform(-1.5, 1.5, size=shape[:-1] + (1,)))
    return jnp.asarray(x, jnp.float32)


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _close(out, want, tol=1e-5):
    out, want = _f64(out), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(initial=0.0), 1e-30)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * scale)


def _rows_of(sizes, rows):
    """The group of each row (-1 past the groups)."""
    group = np.full(rows, -1)
    start = 0
    for g, m in enumerate(sizes):
        group[start:min(start + m, rows)] = g
        start += m
    return group


def _forward_operands(mode: str, seed=0):
    qa, qb = MODES[mode]
    rng = _rng(mode, seed)
    x, w = _data(rng, M, K), _data(rng, G, K, N)
    xq = qa.quantize(x, rowwise=True, flatten_axis=1)
    wq = jax.vmap(lambda w: qb.quantize(w, colwise=True, flatten_axis=1))(w)
    dx = dequantize(xq)
    dw = jnp.stack([dequantize(jax.tree.map(lambda a: a[g], wq)) for g in range(G)])  # [G, K, N]
    return xq, wq, dx, dw


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("mode", list(MODES))
def test_forward_matches_reference_and_float64(mode, sizes):
    xq, wq, dx, dw = _forward_operands(mode)
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    out = GG.grouped_gemm(xq, wq, gs, out_dtype=F32)
    twin = GG.grouped_gemm(xq, wq, gs, out_dtype=F32, backend="reference")
    group = _rows_of(SIZES[sizes], M)
    want = np.zeros((M, N))
    for g in range(G):
        want[group == g] = _f64(dx)[group == g] @ _f64(dw[g])
    _close(out, want)
    _close(out, twin)
    assert np.all(np.asarray(out)[group < 0] == 0) and np.all(np.asarray(twin)[group < 0] == 0)


@pytest.mark.parametrize("mode", ["fp8_e4m3xe4m3", "block_1x128x1x128", "mxfp8", "nvfp4"])
def test_dgrad_layout_matches_dense_gemm_per_group(mode):
    """dy [M, N] @ W_g^T reads W's rowwise copy; each group's rows equal the dense GEMM of just those rows."""
    qa, qb = MODES[mode]
    rng = _rng("dgrad", mode)
    dy, w = _data(rng, M, N), _data(rng, G, K, N)
    dyq = qa.quantize(dy, flatten_axis=1)
    wq = jax.vmap(lambda w: qb.quantize(w, colwise=True, flatten_axis=1))(w)
    sizes = SIZES["random_with_zeros"]
    out = GG.grouped_gemm(dyq, wq, jnp.asarray(sizes, jnp.int32), (1, 1), out_dtype=F32)
    group = _rows_of(sizes, M)
    full = dequantize(dyq)
    for g in range(G):
        wg = jax.tree.map(lambda a: a[g], wq)
        want = dense_gemm.gemm(full, dequantize(wg), ((1,), (1,)), out_dtype=F32)
        _close(np.asarray(out)[group == g], np.asarray(want)[group == g])


def _spans(sizes, align, extent):
    """(group, member, in_spans) of each column of the aligned-span layout."""
    gs = jnp.asarray(sizes, jnp.int32)
    group, index, member = GG.grouped_positions(gs, extent, align)
    return np.asarray(group), np.asarray(member), np.asarray(GG.in_spans(gs, extent, align))


def _wgrad_operands(mode: str, sizes, align: int):
    """x [Mc, P] and dy [Mc, Q] in aligned spans (each group zero padded to its span), quantized columnwise."""
    qa, qb = WGRAD_MODES[mode]
    rng = _rng("wgrad", mode, tuple(sizes))
    mc = -(-(M + G * align) // align) * align
    group, member, spans = _spans(sizes, align, mc)
    x = _data(rng, mc, K) * member[:, None]
    dy = _data(rng, mc, N) * member[:, None]
    xq = qa.quantize(x, rowwise=False, colwise=True, flatten_axis=1)
    dyq = qb.quantize(dy, rowwise=False, colwise=True, flatten_axis=1)
    return xq, dyq, group, spans


@pytest.mark.parametrize("sizes", ["random_with_zeros", "all_in_one", "empty"])
@pytest.mark.parametrize("mode", list(WGRAD_MODES))
def test_wgrad_layout_matches_reference_and_float64(mode, sizes):
    qa, _ = WGRAD_MODES[mode]
    align = GG.GROUP_ALIGN[qa.scaling_mode.family]
    xq, dyq, group, spans = _wgrad_operands(mode, SIZES[sizes], align)
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    out = GG.grouped_gemm(xq, dyq, gs, (0, 0), group_axis=1, out_dtype=F32)
    twin = GG.grouped_gemm(xq, dyq, gs, (0, 0), group_axis=1, out_dtype=F32, backend="reference")
    assert out.shape == (G, K, N)
    # Each group contracts over its whole span. With the Hadamard transform the padding columns of a group that
    # ends inside a 16-column block hold transformed values, and only the whole block's products are the
    # untransformed ones: the Hadamard-domain product equals the product of the values with the transform undone.
    a, b = _f64(dequantize_colwise(xq)), _f64(dequantize_colwise(dyq))
    undone = [_f64(dequantize_colwise(t, undo_rht=True)) for t in (xq, dyq)] if mode.endswith("rht") else None
    for g in range(G):
        cols = (group == g) & spans
        want = a[:, cols] @ b[:, cols].T
        _close(np.asarray(out)[g], want, tol=1e-5 if cols.any() else 0)
        if undone is not None and cols.any():
            _close(np.asarray(out)[g], undone[0][:, cols] @ undone[1][:, cols].T, tol=1e-5)
        if not cols.any():
            assert np.all(np.asarray(out)[g] == 0)
    _close(out, twin)


@pytest.mark.parametrize("group_axis", [0, 1])
def test_unaligned_spans_on_cpu_and_per_group_scales(group_axis):
    """align=1 (CPU only) and one scale_inv per group: each group decodes with its own value."""
    rng = _rng("per_group", group_axis)
    sizes = [7, 0, 19, 3]
    gs = jnp.asarray(sizes, jnp.int32)
    sa, sb = jnp.asarray(rng.uniform(0.5, 2, G), jnp.float32), jnp.asarray(rng.uniform(0.5, 2, G), jnp.float32)
    if group_axis == 0:
        a = jnp.asarray(rng.normal(size=(40, 32)), E4)
        b = jnp.asarray(rng.normal(size=(G, 16, 32)), E4)
    else:
        a = jnp.asarray(rng.normal(size=(24, 32)), E4)
        b = jnp.asarray(rng.normal(size=(16, 32)), E4)
    kw = dict(group_axis=group_axis, align=1, out_dtype=F32)
    out = GG.grouped_gemm_fp8(a, b, sa, sb, gs, **kw)
    twin = GG.grouped_gemm_fp8(a, b, sa, sb, gs, backend="reference", **kw)
    _close(out, twin)
    fa, fb = _f64(a), _f64(b)
    if group_axis == 0:
        group = _rows_of(sizes, 40)
        for g in range(G):
            want = (fa[group == g] * float(sa[g])) @ (fb[g] * float(sb[g])).T
            _close(np.asarray(out)[group == g], want)
    else:
        start = 0
        for g, m in enumerate(sizes):
            want = (fa[:, start:start + m] * float(sa[g])) @ (fb[:, start:start + m] * float(sb[g])).T
            _close(np.asarray(out)[g], want, tol=1e-5 if m else 0)
            start += m


@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_bias_per_group_and_zero_tail(out_dtype):
    xq, wq, dx, dw = _forward_operands("fp8_e4m3xe4m3", seed=1)
    sizes = SIZES["tail_rows"]
    gs = jnp.asarray(sizes, jnp.int32)
    bias = _data(_rng("bias"), G, N)
    out = GG.grouped_gemm(xq, wq, gs, bias=bias, out_dtype=out_dtype)
    twin = GG.grouped_gemm(xq, wq, gs, bias=bias, out_dtype=out_dtype, backend="reference")
    assert out.dtype == out_dtype
    group = _rows_of(sizes, M)
    want = np.zeros((M, N))
    for g in range(G):
        want[group == g] = _f64(dx)[group == g] @ _f64(dw[g]) + _f64(bias[g])
    tol = 1e-5 if out_dtype == F32 else 2**-8
    _close(out, want, tol)
    _close(out, twin, tol)
    assert np.all(np.asarray(out, np.float32)[group < 0] == 0)


def test_nan_and_inf_stay_in_their_group():
    rng = _rng("nan")
    sizes = [10, 6, 0, 16]
    gs = jnp.asarray(sizes, jnp.int32)
    a = np.asarray(rng.normal(size=(40, 32)), np.float32)
    b = np.asarray(rng.normal(size=(G, 16, 32)), np.float32)
    a[3, 5] = np.nan  # group 0
    a[36, 0] = np.nan  # past the groups: never read
    b[3, 2, 7] = np.inf  # group 3's matrix
    a, b = jnp.asarray(a, E4), jnp.asarray(b, E4)
    one = jnp.ones((1,), jnp.float32)
    for backend in ("ffi", "reference"):
        out = np.asarray(GG.grouped_gemm_fp8(a, b, one, one, gs, align=1, out_dtype=F32, backend=backend))
        assert np.isnan(out[3]).all()
        assert not np.isnan(np.delete(out[:16], 3, axis=0)).any()
        assert np.isinf(out[16:32, 2]).all() or np.isnan(out[16:32, 2]).all()
        assert np.isfinite(np.delete(out[16:32], 2, axis=1)).all()
        assert np.all(out[32:] == 0)


def test_group_sizes_past_the_rows_are_cut():
    """sum(group_sizes) > M breaks the caller's contract; the handler cuts the groups at M and stays in bounds."""
    xq, wq, _, _ = _forward_operands("fp8_e4m3xe4m3", seed=2)
    gs = jnp.asarray([100, 100, 100, 100], jnp.int32)
    out = GG.grouped_gemm(xq, wq, gs, out_dtype=F32)
    twin = GG.grouped_gemm(xq, wq, gs, out_dtype=F32, backend="reference")
    _close(out, twin)


def test_under_jit_with_traced_sizes():
    xq, wq, _, _ = _forward_operands("block_1x128x128x128", seed=3)
    f = jax.jit(lambda gs: GG.grouped_gemm(xq, wq, gs, out_dtype=F32))
    for sizes in SIZES.values():
        gs = jnp.asarray(sizes, jnp.int32)
        np.testing.assert_array_equal(np.asarray(f(gs)), np.asarray(GG.grouped_gemm(xq, wq, gs, out_dtype=F32)))


def test_workspace_bytes():
    assert GG.grouped_workspace_bytes(8) == 32 * 1024 * 1024 + 8 * 1024


def test_errors():
    a = jnp.zeros((32, 32), E4)
    b = jnp.zeros((G, 16, 32), E4)
    one = jnp.ones((1,), jnp.float32)
    gs = jnp.asarray([8, 8, 8, 8], jnp.int32)
    with pytest.raises(TypeError, match="group_sizes must be an int32 array"):
        GG.grouped_gemm_fp8(a, b, one, one, gs.astype(jnp.uint32))
    with pytest.raises(TypeError, match="group_sizes must be an int32 array"):
        GG.grouped_gemm_fp8(a, b, one, one, gs.reshape(2, 2))
    with pytest.raises(ValueError, match="B has 4 matrices but group_sizes has 3 groups"):
        GG.grouped_gemm_fp8(a, b, one, one, gs[:3])
    with pytest.raises(ValueError, match="group_axis=0 needs A"):
        GG.grouped_gemm_fp8(a, b[0], one, one, gs)
    with pytest.raises(ValueError, match="group_axis must be 0"):
        GG.grouped_gemm_fp8(a, b, one, one, gs, group_axis=2)
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        GG.grouped_gemm_fp8(a.astype(jnp.bfloat16), b, one, one, gs)
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        GG.grouped_gemm_fp8(a.astype(E5), b.astype(E5), one, one, gs)
    with pytest.raises(ValueError, match="one value per group"):
        GG.grouped_gemm_fp8(a, b, jnp.ones((3,), jnp.float32), one, gs)
    with pytest.raises(ValueError, match=r"bias must be \[G, N\]"):
        GG.grouped_gemm_fp8(a, b, one, one, gs, bias=jnp.zeros((16,)))
    with pytest.raises(ValueError, match="group_axis=0 only"):
        GG.grouped_gemm_fp8(a, a, one, one, gs, group_axis=1, bias=jnp.zeros((G, 32)))
    # Untileable contraction of a block mode, and spans that would split a block.
    s = jnp.ones((32, 1), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 128"):
        GG.grouped_gemm_fp8_block(a, s, b, jnp.ones((G, 16, 1), jnp.float32), gs)
    a128 = jnp.zeros((32, 128), E4)
    with pytest.raises(ValueError, match="align .* multiple of its block"):
        GG.grouped_gemm_fp8_block(a128, s, a128, s, gs, group_axis=1, align=16)


def test_grouped_positions():
    group, index, member = GG.grouped_positions(jnp.asarray([3, 0, 17, 1], jnp.int32), 64, 16)
    group, index, member = map(np.asarray, (group, index, member))
    np.testing.assert_array_equal(group[:16], 0)
    np.testing.assert_array_equal(member[:16], np.arange(16) < 3)
    np.testing.assert_array_equal(group[16:48], 2)
    np.testing.assert_array_equal(index[16:48], np.arange(32))
    np.testing.assert_array_equal(member[16:48], np.arange(32) < 17)
    np.testing.assert_array_equal(group[48:64], 3)
    np.testing.assert_array_equal(member[48:64], np.arange(16) < 1)
    spans = np.asarray(GG.in_spans(jnp.asarray([3, 0, 17, 1], jnp.int32), 80, 16))
    np.testing.assert_array_equal(spans, np.arange(80) < 64)  # padding in, past the last span out


def test_groups_sharded_with_their_experts():
    """On 4 fake devices: B's experts (group_axis 0) or out's groups (group_axis 1) split over "ep" give the
    one-device result bit for bit; rows are combined by one all-reduce, group slices need none. wgrad's span
    operand keeps its columns split and gathers split rows."""
    here = pathlib.Path(__file__).resolve().parents[1] / "multidevice"
    proc = run_on_fake_devices([here / "grouped_gemm_multidevice.py"], devices=4, cwd=here)
    cases = {c["case"]: c for c in map(json.loads, (l for l in proc.stdout.splitlines() if l.startswith("{")))}
    assert set(cases) == {"fp8:rows", "fp8:spans", "block:rows", "block:spans", "bf16:rows", "bf16:spans",
                          "spans_t:cols", "spans_t:rows", "spans_t:explicit_cols", "spans_t:explicit_rows"}, \
        proc.stderr[-4000:]
    for name, case in cases.items():
        assert case["equal"], case
        if name.endswith("cols"):  # the columns stay split (Auto and Explicit meshes): out's rows, nothing exchanged
            assert case["spec"] == "P('ep', None)" and not any(case["collectives"].values()), case
        elif name.startswith("spans_t"):  # the rows are gathered once
            assert case["collectives"]["all-gather"] == 1 and case["collectives"]["all-reduce"] == 0, case
        elif name.endswith("rows"):
            assert case["collectives"]["all-reduce"] == 1 and case["spec"] == "P()", case
        else:
            assert case["collectives"]["all-reduce"] == 0 and case["spec"] == "P('ep', None, None)", case
