"""Quantize ops: FFI custom calls with pure-JAX reference twins (dequantize: ``te_jax.ops.dequantize``).

Every op takes matrices ``x [..., M, N]``; leading axes are a batch (the
kernels loop over it, and ``vmap`` adds to it). Each validates its inputs at
trace time, then runs the ``te_jax_*`` custom call or, when the backend is
"reference", the function of the same name in ``te_jax.spec.reference``.
The columnwise copy of every mode is the quantization of the transposed
matrix ``[..., N, M]``; an output that was not asked for is an empty
``[..., 0]`` array.

Each custom call runs through ``te_jax.ops.primitive``: under ``jit`` with
sharded operands it runs on every device's blocks (rows and columns may both
stay sharded; a columnwise copy takes the transposed sharding), per-tensor
amaxes take one pmax, and current scaling and NVFP4 cast with the whole
tensor's amax (``fp8_current_local``, ``nvfp4_local``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import te_jax.ops.ffi  # noqa: F401  (registers the FFI targets)
from te_jax.ops import primitive as partition
from te_jax.ops.sharding_types import reshape
from te_jax.spec import modes
from te_jax.spec import numerics as nm
from te_jax.spec import reference as ref
from te_jax.spec.modes import flattened_shape

HIGH_PRECISION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MXFP8_BLOCK = nm.MXFP8_BLOCK
NVFP4_BLOCK = nm.NVFP4_BLOCK
FP8_BLOCK = nm.FP8_BLOCK


# ---- validation ------------------------------------------------------------------


def check_high_precision(x, name: str = "x") -> None:
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        got = getattr(x, "dtype", type(x).__name__)
        raise TypeError(f"te_jax: {name} must be a floating-point array, got {got}")
    if jnp.dtype(x.dtype) not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"te_jax: {name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_fp8_dtype(qdtype) -> jnp.dtype:
    nm.fp8_max(qdtype)  # raises ValueError naming the allowed dtypes
    return jnp.dtype(qdtype)


def _check_matrix(x, name: str = "x") -> None:
    check_high_precision(x, name)
    if x.ndim < 2:
        raise ValueError(f"te_jax: {name} must be a matrix [..., M, N], got shape {x.shape}")


def _check_layouts(rowwise: bool, colwise: bool) -> None:
    if not (rowwise or colwise):
        raise ValueError("te_jax: ask for at least one of rowwise=True or colwise=True")


# ---- helpers -----------------------------------------------------------------------


def _sds(x, rows: int, cols: int, dtype, enabled: bool = True) -> jax.ShapeDtypeStruct:
    shape = (*x.shape[:-2], rows, cols) if enabled else (*x.shape[:-2], 0)
    return jax.ShapeDtypeStruct(shape, dtype)


def _scalar_sds(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((*x.shape[:-2], 1), jnp.float32)


def pad_to_blocks(x, rows: int, cols: int):
    """``x [..., M, N]`` zero padded at the end to multiples of ``rows`` and ``cols`` (``x`` itself if it is)."""
    pad_m, pad_n = -x.shape[-2] % rows, -x.shape[-1] % cols
    if not (pad_m or pad_n):
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad_m), (0, pad_n)])


def _block_padded(x, block: int, *, rowwise: bool, colwise: bool, block_2d: bool):
    """``x`` padded to whole blocks along the axes a block-scaled quantize splits into blocks.

    The rowwise copy's blocks run along N, the columnwise copy's along M, 2D
    blocks along both. Zeros never raise an amax, so a partial block's scale
    is its real elements' own.
    """
    rows = block if colwise or block_2d else 1
    cols = block if rowwise or block_2d else 1
    return pad_to_blocks(x, rows, cols)


def _rows(a, count: int):
    """The first ``count`` rows of a result ``[..., R, C]`` (an empty ``[..., 0]`` result as it is)."""
    return a if a.ndim < 2 or a.shape[-1] == 0 or a.shape[-2] == count else a[..., :count, :]


def _trim_rows(results, m: int, n: int, rows_per_scale_row: int = 1) -> tuple:
    """A block quantize's ``(q, s, q_t, s_t, *rest)`` of a padded matrix, cut to the real ``m`` / ``n`` rows.

    Each copy keeps its padded last axis (whole blocks: what the GEMM
    contracts); its rows, the other axis, are the real ones, and 2D-block
    scales keep ``ceil(rows / rows_per_scale_row)`` rows.
    """
    q, s, q_t, s_t, *rest = results
    up = lambda count: -(-count // rows_per_scale_row)  # noqa: E731
    return (_rows(q, m), _rows(s, up(m)), _rows(q_t, n), _rows(s_t, up(n)), *rest)



def key_words(key) -> jax.Array:
    """The two uint32 words of a JAX PRNG key (typed or raw) that seed stochastic rounding."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if key.dtype != jnp.uint32 or key.ndim < 1 or key.shape[-1] < 2:
        raise TypeError(f"te_jax: expected a JAX PRNG key, got {key.dtype}{list(key.shape)}")
    return key[..., :2]


# ---- kernels (one device's blocks) ------------------------------------------------


def _on(enabled: bool, tokens: str) -> str:
    return tokens if enabled else "~"


def _fp8_tensor_kernel(x, scale, qdtype, rowwise, colwise):
    m, n = x.shape[-2:]
    results = (_sds(x, m, n, qdtype, rowwise), _sds(x, n, m, qdtype, colwise), _scalar_sds(x), _scalar_sds(x))
    return tuple(partition.ffi(modes.FP8_TENSOR.quantize_target, results, x, scale, rowwise=rowwise, colwise=colwise))


def _fp8_tensor_body(op, shards, x, scale):
    return _fp8_tensor_kernel(x, scale, *op.config)


def fp8_current_local(x, shards: partition.Shards, *, qdtype, rowwise, colwise, power_2, epsilon):
    """Current scaling of one device's block with the whole tensor's scale: ``(q, q_t, amax, scale, scale_inv)``.

    Split: the local amax, one pmax, the scale as the kernel derives it, then
    ``te_jax_quantize_fp8`` with that scale (the same bits as unsplit).
    """
    if shards.count == 1:
        m, n = x.shape[-2:]
        s = _scalar_sds(x)
        results = (_sds(x, m, n, qdtype, rowwise), _sds(x, n, m, qdtype, colwise), s, s, s)
        return tuple(partition.ffi("te_jax_quantize_fp8_current", results, x, rowwise=rowwise, colwise=colwise,
                          power_2=bool(power_2), epsilon=np.float32(epsilon)))
    amax = shards.pmax(nm.abs_max(x, axis=(-2, -1))[..., None])
    scale = nm.scale_from_amax(amax, nm.fp8_max(qdtype), epsilon, power_2)
    q, q_t, _, scale_inv = _fp8_tensor_kernel(x, scale, qdtype, rowwise, colwise)
    return q, q_t, amax, scale, scale_inv


def _fp8_current_body(op, shards, x):
    return fp8_current_local(x, shards, **dict(op.config))


def _mxfp8_body(op, shards, x):
    qdtype, rowwise, colwise = op.config
    m, n = x.shape[-2:]
    b = MXFP8_BLOCK
    results = (
        _sds(x, m, n, qdtype, rowwise), _sds(x, m, n // b, jnp.uint8, rowwise),
        _sds(x, n, m, qdtype, colwise), _sds(x, n, m // b, jnp.uint8, colwise),
    )
    return tuple(partition.ffi(modes.MXFP8.quantize_target, results, x, rowwise=rowwise, colwise=colwise))


def _fp8_block_body(op, shards, x):
    qdtype, rowwise, colwise, block_2d, power_2 = op.config
    m, n = x.shape[-2:]
    b = FP8_BLOCK
    br = b if block_2d else 1
    results = (
        _sds(x, m, n, qdtype, rowwise), _sds(x, m // br, n // b, jnp.float32, rowwise),
        _sds(x, n, m, qdtype, colwise), _sds(x, n // br, m // b, jnp.float32, colwise),
    )
    return tuple(partition.ffi(modes.FP8_BLOCK.quantize_target, results, x, rowwise=rowwise, colwise=colwise,
                      block_2d=bool(block_2d), power_2=bool(power_2)))


def _nvfp4_kernel(x, words, flags: dict):
    m, n = x.shape[-2:]
    b = NVFP4_BLOCK
    e4 = jnp.float8_e4m3fn
    row, col = flags["rowwise"], flags["colwise"]
    results = (
        _sds(x, m, n // 2, jnp.uint8, row), _sds(x, m, n // b, e4, row),
        _sds(x, n, m // 2, jnp.uint8, col), _sds(x, n, m // b, e4, col),
        _scalar_sds(x), _scalar_sds(x),
    )
    return tuple(partition.ffi(modes.NVFP4.quantize_target, results, x, words, **flags))


def _amax_rows(amax, amax_t, n: int, dtype, *, rowwise: bool, rht: bool):
    """16 rows ``[..., 16, n]`` whose amax is ``amax`` and whose Hadamard-domain amax is ``amax_t``.

    Appended to a block of x, they make the kernel's own amaxes the global
    ones without touching the other rows' blocks. Column 0 carries ``amax``;
    the Hadamard column (1, or 0 without a rowwise copy) is the inverse
    transform of ``amax_t * e0``: entries ``+-amax_t/4 <= amax``, transformed
    exactly back to ``amax_t`` (or, when ``amax_t`` overflowed, ``amax`` times
    the sign pattern, which overflows the same way).
    """
    lead = amax.shape[:-1]
    rows = jnp.zeros((*lead, 16, n), dtype)
    if rowwise or not rht:
        rows = rows.at[..., 0, 0].set(amax[..., 0].astype(dtype))
    if rht:
        e0 = jnp.zeros((*lead, 16), jnp.float32).at[..., 0].set(amax_t[..., 0])
        signs = jnp.asarray(nm._rht_signs())
        col = jnp.where(nm.is_finite(amax_t), nm.inverse_rht16(e0), amax * signs)
        rows = rows.at[..., :, 1 if rowwise else 0].set(col.astype(dtype))
    return rows


def nvfp4_local(x, words, shards: partition.Shards, *, rowwise, colwise, block_2d, rht, stochastic_rounding):
    """NVFP4 of one device's block with the whole tensor's global amaxes: the six results.

    Split: the local amaxes (the columnwise one after the Hadamard transform),
    one pmax, then the kernel on the block with 16 rows appended that carry
    the global amaxes (``_amax_rows``: the kernel takes no amax operand), and
    the appended rows dropped. Stochastic rounding folds the block's index
    into the key, so its bits differ from the unsplit op's.
    """
    flags = dict(rowwise=rowwise, colwise=colwise, block_2d=block_2d, rht=rht,
                 stochastic_rounding=stochastic_rounding)
    if shards.count == 1:
        return _nvfp4_kernel(x, words, flags)
    if stochastic_rounding:
        words = partition.fold_shard_index(words, shards)
    m, n = x.shape[-2:]
    xf = x.astype(jnp.float32)
    amax = nm.abs_max(xf, axis=(-2, -1))[..., None]
    amax_t = nm.abs_max(nm.rht16(jnp.swapaxes(xf, -1, -2)), axis=(-2, -1))[..., None] if rht else amax
    both = shards.pmax(jnp.concatenate([amax, amax_t], axis=-1))
    amax, amax_t = both[..., :1], both[..., 1:]
    # Without the transform the appended values are amaxes of x itself, exact in x's dtype.
    dtype = jnp.float32 if rht else x.dtype
    rows = _amax_rows(amax, amax_t, n, dtype, rowwise=rowwise, rht=rht)
    q, s, q_t, s_t, _, _ = _nvfp4_kernel(jnp.concatenate([x.astype(dtype), rows], axis=-2), words, flags)
    if rowwise:
        q, s = q[..., :m, :], s[..., :m, :]
    if colwise:
        q_t, s_t = q_t[..., : m // 2], s_t[..., : m // NVFP4_BLOCK]
    return q, s, q_t, s_t, amax, amax_t


def _nvfp4_body(op, shards, x, words):
    return nvfp4_local(x, words, shards, **dict(op.config))


# ---- quantize ----------------------------------------------------------------------


def _fp8_block_mode(block_2d: bool) -> modes.ModeSpec:
    return modes.FP8_BLOCK_2D if block_2d else modes.FP8_BLOCK


def quantize_fp8_tensor(x, scale, *, qdtype=jnp.float8_e4m3fn, rowwise=True, colwise=False, backend=None):
    """Per-tensor FP8 with a given float32 scale ``[..., 1]``; the amax comes from the same pass.

    Returns ``(q [...,M,N], q_t [...,N,M], amax [...,1], scale_inv [...,1])``.
    """
    _check_matrix(x)
    qdtype = check_fp8_dtype(qdtype)
    _check_layouts(rowwise, colwise)
    scale = jnp.asarray(scale, jnp.float32).reshape(*x.shape[:-2], 1)
    if partition.resolve(backend) == "reference":
        return ref.quantize_fp8_tensor(x, scale, qdtype=qdtype, rowwise=rowwise, colwise=colwise)
    op = partition.MatrixOp(
        modes.FP8_TENSOR.quantize_target, _fp8_tensor_body, (qdtype, bool(rowwise), bool(colwise)), ("m n", "~"),
        (_on(rowwise, "m n"), _on(colwise, "n m"), "~", "~"), x.shape[-2:], reduce=(None, None, "max", None))
    return partition.call(op, x, scale)


def quantize_fp8_current(
    x, *, qdtype=jnp.float8_e4m3fn, rowwise=True, colwise=False, power_2=False, epsilon=0.0, backend=None
):
    """Per-tensor current scaling: amax, then scale = fp8_max / max(amax, epsilon), then the cast.

    Returns ``(q, q_t, amax, scale, scale_inv)``.
    """
    _check_matrix(x)
    qdtype = check_fp8_dtype(qdtype)
    _check_layouts(rowwise, colwise)
    if not (np.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"te_jax: amax_epsilon must be a finite number >= 0, got {epsilon}")
    if partition.resolve(backend) == "reference":
        return ref.quantize_fp8_current(
            x, qdtype=qdtype, rowwise=rowwise, colwise=colwise, power_2=power_2, epsilon=epsilon
        )
    config = (("qdtype", qdtype), ("rowwise", bool(rowwise)), ("colwise", bool(colwise)),
              ("power_2", bool(power_2)), ("epsilon", float(epsilon)))
    op = partition.MatrixOp("te_jax_quantize_fp8_current", _fp8_current_body, config, ("m n",),
                            (_on(rowwise, "m n"), _on(colwise, "n m"), "~", "~", "~"), x.shape[-2:])
    return partition.call(op, x)


def quantize_mxfp8(x, *, qdtype=jnp.float8_e4m3fn, rowwise=True, colwise=False, backend=None):
    """MXFP8: 1x32 blocks, E8M0 scale codes (uint8).

    Any ``M``, ``N``: a partial block at the end of an axis takes the scale of
    its own elements. Each copy keeps its last axis (the one a GEMM contracts)
    zero padded to whole blocks, and its rows as they are.

    Returns ``(q [...,M,N'], s [...,M,N'/32], q_t [...,N,M'], s_t [...,N,M'/32])``
    with ``N'``, ``M'`` rounded up to whole blocks.
    """
    _check_matrix(x)
    qdtype = check_fp8_dtype(qdtype)
    _check_layouts(rowwise, colwise)
    m, n = x.shape[-2:]
    x = _block_padded(x, MXFP8_BLOCK, rowwise=rowwise, colwise=colwise, block_2d=False)
    if partition.resolve(backend) == "reference":
        return _trim_rows(ref.quantize_mxfp8(x, qdtype=qdtype, rowwise=rowwise, colwise=colwise), m, n)
    results = (_on(rowwise, "m n"), _on(rowwise, "m n/32"), _on(colwise, "n m"), _on(colwise, "n m/32"))
    op = partition.MatrixOp(modes.MXFP8.quantize_target, _mxfp8_body, (qdtype, bool(rowwise), bool(colwise)), ("m n",),
                            results, x.shape[-2:])
    return _trim_rows(partition.call(op, x), m, n)


def quantize_fp8_block(
    x, *, qdtype=jnp.float8_e4m3fn, rowwise=True, colwise=False, block_2d=False, power_2=True, backend=None
):
    """Float8 block scaling: 1x128 or (``block_2d``) 128x128 blocks; float32 1/scale per block.

    Any ``M``, ``N``, as ``quantize_mxfp8``: ``q [...,M,N']`` with ``N'`` rounded
    up to whole blocks, ``s`` ``[...,M,N'/128]`` or ``[...,M'/128,N'/128]``,
    ``q_t`` / ``s_t`` likewise for the transpose.

    Returns ``(q, s, q_t, s_t)``.
    """
    _check_matrix(x)
    qdtype = check_fp8_dtype(qdtype)
    _check_layouts(rowwise, colwise)
    m, n = x.shape[-2:]
    x = _block_padded(x, FP8_BLOCK, rowwise=rowwise, colwise=colwise, block_2d=block_2d)
    scale_rows = _fp8_block_mode(block_2d).rows_per_scale_row
    if partition.resolve(backend) == "reference":
        return _trim_rows(ref.quantize_fp8_block(
            x, qdtype=qdtype, rowwise=rowwise, colwise=colwise, block_2d=block_2d, power_2=power_2
        ), m, n, scale_rows)
    rows = "m/128" if block_2d else "m"
    cols = "n/128" if block_2d else "n"
    results = (_on(rowwise, "m n"), _on(rowwise, f"{rows} n/128"), _on(colwise, "n m"), _on(colwise, f"{cols} m/128"))
    config = (qdtype, bool(rowwise), bool(colwise), bool(block_2d), bool(power_2))
    op = partition.MatrixOp(modes.FP8_BLOCK.quantize_target, _fp8_block_body, config, ("m n",), results, x.shape[-2:])
    return _trim_rows(partition.call(op, x), m, n, scale_rows)


def quantize_nvfp4(
    x, key=None, *, rowwise=True, colwise=False, block_2d=False, rht=False, stochastic_rounding=False, backend=None
):
    """NVFP4: packed E2M1 (two per byte), E4M3 block scales, per-tensor float32 amax.

    ``rht`` applies the 16-point random Hadamard transform to the columnwise
    copy; ``stochastic_rounding`` draws its bits from ``key`` (a JAX PRNG key).

    Any ``M``, ``N``, as ``quantize_mxfp8`` (with ``rht``, a partial block of
    the columnwise copy is transformed with its zero padding).

    Returns ``(q [...,M,N'/2], s [...,M,N'/16], q_t [...,N,M'/2], s_t [...,N,M'/16],
    amax [...,1], amax_t [...,1])`` with ``N'``, ``M'`` rounded up to whole blocks.
    """
    _check_matrix(x)
    _check_layouts(rowwise, colwise)
    if rht and block_2d:
        raise ValueError("te_jax: the random Hadamard transform applies to 1D (1x16) NVFP4 blocks only")
    m, n = x.shape[-2:]
    x = _block_padded(x, NVFP4_BLOCK, rowwise=rowwise, colwise=colwise or rht, block_2d=block_2d)
    if stochastic_rounding:
        if key is None:
            raise ValueError("te_jax: NVFP4 stochastic rounding needs a PRNG key")
        words = key_words(key)
    else:
        words = jnp.zeros((2,), jnp.uint32)
    words = jnp.broadcast_to(words, (*x.shape[:-2], 2))
    if x.shape[-2] * x.shape[-1] >= 2**32:
        raise ValueError("te_jax: NVFP4 supports matrices of fewer than 2^32 elements")
    flags = dict(rowwise=bool(rowwise), colwise=bool(colwise), block_2d=bool(block_2d), rht=bool(rht),
                 stochastic_rounding=bool(stochastic_rounding))
    if partition.resolve(backend) == "reference":
        return _trim_rows(ref.quantize_nvfp4(x, words, **flags), m, n)
    results = (_on(rowwise, "m n/2"), _on(rowwise, "m n/16"), _on(colwise, "n m/2"), _on(colwise, "n m/16"),
               "~", "~")
    align = (NVFP4_BLOCK if block_2d or rht else 1, NVFP4_BLOCK if block_2d else 1)
    op = partition.MatrixOp(modes.NVFP4.quantize_target, _nvfp4_body, tuple(flags.items()), ("m n", "~"), results,
                            x.shape[-2:], align=align)
    return _trim_rows(partition.call(op, x, words), m, n)


def as_matrix(x: jax.Array, flatten_axis: int) -> jax.Array:
    """``x`` reshaped to ``[M, N]`` around ``flatten_axis`` (under an Explicit mesh typed as
    ``sharding_types.reshape`` types it: a split minor axis of a merged group, ``[K, H, D@tp]``, is unsplit)."""
    check_high_precision(x)
    if x.ndim == 0:
        raise ValueError("te_jax: cannot quantize a scalar; give a tensor of rank >= 1")
    return reshape(x, flattened_shape(x.shape, flatten_axis))
