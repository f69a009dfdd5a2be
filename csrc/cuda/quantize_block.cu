// CUDA FFI handlers for MXFP8 (1x32, E8M0 scales) and Float8 block scaling
// (1x128 or 128x128, float32 1/scale).
//
// 1D blocks: one thread block reads a TM x TN tile once with 16-byte loads,
// quantizes the rowwise copy straight from registers (a block's amax is a
// shuffle over the lanes holding it) and keeps the raw tile in shared memory;
// then each thread takes 2 columns x 16 rows of it for the columnwise copy
// (block amax over 16-row segments by shuffles), writing 16-byte stores of
// the transposed output. Float8 blocks use the FP8 cast-transpose kernel
// (fp8_cast_transpose.cuh): 128x128 blocks share one scale per tile, and
// 1x128 blocks of matrices whose sides are multiples of 128 are its tiles'
// rows and columns. Odd shapes take a simple kernel with one thread per block.
#include "fp8_cast_transpose.cuh"
#include "../common/bindings.h"

namespace te_jax {
namespace cuda {
namespace {

// Tile geometry per mode: TM x TN elements, kBlk-element blocks, kThreads.
template <bool kMx>
struct TileCfg {
  static constexpr int kTM = kMx ? 64 : 128;
  static constexpr int kTN = kMx ? 64 : 128;
  static constexpr int kBlk = static_cast<int>(kMx ? kMxfp8Block : kFp8Block);
  static constexpr int kThreads = kMx ? 128 : 512;
};

// Resident blocks per SM (a register cap that keeps enough loads in flight):
// MXFP8 of 2-byte inputs fits 64 registers at 8 blocks (1024 threads); 4-byte
// inputs would spill there and keep 4.
template <typename T, bool kMx>
constexpr int BlockMinBlocks() {
  return kMx ? (sizeof(T) <= 2 ? 8 : 4) : 2;
}

struct BlockArgs {
  const void* x;
  int64_t rows, cols;
  int tiles_m, tiles_n;
  bool power_2;
  uint8_t* q;    // rowwise codes, or nullptr
  void* s;       // rowwise scales: uint8 E8M0 (MXFP8) or float 1/scale
  uint8_t* q_t;  // columnwise codes, or nullptr
  void* s_t;
};

// Multiplier for a block with amax bits `m`; stores its scale at s[idx].
template <bool kMx, bool E5>
__device__ __forceinline__ float BlockMultiplier(uint32_t m, bool power_2, void* s, int64_t idx, bool store) {
  if constexpr (kMx) {
    const uint8_t code = E8M0FromAmax(BitsFloat(m), Fp8MaxOf<E5>());
    if (store) static_cast<uint8_t*>(s)[idx] = code;
    return E8M0InverseToFloat(code);
  } else {
    const float scale = ScaleFromAmax(BitsFloat(m), Fp8MaxOf<E5>(), 0.0f, power_2);
    if (store) static_cast<float*>(s)[idx] = 1.0f / scale;
    return scale;
  }
}

template <typename T, bool E5, bool kMx>
__global__ void __launch_bounds__(TileCfg<kMx>::kThreads, BlockMinBlocks<T, kMx>()) BlockTileKernel(BlockArgs a) {
  using C = TileCfg<kMx>;
  constexpr int kTM = C::kTM, kTN = C::kTN, kBlk = C::kBlk, kNT = C::kThreads;
  constexpr int kVecPerRow = kTN / 8;
  constexpr int kVpt = kTM * kTN / 8 / kNT;
  constexpr int kWordsPerVec = sizeof(T) / 2;  // 16-byte chunks per 8 elements
  constexpr int kRowBytes = kTN * sizeof(T);
  constexpr int kChunks = kRowBytes / 16;
  constexpr int kNseg = kTM / 16;
  // Lanes reading one row in the column phase cover kSwz chunks; rows 16
  // apart get their chunks XOR-ed by multiples of kSwz (no bank conflicts).
  constexpr int kSwz = 4 * sizeof(T) / kNseg;
  extern __shared__ uint4 smem[];
  uint8_t* tile = reinterpret_cast<uint8_t*>(smem);

  const int tid = threadIdx.x;
  const int64_t tiles = int64_t{a.tiles_m} * a.tiles_n;
  const int64_t b = blockIdx.x / tiles;
  const int t_in = static_cast<int>(blockIdx.x % tiles);
  const int64_t row0 = int64_t{t_in / a.tiles_n} * kTM, col0 = int64_t{t_in % a.tiles_n} * kTN;
  const int64_t size = a.rows * a.cols;
  const T* x = static_cast<const T*>(a.x) + b * size;
  const bool colwise = a.q_t != nullptr;

  Raw8<T> raw[kVpt];
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int v = tid + kNT * i, r = v / kVecPerRow, cv = v % kVecPerRow;
    const int64_t gr = row0 + r, gc = col0 + cv * 8;
    raw[i] = (gr < a.rows && gc < a.cols) ? LoadRaw8(x + gr * a.cols + gc) : ZeroRaw8<T>();
  }
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int v = tid + kNT * i, r = v / kVecPerRow, cv = v % kVecPerRow;
    const int64_t gr = row0 + r, gc = col0 + cv * 8;
    const bool valid = gr < a.rows && gc < a.cols;
    if (colwise) {
      const int swz = ((r >> 4) * kSwz) & (kChunks - 1);
#pragma unroll
      for (int k = 0; k < kWordsPerVec; ++k) smem[r * kChunks + ((cv * kWordsPerVec + k) ^ swz)] = raw[i].w[k];
    }
    if (a.q) {
      float f[8];
      Unpack8(raw[i], f);
      const uint32_t m = GroupMax<kBlk / 8>(AbsMaxBits8(f));
      const int64_t sidx = b * (size / kBlk) + gr * (a.cols / kBlk) + gc / kBlk;
      const float mult = BlockMultiplier<kMx, E5>(m, a.power_2, a.s, sidx, valid && cv % (kBlk / 8) == 0);
      if (valid) *reinterpret_cast<uint2*>(a.q + b * size + gr * a.cols + gc) = Fp8x8<E5>(f, mult);
    }
  }
  if (!colwise) return;
  __syncthreads();

  // Column phase: item = (segment of 16 rows, pair of columns); the lanes of
  // one block (kBlk / 16 segments) are adjacent, so its amax is a shuffle.
  constexpr int kItems = (kTN / 2) * kNseg;
  static_assert(kItems % kNT == 0, "every thread takes the same number of items");
#pragma unroll 1
  for (int k = 0; k < kItems / kNT; ++k) {
    const int it = tid + k * kNT;
    const int seg = it % kNseg, c = (it / kNseg) * 2;
    const int swz = (seg * kSwz) & (kChunks - 1);
    const int byte = c * static_cast<int>(sizeof(T));
    const int off = (((byte / 16) ^ swz) * 16) + byte % 16;
    float v0[16], v1[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) Load2(reinterpret_cast<const T*>(tile + (seg * 16 + i) * kRowBytes + off), v0[i], v1[i]);
    uint32_t m0 = 0, m1 = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      m0 = max(m0, AbsBits(v0[i]));
      m1 = max(m1, AbsBits(v1[i]));
    }
    m0 = GroupMax<kBlk / 16>(m0);
    m1 = GroupMax<kBlk / 16>(m1);
    const int64_t gc = col0 + c, gr0 = row0 + seg * 16;
    const bool valid = gc < a.cols && gr0 < a.rows;
    const bool store_scale = valid && seg % (kBlk / 16) == 0;
    const int64_t sidx = b * (size / kBlk) + gc * (a.rows / kBlk) + gr0 / kBlk;
    const float mult0 = BlockMultiplier<kMx, E5>(m0, a.power_2, a.s_t, sidx, store_scale);
    const float mult1 = BlockMultiplier<kMx, E5>(m1, a.power_2, a.s_t, sidx + a.rows / kBlk, store_scale);
    if (valid) {
      uint32_t w0[4], w1[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        w0[k] = Fp8x4<E5>(v0[4 * k] * mult0, v0[4 * k + 1] * mult0, v0[4 * k + 2] * mult0, v0[4 * k + 3] * mult0);
        w1[k] = Fp8x4<E5>(v1[4 * k] * mult1, v1[4 * k + 1] * mult1, v1[4 * k + 2] * mult1, v1[4 * k + 3] * mult1);
      }
      uint8_t* qt = a.q_t + b * size + gc * a.rows + gr0;
      *reinterpret_cast<uint4*>(qt) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
      *reinterpret_cast<uint4*>(qt + a.rows) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
    }
  }
}

// Fallback for any shape: one thread per 1D block of the matrix viewed as
// rows x cols with strides (rs, cs); codes go to q row-major in that view.
template <typename T, bool E5, bool kMx>
__global__ void __launch_bounds__(256) BlockSimpleKernel(const T* x, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                                                         int64_t nblocks, bool power_2, uint8_t* q, void* s) {
  constexpr int kBlk = TileCfg<kMx>::kBlk;
  const int64_t id = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (id >= nblocks) return;
  const int64_t bpr = cols / kBlk, size = rows * cols;
  const int64_t b = id / (rows * bpr), i = (id / bpr) % rows, j0 = (id % bpr) * kBlk;
  const T* xb = x + b * size + i * rs + j0 * cs;
  uint32_t m = 0;
  for (int k = 0; k < kBlk; ++k) m = max(m, AbsBits(ToF(xb[k * cs])));
  const float mult = BlockMultiplier<kMx, E5>(m, power_2, s, id, true);
  uint8_t* qb = q + b * size + i * cols + j0;
  for (int k = 0; k < kBlk; ++k) qb[k] = static_cast<uint8_t>(Fp8x2<E5>(ToF(xb[k * cs]) * mult, 0.0f));
}

template <typename T, bool E5, bool kMx>
ffi::Error LaunchSimple(cudaStream_t stream, const MatrixBatch& mb, const BlockArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const int64_t nblocks = mb.batch * mb.rows * mb.cols / TileCfg<kMx>::kBlk;
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(CeilDiv(nblocks, 256), &grid));
  if (nblocks == 0) return ffi::Error::Success();
  if (a.q) {
    BlockSimpleKernel<T, E5, kMx><<<grid, 256, 0, stream>>>(x, mb.rows, mb.cols, mb.cols, 1, nblocks, a.power_2, a.q, a.s);
    TE_RETURN_IF_ERROR(LaunchError("BlockSimpleKernel"));
  }
  if (a.q_t) {
    BlockSimpleKernel<T, E5, kMx><<<grid, 256, 0, stream>>>(x, mb.cols, mb.rows, 1, mb.cols, nblocks, a.power_2, a.q_t,
                                                             a.s_t);
    TE_RETURN_IF_ERROR(LaunchError("BlockSimpleKernel"));
  }
  return ffi::Error::Success();
}

template <typename T, bool E5, bool kMx>
ffi::Error LaunchBlock1d(cudaStream_t stream, const MatrixBatch& mb, BlockArgs a) {
  using C = TileCfg<kMx>;
  if (!TileFriendly(mb) || !Aligned16(a.x) || !Aligned16(a.q_t) || (reinterpret_cast<uintptr_t>(a.q) & 7u)) {
    return LaunchSimple<T, E5, kMx>(stream, mb, a);
  }
  a.tiles_m = static_cast<int>(CeilDiv(mb.rows, C::kTM));
  a.tiles_n = static_cast<int>(CeilDiv(mb.cols, C::kTN));
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(int64_t{a.tiles_m} * a.tiles_n * mb.batch, &grid));
  const int smem = a.q_t ? C::kTM * C::kTN * static_cast<int>(sizeof(T)) : 0;
  auto kernel = BlockTileKernel<T, E5, kMx>;
  if (smem > 48 * 1024) {
    TE_RETURN_IF_ERROR(AllowDynamicSmem(kernel, smem));
  }
  kernel<<<grid, C::kThreads, smem, stream>>>(a);
  return LaunchError("BlockTileKernel");
}

ffi::Error QuantizeMxfp8(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                         ffi::Result<ffi::Buffer<ffi::U8>> s, ffi::Result<ffi::AnyBuffer> q_t,
                         ffi::Result<ffi::Buffer<ffi::U8>> s_t, bool rowwise, bool colwise) {
  auto cast = CheckQuantizeFp8Blocks(x, *q, *s, *q_t, *s_t, rowwise, colwise, kMxfp8Block, 1);
  if (cast.has_error()) return cast.error();
  const MatrixBatch mb = cast.value().mb;
  const Fp8Format fmt = cast.value().fmt;
  if (!rowwise && !colwise) return ffi::Error::Success();
  BlockArgs a{};
  a.x = x.untyped_data();
  a.rows = mb.rows;
  a.cols = mb.cols;
  a.q = rowwise ? DataOf<uint8_t>(*q) : nullptr;
  a.s = rowwise ? s->typed_data() : nullptr;
  a.q_t = colwise ? DataOf<uint8_t>(*q_t) : nullptr;
  a.s_t = colwise ? s_t->typed_data() : nullptr;
  return DispatchInput(x.element_type(), [&](auto tag) {
    return DispatchBool(fmt.mant_bits == 2, [&](auto e5c) {
      return LaunchBlock1d<decltype(tag), decltype(e5c)::value, true>(stream, mb, a);
    });
  });
}

ffi::Error QuantizeFp8Block(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::Buffer<ffi::F32>> s, ffi::Result<ffi::AnyBuffer> q_t,
                            ffi::Result<ffi::Buffer<ffi::F32>> s_t, bool rowwise, bool colwise, bool block_2d,
                            bool power_2) {
  auto cast = CheckQuantizeFp8Blocks(x, *q, *s, *q_t, *s_t, rowwise, colwise, kFp8Block, block_2d ? kFp8Block : 1);
  if (cast.has_error()) return cast.error();
  const MatrixBatch mb = cast.value().mb;
  const Fp8Format fmt = cast.value().fmt;
  if (!rowwise && !colwise) return ffi::Error::Success();
  const bool e5 = fmt.mant_bits == 2;
  // The cast-transpose kernel: 128x128 blocks, and 1x128 blocks when both sides are multiples of 128.
  CtArgs c{};
  c.x = x.untyped_data();
  c.power_2 = power_2;
  c.q = rowwise ? DataOf<uint8_t>(*q) : nullptr;
  c.q_t = colwise ? DataOf<uint8_t>(*q_t) : nullptr;
  c.scale_inv_out = rowwise ? s->typed_data() : nullptr;
  c.s_t_out = colwise ? s_t->typed_data() : nullptr;
  const bool fits = CastTransposeFits(mb, c.x, c.q, c.q_t);
  if (block_2d && !fits) return ffi::Error::Internal("te_jax CUDA: Float8 128x128 blocks need 16-byte aligned buffers");
  if (block_2d || (fits && mb.rows % kFp8Block == 0 && mb.cols % kFp8Block == 0)) {
    return DispatchInput(x.element_type(), [&](auto tag) {
      return DispatchBool(e5, [&](auto e5c) {
        using T = decltype(tag);
        constexpr bool E5 = decltype(e5c)::value;
        return block_2d ? LaunchFp8CastTranspose<T, E5, CtScale::kBlock2d>(stream, mb, c)
                        : LaunchFp8CastTranspose<T, E5, CtScale::kBlock1d>(stream, mb, c);
      });
    });
  }
  BlockArgs a{};
  a.x = x.untyped_data();
  a.rows = mb.rows;
  a.cols = mb.cols;
  a.power_2 = power_2;
  a.q = rowwise ? DataOf<uint8_t>(*q) : nullptr;
  a.s = rowwise ? s->typed_data() : nullptr;
  a.q_t = colwise ? DataOf<uint8_t>(*q_t) : nullptr;
  a.s_t = colwise ? s_t->typed_data() : nullptr;
  return DispatchInput(x.element_type(), [&](auto tag) {
    return DispatchBool(e5, [&](auto e5c) {
      return LaunchBlock1d<decltype(tag), decltype(e5c)::value, false>(stream, mb, a);
    });
  });
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_HANDLER(QuantizeMxfp8, cuda::QuantizeMxfp8);
TE_JAX_CUDA_HANDLER(QuantizeFp8Block, cuda::QuantizeFp8Block);

}  // namespace te_jax
