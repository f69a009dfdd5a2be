"""``TransformerLayer``: a pre-norm decoder block built from the te_jax.flax layers.

::

    x = x + dropout(out(attention(rope(q), rope(k), v)))    q, k, v = qkv(norm(x))   (LayerNormDenseGeneral)
    x = x + dropout(mlp(x))                                                          (LayerNormMLP, norm inside)

Attention is ``jax.nn.dot_product_attention`` in high precision. Left to
choose (``attention_implementation=None``), it runs cuDNN's fused (flash)
attention on GPUs where cuDNN takes the shapes and dtype (see
``attention_implementation``), XLA's otherwise; jax's own default is XLA
everywhere, which keeps the [T, T] scores in memory with a causal mask and grouped-query heads. Module paths:
``<path>/attention/qkv``, ``<path>/attention/out``, ``<path>/mlp`` (GEMMs
``<path>/mlp/wi`` and ``<path>/mlp/wo``), so per-layer custom recipes can tell them apart.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.core.layer_support import (attention_heads, choose_attention_implementation, mlp_logical_axes,
                                       rotary_embedding, split_qkv)
from te_jax.flax import _common as C
from te_jax.flax.layernorm import LayerNormDenseGeneral
from te_jax.flax.mlp import LayerNormMLP

Dtype = Any


class SelfAttention(nn.Module):
    """Pre-norm self-attention: fused QKV projection (with the norm), attention, output projection.

    Under cuDNN's attention, which keeps its output for its own backward, the output projection keeps
    that output instead of an FP8 copy of it and quantizes it again in the backward (the same bits;
    ``te_jax.layernorm_dense``'s ``recompute_norm_act`` without a norm).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    epsilon: float = 1e-6
    use_bias: bool = False
    kernel_init: C.Initializer = nn.initializers.lecun_normal()
    bias_init: C.Initializer = nn.initializers.zeros_init()
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    causal: bool = True
    rotary: bool = True
    rotary_base: float = 10000.0
    implementation: str | None = None
    logical_axes: bool = False
    dot_general_cls: Any = None
    recompute_norm_act: bool = False  # the qkv projection's norm output (LayerNormDenseGeneral)

    @nn.compact
    def __call__(self, x, mask=None, positions=None):
        n, kv, d, h = self.num_heads, self.num_kv_heads, self.head_dim, x.shape[-1]
        ax = self.logical_axes
        common = dict(use_bias=self.use_bias, kernel_init=self.kernel_init, bias_init=self.bias_init,
                      dtype=self.dtype, param_dtype=self.param_dtype, dot_general_cls=self.dot_general_cls,
                      recompute_norm_act=self.recompute_norm_act)
        g = n // kv  # grouped per key/value head: [kv, n/kv query heads + key + value, d] (split_qkv)
        qkv = LayerNormDenseGeneral(features=(kv, g + 2, d), layernorm_type=self.layernorm_type,
                                    zero_centered_gamma=self.zero_centered_gamma, epsilon=self.epsilon, name="qkv",
                                    kernel_axes=("embed", "heads", "qkv", "kv") if ax else (),
                                    bias_axes=("heads", "qkv", "kv") if ax else (), scale_axes=("embed",) if ax else (),
                                    ln_bias_axes=("embed",) if ax else (), **common)(x)
        q, k, v = split_qkv(qkv, n, kv, d)
        if self.rotary:
            if positions is None:
                positions = jnp.arange(x.shape[1])
            q, k = rotary_embedding(q, positions, self.rotary_base), rotary_embedding(k, positions, self.rotary_base)
        if ax:  # attention sees whole sequences, its heads split like the projections' (sequence parallel too)
            q, k, v = (nn.with_logical_constraint(t, ("batch", None, "heads", "kv")) for t in (q, k, v))
        implementation = self.implementation or choose_attention_implementation(q, mask)
        o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=self.causal, implementation=implementation)
        if ax:
            o = nn.with_logical_constraint(o, ("batch", None, "heads", "kv"))
        # cuDNN's attention keeps o for its own backward: the projection keeps no FP8 copy of it beside that.
        out_common = common | dict(recompute_norm_act=implementation == "cudnn")
        return LayerNormDenseGeneral(features=h, axis=(-2, -1), enable_layernorm=False, name="out",
                                     kernel_axes=("heads", "kv", "embed") if ax else (),
                                     bias_axes=("embed",) if ax else (), **out_common)(o)


class TransformerLayer(nn.Module):
    """A pre-norm decoder block; ``[B, T, H] -> [B, T, H]`` (output in the input's dtype).

    Attributes:
      num_attention_heads: query heads.
      num_gqa_groups: key/value heads (None: as many as query heads); must divide num_attention_heads.
      head_dim: per-head width (None: H / num_attention_heads).
      intermediate_dim: the MLP width (None: 4 H).
      mlp_activation: the MLP's activation (see ``LayerNormMLP``).
      layernorm_type, zero_centered_gamma, layernorm_epsilon: both norms.
      use_bias: biases on every projection.
      causal: causal self-attention mask.
      enable_rotary_pos_emb, rotary_base: rotary embeddings of queries and keys.
      hidden_dropout: dropout on the attention and MLP outputs (before the residual add).
      intermediate_dropout: dropout on the MLP's activation output.
      dropout_rng_name: the dropout RNG stream.
      attention_implementation: ``jax.nn.dot_product_attention``'s implementation: "xla", "cudnn", or
        None to choose (``choose_attention_implementation``: cuDNN's fused attention on GPUs where it fits).
      dtype, param_dtype, kernel_init, bias_init: for every sub-layer.
      logical_axes: give the parameters logical axis names ("embed", "heads", "qkv", "kv", "mlp", "act").
      dot_general_cls: flax's custom product for every projection (e.g. ``nn.Fp8DirectDotGeneralOp``:
        the same block with flax's FP8), for the unquantized path only.
      recompute_norm_act: the backward recomputes both norms' outputs and the MLP activation's output
        (their FP8 copies) from the tensors it keeps anyway instead of keeping them: per token
        ``2 H + F`` elements less memory, three fused memory-bound kernels more in the backward
        (benchmarks/README.md, "Memory").
    """

    num_attention_heads: int = 8
    num_gqa_groups: int | None = None
    head_dim: int | None = None
    intermediate_dim: int | None = None
    mlp_activation: Any = "gelu"
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    layernorm_epsilon: float = 1e-6
    use_bias: bool = False
    causal: bool = True
    enable_rotary_pos_emb: bool = True
    rotary_base: float = 10000.0
    hidden_dropout: float = 0.0
    intermediate_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    attention_implementation: str | None = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: C.Initializer = nn.initializers.lecun_normal()
    bias_init: C.Initializer = nn.initializers.zeros_init()
    logical_axes: bool = False
    dot_general_cls: Any = None
    recompute_norm_act: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None, positions: jax.Array | None = None,
                 deterministic: bool = True) -> jax.Array:
        """Args: x ``[B, T, H]``; mask: boolean, broadcastable to ``[B, N, T, T]`` (True: attend), combined
        with the causal mask; positions: ``[B, T]`` or ``[T]`` for the rotary embedding (default 0..T-1);
        deterministic: no dropout."""
        C.check_dtypes(self, x := C.canonical_input(x))
        if x.ndim != 3:
            raise ValueError(f"te_jax: {C.where(self)}: the input must be [batch, seq, hidden], got {x.shape}")
        h = x.shape[-1]
        n, kv, d = attention_heads(h, self.num_attention_heads, self.num_gqa_groups, self.head_dim, C.where(self))
        norm = dict(layernorm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma)
        common = dict(use_bias=self.use_bias, kernel_init=self.kernel_init, bias_init=self.bias_init,
                      dtype=self.dtype, param_dtype=self.param_dtype, dot_general_cls=self.dot_general_cls,
                      recompute_norm_act=self.recompute_norm_act)
        attn = SelfAttention(n, kv, d, epsilon=self.layernorm_epsilon, causal=self.causal,
                             rotary=self.enable_rotary_pos_emb, rotary_base=self.rotary_base,
                             implementation=self.attention_implementation, logical_axes=self.logical_axes,
                             name="attention", **norm, **common)(x, mask, positions)
        drop = nn.Dropout(self.hidden_dropout, rng_collection=self.dropout_rng_name)
        x = x + drop(attn, deterministic=deterministic).astype(x.dtype)
        axes = mlp_logical_axes(self.mlp_activation, C.where(self)) if self.logical_axes else {}
        mlp = LayerNormMLP(intermediate_dim=self.intermediate_dim or 4 * h, activation=self.mlp_activation,
                           epsilon=self.layernorm_epsilon, intermediate_dropout_rate=self.intermediate_dropout,
                           dropout_rng_name=self.dropout_rng_name, name="mlp", **norm, **common,
                           **axes)(x, deterministic=deterministic)
        return x + drop(mlp, deterministic=deterministic).astype(x.dtype)
