"""te_jax.nnx.MoE against te_jax.flax.MoE with the same parameters: the output without autocast, the loss, gradients
and FP8 state over delayed-scaling steps, and the sown load-balancing loss."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import te_jax
from te_jax import flax as te_flax
from te_jax import nnx as te_nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qtest_util import tree_same_bits  # noqa: E402
from test_nnx import DELAYED, normal, pure  # noqa: E402

E, K_TOP, H, F = 4, 2, 32, 32


@pytest.fixture(autouse=True)
def _on_cpu():
    """XLA:CPU on every machine: the layer's logic (the CUDA grouped kernels have their own tests)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def fp8_linen_layout(tree):
    """An NNX pure-dict ``FP8Meta`` state in the Linen "fp8_meta" layout: each ``fp8_meta`` entry merged into its
    parent (``{"fp8_meta": {"wi": s}, "shared_wi": {"fp8_meta": t}}`` -> ``{"wi": s, "shared_wi": t}``)."""
    if not isinstance(tree, dict):
        return tree
    out = {k: fp8_linen_layout(v) for k, v in tree.items() if k != "fp8_meta"}
    return {**tree.get("fp8_meta", {}), **out}


def _pair(**kw):
    """An NNX MoE (built under the active autocast) and its Linen twin."""
    model = te_nnx.MoE(H, E, K_TOP, F, rngs=nnx.Rngs(0), **kw)
    return model, te_flax.MoE(E, K_TOP, F, **kw)


@pytest.mark.parametrize("kw", [dict(use_bias=True, num_shared_experts=1),
                                dict(activation="relu", score_function="sigmoid", dtype=jnp.bfloat16)])
def test_output_without_autocast_is_the_linen_layers(kw):
    x = normal(1, (2, 8, H))
    model, linen = _pair(**kw)
    params = pure(nnx.state(model, nnx.Param))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, linen.init(jax.random.key(0), x)["params"])
    y = model(x)
    assert y.dtype == kw.get("dtype", jnp.float32)
    assert tree_same_bits(y, linen.apply({"params": params}, x))


def test_aux_loss_is_sown_as_the_linen_layers():
    x = normal(2, (16, H))
    model, linen = _pair(aux_loss_coeff=0.01)
    y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
    want_y, mutated = linen.apply({"params": pure(nnx.state(model, nnx.Param))}, x, mutable=["intermediates"])
    assert tree_same_bits(y, want_y)
    aux = intermediates["aux_loss"].get_value()  # one entry per call
    assert len(aux) == 1 and aux[0].shape == () and float(aux[0]) > 0.0
    assert tree_same_bits(aux, mutated["intermediates"]["aux_loss"])


def test_delayed_scaling_steps_equal_the_linen_layers():
    """Loss (MSE plus the captured aux loss), parameters after SGD and FP8 state, step by step."""
    x, target = normal(3, (2, 8, H)), normal(4, (2, 8, H))
    kw = dict(use_bias=True, num_shared_experts=1, aux_loss_coeff=0.01)
    with te_jax.autocast(recipe=DELAYED):
        model, linen = _pair(**kw)
        fp8_meta = linen.init(jax.random.key(0), x)["fp8_meta"]
    assert tree_same_bits(fp8_linen_layout(pure(nnx.state(model, te_nnx.FP8Meta))), fp8_meta)
    state = te_jax.train.TrainState.create(
        apply_fn=linen.apply, params={"params": pure(nnx.state(model, nnx.Param)), "fp8_meta": fp8_meta},
        tx=optax.sgd(0.1))

    def linen_loss(variables, x):
        y, mutated = linen.apply(variables, x, mutable=["intermediates"])
        return jnp.mean((y - target) ** 2) + mutated["intermediates"]["aux_loss"][0]

    def nnx_loss(model, x):
        y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
        return jnp.mean((y - target) ** 2) + intermediates["aux_loss"][0]

    @jax.jit
    def linen_step(state, x):
        with te_jax.autocast(recipe=DELAYED):
            loss, grads = te_jax.train.value_and_grad(linen_loss)(state.params, x)
        return state.apply_gradients(grads=grads), loss

    @nnx.jit
    def nnx_step(model, optimizer, x):
        with te_jax.autocast(recipe=DELAYED):
            loss, grads = te_nnx.value_and_grad(nnx_loss)(model, x)
        optimizer.update(model, grads)
        return loss

    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for i in range(2):
        xi = x * (1.0 + i)
        loss = nnx_step(model, optimizer, xi)
        state, want_loss = linen_step(state, xi)
        assert tree_same_bits(loss, want_loss)
        assert tree_same_bits(fp8_linen_layout(pure(nnx.state(model, te_nnx.FP8Meta))), state.params["fp8_meta"])
        assert tree_same_bits(pure(nnx.state(model, nnx.Param)), state.params["params"])


def test_errors_name_the_layer():
    with pytest.raises(ValueError, match=r"MoE: activation must be one of"):
        te_nnx.MoE(H, E, K_TOP, F, activation="tanh", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"MoE: num_experts_per_tok \(5\) must be in \[1, num_experts=4\]"):
        te_nnx.MoE(H, E, 5, F, rngs=nnx.Rngs(0))
    model = te_nnx.MoE(H, E, K_TOP, F, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"in_features is 32"):
        model(normal(0, (4, H + 1)))
    with te_jax.autocast(enabled=False, mesh_resource=te_jax.MeshResource(ep_resource="ep")):
        with pytest.raises(ValueError, match=r"MoE.*ep_resource='ep'.*needs a mesh with that axis"):
            model(normal(0, (4, H)))
