// CUTLASS Hopper block-scaled grouped GEMM schedules, each run through te_jax's
// grouped kernel (csrc/cuda/grouped_gemm_sm90.cuh) with only the schedule changed.
// Every schedule_*.cu registers one schedule; main.cu times those that compiled.
#pragma once

#include <type_traits>
#include <vector>

#include "cuda/grouped_gemm_sm90.cuh"

namespace block_schedules {

using namespace cute;  // NOLINT: CUTLASS's shape vocabulary
namespace grouped = te_jax::grouped;
using Call = grouped::GroupedFp8Call;
using RunFn = ::xla::ffi::Error (*)(const Call&, cudaStream_t);

template <class Tile, class Cluster, bool kPingPong>
struct Schedule {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using KernelSchedule =
      std::conditional_t<kPingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule = std::conditional_t<kPingPong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// forward: 1x128 x 128x128 scales, groups of rows; wgrad: 1x128 x 1x128, groups of the contraction.
template <class S, int kBScaleRows, grouped::GroupAxis kAxis>
::xla::ffi::Error RunBlock(const Call& c, cudaStream_t stream) {
  using K = grouped::sm90::Fp8BlockGroupedKernel<cutlass::float_e4m3_t, cutlass::float_e4m3_t, cutlass::bfloat16_t,
                                                 kBScaleRows, kAxis, S>;
  return grouped::sm90::Run<K>(c, stream);
}

struct Entry {
  const char* name;
  RunFn forward, wgrad;
};
std::vector<Entry>& Registry();

template <class S>
struct Register {
  explicit Register(const char* name) {
    Registry().push_back({name, RunBlock<S, 128, grouped::GroupAxis::kRows>,
                          RunBlock<S, 1, grouped::GroupAxis::kContraction>});
  }
};

}  // namespace block_schedules
