"""Scalar numerics of the quantization formats, in plain JAX.

This module is the spec: the reference quantizers are built from it, and
``csrc/common/numerics.h`` is its C++ twin, function for function. All
arithmetic is float32 (or uint32 on float32 bit patterns), so XLA, the CPU
kernels and the CUDA kernels give the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32_MAX = np.float32(np.finfo(np.float32).max)
# The largest encode scale, so that every decode scale 1/scale is a normal float32.
MAX_SCALE = np.float32(2.0**126)
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)

# Block lengths of the block-scaled formats (the kernels in csrc/ use the same numbers).
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK = 128
_FP8_MAX = {jnp.dtype(jnp.float8_e4m3fn): E4M3_MAX, jnp.dtype(jnp.float8_e5m2): E5M2_MAX}

# 16-point random Hadamard transform sign pattern: bit i set negates element i.
RHT_SIGN_MASK = 0x5A93
ROWWISE_STREAM = 0
COLWISE_STREAM = 1


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype (E4M3FN or E5M2)."""
    try:
        return _FP8_MAX[jnp.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(
            f"unsupported FP8 dtype {dtype!r}; use jnp.float8_e4m3fn or jnp.float8_e5m2"
        ) from None


def f32_bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def bits_f32(u: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(u.astype(jnp.uint32), jnp.float32)


def abs_max(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """NaN-propagating max(|x|) in float32, via the ordered bits of |x|.

    Comparing |x|'s bit patterns as unsigned integers orders every finite
    value, then +Inf, then NaN, exactly like the kernels' reduction.
    """
    bits = f32_bits(x) & jnp.uint32(0x7FFFFFFF)
    return bits_f32(jnp.max(bits, axis=axis, keepdims=keepdims))


def is_finite(x: jax.Array) -> jax.Array:
    return (f32_bits(x) & jnp.uint32(0x7F800000)) != jnp.uint32(0x7F800000)


def cast_fp8(x: jax.Array, dtype) -> jax.Array:
    """float32 -> FP8, round to nearest even, saturating finite overflow and Inf.

    The rounding is done here on float32 bits, and the final conversion only
    changes the type of a value the FP8 format holds exactly: XLA:GPU's own
    float32 -> FP8 conversion, fused into the computation that produces its
    input, rounds some values differently from XLA:CPU's (seen on an H200 with
    jax 0.11.2), and the reference must give the same bits on every backend.
    """
    m = fp8_max(dtype)
    mantissa_bits = jnp.finfo(dtype).nmant
    smallest_normal = float(jnp.finfo(dtype).smallest_normal)
    xf = jnp.clip(x.astype(jnp.float32), -m, m)
    bits = f32_bits(xf)
    mag = bits & jnp.uint32(0x7FFFFFFF)
    shift = 23 - mantissa_bits
    # Normal range: round the magnitude's bits to the format's mantissa (ties to even); <= m after the clip.
    normal = (mag + jnp.uint32((1 << (shift - 1)) - 1) + ((mag >> shift) & jnp.uint32(1))) & jnp.uint32(
        (0xFFFFFFFF << shift) & 0xFFFFFFFF)
    # Subnormal range: multiples of the smallest subnormal (powers of two scale exactly; round is ties-to-even).
    quantum = smallest_normal * 2.0**-mantissa_bits
    sub = f32_bits(jnp.round(bits_f32(mag) * np.float32(1 / quantum)) * np.float32(quantum))
    rounded = jnp.where(bits_f32(mag) < np.float32(smallest_normal), sub, normal)
    rounded = jnp.where(mag > jnp.uint32(0x7F800000), mag, rounded)  # NaN stays NaN
    return bits_f32(rounded | (bits & jnp.uint32(0x80000000))).astype(dtype)


def scale_from_amax(amax, fp8_max_value: float, epsilon: float = 0.0, power_2: bool = False):
    """``min(fp8_max / max(amax, epsilon), 2^126)``; 1 for 0 or non-finite amax."""
    amax = jnp.asarray(amax, jnp.float32)
    a = jnp.where(amax > jnp.float32(epsilon), amax, jnp.float32(epsilon))
    scale = jnp.float32(fp8_max_value) / jnp.where(a == 0, jnp.float32(1), a)
    scale = jnp.where(scale <= MAX_SCALE, scale, MAX_SCALE)
    if power_2:
        scale = bits_f32(f32_bits(scale) & jnp.uint32(0xFF800000))
    return jnp.where(is_finite(amax) & (a != 0), scale, jnp.float32(1))


def reciprocal(x: jax.Array) -> jax.Array:
    return jnp.float32(1) / x.astype(jnp.float32)


# ---- E8M0 (MXFP8 block scales) -------------------------------------------------


def e8m0_from_amax(amax: jax.Array, fp8_max_value: float) -> jax.Array:
    """Smallest power of two 2^(code-127) >= amax * (1/fp8_max), as a uint8 code."""
    t = amax.astype(jnp.float32) * jnp.float32(1.0 / fp8_max_value)
    b = f32_bits(t)
    exp_field = b >> 23
    mant = b & jnp.uint32(0x7FFFFF)
    normal = exp_field + (mant != 0).astype(jnp.uint32)
    subnormal = (mant > jnp.uint32(0x400000)).astype(jnp.uint32)
    code = jnp.minimum(jnp.where(exp_field == 0, subnormal, normal), jnp.uint32(254))
    return jnp.where(is_finite(amax), code, jnp.uint32(255)).astype(jnp.uint8)


def e8m0_to_float(code: jax.Array) -> jax.Array:
    c = code.astype(jnp.uint32)
    value = jnp.where(c == 0, bits_f32(jnp.uint32(0x00400000)), bits_f32(c << 23))
    return jnp.where(c == 255, jnp.float32(jnp.nan), value)


def e8m0_inverse_to_float(code: jax.Array) -> jax.Array:
    """2^(127-code), the multiplier that maps a block onto the FP8 grid."""
    c = code.astype(jnp.uint32)
    e = jnp.uint32(254) - jnp.minimum(c, jnp.uint32(254))
    value = jnp.where(e == 0, bits_f32(jnp.uint32(0x00400000)), bits_f32(e << 23))
    return jnp.where(c == 255, jnp.float32(jnp.nan), value)


# ---- E2M1 (NVFP4 elements) --------------------------------------------------------

_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _sign_nibble(x: jax.Array) -> jax.Array:
    """The E2M1 sign bit; NaN gets none (its code is 0 whatever the NaN's sign)."""
    sign = (f32_bits(x) >> 28) & jnp.uint32(8)
    return jnp.where(jnp.isnan(x), jnp.uint32(0), sign).astype(jnp.uint8)


def e2m1_rne(x: jax.Array) -> jax.Array:
    """float32 -> E2M1 code (uint8, sign in bit 3), nearest-even, saturating at 6.

    NaN gives the code 0 (E2M1 has no NaN; the block scale carries it).
    """
    a = bits_f32(f32_bits(x) & jnp.uint32(0x7FFFFFFF))
    mag = sum(
        (a > t).astype(jnp.uint8) for t in (0.25, 1.25, 2.5, 5.0)
    ) + sum((a >= t).astype(jnp.uint8) for t in (0.75, 1.75, 3.5))
    return _sign_nibble(x) | mag.astype(jnp.uint8)


def e2m1_stochastic(x: jax.Array, random_bits: jax.Array) -> jax.Array:
    """float32 -> E2M1 code with stochastic rounding driven by uint32 random bits.

    Rounds |x| up to the next grid point when ``(bits >> 8) * 2^-24 < frac``,
    frac being |x|'s distance above the lower grid point in grid spacings.
    """
    a = bits_f32(f32_bits(x) & jnp.uint32(0x7FFFFFFF))
    inv_spacing = jnp.where(a < 2, jnp.float32(2), jnp.where(a < 4, jnp.float32(1), jnp.float32(0.5)))
    offset = jnp.where(a < 2, 0, jnp.where(a < 4, 2, 4)).astype(jnp.uint32)
    t = a * inv_spacing
    lower = jnp.floor(t)
    frac = t - lower
    u = (random_bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
    steps = jnp.where(a < 6, lower, 0).astype(jnp.uint32) + (u < frac).astype(jnp.uint32)
    mag = jnp.where(a >= 6, jnp.uint32(7), steps + offset)
    mag = jnp.where(jnp.isnan(a), jnp.uint32(0), mag)
    return _sign_nibble(x) | mag.astype(jnp.uint8)


def e2m1_to_float(code: jax.Array) -> jax.Array:
    mag = jnp.asarray(_E2M1_VALUES)[(code & 7).astype(jnp.int32)]
    return jnp.where((code & 8) != 0, -mag, mag)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Pack pairs of 4-bit codes along the last axis: element 2j in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    low = packed & jnp.uint8(0xF)
    high = packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---- NVFP4 scales ----------------------------------------------------------------


def nvfp4_global_encode_scale(global_amax: jax.Array) -> jax.Array:
    """S_enc = 448*6 / global_amax (1 for 0 or non-finite amax), at most 2^126."""
    amax = jnp.asarray(global_amax, jnp.float32)
    ok = is_finite(amax) & (amax != 0)
    s = jnp.float32(E4M3_MAX * E2M1_MAX) / jnp.where(ok, amax, jnp.float32(1))
    s = jnp.where(s <= MAX_SCALE, s, MAX_SCALE)
    return jnp.where(ok, s, jnp.float32(1))


def nvfp4_block_scale(block_amax: jax.Array, global_encode: jax.Array) -> jax.Array:
    """E4M3 block scale s_b = e4m3(block_amax * (S_enc * (1/6)))."""
    factor = global_encode * jnp.float32(1.0 / 6.0)
    return cast_fp8(block_amax * factor, jnp.float8_e4m3fn)


def nvfp4_block_encode(block_scale: jax.Array, global_decode: jax.Array) -> jax.Array:
    """min(1/(s_b * S_dec), FLT_MAX), NaN kept."""
    inv = jnp.float32(1) / (block_scale.astype(jnp.float32) * global_decode)
    return jnp.where(inv > F32_MAX, F32_MAX, inv)


# ---- random bits and the Hadamard transform ------------------------------------


def mix32(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def stream_seed(key_words: jax.Array, stream: int) -> jax.Array:
    """Per-(key, stream) seed from the two uint32 words of a JAX PRNG key."""
    k0 = key_words[..., 0].astype(jnp.uint32)
    k1 = key_words[..., 1].astype(jnp.uint32)
    return mix32(k0 ^ mix32(k1 + jnp.uint32(stream) * jnp.uint32(0x9E3779B9)))


def random_bits(seed: jax.Array, index: jax.Array) -> jax.Array:
    seed = seed.astype(jnp.uint32)
    return mix32(mix32(index.astype(jnp.uint32) + seed) ^ seed)


def rht16(x: jax.Array) -> jax.Array:
    """Random Hadamard transform on consecutive groups of 16 along the last axis.

    Sign flips by RHT_SIGN_MASK, the Walsh-Hadamard butterfly with strides
    1, 2, 4, 8 (this order of float32 additions is part of the spec), then 1/4.
    """
    shape = x.shape
    v = x.astype(jnp.float32).reshape(*shape[:-1], shape[-1] // 16, 16)
    v = v * _rht_signs()
    h = 1
    while h < 16:
        # View the 16 lanes as (16 / 2h, 2, h): pairs (j, j + h) sit on axis -2.
        w = v.reshape(*v.shape[:-1], 16 // (2 * h), 2, h)
        a, b = w[..., 0, :], w[..., 1, :]
        v = jnp.stack([a + b, a - b], axis=-2).reshape(v.shape)
        h *= 2
    return (v * jnp.float32(0.25)).reshape(shape)


def _rht_signs() -> np.ndarray:
    return np.array([-1.0 if (RHT_SIGN_MASK >> i) & 1 else 1.0 for i in range(16)], np.float32)


def _times_signs(x: jax.Array) -> jax.Array:
    shape = x.shape
    return (x.reshape(*shape[:-1], shape[-1] // 16, 16) * _rht_signs()).reshape(shape)


def inverse_rht16(y: jax.Array) -> jax.Array:
    """Undo ``rht16`` (H D / 4 with H^2 = 16 I): D H y / 4."""
    return _times_signs(rht16(_times_signs(y.astype(jnp.float32))))
