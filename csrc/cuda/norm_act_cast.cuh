// The host side of the fused norm/activation cast: picking the cast-transpose
// (fp8_cast_transpose.cuh), tile (norm_act_kernels.cuh, which documents the
// producer contract) or generic (norm_act_generic.cuh) kernels and launching
// them, the cast's buffers and arguments, the dbias reduction.
#pragma once

#include "norm_act_generic.cuh"
#include "norm_act_kernels.cuh"
#include "../common/norm_act_checks.h"

namespace te_jax {
namespace cuda {
namespace fused {

// ---- host side ----------------------------------------------------------------------------

inline int TileModeOf(CastMode m) {
  switch (m) {
    case CastMode::kNone: return kModeNone;
    case CastMode::kFp8Tensor:
    case CastMode::kFp8Current: return kModeTensor;
    case CastMode::kMxfp8: return kModeMx;
    case CastMode::kFp8Block: return kModeBlock;
    default: return kModeNv;
  }
}

template <class P, int kMode>
ffi::Error LaunchTile(cudaStream_t stream, const P& prod, CastArgs a, int64_t batch) {
  using G = TileGeom<kMode>;
  a.tiles_m = static_cast<int>(CeilDiv(a.rows, G::kTM));
  a.tiles_n = static_cast<int>(CeilDiv(a.cols, G::kTN));
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(int64_t{a.tiles_m} * a.tiles_n * batch, &grid));
  const int smem = TileSmemBytes<kMode>(a);
  auto kernel = CastTileKernel<P, kMode>;
  if (smem > 48 * 1024) {
    TE_RETURN_IF_ERROR(AllowDynamicSmem(kernel, smem));
  }
  kernel<<<grid, kThreads, smem, stream>>>(prod, a);
  return LaunchError("CastTileKernel");
}

template <class P>
ffi::Error LaunchTileMode(cudaStream_t stream, const P& prod, const CastArgs& a, int64_t batch, int mode) {
  switch (mode) {
    case kModeNone: return LaunchTile<P, kModeNone>(stream, prod, a, batch);
    case kModeTensor: return LaunchTile<P, kModeTensor>(stream, prod, a, batch);
    case kModeMx: return LaunchTile<P, kModeMx>(stream, prod, a, batch);
    case kModeBlock: return LaunchTile<P, kModeBlock>(stream, prod, a, batch);
    case kModeNv: return LaunchTile<P, kModeNv>(stream, prod, a, batch);
    default: return LaunchTile<P, kModeStats>(stream, prod, a, batch);
  }
}

inline ffi::Error GridFor(int64_t units, int64_t batch, dim3* grid) {
  const int64_t blocks = CeilDiv(units, kThreads);
  if (blocks > 0x7fffffffLL || batch > 65535) return ffi::Error::Internal("te_jax CUDA: tensor too large for one launch");
  *grid = dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(batch));
  return ffi::Error::Success();
}

// The generic kernels for one pass of `mode` (kModeStats: the amax, plus the
// transformed columnwise amax when a.rht).
template <class P>
ffi::Error LaunchGeneric(cudaStream_t stream, const P& prod, const CastArgs& a, int64_t batch, int mode) {
  const int64_t per_b = a.rows * a.cols;
  if (per_b == 0 || batch == 0) return ffi::Error::Success();
  dim3 grid;
  const bool row_pass = mode == kModeNone || mode == kModeTensor || (mode == kModeStats && a.amax_acc != nullptr) ||
                        a.q != nullptr;
  if (row_pass) {
    const int blk = mode == kModeMx ? 32 : (mode == kModeBlock ? 128 : (mode == kModeNv ? 16 : 1));
    const int64_t units = per_b / blk;
    TE_RETURN_IF_ERROR(GridFor(units, batch, &grid));
    GenericRowKernel<P><<<grid, kThreads, 0, stream>>>(prod, a, mode, units);
    TE_RETURN_IF_ERROR(LaunchError("GenericRowKernel"));
  }
  const bool col_pass = (a.q_t != nullptr && mode != kModeTensor && mode != kModeNone) ||
                        (mode == kModeStats && a.rht && a.amax_t_acc != nullptr);
  if (col_pass) {
    const int blk = mode == kModeMx ? 32 : (mode == kModeBlock ? 128 : 16);
    const int64_t units = per_b / blk;
    TE_RETURN_IF_ERROR(GridFor(units, batch, &grid));
    GenericColKernel<P><<<grid, kThreads, 0, stream>>>(prod, a, mode, units);
    TE_RETURN_IF_ERROR(LaunchError("GenericColKernel"));
  }
  if (a.dbias_ws) {
    const int64_t units = CeilDiv(a.rows, kDbiasRows) * a.cols;
    TE_RETURN_IF_ERROR(GridFor(units, batch, &grid));
    GenericDbiasKernel<P><<<grid, kThreads, 0, stream>>>(prod, a, units);
    TE_RETURN_IF_ERROR(LaunchError("GenericDbiasKernel"));
  }
  return ffi::Error::Success();
}

// Whether a per-tensor cast pass can take the 128x128 cast-transpose kernel
// (fp8_cast_transpose.cuh): 16-row and 16-column multiples, aligned outputs.
template <class P>
bool CastTransposeFitsPass(const P& prod, const CastArgs& a) {
  return prod.vec_ok && a.rows % 16 == 0 && a.cols % 16 == 0 && Aligned16(a.q) && Aligned16(a.q_t);
}

// The cast-transpose kernel's arguments shared by every mode: shape, codes, dbias partials.
inline CtArgs CtArgsOf(const CastArgs& a) {
  CtArgs c{};
  c.rows = a.rows;
  c.cols = a.cols;
  c.epsilon = a.epsilon;
  c.power_2 = a.power_2;
  c.q = static_cast<uint8_t*>(a.q);
  c.q_t = static_cast<uint8_t*>(a.q_t);
  c.dbias_ws = a.dbias_ws;
  return c;
}

// A per-tensor cast pass (given scale, or current scaling from a.amax_in)
// through the cast-transpose kernel: the codes go through shared memory as
// bytes (the tile kernel stages float32 values) and convert four at a time.
template <class P>
ffi::Error LaunchTensorCastTranspose(cudaStream_t stream, const P& prod, const CastArgs& a, int64_t batch) {
  CtArgs c = CtArgsOf(a);
  c.scale_inv_out = a.scale_inv_out;
  const bool given = a.scale_in != nullptr;
  c.scale_src = given ? a.scale_in : a.amax_in;
  c.amax_out = given ? a.amax_out : nullptr;
  c.scale_out = given ? nullptr : a.scale_out;
  return DispatchBool(a.e5, [&](auto e5c) {
    constexpr bool E5 = decltype(e5c)::value;
    return given ? LaunchCastTranspose<P, E5, CtScale::kGiven>(stream, prod, batch, c)
                 : LaunchCastTranspose<P, E5, CtScale::kCurrent>(stream, prod, batch, c);
  });
}

// Whether a Float8 1x128 cast pass with a columnwise copy can take the
// cast-transpose kernel: whole 128x128 tiles (a tile row is a rowwise block, a
// tile column a columnwise one), aligned outputs.
template <class P>
bool BlockCastTransposeFitsPass(const P& prod, const CastArgs& a) {
  return prod.vec_ok && a.q_t != nullptr && a.rows % kCtTile == 0 && a.cols % kCtTile == 0 && Aligned16(a.q) &&
         Aligned16(a.q_t);
}

// A Float8 1x128 cast pass through the cast-transpose kernel: the tile's
// values stay in registers while its column amaxes are reduced, and the
// columnwise codes go through shared memory as bytes (the tile kernel stages
// the float32 values there, four times the bytes, and stores the columns
// sixteen bytes per thread and row).
template <class P>
ffi::Error LaunchBlockCastTranspose(cudaStream_t stream, const P& prod, const CastArgs& a, int64_t batch) {
  CtArgs c = CtArgsOf(a);
  c.scale_inv_out = static_cast<float*>(a.s);
  c.s_t_out = static_cast<float*>(a.s_t);
  return DispatchBool(a.e5, [&](auto e5c) {
    return LaunchCastTranspose<P, decltype(e5c)::value, CtScale::kBlock1d>(stream, prod, batch, c);
  });
}

// The amax pass (current scaling; NVFP4 without the Hadamard transform)
// through the cast-transpose kernel's statistics mode: 128x128 tiles with up
// to 8 vector loads in flight per thread, nothing written but the amax.
template <class P>
ffi::Error LaunchAmaxPass(cudaStream_t stream, const P& prod, const CastArgs& a, int64_t batch) {
  CtArgs c{};
  c.rows = a.rows;
  c.cols = a.cols;
  c.amax_out = a.amax_acc;
  return LaunchCastTranspose<P, false, CtScale::kStats>(stream, prod, batch, c);
}

// One pass of `mode` over the producer's output: the cast-transpose kernel
// for per-tensor casts, 1x128 casts of whole tiles and plain amax passes that
// fit it, the tile kernel
// when the producer can vector-load, else the generic kernels.
template <class P>
ffi::Error LaunchPass(cudaStream_t stream, const P& prod, const CastArgs& a, int64_t batch, int mode) {
  if (a.rows == 0 || a.cols == 0 || batch == 0) return ffi::Error::Success();
  if (mode == kModeTensor && CastTransposeFitsPass(prod, a)) return LaunchTensorCastTranspose(stream, prod, a, batch);
  if (mode == kModeBlock && BlockCastTransposeFitsPass(prod, a)) return LaunchBlockCastTranspose(stream, prod, a, batch);
  if (mode == kModeStats && !a.rht && a.amax_acc != nullptr && a.dbias_ws == nullptr &&
      CastTransposeFitsPass(prod, a)) {
    return LaunchAmaxPass(stream, prod, a, batch);
  }
  if (prod.vec_ok && a.cols % 8 == 0) return LaunchTileMode(stream, prod, a, batch, mode);
  return LaunchGeneric(stream, prod, a, batch, mode);
}

// The seven cast results as device pointers.
struct CastBuffers {
  void* q;
  void* s;
  void* q_t;
  void* s_t;
  float* amax;
  float* amax_t;
  float* scale;
  ffi::DataType q_type;
};

inline int OutTypeOf(ffi::DataType t) {
  return t == ffi::DataType::F32 ? 0 : (t == ffi::DataType::BF16 ? 1 : 2);
}

// CastArgs for the final (cast) pass of `sp`, with scale/amax sources set.
inline CastArgs CastArgsFor(const CastSpec& sp, const CastBuffers& o, int64_t rows, int64_t cols,
                            const float* scale_in, const uint32_t* key) {
  CastArgs a;
  a.rows = rows;
  a.cols = cols;
  a.e5 = o.q_type == ffi::DataType::F8E5M2;
  a.out_type = OutTypeOf(o.q_type);
  a.power_2 = sp.power_2;
  a.epsilon = sp.epsilon;
  a.q = sp.rowwise ? o.q : nullptr;
  a.q_t = sp.colwise ? o.q_t : nullptr;
  a.s = sp.rowwise || IsPerTensor(sp.mode) ? o.s : nullptr;
  a.s_t = sp.colwise ? o.s_t : nullptr;
  if (sp.mode == CastMode::kFp8Tensor) {
    a.scale_in = scale_in;
    a.amax_out = o.amax;
    a.scale_inv_out = static_cast<float*>(o.s);
  } else if (sp.mode == CastMode::kFp8Current) {
    a.amax_in = o.amax;
    a.scale_out = o.scale;
    a.scale_inv_out = static_cast<float*>(o.s);
  } else if (sp.mode == CastMode::kNvfp4) {
    a.amax_in = o.amax;
    a.amax_t_in = o.amax_t;
    a.key = sp.sr ? key : nullptr;
    a.rht = sp.rht;
  }
  return a;
}

// The amax pass's CastArgs (fp8_current, nvfp4): writes the amax outputs.
inline CastArgs StatsArgsFor(const CastSpec& sp, const CastBuffers& o, int64_t rows, int64_t cols) {
  CastArgs a;
  a.rows = rows;
  a.cols = cols;
  a.amax_acc = o.amax;
  a.rht = sp.rht;
  a.amax_t_acc = sp.rht ? o.amax_t : nullptr;
  return a;
}

// The whole cast of a producer's output: zeroes the amax outputs, runs the
// amax pass when the mode needs one, then the cast pass (with dbias partials
// into `dbias_ws` when not null).
template <class P>
ffi::Error RunCast(cudaStream_t stream, const P& prod, const CastSpec& sp, const CastBuffers& o, int64_t batch,
                   int64_t rows, int64_t cols, const float* scale_in, const uint32_t* key, float* dbias_ws) {
  const size_t nb = sizeof(float) * batch;
  if (o.amax) TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(o.amax, 0, nb, stream), "memset amax"));
  if (NeedsAmaxPass(sp.mode)) {
    if (sp.rht) TE_RETURN_IF_ERROR(CudaError(cudaMemsetAsync(o.amax_t, 0, nb, stream), "memset amax_t"));
    TE_RETURN_IF_ERROR(LaunchPass(stream, prod, StatsArgsFor(sp, o, rows, cols), batch, kModeStats));
    if (sp.mode == CastMode::kNvfp4 && !sp.rht) {
      TE_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(o.amax_t, o.amax, nb, cudaMemcpyDeviceToDevice, stream), "copy amax"));
    }
  }
  CastArgs a = CastArgsFor(sp, o, rows, cols, scale_in, key);
  a.dbias_ws = dbias_ws;
  return LaunchPass(stream, prod, a, batch, TileModeOf(sp.mode));
}

// Reduces the dbias partials into dbias [batch, cols].
inline ffi::Error LaunchDbiasReduce(cudaStream_t stream, const float* ws, int64_t rows, int64_t cols, int64_t batch,
                                    float* out) {
  if (batch * cols == 0) return ffi::Error::Success();
  const int64_t groups = CeilDiv(rows, kDbiasRows);
  if (groups == 0) return CudaError(cudaMemsetAsync(out, 0, sizeof(float) * batch * cols, stream), "memset dbias");
  dim3 grid;
  TE_RETURN_IF_ERROR(GridOf(CeilDiv(batch * cols, kThreads), &grid));
  DbiasReduceKernel<<<grid, kThreads, 0, stream>>>(ws, groups, cols, batch, out);
  return LaunchError("DbiasReduceKernel");
}

// The device pointers of a handler's seven cast results (nullptr for an empty one).
inline CastBuffers BuffersOf(const FusedCastOut& o) {
  auto ptr = [](const ffi::AnyBuffer& b) -> void* { return b.element_count() ? b.untyped_data() : nullptr; };
  return CastBuffers{ptr(o.q), ptr(o.s), ptr(o.q_t), ptr(o.s_t), static_cast<float*>(ptr(o.amax)),
                     static_cast<float*>(ptr(o.amax_t)), static_cast<float*>(ptr(o.scale)), o.q.element_type()};
}

inline bool AllAligned16(std::initializer_list<const void*> ps) {
  for (const void* p : ps) {
    if (p != nullptr && !Aligned16(p)) return false;
  }
  return true;
}

// The row kernels' shape for a norm row of H elements (H % 8 == 0): the
// number of 8-element vectors per thread, and whether a warp (else the whole
// block) takes a row; 0 when the row is too wide for them.
inline int RowVectors(int64_t h, bool* warp_per_row) {
  const int64_t v = h / 8;
  *warp_per_row = v <= 128;
  if (v <= 32) return 1;
  if (v <= 64) return 2;
  if (v <= 128) return 4;
  if (v <= 256) return 1;
  if (v <= 512) return 2;
  if (v <= 1024) return 4;
  if (v <= 2048) return 8;
  return 0;
}

}  // namespace fused
}  // namespace cuda
}  // namespace te_jax
