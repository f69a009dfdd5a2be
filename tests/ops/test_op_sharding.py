"""Sharding rules of the quantize, dequantize, norm and activation custom calls.

The checks need 8 devices, so ``op_sharding_multidevice.py`` runs them in a
subprocess whose XLA_FLAGS asks for 8 fake CPU devices (the pytest process's
own jax keeps its one device). Each case line says whether the sharded op gave
the unsharded bits, the expected output shardings and collective counts.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.ops import norm_act as A
from te_jax.ops.cast import CastSpec
from te_jax.quantize import MXFP8Quantizer
from te_jax.quantize import fused as qfused
from te_jax.ops.dequantize import dequantize
from qtest_util import run_on_fake_devices

HELPER = pathlib.Path(__file__).resolve().parents[1] / "multidevice" / "op_sharding_multidevice.py"
FAMILIES = ("quantize/", "dequantize/", "nvfp4_sr/", "norm_fwd/", "norm_bwd/", "act_fwd/", "act_bwd/", "misaligned/")


@pytest.fixture(scope="module")
def results() -> dict:
    proc = run_on_fake_devices([HELPER], timeout=1200, cwd=HELPER.parent)
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = proc.stdout.splitlines()
    assert lines and lines[-1] == "ALL OK", proc.stdout[-6000:]
    return {r["case"]: r for r in map(json.loads, lines[:-1])}


@pytest.mark.parametrize("family", FAMILIES)
def test_op_family_sharding(results, family):
    cases = {name: r for name, r in results.items() if name.startswith(family)}
    assert cases, f"no {family} cases ran"
    failed = {name: r["errors"] for name, r in cases.items() if not r["ok"]}
    assert not failed, failed



# ---- the gated pair layout, on one device ---------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "mxfp8", "nvfp4"])
def test_pair_axis_equals_flat_layout(mode):

    spec = CastSpec(mode, jnp.float8_e4m3fn if mode == "mxfp8" else None, True, mode != "none", rht=mode == "nvfp4")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 32, 2, 64)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(3, 32, 64)), jnp.float32)
    flat = x.reshape(3, 32, 128)
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    fwd = A.act_fwd(x, act="swiglu", spec=spec, pair_axis=True)
    for got, want in zip(fwd, A.act_fwd(flat, act="swiglu", spec=spec)):
        np.testing.assert_array_equal(bits(got), bits(want))
    (pair, db), (ref, db_ref) = (A.act_bwd(dy, a, act="swiglu", spec=spec, dbias=True, pair_axis=p)
                                 for a, p in ((x, True), (flat, False)))
    assert pair.q.shape[:2] == (96, 2) and db.shape == (2, 64)
    for got, want in zip((*pair, db), (*ref, db_ref)):
        np.testing.assert_array_equal(bits(got).reshape(-1), bits(want).reshape(-1))
    # vmap and the reference backend keep working with the pair layout.
    vm = jax.vmap(lambda d, a: A.act_bwd(d, a, act="swiglu", spec=spec, pair_axis=True)[0].q)(dy, x)
    np.testing.assert_array_equal(bits(vm[1]), bits(A.act_bwd(dy[1], x[1], act="swiglu", spec=spec,
                                                               pair_axis=True)[0].q))
    refd = A.act_bwd(dy, x, act="swiglu", spec=spec, pair_axis=True, backend="reference")[0]
    assert refd.q.shape == pair.q.shape and refd.q_t.shape == pair.q_t.shape


def test_pair_axis_activation_grad_scaled_tensor():

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(64, 2, 64)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)
    q = MXFP8Quantizer()
    dx, db = qfused.activation_grad(dy, x, "geglu", q, dbias=True, colwise=True, pair_axis=True)
    dx_flat, db_flat = qfused.activation_grad(dy, x.reshape(64, 128), "geglu", q, dbias=True, colwise=True)
    assert dx.shape == (64, 2, 64) and dx.flatten_axis == -2 and dx.data.shape == (64, 128)
    np.testing.assert_array_equal(np.asarray(dequantize(dx)).reshape(64, 128), np.asarray(dequantize(dx_flat)))
    np.testing.assert_array_equal(np.asarray(db).reshape(-1), np.asarray(db_flat))
    with pytest.raises(ValueError, match="pair_axis"):
        A.act_fwd(x, act="gelu", pair_axis=True)
