"""``te_jax_gather_transpose`` (CPU and CUDA handlers) against its pure-JAX reference and against the bf16
gather it replaces: bit for bit, on the default device (the GPU suite runs the CUDA kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from te_jax.ops.grouped.layout import regroup_rows
from te_jax.ops.grouped.spans import gather_transpose, rows_to_spans_transposed

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def _codes(shape, dtype, seed=0):
    """Random bytes of ``dtype`` (every code, NaN and Inf patterns included)."""
    bits = jax.random.randint(jax.random.key(seed), shape, 0, 256, jnp.int32).astype(jnp.uint8)
    return bits if dtype == jnp.uint8 else lax.bitcast_convert_type(bits, dtype)


def _bytes(a):
    a = jnp.asarray(a)
    return np.asarray(a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8))


def _spans(sizes, align):
    return int(sum(-(-s // align) * align for s in sizes))


@pytest.mark.parametrize("rows,cols,sizes", [
    (300, 256, [70, 0, 41, 33, 100]),          # the kernel's 16-byte path, groups not 16-row aligned
    (131, 48, [5, 0, 13, 7]),                  # sum < M, C not a tile multiple
    (64, 40, [17, 9, 0]),                      # C not a multiple of 16: the byte path
    (200, 128, [0, 0, 0, 0]),                  # no row in any group
    (96, 64, [96]),                            # one group, every row
    (0, 32, [0, 0]),                           # no rows at all
    (40, 0, [3, 4]),                           # no columns
])
@pytest.mark.parametrize("dtype", [E4, E5, jnp.uint8])
def test_rows_to_spans_match_the_bf16_gather(rows, cols, sizes, dtype):
    """The same bytes as gathering the rows into 16-aligned spans (``regroup_rows``) and transposing, through the
    custom call and the reference twin, with spare positions past the last span."""
    data = _codes((rows, cols), dtype, seed=rows + cols)
    gs = jnp.asarray(sizes, jnp.int32)
    spans = _spans(sizes, 16) + 32
    want = regroup_rows(jnp.asarray(_bytes(data)), gs, spans, 1, 16).T if rows else np.zeros((cols, spans), np.uint8)
    for backend in ("ffi", "reference"):
        got = jax.jit(lambda d, g: rows_to_spans_transposed(d, g, spans, 16, backend=backend))(data, gs)
        assert got.dtype == data.dtype and got.shape == (cols, spans)
        np.testing.assert_array_equal(_bytes(got), np.asarray(want), err_msg=backend)


@pytest.mark.parametrize("positions", [1, 16, 77, 1000])
def test_gather_transpose_any_sources(positions):
    """Arbitrary sources, repeated rows and values outside ``[0, M)`` (a zero column) included."""
    data = _codes((123, 96), E4, seed=positions)
    sources = jax.random.randint(jax.random.key(positions + 1), (positions,), -5, 130, jnp.int32)
    got, ref = (jax.jit(lambda d, s: gather_transpose(d, s, backend=b))(data, sources) for b in ("ffi", "reference"))
    want = np.where(((sources >= 0) & (sources < 123))[:, None], _bytes(data)[np.clip(sources, 0, 122)], 0).T
    np.testing.assert_array_equal(_bytes(got), want)
    np.testing.assert_array_equal(_bytes(ref), want)


@pytest.mark.parametrize("shape,positions", [((3, 50, 32), 40), ((3, 51, 48), 64)])  # byte path; 16-byte path
def test_gather_transpose_under_vmap(shape, positions):
    """vmap gives the call a leading batch axis (the CUDA grid's z); each matrix takes its own sources."""
    data = _codes(shape, E5, seed=7)
    sources = jax.random.randint(jax.random.key(8), (shape[0], positions), -1, shape[1], jnp.int32)
    got = jax.jit(jax.vmap(gather_transpose))(data, sources)
    for b in range(shape[0]):
        want = gather_transpose(data[b], sources[b], backend="reference")
        np.testing.assert_array_equal(_bytes(got[b]), _bytes(want))


def test_no_positions():
    data = _codes((12, 32), E4)
    for backend in ("ffi", "reference"):
        got = gather_transpose(data, jnp.zeros((0,), jnp.int32), backend=backend)
        assert got.shape == (32, 0) and got.dtype == E4


@pytest.mark.parametrize("sizes", [[30, -5, 25, 3], [50, 10], [-3, -1], [2**31 - 1, 5]])
def test_negative_and_oversized_group_sizes(sizes):
    """Group sizes below zero count as zero, and groups past the rows are cut, as regroup_rows cuts them."""
    data = _codes((40, 32), E4, seed=3)
    gs = jnp.asarray(sizes, jnp.int32)
    want = regroup_rows(jnp.asarray(_bytes(data)), gs, 96, 1, 16).T
    for backend in ("ffi", "reference"):
        got = jax.jit(lambda d, g: rows_to_spans_transposed(d, g, 96, 16, backend=backend))(data, gs)
        np.testing.assert_array_equal(_bytes(got), np.asarray(want), err_msg=backend)


def test_gather_transpose_checks():
    for dtype in (jnp.bfloat16, jnp.int4, jnp.bool_):  # not whole bytes: packed 4-bit types and bool too
        with pytest.raises(TypeError, match="^te_jax: gather_transpose: data must have 8-bit elements"):
            gather_transpose(jnp.zeros((4, 4), dtype), jnp.zeros((2,), jnp.int32))
    with pytest.raises(TypeError, match="int32"):
        gather_transpose(jnp.zeros((4, 4), E4), jnp.zeros((2,), jnp.int16))
    with pytest.raises(ValueError, match="matrix"):
        gather_transpose(jnp.zeros((4,), E4), jnp.zeros((2,), jnp.int32))
