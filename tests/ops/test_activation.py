"""Fused activation custom calls against their reference twin and jax.nn.

Bit-exact: a kernel's quantized outputs equal the reference cast of the
float32 output the kernel itself computes (mode "none", float32). To a few
ulps: that float32 output against the reference and jax.nn (tanh and exp
differ by an ulp or two between XLA, libm and CUDA); dx and dbias against
jax.grad.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.ops import norm_act as aops
from te_jax.ops.cast import CastSpec
from te_jax.quantize import CurrentScalingQuantizer, DelayedScalingQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_jax.quantize import fused as qfused
from te_jax.spec import reference_norm_act as rna
from norm_act_util import (
    CASE_IDS, CASE_SPECS, E4M3, E5M2, F32_NONE, KEY, SCALE, assert_cast_follows_spec, assert_close, kernel,
    random_input, reference,
)
from qtest_util import assert_same_bits, on_cpu

ACTS = list(rna.ACTIVATIONS)
SPECS = dict(zip(CASE_IDS, CASE_SPECS))


def jax_nn(x, act):
    """The activation from jax.nn, float32."""
    x = x.astype(jnp.float32)
    if act in rna.GATED:
        f = x.shape[-1] // 2
        a, g = x[..., :f], x[..., f:]
        return (jax.nn.silu(a) if act == "swiglu" else jax.nn.gelu(a, approximate=True)) * g
    return {"gelu": lambda v: jax.nn.gelu(v, approximate=True), "relu": jax.nn.relu, "silu": jax.nn.silu,
            "squared_relu": lambda v: jnp.square(jax.nn.relu(v))}[act](x)


def act_input(seed, shape, dtype=jnp.bfloat16):
    """Values over the activations' interesting range, with zeros and large magnitudes."""
    x = random_input(seed, shape, jnp.float32, spread=2.0)
    x = x.at[..., 0, :3].set(jnp.array([0.0, -0.0, 30.0])[: min(3, shape[-1])]) if shape[-1] >= 3 else x
    return x.astype(dtype)


def val_tol(x, act, like_x=False):
    """Absolute error allowed in the float32 activation (or, ``like_x``, its gradient): a few ulps of
    its inputs' scale."""
    x = np.abs(np.asarray(x, np.float64))
    if act in rna.GATED:
        f = x.shape[-1] // 2
        a, g = x[..., :f], x[..., f:]
        t = 2.0**-20 * (a + 1) * (a + 1) * (g + 1)
        return np.concatenate([t, t], axis=-1) if like_x else t
    return 2.0**-20 * (x + 1) * (x + 1)


# ---- forward -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _fwd_case(act, shape=(2, 64, 256)):
    x = act_input(1, shape)
    return x, kernel(aops.act_fwd, x, act=act, spec=F32_NONE)


FWD_PARAMS = [("gelu", c) for c in CASE_IDS] + [("swiglu", c) for c in CASE_IDS if c != "none_f16"] + [
    (a, c) for a in ("relu", "silu", "squared_relu", "geglu") for c in ("none_bf16", "current_both", "mxfp8_both")
]


@pytest.mark.parametrize("act,case", FWD_PARAMS, ids=[f"{a}-{c}" for a, c in FWD_PARAMS])
def test_act_fwd_cast_follows_spec(act, case):
    spec = SPECS[case]
    x, base = _fwd_case(act)
    got = kernel(aops.act_fwd, x, act=act, spec=spec, scale=SCALE, key=KEY)
    assert_cast_follows_spec(got, base.q, spec)


@pytest.mark.parametrize("act", ACTS)
def test_act_fwd_values_match_reference_and_jax_nn(act):
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
        x = act_input(2, (48, 96), dtype)
        got = kernel(aops.act_fwd, x, act=act, spec=F32_NONE).q
        want = reference(aops.act_fwd, x, act=act, spec=F32_NONE).q
        tol = val_tol(x, act)
        assert_close(got, want, rtol=2.0**-20, scale_tol=0, atol=tol, what=f"{act} {dtype.__name__} vs reference")
        nn = on_cpu(lambda v: jax_nn(v, act), x)
        assert_close(got, nn, rtol=2.0**-20, scale_tol=0, atol=tol, what=f"{act} vs jax.nn")
        low = kernel(aops.act_fwd, x, act=act, spec=CastSpec("none")).q
        assert_same_bits(low, got.astype(dtype), "output in x's dtype")


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("shape", [(17, 96), (3, 5, 64), (33, 200), (16, 20)], ids=str)
def test_act_fwd_odd_shapes(act, shape):
    """Odd row counts, and widths that are not multiples of 8 (the CUDA generic kernel)."""
    x = act_input(3, shape)
    n_out = shape[-1] // 2 if act == "swiglu" else shape[-1]
    base = kernel(aops.act_fwd, x, act=act, spec=F32_NONE)
    specs = [CastSpec("none", jnp.bfloat16), CastSpec("fp8_tensor", E4M3, True, True),
             CastSpec("fp8_current", E5M2, True, True)]
    if n_out % 32 == 0:
        specs.append(CastSpec("mxfp8", E4M3, True, False))
    if n_out % 16 == 0:
        specs.append(CastSpec("nvfp4", None, True, False, stochastic_rounding=True))
    for spec in specs:
        got = kernel(aops.act_fwd, x, act=act, spec=spec, scale=SCALE, key=KEY)
        assert_cast_follows_spec(got, base.q, spec)


def test_act_fwd_dequantized_within_one_step():
    """Per-tensor FP8 of the activation, dequantized, is within one E4M3 step of the reference values."""
    x = act_input(4, (64, 128))
    spec = CastSpec("fp8_current", E4M3, True, False)
    out = kernel(aops.act_fwd, x, act="gelu", spec=spec)
    deq = np.asarray(rna.dequantized(out, spec), np.float64)
    want = np.asarray(reference(aops.act_fwd, x, act="gelu", spec=F32_NONE).q, np.float64)
    scale = float(out.scale[0])
    v = np.abs(want) * scale
    step = np.exp2(np.floor(np.log2(np.maximum(v, 2.0**-6))) - 3) / scale  # E4M3 spacing (subnormal below 2^-6)
    assert np.all(np.abs(deq - want) <= step * 1.0001), np.max(np.abs(deq - want) / step)


# ---- backward ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _bwd_case(act, shape=(2, 64, 256)):
    x = act_input(5, shape)
    n_out = shape[-1] // 2 if act in rna.GATED else shape[-1]
    dy = random_input(6, (*shape[:-1], n_out), jnp.bfloat16, spread=1.0)
    return x, dy, kernel(aops.act_bwd, dy, x, act=act, spec=F32_NONE, dbias=True)


BWD_PARAMS = [("geglu", c) for c in CASE_IDS] + [
    (a, c) for a in ("gelu", "relu", "silu", "squared_relu", "swiglu") for c in ("none_bf16", "tensor_both_e5", "block_both")
]


@pytest.mark.parametrize("act,case", BWD_PARAMS, ids=[f"{a}-{c}" for a, c in BWD_PARAMS])
def test_act_bwd_cast_follows_spec(act, case):
    spec = SPECS[case]
    x, dy, (base, base_db) = _bwd_case(act)
    got, db = kernel(aops.act_bwd, dy, x, act=act, spec=spec, scale=SCALE, key=KEY, dbias=True)
    assert_cast_follows_spec(got, base.q, spec)
    if jax.default_backend() == "cpu":
        assert_same_bits(db, base_db, "dbias does not depend on the mode")
    else:  # the CUDA tile and row kernels sum dbias's partials in different orders
        np.testing.assert_allclose(np.asarray(db), np.asarray(base_db), rtol=1e-5,
                                   atol=1e-6 * float(np.abs(np.asarray(base_db)).max()))


@pytest.mark.parametrize("act", ACTS)
def test_act_bwd_matches_grad(act):
    x = act_input(7, (3, 40, 128), jnp.float32)
    n_out = 64 if act in rna.GATED else 128
    dy = random_input(8, (3, 40, n_out), jnp.float32, spread=1.0)
    out, db = kernel(aops.act_bwd, dy, x, act=act, spec=F32_NONE, dbias=True)
    dx = out.q.reshape(x.shape)
    grad = on_cpu(jax.grad(lambda v, d: jnp.sum(jax_nn(v, act) * d)), x, dy)
    tol = val_tol(x, act, like_x=True) * (np.abs(np.asarray(dy, np.float64)).max() + 1) * 4
    assert_close(dx, grad, rtol=2.0**-19, scale_tol=0, atol=tol, what=f"{act} dx vs jax.grad")
    twin = reference(aops.act_bwd, dy, x, act=act, spec=F32_NONE, dbias=True)
    assert_close(dx, twin[0].q.reshape(x.shape), rtol=2.0**-19, scale_tol=0, atol=tol, what="dx vs twin")
    want_db = np.asarray(dx, np.float64).reshape(-1, x.shape[-1]).sum(0)
    assert_close(db, want_db, rtol=2.0**-18, scale_tol=2.0**-20, what="dbias vs float64 sum of dx")
    # dbias is the column sum of dx, and each dx may be tol away from the twin's (the GPU's gelu and silu
    # are not the CPU's formulas: docs/norm_act.md), so the twin's dbias is within the summed tol.
    db_tol = np.broadcast_to(tol, x.shape).reshape(-1, x.shape[-1]).sum(0)
    assert_close(db, twin[1], rtol=2.0**-18, scale_tol=2.0**-20, atol=db_tol, what="dbias vs twin")


@pytest.mark.parametrize("shape", [(17, 96), (130, 200), (16, 20)], ids=str)
def test_act_bwd_odd_shapes_and_dbias(shape):
    x = act_input(9, shape)
    dy = random_input(10, (shape[0], shape[1] // 2), jnp.bfloat16, spread=1.0)
    base, db = kernel(aops.act_bwd, dy, x, act="swiglu", spec=F32_NONE, dbias=True)
    assert_close(db, np.asarray(base.q, np.float64).sum(0), rtol=2.0**-18, scale_tol=2.0**-20, what="dbias")
    for spec in [CastSpec("fp8_tensor", E5M2, True, True), CastSpec("fp8_current", E4M3, True, True)]:
        got, db2 = kernel(aops.act_bwd, dy, x, act="swiglu", spec=spec, scale=SCALE, dbias=True)
        assert_cast_follows_spec(got, base.q, spec)
        assert_same_bits(db2, db, "dbias")
    _, none_db = kernel(aops.act_bwd, dy, x, act="swiglu", spec=F32_NONE)
    assert none_db is None


@pytest.mark.parametrize("act", ["gelu", "silu", "geglu"])
@pytest.mark.parametrize("shape", [(48, 144), (2, 160, 80)], ids=str)
def test_per_tensor_casts_of_partial_tiles(act, shape):
    """Per-tensor casts of shapes in 16s that leave 128x128 tiles partial (the CUDA cast-transpose
    pass): forward, and backward with dbias, each against the op's own float32 output."""
    x = act_input(12, shape)
    n_out = shape[-1] // 2 if act in rna.GATED else shape[-1]
    dy = random_input(13, (*shape[:-1], n_out), jnp.bfloat16, spread=1.0)
    base = kernel(aops.act_fwd, x, act=act, spec=F32_NONE)
    base_dx, base_db = kernel(aops.act_bwd, dy, x, act=act, spec=F32_NONE, dbias=True)
    for spec in [CastSpec("fp8_tensor", E4M3, True, True), CastSpec("fp8_current", E5M2, True, True),
                 CastSpec("fp8_tensor", E5M2, False, True)]:
        assert_cast_follows_spec(kernel(aops.act_fwd, x, act=act, spec=spec, scale=SCALE), base.q, spec)
        dx, db = kernel(aops.act_bwd, dy, x, act=act, spec=spec, scale=SCALE, dbias=True)
        assert_cast_follows_spec(dx, base_dx.q, spec)
        if jax.default_backend() == "cpu":
            assert_same_bits(db, base_db, "dbias does not depend on the mode")
        else:  # the CUDA kernels sum dbias's partials in different orders
            np.testing.assert_allclose(np.asarray(db), np.asarray(base_db), rtol=1e-5,
                                       atol=1e-6 * float(np.abs(np.asarray(base_db)).max()))


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_apply_activation_is_differentiable(act):
    x = act_input(11, (4, 6, 64), jnp.float32)
    got = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(aops.apply_activation(v, act)))))(x)
    want = on_cpu(jax.grad(lambda v: jnp.sum(jnp.sin(jax_nn(v, act)))), x)
    assert_close(got, want, rtol=2.0**-18, scale_tol=0, atol=val_tol(x, act, like_x=True) * 4, what="grad")


# ---- quantizers --------------------------------------------------------------------------


QUANTIZERS = [
    ("delayed", DelayedScalingQuantizer(dtype=E5M2, amax_history_len=2)),
    ("current", CurrentScalingQuantizer()),
    ("mxfp8", MXFP8Quantizer()),
    ("nvfp4", NVFP4Quantizer(rht=True, stochastic_rounding=True)),
]


@pytest.mark.parametrize("case", QUANTIZERS, ids=[c[0] for c in QUANTIZERS])
def test_activation_with_quantizer_equals_quantizing_its_output(case):
    _, quantizer = case
    x = act_input(12, (2, 32, 128))
    dy = random_input(13, (2, 32, 64), jnp.bfloat16)
    state = quantizer.init_state() if hasattr(quantizer, "init_state") else None

    def fused(x, dy, state):
        y = qfused.activation(x, "geglu", quantizer, state, colwise=True, key=KEY)
        dx, db = qfused.activation_grad(dy, x, "geglu", quantizer, state, dbias=True, colwise=True, key=KEY)
        return y, dx, db

    def unfused(x, dy, state):
        y = aops.act_fwd(x, act="geglu", spec=F32_NONE).q.reshape(*x.shape[:-1], 64)
        dxf, db = aops.act_bwd(dy, x, act="geglu", spec=F32_NONE, dbias=True)
        return (quantizer.quantize(y, state, colwise=True, key=KEY),
                quantizer.quantize(dxf.q.reshape(x.shape), state, colwise=True, key=KEY), db)

    got, want = jax.jit(fused)(x, dy, state), jax.jit(unfused)(x, dy, state)
    gl, gt = jax.tree.flatten(got)
    wl, wt = jax.tree.flatten(want)
    assert gt == wt
    for i, (g, w) in enumerate(zip(gl, wl)):
        assert_same_bits(g, w, f"leaf {i}")
    assert got[0].shape == (2, 32, 64) and got[1].shape == x.shape


# ---- transformations and errors ----------------------------------------------------------


def test_vmap_equals_per_item_calls():
    x = act_input(14, (3, 32, 64))
    dy = random_input(15, (3, 32, 32), jnp.bfloat16)
    scales = jnp.array([[1.0], [2.0], [4.0]], jnp.float32)
    keys = jax.random.split(jax.random.key(3), 3)

    def f(x, dy, scale, key):
        a = aops.act_fwd(x, act="swiglu", spec=CastSpec("fp8_tensor", E4M3, True, True), scale=scale)
        b = aops.act_fwd(x, act="swiglu", spec=CastSpec("nvfp4", None, True, True, rht=True,
                                                         stochastic_rounding=True), key=key)
        c, db = aops.act_bwd(dy, x, act="swiglu", spec=CastSpec("mxfp8", E5M2, True, True), dbias=True)
        return (*a, *b, *c, db)

    batched = jax.jit(jax.vmap(f))(x, dy, scales, keys)
    for i in range(3):
        single = jax.jit(f)(x[i], dy[i], scales[i], keys[i])
        for j, (b, s) in enumerate(zip(batched, single)):
            assert_same_bits(b[i], s, f"output {j}")


def test_bad_inputs_raise_at_trace_time():
    x = jnp.ones((32, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="activation must be one of"):
        aops.act_fwd(x, act="tanh")
    with pytest.raises(ValueError, match="last axis 63 is odd"):
        aops.act_fwd(jnp.ones((32, 63), jnp.bfloat16), act="swiglu")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        aops.act_fwd(x.astype(E4M3), act="gelu")
    with pytest.raises(ValueError, match="whole 1x32 blocks along the last axis"):
        aops.act_fwd(jnp.ones((32, 32), jnp.bfloat16), act="swiglu", spec=CastSpec("mxfp8", E4M3))  # F = 16
    with pytest.raises(ValueError, match=r"whole 1x128 blocks along the row axis; got shape \(32, 64\)"):
        aops.act_fwd(x, act="gelu", spec=CastSpec("fp8_block", E4M3, False, True))
    with pytest.raises(ValueError, match=r"dy must have shape \(32, 32\)"):
        aops.act_bwd(x, x, act="geglu")
    with pytest.raises(ValueError, match="stochastic_rounding apply to the nvfp4"):
        aops.act_fwd(x, act="gelu", spec=CastSpec("mxfp8", E4M3, stochastic_rounding=True))


def test_gated_layout_is_activated_half_first():
    a = jnp.array([[1.0, -2.0]], jnp.float32)
    g = jnp.array([[3.0, 5.0]], jnp.float32)
    y = aops.apply_activation(jnp.concatenate([a, g], axis=-1), "swiglu")
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.nn.silu(a) * g), rtol=1e-6)
