"""Helpers shared by the quantization tests: awkward inputs and bit-level comparison."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CPU = jax.devices("cpu")[0]


def on_cpu(fn, *args, **kwargs):
    """Runs ``fn`` jitted on the CPU: the reference is always evaluated there."""
    args = jax.device_put(args, CPU)
    with jax.default_device(CPU):
        return jax.jit(lambda *a: fn(*a, **kwargs))(*args)


def assert_same_bits(got, want, what: str = "") -> None:
    """Equal shapes, dtypes and bits; NaN matches NaN whatever its payload."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.dtype.kind == "u" or got.dtype.kind == "i":
        bad = got != want
    else:
        nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
        assert np.array_equal(nan_g, nan_w), f"{what}: NaN positions differ ({nan_g.sum()} vs {nan_w.sum()})"
        width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
        bad = (got.view(width) != want.view(width)) & ~nan_g
    if bad.any():
        idx = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at {idx}: got {got[idx]!r}, want {want[idx]!r}"
        )


def assert_outputs_same_bits(got, want, names) -> None:
    assert len(got) == len(want) == len(names)
    for g, w, n in zip(got, want, names):
        assert_same_bits(g, w, n)


def random_matrix(seed: int, shape, dtype=jnp.bfloat16, spread: float = 8.0) -> jax.Array:
    """Normal values times log-uniform magnitudes in [2^-spread, 2^spread]; never all zeros."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape, jnp.float32)
    mag = jnp.exp2(jax.random.uniform(k2, shape, jnp.float32, -spread, spread))
    return (x * mag).astype(dtype)


def with_specials(x: jax.Array, seed: int, block: int = 16) -> jax.Array:
    """Plants zeros, -0, NaN, +-Inf, an all-zero block, huge and subnormal values."""
    rng = np.random.default_rng(seed)
    v = np.array(x.astype(jnp.float32))
    flat = v.reshape(-1)
    n = flat.size
    picks = rng.choice(n, size=min(n, 12), replace=False)
    specials = [0.0, -0.0, np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-40, 448.0, 464.0, -57344.0, 6.0]
    for p, s in zip(picks, specials):
        flat[p] = s
    if v.shape[-1] >= block:
        v.reshape(-1, v.shape[-1])[0, :block] = 0.0  # an all-zero block in the first row
    return jnp.asarray(v).astype(x.dtype)
