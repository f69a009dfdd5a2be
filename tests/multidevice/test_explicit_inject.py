"""Sharding types of the injected products under a mesh with Explicit axes (issue 42, point 4).

The products: ``te_jax.core.dot_general`` / ``einsum`` / ``ragged_dot``,
a batched einsum (heads), ``te_jax.flax.DotGeneral``, ``te_jax.nnx.DotGeneral`` in
``nnx.Linear`` and ``nnx.LinearGeneral``, ``te_jax.flax.Einsum``.

Each must type its output as what it stands for types it (``lax.dot_general``,
``jnp.einsum``, ``lax.ragged_dot`` with ``out_sharding``, the same flax module
outside autocast), a multi-axis output too, and every gradient as its primal,
under per-tensor current, MXFP8 and delayed scaling.
tests/multidevice/explicit_inject_multidevice.py runs the cases in one
subprocess with 8 fake CPU devices and prints a JSON line per case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CASES = [f"{kind}/{r}" for r in ("current", "mxfp8", "delayed")
         for kind in ("core/dot_general", "core/einsum", "core/einsum_batched", "core/ragged_dot",
                      "linen/dot_general_cls", "nnx/dot_general", "nnx/linear_general", "linen/einsum")]


@pytest.fixture(scope="module")
def results() -> dict:
    from qtest_util import run_on_fake_devices

    proc = run_on_fake_devices([HERE / "explicit_inject_multidevice.py"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


def test_every_case_ran(results):
    assert sorted(results) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_injected_product_types(results, name):
    r = results[name]
    assert "error" not in r, r
    assert r["got"] == r["want"], r
