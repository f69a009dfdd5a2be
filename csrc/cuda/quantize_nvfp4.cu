// CUDA FFI handler for NVFP4: E2M1 codes packed two per byte, E4M3 scales
// per 16 elements (1x16, or 16x16 repeated per row), float32 global amax.
//
// Pass 1 (nvfp4_amax.cuh) reads x once for the global amax (and, with the random Hadamard
// transform, the amax of the transformed columnwise copy). Pass 2 is a tile
// kernel that reads x once more with 16-byte loads and keeps everything in
// registers: each lane holds 16 rows x V columns (V = 16 / sizeof(T), one
// 16-byte vector per row), so it owns complete 16-row column groups (RHT,
// column amax and the columnwise codes need no data exchange) and half (V = 8)
// or a quarter (V = 4) of each 16-column row block (a shuffle gives the row
// amax; a 16x16 block is one shuffle over the lanes of 16 columns). The four
// warps of a block stack along M (a 64 x 32V tile), so the columnwise codes
// and scales of one tile column are contiguous (32 and 4 bytes); they are
// staged in shared memory and written with one full-sector store per column
// chunk. Rowwise codes go straight to global memory (128 contiguous bytes per
// row per warp). With 16x16 blocks and round-to-nearest the rowwise and
// columnwise codes of an element are the same (same block, same global amax),
// so they are computed once and nibble-transposed. The per-element math
// (nvfp4_math.cuh) is restructured for fewer instructions and checked against
// numerics.h on the host.
#include "nvfp4_amax.cuh"
#include "../common/bindings.h"

namespace te_jax {
namespace cuda {
namespace {

struct Nvfp4Global {
  float s_dec;   // 1 / S_enc
  float factor;  // S_enc / 6
};

__device__ __forceinline__ Nvfp4Global GlobalOf(float amax) {
  const float s_enc = Nvfp4GlobalEncodeScale(amax);
  return {1.0f / s_enc, s_enc * (1.0f / 6.0f)};
}

// Per-element E2M1 codes for the fallback kernel (the tile kernels use
// nvfp4_math.cuh). FloatToE2M1 for a product (never a subnormal or a
// signaling NaN under FTZ), in half the instructions; checked against FloatToE2M1 for every such
// float32. Adding M = 2^(max(e, 0) + 22) rounds |x| (RNE) to the E2M1 grid
// spacing of its binade (0.5 below 2, 1 below 4, 2 above); the code is the
// number of steps plus 2 * max(e, 0), saturated at 7.
__device__ __forceinline__ uint32_t E2M1Rne(float x) {
  const uint32_t sign = IsNanF(x) ? 0u : (FloatBits(x) >> 28) & 0x8u;  // NaN -> +0 code
  const float a = fminf(fmaxf(BitsFloat(AbsBits(x)), 0.0f), 8.0f);  // NaN -> 0
  const uint32_t mb = max(FloatBits(a) & 0x7f800000u, 0x3f800000u) + (22u << 23);
  const uint32_t steps = FloatBits(a + BitsFloat(mb)) - mb;
  return sign | min(steps + (mb >> 22) - 298u, 7u);
}

// FloatToE2M1Stochastic for a product (same domain and check as E2M1Rne, plus
// random bits at the rounding boundaries). |x| >= 1: floor(|x| / spacing) and
// the fraction are bit fields of |x|; |x| < 1: spacing 0.5, exact float math.
__device__ __forceinline__ uint32_t E2M1Sr(float x, uint32_t random) {
  const uint32_t sign = IsNanF(x) ? 0u : (FloatBits(x) >> 28) & 0x8u;  // NaN -> +0 code
  const uint32_t b = AbsBits(x);
  const float a = BitsFloat(b);
  const uint32_t r = random >> 8;
  const uint32_t hi = (b >> 22) - 252u + (r < ((b << 2) & 0xfffffcu) ? 1u : 0u);
  const float lower = a >= 0.5f ? 1.0f : 0.0f;
  const float frac = (a + a) - lower;
  const uint32_t lo = (a >= 0.5f ? 1u : 0u) + (static_cast<float>(r) < frac * 16777216.0f ? 1u : 0u);
  return sign | (a >= 6.0f ? 7u : (a >= 1.0f ? hi : lo));  // NaN: lo = 0
}

// Nvfp4BlockScale with the hardware E4M3 conversion (same bits).
__device__ __forceinline__ uint8_t BlockScaleCode(uint32_t amax_bits, float factor) {
  return static_cast<uint8_t>(Fp8x2<false>(BitsFloat(amax_bits) * factor, 0.0f));
}

// Eight values times `enc` as eight E2M1 codes (v[0] in the low nibble);
// with stochastic rounding element k draws RandomBits(seed, index0 + k).
template <bool kSR>
__device__ __forceinline__ uint32_t E2M1x8(const float* v, float enc, uint32_t seed, uint32_t index0) {
  uint32_t w = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float val = v[k] * enc;
    const uint32_t code = kSR ? E2M1Sr(val, RandomBits(seed, index0 + k)) : E2M1Rne(val);
    w |= code << (4 * k);
  }
  return w;
}

struct Nvfp4Args {
  const void* x;
  int64_t rows, cols;
  int tiles_m, tiles_n;
  const float* amax;    // [batch], rowwise global amax
  const float* amax_t;  // [batch], columnwise global amax
  const uint32_t* key;  // [batch, 2] (stochastic rounding)
  uint8_t* q;           // rowwise, or nullptr
  uint8_t* s;
  uint8_t* q_t;         // columnwise, or nullptr
  uint8_t* s_t;
  bool st_vec;          // a tile column's 4 s_t bytes can be stored as one uint32
};

constexpr int kQWarps = 4;
constexpr int kQThreads = 32 * kQWarps;
constexpr int kQRows = 16 * kQWarps;  // tile rows: 16 per warp

// ---- the tile kernel ------------------------------------------------------------------

// Shared-memory slot (8-byte units) of column cl's chunk w (16 rows of codes)
// in the columnwise staging buffer: 32 bytes per column plus one slot of skew
// per lane (cl / V), so that a warp's 8-byte writes (lane stride 4V + 1
// slots) hit 16 different bank pairs.
template <int V>
__device__ __forceinline__ int QtSlot(int cl, int w) {
  return cl * kQWarps + w + cl / V;
}

// 4 resident blocks (16 warps) per SM: at most 128 registers per thread, 64 of
// them the lane's 16 input vectors (more registers do not shorten the code).
template <typename T, bool k2D, bool kRht, bool kSR>
__global__ void __launch_bounds__(kQThreads, 4) Nvfp4TileKernel(Nvfp4Args a) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));  // elements per lane per row
  constexpr int kLanesPerBlock = 16 / V;                 // lanes of one 16-column block
  constexpr int kCols = 32 * V;                          // tile columns
  constexpr int kTables = k2D ? 0 : (kRht ? 2 : 1);      // encode-multiplier tables (1D)
  constexpr bool kSharedCodes = k2D && !kSR;             // rowwise codes == columnwise codes
  __shared__ float enc_tab[kTables > 0 ? kTables : 1][256];
  __shared__ uint2 qt_stage[kCols * kQWarps + 32];
  __shared__ uint32_t st_stage[kCols + 32];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Tiles in reverse order: the amax pass read x front to back, so the end of
  // x is the part most likely to still be in L2.
  const uint32_t t_rev = gridDim.x - 1u - blockIdx.x;
  const uint32_t tn = t_rev % static_cast<uint32_t>(a.tiles_n), rest = t_rev / static_cast<uint32_t>(a.tiles_n);
  const uint32_t tm = rest % static_cast<uint32_t>(a.tiles_m);
  const int64_t b = rest / static_cast<uint32_t>(a.tiles_m);
  const int64_t M = a.rows, N = a.cols, size = M * N;
  const int64_t row_t = int64_t{tm} * kQRows, col_t = int64_t{tn} * kCols;
  const int64_t r0 = row_t + warp * 16, c = col_t + lane * V;
  const bool rows_ok = r0 < M;  // M % 16 == 0: a warp's 16 rows are all in or all out
  const bool cols_ok = c < N;   // N % 16 == 0: a lane's V columns are all in or all out

  uint4 raw[16];
  {
    const T* p = static_cast<const T*>(a.x) + b * size + r0 * N + c;
#pragma unroll
    for (int i = 0; i < 16; ++i) raw[i] = (rows_ok && cols_ok) ? LoadOnce(p + i * N) : make_uint4(0u, 0u, 0u, 0u);
  }

  const Nvfp4Global g_row = GlobalOf(a.amax[b]);
  const Nvfp4Global g_col = GlobalOf(a.amax_t[b]);
  if constexpr (kTables > 0) {
    for (int i = tid; i < 256; i += kQThreads) {
      enc_tab[0][i] = Nvfp4BlockEncode(static_cast<uint8_t>(i), g_row.s_dec);
      if constexpr (kTables > 1) enc_tab[kTables - 1][i] = Nvfp4BlockEncode(static_cast<uint8_t>(i), g_col.s_dec);
    }
    __syncthreads();
  }
  uint32_t row_seed = 0, col_seed = 0;
  if constexpr (kSR) {
    row_seed = StreamSeed(a.key[2 * b], a.key[2 * b + 1], kRowwiseStream);
    col_seed = StreamSeed(a.key[2 * b], a.key[2 * b + 1], kColwiseStream);
  }
  const uint32_t row_fold = nvfp4::SeedFold(row_seed), col_fold = nvfp4::SeedFold(col_seed);
  uint8_t* st_bytes = reinterpret_cast<uint8_t*>(st_stage);

  // 16x16 blocks: one block per lane group, the same for both copies.
  uint32_t m2d = 0;
  uint8_t sb2d = 0;
  float enc2d = 0.0f;
  if constexpr (k2D) {
    m2d = GroupMax<kLanesPerBlock>(TileAbsMax<T>(raw));
    sb2d = BlockScaleCode(m2d, g_row.factor);
    enc2d = Nvfp4BlockEncode(sb2d, g_row.s_dec);
  }

  // Every warp computes (a warp past M works on zeros), so that the
  // shuffles run converged; stores are predicated.
  const bool store_ok = rows_ok && cols_ok;
  const bool scale_lane = store_ok && lane % kLanesPerBlock == 0;
  const uint64_t e0 = static_cast<uint64_t>(b * size + r0 * N + c);  // element offset of (r0, c)
  const uint64_t q_pitch = static_cast<uint64_t>(N / 2), s_pitch = static_cast<uint64_t>(N / 16);
  uint8_t* const q_row = a.q != nullptr ? a.q + (e0 >> 1) : nullptr;
  uint8_t* const s_row = a.q != nullptr ? a.s + (e0 >> 4) : nullptr;

  if constexpr (kSharedCodes) {
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float f[V];
#pragma unroll
      for (int k = 0; k < V; ++k) f[k] = ElemOf<T>(raw[i], k);
      w[i] = NanBits(m2d) ? 0u : nvfp4::EncodeN<V, false>(f, enc2d, 0u, 0u, 0u);
    }
    if (a.q != nullptr) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (store_ok) {
          if constexpr (V == 8) {
            *reinterpret_cast<uint32_t*>(q_row + i * q_pitch) = w[i];
          } else {
            *reinterpret_cast<uint16_t*>(q_row + i * q_pitch) = static_cast<uint16_t>(w[i]);
          }
        }
        if (scale_lane) s_row[i * s_pitch] = sb2d;
      }
    }
    if (a.q_t != nullptr) {
      uint32_t lo[8], hi[8];
      if constexpr (V == 8) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          lo[i] = w[i];
          hi[i] = w[i + 8];
        }
        nvfp4::TransposeNibbles8x8(lo);
        nvfp4::TransposeNibbles8x8(hi);
      } else {
        // Rows i and i + 8 side by side: after the transpose, word j < 4 is
        // column j's rows 0..7 and word j + 4 its rows 8..15.
#pragma unroll
        for (int i = 0; i < 8; ++i) lo[i] = (w[i] & 0xffffu) | (w[i + 8] << 16);
        nvfp4::TransposeNibbles8x8(lo);
#pragma unroll
        for (int j = 0; j < 4; ++j) hi[j] = lo[j + 4];
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int cl = lane * V + j;
        qt_stage[QtSlot<V>(cl, warp)] = make_uint2(lo[j], hi[j]);
        st_bytes[(cl + lane) * 4 + warp] = sb2d;
      }
    }
  } else {
    // Columnwise copy: lane-local 16-row column groups.
    if (a.q_t != nullptr) {
      uint32_t mcol[V];
      if constexpr (!k2D && !kRht && sizeof(T) == 2) {
#pragma unroll
        for (int qw = 0; qw < 4; ++qw) {
          AbsMaxAcc16x2 acc;
#pragma unroll
          for (int i = 0; i < 16; i += 2) acc.Add2(WordOf(raw[i], qw), WordOf(raw[i + 1], qw));
          const uint32_t p = acc.Result();
          mcol[2 * qw] = AbsBitsOf16<T>(p & 0xffffu);
          mcol[2 * qw + 1] = AbsBitsOf16<T>(p >> 16);
        }
      }
      const uint32_t idx_c = static_cast<uint32_t>(c) * static_cast<uint32_t>(M) + static_cast<uint32_t>(r0);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = ElemOf<T>(raw[i], j);
        if constexpr (kRht) Rht16(v);
        uint32_t m;
        if constexpr (k2D) {
          m = m2d;
        } else if constexpr (!kRht && sizeof(T) == 2) {
          m = mcol[j];
        } else {
          m = AbsMax16(v);
        }
        const uint8_t sb = k2D ? sb2d : BlockScaleCode(m, g_col.factor);
        const float enc = k2D ? enc2d : enc_tab[kTables - 1][sb];
        const uint32_t idx = idx_c + static_cast<uint32_t>(j) * static_cast<uint32_t>(M);
        uint32_t lo = nvfp4::EncodeN<8, kSR>(v, enc, col_seed, col_fold, idx);
        uint32_t hi = nvfp4::EncodeN<8, kSR>(v + 8, enc, col_seed, col_fold, idx + 8u);
        if (NanBits(m)) lo = hi = 0u;
        const int cl = lane * V + j;
        qt_stage[QtSlot<V>(cl, warp)] = make_uint2(lo, hi);
        st_bytes[(cl + lane) * 4 + warp] = sb;
      }
    }
    // Rowwise copy: row blocks over kLanesPerBlock lanes.
    if (a.q != nullptr) {
      const uint32_t idx_r = static_cast<uint32_t>(r0) * static_cast<uint32_t>(N) + static_cast<uint32_t>(c);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float f[V];
#pragma unroll
        for (int k = 0; k < V; ++k) f[k] = ElemOf<T>(raw[i], k);
        const uint32_t m = k2D ? m2d : GroupMax<kLanesPerBlock>(VecAbsMax<T>(raw[i]));
        const uint8_t sb = k2D ? sb2d : BlockScaleCode(m, g_row.factor);
        const float enc = k2D ? enc2d : enc_tab[0][sb];
        const uint32_t idx = idx_r + static_cast<uint32_t>(i) * static_cast<uint32_t>(N);
        uint32_t w = nvfp4::EncodeN<V, kSR>(f, enc, row_seed, row_fold, idx);
        if (NanBits(m)) w = 0u;
        if (store_ok) {
          if constexpr (V == 8) {
            *reinterpret_cast<uint32_t*>(q_row + i * q_pitch) = w;
          } else {
            *reinterpret_cast<uint16_t*>(q_row + i * q_pitch) = static_cast<uint16_t>(w);
          }
        }
        if (scale_lane) s_row[i * s_pitch] = sb;
      }
    }
  }
  if (a.q_t == nullptr) return;
  __syncthreads();

  // Columnwise codes: 4 x 8 bytes (64 rows) per tile column; 4 threads write
  // one column's 32 contiguous bytes.
  const uint64_t et = static_cast<uint64_t>(b * size + col_t * M + row_t);  // element offset of (row_t, col_t)^T
  uint8_t* const qt_tile = a.q_t + (et >> 1);
  uint8_t* const st_tile = a.s_t + (et >> 4);
  const uint64_t qt_pitch = static_cast<uint64_t>(M / 2), st_pitch = static_cast<uint64_t>(M / 16);
#pragma unroll
  for (int it = 0; it < kCols * kQWarps / kQThreads; ++it) {
    const int item = tid + it * kQThreads, cl = item / kQWarps, w = item % kQWarps;
    if (col_t + cl < N && row_t + 16 * w < M) {
      *reinterpret_cast<uint2*>(qt_tile + static_cast<uint64_t>(cl) * qt_pitch + 8 * w) =
          qt_stage[QtSlot<V>(cl, w)];
    }
  }
  // Columnwise scales: 4 bytes (64 rows) per tile column.
#pragma unroll
  for (int it = 0; it < kCols / kQThreads; ++it) {
    const int cl = tid + it * kQThreads;
    if (col_t + cl >= N) continue;
    const uint32_t word = st_stage[cl + cl / V];
    uint8_t* dst = st_tile + static_cast<uint64_t>(cl) * st_pitch;
    if (a.st_vec && row_t + kQRows <= M) {
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else {
#pragma unroll
      for (int w = 0; w < kQWarps; ++w) {
        if (row_t + 16 * w < M) dst[w] = static_cast<uint8_t>(word >> (8 * w));
      }
    }
  }
}

// Fallback for any shape (1D blocks): one thread per 16-element block of the
// matrix viewed as rows x cols with strides (rs, cs).
template <typename T, bool kRht, bool kSR>
__global__ void __launch_bounds__(256)
    Nvfp4SimpleKernel(const T* x, int64_t rows, int64_t cols, int64_t rs, int64_t cs, int64_t nblocks,
                      const float* amax, const uint32_t* key, uint32_t stream, uint8_t* q, uint8_t* s) {
  const int64_t id = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (id >= nblocks) return;
  const int64_t bpr = cols / 16, size = rows * cols;
  const int64_t b = id / (rows * bpr), i = (id / bpr) % rows, j0 = (id % bpr) * 16;
  float v[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = ToF(x[b * size + i * rs + (j0 + k) * cs]);
  if constexpr (kRht) Rht16(v);
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) m = max(m, AbsBits(v[k]));
  const Nvfp4Global g = GlobalOf(amax[b]);
  const uint8_t sb = BlockScaleCode(m, g.factor);
  const float enc = Nvfp4BlockEncode(sb, g.s_dec);
  const uint32_t seed = kSR ? StreamSeed(key[2 * b], key[2 * b + 1], stream) : 0u;
  const int64_t idx = i * cols + j0;
  const uint32_t w[2] = {E2M1x8<kSR>(v, enc, seed, static_cast<uint32_t>(idx)),
                         E2M1x8<kSR>(v + 8, enc, seed, static_cast<uint32_t>(idx + 8))};
  uint8_t* qb = q + (b * size + idx) / 2;
#pragma unroll
  for (int k = 0; k < 8; ++k) qb[k] = static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4)));
  s[id] = sb;
}

template <typename T, bool k2D, bool kRht, bool kSR>
ffi::Error LaunchTiles(cudaStream_t stream, const MatrixBatch& mb, Nvfp4Args a) {
  constexpr int64_t kCols = 32 * (16 / sizeof(T));
  a.tiles_m = static_cast<int>(CeilDiv(mb.rows, kQRows));
  a.tiles_n = static_cast<int>(CeilDiv(mb.cols, kCols));
  // s_t rows are M / 16 bytes; a tile's 4 column bytes start at a multiple of 4.
  a.st_vec = a.s_t != nullptr && (mb.rows / 16) % 4 == 0 && (reinterpret_cast<uintptr_t>(a.s_t) & 3u) == 0;
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(int64_t{a.tiles_m} * a.tiles_n * mb.batch, &grid));
  Nvfp4TileKernel<T, k2D, kRht, kSR><<<grid, kQThreads, 0, stream>>>(a);
  return LaunchError("Nvfp4TileKernel");
}

template <typename T, bool kSR>
ffi::Error LaunchSimple(cudaStream_t stream, const MatrixBatch& mb, const Nvfp4Args& a, bool rht) {
  const T* x = static_cast<const T*>(a.x);
  const int64_t nblocks = mb.batch * mb.rows * mb.cols / 16;
  if (nblocks == 0) return ffi::Error::Success();
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(CeilDiv(nblocks, 256), &grid));
  if (a.q) {
    Nvfp4SimpleKernel<T, false, kSR><<<grid, 256, 0, stream>>>(x, mb.rows, mb.cols, mb.cols, 1, nblocks, a.amax, a.key,
                                                                kRowwiseStream, a.q, a.s);
    TE_RETURN_IF_ERROR(LaunchError("Nvfp4SimpleKernel"));
  }
  if (a.q_t) {
    auto kernel = rht ? Nvfp4SimpleKernel<T, true, kSR> : Nvfp4SimpleKernel<T, false, kSR>;
    kernel<<<grid, 256, 0, stream>>>(x, mb.cols, mb.rows, 1, mb.cols, nblocks, a.amax_t, a.key, kColwiseStream, a.q_t,
                                     a.s_t);
    TE_RETURN_IF_ERROR(LaunchError("Nvfp4SimpleKernel"));
  }
  return ffi::Error::Success();
}

template <typename T>
ffi::Error LaunchQuantize(cudaStream_t stream, const MatrixBatch& mb, const Nvfp4Args& a, bool block_2d, bool rht,
                          bool sr) {
  const bool tiles = TileFriendly(mb) && Aligned16(a.x) && Aligned16(a.q) && Aligned16(a.q_t);
  if (block_2d) {
    if (!tiles) return ffi::Error::Internal("te_jax CUDA: NVFP4 16x16 blocks need 16-byte aligned buffers");
    return sr ? LaunchTiles<T, true, false, true>(stream, mb, a) : LaunchTiles<T, true, false, false>(stream, mb, a);
  }
  if (!tiles) return sr ? LaunchSimple<T, true>(stream, mb, a, rht) : LaunchSimple<T, false>(stream, mb, a, rht);
  if (rht) return sr ? LaunchTiles<T, false, true, true>(stream, mb, a) : LaunchTiles<T, false, true, false>(stream, mb, a);
  return sr ? LaunchTiles<T, false, false, true>(stream, mb, a) : LaunchTiles<T, false, false, false>(stream, mb, a);
}

ffi::Error QuantizeNvfp4(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> key,
                         ffi::Result<ffi::Buffer<ffi::U8>> q, ffi::Result<ffi::AnyBuffer> s,
                         ffi::Result<ffi::Buffer<ffi::U8>> q_t, ffi::Result<ffi::AnyBuffer> s_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::F32>> amax_t,
                         bool rowwise, bool colwise, bool block_2d, bool rht, bool stochastic_rounding) {
  auto mb_or = CheckQuantizeNvfp4(x, key, *q, *s, *q_t, *s_t, rowwise, colwise, block_2d, rht);
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  if (mb.batch == 0) return ffi::Error::Success();
  Nvfp4Args a{};
  a.x = x.untyped_data();
  a.rows = mb.rows;
  a.cols = mb.cols;
  a.amax = amax->typed_data();
  a.amax_t = amax_t->typed_data();
  a.key = key.typed_data();
  a.q = rowwise ? q->typed_data() : nullptr;
  a.s = rowwise ? DataOf<uint8_t>(*s) : nullptr;
  a.q_t = colwise ? q_t->typed_data() : nullptr;
  a.s_t = colwise ? DataOf<uint8_t>(*s_t) : nullptr;
  return DispatchInput(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(a.x);
    if (rht) {
      TE_RETURN_IF_ERROR(LaunchRhtAmax<T>(stream, xp, mb, amax->typed_data(), amax_t->typed_data()));
    } else {
      TE_RETURN_IF_ERROR(LaunchAmax<T>(stream, xp, mb, amax->typed_data()));
      TE_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(amax_t->typed_data(), amax->typed_data(), sizeof(float) * mb.batch,
                                                   cudaMemcpyDeviceToDevice, stream),
                                   "copy amax_t"));
    }
    if (!rowwise && !colwise) return ffi::Error::Success();
    return LaunchQuantize<T>(stream, mb, a, block_2d, rht, stochastic_rounding);
  });
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_HANDLER(QuantizeNvfp4, cuda::QuantizeNvfp4);

}  // namespace te_jax
