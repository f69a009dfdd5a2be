"""The functional ops at the edges flax handles: 0-size axes, rank-1 inputs, float64 outside autocast, the
one meaning of grouped_dense's group_sizes and the block formats' flush thresholds of tiny amaxes (issue 42, points
8, 9, 10 and 12).

Before: 0-size M, K or N raised ``ZeroDivisionError: integer modulo by zero`` (te_jax/ops/gemm.py), a rank-1 x
``te_jax: flatten_axis 0 is out of range``, float64 a TypeError even without quantizers, and negative or
overflowing group sizes gave other rows and weight gradients on the quantized path than on the high-precision one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from qtest_util import BUILTIN_RECIPES, assert_same_bits

import te_jax
from te_jax import recipe as R
from te_jax.core import DenseQuantizers, MLPQuantizers
from te_jax.ops.grouped.layout import valid_group_sizes
from te_jax.quantize import MXFP8Quantizer, NVFP4Quantizer, dequantize
from te_jax.quantize.delayed import DelayedState

pytestmark = pytest.mark.filterwarnings("ignore::te_jax.quantize.fused.UnfusedCastWarning")
RECIPES = {"none": None, **BUILTIN_RECIPES, "nvfp4": R.NVFP4BlockScaling(disable_stochastic_rounding=True)}
# (M, K, N): an empty batch, an empty contraction, no output features; block recipes need K, N multiples of 128
SHAPES = {"M=0": (0, 32, 48), "K=0": (24, 0, 48), "N=0": (24, 32, 0)}
U = 2.0**-24  # float32's unit roundoff
# A float32 dot at DEFAULT precision on XLA:GPU (H100) rounds its operands to TF32, 10 mantissa bits; 2^-10
# bounds that relative rounding even when it truncates (on a CPU the operands stay exact).
TF32 = 2.0**-10


def _dot_error_bound(a, b) -> np.ndarray:
    """The largest error of one float32 product ``a @ b`` (K terms) at DEFAULT precision on any backend:
    operands rounded to TF32 (their products then exact in float32), K roundings of the sum, each at most 2U
    (an accumulator that truncates): ``(2 TF32 + TF32^2 + 2 K U) * (|a| @ |b|)``."""
    a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    return (2 * TF32 + TF32**2 + 2 * a.shape[-1] * U) * (a @ b)


def _assert_within(got, want, bound, what: str) -> None:
    """``|got - want| <= bound`` elementwise; the message names the quantity, its worst element and that bound."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
    if err.size and not np.all(err <= bound):
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"{what}: |got - want| = {err[i]:.4g} at {i} exceeds its rounding bound {bound[i]:.4g} "
                             f"({int(np.sum(err > bound))} of {err.size} elements over; got {np.asarray(got)[i]!r}, "
                             f"want {np.asarray(want)[i]!r})")


def _random(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _grads(op, params, state):
    """``(y, grads of params, new state)``: loss ``sum(y * c)``; a stateful recipe's state updated as training
    updates it (te_jax.train.value_and_grad, apply_fp8_update)."""

    def loss(v):
        y, _ = op(*v["params"], v.get("fp8_meta"))
        return jnp.sum(y * _random(9, y.shape, y.dtype)), y

    variables = {"params": params, **({"fp8_meta": state} if state else {})}
    (_, y), grads = te_jax.train.value_and_grad(loss, has_aux=True)(variables)
    new_state = te_jax.train.apply_fp8_update(state, grads["fp8_meta"]) if state else None
    return y, grads["params"], new_state


def _expected_dense(x, w, b, c):
    """What lax.dot_general's gradients give: y, dx, dw, db for the loss sum(y * c)."""
    y = x @ w + b
    return y, c @ w.T, x.T @ c, c.sum(0)


@pytest.mark.parametrize("name", list(RECIPES))
def test_zero_size_axes_forward_backward_and_state(name):
    """dense, layernorm_dense and layernorm_mlp with M, K or N of size 0: empty outputs, K = 0 gives the bias and
    zero gradients (lax.dot_general's), under every recipe; delayed scaling records amax 0 for the empty tensors
    and keeps their scale."""
    recipe = RECIPES[name]
    q = DenseQuantizers.from_recipe(recipe)
    mq = MLPQuantizers.from_recipe(recipe)
    for label, (m, k, n) in SHAPES.items():
        if name == "block" and (k % 128 or n % 128):
            m, k, n = (m and 8), (k and 128), (n and 128)
        x, w, b = _random(0, (m, k)), _random(1, (k, n)) * 0.1, _random(2, (n,))
        state = q.init_state() if recipe else None
        y, (dx, dw, db), new_state = _grads(lambda x, w, b, s: te_jax.dense(x, w, b, quantizers=q, state=s),
                                            (x, w, b), state)
        want = _expected_dense(x, w, b, _random(9, (m, n)))
        assert y.shape == (m, n) and dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape, label
        if m == 0:  # no rows: zero weight and bias gradients
            assert not np.any(dw) and not np.any(db), label
        elif n == 0:  # no output: zero input gradients
            assert not np.any(dx), label
        else:  # K = 0: y is the bias, the bias gradient the column sums of dy (in any order: 2MU of sum |dy|)
            assert_same_bits(y, want[0], f"{label}: dense y with K = 0 vs the bias")
            c = np.asarray(_random(9, (m, n)), np.float64)
            _assert_within(db, c.sum(0), 2 * m * U * np.abs(c).sum(0), f"{label}: dense bias gradient vs sum(dy)")
        if name == "delayed":
            for role, empty in (("linear_input", m == 0 or k == 0), ("linear_weight", k == 0 or n == 0),
                                ("linear_grad_output", m == 0 or n == 0)):
                old, new = DelayedState.of(state[role]), DelayedState.of(new_state[role])
                assert (new.amax_history[-1] == 0) == empty, (label, role)  # the step's amax, rolled to the end
                if empty:
                    np.testing.assert_array_equal(new.scale, old.scale, err_msg=f"{label} {role}")
        gamma, beta = _random(3, (k,)) + 1, _random(4, (k,))
        y2, grads2, _ = _grads(lambda x, g, be, w, b, s: te_jax.layernorm_dense(x, g, be, w, b, quantizers=q,
                                                                                 state=s),
                               (x, gamma, beta, w, b), state)
        assert y2.shape == (m, n) and [g.shape for g in grads2] == [x.shape, (k,), (k,), w.shape, b.shape], label
        if k == 0:
            np.testing.assert_array_equal(y2, want[0], err_msg=label)
        w2 = _random(5, (n, 16)) * 0.1
        mstate = mq.init_state() if recipe else None
        y3, grads3, _ = _grads(lambda x, g, be, w, b, w2, s: te_jax.layernorm_mlp(
            x, g, be, w, b, w2, None, activation="relu", quantizers=mq, state=s), (x, gamma, beta, w, b, w2),
            mstate if mstate and any(mstate.values()) else None)
        assert y3.shape == (m, 16) and [g.shape for g in grads3] == [x.shape, (k,), (k,), w.shape, b.shape,
                                                                     w2.shape], label
        if k == 0 and recipe is None:  # the first GEMM gives its bias: relu(b) @ w2, a float32 GEMM (TF32 on a GPU)
            h = np.broadcast_to(np.maximum(np.asarray(b, np.float64), 0), (m, n))
            w2_64 = np.asarray(w2, np.float64)
            _assert_within(y3, h @ w2_64, _dot_error_bound(h, w2_64), f"{label}: layernorm_mlp y vs relu(b) @ w2")
        assert all(np.all(np.isfinite(g)) for g in (*grads2, *grads3)), label


@pytest.mark.parametrize("name", ["none", "current", "mxfp8", "delayed"])
def test_grouped_dense_zero_size_axes(name):
    """grouped_dense with M, K or N of size 0 (and empty groups) on both paths: shapes, zeros where flax-like."""
    recipe = RECIPES[name]
    q = DenseQuantizers.from_recipe(recipe)
    for m, k, n, sizes in ((0, 32, 32, [0, 0]), (8, 0, 32, [3, 5]), (8, 32, 0, [3, 5])):
        x, w, b = _random(0, (m, k)), _random(1, (2, k, n)), _random(2, (2, n))
        gs = jnp.asarray(sizes, jnp.int32)
        state = q.init_state(num_groups=2) if recipe else None
        y, (dx, dw, db), _ = _grads(
            lambda x, w, b, s: te_jax.grouped_dense(x, w, gs, b, quantizers=q, state=s), (x, w, b), state or None)
        assert y.shape == (m, n) and dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape
        if k == 0:
            np.testing.assert_array_equal(y, jnp.concatenate([jnp.broadcast_to(b[0], (3, n)),
                                                              jnp.broadcast_to(b[1], (5, n))]))


def test_grouped_dense_without_experts_says_so():
    with pytest.raises(ValueError, match="te_jax: grouped_dense: the kernel has no expert"):
        te_jax.grouped_dense(jnp.ones((4, 8)), jnp.ones((0, 8, 8)), jnp.zeros((0,), jnp.int32))


@pytest.mark.parametrize("name", ["none", "current", "mxfp8", "nvfp4", "delayed"])
def test_rank1_input_is_one_row(name):
    """A rank-1 x (one example) gives a rank-1 output. Quantized, te_jax runs it as the one-row matrix: the same
    bits. Unquantized it is flax's product, ``lax.dot_general`` of the rank-1 x (on a GPU a matrix-vector product,
    another program than the one-row GEMM, which may pick another algorithm and TF32): its bits, and the one-row
    product's within float32 (TF32) rounding."""
    recipe = RECIPES[name]
    q = DenseQuantizers.from_recipe(recipe)
    state = q.init_state() if recipe else None
    x, w, b = _random(0, (64,)), _random(1, (64, 32)), _random(2, (32,))
    y1, s1 = te_jax.dense(x, w, b, quantizers=q, state=state)
    y2, s2 = te_jax.dense(x[None], w, b, quantizers=q, state=state)
    assert y1.shape == (32,) and y2.shape == (1, 32), (y1.shape, y2.shape)
    if recipe is None:
        assert_same_bits(y1, lax.dot_general(x, w, (((0,), (0,)), ((), ()))) + b,
                         "rank-1 y vs flax's lax.dot_general(x, w) + b")
        # each product within its rounding bound of the exact one, plus the bias add's rounding
        bound = 2 * _dot_error_bound(x[None], w)[0] + 2 * U * (np.abs(np.asarray(y1)) + np.abs(np.asarray(y2[0])))
        _assert_within(y1, y2[0], bound, "rank-1 y vs the one-row y (unquantized)")
    else:
        assert_same_bits(y1, y2[0], f"{name}: rank-1 y vs the one-row y")
    assert jax.tree.all(jax.tree.map(np.array_equal, s1, s2)), f"{name}: the rank-1 state differs from the one-row one"


@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_vmap_over_examples_gives_each_examples_own_gradients(name):
    """Per-example gradients: jax.vmap of the gradient of a rank-1 example equals the loop over examples."""
    q = DenseQuantizers.from_recipe(RECIPES[name])
    xs, w = _random(0, (3, 64)), _random(1, (64, 32))

    def grad_w(x):
        return jax.grad(lambda w: jnp.sum(te_jax.dense(x, w, quantizers=q)[0] ** 2))(w)

    batched = jax.jit(jax.vmap(grad_w))(xs)
    for i in range(xs.shape[0]):
        np.testing.assert_allclose(batched[i], jax.jit(grad_w)(xs[i]), rtol=1e-6, atol=1e-6)


def test_float64_outside_autocast_is_flax_and_refused_under_a_recipe():
    """With jax_enable_x64 and no quantizers the ops compute in float64 (lax.dot_general, flax's LayerNorm, jax.nn's
    activations); with quantizers a TypeError says to cast to float32."""
    with jax.enable_x64(True):
        x, w, b = (_random(i, s, jnp.float64) for i, s in enumerate(((4, 16), (16, 8), (8,))))
        gamma, beta = jnp.ones(16, jnp.float64), jnp.zeros(16, jnp.float64)
        y, _ = te_jax.dense(x, w, b)
        assert y.dtype == jnp.float64
        np.testing.assert_array_equal(y, jax.lax.dot_general(x, w, (((1,), (0,)), ((), ()))) + b)
        y, _ = te_jax.layernorm_dense(x, gamma, beta, w, b)
        mu = x.mean(-1, keepdims=True)
        ln = (x - mu) * jax.lax.rsqrt(jnp.maximum(0.0, (x * x).mean(-1, keepdims=True) - mu * mu) + 1e-6)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, ln @ w + b, rtol=1e-12, atol=1e-12)
        y, _ = te_jax.layernorm_mlp(x, gamma, beta, w, b, w.T, None, activation="gelu")
        np.testing.assert_allclose(y, jax.nn.gelu(ln @ w + b, approximate=True) @ w.T, rtol=1e-12, atol=1e-12)
        q = DenseQuantizers.from_recipe(R.Float8CurrentScaling())
        with pytest.raises(TypeError, match=r"te_jax: dense: x is float64, which te_jax.autocast cannot quantize .*"
                                            r"x.astype\(jnp.float32\)"):
            te_jax.dense(x, w.astype(jnp.float32), quantizers=q)


@pytest.mark.parametrize("align", [1, 4])
def test_valid_group_sizes_cuts_at_the_rows_and_counts_negative_as_zero(align):
    rows = 16
    cases = [[3, 5, 8], [-2, 5, 7], [3, 20, 2], [10, 10, 10], [-5, -5, 30], [2**31 - 1, 2**31 - 1, 5], [0, 0, 0]]
    for sizes in cases:
        got = np.asarray(valid_group_sizes(jnp.asarray(sizes, jnp.int32), rows, align))
        start, want = 0, []
        for s in sizes:  # the documented rule, one group after another in Python integers
            s = max(s, 0)
            want.append(min(s, max(rows - start, 0)))
            start += -(-s // align) * align
        assert got.tolist() == want, sizes
        if min(sizes) >= 0 and sum(sizes) <= rows and align == 1:  # sizes that fit come back unchanged
            assert got.tolist() == sizes


@pytest.mark.parametrize("sizes", [[-2, 5, 7], [3, 20, 2], [2**30, 2**30, 5]])
def test_invalid_group_sizes_mean_the_same_on_every_path(sizes):
    """Negative and overflowing group sizes: the quantized path (current scaling) follows the high-precision one
    (same rows in groups, FP8 error only), and both are grouped_dense with the valid sizes: the same y, dx and dw
    bits (the same programs on the same values), and each group's bias gradient the sum of its rows of dy. That
    sum is a scatter-add (the gradient of the bias gather), whose float32 additions an XLA:GPU kernel makes in
    an order that varies from run to run (atomics), so it is checked against the exact sum within the rounding
    of any order, 2 n_g U sum |dy| for a group of n_g rows."""
    m, k, n = 16, 32, 32
    x, w, b = _random(0, (m, k)), _random(1, (3, k, n)) * 0.2, _random(2, (3, n))
    gs = jnp.asarray(sizes, jnp.int32)
    c = _random(9, (m, n))

    def run(q, sizes):
        f = lambda x, w, b: jnp.sum(te_jax.grouped_dense(x, w, sizes, b, quantizers=q)[0] * c)  # noqa: E731
        return te_jax.grouped_dense(x, w, sizes, b, quantizers=q)[0], *jax.grad(f, (0, 1, 2))(x, w, b)

    hp = run(None, gs)
    quantized = run(DenseQuantizers.from_recipe(R.Float8CurrentScaling()), gs)
    in_group = np.abs(np.asarray(hp[0])).sum(1) > 0
    np.testing.assert_array_equal(np.abs(np.asarray(quantized[0])).sum(1) > 0, in_group,
                                  err_msg=f"sizes {sizes}: the quantized path's rows in groups differ")
    for what, got, want in zip(("y", "dx", "dw", "dbias"), quantized, hp):
        err = np.max(np.abs(np.asarray(got) - np.asarray(want))) / (np.max(np.abs(np.asarray(want))) + 1e-30)
        assert err < 0.15, (f"sizes {sizes}: quantized {what} differs from the high-precision one by {err:.3g} of "
                            "its largest value (FP8 error is under 0.15; other rows in a group give over 1)")
    valid = valid_group_sizes(gs, m)
    as_valid = run(None, valid)
    for what, got, want in zip(("y", "dx", "dw"), hp[:3], as_valid[:3]):
        assert_same_bits(got, want, f"sizes {sizes}: high-precision {what} vs with valid_group_sizes {valid}")
    ends = np.cumsum(np.asarray(valid))
    dy = np.asarray(c, np.float64)
    rows = [dy[e - s:e] for s, e in zip(np.asarray(valid), ends)]
    exact = np.stack([r.sum(0) for r in rows])
    bound = np.stack([2 * r.shape[0] * U * np.abs(r).sum(0) for r in rows])
    for what, got in (("as given", hp[3]), ("valid", as_valid[3])):
        _assert_within(got, exact, bound, f"sizes {sizes} ({what}): high-precision bias gradient vs its rows' sum")
    empty = np.asarray(valid) == 0
    for what, dw in (("quantized", quantized[2]), ("high-precision", hp[2])):
        leak = np.abs(np.asarray(dw)[empty]).max(initial=0.0)
        assert leak == 0, f"sizes {sizes}: {what} dw of the empty groups {np.flatnonzero(empty)} is not zero: {leak}"


@pytest.mark.parametrize("quantizer, below, above, error", [
    (MXFP8Quantizer(), 448 * 2.0**-126 * 0.999, 448 * 2.0**-126, 2.0**-4),
    (MXFP8Quantizer(jnp.float8_e5m2), 57344 * 2.0**-126 * 0.999, 57344 * 2.0**-126, 2.0**-3),
    (NVFP4Quantizer(), 1.4e-38, 7.2e-38, 0.25)])
def test_tiny_blocks_flush_to_zero_at_the_documented_amax(quantizer, below, above, error):
    """docs/numerics.md, "Edges": a block whose amax is below the threshold dequantizes to zeros; at the MXFP8
    threshold, or above NVFP4's inaccurate range, it has its format's usual accuracy (half a step of E4M3 / E5M2,
    of E2M1 relative to the block's amax)."""
    blocks = jax.random.uniform(jax.random.key(0), (32, 4, 16), minval=-1, maxval=1)
    x = (blocks / jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)).reshape(32, 64)  # every block's amax is 1
    for amax, flushed in ((below, True), (above, False)):
        scaled = x * jnp.float32(amax)
        got = dequantize(quantizer.quantize(scaled, None, rowwise=True, colwise=False), jnp.float32)
        if flushed:
            assert not np.any(got), amax
        else:
            err = np.abs(np.asarray(got, np.float64) - np.asarray(scaled, np.float64))
            assert np.all(err <= error * np.abs(np.asarray(scaled, np.float64)) + 2.0**-126 + error * amax / 4), amax


# Sizes whose int32 sum overflows included: grouped_mlp cuts them with valid_group_sizes, as grouped_dense does.
@pytest.mark.parametrize("sizes", [[-2, 20, 20], [40, 40, 10], [2**30, 2**30, 5]])
def test_invalid_group_sizes_of_grouped_mlp_mean_the_same_on_every_path(sizes):
    x, wi, wo = _random(0, (64, 32)), _random(1, (3, 32, 32)) * 0.2, _random(2, (3, 32, 32)) * 0.2
    gs = jnp.asarray(sizes, jnp.int32)
    q = MLPQuantizers.from_recipe(R.Float8CurrentScaling())
    hp, quantized = (te_jax.grouped_mlp(x, wi, wo, gs, activation="relu", group_align=32, quantizers=qs)[0]
                     for qs in (None, q))
    np.testing.assert_array_equal(np.abs(np.asarray(quantized)).sum(1) > 0, np.abs(np.asarray(hp)).sum(1) > 0)
    assert np.max(np.abs(np.asarray(quantized - hp))) < 0.15 * np.max(np.abs(np.asarray(hp)))
