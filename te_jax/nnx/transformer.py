"""``TransformerLayer``: ``te_jax.flax.TransformerLayer`` in NNX form, built from the te_jax.nnx layers.

::

    x = x + dropout(out(attention(rope(q), rope(k), v)))    q, k, v = qkv(norm(x))   (LayerNormLinear)
    x = x + dropout(mlp(x))                                                          (LayerNormMLP, norm inside)

Attention is ``jax.nn.dot_product_attention`` in high precision (cuDNN's
fused attention on GPUs where it fits when left to choose). Sub-layer paths:
``<path>/attention/qkv``, ``<path>/attention/out``, ``<path>/mlp`` (GEMMs
``<path>/mlp/wi`` and ``<path>/mlp/wo``), as the Linen layer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.core.layer_support import attention_heads, canonical_input, check_dtypes, choose_attention_implementation, \
    mlp_logical_axes, rotary_embedding, split_qkv
from te_jax.nnx._fp8 import Layer, where
from te_jax.nnx.linear import default_bias_init, default_kernel_init
from te_jax.nnx.mlp import LayerNormMLP
from te_jax.nnx.normalization import LayerNormLinear

Dtype = Any
_HEADS = ("batch", None, "heads", "kv")  # the logical axes of q, k, v and the attention output


class SelfAttention(Layer):
    """Pre-norm self-attention: fused QKV projection (with the norm), attention, output projection.

    Under cuDNN's attention the output projection keeps no FP8 copy of the attention output beside the
    output cuDNN keeps, as ``te_jax.flax.SelfAttention``'s does.

    Sub-layers "qkv" (``LayerNormLinear``, kernel ``[H, KV, N/KV + 2, D]``)
    and "out" (``LayerNormLinear`` without a norm, kernel ``[N, D, H]``), as
    ``te_jax.flax.SelfAttention``'s.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 layernorm_type: str = "layernorm", zero_centered_gamma: bool = False, epsilon: float = 1e-6,
                 use_bias: bool = False, kernel_init=default_kernel_init, bias_init=default_bias_init,
                 dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32, causal: bool = True,
                 rotary: bool = True, rotary_base: float = 10000.0, implementation: str | None = None,
                 logical_axes: bool = False, rngs: nnx.Rngs, path: str | Sequence[str] | None = None):
        self.set_path(path)
        n, kv, d, ax = num_heads, num_kv_heads, head_dim, logical_axes
        common = dict(use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init, dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)
        self.qkv = LayerNormLinear(hidden, (kv, n // kv + 2, d), layernorm_type=layernorm_type,
                                   zero_centered_gamma=zero_centered_gamma, epsilon=epsilon,
                                   kernel_axes=("embed", "heads", "qkv", "kv") if ax else (),
                                   bias_axes=("heads", "qkv", "kv") if ax else (), scale_axes=("embed",) if ax else (),
                                   ln_bias_axes=("embed",) if ax else (), path=self.child_path("qkv"), **common)
        self.out = LayerNormLinear((n, d), hidden, axis=(-2, -1), enable_layernorm=False,
                                   kernel_axes=("heads", "kv", "embed") if ax else (),
                                   bias_axes=("embed",) if ax else (), path=self.child_path("out"), **common)
        self.num_heads, self.num_kv_heads, self.head_dim = n, kv, d
        self.causal, self.rotary, self.rotary_base = causal, rotary, rotary_base
        self.implementation, self.logical_axes = implementation, logical_axes

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, positions: jax.Array | None = None):
        q, k, v = split_qkv(self.qkv(x), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.rotary:
            if positions is None:
                positions = jnp.arange(x.shape[1])
            q, k = rotary_embedding(q, positions, self.rotary_base), rotary_embedding(k, positions, self.rotary_base)
        if self.logical_axes:  # attention sees whole sequences, its heads split like the projections'
            q, k, v = (nn.with_logical_constraint(t, _HEADS) for t in (q, k, v))
        implementation = self.implementation or choose_attention_implementation(q, mask)
        o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=self.causal, implementation=implementation)
        if self.logical_axes:
            o = nn.with_logical_constraint(o, _HEADS)
        # cuDNN's attention keeps o for its own backward: the projection keeps no FP8 copy of it beside that.
        return self.out(o, recompute_norm_act=implementation == "cudnn")


class TransformerLayer(Layer):
    """A pre-norm decoder block; ``[B, T, H] -> [B, T, H]`` (output in the input's dtype).

    ``te_jax.flax.TransformerLayer``'s arguments in NNX form: the hidden
    size is given at construction, dropout follows ``nnx.Dropout``
    (``deterministic``, ``model.eval()``), and the parameters live in the
    sub-layers ``attention.qkv``, ``attention.out`` and ``mlp``.

    Args:
      hidden_size: H.
      num_attention_heads, num_gqa_groups, head_dim, intermediate_dim, mlp_activation, layernorm_type,
        zero_centered_gamma, layernorm_epsilon, use_bias, causal, enable_rotary_pos_emb, rotary_base,
        hidden_dropout, intermediate_dropout: as the attributes of ``te_jax.flax.TransformerLayer``.
      dropout_rng_name: the dropout ``nnx.Rngs`` stream.
      deterministic: no dropout (``model.eval()`` sets it).
      attention_implementation: ``jax.nn.dot_product_attention``'s: "xla", "cudnn", or None to choose.
      dtype, param_dtype, kernel_init, bias_init: for every sub-layer.
      logical_axes: give the parameters logical axis names ("embed", "heads", "qkv", "kv", "mlp", "act").
      rngs: ``params`` draws the parameters; "quantize" and the dropout stream are forked where used.
      path: the module path the recipe's roles carry (sub-layers append theirs).
    """

    def __init__(self, hidden_size: int, num_attention_heads: int = 8, *, num_gqa_groups: int | None = None,
                 head_dim: int | None = None, intermediate_dim: int | None = None, mlp_activation: Any = "gelu",
                 layernorm_type: str = "layernorm", zero_centered_gamma: bool = False,
                 layernorm_epsilon: float = 1e-6, use_bias: bool = False, causal: bool = True,
                 enable_rotary_pos_emb: bool = True, rotary_base: float = 10000.0, hidden_dropout: float = 0.0,
                 intermediate_dropout: float = 0.0, dropout_rng_name: str = "dropout", deterministic: bool = False,
                 attention_implementation: str | None = None, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, kernel_init=default_kernel_init, bias_init=default_bias_init,
                 logical_axes: bool = False, rngs: nnx.Rngs, path: str | Sequence[str] | None = None):
        self.set_path(path)
        check_dtypes(where(self), dtype, param_dtype)
        h = int(hidden_size)
        n, kv, d = attention_heads(h, num_attention_heads, num_gqa_groups, head_dim, where(self))
        norm = dict(layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma)
        common = dict(use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init, dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)
        self.attention = SelfAttention(h, n, kv, d, epsilon=layernorm_epsilon, causal=causal,
                                       rotary=enable_rotary_pos_emb, rotary_base=rotary_base,
                                       implementation=attention_implementation, logical_axes=logical_axes,
                                       path=self.child_path("attention"), **norm, **common)
        self.mlp = LayerNormMLP(h, intermediate_dim or 4 * h, activation=mlp_activation, epsilon=layernorm_epsilon,
                                intermediate_dropout_rate=intermediate_dropout, dropout_rng_name=dropout_rng_name,
                                deterministic=deterministic, path=self.child_path("mlp"), **norm, **common,
                                **(mlp_logical_axes(mlp_activation, where(self)) if logical_axes else {}))
        self.dropout = nnx.Dropout(hidden_dropout, rng_collection=dropout_rng_name, deterministic=deterministic,
                                   rngs=rngs if hidden_dropout > 0.0 else None)
        self.hidden_size = h

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None, positions: jax.Array | None = None,
                 deterministic: bool | None = None, rngs=None) -> jax.Array:
        """Args: x ``[B, T, H]``; mask: boolean, broadcastable to ``[B, N, T, T]`` (True: attend), combined
        with the causal mask; positions: ``[B, T]`` or ``[T]`` for the rotary embedding (default 0..T-1);
        deterministic: overrides the layer's; rngs: the dropout masks' (default: the layer's streams)."""
        x = canonical_input(x)
        check_dtypes(where(self), x=x)
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"te_jax: {where(self)}: the input must be [batch, seq, {self.hidden_size}], "
                             f"got {x.shape}")
        attn = self.attention(x, mask, positions)
        x = x + self.dropout(attn, deterministic=deterministic, rngs=rngs).astype(x.dtype)
        y = self.mlp(x, deterministic=deterministic, rngs=rngs)
        return x + self.dropout(y, deterministic=deterministic, rngs=rngs).astype(x.dtype)

