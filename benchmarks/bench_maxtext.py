"""MaxText's own train step at a ~1B dense config: tokens/s of bf16, MaxText's ``fp8`` and te_jax's recipes.

One process builds MaxText's train state and jitted train step for every
quantization (MaxText's ``train_utils.setup_train_loop`` and
``jit_train_and_eval_step`` with its ``train.train_step``, exactly as its
``train_loop`` does; te_jax's names through ``te_jax.maxtext.register()``),
compiles and warms each up, then times them in turns: each round runs every
variant, in a freshly shuffled (seeded) order, for ``--steps-per-round``
steps, each step waited for (``block_until_ready``). The figure is the median
step time over all timed steps; tokens/s = global batch tokens / median. The
same fixed synthetic batch feeds every step (MaxText's ``dataset_type=synthetic``);
MaxText's learning-rate schedule spans the steps each variant runs. Memory:
XLA's analysis of each variant's compiled step (``step peak``: arguments +
temporaries + outputs - the donated state; the variant's own figure even
with others resident), the train state's size, and the device's peak over
the whole run.

The default model is MaxText's ``base.yml`` decoder (llama2-style: 16 layers,
emb 2048, 16 heads x 128, MLP 7168, vocab 32000: about 1.1B parameters) at
sequence 2048 and 8 sequences per step, cuDNN flash attention through JAX
(``attention=cudnn_flash_jax``; no TransformerEngine needed). Every variant's
train state lives on the GPU at once (about 13 GiB each in float32 with Adam):
five do not fit an H100's 80 GB, so pass ``--sequential`` there (one variant
after another, each freed); an H200 holds them.

On one GPU (H100/H200), from the repository root, with MaxText installed
(docs/integrations.md, "MaxText": the wheels to carry to a machine without
network)::

    python3 benchmarks/bench_maxtext.py --out $OUT/maxtext.json --md $OUT/maxtext.md

``--tiny`` runs a small model on the CPU (a check of the script, not a timing).
``--set key=value`` passes any MaxText override (``--set remat_policy=minimal``).

MaxText on a machine without network: ``--pack FILE.tar.xz`` (here, in an
environment where MaxText runs, e.g. .venv312) writes the installed files of
the distributions the GPU image lacks (``CARRY``: MaxText and what its train
step imports, less what the image has), without MaxText's tokenizer assets,
xprof's profiler plugin library and web files (neither is loaded by training)
and without bytecode: about 21 MB. There, ``--maxtext-site FILE.tar.xz``
unpacks it next to ``--workdir`` and puts it at the end of ``sys.path``::

    .venv312/bin/python benchmarks/bench_maxtext.py --pack .maxtext_carry/maxtext_carry.tar.xz
    # on the GPU machine (carry .maxtext_carry, git-ignored):
    python3 tools/gpu_check.py --bench maxtext --estimate bench_maxtext=500 --out $OUT \
        --bench-args maxtext="--maxtext-site .maxtext_carry/maxtext_carry.tar.xz --sequential"
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from timing import write_results

# What MaxText 0.2.5's train step imports and the GPU image (docs: the device's KINDS.md) does not hold: the
# distributions of the modules loaded by a CPU training run (dense, MoE; bf16, fp8, te_jax), less the image's.
CARRY = ("maxtext", "aqtp", "array_record", "cffi", "cryptography", "drjax", "einshape", "fastapi", "fire",
         "google-api-core", "google-auth", "google-cloud-core", "google-cloud-storage", "google-cloud-storage-control",
         "google-crc32c", "google-resumable-media", "googleapis-common-protos", "grain", "grpc-google-iam-v1",
         "grpcio-status", "httpcore2", "httpx2", "immutabledict", "ml_collections", "omegaconf", "opentelemetry-api",
         "pathwaysutils", "portpicker", "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "qwix",
         "starlette", "tensorboardX", "tokamax", "truststore", "uvicorn", "xprof", "pycparser", "pyasn1",
         "pyasn1_modules", "proto-plus", "termcolor")
PACK_SKIP = ("__pycache__/", ".pyc", "maxtext/assets/", "xprof/convert/profiler_plugin_c_api.so", "xprof/static/")
GIB = 2**30
QUANTIZATIONS = ("bf16", "fp8", "te_jax_current", "te_jax_delayed", "te_jax_block")
ONE_B = dict(base_emb_dim=2048, base_num_query_heads=16, base_num_kv_heads=16, head_dim=128, base_mlp_dim=7168,
             base_num_decoder_layers=16, vocab_size=32000, max_target_length=2048, per_device_batch_size=8,
             attention="cudnn_flash_jax", hardware="gpu")
TINY = dict(base_emb_dim=128, base_num_query_heads=4, base_num_kv_heads=4, head_dim=32, base_mlp_dim=256,
            base_num_decoder_layers=2, vocab_size=256, max_target_length=64, per_device_batch_size=4,
            attention="dot_product", hardware="cpu")


def _argv(name: str, quantization: str, out_dir: str, model: dict, overrides: dict) -> list:
    import maxtext  # pylint: disable=import-outside-toplevel

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    settings = dict(run_name=name, base_output_directory=out_dir, skip_jax_distributed_system=True,
                    dataset_type="synthetic", enable_checkpointing=False, enable_tensorboard=False,
                    enable_goodput_recording=False, monitor_goodput=False, jax_cache_dir="", steps=1_000_000,
                    log_period=1_000_000, quantization="" if quantization == "bf16" else quantization)
    settings.update(model)
    settings.update(overrides)
    return [None, base] + [f"{k}={v}" for k, v in settings.items()]


class Variant:
    """One quantization's MaxText train state, jitted train step and batch (built as ``train_loop`` builds them)."""

    def __init__(self, quantization: str, out_dir: str, model: dict, overrides: dict):
        import jax  # pylint: disable=import-outside-toplevel
        from flax import nnx  # pylint: disable=import-outside-toplevel
        from flax.core.spmd import logical_axis_rules  # pylint: disable=import-outside-toplevel
        from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
        from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel
        from maxtext.utils import sharding, train_utils  # pylint: disable=import-outside-toplevel

        self.name = quantization
        self.config = pyconfig.initialize(_argv(f"bench_{quantization}", quantization, out_dir, model, overrides))
        train_utils.validate_train_config(self.config)
        (_, _, state_mesh_shardings, _, self.mesh, _, _, data_loader, rampup_manager, eval_iterator,
         state) = train_utils.setup_train_loop(self.config, None)
        graphdef, self.state = nnx.split(state)
        params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
            self.config, state_mesh_shardings)
        self.step_fn, _ = train_utils.jit_train_and_eval_step(
            self.config, graphdef, self.mesh, self.state, state_mesh_shardings, train.train_step, train.eval_step,
            eval_iterator, params_shardings)
        self._rules = logical_axis_rules  # a context manager that is entered once: made anew per use (context())
        self.batch = data_loader.load_next_batch(rampup_manager=rampup_manager)
        self.tokens = int(self.config.global_batch_size_to_train_on) * int(self.config.max_target_length)
        self.losses: list[float] = []
        self.times: list[float] = []
        self.memory_gib: dict = {}
        self._jax = jax

    def context(self):
        """The mesh and logical axis rules MaxText's ``train_loop`` runs its steps under."""
        import contextlib  # pylint: disable=import-outside-toplevel

        stack = contextlib.ExitStack()
        stack.enter_context(self._jax.set_mesh(self.mesh))
        stack.enter_context(self._rules(self.config.logical_axis_rules))
        return stack

    def run(self, steps: int, record: bool) -> None:
        """``steps`` train steps, each waited for; their times (and losses) kept when ``record``."""
        jax = self._jax
        with self.context():
            for _ in range(steps):
                start = time.perf_counter()
                self.state, metrics = self.step_fn(self.state, self.batch)
                jax.block_until_ready(self.state)
                elapsed = time.perf_counter() - start
                if record:
                    self.times.append(elapsed)
                    self.losses.append(float(metrics["scalar"]["learning/loss"]))

    def memory(self) -> dict:
        """XLA's memory analysis of the compiled train step (cached: the step already ran) and the state's size, GiB.

        ``step_peak_gib`` = arguments + temporaries + outputs - aliased (the donated state): what one step
        needs on the device, this variant's own figure even when several variants share the device.
        """
        jax = self._jax
        with self.context():
            analysis = self.step_fn.lower(self.state, self.batch).compile().memory_analysis()
        state = sum(x.nbytes for x in jax.tree.leaves(self.state) if hasattr(x, "nbytes")) / GIB
        if analysis is None:  # a backend without the analysis
            return dict(state_gib=state)
        temp, args = analysis.temp_size_in_bytes / GIB, analysis.argument_size_in_bytes / GIB
        out, alias = analysis.output_size_in_bytes / GIB, analysis.alias_size_in_bytes / GIB
        return dict(state_gib=state, temp_gib=temp, step_peak_gib=args + temp + out - alias)

    def summary(self) -> dict:
        median = statistics.median(self.times)
        return dict(quantization=self.name, median_step_s=median, tokens_per_s=self.tokens / median,
                    steps_timed=len(self.times), tokens_per_step=self.tokens,
                    min_step_s=min(self.times), max_step_s=max(self.times),
                    last_loss=self.losses[-1] if self.losses else None, **self.memory_gib)

    def free(self) -> None:
        self.state = self.step_fn = self.batch = None


def pack(path: str) -> None:
    """Writes the installed files of ``CARRY`` (less ``PACK_SKIP``) as ``path`` (.tar.xz), relative to site-packages."""
    import importlib.metadata as md  # pylint: disable=import-outside-toplevel
    import pathlib  # pylint: disable=import-outside-toplevel
    import tarfile  # pylint: disable=import-outside-toplevel

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    count = 0
    with tarfile.open(path, "w:xz", preset=9) as tar:
        for name in CARRY:
            dist = md.distribution(name)
            site = pathlib.Path(dist.locate_file(""))
            for file in dist.files or ():
                rel = str(file)
                if rel.startswith("..") or any(skip in rel for skip in PACK_SKIP) or not (site / rel).is_file():
                    continue
                tar.add(site / rel, arcname=rel)
                count += 1
            print(f"pack: {name} {dist.version}", flush=True)
    print(f"pack: {count} files, {os.path.getsize(path) / 2**20:.1f} MiB -> {path}")


def add_site(archive_or_dir: str, workdir: str) -> None:
    """Puts a ``--pack`` archive (unpacked under ``workdir``) or a folder at the end of ``sys.path``."""
    import tarfile  # pylint: disable=import-outside-toplevel

    site = archive_or_dir
    if os.path.isfile(archive_or_dir):
        site = os.path.join(workdir, "maxtext_site")
        os.makedirs(site, exist_ok=True)
        with tarfile.open(archive_or_dir) as tar:
            tar.extractall(site, filter="data")
    sys.path.append(os.path.abspath(site))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quantizations", default=",".join(QUANTIZATIONS),
                        help="comma-separated: bf16, MaxText's names (fp8, ...) and te_jax_<recipe>")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant after compiling")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--sequential", action="store_true", help="one variant after another (frees each)")
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU: checks the script")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a MaxText override")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON results")
    parser.add_argument("--md", help="markdown table")
    parser.add_argument("--workdir", default="/tmp/bench_maxtext")
    parser.add_argument("--pack", metavar="FILE.tar.xz", help="write the carry archive and exit (module docstring)")
    parser.add_argument("--maxtext-site", metavar="FILE.tar.xz|DIR", help="MaxText from a --pack archive or folder")
    args = parser.parse_args(argv)
    if args.pack:
        pack(args.pack)
        return 0
    if args.maxtext_site:
        add_site(args.maxtext_site, args.workdir)

    import jax  # pylint: disable=import-outside-toplevel
    import te_jax.maxtext  # pylint: disable=import-outside-toplevel

    te_jax.maxtext.register()
    model = TINY if args.tiny else ONE_B
    overrides = dict(item.split("=", 1) for item in args.set)
    # MaxText's learning-rate schedule spans `steps` (warm-up: its first tenth); these are the steps each variant runs.
    overrides.setdefault("steps", str(1 + args.warmup + args.rounds * args.steps_per_round))
    names = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    rng = random.Random(args.seed)
    print(f"devices: {jax.devices()}; jax {jax.__version__}", flush=True)

    variants: list[Variant] = []
    results = []
    for name in names:
        start = time.perf_counter()
        variant = Variant(name, args.workdir, model, overrides)
        variant.run(1 + args.warmup, record=False)  # the first step compiles
        variant.memory_gib = variant.memory()
        print(f"{name}: built, compiled and warmed up in {time.perf_counter() - start:.0f} s", flush=True)
        if args.sequential:
            variant.run(args.rounds * args.steps_per_round, record=True)
            results.append(variant.summary())
            print(f"{name}: {results[-1]}", flush=True)  # what a run cut short keeps
            variant.free()
            jax.clear_caches()
        else:
            variants.append(variant)
    for _ in range(args.rounds if not args.sequential else 0):
        for variant in rng.sample(variants, len(variants)):
            variant.run(args.steps_per_round, record=True)
    results += [v.summary() for v in variants]

    base = next((r for r in results if r["quantization"] == "bf16"), None)
    lines = ["| quantization | tokens/s | median step (ms) | vs bf16 | step peak (GiB) | state (GiB) | last loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        lines.append(f"| {r['quantization']} | {r['tokens_per_s']:.0f} | {1e3 * r['median_step_s']:.1f} | "
                     f"{ratio:.3f} | {r.get('step_peak_gib', float('nan')):.2f} | {r['state_gib']:.2f} | "
                     f"{r['last_loss']:.4f} |")
    device_peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    table = "\n".join(lines)
    if device_peak is not None:
        table += f"\n\nDevice peak over the whole run (all variants): {device_peak / GIB:.2f} GiB."
    print(table, flush=True)
    meta = dict(devices=[str(d) for d in jax.devices()], jax=jax.__version__, model=model, overrides=overrides,
                rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=args.warmup,
                sequential=args.sequential, command=" ".join(sys.argv),
                device_peak_gib=None if device_peak is None else device_peak / GIB)
    write_results(args.out, args.md, dict(meta=meta, results=results), table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
