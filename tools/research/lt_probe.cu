// A standalone cuBLASLt probe for the FP8 GEMM D[M,N] (bf16) =
// A[M,K] . B[N,K]^T with e4m3 operands, fast accumulation and scale pointers:
// every candidate algorithm of several descriptor variants, timed at the
// GPU's power cap, in turns. It compares te_jax's cuBLASLt descriptor with
// XLA's description of the same GEMM, candidate by candidate. The
// te_jax variant is te_jax's plan for 256-byte aligned buffers (te_jax lowers
// its alignment preferences for less aligned ones):
//
//   te_jax      cuBLAS A = B as K x N, column order, TRANSA=T (te_jax's plan)
//   xla_rowA    cuBLAS A = B as N x K, row order, TRANSA=N (XLA's description
//               of the same bytes, read from jaxlib 0.11.2)
//   ... ws0     the heuristic asked with no workspace and run without one
//               (XLA with its autotuning off)
//
// Each variant's cuBLAS B is A as K x M (column order, TRANSB=N) and D is
// N x M (column order): m = N, n = M for cuBLASLt in every variant.
//
// Timing: the first candidate runs for --warm-s seconds so the GPU reaches
// its power cap; then --rounds rounds, each timing --iters back-to-back calls
// of every candidate between CUDA events, the first candidate rotating. The
// median per candidate is printed with its cuBLASLt configuration, fastest
// first.
//
// --scales 1dx2d | 2dx1d | 1dx1d probes the Float8 block-scaled GEMM instead
// (our A's scales, then our B's: 1d = VEC128_32F, 2d = BLK128x128_32F; no
// fast accumulation): te_jax's descriptor only, as XLA has no such GEMM.
//
// --exhaustive N adds configurations the heuristic does not offer: every
// algorithm id with every tile and stages id it reports, the cluster shapes
// auto, 1x1, 2x1, 4x1, 1x2, 2x2, 4x2, 1x4 and 2x4, custom options 0 to
// min(its maximum, 7) and CTA swizzle off/on where supported (split-K off),
// each checked by cublasLtMatmulAlgoCheck. If more than --exhaustive-limit
// (default 2000) are accepted, that many are kept, spread over the ids (each
// id's list shuffled with a fixed seed, the ids taken in turns). The kept ones
// that are not heuristic candidates are screened by one short timing (3
// calls, after the warm-up); the N fastest join the heuristic's candidates
// (te_jax's descriptor) in the timed rounds, as "exhaust".
//
//   nvcc -O2 -std=c++17 -arch=sm_90a tools/research/lt_probe.cu -lcublasLt -o lt_probe
//   ./lt_probe 8192 28672 8192 [--scales tensor] [--exhaustive 0] [--exhaustive-limit 2000] [--iters 20]
//              [--rounds 7] [--warm-s 3]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "lt_algo_config.h"
#include "probe_common.cuh"

using te_jax::AlgoConfig;

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kMaxCandidates = 32;
// Each scale pointer gets its own 256-byte slot: cuBLASLt reads a scale pointer as a 16-byte
// aligned address, and refuses (CUBLAS_STATUS_NOT_SUPPORTED) at run time candidates the heuristic
// offered when two scales share one 8-byte allocation.
constexpr int kScaleSlot = 64;

// Roughly normal values (sum of four uniforms from a hash), times `scale`, as saturated e4m3.
__global__ void FillE4m3(__nv_fp8_e4m3* out, int64_t count, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __nv_fp8_e4m3(te_jax_probe::HashNormal(i, seed) * scale);
  }
}

struct Variant {
  const char* name;
  bool row_order_a;    // XLA's description of cuBLAS A
  size_t heuristic_ws;  // workspace limit for the heuristic, and the workspace given to the matmul
};

struct Runner {
  int variant;
  int candidate;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, ld;  // cuBLAS A (our B), cuBLAS B (our A), D
  cublasLtMatmulAlgo_t algo;
  std::string config;
  std::vector<float> ms;
};

template <typename T>
void SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

const char* ArgStr(int argc, char** argv, const char* flag, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], flag) == 0) return argv[i + 1];
  }
  return fallback;
}

int ArgInt(int argc, char** argv, const char* flag, int fallback) {
  const char* value = ArgStr(argc, argv, flag, nullptr);
  return value ? std::atoi(value) : fallback;
}

__global__ void FillFloat(float* out, int64_t count, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = value;
  }
}

template <typename T>
bool SetConfig(cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr, T value) {
  return cublasLtMatmulAlgoConfigSetAttribute(&algo, attr, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}

// A capability that is an array of uint32 ids (tiles, stages); {0} (undefined) when the algorithm lists none.
std::vector<uint32_t> CapIds(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS || bytes == 0) {
    return {0u};
  }
  std::vector<uint32_t> ids(bytes / sizeof(uint32_t));
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, ids.data(), bytes, &bytes) != CUBLAS_STATUS_SUCCESS) return {0u};
  return ids.empty() ? std::vector<uint32_t>{0u} : ids;
}

template <typename T>
T CapValue(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr, T fallback) {
  T value = fallback;
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &value, sizeof(value), &bytes) != CUBLAS_STATUS_SUCCESS) {
    return fallback;
  }
  return value;
}

// Configurations cublasLtMatmulAlgoCheck accepts for this descriptor (split-K off). Every
// combination of every algorithm id is checked; if more than `limit` are accepted, each id's list is
// shuffled (fixed seed) and the ids are taken in turns, so the kept ones spread over ids and tiles.
std::vector<cublasLtMatmulAlgo_t> EnumerateAlgos(cublasLtHandle_t lt, cublasLtMatmulDesc_t desc,
                                                 cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                                                 cublasLtMatrixLayout_t ld, size_t workspace, size_t limit) {
  int ids[256];
  int n_ids = 0;
  CHECK_LT(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF,
                                    CUDA_R_16BF, 256, ids, &n_ids));
  const uint16_t clusters[] = {0, 2, 3, 4, 5, 6, 7, 8, 9};  // auto, 1x1, 2x1, 4x1, 1x2, 2x2, 4x2, 1x4, 2x4
  std::vector<std::vector<cublasLtMatmulAlgo_t>> per_id;
  size_t checked = 0, accepted = 0;
  for (int i = 0; i < n_ids; ++i) {
    cublasLtMatmulAlgo_t base;
    if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF,
                               CUDA_R_16BF, ids[i], &base) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    const std::vector<uint32_t> tiles = CapIds(base, CUBLASLT_ALGO_CAP_TILE_IDS);
    const std::vector<uint32_t> stages = CapIds(base, CUBLASLT_ALGO_CAP_STAGES_IDS);
    const int32_t custom_max = std::min(CapValue<int32_t>(base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, 0), 7);
    const int32_t swizzle_max = CapValue<uint32_t>(base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, 0u) ? 1 : 0;
    std::vector<cublasLtMatmulAlgo_t> ok;
    size_t id_checked = 0;
    for (uint32_t tile : tiles) {
      for (uint32_t stage : stages) {
        for (uint16_t cluster : clusters) {
          for (int32_t custom = 0; custom <= custom_max; ++custom) {
            for (int32_t swizzle = 0; swizzle <= swizzle_max; ++swizzle) {
              cublasLtMatmulAlgo_t algo = base;
              if (!SetConfig(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, tile) ||
                  !SetConfig(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, stage) ||
                  !SetConfig(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster) ||
                  !SetConfig(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, static_cast<uint32_t>(custom)) ||
                  !SetConfig(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, static_cast<uint32_t>(swizzle)) ||
                  !SetConfig(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, int32_t{1})) {
                continue;
              }
              cublasLtMatmulHeuristicResult_t result = {};
              ++id_checked;
              if (cublasLtMatmulAlgoCheck(lt, desc, la, lb, ld, ld, &algo, &result) == CUBLAS_STATUS_SUCCESS &&
                  result.workspaceSize <= workspace) {
                ok.push_back(algo);
              }
            }
          }
        }
      }
    }
    checked += id_checked;
    accepted += ok.size();
    if (!ok.empty()) {
      std::printf("exhaustive: id %d: %zu tiles, %zu stages ids, %zu checked, %zu accepted\n", ids[i], tiles.size(),
                  stages.size(), id_checked, ok.size());
      std::mt19937 rng(12345u + static_cast<uint32_t>(ids[i]));
      std::shuffle(ok.begin(), ok.end(), rng);
      per_id.push_back(std::move(ok));
    }
  }
  std::vector<cublasLtMatmulAlgo_t> out;
  for (size_t j = 0; out.size() < std::min(limit, accepted); ++j) {
    for (const auto& list : per_id) {
      if (j < list.size() && out.size() < limit) out.push_back(list[j]);
    }
  }
  std::printf("exhaustive: %d algorithm ids, %zu configurations checked, %zu accepted, %zu kept\n", n_ids, checked,
              accepted, out.size());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr,
                 "usage: %s M N K [--scales tensor|1dx2d|2dx1d|1dx1d] [--exhaustive N] [--exhaustive-limit L] [--iters I] "
                 "[--rounds R] [--warm-s S]\n",
                 argv[0]);
    return 2;
  }
  const int64_t m = std::atoll(argv[1]), n = std::atoll(argv[2]), k = std::atoll(argv[3]);
  const int iters = std::max(1, ArgInt(argc, argv, "--iters", 20));
  const int rounds = std::max(1, ArgInt(argc, argv, "--rounds", 7));
  const int warm_s = std::max(0, ArgInt(argc, argv, "--warm-s", 3));
  const int exhaustive = std::max(0, ArgInt(argc, argv, "--exhaustive", 0));
  const int exhaustive_limit = std::max(1, ArgInt(argc, argv, "--exhaustive-limit", 2000));
  const std::string scales_arg = ArgStr(argc, argv, "--scales", "tensor");
  const bool block = scales_arg != "tensor";
  if (block && scales_arg != "1dx2d" && scales_arg != "2dx1d" && scales_arg != "1dx1d") {
    std::fprintf(stderr, "--scales takes tensor, 1dx2d, 2dx1d or 1dx1d, got %s\n", scales_arg.c_str());
    return 2;
  }
  const bool a_2d = scales_arg == "2dx1d", b_2d = scales_arg == "1dx2d";
  if (block && (k % 128 != 0 || (a_2d && m % 128 != 0) || (b_2d && n % 128 != 0))) {
    std::fprintf(stderr, "block scales need K (and a 128x128 operand's rows) a multiple of 128\n");
    return 2;
  }

  __nv_fp8_e4m3 *a = nullptr, *b = nullptr;
  __nv_bfloat16* d = nullptr;
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&a, m * k));
  CHECK_CUDA(cudaMalloc(&b, n * k));
  CHECK_CUDA(cudaMalloc(&d, m * n * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMalloc(&workspace, kWorkspaceBytes));
  FillE4m3<<<1024, 256>>>(a, m * k, 1u, 64.0f);
  FillE4m3<<<1024, 256>>>(b, n * k, 2u, 64.0f);
  // Per-tensor: one float each, in its own 256-byte slot. Block: enough floats for either layout
  // (1x128: [K/128, rows]; 128x128: [rows/128, round_up(K/128, 4)]), all 1/64.
  auto scale_count = [&](int64_t rows) {
    return block ? std::max((k / 128) * rows, (rows / 128 + 1) * ((k / 128 + 3) / 4 * 4)) : int64_t{kScaleSlot};
  };
  float *a_scales = nullptr, *b_scales = nullptr;
  CHECK_CUDA(cudaMalloc(&a_scales, scale_count(m) * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&b_scales, scale_count(n) * sizeof(float)));
  FillFloat<<<256, 256>>>(a_scales, scale_count(m), 1.0f / 64.0f);
  FillFloat<<<256, 256>>>(b_scales, scale_count(n), 1.0f / 64.0f);
  CHECK_CUDA(cudaDeviceSynchronize());

  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  const Variant tensor_variants[] = {{"te_jax", false, kWorkspaceBytes},
                                     {"xla_rowA", true, kWorkspaceBytes},
                                     {"te_jax ws0", false, 0},
                                     {"xla_rowA ws0", true, 0}};
  const Variant block_variants[] = {{"te_jax", false, kWorkspaceBytes}};
  const Variant* variants = block ? block_variants : tensor_variants;
  const int n_variants = block ? 1 : 4;
  const float one = 1.0f, zero = 0.0f;
  const void* a_scale_ptr = b_scales;  // cuBLAS A is our B
  const void* b_scale_ptr = a_scales;  // cuBLAS B is our A

  std::vector<Runner> runners;
  for (int v = 0; v < n_variants; ++v) {
    const Variant& var = variants[v];
    cublasLtMatmulDesc_t desc;
    CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSA, var.row_order_a ? CUBLAS_OP_N : CUBLAS_OP_T);
    SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    if (block) {
      SetDesc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
              b_2d ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
      SetDesc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
              a_2d ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
    } else {
      SetDesc(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{1});
    }
    SetDesc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale_ptr);
    SetDesc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale_ptr);
    cublasLtMatrixLayout_t la, lb, ld;
    if (var.row_order_a) {
      CHECK_LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, k, k));
      const cublasLtOrder_t row = CUBLASLT_ORDER_ROW;
      CHECK_LT(cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_ORDER, &row, sizeof(row)));
    } else {
      CHECK_LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, n, k));
    }
    CHECK_LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, m, k));
    CHECK_LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, m, n));
    cublasLtMatmulPreference_t pref;
    CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = var.heuristic_ws;
    CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t results[kMaxCandidates] = {};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, kMaxCandidates, results, &found);
    CHECK_LT(cublasLtMatmulPreferenceDestroy(pref));
    std::printf("%-13s: heuristic status %d, %d candidates\n", var.name, int(st), found);
    for (int c = 0; c < found; ++c) {
      if (results[c].state != CUBLAS_STATUS_SUCCESS || results[c].workspaceSize > ws) continue;
      runners.push_back(Runner{v, c, desc, la, lb, ld, results[c].algo, AlgoConfig(results[c].algo), {}});
    }
    if (v == 0 && exhaustive > 0) {
      int c = 0, duplicates = 0;
      for (const cublasLtMatmulAlgo_t& algo : EnumerateAlgos(lt, desc, la, lb, ld, ws, exhaustive_limit)) {
        const std::string config = AlgoConfig(algo);
        const bool offered = std::any_of(runners.begin(), runners.end(),
                                         [&](const Runner& r) { return r.variant == 0 && r.config == config; });
        if (offered) {
          ++duplicates;  // the heuristic's own candidate: timed once, under its heuristic name
          continue;
        }
        runners.push_back(Runner{-1, c++, desc, la, lb, ld, algo, config, {}});
      }
      std::printf("exhaustive: %d of the kept configurations are heuristic candidates\n", duplicates);
    }
  }
  if (runners.empty()) {
    std::fprintf(stderr, "no candidates\n");
    return 1;
  }
  auto name_of = [&](const Runner& r) { return r.variant < 0 ? "exhaust" : variants[r.variant].name; };

  auto run = [&](const Runner& r) {
    const size_t ws = r.variant < 0 ? kWorkspaceBytes : variants[r.variant].heuristic_ws;
    return cublasLtMatmul(lt, r.desc, &one, b, r.la, a, r.lb, &zero, d, r.ld, d, r.ld, &r.algo,
                          ws ? workspace : nullptr, ws, stream);
  };
  // Refused candidates are dropped before timing (exhaustive ones silently: they are many).
  std::vector<Runner> usable;
  int refused_exhaustive = 0;
  for (const Runner& r : runners) {
    const cublasStatus_t st = run(r);
    const cudaError_t ran = st == CUBLAS_STATUS_SUCCESS ? cudaStreamSynchronize(stream) : cudaGetLastError();
    if (ran != cudaSuccess && cudaStreamSynchronize(stream) != cudaSuccess) {
      // A sticky error (a fault in the kernel): nothing later can run; name the configuration.
      std::fprintf(stderr, "%-13s #%d (%s): CUDA error %s; stopping\n", name_of(r), r.candidate, r.config.c_str(),
                   cudaGetErrorString(ran));
      return 1;
    }
    if (st == CUBLAS_STATUS_SUCCESS && ran == cudaSuccess) {
      usable.push_back(r);
    } else if (r.variant < 0) {
      ++refused_exhaustive;
    } else {
      std::fprintf(stderr, "%-13s #%d refused: %s (%d), CUDA %s\n", name_of(r), r.candidate,
                   cublasLtGetStatusString(st), int(st), cudaGetErrorString(ran));
    }
  }
  if (refused_exhaustive > 0) std::printf("exhaustive: %d refused at run time\n", refused_exhaustive);
  if (usable.empty()) {
    std::fprintf(stderr, "cuBLASLt refused every candidate\n");
    return 1;
  }
  const auto warm_end = std::chrono::steady_clock::now() + std::chrono::seconds(warm_s);
  while (std::chrono::steady_clock::now() < warm_end) {
    for (int i = 0; i < 20; ++i) CHECK_LT(run(usable[0]));
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  if (exhaustive > 0) {
    // Screen the enumerated configurations: 3 back-to-back calls each, keep the `exhaustive` fastest.
    std::vector<std::pair<float, size_t>> screen;
    std::vector<Runner> kept;
    for (size_t i = 0; i < usable.size(); ++i) {
      if (usable[i].variant >= 0) {
        kept.push_back(usable[i]);
        continue;
      }
      CHECK_CUDA(cudaEventRecord(e0, stream));
      for (int it = 0; it < 3; ++it) CHECK_LT(run(usable[i]));
      CHECK_CUDA(cudaEventRecord(e1, stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float t = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
      screen.emplace_back(t / 3.0f, i);
    }
    std::sort(screen.begin(), screen.end());
    std::printf("exhaustive: %zu screened, fastest %.4f ms, slowest %.4f ms\n", screen.size(),
                screen.empty() ? 0.0f : screen.front().first, screen.empty() ? 0.0f : screen.back().first);
    for (size_t j = 0; j < screen.size() && j < static_cast<size_t>(exhaustive); ++j) {
      kept.push_back(usable[screen[j].second]);
    }
    usable.swap(kept);
  }
  std::vector<cudaEvent_t> ev(2 * usable.size());
  for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int round = 0; round < rounds; ++round) {
    for (size_t j = 0; j < usable.size(); ++j) {
      const size_t i = (j + round) % usable.size();
      CHECK_CUDA(cudaEventRecord(ev[2 * i], stream));
      for (int it = 0; it < iters; ++it) CHECK_LT(run(usable[i]));
      CHECK_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < usable.size(); ++i) {
      float t = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
      usable[i].ms.push_back(t / static_cast<float>(iters));
    }
  }
  for (Runner& r : usable) std::sort(r.ms.begin(), r.ms.end());
  std::sort(usable.begin(), usable.end(),
            [](const Runner& x, const Runner& y) { return x.ms[x.ms.size() / 2] < y.ms[y.ms.size() / 2]; });
  const double flop = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  std::printf("M=%lld N=%lld K=%lld scales %s, %d rounds of %d calls after %d s of warm-up; median ms per call:\n",
              static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), scales_arg.c_str(),
              rounds, iters, warm_s);
  for (const Runner& r : usable) {
    const float med = r.ms[r.ms.size() / 2];
    std::printf("  %.4f ms %6.0f TFLOP/s  %-13s #%d  %s  (rounds %.4f-%.4f)\n", med, flop / (med * 1e-3) / 1e12,
                name_of(r), r.candidate, r.config.c_str(), r.ms.front(), r.ms.back());
  }
  return 0;
}
