// CUDA FFI handler te_jax_act_fwd: activation (gelu, relu, silu,
// squared_relu, swiglu, geglu) fused with the output's cast. The activation
// is computed from x inside the cast kernels (norm_act_cast.cuh): one pass
// over x for modes none / fp8_tensor / mxfp8 / fp8_block; fp8_current and
// nvfp4 first run an amax pass (reads x, writes only the amax).
#include "norm_act_cast.cuh"
#include "../common/bindings.h"
#include "../common/norm_act_checks.h"

namespace te_jax {
namespace cuda {
namespace {

// Output (b, r, c) = act(x[b, r, c]), or act(x[b, r, c]) * x[b, r, F + c] (kGated):
// a plain activation's vector is one 16-byte load, so the cast kernels keep
// more of them in flight.
template <typename T, bool kGated>
struct ActFwdProducer {
  const T* x;
  int64_t rows, cols, in_cols;  // cols: F (output), in_cols: x's last axis
  ActKind act = ActKind::kGelu;
  bool vec_ok;

  struct RawPlain {
    Raw8<T> a;
  };
  struct RawGated {
    Raw8<T> a, g;
  };
  using Raw = std::conditional_t<kGated, RawGated, RawPlain>;

  __device__ __forceinline__ Raw Fetch(int64_t b, int64_t r, int64_t c0) const {
    const T* row = x + (b * rows + r) * in_cols;
    Raw raw;
    raw.a = LoadRaw8(row + c0);
    if constexpr (kGated) raw.g = LoadRaw8(row + cols + c0);
    return raw;
  }

  __device__ __forceinline__ void Compute(const Raw& raw, int64_t, int64_t, int64_t, float (&f)[8]) const {
    float a[8];
    Unpack8(raw.a, a);
    if constexpr (kGated) {
      float g[8];
      Unpack8(raw.g, g);
      WithActKind(act, [&](auto kind) {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = ActForwardGated(kind.value, a[k], g[k]);
      });
    } else {
      WithActKind(act, [&](auto kind) {
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = ActValue(kind.value, a[k]);
      });
    }
  }

  __device__ __forceinline__ float Load1(int64_t b, int64_t r, int64_t c) const {
    const T* row = x + (b * rows + r) * in_cols;
    if constexpr (kGated) return ActForwardGated(act, ToF(row[c]), ToF(row[cols + c]));
    return ActValue(act, ToF(row[c]));
  }
};

ffi::Error ActFwd(cudaStream_t stream, const ActCall& c) {
  const MatrixBatch in = c.mb;
  const ActKind act = c.act;
  const int64_t F = c.out_cols;
  if (in.batch == 0) return ffi::Error::Success();
  const fused::CastBuffers bufs = fused::BuffersOf(c.out);
  return DispatchInput(c.x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    return DispatchBool(IsGated(act), [&](auto gated) {
      ActFwdProducer<T, decltype(gated)::value> p{static_cast<const T*>(c.x.untyped_data()), in.rows, F, in.cols, act,
                                                  false};
      p.vec_ok = in.cols % 8 == 0 && F % 8 == 0 && Aligned16(c.x.untyped_data()) &&
                 fused::AllAligned16({bufs.q, bufs.q_t});
      return fused::RunCast(stream, p, c.sp, bufs, in.batch, in.rows, F, c.scale, c.key, nullptr);
    });
  });
}

}  // namespace
}  // namespace cuda

TE_JAX_CUDA_ENTRY(ActFwd, cuda::ActFwd);

}  // namespace te_jax
