"""Quantize/dequantize custom calls against their pure-JAX reference, bit for bit.

The kernel runs on the default device (the CPU handlers here, the CUDA ones
on a GPU machine); the reference always runs on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.ops import dequantize as dqops
from te_jax.ops import quantize as qops
from te_jax.spec import reference as ref
from qtest_util import assert_outputs_same_bits, assert_same_bits, on_cpu, random_matrix, with_specials

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HP = [jnp.bfloat16, jnp.float32, jnp.float16]
LAYOUTS = [(True, False), (False, True), (True, True)]


def run_both(op, x, *args, **kwargs):
    got = jax.jit(functools.partial(op, backend="ffi", **kwargs))(x, *args)
    want = on_cpu(functools.partial(op, backend="reference", **kwargs), x, *args)
    return got, want


def inputs(kind: str, shape, dtype, seed=0):
    """"random": spread magnitudes; "specials": NaN/Inf/zeros planted; "tiny": float32-subnormal scale."""
    if kind == "tiny":
        return (random_matrix(seed, shape, jnp.float32, spread=2.0) * 1e-39).astype(dtype)
    x = random_matrix(seed, shape, dtype)
    return with_specials(x, seed) if kind == "specials" else x


# ---- per-tensor FP8 ------------------------------------------------------------------

FP8_NAMES = ("q", "q_t", "amax", "scale_inv")


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("qdtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(64, 256), (17, 48), (1, 1), (3, 40, 24)])
@pytest.mark.parametrize("rowwise,colwise", LAYOUTS)
def test_fp8_tensor_matches_reference(dtype, qdtype, shape, rowwise, colwise):
    x = inputs("random", shape, dtype)
    scale = jnp.full((*shape[:-2], 1), 3.5, jnp.float32)
    got, want = run_both(qops.quantize_fp8_tensor, x, scale, qdtype=qdtype, rowwise=rowwise, colwise=colwise)
    assert_outputs_same_bits(got, want, FP8_NAMES)


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("qdtype", [E4M3, E5M2])
@pytest.mark.parametrize("kind", ["random", "specials", "tiny"])
@pytest.mark.parametrize("power_2,epsilon", [(False, 0.0), (True, 0.0), (False, 1e3), (True, 1e-30)])
def test_fp8_current_matches_reference(dtype, qdtype, kind, power_2, epsilon):
    x = inputs(kind, (48, 80), dtype, seed=3)
    got, want = run_both(
        qops.quantize_fp8_current, x, qdtype=qdtype, rowwise=True, colwise=True, power_2=power_2, epsilon=epsilon
    )
    assert_outputs_same_bits(got, want, ("q", "q_t", "amax", "scale", "scale_inv"))


def test_fp8_current_spec_values():
    x = jnp.array([[1.0, -2.0, 0.5, 100.0]], jnp.float32)
    q, _, amax, scale, scale_inv = qops.quantize_fp8_current(x, qdtype=E4M3)
    assert float(amax[0]) == 100.0
    assert float(scale[0]) == np.float32(448.0) / np.float32(100.0)
    assert float(scale_inv[0]) == np.float32(1.0) / float(scale[0])
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), np.asarray((x * scale[0]).astype(E4M3).astype(jnp.float32)))
    _, _, _, scale_p2, _ = qops.quantize_fp8_current(x, qdtype=E4M3, power_2=True)
    assert float(scale_p2[0]) == 4.0  # 4.48 rounded down to a power of two
    _, _, _, scale_eps, _ = qops.quantize_fp8_current(x, qdtype=E4M3, epsilon=1000.0)
    assert float(scale_eps[0]) == np.float32(448.0) / np.float32(1000.0)


def test_fp8_specials_saturate_and_keep_nan():
    x = jnp.array([[np.nan, np.inf, -np.inf, 500.0, -1e6, 0.0, -0.0, 447.0]], jnp.float32)
    q, q_t, amax, _ = qops.quantize_fp8_tensor(x, jnp.ones((1,), jnp.float32), qdtype=E4M3, colwise=True)
    v = np.asarray(q.astype(jnp.float32))[0]
    assert np.isnan(v[0]) and np.isnan(float(amax[0]))
    np.testing.assert_array_equal(v[1:], [448, -448, 448, -448, 0, 0, 448])
    assert np.signbit(v[6])
    assert_same_bits(q_t, q.T, "q_t")


def test_fp8_all_zero_tensor_gets_unit_scale():
    x = jnp.zeros((8, 16), jnp.bfloat16)
    q, _, amax, scale, scale_inv = qops.quantize_fp8_current(x)
    assert float(amax[0]) == 0 and float(scale[0]) == 1 and float(scale_inv[0]) == 1
    assert not np.asarray(q.astype(jnp.float32)).any()


# ---- block modes -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("qdtype", [E4M3, E5M2])
@pytest.mark.parametrize("kind", ["random", "specials", "tiny"])
@pytest.mark.parametrize("rowwise,colwise", LAYOUTS)
def test_mxfp8_matches_reference(dtype, qdtype, kind, rowwise, colwise):
    x = inputs(kind, (64, 96), dtype, seed=5)
    got, want = run_both(qops.quantize_mxfp8, x, qdtype=qdtype, rowwise=rowwise, colwise=colwise)
    assert_outputs_same_bits(got, want, ("q", "s", "q_t", "s_t"))


def test_mxfp8_spec_scale_rounds_up():
    # amax 500 -> t = 500/448 = 1.116 -> 2^1 (code 128); no element overflows.
    x = jnp.zeros((1, 32), jnp.float32).at[0, 0].set(500.0).at[0, 1].set(-3.0)
    q, s, _, _ = qops.quantize_mxfp8(x)
    assert int(s[0, 0]) == 128
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32))[0, :2], [256.0, -1.5])  # 250 rounds to the E4M3 grid point 256
    zero_codes = qops.quantize_mxfp8(jnp.zeros((1, 32), jnp.float32))[1]
    assert int(zero_codes[0, 0]) == 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("qdtype", [E4M3, E5M2])
@pytest.mark.parametrize("kind", ["random", "specials", "tiny"])
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("power_2", [True, False])
def test_fp8_block_matches_reference(dtype, qdtype, kind, block_2d, power_2):
    x = inputs(kind, (128, 256), dtype, seed=7)
    got, want = run_both(
        qops.quantize_fp8_block, x, qdtype=qdtype, rowwise=True, colwise=True, block_2d=block_2d, power_2=power_2
    )
    assert_outputs_same_bits(got, want, ("q", "s", "q_t", "s_t"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kind", ["random", "specials"])
@pytest.mark.parametrize("shape,rowwise,colwise", [
    ((256, 384), True, False), ((256, 384), False, True), ((256, 384), True, True), ((2, 128, 128), True, True),
    ((48, 256), True, False), ((256, 48), False, True), ((16, 128), True, False),
])
def test_fp8_block_1x128_layouts_and_shapes(dtype, kind, shape, rowwise, colwise):
    """1x128 blocks: sides that are multiples of 128 (several tiles, a batch, one copy or both) and
    rowwise- or columnwise-only shapes whose other side is not."""
    x = inputs(kind, shape, dtype, seed=8)
    got, want = run_both(qops.quantize_fp8_block, x, rowwise=rowwise, colwise=colwise)
    assert_outputs_same_bits(got, want, ("q", "s", "q_t", "s_t"))  # a copy not asked for is empty in both


def test_fp8_block_2d_colwise_is_transpose():
    x = random_matrix(1, (256, 128), jnp.bfloat16)
    q, s, q_t, s_t = qops.quantize_fp8_block(x, colwise=True, block_2d=True)
    assert_same_bits(q_t, q.T, "q_t")
    assert_same_bits(s_t, s.T, "s_t")


NVFP4_FLAGS = {"1d": {}, "2d": dict(block_2d=True), "rht": dict(rht=True), "sr": dict(stochastic_rounding=True),
               "rht_sr": dict(rht=True, stochastic_rounding=True)}
# Every flag set and layout in bfloat16; the other input dtypes with both copies (the layouts do not
# depend on the input dtype).
NVFP4_CASES = [(jnp.bfloat16, f, rc) for f in NVFP4_FLAGS for rc in LAYOUTS] + [
    (d, f, (True, True)) for d in (jnp.float32, jnp.float16) for f in NVFP4_FLAGS]


@pytest.mark.parametrize("kind", ["random", "specials", "tiny"])
@pytest.mark.parametrize("dtype,flag_set,layout", NVFP4_CASES,
                         ids=[f"{jnp.dtype(d).name}-{f}-{rc}" for d, f, rc in NVFP4_CASES])
def test_nvfp4_matches_reference(dtype, kind, flag_set, layout):
    flags, (rowwise, colwise) = NVFP4_FLAGS[flag_set], layout
    x = inputs(kind, (64, 80), dtype, seed=11)
    key = jax.random.key(42)
    got, want = run_both(qops.quantize_nvfp4, x, key, rowwise=rowwise, colwise=colwise, **flags)
    assert_outputs_same_bits(got, want, ("q", "s", "q_t", "s_t", "amax", "amax_t"))


def test_nvfp4_stochastic_rounding_depends_on_key_and_is_unbiased():
    # Every 16-block holds one 6.0, so its scale maps 2.4 near the E2M1 grid's 2..3 gap.
    x = jnp.full((64, 256), 2.4, jnp.float32).at[:, ::16].set(6.0)
    q1 = qops.quantize_nvfp4(x, jax.random.key(1), stochastic_rounding=True)
    q2 = qops.quantize_nvfp4(x, jax.random.key(2), stochastic_rounding=True)
    q1b = qops.quantize_nvfp4(x, jax.random.key(1), stochastic_rounding=True)
    assert_same_bits(q1[0], q1b[0], "same key")
    assert not np.array_equal(np.asarray(q1[0]), np.asarray(q2[0]))
    body = np.ones((64, 256), bool)
    body[:, ::16] = False
    vals = np.asarray(dqops.dequantize_nvfp4(q1[0], q1[1], q1[4]))[body]
    np.testing.assert_allclose(np.unique(vals), [2.0, 3.0], rtol=1e-6)  # the two neighbours only
    assert abs(vals.mean() - 2.4) < 0.02, vals.mean()
    rne = np.asarray(dqops.dequantize_nvfp4(*[qops.quantize_nvfp4(x)[i] for i in (0, 1, 4)]))[body]
    np.testing.assert_allclose(rne, 2.0, rtol=1e-6)  # nearest rounding is biased down here


def test_nvfp4_2d_scales_repeat_over_16_rows():
    x = random_matrix(2, (32, 64), jnp.float32)
    _, s, _, _, _, _ = qops.quantize_nvfp4(x, block_2d=True)
    s = np.asarray(s.astype(jnp.float32))
    np.testing.assert_array_equal(s[:16], np.broadcast_to(s[:1], (16, 4)))
    np.testing.assert_array_equal(s[16:], np.broadcast_to(s[16:17], (16, 4)))


# ---- dequantize ------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", HP)
def test_dequantize_matches_reference_every_mode(out_dtype):
    x = with_specials(random_matrix(9, (128, 128), jnp.float32), 9)
    key = jax.random.key(0)
    cases = [
        (dqops.dequantize_fp8_tensor, lambda: tuple(qops.quantize_fp8_current(x, qdtype=E5M2)[i] for i in (0, 4)), {}),
        (dqops.dequantize_mxfp8, lambda: qops.quantize_mxfp8(x)[:2], {}),
        (dqops.dequantize_fp8_block, lambda: qops.quantize_fp8_block(x)[:2], {}),
        (dqops.dequantize_fp8_block, lambda: qops.quantize_fp8_block(x, block_2d=True)[:2], dict(block_2d=True)),
        (dqops.dequantize_nvfp4, lambda: tuple(qops.quantize_nvfp4(x, key)[i] for i in (0, 1, 4)), {}),
    ]
    for op, make, kw in cases:
        args = make()
        got = jax.jit(functools.partial(op, out_dtype=out_dtype, backend="ffi", **kw))(*args)
        want = on_cpu(functools.partial(op, out_dtype=out_dtype, backend="reference", **kw), *args)
        assert_same_bits(got, want, op.__name__)


# ---- transformations -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_vmap_equals_per_item_calls(backend):
    x = random_matrix(4, (3, 32, 64), jnp.bfloat16)
    keys = jax.random.split(jax.random.key(3), 3)

    def f(x, k):
        return (
            qops.quantize_fp8_current(x, colwise=True, backend=backend)
            + qops.quantize_mxfp8(x, colwise=True, backend=backend)
            + qops.quantize_nvfp4(x, k, colwise=True, rht=True, stochastic_rounding=True, backend=backend)
        )

    batched = jax.jit(jax.vmap(f))(x, keys)
    for i in range(3):
        single = jax.jit(f)(x[i], keys[i])
        for b, s in zip(batched, single):
            assert_same_bits(b[i], s, "vmap")
    nested = jax.jit(jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0)))(x, keys)
    assert nested[0].shape == (3, 3, 32, 64)


def test_backend_context_switches_implementation():
    x = random_matrix(0, (32, 32), jnp.bfloat16)
    f = lambda x: qops.quantize_fp8_current(x)  # noqa: E731
    assert "te_jax_quantize_fp8_current" in jax.jit(f).lower(x).as_text()
    with te_jax.ops.backend.use("reference"):
        assert "te_jax_quantize" not in jax.jit(f).lower(x).as_text()
    assert te_jax.ops.backend.current() == "ffi"
    with pytest.raises(ValueError, match="unknown te_jax backend"):
        te_jax.ops.backend.resolve("cuda")


# ---- errors ------------------------------------------------------------------------------


def test_bad_inputs_raise_at_trace_time():
    good = jnp.ones((32, 32), jnp.bfloat16)
    with pytest.raises(TypeError, match="floating-point"):
        qops.quantize_fp8_current(jnp.ones((32, 32), jnp.int32))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        qops.quantize_fp8_current(good.astype(E4M3))
    with pytest.raises(ValueError, match="float8_e4m3fn or jnp.float8_e5m2"):
        qops.quantize_fp8_current(good, qdtype=jnp.int8)
    with pytest.raises(ValueError, match=r"matrix \[..., M, N\]"):
        qops.quantize_fp8_current(jnp.ones((32,), jnp.float32))
    with pytest.raises(ValueError, match="at least one of rowwise"):
        qops.quantize_mxfp8(good, rowwise=False)
    with pytest.raises(ValueError, match="kernel takes whole 1x32 blocks along the last axis"):
        dqops.dequantize_mxfp8(jnp.zeros((32, 48), E4M3), jnp.zeros((32, 2), jnp.uint8))
    with pytest.raises(ValueError, match="1D"):
        qops.quantize_nvfp4(good, rht=True, block_2d=True)
    with pytest.raises(ValueError, match="PRNG key"):
        qops.quantize_nvfp4(good, stochastic_rounding=True)
    with pytest.raises(ValueError, match="amax_epsilon"):
        qops.quantize_fp8_current(good, epsilon=-1.0)
    with pytest.raises(TypeError, match="dequantize produces"):
        dqops.dequantize_mxfp8(*qops.quantize_mxfp8(good)[:2], out_dtype=jnp.int32)


def test_ffi_handler_rejects_inconsistent_buffers():
    """The C++ checks are the last line of defence: call the target directly with a bad shape."""
    x = jnp.ones((32, 48), jnp.float32)
    bad = jax.ffi.ffi_call(
        "te_jax_quantize_mxfp8",
        (
            jax.ShapeDtypeStruct((32, 48), E4M3), jax.ShapeDtypeStruct((32, 1), jnp.uint8),
            jax.ShapeDtypeStruct((0,), E4M3), jax.ShapeDtypeStruct((0,), jnp.uint8),
        ),
    )
    with pytest.raises(Exception, match="multiple of the block size 32"):
        jax.block_until_ready(bad(x, rowwise=True, colwise=False))


def test_reference_module_is_what_the_ops_call():
    x = random_matrix(0, (32, 64), jnp.float32)
    assert_outputs_same_bits(
        qops.quantize_mxfp8(x, backend="reference"), ref.quantize_mxfp8(x, qdtype=E4M3), ("q", "s", "q_t", "s_t")
    )


@pytest.mark.parametrize("power_2", [False, True])
def test_scale_is_capped_so_decode_scales_stay_normal(power_2):
    """amax 1e-37 would give 448/1e-37 > FLT_MAX/4: the scale is capped at 2^126."""
    x = jnp.zeros((128, 128), jnp.float32).at[:, 0].set(1e-37).at[0, 1].set(-5e-38)
    _, _, _, scale, scale_inv = qops.quantize_fp8_current(x, power_2=power_2)
    assert float(scale[0]) == 2.0**126 and float(scale_inv[0]) == 2.0**-126
    _, s, _, s_t = qops.quantize_fp8_block(x, colwise=True, power_2=power_2)
    np.testing.assert_array_equal(np.asarray(s)[:, 0], 2.0**-126)
    for name, got, want in zip(("s", "s_t"), (s, s_t), on_cpu(
            functools.partial(qops.quantize_fp8_block, colwise=True, power_2=power_2, backend="reference"), x)[1::2]):
        assert_same_bits(got, want, name)
    nv = qops.quantize_nvfp4(x)
    assert float(nv[4][0]) == np.float32(1e-37)
    got = dqops.dequantize_nvfp4(nv[0], nv[1], nv[4])
    np.testing.assert_allclose(np.asarray(got)[:, 0], 1e-37, rtol=0.1)
