"""Fused LayerNorm/RMSNorm custom calls against their reference twin and float64 numpy.

Bit-exact: a kernel's quantized outputs equal the reference cast of the
float32 output the kernel itself computes (mode "none", float32), and the
statistics do not depend on the mode. To a few ulps: that float32 output and
the statistics against the reference; the backward against jax.grad.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.ops import norm_act as nops
from te_jax.ops.cast import CastSpec
from te_jax.quantize import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from te_jax.spec import reference_norm_act as rna
from te_jax.quantize import fused as qfused
from norm_act_util import (
    CASE_IDS, CASE_SPECS, E4M3, E5M2, F32_NONE, HP, KEY, SCALE, assert_cast_follows_spec, assert_close, kernel,
    random_input, reference, with_rows,
)
from qtest_util import assert_same_bits, on_cpu

KINDS = ["layernorm", "rmsnorm"]


def params(h: int, kind: str, seed: int = 1, zero_centered: bool = False):
    k1, k2 = jax.random.split(jax.random.key(seed))
    gamma = jax.random.normal(k1, (h,), jnp.float32) * (0.3 if zero_centered else 1.0) + (0.0 if zero_centered else 1.0)
    beta = jax.random.normal(k2, (h,), jnp.float32) * 0.5 if kind == "layernorm" else None
    return gamma, beta


def norm_np(x, gamma, beta, kind, eps, zero_centered=False):
    """float64 numpy layernorm / rmsnorm."""
    x = np.asarray(x, np.float64)
    w = np.asarray(gamma, np.float64) + (1.0 if zero_centered else 0.0)
    if kind == "layernorm":
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        y = (x - mean) / np.sqrt(var + eps) * w + (0.0 if beta is None else np.asarray(beta, np.float64))
        return y, mean[..., 0], 1 / np.sqrt(var[..., 0] + eps)
    ms = (x * x).mean(-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w, None, 1 / np.sqrt(ms[..., 0] + eps)


def y_tol(x, mean, rsigma, gamma, zero_centered=False, ulps=16):
    """Forward error bound of the float32 norm: ulps * eps * rsigma |w| (|x| + |mean|)."""
    x = np.abs(np.asarray(x, np.float64))
    m = 0.0 if mean is None else np.abs(np.asarray(mean, np.float64))[..., None]
    w = np.abs(np.asarray(gamma, np.float64) + (1.0 if zero_centered else 0.0))
    return ulps * 2.0**-24 * np.asarray(rsigma, np.float64)[..., None] * w * (x + m)


# ---- forward: the cast follows the spec for every mode ------------------------------------


@functools.lru_cache(maxsize=None)
def _fwd_case(kind, dtype):
    """Input, parameters and the kernel's float32 output for the mode tests."""
    x = with_rows(random_input(3, (2, 64, 256), dtype))
    gamma, beta = params(256, kind)
    kw = dict(kind=kind, epsilon=1e-5, zero_centered_gamma=kind == "rmsnorm")
    return x, gamma, beta, kw, kernel(nops.norm_fwd, x, gamma, beta, spec=F32_NONE, **kw)


DTYPE_CASES = ["tensor_both_e5", "current_p2_eps_e5", "mxfp8_both", "block_both", "nvfp4_rht_sr"]
MODE_PARAMS = [(k, jnp.bfloat16, c, s) for k in KINDS for c, s in zip(CASE_IDS, CASE_SPECS)] + [
    ("layernorm", d, c, s) for d in (jnp.float32, jnp.float16) for c, s in zip(CASE_IDS, CASE_SPECS)
    if c in DTYPE_CASES
]


@pytest.mark.parametrize("kind,dtype,case,spec", MODE_PARAMS,
                         ids=[f"{k}-{jnp.dtype(d).name}-{c}" for k, d, c, _ in MODE_PARAMS])
def test_norm_fwd_cast_follows_spec(kind, dtype, case, spec):
    x, gamma, beta, kw, base = _fwd_case(kind, dtype)
    got = kernel(nops.norm_fwd, x, gamma, beta, spec=spec, scale=SCALE, key=KEY, **kw)
    assert_cast_follows_spec(got.cast, base.cast.q, spec)
    assert_same_bits(got.rsigma, base.rsigma, "rsigma")
    if kind == "layernorm":
        assert_same_bits(got.mean, base.mean, "mean")


ODD_CASES = [
    ("none", F32_NONE), ("tensor_both", CastSpec("fp8_tensor", E4M3, True, True)),
    ("current_both", CastSpec("fp8_current", E4M3, True, True)), ("mxfp8_row", CastSpec("mxfp8", E4M3)),
    ("block_row", CastSpec("fp8_block", E4M3, power_2=True)), ("nvfp4_row", CastSpec("nvfp4")),
]


@pytest.mark.parametrize("shape", [(17, 256), (3, 5, 128)], ids=str)
@pytest.mark.parametrize("case", ODD_CASES, ids=[c[0] for c in ODD_CASES])
def test_norm_fwd_odd_row_counts(shape, case):
    _, spec = case
    x = random_input(5, shape, jnp.bfloat16)
    gamma, beta = params(shape[-1], "layernorm")
    base = kernel(nops.norm_fwd, x, gamma, beta, spec=F32_NONE)
    got = kernel(nops.norm_fwd, x, gamma, beta, spec=spec, scale=SCALE, key=KEY)
    assert_cast_follows_spec(got.cast, base.cast.q, spec)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(48, 144), (2, 32, 80)], ids=str)
def test_norm_fwd_per_tensor_partial_tiles(kind, shape):
    """Shapes in 16s that leave the 128x128 tiles of the CUDA cast-transpose pass partial."""
    x = random_input(6, shape, jnp.bfloat16)
    gamma, beta = params(shape[-1], kind)
    base = kernel(nops.norm_fwd, x, gamma, beta, kind=kind, spec=F32_NONE)
    for spec in [CastSpec("fp8_tensor", E4M3, True, True), CastSpec("fp8_current", E5M2, True, True),
                 CastSpec("fp8_tensor", E4M3, False, True)]:
        got = kernel(nops.norm_fwd, x, gamma, beta, kind=kind, spec=spec, scale=SCALE)
        assert_cast_follows_spec(got.cast, base.cast.q, spec)


# Hidden sizes for every CUDA path: a warp per row (1, 2, 4 vectors per
# thread), a thread block per row (1, 2, 4, 8), the generic kernels (H % 8 != 0,
# H > 16384). The CPU handler has one path: there, a small, an odd, a mid and the
# largest size.
CUDA_PATHS = jax.default_backend() == "gpu"
H_CASES = [8, 40, 100, 768, 1000, 2048, 4096, 8192, 12288, 16384, 16392] if CUDA_PATHS else [8, 100, 1000, 16392]


@pytest.mark.parametrize("h", H_CASES)
def test_norm_fwd_hidden_sizes(h):
    rows = 32 if h > 4096 else 48
    x = with_rows(random_input(h, (rows, h), jnp.bfloat16))
    gamma, beta = params(h, "layernorm")
    base = kernel(nops.norm_fwd, x, gamma, beta, spec=F32_NONE)
    want = reference(nops.norm_fwd, x, gamma, beta, spec=F32_NONE)
    assert_close(base.cast.q, want.cast.q, atol=y_tol(x, want.mean, want.rsigma, gamma), what="y")
    specs = [CastSpec("fp8_tensor", E4M3, True, True), CastSpec("fp8_current", E4M3, True, False)]
    if h % 32 == 0:
        specs.append(CastSpec("mxfp8", E4M3, True, False))
    if h % 16 == 0:
        specs.append(CastSpec("nvfp4", None, True, True, rht=True))
    for spec in specs:
        got = kernel(nops.norm_fwd, x, gamma, beta, spec=spec, scale=SCALE, key=KEY)
        assert_cast_follows_spec(got.cast, base.cast.q, spec)


# ---- forward values --------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_fwd_values_match_reference_and_float64(kind, dtype, zero_centered):
    x = with_rows(random_input(11, (96, 320), dtype))
    gamma, beta = params(320, kind, zero_centered=zero_centered)
    kw = dict(kind=kind, epsilon=1e-5, zero_centered_gamma=zero_centered, spec=F32_NONE)
    got = kernel(nops.norm_fwd, x, gamma, beta, **kw)
    want = reference(nops.norm_fwd, x, gamma, beta, **kw)
    tol = y_tol(x, want.mean, want.rsigma, gamma, zero_centered)
    assert_close(got.cast.q, want.cast.q, atol=tol, what="y vs reference")
    assert_close(got.rsigma, want.rsigma, rtol=2.0**-21, scale_tol=0, what="rsigma vs reference")
    if kind == "layernorm":
        assert_close(got.mean, want.mean, rtol=2.0**-21, scale_tol=2.0**-22, what="mean vs reference")
    y64, mean64, rs64 = norm_np(x.astype(jnp.float32), gamma, beta, kind, 1e-5, zero_centered)
    assert_close(got.cast.q, y64, atol=tol, what="y vs float64")
    assert_close(got.rsigma, rs64, rtol=2.0**-20, scale_tol=0, what="rsigma vs float64")
    # the unquantized output in x's dtype is the float32 output rounded once
    low = kernel(nops.norm_fwd, x, gamma, beta, **{**kw, "spec": CastSpec("none")})
    assert_same_bits(low.cast.q, got.cast.q.astype(dtype), "y in x's dtype")


def test_norm_without_beta_and_specials():
    x = random_input(2, (16, 64), jnp.float32).at[3, 5].set(jnp.nan).at[4, 7].set(jnp.inf)
    gamma, _ = params(64, "layernorm")
    got = kernel(nops.norm_fwd, x, gamma, None, spec=F32_NONE)
    want = reference(nops.norm_fwd, x, gamma, None, spec=F32_NONE)
    assert_close(got.cast.q, want.cast.q, atol=y_tol(x, want.mean, want.rsigma, gamma), what="y")
    y = np.asarray(got.cast.q)
    assert np.isnan(y[3]).all() and np.isnan(y[4]).all() and np.isfinite(y[5:]).all()
    spec = CastSpec("fp8_current", E4M3, True, True)
    q = kernel(nops.norm_fwd, x, gamma, None, spec=spec)
    assert_cast_follows_spec(q.cast, got.cast.q, spec)
    assert np.isnan(float(q.cast.amax[0]))


# ---- backward ----------------------------------------------------------------------------


def _ref_loss(kind, zero_centered, eps):
    def loss(x, gamma, beta, dy):
        xf = x.astype(jnp.float32)
        mean, rsigma = rna.norm_stats(xf, kind=kind, epsilon=eps)
        y = rna.norm_apply(xf, mean, rsigma, gamma, beta, kind=kind, zero_centered_gamma=zero_centered)
        return jnp.sum(y * dy.astype(jnp.float32))

    return loss


# The CUDA row kernel's paths: a warp per row (H <= 1024), a block per row with 2, 4 or 8 vectors per
# thread (several rows per group, so its shared-memory ring wraps around), the generic kernels (odd H,
# H > 16384), float32 with the smallest ring. On the CPU: a warp-sized, an odd, a batched and the
# largest shape.
BWD_SHAPES = ([(200, 256), (37, 100), (2, 40, 1024), (130, 4096), (300, 8192), (70, 16384), (24, 16392)]
              if CUDA_PATHS else [(200, 256), (37, 100), (2, 40, 1024), (24, 16392)])
BWD_PARAMS = [(k, jnp.bfloat16, s) for k in KINDS for s in BWD_SHAPES] + [
    (k, d, (64, 256)) for k in KINDS for d in (jnp.float32, jnp.float16)
] + [(k, jnp.float32, s) for k in KINDS for s in ([(90, 8192), (40, 16384)] if CUDA_PATHS else [(40, 16384)])]


@pytest.mark.parametrize("kind,dtype,shape", BWD_PARAMS,
                         ids=[f"{k}-{jnp.dtype(d).name}-{s}" for k, d, s in BWD_PARAMS])
def test_norm_bwd_matches_grad(kind, dtype, shape):
    zc = dtype == jnp.float16
    x = random_input(21, shape, dtype, spread=1.0)
    dy = random_input(22, shape, dtype, spread=1.0)
    gamma, beta = params(shape[-1], kind, zero_centered=zc)
    fwd = kernel(nops.norm_fwd, x, gamma, beta, kind=kind, zero_centered_gamma=zc, epsilon=1e-5)
    dx, dgamma, dbeta = kernel(nops.norm_bwd, dy, x, fwd.mean, fwd.rsigma, gamma, kind=kind, zero_centered_gamma=zc)
    assert dx.dtype == x.dtype and dgamma.dtype == jnp.float32
    argnums = (0, 1, 2) if kind == "layernorm" else (0, 1)
    grads = on_cpu_grad(_ref_loss(kind, zc, 1e-5), argnums, x.astype(jnp.float32), gamma, beta, dy)
    tol = 2.0**-17 if dtype == jnp.float32 else 2.0**-8  # dx is rounded to x's dtype
    assert_close(dx, grads[0], rtol=tol, scale_tol=tol, what="dx")
    assert_close(dgamma, grads[1], rtol=2.0**-16, scale_tol=2.0**-17, what="dgamma")
    if kind == "layernorm":
        assert_close(dbeta, grads[2], rtol=2.0**-16, scale_tol=2.0**-17, what="dbeta")
    else:
        assert dbeta is None
    # the reference twin agrees too
    rdx, rdg, _ = reference(nops.norm_bwd, dy, x, fwd.mean, fwd.rsigma, gamma, kind=kind, zero_centered_gamma=zc)
    assert_close(dx, rdx, rtol=tol, scale_tol=tol, what="dx vs twin")
    assert_close(dgamma, rdg, rtol=2.0**-16, scale_tol=2.0**-17, what="dgamma vs twin")


def on_cpu_grad(loss, argnums, *args):
    return on_cpu(jax.grad(loss, argnums=argnums), *args)


@pytest.mark.parametrize("kind", KINDS)
def test_normalize_is_differentiable(kind):
    x = random_input(4, (4, 6, 128), jnp.float32, spread=1.0)
    gamma, beta = params(128, kind)

    def ours(x, gamma, beta):
        return jnp.sum(jnp.sin(nops.normalize(x, gamma, beta, kind=kind, epsilon=1e-6)))

    def plain(x, gamma, beta):
        mean, rsigma = rna.norm_stats(x, kind=kind, epsilon=1e-6)
        y = rna.norm_apply(x, mean, rsigma, gamma, beta, kind=kind, zero_centered_gamma=False)
        return jnp.sum(jnp.sin(y))

    argnums = (0, 1, 2) if kind == "layernorm" else (0, 1)
    got = jax.jit(jax.grad(ours, argnums))(x, gamma, beta)
    want = jax.jit(jax.grad(plain, argnums))(x, gamma, beta)
    for g, w, n in zip(got, want, ["dx", "dgamma", "dbeta"]):
        assert_close(g, w, rtol=2.0**-16, scale_tol=2.0**-17, what=n)


# ---- quantizers --------------------------------------------------------------------------


QUANTIZERS = [
    ("delayed", DelayedScalingQuantizer(amax_history_len=4)),
    ("current", CurrentScalingQuantizer(power_2_scales=True)),
    ("mxfp8", MXFP8Quantizer()),
    ("block", Float8BlockQuantizer()),
    ("nvfp4", NVFP4Quantizer(rht=True, stochastic_rounding=True)),
    ("block2d_unfused", Float8BlockQuantizer(block_2d=True)),
]


@pytest.mark.parametrize("case", QUANTIZERS, ids=[c[0] for c in QUANTIZERS])
def test_norm_with_quantizer_equals_quantizing_its_output(case):
    _, quantizer = case
    x = random_input(8, (2, 64, 256), jnp.bfloat16)
    gamma, beta = params(256, "layernorm")
    state = quantizer.init_state() if hasattr(quantizer, "init_state") else None
    if state is not None:
        state = {**state, "scale": jnp.full((1,), 2.0, jnp.float32)}

    def fused(x, gamma, beta, state):
        y, mean, rsigma = qfused.norm(x, gamma, beta, quantizer, state, colwise=True, key=KEY)
        return y

    def unfused(x, gamma, beta, state):
        y = nops.norm_fwd(x, gamma, beta, spec=F32_NONE).cast.q.reshape(x.shape)
        return quantizer.quantize(y, state, rowwise=True, colwise=True, key=KEY)

    got, want = jax.jit(fused)(x, gamma, beta, state), jax.jit(unfused)(x, gamma, beta, state)
    assert type(got) is type(want) and got.mode == want.mode and got.shape == want.shape == x.shape
    gl, gt = jax.tree.flatten(got)
    wl, wt = jax.tree.flatten(want)
    assert gt == wt
    for i, (g, w) in enumerate(zip(gl, wl)):
        assert_same_bits(g, w, f"leaf {i}")
    y, _, _ = qfused.norm(x, gamma, beta, None)
    assert y.shape == x.shape and y.dtype == x.dtype


# ---- transformations --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_vmap_equals_per_item_calls(backend):
    x = random_input(9, (3, 32, 64), jnp.bfloat16)
    gammas = jax.random.normal(jax.random.key(1), (3, 64), jnp.float32)
    beta = jnp.full((64,), 0.5, jnp.float32)
    scales = jnp.array([[1.0], [2.0], [4.0]], jnp.float32)
    keys = jax.random.split(jax.random.key(3), 3)

    def f(x, gamma, scale, key):
        a = nops.norm_fwd(x, gamma, beta, spec=CastSpec("fp8_tensor", E4M3, True, True), scale=scale,
                          backend=backend)
        b = nops.norm_fwd(x, gamma, beta, spec=CastSpec("nvfp4", None, True, True, rht=True,
                                                        stochastic_rounding=True), key=key, backend=backend)
        c = nops.norm_bwd(x, x, a.mean, a.rsigma, gamma, backend=backend)
        return (*a.cast, a.mean, a.rsigma, *b.cast, *c)

    batched = jax.jit(jax.vmap(f))(x, gammas, scales, keys)
    for i in range(3):
        single = jax.jit(f)(x[i], gammas[i], scales[i], keys[i])
        for j, (b, s) in enumerate(zip(batched, single)):
            if backend == "ffi":
                assert_same_bits(b[i], s, f"output {j}")
            else:  # XLA may reduce in another order when batched
                assert b[i].shape == s.shape and b[i].dtype == s.dtype
                if s.dtype == jnp.float32 and s.size:
                    assert_close(b[i], s, rtol=2.0**-20, scale_tol=2.0**-20, what=f"output {j}")


def test_backend_switch_and_targets():
    x = jnp.ones((8, 32), jnp.bfloat16)
    g = jnp.ones((32,), jnp.float32)
    f = lambda x: nops.norm_fwd(x, g, None).cast.q  # noqa: E731
    assert "te_jax_norm_fwd" in jax.jit(f).lower(x).as_text()
    assert "te_jax_norm" not in jax.jit(lambda x: nops.norm_fwd(x, g, None, backend="reference").cast.q).lower(x).as_text()


# ---- errors --------------------------------------------------------------------------------


def test_bad_inputs_raise_at_trace_time():
    x = jnp.ones((64, 256), jnp.bfloat16)
    g = jnp.ones((256,), jnp.float32)
    with pytest.raises(ValueError, match=r"gamma must have shape \(256,\)"):
        nops.norm_fwd(x, jnp.ones((128,), jnp.float32))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        nops.norm_fwd(x.astype(E4M3), g)
    with pytest.raises(TypeError, match="floating-point"):
        nops.norm_fwd(jnp.ones((4, 256), jnp.int32), g)
    with pytest.raises(ValueError, match="rmsnorm has no beta"):
        nops.norm_fwd(x, g, g, kind="rmsnorm")
    with pytest.raises(ValueError, match="norm kind"):
        nops.norm_fwd(x, g, kind="batchnorm")
    with pytest.raises(ValueError, match="epsilon"):
        nops.norm_fwd(x, g, epsilon=-1.0)
    with pytest.raises(ValueError, match="whole 1x32 blocks along the last axis"):
        nops.norm_fwd(jnp.ones((64, 48), jnp.bfloat16), jnp.ones((48,), jnp.float32), spec=CastSpec("mxfp8", E4M3))
    with pytest.raises(ValueError, match=r"whole 1x128 blocks along the last axis and the row axis; got shape \(40"):
        nops.norm_fwd(jnp.ones((40, 256), jnp.bfloat16), g, spec=CastSpec("fp8_block", E4M3, True, True))
    with pytest.raises(ValueError, match="no columnwise copy"):
        nops.norm_fwd(x, g, spec=CastSpec("none", None, True, True))
    with pytest.raises(ValueError, match="needs the scale"):
        nops.norm_fwd(x, g, spec=CastSpec("fp8_tensor", E4M3))
    with pytest.raises(ValueError, match="PRNG key"):
        nops.norm_fwd(x, g, spec=CastSpec("nvfp4", stochastic_rounding=True))
    with pytest.raises(ValueError, match="unknown cast mode"):
        nops.norm_fwd(x, g, spec=CastSpec("int8"))
    with pytest.raises(ValueError, match="float8_e4m3fn or jnp.float8_e5m2"):
        nops.norm_fwd(x, g, spec=CastSpec("fp8_current", jnp.int8))
    with pytest.raises(ValueError, match="dy must have x's shape"):
        nops.norm_bwd(jnp.ones((64, 128), jnp.bfloat16), x, jnp.ones(64), jnp.ones(64), g)
    with pytest.raises(ValueError, match="needs the forward's mean"):
        nops.norm_bwd(x, x, None, jnp.ones(64), g)


def test_ffi_handler_rejects_inconsistent_buffers():
    x = jnp.ones((8, 32), jnp.float32)
    f32 = jnp.float32
    sds = jax.ShapeDtypeStruct
    results = (sds((8, 32), f32), *(sds((0,), f32),) * 6, sds((8,), f32), sds((8,), f32))
    call = jax.ffi.ffi_call("te_jax_norm_fwd", results)
    attrs = dict(kind="layernorm", zero_centered_gamma=False, epsilon=np.float32(1e-5),
                 **CastSpec("none", f32).attrs)
    with pytest.raises(Exception, match="gamma: expected 32 elements"):
        jax.block_until_ready(call(x, jnp.ones((16,), f32), jnp.zeros((0,), f32), jnp.ones((1,), f32),
                                   jnp.zeros((2,), jnp.uint32), **attrs))
