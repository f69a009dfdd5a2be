"""Block formats on shapes their blocks do not tile: partial blocks in quantize, dequantize, the GEMM and the layers.

The contract (docs/numerics.md, "Partial blocks"): a partial block at the end
of an axis is quantized as if zero padded to a whole block, so its scale comes
from its own elements; each copy keeps its last axis padded to whole blocks
and its rows as they are; scales have ``ceil(dim / block)`` entries along a
blocked axis; dequantize returns the logical shape; the GEMM zero pads what
its handlers need and returns the logical shape. Shapes the blocks tile run
exactly the ops they ran before (no pad, no slice).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from qtest_util import BUILTIN_RECIPES, assert_same_bits, on_cpu, random_matrix, with_specials
from te_jax.ops import backend
from te_jax import flax as tf
from te_jax import recipe as R
from te_jax.ops import gemm as G
from te_jax.core.stats import tensor_stats
from te_jax.ops import quantize as qops
from te_jax.quantize import (
    CurrentScalingQuantizer,
    Float8BlockQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from te_jax.quantize import fused
from te_jax.spec import reference as ref
from te_jax.quantize import dequantize, dequantize_colwise

E4 = jnp.float8_e4m3fn
# Norms and activations whose output blocks do not tile run unfused and say so (tested once, below).
pytestmark = pytest.mark.filterwarnings("ignore::te_jax.quantize.fused.UnfusedCastWarning")

# name -> (the op with its mode's arguments, its reference twin, block, rows per stored scale row)
QUANTIZE = {
    "mxfp8": (lambda x, **kw: qops.quantize_mxfp8(x, **kw), lambda x, **kw: ref.quantize_mxfp8(x, qdtype=E4, **kw),
              32, 1),
    "fp8_block": (lambda x, **kw: qops.quantize_fp8_block(x, **kw),
                  lambda x, **kw: ref.quantize_fp8_block(x, qdtype=E4, **kw), 128, 1),
    "fp8_block_2d": (lambda x, **kw: qops.quantize_fp8_block(x, block_2d=True, **kw),
                     lambda x, **kw: ref.quantize_fp8_block(x, qdtype=E4, block_2d=True, **kw), 128, 128),
    "nvfp4": (lambda x, **kw: qops.quantize_nvfp4(x, **kw),
              lambda x, **kw: ref.quantize_nvfp4(x, jnp.zeros((2,), jnp.uint32), **kw), 16, 1),
    "nvfp4_2d": (lambda x, **kw: qops.quantize_nvfp4(x, block_2d=True, **kw),
                 lambda x, **kw: ref.quantize_nvfp4(x, jnp.zeros((2,), jnp.uint32), block_2d=True, **kw), 16, 1),
    "nvfp4_rht": (lambda x, **kw: qops.quantize_nvfp4(x, rht=kw["colwise"], **kw),
                  lambda x, **kw: ref.quantize_nvfp4(x, jnp.zeros((2,), jnp.uint32), rht=kw["colwise"], **kw), 16, 1),
}
# (shape, rowwise, colwise): partial blocks on both axes, a partial block of one element, a single row or column.
CASES = [((30, 200), True, True), ((1, 33), True, False), ((129, 17), False, True)]


ON_GPU = jax.default_backend() == "gpu"


def _gemm_rtol(mode: str) -> float:
    """The GEMM handlers' relative-error bound (tests/ops/test_gemm.py's ``_tol``): float32 on the CPU; on a GPU,
    cuBLASLt's fast-accumulating per-tensor FP8, its block-scaled kernels, and the sm_90 bfloat16 emulation."""
    if not ON_GPU:
        return 1e-5
    if mode.startswith(("mxfp8", "nvfp4")):
        return 1e-5
    return 1e-3 if mode.startswith("block") else 1e-2


def _padded_reference(name: str, x, rowwise: bool, colwise: bool):
    """The reference twin on ``x`` zero padded to whole blocks on both axes, cut to the op's layout."""
    _, twin, block, scale_rows = QUANTIZE[name]
    m, n = x.shape
    xp = jnp.pad(x, ((0, -m % block), (0, -n % block)))
    q, s, q_t, s_t, *rest = twin(xp, rowwise=rowwise, colwise=colwise)
    up = lambda r: -(-r // scale_rows)  # noqa: E731
    keep = lambda a, r: a[:r] if a.ndim == 2 else a  # noqa: E731  (an absent copy is [0])
    return (keep(q, m), keep(s, up(m)), keep(q_t, n), keep(s_t, up(n)), *rest)


@pytest.mark.parametrize("name", list(QUANTIZE))
def test_quantize_is_the_zero_padded_reference(name):
    """The kernel (and, for the first case, the reference backend) equals the reference twin on the padded matrix."""
    op = QUANTIZE[name][0]
    for i, (shape, rowwise, colwise) in enumerate(CASES):
        x = with_specials(random_matrix(i, shape, jnp.float32), i) if min(shape) > 1 else random_matrix(i, shape)
        want = on_cpu(lambda x: _padded_reference(name, x.astype(jnp.float32), rowwise, colwise), x)
        for be in ("ffi", "reference")[: 2 if i == 0 else 1]:
            got = jax.jit(lambda x: op(x, rowwise=rowwise, colwise=colwise, backend=be))(x)
            for g, w, what in zip(got, want, ("q", "s", "q_t", "s_t", "amax", "amax_t")):
                if g.size or w.size:
                    assert_same_bits(g, w, f"{name} {shape} rowwise={rowwise} colwise={colwise} {be}: {what}")


@pytest.mark.parametrize("quantizer", [MXFP8Quantizer(), Float8BlockQuantizer(), Float8BlockQuantizer(E4, True)],
                         ids=["mxfp8", "fp8_block", "fp8_block_2d"])
def test_a_partial_block_takes_its_own_amax(quantizer):
    """The last block of [.., 1 real element] is what quantizing that element alone gives, saturation included."""
    block = quantizer.scaling_mode.block_cols
    x = random_matrix(7, (3, block + 1), jnp.float32).at[0, -1].set(0.0).at[1, -1].set(1e30).at[1, 0].set(3e-3)
    t = quantizer.quantize(x, colwise=True)
    alone = quantizer.quantize(x[:, -1:], colwise=True)
    assert t.data.shape == (3, 2 * block) and t.colwise_data.shape == (block + 1, block)
    if getattr(quantizer, "block_2d", False):  # one 128x128 block holds all three rows of the last column
        assert_same_bits(t.scale_inv[:, 1:], alone.scale_inv)
    else:
        assert_same_bits(t.scale_inv[:, 1:], alone.scale_inv)
        assert_same_bits(t.data[:, block:block + 1], alone.data[:, :1])
    assert_same_bits(t.colwise_data[-1:], alone.colwise_data)
    assert_same_bits(t.colwise_scale_inv[-1:], alone.colwise_scale_inv[-1:])
    assert np.all(np.asarray(t.data[:, block + 1:].astype(jnp.float32)) == 0)  # the padding is zero codes


@pytest.mark.parametrize("quantizer", [MXFP8Quantizer(), Float8BlockQuantizer(), Float8BlockQuantizer(E4, True),
                                       NVFP4Quantizer(), NVFP4Quantizer(block_2d=True), NVFP4Quantizer(rht=True)],
                         ids=["mxfp8", "fp8_block", "fp8_block_2d", "nvfp4", "nvfp4_2d", "nvfp4_rht"])
def test_dequantize_returns_the_logical_shape(quantizer):
    x = with_specials(random_matrix(3, (2, 15, 200), jnp.float32), 3)
    mode, block = quantizer.scaling_mode, quantizer.scaling_mode.block_cols

    @jax.jit
    def run(x):
        t = quantizer.quantize(x, colwise=True)
        padded = quantizer.quantize(jnp.pad(x.reshape(30, 200), ((0, -30 % block), (0, -200 % block))), colwise=True)
        got = [(dequantize(t, backend=be), dequantize_colwise(t, backend=be, undo_rht=True))
               for be in ("ffi", "reference")]
        want = (dequantize(padded)[:30, :200].reshape(x.shape), dequantize_colwise(padded, undo_rht=True)[:200, :30])
        return got, want, t.scale_inv, t.colwise_scale_inv

    got, want, scales, colwise_scales = run(x)
    assert scales.shape == mode.scale_shape(30, 200) and colwise_scales.shape == mode.scale_shape(200, 30)
    for values, values_colwise in got:
        assert_same_bits(values, want[0])
        assert_same_bits(values_colwise, want[1])


GEMM_QUANTIZERS = {
    "current": (CurrentScalingQuantizer(), CurrentScalingQuantizer()),
    "mxfp8": (MXFP8Quantizer(), MXFP8Quantizer()),
    "block_1x128_x_128x128": (Float8BlockQuantizer(), Float8BlockQuantizer(E4, True)),
    "block_128x128_x_1x128": (Float8BlockQuantizer(E4, True), Float8BlockQuantizer()),
    "nvfp4": (NVFP4Quantizer(), NVFP4Quantizer(block_2d=True)),
}


def _f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


@pytest.mark.parametrize("name", list(GEMM_QUANTIZERS))
def test_gemm_of_partial_blocks(name):
    """x [30, 200] @ w [200, 250] (+ bias), dgrad and wgrad: the products of the dequantized operands."""
    qx, qw = GEMM_QUANTIZERS[name]
    qdy = qw if getattr(qx, "block_2d", False) else qx  # gradients take 1D blocks (2D x 2D has no GEMM)
    x, w = random_matrix(0, (30, 200), jnp.float32, 3), random_matrix(1, (200, 250), jnp.float32, 3)
    dy = random_matrix(2, (30, 250), jnp.float32, 3)
    bias = random_matrix(3, (250,), jnp.float32, 1)

    @jax.jit
    def run(x, w, dy, bias):
        tx, tw, tdy = qx.quantize(x, colwise=True), qw.quantize(w, colwise=True), qdy.quantize(dy, colwise=True)
        operands = [(tx, tw, ((1,), (0,)), bias), (tdy, tw, ((1,), (1,)), None), (tx, tdy, ((0,), (0,)), None)]
        got = [[G.gemm(a, b, dims, out_dtype=jnp.float32, bias=c, backend=be) for be in ("ffi", "reference")]
               for a, b, dims, c in operands]
        copies = [(dequantize(t), dequantize_colwise(t, undo_rht=True)) for t in (tx, tw, tdy)]
        return got, copies

    got, ((x_r, x_c), (w_r, w_c), (dy_r, dy_c)) = jax.tree.map(_f64, run(x, w, dy, bias))
    wants = [x_r @ w_c.T + _f64(bias), dy_r @ w_r.T, x_c @ dy_c.T]  # products of the copies each GEMM reads
    for pair, want in zip(got, wants):
        for g in pair:
            assert g.shape == want.shape
            tol = _gemm_rtol(name)
            np.testing.assert_allclose(g, want, rtol=tol, atol=tol * np.abs(want).max())


def test_nvfp4_wgrad_with_hadamard_over_a_partial_block():
    """30 tokens contract as the Hadamard-domain copies of the zero-padded 32 tokens (the transforms cancel)."""
    q = NVFP4Quantizer(rht=True)
    x, dy = random_matrix(4, (30, 48), jnp.float32, 2), random_matrix(5, (30, 40), jnp.float32, 2)

    @jax.jit
    def run(x, dy):
        tx, tdy = q.quantize(x, colwise=True), q.quantize(dy, colwise=True)
        px, pdy = (q.quantize(jnp.pad(a, ((0, 2), (0, 0))), colwise=True) for a in (x, dy))
        copies = [(dequantize_colwise(t), dequantize_colwise(t, undo_rht=True)) for t in (px, pdy)]
        return G.gemm(tx, tdy, ((0,), (0,)), out_dtype=jnp.float32), tx.colwise_data, px.colwise_data, copies

    got, data, padded_data, ((x_h, x_v), (dy_h, dy_v)) = jax.tree.map(np.asarray, run(x, dy))
    assert data.shape == (48, 16) and np.array_equal(data, padded_data)
    want = _f64(x_h) @ _f64(dy_h).T
    np.testing.assert_allclose(_f64(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = _f64(x_v) @ _f64(dy_v).T
    np.testing.assert_allclose(want, exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max())


def test_per_tensor_gemm_with_unaligned_k_and_vocab_n():
    """K = 200 and N = 50257 (cuBLASLt needs 16-aligned M, N, K: the op pads with zeros and cuts the output)."""
    q = CurrentScalingQuantizer()
    x, w = random_matrix(6, (3, 200), jnp.float32, 2), random_matrix(7, (200, 50257), jnp.bfloat16, 2)
    tx, tw = q.quantize(x), q.quantize(w, rowwise=False, colwise=True)
    got = G.gemm(tx, tw, out_dtype=jnp.float32)
    want = _f64(dequantize(tx)) @ _f64(dequantize(tw))
    assert got.shape == (3, 50257)
    tol = _gemm_rtol("current")
    np.testing.assert_allclose(_f64(got), want, rtol=tol, atol=tol * np.abs(want).max())


def _lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_whole_blocks_run_no_pad_and_no_slice():
    """Aligned shapes lower to the ops they lowered to before partial blocks existed: no pad, no slice."""
    x, w = jnp.ones((128, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16)
    for recipe in (R.MXFP8BlockScaling(), R.Float8BlockScaling(), R.Float8CurrentScaling()):
        q = te_jax.core.DenseQuantizers.from_recipe(recipe)
        text = _lowered(jax.grad(lambda x, w: jnp.sum(te_jax.dense(x, w, quantizers=q)[0]), (0, 1)), x, w)
        assert "stablehlo.pad" not in text and "stablehlo.slice" not in text, recipe
    for quantizer in (MXFP8Quantizer(), Float8BlockQuantizer(E4, True), NVFP4Quantizer(rht=True)):
        text = _lowered(lambda x: dequantize(quantizer.quantize(x, colwise=True)), x)
        assert "stablehlo.pad" not in text and "stablehlo.slice" not in text, quantizer
    # ... while a partial block pads once per quantized tensor.
    text = _lowered(lambda x: dequantize(MXFP8Quantizer().quantize(x, colwise=True)), x[:30, :200])
    assert text.count("stablehlo.pad") == 1


# ---- the layers ------------------------------------------------------------------------------------------

TOL = {"nvfp4": 0.3}  # relative error of a layer's output vs high precision; E4M3 ~5% per GEMM


def _rel(a, b) -> float:
    a, b = _f64(a), _f64(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _functional(name: str, q, state, key):
    """``f(x, w) -> y`` for one functional op on x [3, 10, 200] and w [200, 250] (MLP: F = 200)."""
    keys = jax.random.split(jax.random.key(9), 3)
    gamma, beta = 1 + random_matrix(10, (200,), jnp.float32, 1) / 8, random_matrix(11, (200,), jnp.float32, 1) / 8
    w1 = jax.random.normal(keys[0], (200, 200)) / 14
    if name == "dense":
        return lambda x, w: te_jax.dense(x, w, quantizers=q, state=state, key=key)[0]
    if name == "layernorm_dense":
        return lambda x, w: te_jax.layernorm_dense(x, gamma, beta, w, quantizers=q, state=state, key=key)[0]
    mq = te_jax.core.MLPQuantizers(q, q)
    mstate = None if state is None else {"wi": state, "wo": state}
    return lambda x, w: te_jax.layernorm_mlp(x, gamma, beta, w1, None, w[:, :200].T / 1.5, quantizers=mq,
                                             state=mstate, key=key)[0]


@functools.lru_cache(maxsize=None)  # the high-precision results serve every recipe
def _functional_value_and_grads(op: str, q, be: str):
    """The loss and its gradients in x [3, 10, 200] and w [200, 250] of one op with quantizers ``q``."""
    x = random_matrix(12, (3, 10, 200), jnp.float32, 2)
    w = jax.random.normal(jax.random.key(13), (200, 250)) / 14
    c = jax.random.normal(jax.random.key(14), (3, 10, 250 if op != "layernorm_mlp" else 200))
    f = _functional(op, q, q.init_state() if q.stateful() else None, jax.random.key(15))
    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * c)  # noqa: E731
    with backend.use(be), te_jax.train.fp8_state_updates():
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)


@pytest.mark.parametrize("op", ["dense", "layernorm_dense", "layernorm_mlp"])
@pytest.mark.parametrize("recipe", list(BUILTIN_RECIPES))
def test_functional_layers(op, recipe):
    """30 tokens, 200 features, N = 250: forward and gradients match the reference backend and high precision."""
    q = te_jax.core.DenseQuantizers.from_recipe(BUILTIN_RECIPES[recipe])
    got = _functional_value_and_grads(op, q, "ffi")
    hp = _functional_value_and_grads(op, te_jax.core.DenseQuantizers(), "ffi")
    for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(hp)):
        assert g.shape == h.shape and _rel(g, h) < 2 * TOL.get(recipe, 0.08)
    if op == "dense" and recipe in ("mxfp8", "block", "nvfp4"):  # the kernels against their pure-JAX twins
        twin = _functional_value_and_grads(op, q, "reference")
        for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(twin)):
            tol = max(1e-4, _gemm_rtol(recipe))
            np.testing.assert_allclose(_f64(g), _f64(t), rtol=tol, atol=tol * np.abs(_f64(t)).max())


# The Linen layers are thin wrappers of the functional ops tested above; LayerNormMLP runs a norm, two GEMMs and
# an activation, with 200 features and a gated 2 x 200 first GEMM.
LAYERS = {"ln_mlp": lambda: tf.LayerNormMLP(200, activation="swiglu")}
_LINEN_X = random_matrix(16, (3, 10, 200), jnp.float32, 2)


def _linen_grads(layer: str, variables, recipe):
    """``((loss, y), grads)`` of one step of a layer under ``recipe`` (None: autocast disabled)."""
    model = LAYERS[layer]()

    def loss(v):
        y = model.apply(v, _LINEN_X, rngs={"quantize": jax.random.key(3)})
        return jnp.mean(jnp.sin(y.astype(jnp.float32)) ** 2), y

    with te_jax.autocast(recipe=recipe) if recipe else te_jax.autocast(enabled=False):
        return jax.jit(te_jax.train.value_and_grad(loss, has_aux=True))(variables)


@functools.lru_cache(maxsize=None)  # one high-precision step per layer serves every recipe
def _linen_high_precision(layer: str):
    with te_jax.autocast(enabled=False):
        params = jax.jit(LAYERS[layer]().init)(jax.random.key(1), _LINEN_X)["params"]
    return params, _linen_grads(layer, {"params": params}, None)


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("recipe", list(BUILTIN_RECIPES))
def test_linen_layers(layer, recipe):
    """The Linen layers under autocast at tokens = 30, features = 200: output and gradients near high precision."""
    params, ((_, y_hp), g_hp) = _linen_high_precision(layer)
    with te_jax.autocast(recipe=BUILTIN_RECIPES[recipe]):
        variables = {**jax.jit(LAYERS[layer]().init)(jax.random.key(1), _LINEN_X), "params": params}
    if "fp8_meta" in variables:  # one step to calibrate the delayed scales
        _, g = _linen_grads(layer, variables, BUILTIN_RECIPES[recipe])
        fp8_meta = jax.jit(te_jax.train.apply_fp8_update)(variables["fp8_meta"], g["fp8_meta"])
        variables = {**variables, "fp8_meta": fp8_meta}
    (_, y), g = _linen_grads(layer, variables, BUILTIN_RECIPES[recipe])
    tol = TOL.get(recipe, 0.08)
    assert y.shape == y_hp.shape and _rel(y, y_hp) < tol
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g["params"])[0], jax.tree.leaves(g_hp["params"])):
        assert _rel(a, b) < 2 * tol + 0.1, path


def test_unfused_partial_block_cast_warns_and_matches_the_quantizer():
    """A norm whose output blocks do not tile runs unfused: the quantizer's own result, with a warning saying why."""
    x = random_matrix(17, (30, 200), jnp.float32, 2)
    gamma = jnp.ones((200,))
    with pytest.warns(fused.UnfusedCastWarning, match=r"do not tile the output matrix \[30, 200\]"):
        y, _, _ = fused.norm(x, gamma, None, MXFP8Quantizer(), kind="rmsnorm", colwise=True)
    hp, _, _ = fused.norm(x, gamma, None, None, kind="rmsnorm", out_dtype=jnp.float32)
    want = MXFP8Quantizer().quantize(hp, colwise=True)
    assert_same_bits(y.data, want.data)
    assert_same_bits(y.colwise_scale_inv, want.colwise_scale_inv)


@pytest.mark.parametrize("quantizer", [Float8BlockQuantizer(E4, True), NVFP4Quantizer(rht=True)],
                         ids=["fp8_block_2d", "nvfp4_rht"])
def test_inspect_statistics_ignore_the_padding(quantizer):
    """te_jax.inspect's statistics of a partial-block tensor are those of the tensor zero padded to whole blocks."""
    x = random_matrix(18, (30, 200), jnp.float32, 3)
    block = quantizer.scaling_mode.block_cols
    xp = jnp.pad(x, ((0, -30 % block), (0, -200 % block)))

    @jax.jit
    def run(x, xp):
        t, tp = quantizer.quantize(x, colwise=True), quantizer.quantize(xp, colwise=True)
        return [(tensor_stats(x, t, copy), tensor_stats(xp, tp, copy)) for copy in ("rowwise", "colwise")]

    for got, want in run(x, xp):
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
