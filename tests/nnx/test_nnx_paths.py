"""te_jax.nnx module paths without ``path=``: ``name_paths``, per-layer recipes chosen by path (delayed scaling
state where the recipe asks for it, a clear error where the path is not known), ``path=`` as an override, and the
inspector's rows of an NNX model named by layer path.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qtest_util import BUILTIN_RECIPES, normal

import te_jax
from te_jax import nnx as te_nnx
from te_jax import recipe as R

DELAYED = BUILTIN_RECIPES["delayed"]
CURRENT = R.Float8CurrentScaling()


def by_path(pattern: str, quantizing: R.Recipe) -> R.CustomRecipe:
    """``quantizing``'s quantizers for the layers whose path matches ``pattern``, high precision elsewhere."""
    return R.CustomRecipe(lambda role: quantizing.quantizer(role) if re.search(pattern, role.path_str) else None)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = te_nnx.LayerNorm(32, rngs=rngs)
        self.proj = te_nnx.Linear(32, 32, rngs=rngs)
        self.mlp = te_nnx.LayerNormMLP(32, 64, rngs=rngs)

    def __call__(self, x):
        return self.mlp(self.proj(self.norm(x)))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.attn = te_nnx.TransformerLayer(32, 2, intermediate_dim=32, rngs=rngs)
        self.head = te_nnx.Linear(32, 8, rngs=rngs, path="lm_head")  # an explicit path is kept

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.attn(x))


def paths(model) -> dict[str, tuple[str, ...] | None]:
    return {"/".join(map(str, p)): n.path for p, n in nnx.iter_graph(model) if hasattr(n, "path_given")}


def meta(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, te_nnx.FP8Meta))


def test_name_paths_names_every_layer_by_its_place_and_keeps_given_paths():
    model = Model(nnx.Rngs(0))
    before = paths(model)
    assert before["blocks/0/proj"] is None and before["head"] == ("lm_head",)
    assert before["attn/attention/qkv"] is None  # a sub-layer of an unnamed layer waits for the graph
    assert te_nnx.name_paths(model) is model
    after = paths(model)
    assert after["blocks/1/mlp"] == ("blocks", "1", "mlp")
    assert after["attn/attention/qkv"] == ("attn", "attention", "qkv")
    assert after["blocks/0/norm"] == ("blocks", "0", "norm")
    assert after["head"] == ("lm_head",)
    given = te_nnx.TransformerLayer(32, 2, intermediate_dim=32, rngs=nnx.Rngs(0), path="layer_7")
    assert given.attention.out.path == ("layer_7", "attention", "out")
    te_nnx.name_paths(given)
    assert given.attention.out.path == ("layer_7", "attention", "out")


def test_per_layer_delayed_recipe_gets_state_exactly_where_it_quantizes():
    recipe = by_path(r"^blocks/\d+/mlp|^lm_head", DELAYED)
    with te_jax.autocast(recipe=recipe):
        model = Model(nnx.Rngs(0))
        assert set(meta(model)) == {"head"}  # only the layer whose path was given: no state guessed
        te_nnx.name_paths(model)
    state = meta(model)
    assert set(state) == {"blocks", "head"} and set(state["blocks"]) == {0, 1}
    assert set(state["blocks"][0]) == {"mlp"}
    assert set(state["blocks"][0]["mlp"]["fp8_meta"]) == {"wi", "wo"}
    te_nnx.name_paths(model)  # again: nothing changes
    assert jax.tree.structure(meta(model)) == jax.tree.structure(state)

    x = normal(0, (2, 16, 32))

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=recipe):
            return te_nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

    step(model)
    history = meta(model)["blocks"][1]["mlp"]["fp8_meta"]["wi"]["linear_input"]["amax_history"]
    assert float(history[-1]) > 0  # the selected layer was quantized with delayed scaling and its state moved
    with te_jax.autocast(recipe=recipe):  # forward only, now that the paths are known
        got = nnx.jit(lambda m: m(x))(model)
    want = nnx.jit(lambda m: m(x))(model)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert 0 < error < 0.1, error


def test_value_and_grad_names_the_paths_and_creates_the_waiting_state_inside_nnx_jit():
    recipe = by_path(r"proj$", DELAYED)
    with te_jax.autocast(recipe=recipe):
        model = Model(nnx.Rngs(0))
    x = normal(1, (2, 16, 32))

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=recipe):
            return te_nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

    loss = step(model)
    assert np.isfinite(float(loss[0]))
    state = meta(model)
    assert set(state) == {"blocks"} and all(set(state["blocks"][i]) == {"proj"} for i in (0, 1))
    history = state["blocks"][0]["proj"]["fp8_meta"]["linear_input"]["amax_history"]
    assert float(history[-1]) > 0
    assert model.blocks[0].proj.path == ("blocks", "0", "proj")


def test_a_path_recipe_on_an_unnamed_layer_is_a_clear_error_never_silently_unquantized():
    recipe = by_path(r"proj", CURRENT)
    model = Model(nnx.Rngs(0))
    with te_jax.autocast(recipe=recipe), pytest.raises(ValueError, match=r"path is not known yet.*name_paths"):
        model(normal(2, (2, 8, 32)))
    te_nnx.name_paths(model)
    with te_jax.autocast(recipe=recipe):
        got = model(normal(2, (2, 8, 32)))
    assert not bool(jnp.array_equal(got, model(normal(2, (2, 8, 32)))))  # now the proj layers quantize


def test_state_made_for_another_recipe_is_a_clear_error():
    with te_jax.autocast(recipe=by_path(r"^blocks/0/", DELAYED)):
        model = Model(nnx.Rngs(0))
        te_nnx.name_paths(model)
    x = normal(3, (2, 8, 32))
    with te_jax.autocast(recipe=by_path(r"^blocks/1/proj", DELAYED)), \
            pytest.raises(ValueError, match=r"Linear at blocks/1/proj has no FP8Meta state.*name_paths"):
        model(x)


def test_builtin_recipes_need_no_names():
    with te_jax.autocast(recipe=DELAYED):
        model = Model(nnx.Rngs(0))
        y = model(normal(4, (2, 8, 32)))  # every layer has its state already
    assert np.isfinite(np.asarray(y)).all()
    assert set(meta(model)) == {"blocks", "attn", "head"}
    # FP8 state is not statistics: a clear error, not an empty table
    with pytest.raises(ValueError, match=r"to_rows: the tree holds no statistics .*nnx.FP8Stats"):
        te_jax.inspect.to_rows(nnx.state(model, te_nnx.FP8Meta))


def test_inspector_rows_of_an_nnx_model_are_named_by_layer_path():
    x = normal(5, (2, 16, 32), 2.0)
    recipe = by_path(r"^blocks/0/|^lm_head", CURRENT)
    with te_jax.autocast(recipe=recipe, inspect=True):
        model = Model(nnx.Rngs(0))
        te_nnx.name_paths(model)

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=recipe, inspect=True):
            return te_nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

    step(model)
    rows = te_jax.inspect.to_rows(nnx.state(model, te_nnx.FP8Stats), step=1)
    layers = {r["layer"] for r in rows}
    assert layers == {"blocks/0/proj", "blocks/0/mlp/wi", "blocks/0/mlp/wo", "head"}
    roles = {r["role"] for r in rows if r["layer"] == "blocks/0/proj"}
    assert roles == {"linear_input", "linear_weight", "linear_grad_output"}
    assert all(r["step"] == 1 for r in rows)
    first = next(r for r in rows if r["layer"] == "blocks/0/proj" and r["role"] == "linear_input")
    norm_out = model.blocks[0].norm(x)
    np.testing.assert_allclose(first["amax"], float(jnp.max(jnp.abs(norm_out))), rtol=1e-6)
    assert te_jax.inspect.to_rows(nnx.to_pure_dict(nnx.state(model, te_nnx.FP8Stats))) == \
        te_jax.inspect.to_rows(nnx.state(model, te_nnx.FP8Stats))
    assert te_jax.inspect.to_rows(nnx.state(model, te_nnx.FP8Meta)) == []  # current scaling: no state, no rows


def test_inspector_rows_of_stacked_layers_carry_the_index():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        with te_jax.autocast(recipe=CURRENT, inspect=True):
            return te_nnx.Linear(16, 16, rngs=rngs)

    stacked = create(nnx.Rngs(0))
    rows = te_jax.inspect.to_rows(nnx.state(stacked, te_nnx.FP8Stats))
    assert sorted({r["layer"] for r in rows}) == ["[0]", "[1]", "[2]"]
    assert te_jax.inspect.to_rows({"stack": nnx.to_pure_dict(nnx.state(stacked, te_nnx.FP8Stats))})[0]["layer"] \
        == "stack[0]"
