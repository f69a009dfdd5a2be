// CUDA FFI handler te_jax_act_bwd: dx = dy * act'(x) (gated: both halves)
// fused with dx's cast and dbias. dx is computed from dy and x inside the cast
// kernels (norm_act_cast.cuh); dbias comes from the same pass: each tile
// writes the column sums of its 64-row groups to the workspace, and a small
// kernel adds them up in order (deterministic, no atomics).
#include "norm_act_cast.cuh"
#include "../common/bindings.h"
#include "../common/norm_act_checks.h"

namespace te_jax {
namespace cuda {
namespace {

// Output (b, r, c) of dx [rows, cols]: plain dy * act'(x); kGated, for c < F
// da = dy * g * act'(a), for c >= F dg = dy * act(a) (a = x[:, :F], g = x[:, F:]).
// A plain activation's vector is two 16-byte loads (dy, x), a gated one three.
template <typename T, bool kGated>
struct ActBwdProducer {
  const T* dy;
  const T* x;
  int64_t rows, cols, F;  // dx is [rows, cols]; dy is [rows, F]
  ActKind act = ActKind::kGelu;
  bool vec_ok;

  struct RawPlain {
    Raw8<T> d, a;
  };
  struct RawGated {
    Raw8<T> d, a, g;
  };
  using Raw = std::conditional_t<kGated, RawGated, RawPlain>;

  __device__ __forceinline__ Raw Fetch(int64_t b, int64_t r, int64_t c0) const {
    const T* xr = x + (b * rows + r) * cols;
    const T* dr = dy + (b * rows + r) * F;
    const int64_t c = (kGated && c0 >= F) ? c0 - F : c0;
    Raw raw;
    raw.d = LoadRaw8(dr + c);
    raw.a = LoadRaw8(xr + c);
    if constexpr (kGated) raw.g = c0 < F ? LoadRaw8(xr + F + c) : raw.a;
    return raw;
  }

  __device__ __forceinline__ void Compute(const Raw& raw, int64_t, int64_t, int64_t c0, float (&f)[8]) const {
    float d[8], a[8];
    Unpack8(raw.d, d);
    Unpack8(raw.a, a);
    if constexpr (!kGated) {
      WithActKind(act, [&](auto kind) {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = ActGradPlain(kind.value, d[k], a[k]);
      });
    } else if (c0 < F) {
      float g[8];
      Unpack8(raw.g, g);
      WithActKind(act, [&](auto kind) {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = ActGradGatedA(kind.value, d[k], a[k], g[k]);
      });
    } else {
      WithActKind(act, [&](auto kind) {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = ActGradGatedG(kind.value, d[k], a[k]);
      });
    }
  }

  __device__ __forceinline__ float Load1(int64_t b, int64_t r, int64_t c) const {
    const T* xr = x + (b * rows + r) * cols;
    const T* dr = dy + (b * rows + r) * F;
    if constexpr (!kGated) return ActGradPlain(act, ToF(dr[c]), ToF(xr[c]));
    if (c < F) return ActGradGatedA(act, ToF(dr[c]), ToF(xr[c]), ToF(xr[F + c]));
    return ActGradGatedG(act, ToF(dr[c - F]), ToF(xr[c - F]));
  }
};

ffi::Error ActBwd(cudaStream_t stream, const ActCall& c) {
  TE_RETURN_IF_ERROR(CheckHighPrecision(c.x, "x"));
  if (c.dy.element_type() != c.x.element_type()) return InvalidArgument("dy and x must have the same dtype");
  const ActKind act = c.act;
  const int64_t F = c.out_cols;
  const int64_t B = c.mb.batch, M = c.mb.rows, N = c.mb.cols;
  const int64_t ws_need = c.dbias ? B * CeilDiv(M, kDbiasRows) * N : 0;
  if (c.workspace_elems < ws_need) {
    return InvalidArgument("workspace: need " + std::to_string(ws_need) + " float32 elements for the dbias partials");
  }
  if (B == 0) return ffi::Error::Success();
  const fused::CastBuffers bufs = fused::BuffersOf(c.out);
  float* ws = c.dbias ? c.workspace : nullptr;
  TE_RETURN_IF_ERROR(DispatchInput(c.x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return DispatchBool(IsGated(act), [&](auto gated) {
      ActBwdProducer<T, decltype(gated)::value> p{static_cast<const T*>(c.dy.untyped_data()),
                                                  static_cast<const T*>(c.x.untyped_data()), M, N, F, act, false};
      p.vec_ok = N % 8 == 0 && F % 8 == 0 && Aligned16(c.x.untyped_data()) && Aligned16(c.dy.untyped_data()) &&
                 fused::AllAligned16({bufs.q, bufs.q_t});
      return fused::RunCast(stream, p, c.sp, bufs, B, M, N, c.scale, c.key, ws);
    });
  }));
  if (ws) TE_RETURN_IF_ERROR(fused::LaunchDbiasReduce(stream, ws, M, N, B, c.dbias));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_ENTRY(ActBwd, cuda::ActBwd);

}  // namespace te_jax
