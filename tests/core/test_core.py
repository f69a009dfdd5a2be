"""The functional core shared by te_jax.dense, layernorm_dense and layernorm_mlp: one error per mistake,
one return shape, statistics carried in the state."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import recipe as R
from te_jax.core import STATS, QUANTIZED
from te_jax.inspect import STAT_NAMES
from te_jax.quantize import NVFP4Quantizer

H = 64
_PREFIX = re.compile(r"^te_jax: (dense|layernorm_dense|layernorm_mlp( \(wi\))?): ")


def _ops(recipe, state_of=lambda q: q.init_state()):
    """The three ops as ``f(x, key) -> (y, new_state)`` on ``x [..., H]``, each with its quantizers from ``recipe``."""
    keys = jax.random.split(jax.random.key(3), 3)
    w = jax.random.normal(keys[0], (H, H)) * 0.1
    gamma, beta = jnp.ones(H), jnp.zeros(H)
    dq = recipe if isinstance(recipe, te_jax.core.DenseQuantizers) else te_jax.core.DenseQuantizers.from_recipe(recipe)
    mq = te_jax.core.MLPQuantizers(dq, dq)
    return {
        "dense": lambda x, key=None, **kw: te_jax.dense(x, w, quantizers=dq, state=state_of(dq), key=key, **kw),
        "layernorm_dense": lambda x, key=None, **kw: te_jax.layernorm_dense(
            x, gamma, beta, w, quantizers=dq, state=state_of(dq), key=key, **kw),
        "layernorm_mlp": lambda x, key=None, **kw: te_jax.layernorm_mlp(
            x, gamma, beta, w, None, w, quantizers=mq, state=state_of(mq), key=key, **kw),
    }


def _messages(ops, call) -> dict[str, str]:
    """The error each op raises from ``call(op)``, without its ``te_jax: <op>:`` prefix."""
    out = {}
    for name, op in ops.items():
        with pytest.raises((ValueError, TypeError)) as err:
            call(op)
        msg = str(err.value)
        assert _PREFIX.match(msg), msg
        out[name] = _PREFIX.sub("", msg)
    return out


def _same(messages: dict[str, str], *needles: str) -> None:
    first = next(iter(messages.values()))
    assert all(m == first for m in messages.values()), messages
    for needle in needles:
        assert needle in first, first


def test_same_missing_state_same_error():
    x = jax.random.normal(jax.random.key(0), (32, H))
    _same(_messages(_ops(R.DelayedScaling(), state_of=lambda q: None), lambda op: op(x)),
          "no state for the stateful quantizers of ['linear_input', 'linear_weight', 'linear_grad_output']")


def test_same_missing_key_same_error():
    x = jax.random.normal(jax.random.key(0), (32, H))
    ops = _ops(te_jax.core.DenseQuantizers(grad_output=NVFP4Quantizer(stochastic_rounding=True)))
    for op in ops.values():
        op(x)  # the forward rounds nothing stochastically: no key needed
    _same(_messages(ops, lambda op: jax.grad(lambda x: jnp.sum(op(x)[0]))(x)),
          "the quantizers of ['linear_grad_output'] round stochastically and need key=")


def test_same_bad_dtype_same_error():
    x = jnp.ones((32, H), jnp.int32)
    _same(_messages(_ops(R.Float8CurrentScaling()), lambda op: op(x)), "x must be float32, bfloat16 or float16")


@pytest.mark.parametrize("recipe", [None, R.Float8CurrentScaling(), R.DelayedScaling()], ids=["none", "current",
                                                                                            "delayed"])
@pytest.mark.parametrize("inspect", [False, True])
def test_one_return_shape(recipe, inspect):
    x = jax.random.normal(jax.random.key(0), (32, H))
    for name, op in _ops(recipe, state_of=lambda q: q.init_state() if recipe else None).items():
        out = op(x, inspect=inspect)
        assert isinstance(out, tuple) and len(out) == 2, name
        y, new_state = out
        assert y.shape == x.shape
        if inspect:
            fwd = new_state[STATS]
            if recipe is None:
                assert fwd == {}
            else:
                per_gemm = fwd.values() if name == "layernorm_mlp" else [fwd]
                for roles in per_gemm:
                    assert set(roles) == {"linear_input", "linear_weight"}
                    assert all(set(s) == set(STAT_NAMES) for s in roles.values())
        else:
            assert new_state is None or STATS not in new_state


def test_statistics_travel_in_the_state():
    """The forward statistics come back in the new state; all of them are the gradient of state[STATS]."""
    x = jax.random.normal(jax.random.key(0), (32, H))
    q = te_jax.core.DenseQuantizers.from_recipe(R.Float8CurrentScaling())
    w = jax.random.normal(jax.random.key(1), (H, H)) * 0.1
    stats = te_jax.inspect.zeros(q.quantized_roles())

    def loss(state):
        y, new_state = te_jax.dense(x, w, quantizers=q, state=state, inspect=True)
        return jnp.sum(y), new_state

    grads, new_state = jax.grad(loss, has_aux=True)({STATS: stats})
    assert set(grads[STATS]) == set(q.quantized_roles())
    for role, fwd in new_state[STATS].items():
        assert np.array_equal(fwd["amax"], grads[STATS][role]["amax"]) and float(fwd["amax"]) > 0
    assert float(grads[STATS]["linear_grad_output"]["amax"]) == 1.0  # d sum(y) / dy


def test_entries_an_op_does_not_use_pass_through():
    x = jax.random.normal(jax.random.key(0), (32, H))
    other = {"mine": jnp.arange(3.0)}
    for op in _ops(R.Float8CurrentScaling(), state_of=lambda q: other).values():
        _, new_state = op(x)
        assert new_state["mine"] is other["mine"]


def test_dense_general_names_its_quantized_copies():
    """te_jax.flax.DenseGeneral's FP8 copies carry the QUANTIZED name that save_fp8_policy keeps."""
    x = jax.random.normal(jax.random.key(0), (32, H))
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        layer = te_jax.flax.DenseGeneral(H)
        variables = layer.init(jax.random.key(1), x)
        jaxpr = str(jax.make_jaxpr(lambda v: layer.apply(v, x))(variables))
    assert f"name={QUANTIZED}" in jaxpr


def test_module_errors_name_the_module():
    x = jax.random.normal(jax.random.key(0), (5, 8, H))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return te_jax.flax.DenseGeneral(H, name="proj")(x)

    # A forward quantizer that rounds stochastically needs the "quantize" RNG stream, not given here.
    recipe = R.CustomRecipe(qfactory=lambda role: NVFP4Quantizer(stochastic_rounding=True))
    with te_jax.autocast(recipe=recipe), pytest.raises(ValueError) as err:
        Model().init(jax.random.key(1), x)
    assert str(err.value).startswith("te_jax: DenseGeneral at proj: the quantizers of ['linear_input', "
                                     "'linear_weight', 'linear_output'] round stochastically and need key=")
