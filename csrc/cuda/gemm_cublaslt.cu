// cuBLASLt plans: creation, autotuning (once per configuration) and execution
// (see gemm_cublaslt.cuh).
//
// Autotuning
// ----------
// When a plan is built, cublasLtMatmulAlgoGetHeuristic is asked for up to
// kMaxCandidates algorithms that fit the workspace. Unless autotuning is off
// (environment variable TE_JAX_GEMM_AUTOTUNE=0, read once per process), only
// one candidate is usable, or the call's stream is being captured into a CUDA
// graph (cudaStreamIsCapturing), the candidates are timed on the call's own
// stream (TimeCandidates: each candidate's second call sizes its samples;
// a warm-up of kWarmMs brings the GPU to its power cap, unless this device
// finished a long enough autotuning less than kStillWarmSeconds ago; then
// kRounds rounds of samples of back-to-back calls, the median sample per
// candidate), with the call's real operands, scales, bias and alpha, writing
// the first matmul's D and the cuBLASLt workspace: both belong to this GEMM
// (its output or staging buffer, its scratch), and the real matmuls are
// enqueued afterwards, so they overwrite whatever the candidates wrote; the
// scratch regions the handlers filled before (converted scales, dequantized
// operands) are never touched. The host waits after each sizing call and
// each round (a one-time stall of the stream's host-side dispatch per
// configuration). The
// heuristic's order wins ties within kMargin, so timing noise on small
// problems does not flip the choice between runs. Candidates that
// cuBLASLt refuses are skipped (if all are refused, the first one's error is
// returned). TE_JAX_GEMM_AUTOTUNE=verbose prints each decision to stderr.
//
// CUDA graphs: while the stream is being captured, nothing is timed (recording
// events and running candidates would become graph nodes, and synchronising
// on them is illegal); the plan takes the heuristic's first algorithm and
// keeps it for the process, like every plan keeps its algorithm, so a
// configuration never changes algorithm (and result bits) once chosen. The
// steady state (a built plan) neither allocates nor synchronises.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../common/ffi_common.h"
#include "lt_algo_config.h"
#include "gemm_cublaslt.cuh"

namespace te_jax {
namespace gemm {
namespace {

constexpr int kMaxCandidates = 16;  // heuristic results considered by the autotuner
constexpr float kMargin = 0.02f;    // a later candidate must be this much faster to win

// Everything that selects a descriptor, layouts or algorithm.
using PlanKey = std::array<int64_t, 21>;

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

// TE_JAX_GEMM_AUTOTUNE: "0" off, "verbose" on and logged, anything else (or unset) on.
enum class Autotune : int { kOff = 0, kOn = 1, kVerbose = 2 };
Autotune AutotuneMode() {
  static const Autotune mode = [] {
    const char* v = std::getenv("TE_JAX_GEMM_AUTOTUNE");
    if (v == nullptr) return Autotune::kOn;
    if (std::strcmp(v, "0") == 0) return Autotune::kOff;
    if (std::strcmp(v, "verbose") == 0) return Autotune::kVerbose;
    return Autotune::kOn;
  }();
  return mode;
}

ffi::Error LtError(const char* what, cublasStatus_t status, const MatmulSpec& spec) {
  return ffi::Error::Internal(std::string("te_jax GEMM: ") + what + " failed with " +
                              cublasLtGetStatusName(status) + " (" + cublasLtGetStatusString(status) +
                              ") for " + ShapeString(spec));
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

// Enqueues one matmul with `algo` (the pointer attributes must be set).
cublasStatus_t Enqueue(const Plan& plan, const MatmulSpec& s, const MatmulPointers& p,
                       const cublasLtMatmulAlgo_t& algo, cudaStream_t stream) {
  static const float kOne = 1.0f, kZero = 0.0f;
  const void* alpha = s.device_alpha ? static_cast<const void*>(p.alpha) : &kOne;
  const void* beta = s.device_alpha ? static_cast<const void*>(p.beta) : &kZero;
  // beta is 0: C (= D, same layout) is never read.
  return cublasLtMatmul(plan.handle, plan.desc, alpha, p.b, plan.lt_a, p.a, plan.lt_b, beta, p.d, plan.lt_d, p.d,
                        plan.lt_d, &algo, p.workspace, s.workspace_bytes, stream);
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

// "M=.. N=.. K=.. batch=.. calls=.. A/B/D types .. fast_accum=.." for the autotuning log.
std::string Describe(const MatmulSpec& s, int64_t calls) {
  return ShapeString(s) + " calls=" + std::to_string(calls) + " types(A,B,D)=(" +
         std::to_string(static_cast<int>(s.a_type)) + "," + std::to_string(static_cast<int>(s.b_type)) + "," +
         std::to_string(static_cast<int>(s.d_type)) + ") fast_accum=" + std::to_string(s.fast_accum) +
         " bias=" + std::to_string(s.bias);
}

// Events for one candidate's timed runs, destroyed with the tuner.
class Events {
 public:
  ~Events() {
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  cudaError_t Create(int n) {
    events_.assign(n, nullptr);
    for (cudaEvent_t& e : events_) {
      const cudaError_t status = cudaEventCreate(&e);
      if (status != cudaSuccess) return status;
    }
    return cudaSuccess;
  }
  cudaEvent_t operator[](int i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

// Timing of autotuning candidates (see "Autotuning" above).
constexpr int kRounds = 5;              // every candidate is sampled once per round
constexpr float kWarmMs = 200.0f;       // GPU time of back-to-back calls before the first sample
constexpr float kSampleMs = 2.0f;       // a sample is at least this much GPU time of back-to-back calls
constexpr int kMaxRunsPerSample = 64;
constexpr int kMaxWarmRuns = 1 << 15;
constexpr double kStillWarmSeconds = 1.0;  // a plan built this soon after a hot one skips the warm-up
constexpr int kMaxDevices = 64;

// Host time (microseconds, steady clock; 0: never) when the last autotuning
// that kept the device busy for kWarmMs or more ended, per device.
std::atomic<int64_t>& LastHotAutotuneEndUs(int device) {
  static std::array<std::atomic<int64_t>, kMaxDevices> t{};
  return t[static_cast<size_t>(device) % kMaxDevices];
}

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool DeviceStillHot(int device) {
  const int64_t last = LastHotAutotuneEndUs(device).load();
  return last != 0 && NowUs() - last <= static_cast<int64_t>(kStillWarmSeconds * 1e6);
}

// Runs `runs` calls of `algo` between events `start` and `stop`; the cuBLASLt status of the first refusal.
cublasStatus_t TimedCalls(const Plan& plan, const MatmulSpec& s, const MatmulPointers& p,
                          const cublasLtMatmulAlgo_t& algo, int runs, cudaEvent_t start, cudaEvent_t stop,
                          cudaStream_t stream, cudaError_t* cuda_status) {
  *cuda_status = cudaEventRecord(start, stream);
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  for (int r = 0; r < runs && *cuda_status == cudaSuccess && status == CUBLAS_STATUS_SUCCESS; ++r) {
    status = Enqueue(plan, s, p, algo, stream);
  }
  if (*cuda_status == cudaSuccess) *cuda_status = cudaEventRecord(stop, stream);
  return status;
}

float ElapsedMs(cudaEvent_t start, cudaEvent_t stop) {
  float t = std::numeric_limits<float>::infinity();
  if (cudaEventElapsedTime(&t, start, stop) != cudaSuccess) {
    cudaGetLastError();  // ours, and not sticky: do not leave it for the next launch check
    return std::numeric_limits<float>::infinity();
  }
  return t;
}

// Times every candidate on `stream` (the pointer attributes are set) and
// returns the index of the one to keep. An H200 under FP8 GEMMs runs at its
// power cap with lower clocks, and candidates may rank differently in a short
// burst; so the GPU is first kept busy for kWarmMs, then every candidate is
// sampled in kRounds rounds (the first candidate of a round rotating), each
// sample kSampleMs of back-to-back calls (fewer for GEMMs under
// kSampleMs / kMaxRunsPerSample), and a candidate's time is its median sample.
ffi::ErrorOr<size_t> TimeCandidates(const Plan& plan, const MatmulSpec& s, const MatmulPointers& p,
                                    const std::vector<cublasLtMatmulAlgo_t>& candidates, int64_t calls,
                                    cudaStream_t stream) {
  const size_t n = candidates.size();
  Events ev;
  cudaError_t cuda_status = ev.Create(static_cast<int>(2 * n));
  if (cuda_status != cudaSuccess) {  // cannot time: keep the heuristic's first algorithm
    cudaGetLastError();
    return size_t{0};
  }
  auto broken = [&](cudaError_t status) {  // a failed launch or a broken context: not a candidate's fault
    cudaGetLastError();
    return ffi::Unexpected(CudaError("GEMM autotuning", status, ShapeString(s)));
  };
  constexpr float kNever = std::numeric_limits<float>::infinity();
  // Two calls of each candidate: the first finds the refusals (and pays for
  // loading the kernel), the second, timed, sizes the samples.
  std::vector<int> runs(n, 0);  // 0: refused
  std::vector<float> once(n, kNever);
  cublasStatus_t first_refusal = CUBLAS_STATUS_SUCCESS;
  for (size_t c = 0; c < n; ++c) {
    cublasStatus_t status = Enqueue(plan, s, p, candidates[c], stream);
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = TimedCalls(plan, s, p, candidates[c], 1, ev[0], ev[1], stream, &cuda_status);
    }
    if (cuda_status == cudaSuccess) cuda_status = cudaStreamSynchronize(stream);
    if (cuda_status != cudaSuccess) return broken(cuda_status);
    if (status != CUBLAS_STATUS_SUCCESS) {  // cuBLASLt refused this algorithm for these operands
      if (first_refusal == CUBLAS_STATUS_SUCCESS) first_refusal = status;
      continue;
    }
    once[c] = std::max(ElapsedMs(ev[0], ev[1]), 1e-3f);
    runs[c] = std::clamp(static_cast<int>(std::ceil(kSampleMs / once[c])), 1, kMaxRunsPerSample);
  }
  // A candidate refused later (it ran before, so unexpected) is dropped like one refused at once.
  auto refuse = [&](size_t c, cublasStatus_t status) {
    runs[c] = 0;
    if (first_refusal == CUBLAS_STATUS_SUCCESS) first_refusal = status;
  };
  auto usable_now = [&] {
    std::vector<size_t> u;
    for (size_t c = 0; c < n; ++c) {
      if (runs[c] > 0) u.push_back(c);
    }
    return u;
  };
  std::vector<size_t> usable = usable_now();
  if (usable.empty()) return ffi::Unexpected(LtError("cublasLtMatmul (every autotuning candidate)", first_refusal, s));
  float busy_ms = 0.0f;  // GPU time of this autotuning's warm-up and samples
  if (!DeviceStillHot(s.device)) {
    const size_t c = usable[0];
    const int warm_runs = std::clamp(static_cast<int>(std::ceil(kWarmMs / once[c])), 1, kMaxWarmRuns);
    const cublasStatus_t status = TimedCalls(plan, s, p, candidates[c], warm_runs, ev[0], ev[1], stream, &cuda_status);
    if (cuda_status == cudaSuccess) cuda_status = cudaStreamSynchronize(stream);
    if (cuda_status != cudaSuccess) return broken(cuda_status);
    if (status != CUBLAS_STATUS_SUCCESS) refuse(c, status);
    busy_ms += std::isfinite(ElapsedMs(ev[0], ev[1])) ? ElapsedMs(ev[0], ev[1]) : 0.0f;
  }
  std::vector<std::vector<float>> samples(n);
  for (int round = 0; round < kRounds; ++round) {
    usable = usable_now();
    if (usable.empty()) {
      return ffi::Unexpected(LtError("cublasLtMatmul (every autotuning candidate)", first_refusal, s));
    }
    std::vector<cublasStatus_t> status(n, CUBLAS_STATUS_SUCCESS);
    for (size_t j = 0; j < usable.size(); ++j) {
      const size_t c = usable[(j + round) % usable.size()];
      status[c] = TimedCalls(plan, s, p, candidates[c], runs[c], ev[2 * c], ev[2 * c + 1], stream, &cuda_status);
      if (cuda_status != cudaSuccess) return broken(cuda_status);
    }
    cuda_status = cudaStreamSynchronize(stream);
    if (cuda_status != cudaSuccess) return broken(cuda_status);
    for (size_t c : usable) {
      if (status[c] != CUBLAS_STATUS_SUCCESS) {
        refuse(c, status[c]);
        continue;
      }
      const float t = ElapsedMs(ev[2 * c], ev[2 * c + 1]);
      samples[c].push_back(t / static_cast<float>(runs[c]));
      if (std::isfinite(t)) busy_ms += t;
    }
  }
  if (busy_ms >= kWarmMs) LastHotAutotuneEndUs(s.device).store(NowUs());
  std::vector<float> ms(n, kNever);
  for (size_t c = 0; c < n; ++c) {
    if (runs[c] == 0 || samples[c].empty()) continue;
    std::sort(samples[c].begin(), samples[c].end());
    ms[c] = samples[c][samples[c].size() / 2];
  }
  size_t best = n;
  for (size_t c = 0; c < n; ++c) {  // the heuristic's order wins within kMargin
    if (ms[c] == kNever) continue;
    if (best == n || ms[c] < ms[best] * (1.0f - kMargin)) best = c;
  }
  if (best == n) return size_t{0};  // ran, but no timing came back
  if (AutotuneMode() == Autotune::kVerbose) {
    std::fprintf(stderr, "te_jax GEMM autotune %s: %zu candidates, heuristic #0 %.4f ms, chose #%zu %.4f ms\n",
                 Describe(s, calls).c_str(), n, static_cast<double>(ms[0]), best,
                 static_cast<double>(ms[best]));  // "inf" for #0: cuBLASLt refused it
    for (size_t c = 0; c < n; ++c) {
      std::fprintf(stderr, "  #%zu %.4f ms (%d calls per sample) %s\n", c, static_cast<double>(ms[c]), runs[c],
                   AlgoConfig(candidates[c]).c_str());
    }
  }
  return best;
}

ffi::Error BuildPlan(Plan& plan, const MatmulSpec& s, const Alignments& al, const MatmulPointers& p, int64_t calls,
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
  plan.algo = candidates[0];
  if (candidates.size() == 1 || AutotuneMode() == Autotune::kOff) return ffi::Error::Success();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();
    capture = cudaStreamCaptureStatusInvalidated;  // unknown: do not time
  }
  if (capture != cudaStreamCaptureStatusNone) {
    if (AutotuneMode() == Autotune::kVerbose) {
      std::fprintf(stderr, "te_jax GEMM autotune %s: stream capture in progress, using heuristic #0 untimed\n",
                   Describe(s, calls).c_str());
    }
    return ffi::Error::Success();
  }
  auto best = TimeCandidates(plan, s, p, candidates, calls, stream);
  if (best.has_error()) return best.error();
  plan.algo = candidates[best.value()];
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

// The plan for `key`, created empty (not ready) if new.
Plan* PlanSlot(const PlanKey& key) {
  std::lock_guard<std::mutex> lock(CacheMutex());
  std::unique_ptr<Plan>& slot = Plans()[key];
  if (!slot) slot = std::make_unique<Plan>();
  return slot.get();
}

MatmulPointers Advance(const MatmulPointers& first, const MatmulSteps& st, int64_t i) {
  auto at = [i](const void* p, int64_t step) -> const void* {
    return p == nullptr ? nullptr : static_cast<const uint8_t*>(p) + i * step;
  };
  MatmulPointers p = first;
  p.a = at(first.a, st.a);
  p.b = at(first.b, st.b);
  p.d = const_cast<void*>(at(first.d, st.d));
  p.a_scale = at(first.a_scale, st.a_scale);
  p.b_scale = at(first.b_scale, st.b_scale);
  p.alpha = static_cast<const float*>(at(first.alpha, st.alpha));
  p.beta = static_cast<const float*>(at(first.beta, st.alpha));
  return p;
}

}  // namespace

ffi::Error RunMatmuls(const MatmulSpec& spec, const MatmulPointers& first, const MatmulSteps& steps,
                      cudaStream_t stream) {
  if (steps.calls < 1) return ffi::Error::Success();
  const Alignments al = AlignmentsOf(spec, first, steps);
  Plan& plan = *PlanSlot(KeyOf(spec, al));
  std::lock_guard<std::mutex> lock(plan.mu);
  if (!plan.ready) {
    RelaxedCapture relaxed;  // one-time host work may allocate (cublasLtCreate, events)
    ffi::Error err = BuildPlan(plan, spec, al, first, steps.calls, stream);
    if (err.failure()) {
      DestroyPartialPlan(plan);
      return err;
    }
    plan.ready = true;
  }
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

ffi::Error CudaError(const char* what, cudaError_t status, const std::string& shape) {
  return ffi::Error::Internal(std::string("te_jax GEMM: ") + what + " failed with " + cudaGetErrorName(status) +
                              " (" + cudaGetErrorString(status) + ") for " + shape);
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
