"""Set-up shared by every test file (and the subprocesses they start, which inherit the environment)."""

import os

# XLA's GPU emitters (scatter-add, some reductions) are deterministic only when asked, and the tests
# compare bits: a resumed run against an uninterrupted one, kernels against their reference.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
