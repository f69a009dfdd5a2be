"""A decoder-only byte-level language model made of te_jax.flax layers.

    tokens -> Embed -> TransformerLayer_0 .. TransformerLayer_{n-1} -> LayerNorm -> DenseGeneral head -> logits

Each ``te_jax.flax.TransformerLayer`` is a pre-norm block (LayerNormDenseGeneral
for the query/key/value projection, causal attention with rotary embeddings
and grouped-query heads, output projection, LayerNormMLP); under
``te_jax.autocast(recipe=...)`` all of its GEMMs run in FP8/FP4. Blocks are
unrolled and named ``TransformerLayer_<i>`` so per-layer recipes (recipes/)
can tell them apart. With ``ModelConfig.experts`` the blocks are ``MoEBlock``s:
the same attention, then a ``te_jax.flax.MoE`` (router, top-k experts, shared
experts) in place of the MLP; its load-balancing loss is sown under
"intermediates". With ``ModelConfig.flax_fp8`` (``--recipe flax-fp8``) the
same blocks multiply through flax's ``Fp8DotGeneral`` instead, outside any
te_jax recipe: the baseline the benchmarks compare with. With ``ModelConfig.flax_linen``
(``--recipe flax``) the dense blocks are ``LinenBlock``s, flax.linen's own layers: the
peer with no te_jax kernel in the blocks. The output head stays in high precision unless
``ModelConfig.quantize_head`` (the usual choice: the logits are the most
sensitive GEMM, and with 256 byte tokens it is a tiny one).

Memory: ``ModelConfig.remat`` wraps every block in ``nn.remat`` with one of
te_jax.flax's policies (``REMAT_POLICIES``: what the backward keeps, the rest
recomputed), and ``ModelConfig.recompute_norm_act`` makes te_jax's layers
recompute their norms' and activation's outputs in the backward
(benchmarks/README.md, "Memory", gives what each saves).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import te_jax
import te_jax.flax as te_flax
from examples.gpt.presets import ModelConfig

INIT_STD = 0.02


# --remat: the nn.remat policy of every block, by what the backward keeps of it ("none": no remat).
REMAT_POLICIES = {
    "none": None,
    "fp8": te_flax.save_fp8_policy,  # the FP8 copies (and norm statistics): GEMMs and attention recomputed
    "fp8-pre-activation": te_flax.save_fp8_and_pre_activation_policy,  # also the MLP's first GEMM output
    "nothing": te_flax.save_nothing_policy,  # the block's input only: the whole forward again
    "offload-fp8": te_flax.offload_fp8_policy(),  # the FP8 copies, in host memory until the backward
}


def remat(block_cls: type[nn.Module], c: ModelConfig) -> type[nn.Module]:
    """``block_cls`` under ``nn.remat`` with ``REMAT_POLICIES[c.remat]`` (itself for "none")."""
    if c.remat not in REMAT_POLICIES:
        raise ValueError(f"remat: no policy {c.remat!r}; choose from {', '.join(REMAT_POLICIES)}")
    return block_cls if c.remat == "none" else nn.remat(block_cls, policy=REMAT_POLICIES[c.remat])


def layer_settings(c: ModelConfig):
    """(dtype, kernel init, ``dot_general_cls``) of the model's layers: flax's FP8 GEMMs for ``flax_fp8``."""
    return jnp.dtype(c.dtype), nn.initializers.normal(INIT_STD), nn.Fp8DirectDotGeneralOp if c.flax_fp8 else None


class OneHotEmbed(nn.Module):
    """``nn.Embed``'s lookup (same "embedding" parameter) as a GEMM with the tokens' one-hot rows.

    With a vocabulary of 256 bytes, the lookup's gradient is a scatter-add of every token's row into one of
    256 rows, which XLA:GPU serializes on the colliding rows (about 25 ms per step at 32K tokens and width 768
    on an H200). As a GEMM it is ``one_hot^T @ grad``, accumulated in float32: well under a millisecond. The
    forward values are the lookup's exactly (one non-zero term per output).
    """

    num_embeddings: int
    features: int
    embedding_init: nn.initializers.Initializer
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.param("embedding", self.embedding_init, (self.num_embeddings, self.features), jnp.float32)
        one_hot = jax.nn.one_hot(tokens, self.num_embeddings, dtype=self.dtype)
        out = jnp.einsum("...v,vh->...h", one_hot, table.astype(self.dtype), preferred_element_type=jnp.float32)
        return out.astype(self.dtype)


class GPT(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int32[batch, seq] byte tokens -> float32[batch, seq, vocab] logits."""
        c = self.config
        dtype, init, dot_general_cls = layer_settings(c)
        x = OneHotEmbed(c.vocab, c.hidden, embedding_init=init, dtype=dtype, name="embed")(tokens)
        for i in range(c.layers):
            if c.experts or c.flax_linen:
                x = remat(MoEBlock if c.experts else LinenBlock, c)(c, name=f"TransformerLayer_{i}")(x)
                continue
            x = remat(te_flax.TransformerLayer, c)(
                num_attention_heads=c.heads,
                num_gqa_groups=c.kv_heads,
                intermediate_dim=c.mlp_hidden,
                mlp_activation="gelu",
                enable_rotary_pos_emb=c.rotary,
                causal=True,
                dtype=dtype,
                kernel_init=init,
                logical_axes=c.logical_axes,
                dot_general_cls=dot_general_cls,
                recompute_norm_act=c.recompute_norm_act,
                name=f"TransformerLayer_{i}",
            )(x)
        x = te_flax.LayerNorm(dtype=dtype, name="ln_f")(x)
        head = te_flax.DenseGeneral(c.vocab, dtype=dtype, kernel_init=init, name="head")
        if c.quantize_head:
            logits = head(x)
        else:
            with te_jax.autocast(enabled=False):  # keeps the enclosing block's mesh axes
                logits = head(x)
        return logits.astype(jnp.float32)


# The MoE's parameters' logical axes (``ModelConfig.logical_axes``): experts over the expert-parallel axis.
EXPERT_AXES = dict(router_axes=("embed", None), wi_axes=("expert", "embed", "mlp"), wo_axes=("expert", "mlp", "embed"))


class MoEBlock(nn.Module):
    """A pre-norm decoder block whose MLP is a mixture of experts: ``x + attn(x)``, then ``+ moe(norm(x))``.

    With ``flax_fp8`` (the baseline) only the attention's projections use flax's FP8: flax has no grouped
    GEMM, so the experts run unquantized there. With ``logical_axes`` the MoE's parameters name their axes
    (``EXPERT_AXES``); the attention's do not.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype, init, dot_general_cls = layer_settings(c)
        x = x + te_flax.SelfAttention(c.heads, c.kv_heads, c.hidden // c.heads, causal=True, rotary=c.rotary,
                                      dtype=dtype, kernel_init=init, dot_general_cls=dot_general_cls,
                                      recompute_norm_act=c.recompute_norm_act, name="attention")(x).astype(x.dtype)
        h = te_flax.LayerNorm(dtype=dtype, name="moe_norm")(x)
        axes = EXPERT_AXES if c.logical_axes else {}
        y = te_flax.MoE(c.experts, c.top_k, c.mlp_hidden, num_shared_experts=c.shared_experts,
                        aux_loss_coeff=c.aux_loss_coeff, dtype=dtype, kernel_init=init, router_init=init,
                        name="moe", **axes)(h)
        return x + y.astype(x.dtype)


def attention_implementation(q: jax.Array) -> str:
    """cuDNN's fused attention on a GPU (bf16/fp16, head dim a multiple of 8 up to 128), XLA's otherwise: the
    choice te_jax.flax.TransformerLayer makes, so that the flax.linen peer attends alike."""
    d = q.shape[-1]
    fits = q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128
    return "cudnn" if fits and jax.default_backend() == "gpu" else "xla"


class LinenBlock(nn.Module):
    """The dense block of ``te_jax.flax.TransformerLayer`` (no bias, layernorm, gelu) from flax.linen's own
    layers: ``LayerNorm``, ``DenseGeneral`` (the grouped-query QKV projection and the output projection),
    rotary embeddings, ``jax.nn.dot_product_attention``, ``LayerNorm``, ``Dense``, ``nn.gelu``, ``Dense``.
    No te_jax kernel runs in it: the ``--recipe flax`` peer (with ``flax_fp8``, flax's FP8 on the same layers).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype, init, dot_general_cls = layer_settings(c)
        n, kv, d = c.heads, c.kv_heads, c.hidden // c.heads
        g = n // kv
        dense = dict(use_bias=False, dtype=dtype, kernel_init=init, dot_general_cls=dot_general_cls)
        qkv = nn.DenseGeneral((kv, g + 2, d), name="qkv", **dense)(nn.LayerNorm(1e-6, dtype, name="ln_1")(x))
        q = qkv[..., :g, :].reshape(*qkv.shape[:2], n, d)  # grouped per key/value head, as TransformerLayer's
        k, v = qkv[..., g, :], qkv[..., g + 1, :]
        if c.rotary:
            positions = jnp.arange(x.shape[1])
            q, k = te_flax.rotary_embedding(q, positions), te_flax.rotary_embedding(k, positions)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention_implementation(q))
        x = x + nn.DenseGeneral(c.hidden, axis=(-2, -1), name="out", **dense)(o).astype(x.dtype)
        h = nn.Dense(c.mlp_hidden, name="wi", **dense)(nn.LayerNorm(1e-6, dtype, name="ln_2")(x))
        return x + nn.Dense(c.hidden, name="wo", **dense)(nn.gelu(h)).astype(x.dtype)


def aux_loss(intermediates) -> jax.Array:
    """The sum of the load-balancing losses the MoE blocks sowed (0 for a dense model)."""
    return sum((jnp.sum(v) for v in jax.tree.leaves(intermediates)), jnp.float32(0))


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
