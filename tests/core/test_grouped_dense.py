"""te_jax.grouped_dense: every recipe vs the per-group high-precision loop, the GEMMs' operands, the state."""

from __future__ import annotations

import dataclasses
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import te_jax
from te_jax import recipe as R
from te_jax.core.dense import DenseQuantizers
from te_jax.core.grouped_dense import grouped_dense, init_state
from te_jax.ops.grouped import gemm as GG
from te_jax.quantize import CurrentScalingQuantizer, DelayedScalingQuantizer
from te_jax.quantize import dequantize

GD = importlib.import_module("te_jax.core.grouped_dense")  # the module (te_jax.grouped_dense is also the function)

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
G, M, K, N = 4, 192, 128, 128
SIZES = {
    "zeros": [70, 0, 90, 20],
    "skew": [0, 0, M, 0],
    "tail": [17, 30, 0, 5],  # sum < M: rows past it give zeros and get zero gradients
    "empty": [0, 0, 0, 0],
}
# Relative (norm) error bounds of y, dx, dW against the high-precision loop: a few times each format's
# relative rounding error per element (E4M3 2^-4, E5M2 gradients 2^-3, MXFP8's power-of-two scales ~2x,
# NVFP4's E2M1 values 2^-1 with per-16 scales), averaged over the K- or M-long sums.
TOL = {"delayed": 0.06, "current": 0.06, "block": 0.06, "mxfp8": 0.1, "nvfp4": 0.3, "custom": 0.06}


@pytest.fixture(autouse=True)
def _on_cpu():
    """Runs on XLA:CPU on every machine, so every recipe (MXFP8 and NVFP4, which have no CUDA grouped kernel, too)
    is checked; the CUDA grouped kernels are tested against the reference twin in test_grouped_gemm_gpu.py."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _custom():
    """Per-tensor FP8 for the experts' weights by module path, inputs and gradients current-scaled."""
    def qfactory(role):
        if role.endswith("weight"):
            assert role.path == ("moe", "wi")
            return CurrentScalingQuantizer(E4)
        return CurrentScalingQuantizer(E5 if "grad" in role else E4) if role in (
            "linear_input", "linear_grad_output") else None
    return R.CustomRecipe(qfactory)


RECIPES = {"delayed": lambda: R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling,
           "block": R.Float8BlockScaling, "mxfp8": R.MXFP8BlockScaling, "nvfp4": R.NVFP4BlockScaling,
           "custom": _custom}


def _bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    width = np.dtype(f"u{a.dtype.itemsize}")
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(width), b.view(width))


def _data(seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = (jax.random.normal(keys[0], (M, K)) * 2).astype(dtype)
    w = (jax.random.normal(keys[1], (G, K, N)) / 8).astype(dtype)
    b = jax.random.normal(keys[2], (G, N)).astype(dtype)
    c = jax.random.normal(keys[3], (M, N))
    return x, w, b, c


def _loop(x, w, b, sizes):
    """The per-group loop of lax.dot_general (the reference), zeros past the groups."""
    out, start = [], 0
    for g, m in enumerate(sizes):
        yg = lax.dot_general(x[start:start + m], w[g], (((1,), (0,)), ((), ())))
        out.append(yg if b is None else yg + b[g])
        start += m
    out.append(jnp.zeros((x.shape[0] - start, w.shape[2]), x.dtype))
    return jnp.concatenate(out)


def _fwd_bwd(fn, x, w, b, c):
    def loss(x, w, b):
        y = fn(x, w, b)
        return jnp.sum(y.astype(jnp.float32) * c), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, b)
    return (y, *grads)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("sizes", list(SIZES))
def test_high_precision_is_the_per_group_loop(sizes):
    x, w, b, c = _data()
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    y, state = grouped_dense(x, w, gs, b)
    assert state is None
    assert _bits(y, _loop(x, w, b, SIZES[sizes]))
    got = _fwd_bwd(lambda x, w, b: grouped_dense(x, w, gs, b)[0], x, w, b, c)
    want = _fwd_bwd(lambda x, w, b: _loop(x, w, b, SIZES[sizes]), x, w, b, c)
    assert _bits(got[0], want[0])
    for u, v in zip(got[1:], want[1:]):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,sizes", [(name, "zeros") for name in RECIPES] + [("current", "skew"), ("block", "tail"),
                                                                                ("mxfp8", "empty")])
def test_recipe_matches_the_loop(name, sizes):
    q = DenseQuantizers.from_recipe(RECIPES[name](), ("moe", "wi"))
    x, w, b, c = _data(seed=1)
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    state = init_state(q, G)
    key = jax.random.key(3)

    def run(x, w, b):
        return grouped_dense(x, w, gs, b, quantizers=q, state=state, key=key)[0]

    if name == "delayed":  # a step with the amaxes recorded first, so the scales fit the data
        with te_jax.train.fp8_state_updates():
            grads = jax.jit(jax.grad(
                lambda s: jnp.sum(grouped_dense(x, w, gs, b, quantizers=q, state=s)[0] * c)))(state)
        state = te_jax.train.apply_fp8_update(state, grads)
    with te_jax.train.fp8_state_updates():
        got = _fwd_bwd(run, x, w, b, c)
    want = _fwd_bwd(lambda x, w, b: _loop(x, w, b, SIZES[sizes]), x, w, b, c)
    member = np.arange(M) < sum(SIZES[sizes])
    for what, u, v in zip(("y", "dx", "dw", "db"), got, want):
        assert u.shape == v.shape and u.dtype == v.dtype, what
        assert _rel(u, v) < TOL[name] or not np.any(np.asarray(v)), (what, _rel(u, v))
    assert np.all(np.asarray(got[0])[~member] == 0) and np.all(np.asarray(got[1])[~member] == 0)
    empty = [g for g, m in enumerate(SIZES[sizes]) if m == 0]
    assert np.all(np.asarray(got[2])[empty] == 0) and np.all(np.asarray(got[3])[empty] == 0)


def test_each_gemm_uses_the_right_copies():
    """forward x(row) W_g(col); dgrad dy(row) W_g(row); wgrad x(col) dy(col) in aligned spans, bit for bit."""
    qx, qw, qg = CurrentScalingQuantizer(E4), CurrentScalingQuantizer(E4), CurrentScalingQuantizer(E5)
    q = DenseQuantizers(input=qx, weight=qw, grad_output=qg)
    x, w, b, c = _data(seed=2)
    sizes = SIZES["zeros"]
    gs = jnp.asarray(sizes, jnp.int32)
    y, dx, dw, db = _fwd_bwd(lambda x, w, b: grouped_dense(x, w, gs, b, quantizers=q)[0], x, w, b, c)
    wq = jax.vmap(lambda w: qw.quantize(w, colwise=True, flatten_axis=1))(w)
    assert _bits(y, GG.grouped_gemm(qx.quantize(x, flatten_axis=1), wq, gs, bias=b, out_dtype=jnp.float32))
    assert _bits(dx, GG.grouped_gemm(qg.quantize(c, flatten_axis=1), wq, gs, (1, 1), out_dtype=jnp.float32,
                                     fast_accum=False))
    align, spans = 16, -(-(M + G * 15) // 16) * 16
    group, index, member = GG.grouped_positions(gs, spans, align)
    rows = (np.cumsum(sizes) - sizes)[np.asarray(group)] + np.asarray(index)
    xs = jnp.where(member[:, None], x[np.clip(rows, 0, M - 1)], 0.0)
    cs = jnp.where(member[:, None], c[np.clip(rows, 0, M - 1)], 0.0)
    # The spans are cast with the scale of their whole tensor (rows past the groups included).
    want_dw = GG.grouped_gemm(qx.quantize_like(xs, qx.quantize(x, flatten_axis=1), rowwise=False, colwise=True,
                                               flatten_axis=1),
                              qg.quantize_like(cs, qg.quantize(c, flatten_axis=1), rowwise=False, colwise=True,
                                               flatten_axis=1), gs, (0, 0), group_axis=1,
                              out_dtype=jnp.float32, fast_accum=False)
    assert _bits(dw, want_dw)
    starts = np.cumsum(sizes) - sizes
    want_db = np.stack([np.asarray(c[s:s + m]).sum(0) for s, m in zip(starts, sizes)])
    np.testing.assert_allclose(db, want_db, rtol=1e-6, atol=1e-5)


def test_current_scaling_spans_reuse_the_tensors_amax():
    """Current scaling: the wgrad spans are x's and dy's rowwise copies moved and transposed (one
    te_jax_gather_transpose each), so one step runs three current-scaling casts (x, the experts' weights in one
    batched call, dy) and no other cast; the spans' scales are those of the whole tensors even when a row past
    the groups holds the largest value."""
    q = DenseQuantizers.from_recipe(R.Float8CurrentScaling())
    x, w, b, c = _data(seed=5)
    x, c = x.at[M - 1].set(1e3), c.at[M - 1].set(-1e3)  # past the groups (sum 180 < M)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)

    def loss(x, w):
        return jnp.sum(grouped_dense(x, w, gs, quantizers=q)[0].astype(jnp.float32) * c)

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    calls = {t: hlo.count(f'custom_call_target="{t}"')
             for t in ("te_jax_quantize_fp8_current", "te_jax_quantize_fp8", "te_jax_gather_transpose")}
    assert calls == {"te_jax_quantize_fp8_current": 3, "te_jax_quantize_fp8": 0, "te_jax_gather_transpose": 2}, calls
    qx = q.input
    rows = qx.quantize(x, flatten_axis=1)
    spans = qx.quantize_like(x[:180] * 0.5, rows, rowwise=False, colwise=True, flatten_axis=1)
    assert _bits(spans.colwise_scale_inv, rows.scale_inv) and _bits(spans.amax, rows.amax)
    own = qx.quantize(x[:180] * 0.5, rowwise=False, colwise=True, flatten_axis=1)
    assert float(own.colwise_scale_inv[0]) < float(rows.scale_inv[0])  # its own amax would give a finer scale
    assert _rel(dequantize(spans, jnp.float32), x[:180] * 0.5) < 0.1  # E4M3 steps, a few small values subnormal
    with pytest.raises(ValueError, match="amax"):
        qx.quantize_like(x, dataclasses.replace(rows, amax=None))


def test_one_operand_quantized():
    """A role left in high precision: the GEMM dequantizes the other operand and multiplies in float32."""
    qx = CurrentScalingQuantizer(E4)
    x, w, b, c = _data(seed=5)
    sizes = [100, 0, 60, 32]  # every row in a group: the wgrad copy has x's scale
    gs = jnp.asarray(sizes, jnp.int32)
    y, dx, dw, db = _fwd_bwd(lambda x, w, b: grouped_dense(x, w, gs, b, quantizers={"linear_input": qx})[0],
                             x, w, b, c)
    xq = dequantize(qx.quantize(x), jnp.float32)
    want = _fwd_bwd(lambda x, w, b: _loop(x, w, b, sizes), xq, w, b, c)
    for u, v in zip((y, dx, dw, db), want):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-4)


def test_bf16():
    x, w, b, c = _data(dtype=jnp.bfloat16)
    q = DenseQuantizers.from_recipe(R.Float8CurrentScaling())
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    out = _fwd_bwd(lambda x, w, b: grouped_dense(x, w, gs, b, quantizers=q)[0], x, w, b, c)
    assert all(t.dtype == jnp.bfloat16 for t in out)


@pytest.mark.parametrize("sizes", list(SIZES))
def test_bf16_grouped_kernel_path(sizes):
    """The GPU's unquantized bfloat16 path (te_jax's grouped GEMM for forward, dgrad and wgrad; here its CPU
    twin) against the float32 per-group loop on the same bfloat16 values: float32 accumulation and one bfloat16
    rounding, so within 2^-8 (relative norm) for y, dx, dW and the bias gradient (summed in float32); the rows
    past the groups are zero and get zero gradients."""
    x, w, b, c = _data(dtype=jnp.bfloat16)
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    got = _fwd_bwd(lambda x, w, b: GD._grouped_bf16(x, w, gs, b), x, w, b, c)
    f32 = [t.astype(jnp.float32) for t in (x, w, b)]
    want = _fwd_bwd(lambda x, w, b: _loop(x, w, b, SIZES[sizes]), *f32, c)
    for u, v in zip(got, want):
        assert u.dtype == jnp.bfloat16
        assert _rel(u, v) <= 2**-8, _rel(u, v)
    tail = int(sum(SIZES[sizes]))
    assert not np.any(np.asarray(got[0][tail:], np.float32)) and not np.any(np.asarray(got[1][tail:], np.float32))


def test_high_precision_path_choice():
    """bfloat16 operands with K and N multiples of 8 stage te_jax's bfloat16 grouped GEMM for CUDA (XLA's ragged
    dot on CPU); float32 operands or a K that is not a multiple of 8 stage the ragged dot alone."""
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    x, w, b, _ = _data(dtype=jnp.bfloat16)
    staged = str(jax.make_jaxpr(lambda x, w: grouped_dense(x, w, gs)[0])(x, w))
    assert "platform_index" in staged and "te_jax_grouped_gemm" in staged and "ragged_dot" in staged
    x32, w32, _, _ = _data()
    assert "te_jax_grouped_gemm" not in str(jax.make_jaxpr(lambda x, w: grouped_dense(x, w, gs)[0])(x32, w32))
    odd = str(jax.make_jaxpr(lambda x, w: grouped_dense(x, w, gs)[0])(x[:, :12], w[:, :12]))
    assert "te_jax_grouped_gemm" not in odd


def _aligned_rows(sizes, align: int) -> np.ndarray:
    """Where each packed row of the groups lands in the aligned layout (group g from roundup-summed spans)."""
    spans = -(-np.asarray(sizes) // align) * align
    starts = np.cumsum(spans) - spans
    return np.concatenate([np.arange(m) + s for m, s in zip(sizes, starts)]).astype(np.int32)


@pytest.mark.parametrize("sizes", ["zeros", "tail", "empty"])
@pytest.mark.parametrize("name", [None, "delayed", "current", "block", "mxfp8", "nvfp4", "custom"])
def test_aligned_layout_matches_the_packed_one(name, sizes):
    """group_align: the same groups laid out at aligned rows, with large values in the rows between them, give
    the packed layout's y, dx, dW and dbias (bit for bit where no random rounding differs; NVFP4's stochastic
    rounding draws other bits), zeros in the rows between, and ignore what those rows of x and dy hold."""
    x, w, b, c = _data(seed=6)
    _check_aligned_matches_packed(name, sizes, x, w, b, c)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_per_tensor_spans_awkward_values(name):
    """Per-tensor scaling builds wgrad's spans from the rowwise copies' bytes (moved, transposed): the same bits as
    the aligned layout's one cast writing both copies, with negative zeros, zero rows and saturating values."""
    x, w, b, c = _data(seed=11)
    x = x.at[3].set(-0.0).at[5].set(0.0).at[7, :9].set(1e4).at[8, 1].set(-3e4)
    c = c.at[2].set(-0.0).at[4, :5].set(-2e5)
    _check_aligned_matches_packed(name, "zeros", x, w, b, c)


@dataclasses.dataclass(frozen=True)
class _HalvedColumns:
    """A CustomRecipe's own per-tensor quantizer (not one of te_jax's): its columnwise copy casts x / 2, so it is
    not the rowwise copy transposed."""

    dtype = E4

    def quantize(self, x, state=None, *, rowwise=True, colwise=False, flatten_axis=-1, key=None):
        if colwise and not rowwise:
            return CurrentScalingQuantizer(E4).quantize(x / 2, rowwise=False, colwise=True, flatten_axis=flatten_axis)
        return CurrentScalingQuantizer(E4).quantize(x, rowwise=rowwise, colwise=colwise, flatten_axis=flatten_axis)


@dataclasses.dataclass(frozen=True)
class _HalvingSubclass(CurrentScalingQuantizer):
    """te_jax's current scaling, subclassed: what it casts with another copy's scale (wgrad's spans) is x / 2."""

    def quantize_like(self, x, like, **kwargs):
        return super().quantize_like(x / 2, like, **kwargs)


def test_only_te_jax_per_tensor_casts_move_rowwise_bytes():
    """The packed layout's spans come from the rowwise bytes only for te_jax's own per-tensor quantizers (whose
    columnwise copy is the rowwise one transposed); another per-tensor quantizer casts its spans itself, and wgrad
    sees what that cast gives (here x / 2: half the weight gradient)."""
    x, w, _, c = _data(seed=12)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    q = DenseQuantizers(input=_HalvedColumns(), weight=CurrentScalingQuantizer(E4),
                        grad_output=CurrentScalingQuantizer(E5))
    plain = DenseQuantizers(input=CurrentScalingQuantizer(E4), weight=CurrentScalingQuantizer(E4),
                            grad_output=CurrentScalingQuantizer(E5))

    def grads(q):
        loss = lambda x, w: jnp.sum(grouped_dense(x, w, gs, quantizers=q)[0].astype(jnp.float32) * c)  # noqa: E731
        f = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return f(x, w), f.lower(x, w).as_text().count("te_jax_gather_transpose")

    (_, dw_custom), calls_custom = grads(q)
    (_, dw_plain), calls_plain = grads(plain)
    assert calls_custom == 1 and calls_plain == 2  # dy's spans still move bytes: its quantizer is te_jax's
    assert _rel(dw_plain / 2, dw_custom) < 0.05
    # A subclass of te_jax's quantizer may cast otherwise: it casts its spans itself too.
    (_, dw_sub), calls_sub = grads(dataclasses.replace(q, input=_HalvingSubclass(E4)))
    assert calls_sub == 1 and _rel(dw_plain / 2, dw_sub) < 0.05


def _check_aligned_matches_packed(name, sizes, x, w, b, c):
    q = DenseQuantizers.from_recipe(RECIPES[name](), ("moe", "wi")) if name else DenseQuantizers()
    align = math.lcm(GD.span_alignment(q), 16)
    gs = jnp.asarray(SIZES[sizes], jnp.int32)
    used = int(sum(SIZES[sizes]))
    rows = _aligned_rows(SIZES[sizes], align)
    m_al = -(-(M + G * (align - 1)) // align) * align
    fill = jax.random.normal(jax.random.key(9), (m_al, K)) * 1e3
    x_al = fill.at[rows].set(x[:used])
    c_al = (fill[:, :N] * -1).at[rows].set(c[:used])
    # The packed layout's rows past the groups count in its per-tensor amaxes (the aligned layout's between-group
    # rows do not): zero them, so that both quantize the same values with the same scales.
    x, c = x.at[used:].set(0.0), c.at[used:].set(0.0)
    state = init_state(q, G)
    key = jax.random.key(3)

    def run(align, c):
        return lambda x, w, b: grouped_dense(x, w, gs, b, quantizers=q, state=state, key=key, group_align=align)[0]

    with te_jax.train.fp8_state_updates():
        packed = _fwd_bwd(run(1, c), x, w, b, c)
        aligned = _fwd_bwd(run(align, c_al), x_al, w, b, c_al)
    between = np.setdiff1d(np.arange(m_al), rows)
    assert not np.any(np.asarray(aligned[0])[between]) and not np.any(np.asarray(aligned[1])[between])
    pairs = [(packed[0][:used], aligned[0][rows]), (packed[1][:used], aligned[1][rows]), (packed[2], aligned[2]),
             (packed[3], aligned[3])]
    for what, (u, v) in zip(("y", "dx", "dw", "db"), pairs):
        if name == "nvfp4":
            assert _rel(v, u) < TOL["nvfp4"] or not np.any(np.asarray(u)), (what, _rel(v, u))
        elif name is None:
            np.testing.assert_allclose(np.asarray(v), np.asarray(u), rtol=1e-5, atol=1e-4, err_msg=what)
        else:
            assert _bits(u, v), (what, _rel(v, u))


def test_group_align_errors():
    x, w, _, _ = _data()
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    current = DenseQuantizers.from_recipe(R.Float8CurrentScaling())
    with pytest.raises(ValueError, match="group_align must be 1 or a multiple of 16"):
        grouped_dense(x, w, gs, quantizers=current, group_align=24)
    block = DenseQuantizers.from_recipe(R.Float8BlockScaling())
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_dense(x, w, gs, quantizers=block, group_align=64)
    with pytest.raises(ValueError, match=r"x's rows \(200\) must be a multiple of it"):
        grouped_dense(jnp.zeros((200, K)), w, gs, quantizers=current, group_align=16)
    for bad in (0, True, 16.0):
        with pytest.raises(ValueError, match="group_align must be a positive int"):
            grouped_dense(x, w, gs, group_align=bad)
    assert GD.span_alignment(None) == 1 and GD.span_alignment(current) == 16 and GD.span_alignment(block) == 128


def test_delayed_state_step_by_step():
    q = DenseQuantizers.from_recipe(R.DelayedScaling(amax_history_len=2))
    x, w, b, c = _data(seed=4)
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    state = init_state(q, G)
    assert state["linear_weight"]["amax_history"].shape == (G, 2) and state["linear_weight"]["scale"].shape == (G, 1)
    assert state["linear_input"]["amax_history"].shape == (2,)
    y, new = grouped_dense(x, w, gs, b, quantizers=q, state=state)
    # One weight scale per expert; one input scale for all experts' rows.
    want_w = np.float32(448) / np.max(np.abs(np.asarray(w)), axis=(1, 2))
    np.testing.assert_array_equal(np.asarray(new["linear_weight"]["scale"])[:, 0], want_w)
    assert float(new["linear_input"]["scale"][0]) == float(np.float32(448) / jnp.max(jnp.abs(x)))
    assert float(new["linear_grad_output"]["scale"][0]) == 1.0
    with te_jax.train.fp8_state_updates():
        grads = jax.jit(jax.grad(lambda s: jnp.sum(grouped_dense(x, w, gs, b, quantizers=q, state=s)[0] * c)))(state)
    stepped = te_jax.train.apply_fp8_update(state, grads)
    assert float(stepped["linear_grad_output"]["amax_history"][-1]) == float(jnp.max(jnp.abs(c)))
    np.testing.assert_array_equal(np.asarray(stepped["linear_weight"]["scale"])[:, 0], want_w)
    # The next step quantizes with those scales.
    y2, _ = grouped_dense(x, w, gs, b, quantizers=q, state=stepped)
    assert _rel(y2, _loop(x, w, b, SIZES["zeros"])) < TOL["delayed"]


def test_errors():
    x, w, b, c = _data()
    gs = jnp.asarray(SIZES["zeros"], jnp.int32)
    with pytest.raises(TypeError, match=r"group_sizes must be int32 \[G\] = \[4\]"):
        grouped_dense(x, w, gs.astype(jnp.float32))
    with pytest.raises(TypeError, match=r"group_sizes must be int32 \[G\] = \[4\]"):
        grouped_dense(x, w, gs[:3])
    with pytest.raises(ValueError, match=r"bias must be \[G, N\]"):
        grouped_dense(x, w, gs, b[0])
    with pytest.raises(ValueError, match="x must be"):
        grouped_dense(x[:, :64], w, gs)
    block = DenseQuantizers.from_recipe(R.Float8BlockScaling())
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_dense(x, w[:, :, :96], gs, quantizers=block)
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_dense(x[:, :64], w[:, :64], gs, quantizers=block)
    delayed = DenseQuantizers(weight=DelayedScalingQuantizer(amax_history_len=2))
    with pytest.raises(ValueError, match=r"no state for the stateful quantizers.*state=quantizers\.init_state\("
                                         r"num_groups=4\)"):
        grouped_dense(x, w, gs, quantizers=delayed)
    with pytest.raises(ValueError, match=r"leading axis of the 4 experts.*create it with "
                                         r"quantizers\.init_state\(num_groups=4\)"):
        grouped_dense(x, w, gs, quantizers=delayed, state=delayed.init_state())
    # the call the messages name makes the state they ask for
    grouped_dense(x, w, gs, quantizers=delayed, state=delayed.init_state(num_groups=4))
