// A standalone probe of cuBLASLt's experimental grouped batch mode
// (CUBLASLT_BATCH_MODE_GROUPED: per-group rows / cols / leading dimensions in
// device arrays, operands through device pointer arrays) for the MoE forward
// GEMM D_g[M_g, N] = X_g[M_g, K] . W_g[N, K]^T, G groups of M_g rows each:
// does the heuristic offer an algorithm (FP8 E4M3 with fast accumulation ->
// bf16, and bf16 -> bf16), does it run, are sampled outputs right, how fast.
//
// cuBLAS is column-major: cuBLAS A = W_g (K x N, TRANSA=T), B = X_g (K x M_g),
// D = D_g^T (N x M_g); only B's and D's column counts vary by group.
//
//   nvcc -O2 -std=c++17 -arch=sm_90a tools/research/lt_grouped_probe.cu -lcublasLt -o /tmp/lt_grouped_probe
//   /tmp/lt_grouped_probe [G=8] [M_g=4096] [N=28672] [K=4096]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CUDA_OK(x)                                                                     \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

template <typename T>
__global__ void Fill(T* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    x[i] = T((static_cast<float>(h & 0xffff) / 65536.0f - 0.5f) * 4.0f);
  }
}

// out[s] = sum_k X[r, k] * W[g, c, k] for sampled (r, c), r in group g.
template <typename T>
__global__ void Sample(const T* x, const T* w, int mg, int n, int k, const int* rows, const int* cols, int count,
                       float* out) {
  int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= count) return;
  int r = rows[s], c = cols[s], g = r / mg;
  float acc = 0.f;
  for (int i = 0; i < k; ++i) acc += float(x[int64_t{r} * k + i]) * float(w[(int64_t{g} * n + c) * k + i]);
  out[s] = acc;
}

// The grouped batch mode's API (cublasLtGroupedMatrixLayoutCreate, ...): in the cublasLt.h of nvidia-cublas
// 13.10 (CUBLAS_VERSION 131000), not in 13.1.0's (130100, the one jax 0.11.2's CUDA 13 plugin loaded on the H200).
#if CUBLAS_VERSION >= 131000
template <typename T>
void Probe(const char* name, cudaDataType dtype, bool fp8, int groups, int mg, int n, int k, cublasLtHandle_t lt) {
  std::printf("== %s: G=%d, M_g=%d, N=%d, K=%d\n", name, groups, mg, n, k);
  const int64_t m = int64_t{groups} * mg;
  T *x, *w;
  __nv_bfloat16* d;
  CUDA_OK(cudaMalloc(&x, m * k * sizeof(T)));
  CUDA_OK(cudaMalloc(&w, int64_t{groups} * n * k * sizeof(T)));
  CUDA_OK(cudaMalloc(&d, m * n * sizeof(__nv_bfloat16)));
  Fill<<<1024, 256>>>(x, m * k, 1u);
  Fill<<<1024, 256>>>(w, int64_t{groups} * n * k, 2u);
  std::vector<const void*> pa(groups), pb(groups);
  std::vector<void*> pd(groups);
  std::vector<int64_t> a_rows(groups, k), a_cols(groups, n), a_ld(groups, k), b_rows(groups, k), b_cols(groups, mg),
      b_ld(groups, k), d_rows(groups, n), d_cols(groups, mg), d_ld(groups, n);
  for (int g = 0; g < groups; ++g) {
    pa[g] = w + int64_t{g} * n * k;
    pb[g] = x + int64_t{g} * mg * k;
    pd[g] = d + int64_t{g} * mg * n;
  }
  auto upload = [](const void* host, size_t bytes) {
    void* p;
    CUDA_OK(cudaMalloc(&p, bytes));
    CUDA_OK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    return p;
  };
  const size_t gb = groups * sizeof(int64_t);
  void *dpa = upload(pa.data(), groups * sizeof(void*)), *dpb = upload(pb.data(), groups * sizeof(void*)),
       *dpd = upload(pd.data(), groups * sizeof(void*));
  void *dar = upload(a_rows.data(), gb), *dac = upload(a_cols.data(), gb), *dal = upload(a_ld.data(), gb);
  void *dbr = upload(b_rows.data(), gb), *dbc = upload(b_cols.data(), gb), *dbl = upload(b_ld.data(), gb);
  void *ddr = upload(d_rows.data(), gb), *ddc = upload(d_cols.data(), gb), *ddl = upload(d_ld.data(), gb);

  cublasLtMatrixLayout_t la, lb, ld;
  cublasStatus_t st;
  st = cublasLtGroupedMatrixLayoutCreate(&la, dtype, groups, dar, dac, dal);
  std::printf("grouped layout A create: status %d\n", st);
  if (st != CUBLAS_STATUS_SUCCESS) return;
  cublasLtGroupedMatrixLayoutCreate(&lb, dtype, groups, dbr, dbc, dbl);
  cublasLtGroupedMatrixLayoutCreate(&ld, CUDA_R_16BF, groups, ddr, ddc, ddl);
  const int32_t width = CUBLASLT_INTEGER_WIDTH_64;
  for (auto l : {la, lb, ld}) {
    cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_GROUPED_MATRIX_LAYOUT_ROWS_COLS_ARRAY_INTEGER_WIDTH, &width,
                                     sizeof(width));
    cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_GROUPED_MATRIX_LAYOUT_LD_ARRAY_INTEGER_WIDTH, &width, sizeof(width));
  }
  cublasLtMatmulDesc_t op;
  cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn));
  if (fp8) {
    const int8_t fast = 1;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
  }
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  const size_t ws_bytes = 64 << 20;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes));
  const uint32_t avg_rows = mg, avg_cols = n, avg_k = k;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_ROWS, &avg_cols,
                                       sizeof(avg_cols));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_COLS, &avg_rows,
                                       sizeof(avg_rows));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_GROUPED_AVERAGE_REDUCTION_DIM, &avg_k, sizeof(avg_k));
  cublasLtMatmulHeuristicResult_t results[8];
  int found = 0;
  st = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 8, results, &found);
  std::printf("heuristic: status %d (%s), %d algorithm(s)\n", st, cublasGetStatusString(st), found);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) return;
  void* ws;
  CUDA_OK(cudaMalloc(&ws, ws_bytes));
  const float alpha = 1.f, beta = 0.f;
  st = cublasLtMatmul(lt, op, &alpha, dpa, la, dpb, lb, &beta, dpd, ld, dpd, ld, &results[0].algo, ws, ws_bytes, 0);
  cudaError_t ce = cudaDeviceSynchronize();
  std::printf("matmul: status %d (%s), CUDA %s\n", st, cublasGetStatusString(st), cudaGetErrorString(ce));
  if (st != CUBLAS_STATUS_SUCCESS || ce != cudaSuccess) return;

  const int count = 256;
  std::vector<int> rs(count), cs(count);
  for (int s = 0; s < count; ++s) {
    rs[s] = static_cast<int>((int64_t{s} * 7919 * 104729) % m);
    cs[s] = static_cast<int>((int64_t{s} * 6007 * 15485863) % n);
  }
  int* drs = static_cast<int*>(upload(rs.data(), count * sizeof(int)));
  int* dcs = static_cast<int*>(upload(cs.data(), count * sizeof(int)));
  float* dref;
  CUDA_OK(cudaMalloc(&dref, count * sizeof(float)));
  Sample<<<1, count>>>(x, w, mg, n, k, drs, dcs, count, dref);
  std::vector<float> ref(count);
  CUDA_OK(cudaMemcpy(ref.data(), dref, count * sizeof(float), cudaMemcpyDeviceToHost));
  double worst = 0, scale = 0;
  for (int s = 0; s < count; ++s) {
    __nv_bfloat16 v;
    CUDA_OK(cudaMemcpy(&v, d + int64_t{rs[s]} * n + cs[s], sizeof(v), cudaMemcpyDeviceToHost));
    worst = std::max(worst, std::abs(double(float(v)) - ref[s]));
    scale = std::max(scale, std::abs(double(ref[s])));
  }
  std::printf("sampled check: max |err| %.3g, max |ref| %.3g (rel %.2e)\n", worst, scale, worst / scale);

  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < 5; ++i)
    cublasLtMatmul(lt, op, &alpha, dpa, la, dpb, lb, &beta, dpd, ld, dpd, ld, &results[0].algo, ws, ws_bytes, 0);
  const int iters = 20;
  cudaEventRecord(e0);
  for (int i = 0; i < iters; ++i)
    cublasLtMatmul(lt, op, &alpha, dpa, la, dpb, lb, &beta, dpd, ld, dpd, ld, &results[0].algo, ws, ws_bytes, 0);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  ms /= iters;
  std::printf("time: %.3f ms, %.0f TFLOP/s\n", ms, 2.0 * m * n * k / (ms * 1e-3) / 1e12);
}

#endif  // CUBLAS_VERSION >= 131000

int main(int argc, char** argv) {
  std::printf("cuBLASLt %zu at run time, cublasLt.h of %d\n", cublasLtGetVersion(), CUBLAS_VERSION);
#if CUBLAS_VERSION < 131000
  std::printf("this cublasLt.h has no grouped batch mode (nvidia-cublas 13.10 has it)\n");
  (void)argc;
  (void)argv;
#else
  const int groups = argc > 1 ? std::atoi(argv[1]) : 8;
  const int mg = argc > 2 ? std::atoi(argv[2]) : 4096;
  const int n = argc > 3 ? std::atoi(argv[3]) : 28672;
  const int k = argc > 4 ? std::atoi(argv[4]) : 4096;
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  Probe<__nv_fp8_e4m3>("fp8 e4m3 -> bf16, fast accum", CUDA_R_8F_E4M3, true, groups, mg, n, k, lt);
  Probe<__nv_bfloat16>("bf16 -> bf16", CUDA_R_16BF, false, groups, mg, n, k, lt);
#endif
  return 0;
}
