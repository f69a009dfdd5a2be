"""Test-session set-up: one XLA compilation cache for the session's pytest workers.

The suite is mostly XLA compilation, and many tests compile the same
computation (a reference function at a shape another test also uses). A
compilation cache keyed by the computation lets each worker reuse what any
worker of the same run has compiled. The cache lives in a folder of this run
only (pytest-xdist gives its workers one run id), so no run sees another
run's executables. Subprocesses the tests start are not affected.
"""

import os
import sys
import tempfile
import uuid

import jax


def pytest_configure(config):
    del config
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
