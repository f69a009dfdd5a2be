// CUDA FFI handler for NVFP4: E2M1 codes packed two per byte, E4M3 scales
// per 16 elements (1x16, or 16x16 repeated per row), float32 global amax.
//
// Pass 1 reads x once for the global amax (and, with the random Hadamard
// transform, the amax of the transformed columnwise copy). Pass 2 is a tile
// kernel: a 64x64 tile is read once with 16-byte loads; 1D rowwise blocks are
// quantized from registers (2 lanes per block); the raw tile goes to shared
// memory, where each thread takes 2 columns x 16 rows: the columnwise
// blocks (after the RHT), and for 16x16 blocks the block amax (a shuffle over
// the 8 lanes of a block), which a third phase uses for the rowwise copy.
#include "amax.cuh"

namespace te_jax {
namespace cuda {
namespace {

constexpr int kNvTile = 64;
constexpr int kNvThreads = 128;

struct Nvfp4Global {
  float s_dec;   // 1 / S_enc
  float factor;  // S_enc / 6
};

__device__ __forceinline__ Nvfp4Global GlobalOf(float amax) {
  const float s_enc = Nvfp4GlobalEncodeScale(amax);
  return {1.0f / s_enc, s_enc * (1.0f / 6.0f)};
}

// FloatToE2M1 for a product (never a subnormal or a signaling NaN under
// FTZ), in half the instructions; checked against FloatToE2M1 for every such
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
};

template <typename T, bool k2D, bool kRht, bool kSR>
__global__ void __launch_bounds__(kNvThreads) Nvfp4TileKernel(Nvfp4Args a) {
  constexpr int kVecPerRow = kNvTile / 8, kVpt = kNvTile * kNvTile / 8 / kNvThreads;
  constexpr int kWordsPerVec = sizeof(T) / 2;
  constexpr int kRowBytes = kNvTile * sizeof(T), kChunks = kRowBytes / 16;
  constexpr int kSwz = sizeof(T);  // chunks read per row by the 8 lanes of a segment
  __shared__ uint4 smem[kNvTile * kRowBytes / 16];
  __shared__ uint32_t blk_amax[kNvTile / 16][kNvTile / 16];
  const uint8_t* tile = reinterpret_cast<const uint8_t*>(smem);

  const int tid = threadIdx.x;
  const int64_t tiles = int64_t{a.tiles_m} * a.tiles_n;
  const int64_t b = blockIdx.x / tiles;
  const int t_in = static_cast<int>(blockIdx.x % tiles);
  const int64_t row0 = int64_t{t_in / a.tiles_n} * kNvTile, col0 = int64_t{t_in % a.tiles_n} * kNvTile;
  const int64_t size = a.rows * a.cols;
  const T* x = static_cast<const T*>(a.x) + b * size;
  const Nvfp4Global g_row = GlobalOf(a.amax[b]);
  const Nvfp4Global g_col = GlobalOf(a.amax_t[b]);
  uint32_t row_seed = 0, col_seed = 0;
  if constexpr (kSR) {
    row_seed = StreamSeed(a.key[2 * b], a.key[2 * b + 1], kRowwiseStream);
    col_seed = StreamSeed(a.key[2 * b], a.key[2 * b + 1], kColwiseStream);
  }
  const bool keep = a.q_t != nullptr || k2D;

  Raw8<T> raw[kVpt];
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int v = tid + kNvThreads * i, r = v / kVecPerRow, cv = v % kVecPerRow;
    const int64_t gr = row0 + r, gc = col0 + cv * 8;
    raw[i] = (gr < a.rows && gc < a.cols) ? LoadRaw8(x + gr * a.cols + gc) : ZeroRaw8<T>();
  }
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int v = tid + kNvThreads * i, r = v / kVecPerRow, cv = v % kVecPerRow;
    const int64_t gr = row0 + r, gc = col0 + cv * 8;
    if (keep) {
      const int swz = ((r >> 4) * kSwz) & (kChunks - 1);
#pragma unroll
      for (int k = 0; k < kWordsPerVec; ++k) smem[r * kChunks + ((cv * kWordsPerVec + k) ^ swz)] = raw[i].w[k];
    }
    if (!k2D && a.q) {
      float f[8];
      Unpack8(raw[i], f);
      const uint32_t m = GroupMax<2>(AbsMaxBits8(f));
      const uint8_t sb = BlockScaleCode(m, g_row.factor);
      const float enc = Nvfp4BlockEncode(sb, g_row.s_dec);
      const int64_t idx = gr * a.cols + gc;
      const uint32_t w = E2M1x8<kSR>(f, enc, row_seed, static_cast<uint32_t>(idx));
      if (gr < a.rows && gc < a.cols) {
        *reinterpret_cast<uint32_t*>(a.q + (b * size + idx) / 2) = w;
        if ((cv & 1) == 0) a.s[(b * size + idx) / 16] = sb;
      }
    }
  }
  if (!keep) return;
  __syncthreads();

  // Column phase: 16 rows (segment seg) x 2 columns per thread; a warp holds
  // 16 columns, so the 8 lanes with the same seg form one 16x16 block.
  {
    const int seg = tid & 3, c = (tid >> 2) * 2;
    const int byte = c * static_cast<int>(sizeof(T));
    const int off = (((byte / 16) ^ ((seg * kSwz) & (kChunks - 1))) * 16) + byte % 16;
    float v[2][16];
#pragma unroll
    for (int i = 0; i < 16; ++i) Load2(reinterpret_cast<const T*>(tile + (seg * 16 + i) * kRowBytes + off), v[0][i], v[1][i]);
    uint32_t m2d = 0;
    if constexpr (k2D) {
#pragma unroll
      for (int i = 0; i < 16; ++i) m2d = max(m2d, max(AbsBits(v[0][i]), AbsBits(v[1][i])));
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) m2d = max(m2d, __shfl_xor_sync(0xffffffffu, m2d, o));
      if ((tid & 31) < 4) blk_amax[seg][tid / 32] = m2d;
    }
    const int64_t gc = col0 + c, gr0 = row0 + seg * 16;
    if (a.q_t && gc < a.cols && gr0 < a.rows) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if constexpr (kRht) Rht16(v[j]);
        uint32_t m = m2d;
        if constexpr (!k2D) {
#pragma unroll
          for (int i = 0; i < 16; ++i) m = max(m, AbsBits(v[j][i]));
        }
        const uint8_t sb = BlockScaleCode(m, g_col.factor);
        const float enc = Nvfp4BlockEncode(sb, g_col.s_dec);
        const int64_t idx = (gc + j) * a.rows + gr0;
        const uint32_t lo = E2M1x8<kSR>(v[j], enc, col_seed, static_cast<uint32_t>(idx));
        const uint32_t hi = E2M1x8<kSR>(v[j] + 8, enc, col_seed, static_cast<uint32_t>(idx + 8));
        *reinterpret_cast<uint2*>(a.q_t + (b * size + idx) / 2) = make_uint2(lo, hi);
        a.s_t[(b * size + idx) / 16] = sb;
      }
    }
  }
  if (!k2D || a.q == nullptr) return;
  __syncthreads();

  // 16x16 blocks, rowwise copy: the tile again from shared memory.
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int v = tid + kNvThreads * i, r = v / kVecPerRow, cv = v % kVecPerRow;
    const int64_t gr = row0 + r, gc = col0 + cv * 8;
    if (gr >= a.rows || gc >= a.cols) continue;
    const int swz = ((r >> 4) * kSwz) & (kChunks - 1);
    Raw8<T> rw;
#pragma unroll
    for (int k = 0; k < kWordsPerVec; ++k) rw.w[k] = smem[r * kChunks + ((cv * kWordsPerVec + k) ^ swz)];
    float f[8];
    Unpack8(rw, f);
    const uint8_t sb = BlockScaleCode(blk_amax[r >> 4][cv >> 1], g_row.factor);
    const float enc = Nvfp4BlockEncode(sb, g_row.s_dec);
    const int64_t idx = gr * a.cols + gc;
    *reinterpret_cast<uint32_t*>(a.q + (b * size + idx) / 2) = E2M1x8<kSR>(f, enc, row_seed, static_cast<uint32_t>(idx));
    if ((cv & 1) == 0) a.s[(b * size + idx) / 16] = sb;
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

// amax of x (plain) and amax_t of the RHT of x^T: each thread takes 16 rows
// of 16 / sizeof(T) columns (kVec) or of one column.
template <typename T, bool kVec>
__global__ void __launch_bounds__(256) RhtAmaxKernel(const T* x, int64_t rows, int64_t cols, int64_t col_blocks,
                                                     float* amax, float* amax_t) {
  constexpr int kCpt = kVec ? 16 / sizeof(T) : 1;
  __shared__ uint32_t scratch[2][8];
  const int64_t per_matrix = (rows / 16) * col_blocks;
  const int64_t b = blockIdx.x / per_matrix, rem = blockIdx.x % per_matrix;
  const int64_t seg = rem / col_blocks, c0 = ((rem % col_blocks) * 256 + threadIdx.x) * kCpt;
  uint32_t m = 0, mt = 0;
  if (c0 < cols) {
    const T* p = x + b * rows * cols + seg * 16 * cols + c0;
    if constexpr (kVec) {
      uint4 raw[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) raw[i] = __ldg(reinterpret_cast<const uint4*>(p + i * cols));
#pragma unroll
      for (int k = 0; k < kCpt; ++k) {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          v[i] = ElemOf<T>(raw[i], k);
          m = max(m, AbsBits(v[i]));
        }
        Rht16(v);
#pragma unroll
        for (int i = 0; i < 16; ++i) mt = max(mt, AbsBits(v[i]));
      }
    } else {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        v[i] = ToF(p[i * cols]);
        m = max(m, AbsBits(v[i]));
      }
      Rht16(v);
#pragma unroll
      for (int i = 0; i < 16; ++i) mt = max(mt, AbsBits(v[i]));
    }
  }
  BlockAmaxAtomic<256>(m, scratch[0], amax + b);
  BlockAmaxAtomic<256>(mt, scratch[1], amax_t + b);
}

template <typename T>
ffi::Error LaunchRhtAmax(cudaStream_t stream, const T* x, const MatrixBatch& mb, float* amax, float* amax_t) {
  TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(amax, 0, sizeof(float) * mb.batch, stream), "memset amax"));
  TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(amax_t, 0, sizeof(float) * mb.batch, stream), "memset amax_t"));
  if (mb.rows == 0 || mb.cols == 0) return ffi::Error::Success();
  const bool vec = (mb.cols * sizeof(T)) % 16 == 0 && Aligned16(x);
  const int64_t col_blocks = CeilDiv(mb.cols, 256 * (vec ? 16 / sizeof(T) : 1));
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(mb.batch * (mb.rows / 16) * col_blocks, &grid));
  if (vec) {
    RhtAmaxKernel<T, true><<<grid, 256, 0, stream>>>(x, mb.rows, mb.cols, col_blocks, amax, amax_t);
  } else {
    RhtAmaxKernel<T, false><<<grid, 256, 0, stream>>>(x, mb.rows, mb.cols, col_blocks, amax, amax_t);
  }
  return LaunchError("RhtAmaxKernel");
}

template <typename T, bool k2D, bool kRht, bool kSR>
ffi::Error LaunchTiles(cudaStream_t stream, const MatrixBatch& mb, Nvfp4Args a) {
  a.tiles_m = static_cast<int>(CeilDiv(mb.rows, kNvTile));
  a.tiles_n = static_cast<int>(CeilDiv(mb.cols, kNvTile));
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(int64_t{a.tiles_m} * a.tiles_n * mb.batch, &grid));
  Nvfp4TileKernel<T, k2D, kRht, kSR><<<grid, kNvThreads, 0, stream>>>(a);
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
  TE_RETURN_IF_ERROR(CheckHighPrecision(x, "x"));
  auto mb_or = MatrixBatchOf(x, "x");
  if (mb_or.has_error()) return mb_or.error();
  const MatrixBatch mb = mb_or.value();
  if (rht && block_2d) return InvalidArgument("the random Hadamard transform applies to 1D (1x16) blocks only");
  if (s->element_type() != ffi::DataType::F8E4M3FN || s_t->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument("NVFP4 block scales must be float8_e4m3fn");
  }
  TE_RETURN_IF_ERROR(CheckBlockOutputs(mb, kNvfp4Block, rowwise, colwise || rht, block_2d));
  TE_RETURN_IF_ERROR(CheckOutput(*q, "q", rowwise, mb.batch, mb.rows, mb.cols / 2));
  TE_RETURN_IF_ERROR(CheckOutput(*s, "s", rowwise, mb.batch, mb.rows, mb.cols / kNvfp4Block));
  TE_RETURN_IF_ERROR(CheckOutput(*q_t, "q_t", colwise, mb.batch, mb.cols, mb.rows / 2));
  TE_RETURN_IF_ERROR(CheckOutput(*s_t, "s_t", colwise, mb.batch, mb.cols, mb.rows / kNvfp4Block));
  if (static_cast<int64_t>(key.element_count()) != 2 * mb.batch) return InvalidArgument("key must be uint32[..., 2]");
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeNvfp4Cuda, cuda::QuantizeNvfp4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("colwise")
                                  .Attr<bool>("block_2d")
                                  .Attr<bool>("rht")
                                  .Attr<bool>("stochastic_rounding"));

}  // namespace te_jax
