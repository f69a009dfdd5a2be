"""te_jax's custom calls inside CUDA graphs (XLA command buffers), on a GPU; skipped elsewhere.

A small te_jax train step (LayerNormMLP and DenseGeneral: fused norm and activation casts,
quantizes and GEMMs, forward and backward) runs in two fresh processes: one with XLA's command
buffers at their default types, which include custom calls, and ``--xla_gpu_graph_min_graph_size=1``
(so that every call the trait makes eligible is captured, whatever its neighbours), one with none.
XLA's dump of the first must show every te_jax custom call inside a command buffer and of the
second every one outside, and the two runs must give the same bits: losses, parameters and FP8
state. Both runs ask XLA for deterministic ops and no autotuning of its own; te_jax's GEMMs take
cuBLASLt's heuristic algorithm, the same in every process.

A second test autotunes a GEMM (its plan is built, and its candidates timed, in the custom call's
initialize stage, before the program runs) whose output XLA writes into the buffer of a donated
input that the program reads before the GEMM: the input must reach the program intact, so the
result matches the same step without donation (to the rounding a different algorithm may give).

Run as a script (``python test_cuda_graphs_gpu.py RECIPE OUT.npz``) it is the child of the first
test: it trains the step and writes what it computed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ON_GPU = jax.default_backend() == "gpu"
STEP_NAME = "graphs_train_step"  # the jitted function, so its module is jit_graphs_train_step
STEPS = 4
RECIPES = ["delayed", "block", "nvfp4"]  # per-tensor, block-scaled (scale conversions), NVFP4 (device alpha, RHT/SR)
COMMON_FLAGS = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
GRAPH_FLAGS = {
    "graphs": "--xla_gpu_graph_min_graph_size=1",  # XLA's default command-buffer types: custom calls included
    "plain": "--xla_gpu_enable_command_buffer=",  # no command buffers
}


# ---- the child: a few train steps ---------------------------------------------------------------


def train(recipe_name: str, out: Path) -> None:
    """Trains the small model for STEPS steps; writes each loss and every final array's bytes to ``out``."""
    import flax.linen as nn
    import optax

    import te_jax
    from te_jax import recipe as R
    from te_jax.train import TrainState

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = te_jax.flax.LayerNormMLP(intermediate_dim=512, activation="gelu", name="mlp")(x)
            return te_jax.flax.DenseGeneral(features=256, name="out")(h)

    recipe = R.load_recipe(recipe_name)
    model = Model()
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (128, 256), jnp.bfloat16)
    target = jax.random.normal(keys[1], (128, 256), jnp.float32)
    with te_jax.autocast(recipe=recipe):
        variables = jax.jit(model.init)({"params": keys[2], "quantize": keys[3]}, x)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3))
    state = state.replace(step=jnp.asarray(0, jnp.int32))  # the step's type stays the same: one compilation

    def graphs_train_step(state, x, target):
        def loss_fn(variables):
            key = jax.random.fold_in(jax.random.key(1), state.step)
            pred = state.apply_fn(variables, x, rngs={"quantize": key})
            return jnp.mean(jnp.square(pred.astype(jnp.float32) - target))

        with te_jax.autocast(recipe=recipe):
            loss, grads = te_jax.train.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    assert graphs_train_step.__name__ == STEP_NAME
    step = jax.jit(graphs_train_step)
    losses = []
    for _ in range(STEPS):
        state, loss = step(state, x, target)
        losses.append(loss)
    leaves = jax.tree_util.tree_leaves_with_path(state.params)
    arrays = {"losses": np.asarray(jnp.stack(losses))}
    arrays |= {jax.tree_util.keystr(path): np.frombuffer(np.asarray(leaf).tobytes(), np.uint8) for path, leaf in leaves}
    np.savez(out, **arrays)


# ---- reading XLA's dump: tools/xla_dump.py ---------------------------------------------------------


def _load_xla_dump():
    spec = importlib.util.spec_from_file_location("xla_dump", Path(__file__).resolve().parents[2] / "tools" /
                                                  "xla_dump.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


xla_dump = _load_xla_dump()


def gemm_output_copied(hlo: str, target: str) -> bool:
    """Whether the entry computation of an optimized HLO module copies the output of its one ``target`` call
    (else the call writes the program's result buffer itself)."""
    entry = hlo[hlo.index("\nENTRY"):].splitlines()
    name_of = lambda line: re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = ", line).group(1)  # noqa: E731
    (call,) = [name_of(line) for line in entry if f'custom_call_target="{target}"' in line]
    outs = [name_of(line) for line in entry
            if re.search(rf"get-tuple-element\((?:.*\s)?%?{re.escape(call)}\), index=0", line)]
    assert outs, f"no get-tuple-element of {call}"
    return any(re.search(rf"\bcopy\((?:.*\s)?%?{re.escape(out)}\)", line) for line in entry for out in outs)


# ---- the tests ------------------------------------------------------------------------------------


def _run_child(recipe: str, which: str, tmp_path: Path) -> tuple[dict, dict]:
    dump, out = tmp_path / f"dump_{which}", tmp_path / f"{which}.npz"
    flags = f"{os.environ.get('XLA_FLAGS', '')} {COMMON_FLAGS} {GRAPH_FLAGS[which]} --xla_dump_to={dump}"
    run = subprocess.run([sys.executable, __file__, recipe, str(out)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "XLA_FLAGS": flags.strip()})
    assert run.returncode == 0, run.stderr[-4000:]
    with np.load(out) as saved:
        arrays = {name: saved[name] for name in saved.files}
    (placement,) = xla_dump.placements(dump, f"jit_{STEP_NAME}")
    return placement, arrays


def test_dump_readers(tmp_path):
    """tools/xla_dump.py on dumps in the forms XLA writes (thunks with or without ids, HLO command buffers),
    and the copy finder below."""
    numbered = ("000: kKernel        \t\n001: kCommandBuffer \t\n    002: kKernel\t\n    003: kCustomCall\t\n"
                "004: kCustomCall    \t\n005: kWhile         \t\n  condition:\n    006: kKernel\t\n  body:\n"
                "    007: kCommandBuffer\t\n        008: kCustomCall\t\n    009: kCustomCall\t\n")
    assert xla_dump.custom_call_thunks(numbered) == (2, 2)
    plain = "kCommandBuffer\t\n    kCustomCall\t\n    kKernel\t\nkCustomCall\t\nkGemm\t\n"
    assert xla_dump.custom_call_thunks(plain) == (1, 1)
    hlo = ('%command_buffer (p: f32[16]) -> f32[16] {\n  %a = f32[16] custom-call(%p), custom_call_target="te_jax_x"\n'
           '}\n\nENTRY %main (p: f32[16]) -> f32[16] {\n  %b = f32[16] call(%p), to_apply=%command_buffer\n'
           '  ROOT %c = f32[16] custom-call(%b), custom_call_target="te_jax_y"\n}\n')
    assert xla_dump.hlo_te_jax_calls_in_command_buffers(hlo) == (1, 1) and xla_dump.te_jax_call_count(hlo) == 2
    (tmp_path / "module_0007.jit_step.sm_9.0_gpu_after_optimizations.txt").write_text(hlo)
    assert xla_dump.placements(tmp_path, "jit_step") == [
        {"module": "module_0007.jit_step", "te_jax_calls": 2, "custom_calls_inside": 1, "custom_calls_outside": 1,
         "source": "module_0007.jit_step.sm_9.0_gpu_after_optimizations.txt"}]
    (tmp_path / "module_0007.jit_step.thunk_sequence.txt").write_text(plain + "kCustomCall\t\n")
    (tmp_path / "module_0007.jit_step.thunk_sequence_after_thunk_passes.txt").write_text(numbered)
    assert xla_dump.placements(tmp_path, "jit_step")[0]["custom_calls_inside"] == 2
    (tmp_path / "module_0007.jit_step.thunk_sequence_after_thunk_passes.txt").unlink()
    assert xla_dump.placements(tmp_path, "jit_step")[0]["custom_calls_outside"] == 2
    call = '\nENTRY %main {\n  %g = (bf16[4]{0}, u8[0]{0}) custom-call(%x), custom_call_target="te_jax_gemm_fp8"\n'
    assert not gemm_output_copied(call + "  ROOT %o = bf16[4]{0} get-tuple-element(%g), index=0\n}\n",
                                  "te_jax_gemm_fp8")
    assert gemm_output_copied(call + "  %o = bf16[4]{0} get-tuple-element(%g), index=0\n"
                              "  ROOT %c = bf16[4]{0} copy(bf16[4]{0} %o)\n}\n", "te_jax_gemm_fp8")


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", RECIPES)
def test_te_jax_calls_run_inside_command_buffers_with_the_same_bits(recipe, tmp_path):
    graphs, graph_arrays = _run_child(recipe, "graphs", tmp_path)
    plain, plain_arrays = _run_child(recipe, "plain", tmp_path)
    report = json.dumps({"graphs": graphs, "plain": plain})
    assert graphs["te_jax_calls"] >= 8, report  # norm, activation, quantize and GEMM calls, both directions
    assert graphs["custom_calls_outside"] == 0, report
    assert graphs["custom_calls_inside"] >= graphs["te_jax_calls"], report
    assert plain["custom_calls_inside"] == 0, report
    assert plain["custom_calls_outside"] >= plain["te_jax_calls"] == graphs["te_jax_calls"], report
    assert graph_arrays.keys() == plain_arrays.keys()
    assert np.isfinite(plain_arrays["losses"]).all(), plain_arrays["losses"]
    for name, want in plain_arrays.items():
        np.testing.assert_array_equal(graph_arrays[name], want, err_msg=name)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_autotuning_leaves_a_donated_input_in_the_output_buffer_intact():
    """y = gemm(x * mean(a), w), ``a`` donated and shaped like y: the GEMM writes y into a's buffer, and its
    initialize stage times the candidates there before the program has read a."""
    from te_jax.ops import gemm as G

    e4 = jnp.float8_e4m3fn
    rng = np.random.default_rng(7)
    m, n, k = 512, 1024, 768
    x = jnp.asarray(rng.normal(size=(m, k)) / 8, jnp.float32).astype(e4)
    w = jnp.asarray(rng.normal(size=(n, k)) / 8, jnp.float32).astype(e4)
    a_host = rng.uniform(0.5, 1.5, size=(m, n)).astype(np.float32)  # mean near 1; a GEMM's output has mean near 0
    one = jnp.ones((1,), jnp.float32)

    def step(a, x, w):
        s = jnp.mean(a.astype(jnp.float32))
        x = (x.astype(jnp.float32) * s).astype(e4)
        return G.gemm_fp8(x, w, one, one, out_dtype=jnp.bfloat16, autotune=True)

    a = jnp.asarray(a_host, jnp.bfloat16)
    donating = jax.jit(step, donate_argnums=0)
    hlo = donating.lower(a, x, w).compile().as_text()
    assert not gemm_output_copied(hlo, "te_jax_gemm_fp8"), "XLA copies the GEMM's output into a's buffer"
    donated = np.asarray(donating(a, x, w).astype(jnp.float32))  # the first run: the plan is built and timed here
    kept = np.asarray(jax.jit(step)(jnp.asarray(a_host, jnp.bfloat16), x, w).astype(jnp.float32))
    assert np.abs(kept).mean() > 0.1, np.abs(kept).mean()
    np.testing.assert_allclose(donated, kept, rtol=2e-2, atol=2e-2)


if __name__ == "__main__":
    train(sys.argv[1], Path(sys.argv[2]))
