"""The expert-parallel te_jax.flax.MoE on 8 fake CPU devices; run by tests/flax/test_flax_moe.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8.

For each mesh ("ep8", "dp2xep4") and recipe ("none", "delayed") it prints one JSON line comparing one jitted
training step (loss, input and parameter gradients, the FP8 state update) under
``autocast(mesh_resource=MeshResource(dp_resource="dp", ep_resource="ep"))`` (no dp on "ep8") on the mesh with the
same step on one device, whether every device holds the same FP8 state update, and the collectives in the compiled HLO.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import te_jax
from te_jax import recipe as R
from te_jax.flax import MoE
from te_jax.train import value_and_grad

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_multidevice import MESHES, collective_counts, main_over_cases  # noqa: E402

T, E, K_TOP, H, F = 64, 8, 2, 32, 32
RECIPES = {"none": None, "delayed": R.DelayedScaling(amax_history_len=4)}


def mesh_resource(axes) -> te_jax.MeshResource:
    """The roles of ``axes``: the MeshResource names only axes of the mesh (te_jax checks them)."""
    return te_jax.MeshResource(dp_resource="dp" if "dp" in axes else None, ep_resource="ep")


def step_fn(recipe, mesh_resource):
    layer = MoE(E, K_TOP, F, aux_loss_coeff=0.01)

    def loss(variables, x, cotangent):
        y, inter = layer.apply(variables, x, mutable=["intermediates"])
        aux = sum(jax.tree.leaves(inter))
        return jnp.sum(y * cotangent) + aux

    def step(variables, x, cotangent):
        with te_jax.autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=mesh_resource):
            # x rides in the differentiated dict: te_jax.train.value_and_grad takes one argument
            value, grads = value_and_grad(
                lambda v: loss({c: w for c, w in v.items() if c != "inputs"}, v["inputs"], cotangent))(
                    {**variables, "inputs": x})
        return value, grads, grads["inputs"]

    return layer, step


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def same_on_every_device(tree) -> bool:
    """Whether each replicated leaf's shards hold the same bits on every device."""
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards if s.index == leaf.addressable_shards[0].index]
        if any(not np.array_equal(s.view(np.uint8), shards[0].view(np.uint8)) for s in shards):
            return False
    return True


def run_case(mesh_name: str, recipe_name: str) -> dict:
    recipe = RECIPES[recipe_name]
    shape, axes = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))
    x = jax.random.normal(jax.random.key(0), (T, H))
    cotangent = jax.random.normal(jax.random.key(1), (T, H))
    layer, step_one = step_fn(recipe, None)
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
        variables = jax.jit(layer.init)(jax.random.key(2), x)
    loss_one, grads_one, dx_one = jax.jit(step_one)(variables, x, cotangent)

    _, step_ep = step_fn(recipe, mesh_resource(axes))
    with jax.set_mesh(mesh):
        jitted = jax.jit(step_ep)
        loss_ep, grads_ep, dx_ep = jitted(variables, x, cotangent)
        grad_hlo = jitted.lower(variables, x, cotangent).compile().as_text()
        forward = jax.jit(lambda v, x: _forward(layer, recipe, mesh_resource(axes), v, x))
        forward_hlo = forward.lower(variables, x).compile().as_text()

    out = {"mesh": mesh_name, "recipe": recipe_name, "loss_rel_diff": rel_diff(loss_ep, loss_one),
           "dx_rel_diff": rel_diff(dx_ep, dx_one)}
    out["param_rel_diff"] = {"/".join(str(getattr(k, "key", k)) for k in path): rel_diff(g, w) for (path, g), w in
                             zip(jax.tree_util.tree_leaves_with_path(grads_ep["params"]),
                                 jax.tree.leaves(grads_one["params"]))}
    if "fp8_meta" in grads_one:
        out["fp8_meta_equal"] = all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(grads_ep["fp8_meta"]), jax.tree.leaves(grads_one["fp8_meta"])))
        out["fp8_meta_same_on_every_device"] = same_on_every_device(grads_ep["fp8_meta"])
    out["forward_collectives"] = collective_counts(forward_hlo)
    out["grad_collectives"] = collective_counts(grad_hlo)
    return out


def _forward(layer, recipe, resource, variables, x):
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=resource):
        return layer.apply(variables, x)


def trace_errors() -> dict:
    """The trace-time errors of bad expert-parallel input on the ep8 mesh: name -> message (or "no error")."""
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))
    bad = {"experts_not_divisible": (MoE(12, K_TOP, F), T), "tokens_not_divisible": (MoE(E, K_TOP, F), T - 4)}
    out = {}
    for name, (layer, tokens) in bad.items():
        x = jnp.zeros((tokens, H))
        variables = jax.eval_shape(layer.init, jax.random.key(0), x)
        try:
            with jax.set_mesh(mesh), te_jax.autocast(enabled=False, mesh_resource=te_jax.MeshResource(ep_resource="ep")):
                jax.jit(layer.apply).lower(variables, x)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def main() -> None:
    main_over_cases("ep8:none,dp2xep4:none,ep8:delayed,dp2xep4:delayed", run_case,
                    lambda mesh_name, recipe_name: {"mesh": mesh_name, "recipe": recipe_name},
                    first=lambda: {"errors": trace_errors()})


if __name__ == "__main__":
    main()
