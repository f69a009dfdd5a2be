"""Expert parallelism on 8 fake CPU devices; run by tests/moe/test_moe_dispatch.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8.

For every mesh and routing case it prints one JSON line: whether the expert-parallel MoE (tokens split over
every axis, experts over "ep") equals the one-device computation, the largest gradient differences, the
dropped-row count, and the collectives in the compiled forward and forward+backward HLO.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from te_jax import moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_util import grouped_ffn, moe_weights, routing_logits  # noqa: E402

T, E, H, F = 128, 8, 16, 32
MESHES = {"ep8": ((8,), ("ep",)), "dp2xep4": ((2, 4), ("dp", "ep"))}
KINDS = ("all-to-all", "all-reduce", "all-gather", "collective-permute")


def collective_counts(hlo: str) -> dict[str, int]:
    """Instructions per collective kind (an instruction line is "name = shape kind(operands)")."""
    return {k: len(re.findall(rf"^\s*\S+ = .*\s{k}(?:-start)?\(", hlo, re.MULTILINE)) for k in KINDS}


def one_device(x, logits, w_in, w_out, k):
    r = moe.route(logits, k)
    y = moe.apply_experts(x, r.expert_ids, r.gates, grouped_ffn(w_in, w_out), num_experts=E)
    return y, r.aux_loss, r.tokens_per_expert


def expert_parallel(mesh, k, capacity=None):
    tokens = tuple(mesh.axis_names)  # tokens split over every axis, experts over "ep" only

    def body(x, logits, w_in, w_out):
        r = moe.route(logits, k, axis_name=tokens)
        x_sorted, perm = moe.permute(x, r.expert_ids, E)
        x_local, local_sizes, exchange = moe.dispatch(x_sorted, perm.group_sizes, "ep", capacity=capacity)
        y_sorted = moe.combine(grouped_ffn(w_in, w_out)(x_local, local_sizes), exchange, "ep")
        y = moe.unpermute(y_sorted, perm, r.gates)
        return y, r.aux_loss, r.tokens_per_expert, jax.lax.psum(exchange.dropped, tokens)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(tokens), P(tokens), P("ep"), P("ep")),
                         out_specs=(P(tokens), P(), P(), P()))


def loss_of(fn, cotangent):
    def loss(x, logits, w_in, w_out):
        y, aux_loss = fn(x, logits, w_in, w_out)[:2]
        return jnp.sum(y * cotangent) + aux_loss

    return jax.grad(loss, argnums=(0, 1, 2, 3))


def dropped_expected(expert_ids: np.ndarray, devices_on_tokens: int, ep_size, capacity: int) -> np.ndarray:
    """Which assignments [T, k] a per-pair capacity drops: per token shard and destination, those past
    ``capacity`` in the shard's stable by-expert order."""
    tokens_per_shard = expert_ids.shape[0] // devices_on_tokens
    k = expert_ids.shape[1]
    experts_per_device = E // ep_size
    dropped = np.zeros(expert_ids.size, bool)
    for shard in range(devices_on_tokens):
        flat = expert_ids[shard * tokens_per_shard:(shard + 1) * tokens_per_shard].reshape(-1)
        seen = np.zeros(ep_size, int)
        for a in np.argsort(flat, kind="stable"):
            dest = flat[a] // experts_per_device
            dropped[shard * tokens_per_shard * k + a] = seen[dest] >= capacity
            seen[dest] += 1
    return dropped.reshape(expert_ids.shape)


def run_case(mesh_name: str, case: str, k: int, capacity: int | None) -> dict:
    shape, axes = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
    x = jax.random.normal(jax.random.key(0), (T, H))
    logits = routing_logits(1, T, E, case)
    w_in, w_out = moe_weights(2, E, H, F)
    cotangent = jax.random.normal(jax.random.key(3), (T, H))
    args = (x, logits, w_in, w_out)
    out = {"mesh": mesh_name, "case": case, "k": k, "capacity": capacity}

    ep_fn = jax.jit(expert_parallel(mesh, k, capacity))
    y, aux_loss, counts, dropped = ep_fn(*args)
    y_one, aux_one, counts_one = jax.jit(one_device, static_argnums=4)(*args, k)
    out["dropped"] = int(dropped)
    if capacity is None:
        out["y_equal"] = bool(np.array_equal(y, y_one))
    else:  # the one-device result with the dropped assignments' gates zeroed
        r = moe.route(logits, k)
        keep = ~dropped_expected(np.asarray(r.expert_ids), 8, dict(zip(axes, shape))["ep"], capacity)
        out["dropped_expected"] = int((~keep).sum())
        y_want = jax.jit(lambda *a: moe.apply_experts(*a, num_experts=E), static_argnums=3)(
            x, r.expert_ids, r.gates * keep, grouped_ffn(w_in, w_out))
        # A different program (the gates masked before the FFN): equal up to float32 rounding, which XLA:CPU's
        # fusion choices (they differ between processors) may place differently.
        out["y_rel_diff"] = float(jnp.max(jnp.abs(y - y_want)) / jnp.maximum(jnp.max(jnp.abs(y_want)), 1e-30))
    out["y_max_diff"] = float(jnp.max(jnp.abs(y - y_one)))
    out["aux_loss_diff"] = float(abs(aux_loss - aux_one))
    out["counts_equal"] = bool(np.array_equal(counts, counts_one))

    if capacity is None:
        grads = jax.jit(loss_of(expert_parallel(mesh, k), cotangent))(*args)
        grads_one = jax.jit(loss_of(lambda *a: one_device(*a, k), cotangent))(*args)
        out["grad_rel_diff"] = {
            name: float(jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30))
            for name, g, w in zip(("x", "logits", "w_in", "w_out"), grads, grads_one)
        }
        out["forward_collectives"] = collective_counts(ep_fn.lower(*args).compile().as_text())
        out["grad_collectives"] = collective_counts(
            jax.jit(loss_of(expert_parallel(mesh, k), cotangent)).lower(*args).compile().as_text())
    return out


def main_over_cases(default_cases: str, run: Callable[..., dict], labels: Callable[..., dict],
                    first: Callable[[], dict] | None = None) -> None:
    """A fake-device script's main: one JSON line per ``--cases`` spec (comma-separated, its fields split at ":").

    Each line is ``run(*fields)``, or where that raised ``labels(*fields)`` with the "error"; ``first()``'s
    line, if given, comes before them.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=default_cases)
    args = parser.parse_args()
    assert jax.device_count() == 8, jax.devices()
    if first is not None:
        print(json.dumps(first()), flush=True)
    for spec in args.cases.split(","):
        fields = spec.split(":")
        label = labels(*fields)
        try:
            line = run(*fields)
        except Exception as e:  # noqa: BLE001 -- reported per case, the test fails on it
            line = {**label, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(line), flush=True)


def main() -> None:
    main_over_cases("ep8:random:2,dp2xep4:random:2",
                    lambda mesh_name, case, k, *capacity: run_case(mesh_name, case, int(k),
                                                                   int(capacity[0]) if capacity else None),
                    lambda mesh_name, case, k, *capacity: {"mesh": mesh_name, "case": case, "k": int(k)})


if __name__ == "__main__":
    main()
