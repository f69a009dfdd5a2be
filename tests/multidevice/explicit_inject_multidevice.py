"""Sharding types of the injected products under a mesh with Explicit axes: the cases test_explicit_inject.py checks.

Run as a script with 8 fake CPU devices; prints one JSON line per case,
``{"case": name, "got": ..., "want": ...}`` or ``{"case": name, "error": ...}``.
Types come from traced jaxprs (nothing compiles). The mesh is ``(dp 2, fsdp
2, tp 2)``, all Explicit; the input ``[4, 32, 128]`` is split over dp, a
kernel ``[128, 4, 32]`` over ``(fsdp, -, tp)``. Each product must have the
type of what it stands for (``lax.dot_general``, ``jnp.einsum``,
``lax.ragged_dot`` with its ``out_sharding``, or the same flax module outside
autocast), every gradient the type of its primal.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import te_jax
import te_jax.flax as tf
import te_jax.nnx as tn
from te_jax import recipe as R
from te_jax.core import DenseQuantizers
from te_jax.core.dot_general import dot_general, einsum
from te_jax.core.ragged_dot import ragged_dot_with_state

from explicit_types_multidevice import report  # a sibling script: one JSON line per case

E = AxisType.Explicit
RECIPES = {"current": R.Float8CurrentScaling(), "mxfp8": R.MXFP8BlockScaling(), "delayed": R.DelayedScaling()}
MR = te_jax.MeshResource(dp_resource="dp", tp_resource="tp", fsdp_resource="fsdp")


def spec(aval) -> str:
    """An aval's type as text ("untyped": no mesh in its type, which no constraint accepts)."""
    return "untyped" if aval.sharding.mesh.empty else str(aval.sharding.spec)


def types(f, *args) -> list[str]:
    return [spec(a) for a in jax.jit(f).trace(*args).jaxpr.out_avals]


def unlike_primals(f, args, wrt) -> list[str]:
    """The gradients of ``f(*args).sum()`` with respect to ``args[i]`` (i in ``wrt``) not typed as their primal."""
    with te_jax.train.fp8_state_updates():
        grads = jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=wrt)).trace(*args)
    primals = jax.tree_util.tree_leaves_with_path(tuple(args[i] for i in wrt))
    return [f"{jax.tree_util.keystr(p)}: {spec(g)} vs {spec(jax.typeof(x))}"
            for (p, x), g in zip(primals, grads.jaxpr.out_avals) if spec(g) != spec(jax.typeof(x))]


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"), axis_types=(E, E, E))

    def put(shape, *axes, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))

    def replicated(tree):
        return jax.tree.map(lambda a: put(a.shape, dtype=a.dtype), tree)

    with jax.set_mesh(mesh):
        x, w = put((4, 32, 128), "dp"), put((128, 4, 32), "fsdp", None, "tp")
        dims = (((2,), (0,)), ((), ()))
        for rname, recipe in RECIPES.items():
            q = DenseQuantizers.from_recipe(recipe)
            st = replicated(jax.eval_shape(q.init_state))

            def dg(x, w, st, q=q):
                return dot_general(x, w, dims, quantizers=q, state=st)[0]

            def es(x, w, st, q=q):
                return einsum("bsd,dhk->bshk", x, w, quantizers=q, state=st)[0]
            report(f"core/dot_general/{rname}", lambda dg=dg, st=st: (
                (types(dg, x, w, st)[:1], unlike_primals(dg, (x, w, st), (0, 1))),
                (types(lambda x, w: lax.dot_general(x, w, dims), x, w), [])))
            report(f"core/einsum/{rname}", lambda es=es, st=st: (
                (types(es, x, w, st)[:1], unlike_primals(es, (x, w, st), (0, 1))),
                (types(lambda x, w: jnp.einsum("bsd,dhk->bshk", x, w), x, w), [])))

            # a batch axis (heads) runs on the grouped GEMM, one weight state per head
            xh, wh, heads = put((4, 4, 32, 64), "dp", "tp"), put((4, 64, 32), "tp"), "bhsd,hdk->bhsk"
            hst = replicated(jax.eval_shape(lambda q=q: q.init_state(num_groups=4)))

            def eh(x, w, st, q=q):
                return einsum(heads, x, w, quantizers=q, state=st)[0]
            report(f"core/einsum_batched/{rname}", lambda eh=eh, hst=hst: (
                (types(eh, xh, wh, hst)[:1], unlike_primals(eh, (xh, wh, hst), (0, 1))),
                (types(lambda x, w: jnp.einsum(heads, x, w), xh, wh), [])))

            # lax.ragged_dot has no Explicit typing of its own: under such a mesh it takes an out_sharding.
            lhs, rhs, sizes = put((256, 128), "dp"), put((4, 128, 64), None, None, "tp"), put((4,), dtype=jnp.int32)
            out = P("dp", "tp")
            gst = replicated(jax.eval_shape(lambda q=q: q.init_state(num_groups=4)))

            def rd(lhs, rhs, st, sizes, q=q):
                return ragged_dot_with_state(lhs, rhs, sizes, out_sharding=out, quantizers=q, state=st)[0]
            report(f"core/ragged_dot/{rname}", lambda rd=rd, gst=gst: (
                (types(rd, lhs, rhs, gst, sizes), unlike_primals(rd, (lhs, rhs, gst, sizes), (0, 1))),
                (types(lambda a, b, s: lax.ragged_dot(a, b, s, out_sharding=out), lhs, rhs, sizes), [])))

            report(f"linen/dot_general_cls/{rname}", lambda recipe=recipe: linen_case(put, x, recipe))
            report(f"nnx/dot_general/{rname}", lambda recipe=recipe: nnx_case(put, x, recipe))
            report(f"nnx/linear_general/{rname}", lambda recipe=recipe: nnx_case(
                put, x, recipe, lambda: nnx.LinearGeneral(128, (4, 32), dot_general=tn.DotGeneral(),
                                                          rngs=nnx.Rngs(0)), ("fsdp", None, "tp"), (None, "tp")))
            report(f"linen/einsum/{rname}", lambda recipe=recipe: linen_case(
                put, x, recipe, tf.Einsum((128, 4, 32), "bsd,dhk->bshk")))


def linen_case(put, x, recipe, module=None):
    """``module`` (``nn.DenseGeneral((4, 32), dot_general_cls=te_jax.flax.DotGeneral)``): under the recipe as
    outside autocast."""
    module = module or nn.DenseGeneral((4, 32), dot_general_cls=tf.DotGeneral)

    def shard(path, a):
        name = str(getattr(path[-1], "key", ""))
        axes = ("fsdp", None, "tp") if name == "kernel" else (None, "tp") if name == "bias" else ()
        return put(a.shape, *axes, dtype=a.dtype)

    def apply(v, x):
        return module.apply(v, x, mutable=True)[0]

    want = None
    for enabled in (False, True):
        with te_jax.autocast(enabled=enabled, recipe=recipe, mesh_resource=MR):
            v = jax.tree_util.tree_map_with_path(shard, jax.eval_shape(lambda x: module.init(jax.random.key(1), x), x))
            y = types(apply, v, x)[0]
            if not enabled:
                want = y
                continue
            # the whole variables dict: a delayed-scaling state's gradient is its new value
            bad = unlike_primals(apply, (v, x), (0, 1))
    return {"y": y, "bad_grads": bad}, {"y": want, "bad_grads": []}


def nnx_case(put, x, recipe, layer=None, kernel_axes=("fsdp", "tp"), bias_axes=("tp",)):
    """``layer()`` (``nnx.Linear(..., dot_general=te_jax.nnx.DotGeneral())``): under the recipe as outside
    autocast."""
    mesh = jax.sharding.get_abstract_mesh()
    layer = layer or (lambda: nnx.Linear(128, 128, dot_general=tn.DotGeneral(), rngs=nnx.Rngs(0)))

    def make():
        model = layer()
        tn.name_paths(model)
        return model

    def shard(path, a):
        name = str(getattr(path[-2] if len(path) > 1 else path[-1], "key", ""))
        axes = kernel_axes if name == "kernel" else bias_axes if name == "bias" else ()
        return put(a.shape, *axes, dtype=a.dtype)

    want = None
    for enabled in (False, True):
        with te_jax.autocast(enabled=enabled, recipe=recipe, mesh_resource=MR):
            # built outside the mesh (under one flax types every variable, and FP8 state holds a dict)
            with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
                model = nnx.eval_shape(make)
            graph, params, rest = nnx.split(model, nnx.Param, ...)
            with jax.sharding.use_abstract_mesh(mesh):
                params = jax.tree_util.tree_map_with_path(shard, params)
                rest = jax.tree.map(lambda a: put(a.shape, dtype=a.dtype), rest)

            def apply(p, r, x):
                return nnx.merge(graph, p, r)(x)
            y = types(apply, params, rest, x)[0]
            if not enabled:
                want = y
                continue
            bad = unlike_primals(apply, (params, rest, x), (0, 2))
    return {"y": y, "bad_grads": bad}, {"y": want, "bad_grads": []}


if __name__ == "__main__":
    main()
