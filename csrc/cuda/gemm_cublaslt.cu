// cuBLASLt plans: creation, caches and execution (see gemm_cublaslt.cuh).
// Autotuning, the choice among the heuristic's algorithms: gemm_autotune.cu.
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../common/ffi_common.h"
#include "cuda_common.cuh"
#include "gemm_autotune.cuh"
#include "gemm_cublaslt.cuh"

namespace te_jax {
namespace gemm {

// Declared (opaque) in gemm_autotune.cuh.
struct Plan {
  std::mutex mu;       // serialises building, and "set pointer attributes, then enqueue"
  bool ready = false;  // built (a failed build leaves it false: the next call retries)
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lt_a = nullptr;  // cuBLAS-A = our B
  cublasLtMatrixLayout_t lt_b = nullptr;  // cuBLAS-B = our A
  cublasLtMatrixLayout_t lt_d = nullptr;  // C and D
  cublasLtMatmulAlgo_t algo{};
};

namespace {

constexpr int kMaxCandidates = 16;  // heuristic results considered by the autotuner

// Everything that selects a descriptor, layouts or algorithm.
using PlanKey = std::array<int64_t, 22>;

// The alignment (bytes, a power of two up to 256) every matrix of a
// RunMatmuls call is guaranteed to have, per pointer.
struct Alignments {
  int64_t a = 256, b = 256, d = 256, a_scale = 256, b_scale = 256, bias = 256, alpha = 256;
};

// Process-lifetime caches (never destroyed: tearing cuBLASLt down at exit can
// race with the CUDA runtime's own teardown). The cache mutex only guards the
// map; a plan is built under its own mutex, so building (and autotuning, which
// waits on its stream) never blocks another device's thread.
std::mutex& CacheMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<PlanKey, std::unique_ptr<Plan>>& Plans() {
  static auto* plans = new std::map<PlanKey, std::unique_ptr<Plan>>;
  return *plans;
}
std::mutex& HandleMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<int, cublasLtHandle_t>& Handles() {
  static auto* handles = new std::map<int, cublasLtHandle_t>;
  return *handles;
}

#define TE_LT_CHECK(call, spec)                                                       \
  do {                                                                                \
    const cublasStatus_t _te_status = (call);                                         \
    if (_te_status != CUBLAS_STATUS_SUCCESS) return LtError(#call, _te_status, spec); \
  } while (0)

// Largest power of two (up to 256) dividing the address and both strides.
int64_t AlignmentOf(const void* p, int64_t stride_bytes = 0, int64_t step_bytes = 0) {
  const uint64_t v = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(stride_bytes) |
                     static_cast<uint64_t>(step_bytes) | 256u;
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

// Every pointer's alignment over all `steps.calls` matmuls: the first
// pointer's, lowered by the strided-batch stride and by the per-call step.
Alignments AlignmentsOf(const MatmulSpec& s, const MatmulPointers& p, const MatmulSteps& st) {
  const bool strided = s.batch > 1;
  const bool loop = st.calls > 1;
  Alignments al;
  al.a = AlignmentOf(p.a, strided ? MatrixBytes(s.a_type, s.m, s.k) : 0, loop ? st.a : 0);
  al.b = AlignmentOf(p.b, strided ? MatrixBytes(s.b_type, s.n, s.k) : 0, loop ? st.b : 0);
  al.d = AlignmentOf(p.d, strided ? MatrixBytes(s.d_type, s.m, s.n) : 0, loop ? st.d : 0);
  al.a_scale = AlignmentOf(p.a_scale, 0, loop ? st.a_scale : 0);
  al.b_scale = AlignmentOf(p.b_scale, 0, loop ? st.b_scale : 0);
  al.bias = AlignmentOf(p.bias);
  al.alpha = AlignmentOf(p.alpha, 0, loop ? st.alpha : 0);
  return al;
}

PlanKey KeyOf(const MatmulSpec& s, const Alignments& al) {
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
                 s.autotune,
                 s.bias,
                 s.device_alpha,
                 static_cast<int64_t>(s.workspace_bytes),
                 al.a,
                 al.b,
                 al.d,
                 al.a_scale,
                 al.b_scale,
                 al.bias,
                 al.alpha};
}

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  ~Preference() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  }
};

// Frees what a failed build created and resets the plan so that the next call retries.
void DestroyPartialPlan(Plan& plan) {
  if (plan.desc != nullptr) cublasLtMatmulDescDestroy(plan.desc);
  for (cublasLtMatrixLayout_t layout : {plan.lt_a, plan.lt_b, plan.lt_d}) {
    if (layout != nullptr) cublasLtMatrixLayoutDestroy(layout);
  }
  plan.desc = nullptr;
  plan.lt_a = plan.lt_b = plan.lt_d = nullptr;
  plan.ready = false;
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
  std::lock_guard<std::mutex> lock(HandleMutex());
  auto& handles = Handles();
  auto it = handles.find(spec.device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t status = cublasLtCreate(&handle);
  if (status != CUBLAS_STATUS_SUCCESS) return ffi::Unexpected(LtError("cublasLtCreate", status, spec));
  handles.emplace(spec.device, handle);
  return handle;
}

ffi::Error BuildPlan(Plan& plan, const MatmulSpec& s, const Alignments& al, const MatmulPointers& p,
                     cudaStream_t stream) {
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
  // The heuristic may look at pointer values, and the autotuner runs, so set real ones.
  TE_RETURN_IF_ERROR(SetPointers(plan, s, p));

  Preference pref;
  TE_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref.pref), s);
  const uint64_t ws = s.workspace_bytes;
  TE_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                   sizeof(ws)), s);
  // The guaranteed alignments of every matrix the plan serves (not just the first one's).
  const uint32_t align[4] = {static_cast<uint32_t>(al.b),   // cuBLAS-A = our B
                             static_cast<uint32_t>(al.a),   // cuBLAS-B = our A
                             static_cast<uint32_t>(al.d),   // C (= D)
                             static_cast<uint32_t>(al.d)};  // D
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    TE_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.pref, align_attrs[i], &align[i], sizeof(align[i])), s);
  }
  std::array<cublasLtMatmulHeuristicResult_t, kMaxCandidates> results{};
  int found = 0;
  TE_LT_CHECK(cublasLtMatmulAlgoGetHeuristic(plan.handle, plan.desc, plan.lt_a, plan.lt_b, plan.lt_d, plan.lt_d,
                                             pref.pref, kMaxCandidates, results.data(), &found), s);
  std::vector<cublasLtMatmulAlgo_t> candidates;
  for (int i = 0; i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= ws) {
      candidates.push_back(results[i].algo);
    }
  }
  if (candidates.empty()) {
    return ffi::Error::Internal("te_jax GEMM: cuBLASLt found no algorithm for " + ShapeString(s) +
                                " (check the dtype pairing, scale modes and the device's support for them)");
  }
  auto best = ChooseCandidate(plan, s, p, candidates, stream);
  if (best.has_error()) return best.error();
  plan.algo = candidates[best.value()];
  return ffi::Error::Success();
}

// RunMatmuls without a plan: the handler's initialize stage did not run for
// these buffers (or failed, and XLA reported that error first).
ffi::Error MissingPlan(const MatmulSpec& s) {
  return ffi::Error::Internal(
      "te_jax GEMM: no cuBLASLt plan for " + ShapeString(s) +
      ": plans are built in the custom call's FFI initialize stage, which XLA runs before every execution with "
      "the same buffers; this execution did not run it for these buffers. A custom call wrapped by "
      "--xla_gpu_enable_dynamic_slice_fusion=true is one known case: leave that flag at its default (false)");
}

// The plan for `key`, created empty (not ready) if new.
Plan* PlanSlot(const PlanKey& key) {
  std::lock_guard<std::mutex> lock(CacheMutex());
  std::unique_ptr<Plan>& slot = Plans()[key];
  if (!slot) slot = std::make_unique<Plan>();
  return slot.get();
}

// The plan for `key`, or null if PlanSlot never created it.
Plan* FindPlan(const PlanKey& key) {
  std::lock_guard<std::mutex> lock(CacheMutex());
  auto it = Plans().find(key);
  return it == Plans().end() ? nullptr : it->second.get();
}

// `p` advanced by i * step bytes (null stays null).
template <typename T>
T* Stepped(T* p, int64_t i, int64_t step) {
  if (p == nullptr) return nullptr;
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(i * step));
}

MatmulPointers Advance(const MatmulPointers& first, const MatmulSteps& st, int64_t i) {
  MatmulPointers p = first;
  p.a = Stepped(first.a, i, st.a);
  p.b = Stepped(first.b, i, st.b);
  p.d = Stepped(first.d, i, st.d);
  p.a_scale = Stepped(first.a_scale, i, st.a_scale);
  p.b_scale = Stepped(first.b_scale, i, st.b_scale);
  p.alpha = Stepped(first.alpha, i, st.alpha);
  p.beta = Stepped(first.beta, i, st.alpha);
  return p;
}

}  // namespace

cublasStatus_t Enqueue(const Plan& plan, const MatmulSpec& s, const MatmulPointers& p,
                       const cublasLtMatmulAlgo_t& algo, cudaStream_t stream) {
  static const float kOne = 1.0f, kZero = 0.0f;
  const void* alpha = s.device_alpha ? static_cast<const void*>(p.alpha) : &kOne;
  const void* beta = s.device_alpha ? static_cast<const void*>(p.beta) : &kZero;
  // beta is 0: C (= D, same layout) is never read.
  return cublasLtMatmul(plan.handle, plan.desc, alpha, p.b, plan.lt_a, p.a, plan.lt_b, beta, p.d, plan.lt_d, p.d,
                        plan.lt_d, &algo, p.workspace, s.workspace_bytes, stream);
}

ffi::Error PlanMatmuls(const MatmulSpec& spec, const MatmulPointers& first, const MatmulSteps& steps,
                       cudaStream_t stream) {
  if (steps.calls < 1) return ffi::Error::Success();
  const Alignments al = AlignmentsOf(spec, first, steps);
  Plan& plan = *PlanSlot(KeyOf(spec, al));
  std::lock_guard<std::mutex> lock(plan.mu);
  if (plan.ready) return ffi::Error::Success();
  cuda::RelaxedCapture relaxed;  // one-time host work may allocate (cublasLtCreate, events)
  ffi::Error err = BuildPlan(plan, spec, al, first, stream);
  if (err.failure()) {
    DestroyPartialPlan(plan);
    return err;
  }
  plan.ready = true;
  return ffi::Error::Success();
}

ffi::Error RunMatmuls(const MatmulSpec& spec, const MatmulPointers& first, const MatmulSteps& steps,
                      cudaStream_t stream) {
  if (steps.calls < 1) return ffi::Error::Success();
  Plan* found = FindPlan(KeyOf(spec, AlignmentsOf(spec, first, steps)));
  if (found == nullptr) return MissingPlan(spec);
  Plan& plan = *found;
  std::lock_guard<std::mutex> lock(plan.mu);
  if (!plan.ready) return MissingPlan(spec);
  for (int64_t i = 0; i < steps.calls; ++i) {
    const MatmulPointers p = Advance(first, steps, i);
    TE_RETURN_IF_ERROR(SetPointers(plan, spec, p));
    const cublasStatus_t status = Enqueue(plan, spec, p, plan.algo, stream);
    if (status != CUBLAS_STATUS_SUCCESS) {
      const std::string what = steps.calls > 1 ? "cublasLtMatmul (matrix " + std::to_string(i) + " of " +
                                                     std::to_string(steps.calls) + ")"
                                               : std::string("cublasLtMatmul");
      return LtError(what.c_str(), status, spec);
    }
  }
  return ffi::Error::Success();
}

std::string ShapeString(const MatmulSpec& s) {
  return "M=" + std::to_string(s.m) + " N=" + std::to_string(s.n) + " K=" + std::to_string(s.k) +
         " batch=" + std::to_string(s.batch);
}

ffi::Error LtError(const char* what, cublasStatus_t status, const MatmulSpec& spec) {
  return ffi::Error::Internal(std::string("te_jax GEMM: ") + what + " failed with " +
                              cublasLtGetStatusName(status) + " (" + cublasLtGetStatusString(status) +
                              ") for " + ShapeString(spec));
}

ffi::Error CudaError(const char* what, cudaError_t status, const std::string& shape) {
  return ffi::Error::Internal(std::string("te_jax GEMM: ") + what + " failed with " + cudaGetErrorName(status) +
                              " (" + cudaGetErrorString(status) + ") for " + shape);
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

ffi::Error DeviceGuard::Enter(int device) {
  device_ = device;
  int current = 0;
  cudaError_t status = cudaGetDevice(&current);
  if (status != cudaSuccess) return CudaError("cudaGetDevice", status, "the GEMM's device");
  if (device_ != current) {
    status = cudaSetDevice(device_);
    if (status != cudaSuccess) return CudaError("cudaSetDevice", status, "device " + std::to_string(device_));
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
