"""benchmarks/bench_deepgemm.py without a GPU: DeepGEMM's operand layouts against numpy references, the block
quantizers, the shape lists, the timing hook, and the --dry-run end to end (te_jax's side on tiny operands). The
GPU machine runs the real comparison (tools/gpu_check.py --bench deepgemm)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "benchmarks"))

import bench_deepgemm as bd  # noqa: E402
from timing import time_interleaved  # noqa: E402


@pytest.mark.parametrize("m", [1, 3, 4, 5, 64, 130])
def test_mn_major_scales_layout(m):
    """A's scales [M, K/128] as DeepGEMM's SM90 kernels read them: M contiguous, each K block's column a whole number
    of 16 bytes apart, the padding zero."""
    rng = np.random.default_rng(m)
    sf = rng.uniform(0.01, 2.0, (m, 3)).astype(np.float32)
    view = bd.mn_major_scales(sf)
    pitch = (m * 4 + 15) // 16 * 16  # bytes per K block, rounded up to the TMA unit
    assert view.shape == sf.shape and view.strides == (4, pitch)
    np.testing.assert_array_equal(view, sf)
    flat = np.lib.stride_tricks.as_strided(view, (3, pitch // 4), (pitch, 4))  # the whole buffer, padding included
    np.testing.assert_array_equal(flat[:, m:], 0.0)
    assert bd.tma_aligned(m, 4) * 4 == pitch and bd.tma_aligned(m, 2) * 2 == (m * 2 + 15) // 16 * 16


def test_row_groups_and_group_sizes():
    np.testing.assert_array_equal(bd.row_groups((2, 0, 3)), np.array([0, 0, 2, 2, 2], np.int32))
    assert bd.row_groups((0, 0)).shape == (0,) and bd.row_groups((1,)).dtype == np.int32
    assert bd.group_sizes(8, 32768, False) == (4096,) * 8
    skewed = bd.group_sizes(8, 32768, True)
    assert sum(skewed) == 32768 and all(g % 128 == 0 for g in skewed) and skewed[0] > 16000 > skewed[1]
    with pytest.raises(ValueError, match="whole 128-row blocks"):
        bd.group_sizes(3, 384 * 3 + 128, False)
    with pytest.raises(ValueError, match="whole 128-row blocks"):
        bd.group_sizes(256, 8 * 1024, False)  # 32 rows an expert


def test_shapes():
    shapes = bd.shapes()
    assert len(shapes) == len(bd.DENSE_PUBLISHED) + len(bd.GROUPED_PUBLISHED) + len(bd.MOE)
    assert len({s.label for s in shapes}) == len(shapes)
    for s in shapes:
        assert s.k % 128 == 0 and s.m > 0 and s.n > 0
        if s.grouped:
            assert sum(s.groups) == s.m and all(g % 128 == 0 for g in s.groups) and s.n % 128 == 0
    assert sum(s.published is not None for s in shapes) == len(bd.DENSE_PUBLISHED) + len(bd.GROUPED_PUBLISHED)
    e256 = next(s for s in shapes if s.label == "deepseek-v3 E256 gate+up")
    assert (len(e256.groups), e256.k, e256.n, e256.m) == (256, 7168, 4096, 8192 * 8)
    assert bd.Shape("x", 2, 3, 128).flops == 2 * 2 * 3 * 128


def _decoded_error(q, s, x, tile_rows):
    """max |q * s - x| / (max |x| of the block), blockwise (the E4M3 step is 2^-4 relative, 2^-9 of 448 at least)."""
    deq = np.asarray(q).astype(np.float64) * np.repeat(np.repeat(np.asarray(s, np.float64), tile_rows, 0), 128, 1)[
        :x.shape[0]]
    return np.max(np.abs(deq - x))


@pytest.mark.parametrize("n", [128, 192, 1])
def test_quantizers_against_numpy(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 256)).astype(np.float32)
    x[0, :128] = 0.0  # an all-zero block: the scale's floor, zero codes
    q, s = bd.quantize_rows(jnp.asarray(x))
    amax = np.abs(x.reshape(n, 2, 128)).max(-1)
    np.testing.assert_allclose(np.asarray(s), np.maximum(amax, 1e-4) / 448.0, rtol=1e-6)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape and not np.asarray(q)[0, :128].astype(float).any()
    assert _decoded_error(q, s, x, 1) <= np.abs(x).max() * 2.0**-4

    qt, st = bd.quantize_tiles(jnp.asarray(x))
    nb = -(-n // 128)
    pad = np.zeros((nb * 128, 256), np.float32)
    pad[:n] = x
    tamax = np.abs(pad.reshape(nb, 128, 2, 128)).max((1, 3))
    np.testing.assert_allclose(np.asarray(st), np.maximum(tamax, 1e-4) / 448.0, rtol=1e-6)
    assert qt.shape == x.shape and st.shape == (nb, 2)
    assert _decoded_error(qt, st, x, 128) <= np.abs(x).max() * 2.0**-4


def test_reference_rows_of_a_group():
    shape = bd.Shape("g", 256, 128, 256, (128, 128))
    ops = bd.make_operands(shape, jax.random.key(0))
    assert ops["b"].shape == (2, 128, 256) and ops["b_s"].shape == (2, 1, 2) and ops["sizes"].tolist() == [128, 128]
    a = np.asarray(ops["a"]).astype(np.float64) * np.repeat(np.asarray(ops["a_s"], np.float64), 128, 1)
    b1 = np.asarray(ops["b"][1]).astype(np.float64) * np.asarray(ops["b_s"][1], np.float64).repeat(128, 0).repeat(
        128, 1)
    np.testing.assert_allclose(bd.reference_rows(ops, 128, 5, group=1), a[128:133] @ b1.T, rtol=1e-12)
    assert bd.rel_l2(np.ones(4), np.ones(4)) == 0.0 and bd.rel_l2(np.zeros(2), np.ones(2)) == 1.0


def test_torch_results_are_waited_for():
    """time_interleaved calls block_until_ready on what a DeepGEMM variant returns: a TorchDone syncs torch."""
    synced = []

    class FakeCuda:
        @staticmethod
        def synchronize():
            synced.append(1)

    fake_torch = type("FakeTorch", (), {"cuda": FakeCuda})
    bd.check_sync_hook(jax)
    calls = {"deepgemm": (lambda x: bd.TorchDone(fake_torch, x), [(1,), (2,)])}
    times = time_interleaved(calls, warmup=2, iters=3, trials=4)
    assert len(times["deepgemm"]) == 4 and len(synced) == 2 + 4  # every warm-up call, then once per trial


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="with torch the worker would build DeepGEMM from an earlier run's /tmp copy")
def test_precompile_reports_a_failed_worker():
    """The compile workers run in spawned processes; one that fails (here: no torch) fails its shape, no hang."""
    args = argparse.Namespace(jit_workers=2, deepgemm="/nonexistent", cutlass_include=None)
    shapes = [bd.Shape("a", 128, 128, 128), bd.Shape("b", 256, 128, 128, (128, 128))]
    errors = bd.precompile(args, shapes)
    assert set(errors) == {"a", "b"} and all("torch" in e for e in errors.values())


def _run(*argv):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(Path(te_jax.__file__).resolve().parents[1]), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_deepgemm.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT / "benchmarks", timeout=600, env=env)


def test_dry_run_checks_te_jax_side():
    proc = _run("--dry-run", "--only", "E256|grouped 4x8192 N=4096")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "deepseek-v3 E256 gate+up: M=65536 N=4096 K=7168 groups=256" in out
    assert "grouped 4x8192 N=4096 K=7168" in out and "H800 1346 TFLOP/s" in out and "dense M=" not in out
    assert "A scales f32 [32768, 56] strides (1, 32768)" in out
    assert out.count("(ok)") == 2 and "dry run: 0 failure(s)" in out


def test_needs_deepgemm_dir():
    proc = _run("--trials", "1")
    assert proc.returncode != 0 and "give --deepgemm DIR" in proc.stderr


@pytest.mark.skipif(not (ROOT / ".cache" / "deepgemm" / "csrc").is_dir()
                    or not list((ROOT / ".cache" / "cutlass").glob("nvidia_cutlass-*.whl")),
                    reason="needs tools/pack_deepgemm.py's .cache/deepgemm and te_jax's .cache/cutlass wheel")
def test_prepare_source_from_the_pack_and_the_cutlass_wheel(tmp_path, monkeypatch):
    """The copy in /tmp gets CUTLASS's cute/ and cutlass/ from te_jax's nvidia-cutlass wheel when no unpacked headers
    are there, and is made once per pack."""
    root = tmp_path / "checkout"
    (root / ".cache" / "cutlass").mkdir(parents=True)
    wheel = sorted((ROOT / ".cache" / "cutlass").glob("nvidia_cutlass-*.whl"))[-1]
    (root / ".cache" / "cutlass" / wheel.name).symlink_to(wheel)
    monkeypatch.setattr(bd, "ROOT", root)
    monkeypatch.setattr(bd, "WORK", tmp_path / "work")
    args = argparse.Namespace(deepgemm=str(ROOT / ".cache" / "deepgemm"), cutlass_include=None)
    src = bd.prepare_source(args)
    include = src / "deep_gemm" / "include"
    for header in ("cute/arch/copy_sm90_tma.hpp", "cutlass/arch/barrier.h", "deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh"):
        assert (include / header).is_file(), header
    assert (src / "third-party" / "fmt" / "include" / "fmt" / "format.h").is_file()
    marker = src / "csrc" / "marker"
    marker.write_text("kept")
    assert bd.prepare_source(args) == src and marker.exists()  # the same pack: not copied again
    with pytest.raises(SystemExit, match="not DeepGEMM's source"):
        bd.prepare_source(argparse.Namespace(deepgemm=str(tmp_path), cutlass_include=None))
