"""Train the byte-level GPT with any te_jax recipe.

    .venv/bin/python examples/gpt/train.py --preset tiny --recipe current
    .venv/bin/python examples/gpt/train.py --preset tiny --recipe bf16,delayed,current --plot curves.png
    .venv/bin/python examples/gpt/train.py --preset 125m --recipe mxfp8 --ckpt-dir /tmp/ckpt   # ... --resume
    .venv/bin/python examples/gpt/train.py --recipe recipes/mixed_per_layer.py --data my_text.txt
    .venv/bin/python examples/gpt/train.py --preset tiny --recipe mxfp8,nvfp4 --inspect stats/   # statistics

(``.venv`` is the environment ``tools/demo.sh`` and ``tools/run_tests.sh`` make.)
``--recipe`` takes bf16 (no quantization), flax-fp8 (the same model through
flax.linen's Fp8DotGeneral, the baseline), any name or path
``te_jax.recipe.load_recipe`` takes (delayed, current, block, mxfp8, nvfp4, a
class name such as DelayedScaling, a recipes/ gallery name, a recipes/*.py
path), or a comma-separated list of those (trained one after the other, then
compared in a table and, with ``--plot``, a loss-curve PNG). A recipe that
quantizes no layer of the model is reported with a warning. The table's train
loss is the mean over the last 10% of the steps; its eval loss, the last
evaluation's.

A bad flag (an unknown recipe, a mesh the batch or the model cannot be split
over, a missing checkpoint, a number out of range) ends with a usage message
and exit status 2 before anything is compiled.

The FP8 parts of the train step are three lines (see ``steps.make_train_step``):
the model is initialized and applied inside ``te_jax.autocast``, gradients
come from ``te_jax.train.value_and_grad`` over the whole variables dict, and
``te_jax.train.TrainState`` gives the optimizer (AdamW, warmup + cosine
decay, gradient clipping) the parameters only; the fp8_meta state is
replaced by its update, never clipped or decayed.

``--command-buffers`` picks which work XLA records into CUDA graphs (its
command buffers) on a GPU: ``xla`` (the default) leaves XLA's own choice,
which in jax 0.10/0.11 includes custom calls, so te_jax's calls run inside
the graphs with the fusions around them; ``no-custom-calls`` keeps every
custom call out (te_jax's calls run between the graphs, as XLA runs handlers
without the command-buffer trait); ``off`` records no graphs. It adds
``--xla_gpu_enable_command_buffer=...`` to this process's ``XLA_FLAGS``
before jax starts (docs/gemm_ffi.md, "CUDA graphs").

``--inspect [DIR]`` collects te_jax.inspect's per-layer quantization
statistics at every evaluation (a second compiled step with
``autocast(..., inspect=True)``; the other steps run the plain one), writes
them to ``DIR/<recipe>.jsonl`` (and TensorBoard with ``--tensorboard``), and
at the end a report ``DIR/<recipe>_report.png`` (``DIR/report.png`` comparing
the recipes when there are several) and the measured cost of inspection per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples.gpt` importable
    # appended, not prepended: an installed te_jax (with its compiled modules) wins over the source tree
    sys.path.append(str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from examples.gpt import data as data_lib
from examples.gpt import parallel, report
from examples.gpt.checkpoint import (_ckpt_manager, _ckpt_meta, check_resume, find_checkpoint, restore_checkpoint,
                                     save_checkpoint, saved_history)
from examples.gpt.config import NO_RECIPE, REMAT_CHOICES, RunConfig, make_recipe, recipe_label
from examples.gpt.inspection import StatsLog, inspect_overhead, write_report
from examples.gpt.memory import StepTooLarge, check_fits, memory_errors, memory_figures, step_description
from examples.gpt.model import GPT, count_params
from examples.gpt.presets import PRESETS
from examples.gpt.steps import autocast_for, make_eval_step, make_optimizer, make_train_step
from te_jax import inspect as te_inspect
from te_jax import recipe as R
from te_jax.train import TrainState

# --command-buffers: the XLA flag each choice adds ("-" removes a type from XLA's default list).
COMMAND_BUFFER_FLAGS = {
    "xla": "",
    "no-custom-calls": "--xla_gpu_enable_command_buffer=-CUSTOM_CALL",
    "off": "--xla_gpu_enable_command_buffer=",
}
TRAIN_LOSS_TAIL = 0.1  # the reported train loss: the mean over this last fraction of the steps
TRAIN_LOSS_LABEL = f"train loss (mean of last {TRAIN_LOSS_TAIL:.0%})"


# ---- the layers a recipe quantizes --------------------------------------------------------------


def quantized_layers(model: GPT, recipe: R.CustomRecipe, tokens: jax.Array) -> list[tuple[str, ...]]:
    """The module paths of the layers that ``recipe`` quantizes at least one tensor of.

    Found by tracing ``model.init`` (shapes only, nothing is compiled) under a
    recipe that records the paths of the roles ``recipe`` returns a quantizer for.
    """
    paths = set()

    def recording(role: R.Role):
        quantizer = recipe.qfactory(role)
        if quantizer is not None:
            paths.add(role.path)
        return quantizer

    key = jax.random.key(0)
    with te_jax.autocast(recipe=R.CustomRecipe(qfactory=recording)):
        jax.eval_shape(model.init, {"params": key, "quantize": key}, tokens)
    return sorted(paths)


def warn_if_unquantized(cfg: RunConfig, model: GPT, recipe: R.Recipe | None, tokens: jax.Array) -> None:
    """Prints a warning when ``recipe``, a CustomRecipe, quantizes no layer of ``model`` (built-ins quantize all)."""
    if isinstance(recipe, R.CustomRecipe) and not quantized_layers(model, recipe, tokens):
        print(f"warning: --recipe {cfg.recipe} quantizes no layer of the {model.config.layers}-block {cfg.preset} "
              f"model: its qfactory returned None for every tensor, so every GEMM runs in {cfg.dtype}, as with "
              "--recipe bf16", file=sys.stderr)


# ---- one run -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What a training run is built from: the model, its recipe and mesh, the sharded state and the steps.

    ``inspect_step`` (None unless ``cfg.inspect`` and a recipe) is the train
    step that also returns the quantization statistics; ``jit_step(inspect)``
    compiles the train step with another ``inspect`` setting.
    """

    cfg: RunConfig
    label: str
    model: GPT
    recipe: R.Recipe | None
    mesh: jax.sharding.Mesh
    batch_sharding: NamedSharding
    shardings: Any
    state: TrainState
    train_step: Callable
    inspect_step: Callable | None
    eval_step: Callable
    jit_step: Callable[[bool | te_inspect.Sample], Callable]


def gpt_model(cfg: RunConfig) -> GPT:
    """The GPT of ``cfg``, with logical axes when its mesh shards tensors or experts."""
    shape = parallel.parse_mesh(cfg.mesh)
    return GPT(dataclasses.replace(cfg.model_config(), logical_axes=shape["tp"] > 1 or shape["ep"] > 1))


def build_run(cfg: RunConfig) -> Run:
    """The model, its sharded initial state and the jitted steps of ``cfg`` (resolved)."""
    shape = cfg.check()
    label = recipe_label(cfg.recipe)
    recipe = make_recipe(cfg.recipe, cfg.model_config().layers)
    sample = te_inspect.Sample(cfg.inspect_every)  # used only with cfg.inspect
    mesh = parallel.make_mesh(shape)
    mesh_resource = parallel.mesh_resource(shape)
    batch_sharding = NamedSharding(mesh, P(parallel.BATCH))
    model = gpt_model(cfg)
    init_key, quant_key = jax.random.split(jax.random.key(cfg.seed))
    dummy = jnp.zeros((cfg.batch, cfg.seq_len), jnp.int32)
    warn_if_unquantized(cfg, model, recipe, dummy)
    inspecting = bool(cfg.inspect) and recipe is not None
    with autocast_for(recipe, mesh_resource, inspecting, mesh):  # creates fp8_meta (stateful recipes), fp8_stats
        variables = jax.jit(model.init)({"params": init_key, "quantize": quant_key}, dummy)
    variables, specs = parallel.param_specs(dict(variables), shape)
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=make_optimizer(cfg))
    state = state.replace(step=jnp.asarray(0, jnp.int32))
    shardings = parallel.state_shardings(state, specs, mesh)
    state = jax.device_put(state, shardings)

    def jit_step(inspect: bool | te_inspect.Sample):
        return jax.jit(make_train_step(model, recipe, mesh_resource, quant_key, inspect=inspect, mesh=mesh),
                       in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None), donate_argnums=0)

    return Run(cfg=cfg, label=label, model=model, recipe=recipe, mesh=mesh, batch_sharding=batch_sharding,
               shardings=shardings, state=state, train_step=jit_step(False),
               inspect_step=jit_step(sample) if inspecting else None,
               eval_step=jax.jit(make_eval_step(model, recipe, mesh_resource, mesh)), jit_step=jit_step)


def train(cfg: RunConfig, corpus: data_lib.Corpus | None = None, *, return_state: bool = False) -> dict:
    """Trains one recipe; returns its history and final figures (and the TrainState when asked)."""
    cfg = cfg.resolved()
    corpus = corpus or data_lib.load(cfg.data, cfg.data_bytes)  # first: a bad --data fails before compiling
    run = build_run(cfg)
    label, state, train_step, inspect_step, eval_step = (run.label, run.state, run.train_step, run.inspect_step,
                                                          run.eval_step)
    batch_sharding, shardings = run.batch_sharding, run.shardings
    evals = [jax.device_put(b, batch_sharding)
             for b in data_lib.eval_batches(corpus, cfg.eval_batches, cfg.batch, cfg.seq_len)]
    inspecting = inspect_step is not None
    # Compiled now and checked against the memory it runs in, before anything is written.
    first = jax.device_put(data_lib.train_batch(corpus, 0, cfg.batch, cfg.seq_len, cfg.seed), batch_sharding)
    train_step = train_step.lower(state, first).compile()
    check_fits(train_step, step_description(cfg))

    meta = _ckpt_meta(cfg)
    manager = _ckpt_manager(cfg) if cfg.resume else None  # else made at the first save: no empty folder is left
    earlier = {}  # the resumed run's history up to its checkpoint, so the figures cover every step
    if cfg.resume:
        step = find_checkpoint(manager, cfg.resume, meta)
        state = restore_checkpoint(manager, state, step)
        earlier = saved_history(manager, step)
        print(f"{label}: resumed at step {step} from {Path(manager.directory) / str(step)}")
    start = int(state.step)
    stats_log = StatsLog(cfg.inspect, label, cfg.tensorboard) if inspecting else None

    def evaluate(params):
        return float(np.mean([float(eval_step(params, b)) for b in evals]))

    n_params = count_params(state.params["params"])
    tokens_per_step = cfg.batch * cfg.seq_len
    writer = report.make_writer(cfg.tensorboard, label) if cfg.tensorboard else None
    bar = report.Progress(range(start, cfg.steps), enabled=cfg.progress, desc=f"{label:>8}", total=cfg.steps,
                          initial=start)
    # window_tokens_per_s: the tokens/s of each stretch between log points (compile and evaluation excluded)
    hist = {"step": [], "loss": [], "eval_step": [], "eval_loss": [], "window_step": [], "window_tokens_per_s": []}
    hist.update({k: list(v) for k, v in earlier.items() if k in ("step", "loss", "eval_step", "eval_loss")})
    if inspect_step is not None:  # compiled now, so its first use at an evaluation step is not timed as training
        example = jax.device_put(data_lib.train_batch(corpus, start, cfg.batch, cfg.seq_len, cfg.seed), batch_sharding)
        inspect_step = inspect_step.lower(state, example).compile()
    pending, train_time, timed_steps, t0, timed_from = [], 0.0, 0, None, start
    for step in bar:
        tokens = jax.device_put(data_lib.train_batch(corpus, step, cfg.batch, cfg.seq_len, cfg.seed),
                                batch_sharding)
        done = step + 1
        eval_due = done == cfg.steps or (cfg.eval_every and done % cfg.eval_every == 0)
        state, metrics = (inspect_step if inspecting and eval_due else train_step)(state, tokens)
        pending.append((done, metrics))
        if t0 is None:  # the first step compiles: time from its end
            jax.block_until_ready(metrics)
            t0, timed_from = time.perf_counter(), done
        last = done == cfg.steps
        do_eval = last or (cfg.eval_every and done % cfg.eval_every == 0)
        do_save = bool(cfg.ckpt_dir) and (last or (cfg.ckpt_every and done % cfg.ckpt_every == 0))
        if not (last or do_eval or do_save or done % cfg.log_every == 0):
            continue
        # A log point: wait for the steps so far, then evaluate / save outside the timed region.
        for s, m in jax.device_get(pending):
            hist["step"].append(s)
            hist["loss"].append(float(m["loss"]))
            if stats_log and te_inspect.STATS_COLLECTION in m:
                stats_log.write(m[te_inspect.STATS_COLLECTION], s)
            if writer:
                writer.scalar("train/loss", float(m["loss"]), s)
                writer.scalar("train/grad_norm", float(m["grad_norm"]), s)
        pending = []
        window_s = time.perf_counter() - t0
        train_time += window_s
        window_steps = done - max(timed_from, hist["window_step"][-1] if hist["window_step"] else timed_from)
        if window_steps > 0:
            hist["window_step"].append(done)
            hist["window_tokens_per_s"].append(window_steps * tokens_per_step / window_s)
        timed_steps = done - timed_from
        tps = timed_steps * tokens_per_step / train_time if timed_steps else float("nan")
        if do_eval:
            hist["eval_step"].append(done)
            hist["eval_loss"].append(evaluate(state.params))
        if writer:
            writer.scalar("train/tokens_per_s", tps, done)
            if do_eval:
                writer.scalar("eval/loss", hist["eval_loss"][-1], done)
        postfix = {"loss": f"{hist['loss'][-1]:.3f}", "tok/s": f"{tps:,.0f}"}
        if hist["eval_loss"]:
            postfix["eval"] = f"{hist['eval_loss'][-1]:.3f}"
        bar.set_postfix(postfix)
        if do_save:
            manager = manager or _ckpt_manager(cfg)
            save_checkpoint(manager, state, meta | {"history": hist})
        t0 = time.perf_counter()
    bar.close()
    if manager:
        manager.wait_until_finished()
        manager.close()
    if writer:
        writer.close()
    inspection = None
    if stats_log:
        stats_log.close()
        step_ms = inspect_overhead(train_step, inspect_step, state, shardings, tokens)
        inspection = {"rows": stats_log.last, "jsonl": str(stats_log.jsonl.path), **step_ms,
                      "report": stats_log.report()}
        print(f"{label}: inspection costs {step_ms['overhead']:+.1%} per step ({step_ms['step_ms']:.1f} ms -> "
              f"{step_ms['inspect_step_ms']:.1f} ms, {jax.default_backend()}); statistics: {inspection['jsonl']}"
              + (f", report: {inspection['report']}" if inspection["report"] else ""))
    tail = hist["loss"][-max(1, round(len(hist["loss"]) * TRAIN_LOSS_TAIL)):]
    result = {
        "recipe": label,
        "preset": cfg.preset,
        "params": n_params,
        "steps": cfg.steps,
        "tokens_per_step": tokens_per_step,
        "backend": jax.default_backend(),
        "final_train_loss": float(np.mean(tail)) if tail else float("nan"),
        "final_eval_loss": hist["eval_loss"][-1] if hist["eval_loss"] else float("nan"),
        "tokens_per_s": timed_steps * tokens_per_step / train_time if timed_steps else float("nan"),
        "remat": cfg.remat,
        "recompute_norm_act": cfg.recompute_norm_act,
        **memory_figures(train_step),
        "history": hist,
    }
    if inspection:
        result["inspect"] = inspection
    if return_state:
        result["state"] = state
    return result


# ---- command line -------------------------------------------------------------------------------


def use_command_buffers(mode: str) -> None:
    """Adds the XLA flag of ``--command-buffers mode`` to this process's ``XLA_FLAGS``.

    Raises:
      ValueError: jax has started a backend already, so XLA would not read the flag.
    """
    flag = COMMAND_BUFFER_FLAGS[mode]
    if not flag:
        return
    if xla_bridge.backends_are_initialized():
        raise ValueError(f"--command-buffers {mode}: jax has started its backend already; XLA reads XLA_FLAGS "
                         "once, before that")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def format_table(results: list[dict]) -> str:
    """A plain-text table: recipe, train loss (``TRAIN_LOSS_LABEL``), final eval loss, tokens/s (and vs bf16),
    and the device's peak memory where it reports one (else XLA's analysis of the step), in GiB."""
    base = next((r["tokens_per_s"] for r in results if r["recipe"] == "bf16"), None)
    measured = any(r.get("peak_memory_gib") is not None for r in results)
    memory_key, memory_label = ("peak_memory_gib", "peak GiB") if measured else ("step_memory_gib", "step GiB")
    rows = [("recipe", TRAIN_LOSS_LABEL, "eval loss", "tokens/s", "vs bf16", memory_label)]
    for r in results:
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        memory = r.get(memory_key)
        rows.append((r["recipe"], f"{r['final_train_loss']:.4f}", f"{r['final_eval_loss']:.4f}",
                     f"{r['tokens_per_s']:,.0f}", rel, "-" if memory is None else f"{memory:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--recipe", default="bf16",
                   help=f"{', '.join(NO_RECIPE)}, a te_jax.recipe name ({', '.join(R.BUILTIN)}, a class name such "
                        "as DelayedScaling, a recipes/ gallery name), a recipes/*.py path, or a comma-separated "
                        "list (trained in turn, then compared)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch", type=int, help="global batch size (sequences)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup", type=int, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (parameters only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--eval-batches", type=int)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--data", help="train on this text file instead of the Python standard library")
    p.add_argument("--data-bytes", type=int, default=16 << 20, help="read at most this many bytes")
    p.add_argument("--mesh", default="", help="dp=N,fsdp=N,ep=N,tp=N (ep: MoE presets' experts; CPU: fake devices "
                                                "are made to fit)")
    p.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() first")
    p.add_argument("--coordinator", help="with --distributed: the coordinator's host:port (else auto-detected)")
    p.add_argument("--num-processes", type=int, help="with --distributed: how many processes")
    p.add_argument("--process-id", type=int, help="with --distributed: this process's index")
    p.add_argument("--ckpt-dir", help="save orbax checkpoints (fp8_meta included) here")
    p.add_argument("--ckpt-every", type=int, default=0, help="also save every N steps (always at the end)")
    p.add_argument("--resume", nargs="?", const="latest", help="resume from --ckpt-dir (latest, or a step)")
    p.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard logs (needs tensorboardX or tensorflow)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="compute dtype (default bfloat16)")
    p.add_argument("--command-buffers", choices=list(COMMAND_BUFFER_FLAGS), default="xla",
                   help="what XLA records into CUDA graphs on a GPU: xla (its default; te_jax's calls included), "
                        "no-custom-calls (te_jax's calls between the graphs), off (no graphs)")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a tqdm bar")
    p.add_argument("--plot", metavar="PNG", help="write a loss-curve plot comparing the recipes")
    p.add_argument("--json", metavar="FILE", help="write the results (histories included) as JSON")
    p.add_argument("--inspect", nargs="?", const="inspect_out", metavar="DIR",
                   help="collect per-layer quantization statistics at each evaluation (te_jax.inspect); write "
                        "DIR/<recipe>.jsonl and reports (default DIR: inspect_out)")
    p.add_argument("--inspect-every", type=int, default=1, metavar="K",
                   help="statistics over every K-th row of activations and gradients (te_jax.inspect.Sample; "
                        "cheaper, though not K times; default 1: every row)")
    p.add_argument("--remat", choices=REMAT_CHOICES, default="none",
                   help="every block under nn.remat with te_jax.flax's policy that keeps (the rest recomputed): "
                        "fp8 (the FP8 copies), fp8-pre-activation (and the MLP's first GEMM output), nothing, "
                        "offload-fp8 (the FP8 copies, in host memory)")
    p.add_argument("--recompute-norm-act", action="store_true",
                   help="te_jax's layers recompute their norms' and activation's outputs (their FP8 copies) in the "
                        "backward from the tensors it keeps anyway: less memory, no GEMM recomputed")
    return p


def config_from_args(args, recipe: str) -> RunConfig:
    return RunConfig(
        preset=args.preset, recipe=recipe, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
        warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip, seed=args.seed,
        eval_every=args.eval_every, eval_batches=args.eval_batches, log_every=args.log_every, data=args.data,
        data_bytes=args.data_bytes, mesh=args.mesh, ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every,
        resume=args.resume, tensorboard=args.tensorboard, progress=not args.no_progress, dtype=args.dtype,
        inspect=args.inspect, inspect_every=args.inspect_every, remat=args.remat,
        recompute_norm_act=args.recompute_norm_act)


def prepare(args: argparse.Namespace) -> tuple[list[RunConfig], data_lib.Corpus]:
    """Every run's resolved config and the corpus, after checking every flag (before anything compiles).

    Raises:
      ValueError, OSError: a flag's value no run can use; the message names the flag.
    """
    if args.inspect_every != 1 and not args.inspect:
        raise ValueError("--inspect-every needs --inspect")
    if not args.distributed and any(v is not None for v in (args.coordinator, args.num_processes, args.process_id)):
        raise ValueError("--coordinator, --num-processes and --process-id need --distributed")
    use_command_buffers(args.command_buffers)
    recipes = [r.strip() for r in args.recipe.split(",") if r.strip()]
    if not recipes:
        raise ValueError(f"--recipe {args.recipe!r} names no recipe")
    if len(recipes) > 1 and args.ckpt_dir:
        raise ValueError("--ckpt-dir takes one --recipe at a time")
    configs = [config_from_args(args, r).resolved() for r in recipes]
    check_configs(configs)
    parallel.setup_devices(args.mesh, args.distributed, args.coordinator, args.num_processes, args.process_id)
    parallel.make_mesh(parallel.parse_mesh(args.mesh))  # enough devices for the mesh
    corpus = load_corpus(args.data, args.data_bytes, configs[0].seq_len)
    if args.resume:
        check_resume(configs[0])
    return configs, corpus


def check_configs(configs: list[RunConfig]) -> None:
    """Raises ValueError, naming the flag, for settings or a recipe that a run cannot use."""
    for cfg in configs:
        cfg.check()
        make_recipe(cfg.recipe, cfg.model_config().layers)


def load_corpus(data: str | None, data_bytes: int, seq_len: int) -> data_lib.Corpus:
    """``data_lib.load``, raising ValueError naming --data or --seq-len for a file it cannot train on."""
    try:
        corpus = data_lib.load(data, data_bytes)
    except OSError as err:
        raise ValueError(f"--data {data}: {err.strerror or err}") from None
    data_lib.check_seq_len(corpus, seq_len)
    return corpus


def main(argv: list[str] | None = None) -> list[dict]:
    """The command line: trains each --recipe in turn and compares them. A bad flag exits with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configs, corpus = prepare(args)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    preset = PRESETS[args.preset]
    print(f"data: {corpus.describe()}")
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"preset {args.preset}: {preset.model}")
    results = []
    for cfg in configs:
        try:
            with memory_errors(step_description(cfg)):
                result = train(cfg, corpus) | {"command_buffers": args.command_buffers}
        except StepTooLarge as err:
            parser.error(str(err))
        print(f"{result['recipe']}: {result['params'] / 1e6:.2f}M params, final train loss "
              f"{result['final_train_loss']:.4f}, eval loss {result['final_eval_loss']:.4f}, "
              f"{result['tokens_per_s']:,.0f} tokens/s (train loss: the mean of the last "
              f"{TRAIN_LOSS_TAIL:.0%} of the steps)")
        results.append(result)
    print()
    print(format_table(results))
    if args.plot:
        path = report.plot_curves(results, args.plot)
        if path:
            print(f"loss curves: {path}")
    inspected = {r["recipe"]: r["inspect"]["rows"] for r in results if r.get("inspect")}
    if len(inspected) > 1:
        print()
        print(te_inspect.compare_table(inspected))
        path = write_report(inspected, Path(args.inspect) / "report.png")
        if path:
            print(f"inspection report: {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
