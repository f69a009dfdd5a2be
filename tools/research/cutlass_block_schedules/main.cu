// Times the registered block-scaled grouped GEMM schedules in turns at the MoE shapes (median of rounds of
// back-to-back calls, random FP8 operands and scales, balanced group sizes on the device), after checking each
// schedule's output against te_jax's (the first registered under cooperative_128x128_c1x2).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "schedules.h"

namespace bs = block_schedules;

std::vector<bs::Entry>& bs::Registry() {
  static std::vector<Entry> entries;
  return entries;
}

#define CHECK_CUDA(x)                                                               \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e));                           \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

__device__ uint32_t Mix(size_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  return h ^ (h >> 13);
}

__global__ void FillFp8(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    p[i] = static_cast<uint8_t>(Mix(i, seed) & 0xBF);  // E4M3 with exponent below 8: |x| < 2, never NaN
  }
}

__global__ void FillScales(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    p[i] = 0.5f + (Mix(i, seed) & 0xFFFF) / 65536.0f;
  }
}

// Counts the bfloat16 elements of `got` more than 1% (relative, at least 1 absolute) from `want`.
__global__ void CountMismatches(const uint16_t* got, const uint16_t* want, size_t n, unsigned long long* bad) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float x = __uint_as_float(uint32_t{got[i]} << 16), y = __uint_as_float(uint32_t{want[i]} << 16);
    if (!(fabsf(x - y) <= 1e-2f * fmaxf(fabsf(y), 1.0f))) atomicAdd(bad, 1ull);
  }
}

struct Case {
  const char* name;
  bool wgrad;                  // groups of the contraction (out [G, M, N]) instead of groups of rows (out [M, N])
  int64_t groups, m, n, k;     // forward: M rows in all; wgrad: K rows in all
};

int main() {
  const std::vector<Case> cases = {
      {"forward, one group, 8192 x 28672 x 8192", false, 1, 8192, 28672, 8192},
      {"forward, Mixtral gate+up: 8 groups of 4096 rows, N 28672, K 4096", false, 8, 32768, 28672, 4096},
      {"forward, DeepSeek gate+up: 64 groups of 1024 rows, N 4096, K 7168", false, 64, 65536, 4096, 7168},
      {"wgrad, one group, 8192 x 28672, K 8192", true, 1, 8192, 28672, 8192},
      {"wgrad, Mixtral gate+up: 8 x [4096 x 28672], K 8 x 4096", true, 8, 4096, 28672, 32768},
      {"wgrad, Mixtral down: 8 x [14336 x 4096], K 8 x 4096", true, 8, 14336, 4096, 32768},
      {"wgrad, DeepSeek gate+up: 64 x [7168 x 4096], K 64 x 1024", true, 64, 7168, 4096, 65536},
  };
  std::vector<bs::Entry> schedules = bs::Registry();
  std::sort(schedules.begin(), schedules.end(),
            [](const bs::Entry& a, const bs::Entry& b) { return std::string(a.name) < std::string(b.name); });
  std::stable_partition(schedules.begin(), schedules.end(),
                        [](const bs::Entry& e) { return std::string(e.name) == "cooperative_128x128_c1x2"; });
  const int rounds = 7, iters = 10, warmup = 3;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  int device;
  CHECK_CUDA(cudaGetDevice(&device));
  const size_t workspace_bytes = size_t{256} << 20;
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  unsigned long long* bad;
  CHECK_CUDA(cudaMallocManaged(&bad, sizeof(*bad)));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));

  for (const Case& cs : cases) {
    const int64_t g = cs.groups, m = cs.m, n = cs.n, k = cs.k;
    const size_t a_count = m * k, b_count = cs.wgrad ? n * k : g * n * k;
    const size_t sa_count = m * (k / 128), sb_count = cs.wgrad ? n * (k / 128) : g * (n / 128) * (k / 128);
    const size_t d_count = cs.wgrad ? g * m * n : m * n;
    uint8_t *a, *b;
    float *sa, *sb;
    uint16_t *d, *reference;
    int32_t* sizes;
    CHECK_CUDA(cudaMalloc(&a, a_count));
    CHECK_CUDA(cudaMalloc(&b, b_count));
    CHECK_CUDA(cudaMalloc(&sa, sa_count * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&sb, sb_count * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&d, d_count * 2));
    CHECK_CUDA(cudaMalloc(&reference, d_count * 2));
    CHECK_CUDA(cudaMalloc(&sizes, g * sizeof(int32_t)));
    FillFp8<<<1024, 256, 0, stream>>>(a, a_count, 1);
    FillFp8<<<1024, 256, 0, stream>>>(b, b_count, 2);
    FillScales<<<256, 256, 0, stream>>>(sa, sa_count, 3);
    FillScales<<<256, 256, 0, stream>>>(sb, sb_count, 4);
    const std::vector<int32_t> host_sizes(g, static_cast<int32_t>((cs.wgrad ? k : m) / g));
    CHECK_CUDA(cudaMemcpy(sizes, host_sizes.data(), g * sizeof(int32_t), cudaMemcpyHostToDevice));

    bs::Call c{};
    c.target = "cutlass_block_schedules";
    c.axis = cs.wgrad ? bs::grouped::GroupAxis::kContraction : bs::grouped::GroupAxis::kRows;
    c.groups = g, c.m = m, c.n = n, c.k = k, c.align = 128;
    c.a = a, c.b = b, c.a_s = sa, c.b_s = sb, c.b_scale_rows = cs.wgrad ? 1 : 128;
    c.group_sizes = sizes, c.workspace = workspace, c.workspace_bytes = workspace_bytes, c.device = device;
    auto run = [&](const bs::Entry& e) { return (cs.wgrad ? e.wgrad : e.forward)(c, stream); };

    std::vector<bool> usable(schedules.size(), true);
    for (size_t s = 0; s < schedules.size(); ++s) {
      c.out = s == 0 ? reference : d;
      for (int w = 0; w < warmup && usable[s]; ++w) {
        if (auto err = run(schedules[s]); err.failure()) {
          std::printf("%s, %s: %s\n", cs.name, schedules[s].name, std::string(err.message()).c_str());
          usable[s] = false;
        }
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      if (s > 0 && usable[s]) {
        *bad = 0;
        CountMismatches<<<1024, 256, 0, stream>>>(d, reference, d_count, bad);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        if (*bad) std::printf("  %s: %llu of %zu outputs differ from te_jax's schedule\n", schedules[s].name, *bad, d_count);
      }
    }
    std::vector<std::vector<float>> ms(schedules.size());
    c.out = d;
    for (int r = 0; r < rounds; ++r) {
      for (size_t j = 0; j < schedules.size(); ++j) {
        const size_t s = (j + r) % schedules.size();  // a different order each round
        if (!usable[s]) continue;
        CHECK_CUDA(cudaEventRecord(start, stream));
        for (int i = 0; i < iters; ++i) (void)run(schedules[s]);
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float t;
        CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
        ms[s].push_back(t / iters);
      }
    }
    const double flops = 2.0 * m * n * k;  // wgrad: G products of M x N over K / G rows each
    std::printf("%s\n", cs.name);
    for (size_t s = 0; s < schedules.size(); ++s) {
      if (!usable[s]) continue;
      std::sort(ms[s].begin(), ms[s].end());
      const float median = ms[s][ms[s].size() / 2];
      std::printf("  %-26s %8.3f ms %6.0f TFLOP/s\n", schedules[s].name, median, flops / (median * 1e-3) / 1e12);
    }
    std::fflush(stdout);
    for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(sa), static_cast<void*>(sb),
                    static_cast<void*>(d), static_cast<void*>(reference), static_cast<void*>(sizes)}) {
      CHECK_CUDA(cudaFree(p));
    }
  }
  return 0;
}
