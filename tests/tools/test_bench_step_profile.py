"""benchmarks/bench_step_profile.py on CPU: the kernel categories, and a smoke run of the GPT example's step (the
H200 runs the real presets with tools/gpu_check.py --bench step_profile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import te_jax

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "benchmarks"))

import bench_profile  # noqa: E402


def test_kernel_categories():
    names = {
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "collective",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
        "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128": "gemm",
        "void te_jax::cuda::AmaxKernel<te_jax::cuda::Bf16, 8>(...)": "te_jax",
        "loop_multiply_fusion_3": "xla",
    }
    assert {n: bench_profile.category(n) for n in names} == names
    assert set(names.values()) == set(bench_profile.CATEGORIES)


def test_smoke_run_writes_a_row_per_recipe(tmp_path):
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step_profile.py"), "--preset", "tiny",
                           "--recipes", "bf16,delayed", "--batch", "4", "--seq-len", "64", "--warmup", "1",
                           "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT / "benchmarks",
                          env={**os.environ, "JAX_PLATFORMS": "cpu",
                               "PYTHONPATH": os.pathsep.join([str(Path(te_jax.__file__).resolve().parents[1]),
                                                              str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["bf16", "delayed"]
    assert all(r["wall_ms"] > 0 and r["gaps_ms"] <= r["wall_ms"] for r in rows)
