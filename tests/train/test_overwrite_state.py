"""flax's overwrite-with-gradient state form (te_jax.quantize.overwrite) through te_jax.flax.DotGeneral: flax's
TrainState, a plain optax loop and te_jax.train keep it exactly equal, step by step, to te_jax.flax.DenseGeneral's
fp8_meta state; several uses merge; the silent failures raise."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT, fp32_max_grad
from flax.training import train_state

import te_jax
from qtest_util import assert_same_bits
from te_jax import flax as tf
from te_jax import recipe as R
from te_jax.core.dense import dense
from te_jax.core import DenseQuantizers
from te_jax.quantize import delayed, overwrite
from te_jax.train import FP8StateError

OWG = overwrite.OVERWRITE_COLLECTION
RECIPE = R.DelayedScaling(amax_history_len=4)
STEPS = 5
FEATURES = 16


def _rand(seed: int, shape) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _batch(step: int):
    """A batch whose amax changes every step (so the scales move) and its target."""
    x = _rand(step, (8, FEATURES)) * (1.0 + 0.7 * step)
    return x, jnp.sin(x[:, :8])


def _decoded(owg) -> dict:
    """The overwrite-form states as the (history, scale) dict the fp8_meta layers keep."""
    return jax.tree.map(lambda s: overwrite.to_delayed(s)._asdict(), owg, is_leaf=overwrite.is_state)


def _assert_states_equal(owg, fp8_meta, what: str) -> None:
    got = _decoded(owg)
    assert jax.tree.structure(got) == jax.tree.structure(fp8_meta), what
    jax.tree.map(lambda g, w: assert_same_bits(g, w, what), got, fp8_meta)


def _mse(model, v, x, y):
    return jnp.mean((model.apply(v, x)[:, :8] - y) ** 2)


REF = tf.DenseGeneral(FEATURES, use_bias=False)
INJECTED = nn.Dense(FEATURES, use_bias=False, dot_general_cls=tf.DotGeneral)


def _init():
    x = _batch(0)[0]
    with te_jax.autocast(recipe=RECIPE):
        ref = jax.jit(REF.init)(jax.random.key(0), x)
        inj = jax.jit(INJECTED.init)(jax.random.key(0), x)
    assert set(ref) == {"params", "fp8_meta"} and set(inj) == {"params", OWG}
    _assert_states_equal(inj[OWG]["DotGeneral_0"], ref["fp8_meta"], "initial")
    return ref, {**inj, "params": ref["params"]}


@functools.cache
def _reference_run():
    """te_jax.flax.DenseGeneral under te_jax.train.TrainState: (params, fp8_meta) after each step."""
    variables, _ = _init()
    state = te_jax.train.TrainState.create(apply_fn=REF.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state, x, y):
        with te_jax.autocast(recipe=RECIPE):
            grads = te_jax.train.grad(lambda v: _mse(REF, v, x, y))(state.params)
        return state.apply_gradients(grads=grads)

    out = []
    for i in range(STEPS):
        state = step(state, *_batch(i))
        out.append((state.params["params"], state.params["fp8_meta"]))
    return out


def _flax_train_state_run():
    """flax's own TrainState with params = the whole variables, gradients from jax.grad over them."""
    _, variables = _init()
    state = train_state.TrainState.create(apply_fn=INJECTED.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state, x, y):
        with te_jax.autocast(recipe=RECIPE):
            grads = jax.grad(lambda v: _mse(INJECTED, v, x, y))(state.params)
        return state.apply_gradients(grads=grads)

    out = []
    for i in range(STEPS):
        state = step(state, *_batch(i))
        out.append((state.params["params"], state.params[OWG]))
    return out


def _optax_run():
    """A plain optax loop: the optimizer on "params", the state overwritten with its gradient."""
    _, variables = _init()
    tx = optax.adam(1e-2)
    opt = tx.init(variables["params"])

    @jax.jit
    def step(variables, opt, x, y):
        with te_jax.autocast(recipe=RECIPE):
            grads = jax.grad(lambda v: _mse(INJECTED, v, x, y))(variables)
        updates, opt = tx.update(grads["params"], opt, variables["params"])
        return {"params": optax.apply_updates(variables["params"], updates), OWG: grads[OWG]}, opt

    out = []
    for i in range(STEPS):
        variables, opt = step(variables, opt, *_batch(i))
        out.append((variables["params"], variables[OWG]))
    return out


def _te_jax_run():
    """te_jax.train.TrainState and value_and_grad over variables holding the overwrite collection."""
    _, variables = _init()
    state = te_jax.train.TrainState.create(apply_fn=INJECTED.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state, x, y):
        with te_jax.autocast(recipe=RECIPE):
            _, grads = te_jax.train.value_and_grad(lambda v: _mse(INJECTED, v, x, y))(state.params)
        assert grads[OWG]["DotGeneral_0"]["linear_input"]["scale"].dtype == jnp.float32
        return state.apply_gradients(grads=grads)

    out = []
    for i in range(STEPS):
        state = step(state, *_batch(i))
        out.append((state.params["params"], state.params[OWG]))
    return out


@pytest.mark.parametrize("loop", [_flax_train_state_run, _optax_run, _te_jax_run])
def test_training_loops_keep_the_state_equal_to_dense_generals(loop):
    reference = _reference_run()
    scales = set()
    for i, ((params, owg), (ref_params, fp8_meta)) in enumerate(zip(loop(), reference)):
        jax.tree.map(lambda a, b: assert_same_bits(a, b, f"params after step {i}"), params, ref_params)
        _assert_states_equal(owg["DotGeneral_0"], fp8_meta, f"state after step {i}")
        scales.add(float(fp8_meta["linear_input"]["scale"][0]))
    assert len(scales) == STEPS  # the scales moved every step


class Twice(nn.Module):
    """One layer applied twice in a step: its state has two uses."""

    make: object

    @nn.compact
    def __call__(self, x):
        layer = self.make()
        return layer(jnp.tanh(layer(x)) * 3.0)


def test_several_uses_merge_like_te_jax_layers_and_float32_raises():
    ref_model = Twice(lambda: tf.DenseGeneral(FEATURES, use_bias=False, name="layer"))
    inj_model = Twice(lambda: nn.Dense(FEATURES, use_bias=False, dot_general_cls=tf.DotGeneral, name="layer"))
    x0 = _batch(0)[0]
    with te_jax.autocast(recipe=RECIPE):
        ref = jax.jit(ref_model.init)(jax.random.key(0), x0)
        inj = {**jax.jit(inj_model.init)(jax.random.key(0), x0), "params": ref["params"]}

    def loss(model, v, x):
        return jnp.sum(model.apply(v, x) ** 2)

    @jax.jit
    def ref_step(v, x):
        with te_jax.autocast(recipe=RECIPE):
            g = te_jax.train.grad(lambda v: loss(ref_model, v, x))(v)
        return {**v, "fp8_meta": te_jax.train.apply_fp8_update(v["fp8_meta"], g["fp8_meta"])}

    @jax.jit
    def te_jax_step(v, x):
        with te_jax.autocast(recipe=RECIPE):
            g = te_jax.train.grad(lambda v: loss(inj_model, v, x))(v)
        return {**v, OWG: g[OWG]}

    @jax.jit
    def max_merging_step(v, x):  # the MaxText way: the collection converted to fp32_max_grad inside the loss
        def max_merging_loss(v):
            return loss(inj_model, {**v, OWG: te_jax.train.to_max_merging(v[OWG])}, x)

        with te_jax.autocast(recipe=RECIPE):
            g = jax.grad(max_merging_loss)(v)
        return {**v, OWG: g[OWG]}

    a = b = inj
    for i in range(3):
        x = _batch(i)[0]
        ref, a, b = ref_step(ref, x), te_jax_step(a, x), max_merging_step(b, x)
        for v, what in ((a, "te_jax.train.grad"), (b, "fp32_max_grad")):
            _assert_states_equal(v[OWG]["layer"]["DotGeneral_0"], ref["fp8_meta"]["layer"], f"{what}, step {i}")
    # the merged history holds the larger input amax (the first use's: the second's is below 3), not a sum
    assert float(jnp.max(jnp.abs(x))) > 3.0
    assert float(a[OWG]["layer"]["DotGeneral_0"]["linear_input"]["amax_history"][-1]) == float(jnp.max(jnp.abs(x)))
    with te_jax.autocast(recipe=RECIPE), pytest.raises(FP8StateError, match="called more than once") as err:
        jax.grad(lambda v: loss(inj_model, v, x0))(inj)
    assert "te_jax.train.value_and_grad" in str(err.value) and "to_max_merging" in str(err.value)


def test_differentiating_params_only_raises():
    _, variables = _init()
    x, y = _batch(0)
    with te_jax.autocast(recipe=RECIPE), pytest.raises(FP8StateError, match="the weight is differentiated but"):
        jax.grad(lambda p: _mse(INJECTED, {**variables, "params": p}, x, y))(variables["params"])
    with te_jax.autocast(recipe=RECIPE):  # the input alone (e.g. a saliency map): nothing goes stale
        jax.grad(lambda x: _mse(INJECTED, variables, x, y))(x)
        # a stateless recipe keeps no state: params-only differentiation is fine
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        jax.grad(lambda p: _mse(INJECTED, {"params": p}, x, y))(variables["params"])


def test_a_step_that_does_not_use_the_module_restarts_its_calibration():
    _, variables = _init()
    x, y = _batch(1)
    with te_jax.autocast(recipe=RECIPE):
        grads = jax.jit(jax.grad(lambda v: _mse(INJECTED, v, x, y)))(variables)
        variables = {**variables, OWG: grads[OWG]}
        assert float(_decoded(variables[OWG])["DotGeneral_0"]["linear_input"]["scale"][0]) != 1.0

        def loss(v):
            INJECTED.apply(v, x)  # applied, its output not in the loss
            return jnp.sum(v["params"]["kernel"])

        unused = jax.jit(jax.grad(loss))(variables)
    restarted = _decoded(unused[OWG])["DotGeneral_0"]
    init = _decoded(overwrite.init_like(delayed.init_state(4)))
    jax.tree.map(lambda g, w: assert_same_bits(g, w, "restarted"), restarted["linear_input"], init)


# ---- the stored form ----------------------------------------------------------------------------------------


def _updates(seed: int, old: delayed.DelayedState, amaxes):
    q = delayed.DelayedScalingQuantizer(amax_history_len=old.amax_history.shape[-1])
    return [delayed.StateUpdate.of(q.state_gradient(old._asdict(), jnp.float32(a))) for a in amaxes]


AMAXES = [0.0, 0.5, 3.0, 1e-30, 7e4, float("inf"), float("nan")]


@pytest.mark.parametrize("history", ["zeros", "random"])
def test_max_of_stored_values_decodes_to_the_merged_update(history):
    hist = jnp.zeros((4,)) if history == "zeros" else jnp.abs(_rand(3, (4,))) * 5
    old = delayed.DelayedState(hist, jnp.asarray([37.5], jnp.float32))
    updates = _updates(0, old, AMAXES)
    for i, u in enumerate(updates):
        single = overwrite.from_update(old, u)
        jax.tree.map(lambda g, w: assert_same_bits(g, w, f"single {AMAXES[i]}"),
                     overwrite.to_delayed(single._asdict()), delayed.decode_update(old, u))
        for j, v in enumerate(updates):
            stored = jax.tree.map(jnp.maximum, single, overwrite.from_update(old, v))
            merged = jax.tree.map(jnp.maximum, u, v)
            jax.tree.map(lambda g, w: assert_same_bits(g, w, f"merge {AMAXES[i]}, {AMAXES[j]}"),
                         overwrite.to_delayed(stored._asdict()), delayed.decode_update(old, merged))


def test_zeros_and_the_merge_zero_are_the_initial_state():
    init = delayed.DelayedState(jnp.zeros((6,)), jnp.ones((1,)))
    for fill in (0.0, -np.inf):
        stored = jax.tree.map(lambda a: jnp.full_like(a, fill), overwrite.init_state(6))
        jax.tree.map(lambda g, w: assert_same_bits(g, w, str(fill)), overwrite.to_delayed(stored), init)
    assert set(overwrite.init_state(6)) == set(overwrite.FIELDS)
    assert overwrite.adds_cotangents(jnp.float32) and not overwrite.adds_cotangents(fp32_max_grad)
    assert OWG == OVERWRITE_WITH_GRADIENT


def test_state_update_declared_around_the_forward_is_accepted():
    q = DenseQuantizers.from_recipe(RECIPE)
    x, w, state = _rand(1, (8, 16)), _rand(2, (16, 8)), q.init_state()

    def f(x, w, s):
        return jnp.sum(dense(x, w, quantizers=q, state=s)[0])

    with te_jax.train.fp8_state_updates():
        _, vjp = jax.vjp(f, x, w, state)
    dstate = vjp(jnp.float32(1))[2]  # the backward traced outside the declaration
    assert float(dstate["linear_grad_output"]["amax_history"][-1]) == 1.0
    _, vjp = jax.vjp(f, x, w, state)
    with pytest.raises(FP8StateError, match="keeps FP8 state"):
        vjp(jnp.float32(1))
    with te_jax.train.fp8_state_updates():  # declared around the backward, as before
        vjp(jnp.float32(1))
