"""The GPT example's ``--mesh dp=2,ep=2`` on 4 fake CPU devices; run by tests/tools/test_example.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4.

Trains the tiny-moe preset, cut to one block (the test's compile time), for a few steps in float32 and prints
one JSON line:

* "losses": {"one_device": ..., "dp2xep2": ...}, the per-step training losses without quantization
  (``--recipe bf16``) on one device and with the experts split over "ep"; "all_to_alls": how many
  ``all_to_all`` the dp2xep2 step's lowering holds (the MoE's token exchange);
* "expert_kernel_specs": the PartitionSpec of every MoE kernel ("wi", "wo") after delayed-scaling training;
* "delayed": delayed-scaling steps on dp2xep2: their losses, whether every fp8_meta leaf is replicated with the
  same value on every device, and whether a checkpoint of the state (``save_checkpoint``) restores
  (``restore_checkpoint``) the parameters, fp8_meta and optimizer state bit for bit with their shardings.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

# After the te_jax under test (on a GPU machine, an installed wheel on PYTHONPATH): only examples/ comes from here.
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root
from examples.gpt import data as data_lib  # noqa: E402
from examples.gpt import train as train_lib  # noqa: E402
from examples.gpt.presets import PRESETS  # noqa: E402

STEPS = 3
SMALL = dict(preset="tiny-moe", steps=STEPS, batch=4, seq_len=32, eval_batches=1, log_every=1, dtype="float32",
             progress=False)


def same_on_every_device(x: jax.Array) -> bool:
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    return x.sharding.is_fully_replicated and all(np.array_equal(s, shards[0]) for s in shards)


def train_steps(corpus: data_lib.Corpus, **overrides) -> tuple[train_lib.TrainState, list[float], int]:
    """The state and losses after ``STEPS`` of the example's own training step (no evaluation), and the number
    of all-to-alls in that step's lowering."""
    cfg = train_lib.RunConfig(**{**SMALL, **overrides}).resolved()
    run = train_lib.build_run(cfg)
    state, losses = run.state, []
    for step in range(STEPS):
        tokens = jax.device_put(data_lib.train_batch(corpus, step, cfg.batch, cfg.seq_len, cfg.seed),
                                run.batch_sharding)
        if step == 0:
            all_to_alls = run.train_step.lower(state, tokens).as_text().count("stablehlo.all_to_all")
        state, metrics = run.train_step(state, tokens)
        losses.append(float(metrics["loss"]))
    return state, losses, all_to_alls


def main() -> None:
    tiny_moe = PRESETS["tiny-moe"]
    PRESETS["tiny-moe"] = dataclasses.replace(tiny_moe, model=dataclasses.replace(tiny_moe.model, layers=1))
    corpus = data_lib.load(None, 1 << 20)
    _, one_device, _ = train_steps(corpus, recipe="bf16", mesh="")
    _, expert_parallel, all_to_alls = train_steps(corpus, recipe="bf16", mesh="dp=2,ep=2")
    state, delayed_losses, _ = train_steps(corpus, recipe="delayed", mesh="dp=2,ep=2")
    with tempfile.TemporaryDirectory() as ckpt:
        manager = train_lib._ckpt_manager(train_lib.RunConfig(ckpt_dir=ckpt))
        train_lib.save_checkpoint(manager, state, {})
        manager.wait_until_finished()
        restored = train_lib.restore_checkpoint(manager, state, STEPS)
        manager.close()
    trees = [(s.params, s.opt_state) for s in (state, restored)]
    restored_same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))
                                                   and x.sharding.is_equivalent_to(y.sharding, x.ndim)), *trees)
    specs = {"/".join(str(getattr(k, "key", k)) for k in path): str(x.sharding.spec)
             for path, x in jax.tree_util.tree_flatten_with_path(state.params["params"])[0]
             if any(getattr(k, "key", None) in ("wi", "wo") for k in path)}
    fp8_meta = state.params.get("fp8_meta", {})
    print(json.dumps({
        "devices": len(jax.devices()),
        "losses": {"one_device": one_device, "dp2xep2": expert_parallel},
        "all_to_alls": all_to_alls,
        "expert_kernel_specs": specs,
        "delayed": {
            "losses": delayed_losses,
            "fp8_meta_leaves": len(jax.tree.leaves(fp8_meta)),
            "fp8_meta_same_on_every_device": all(same_on_every_device(x) for x in jax.tree.leaves(fp8_meta)),
            "restored_as_saved": all(jax.tree.leaves(restored_same)),
        },
    }))


if __name__ == "__main__":
    main()
