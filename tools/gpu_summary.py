"""Merges the GPU check's jobs, test results, benchmark tables, training runs and multi-GPU checks
into summary.json and summary.md."""

from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ET


def test_counts(junit: pathlib.Path) -> dict:
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
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def table(rows: list[dict], columns: list[str]) -> list[str]:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]


def main(out: pathlib.Path) -> None:
    summary = {
        "tests": test_counts(out / "junit.xml"),
        "benchmarks": {},
        "jobs": json_lines(out / "jobs.log"),
        "training": json_lines(out / "train.log"),
        "multi_gpu": json_lines(out / "multi_gpu.log"),
    }
    md = ["# te_jax GPU check", ""]
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
    if summary["training"]:
        columns = ["recipe", "run", "preset", "steps", "final_train_loss", "final_eval_loss", "tokens_per_s", "gpu"]
        if any("overhead" in row for row in summary["training"]):  # runs with --inspect: the example's timing
            columns += ["step_ms", "inspect_step_ms", "overhead"]
        md += ["", "## training", ""] + table(summary["training"], columns)
    if summary["multi_gpu"]:
        md += ["", "## multi-GPU", ""] + [json.dumps(row) for row in summary["multi_gpu"]]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
