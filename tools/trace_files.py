"""Counts the te_jax Python files entered while tracing one DelayedScaling LayerNormMLP train step.

Only ``jax.jit(step).lower(...)`` is watched, after the imports, the model's
init and the TrainState's creation: a ``sys.setprofile`` hook counts the
"call" events whose code object's file lies in the te_jax package. The step
is the three-line FP8 step of ``te_jax/train/step.py``: ``te_jax.flax.LayerNormMLP``
initialized under ``te_jax.autocast(recipe=te_jax.recipe.DelayedScaling())``,
``te_jax.train.TrainState`` with an optax optimizer, and
``te_jax.train.value_and_grad``. Fewer files on this path means a shorter
way from a layer call to its custom calls.

Examples:
  python3 tools/trace_files.py            # one line per file: calls, path; then the total
  python3 tools/trace_files.py --json     # {"files": {path: calls}, "total_files": N, "total_calls": M}
  python3 tools/trace_files.py --max 40   # exit 1 when more than 40 files are entered
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any


def build_step() -> tuple[Callable, tuple[Any, ...]]:
    """The train step and its arguments, after the imports, the model's init and the TrainState's creation."""
    import jax  # noqa: PLC0415  (imported here so that --help needs no jax)
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import te_jax  # noqa: PLC0415
    from te_jax.flax import LayerNormMLP  # noqa: PLC0415
    from te_jax.train import TrainState, value_and_grad  # noqa: PLC0415

    recipe = te_jax.recipe.DelayedScaling()
    model = LayerNormMLP(intermediate_dim=64)
    x = jnp.ones((8, 32), jnp.float32)
    with te_jax.autocast(recipe=recipe):
        variables = model.init(jax.random.key(0), x)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adamw(1e-3))

    def step(state, x):
        def loss_fn(variables):
            return jnp.mean(state.apply_fn(variables, x) ** 2)

        with te_jax.autocast(recipe=recipe):
            loss, grads = value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step, (state, x)


def package_dirs() -> list[pathlib.Path]:
    """The folders of the te_jax package that is imported (a source tree or an install; an editable install may
    add the folder of its compiled modules)."""
    import te_jax  # noqa: PLC0415

    return [pathlib.Path(p).resolve() for p in te_jax.__path__]


def count_entered_files(step: Callable, args: tuple[Any, ...], packages: Sequence[pathlib.Path]) -> dict[str, int]:
    """Traces ``jax.jit(step).lower(*args)`` and counts the Python calls per file under ``packages``.

    Args:
        step: the function to jit.
        args: its arguments.
        packages: the te_jax package folders; only files under them count.

    Returns:
        ``te_jax/<path in the package>`` -> number of "call" events whose code is in that file, sorted by path.
    """
    import jax  # noqa: PLC0415

    by_code: collections.Counter[str] = collections.Counter()
    resolved: dict[str, str | None] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:  # noqa: ARG001  (sys.setprofile's signature)
        if event == "call":
            by_code[frame.f_code.co_filename] += 1

    jitted = jax.jit(step)
    sys.setprofile(profile)
    try:
        jitted.lower(*args)
    finally:
        sys.setprofile(None)
    files: collections.Counter[str] = collections.Counter()
    for filename, calls in by_code.items():
        if filename not in resolved:
            path = pathlib.Path(filename)
            path = path.resolve() if path.is_absolute() else path
            inside = [package for package in packages if path.is_relative_to(package)]
            resolved[filename] = f"te_jax/{path.relative_to(inside[0]).as_posix()}" if inside else None
        if resolved[filename] is not None:
            files[resolved[filename]] += calls
    return dict(sorted(files.items()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max", type=int, metavar="N", help="exit 1 when more than N te_jax files are entered")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the count and prints it.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0, or 1 when ``--max`` is given and the number of files entered exceeds it.
    """
    args = build_parser().parse_args(argv)
    step, step_args = build_step()
    files = count_entered_files(step, step_args, package_dirs())
    total_files, total_calls = len(files), sum(files.values())
    over = args.max is not None and total_files > args.max
    if args.json:
        print(json.dumps({"files": files, "total_files": total_files, "total_calls": total_calls,
                          "max": args.max, "over": over}, indent=1))
    else:
        width = max((len(str(n)) for n in files.values()), default=1)
        for path, calls in files.items():
            print(f"{calls:>{width}} {path}")
        print(f"{total_files} te_jax files entered, {total_calls} calls"
              + (f" (--max {args.max})" if args.max is not None else ""))
    if over:
        print(f"trace_files: {total_files} files entered, more than --max {args.max}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
