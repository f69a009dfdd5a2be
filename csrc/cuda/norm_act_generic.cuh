// The generic kernels of the fused norm/activation casts: any shape (widths
// not a multiple of 8, unaligned buffers), one thread per block or element
// per copy, the mode chosen at run time; correct but slow. The producer
// contract and the cast arguments are in norm_act_kernels.cuh.
#pragma once

#include "norm_act_kernels.cuh"

namespace te_jax {
namespace cuda {
namespace fused {

// Rowwise copy (and, per-tensor, the columnwise copy), or the amax (stats):
// one thread per unit = block (block modes) or element. Mode chosen at run time.
template <class P>
__global__ void __launch_bounds__(kThreads) GenericRowKernel(P prod, CastArgs a, int mode, int64_t units) {
  __shared__ uint32_t scratch[kThreads / 32];
  const int64_t id = int64_t{blockIdx.x} * kThreads + threadIdx.x;  // unit within batch element b
  const int64_t b = blockIdx.y;
  const int64_t per_b = a.rows * a.cols;
  const int blk = mode == kModeMx ? 32 : (mode == kModeBlock ? 128 : (mode == kModeNv ? 16 : 1));
  const int64_t units_per_b = per_b / blk;
  uint32_t amax_bits = 0;
  const BatchCtx ctx = MakeCtx(a, mode, b, id == 0);
  if (id < units) {
    const int64_t e0 = id * blk;  // first element of the unit
    const int64_t r = e0 / a.cols, c0 = e0 % a.cols;
    if (mode == kModeNone) {
      StoreOut1(a.q, b * per_b + e0, prod.Load1(b, r, c0), a.out_type);
    } else if (mode == kModeTensor || mode == kModeStats) {
      const float v = prod.Load1(b, r, c0);
      amax_bits = AbsBits(v);
      if (mode == kModeTensor) {
        const uint8_t code = static_cast<uint8_t>(Fp8Code(v * ctx.scale, a.e5));
        if (a.q) static_cast<uint8_t*>(a.q)[b * per_b + e0] = code;
        if (a.q_t) static_cast<uint8_t*>(a.q_t)[b * per_b + c0 * a.rows + r] = code;
      }
    } else {
      uint32_t m = 0;
      for (int k = 0; k < blk; ++k) m = max(m, AbsBits(prod.Load1(b, r, c0 + k)));
      uint8_t* q = static_cast<uint8_t*>(a.q);
      if (mode == kModeNv) {
        const uint8_t sb = Nvfp4BlockScale(BitsToF(m), ctx.factor);
        const float enc = Nvfp4BlockEncode(sb, ctx.s_dec);
        static_cast<uint8_t*>(a.s)[b * units_per_b + id] = sb;
        for (int k = 0; k < blk; k += 2) {
          const uint32_t i0 = static_cast<uint32_t>(e0 + k);
          const uint32_t lo = E2M1Code(prod.Load1(b, r, c0 + k) * enc, a.key != nullptr, ctx.seed, i0);
          const uint32_t hi = E2M1Code(prod.Load1(b, r, c0 + k + 1) * enc, a.key != nullptr, ctx.seed, i0 + 1);
          q[(b * per_b + e0 + k) / 2] = static_cast<uint8_t>(lo | (hi << 4));
        }
      } else {
        const float fmax = a.e5 ? kE5M2Max : kE4M3Max;
        float mult;
        if (mode == kModeMx) {
          const uint8_t code = E8M0FromAmax(BitsToF(m), fmax);
          static_cast<uint8_t*>(a.s)[b * units_per_b + id] = code;
          mult = E8M0InverseToFloat(code);
        } else {
          mult = ScaleFromAmax(BitsToF(m), fmax, 0.0f, a.power_2);
          static_cast<float*>(a.s)[b * units_per_b + id] = 1.0f / mult;
        }
        for (int k = 0; k < blk; ++k) q[b * per_b + e0 + k] = static_cast<uint8_t>(Fp8Code(prod.Load1(b, r, c0 + k) * mult, a.e5));
      }
    }
  }
  if (mode == kModeStats && a.amax_acc) BlockMaxToGlobal(amax_bits, scratch, a.amax_acc + b);
  if (mode == kModeTensor && a.amax_out) BlockMaxToGlobal(amax_bits, scratch, a.amax_out + b);
}

// Columnwise copy of the block modes (blocks along M), or, in kModeStats, the
// amax of the Hadamard-transformed columnwise copy: one thread per (column, block).
template <class P>
__global__ void __launch_bounds__(kThreads) GenericColKernel(P prod, CastArgs a, int mode, int64_t units) {
  __shared__ uint32_t scratch[kThreads / 32];
  const int64_t id = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int64_t b = blockIdx.y;
  const int blk = mode == kModeMx ? 32 : (mode == kModeBlock ? 128 : 16);
  const int64_t per_b = a.rows * a.cols;
  const int64_t bpc = a.rows / blk;  // blocks per column
  const BatchCtx ctx = MakeCtx(a, mode == kModeStats ? kModeNone : mode, b, false);
  uint32_t amax_bits = 0;
  if (id < units) {
    const int64_t c = id / bpc, r0 = (id % bpc) * blk;
    if (mode == kModeNv || mode == kModeStats) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = prod.Load1(b, r0 + i, c);
      if (a.rht) Rht16(v);
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max(m, AbsBits(v[i]));
      amax_bits = m;
      if (mode == kModeNv) {
        const uint8_t sb = Nvfp4BlockScale(BitsToF(m), ctx.factor_t);
        const float enc = Nvfp4BlockEncode(sb, ctx.s_dec_t);
        static_cast<uint8_t*>(a.s_t)[b * (per_b / 16) + id] = sb;
        uint8_t* qt = static_cast<uint8_t*>(a.q_t);
#pragma unroll
        for (int i = 0; i < 16; i += 2) {
          const uint32_t i0 = static_cast<uint32_t>(c * a.rows + r0 + i);
          const uint32_t lo = E2M1Code(v[i] * enc, a.key != nullptr, ctx.seed_t, i0);
          const uint32_t hi = E2M1Code(v[i + 1] * enc, a.key != nullptr, ctx.seed_t, i0 + 1);
          qt[(b * per_b + c * a.rows + r0 + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
    } else {
      uint32_t m = 0;
      for (int i = 0; i < blk; ++i) m = max(m, AbsBits(prod.Load1(b, r0 + i, c)));
      const float fmax = a.e5 ? kE5M2Max : kE4M3Max;
      float mult;
      if (mode == kModeMx) {
        const uint8_t code = E8M0FromAmax(BitsToF(m), fmax);
        static_cast<uint8_t*>(a.s_t)[b * (per_b / blk) + id] = code;
        mult = E8M0InverseToFloat(code);
      } else {
        mult = ScaleFromAmax(BitsToF(m), fmax, 0.0f, a.power_2);
        static_cast<float*>(a.s_t)[b * (per_b / blk) + id] = 1.0f / mult;
      }
      uint8_t* qt = static_cast<uint8_t*>(a.q_t);
      for (int i = 0; i < blk; ++i) {
        qt[b * per_b + c * a.rows + r0 + i] = static_cast<uint8_t>(Fp8Code(prod.Load1(b, r0 + i, c) * mult, a.e5));
      }
    }
  }
  if (mode == kModeStats) BlockMaxToGlobal(amax_bits, scratch, a.amax_t_acc + b);
}

// dbias partials: one thread per (64-row group, column) sums its rows.
template <class P>
__global__ void __launch_bounds__(kThreads) GenericDbiasKernel(P prod, CastArgs a, int64_t units) {
  const int64_t id = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int64_t b = blockIdx.y;
  if (id >= units) return;
  const int64_t groups = (a.rows + kDbiasRows - 1) / kDbiasRows;
  const int64_t g = id / a.cols, c = id % a.cols;
  float sum = 0.0f;
  const int64_t r1 = a.rows < (g + 1) * kDbiasRows ? a.rows : (g + 1) * kDbiasRows;
  for (int64_t r = g * kDbiasRows; r < r1; ++r) sum += prod.Load1(b, r, c);
  a.dbias_ws[(b * groups + g) * a.cols + c] = sum;
}

}  // namespace fused
}  // namespace cuda
}  // namespace te_jax
