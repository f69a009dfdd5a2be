"""examples/gpt: a 20-step run of the tiny model, checkpoint resume, a recipes/ path, and the demo (CPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qtest_util import run_on_fake_devices

import te_jax
from te_jax import recipe as R

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.gpt import data as data_lib  # noqa: E402
from examples.gpt import demo, parallel  # noqa: E402
from examples.gpt import train as train_lib  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402

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
    assert result["final_train_loss"] == pytest.approx(np.mean(losses[-2:]), rel=1e-6)  # the last 10% of 20
    header = train_lib.format_table([result]).splitlines()[0]
    assert "train loss (mean of last 10%)" in header and "eval loss" in header


def test_resume_continues_bit_identically(twenty_steps, corpus, tmp_path, capsys):
    result, ckpt = twenty_steps
    only_18 = tmp_path / "ckpt"
    shutil.copytree(ckpt, only_18)
    cfg = train_lib.RunConfig(recipe="delayed", steps=STEPS, ckpt_dir=str(only_18), resume=str(SAVE_AT), **SMALL)
    resumed = train_lib.train(cfg, corpus, return_state=True)
    said = f"delayed: resumed at step {SAVE_AT} from {only_18.absolute() / str(SAVE_AT)}"
    assert said in capsys.readouterr().out and (only_18 / str(SAVE_AT)).is_dir()
    # the history (and so the summary's train loss) covers the steps before the checkpoint too
    assert resumed["history"]["step"] == result["history"]["step"] == list(range(1, STEPS + 1))
    assert resumed["history"]["eval_step"] == result["history"]["eval_step"]
    a, b = result["state"], resumed["state"]
    assert int(a.step) == int(b.step) == STEPS
    if jax.default_backend() != "cpu":
        # A GPU step is not bitwise reproducible even without a restart (XLA's scatter-add and reductions
        # use atomics), so there the resumed run only has to follow the same trajectory.
        np.testing.assert_allclose(resumed["history"]["loss"], result["history"]["loss"], rtol=1e-3)
        return
    assert resumed["history"]["loss"] == result["history"]["loss"]
    assert resumed["final_train_loss"] == result["final_train_loss"]
    same = jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), (a.params, a.opt_state),
                        (b.params, b.opt_state))
    assert all(jax.tree.leaves(same))  # parameters, fp8_meta and the optimizer state
    with pytest.raises(ValueError, match="--recipe"):
        train_lib.train(train_lib.RunConfig(recipe="current", steps=STEPS, ckpt_dir=str(only_18), resume="latest",
                                            **SMALL), corpus)


class _DeviceView:
    """The first device as examples/gpt/memory.py's check sees it: a platform and a memory limit (1 MB)."""

    def __init__(self, platform: str):
        self.platform, self.device_kind = platform, "Test GPU" if platform == "gpu" else "cpu"

    def memory_stats(self) -> dict | None:
        return {"bytes_limit": 1 << 20} if self.platform == "gpu" else None  # a CPU device gives no figures


class _JaxSeeing:
    """``jax`` for memory.py, whose ``local_devices()`` is ``devices``; everything else is jax's own."""

    def __init__(self, devices):
        self._devices = devices

    def local_devices(self):
        return self._devices

    def __getattr__(self, name):
        return getattr(jax, name)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_a_step_too_large_for_the_machine_stops_before_training_and_leaves_no_folder(platform, tmp_path, capsys,
                                                                                       monkeypatch):
    """The 125m preset on a CPU needed a 103 GB allocation and left an empty --ckpt-dir: now the compiled step's
    memory analysis is checked first, the run ends with exit status 2 and a message that says what to do, and no
    checkpoint folder is made. Both of the check's branches run on any machine: the memory module sees one
    device of ``platform`` with 1 MB (the host's available RAM for a CPU, the allocator's limit for a GPU), so
    the tiny preset stands in for a step too large."""
    from examples.gpt import memory

    monkeypatch.setattr(memory, "jax", _JaxSeeing([_DeviceView(platform)]))
    monkeypatch.setattr(memory, "_host_available_bytes", lambda: 1 << 20)
    ckpt = tmp_path / "ckpt"
    err = _usage_error(["--steps", "2", "--batch", "4", "--seq-len", "64", "--eval-batches", "1", "--data-bytes",
                        str(1 << 20), "--no-progress", "--ckpt-dir", str(ckpt)], capsys)
    assert "the tiny preset's train step (--batch 4, --seq-len 64) needs" in err, err
    assert "XLA's memory analysis" in err and "--preset tiny" in err, err
    available = "0.0 GB of RAM available" if platform == "cpu" else "each Test GPU has 0.0 GB"
    assert available in err, (f"{platform}: the message does not say what the {platform} has ({available!r}): "
                              f"{err}")
    assert not ckpt.exists()
    said = memory.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 103 GB"), "the step")
    assert isinstance(said, memory.StepTooLarge) and "ran out of memory" in str(said)
    assert memory.out_of_memory(RuntimeError("INTERNAL: something else"), "the step") is None


def test_recipe_from_a_recipes_path(capsys):
    path = str(ROOT / "recipes" / "current_scaling_ref.py")
    (result,) = train_lib.main(["--recipe", path, "--steps", "3", "--batch", "4", "--seq-len", "64",
                                "--eval-batches", "1", "--data-bytes", str(1 << 20), "--no-progress"])
    assert result["recipe"] == "current_scaling_ref" and np.isfinite(result["final_eval_loss"])
    assert "current_scaling_ref" in capsys.readouterr().out


def test_tiny_moe_preset_trains_with_each_recipe_kind(capsys):
    """--preset tiny-moe (MoE blocks) with delayed, current and block scaling: finite losses, the MoE's size."""
    results = train_lib.main(["--preset", "tiny-moe", "--recipe", "delayed,current,block", "--steps", "3",
                              "--batch", "4", "--seq-len", "64", "--eval-batches", "1", "--data-bytes", str(1 << 20),
                              "--no-progress"])
    assert [r["recipe"] for r in results] == ["delayed", "current", "block"]
    assert all(np.isfinite(r["final_eval_loss"]) and np.isfinite(r["final_train_loss"]) for r in results)
    out = capsys.readouterr().out
    assert "preset tiny-moe" in out and "experts=8" in out and "1.05M params" in out


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


def _usage_error(argv: list[str], capsys) -> str:
    """What ``train.main(argv)`` prints on stderr when it exits with status 2 (argparse's usage error)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train_lib.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage: " in err and "Traceback" not in err, err
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv, says", [
    (["--recipe", "fp9"], "no recipe named 'fp9'"),
    (["--recipe", "recipes/nope.py"], "no recipe file"),
    (["--recipe", " , "], "names no recipe"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--mesh", "dp=two"], "--mesh: bad entry 'dp=two'"),
    (["--mesh", "dp=2", "--batch", "3"], "--batch 3 must be divisible by dp*fsdp*ep = 2"),
    (["--mesh", "tp=3"], "--mesh tp=3 must divide the tiny preset's attention heads (4)"),
    (["--mesh", "ep=2"], "--mesh ep=2: the tiny preset has no experts to split; use an MoE preset (tiny-moe, moe-1b)"),
    (["--preset", "tiny-moe", "--mesh", "ep=3"], "--mesh ep=3 must divide the tiny-moe preset's experts (8)"),
    (["--preset", "tiny-moe", "--mesh", "ep=2,tp=2"], "experts are not tensor parallel; use dp, fsdp and ep"),
    (["--preset", "tiny-moe", "--mesh", "dp=2,ep=2", "--batch", "6"],
     "--batch 6 must be divisible by dp*fsdp*ep = 4"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--inspect-every", "2"], "--inspect-every needs --inspect"),
    (["--inspect", "x", "--inspect-every", "0"], "--inspect-every must be an integer >= 1"),
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--resume", "last", "--ckpt-dir", "."], "--resume takes 'latest' or a step number, got 'last'"),
    (["--recipe", "bf16,delayed", "--ckpt-dir", "c"], "--ckpt-dir takes one --recipe at a time"),
    (["--num-processes", "2"], "need --distributed"),
    (["--data", "no_such_file.txt"], "--data no_such_file.txt: No such file or directory"),
])
def test_cli_mistakes_exit_2_with_a_message(argv, says, capsys):
    assert says in _usage_error(argv, capsys)


@pytest.mark.parametrize("flag, value, bound", [
    ("--steps", "0", "an integer >= 1"),
    ("--batch", "-4", "an integer >= 1"),
    ("--log-every", "0", "an integer >= 1"),
    ("--warmup", "-1", "an integer >= 0"),
    ("--lr", "nan", "a finite number > 0"),
    ("--clip", "0.0", "a finite number > 0"),
    ("--weight-decay", "-0.1", "a finite number >= 0"),
])
def test_cli_numbers_out_of_range_exit_2_naming_the_bound(flag, value, bound, capsys):
    assert _usage_error([flag, value], capsys).endswith(f" error: {flag} must be {bound}, got {value}")


def test_cli_checks_the_checkpoint_and_the_data_before_training(twenty_steps, tmp_path, capsys):
    _, ckpt = twenty_steps
    assert "--recipe 'delayed', this run has 'current'" in _usage_error(
        ["--recipe", "current", "--ckpt-dir", str(ckpt), "--resume"], capsys)
    assert "--resume 7: no such checkpoint" in _usage_error(
        ["--recipe", "delayed", "--ckpt-dir", str(ckpt), "--resume", "7"], capsys)
    assert "is not a directory" in _usage_error(["--ckpt-dir", str(tmp_path / "none"), "--resume"], capsys)
    short = tmp_path / "short.txt"
    short.write_text("x" * 4000)
    assert "shorter than --seq-len + 2" in _usage_error(["--data", str(short), "--seq-len", "1000"], capsys)


def test_unknown_recipe_lists_the_names_the_cli_takes_in_a_fresh_process():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "--recipe", "nonsense"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    for name in ("bf16", "flax-fp8", "delayed", "current", "block", "mxfp8", "nvfp4", "DelayedScaling",
                 "current_scaling_ref", "mixed_per_layer", "nvfp4_first_last_bf16"):
        assert name in run.stderr, name
    for name in ("delayed", "current", "block", "mxfp8", "nvfp4", "DelayedScaling", "mixed_per_layer"):
        assert type(train_lib.make_recipe(name)) is type(R.load_recipe(name))
    assert train_lib.make_recipe("bf16") is None and train_lib.make_recipe("flax-fp8") is None


def test_command_buffers_flag_reaches_xla_only_before_the_backend_starts(tmp_path):
    """--command-buffers no-custom-calls: XLA's debug options (dumped) list its default command-buffer types
    without CUSTOM_CALL; once jax has started its backend, a second choice is refused (XLA would ignore it)."""
    # sys.argv[2]: the te_jax under test (on a GPU machine, an installed wheel) goes before this tree
    child = ("import json, os, sys; sys.path[:0] = [sys.argv[2], sys.argv[1]]; from examples.gpt import train; "
             "train.use_command_buffers('xla'); unchanged = os.environ['XLA_FLAGS']; "
             "train.use_command_buffers('no-custom-calls'); import jax, jax.numpy as jnp; "
             "jax.jit(lambda x: x + 1)(jnp.ones(2)).block_until_ready(); refused = None\n"
             "try:\n  train.use_command_buffers('off')\nexcept ValueError as err:\n  refused = str(err)\n"
             "print(json.dumps({'unchanged': unchanged, 'flags': os.environ['XLA_FLAGS'], 'refused': refused}))")
    dump = tmp_path / "dump"
    run = subprocess.run([sys.executable, "-c", child, str(ROOT), str(Path(te_jax.__file__).resolve().parents[1])],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={dump}"})
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["unchanged"] == f"--xla_dump_to={dump}"
    assert got["flags"] == f"--xla_dump_to={dump} --xla_gpu_enable_command_buffer=-CUSTOM_CALL"
    assert got["refused"] == ("--command-buffers off: jax has started its backend already; XLA reads XLA_FLAGS "
                              "once, before that")
    (options,) = dump.glob("*jit__lambda*.debug_options")
    types = re.findall(r"xla_gpu_enable_command_buffer: (\w+)", options.read_text())
    assert "FUSION" in types and "CUSTOM_CALL" not in types, types


def test_mesh_parse():
    with pytest.raises(ValueError, match="dp=2"):
        parallel.parse_mesh("dp=two")
    assert parallel.parse_mesh("dp=2,tp=1") == {"dp": 2, "fsdp": 1, "ep": 1, "tp": 1}


def test_a_recipe_that_quantizes_no_layer_is_reported(capsys):
    """nvfp4_first_last_bf16 keeps blocks 0 and n-1 in bf16: on the 2-block tiny model nothing is quantized."""
    cfg = train_lib.RunConfig(recipe="nvfp4_first_last_bf16", **SMALL).resolved()
    model = GPT(cfg.model_config())
    tokens = jnp.zeros((2, 64), jnp.int32)
    deeper = GPT(dataclasses.replace(cfg.model_config(), layers=4))
    assert train_lib.quantized_layers(model, R.load_recipe("nvfp4_first_last_bf16", num_layers=2), tokens) == []
    got = train_lib.quantized_layers(deeper, R.load_recipe("nvfp4_first_last_bf16", num_layers=4), tokens)
    assert {path[0] for path in got} == {"TransformerLayer_1", "TransformerLayer_2"}
    assert ("TransformerLayer_0", "mlp", "wi") in train_lib.quantized_layers(
        model, R.load_recipe("mixed_per_layer"), tokens)
    train_lib.warn_if_unquantized(cfg, model, R.load_recipe("nvfp4_first_last_bf16", num_layers=2), tokens)
    err = capsys.readouterr().err
    assert "warning: --recipe nvfp4_first_last_bf16 quantizes no layer of the 2-block tiny model" in err
    for name in ("mixed_per_layer", "current"):
        train_lib.warn_if_unquantized(cfg, model, train_lib.make_recipe(name), tokens)
    assert capsys.readouterr().err == ""


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


def test_mesh_expert_parallel_on_fake_cpu_devices():
    """--mesh dp=2,ep=2 with tiny-moe (tests/multidevice/example_ep_multidevice.py, 4 fake CPU devices): without quantization
    the losses are the one-device ones to float32 rounding and the step exchanges tokens with all-to-all; the
    expert kernels are split over "ep" along their expert axis; under delayed scaling every device holds the same
    fp8_meta, and a checkpoint restores the state bit for bit with its shardings."""
    proc = run_on_fake_devices([ROOT / "tests" / "multidevice" / "example_ep_multidevice.py"], devices=4, cwd=ROOT)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = lines[-1]
    assert got["devices"] == 4
    np.testing.assert_allclose(got["losses"]["dp2xep2"], got["losses"]["one_device"], rtol=1e-6)
    assert got["all_to_alls"] == 5  # one MoE block's exchange: three forward, two backward (docs/moe.md)
    specs = got["expert_kernel_specs"]
    assert sorted(specs) == ["TransformerLayer_0/moe/wi", "TransformerLayer_0/moe/wo"], specs
    assert all(spec.startswith("P('ep',") for spec in specs.values()), specs
    delayed = got["delayed"]
    assert len(delayed["losses"]) == 3 and np.all(np.isfinite(delayed["losses"])), delayed
    assert delayed["fp8_meta_leaves"] > 0 and delayed["fp8_meta_same_on_every_device"], delayed
    assert delayed["restored_as_saved"], delayed


def test_demo_runs(tmp_path, capsys):
    """The demo's main with a few steps, so CI runs the demo's code (bash tools/demo.sh runs it in full)."""
    results = demo.main(["--steps", "4", "--batch", "4", "--seq-len", "64", "--eval-every", "2",
                         "--out", str(tmp_path), "--no-progress"])
    assert [r["recipe"] for r in results] == ["bf16", "current", "delayed"]
    assert all(np.isfinite(r["final_eval_loss"]) for r in results)
    out = capsys.readouterr().out
    assert "tokens/s" in out and "vs bf16" in out and (tmp_path / "results.json").exists()


def test_nnx_example_trains_with_each_recipe_kind(capsys):
    """examples/nnx_gpt.py's tiny preset, a few steps per recipe: the te_jax.nnx layers in a model (the layers
    themselves under every recipe: tests/nnx/test_nnx.py)."""
    from examples import nnx_gpt  # noqa: PLC0415

    recipes = ["bf16", "delayed", "block", "nvfp4"]
    results = nnx_gpt.main(["--recipe", ",".join(recipes), "--steps", "3", "--batch", "2", "--seq-len", "64",
                            "--eval-batches", "1", "--data-bytes", str(1 << 20)])
    assert [r["recipe"] for r in results] == recipes
    bf16 = results[0]["eval_loss"]
    for r in results:
        assert np.isfinite(r["losses"]).all() and abs(r["eval_loss"] - bf16) < 0.1, r
    assert "tokens/s" in capsys.readouterr().out


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


@pytest.mark.parametrize("name", ["nnx-base", "nnx-fp8", "nnx-delayed"])
def test_readme_nnx_quick_start_runs(name, capsys):
    blocks = _readme_blocks()
    code = blocks[name] if name == "nnx-base" else _apply_diff(blocks["nnx-base"], blocks[name])
    namespace = {"__name__": f"readme_{name}"}
    exec(compile(code, f"README.md ({name})", "exec"), namespace)
    assert "final loss" in capsys.readouterr().out
    assert float(namespace["loss"]) < 0.5 * float(jax.numpy.mean(namespace["y"] ** 2))
    if name == "nnx-delayed":
        from flax import nnx  # noqa: PLC0415

        import te_jax  # noqa: PLC0415

        assert jax.tree.leaves(nnx.state(namespace["model"], te_jax.nnx.FP8Meta))


def _commands(text: str, script: str) -> list[list[str]]:
    """The arguments of every ``.venv/bin/python <script> ...`` command in ``text`` (comments dropped)."""
    found = re.findall(rf"\.venv/bin/python\s+{re.escape(script)}([^`\n#]*)", text)
    return [shlex.split(args) for args in found]


def test_readme_python_commands_name_the_venv():
    """Pasted into a fresh shell after the set-up commands, every Python and pip command finds jax: it runs .venv's
    (a bare `pip install --no-build-isolation -e .` ran the system pip and failed with "No module named 'jax'")."""
    text = (ROOT / "README.md").read_text()
    interpreters = re.findall(r"([\w./-]*python3?)\s+(?:-m\s|examples/|benchmarks/|tools/)", text)
    assert interpreters and set(interpreters) == {".venv/bin/python"}, interpreters
    pips = re.findall(r"([\w./-]*pip3?)\s+install", text)
    assert pips and set(pips) == {".venv/bin/pip"}, pips
    assert "tools/demo.sh" in text and "tools/run_tests.sh" in text


def test_readme_and_docstring_train_commands_pass_the_flag_checks(monkeypatch):
    """Each train.py command of the README and of train.py's docstring parses and passes every check but the data's."""
    monkeypatch.chdir(ROOT)  # the commands are run from the repository root
    commands = _commands((ROOT / "README.md").read_text(), "examples/gpt/train.py")
    commands += _commands(train_lib.__doc__, "examples/gpt/train.py")
    assert len(commands) >= 12 and ["--recipe", "delayed", "--mesh", "dp=2,tp=2", "--batch", "8"] in commands
    assert all("--recipe" in argv for argv in commands if "--mesh" in argv)  # a mesh example shows FP8, not bf16
    parser = train_lib.build_parser()
    for argv in commands:
        args = parser.parse_args(argv)
        recipes = [r for r in args.recipe.split(",") if r]
        train_lib.check_configs([train_lib.config_from_args(args, r).resolved() for r in recipes])


def test_readme_transformer_engine_differences_hold():
    """The facts the README's "Coming from TransformerEngine" section states about te_jax."""
    import inspect

    import te_jax
    import te_jax.flax as tf
    from te_jax.spec import numerics

    assert inspect.signature(te_jax.autocast).parameters["enabled"].default is True
    assert not hasattr(te_jax, "fp8_autocast") and te_jax.FP8_COLLECTION == "fp8_meta"
    assert numerics.MAX_SCALE == 2.0**126
    for rec in (R.DelayedScaling(), R.Float8CurrentScaling(), R.MXFP8BlockScaling(), R.NVFP4BlockScaling(),
                R.Float8BlockScaling()):
        assert rec.quantizer("linear_output") is None and rec.quantizer("linear_grad_input") is None
        per_tensor = isinstance(rec, (R.DelayedScaling, R.Float8CurrentScaling))
        assert (rec.fast_accumulation, rec.backward_fast_accumulation) == (per_tensor, False)
        with pytest.raises(TypeError, match=f"te_jax: {type(rec).__name__} has no fp8_dpa= .*no FP8 attention"):
            type(rec)(fp8_dpa=False)
        with pytest.raises(TypeError, match="has no fp8_mha= .*no FP8 attention"):
            type(rec)(fp8_mha=True)
    for field, says in (("interval", "after every step"), ("override_linear_precision", "CustomRecipe"),
                        ("fp8_gemm_dgrad", "backward_fast_accumulation"), ("fp8_quant_fwd_inp", "use_power_2_scales")):
        with pytest.raises(TypeError, match=f"te_jax: DelayedScaling has no {field}= .*{says}"):
            R.DelayedScaling(**{field: None})
    with pytest.raises(TypeError, match="te_jax: MXFP8BlockScaling has no margin= "):
        R.MXFP8BlockScaling(margin=0)
    assert R.DelayedScaling(margin=1).margin == 1  # a field te_jax has is never refused
    assert {f.name for f in dataclasses.fields(te_jax.MeshResource)} == {"dp_resource", "tp_resource",
                                                                          "fsdp_resource", "sp_resource",
                                                                          "ep_resource"}
    assert tf.DenseGeneral(4).use_bias and tf.LayerNormDenseGeneral(4).use_bias and tf.LayerNormMLP().use_bias
    assert tf.DenseGeneral(4).dtype is None
    assert {"activation", "dropout_rng_name"} <= set(tf.LayerNormMLP.__dataclass_fields__)
    assert "intermediate_dim" in tf.TransformerLayer.__dataclass_fields__
    layer = tf.TransformerLayer(num_attention_heads=2, intermediate_dim=8)
    assert layer.mlp_activation == "gelu" and layer.enable_rotary_pos_emb and layer.hidden_dropout == 0.0
    x = jnp.ones((2, 16))
    assert set(tf.LayerNorm().init(jax.random.key(0), x)["params"]) == {"scale", "bias"}
    wi = tf.LayerNormMLP(intermediate_dim=8).init(jax.random.key(0), x)["params"]["wi_kernel"]
    assert wi.shape == (16, 8)
