// Shape, dtype and workspace bookkeeping for the CUDA GEMM handlers.
#include "gemm_problem.cuh"

namespace te_jax {
namespace gemm {

namespace {
constexpr int64_t kAlign = 256;  // cuBLASLt wants a 256-byte aligned workspace
constexpr int64_t kDimMultiple = 16;

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

std::string Problem::Describe() const {
  return std::string(target) + " with " + shapes + " (M=" + std::to_string(m) + " N=" + std::to_string(n) +
         " K=" + std::to_string(k) + " batch=" + std::to_string(count) + ")";
}

ffi::ErrorOr<Problem> ParseProblem(const char* target, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                   int64_t k_div, const ffi::AnyBuffer& out) {
  Problem p;
  p.target = target;
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  p.shapes = "A " + DimsToString(ad) + " B " + DimsToString(bd);
  if (ad.size() < 2 || bd.size() < 2) {
    return ffi::Unexpected(InvalidArgument(std::string(target) + ": A and B must have rank >= 2, got " + p.shapes));
  }
  p.m = ad[ad.size() - 2];
  p.k = ad[ad.size() - 1] * k_div;
  p.n = bd[bd.size() - 2];
  for (size_t i = 0; i + 2 < ad.size(); ++i) p.count *= ad[i];
  if (bd[bd.size() - 1] * k_div != p.k) {
    return ffi::Unexpected(InvalidArgument(std::string(target) + ": A and B must share the contraction (last) axis, got " +
                                           p.shapes));
  }
  p.b_shared = bd.size() == 2;
  if (!p.b_shared) {
    bool same = ad.size() == bd.size();
    for (size_t i = 0; same && i + 2 < ad.size(); ++i) same = ad[i] == bd[i];
    if (!same) {
      return ffi::Unexpected(InvalidArgument(std::string(target) + ": a batched B [..., N, K] must have A's leading axes, got " +
                                             p.shapes));
    }
  }
  if (p.k == 0) {
    return ffi::Unexpected(InvalidArgument(p.Describe() + ": the contraction axis K must not be empty"));
  }
  if (p.m % kDimMultiple || p.n % kDimMultiple || p.k % kDimMultiple) {
    return ffi::Unexpected(InvalidArgument(
        p.Describe() + ": cuBLASLt's FP8/FP4 kernels need 16-byte aligned rows, so M, N and K must be multiples of " +
        std::to_string(kDimMultiple) + "; pad the operands"));
  }
  const auto ot = out.element_type();
  if (ot != ffi::DataType::F32 && ot != ffi::DataType::BF16 && ot != ffi::DataType::F16) {
    return ffi::Unexpected(InvalidArgument(p.Describe() + ": out must be float32, bfloat16 or float16"));
  }
  auto od = out.dimensions();
  if (static_cast<int64_t>(out.element_count()) != p.count * p.m * p.n || od.size() < 2 || od[od.size() - 1] != p.n) {
    return ffi::Unexpected(InvalidArgument(p.Describe() + ": out must be [..., M, N], got " + DimsToString(od)));
  }
  return p;
}

ffi::Error CheckFp8Pair(const Problem& p, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                        cudaDataType_t* a_type, cudaDataType_t* b_type) {
  auto fa = Fp8FormatOf(a.element_type());
  auto fb = Fp8FormatOf(b.element_type());
  if (!fa || !fb) return InvalidArgument(p.Describe() + ": A and B must be float8_e4m3fn or float8_e5m2");
  if (fa->mant_bits == 2 && fb->mant_bits == 2) {
    return InvalidArgument(p.Describe() + ": E5M2 x E5M2 is not supported (use E4M3 for at least one operand)");
  }
  *a_type = fa->mant_bits == 3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
  *b_type = fb->mant_bits == 3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
  return ffi::Error::Success();
}

ffi::Error CheckCount(const Problem& p, const ffi::AnyBuffer& buf, const char* name, int64_t want) {
  if (static_cast<int64_t>(buf.element_count()) != want) {
    return InvalidArgument(p.Describe() + ": " + name + " must hold " + std::to_string(want) + " elements, got shape " +
                           DimsToString(buf.dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error CheckScalars(const Problem& p, const ffi::AnyBuffer& buf, const char* name, int64_t matrices) {
  if (buf.element_type() != ffi::DataType::F32) return InvalidArgument(p.Describe() + ": " + name + " must be float32");
  const int64_t got = static_cast<int64_t>(buf.element_count());
  if (got != 1 && got != matrices) {
    return InvalidArgument(p.Describe() + ": " + name + " must hold 1 value (or one per matrix, " +
                           std::to_string(matrices) + "), got shape " + DimsToString(buf.dimensions()));
  }
  return ffi::Error::Success();
}

cudaDataType_t CudaTypeOf(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? CUDA_R_16BF : (t == ffi::DataType::F16 ? CUDA_R_16F : CUDA_R_32F);
}

OutType OutTypeOf(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? OutType::kBF16 : (t == ffi::DataType::F16 ? OutType::kF16 : OutType::kF32);
}

ffi::ErrorOr<OutputPlan> PlanOutput(const Problem& p, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& out,
                                    bool narrow) {
  OutputPlan plan;
  const ffi::DataType ot = out.element_type();
  const ffi::DataType bt = bias.element_type();
  plan.bias = bias.element_count() != 0;
  if (plan.bias && (static_cast<int64_t>(bias.element_count()) != p.n || (bt != ot && bt != ffi::DataType::F32))) {
    return ffi::Unexpected(InvalidArgument(p.Describe() + ": bias must be [N] in out's dtype or float32 (or [0]), got " +
                                           DimsToString(bias.dimensions())));
  }
  // cuBLASLt: FP8/FP4 operands give any of f32/bf16/f16 D, with a bias in D's
  // dtype for bf16/f16 D (bf16 for f32 D); bf16 operands give bf16/f32 D with
  // a bias in D's dtype.
  const bool direct = narrow || ot != ffi::DataType::F16;
  const bool epilogue_ok = bt == ot && (narrow ? ot != ffi::DataType::F32 : true);
  if (!direct) {
    plan.staged = true;
  } else if (plan.bias && epilogue_ok) {
    plan.epilogue = true;
  } else if (plan.bias && ot == ffi::DataType::F32) {
    plan.post_add = true;
  } else if (plan.bias) {
    plan.staged = true;  // float32 bias on a bf16/f16 out: add in float32, then cast once
  }
  plan.d_type = plan.staged ? CUDA_R_32F : CudaTypeOf(ot);
  return plan;
}

Workspace::Workspace(ffi::AnyBuffer buf) {
  const uintptr_t raw = reinterpret_cast<uintptr_t>(buf.untyped_data());
  base_ = (raw + kAlign - 1) / kAlign * kAlign;
  size_ = static_cast<int64_t>(buf.size_bytes()) - static_cast<int64_t>(base_ - raw);
  if (size_ < 0) size_ = 0;
}

void* Workspace::Take(int64_t bytes) {
  void* p = reinterpret_cast<void*>(base_ + used_);
  used_ += RoundUp(bytes, kAlign);
  return p;
}

ffi::Error Workspace::Check(const Problem& p) const {
  if (used_ > size_) {
    return InvalidArgument(p.Describe() + ": the workspace result is too small: this GEMM needs " +
                           std::to_string(used_) + " bytes of scratch plus cuBLASLt's workspace (32 MiB), but " +
                           std::to_string(size_) + " bytes are usable; size it as docs/gemm_ffi.md, section "
                           "\"Workspace\", says");
  }
  return ffi::Error::Success();
}

void* Workspace::cublas_workspace() const { return reinterpret_cast<void*>(base_ + used_); }

size_t Workspace::cublas_bytes() const {
  return used_ >= size_ ? 0 : static_cast<size_t>((size_ - used_) / kAlign * kAlign);
}

ffi::Error Launched(cudaError_t status, const char* kernel, const Problem& p) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("te_jax GEMM: launching ") + kernel + " failed with " +
                              cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ") for " + p.Describe());
}

}  // namespace gemm
}  // namespace te_jax
