// A standalone probe of cuBLASLt's activation epilogues on te_jax's FP8 GEMM
// D[M,N] (bf16) = (A[M,K] * a_scale) . (B[N,K] * b_scale)^T: does the heuristic
// offer an algorithm for each epilogue with FP8 operands, with and without the
// output's amax (AMAX_D) written by the GEMM, are the results right on sampled
// entries, and how long does each take next to the plain GEMM.
//
//   forward   BIAS                   D = AB + bias                      (te_jax's layernorm_mlp today)
//             GELU_AUX_BIAS          D = gelu(AB + bias), aux = AB + bias
//   backward  DEFAULT                D = AB                             (E5M2 gradient x E4M3 weight)
//             DGELU                  D = AB * gelu'(aux)
//             DGELU_BGRAD            the same, and bgrad[n] = sum_m D[m, n]
//
// each with AMAX_D off and on. The layout is te_jax's plan (csrc/cuda/gemm_cublaslt.cuh): cuBLAS A = our
// B as K x N (TRANSA=T), cuBLAS B = our A as K x M, D and aux N x M, column order; the bias and bgrad vectors
// run along N.
//
//   nvcc -O2 -std=c++17 -arch=sm_90a tools/research/lt_epilogue_probe.cu -lcublasLt -o /tmp/lt_epilogue_probe
//   /tmp/lt_epilogue_probe [M=8192] [N=28672] [K=8192] [--iters 10] [--rounds 7] [--warm-s 3]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "probe_common.cuh"

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kSamples = 4096;

template <typename T>
__global__ void FillNormal(T* out, int64_t count, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = T(te_jax_probe::HashNormal(i, seed) * scale);
  }
}

__device__ __host__ float GeluTanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

__device__ __host__ float GeluTanhGrad(float x) {
  const float u = 0.7978845608f * (x + 0.044715f * x * x * x);
  const float t = tanhf(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x);
}

// ab[s] = sum_k A[r, k] B[c, k] * a_scale * b_scale for the sampled (r, c).
template <typename TA, typename TB>
__global__ void SampleProducts(const TA* a, const TB* b, int k, const int* rows, const int* cols, float scale,
                               float* ab) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= kSamples) return;
  float acc = 0.0f;
  for (int i = 0; i < k; ++i) acc += float(a[int64_t{rows[s]} * k + i]) * float(b[int64_t{cols[s]} * k + i]);
  ab[s] = acc * scale;
}

__global__ void AbsMax(const __nv_bfloat16* x, int64_t count, float* out) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    m = fmaxf(m, fabsf(__bfloat162float(x[i])));
  }
  for (int off = 16; off; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));  // m >= 0: int order
}

// colsum[n] = sum_m D[m, n] (D row-major M x N), for the bgrad check.
__global__ void ColumnSums(const __nv_bfloat16* d, int m, int n, float* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  float acc = 0.0f;
  for (int r = 0; r < m; ++r) acc += __bfloat162float(d[int64_t{r} * n + c]);
  out[c] = acc;
}

template <typename T>
void SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

struct Variant {
  std::string name;
  bool backward;  // E5M2 x E4M3, aux read (DGELU); otherwise E4M3 x E4M3
  cublasLtEpilogue_t epilogue;
  bool amax;
  bool offered = false;
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t la{}, lb{}, ld{};
  cublasLtMatmulAlgo_t algo{};
  std::vector<float> ms;
};

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? NAN : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> dims;
  int iters = 10, rounds = 7;
  double warm_s = 3.0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--warm-s") && i + 1 < argc) warm_s = std::atof(argv[++i]);
    else dims.push_back(std::atoi(argv[i]));
  }
  const int M = dims.size() > 0 ? dims[0] : 8192, N = dims.size() > 1 ? dims[1] : 28672,
            K = dims.size() > 2 ? dims[2] : 8192;
  const int version = static_cast<int>(cublasLtGetVersion());
  std::printf("cuBLASLt %d, M=%d N=%d K=%d (our D[M,N] = A[M,K] . B[N,K]^T), %d rounds of %d calls\n", version, M, N,
              K, rounds, iters);

  const int64_t mk = int64_t{M} * K, nk = int64_t{N} * K, mn = int64_t{M} * N;
  __nv_fp8_e4m3 *a4, *b4;
  __nv_fp8_e5m2* a5;
  __nv_bfloat16 *d, *aux, *bias, *bgrad;
  float *scales, *amax, *ab, *colsum;
  int *rows, *cols;
  void* workspace;
  CHECK_CUDA(cudaMalloc(&a4, mk));
  CHECK_CUDA(cudaMalloc(&a5, mk));
  CHECK_CUDA(cudaMalloc(&b4, nk));
  CHECK_CUDA(cudaMalloc(&d, mn * 2));
  CHECK_CUDA(cudaMalloc(&aux, mn * 2));
  CHECK_CUDA(cudaMalloc(&bias, N * 2));
  CHECK_CUDA(cudaMalloc(&bgrad, N * 2));
  CHECK_CUDA(cudaMalloc(&scales, 256 * 3));  // a, b scales and amax, each in its own 256-byte slot
  CHECK_CUDA(cudaMalloc(&ab, kSamples * 4));
  CHECK_CUDA(cudaMalloc(&colsum, N * 4));
  CHECK_CUDA(cudaMalloc(&rows, kSamples * 4));
  CHECK_CUDA(cudaMalloc(&cols, kSamples * 4));
  CHECK_CUDA(cudaMalloc(&workspace, kWorkspaceBytes));
  float* a_scale = scales;
  float* b_scale = scales + 64;
  amax = scales + 128;
  FillNormal<<<1024, 256>>>(a4, mk, 1, 1.0f);
  FillNormal<<<1024, 256>>>(a5, mk, 2, 1.0f);
  FillNormal<<<1024, 256>>>(b4, nk, 3, 1.0f);
  FillNormal<<<1024, 256>>>(bias, N, 4, 0.5f);
  const float scale_a = 1.0f / std::sqrt(static_cast<float>(K)), scale_b = 1.0f;  // unit-variance products
  CHECK_CUDA(cudaMemcpy(a_scale, &scale_a, 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b_scale, &scale_b, 4, cudaMemcpyHostToDevice));
  std::vector<int> h_rows(kSamples), h_cols(kSamples);
  uint32_t state = 12345u;
  for (int s = 0; s < kSamples; ++s) {
    state = state * 1664525u + 1013904223u;
    h_rows[s] = static_cast<int>(state % M);
    state = state * 1664525u + 1013904223u;
    h_cols[s] = static_cast<int>(state % N);
  }
  CHECK_CUDA(cudaMemcpy(rows, h_rows.data(), kSamples * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(cols, h_cols.data(), kSamples * 4, cudaMemcpyHostToDevice));

  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  std::vector<Variant> variants;
  for (bool with_amax : {false, true}) {
    const char* suffix = with_amax ? " +AMAX_D" : "";
    variants.push_back({std::string("fwd BIAS") + suffix, false, CUBLASLT_EPILOGUE_BIAS, with_amax});
    variants.push_back({std::string("fwd GELU_AUX_BIAS") + suffix, false, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, with_amax});
    variants.push_back({std::string("bwd DEFAULT") + suffix, true, CUBLASLT_EPILOGUE_DEFAULT, with_amax});
    variants.push_back({std::string("bwd DGELU") + suffix, true, CUBLASLT_EPILOGUE_DGELU, with_amax});
    variants.push_back({std::string("bwd DGELU_BGRAD") + suffix, true, CUBLASLT_EPILOGUE_DGELU_BGRAD, with_amax});
  }

  for (Variant& v : variants) {
    CHECK_LT(cublasLtMatmulDescCreate(&v.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    SetDesc(v.desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    SetDesc(v.desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    SetDesc(v.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(v.backward ? 0 : 1));
    SetDesc(v.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(b_scale));  // cuBLAS A = our B
    SetDesc(v.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(a_scale));
    SetDesc(v.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, v.epilogue);
    const bool has_bias = v.epilogue == CUBLASLT_EPILOGUE_BIAS || v.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    const bool has_aux = v.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || v.epilogue == CUBLASLT_EPILOGUE_DGELU ||
                         v.epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD;
    if (has_bias || v.epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD) {
      SetDesc(v.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
              static_cast<const void*>(v.epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD ? bgrad : bias));
      SetDesc(v.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_16BF);
    }
    if (has_aux) {
      SetDesc(v.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(aux));
      SetDesc(v.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(N));
      SetDesc(v.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, CUDA_R_16BF);
    }
    if (v.amax) SetDesc(v.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<const void*>(amax));
    CHECK_LT(cublasLtMatrixLayoutCreate(&v.la, CUDA_R_8F_E4M3, K, N, K));
    CHECK_LT(cublasLtMatrixLayoutCreate(&v.lb, v.backward ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, K, M, K));
    CHECK_LT(cublasLtMatrixLayoutCreate(&v.ld, CUDA_R_16BF, N, M, N));
    cublasLtMatmulPreference_t pref;
    CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = kWorkspaceBytes;
    CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(lt, v.desc, v.la, v.lb, v.ld, v.ld, pref, 1, &result, &found);
    CHECK_LT(cublasLtMatmulPreferenceDestroy(pref));
    v.offered = status == CUBLAS_STATUS_SUCCESS && found > 0;
    if (v.offered) v.algo = result.algo;
    std::printf("%-28s heuristic: status %d, %d algorithm(s)\n", v.name.c_str(), int(status), found);
  }

  const float one = 1.0f, zero = 0.0f;
  auto run = [&](Variant& v) {
    const void* a_ptr = b4;  // cuBLAS A = our B
    const void* b_ptr = v.backward ? static_cast<const void*>(a5) : static_cast<const void*>(a4);
    return cublasLtMatmul(lt, v.desc, &one, a_ptr, v.la, b_ptr, v.lb, &zero, d, v.ld, d, v.ld, &v.algo, workspace,
                          kWorkspaceBytes, 0);
  };

  // Correctness on sampled entries: the forward against gelu(AB + bias) computed here, the backward against
  // AB * gelu'(aux); the amax against a reduction over D; bgrad against D's column sums.
  std::vector<float> h_ab(kSamples);
  for (bool backward : {false, true}) {
    if (backward) {
      SampleProducts<<<(kSamples + 127) / 128, 128>>>(a5, b4, K, rows, cols, scale_a * scale_b, ab);
    } else {
      SampleProducts<<<(kSamples + 127) / 128, 128>>>(a4, b4, K, rows, cols, scale_a * scale_b, ab);
    }
    CHECK_CUDA(cudaMemcpy(h_ab.data(), ab, kSamples * 4, cudaMemcpyDeviceToHost));
    std::vector<__nv_bfloat16> h_bias(N);
    CHECK_CUDA(cudaMemcpy(h_bias.data(), bias, N * 2, cudaMemcpyDeviceToHost));
    for (Variant& v : variants) {
      if (v.backward != backward || !v.offered) continue;
      if (backward) FillNormal<<<1024, 256>>>(aux, mn, 5, 1.0f);  // the pre-activation the backward reads
      CHECK_CUDA(cudaMemset(amax, 0, 4));
      const cublasStatus_t status = run(v);
      CHECK_CUDA(cudaDeviceSynchronize());
      if (status != CUBLAS_STATUS_SUCCESS) {
        std::printf("%-28s run: cuBLAS status %d\n", v.name.c_str(), int(status));
        v.offered = false;
        continue;
      }
      std::vector<__nv_bfloat16> h_d(mn), h_aux;
      CHECK_CUDA(cudaMemcpy(h_d.data(), d, mn * 2, cudaMemcpyDeviceToHost));
      const bool has_aux = v.epilogue != CUBLASLT_EPILOGUE_BIAS && v.epilogue != CUBLASLT_EPILOGUE_DEFAULT;
      if (has_aux) {
        h_aux.resize(mn);
        CHECK_CUDA(cudaMemcpy(h_aux.data(), aux, mn * 2, cudaMemcpyDeviceToHost));
      }
      double err_d = 0.0, norm_d = 0.0, err_aux = 0.0, norm_aux = 0.0;
      for (int s = 0; s < kSamples; ++s) {
        const int64_t at = int64_t{h_rows[s]} * N + h_cols[s];
        const float pre = h_ab[s] + (backward ? 0.0f : __bfloat162float(h_bias[h_cols[s]]));
        float want = pre;
        if (v.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
          want = GeluTanh(pre);
          err_aux += std::pow(__bfloat162float(h_aux[at]) - pre, 2.0);
          norm_aux += double(pre) * pre;
        } else if (backward && v.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
          want = h_ab[s] * GeluTanhGrad(__bfloat162float(h_aux[at]));
        }
        err_d += std::pow(__bfloat162float(h_d[at]) - want, 2.0);
        norm_d += double(want) * want;
      }
      std::printf("%-28s check: D rel L2 %.2e", v.name.c_str(), std::sqrt(err_d / norm_d));
      if (v.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) std::printf(", aux rel L2 %.2e", std::sqrt(err_aux / norm_aux));
      if (v.amax) {
        float got = 0.0f, want = 0.0f;
        CHECK_CUDA(cudaMemcpy(&got, amax, 4, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemset(colsum, 0, 4));
        AbsMax<<<1024, 256>>>(d, mn, colsum);
        CHECK_CUDA(cudaMemcpy(&want, colsum, 4, cudaMemcpyDeviceToHost));
        std::printf(", AMAX_D %.6g vs max|D| %.6g", got, want);
      }
      if (v.epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD) {
        ColumnSums<<<(N + 255) / 256, 256>>>(d, M, N, colsum);
        std::vector<float> want(N);
        std::vector<__nv_bfloat16> got(N);
        CHECK_CUDA(cudaMemcpy(want.data(), colsum, N * 4, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(got.data(), bgrad, N * 2, cudaMemcpyDeviceToHost));
        double err = 0.0, norm = 0.0;
        for (int c = 0; c < N; ++c) {
          err += std::pow(__bfloat162float(got[c]) - want[c], 2.0);
          norm += double(want[c]) * want[c];
        }
        std::printf(", bgrad rel L2 %.2e", std::sqrt(err / norm));
      }
      std::printf("\n");
    }
  }

  // Timing: warm to the power cap, then rounds of `iters` back-to-back calls of each variant in turn.
  std::vector<Variant*> timed;
  for (Variant& v : variants) {
    if (v.offered) timed.push_back(&v);
  }
  if (timed.empty()) return 0;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < warm_s) {
    for (Variant* v : timed) CHECK_LT(run(*v));
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t j = 0; j < timed.size(); ++j) {
      Variant& v = *timed[(j + r) % timed.size()];
      CHECK_CUDA(cudaEventRecord(start));
      for (int i = 0; i < iters; ++i) CHECK_LT(run(v));
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      v.ms.push_back(ms / iters);
    }
  }
  const double flop = 2.0 * M * N * K;
  for (Variant* v : timed) {
    const float med = Median(v->ms);
    std::printf("%-28s %.3f ms  %.0f TFLOP/s\n", v->name.c_str(), med, flop / med * 1e-9);
  }
  return 0;
}
