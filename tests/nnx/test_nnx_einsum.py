"""``te_jax.nnx.Einsum``: flax.nnx.Einsum's arguments, parameters and (without autocast) result; under every
recipe the quantized product within the FP8 bounds; delayed-scaling state step by step as ``te_jax.nnx.Linear``'s;
batch axes with one weight history per batch element; flax's checks as te_jax errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_jax
from te_jax import nnx as te_nnx
from te_jax import recipe as R
from qtest_util import BUILTIN_RECIPES, normal, pure, tree_same_bits

DELAYED = BUILTIN_RECIPES["delayed"]
RECIPES = BUILTIN_RECIPES


CASES = [  # (equation, kernel_shape, bias_shape, input shape, extra kwargs)
    ("btd,dnh->btnh", (16, 2, 8), (2, 8), (2, 5, 16), {}),  # Gemma's q projection
    ("btnh,nhd->btd", (2, 8, 16), (16,), (2, 5, 2, 8), {}),  # its output projection
    ("...d,df->...f", (16, 8), None, (3, 4, 16), dict(kernel_init=nnx.initializers.normal(0.3))),
    ("btd,dnh->bnth", (16, 2, 8), (2, 8), (2, 5, 16), dict(dtype=jnp.bfloat16)),  # the output transposed
    ("ecd,edf->ecf", (3, 16, 8), (3, 8), (3, 5, 16), dict(param_dtype=jnp.bfloat16)),  # a batch axis
    (" b t d , d f -> b t f ", (16, 8), (8,), (2, 5, 16), dict(preferred_element_type=jnp.float32)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0].replace(" ", "") for c in CASES])
def test_einsum_is_flax_nnx(case):
    equation, kernel_shape, bias_shape, shape, kw = case
    x = normal(0, shape, 2.0)
    ref = nnx.Einsum(equation, kernel_shape, bias_shape, rngs=nnx.Rngs(4), **kw)
    ours = te_nnx.Einsum(equation, kernel_shape, bias_shape, rngs=nnx.Rngs(4), **kw)
    assert tree_same_bits(pure(nnx.state(ours)), pure(nnx.state(ref)))
    assert ours.einsum_str == ref.einsum_str and ours.kernel.get_metadata() == ref.kernel.get_metadata()
    assert tree_same_bits(ours(x), ref(x))


def test_einsum_takes_flax_metadata_and_a_call_time_equation():
    kw = dict(kernel_metadata={"tag": "query"})
    ref = nnx.Einsum("btd,dnh->btnh", (16, 2, 8), (2, 8), rngs=nnx.Rngs(1), **kw)
    ours = te_nnx.Einsum("btd,dnh->btnh", (16, 2, 8), (2, 8), rngs=nnx.Rngs(1), **kw)
    assert ours.kernel.get_metadata()["tag"] == "query"
    x = normal(1, (2, 3, 16))
    assert tree_same_bits(ours(x, "btd,dnh->bnth"), ref(x, "btd,dnh->bnth"))
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        got = ours(x, "btd,dnh->bnth")
    assert got.shape == (2, 2, 3, 8) and float(jnp.max(jnp.abs(got - ref(x, "btd,dnh->bnth")))) < 0.2


@pytest.mark.parametrize("equation,match", [("btd,dnh", "must be explicit"), ("a,b,c->a", "exactly two operands")])
def test_flax_equation_checks_are_te_jax_errors(equation, match):
    with pytest.raises(ValueError, match=f"te_jax: Einsum.*{match}"):
        te_nnx.Einsum(equation, (2, 2), rngs=nnx.Rngs(0))


def test_a_custom_einsum_op_is_honoured_outside_autocast_only():
    ours = te_nnx.Einsum("bd,df->bf", (4, 4), einsum_op=lambda *a, **k: 2 * jnp.einsum(*a, **k), rngs=nnx.Rngs(0))
    ref = nnx.Einsum("bd,df->bf", (4, 4), einsum_op=lambda *a, **k: 2 * jnp.einsum(*a, **k), rngs=nnx.Rngs(0))
    x = normal(2, (3, 4))
    assert tree_same_bits(ours(x), ref(x))
    with te_jax.autocast(recipe=DELAYED), pytest.raises(ValueError, match="custom einsum_op"):
        ours(x)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_quantizes_the_einsum(recipe):
    rec = RECIPES[recipe]
    x = normal(3, (1, 128, 128))
    with te_jax.autocast(recipe=rec):
        ours = te_nnx.Einsum("btd,dnh->btnh", (128, 2, 64), (2, 64), rngs=nnx.Rngs(0, quantize=1))
    ref = nnx.Einsum("btd,dnh->btnh", (128, 2, 64), (2, 64), rngs=nnx.Rngs(0))
    assert bool(pure(nnx.state(ours, te_nnx.FP8Meta))) == (recipe == "delayed")

    @nnx.jit
    def run(model):
        with te_jax.autocast(recipe=rec):
            return te_nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    (loss, g), (want_loss, want_g) = run(ours), nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(ref)
    if recipe == "delayed":  # the first step quantized with the initial scales: the second with the amaxes
        loss, g = run(ours)
    error = abs(float(loss) / float(want_loss) - 1)
    g, want_g = g["kernel"][...], want_g["kernel"][...]
    grad_error = float(jnp.linalg.norm(g - want_g) / jnp.linalg.norm(want_g))
    assert 0 < error < (0.1 if recipe == "nvfp4" else 0.02), error
    assert 0 < grad_error < (0.3 if recipe == "nvfp4" else 0.1), grad_error


def test_delayed_state_steps_exactly_as_te_jax_nnx_linear():
    x, y = normal(4, (2, 16, 32)), normal(5, (2, 16, 24))
    with te_jax.autocast(recipe=DELAYED):
        einsum = te_nnx.Einsum("btd,df->btf", (32, 24), rngs=nnx.Rngs(0))
        linear = te_nnx.Linear(32, 24, use_bias=False, rngs=nnx.Rngs(0))
    assert tree_same_bits(pure(nnx.state(einsum)), pure(nnx.state(linear)))

    @nnx.jit
    def step(model, optimizer, x):
        with te_jax.autocast(recipe=DELAYED):
            loss, grads = te_nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in (einsum, linear)]
    for i in range(3):
        xi = x * (1.0 + i)
        losses = [step(m, o, xi) for m, o in zip((einsum, linear), opts)]
        assert tree_same_bits(losses[0], losses[1])
        assert tree_same_bits(pure(nnx.state(einsum)), pure(nnx.state(linear)))


def test_batch_axes_keep_one_weight_history_per_batch_element():
    x = normal(6, (3, 32, 16))
    with te_jax.autocast(recipe=DELAYED):
        ours = te_nnx.Einsum("ecd,edf->ecf", (3, 16, 8), rngs=nnx.Rngs(0))  # N = 8: padded to 16 (the CUDA tile)
    assert ours.batch_size == 3
    weight = pure(nnx.state(ours, te_nnx.FP8Meta))["fp8_meta"]["linear_weight"]
    shapes = weight["amax_history"].shape, weight["scale"].shape
    assert shapes == ((3, 4), (3, 1)), f"weight amax history and scale shapes {shapes}"

    def loss(model):
        return jnp.mean(model(x) ** 2)

    @nnx.jit
    def step(model):
        with te_jax.autocast(recipe=DELAYED):
            return te_nnx.value_and_grad(loss)(model)

    # The step lowered for CUDA (on any machine: what XLA:GPU compiles) passes the grouped GEMM's CUDA checks.
    graph, state = nnx.split(ours)

    def functional_step(state):
        with te_jax.autocast(recipe=DELAYED):
            return te_nnx.value_and_grad(loss)(nnx.merge(graph, state))

    hlo = jax.jit(functional_step).trace(state).lower(lowering_platforms=("cuda",)).as_text()
    calls = hlo.count("custom_call @te_jax_grouped_gemm_fp8(")
    assert calls >= 2, f"{calls} grouped GEMM calls in the CUDA program (forward and wgrad expected)"
    step(ours)
    weight = pure(nnx.state(ours, te_nnx.FP8Meta))["fp8_meta"]["linear_weight"]
    np.testing.assert_array_equal(weight["amax_history"][:, -1], jnp.max(jnp.abs(ours.kernel[...]), axis=(1, 2)),
                                  err_msg="the new weight amax of each batch element (got, want)")
    with te_jax.autocast(recipe=DELAYED), pytest.raises(ValueError, match=r"Einsum: .*no batch axis.*batch axes of 3"):
        ours(x.reshape(3 * 32, 16), "cd,edf->ecf")  # a call-time equation without the batch axis
