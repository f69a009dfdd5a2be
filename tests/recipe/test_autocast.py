"""te_jax.autocast and te_jax.MeshResource, and the issue's custom-recipe example as written."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest

import te_jax
from te_jax import recipe as R
from te_jax.recipe.autocast import AutocastConfig, current, current_recipe, inspect_sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_models import MLP, Dense  # noqa: E402


def test_outside_autocast_nothing_is_quantized():
    assert current() == AutocastConfig(False, None, None) and current_recipe() is None
    x = jax.random.normal(jax.random.key(0), (8, 32))
    variables = Dense(16).init(jax.random.key(1), x)
    assert set(variables) == {"params"}
    y = Dense(16).apply(variables, x)
    want = nn.Dense(16).apply(variables, x)  # same params, flax.linen's computation
    assert np.array_equal(y, want)


def test_default_recipe_nesting_and_disable():
    with te_jax.autocast():
        assert current_recipe() == R.DelayedScaling()
        with te_jax.autocast(recipe=R.MXFP8BlockScaling()):
            assert current_recipe() == R.MXFP8BlockScaling()
            with te_jax.autocast(enabled=False):
                assert current_recipe() is None and not current().enabled
            assert current_recipe() == R.MXFP8BlockScaling()
        assert current_recipe() == R.DelayedScaling()
        with pytest.raises(RuntimeError), te_jax.autocast(recipe=R.Float8CurrentScaling()):
            raise RuntimeError
        assert current_recipe() == R.DelayedScaling()
    assert current_recipe() is None
    mesh_resource = te_jax.MeshResource(dp_resource="data")
    with te_jax.autocast(recipe=R.Float8CurrentScaling(), mesh_resource=mesh_resource):
        assert current().mesh_resource == mesh_resource


def test_nested_blocks_inherit_what_they_do_not_set():
    mesh_resource = te_jax.MeshResource(dp_resource="data")
    sample = te_jax.inspect.Sample(every=4)
    with te_jax.autocast(recipe=R.MXFP8BlockScaling(), mesh_resource=mesh_resource, inspect=sample):
        with te_jax.autocast(enabled=False):
            assert current() == AutocastConfig(False, R.MXFP8BlockScaling(), mesh_resource, sample)
            assert current_recipe() is None and inspect_sample() is None
            with te_jax.autocast():  # quantizes again, with the outer recipe, mesh axes and inspection
                assert current() == AutocastConfig(True, R.MXFP8BlockScaling(), mesh_resource, sample)
        with te_jax.autocast(recipe=R.Float8CurrentScaling()):
            assert current() == AutocastConfig(True, R.Float8CurrentScaling(), mesh_resource, sample)
        with te_jax.autocast(recipe=None, mesh_resource=None, inspect=False):  # set explicitly: not inherited
            assert current() == AutocastConfig(True, R.DelayedScaling(), None, None)
    with te_jax.autocast(enabled=False):  # outside any block: the defaults
        with te_jax.autocast():
            assert current() == AutocastConfig(True, R.DelayedScaling(), None, None)


def test_disabled_inner_block_computes_in_high_precision():
    x = jax.random.normal(jax.random.key(0), (32, 32))
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        variables = MLP().init(jax.random.key(1), x)
        quantized = MLP().apply(variables, x)
        with te_jax.autocast(enabled=False):
            plain = MLP().apply(variables, x)
    assert np.array_equal(plain, MLP().apply(variables, x)) and not np.array_equal(plain, quantized)


def test_autocast_is_part_of_the_jit_cache_key():
    traces = []

    @jax.jit
    def f(x):
        traces.append(current_recipe())
        return x + 1

    f(1.0)
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        f(1.0)
        f(2.0)
    with te_jax.autocast(recipe=R.Float8CurrentScaling(use_power_2_scales=True)):
        f(1.0)
    f(3.0)
    assert traces == [None, R.Float8CurrentScaling(), R.Float8CurrentScaling(use_power_2_scales=True)]


def test_autocast_validation():
    with pytest.raises(ValueError, match="must be a te_jax.recipe recipe"):
        te_jax.autocast(recipe="delayed")
    with pytest.raises(ValueError, match="True or False"):
        te_jax.autocast(enabled=1)
    with pytest.raises(ValueError, match="te_jax.MeshResource"):
        te_jax.autocast(mesh_resource=("dp",))


def test_mesh_resource():
    mr = te_jax.MeshResource()
    assert (mr.dp_resource, mr.tp_resource, mr.fsdp_resource, mr.sp_resource) == (None,) * 4 and mr.axes == ()
    mr = te_jax.MeshResource(dp_resource="dp", tp_resource="tp", fsdp_resource=["dp", "fsdp"], sp_resource="tp")
    assert mr.fsdp_resource == ("dp", "fsdp") and mr.axes == ("dp", "tp", "fsdp")
    assert hash(mr) == hash(dataclasses.replace(mr))
    with pytest.raises(dataclasses.FrozenInstanceError):
        mr.dp_resource = "x"
    with pytest.raises(ValueError, match="mesh axis name"):
        te_jax.MeshResource(dp_resource=3)


# ---- the issue's example, as written ------------------------------------------------------------


class Model(nn.Module):
    """A small flax model whose matmuls are te_jax.dense (the te_jax.flax layers come later)."""

    @nn.compact
    def __call__(self, x):
        return Dense(32, name="out")(nn.relu(Dense(64, name="hidden")(x)))


def test_the_issues_example():
    model = Model()
    x = jax.random.normal(jax.random.key(0), (32, 32))
    variables = model.init(jax.random.key(1), x)

    # The example's factory is the gallery recipe recipes/current_scaling_ref.py.
    import jax.numpy as jnp
    from te_jax import autocast, recipe

    custom_recipe = recipe.load_recipe("current_scaling_ref")
    assert isinstance(custom_recipe, recipe.CustomRecipe)
    with autocast(recipe=custom_recipe):
        output = model.apply(variables, x)

    # The output quantizer ran: E5M2 values times one per-tensor scale (E5M2 has < 128 magnitudes).
    plain = model.apply(variables, x)
    assert output.shape == plain.shape and not np.array_equal(output, plain)
    assert 0 < float(jnp.linalg.norm(output - plain) / jnp.linalg.norm(plain)) < 0.1
    assert len(np.unique(np.abs(np.asarray(output)))) < 128 < len(np.unique(np.abs(np.asarray(plain))))
    # The gradients flow through the quantized GEMMs.
    with autocast(recipe=custom_recipe):
        grads = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(variables)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
