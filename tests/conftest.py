"""Test-session set-up: one XLA compilation cache for the session's pytest workers.

The suite is mostly XLA compilation, and many tests compile the same
computation (a reference function at a shape another test also uses). A
compilation cache keyed by the computation lets each worker reuse what any
worker of the same run has compiled. The cache lives in a folder of this run
only (pytest-xdist gives its workers one run id), so no run sees another
run's executables. Subprocesses the tests start are not affected.

``--progress-log PATH`` appends one JSON line per test outcome to PATH as it
happens (the node id, its outcome, seconds, and for a failure the crash line
and the traceback), so a run stopped before pytest's final report still
says what failed and why (tools/gpu_check.py reads it).
"""

import json
import os
import sys
import tempfile
import uuid

import jax
import pytest

LOGGED_TRACEBACK_CHARS = 6000


def pytest_addoption(parser):
    parser.addoption("--progress-log", metavar="PATH", default=None,
                     help="append a JSON line per test outcome to PATH as the run goes")


def pytest_configure(config):
    path = config.getoption("--progress-log")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(ProgressLog(path), "te_jax_progress_log")
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
    jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), f"te_jax_tests_{run_id}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# The tests live in one folder per floor (tests/ops, tests/core, ...); the helpers they share
# (qtest_util, fp8_models, moe_util, norm_act_util) sit in tests/ and the fake-device scripts in
# tests/multidevice, whichever folder a test runs from.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in (_TESTS, os.path.join(_TESTS, "multidevice")):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)



class ProgressLog:
    """The ``--progress-log`` plugin, registered in the process that reports (the xdist controller, or the only one).

    Attributes:
        path: the JSON-lines file it appends to.
    """

    def __init__(self, path: str):
        self.path = path

    def _append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        del node
        self._append({"collected": len(ids)})

    def pytest_collection_finish(self, session):
        self._append({"collected": len(session.items)})

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and report.outcome == "passed":
            return  # setup and teardown are logged only when they fail or skip
        record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                  "seconds": round(report.duration, 3)}
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            record["message"] = crash.message if crash is not None else str(report.longrepr).splitlines()[-1]
            record["traceback"] = str(report.longrepr)[-LOGGED_TRACEBACK_CHARS:]
        self._append(record)
