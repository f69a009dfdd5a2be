"""Helpers shared by the tests: awkward inputs, bit-level comparison, the built-in recipes, scripts on fake CPU
devices."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from te_jax import recipe as R

CPU = jax.devices("cpu")[0]
# Every built-in recipe, with a short amax history so that delayed scaling calibrates in one step.
BUILTIN_RECIPES = {
    "delayed": R.DelayedScaling(amax_history_len=4),
    "current": R.Float8CurrentScaling(),
    "mxfp8": R.MXFP8BlockScaling(),
    "block": R.Float8BlockScaling(),
    "nvfp4": R.NVFP4BlockScaling(),
}


def normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    """Standard normal float32 values (times ``scale``) from ``jax.random.key(seed)``."""
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def pure(state) -> dict:
    """An NNX state as a plain nested dict of arrays (``nnx.to_pure_dict``)."""
    from flax import nnx

    return nnx.to_pure_dict(state)


def on_cpu(fn, *args, **kwargs):
    """Runs ``fn`` jitted on the CPU: the reference is always evaluated there."""
    args = jax.device_put(args, CPU)
    with jax.default_device(CPU):
        return jax.jit(lambda *a: fn(*a, **kwargs))(*args)


def _bit_mismatch(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Where ``got`` and ``want`` (same shape and dtype) differ in bits; NaN matches NaN whatever its payload,
    NaN against a number is a mismatch."""
    if got.dtype.kind in "ui":
        return got != want
    nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    return ((got.view(width) != want.view(width)) & ~(nan_g & nan_w)) | (nan_g != nan_w)


def same_bits(got, want) -> bool:
    """Equal shapes, dtypes and bits (so -0 != +0); NaN matches NaN whatever its payload."""
    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and got.dtype == want.dtype and not _bit_mismatch(got, want).any()


def tree_same_bits(got, want) -> bool:
    """Equal tree structures and ``same_bits`` leaf by leaf."""
    return jax.tree.structure(got) == jax.tree.structure(want) and all(
        same_bits(u, v) for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def assert_same_bits(got, want, what: str = "") -> None:
    """Equal shapes, dtypes and bits; NaN matches NaN whatever its payload."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.dtype.kind not in "ui":
        nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
        assert np.array_equal(nan_g, nan_w), f"{what}: NaN positions differ ({nan_g.sum()} vs {nan_w.sum()})"
    bad = _bit_mismatch(got, want)
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


def run_on_fake_devices(argv: list[str], *, devices: int = 8, xla_flags: str = "", timeout: int = 900,
                        cwd=None) -> subprocess.CompletedProcess:
    """``python argv...`` in a subprocess on ``devices`` fake CPU devices (the pytest process keeps one).

    The child inherits the environment; its XLA_FLAGS are ours plus the device count and ``xla_flags``.
    """
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices} {xla_flags}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)
