// cuBLASLt plans: creation (once per configuration) and execution (see gemm_cublaslt.cuh).
#include <array>
#include <map>
#include <memory>
#include <mutex>

#include "gemm_cublaslt.cuh"

namespace te_jax {
namespace gemm {
namespace {

// Everything that selects a descriptor, layouts or algorithm.
using PlanKey = std::array<int64_t, 20>;

struct Plan {
  std::mutex mu;  // serialises "set pointer attributes, then enqueue"
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lt_a = nullptr;  // cuBLAS-A = our B
  cublasLtMatrixLayout_t lt_b = nullptr;  // cuBLAS-B = our A
  cublasLtMatrixLayout_t lt_d = nullptr;  // C and D
  cublasLtMatmulAlgo_t algo{};
};

// Process-lifetime caches (never destroyed: tearing cuBLASLt down at exit can
// race with the CUDA runtime's own teardown).
std::mutex& CacheMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<PlanKey, std::unique_ptr<Plan>>& Plans() {
  static auto* plans = new std::map<PlanKey, std::unique_ptr<Plan>>;
  return *plans;
}
std::map<int, cublasLtHandle_t>& Handles() {
  static auto* handles = new std::map<int, cublasLtHandle_t>;
  return *handles;
}

ffi::Error LtError(const char* what, cublasStatus_t status, const MatmulSpec& spec) {
  return ffi::Error::Internal(std::string("te_jax GEMM: ") + what + " failed with " +
                              cublasLtGetStatusName(status) + " (" + cublasLtGetStatusString(status) +
                              ") for " + ShapeString(spec));
}

#define TE_LT_CHECK(call, spec)                                              \
  do {                                                                       \
    const cublasStatus_t _te_status = (call);                                \
    if (_te_status != CUBLAS_STATUS_SUCCESS) return LtError(#call, _te_status, spec); \
  } while (0)

// Largest power of two (up to 256) dividing the address and the batch stride.
int64_t AlignmentOf(const void* p, int64_t stride_bytes = 0) {
  const uint64_t v = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(stride_bytes) | 256u;
  return static_cast<int64_t>(v & (~v + 1));
}

int64_t BitsOf(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_4F_E2M1:
      return 4;
    case CUDA_R_8F_E4M3:
    case CUDA_R_8F_E5M2:
      return 8;
    case CUDA_R_16BF:
    case CUDA_R_16F:
      return 16;
    default:
      return 32;
  }
}

int64_t MatrixBytes(cudaDataType_t t, int64_t rows, int64_t cols) { return rows * cols * BitsOf(t) / 8; }

bool IsNarrow(cudaDataType_t t) { return BitsOf(t) <= 8; }

int32_t LtScaleMode(ScaleMode m) {
  switch (m) {
    case ScaleMode::kVec128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::kBlk128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case ScaleMode::kVec32Ue8m0:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    case ScaleMode::kVec16Ue4m3:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
    default:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  }
}

PlanKey KeyOf(const MatmulSpec& s, const MatmulPointers& p) {
  const int64_t a_stride = s.batch > 1 ? MatrixBytes(s.a_type, s.m, s.k) : 0;
  const int64_t b_stride = s.batch > 1 ? MatrixBytes(s.b_type, s.n, s.k) : 0;
  const int64_t d_stride = s.batch > 1 ? MatrixBytes(s.d_type, s.m, s.n) : 0;
  return PlanKey{s.device,
                 s.m,
                 s.n,
                 s.k,
                 s.batch,
                 static_cast<int64_t>(s.a_type),
                 static_cast<int64_t>(s.b_type),
                 static_cast<int64_t>(s.d_type),
                 static_cast<int64_t>(s.a_scale),
                 static_cast<int64_t>(s.b_scale),
                 s.fast_accum,
                 s.bias,
                 s.device_alpha,
                 static_cast<int64_t>(s.workspace_bytes),
                 AlignmentOf(p.a, a_stride),
                 AlignmentOf(p.b, b_stride),
                 AlignmentOf(p.d, d_stride),
                 AlignmentOf(p.a_scale),
                 AlignmentOf(p.b_scale),
                 AlignmentOf(p.bias)};
}

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  ~Preference() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  }
};

// Frees a plan whose construction failed (a built plan lives for the process).
void DestroyPartialPlan(Plan& plan) {
  if (plan.desc != nullptr) cublasLtMatmulDescDestroy(plan.desc);
  for (cublasLtMatrixLayout_t layout : {plan.lt_a, plan.lt_b, plan.lt_d}) {
    if (layout != nullptr) cublasLtMatrixLayoutDestroy(layout);
  }
}

template <typename T>
cublasStatus_t SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value));
}

// The per-call attributes: every pointer cuBLASLt reads from the descriptor.
ffi::Error SetPointers(Plan& plan, const MatmulSpec& spec, const MatmulPointers& p) {
  if (spec.b_scale != ScaleMode::kNone) {
    TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, p.b_scale), spec);
  }
  if (spec.a_scale != ScaleMode::kNone) {
    TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, p.a_scale), spec);
  }
  if (spec.bias) TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias), spec);
  return ffi::Error::Success();
}

ffi::ErrorOr<cublasLtHandle_t> HandleFor(const MatmulSpec& spec) {
  auto& handles = Handles();  // CacheMutex() is held by the caller
  auto it = handles.find(spec.device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t status = cublasLtCreate(&handle);
  if (status != CUBLAS_STATUS_SUCCESS) return ffi::Unexpected(LtError("cublasLtCreate", status, spec));
  handles.emplace(spec.device, handle);
  return handle;
}

ffi::Error BuildPlan(Plan& plan, const MatmulSpec& s, const MatmulPointers& p) {
  auto handle = HandleFor(s);
  if (handle.has_error()) return handle.error();
  plan.handle = handle.value();

  const uint64_t k = static_cast<uint64_t>(s.k), m = static_cast<uint64_t>(s.m), n = static_cast<uint64_t>(s.n);
  TE_LT_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_a, s.b_type, k, n, s.k), s);
  TE_LT_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_b, s.a_type, k, m, s.k), s);
  TE_LT_CHECK(cublasLtMatrixLayoutCreate(&plan.lt_d, s.d_type, n, m, s.n), s);
  if (s.batch > 1) {
    const int32_t count = static_cast<int32_t>(s.batch);
    const int64_t strides[3] = {s.n * s.k, s.m * s.k, s.m * s.n};  // in elements
    cublasLtMatrixLayout_t layouts[3] = {plan.lt_a, plan.lt_b, plan.lt_d};
    for (int i = 0; i < 3; ++i) {
      TE_LT_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                   sizeof(count)), s);
      TE_LT_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                   &strides[i], sizeof(strides[i])), s);
    }
  }

  TE_LT_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), s);
  TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T), s);
  TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N), s);
  if (s.b_scale != ScaleMode::kNone && s.b_scale != ScaleMode::kScalar) {
    TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, LtScaleMode(s.b_scale)), s);
  }
  if (s.a_scale != ScaleMode::kNone && s.a_scale != ScaleMode::kScalar) {
    TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, LtScaleMode(s.a_scale)), s);
  }
  if (s.a_scale == ScaleMode::kScalar) {
    TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(s.fast_accum)), s);
  }
  if (s.device_alpha) {
    TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_DEVICE), s);
  }
  const cublasLtEpilogue_t epilogue = s.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue), s);
  if (s.bias && IsNarrow(s.a_type)) {
    TE_LT_CHECK(SetDesc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(s.d_type)), s);
  }
  // The heuristic may look at pointer values (alignment), so it sees real ones.
  ffi::Error ptr_status = SetPointers(plan, s, p);
  if (ptr_status.failure()) return ptr_status;

  Preference pref;
  TE_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref.pref), s);
  const uint64_t ws = s.workspace_bytes;
  TE_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                   sizeof(ws)), s);
  const bool strided = s.batch > 1;
  const uint32_t align[3] = {
      static_cast<uint32_t>(AlignmentOf(p.b, strided ? MatrixBytes(s.b_type, s.n, s.k) : 0)),   // cuBLAS-A
      static_cast<uint32_t>(AlignmentOf(p.a, strided ? MatrixBytes(s.a_type, s.m, s.k) : 0)),   // cuBLAS-B
      static_cast<uint32_t>(AlignmentOf(p.d, strided ? MatrixBytes(s.d_type, s.m, s.n) : 0))};  // C and D
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    const uint32_t value = align[i < 3 ? i : 2];
    TE_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, align_attrs[i], &value, sizeof(value)), s);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  TE_LT_CHECK(cublasLtMatmulAlgoGetHeuristic(plan.handle, plan.desc, plan.lt_a, plan.lt_b, plan.lt_d, plan.lt_d,
                                             pref.pref, 1, &result, &found), s);
  if (found == 0) {
    return ffi::Error::Internal("te_jax GEMM: cuBLASLt found no algorithm for " + ShapeString(s) +
                                " (check the dtype pairing, scale modes and the device's support for them)");
  }
  plan.algo = result.algo;
  return ffi::Error::Success();
}

// Restores the thread's stream-capture mode on scope exit.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

ffi::ErrorOr<Plan*> PlanFor(const MatmulSpec& spec, const MatmulPointers& ptrs) {
  const PlanKey key = KeyOf(spec, ptrs);
  std::lock_guard<std::mutex> lock(CacheMutex());
  auto& plans = Plans();
  auto it = plans.find(key);
  if (it != plans.end()) return it->second.get();
  RelaxedCapture relaxed;  // one-time host work may allocate (cublasLtCreate)
  auto plan = std::make_unique<Plan>();
  ffi::Error err = BuildPlan(*plan, spec, ptrs);
  if (err.failure()) {
    DestroyPartialPlan(*plan);
    return ffi::Unexpected(std::move(err));
  }
  Plan* raw = plan.get();
  plans.emplace(key, std::move(plan));
  return raw;
}

}  // namespace

std::string ShapeString(const MatmulSpec& s) {
  return "M=" + std::to_string(s.m) + " N=" + std::to_string(s.n) + " K=" + std::to_string(s.k) +
         " batch=" + std::to_string(s.batch);
}

ffi::Error CudaError(const char* what, cudaError_t status, const std::string& shape) {
  return ffi::Error::Internal(std::string("te_jax GEMM: ") + what + " failed with " + cudaGetErrorName(status) +
                              " (" + cudaGetErrorString(status) + ") for " + shape);
}

ffi::Error RunMatmul(const MatmulSpec& spec, const MatmulPointers& ptrs, cudaStream_t stream) {
  auto plan_or = PlanFor(spec, ptrs);
  if (plan_or.has_error()) return plan_or.error();
  Plan& plan = *plan_or.value();
  static const float kOne = 1.0f, kZero = 0.0f;
  const void* alpha = spec.device_alpha ? static_cast<const void*>(ptrs.alpha) : &kOne;
  const void* beta = spec.device_alpha ? static_cast<const void*>(ptrs.beta) : &kZero;
  std::lock_guard<std::mutex> lock(plan.mu);
  ffi::Error err = SetPointers(plan, spec, ptrs);
  if (err.failure()) return err;
  TE_LT_CHECK(cublasLtMatmul(plan.handle, plan.desc, alpha, ptrs.b, plan.lt_a, ptrs.a, plan.lt_b, beta, ptrs.d,
                             plan.lt_d, ptrs.d, plan.lt_d, &plan.algo, ptrs.workspace, spec.workspace_bytes, stream),
              spec);
  return ffi::Error::Success();
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

ffi::Error DeviceGuard::Enter(cudaStream_t stream) {
  int current = 0;
  cudaError_t status = cudaGetDevice(&current);
  if (status != cudaSuccess) return CudaError("cudaGetDevice", status, "the GEMM's stream");
  status = cudaStreamGetDevice(stream, &device_);
  if (status != cudaSuccess) return CudaError("cudaStreamGetDevice", status, "the GEMM's stream");
  if (device_ != current) {
    status = cudaSetDevice(device_);
    if (status != cudaSuccess) return CudaError("cudaSetDevice", status, "the GEMM's stream");
    previous_ = current;
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<int> ComputeCapability(int device) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int major = 0, minor = 0;
  cudaError_t status = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (status != cudaSuccess) {
    return ffi::Unexpected(CudaError("cudaDeviceGetAttribute", status, "device " + std::to_string(device)));
  }
  cache[device] = major * 10 + minor;
  return major * 10 + minor;
}

size_t CublasLtVersion() { return cublasLtGetVersion(); }

}  // namespace gemm
}  // namespace te_jax
