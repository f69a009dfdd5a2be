"""Sharding types under meshes with Explicit axes (``jax.make_mesh``'s default), and MeshResource's axes.

Issue 42, point 4: every te_jax op and layer gives its output (and its
gradients) the sharding type jax gives its flax / jnp equivalent, so that a
user's ``nn.with_logical_constraint`` (an assert under Explicit axes) holds:
te_jax.ops (quantize, dequantize, GEMM, norm and activation, grouped GEMM,
under vmap too), te_jax.core's grouped ops, the Linen layers under every
recipe, the NNX layers, the MoE (expert parallel or not), on Explicit, mixed
Explicit/Auto and Auto meshes; and the compiled step on an Explicit mesh has
Auto's values and collectives (the types move no data).

Point 3: a MeshResource axis the mesh in scope lacks raises at trace time
(shard_map, ``jax.set_mesh``, plain jit on NamedSharding operands) instead of
reducing amaxes over nothing.

tests/multidevice/explicit_types_multidevice.py runs every case in one
subprocess with 8 fake CPU devices (types come from traced jaxprs; two steps
compile) and prints a JSON line per case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).parent
RECIPES = ("bf16", "delayed", "current", "mxfp8", "nvfp4", "block")
LINEN = ("dense", "ln", "lndense", "mlp", "mlp_swiglu")
CASES = (
    [f"linen/{layer}/{r}" for r in RECIPES for layer in LINEN]
    + [f"nnx/{layer}/{r}" for r in RECIPES for layer in ("dense", "ln", "lndense", "mlp")]
    + ["linen/with_logical_constraint"]
    + [f"ops/{name}" for name in (
        "quantize_fp8_tensor", "quantize_fp8_current", "quantize_mxfp8", "quantize_nvfp4", "quantize_fp8_block",
        "dequantize_mxfp8", "gemm_mxfp8", "gemm_mxfp8_split_k", "norm_fwd", "act_bwd", "normalize",
        "activation_gelu", "activation_swiglu", "activation_swiglu_pair", "vmap_quantize", "grouped_gemm_bf16")]
    + [f"core/grouped/{r}" for r in ("bf16", "current", "mxfp8", "delayed")]
    + [f"moe/linen/{r}/{ep}" for r in ("bf16", "delayed", "current", "mxfp8") for ep in ("no_ep", "ep")]
    + ["moe/nnx/current/ep"]
    + [f"mixed/{mesh}/{layer}" for mesh in ("explicit_dp_fsdp_auto_tp", "auto") for layer in ("dense", "mlp")]
    + [f"mesh_axes/{name}" for name in ("shard_map_misnamed", "shard_map_named", "set_mesh_misnamed",
                                        "operand_mesh_misnamed")]
    + ["numerics/current", "numerics/mxfp8"]
)


@pytest.fixture(scope="module")
def results() -> dict:
    from qtest_util import run_on_fake_devices

    proc = run_on_fake_devices([HERE / "explicit_types_multidevice.py"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


def test_every_case_ran(results):
    assert sorted(results) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_explicit_types(results, name):
    r = results[name]
    assert "error" not in r, r
    assert r["got"] == r["want"], r
