"""NNX FP8 state where no backward runs (issue 42): a frozen branch under te_jax.nnx.value_and_grad records its
forward state, ``calibrate`` applies a forward-only pass, and a layer called twice merges by max either way."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import te_jax
from te_jax import recipe as R
from te_jax.nnx import calibrate
from qtest_util import same_bits

REC = R.DelayedScaling(amax_history_len=4)


def _div(a, b) -> float:
    return float(jax.jit(jnp.divide)(np.float32(a), np.float32(b)))


def _x(seed, amax, shape=(16, 32)):
    x = jax.random.uniform(jax.random.key(seed), shape, minval=-amax / 2, maxval=amax / 2)
    return x.at[3, 5].set(-amax)


def _state(layer):
    return jax.tree.map(np.asarray, layer.fp8_meta.get_value())


class Frozen(nnx.Module):
    def __init__(self, rngs):
        self.enc = te_jax.nnx.Linear(32, 32, rngs=rngs)
        self.head = te_jax.nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(lax.stop_gradient(self.enc(x)) / 1000)


def test_frozen_branch_records_its_forward_state():
    x = _x(0, 1000.0)
    with te_jax.autocast(recipe=REC):
        model = Frozen(nnx.Rngs(0))
    before = _state(model.enc)

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=REC):
            te_jax.nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

    step(model)
    enc = _state(model.enc)
    assert float(enc["linear_input"]["scale"][0]) == _div(448, 1000)  # was 1
    assert float(enc["linear_weight"]["amax_history"][-1]) == float(jnp.max(jnp.abs(model.enc.kernel.get_value())))
    assert same_bits(enc["linear_grad_output"]["scale"], before["linear_grad_output"]["scale"])
    assert float(_state(model.head)["linear_grad_output"]["scale"][0]) != 1.0


class FrozenRemat(Frozen):
    def __call__(self, x):
        return self.head(lax.stop_gradient(nnx.remat(lambda m, x: m(x))(self.enc, x)) / 1000)


def test_a_state_te_jax_cannot_record_warns_and_names_the_layer():
    x = _x(3, 100.0)
    with te_jax.autocast(recipe=REC):
        model = FrozenRemat(nnx.Rngs(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with te_jax.autocast(recipe=REC):
            te_jax.nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    messages = [str(w.message) for w in caught if "te_jax" in str(w.message)]
    # named by its path in the model (not "enc/fp8_meta/value"), with the NNX way to calibrate it
    assert len(messages) == 1 and "state of enc gets no update" in messages[0], messages
    assert "te_jax.nnx.calibrate" in messages[0]
    assert float(_state(model.enc)["linear_input"]["scale"][0]) == 1.0
    with te_jax.autocast(recipe=REC):  # the remedy the warning names
        calibrate(lambda m: m.enc(x))(model)
    assert float(_state(model.enc)["linear_input"]["scale"][0]) == _div(448, 100)


class Twice(nnx.Module):
    def __init__(self, rngs):
        self.shared = te_jax.nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, a, b):
        return self.shared(a), self.shared(b)


def test_calibrate_applies_a_forward_pass_and_merges_as_training_does():
    a, b = _x(1, 10.0), _x(2, 2.0)
    with te_jax.autocast(recipe=REC):
        model, trained = Twice(nnx.Rngs(0)), Twice(nnx.Rngs(0))
    initial = _state(model.shared)
    with te_jax.autocast(recipe=REC):
        model(a, b)  # a plain call reads the state and leaves it
    assert jax.tree.all(jax.tree.map(same_bits, _state(model.shared), initial))

    @nnx.jit
    def calibrated(model):
        with te_jax.autocast(recipe=REC):
            return calibrate(lambda m: m(a, b))(model)

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=REC):
            te_jax.nnx.value_and_grad(lambda m: sum(jnp.sum(y) for y in m(a, b)))(model)

    calibrated(model)
    step(trained)
    got, want = _state(model.shared), _state(trained.shared)
    for role in ("linear_input", "linear_weight"):  # two calls, one step merged by max, as in training
        assert jax.tree.all(jax.tree.map(same_bits, got[role], want[role])), role
    assert np.count_nonzero(got["linear_input"]["amax_history"]) == 1
    assert float(got["linear_input"]["scale"][0]) == _div(448, 10)
    assert jax.tree.all(jax.tree.map(same_bits, got["linear_grad_output"], initial["linear_grad_output"]))
    with te_jax.autocast(recipe=REC):  # eagerly too; a second pass advances the history
        calibrate(lambda m: m(b, b))(model)
    assert np.count_nonzero(_state(model.shared)["linear_input"]["amax_history"]) == 2
