"""te_jax.nnx: flax.nnx parity without autocast, every recipe on every layer, the FP8 state step by step
against the Linen layers', optimizer isolation, jit / scan / remat / reuse, the "quantize" RNG stream,
the orbax round trip, and (in a subprocess with 8 CPU devices) data and tensor parallelism.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_jax
from te_jax import flax as te_flax
from te_jax import nnx as te_nnx
from te_jax import recipe as R
from te_jax.train import FP8StateError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qtest_util import BUILTIN_RECIPES, normal, pure, run_on_fake_devices, tree_same_bits  # noqa: E402

DELAYED = BUILTIN_RECIPES["delayed"]
RECIPES = BUILTIN_RECIPES


def linen_layout(tree):
    """An NNX pure-dict state in the Linen variables' layout: ``{"fp8_meta": X}`` entries replaced by X."""
    if isinstance(tree, dict):
        if set(tree) == {"fp8_meta"}:
            return linen_layout(tree["fp8_meta"])
        return {k: linen_layout(v) for k, v in tree.items()}
    return tree


def mse_step(recipe, y):
    """An nnx.jit train step: loss, value_and_grad (FP8 update applied), SGD on the parameters."""

    @nnx.jit
    def step(model, optimizer, x):
        with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
            loss, grads = te_nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return step


# ---- parity with flax.nnx without autocast ---------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(use_bias=False), dict(dtype=jnp.bfloat16),
                                dict(param_dtype=jnp.bfloat16, kernel_init=nnx.initializers.normal(0.3))])
def test_linear_is_flax_nnx(kw):
    x = normal(0, (3, 5, 12), 3.0)
    ref, ours = nnx.Linear(12, 7, rngs=nnx.Rngs(4), **kw), te_nnx.Linear(12, 7, rngs=nnx.Rngs(4), **kw)
    assert tree_same_bits(pure(nnx.state(ours)), pure(nnx.state(ref)))
    assert tree_same_bits(ours(x), ref(x))


@pytest.mark.parametrize("args,kw,shape", [
    ((12, 7), {}, (3, 12)),
    (((5, 12), (2, 3)), dict(axis=(-2, -1)), (3, 5, 12)),
    (((3, 12), 4), dict(axis=(2, 0)), (3, 5, 12)),  # contracted in ascending order, as flax.nnx does
    ((12, 4), dict(batch_axis={0: 3}), (3, 5, 12)),
    ((12, (2, 2)), dict(use_bias=False, dtype=jnp.bfloat16), (2, 12)),
])
def test_linear_general_is_flax_nnx(args, kw, shape):
    x = normal(1, shape)
    ref, ours = nnx.LinearGeneral(*args, rngs=nnx.Rngs(2), **kw), te_nnx.LinearGeneral(*args, rngs=nnx.Rngs(2), **kw)
    assert tree_same_bits(pure(nnx.state(ours)), pure(nnx.state(ref)))
    assert tree_same_bits(ours(x), ref(x))


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("kw,masked", [(dict(), False), (dict(use_fast_variance=False), True),
                                       (dict(dtype=jnp.bfloat16), False),
                                       (dict(param_dtype=jnp.bfloat16, epsilon=1e-3), True),
                                       (dict(use_scale=False), False)])
def test_norms_are_flax_nnx(name, kw, masked):
    x = normal(2, (4, 6, 16), 2.0) + 5.0
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, x.shape) if masked else None
    ref, ours = getattr(nnx, name)(16, rngs=nnx.Rngs(0), **kw), getattr(te_nnx, name)(16, rngs=nnx.Rngs(0), **kw)
    assert tree_same_bits(pure(nnx.state(ours)), pure(nnx.state(ref)))
    assert tree_same_bits(ours(x, mask=mask), ref(x, mask=mask))


def test_norm_under_autocast_is_the_fused_kernel_within_float32_ulps():
    x = normal(2, (4, 16), 2.0) + 5.0
    ref = nnx.LayerNorm(16, rngs=nnx.Rngs(0))
    with te_jax.autocast(recipe=DELAYED):
        ours = te_nnx.LayerNorm(16, rngs=nnx.Rngs(0))
        got = ours(x)
    assert not nnx.state(ours, te_nnx.FP8Meta)  # nothing quantized, no state
    np.testing.assert_allclose(got, ref(x), rtol=1e-5, atol=1e-5)


def _nnx_norm_linear(h, f, rngs):
    return nnx.LayerNorm(h, rngs=rngs), nnx.Linear(h, f, rngs=rngs)


def test_layernorm_linear_is_flax_nnx_norm_then_linear():
    x = normal(3, (2, 5, 16), 2.0)
    norm, lin = _nnx_norm_linear(16, 8, nnx.Rngs(0))
    ours = te_nnx.LayerNormLinear(16, 8, rngs=nnx.Rngs(0))
    assert tree_same_bits(pure(nnx.state(ours)), {"scale": pure(nnx.state(norm))["scale"],
                                              "ln_bias": pure(nnx.state(norm))["bias"], **pure(nnx.state(lin))})
    np.testing.assert_allclose(ours(x), lin(norm(x)), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_is_flax_nnx_layers(activation):
    x = normal(4, (2, 5, 16), 2.0)
    ours = te_nnx.LayerNormMLP(16, 24, activation=activation, rngs=nnx.Rngs(0))
    rngs = nnx.Rngs(0)
    norm = nnx.LayerNorm(16, rngs=rngs)
    wi = nnx.LinearGeneral(16, (2, 24) if activation == "swiglu" else 24, rngs=rngs)
    wo = nnx.Linear(24, 16, rngs=rngs)
    want = {"scale": norm.scale[...], "ln_bias": norm.bias[...], "wi_kernel": wi.kernel[...], "wi_bias": wi.bias[...],
            "wo_kernel": wo.kernel[...], "wo_bias": wo.bias[...]}
    assert tree_same_bits(pure(nnx.state(ours)), want)
    h = wi(norm(x))
    h = jax.nn.silu(h[..., 0, :]) * h[..., 1, :] if activation == "swiglu" else jax.nn.gelu(h)
    np.testing.assert_allclose(ours(x), wo(h), rtol=2e-5, atol=2e-5)


def _linen_twin(model: te_nnx.TransformerLayer, **kw) -> te_flax.TransformerLayer:
    return te_flax.TransformerLayer(num_attention_heads=model.attention.num_heads,
                                    num_gqa_groups=model.attention.num_kv_heads, **kw)


def test_transformer_layer_is_the_linen_layer():
    x = normal(5, (2, 8, 32))
    kw = dict(num_gqa_groups=2, intermediate_dim=48, mlp_activation="swiglu", layernorm_type="rmsnorm")
    ours = te_nnx.TransformerLayer(32, 4, rngs=nnx.Rngs(0), **kw)
    params = pure(nnx.state(ours, nnx.Param))
    linen = te_flax.TransformerLayer(num_attention_heads=4, **kw)
    shapes = jax.tree.map(jnp.shape, linen.init(jax.random.key(0), x)["params"])
    assert jax.tree.map(jnp.shape, params) == shapes
    assert tree_same_bits(ours(x), linen.apply({"params": params}, x))


# ---- every recipe on every layer ------------------------------------------------------------------------

H = 128  # the block recipes quantize 128-wide blocks; 128 tokens per call below


class EveryLayer(nnx.Module):
    """Each te_jax.nnx layer once, in a chain."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = te_nnx.Linear(H, H, rngs=rngs)
        self.general = te_nnx.LinearGeneral((2, 64), H, axis=(-2, -1), rngs=rngs)
        self.layernorm = te_nnx.LayerNorm(H, rngs=rngs)
        self.rmsnorm = te_nnx.RMSNorm(H, rngs=rngs)
        self.norm_linear = te_nnx.LayerNormLinear(H, H, layernorm_type="rmsnorm", rngs=rngs)
        self.mlp = te_nnx.LayerNormMLP(H, 128, activation="swiglu", rngs=rngs)
        self.block = te_nnx.TransformerLayer(H, 2, intermediate_dim=128, rngs=rngs)

    def __call__(self, x):
        x = self.general(self.linear(x).reshape(*x.shape[:-1], 2, 64))
        return self.block(self.mlp(self.norm_linear(self.rmsnorm(self.layernorm(x)))))


QUANTIZED = ("linear", "general", "norm_linear", "mlp", "block")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_trains_every_layer(recipe):
    rec = RECIPES[recipe]
    x = normal(6, (2, 64, H))
    y = jnp.sin(x)
    with te_jax.autocast(recipe=rec):
        model = EveryLayer(nnx.Rngs(0, quantize=1))
    reference = nnx.clone(model)
    meta = pure(nnx.state(model, te_nnx.FP8Meta))
    if recipe == "delayed":  # every quantizing layer keeps state, the norms none
        assert set(meta) == set(QUANTIZED)
    else:
        assert not meta
    # Each forward as one program (op by op, every small op compiles alone); a jit each, since autocast is read
    # when tracing.
    with te_jax.autocast(recipe=rec):
        got = nnx.jit(lambda m, x: m(x))(model, x)
    want = nnx.jit(lambda m, x: m(x))(reference, x)
    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert 0 < error < (0.6 if recipe == "nvfp4" else 0.15), error  # quantized, and close (NVFP4: 8 GEMMs deep)
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    step = mse_step(rec, y)
    losses = [float(step(model, optimizer, x)) for _ in range(2)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    if recipe == "delayed":  # the state moved: amaxes recorded in every layer
        for name in QUANTIZED:
            histories = [v for p, v in jax.tree_util.tree_leaves_with_path(meta[name]) if "amax_history" in str(p)]
            now = pure(nnx.state(getattr(model, name), te_nnx.FP8Meta))
            assert histories and all(float(jnp.max(v)) > 0 for v in jax.tree.leaves(now) if v.ndim and v.size == 4)


# ---- state semantics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["LayerNormMLP", "TransformerLayer"])
def test_state_step_by_step_equals_the_linen_layers(which):
    x, y = normal(7, (2, 16, 32)), normal(8, (2, 16, 32))
    with te_jax.autocast(recipe=DELAYED):
        if which == "LayerNormMLP":
            model = te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0))
            linen = te_flax.LayerNormMLP(intermediate_dim=64)
        else:
            model = te_nnx.TransformerLayer(32, 4, num_gqa_groups=2, intermediate_dim=64, rngs=nnx.Rngs(0))
            linen = te_flax.TransformerLayer(num_attention_heads=4, num_gqa_groups=2, intermediate_dim=64)
        fp8_meta = linen.init(jax.random.key(0), x)["fp8_meta"]
    assert tree_same_bits(linen_layout(pure(nnx.state(model, te_nnx.FP8Meta))), fp8_meta)
    state = te_jax.train.TrainState.create(
        apply_fn=linen.apply, params={"params": pure(nnx.state(model, nnx.Param)), "fp8_meta": fp8_meta},
        tx=optax.sgd(0.1))

    @jax.jit
    def linen_step(state, x):
        with te_jax.autocast(recipe=DELAYED):
            loss, grads = te_jax.train.value_and_grad(lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2))(
                state.params)
        return state.apply_gradients(grads=grads), loss

    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = mse_step(DELAYED, y)
    for i in range(3):
        xi = x * (1.0 + i)
        loss = step(model, optimizer, xi)
        state, linen_loss = linen_step(state, xi)
        assert tree_same_bits(loss, linen_loss)
        assert tree_same_bits(linen_layout(pure(nnx.state(model, te_nnx.FP8Meta))), state.params["fp8_meta"])
        assert tree_same_bits(pure(nnx.state(model, nnx.Param)), state.params["params"])


def test_optimizer_never_touches_the_fp8_state():
    with te_jax.autocast(recipe=DELAYED):
        model = te_nnx.LayerNormMLP(16, 32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    assert not jax.tree.leaves(nnx.state(optimizer.opt_state, te_nnx.FP8Meta))
    n_params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert len(jax.tree.leaves(optimizer.opt_state)) == 2 * n_params + 1  # adam: mu, nu, count
    before = pure(nnx.state(model, te_nnx.FP8Meta))
    optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
    assert tree_same_bits(pure(nnx.state(model, te_nnx.FP8Meta)), before)


def test_plain_nnx_grad_over_delayed_state_is_refused():
    x = normal(9, (4, 16))
    with te_jax.autocast(recipe=DELAYED):
        model = te_nnx.Linear(16, 8, rngs=nnx.Rngs(0))
        with pytest.raises(FP8StateError, match="te_jax.nnx.value_and_grad"):
            nnx.value_and_grad(lambda m: jnp.sum(m(x)))(model)


def test_construction_without_the_recipe_is_a_clear_error():
    model = te_nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    assert not nnx.state(model, te_nnx.FP8Meta)
    with te_jax.autocast(recipe=DELAYED), pytest.raises(ValueError, match=r"Linear has no FP8Meta.*construct"):
        model(normal(0, (4, 16)))


def test_a_call_reads_the_state_and_leaves_it():
    with te_jax.autocast(recipe=DELAYED):
        model = te_nnx.Linear(16, 8, rngs=nnx.Rngs(0))
        before = pure(nnx.state(model))
        model(normal(0, (4, 16)))
    assert tree_same_bits(pure(nnx.state(model)), before)


def test_a_layer_called_twice_merges_its_amaxes_by_max():
    small, large = normal(10, (8, 16)), normal(11, (8, 16), 7.0)
    with te_jax.autocast(recipe=DELAYED):
        twice = te_nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    once = nnx.clone(twice)

    def run(model, loss):
        @nnx.jit
        def step(model):
            with te_jax.autocast(recipe=DELAYED):
                return te_nnx.value_and_grad(loss)(model)

        step(model)
        return pure(nnx.state(model, te_nnx.FP8Meta))["fp8_meta"]

    got = run(twice, lambda m: jnp.sum(m(m(small))) + jnp.sum(m(large)))
    alone = run(once, lambda m: jnp.sum(m(large)))
    amax = float(jnp.max(jnp.abs(large)))
    assert float(got["linear_input"]["amax_history"][-1]) == amax
    assert tree_same_bits(got["linear_weight"], alone["linear_weight"])  # one weight, one amax
    assert float(got["linear_grad_output"]["amax_history"][-1]) >= float(
        alone["linear_grad_output"]["amax_history"][-1])


# ---- transforms -----------------------------------------------------------------------------------------


def _stack(n: int, recipe):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        with te_jax.autocast(recipe=recipe):
            return te_nnx.LayerNormMLP(16, 32, rngs=rngs)

    return create(nnx.Rngs(0))


def test_remat_scan_over_layers_equals_the_unrolled_loop():
    n, x, y = 3, normal(12, (2, 8, 16)), normal(13, (2, 8, 16))
    stacked = _stack(n, DELAYED)
    assert jax.tree.leaves(nnx.state(stacked, te_nnx.FP8Meta))[0].shape[0] == n
    graphdef, state = nnx.split(stacked)
    unrolled = [nnx.merge(graphdef, jax.tree.map(lambda v: v[i], state)) for i in range(n)]  # new variables

    def scanned_loss(model):
        def body(x, layer):
            return layer(x), None

        body = nnx.remat(body)
        out, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, model)
        return jnp.mean((out - y) ** 2)

    def loop_loss(layers):
        h = x
        for layer in layers:
            h = layer(h)
        return jnp.mean((h - y) ** 2)

    def step(model, loss_fn):
        @nnx.jit
        def run(model):
            with te_jax.autocast(recipe=DELAYED):
                return te_nnx.value_and_grad(loss_fn)(model)

        return run(model)

    wrapper = nnx.List(unrolled)
    for _ in range(2):
        (l1, g1), (l2, g2) = step(stacked, scanned_loss), step(wrapper, loop_loss)
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
    stacked_meta = pure(nnx.state(stacked, te_nnx.FP8Meta))["fp8_meta"]
    for i, layer in enumerate(unrolled):
        got = jax.tree.map(lambda v: v[i], stacked_meta)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(pure(nnx.state(layer, te_nnx.FP8Meta)))):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_stochastic_rounding_keys_come_from_the_quantize_stream():
    rec = R.NVFP4BlockScaling()
    x = normal(14, (64, 64))
    grads = []
    for seed in (1, 1, 2):
        with te_jax.autocast(recipe=rec):
            model = te_nnx.Linear(64, 64, rngs=nnx.Rngs(0, quantize=seed))
        grads.append(_nvfp4_grad(model, x, rec))
    assert tree_same_bits(grads[0], grads[1]) and not tree_same_bits(grads[0], grads[2])
    with te_jax.autocast(recipe=rec):
        keyless = te_nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="key"):
        _nvfp4_grad(keyless, x, rec)


def _nvfp4_grad(model, x, rec):
    @nnx.jit
    def grad(model):
        with te_jax.autocast(recipe=rec):
            return te_nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)

    first = grad(model)
    assert not tree_same_bits(grad(model), first)  # the stream's count moved: a new key per step
    return first


def test_inspect_statistics_land_in_fp8_stats():
    x = normal(15, (16, 16), 3.0)
    with te_jax.autocast(recipe=R.Float8CurrentScaling(), inspect=True):
        model = te_nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    assert nnx.state(model, te_nnx.FP8Stats)

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=R.Float8CurrentScaling(), inspect=True):
            return te_nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    step(model)
    stats = pure(nnx.state(model, te_nnx.FP8Stats))["fp8_stats"]
    assert float(stats["linear_input"]["amax"]) == float(jnp.max(jnp.abs(x)))


def test_orbax_round_trip_continues_bit_identically(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    x, y = normal(16, (2, 8, 16)), normal(17, (2, 8, 16))

    def setup():
        with te_jax.autocast(recipe=DELAYED):
            model = te_nnx.LayerNormMLP(16, 32, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    step = mse_step(DELAYED, y)
    model, optimizer = setup()
    for _ in range(2):
        step(model, optimizer, x)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.state((model, optimizer)))
    checkpointer.wait_until_finished()
    for _ in range(2):
        step(model, optimizer, x)
    fresh, fresh_opt = setup()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state((fresh, fresh_opt)))
    nnx.update((fresh, fresh_opt), checkpointer.restore(tmp_path / "ckpt", abstract))
    for _ in range(2):
        step(fresh, fresh_opt, x)
    assert tree_same_bits(pure(nnx.state(fresh)), pure(nnx.state(model)))


def test_eight_devices_data_and_tensor_parallel():
    result = run_on_fake_devices([Path(__file__).resolve().parents[1] / "multidevice" / "nnx_multidevice.py"], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ALL OK" in result.stdout
