"""Helpers for the fused norm/activation tests.

The kernels run on the default device (CPU handlers here, CUDA on a GPU
machine); the reference always runs on the CPU. The check that makes the
cast bit-exact despite float32 differences in the math: a kernel's quantized
outputs must equal the reference cast (``ref_norm_act.cast_outputs``) of the
float32 output the *same kernel* computes in mode "none" (float32), and that
float32 output must agree with the reference's to a few ulps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops.cast import CastSpec, check_spec
from te_jax.ops.quantize import key_words
from te_jax.spec import reference_norm_act as rna
from qtest_util import assert_outputs_same_bits, on_cpu

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HP = [jnp.bfloat16, jnp.float32, jnp.float16]
CAST_NAMES = ("q", "s", "q_t", "s_t", "amax", "amax_t", "scale")
F32_NONE = CastSpec("none", jnp.float32)

# (id, spec): every mode and layout the fused kernels support.
CAST_CASES = [
    ("none_bf16", CastSpec("none", jnp.bfloat16)),
    ("none_f16", CastSpec("none", jnp.float16)),
    ("tensor_row", CastSpec("fp8_tensor", E4M3, True, False)),
    ("tensor_col", CastSpec("fp8_tensor", E4M3, False, True)),
    ("tensor_both_e5", CastSpec("fp8_tensor", E5M2, True, True)),
    ("current_row", CastSpec("fp8_current", E4M3, True, False)),
    ("current_both", CastSpec("fp8_current", E4M3, True, True)),
    ("current_p2_eps_e5", CastSpec("fp8_current", E5M2, True, True, power_2=True, epsilon=1e-3)),
    ("mxfp8_row", CastSpec("mxfp8", E4M3, True, False)),
    ("mxfp8_both", CastSpec("mxfp8", E4M3, True, True)),
    ("mxfp8_col_e5", CastSpec("mxfp8", E5M2, False, True)),
    ("block_row", CastSpec("fp8_block", E4M3, True, False, power_2=True)),
    ("block_both", CastSpec("fp8_block", E4M3, True, True, power_2=True)),
    ("block_both_f32scale", CastSpec("fp8_block", E5M2, True, True, power_2=False)),
    ("nvfp4_row", CastSpec("nvfp4", None, True, False)),
    ("nvfp4_both", CastSpec("nvfp4", None, True, True)),
    ("nvfp4_rht", CastSpec("nvfp4", None, True, True, rht=True)),
    ("nvfp4_rht_sr", CastSpec("nvfp4", None, True, True, rht=True, stochastic_rounding=True)),
    ("nvfp4_col_sr", CastSpec("nvfp4", None, False, True, stochastic_rounding=True)),
]
CASE_IDS = [c[0] for c in CAST_CASES]
CASE_SPECS = [c[1] for c in CAST_CASES]
SCALE = jnp.full((1,), 3.5, jnp.float32)
KEY = jax.random.key(7)


def kernel(fn, *args, **kwargs):
    """``fn`` jitted with the FFI backend on the default device."""
    return jax.jit(functools.partial(fn, backend="ffi", **kwargs))(*args)


def reference(fn, *args, **kwargs):
    return on_cpu(functools.partial(fn, backend="reference", **kwargs), *args)


def cast_of(y, spec: CastSpec, m: int, n: int, scale=SCALE, key=KEY):
    """The reference cast of a float32 output matrix ``y [m, n]``, on the CPU."""
    spec = check_spec(spec, jnp.float32, m, n)
    words = key_words(key).reshape(2) if spec.stochastic_rounding else jnp.zeros((2,), jnp.uint32)
    sc = scale if spec.mode == "fp8_tensor" else jnp.ones((1,), jnp.float32)
    return on_cpu(lambda y, s, w: rna.cast_outputs(y, spec, s, w), jnp.asarray(y, jnp.float32), sc, words)


def assert_cast_follows_spec(outs, y_kernel, spec: CastSpec, scale=SCALE, key=KEY) -> None:
    """A kernel's cast results equal the reference cast of its own float32 output."""
    y = np.asarray(y_kernel, np.float32)
    want = cast_of(y.reshape(-1, y.shape[-1]), spec, int(np.prod(y.shape[:-1])), y.shape[-1], scale, key)
    assert_outputs_same_bits(tuple(outs), want, CAST_NAMES)


def assert_close(got, want, *, rtol=2.0**-19, scale_tol=2.0**-19, atol=None, what="") -> None:
    """``|got - want| <= rtol |want| + scale_tol max|want| (+ atol)`` elementwise; NaN positions equal."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    extra = np.broadcast_to(np.zeros(()) if atol is None else np.asarray(atol, np.float64), want.shape)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), f"{what}: NaN positions differ"
    ok = ~nan_w
    if not ok.any():
        return
    inf = np.isinf(want) & ok
    assert np.array_equal(got[inf], want[inf]), f"{what}: infinities differ"
    fin = ok & ~inf
    g, w = got[fin], want[fin]
    tol = rtol * np.abs(w) + scale_tol * (np.abs(w).max() if w.size else 0.0) + extra[fin]
    bad = np.abs(g - w) > tol
    if bad.any():
        i = int(np.argmax(np.abs(g - w) - tol))
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} beyond tolerance; worst got {g[i]!r} want {w[i]!r}")


def random_input(seed: int, shape, dtype, spread: float = 3.0) -> jax.Array:
    """Normal values times log-uniform magnitudes in [2^-spread, 2^spread] plus a per-row offset."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, shape, jnp.float32)
    x = x * jnp.exp2(jax.random.uniform(k2, shape, jnp.float32, -spread, spread))
    x = x + jax.random.normal(k3, (*shape[:-1], 1), jnp.float32) * 4
    return x.astype(dtype)


def with_rows(x: jax.Array) -> jax.Array:
    """Plants awkward rows: all zeros, a constant, huge values, and -0."""
    v = np.array(x.astype(jnp.float32)).reshape(-1, x.shape[-1])
    rows = v.shape[0]
    if rows >= 4:
        v[0] = 0.0
        v[1] = 3.0
        v[2] *= 1000.0 if x.dtype != jnp.float16 else 30.0
        v[3] = -0.0
    return jnp.asarray(v.reshape(x.shape)).astype(x.dtype)
