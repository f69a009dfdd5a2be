"""Where a layer step's GPU time goes: its kernels, from a ``jax.profiler`` trace.

Builds the training step of ``bench_layers.py`` (forward + backward of one
te_jax layer, or of flax.linen's bf16 version) for each wanted variant, runs it
``--steps`` times under ``jax.profiler.trace`` and sums the GPU kernels' time
per step by kernel name, grouped into the GEMMs (cuBLAS/cuBLASLt), te_jax's
own kernels (named in csrc/cuda) and XLA's fusions. The sum of the kernels'
time is the GPU's busy time; the step's wall time is printed beside it, so a
gap between them shows launch or host overhead.

This is a diagnostic, not a timing to quote: the profiler's own overhead
stretches each kernel a little. bench_layers.py gives the step times.

Usage: python benchmarks/bench_profile.py [--out r.json] [--md r.md] [--sections mlp]
       [--only REGEX] [--steps 5] [--top 25] [--quick]
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import tempfile
import time

import jax

import bench_layers as bl
from timing import selected, write_results

COLLECTIVE_PATTERN = re.compile(r"nccl", re.IGNORECASE)
ATTENTION_PATTERN = re.compile(r"flash|fmha|sdpa|attention", re.IGNORECASE)
GEMM_PATTERN = re.compile(r"gemm|nvjet|sm90_xmma|cutlass|cublas|xmma", re.IGNORECASE)
TE_PATTERN = re.compile(r"te_jax|Kernel<|Kernel$|Kernel\(")
CATEGORIES = ("gemm", "attention", "te_jax", "collective", "xla")


def category(name: str) -> str:
    """One of ``CATEGORIES`` for a kernel name: NCCL collectives, cuDNN's fused attention (before the GEMMs:
    its names may say gemm), cuBLAS/cuBLASLt/CUTLASS GEMMs, te_jax's kernels (their names end in Kernel), and
    ``xla``: XLA's fusions, copies and reductions."""
    if COLLECTIVE_PATTERN.search(name):
        return "collective"
    if ATTENTION_PATTERN.search(name):
        return "attention"
    if GEMM_PATTERN.search(name):
        return "gemm"
    if TE_PATTERN.search(name):
        return "te_jax"
    return "xla"


def short_name(name: str) -> str:
    """A kernel name without namespaces and its parameter list (``void te_jax::cuda::fused::CastTileKernel<
    te_jax::cuda::(anonymous namespace)::ActFwdProducer<te_jax::cuda::Bf16>, 1>(...)`` ->
    ``CastTileKernel<ActFwdProducer<Bf16>, 1>``), so that instantiations stay apart by their arguments."""
    name = re.sub(r"\(anonymous namespace\)::|_GLOBAL__N_[0-9A-Za-z_]+::", "", name)
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"[A-Za-z_][A-Za-z_0-9]*::", "", name)
    if name.endswith(")") and "(" in name:
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    return name[:100]


def kernel_events(trace_dir: pathlib.Path) -> list[dict]:
    """The GPU kernel events (``ph == "X"`` on a ``/device:GPU`` process's stream threads) of the newest trace."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RuntimeError(f"no *.trace.json.gz under {trace_dir}: the profiler wrote no trace")
    with gzip.open(files[-1], "rb") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    gpu = {pid for pid, name in procs.items() if "/device:GPU" in name}
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu:
            continue
        thread = threads.get((e["pid"], e.get("tid")), "")
        if not thread.lower().startswith("stream"):
            continue  # the "XLA Ops" / "XLA Modules" lines repeat the kernels' time
        out.append({"name": e["name"], "dur_us": float(e.get("dur", 0.0)), "thread": thread})
    if not out and jax.devices()[0].platform == "gpu":
        seen = sorted({f"{procs.get(pid, pid)} / {name}" for (pid, _), name in threads.items()})
        raise RuntimeError(f"no GPU kernel events in {files[-1].name} (CUPTI tracing unavailable?); "
                           f"its threads: {seen[:20]}")
    return out


def profile_step(step, sets, steps: int) -> tuple[list[dict], float]:
    """Kernel events of ``steps`` calls of ``step`` under the profiler, and the wall ms per step."""
    for _ in range(3):
        jax.block_until_ready(step(*sets[0]))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            start = time.perf_counter()
            out = None
            for i in range(steps):
                out = step(*sets[i % len(sets)])
            jax.block_until_ready(out)
            wall_ms = (time.perf_counter() - start) * 1e3 / steps
        events = kernel_events(pathlib.Path(tmp))
    return events, wall_ms


SHORT_KERNEL_US = 10.0  # kernels shorter than this mostly cost their launch


def summarize(events: list[dict], steps: int) -> dict:
    """Per-step totals by category and by kernel (ms, calls), the kernel launches, and the short kernels among
    them (``SHORT_KERNEL_US``: count and ms)."""
    by_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    by_cat: dict[str, float] = collections.defaultdict(float)
    for e in events:
        k = by_kernel[(category(e["name"]), short_name(e["name"]))]
        k[0] += e["dur_us"]
        k[1] += 1
        by_cat[category(e["name"])] += e["dur_us"]
    kernels = [dict(category=c, kernel=n, ms=us / steps / 1e3, calls=cnt / steps)
               for (c, n), (us, cnt) in by_kernel.items()]
    kernels.sort(key=lambda k: -k["ms"])
    short = [e["dur_us"] for e in events if e["dur_us"] < SHORT_KERNEL_US]
    return dict(busy_ms=sum(by_cat.values()) / steps / 1e3,
                categories={c: us / steps / 1e3 for c, us in sorted(by_cat.items())}, kernels=kernels,
                launches=len(events) / steps, short_launches=len(short) / steps, short_ms=sum(short) / steps / 1e3)


def kernel_table(title: str, kernels: list[dict], ms_digits: int = 3, kind: str = "kind") -> list[str]:
    """Markdown lines: a blank line, ``title``, a blank line, then a table of ``summarize``'s ``kernels``.

    ``ms_digits``: the decimals of the ms column; ``kind``: the header of the category column.
    """
    return ["", title, "", f"| kernel | {kind} | ms | calls |", "|---|---|---|---|",
            *(f"| `{k['kernel']}` | {k['category']} | {k['ms']:.{ms_digits}f} | {k['calls']:g} |" for k in kernels)]


def markdown(rows: list[dict], top: int) -> str:
    lines = ["| section | variant | wall ms/step (profiled) | GPU busy ms | " + " | ".join(f"{c} ms" for c in CATEGORIES)
             + " |", "|---" * (len(CATEGORIES) + 4) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['section']} | {r['name']} | - | - | " + " | ".join("-" for _ in CATEGORIES[1:])
                         + f" | {r['error'][:100]} |")
            continue
        c = r["categories"]
        lines.append(f"| {r['section']} | {r['name']} | {r['wall_ms']:.3f} | {r['busy_ms']:.3f} | "
                     + " | ".join(f"{c.get(k, 0):.3f}" for k in CATEGORIES) + " |")
    for r in rows:
        if "error" in r:
            continue
        lines += kernel_table(f"**{r['section']}, {r['name']}**: top {top} kernels per step", r["kernels"][:top],
                              ms_digits=4)
    return "\n".join(lines)


def main() -> int:
    p = bl.layer_parser(__doc__.splitlines()[0], "mlp", "bf16 flax$|te (delayed|current)$")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per variant")
    p.add_argument("--top", type=int, default=25, help="kernels listed per variant")
    args = p.parse_args()
    t, h, n = bl.step_shape(args)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, T={t} H={h} N/F={n}")
    rows = []
    for section in [s for s in args.sections.split(",") if s]:
        sets = bl._step_inputs(section, t, h, n, jax.random.key(0))
        for name, impl, arg in selected(bl._variants(section, ""), args.only):
            row = dict(section=section, name=name)
            rows.append(row)
            try:
                step = bl._build_step(row, section, h, n, impl, arg, sets, args)
                events, wall_ms = profile_step(step, sets, args.steps)
                row.update(wall_ms=wall_ms, **summarize(events, args.steps))
                del step
            except Exception as err:  # noqa: BLE001 (diagnostic: report and continue)
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"  {section} {name}: " + (row.get("error") or
                  f"busy {row['busy_ms']:.3f} ms/step ({', '.join(f'{c} {v:.3f}' for c, v in row['categories'].items())})"),
                  flush=True)
    md = markdown(rows, args.top)
    print(md)
    device = jax.devices()[0].device_kind
    write_results(args.out, args.md, dict(device=device, jax=jax.__version__, rows=rows),
                  f"# te_jax step profile ({device})\n\n{md}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
