"""The reference numerics against independent implementations (ml_dtypes, float64 math)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from te_jax.ops import quantize as qops
from te_jax.spec import numerics as nm
from qtest_util import assert_same_bits

F32_MAX = np.finfo(np.float32).max


@pytest.fixture(autouse=True)
def _reference_on_cpu():
    """The reference is the spec where it runs: on XLA:CPU (a GPU machine would use XLA:GPU)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def all_kinds_of_floats(n: int, seed: int = 0) -> np.ndarray:
    """Random float32 bit patterns (every exponent, NaN, Inf, subnormals) plus edge values."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    edges = np.array([0.0, -0.0, 448.0, 464.0, 463.99, 480.0, 57344.0, 61440.0, 61439.0, 2**-9, 2**-10,
                      3 * 2**-11, 2**-16, 2**-17, 1.5 * 2**-17, np.inf, -np.inf, np.nan, F32_MAX], np.float32)
    return np.concatenate([x, edges, -edges])


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_cast_matches_ml_dtypes_and_kernel(dtype):
    x = all_kinds_of_floats(1 << 16)
    m = nm.fp8_max(dtype)
    # ml_dtypes casts directly from float32 with round-to-nearest-even; clip first to saturate.
    with np.errstate(invalid="ignore"):
        want = np.clip(x, -m, m).astype(dtype)
    got_ref = np.asarray(jax.jit(nm.cast_fp8, static_argnums=1)(jnp.asarray(x), dtype))
    assert_same_bits(got_ref, want, "reference vs ml_dtypes")
    q, *_ = qops.quantize_fp8_tensor(jnp.asarray(x)[None], jnp.ones((1,), jnp.float32), qdtype=dtype)
    assert_same_bits(np.asarray(q)[0], want, "kernel vs ml_dtypes")


def test_e2m1_rne_matches_ml_dtypes():
    x = all_kinds_of_floats(1 << 16)
    finite = np.isfinite(x)
    want = np.clip(x[finite], -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = np.asarray(nm.e2m1_to_float(nm.e2m1_rne(jnp.asarray(x[finite]))))
    np.testing.assert_array_equal(got, want)
    ties = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0], jnp.float32)
    np.testing.assert_array_equal(nm.e2m1_to_float(nm.e2m1_rne(ties)), [0, 1, 1, 2, 2, 4, 4, -0.0, -4])
    assert int(nm.e2m1_rne(jnp.float32(jnp.nan))) & 7 == 0


def test_e2m1_stochastic_picks_a_neighbour_with_the_right_probability():
    v = jnp.array([0.1, 0.6, 1.3, 2.25, 3.9, 4.5, 5.99, 7.0, -2.25], jnp.float32)
    n = 20000
    bits = jax.random.bits(jax.random.key(0), (n, v.size), jnp.uint32)
    out = np.asarray(nm.e2m1_to_float(nm.e2m1_stochastic(jnp.broadcast_to(v, (n, v.size)), bits)))
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    for j, val in enumerate(np.asarray(v)):
        a = min(abs(val), 6.0)
        lo = grid[grid <= a].max()
        hi = grid[grid >= a].min()
        assert set(np.unique(np.abs(out[:, j]))) <= {lo, hi}
        np.testing.assert_allclose(out[:, j].mean(), np.sign(val) * a, atol=0.03 * max(hi - lo, 0.01))


def test_e8m0_is_the_smallest_power_of_two_not_below_amax_over_max():
    rng = np.random.default_rng(1)
    amax = np.concatenate([
        np.exp2(rng.uniform(-140, 127, 5000)).astype(np.float32),
        np.array([0.0, 448.0, 449.0, 1e-45, 2.0**-120, F32_MAX], np.float32),
    ])
    codes = np.asarray(nm.e8m0_from_amax(jnp.asarray(amax), 448.0)).astype(np.int64)
    t = amax * np.float32(1.0 / 448.0)  # float32, as the spec orders it
    t[np.abs(t) < np.finfo(np.float32).tiny] = 0.0  # the spec's float32 flushes subnormals (FTZ)
    scale = np.exp2(codes.astype(np.float64) - 127)
    assert (scale >= t.astype(np.float64)).all()
    not_smallest = (codes > 0) & (scale / 2 >= t.astype(np.float64))
    assert not not_smallest.any()
    assert codes[amax == 0].tolist() == [0]
    nonfinite = nm.e8m0_from_amax(jnp.array([np.inf, np.nan], jnp.float32), 448.0)
    assert np.asarray(nonfinite).tolist() == [255, 255]
    np.testing.assert_array_equal(
        np.asarray(nm.e8m0_to_float(jnp.asarray(codes[:100], jnp.uint8))) * np.asarray(
            nm.e8m0_inverse_to_float(jnp.asarray(codes[:100], jnp.uint8))), 1.0)


def test_scale_from_amax_edge_cases():
    f = lambda a, eps=0.0, p2=False: float(nm.scale_from_amax(jnp.float32(a), 448.0, eps, p2))  # noqa: E731
    assert f(0.0) == 1.0 and f(np.inf) == 1.0 and f(np.nan) == 1.0
    assert f(1e-37) == 2.0**126  # capped so that 1/scale stays a normal float32
    assert f(1e-37, p2=True) == 2.0**126
    assert f(1e-35) == np.float32(448) / np.float32(1e-35)
    assert f(1e-44) == 1.0  # a subnormal amax is zero under the spec's flush-to-zero
    assert f(100.0) == np.float32(448) / np.float32(100)
    assert f(100.0, p2=True) == 4.0
    assert f(1.0, eps=2.0) == 224.0
    assert f(0.0, eps=2.0) == 224.0


def test_nvfp4_global_scale_edge_cases():
    s = lambda a: float(nm.nvfp4_global_encode_scale(jnp.float32(a)))  # noqa: E731
    assert s(0.0) == 1.0 and s(np.inf) == 1.0 and s(np.nan) == 1.0
    assert s(2688.0) == 1.0
    assert s(1e-37) == 2.0**126
    assert s(1e-44) == 1.0  # subnormal amax flushes to zero


def test_rht16_is_the_scaled_signed_hadamard_matrix():
    h = np.array([[1.0]])
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    signs = np.array([-1.0 if (nm.RHT_SIGN_MASK >> i) & 1 else 1.0 for i in range(16)])
    matrix = h @ np.diag(signs) / 4.0  # orthogonal
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(16), atol=1e-12)
    x = np.random.default_rng(2).standard_normal((8, 32)).astype(np.float32)
    got = np.asarray(nm.rht16(jnp.asarray(x)))
    want = (x.reshape(8, 2, 16).astype(np.float64) @ matrix.T).reshape(8, 32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(nm.inverse_rht16(jnp.asarray(got))), x, rtol=1e-5, atol=1e-6)


def test_random_bits_are_roughly_uniform_and_key_dependent():
    idx = jnp.arange(1 << 16, dtype=jnp.uint32)
    a = np.asarray(nm.random_bits(nm.stream_seed(jnp.array([1, 2], jnp.uint32), 0), idx))
    b = np.asarray(nm.random_bits(nm.stream_seed(jnp.array([1, 2], jnp.uint32), 1), idx))
    c = np.asarray(nm.random_bits(nm.stream_seed(jnp.array([1, 3], jnp.uint32), 0), idx))
    assert (a != b).mean() > 0.99 and (a != c).mean() > 0.99
    counts = np.bincount(a >> 28, minlength=16)
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean()
    bit_means = ((a[:, None] >> np.arange(32, dtype=np.uint32)) & 1).mean(axis=0)
    assert np.all(np.abs(bit_means - 0.5) < 0.02)


def test_abs_max_propagates_nan_and_ignores_sign():
    assert float(nm.abs_max(jnp.array([-3.0, 2.0]))) == 3.0
    assert np.isnan(float(nm.abs_max(jnp.array([1.0, np.nan, np.inf]))))
    assert float(nm.abs_max(jnp.array([-np.inf, 1.0]))) == np.inf
