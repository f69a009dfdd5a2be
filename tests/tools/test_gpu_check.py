"""tools/gpu_check.py on the CPU: argument parsing, the jobs it builds, --dry-run and the base/new ratios."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shlex
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOLS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def _jobs(argv: list[str], tmp_path: pathlib.Path):
    args = gpu_check.build_parser().parse_args(argv)
    layout = gpu_check.Layout(tmp_path / "out", tmp_path / "work")
    return gpu_check.make_jobs(args, layout, python="py"), layout


def test_device_command_runs_tests_then_benchmarks_from_outside_the_source_tree(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the GPU suite itself runs with one (the install folder)
    jobs, layout = _jobs(["--tests", "--bench", "layers,quantize"], tmp_path)
    assert [j.name for j in jobs] == ["tests", "bench_layers", "bench_quantize"]
    tests = jobs[0]
    assert tests.cwd == str(gpu_check.ROOT / "tests")
    assert tests.argv[:3] == ["py", "-m", "pytest"]
    assert tests.argv[-3:] == ["-n", str(gpu_check.TEST_WORKERS), "."]
    assert f"--progress-log={layout.out / 'tests.jsonl'}" in tests.argv
    for job in jobs:
        assert job.env["PYTHONPATH"] == str(layout.site("new"))
        assert job.gpus_needed == 1
    assert jobs[1].cwd == "/tmp"
    assert jobs[1].argv[1] == str(gpu_check.ROOT / "benchmarks" / "bench_layers.py")
    assert jobs[1].argv[2:4] == ["--out", str(layout.out / "bench_layers.json")]


def test_pytest_arguments_are_split_and_relative_to_tests(tmp_path):
    jobs, _ = _jobs(["--tests", "tests/ops/test_norm.py -k 'mxfp8 and not slow'"], tmp_path)
    assert jobs[0].argv[-3:] == ["ops/test_norm.py", "-k", "mxfp8 and not slow"]
    assert (pathlib.Path(jobs[0].cwd) / jobs[0].argv[-3]).is_file()  # the job runs in tests/


def test_bench_args_go_to_their_benchmark_only(tmp_path):
    jobs, _ = _jobs(["--bench", "layers", "--bench", "gemm", "--bench-args", 'layers=--sections mlp --only "te (a|b)"'],
                    tmp_path)
    by_name = {j.name: j for j in jobs}
    assert by_name["bench_layers"].argv[-4:] == ["--sections", "mlp", "--only", "te (a|b)"]
    assert by_name["bench_gemm"].argv[-1].endswith("bench_gemm.md")


def test_baseline_alternates_base_and_new_in_separate_install_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/te_site")  # kept after the install folder (TransformerEngine-JAX's)
    jobs, layout = _jobs(["--bench", "quantize", "--baseline-wheel", "old.whl", "--rounds", "2"], tmp_path)
    assert [j.name for j in jobs] == ["bench_quantize_base1", "bench_quantize_new1",
                                      "bench_quantize_base2", "bench_quantize_new2"]
    assert [j.env["PYTHONPATH"] for j in jobs] == [f"{layout.site(w)}:/tmp/te_site" for w in
                                                   ("base", "new", "base", "new")]
    assert layout.site("base") != layout.site("new")


def test_a_benchmark_listed_twice_gets_a_second_name(tmp_path):
    jobs, _ = _jobs(["--bench", "gemm,gemm"], tmp_path)
    assert [j.name for j in jobs] == ["bench_gemm", "bench_gemm_2"]


def test_train_runs(tmp_path):
    jobs, layout = _jobs(["--train", "delayed@1.3b:40,bf16", "--train", "mxfp8@tiny"], tmp_path)
    assert [j.name for j in jobs] == ["train_delayed_1.3b_40", "train_bf16_125m", "train_mxfp8_tiny"]
    first = jobs[0].argv
    assert first[first.index("--preset") + 1] == "1.3b"
    assert first[first.index("--recipe") + 1] == "delayed"
    assert first[first.index("--steps") + 1] == "40"
    assert first[first.index("--json") + 1] == str(layout.out / "train_delayed_1.3b_40.json")
    assert "--steps" not in jobs[1].argv and "--seed" not in first


def test_train_runs_with_a_seed_get_their_own_name(tmp_path):
    jobs, _ = _jobs(["--train", "bf16@moe-1b,bf16@moe-1b/1,bf16@tiny:20/2"], tmp_path)
    assert [j.name for j in jobs] == ["train_bf16_moe-1b", "train_bf16_moe-1b_seed1", "train_bf16_tiny_20_seed2"]
    assert "--seed" not in jobs[0].argv
    for job, seed in zip(jobs[1:], ("1", "2")):
        assert job.argv[job.argv.index("--seed") + 1] == seed


def test_train_runs_share_a_gpu_with_their_memory_split(tmp_path):
    jobs, _ = _jobs(["--train", "bf16@moe-1b,delayed@moe-1b", "--train-args", "--batch 4 --lr 1e-3",
                     "--train-per-gpu", "3"], tmp_path)
    assert [j.name for j in jobs] == ["train_bf16_moe-1b", "train_delayed_moe-1b"]
    for job in jobs:
        assert job.share == 3 and job.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.300"
        assert job.argv[-4:] == ["--batch", "4", "--lr", "1e-3"]
    alone = _jobs(["--train", "delayed"], tmp_path)[0][0]
    assert alone.share == 1 and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in alone.env


def test_shared_jobs_fill_a_gpu_up_to_their_share_and_never_join_a_lone_job():
    place, Job = gpu_check.gpu_jobs.place, gpu_check.gpu_jobs.Job
    shared, lone, pair = Job("s", 1, 1, ["true"], share=3), Job("l", 1, 1, ["true"]), Job("p", 1, 2, ["true"])
    assert place(shared, {"0": [3, 3], "1": [3]}) == ["1"]  # the least-held GPU first
    assert place(shared, {"0": [3, 3, 3]}) is None  # full
    assert place(shared, {"0": [1], "1": [2]}) is None  # a lone job's GPU, another share's
    assert place(lone, {"0": [3], "1": []}) == ["1"] and place(lone, {"0": [3]}) is None
    assert place(pair, {"0": [], "1": [3], "2": []}) == ["0", "2"]
    with pytest.raises(ValueError, match="one GPU"):
        Job("x", 1, 2, ["true"], share=2)


def test_graphs_run_each_train_run_once_per_command_buffer_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    jobs, layout = _jobs(["--train", "delayed@125m:100,bf16@tiny", "--graphs"], tmp_path)
    assert [j.name for j in jobs] == [
        "train_delayed_125m_100_graphs-no-custom-calls", "train_delayed_125m_100_graphs-xla",
        "train_bf16_tiny_graphs-no-custom-calls", "train_bf16_tiny_graphs-xla"]
    for job in jobs:
        mode = job.name.rsplit("_graphs-", 1)[1]
        assert job.argv[job.argv.index("--command-buffers") + 1] == mode
        assert job.argv[job.argv.index("--json") + 1] == str(layout.out / f"{job.name}.json")
        assert job.env["XLA_FLAGS"] == (f"--xla_gpu_autotune_level=0 --xla_dump_to={layout.dump(job.name)} "
                                        "--xla_dump_hlo_module_re=jit_train_step")
    jobs, _ = _jobs(["--train", "delayed", "--graphs", "off"], tmp_path)
    assert [j.name for j in jobs] == ["train_delayed_125m_graphs-off"]
    plain = _jobs(["--train", "delayed"], tmp_path)[0][0]
    assert "--command-buffers" not in plain.argv and "XLA_FLAGS" not in plain.env


def test_command_buffer_rows_read_each_graphs_jobs_dump(tmp_path):
    jobs, layout = _jobs(["--train", "delayed", "--graphs"], tmp_path)
    hlo = 'ENTRY %main {\n  %a = f32[4] custom-call(%p), custom_call_target="te_jax_gemm_fp8"\n}\n'
    for job, thunks in zip(jobs, ["kCustomCall\t\n", "kCommandBuffer\t\n  kCustomCall\t\n"]):
        dump = layout.dump(job.name)
        dump.mkdir(parents=True)
        (dump / "module_0003.jit_train_step.sm_9.0_gpu_after_optimizations.txt").write_text(hlo)
        (dump / "module_0003.jit_train_step.thunk_sequence_after_thunk_passes.txt").write_text(thunks)
    rows = gpu_check.command_buffer_rows(layout, jobs)
    assert [(r["job"], r["te_jax_calls"], r["custom_calls_inside"], r["custom_calls_outside"]) for r in rows] == [
        ("train_delayed_125m_graphs-no-custom-calls", 1, 0, 1), ("train_delayed_125m_graphs-xla", 1, 1, 0)]


def test_graphs_modes_are_the_examples_choices(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS.parent))
    from examples.gpt import train as train_lib

    assert set(gpu_check.COMMAND_BUFFER_MODES) == set(train_lib.COMMAND_BUFFER_FLAGS)
    assert set(gpu_check.GRAPHS_DEFAULT.split(",")) <= set(train_lib.COMMAND_BUFFER_FLAGS)


def test_estimates_match_by_name_prefix_the_longest_winning(tmp_path):
    jobs, _ = _jobs(["--tests", "--bench", "layers,gemm", "--train", "delayed", "--estimate", "bench=60",
                     "--estimate", "bench_layers=540", "--estimate", "tests=340"], tmp_path)
    assert {j.name: j.estimate_s for j in jobs} == {
        "tests": 340, "bench_layers": 540, "bench_gemm": 60,
        "train_delayed_125m": gpu_check.train_estimate_s("delayed", "125m", None)}


def test_multi_gpu_holds_two_gpus(tmp_path):
    jobs, _ = _jobs(["--multi-gpu"], tmp_path)
    assert [(j.name, j.gpus_needed) for j in jobs] == [("mesh", 2)]
    script = pathlib.Path(jobs[0].cwd) / jobs[0].argv[1]
    assert script.is_file() and script.name == "mesh_multidevice.py", script


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to run"),
    (["--bench", "nosuch"], "no benchmark 'nosuch'"),
    (["--bench", "gemm", "--bench-args", "layers=--quick"], "which --bench does not name"),
    (["--bench", "gemm", "--bench-args", "gemm"], "NAME="),
    (["--train", "delayed@125m:many"], "RECIPE[@PRESET[:STEPS]]"),
    (["--train", "@125m"], "RECIPE[@PRESET[:STEPS]]"),
    (["--train", "bf16@125m/one"], "RECIPE[@PRESET[:STEPS]][/SEED]"),
    (["--tests", "--python-from-checkout"], "applies to an installed --wheel"),
    (["--bench", "gemm", "--rounds", "2"], "more than 1 only with"),
    (["--bench", "gemm", "--estimate", "bench=soon"], "NAME=SECONDS"),
    (["--bench", "gemm", "--baseline-wheel", "old.whl", "--rounds", "0"], "--rounds takes a number >= 1"),
    (["--train", "delayed", "--graphs", "sometimes"], "--graphs takes xla, no-custom-calls, off"),
    (["--bench", "gemm", "--graphs"], "applies to --train runs"),
    (["--train", "delayed", "--train-per-gpu", "0"], "--train-per-gpu takes a number >= 1"),
    (["--bench", "gemm", "--train-args", "--batch 4"], "apply to --train runs"),
])
def test_bad_arguments_say_what_to_do(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("(", r"\(")):
        _jobs(argv, tmp_path)


def test_dry_run_prints_the_jobs_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code = gpu_check.main(["--tests", "--bench", "layers,quantize", "--out", str(out), "--dry-run"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "pip wheel" in printed and "cmake.define.TE_JAX_CUDA=ON" in printed
    assert [line.split(":")[0] for line in printed.splitlines() if line.startswith("job ")] == [
        "job tests", "job bench_layers", "job bench_quantize"]
    assert not out.exists()


def test_ratios_pair_the_same_timing_of_base_and_new_runs(tmp_path):
    def result(ms_a: float, ms_b: float) -> dict:
        return {"rows": [{"case": "fp8", "ours": {"ms": ms_a}, "base": {"ms": 9.0}},
                         {"case": "mx", "ours": {"ms": ms_b}, "base": {"error": "x"}}], "copy_ms": 1.0}

    for name, ms_a, ms_b in [("base1", 2.0, 4.0), ("new1", 1.0, 4.0), ("base2", 4.0, 4.0), ("new2", 1.0, 2.0)]:
        (tmp_path / f"bench_q_{name}.json").write_text(json.dumps(result(ms_a, ms_b)))
    rows = {r["timing"]: r for r in gpu_check.ratio_rows(tmp_path, ["bench_q"], rounds=2)}
    assert set(rows) == {"fp8 / ours", "fp8 / base", "mx / ours"}
    assert rows["fp8 / ours"]["base/new"] == pytest.approx(3.0)  # medians 3.0 and 1.0
    assert rows["mx / ours"]["base/new"] == pytest.approx(4.0 / 3.0)
    assert rows["fp8 / base"]["base/new"] == pytest.approx(1.0)


def test_usage_examples_in_the_docstring_parse(tmp_path):
    """Every example of the docstring parses, and the test files its --tests examples name exist."""
    doc = gpu_check.__doc__.replace("\\\n", " ")
    examples = [line.strip() for line in doc.splitlines() if line.strip().startswith("python3 tools/gpu_check.py")]
    assert examples and len(examples) == doc.count("python3 tools/gpu_check.py"), examples
    test_args = 0
    for line in examples:
        argv = shlex.split(line.split("#")[0].replace("$OUT", str(tmp_path)))[2:]
        argv = [a for a in argv if a != "\\"]
        args = gpu_check.build_parser().parse_args(argv)
        for arg in shlex.split(args.tests or ""):
            if arg.endswith(".py") or "::" in arg:
                test_args += 1
                path = gpu_check.ROOT / "tests" / arg.split("::")[0].removeprefix("tests/")
                assert path.is_file(), f"{line!r} names {arg}, but {path} does not exist"
    assert test_args, "no example runs a single test file"


def test_test_files_the_tool_names_exist():
    """Test files named anywhere in tools/gpu_check.py (docstring, help texts, jobs) are where the tests run."""
    source = (TOOLS / "gpu_check.py").read_text()
    named = set(re.findall(r"[\w/]*\btest_\w+\.py|tests/[\w/]+\.py", source))
    assert named, "tools/gpu_check.py names no test file"
    missing = sorted(n for n in named if not (gpu_check.ROOT / "tests" / n.removeprefix("tests/")).is_file())
    assert not missing, f"tools/gpu_check.py names {missing}, which are not under tests/ (tests/<floor>/test_*.py)"


def test_python_from_checkout_replaces_the_installed_python_only(tmp_path):
    """The installed package's .py files become the checkout's, its recipes gallery included (stale ones removed);
    other files stay."""
    installed = tmp_path / "te_jax"
    (installed / "ops").mkdir(parents=True)
    (installed / "gallery").mkdir()
    (installed / "ops" / "gemm.py").write_text("old")
    (installed / "gone.py").write_text("a module the checkout no longer has")
    (installed / "gallery" / "gone_recipe.py").write_text("a recipe the checkout no longer has")
    (installed / "_te_jax_cuda.so").write_text("compiled")
    count = gpu_check.overlay_python(tmp_path)
    package, gallery = gpu_check.ROOT / "te_jax", sorted((gpu_check.ROOT / "recipes").glob("*.py"))
    assert gallery and count == len(list(package.rglob("*.py"))) + len(gallery)
    assert (installed / "ops" / "gemm.py").read_text() == (package / "ops" / "gemm.py").read_text()
    assert all((installed / "gallery" / r.name).read_text() == r.read_text() for r in gallery)
    assert not (installed / "gone.py").exists() and not (installed / "gallery" / "gone_recipe.py").exists()
    assert (installed / "_te_jax_cuda.so").read_text() == "compiled"


def test_extra_wheels_join_the_jobs_site(tmp_path, capsys):
    """--extra-wheel: the wheel is installed (no dependencies) beside te_jax in the jobs' folder."""
    import zipfile

    import gpu_build

    wheel = tmp_path / "extra_pkg-0.1-py3-none-any.whl"
    files = {"extra_pkg/__init__.py": "VALUE = 7\n",
             "extra_pkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: extra_pkg\nVersion: 0.1\n",
             "extra_pkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "extra_pkg-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in {**files, "extra_pkg-0.1.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    site = tmp_path / "site"
    site.mkdir()
    gpu_build.install_extras([wheel], site, tmp_path / "log", sys.executable)
    assert (site / "extra_pkg" / "__init__.py").read_text() == "VALUE = 7\n"
    gpu_build.install_extras([], site, tmp_path / "log", sys.executable)  # nothing to add: nothing runs
    assert gpu_check.main(["--bench", "layers", "--extra-wheel", str(wheel), "--out", str(tmp_path / "o"),
                           "--dry-run"]) == 0
    assert f"with {wheel}" in capsys.readouterr().out


def test_progress_log_says_what_failed_and_why_even_when_the_run_is_cut_short(tmp_path):
    """tests/conftest.py's --progress-log, read by gpu_summary: every outcome as it happens, the crash line of each
    failure, and a run that never reached pytest's final report (here: one test never reported) is marked so."""
    import subprocess  # noqa: PLC0415

    (tmp_path / "conftest.py").write_text((gpu_check.ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_cases.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 + 1 == 3, 'the sum is off by one'\n"
        "def test_skipped(): pytest.skip('not here')\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('set-up broke')\n"
        "def test_setup_error(broken): pass\n")
    log = tmp_path / "out" / "tests.jsonl"
    log.parent.mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           f"--progress-log={log}", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                          check=False, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 1, done.stdout + done.stderr
    gpu_summary = sys.modules["gpu_summary"]
    t = gpu_summary.test_counts(log)
    assert (t["collected"], t["passed"], t["failed"], t["skipped"], t["complete"]) == (4, 1, 2, 1, True)
    by_test = {f["test"].split("::")[1]: f for f in t["failures"]}
    assert "the sum is off by one" in by_test["test_bad"]["message"]
    assert by_test["test_setup_error"]["when"] == "setup" and "set-up broke" in by_test["test_setup_error"]["message"]
    lines = [line for line in log.read_text().splitlines() if "test_ok" not in line]
    log.write_text("\n".join(lines) + '\n{"test": "test_cases.py::test_o')  # killed before test_ok reported, mid-line
    t = gpu_summary.test_counts(log)
    assert not t["complete"] and t["reported"] == 3
    md = "\n".join(gpu_summary.test_lines(t))
    assert "cut short: 3 of 4 reported" in md and "the sum is off by one" in md
    assert gpu_summary.test_counts(tmp_path / "none.jsonl") == {"ran": False}
