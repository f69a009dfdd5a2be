// The grouped FP8 and bfloat16 GEMMs on sm_90a: CUTLASS's pointer-array
// grouped kernel (TMA, warp-specialized cooperative; FP8 with or without fast
// accumulation, FP8 block-scaled, or bfloat16), fed by a setup kernel that
// computes every group's problem from group_sizes on the device. See
// grouped_gemm.cuh. Included only by the grouped_gemm_sm90_*.cu sources, one
// kernel instantiation each (so a parallel build compiles them side by side),
// built for sm_90a alone.
#pragma once

#include <algorithm>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "cuda_common.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "grouped_gemm.cuh"
#include "grouped_gemm_sm90_setup.cuh"

namespace te_jax {
namespace grouped {
namespace sm90 {

using namespace cute;  // NOLINT: CUTLASS's shape and stride vocabulary (_1, Shape, ...)

// The FP8 kernels' operand layouts: A [m, k] and B [n, k] k-contiguous (16-byte aligned), D [m, n] row-major.
struct Fp8Layouts {
  using LayoutA = cutlass::layout::RowMajor;     // A [m, k], k contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // B [n, k], k contiguous
  using LayoutD = cutlass::layout::RowMajor;     // D [m, n]
  static constexpr int kAlignAB = 16;
};

// The CUTLASS grouped GEMM of one dtype combination and accumulation mode.
template <class ElementA, class ElementB, class ElementD, bool kFastAccum>
struct Fp8GroupedKernel : Fp8Layouts {
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  // Split accumulation keeps a second float32 accumulator per thread (the promotion target): at 256x128
  // that overflows the registers (ptxas spills and serializes the wgmma pipeline), so it takes 128x128.
  using TileShape = std::conditional_t<kFastAccum, Shape<_256, _128, _128>, Shape<_128, _128, _128>>;
  using ClusterShape = Shape<_1, _2, _1>;
  using MainloopSchedule =
      std::conditional_t<kFastAccum, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD,  // no source C
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB, LayoutB*,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Gemm = GroupedGemm<Mainloop, Epilogue>;
  // The setup arrays, carved from the front of the workspace.
  using Arrays = PtrArrays<Gemm>;
  static_assert(is_static<decltype(get<1>(typename Arrays::StrideA{}))>::value &&
                    is_static<decltype(get<1>(typename Arrays::StrideB{}))>::value &&
                    is_static<decltype(get<1>(typename Arrays::StrideD{}))>::value,
                "the grouped operands are contiguous along their last axis");
  __device__ static GroupGeometry Geometry(const GroupedFp8Call& c, int64_t g, int64_t start, int32_t size) {
    return GeometryOf(c, g, start, size);
  }
  __device__ static void SetupScales(const GroupedFp8Call&, int64_t, const GroupGeometry&, Arrays&) {}
  static auto MainloopArguments(const Arrays& a) {
    return typename Mainloop::Arguments{a.a, a.stride_a, a.b, a.stride_b};
  }
};

// The block kernel's schedule: cooperative, the two consumer warpgroups
// sharing a 128x128 tile, in 1x2 clusters. The fastest of CUTLASS's Hopper
// block-scaled schedules measured at the MoE shapes (ping-pong with 64x128
// tiles, other clusters: tools/research/cutlass_block_schedules).
struct BlockCooperative {
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _2, _1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// The CUTLASS grouped GEMM with float32 block scales applied in the mainloop:
// 1x128 blocks of A, kBScaleRows x 128 blocks of B. The grouped kernel derives
// each group's scale layout from its problem shape (compact), so the groups'
// scales must be compact slices: group_axis 0 takes K-major scales (a row's
// K blocks contiguous, a group is whole rows), group_axis 1 K-block-major
// scales [K/128, rows] (a group's span is whole rows of those). Schedule: as
// BlockCooperative (a parameter for tools/research/cutlass_block_schedules).
template <class ElementA, class ElementB, class ElementD, int kBScaleRows, GroupAxis kAxis,
          class Schedule = BlockCooperative>
struct Fp8BlockGroupedKernel : Fp8Layouts {
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;
  static constexpr auto kScaleMajor = kAxis == GroupAxis::kRows ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBScaleRows, 128, kScaleMajor, kScaleMajor>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, typename Schedule::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::KernelSchedule>::CollectiveOp;
  using Gemm = GroupedGemm<Mainloop, Epilogue>;

  struct Arrays : Fp8GroupedKernel<ElementA, ElementB, ElementD, true>::Arrays {
    const float** sfa;
    const float** sfb;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;

    using Base = typename Fp8GroupedKernel<ElementA, ElementB, ElementD, true>::Arrays;
    static size_t Bytes(int64_t g) {
      return Base::Bytes(g) + 2 * RoundUpBytes(g * sizeof(void*)) + RoundUpBytes(g * sizeof(LayoutSFA)) +
             RoundUpBytes(g * sizeof(LayoutSFB));
    }

    static Arrays Carve(void* base, int64_t g) {
      Arrays r;
      static_cast<Base&>(r) = Base::Carve(base, g);
      char* p = static_cast<char*>(base) + Base::Bytes(g);
      auto take = [&p](size_t bytes) {
        void* q = p;
        p += RoundUpBytes(bytes);
        return q;
      };
      r.sfa = static_cast<const float**>(take(g * sizeof(void*)));
      r.sfb = static_cast<const float**>(take(g * sizeof(void*)));
      r.layout_sfa = static_cast<LayoutSFA*>(take(g * sizeof(LayoutSFA)));
      r.layout_sfb = static_cast<LayoutSFB*>(take(g * sizeof(LayoutSFB)));
      return r;
    }
  };

  __device__ static GroupGeometry Geometry(const GroupedFp8Call& c, int64_t g, int64_t start, int32_t size) {
    return GeometryOf(c, g, start, size);
  }

  // Fills the block mode's arrays of group g (the scale pointers and layouts).
  __device__ static void SetupScales(const GroupedFp8Call& c, int64_t g, const GroupGeometry& geo, Arrays& arrays) {
    arrays.sfa[g] = c.a_s + geo.sfa_offset;
    arrays.sfb[g] = c.b_s + geo.sfb_offset;
    const int32_t k_blocks = (geo.k + 127) / 128, ld = static_cast<int32_t>(geo.ld_sf);
    const int32_t n_blocks = (geo.n + kBScaleRows - 1) / kBScaleRows;
    if constexpr (kAxis == GroupAxis::kRows) {
      arrays.layout_sfa[g] = LayoutSFA(make_shape(make_shape(Int<1>{}, geo.m), make_shape(Int<128>{}, k_blocks), 1),
                                       make_stride(make_stride(_0{}, ld), make_stride(_0{}, _1{}), 0));
      arrays.layout_sfb[g] = LayoutSFB(
          make_shape(make_shape(Int<kBScaleRows>{}, n_blocks), make_shape(Int<128>{}, k_blocks), 1),
          make_stride(make_stride(_0{}, ld), make_stride(_0{}, _1{}), 0));
    } else {  // K-block-major: one row of m (n) scales per K block
      arrays.layout_sfa[g] = LayoutSFA(make_shape(make_shape(Int<1>{}, geo.m), make_shape(Int<128>{}, k_blocks), 1),
                                       make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, geo.m), 0));
      arrays.layout_sfb[g] = LayoutSFB(
          make_shape(make_shape(Int<kBScaleRows>{}, n_blocks), make_shape(Int<128>{}, k_blocks), 1),
          make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, n_blocks), 0));
    }
  }

  static auto MainloopArguments(const Arrays& a) {
    return typename Mainloop::Arguments{a.a, a.stride_a, a.b, a.stride_b, a.sfa, a.layout_sfa, a.sfb, a.layout_sfb};
  }
};

// The CUTLASS grouped bfloat16 GEMM of one layout (Bf16Layout): bfloat16 A
// and B, float32 accumulation, bfloat16 D, alpha 1 (the alpha array is
// filled with ones). kForward: A K-major, B N-major; kDgrad: A and B K-major
// (as the FP8 kernels); kWgrad: A M-major, B N-major. 128x256x64 tiles (each
// of the two consumer warpgroups holds a 64x256 float32 accumulator, 128
// registers per thread) in 1x2 clusters. (Element is a parameter, always
// bfloat16, so that the CUTLASS builders stay dependent: GCC, as nvcc's host
// compiler, rejects the epilogue builder evaluated at the template's definition.)
template <Bf16Layout kLayout, class Element>
struct Bf16GroupedKernel {
  using ElementA = Element;
  using ElementB = Element;
  using ElementD = Element;
  // CUTLASS's views: A (m, k), B (n, k). RowMajor A: k contiguous; ColumnMajor A: m contiguous.
  // RowMajor B: n contiguous; ColumnMajor B: k contiguous.
  using LayoutA = std::conditional_t<kLayout == Bf16Layout::kWgrad, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<kLayout == Bf16Layout::kDgrad, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 8;  // 16 bytes of bfloat16 (TMA)
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, _2, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlign,  // no source C
      ElementD, LayoutD*, kAlign, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlign, ElementB, LayoutB*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Gemm = GroupedGemm<Mainloop, Epilogue>;
  using Arrays = PtrArrays<Gemm>;
  static_assert(std::is_same_v<typename Arrays::StrideA,
                               std::conditional_t<kLayout == Bf16Layout::kWgrad, Stride<_1, int64_t, _0>,
                                                  Stride<int64_t, _1, _0>>>,
                "A: (m, k) strides (1, lda) for kWgrad, (lda, 1) otherwise");
  static_assert(std::is_same_v<typename Arrays::StrideB,
                               std::conditional_t<kLayout == Bf16Layout::kDgrad, Stride<int64_t, _1, _0>,
                                                  Stride<_1, int64_t, _0>>>,
                "B: (n, k) strides (ldb, 1) for kDgrad, (1, ldb) otherwise");

  __device__ static GroupGeometry Geometry(const GroupedFp8Call& c, int64_t g, int64_t start, int32_t size) {
    return Bf16GeometryOf<kLayout>(c, g, start, size);
  }
  __device__ static void SetupScales(const GroupedFp8Call&, int64_t, const GroupGeometry&, Arrays&) {}
  static auto MainloopArguments(const Arrays& a) {
    return typename Mainloop::Arguments{a.a, a.stride_a, a.b, a.stride_b};
  }
};

// A stride (x, y, batch) with exactly one of x, y dynamic: that one set to `ld`
// (the leading dimension), the static unit stride and batch stride as they are.
template <class Stride3>
__device__ inline Stride3 LeadingStride(int64_t ld) {
  constexpr bool kFirst = !is_static<decltype(get<0>(Stride3{}))>::value;
  constexpr bool kSecond = !is_static<decltype(get<1>(Stride3{}))>::value;
  static_assert(kFirst != kSecond && is_static<decltype(get<2>(Stride3{}))>::value,
                "a grouped operand has one contiguous axis and one leading dimension");
  Stride3 s{};
  if constexpr (kFirst) {
    get<0>(s) = ld;
  } else {
    get<1>(s) = ld;
  }
  return s;
}

// One block: each thread takes groups g, g + blockDim, ... and sums the sizes
// (or aligned spans) of the groups before it (G is at most a few thousand).
template <class K>
__global__ void __launch_bounds__(kSetupThreads) SetupKernel(GroupedFp8Call c, typename K::Arrays arrays) {
  using Arrays = typename K::Arrays;
  using ElementA = typename K::Gemm::ElementA;
  using ElementB = typename K::Gemm::ElementB;
  using ElementD = typename K::Gemm::ElementD;
  for (int64_t g = threadIdx.x; g < c.groups; g += blockDim.x) {
    int64_t start = 0;
    for (int64_t h = 0; h < g; ++h) {
      const int64_t s = max(c.group_sizes[h], 0);
      start += c.axis == GroupAxis::kRows ? s : (s + c.align - 1) / c.align * c.align;
    }
    const GroupGeometry geo = K::Geometry(c, g, start, c.group_sizes[g]);
    arrays.problems[g] = typename Arrays::Shape3(geo.m, geo.n, geo.k);
    arrays.a[g] = static_cast<const ElementA*>(c.a) + geo.a_offset;
    arrays.b[g] = static_cast<const ElementB*>(c.b) + geo.b_offset;
    arrays.d[g] = static_cast<ElementD*>(c.out) + geo.d_offset;
    // Each stride is (leading dimension, 1, 0) or (1, leading dimension, 0): only the leading dimension is dynamic.
    arrays.stride_a[g] = LeadingStride<typename Arrays::StrideA>(geo.lda);
    arrays.stride_b[g] = LeadingStride<typename Arrays::StrideB>(geo.ldb);
    arrays.stride_d[g] = LeadingStride<typename Arrays::StrideD>(geo.ldd);
    arrays.alpha[g] = geo.alpha;
    K::SetupScales(c, g, geo, arrays);
  }
}

inline int SmCount(int device) {
  static std::mutex mu;
  static std::unordered_map<int, int> counts;
  std::lock_guard<std::mutex> lock(mu);
  auto it = counts.find(device);
  if (it == counts.end()) {
    it = counts.emplace(device, cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device)).first;
  }
  return it->second;
}

inline ffi::Error CutlassError(const GroupedFp8Call& c, cutlass::Status s, const char* what) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(c.target) + ": CUTLASS " + what + " failed: " + cutlassGetStatusString(s));
}

template <class K>
ffi::Error Run(const GroupedFp8Call& c, cudaStream_t stream) {
  using Gemm = typename K::Gemm;
  const size_t setup_bytes = K::Arrays::Bytes(c.groups);
  auto arrays = K::Arrays::Carve(c.workspace, c.groups);
  SetupKernel<K><<<1, kSetupThreads, 0, stream>>>(c, arrays);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string(c.target) + ": the setup kernel failed: " + cudaGetErrorString(e));
  }

  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 0.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = arrays.alpha;
  fusion.dAlpha = {_0{}, _0{}, 1};  // one alpha per group, read on the device
  cutlass::KernelHardwareInfo hw;
  hw.device_id = c.device;
  hw.sm_count = SmCount(c.device);
  args = typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(c.groups), arrays.problems, nullptr},  // problem shapes on the device only
      K::MainloopArguments(arrays),
      {fusion, nullptr, nullptr, arrays.d, arrays.stride_d},
      hw};

  const size_t cutlass_bytes = Gemm::get_workspace_size(args);
  if (setup_bytes + cutlass_bytes > c.workspace_bytes) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(c.target) + ": the workspace has " + std::to_string(c.workspace_bytes) +
                          " bytes, the grouped GEMM needs " + std::to_string(setup_bytes + cutlass_bytes) +
                          " (size it with grouped_workspace_bytes)");
  }
  if (cutlass::Status s = Gemm::can_implement(args); s != cutlass::Status::kSuccess) {
    return CutlassError(c, s, "can_implement");
  }
  Gemm gemm;
  void* cutlass_workspace = static_cast<char*>(c.workspace) + setup_bytes;
  {
    // initialize() sets the kernel's shared-memory attribute (host work that
    // stream capture, i.e. a command buffer, would otherwise refuse).
    cuda::RelaxedCapture relaxed;
    if (cutlass::Status s = gemm.initialize(args, cutlass_workspace, stream); s != cutlass::Status::kSuccess) {
      return CutlassError(c, s, "initialize");
    }
  }
  if (cutlass::Status s = gemm.run(stream); s != cutlass::Status::kSuccess) {
    return CutlassError(c, s, "run");
  }
  return ffi::Error::Success();
}

// The CUTLASS element types of the kinds (grouped_gemm.cuh).
template <Fp8Kind k>
using Fp8Element = std::conditional_t<k == Fp8Kind::kE4M3, cutlass::float_e4m3_t, cutlass::float_e5m2_t>;
template <OutKind k>
using OutElement = std::conditional_t<k == OutKind::kF32, float,
                                      std::conditional_t<k == OutKind::kBf16, cutlass::bfloat16_t, cutlass::half_t>>;

}  // namespace sm90

template <Fp8Kind kA, Fp8Kind kB, OutKind kOut, bool kFastAccum>
ffi::Error RunGroupedFp8(const GroupedFp8Call& c, cudaStream_t stream) {
  using K = sm90::Fp8GroupedKernel<sm90::Fp8Element<kA>, sm90::Fp8Element<kB>, sm90::OutElement<kOut>, kFastAccum>;
  return sm90::Run<K>(c, stream);
}

template <Fp8Kind kA, Fp8Kind kB, OutKind kOut, int kBScaleRows, GroupAxis kAxis>
ffi::Error RunGroupedFp8Block(const GroupedFp8Call& c, cudaStream_t stream) {
  using K = sm90::Fp8BlockGroupedKernel<sm90::Fp8Element<kA>, sm90::Fp8Element<kB>, sm90::OutElement<kOut>,
                                        kBScaleRows, kAxis>;
  return sm90::Run<K>(c, stream);
}

template <Bf16Layout kLayout>
ffi::Error RunGroupedBf16(const GroupedFp8Call& c, cudaStream_t stream) {
  return sm90::Run<sm90::Bf16GroupedKernel<kLayout, cutlass::bfloat16_t>>(c, stream);
}

// Instantiates RunGroupedFp8 for one entry of TE_JAX_GROUPED_FP8_KERNELS.
#define TE_JAX_INSTANTIATE_GROUPED_FP8(ka, kb, ko, fast) \
  template ffi::Error RunGroupedFp8<Fp8Kind::ka, Fp8Kind::kb, OutKind::ko, fast>(const GroupedFp8Call&, cudaStream_t);

// Instantiates RunGroupedFp8Block for one entry of TE_JAX_GROUPED_FP8_BLOCK_KERNELS.
#define TE_JAX_INSTANTIATE_GROUPED_FP8_BLOCK(ka, kb, ko, rows, axis)                                       \
  template ffi::Error RunGroupedFp8Block<Fp8Kind::ka, Fp8Kind::kb, OutKind::ko, rows, axis>(const GroupedFp8Call&, \
                                                                                           cudaStream_t);

// Instantiates RunGroupedBf16 for one entry of TE_JAX_GROUPED_BF16_KERNELS.
#define TE_JAX_INSTANTIATE_GROUPED_BF16(layout) \
  template ffi::Error RunGroupedBf16<Bf16Layout::layout>(const GroupedFp8Call&, cudaStream_t);

}  // namespace grouped
}  // namespace te_jax
