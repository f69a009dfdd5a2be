"""examples/gpt: a 20-step run of the tiny model, checkpoint resume, a recipes/ path, and the demo (CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.gpt import data as data_lib  # noqa: E402
from examples.gpt import demo, parallel  # noqa: E402
from examples.gpt import train as train_lib  # noqa: E402

STEPS, SAVE_AT = 20, 18
SMALL = dict(preset="tiny", batch=8, seq_len=64, eval_every=10, eval_batches=1, log_every=2, progress=False)


@pytest.fixture(scope="module")
def corpus():
    return data_lib.load(None, 2 << 20)


@pytest.fixture(scope="module")
def twenty_steps(corpus, tmp_path_factory):
    """20 steps of delayed scaling (the recipe with fp8_meta state), checkpointed at step 18 and at the end."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    cfg = train_lib.RunConfig(recipe="delayed", steps=STEPS, ckpt_dir=str(ckpt), ckpt_every=SAVE_AT, **SMALL)
    return train_lib.train(cfg, corpus, return_state=True), ckpt


def test_stdlib_corpus_is_deterministic_with_a_held_out_split(corpus):
    again = data_lib.load(None, 2 << 20)
    assert np.array_equal(corpus.train, again.train) and np.array_equal(corpus.eval, again.eval)
    assert len(corpus.eval) > 0.02 * len(corpus.train) and corpus.train.dtype == np.uint8
    b = data_lib.train_batch(corpus, 7, 4, 32, seed=1)
    assert b.shape == (4, 33) and np.array_equal(b, data_lib.train_batch(corpus, 7, 4, 32, seed=1))
    assert not np.array_equal(b, data_lib.train_batch(corpus, 8, 4, 32, seed=1))


def test_twenty_steps_loss_is_finite_and_decreases(twenty_steps):
    result, _ = twenty_steps
    losses = result["history"]["loss"]
    assert len(losses) == STEPS and np.all(np.isfinite(losses)), losses
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    evals = result["history"]["eval_loss"]
    assert len(evals) == 2 and np.all(np.isfinite(evals)) and evals[-1] < evals[0], evals
    assert result["tokens_per_s"] > 0
    assert "fp8_meta" in result["state"].params  # delayed scaling keeps state


def test_resume_continues_bit_identically(twenty_steps, corpus, tmp_path):
    result, ckpt = twenty_steps
    only_18 = tmp_path / "ckpt"
    shutil.copytree(ckpt, only_18)
    cfg = train_lib.RunConfig(recipe="delayed", steps=STEPS, ckpt_dir=str(only_18), resume=str(SAVE_AT), **SMALL)
    resumed = train_lib.train(cfg, corpus, return_state=True)
    assert resumed["history"]["step"] == [SAVE_AT + 1, STEPS]
    a, b = result["state"], resumed["state"]
    assert int(a.step) == int(b.step) == STEPS
    if jax.default_backend() != "cpu":
        # A GPU step is not bitwise reproducible even without a restart (XLA's scatter-add and reductions
        # use atomics), so there the resumed run only has to follow the same trajectory.
        np.testing.assert_allclose(resumed["history"]["loss"], result["history"]["loss"][SAVE_AT:], rtol=1e-3)
        return
    assert resumed["history"]["loss"] == result["history"]["loss"][SAVE_AT:]
    same = jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), (a.params, a.opt_state),
                        (b.params, b.opt_state))
    assert all(jax.tree.leaves(same))  # parameters, fp8_meta and the optimizer state
    with pytest.raises(ValueError, match="--recipe"):
        train_lib.train(train_lib.RunConfig(recipe="current", steps=STEPS, ckpt_dir=str(only_18), resume="latest",
                                            **SMALL), corpus)


def test_recipe_from_a_recipes_path(capsys):
    path = str(ROOT / "recipes" / "current_scaling_ref.py")
    (result,) = train_lib.main(["--recipe", path, "--steps", "3", "--batch", "4", "--seq-len", "64",
                                "--eval-batches", "1", "--data-bytes", str(1 << 20), "--no-progress"])
    assert result["recipe"] == "current_scaling_ref" and np.isfinite(result["final_eval_loss"])
    assert "current_scaling_ref" in capsys.readouterr().out


def test_inspect_writes_statistics_a_report_and_the_cost(tmp_path, capsys):
    """--inspect with --inspect-every: statistics at each evaluation, the JSON lines, the PNG, the cost per step."""
    (result,) = train_lib.main(["--recipe", "current", "--steps", "4", "--batch", "4", "--seq-len", "64",
                                "--eval-every", "2", "--eval-batches", "1", "--data-bytes", str(1 << 20),
                                "--no-progress", "--inspect", str(tmp_path), "--inspect-every", "2"])
    inspection = result["inspect"]
    lines = [json.loads(line) for line in Path(inspection["jsonl"]).read_text().splitlines()]
    assert {r["step"] for r in lines} == {2, 4}  # the evaluation steps
    assert {r["role"] for r in lines} >= {"linear_input", "linear_weight", "linear_grad_output"}
    assert all(0 < r["rel_error"] < 0.2 for r in lines if r["role"] == "linear_input")
    assert Path(inspection["report"]).stat().st_size > 0
    # the statistics add work: on CPU the inspected step is not faster than half the plain one
    assert inspection["inspect_step_ms"] >= 0.5 * inspection["step_ms"] > 0
    assert "inspection costs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--inspect-every needs --inspect"):
        train_lib.main(["--inspect-every", "2"])


def test_bad_recipe_and_mesh_say_what_to_do():
    with pytest.raises(ValueError, match="no recipe named"):
        train_lib.make_recipe("fp9")
    with pytest.raises(ValueError, match="dp=2"):
        parallel.parse_mesh("dp=two")
    assert parallel.parse_mesh("dp=2,tp=1") == {"dp": 2, "fsdp": 1, "tp": 1}


def test_mesh_data_and_tensor_parallel_on_fake_cpu_devices(tmp_path):
    """--mesh dp=2,tp=2 in a fresh process (4 fake CPU devices): same loss as one device, to fp32 tolerance."""
    args = [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "--recipe", "delayed", "--steps", "3",
            "--batch", "4", "--seq-len", "64", "--eval-batches", "1", "--data-bytes", str(1 << 20), "--no-progress"]
    losses = []
    for i, mesh in enumerate(("dp=1", "dp=2,tp=2")):
        out = tmp_path / f"{i}.json"
        subprocess.run(args + ["--mesh", mesh, "--json", str(out)], capture_output=True, cwd=ROOT, check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
        losses.append(json.loads(out.read_text())[0]["history"]["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-3)


def test_demo_runs(tmp_path, capsys):
    """The demo's main with a few steps, so CI runs the demo's code (bash tools/demo.sh runs it in full)."""
    results = demo.main(["--steps", "4", "--batch", "4", "--seq-len", "64", "--eval-every", "2",
                         "--out", str(tmp_path), "--no-progress"])
    assert [r["recipe"] for r in results] == ["bf16", "current", "delayed"]
    assert all(np.isfinite(r["final_eval_loss"]) for r in results)
    out = capsys.readouterr().out
    assert "tokens/s" in out and "vs bf16" in out and (tmp_path / "results.json").exists()


# ---- the README's quick start, as written ----------------------------------------------------------


def _readme_blocks() -> dict[str, str]:
    """The fenced blocks after ``<!-- readme-test: NAME -->`` markers in README.md."""
    text = (ROOT / "README.md").read_text()
    blocks = {}
    for part in text.split("<!-- readme-test: ")[1:]:
        name, _, rest = part.partition(" -->")
        body = rest.split("```", 2)[1]
        blocks[name] = body.split("\n", 1)[1]  # drop the language tag
    return blocks


def _apply_diff(base: str, diff: str) -> str:
    """Each run of "-" lines (which must occur once in ``base``) replaced by the "+" lines after it."""
    hunks, minus, plus = [], [], []
    for line in diff.splitlines():
        if line.startswith("-"):
            if plus:
                hunks.append((minus, plus))
                minus, plus = [], []
            minus.append(line[1:])
        elif line.startswith("+"):
            plus.append(line[1:])
    hunks.append((minus, plus))
    for minus, plus in hunks:
        old = "\n".join(minus) + "\n"
        assert base.count(old) == 1, old
        base = base.replace(old, "\n".join(plus) + "\n")
    return base


@pytest.mark.parametrize("name", ["base", "fp8", "delayed"])
def test_readme_quick_start_runs(name, capsys):
    blocks = _readme_blocks()
    code = blocks["base"] if name == "base" else _apply_diff(blocks["base"], blocks[name])
    namespace = {"__name__": f"readme_{name}"}
    exec(compile(code, f"README.md ({name})", "exec"), namespace)
    assert "final loss" in capsys.readouterr().out
    assert float(namespace["loss"]) < 0.5 * float(jax.numpy.mean(namespace["y"] ** 2))
    if name == "delayed":
        assert "fp8_meta" in namespace["state"].params
