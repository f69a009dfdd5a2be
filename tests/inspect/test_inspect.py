"""te_jax.inspect: statistics against hand-computed values, recipe rankings, the off path, the layers, writers, CLI.

Covers: amax, scale, underflow and saturation counts on constructed inputs
(per tensor with a fixed scale, current scaling, MXFP8 block scales, NVFP4
against an independent numpy computation); NVFP4 > per-tensor E5M2 >
MXFP8 ~ per-tensor E4M3 in relative error on Gaussian data with outliers;
inspection off traces nothing of it and leaves the program as it was;
statistics of every role (backward ones included) of DenseGeneral,
LayerNormDenseGeneral and LayerNormMLP under jit and nn.scan; the JSON
lines / table / report writers; the CLI on CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax
import te_jax.flax as tf
from te_jax import inspect as I
from te_jax import recipe as R
from te_jax.core import stats as S
from te_jax.quantize import CurrentScalingQuantizer, DelayedScalingQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_jax.train import TrainState, value_and_grad
from te_jax.quantize import dequantize

F32 = np.float32
FWD, BWD = ("linear_input", "linear_weight"), ("linear_grad_output",)


def _stats(x, t, copy="rowwise"):
    return {k: float(v) for k, v in jax.jit(S.tensor_stats, static_argnums=2)(x, t, copy).items()}


# ---- hand-computed statistics ---------------------------------------------------------------

# E4M3 at scale 1: max 448, smallest subnormal 2^-9 (so 2^-10 rounds to 0, a tie to even).
SATURATING = [1000.0, -600.0, 449.0, 1e4]  # beyond 448
UNDERFLOWING = [2.0**-10, -(2.0**-11), 1e-5]
EXACT = [448.0, -448.0, 1.5, -3.0, 0.25, 2.0**-9, 96.0, -0.875, 1.0, 2.0, -4.0, 6.0, 10.0, -12.0, 0.5, 0.75,
         -1.25, 3.5, 7.0, 24.0]
ZEROS = [0.0] * 5


def _constructed(scale: float):
    """32 values in the scaled domain divided by ``scale``, and the hand-computed represented values."""
    scaled = np.array(SATURATING + UNDERFLOWING + EXACT + ZEROS, F32)
    represented = np.concatenate([np.sign(SATURATING) * 448, np.zeros(3), EXACT, ZEROS]).astype(F32)
    perm = np.random.default_rng(0).permutation(32)
    return (scaled[perm] / F32(scale)).reshape(4, 8), (represented[perm] / F32(scale)).reshape(4, 8)


@pytest.mark.parametrize("scale", [1.0, 4.0, 0.125])
def test_per_tensor_counts_by_hand(scale):
    x, represented = _constructed(scale)
    q = DelayedScalingQuantizer(jnp.float8_e4m3fn, amax_history_len=2)
    state = {"amax_history": jnp.zeros(2), "scale": jnp.full((1,), scale, jnp.float32)}
    t = q.quantize(jnp.asarray(x), state, colwise=True)
    np.testing.assert_array_equal(np.asarray(dequantize(t)), represented)  # the construction holds
    nonzero = 27
    want_err = np.linalg.norm(x.astype(np.float64) - represented) / np.linalg.norm(x.astype(np.float64))
    for copy in ("rowwise", "colwise"):
        s = _stats(jnp.asarray(x), t, copy)
        assert s["amax"] == pytest.approx(1e4 / scale, rel=1e-7)
        assert s["scale"] == scale
        assert s["underflow"] == pytest.approx(3 / nonzero, rel=1e-6)
        assert s["saturation"] == pytest.approx(4 / nonzero, rel=1e-6)  # 448 itself is representable
        assert s["rel_error"] == pytest.approx(want_err, rel=1e-5)
        assert s["scale_log2_range"] == 0 and s["scale_log2_std"] == 0


@pytest.mark.parametrize("amax", [448.0, 3.0, 0.7, 1e-3, 12345.0])
def test_current_scaling_never_saturates(amax):
    x = jax.random.normal(jax.random.key(1), (64, 64))
    x = x / jnp.max(jnp.abs(x)) * amax
    s = _stats(x, CurrentScalingQuantizer().quantize(x))
    assert s["saturation"] == 0  # the amax element lands on 448 up to float32 rounding: not counted
    assert s["amax"] == pytest.approx(amax, rel=1e-6)
    assert s["scale"] == pytest.approx(448 / amax, rel=1e-6)


def test_mxfp8_block_scales_by_hand():
    x = np.zeros((2, 64), F32)
    x[0, :32] = np.linspace(-448, 448, 32)  # block amax 448: decode 2^0
    x[0, 32:] = np.linspace(-3.5, 3.5, 32)  # 3.5/448 = 2^-7 exactly: decode 2^-7
    x[1, 32:] = np.linspace(-7168, 7168, 32)  # 7168/448 = 2^4: decode 2^4 (row 1 block 0 stays zero: left out)
    x[1, 40] = 2.0**-7  # 2^-7 / 2^4 = 2^-11, under half the smallest E4M3 subnormal: 0
    x[0, 5] = 0.0
    s = _stats(jnp.asarray(x), MXFP8Quantizer().quantize(jnp.asarray(x)))
    nonzero = int(np.count_nonzero(x))
    assert s["underflow"] == pytest.approx(1 / nonzero, rel=1e-6)
    assert s["saturation"] == 0
    logs = np.array([0.0, -7.0, 4.0])
    assert s["scale_log2_range"] == 11
    assert s["scale_log2_std"] == pytest.approx(np.std(logs), rel=1e-6)
    assert s["scale"] == pytest.approx(2.0 ** -np.mean(logs), rel=1e-6)
    assert s["amax"] == 7168


def _nvfp4_by_numpy(x: np.ndarray):
    """NVFP4 1x16 round-to-nearest in numpy (docs/numerics.md): (values, saturated count, log2 decode scales)."""
    e4m3 = ml_dtypes.float8_e4m3fn
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)
    s_enc = F32(448 * 6) / F32(np.max(np.abs(x)))
    s_dec = F32(1) / s_enc
    blocks = x.reshape(x.shape[0], -1, 16)
    s_b = (np.max(np.abs(blocks), axis=-1) * (s_enc * F32(1 / 6))).astype(e4m3).astype(F32)
    enc = F32(1) / (s_b * s_dec)
    v = blocks * enc[..., None]
    nearest = grid[np.argmin(np.abs(np.abs(v)[..., None] - grid), axis=-1)]
    values = (np.sign(v) * nearest * s_b[..., None] * s_dec).reshape(x.shape)
    saturated = int(np.sum(np.abs(v) > 6 * (1 + S.SATURATION_MARGIN)))
    return values, saturated, np.log2(s_b * s_dec)


def test_nvfp4_against_numpy():
    x = np.asarray(jax.random.normal(jax.random.key(2), (32, 64)), F32) * np.exp2(np.arange(32) % 7)[:, None]
    values, saturated, logs = _nvfp4_by_numpy(x)
    s = _stats(jnp.asarray(x), NVFP4Quantizer().quantize(jnp.asarray(x)))
    n = x.size
    assert saturated > 0  # E4M3 block scales that round down clip the block's largest element
    assert s["saturation"] == pytest.approx(saturated / n, rel=1e-6)
    assert s["underflow"] == pytest.approx(np.sum((values == 0) & (x != 0)) / n, rel=1e-6)
    assert s["rel_error"] == pytest.approx(np.linalg.norm(x - values) / np.linalg.norm(x), rel=1e-4)
    assert s["scale_log2_range"] == pytest.approx(np.ptp(logs), rel=1e-5)
    assert s["scale_log2_std"] == pytest.approx(np.std(logs), rel=1e-4)


def test_all_zero_tensor_gives_zeros():
    x = jnp.zeros((32, 32))
    for q in (CurrentScalingQuantizer(), MXFP8Quantizer(), NVFP4Quantizer()):
        s = _stats(x, q.quantize(x))
        assert s["amax"] == s["underflow"] == s["saturation"] == s["rel_error"] == 0, (q, s)
        assert s["scale_log2_range"] == s["scale_log2_std"] == 0


# ---- recipes rank as expected ------------------------------------------------------------------


def _gaussian_with_outliers(seed: int, fraction: float, magnitude: float):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (256, 256))
    return jnp.where(jax.random.bernoulli(k2, fraction, x.shape), x * magnitude, x)


def _input_stats(recipe, x):
    """The linear_input statistics of a DenseGeneral under ``recipe`` (through the layer, as a user gets them)."""
    model = tf.DenseGeneral(128, use_bias=False)
    with te_jax.autocast(recipe=recipe, inspect=True):
        variables = jax.jit(model.init)(jax.random.key(0), x)
        _, out = jax.jit(lambda v, x: model.apply(v, x, mutable=[I.STATS_COLLECTION]))(variables, x)
    return {k: float(v) for k, v in out[I.STATS_COLLECTION]["linear_input"].items()}


def _e5m2_inputs(role):
    """Per-tensor E5M2 inputs (an E5M2 x E5M2 GEMM does not exist, so E4M3 weights)."""
    return CurrentScalingQuantizer(jnp.float8_e5m2 if role == "linear_input" else jnp.float8_e4m3fn)


@pytest.mark.parametrize("seed", [0, 1])
def test_recipes_rank_by_error_on_gaussian_with_outliers(seed):
    x = _gaussian_with_outliers(seed, 0.001, 50.0)
    err = {name: _input_stats(rec, x)["rel_error"] for name, rec in [
        ("nvfp4", R.NVFP4BlockScaling(disable_rht=True)), ("mxfp8", R.MXFP8BlockScaling()),
        ("e4m3", R.Float8CurrentScaling(fp8_format=R.Format.E4M3)),
        ("e5m2", R.CustomRecipe(qfactory=_e5m2_inputs))]}
    assert err["nvfp4"] > 1.3 * err["e5m2"] > 1.3 * max(err["mxfp8"], err["e4m3"]), err
    # Same element format: MXFP8 and per-tensor E4M3 differ by where the scales put the values, not by much.
    assert abs(err["mxfp8"] - err["e4m3"]) < 0.2 * err["e4m3"], err


def test_block_scales_keep_small_values_that_per_tensor_loses():
    x = _gaussian_with_outliers(0, 0.002, 1e4)
    per_tensor = _input_stats(R.Float8CurrentScaling(fp8_format=R.Format.E4M3), x)
    mx = _input_stats(R.MXFP8BlockScaling(), x)
    assert per_tensor["underflow"] > 10 * mx["underflow"] > 0, (per_tensor, mx)
    assert mx["scale_log2_range"] >= 12 and per_tensor["scale_log2_range"] == 0


# ---- the layers: every role, under jit and nn.scan ----------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        x = tf.LayerNormDenseGeneral(64, name="lnd")(x)
        x = tf.LayerNormMLP(intermediate_dim=128, name="mlp")(x)
        return tf.DenseGeneral(64, name="dense")(x), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Block, variable_axes={"params": 0, "fp8_meta": 0, I.STATS_COLLECTION: 0},
                       split_rngs={"params": True}, length=3)
        return scan(name="layers")(x, None)[0]


def _train_grads(model, recipe, x, inspect=True):
    with te_jax.autocast(recipe=recipe, inspect=inspect):
        variables = jax.jit(model.init)(jax.random.key(1), x)  # op by op, each small op would compile on its own

    @jax.jit
    def step(v):
        with te_jax.autocast(recipe=recipe, inspect=inspect):
            return value_and_grad(lambda v: jnp.sum(model.apply(v, x)[0] ** 2) if isinstance(model, Block)
                                  else jnp.sum(model.apply(v, x) ** 2))(v)

    return variables, step(variables)[1]


GEMMS = ("lnd", "mlp/wi", "mlp/wo", "dense")


@pytest.mark.parametrize("recipe", [R.DelayedScaling(amax_history_len=4), R.MXFP8BlockScaling()],
                         ids=["delayed", "mxfp8"])
def test_every_role_of_every_layer_under_jit(recipe):
    x = jax.random.normal(jax.random.key(0), (64, 64))
    variables, grads = _train_grads(Block(), recipe, x)
    assert set(variables[I.STATS_COLLECTION]) == {"lnd", "mlp", "dense"}
    rows = I.to_rows(grads[I.STATS_COLLECTION])
    assert {(r["layer"], r["role"]) for r in rows} == {(g, role) for g in GEMMS for role in FWD + BWD}
    for r in rows:
        assert r["amax"] > 0 and 0 < r["rel_error"] < 0.1 and r["scale"] > 0, r
    # The backward statistics describe the gradient actually quantized: dense's output gradient is 2 y.
    with te_jax.autocast(recipe=recipe):
        y = jax.jit(Block().apply)(variables, x)[0]
    dense_dy = next(r for r in rows if r["layer"] == "dense" and r["role"] == "linear_grad_output")
    assert dense_dy["amax"] == pytest.approx(float(jnp.max(jnp.abs(2 * y))), rel=1e-6)
    # grads["params"] are unchanged by inspection.
    _, plain = _train_grads(Block(), recipe, x, inspect=False)
    for a, b in zip(jax.tree.leaves(plain["params"]), jax.tree.leaves(grads["params"])):
        np.testing.assert_array_equal(a, b)


def test_every_role_under_scan():
    x = jax.random.normal(jax.random.key(0), (64, 64))
    recipe = R.Float8CurrentScaling()
    variables, grads = _train_grads(Scanned(), recipe, x)
    stats = grads[I.STATS_COLLECTION]["layers"]
    assert stats["mlp"]["wo"]["linear_grad_output"]["rel_error"].shape == (3,)
    rows = I.to_rows(grads[I.STATS_COLLECTION])
    assert len(rows) == 3 * len(GEMMS) * 3
    assert {r["layer"] for r in rows} == {f"layers/{g}[{i}]" for g in GEMMS for i in range(3)}
    amaxes = np.asarray(stats["lnd"]["linear_input"]["amax"])
    assert len(set(amaxes.tolist())) == 3  # each layer its own statistics


def test_forward_statistics_through_mutable_apply_and_outputs_roles():
    def qfactory(role):  # quantize every role, outputs and input gradients too
        return CurrentScalingQuantizer(jnp.float8_e5m2 if role.is_gradient else jnp.float8_e4m3fn)

    recipe = R.CustomRecipe(qfactory=qfactory)
    x = jax.random.normal(jax.random.key(0), (64, 64))
    model = tf.DenseGeneral(64)
    with te_jax.autocast(recipe=recipe, inspect=True):
        variables = jax.jit(model.init)(jax.random.key(1), x)
        _, fwd = model.apply(variables, x, mutable=[I.STATS_COLLECTION])
        _, grads = jax.jit(value_and_grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)
    assert {r["role"] for r in I.to_rows(fwd[I.STATS_COLLECTION]) if r["amax"] > 0} == {
        "linear_input", "linear_weight", "linear_output"}
    assert {r["role"] for r in I.to_rows(grads[I.STATS_COLLECTION]) if r["amax"] > 0} == set(R.ROLES)


def test_a_layer_applied_twice_merges_by_max():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, a, b):
            layer = tf.DenseGeneral(32, name="shared")
            return layer(a) + layer(b)

    a = jax.random.normal(jax.random.key(0), (32, 32))
    recipe = R.Float8CurrentScaling()
    with te_jax.autocast(recipe=recipe, inspect=True):
        variables = jax.jit(Twice().init)(jax.random.key(1), a, a)
        _, g = jax.jit(value_and_grad(lambda v: jnp.sum(Twice().apply(v, a, 5 * a))))(variables)
    amax = float(g[I.STATS_COLLECTION]["shared"]["linear_input"]["amax"])
    assert amax == pytest.approx(5 * float(jnp.max(jnp.abs(a))), rel=1e-6)


def test_train_state_keeps_stats_away_from_the_optimizer():
    import optax

    x = jax.random.normal(jax.random.key(0), (64, 64))
    recipe = R.DelayedScaling(amax_history_len=4)
    with te_jax.autocast(recipe=recipe, inspect=True):
        variables = jax.jit(Block().init)(jax.random.key(1), x)
    state = TrainState.create(apply_fn=Block().apply, params=variables, tx=optax.adamw(1e-3, weight_decay=0.1))
    assert I.STATS_COLLECTION not in str(jax.tree.structure(state.opt_state))

    @jax.jit
    def step(state):
        with te_jax.autocast(recipe=recipe, inspect=True):
            loss, grads = value_and_grad(lambda v: jnp.sum(state.apply_fn(v, x)[0] ** 2))(state.params)
        return state.apply_gradients(grads=grads), grads[I.STATS_COLLECTION]

    new, stats = step(state)
    assert jax.tree.structure(new.params) == jax.tree.structure(state.params)
    for a, b in zip(jax.tree.leaves(new.params[I.STATS_COLLECTION]), jax.tree.leaves(variables[I.STATS_COLLECTION])):
        np.testing.assert_array_equal(a, b)  # the input stays zeros
    assert len(I.to_rows(stats)) == 12


# ---- off: nothing traced, the same program ---------------------------------------------------------


def _jaxpr(recipe, x, variables, **autocast):
    def step(v):
        with te_jax.autocast(recipe=recipe, **autocast):
            return value_and_grad(lambda v: jnp.sum(Block().apply(v, x)[0] ** 2))(v)

    return str(jax.make_jaxpr(step)(variables))


def test_inspection_off_traces_nothing_and_leaves_the_program_unchanged(monkeypatch):
    x = jax.random.normal(jax.random.key(0), (64, 64), jnp.bfloat16)
    recipe = R.DelayedScaling(amax_history_len=4)
    with te_jax.autocast(recipe=recipe):
        variables = jax.jit(Block().init)(jax.random.key(1), x)
    default = _jaxpr(recipe, x, variables)
    assert _jaxpr(recipe, x, variables, inspect=False) == default

    def boom(*args, **kwargs):
        raise AssertionError("statistics traced with inspection off")

    monkeypatch.setattr(sys.modules["te_jax.core.gemm_quant"], "tensor_stats", boom)  # every op's statistics
    assert _jaxpr(recipe, x, variables, inspect=False) == default
    with pytest.raises(AssertionError, match="traced with inspection off"):
        with te_jax.autocast(recipe=recipe, inspect=True):
            Block().init(jax.random.key(1), x)


def test_inspection_is_part_of_the_jit_cache_key():
    x = jax.random.normal(jax.random.key(0), (64, 64))
    recipe = R.Float8CurrentScaling()
    with te_jax.autocast(recipe=recipe, inspect=True):
        variables = jax.jit(Block().init)(jax.random.key(1), x)
    traces = []

    @jax.jit
    def f(v):
        traces.append(1)
        return Block().apply(v, x, mutable=[I.STATS_COLLECTION])

    with te_jax.autocast(recipe=recipe):
        f(variables)
    with te_jax.autocast(recipe=recipe, inspect=True):
        _, out = f(variables)
    assert len(traces) == 2 and float(out[I.STATS_COLLECTION]["dense"]["linear_input"]["amax"]) > 0


def test_clear_errors():
    x = jnp.ones((32, 32))
    with te_jax.autocast(recipe=R.Float8CurrentScaling()):
        variables = tf.DenseGeneral(32).init(jax.random.key(0), x)
    with te_jax.autocast(recipe=R.Float8CurrentScaling(), inspect=True):
        with pytest.raises(ValueError, match="inspect=True"):
            tf.DenseGeneral(32).apply(variables, x)
    with pytest.raises(ValueError, match="inspect"):
        te_jax.autocast(inspect=1)
    with pytest.raises(ValueError, match="inspect"):
        te_jax.layernorm_dense(x, jnp.ones(32), jnp.zeros(32), jnp.ones((32, 32)), inspect=4,
                               quantizers=te_jax.core.DenseQuantizers.from_recipe(R.Float8CurrentScaling()))


def test_nan_input_gives_nan_error():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)), jnp.float32).at[3, 5].set(jnp.nan)
    for q in (CurrentScalingQuantizer(), MXFP8Quantizer()):
        assert np.isnan(_stats(x, q.quantize(x))["rel_error"]), q


# ---- rows, tables, writers, the report, the CLI ----------------------------------------------------


def test_rows_tables_and_jsonl(tmp_path):
    x = jax.random.normal(jax.random.key(0), (64, 64))
    _, g = _train_grads(Scanned(), R.Float8CurrentScaling(), x)
    rows = I.to_rows(jax.device_get(g[I.STATS_COLLECTION]), step=3)
    assert rows[0]["layer"] == "layers/dense[0]" and rows[0]["role"] == "linear_input" and rows[0]["step"] == 3
    path = tmp_path / "s.jsonl"
    with I.JsonlWriter(path) as w:
        w.write(g[I.STATS_COLLECTION], step=3, recipe="current")
    back = I.read_jsonl(path)
    assert len(back) == len(rows) and back[0]["recipe"] == "current" and set(I.STAT_NAMES) <= set(back[0])
    assert json.loads(path.read_text().splitlines()[-1])["step"] == 3
    table = I.compare_table({"a": rows, "b": [{**r, "rel_error": r["rel_error"] / 2} for r in rows]})
    assert table.splitlines()[2].endswith(" b") and "mean over tensors" in table
    assert "layers/mlp/wi[2] linear_grad_output" in I.format_table(rows, sort="rel_error")
    averaged = I.mean_over(rows + [{**r, "amax": r["amax"] + 2} for r in rows])
    assert averaged[0]["amax"] == pytest.approx(rows[0]["amax"] + 1)


def test_tensorboard_writer_says_what_to_install(tmp_path):
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            with pytest.raises(ImportError, match="tensorboardX"):
                I.TensorBoardWriter(tmp_path)
            return
    rows = [{"layer": "a", "role": "linear_input", **{n: 1.0 for n in I.STAT_NAMES}}]
    with I.TensorBoardWriter(tmp_path) as w:
        w.write(rows, step=0)
    assert any(tmp_path.iterdir())


def test_report_png(tmp_path):
    pytest.importorskip("matplotlib")
    from te_jax.inspect.report import plot_report

    rows = [{"layer": f"l{i}", "role": role, **{n: (i + 1) * 0.01 for n in I.STAT_NAMES}}
            for i in range(5) for role in ("linear_input", "linear_grad_output")]
    path = plot_report({"a": rows, "b": [{**r, "rel_error": r["rel_error"] * 3} for r in rows]}, tmp_path / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_cli_compares_recipes_on_cpu(tmp_path, capsys):
    from te_jax.inspect import cli

    jsonl = tmp_path / "s.jsonl"
    gallery = Path(__file__).resolve().parents[2] / "recipes" / "mixed_per_layer.py"
    averaged = cli.main(["--recipes", f"current,mxfp8,{gallery}", "--steps", "2", "--layers", "1",
                         "--batch", "4", "--seq-len", "64", "--jsonl", str(jsonl)])
    out = capsys.readouterr().out
    assert set(averaged) == {"current", "mxfp8", "mixed_per_layer"}
    assert "TransformerLayer_0/mlp/wi linear_grad_output" in out and "mean over tensors (rel_error)" in out
    assert len(averaged["current"]) == 12 and len(I.read_jsonl(jsonl)) == 2 * 3 * 12
    with pytest.raises(SystemExit):
        cli.main(["--recipes", "current", "--steps", "1", "--compare", "nope,current"])
