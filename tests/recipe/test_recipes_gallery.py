"""The recipes/ gallery: each file loads by path, decides per layer as documented, and trains."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_jax
from te_jax import recipe as R
from te_jax.quantize import CurrentScalingQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_jax.train import TrainState, value_and_grad

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_models import Transformer, mse  # noqa: E402

GALLERY = Path(__file__).resolve().parents[2] / "recipes"
NAMES = ["current_scaling_ref", "nvfp4_first_last_bf16", "mixed_per_layer"]


def _module(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"gallery_{name}", GALLERY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", NAMES)
def test_loads_by_path_and_is_documented(name):
    rec = R.load_recipe(str(GALLERY / f"{name}.py"))
    assert isinstance(rec, R.CustomRecipe) and isinstance(R.load_recipe(name), R.CustomRecipe)
    module = _module(name)
    assert module.__doc__ and len(module.__doc__) > 200 and callable(module.qfactory)


def test_current_scaling_ref_is_the_issues_example():
    q = _module("current_scaling_ref").qfactory
    want = {"linear_input": jnp.float8_e4m3fn, "linear_weight": jnp.float8_e4m3fn,
            "linear_output": jnp.float8_e5m2, "linear_grad_output": jnp.float8_e5m2}
    for role in R.ROLES:
        got = q(R.Role(role, ("any",)))
        assert got == (CurrentScalingQuantizer(dtype=want[role]) if role in want else None)


def test_nvfp4_first_last_bf16_decides_by_block():
    module = _module("nvfp4_first_last_bf16")
    assert module.NUM_LAYERS == 12
    q = module.make_qfactory(4)
    for block, quantized in [(0, False), (1, True), (2, True), (3, False)]:
        path = (f"TransformerLayer_{block}", "mlp", "wi")
        got = q(R.Role("linear_input", path))
        assert isinstance(got, NVFP4Quantizer) == quantized and (got is None) != quantized
    assert isinstance(q(R.Role("linear_weight", ("layers_2", "attention", "query"))), NVFP4Quantizer)
    assert q(R.Role("linear_weight", ("layers_2", "attention", "query"))).block_2d
    assert q(R.Role("linear_grad_output", ("blocks_1", "x"))).stochastic_rounding
    assert q(R.Role("linear_input", ("embed",))) is None and q(R.Role("linear_output", ("layers_1",))) is None
    assert module.qfactory(R.Role("linear_input", ("TransformerLayer_11",))) is None
    assert isinstance(module.qfactory(R.Role("linear_input", ("TransformerLayer_10",))), NVFP4Quantizer)


def test_load_recipe_passes_the_depth_to_make_qfactory():
    rec = R.load_recipe("nvfp4_first_last_bf16", num_layers=18)
    role = lambda block: R.Role("linear_input", (f"TransformerLayer_{block}", "mlp", "wi"))  # noqa: E731
    assert isinstance(rec.quantizer(role(16)), NVFP4Quantizer) and rec.quantizer(role(17)) is None
    default = R.load_recipe("nvfp4_first_last_bf16")  # the module's own qfactory: NUM_LAYERS = 12
    assert default.quantizer(role(11)) is None and default.quantizer(role(16)) is None
    # recipes without make_qfactory ignore the depth
    mixed = R.load_recipe("mixed_per_layer", num_layers=18)
    attn = R.Role("linear_input", ("TransformerLayer_17", "attention", "query"))
    assert mixed.quantizer(attn) == MXFP8Quantizer(jnp.float8_e4m3fn)
    for bad in (0, -1, 2.0, True, "18"):
        with pytest.raises(ValueError, match="num_layers"):
            R.load_recipe("nvfp4_first_last_bf16", num_layers=bad)


def test_mixed_per_layer_decides_by_layer():
    q = _module("mixed_per_layer").qfactory
    for name in ("query", "key", "value", "out_proj"):
        for role in ("linear_input", "linear_weight", "linear_grad_output"):
            assert isinstance(q(R.Role(role, ("TransformerLayer_0", "attention", name))), MXFP8Quantizer)
    mlp = [q(R.Role(r, ("TransformerLayer_0", "mlp", "wi"))) for r in R.ROLES]
    assert mlp == [CurrentScalingQuantizer(jnp.float8_e4m3fn), CurrentScalingQuantizer(jnp.float8_e4m3fn), None,
                   CurrentScalingQuantizer(jnp.float8_e5m2), None]
    assert q(R.Role("linear_input", ("embed",))) is None


def _recipe(name):
    if name == "nvfp4_first_last_bf16":
        return R.CustomRecipe(_module(name).make_qfactory(3))
    return R.load_recipe(str(GALLERY / f"{name}.py"))


@pytest.mark.parametrize("name", NAMES)
def test_trains_a_small_transformer(name):
    rec = _recipe(name)
    model = Transformer(num_layers=3, features=32)
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))
    y = jnp.roll(x, 1, axis=-1) * 0.5
    variables = jax.jit(model.init)(jax.random.key(1), x)  # stateless recipes: no fp8_meta to create
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state, key):
        def loss_fn(params):
            return mse(state.apply_fn(params, x, rngs={"quantize": key}), y)

        with te_jax.autocast(recipe=rec):
            loss, grads = value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, loss_fn(state.params)  # the last one in bf16

    losses = []
    for i in range(5):
        state, loss, plain = step(state, jax.random.fold_in(jax.random.key(2), i))
        losses.append(float(loss))
        assert float(loss) != float(plain)  # the recipe quantized something
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses
