"""te_jax.flax.MoE: the high-precision reference without autocast, every tested recipe near it, jit/grad/scan/remat,
and expert parallelism on 8 fake CPU devices (tests/multidevice/moe_layer_multidevice.py in a subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from qtest_util import run_on_fake_devices

import te_jax
from te_jax import moe
from te_jax import recipe as R
from te_jax.flax import MoE, save_fp8_policy

E, K_TOP, H, F, T = 4, 2, 128, 128, 48
HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _on_cpu():
    """Runs on XLA:CPU on every machine (the layer's logic; the CUDA grouped kernels are tested against the
    reference twin in test_grouped_gemm_gpu.py)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _x(dtype=jnp.float32):
    return jax.random.normal(jax.random.key(0), (2, T // 2, H)).astype(dtype)


def _reference(params, x, activation="swiglu", score_function="softmax"):
    """Route, permute, a per-expert loop of dot_general, un-permute: the MoE written out in plain JAX."""
    p = jax.tree.map(lambda a: getattr(a, "value", a), params, is_leaf=lambda a: hasattr(a, "value"))
    x2 = x.reshape(-1, H)
    logits = jnp.dot(x2.astype(jnp.float32), p["router"], precision=lax.Precision.HIGHEST)
    r = moe.route(logits, K_TOP, score_function=score_function, expert_bias=p.get("expert_bias"))
    xs, perm = moe.permute(x2, r.expert_ids, E)
    h = lax.ragged_dot(xs, p["wi"], perm.group_sizes)
    if activation == "swiglu":
        a, g = jnp.split(h, 2, axis=-1)
        h = jax.nn.silu(a) * g
    else:
        h = jax.nn.relu(h)
    y = moe.unpermute(lax.ragged_dot(h, p["wo"], perm.group_sizes), perm, r.gates)
    return y.reshape(x.shape)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("activation,score_function", [("swiglu", "softmax"), ("relu", "sigmoid")])
def test_without_autocast_is_the_reference(activation, score_function):
    layer = MoE(E, K_TOP, F, activation=activation, score_function=score_function, aux_loss_coeff=0.5)
    x = _x()
    v = jax.jit(layer.init)(jax.random.key(1), x)
    y, inter = jax.jit(lambda v, x: layer.apply(v, x, mutable=["intermediates"]))(v, x)
    np.testing.assert_allclose(y, _reference(v["params"], x, activation, score_function), rtol=1e-6, atol=1e-6)
    assert inter["intermediates"]["aux_loss"][0].shape == ()
    assert float(inter["intermediates"]["aux_loss"][0]) >= 0.5 * 0.99  # coeff * Switch loss (>= 1 up to rounding)
    with te_jax.autocast(enabled=False, recipe=R.Float8CurrentScaling()):
        y_off = layer.apply(v, x)
    np.testing.assert_array_equal(y_off, layer.apply(v, x))


@pytest.mark.parametrize("name,recipe", [("delayed", R.DelayedScaling(amax_history_len=4)),
                                         ("block", R.Float8BlockScaling())])
def test_recipes_near_the_reference(name, recipe):
    # The shared expert is a DenseGeneral, whose block-scaled tokens would need a multiple of 128.
    layer = MoE(E, K_TOP, F, use_bias=True, num_shared_experts=int(name != "block"))
    x = _x()
    with te_jax.autocast(recipe=recipe):
        v = jax.jit(layer.init)(jax.random.key(1), x)
    params = {"params": v["params"]}

    def loss(v):
        return jnp.mean(layer.apply(v, x) ** 2)

    want_l, want_g = jax.jit(jax.value_and_grad(loss))(params)
    with te_jax.autocast(recipe=recipe):
        if name == "delayed":  # one step records the amaxes, so the scales fit the data
            _, g = jax.jit(te_jax.train.value_and_grad(loss))(v)
            v = {**v, "fp8_meta": jax.jit(te_jax.train.apply_fp8_update)(v["fp8_meta"], g["fp8_meta"])}
        got_l, got_g = jax.jit(te_jax.train.value_and_grad(loss))(v)
    assert abs(float(got_l) - float(want_l)) / float(want_l) < 0.05
    for path in (("wi",), ("wo",), ("router",)) + ((("shared_wi", "kernel"),) if name != "block" else ()):
        a, b = got_g["params"], want_g["params"]
        for p in path:
            a, b = a[p], b[p]
        a, b = getattr(a, "value", a), getattr(b, "value", b)
        assert _rel(a, b) < 0.15, (path, _rel(a, b))
    if name == "delayed":
        assert v["fp8_meta"]["wi"]["linear_weight"]["amax_history"].shape == (E, 4)


def test_scan_remat_bf16():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + MoE(E, K_TOP, F, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)(x), None

    stack = nn.scan(nn.remat(Block, policy=save_fp8_policy, prevent_cse=False),
                    variable_axes={"params": 0, "fp8_meta": 0}, split_rngs={"params": True}, length=2)()
    x = _x(jnp.bfloat16)
    with te_jax.autocast(recipe=R.DelayedScaling(amax_history_len=4)):
        v = jax.jit(lambda key, x: stack.init(key, x, None))(jax.random.key(2), x)
        loss = lambda v: jnp.mean(stack.apply(v, x, None)[0].astype(jnp.float32) ** 2)  # noqa: E731
        value, grads = jax.jit(te_jax.train.value_and_grad(loss))(v)
    assert v["fp8_meta"]["MoE_0"]["wi"]["linear_weight"]["scale"].shape == (2, E, 1)
    assert np.isfinite(float(value))
    wi = grads["params"]["MoE_0"]["wi"]
    assert getattr(wi, "value", wi).dtype == jnp.bfloat16
    assert float(jnp.max(grads["fp8_meta"]["MoE_0"]["wi"]["linear_input"]["amax_history"])) > 0


def test_errors():
    x = _x()
    with pytest.raises(ValueError, match=r"MoE.*num_experts_per_tok \(5\) must be in \[1, num_experts=4\]"):
        MoE(E, E + 1, F).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(E, K_TOP, F, activation="tanh").init(jax.random.key(0), x)
    with te_jax.autocast(recipe=R.Float8BlockScaling()):
        with pytest.raises(ValueError, match="multiple of 128"):
            MoE(E, K_TOP, 96).init(jax.random.key(0), x)


# ---- expert parallelism on 8 fake CPU devices ----------------------------------------------------------

EP_CASES = ("ep8:none", "dp2xep4:none", "ep8:delayed", "dp2xep4:delayed")
# One MoE step compiled on the mesh: the row counts, the rows and the results forward; the transposes of
# the two row exchanges backward.
ALL_TO_ALLS = {"forward": 3, "grad": 5}
# Float32 sums in another order: the mesh's loss has differed from one device's by up to 1.08e-6 relative (about
# nine ulps) on one CPU model and by less on another, so the bound leaves room for a few times that.
REORDER_RTOL = 4e-6


@pytest.fixture(scope="module")
def ep_results() -> dict:
    """tests/multidevice/moe_layer_multidevice.py's JSON lines: "errors" and one per case "<mesh>:<recipe>"."""
    proc = run_on_fake_devices([HERE.parent / "multidevice" / "moe_layer_multidevice.py", "--cases", ",".join(EP_CASES)], cwd=HERE)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no output; stderr:\n{proc.stderr[-4000:]}"
    return {"errors" if "errors" in c else f"{c['mesh']}:{c['recipe']}": c for c in lines}


@pytest.mark.parametrize("name", EP_CASES)
def test_expert_parallel_layer_equals_one_device(ep_results, name):
    """Tokens over every axis, experts over "ep": the step's loss and gradients are the one-device ones up to
    float32 rounding (the weight gradients sum rows in another order); with delayed scaling the FP8 state
    update is the one-device update bit for bit (the input and gradient amaxes are reduced over the mesh, each
    expert weight's amax is its own) and every device holds the same."""
    case = ep_results[name]
    assert "error" not in case, case["error"]
    assert case["loss_rel_diff"] <= REORDER_RTOL and case["dx_rel_diff"] <= REORDER_RTOL, case
    assert max(case["param_rel_diff"].values()) <= REORDER_RTOL, case["param_rel_diff"]
    if name.endswith("delayed"):
        assert case["fp8_meta_equal"] and case["fp8_meta_same_on_every_device"], case
    assert case["forward_collectives"]["all-to-all"] == ALL_TO_ALLS["forward"], case["forward_collectives"]
    assert case["grad_collectives"]["all-to-all"] == ALL_TO_ALLS["grad"], case["grad_collectives"]


def test_expert_parallel_bad_input_errors_at_trace_time(ep_results):
    errors = ep_results["errors"]["errors"]
    assert "12 experts cannot be split over the 8 devices" in errors["experts_not_divisible"]
    assert "60 tokens cannot be split over the 8 devices" in errors["tokens_not_divisible"]


def test_expert_parallel_needs_a_mesh():
    layer = MoE(E, K_TOP, F)
    x = _x()
    v = jax.jit(layer.init)(jax.random.key(1), x)
    with te_jax.autocast(enabled=False, mesh_resource=te_jax.MeshResource(ep_resource="ep")):
        with pytest.raises(ValueError, match=r"MoE.*ep_resource='ep'.*needs a mesh with that axis"):
            layer.apply(v, x)


def test_ep_resource_is_one_axis():
    with pytest.raises(ValueError, match="ep_resource must be one mesh axis name"):
        te_jax.MeshResource(ep_resource=("a", "b"))
