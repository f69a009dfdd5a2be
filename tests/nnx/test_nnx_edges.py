"""te_jax.nnx's layers at the edges flax.nnx handles (issue 42, points 8-10): rank-1 inputs and jax.vmap over
examples, an empty batch, float64 with jax_enable_x64 outside autocast (and a clear error under it).

Before: a rank-1 input to Linear under a recipe raised "te_jax: flatten_axis 0 is out of range", an empty batch
ZeroDivisionError, and float64 "te_jax: dense: x must be float32, bfloat16 or float16" outside autocast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from qtest_util import BUILTIN_RECIPES

import te_jax
from te_jax import nnx as tn

pytestmark = pytest.mark.filterwarnings("ignore::te_jax.quantize.fused.UnfusedCastWarning")
LAYERS = {"Linear": lambda **kw: tn.Linear(32, 16, rngs=nnx.Rngs(0), **kw),
          "LayerNormLinear": lambda **kw: tn.LayerNormLinear(32, 16, rngs=nnx.Rngs(0), **kw),
          "LayerNormMLP": lambda **kw: tn.LayerNormMLP(32, 64, rngs=nnx.Rngs(0), **kw)}


@pytest.mark.parametrize("name", list(LAYERS))
def test_rank1_vmap_and_empty_batch_under_a_recipe(name):
    recipe = BUILTIN_RECIPES["current"]
    xs = jax.random.normal(jax.random.key(1), (3, 32))
    with te_jax.autocast(recipe=recipe):
        layer = LAYERS[name]()
        y1 = layer(xs[0])
        np.testing.assert_array_equal(y1, layer(xs[:1])[0])
        graphdef, params = nnx.split(layer)

        def grads(x):
            return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x) ** 2))(params)

        batched = jax.jit(jax.vmap(grads))(xs)
        for i in range(xs.shape[0]):
            for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(jax.jit(grads)(xs[i]))):
                np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)
        assert layer(jnp.zeros((0, 32))).shape == (0, y1.shape[-1])
        empty = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(jnp.zeros((0, 32)))))(params)
        assert all(not np.any(leaf) for leaf in jax.tree.leaves(empty))


def test_float64_outside_autocast_is_flax_nnx_and_refused_under_it():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(1), (4, 32), jnp.float64)
        f64 = dict(param_dtype=jnp.float64)
        pairs = ((tn.Linear(32, 16, rngs=nnx.Rngs(0), **f64), nnx.Linear(32, 16, rngs=nnx.Rngs(0), **f64)),
                 (tn.LayerNorm(32, rngs=nnx.Rngs(0), **f64), nnx.LayerNorm(32, rngs=nnx.Rngs(0), **f64)))
        for ours, theirs in pairs:
            y = ours(x)
            assert y.dtype == jnp.float64
            np.testing.assert_array_equal(y, theirs(x))
        assert LAYERS["LayerNormMLP"](**f64)(x).dtype == jnp.float64
        with te_jax.autocast(recipe=BUILTIN_RECIPES["current"]):
            with pytest.raises(TypeError, match=r"te_jax: Linear.*the input is float64.*x.astype\(jnp.float32\)"):
                pairs[0][0](x)


# A 0-size batch through a multi-axis contraction runs as flax.nnx.LinearGeneral does.
@pytest.mark.parametrize("recipe", [None, "current"])
def test_empty_batch_of_a_multi_axis_layernorm_linear(recipe):
    layer = tn.LayerNormLinear((4, 32), 16, axis=(-2, -1), enable_layernorm=False, rngs=nnx.Rngs(0))
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe and BUILTIN_RECIPES[recipe]):
        assert layer(jnp.zeros((0, 4, 32))).shape == (0, 16)
