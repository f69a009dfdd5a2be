"""te_jax.grouped_mlp: the experts' FFN with fused activation casts, against the per-group loop and against the
same FFN written as grouped_dense, activation, grouped_dense."""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import recipe as R
from te_jax.core.dense import DenseQuantizers
from te_jax.core.grouped_dense import grouped_dense, init_state, span_alignment
from te_jax.core.grouped_mlp import grouped_mlp
from te_jax.core.layernorm_mlp import MLPQuantizers

GD = importlib.import_module("te_jax.core.grouped_dense")

G, H, F = 4, 128, 128
SIZES = {"zeros": [70, 0, 90, 20], "empty": [0, 0, 0, 0], "one": [0, 130, 0, 0]}
RECIPES = {"delayed": lambda: R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling,
           "block": R.Float8BlockScaling, "mxfp8": R.MXFP8BlockScaling, "nvfp4": R.NVFP4BlockScaling}
# Relative (norm) bounds against the float32 per-group loop, as in test_grouped_dense (two GEMMs in a row).
TOL = {None: 1e-5, "delayed": 0.1, "current": 0.1, "block": 0.1, "mxfp8": 0.15, "nvfp4": 0.5}


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _quantizers(name):
    if name is None:
        return MLPQuantizers()
    return MLPQuantizers(*(DenseQuantizers.from_recipe(RECIPES[name](), ("moe", g)) for g in ("wi", "wo")))


def _aligned(sizes, align, seed=0, gated=True, bias=False):
    """x in the aligned layout (large values between the groups), weights, biases, the output cotangent."""
    keys = jax.random.split(jax.random.key(seed), 6)
    spans = [-(-m // align) * align for m in sizes]
    rows = np.concatenate([np.arange(m) + s for m, s in zip(sizes, np.cumsum(spans) - spans)]).astype(np.int32)
    m_al = -(-(sum(sizes) + G * (align - 1)) // align) * align
    x = (jax.random.normal(keys[0], (m_al, H)) * 1e3).at[rows].set(jax.random.normal(keys[1], (len(rows), H)) * 2)
    width = 2 * F if gated else F
    wi = jax.random.normal(keys[2], (G, H, width)) / 8
    wo = jax.random.normal(keys[3], (G, F, H)) / 8
    bi = jax.random.normal(keys[4], (G, width)) if bias else None
    bo = jax.random.normal(keys[5], (G, H)) if bias else None
    c = jax.random.normal(jax.random.key(seed + 1), (m_al, H)) * 1e3
    c = c.at[rows].set(jax.random.normal(jax.random.key(seed + 2), (len(rows), H)))
    return x, wi, wo, bi, bo, c, rows


def _act(h, activation):
    return te_jax.ops.norm_act.apply_activation(h, activation)


def _loop(x, wi, wo, bi, bo, rows, sizes, activation):
    """float32 per-group loop over the groups' rows, at HIGHEST precision: y on those rows."""
    out, start = [], 0
    hi = jax.lax.Precision.HIGHEST
    for g, m in enumerate(sizes):
        xg = x[rows[start:start + m]]
        h = jnp.dot(xg, wi[g], precision=hi) + (0 if bi is None else bi[g])
        out.append(jnp.dot(_act(h, activation), wo[g], precision=hi) + (0 if bo is None else bo[g]))
        start += m
    return jnp.concatenate(out)


def _grads(fn, x, wi, wo, bi, bo, c):
    def loss(x, wi, wo, bi, bo):
        y = fn(x, wi, wo, bi, bo)
        return jnp.sum(y.astype(jnp.float32) * c), y

    argnums = (0, 1, 2) if bi is None else (0, 1, 2, 3, 4)
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(x, wi, wo, bi, bo)
    return (y, *grads)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("name", [None, *RECIPES])
def test_matches_the_per_group_loop(name, sizes):
    """y and every gradient within the recipe's bound of the float32 loop; zeros (and zero gradients) in the rows
    between and past the groups, whatever x and dy hold there."""
    q = _quantizers(name)
    align = math.lcm(span_alignment(q.wi), span_alignment(q.wo), 16)
    x, wi, wo, bi, bo, c, rows = _aligned(SIZES[sizes], align, bias=name in (None, "delayed", "block"))
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    state = {g: init_state(getattr(q, g), G) for g in ("wi", "wo")}

    def ours(x, wi, wo, bi, bo):
        return grouped_mlp(x, wi, wo, gs, bi, bo, activation="swiglu", quantizers=q, state=state,
                           key=jax.random.key(3), group_align=align)[0]

    def loop(x, wi, wo, bi, bo):
        return _loop(x, wi, wo, bi, bo, rows, SIZES[sizes], "swiglu")

    with te_jax.train.fp8_state_updates():
        got = _grads(ours, x, wi, wo, bi, bo, c)
    want = _grads(loop, x, wi, wo, bi, bo, c[rows])
    between = np.setdiff1d(np.arange(x.shape[0]), rows)
    assert not np.any(np.asarray(got[0])[between]) and not np.any(np.asarray(got[1])[between])
    pairs = [("y", got[0][rows], want[0]), ("dx", got[1][rows], want[1][rows]), *zip(("dwi", "dwo", "dbi", "dbo"),
                                                                                   got[2:], want[2:])]
    for what, u, v in pairs:
        assert u.shape == v.shape, what
        assert _rel(u, v) < TOL[name] or not np.any(np.asarray(v)), (what, _rel(u, v))
    empty = [g for g, m in enumerate(SIZES[sizes]) if m == 0]
    assert not np.any(np.asarray(got[2])[empty]) and not np.any(np.asarray(got[3])[empty])


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu", "geglu"])
def test_every_activation_keeps_the_rows_between_groups_zero(activation):
    """Large values in x and dy between the groups reach neither y nor dx, nor the weights' gradients, whatever
    the activation's slope at zero (gelu's is 1/2), and each activation matches the loop."""
    q = _quantizers("current")
    sizes = SIZES["zeros"]
    gated = activation == "geglu"
    x, wi, wo, bi, bo, c, rows = _aligned(sizes, 16, seed=11, gated=gated, bias=True)
    gs = jnp.asarray(sizes, jnp.int32)
    got = _grads(lambda *a: grouped_mlp(*a[:3], gs, *a[3:], activation=activation, quantizers=q,
                                        group_align=16)[0], x, wi, wo, bi, bo, c)
    want = _grads(lambda *a: _loop(*a, rows, sizes, activation), x, wi, wo, bi, bo, c[rows])
    between = np.setdiff1d(np.arange(x.shape[0]), rows)
    assert not np.any(np.asarray(got[0])[between]) and not np.any(np.asarray(got[1])[between])
    for what, u, v in zip(("y", "dx", "dwi", "dwo", "dbi", "dbo"), (got[0][rows], got[1][rows], *got[2:]),
                          (want[0], want[1][rows], *want[2:])):
        # relu's gradient jumps at zero: FP8 rounding of h moves some small h across it.
        assert _rel(u, v) < (0.25 if activation == "relu" else TOL["current"]), (what, _rel(u, v))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_matches_grouped_dense_activation_grouped_dense(name, activation):
    """The fused activation casts change only where the activation (and its gradient) is rounded: the same FFN
    written as grouped_dense, XLA's activation, grouped_dense agrees to a few FP8 steps, and the state update
    (amaxes of every role) to one bfloat16 rounding of the activation's amax."""
    q = _quantizers(name)
    align = math.lcm(span_alignment(q.wi), span_alignment(q.wo))
    sizes = SIZES["zeros"]
    x, wi, wo, _, _, c, rows = _aligned(sizes, align, seed=4, gated=activation == "swiglu")
    x, wi, wo, c = (t.astype(jnp.bfloat16) for t in (x, wi, wo, c))
    gs = jnp.asarray(sizes, jnp.int32)
    state = {g: init_state(getattr(q, g), G) for g in ("wi", "wo")}

    def ours(x, wi, wo, bi, bo):
        return grouped_mlp(x, wi, wo, gs, activation=activation, quantizers=q, state=state, group_align=align)[0]

    def composed(x, wi, wo, bi, bo):
        h, _ = grouped_dense(x, wi, gs, quantizers=q.wi, state=state["wi"], group_align=align)
        y, _ = grouped_dense(_act(h, activation), wo, gs, quantizers=q.wo, state=state["wo"], group_align=align)
        return y

    with te_jax.train.fp8_state_updates():
        got = _grads(ours, x, wi, wo, None, None, c)
        want = _grads(composed, x, wi, wo, None, None, c)
    for what, u, v in zip(("y", "dx", "dwi", "dwo"), got, want):
        assert u.dtype == v.dtype == jnp.bfloat16, what
        assert _rel(u.astype(jnp.float32), v.astype(jnp.float32)) < 0.03, (what, _rel(u, v))
    if name == "delayed":
        new = grouped_mlp(x, wi, wo, gs, activation=activation, quantizers=q, state=state, group_align=align)[1]
        h, _ = grouped_dense(x, wi, gs, quantizers=q.wi, state=state["wi"], group_align=align)
        a_amax = float(jnp.max(jnp.abs(_act(h, activation).astype(jnp.float32))))
        got_amax = float(new["wo"]["linear_input"]["amax_history"][-1])
        assert abs(got_amax - a_amax) <= 2**-7 * a_amax, (got_amax, a_amax)


def test_high_precision_is_the_composition():
    """Without quantizers: grouped_dense, the activation, grouped_dense (bit for bit)."""
    x, wi, wo, bi, bo, c, rows = _aligned(SIZES["zeros"], 16, seed=7, bias=True)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    got = _grads(lambda *a: grouped_mlp(*a[:3], gs, *a[3:], activation="geglu", group_align=16)[0],
                 x, wi, wo, bi, bo, c)

    def composed(x, wi, wo, bi, bo):
        h, _ = grouped_dense(x, wi, gs, bi, group_align=16)
        return grouped_dense(_act(h, "geglu"), wo, gs, bo, group_align=16)[0]

    for u, v in zip(got, _grads(composed, x, wi, wo, bi, bo, c)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_errors():
    x, wi, wo, _, _, _, _ = _aligned(SIZES["zeros"], 16)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    q = _quantizers("current")
    with pytest.raises(ValueError, match="group_align must be a positive multiple of 16"):
        grouped_mlp(x, wi, wo, gs, activation="swiglu", quantizers=q, group_align=8)
    with pytest.raises(ValueError, match="that divides x's"):
        grouped_mlp(x[:-16 + 1], wi, wo, gs, activation="swiglu", quantizers=q, group_align=16)
    with pytest.raises(ValueError, match="activation must be one of"):
        grouped_mlp(x, wi, wo, gs, activation="tanh", quantizers=q, group_align=16)
    with pytest.raises(ValueError, match=r"wo must be \[G, F, H_out\] with F = 128"):
        grouped_mlp(x, wi, wo[:, :64], gs, activation="swiglu", quantizers=q, group_align=16)
    with pytest.raises(TypeError, match="share the compute dtype"):
        grouped_mlp(x, wi.astype(jnp.bfloat16), wo, gs, activation="swiglu", quantizers=q, group_align=16)
    with pytest.raises(ValueError, match=r"grouped_mlp \(wi\): bias must be \[G, N\] = \[4, 256\]"):
        grouped_mlp(x, wi, wo, gs, jnp.zeros((G, 128)), activation="swiglu", quantizers=q, group_align=16)
    with pytest.raises(TypeError, match=r"grouped_mlp \(wi\): group_sizes must be int32 \[G\] = \[4\]"):
        grouped_mlp(x, wi, wo, gs[:3], activation="swiglu", quantizers=q, group_align=16)
    block = _quantizers("block")
    x128 = jnp.zeros((256, H))
    with pytest.raises(ValueError, match=r"grouped_mlp \(wo\): .*multiple of 128"):  # F = 64: not whole blocks
        grouped_mlp(x128, wi[:, :, :128], wo[:, :64], gs, activation="swiglu", quantizers=block, group_align=128)
    delayed = _quantizers("delayed")
    with pytest.raises(ValueError, match="leading axis of the 4 experts"):
        grouped_mlp(x, wi, wo, gs, activation="swiglu", quantizers=delayed, group_align=16,
                    state={"wi": delayed.wi.init_state(), "wo": init_state(delayed.wo, G)})
