"""The mix check of ``FP8Gradients``: tree operations that add, average or scale gradients are refused.

The FP8 state update in ``grads["fp8_meta"]`` merges by elementwise max
(``te_jax.train.merge_gradients``); summing micro-batches' updates with
``jax.tree.map(jnp.add, acc, g)`` would decode to a scale several times too
large. A tree operation cannot be told apart from ``jax.jit``, ``lax.pmean``
or a checkpoint by its structure, so ``FP8Gradients`` carries one more leaf,
``f32[4] = [r1, r1**2, r2, r2**2]`` with r1, r2 small integers (1 to 16)
drawn from the bits of the update. Every operation that keeps a gradient
whole keeps that relation exactly (jit, device_put, a checkpoint, the mean
of identical copies in ``lax.pmean``, te_jax's max-merge), and every positive
mix of different gradients breaks it (a sum, a mean, a sum divided by the
count: ``mean(r)**2 < mean(r**2)`` unless all r are equal), as does scaling
one. When the leaf is concrete (outside jit), building the gradients checks
it, and the result refuses to give its "fp8_meta" (or to be applied) with a
``FP8StateError`` naming ``te_jax.train.merge_gradients``; inside jit,
``te_jax.train.apply_gradients`` (and ``TrainState``) checks it as the step
runs and, the values being unknown when it is traced, turns the FP8 state it
would write into NaN, so that the step fails loudly instead of training on a
wrong scale. Two different gradients draw the same (r1, r2) once in 256:
their mean then passes unnoticed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.core.gemm_quant import FP8StateError

SIZE = 4
FIX = ("combine FP8 gradients with te_jax.train.merge_gradients (parameters summed, the FP8 state update and "
       "statistics max-merged) or te_jax.train.accumulate_gradients, and transform grads[\"params\"] only")


def zero() -> np.ndarray:
    """The check of gradients that carry none yet (the max-merge's identity; consistent)."""
    return np.zeros((SIZE,), np.float32)


def of(tree: Any) -> jax.Array:
    """A fresh check drawn from the bits of ``tree`` (the FP8 state update and statistics)."""
    h = jnp.uint32(0)
    for leaf in jax.tree.leaves(tree):
        v = jnp.asarray(leaf, jnp.float32)
        h = h + jnp.sum(lax.bitcast_convert_type(jnp.where(jnp.isfinite(v), v, 0), jnp.uint32), dtype=jnp.uint32)
    h = h * jnp.uint32(0x9E3779B1)
    h = h ^ (h >> 15)
    r = (1 + jnp.stack([(h >> 28) & 15, (h >> 24) & 15])).astype(jnp.float32)
    return jnp.stack([r[0], r[0] * r[0], r[1], r[1] * r[1]])


def merge(a: Any, b: Any) -> jax.Array:
    """The check of two gradients merged by te_jax (elementwise max keeps the relation)."""
    return jnp.maximum(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))


def holds(check: Any) -> jax.Array:
    """Whether the relation holds (a bool array; traced inside jit)."""
    c = jnp.asarray(check, jnp.float32)
    return (c[1] == c[0] * c[0]) & (c[3] == c[2] * c[2])


def _concrete(check: Any) -> np.ndarray | None:
    """The check as numbers when it is concrete and numeric, else None (a tracer, a shape, a placeholder)."""
    if isinstance(check, jax.core.Tracer) or isinstance(check, (bool, np.bool_)):
        return None
    if not isinstance(check, (np.ndarray, np.generic, jax.Array, float, int)):
        return None
    value = np.asarray(check)
    if value.shape != (SIZE,) or not np.issubdtype(value.dtype, np.number):
        return None
    return value.astype(np.float64)


def consistent(check: Any) -> bool:
    """False when ``check`` is concrete and its relation is broken (gradients mixed); True otherwise (a tracer,
    a placeholder: not known here)."""
    c = _concrete(check)
    return c is None or (c[1] == c[0] * c[0] and c[3] == c[2] * c[2])


def verify(check: Any) -> None:
    """Raises ``FP8StateError`` when ``check`` is concrete and its relation is broken (gradients mixed)."""
    if not consistent(check):
        raise FP8StateError(
            "te_jax: these FP8Gradients were combined or scaled by a tree operation (e.g. jax.tree.map(jnp.add, "
            "acc, grads), or dividing every leaf by the number of micro-batches): their FP8 state update merges "
            f"by max, not by sum, and a summed update decodes to a wrong scale. To accumulate, {FIX}")


def poisoned_unless_held(check: Any, fp8_meta: Any) -> Any:
    """``fp8_meta`` where the relation holds, NaN where the gradients it came from were mixed (inside jit)."""
    ok = holds(check)
    return jax.tree.map(lambda v: jnp.where(ok, v, jnp.full_like(v, jnp.nan)), fp8_meta)
