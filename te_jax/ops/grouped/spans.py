"""wgrad's span operand straight from a per-tensor FP8 copy: its group rows moved into aligned spans, transposed.

``grouped_dense``'s wgrad (group_axis 1) contracts each group over a span of
``[C, spans]`` columns that starts at an aligned position. For rows packed
one group after another (``jax.lax.ragged_dot``'s layout) the columnwise copy
must be built in that layout. Under per-tensor scaling the columnwise copy of
a cast is its rowwise copy transposed (one scale, an elementwise cast), so
``rows_to_spans_transposed`` moves the rowwise copy's FP8 bytes: one gather
of whole rows and one transpose, in one pass (``te_jax_gather_transpose``,
CPU and CUDA), instead of gathering the high-precision rows and casting them
a second time.

``gather_transpose`` is that custom call, with its pure-JAX reference twin
(the "reference" backend, ``te_jax.ops.backend``). Under a mesh the columns
(C) keep their sharding; the rows and the positions are gathered (a span may
take its rows from any shard).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
from jax import lax

import te_jax.ops.ffi  # noqa: F401  (registers the FFI targets)
from te_jax.ops import primitive as partition
from te_jax.ops.grouped.layout import regroup_sources

__all__ = ["gather_transpose", "rows_to_spans_transposed"]

_TARGET = "te_jax_gather_transpose"
# The element types moved: whole bytes (the packed 4-bit types and bool have itemsize 1 as well).
_BYTE_DTYPES = frozenset(jnp.dtype(t) for t in (
    jnp.uint8, jnp.int8, *filter(None, (getattr(ml_dtypes, name, None) for name in (
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e3m4", "float8_e4m3b11fnuz", "float8_e5m2fnuz",
        "float8_e4m3fnuz", "float8_e8m0fnu")))))


def _check(data, sources) -> None:
    if data.ndim != 2:
        raise ValueError(f"te_jax: gather_transpose: data must be a matrix [M, C], got shape {list(data.shape)}")
    dtype = jnp.dtype(data.dtype)
    if dtype not in _BYTE_DTYPES:
        raise TypeError(f"te_jax: gather_transpose: data must have 8-bit elements (float8_e4m3fn, float8_e5m2, "
                        f"uint8, int8), got {dtype}")
    if sources.ndim != 1 or jnp.dtype(sources.dtype) != jnp.int32:
        raise TypeError(f"te_jax: gather_transpose: sources must be int32 [S], got {sources.dtype}"
                        f"{list(sources.shape)}; pass sources.astype(jnp.int32)")


def _reference(data: jax.Array, sources: jax.Array) -> jax.Array:
    rows, cols = data.shape
    if rows == 0:
        return jnp.zeros((cols, sources.shape[0]), data.dtype)
    bits = data if data.dtype == jnp.uint8 else lax.bitcast_convert_type(data, jnp.uint8)
    valid = (sources >= 0) & (sources < rows)
    gathered = jnp.where(valid[:, None], bits[jnp.clip(sources, 0, rows - 1)], jnp.uint8(0))
    return gathered.T if data.dtype == jnp.uint8 else lax.bitcast_convert_type(gathered.T, data.dtype)


def _body(op, shards, data, sources):
    # Under vmap, data [B..., M, C] and sources [B..., S]: the call takes the leading axes as they are.
    out = jax.ShapeDtypeStruct((*data.shape[:-2], data.shape[-1], sources.shape[-1]), data.dtype)
    return tuple(partition.ffi(op.target, out, data, sources))


def gather_transpose(data: jax.Array, sources: jax.Array, *, backend: str | None = None) -> jax.Array:
    """``out [C, S]`` with ``out[:, p] = data[sources[p]]``, zeros where ``sources[p]`` is outside ``[0, M)``.

    Args:
      data: ``[M, C]`` of 8-bit elements (float8_e4m3fn, float8_e5m2, uint8, int8).
      sources: int32 ``[S]``: the row of ``data`` each output column takes (any other value: a zero column).
      backend: "ffi" (the custom call) or "reference" (pure JAX); None: ``te_jax.ops.backend``'s current one.

    Returns:
      ``[C, S]`` of ``data``'s dtype.
    """
    _check(data, sources)
    if partition.resolve(backend) == "reference":
        return _reference(data, sources)
    op = partition.MatrixOp(_TARGET, _body, None, ("~ n", "~"), ("n ~",), data.shape)
    return partition.call(op, data, sources)[0]


def rows_to_spans_transposed(data: jax.Array, group_sizes: jax.Array, spans: int, align: int, *,
                             backend: str | None = None) -> jax.Array:
    """``data [M, C]``'s group rows (packed from row 0, ``group_sizes`` int32 ``[G]``) laid out in ``spans``
    positions of ``align``-rounded spans and transposed: ``[C, spans]``, zeros in the padding and past the last
    span. The same bytes as ``regroup_rows(data, group_sizes, spans, 1, align).T``."""
    source, member = regroup_sources(group_sizes, spans, 1, align, max(data.shape[0], 1))
    return gather_transpose(data, jnp.where(member, source, -1), backend=backend)
