// Device helpers shared by the CUDA FFI handlers: input element types,
// 8-element vector loads, FP8 packing, reductions and launch/error checks
// (the operand checks shared with the CPU handlers: ../common/quantize_checks.h).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

// The XLA FFI headers trip warnings (missing returns after exhaustive
// switches, always_inline on templates) in nvcc's front end and the host
// compiler; they are not ours.
#pragma nv_diag_suppress 940
#pragma nv_diag_suppress 2473
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "../common/quantize_checks.h"
#pragma GCC diagnostic pop
#pragma nv_diag_default 940
#pragma nv_diag_default 2473

// The FP8 conversion instruction needs sm_89 and the warp max reduction
// sm_80; older targets (only reached through PTX JIT) get the same bits from
// numerics.h and shuffles, slower.
#if defined(TE_JAX_SOFT_FP8) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890)
#define TE_JAX_FP8_CVT_SOFT 1
#endif

namespace te_jax {
namespace cuda {

// ---- errors --------------------------------------------------------------------------

inline ffi::Error CudaError(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("te_jax CUDA ") + what + ": " + cudaGetErrorString(e));
}

// Checks the launch just made (bad configuration, missing kernel image, ...).
inline ffi::Error LaunchError(const char* kernel) { return CudaError(cudaGetLastError(), kernel); }

// The calling thread's stream-capture mode relaxed for the guard's lifetime,
// so that host-side work a handler may do while XLA captures it into a CUDA
// graph (setting a kernel attribute, building a GEMM plan) is not refused as
// unsafe during capture.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Raises `kernel`'s dynamic shared memory limit to `bytes` (needed above 48 KiB).
template <typename Kernel>
inline ffi::Error AllowDynamicSmem(Kernel kernel, int bytes) {
  RelaxedCapture relaxed;
  return CudaError(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                   "cudaFuncSetAttribute");
}

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid of `blocks` blocks in x, or an error when it does not fit.
inline ffi::Error GridOf(int64_t blocks, dim3* grid) {
  if (blocks > 0x7fffffffLL) return ffi::Error::Internal("te_jax CUDA: tensor too large for one launch");
  *grid = dim3(static_cast<unsigned>(blocks));
  return ffi::Error::Success();
}

// ---- input element types -------------------------------------------------------------

struct Bf16 {
  uint16_t u;
};
struct Half {
  uint16_t u;
};

__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(Bf16 v) { return __uint_as_float(uint32_t{v.u} << 16); }
__device__ __forceinline__ float ToF(Half v) { return __half2float(__ushort_as_half(v.u)); }

// Calls f(T{}) with T the storage type of a float32/bfloat16/float16 buffer.
template <typename F>
ffi::Error DispatchInput(ffi::DataType t, F&& f) {
  if (t == ffi::DataType::F32) return f(float{});
  if (t == ffi::DataType::BF16) return f(Bf16{});
  return f(Half{});
}

// Calls f(std::integral_constant<bool, b>{}).
template <typename F>
ffi::Error DispatchBool(bool b, F&& f) {
  if (b) return f(std::true_type{});
  return f(std::false_type{});
}

// 8 consecutive input elements as raw bits: one 16-byte word for 2-byte
// types, two for float32.
template <typename T>
struct Raw8 {
  uint4 w[sizeof(T) / 2];
};

template <typename T>
__device__ __forceinline__ Raw8<T> LoadRaw8(const T* p) {
  Raw8<T> r;
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(T) / 2); ++k) r.w[k] = __ldg(reinterpret_cast<const uint4*>(p) + k);
  return r;
}

template <typename T>
__device__ __forceinline__ Raw8<T> ZeroRaw8() {
  Raw8<T> r;
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(T) / 2); ++k) r.w[k] = make_uint4(0u, 0u, 0u, 0u);
  return r;
}

// The kUnroll vectors a thread of a kThreads-thread block loads in a grid-stride
// chunk starting at `base`: vector u at base + (u * kThreads + thread) * 8,
// zeros past `size`.
template <int kThreads, int kUnroll, typename T>
__device__ __forceinline__ void LoadChunk8(const T* x, int64_t base, int64_t size, Raw8<T> (&raw)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t idx = base + (int64_t{u} * kThreads + threadIdx.x) * 8;
    raw[u] = idx < size ? LoadRaw8(x + idx) : ZeroRaw8<T>();
  }
}

// LoadChunk8's kUnroll vectors, then body(u, f) with vector u unpacked to float f[8], for u = 0 .. kUnroll - 1.
template <int kThreads, int kUnroll, typename T, typename Body>
__device__ __forceinline__ void ForEachChunk8(const T* x, int64_t base, int64_t size, Body&& body) {
  Raw8<T> raw[kUnroll];
  LoadChunk8<kThreads>(x, base, size, raw);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    float f[8];
    Unpack8(raw[u], f);
    body(u, f);
  }
}

// Element i (0..1) of a 32-bit word holding two 2-byte elements, as float.
template <typename T>
__device__ __forceinline__ float HalfWordToF(uint32_t w, int i) {
  const uint16_t h = static_cast<uint16_t>(i ? (w >> 16) : (w & 0xffffu));
  return ToF(T{h});
}

template <typename T>
__device__ __forceinline__ void Unpack8(const Raw8<T>& r, float (&f)[8]) {
  if constexpr (sizeof(T) == 4) {
    const uint32_t* u = reinterpret_cast<const uint32_t*>(r.w);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __uint_as_float(u[i]);
  } else {
    const uint32_t u[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = HalfWordToF<T>(u[i / 2], i % 2);
  }
}

// Element k of a 16-byte word holding 16 / sizeof(T) elements, as float.
template <typename T>
__device__ __forceinline__ float ElemOf(const uint4& w, int k) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(u[k]);
  } else {
    return HalfWordToF<T>(u[k / 2], k % 2);
  }
}

// Two consecutive elements (2 * sizeof(T) bytes, aligned) as floats.
template <typename T>
__device__ __forceinline__ void Load2(const T* p, float& a, float& b) {
  if constexpr (sizeof(T) == 4) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    a = v.x;
    b = v.y;
  } else {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    a = HalfWordToF<T>(w, 0);
    b = HalfWordToF<T>(w, 1);
  }
}

// ---- FP8 packing ---------------------------------------------------------------------

// Two FP8 codes, `lo` in the low byte. The hardware cvt is round-to-nearest-
// even with satfinite (finite overflow and +-Inf give +-max, NaN gives NaN),
// the same bits as FloatToFp8. Define TE_JAX_SOFT_FP8 to use FloatToFp8.
template <bool E5>
__device__ __forceinline__ uint32_t Fp8x2(float lo, float hi) {
#if defined(TE_JAX_FP8_CVT_SOFT)
  const Fp8Format fmt = E5 ? kE5M2 : kE4M3;
  return uint32_t{FloatToFp8(lo, fmt)} | (uint32_t{FloatToFp8(hi, fmt)} << 8);
#else
  uint16_t r;
  if constexpr (E5) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
#endif
}

// Four codes in one word, f[0] in the low byte.
template <bool E5>
__device__ __forceinline__ uint32_t Fp8x4(float a, float b, float c, float d) {
  return Fp8x2<E5>(a, b) | (Fp8x2<E5>(c, d) << 16);
}

template <bool E5>
__device__ __forceinline__ float Fp8MaxOf() {
  return E5 ? kE5M2Max : kE4M3Max;
}

// Eight values times `mult` as eight FP8 codes.
template <bool E5>
__device__ __forceinline__ uint2 Fp8x8(const float (&f)[8], float mult) {
  return make_uint2(Fp8x4<E5>(f[0] * mult, f[1] * mult, f[2] * mult, f[3] * mult),
                    Fp8x4<E5>(f[4] * mult, f[5] * mult, f[6] * mult, f[7] * mult));
}

// ---- reductions ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t AbsMaxBits8(const float (&f)[8]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max(m, AbsBits(f[i]));
  return m;
}

// Max over the 32 lanes of a full warp.
__device__ __forceinline__ uint32_t WarpMax(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

// Max over groups of `kLanes` consecutive lanes (a power of two <= 32).
template <int kLanes>
__device__ __forceinline__ uint32_t GroupMax(uint32_t v) {
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide max of AbsBits values, folded into *out with one atomicMax (the
// bits of non-negative floats and NaNs order like the values). `scratch`
// holds one word per warp. Every thread must call it.
template <int kThreads>
__device__ __forceinline__ void BlockAmaxAtomic(uint32_t v, uint32_t* scratch, float* out) {
  v = WarpMax(v);
  const int warp = threadIdx.x / 32;
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, scratch[w]);
    atomicMax(reinterpret_cast<unsigned int*>(out), m);
  }
}

// Byte-transpose of a 4x4 block: in[r] holds row r (byte c = column c);
// out[c] gets column c (byte r = row r).
__device__ __forceinline__ void Transpose4x4(const uint32_t (&in)[4], uint32_t (&out)[4]) {
  const uint32_t t0 = __byte_perm(in[0], in[1], 0x5140);
  const uint32_t t1 = __byte_perm(in[2], in[3], 0x5140);
  const uint32_t t2 = __byte_perm(in[0], in[1], 0x7362);
  const uint32_t t3 = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(t0, t1, 0x5410);
  out[1] = __byte_perm(t0, t1, 0x7632);
  out[2] = __byte_perm(t2, t3, 0x5410);
  out[3] = __byte_perm(t2, t3, 0x7632);
}

// ---- shapes and buffers ------------------------------------------------------------------

// The tiled kernels need both matrix extents to be multiples of 16 (16-byte
// vectors along N, 16-row segments along M); other shapes take the simple
// kernels.
inline bool TileFriendly(const MatrixBatch& mb) {
  return mb.rows > 0 && mb.cols > 0 && mb.rows % 16 == 0 && mb.cols % 16 == 0;
}

template <typename T>
inline T* DataOf(ffi::AnyBuffer& b) {
  return static_cast<T*>(b.untyped_data());
}

}  // namespace cuda
}  // namespace te_jax
