// cuBLASLt autotuning: which of a plan's heuristic candidates it keeps (see
// gemm_autotune.cuh; plans themselves are in gemm_cublaslt.cu).
//
// Autotuning
// ----------
// Plans are built in the GEMM handlers' FFI initialize stage (PlanMatmuls),
// before the execution runs: the buffers have their real addresses, but the
// operands are not computed yet and the handler's own kernels (scale
// conversions, dequantization, the NVFP4 alpha) have not run. When a plan is
// built, cublasLtMatmulAlgoGetHeuristic is asked for up to kMaxCandidates
// algorithms that fit the workspace. When the GEMM asks for autotuning (the
// `autotune` attribute, MatmulSpec::autotune; off by default, so a
// configuration always gets the heuristic's first algorithm), more than one
// candidate is usable and the stream is not being captured into a CUDA graph
// (cudaStreamIsCapturing), the candidates are timed on the stream
// (TimeCandidates: each candidate's second call sizes its samples; a warm-up
// of kWarmMs brings the GPU to its power cap, unless this device finished a
// long enough autotuning less than kStillWarmSeconds ago; then kRounds rounds
// of samples of back-to-back calls, the median sample per candidate) with the
// call's pointers. Timing speed does not depend on the bytes the operands and
// scales hold; device alpha/beta (NVFP4) are set to 1 and 0 first, so no
// candidate reads C. The candidates write the first matmul's D and the
// cuBLASLt workspace. The workspace is scratch of this GEMM, but D may be an
// output XLA placed in a donated input's buffer, which the program has not
// read yet: D's bytes are therefore copied to the host before the timing and
// written back after it (SavedBytes). The host waits after each sizing call
// and each round (a one-time stall per configuration). The heuristic's order
// wins ties within kMargin, so timing noise on small problems does not flip
// the choice between runs. Candidates that cuBLASLt refuses are skipped (if
// all are refused, the first one's error is returned).
//
// A stream being captured (a caller capturing XLA's whole execution) is never
// timed on (events and candidate runs would become graph nodes, and
// synchronising on them is illegal): the plan takes the heuristic's first
// algorithm. Every plan keeps its algorithm for the process, so a
// configuration never changes algorithm (and result bits) once chosen.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../common/ffi_common.h"
#include "gemm_autotune.cuh"

namespace te_jax {
namespace gemm {
namespace {

constexpr float kMargin = 0.02f;  // a later candidate must be this much faster to win

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

// Bytes of device memory kept on the host and written back (see "Autotuning").
class SavedBytes {
 public:
  ffi::Error Save(void* device, size_t bytes, cudaStream_t stream, const MatmulSpec& s) {
    device_ = device;
    host_.resize(bytes);
    return Copied(cudaMemcpyAsync(host_.data(), device_, bytes, cudaMemcpyDeviceToHost, stream), stream,
                  "saving D across GEMM autotuning", s);
  }
  ffi::Error Restore(cudaStream_t stream, const MatmulSpec& s) {
    return Copied(cudaMemcpyAsync(device_, host_.data(), host_.size(), cudaMemcpyHostToDevice, stream), stream,
                  "restoring D after GEMM autotuning", s);
  }

 private:
  // Waits for the copy: the host buffer must outlive it.
  static ffi::Error Copied(cudaError_t status, cudaStream_t stream, const char* what, const MatmulSpec& s) {
    if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
    if (status != cudaSuccess) {
      cudaGetLastError();
      return CudaError(what, status, ShapeString(s));
    }
    return ffi::Error::Success();
  }

  void* device_ = nullptr;
  std::vector<uint8_t> host_;
};

// The first call's device alpha and beta set to 1 and 0 (they are scratch the
// execute stage computes; a garbage beta would make candidates read C).
ffi::Error SetAlphaBeta(const MatmulPointers& p, cudaStream_t stream, const MatmulSpec& s) {
  static const float kOne = 1.0f, kZero = 0.0f;
  cudaError_t status = cudaMemcpyAsync(p.alpha, &kOne, sizeof(float), cudaMemcpyHostToDevice, stream);
  if (status == cudaSuccess) status = cudaMemcpyAsync(p.beta, &kZero, sizeof(float), cudaMemcpyHostToDevice, stream);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return CudaError("setting alpha and beta for GEMM autotuning", status, ShapeString(s));
  }
  return ffi::Error::Success();
}

// Times every candidate on `stream` (the pointer attributes are set) and
// returns the index of the one to keep. An H200 under FP8 GEMMs runs at its
// power cap with lower clocks, and candidates may rank differently in a short
// burst; so the GPU is first kept busy for kWarmMs, then every candidate is
// sampled in kRounds rounds (the first candidate of a round rotating), each
// sample kSampleMs of back-to-back calls (fewer for GEMMs under
// kSampleMs / kMaxRunsPerSample), and a candidate's time is its median sample.
ffi::ErrorOr<size_t> TimeCandidates(const Plan& plan, const MatmulSpec& s, const MatmulPointers& p,
                                    const std::vector<cublasLtMatmulAlgo_t>& candidates, cudaStream_t stream) {
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
  return best;
}

}  // namespace

ffi::ErrorOr<size_t> ChooseCandidate(const Plan& plan, const MatmulSpec& s, const MatmulPointers& p,
                                     const std::vector<cublasLtMatmulAlgo_t>& candidates, cudaStream_t stream) {
  if (candidates.size() == 1 || !s.autotune) return size_t{0};
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();
    capture = cudaStreamCaptureStatusInvalidated;  // unknown: do not time
  }
  if (capture != cudaStreamCaptureStatusNone) return size_t{0};
  const size_t d_bytes = static_cast<size_t>(s.batch * s.m * s.n * (s.d_type == CUDA_R_32F ? 4 : 2));
  SavedBytes saved_d;
  TE_RETURN_IF_ERROR_OR(saved_d.Save(p.d, d_bytes, stream, s));
  if (s.device_alpha) TE_RETURN_IF_ERROR_OR(SetAlphaBeta(p, stream, s));
  auto best = TimeCandidates(plan, s, p, candidates, stream);
  TE_RETURN_IF_ERROR_OR(saved_d.Restore(stream, s));
  return best;
}

}  // namespace gemm
}  // namespace te_jax
