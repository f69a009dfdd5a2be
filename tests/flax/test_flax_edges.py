"""te_jax.flax's layers at the edges flax.linen handles (issue 42, points 8-10): rank-1 inputs and jax.vmap over
examples, 0-size axes, float64 with jax_enable_x64 outside autocast (and a clear error under it).

Before: a rank-1 input to DenseGeneral under a recipe raised "te_jax: flatten_axis 0 is out of range for shape
(32,)" (naming no layer), an empty batch under a recipe ZeroDivisionError, and float64 a TypeError outside autocast.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qtest_util import BUILTIN_RECIPES

import te_jax
import te_jax.flax as tf

pytestmark = pytest.mark.filterwarnings("ignore::te_jax.quantize.fused.UnfusedCastWarning")
LAYERS = {"DenseGeneral": lambda: tf.DenseGeneral(16), "LayerNormDenseGeneral": lambda: tf.LayerNormDenseGeneral(16),
          "LayerNormMLP": lambda: tf.LayerNormMLP(intermediate_dim=64)}


def _init(layer, x, recipe):
    with te_jax.autocast(recipe=recipe):
        return layer.init(jax.random.key(0), x)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_rank1_input_gives_a_rank1_output_and_vmap_gives_per_example_gradients(name, recipe):
    layer, recipe = LAYERS[name](), BUILTIN_RECIPES[recipe]
    xs = jax.random.normal(jax.random.key(1), (3, 32))
    v = _init(layer, xs[0], recipe)
    with te_jax.autocast(recipe=recipe):
        y1 = layer.apply(v, xs[0])
        assert y1.shape == layer.apply(v, xs[:1]).shape[1:]
        np.testing.assert_array_equal(y1, layer.apply(v, xs[:1])[0])

        def grads(x):  # per example: the parameters' gradient (and the state's update)
            return te_jax.train.grad(lambda v: jnp.sum(layer.apply(v, x) ** 2))(v)

        batched = jax.jit(jax.vmap(grads))(xs)
        for i in range(xs.shape[0]):
            one = jax.jit(grads)(xs[i])
            for got, want in zip(jax.tree.leaves(batched["params"]), jax.tree.leaves(one["params"])):
                np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", ["current", "mxfp8", "delayed"])
def test_zero_size_axes_as_flax(recipe):
    """An empty batch and zero output features under a recipe: flax's shapes, zeros where flax gives zeros."""
    recipe = BUILTIN_RECIPES[recipe]
    for name, make in LAYERS.items():
        x = jnp.zeros((0, 5, 32))
        v = _init(make(), jnp.zeros((2, 32)), recipe)
        with te_jax.autocast(recipe=recipe):
            assert make().apply(v, x).shape == (0, 5, 16 if name != "LayerNormMLP" else 32), name
            g = te_jax.train.grad(lambda v: jnp.sum(make().apply(v, x)))(v)
        assert all(not np.any(leaf) for leaf in jax.tree.leaves(g["params"])), name
    x = jax.random.normal(jax.random.key(1), (4, 32))
    zeros = dict(kernel_init=nn.initializers.zeros)  # flax's default (lecun_normal) divides by the 0 features
    flax_v = nn.DenseGeneral(0, **zeros).init(jax.random.key(0), x)
    with te_jax.autocast(recipe=recipe):
        v = tf.DenseGeneral(0, **zeros).init(jax.random.key(0), x)
        y = tf.DenseGeneral(0, **zeros).apply(v, x)
        g = te_jax.train.grad(lambda v: jnp.sum(tf.DenseGeneral(0, **zeros).apply(v, x)))(v)
    assert y.shape == nn.DenseGeneral(0, **zeros).apply(flax_v, x).shape == (4, 0)
    assert jax.tree.map(jnp.shape, g["params"]) == jax.tree.map(jnp.shape, flax_v["params"])


def test_float64_outside_autocast_is_flax_and_refused_under_it():
    """With jax_enable_x64, float64 parameters and inputs compute what flax.linen computes in float64; under a
    recipe the layer says to pass param_dtype=jnp.float32."""
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(1), (4, 32), jnp.float64)
        f64 = dict(param_dtype=jnp.float64)
        for ours, theirs in ((tf.DenseGeneral(16, **f64), nn.DenseGeneral(16, **f64)),
                             (tf.LayerNorm(**f64), nn.LayerNorm(**f64))):
            v = ours.init(jax.random.key(0), x)
            y = ours.apply(v, x)
            assert y.dtype == jnp.float64
            np.testing.assert_array_equal(y, theirs.apply(v, x))
        ln = nn.LayerNorm(**f64)
        v = tf.LayerNormDenseGeneral(16, **f64).init(jax.random.key(0), x)["params"]
        normed = ln.apply({"params": {"scale": v["scale"], "bias": v["ln_bias"]}}, x)
        want = nn.DenseGeneral(16, **f64).apply({"params": {"kernel": v["kernel"], "bias": v["bias"]}}, normed)
        np.testing.assert_array_equal(tf.LayerNormDenseGeneral(16, **f64).apply({"params": v}, x), want)
        v = tf.LayerNormMLP(intermediate_dim=64, **f64).init(jax.random.key(0), x)["params"]
        normed = ln.apply({"params": {"scale": v["scale"], "bias": v["ln_bias"]}}, x)
        want = nn.gelu(normed @ v["wi_kernel"] + v["wi_bias"]) @ v["wo_kernel"] + v["wo_bias"]
        got = tf.LayerNormMLP(intermediate_dim=64, **f64).apply({"params": v}, x)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
        moe = tf.MoE(num_experts=4, num_experts_per_tok=2, intermediate_dim=16, **f64)  # grouped_dense unquantized
        assert moe.apply(moe.init(jax.random.key(0), x), x).dtype == jnp.float64
        with te_jax.autocast(recipe=BUILTIN_RECIPES["current"]):
            with pytest.raises(TypeError, match=r"te_jax: DenseGeneral: param_dtype is float64, which "
                                                r"te_jax.autocast cannot quantize .* param_dtype=jnp.float32"):
                tf.DenseGeneral(16, **f64).init(jax.random.key(0), x)
            with pytest.raises(TypeError, match=r"te_jax: DenseGeneral: the input is float64.*x.astype"):
                tf.DenseGeneral(16).init(jax.random.key(0), x)


# A 0-size batch through a multi-axis contraction and through the MoE layer runs as flax's layers do.
@pytest.mark.parametrize("recipe", [None, "current"])
@pytest.mark.parametrize("name", ["LayerNormDenseGeneral(axis=(-2, -1))", "MoE"])
def test_empty_batch_of_a_multi_axis_contraction_and_of_moe(name, recipe):
    layer = (tf.LayerNormDenseGeneral(16, axis=(-2, -1), enable_layernorm=False) if name != "MoE"
             else tf.MoE(num_experts=4, num_experts_per_tok=2, intermediate_dim=64))
    shape = (4, 32) if name != "MoE" else (32,)
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe and BUILTIN_RECIPES[recipe]):
        v = layer.init(jax.random.key(0), jnp.ones((2, *shape)))
        y = layer.apply(v, jnp.zeros((0, *shape)))
        g = te_jax.train.grad(lambda v: jnp.sum(layer.apply(v, jnp.zeros((0, *shape)))))(v)
    assert y.shape == (0, 16 if name != "MoE" else 32)
    assert all(not np.any(leaf) for leaf in jax.tree.leaves(g["params"]))
