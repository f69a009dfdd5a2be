// Scalar numerics shared by the CPU and CUDA kernels.
//
// Every function here is the C++ twin of a function in
// te_jax/quantize/numerics.py; together they are the bit-level spec of the
// quantization formats (see docs/numerics.md). Everything works on
// float32 values and integer codes, so host and device give the same bits.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define TE_HD __host__ __device__ __forceinline__
#else
#define TE_HD inline
#endif
#if defined(__CUDA_ARCH__)
#define TE_UNROLL _Pragma("unroll")
#else
#define TE_UNROLL
#endif

namespace te_jax {

// The bits of a float32 as uint32, or the other way round: the device's
// intrinsics there, memcpy on the host.
template <typename To, typename From>
TE_HD To BitCast(From v) {
  static_assert(sizeof(To) == 4 && sizeof(From) == 4, "BitCast converts between float and uint32_t");
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<To, uint32_t>) {
    return __float_as_uint(v);
  } else {
    return __uint_as_float(v);
  }
#else
  To out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
#endif
}

TE_HD uint32_t FloatBits(float f) { return BitCast<uint32_t>(f); }
TE_HD float BitsFloat(uint32_t u) { return BitCast<float>(u); }

TE_HD bool IsFiniteF(float f) { return (FloatBits(f) & 0x7f800000u) != 0x7f800000u; }
TE_HD bool IsNanF(float f) { return (FloatBits(f) & 0x7fffffffu) > 0x7f800000u; }

// |x| as ordered bits: unsigned comparison of these orders every finite value,
// then +Inf, then every NaN. The max over a tensor is the NaN-propagating amax.
TE_HD uint32_t AbsBits(float f) { return FloatBits(f) & 0x7fffffffu; }

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kE2M1Max = 6.0f;

// FP8 format descriptor: mantissa bits, exponent bias and the largest finite code.
struct Fp8Format {
  int mant_bits;
  int bias;
  uint32_t max_code;  // magnitude code of the largest finite value
  float max_value;
};
constexpr Fp8Format kE4M3{3, 7, 0x7eu, kE4M3Max};
constexpr Fp8Format kE5M2{2, 15, 0x7bu, kE5M2Max};

// float32 -> FP8 with round-to-nearest-even. Finite overflow and +-Inf
// saturate to +-max; NaN gives a NaN code (0x7f, sign kept); -0 gives 0x80.
TE_HD uint8_t FloatToFp8(float x, Fp8Format fmt) {
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  const int min_normal_exp = 1 - fmt.bias;  // unbiased exponent of the smallest normal
  const uint32_t min_normal_bits = static_cast<uint32_t>(min_normal_exp + 127) << 23;
  uint32_t code;
  if (a < min_normal_bits) {
    // Subnormal range of the FP8 format: multiples of 2^(min_normal_exp - mant_bits).
    // Scaling by a power of two is exact; rintf rounds half to even.
    const float steps = BitsFloat(a) * BitsFloat(static_cast<uint32_t>(127 - min_normal_exp + fmt.mant_bits) << 23);
    code = static_cast<uint32_t>(rintf(steps));
  } else {
    const int shift = 23 - fmt.mant_bits;
    const uint32_t half_minus_one = (1u << (shift - 1)) - 1u;
    const uint32_t odd = (a >> shift) & 1u;
    const uint32_t rounded = (a + half_minus_one + odd) >> shift;  // carries into the exponent
    const uint32_t rebias = static_cast<uint32_t>(127 - fmt.bias) << fmt.mant_bits;
    code = (a >= 0x7f800000u) ? 0xffu : rounded - rebias;
  }
  if (code > fmt.max_code) code = fmt.max_code;
  return static_cast<uint8_t>(sign | code);
}

// FP8 code -> float32 (exact). NaN codes give NaN.
TE_HD float Fp8ToFloat(uint8_t c, Fp8Format fmt) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t mag = c & 0x7fu;
  const uint32_t exp_field = mag >> fmt.mant_bits;
  const uint32_t mant = mag & ((1u << fmt.mant_bits) - 1u);
  const uint32_t exp_all_ones = (1u << (7 - fmt.mant_bits)) - 1u;
  if (fmt.mant_bits == 3 && mag == 0x7fu) return BitsFloat(sign | 0x7fc00000u);
  if (fmt.mant_bits == 2 && exp_field == exp_all_ones) {
    return BitsFloat(sign | (mant ? 0x7fc00000u : 0x7f800000u));
  }
  if (exp_field == 0) {
    // mant * 2^(1 - bias - mant_bits), exact in float32.
    const float unit = BitsFloat(static_cast<uint32_t>(127 + 1 - fmt.bias - fmt.mant_bits) << 23);
    return BitsFloat(sign | FloatBits(static_cast<float>(mant) * unit));
  }
  const uint32_t bits = ((exp_field + 127u - fmt.bias) << 23) | (mant << (23 - fmt.mant_bits));
  return BitsFloat(sign | bits);
}

// E2M1 magnitudes by code: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
TE_HD float E2M1ToFloat(uint8_t c) {
  const uint32_t mag = c & 0x7u;
  const float m = (mag < 4u) ? 0.5f * static_cast<float>(mag)
                             : (mag < 6u ? static_cast<float>(mag - 2u) : (mag == 6u ? 4.0f : 6.0f));
  return (c & 0x8u) ? -m : m;
}

// float32 -> E2M1 code (4 bits, sign in bit 3), round to nearest even,
// saturating to +-6. NaN gives the code 0 (E2M1 has no NaN; the block scale
// carries it).
TE_HD uint8_t FloatToE2M1(float x) {
  const uint32_t sign = IsNanF(x) ? 0u : (FloatBits(x) >> 28) & 0x8u;
  const float a = BitsFloat(AbsBits(x));
  // Ties go to the even code: up at 0.75, 1.75, 3.5; down at 0.25, 1.25, 2.5, 5.
  const uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                       (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(sign | mag);
}

// float32 -> E2M1 code with stochastic rounding. `random` is 32 uniform bits;
// its top 24 bits u decide: round |x| up to the next grid point when
// u * 2^-24 < frac, where frac is |x|'s distance above the lower grid point in
// units of the grid spacing. Every step is exact in float32. |x| >= 6
// saturates; NaN gives the code 0.
TE_HD uint8_t FloatToE2M1Stochastic(float x, uint32_t random) {
  const uint32_t sign = IsNanF(x) ? 0u : (FloatBits(x) >> 28) & 0x8u;
  const float a = BitsFloat(AbsBits(x));
  if (IsNanF(a)) return static_cast<uint8_t>(sign);
  if (a >= 6.0f) return static_cast<uint8_t>(sign | 0x7u);
  const float inv_spacing = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const uint32_t code_offset = a < 2.0f ? 0u : (a < 4.0f ? 2u : 4u);
  const float t = a * inv_spacing;
  const float lower = floorf(t);
  const float frac = t - lower;
  const float u = static_cast<float>(random >> 8) * 5.9604644775390625e-8f;  // 2^-24
  const uint32_t steps = static_cast<uint32_t>(lower) + (u < frac ? 1u : 0u);
  return static_cast<uint8_t>(sign | (steps + code_offset));
}

// E8M0 scale code for an MXFP8 block: t = amax * (1/fp8_max), rounded up to a
// power of two 2^(code-127). amax 0 gives code 0; non-finite amax gives 0xff (NaN).
TE_HD uint8_t E8M0FromAmax(float amax, float fp8_max) {
  if (!IsFiniteF(amax)) return 0xffu;
  const float t = amax * (1.0f / fp8_max);
  const uint32_t b = FloatBits(t);
  const uint32_t exp_field = b >> 23;
  const uint32_t mant = b & 0x7fffffu;
  uint32_t code;
  if (exp_field == 0) {
    code = (mant > 0x400000u) ? 1u : 0u;  // (2^-127, 2^-126) rounds up to 2^-126
  } else {
    code = exp_field + (mant != 0u ? 1u : 0u);
  }
  return static_cast<uint8_t>(code > 254u ? 254u : code);
}

// 2^(code-127) as float32 (code 0 is the subnormal 2^-127; 0xff is NaN).
TE_HD float E8M0ToFloat(uint8_t code) {
  if (code == 0xffu) return BitsFloat(0x7fc00000u);
  if (code == 0u) return BitsFloat(0x00400000u);
  return BitsFloat(static_cast<uint32_t>(code) << 23);
}

// 2^(127-code): the multiplier that maps a block onto the FP8 grid.
TE_HD float E8M0InverseToFloat(uint8_t code) {
  if (code == 0xffu) return BitsFloat(0x7fc00000u);
  const uint32_t e = 254u - code;  // biased exponent of 2^(127-code)
  return e == 0u ? BitsFloat(0x00400000u) : BitsFloat(e << 23);
}

// The largest encode scale: 2^126, so that every decode scale 1/scale is a
// normal float32 (XLA:CPU and CUDA disagree on subnormal results).
constexpr float kMaxScale = 8.507059173023462e37f;  // 2^126

// Per-tensor / per-block FP8 scale from an amax:
// scale = min(fp8_max / max(amax, epsilon), 2^126); 1 when that max is 0 or
// amax is non-finite; power_2 rounds down to 2^k.
TE_HD float ScaleFromAmax(float amax, float fp8_max, float epsilon, bool power_2) {
  if (!IsFiniteF(amax)) return 1.0f;
  const float a = amax > epsilon ? amax : epsilon;
  if (a == 0.0f) return 1.0f;
  float scale = fp8_max / a;
  if (!(scale <= kMaxScale)) scale = kMaxScale;
  if (power_2) scale = BitsFloat(FloatBits(scale) & 0xff800000u);
  return scale;
}

// NVFP4 float32 global encode scale: 448*6/global_amax (1 when the amax is 0
// or non-finite), at most 2^126.
TE_HD float Nvfp4GlobalEncodeScale(float global_amax) {
  if (!IsFiniteF(global_amax) || global_amax == 0.0f) return 1.0f;
  const float s = (kE4M3Max * kE2M1Max) / global_amax;
  return s <= kMaxScale ? s : kMaxScale;
}

// NVFP4 E4M3 block scale code: e4m3(block_amax * (S_enc * (1/6))).
// `block_scale_factor` is S_enc * (1/6), computed once per tensor.
TE_HD uint8_t Nvfp4BlockScale(float block_amax, float block_scale_factor) {
  return FloatToFp8(block_amax * block_scale_factor, kE4M3);
}

// NVFP4 element multiplier: min(1/(s_b * S_dec), FLT_MAX); NaN stays NaN.
TE_HD float Nvfp4BlockEncode(uint8_t block_scale, float global_decode) {
  const float inv = 1.0f / (Fp8ToFloat(block_scale, kE4M3) * global_decode);
  return inv > FLT_MAX ? FLT_MAX : inv;
}

// Counter-based random bits for stochastic rounding: a stream seed from the
// JAX key words and a stream id, then a hash of the element index.
TE_HD uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

TE_HD uint32_t StreamSeed(uint32_t key0, uint32_t key1, uint32_t stream) {
  return Mix32(key0 ^ Mix32(key1 + stream * 0x9e3779b9u));
}

TE_HD uint32_t RandomBits(uint32_t seed, uint32_t index) { return Mix32(Mix32(index + seed) ^ seed); }

// Random stream ids: rowwise and columnwise copies draw independent bits.
constexpr uint32_t kRowwiseStream = 0u;
constexpr uint32_t kColwiseStream = 1u;

// 16-point random Hadamard transform, in place: flip signs by kRhtSignMask
// (bit i set: element i negated), then the iterative Walsh-Hadamard butterfly
// with strides 1, 2, 4, 8 ((a + b, a - b) pairs), then scale by 1/4. The
// order of the float32 additions is part of the spec; the pairs within a stage
// are disjoint, so their order is free. This is the only implementation (CPU
// and CUDA kernels): every loop has a constant trip count and every index is
// a constant once unrolled, so on the device v stays in registers.
constexpr uint32_t kRhtSignMask = 0x5a93u;

// One butterfly stage with stride H.
template <int H>
TE_HD void RhtStage(float (&v)[16]) {
TE_UNROLL
  for (int j = 0; j < 16; ++j) {
    if ((j & H) == 0) {
      const float a = v[j];
      const float b = v[j + H];
      v[j] = a + b;
      v[j + H] = a - b;
    }
  }
}

// The sign flips and the butterfly, without the final 1/4 (an exact scaling,
// which an amax pass can apply once to its maximum).
TE_HD void Rht16Butterfly(float (&v)[16]) {
TE_UNROLL
  for (int i = 0; i < 16; ++i) {
    if ((kRhtSignMask >> i) & 1u) v[i] = -v[i];
  }
  RhtStage<1>(v);
  RhtStage<2>(v);
  RhtStage<4>(v);
  RhtStage<8>(v);
}

TE_HD void Rht16(float (&v)[16]) {
  Rht16Butterfly(v);
TE_UNROLL
  for (int i = 0; i < 16; ++i) v[i] *= 0.25f;
}

// Rht16 of each group of 16 consecutive values of v[0, n) (n a multiple of 16).
inline void Rht16Groups(float* v, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) Rht16(*reinterpret_cast<float(*)[16]>(v + i));
}

}  // namespace te_jax
