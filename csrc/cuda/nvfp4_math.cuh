// Per-element NVFP4 math for the CUDA kernels, restructured for fewer
// instructions but bit-identical to the spec in ../common/numerics.h
// (FloatToE2M1, FloatToE2M1Stochastic, RandomBits). Everything is
// __host__ __device__ so that tests/host test programs can check it against
// numerics.h; the device build uses the directed-rounding intrinsics.
//
// Domain: the E2M1 magnitude functions take v = x * enc of a block whose
// amax is not NaN. Such a product is never NaN (x is finite or +-Inf, enc is
// positive and finite) and, under FTZ, never subnormal. The kernels handle a
// NaN block (every element's code is 0, see numerics.h FloatToE2M1) by
// zeroing the packed words of the block, and take the sign from x: enc > 0,
// so sign(x * enc) == sign(x), -0 included.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../common/numerics.h"

#if !defined(__CUDA_ARCH__)
#include <cfenv>
#include <cmath>
#endif

namespace te_jax {
namespace nvfp4 {

// ---- helpers with a host twin -------------------------------------------------------

// fma(a, b, c) and a + b rounded toward +Inf.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float FmaRu(float a, float b, float c) { return __fmaf_ru(a, b, c); }
__device__ __forceinline__ float AddRu(float a, float b) { return __fadd_ru(a, b); }
#elif defined(TE_NVFP4_HOST_CALLER_ROUNDS_UP)
// Host tests that run under fesetround(FE_UPWARD) themselves (every other
// operation in this file is exact or a comparison). Build with -frounding-math.
inline float FmaRu(float a, float b, float c) { return std::fma(a, b, c); }
inline float AddRu(float a, float b) {
  volatile float x = a;
  return x + b;
}
#else
// Host twins (host tests only; slow). Build with -frounding-math.
inline float FmaRu(float a, float b, float c) {
  const int mode = std::fegetround();
  std::fesetround(FE_UPWARD);
  volatile float r = std::fma(a, b, c);
  std::fesetround(mode);
  return r;
}
inline float AddRu(float a, float b) {
  const int mode = std::fegetround();
  std::fesetround(FE_UPWARD);
  volatile float x = a;
  volatile float r = x + b;
  std::fesetround(mode);
  return r;
}
#endif

// (hi << 1) | (lo >> 31): shifts the sign bit of `lo` into `hi`.
TE_HD uint32_t ShiftInSign(uint32_t hi, uint32_t lo) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(lo, hi, 1);
#else
  return (hi << 1) | (lo >> 31);
#endif
}

// __byte_perm (default mode, selector nibbles 0..7 only).
TE_HD uint32_t BytePerm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = (uint64_t{b} << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
#endif
}

TE_HD uint32_t UMax(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return max(a, b);
#else
  return a > b ? a : b;
#endif
}

// x >> kS. On the device, unless TE_NVFP4_SHIFTS_ON_ALU is defined, as
// __umulhi(x, 2^(32 - kS)) (IMAD.HI): the same bits, computed on the FMA
// pipe instead of the integer ALU, which the stochastic-rounding kernel
// otherwise saturates (the hash is mostly shifts and xors).
template <int kS>
TE_HD uint32_t ShrAlt(uint32_t x) {
#if defined(__CUDA_ARCH__) && !defined(TE_NVFP4_SHIFTS_ON_ALU)
  return __umulhi(x, 1u << (32 - kS));
#else
  return x >> kS;
#endif
}

// a * b + c as one integer multiply-add (the compiler otherwise splits
// acc * 8 + code into a shift and an OR on the integer ALU).
TE_HD uint32_t Mad(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return a * b + c;
#endif
}

// Max of AbsBits over the float32 bit patterns seen so far, kept as the
// signed and the unsigned maximum of the raw patterns: the signed max is the
// largest non-negative pattern if there is one, the unsigned max the
// negative pattern of largest magnitude if there is one, so
// max(AbsBits(smax), AbsBits(umax)) is the max of AbsBits (one 3-input max
// per two elements each, no masking).
struct AbsMaxAcc {
  int32_t smax = INT32_MIN;
  uint32_t umax = 0u;
  TE_HD void Add2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
    smax = __vimax3_s32(smax, static_cast<int32_t>(a), static_cast<int32_t>(b));
    umax = __vimax3_u32(umax, a, b);
#else
    smax = std::max(smax, std::max(static_cast<int32_t>(a), static_cast<int32_t>(b)));
    umax = std::max(umax, std::max(a, b));
#endif
  }
  TE_HD uint32_t Result() const {
    const uint32_t p = static_cast<uint32_t>(smax) & 0x7fffffffu, n = umax & 0x7fffffffu;
    return p > n ? p : n;
  }
};

// ---- random bits ------------------------------------------------------------------

// Per-stream constant of RandomBitsFast: seed ^ (seed >> 16).
TE_HD uint32_t SeedFold(uint32_t seed) { return seed ^ (seed >> 16); }

// RandomBits(seed, index) = Mix32(Mix32(index + seed) ^ seed) with the middle
// rewritten: after the inner Mix32's second multiply x2, the spec computes
// y = x2 ^ (x2 >> 16) ^ seed and the outer Mix32 starts with y ^ (y >> 16).
// Since (x2 ^ (x2 >> 16)) >> 16 == x2 >> 16, that is x2 ^ seed ^ (seed >> 16)
// = x2 ^ fold: two shifts and three xors become one xor.
// This takes x = index + seed already added.
TE_HD uint32_t RandomBitsOfSum(uint32_t x, uint32_t fold) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= ShrAlt<15>(x);
  x *= 0x846ca68bu;
  x ^= fold;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// RandomBits(seed, index), with fold = SeedFold(seed).
TE_HD uint32_t RandomBitsFast(uint32_t seed, uint32_t fold, uint32_t index) {
  return RandomBitsOfSum(index + seed, fold);
}

// ---- E2M1 magnitudes ----------------------------------------------------------------
//
// Let a = min(|v|, 6) and E' = max(biased exponent of a, 127), so that the
// E2M1 grid spacing at a is s = 2^(E' - 128) (0.5 below 2, 1 below 4, 2 from
// 4 on) and the code of a grid point g is g / s + 2 (E' - 127).
// t = a / s = a * 2^(128 - E') is exact and below 4; clamping at 6 (t = 3 in
// the top binade, code 7) makes the saturation implicit: no code exceeds 7.
// Both functions return the code plus a constant bias (the float bits of a
// sum around 2^23); EncodeN removes the biases of a packed word at once.

constexpr uint32_t kRneBias = 0x4b000000u;  // bits of 2^23
constexpr uint32_t kSrBias = 0x4b000001u;   // bits of 2^23 + 1

// FloatToE2M1's magnitude + kRneBias: t + (2^23 + 2 (E' - 127)) rounds t to
// an integer (RNE; the addend is even, so ties go to an even t-step, which is
// an even code) and adds the code offset. The (contracted) fma rounds once,
// as the exact product and a separate add would.
TE_HD uint32_t RneCodeBiased(float v) {
  const float a = fminf(fabsf(v), 6.0f);
  const uint32_t e = UMax(ShrAlt<23>(FloatBits(a)), 127u);
  const float inv_s = BitsFloat(Mad(e, 0u - (1u << 23), 255u << 23));  // (255 - e) << 23
  const float k = BitsFloat(Mad(e, 2u, kRneBias - 254u));               // 2^23 + 2 (E' - 127)
  return FloatBits(a * inv_s + k);
}

// FloatToE2M1Stochastic's magnitude + kSrBias, with random bits `rnd` (only
// the top 24 bits count: u = (rnd >> 8) 2^-24). The spec rounds t up iff
// u < frac(t), i.e. takes ceil(t - u) steps. w = RU(t - u) keeps that
// ceiling (the integers around it are floats), and
// RU(w + 2^23 + 1 + 2 (E' - 127)) = 2^23 + 1 + 2 (E' - 127) + ceil(w)
// exactly (spacing 1 there). t - u is formed exactly inside the fma:
// (rnd & ~0xff) is exact as a float and times 2^-32 is u.
TE_HD uint32_t SrCodeBiased(float v, uint32_t rnd) {
  const float a = fminf(fabsf(v), 6.0f);
  const uint32_t e = UMax(ShrAlt<23>(FloatBits(a)), 127u);
  const float inv_s = BitsFloat(Mad(e, 0u - (1u << 23), 255u << 23));
  const float k1 = BitsFloat(Mad(e, 2u, kSrBias - 254u));
  const float t = a * inv_s;
  const float u32 = static_cast<float>(rnd & 0xffffff00u);
  const float w = FmaRu(u32, -2.3283064365386962890625e-10f, t);  // -2^-32
  return FloatBits(AddRu(w, k1));
}

// The magnitudes alone (host tests).
TE_HD uint32_t MagRne(float v) { return RneCodeBiased(v) - kRneBias; }
TE_HD uint32_t MagSr(float v, uint32_t rnd) { return SrCodeBiased(v, rnd) - kSrBias; }

// Packs n codes, element 0 in the low nibble: for k = n-1 down to 0,
// acc = ((acc << 1) | sign_k) * 8 + (code_k + bias). Every step is linear
// mod 2^32, so the biases come off at the end: bias * (1 + 16 + ... 16^(n-1)).
// `x` gives the signs.
template <int kN, bool kSR>
TE_HD uint32_t EncodeN(const float* x, float enc, uint32_t seed, uint32_t fold, uint32_t index0) {
  uint32_t acc = 0;
  const uint32_t sum0 = index0 + seed;
TE_UNROLL
  for (int k = kN - 1; k >= 0; --k) {
    const float v = x[k] * enc;
    const uint32_t z =
        kSR ? SrCodeBiased(v, RandomBitsOfSum(sum0 + static_cast<uint32_t>(k), fold)) : RneCodeBiased(v);
    acc = Mad(ShiftInSign(acc, FloatBits(x[k])), 8u, z);
  }
  constexpr uint32_t kOnes = kN == 8 ? 0x11111111u : (kN == 4 ? 0x1111u : 0x11u);
  return acc - (kSR ? kSrBias : kRneBias) * kOnes;
}

// ---- nibble transpose ----------------------------------------------------------------

// 8x8 nibble transpose: on entry x[r] holds row r (nibble c = column c); on
// exit x[c] holds column c (nibble r = row r).
TE_HD void TransposeNibbles8x8(uint32_t (&x)[8]) {
TE_UNROLL
  for (int r = 0; r < 4; ++r) {  // 4x4 blocks: 16-bit halves
    const uint32_t a = x[r], b = x[r + 4];
    x[r] = BytePerm(a, b, 0x5410u);
    x[r + 4] = BytePerm(a, b, 0x7632u);
  }
TE_UNROLL
  for (int r = 0; r < 8; r += 4) {  // 2x2 blocks: bytes
TE_UNROLL
    for (int q = 0; q < 2; ++q) {
      const uint32_t a = x[r + q], b = x[r + q + 2];
      x[r + q] = BytePerm(a, b, 0x6240u);
      x[r + q + 2] = BytePerm(a, b, 0x7351u);
    }
  }
TE_UNROLL
  for (int r = 0; r < 8; r += 2) {  // single nibbles
    const uint32_t a = x[r], b = x[r + 1];
    x[r] = (a & 0x0f0f0f0fu) | ((b << 4) & 0xf0f0f0f0u);
    x[r + 1] = ((a >> 4) & 0x0f0f0f0fu) | (b & 0xf0f0f0f0u);
  }
}

}  // namespace nvfp4
}  // namespace te_jax
