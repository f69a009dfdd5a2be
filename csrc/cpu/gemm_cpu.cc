// CPU FFI handlers for the GEMM custom calls (contract: docs/gemm_ffi.md).
//
// Both operands are contraction-last: out[..., m, n] = sum_k A[..., m, k] * B[n, k].
// Each handler validates its buffers, dequantizes A and B to float32 with the
// mode's numerics (numerics.h, the twin of te_jax/quantize/reference.py),
// multiplies with float32 products and accumulation, adds the bias in float32
// and casts to the output dtype. `fast_accum` and `autotune` (cuBLASLt
// options) are accepted and ignored, and the workspace result is left untouched.
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

using namespace gemm_cpu;  // NOLINT: the helpers this file shares with grouped_gemm_cpu.cc

struct GemmShape {
  ffi::Span<const int64_t> lead;  // A's leading axes
  int64_t mats;                   // product of A's leading axes
  int64_t m, n, k;                // rows of each A matrix, rows of B, contraction length
  bool b_batched;                 // B has A's leading axes (batched GEMM); else B is shared
};

// A [..., M, K/pack] and B [N, K/pack] or [..., N, K/pack] (pack: elements per stored column).
ffi::ErrorOr<GemmShape> ShapeOf(std::string_view target, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                int64_t pack) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (ad.size() < 2 || bd.size() < 2) {
    return ffi::Unexpected(Fail(target, "A and B must have rank >= 2 (A [..., M, K], B [..., N, K]); got A " +
                                            DimsToString(ad) + " and B " + DimsToString(bd)));
  }
  if (ad.back() != bd.back()) {
    return ffi::Unexpected(Fail(target, "A and B must share the contraction (last) axis; got A " +
                                            DimsToString(ad) + " and B " + DimsToString(bd)));
  }
  const auto lead = ad.first(ad.size() - 2);
  const bool b_batched = bd.size() > 2;
  if (b_batched && !std::equal(lead.begin(), lead.end(), bd.begin(), bd.end() - 2)) {
    return ffi::Unexpected(Fail(target, "a batched B must have A's leading axes; got A " + DimsToString(ad) +
                                            " and B " + DimsToString(bd)));
  }
  GemmShape s{lead, 1, ad[ad.size() - 2], bd[bd.size() - 2], ad.back() * pack, b_batched};
  for (int64_t d : lead) s.mats *= d;
  return s;
}

ffi::Error CheckOutAndBias(std::string_view target, const GemmShape& s, const ffi::AnyBuffer& out,
                           const ffi::AnyBuffer& bias) {
  if (!IsHighPrecision(out.element_type())) return Fail(target, "out must be float32, bfloat16 or float16");
  std::vector<int64_t> want(s.lead.begin(), s.lead.end());
  want.push_back(s.m);
  want.push_back(s.n);
  auto od = out.dimensions();
  if (!std::equal(want.begin(), want.end(), od.begin(), od.end())) {
    return Fail(target, "out must be " + DimsToString(want) + ", got " + DimsToString(od));
  }
  const int64_t nb = static_cast<int64_t>(bias.element_count());
  if (bias.dimensions().size() != 1 || (nb != 0 && nb != s.n)) {
    return Fail(target, "bias must be [N] = [" + std::to_string(s.n) + "] or empty [0], got " +
                            DimsToString(bias.dimensions()));
  }
  if (nb && bias.element_type() != out.element_type() && bias.element_type() != ffi::DataType::F32) {
    return Fail(target, "bias must have the output's dtype or float32");
  }
  return ffi::Error::Success();
}

// A per-tensor value: one for the operand, or one per matrix of its leading axes.
ffi::Error CheckTensorScale(std::string_view target, const ffi::AnyBuffer& s, std::string_view name,
                            int64_t matrices) {
  TE_RETURN_IF_ERROR(CheckDtype(target, s, ffi::DataType::F32, name, "float32"));
  const int64_t got = static_cast<int64_t>(s.element_count());
  if (got != 1 && got != matrices) {
    return Fail(target, std::string(name) + " must be float32 [1] or one value per matrix (" +
                            std::to_string(matrices) + "), got " + DimsToString(s.dimensions()));
  }
  return ffi::Error::Success();
}

// The per-tensor value of row r of an operand with `rows` rows per matrix.
float ScaleOfRow(const ffi::AnyBuffer& s, int64_t r, int64_t rows) {
  const auto* v = static_cast<const float*>(s.untyped_data());
  return s.element_count() == 1 ? v[0] : v[r / rows];
}

// The shape and operand formats of an FP8 GEMM (per-tensor, block, MXFP8).
struct Fp8Gemm {
  GemmShape shape;
  Fp8Format a, b;
};

ffi::ErrorOr<Fp8Gemm> Fp8GemmOf(std::string_view target, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto s = ShapeOf(target, a, b, 1);
  if (s.has_error()) return ffi::Unexpected(s.error());
  Fp8Gemm g{s.value(), kE4M3, kE4M3};
  TE_RETURN_IF_ERROR_OR(Fp8Pair(target, a, b, &g.a, &g.b));
  return g;
}

// Multiplies the dequantized operands (A: mats*m rows; B: n rows, or mats*n when
// batched), adds the bias and writes `out`.
void Multiply(const GemmShape& s, const std::vector<float>& a, const std::vector<float>& b,
              const ffi::AnyBuffer& bias, ffi::AnyBuffer out) {
  std::vector<float> c(static_cast<size_t>(s.mats * s.m * s.n));
  if (s.b_batched) {
    for (int64_t t = 0; t < s.mats; ++t) {
      MatMulNT(a.data() + t * s.m * s.k, b.data() + t * s.n * s.k, s.m, s.n, s.k, c.data() + t * s.m * s.n);
    }
  } else {
    MatMulNT(a.data(), b.data(), s.mats * s.m, s.n, s.k, c.data());
  }
  if (bias.element_count()) {
    const std::vector<float> bf = ToFloat(bias);
    for (size_t i = 0; i < c.size(); ++i) c[i] += bf[i % s.n];
  }
  StoreFloat(c, out);
}

int64_t BMats(const GemmShape& s) { return s.b_batched ? s.mats : 1; }
int64_t BRows(const GemmShape& s) { return BMats(s) * s.n; }

ffi::Error GemmFp8(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                   ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                   bool autotune, bool fast_accum) {
  constexpr std::string_view kTarget = "te_jax_gemm_fp8";
  auto g = Fp8GemmOf(kTarget, a, b);
  if (g.has_error()) return g.error();
  const GemmShape s = g.value().shape;
  const Fp8Format fa = g.value().a, fb = g.value().b;
  TE_RETURN_IF_ERROR(CheckTensorScale(kTarget, a_scale_inv, "a_scale_inv", s.mats));
  TE_RETURN_IF_ERROR(CheckTensorScale(kTarget, b_scale_inv, "b_scale_inv", BMats(s)));
  TE_RETURN_IF_ERROR(CheckOutAndBias(kTarget, s, *out, bias));
  const auto* ad = static_cast<const uint8_t*>(a.untyped_data());
  const auto* bd = static_cast<const uint8_t*>(b.untyped_data());
  const auto av = Dequantize(s.mats * s.m, s.k, [&](int64_t r, int64_t c) {
    return Fp8ToFloat(ad[r * s.k + c], fa) * ScaleOfRow(a_scale_inv, r, s.m);
  });
  const auto bv = Dequantize(BRows(s), s.k, [&](int64_t r, int64_t c) {
    return Fp8ToFloat(bd[r * s.k + c], fb) * ScaleOfRow(b_scale_inv, r, s.n);
  });
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

ffi::Error GemmFp8Block(ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b, ffi::AnyBuffer b_s,
                        ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                        bool autotune, bool a_block_2d, bool b_block_2d) {
  constexpr std::string_view kTarget = "te_jax_gemm_fp8_block";
  auto g = Fp8GemmOf(kTarget, a, b);
  if (g.has_error()) return g.error();
  const GemmShape s = g.value().shape;
  const Fp8Format fa = g.value().a, fb = g.value().b;
  if (a_block_2d && b_block_2d) {
    return Fail(kTarget, "128x128 x 128x128 block scaling is not supported; quantize one operand with 1x128 blocks");
  }
  const int64_t ra = a_block_2d ? kFp8Block : 1, rb = b_block_2d ? kFp8Block : 1;
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, a_s, ffi::DataType::F32, "a_s", "float32"));
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, b_s, ffi::DataType::F32, "b_s", "float32"));
  TE_RETURN_IF_ERROR(CheckBlockScales(kTarget, a_s, "a_s", a, s.k, ra, kFp8Block));
  TE_RETURN_IF_ERROR(CheckBlockScales(kTarget, b_s, "b_s", b, s.k, rb, kFp8Block));
  TE_RETURN_IF_ERROR(CheckOutAndBias(kTarget, s, *out, bias));
  const auto* as = static_cast<const float*>(a_s.untyped_data());
  const auto* bs = static_cast<const float*>(b_s.untyped_data());
  const auto av = DequantizeFp8Blocks(a, fa, s.mats * s.m, s.k, ra, kFp8Block, [as](int64_t i) { return as[i]; });
  const auto bv = DequantizeFp8Blocks(b, fb, BRows(s), s.k, rb, kFp8Block, [bs](int64_t i) { return bs[i]; });
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

ffi::Error GemmMxfp8(ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer b, ffi::AnyBuffer b_s,
                     ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                     bool autotune) {
  constexpr std::string_view kTarget = "te_jax_gemm_mxfp8";
  auto g = Fp8GemmOf(kTarget, a, b);
  if (g.has_error()) return g.error();
  const GemmShape s = g.value().shape;
  const Fp8Format fa = g.value().a, fb = g.value().b;
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, a_s, ffi::DataType::U8, "a_s", "uint8 (E8M0 codes)"));
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, b_s, ffi::DataType::U8, "b_s", "uint8 (E8M0 codes)"));
  TE_RETURN_IF_ERROR(CheckBlockScales(kTarget, a_s, "a_s", a, s.k, 1, kMxfp8Block));
  TE_RETURN_IF_ERROR(CheckBlockScales(kTarget, b_s, "b_s", b, s.k, 1, kMxfp8Block));
  TE_RETURN_IF_ERROR(CheckOutAndBias(kTarget, s, *out, bias));
  const auto* as = static_cast<const uint8_t*>(a_s.untyped_data());
  const auto* bs = static_cast<const uint8_t*>(b_s.untyped_data());
  const auto av = DequantizeFp8Blocks(a, fa, s.mats * s.m, s.k, 1, kMxfp8Block,
                                      [as](int64_t i) { return E8M0ToFloat(as[i]); });
  const auto bv = DequantizeFp8Blocks(b, fb, BRows(s), s.k, 1, kMxfp8Block,
                                      [bs](int64_t i) { return E8M0ToFloat(bs[i]); });
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

// value = (e2m1 * s_b) * S_dec, S_dec = 1 / Nvfp4GlobalEncodeScale(amax of the row's matrix).
std::vector<float> DequantizeNvfp4(const ffi::AnyBuffer& q, const ffi::AnyBuffer& s, const ffi::AnyBuffer& amax,
                                   int64_t mats, int64_t rows, int64_t k) {
  const auto* qd = static_cast<const uint8_t*>(q.untyped_data());
  const auto* sd = static_cast<const uint8_t*>(s.untyped_data());
  std::vector<float> s_dec(static_cast<size_t>(mats));
  for (int64_t t = 0; t < mats; ++t) s_dec[t] = 1.0f / Nvfp4GlobalEncodeScale(ScaleOfRow(amax, t, 1));
  return Dequantize(mats * rows, k, [&](int64_t r, int64_t c) {
    return Nvfp4BlockValue(qd, sd, r, c, k) * s_dec[r / rows];
  });
}

ffi::Error GemmNvfp4(ffi::AnyBuffer a, ffi::AnyBuffer a_s, ffi::AnyBuffer a_amax, ffi::AnyBuffer b,
                     ffi::AnyBuffer b_s, ffi::AnyBuffer b_amax, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> workspace, bool autotune) {
  constexpr std::string_view kTarget = "te_jax_gemm_nvfp4";
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, a, ffi::DataType::U8, "A", "uint8 (packed E2M1 pairs)"));
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, b, ffi::DataType::U8, "B", "uint8 (packed E2M1 pairs)"));
  auto s_or = ShapeOf(kTarget, a, b, 2);
  if (s_or.has_error()) return s_or.error();
  const GemmShape s = s_or.value();
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, a_s, ffi::DataType::F8E4M3FN, "a_s", "float8_e4m3fn"));
  TE_RETURN_IF_ERROR(CheckDtype(kTarget, b_s, ffi::DataType::F8E4M3FN, "b_s", "float8_e4m3fn"));
  TE_RETURN_IF_ERROR(CheckBlockScales(kTarget, a_s, "a_s", a, s.k, 1, kNvfp4Block));
  TE_RETURN_IF_ERROR(CheckBlockScales(kTarget, b_s, "b_s", b, s.k, 1, kNvfp4Block));
  TE_RETURN_IF_ERROR(CheckTensorScale(kTarget, a_amax, "a_amax", s.mats));
  TE_RETURN_IF_ERROR(CheckTensorScale(kTarget, b_amax, "b_amax", BMats(s)));
  TE_RETURN_IF_ERROR(CheckOutAndBias(kTarget, s, *out, bias));
  const auto av = DequantizeNvfp4(a, a_s, a_amax, s.mats, s.m, s.k);
  const auto bv = DequantizeNvfp4(b, b_s, b_amax, BMats(s), s.n, s.k);
  Multiply(s, av, bv, bias, *out);
  return ffi::Error::Success();
}

}  // namespace

// ---- shared with the grouped GEMM (gemm_cpu.h) ----

namespace gemm_cpu {

// Tiles of the i-k-j loop: a kTileK x kTileN panel of B^T (128 KiB) stays in cache.
constexpr int64_t kTileK = 128;
constexpr int64_t kTileN = 256;

// Block scales of an operand `data` [..., R, K/pack]: [..., R/row_block, K/k_block].
ffi::Error CheckBlockScales(std::string_view target, const ffi::AnyBuffer& s, std::string_view name,
                            const ffi::AnyBuffer& data, int64_t k, int64_t row_block, int64_t k_block) {
  auto dd = data.dimensions();
  const int64_t rows = dd[dd.size() - 2];
  if (k % k_block) {
    return Fail(target, "K (" + std::to_string(k) + ") must be a multiple of the block size " +
                            std::to_string(k_block) + "; pad the contraction axis");
  }
  if (rows % row_block) {
    return Fail(target, std::string(name) + ": 2D blocks need the operand's rows (" + std::to_string(rows) +
                            ") to be a multiple of " + std::to_string(row_block));
  }
  std::vector<int64_t> want(dd.begin(), dd.end() - 2);
  want.push_back(rows / row_block);
  want.push_back(k / k_block);
  auto sd = s.dimensions();
  if (!std::equal(want.begin(), want.end(), sd.begin(), sd.end())) {
    return Fail(target, std::string(name) + " must be " + DimsToString(want) + ", got " + DimsToString(sd));
  }
  return ffi::Error::Success();
}

// FP8 operand formats; E5M2 x E5M2 has no tensor-core kernel and is refused.
ffi::Error Fp8Pair(std::string_view target, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, Fp8Format* fa,
                   Fp8Format* fb) {
  auto ta = Fp8FormatOf(a.element_type());
  auto tb = Fp8FormatOf(b.element_type());
  if (!ta || !tb) return Fail(target, "A and B must be float8_e4m3fn or float8_e5m2");
  if (a.element_type() == ffi::DataType::F8E5M2 && b.element_type() == ffi::DataType::F8E5M2) {
    return Fail(target, "E5M2 x E5M2 is not supported; quantize one operand to E4M3 (e.g. Format.HYBRID)");
  }
  *fa = *ta;
  *fb = *tb;
  return ffi::Error::Success();
}

// c[m, n] = sum_k a[m, k] * b[n, k] in float32 (i-k-j order over B^T tiles, so the
// inner loop runs over contiguous outputs and vectorizes).
void MatMulNT(const float* a, const float* b, int64_t m, int64_t n, int64_t k, float* c) {
  const std::vector<float> bt = Transpose(b, n, k);
  std::fill(c, c + m * n, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += kTileN) {
    const int64_t j1 = std::min(n, j0 + kTileN);
    for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
      const int64_t k1 = std::min(k, k0 + kTileK);
      for (int64_t i = 0; i < m; ++i) {
        float* __restrict ci = c + i * n;
        for (int64_t kk = k0; kk < k1; ++kk) {
          const float aik = a[i * k + kk];
          const float* __restrict bk = bt.data() + kk * n;
          for (int64_t j = j0; j < j1; ++j) ci[j] += aik * bk[j];
        }
      }
    }
  }
}

}  // namespace gemm_cpu

TE_JAX_CPU_HANDLER(GemmFp8, GemmFp8);
TE_JAX_CPU_HANDLER(GemmFp8Block, GemmFp8Block);
TE_JAX_CPU_HANDLER(GemmMxfp8, GemmMxfp8);
TE_JAX_CPU_HANDLER(GemmNvfp4, GemmNvfp4);

}  // namespace te_jax
