"""8-device checks of the te_jax.nnx layers; run by tests/nnx/test_nnx.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (so the main pytest process keeps one device).

* data parallel in shard_map: the amaxes are reduced over the ``te_jax.MeshResource`` data axis, so every
  device steps its FP8Meta to the single-device, whole-batch state;
* data x tensor parallel under jit: a TransformerLayer whose parameters carry logical axis names
  (``out_sharding`` metadata, mapped by ``te_jax.ops.sharding.logical_axis_rules``) trains like on one device.

Prints "ALL OK" when every check passes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from te_jax import nnx as te_nnx
from te_jax import recipe as R
from te_jax.ops.sharding import logical_axis_rules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qtest_util import same_bits  # noqa: E402

assert jax.device_count() == 8, jax.devices()
REC = R.DelayedScaling(amax_history_len=3)


def check(name, ok):
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        raise SystemExit(1)


def bits_equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        same_bits(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def fp8_meta(model):
    return nnx.to_pure_dict(nnx.state(model, te_nnx.FP8Meta))


# ---- data parallel in shard_map: MeshResource amax reduction ------------------------------------

ROWS = 64
# rows scaled so that every device's shard has a different amax
X = jax.random.normal(jax.random.key(0), (ROWS, 32)) * jnp.repeat(jnp.arange(1.0, 9.0), ROWS // 8)[:, None]
Y = jnp.sin(X)
with te_jax.autocast(recipe=REC):
    MLP = te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(1))
GRAPHDEF, STATE = nnx.split(nnx.clone(MLP))  # a copy: MLP itself steps on one device below


def dp_step(recipe, mesh_resource):
    def step(state, x, y):
        model = nnx.merge(GRAPHDEF, state)
        with te_jax.autocast(recipe=recipe, mesh_resource=mesh_resource):
            # a sum, so each row's gradient does not depend on how the batch is split
            te_nnx.value_and_grad(lambda m: jnp.sum((m(x) - y) ** 2))(model)
        return jax.tree.map(lambda v: v[None], fp8_meta(model))

    return step


reference = MLP  # one device, the whole batch
with te_jax.autocast(recipe=REC):
    nnx.jit(lambda m: te_nnx.value_and_grad(lambda m: jnp.sum((m(X) - Y) ** 2))(m))(reference)
want = fp8_meta(reference)

mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
f = jax.shard_map(dp_step(REC, te_jax.MeshResource(dp_resource="dp")), mesh=mesh, in_specs=(P(), P("dp"), P("dp")),
                  out_specs=P("dp"), check_vma=False)
got = jax.jit(f)(STATE, X, Y)
per_device = [jax.tree.map(lambda v: v[i], got) for i in range(8)]
check("dp8 shard_map, MeshResource(dp): every device has the single-device, whole-batch FP8Meta",
      all(bits_equal(g, want) for g in per_device))
unreduced = jax.jit(jax.shard_map(dp_step(dataclasses.replace(REC, reduce_amax=False), te_jax.MeshResource(
    dp_resource="dp")), mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P("dp"), check_vma=False))(STATE, X, Y)
firsts = np.asarray(unreduced["fp8_meta"]["wi"]["linear_grad_output"]["amax_history"][:, -1])
check("reduce_amax=False: the devices' amaxes differ (the reduction above made them equal)",
      len(set(firsts.tolist())) == 8)


# ---- data x tensor parallel under jit, logical axis annotations ----------------------------------

B, T, H = 4, 8, 32
XT = jax.random.normal(jax.random.key(2), (B, T, H))
YT = jnp.sin(XT)
mesh_resource = te_jax.MeshResource(dp_resource="dp", tp_resource="tp")
RULES = logical_axis_rules(mesh_resource)


def build():
    with te_jax.autocast(recipe=REC):
        return te_nnx.TransformerLayer(H, 4, intermediate_dim=64, mlp_activation="swiglu", logical_axes=True,
                                       rngs=nnx.Rngs(3))


def train(model, x, y, steps=2):
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        with te_jax.autocast(recipe=REC, mesh_resource=mesh_resource):
            loss, grads = te_nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    return [step(model, optimizer, x) for _ in range(steps)]


with nnx.use_eager_sharding(False):  # one device: the annotations stay metadata
    one = build()
with nn.logical_axis_rules(RULES):
    ref_losses = train(one, XT, YT)

mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    model = build()  # flax.nnx shards each parameter as it is created
    check("the MLP's first kernel is split over tp on its 'mlp' axis",
          model.mlp.wi_kernel[...].sharding.spec == P(None, None, "tp"))
    check("the QKV kernel is split over tp on its 'heads' axis",
          model.attention.qkv.kernel[...].sharding.spec == P(None, "tp", None, None))
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in (XT, YT))
    losses = train(model, xs, ys)
check("dp2 x tp4: the losses of one device", np.allclose(losses, ref_losses, rtol=1e-5))
check("dp2 x tp4: the parameters of one device", all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(
    jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(one, nnx.Param)))))
check("dp2 x tp4: the FP8Meta of one device", all(np.allclose(a, b, rtol=1e-5) for a, b in zip(
    jax.tree.leaves(fp8_meta(model)), jax.tree.leaves(fp8_meta(one)))))

print("ALL OK")
