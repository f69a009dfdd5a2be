"""Small Flax models built on te_jax.dense, for the recipe, state and gallery tests.

Their dense layer keeps its FP8 state as the te_jax.flax layers do (``fp8_meta/<path>/<role>``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import te_jax
from te_jax.flax import _common as C
from te_jax.flax._common import module_path


class Dense(nn.Module):
    features: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,)) if self.use_bias else None
        quantizers = te_jax.core.DenseQuantizers.from_recipe(C.recipe_or_none(), module_path(self))
        state = C.gemm_state(self, quantizers)
        key = C.quantize_key(self, quantizers.any)
        y, new_state = te_jax.dense(x, kernel, bias, quantizers=quantizers, state=state, key=key)
        C.store_gemm_state(self, new_state)
        return y


class MLP(nn.Module):
    hidden: int = 64
    features: int = 32

    @nn.compact
    def __call__(self, x):
        return Dense(self.features, name="wo")(nn.gelu(Dense(self.hidden, name="wi")(x)))


class Attention(nn.Module):
    """Single-head self-attention over axis -2: the projections are te_jax dense layers."""

    features: int = 32

    @nn.compact
    def __call__(self, x):
        q, k, v = (Dense(self.features, name=n)(x) for n in ("query", "key", "value"))
        w = jax.nn.softmax(jnp.einsum("...qd,...kd->...qk", q, k) / jnp.sqrt(q.shape[-1]), axis=-1)
        return Dense(self.features, name="out")(jnp.einsum("...qk,...kd->...qd", w, v))


class TransformerLayer(nn.Module):
    features: int = 32

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.features, name="attention")(nn.LayerNorm()(x))
        return x + MLP(2 * self.features, self.features, name="mlp")(nn.LayerNorm()(x))


class Transformer(nn.Module):
    """Blocks named TransformerLayer_0 .. TransformerLayer_{n-1}, between bf16 in/out projections."""

    num_layers: int = 4
    features: int = 32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.features, name="embed")(x)
        for _ in range(self.num_layers):
            x = TransformerLayer(self.features)(x)
        return nn.Dense(x.shape[-1], name="head")(x)


def mse(pred, target):
    return jnp.mean((pred.astype(jnp.float32) - target) ** 2)
