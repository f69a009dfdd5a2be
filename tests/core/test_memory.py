"""What the functional ops keep for their backward (issue 41): ``recompute_norm_act`` and the remat policies.

``recompute_norm_act=True`` must give the same bits as the plain op (forward and gradients) while keeping
neither the norm's output nor the activation's (FP8 copies under a recipe, the compute dtype without); the
policies keep what their names say. The two are two programs: where XLA may run their FP8 GEMMs with other
cuBLASLt algorithms (a GPU), the recomputed copies are still the same bits but the GEMMs' results agree only
within their error bounds (``test_recompute_without_norm_keeps_the_input_not_its_fp8_copy`` checks those).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from qtest_util import assert_same_bits

import te_jax
from te_jax import recipe as R
from te_jax.core import (MLPQuantizers, NORM_ACT_OUTPUT, PRE_ACTIVATION, QUANTIZED, DenseQuantizers,
                         offload_fp8_policy, recompute_norm_act_policy, save_fp8_and_pre_activation_policy,
                         save_fp8_policy, save_nothing_policy)

M, H, F = 128, 128, 256  # Float8 block scaling: blocks of 128 tile both norm and activation outputs
RECIPES = {"bf16": None, "current": R.Float8CurrentScaling(), "block": R.Float8BlockScaling()}


def _inputs(seed: int, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.key(seed), 5)
    x = (jax.random.normal(k[0], (M, H)) * 3).astype(dtype)
    gamma = (1 + 0.1 * jax.random.normal(k[1], (H,))).astype(dtype)
    beta = (0.1 * jax.random.normal(k[2], (H,))).astype(dtype)
    w1 = (jax.random.normal(k[3], (H, F)) * H**-0.5).astype(dtype)
    w2 = (jax.random.normal(k[4], (F, H)) * F**-0.5).astype(dtype)
    return x, gamma, beta, w1, w2


def _mlp(recipe, recompute: bool):
    q = None if recipe is None else MLPQuantizers.from_recipe(recipe)

    def loss(x, gamma, beta, w1, w2):
        y, _ = te_jax.layernorm_mlp(x, gamma, beta, w1, None, w2, activation="gelu", quantizers=q,
                                    recompute_norm_act=recompute)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))
    return loss


def _layernorm_dense(recipe, recompute: bool):
    q = None if recipe is None else DenseQuantizers.from_recipe(recipe)

    def loss(x, gamma, beta, w1, w2):
        del w2
        y, _ = te_jax.layernorm_dense(x, gamma, beta, w1, quantizers=q, recompute_norm_act=recompute)
        return jnp.sum(y.astype(jnp.float32) * jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))
    return loss


def _saved_bytes(loss, args, itemsize: int | None = None) -> int:
    """Bytes of what ``loss``'s backward keeps that is not one of its arguments (activations), of residuals
    with ``itemsize`` bytes an element only when given."""
    from jax._src.ad_checkpoint import saved_residuals

    return sum(a.size * a.dtype.itemsize for a, src in saved_residuals(loss, *args)
               if "from the argument" not in src and itemsize in (None, a.dtype.itemsize))


@pytest.mark.parametrize("op", ["mlp", "layernorm_dense"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recompute_norm_act_same_bits_and_keeps_less(op, recipe):
    make = _mlp if op == "mlp" else _layernorm_dense
    args = _inputs(1)
    args = (args[0].at[3].set(0), *args[1:])  # a zero row: rsigma of a constant row
    plain, recomputed = make(RECIPES[recipe], False), make(RECIPES[recipe], True)
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4)))  # noqa: E731
    (l0, g0), (l1, g1) = grad(plain)(*args), grad(recomputed)(*args)
    assert np.isfinite(float(l0))
    assert_same_bits(l1, l0, "loss")
    for name, a, b in zip(("x", "gamma", "beta", "w1", "w2"), g1, g0):
        assert_same_bits(a, b, f"d{name}")
    # What is no longer kept: the norm's output [M, H] (and the activation's [M, F]), 1 byte an element as FP8
    # (plus block scales), 2 bytes in bf16.
    dropped = (M * H + (M * F if op == "mlp" else 0)) * (2 if recipe == "bf16" else 1)
    kept, kept_recomputed = _saved_bytes(plain, args), _saved_bytes(recomputed, args)
    assert kept - kept_recomputed >= dropped, (kept, kept_recomputed, dropped)


def test_recompute_norm_act_on_empty_and_rank_3_inputs():
    q = MLPQuantizers.from_recipe(R.Float8CurrentScaling())
    x, gamma, beta, w1, w2 = _inputs(2)
    for xs in (x[:0], x.reshape(4, M // 4, H)):
        f = lambda x, w1: te_jax.layernorm_mlp(x, gamma, beta, w1, None, w2, quantizers=q,  # noqa: E731
                                               recompute_norm_act=True)[0].astype(jnp.float32).sum()
        g = lambda x, w1: te_jax.layernorm_mlp(x, gamma, beta, w1, None, w2, quantizers=q)[0]  # noqa: E731
        val, (dx, dw1) = jax.value_and_grad(f, argnums=(0, 1))(xs, w1)
        assert dx.shape == xs.shape and dw1.shape == w1.shape
        assert_same_bits(val, g(xs, w1).astype(jnp.float32).sum(), "loss")


def _named_residuals(policy, fn, *args) -> set[str]:
    """The checkpoint names of what ``jax.checkpoint(fn, policy=policy)`` keeps for its backward."""
    from jax._src.ad_checkpoint import saved_residuals

    return {src.split("named '")[1].split("'")[0] for _, src in saved_residuals(jax.checkpoint(fn, policy=policy),
                                                                              *args) if "named '" in src}


def test_policies_keep_what_their_names_say():
    def block(x):
        q = checkpoint_name(x * 2, QUANTIZED)
        ln = checkpoint_name(jnp.sin(q), NORM_ACT_OUTPUT)
        pre = checkpoint_name(jnp.cos(ln) * x, PRE_ACTIVATION)
        return jnp.sum(jnp.tanh(pre) * ln)

    x = jnp.linspace(-2, 2, 16)
    assert _named_residuals(save_fp8_policy, block, x) == {QUANTIZED, NORM_ACT_OUTPUT}
    assert _named_residuals(save_fp8_and_pre_activation_policy, block, x) == {QUANTIZED, NORM_ACT_OUTPUT,
                                                                              PRE_ACTIVATION}
    assert _named_residuals(recompute_norm_act_policy, block, x) == {QUANTIZED, PRE_ACTIVATION}
    assert _named_residuals(save_nothing_policy, block, x) == set()
    offload = offload_fp8_policy()
    assert offload is not offload_fp8_policy("pinned_host") and callable(offload)


def test_transformer_layer_recompute_norm_act_same_bits_and_keeps_less():
    """te_jax.flax.TransformerLayer passes the option to both norms (attention's qkv, the MLP) and the MLP's
    activation: the same loss and gradients, three fewer FP8 copies kept."""
    import flax.linen as nn

    from te_jax import flax as tf

    def layer(recompute: bool) -> nn.Module:
        return tf.TransformerLayer(num_attention_heads=4, num_gqa_groups=2, intermediate_dim=256,
                                   dtype=jnp.bfloat16, recompute_norm_act=recompute)

    x = jax.random.normal(jax.random.key(7), (2, 64, 128), jnp.float32).astype(jnp.bfloat16)
    recipe = R.Float8CurrentScaling()
    with te_jax.autocast(recipe=recipe):
        v = jax.jit(layer(False).init)(jax.random.key(0), x)

    def loss_of(recompute: bool):
        def loss(v, x):
            with te_jax.autocast(recipe=recipe):
                return jnp.sum(layer(recompute).apply(v, x).astype(jnp.float32) ** 2)
        return loss

    (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(loss_of(r), argnums=(0, 1)))(v, x) for r in (False, True))
    assert np.isfinite(float(l0))
    assert_same_bits(l1, l0, "loss")
    jax.tree.map(lambda a, b: assert_same_bits(a, b, "gradient"), g1, g0)
    tokens = x.shape[0] * x.shape[1]
    dropped = tokens * (128 + 128 + 256)  # both norms' FP8 outputs and the activation's, 1 byte an element
    kept = _saved_bytes(loss_of(False), (v, x)) - _saved_bytes(loss_of(True), (v, x))
    assert kept >= dropped, (kept, dropped)


def test_recompute_norm_act_with_a_custom_dot_general_raises():
    x, gamma, beta, w1, w2 = _inputs(3)
    with pytest.raises(ValueError, match=r"^te_jax: layernorm_mlp: recompute_norm_act=True cannot be combined"):
        te_jax.layernorm_mlp(x, gamma, beta, w1, None, w2, dot_generals=(jax.lax.dot_general,) * 2,
                             recompute_norm_act=True)
    with pytest.raises(ValueError, match=r"^te_jax: layernorm_dense: recompute_norm_act=True cannot be combined"):
        te_jax.layernorm_dense(x, gamma, beta, w1, dot_general=jax.lax.dot_general, recompute_norm_act=True)
    y, _ = te_jax.layernorm_dense(x, gamma, beta, w1, dot_general=jax.lax.dot_general)  # without the option: fine
    assert y.shape == (M, F)
    # Without a norm the unquantized product keeps no copy to drop: the option is accepted (SelfAttention's
    # output projection under cuDNN with flax's FP8 as its dot_general).
    y0, _ = te_jax.layernorm_dense(x, None, None, w1, norm_type=None, dot_general=jax.lax.dot_general)
    y1, _ = te_jax.layernorm_dense(x, None, None, w1, norm_type=None, dot_general=jax.lax.dot_general,
                                   recompute_norm_act=True)
    assert_same_bits(y1, y0, "y")


# Two programs' bf16 GEMM outputs on a GPU (where each may run another cuBLASLt algorithm, see below).
BF16_ROUNDING = 2.0**-7  # one rounding to bfloat16, as tests/ops/test_gemm.py bounds it (twice the half-ulp)


def _gemm_tolerance(recipe: str, fast_accum: bool) -> float:
    """The CUDA FP8 GEMMs' error bound relative to the exact product's largest magnitude (tests/ops/test_gemm.py's
    ``_tol``, tested there at K = 4096; here K is at most 256): per-tensor FP8 1e-2 with fast accumulation and
    1e-3 with split accumulation; Float8 block scaling 1e-3 (its kernels promote every 128-long K block)."""
    if recipe == "block":
        return 1e-3
    return 1e-2 if fast_accum else 1e-3


def _two_programs_bound(out, tol: float) -> np.ndarray:
    """How far two programs' bf16 outputs of one GEMM on the same operands may be apart, from one of them.

    Each lies within ``BF16_ROUNDING * |exact| + tol * max|exact|`` of the exact product (test_gemm's bound for
    a bf16 output); ``|exact|`` is bounded from ``out``; the two are at most twice that apart.
    """
    out = np.abs(np.asarray(out, np.float64))
    scale = out.max() / (1 - BF16_ROUNDING - tol)
    exact = (out + tol * scale) / (1 - BF16_ROUNDING)
    return 2 * (BF16_ROUNDING * exact + tol * scale)


def _assert_within(got, want, bound, what: str) -> None:
    """``|got - want| <= bound`` elementwise, else an error saying how many elements are past it and by how much."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all() and np.isfinite(want).all(), f"{what}: not finite"
    diff = np.abs(got - want)
    over = diff > bound
    if over.any():
        i = np.unravel_index(np.argmax(diff / np.maximum(bound, np.finfo(np.float64).tiny)), diff.shape)
        raise AssertionError(f"{what}: {int(over.sum())} of {over.size} elements are apart by more than the bound "
                             f"(worst at {i}: {got[i]:.6g} vs {want[i]:.6g}, apart by {diff[i]:.3g}, bound "
                             f"{bound[i]:.3g}); {int((diff > 0).sum())} differ at all, by at most {diff.max():.3g}")


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_recompute_without_norm_keeps_the_input_not_its_fp8_copy(recipe):
    """layernorm_dense without a norm: recompute_norm_act keeps x and quantizes it again in the backward (the same
    bits), so where x's producer keeps x anyway (exp keeps its output here, as cuDNN's attention keeps its
    output), the FP8 copy [M, H] is no longer kept beside it.

    The two options compile to two programs. On a CPU they give the same bits (the twins' GEMMs sum in one
    order). On a GPU each program's FP8 GEMMs may run another cuBLASLt algorithm (te_jax's plan is keyed by
    the operands' alignment and the workspace left after aligning it, which XLA's buffer assignment of that
    program decides: docs/gemm_ffi.md, "Plans"): the GEMMs take the same operands (the forward's quantized
    copies, and the backward's recomputed copy, the same bits), so the forward's output and the gradients
    agree within two GEMM error bounds, and the loss within what its output's difference explains. Those
    bounds are checked on every backend (on a CPU, with nothing apart)."""
    q = DenseQuantizers.from_recipe(RECIPES[recipe])

    def loss_of(recompute: bool):
        def loss(x, w, weights):
            y, _ = te_jax.layernorm_dense(jnp.exp(x), None, None, w, norm_type=None, quantizers=q,
                                          recompute_norm_act=recompute)
            return jnp.sum(y.astype(jnp.float32) * weights), y
        return loss

    x, _, _, w, _ = _inputs(4)
    x = x.at[5].set(0).at[6, :7].set(-30.0)  # exp: a row of ones and values that round to zero in FP8
    weights = jnp.sin(jnp.arange(M * F, dtype=jnp.float32)).reshape(M, F)  # an argument: the same in both programs
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))  # noqa: E731
    ((l0, y0), (dx0, dw0)), ((l1, y1), (dx1, dw1)) = (grad(loss_of(r))(x, w, weights) for r in (False, True))
    assert np.isfinite(float(l0)), f"loss {float(l0)}"
    if jax.default_backend() == "cpu":
        for name, a, b in (("loss", l1, l0), ("y", y1, y0), ("dx", dx1, dx0), ("dw", dw1, dw0)):
            assert_same_bits(a, b, f"{recipe}: {name} with recompute_norm_act vs without")
    forward, backward = _gemm_tolerance(recipe, q.fast_accum is not False), _gemm_tolerance(recipe, False)
    where = f"{recipe}, {jax.default_backend()}: with recompute_norm_act vs without"
    _assert_within(y1, y0, _two_programs_bound(y0, forward), f"{where}: y (the forward GEMM)")
    # The loss is one float32 sum of y * weights: apart by what y's difference explains plus two summation orders.
    y0_, y1_ = np.asarray(y0, np.float64), np.asarray(y1, np.float64)
    c = np.abs(np.asarray(weights, np.float64))
    explained, orders = np.sum(np.abs(y1_ - y0_) * c), 2 * y0_.size * 2.0**-24 * np.sum(np.abs(y0_) * c)
    _assert_within(l1, l0, np.asarray(explained + orders), f"{where}: the loss")
    _assert_within(dw1, dw0, _two_programs_bound(dw0, backward), f"{where}: dw (the wgrad GEMM)")
    # dx = bf16(dgrad GEMM output * exp(x)), exp(x) the program's bf16 value (within 2^-7 of the exact one): the
    # GEMM's bound scaled by exp(x), plus one rounding each.
    e = np.exp(np.asarray(x, np.float64))
    dx0_ = np.abs(np.asarray(dx0, np.float64))
    dgrad = dx0_ / ((1 - BF16_ROUNDING) ** 2 * e)  # at least |the dgrad GEMM's output| in the first program
    apart = e * (1 + BF16_ROUNDING) * _two_programs_bound(dgrad, backward)
    _assert_within(dx1, dx0, apart + BF16_ROUNDING * (dx0_ * (1 + BF16_ROUNDING) + apart),
                   f"{where}: dx (the dgrad GEMM times exp(x))")
    loss_only = lambda recompute: lambda x, w: loss_of(recompute)(x, w, weights)[0]  # noqa: E731
    kept, kept_recomputed = _saved_bytes(loss_only(False), (x, w)), _saved_bytes(loss_only(True), (x, w))
    assert kept - kept_recomputed >= M * H, (f"{recipe}: recompute_norm_act keeps {kept_recomputed} bytes, without "
                                             f"it {kept}: {kept - kept_recomputed} fewer, not the FP8 copy's {M * H}")


def _keeps_its_output(q, k, v, *args, **kwargs):
    """Attention's memory under cuDNN (its backward keeps q, k, v and the output), not its values."""
    @jax.custom_vjp
    def attend(q, k, v):
        return (q * jnp.repeat(k + v, q.shape[2] // k.shape[2], axis=2)).astype(q.dtype)

    def fwd(q, k, v):
        o = attend(q, k, v)
        return o, (q, k, v, o)

    def bwd(res, do):
        q, k, v, o = res
        s = (do.astype(jnp.float32) * o.astype(jnp.float32)).astype(q.dtype)
        g = q.shape[2] // k.shape[2]
        dkv = s.reshape(*s.shape[:2], k.shape[2], g, s.shape[-1]).sum(3)
        return s * q, dkv * k, dkv * v

    attend.defvjp(fwd, bwd)
    return attend(q, k, v)


@pytest.mark.parametrize("api, recipe", [("linen", "current"), ("linen", "delayed"), ("nnx", "current")])
def test_attention_output_projection_keeps_no_fp8_copy_beside_cudnn_output(api, recipe, monkeypatch):
    """Under cuDNN's attention (which keeps its output) SelfAttention's output projection keeps no FP8 copy of that
    output: the same loss and gradients (delayed scaling's state update too) as under "xla", tokens x heads x
    head_dim bytes less kept."""
    import flax.linen as nn
    from flax import nnx

    from te_jax import flax as tf

    monkeypatch.setattr(jax.nn, "dot_product_attention", _keeps_its_output)
    x = jax.random.normal(jax.random.key(8), (2, 64, 128), jnp.float32).astype(jnp.bfloat16)
    recipe = {"current": R.Float8CurrentScaling(), "delayed": R.DelayedScaling()}[recipe]
    heads, head_dim = 4, 32
    if api == "linen":
        def attn(implementation: str) -> nn.Module:
            return tf.SelfAttention(heads, 2, head_dim, implementation=implementation, dtype=jnp.bfloat16)

        with te_jax.autocast(recipe=recipe):
            v = jax.jit(attn("xla").init)(jax.random.key(0), x)

        def loss_of(implementation: str):
            def loss(v, x):
                with te_jax.autocast(recipe=recipe):
                    return jnp.sum(attn(implementation).apply(v, x).astype(jnp.float32) ** 2)
            return loss
    else:
        def build(implementation: str):
            return te_jax.nnx.SelfAttention(128, heads, 2, head_dim, implementation=implementation,
                                            dtype=jnp.bfloat16, rngs=nnx.Rngs(0))

        graphdef, v = nnx.split(build("xla"))

        def loss_of(implementation: str):
            gd = nnx.split(build(implementation))[0]

            def loss(v, x):
                with te_jax.autocast(recipe=recipe):
                    return jnp.sum(nnx.merge(gd, v)(x).astype(jnp.float32) ** 2)
            return loss

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))  # noqa: E731
    with te_jax.train.fp8_state_updates():  # delayed scaling: the gradient of its state is the state update
        (l0, g0), (l1, g1) = grad(loss_of("xla"))(v, x), grad(loss_of("cudnn"))(v, x)
    assert np.isfinite(float(l0))
    assert_same_bits(l1, l0, "loss")
    jax.tree.map(lambda a, b: assert_same_bits(a, b, "gradient"), g1, g0)
    # The projection keeps a reshape of o instead, which XLA keeps in o's buffer (a bitcast) but autodiff's
    # residual list counts apart: count the FP8 residuals only.
    dropped = x.shape[0] * x.shape[1] * heads * head_dim  # the attention output's FP8 copy, 1 byte an element
    kept = _saved_bytes(loss_of("xla"), (v, x), itemsize=1) - _saved_bytes(loss_of("cudnn"), (v, x), itemsize=1)
    assert kept >= dropped, (kept, dropped)


def test_attention_under_cudnn_takes_flax_fp8_as_its_dot_general(monkeypatch):
    """The GPT example's flax-fp8 baseline: SelfAttention with flax's FP8 dot_general under cuDNN's attention
    (te_jax's autocast off) runs, and computes what it computes under "xla"."""
    import flax.linen as nn

    from te_jax import flax as tf

    monkeypatch.setattr(jax.nn, "dot_product_attention", _keeps_its_output)
    x = jax.random.normal(jax.random.key(9), (2, 32, 64), jnp.float32).astype(jnp.bfloat16)

    def attn(implementation: str) -> nn.Module:
        return tf.SelfAttention(4, 2, 16, implementation=implementation, dtype=jnp.bfloat16,
                                dot_general_cls=nn.Fp8DirectDotGeneralOp)

    v = attn("xla").init(jax.random.key(0), x)
    assert_same_bits(attn("cudnn").apply(v, x), attn("xla").apply(v, x), "y")
