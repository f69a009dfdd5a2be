"""Model and run presets: tiny and tiny-moe (CPU, seconds per hundred steps), 125m, 1.3b and moe-1b (one GPU)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape. Tokens are bytes, so ``vocab`` is 256."""

    vocab: int = 256
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: heads share kv_heads key/value heads
    mlp_hidden: int = 512
    max_len: int = 128
    rotary: bool = True
    dtype: str = "bfloat16"  # compute dtype; parameters are float32
    quantize_head: bool = False  # the output projection stays in high precision unless True
    logical_axes: bool = False  # name the parameters' axes ("embed", "heads", "mlp", ...) for sharding rules
    flax_fp8: bool = False  # the baseline: every block's projections through flax's Fp8DotGeneral, no te_jax recipe
    flax_linen: bool = False  # the peer: dense blocks of flax.linen's own layers (LayerNorm, DenseGeneral, gelu)
    # What a block keeps for its backward: remat (a te_jax.flax policy's name, model.REMAT_POLICIES) recomputes
    # the rest of the block; recompute_norm_act drops only the norms' and activation's outputs (their FP8 copies),
    # recomputed from the tensors the backward keeps anyway (te_jax.flax.TransformerLayer.recompute_norm_act).
    remat: str = "none"
    recompute_norm_act: bool = False
    # Mixture of experts: with experts > 0 each block's MLP is a te_jax.flax.MoE of that many swiglu experts
    # of width mlp_hidden, top_k of them per token, plus shared_experts every token goes through.
    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0
    aux_loss_coeff: float = 0.01  # the load-balancing loss's weight in the training loss


@dataclasses.dataclass(frozen=True)
class Preset:
    model: ModelConfig
    batch: int
    seq_len: int
    steps: int
    lr: float
    warmup: int
    eval_every: int
    eval_batches: int


PRESETS = {
    # ~0.4M parameters: trains on 2 CPU cores in a minute or two.
    "tiny": Preset(ModelConfig(layers=2, hidden=128, heads=4, kv_heads=2, mlp_hidden=512, max_len=128),
                   batch=16, seq_len=128, steps=200, lr=3e-3, warmup=20, eval_every=50, eval_batches=4),
    # ~127M parameters (GPT-2 small's width, 18 blocks since byte tokens need almost no embedding).
    "125m": Preset(ModelConfig(layers=18, hidden=768, heads=12, kv_heads=12, mlp_hidden=3072, max_len=1024),
                   batch=32, seq_len=1024, steps=500, lr=6e-4, warmup=50, eval_every=100, eval_batches=8),
    # ~1.29B parameters (GPT-3 XL's width, grouped-query attention with 8 key/value heads).
    "1.3b": Preset(ModelConfig(layers=28, hidden=2048, heads=16, kv_heads=8, mlp_hidden=8192, max_len=2048),
                   batch=16, seq_len=2048, steps=500, lr=2e-4, warmup=50, eval_every=100, eval_batches=4),
    # ~1.05M parameters (~0.46M active per token): tiny's attention, 8 experts of width 128, top-2, one shared
    # expert.
    "tiny-moe": Preset(ModelConfig(layers=2, hidden=128, heads=4, kv_heads=2, mlp_hidden=128, max_len=128,
                                   experts=8, top_k=2, shared_experts=1),
                       batch=16, seq_len=128, steps=200, lr=3e-3, warmup=20, eval_every=50, eval_batches=4),
    # ~1.01B parameters (~0.22B active per token): 12 blocks of width 1536, 32 experts of width 512, top-4,
    # one shared expert (DeepSeek-style fine-grained experts).
    "moe-1b": Preset(ModelConfig(layers=12, hidden=1536, heads=12, kv_heads=4, mlp_hidden=512, max_len=2048,
                                 experts=32, top_k=4, shared_experts=1),
                     batch=16, seq_len=2048, steps=500, lr=3e-4, warmup=50, eval_every=100, eval_batches=4),
}
