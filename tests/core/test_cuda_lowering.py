"""What runs on CPU lowers for CUDA: every public op and layer, forward and backward, each recipe, awkward shapes.

The CUDA lowering rules check what the GPU kernels take, and the CPU lowering
takes more; a CPU-only test suite cannot see the difference unless the
programs are lowered for CUDA, which ``jax.jit(f).trace(*args).lower(
lowering_platforms=("cuda",))`` does on this machine. The CUDA-only refusals,
and what keeps each public entry point clear of them:

* ``te_jax.ops.gemm_call._check_cuda_shapes`` (every dense GEMM: dense,
  layernorm_dense, layernorm_mlp, dot_general / einsum without batch axes, the
  Linen and NNX layers on them): M and N multiples of 16, K of 16 (32 for
  MXFP8 and NVFP4). ``te_jax.ops.gemm`` pads the whole operands
  (``gemm_call.aligned``) and a partition rule's body pads each device's
  blocks (``gemm_call._local_call``): a split of M, N or K over a mesh may
  leave 8 of 16 rows on a device (``test_sharded_gemm_blocks_lower_for_cuda``).
* ``te_jax.ops.grouped.cuda.check_cuda`` (the grouped GEMMs: grouped_dense,
  grouped_mlp, ragged_dot, dot_general / einsum with batch axes, the MoE,
  RaggedDot, DenseGeneral(batch_dims) and Einsum layers): per-tensor FP8 K and
  N multiples of 16, which the grouped ops zero pad on every platform
  (``te_jax.core.grouped_tiles``); Float8 block K and N multiples of 128,
  whose partial blocks ``check_blocks`` refuses on every platform
  (``ragged_dot`` pads them); wgrad's span alignment, which the ops lay out at
  ``span_alignment``. MXFP8 and NVFP4 grouped GEMMs run an emulation on a GPU
  (``GemmEmulationWarning``), on the bfloat16 grouped kernel only where K and
  N are multiples of 8, as is the high-precision bfloat16 path.
* ``te_jax.ops.grouped.cuda.cuda_kernel``: Float8 block kernels for E4M3 x
  E4M3 with 1x128 blocks on the left (both wgrad operands); the other block
  layouts run the emulation on CUDA with a ``GemmEmulationWarning``
  (``block_emulation_message``), as on every other GPU; per-tensor FP8 has a
  kernel (or the float32 one, cast) for every dtype pair but E5M2 x E5M2,
  which every platform refuses.

Quantize, dequantize and the fused norm / activation casts lower by one rule
for every platform. (cuDNN's fused attention, which TransformerLayer picks on
a GPU only, cannot be traced without cuDNN: not covered here.) Each case
traces the function once (a trace-time error is every platform's: the same
message) and lowers it for CPU and for CUDA: it must lower for both, or raise
the te_jax error the case names; where cheap the CPU run gives finite values.
"""

from __future__ import annotations

import json
import math
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

import te_jax
from te_jax import recipe as R
from te_jax.core import DenseQuantizers, MLPQuantizers
from te_jax.core.grouped_dense import init_state, span_alignment
from te_jax.ops.gemm_call import GemmEmulationWarning
from te_jax.quantize import CurrentScalingQuantizer

# Block casts that do not tile a norm's or activation's output run unfused (a performance note, not a refusal).
pytestmark = pytest.mark.filterwarnings("ignore::te_jax.quantize.fused.UnfusedCastWarning")

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
WHOLE_BLOCKS = "the grouped GEMM takes whole blocks only"


def _custom(role):
    """A CustomRecipe's own per-tensor quantizers: E4M3 inputs and weights, E5M2 gradients."""
    if str(role) in ("linear_input", "linear_weight"):
        return CurrentScalingQuantizer(E4)
    return CurrentScalingQuantizer(E5) if str(role) == "linear_grad_output" else None


# "custom" has E5M2 gradients (HYBRID): the E5M2 x E4M3 and E4M3 x E5M2 per-tensor kernels.
RECIPES = {"delayed": R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling(),
           "block": R.Float8BlockScaling(), "mxfp8": R.MXFP8BlockScaling(), "nvfp4": R.NVFP4BlockScaling(),
           "custom": R.CustomRecipe(_custom)}
# Float8 block variants the CUDA grouped kernels have no kernel for (te_jax.dense takes them; the grouped ops run
# the emulation for them on CUDA).
BLOCK_VARIANTS = {"block_hybrid": R.Float8BlockScaling(fp8_format=R.Format.HYBRID),
                  "block_x2": R.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
                  "block_grad2": R.Float8BlockScaling(grad_block_scaling_dim=2, w_block_scaling_dim=1)}
# The recipes whose cases also run on CPU (finite results): state, E5M2 gradients, FP4 with stochastic rounding;
# the others' numerics are tested in their op's own file.
RUN_ON_CPU = ("delayed", "custom", "nvfp4")
# The variants with 128x128 blocks on activations or gradients: the grouped GEMM takes them for whole blocks of
# rows only (every platform).
TWO_D_LEFT = ("block_x2", "block_grad2")
ROWS_OF_128 = "128x128 blocks need"
BLOCKED = {"block": 128, "mxfp8": 32, "nvfp4": 16}  # what a grouped op's K and N must be multiples of


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _rand(seed: int, shape, scale: float = 1.0, dtype=jnp.float32) -> jax.Array:
    return (scale * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def _lowers_alike(fn, *args, refuses: str | None = None, run: bool = False) -> str | None:
    """Traces ``jax.jit(fn)`` once and lowers it for CPU and CUDA.

    ``refuses``: the trace raises a te_jax ValueError containing it (every platform's, as the trace is shared).
    Else both lowerings must succeed (a CUDA-only refusal fails the test) and, with ``run``, the CPU program's
    floating outputs are finite. Returns the CUDA program's text (None when refused).
    """
    with warnings.catch_warnings(), te_jax.train.fp8_state_updates():
        warnings.simplefilter("ignore", GemmEmulationWarning)  # MXFP8 / NVFP4 grouped GEMMs emulated on a GPU
        if refuses is not None:
            with pytest.raises(ValueError, match="^te_jax: ") as err:
                jax.jit(fn).trace(*args)
            assert refuses in str(err.value), str(err.value)
            return None
        traced = jax.jit(fn).trace(*args)
        on_cpu = traced.lower(lowering_platforms=("cpu",))
        try:
            on_cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
        except ValueError as e:  # the bug class: CPU takes it, CUDA refuses it
            pytest.fail(f"lowers for CPU but CUDA refuses it: {e}")
    if run:
        for leaf in jax.tree.leaves(on_cpu.compile()(*args)):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert bool(jnp.all(jnp.isfinite(leaf))), leaf
    return on_cuda


def _grad(loss, n: int):
    """``jax.grad`` of ``sum(loss(*args) ** 2)`` in its first ``n`` arguments: forward and backward."""
    return jax.grad(lambda *a: jnp.sum(jnp.square(loss(*a).astype(jnp.float32))), argnums=tuple(range(n)))


# ---- dense, layernorm_dense, layernorm_mlp -----------------------------------------------------------------

H, N, F = 40, 24, 24  # none a multiple of 16


def _dense_op(op: str, recipe):
    """``(f(x, weights, state) -> y, weights, state)`` of one functional op under ``recipe``."""
    gamma, beta, key = jnp.ones(H), jnp.zeros(H), jax.random.key(5)
    if op == "layernorm_mlp":
        q = MLPQuantizers.from_recipe(recipe)
        ws = (_rand(1, (H, 2 * F), 0.1), _rand(2, (F, H), 0.1))
        return (lambda x, w, s: te_jax.layernorm_mlp(x, gamma, beta, w[0], None, w[1], activation="swiglu",
                                                     quantizers=q, state=s, key=key)[0]), ws, q.init_state()
    q = DenseQuantizers.from_recipe(recipe)
    w = _rand(1, (H, N), 0.1)
    if op == "dense":
        return (lambda x, w, s: te_jax.dense(x, w, quantizers=q, state=s, key=key)[0]), w, q.init_state()
    return (lambda x, w, s: te_jax.layernorm_dense(x, gamma, beta, w, quantizers=q, state=s, key=key)[0]), w, \
        q.init_state()


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("op", ["dense", "layernorm_dense", "layernorm_mlp"])
def test_dense_ops_lower_for_cuda(op, recipe):
    """Rows, K and N off every tile, rank-1 and 0-row inputs: the GEMMs' operands are padded (te_jax.ops.gemm)."""
    f, w, state = _dense_op(op, RECIPES[recipe])
    for shape, run in (((1, 7, H), recipe in RUN_ON_CPU), ((H,), False), ((0, H), False)):
        _lowers_alike(_grad(f, 3), _rand(0, shape), w, state, run=run)


@pytest.mark.parametrize("recipe", list(BLOCK_VARIANTS))
def test_dense_takes_every_float8_block_variant_on_cuda(recipe):
    """cuBLASLt multiplies E5M2 and 128x128-blocked inputs and gradients, which the grouped kernels do not."""
    f, w, state = _dense_op("dense", BLOCK_VARIANTS[recipe])
    hlo = _lowers_alike(_grad(f, 3), _rand(0, (1, 7, H)), w, state)
    assert hlo.count("te_jax_gemm_fp8_block") >= 3


def test_dense_ops_lower_for_cuda_in_bfloat16():
    for op in ("dense", "layernorm_dense", "layernorm_mlp"):
        f, w, state = _dense_op(op, RECIPES["current"])
        w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), w)
        hlo = _lowers_alike(_grad(f, 3), _rand(0, (3, H), dtype=jnp.bfloat16), w, state, run=True)
        assert "te_jax_gemm_fp8" in hlo


@pytest.mark.parametrize("recipe", [*RECIPES, *BLOCK_VARIANTS])
def test_quantize_and_dequantize_lower_for_cuda(recipe):
    """Each role's quantizer, both copies, and their dequantization: one lowering rule for every platform."""
    r = _recipe(recipe)
    state = DenseQuantizers.from_recipe(r).init_state()
    for role in ("linear_input", "linear_weight", "linear_grad_output"):
        qz = r.quantizer(role)

        def roundtrip(x, qz=qz, st=state.get(role)):
            t = qz.quantize(x, st, rowwise=True, colwise=True, flatten_axis=1, key=jax.random.key(5))
            return te_jax.quantize.dequantize(t), te_jax.quantize.dequantize_colwise(t)

        for shape in ((7, 40), (1, 24), (0, 40)):
            _lowers_alike(roundtrip, _rand(0, shape), run=recipe in RUN_ON_CPU and shape == (7, 40))


# ---- the grouped ops ---------------------------------------------------------------------------------------

G = 3
SIZES = {"gaps": [7, 0, 9], "one_row": [0, 1, 0], "none": [0, 0, 0]}  # an empty group, sum < M, no row at all
ROWS = {"gaps": 20, "one_row": 1, "none": 0}


def _features(recipe: str, odd: tuple[int, int]) -> list[tuple[int, int]]:
    """The feature sizes a grouped case tries under ``recipe``: ``odd`` (off every tile; per-tensor FP8 pads it, the
    block modes refuse it), and 128 (every block mode's tile) for the block modes."""
    return [odd] * (recipe not in BLOCK_VARIANTS) + [(128, 128)] * (recipe in BLOCKED or recipe in BLOCK_VARIANTS)


def _expected(recipe: str, dims: tuple[int, ...], rows: int = 0) -> str | None:
    """The refusal a grouped op under ``recipe`` owes on every platform for feature sizes ``dims`` and ``rows``
    rows of activations, or None."""
    if recipe in BLOCK_VARIANTS:
        if any(d % 128 for d in dims):
            return WHOLE_BLOCKS
        return ROWS_OF_128 if recipe in TWO_D_LEFT and rows % 128 else None
    if recipe in BLOCKED and any(d % BLOCKED[recipe] for d in dims):
        return WHOLE_BLOCKS
    return None


def _recipe(name: str):
    return RECIPES[name] if name in RECIPES else BLOCK_VARIANTS[name]


def _grouped_dense(recipe, k: int, n: int, dtype=jnp.float32):
    q = DenseQuantizers.from_recipe(recipe)

    def f(x, w, b, state, sizes):
        return te_jax.grouped_dense(x, w, sizes, b, quantizers=q, state=state, key=jax.random.key(5))[0]

    return f, (_rand(1, (G, k, n), 0.1, dtype), _rand(2, (G, n), 0.1, dtype), init_state(q, G))


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("recipe", [*RECIPES, *BLOCK_VARIANTS])
def test_grouped_dense_lowers_for_cuda(recipe, sizes):
    """K = 24, N = 40 (per-tensor FP8: zero padded to 16 on every platform) and K = N = 128 (every block mode's
    tile), with an empty group, rows past the groups, one row or none."""
    m, gs = ROWS[sizes], jnp.asarray(SIZES[sizes], jnp.int32)
    for k, n in _features(recipe, (24, 40)):
        f, (w, b, state) = _grouped_dense(_recipe(recipe), k, n)
        refuses = _expected(recipe, (k, n), m)
        hlo = _lowers_alike(_grad(lambda x, w, b, s: f(x, w, b, s, gs), 4), _rand(0, (m, k)), w, b, state,
                            refuses=refuses, run=sizes == "gaps" and recipe in RUN_ON_CPU)
        if refuses is None and m:
            assert "te_jax_grouped_gemm" in hlo


def test_grouped_dense_padded_per_tensor_path_matches_the_loop():
    """K = 24, N = 40 under current scaling (zero padded to 48 x 48 inside) against the float32 per-group loop: y
    and every gradient, in the callers' shapes, within E4M3 / E5M2 rounding."""
    k, n, gs = 24, 40, jnp.asarray(SIZES["gaps"], jnp.int32)
    f, (w, b, state) = _grouped_dense(RECIPES["current"], k, n)
    x = _rand(0, (ROWS["gaps"], k))

    def loop(x, w, b):
        group = jnp.repeat(jnp.arange(G), jnp.asarray(SIZES["gaps"]), total_repeat_length=ROWS["gaps"])
        rows = jnp.arange(ROWS["gaps"]) < sum(SIZES["gaps"])
        y = jnp.einsum("mk,mkn->mn", x, w[group], precision=jax.lax.Precision.HIGHEST) + b[group]
        return jnp.where(rows[:, None], y, 0.0)

    got = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a, state, gs) * x[:, :1]), argnums=(0, 1, 2)))(x, w, b)
    want = jax.value_and_grad(lambda *a: jnp.sum(loop(*a) * x[:, :1]), argnums=(0, 1, 2))(x, w, b)
    for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == v.shape
        assert float(jnp.linalg.norm(g - v) / jnp.linalg.norm(v)) < 0.08


def test_grouped_dense_bfloat16_high_precision_lowers_for_cuda():
    """No recipe, bfloat16: the bfloat16 grouped kernel on CUDA where K and N are multiples of 8, XLA's ragged dot
    elsewhere; both lower."""
    gs = jnp.asarray(SIZES["gaps"], jnp.int32)
    for (k, n), kernel in (((24, 40), True), ((12, 20), False)):
        f, (w, b, state) = _grouped_dense(None, k, n, jnp.bfloat16)
        hlo = _lowers_alike(lambda x, w, b: f(x, w, b, state, gs), _rand(0, (20, k), dtype=jnp.bfloat16), w, b,
                            run=True)
        assert ("te_jax_grouped_gemm_bf16" in hlo) == kernel


@pytest.mark.parametrize("recipe", [*RECIPES, *BLOCK_VARIANTS])
def test_grouped_mlp_lowers_for_cuda(recipe):
    """The experts' FFN (swiglu: each half of wi's width padded) in the aligned row layout, H = 40, F = 24 and
    H = F = 128."""
    r = _recipe(recipe)
    q = MLPQuantizers.from_recipe(r)
    align = math.lcm(span_alignment(q.wi), span_alignment(q.wo))
    gs = jnp.asarray(SIZES["gaps"], jnp.int32)
    for h, f in _features(recipe, (40, 24)):
        def mlp(x, wi, wo, bi, bo, state):
            return te_jax.grouped_mlp(x, wi, wo, gs, bi, bo, activation="swiglu", quantizers=q, state=state,
                                      key=jax.random.key(5), group_align=align)[0]

        args = (_rand(0, (G * max(align, 16), h)), _rand(1, (G, h, 2 * f), 0.1), _rand(2, (G, f, h), 0.1),
                _rand(3, (G, 2 * f), 0.1), _rand(4, (G, h), 0.1), q.init_state(num_groups=G))
        refuses = _expected(recipe, (h, f), args[0].shape[0])
        hlo = _lowers_alike(_grad(mlp, 5), *args, refuses=refuses, run=recipe in RUN_ON_CPU)
        if refuses is None:
            assert "te_jax_grouped_gemm" in hlo


@pytest.mark.parametrize("recipe", [*RECIPES, *BLOCK_VARIANTS])
def test_ragged_dot_lowers_for_cuda(recipe):
    """te_jax.ragged_dot zero pads K and N to every mode's tile: every recipe lowers but the 128x128 activation or
    gradient blocks at 20 rows, refused on every platform."""
    q = DenseQuantizers.from_recipe(_recipe(recipe))
    state, gs = init_state(q, G), jnp.asarray(SIZES["gaps"], jnp.int32)

    def f(x, w, state):
        return te_jax.ragged_dot(x, w, gs, quantizers=q, state=state, key=jax.random.key(5))

    _lowers_alike(_grad(f, 3), _rand(0, (20, 24)), _rand(1, (G, 24, 40), 0.1), state,
                  refuses=_expected(recipe, (128, 128), 20), run=recipe in RUN_ON_CPU)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_einsum_with_batch_axes_lowers_for_cuda(recipe):
    """dot_general's batched route runs the grouped GEMM: per-tensor pads, the block modes take whole blocks."""
    from te_jax.core.dot_general import einsum  # noqa: PLC0415

    q = DenseQuantizers.from_recipe(RECIPES[recipe])
    for d, f in _features(recipe, (8, 6)):
        state = q.init_state(num_groups=4)

        def fn(x, w, state):
            return einsum("bhd,hdf->bhf", x, w, quantizers=q, state=state, key=jax.random.key(5))[0]

        refuses = _expected(recipe, (d, f))
        _lowers_alike(_grad(fn, 3), _rand(0, (3, 4, d)), _rand(1, (4, d, f), 0.1), state, refuses=refuses,
                      run=recipe in RUN_ON_CPU)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_products_with_a_weight_vector_lower_for_cuda(recipe):
    """A weight with no free axis (dot_general gives it one output column): a dot product of two vectors and a
    matrix-vector product on the dense GEMM, a batch of them on the grouped GEMM (whole blocks refused)."""
    from te_jax.core.dot_general import dot_general  # noqa: PLC0415

    q = DenseQuantizers.from_recipe(RECIPES[recipe])
    cases = (((128,), (128,), (((0,), (0,)), ((), ())), None), ((16, 128), (128,), (((1,), (0,)), ((), ())), None),
             ((3, 16, 128), (3, 128), (((2,), (1,)), ((0,), (0,))), _expected(recipe, (128, 1))))
    for a, b, dn, refuses in cases:
        state = q.init_state(num_groups=a[0]) if dn[1][0] else q.init_state()

        def fn(x, w, state, dn=dn):
            return dot_general(x, w, dn, quantizers=q, state=state, key=jax.random.key(5))[0]

        _lowers_alike(_grad(fn, 2), _rand(0, a), _rand(1, b, 0.1), state, refuses=refuses, run=recipe in RUN_ON_CPU)


@pytest.mark.parametrize("recipe", list(BLOCK_VARIANTS))
def test_float8_block_layouts_without_a_kernel_run_the_emulation_on_cuda(recipe):
    """HYBRID (E5M2 gradients) and 128x128 activation or gradient blocks: the grouped GEMMs the sm_90 kernels do
    not cover lower to the emulation on CUDA with a GemmEmulationWarning naming what the kernels take; the others
    still run the kernels, and the CPU result is that of the grouped ops (finite, in the callers' shapes)."""
    f, (w, b, state) = _grouped_dense(BLOCK_VARIANTS[recipe], 128, 128)
    gs, x = jnp.asarray([100, 0, 156], jnp.int32), _rand(0, (256, 128))  # whole 128-row blocks, an empty group
    step = jax.jit(_grad(lambda x, w, b, s: f(x, w, b, s, gs), 4))
    with te_jax.train.fp8_state_updates():
        traced = step.trace(x, w, b, state)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", GemmEmulationWarning)
        hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    said = [str(w.message) for w in seen if issubclass(w.category, GemmEmulationWarning)]
    assert said and all("Float8 block GEMMs" in m and "emulation" in m for m in said), said
    kernels = hlo.count("te_jax_grouped_gemm_fp8_block")
    assert 1 <= kernels < 3, f"{recipe}: {kernels} block kernel calls of the three GEMMs"
    with te_jax.train.fp8_state_updates():
        grads = step(x, w, b, state)
    assert [g.shape for g in grads[:3]] == [x.shape, w.shape, b.shape]
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads[:3])


# ---- layers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8", "block_hybrid"])
def test_linen_moe_lowers_for_cuda(recipe):
    """The MoE layer's step (routing, the grouped FFN, the state update) at H = 40, F = 24, and H = F = 128."""
    from te_jax.flax import MoE  # noqa: PLC0415

    r = _recipe(recipe)
    for h, f in _features(recipe, (40, 24)):
        model, x, refuses = MoE(num_experts=4, num_experts_per_tok=2, intermediate_dim=f), _rand(0, (2, 5, h)), \
            _expected(recipe, (h, f))
        with te_jax.autocast(enabled=refuses is None, recipe=r):  # a refused recipe keeps no state: init without
            variables = jax.jit(model.init)(jax.random.key(0), x)
        with te_jax.autocast(recipe=r):
            step = te_jax.train.grad(lambda v: jnp.sum(jnp.square(model.apply(v, x))))
            _lowers_alike(step, variables, refuses=refuses, run=recipe in RUN_ON_CPU)


def test_nnx_moe_and_einsum_lower_for_cuda():
    """The NNX MoE and an Einsum with a batch letter under delayed scaling, K and N off the tile."""
    from flax import nnx  # noqa: PLC0415

    from te_jax import nnx as te_nnx  # noqa: PLC0415

    x = _rand(0, (2, 5, 40))
    with te_jax.autocast(recipe=RECIPES["delayed"]):
        for model, x in ((te_nnx.MoE(40, 4, 2, 24, rngs=nnx.Rngs(0)), x),
                         (te_nnx.Einsum("bhd,hdf->bhf", (4, 8, 6), rngs=nnx.Rngs(0)), _rand(0, (3, 4, 8)))):
            graph, state = nnx.split(model)

            def step(state, x):
                return te_nnx.value_and_grad(lambda m: jnp.sum(jnp.square(m(x))))(nnx.merge(graph, state))

            _lowers_alike(step, state, x, run=True)


@pytest.mark.parametrize("recipe", ["current", "nvfp4"])
def test_linen_transformer_layer_lowers_for_cuda(recipe):
    """A TransformerLayer (fused QKV, attention, output projection, LayerNormMLP) with hidden 40, five heads of 8,
    intermediate 24 and 7 tokens."""
    from te_jax.flax import TransformerLayer  # noqa: PLC0415

    model = TransformerLayer(num_attention_heads=5, intermediate_dim=24)
    x = _rand(0, (1, 7, 40))
    with te_jax.autocast(recipe=RECIPES[recipe]):
        variables = jax.jit(model.init)(jax.random.key(0), x)
        loss = lambda v: jnp.sum(jnp.square(model.apply(v, x, rngs={"quantize": jax.random.key(5)})))  # noqa: E731
        _lowers_alike(te_jax.train.grad(loss), variables, run=recipe in RUN_ON_CPU)


# ---- a GEMM split over a mesh ------------------------------------------------------------------------------

SHARDED = {  # name -> (M, K, N, x spec, w spec): each split leaves blocks of 8 on a device of two (mxfp8 splits
    # no K of 16: one 32-wide block)
    "rows": (16, 32, 32, ("d", None), (None, None)),
    "contraction": (16, 16, 32, (None, "d"), ("d", None)),
    "columns": (32, 32, 16, (None, None), (None, "d")),
}


def _sharded_child() -> None:
    """Runs in a subprocess with two CPU devices: each case's step, with every GEMM block the partition rule runs
    checked by the CUDA lowering's own rule, and its result against the unsharded one."""
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    from te_jax.ops import gemm_call  # noqa: PLC0415

    blocks = []
    unchecked = gemm_call._ffi_call

    def checked(lay, *args):
        a, b = args[lay.roles.index("a")], args[lay.roles.index("b")]
        try:
            gemm_call._check_cuda_shapes(lay, a.shape, b.shape)
            blocks.append(None)
        except ValueError as err:
            blocks.append(str(err))
        return unchecked(lay, *args)

    gemm_call._ffi_call = checked  # what each device's partitioned body calls
    mesh = jax.make_mesh((2,), ("d",))
    for name, (m, k, n, xs, ws) in SHARDED.items():
        for recipe in ("current", "mxfp8"):
            q = DenseQuantizers.from_recipe(RECIPES[recipe])
            step = jax.jit(_grad(lambda x, w: te_jax.dense(x, w, quantizers=q)[0], 2))
            x, w = _rand(0, (m, k)), _rand(1, (k, n), 0.1)
            want = step(x, w)
            del blocks[:]
            got = step(jax.device_put(x, NamedSharding(mesh, P(*xs))), jax.device_put(w, NamedSharding(mesh, P(*ws))))
            errors = [float(jnp.max(jnp.abs(g - v)) / jnp.max(jnp.abs(v))) for g, v in zip(got, want)]
            print(json.dumps({"case": f"{name}/{recipe}", "blocks": blocks, "errors": errors}), flush=True)


def test_sharded_gemm_blocks_lower_for_cuda():
    """A GEMM whose M, K or N a mesh splits into blocks of 8: each device's block is padded (on every platform),
    so the CUDA lowering takes it; the result is the unsharded one up to the order of a split contraction's sum."""
    from qtest_util import run_on_fake_devices  # noqa: PLC0415

    proc = run_on_fake_devices([__file__], devices=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 2 * len(SHARDED), proc.stdout
    for case in cases:
        assert case["blocks"] and all(b is None for b in case["blocks"]), case
        assert max(case["errors"]) < 1e-5, case


if __name__ == "__main__":
    assert len(sys.argv) == 1 and jax.device_count() == 2, jax.devices()
    with jax.default_device(jax.devices("cpu")[0]):
        _sharded_child()
