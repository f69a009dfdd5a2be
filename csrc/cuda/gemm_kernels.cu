// Small kernels around the cuBLASLt GEMMs (see gemm_kernels.cuh).
//
// All of them are memory-bound elementwise maps written as grid-stride loops
// with 64-bit indices. The dequantize kernels use numerics.h, the bit-level
// spec shared with the CPU handlers, so the emulated operands are exactly the
// reference's dequantized values (rounded to bfloat16, which is exact for
// NVFP4 and for MXFP8 inside bfloat16's range).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "../common/numerics.h"
#include "gemm_kernels.cuh"

namespace te_jax {
namespace gemm {
namespace {

constexpr int kThreads = 256;

int GridFor(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1 << 16)));
}

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t GridStride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__global__ void TransposeScalesKernel(const float* src, float* dst, int64_t batch, int64_t rows, int64_t l,
                                      int64_t dst_stride) {
  const int64_t per = rows * l;
  for (int64_t i = GlobalThread(); i < batch * per; i += GridStride()) {
    const int64_t b = i / per, rem = i % per;
    const int64_t c = rem / rows, r = rem % rows;  // dst index (c, r): coalesced writes
    dst[b * dst_stride + rem] = src[b * per + r * l + c];
  }
}

__global__ void PadScalesKernel(const float* src, float* dst, int64_t batch, int64_t row_blocks, int64_t l,
                                int64_t l4, int64_t dst_stride) {
  const int64_t per = row_blocks * l4;
  for (int64_t i = GlobalThread(); i < batch * per; i += GridStride()) {
    const int64_t b = i / per, rem = i % per;
    const int64_t row = rem / l4, c = rem % l4;
    dst[b * dst_stride + rem] = c < l ? src[(b * row_blocks + row) * l + c] : 0.0f;
  }
}

// One thread per destination byte, so the padding is written (as zeros) too.
// Within a 128x4 tile: offset = (r % 32) * 16 + (r / 32) * 4 + c, tiles row-major.
__global__ void SwizzleScalesKernel(const uint8_t* src, uint8_t* dst, int64_t batch, int64_t rows, int64_t cols,
                                    int64_t tiles_c, int64_t per) {
  for (int64_t i = GlobalThread(); i < batch * per; i += GridStride()) {
    const int64_t b = i / per, off = i % per;
    const int64_t tile = off / 512, within = off % 512;
    const int64_t r = (tile / tiles_c) * 128 + ((within % 16) / 4) * 32 + within / 16;
    const int64_t c = (tile % tiles_c) * 4 + within % 4;
    dst[i] = (r < rows && c < cols) ? src[(b * rows + r) * cols + c] : uint8_t{0};
  }
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two FP8 codes as floats: one conversion instruction to half2 on sm_89 and
// later (E4M3 and E5M2 values are all exact in float16), then two widenings;
// the same floats as numerics.h Fp8ToFloat, except NaN payloads.
__device__ __forceinline__ float2 Fp8PairToFloat2(uint8_t lo, uint8_t hi, const Fp8Format& fmt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const auto two = static_cast<__nv_fp8x2_storage_t>(lo | (static_cast<uint16_t>(hi) << 8));
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, fmt.mant_bits == 2 ? __NV_E5M2 : __NV_E4M3);
  return __half22float2(__half2(h));
#else
  return make_float2(Fp8ToFloat(lo, fmt), Fp8ToFloat(hi, fmt));
#endif
}

// Chunk c of 16 bfloat16 values (8 packed pairs) into out: two 16-byte stores,
// or element by element when the buffers are not 16-byte aligned.
__device__ __forceinline__ void StoreBf16x16(const uint32_t (&packed)[8], uint16_t* out, int64_t c, bool vector_io) {
  if (vector_io) {
    reinterpret_cast<uint4*>(out)[2 * c] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    reinterpret_cast<uint4*>(out)[2 * c + 1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  } else {
    const int64_t e = c * 16;
    for (int j = 0; j < 8; ++j) {
      out[e + 2 * j] = static_cast<uint16_t>(packed[j] & 0xffffu);
      out[e + 2 * j + 1] = static_cast<uint16_t>(packed[j] >> 16);
    }
  }
}

// 16 elements per thread: 16 FP8 codes (one 16-byte load when aligned) -> 16
// bfloat16 (two 16-byte stores). k % 32 == 0, so a chunk has one E8M0 scale.
__global__ void DequantMxfp8Kernel(const uint8_t* q, const uint8_t* s, bool e5m2, uint16_t* out, int64_t rows,
                                   int64_t k, bool vector_io) {
  const Fp8Format fmt = e5m2 ? kE5M2 : kE4M3;
  const int64_t chunks = rows * k / 16;
  for (int64_t c = GlobalThread(); c < chunks; c += GridStride()) {
    const int64_t e = c * 16;
    const float scale = E8M0ToFloat(s[e / 32]);  // row * (k/32) + col/32 == e/32
    uint8_t codes[16];
    if (vector_io) {
      *reinterpret_cast<uint4*>(codes) = reinterpret_cast<const uint4*>(q)[c];
    } else {
      for (int j = 0; j < 16; ++j) codes[j] = q[e + j];
    }
    uint32_t packed[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 f = Fp8PairToFloat2(codes[2 * j], codes[2 * j + 1], fmt);
      packed[j] = PackBf16(f.x * scale, f.y * scale);
    }
    StoreBf16x16(packed, out, c, vector_io);
  }
}

// 16 elements (one NVFP4 block) per thread: 8 packed bytes -> 16 bfloat16.
__global__ void DequantNvfp4Kernel(const uint8_t* q, const uint8_t* s, uint16_t* out, int64_t rows, int64_t k,
                                   bool vector_io) {
  const int64_t chunks = rows * k / 16;
  for (int64_t c = GlobalThread(); c < chunks; c += GridStride()) {
    const int64_t e = c * 16;
    const float scale = Fp8ToFloat(s[c], kE4M3);  // row * (k/16) + col/16 == c
    uint8_t bytes[8];
    if (vector_io) {
      *reinterpret_cast<uint2*>(bytes) = reinterpret_cast<const uint2*>(q)[c];
    } else {
      for (int j = 0; j < 8; ++j) bytes[j] = q[e / 2 + j];
    }
    uint32_t packed[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      packed[j] = PackBf16(E2M1ToFloat(static_cast<uint8_t>(bytes[j] & 0xfu)) * scale,
                           E2M1ToFloat(static_cast<uint8_t>(bytes[j] >> 4)) * scale);
    }
    StoreBf16x16(packed, out, c, vector_io);
  }
}

__global__ void Nvfp4AlphaKernel(const float* a_amax, int64_t a_count, const float* b_amax, int64_t b_count,
                                 float* alpha, float* beta, int64_t count) {
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) {
    const float s_dec_a = 1.0f / Nvfp4GlobalEncodeScale(a_amax[a_count == 1 ? 0 : i]);
    const float s_dec_b = 1.0f / Nvfp4GlobalEncodeScale(b_amax[b_count == 1 ? 0 : i]);
    alpha[i] = s_dec_a * s_dec_b;
    beta[i] = 0.0f;
  }
}

__global__ void SpreadScalarsKernel(const float* src, float* dst, int64_t count, int64_t stride) {
  for (int64_t i = GlobalThread(); i < count; i += GridStride()) dst[i * stride] = src[i];
}

__device__ __forceinline__ float LoadFloat(const void* p, int64_t i, OutType t) {
  switch (t) {
    case OutType::kF32:
      return static_cast<const float*>(p)[i];
    case OutType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return __half2float(static_cast<const __half*>(p)[i]);
  }
}

template <typename OutT>
__device__ __forceinline__ OutT FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) { return __float2half_rn(v); }

template <typename OutT>
__global__ void FinalizeKernel(const float* src, const void* bias, OutType bias_type, OutT* out, int64_t total,
                               int64_t n) {
  for (int64_t i = GlobalThread(); i < total; i += GridStride()) {
    float v = src[i];
    if (bias != nullptr) v += LoadFloat(bias, i % n, bias_type);
    out[i] = FromFloat<OutT>(v);
  }
}

cudaError_t Launched() { return cudaGetLastError(); }

}  // namespace

cudaError_t LaunchTransposeScales(const float* src, float* dst, int64_t batch, int64_t rows, int64_t l,
                                  int64_t dst_stride, cudaStream_t stream) {
  TransposeScalesKernel<<<GridFor(batch * rows * l), kThreads, 0, stream>>>(src, dst, batch, rows, l, dst_stride);
  return Launched();
}

cudaError_t LaunchPadScales(const float* src, float* dst, int64_t batch, int64_t row_blocks, int64_t l,
                            int64_t dst_stride, cudaStream_t stream) {
  const int64_t l4 = (l + 3) / 4 * 4;
  PadScalesKernel<<<GridFor(batch * row_blocks * l4), kThreads, 0, stream>>>(src, dst, batch, row_blocks, l, l4,
                                                                             dst_stride);
  return Launched();
}

int64_t SwizzledScaleBytes(int64_t rows, int64_t cols) { return (rows + 127) / 128 * 128 * ((cols + 3) / 4 * 4); }

cudaError_t LaunchSwizzleScales(const uint8_t* src, uint8_t* dst, int64_t batch, int64_t rows, int64_t cols,
                                cudaStream_t stream) {
  const int64_t per = SwizzledScaleBytes(rows, cols);
  SwizzleScalesKernel<<<GridFor(batch * per), kThreads, 0, stream>>>(src, dst, batch, rows, cols,
                                                                     (cols + 3) / 4, per);
  return Launched();
}

cudaError_t LaunchDequantMxfp8ToBf16(const uint8_t* q, const uint8_t* s, bool e5m2, uint16_t* out,
                                     int64_t rows, int64_t k, cudaStream_t stream) {
  const bool vector_io = reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  DequantMxfp8Kernel<<<GridFor(rows * k / 16), kThreads, 0, stream>>>(q, s, e5m2, out, rows, k, vector_io);
  return Launched();
}

cudaError_t LaunchDequantNvfp4ToBf16(const uint8_t* q, const uint8_t* s, uint16_t* out, int64_t rows,
                                     int64_t k, cudaStream_t stream) {
  const bool vector_io = reinterpret_cast<uintptr_t>(q) % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  DequantNvfp4Kernel<<<GridFor(rows * k / 16), kThreads, 0, stream>>>(q, s, out, rows, k, vector_io);
  return Launched();
}

cudaError_t LaunchNvfp4Alpha(const float* a_amax, int64_t a_count, const float* b_amax, int64_t b_count,
                             float* alpha, float* beta, int64_t count, cudaStream_t stream) {
  Nvfp4AlphaKernel<<<GridFor(count), kThreads, 0, stream>>>(a_amax, a_count, b_amax, b_count, alpha, beta, count);
  return Launched();
}

cudaError_t LaunchSpreadScalars(const float* src, float* dst, int64_t count, cudaStream_t stream) {
  SpreadScalarsKernel<<<GridFor(count), kThreads, 0, stream>>>(src, dst, count,
                                                                kScalarSlotBytes / static_cast<int64_t>(sizeof(float)));
  return Launched();
}

cudaError_t LaunchFinalize(const float* src, const void* bias, OutType bias_type, void* out, OutType out_type,
                           int64_t rows, int64_t n, cudaStream_t stream) {
  const int64_t total = rows * n;
  const int grid = GridFor(total);
  switch (out_type) {
    case OutType::kF32:
      FinalizeKernel<<<grid, kThreads, 0, stream>>>(src, bias, bias_type, static_cast<float*>(out), total, n);
      break;
    case OutType::kBF16:
      FinalizeKernel<<<grid, kThreads, 0, stream>>>(src, bias, bias_type, static_cast<__nv_bfloat16*>(out),
                                                    total, n);
      break;
    default:
      FinalizeKernel<<<grid, kThreads, 0, stream>>>(src, bias, bias_type, static_cast<__half*>(out), total, n);
      break;
  }
  return Launched();
}

}  // namespace gemm
}  // namespace te_jax
