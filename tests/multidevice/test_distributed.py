"""Layers under jit on 8-device meshes (dp8, dp2xtp4, fsdp4xtp2, dp2xfsdp2xtp2 with sequence parallel).

tests/multidevice/mesh_multidevice.py runs the cases in a subprocess with 8 fake CPU
devices and prints one JSON line per case; these tests check them:

* the loss, the gradients and the fp8_meta update equal a one-device run to
  fp32 rounding (the only difference is the order of a split contraction's
  sum), for a LayerNormMLP and a two-TransformerLayer stack;
* the fp8_meta update is bit-identical on every device;
* the compiled step holds exactly the collectives listed in ``COLLECTIVES``
  and moves weights and activations as FP8, one byte per element: every
  all-gather of a matrix the SPMD partitioner emits is FP8 (checked in XLA's
  dump after partitioning, since the CPU backend later carries FP8 collectives
  in f16); high precision is gathered only for 1-D norm/bias vectors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from qtest_util import run_on_fake_devices

HERE = Path(__file__).parent
MESHES = ("dp8", "dp2xtp4", "fsdp4xtp2", "dp2xfsdp2xtp2_sp")
RECIPES = ("delayed", "current")


def _per_recipe(all_reduce: tuple[int, int], all_gather: int = 0, reduce_scatter: int = 0) -> dict:
    """The nonzero collective counts of one step under "delayed" and "current" scaling.

    The two recipes differ only in their all-reduces: ``all_reduce`` is delayed's count, then current's.
    """
    def counts(reduces: int) -> dict[str, int]:
        found = {"all-gather": all_gather, "all-reduce": reduces, "reduce-scatter": reduce_scatter}
        return {name: count for name, count in found.items() if count}

    return {"delayed": counts(all_reduce[0]), "current": counts(all_reduce[1])}


# The collectives of the compiled fwd+bwd step, per model and mesh, for each recipe.
#  all-reduce: the amaxes (max; XLA combines those of one dependency level: delayed scaling reduces
#   once at the end, current scaling needs each amax before its cast), the row-parallel GEMM's output
#   and the column-parallel GEMM's dgrad over tp, the data-parallel gradient sum (with the loss).
#  all-gather (FSDP): each weight in FP8 for the forward and again for the backward, and the f32
#   norm/bias vectors split over fsdp.
#  sequence parallel: the FP8 all-gathers of the norm output's two copies and of dy over tp, and a
#   reduce-scatter (not an all-reduce) of the row-parallel output and of the column-parallel dgrad.
COLLECTIVES = {
    ("mlp", "dp8"): _per_recipe(all_reduce=(2, 4)),
    ("mlp", "dp2xtp4"): _per_recipe(all_reduce=(5, 5)),
    ("mlp", "fsdp4xtp2"): _per_recipe(all_reduce=(5, 6), all_gather=7),
    ("mlp", "dp2xfsdp2xtp2_sp"): _per_recipe(all_reduce=(6, 8), all_gather=11, reduce_scatter=2),
    ("stack", "dp8"): _per_recipe(all_reduce=(2, 16)),
    ("stack", "dp2xtp4"): _per_recipe(all_reduce=(11, 23)),
    ("stack", "fsdp4xtp2"): _per_recipe(all_reduce=(11, 24), all_gather=24),
    ("stack", "dp2xfsdp2xtp2_sp"): _per_recipe(all_reduce=(6, 20), all_gather=40, reduce_scatter=8),
}
# The same LayerNormMLP step ending in an SGD update whose result keeps the parameters' shardings: the
# FSDP weight gradients are reduce-scattered (W1, W2), not all-reduced; with sequence parallelism one
# more reduce-scatter is the row-parallel output's.
SGD_COLLECTIVES = {
    "dp8": _per_recipe(all_reduce=(1, 3)),
    "dp2xtp4": _per_recipe(all_reduce=(2, 5)),
    "fsdp4xtp2": _per_recipe(all_reduce=(2, 6), all_gather=5, reduce_scatter=2),
    "dp2xfsdp2xtp2_sp": _per_recipe(all_reduce=(3, 7), all_gather=9, reduce_scatter=3),
}
FP8_CARRIERS = ("f8e4m3fn", "f8e5m2", "u8", "f16")  # f16: XLA CPU's carrier for an FP8 all-gather
FP8 = ("f8e4m3fn", "f8e5m2")


# The default LLVM optimization level for these programs (tools/run_tests.sh lowers it): "equal to one
# device to fp32 rounding" assumes a split contraction sums like the whole one but for the order of its
# partial sums; at level 0 XLA:CPU sums the dp2xtp4 stack's in another order, so one current-scaling amax
# moves by an ulp and with it FP8 codes of the tensor it scales.
OPT_LEVEL = "--xla_backend_optimization_level=2"


def _run(args: list[str], dump: Path, devices: int = 8) -> list[dict]:
    proc = run_on_fake_devices([HERE / "mesh_multidevice.py", *args], devices=devices, timeout=1200, cwd=HERE,
                               xla_flags=f"{OPT_LEVEL} --xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no output; stderr:\n{proc.stderr[-4000:]}"
    return lines


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    out = {}
    dump = tmp_path_factory.mktemp("hlo")
    for line in _run(["--models", "mlp,stack,mlp_sgd", "--meshes", ",".join(MESHES), "--recipes", ",".join(RECIPES)], dump):
        if "model" in line:
            out[(line["model"], line["mesh"], line["recipe"])] = line
    return out


def _case(cases, *key) -> dict:
    case = cases[key]
    assert "error" not in case, case["error"]
    return case


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("model", ("mlp", "stack"))
def test_matches_one_device(cases, model, mesh, recipe):
    case = _case(cases, model, mesh, recipe)
    assert max(case["errors"].values()) <= 1e-5, case["errors"]
    assert case["fp8_same_everywhere"]
    assert case["verdict"] == "exact"


def test_verdict_judges_against_the_noise_floor():
    """The GPU mesh check's verdict: exact, within NOISE_FACTOR of the floor, or not."""
    import mesh_multidevice as mm

    exact = {"loss": 1e-7, "x": 2e-6, "params": 9e-6, "fp8_meta": 0.5}  # fp8_meta is not judged
    assert mm.verdict(exact, None, True) == "exact"
    assert mm.verdict(exact, None, False) == "fp8 state differs between devices"
    floor = {"loss": 2e-3, "x": 4e-2, "params": 8e-2}
    noisy = {"loss": 7e-3, "x": 6e-2, "params": 0.11, "fp8_meta": 1e-2}
    assert mm.verdict(noisy, floor, True) == "within noise"
    assert mm.verdict(noisy, None, True) == "mismatch"  # no floor: nothing to judge against
    assert mm.verdict({**noisy, "loss": 9e-3}, floor, True) == "mismatch"  # loss 4.5x its floor
    assert mm.verdict(noisy, {**floor, "params": 0.0}, True) == "mismatch"


def test_mesh_check_fails_a_broken_partitioning(tmp_path):
    """Current scaling with each device's own amax (--inject-fault local-amax): the check says mismatch.

    A single layer fails as inexact, the two-layer stack against its noise floor (on CPU: loss about
    15x its floor); the check passes without the fault (test_matches_one_device).
    """
    lines = _run(["--models", "mlp,stack", "--meshes", "tp2", "--recipes", "current_split", "--check",
                  "--inject-fault", "local-amax"], tmp_path, devices=2)
    verdicts = {r["model"]: r.get("verdict", r.get("error")) for r in lines if "model" in r}
    assert verdicts == {"mlp": "mismatch", "stack": "mismatch"}, lines


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("model", ("mlp", "stack"))
def test_collectives(cases, model, mesh, recipe):
    case = _case(cases, model, mesh, recipe)
    assert {k: v for k, v in case["counts"].items() if v} == COLLECTIVES[(model, mesh)][recipe]
    for gathered in case["all_gathers"]:
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", gathered).groups()
        assert dtype in FP8_CARRIERS or dims.count(",") == 0, f"high-precision all-gather of a matrix: {gathered}"
    # What the SPMD partitioner emitted (before the CPU backend widens FP8 collectives): matrices move as FP8.
    partitioned = case["partitioned_all_gathers"]
    assert partitioned is not None and len(partitioned) == len(case["all_gathers"])
    for gathered in partitioned:
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", gathered).groups()
        assert dtype in FP8 or dims.count(",") == 0, f"a matrix gathered in {dtype}, not FP8: {gathered}"


def test_logical_axis_rules_extend_the_users():
    import te_jax
    from te_jax.ops.sharding import logical_axis_rules

    res = te_jax.MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp", sp_resource="tp")
    rules = dict(logical_axis_rules(res, (("vocab", "tp"), ("mlp", None))))
    assert rules["vocab"] == "tp" and rules["mlp"] is None  # the user's mappings win
    assert rules["embed"] == "fsdp" and rules["heads"] == "tp" and rules["length"] == "tp"
    assert rules["batch"] == ("dp", "fsdp") and rules["kv"] is None and rules["qkv"] is None
    assert dict(logical_axis_rules(te_jax.MeshResource(dp_resource="dp")))["embed"] is None
    assert rules["expert"] is None
    ep = dict(logical_axis_rules(te_jax.MeshResource(dp_resource="dp", ep_resource="ep")))
    assert ep["expert"] == "ep" and ep["batch"] == ("dp", "ep")  # tokens are split over the expert axis too
    with pytest.raises(TypeError, match="MeshResource"):
        logical_axis_rules({"dp_resource": "dp"})


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("mesh", MESHES)
def test_sgd_step_reduce_scatters_fsdp_gradients(cases, mesh, recipe):
    case = _case(cases, "mlp_sgd", mesh, recipe)
    assert case["errors"]["params"] <= 1e-5, case["errors"]
    assert {k: v for k, v in case["counts"].items() if v} == SGD_COLLECTIVES[mesh][recipe]
    for gathered in case["partitioned_all_gathers"]:
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", gathered).groups()
        assert dtype in FP8 or dims.count(",") == 0, f"a matrix gathered in {dtype}, not FP8: {gathered}"
