"""te_jax.flax layers: flax.linen parity, every recipe on every layer, state, scan, remat, dtypes, errors."""

from __future__ import annotations

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
