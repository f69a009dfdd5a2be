"""Merges the GPU check's results into summary.json and summary.md (used by tools/gpu_check.py).

Reads from the output folder: jobs.log (one JSON line per job), tests.jsonl (the tests' progress log),
bench_*.json / bench_*.md (each benchmark run), train_*.json (each training run) and
multi_gpu.log (JSON lines of the mesh check).
"""

from __future__ import annotations

import json
import pathlib

# peak_memory_gib: the device's peak bytes in use over the run; step_memory_gib: XLA's analysis of the compiled
# train step (arguments + temporaries + outputs - donated), both from examples/gpt/train.py's --json.
TRAIN_COLUMNS = ["run", "recipe", "preset", "steps", "final_train_loss", "final_eval_loss", "tokens_per_s",
                 "peak_memory_gib", "step_memory_gib"]


def test_counts(progress_log: pathlib.Path) -> dict:
    """Counts of the tests' progress log (tests/conftest.py's ``--progress-log``), complete or cut short.

    Returns:
        ``ran`` False when there is no log; else the counts of collected, passed, failed (errors in set-up or
        teardown included) and skipped tests, ``complete`` (every collected test reported), the failures (at most
        50, each with its crash line), the 10 slowest tests and the seconds spent per test folder.
    """
    if not progress_log.exists():
        return {"ran": False}
    lines = json_lines(progress_log)
    collected = max((line["collected"] for line in lines if "collected" in line), default=0)
    reports = [line for line in lines if "test" in line]
    outcome: dict[str, str] = {}
    for r in reports:  # a test's worst report: a teardown failure after a passed call is a failure
        if outcome.get(r["test"]) != "failed":
            outcome[r["test"]] = r["outcome"]
    failed, listed = [], set()
    for r in reports:  # a test's first failure (a failed call may fail its teardown too)
        if r["outcome"] == "failed" and r["test"] not in listed:
            listed.add(r["test"])
            failed.append({"test": r["test"], "when": r["when"], "message": r["message"]})
    folders: dict[str, float] = {}
    for r in reports:
        folder = r["test"].split("::")[0].rsplit("/", 1)[0]
        folders[folder] = folders.get(folder, 0.0) + r["seconds"]
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    return {"ran": True, "collected": collected, "reported": len(outcome), **counts,
            "complete": len(outcome) >= collected > 0,
            "failures": failed[:50],
            "slowest": sorted(({"test": r["test"], "seconds": r["seconds"]} for r in reports),
                              key=lambda r: -r["seconds"])[:10],
            "seconds_per_folder": dict(sorted(folders.items(), key=lambda kv: -kv[1]))}


def test_lines(t: dict) -> list[str]:
    """The summary's markdown lines for ``test_counts``'s result."""
    done = "" if t["complete"] else f" (cut short: {t['reported']} of {t['collected']} reported)"
    md = [f"tests: {t['collected']} collected, {t['passed']} passed, {t['failed']} failed, "
          f"{t['skipped']} skipped{done}"]
    md += [f"- FAILED {f['test']} ({f['when']}): {f['message'].splitlines()[0][:300]}" for f in t["failures"]]
    if t["seconds_per_folder"]:
        md.append("- worker-seconds per folder: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                               t["seconds_per_folder"].items()))
        md.append("- slowest: " + ", ".join(f"{r['test']} {r['seconds']:.0f} s" for r in t["slowest"]))
    return md


def json_lines(path: pathlib.Path) -> list[dict]:
    """The JSON objects of a file's lines that start with "{" ([] when the file does not exist), less the record a
    killed process was writing (a line that does not parse)."""
    if not path.exists():
        return []
    objects = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                objects.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return objects


def table(rows: list[dict], columns: list[str]) -> list[str]:
    """A markdown table of ``rows`` with ``columns`` (missing cells empty)."""

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]


def training_rows(out: pathlib.Path) -> list[dict]:
    """One row per train_<job>.json that examples/gpt/train.py wrote (its first run)."""
    rows = []
    for path in sorted(out.glob("train_*.json")):
        result = json.loads(path.read_text())[0]
        rows.append({"run": path.stem.removeprefix("train_")} | {k: result.get(k) for k in TRAIN_COLUMNS[1:]})
    return rows


def summarize(out: pathlib.Path, header: list[str], extra: dict[str, tuple[object, list[str]]]) -> str:
    """Writes summary.json and summary.md under ``out`` and returns the markdown.

    Args:
        out: the output folder holding the jobs' results.
        header: markdown lines that open the summary (machine, software).
        extra: more sections, name -> (JSON value, markdown lines), placed after the benchmarks.
    """
    summary = {
        "jobs": json_lines(out / "jobs.log"),
        "tests": test_counts(out / "tests.jsonl"),
        "benchmarks": {},
        "training": training_rows(out),
        "multi_gpu": json_lines(out / "multi_gpu.log"),
    }
    md = ["# te_jax GPU check", ""] + header + [""]
    if summary["jobs"]:
        md += ["## jobs", ""] + table(summary["jobs"], ["job", "gpus", "rc", "seconds", "why"]) + [""]
    t = summary["tests"]
    if t["ran"]:
        md += test_lines(t)
    for path in sorted(out.glob("bench_*.json")):
        summary["benchmarks"][path.stem] = json.loads(path.read_text())
        bench_md = path.with_suffix(".md")
        if bench_md.exists():
            md += ["", f"## {path.stem}", "", bench_md.read_text().strip()]
    for name, (value, lines) in extra.items():
        summary[name] = value
        md += ["", f"## {name}", ""] + lines
    if summary["training"]:
        md += ["", "## training", ""] + table(summary["training"], TRAIN_COLUMNS)
    if summary["multi_gpu"]:
        md += ["", "## multi-GPU", ""] + [json.dumps(row) for row in summary["multi_gpu"]]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text)
    return text
