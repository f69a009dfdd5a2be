// CUDA FFI handlers for the grouped GEMM targets (the grouped GEMM contract of
// te_jax/ops/grouped_gemm.py):
//   te_jax_grouped_gemm_fp8        -> GroupedGemmFp8Cuda       per-tensor FP8, CUTLASS sm_90a (grouped_gemm.cuh)
//   te_jax_grouped_gemm_fp8_block  -> GroupedGemmFp8BlockCuda  1x128 A x 128x128 or 1x128 B scales, CUTLASS sm_90a
//                                                              (group_axis 1: K-block-major scales)
//   te_jax_grouped_gemm_bf16       -> GroupedGemmBf16Cuda      bfloat16 x bfloat16 -> bfloat16, float32 accumulation,
//                                                              CUTLASS sm_90a (forward, dgrad and wgrad layouts)
//   te_jax_grouped_gemm_mxfp8      -> GroupedGemmMxfp8Cuda     an error: the Python side emulates these on sm_90
//   te_jax_grouped_gemm_nvfp4      -> GroupedGemmNvfp4Cuda     an error: the Python side emulates these on sm_90
//
// Each FP8 / bfloat16 handler: check the call, then the grouped GEMM (setup kernel + one
// CUTLASS launch), the zeroing kernel for what no group writes, and the bias
// kernel when there is a bias. group_sizes stays on the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <initializer_list>
#include <string>

#include "gemm_cublaslt.cuh"
#include "../common/bindings.h"
#include "grouped_gemm.cuh"

namespace te_jax {
namespace grouped {
namespace {

constexpr int kThreads = 256;

ffi::Error Invalid(const char* target, const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": " + what);
}

std::string ShapeOf(const ffi::AnyBuffer& x) {
  std::string s = "[";
  for (size_t i = 0; i < x.dimensions().size(); ++i) s += (i ? ", " : "") + std::to_string(x.dimensions()[i]);
  return s + "]";
}

// The sum of the first `groups` sizes (negative sizes count as zero), by one block.
__device__ int64_t SumOfSizes(const int32_t* sizes, int64_t groups) {
  int64_t total = 0;
  for (int64_t h = 0; h < groups; ++h) total += max(sizes[h], 0);
  return total;
}

// group_axis 0: zeroes out's rows [min(sum(sizes), m), m) (row_bytes per row, a multiple of 16).
__global__ void ZeroTailRowsKernel(const int32_t* sizes, int64_t groups, int64_t m, int64_t row_bytes, uint4* out) {
  __shared__ int64_t first;
  if (threadIdx.x == 0) first = min(SumOfSizes(sizes, groups), m);
  __syncthreads();
  const int64_t begin = first * row_bytes / 16, end = m * row_bytes / 16;
  for (int64_t i = begin + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < end;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

// group_axis 1: zeroes out[g] (matrix_bytes, a multiple of 16) for every group
// the GEMM skips: an empty group, or one whose span starts past K (clamped).
__global__ void ZeroEmptyGroupsKernel(const int32_t* sizes, int64_t align, int64_t k, int64_t matrix_bytes,
                                      uint4* out) {
  const int64_t g = blockIdx.y;
  __shared__ int64_t start;
  if (threadIdx.x == 0) {
    start = 0;
    for (int64_t h = 0; h < g; ++h) start += (int64_t{max(sizes[h], 0)} + align - 1) / align * align;
  }
  __syncthreads();
  if (sizes[g] > 0 && start < k) return;
  uint4* m = out + g * (matrix_bytes / 16);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < matrix_bytes / 16;
       i += int64_t{gridDim.x} * blockDim.x) {
    m[i] = make_uint4(0, 0, 0, 0);
  }
}

__device__ float LoadF(const float* p, int64_t i) { return p[i]; }
__device__ float LoadF(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ float LoadF(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ void StoreF(float* p, int64_t i, float v) { p[i] = v; }
__device__ void StoreF(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ void StoreF(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }

// group_axis 0: out[r, :] += bias[g, :] for each row r of group g (rows past
// the groups' sum keep their zeros). One block per row, grid-strided.
template <typename Out, typename Bias>
__global__ void AddBiasKernel(const int32_t* sizes, int64_t groups, int64_t m, int64_t n, const Bias* bias, Out* out) {
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    int64_t g = 0, end = max(sizes[0], 0);
    while (end <= r && g + 1 < groups) end += max(sizes[++g], 0);
    if (r >= end) return;  // past the groups' sum
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      StoreF(out, r * n + j, LoadF(out, r * n + j) + LoadF(bias, g * n + j));
    }
  }
}

template <typename Out>
void LaunchAddBias(ffi::DataType bias_type, const int32_t* sizes, int64_t groups, int64_t m, int64_t n,
                   const void* bias, void* out, int blocks, cudaStream_t stream) {
  auto* o = static_cast<Out*>(out);
  if (bias_type == ffi::DataType::F32) {
    AddBiasKernel<<<blocks, kThreads, 0, stream>>>(sizes, groups, m, n, static_cast<const float*>(bias), o);
  } else {
    AddBiasKernel<<<blocks, kThreads, 0, stream>>>(sizes, groups, m, n, static_cast<const Out*>(bias), o);
  }
}

bool Fp8KindOf(ffi::DataType t, Fp8Kind* kind) {
  if (t == ffi::DataType::F8E4M3FN) {
    *kind = Fp8Kind::kE4M3;
    return true;
  }
  if (t == ffi::DataType::F8E5M2) {
    *kind = Fp8Kind::kE5M2;
    return true;
  }
  return false;
}

bool OutKindOf(ffi::DataType t, OutKind* kind, int64_t* bytes) {
  switch (t) {
    case ffi::DataType::F32: *kind = OutKind::kF32; *bytes = 4; return true;
    case ffi::DataType::BF16: *kind = OutKind::kBf16; *bytes = 2; return true;
    case ffi::DataType::F16: *kind = OutKind::kF16; *bytes = 2; return true;
    default: return false;
  }
}

ffi::Error Dispatch(const GroupedFp8Call& c, cudaStream_t stream) {
#define TE_JAX_RUN(ka, kb, ko, fast)                                                                              \
  if (c.a_kind == Fp8Kind::ka && c.b_kind == Fp8Kind::kb && c.out_kind == OutKind::ko && c.fast_accum == fast) \
    return RunGroupedFp8<Fp8Kind::ka, Fp8Kind::kb, OutKind::ko, fast>(c, stream);
  TE_JAX_GROUPED_FP8_KERNELS(TE_JAX_RUN)
#undef TE_JAX_RUN
  return Invalid(c.target,
                 "the CUDA grouped GEMM has no kernel for this combination of operand dtypes, output dtype and "
                 "fast_accum (it has E4M3 x E4M3 -> bfloat16 with fast_accum, E5M2 x E4M3 -> bfloat16 without, "
                 "and every pair -> float32 without; te_jax.ops.grouped_gemm picks one and casts)");
}

ffi::Error DispatchBlock(const GroupedFp8Call& c, cudaStream_t stream) {
#define TE_JAX_RUN(ka, kb, ko, rows, group_axis)                                                                  \
  if (c.a_kind == Fp8Kind::ka && c.b_kind == Fp8Kind::kb && c.out_kind == OutKind::ko && c.b_scale_rows == rows && \
      c.axis == group_axis)                                                                                         \
    return RunGroupedFp8Block<Fp8Kind::ka, Fp8Kind::kb, OutKind::ko, rows, group_axis>(c, stream);
  TE_JAX_GROUPED_FP8_BLOCK_KERNELS(TE_JAX_RUN)
#undef TE_JAX_RUN
  return Invalid(c.target,
                 "the CUDA grouped GEMM has no kernel for this combination of operand dtypes, output dtype and B "
                 "blocks (it has E4M3 x E4M3: group_axis 0 with 128x128 B blocks -> bfloat16 or float32, with 1x128 "
                 "B blocks -> float32; group_axis 1 with 1x128 blocks -> float32; te_jax.ops.grouped_gemm casts)");
}

// group_sizes must be int32 [G]; sets *g.
ffi::Error CheckGroupSizes(const char* t, const ffi::AnyBuffer& sizes, int64_t* g) {
  if (sizes.element_type() != ffi::DataType::S32 || sizes.dimensions().size() != 1) {
    return Invalid(t, "group_sizes must be int32 [G], got " + ShapeOf(sizes));
  }
  *g = sizes.dimensions()[0];
  return ffi::Error::Success();
}

// A bias (has_bias) must be [G, N] of float32 or the out dtype, for group_axis 0 only.
ffi::Error CheckBias(const GroupedFp8Call& c, const ffi::AnyBuffer& bias, bool has_bias, int64_t g,
                     ffi::DataType out_type) {
  if (!has_bias) return ffi::Error::Success();
  if (c.axis != GroupAxis::kRows) return Invalid(c.target, "a bias is only for group_axis 0");
  if (bias.dimensions().size() != 2 || static_cast<int64_t>(bias.dimensions()[0]) != g ||
      static_cast<int64_t>(bias.dimensions()[1]) != c.n ||
      (bias.element_type() != ffi::DataType::F32 && bias.element_type() != out_type)) {
    return Invalid(c.target, "bias must be [G, N] of float32 or the out dtype, got " + ShapeOf(bias));
  }
  return ffi::Error::Success();
}

// Fills `c`'s group count, span alignment and device pointers once the shapes are checked.
void FillBuffers(GroupedFp8Call* c, int64_t g, int64_t align, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                 const ffi::AnyBuffer& sizes, ffi::AnyBuffer& out, ffi::AnyBuffer& workspace) {
  c->groups = g;
  c->align = align;
  c->a = a.untyped_data();
  c->b = b.untyped_data();
  c->group_sizes = static_cast<const int32_t*>(sizes.untyped_data());
  c->out = out.untyped_data();
  c->workspace = workspace.untyped_data();
  c->workspace_bytes = workspace.size_bytes();
}

// Checks the operands, group sizes, output and bias against the contract and
// fills `c` with them (the scales are each mode's).
ffi::Error Prepare(const char* t, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& sizes,
                   const ffi::AnyBuffer& bias, ffi::AnyBuffer& out, ffi::AnyBuffer& workspace, int64_t group_axis,
                   int64_t align, bool has_bias, GroupedFp8Call* c, int64_t* out_bytes) {
  c->target = t;
  if (group_axis != 0 && group_axis != 1) return Invalid(t, "group_axis must be 0 or 1, got " + std::to_string(group_axis));
  c->axis = group_axis == 0 ? GroupAxis::kRows : GroupAxis::kContraction;
  if (!Fp8KindOf(a.element_type(), &c->a_kind) || !Fp8KindOf(b.element_type(), &c->b_kind)) {
    return Invalid(t, "a and b must be float8_e4m3fn or float8_e5m2");
  }
  if (c->a_kind == Fp8Kind::kE5M2 && c->b_kind == Fp8Kind::kE5M2) return Invalid(t, "a and b cannot both be E5M2");
  if (!OutKindOf(out.element_type(), &c->out_kind, out_bytes)) {
    return Invalid(t, "out must be float32, bfloat16 or float16");
  }
  int64_t g = 0;
  TE_RETURN_IF_ERROR(CheckGroupSizes(t, sizes, &g));
  auto dims = [](const ffi::AnyBuffer& x, size_t i) { return static_cast<int64_t>(x.dimensions()[i]); };
  if (c->axis == GroupAxis::kRows) {
    if (a.dimensions().size() != 2 || b.dimensions().size() != 3 || out.dimensions().size() != 2 ||
        dims(b, 0) != g || dims(b, 2) != dims(a, 1) || dims(out, 0) != dims(a, 0) || dims(out, 1) != dims(b, 1)) {
      return Invalid(t, "group_axis 0 takes a [M, K], b [G, N, K], out [M, N]; got a " + ShapeOf(a) + ", b " +
                            ShapeOf(b) + ", out " + ShapeOf(out) + ", G = " + std::to_string(g));
    }
    c->m = dims(a, 0);
    c->n = dims(b, 1);
    c->k = dims(a, 1);
  } else {
    if (a.dimensions().size() != 2 || b.dimensions().size() != 2 || out.dimensions().size() != 3 ||
        dims(b, 1) != dims(a, 1) || dims(out, 0) != g || dims(out, 1) != dims(a, 0) || dims(out, 2) != dims(b, 0)) {
      return Invalid(t, "group_axis 1 takes a [P, Kc], b [Q, Kc], out [G, P, Q]; got a " + ShapeOf(a) + ", b " +
                            ShapeOf(b) + ", out " + ShapeOf(out) + ", G = " + std::to_string(g));
    }
    if (align <= 0) return Invalid(t, "align must be positive, got " + std::to_string(align));
    c->m = dims(a, 0);
    c->n = dims(b, 0);
    c->k = dims(a, 1);
  }
  if (c->k % 16 != 0 || c->n % 16 != 0) {
    return Invalid(t, "the CUDA grouped GEMM needs the contraction and output columns to be multiples of 16, got K = " +
                          std::to_string(c->k) + ", N = " + std::to_string(c->n));
  }
  if (c->m > INT32_MAX || c->n > INT32_MAX || c->k > INT32_MAX) return Invalid(t, "a dimension exceeds 2^31 - 1");
  TE_RETURN_IF_ERROR(CheckBias(*c, bias, has_bias, g, out.element_type()));
  FillBuffers(c, g, align, a, b, sizes, out, workspace);
  return ffi::Error::Success();
}

ffi::Error Launched(const GroupedFp8Call& c, const char* what) {
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(c.target) + ": " + what + " failed: " + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

// The shared body of the FP8 handlers once `c` is filled: an empty output is
// zeroed; otherwise (sm_90 only) `gemm` runs the grouped GEMM, then the rows /
// matrices no group writes are zeroed and the bias is added.
template <typename Gemm>
ffi::Error Run(GroupedFp8Call& c, int device, int64_t out_bytes, const ffi::AnyBuffer& bias, bool has_bias,
               cudaStream_t stream, Gemm gemm) {
  const size_t total_bytes = static_cast<size_t>(out_bytes) * c.m * c.n * (c.axis == GroupAxis::kRows ? 1 : c.groups);
  if (c.groups == 0 || c.m == 0 || c.n == 0) {
    if (total_bytes > 0 && cudaMemsetAsync(c.out, 0, total_bytes, stream) != cudaSuccess) {
      return Launched(c, "zeroing the output");
    }
    return ffi::Error::Success();
  }
  c.device = device;
  auto cc = gemm::ComputeCapability(device);
  if (cc.has_error()) return cc.error();
  if (cc.value() != 90) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(c.target) + ": the CUDA grouped GEMM runs on sm_90 (Hopper) only; device " +
                          std::to_string(device) + " is sm_" + std::to_string(cc.value()));
  }
  TE_RETURN_IF_ERROR(gemm(c, stream));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (c.axis == GroupAxis::kRows) {
    ZeroTailRowsKernel<<<2 * sms, kThreads, 0, stream>>>(c.group_sizes, c.groups, c.m, c.n * out_bytes,
                                                          static_cast<uint4*>(c.out));
    TE_RETURN_IF_ERROR(Launched(c, "the row-zeroing kernel"));
  } else {
    const dim3 grid(static_cast<unsigned>(std::max<int64_t>(1, 2 * sms / c.groups)), static_cast<unsigned>(c.groups));
    ZeroEmptyGroupsKernel<<<grid, kThreads, 0, stream>>>(c.group_sizes, c.align, c.k, c.m * c.n * out_bytes,
                                                          static_cast<uint4*>(c.out));
    TE_RETURN_IF_ERROR(Launched(c, "the group-zeroing kernel"));
  }
  if (has_bias) {
    const int blocks = static_cast<int>(std::min<int64_t>(c.m, 8 * sms));
    const void* bp = bias.untyped_data();
    const ffi::DataType bt = bias.element_type();
    switch (c.out_kind) {
      case OutKind::kF32: LaunchAddBias<float>(bt, c.group_sizes, c.groups, c.m, c.n, bp, c.out, blocks, stream); break;
      case OutKind::kBf16: LaunchAddBias<__nv_bfloat16>(bt, c.group_sizes, c.groups, c.m, c.n, bp, c.out, blocks, stream); break;
      case OutKind::kF16: LaunchAddBias<__half>(bt, c.group_sizes, c.groups, c.m, c.n, bp, c.out, blocks, stream); break;
    }
    TE_RETURN_IF_ERROR(Launched(c, "the bias kernel"));
  }
  return ffi::Error::Success();
}

// The FP8 handlers' frame: on `device`, Prepare's checks of the shared operands into a call, then
// fill(c) (the handler's own checks and operands, an error ends the call), then Run with `dispatch`.
template <typename Fill>
ffi::Error RunFp8Call(const char* t, cudaStream_t stream, int32_t device, const ffi::AnyBuffer& a,
                      const ffi::AnyBuffer& b, const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& bias,
                      ffi::AnyBuffer& out, ffi::AnyBuffer& workspace, int64_t group_axis, int64_t align, bool has_bias,
                      ffi::Error (*dispatch)(const GroupedFp8Call&, cudaStream_t), Fill fill) {
  gemm::DeviceGuard guard;
  TE_RETURN_IF_ERROR(guard.Enter(device));
  GroupedFp8Call c{};
  int64_t out_bytes = 0;
  TE_RETURN_IF_ERROR(Prepare(t, a, b, group_sizes, bias, out, workspace, group_axis, align, has_bias, &c, &out_bytes));
  TE_RETURN_IF_ERROR(fill(c));
  return Run(c, guard.device(), out_bytes, bias, has_bias, stream, dispatch);
}

ffi::Error GroupedGemmFp8(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                          ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer group_sizes, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, int64_t group_axis,
                          int64_t align, bool has_bias, bool fast_accum) {
  const char* t = "te_jax_grouped_gemm_fp8";
  auto fill = [&](GroupedFp8Call& c) -> ffi::Error {
    if (c.axis == GroupAxis::kContraction && align % 16 != 0) {
      return Invalid(t, "the CUDA grouped GEMM needs align a multiple of 16 for group_axis 1, got " + std::to_string(align));
    }
    for (const ffi::AnyBuffer* s : {&a_scale_inv, &b_scale_inv}) {
      const int64_t count = static_cast<int64_t>(s->element_count());
      if (s->element_type() != ffi::DataType::F32 || (count != 1 && count != c.groups)) {
        return Invalid(t, "a_scale_inv and b_scale_inv must be float32 [1] or [G]");
      }
    }
    c.fast_accum = fast_accum;
    c.a_scale_inv = static_cast<const float*>(a_scale_inv.untyped_data());
    c.b_scale_inv = static_cast<const float*>(b_scale_inv.untyped_data());
    c.a_scale_per_group = a_scale_inv.element_count() > 1;
    c.b_scale_per_group = b_scale_inv.element_count() > 1;
    return ffi::Error::Success();
  };
  return RunFp8Call(t, stream, device, a, b, group_sizes, bias, *out, *workspace, group_axis, align, has_bias,
                    Dispatch, fill);
}

// Checks a block-scale operand: float32 of exactly `dims`.
ffi::Error CheckScales(const char* t, const char* name, const ffi::AnyBuffer& s, std::initializer_list<int64_t> dims) {
  bool ok = s.element_type() == ffi::DataType::F32 && s.dimensions().size() == dims.size();
  size_t i = 0;
  for (int64_t d : dims) ok = ok && static_cast<int64_t>(s.dimensions()[i++]) == d;
  if (ok) return ffi::Error::Success();
  std::string want = "[";
  i = 0;
  for (int64_t d : dims) want += (i++ ? ", " : "") + std::to_string(d);
  return Invalid(t, std::string(name) + " must be float32 " + want + "], got " + ShapeOf(s));
}

ffi::Error GroupedGemmFp8Block(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b,
                               ffi::AnyBuffer b_s, ffi::AnyBuffer group_sizes, ffi::AnyBuffer bias,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                               int64_t group_axis, int64_t align, bool has_bias, bool a_block_2d, bool b_block_2d) {
  const char* t = "te_jax_grouped_gemm_fp8_block";
  auto fill = [&](GroupedFp8Call& c) -> ffi::Error {
    if (a_block_2d) return Invalid(t, "the CUDA grouped GEMM takes 1x128 blocks for a (a_block_2d false)");
    if (c.k % 128 != 0 || (b_block_2d && c.n % 128 != 0)) {
      return Invalid(t, "the block-scaled grouped GEMM needs K (and N with 128x128 B blocks) to be multiples of 128");
    }
    if (c.axis == GroupAxis::kRows) {
      TE_RETURN_IF_ERROR(CheckScales(t, "a_s", a_s, {c.m, c.k / 128}));
      TE_RETURN_IF_ERROR(b_block_2d ? CheckScales(t, "b_s", b_s, {c.groups, c.n / 128, c.k / 128})
                                    : CheckScales(t, "b_s", b_s, {c.groups, c.n, c.k / 128}));
    } else {
      // K-block-major, so a group's span is a compact slice (CUTLASS derives
      // each group's scale layout from its problem shape).
      if (b_block_2d) return Invalid(t, "the CUDA grouped GEMM takes 1x128 blocks for b with group_axis 1");
      if (c.m % 128 != 0) return Invalid(t, "the block-scaled group_axis 1 GEMM needs P to be a multiple of 128");
      TE_RETURN_IF_ERROR(CheckScales(t, "a_s", a_s, {c.k / 128, c.m}));
      TE_RETURN_IF_ERROR(CheckScales(t, "b_s", b_s, {c.k / 128, c.n}));
    }
    c.a_s = static_cast<const float*>(a_s.untyped_data());
    c.b_s = static_cast<const float*>(b_s.untyped_data());
    c.b_scale_rows = b_block_2d ? 128 : 1;
    return ffi::Error::Success();
  };
  return RunFp8Call(t, stream, device, a, b, group_sizes, bias, *out, *workspace, group_axis, align, has_bias,
                    DispatchBlock, fill);
}

// Checks the bfloat16 call's operands, group sizes, output and bias against
// the contract (te_jax.ops.grouped_gemm.grouped_gemm_bf16) and fills `c`.
ffi::Error PrepareBf16(const char* t, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& sizes,
                       const ffi::AnyBuffer& bias, ffi::AnyBuffer& out, ffi::AnyBuffer& workspace, int64_t group_axis,
                       bool b_kn, bool has_bias, GroupedFp8Call* c) {
  c->target = t;
  if (group_axis != 0 && group_axis != 1) {
    return Invalid(t, "group_axis must be 0 or 1, got " + std::to_string(group_axis));
  }
  c->axis = group_axis == 0 ? GroupAxis::kRows : GroupAxis::kContraction;
  if (a.element_type() != ffi::DataType::BF16 || b.element_type() != ffi::DataType::BF16 ||
      out.element_type() != ffi::DataType::BF16) {
    return Invalid(t, "a, b and out must be bfloat16");
  }
  int64_t g = 0;
  TE_RETURN_IF_ERROR(CheckGroupSizes(t, sizes, &g));
  auto dims = [](const ffi::AnyBuffer& x, size_t i) { return static_cast<int64_t>(x.dimensions()[i]); };
  if (c->axis == GroupAxis::kRows) {
    const bool ranks = a.dimensions().size() == 2 && b.dimensions().size() == 3 && out.dimensions().size() == 2;
    const int64_t bk = ranks ? dims(b, b_kn ? 1 : 2) : -1, bn = ranks ? dims(b, b_kn ? 2 : 1) : -1;
    if (!ranks || dims(b, 0) != g || bk != dims(a, 1) || dims(out, 0) != dims(a, 0) || dims(out, 1) != bn) {
      return Invalid(t, std::string("group_axis 0 takes a [M, K], b ") + (b_kn ? "[G, K, N]" : "[G, N, K]") +
                            ", out [M, N]; got a " + ShapeOf(a) + ", b " + ShapeOf(b) + ", out " + ShapeOf(out) +
                            ", G = " + std::to_string(g));
    }
    c->bf16_layout = b_kn ? Bf16Layout::kForward : Bf16Layout::kDgrad;
    c->m = dims(a, 0);
    c->n = bn;
    c->k = dims(a, 1);
    if (c->k % 8 != 0 || c->n % 8 != 0) {
      return Invalid(t, "the CUDA grouped GEMM needs K and N to be multiples of 8, got K = " + std::to_string(c->k) +
                            ", N = " + std::to_string(c->n));
    }
  } else {
    if (a.dimensions().size() != 2 || b.dimensions().size() != 2 || out.dimensions().size() != 3 ||
        dims(b, 0) != dims(a, 0) || dims(out, 0) != g || dims(out, 1) != dims(a, 1) || dims(out, 2) != dims(b, 1)) {
      return Invalid(t, "group_axis 1 takes a [R, P], b [R, Q], out [G, P, Q]; got a " + ShapeOf(a) + ", b " +
                            ShapeOf(b) + ", out " + ShapeOf(out) + ", G = " + std::to_string(g));
    }
    c->bf16_layout = Bf16Layout::kWgrad;
    c->m = dims(a, 1);  // P
    c->n = dims(b, 1);  // Q
    c->k = dims(a, 0);  // R, the grouped rows
    if (c->m % 8 != 0 || c->n % 8 != 0) {
      return Invalid(t, "the CUDA grouped GEMM needs P and Q to be multiples of 8, got P = " + std::to_string(c->m) +
                            ", Q = " + std::to_string(c->n));
    }
  }
  if (c->m > INT32_MAX || c->n > INT32_MAX || c->k > INT32_MAX) return Invalid(t, "a dimension exceeds 2^31 - 1");
  c->out_kind = OutKind::kBf16;
  TE_RETURN_IF_ERROR(CheckBias(*c, bias, has_bias, g, out.element_type()));
  FillBuffers(c, g, 1, a, b, sizes, out, workspace);  // align 1: group_axis 1's rows follow each other unpadded
  return ffi::Error::Success();
}

ffi::Error DispatchBf16(const GroupedFp8Call& c, cudaStream_t stream) {
  if (c.axis == GroupAxis::kRows && c.k == 0) {  // an empty contraction (no K tiles): every product is zero
    if (cudaMemsetAsync(c.out, 0, static_cast<size_t>(c.m * c.n) * 2, stream) != cudaSuccess) {
      return Launched(c, "zeroing the output");
    }
    return ffi::Error::Success();
  }
#define TE_JAX_RUN(layout) \
  if (c.bf16_layout == Bf16Layout::layout) return RunGroupedBf16<Bf16Layout::layout>(c, stream);
  TE_JAX_GROUPED_BF16_KERNELS(TE_JAX_RUN)
#undef TE_JAX_RUN
  return Invalid(c.target, "the CUDA grouped GEMM has no bfloat16 kernel for this layout");
}

ffi::Error GroupedGemmBf16(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                           ffi::AnyBuffer group_sizes, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> workspace, int64_t group_axis, bool has_bias, bool b_kn) {
  const char* t = "te_jax_grouped_gemm_bf16";
  gemm::DeviceGuard guard;
  TE_RETURN_IF_ERROR(guard.Enter(device));
  GroupedFp8Call c{};
  TE_RETURN_IF_ERROR(PrepareBf16(t, a, b, group_sizes, bias, *out, *workspace, group_axis, b_kn, has_bias, &c));
  // The rows (group_axis 0) or matrices (1) no group writes are zeroed by Run, which reads c.m, c.n as out's
  // row count and width (P, Q for group_axis 1) and c.k as the grouped extent of group_axis 1 (R).
  return Run(c, guard.device(), 2, bias, has_bias, stream, DispatchBf16);
}

ffi::Error NotOnCuda(const char* target, const char* why) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string(target) + ": " + why);
}

ffi::Error GroupedGemmMxfp8(cudaStream_t, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                            ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>,
                            int64_t, int64_t, bool) {
  return NotOnCuda("te_jax_grouped_gemm_mxfp8",
                   "the MXFP8 grouped GEMM has no CUDA kernel; te_jax.ops.grouped_gemm lowers it to its emulation "
                   "on a GPU");
}

ffi::Error GroupedGemmNvfp4(cudaStream_t, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                            ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                            ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>, int64_t, int64_t, bool) {
  return NotOnCuda("te_jax_grouped_gemm_nvfp4",
                   "the NVFP4 grouped GEMM has no CUDA kernel; te_jax.ops.grouped_gemm lowers it to its emulation "
                   "on a GPU");
}

}  // namespace
}  // namespace grouped

TE_JAX_CUDA_DEVICE_HANDLER(GroupedGemmFp8, grouped::GroupedGemmFp8);
TE_JAX_CUDA_DEVICE_HANDLER(GroupedGemmFp8Block, grouped::GroupedGemmFp8Block);
TE_JAX_CUDA_DEVICE_HANDLER(GroupedGemmBf16, grouped::GroupedGemmBf16);
TE_JAX_CUDA_HANDLER(GroupedGemmMxfp8, grouped::GroupedGemmMxfp8);
TE_JAX_CUDA_HANDLER(GroupedGemmNvfp4, grouped::GroupedGemmNvfp4);

}  // namespace te_jax
