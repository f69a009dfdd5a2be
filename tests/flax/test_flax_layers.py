"""te_jax.flax layers: flax.linen parity, every recipe on every layer, state, scan, remat, dtypes, errors."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from qtest_util import BUILTIN_RECIPES
from te_jax import flax as tf
from te_jax import recipe as R
from te_jax.core.dense import DenseQuantizers, dense
from te_jax.core.layernorm_dense import layernorm_dense
from te_jax.core.layernorm_mlp import MLPQuantizers, layernorm_mlp
from te_jax.ops.norm_act import apply_activation
from te_jax.ops.norm_act import normalize

RECIPES = {
    **BUILTIN_RECIPES,
    "custom_ref": R.load_recipe("current_scaling_ref"),
    "custom_mixed": R.load_recipe("mixed_per_layer"),
}


def _x(shape=(2, 64, 128), seed=0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(seed), shape) * 1.5 + 0.3).astype(dtype)


def _randomize(tree, seed=5, scale=0.2):
    """Parameters with random values (so scales and biases are exercised)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([v + scale * jax.random.normal(k, v.shape, v.dtype) for k, v in zip(keys, leaves)])


@pytest.fixture(autouse=True)
def _float32_products():
    """float32 products in float32: on GPUs jax's default lets XLA multiply float32 matrices in TF32 (10-bit
    mantissas), and the parity checks here compare float32 layers with float32 references."""
    with jax.default_matmul_precision("highest"):
        yield


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# ---- packaging ------------------------------------------------------------------------------


def test_te_jax_flax_is_lazy_and_flax_is_real():
    code = ("import sys, te_jax; assert 'te_jax.flax' not in sys.modules; import flax; "
            "assert flax.__name__ == 'flax' and 'site-packages' in flax.__file__; "
            "assert te_jax.flax.DenseGeneral.__module__ == 'te_jax.flax.dense'; "
            "import te_jax.train.step; assert te_jax.train.step.fp32_max_grad.__module__.startswith('flax.')")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- parity with flax.linen (autocast disabled) -----------------------------------------------


@pytest.mark.parametrize("kw,shape", [
    (dict(features=32), (4, 8, 16)),
    (dict(features=(3, 5), axis=(-2, -1)), (4, 6, 8, 5)),
    (dict(features=7, axis=(1, -1), use_bias=False), (4, 6, 8, 5)),
    (dict(features=12, dtype=jnp.bfloat16), (4, 16)),
    (dict(features=12, param_dtype=jnp.bfloat16), (4, 16)),
    (dict(features=6, batch_dims=(0,), axis=-1), (3, 4, 8)),
    (dict(features=6, dot_general=jax.lax.dot_general), (3, 4, 8)),
])
def test_dense_general_is_flax(kw, shape):
    x = _x(shape)
    ours, theirs = tf.DenseGeneral(**kw), nn.DenseGeneral(**kw)
    # jitted (op by op, each small op would compile on its own); ours and flax's alike
    v_ours, v_theirs = jax.jit(ours.init)(jax.random.key(1), x), jax.jit(theirs.init)(jax.random.key(1), x)
    assert jax.tree.all(jax.tree.map(lambda a, b: a.shape == b.shape and bool(jnp.all(a == b)), v_ours, v_theirs))
    v = _randomize(v_theirs)
    y, y_ref = jax.jit(ours.apply)(v, x), jax.jit(theirs.apply)(v, x)
    assert y.dtype == y_ref.dtype and np.array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    g, g_ref = (jax.jit(jax.grad(lambda v, m=m: jnp.sum(m.apply(v, x).astype(jnp.float32) ** 2)))(v)
                for m in (ours, theirs))
    jax.tree.map(lambda a, b: _close(a, b, 1e-6), g, g_ref)


@pytest.mark.parametrize("kw,dtype", [
    (dict(), jnp.float32),
    (dict(use_bias=False), jnp.float32),
    (dict(use_scale=False, epsilon=1e-3), jnp.float32),
    (dict(dtype=jnp.bfloat16), jnp.float32),
    (dict(), jnp.bfloat16),
    (dict(param_dtype=jnp.bfloat16), jnp.bfloat16),
    (dict(layernorm_type="rmsnorm"), jnp.float32),
    (dict(layernorm_type="rmsnorm", dtype=jnp.bfloat16), jnp.float32),
])
def test_layernorm_is_flax(kw, dtype):
    x = _x((4, 8, 64), dtype=dtype)
    rms = kw.get("layernorm_type") == "rmsnorm"
    flax_kw = {k: v for k, v in kw.items() if k != "layernorm_type"}
    ours, theirs = tf.LayerNorm(**kw), (nn.RMSNorm(**flax_kw) if rms else nn.LayerNorm(**flax_kw))
    v = _randomize(jax.jit(theirs.init)(jax.random.key(1), x))
    assert jax.tree.map(jnp.shape, jax.eval_shape(ours.init, jax.random.key(1), x)) == jax.tree.map(jnp.shape, v)
    y, y_ref = jax.jit(ours.apply)(v, x), jax.jit(theirs.apply)(v, x)
    tol = 1e-5 if y_ref.dtype == jnp.float32 else 1e-2
    assert y.dtype == y_ref.dtype
    _close(y, y_ref, tol)
    g, g_ref = (jax.jit(jax.grad(lambda v, x, m=m: jnp.sum(jnp.sin(m.apply(v, x).astype(jnp.float32))),
                                 argnums=(0, 1)))(v, x)
                for m in (ours, theirs))
    jax.tree.map(lambda a, b: _close(a, b, 1e-4 if a.dtype == jnp.float32 and tol == 1e-5 else 5e-2), g, g_ref)


def test_zero_centered_gamma():
    x = _x((4, 64))
    m = tf.LayerNorm(zero_centered_gamma=True)
    v = jax.jit(m.init)(jax.random.key(0), x)
    assert not jnp.any(v["params"]["scale"])  # zeros: the layer starts as a plain norm
    v = _randomize(v)
    ref = jax.jit(nn.LayerNorm().apply)({"params": {"scale": 1 + v["params"]["scale"], "bias": v["params"]["bias"]}},
                                        x)
    _close(jax.jit(m.apply)(v, x), ref, 1e-5)


class _FlaxLnDense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral(self.features)(nn.LayerNorm()(x))


def test_layernorm_dense_general_takes_flax_weights():
    x = _x((2, 16, 64))
    flax_v = _randomize(jax.jit(_FlaxLnDense(32).init)(jax.random.key(0), x))
    p = flax_v["params"]
    ours = {"params": {"scale": p["LayerNorm_0"]["scale"], "ln_bias": p["LayerNorm_0"]["bias"],
                       "kernel": p["DenseGeneral_0"]["kernel"], "bias": p["DenseGeneral_0"]["bias"]}}
    m = tf.LayerNormDenseGeneral(32)
    assert jax.tree.map(jnp.shape, jax.eval_shape(m.init, jax.random.key(0), x)) == jax.tree.map(jnp.shape, ours)
    _close(jax.jit(m.apply)(ours, x), jax.jit(_FlaxLnDense(32).apply)(flax_v, x), 1e-5)
    g = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x) ** 2)))(ours)
    g_ref = jax.jit(jax.grad(lambda v: jnp.sum(_FlaxLnDense(32).apply(v, x) ** 2)))(flax_v)["params"]
    _close(g["params"]["scale"], g_ref["LayerNorm_0"]["scale"], 1e-4)
    _close(g["params"]["kernel"], g_ref["DenseGeneral_0"]["kernel"], 1e-4)


_ACTS = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu, "squared_relu": lambda h: nn.relu(h) ** 2}


class _FlaxMLP(nn.Module):
    features: int
    activation: str

    @nn.compact
    def __call__(self, x):
        gated = self.activation in ("swiglu", "geglu")
        h = nn.DenseGeneral((2, self.features) if gated else self.features)(nn.LayerNorm()(x))
        if gated:
            a = (nn.silu if self.activation == "swiglu" else nn.gelu)(h[..., 0, :]) * h[..., 1, :]
        else:
            a = _ACTS[self.activation](h)
        return nn.Dense(x.shape[-1])(a)


@pytest.mark.parametrize("act", ["gelu", "relu", "silu", "squared_relu", "swiglu", "geglu"])
def test_layernorm_mlp_takes_flax_weights(act):
    x = _x((2, 16, 64))
    ref = _FlaxMLP(96, act)
    flax_v = _randomize(jax.jit(ref.init)(jax.random.key(0), x), scale=0.05)
    p = flax_v["params"]
    ours = {"params": {"scale": p["LayerNorm_0"]["scale"], "ln_bias": p["LayerNorm_0"]["bias"],
                       "wi_kernel": p["DenseGeneral_0"]["kernel"], "wi_bias": p["DenseGeneral_0"]["bias"],
                       "wo_kernel": p["Dense_0"]["kernel"], "wo_bias": p["Dense_0"]["bias"]}}
    m = tf.LayerNormMLP(96, activation=act)
    assert jax.tree.map(jnp.shape, jax.eval_shape(m.init, jax.random.key(0), x)) == jax.tree.map(jnp.shape, ours)
    # GPUs: our activation kernel and XLA's evaluate tanh/erf with different float32 approximations.
    _close(jax.jit(m.apply)(ours, x), jax.jit(ref.apply)(flax_v, x), 1e-5 if jax.default_backend() == "cpu" else 1e-4)
    gx = jax.jit(jax.grad(lambda x: jnp.sum(m.apply(ours, x) ** 2)))(x)
    gx_ref = jax.jit(jax.grad(lambda x: jnp.sum(ref.apply(flax_v, x) ** 2)))(x)
    _close(gx, gx_ref, 1e-4)


def _ref_transformer(p, x, n, kv, causal=True):
    """A from-scratch pre-norm block (naive softmax attention, GQA by repeating heads)."""
    a, m = p["attention"], p["mlp"]

    def ln(x, s, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * s + b

    qkv = jnp.einsum("bth,hgjd->btgjd", ln(x, a["qkv"]["scale"], a["qkv"]["ln_bias"]), a["qkv"]["kernel"])
    g = n // kv  # per key/value head: g query heads, then the key, then the value
    q = qkv[:, :, :, :g].reshape(*x.shape[:2], n, -1)
    k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
    t = jnp.arange(x.shape[1])
    q, k = tf.rotary_embedding(q, t), tf.rotary_embedding(k, t)
    k, v = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) / jnp.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), s, -jnp.inf)
    o = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(s, -1), v)
    x = x + jnp.einsum("btnd,ndh->bth", o, a["out"]["kernel"])
    h = nn.gelu(ln(x, m["scale"], m["ln_bias"]) @ m["wi_kernel"])
    return x + h @ m["wo_kernel"]


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_transformer_layer_matches_reference(heads, groups):
    x = _x((2, 16, 64))
    m = tf.TransformerLayer(num_attention_heads=heads, num_gqa_groups=groups, intermediate_dim=96)
    v = _randomize(jax.jit(m.init)(jax.random.key(0), x), scale=0.05)
    d = 64 // heads
    assert v["params"]["attention"]["qkv"]["kernel"].shape == (64, groups, heads // groups + 2, d)
    assert v["params"]["attention"]["out"]["kernel"].shape == (heads, d, 64)
    ref = jax.jit(_ref_transformer, static_argnums=(2, 3))
    _close(jax.jit(m.apply)(v, x), ref(v["params"], x, heads, groups), 2e-5)


def test_attention_picks_cudnn_only_on_gpus_where_it_fits(monkeypatch):
    pick = tf.transformer.choose_attention_implementation
    q = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)
    assert pick(q) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pick(q) == "cudnn" and pick(q.astype(jnp.float16)) == "cudnn"
    assert pick(q.astype(jnp.float32)) == "xla"  # cuDNN takes half precision only
    assert pick(jnp.zeros((2, 16, 4, 12), jnp.bfloat16)) == "xla"  # head dim not a multiple of 8
    assert pick(jnp.zeros((2, 16, 4, 192), jnp.bfloat16)) == "xla"
    assert pick(jnp.zeros((2, 15, 4, 64), jnp.bfloat16), mask=jnp.ones((15, 15), bool)) == "xla"
    assert pick(jnp.zeros((2, 15, 4, 64), jnp.bfloat16)) == "cudnn"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert pick(q) == "xla"


# ---- every recipe on every layer ------------------------------------------------------------

LAYERS = {
    "dense": lambda **kw: tf.DenseGeneral(256, **kw),
    "layernorm": lambda **kw: tf.LayerNorm(**kw),
    "ln_dense": lambda **kw: tf.LayerNormDenseGeneral(256, layernorm_type="rmsnorm", **kw),
    "ln_mlp": lambda **kw: tf.LayerNormMLP(256, **kw),
    "ln_mlp_swiglu": lambda **kw: tf.LayerNormMLP(256, activation="swiglu", use_bias=False, zero_centered_gamma=True,
                                                  **kw),
    "transformer": lambda **kw: tf.TransformerLayer(num_attention_heads=4, num_gqa_groups=2, intermediate_dim=256,
                                                    use_bias=True, **kw),
}


def _wrapped(make, name):
    """The layer as a submodule named like an attention or MLP block (custom recipes read the path)."""

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return make(name=name)(x)

    return Outer()


def _train_grads(model, variables, x, recipe, key=jax.random.key(3)):
    rngs = {} if key is None else {"quantize": key}

    def loss(v):
        y = model.apply(v, x, rngs=rngs)
        return jnp.mean(jnp.sin(y.astype(jnp.float32)) ** 2), y

    with te_jax.autocast(recipe=recipe) if recipe else te_jax.autocast(enabled=False):
        return jax.jit(te_jax.train.value_and_grad(loss, has_aux=True))(variables)


_HP_GRADS: dict[str, tuple] = {}


def _hp_train_grads(layer: str, model, params, x):
    """``_train_grads`` without quantization, computed once per layer (every recipe's init gives the same params)."""
    cached = _HP_GRADS.get(layer)
    if cached is None or not jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), cached[0], params)):
        cached = _HP_GRADS[layer] = (params, _train_grads(model, {"params": params}, x, None))
    return cached[1]


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_on_every_layer(layer, recipe):
    x = _x()
    model = _wrapped(LAYERS[layer], "mlp" if "mlp" in layer else "attention")
    with te_jax.autocast(recipe=RECIPES[recipe]):
        variables = jax.jit(model.init)(jax.random.key(1), x)
    has_meta = recipe == "delayed" and layer != "layernorm"
    assert ("fp8_meta" in variables) == has_meta
    if has_meta:  # one step to calibrate the delayed scales (they start at 1)
        _, grads = _train_grads(model, variables, x, RECIPES[recipe])
        variables = {**variables, "fp8_meta": te_jax.train.apply_fp8_update(variables["fp8_meta"], grads["fp8_meta"])}
        scales = [float(s[0]) for s in jax.tree.leaves(jax.tree.map(lambda s: s["scale"], variables["fp8_meta"],
                                                                   is_leaf=te_jax.quantize.delayed.is_state))]
        assert scales and all(s != 1.0 for s in scales)
    (loss, y), grads = _train_grads(model, variables, x, RECIPES[recipe])
    (loss_hp, y_hp), grads_hp = _hp_train_grads(layer, model, variables["params"], x)
    # E4M3 operands give ~5% error per GEMM on random data, E5M2 ~10%, NVFP4 ~15%; a wrong copy or role ~100%.
    tol = {"nvfp4": 0.3, "custom_ref": 0.15}.get(recipe, 0.08)
    assert _rel(y, y_hp) < tol
    for path, g in jax.tree_util.tree_flatten_with_path(grads["params"])[0]:
        g_hp = grads_hp["params"]
        for k in path:
            g_hp = g_hp[k.key]
        assert _rel(g, g_hp) < 2 * tol + 0.1, (path, _rel(g, g_hp))


def test_inference_equals_training_forward():
    """apply without differentiation writes fewer copies but computes the same output."""
    x = _x()
    for recipe in ("delayed", "nvfp4", "block"):
        model = LAYERS["transformer"]()
        with te_jax.autocast(recipe=RECIPES[recipe]):
            v = jax.jit(model.init)(jax.random.key(1), x)
            y = jax.jit(lambda v: model.apply(v, x, rngs={"quantize": jax.random.key(3)}))(v)
        (_, y_train), _ = _train_grads(model, v, x, RECIPES[recipe])
        assert np.array_equal(np.asarray(y), np.asarray(y_train))


def test_role_paths_reach_the_recipe():
    seen = set()

    def qfactory(role):
        seen.add((role.path_str, str(role)))
        return None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = tf.TransformerLayer(num_attention_heads=4, intermediate_dim=256, name="block_0")(x)
            return tf.DenseGeneral(8, name="head")(x)

    with te_jax.autocast(recipe=R.CustomRecipe(qfactory=qfactory)):
        jax.eval_shape(Net().init, jax.random.key(0), _x())  # the recipe is asked while tracing
    paths = {p for p, _ in seen}
    assert paths == {"block_0/attention/qkv", "block_0/attention/out", "block_0/mlp/wi", "block_0/mlp/wo", "head"}
    assert {r for _, r in seen} == set(R.ROLES)


def test_mixed_per_layer_recipe_quantizes_by_path():
    model = _wrapped(LAYERS["transformer"], "block")
    x = _x()
    with te_jax.autocast(recipe=RECIPES["custom_mixed"]):
        v = jax.jit(model.init)(jax.random.key(0), x)
        text = str(jax.make_jaxpr(lambda v: model.apply(v, x))(v))
    assert text.count("target_name=te_jax_norm_fwd") == 2  # mxfp8 qkv input and current-scaling mlp input fused
    assert "te_jax_quantize_mxfp8" in text and "te_jax_quantize_fp8_current" in text


# ---- functional cores: the fused kernels give what dense() on the unfused pieces gives -----


@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8", "block", "nvfp4"])
def test_layernorm_dense_equals_dense_of_normalize(recipe):
    x, key = _x((2, 64, 128)), jax.random.key(7)
    gamma, beta = 1 + 0.1 * _x((128,), 1), 0.1 * _x((128,), 2)
    w, b = _x((128, 256), 3) / 12, _x((256,), 4) / 10
    q = DenseQuantizers.from_recipe(RECIPES[recipe])
    st = q.init_state()

    def fused(x, gamma, beta, w, b):
        return layernorm_dense(x, gamma, beta, w, b, quantizers=q, state=st, key=key)[0]

    def unfused(x, gamma, beta, w, b):
        return dense(normalize(x, gamma, beta), w, b, quantizers=q, state=st, key=key)[0]

    with te_jax.train.fp8_state_updates():  # the state's update is not compared here
        outs = [jax.jit(jax.value_and_grad(lambda *a, f=f: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3, 4)))(
            x, gamma, beta, w, b) for f in (fused, unfused)]
    for a, b_ in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        _close(a, b_, 2e-5)


@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_layernorm_mlp_equals_dense_chain(recipe, act):
    """Norm and activation casts fused, dropout in between, roles per GEMM: as dense() on the unfused pieces."""
    x, key = _x((2, 64, 128)), jax.random.key(7)
    n1 = 512 if act == "swiglu" else 256
    gamma, beta = 1 + 0.1 * _x((128,), 1), 0.1 * _x((128,), 2)
    w1, b1, w2, b2 = _x((128, n1), 3) / 12, _x((n1,), 4) / 10, _x((256, 128), 5) / 16, _x((128,), 6) / 10
    mask = jax.random.bernoulli(jax.random.key(8), 0.9, (2, 64, 256)) / 0.9
    q = MLPQuantizers.from_recipe(RECIPES[recipe])
    st = q.init_state()

    def fused(x, gamma, beta, w1, b1, w2, b2, mask=None):
        return layernorm_mlp(x, gamma, beta, w1, b1, w2, b2, activation=act, quantizers=q, state=st, key=key,
                             dropout_mask=mask)[0]

    def unfused(x, gamma, beta, w1, b1, w2, b2, mask=None):
        ki, ko = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
        h = dense(normalize(x, gamma, beta), w1, b1, quantizers=q.wi, state=st["wi"], key=ki)[0]
        a = apply_activation(h, act) * (1 if mask is None else mask)
        return dense(a, w2, b2, quantizers=q.wo, state=st["wo"], key=ko)[0]

    for m in (None, mask):
        with te_jax.train.fp8_state_updates():  # the state's update is not compared here
            outs = [jax.jit(jax.value_and_grad(lambda *a, f=f: jnp.sum(jnp.sin(f(*a, mask=m))),
                                               argnums=tuple(range(7))))(x, gamma, beta, w1, b1, w2, b2)
                    for f in (fused, unfused)]
        for a, b_ in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
            _close(a, b_, 5e-5)


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
