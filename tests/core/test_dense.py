"""te_jax.dense: each GEMM gets the right copies of the right quantized tensors, bit for bit."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import te_jax
from te_jax import recipe as R
from te_jax.core.dense import DenseQuantizers, dense
from te_jax.ops.gemm import gemm
from te_jax.quantize import CurrentScalingQuantizer, DelayedScalingQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_jax.quantize import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_models import Dense  # noqa: E402

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    width = np.dtype(f"u{a.dtype.itemsize}")
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(width), b.view(width))


@pytest.fixture
def cpu_device():
    """Runs a test on XLA:CPU. Such tests compare the bits of two compositions of XLA ops (or use
    shapes below cuBLASLt's 16-alignment); XLA:GPU may order a reduction differently in each. The
    GPU kernels' own numerics are tested in test_gemm.py and test_quantize.py."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _data(m=64, k=64, n=32, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = (jax.random.normal(keys[0], (m, k)) * 2).astype(dtype)
    w = (jax.random.normal(keys[1], (k, n)) / 8).astype(dtype)
    b = jax.random.normal(keys[2], (n,)).astype(dtype)
    c = jax.random.normal(keys[3], (m, n))
    return x, w, b, c


def _fwd_bwd(q, x, w, b, c, state=None, key=None):
    def loss(x, w, b):
        y, _ = dense(x, w, b, quantizers=q, state=state, key=key)
        return jnp.sum(y.astype(jnp.float32) * c), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, b)
    return (y, *grads)


def test_high_precision_path_is_flax():
    x = jax.random.normal(jax.random.key(0), (4, 6, 8, 5))
    layer = nn.DenseGeneral(features=(3, 7), axis=(-2, -1))
    variables = layer.init(jax.random.key(1), x)
    kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    y, state = dense(x, kernel, bias, contracting_dims=((2, 3), (0, 1)))
    assert state is None and _bits(y, layer.apply(variables, x))
    y2, _ = dense(x, kernel, None, contracting_dims=((-2, -1), (0, 1)), quantizers=DenseQuantizers())
    assert _bits(y2, lax.dot_general(x, kernel, (((2, 3), (0, 1)), ((), ()))))


@pytest.mark.parametrize("make", [lambda: CurrentScalingQuantizer(E4), lambda: MXFP8Quantizer(E4)],
                         ids=["per_tensor", "mxfp8"])
@pytest.mark.usefixtures("cpu_device")
def test_each_gemm_uses_the_right_copies(make):
    """forward x(row) W(col); dgrad dy(row) W(row); wgrad x(col) dy(col): all from one quantization each."""
    qx, qw = make(), make()
    qg = dataclasses.replace(make(), dtype=E5)
    q = DenseQuantizers(input=qx, weight=qw, grad_output=qg)
    x, w, b, c = _data()
    y, dx, dw, db = _fwd_bwd(q, x, w, b, c)
    tx, tw = qx.quantize(x, colwise=True), qw.quantize(w, colwise=True)
    tdy = qg.quantize(c, colwise=True)  # dy = c
    assert _bits(y, gemm(tx, tw, ((1,), (0,)), out_dtype=jnp.float32, bias=b))
    assert _bits(dx, gemm(tdy, tw, ((1,), (1,)), out_dtype=jnp.float32, fast_accum=False))
    assert _bits(dw, gemm(tx, tdy, ((0,), (0,)), out_dtype=jnp.float32, fast_accum=False))
    assert _bits(db, jnp.sum(c, axis=0))
    # ... and close to the high-precision product
    assert float(jnp.linalg.norm(y - (x @ w + b)) / jnp.linalg.norm(x @ w + b)) < 0.1


def test_one_quantize_call_per_tensor():
    """The columnwise copies come from the same call as the rowwise ones: backward reads no x or W."""
    x, w, b, c = _data()
    q = DenseQuantizers.from_recipe(R.Float8CurrentScaling())

    def loss(x, w, b):
        return jnp.sum(dense(x, w, b, quantizers=q)[0] * c)

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w, b))
    assert jaxpr.count("target_name=te_jax_quantize") == 3  # x, W, dy


@pytest.mark.usefixtures("cpu_device")
def test_output_and_grad_input_quantizers_quantize_dequantize():
    x, w, b, c = _data()
    qo, qgi = CurrentScalingQuantizer(E5), CurrentScalingQuantizer(E4)
    y, dx, dw, _ = _fwd_bwd(DenseQuantizers(output=qo, grad_input=qgi), x, w, b, c)
    y_hp = lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) + b
    assert _bits(y, dequantize(qo.quantize(y_hp), jnp.float32))
    dx_hp = lax.dot_general(c, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    assert _bits(dx, dequantize(qgi.quantize(dx_hp), jnp.float32))
    np.testing.assert_allclose(dw, x.T @ c, rtol=1e-5, atol=1e-5)  # wgrad untouched


@pytest.mark.usefixtures("cpu_device")
def test_one_operand_quantized():
    x, w, b, c = _data()
    qx = CurrentScalingQuantizer(E4)
    y, dx, dw, _ = _fwd_bwd(DenseQuantizers(input=qx), x, w, b, c)
    xq = dequantize(qx.quantize(x), jnp.float32)
    np.testing.assert_allclose(y, xq @ w + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, xq.T @ c, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dx, c @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("contract,kshape", [(((2,), (0,)), (64, 32)), (((1, 2), (0, 1)), (8, 64, 32)),
                                             (((0,), (0,)), (4, 32)), (((2,), (1,)), (32, 64))])
@pytest.mark.usefixtures("cpu_device")
def test_contracting_dims(contract, kshape):
    x = jax.random.normal(jax.random.key(0), (4, 8, 64))
    w = jax.random.normal(jax.random.key(1), kshape) / 8
    q = DenseQuantizers.from_recipe(R.Float8CurrentScaling())
    want = lax.dot_general(x, w, (contract, ((), ())))
    y, _ = dense(x, w, contracting_dims=contract, quantizers=q)
    assert y.shape == want.shape
    assert float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want)) < 0.1
    gx, gw = jax.grad(lambda x, w: jnp.sum(dense(x, w, contracting_dims=contract, quantizers=q)[0] ** 2),
                      argnums=(0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w: jnp.sum(lax.dot_general(x, w, (contract, ((), ()))) ** 2), argnums=(0, 1))(x, w)
    assert gx.shape == x.shape and gw.shape == w.shape
    assert float(jnp.linalg.norm(gx - rx) / jnp.linalg.norm(rx)) < 0.15
    assert float(jnp.linalg.norm(gw - rw) / jnp.linalg.norm(rw)) < 0.15


def test_bf16_and_dtypes():
    x, w, b, c = _data(dtype=jnp.bfloat16)
    y, dx, dw, db = _fwd_bwd(DenseQuantizers.from_recipe(R.Float8CurrentScaling()), x, w, b, c)
    assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (jnp.bfloat16,) * 4


def test_delayed_state_flows():
    q = DenseQuantizers.from_recipe(R.DelayedScaling(amax_history_len=2))
    x, w, b, c = _data()
    state = q.init_state()
    assert set(state) == {"linear_input", "linear_weight", "linear_grad_output"}
    y, new = dense(x, w, b, quantizers=q, state={**state, "extra": {"keep": jnp.ones(2)}})
    assert float(new["linear_input"]["scale"][0]) == float(np.float32(448) / jnp.max(jnp.abs(x)))
    assert float(new["linear_grad_output"]["scale"][0]) == 1.0 and np.array_equal(new["extra"]["keep"], [1, 1])
    with te_jax.train.fp8_state_updates():
        grads = jax.grad(lambda s: jnp.sum(dense(x, w, b, quantizers=q, state=s)[0] * c))(state)
    assert float(grads["linear_grad_output"]["amax_history"][-1]) == float(jnp.max(jnp.abs(c)))


def test_errors():
    x, w, b, c = _data()
    delayed = DenseQuantizers(input=DelayedScalingQuantizer(amax_history_len=2))
    with pytest.raises(ValueError, match="no state for the stateful quantizers"):
        dense(x, w, quantizers=delayed)
    with pytest.raises(ValueError, match="Re-initialize"):
        dense(x, w, quantizers=delayed, state={"linear_input": DelayedScalingQuantizer().init_state()})
    with pytest.raises(ValueError, match="pair axes of different sizes"):
        dense(x, w, contracting_dims=((0,), (1,)))
    with pytest.raises(ValueError, match="bias must have"):
        dense(x, w, jnp.ones(3))
    sr = DenseQuantizers(grad_output=NVFP4Quantizer(stochastic_rounding=True))
    dense(x, w, quantizers=sr)  # the forward needs no key
    with pytest.raises(ValueError, match="need key="):
        jax.grad(lambda x: jnp.sum(dense(x, w, quantizers=sr)[0]))(x)
    with pytest.raises(ValueError, match="unknown roles"):
        dense(x, w, quantizers={"linear_bias": None})
    with pytest.raises(TypeError, match="quantizers must be"):
        dense(x, w, quantizers=[None])


def test_nvfp4_keys_are_per_role_and_per_step():
    x, w, b, c = _data(64, 64, 32)
    q = DenseQuantizers.from_recipe(R.NVFP4BlockScaling())
    a = _fwd_bwd(q, x, w, b, c, key=jax.random.key(0))
    again = _fwd_bwd(q, x, w, b, c, key=jax.random.key(0))
    other = _fwd_bwd(q, x, w, b, c, key=jax.random.key(1))
    assert all(_bits(u, v) for u, v in zip(a, again))
    assert _bits(a[0], other[0]) and not _bits(a[1], other[1])
    raw = _fwd_bwd(q, x, w, b, c, key=jax.random.key_data(jax.random.key(0)))
    assert all(_bits(u, v) for u, v in zip(a, raw))


def test_module_under_jit_with_autocast():
    x = jax.random.normal(jax.random.key(0), (32, 32))
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        variables = Dense(32).init(jax.random.key(1), x)
        y = jax.jit(Dense(32).apply)(variables, x)
    assert y.shape == (32, 32) and "fp8_meta" not in variables
