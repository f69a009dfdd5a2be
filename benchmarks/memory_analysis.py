"""bench_memory.py's measuring half: XLA's memory analysis of a compiled step, the saved residuals, the device's
measured peak, the values live at the peak of XLA's buffer assignment, and the markdown table."""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from pathlib import Path

import jax

import te_jax
from memory_variants import Variant, attention

GIB = 2**30
# The row each case's temporaries are compared with: the first of these the case has.
BASELINE = {"mlp": ("bf16 flax.linen",), "moe": ("bf16 einsum cap 1.0",),
            "gpt": ("bf16 flax.linen", "te bf16 (autocast off)")}


def memory_row(compiled) -> dict:
    """XLA's memory analysis of a compiled step, in GiB (total: arguments + temporaries + outputs - aliased)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    row = {"temp_gib": m.temp_size_in_bytes / GIB, "argument_gib": m.argument_size_in_bytes / GIB,
           "output_gib": m.output_size_in_bytes / GIB, "alias_gib": m.alias_size_in_bytes / GIB}
    row["total_gib"] = row["argument_gib"] + row["temp_gib"] + row["output_gib"] - row["alias_gib"]
    host = getattr(m, "host_temp_size_in_bytes", 0) or 0
    if host:
        row["host_temp_gib"] = host / GIB
    return row


def residuals(loss: Callable, arg, top: int = 0) -> tuple[float, list]:
    """GiB of the values ``loss`` keeps for its backward that are not its argument (activations), and the
    ``top`` largest grouped by where they come from."""
    from jax._src.ad_checkpoint import saved_residuals

    groups = collections.Counter()
    total = 0
    for aval, source in saved_residuals(loss, arg):
        if "from the argument" in source:
            continue
        nbytes = aval.size * aval.dtype.itemsize
        total += nbytes
        where = re.sub(r"TransformerLayer_\d+", "TransformerLayer_*", source.split(" from ")[-1])
        groups[f"{aval.str_short()} {where}"] += nbytes
    return total / GIB, [(k, v / GIB) for k, v in groups.most_common(top)]


def module_name(variant: Variant) -> str:
    return "step_" + re.sub(r"\W+", "_", variant.key).strip("_").lower()[:80]


def analyze(variant: Variant, attention_kind: str, breakdown: bool) -> dict:
    """Compiles ``variant`` on abstract inputs and returns its memory row (nothing is allocated)."""
    name = module_name(variant)
    with attention(attention_kind):
        built = variant.build(True)
        row = memory_row(built.jitted(name).lower(*built.args).compile())
        if built.loss is not None:
            try:
                with te_jax.train.fp8_state_updates():
                    row["residual_gib"], row["top_residuals"] = residuals(built.loss, built.args[0],
                                                                          10 if breakdown else 0)
            except Exception as err:  # noqa: BLE001  (the analysis is an extra: report, go on)
                row["residual_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    row["module"] = name
    return row


def compiled_total_gib(variant: Variant) -> float:
    """The compiled step's arguments + temporaries + outputs - aliased, in GiB (abstract inputs, as ``analyze``)."""
    built = variant.build(True)
    return memory_row(built.jitted(module_name(variant)).lower(*built.args).compile())["total_gib"]


def largest_batch(variant: Variant, limit_gib: float, attention_kind: str, start: int,
                  max_compiles: int = 8, known: dict[int, float] | None = None) -> dict:
    """The largest batch (sequences) whose compiled step fits ``limit_gib`` by XLA's memory analysis (what
    examples/gpt/train.py's memory check compares with the device's limit), from a line through the totals at
    ``start`` and ``start + 8`` checked by compiling at the batch it predicts and the next one.

    Returns ``{"largest_batch": b, "largest_batch_gib": total at b, "largest_batch_compiles": n}``, b = 0
    when not even batch 1 fits; or ``{"largest_batch_error": why}`` after ``max_compiles`` compiles.
    ``known`` holds totals already compiled (batch -> GiB), e.g. the analysis at ``start``.
    """
    totals: dict[int, float] = dict(known or {})

    def total(b: int) -> float:
        if b not in totals:
            with attention(attention_kind):
                totals[b] = compiled_total_gib(variant.at_batch(b))
            print(f"    batch {b}: {totals[b]:.3f} GiB (limit {limit_gib:.3f})", flush=True)
        return totals[b]

    lo, hi = start, start + 8
    slope = (total(hi) - total(lo)) / (hi - lo)
    b = max(1, int(lo + (limit_gib - total(lo)) / slope)) if slope > 0 else hi
    while len(totals) < max_compiles:
        if total(b) > limit_gib:
            if b == 1:
                return {"largest_batch": 0, "largest_batch_compiles": len(totals)}
            b -= 1
        elif total(b + 1) <= limit_gib:
            b += 1
        else:
            return {"largest_batch": b, "largest_batch_gib": totals[b], "largest_batch_compiles": len(totals)}
    return {"largest_batch_error": f"no answer in {max_compiles} compiles: {sorted(totals.items())}"}


def measure(variant: Variant, steps: int) -> dict:
    """Initializes ``variant`` on the device, compiles, runs ``steps`` steps and reads the device's peak."""
    device = jax.local_devices()[0]
    built = variant.build(False)
    compiled = built.jitted(module_name(variant)).lower(*built.args).compile()
    row = {"device": device.device_kind, **memory_row(compiled)}
    stats = device.memory_stats() or {}
    row["resident_gib"] = stats.get("bytes_in_use", 0) / GIB
    args = built.args
    try:
        for _ in range(steps):
            out = compiled(*args)
            jax.block_until_ready(out)
            if built.advance is not None:
                args = built.advance(args, out)
    except jax.errors.JaxRuntimeError as err:
        row["error"] = str(err).strip().splitlines()[0][:300]
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        row["peak_gib"] = stats["peak_bytes_in_use"] / GIB
        row["limit_gib"] = stats.get("bytes_limit", 0) / GIB
    return row


# ---- where the memory goes (--breakdown) -----------------------------------------------------------------


def live_at_peak(dump_dir: str, module: str, top: int = 15) -> list[tuple[str, float]]:
    """The ``top`` largest groups of values live at the peak of ``module``'s buffer assignment in ``dump_dir``
    (``--xla_dump_to``), grouped by shape and the op (layer index dropped) that made them, in GiB."""
    found = sorted(Path(dump_dir).glob(f"*{module}*after_optimizations-buffer-assignment.txt"))
    if not found:
        return []
    text = found[-1].read_text()
    live_text = found[-1].with_name(found[-1].name.replace("buffer-assignment", "live-range")).read_text()
    hlo = found[-1].with_name(found[-1].name.replace("-buffer-assignment", "")).read_text()
    sizes, temp, in_temp = {}, set(), False
    for line in text.splitlines():
        if line.startswith("allocation"):
            in_temp = not any(w in line for w in ("parameter", "constant", "output"))
            continue
        m = re.match(r"\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)", line)
        if m:
            name = m.group(1).removesuffix("{}")
            sizes[name] = (int(m.group(2)), m.group(3).split("{")[0])
            if in_temp:
                temp.add(name)
    ranges = {}
    for line in live_text.split("BufferLiveRange:")[-1].splitlines():
        m = re.match(r"\s*(\S+):(\d+)-(\d+)", line)
        if m and m.group(1).removesuffix("{}") in temp:
            ranges[m.group(1).removesuffix("{}")] = (int(m.group(2)), int(m.group(3)))
    ops = {m.group(1): m.group(2) for m in re.finditer(r'%?([\w.\-]+) = [^\n]*?op_name="([^"]*)"', hlo)}
    events = collections.Counter()
    for v, (a, b) in ranges.items():
        events[a] += sizes[v][0]
        events[b + 1] -= sizes[v][0]
    live, best, at = 0, -1, 0
    for t in sorted(events):
        live += events[t]
        if live > best:
            best, at = live, t
    groups = collections.Counter()
    for v, (a, b) in ranges.items():
        if a <= at <= b:
            op = re.sub(r"TransformerLayer_\d+", "TransformerLayer_*", ops.get(v.split("{")[0], "?"))
            op = re.sub(r"^jit\([^)]*\)/", "", op)[-90:]
            groups[f"{sizes[v][1]} {op}"] += sizes[v][0]
    return [(k, n / GIB) for k, n in groups.most_common(top)]


# ---- the table -------------------------------------------------------------------------------------------


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    return "" if value is None else f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"


def markdown(rows: list[dict], analysis_only: bool, platform: str) -> str:
    measured = not analysis_only
    head = ["section", "case", "variant", "temp GiB", "vs baseline", "args GiB", "out GiB", "aliased GiB",
            "total GiB", "residuals GiB"] + (["per block GiB", "est. at preset depth"] if any(
                "per_block_gib" in r for r in rows) else []) + (["peak GiB (measured)"] if measured else []) + (
                ["largest batch (GiB)"] if any("largest_batch" in r or "largest_batch_error" in r for r in rows)
                else [])
    title = ("XLA's memory analysis of the compiled step on the CPU (abstract inputs; see the script's doc for what "
             "differs from a GPU)" if platform == "cpu" else f"{platform}: compiled memory analysis"
             + (" and the measured peak" if measured else ""))
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {}  # (section, case) -> (rank in BASELINE, temporaries)
    for r in rows:
        names, key = BASELINE[r["section"]], (r["section"], r["case"])
        if r["variant"] in names and r.get("temp_gib") and names.index(r["variant"]) < base.get(key, (9, 0))[0]:
            base[key] = (names.index(r["variant"]), r["temp_gib"])
    for r in rows:
        b = base.get((r["section"], r["case"]), (0, None))[1]
        ratio = f"{r['temp_gib'] / b:.2f}x" if b and r.get("temp_gib") is not None else ""
        cells = [r["section"], r["case"], r["variant"], _cell(r, "temp_gib"), ratio, _cell(r, "argument_gib"),
                 _cell(r, "output_gib"), _cell(r, "alias_gib"), _cell(r, "total_gib"), _cell(r, "residual_gib")]
        if "per block GiB" in head:
            cells += [_cell(r, "per_block_gib"), _cell(r, "estimate_gib")]
        if measured:
            cells.append(r.get("error", "")[:60] or _cell(r, "peak_gib"))
        elif r.get("error"):
            cells[3] = r["error"][:60]
        if "largest batch (GiB)" in head:
            cells.append(f"{r['largest_batch']} ({r.get('largest_batch_gib', 0):.2f})" if "largest_batch" in r
                         else r.get("largest_batch_error", "")[:60])
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("live_at_peak") or r.get("top_residuals"):
            lines += ["", f"**{r['case']}, {r['variant']}**: values live at the peak (GiB, by op) / saved residuals"]
            lines += [f"- {n:.3f} {k}" for k, n in r.get("live_at_peak", [])]
            lines += [f"- residual {n:.3f} {k}" for k, n in r.get("top_residuals", [])]
    return "\n".join(lines) + "\n"


def add_per_block(rows: list[dict]) -> None:
    """For GPT cases compiled at 2 and 4 blocks: temporaries per block and the estimate at the preset's depth."""
    from examples.gpt.presets import PRESETS as GPT_PRESETS

    at = {(r["case"], r["variant"]): r for r in rows if r["section"] == "gpt"}
    for (case, variant), r in at.items():
        m = re.match(r"GPT (\S+) @ 4 blocks", case)
        two = at.get((case.replace("@ 4 blocks", "@ 2 blocks"), variant))
        if m and two and "temp_gib" in r and "temp_gib" in two:
            per = (r["temp_gib"] - two["temp_gib"]) / 2
            r["per_block_gib"] = per
            r["estimate_gib"] = two["temp_gib"] + per * (GPT_PRESETS[m.group(1)].model.layers - 2)
