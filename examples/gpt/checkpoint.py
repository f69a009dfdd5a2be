"""Orbax checkpoints of the GPT example's train state, fp8_meta included (used by examples/gpt/train.py).

A checkpoint holds the step, the parameters (fp8_meta included) and the optimizer state, and as
metadata the preset, recipe and seed of the run that wrote it and its loss history up to the step
(so a resumed run reports the figures an uninterrupted one does); ``--resume`` checks the metadata
before restoring. orbax is imported only when a checkpoint is used.
"""

from __future__ import annotations

from pathlib import Path

import jax

from examples.gpt.config import RunConfig
from te_jax.train import TrainState


def _ckpt_manager(cfg: RunConfig):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=3, create=True)
    return ocp.CheckpointManager(Path(cfg.ckpt_dir).absolute(), options=options)


def _ckpt_tree(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def save_checkpoint(manager, state: TrainState, meta: dict) -> None:
    import orbax.checkpoint as ocp

    step = int(state.step)
    if step in manager.all_steps():
        return
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_ckpt_tree(state)),
                                               meta=ocp.args.JsonSave(meta)))


def find_checkpoint(manager, which: str, meta: dict) -> int:
    """The step of the checkpoint ``--resume which`` names, after checking it was written by this preset and recipe.

    Raises:
      FileNotFoundError: no such checkpoint in the manager's directory.
      ValueError: the checkpoint was written with another --preset or --recipe.
    """
    import orbax.checkpoint as ocp

    steps = list(manager.all_steps())
    step = manager.latest_step() if which == "latest" else int(which)
    if step is None or step not in steps:
        raise FileNotFoundError(f"--resume {which}: no such checkpoint in {manager.directory} (steps there: {steps})")
    saved_meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    for key in ("preset", "recipe"):
        if saved_meta.get(key) != meta[key]:
            raise ValueError(f"--resume: the checkpoint was written with --{key} {saved_meta.get(key)!r}, "
                             f"this run has {meta[key]!r}")
    return step


def saved_history(manager, step: int) -> dict[str, list]:
    """The losses the run that wrote checkpoint ``step`` had recorded (``{"step": [...], "loss": [...], ...}``),
    the steps after ``step`` dropped; empty for a checkpoint written without them."""
    import orbax.checkpoint as ocp

    hist = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"].get("history") or {}
    out = {}
    for steps, values in (("step", "loss"), ("eval_step", "eval_loss")):
        kept = [(s, v) for s, v in zip(hist.get(steps, []), hist.get(values, [])) if s <= step]
        out[steps], out[values] = [s for s, _ in kept], [v for _, v in kept]
    return out


def restore_checkpoint(manager, state: TrainState, step: int) -> TrainState:
    """``state`` with step, params (fp8_meta included) and optimizer state from the checkpoint of ``step``."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                          if isinstance(x, jax.Array) else x, _ckpt_tree(state))
    tree = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    return state.replace(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"])


def check_resume(cfg: RunConfig) -> None:
    """Raises (FileNotFoundError, ValueError) unless ``cfg.resume`` names a checkpoint this run can continue."""
    if not Path(cfg.ckpt_dir).is_dir():
        raise FileNotFoundError(f"--resume: --ckpt-dir {cfg.ckpt_dir} is not a directory")
    manager = _ckpt_manager(cfg)
    try:
        find_checkpoint(manager, cfg.resume, _ckpt_meta(cfg))
    finally:
        manager.close()


def _ckpt_meta(cfg: RunConfig) -> dict:
    return {"preset": cfg.preset, "recipe": cfg.recipe, "seed": cfg.seed}
