"""te_jax.flax.RaggedDot injected into a Linen MoE FFN written with jax.lax.ragged_dot: exact outside autocast,
quantized under a recipe, its delayed-scaling state in "_overwrite_with_gradient" stepped by te_jax.train.TrainState
and by flax's own TrainState."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state
from jax import lax

from qtest_util import same_bits

import te_jax
from te_jax import recipe as R
from te_jax.quantize import CurrentScalingQuantizer, overwrite
from te_jax.train import TrainState

OWG = overwrite.OVERWRITE_COLLECTION

G, M, H, F = 4, 48, 32, 64
SIZES = [12, 0, 30, 4]  # an empty expert, rows past the groups


class ExpertFFN(nn.Module):
    """A MoE's experts as model code writes them (rows sorted by expert), with ``jax.lax.ragged_dot`` or
    ``te_jax.flax.RaggedDot`` injected."""

    te: bool = True

    @nn.compact
    def __call__(self, x, group_sizes):
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        wi = self.param("wi", init, (G, H, F))
        wo = self.param("wo", init, (G, F, H))
        dot_wi = te_jax.flax.RaggedDot(name="wi_dot") if self.te else lax.ragged_dot
        dot_wo = te_jax.flax.RaggedDot(name="wo_dot") if self.te else lax.ragged_dot
        return dot_wo(nn.gelu(dot_wi(x, wi, group_sizes)), wo, group_sizes)


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield




def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _data(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (M, H))
    target = jax.random.normal(keys[1], (M, H)) * 0.1
    return x, target, jnp.asarray(SIZES, jnp.int32), keys[2]


def _loss(model, variables, x, target, gs, rngs=None):
    return jnp.mean((model.apply(variables, x, gs, rngs=rngs) - target) ** 2)


def test_outside_autocast_is_lax_ragged_dot():
    x, target, gs, key = _data()
    variables = ExpertFFN().init(key, x, gs)
    assert set(variables) == {"params"}  # no state without a recipe
    want = jax.value_and_grad(lambda v: _loss(ExpertFFN(te=False), v, x, target, gs))(variables)
    got = jax.value_and_grad(lambda v: _loss(ExpertFFN(), v, x, target, gs))(variables)
    assert all(same_bits(u, v) for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


@pytest.mark.parametrize("use_te_train", [True, False], ids=["te_jax.train", "flax"])
def test_delayed_scaling_state_steps_with_train_state(use_te_train):
    x, target, gs, key = _data(1)
    model, rec = ExpertFFN(), R.DelayedScaling(amax_history_len=4)
    with te_jax.autocast(recipe=rec):
        variables = jax.jit(model.init)(key, x, gs)
    meta = variables[OWG]
    assert set(variables) == {"params", OWG}
    assert set(meta) == {"wi_dot", "wo_dot"}
    assert set(meta["wi_dot"]) == {"linear_input", "linear_weight", "linear_grad_output"}
    assert meta["wi_dot"]["linear_weight"]["amax_history"].shape == (G, 4)  # one history per expert weight
    assert meta["wi_dot"]["linear_input"]["amax_history"].shape == (4,)
    train_state = TrainState if use_te_train else flax_train_state.TrainState
    grad = te_jax.train.value_and_grad if use_te_train else jax.value_and_grad
    state = train_state.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))

    @jax.jit
    def step(state):
        with te_jax.autocast(recipe=rec):
            loss, grads = grad(lambda v: _loss(model, v, x, target, gs))(state.params)
        return state.apply_gradients(grads=grads), loss

    reference = ExpertFFN(te=False)
    for i in range(3):
        params = state.params["params"]
        want = _loss(reference, {"params": params}, x, target, gs)
        state, loss = step(state)
        meta = jax.tree.map(lambda s: overwrite.to_delayed(s)._asdict(), state.params[OWG], is_leaf=overwrite.is_state)
        for name, w in (("wi_dot", params["wi"]), ("wo_dot", params["wo"])):
            history = meta[name]["linear_weight"]["amax_history"]
            np.testing.assert_array_equal(history[:, -1], jnp.max(jnp.abs(w), axis=(1, 2)))  # this step's amaxes
            if i:
                assert np.all(np.asarray(history[:, -2]) > 0)  # and the step before's, one place on
        np.testing.assert_array_equal(meta["wi_dot"]["linear_input"]["amax_history"][-1], jnp.max(jnp.abs(x)))
        assert float(meta["wo_dot"]["linear_grad_output"]["amax_history"][-1]) > 0
        if i:  # from step 2 the scales fit the data: the loss within FP8's bound of the unquantized one
            assert 1e-6 < abs(float(loss) - float(want)) < 0.05 * float(want), (float(loss), float(want))
    with te_jax.autocast(recipe=rec), pytest.raises(te_jax.train.FP8StateError, match="is not"):
        jax.eval_shape(jax.grad(lambda v: _loss(model, {"params": v, OWG: state.params[OWG]}, x, target, gs)),
                       state.params["params"])  # the weights differentiated, the state not: stale, refused


@pytest.mark.parametrize("rec", [R.Float8CurrentScaling(), R.NVFP4BlockScaling()], ids=["current", "nvfp4"])
def test_stateless_recipes_match_lax(rec):
    x, target, gs, key = _data(2)
    model = ExpertFFN()
    variables = model.init(key, x, gs)
    rngs = {"quantize": jax.random.key(3)}
    with te_jax.autocast(recipe=rec):
        assert set(jax.jit(model.init)(key, x, gs)) == {"params"}
        got = jax.jit(jax.value_and_grad(lambda v: _loss(model, v, x, target, gs, rngs)))(variables)
    want = jax.value_and_grad(lambda v: _loss(ExpertFFN(te=False), v, x, target, gs))(variables)
    tol = 0.1 if isinstance(rec, R.Float8CurrentScaling) else 0.4
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert 1e-5 < _rel(u, v) < tol, _rel(u, v)


def test_recipe_sees_the_module_path():
    """A CustomRecipe chooses by path: only "wo_dot" quantized, "wi_dot" stays lax.ragged_dot."""
    seen = set()

    def qfactory(role):
        seen.add(role.path)
        return CurrentScalingQuantizer(jnp.float8_e4m3fn) if role.path[-1] == "wo_dot" and role in (
            "linear_input", "linear_weight") else None

    x, _, gs, key = _data(3)
    model = ExpertFFN()
    variables = model.init(key, x, gs)
    wi, wo = variables["params"]["wi"], variables["params"]["wo"]
    with te_jax.autocast(recipe=R.CustomRecipe(qfactory)):
        y = jax.jit(model.apply)(variables, x, gs)
    assert seen == {("wi_dot",), ("wo_dot",)}
    h = nn.gelu(lax.ragged_dot(x, wi, gs))
    assert 1e-5 < _rel(y, lax.ragged_dot(h, wo, gs)) < 0.06


def test_missing_state_names_the_module():
    x, _, gs, key = _data()
    variables = ExpertFFN().init(key, x, gs)  # built without the recipe: no state
    with te_jax.autocast(recipe=R.DelayedScaling()), pytest.raises(ValueError, match="RaggedDot at wi_dot has no "
                                                                                     "_overwrite_with_gradient state"):
        ExpertFFN().apply(variables, x, gs)
