"""The grouped GEMMs on a GPU against their reference twin (te_jax.ops.grouped.gemm, backend="reference").

Every (operand dtypes, out dtype, fast_accum, group_axis) that te_jax.grouped_dense issues for the per-tensor
recipes, the Float8 block kernels (both group axes), the bfloat16 kernels (three layouts), the MXFP8 / NVFP4
emulation, the trace-time refusals, and te_jax.grouped_dense forward and backward for every recipe with backend
"ffi" against backend "reference".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax
from te_jax.ops import ffi as _ffi
from te_jax import recipe as R
from te_jax.core.dense import DenseQuantizers
from te_jax.core.grouped_dense import grouped_dense, init_state
from te_jax.core.grouped_mlp import grouped_mlp
from te_jax.core.layernorm_mlp import MLPQuantizers
from te_jax.ops.grouped import gemm as GG
from te_jax.ops.gemm_call import GemmEmulationWarning

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or not _ffi.CUDA_BUILT,
                       reason="needs a GPU and te_jax's CUDA handlers"),
]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32, BF16 = jnp.float32, jnp.bfloat16
ROW_SIZES, ROWS = [37, 0, 200, 91], 400  # an empty group, rows past the sum
SPAN_SIZES = [50, 0, 130, 17]


def _fp8(rng, shape, dtype):
    return jnp.asarray((rng.standard_normal(shape) * 2).astype(np.float32)).astype(dtype)


def _positive(rng, shape):
    return jnp.asarray(rng.uniform(0.25, 2.0, size=shape).astype(np.float32))


def _spans(rng, rows, sizes, align, dtype):
    """[rows, Kc]: the groups' aligned spans, then ``align`` columns past the last span (no group's); random
    values everywhere, the spans' padding included (each group contracts over its whole span)."""
    kc = int(sum(-(-s // align) * align for s in sizes)) + align
    return jnp.asarray(rng.standard_normal((rows, kc)) * 2, np.float32).astype(dtype)


def _row_parts(sizes, m):
    """Each group's rows (cut at m), then the rows past the groups' sum."""
    parts, start = [], 0
    for s in sizes:
        parts.append(slice(min(start, m), min(start + s, m)))
        start += s
    return parts + [slice(min(start, m), m)]


def _assert_close(out, ref, out_dtype, tol, parts):
    """Each part within ``tol`` (relative Frobenius norm) plus one rounding to out_dtype; a zero part stays zero."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = (np.asarray(jnp.asarray(t).astype(F32), np.float64) for t in (out, ref))
    tol += {BF16: 2**-8, F32: 0.0}[out_dtype]
    for part in parts:
        o, r = out[part], ref[part]
        if not r.any():
            assert not o.any(), f"part {part} must be zero"
            continue
        rel = np.linalg.norm(o - r) / np.linalg.norm(r)
        assert rel <= tol, f"part {part}: relative error {rel:.3g} > {tol:.3g}"


def _both(fn, *args):
    """fn(*args, backend) jitted for "ffi" and for "reference"."""
    return tuple(jax.jit(lambda *xs, b=b: fn(*xs, backend=b))(*args) for b in ("ffi", "reference"))


# ---- per-tensor FP8: every combination grouped_dense issues --------------------------------------------

PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]  # forward (and E4M3 grads), HYBRID dgrad, HYBRID wgrad


@pytest.mark.parametrize("group_axis", [0, 1])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("a_dt, b_dt", PAIRS)
def test_fp8_every_combination(a_dt, b_dt, out_dtype, fast, group_axis):
    rng = np.random.default_rng(group_axis * 10 + fast)
    if group_axis == 0:
        sizes, n, k = ROW_SIZES, 272, 384
        a, b = _fp8(rng, (ROWS, k), a_dt), _fp8(rng, (len(sizes), n, k), b_dt)
        parts = _row_parts(sizes, ROWS)
    else:
        sizes = SPAN_SIZES
        a, b = _spans(rng, 192, sizes, 16, a_dt), _spans(rng, 256, sizes, 16, b_dt)
        parts = range(len(sizes))
    a_si, b_si = _positive(rng, (len(sizes),)), _positive(rng, (1,))
    gs = jnp.asarray(sizes, jnp.int32)
    out, ref = _both(lambda *xs, backend: GG.grouped_gemm_fp8(*xs, group_axis=group_axis, out_dtype=out_dtype,
                                                              fast_accum=fast, backend=backend), a, b, a_si, b_si, gs)
    _assert_close(out, ref, out_dtype, 1e-2 if fast else 1e-3, parts)


@pytest.mark.parametrize("a_dt, b_dt, out_dtype", [(E4M3, E4M3, BF16), (E4M3, E5M2, BF16), (E4M3, E4M3, F32)])
def test_fp8_rows_with_bias(a_dt, b_dt, out_dtype):
    """A bias of the out dtype, on the direct and on the float32-and-cast kernels."""
    rng = np.random.default_rng(3)
    sizes, m, n, k = [64, 0, 100], 200, 128, 256
    a, b = _fp8(rng, (m, k), a_dt), _fp8(rng, (len(sizes), n, k), b_dt)
    one = jnp.ones((1,), F32)
    bias = jnp.asarray(rng.standard_normal((len(sizes), n)), out_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    out, ref = _both(lambda *xs, backend: GG.grouped_gemm_fp8(*xs, group_axis=0, out_dtype=out_dtype, backend=backend),
                     a, b, one, one, gs, bias)
    _assert_close(out, ref, out_dtype, 1e-2, _row_parts(sizes, m))


def test_one_compilation_serves_any_group_sizes():
    """group_sizes is data: one jitted function, different routings, each right (nothing read on the host)."""
    rng = np.random.default_rng(5)
    m, n, k, groups = 512, 256, 256, 4
    a, b = _fp8(rng, (m, k), E4M3), _fp8(rng, (groups, n, k), E4M3)
    a_si, b_si = _positive(rng, (1,)), _positive(rng, (groups,))
    f = jax.jit(lambda *xs: GG.grouped_gemm_fp8(*xs, backend="ffi"))
    for sizes in ([128, 128, 128, 128], [512, 0, 0, 0], [0, 0, 0, 500], [1, 2, 3, 4]):
        gs = jnp.asarray(sizes, jnp.int32)
        ref = GG.grouped_gemm_fp8(a, b, a_si, b_si, gs, backend="reference")
        _assert_close(f(a, b, a_si, b_si, gs), ref, BF16, 1e-2, _row_parts(sizes, m))
    assert f._cache_size() == 1


# ---- Float8 block ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("sizes, m, n, b_block_2d", [
    ([37, 0, 200, 91], 400, 256, True),   # 1x128 blocks of a x 128x128 blocks of each group's weight
    ([300, 250], 512, 256, True),         # sum > M: group 1 is cut
    ([100, 0, 156], 320, 256, False),     # 1x128 blocks of the weight
])
def test_block_rows(sizes, m, n, b_block_2d, out_dtype):
    rng = np.random.default_rng(len(sizes) + m)
    groups, k, rows = len(sizes), 384, (128 if b_block_2d else 1)
    a, b = _fp8(rng, (m, k), E4M3), _fp8(rng, (groups, n, k), E4M3)
    a_s, b_s = _positive(rng, (m, k // 128)), _positive(rng, (groups, n // rows, k // 128))
    gs = jnp.asarray(sizes, jnp.int32)
    out, ref = _both(lambda *xs, backend: GG.grouped_gemm_fp8_block(*xs, b_block_2d=b_block_2d, out_dtype=out_dtype,
                                                                    backend=backend), a, a_s, b, b_s, gs)
    # The block-scaled kernels promote every 128-long K block: the split-accumulation bound.
    _assert_close(out, ref, out_dtype, 1e-3, _row_parts(sizes, m))


@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("sizes", [[50, 0, 300, 17], [0, 0], [256]])
def test_block_wgrad(sizes, out_dtype):
    """group_axis 1: [P, Kc/128] scales (the custom call takes them K-block-major), aligned 128-column spans."""
    rng = np.random.default_rng(sum(sizes))
    p, q = 256, 384
    a, b = _spans(rng, p, sizes, 128, E4M3), _spans(rng, q, sizes, 128, E4M3)
    kc = a.shape[1]
    a_s, b_s = _positive(rng, (p, kc // 128)), _positive(rng, (q, kc // 128))
    gs = jnp.asarray(sizes, jnp.int32)
    out, ref = _both(lambda *xs, backend: GG.grouped_gemm_fp8_block(*xs, group_axis=1, out_dtype=out_dtype,
                                                                    backend=backend), a, a_s, b, b_s, gs)
    _assert_close(out, ref, out_dtype, 1e-3, range(len(sizes)))


@pytest.mark.parametrize("kw, match", [
    (dict(a_dt=E5M2), "E4M3 x E4M3 kernels only"),
    (dict(a_block_2d=True), "1x128 blocks for the left operand"),
    (dict(group_axis=1, b_block_2d=True), "1x128 blocks for both"),
])
def test_block_without_kernel_raises_at_trace_time(kw, match):
    kw = dict(kw)
    rng = np.random.default_rng(0)
    a_dt, group_axis, a2, b2 = kw.get("a_dt", E4M3), kw.get("group_axis", 0), kw.get("a_block_2d"), kw.get("b_block_2d")
    if group_axis == 0:
        a, b = _fp8(rng, (256, 256), a_dt), _fp8(rng, (2, 128, 256), E4M3)
        a_s = _positive(rng, (2, 2) if a2 else (256, 2))
        b_s = _positive(rng, (2, 128, 2))
    else:
        a, b = _fp8(rng, (128, 256), a_dt), _fp8(rng, (128, 256), E4M3)
        a_s, b_s = _positive(rng, (128, 2)), _positive(rng, (1, 2) if b2 else (128, 2))
    f = jax.jit(lambda *xs: GG.grouped_gemm_fp8_block(*xs, group_axis=group_axis, a_block_2d=bool(a2),
                                                      b_block_2d=bool(b2), backend="ffi"))
    with pytest.raises(ValueError, match=match):
        f.lower(a, a_s, b, b_s, jnp.asarray([128, 0], jnp.int32))


# ---- MXFP8 / NVFP4: the emulation -----------------------------------------------------------------------


def _mxfp8(rng, shape):
    data = _fp8(rng, shape, E4M3)
    scales = jnp.asarray(rng.integers(122, 132, size=(*shape[:-1], shape[-1] // 32)), jnp.uint8)
    return data, scales


def _nvfp4(rng, shape):
    data = jnp.asarray(rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 2)), jnp.uint8)
    scales = jnp.asarray(rng.uniform(0.5, 8.0, size=(*shape[:-1], shape[-1] // 16)).astype(ml_dtypes.float8_e4m3fn))
    return data, scales


@pytest.mark.parametrize("group_axis", [0, 1])
@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_emulation(mode, group_axis):
    rng = np.random.default_rng(7)
    sizes = ROW_SIZES if group_axis == 0 else SPAN_SIZES
    gs = jnp.asarray(sizes, jnp.int32)
    if group_axis == 0:
        a_shape, b_shape, parts = (ROWS, 256), (len(sizes), 128, 256), _row_parts(sizes, ROWS)
    else:
        kc = int(sum(-(-s // 32) * 32 for s in sizes)) + 32
        a_shape, b_shape, parts = (128, kc), (96, kc), range(len(sizes))
    make = _mxfp8 if mode == "mxfp8" else _nvfp4
    (a, a_s), (b, b_s) = make(rng, a_shape), make(rng, b_shape)
    if mode == "mxfp8":
        op, args = GG.grouped_gemm_mxfp8, (a, a_s, b, b_s, gs)
    else:
        op, args = GG.grouped_gemm_nvfp4, (a, a_s, jnp.asarray([3.0], F32), b, b_s, jnp.asarray([5.0], F32), gs)
    # group_axis 1: random codes in every span's padding too (each group contracts over its whole span).
    # On sm_90 the emulation multiplies with the bfloat16 grouped kernel (these shapes tile), which rounds the
    # result to bfloat16 once.
    with pytest.warns(GemmEmulationWarning, match="emulation.*bfloat16 grouped kernel"):
        out, ref = _both(lambda *xs, backend: op(*xs, group_axis=group_axis, out_dtype=F32, backend=backend), *args)
    # MXFP8 dequantizes exactly to bfloat16; NVFP4's global decode scale rounds once per element.
    _assert_close(out, ref, F32, 2**-8 if mode == "mxfp8" else 2**-7 + 2**-8, parts)


# ---- the custom call's own errors -------------------------------------------------------------------------


def _raw_fp8_call(out_dtype, workspace_bytes):
    rng = np.random.default_rng(0)
    a, b = _fp8(rng, (64, 128), E4M3), _fp8(rng, (2, 128, 128), E4M3)
    one = jnp.ones((1,), F32)
    results = (jax.ShapeDtypeStruct((64, 128), out_dtype), jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8))
    out, _ = jax.ffi.ffi_call("te_jax_grouped_gemm_fp8", results)(
        a, b, one, one, jnp.asarray([32, 32], jnp.int32), jnp.zeros((0,), out_dtype), group_axis=np.int64(0),
        align=np.int64(16), has_bias=False, fast_accum=True)
    return jax.block_until_ready(out)


def test_handler_without_kernel_is_an_error_naming_the_target():
    """Called directly (not through te_jax.ops.grouped.gemm, which casts), float16 out has no kernel."""
    with pytest.raises(Exception, match="te_jax_grouped_gemm_fp8.*no kernel"):
        _raw_fp8_call(jnp.float16, GG.grouped_workspace_bytes(2))


def test_small_workspace_is_an_error():
    with pytest.raises(Exception, match="te_jax_grouped_gemm_fp8.*workspace"):
        _raw_fp8_call(BF16, 256)


# ---- bfloat16 (te_jax_grouped_gemm_bf16): the three layouts at MoE-like shapes -------------------------------

def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(BF16)


@pytest.mark.parametrize("b_kn", [True, False])  # forward (W [G, K, N] as stored), dgrad (W^T: [G, N, K])
@pytest.mark.parametrize("sizes, m", [
    ([700, 0, 1300, 37, 910, 0, 129, 1020], 4096),  # empty groups, rows past the sum
    ([3000, 3000], 4096),                            # sum > M: group 1 is cut
    ([4096], 4096),                                  # all rows in one group
])
def test_bf16_rows(sizes, m, b_kn):
    rng = np.random.default_rng(len(sizes) + m + b_kn)
    groups, k, n = len(sizes), 1024, 1536
    a = _bf16(rng, (m, k))
    b = _bf16(rng, (groups, k, n) if b_kn else (groups, n, k))
    gs = jnp.asarray(sizes, jnp.int32)
    out, ref = _both(lambda *xs, backend: GG.grouped_gemm_bf16(*xs, b_kn=b_kn, backend=backend), a, b, gs)
    # float32 accumulation of bfloat16 products on both sides (different orders): one bfloat16 rounding.
    _assert_close(out, ref, BF16, 1e-5, _row_parts(sizes, m))


@pytest.mark.parametrize("bias_dtype", [BF16, F32])
def test_bf16_rows_with_bias(bias_dtype):
    rng = np.random.default_rng(7)
    sizes, m, k, n = [100, 0, 60, 200], 512, 256, 384
    a, b = _bf16(rng, (m, k)), _bf16(rng, (len(sizes), k, n))
    bias = jnp.asarray(rng.standard_normal((len(sizes), n)), F32).astype(bias_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    out, ref = _both(lambda *xs, backend: GG.grouped_gemm_bf16(*xs, backend=backend), a, b, gs, bias)
    _assert_close(out, ref, BF16, 1e-5, _row_parts(sizes, m))


@pytest.mark.parametrize("sizes, r", [
    ([700, 0, 1300, 37, 910, 0, 129, 1020], 4200),  # unaligned rows, empty groups, rows past the sum
    ([3000, 3000], 4096),                            # sum > R: group 1 is cut
    ([0, 0], 64),                                    # every group empty: zeros
])
def test_bf16_wgrad(sizes, r):
    """group_axis 1: x [R, P], dy [R, Q] grouped along their rows; out[g] = x_g^T @ dy_g [P, Q]."""
    rng = np.random.default_rng(sum(sizes) + r)
    p, q = 1024, 1536
    a, b = _bf16(rng, (r, p)), _bf16(rng, (r, q))
    gs = jnp.asarray(sizes, jnp.int32)
    out, ref = _both(lambda *xs, backend: GG.grouped_gemm_bf16(*xs, group_axis=1, backend=backend), a, b, gs)
    _assert_close(out, ref, BF16, 1e-5, range(len(sizes)))


def test_bf16_refuses_untileable_shapes_at_trace_time():
    a, b = jnp.zeros((64, 36), BF16), jnp.zeros((2, 36, 64), BF16)
    with pytest.raises(ValueError, match="multiples of 8"):
        jax.jit(lambda a, b: GG.grouped_gemm_bf16(a, b, jnp.asarray([32, 32], jnp.int32), backend="ffi")).lower(a, b)


# ---- grouped_dense, every recipe: backend "ffi" against "reference" ---------------------------------------

DG, DM, DK, DN = 4, 192, 128, 256
DENSE_SIZES = [70, 0, 90, 20]
PER_TENSOR = {f"{kind}_{fmt.name}_{fast}": (kind, fmt, fast) for kind in ("delayed", "current")
              for fmt in (R.Format.HYBRID, R.Format.E4M3) for fast in ("fwd_fast", "bwd_fast")}


def _recipe(name):
    if name in PER_TENSOR:
        kind, fmt, fast = PER_TENSOR[name]
        cls = R.DelayedScaling if kind == "delayed" else R.Float8CurrentScaling
        return cls(fp8_format=fmt, fast_accumulation=fast == "fwd_fast", backward_fast_accumulation=fast == "bwd_fast")
    return {"block": R.Float8BlockScaling, "block_w1": lambda: R.Float8BlockScaling(w_block_scaling_dim=1),
            "mxfp8": R.MXFP8BlockScaling, "nvfp4": R.NVFP4BlockScaling}[name]()


def _dense_run(q, state, x, w, b, c, backend):
    # The pure-JAX twin runs on the CPU, as every test's reference does (on a GPU, XLA's float32 arithmetic
    # and default matmul precision are not the reference's).
    device = jax.devices("cpu")[0] if backend == "reference" else jax.devices()[0]
    x, w, b, c, state = jax.device_put((x, w, b, c, state), device)
    with jax.default_device(device):
        gs = jnp.asarray(DENSE_SIZES, jnp.int32)

        def loss(x, w, b):
            y = grouped_dense(x, w, gs, b, quantizers=q, state=state, key=jax.random.key(3))[0]
            return jnp.sum(y.astype(F32) * c), y

        with te_jax.ops.backend.use(backend):
            (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, b)
    return (y, *grads)


@pytest.mark.parametrize("x_dtype, w_dtype", [(F32, F32), (BF16, BF16)])
@pytest.mark.parametrize("name", [*PER_TENSOR, "block", "block_w1", "mxfp8", "nvfp4"])
def test_grouped_dense_matches_reference(name, x_dtype, w_dtype):
    q = DenseQuantizers.from_recipe(_recipe(name))
    keys = jax.random.split(jax.random.key(1), 4)
    x = (jax.random.normal(keys[0], (DM, DK)) * 2).astype(x_dtype)
    w = (jax.random.normal(keys[1], (DG, DK, DN)) / 8).astype(w_dtype)
    b = jax.random.normal(keys[2], (DG, DN)).astype(w_dtype)
    c = jax.random.normal(keys[3], (DM, DN))
    state = init_state(q, DG)
    with te_jax.train.fp8_state_updates(), jax.default_matmul_precision("highest"):
        got = _dense_run(q, state, x, w, b, c, "ffi")
        want = _dense_run(q, state, x, w, b, c, "reference")
    for what, u, v in zip(("y", "dx", "dw", "db"), got, want):
        assert u.shape == v.shape and u.dtype == v.dtype, what
        u, v = np.asarray(u.astype(F32), np.float64), np.asarray(v.astype(F32), np.float64)
        rel = np.linalg.norm(u - v) / max(np.linalg.norm(v), 1e-30)
        assert rel < 2e-2, (what, rel)


@pytest.mark.parametrize("name", ["delayed_E4M3_fwd_fast", "current_HYBRID_bwd_fast", "block"])
def test_grouped_dense_aligned_layout_matches_the_packed_one(name):
    """group_align (the MoE layer's row layout) on the CUDA kernels: the row-grouped GEMMs over whole spans and
    wgrad on the columnwise copies as they are give the packed layout's y, dx, dW bit for bit, and zeros (and zero
    gradients) in the rows between the groups, whatever x and dy hold there."""
    q = DenseQuantizers.from_recipe(_recipe(name))
    align = 128 if name == "block" else 16
    keys = jax.random.split(jax.random.key(5), 4)
    x = (jax.random.normal(keys[0], (DM, DK)) * 2).astype(BF16)
    w = (jax.random.normal(keys[1], (DG, DK, DN)) / 8).astype(BF16)
    c = jax.random.normal(keys[2], (DM, DN)).astype(BF16)
    spans = [-(-s // align) * align for s in DENSE_SIZES]
    rows = np.concatenate([np.arange(m) + s for m, s in zip(DENSE_SIZES, np.cumsum(spans) - spans)])
    used, m_al = sum(DENSE_SIZES), -(-(DM + DG * (align - 1)) // align) * align
    fill = (jax.random.normal(keys[3], (m_al, max(DK, DN))) * 1e3).astype(BF16)
    x_al, c_al = fill[:, :DK].at[rows].set(x[:used]), fill[:, :DN].at[rows].set(c[:used])
    gs = jnp.asarray(DENSE_SIZES, jnp.int32)
    state = init_state(q, DG)

    def run(x, w, c, group_align):
        def loss(x, w):
            y = grouped_dense(x, w, gs, quantizers=q, state=state, group_align=group_align)[0]
            return jnp.sum(y.astype(F32) * c.astype(F32)), y
        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return (y, *grads)

    with te_jax.train.fp8_state_updates():
        packed = jax.jit(run, static_argnums=3)(x, w, c, 1)
        aligned = jax.jit(run, static_argnums=3)(x_al, w, c_al, align)
    between = np.setdiff1d(np.arange(m_al), rows)
    for got in aligned[:2]:
        assert not np.any(np.asarray(got.astype(F32))[between])
    for what, u, v in (("y", packed[0][:used], aligned[0][rows]), ("dx", packed[1][:used], aligned[1][rows]),
                       ("dw", packed[2], aligned[2])):
        np.testing.assert_array_equal(np.asarray(u.astype(F32)), np.asarray(v.astype(F32)), err_msg=what)


@pytest.mark.parametrize("name", ["delayed_HYBRID_fwd_fast", "current_E4M3_bwd_fast", "block", "mxfp8"])
def test_grouped_mlp_matches_reference(name):
    """te_jax.grouped_mlp (fused activation casts between the grouped GEMMs) with backend "ffi" on the GPU against
    backend "reference" on the CPU: y and the gradients of x, wi and wo within 2% (relative norm)."""
    r = _recipe(name)
    q = MLPQuantizers(*(DenseQuantizers.from_recipe(r, ("moe", g)) for g in ("wi", "wo")))
    align = 128 if name == "block" else 32
    keys = jax.random.split(jax.random.key(8), 4)
    spans = [-(-s // align) * align for s in DENSE_SIZES]
    rows = np.concatenate([np.arange(m) + s for m, s in zip(DENSE_SIZES, np.cumsum(spans) - spans)])
    m_al = -(-(DM + DG * (align - 1)) // align) * align
    x = jnp.zeros((m_al, DK), BF16).at[rows].set((jax.random.normal(keys[0], (len(rows), DK)) * 2).astype(BF16))
    wi = (jax.random.normal(keys[1], (DG, DK, 2 * DN)) / 8).astype(BF16)
    wo = (jax.random.normal(keys[2], (DG, DN, DK)) / 8).astype(BF16)
    c = jax.random.normal(keys[3], (m_al, DK))
    state = {g: init_state(getattr(q, g), DG) for g in ("wi", "wo")}

    def run(backend):
        device = jax.devices("cpu")[0] if backend == "reference" else jax.devices()[0]
        args = jax.device_put((x, wi, wo, c, state), device)
        with jax.default_device(device), te_jax.ops.backend.use(backend), te_jax.train.fp8_state_updates():
            gs = jnp.asarray(DENSE_SIZES, jnp.int32)

            def loss(x, wi, wo, c, state):
                y = grouped_mlp(x, wi, wo, gs, activation="swiglu", quantizers=q, state=state,
                                key=jax.random.key(3), group_align=align)[0]
                return jnp.sum(y.astype(F32) * c), y

            (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
        return (y, *grads)

    with jax.default_matmul_precision("highest"):
        got, want = run("ffi"), run("reference")
    for what, u, v in zip(("y", "dx", "dwi", "dwo"), got, want):
        u, v = np.asarray(u.astype(F32), np.float64), np.asarray(v.astype(F32), np.float64)
        rel = np.linalg.norm(u - v) / max(np.linalg.norm(v), 1e-30)
        assert rel < 2e-2, (what, rel)
