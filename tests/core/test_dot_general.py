"""te_jax.core.dot_general / einsum: lax.dot_general / jnp.einsum unquantized (bit for bit), te_jax's GEMMs
quantized."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import te_jax
from qtest_util import assert_same_bits
from te_jax import recipe as R
from te_jax.core import DenseQuantizers, dot_general, einsum
from te_jax.core.dense import dense

CURRENT = DenseQuantizers.from_recipe(R.Float8CurrentScaling())
DELAYED = DenseQuantizers.from_recipe(R.DelayedScaling(amax_history_len=4))


def _rand(seed: int, shape, dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# (lhs shape, rhs shape, dimension numbers): several, unordered and batch axes, 0-size axes, rank 1, outer products.
LAX_CASES = [
    ((3, 4), (4, 5), (((1,), (0,)), ((), ()))),
    ((2, 3, 4), (4, 3, 5), (((2, 1), (0, 1)), ((), ()))),
    ((2, 3, 4), (2, 4, 5), (((2,), (1,)), ((0,), (0,)))),
    ((3, 2, 4, 6), (6, 4, 2), (((3,), (0,)), ((2, 1), (1, 2)))),
    ((0, 4), (4, 5), (((1,), (0,)), ((), ()))),
    ((3, 0), (0, 5), (((1,), (0,)), ((), ()))),
    ((4,), (4, 5), (((0,), (0,)), ((), ()))),
    ((4,), (4,), (((0,), (0,)), ((), ()))),
    ((3,), (5,), (((), ()), ((), ()))),
    ((2, 3), (2, 5), (((), ()), ((0,), (0,)))),
]


@pytest.mark.parametrize("case", range(len(LAX_CASES)))
def test_unquantized_is_lax_dot_general(case):
    a, b, dn = LAX_CASES[case]
    lhs, rhs = _rand(case, a), _rand(100 + case, b)
    want = lax.dot_general(lhs, rhs, dn)
    got, state = jax.jit(lambda x, w: dot_general(x, w, dn))(lhs, rhs)
    assert_same_bits(got, jax.jit(lambda x, w: lax.dot_general(x, w, dn))(lhs, rhs), str(dn))
    assert got.shape == want.shape and state is None
    # precision and preferred_element_type pass through; a recipe quantizing nothing is the same product
    kw = dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    lb, rb = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    none = DenseQuantizers()
    got = jax.jit(lambda x, w: dot_general(x, w, dn, quantizers=none, state={}, **kw))(lb, rb)
    assert_same_bits(got[0], jax.jit(lambda x, w: lax.dot_general(x, w, dn, **kw))(lb, rb), str(dn))
    assert got[1] == {}


EINSUMS = [
    ("ij,jk->ik", (3, 4), (4, 5)),
    ("ij,kj->ki", (3, 4), (5, 4)),
    ("bqhd,bkhd->bhqk", (2, 3, 4, 5), (2, 6, 4, 5)),
    ("abc,cde->abde", (2, 3, 4), (4, 5, 6)),
    ("bsd,dhk->bshk", (2, 3, 8), (8, 2, 4)),
    ("bhd,hdf->bhf", (3, 2, 4), (2, 4, 5)),
    ("ij,jk", (3, 4), (4, 5)),
    ("...i,...i->...", (2, 3, 4), (3, 4)),
    ("...d,df->...f", (2, 3, 4), (4, 5)),
    ("ij,jk->k", (3, 4), (4, 5)),
    ("xij,jk->ik", (2, 3, 4), (4, 5)),
    ("ij,jk->ik", (3, 1), (4, 5)),
    ("bi,bi->b", (1, 4), (3, 4)),
    ("i,i->", (4,), (4,)),
    ("i,j->ij", (3,), (4,)),
    ("ij,jk->ik", (0, 4), (4, 5)),
    ("ij,jk->ik", (3, 0), (0, 5)),
    (" ab , bc -> ca ", (3, 4), (4, 5)),
]


@pytest.mark.parametrize("case", range(len(EINSUMS)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unquantized_einsum_is_jnp_einsum(case, dtype, monkeypatch):
    """Unquantized, te_jax.core.einsum is the jnp.einsum call itself: the same program, eagerly too (so the same
    bits on a GPU, where two programs that only compute the same product, such as a sum then a product run
    eagerly one by one against one jitted program of both, may fuse, order and round otherwise)."""
    eq, a, b = EINSUMS[case]
    what = f"einsum {eq!r} {jnp.dtype(dtype).name} {a} x {b}"
    lhs, rhs = _rand(case, a, dtype), _rand(50 + case, b, dtype)
    calls, jnp_einsum = [], jnp.einsum
    with monkeypatch.context() as patch:
        patch.setattr(jnp, "einsum", lambda *args, **kw: calls.append((args, kw)) or jnp_einsum(*args, **kw))
        einsum(eq, lhs, rhs, precision=lax.Precision.HIGHEST)
    assert len(calls) == 1 and calls[0][0][0] == eq, f"{what}: te_jax made {len(calls)} jnp.einsum calls, not one"
    assert all(np.array_equal(got, want) for got, want in zip(calls[0][0][1:], (lhs, rhs))), f"{what}: operands"
    assert calls[0][1] == dict(precision=lax.Precision.HIGHEST, preferred_element_type=None), f"{what}: {calls[0][1]}"
    want = jax.jit(lambda x, w: jnp.einsum(eq, x, w))(lhs, rhs)
    got, state = jax.jit(lambda x, w: einsum(eq, x, w))(lhs, rhs)
    assert_same_bits(got, want, f"{what} under jit, te_jax vs jnp.einsum")
    assert state is None
    want = jnp.einsum(eq, lhs, rhs, preferred_element_type=jnp.float32)
    assert_same_bits(einsum(eq, lhs, rhs, preferred_element_type=jnp.float32)[0], want,
                     f"{what} eager, preferred_element_type=float32, te_jax vs jnp.einsum")


@pytest.mark.parametrize("eq, a, b, message", [
    ("ij,jk,kl->il", (2, 3), (3, 4), "exactly two operands"),
    ("ij->i", (2, 3), (3, 4), "exactly two operands"),
    ("ii,ij->j", (3, 3), (3, 4), "repeats within the lhs"),
    ("ij,jk->ii", (3, 4), (4, 5), "repeats within the output"),
    ("...i,i->i", (2, 3), (3,), "ellipsis and the output does not"),
    ("ij,jk->iz", (3, 4), (4, 5), "appear in no operand"),
    ("ij,jk->ik", (3, 4), (5, 6), "letter 'j' is 4 in lhs and 5 in rhs"),
    ("ijk,jk->ik", (3, 4), (4, 5), "names 3 axes, the operand has 2"),
    ("i1,1k->ik", (3, 4), (4, 5), "must be letters"),
    ("ij,jk->i->k", (3, 4), (4, 5), "more than one '->'"),
])
def test_einsum_errors(eq, a, b, message):
    with pytest.raises(ValueError, match="te_jax: einsum") as err:
        einsum(eq, jnp.ones(a), jnp.ones(b), quantizers=CURRENT)
    assert message in str(err.value)


# (lhs, rhs, dimension numbers): contracting axes in any order, several free axes, batch axes (grouped GEMM)
QUANTIZED = [
    ((16, 32), (32, 24), (((1,), (0,)), ((), ()))),
    ((4, 8, 6), (6, 8, 24), (((2, 1), (0, 1)), ((), ()))),
    ((24, 4, 32), (32, 4, 16), (((2,), (0,)), ((1,), (1,)))),
    ((3, 16, 32), (3, 32, 16), (((2,), (1,)), ((0,), (0,)))),
]


@pytest.mark.parametrize("case", range(len(QUANTIZED)))
def test_quantized_dot_general_within_fp8_bounds(case):
    a, b, dn = QUANTIZED[case]
    lhs, rhs = _rand(case, a), _rand(9 + case, b)

    def loss(fn, x, w):
        y = fn(x, w)
        return jnp.sum(y * _rand(7, y.shape)), y  # a random output gradient

    grad = jax.jit(jax.grad(loss, (1, 2), has_aux=True), static_argnums=0)
    (gx, gw), y = grad(lambda x, w: dot_general(x, w, dn, quantizers=CURRENT)[0], lhs, rhs)
    (gx_hp, gw_hp), y_hp = grad(lambda x, w: lax.dot_general(x, w, dn), lhs, rhs)
    assert y.shape == y_hp.shape and y.dtype == y_hp.dtype
    # E4M3 operands: ~5% per GEMM, E5M2 gradients ~10%; a wrong copy, axis order or role: ~100%
    assert _rel(y, y_hp) < 0.08
    assert _rel(gx, gx_hp) < 0.26 and _rel(gw, gw_hp) < 0.26


# A weight with no free axis: dot products of vectors, matrix-vector products, a batch of them.
VECTORS = [
    ((32,), (32,), (((0,), (0,)), ((), ()))),
    ((16, 32), (32,), (((1,), (0,)), ((), ()))),
    ((3, 16, 32), (3, 32), (((2,), (1,)), ((0,), (0,)))),
]


@pytest.mark.parametrize("case", range(len(VECTORS)))
def test_weight_vectors_give_lax_shapes_within_fp8_bounds(case):
    """lax.dot_general's shape and dtype (a scalar for two vectors); each output within the E4M3 operands' bound
    ``(2 * 2^-4 + 2^-8) |x| @ |w|`` (plus float32 sums), the input gradient likewise with E5M2 output gradients."""
    a, b, dn = VECTORS[case]
    lhs, rhs = _rand(case, a), _rand(30 + case, b)

    def fn(x, w):
        return dot_general(x, w, dn, quantizers=CURRENT)[0]

    y = jax.jit(fn)(lhs, rhs)
    want = lax.dot_general(lhs, rhs, dn)
    assert y.shape == want.shape and y.dtype == want.dtype
    scale = lax.dot_general(jnp.abs(lhs), jnp.abs(rhs), dn, precision=lax.Precision.HIGHEST)
    assert np.all(np.abs(y - want) <= (2 * 2.0**-4 + 2.0**-8) * scale + 1e-5), (y, want)
    gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w)), (0, 1)))(lhs, rhs)  # dy = 1: exact in E5M2
    hx, hw = jax.grad(lambda x, w: jnp.sum(lax.dot_general(x, w, dn)), (0, 1))(lhs, rhs)
    assert gx.shape == hx.shape and gw.shape == hw.shape
    # dy = 1 times the E4M3 copy of the other operand (for the weight's gradient summed over the input's rows)
    assert np.all(np.abs(gx - hx) <= 2.0**-4 * np.abs(hx) + 1e-6)
    abs_rows = jax.grad(lambda w: jnp.sum(lax.dot_general(jnp.abs(lhs), w, dn)))(rhs)
    assert np.all(np.abs(gw - hw) <= 2.0**-4 * abs_rows + 1e-5)


def test_mixed_operand_dtypes_give_lax_dtype():
    """float16 x bfloat16 writes bfloat16 as lax.dot_general does (jnp.result_type would say float32)."""
    x, w = _rand(1, (16, 32), jnp.float16), _rand(2, (32, 24), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    for lhs, rhs in ((x, w), (w.T, x.T), (x, w.astype(jnp.float32))):
        got, _ = dot_general(lhs, rhs, dn, quantizers=CURRENT)
        want = lax.dot_general(lhs, rhs, dn)
        assert got.dtype == want.dtype, (lhs.dtype, rhs.dtype, got.dtype, want.dtype)
        assert _rel(got, want) < 0.08


def test_quantized_without_batch_axes_is_te_jax_dense():
    x, w = _rand(1, (4, 8, 6)), _rand(2, (6, 8, 24))
    dn = (((2, 1), (0, 1)), ((), ()))
    state = DELAYED.init_state()
    got = jax.jit(lambda x, w, s: dot_general(x, w, dn, quantizers=DELAYED, state=s))(x, w, state)
    want = jax.jit(lambda x, w, s: dense(x, w, contracting_dims=((2, 1), (0, 1)), quantizers=DELAYED,
                                          state=s))(x, w, state)
    assert_same_bits(got[0], want[0], "y")
    jax.tree.map(lambda g, e: assert_same_bits(g, e, "state"), got[1], want[1])


def test_batch_axes_keep_one_weight_history_per_batch_element():
    x, w = _rand(1, (24, 4, 32)), _rand(2, (32, 4, 16))
    dn = (((2,), (0,)), ((1,), (1,)))
    with pytest.raises(ValueError, match="leading axis of the 4 experts"):
        dot_general(x, w, dn, quantizers=DELAYED, state=DELAYED.init_state())
    state = DELAYED.init_state(num_groups=4)
    y, new = jax.jit(lambda x, w, s: dot_general(x, w, dn, quantizers=DELAYED, state=s))(x, w, state)
    assert y.shape == (4, 24, 16)
    hist = new["linear_weight"]["amax_history"]
    assert hist.shape == (4, 4)
    want = jnp.max(jnp.abs(jnp.moveaxis(w, 1, 0)), axis=(1, 2))  # each batch element's weight amax
    np.testing.assert_array_equal(hist[:, -1], want)
    assert float(new["linear_input"]["amax_history"][-1]) == float(jnp.max(jnp.abs(x)))


def test_preferred_element_type_is_the_output_dtype():
    x, w = _rand(1, (16, 32), jnp.bfloat16), _rand(2, (32, 24), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    wide, _ = dot_general(x, w, dn, quantizers=CURRENT, preferred_element_type=jnp.float32)
    natural, _ = dot_general(x, w, dn, quantizers=CURRENT)
    narrow, _ = dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dn, quantizers=CURRENT,
                            preferred_element_type=jnp.bfloat16)
    assert (wide.dtype, natural.dtype, narrow.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    # widening is exact: the same FP8 copies, the float32 GEMM output rounds to the bfloat16 one
    assert_same_bits(wide.astype(jnp.bfloat16), natural, "widened")
    with pytest.raises(TypeError, match="preferred_element_type=int32"):
        dot_general(x, w, dn, quantizers=CURRENT, preferred_element_type=jnp.int32)


def test_quantized_einsum_within_fp8_bounds_and_jit():
    x, w = _rand(3, (2, 8, 32)), _rand(4, (32, 2, 16))
    eq = "bsd,dhk->bkhs"  # output transposed from lax's order
    y, _ = jax.jit(lambda x, w: einsum(eq, x, w, quantizers=CURRENT))(x, w)
    want = jnp.einsum(eq, x, w)
    assert y.shape == want.shape and _rel(y, want) < 0.08
    # summed-first letters, quantized
    y, _ = einsum("xbd,dk->bk", _rand(5, (3, 8, 32)), w[:, 0], quantizers=CURRENT)
    assert _rel(y, jnp.einsum("xbd,dk->bk", _rand(5, (3, 8, 32)), w[:, 0])) < 0.08


@pytest.mark.parametrize("dn, message", [
    ((((), ()), ((), ())), "contract no axis"),
    ((((1,), (1,)), ((), ())), "differ in size"),
    ((((1,), (0, 1)), ((), ())), "pair as many lhs as rhs"),
    ((((2,), (0,)), ((), ())), "not distinct axes"),
    ((1, 0), "dimension_numbers must be"),
])
def test_quantized_dimension_numbers_errors(dn, message):
    with pytest.raises(ValueError, match="te_jax: dot_general") as err:
        dot_general(jnp.ones((8, 16)), jnp.ones((16, 8)), dn, quantizers=CURRENT)
    assert message in str(err.value)


def test_the_limits_of_the_batched_route_are_named():
    x, w = jnp.ones((2, 16, 32)), jnp.ones((2, 32, 48))
    dn = (((2,), (1,)), ((0,), (0,)))
    block = DenseQuantizers.from_recipe(R.Float8BlockScaling())
    with pytest.raises(ValueError, match=r"te_jax: dot_general \(batch axes run on the grouped GEMM") as err:
        dot_general(x, w, dn, quantizers=block)
    assert "multiple of 128" in str(err.value)
    with pytest.raises(ValueError, match="statistics .* batch axes"):
        dot_general(x, w, dn, quantizers=CURRENT, inspect=True)
    with pytest.raises(TypeError, match="te_jax: dot_general: lhs must be float32"):
        dot_general(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 4)), (((1,), (0,)), ((), ())), quantizers=CURRENT)


def test_exported():
    assert te_jax.core.dot_general is dot_general and te_jax.core.einsum is einsum
