"""What the Linen (``te_jax.flax``) and NNX (``te_jax.nnx``) layers share: checks, dtypes, norms, attention.

Nothing here knows a module system: a layer passes its description
(``where``, e.g. ``"LayerNormMLP at block/mlp"``) for error messages, and
its arrays and keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as flax_dtypes

from te_jax.core.gemm_quant import NORM_TYPES
from te_jax.core.unquantized import KERNEL_DTYPES, dtype_problem, quantized_dtype_error
from te_jax.core.unquantized import flax_normalize  # noqa: F401  (the layers' import path)
from te_jax.ops.norm_act import ACTIVATIONS, GATED
from te_jax.recipe.autocast import current_recipe

HIGH_PRECISION = KERNEL_DTYPES
Initializer = Callable[..., Any]
_OPS = ("dense", "grouped_dense", "layernorm_dense", "layernorm_mlp", "dot_general", "einsum",
        "ragged_dot")  # the functional ops, named in their errors
# TransformerEngine-style activation tuples.
_ACTIVATION_TUPLES = {("gelu",): "gelu", ("relu",): "relu", ("silu",): "silu", ("swish",): "silu",
                      ("squared_relu",): "squared_relu", ("silu", "linear"): "swiglu", ("swish", "linear"): "swiglu",
                      ("gelu", "linear"): "geglu"}


def describe(layer: object, path: Sequence[str]) -> str:
    """``"LayerNormMLP at TransformerLayer_0/mlp"`` for error messages."""
    path = "/".join(path)
    return f"{type(layer).__name__}" + (f" at {path}" if path else "")


def check_dtypes(where: str, dtype=None, param_dtype=None, x: jax.Array | None = None) -> None:
    """``dtype``, ``param_dtype`` and the input must be float32, bfloat16 or float16, or float64 outside
    ``te_jax.autocast`` (flax's computation; the active recipe is read here), with a clear error otherwise."""
    quantized = current_recipe() is not None
    for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        problem = None if value is None else dtype_problem(value, quantized)
        if problem == "quantized":
            raise quantized_dtype_error(where, name, value, f"pass {name}=jnp.float32")
        if problem == "invalid":
            raise TypeError(f"te_jax: {where}: {name}={jnp.dtype(value)} is not supported; use float32, bfloat16 "
                            "or float16 (float64 outside te_jax.autocast)")
    if x is not None:
        x_dtype = getattr(x, "dtype", None)
        problem = "invalid" if x_dtype is None else dtype_problem(x_dtype, quantized)
        if problem == "quantized":
            raise quantized_dtype_error(where, "the input", x_dtype, "cast it with x.astype(jnp.float32)")
        if problem == "invalid":
            raise TypeError(f"te_jax: {where}: the input must be a float32, bfloat16 or float16 array (float64 "
                            f"outside te_jax.autocast), got {x_dtype if x_dtype is not None else type(x).__name__}")


def canonical_input(x) -> jax.Array:
    """``x`` in the dtype flax's layers compute it in: NumPy float64 is float32 with x64 off, integers and
    bools are promoted to float32 (flax's ``canonicalize_dtype``); float32/bfloat16/float16 arrays pass unchanged."""
    return jnp.asarray(x, flax_dtypes.canonicalize_dtype(x))


def canonical_axes(axes, ndim: int, where: str, what: str = "axis") -> tuple[int, ...]:
    """``axes`` (an int or a sequence) as distinct non-negative axes of a rank-``ndim`` array."""
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes)
    out = tuple(int(a) % ndim for a in axes if -ndim <= int(a) < ndim)
    if len(out) != len(axes) or len(set(out)) != len(out):
        raise ValueError(f"te_jax: {where}: {what}={axes} are not distinct axes of a rank-{ndim} input")
    return out


def compute_dtype(dtype, *arrays):
    """flax's rule: ``dtype`` if given, else the promoted type of the arrays (None ignored)."""
    return flax_dtypes.canonicalize_dtype(*arrays, dtype=dtype)


def located(err: ValueError, where: str) -> ValueError:
    """A functional op's error with the layer (``where``) in place of the op's name."""
    msg = str(err)
    for op in _OPS:
        msg = msg.replace(f"te_jax: {op}", f"te_jax: {where}", 1)
    return ValueError(msg)


def activation_name(activation: str | Sequence[str], where: str) -> str:
    """"gelu", "relu", "silu", "squared_relu", "swiglu" or "geglu" (TE tuples like ("silu", "linear") accepted)."""
    name = activation if isinstance(activation, str) else _ACTIVATION_TUPLES.get(tuple(activation))
    if name not in ACTIVATIONS:
        raise ValueError(f"te_jax: {where}: activation must be one of {ACTIVATIONS} (or a TE tuple "
                         f"{tuple(_ACTIVATION_TUPLES)}), got {activation!r}")
    return name


def norm_uses_bias(layernorm_type: str, use_bias: bool | None, where: str) -> bool:
    """Checks ``layernorm_type``; whether the norm has a bias (None: layernorm has one, rmsnorm none)."""
    if layernorm_type not in NORM_TYPES:
        raise ValueError(f"te_jax: {where}: layernorm_type must be one of {NORM_TYPES}, got {layernorm_type!r}")
    if use_bias and layernorm_type == "rmsnorm":
        raise ValueError(f"te_jax: {where}: rmsnorm has no bias; leave use_bias unset (None) or False")
    return layernorm_type == "layernorm" if use_bias is None else bool(use_bias)


def dropout_mask(draw_key: Callable[[], jax.Array], rate: float, shape, broadcast_dims, dtype, deterministic: bool,
                 where: str):
    """``bernoulli(1 - rate) / (1 - rate)`` of ``shape`` (size 1 along ``broadcast_dims``), or None.

    ``draw_key()`` gives the mask's key; it is called only when a mask is drawn.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"te_jax: {where}: a dropout rate must be in [0, 1], got {rate}")
    if deterministic or rate == 0.0:
        return None
    if rate == 1.0:
        return jnp.zeros(shape, dtype)
    keep = 1.0 - rate
    dims = canonical_axes(broadcast_dims, len(shape), where, "dropout broadcast dims") if broadcast_dims else ()
    draw = tuple(1 if i in dims else d for i, d in enumerate(shape))
    mask = jax.random.bernoulli(draw_key(), keep, draw)
    return jnp.broadcast_to(mask.astype(dtype) / jnp.asarray(keep, dtype), shape)


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding of ``x [B, T, N, D]`` (rotate-half convention), computed in float32.

    Args:
      x: queries or keys; D must be even.
      positions: ``[B, T]`` or ``[T]`` integer positions.
      base: the frequency base.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"te_jax: rotary embeddings need an even head dimension, got {d}")
    inv_freq = 1.0 / (base ** (jnp.arange(0, d // 2, dtype=jnp.float32) * (2.0 / d)))
    # [T, 1, D/2] (or [B, T, 1, D/2]): broadcast against x's batch and heads, never materialized per example
    angles = (jnp.asarray(positions, jnp.float32)[..., None] * inv_freq)[..., None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def choose_attention_implementation(q: jax.Array, mask: jax.Array | None = None) -> str:
    """The attention kernel a TransformerLayer picks when left to choose.

    "cudnn" when the default backend is a GPU, ``q`` ([B, T, N, D]) is bf16 or
    fp16, D is a multiple of 8 and at most 128, and any mask leaves T even
    (what cuDNN's fused attention takes for training); "xla" otherwise.
    """
    d, t = q.shape[-1], q.shape[-3]
    fits = q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128 and (mask is None or t % 2 == 0)
    return "cudnn" if fits and jax.default_backend() == "gpu" else "xla"


def attention_heads(hidden: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None,
                    where: str) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head dim)`` of a TransformerLayer, checked."""
    kv = num_kv_heads or num_heads
    if num_heads < 1 or kv < 1 or num_heads % kv:
        raise ValueError(f"te_jax: {where}: num_gqa_groups ({kv}) must divide num_attention_heads ({num_heads})")
    if head_dim is None and hidden % num_heads:
        raise ValueError(f"te_jax: {where}: hidden size {hidden} is not divisible by {num_heads} heads; set head_dim")
    return num_heads, kv, head_dim or hidden // num_heads


def split_qkv(qkv: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int):
    """``q [B, T, N, D], k, v [B, T, KV, D]`` from the fused projection ``[B, T, KV, N/KV + 2, D]``.

    Grouped per key/value head, query head i uses key/value head i // (N/KV);
    splitting the KV axis over tensor-parallel devices keeps each device's
    queries with their keys and values.
    """
    g = num_heads // num_kv_heads
    q = qkv[..., :g, :].reshape(*qkv.shape[:2], num_heads, head_dim)
    return q, qkv[..., g, :], qkv[..., g + 1, :]


def mlp_logical_axes(activation: str | Sequence[str], where: str) -> dict[str, tuple[str, ...]]:
    """A TransformerLayer's LayerNormMLP axis-name arguments ("embed", "act", "mlp")."""
    gated = activation_name(activation, where) in GATED
    return dict(kernel_axes_1=("embed", "act", "mlp") if gated else ("embed", "mlp"),
                bias_axes_1=("act", "mlp") if gated else ("mlp",), kernel_axes_2=("mlp", "embed"),
                bias_axes_2=("embed",), scale_axes=("embed",), ln_bias_axes=("embed",))
