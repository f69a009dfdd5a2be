"""te_jax.nnx.RaggedDot injected into an NNX MoE FFN written with jax.lax.ragged_dot: exact outside autocast, its
delayed-scaling FP8Meta stepped by te_jax.nnx.value_and_grad equal, step by step, to te_jax.flax.RaggedDot's."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx.nn import initializers
from jax import lax

from qtest_util import tree_same_bits

import te_jax
from te_jax import nnx as te_nnx
from te_jax import recipe as R
from te_jax.quantize import CurrentScalingQuantizer
from te_jax.quantize.overwrite import OVERWRITE_COLLECTION, to_delayed

G, M, H, F = 4, 48, 32, 64
SIZES = [12, 0, 30, 4]
DELAYED = R.DelayedScaling(amax_history_len=4)


class ExpertFFN(nnx.Module):
    """A MoE's experts as NNX model code writes them, with ``te_jax.nnx.RaggedDot`` injected (or lax's)."""

    def __init__(self, rngs: nnx.Rngs, te: bool = True):
        init = initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.wi = nnx.Param(init(rngs.params(), (G, H, F)))
        self.wo = nnx.Param(init(rngs.params(), (G, F, H)))
        self.te = te
        self.wi_dot = te_nnx.RaggedDot(G, rngs=rngs, path="wi_dot") if te else nnx.data(None)
        self.wo_dot = te_nnx.RaggedDot(G, rngs=rngs, path="wo_dot") if te else nnx.data(None)

    def __call__(self, x, group_sizes):
        dot_wi = self.wi_dot if self.te else lax.ragged_dot
        dot_wo = self.wo_dot if self.te else lax.ragged_dot
        return dot_wo(nn.gelu(dot_wi(x, self.wi[...], group_sizes)), self.wo[...], group_sizes)


class LinenFFN(nn.Module):
    """The same FFN in Linen with ``te_jax.flax.RaggedDot`` (its state in "_overwrite_with_gradient", in the stored
    form of te_jax.quantize.overwrite: ``to_delayed`` gives the NNX FP8Meta's layout)."""

    @nn.compact
    def __call__(self, x, group_sizes):
        wi = self.param("wi", nn.initializers.zeros, (G, H, F))
        wo = self.param("wo", nn.initializers.zeros, (G, F, H))
        h = nn.gelu(te_jax.flax.RaggedDot(name="wi_dot")(x, wi, group_sizes))
        return te_jax.flax.RaggedDot(name="wo_dot")(h, wo, group_sizes)


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _pure(state) -> dict:
    return nnx.to_pure_dict(state)




def _fp8_linen_layout(tree):
    """``{"wi_dot": {"fp8_meta": s}}`` -> ``{"wi_dot": s}``."""
    return {k: v["fp8_meta"] for k, v in tree.items()}


def _delayed(stored):
    """The Linen module's "_overwrite_with_gradient" state as the delayed state it quantizes with."""
    return {layer: {role: dict(to_delayed(s)._asdict()) for role, s in roles.items()} for layer, roles in stored.items()}


def _data(seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    return jax.random.normal(keys[0], (M, H)), jax.random.normal(keys[1], (M, H)) * 0.1, jnp.asarray(SIZES, jnp.int32)


def test_outside_autocast_is_lax_ragged_dot():
    x, _, gs = _data()
    model, reference = ExpertFFN(nnx.Rngs(0)), ExpertFFN(nnx.Rngs(0), te=False)
    assert model.wi_dot.fp8_meta is None and not jax.tree.leaves(nnx.state(model, te_nnx.FP8Meta))
    assert tree_same_bits(model(x, gs), reference(x, gs))


def test_delayed_state_steps_equal_the_linen_module():
    x, target, gs = _data(1)
    with te_jax.autocast(recipe=DELAYED):
        model = ExpertFFN(nnx.Rngs(0))
        linen_vars = jax.jit(LinenFFN().init)(jax.random.key(0), x, gs)
    meta = _pure(nnx.state(model, te_nnx.FP8Meta))
    assert meta["wi_dot"]["fp8_meta"]["linear_weight"]["amax_history"].shape == (G, 4)
    assert tree_same_bits(_fp8_linen_layout(meta), _delayed(linen_vars[OVERWRITE_COLLECTION]))
    state = te_jax.train.TrainState.create(
        apply_fn=LinenFFN().apply, tx=optax.sgd(0.1),
        params={"params": {"wi": model.wi[...], "wo": model.wo[...]},
                OVERWRITE_COLLECTION: linen_vars[OVERWRITE_COLLECTION]})

    @jax.jit
    def linen_step(state):
        with te_jax.autocast(recipe=DELAYED):
            loss, grads = te_jax.train.value_and_grad(
                lambda v: jnp.mean((LinenFFN().apply(v, x, gs) - target) ** 2))(state.params)
        return state.apply_gradients(grads=grads), loss

    @nnx.jit
    def nnx_step(model, optimizer):
        with te_jax.autocast(recipe=DELAYED):
            loss, grads = te_nnx.value_and_grad(lambda m: jnp.mean((m(x, gs) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for _ in range(3):
        wi = model.wi[...]
        loss = nnx_step(model, optimizer)
        state, want = linen_step(state)
        meta = _pure(nnx.state(model, te_nnx.FP8Meta))
        assert tree_same_bits(loss, want)
        assert tree_same_bits(_fp8_linen_layout(meta), _delayed(state.params[OVERWRITE_COLLECTION]))
        history = meta["wi_dot"]["fp8_meta"]["linear_weight"]["amax_history"]
        np.testing.assert_array_equal(history[:, -1], jnp.max(jnp.abs(wi), axis=(1, 2)))  # per expert, this step
    assert tree_same_bits(model.wo[...], state.params["params"]["wo"])


def test_recipe_path_and_errors():
    x, _, gs = _data(2)
    seen = set()

    def qfactory(role):
        seen.add(role.path)
        return CurrentScalingQuantizer(jnp.float8_e4m3fn) if role in ("linear_input", "linear_weight") else None

    with te_jax.autocast(recipe=R.CustomRecipe(qfactory)):
        model = ExpertFFN(nnx.Rngs(0))
        y = model(x, gs)
    assert seen == {("wi_dot",), ("wo_dot",)}
    want = ExpertFFN(nnx.Rngs(0), te=False)(x, gs)
    assert 1e-5 < float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 0.1
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        te_nnx.RaggedDot(0)
    with te_jax.autocast(recipe=R.Float8CurrentScaling()), pytest.raises(ValueError, match="num_groups = 4"):
        model.wi_dot(x, model.wi[...][:3], gs[:3])
    plain = ExpertFFN(nnx.Rngs(0))  # built outside autocast: no state for delayed scaling
    with te_jax.autocast(recipe=DELAYED), pytest.raises(ValueError, match="RaggedDot at wi_dot has no FP8Meta"):
        plain(x, gs)
