"""Expert parallelism (te_jax.moe.dispatch / combine) on 8 fake CPU devices against one device.

tests/multidevice/moe_multidevice.py runs the cases in a subprocess and prints one JSON line per case; these tests
check that, with tokens split over every mesh axis and experts over "ep" (ep8, and dp2 x ep4):

* the output equals the one-device permute -> grouped FFN -> unpermute bit for bit (float32), with
  random routing, every token's first choice on one expert, and half the experts without tokens;
* the global expert counts are equal and the load-balancing loss too; gradients of x, the router
  logits and both expert weights match to float32 rounding (the weight gradients sum over rows in
  another order);
* a capacity below the dropless one drops exactly the rows past it, per (sender, receiver) pair;
* the compiled HLO holds three all-to-alls forward (the counts, the rows, the results) and five
  forward+backward (the row exchanges' transposes).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from qtest_util import run_on_fake_devices

from te_jax import moe

HERE = Path(__file__).parent
DROPLESS = ("ep8:random:2", "ep8:skew:1", "dp2xep4:empty:2", "dp2xep4:skew:2")
CAPPED = ("ep8:random:2:6", "dp2xep4:skew:1:8")
# Collectives of the compiled expert-parallel MoE. all-reduce: the router's global counts and mean
# probabilities and the dropped-row count (combined by XLA into the numbers below); backward, the
# weight gradients' sum over "dp" where there is one.
FORWARD_COLLECTIVES = {"ep8": {"all-to-all": 3, "all-reduce": 2}, "dp2xep4": {"all-to-all": 3, "all-reduce": 2}}
GRAD_COLLECTIVES = {"ep8": {"all-to-all": 5, "all-reduce": 1}, "dp2xep4": {"all-to-all": 5, "all-reduce": 2}}


@pytest.fixture(scope="module")
def cases() -> dict:
    proc = run_on_fake_devices([HERE.parent / "multidevice" / "moe_multidevice.py", "--cases", ",".join(DROPLESS + CAPPED)], cwd=HERE)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no output; stderr:\n{proc.stderr[-4000:]}"
    return {":".join(str(v) for v in (c["mesh"], c["case"], c["k"], c.get("capacity")) if v is not None): c
            for c in lines}


def _case(cases, name) -> dict:
    case = cases[name]
    assert "error" not in case, case["error"]
    return case


@pytest.mark.parametrize("name", DROPLESS)
def test_expert_parallel_equals_one_device(cases, name):
    case = _case(cases, name)
    assert case["y_equal"], case
    assert case["dropped"] == 0
    assert case["counts_equal"]
    assert case["aux_loss_diff"] <= 1e-6
    assert max(case["grad_rel_diff"].values()) <= 1e-6, case["grad_rel_diff"]


@pytest.mark.parametrize("name", DROPLESS)
def test_collectives(cases, name):
    case = _case(cases, name)
    mesh = case["mesh"]
    assert {k: v for k, v in case["forward_collectives"].items() if v} == FORWARD_COLLECTIVES[mesh]
    assert {k: v for k, v in case["grad_collectives"].items() if v} == GRAD_COLLECTIVES[mesh]


@pytest.mark.parametrize("name", CAPPED)
def test_capacity_drops_the_rows_past_it(cases, name):
    case = _case(cases, name)
    assert case["dropped"] == case["dropped_expected"] > 0
    assert case["y_rel_diff"] <= 1e-6, case  # = one device with the dropped assignments' gates set to 0


def test_dispatch_bad_input_fails_at_trace_time():
    """Under vmap with a named axis (devices simulated): experts not divisible by the axis, capacity < 1."""

    def dispatch_over(devices, capacity):
        x_sorted, sizes = jnp.zeros((devices, 16, 4)), jnp.zeros((devices, 8), jnp.int32)
        fn = jax.vmap(lambda x, s: moe.dispatch(x, s, "ep", capacity=capacity)[0], axis_name="ep")
        return jax.eval_shape(fn, x_sorted, sizes)

    assert dispatch_over(2, None).shape == (2, 32, 4)  # P * C rows, C = 16 by default
    with pytest.raises(ValueError, match="8 experts cannot be split evenly over the 3 devices"):
        dispatch_over(3, None)
    with pytest.raises(ValueError, match="capacity"):
        dispatch_over(2, 0)
