"""Sharding types under meshes with Explicit axes: the cases tests/multidevice/test_explicit_types.py checks.

Run as a script with 8 fake CPU devices; prints one JSON line per case:
``{"case": name, "got": ..., "want": ...}`` (the test asserts they are equal)
or ``{"case": name, "error": ...}``. Types are read from traced jaxprs
(``jax.jit(f).trace(...)``: nothing compiles) except for the ``numerics/``
cases, which compile one step on an Explicit and on an Auto mesh.

The mesh is ``(dp 2, fsdp 2, tp 2)`` (MoE: ``(dp 2, ep 4)``); the input
``[4, 32, 128]`` is split over dp, the kernels as in tensor parallelism with
FSDP: column-parallel ``(fsdp, tp)``, row-parallel ``(tp, fsdp)``, biases and
a norm's bias over tp. A layer's output must have the type jax gives its
flax equivalent (where jax refuses one, a contraction split on both sides,
the documented rule: x's leading axes, the last kernel's free axes), every
gradient the type of its primal.
"""

from __future__ import annotations

import json
import re
import time
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import te_jax
import te_jax.flax as tf
import te_jax.nnx as tn
from te_jax import recipe as R
from te_jax.core import DenseQuantizers, MLPQuantizers
from te_jax.ops import dequantize as D
from te_jax.ops import gemm as G
from te_jax.ops import norm_act as N
from te_jax.ops import quantize as Q
from te_jax.ops.grouped import gemm as GG

E, A = AxisType.Explicit, AxisType.Auto
RECIPES = {"bf16": None, "delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling(),
           "mxfp8": R.MXFP8BlockScaling(), "nvfp4": R.NVFP4BlockScaling(), "block": R.Float8BlockScaling()}
MR = te_jax.MeshResource(dp_resource="dp", tp_resource="tp", fsdp_resource="fsdp")
# parameter name -> its split (the leading and the last axis for a rank-3 gated kernel [H, 2, F])
SPECS = {"kernel": ("fsdp", "tp"), "bias": ("tp",), "wi_kernel": ("fsdp", "tp"), "wi_bias": ("tp",),
         "wo_kernel": ("tp", "fsdp")}


def spec(aval) -> str:
    """An aval's type as text; under an Explicit mesh "untyped" when it has no mesh (what a custom call's
    result had, which no constraint accepts)."""
    explicit = E in tuple(jax.sharding.get_abstract_mesh().axis_types)
    return "untyped" if explicit and aval.sharding.mesh.empty else str(aval.sharding.spec)


def types(f, *args) -> list[str]:
    return [spec(a) for a in jax.jit(f).trace(*args).jaxpr.out_avals]


def report(case: str, fn) -> None:
    start = time.perf_counter()
    try:
        got, want = fn()
        print(json.dumps(dict(case=case, got=got, want=want, seconds=round(time.perf_counter() - start, 2))),
              flush=True)
    except Exception as err:  # noqa: BLE001 (a case's failure is its result)
        tail = traceback.format_exc().splitlines()[-3:]
        print(json.dumps(dict(case=case, error=f"{type(err).__name__}: {str(err)[:600]}", where=tail)), flush=True)


def param_spec(mesh, name: str, ndim: int) -> NamedSharding:
    axes = SPECS.get(name, ())
    if ndim == 3 and len(axes) == 2:
        axes = (axes[0], None, axes[1])
    elif ndim == 2 and name.endswith("bias") and axes:  # a gated bias [2, F]
        axes = (None, *axes)
    return NamedSharding(mesh, P(*axes[:ndim]))


def shard_params(mesh, tree, all_params: bool = False, concrete: bool = False):
    """Every "params" leaf (every leaf with ``all_params``: an NNX Param state) split by its name (SPECS),
    the rest replicated: abstract values (ShapeDtypeStructs, to trace with), or with ``concrete`` arrays."""
    def put(path, a):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        named = [n for n in names if n not in (None, "value")]
        is_param = all_params or names[0] == "params"
        sharding = param_spec(mesh, str(named[-1]), a.ndim) if is_param else NamedSharding(mesh, P())
        return jax.device_put(a, sharding) if concrete else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(put, tree)


def abstract(mesh, shape, *axes, dtype=jnp.float32):
    """An abstract array of ``shape`` split as ``axes`` say."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))


def grads_untyped_or_unlike(args, grads) -> list[str]:
    """The gradients whose type is not their primal's (untyped ones included)."""
    leaves = jax.tree_util.tree_leaves_with_path(args)
    return [f"{jax.tree_util.keystr(p)}: {spec(g)} vs {spec(jax.typeof(x))}" for (p, x), g in zip(leaves, grads)
            if spec(g) != spec(jax.typeof(x))]


# ---- the flax equivalents: what jax types a layer's output as ---------------------------


def rule(x, kernel_free_axes) -> str:
    """The documented type where jax refuses its flax equivalent: x's leading axes, the last kernel's free axes."""
    return str(P(*tuple(jax.typeof(x).sharding.spec)[:-1], *kernel_free_axes))


def flax_equivalent(name: str, v, x) -> str:
    """The type of the flax computation a te_jax layer stands for, its parameters as the layer's."""
    p = v["params"]

    def dense(h, kernel, bias):
        y = lax.dot_general(h, kernel, (((h.ndim - 1,), (0,)), ((), ())))
        return y if bias is None else y + bias

    def ln(h, scale, bias):
        return nn.LayerNorm(epsilon=1e-6).apply({"params": {"scale": scale, "bias": bias}}, h)

    def run(v, x):
        p = v["params"]
        if name == "dense":
            return dense(x, p["kernel"], p["bias"])
        if name == "ln":
            return ln(x, p["scale"], p["bias"])
        h = ln(x, p["scale"], p["ln_bias"])
        if name == "lndense":
            return dense(h, p["kernel"], p["bias"])
        k1 = p["wi_kernel"]
        h = dense(h, k1, p["wi_bias"])
        h = nn.gelu(h) if k1.ndim == 2 else jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
        return dense(h, p["wo_kernel"], p["wo_bias"])

    try:
        return types(run, v, x)[0]
    except Exception as err:  # noqa: BLE001
        if "Contracting dimensions are sharded" not in str(err):
            raise
        last = p["wo_kernel"] if "wo_kernel" in p else p["kernel"]
        return rule(x, tuple(jax.typeof(last).sharding.spec)[1:])


LINEN = {"dense": lambda: tf.DenseGeneral(128), "ln": lambda: tf.LayerNorm(),
         "lndense": lambda: tf.LayerNormDenseGeneral(128), "mlp": lambda: tf.LayerNormMLP(intermediate_dim=256),
         "mlp_swiglu": lambda: tf.LayerNormMLP(intermediate_dim=256, activation="swiglu")}


def linen_case(mesh, x, layer: str, recipe):
    module = LINEN[layer]()
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=MR):
        v = shard_params(mesh, jax.eval_shape(lambda x: module.init({"params": jax.random.key(1)}, x), x))
        rngs = {"quantize": jax.random.key(2)}

        def apply(v, x):
            return module.apply(v, x, rngs=rngs, mutable=["fp8_meta"])[0]

        y = types(apply, v, x)[0]
        with te_jax.train.fp8_state_updates():
            grads = jax.jit(jax.grad(lambda v, x: apply(v, x).sum(), argnums=(0, 1))).trace(v, x).jaxpr.out_avals
    want = flax_equivalent(layer.split("_")[0], v, x)
    return {"y": y, "bad_grads": grads_untyped_or_unlike((v, x), grads)}, {"y": want, "bad_grads": []}


def abstract_nnx(make):
    """``nnx.eval_shape(make)`` outside the mesh (under a mesh flax types every variable, and an ``FP8Meta``
    holds a dict, which it cannot type)."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.eval_shape(make)


NNX = {"dense": lambda r: tn.Linear(128, 128, rngs=r), "ln": lambda r: tn.LayerNorm(128, rngs=r),
       "lndense": lambda r: tn.LayerNormLinear(128, 128, rngs=r), "mlp": lambda r: tn.LayerNormMLP(128, 256, rngs=r)}


def nnx_case(mesh, x, layer: str, recipe, want_y: str):
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=MR):
        graph, params, rest = nnx.split(abstract_nnx(lambda: NNX[layer](nnx.Rngs(0))), nnx.Param, ...)
        params = shard_params(mesh, params, all_params=True)
        rest = jax.tree.map(lambda a: abstract(mesh, a.shape, dtype=a.dtype), rest)

        def apply(p, r, x):
            return nnx.merge(graph, p, r)(x)

        y = types(apply, params, rest, x)[0]
        with te_jax.train.fp8_state_updates():
            grads = jax.jit(jax.grad(lambda p, r, x: apply(p, r, x).sum(), argnums=(0, 2))).trace(
                params, rest, x).jaxpr.out_avals
    return {"y": y, "bad_grads": grads_untyped_or_unlike((params, x), grads)}, {"y": want_y, "bad_grads": []}


def moe_case(recipe, ep: str | None, nnx_layer: bool = False):
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(E, E))
    mr = te_jax.MeshResource(dp_resource="dp", ep_resource=ep)
    with jax.set_mesh(mesh), te_jax.autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=mr):
        x = abstract(mesh, (4, 16, 64), "dp")

        def split(a):  # the experts' kernels over ep
            return abstract(mesh, a.shape, *(("ep",) if ep and a.ndim == 3 else ()), dtype=a.dtype)
        if nnx_layer:
            graph, params, rest = nnx.split(abstract_nnx(lambda: tn.MoE(64, 8, 2, 64, rngs=nnx.Rngs(0))), nnx.Param,
                                            ...)
            params, rest = jax.tree.map(split, params), jax.tree.map(split, rest)

            def apply(p, r, x):
                return nnx.merge(graph, p, r)(x)
            args, wrt = (params, rest, x), (0, 2)
        else:
            module = tf.MoE(num_experts=8, num_experts_per_tok=2, intermediate_dim=64)
            v = jax.tree.map(split, jax.eval_shape(lambda x: module.init({"params": jax.random.key(1)}, x), x))

            def apply(v, x):
                return module.apply(v, x, mutable=["fp8_meta"])[0]
            args, wrt = (v, x), (0, 1)
        y = types(apply, *args)[0]
        with te_jax.train.fp8_state_updates():
            grads = jax.jit(jax.grad(lambda *a: apply(*a).sum(), argnums=wrt)).trace(*args).jaxpr.out_avals
    return ({"y": y, "bad_grads": grads_untyped_or_unlike(tuple(args[i] for i in wrt), grads)},
            {"y": str(P("dp", None, None)), "bad_grads": []})


# ---- te_jax.ops and te_jax.core -----------------------------------------------------------


def ops_cases(mesh) -> None:
    def put(shape, *axes, dtype=jnp.float32):
        return abstract(mesh, shape, *axes, dtype=dtype)

    x = put((256, 128), "dp", "tp")
    rows, cols = str(P("dp", "tp")), str(P("tp", "dp"))
    quantizers = {
        "fp8_tensor": (lambda x: Q.quantize_fp8_tensor(x, jnp.ones(1), rowwise=True, colwise=True), [0], [1]),
        "fp8_current": (lambda x: Q.quantize_fp8_current(x, rowwise=True, colwise=True), [0], [1]),
        "mxfp8": (lambda x: Q.quantize_mxfp8(x, rowwise=True, colwise=True), [0, 1], [2, 3]),
        "nvfp4": (lambda x: Q.quantize_nvfp4(x, rowwise=True, colwise=True), [0, 1], [2, 3]),
    }
    for name, (fn, row, col) in quantizers.items():
        def case(fn=fn, row=row, col=col):
            got = types(fn, x)
            return ([got[i] for i in row + col], [rows] * len(row) + [cols] * len(col))
        report(f"ops/quantize_{name}", case)
    # Float8 1x128 blocks: 64 columns per device are no whole block, so N is gathered; M keeps dp.
    report("ops/quantize_fp8_block", lambda: (types(lambda x: Q.quantize_fp8_block(x, rowwise=True, colwise=True)[0],
                                                    x), [str(P("dp", None))]))
    report("ops/dequantize_mxfp8", lambda: (types(lambda x: D.dequantize_mxfp8(*Q.quantize_mxfp8(x)[:2]), x), [rows]))
    w = put((64, 128), "fsdp", None)

    def gemm(x, w):
        a, b = Q.quantize_mxfp8(x), Q.quantize_mxfp8(w)
        return G.gemm_mxfp8(a[0], a[1], b[0], b[1])
    report("ops/gemm_mxfp8", lambda: (types(gemm, put((256, 128), "dp", None), w), [str(P("dp", "fsdp"))]))
    report("ops/gemm_mxfp8_split_k", lambda: (types(gemm, x, put((64, 128), None, "tp")), [str(P("dp", None))]))
    g, b = put((128,), None), put((128,), "tp")
    report("ops/norm_fwd", lambda: (types(lambda x, g, b: N.norm_fwd(x, g, b), x, g, b)[7:], [str(P("dp"))] * 2))
    report("ops/act_bwd", lambda: (types(lambda x: N.act_bwd(x, x, act="gelu", dbias=True), x)[::7],
                                    [rows, str(P("tp"))]))

    def flax_ln(x, g, b):
        return nn.LayerNorm(epsilon=1e-6).apply({"params": {"scale": g, "bias": b}}, x)
    report("ops/normalize", lambda: (types(lambda x, g, b: N.normalize(x, g, b), x, g, b) +
                                     types(jax.grad(lambda x, g, b: N.normalize(x, g, b).sum(), argnums=(0, 1, 2)),
                                           x, g, b),
                                     types(flax_ln, x, g, b) + [spec(jax.typeof(a)) for a in (x, g, b)]))
    x3 = put((256, 2, 128), "dp", None, "tp")
    acts = {"gelu": (x, "gelu", False, nn.gelu),
            "swiglu": (put((256, 256), "dp", "tp"), "swiglu", False,
                       lambda h: jax.nn.silu(h[:, :128]) * h[:, 128:]),
            "swiglu_pair": (x3, "swiglu", True, lambda h: jax.nn.silu(h[:, 0]) * h[:, 1])}
    for name, (h, act, pair, ref) in acts.items():
        def case(h=h, act=act, pair=pair, ref=ref):
            def fn(h):
                return N.apply_activation(h, act, pair_axis=pair)
            return (types(fn, h) + types(jax.grad(lambda h: fn(h).sum()), h), types(ref, h) + [spec(jax.typeof(h))])
        report(f"ops/activation_{name}", case)
    report("ops/vmap_quantize", lambda: (types(jax.vmap(lambda x: Q.quantize_fp8_current(x, colwise=True)[:2]),
                                               put((4, 64, 128), "dp", None, "tp")),
                                         [str(P("dp", None, "tp")), str(P("dp", "tp", None))]))
    sizes = put((4,), None, dtype=jnp.int32)
    bf16 = jnp.bfloat16  # group_axis 0: the rows gathered, the groups' weights split over tp
    report("ops/grouped_gemm_bf16", lambda: (types(GG.grouped_gemm_bf16, put((256, 128), "dp", None, dtype=bf16),
                                                   put((4, 128, 64), "tp", dtype=bf16), sizes), [str(P(None, None))]))
    # te_jax.grouped_dense / grouped_mlp: y keeps x's rows' and the kernel's N split; gradients typed as primals
    xg = put((256, 128), "dp", None)
    wi, wo = put((4, 128, 64), None, None, "tp"), put((4, 64, 128), None, "tp")
    for rname in ("bf16", "current", "mxfp8", "delayed"):
        recipe = RECIPES[rname]

        def case(recipe=recipe):
            q = DenseQuantizers.from_recipe(recipe) if recipe else None
            mq = MLPQuantizers.from_recipe(recipe) if recipe else None
            st = jax.eval_shape(lambda: q.init_state(num_groups=4)) if recipe else None
            mst = jax.eval_shape(lambda: {"wi": mq.wi.init_state(num_groups=4),
                                          "wo": mq.wo.init_state(num_groups=4)}) if recipe else None

            def dense(x, k, st, sizes):
                return te_jax.grouped_dense(x, k, sizes, quantizers=q, state=st)[0]

            def mlp(x, k1, k2, st, sizes):
                return te_jax.grouped_mlp(x, k1, k2, sizes, activation="gelu", quantizers=mq, state=st,
                                          group_align=64 if recipe else 1)[0]
            with te_jax.train.fp8_state_updates():
                gd = jax.jit(jax.grad(lambda *a: dense(*a).sum(), argnums=(0, 1))).trace(
                    xg, wi, st, sizes).jaxpr.out_avals
                gm = jax.jit(jax.grad(lambda *a: mlp(*a).sum(), argnums=(0, 1, 2))).trace(
                    xg, wi, wo, mst, sizes).jaxpr.out_avals
            return ([*types(dense, xg, wi, st, sizes)[:1], *types(mlp, xg, wi, wo, mst, sizes)[:1],
                     *grads_untyped_or_unlike((xg, wi), gd), *grads_untyped_or_unlike((xg, wi, wo), gm)],
                    [str(P("dp", "tp")), str(P("dp", None))])
        report(f"core/grouped/{rname}", case)


# ---- MeshResource axes against the mesh (issue 42, point 3) ----------------------------------


def mesh_axes_cases() -> None:
    auto = jax.make_mesh((8,), ("dp",), axis_types=(A,))
    layer = tf.DenseGeneral(32)
    x = jax.random.normal(jax.random.key(0), (64, 64)) * (1 + jnp.arange(64)[:, None] / 20)

    def amaxes(axis: str):
        with te_jax.autocast(recipe=R.DelayedScaling(), mesh_resource=te_jax.MeshResource(dp_resource=axis)):
            v = layer.init(jax.random.key(1), x[:8])

            def step(v, x):
                updated = layer.apply(v, x, mutable=["fp8_meta"])[1]
                return updated["fp8_meta"]["linear_input"]["amax_history"].max()[None]
            run = jax.shard_map(step, mesh=auto, in_specs=(P(), P("dp")), out_specs=P("dp"), check_vma=False)
            return np.asarray(jax.jit(run)(v, x))

    def error_text(fn) -> str:
        try:
            fn()
        except ValueError as err:
            return str(err)
        return "no error"

    report("mesh_axes/shard_map_misnamed",
           lambda: ("MeshResource.dp_resource names the mesh axis 'data'" in (t := error_text(lambda: amaxes("data")))
                    and "('dp',)" in t and t.startswith("te_jax: DenseGeneral"), True))
    report("mesh_axes/shard_map_named", lambda: (len(set(amaxes("dp").tolist())), 1))
    explicit = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(E, E))
    q = DenseQuantizers.from_recipe(R.Float8CurrentScaling())

    def dense_under(mesh, mesh_resource, context: bool):
        xs = jax.device_put(x, NamedSharding(mesh, P("dp")))
        fn = jax.jit(lambda x: te_jax.dense(x, jnp.ones((64, 32)), quantizers=q, mesh_resource=mesh_resource)[0])
        if context:
            with jax.set_mesh(mesh):
                return fn.trace(xs)
        return fn.trace(xs)
    report("mesh_axes/set_mesh_misnamed",
           lambda: ("MeshResource.tp_resource names the mesh axis 'model'" in error_text(
               lambda: dense_under(explicit, te_jax.MeshResource(tp_resource="model"), True)), True))
    # Plain jit, no mesh context: the operands' NamedSharding names the mesh.
    report("mesh_axes/operand_mesh_misnamed",
           lambda: ("names the mesh axis 'model'" in error_text(
               lambda: dense_under(jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(A, A)),
                                   te_jax.MeshResource(tp_resource="model"), False)), True))


# ---- numerics and collectives: Explicit against Auto --------------------------------------


def collectives(hlo: str) -> dict[str, int]:
    return {kind: len(re.findall(rf"= [^\n=]*? {kind}(?:-start)?\(", hlo))
            for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")}


def numerics_case(recipe):
    """A LayerNormMLP's gradients on the Explicit mesh: Auto's values, and no collective Auto does not have."""
    module = tf.LayerNormMLP(intermediate_dim=256)
    x0 = jax.random.normal(jax.random.key(0), (4, 32, 128))
    out = {}
    with te_jax.autocast(recipe=recipe, mesh_resource=MR):
        v0 = module.init({"params": jax.random.key(1)}, x0)

        def grads(v, x):
            with te_jax.train.fp8_state_updates():
                return jax.grad(lambda v, x: module.apply(v, x).astype(jnp.float32).sum(), argnums=(0, 1))(v, x)
        for kinds in ((A, A, A), (E, E, E)):
            mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"), axis_types=kinds)
            v, x = shard_params(mesh, v0, concrete=True), jax.device_put(x0, NamedSharding(mesh, P("dp")))
            with jax.set_mesh(mesh):
                compiled = jax.jit(grads).lower(v, x).compile()
                out[kinds[0]] = (jax.tree.leaves(compiled(v, x)), collectives(compiled.as_text()))
    (auto, auto_coll), (explicit, explicit_coll) = out[A], out[E]
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / max(float(np.max(np.abs(np.asarray(a)))), 1e-30)
              for a, b in zip(auto, explicit))
    return {"collectives": explicit_coll, "err<=1e-6": err <= 1e-6}, {"collectives": auto_coll, "err<=1e-6": True}


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"), axis_types=(E, E, E))
    with jax.set_mesh(mesh):
        x = abstract(mesh, (4, 32, 128), "dp")
        wants = {}
        for rname, recipe in RECIPES.items():
            for layer in LINEN:

                def case(layer=layer, recipe=recipe):
                    got, want = linen_case(mesh, x, layer, recipe)
                    wants[layer] = want["y"]
                    return got, want
                report(f"linen/{layer}/{rname}", case)
        for rname in RECIPES:
            # NVFP4 without stochastic rounding: its key stream is an nnx.Rngs, which the traced step cannot draw from
            recipe = R.NVFP4BlockScaling(disable_stochastic_rounding=True) if rname == "nvfp4" else RECIPES[rname]
            for layer in NNX:
                report(f"nnx/{layer}/{rname}", lambda layer=layer, recipe=recipe: nnx_case(
                    mesh, x, layer, recipe, wants[layer]))

        def with_logical_constraint():
            # The report: a user's constraint after a te_jax layer (with_sharding_constraint asserts the
            # type under Explicit axes), data parallel, the parameters replicated.
            module = tf.LayerNormMLP(intermediate_dim=256)
            data = te_jax.MeshResource(dp_resource="dp")
            with te_jax.autocast(recipe=R.Float8CurrentScaling(), mesh_resource=data):
                v = jax.tree.map(lambda a: abstract(mesh, a.shape, dtype=a.dtype),
                                 jax.eval_shape(lambda x: module.init(jax.random.key(1), x), x))

                def apply(v, x):
                    with nn.logical_axis_rules(te_jax.ops.sharding.logical_axis_rules(data)):
                        return nn.with_logical_constraint(module.apply(v, x), ("batch", "length", "hidden"))
                return types(apply, v, x), [str(P("dp", None, None))]
        report("linen/with_logical_constraint", with_logical_constraint)
        ops_cases(mesh)
    for rname in ("bf16", "delayed", "current", "mxfp8"):
        for ep in (None, "ep"):
            report(f"moe/linen/{rname}/{ep or 'no_ep'}", lambda r=RECIPES[rname], ep=ep: moe_case(r, ep))
    report("moe/nnx/current/ep", lambda: moe_case(RECIPES["current"], "ep", nnx_layer=True))
    for kinds, name in (((E, E, A), "explicit_dp_fsdp_auto_tp"), ((A, A, A), "auto")):
        mixed = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"), axis_types=kinds)
        with jax.set_mesh(mixed):
            xm = abstract(mixed, (4, 32, 128), "dp")
            for layer in ("dense", "mlp"):
                report(f"mixed/{name}/{layer}", lambda layer=layer: linen_case(mixed, xm, layer, RECIPES["current"]))
    mesh_axes_cases()
    for rname in ("current", "mxfp8"):
        report(f"numerics/{rname}", lambda r=RECIPES[rname]: numerics_case(r))


if __name__ == "__main__":
    main()
