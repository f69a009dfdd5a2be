"""te_jax.qwix.Provider on small unmodified Linen and NNX models: flax's result outside autocast, te_jax's injected
products (bit for bit) under it, rules choosing per module, delayed-scaling state stepped by flax's TrainState."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state
from jax import lax
from qtest_util import tree_same_bits

qwix = pytest.importorskip("qwix", reason="the Qwix provider needs the optional extra te_jax[qwix]")

import te_jax  # noqa: E402
import te_jax.qwix  # noqa: E402
from te_jax import recipe as R  # noqa: E402
from te_jax.quantize import overwrite  # noqa: E402

OWG = overwrite.OVERWRITE_COLLECTION
D, H, F, G = 32, 4, 64, 3


class Block(nn.Module):
    """A transformer block as flax users write it, optionally with te_jax's modules injected by hand."""

    injected: bool = False

    @nn.compact
    def __call__(self, x, group_sizes):
        dg = te_jax.flax.DotGeneral if self.injected else None
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(H, qkv_dot_general_cls=dg, out_dot_general_cls=dg)(h, h)
        x = x + h
        h = nn.Dense(F, dot_general_cls=dg)(nn.LayerNorm()(x))
        x = x + nn.Dense(D, dot_general_cls=dg)(nn.gelu(h))
        wi = self.param("experts", nn.initializers.lecun_normal(), (G, D, D))
        flat = x.reshape(-1, D)
        moe = te_jax.flax.RaggedDot()(flat, wi, group_sizes) if self.injected else lax.ragged_dot(flat, wi,
                                                                                                  group_sizes)
        return x + moe.reshape(x.shape)


def _data(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (2, 8, D), jnp.float32)
    return x, jnp.array([5, 0, 9], jnp.int32), k2


def _provider(*rules):
    return te_jax.qwix.Provider(list(rules) or [te_jax.qwix.Rule(module_path=".*")])




def test_outside_autocast_is_flax_bit_for_bit():
    x, gs, key = _data()
    variables = Block().init(key, x, gs)
    model = qwix.quantize_model(Block(), _provider())
    assert tree_same_bits(model.apply(variables, x, gs), Block().apply(variables, x, gs))


@pytest.mark.parametrize("recipe", [R.Float8CurrentScaling(), R.MXFP8BlockScaling()], ids=["current", "mxfp8"])
def test_stateless_recipe_equals_the_injected_modules(recipe):
    """Every projection (q, k, v, out, both Dense, the experts) runs te_jax's products: the same bits as the model
    with te_jax.flax.DotGeneral / RaggedDot injected by hand, and not the unquantized result."""
    x, gs, key = _data(1)
    variables = Block().init(key, x, gs)
    model = qwix.quantize_model(Block(), _provider())
    with te_jax.autocast(recipe=recipe):
        got = jax.jit(model.apply)(variables, x, gs)
        want = jax.jit(Block(injected=True).apply)(variables, x, gs)
        grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x, gs) ** 2)))(variables)
        want_grads = jax.jit(jax.grad(lambda v: jnp.sum(Block(injected=True).apply(v, x, gs) ** 2)))(variables)
    assert tree_same_bits(got, want)
    assert tree_same_bits(grads, want_grads)
    plain = Block().apply(variables, x, gs)
    rel = float(jnp.linalg.norm(got - plain) / jnp.linalg.norm(plain))
    assert 1e-4 < rel < 0.1, rel


def test_rules_choose_per_module():
    """The first matching rule wins: an exclusion leaves the attention unquantized, a rule's own recipe (here
    one that quantizes nothing) overrides the autocast's for Dense_1, the catch-all quantizes the rest: the same
    bits as the hand-injected model under a CustomRecipe quantizing Dense_0 and the experts only."""
    x, gs, key = _data(2)
    variables = Block().init(key, x, gs)
    asked = []

    def nothing(role):
        asked.append(role.path)
        return None

    model = qwix.quantize_model(Block(), _provider(
        te_jax.qwix.Rule(module_path=".*MultiHeadDotProductAttention.*", quantize=False),
        te_jax.qwix.Rule(module_path="Dense_1", recipe=R.CustomRecipe(nothing)),
        te_jax.qwix.Rule(module_path=".*")))
    current = R.Float8CurrentScaling()
    with te_jax.autocast(recipe=current):
        got = jax.jit(model.apply)(variables, x, gs)
    assert set(asked) == {("Dense_1",)}  # the rule's recipe, asked with the module's path
    chosen = R.CustomRecipe(lambda role: current.quantizer(role) if role.path in {("Dense_0",), ("RaggedDot_0",)}
                            else None)
    with te_jax.autocast(recipe=chosen):
        want = jax.jit(Block(injected=True).apply)(variables, x, gs)
    assert tree_same_bits(got, want)
    assert not tree_same_bits(got, Block().apply(variables, x, gs))


def test_delayed_state_steps_with_flax_train_state():
    """Delayed scaling: the state lives in "_overwrite_with_gradient" under each product's op id, and flax's own
    TrainState (jax.grad over the whole variables) steps it exactly as the hand-injected model's."""
    x, gs, key = _data(3)
    recipe = R.DelayedScaling(amax_history_len=4)
    model, injected = qwix.quantize_model(Block(), _provider()), Block(injected=True)
    with te_jax.autocast(recipe=recipe):
        variables = jax.jit(model.init)(key, x, gs)
        ref_variables = jax.jit(injected.init)(key, x, gs)
    owg = variables[OWG]
    assert set(owg["Dense_0"]) == {"dot_general0"}
    assert set(owg["Dense_0"]["dot_general0"]) == {"linear_input", "linear_weight", "linear_grad_output"}
    assert set(owg["MultiHeadDotProductAttention_0"]["query"]) == {"dot_general0"}
    assert owg["ragged_dot0"]["linear_weight"]["amax_history"].shape == (G, 4)  # the block's own experts

    def make_step(m):
        @jax.jit
        def step(state):
            with te_jax.autocast(recipe=recipe):
                loss, grads = jax.value_and_grad(lambda v: jnp.mean(m.apply(v, x, gs) ** 2))(state.params)
            return state.apply_gradients(grads=grads), loss
        return step

    tx = optax.sgd(0.05)
    state = flax_train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    ref = flax_train_state.TrainState.create(apply_fn=injected.apply, params=ref_variables, tx=tx)
    step, ref_step = make_step(model), make_step(injected)
    decode = lambda t: jax.tree.map(lambda s: overwrite.to_delayed(s)._asdict(), t, is_leaf=overwrite.is_state)
    for _ in range(3):
        state, loss = step(state)
        ref, ref_loss = ref_step(ref)
        assert float(loss) == float(ref_loss)
        got = decode(state.params[OWG]["Dense_0"]["dot_general0"])
        want = decode(ref.params[OWG]["Dense_0"]["DotGeneral_0"])
        assert tree_same_bits(got, want)
        assert float(got["linear_input"]["amax_history"][-1]) > 0


class NnxBlock(nnx.Module):
    def __init__(self, rngs, injected: bool = False):
        kw = dict(dot_general=te_jax.nnx.DotGeneral(path="up/te_jax_dot_general0")) if injected else {}
        self.up = nnx.Linear(D, F, rngs=rngs, **kw)
        kw = dict(einsum_op=te_jax.nnx.EinsumOp(path="proj/te_jax_einsum0")) if injected else {}
        self.proj = nnx.Einsum("btd,dnh->btnh", (D, H, D // H), rngs=rngs, **kw)

    def __call__(self, x):
        return self.proj(nnx.gelu(self.up(x))[..., :D]).reshape(x.shape)


def test_nnx_model():
    x, _, _ = _data(4)
    plain = NnxBlock(nnx.Rngs(0))
    want = plain(x)
    model = qwix.quantize_model(NnxBlock(nnx.Rngs(0)), _provider(), x)
    assert tree_same_bits(model(x), want)  # outside autocast: flax's result
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        got = model(x)
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert 1e-4 < rel < 0.1, rel
    assert hasattr(model.up, "te_jax_dot_general0") and hasattr(model.proj, "te_jax_einsum0")


def test_nnx_delayed_state_steps_with_te_jax_nnx():
    """NNX under delayed scaling: Qwix's first run (under the autocast) gives each product a te_jax.nnx child with
    its FP8Meta; te_jax.nnx.value_and_grad steps it exactly as a hand-injected te_jax.nnx.DotGeneral's."""
    x, _, _ = _data(5)
    recipe = R.DelayedScaling(amax_history_len=4)
    with te_jax.autocast(recipe=recipe):
        model = qwix.quantize_model(NnxBlock(nnx.Rngs(0)), _provider(), x)
        ref = NnxBlock(nnx.Rngs(0), injected=True)

    def step(m):
        with te_jax.autocast(recipe=recipe):
            loss, _ = te_jax.nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
        return loss

    for _ in range(3):
        assert float(step(model)) == float(step(ref))
    got = model.up.te_jax_dot_general0.fp8_meta.get_value()
    want = ref.up.dot_general.fp8_meta.get_value()
    assert tree_same_bits(got, want)
    assert float(got["linear_input"]["amax_history"][-1]) > 0
