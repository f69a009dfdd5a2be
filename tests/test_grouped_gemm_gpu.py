"""The CUDA grouped FP8 GEMM (te_jax_grouped_gemm_fp8) on a GPU, against a float32 per-group reference.

The target is called through ``jax.ffi.ffi_call`` with the grouped GEMM contract's operands and attributes.
The reference dequantizes each operand (FP8 value x its scale_inv, per tensor or per group) and multiplies group
by group in float64, then rounds to the out dtype. TODO(te_jax.ops.grouped_gemm): once the op and its reference
twin exist, call the op and compare with its twin instead of ``_call`` and ``_reference``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax  # noqa: F401  (registers the FFI targets)
from te_jax import _ffi

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or not _ffi.CUDA_BUILT,
                       reason="needs a GPU and te_jax's CUDA handlers"),
]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _workspace_bytes(groups: int) -> int:
    return 32 * 2**20 + 1024 * groups


def _ffi(target, operands, out_shape, out_dtype, groups, workspace_bytes=None, **attrs):
    results = (jax.ShapeDtypeStruct(out_shape, out_dtype),
               jax.ShapeDtypeStruct((workspace_bytes or _workspace_bytes(groups),), jnp.uint8))
    out, _ = jax.ffi.ffi_call(target, results)(*operands, **attrs)
    return out


def _out_shape(a, b, groups, group_axis):
    return (a.shape[0], b.shape[1]) if group_axis == 0 else (groups, a.shape[0], b.shape[0])


def _call(a, b, a_si, b_si, sizes, *, group_axis, out_dtype, fast_accum, align=16, bias=None,
          workspace_bytes=None):
    """te_jax_grouped_gemm_fp8."""
    groups = sizes.shape[0]
    bias_arg = jnp.zeros((0,), out_dtype) if bias is None else bias
    return _ffi("te_jax_grouped_gemm_fp8", (a, b, a_si, b_si, sizes, bias_arg), _out_shape(a, b, groups, group_axis),
                out_dtype, groups, workspace_bytes, group_axis=np.int64(group_axis), align=np.int64(align),
                fast_accum=bool(fast_accum), has_bias=bias is not None)


def _call_block(a, a_s, b, b_s, sizes, *, group_axis, out_dtype, b_block_2d, align=128):
    """te_jax_grouped_gemm_fp8_block (1x128 blocks of a)."""
    groups = sizes.shape[0]
    return _ffi("te_jax_grouped_gemm_fp8_block", (a, a_s, b, b_s, sizes, jnp.zeros((0,), out_dtype)),
                _out_shape(a, b, groups, group_axis), out_dtype, groups, group_axis=np.int64(group_axis),
                align=np.int64(align), a_block_2d=False, b_block_2d=bool(b_block_2d), has_bias=False)


def _fp8(rng, shape, dtype):
    return jnp.asarray((rng.standard_normal(shape) * 2).astype(np.float32)).astype(dtype)


def _scales(rng, count):
    return jnp.asarray(rng.uniform(0.25, 2.0, size=(count,)).astype(np.float32))


def _deq(x, scale_inv, per_group_index=None):
    v = np.asarray(x.astype(jnp.float32), np.float64)
    s = np.asarray(scale_inv, np.float64)
    return v * (s[0] if s.size == 1 else s[per_group_index])


def _deq_block(x, s, rows):
    """x * its float32 1/scale per (rows x 128) block along the last two axes."""
    v = np.asarray(x.astype(jnp.float32), np.float64)
    s = np.repeat(np.repeat(np.asarray(s, np.float64), 128, axis=-1), rows, axis=-2)
    return v * s[..., : v.shape[-2], : v.shape[-1]]


def _reference(a_deq, b_deq, sizes, *, group_axis, out_dtype, align=16, bias=None):
    """The contract's product in float64, rounded to out_dtype; a_deq(g) / b_deq(g): the operands under group g's scales."""
    sizes = np.maximum(np.asarray(sizes), 0)
    groups = sizes.size
    if group_axis == 0:
        a0, b0 = a_deq(0), b_deq(0)
        m, n = a0.shape[0], b0.shape[1]
        out = np.zeros((m, n))
        start = 0
        for g in range(groups):
            rows = slice(min(start, m), min(start + sizes[g], m))
            out[rows] = a_deq(g)[rows] @ b_deq(g)[g].T
            if bias is not None and rows.stop > rows.start:
                out[rows] += np.asarray(bias[g].astype(jnp.float32), np.float64)
            start += sizes[g]
    else:
        a0, b0 = a_deq(0), b_deq(0)
        out = np.zeros((groups, a0.shape[0], b0.shape[0]))
        start = 0
        for g in range(groups):
            cols = slice(start, start + sizes[g])
            out[g] = a_deq(g)[:, cols] @ b_deq(g)[:, cols].T
            start += -(-sizes[g] // align) * align
    return np.asarray(jnp.asarray(out.astype(np.float32)).astype(out_dtype).astype(jnp.float32))


def _tensor_reference(a, b, a_si, b_si, sizes, **kw):
    return _reference(lambda g: _deq(a, a_si, g), lambda g: _deq(b, b_si, g), sizes, **kw)


def _assert_close(out, ref, out_dtype, fast_accum, parts):
    """Each part (a group's rows or matrix) within the dense GEMM's bound (docs/gemm_ffi.md, "Accuracy").

    Relative error = Frobenius norm of the difference over that of the reference: <= 1e-2 with fast accumulation,
    1e-3 with split accumulation, plus one rounding to the out dtype. A part whose reference is zero must be zero.
    """
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    tol = (1e-2 if fast_accum else 1e-3) + {jnp.bfloat16: 2**-8, jnp.float16: 2**-11, jnp.float32: 0.0}[out_dtype]
    for part in parts:
        o, r = out[part], ref[part]
        if not r.any():
            assert not o.any(), f"part {part} must be zero"
            continue
        rel = np.linalg.norm(o - r) / np.linalg.norm(r)
        assert rel <= tol, f"part {part}: relative error {rel:.3g} > {tol:.3g}"


def _row_parts(sizes, m):
    """The row slices of each group (cut at m) and of the rows past the groups' sum."""
    parts, start = [], 0
    for s in np.maximum(np.asarray(sizes), 0):
        parts.append(slice(min(start, m), min(start + s, m)))
        start += s
    return parts + [slice(min(start, m), m)]


def _spans(rng, rows, sizes, align, dtype):
    """[rows, Kc] FP8 with each group's columns in an aligned span, the spans' padding zero."""
    kc = int(sum(-(-s // align) * align for s in sizes))
    kc = -(-max(kc, align) // 16) * 16 + 16  # some unused columns at the end
    x = np.zeros((rows, kc), np.float32)
    start = 0
    for s in sizes:
        x[:, start:start + s] = rng.standard_normal((rows, s)) * 2
        start += -(-s // align) * align
    return jnp.asarray(x).astype(dtype)


ROW_CASES = [
    # (a dtype, b dtype, out dtype, fast_accum, sizes, M, per-group scales)
    (E4M3, E4M3, jnp.bfloat16, True, [37, 0, 200, 91], 400, True),     # forward; tail rows zero
    (E4M3, E4M3, jnp.bfloat16, True, [300, 250], 400, False),          # sum > M: group 1 is cut
    (E5M2, E4M3, jnp.bfloat16, False, [0, 0, 128, 1, 255], 384, True),  # dgrad-like; empty groups
]


@pytest.mark.parametrize("a_dt, b_dt, out_dt, fast, sizes, m, per_group", ROW_CASES)
def test_rows_match_reference(a_dt, b_dt, out_dt, fast, sizes, m, per_group):
    rng = np.random.default_rng(len(sizes) * 7 + m)
    groups, n, k = len(sizes), 272, 384
    a, b = _fp8(rng, (m, k), a_dt), _fp8(rng, (groups, n, k), b_dt)
    a_si, b_si = _scales(rng, groups if per_group else 1), _scales(rng, groups)
    sizes = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(lambda *xs: _call(*xs, group_axis=0, out_dtype=out_dt, fast_accum=fast))(a, b, a_si, b_si, sizes)
    ref = _tensor_reference(a, b, a_si, b_si, sizes, group_axis=0, out_dtype=out_dt)
    _assert_close(out, ref, out_dt, fast, _row_parts(sizes, m))  # the last part: rows past the sum, zero


def test_rows_with_bias():
    rng = np.random.default_rng(3)
    sizes, m, n, k = [64, 0, 100], 200, 128, 256
    a, b = _fp8(rng, (m, k), E4M3), _fp8(rng, (len(sizes), n, k), E4M3)
    a_si, b_si = _scales(rng, 1), _scales(rng, 1)
    bias = jnp.asarray(rng.standard_normal((len(sizes), n)).astype(np.float32))
    sizes = jnp.asarray(sizes, jnp.int32)
    out = _call(a, b, a_si, b_si, sizes, group_axis=0, out_dtype=jnp.bfloat16, fast_accum=True, bias=bias)
    ref = _tensor_reference(a, b, a_si, b_si, sizes, group_axis=0, out_dtype=jnp.bfloat16, bias=bias)
    _assert_close(out, ref, jnp.bfloat16, True, _row_parts(sizes, m))


def test_one_compilation_serves_any_group_sizes():
    """group_sizes is data: one jitted function, different routings, each right (nothing read on the host)."""
    rng = np.random.default_rng(5)
    m, n, k, groups = 512, 256, 256, 4
    a, b = _fp8(rng, (m, k), E4M3), _fp8(rng, (groups, n, k), E4M3)
    a_si, b_si = _scales(rng, 1), _scales(rng, groups)
    f = jax.jit(lambda *xs: _call(*xs, group_axis=0, out_dtype=jnp.bfloat16, fast_accum=True))
    for sizes in ([128, 128, 128, 128], [512, 0, 0, 0], [0, 0, 0, 500], [1, 2, 3, 4]):
        sizes = jnp.asarray(sizes, jnp.int32)
        ref = _tensor_reference(a, b, a_si, b_si, sizes, group_axis=0, out_dtype=jnp.bfloat16)
        _assert_close(f(a, b, a_si, b_si, sizes), ref, jnp.bfloat16, True, _row_parts(sizes, m))
    assert f._cache_size() == 1


@pytest.mark.parametrize("sizes", [[50, 0, 130, 17], [0, 0], [256]])
def test_contraction_matches_reference(sizes):
    rng = np.random.default_rng(sum(sizes) + len(sizes))
    p, q, align = 192, 256, 16
    a, b = _spans(rng, p, sizes, align, E4M3), _spans(rng, q, sizes, align, E5M2)
    a_si, b_si = _scales(rng, len(sizes)), _scales(rng, 1)
    sizes = jnp.asarray(sizes, jnp.int32)
    out = _call(a, b, a_si, b_si, sizes, group_axis=1, out_dtype=jnp.float32, fast_accum=False, align=align)
    ref = _tensor_reference(a, b, a_si, b_si, sizes, group_axis=1, out_dtype=jnp.float32, align=align)
    _assert_close(out, ref, jnp.float32, False, range(len(sizes)))  # an empty group's matrix: zero


def _block_scales(rng, shape):
    return jnp.asarray(rng.uniform(0.25, 2.0, size=shape).astype(np.float32))


@pytest.mark.parametrize("sizes, m, n, b_block_2d", [
    ([37, 0, 200, 91], 400, 256, True),   # 1x128 blocks of a x 128x128 blocks of each group's weight
    ([300, 250], 512, 256, True),         # sum > M: group 1 is cut
    ([100, 0, 156], 320, 144, False),     # 1x128 blocks of the weight
])
def test_block_rows_match_reference(sizes, m, n, b_block_2d):
    rng = np.random.default_rng(len(sizes) + m)
    groups, k, rows = len(sizes), 384, (128 if b_block_2d else 1)
    a, b = _fp8(rng, (m, k), E4M3), _fp8(rng, (groups, n, k), E4M3)
    a_s, b_s = _block_scales(rng, (m, k // 128)), _block_scales(rng, (groups, n // rows, k // 128))
    sizes = jnp.asarray(sizes, jnp.int32)
    out = _call_block(a, a_s, b, b_s, sizes, group_axis=0, out_dtype=jnp.bfloat16, b_block_2d=b_block_2d)
    ref = _reference(lambda g: _deq_block(a, a_s, 1), lambda g: _deq_block(b, b_s, rows), sizes, group_axis=0,
                     out_dtype=jnp.bfloat16)
    # The block-scaled kernels promote every 128-long K block: the split-accumulation bound.
    _assert_close(out, ref, jnp.bfloat16, False, _row_parts(sizes, m))


def test_block_contraction_is_an_error():
    """group_axis 1 of the block mode has no CUDA kernel: an error, never a wrong result."""
    rng = np.random.default_rng(0)
    a, b = _fp8(rng, (128, 256), E4M3), _fp8(rng, (128, 256), E4M3)
    s = jnp.ones((128, 2), jnp.float32)
    with pytest.raises(Exception, match="te_jax_grouped_gemm_fp8_block.*group_axis 1"):
        jax.block_until_ready(_call_block(a, s, b, s, jnp.asarray([128, 0], jnp.int32), group_axis=1,
                                          out_dtype=jnp.float32, b_block_2d=False))


def test_unsupported_combination_is_an_error_naming_the_target():
    rng = np.random.default_rng(0)
    a, b = _fp8(rng, (64, 128), E4M3), _fp8(rng, (2, 128, 128), E4M3)
    one = jnp.ones((1,), jnp.float32)
    with pytest.raises(Exception, match="te_jax_grouped_gemm_fp8.*no kernel"):
        jax.block_until_ready(_call(a, b, one, one, jnp.asarray([32, 32], jnp.int32), group_axis=0,
                                    out_dtype=jnp.float16, fast_accum=True))


def test_small_workspace_is_an_error():
    rng = np.random.default_rng(0)
    a, b = _fp8(rng, (64, 128), E4M3), _fp8(rng, (2, 128, 128), E4M3)
    one = jnp.ones((1,), jnp.float32)
    with pytest.raises(Exception, match="te_jax_grouped_gemm_fp8.*workspace"):
        jax.block_until_ready(_call(a, b, one, one, jnp.asarray([32, 32], jnp.int32), group_axis=0,
                                    out_dtype=jnp.bfloat16, fast_accum=True, workspace_bytes=256))
