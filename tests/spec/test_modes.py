"""The scaling-mode registry (te_jax.spec.modes) and the explicit fallback paths.

The registry must agree with the kernels (block sizes, cast modes, FFI
targets), with the reference twins (scale shapes, dequantize) and with the
quantizers (ScaledTensor.from_kernel_outputs builds what they return).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtest_util import on_cpu
from te_jax.ops import ffi as _ffi
from te_jax.ops import gemm_call
from te_jax.ops import primitive as partition
from te_jax.ops.gemm import gemm
from te_jax.quantize import CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, ScaledTensor
from te_jax.spec import modes
from te_jax.quantize import fused as qfused
from te_jax.spec import numerics as nm
from te_jax.ops.sharding import MeshResource
from te_jax.ops.dequantize import dequantize

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "common"
QUANTIZERS = {
    "fp8_tensor": CurrentScalingQuantizer(),
    "mxfp8": MXFP8Quantizer(),
    "fp8_block": Float8BlockQuantizer(),
    "fp8_block_2d": Float8BlockQuantizer(block_2d=True),
    "nvfp4": NVFP4Quantizer(),
    "nvfp4_2d": NVFP4Quantizer(block_2d=True),
}


def test_block_sizes_match_the_kernels():
    text = (CSRC / "ffi_common.h").read_text()
    kernel = {name: int(v) for name, v in re.findall(r"constexpr int64_t k(\w+)Block = (\d+);", text)}
    assert kernel == {"Mxfp8": nm.MXFP8_BLOCK, "Nvfp4": nm.NVFP4_BLOCK, "Fp8": nm.FP8_BLOCK}


def test_cast_modes_match_the_kernels_attribute_parser():
    text = (CSRC / "norm_act.h").read_text()
    parsed = re.findall(r'm == "(\w+)"', text[text.index("ParseCastSpec"):])
    assert tuple(parsed) == modes.CAST_MODES


@pytest.mark.parametrize("mode", modes.MODES.values(), ids=list(modes.MODES))
def test_every_mode_names_registered_targets(mode):
    for target in (mode.quantize_target, mode.dequantize_target, mode.gemm_target):
        assert target in _ffi.TARGETS
    assert modes.mode_spec(mode.family, mode.block_2d) is mode
    assert modes.by_gemm_target(mode.gemm_target).gemm_target == mode.gemm_target
    for cast_mode in mode.cast_modes:
        assert modes.by_cast_mode(cast_mode) is mode


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantizers_write_their_mode_with_its_layout(name):
    mode, quantizer = modes.MODES[name], QUANTIZERS[name]
    assert quantizer.scaling_mode is mode
    m, n = 256, 384  # every block tiles both axes; rows != cols so that a swapped layout fails
    x = jax.random.normal(jax.random.key(3), (2, m // 2, n), jnp.float32) * 3
    t = quantizer.quantize(x, rowwise=True, colwise=True, key=jax.random.key(4))
    assert t.scaling_mode is mode and t.shape == x.shape
    assert t.data.shape == (m, n // mode.pack) and t.colwise_data.shape == (n, m // mode.pack)
    assert t.scale_inv.shape == mode.scale_shape(m, n) and t.colwise_scale_inv.shape == mode.scale_shape(n, m)
    assert jnp.dtype(t.scale_inv.dtype) == (jnp.dtype(jnp.float32) if mode.per_tensor else mode.scale_dtype)
    assert (t.amax is not None) == (mode.per_tensor or mode.global_amax)
    assert (t.colwise_amax is not None) == mode.global_amax
    # The registry's reference dequantize gives what the ScaledTensor gives (through the custom call).
    want = dequantize(t, jnp.float32)
    got = on_cpu(lambda q, s, a: mode.reference_dequantize(q, s, a, jnp.float32), t.data, t.scale_inv,
                 t.amax).reshape(x.shape)  # the reference is evaluated on the CPU, as in every kernel test
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(jnp.max(jnp.abs(want - x))) <= 0.6 * float(jnp.max(jnp.abs(x)))


def test_from_kernel_outputs_keeps_what_the_mode_keeps():
    q, s = jnp.zeros((32, 32), jnp.float8_e4m3fn), jnp.ones((1,), jnp.float32)
    amax = jnp.full((1,), 2.0, jnp.float32)
    t = ScaledTensor.from_kernel_outputs(modes.FP8_TENSOR, jnp.float8_e4m3fn, (32, 32), q=q, s=s, q_t=q, s_t=None,
                                         amax=amax, amax_t=amax, rowwise=False, colwise=True)
    assert t.data is None and t.scale_inv is None and t.colwise_scale_inv is s and t.amax is amax
    assert t.colwise_amax is None and not t.rht and not t.block_2d
    with pytest.raises(ValueError, match="Hadamard"):
        ScaledTensor.from_kernel_outputs(modes.FP8_TENSOR, jnp.float8_e4m3fn, (32, 32), q=q, s=s, q_t=q,
                                         colwise=True, rht=True)
    e4 = jnp.ones((32, 2), jnp.float8_e4m3fn)
    packed = jnp.zeros((32, 16), jnp.uint8)
    t = ScaledTensor.from_kernel_outputs(modes.NVFP4, jnp.float4_e2m1fn, (32, 32), q=packed, s=e4, q_t=packed,
                                         s_t=e4, amax=amax, amax_t=s, rowwise=True, colwise=True, rht=True)
    assert t.rht and t.colwise_amax is s and t.amax is amax and t.scaling_mode is modes.NVFP4


def test_tiles_and_partial_block_scales():
    assert modes.FP8_TENSOR.tiles((3, 5), rowwise=True, colwise=True)
    assert modes.MXFP8.tiles((3, 64), rowwise=True, colwise=False)
    assert not modes.MXFP8.tiles((3, 64), rowwise=True, colwise=True)
    assert modes.MXFP8.tiles((50, 64), rowwise=False, colwise=False) and not modes.FP8_BLOCK_2D.tiles(
        (100, 128), rowwise=True, colwise=False)
    assert modes.FP8_BLOCK_2D.scale_shape(129, 256) == (2, 2) and modes.MXFP8.scale_shape(30, 33) == (30, 2)
    assert modes.NVFP4_2D.scale_shape(17, 17) == (17, 2) and modes.FP8_TENSOR.scale_shape(3, 5) == (1,)
    with pytest.raises(ValueError, match="whole 128x128 blocks along both axes"):
        modes.FP8_BLOCK_2D.check_tiles((100, 128), rowwise=True, colwise=False)


# ---- explicit fallbacks ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _HalvingQuantizer:
    """A custom quantizer without a fused cast: quantizes x / 2 with current scaling."""

    dtype = jnp.dtype(jnp.float8_e4m3fn)

    def quantize(self, x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1, key=None):
        return CurrentScalingQuantizer().quantize(x / 2, rowwise=rowwise, colwise=colwise, flatten_axis=flatten_axis)


def test_unfused_quantizer_warns_and_quantizes_the_float32_output():
    x = jax.random.normal(jax.random.key(0), (64, 96), jnp.bfloat16)
    quantizer = _HalvingQuantizer()
    with pytest.warns(qfused.UnfusedCastWarning, match="_HalvingQuantizer.*no fused_cast method"):
        y = qfused.activation(x, "gelu", quantizer, colwise=True)
    want = quantizer.quantize(qfused.activation(x, "gelu", out_dtype=jnp.float32), colwise=True)
    assert jax.tree.structure(y) == jax.tree.structure(want)
    for got_leaf, want_leaf in zip(jax.tree.leaves(y), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got_leaf, np.float32), np.asarray(want_leaf, np.float32))


def test_fused_quantizer_does_not_warn():
    x = jax.random.normal(jax.random.key(1), (64, 96), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qfused.UnfusedCastWarning)
        qfused.activation(x, "gelu", MXFP8Quantizer(), colwise=True)


@pytest.mark.parametrize("target", ["te_jax_gemm_mxfp8", "te_jax_gemm_nvfp4"])
def test_block_scaled_gemm_on_hopper_warns_about_the_emulation(target):
    message = gemm_call.emulation_warning(target, 9.0)
    assert message and "emulation" in message and "bfloat16" in message and "GemmEmulationWarning" in message
    assert gemm_call.emulation_warning(target, 10.0) is None
    assert gemm_call.emulation_warning(target, 12.0) is None
    assert gemm_call.emulation_warning(target, None) is None


@pytest.mark.parametrize("target", ["te_jax_gemm_fp8", "te_jax_gemm_fp8_block"])
def test_fp8_gemm_on_hopper_runs_natively(target):
    assert gemm_call.emulation_warning(target, 9.0) is None


class _Sharding:
    _hlo_sharding = object()


def test_sub_axis_sharding_is_gathered_with_a_warning(monkeypatch):
    def indivisible(hlo, mesh):
        raise jax._src.sharding.IndivisibleError("dim_size=3 is not divisible by axis_size=2")

    monkeypatch.setattr(partition, "_parse_hlo_sharding", indivisible)
    with pytest.warns(partition.ShardingGatherWarning, match="sub-axes.*gathers"):
        assert partition._spec_of(_Sharding(), mesh=None) == ()


def test_unknown_sharding_layout_raises(monkeypatch):
    def unknown(hlo, mesh):
        raise NotImplementedError("Unhandled HloSharding type")

    monkeypatch.setattr(partition, "_parse_hlo_sharding", unknown)
    with pytest.raises(NotImplementedError):
        partition._spec_of(_Sharding(), mesh=None)


# ---- the GEMM's explicit mesh argument ----------------------------------------------------


def test_parallel_axes_come_from_the_mesh_resource():
    assert gemm_call.parallel_axes(None) == ((), ())
    assert gemm_call.parallel_axes(MeshResource(tp_resource="t", sp_resource=("s", "u"))) == (("t", "s", "u"),
                                                                                               ("s", "u"))
    assert gemm_call.parallel_axes(MeshResource(dp_resource="d")) == ((), ())


def test_gemm_takes_the_mesh_resource_as_an_argument():
    x = jax.random.normal(jax.random.key(5), (32, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(6), (64, 48), jnp.float32)
    q = CurrentScalingQuantizer()
    xq, wq = q.quantize(x), q.quantize(w, colwise=True, rowwise=False)
    plain = gemm(xq, wq, out_dtype=jnp.float32)
    with_mesh = gemm(xq, wq, out_dtype=jnp.float32, mesh_resource=MeshResource(tp_resource="t", sp_resource="s"))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(with_mesh))
