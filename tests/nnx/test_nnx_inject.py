"""te_jax injected into flax.nnx's own layers: ``DotGeneral`` in ``nnx.Linear`` / ``nnx.LinearGeneral`` /
``nnx.MultiHeadAttention``, ``EinsumOp`` in ``nnx.Einsum``, and ``te_jax.nnx.inject``.

Outside autocast the injected layers are flax's to the bit; under every recipe they quantize within the FP8
bounds of tests/nnx/test_nnx.py and train; under delayed scaling their state steps exactly as
``te_jax.nnx.Linear``'s; an instance shared by several layers, or made at every call, is a clear error.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_jax
from te_jax import nnx as te_nnx
from te_jax import recipe as R
from qtest_util import BUILTIN_RECIPES, normal, pure, tree_same_bits

DELAYED = BUILTIN_RECIPES["delayed"]
CURRENT = R.Float8CurrentScaling()
RECIPES = BUILTIN_RECIPES
H = 128  # the block recipes quantize 128-wide blocks


class FlaxModel(nnx.Module):
    """flax.nnx's layers only: Linear, LinearGeneral, Einsum and MultiHeadAttention."""

    def __init__(self, rngs: nnx.Rngs, h: int = H):
        self.linear = nnx.Linear(h, h, rngs=rngs)
        self.general = nnx.LinearGeneral((2, h // 2), h, axis=(-2, -1), rngs=rngs)
        self.einsum = nnx.Einsum("btd,dnh->btnh", (h, 2, h // 2), (2, h // 2), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, h, decode=False, rngs=rngs)

    def __call__(self, x):
        x = self.linear(x)
        x = self.general(self.einsum(x))
        return self.attn(x)


def test_inject_gives_each_flax_product_its_own_te_jax_op_and_names_it():
    model = FlaxModel(nnx.Rngs(0), h=16)
    params = pure(nnx.state(model, nnx.Param))
    assert te_nnx.inject(model) is model
    ops = {"/".join(map(str, p)): n for p, n in nnx.iter_graph(model) if isinstance(n, (te_nnx.DotGeneral,
                                                                                        te_nnx.EinsumOp))}
    assert set(ops) == {"linear/dot_general", "general/dot_general", "einsum/einsum_op", "attn/query/dot_general",
                        "attn/key/dot_general", "attn/value/dot_general", "attn/out/dot_general"}
    assert len({id(op) for op in ops.values()}) == len(ops)
    assert all(op.path == tuple(name.split("/")) for name, op in ops.items())
    assert tree_same_bits(pure(nnx.state(model, nnx.Param)), params)  # no parameter added or changed
    assert not nnx.state(model, te_nnx.FP8Meta)  # built outside autocast: flax's variables only
    te_nnx.inject(model)  # again: every op kept
    assert all(model.linear.dot_general is ops["linear/dot_general"] for _ in [0])


@pytest.mark.parametrize("recipe", [None, "nothing quantized"])
def test_injected_layers_are_flax_to_the_bit_without_quantization(recipe):
    x = normal(0, (2, 8, 16), 2.0)
    reference, model = FlaxModel(nnx.Rngs(3), h=16), FlaxModel(nnx.Rngs(3), h=16)
    te_nnx.inject(model)
    general_ref = nnx.LinearGeneral(16, (2, 3), batch_axis={0: 2}, use_bias=True, rngs=nnx.Rngs(1))
    general = nnx.LinearGeneral(16, (2, 3), batch_axis={0: 2}, use_bias=True, rngs=nnx.Rngs(1))
    te_nnx.inject(general)
    bf16_ref = nnx.Linear(16, 4, dtype=jnp.bfloat16, preferred_element_type=jnp.float32, rngs=nnx.Rngs(2))
    bf16 = nnx.Linear(16, 4, dtype=jnp.bfloat16, preferred_element_type=jnp.float32,
                      dot_general=te_nnx.DotGeneral(), rngs=nnx.Rngs(2))
    te_nnx.name_paths(bf16)  # a CustomRecipe reads paths
    off = R.CustomRecipe(lambda role: None)

    @nnx.jit
    def run(model, general, bf16):
        return model(x), general(x), bf16(x), model.einsum(x, "btd,dnh->bnth")

    with te_jax.autocast(enabled=recipe is not None, recipe=off):
        got = run(model, general, bf16)
    want = run(reference, general_ref, bf16_ref)
    assert tree_same_bits(got, want)
    assert got[2].dtype == jnp.float32


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_quantizes_the_injected_layers_forward_and_backward(recipe):
    rec = RECIPES[recipe]
    x = normal(4, (1, 128, H))
    y = jnp.sin(x)
    with te_jax.autocast(recipe=rec):
        model = FlaxModel(nnx.Rngs(0))
        reference = nnx.clone(model)
        te_nnx.inject(model, rngs=nnx.Rngs(quantize=1))
    meta = pure(nnx.state(model, te_nnx.FP8Meta))
    assert set(meta) == ({"linear", "general", "einsum", "attn"} if recipe == "delayed" else set())
    with te_jax.autocast(recipe=rec):
        got = nnx.jit(lambda m, x: m(x))(model, x)
    want = nnx.jit(lambda m, x: m(x))(reference, x)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert 0 < error < (0.5 if recipe == "nvfp4" else 0.12), error  # quantized, and close (4 GEMMs deep)
    loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731

    @nnx.jit
    def grads_of(model):
        with te_jax.autocast(recipe=rec):
            return te_nnx.value_and_grad(loss_fn)(model)

    loss, grads = grads_of(model)
    if recipe == "delayed":  # the first step quantized with the initial scales (1): the second with the amaxes
        loss, grads = grads_of(model)
    want_loss, want_grads = nnx.jit(nnx.value_and_grad(loss_fn))(reference)
    flat = [jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(g)]) for g in (grads, want_grads)]
    cosine = float(jnp.dot(*flat) / (jnp.linalg.norm(flat[0]) * jnp.linalg.norm(flat[1])))
    assert np.isfinite(float(loss)) and abs(float(loss) / float(want_loss) - 1) < 0.1
    assert cosine > (0.8 if recipe == "nvfp4" else 0.98), cosine
    if recipe == "delayed":
        history = pure(nnx.state(model.attn.query, te_nnx.FP8Meta))["dot_general"]["fp8_meta"]
        assert float(history["linear_input"]["amax_history"][-1]) > 0


class Pair(nnx.Module):
    """Two layers; ``injected``: flax's nnx.Linear with te_jax's DotGeneral, else te_jax.nnx.Linear."""

    def __init__(self, injected: bool, rngs: nnx.Rngs):
        if injected:
            self.a = nnx.Linear(32, 48, use_bias=False, dot_general=te_nnx.DotGeneral(), rngs=rngs)
            self.b = nnx.Linear(48, 32, use_bias=False, dot_general=te_nnx.DotGeneral(), rngs=rngs)
        else:
            self.a = te_nnx.Linear(32, 48, use_bias=False, rngs=rngs)
            self.b = te_nnx.Linear(48, 32, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.gelu(self.a(x)))


def test_delayed_state_steps_exactly_as_te_jax_nnx_linear():
    x, y = normal(5, (2, 16, 32)), normal(6, (2, 16, 32))
    with te_jax.autocast(recipe=DELAYED):
        injected, layers = Pair(True, nnx.Rngs(0)), Pair(False, nnx.Rngs(0))
    te_nnx.name_paths(injected), te_nnx.name_paths(layers)
    assert injected.a.dot_general.path == ("a", "dot_general") and layers.a.path == ("a",)

    def state_of(model, injected):
        meta = pure(nnx.state(model, te_nnx.FP8Meta))
        return {k: (v["dot_general"] if injected else v)["fp8_meta"] for k, v in meta.items()}

    assert tree_same_bits(state_of(injected, True), state_of(layers, False))

    @nnx.jit
    def step(model, optimizer, x):
        with te_jax.autocast(recipe=DELAYED):
            loss, grads = te_nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in (injected, layers)]
    for i in range(3):
        xi = x * (1.0 + 2.0 * i)
        losses = [step(m, o, xi) for m, o in zip((injected, layers), opts)]
        assert tree_same_bits(losses[0], losses[1])
        assert tree_same_bits(state_of(injected, True), state_of(layers, False))
        assert tree_same_bits(pure(nnx.state(injected, nnx.Param)), pure(nnx.state(layers, nnx.Param)))
    assert float(state_of(injected, True)["a"]["linear_input"]["amax_history"][-1]) == float(jnp.max(jnp.abs(x * 5)))


def test_batch_axes_keep_one_weight_history_per_batch_element():
    x = normal(7, (3, 32, 64))
    with te_jax.autocast(recipe=DELAYED):
        model = te_nnx.inject(nnx.LinearGeneral(64, 32, batch_axis={0: 3}, rngs=nnx.Rngs(0)))
    weight = pure(nnx.state(model, te_nnx.FP8Meta))["dot_general"]["fp8_meta"]["linear_weight"]
    assert weight["amax_history"].shape == (3, 4)

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=DELAYED):
            return te_nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

    step(model)
    weight = pure(nnx.state(model, te_nnx.FP8Meta))["dot_general"]["fp8_meta"]["linear_weight"]
    np.testing.assert_array_equal(weight["amax_history"][:, -1], jnp.max(jnp.abs(model.kernel[...]), axis=(1, 2)))
    with te_jax.autocast(recipe=DELAYED):  # the same op without batch_size: its weight state does not fit
        wrong = nnx.LinearGeneral(64, 32, batch_axis={0: 3}, dot_general=te_nnx.DotGeneral(), rngs=nnx.Rngs(0))
        te_nnx.name_paths(wrong)
        with pytest.raises(ValueError, match=r"DotGeneral at dot_general: .*batch axes of 3 .*batch_size=3"):
            wrong(x)


def test_one_instance_shared_by_two_layers_is_a_clear_error():
    shared = te_nnx.DotGeneral()

    class Shared(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 8, dot_general=shared, rngs=rngs)
            self.b = nnx.Linear(8, 8, dot_general=shared, rngs=rngs)

        def __call__(self, x):
            return self.b(self.a(x))

    model = Shared(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"one DotGeneral is referenced from 2 places \(a/dot_general, "
                                         r"b/dot_general\).*its own"):
        te_nnx.name_paths(model)
    with te_jax.autocast(recipe=CURRENT), pytest.raises(ValueError, match="referenced from 2 places"):
        te_nnx.value_and_grad(lambda m: jnp.sum(m(jnp.ones((2, 8)))))(model)
    with pytest.raises(ValueError, match=r"referenced from 4 places.*MultiHeadAttention.*inject"):
        te_nnx.name_paths(nnx.MultiHeadAttention(2, 8, decode=False, qkv_dot_general=te_nnx.DotGeneral(),
                                                 rngs=nnx.Rngs(0)))


def test_an_instance_made_at_every_call_cannot_keep_state():
    x = normal(8, (4, 16))
    flax_general = nnx.LinearGeneral(16, 8, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m: m(x))
    with te_jax.autocast(recipe=DELAYED):
        model = nnx.LinearGeneral(16, 8, dot_general_cls=te_nnx.DotGeneral, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"DotGeneral keeps FP8 state.*dot_general_cls.*inject"):
            forward(model)
    with te_jax.autocast(recipe=CURRENT):  # stateless: it works
        got = forward(model)
    assert 0 < float(jnp.max(jnp.abs(got - flax_general(x)))) < 0.1 * float(jnp.max(jnp.abs(got)))
    with te_jax.autocast(recipe=DELAYED):
        te_nnx.inject(model)  # the class becomes an instance, part of the model
        assert model.dot_general_cls is None and isinstance(model.dot_general, te_nnx.DotGeneral)
        assert pure(nnx.state(model, te_nnx.FP8Meta))["dot_general"]["fp8_meta"]
        forward(model)


def test_inject_refuses_a_custom_product():
    model = nnx.Linear(8, 8, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"inject: Linear at \(root\) has its own dot_general"):
        te_nnx.inject(model)


def test_multi_head_attention_with_inject_trains_under_a_per_layer_recipe():
    x = normal(9, (2, 8, 16))
    recipe = R.CustomRecipe(lambda role: DELAYED.quantizer(role) if re.search(r"attn/(query|out)", role.path_str)
                            else None)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)

        def __call__(self, x):
            return self.attn(x)

    with te_jax.autocast(recipe=recipe):
        model = te_nnx.inject(Model(nnx.Rngs(0)))
    assert set(pure(nnx.state(model, te_nnx.FP8Meta))["attn"]) == {"query", "out"}

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=recipe):
            return te_nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

    step(model)
    meta = pure(nnx.state(model, te_nnx.FP8Meta))["attn"]
    assert float(meta["out"]["dot_general"]["fp8_meta"]["linear_grad_output"]["amax_history"][-1]) > 0


def test_injected_inside_a_vmapped_constructor_the_state_gets_the_layer_axis_and_scans():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        with te_jax.autocast(recipe=DELAYED):
            return te_nnx.inject(nnx.Linear(16, 16, rngs=rngs))

    stacked = create(nnx.Rngs(0))
    history = pure(nnx.state(stacked, te_nnx.FP8Meta))["dot_general"]["fp8_meta"]["linear_input"]["amax_history"]
    assert history.shape == (3, 4)
    x = normal(10, (4, 16))

    def loss(model):
        out, _ = nnx.scan(lambda h, layer: (layer(h), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
            x, model)
        return jnp.mean(out ** 2)

    with te_jax.autocast(recipe=DELAYED), pytest.raises(te_jax.train.FP8StateError, match="te_jax.nnx.value_and_grad"):
        nnx.value_and_grad(loss)(stacked)  # would drop the update

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=DELAYED):
            return te_nnx.value_and_grad(loss)(model)

    step(stacked)
    history = pure(nnx.state(stacked, te_nnx.FP8Meta))["dot_general"]["fp8_meta"]["linear_input"]["amax_history"]
    assert float(history[0, -1]) == float(jnp.max(jnp.abs(x)))  # the first layer saw x
    assert all(float(h) > 0 for h in history[:, -1])
