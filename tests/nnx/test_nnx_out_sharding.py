"""``out_sharding`` under ``te_jax.autocast``, as flax honours it: te_jax.nnx.Linear / LinearGeneral / Einsum and
flax's nnx.Linear / nnx.Einsum with te_jax's DotGeneral / EinsumOp injected, on an Explicit (data: 2, model: 4)
mesh of 8 fake CPU devices.

For every case the result must have the type of flax's (shape, dtype and sharding), be flax's bits outside
autocast and within the FP8 bound under it; a delayed-scaling train step runs under the mesh. The checks need 8
devices, so they run in a subprocess (this file run as a script) that prints one JSON line per case.
"""

from __future__ import annotations

import json

import pytest

CASES = ("Linear", "LinearGeneral", "Einsum", "inject/Linear", "inject/Linear/bf16->f32", "inject/Einsum",
         "train/Linear", "train/inject/LinearGeneral", "train/Einsum")


def _child() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AxisType, PartitionSpec as P

    import te_jax
    from te_jax import nnx as te_nnx
    from te_jax import recipe as R

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    current, delayed = R.Float8CurrentScaling(), R.DelayedScaling(amax_history_len=4)

    def build(name):
        """(ours, flax's, the output's PartitionSpec) for a case."""
        rngs = lambda: nnx.Rngs(0)  # noqa: E731
        if name == "Linear":
            return te_nnx.Linear(64, 32, rngs=rngs()), nnx.Linear(64, 32, rngs=rngs()), P("data", None, "model")
        if name == "LinearGeneral":
            return (te_nnx.LinearGeneral(64, (4, 8), rngs=rngs()), nnx.LinearGeneral(64, (4, 8), rngs=rngs()),
                    P("data", None, "model", None))
        if name == "Einsum":  # the output transposed: heads before the sequence
            eq = ("btd,dnh->bnth", (64, 4, 8), (4, 8))
            return te_nnx.Einsum(*eq, rngs=rngs()), nnx.Einsum(*eq, rngs=rngs()), P("data", "model", None, None)
        if name == "inject/Linear":
            return (te_nnx.inject(nnx.Linear(64, 32, rngs=rngs())), nnx.Linear(64, 32, rngs=rngs()),
                    P("data", "model", None))
        if name == "inject/Linear/bf16->f32":
            kw = dict(dtype=jnp.bfloat16, preferred_element_type=jnp.float32)
            return (te_nnx.inject(nnx.Linear(64, 32, rngs=rngs(), **kw)), nnx.Linear(64, 32, rngs=rngs(), **kw),
                    P(None, None, "model"))
        eq = ("btd,df->btf", (64, 32), (32,))
        return te_nnx.inject(nnx.Einsum(*eq, rngs=rngs())), nnx.Einsum(*eq, rngs=rngs()), P("data", None, "model")

    x = jax.random.normal(jax.random.key(0), (8, 16, 64), jnp.float32)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data", None, None))
        for name in CASES[:6]:
            ours, ref, spec = build(name)
            want = nnx.jit(lambda m, x: m(x, out_sharding=spec))(ref, xs)
            plain = nnx.jit(lambda m, x: m(x, out_sharding=spec))(ours, xs)

            @nnx.jit
            def quantized(m, x):
                with te_jax.autocast(recipe=current):
                    return m(x, out_sharding=spec)

            got = quantized(ours, xs)
            error = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want))
            print(json.dumps({"name": name, "want": str(jax.typeof(want)), "got": str(jax.typeof(got)),
                              "plain": str(jax.typeof(plain)), "plain_bits": bool(jnp.array_equal(plain, want)),
                              "error": error}), flush=True)

        for name in CASES[6:]:
            with te_jax.autocast(recipe=delayed):
                if name == "train/Linear":
                    model, spec = te_nnx.Linear(64, 32, rngs=nnx.Rngs(0)), P("data", None, "model")
                elif name == "train/Einsum":
                    model = te_nnx.Einsum("btd,dnh->btnh", (64, 4, 8), (4, 8), rngs=nnx.Rngs(0))
                    spec = P("data", None, "model", None)
                else:
                    model = te_nnx.inject(nnx.LinearGeneral(64, (4, 8), rngs=nnx.Rngs(0)))
                    spec = P("data", None, "model", None)

            @nnx.jit
            def step(model, x):
                with te_jax.autocast(recipe=delayed):
                    return te_nnx.value_and_grad(lambda m: jnp.mean(m(x, out_sharding=spec) ** 2))(model)[0]

            @nnx.jit
            def forward(model, x):
                with te_jax.autocast(recipe=delayed):
                    return model(x, out_sharding=spec)

            losses = [float(step(model, xs)) for _ in range(2)]
            y_type = str(jax.typeof(forward(model, xs)))
            history = [v for v in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, te_nnx.FP8Meta)))
                       if v.ndim == 1 and v.shape[0] == 4]
            print(json.dumps({"name": name, "losses": losses, "got": y_type,
                              "recorded": all(float(h[-1]) > 0 for h in history) and len(history) == 3}),
                  flush=True)


@pytest.fixture(scope="module")
def results():
    from qtest_util import run_on_fake_devices  # not at the top: the child this file also is needs no jax yet

    proc = run_on_fake_devices([__file__], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["name"]: r for r in lines}


@pytest.mark.parametrize("name", CASES[:6])
def test_out_sharding_types_the_result_as_flax_does(results, name):
    r = results[name]
    assert r["got"] == r["want"] and r["plain"] == r["want"], r  # shape, dtype and sharding
    assert r["plain_bits"], r  # outside autocast: flax's product
    assert 0 < r["error"] < 0.1, r


@pytest.mark.parametrize("name", CASES[6:])
def test_a_delayed_scaling_step_under_the_mesh_records_state(results, name):
    r = results[name]
    assert all(abs(loss) < 1e3 for loss in r["losses"]) and r["recorded"], r
    assert "@model" in r["got"] and "@data" in r["got"], r


if __name__ == "__main__":
    _child()
