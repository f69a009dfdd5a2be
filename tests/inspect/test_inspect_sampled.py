"""te_jax.inspect with sampled rows (Sample(every=k)): the statistics of the sampled rows, in the ops and the layers."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_inspect import F32, Block, _stats, _train_grads

from te_jax import inspect as I
from te_jax import recipe as R
from te_jax.core import stats as S
from te_jax.quantize import CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_jax.quantize import dequantize


# ---- sampled rows (Sample(every=k)) -----------------------------------------------------------------

SAMPLED_QUANTIZERS = {
    "current": CurrentScalingQuantizer(),
    "mxfp8": MXFP8Quantizer(),
    "nvfp4": NVFP4Quantizer(),
    "block": Float8BlockQuantizer(),  # 1x128
}


def _stats_sampled(x, t, every):
    fn = jax.jit(lambda x, t: S.tensor_stats(x, t, "rowwise", S.Sample(every)))
    return {k: float(v) for k, v in fn(x, t).items()}


@pytest.mark.parametrize("name", sorted(SAMPLED_QUANTIZERS))
@pytest.mark.parametrize("every", [3, 8])
def test_sampled_statistics_are_those_of_the_sampled_rows(name, every):
    """Every statistic but a measured amax equals the whole-tensor statistic of rows 0, k, 2k, ...

    The rows sampled come with their own quantized copy (block scales are per row), so the reference
    is the unsampled statistic of ``x[::k]`` against the same codes and scales, computed in numpy.
    """
    rng = np.random.default_rng(every)
    x = rng.standard_normal((48, 256)).astype(F32) * np.exp(rng.uniform(-4, 4, (48, 1))).astype(F32)  # 3, 8 | 48
    x[5, 7] = 3e4  # the largest value sits in a row the sample skips (5 is not a multiple of 3 or 8)
    x[::every][1, :128] = 0.0  # a zero block (of every block size) in the sample
    t = SAMPLED_QUANTIZERS[name].quantize(jnp.asarray(x), rowwise=True, colwise=False)
    got = _stats_sampled(jnp.asarray(x), t, every)
    values = np.asarray(dequantize(t, jnp.float32))[::every]
    xs = x[::every]
    nonzero = xs != 0
    assert got["underflow"] == pytest.approx(np.sum(nonzero & (values == 0)) / np.sum(nonzero), abs=1e-7)
    want_err = np.sqrt(np.sum((xs.astype(np.float64) - values) ** 2) / np.sum(xs.astype(np.float64) ** 2))
    assert got["rel_error"] == pytest.approx(want_err, rel=1e-5)
    full = _stats(jnp.asarray(x), t)
    if name in ("mxfp8", "block"):  # no measured amax: the sample's own maximum, which misses x[5, 7]
        assert got["amax"] == np.max(np.abs(xs)) < full["amax"] == 3e4
    else:  # the quantizer measured the whole tensor's amax
        assert got["amax"] == full["amax"] == 3e4
    if name != "current":  # block scales: those of the sampled rows
        blocks = {"mxfp8": 32, "nvfp4": 16, "block": 128}[name]
        amax_blocks = np.abs(xs).reshape(xs.shape[0], -1, blocks).max(-1)
        assert 0 < got["scale_log2_range"] and got["scale"] > 0
        assert np.sum(amax_blocks > 0) < amax_blocks.size  # the zero block is left out


@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("every, stride", [(1, 1), (3, 2), (4, 4), (5, 5)])  # 40 rows: 2, 4 and 5 divide them
def test_recomputed_reference_is_asked_for_the_sampled_rows_only(name, every, stride):
    """A fused kernel's output is recomputed for the rows the statistics read, with the same statistics."""
    x = jax.random.normal(jax.random.key(5), (40, 64)) * 3
    t = jax.jit(lambda x: SAMPLED_QUANTIZERS[name].quantize(x, rowwise=True, colwise=False))(x)
    asked = []

    def rows_of_x(rows: slice) -> jax.Array:
        asked.append(rows)
        return x[rows]

    sample = S.Sample(every)
    # jitted (op by op, each small op would compile on its own): rows_of_x is asked while tracing
    got = jax.jit(lambda t: S.tensor_stats(rows_of_x, t, "rowwise", sample))(t)
    want = jax.jit(lambda x, t: S.tensor_stats(x, t, "rowwise", sample))(x, t)
    assert {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in want.items()}
    # the whole tensor's type is read for its sharding (traced, then dropped), then the sampled rows
    assert asked == [slice(None)] + ([slice(None, None, stride)] if stride > 1 else [])


@pytest.mark.parametrize("recipe", [R.Float8CurrentScaling(), R.MXFP8BlockScaling()], ids=["current", "mxfp8"])
def test_layers_recompute_only_the_sampled_rows_with_the_same_statistics(recipe, monkeypatch):
    """In the layers (fused norm, activation and its gradient), recomputing only the sampled rows gives
    the statistics of recomputing the whole tensor and then sampling it (to float32 rounding: XLA may
    sum a norm's row in another order for another shape)."""
    LD = importlib.import_module("te_jax.core.gemm_quant")  # where every functional op computes statistics
    x = jax.random.normal(jax.random.key(0), (96, 64))
    _, rows_only = _train_grads(Block(), recipe, x, inspect=I.Sample(every=3))
    whole_stats = LD.tensor_stats
    monkeypatch.setattr(LD, "tensor_stats", lambda x, t, copy="rowwise", sample=None: whole_stats(
        x(slice(None)) if callable(x) else x, t, copy, sample))
    _, whole = _train_grads(Block(), recipe, x, inspect=I.Sample(every=3))
    a, b = (I.to_rows(g[I.STATS_COLLECTION]) for g in (rows_only, whole))
    assert len(a) == len(b) == 12  # 4 GEMMs x input, weight, grad_output
    for got, want in zip(a, b):
        assert (got["layer"], got["role"]) == (want["layer"], want["role"])
        assert [got[k] for k in S.STAT_NAMES] == pytest.approx([want[k] for k in S.STAT_NAMES], rel=1e-6, abs=0)


def test_sample_one_is_every_row_and_weights_are_read_whole():
    x = jax.random.normal(jax.random.key(3), (64, 64))
    t = NVFP4Quantizer(block_2d=True).quantize(x, rowwise=True, colwise=True)
    full = jax.jit(lambda x, t: S.tensor_stats(x, t, "rowwise"))(x, t)
    for sample in (S.Sample(), S.Sample(every=4)):  # 2D blocks are never sampled
        got = jax.jit(lambda x, t, s=sample: S.tensor_stats(x, t, "rowwise", s))(x, t)
        assert all(np.asarray(got[k]) == np.asarray(full[k]) for k in S.STAT_NAMES)
    t = CurrentScalingQuantizer().quantize(x, rowwise=True, colwise=True)
    full = jax.jit(lambda x, t: S.tensor_stats(x, t, "colwise"))(x, t)
    got = jax.jit(lambda x, t: S.tensor_stats(x, t, "colwise", S.Sample(every=4)))(x, t)
    assert all(np.asarray(got[k]) == np.asarray(full[k]) for k in S.STAT_NAMES)
    assert S.as_sample(True) == S.Sample() and S.as_sample(False) is None


def test_layers_under_sampled_inspection():
    x = jax.random.normal(jax.random.key(0), (64, 64))
    recipe = R.Float8CurrentScaling()
    _, full = _train_grads(Block(), recipe, x)
    _, sampled = _train_grads(Block(), recipe, x, inspect=I.Sample(every=4))
    rows = {(r["layer"], r["role"]): r for r in I.to_rows(full[I.STATS_COLLECTION])}
    for r in I.to_rows(sampled[I.STATS_COLLECTION]):
        want = rows[(r["layer"], r["role"])]
        # per-tensor: the quantizer's own amax, which may differ from the float32 recomputation by an ulp
        assert r["amax"] == pytest.approx(want["amax"], rel=1e-6)
        if r["role"] == "linear_weight":  # weights are read whole
            assert r == want
        else:
            assert 0 < r["rel_error"] < 0.1 and r["rel_error"] == pytest.approx(want["rel_error"], rel=0.25)
    for a, b in zip(jax.tree.leaves(full["params"]), jax.tree.leaves(sampled["params"])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8", np.bool_(True)])
def test_sample_refuses_bad_strides(bad):
    with pytest.raises(ValueError, match="Sample"):
        I.Sample(every=bad)


def test_sample_takes_integer_likes_and_numpy_bools():
    assert I.Sample(every=np.int64(8)) == I.Sample(8) and type(I.Sample(np.int32(2)).every) is int
    assert S.as_sample(np.bool_(True)) == I.Sample() and S.as_sample(np.bool_(False)) is None
    with pytest.raises(ValueError, match="inspect"):
        S.as_sample(1)


@pytest.mark.parametrize("rows, every, stride", [(64, 8, 8), (64, 3, 2), (48, 5, 4), (7, 4, 1), (3, 8, 3)])
def test_the_stride_divides_the_rows(rows, every, stride):
    """Rows 0, k, 2k, ... with k the largest divisor of the rows at most ``every`` (so a sample of a
    sharded tensor stays on each device)."""
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)), jnp.float32)
    t = MXFP8Quantizer().quantize(x, rowwise=True, colwise=False)
    got = _stats_sampled(x, t, every)
    xs = np.asarray(x)[::stride]
    assert got["amax"] == np.max(np.abs(xs))
