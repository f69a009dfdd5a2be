"""Grouped GEMM op without a GPU: the CUDA kernel tables, checks and lowering, and the MXFP8 / NVFP4 emulation."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grouped_gemm import E4, E5, G

from te_jax.ops.gemm_call import GemmEmulationWarning
from te_jax.ops.grouped import call as grouped_call
from te_jax.ops.grouped import cuda as grouped_cuda
from te_jax.ops.grouped import reference as grouped_reference
from te_jax.ops.grouped import gemm as GG
from te_jax.ops.grouped.layout import GroupedLayout


@pytest.fixture(autouse=True)
def _on_cpu():
    """Runs on XLA:CPU on every machine: the CUDA lowering is checked without a GPU, the emulation on XLA:CPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_cuda_checks():
    """What the CUDA lowering refuses (checked here without a GPU)."""
    lay = GroupedLayout(GG.ScalingMode.FP8_TENSOR, "te_jax_grouped_gemm_fp8", ("a", "b", "a_t", "b_t"), 0, 16)
    grouped_cuda.check_cuda(lay, (48, 32), (G, 64, 32))
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_cuda.check_cuda(lay, (48, 40), (G, 64, 40))
    wg = GroupedLayout(GG.ScalingMode.FP8_TENSOR, "te_jax_grouped_gemm_fp8", ("a", "b", "a_t", "b_t"), 1, 1)
    with pytest.raises(ValueError, match="align to be a multiple of 16"):
        grouped_cuda.check_cuda(wg, (64, 64), (32, 64))


@pytest.mark.parametrize("a_dt, b_dt", [(E4, E4), (E5, E4), (E4, E5)])  # forward / E4M3 grads, HYBRID dgrad, wgrad
def test_every_per_tensor_combination_has_a_cuda_kernel(a_dt, b_dt):
    """Each out dtype and fast_accum grouped_dense can ask for runs a kernel: the direct one, or the float32 one
    then a cast, never with less exact accumulation than asked."""
    for out in (jnp.bfloat16, jnp.float32, jnp.float16):
        for fast in (True, False):
            lay = GroupedLayout(GG.ScalingMode.FP8_TENSOR, "te_jax_grouped_gemm_fp8", ("a", "b", "a_t", "b_t"), 0,
                                16, attrs=(("fast_accum", fast),), out_dtype=jnp.dtype(out))
            run = grouped_cuda.cuda_kernel(lay, a_dt, b_dt)
            run_fast = dict(run.attrs)["fast_accum"]
            assert (jnp.dtype(a_dt), jnp.dtype(b_dt), run.out_dtype, run_fast) in grouped_cuda.CUDA_FP8_KERNELS
            assert run.out_dtype in (jnp.dtype(out), jnp.dtype(jnp.float32)) and run_fast in (fast, False)
            # fast accumulation runs wherever a fast kernel of the pair and out dtype exists
            assert run_fast == (fast and (jnp.dtype(a_dt), jnp.dtype(b_dt), jnp.dtype(out), True)
                                in grouped_cuda.CUDA_FP8_KERNELS)


def test_block_cuda_kernels():
    """The Float8 block recipe's GEMMs (1x128 activations and gradients) run a kernel; the rest is refused."""
    def lay(axis, out, a2=False, b2=False):
        return GroupedLayout(GG.ScalingMode.FP8_BLOCK, "te_jax_grouped_gemm_fp8_block", ("a", "a_s", "b", "b_s"),
                             axis, 128, attrs=(("a_block_2d", a2), ("b_block_2d", b2)), out_dtype=jnp.dtype(out))
    for out in (jnp.bfloat16, jnp.float32):
        for axis, b2 in ((0, True), (0, False), (1, False)):
            run = grouped_cuda.cuda_kernel(lay(axis, out, b2=b2), E4, E4)
            assert (jnp.dtype(E4), jnp.dtype(E4), run.out_dtype, b2, axis) in grouped_cuda.CUDA_BLOCK_KERNELS
    with pytest.raises(ValueError, match="fp8_format=Format.E4M3"):
        grouped_cuda.cuda_kernel(lay(0, jnp.bfloat16, b2=True), E5, E4)
    with pytest.raises(ValueError, match="x_block_scaling_dim=1"):
        grouped_cuda.cuda_kernel(lay(0, jnp.bfloat16, a2=True), E4, E4)
    with pytest.raises(ValueError, match="both operands"):
        grouped_cuda.cuda_kernel(lay(1, jnp.float32, b2=True), E4, E4)


def test_cuda_kernel_tables_match_the_sources():
    """grouped_cuda's kernel tables list exactly the instantiations of csrc/cuda/grouped_gemm.cuh, each with its
    source file."""
    csrc = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "cuda"
    header = (csrc / "grouped_gemm.cuh").read_text()
    kinds = {"kE4M3": jnp.dtype(E4), "kE5M2": jnp.dtype(E5), "kBf16": jnp.dtype(jnp.bfloat16),
             "kF32": jnp.dtype(jnp.float32)}

    def entries(macro):
        body = header[header.index(f"#define {macro}(X)"):].split("\n\n")[0]
        return [[p.strip() for p in args.split(",")] for args in re.findall(r"X\(([^)]*)\)", body)]

    fp8 = entries("TE_JAX_GROUPED_FP8_KERNELS")
    assert {(kinds[a], kinds[b], kinds[o], f == "true") for a, b, o, f in fp8} == grouped_cuda.CUDA_FP8_KERNELS
    block = entries("TE_JAX_GROUPED_FP8_BLOCK_KERNELS")
    assert {(kinds[a], kinds[b], kinds[o], rows == "128", int(axis.endswith("kContraction")))
            for a, b, o, rows, axis in block} == grouped_cuda.CUDA_BLOCK_KERNELS
    sources = "".join(p.read_text() for p in csrc.glob("grouped_gemm_sm90_*.cu"))
    for a, b, o, f in fp8:
        assert f"TE_JAX_INSTANTIATE_GROUPED_FP8({a}, {b}, {o}, {f})" in sources
    for a, b, o, rows, axis in block:
        assert f"TE_JAX_INSTANTIATE_GROUPED_FP8_BLOCK({a}, {b}, {o}, {rows}, {axis})" in sources


def _cuda_hlo(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering():
    """Lowered for a GPU (no GPU needed): the float32 kernel then a cast, the K-block-major block wgrad scales
    (the emulation's lowering: test_cuda_lowering_of_the_emulation)."""
    gs = jnp.asarray([32, 32], jnp.int32)
    one = jnp.ones((1,), jnp.float32)
    bias = jnp.zeros((2, 128), jnp.float16)
    hlo = _cuda_hlo(lambda a, b: GG.grouped_gemm_fp8(a, b, one, one, gs, bias, out_dtype=jnp.float16, backend="ffi"),
                    jnp.zeros((64, 128), E4), jnp.zeros((2, 128, 128), E5))
    assert "@te_jax_grouped_gemm_fp8(" in hlo and "fast_accum = false" in hlo
    assert "-> tensor<64x128xf16>" in hlo and "tensor<2x128xf32>" in hlo  # result cast, bias given as float32
    a, s = jnp.zeros((128, 256), E4), jnp.ones((128, 2), jnp.float32)
    hlo = _cuda_hlo(lambda a, s: GG.grouped_gemm_fp8_block(a, s, a, s, gs, group_axis=1, backend="ffi"), a, s)
    assert "stablehlo.transpose" in hlo and "@te_jax_grouped_gemm_fp8_block(" in hlo


def _emulation_case(mode: str, group_axis: int, has_bias: bool = False):
    """Random MXFP8 / NVFP4 operands of a grouped call: (layout, operand values, group sizes, bias, op, align).

    group_axis 1: the random codes fill every span's padding too (each group contracts over its whole span) and
    the columns past the last span (no group's).
    """
    rng = np.random.default_rng(11)
    sizes = [37, 0, 60, 20]
    gs = jnp.asarray(sizes, jnp.int32)
    m, k = (128, 128) if group_axis == 0 else (64, 160)
    b_rows = (len(sizes), 64) if group_axis == 0 else (48,)
    if mode == "mxfp8":
        def operand(rows):
            return (jnp.asarray(rng.standard_normal((*rows, k)) * 2, jnp.float32).astype(E4),
                    jnp.asarray(rng.integers(122, 132, size=(*rows, k // 32)), jnp.uint8))
        (a, a_s), (b, b_s) = operand((m,)), operand(b_rows)
        roles, values, align, pack, block = ("a", "a_s", "b", "b_s"), (a, a_s, b, b_s), 32, 1, 32
        op = GG.grouped_gemm_mxfp8
    else:
        def operand(rows):
            return (jnp.asarray(rng.integers(0, 256, size=(*rows, k // 2)), jnp.uint8),
                    jnp.asarray(rng.uniform(0.5, 8.0, size=(*rows, k // 16)), jnp.float32).astype(E4))
        (a, a_s), (b, b_s) = operand((m,)), operand(b_rows)
        amax_a, amax_b = jnp.asarray([3.0], jnp.float32), jnp.asarray([5.0], jnp.float32)
        roles, values = ("a", "a_s", "a_t", "b", "b_s", "b_t"), (a, a_s, amax_a, b, b_s, amax_b)
        align, pack, block, op = 32, 2, 16, GG.grouped_gemm_nvfp4
    bias = jnp.asarray(rng.standard_normal((len(sizes), 64)) * 4, jnp.float32) if has_bias else None
    lay = GroupedLayout(GG.ScalingMode.MXFP8 if mode == "mxfp8" else GG.ScalingMode.NVFP4, "", roles, group_axis,
                        align, out_dtype=jnp.dtype(jnp.float32), has_bias=has_bias, pack=pack, k_block=block)
    return lay, values, gs, bias, op, align


@pytest.mark.parametrize("group_axis", [0, 1])
@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_gpu_emulation_matches_reference(mode, group_axis):
    """The MXFP8 / NVFP4 ragged-dot emulation a non-sm_90 GPU lowers (bfloat16 operands), run here on XLA:CPU."""
    lay, values, gs, _, op, align = _emulation_case(mode, group_axis)
    got = grouped_reference.emulate(lay, *values, gs, jnp.zeros((0,), jnp.float32))
    want = op(*values, gs, group_axis=group_axis, align=align, out_dtype=jnp.float32, backend="reference")
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert got.shape == want.shape and rel < (1e-6 if mode == "mxfp8" else 2**-7), rel


@pytest.mark.parametrize("group_axis,has_bias", [(0, False), (0, True), (1, False)])
@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_bf16_kernel_emulation_matches_reference(mode, group_axis, has_bias):
    """The sm_90 emulation (bfloat16 operands, the bfloat16 grouped call), run here through the call's CPU twin:
    the reference within one bfloat16 rounding of the result (and NVFP4's rounding of its operands); rows past
    the groups, and the empty group's matrix, zero."""
    lay, values, gs, bias, op, align = _emulation_case(mode, group_axis, has_bias)
    got = grouped_call._emulate_with_bf16_kernel(lay, *values, gs, jnp.zeros((0,), jnp.float32) if bias is None
                                                 else bias)
    want = op(*values, gs, bias, group_axis=group_axis, align=align, out_dtype=jnp.float32, backend="reference")
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert rel < (2**-8 if mode == "mxfp8" else 2**-7 + 2**-8), rel
    if group_axis == 0:
        assert not np.any(np.asarray(got[117:]))
    else:
        assert not np.any(np.asarray(got[1]))


def test_cuda_lowering_of_the_emulation():
    """Lowered for a GPU (no GPU here: sm_90 assumed): MXFP8 runs the bfloat16 grouped call when it tiles the
    dequantized operands (multiples of 8), XLA's ragged dot when it does not; both warn."""
    lay, values, gs, _, _, _ = _emulation_case("mxfp8", 0)
    a, a_s, b, b_s = values

    def lowered(b, b_s):
        f = jax.jit(lambda *v: GG.grouped_gemm_mxfp8(*v, gs, out_dtype=jnp.bfloat16, backend="ffi"))
        with pytest.warns(GemmEmulationWarning, match="emulation"):
            return f.trace(a, a_s, b, b_s).lower(lowering_platforms=("cuda",)).as_text()

    hlo = lowered(b, b_s)
    assert "@te_jax_grouped_gemm_bf16(" in hlo and "ragged_dot" not in hlo
    hlo = lowered(b[:, :60], b_s[:, :60])  # N 60: the bfloat16 kernel needs multiples of 8
    assert "te_jax_grouped_gemm_bf16" not in hlo and "ragged_dot" in hlo
    assert grouped_cuda.bf16_kernel_emulates(lay, 9.0, a.shape, b.shape)
    assert not grouped_cuda.bf16_kernel_emulates(lay, 10.0, a.shape, b.shape)
    assert "bfloat16 grouped kernel" in grouped_cuda.emulation_message(lay, 9.0, True)
    assert "ragged dot" in grouped_cuda.emulation_message(lay, 10.0, False)
