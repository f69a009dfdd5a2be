"""FP8 state that used to go silently wrong (issue 42): each test failed before its fix.

1. a delayed-scaling layer whose output gets no gradient (stop_gradient, a frozen encoder) records its forward
   state in training; where te_jax cannot record it (inside nn.remat), a warning names it;
2. a NaN or Inf amax is skipped (recorded as 0), not frozen into the history, and counted in the statistics;
5. FP8Gradients summed or scaled by a tree operation are refused (eagerly), or poisoned (inside jit);
6. a scaling_factor_compute_algo returning NaN, Inf, 0 or a wrong shape keeps the scale / raises naming the field;
7. a layer called twice in a mutable apply merges its two updates as training does.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import te_jax
from te_jax import recipe as R
from te_jax.inspect import mean_over, to_rows
from te_jax.quantize import DelayedScalingQuantizer
from te_jax.train import FP8StateError, TrainState, apply_fp8_update, merge_gradients, value_and_grad
from qtest_util import same_bits

F32 = np.float32
REC = R.DelayedScaling(amax_history_len=4)
DenseGeneral = te_jax.flax.DenseGeneral


def _div(a, b) -> float:
    return float(jax.jit(jnp.divide)(F32(a), F32(b)))


def _x(seed, amax, shape=(16, 32)):
    """Uniform in [-amax/2, amax/2] with one element -amax: max |x| is amax exactly."""
    x = jax.random.uniform(jax.random.key(seed), shape, minval=-amax / 2, maxval=amax / 2)
    return x.at[3, 5].set(-amax)


def _tree_same_bits(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        same_bits(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---- 1. forward recording where no backward runs -----------------------------------------------------------


class Frozen(nn.Module):
    """A frozen encoder (its output under stop_gradient, optionally rematerialized) in front of a trained head."""

    remat: bool = False

    @nn.compact
    def __call__(self, x):
        enc = (nn.remat(DenseGeneral) if self.remat else DenseGeneral)(32, name="enc")
        return DenseGeneral(8, name="head")(lax.stop_gradient(enc(x)) / 1000)


def _frozen_step(model, variables, x):
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(1e-3))

    @jax.jit
    def step(state):
        with te_jax.autocast(recipe=REC):
            _, grads = value_and_grad(lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    return step(state).params["fp8_meta"]


def test_frozen_branch_records_its_forward_state():
    x = _x(0, 1000.0)
    with te_jax.autocast(recipe=REC):
        variables = Frozen().init(jax.random.key(1), x)
        _, forward = Frozen().apply(variables, x, mutable=["fp8_meta"])  # the forward-updated state
    meta = _frozen_step(Frozen(), variables, x)
    enc = meta["enc"]
    assert float(enc["linear_input"]["scale"][0]) == _div(448, 1000)  # was 1: 64% of the inputs saturated
    assert float(enc["linear_input"]["amax_history"][-1]) == 1000.0
    for role in ("linear_input", "linear_weight"):  # exactly what the forward pass computes
        assert _tree_same_bits(enc[role], forward["fp8_meta"]["enc"][role]), role
    # the backward-only role never ran, and the head (which has a gradient) steps as before
    assert _tree_same_bits(enc["linear_grad_output"], variables["fp8_meta"]["enc"]["linear_grad_output"])
    assert float(meta["head"]["linear_grad_output"]["scale"][0]) != 1.0


def test_a_state_te_jax_cannot_record_warns_and_names_the_layer():
    x = _x(2, 100.0)
    with te_jax.autocast(recipe=REC):
        variables = Frozen(remat=True).init(jax.random.key(1), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = _frozen_step(Frozen(remat=True), variables, x)
    messages = [str(w.message) for w in caught if "te_jax" in str(w.message)]
    assert len(messages) == 1 and "state of enc gets no update" in messages[0] and "mutable=['fp8_meta']" in \
        messages[0], messages
    assert float(meta["enc"]["linear_input"]["scale"][0]) == 1.0  # inside nn.remat: not recorded, but said so
    with warnings.catch_warnings(record=True) as caught:  # with a gradient: nothing to warn about
        warnings.simplefilter("always")
        with te_jax.autocast(recipe=REC):
            value_and_grad(lambda v: jnp.sum(nn.remat(DenseGeneral)(8).apply(v, x)))(
                DenseGeneral(8).init(jax.random.key(0), x) | {})
    assert not [w for w in caught if "te_jax" in str(w.message)]


# ---- 2. a non-finite amax ---------------------------------------------------------------------------------


def test_a_nan_amax_does_not_freeze_the_scale():
    q = DelayedScalingQuantizer(amax_history_len=8)
    state = q.update_state(q.init_state(), jnp.float32(2.0))
    skipped = []
    for amax in (np.nan, np.inf, 8.0, 4.0):
        skipped.append(float(q.update_skipped(state, jnp.float32(amax))[0]))
        state = q.update_state(state, jnp.float32(amax))
        assert np.all(np.isfinite(state["amax_history"]))
    assert skipped == [1.0, 1.0, 0.0, 0.0]
    assert float(state["scale"][0]) == 56.0  # 448 / max(2, 8, 4); was frozen at 224 for the whole window


def test_a_nan_micro_batch_merges_as_zero_and_is_counted():
    layer = DenseGeneral(16)
    x = _x(3, 4.0)
    with te_jax.autocast(recipe=REC, inspect=True):
        variables = layer.init(jax.random.key(0), x)

    @jax.jit
    def grads(v, x):
        with te_jax.autocast(recipe=REC, inspect=True):
            return value_and_grad(lambda v: jnp.sum(layer.apply(v, x)))(v)[1]

    bad, good = grads(variables, x.at[0, 0].set(jnp.nan)), grads(variables, x)
    merged = merge_gradients(bad, good)
    assert _tree_same_bits(merged["fp8_meta"]["linear_input"], good["fp8_meta"]["linear_input"])
    new = apply_fp8_update(variables["fp8_meta"], merged["fp8_meta"])
    assert float(new["linear_input"]["scale"][0]) == _div(448, 4)
    rows = to_rows(merged["fp8_stats"])
    skipped = {r["role"]: r["skipped_update"] for r in rows}
    assert skipped["linear_input"] == 1.0 and skipped["linear_weight"] == 0.0
    steps = to_rows(bad["fp8_stats"], step=0) + to_rows(good["fp8_stats"], step=1) + to_rows(bad["fp8_stats"], step=2)
    counted = {r["role"]: r["skipped_update"] for r in mean_over(steps)}
    assert counted["linear_input"] == 2.0 and counted["linear_weight"] == 0.0  # counted over steps, not averaged


# ---- 5. FP8 gradients combined by tree operations ---------------------------------------------------------


def _micro_batch_grads(n=3):
    layer = DenseGeneral(16)
    xs = [_x(10 + i, 1.0 + i) for i in range(n)]
    with te_jax.autocast(recipe=REC):
        variables = layer.init(jax.random.key(0), xs[0])
    fn = jax.jit(lambda v, x: value_and_grad(lambda v: jnp.sum(layer.apply(v, x) ** 2))(v)[1])
    with te_jax.autocast(recipe=REC):
        return layer, variables, [fn(variables, x) for x in xs]


def test_tree_operations_that_mix_fp8_gradients_are_refused():
    layer, variables, gs = _micro_batch_grads()
    summed = jax.tree.map(jnp.add, gs[0], gs[1])  # was accepted: the scale came out several times too large
    with pytest.raises(FP8StateError, match="merge_gradients"):
        summed["fp8_meta"]
    state = TrainState.create(apply_fn=layer.apply, params=variables, tx=optax.sgd(1e-3))
    with pytest.raises(FP8StateError, match="accumulate_gradients"):
        state.apply_gradients(grads=summed)
    for mixed in (jax.tree.map(lambda *g: sum(g) / 3, *gs),  # a mean of different updates
                  jax.tree.map(lambda g: 0.5 * g, gs[0])):  # a scaled update
        with pytest.raises(FP8StateError):
            merge_gradients(mixed, gs[0])
    assert np.all(np.isfinite(summed["params"]["kernel"]))  # the parameters' part stays usable
    acc = jax.tree.map(jnp.zeros_like, gs[0])
    jax.tree.map(jnp.add, acc, gs[0])["fp8_meta"]  # zeros + one gradient is that gradient: accepted
    # what keeps every gradient whole keeps working: te_jax's merge, jit, device_get, a pmean of identical copies
    merged = merge_gradients(merge_gradients(gs[0], gs[1]), gs[2])
    jax.jit(lambda g: g)(merged)["fp8_meta"]
    jax.device_get(merged)["fp8_meta"]
    copies = jax.tree.map(lambda a: jnp.stack([a, a]), merged)
    averaged = jax.vmap(lambda g: lax.pmean(g, "i"), axis_name="i")(copies)
    jax.tree.map(lambda a: a[0], averaged)["fp8_meta"]
    tx = optax.adam(1e-3)
    tx.update(merged["params"], tx.init(variables["params"]), variables["params"])
    state.apply_gradients(grads=merged)


def test_mixed_fp8_gradients_inside_jit_poison_the_state():
    layer, variables, gs = _micro_batch_grads(2)
    state = TrainState.create(apply_fn=layer.apply, params=variables, tx=optax.sgd(1e-3))
    step = jax.jit(lambda s, a, b, mix: s.apply_gradients(grads=jax.tree.map(jnp.add, a, b) if mix else
                                                          merge_gradients(a, b)), static_argnums=3)
    good = step(state, gs[0], gs[1], False).params["fp8_meta"]
    bad = step(state, gs[0], gs[1], True).params["fp8_meta"]
    assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(good))
    assert all(np.all(np.isnan(v)) for v in jax.tree.leaves(bad))  # loud, not a silently wrong scale


# ---- 6. scaling_factor_compute_algo ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, 0.0, -1.0])
def test_a_rejected_scale_keeps_the_old_one_and_is_counted(bad):
    q = DelayedScalingQuantizer(amax_history_len=2, scaling_factor_compute_algo=lambda a, s, m, mg: s * 0 + bad)
    state = {"amax_history": jnp.zeros(2), "scale": jnp.array([7.0], jnp.float32)}
    new = q.update_state(state, jnp.float32(3.0))
    assert float(new["scale"][0]) == 7.0  # NaN/Inf were capped to 2^126 (every element saturated), 0 gave Inf
    assert float(q.update_skipped(state, jnp.float32(3.0))[0]) == 1.0


def test_a_wrong_shape_names_the_recipe_field():
    x = _x(4, 2.0)
    for field, fn in (("scaling_factor_compute_algo", lambda a, s, m, r: jnp.ones((3,))),
                      ("amax_compute_algo", lambda h: h[:2])):
        rec = R.DelayedScaling(amax_history_len=4, **{field: fn})
        with te_jax.autocast(recipe=rec), pytest.raises(ValueError, match=rf"DelayedScaling\.{field} .*shape \(1,\)"):
            DenseGeneral(16).init(jax.random.key(0), x)  # was a bare reshape error


# ---- 7. a layer called twice in a mutable apply ---------------------------------------------------------


class Twice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
        layer = DenseGeneral(16, name="shared")
        return layer(a), layer(b)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_layer_called_twice_in_a_mutable_apply_merges_as_training_does(algo):
    rec = R.DelayedScaling(amax_history_len=4, amax_compute_algo=algo)
    a, b = _x(5, 10.0), _x(6, 2.0)  # the larger amax first: a last write would keep 2
    with te_jax.autocast(recipe=rec, inspect=True):
        variables = Twice().init(jax.random.key(0), a, b)
        _, applied = Twice().apply(variables, a, b, mutable=["fp8_meta", "fp8_stats"])
        _, grads = jax.jit(value_and_grad(lambda v: sum(jnp.sum(y) for y in Twice().apply(v, a, b))))(variables)
    trained = apply_fp8_update(variables["fp8_meta"], grads["fp8_meta"])["shared"]
    mutable = applied["fp8_meta"]["shared"]
    for role in ("linear_input", "linear_weight"):
        assert _tree_same_bits(mutable[role], trained[role]), role
    assert float(mutable["linear_input"]["scale"][0]) == _div(448, 10)
    assert np.count_nonzero(mutable["linear_input"]["amax_history"]) == 1  # one step, not two
    assert float(applied["fp8_stats"]["shared"]["linear_input"]["amax"]) == 10.0  # statistics merge by max too
    with te_jax.autocast(recipe=rec):  # a second apply starts from the state the first one stored
        _, again = Twice().apply({**variables, **applied}, b, b, mutable=["fp8_meta"])
    assert np.count_nonzero(again["fp8_meta"]["shared"]["linear_input"]["amax_history"]) == 2
