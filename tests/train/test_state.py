"""FP8 state: the delayed-scaling update step by step, and how state moves through training.

Covers the update against hand-computed histories and scales, the
max-mergeable update form, forward-only (mutable) updates, training under
jit, nn.scan, nn.remat, a layer applied twice, gradient accumulation,
TrainState, orbax save/restore, and (in a subprocess with 8 CPU devices)
the cross-device reduction.
"""

from __future__ import annotations

import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_jax
from te_jax import recipe as R
from te_jax.ops import quantize as qops
from te_jax.quantize import DelayedScalingQuantizer
from te_jax.quantize import delayed as D
from te_jax.train.step import apply_fp8_update, merge_fp8_updates
from te_jax.train import TrainState, accumulate_gradients, value_and_grad

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_models import MLP, Dense, mse  # noqa: E402
from qtest_util import run_on_fake_devices, same_bits as _bits_equal  # noqa: E402  (GPUs write their own NaNs)

F32 = np.float32
E4M3_MAX, E5M2_MAX = F32(448), F32(57344)


def _div(a, b) -> float:
    """``a / b`` in float32 as XLA divides on the default device (a GPU's division may differ by an ulp
    from IEEE's, and the state update is XLA's arithmetic)."""
    return float(jax.jit(jnp.divide)(F32(a), F32(b)))


def _tree_bits_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(_bits_equal(x, y) for x, y in zip(la, lb))


# ---- the update, by hand -------------------------------------------------------------------

# amax_history_len 3, E4M3, "max": (amax this step, history after, scale after)
HAND = [
    (2.0, [0, 0, 2], 224.0),  # h=[2,0,0] a=2 -> 448/2; roll -> [0,0,2]
    (8.0, [0, 2, 8], 56.0),  # h=[8,0,2] a=8
    (4.0, [0, 8, 4], 56.0),  # h=[4,2,8] a=8; roll [2,8,4], zero [0]
    (0.0, [0, 4, 0], 56.0),  # h=[0,8,4] a=8
    (1.0, [0, 0, 1], 112.0),  # h=[1,4,0] a=4
    (0.0, [0, 1, 0], 448.0),  # h=[0,0,1] a=1
    (0.0, [0, 0, 0], 448.0),  # h=[0,1,0] a=1
    (0.0, [0, 0, 0], 448.0),  # all zero: a=0 keeps the scale
    (float("nan"), [0, 0, 0], 448.0),  # a NaN amax is skipped (recorded as 0): h=[0,0,0] a=0 keeps the scale
    (4.0, [0, 0, 4], 112.0),  # the NaN froze nothing: h=[4,0,0] a=4
    (float("inf"), [0, 4, 0], 112.0),  # Inf is skipped too: h=[0,0,4] a=4 from the rest of the window
    (1.0, [0, 0, 1], 112.0),  # h=[1,4,0] a=4
    (7.0, [0, 1, 7], 64.0),  # h=[7,0,1] a=7
    (2.0, [0, 7, 2], 64.0),  # h=[2,1,7] a=7
]


def test_delayed_update_by_hand():
    q = DelayedScalingQuantizer(amax_history_len=3)
    state = q.init_state()
    assert np.array_equal(state["amax_history"], [0, 0, 0]) and np.array_equal(state["scale"], [1])
    for amax, history, scale in HAND:
        state = q.update_state(state, jnp.array([amax], jnp.float32))
        np.testing.assert_array_equal(state["amax_history"], np.array(history, F32))
        assert state["scale"].dtype == jnp.float32 and state["scale"].shape == (1,)
        assert float(state["scale"][0]) == scale, (amax, history, scale)


def test_delayed_variants_by_hand():
    def run(q, amaxes):
        state = q.init_state()
        for a in amaxes:
            state = q.update_state(state, jnp.float32(a))
        return state

    st = run(DelayedScalingQuantizer(amax_history_len=3, amax_compute_algo="most_recent"), [8.0, 2.0])
    assert float(st["scale"][0]) == 224.0 and np.array_equal(st["amax_history"], F32([0, 8, 2]))
    st = run(DelayedScalingQuantizer(amax_history_len=3, margin=2), [8.0, 2.0])
    assert float(st["scale"][0]) == 14.0  # 448/8/4
    st = run(DelayedScalingQuantizer(jnp.float8_e5m2, amax_history_len=1), [3.0])
    assert float(st["scale"][0]) == _div(E5M2_MAX, 3) and np.array_equal(st["amax_history"], [0])
    st = run(DelayedScalingQuantizer(amax_history_len=2), [1e-37])
    assert float(st["scale"][0]) == 2.0**126  # 448/1e-37 exceeds the largest scale, 2^126: capped
    seen = []
    sf = lambda amax, scale, fp8_max, margin: seen.append((fp8_max, margin)) or scale * 2  # noqa: E731
    st = run(DelayedScalingQuantizer(amax_history_len=2, margin=1, scaling_factor_compute_algo=sf), [5.0, 0.0])
    assert float(st["scale"][0]) == 4.0 and seen[0] == (448.0, 1)  # second step: a = max(window) = 5 > 0


def test_quantize_uses_the_stored_scale_and_reports_the_amax():
    q = DelayedScalingQuantizer(jnp.float8_e4m3fn, amax_history_len=4)
    x = jax.random.normal(jax.random.key(0), (64, 32)) * 3
    state = {"amax_history": jnp.zeros(4), "scale": jnp.array([37.0], jnp.float32)}
    t = q.quantize(x, state, colwise=True)
    want_q, want_qt, want_amax, want_si = qops.quantize_fp8_tensor(x, jnp.array([37.0]), colwise=True,
                                                                   backend="reference")
    assert _bits_equal(t.data, want_q) and _bits_equal(t.colwise_data, want_qt)
    assert float(t.amax[0]) == float(jnp.max(jnp.abs(x))) == float(want_amax[0])
    assert float(t.scale_inv[0]) == float(F32(1) / F32(37))
    with pytest.raises(ValueError, match="needs its state"):
        q.quantize(x)
    with pytest.raises(ValueError, match="Re-initialize fp8_meta"):
        q.quantize(x, D.init_state(8))


def _random_state(rng, length):
    history = rng.choice([0.0, 0.5, 1.0, 3.0, 100.0], size=length).astype(F32)
    history[0] = 0
    return {"amax_history": jnp.asarray(history), "scale": jnp.asarray([rng.choice([1.0, 7.0, 448.0])], F32)}


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_form_merges_exactly(algo):
    """max of two updates' forms == the form of one update with the larger amax, edge cases included."""
    rng = np.random.default_rng(0)
    q = DelayedScalingQuantizer(amax_history_len=4, amax_compute_algo=algo, margin=1)
    values = [0.0, 1e-3, 0.5, 2.0, 200.0, float("nan"), float("inf")]
    for _ in range(6):
        old = _random_state(rng, 4)
        for a1 in values:
            for a2 in values:
                g1 = q.state_gradient(old, jnp.float32(a1))
                g2 = q.state_gradient(old, jnp.float32(a2))
                merged = apply_fp8_update({"t": old}, merge_fp8_updates({"t": g1}, {"t": g2}))["t"]
                # a non-finite amax is skipped: it merges as 0 (the update of the other use's amax)
                want = q.update_state(old, jnp.float32(max((a for a in (a1, a2) if np.isfinite(a)), default=0.0)))
                assert _tree_bits_equal(merged, want), (old, a1, a2)
        unused = jax.tree.map(lambda v: jnp.full_like(v, -jnp.inf), old)
        assert _tree_bits_equal(apply_fp8_update({"t": old}, {"t": unused})["t"], old)


# ---- training: one layer, amaxes under control ------------------------------------------------

REC3 = R.DelayedScaling(amax_history_len=3)


def _one_layer(rec=REC3):
    layer = Dense(16, use_bias=False)
    x0 = jnp.ones((32, 32))
    with te_jax.autocast(recipe=rec):
        variables = layer.init(jax.random.key(0), x0)
    kernel = jnp.full((32, 16), 0.5).at[3, 4].set(-0.75)  # amax 0.75
    return layer, {"params": {"kernel": kernel}, "fp8_meta": variables["fp8_meta"]}


def _x_with_amax(a, seed):
    x = jax.random.uniform(jax.random.key(seed), (32, 32), minval=-a / 2, maxval=a / 2)
    return x.at[5, 7].set(-a)


def _expected(amaxes, fp8_max, length=3):
    history, scale = np.zeros(length, F32), F32(1)
    for a in amaxes:
        history[0] = a
        m = history.max()
        if m > 0 and np.isfinite(m):
            scale = F32(_div(fp8_max, m))
        history = np.roll(history, -1)
        history[0] = 0
    return history, scale


def test_train_steps_by_hand():
    layer, variables = _one_layer()

    @jax.jit
    def step(variables, x, c):
        def loss(v):
            return jnp.sum(layer.apply(v, x) * c)  # dy = c exactly

        with te_jax.autocast(recipe=REC3):
            _, grads = value_and_grad(loss)(variables)
        return {**variables, "fp8_meta": apply_fp8_update(variables["fp8_meta"], grads["fp8_meta"])}, grads

    x_amax, c_amax = [2.0, 8.0, 4.0, 0.5], [1.0, 3.0, 2.0, 0.25]
    for i in range(4):
        c = jnp.full((32, 16), c_amax[i] / 2).at[0, 0].set(c_amax[i])
        variables, grads = step(variables, _x_with_amax(x_amax[i], i), c)
        meta = variables["fp8_meta"]
        for role, amaxes, fp8_max in [("linear_input", x_amax, E4M3_MAX), ("linear_weight", [0.75] * 4, E4M3_MAX),
                                      ("linear_grad_output", c_amax, E5M2_MAX)]:
            history, scale = _expected(amaxes[: i + 1], fp8_max)
            np.testing.assert_array_equal(meta[role]["amax_history"], history, err_msg=f"{role} step {i}")
            assert float(meta[role]["scale"][0]) == float(scale), (role, i)
        assert np.array_equal(grads["params"]["kernel"].shape, (32, 16))


def test_forward_only_updates_need_mutable():
    layer, variables = _one_layer()
    x = _x_with_amax(4.0, 0)
    with te_jax.autocast(recipe=REC3):
        y1 = layer.apply(variables, x)  # not mutable: the state is read, not returned
        y2, updated = layer.apply(variables, x, mutable=["fp8_meta"])
    assert np.array_equal(y1, y2)
    meta = updated["fp8_meta"]
    assert float(meta["linear_input"]["scale"][0]) == 112.0 and float(meta["linear_weight"]["scale"][0]) == \
        _div(448, 0.75)
    assert _tree_bits_equal(meta["linear_grad_output"], variables["fp8_meta"]["linear_grad_output"])


def test_unused_state_is_kept_and_init_is_pristine():
    layer, variables = _one_layer()
    assert np.all(np.asarray(variables["fp8_meta"]["linear_input"]["amax_history"]) == 0)
    x = _x_with_amax(4.0, 0)
    _, grads = value_and_grad(lambda v: jnp.sum(layer.apply(v, x)))(variables)  # eager, autocast off
    assert _tree_bits_equal(apply_fp8_update(variables["fp8_meta"], grads["fp8_meta"]), variables["fp8_meta"])


def test_stateless_recipes_create_no_state():
    for rec in (R.Float8CurrentScaling(), R.MXFP8BlockScaling()):
        with te_jax.autocast(recipe=rec):
            variables = jax.jit(MLP().init)(jax.random.key(0), jnp.ones((32, 32)))
        assert "fp8_meta" not in variables


def test_missing_state_is_a_clear_error():
    variables = jax.jit(MLP().init)(jax.random.key(0), jnp.ones((32, 32)))  # initialized without autocast
    with te_jax.autocast(recipe=REC3), pytest.raises(ValueError, match="initialize the model under te_jax.autocast"):
        jax.eval_shape(MLP().apply, variables, jnp.ones((32, 32)))


# ---- a layer applied twice, remat, scan, accumulation -------------------------------------------


class Twice(nn.Module):
    @nn.compact
    def __call__(self, x1, x2):
        layer = Dense(16, use_bias=False, name="shared")
        return layer(x1), layer(x2)


def test_layer_applied_twice_merges_by_max():
    model = Twice()
    x1, x2 = _x_with_amax(2.0, 1), _x_with_amax(5.0, 2)
    c1, c2 = jnp.full((32, 16), 0.5), jnp.full((32, 16), 0.25).at[1, 1].set(3.0)
    with te_jax.autocast(recipe=REC3):
        variables = model.init(jax.random.key(0), x1, x2)

    def loss(v):
        y1, y2 = model.apply(v, x1, x2)
        return jnp.sum(y1 * c1) + jnp.sum(y2 * c2)

    with te_jax.autocast(recipe=REC3):
        _, grads = jax.jit(value_and_grad(loss))(variables)
        with te_jax.train.fp8_state_updates():
            plain = jax.jit(jax.grad(loss))(variables)["fp8_meta"]["shared"]  # jax.grad sums the two uses
    meta = apply_fp8_update(variables["fp8_meta"], grads["fp8_meta"])["shared"]
    assert np.array_equal(meta["linear_input"]["amax_history"], F32([0, 0, 5]))
    assert float(meta["linear_input"]["scale"][0]) == _div(448, 5)
    assert np.array_equal(meta["linear_grad_output"]["amax_history"], F32([0, 0, 3]))
    assert float(meta["linear_grad_output"]["scale"][0]) == _div(57344, 3)
    assert float(plain["linear_input"]["amax_history"][2]) == 7.0  # what a sum would have given


class RematMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.remat(Dense)
        return block(32, name="wo")(nn.gelu(block(64, name="wi")(x)))


def _grads(model, variables, x, rec=REC3):
    @jax.jit
    def run(v):
        with te_jax.autocast(recipe=rec):
            return value_and_grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v)

    return run(variables)


def test_remat_gives_the_same_state_and_gradients():
    x = jax.random.normal(jax.random.key(3), (32, 32))
    with te_jax.autocast(recipe=REC3):
        variables = MLP().init(jax.random.key(0), x)
    a, b = _grads(MLP(), variables, x), _grads(RematMLP(), variables, x)
    assert _tree_bits_equal(a, b)


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(Dense(32, name="dense")(x)), None


class Scanned(nn.Module):
    layers: int = 3

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(ScanBlock, variable_axes={"params": 0, "fp8_meta": 0}, split_rngs={"params": True},
                       length=self.layers)
        return scan(name="layers")(x, None)[0]


class Unrolled(nn.Module):
    layers: int = 3

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = jnp.tanh(Dense(32, name=f"dense_{i}")(x))
        return x


def test_scan_keeps_per_layer_state():
    x = jax.random.normal(jax.random.key(4), (32, 32)) * 3
    with te_jax.autocast(recipe=REC3):
        scanned = Scanned().init(jax.random.key(0), x)
    history = scanned["fp8_meta"]["layers"]["dense"]["linear_input"]["amax_history"]
    assert history.shape == (3, 3)
    per_layer = lambda tree, i: jax.tree.map(lambda v: v[i], tree)  # noqa: E731
    unrolled = {c: {f"dense_{i}": per_layer(scanned[c]["layers"]["dense"], i) for i in range(3)}
                for c in ("params", "fp8_meta")}
    (_, g_s), (_, g_u) = _grads(Scanned(), scanned, x), _grads(Unrolled(), unrolled, x)
    new_s = apply_fp8_update(scanned["fp8_meta"], g_s["fp8_meta"])["layers"]["dense"]
    new_u = apply_fp8_update(unrolled["fp8_meta"], g_u["fp8_meta"])
    for i in range(3):
        assert _tree_bits_equal(per_layer(new_s, i), new_u[f"dense_{i}"]), i
        np.testing.assert_allclose(per_layer(g_s["params"]["layers"]["dense"], i)["kernel"],
                                   g_u["params"][f"dense_{i}"]["kernel"], rtol=1e-5, atol=1e-6)
    inputs = np.asarray(new_s["linear_input"]["amax_history"][:, -1])
    assert inputs[0] == float(jnp.max(jnp.abs(x))) and len(set(inputs.tolist())) == 3  # each layer its own amax


def test_gradient_accumulation_sums_and_max_merges():
    model = MLP()
    batches = jax.random.normal(jax.random.key(5), (4, 32, 32)) * jnp.array([1.0, 4.0, 2.0, 0.5])[:, None, None]
    with te_jax.autocast(recipe=REC3):
        variables = model.init(jax.random.key(0), batches[0])
    loss_fn = lambda v, b: jnp.mean(model.apply(v, b) ** 2)  # noqa: E731

    @jax.jit
    def accumulated(v):
        with te_jax.autocast(recipe=REC3):
            return accumulate_gradients(loss_fn, v, batches)

    @jax.jit
    def single(v, b):
        with te_jax.autocast(recipe=REC3):
            return value_and_grad(loss_fn)(v, b)

    loss, grads = accumulated(variables)
    parts = [single(variables, b) for b in batches]
    np.testing.assert_allclose(loss, np.mean([p[0] for p in parts]), rtol=1e-6)
    mean_params = jax.tree.map(lambda *g: sum(g) / 4, *[p[1]["params"] for p in parts])
    for got, want in zip(jax.tree.leaves(grads["params"]), jax.tree.leaves(mean_params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    merged = parts[0][1]["fp8_meta"]
    for p in parts[1:]:
        merged = merge_fp8_updates(merged, p[1]["fp8_meta"])
    assert _tree_bits_equal(grads["fp8_meta"], merged)
    new = apply_fp8_update(variables["fp8_meta"], grads["fp8_meta"])
    assert float(new["wi"]["linear_input"]["amax_history"][-1]) == float(jnp.max(jnp.abs(batches)))


# ---- TrainState, the three-line change, orbax ------------------------------------------------


def bf16_train_step(state, x, y):
    def loss_fn(params):
        return mse(state.apply_fn({"params": params}, x), y)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def fp8_train_step(state, x, y):
    def loss_fn(params):
        return mse(state.apply_fn(params, x), y)

    with te_jax.autocast(recipe=REC3):
        loss, grads = te_jax.train.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


# fp8_train_step is bf16_train_step with the three-line change of te_jax/train/step.py's docstring. That the change
# is all it takes is checked by behaviour, not by diffing the source: test_train_state_trains_and_keeps_bf16_behaviour
# (the FP8 step trains and moves the FP8 state), and tests/core/test_dropin.py (the te_jax loop is step-by-step
# identical to flax's and optax's loops where there is no state, and a loop without te_jax.train.value_and_grad
# raises, naming it, where there is).


def _setup(seed=0):
    x = jax.random.normal(jax.random.key(seed), (32, 32))
    y = jnp.sin(x)
    with te_jax.autocast(recipe=REC3):
        variables = MLP().init(jax.random.key(1), x)
    return TrainState.create(apply_fn=MLP().apply, params=variables, tx=optax.adam(3e-3)), x, y


def test_train_state_trains_and_keeps_bf16_behaviour():
    state, x, y = _setup()
    step = jax.jit(fp8_train_step)
    losses = []
    for _ in range(6):
        state, loss = step(state, x, y)
        losses.append(float(loss))
    assert losses[-1] < losses[0] and all(np.isfinite(losses))
    assert int(state.step) == 6
    assert float(state.params["fp8_meta"]["wi"]["linear_input"]["scale"][0]) != 1.0
    # without fp8_meta it is flax's TrainState
    params = MLP().init(jax.random.key(1), x)["params"]
    plain = TrainState.create(apply_fn=MLP().apply, params=params, tx=optax.adam(3e-3))
    plain, loss = jax.jit(bf16_train_step)(plain, x, y)
    assert np.isfinite(float(loss)) and int(plain.step) == 1


def test_orbax_restore_continues_bit_identically(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    state, x, y = _setup(1)
    step = jax.jit(fp8_train_step)
    for _ in range(2):
        state, _ = step(state, x, y)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": state.params, "opt_state": state.opt_state, "step": state.step})
    checkpointer.wait_until_finished()
    assert "fp8_meta" in state.params
    continued = state
    for _ in range(3):
        continued, _ = step(continued, x, y)
    fresh, _, _ = _setup(1)
    target = {"params": fresh.params, "opt_state": fresh.opt_state, "step": jnp.zeros((), jnp.int32)}
    restored = checkpointer.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, target))
    resumed = fresh.replace(**restored)
    assert _tree_bits_equal(resumed.params, state.params)
    for _ in range(3):
        resumed, _ = step(resumed, x, y)
    assert _tree_bits_equal(resumed.params, continued.params)
    assert _tree_bits_equal(resumed.opt_state, continued.opt_state)


# ---- 8 devices ---------------------------------------------------------------------------------


def test_eight_device_reduction():
    script = Path(__file__).resolve().parents[1] / "multidevice" / "fp8_multidevice.py"
    result = run_on_fake_devices([script], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ALL OK" in result.stdout
