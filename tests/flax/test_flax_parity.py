"""te_jax.flax against flax.linen: contracting-axis order, masked norms, NumPy and integer inputs, exact LayerNorm.

Outside autocast the layers must give flax's parameters and flax's values bit
for bit; under autocast they must accept what flax accepts.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import flax as tf
from te_jax import recipe as R

CURRENT = R.Float8CurrentScaling()

# Under autocast these small, odd shapes run on the CPU handlers: cuBLASLt needs 16-aligned GEMMs, and what is
# tested here is the layers' input handling, which is the same on every platform.
def on_cpu():
    return jax.default_device(jax.devices("cpu")[0])


def _randomize(variables, seed=7):
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [(1 + 0.3 * jax.random.normal(k, v.shape)).astype(v.dtype)
                                     for k, v in zip(keys, leaves)])


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda u, v: (np.testing.assert_array_equal(u, v), _dtype_equal(u, v)), a, b)


def _dtype_equal(u, v):
    assert jnp.result_type(u) == jnp.result_type(v), (jnp.result_type(u), jnp.result_type(v))


# ---- DenseGeneral: the contracting axes in flax's (ascending) order ---------------------------------


@pytest.mark.parametrize("axis", [(3, -2), (-1, 1), (2, 0, -1)])
def test_dense_general_sorts_the_contracting_axes_as_flax(axis):
    x = jax.random.normal(jax.random.key(0), (3, 5, 9, 10))
    ours, theirs = tf.DenseGeneral((11, 12), axis=axis), nn.DenseGeneral((11, 12), axis=axis)
    v = theirs.init(jax.random.key(1), x)
    _same(ours.init(jax.random.key(1), x), v)  # same kernel shape and values for the same key
    if axis == (3, -2):
        assert v["params"]["kernel"].shape == (9, 10, 11, 12)
    v = _randomize(v)
    _same(ours.apply(v, x), theirs.apply(v, x))
    grads = [jax.grad(lambda v, m=m: jnp.sum(jnp.sin(m.apply(v, x))))(v) for m in (ours, theirs)]
    _same(*grads)
    with te_jax.autocast(recipe=CURRENT), on_cpu():  # flax's parameters load under autocast too
        y = ours.apply(v, x)
    np.testing.assert_allclose(y, theirs.apply(v, x), rtol=0.15, atol=0.15 * float(jnp.std(y)))


# ---- NumPy float64 and integer inputs -----------------------------------------------------------------


INPUTS = {
    "numpy_float64": lambda: np.linspace(-2, 2, 2 * 64, dtype=np.float64).reshape(2, 64),
    "numpy_ones": lambda: np.ones((2, 64)),
    "int32": lambda: jnp.arange(2 * 64, dtype=jnp.int32).reshape(2, 64) % 7 - 3,
    "numpy_int64": lambda: (np.arange(2 * 64, dtype=np.int64).reshape(2, 64) % 5),
}


@pytest.mark.parametrize("kind", INPUTS)
def test_dense_general_promotes_inputs_as_flax(kind):
    x = INPUTS[kind]()
    v = nn.DenseGeneral(8).init(jax.random.key(0), x)
    _same(tf.DenseGeneral(8).init(jax.random.key(0), x), v)
    v = _randomize(v)
    _same(tf.DenseGeneral(8).apply(v, x), nn.DenseGeneral(8).apply(v, x))
    _same(tf.DenseGeneral(8, param_dtype=jnp.bfloat16).apply(v, x),
          nn.DenseGeneral(8, param_dtype=jnp.bfloat16).apply(v, x))
    with te_jax.autocast(recipe=CURRENT), on_cpu():
        y = tf.DenseGeneral(8).apply(v, x)
    assert y.dtype == jnp.float32 and y.shape == (2, 8)


@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("rms", [False, True])
def test_layernorm_promotes_inputs_as_flax(kind, rms):
    x = INPUTS[kind]()
    ours = tf.LayerNorm(layernorm_type="rmsnorm" if rms else "layernorm")
    theirs = nn.RMSNorm() if rms else nn.LayerNorm()
    v = _randomize(theirs.init(jax.random.key(0), x))
    _same(ours.apply(v, x), theirs.apply(v, x))
    with te_jax.autocast(recipe=CURRENT):
        y = ours.apply(v, x)
    np.testing.assert_allclose(y, theirs.apply(v, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["numpy_float64", "int32"])
def test_fused_layers_accept_what_flax_accepts(kind):
    x = INPUTS[kind]()
    for layer in (tf.LayerNormDenseGeneral(16), tf.LayerNormMLP(128)):
        v = layer.init(jax.random.key(0), x)
        want = layer.apply(v, jnp.asarray(x, jnp.float32))
        np.testing.assert_array_equal(layer.apply(v, x), want)
        with te_jax.autocast(recipe=CURRENT), on_cpu():
            assert layer.apply(layer.init(jax.random.key(0), x), x).dtype == jnp.float32


# ---- LayerNorm / RMSNorm: exactly flax, mask included ---------------------------------------------


NORM_CASES = [
    (dict(), jnp.float32),
    (dict(use_fast_variance=False), jnp.float32),
    (dict(use_bias=False, epsilon=1e-3), jnp.float32),
    (dict(use_scale=False), jnp.float32),
    (dict(dtype=jnp.bfloat16), jnp.float32),
    (dict(), jnp.bfloat16),
    (dict(param_dtype=jnp.bfloat16), jnp.bfloat16),
    (dict(param_dtype=jnp.bfloat16, force_float32_reductions=False), jnp.bfloat16),
    (dict(layernorm_type="rmsnorm"), jnp.float32),
    (dict(layernorm_type="rmsnorm", dtype=jnp.bfloat16), jnp.float32),
    (dict(layernorm_type="rmsnorm", use_fast_variance=False), jnp.bfloat16),
]


def _pair(kw):
    rms = kw.get("layernorm_type") == "rmsnorm"
    flax_kw = {k: v for k, v in kw.items() if k != "layernorm_type"}
    return tf.LayerNorm(**kw), (nn.RMSNorm(**flax_kw) if rms else nn.LayerNorm(**flax_kw))


def _norm_input(dtype, shape=(4, 8, 96)):
    # an offset mean and a spread of magnitudes: where a two-pass variance and flax's one-pass one differ
    x = 3.0 + jax.random.normal(jax.random.key(3), shape) * jnp.exp(jax.random.normal(jax.random.key(4), shape))
    return x.astype(dtype)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kw,dtype", NORM_CASES)
def test_layernorm_is_exactly_flax(kw, dtype, masked):
    x = _norm_input(dtype)
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, x.shape) if masked else None
    ours, theirs = _pair(kw)
    v = _randomize(theirs.init(jax.random.key(1), x))
    _same(jax.tree.map(jnp.shape, ours.init(jax.random.key(1), x)), jax.tree.map(jnp.shape, v))
    _same(ours.apply(v, x, mask=mask), theirs.apply(v, x, mask=mask))

    def loss(m):
        return lambda v, x: jnp.sum(jnp.sin(m.apply(v, x, mask=mask).astype(jnp.float32)))

    _same(jax.grad(loss(ours), argnums=(0, 1))(v, x), jax.grad(loss(theirs), argnums=(0, 1))(v, x))


@pytest.mark.parametrize("rms", [False, True])
def test_masked_norm_under_autocast_is_flax(rms):
    x = _norm_input(jnp.float32)
    mask = jnp.broadcast_to(jnp.arange(x.shape[-1]) < 40, x.shape)  # e.g. padding at the end of each row
    ours, theirs = _pair(dict(layernorm_type="rmsnorm") if rms else dict())
    v = _randomize(theirs.init(jax.random.key(1), x))
    with te_jax.autocast(recipe=CURRENT):
        y = ours.apply(v, x, mask=mask)
        unmasked = ours.apply(v, x)
    _same(y, theirs.apply(v, x, mask=mask))
    # the mask changes the statistics: the first 40 features normalized alone
    np.testing.assert_allclose(y[..., :40], theirs.apply(jax.tree.map(lambda p: p[:40], v), x[..., :40]),
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(y, unmasked)


def test_autocast_norm_stays_within_float32_ulps_of_flax():
    x = _norm_input(jnp.float32)
    ours, theirs = _pair(dict())
    v = _randomize(theirs.init(jax.random.key(1), x))
    with te_jax.autocast(recipe=CURRENT):
        y = ours.apply(v, x)
    ref = theirs.apply(v, x)
    ulp_of_largest = float(jnp.finfo(jnp.float32).eps) * float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(y, ref, rtol=0, atol=8 * ulp_of_largest)
