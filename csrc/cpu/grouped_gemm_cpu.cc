// CPU FFI handlers for the grouped GEMM custom calls (te_jax/ops/grouped_gemm.py).
//
// group_axis 0 (forward, dgrad): A [M, K] with rows sorted by group, B [G, N, K];
// out [M, N] holds A_g @ B_g^T in group g's rows and zeros in the rows past
// sum(group_sizes). group_axis 1 (wgrad): A [P, Kc] and B [Q, Kc] grouped along
// the contraction in spans aligned to `align`; out [G, P, Q], out[g] = A_span @ B_span^T over the whole
// span (its padding columns included: zero, or a Hadamard transform's values of zero padding).
// Groups reaching past M (past Kc) are cut there. Each handler dequantizes A and
// B with the dense handlers' helpers (gemm_cpu.h), a per-tensor value taken per
// group when there is one per group, multiplies each group in float32, adds
// the bias in float32 and casts. `fast_accum` is ignored; the workspace is untouched.
//
// te_jax_grouped_gemm_bf16 takes bfloat16 operands in their natural layouts
// (group_axis 0: B [G, K, N] with b_kn, else [G, N, K]; group_axis 1: A
// [R, P] and B [R, Q] with the groups' rows stacked, unpadded, out[g] =
// A_g^T @ B_g) and brings them to the layouts above (transposes in float32)
// before the same per-group product.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/bindings.h"
#include "../common/ffi_common.h"
#include "cpu_common.h"
#include "gemm_cpu.h"

namespace te_jax {
namespace {

using namespace gemm_cpu;  // NOLINT: the dense GEMM's checks, dequantization and product

// The groups of one call: sizes[g] and the first row (group_axis 0) or column (1) of each.
struct Groups {
  int64_t axis = 0, count = 0;
  std::vector<int64_t> begin, end;  // [begin[g], end[g]) cut to the grouped extent
  std::vector<int64_t> of;          // the group of each row (axis 0) / column (axis 1); 0 outside every group
};

struct GroupedShape {
  Groups groups;
  int64_t a_rows, b_rows, k;  // axis 0: M, G*N, K; axis 1: P, Q, Kc
  int64_t n;                  // axis 0: N (rows of each B matrix); axis 1: Q
};

// Reads group_sizes and lays the groups out over `extent` rows or columns.
ffi::ErrorOr<Groups> GroupsOf(std::string_view target, const ffi::AnyBuffer& sizes, int64_t axis, int64_t align,
                              int64_t extent) {
  if (sizes.element_type() != ffi::DataType::S32 || sizes.dimensions().size() != 1) {
    return ffi::Unexpected(Fail(target, "group_sizes must be int32 [G], got " + DimsToString(sizes.dimensions())));
  }
  if (axis != 0 && axis != 1) return ffi::Unexpected(Fail(target, "group_axis must be 0 or 1"));
  if (align < 1) return ffi::Unexpected(Fail(target, "align must be >= 1"));
  Groups g;
  g.axis = axis;
  g.count = static_cast<int64_t>(sizes.element_count());
  g.of.assign(static_cast<size_t>(extent), 0);
  const auto* m = static_cast<const int32_t*>(sizes.untyped_data());
  int64_t start = 0;
  for (int64_t i = 0; i < g.count; ++i) {
    const int64_t size = std::max<int64_t>(m[i], 0);
    const int64_t extent_of_group = axis == 0 ? size : (size + align - 1) / align * align;
    const int64_t lo = std::min(start, extent), hi = std::min(start + extent_of_group, extent);
    g.begin.push_back(lo);
    g.end.push_back(hi);
    for (int64_t r = lo; r < hi; ++r) g.of[r] = i;
    start += extent_of_group;
  }
  return g;
}

// out must be `want_out`; the bias [G, N] of the out dtype or float32 with has_bias, else [0].
ffi::Error CheckOutAndBias(std::string_view target, const ffi::AnyBuffer& out, const ffi::AnyBuffer& bias,
                           const std::vector<int64_t>& want_out, int64_t g, int64_t n, bool has_bias) {
  auto od = out.dimensions();
  if (!std::equal(want_out.begin(), want_out.end(), od.begin(), od.end())) {
    return Fail(target, "out must be " + DimsToString(want_out) + ", got " + DimsToString(od));
  }
  const std::vector<int64_t> want_bias = has_bias ? std::vector<int64_t>{g, n} : std::vector<int64_t>{0};
  auto bias_d = bias.dimensions();
  if (!std::equal(want_bias.begin(), want_bias.end(), bias_d.begin(), bias_d.end())) {
    return Fail(target, "bias must be " + DimsToString(want_bias) + " (has_bias=" + (has_bias ? "true" : "false") +
                            "), got " + DimsToString(bias_d));
  }
  if (has_bias && bias.element_type() != out.element_type() && bias.element_type() != ffi::DataType::F32) {
    return Fail(target, "bias must have the output's dtype or float32");
  }
  return ffi::Error::Success();
}

// Operand shapes, out and bias of either layout; `pack` K elements per stored column (NVFP4: 2).
// Completes `s` (groups and K set) with A's rows `a_rows` (M; group_axis 1: P), the rows `n` of each B
// matrix (N; group_axis 1: Q) and B's matrix count (checked against the groups for group_axis 0), then checks
// the bias (group_axis 0 only), out's dtype and out's and the bias's shapes.
ffi::ErrorOr<GroupedShape> WithMatrices(std::string_view target, GroupedShape s, int64_t axis, int64_t a_rows,
                                        int64_t n, int64_t b_matrices, const ffi::AnyBuffer& out,
                                        const ffi::AnyBuffer& bias, bool has_bias) {
  const int64_t g = s.groups.count;
  if (axis == 0 && b_matrices != g) {
    return ffi::Unexpected(Fail(target, "B has " + std::to_string(b_matrices) + " matrices but group_sizes has " +
                                            std::to_string(g) + " groups"));
  }
  if (axis == 1 && has_bias) return ffi::Unexpected(Fail(target, "a bias applies to group_axis 0 only"));
  s.a_rows = a_rows;
  s.n = n;
  s.b_rows = axis == 0 ? g * n : n;
  if (!IsHighPrecision(out.element_type())) {
    return ffi::Unexpected(Fail(target, "out must be float32, bfloat16 or float16"));
  }
  const std::vector<int64_t> want_out =
      axis == 0 ? std::vector<int64_t>{a_rows, n} : std::vector<int64_t>{g, a_rows, n};
  TE_RETURN_IF_ERROR_OR(CheckOutAndBias(target, out, bias, want_out, g, n, has_bias));
  return s;
}

ffi::ErrorOr<GroupedShape> ShapeOf(std::string_view target, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                   const ffi::AnyBuffer& sizes, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& out,
                                   int64_t pack, int64_t axis, int64_t align, bool has_bias) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  const size_t b_rank = axis == 0 ? 3 : 2;
  if (ad.size() != 2 || bd.size() != b_rank || ad.back() != bd.back()) {
    return ffi::Unexpected(Fail(target, std::string(axis == 0 ? "group_axis 0 needs A [M, K] and B [G, N, K]"
                                                              : "group_axis 1 needs A [P, Kc] and B [Q, Kc]") +
                                            " with one contraction axis; got A " + DimsToString(ad) + " and B " +
                                            DimsToString(bd)));
  }
  GroupedShape s;
  s.k = ad.back() * pack;
  auto groups = GroupsOf(target, sizes, axis, align, axis == 0 ? ad[0] : s.k);
  if (groups.has_error()) return ffi::Unexpected(groups.error());
  s.groups = groups.value();
  return WithMatrices(target, s, axis, ad[0], axis == 0 ? bd[1] : bd[0], bd[0], out, bias, has_bias);
}

// A per-tensor value (scale_inv, NVFP4 amax): float32 [1], or [G] with one value per group.
ffi::Error CheckGroupScale(std::string_view target, const ffi::AnyBuffer& s, std::string_view name, int64_t groups) {
  TE_RETURN_IF_ERROR(CheckDtype(target, s, ffi::DataType::F32, name, "float32"));
  const int64_t got = static_cast<int64_t>(s.element_count());
  if (s.dimensions().size() != 1 || (got != 1 && got != groups)) {
    return Fail(target, std::string(name) + " must be float32 [1] or one value per group [" +
                            std::to_string(groups) + "], got " + DimsToString(s.dimensions()));
  }
  return ffi::Error::Success();
}

// The group whose per-tensor value applies to element (r, c) of A (`is_b` false) or B.
int64_t GroupAt(const GroupedShape& s, bool is_b, int64_t r, int64_t c) {
  if (s.groups.axis == 1) return s.groups.of[c];
  return is_b ? r / s.n : s.groups.of[r];
}

float GroupValue(const ffi::AnyBuffer& v, int64_t group) {
  const auto* p = static_cast<const float*>(v.untyped_data());
  return v.element_count() == 1 ? p[0] : p[group];
}

// Each group's product of the dequantized operands, the bias, cast into `out`.
void Multiply(const GroupedShape& s, const std::vector<float>& a, const std::vector<float>& b,
              const ffi::AnyBuffer& bias, ffi::AnyBuffer out) {
  const Groups& gs = s.groups;
  const int64_t k = s.k, n = s.n;
  std::vector<float> c(static_cast<size_t>(out.element_count()), 0.0f);
  const std::vector<float> bias_f = bias.element_count() ? ToFloat(bias) : std::vector<float>();
  for (int64_t g = 0; g < gs.count; ++g) {
    const int64_t lo = gs.begin[g], width = gs.end[g] - gs.begin[g];
    if (width <= 0) continue;
    if (gs.axis == 0) {
      float* rows = c.data() + lo * n;
      MatMulNT(a.data() + lo * k, b.data() + g * n * k, width, n, k, rows);
      if (!bias_f.empty()) {
        for (int64_t i = 0; i < width * n; ++i) rows[i] += bias_f[g * n + i % n];
      }
    } else {  // the span's columns of A and B, side by side, then one product
      std::vector<float> sa(static_cast<size_t>(s.a_rows * width)), sb(static_cast<size_t>(n * width));
      for (int64_t r = 0; r < s.a_rows; ++r) std::copy_n(a.data() + r * k + lo, width, sa.data() + r * width);
      for (int64_t r = 0; r < n; ++r) std::copy_n(b.data() + r * k + lo, width, sb.data() + r * width);
      MatMulNT(sa.data(), sb.data(), s.a_rows, n, width, c.data() + g * s.a_rows * n);
    }
  }
  StoreFloat(c, out);
}

// The block size of a block-scaled mode must divide the spans of group_axis 1.
ffi::Error CheckAlign(std::string_view target, int64_t axis, int64_t align, int64_t block) {
  if (axis == 1 && align % block) {
    return Fail(target, "group_axis 1 needs align (" + std::to_string(align) + ") to be a multiple of the block size " +
                            std::to_string(block) + ": a block must not straddle two groups");
  }
  return ffi::Error::Success();
}

// The block scales a_s and b_s: dtype `t` and [rows / row_block, K / block] for A and each matrix of B.
ffi::Error CheckScales(std::string_view target, const GroupedShape& s, const ffi::AnyBuffer& a,
                       const ffi::AnyBuffer& a_s, const ffi::AnyBuffer& b, const ffi::AnyBuffer& b_s, ffi::DataType t,
                       std::string_view want, int64_t block, int64_t a_rows = 1, int64_t b_rows = 1) {
  TE_RETURN_IF_ERROR(CheckDtype(target, a_s, t, "a_s", want));
  TE_RETURN_IF_ERROR(CheckDtype(target, b_s, t, "b_s", want));
  TE_RETURN_IF_ERROR(CheckBlockScales(target, a_s, "a_s", a, s.k, a_rows, block));
  return CheckBlockScales(target, b_s, "b_s", b, s.k, b_rows, block);
}

// The Float8 block scales of group_axis 1: float32 [k_blocks, row_blocks] (one row per K block).
ffi::Error CheckKBlockMajorScales(std::string_view target, const ffi::AnyBuffer& x_s, std::string_view name,
                                  int64_t k_blocks, int64_t row_blocks) {
  TE_RETURN_IF_ERROR(CheckDtype(target, x_s, ffi::DataType::F32, name, "float32"));
  const auto d = x_s.dimensions();
  if (d.size() != 2 || d[0] != k_blocks || d[1] != row_blocks) {
    return Fail(target, std::string(name) + " of group_axis 1 must be K-block-major [" + std::to_string(k_blocks) +
                            ", " + std::to_string(row_blocks) + "] (one row per 128 columns of Kc)");
  }
  return ffi::Error::Success();
}

ffi::Error GroupedGemmFp8(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                          ffi::AnyBuffer group_sizes, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> workspace, int64_t group_axis, int64_t align, bool has_bias,
                          bool fast_accum) {
  constexpr std::string_view kTarget = "te_jax_grouped_gemm_fp8";
  Fp8Format fa = kE4M3, fb = kE4M3;
  TE_RETURN_IF_ERROR(Fp8Pair(kTarget, a, b, &fa, &fb));
  auto s_or = ShapeOf(kTarget, a, b, group_sizes, bias, *out, 1, group_axis, align, has_bias);
  if (s_or.has_error()) return s_or.error();
  const GroupedShape& s = s_or.value();
  TE_RETURN_IF_ERROR(CheckGroupScale(kTarget, a_scale_inv, "a_scale_inv", s.groups.count));
  TE_RETURN_IF_ERROR(CheckGroupScale(kTarget, b_scale_inv, "b_scale_inv", s.groups.count));
  const auto* ad = static_cast<const uint8_t*>(a.untyped_data());
  const auto* bd = static_cast<const uint8_t*>(b.untyped_data());
  const auto av = Dequantize(s.a_rows, s.k, [&](int64_t r, int64_t c) {
    return Fp8ToFloat(ad[r * s.k + c], fa) * GroupValue(a_scale_inv, GroupAt(s, false, r, c));
  });
  const auto bv = Dequantize(s.b_rows, s.k, [&](int64_t r, int64_t c) {
    return Fp8ToFloat(bd[r * s.k + c], fb) * GroupValue(b_scale_inv, GroupAt(s, true, r, c));
  });
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

ffi::Error GroupedGemmFp8Block(ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b, ffi::AnyBuffer b_s,
                               ffi::AnyBuffer group_sizes, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, int64_t group_axis, int64_t align,
                               bool has_bias, bool a_block_2d, bool b_block_2d) {
  constexpr std::string_view kTarget = "te_jax_grouped_gemm_fp8_block";
  Fp8Format fa = kE4M3, fb = kE4M3;
  TE_RETURN_IF_ERROR(Fp8Pair(kTarget, a, b, &fa, &fb));
  if (a_block_2d && b_block_2d) {
    return Fail(kTarget, "128x128 x 128x128 block scaling is not supported; quantize one operand with 1x128 blocks");
  }
  TE_RETURN_IF_ERROR(CheckAlign(kTarget, group_axis, align, kFp8Block));
  auto s_or = ShapeOf(kTarget, a, b, group_sizes, bias, *out, 1, group_axis, align, has_bias);
  if (s_or.has_error()) return s_or.error();
  const GroupedShape& s = s_or.value();
  const int64_t ra = a_block_2d ? kFp8Block : 1, rb = b_block_2d ? kFp8Block : 1;
  const auto* as = static_cast<const float*>(a_s.untyped_data());
  const auto* bs = static_cast<const float*>(b_s.untyped_data());
  if (group_axis == 1) {  // K-block-major scales [Kc/128, rows/row_block]: read transposed
    TE_RETURN_IF_ERROR(CheckKBlockMajorScales(kTarget, a_s, "a_s", s.k / kFp8Block, s.a_rows / ra));
    TE_RETURN_IF_ERROR(CheckKBlockMajorScales(kTarget, b_s, "b_s", s.k / kFp8Block, s.b_rows / rb));
    const int64_t kb = s.k / kFp8Block, a_blocks = s.a_rows / ra, b_blocks = s.b_rows / rb;
    const auto av = DequantizeFp8Blocks(a, fa, s.a_rows, s.k, ra, kFp8Block,
                                        [as, kb, a_blocks](int64_t i) { return as[(i % kb) * a_blocks + i / kb]; });
    const auto bv = DequantizeFp8Blocks(b, fb, s.b_rows, s.k, rb, kFp8Block,
                                        [bs, kb, b_blocks](int64_t i) { return bs[(i % kb) * b_blocks + i / kb]; });
    Multiply(s, av, bv, bias, *out);
    return ffi::Error::Success();
  }
  TE_RETURN_IF_ERROR(CheckScales(kTarget, s, a, a_s, b, b_s, ffi::DataType::F32, "float32", kFp8Block, ra, rb));
  const auto av = DequantizeFp8Blocks(a, fa, s.a_rows, s.k, ra, kFp8Block, [as](int64_t i) { return as[i]; });
  const auto bv = DequantizeFp8Blocks(b, fb, s.b_rows, s.k, rb, kFp8Block, [bs](int64_t i) { return bs[i]; });
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

// `x` ([rows, cols] row-major floats) transposed to [cols, rows].
std::vector<float> Transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = x[r * cols + c];
  }
  return t;
}

// The bfloat16 call's shapes, in the GroupedShape of the layouts above (group_axis 1: P, Q, R).
ffi::ErrorOr<GroupedShape> Bf16ShapeOf(std::string_view target, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                       const ffi::AnyBuffer& sizes, const ffi::AnyBuffer& bias,
                                       const ffi::AnyBuffer& out, int64_t axis, bool b_kn, bool has_bias) {
  for (const auto* x : {&a, &b, &out}) {
    if (x->element_type() != ffi::DataType::BF16) return ffi::Unexpected(Fail(target, "a, b and out must be bfloat16"));
  }
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (axis == 0 && (ad.size() != 2 || bd.size() != 3 || bd[b_kn ? 1 : 2] != ad[1])) {
    return ffi::Unexpected(Fail(target, std::string("group_axis 0 needs A [M, K] and B ") +
                                            (b_kn ? "[G, K, N]" : "[G, N, K]") + "; got A " + DimsToString(ad) +
                                            " and B " + DimsToString(bd)));
  }
  if (axis == 1 && (ad.size() != 2 || bd.size() != 2 || bd[0] != ad[0])) {
    return ffi::Unexpected(Fail(target, "group_axis 1 needs A [R, P] and B [R, Q] with one R; got A " +
                                            DimsToString(ad) + " and B " + DimsToString(bd)));
  }
  auto groups = GroupsOf(target, sizes, axis, 1, ad[0]);
  if (groups.has_error()) return ffi::Unexpected(groups.error());
  GroupedShape s;
  s.groups = groups.value();
  s.k = axis == 0 ? ad[1] : ad[0];
  return WithMatrices(target, s, axis, axis == 0 ? ad[0] : ad[1], axis == 0 ? bd[b_kn ? 2 : 1] : bd[1], bd[0], out,
                      bias, has_bias);
}

ffi::Error GroupedGemmBf16(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer group_sizes, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, int64_t group_axis,
                           bool has_bias, bool b_kn) {
  constexpr std::string_view kTarget = "te_jax_grouped_gemm_bf16";
  if (group_axis != 0 && group_axis != 1) return Fail(kTarget, "group_axis must be 0 or 1");
  auto s_or = Bf16ShapeOf(kTarget, a, b, group_sizes, bias, *out, group_axis, b_kn, has_bias);
  if (s_or.has_error()) return s_or.error();
  const GroupedShape& s = s_or.value();
  std::vector<float> av = ToFloat(a), bv = ToFloat(b);
  if (group_axis == 1) {  // [R, P], [R, Q] -> [P, R], [Q, R]: the groups along the columns
    av = Transposed(av, s.k, s.a_rows);
    bv = Transposed(bv, s.k, s.n);
  } else if (b_kn) {  // each [K, N] -> [N, K]
    std::vector<float> t(bv.size());
    const int64_t per = s.k * s.n;
    for (int64_t g = 0; g < s.groups.count; ++g) {
      const std::vector<float> one(bv.begin() + g * per, bv.begin() + (g + 1) * per);
      const std::vector<float> one_t = Transposed(one, s.k, s.n);
      std::copy(one_t.begin(), one_t.end(), t.begin() + g * per);
    }
    bv = std::move(t);
  }
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

ffi::Error GroupedGemmMxfp8(ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b, ffi::AnyBuffer b_s,
                            ffi::AnyBuffer group_sizes, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> workspace, int64_t group_axis, int64_t align, bool has_bias) {
  constexpr std::string_view kTarget = "te_jax_grouped_gemm_mxfp8";
  Fp8Format fa = kE4M3, fb = kE4M3;
  TE_RETURN_IF_ERROR(Fp8Pair(kTarget, a, b, &fa, &fb));
  TE_RETURN_IF_ERROR(CheckAlign(kTarget, group_axis, align, kMxfp8Block));
  auto s_or = ShapeOf(kTarget, a, b, group_sizes, bias, *out, 1, group_axis, align, has_bias);
  if (s_or.has_error()) return s_or.error();
  const GroupedShape& s = s_or.value();
  TE_RETURN_IF_ERROR(CheckScales(kTarget, s, a, a_s, b, b_s, ffi::DataType::U8, "uint8 (E8M0 codes)", kMxfp8Block));
  const auto* as = static_cast<const uint8_t*>(a_s.untyped_data());
  const auto* bs = static_cast<const uint8_t*>(b_s.untyped_data());
  const auto av = DequantizeFp8Blocks(a, fa, s.a_rows, s.k, 1, kMxfp8Block,
                                      [as](int64_t i) { return E8M0ToFloat(as[i]); });
  const auto bv = DequantizeFp8Blocks(b, fb, s.b_rows, s.k, 1, kMxfp8Block,
                                      [bs](int64_t i) { return E8M0ToFloat(bs[i]); });
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

ffi::Error GroupedGemmNvfp4(ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer a_amax, ffi::AnyBuffer b,
                            ffi::AnyBuffer b_s, ffi::AnyBuffer b_amax, ffi::AnyBuffer group_sizes, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                            int64_t group_axis, int64_t align, bool has_bias) {
  constexpr std::string_view kTarget = "te_jax_grouped_gemm_nvfp4";
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, a, ffi::DataType::U8, "A", "uint8 (packed E2M1 pairs)"));
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, b, ffi::DataType::U8, "B", "uint8 (packed E2M1 pairs)"));
  TE_RETURN_IF_ERROR(CheckAlign(kTarget, group_axis, align, kNvfp4Block));
  auto s_or = ShapeOf(kTarget, a, b, group_sizes, bias, *out, 2, group_axis, align, has_bias);
  if (s_or.has_error()) return s_or.error();
  const GroupedShape& s = s_or.value();
  TE_RETURN_IF_ERROR(CheckScales(kTarget, s, a, a_s, b, b_s, ffi::DataType::F8E4M3FN, "float8_e4m3fn", kNvfp4Block));
  TE_RETURN_IF_ERROR(CheckGroupScale(kTarget, a_amax, "a_amax", s.groups.count));
  TE_RETURN_IF_ERROR(CheckGroupScale(kTarget, b_amax, "b_amax", s.groups.count));
  // S_dec = 1 / nvfp4_global_encode_scale(amax), one per group (or one for the operand).
  auto s_dec = [&](const ffi::AnyBuffer& amax) {
    std::vector<float> v(static_cast<size_t>(amax.element_count()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f / Nvfp4GlobalEncodeScale(static_cast<const float*>(
                                                        amax.untyped_data())[i]);
    return v;
  };
  const std::vector<float> a_dec = s_dec(a_amax), b_dec = s_dec(b_amax);
  auto dequantize = [&](const ffi::AnyBuffer& q, const ffi::AnyBuffer& sc, const std::vector<float>& dec,
                        int64_t rows, bool is_b) {
    const auto* qd = static_cast<const uint8_t*>(q.untyped_data());
    const auto* sd = static_cast<const uint8_t*>(sc.untyped_data());
    return Dequantize(rows, s.k, [&](int64_t r, int64_t c) {
      const float d = dec.size() == 1 ? dec[0] : dec[GroupAt(s, is_b, r, c)];
      return Nvfp4BlockValue(qd, sd, r, c, s.k) * d;
    });
  };
  const auto av = dequantize(a, a_s, a_dec, s.a_rows, false);
  const auto bv = dequantize(b, b_s, b_dec, s.b_rows, true);
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

}  // namespace

TE_JAX_CPU_HANDLER(GroupedGemmFp8, GroupedGemmFp8);
TE_JAX_CPU_HANDLER(GroupedGemmFp8Block, GroupedGemmFp8Block);
TE_JAX_CPU_HANDLER(GroupedGemmBf16, GroupedGemmBf16);
TE_JAX_CPU_HANDLER(GroupedGemmMxfp8, GroupedGemmMxfp8);
TE_JAX_CPU_HANDLER(GroupedGemmNvfp4, GroupedGemmNvfp4);

}  // namespace te_jax
