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


DEPTH = {"nvfp4_first_last_bf16": 4}  # the recipes that place quantization by block need the model's depth


@pytest.mark.parametrize("name", NAMES)
def test_loads_by_path_and_is_documented(name):
    depth = DEPTH.get(name)
    rec = R.load_recipe(str(GALLERY / f"{name}.py"), num_layers=depth)
    assert isinstance(rec, R.CustomRecipe) and isinstance(R.load_recipe(name, num_layers=depth), R.CustomRecipe)
    module = _module(name)
    assert module.__doc__ and len(module.__doc__) > 200
    assert callable(module.make_qfactory) if depth else callable(module.qfactory)


def test_current_scaling_ref_is_the_issues_example():
    q = _module("current_scaling_ref").qfactory
    want = {"linear_input": jnp.float8_e4m3fn, "linear_weight": jnp.float8_e4m3fn,
            "linear_output": jnp.float8_e5m2, "linear_grad_output": jnp.float8_e5m2}
    for role in R.ROLES:
        got = q(R.Role(role, ("any",)))
        assert got == (CurrentScalingQuantizer(dtype=want[role]) if role in want else None)


def test_nvfp4_first_last_bf16_decides_by_block():
    module = _module("nvfp4_first_last_bf16")
    assert not hasattr(module, "qfactory") and not hasattr(module, "NUM_LAYERS")  # no default depth
    q = module.make_qfactory(4)
    for block, quantized in [(0, False), (1, True), (2, True), (3, False)]:
        path = (f"TransformerLayer_{block}", "mlp", "wi")
        got = q(R.Role("linear_input", path))
        assert isinstance(got, NVFP4Quantizer) == quantized and (got is None) != quantized
    assert isinstance(q(R.Role("linear_weight", ("layers_2", "attention", "query"))), NVFP4Quantizer)
    assert q(R.Role("linear_weight", ("layers_2", "attention", "query"))).block_2d
    assert q(R.Role("linear_grad_output", ("blocks_1", "x"))).stochastic_rounding
    assert q(R.Role("linear_input", ("embed",))) is None and q(R.Role("linear_output", ("layers_1",))) is None
    with pytest.raises(ValueError, match=r"built for num_layers=4, but the layer at TransformerLayer_4/mlp/wi lies "
                                         r"in block 4: load it with the model's depth"):
        q(R.Role("linear_input", ("TransformerLayer_4", "mlp", "wi")))  # a deeper model than the recipe's
    two = module.make_qfactory(2)  # both blocks are the first or the last: nothing quantized
    assert all(two(R.Role(r, (f"TransformerLayer_{b}", "mlp", "wi"))) is None for r in R.ROLES for b in (0, 1))
    assert two(R.Role("linear_input", ("block_0",))) is None
    for bad in (0, -1, 2.0, True, "3", None):
        with pytest.raises(ValueError, match="num_layers must be a positive int"):
            module.make_qfactory(bad)


def test_nvfp4_first_last_bf16_reads_an_nnx_models_block_list():
    """An NNX model's blocks in a list have paths ("blocks", "1", ...): the number after the list's name is the
    block (before, no block was found and every layer stayed bf16 silently)."""
    q = _module("nvfp4_first_last_bf16").make_qfactory(4)
    for container in ("blocks", "layers", "decoder_layers", "TransformerLayers"):
        got = [q(R.Role("linear_input", (container, str(b), "mlp", "dot_general"))) for b in range(4)]
        assert [isinstance(g, NVFP4Quantizer) for g in got] == [False, True, True, False], container
    assert q(R.Role("linear_input", ("model", "blocks", "2", "attn", "query"))) is not None
    assert q(R.Role("linear_input", ("blocks", "mlp"))) is None  # no number: outside numbered blocks
    assert q(R.Role("linear_input", ("heads", "2", "proj"))) is None  # not a block list
    with pytest.raises(ValueError, match=r"layer at blocks/9/mlp lies in block 9"):
        q(R.Role("linear_input", ("blocks", "9", "mlp")))


def test_load_recipe_takes_the_depth_from_the_caller_and_has_no_default():
    rec = R.load_recipe("nvfp4_first_last_bf16", num_layers=18)
    role = lambda block: R.Role("linear_input", (f"TransformerLayer_{block}", "mlp", "wi"))  # noqa: E731
    assert isinstance(rec.quantizer(role(16)), NVFP4Quantizer) and rec.quantizer(role(17)) is None
    for where in ("nvfp4_first_last_bf16", str(GALLERY / "nvfp4_first_last_bf16.py")):
        with pytest.raises(ValueError) as err:
            R.load_recipe(where)
        assert str(err.value) == (
            f"te_jax: recipe {where!r} places quantization by transformer block and needs the model's depth: "
            f"load_recipe({where!r}, num_layers=<the model's number of blocks>)")
    with pytest.raises(ValueError, match="lies in block 12"):
        R.load_recipe("nvfp4_first_last_bf16", num_layers=12).quantizer(role(12))
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


def _quantized_paths(model, rec, x) -> set[tuple[str, ...]]:
    """The module paths whose roles the recipe quantizes when ``model`` is traced under it."""
    asked = set()

    def qfactory(role):
        q = rec.quantizer(role)
        if q is not None:
            asked.add(role.path)
        return q

    with te_jax.autocast(recipe=R.CustomRecipe(qfactory)):
        jax.eval_shape(model.init, jax.random.key(0), x)
    return asked


def test_nvfp4_first_last_bf16_takes_the_depth_of_the_model_it_runs():
    """On a 2-block model nothing is quantized (both blocks are an end), on 4 blocks the middle two; a recipe
    built for a shallower model than the one it runs raises instead of quantizing the last block."""
    x = jnp.zeros((2, 8, 32))
    for depth, blocks in ((2, set()), (4, {"TransformerLayer_1", "TransformerLayer_2"})):
        model = Transformer(num_layers=depth, features=32)
        rec = R.load_recipe("nvfp4_first_last_bf16", num_layers=model.num_layers)
        assert {path[0] for path in _quantized_paths(model, rec, x)} == blocks
    with pytest.raises(ValueError, match="built for num_layers=2, but the layer at TransformerLayer_2/"):
        _quantized_paths(Transformer(num_layers=3, features=32),
                         R.load_recipe("nvfp4_first_last_bf16", num_layers=2), x)


@pytest.mark.parametrize("name", NAMES)
def test_trains_a_small_transformer(name):
    model = Transformer(num_layers=3, features=32)
    rec = R.load_recipe(str(GALLERY / f"{name}.py"), num_layers=model.num_layers)
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
