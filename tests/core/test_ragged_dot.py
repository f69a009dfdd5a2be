"""te_jax.ragged_dot: jax.lax.ragged_dot outside autocast (bit for bit), te_jax's grouped GEMMs under a recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from qtest_util import same_bits

import te_jax
from te_jax import recipe as R
from te_jax.core import DenseQuantizers
from te_jax.core.grouped_dense import grouped_dense, init_state
from te_jax.core.ragged_dot import ragged_dot_with_state
from te_jax.quantize import CurrentScalingQuantizer

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
G, M, K, N = 4, 64, 40, 24  # K and N are no multiple of any block: ragged_dot pads them
SIZES = {
    "zeros": [20, 0, 30, 10],  # empty groups, sum < M
    "one": [0, M, 0, 0],  # every row in one group
    "tail": [5, 7, 0, 3],  # most rows past the groups: zeros, zero gradients
    "over": [30, 30, 30, 0],  # sum > M: lax cuts the groups at M
    "empty": [0, 0, 0, 0],
}
# Relative (norm) error bounds against lax.ragged_dot in float32 (y; dlhs and drhs): each format's relative
# rounding error per element, which a K- or M-long sum of random terms keeps (signal and error both grow as the
# square root of the length). E4M3 x E4M3 forward (2^-4 steps, ~0.036 rms each), E5M2 gradients (2^-3 steps)
# times E4M3 operands; MXFP8's power-of-two scales waste up to a bit; NVFP4's E2M1 has 1 mantissa bit.
TOL = {"current": (0.06, 0.1), "block": (0.06, 0.06), "mxfp8": (0.1, 0.1), "nvfp4": (0.3, 0.3),
       "custom": (0.06, 0.1)}


def _custom():
    """Current scaling by module path: the role carries ragged_dot's path=."""
    def qfactory(role):
        assert role.path == ("moe", "wi")
        if role in ("linear_output", "linear_grad_input"):
            return None
        return CurrentScalingQuantizer(E5 if role == "linear_grad_output" else E4)
    return R.CustomRecipe(qfactory)


RECIPES = {"current": R.Float8CurrentScaling, "block": R.Float8BlockScaling, "mxfp8": R.MXFP8BlockScaling,
           "nvfp4": R.NVFP4BlockScaling, "custom": _custom}


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield




def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _data(seed=0, m=M, k=K, n=N, g=G, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(keys[0], (m, k)) * 2).astype(dtype)
    w = (jax.random.normal(keys[1], (g, k, n)) / 4).astype(dtype)
    c = jax.random.normal(keys[2], (m, n))
    return x, w, c


def _fwd_bwd(fn, x, w, c):
    """``(y, dlhs, drhs)`` of ``sum(fn(x, w) * c)``, jitted."""
    def loss(x, w):
        y = fn(x, w)
        return jnp.sum(y.astype(jnp.float32) * c), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    return y, dx, dw


def _under(recipe, fn):
    def run(*args):
        with te_jax.autocast(recipe=recipe):
            return fn(*args)
    return run


# ---- outside autocast: jax.lax.ragged_dot itself -----------------------------------------------------------


@pytest.mark.parametrize("sizes", list(SIZES))
def test_outside_autocast_is_lax_bit_for_bit(sizes):
    x, w, c = _data()
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    got = _fwd_bwd(lambda x, w: te_jax.ragged_dot(x, w, gs), x, w, c)
    want = _fwd_bwd(lambda x, w: lax.ragged_dot(x, w, gs), x, w, c)
    assert all(same_bits(u, v) for u, v in zip(got, want))
    assert te_jax.core.ragged_dot is te_jax.ragged_dot


@pytest.mark.parametrize("dtype,preferred,precision", [(jnp.bfloat16, None, None),
                                                        (jnp.bfloat16, jnp.float32, None),
                                                        (jnp.float32, jnp.bfloat16, lax.Precision.HIGHEST)])
def test_outside_autocast_dtypes_and_arguments_are_lax(dtype, preferred, precision):
    x, w, c = _data(dtype=dtype)
    gs = jnp.asarray(SIZES["zeros"], jnp.uint8)  # any integer dtype, as lax
    got = _fwd_bwd(lambda x, w: te_jax.ragged_dot(x, w, gs, precision, preferred), x, w, c)
    want = _fwd_bwd(lambda x, w: lax.ragged_dot(x, w, gs, precision, preferred), x, w, c)
    assert all(same_bits(u, v) for u, v in zip(got, want))
    with te_jax.autocast(enabled=False, recipe=R.Float8CurrentScaling()):  # a disabled autocast: lax too
        assert same_bits(te_jax.ragged_dot(x, w, gs), lax.ragged_dot(x, w, gs))


@pytest.mark.parametrize("m,k,n,g", [(0, K, N, G), (M, K, N, 1), (M, 0, N, G), (M, K, 0, G)])
def test_outside_autocast_degenerate_shapes_are_lax(m, k, n, g):
    x, w, c = _data(m=m, k=k, n=n, g=g)
    gs = jnp.full((g,), m // g, jnp.int32)
    got = _fwd_bwd(lambda x, w: te_jax.ragged_dot(x, w, gs), x, w, c)
    want = _fwd_bwd(lambda x, w: lax.ragged_dot(x, w, gs), x, w, c)
    assert all(same_bits(u, v) for u, v in zip(got, want))


# ---- under a recipe: te_jax's grouped GEMMs ---------------------------------------------------------------


@pytest.mark.parametrize("name,sizes", [(name, "zeros") for name in RECIPES]
                         + [("current", s) for s in ("one", "tail", "over", "empty")] + [("block", "tail")])
def test_recipe_matches_lax_within_bounds(name, sizes):
    x, w, c = _data(seed=1)
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    fn = _under(RECIPES[name](), lambda x, w: te_jax.ragged_dot(x, w, gs, key=jax.random.key(2), path="moe/wi"))
    got = _fwd_bwd(fn, x, w, c)
    want = _fwd_bwd(lambda x, w: lax.ragged_dot(x, w, gs, precision=lax.Precision.HIGHEST), x, w, c)
    fwd_tol, bwd_tol = TOL[name]
    for what, u, v, tol in zip(("y", "dlhs", "drhs"), got, want, (fwd_tol, bwd_tol, bwd_tol)):
        assert u.shape == v.shape and u.dtype == v.dtype, what
        if np.any(np.asarray(v)):
            assert 1e-4 < _rel(u, v) < tol, (what, _rel(u, v))  # quantized, and within the format's bound
        else:
            assert not np.any(np.asarray(u)), what
    rows = min(sum(SIZES[sizes]), M)
    assert not np.any(np.asarray(got[0])[rows:]) and not np.any(np.asarray(got[1])[rows:])
    empty = [e for e, s in enumerate(SIZES[sizes]) if s == 0 or sum(SIZES[sizes][:e]) >= M]
    assert not np.any(np.asarray(got[2])[empty])


def test_recipe_runs_grouped_dense_bit_for_bit():
    """Where K and N need no padding, te_jax.ragged_dot under a recipe is grouped_dense with its quantizers."""
    x, w, c = _data(seed=3, k=32, n=64)
    gs = jnp.asarray(SIZES["over"], jnp.int32)
    cut = jnp.asarray([30, 30, 4, 0], jnp.int32)  # lax cuts the groups at M; grouped_dense takes sum <= M
    q = DenseQuantizers.from_recipe(R.MXFP8BlockScaling())
    got = _fwd_bwd(_under(R.MXFP8BlockScaling(), lambda x, w: te_jax.ragged_dot(x, w, gs)), x, w, c)
    want = _fwd_bwd(lambda x, w: grouped_dense(x, w, cut, quantizers=q)[0], x, w, c)
    assert all(same_bits(u, v) for u, v in zip(got, want))
    hlo = jax.jit(_under(R.MXFP8BlockScaling(), lambda x, w: te_jax.ragged_dot(x, w, gs))).lower(x, w).as_text()
    assert "te_jax_grouped_gemm" in hlo and "ragged_dot" not in hlo


def test_padding_k_and_n_is_exact():
    """K and N padded with zeros to the block multiple: the same products as operands padded by hand."""
    x, w, c = _data(seed=4)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    rec = R.Float8BlockScaling()
    got = _fwd_bwd(_under(rec, lambda x, w: te_jax.ragged_dot(x, w, gs)), x, w, c)
    xp, wp = jnp.pad(x, ((0, 0), (0, 256 - K))), jnp.pad(w, ((0, 0), (0, 256 - K), (0, 128 - N)))
    cp = jnp.pad(c, ((0, 0), (0, 128 - N)))
    want = _fwd_bwd(_under(rec, lambda x, w: te_jax.ragged_dot(x, w, gs)), xp, wp, cp)
    np.testing.assert_allclose(got[0], want[0][:, :N], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1][:, :K], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2][:, :K, :N], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,preferred", [(jnp.bfloat16, None), (jnp.bfloat16, jnp.float32),
                                             (jnp.float32, jnp.bfloat16)])
def test_recipe_dtypes_follow_lax(dtype, preferred):
    """Output in lax's dtype (preferred_element_type, else the operands'), gradients in the operands' dtypes."""
    x, w, c = _data(seed=5, dtype=dtype)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    got = _fwd_bwd(_under(R.Float8CurrentScaling(), lambda x, w: te_jax.ragged_dot(x, w, gs,
                                                                                   preferred_element_type=preferred)),
                   x, w, c)
    want = _fwd_bwd(lambda x, w: lax.ragged_dot(x, w, gs, preferred_element_type=preferred), x, w, c)
    for u, v in zip(got, want):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert _rel(u, v) < 0.1


def test_wider_preferred_dtype_takes_the_float32_accumulation():
    """bfloat16 operands with preferred_element_type=float32: the grouped GEMM writes float32, not bfloat16 cast."""
    x, w, _ = _data(seed=6, dtype=jnp.bfloat16)
    gs = jnp.asarray(SIZES["one"], jnp.int32)
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        wide = jax.jit(lambda x, w: te_jax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))(x, w)
        narrow = jax.jit(lambda x, w: te_jax.ragged_dot(x, w, gs))(x, w)
    assert wide.dtype == jnp.float32 and narrow.dtype == jnp.bfloat16
    assert not same_bits(wide, narrow.astype(jnp.float32))  # float32 values that bfloat16 cannot hold
    np.testing.assert_allclose(wide, narrow.astype(jnp.float32), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("m,k,n,g", [(0, K, N, G), (M, K, N, 1), (M, 0, N, G), (M, K, 0, G)])
def test_recipe_degenerate_shapes(m, k, n, g):
    """m = 0, k = 0, n = 0: nothing to multiply (lax's zeros); g = 1: every row of the one group quantized."""
    x, w, c = _data(seed=7, m=m, k=k, n=n, g=g)
    gs = jnp.full((g,), m // g, jnp.int32)
    got = _fwd_bwd(_under(R.Float8CurrentScaling(), lambda x, w: te_jax.ragged_dot(x, w, gs)), x, w, c)
    want = _fwd_bwd(lambda x, w: lax.ragged_dot(x, w, gs), x, w, c)
    for u, v in zip(got, want):
        assert u.shape == v.shape and u.dtype == v.dtype
        if np.any(np.asarray(v)):
            assert 1e-4 < _rel(u, v) < 0.1
        else:
            assert not np.any(np.asarray(u))


def test_out_sharding_under_a_recipe():
    """out_sharding (explicit sharding): lax's without a recipe, the quantized result resharded to it with one."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:1])
    x, w, _ = _data(seed=8)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    with jax.set_mesh(mesh):
        want = lax.ragged_dot(x, w, gs, out_sharding=P("x", None))
        assert same_bits(te_jax.ragged_dot(x, w, gs, out_sharding=P("x", None)), want)
        with te_jax.autocast(recipe=R.Float8CurrentScaling()):
            got = jax.jit(lambda x, w: te_jax.ragged_dot(x, w, gs, out_sharding=P("x", None)))(x, w)
    assert got.sharding.spec == want.sharding.spec and _rel(got, want) < 0.06


# ---- state, keys, errors ------------------------------------------------------------------------------------


def test_delayed_scaling_needs_state_and_takes_it_as_the_functional_ops_do():
    x, w, c = _data(seed=9)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    rec = R.DelayedScaling(amax_history_len=4)
    with te_jax.autocast(recipe=rec), pytest.raises(ValueError) as err:
        te_jax.ragged_dot(x, w, gs)
    for part in ("te_jax: ragged_dot", "keeps state", "te_jax.flax.RaggedDot", "te_jax.nnx.RaggedDot",
                 "state=te_jax.core.grouped_dense.init_state"):
        assert part in str(err.value), part
    q = DenseQuantizers.from_recipe(rec)
    with pytest.raises(ValueError, match="te_jax: ragged_dot: the linear_weight state must have a leading axis of "
                                         "the 4 experts"):
        te_jax.ragged_dot(x, w, gs, quantizers=q, state=q.init_state())  # grouped_dense's check, named as this op
    state = init_state(q, G)

    def loss(x, w, s):
        return jnp.sum(te_jax.ragged_dot(x, w, gs, quantizers=q, state=s) * c)

    step = jax.jit(lambda x, w, s: te_jax.train.apply_fp8_update(s, jax.grad(loss, argnums=2)(x, w, s)))
    with te_jax.train.fp8_state_updates():
        for _ in range(2):  # the first step records the amaxes, the second quantizes with their scales
            state = step(x, w, state)
    weight = state["linear_weight"]["amax_history"]
    assert weight.shape == (G, 4)
    amax = jnp.max(jnp.abs(w), axis=(1, 2))
    np.testing.assert_array_equal(weight[:, -2:], jnp.stack([amax, amax], 1))  # one history per expert, 2 steps
    np.testing.assert_allclose(state["linear_weight"]["scale"][:, 0], 448.0 / amax, rtol=1e-6)
    y = jax.jit(lambda x, w, s: te_jax.ragged_dot(x, w, gs, quantizers=q, state=s))(x, w, state)
    want = lax.ragged_dot(x, w, gs, precision=lax.Precision.HIGHEST)
    assert 1e-4 < _rel(y, want) < 0.06
    with pytest.raises(te_jax.train.FP8StateError):  # the state's update needs a caller that applies it
        jax.eval_shape(jax.grad(loss, argnums=2), x, w, state)


def test_stochastic_rounding_needs_a_key():
    x, w, c = _data(seed=10, k=32, n=32)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    with te_jax.autocast(recipe=R.NVFP4BlockScaling()):
        with pytest.raises(ValueError, match=r"te_jax: ragged_dot: .*linear_grad_output.*key=.*quantize.*"
                                             r"disable_stochastic_rounding"):
            te_jax.ragged_dot(x, w, gs)
    rounded = [_fwd_bwd(_under(R.NVFP4BlockScaling(), lambda x, w: te_jax.ragged_dot(x, w, gs, key=key)), x, w, c)
               for key in (jax.random.key(0), jax.random.key(0), jax.random.key(1))]
    assert all(same_bits(u, v) for u, v in zip(rounded[0], rounded[1]))  # the key decides the rounding
    assert same_bits(rounded[0][0], rounded[2][0]) and not same_bits(rounded[0][2], rounded[2][2])
    off = R.NVFP4BlockScaling(disable_stochastic_rounding=True)
    with te_jax.autocast(recipe=off):
        jax.eval_shape(lambda x, w: te_jax.ragged_dot(x, w, gs), x, w)


def test_errors():
    x, w, _ = _data()
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    for recipe in (None, R.Float8CurrentScaling()):
        with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
            with pytest.raises(ValueError, match="te_jax: ragged_dot: group_offset is not supported"):
                te_jax.ragged_dot(x, w, gs, group_offset=jnp.zeros((1,), jnp.int32))
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        with pytest.raises(TypeError, match="te_jax: ragged_dot: under a recipe lhs must be float32"):
            te_jax.ragged_dot(x.astype(jnp.int32), w.astype(jnp.int32), gs)
        with pytest.raises(TypeError):  # lax's own shape check
            te_jax.ragged_dot(x, w[:, :-1], gs)
    with pytest.raises(ValueError, match="te_jax: ragged_dot: inspect"):
        ragged_dot_with_state(x, w, gs, quantizers=DenseQuantizers.from_recipe(R.Float8CurrentScaling()),
                              inspect=True)


# ---- a mixture of experts written with jax.lax.ragged_dot ---------------------------------------------------


def _moe_ffn(x, wi, wo, group_sizes, ragged_dot=lax.ragged_dot):
    """A dropless MoE's expert FFN as model code writes it: rows sorted by expert, two ragged dots."""
    return ragged_dot(jax.nn.gelu(ragged_dot(x, wi, group_sizes)), wo, group_sizes)


@pytest.mark.parametrize("name", ["none", "current", "mxfp8"])
def test_moe_ffn_with_te_jax_swapped_in(name):
    keys = jax.random.split(jax.random.key(11), 4)
    x = jax.random.normal(keys[0], (M, 32))
    wi = jax.random.normal(keys[1], (G, 32, 64)) / 6
    wo = jax.random.normal(keys[2], (G, 64, 32)) / 8
    c = jax.random.normal(keys[3], (M, 32))
    gs = jnp.asarray([16, 0, 40, 8], jnp.int32)

    def loss(params, ragged_dot):
        return jnp.sum(_moe_ffn(x, *params, gs, ragged_dot) * c)

    want_loss, want = jax.jit(jax.value_and_grad(lambda p: loss(p, lax.ragged_dot)))((wi, wo))
    recipe = None if name == "none" else RECIPES[name]()
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
        got_loss, got = jax.jit(jax.value_and_grad(lambda p: loss(p, te_jax.ragged_dot)))((wi, wo))
    if recipe is None:
        assert same_bits(got_loss, want_loss) and all(same_bits(u, v) for u, v in zip(got, want))
    else:
        assert all(1e-4 < _rel(u, v) < 0.15 for u, v in zip(got, want)), [_rel(u, v) for u, v in zip(got, want)]


def test_negative_sizes_stay_in_bounds_under_a_recipe():
    """A negative size (lax's groups then overlap) gives an empty group; no group starts before an earlier one's
    end, so the kernels read and write only the rows they own."""
    x, w, c = _data(seed=12)
    rec = R.Float8CurrentScaling()
    got = _fwd_bwd(_under(rec, lambda x, w: te_jax.ragged_dot(x, w, jnp.asarray([20, -5, 30, 10], jnp.int32))),
                   x, w, c)
    want = _fwd_bwd(_under(rec, lambda x, w: te_jax.ragged_dot(x, w, jnp.asarray([20, 0, 25, 10], jnp.int32))),
                    x, w, c)
    assert all(same_bits(u, v) for u, v in zip(got, want))
