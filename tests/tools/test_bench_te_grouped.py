"""benchmarks/bench_grouped_gemm.py's layer table without TransformerEngine-JAX (CPU): the --tiny --backward run has
te_jax's rows, no TE row and the not-found line; the pure helpers (group sizes summing to M as TE's grouped GEMM
requires, the aligned row layout, the FLOP count, the relative L2 error, the table) on random inputs. The GPU
machine runs the TE rows (benchmarks/README.md, "Mixture of experts")."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import moe

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "benchmarks"))

import bench_grouped_gemm as bgg  # noqa: E402

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(HAS_TE, reason="TransformerEngine is importable here: the TE rows join")
def test_tiny_backward_runs_without_te(tmp_path):
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_grouped_gemm.py"), "--tiny", "--backward",
                           "--iters", "1", "--trials", "1", "--out", str(out), "--md", str(md)],
                          capture_output=True, text=True, cwd=ROOT / "benchmarks", timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu",
                               "PYTHONPATH": os.pathsep.join([str(Path(te_jax.__file__).resolve().parents[1]),
                                                              str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count(bgg.TE_NOT_FOUND) == 1
    assert f"| {bgg.TE_NAME} " not in md.read_text() and f"| {bgg.TE_NAME} " not in proc.stdout  # no TE row
    result = json.loads(out.read_text())
    assert result["transformer_engine_found"] is False
    assert [r["shape"] for r in result["results"]] == [s[0] for s in bgg.TINY_SHAPES]
    for r, shape in zip(result["results"], bgg.TINY_SHAPES):
        _, experts, top_k, tokens, k, n, skewed = shape
        fb = r["fwd_bwd"]
        assert sum(r["group_sizes"]) == fb["rows"] == tokens * top_k
        fast = f"+{bgg.FAST_BACKWARD}"
        assert list(fb["variants"]) == ["te_jax delayed", "te_jax delayed aligned", "te_jax current",
                                        "te_jax current aligned", f"te_jax delayed{fast}",
                                        f"te_jax delayed{fast} aligned", f"te_jax current{fast}",
                                        f"te_jax current{fast} aligned"]
        assert fb["cross_check"] == {}
        for name, v in fb["variants"].items():
            flops = bgg.fwd_bwd_flops(r["group_sizes"], k, n)
            assert v["ms"] > 0 and v["tflops"] * v["ms"] * 1e9 == pytest.approx(flops) and fb["flops"] == flops
            want_rows = moe.aligned_rows(fb["rows"], experts, 16) if name.endswith("aligned") else fb["rows"]
            assert v["rows"] == want_rows
        # The GEMM table needs whole 128-row groups: the skewed shape has the layer table only.
        assert bool(r["variants"]) != skewed and ("gemms_skipped" in r) == skewed


@pytest.mark.parametrize("seed", range(6))
def test_group_sizes_sum_to_the_rows(seed):
    rng = np.random.default_rng(seed)
    experts, rows, skewed = int(rng.integers(2, 300)), int(rng.integers(0, 100_000)), bool(seed % 2)
    sizes = bgg.group_sizes(experts, rows, skewed)
    assert sizes.dtype == np.int32 and sizes.shape == (experts,) and np.all(sizes >= 0)
    assert int(sizes.sum()) == rows  # TransformerEngine's grouped GEMM checks sum(group_sizes) == M
    if skewed:
        assert sizes[0] >= rows - rows // 2 and len(set(sizes[1:].tolist())) == 1
    else:
        assert sizes.max() - sizes.min() <= 1 and np.all(np.diff(sizes) <= 0)


def test_group_sizes_of_the_benchmark_shapes():
    for label, experts, top_k, tokens, _, _, skewed in bgg.SHAPES + bgg.V3_SHAPES + bgg.TINY_SHAPES:
        sizes = bgg.group_sizes(experts, tokens * top_k, skewed)
        assert int(sizes.sum()) == tokens * top_k, label
        if not skewed:  # balanced: equal groups, whole 128-row spans (the backward's GEMM table)
            assert set(sizes.tolist()) == {tokens * top_k // experts} and not np.any(sizes % 128), label
    assert bgg.group_sizes(3, 0, False).tolist() == [0, 0, 0] and bgg.group_sizes(1, 5, False).tolist() == [5]
    for experts, rows, skewed in ((0, 8, False), (4, -1, False), (1, 8, True)):
        with pytest.raises(ValueError, match="^bench_grouped_gemm: group_sizes needs"):
            bgg.group_sizes(experts, rows, skewed)


def _aligned_loop(sizes, align):
    """Where each routed row goes, one group after another (the reference)."""
    out, start = [], 0
    for m in sizes:
        out += range(start, start + m)
        start += -(-m // align) * align
    return np.asarray(out, np.int64)


@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("seed", range(4))
def test_aligned_row_index(align, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 300, int(rng.integers(1, 12)))
    sizes[rng.random(sizes.shape) < 0.3] = 0  # empty groups
    index = bgg.aligned_row_index(sizes, align)
    assert index.dtype == np.int32
    np.testing.assert_array_equal(index, _aligned_loop(sizes.tolist(), align))
    assert index.size == 0 or index.max() < moe.aligned_rows(int(sizes.sum()), sizes.size, align)
    assert np.all(np.diff(index) > 0)  # distinct rows, the groups' order kept
    starts = index[np.cumsum(sizes)[sizes > 0] - sizes[sizes > 0]]
    assert np.all(starts % align == 0)
    if align == 1:
        np.testing.assert_array_equal(index, np.arange(sizes.sum()))


def test_aligned_row_index_edges():
    assert bgg.aligned_row_index([0, 0], 16).shape == (0,)
    assert bgg.aligned_row_index([5], 16).tolist() == [0, 1, 2, 3, 4]
    for sizes, align in (([3, -1], 16), ([[3]], 16), ([3], 0), ([3], True), ([3], 16.0)):
        with pytest.raises(ValueError, match="^bench_grouped_gemm: aligned_row_index needs"):
            bgg.aligned_row_index(sizes, align)


def test_fwd_bwd_flops():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 2**20, 256).astype(np.int32)  # past int32 once multiplied
    k, n = 7168, 4096
    assert bgg.fwd_bwd_flops(sizes, k, n) == 3 * 2.0 * int(sizes.astype(np.int64).sum()) * k * n
    assert bgg.fwd_bwd_flops([0, 0], k, n) == 0.0


def test_relative_l2():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((37, 5)), rng.standard_normal((37, 5))
    want = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert float(bgg.relative_l2(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))) == pytest.approx(want,
                                                                                                            rel=1e-5)
    a16, b16 = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
    want16 = np.linalg.norm(np.asarray(a16, np.float64) - np.asarray(b16, np.float64)) / np.linalg.norm(
        np.asarray(b16, np.float64))
    assert float(bgg.relative_l2(a16, b16)) == pytest.approx(want16, rel=1e-5)
    zeros = jnp.zeros((3, 4))
    assert float(bgg.relative_l2(zeros, zeros)) == 0.0 and float(bgg.relative_l2(b16, b16)) == 0.0
    assert float(bgg.relative_l2(zeros + 1, zeros)) == np.inf
    assert np.isnan(float(bgg.relative_l2(zeros.at[0, 0].set(jnp.nan), zeros + 1)))
    assert float(bgg.relative_l2(jnp.zeros((0, 4)), jnp.zeros((0, 4)))) == 0.0


@pytest.mark.skipif(HAS_TE, reason="TransformerEngine is importable here")
def test_te_anchor_without_te():
    assert bgg.te_grouped_anchor("delayed", 4) is None and bgg.te_grouped_anchor("current", 4) is None
    with pytest.raises(ValueError, match="^bench_grouped_gemm: the TransformerEngine-JAX anchor takes"):
        bgg.te_grouped_anchor("block", 4)


def test_packed_and_aligned_variants_agree():
    """The layer table's two te_jax layouts of the same rows (skewed sizes, not multiples of the alignment) give the
    same y, dx and dW: the aligned inputs hold the routed rows where aligned_row_index puts them."""
    sizes = bgg.group_sizes(4, 200, True)
    with jax.default_device(jax.devices("cpu")[0]):
        calls, info, failed = bgg.layer_calls("agree", sizes, 64, 32, ["current"])
        assert list(calls) == ["te_jax current", "te_jax current aligned"] and failed == {}
        assert info["te_jax current aligned"] == {"recipe": "current", "rows": moe.aligned_rows(200, 4, 16),
                                                  "anchor": "current"}
        (fn, sets), (fn_al, sets_al) = calls["te_jax current"], calls["te_jax current aligned"]
        y, dx, dw, _ = fn(*sets[1])
        y_al, dx_al, dw_al, _ = fn_al(*sets_al[1])
    index = bgg.aligned_row_index(sizes, 16)
    outside = np.setdiff1d(np.arange(y_al.shape[0]), index)
    assert not np.any(np.asarray(y_al)[outside]) and not np.any(np.asarray(dx_al)[outside])
    for mine, theirs in ((y, y_al[index]), (dx, dx_al[index]), (dw, dw_al)):
        assert float(bgg.relative_l2(theirs, mine)) < 1e-2


def test_fwd_bwd_markdown_with_te_rows():
    te = bgg.TE_NAME
    variants = {"te_jax delayed": {"recipe": "delayed", "rows": 512, "ms": 2.0, "tflops": 600.0},
                f"{te} delayed": {"recipe": "delayed", "rows": 512, "ms": 3.0, "tflops": 400.0},
                "te_jax delayed aligned": {"recipe": "delayed", "rows": 576, "ms": 1.5, "tflops": 800.0},
                "te_jax current": {"recipe": "current", "rows": 512, "error": "JaxRuntimeError: out of memory"}}
    md = bgg.fwd_bwd_markdown([{"shape": "s", "fwd_bwd": {"variants": variants, "cross_check": {
        "delayed": {"y": 0.0123, "dx": 0.02, "dw": 0.5}, "current": {"error": "JaxRuntimeError: oom"}}}},
        {"shape": "t", "fwd_bwd_error": "JaxRuntimeError: out of memory"}])
    rows = [line for line in md.splitlines() if line.startswith(("| s |", "| t |"))]
    assert rows == ["| s | te_jax delayed | 512 | 2.00 | 600 | 1.50x |", f"| s | {te} delayed | 512 | 3.00 | 400 | - |",
                    "| s | te_jax delayed aligned | 576 | 1.50 | 800 | 2.00x |",
                    "| s | te_jax current | 512 | error | - | - |", "| t | (every variant) | - | error | - | - |",
                    "| s | delayed | 1.23e-02 | 2.00e-02 | 5.00e-01 |", "| s | current | error | error | error |"]
    assert "Cross-check" not in bgg.fwd_bwd_markdown([{"shape": "s", "fwd_bwd": {"variants": {}, "cross_check": {}}}])


def test_layer_recipe_fast_backward():
    """``NAME+fast-backward`` is the recipe with backward_fast_accumulation=True (its base names the
    TransformerEngine-JAX row it is compared with); any other option is refused."""
    base, plain = bgg.layer_recipe("delayed")
    assert base == "delayed" and plain.backward_fast_accumulation is False
    base, fast = bgg.layer_recipe(f"current+{bgg.FAST_BACKWARD}")
    assert base == "current" and fast.backward_fast_accumulation is True
    assert dataclasses.replace(fast, backward_fast_accumulation=False) == bgg.layer_recipe("current")[1]
    with pytest.raises(ValueError, match="the one option is"):
        bgg.layer_recipe("delayed+slow")


def test_fast_backward_rows_compare_with_the_base_recipes_anchor():
    te, fast = bgg.TE_NAME, f"+{bgg.FAST_BACKWARD}"
    variants = {f"te_jax delayed{fast}": {"recipe": f"delayed{fast}", "anchor": "delayed", "rows": 512, "ms": 2.5,
                                         "tflops": 480.0},
                f"{te} delayed": {"recipe": "delayed", "rows": 512, "ms": 3.0, "tflops": 400.0}}
    md = bgg.fwd_bwd_markdown([{"shape": "s", "fwd_bwd": {"variants": variants, "cross_check": {}}}])
    assert f"| s | te_jax delayed{fast} | 512 | 2.50 | 480 | 1.20x |" in md.splitlines()


def test_plain_recipes_come_first():
    """Whatever the order asked, each plain recipe's rows come before its +fast-backward ones, so that a
    TransformerEngine-JAX row (built right after the plain te_jax row) is cross-checked with it."""
    fast = f"current+{bgg.FAST_BACKWARD}"
    with jax.default_device(jax.devices("cpu")[0]):
        calls, info, failed = bgg.layer_calls("order", bgg.group_sizes(2, 64, False), 32, 32, [fast, "current"])
    assert list(calls) == ["te_jax current", "te_jax current aligned", f"te_jax {fast}", f"te_jax {fast} aligned"]
    assert info[f"te_jax {fast}"]["anchor"] == "current" and failed == {}
