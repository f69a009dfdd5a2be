// The setup side of the sm_90a grouped GEMMs (grouped_gemm_sm90.cuh): each
// group's problem (GroupGeometry, computed from group_sizes on the device by
// GeometryOf / Bf16GeometryOf), the grouped problem shape and GEMM type, and
// the setup arrays (PtrArrays) the setup kernel fills in the front of the
// workspace. Included only by grouped_gemm_sm90.cuh.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped_gemm.cuh"

namespace te_jax {
namespace grouped {
namespace sm90 {

using namespace cute;  // NOLINT: CUTLASS's shape and stride vocabulary (_1, Shape, ...)

constexpr int kSetupThreads = 256;
constexpr size_t kSectionAlign = 256;

inline size_t RoundUpBytes(size_t n) { return (n + kSectionAlign - 1) / kSectionAlign * kSectionAlign; }

// One group's GEMM in the row-major A [m, k] x B [n, k]^T -> D [m, n] form,
// offsets in elements of each operand. m == 0 means no GEMM for the group.
struct GroupGeometry {
  int m, n, k;
  int64_t a_offset, b_offset, d_offset;
  int64_t lda, ldb, ldd;
  float alpha;
  int64_t sfa_offset, sfb_offset, ld_sf;  // block mode: in scales; ld_sf in K blocks
};

// The operands of group g of a row-grouped GEMM (group_axis 0) whose rows start at `off`: rows [off, off + m) of
// A [M, K] and D [M, N] (m = size, cut at M), B[g] [N, K]; every operand K- (D N-) contiguous.
__device__ inline void RowGroupGeometry(const GroupedFp8Call& c, int64_t g, int64_t off, int32_t size,
                                        GroupGeometry& geo) {
  geo.m = static_cast<int>(min(static_cast<int64_t>(max(size, 0)), c.m - off));
  geo.n = static_cast<int>(c.n);
  geo.k = static_cast<int>(c.k);
  geo.a_offset = off * c.k;
  geo.b_offset = g * c.n * c.k;
  geo.d_offset = off * c.n;
  geo.lda = c.k;
  geo.ldb = c.k;
  geo.ldd = c.n;
}

__device__ inline GroupGeometry GeometryOf(const GroupedFp8Call& c, int64_t g, int64_t start, int32_t size) {
  GroupGeometry geo{};
  const bool block = c.a_s != nullptr;
  geo.alpha = block ? 1.0f : c.a_scale_inv[c.a_scale_per_group ? g : 0] * c.b_scale_inv[c.b_scale_per_group ? g : 0];
  if (c.axis == GroupAxis::kRows) {
    // start: the sum of the earlier groups' sizes; groups past M are cut.
    const int64_t off = min(start, c.m);
    RowGroupGeometry(c, g, off, size, geo);
    geo.sfa_offset = off * (c.k / 128);
    geo.sfb_offset = g * (c.n / max(c.b_scale_rows, 1)) * (c.k / 128);
    geo.ld_sf = c.k / 128;
  } else {
    // start: the sum of the earlier groups' aligned spans. The group contracts
    // over its whole span (the contract), rounded up to the 16 columns TMA
    // needs (whole 128-column scale blocks in the block mode).
    const int64_t off = min(start, c.k);
    const int64_t round = block ? 128 : 16;
    const int64_t span = (static_cast<int64_t>(max(size, 0)) + c.align - 1) / c.align * c.align;
    const int64_t k16 = (span + round - 1) / round * round;
    const int64_t kg = min(k16, c.k - off);
    geo.m = kg > 0 ? static_cast<int>(c.m) : 0;
    geo.n = static_cast<int>(c.n);
    geo.k = kg > 0 ? static_cast<int>(kg) : 16;
    geo.a_offset = off;
    geo.b_offset = off;
    geo.d_offset = g * c.m * c.n;
    geo.lda = c.k;
    geo.ldb = c.k;
    geo.ldd = c.n;
    geo.sfa_offset = off / 128 * c.m;  // K-block-major scales [K/128, m], [K/128, n]
    geo.sfb_offset = off / 128 * c.n;
    geo.k = block && kg <= 0 ? 128 : geo.k;
  }
  return geo;
}

// One group's GEMM of the bfloat16 call of layout kLayout (grouped_gemm.cuh),
// in CUTLASS's (m, n, k) terms with each operand's leading dimension (the
// stride of its non-contiguous axis). kForward and kDgrad: A [M, K] K-major, B
// N-major (kForward: [G, K, N]) or K-major ([G, N, K]), D [M, N]; group g's
// rows start at `start` (cut at M). kWgrad: m = P, n = Q and the group's rows
// are the contraction: A M-major (row r of the group at (off + r) * P), B
// N-major (at (off + r) * Q), D = out[g] [P, Q]; rows past R are cut.
template <Bf16Layout kLayout>
__device__ inline GroupGeometry Bf16GeometryOf(const GroupedFp8Call& c, int64_t g, int64_t start, int32_t size) {
  GroupGeometry geo{};
  geo.alpha = 1.0f;
  if constexpr (kLayout == Bf16Layout::kWgrad) {
    const int64_t off = min(start, c.k);
    const int64_t rows = min(static_cast<int64_t>(max(size, 0)), c.k - off);
    geo.m = rows > 0 ? static_cast<int>(c.m) : 0;  // m 0: no tiles (the handler zeroes out[g])
    geo.n = static_cast<int>(c.n);
    geo.k = rows > 0 ? static_cast<int>(rows) : 8;
    geo.a_offset = off * c.m;
    geo.b_offset = off * c.n;
    geo.d_offset = g * c.m * c.n;
    geo.lda = c.m;
    geo.ldb = c.n;
    geo.ldd = c.n;
  } else {
    RowGroupGeometry(c, g, min(start, c.m), size, geo);
    geo.ldb = kLayout == Bf16Layout::kForward ? c.n : c.k;
  }
  return geo;
}

using GroupedProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

// CUTLASS's grouped GEMM (device adapter) of a mainloop and an epilogue.
template <class Mainloop, class Epilogue>
using GroupedGemm = cutlass::gemm::device::GemmUniversalAdapter<
    cutlass::gemm::kernel::GemmUniversal<GroupedProblemShape, Mainloop, Epilogue>>;

// The setup arrays of one grouped GEMM (problem shapes, operand pointers,
// strides, alphas), carved from the front of the workspace; its element,
// stride and problem types are those of the GroupedGemm.
template <class Gemm>
struct PtrArrays {
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementD = typename Gemm::ElementD;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;
  using Shape3 = typename GroupedProblemShape::UnderlyingProblemShape;

  Shape3* problems;
  const ElementA** a;
  const ElementB** b;
  ElementD** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  float* alpha;

  static size_t Bytes(int64_t g) {
    return RoundUpBytes(g * sizeof(Shape3)) + 3 * RoundUpBytes(g * sizeof(void*)) +
           RoundUpBytes(g * sizeof(StrideA)) + RoundUpBytes(g * sizeof(StrideB)) +
           RoundUpBytes(g * sizeof(StrideD)) + RoundUpBytes(g * sizeof(float));
  }

  static PtrArrays Carve(void* base, int64_t g) {
    auto* p = static_cast<char*>(base);
    auto take = [&p](size_t bytes) {
      void* q = p;
      p += RoundUpBytes(bytes);
      return q;
    };
    PtrArrays r;
    r.problems = static_cast<Shape3*>(take(g * sizeof(Shape3)));
    r.a = static_cast<const ElementA**>(take(g * sizeof(void*)));
    r.b = static_cast<const ElementB**>(take(g * sizeof(void*)));
    r.d = static_cast<ElementD**>(take(g * sizeof(void*)));
    r.stride_a = static_cast<StrideA*>(take(g * sizeof(StrideA)));
    r.stride_b = static_cast<StrideB*>(take(g * sizeof(StrideB)));
    r.stride_d = static_cast<StrideD*>(take(g * sizeof(StrideD)));
    r.alpha = static_cast<float*>(take(g * sizeof(float)));
    return r;
  }
};

}  // namespace sm90
}  // namespace grouped
}  // namespace te_jax
