"""Property tests: every functional op (quantize, dense, layernorm_dense, layernorm_mlp, grouped_dense,
grouped_mlp) and the Linen and NNX layers on them against their high-precision counterparts within the error bounds
of docs/numerics.md ("Error bounds"), on drawn shapes (0, 1 and ragged sizes), dtypes, recipes and magnitudes.

The bounds are computed here in float64 from the inputs alone: per element ``u|x| + v A + g T + 2^-22 |x| +
2^-126`` for a quantized tensor (A its scale block's amax, T the tensor's), and for a GEMM ``E_x @ |w| + |x| @ E_w +
E_x @ E_w + c(K) (|x'| @ |w'|)`` plus the output cast, where the GEMM's ``Accumulation`` (the backend and the path
that ran it) widens ``E_x``, ``E_w`` by the rounding of operands the multiply reads in fewer bits (TF32) and gives
``c(K)``: ``K 2^-23`` for float32 sums (CPU), more for the tensor cores of a CUDA GPU. The high-precision path is
held to the same bound with no quantization error (its dot's roundings only). Hypothesis draws a bounded,
derandomized set of examples (fixed ``max_examples``, no deadline), so CI sees the same examples every run.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import te_jax
import te_jax.flax as tf
import te_jax.nnx as tn
from te_jax import recipe as R
from te_jax.core import DenseQuantizers, MLPQuantizers
from te_jax.ops.grouped.layout import valid_group_sizes
from te_jax.quantize import CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, dequantize
from te_jax.quantize.delayed import DelayedScalingQuantizer
from te_jax.spec.modes import ScalingMode

pytestmark = pytest.mark.filterwarnings("ignore::te_jax.quantize.fused.UnfusedCastWarning")
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RECIPES = {"current": R.Float8CurrentScaling(), "mxfp8": R.MXFP8BlockScaling(), "block": R.Float8BlockScaling(),
           "nvfp4": R.NVFP4BlockScaling(disable_stochastic_rounding=True), "delayed": R.DelayedScaling()}
OUT_REL = {jnp.dtype(jnp.float32): 2.0**-23, jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11}
# the output cast's absolute error below the dtype's normal range (float16's subnormal step; FTZ for the others)
OUT_ABS = {jnp.dtype(jnp.float32): 2.0**-126, jnp.dtype(jnp.bfloat16): 2.0**-126, jnp.dtype(jnp.float16): 2.0**-24}


# ---- the documented bounds ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bound:
    """docs/numerics.md's ``u``, ``v``, ``g`` of a quantizer and its rowwise scale block (None: the tensor)."""

    u: float
    v: float
    g: float
    block: tuple[int, int] | None

    def of(self, x: np.ndarray, colwise: bool = False) -> np.ndarray:
        """The elementwise bound of ``x [M, N]``'s rowwise copy (columnwise: blocks of the transposed matrix)."""
        a = np.abs(np.asarray(x, np.float64))
        block = None if self.block is None else (self.block[::-1] if colwise else self.block)
        return ((self.u + 2.0**-22) * a + self.v * _block_amax(a, block) + self.g * (a.max() if a.size else 0.0)
                + 2.0**-126)


def _block_amax(a: np.ndarray, block) -> np.ndarray:
    if a.size == 0:
        return a
    if block is None:
        return np.full_like(a, a.max())
    (m, n), (r, c) = a.shape, block
    p = np.pad(a, ((0, -m % r), (0, -n % c)))
    tiles = p.reshape(p.shape[0] // r, r, p.shape[1] // c, c).max(axis=(1, 3))
    return np.repeat(np.repeat(tiles, r, 0), c, 1)[:m, :n]


def bound_of(q) -> Bound:
    """The bound of quantizer ``q`` (round to nearest)."""
    if isinstance(q, NVFP4Quantizer):
        twice = 2.0 if q.stochastic_rounding else 1.0
        return Bound(0.25 * twice, 0.045 * twice, 2.0**-13, (16, 16) if q.block_2d else (1, 16))
    e5m2 = jnp.dtype(q.dtype) == jnp.float8_e5m2
    u, v = (2.0**-3, 2.0**-17 / 57344) if e5m2 else (2.0**-4, 2.0**-10 / 448)
    if isinstance(q, MXFP8Quantizer):
        return Bound(u, 2 * v, 0.0, (1, 32))
    if isinstance(q, Float8BlockQuantizer):
        return Bound(u, v * (2 if q.power_2_scales else 1), 0.0, (128, 128) if q.block_2d else (1, 128))
    return Bound(u, v * (2 if getattr(q, "power_2_scales", False) else 1), 0.0, None)


def operand_bound(q, t: np.ndarray, colwise: bool = False) -> np.ndarray:
    """The elementwise quantization bound of a GEMM operand ``t`` (0 for an unquantized one, ``q`` None)."""
    return np.zeros_like(t) if q is None else bound_of(q).of(t, colwise)


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """How one GEMM reads and sums its operands (docs/numerics.md, "Error bounds"): the terms beyond quantization.

    Attributes:
      name: what ran the GEMM, for the failure messages.
      operand: the relative rounding of each operand as the multiply reads it (TF32: 2^-10, truncation
        included; bfloat16 copies: 2^-8); 0 where the products are exact.
      unit: the error of one addend of the sums, relative to ``|x'| @ |w'|``.
      step: the fewest products one tensor-core step sums, each step adding three more roundings (the carried
        accumulator, the step's normalization, a split-K or promotion sum); None: plain float32 sums, K addends.
      result: the relative rounding of the sum before the output cast (the bfloat16 grouped kernel's bfloat16
        result: 2^-8), bounded relative to ``|x'| @ |w'|``; 0 for a float32 result.
    """

    name: str
    operand: float
    unit: float
    step: int | None
    result: float = 0.0

    def term(self, k: int) -> float:
        """``c(K)``: the accumulation's error relative to ``|x'| @ |w'|``."""
        return self.unit * (k if self.step is None else k + 3 * -(-k // self.step)) + self.result


# XLA:CPU and the CPU twins: float32 products and round-to-nearest float32 sums.
CPU_SUMS = Accumulation("float32 sums", 0.0, 2.0**-23, None)
# Tensor cores summing in float32 (bfloat16 GEMMs, TF32 dots): at least 24 bits, possibly truncated, so an addend
# aligned to the step's largest term loses < 2^-23 of it; steps of at least 4 products.
GPU_F32_SUMS = Accumulation("tensor-core float32 sums", 0.0, 2.0**-23, 4)
# XLA:GPU's float32 dot at the default precision (what flax's layers and te_jax's unquantized path run): TF32.
GPU_TF32 = dataclasses.replace(GPU_F32_SUMS, name="TF32 dot (default precision)", operand=2.0**-10)
# Hopper's FP8 MMA keeps about 14 bits in its accumulator (DeepSeek-V3's report); assuming, with a bit to
# spare, at least 13 significant bits with truncation, an addend aligned to
# the step's largest term loses < 2^-12 of it. Steps of at least 16 products (wgmma's FP8 K is 32).
GPU_FP8_SUMS = Accumulation("FP8 tensor-core sums (>= 13 bits)", 0.0, 2.0**-12, 16)
# The grouped emulation (te_jax.ops.grouped.reference.emulate): the float32 dequantized operands cast to bfloat16
# (exact for MXFP8's E4M3 * 2^e), the product on sm_90 from the bfloat16 grouped kernel, whose result is bfloat16.
GPU_BF16_EXACT_COPIES = dataclasses.replace(GPU_F32_SUMS, name="bfloat16 emulation (exact copies)", result=2.0**-8)
GPU_BF16_COPIES = dataclasses.replace(GPU_BF16_EXACT_COPIES, name="bfloat16 emulation", operand=2.0**-8)


def _capability() -> float | None:
    """The first CUDA device's compute capability, None when it does not say."""
    try:
        return float(jax.devices("gpu")[0].compute_capability)
    except (RuntimeError, AttributeError, ValueError, TypeError, IndexError):
        return None


def accumulation_of(q, dtype=jnp.float32, grouped: bool = False) -> Accumulation:
    """The ``Accumulation`` of a GEMM whose operands ``q`` quantizes (None: the unquantized ``dtype`` dot) on the
    default backend: float32 sums on CPU; on a CUDA GPU what runs the GEMM (docs/numerics.md, "Error bounds")."""
    if jax.default_backend() == "cpu":
        return CPU_SUMS
    if q is None:
        return GPU_TF32 if jnp.dtype(dtype) == jnp.float32 else GPU_F32_SUMS
    family, capability = q.scaling_mode.family, _capability()
    kernels = (ScalingMode.FP8_TENSOR, ScalingMode.FP8_BLOCK)  # the grouped CUTLASS kernels (sm_90)
    if grouped and (family not in kernels or capability not in (None, 9.0)):  # te_jax.ops.grouped.cuda
        return GPU_BF16_EXACT_COPIES if family is ScalingMode.MXFP8 else GPU_BF16_COPIES
    if family in (ScalingMode.MXFP8, ScalingMode.NVFP4) and capability is not None \
            and capability < q.scaling_mode.native_gemm_capability:
        return GPU_F32_SUMS  # sm_90's emulation: exact bfloat16 operands, one bfloat16 GEMM
    return GPU_FP8_SUMS


def gemm_bound(x, w, ex, ew, acc: Accumulation, bias=None) -> np.ndarray:
    """docs/numerics.md's GEMM bound (before the output cast) of ``x [M, K] @ w [K, N]`` run as ``acc`` says, plus
    ``bias [N]`` when given: XLA:GPU may add it in the GEMM's accumulator (cuBLAS's C operand), so the sums'
    roundings apply to K + 1 addends and to ``|bias|`` as well."""
    x, w = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    ex, ew = ex + acc.operand * (x + ex), ew + acc.operand * (w + ew)  # the operands as the multiply reads them
    k, sums = x.shape[1], (x + ex) @ (w + ew)
    if bias is not None:
        k, sums = k + 1, sums + np.abs(np.asarray(bias, np.float64))
    return ex @ w + x @ ew + ex @ ew + acc.term(k) * sums


def assert_within(got, want, bound, out_dtype, what: str) -> None:
    """``|got - want| <= bound`` plus the output cast's rounding of ``got`` (and ``want``'s own float32 one); the
    message gives the worst ratio of error to that allowance, and where."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: output shape {got.shape}, expected {want.shape}"
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {got.size} outputs not finite, the first at " \
                          f"{tuple(int(i) for i in np.argwhere(bad)[0])}"
    if got.size == 0:
        return
    rel = OUT_REL[jnp.dtype(out_dtype)]
    allowed = bound * (1 + rel) + 2 * rel * np.abs(want) + OUT_ABS[jnp.dtype(out_dtype)]
    ratio = np.abs(got - want) / allowed
    i = np.unravel_index(np.argmax(ratio), ratio.shape)
    assert ratio[i] <= 1, (
        f"{what} on {jax.default_backend()}: {int(np.sum(ratio > 1))} of {ratio.size} outputs over the bound; worst "
        f"|got - want| / bound = {ratio[i]:.4g} at {tuple(int(j) for j in i)}: got {got[i]:.9g}, want {want[i]:.9g}, "
        f"bound {allowed[i]:.4g}")


# ---- drawn inputs -------------------------------------------------------------------------------------------


def _values(seed: int, shape, scale_exp: int, dtype) -> jax.Array:
    """Normal values times 2^scale_exp, each row of its own magnitude (2^-6 .. 2^6), some rows zero."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lead = shape[:-1] if len(shape) > 1 else (1,)
    rows = jnp.exp2(jax.random.uniform(k2, (*lead, 1), minval=-6, maxval=6))
    rows = jnp.where(jax.random.uniform(k3, rows.shape) < 0.1, 0.0, rows)
    x = jax.random.normal(k1, shape) * (rows if len(shape) > 1 else rows[0]) * 2.0**scale_exp
    return x.astype(dtype)


sizes = st.sampled_from([0, 1, 3, 16, 33])
contraction = st.sampled_from([0, 1, 5, 32, 48, 130])
exponents = st.integers(-30, 30)
dtypes = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
seeds = st.integers(0, 2**16)


def _in_range(e: int, dtype) -> int:
    """The drawn exponent, within what float16 holds (values reach 2^(e+8); outputs a few times more)."""
    return max(-6, min(e, 4)) if jnp.dtype(dtype) == jnp.float16 else e


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _amax(t) -> jax.Array:
    return jnp.max(jnp.abs(jnp.asarray(t, jnp.float32)), initial=0.0).reshape(1)


def _calibrated(q: DenseQuantizers, amaxes: dict) -> dict:
    """Delayed scaling's state after one step with these amaxes (role -> f32[1]): the scales current scaling
    would use, so the bound is current scaling's."""
    return {r: qz.update_state(qz.init_state(), amaxes[r]) for r, qz in q.stateful().items()}


# ---- the properties -----------------------------------------------------------------------------------------

QUANTIZERS = {
    "current e4m3": CurrentScalingQuantizer(), "current e5m2 p2": CurrentScalingQuantizer(jnp.float8_e5m2, True),
    "delayed": DelayedScalingQuantizer(amax_history_len=1), "mxfp8": MXFP8Quantizer(),
    "mxfp8 e5m2": MXFP8Quantizer(jnp.float8_e5m2), "block 1d": Float8BlockQuantizer(),
    "block 2d f32": Float8BlockQuantizer(block_2d=True, power_2_scales=False), "nvfp4": NVFP4Quantizer(),
    "nvfp4 2d": NVFP4Quantizer(block_2d=True),
}


@settings(max_examples=24, **SETTINGS)
@given(name=st.sampled_from(list(QUANTIZERS)), m=sizes, n=contraction, e=exponents, dtype=dtypes, seed=seeds)
def test_quantize_dequantize_within_the_bound(name, m, n, e, dtype, seed):
    q = QUANTIZERS[name]
    x = _values(seed, (m, n), _in_range(e, dtype), dtype)
    state = q.update_state(q.init_state(), _amax(x)) if isinstance(q, DelayedScalingQuantizer) else None

    @jax.jit
    def run(x):
        t = q.quantize(x, state, rowwise=True, colwise=True)
        return dequantize(t, jnp.float32), te_jax.quantize.dequantize_colwise(t, jnp.float32)

    rowwise, colwise = run(x)
    bound = bound_of(q)
    assert_within(rowwise, _f64(x), bound.of(_f64(x)), jnp.float32, f"{name} rowwise")
    assert_within(np.asarray(colwise)[:n, :m].T, _f64(x), bound.of(_f64(x), colwise=True), jnp.float32,
                  f"{name} columnwise")


def _dense_bounds(q: DenseQuantizers, x, w):
    """Elementwise bounds of the forward operands: x rowwise [M, K], the kernel's columnwise copy ([K, N] blocks
    along K)."""
    return operand_bound(q.input, x), operand_bound(q.weight, w, colwise=True)


@settings(max_examples=20, **SETTINGS)
@given(recipe=st.sampled_from(list(RECIPES)), m=sizes, k=contraction, n=sizes, e=exponents, dtype=dtypes,
       seed=seeds, rank1=st.booleans())
def test_dense_forward_within_the_bound(recipe, m, k, n, e, dtype, seed, rank1):
    q = DenseQuantizers.from_recipe(RECIPES[recipe])
    x = _values(seed, (k,) if rank1 else (m, k), _in_range(e, dtype), dtype)
    w = _values(seed + 1, (k, n), 0, dtype) * (1.0 / max(k, 1)) ** 0.5
    b = _values(seed + 2, (n,), 0, dtype)
    state = _calibrated(q, {"linear_input": _amax(x), "linear_weight": _amax(w), "linear_grad_output": _amax(1.0)})
    y, _ = jax.jit(lambda x, w, b: te_jax.dense(x, w, b, quantizers=q, state=state))(x, w, b)
    y_hp, _ = jax.jit(te_jax.dense)(x, w, b)
    x2, w2, b2 = _f64(x).reshape(1 if rank1 else m, k), _f64(w), _f64(b)
    exact = x2 @ w2 + b2
    ex, ew = _dense_bounds(q, x2, w2)
    acc, hp_acc = accumulation_of(q.input), accumulation_of(None, dtype)
    bound = gemm_bound(x2, w2, ex, ew, acc)
    hp_rounding = gemm_bound(x2, w2, np.zeros_like(x2), np.zeros_like(w2), hp_acc)
    y, y_hp = (np.asarray(t, np.float64).reshape(exact.shape) for t in (y, y_hp))
    assert_within(y, exact, bound, dtype, f"{recipe} y vs exact ({acc.name})")
    if jnp.dtype(dtype) == jnp.float32:  # narrower dots may sum in their own dtype (XLA:CPU): held to y's bound
        assert_within(y_hp, exact, hp_rounding, dtype, f"high precision y vs exact ({hp_acc.name})")
    assert_within(y, y_hp, bound + hp_rounding + OUT_REL[jnp.dtype(dtype)] * np.abs(exact), dtype,
                  f"{recipe} y vs hp ({acc.name}; {hp_acc.name})")


@settings(max_examples=10, **SETTINGS)
@given(m=sizes, k=contraction, n=sizes, e=exponents, seed=seeds)
def test_dense_gradients_within_the_bound(m, k, n, e, seed):
    """Current scaling (per-tensor blocks: the bound needs no block orientation): dx = dy @ w^T, dw = x^T @ dy."""
    q = DenseQuantizers.from_recipe(RECIPES["current"])
    x, w, dy = _values(seed, (m, k), e, jnp.float32), _values(seed + 1, (k, n), 0, jnp.float32), \
        _values(seed + 2, (m, n), -e, jnp.float32)
    _, vjp = jax.vjp(lambda x, w: te_jax.dense(x, w, quantizers=q)[0], x, w)
    dx, dw = jax.jit(vjp)(dy)
    x2, w2, g2 = _f64(x), _f64(w), _f64(dy)
    e_x, e_w, e_g = (bound_of(q_).of(t) for q_, t in ((q.input, x2), (q.weight, w2), (q.grad_output, g2)))
    acc = accumulation_of(q.grad_output)
    assert_within(dx, g2 @ w2.T, gemm_bound(g2, w2.T, e_g, e_w.T, acc), jnp.float32, f"dx ({acc.name})")
    assert_within(dw, x2.T @ g2, gemm_bound(x2.T, g2, e_x.T, e_g, acc), jnp.float32, f"dw ({acc.name})")


def _layernorm(x, gamma, beta, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * gamma + beta


def _ln_operand_bound(q, ln):
    """The normalized input's bound: its quantization (none for ``q`` None), plus the float32 norm's rounding (2^-20
    of its row's amax)."""
    rows = np.abs(ln).max(-1, keepdims=True) if ln.size else np.zeros((ln.shape[0], 1))
    return operand_bound(q, ln) + 2.0**-20 * (np.abs(ln) + rows)


@settings(max_examples=8, **SETTINGS)
@given(recipe=st.sampled_from(list(RECIPES)), m=sizes, h=st.sampled_from([1, 5, 32, 48]), n=sizes, e=exponents,
       seed=seeds)
def test_layernorm_dense_within_the_bound(recipe, m, h, n, e, seed):
    q = DenseQuantizers.from_recipe(RECIPES[recipe])
    x = _values(seed, (m, h), e, jnp.float32)
    gamma, beta = 1 + 0.1 * _values(seed + 1, (h,), 0, jnp.float32), _values(seed + 2, (h,), -3, jnp.float32)
    w, b = _values(seed + 3, (h, n), 0, jnp.float32), _values(seed + 4, (n,), 0, jnp.float32)
    ln = _layernorm(_f64(x), _f64(gamma), _f64(beta))
    state = _calibrated(q, {"linear_input": _amax(ln), "linear_weight": _amax(w), "linear_grad_output": _amax(1.0)})

    @jax.jit
    def run(*a):
        return te_jax.layernorm_dense(*a, quantizers=q, state=state)[0], te_jax.layernorm_dense(*a)[0]

    y, y_hp = run(x, gamma, beta, w, b)
    exact = ln @ _f64(w) + _f64(b)
    for got, qs, what in ((y, q, recipe), (y_hp, DenseQuantizers(), "high precision")):
        acc = accumulation_of(qs.input)
        bound = gemm_bound(ln, _f64(w), _ln_operand_bound(qs.input, ln), operand_bound(qs.weight, _f64(w), True), acc)
        assert_within(got, exact, bound, jnp.float32, f"{what} ({acc.name})")


_SLOPE = {"gelu": 1.13, "relu": 1.0, "swiglu": 1.1}  # the activation's largest slope (swiglu: silu's)
_GATED = ("swiglu",)


def _activation(h, activation):
    if activation == "relu":
        return np.maximum(h, 0.0)
    if activation == "swiglu":
        return h / (1 + np.exp(-h))
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))


def activated(hid: np.ndarray, e_h: np.ndarray, activation: str) -> tuple[np.ndarray, np.ndarray]:
    """``(a, E_a)``: the activation of the first GEMM's output ``hid`` (gated: ``act(h[:F]) * h[F:]``) and the bound
    of its computed value: the GEMM's bound ``e_h`` carried by the activation's slope (gated: times the gate, plus
    the activated half times the gate's bound), plus the activation's float32 rounding."""
    if activation not in _GATED:
        return _activation(hid, activation), _SLOPE[activation] * e_h + 2.0**-20 * np.abs(hid)
    f = hid.shape[-1] // 2
    (h, g), (e_1, e_g) = (hid[..., :f], hid[..., f:]), (e_h[..., :f], e_h[..., f:])
    act = _activation(h, activation)
    moved = _SLOPE[activation] * e_1 * (np.abs(g) + e_g) + np.abs(act) * e_g
    return act * g, moved + 2.0**-20 * (np.abs(h) * np.abs(g) + np.abs(act * g))


def mlp_exact_and_bound(q: MLPQuantizers, ln, w1, b1, w2, b2, activation: str):
    """``act(ln @ w1 + b1) @ w2 + b2`` in float64 and its bound: the first GEMM's bound carried through the
    activation into the second GEMM's input, next to that input's own quantization (ln: the normalized input, whose
    float32 rounding counts too; w1 ``[H, N1]``). Each GEMM's ``Accumulation`` follows its quantizers."""
    hid = ln @ w1 + b1
    e_h = gemm_bound(ln, w1, _ln_operand_bound(q.wi.input, ln), operand_bound(q.wi.weight, w1, True),
                     accumulation_of(q.wi.input), b1)
    a, moved = activated(hid, e_h, activation)
    e_a = moved + operand_bound(q.wo.input, np.abs(a) + moved)
    return a @ w2 + b2, gemm_bound(a, w2, e_a, operand_bound(q.wo.weight, w2, True), accumulation_of(q.wo.input), b2)


@settings(max_examples=8, **SETTINGS)
@given(recipe=st.sampled_from(["current", "mxfp8", "nvfp4", "block"]), m=sizes, h=st.sampled_from([5, 32]),
       f=st.sampled_from([1, 16, 40]), activation=st.sampled_from(list(_SLOPE)), e=exponents, seed=seeds)
def test_layernorm_mlp_within_the_bound(recipe, m, h, f, activation, e, seed):
    """Quantized and high-precision, each within its bound of the float64 MLP (gated: ``[H, 2, F]`` kernel)."""
    q = MLPQuantizers.from_recipe(RECIPES[recipe])
    x = _values(seed, (m, h), e, jnp.float32)
    gamma, beta = jnp.ones((h,)), jnp.zeros((h,))
    width = (2, f) if activation in _GATED else (f,)
    w1, b1 = _values(seed + 1, (h, *width), 0, jnp.float32) * h**-0.5, _values(seed + 2, width, -2, jnp.float32)
    w2, b2 = _values(seed + 3, (f, h), 0, jnp.float32) * f**-0.5, _values(seed + 4, (h,), -2, jnp.float32)

    @jax.jit
    def run(*a):
        return [te_jax.layernorm_mlp(*a, activation=activation, quantizers=qs)[0] for qs in (q, None)]

    ys = run(x, gamma, beta, w1, b1, w2, b2)
    ln = _layernorm(_f64(x), 1.0, 0.0)
    w1_2d, b1_2d = _f64(w1).reshape(h, -1), _f64(b1).reshape(-1)
    for y, qs, what in zip(ys, (q, MLPQuantizers.from_recipe(None)), (recipe, "high precision")):
        exact, bound = mlp_exact_and_bound(qs, ln, w1_2d, b1_2d, _f64(w2), _f64(b2), activation)
        assert_within(y, exact, bound, jnp.float32, f"{what} {activation} ({accumulation_of(qs.wi.input).name})")


@settings(max_examples=8, **SETTINGS)
@given(recipe=st.sampled_from(["current", "mxfp8"]), m=st.sampled_from([0, 1, 16, 37]),
       k=st.sampled_from([32, 64]), n=st.sampled_from([32, 64]),
       group_sizes=st.lists(st.integers(-4, 24), min_size=1, max_size=4), e=exponents, seed=seeds)
def test_grouped_dense_within_the_bound(recipe, m, k, n, group_sizes, e, seed):
    """Each row against its group's weight (the valid sizes: negative ones count as 0, cut at M); rows in no
    group are zero on both paths."""
    q = DenseQuantizers.from_recipe(RECIPES[recipe])
    g = len(group_sizes)
    x, w = _values(seed, (m, k), e, jnp.float32), _values(seed + 1, (g, k, n), 0, jnp.float32)
    gs = jnp.asarray(group_sizes, jnp.int32)
    y, _ = jax.jit(lambda x, w, gs: te_jax.grouped_dense(x, w, gs, quantizers=q))(x, w, gs)
    y_hp, _ = jax.jit(te_jax.grouped_dense)(x, w, gs)
    sizes = np.asarray(valid_group_sizes(gs, m))
    x2, w2 = _f64(x), _f64(w)
    acc, hp_acc = accumulation_of(q.input, grouped=True), accumulation_of(None)
    exact, bound, hp_bound = np.zeros((m, n)), np.zeros((m, n)), np.zeros((m, n))
    ex = bound_of(q.input).of(x2)
    start = 0
    for i, size in enumerate(sizes):
        rows = slice(start, start + size)
        exact[rows] = x2[rows] @ w2[i]
        bound[rows] = gemm_bound(x2[rows], w2[i], ex[rows], bound_of(q.weight).of(w2[i], colwise=True), acc)
        hp_bound[rows] = gemm_bound(x2[rows], w2[i], np.zeros_like(ex[rows]), np.zeros_like(w2[i]), hp_acc)
        start += size
    assert_within(y, exact, bound, jnp.float32, f"{recipe} vs exact ({acc.name})")
    assert_within(y_hp, exact, hp_bound, jnp.float32, f"high precision ({hp_acc.name})")
    for got, what in ((y, recipe), (y_hp, "high precision")):
        past = np.asarray(got)[start:]
        assert not np.any(past), f"{what}: {int(np.count_nonzero(past))} nonzero outputs in the rows past the groups"


def grouped_weight_bound(q, w: np.ndarray) -> np.ndarray:
    """Each expert's kernel bound (``w`` ``[G, K, N]``, columnwise blocks along K), with the amax over all experts
    where the scale is per tensor (a bound either way)."""
    if q is None:
        return np.zeros_like(w)
    flat = np.concatenate(list(w), axis=1)  # [K, G N]: each column's blocks stay in its expert
    return np.stack(np.split(bound_of(q).of(flat, colwise=True), w.shape[0], axis=1))


@settings(max_examples=6, **SETTINGS)
@given(recipe=st.sampled_from(["none", "current", "mxfp8"]), group_sizes=st.lists(st.integers(0, 40), min_size=1,
                                                                                   max_size=3),
       activation=st.sampled_from(list(_SLOPE)), e=exponents, seed=seeds)
def test_grouped_mlp_within_the_bound(recipe, group_sizes, activation, e, seed):
    """Each group's rows through its expert's MLP in the aligned row layout (empty groups included); the rows
    between the groups give zeros. Quantized and high precision, each within its bound of the float64 MLPs."""
    q = MLPQuantizers.from_recipe(RECIPES.get(recipe))
    align, h, f, g = 32, 32, 32, len(group_sizes)
    starts = np.cumsum([0] + [-(-size // align) * align for size in group_sizes])
    member = np.zeros(int(starts[-1]), bool)
    for start, size in zip(starts, group_sizes):
        member[start:start + size] = True
    x = jnp.where(member[:, None], _values(seed, (member.size, h), e, jnp.float32), 0.0)
    width = 2 * f if activation in _GATED else f
    wi, bi = _values(seed + 1, (g, h, width), 0, jnp.float32) * h**-0.5, _values(seed + 2, (g, width), -2, jnp.float32)
    wo, bo = _values(seed + 3, (g, f, h), 0, jnp.float32) * f**-0.5, _values(seed + 4, (g, h), -2, jnp.float32)
    gs = jnp.asarray(group_sizes, jnp.int32)

    @jax.jit
    def run(*a):
        return [te_jax.grouped_mlp(*a, activation=activation, quantizers=qs, group_align=align)[0] for qs in (q, None)]

    ys = run(x, wi, wo, gs, bi, bo)
    x2, wi2, bi2, wo2, bo2 = (_f64(t) for t in (x, wi, bi, wo, bo))
    groups = [slice(start, start + size) for start, size in zip(starts, group_sizes)]
    for y, qs, what in zip(ys, (q, MLPQuantizers.from_recipe(None)), (recipe, "high precision")):
        ex, e_wi, e_wo = (operand_bound(qs.wi.input, x2), grouped_weight_bound(qs.wi.weight, wi2),
                          grouped_weight_bound(qs.wo.weight, wo2))
        acc_i, acc_o = accumulation_of(qs.wi.input, grouped=True), accumulation_of(qs.wo.input, grouped=True)
        hid, e_h = np.zeros((x2.shape[0], width)), np.zeros((x2.shape[0], width))
        for i, rows in enumerate(groups):
            hid[rows], e_h[rows] = x2[rows] @ wi2[i] + bi2[i], gemm_bound(x2[rows], wi2[i], ex[rows], e_wi[i], acc_i)
        a, moved = activated(hid, e_h, activation)
        e_a = moved + operand_bound(qs.wo.input, np.abs(a) + moved)  # the whole activation's scale blocks
        exact, bound = np.zeros((x2.shape[0], h)), np.zeros((x2.shape[0], h))
        for i, rows in enumerate(groups):
            exact[rows] = a[rows] @ wo2[i] + bo2[i]
            bound[rows] = gemm_bound(a[rows], wo2[i], e_a[rows], e_wo[i], acc_o)
        assert_within(y, exact, bound, jnp.float32, f"{what} {activation} ({acc_i.name})")
        between = np.asarray(y)[~member]
        assert not np.any(between), f"{what}: {int(np.count_nonzero(between))} nonzero outputs between the groups"


# kind -> (the Linen layer, the NNX layer) of input width h, n outputs, MLP width f, the MLP's activation
LAYERS = {
    "dense": (lambda h, n, f, act: tf.DenseGeneral(n), lambda h, n, f, act, rngs: tn.Linear(h, n, rngs=rngs)),
    "layernorm_dense": (lambda h, n, f, act: tf.LayerNormDenseGeneral(n),
                        lambda h, n, f, act, rngs: tn.LayerNormLinear(h, n, rngs=rngs)),
    "layernorm_mlp": (lambda h, n, f, act: tf.LayerNormMLP(intermediate_dim=f, activation=act),
                      lambda h, n, f, act, rngs: tn.LayerNormMLP(h, f, activation=act, rngs=rngs)),
}


def _perturbed(params: dict, seed: int) -> dict:
    """The parameters with random biases and norm scales (their initializers give 0 and 1)."""
    out = {}
    for i, (name, p) in enumerate(sorted(params.items())):
        if name.endswith("bias"):
            p = _values(seed + i, p.shape, -2, p.dtype)
        elif name == "scale":
            p = 1 + 0.1 * _values(seed + i, p.shape, 0, p.dtype)
        out[name] = p
    return out


def layer_exact_and_bound(kind: str, q: DenseQuantizers, x: np.ndarray, p: dict, activation: str):
    """The float64 layer of parameters ``p`` (flax's names) on ``x`` and the bound of its computed value."""
    if kind == "dense":
        ex, ew = _dense_bounds(q, x, p["kernel"])
        return x @ p["kernel"] + p["bias"], gemm_bound(x, p["kernel"], ex, ew, accumulation_of(q.input), p["bias"])
    ln = _layernorm(x, p["scale"], p["ln_bias"])
    if kind == "layernorm_dense":
        bound = gemm_bound(ln, p["kernel"], _ln_operand_bound(q.input, ln), operand_bound(q.weight, p["kernel"], True),
                           accumulation_of(q.input), p["bias"])
        return ln @ p["kernel"] + p["bias"], bound
    mq = MLPQuantizers(wi=q, wo=q)
    return mlp_exact_and_bound(mq, ln, p["wi_kernel"].reshape(x.shape[1], -1), p["wi_bias"].reshape(-1),
                               p["wo_kernel"], p["wo_bias"], activation)


@settings(max_examples=8, **SETTINGS)
@given(api=st.sampled_from(["linen", "nnx"]), kind=st.sampled_from(list(LAYERS)),
       recipe=st.sampled_from(["current", "mxfp8", "block", "nvfp4"]), m=sizes, h=st.sampled_from([5, 32, 48]),
       n=st.sampled_from([1, 3, 16, 33]), f=st.sampled_from([1, 16, 40]), activation=st.sampled_from(list(_SLOPE)),
       e=exponents, seed=seeds)
def test_layers_within_the_bound(api, kind, recipe, m, h, n, f, activation, e, seed):
    """te_jax.flax's DenseGeneral, LayerNormDenseGeneral and LayerNormMLP and te_jax.nnx's Linear, LayerNormLinear
    and LayerNormMLP: under autocast and outside it (flax's computation), each within its bound of the float64
    layer with the same (randomized) parameters."""
    x = _values(seed, (m, h), e, jnp.float32)
    rec = RECIPES[recipe]
    if api == "linen":
        layer = LAYERS[kind][0](h, n, f, activation)
        params = _perturbed(layer.init(jax.random.key(seed), jnp.ones((1, h)))["params"], seed + 1)

        @jax.jit
        def run(params, x):
            with te_jax.autocast(recipe=rec):
                y = layer.apply({"params": params}, x)
            return y, layer.apply({"params": params}, x)

        ys = run(params, x)
    else:
        layer = LAYERS[kind][1](h, n, f, activation, nnx.Rngs(seed))
        names = [name for name, v in vars(layer).items() if isinstance(v, nnx.Param)]
        params = _perturbed({name: getattr(layer, name)[...] for name in names}, seed + 1)
        for name, value in params.items():
            getattr(layer, name).set_value(value)
        graphdef, state = nnx.split(layer)

        @jax.jit
        def run(state, x):
            model = nnx.merge(graphdef, state)
            with te_jax.autocast(recipe=rec):
                y = model(x)
            return y, model(x)

        ys = run(state, x)
    p = {name: _f64(v) for name, v in params.items()}
    for y, q, what in zip(ys, (DenseQuantizers.from_recipe(rec), DenseQuantizers()), (recipe, "high precision")):
        exact, bound = layer_exact_and_bound(kind, q, _f64(x), p, activation)
        assert_within(y, exact, bound, jnp.float32, f"{api} {kind} {what} ({accumulation_of(q.input).name})")


@settings(max_examples=5, **SETTINGS)
@given(recipe=st.sampled_from(["current", "mxfp8", "nvfp4"]), m=sizes, k=st.sampled_from([1, 32, 48]),
       e=exponents, seed=seeds)
def test_flax_dense_general_within_the_bound_of_flax(recipe, m, k, e, seed):
    """te_jax.flax.DenseGeneral under autocast against flax.linen.DenseGeneral with the same parameters."""
    import flax.linen as nn

    x = _values(seed, (m, k), e, jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = nn.DenseGeneral(24).init(jax.random.key(seed), jnp.ones((1, k)))
    with te_jax.autocast(recipe=RECIPES[recipe]):
        y = jax.jit(tf.DenseGeneral(24).apply)(v, x)
    q = DenseQuantizers.from_recipe(RECIPES[recipe])
    w = _f64(v["params"]["kernel"])
    ex, ew = _dense_bounds(q, _f64(x), w)
    acc, flax_acc = accumulation_of(q.input), accumulation_of(None)  # flax's dot: the default precision
    flax_rounding = gemm_bound(_f64(x), w, np.zeros_like(ex), np.zeros_like(ew), flax_acc)
    assert_within(y, _f64(nn.DenseGeneral(24).apply(v, x)), gemm_bound(_f64(x), w, ex, ew, acc) + flax_rounding,
                  jnp.float32, f"{recipe} ({acc.name}) vs flax ({flax_acc.name})")
