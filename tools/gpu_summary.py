"""Merges the GPU check's test results and benchmark tables into summary.json and summary.md."""

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


def main(out: pathlib.Path) -> None:
    summary = {"tests": test_counts(out / "junit.xml"), "benchmarks": {}}
    md = ["# te_jax GPU check", ""]
    t = summary["tests"]
    if t["ran"]:
        md.append(f"tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped")
        md += [f"- FAILED {name}" for name in t["failed"]]
    for path in sorted(out.glob("bench_*.json")):
        summary["benchmarks"][path.stem] = json.loads(path.read_text())
        table = path.with_suffix(".md")
        if table.exists():
            md += ["", f"## {path.stem}", "", table.read_text().strip()]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
