"""Merges the GPU check's results into summary.json and summary.md (used by tools/gpu_check.py).

Reads from the output folder: jobs.log (one JSON line per job), junit.xml (the tests),
bench_*.json / bench_*.md (each benchmark run), train_*.json (each training run) and
multi_gpu.log (JSON lines of the mesh check).
"""

from __future__ import annotations

import json
import pathlib
import xml.etree.ElementTree as ET

# peak_memory_gib: the device's peak bytes in use over the run; step_memory_gib: XLA's analysis of the compiled
# train step (arguments + temporaries + outputs - donated), both from examples/gpt/train.py's --json.
TRAIN_COLUMNS = ["run", "recipe", "preset", "steps", "final_train_loss", "final_eval_loss", "tokens_per_s",
                 "peak_memory_gib", "step_memory_gib"]


def test_counts(junit: pathlib.Path) -> dict:
    """Counts of a pytest junit file, with the names of at most 50 failed tests."""
    if not junit.exists():
        return {"ran": False}
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "ran": True,
        "tests": int(suite.get("tests", 0)),
        "failures": int(suite.get("failures", 0)),
        "errors": int(suite.get("errors", 0)),
        "skipped": int(suite.get("skipped", 0)),
        "failed": failed[:50],
    }


def json_lines(path: pathlib.Path) -> list[dict]:
    """The JSON objects of a file's lines that start with "{" ([] when the file does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


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
        "tests": test_counts(out / "junit.xml"),
        "benchmarks": {},
        "training": training_rows(out),
        "multi_gpu": json_lines(out / "multi_gpu.log"),
    }
    md = ["# te_jax GPU check", ""] + header + [""]
    if summary["jobs"]:
        md += ["## jobs", ""] + table(summary["jobs"], ["job", "gpus", "rc", "seconds", "why"]) + [""]
    t = summary["tests"]
    if t["ran"]:
        md.append(f"tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped")
        md += [f"- FAILED {name}" for name in t["failed"]]
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
