"""te_jax's GPU check: build the CUDA wheel, install it into a private folder, run tests, benchmarks
and training runs on the machine's GPUs in parallel within a deadline, and write a summary.

The wheel is built from this checkout with its CUDA handlers (or taken from --wheel) and installed
with ``pip install --target`` into a folder of its own; every job runs with ``PYTHONPATH`` pointing
there, and from outside the source tree (the tests from tests/, the rest from /tmp), so it imports
the installed te_jax with its compiled modules, never the source tree's te_jax/. No installed
package is modified. A before/after comparison (--baseline-wheel) installs the second wheel into a
second folder and runs each benchmark with the two in turns.

Writes under --out: summary.md and summary.json (tests, benchmarks, base/new ratios, training,
jobs; with --graphs, where XLA put te_jax's calls in each training job's train step, read from its
XLA dump by tools/xla_dump.py), jobs.log (one JSON line per job), logs.tgz (the build log and every job's output) and the
wheel it built (pass it back with --wheel to skip the build). A job starts only when its time
estimate still fits before --deadline (counted from the start, build included); --estimate
NAME=SECONDS corrects the estimate of the jobs it names.

Examples:
  python3 tools/gpu_check.py --tests --bench layers,quantize --out $OUT
  python3 tools/gpu_check.py --tests "ops/test_norm.py -k mxfp8"
  python3 tools/gpu_check.py --wheel new.whl --baseline-wheel old.whl --rounds 2 \\
      --bench layers --bench-args layers="--sections mlp --trials 5"
  python3 tools/gpu_check.py --train delayed@125m:200,bf16@125m:200
  python3 tools/gpu_check.py --train bf16@moe-1b,bf16@moe-1b/1,delayed@moe-1b,block@moe-1b \\
      --train-args "--batch 4" --train-per-gpu 3   # a loss table (bf16 twice: seeds 0 and 1), three runs per GPU
  python3 tools/gpu_check.py --train delayed@125m:200 --graphs   # tokens/s with te_jax's calls out of / in CUDA graphs
  python3 tools/gpu_check.py --tests --bench gemm --dry-run    # print the jobs, run nothing
  python3 tools/gpu_check.py --wheel gpu_out/te_jax-*.whl --python-from-checkout --tests   # Python-only changes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_jobs  # noqa: E402  (a sibling module of this script)
import gpu_summary  # noqa: E402
import xla_dump  # noqa: E402
from gpu_build import cutlass_build_flags, cutlass_source, install, install_extras, overlay_python, step  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
# examples/gpt/presets.py, for time estimates only
PRESET_STEPS = {"tiny": 200, "125m": 500, "1.3b": 500, "tiny-moe": 200, "moe-1b": 500}
BUILD_FLAGS = ["-C", "cmake.define.TE_JAX_CUDA=ON", "-C", "cmake.define.CMAKE_CUDA_ARCHITECTURES=90a"]
BENCH_ESTIMATE_S = 120
TESTS_ESTIMATE_S = 300  # a part of the suite
# The whole suite: 2535 of 2555 tests in 463 s on one H100 80GB with 10 workers, so it does not fit beside a
# build (about 170 s) in one 600 s call: build once, then pass the wheel back with --wheel.
WHOLE_SUITE_ESTIMATE_S = 520
MESH_ESTIMATE_S = 200
TEST_WORKERS = 10  # 14 were slower on a 16-core machine (XLA compiles use several threads)
# examples/gpt/train.py --command-buffers choices; --graphs alone compares te_jax's calls outside and inside.
COMMAND_BUFFER_MODES = ("xla", "no-custom-calls", "off")
GRAPHS_DEFAULT = "no-custom-calls,xla"
TRAIN_MODULE = "jit_train_step"  # examples/gpt/train.py's jitted step, as XLA names its module


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the check keeps its files.

    Attributes:
        out: results (summary, logs.tgz, the built wheel).
        work: scratch: the build, the install folders, the job logs.
    """

    out: pathlib.Path
    work: pathlib.Path

    @property
    def logs(self) -> pathlib.Path:
        return self.work / "logs"

    def site(self, which: str) -> pathlib.Path:
        """The folder a wheel is installed into: "new" (the wheel under test) or "base"."""
        return self.work / f"site_{which}"

    def dump(self, job_name: str) -> pathlib.Path:
        """The folder a --graphs training job's XLA dump goes to."""
        return self.work / "dumps" / job_name


def parse_bench_args(items: list[str]) -> dict[str, list[str]]:
    """Maps ``NAME=ARGS`` items (ARGS a shell-quoted string) to benchmark name -> argument list."""
    parsed = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"gpu_check: --bench-args takes NAME=\"ARGS\", got {item!r}")
        parsed[name] = shlex.split(value)
    return parsed


def parse_train_run(run: str, default_preset: str = "125m") -> tuple[str, str, int | None, int | None]:
    """Splits ``RECIPE[@PRESET[:STEPS]][/SEED]`` into (recipe, preset, steps or None: the preset's, seed or None)."""
    run, slash, seed = run.partition("/")
    recipe, _, spec = run.partition("@")
    preset, _, steps = (spec or default_preset).partition(":")
    if not recipe or not preset or (steps and not steps.isdigit()) or (slash and not seed.isdigit()):
        raise SystemExit(f"gpu_check: --train takes RECIPE[@PRESET[:STEPS]][/SEED], got {run + slash + seed!r}")
    return recipe, preset, int(steps) if steps else None, int(seed) if slash else None


def train_estimate_s(recipe: str, preset: str, steps: int | None) -> float:
    """Rough seconds for a training run: compilation and evaluation, then the steps."""
    per_step = {"tiny": 0.05, "tiny-moe": 0.05, "125m": 0.16, "moe-1b": 0.4}.get(preset, 1.3)
    if recipe in ("mxfp8", "nvfp4", "flax-fp8"):
        per_step *= 1.5
    return 60 + (steps or PRESET_STEPS.get(preset, 500)) * per_step


def apply_estimates(jobs: list[gpu_jobs.Job], items: list[str]) -> None:
    """Sets each job's estimate from ``NAME=SECONDS`` items whose NAME is the job's name or a prefix of it."""
    estimates = {}
    for item in items:
        name, _, seconds = item.partition("=")
        try:
            estimates[name] = float(seconds)
        except ValueError:
            raise SystemExit(f"gpu_check: --estimate takes NAME=SECONDS, got {item!r}") from None
    for job in jobs:
        matches = [n for n in estimates if job.name == n or job.name.startswith(n + "_")]
        if matches:
            job.estimate_s = estimates[max(matches, key=len)]


def split_names(values: list[str]) -> list[str]:
    """The comma-separated names of repeated flags, in order."""
    return [name for value in values for name in value.split(",") if name]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheel", type=pathlib.Path, help="install this wheel instead of building one")
    p.add_argument("--python-from-checkout", action="store_true",
                   help="with --wheel: replace the installed wheel's Python files by this checkout's te_jax/ (its "
                        "compiled modules stay): for a checkout whose csrc/ is unchanged since the wheel was built")
    p.add_argument("--cutlass-wheel", type=pathlib.Path,
                   help="the nvidia-cutlass wheel whose headers the build uses when the build's Python has no "
                        "cutlass_library package (default: the newest .cache/cutlass/nvidia_cutlass-*.whl of this "
                        "checkout, which tools/compile_cuda.sh downloads; carry it to a machine without network)")
    p.add_argument("--baseline-wheel", type=pathlib.Path,
                   help="run every benchmark also with this wheel (its own install folder), in turns, and "
                        "write the base/new ratio of each timing; the benchmark scripts are this checkout's, "
                        "so both wheels must have the API they use")
    p.add_argument("--baseline-python", type=pathlib.Path, metavar="DIR",
                   help="instead of --baseline-wheel: the baseline is the wheel this run uses with DIR's te_jax/*.py "
                        "and recipes/*.py over it (e.g. `git archive OLD te_jax recipes` unpacked): a before/after "
                        "comparison of a change that leaves csrc/ alone")
    p.add_argument("--extra-wheel", type=pathlib.Path, action="append", default=[],
                   help="also install this wheel (no dependencies) where te_jax is installed, for the jobs: an "
                        "optional extra's package such as .cache/gpuwheels/qwix-*.whl (repeatable)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --baseline-wheel: base/new pairs per benchmark (base, new, base, new, ...)")
    p.add_argument("--tests", nargs="?", const="", metavar="PYTEST_ARGS",
                   help="run the test suite (pytest -n 10 from tests/); an optional quoted string of pytest "
                        "arguments narrows it, e.g. \"ops/test_norm.py -k mxfp8\"")
    p.add_argument("--bench", action="append", default=[], metavar="NAME[,NAME]",
                   help="run benchmarks/bench_NAME.py (repeatable)")
    p.add_argument("--bench-args", action="append", default=[], metavar="NAME=\"ARGS\"",
                   help="extra arguments for one benchmark, e.g. layers=\"--sections mlp\" (repeatable)")
    p.add_argument("--train", action="append", default=[], metavar="RECIPE[@PRESET[:STEPS]][/SEED][,...]",
                   help="examples/gpt/train.py runs, one GPU each (default preset 125m; a SEED is passed as "
                        "--seed, e.g. bf16@moe-1b/1 for a second bf16 run, the noise floor of a loss table)")
    p.add_argument("--train-args", default="", metavar="\"ARGS\"",
                   help="extra examples/gpt/train.py arguments for every --train run, e.g. \"--batch 4\"")
    p.add_argument("--train-per-gpu", type=int, default=1, metavar="N",
                   help="up to N --train runs share one GPU, each with 0.9/N of its memory "
                        "(XLA_PYTHON_CLIENT_MEM_FRACTION): for loss tables, not for tokens/s")
    p.add_argument("--graphs", nargs="?", const=GRAPHS_DEFAULT, metavar="MODE[,MODE]",
                   help="run every --train run once per examples/gpt/train.py --command-buffers MODE (xla: XLA's "
                        "CUDA graphs with te_jax's calls inside; no-custom-calls: te_jax's calls between the "
                        f"graphs; off: no graphs), job names ending _graphs-MODE; alone: {GRAPHS_DEFAULT}")
    p.add_argument("--multi-gpu", action="store_true",
                   help="the layer mesh check over two GPUs (tests/multidevice/mesh_multidevice.py --check)")
    p.add_argument("--deadline", type=float, default=570, help="seconds from the start by which every job ends")
    p.add_argument("--estimate", action="append", default=[], metavar="NAME=SECONDS",
                   help="how long the jobs whose name is NAME or starts with NAME_ take (a job starts only when "
                        "its estimate fits before the deadline), e.g. tests=340, bench=60, bench_layers=540 "
                        "(repeatable; the longest matching NAME wins)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "gpu_out")),
                   help="output folder (default: $OUT, else ./gpu_out)")
    p.add_argument("--dry-run", action="store_true", help="print what would run and stop")
    return p


def has_baseline(args: argparse.Namespace) -> bool:
    """Whether the benchmarks also run against a baseline (--baseline-wheel or --baseline-python)."""
    return bool(args.baseline_wheel or getattr(args, "baseline_python", None))


def make_jobs(args: argparse.Namespace, layout: Layout, python: str = sys.executable) -> list[gpu_jobs.Job]:
    """The jobs, in the order they start: the tests, the benchmarks, the mesh check, the training runs."""
    # NCCL_NVLS_ENABLE=0: NVLink multicast stays off on the lent multi-GPU machines.
    if args.baseline_wheel and args.baseline_python:
        raise SystemExit("gpu_check: give --baseline-wheel or --baseline-python, not both")
    if args.rounds < 1 or (args.rounds > 1 and not has_baseline(args)):
        raise SystemExit("gpu_check: --rounds takes a number >= 1, and more than 1 only with a baseline")
    new_env = {"PYTHONPATH": str(layout.site("new")), "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    jobs: list[gpu_jobs.Job] = []
    if args.tests is not None:
        pytest_args = [a.removeprefix("tests/") for a in shlex.split(args.tests)] or ["."]
        jobs.append(gpu_jobs.Job(
            "tests", TESTS_ESTIMATE_S if args.tests.strip() else WHOLE_SUITE_ESTIMATE_S, 1,
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--progress-log={layout.out / 'tests.jsonl'}",
             "--maxfail=30", "-n", str(TEST_WORKERS), *pytest_args],
            cwd=str(ROOT / "tests"), env=new_env | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))
    bench_args = parse_bench_args(args.bench_args)
    unknown = set(bench_args) - set(split_names(args.bench))
    if unknown:
        raise SystemExit(f"gpu_check: --bench-args for {sorted(unknown)}, which --bench does not name")
    seen: dict[str, int] = {}
    for name in split_names(args.bench):
        script = ROOT / "benchmarks" / f"bench_{name}.py"
        if not script.exists():
            raise SystemExit(f"gpu_check: no benchmark {name!r} ({script} does not exist)")
        seen[name] = seen.get(name, 0) + 1
        stem = f"bench_{name}" + (f"_{seen[name]}" if seen[name] > 1 else "")
        if not has_baseline(args):
            runs = [(stem, "new")]
        else:
            runs = [(f"{stem}_{which}{r}", which) for r in range(1, args.rounds + 1) for which in ("base", "new")]
        for job_name, which in runs:
            jobs.append(gpu_jobs.Job(
                job_name, BENCH_ESTIMATE_S, 1,
                [python, str(script), "--out", str(layout.out / f"{job_name}.json"),
                 "--md", str(layout.out / f"{job_name}.md"), *bench_args.get(name, [])],
                # the caller's PYTHONPATH after the install folder (TransformerEngine-JAX's /tmp/te_site, say)
                env=new_env | {"PYTHONPATH": os.pathsep.join(filter(None, [str(layout.site(which)),
                                                                         os.environ.get("PYTHONPATH")]))}))
    if args.multi_gpu:
        jobs.append(gpu_jobs.Job(
            "mesh", MESH_ESTIMATE_S, 2,
            [python, "multidevice/mesh_multidevice.py", "--meshes", "dp2,tp2",
             "--recipes", "delayed,current,delayed_split,current_split", "--check"],
            cwd=str(ROOT / "tests"), env=new_env))
    if args.python_from_checkout and not args.wheel:
        raise SystemExit("gpu_check: --python-from-checkout applies to an installed --wheel (a build already uses "
                         "this checkout)")
    if args.train_per_gpu < 1 or ((args.train_per_gpu > 1 or args.train_args) and not args.train):
        raise SystemExit("gpu_check: --train-per-gpu takes a number >= 1; it and --train-args apply to --train runs")
    graph_modes = split_names([args.graphs]) if args.graphs is not None else [None]
    unknown = sorted(set(graph_modes) - {None, *COMMAND_BUFFER_MODES})
    if unknown or (args.graphs is not None and not args.train):
        raise SystemExit(f"gpu_check: --graphs takes {', '.join(COMMAND_BUFFER_MODES)} (comma-separated) and "
                         f"applies to --train runs; got {args.graphs!r}" + ("" if args.train else " without --train"))
    for run in split_names(args.train):
        recipe, preset, steps, seed = parse_train_run(run)
        for mode in graph_modes:
            job_name = (f"train_{recipe}_{preset}" + (f"_{steps}" if steps else "")
                        + (f"_seed{seed}" if seed is not None else "") + (f"_graphs-{mode}" if mode else ""))
            argv = [python, str(ROOT / "examples" / "gpt" / "train.py"), "--preset", preset, "--recipe", recipe,
                    "--no-progress", "--log-every", "100", "--json", str(layout.out / f"{job_name}.json")]
            argv += (["--steps", str(steps)] if steps else []) + (["--command-buffers", mode] if mode else [])
            argv += ["--seed", str(seed)] if seed is not None else []
            argv += shlex.split(args.train_args)
            # With --graphs, XLA dumps the train step, to show where te_jax's calls went (command_buffer_rows).
            dump_flags = f"--xla_dump_to={layout.dump(job_name)} --xla_dump_hlo_module_re={TRAIN_MODULE}"
            dump = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {dump_flags}".strip()}
            shared = {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / args.train_per_gpu:.3f}"} \
                if args.train_per_gpu > 1 else {}
            jobs.append(gpu_jobs.Job(job_name, train_estimate_s(recipe, preset, steps), 1, argv,
                                     env=new_env | (dump if mode else {}) | shared, share=args.train_per_gpu))
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise SystemExit(f"gpu_check: a job is listed twice: {names}")
    if not jobs:
        raise SystemExit("gpu_check: nothing to run; give --tests, --bench, --train or --multi-gpu")
    apply_estimates(jobs, args.estimate)
    return jobs


def ms_timings(result, label: str = "") -> dict[str, float]:
    """Every ``"ms"`` value in a benchmark's JSON result, keyed by where it sits.

    A list item is named by its "section", "case" and "name" fields when it has them (else its index),
    so the same row of two runs gets the same key.
    """
    found: dict[str, float] = {}
    if isinstance(result, dict):
        for key, value in result.items():
            if key == "ms" and isinstance(value, (int, float)):
                found[label or "ms"] = float(value)
            else:
                found |= ms_timings(value, f"{label} / {key}" if label else key)
    elif isinstance(result, list):
        for i, item in enumerate(result):
            parts = [str(item[k]) for k in ("section", "case", "name") if isinstance(item, dict) and k in item]
            found |= ms_timings(item, " ".join(parts) if parts else f"{label}[{i}]")
    return found


def ratio_rows(out: pathlib.Path, bench_stems: list[str], rounds: int) -> list[dict]:
    """Base/new rows for each benchmark run against a baseline: median ms of each over its rounds."""
    rows = []
    for stem in bench_stems:
        runs = {which: [json.loads(p.read_text()) for r in range(1, rounds + 1)
                        if (p := out / f"{stem}_{which}{r}.json").exists()] for which in ("base", "new")}
        base = [ms_timings(r) for r in runs["base"]]
        new = [ms_timings(r) for r in runs["new"]]
        for key in sorted(set().union(*base, *new)):
            base_ms = [t[key] for t in base if key in t]
            new_ms = [t[key] for t in new if key in t]
            if base_ms and new_ms:
                b, n = statistics.median(base_ms), statistics.median(new_ms)
                rows.append({"benchmark": stem, "timing": key, "base_ms": b, "new_ms": n, "base/new": b / n})
    return rows


def command_buffer_rows(layout: Layout, jobs: list[gpu_jobs.Job]) -> list[dict]:
    """Per --graphs training job: te_jax's calls in its train step and the custom calls XLA put inside and
    outside command buffers (tools/xla_dump.py)."""
    rows = []
    for job in jobs:
        if "_graphs-" in job.name and layout.dump(job.name).exists():
            rows += [{"job": job.name} | record for record in xla_dump.placements(layout.dump(job.name), TRAIN_MODULE)]
    return rows


def machine_info(python: str) -> list[str]:
    """Markdown lines naming the GPUs, driver, jax and Python."""
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    jax = subprocess.run([python, "-c", "import jax, sys; print('jax', jax.__version__, '| python', "
                          "sys.version.split()[0])"], capture_output=True, text=True, cwd="/tmp").stdout.strip()
    return [f"- GPU {line}" for line in gpus.splitlines()] + [f"- {jax}"]


def clock_summary(csv: pathlib.Path) -> list[str]:
    """One line per GPU: SM clock min/median/max, power and temperature maxima over the run."""
    by_gpu: dict[str, list[tuple[float, float, float]]] = {}
    for line in csv.read_text().splitlines() if csv.exists() else []:
        fields = [x.strip() for x in line.split(",")]
        try:
            by_gpu.setdefault(fields[1], []).append((float(fields[2]), float(fields[3]), float(fields[4])))
        except (IndexError, ValueError):
            continue
    lines = []
    for gpu, samples in sorted(by_gpu.items()):
        clock, power, temp = zip(*samples)
        lines.append(f"- GPU {gpu}, {len(samples)} samples: SM clock {min(clock):.0f}/{statistics.median(clock):.0f}/"
                     f"{max(clock):.0f} MHz (min/median/max), power max {max(power):.0f} W, "
                     f"temperature max {max(temp):.0f} C")
    return lines


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = build_parser().parse_args(argv)
    python = sys.executable
    layout = Layout(args.out.resolve(), pathlib.Path(tempfile.gettempdir()) / "te_jax_gpu_check")
    jobs = make_jobs(args, layout, python)
    if args.dry_run:
        print(f"build: {'use ' + str(args.wheel) if args.wheel else 'pip wheel ' + ' '.join(BUILD_FLAGS)}"
              + ("" if args.wheel else f", CUTLASS from {cutlass_source(args) or 'the build Python'}"))
        print(f"install: new -> {layout.site('new')}"
              + (f", base {args.baseline_wheel} -> {layout.site('base')}" if args.baseline_wheel else "")
              + (f"; with {', '.join(map(str, args.extra_wheel))}" if args.extra_wheel else ""))
        for job in jobs:
            shared = f" (shared by up to {job.share} jobs)" if job.share > 1 else ""
            print(f"job {job.name}: {job.gpus_needed} GPU{shared}, ~{job.estimate_s:.0f} s, in {job.cwd}, "
                  f"{' '.join(f'{k}={v}' for k, v in job.env.items())} {shlex.join(job.argv)}")
        return 0

    if shutil.which("nvidia-smi") is None:
        raise SystemExit("gpu_check: nvidia-smi not found; run this on a GPU machine (--dry-run shows the jobs)")
    shutil.rmtree(layout.work, ignore_errors=True)
    layout.logs.mkdir(parents=True)
    layout.out.mkdir(parents=True, exist_ok=True)
    (layout.out / "jobs.log").unlink(missing_ok=True)  # results of an earlier check in the same folder
    build_log = layout.logs / "build.log"
    wheel = args.wheel.resolve() if args.wheel else None
    if wheel is None:
        wheel_dir = layout.work / "wheel"
        flags = BUILD_FLAGS + cutlass_build_flags(cutlass_source(args), layout.work, python)
        step("build the CUDA wheel", [python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v",
                                      "-w", str(wheel_dir), str(ROOT), *flags], build_log)
        (wheel,) = wheel_dir.glob("te_jax-*.whl")
        shutil.copy(wheel, layout.out / wheel.name)
    install(wheel, layout.site("new"), build_log, python)
    install_extras(args.extra_wheel, layout.site("new"), build_log, python)
    if args.python_from_checkout:
        print(f"gpu_check: {overlay_python(layout.site('new'))} Python files of te_jax/ from the checkout over "
              f"{wheel.name}", flush=True)
    if args.baseline_wheel:
        install(args.baseline_wheel.resolve(), layout.site("base"), build_log, python)
    elif args.baseline_python:
        install(wheel, layout.site("base"), build_log, python)
    if has_baseline(args):
        install_extras(args.extra_wheel, layout.site("base"), build_log, python)
        print(f"gpu_check: baseline {wheel.name} with {overlay_python(layout.site('base'), args.baseline_python)} "
              f"Python files from {args.baseline_python}", flush=True)

    header = machine_info(python) + [f"- wheel {wheel.name}"
                                     + (", te_jax/*.py from the checkout" if args.python_from_checkout else "")]
    if args.baseline_wheel:
        header.append(f"- baseline wheel {args.baseline_wheel.name}, {args.rounds} round(s)")
    elif args.baseline_python:
        header.append(f"- baseline: the same wheel with te_jax/*.py from {args.baseline_python}, {args.rounds} round(s)")
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                          text=True, check=True).stdout.splitlines()
    gpus = [g.strip() for g in gpus if g.strip()]
    # SM clock, power and temperature every 2 s while the jobs run (a power-capped GPU slows as it heats).
    clocks_csv = layout.logs / "gpu_clocks.csv"
    with clocks_csv.open("w") as f:
        clocks = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu",
                                   "--format=csv,noheader,nounits", "-lms", "2000"], stdout=f,
                                  stderr=subprocess.STDOUT)
    deadline = start + args.deadline - gpu_jobs.GRACE_S
    try:
        failures = gpu_jobs.run(jobs, gpus, deadline, layout.out / "jobs.log", layout.logs)
    finally:
        clocks.terminate()
        clocks.wait()

    mesh_log = layout.logs / "mesh.log"
    if mesh_log.exists():  # the mesh check prints one JSON line per case
        (layout.out / "multi_gpu.log").write_text(
            "".join(line + "\n" for line in mesh_log.read_text().splitlines() if line.startswith("{")))
    extra = {"clocks": (None, clock_summary(clocks_csv))}
    if args.graphs is not None:
        rows = command_buffer_rows(layout, jobs)
        extra["command buffers"] = (rows, gpu_summary.table(
            rows, ["job", "te_jax_calls", "custom_calls_inside", "custom_calls_outside", "source"]))
    if has_baseline(args):
        stems = sorted({job.name.rsplit("_", 1)[0] for job in jobs if job.name.startswith("bench_")})
        rows = ratio_rows(layout.out, stems, args.rounds)
        extra["base/new"] = (rows, gpu_summary.table(rows, ["benchmark", "timing", "base_ms", "new_ms", "base/new"]))
    print(gpu_summary.summarize(layout.out, header, extra))
    for path in [*layout.out.glob("bench_*.json"), *layout.out.glob("bench_*.md"), *layout.out.glob("train_*.json")]:
        shutil.move(path, layout.logs / path.name)
    for name in ("tests.jsonl", "multi_gpu.log"):
        if (layout.out / name).exists():
            shutil.move(layout.out / name, layout.logs / name)
    with tarfile.open(layout.out / "logs.tgz", "w:gz") as tar:
        tar.add(layout.logs, arcname="logs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
