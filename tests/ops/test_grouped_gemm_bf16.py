"""The bfloat16 grouped GEMM (te_jax_grouped_gemm_bf16): the CPU handler vs the reference twin and vs a per-group
numpy loop, for its three layouts (forward ``B [G, K, N]``, dgrad ``B [G, N, K]``, wgrad ``A [R, P]``,
``B [R, Q]``), and what it refuses.

The handler and the twin both multiply the bfloat16 values in float32 (in different summation orders) and round
to bfloat16 once, so they agree to one bfloat16 rounding of the output: within 2^-8 of the output's scale. What the
grouping decides (which rows belong to which group, the zero tail, empty groups, the cut) is checked exactly.
"""

from __future__ import annotations

import pathlib
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.ops.grouped import call as grouped_call
from te_jax.ops.grouped import cuda as grouped_cuda
from te_jax.ops.grouped import reference as grouped_reference
from te_jax.ops.grouped import gemm as GG
from te_jax.ops.gemm_call import GemmEmulationWarning
from te_jax.ops.grouped.layout import GroupedLayout

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
G, M, K, N = 4, 96, 64, 48
P, Q = 40, 24  # wgrad: out [G, P, Q]
TOL = 2**-8  # one bfloat16 rounding of the output, relative to its scale

SIZES = {
    "random_with_zeros": [40, 0, 31, 25],
    "all_in_one": [0, 0, M, 0],
    "tail_rows": [20, 5, 0, 31],  # sum < M: the rest is zero (wgrad: rows no group contracts)
    "empty": [0, 0, 0, 0],
    "past_the_rows": [50, 30, 40, 10],  # cut at M: group 2 keeps 16 rows, group 3 none
    "negative": [30, -5, 40, 10],  # a negative size counts as zero
}
LAYOUTS = ["forward", "dgrad", "wgrad"]


@pytest.fixture(autouse=True)
def _on_cpu():
    """Runs on XLA:CPU on every machine (the CUDA kernels are tested in test_grouped_gemm_gpu.py)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _rng(*names) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(names).encode()))


def _bf16(rng, *shape) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(BF16)


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _close(out, want, tol=TOL):
    out, want = _f64(out), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(initial=0.0), 1e-30)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * scale)


def _bounds(sizes, rows):
    """[(begin, end)] of each group's rows, cut at ``rows`` (negative sizes count as zero)."""
    out, start = [], 0
    for m in sizes:
        m = max(m, 0)
        out.append((min(start, rows), min(start + m, rows)))
        start += m
    return out


def _operands(layout: str, seed=0):
    """(a, b, kwargs) of one layout, random bfloat16 data."""
    rng = _rng(layout, seed)
    if layout == "forward":
        return _bf16(rng, M, K), _bf16(rng, G, K, N), dict(group_axis=0, b_kn=True)
    if layout == "dgrad":
        return _bf16(rng, M, K), _bf16(rng, G, N, K), dict(group_axis=0, b_kn=False)
    return _bf16(rng, M, P), _bf16(rng, M, Q), dict(group_axis=1)


def _numpy_loop(layout, a, b, sizes, bias=None):
    """The contract, one group at a time in float64."""
    a, b = _f64(a), _f64(b)
    if layout == "wgrad":
        out = np.zeros((len(sizes), P, Q))
        for g, (lo, hi) in enumerate(_bounds(sizes, a.shape[0])):
            out[g] = a[lo:hi].T @ b[lo:hi]
        return out
    out = np.zeros((a.shape[0], N))
    for g, (lo, hi) in enumerate(_bounds(sizes, a.shape[0])):
        w = b[g] if layout == "forward" else b[g].T  # [K, N]
        out[lo:hi] = a[lo:hi] @ w + (0.0 if bias is None else _f64(bias[g]))
    return out


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference_and_numpy_loop(layout, sizes):
    a, b, kw = _operands(layout)
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    out = GG.grouped_gemm_bf16(a, b, gs, **kw)
    twin = GG.grouped_gemm_bf16(a, b, gs, **kw, backend="reference")
    want = _numpy_loop(layout, a, b, SIZES[sizes])
    assert out.dtype == BF16 and twin.dtype == BF16 and out.shape == twin.shape == want.shape
    _close(out, want)
    _close(out, twin)
    # Exactly zero wherever no group writes: rows past the groups (group_axis 0), empty groups (group_axis 1).
    np.testing.assert_array_equal(_f64(out)[want == 0] == 0, _f64(twin)[want == 0] == 0)
    if layout == "wgrad":
        for g, (lo, hi) in enumerate(_bounds(SIZES[sizes], M)):
            if hi <= lo:
                assert np.all(_f64(out[g]) == 0) and np.all(_f64(twin[g]) == 0)
    else:
        covered = max(hi for _, hi in _bounds(SIZES[sizes], M))
        assert np.all(_f64(out)[covered:] == 0) and np.all(_f64(twin)[covered:] == 0)


@pytest.mark.parametrize("bias_dtype", [BF16, F32])
@pytest.mark.parametrize("layout", ["forward", "dgrad"])
def test_bias_per_group_and_zero_tail(layout, bias_dtype):
    a, b, kw = _operands(layout, seed=1)
    sizes = SIZES["tail_rows"]
    gs = jnp.asarray(sizes, jnp.int32)
    bias = jnp.asarray(_rng("bias").normal(size=(G, N)), jnp.float32).astype(bias_dtype)
    out = GG.grouped_gemm_bf16(a, b, gs, bias, **kw)
    twin = GG.grouped_gemm_bf16(a, b, gs, bias, **kw, backend="reference")
    want = _numpy_loop(layout, a, b, sizes, bias)
    _close(out, want)
    _close(out, twin)
    assert np.all(_f64(out)[sum(sizes):] == 0)


def test_forward_and_dgrad_layouts_agree():
    """b_kn=True with W [G, K, N] equals b_kn=False with the same weight stored [G, N, K], bit for bit."""
    a, w, _ = _operands("forward", seed=2)
    gs = jnp.asarray(SIZES["random_with_zeros"], jnp.int32)
    fwd = GG.grouped_gemm_bf16(a, w, gs, b_kn=True)
    dgrad = GG.grouped_gemm_bf16(a, jnp.swapaxes(w, 1, 2), gs, b_kn=False)
    np.testing.assert_array_equal(_f64(fwd), _f64(dgrad))


def test_under_jit_with_traced_sizes():
    a, b, kw = _operands("wgrad", seed=3)
    f = jax.jit(lambda gs: GG.grouped_gemm_bf16(a, b, gs, **kw))
    for sizes in SIZES.values():
        gs = jnp.asarray(sizes, jnp.int32)
        np.testing.assert_array_equal(_f64(f(gs)), _f64(GG.grouped_gemm_bf16(a, b, gs, **kw)))


def test_errors():
    a, b, _ = _operands("forward")
    gs = jnp.asarray(SIZES["random_with_zeros"], jnp.int32)
    with pytest.raises(TypeError, match="bfloat16 operands"):
        GG.grouped_gemm_bf16(a.astype(F32), b, gs)
    with pytest.raises(TypeError, match="bfloat16 operands"):
        GG.grouped_gemm_bf16(a, b.astype(jnp.float16), gs)
    with pytest.raises(TypeError, match="bfloat16 only"):
        GG.grouped_gemm_bf16(a, b, gs, out_dtype=F32)
    with pytest.raises(TypeError, match="int32"):
        GG.grouped_gemm_bf16(a, b, gs.astype(jnp.int64) if jax.config.jax_enable_x64 else gs.astype(jnp.int16))
    with pytest.raises(ValueError, match=r"B \[G, N, K\] \(b_kn=False\)"):
        GG.grouped_gemm_bf16(a, b, gs, b_kn=False)  # b is [G, K, N] with K != N
    with pytest.raises(ValueError, match="matrices but group_sizes has"):
        GG.grouped_gemm_bf16(a, b[:3], gs)
    with pytest.raises(ValueError, match=r"A \[R, P\] and B \[R, Q\]"):
        GG.grouped_gemm_bf16(a, a[:50], gs, group_axis=1)
    with pytest.raises(ValueError, match="group_axis must be 0"):
        GG.grouped_gemm_bf16(a, b, gs, group_axis=2)
    with pytest.raises(ValueError, match="group_axis=0 only"):
        GG.grouped_gemm_bf16(a, a, gs, jnp.zeros((G, K), BF16), group_axis=1)
    with pytest.raises(ValueError, match=r"bias must be \[G, N\]"):
        GG.grouped_gemm_bf16(a, b, gs, jnp.zeros((G, K), BF16))
    with pytest.raises(TypeError, match="b_kn"):
        GG.grouped_gemm_bf16(a, b, gs, b_kn=1)


def _lay(group_axis, b_kn=False, align=1):
    return GroupedLayout(None, "te_jax_grouped_gemm_bf16", ("a", "b"), group_axis, align,
                         attrs=(("b_kn", b_kn),), out_dtype=BF16)


def test_cuda_checks():
    """What the CUDA lowering refuses (checked here without a GPU): K, N (P, Q) not multiples of 8."""
    grouped_cuda.check_cuda(_lay(0, True), (48, 32), (G, 32, 64))
    grouped_cuda.check_cuda(_lay(0, False), (48, 32), (G, 64, 32))
    grouped_cuda.check_cuda(_lay(1), (100, 40), (100, 24))  # R (the grouped rows) is free
    with pytest.raises(ValueError, match="multiples of 8"):
        grouped_cuda.check_cuda(_lay(0, True), (48, 36), (G, 36, 64))
    with pytest.raises(ValueError, match=r"multiples of 8.*'N': 60"):
        grouped_cuda.check_cuda(_lay(0, True), (48, 32), (G, 32, 60))
    with pytest.raises(ValueError, match=r"multiples of 8.*'N': 60"):
        grouped_cuda.check_cuda(_lay(0, False), (48, 32), (G, 60, 32))
    with pytest.raises(ValueError, match=r"multiples of 8.*'Q': 20"):
        grouped_cuda.check_cuda(_lay(1), (100, 40), (100, 20))
    with pytest.raises(ValueError, match="align 1"):
        grouped_cuda.check_cuda(_lay(1, align=16), (100, 40), (100, 24))
    for axis, b_kn in grouped_cuda.CUDA_BF16_KERNELS:
        assert grouped_cuda.cuda_kernel(_lay(axis, b_kn), BF16, BF16) == _lay(axis, b_kn)
    with pytest.raises(ValueError, match="bfloat16 x bfloat16 -> bfloat16"):
        grouped_cuda.cuda_kernel(_lay(0), F32, BF16)
    assert grouped_cuda.emulation_message(_lay(0), 9.0) is None
    assert grouped_cuda.emulation_message(_lay(0), None) is None
    assert "ragged dot" in grouped_cuda.emulation_message(_lay(1), 10.0)


def test_cuda_kernel_table_matches_the_sources():
    """CUDA_BF16_KERNELS lists exactly TE_JAX_GROUPED_BF16_KERNELS, each instantiated in its own source."""
    csrc = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "cuda"
    header = (csrc / "grouped_gemm.cuh").read_text()
    body = header[header.index("#define TE_JAX_GROUPED_BF16_KERNELS(X)"):].split("\n\n")[0]
    layouts = re.findall(r"X\((\w+)\)", body)
    key = {"kForward": (0, True), "kDgrad": (0, False), "kWgrad": (1, False)}
    assert {key[x] for x in layouts} == grouped_cuda.CUDA_BF16_KERNELS and len(layouts) == 3
    for x in layouts:
        source = csrc / f"grouped_gemm_sm90_bf16_{x[1:].lower()}.cu"
        assert f"TE_JAX_INSTANTIATE_GROUPED_BF16({x})" in source.read_text()


def test_cuda_lowering():
    """Lowered for a GPU (no GPU needed): the custom call with b_kn and no align; a float32 bias passed as is."""
    gs = jnp.asarray([32, 32], jnp.int32)
    a, w = jnp.zeros((64, 128), BF16), jnp.zeros((2, 128, 64), BF16)
    bias = jnp.zeros((2, 64), F32)
    hlo = jax.jit(lambda a, w, b: GG.grouped_gemm_bf16(a, w, gs, b, backend="ffi")).trace(a, w, bias).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "@te_jax_grouped_gemm_bf16(" in hlo and "b_kn = true" in hlo and "align" not in hlo
    assert "-> (tensor<64x64xbf16>" in hlo and "tensor<2x64xf32>" in hlo  # the float32 bias as is
    x, dy = jnp.zeros((64, 128), BF16), jnp.zeros((64, 32), BF16)
    hlo = jax.jit(lambda x, dy: GG.grouped_gemm_bf16(x, dy, gs, group_axis=1, backend="ffi")).trace(x, dy).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "@te_jax_grouped_gemm_bf16(" in hlo and "tensor<2x128x32xbf16>" in hlo


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_emulation_matches_reference(layout):
    """The ragged-dot emulation a non-sm_90 GPU lowers, run here on XLA:CPU."""
    a, b, kw = _operands(layout, seed=4)
    sizes = SIZES["past_the_rows"]
    gs = jnp.asarray(sizes, jnp.int32)
    lay = _lay(kw["group_axis"], kw.get("b_kn", False))
    bias = jnp.zeros((0,), BF16)
    got = grouped_reference.emulate(lay, a, b, gs, bias)
    want = GG.grouped_gemm_bf16(a, b, gs, **kw, backend="reference")
    assert got.dtype == BF16 and got.shape == want.shape
    _close(got, want)


def test_lowering_for_another_gpu_is_the_emulation(monkeypatch):
    """Lowered for a GPU that is not sm_90: the ragged dot, with a GemmEmulationWarning; no custom call."""
    monkeypatch.setattr(grouped_call, "_cuda_compute_capability", lambda: 8.9)
    a, b, kw = _operands("wgrad", seed=5)
    gs = jnp.asarray(SIZES["random_with_zeros"], jnp.int32)
    with pytest.warns(GemmEmulationWarning, match="bfloat16"):
        hlo = jax.jit(lambda a, b: GG.grouped_gemm_bf16(a, b, gs, **kw, backend="ffi")).trace(a, b).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "ragged_dot" in hlo and "custom_call" not in hlo
