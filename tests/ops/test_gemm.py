"""GEMM op: custom calls vs float64 products of the dequantized operands and vs the reference twin.

Accuracy bounds are per platform (docs/gemm_ffi.md, "Accuracy"; ``_tol``): the
CPU handler accumulates in float32 (relative error <= 1e-5); cuBLASLt's FP8
kernels on a GPU meet 1e-3 with split accumulation (and in the Float8 block
mode) and 1e-2 with fast accumulation; the sm_90 MXFP8/NVFP4 emulation (a
bfloat16 GEMM with float32 accumulation) meets 1e-5.
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.ops import gemm as G
from te_jax.ops import gemm_call
from te_jax.ops import quantize as qops
from te_jax.quantize import CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_jax.spec import numerics as nm
from te_jax.spec import reference as ref
from te_jax.ops.dequantize import dequantize, dequantize_colwise

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
ON_CPU = jax.default_backend() == "cpu"
ON_GPU = jax.default_backend() == "gpu"
HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
# An odd M on CPU; cuBLASLt (GPU) needs M to be a multiple of 16 (a clear error otherwise, tested below).
M, N, K = (33 if ON_CPU else 48), 128, 256
MODES = ["fp8_e4m3xe4m3", "fp8_e4m3xe5m2", "fp8_e5m2xe4m3", "block_1x128x128x128", "block_1x128x1x128", "mxfp8",
         "nvfp4", "nvfp4_rht"]


def _tol(mode: str, fast_accum: bool = True) -> float:
    """The handler's relative-error bound for ``mode`` (a MODES or DENSE name) on this platform."""
    if ON_CPU:
        return 1e-5  # float32 products and accumulation
    if mode.startswith(("mxfp8", "nvfp4")):
        return 1e-5 if HOPPER else 1e-3  # sm_90: bfloat16 emulation, float32 accumulation; sm_100: native
    if mode.startswith("block"):
        return 1e-3  # cuBLASLt's block-scaled kernels promote every 128-long K block: fast_accum has no effect
    return 1e-2 if fast_accum else 1e-3  # per-tensor FP8: fast vs split accumulation


def _rng(*names) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(names).encode()))


def _data(rng, rows: int, cols: int) -> jax.Array:
    """Rows of very different magnitudes, one all-zero row, and outliers."""
    x = rng.normal(size=(rows, cols)) * np.exp(rng.uniform(-2, 2, size=(rows, 1)))
    x[1] = 0.0
    x[2, :4] = [40.0, -40.0, 1e-3, 25.0]
    return jnp.asarray(x, jnp.float32)


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _operands(mode: str, rng, m: int = M, n: int = N, k: int = K):
    """(call(bias, out_dtype, backend, fast_accum, **extra), dequantized A [m, k], dequantized B [n, k]) for one mode.

    ``fast_accum`` applies to the per-tensor modes only (None: the function's default); ``extra`` goes to the
    mode's function as it is.
    """
    x, w = _data(rng, m, k), _data(rng, n, k)
    if mode.startswith("fp8"):
        da, db = {"fp8_e4m3xe4m3": (E4, E4), "fp8_e4m3xe5m2": (E4, E5), "fp8_e5m2xe4m3": (E5, E4)}[mode]
        # A fixed scale that maps 8 to fp8_max: the outliers saturate.
        qa, _, _, sa = qops.quantize_fp8_tensor(x, jnp.full((1,), nm.fp8_max(da) / 8), qdtype=da)
        qb, _, _, sb = qops.quantize_fp8_tensor(w, jnp.full((1,), nm.fp8_max(db) / 8), qdtype=db)
        args, fn, kw = (qa, qb, sa, sb), G.gemm_fp8, {}
        deq = (ref.dequantize_fp8_tensor(qa, sa), ref.dequantize_fp8_tensor(qb, sb))
    elif mode.startswith("block"):
        b2d = mode == "block_1x128x128x128"
        qa, sa, _, _ = qops.quantize_fp8_block(x)
        qb, sb, _, _ = qops.quantize_fp8_block(w, block_2d=b2d)
        args, fn, kw = (qa, sa, qb, sb), G.gemm_fp8_block, dict(b_block_2d=b2d)
        deq = (ref.dequantize_fp8_block(qa, sa), ref.dequantize_fp8_block(qb, sb, block_2d=b2d))
    elif mode == "mxfp8":
        qa, sa, _, _ = qops.quantize_mxfp8(x)
        qb, sb, _, _ = qops.quantize_mxfp8(w, qdtype=E5)
        args, fn, kw = (qa, sa, qb, sb), G.gemm_mxfp8, {}
        deq = (ref.dequantize_mxfp8(qa, sa), ref.dequantize_mxfp8(qb, sb))
    elif mode == "nvfp4":
        qa, sa, _, _, aa, _ = qops.quantize_nvfp4(x)
        qb, sb, _, _, ab, _ = qops.quantize_nvfp4(w, block_2d=True)
        args, fn, kw = (qa, sa, aa, qb, sb, ab), G.gemm_nvfp4, {}
        deq = (ref.dequantize_nvfp4(qa, sa, aa), ref.dequantize_nvfp4(qb, sb, ab))
    else:  # wgrad-style operands: the Hadamard-transformed columnwise copies of x^T [K, M] and w^T [K, N]
        _, _, qa, sa, _, aa = qops.quantize_nvfp4(x.T, rowwise=False, colwise=True, rht=True)
        _, _, qb, sb, _, ab = qops.quantize_nvfp4(w.T, rowwise=False, colwise=True, rht=True)
        args, fn, kw = (qa, sa, aa, qb, sb, ab), G.gemm_nvfp4, {}
        deq = (ref.dequantize_nvfp4(qa, sa, aa), ref.dequantize_nvfp4(qb, sb, ab))

    def call(bias=None, out_dtype=F32, backend=None, fast_accum=None, **extra):
        accum = {} if fast_accum is None else dict(fast_accum=fast_accum)
        return fn(*args, bias, out_dtype=out_dtype, backend=backend, **accum, **extra, **kw)

    return call, _f64(deq[0]), _f64(deq[1])


def _rel(got, want) -> float:
    return float(np.linalg.norm(_f64(got) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_matches_float64_and_reference(mode, out_dtype, with_bias):
    rng = _rng(mode, str(out_dtype), with_bias)
    call, a, b = _operands(mode, rng)
    bias = jnp.asarray(rng.normal(size=(N,)), out_dtype) if with_bias else None
    want = a @ b.T + (_f64(bias) if with_bias else 0.0)
    out, twin = call(bias, out_dtype, "ffi"), call(bias, out_dtype, "reference")
    assert out.shape == twin.shape == (M, N) and out.dtype == twin.dtype == out_dtype
    scale, tol = np.abs(want).max(), _tol(mode)  # the default fast_accum=True
    if out_dtype == F32:
        assert _rel(out, want) <= tol
        np.testing.assert_allclose(_f64(out), _f64(twin), rtol=tol, atol=(1e-6 if tol <= 1e-5 else tol) * scale)
    else:  # one rounding to the output type (give or take an ulp from summation order) plus the accumulation bound
        ulp = 2.0**-7 if out_dtype == BF16 else 2.0**-10
        np.testing.assert_allclose(_f64(out), want, rtol=ulp, atol=tol * scale)
        np.testing.assert_allclose(_f64(out), _f64(twin), rtol=ulp, atol=tol * scale)


@pytest.mark.parametrize(("mode", "fast_accum"), [("fp8_e4m3xe4m3", True), ("fp8_e4m3xe4m3", False),
                                                  ("fp8_e5m2xe4m3", True), ("fp8_e5m2xe4m3", False),
                                                  ("block_1x128x128x128", None), ("block_1x128x1x128", None)])
def test_accumulation_bounds(mode, fast_accum):
    """A long contraction: on a GPU, split accumulation (and the block mode, which always promotes and has no
    fast_accum) must meet 1e-3, fast accumulation 1e-2; the CPU always meets 1e-5."""
    call, a, b = _operands(mode, _rng("accum", mode), m=64, n=128, k=4096)
    err = _rel(call(out_dtype=F32, fast_accum=fast_accum), a @ b.T)
    assert err <= _tol(mode, fast_accum is not False), f"relative error {err:.3g} with fast_accum={fast_accum}"


def test_rht_transforms_cancel():
    call, a, b = _operands("nvfp4_rht", _rng("rht"))
    undo = lambda v: _f64(nm.inverse_rht16(jnp.asarray(v, jnp.float32)))  # noqa: E731
    assert _rel(call(), undo(a) @ undo(b).T) <= _tol("nvfp4_rht")


# ---- errors --------------------------------------------------------------------------


def _cpu_device():
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        pytest.skip("the CPU backend is not available (JAX_PLATFORMS excludes cpu)")


def _raw(target: str, *args, out_shape, **attrs):
    """The custom call itself, on the CPU device: the CPU handler's own validation, on every platform.

    (On CUDA the handler checks cuBLASLt's 16-element alignment first; see test_cuda_handler_validation.)
    """
    cpu = _cpu_device()
    results = (jax.ShapeDtypeStruct(out_shape, jnp.float32), jax.ShapeDtypeStruct((0,), jnp.uint8))
    with jax.default_device(cpu):
        args = jax.device_put(args, cpu)
        return jax.ffi.ffi_call(target, results)(*args, **_gemm_attrs(target), **attrs)[0].block_until_ready()


def _gemm_attrs(target: str) -> dict:
    """The attributes every call of ``target`` takes besides its own: autotune, and fast_accum on te_jax_gemm_fp8."""
    return dict(autotune=False, **(dict(fast_accum=True) if target == "te_jax_gemm_fp8" else {}))


def _raw_gpu(target: str, *args, out_shape, workspace: int = 0, **attrs):
    """The custom call on the default (GPU) device, with a workspace of `workspace` bytes."""
    results = (jax.ShapeDtypeStruct(out_shape, jnp.float32), jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    return jax.ffi.ffi_call(target, results)(*args, **_gemm_attrs(target), **attrs)[0].block_until_ready()


def test_e5m2_x_e5m2_is_refused():
    q = jnp.zeros((4, 32), E5)
    one = jnp.ones((1,), jnp.float32)
    with pytest.raises(TypeError, match="te_jax: E5M2 x E5M2"):
        G.gemm_fp8(q, q, one, one)
    with pytest.raises(TypeError, match="te_jax: E5M2 x E5M2"):
        G.gemm_mxfp8(q, jnp.zeros((4, 1), jnp.uint8), q, jnp.zeros((4, 1), jnp.uint8))
    x = jnp.ones((32, 32), jnp.float32)
    xq = CurrentScalingQuantizer(E5).quantize(x)
    wq = CurrentScalingQuantizer(E5).quantize(x, colwise=True)
    with pytest.raises(TypeError, match="te_jax: E5M2 x E5M2"):
        G.gemm(xq, wq)
    with pytest.raises(jax.errors.JaxRuntimeError, match="te_jax: te_jax_gemm_fp8: E5M2 x E5M2"):
        _raw("te_jax_gemm_fp8", q, q, one, one, jnp.zeros((0,), jnp.float32), out_shape=(4, 4))


def test_k_not_a_block_multiple():
    """A partial last K block needs its own scale (ceil(K / block) of them); the op zero pads the codes."""
    q, s = jnp.zeros((4, 48), E4), jnp.zeros((4, 1), jnp.uint8)
    with pytest.raises(ValueError, match=re.escape("te_jax: a_s must be uint8[4, 2], got uint8[4, 1]")):
        G.gemm_mxfp8(q, s, q, s)
    with pytest.raises(ValueError, match=re.escape("te_jax: a_s must be float32[4, 1], got float32[4, 2]")):
        G.gemm_fp8_block(q, jnp.ones((4, 2), F32), q, jnp.ones((4, 1), F32))
    codes = jnp.asarray(_rng("k48").normal(size=(4, 48)), E4)
    s2 = jnp.full((4, 2), 127, jnp.uint8)  # E8M0 1.0
    want = np.asarray(codes, np.float64) @ np.asarray(codes, np.float64).T
    np.testing.assert_allclose(G.gemm_mxfp8(codes, s2, codes, s2, out_dtype=F32), want, rtol=1e-6)
    with pytest.raises(jax.errors.JaxRuntimeError, match="K \\(48\\) must be a multiple of the block size 32"):
        _raw("te_jax_gemm_mxfp8", q, s, q, s, jnp.zeros((0,), jnp.float32), out_shape=(4, 4))


def test_bad_scales_and_bias():
    q, s = jnp.zeros((4, 64), E4), jnp.zeros((4, 2), jnp.uint8)
    with pytest.raises(ValueError, match=re.escape("te_jax: b_s must be uint8[4, 2], got uint8[4, 3]")):
        G.gemm_mxfp8(q, s, q, jnp.zeros((4, 3), jnp.uint8))
    with pytest.raises(ValueError, match=re.escape("te_jax: bias must be [N] = [4]")):
        G.gemm_mxfp8(q, s, q, s, jnp.zeros((5,)))
    q128, s128 = jnp.zeros((128, 128), E4), jnp.ones((1, 1), jnp.float32)
    with pytest.raises(ValueError, match="te_jax: 128x128 x 128x128"):
        G.gemm_fp8_block(q128, s128, q128, s128, a_block_2d=True, b_block_2d=True)
    no_bias = jnp.zeros((0,), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("a_s must be [4, 2], got [4, 3]")):
        _raw("te_jax_gemm_mxfp8", q, jnp.zeros((4, 3), jnp.uint8), q, s, no_bias, out_shape=(4, 4))
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("bias must be [N] = [4] or empty [0], got [5]")):
        _raw("te_jax_gemm_mxfp8", q, s, q, s, jnp.zeros((5,), jnp.float32), out_shape=(4, 4))
    with pytest.raises(jax.errors.JaxRuntimeError, match="128x128 x 128x128 block scaling is not supported"):
        _raw("te_jax_gemm_fp8_block", q128, s128, q128, s128, no_bias, out_shape=(128, 128), a_block_2d=True,
             b_block_2d=True)


def test_operand_errors():
    x, w = jnp.ones((128, 64), jnp.float32), jnp.ones((64, 128), jnp.float32)
    with pytest.raises(ValueError, match="te_jax: both GEMM operands must use one scaling mode"):
        G.gemm(MXFP8Quantizer().quantize(x), CurrentScalingQuantizer().quantize(w, colwise=True))
    with pytest.raises(ValueError, match="needs the columnwise copy .* quantize it with colwise=True"):
        G.gemm(MXFP8Quantizer().quantize(x), MXFP8Quantizer().quantize(w))
    x3 = CurrentScalingQuantizer().quantize(jnp.ones((4, 8, 64)), colwise=True)
    with pytest.raises(ValueError, match="flatten_axis=2"):
        G.gemm(x3, x3, ((1, 2), (1, 2)))
    xr = NVFP4Quantizer(rht=True).quantize(x, colwise=True)
    xp = NVFP4Quantizer().quantize(x, colwise=True)
    with pytest.raises(ValueError, match="random Hadamard transform"):
        G.gemm(xr, xp, ((0,), (0,)))


# ---- the three GEMMs of a dense layer ------------------------------------------------

DENSE = {  # quantizers of x, W, dy
    "fp8_hybrid": (CurrentScalingQuantizer(E4), CurrentScalingQuantizer(E4), CurrentScalingQuantizer(E5)),
    "block": (Float8BlockQuantizer(), Float8BlockQuantizer(block_2d=True), Float8BlockQuantizer()),
    "mxfp8": (MXFP8Quantizer(), MXFP8Quantizer(), MXFP8Quantizer(E5)),
    "nvfp4": (NVFP4Quantizer(), NVFP4Quantizer(block_2d=True), NVFP4Quantizer(stochastic_rounding=True)),
    "nvfp4_rht": (NVFP4Quantizer(rht=True), NVFP4Quantizer(block_2d=True),
                  NVFP4Quantizer(rht=True, stochastic_rounding=True)),
}


@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "split"])
@pytest.mark.parametrize("name", DENSE)
def test_dense_fwd_dgrad_wgrad(name, fast_accum):
    rng = _rng("dense", name)
    x = jnp.asarray(rng.normal(size=(2, 64, 256)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(256, 128)) / 16, jnp.float32)
    dy = jnp.asarray(rng.normal(size=(2, 64, 128)), jnp.float32)
    qx, qw, qg = DENSE[name]
    key = jax.random.key(7)
    xq, wq, gq = (q.quantize(t, colwise=True, key=key) for q, t in zip((qx, qw, qg), (x, w, dy)))
    row = lambda t: _f64(dequantize(t))  # noqa: E731
    col = lambda t: _f64(dequantize_colwise(t))  # noqa: E731  ([N, M], Hadamard domain with rht)
    if fast_accum and not name.startswith("fp8"):
        fast_accum = None  # the block modes' default (they refuse True, see test_fast_accum_of_block_modes)
    kw = dict(out_dtype=F32, fast_accum=fast_accum)
    gemms = {
        "fwd": (G.gemm(xq, wq, ((2,), (0,)), **kw), np.einsum("bsh,fh->bsf", row(xq), col(wq)), x @ w),
        "dgrad": (G.gemm(gq, wq, ((2,), (1,)), **kw), np.einsum("bsf,hf->bsh", row(gq), row(wq)), dy @ w.T),
        "wgrad": (G.gemm(xq, gq, ((0, 1), (0, 1)), **kw), col(xq) @ col(gq).T, jnp.einsum("bsh,bsf->hf", x, dy)),
    }
    loose, tol = (0.3 if name.startswith("nvfp4") else 0.1), _tol(name, fast_accum is not False)
    for which, (out, want, exact) in gemms.items():
        assert out.shape == want.shape, which
        assert _rel(out, want) <= tol, which
        assert _rel(out, _f64(exact)) <= loose, which  # and close to the unquantized product


# ---- transformations and the other paths ---------------------------------------------


@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0)], ids=str)
@pytest.mark.parametrize("name", ["fp8_hybrid", "mxfp8", "nvfp4"])
def test_jit_vmap(name, in_axes):
    qx, qw, _ = DENSE[name]
    rng = _rng("vmap", name, in_axes)
    xs = jnp.asarray(rng.normal(size=(3, 32, 128)), jnp.float32)
    ws = jnp.asarray(rng.normal(size=(3, 128, 64)), jnp.float32)

    def f(x, w):
        return G.gemm(qx.quantize(x), qw.quantize(w, rowwise=False, colwise=True), out_dtype=F32)

    xs_in, ws_in = (xs if in_axes[0] == 0 else xs[0]), (ws if in_axes[1] == 0 else ws[0])
    got = jax.jit(jax.vmap(f, in_axes=in_axes))(xs_in, ws_in)
    want = np.stack([f(xs[i] if in_axes[0] == 0 else xs_in, ws[i] if in_axes[1] == 0 else ws_in) for i in range(3)])
    # On a GPU both sides are approximations (possibly with different algorithms) within the bound.
    tol = _tol(name)
    np.testing.assert_allclose(_f64(got), _f64(want), rtol=tol, atol=tol * np.abs(want).max())


def test_leading_axes_and_batch_dims():
    rng = _rng("batch")
    xs = jnp.asarray(rng.normal(size=(3, 32, 128)), jnp.float32)
    ws = jnp.asarray(rng.normal(size=(3, 64, 128)), jnp.float32)
    q = MXFP8Quantizer()
    xq, wq = q.quantize(xs), q.quantize(ws)
    got = jax.jit(lambda a, b: G.gemm(a, b, ((2,), (2,)), ((0,), (0,)), out_dtype=F32))(xq, wq)
    want = np.einsum("bmk,bnk->bmn", _f64(dequantize(xq)), _f64(dequantize(wq)))
    tol = _tol("mxfp8")
    assert got.shape == (3, 32, 64) and _rel(got, want) <= tol
    # The custom call's own leading axes: folded into M with a shared B, or a batched B.
    a, a_s = xq.data.reshape(3, 32, 128), xq.scale_inv.reshape(3, 32, 4)
    b, b_s = wq.data.reshape(3, 64, 128), wq.scale_inv.reshape(3, 64, 4)
    for bb, bs in [(b[0], b_s[0]), (b, b_s)]:
        out = G.gemm_mxfp8(a, a_s, bb, bs, out_dtype=F32)
        twin = _f64(G.gemm_mxfp8(a, a_s, bb, bs, out_dtype=F32, backend="reference"))
        rtol, atol = (1e-5, 1e-4) if tol <= 1e-5 else (tol, tol * np.abs(twin).max())
        np.testing.assert_allclose(_f64(out), twin, rtol=rtol, atol=atol)


def test_per_matrix_scales():
    rng = _rng("per-matrix")
    # Matrices of very different magnitudes, so each one's scale matters (on CUDA: one matmul per matrix,
    # the scales copied into aligned slots).
    mag = np.exp(rng.uniform(-3, 3, size=(4, 1, 1)))
    x, w = jnp.asarray(rng.normal(size=(4, 16, 64)) * mag, F32), jnp.asarray(rng.normal(size=(4, 32, 64)) / mag, F32)
    qx, _, _, _, sx = qops.quantize_fp8_current(x)  # one scale per matrix: [4, 1]
    qw, _, _, _, sw = qops.quantize_fp8_current(w)
    assert sx.shape == sw.shape == (4, 1)
    want = np.einsum("bmk,bnk->bmn", _f64(ref.dequantize_fp8_tensor(qx, sx)), _f64(ref.dequantize_fp8_tensor(qw, sw)))
    shared = np.einsum("bmk,nk->bmn", _f64(ref.dequantize_fp8_tensor(qx, sx)),
                       _f64(ref.dequantize_fp8_tensor(qw[0], sw[0])))
    assert _rel(G.gemm_fp8(qx, qw, sx, sw, out_dtype=F32, backend="reference"), want) <= 1e-5
    for fast_accum in (True, False):
        tol = _tol("fp8", fast_accum)
        got = G.gemm_fp8(qx, qw, sx, sw, out_dtype=F32, fast_accum=fast_accum)
        for i in range(4):  # every matrix, not just the norm of all of them
            assert _rel(got[i], want[i]) <= tol, (i, fast_accum)
        got = jax.jit(lambda a, b, sa, sb: G.gemm_fp8(a, b, sa, sb, out_dtype=F32, fast_accum=fast_accum))(
            qx, qw[0], sx, sw[0])
        for i in range(4):
            assert _rel(got[i], shared[i]) <= tol, (i, fast_accum)
    with pytest.raises(ValueError, match=re.escape("te_jax: b_scale_inv must be float32 [1] or one value per matrix")):
        G.gemm_fp8(qx, qw[0], sx, sw)
    with pytest.raises(jax.errors.JaxRuntimeError, match="a_scale_inv must be float32 \\[1\\] or one value per matrix"):
        _raw("te_jax_gemm_fp8", qx, qw[0], jnp.ones((3,)), sw[0], jnp.zeros((0,)), out_shape=(4, 16, 32))


def test_vmap_bias_and_mixed_batching():
    rng = _rng("vmap-bias")
    xs = jnp.asarray(rng.normal(size=(3, 2, 16, 64)), jnp.float32)
    w, bias = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), jnp.asarray(rng.normal(size=(3, 32)), BF16)
    q = NVFP4Quantizer()

    def f(x, b):  # x: [2, 16, 64], contraction over the last axis; a bias per vmapped element
        return G.gemm(q.quantize(x), q.quantize(w, colwise=True), bias=b, out_dtype=BF16)

    got = jax.jit(jax.vmap(f))(xs, bias)
    want = np.stack([f(xs[i], bias[i]) for i in range(3)])
    assert got.shape == (3, 2, 16, 32)
    np.testing.assert_allclose(_f64(got), _f64(want), rtol=2**-7,
                               atol=max(1e-3, _tol("nvfp4") * np.abs(_f64(want)).max()))


def test_one_or_no_quantized_operand():
    rng = _rng("hp")
    x = jnp.asarray(rng.normal(size=(16, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    xq = CurrentScalingQuantizer().quantize(x)
    got = G.gemm(xq, w, out_dtype=F32, bias=jnp.ones((32,)))
    assert _rel(got, _f64(dequantize(xq)) @ _f64(w) + 1.0) <= 1e-6
    got = G.gemm(x, w, out_dtype=F32)
    assert _rel(got, _f64(x) @ _f64(w)) <= 1e-2


def _lowered_text(fn, *args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_workspace_per_platform():
    a, b, one = jnp.zeros((2, 16, 64), E4), jnp.zeros((32, 64), E4), jnp.ones((1,), jnp.float32)
    s_a, s_b = jnp.zeros((2, 16, 2), jnp.uint8), jnp.zeros((32, 2), jnp.uint8)
    ab, bb = jnp.zeros((2, 16, 128), E4), jnp.zeros((2, 32, 128), E4)
    s_ab, s_bb = jnp.ones((2, 16, 1), F32), jnp.ones((2, 32, 1), F32)
    slots = 256 * (2 + 1)  # a 256-byte scale slot per matrix of A (2) and of B (1)
    cases = [  # (fn, args, workspace bytes on CUDA) per docs/gemm_ffi.md, "Workspace"
        (lambda a, b: G.gemm_fp8(a, b, one, one), (a, b), slots),
        (lambda a, b: G.gemm_mxfp8(a, s_a, b, s_b, out_dtype=F32), (a, b), 2 * (32 + 32) * 64),
        (lambda a, b: G.gemm_mxfp8(a, s_a, b, s_b, out_dtype=F16), (a, b), 2 * 64 * 64 + 4 * 32 * 32),
        (lambda a, b: G.gemm_fp8(a, b, one, one, jnp.zeros((32,)), out_dtype=BF16), (a, b), slots + 4 * 32 * 32),
        (lambda a, b: G.gemm_fp8_block(a, s_ab, b, s_bb), (ab, bb), 4 * (32 + 64) * 1 + 256 * (2 + 2)),
    ]
    for fn, args, scratch in cases:
        assert re.findall(r"tensor<(\d+)xui8>", _lowered_text(fn, *args, platform="cpu")) == ["0"]
        text = _lowered_text(fn, *args, platform="cuda")
        assert re.findall(r"tensor<(\d+)xui8>", text) == [str(32 * 2**20 + scratch + 4096)]
    # The document's examples: MXFP8 8192^3 and 8192x28672x8192 need 256 MiB and 576 MiB of scratch.
    assert G.workspace_bytes("te_jax_gemm_mxfp8", (8192, 8192), (8192, 8192), 8192, BF16) == 288 * 2**20 + 4096
    assert G.workspace_bytes("te_jax_gemm_nvfp4", (8192, 4096), (28672, 4096), 8192, BF16) == 608 * 2**20 + 4104


def test_unaligned_rows_are_padded_for_every_handler():
    """M = N = 33 reach the custom call as 48 (cuBLASLt's 16-aligned rows); aligned operands are not padded."""
    a, s = jnp.zeros((33, 64), E4), jnp.zeros((33, 2), jnp.uint8)
    fn = lambda a, s: G.gemm_mxfp8(a, s, a, s)  # noqa: E731
    for platform in ("cpu", "cuda"):
        text = _lowered_text(fn, a, s, platform=platform)
        assert "stablehlo.pad" in text and "tensor<48x64xf8E4M3FN>" in text
    assert "stablehlo.pad" not in _lowered_text(fn, a[:32], s[:32], platform="cuda")
    lay = gemm_call.Layout("te_jax_gemm_mxfp8", ("a", "a_s", "b", "b_s"), (("autotune", False),), k_block=32)
    with pytest.raises(ValueError, match="te_jax: te_jax_gemm_mxfp8 on CUDA needs M and N to be multiples of 16"):
        _lowered_text(lambda a, s: gemm_call.call(lay, a, s, a, s), a, s, platform="cuda")


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_cuda_handler_validation():
    """The CUDA handlers' own checks, on raw custom calls: alignment first, then dtypes, then the workspace."""
    one, no_bias = jnp.ones((1,), F32), jnp.zeros((0,), F32)
    q = jnp.zeros((4, 32), E4)
    for target, args in [("te_jax_gemm_fp8", (q, q, one, one)),
                         ("te_jax_gemm_mxfp8", (q, jnp.zeros((4, 1), jnp.uint8), q, jnp.zeros((4, 1), jnp.uint8)))]:
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=re.escape(f"{target} with A [4, 32] B [4, 32] (M=4 N=4 K=32 batch=1): cuBLASLt's "
                                           "FP8/FP4 kernels need 16-byte aligned rows, so M, N and K must be "
                                           "multiples of 16")):
            _raw_gpu(target, *args, no_bias, out_shape=(4, 4))
    q5, s5 = jnp.zeros((16, 32), E5), jnp.zeros((16, 1), jnp.uint8)
    for target, args in [("te_jax_gemm_fp8", (q5, q5, one, one)), ("te_jax_gemm_mxfp8", (q5, s5, q5, s5))]:
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=re.escape("E5M2 x E5M2 is not supported (use E4M3 for at least one operand)")):
            _raw_gpu(target, *args, no_bias, out_shape=(16, 16))
    qb, sb = jnp.zeros((16, 128), E4), jnp.ones((16, 1), F32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="the workspace result is too small"):
        _raw_gpu("te_jax_gemm_fp8_block", qb, sb, qb, sb, no_bias, out_shape=(16, 16), a_block_2d=False,
                 b_block_2d=False)


def _gemm_attrs_of(text: str) -> list[dict[str, str]]:
    """fast_accum and autotune of each te_jax GEMM custom call in a lowered program, in program order."""
    calls = re.findall(r"stablehlo\.custom_call @te_jax_gemm_\w+\(.*?\{(.*?)\}", text)
    return [dict(re.findall(r"\b(fast_accum|autotune) = (true|false)", attrs)) for attrs in calls]


@pytest.mark.parametrize("mode", ["fp8_e4m3xe4m3", "block_1x128x1x128", "mxfp8", "nvfp4"])
def test_fast_accum_and_autotune_attributes(mode):
    """fast_accum reaches te_jax_gemm_fp8 only; every GEMM target takes autotune, off unless asked for."""
    call, _, _ = _operands(mode, _rng("attrs", mode))
    fast = {"fast_accum": "true"} if mode.startswith("fp8") else {}
    for autotune in (False, True):
        text = _lowered_text(lambda: call(autotune=autotune), platform="cpu")
        assert _gemm_attrs_of(text) == [{**fast, "autotune": str(autotune).lower()}], text
        # The CPU handler ignores autotune: the same bits either way.
        np.testing.assert_array_equal(np.asarray(call(autotune=autotune)), np.asarray(call()))
    with pytest.raises(TypeError, match="te_jax: GEMM autotune must be True or False, got 1"):
        call(autotune=1)


@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4"])
def test_fast_accum_of_block_modes(name):
    """The block modes always accumulate in float32: gemm refuses fast_accum=True, saying why; None is False."""
    rng = _rng("block_accum", name)
    x, w = jnp.asarray(rng.normal(size=(32, 256)), F32), jnp.asarray(rng.normal(size=(256, 128)), F32)
    qx, qw, _ = DENSE[name]
    xq, wq = qx.quantize(x, key=jax.random.key(1)), qw.quantize(w, colwise=True, key=jax.random.key(2))
    with pytest.raises(ValueError, match=r"fast_accum=True does not apply to \w+ GEMMs: they always accumulate in "
                                         "float32"):
        G.gemm(xq, wq, out_dtype=F32, fast_accum=True)
    default = G.gemm(xq, wq, out_dtype=F32)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(G.gemm(xq, wq, out_dtype=F32, fast_accum=False)))
    text = jax.jit(lambda a, b: G.gemm(a, b, out_dtype=F32, autotune=True)).lower(xq, wq).as_text()
    assert _gemm_attrs_of(text) == [{"autotune": "true"}]
    for fn in (G.gemm_fp8_block, G.gemm_mxfp8, G.gemm_nvfp4):
        assert "fast_accum" not in fn.__code__.co_varnames[:fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]


def test_fast_accum_of_per_tensor_gemm():
    """Per-tensor FP8: fast_accum None means True; it must be a bool."""
    x, w = jnp.ones((16, 32), F32), jnp.ones((32, 16), F32)
    q = CurrentScalingQuantizer(E4)
    xq, wq = q.quantize(x), q.quantize(w, colwise=True)
    for fast, flag in ((None, "true"), (True, "true"), (False, "false")):
        text = jax.jit(lambda a, b: G.gemm(a, b, fast_accum=fast)).lower(xq, wq).as_text()
        assert _gemm_attrs_of(text) == [{"fast_accum": flag, "autotune": "false"}]
    with pytest.raises(TypeError, match="te_jax: GEMM fast_accum must be True or False"):
        G.gemm(xq, wq, fast_accum="yes")
