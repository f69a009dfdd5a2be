"""FP8 state under the training loops flax and optax users already have.

te_jax.train.TrainState with te_jax.train.value_and_grad is the reference.
Each other loop either gives identical losses, parameters and state step by
step (a stateless recipe: nothing but parameters to train) or raises, at
trace time, an error naming the fix (delayed scaling: the state would be
moved by the optimizer or left stale).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state

import te_jax
from te_jax import flax as te_flax
from te_jax import recipe as R
from te_jax.train.step import apply_fp8_update
from te_jax.train import FP8Gradients, FP8StateError, TrainState, fp8_state_updates, value_and_grad

DELAYED = R.DelayedScaling(amax_history_len=4)
CURRENT = R.Float8CurrentScaling()
STEPS = 3
NAMES_THE_FIX = "te_jax.train.value_and_grad"


class Net(nn.Module):
    """A LayerNormDenseGeneral then a DenseGeneral: both backward paths that return state updates."""

    @nn.compact
    def __call__(self, x):
        h = te_flax.LayerNormDenseGeneral(64, name="ln_dense")(x)
        return te_flax.DenseGeneral(32, name="out")(jax.nn.gelu(h))


def _data():
    x = jax.random.normal(jax.random.key(0), (16, 32)) * 3.0
    return x, jnp.sin(x)


def _init(recipe):
    x, _ = _data()
    with te_jax.autocast(recipe=recipe):
        return Net().init(jax.random.key(1), x)


def _loss(variables, x, y):
    return jnp.mean((Net().apply(variables, x) - y) ** 2)


def _tx():
    return optax.adamw(1e-2, weight_decay=0.1)


def _run(step, carry, variables_of):
    """(loss, variables) after each of STEPS jitted steps ``carry -> (*carry, loss)``."""
    step, out = jax.jit(step), []
    for _ in range(STEPS):
        *carry, loss = step(*carry)
        out.append((loss, variables_of(*carry)))
    return out


def _train_state_loop(recipe, state_cls=TrainState, grad_fn=value_and_grad):
    """A TrainState over all the variables; te_jax's with te_jax's value_and_grad is the reference."""
    x, y = _data()
    state = state_cls.create(apply_fn=Net().apply, params=_init(recipe), tx=_tx())

    def step(state):
        with te_jax.autocast(recipe=recipe):
            loss, grads = grad_fn(_loss)(state.params, x, y)
        return state.apply_gradients(grads=grads), loss

    return _run(step, (state,), lambda state: state.params)


def _reference(recipe):
    return _train_state_loop(recipe)


def _assert_same(got, want):
    assert len(got) == len(want)
    for (loss, variables), (loss_ref, variables_ref) in zip(got, want):
        assert jax.tree.structure(variables) == jax.tree.structure(variables_ref)
        np.testing.assert_array_equal(loss, loss_ref)
        jax.tree.map(np.testing.assert_array_equal, variables, variables_ref)


# ---- the loops ---------------------------------------------------------------------------


def _optax_loop(recipe, grad_fn=jax.value_and_grad):
    """A plain optax loop over ``variables``."""
    x, y = _data()
    variables, tx = _init(recipe), _tx()

    def step(variables, opt_state):
        with te_jax.autocast(recipe=recipe):
            loss, grads = grad_fn(_loss)(variables, x, y)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state, loss

    return _run(step, (variables, tx.init(variables)), lambda variables, _: variables)


def _params_only_loop(recipe, grad_fn=jax.value_and_grad):
    """Differentiating the parameters only, the other collections passed along un-differentiated."""
    x, y = _data()
    variables, tx = _init(recipe), _tx()
    params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def step(params, opt_state):
        with te_jax.autocast(recipe=recipe):
            loss, grads = grad_fn(lambda p: _loss({"params": p, **rest}, x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return _run(step, (params, tx.init(params)), lambda params, _: {"params": params, **rest})


def _te_grads_flax_train_state(recipe):
    return _train_state_loop(recipe, flax_train_state.TrainState, value_and_grad)


def _te_grads_optax_loop(recipe):
    return _optax_loop(recipe, value_and_grad)


LOOPS = {  # (a) flax's TrainState, (b) optax, (c) the parameters alone; then te_jax's gradients in (a), (b)
    "flax_train_state": lambda r: _train_state_loop(r, flax_train_state.TrainState, jax.value_and_grad),
    "optax_loop": _optax_loop,
    "params_only": _params_only_loop,
    "params_only_te_value_and_grad": lambda r: _params_only_loop(r, value_and_grad),
    "te_grads_flax_train_state": _te_grads_flax_train_state,
    "te_grads_optax_loop": _te_grads_optax_loop,
}


@pytest.mark.parametrize("loop", LOOPS)
def test_stateless_recipe_trains_identically_in_every_loop(loop):
    assert "fp8_meta" not in _init(CURRENT)
    _assert_same(LOOPS[loop](CURRENT), _reference(CURRENT))


@pytest.mark.parametrize("loop", ["flax_train_state", "optax_loop", "params_only", "params_only_te_value_and_grad"])
def test_delayed_scaling_differentiated_without_te_jax_raises_naming_the_fix(loop):
    with pytest.raises(FP8StateError, match=NAMES_THE_FIX) as err:
        LOOPS[loop](DELAYED)
    assert "te_jax.train.TrainState" in str(err.value) and "fp8_state_updates" in str(err.value)


def test_te_jax_gradients_refuse_flax_train_state():
    with pytest.raises(FP8StateError, match="step with te_jax.train.TrainState"):
        _te_grads_flax_train_state(DELAYED)


def test_te_jax_gradients_refuse_an_optax_update_over_all_variables():
    with pytest.raises(ValueError, match="FP8Gradients"):
        _te_grads_optax_loop(DELAYED)


def test_reference_moves_the_state():
    (_, first), *_, (_, last) = _reference(DELAYED)
    scale = last["fp8_meta"]["out"]["linear_input"]["scale"]
    assert float(scale[0]) != 1.0 and float(scale[0]) == float(first["fp8_meta"]["out"]["linear_input"]["scale"][0])


# ---- the gradients' type, the missing-state message, the functional API ------------------------


def test_gradients_type_keeps_dict_behaviour():
    x, y = _data()
    with te_jax.autocast(recipe=DELAYED):
        _, grads = value_and_grad(_loss)(_init(DELAYED), x, y)
    assert isinstance(grads, FP8Gradients) and isinstance(grads, dict)
    assert set(grads) == {"params", "fp8_meta"} and "fp8_meta" in grads
    same = jax.tree.map(jnp.asarray, grads)  # a tree operation that keeps every gradient whole
    assert isinstance(same, FP8Gradients) and jax.tree.structure(same) == jax.tree.structure(grads)
    scaled = jax.tree.map(lambda g: 2 * g, grads)  # would scale the FP8 state update too
    with pytest.raises(FP8StateError, match="merge_gradients"):
        scaled["fp8_meta"]
    doubled = jax.tree.map(lambda g: 2 * g, grads["params"])
    np.testing.assert_array_equal(doubled["out"]["kernel"], 2 * grads["params"]["out"]["kernel"])
    assert jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(grads)[0][0][0]).startswith("['fp8_meta']")


def test_missing_state_message_names_the_training_path():
    x, _ = _data()
    params = _init(DELAYED)["params"]
    with te_jax.autocast(recipe=DELAYED), pytest.raises(ValueError, match="has no fp8_meta state") as err:
        Net().apply({"params": params}, x)
    assert NAMES_THE_FIX in str(err.value) and "te_jax.train.TrainState" in str(err.value)


def _functional(x, kernel, state, quantizers):
    return jnp.sum(te_jax.dense(x, kernel, quantizers=quantizers, state=state)[0] ** 2)


def test_functional_dense_needs_the_declaration():
    x = jax.random.normal(jax.random.key(2), (16, 32))  # multiples of 16: cuBLASLt's alignment on a GPU
    kernel = jax.random.normal(jax.random.key(3), (32, 16))
    q = te_jax.core.DenseQuantizers.from_recipe(DELAYED)
    state = q.init_state()
    grad = jax.jit(jax.grad(_functional, argnums=(1, 2)), static_argnums=3)
    with pytest.raises(FP8StateError, match="fp8_state_updates"):
        grad(x, kernel, state, q)
    with fp8_state_updates():  # part of jit's cache key: traced again
        dk, dstate = grad(x, kernel, state, q)
    with fp8_state_updates(), fp8_state_updates(False), pytest.raises(FP8StateError):
        grad(x, kernel, state, q)
    new = apply_fp8_update(state, dstate)
    assert float(new["linear_input"]["amax_history"][-1]) == float(jnp.max(jnp.abs(x)))
    # the same as te_jax.train.value_and_grad over {"params", "fp8_meta"}
    _, want = value_and_grad(lambda v: _functional(x, v["params"], v["fp8_meta"], q))(
        {"params": kernel, "fp8_meta": state})
    np.testing.assert_array_equal(dk, want["params"])
    jax.tree.map(np.testing.assert_array_equal, new, apply_fp8_update(state, want["fp8_meta"]))


def test_stateless_functional_dense_needs_no_declaration():
    x = jax.random.normal(jax.random.key(2), (16, 32))  # multiples of 16: cuBLASLt's alignment on a GPU
    kernel = jax.random.normal(jax.random.key(3), (32, 16))
    q = te_jax.core.DenseQuantizers.from_recipe(CURRENT)
    assert np.isfinite(np.asarray(jax.grad(_functional, argnums=1)(x, kernel, {}, q))).all()


def test_fp8_state_updates_rejects_non_bool():
    with pytest.raises(ValueError, match="True or False"):
        fp8_state_updates(1)


# ---- DelayedScaling(scaling_factor_compute_algo=...): TransformerEngine's signature ----------------


def _te_style_scaling_factor(amax, scale, fp8_max, recipe):
    """A TransformerEngine-style callable: reads the recipe's margin and format."""
    assert isinstance(recipe, R.DelayedScaling)
    return jnp.where(amax > 0.0, (fp8_max / amax) / (2 ** (recipe.margin + 1)), scale)


@pytest.mark.parametrize("margin", [0, 2])
def test_scaling_factor_compute_algo_gets_the_recipe(margin):
    recipe = R.DelayedScaling(margin=margin, amax_history_len=2, scaling_factor_compute_algo=_te_style_scaling_factor)
    quantizer = recipe.quantizer("linear_grad_output")
    assert quantizer == recipe.quantizer("linear_grad_output") and hash(quantizer) == hash(recipe.quantizer(
        "linear_grad_output"))  # static in jit: equal recipes give equal quantizers
    with jax.default_device(jax.devices("cpu")[0]):  # IEEE float32 division, as NumPy's below
        state = quantizer.update_state(quantizer.init_state(), jnp.float32(3.0))
        assert float(state["scale"][0]) == float(np.float32(57344) / np.float32(3) / np.float32(2 ** (margin + 1)))
        state = quantizer.update_state(state, jnp.float32(0.0))  # the history still holds 3
        assert float(state["scale"][0]) == float(np.float32(57344) / np.float32(3) / np.float32(2 ** (margin + 1)))


def test_scaling_factor_compute_algo_trains_a_model():
    recipe = R.DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=_te_style_scaling_factor)
    (_, variables), = _reference(recipe)[:1]
    scale = variables["fp8_meta"]["out"]["linear_weight"]["scale"][0]
    amax = np.max(np.abs(np.asarray(_init(recipe)["params"]["out"]["kernel"])))
    assert float(scale) == float(np.float32(448) / np.float32(amax) / np.float32(2))


@pytest.mark.parametrize("bad", [lambda amax, scale, fp8_max: scale, lambda amax: amax, "max", 3])
def test_scaling_factor_compute_algo_is_validated(bad):
    with pytest.raises(ValueError, match=r"f\(amax, scale, fp8_max, recipe\)"):
        R.DelayedScaling(scaling_factor_compute_algo=bad)
