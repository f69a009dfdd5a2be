"""8-device checks of the FP8 state reduction; run by tests/train/test_state.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (so the main pytest process keeps one device).

Prints "ALL OK" when every check passes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from te_jax import recipe as R
from te_jax.train import value_and_grad

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8_models import MLP  # noqa: E402

assert jax.device_count() == 8, jax.devices()
REC = R.DelayedScaling(amax_history_len=3)
ROWS = 64
# rows scaled so that every device's shard has a different amax
X = jax.random.normal(jax.random.key(0), (ROWS, 32)) * jnp.repeat(jnp.arange(1.0, 9.0), ROWS // 8)[:, None]
Y = jnp.sin(X)
with te_jax.autocast(recipe=REC):
    VARIABLES = jax.jit(MLP().init)(jax.random.key(1), X[:8])


def loss_grads(rec, mesh_resource=None):
    def grads(variables, x, y):
        with te_jax.autocast(recipe=rec, mesh_resource=mesh_resource):
            # a sum, so each row's gradient does not depend on how the batch is split
            return value_and_grad(lambda v: jnp.sum((MLP().apply(v, x) - y) ** 2))(variables)[1]

    return grads


def bits_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(u).view(np.uint32), np.asarray(v).view(np.uint32)) for u, v in zip(la, lb))


def per_device(tree, n=8):
    return [jax.tree.map(lambda v: v[i], tree) for i in range(n)]


def sharded(rec, axes=("dp",), shape=(8,), mesh_resource=None, check_vma=True, pmean=False):
    """fp8 updates (and those after a lax.pmean over the whole gradient tree), one per device."""
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
    grads_fn = loss_grads(rec, mesh_resource)

    def step(variables, x, y):
        grads = grads_fn(variables, x, y)
        averaged = lax.pmean(grads, axes) if pmean else grads
        stack = lambda t: jax.tree.map(lambda v: v[None], t)  # noqa: E731
        return stack(grads["fp8_meta"]), stack(averaged["fp8_meta"])

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(axes), P(axes)), out_specs=(P(axes), P(axes)),
                      check_vma=check_vma)
    got, averaged = jax.jit(f)(VARIABLES, X, Y)
    return per_device(got), per_device(averaged)


def check(name, ok):
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        raise SystemExit(1)


reference = jax.jit(loss_grads(REC))(VARIABLES, X, Y)["fp8_meta"]  # one device, whole batch
x_amaxes = np.abs(np.asarray(X)).reshape(8, ROWS // 8, 32).max(axis=(1, 2))

for check_vma in (True, False):
    got, averaged = sharded(REC, check_vma=check_vma, pmean=True)
    check(f"check_vma={check_vma}: every device has the single-device, whole-batch update",
          all(bits_equal(g, reference) for g in got))
    # XLA's all-reduce sums the 8 identical copies one by one (3x, 5x, ... round), so the mean can
    # move by an ulp; it stays identical on every device.
    check(f"check_vma={check_vma}: after lax.pmean over the gradient tree, still identical on every device",
          all(bits_equal(a, averaged[0]) for a in averaged))
    check(f"check_vma={check_vma}: and unchanged up to the all-reduce's rounding (2 ulp)",
          all(np.allclose(u, v, rtol=2.4e-7, atol=0) for u, v in zip(jax.tree.leaves(averaged[0]),
                                                                    jax.tree.leaves(got[0]))))

got, _ = sharded(dataclasses.replace(REC, amax_reduction="mean"), check_vma=False)
first = [float(g["wi"]["linear_input"]["amax_history"][-1]) for g in got]
check("amax_reduction='mean': identical on every device", len(set(first)) == 1)
check("amax_reduction='mean': the mean of the local amaxes", np.isclose(first[0], x_amaxes.mean(), rtol=1e-6))

got, _ = sharded(dataclasses.replace(REC, reduce_amax=False), check_vma=False)
local = [float(g["wi"]["linear_input"]["amax_history"][-1]) for g in got]
check("reduce_amax=False: each device keeps its own amax", np.array_equal(local, x_amaxes))

# A 4x2 mesh with the batch split over both axes: MeshResource picks the axes reduced over.
both = te_jax.MeshResource(dp_resource="dp", tp_resource="tp")
got, _ = sharded(REC, ("dp", "tp"), (4, 2), mesh_resource=both, check_vma=False)
check("MeshResource(dp, tp): the global update", all(bits_equal(g, reference) for g in got))
got, _ = sharded(REC, ("dp", "tp"), (4, 2), mesh_resource=te_jax.MeshResource(dp_resource="dp"), check_vma=False)
inputs = np.array([float(g["wi"]["linear_input"]["amax_history"][-1]) for g in got]).reshape(4, 2)
check("MeshResource(dp): reduced over dp only", np.all(inputs == inputs[:1]) and inputs[0, 0] != inputs[0, 1])
check("MeshResource(dp): the max over dp of each tp column",
      np.array_equal(inputs[0], x_amaxes.reshape(4, 2).max(axis=0)))

# jit with sharded arrays (no shard_map): amaxes are global values, nothing to reduce.
mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Explicit,))
xs, ys = (jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in (X, Y))
replicated = jax.device_put(VARIABLES, NamedSharding(mesh, P()))
with jax.set_mesh(mesh):
    under_jit = jax.jit(loss_grads(REC))(replicated, xs, ys)["fp8_meta"]
check("jit with shardings: the global update", bits_equal(under_jit, reference))

print("ALL OK")
