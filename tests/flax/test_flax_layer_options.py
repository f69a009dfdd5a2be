"""te_jax.flax layers: FP8 state, scan and remat, dtypes, dropout, errors, logical axes, fast accumulation."""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_flax_layers import RECIPES, _close, _train_grads, _x

import te_jax
from te_jax import flax as tf
from te_jax import recipe as R
from te_jax.core.dense import DenseQuantizers
from te_jax.core.layernorm_mlp import MLPQuantizers, layernorm_mlp


@pytest.fixture(autouse=True)
def _float32_products():
    """float32 products in float32: on GPUs jax's default lets XLA multiply float32 matrices in TF32 (10-bit
    mantissas), and the parity checks here compare float32 layers with float32 references."""
    with jax.default_matmul_precision("highest"):
        yield


# ---- state, scan, remat ------------------------------------------------------------------


def test_delayed_state_layout_and_training_updates():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return tf.TransformerLayer(num_attention_heads=4, intermediate_dim=256, name="layer")(x)

    x, recipe = _x(), RECIPES["delayed"]
    with te_jax.autocast(recipe=recipe):
        v = jax.jit(Net().init)(jax.random.key(0), x)
    meta = v["fp8_meta"]["layer"]
    assert set(meta) == {"attention", "mlp"} and set(meta["mlp"]) == {"wi", "wo"}
    assert set(meta["attention"]["qkv"]) == {"linear_input", "linear_weight", "linear_grad_output"}
    assert meta["mlp"]["wi"]["linear_input"]["amax_history"].shape == (4,)
    import optax

    state = te_jax.train.TrainState.create(apply_fn=Net().apply, params=v, tx=optax.sgd(1e-2))
    for _ in range(2):
        (_, _), grads = _train_grads(Net(), state.params, x, recipe)
        state = state.apply_gradients(grads=grads)
    wi = state.params["fp8_meta"]["layer"]["mlp"]["wi"]
    for role in ("linear_input", "linear_weight", "linear_grad_output"):
        hist = np.asarray(wi[role]["amax_history"])
        assert hist[0] == 0 and np.all(hist[-2:] > 0) and float(wi[role]["scale"][0]) != 1.0
    # apply with a mutable fp8_meta returns the forward-updated state
    with te_jax.autocast(recipe=recipe):
        _, upd = Net().apply(v, x, mutable=["fp8_meta"])
    assert float(upd["fp8_meta"]["layer"]["mlp"]["wo"]["linear_input"]["amax_history"][-1]) > 0


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return tf.TransformerLayer(num_attention_heads=4, num_gqa_groups=2, intermediate_dim=256)(x), None


class _DenseBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = tf.DenseGeneral(256, name="up")(x)
        return x + tf.DenseGeneral(x.shape[-1], name="down")(jax.nn.gelu(h)), None


def _stack(policy=None, length=3, block_cls=_Block):
    block = block_cls if policy is None else nn.remat(block_cls, policy=policy, prevent_cse=False)
    return nn.scan(block, variable_axes={"params": 0, "fp8_meta": 0}, split_rngs={"params": True, "quantize": True},
                   length=length)()


def _casts(text: str) -> dict[str, int]:
    """The quantizing custom calls in a jaxpr (quantize, and norm/activation forwards, which cast)."""
    names = re.findall(r"target_name=(te_jax_quantize\w*|te_jax_norm_fwd|te_jax_act_fwd)", text)
    return {n: names.count(n) for n in sorted(set(names))}


def _grad_jaxpr(model, v, x, recipe, run: bool = True):
    """The jaxpr of the loss's value_and_grad, and its value (None unless ``run``: compiling costs)."""
    def loss(v):
        y = model.apply(v, x, None, rngs={"quantize": jax.random.key(0)})[0]
        return jnp.mean(y.astype(jnp.float32) ** 2)

    with te_jax.autocast(recipe=recipe):
        traced = jax.jit(te_jax.train.value_and_grad(loss)).trace(v)  # one trace for the jaxpr and the run
        return str(traced.jaxpr), traced.lower().compile()(v) if run else None


@pytest.mark.parametrize("recipe", ["delayed", "current", "nvfp4"])
def test_scan_and_remat_keep_fp8_copies(recipe):
    x = _x()
    with te_jax.autocast(recipe=RECIPES[recipe]):
        v = jax.jit(_stack().init)(jax.random.key(0), x, None)
    assert all(leaf.shape[0] == 3 for leaf in jax.tree.leaves(v))
    plain, (loss, g) = _grad_jaxpr(_stack(), v, x, RECIPES[recipe])
    saved, (loss_s, g_s) = _grad_jaxpr(_stack(tf.save_fp8_policy), v, x, RECIPES[recipe])
    nothing, _ = _grad_jaxpr(_stack(jax.checkpoint_policies.nothing_saveable), v, x, RECIPES[recipe], run=False)
    assert _casts(saved) == _casts(plain)  # backward recomputes GEMMs, never a cast
    assert sum(_casts(nothing).values()) > sum(_casts(plain).values())
    assert "te_jax_quantized" in saved
    np.testing.assert_allclose(loss_s, loss, rtol=1e-6)
    if recipe == "nvfp4" and jax.default_backend() != "cpu":
        # On a GPU the two programs' fusions may round a recomputed bf16 value differently, and a 4-bit
        # cast turns that last bit into a whole step for a few elements: compare the gradients as a whole.
        def rel_diff(a, b):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert max(jax.tree.leaves(jax.tree.map(rel_diff, g_s, g))) < 1e-2
    else:
        jax.tree.map(lambda a, b: _close(a, b, 1e-5), g_s, g)
    if recipe == "delayed":
        hist = g["fp8_meta"]["TransformerLayer_0"]["mlp"]["wi"]["linear_input"]["amax_history"]
        assert hist.shape == (3, 4) and len(set(np.asarray(hist[:, -1]).tolist())) == 3  # one state per layer


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_remat_keeps_dense_general_fp8_copies(recipe):
    """DenseGeneral names its quantized copies too: save_fp8_policy recomputes no cast in backward."""
    x = _x()
    stack = lambda policy=None: _stack(policy, block_cls=_DenseBlock)  # noqa: E731
    with te_jax.autocast(recipe=RECIPES[recipe]):
        v = jax.jit(stack().init)(jax.random.key(0), x, None)
    plain, (loss, g) = _grad_jaxpr(stack(), v, x, RECIPES[recipe])
    saved, (loss_s, g_s) = _grad_jaxpr(stack(tf.save_fp8_policy), v, x, RECIPES[recipe])
    nothing, _ = _grad_jaxpr(stack(jax.checkpoint_policies.nothing_saveable), v, x, RECIPES[recipe], run=False)
    assert _casts(saved) == _casts(plain)
    assert sum(_casts(nothing).values()) > sum(_casts(plain).values())
    np.testing.assert_allclose(loss_s, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: _close(a, b, 1e-5), g_s, g)


# ---- dtypes, dropout, errors ----------------------------------------------------------------


@pytest.mark.parametrize("param_dtype,dtype", [(jnp.bfloat16, None), (jnp.float32, jnp.bfloat16),
                                               (jnp.float32, None)])
def test_param_and_compute_dtypes(param_dtype, dtype):
    x = _x(dtype=jnp.bfloat16)
    model = tf.TransformerLayer(num_attention_heads=4, intermediate_dim=256, param_dtype=param_dtype, dtype=dtype)
    with te_jax.autocast(recipe=RECIPES["current"]):
        v = jax.jit(model.init)(jax.random.key(0), x)
    (_, y), g = _train_grads(model, v, x, RECIPES["current"])
    assert y.dtype == x.dtype  # the residual stream keeps its dtype
    assert all(leaf.dtype == param_dtype for leaf in jax.tree.leaves(v["params"]))
    assert all(leaf.dtype == param_dtype for leaf in jax.tree.leaves(g["params"]))
    assert all(bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32)))) for leaf in jax.tree.leaves(g["params"]))
    m = tf.LayerNormMLP(256, dtype=dtype, param_dtype=param_dtype)
    with te_jax.autocast(recipe=RECIPES["block"]):
        y = jax.jit(m.apply)(jax.jit(m.init)(jax.random.key(0), x), x)
    assert y.dtype == (dtype or jnp.promote_types(x.dtype, param_dtype))


def test_dropout():
    x = _x()
    m = tf.LayerNormMLP(256, intermediate_dropout_rate=0.5, intermediate_hidden_dropout_dims=(1,))
    v = jax.jit(m.init)(jax.random.key(0), x)
    apply = jax.jit(m.apply, static_argnames="deterministic")  # the autocast setting is part of jit's cache key
    for recipe in (None, RECIPES["current"]):
        with te_jax.autocast(recipe=recipe) if recipe else te_jax.autocast(enabled=False):
            det = apply(v, x)
            a = apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
            b = apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
            c = apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
        assert np.array_equal(a, b) and not np.array_equal(a, c) and not np.array_equal(a, det)
    t = tf.TransformerLayer(num_attention_heads=4, intermediate_dim=256, hidden_dropout=0.1, intermediate_dropout=0.1)
    vt = jax.jit(t.init)(jax.random.key(0), x)
    apply = jax.jit(t.apply, static_argnames="deterministic")
    assert not np.array_equal(apply(vt, x), apply(vt, x, deterministic=False, rngs={"dropout": jax.random.key(1)}))


def test_errors():
    x = _x((2, 64, 128))
    v = jax.jit(tf.LayerNormMLP(256).init)(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"te_jax: LayerNormMLP: parameter 'scale' has shape \(128,\), but this input "
                                         r"needs \(96,\)"):
        tf.LayerNormMLP(256).apply(v, _x((2, 64, 96)))
    with pytest.raises(ValueError, match="te_jax: DenseGeneral: parameter 'kernel'"):
        d = tf.DenseGeneral(8)
        d.apply(d.init(jax.random.key(0), x), _x((2, 64, 32)))
    with pytest.raises(TypeError, match="te_jax: LayerNormDenseGeneral: the input must be a float32"):
        tf.LayerNormDenseGeneral(8).init(jax.random.key(0), jnp.ones((4, 8), jnp.complex64))
    with pytest.raises(TypeError, match="te_jax: LayerNorm: dtype=int8 is not supported"):
        tf.LayerNorm(dtype=jnp.int8).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="has no fp8_meta state"):
        with te_jax.autocast(recipe=RECIPES["delayed"]):
            tf.LayerNormMLP(256).apply(v, x)
    with pytest.raises(ValueError, match=r"rngs=\{'quantize': key\}"):
        _train_grads(tf.LayerNormMLP(256), v, x, RECIPES["nvfp4"], key=None)
    with pytest.raises(ValueError, match="rmsnorm has no bias"):
        tf.LayerNorm(layernorm_type="rmsnorm", use_bias=True).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="activation must be one of"):
        tf.LayerNormMLP(256, activation="tanh").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        tf.TransformerLayer(num_attention_heads=4, num_gqa_groups=3).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="batch_dims are not supported under te_jax.autocast"):
        with te_jax.autocast(recipe=RECIPES["current"]):
            tf.DenseGeneral(8, batch_dims=(0,)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="logical axis names"):
        tf.DenseGeneral(8, kernel_axes=("embed",)).init(jax.random.key(0), x)


def test_logical_axes():
    x = _x()
    v = tf.TransformerLayer(num_attention_heads=4, intermediate_dim=256, logical_axes=True).init(jax.random.key(0), x)
    specs = nn.get_partition_spec(v)["params"]
    assert specs["attention"]["qkv"]["kernel"] == jax.sharding.PartitionSpec("embed", "heads", "qkv", "kv")
    assert specs["mlp"]["wi_kernel"] == jax.sharding.PartitionSpec("embed", "mlp")
    assert specs["mlp"]["wo_kernel"] == jax.sharding.PartitionSpec("mlp", "embed")
    m = tf.DenseGeneral(8, kernel_axes=("embed", "mlp"), bias_axes=("mlp",))
    vd = m.init(jax.random.key(0), x)
    assert nn.get_partition_spec(vd)["params"]["kernel"] == jax.sharding.PartitionSpec("embed", "mlp")
    _close(m.apply(vd, x), m.apply(nn.meta.unbox(vd), x), 0)


def test_flax_fp8_dot_general_passes_through_unquantized_layers():
    """dot_general_cls (flax's FP8) serves the unquantized path of every layer; under a recipe it is an error."""
    x = _x((2, 16, 64))
    m = tf.TransformerLayer(num_attention_heads=4, intermediate_dim=128, dot_general_cls=nn.Fp8DirectDotGeneralOp)
    v = jax.jit(m.init)(jax.random.key(0), x)
    fp8 = v["_overwrite_with_gradient"]
    assert set(fp8["attention"]["qkv"]) == {"Fp8DirectDotGeneralOp_0"}
    assert set(fp8["mlp"]) == {"Fp8DirectDotGeneralOp_0", "Fp8DirectDotGeneralOp_1"}
    y = jax.jit(m.apply)(v, x)
    y_hp = jax.jit(tf.TransformerLayer(num_attention_heads=4, intermediate_dim=128).apply)({"params": v["params"]}, x)
    rel = float(jnp.linalg.norm(y - y_hp) / jnp.linalg.norm(y_hp))
    assert 1e-4 < rel < 5e-2  # quantized (not the high-precision product), to FP8 accuracy
    with te_jax.autocast(recipe=te_jax.recipe.DelayedScaling()):
        with pytest.raises(ValueError, match="dot_general_cls cannot be combined"):
            m.init(jax.random.key(0), x)


def _gemm_fast_accum_flags(fn, *args) -> list[bool]:
    """The fast_accum attribute of each te_jax GEMM in the lowered program of ``fn``, in program order."""
    return [f == "true" for f in re.findall(r"fast_accum = (true|false)", jax.jit(fn).lower(*args).as_text())]


@pytest.mark.parametrize("layer,forward_gemms", [("dense", 1), ("ln_dense", 1), ("ln_mlp", 2)])
@pytest.mark.parametrize("forward,backward", [(True, False), (True, True), (False, True), (False, False)])
def test_fast_accumulation_of_forward_and_backward_gemms(layer, forward_gemms, forward, backward):
    """The recipe's fast_accumulation reaches the forward GEMMs, backward_fast_accumulation dgrad and wgrad."""
    make = {"dense": lambda: tf.DenseGeneral(64), "ln_dense": lambda: tf.LayerNormDenseGeneral(64),
            "ln_mlp": lambda: tf.LayerNormMLP(96)}[layer]
    recipe = R.Float8CurrentScaling(fast_accumulation=forward, backward_fast_accumulation=backward)
    x = _x((16, 32))
    model = make()
    with te_jax.autocast(recipe=recipe):
        variables = jax.jit(model.init)(jax.random.key(1), x)

        def loss(params, x):
            y, _ = model.apply({**variables, "params": params}, x, mutable=["fp8_meta"])
            return jnp.sum((y[0] if isinstance(y, tuple) else y) ** 2)

        flags = _gemm_fast_accum_flags(jax.grad(loss, argnums=(0, 1)), variables["params"], x)
    # The forward GEMMs come first, then dgrad and wgrad of each (the second GEMM's first).
    assert flags == [forward] * forward_gemms + [backward] * 2 * forward_gemms


def test_layernorm_mlp_backward_fast_accumulation_per_gemm():
    """Each of the MLP's GEMMs takes its own quantizers' flags: the second GEMM's backward is not the first's."""
    x, w1, w2 = _x((16, 32)), _x((32, 96), 1) / 6, _x((96, 32), 2) / 10
    gamma, beta = jnp.ones((32,)), jnp.zeros((32,))
    current = R.Float8CurrentScaling()
    wi = dataclasses.replace(DenseQuantizers.from_recipe(current), fast_accum=False, backward_fast_accum=True)
    wo = dataclasses.replace(DenseQuantizers.from_recipe(current), fast_accum=True, backward_fast_accum=False)

    def loss(x, w1, w2):
        y = layernorm_mlp(x, gamma, beta, w1, None, w2, quantizers=MLPQuantizers(wi, wo))[0]
        return jnp.sum(y ** 2)

    flags = _gemm_fast_accum_flags(jax.grad(loss, argnums=(0, 1, 2)), x, w1, w2)
    assert flags == [False, True, False, False, True, True]  # forward wi, wo; backward wo (dgrad, wgrad), wi


def test_backward_fast_accumulation_must_be_a_bool():
    with pytest.raises(ValueError, match="backward_fast_accumulation"):
        R.DelayedScaling(backward_fast_accumulation=1)
